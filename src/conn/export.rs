//! Export of an [`Endpoint`](crate::Endpoint)'s counters through the [`metrics`](https://docs.rs/metrics)
//! facade (feature `metrics`): [`Endpoint::export_metrics`] starts a task that, every period,
//! copies [`DriverStats`], [`MemoryStats`], the shared receive queue's [`SrqStats`], every live
//! connection's [`ConnStats`] and the metrics of pools and registration caches handed to
//! [`MetricsExporter::watch_pool`] / [`MetricsExporter::watch_cache`] into the recorder the
//! application installed (Prometheus, StatsD, ...). Nothing on the data path changes: the
//! task reads the same snapshots [`Endpoint::stats`] and [`Connection::stats`] return.
//!
//! Every name, its kind and meaning is in `docs/observability.md`; the help texts are
//! registered with the recorder (`describe_*`) when the export starts.
//!
//! [`Connection::stats`]: crate::conn::Connection::stats
//! [`Endpoint::export_metrics`]: crate::Endpoint::export_metrics
//! [`Endpoint::stats`]: crate::Endpoint::stats

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ::metrics::{Counter, Gauge, Label};

use super::device::{Device, WeakDevice};
use super::endpoint_options::MemoryStats;
use super::observe::{ConnSnapshot, Registry};
use super::srq::SrqStats;
use super::stats::ConnStats;
use crate::buf::{CacheMetrics, Pool, PoolMetrics, RegCache};
use crate::driver::DriverStats;
use crate::error::{Error, InvalidArgument, Result};

/// A metric: its name, help text, and how to read it from a snapshot of `T`.
type Def<T> = (&'static str, &'static str, Read<T>);

/// Reads one value from a snapshot of `T`.
type Read<T> = fn(&T) -> f64;

/// Counter definitions of the endpoint's driver ([`DriverStats`]).
const DRIVER_COUNTERS: &[Def<DriverStats>] = &[
    (
        "tokio_rdma_driver_completions_total",
        "Work completions polled",
        |s| s.completions as f64,
    ),
    (
        "tokio_rdma_driver_cq_events_total",
        "CQ events read from the completion channel",
        |s| s.cq_events as f64,
    ),
    (
        "tokio_rdma_driver_empty_events_total",
        "CQ events after which the CQ was empty",
        |s| s.empty_events as f64,
    ),
    ("tokio_rdma_driver_polls_total", "ibv_poll_cq calls", |s| {
        s.polls as f64
    }),
    (
        "tokio_rdma_driver_doorbells_total",
        "ibv_post_send/ibv_post_recv calls",
        |s| s.doorbells as f64,
    ),
    (
        "tokio_rdma_driver_posted_total",
        "Work requests posted",
        |s| s.posted as f64,
    ),
    (
        "tokio_rdma_driver_unknown_completions_total",
        "Completions that matched no operation",
        |s| s.unknown as f64,
    ),
    (
        "tokio_rdma_driver_polled_in_place_total",
        "Times a waiting future polled the CQ itself",
        |s| s.polled_in_place as f64,
    ),
    (
        "tokio_rdma_driver_arms_total",
        "Times the completion task armed the CQ",
        |s| s.arms as f64,
    ),
    (
        "tokio_rdma_driver_last_wqe_reached_total",
        "IBV_EVENT_QP_LAST_WQE_REACHED events",
        |s| s.last_wqe_reached as f64,
    ),
    (
        "tokio_rdma_driver_last_wqe_timeouts_total",
        "SRQ queue pairs destroyed without the last-WQE event",
        |s| s.last_wqe_timeouts as f64,
    ),
];

/// Gauge definitions of the endpoint's driver.
const DRIVER_GAUGES: &[Def<DriverStats>] = &[
    (
        "tokio_rdma_driver_ops_in_table",
        "Operations in the driver's table now",
        |s| s.ops_in_table as f64,
    ),
    (
        "tokio_rdma_driver_queue_pairs",
        "Queue pairs registered with the driver now",
        |s| s.queue_pairs as f64,
    ),
];

