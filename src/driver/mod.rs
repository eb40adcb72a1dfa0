//! The Tokio shell: a [`Driver`] owns a completion queue, the engine of every operation
//! future (post, then poll the CQ in place and spin or sleep as the [`CompletionMode`] says),
//! and the tasks for what nobody polls; it creates [`AsyncQp`]s whose operations are futures.
//! An [`Endpoint`](crate::Endpoint) owns one; use [`Endpoint::driver`](crate::Endpoint::driver)
//! for raw queue pairs next to connections.
//!
//! # Examples
//!
//! ```no_run
//! use tokio_rdma::driver::{Driver, DriverOptions, QpOptions};
//! use tokio_rdma::verbs::{Context, ProtectionDomain};
//!
//! # async fn demo() -> tokio_rdma::Result<()> {
//! let (ctx, port) = Context::open_first_active()?;
//! let pd = ProtectionDomain::new(&ctx)?;
//! let driver = Driver::new(&ctx, DriverOptions::default())?;
//! let qp = driver.create_qp(&pd, QpOptions::default())?;
//! // Connect `qp.verbs()` to a peer (RTR/RTS), then:
//! // let (res, buf) = qp.send(buf).await;
//! # Ok(()) }
//! ```

mod completion;
mod events;
mod post;
mod qp;
mod raw;
mod shared;
mod spinners;
mod wait;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tracing::debug;

pub use qp::AsyncQp;
pub(crate) use raw::{OpConfig, RawOp};
pub(crate) use shared::{Deferred, Shared, Sink, srq_wr_id};
pub(crate) use wait::{WaitKind, Waiter, wait_until};

/// Runs `f`, which may block in the kernel (destroying a queue pair or an RDMA CM id), on the
/// runtime's blocking pool when called on a runtime, so no worker thread stalls on it (a task
/// woken onto a stalled worker's next-task slot waits with it); inline otherwise.
pub(crate) fn off_runtime(f: impl FnOnce() + Send + 'static) {
    match tokio::runtime::Handle::try_current() {
        Ok(rt) => {
            rt.spawn_blocking(f);
        }
        Err(_) => f(),
    }
}

use crate::error::{Error, Result};
use crate::verbs::{
    CompletionChannel, CompletionQueue, Context, ProtectionDomain, QpCaps, SharedReceiveQueue,
};
use tokio::sync::Notify;

/// How a future waits for its completion (see `docs/architecture.md`, "Waiting").
///
/// In every mode a waiting future first polls the completion queue itself; the modes differ
/// in what it does when its completion is not there yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CompletionMode {
    /// Sleep at once; the completion task arms the CQ and wakes the future from the
    /// completion event: least CPU, an interrupt and a task wake per completion.
    Event,
    /// Keep polling (yielding to the runtime between polls) until the completion arrives:
    /// lowest latency; keeps a worker busy while operations are outstanding.
    BusyPoll,
    /// Hybrid polling (the default): spin for about twice the moving average of observed
    /// completion latency (at least a few microseconds, at most `max_spin`), then sleep as in
    /// `Event`; when the average exceeds `max_spin` (a slow peer), sleep at once.
    Adaptive {
        /// The longest a future spins before sleeping (default 500 µs: spinning pays while a
        /// wait is shorter than an event's wake-up, which on soft-RoCE under emulation costs
        /// some 150 µs; on hardware the averages, and so the spins, are far shorter).
        max_spin: Duration,
    },
}

impl Default for CompletionMode {
    fn default() -> Self {
        CompletionMode::Adaptive {
            max_spin: Duration::from_micros(500),
        }
    }
}

/// Options of a [`Driver`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct DriverOptions {
    /// Completion queue entries: bounds the sum of the queue depths of all queue pairs.
    pub cq_size: u32,
    /// How the completion task waits.
    pub mode: CompletionMode,
    /// Completions polled per `ibv_poll_cq` call.
    pub poll_batch: usize,
}

impl Default for DriverOptions {
    fn default() -> Self {
        DriverOptions {
            cq_size: 4096,
            mode: CompletionMode::default(),
            poll_batch: 32,
        }
    }
}

impl DriverOptions {
    /// Sets the completion mode.
    pub fn mode(mut self, mode: CompletionMode) -> Self {
        self.mode = mode;
        self
    }

    /// Sets the completion queue size.
    pub fn cq_size(mut self, n: u32) -> Self {
        self.cq_size = n;
        self
    }

    /// Sets how many completions one poll takes.
    pub fn poll_batch(mut self, n: usize) -> Self {
        self.poll_batch = n;
        self
    }
}

