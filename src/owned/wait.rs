//! How an [`OwnedQp`](super::OwnedQp)'s futures learn of completions: they poll the queue
//! pair's own completion queue in place, and, to sleep, arm it and wait on its completion
//! channel's descriptor through the reactor, which wakes the waiting task itself. No other
//! task, lock or table is involved: one CQ poll finds the completion, its `wr_id` names the
//! ring slot that owns the buffer.

use std::task::{Context, Poll};
use std::time::Instant;

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tracing::{trace, warn};

use super::ring::{Outcome, Ring};
use crate::driver::{ChannelFd, CompletionMode};
use crate::error::{Error, Result};
use crate::verbs::{CompletionChannel, CompletionQueue, WcBatch, WcOpcode};

/// Busy and adaptive modes: CQ polls in place per poll of the future, before it yields to the
/// runtime (wakes itself and returns `Pending`), so that other tasks, the reactor and the
/// timers still run. An empty poll of a soft-RoCE CQ is about 40 instructions; 64 of them
/// are a few microseconds, well under a runtime's scheduling slice.
const SPIN_POLLS: u32 = 64;

/// Completions read per `ibv_poll_cq`.
const BATCH: usize = 16;

/// CQ events acknowledged in one `ibv_ack_cq_events`.
const ACK_BATCH: u32 = 32;

/// The completion queue of one owned queue pair, and how its waits poll and sleep.
pub(super) struct CqWait {
    pub(super) cq: CompletionQueue,
    events: AsyncFd<ChannelFd>,
    mode: CompletionMode,
    /// The CQ is armed: its next completion raises an event.
    armed: bool,
    /// The queue pair whose completions these are (set once it exists): a completion of any
    /// other is ignored.
    qpn: u32,
    /// The reactor that registered the channel is gone (its runtime shut down): sleeping is
    /// impossible, every wait polls and yields instead.
    no_reactor: bool,
    /// Adaptive mode: when the current wait started spinning.
    spin_since: Option<Instant>,
    batch: WcBatch,
}