/// The endpoint's memory budget ([`MemoryStats`]).
const MEMORY_GAUGES: &[Def<MemoryStats>] = &[
    (
        "tokio_rdma_memory_in_use_bytes",
        "Registered bytes the endpoint's connections hold in their pools",
        |s| s.in_use as f64,
    ),
    (
        "tokio_rdma_memory_budget_bytes",
        "The endpoint's memory budget (+Inf: none)",
        |s| s.budget.map_or(f64::INFINITY, |b| b as f64),
    ),
];
const MEMORY_COUNTERS: &[Def<MemoryStats>] = &[(
    "tokio_rdma_memory_refused_total",
    "Connections refused by the memory budget",
    |s| s.refused as f64,
)];

/// The shared receive queue ([`SrqStats`]).
const SRQ_GAUGES: &[Def<SrqStats>] = &[
    (
        "tokio_rdma_srq_buffers",
        "Buffers of the shared receive queue",
        |s| f64::from(s.buffers),
    ),
    (
        "tokio_rdma_srq_posted",
        "Receives on the shared receive queue now",
        |s| s.posted as f64,
    ),
    (
        "tokio_rdma_srq_connections",
        "Connections on the shared receive queue now",
        |s| f64::from(s.connections),
    ),
    (
        "tokio_rdma_srq_granted",
        "Receives granted to peers now",
        |s| s.granted as f64,
    ),
    (
        "tokio_rdma_srq_spare",
        "Buffers no connection has claimed",
        |s| s.spare as f64,
    ),
];
const SRQ_COUNTERS: &[Def<SrqStats>] = &[
    (
        "tokio_rdma_srq_refused_total",
        "Connections refused: the queue could not take their floor",
        |s| s.refused as f64,
    ),
    (
        "tokio_rdma_srq_limit_events_total",
        "Times the queue went below its low watermark",
        |s| s.limit_events as f64,
    ),
    (
        "tokio_rdma_srq_orphans_total",
        "Receive completions whose connection was gone",
        |s| s.orphans as f64,
    ),
];

/// A registered buffer pool ([`PoolMetrics`]), labelled `pool`.
const POOL_GAUGES: &[Def<PoolMetrics>] = &[
    (
        "tokio_rdma_pool_bytes_registered",
        "Bytes the pool registered",
        |m| m.bytes_registered as f64,
    ),
    (
        "tokio_rdma_pool_bytes_in_use",
        "Bytes of the pool's buffers handed out",
        |m| m.bytes_in_use as f64,
    ),
    (
        "tokio_rdma_pool_buffers_in_use",
        "The pool's buffers handed out",
        |m| m.buffers_in_use as f64,
    ),
    (
        "tokio_rdma_pool_waiters",
        "Tasks waiting for a buffer now",
        |m| m.waiters as f64,
    ),
];
const POOL_COUNTERS: &[Def<PoolMetrics>] = &[(
    "tokio_rdma_pool_waits_total",
    "Acquires that had to wait for a buffer",
    |m| m.waits as f64,
)];

/// A registration cache ([`CacheMetrics`]), labelled `cache`.
const CACHE_GAUGES: &[Def<CacheMetrics>] = &[
    (
        "tokio_rdma_cache_entries",
        "Ranges in the registration cache",
        |m| m.entries as f64,
    ),
    (
        "tokio_rdma_cache_bytes_registered",
        "Bytes the cache registered and still alive",
        |m| m.bytes_registered as f64,
    ),
    (
        "tokio_rdma_cache_bytes_in_use",
        "Bytes of cached registrations with leases",
        |m| m.bytes_in_use as f64,
    ),
];
const CACHE_COUNTERS: &[Def<CacheMetrics>] = &[
    (
        "tokio_rdma_cache_hits_total",
        "Lookups served from the cache",
        |m| m.hits as f64,
    ),
    (
        "tokio_rdma_cache_misses_total",
        "Lookups that had to register",
        |m| m.misses as f64,
    ),
    (
        "tokio_rdma_cache_registration_failures_total",
        "Failed registrations",
        |m| m.registration_failures as f64,
    ),
    (
        "tokio_rdma_cache_evictions_total",
        "Ranges evicted to stay within the budget",
        |m| m.evictions as f64,
    ),
];