/// Options of an [`AsyncQp`].
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct QpOptions {
    /// Queue sizes (the device may grant more).
    pub caps: QpCaps,
    /// Request a completion every this many sends (1: every send). The last send of every
    /// post batch is always signaled.
    pub signal_every: u32,
    /// Defer posting to the next poll so that operations started in the same wake are posted
    /// together (one doorbell). Off: every operation is posted on its first poll.
    pub coalesce: bool,
    /// Send payloads up to the queue pair's `max_inline_data` inline.
    pub inline: bool,
    /// Send-queue entries the owner posts itself (a connection's message sends), kept out of
    /// the operation table's depth.
    pub(crate) sink_sends: u32,
}

impl Default for QpOptions {
    fn default() -> Self {
        QpOptions {
            caps: QpCaps {
                max_send_wr: 256,
                max_recv_wr: 256,
                max_send_sge: 4,
                max_recv_sge: 4,
                max_inline_data: 64,
            },
            signal_every: 16,
            coalesce: true,
            inline: true,
            sink_sends: 0,
        }
    }
}

/// Counters of a driver's completion machinery.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DriverStats {
    /// Work completions polled.
    pub completions: u64,
    /// CQ events read from the channel.
    pub cq_events: u64,
    /// CQ events after which the CQ turned out empty (normal; counts the arm/poll race).
    pub empty_events: u64,
    /// `ibv_poll_cq` calls.
    pub polls: u64,
    /// `ibv_post_send`/`ibv_post_recv` calls.
    pub doorbells: u64,
    /// Work requests posted.
    pub posted: u64,
    /// Completions that matched no operation.
    pub unknown: u64,
    /// Times a waiting future polled the CQ itself.
    pub polled_in_place: u64,
    /// Times the completion task armed the CQ for an event.
    pub arms: u64,
    /// Operations in the table now.
    pub ops_in_table: u64,
    /// Queue pairs registered with the driver, closing ones included (a dropped queue pair
    /// leaves once the device can produce no more completions for it).
    pub queue_pairs: u64,
    /// `IBV_EVENT_QP_LAST_WQE_REACHED` events for this driver's queue pairs on a shared
    /// receive queue (one closing is destroyed only after its event, or see
    /// [`last_wqe_timeouts`](Self::last_wqe_timeouts)).
    pub last_wqe_reached: u64,
    /// Queue pairs on a shared receive queue destroyed without that event, 2 s after they
    /// started closing (a provider that does not send it: soft-RoCE before Linux 6.5).
    pub last_wqe_timeouts: u64,
}

/// A completion queue with its machinery: the completion task and the async-event task. Cheap
/// to clone. Must be created inside a Tokio runtime (with the time driver enabled). Several
/// drivers may share a device context.
#[derive(Debug, Clone)]
pub struct Driver {
    inner: Arc<DriverInner>,
}

#[derive(Debug)]
struct DriverInner {
    shared: Arc<Shared>,
    ctx: Context,
    /// Dropped with the completion task: tells whether the task (and its runtime) still runs.
    alive: Arc<()>,
}

impl Drop for DriverInner {
    fn drop(&mut self) {
        // Queue pairs hold a driver clone, so none is open any more: stop the tasks once the
        // closing queue pairs have drained.
        self.shared.shutdown.store(true, Ordering::Release);
        self.shared.notify.notify_one();
        self.shared.notify_events.notify_one();
    }
}

impl Driver {
    /// Creates the completion queue and spawns the completion and async-event tasks on the
    /// current Tokio runtime.
    ///
    /// # Errors
    ///
    /// Verb errors creating the channel or CQ.
    ///
    /// # Panics
    ///
    /// If called outside a Tokio runtime.
    pub fn new(ctx: &Context, opts: DriverOptions) -> Result<Driver> {
        let channel = CompletionChannel::new(ctx)?;
        let cq = CompletionQueue::new(ctx, opts.cq_size, Some(&channel))?;
        cq.set_driven();
        let shared = Arc::new(Shared::new(cq, opts.mode, opts.poll_batch));
        let alive = Arc::new(());
        let token = alive.clone();
        let task = completion::run(shared.clone());
        let stop = StopOnDrop(shared.clone());
        tokio::spawn(async move {
            let _token = token;
            // Dropped with the task: when it ends, or when its runtime shuts down first.
            let _stop = stop;
            task.await;
        });
        tokio::spawn(events::run(ctx.clone(), Arc::downgrade(&shared)));
        debug!(device = ctx.name(), ?opts, "driver started");
        Ok(Driver {
            inner: Arc::new(DriverInner {
                shared,
                ctx: ctx.clone(),
                alive,
            }),
        })
    }

    /// Whether the completion task still runs (it stops when its runtime shuts down; the
    /// driver's queue pairs then fail with [`QpFailure::DriverStopped`](crate::QpFailure)).
    pub fn is_running(&self) -> bool {
        // The task holds one reference to `alive` and drops it when it ends or is dropped.
        Arc::strong_count(&self.inner.alive) > 1
    }