impl CqWait {
    /// A completion queue of `cqe` entries with a channel registered with the current runtime's
    /// reactor.
    pub(super) fn new(
        ctx: &crate::verbs::Context,
        cqe: u32,
        mode: CompletionMode,
    ) -> Result<CqWait> {
        let channel = CompletionChannel::new(ctx)?;
        let cq = CompletionQueue::new(ctx, cqe, Some(&channel))?;
        // Polled and armed only here from now on, and no queue pair but this one's may be
        // created on it (`QueuePair::new_rc` refuses a driven CQ).
        cq.set_driven();
        let fd = ChannelFd(channel);
        // SAFETY: `ChannelFd` owns a handle of the channel: the descriptor stays open, and the
        // same, for the AsyncFd's life.
        let registered = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) };
        let events = registered.map_err(|e| Error::CreateCompChannel(e.into()))?;
        Ok(CqWait {
            cq,
            events,
            mode,
            armed: false,
            qpn: u32::MAX,
            no_reactor: false,
            spin_since: None,
            batch: WcBatch::with_capacity(BATCH),
        })
    }

    /// A new wait begins: its adaptive spin budget starts at its first poll (a wait dropped
    /// mid-spin must not leave its start to the next one, which would then sleep at once).
    #[inline]
    pub(super) fn begin_wait(&mut self) {
        self.spin_since = None;
    }

    /// The queue pair this CQ serves.
    pub(super) fn set_qpn(&mut self, qpn: u32) {
        self.qpn = qpn;
    }

    /// Polls one batch of completions into `ring`; returns how many were applied.
    pub(super) fn poll_once<B>(&mut self, ring: &mut Ring<B>) -> usize {
        poll_into(&self.cq, &mut self.batch, self.qpn, ring)
    }

    /// What a reaper of the dropped queue pair needs to poll its flushes (the reactor
    /// registration is not kept: the reaper does not sleep on events).
    pub(super) fn flushes(&self) -> Flushes {
        Flushes {
            cq: self.cq.clone(),
            batch: WcBatch::with_capacity(BATCH),
            qpn: self.qpn,
        }
    }

    /// Waits until a poll of the CQ applied at least one completion to `ring`. The caller
    /// checks whether the one it waits for is among them, and calls again if not.
    pub(super) fn poll_progress<B>(
        &mut self,
        cx: &mut Context<'_>,
        ring: &mut Ring<B>,
    ) -> Poll<()> {
        let spin = match self.mode {
            CompletionMode::BusyPoll => true,
            CompletionMode::Event => self.no_reactor,
            CompletionMode::Adaptive { max_spin } => {
                let since = *self.spin_since.get_or_insert_with(Instant::now);
                self.no_reactor || since.elapsed() < max_spin
            }
        };
        if spin {
            for _ in 0..SPIN_POLLS {
                if self.poll_once(ring) > 0 {
                    self.spin_since = None;
                    return Poll::Ready(());
                }
            }
            // A slice spent: let the runtime run others, then go on.
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let r = self.poll_event(cx, ring);
        if r.is_ready() {
            self.spin_since = None;
        }
        r
    }

    /// Sleeps until the CQ's next event: arms it if it is not (then polls once, for a
    /// completion that came before the arm), and waits for its channel to be readable.
    fn poll_event<B>(&mut self, cx: &mut Context<'_>, ring: &mut Ring<B>) -> Poll<()> {
        loop {
            if !self.armed {
                if let Err(e) = self.cq.req_notify_driven(false) {
                    warn!(error = %e, "arming the owned queue pair's CQ failed; polling instead");
                    self.no_reactor = true;
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                self.armed = true;
                if self.poll_once(ring) > 0 {
                    return Poll::Ready(());
                }
            }
            let mut guard = match self.events.poll_read_ready(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(guard)) => guard,
                Poll::Ready(Err(e)) => {
                    // The runtime that registered the channel shut down.
                    warn!(error = %e, "the owned queue pair's reactor is gone; polling instead");
                    self.no_reactor = true;
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
            };
            // At most one event is pending: the CQ is armed again only after the event of its
            // last arm was read. So one read clears the readiness (no second read to see
            // EAGAIN), and a later event, of a later arm, raises it anew.
            match self.cq.get_event_driven() {
                Ok(true) => self.armed = false,
                Ok(false) => {}
                Err(e) => {
                    warn!(error = %e, "reading a CQ event failed");
                    self.armed = false;
                }
            }
            guard.clear_ready();
            if self.cq.unacked_events() >= ACK_BATCH {
                self.cq.ack_events();
            }
            trace!(armed = self.armed, "CQ event");
            if self.poll_once(ring) > 0 {
                return Poll::Ready(());
            }
        }
    }
}

/// The completion queue of a dropped queue pair, polled until its requests are flushed.
pub(super) struct Flushes {
    cq: CompletionQueue,
    batch: WcBatch,
    qpn: u32,
}

impl Flushes {
    pub(super) fn poll<B>(&mut self, ring: &mut Ring<B>) -> usize {
        poll_into(&self.cq, &mut self.batch, self.qpn, ring)
    }
}

/// Polls one batch of `cq` into `ring`; returns how many completions were applied. Only queue
/// pair `qpn`'s count: no other can be created on this CQ from safe code (a driven CQ is
/// refused), and one that were would name nothing here.
fn poll_into<B>(cq: &CompletionQueue, batch: &mut WcBatch, qpn: u32, ring: &mut Ring<B>) -> usize {
    let wcs = match cq.poll_driven(batch) {
        Ok(wcs) => wcs,
        Err(e) => {
            // `ibv_poll_cq` fails only on a provider's internal error; the wait goes on.
            warn!(error = %e, "polling an owned queue pair's CQ failed");
            return 0;
        }
    };
    let mut applied = 0;
    for wc in wcs {
        if wc.qp_num() != qpn {
            warn!(
                qp_num = wc.qp_num(),
                "completion of another queue pair on an owned CQ ignored"
            );
            continue;
        }
        let ok = wc.is_success();
        let outcome = Outcome {
            status: wc.status(),
            vendor_err: wc.vendor_err(),
            len: wc.byte_len(),
            imm: wc.imm(),
            write_imm: ok && wc.opcode() == WcOpcode::RecvRdmaWithImm,
        };
        if ring.complete(wc.wr_id(), outcome) {
            applied += 1;
        } else {
            // Cannot happen: only this queue pair posts to the CQ, with ring ids.
            warn!(
                wr_id = wc.wr_id(),
                "completion for no request of this queue pair"
            );
        }
    }
    // Given-up requests' buffers, once the whole batch is applied.
    ring.drop_released();
    applied
}