/// One connection ([`ConnStats`]), labelled `conn_id` and `peer`.
const CONN_COUNTERS: &[Def<ConnStats>] = &[
    (
        "tokio_rdma_conn_messages_sent_total",
        "Messages sent",
        |s| s.protocol.messages_sent as f64,
    ),
    (
        "tokio_rdma_conn_messages_received_total",
        "Messages received",
        |s| s.protocol.messages_received as f64,
    ),
    (
        "tokio_rdma_conn_bytes_sent_total",
        "Payload bytes of the messages sent",
        |s| s.protocol.bytes_sent as f64,
    ),
    (
        "tokio_rdma_conn_bytes_received_total",
        "Payload bytes of the messages received",
        |s| s.protocol.bytes_received as f64,
    ),
    (
        "tokio_rdma_conn_sends_total",
        "SENDs (chunks and control messages)",
        |s| s.protocol.sends as f64,
    ),
    (
        "tokio_rdma_conn_receives_total",
        "Receives completed",
        |s| s.protocol.receives as f64,
    ),
    (
        "tokio_rdma_conn_credit_messages_total",
        "Credit messages and keepalives sent",
        |s| s.protocol.credit_messages as f64,
    ),
    (
        "tokio_rdma_conn_credit_waits_total",
        "Times a sender waited for a credit",
        |s| s.protocol.credit_waits as f64,
    ),
    (
        "tokio_rdma_conn_aborts_sent_total",
        "Sends cancelled part-way",
        |s| s.protocol.aborts_sent as f64,
    ),
    (
        "tokio_rdma_conn_aborts_received_total",
        "Partial messages the peer withdrew",
        |s| s.protocol.aborts_received as f64,
    ),
    (
        "tokio_rdma_conn_reposts_withheld_total",
        "Receives re-posted only once the application consumed",
        |s| s.protocol.reposts_withheld as f64,
    ),
    (
        "tokio_rdma_conn_rendezvous_sent_total",
        "Messages sent by rendezvous",
        |s| s.protocol.rendezvous_sent as f64,
    ),
    (
        "tokio_rdma_conn_rendezvous_received_total",
        "Messages received by rendezvous",
        |s| s.protocol.rendezvous_received as f64,
    ),
    (
        "tokio_rdma_conn_send_bytes_inline_total",
        "Message bytes sent inline",
        |s| s.send_bytes_inline as f64,
    ),
    (
        "tokio_rdma_conn_send_bytes_copied_total",
        "Message bytes copied into staging buffers",
        |s| s.send_bytes_copied as f64,
    ),
    (
        "tokio_rdma_conn_send_bytes_zero_copy_total",
        "Message bytes sent from registered memory",
        |s| s.send_bytes_zero_copy as f64,
    ),
    (
        "tokio_rdma_conn_recv_bytes_copied_total",
        "Received bytes the CPU copied",
        |s| s.recv_bytes_copied as f64,
    ),
    (
        "tokio_rdma_conn_recv_bytes_fetched_total",
        "Received bytes read by rendezvous",
        |s| s.recv_bytes_fetched as f64,
    ),
];
const CONN_GAUGES: &[Def<ConnStats>] = &[
    (
        "tokio_rdma_conn_recv_bytes_held",
        "Received bytes the application holds now",
        |s| s.recv_bytes_held as f64,
    ),
    (
        "tokio_rdma_conn_buffer_bytes_in_use",
        "Bytes of the connection's buffers in use now",
        |s| s.buffer_bytes_in_use as f64,
    ),
];

/// The connection's open gauge: 1 while it lives, 0 once it ended.
const CONN_OPEN: (&str, &str) = (
    "tokio_rdma_conn_open",
    "1 while the connection lives, 0 once it ended",
);
/// The endpoint's live connections.
const CONNECTIONS: (&str, &str) = (
    "tokio_rdma_connections",
    "Live message connections of the endpoint",
);

/// Handles of one group of metrics with the same labels.
struct Set<T> {
    counters: Vec<(Counter, Read<T>)>,
    gauges: Vec<(Gauge, Read<T>)>,
}