    /// The device context.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// Creates an RC queue pair that reports to this driver's CQ. Connect it with
    /// [`AsyncQp::verbs`] (INIT/RTR/RTS) before starting operations.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] if the CQ cannot take the queue pair's depths;
    /// [`Error::CreateQp`] from the device.
    pub fn create_qp(&self, pd: &ProtectionDomain, opts: QpOptions) -> Result<AsyncQp> {
        self.create_qp_on(pd, opts, None)
    }

    /// [`create_qp`](Self::create_qp), taking its receives from `srq` if given (whose
    /// completions this driver routes by queue-pair number: see [`srq_wr_id`]). The receive
    /// depth then reserves nothing in the completion queue (the SRQ's owner reserved its
    /// depth once, [`reserve_cq`](Self::reserve_cq)).
    pub(crate) fn create_qp_on(
        &self,
        pd: &ProtectionDomain,
        opts: QpOptions,
        srq: Option<&SharedReceiveQueue>,
    ) -> Result<AsyncQp> {
        let recv = if srq.is_some() {
            0
        } else {
            u64::from(opts.caps.max_recv_wr)
        };
        let need = u64::from(opts.caps.max_send_wr) + recv;
        self.try_reserve(need).map_err(|(used, cap)| {
            Error::InvalidArgument(format!(
                "completion queue of {cap} entries cannot take another queue pair of depth {need} \
                 ({used} already used; every queue pair reserves its send and receive depths): \
                 raise EndpointOptions::cq_size (or DriverOptions::cq_size) up to the \
                 device's max_cqe {}, use shallower queues (ConnectOptions::recv_credits, \
                 send_queue_depth), or open another Endpoint on the device",
                self.context().device_attr().max_cqe
            ))
        })?;
        match AsyncQp::create(self.clone(), pd, opts, srq, need) {
            Ok(qp) => Ok(qp),
            Err(e) => {
                self.release_budget(need);
                Err(e)
            }
        }
    }

    /// Reserves `n` completion-queue entries (a shared receive queue's depth), or explains
    /// why the completion queue cannot take them.
    pub(crate) fn reserve_cq(&self, n: u64) -> Result<()> {
        self.try_reserve(n).map_err(|(used, cap)| {
            Error::InvalidArgument(format!(
                "completion queue of {cap} entries cannot take {n} more ({used} already used): \
                 raise EndpointOptions::cq_size up to the device's max_cqe {}",
                self.context().device_attr().max_cqe
            ))
        })
    }

    /// Reserves `n` completion-queue entries, or returns (entries used, capacity).
    fn try_reserve(&self, n: u64) -> std::result::Result<(), (u64, u64)> {
        let mut budget = self.cq_budget();
        let cap = u64::from(self.inner.shared.cq.capacity());
        if *budget + n > cap {
            return Err((*budget, cap));
        }
        *budget += n;
        Ok(())
    }

    /// Routes the shared receive queue's completions whose queue pair is gone to `sink`, and
    /// returns the notifier signalled when the device reports the queue's limit reached.
    pub(crate) fn set_srq_sink(&self, sink: Arc<dyn Sink>) -> Arc<Notify> {
        self.inner.shared.lock().srq_sink = Some(sink);
        self.inner.shared.srq_limit.clone()
    }

    pub(crate) fn release_budget(&self, need: u64) {
        let mut budget = self.cq_budget();
        *budget = budget.saturating_sub(need);
    }

    /// The completion-queue entries reserved so far (locked).
    fn cq_budget(&self) -> std::sync::MutexGuard<'_, u64> {
        self.inner
            .shared
            .cq_budget
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.inner.shared
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> DriverStats {
        let c = &self.inner.shared.counters;
        let (ops, qps) = {
            let st = self.inner.shared.lock();
            (
                st.core.ops_in_table() as u64,
                st.qps.iter().flatten().count() as u64,
            )
        };
        DriverStats {
            completions: c.completions.load(Ordering::Relaxed),
            cq_events: c.cq_events.load(Ordering::Relaxed),
            empty_events: c.empty_events.load(Ordering::Relaxed),
            polls: c.polls.load(Ordering::Relaxed),
            doorbells: c.doorbells.load(Ordering::Relaxed),
            posted: c.posted.load(Ordering::Relaxed),
            unknown: c.unknown.load(Ordering::Relaxed),
            polled_in_place: c.polled_in_place.load(Ordering::Relaxed),
            arms: c.arms.load(Ordering::Relaxed),
            last_wqe_reached: c.last_wqe_reached.load(Ordering::Relaxed),
            last_wqe_timeouts: c.last_wqe_timeouts.load(Ordering::Relaxed),
            ops_in_table: ops,
            queue_pairs: qps,
        }
    }
}

/// Held by the completion task: when the task goes (its runtime shut down while queue pairs
/// were still in use), nothing would wake a waiting operation again, so the driver fails its
/// queue pairs and wakes every waiter ([`Shared::stop`]).
#[derive(Debug)]
struct StopOnDrop(Arc<Shared>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.stop();
    }
}
