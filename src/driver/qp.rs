//! [`AsyncQp`]: a queue pair whose operations are futures resolved by the completion task.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use tracing::{debug, info_span};

use super::deferred::{Deferred, Sink};
use super::raw::{OpConfig, OpFields};
use super::shared::Shared;
use super::sink::sink_wr_id;
use super::state::QpEntry;
use super::{Driver, QpOptions};
use crate::error::{Error, InvalidArgument, QpFailure, Result, Unsupported};
use crate::proto::{QpConfig, QpKey};
use crate::verbs::{ProtectionDomain, QpCaps, QpInitAttr, QueuePair, SharedReceiveQueue};

/// A reliable-connected queue pair driven by a [`Driver`]: every operation is a future that
/// posts on first poll and resolves on its work completion, taking its buffers by value and
/// giving them back with the result.
///
/// Dropping an `AsyncQp` closes it in the background: the queue pair moves to the error state,
/// every outstanding operation resolves with [`QpFailure::Closed`](crate::QpFailure::Closed)
/// (its buffers are returned to its future, or released if the future is gone), and the queue
/// pair is destroyed once the device has flushed everything. [`close`](Self::close) does the
/// same and waits for it.
pub struct AsyncQp {
    driver: Driver,
    key: QpKey,
    qp: QueuePair,
    cfg: OpConfig,
    span: tracing::Span,
}

impl AsyncQp {
    pub(super) fn create(
        driver: Driver,
        pd: &ProtectionDomain,
        opts: QpOptions,
        srq: Option<&SharedReceiveQueue>,
        cq_need: u64,
    ) -> Result<AsyncQp> {
        let cq = driver.shared().cq.clone();
        let mut attr = QpInitAttr::new(&cq, &cq);
        attr.caps = opts.caps;
        attr.srq = srq.cloned();
        let qp = QueuePair::new_rc_driven(pd, &attr)?;
        qp.set_driven();
        let caps: QpCaps = qp.caps();
        let mut wake = Deferred::default();
        let key = {
            let shared = driver.shared();
            let mut st = shared.lock();
            if srq.is_some() {
                // Receive completions on a shared receive queue are routed by queue-pair
                // number. Numbers are reused once a queue pair is destroyed, and a destroyed
                // one's completions may still wait in the CQ: apply them all now, while this
                // number maps to nothing (they go back to the queue), so none reaches the new
                // queue pair. Every one of them is already in the CQ: the old queue pair was
                // destroyed before its number could be given to this one.
                while shared.poll_cq(&mut st, &mut wake) > 0 {}
            }
            let key = st
                .core
                .add_qp(QpConfig::new(
                    opts.caps
                        .max_send_wr
                        .min(caps.max_send_wr)
                        .saturating_sub(opts.sink_sends),
                    opts.caps.max_recv_wr.min(caps.max_recv_wr),
                    opts.signal_every,
                ))
                .ok_or(Error::Unsupported(Unsupported::TooManyQueuePairs {
                    max: crate::proto::QpKey::MAX_INDEX,
                }))?;
            if st.qps.len() <= key.index() {
                st.qps.resize_with(key.index() + 1, || None);
            }
            if srq.is_some() {
                st.by_qpn.insert(qp.qpn(), key);
            }
            st.qps[key.index()] = Some(QpEntry {
                key,
                qp: qp.clone(),
                closing: false,
                cq_need,
                sink: None,
                last_wqe: false,
                closing_since: None,
            });
            key
        };
        wake.run();
        let span = info_span!("qp", qpn = qp.qpn(), device = driver.context().name());
        span.in_scope(|| debug!(?caps, "queue pair created"));
        Ok(AsyncQp {
            cfg: OpConfig::new(OpFields {
                shared: driver.shared().clone(),
                qp: key,
                caps,
                coalesce: opts.coalesce,
                inline: opts.inline,
            }),
            driver,
            key,
            qp,
            span,
        })
    }

    /// The underlying verbs queue pair, for connecting it (INIT/RTR/RTS) and queries. Posting
    /// on it directly bypasses the driver and is not supported.
    pub fn verbs(&self) -> &QueuePair {
        &self.qp
    }

    /// The queue pair number.
    pub fn qpn(&self) -> u32 {
        self.qp.qpn()
    }

    /// The capabilities the device granted.
    pub fn caps(&self) -> QpCaps {
        self.cfg.caps
    }

    /// The driver.
    pub fn driver(&self) -> &Driver {
        &self.driver
    }

    /// The failure that stopped this queue pair, if any.
    pub fn failure(&self) -> Option<QpFailure> {
        self.shared().lock().core.failure(self.key).cloned()
    }

    /// Operations queued or posted on this queue pair and not yet completed.
    pub fn outstanding(&self) -> usize {
        self.shared().lock().core.outstanding(self.key)
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.cfg.shared
    }

    /// What the operation futures of this queue pair need.
    pub(crate) fn op_config(&self) -> &OpConfig {
        &self.cfg
    }