impl<T> Set<T> {
    fn new(counters: &'static [Def<T>], gauges: &'static [Def<T>], labels: &[Label]) -> Self {
        Set {
            counters: counters
                .iter()
                .map(|&(n, _, f)| (::metrics::counter!(n, labels.iter()), f))
                .collect(),
            gauges: gauges
                .iter()
                .map(|&(n, _, f)| (::metrics::gauge!(n, labels.iter()), f))
                .collect(),
        }
    }

    fn publish(&self, v: &T) {
        for (c, f) in &self.counters {
            // Counters are exact integers read from the snapshot.
            c.absolute(f(v) as u64);
        }
        for (g, f) in &self.gauges {
            g.set(f(v));
        }
    }
}

/// Registers the help texts of a group.
fn describe<T>(counters: &[Def<T>], gauges: &[Def<T>]) {
    for &(n, h, _) in counters {
        ::metrics::describe_counter!(n, h);
    }
    for &(n, h, _) in gauges {
        ::metrics::describe_gauge!(n, h);
    }
}

/// The series of one connection.
struct ConnSeries {
    stats: Set<ConnStats>,
    recv_pool: Set<PoolMetrics>,
    staging_pool: Set<PoolMetrics>,
    open: Gauge,
}

impl ConnSeries {
    fn new(c: &ConnSnapshot, base: &[Label]) -> ConnSeries {
        let mut labels = base.to_vec();
        labels.push(Label::new("conn_id", c.id.to_string()));
        labels.push(Label::new(
            "peer",
            c.peer
                .map_or_else(|| "unknown".to_string(), |p| p.to_string()),
        ));
        let pool = |name: &'static str| {
            let mut l = labels.clone();
            l.push(Label::new("pool", name));
            Set::new(POOL_COUNTERS, POOL_GAUGES, &l)
        };
        ConnSeries {
            recv_pool: pool("conn_recv"),
            staging_pool: pool("conn_staging"),
            open: ::metrics::gauge!(CONN_OPEN.0, labels.iter()),
            stats: Set::new(CONN_COUNTERS, CONN_GAUGES, &labels),
        }
    }

    fn publish(&self, s: &ConnStats, open: bool) {
        self.stats.publish(s);
        self.recv_pool.publish(&s.recv_pool);
        self.staging_pool.publish(&s.staging_pool);
        self.open.set(if open { 1.0 } else { 0.0 });
    }
}

/// Pools and caches handed to [`MetricsExporter::watch_pool`] / `watch_cache`.
#[derive(Default)]
struct Watched {
    pools: Vec<(String, Pool)>,
    caches: Vec<(String, RegCache)>,
}

/// The running export of an endpoint's metrics, started by
/// [`Endpoint::export_metrics`](crate::Endpoint::export_metrics).
/// Dropping it stops the export (the series keep their last values in the recorder).
///
/// Needs the crate feature `metrics`.
///
/// # Examples
///
/// ```no_run
/// use std::time::Duration;
/// # async fn demo(ep: tokio_rdma::Endpoint, pool: tokio_rdma::buf::Pool) -> tokio_rdma::Result<()> {
/// // A recorder installed beforehand (e.g. metrics-exporter-prometheus) receives the series.
/// let exporter = ep.export_metrics(Duration::from_secs(1))?;
/// exporter.watch_pool("requests", &pool);
/// // ... serve ...
/// drop(exporter); // stops the export
/// # Ok(()) }
/// ```
pub struct MetricsExporter {
    task: tokio::task::JoinHandle<()>,
    registry: Arc<Registry>,
    watched: Arc<Mutex<Watched>>,
}

impl MetricsExporter {
    /// Exports `pool`'s [`PoolMetrics`] too, as the `tokio_rdma_pool_*` series with the label
    /// `pool = name` (e.g. a connection's [`pool`](crate::conn::Connection::pool) or a pool of
    /// your own). The exporter keeps a handle of the pool (its memory stays registered) until
    /// the exporter is dropped.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn f(exporter: &tokio_rdma::MetricsExporter, conn: &tokio_rdma::conn::Connection) -> tokio_rdma::Result<()> {
    /// exporter.watch_pool(&format!("conn{}_user", conn.id()), conn.pool()?);
    /// # Ok(()) }
    /// ```
    pub fn watch_pool(&self, name: &str, pool: &Pool) {
        let mut w = self.watched.lock().unwrap_or_else(|e| e.into_inner());
        w.pools.push((name.to_string(), pool.clone()));
    }

