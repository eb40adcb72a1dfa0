//! Device test of the `metrics` feature (docs/observability.md): an endpoint's exporter
//! publishes its driver counters and each connection's `ConnStats` through the `metrics`
//! facade, labelled with the connection's id; traffic moves them, and a connection's series
//! get their final values and `tokio_rdma_conn_open` 0 when it ends. Run with
//! `cargo test --features metrics --test metrics -- --ignored` (in the VM).
#![allow(clippy::print_stdout)]

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::within;
use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use metrics_util::registry::{AtomicStorage, Registry};
use tokio_rdma::Endpoint;
use tokio_rdma::conn::ConnectOptions;

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([192, 0, 2, 1], port))
}

/// A recorder that keeps each series' last value (metrics-util's recorder resets
/// every value it reads, so "stays at its final value" could not be told from "never
/// written"): metrics-util's registry of atomics, read without resetting.
#[derive(Clone)]
struct Latest(Arc<Registry<Key, AtomicStorage>>);

impl Recorder for Latest {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        self.0
            .get_or_create_counter(key, |c| Counter::from_arc(c.clone()))
    }

    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        self.0
            .get_or_create_gauge(key, |g| Gauge::from_arc(g.clone()))
    }

    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        self.0
            .get_or_create_histogram(key, |h| Histogram::from_arc(h.clone()))
    }
}

type Snapshotter = Latest;

/// The value of the series `name` whose labels include every one of `labels`.
fn value(snap: &Snapshotter, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let matches = |key: &Key| {
        key.name() == name
            && labels
                .iter()
                .all(|(lk, lv)| key.labels().any(|l| l.key() == *lk && l.value() == *lv))
    };
    let counter = snap
        .0
        .get_counter_handles()
        .into_iter()
        .find(|(k, _)| matches(k))
        .map(|(_, c)| c.load(Ordering::Acquire) as f64);
    counter.or_else(|| {
        snap.0
            .get_gauge_handles()
            .into_iter()
            .find(|(k, _)| matches(k))
            .map(|(_, g)| f64::from_bits(g.load(Ordering::Acquire)))
    })
}

/// How many series are called `name`.
fn series(snap: &Snapshotter, name: &str) -> usize {
    snap.0
        .get_counter_handles()
        .keys()
        .chain(snap.0.get_gauge_handles().keys())
        .filter(|k| k.name() == name)
        .count()
}

/// Waits (bounded) until the series `name` with `labels` satisfies `ok`.
async fn wait_value(
    snap: &Snapshotter,
    name: &str,
    labels: &[(&str, &str)],
    ok: impl Fn(f64) -> bool,
) -> f64 {
    within(60, name, async {
        loop {
            if let Some(v) = value(snap, name, labels).filter(|v| ok(*v)) {
                return v;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; run in the soft-RoCE VM (scripts/rxe-vm)"]
async fn traffic_moves_the_exported_connection_counters() {
    let snap = Latest(Arc::new(Registry::atomic()));
    metrics::set_global_recorder(snap.clone()).expect("the only recorder of this test binary");
    let ep = Endpoint::open(&common::device_name()).expect("endpoint");
    let exporter = ep
        .export_metrics(Duration::from_millis(100))
        .expect("export");
    assert!(
        ep.export_metrics(Duration::from_millis(100)).is_err(),
        "one exporter per endpoint at a time"
    );
    let device = ep.device_name().to_string();
    let listener = ep
        .listen_with(addr(7593), ConnectOptions::default())
        .await
        .expect("listen");
    let (client, server) = within(60, "connect", async {
        tokio::join!(
            ep.connect(addr(7593), ConnectOptions::default()),
            listener.accept()
        )
    })
    .await;
    let (client, server) = (client.expect("connect"), server.expect("accept"));
    let (cid, sid) = (client.id().to_string(), server.id().to_string());
    let c_labels = [("device", device.as_str()), ("conn_id", cid.as_str())];
    let s_labels = [("device", device.as_str()), ("conn_id", sid.as_str())];

    wait_value(&snap, "tokio_rdma_connections", &[], |v| v == 2.0).await;
    wait_value(&snap, "tokio_rdma_conn_open", &c_labels, |v| v == 1.0).await;
    let before = value(&snap, "tokio_rdma_conn_messages_sent_total", &c_labels).unwrap_or(0.0);
    assert_eq!(before, 0.0, "nothing sent yet");

    const N: usize = 20;
    const SIZE: usize = 1000;
    let echo = async {
        for _ in 0..N {
            let m = server.recv().await.expect("recv").expect("message");
            server.send(&m).await.expect("echo");
        }
    };
    let ping = async {
        let buf = vec![7u8; SIZE];
        for _ in 0..N {
            client.send(&buf).await.expect("send");
            let back = client.recv().await.expect("recv").expect("echo");
            assert_eq!(back.len(), SIZE);
        }
    };
    within(120, "ping-pong", async { tokio::join!(echo, ping) }).await;

    let want = N as f64;
    wait_value(
        &snap,
        "tokio_rdma_conn_messages_sent_total",
        &c_labels,
        |v| v == want,
    )
    .await;
    wait_value(
        &snap,
        "tokio_rdma_conn_messages_received_total",
        &s_labels,
        |v| v == want,
    )
    .await;
    wait_value(&snap, "tokio_rdma_conn_bytes_sent_total", &c_labels, |v| {
        v == (N * SIZE) as f64
    })
    .await;
    wait_value(
        &snap,
        "tokio_rdma_conn_bytes_received_total",
        &c_labels,
        |v| v == (N * SIZE) as f64,
    )
    .await;
    let pool = [("conn_id", cid.as_str()), ("pool", "conn_recv")];
    let recv_pool = client.stats().recv_pool.bytes_registered as f64;
    assert!(recv_pool > 0.0);
    wait_value(&snap, "tokio_rdma_pool_bytes_registered", &pool, |v| {
        v == recv_pool
    })
    .await;
    assert_eq!(
        series(&snap, "tokio_rdma_srq_buffers"),
        0,
        "no shared receive queue: no series"
    );
    let completions = wait_value(
        &snap,
        "tokio_rdma_driver_completions_total",
        &[("device", &device)],
        |v| {
            // Every message's receive completes (sends are signaled selectively).
            v >= (2 * N) as f64
        },
    )
    .await;
    println!("driver completions exported: {completions}");

    // The end: final values, `open` 0, and the endpoint's count back to 0.
    within(60, "close", client.close()).await.expect("close");
    assert!(server.recv().await.expect("eos").is_none());
    within(60, "server close", server.close())
        .await
        .expect("close");
    drop((client, server));
    wait_value(&snap, "tokio_rdma_conn_open", &c_labels, |v| v == 0.0).await;
    wait_value(&snap, "tokio_rdma_conn_open", &s_labels, |v| v == 0.0).await;
    wait_value(&snap, "tokio_rdma_connections", &[], |v| v == 0.0).await;
    assert_eq!(
        value(&snap, "tokio_rdma_conn_messages_sent_total", &c_labels),
        Some(want),
        "the final value stays"
    );
    assert_eq!(
        value(&snap, "tokio_rdma_conn_messages_received_total", &s_labels),
        Some(want)
    );
    // Dropping the exporter frees the endpoint for another one.
    drop(exporter);
    let again = ep.export_metrics(Duration::from_millis(100));
    assert!(again.is_ok(), "{again:?}");
}
