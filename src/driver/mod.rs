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

mod batch;
mod channel_fd;
mod completion;
mod counters;
mod deferred;
mod events;
mod kick;
mod latency;
mod offload;
mod options;
mod post;
mod qp;
mod raw;
mod shared;
mod sink;
mod spinners;
mod state;
mod wait;
mod watch;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tracing::debug;

pub use batch::MAX_BATCH;
pub(crate) use batch::RawBatch;
pub(crate) use channel_fd::ChannelFd;
pub(crate) use deferred::{Deferred, Sink};
pub(crate) use latency::WaitKind;
pub(crate) use offload::off_runtime;
pub use options::{CompletionMode, DriverOptions, DriverStats, QpOptions};
pub use qp::AsyncQp;
pub(crate) use raw::{OpConfig, RawOp, Request};
pub(crate) use shared::Shared;
pub(crate) use sink::srq_wr_id;
pub(crate) use wait::{Waiter, wait_until};

use crate::error::{Error, InvalidArgument, Result};
use crate::verbs::{CompletionChannel, CompletionQueue, Context};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;

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
    /// [`Error::InvalidArgument`] for a `poll_batch` of 0 or above 4096 or an adaptive
    /// `max_spin` above one second (as [`EndpointOptions`](crate::EndpointOptions) refuses
    /// them); verb errors creating the channel or CQ.
    ///
    /// # Panics
    ///
    /// If called outside a Tokio runtime.
    pub fn new(ctx: &Context, opts: DriverOptions) -> Result<Driver> {
        opts.check().map_err(Error::InvalidArgument)?;
        let channel = CompletionChannel::new(ctx)?;
        let cq = CompletionQueue::new(ctx, opts.cq_size, Some(&channel))?;
        cq.set_driven();
        let fd = ChannelFd(channel);
        // SAFETY: `ChannelFd` owns a handle of the channel, so the descriptor stays open and
        // the same for the whole life of the AsyncFd.
        let registered = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) };
        let events = registered.map_err(|e| Error::CreateCompChannel(e.into()))?;
        let one_thread = tokio::runtime::Handle::current().runtime_flavor()
            == tokio::runtime::RuntimeFlavor::CurrentThread;
        let shared = Arc::new(Shared::new(
            cq,
            events,
            opts.mode,
            opts.poll_batch,
            one_thread,
        ));
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

    /// Reserves `n` completion-queue entries (a shared receive queue's depth), or explains
    /// why the completion queue cannot take them.
    pub(crate) fn reserve_cq(&self, n: u64) -> Result<()> {
        self.try_reserve(n).map_err(|(used, cap)| {
            Error::InvalidArgument(InvalidArgument::CqFull {
                capacity: cap,
                needed: n,
                used,
                max_cqe: self.context().device_attr().max_cqe,
            })
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
        let shared = &self.inner.shared;
        let mut st = shared.lock();
        if st.srq_sink.replace(sink).is_none() {
            // As a connection's sink (`AsyncQp::set_sink`): the completion task watches.
            st.watch.sinks += 1;
            watch::hand_to_task(&mut st, shared);
        }
        drop(st);
        shared.srq_limit.clone()
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
            task_wakeups: c.task_wakeups.load(Ordering::Relaxed),
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