    /// Exports `cache`'s [`CacheMetrics`] too, as the `tokio_rdma_cache_*` series with the
    /// label `cache = name`. The exporter keeps a handle of the cache until it is dropped.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn f(exporter: &tokio_rdma::MetricsExporter, cache: &tokio_rdma::buf::RegCache) {
    /// exporter.watch_cache("uploads", cache);
    /// # }
    /// ```
    pub fn watch_cache(&self, name: &str, cache: &RegCache) {
        let mut w = self.watched.lock().unwrap_or_else(|e| e.into_inner());
        w.caches.push((name.to_string(), cache.clone()));
    }
}

impl Drop for MetricsExporter {
    fn drop(&mut self) {
        self.task.abort();
        self.registry.stop_export();
    }
}

impl std::fmt::Debug for MetricsExporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsExporter")
            .field("running", &!self.task.is_finished())
            .finish_non_exhaustive()
    }
}

/// Starts the export of `dev`'s counters (`Endpoint::export_metrics_labeled`).
pub(crate) fn start(
    dev: &Device,
    period: Duration,
    labels: Vec<(&'static str, String)>,
) -> Result<MetricsExporter> {
    if period.is_zero() {
        return Err(Error::InvalidArgument(InvalidArgument::ZeroExportPeriod));
    }
    let registry = dev.conn_registry().clone();
    if !registry.start_export() {
        return Err(Error::InvalidArgument(InvalidArgument::ExporterRunning));
    }
    let mut base = vec![Label::new("device", dev.device_name().to_string())];
    base.extend(labels.into_iter().map(|(k, v)| Label::new(k, v)));
    let watched = Arc::new(Mutex::new(Watched::default()));
    let task = tokio::spawn(run(
        dev.downgrade(),
        registry.clone(),
        watched.clone(),
        base,
        period,
    ));
    Ok(MetricsExporter {
        task,
        registry,
        watched,
    })
}

/// The exporter's task.
async fn run(
    weak: WeakDevice,
    registry: Arc<Registry>,
    watched: Arc<Mutex<Watched>>,
    base: Vec<Label>,
    period: Duration,
) {
    describe(DRIVER_COUNTERS, DRIVER_GAUGES);
    describe(MEMORY_COUNTERS, MEMORY_GAUGES);
    describe(SRQ_COUNTERS, SRQ_GAUGES);
    describe(POOL_COUNTERS, POOL_GAUGES);
    describe(CACHE_COUNTERS, CACHE_GAUGES);
    describe(CONN_COUNTERS, CONN_GAUGES);
    ::metrics::describe_gauge!(CONN_OPEN.0, CONN_OPEN.1);
    ::metrics::describe_gauge!(CONNECTIONS.0, CONNECTIONS.1);
    let driver = Set::new(DRIVER_COUNTERS, DRIVER_GAUGES, &base);
    let memory = Set::new(MEMORY_COUNTERS, MEMORY_GAUGES, &base);
    let with = |k: &'static str, v: &str| {
        let mut l = base.clone();
        l.push(Label::new(k, v.to_string()));
        l
    };
    // The shared receive queue's series, made once it is seen (none without a queue).
    let mut srq: Option<(Set<SrqStats>, Set<PoolMetrics>)> = None;
    let connections = ::metrics::gauge!(CONNECTIONS.0, base.iter());
    let mut conns: HashMap<u64, ConnSeries> = HashMap::new();
    let mut pools: HashMap<String, Set<PoolMetrics>> = HashMap::new();
    let mut caches: HashMap<String, Set<CacheMetrics>> = HashMap::new();
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(ep) = weak.upgrade() else {
            break;
        };
        driver.publish(&ep.driver().stats());
        memory.publish(&ep.memory_stats());
        if let Some(s) = ep.shared_receive_stats() {
            let (q, pool) = srq.get_or_insert_with(|| {
                (
                    Set::new(SRQ_COUNTERS, SRQ_GAUGES, &base),
                    Set::new(POOL_COUNTERS, POOL_GAUGES, &with("pool", "srq")),
                )
            });
            q.publish(&s);
            pool.publish(&s.pool);
        }
        drop(ep);
        connections.set(registry.live() as f64);
        let snaps = registry.snapshot();
        let mut seen = std::collections::HashSet::with_capacity(snaps.len());
        for c in &snaps {
            seen.insert(c.id);
            let series = conns
                .entry(c.id)
                .or_insert_with(|| ConnSeries::new(c, &base));
            series.publish(&c.stats, c.open);
            if !c.open {
                conns.remove(&c.id);
            }
        }
        // Connections gone without a final report (their task ended with its runtime).
        conns.retain(|id, s| {
            let keep = seen.contains(id);
            if !keep {
                s.open.set(0.0);
            }
            keep
        });
        let (p, k) = {
            let w = watched.lock().unwrap_or_else(|e| e.into_inner());
            (w.pools.clone(), w.caches.clone())
        };
        for (name, pool) in p {
            pools
                .entry(name)
                .or_insert_with_key(|n| Set::new(POOL_COUNTERS, POOL_GAUGES, &with("pool", n)))
                .publish(&pool.metrics());
        }
        for (name, cache) in k {
            caches
                .entry(name)
                .or_insert_with_key(|n| Set::new(CACHE_COUNTERS, CACHE_GAUGES, &with("cache", n)))
                .publish(&cache.metrics());
        }
    }
    registry.stop_export();
}