    /// Routes the completions of requests posted with [`sink_wr_id`](Self::sink_wr_id) to
    /// `sink` (a connection's receives and message sends, posted by the connection itself).
    pub(crate) fn set_sink(&self, sink: std::sync::Arc<dyn Sink>) {
        let shared = self.shared();
        let mut st = shared.lock();
        let Some(e) = st.entry_mut(self.key) else {
            return;
        };
        if e.sink.replace(sink).is_none() {
            // Its completions are to be applied while nobody waits: the completion task
            // watches the channel from now on (`watch`).
            st.watch.sinks += 1;
            super::watch::hand_to_task(&mut st, shared);
        }
    }

    /// The `wr_id` of the sink's request `local`.
    pub(crate) fn sink_wr_id(&self, local: u32) -> u64 {
        sink_wr_id(self.key, local)
    }

    /// Polls the completion queue once, in place, applying what it finds (for futures that
    /// wait on something a completion produces, such as a connection's next message).
    pub(crate) fn poll_completions(&self) -> usize {
        self.poll_completions_into(&mut Deferred::default())
    }

    /// [`poll_completions`](Self::poll_completions) with the caller's `Deferred`, which is
    /// run (emptied) before this returns: a waiter that polls many times in a row sets one up
    /// once, not per poll (most polls find nothing, and an empty poll should cost little
    /// more than `ibv_poll_cq`).
    pub(crate) fn poll_completions_into(&self, wake: &mut Deferred) -> usize {
        let shared = self.shared();
        let n = {
            let mut st = shared.lock();
            shared
                .counters
                .polled_in_place
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            shared.poll_cq(&mut st, wake)
        };
        wake.run();
        n
    }

    /// Moves the queue pair to the error state and fails its operations with `cause` (the
    /// connection layer uses it when the peer disconnects).
    pub(crate) fn force_error(&self, cause: QpFailure) {
        let mut wake = Deferred::default();
        self.shared().lock().fail(self.key, cause, &mut wake);
        wake.run();
        self.shared().notify.notify_one();
    }

    /// Closes the queue pair: moves it to ERR, waits until every outstanding operation has
    /// resolved (each exactly once, with [`QpFailure::Closed`] unless it completed first).
    /// The queue pair is destroyed when this handle is dropped.
    ///
    /// # Errors
    ///
    /// None today; the `Result` leaves room for drain timeouts.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future stops waiting; the queue pair stays closed.
    pub async fn close(&self) -> Result<()> {
        let _g = self.span.enter();
        self.force_error(QpFailure::Closed);
        let shared = self.shared();
        let stopped = || shared.stopped.load(std::sync::atomic::Ordering::Acquire);
        let posted = || shared.lock().core.posted(self.key);
        // Registered as a closer before the first look at what is posted (see `Shared::drain`).
        let _closer = Closer::new(shared);
        loop {
            if stopped() {
                // No completion task any more (its runtime shut down): apply the flushes here,
                // yielding between polls.
                self.poll_completions();
                if posted() == 0 {
                    break;
                }
                tokio::task::yield_now().await;
                continue;
            }
            let notified = shared.drained.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if posted() == 0 {
                break;
            }
            // The completion task applies the flushes if nobody else polls.
            shared.notify.notify_one();
            notified.await;
        }
        debug!("queue pair drained");
        Ok(())
    }
}

impl Drop for AsyncQp {
    fn drop(&mut self) {
        let mut wake = Deferred::default();
        {
            let mut st = self.shared().lock();
            st.fail(self.key, QpFailure::Closed, &mut wake);
            if let Some(e) = st.entry_mut(self.key) {
                e.closing = true;
                e.closing_since = Some(std::time::Instant::now());
                // The sink (a connection) owns this handle; break the cycle.
                if e.sink.take().is_some() {
                    st.watch.sinks -= 1;
                }
            }
            self.shared()
                .closing
                .store(true, std::sync::atomic::Ordering::Release);
        }
        wake.run();
        // The completion task reaps the queue pair once the device has flushed it.
        self.shared().notify.notify_one();
    }
}

impl fmt::Debug for AsyncQp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AsyncQp")
            .field("qpn", &self.qp.qpn())
            .field("caps", &self.cfg.caps)
            .finish_non_exhaustive()
    }
}

/// Counts an `AsyncQp::close` waiting on [`Shared::drained`] while it lives.
struct Closer<'a>(&'a Shared);

impl<'a> Closer<'a> {
    fn new(shared: &'a Shared) -> Closer<'a> {
        shared.closers.fetch_add(1, Ordering::AcqRel);
        Closer(shared)
    }
}

impl Drop for Closer<'_> {
    fn drop(&mut self) {
        self.0.closers.fetch_sub(1, Ordering::AcqRel);
    }
}

// In this file, above the driver: the driver does not know the queue-pair handle it makes.
impl Driver {
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
    /// completions this driver routes by queue-pair number: see [`srq_wr_id`](super::sink::srq_wr_id)). The receive
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
            Error::InvalidArgument(InvalidArgument::CqFullForQp {
                capacity: cap,
                depth: need,
                used,
                max_cqe: self.context().device_attr().max_cqe,
            })
        })?;
        match AsyncQp::create(self.clone(), pd, opts, srq, need) {
            Ok(qp) => Ok(qp),
            Err(e) => {
                self.release_budget(need);
                Err(e)
            }
        }
    }
}

#[cfg(test)]
#[path = "qp_tests.rs"]
mod tests;