#[cfg(test)]
mod tests {
    use super::*;
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    #[test]
    fn a_set_publishes_every_counter_and_gauge_of_a_snapshot() {
        let recorder = DebuggingRecorder::new();
        let snap = recorder.snapshotter();
        let m = PoolMetrics {
            bytes_registered: 4096,
            bytes_in_use: 1024,
            buffers_in_use: 1,
            waits: 7,
            ..PoolMetrics::default()
        };
        ::metrics::with_local_recorder(&recorder, || {
            let set = Set::new(POOL_COUNTERS, POOL_GAUGES, &[Label::new("pool", "p")]);
            set.publish(&m);
        });
        let got: HashMap<String, f64> = snap
            .snapshot()
            .into_vec()
            .into_iter()
            .map(|(k, _, _, v)| {
                let v = match v {
                    DebugValue::Counter(c) => c as f64,
                    DebugValue::Gauge(g) => g.into_inner(),
                    DebugValue::Histogram(_) => f64::NAN,
                };
                (k.key().name().to_string(), v)
            })
            .collect();
        assert_eq!(got["tokio_rdma_pool_bytes_registered"], 4096.0);
        assert_eq!(got["tokio_rdma_pool_bytes_in_use"], 1024.0);
        assert_eq!(got["tokio_rdma_pool_buffers_in_use"], 1.0);
        assert_eq!(got["tokio_rdma_pool_waits_total"], 7.0);
        assert_eq!(got.len(), POOL_COUNTERS.len() + POOL_GAUGES.len());
    }

    #[test]
    fn a_connection_series_carries_its_pools() {
        let recorder = DebuggingRecorder::new();
        let snap = recorder.snapshotter();
        let stats = ConnStats {
            recv_pool: PoolMetrics {
                bytes_registered: 5,
                ..PoolMetrics::default()
            },
            ..ConnStats::default()
        };
        let c = ConnSnapshot {
            id: 3,
            peer: None,
            stats,
            open: true,
        };
        ::metrics::with_local_recorder(&recorder, || {
            ConnSeries::new(&c, &[]).publish(&c.stats, true);
        });
        let v: Vec<_> = snap
            .snapshot()
            .into_vec()
            .into_iter()
            .filter(|(k, ..)| {
                k.key().name() == "tokio_rdma_pool_bytes_registered"
                    && k.key().labels().any(|l| l.value() == "conn_recv")
            })
            .map(|(.., v)| v)
            .collect();
        assert_eq!(v, [DebugValue::Gauge(5.0.into())]);
    }
}
