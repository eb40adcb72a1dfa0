//! The connection as its queue pair's completion [`Sink`]: whoever polls the completion queue
//! hands it the connection's completions, which go straight into the state machine; what the
//! state machine then asks for is posted in the same call ([`ConnIo::pump`]).

use std::sync::atomic::Ordering;
use std::time::Instant;

use tracing::warn;

use super::{ConnIo, ConnState, Held, Local, RECV_SEQ_MASK, Retired, Sent};
use crate::buf::PoolBuf;
use crate::conn::rdv_memory::Fetch;
use crate::driver::{Deferred, Sink};
use crate::error::{QpFailure, WcStatus};
use crate::proto::Cqe;

fn cause_of(cqe: &Cqe, qp_failure: Option<&QpFailure>) -> QpFailure {
    if cqe.status == WcStatus::WrFlushErr {
        qp_failure.cloned().unwrap_or(QpFailure::Flushed)
    } else {
        QpFailure::WorkCompletion {
            status: cqe.status,
            vendor_err: cqe.vendor_err,
        }
    }
}

impl ConnIo {
    /// A receive completed into `buf`: hand it to the state machine.
    pub(super) fn received(
        s: &mut ConnState,
        buf: PoolBuf,
        cqe: &Cqe,
        qp_failure: Option<&QpFailure>,
        now: Instant,
    ) {
        let res = if cqe.status == WcStatus::Success {
            s.proto.heard(now);
            Ok((cqe.byte_len, cqe.imm))
        } else {
            Err(cause_of(cqe, qp_failure))
        };
        s.proto.handle_recv(res, buf);
    }
}

impl ConnIo {
    /// One completion of this connection into its state (under its lock): the receive or
    /// send it completes leaves the posted lists, and the state machine hears of it.
    #[inline(always)]
    fn apply(
        &self,
        s: &mut ConnState,
        local: u32,
        cqe: &Cqe,
        qp_failure: Option<&QpFailure>,
        now: Instant,
        wake: &mut Deferred,
    ) {
        match Local::of(local) {
            Local::Shared => self.shared_received(s, local, cqe, qp_failure, now),
            Local::Recv => {
                let Some(entry) = s.recvs.pop_front() else {
                    warn!(local, "a receive completion with no receive posted");
                    return;
                };
                let seq = s.next_recv.wrapping_sub(s.recvs.len() as u32 + 1) & RECV_SEQ_MASK;
                debug_assert_eq!(seq, local, "receive completions come in posting order");
                // The drain marker's flush carries nothing for the state machine.
                if let Some(buf) = entry {
                    Self::received(s, buf, cqe, qp_failure, now);
                }
            }
            Local::Send(seq) => {
                if !s.sends.iter().any(|(q, _)| *q == seq) {
                    warn!(local, "a send completion that matches no send");
                    return;
                }
                let ok = cqe.status == WcStatus::Success;
                // Completions on a send queue come in posting order: every earlier send is done.
                while let Some((q, sent)) = s.sends.pop_front() {
                    let this = q == seq;
                    let res = if this && !ok {
                        Err(cause_of(cqe, qp_failure))
                    } else {
                        Ok(())
                    };
                    match sent {
                        Sent::Marker => {}
                        Sent::Fetch { last } => {
                            if last || res.is_err() {
                                s.proto.fetch_done(res);
                            }
                            if last && ok {
                                s.recv_bytes.fetched += s.fetch.as_ref().map_or(0, Fetch::len);
                            }
                        }
                        Sent::Control(kind) => s.proto.handle_control_done(kind, res, now),
                        Sent::Data(held) => {
                            if let Held::User(b) = held {
                                self.retire(Retired::Bytes(b));
                            }
                            // A send's completion is no sign of the peer's life (its NIC acks).
                            if let Err(cause) = res {
                                s.proto.data_send_failed(cause);
                            }
                        }
                    }
                    if this {
                        break;
                    }
                }
                Self::wake_sq(s, wake);
            }
        }
    }
}

impl ConnIo {
    /// A look at the state for completions: `apply` feeds them to it under the lock, then
    /// what they changed is settled and pumped once. `ok`: all of them succeeded. Returns the
    /// failure to record for the queue pair (see [`Sink::on_completion`]).
    #[inline(always)]
    fn take_completions(
        &self,
        ok: bool,
        wake: &mut Deferred,
        apply: impl FnOnce(&mut ConnState, Instant, &mut Deferred),
    ) -> Option<QpFailure> {
        let now = Instant::now();
        let mut s = self.lock();
        self.bump_changes(&s);
        self.report_dropped(&mut s);
        let was_failed = s.proto.failure().is_some();
        apply(&mut s, now, wake);
        self.settle_dropped(&mut s);
        let kick = self.pump(&mut s, Some(now), wake);
        let newly_failed = !was_failed && s.proto.failure().is_some();
        // On a shared receive queue every SEND of the peer takes a shared buffer, credits or
        // not: a connection that broke the protocol stops consuming them now (its queue pair
        // goes to ERR), not after its error report (which then flushes).
        let failure = if newly_failed && (!ok || s.srq.is_some()) {
            s.proto.failure().cloned()
        } else {
            None
        };
        if newly_failed {
            Self::wake_sq(&mut s, wake);
        }
        self.note_recv_idle(&s);
        drop(s);
        // Under the driver's lock: the retired application bytes are dropped once it is
        // released (their owner may hold the last handle of a queue pair of this driver).
        if self.has_retired.load(Ordering::Acquire) {
            if let Some(me) = self.me.upgrade() {
                wake.after_unlock(me);
            }
        }
        if kick || newly_failed {
            self.kick.notify_one();
        }
        failure
    }
}

impl Sink for ConnIo {
    fn on_completion(
        &self,
        local: u32,
        cqe: &Cqe,
        qp_failure: Option<&QpFailure>,
        wake: &mut Deferred,
    ) -> Option<QpFailure> {
        let ok = cqe.status == WcStatus::Success;
        self.take_completions(ok, wake, |s, now, wake| {
            self.apply(s, local, cqe, qp_failure, now, wake);
        })
    }

    /// The run in one look at the state: one lock, one clock read, one pump for all of it
    /// (a receiver that polls ten completions at a time pays for the look once per ten).
    fn on_completions(
        &self,
        run: &[(u32, Cqe)],
        qp_failure: Option<&QpFailure>,
        wake: &mut Deferred,
    ) -> Option<QpFailure> {
        let ok = run.iter().all(|(_, c)| c.status == WcStatus::Success);
        self.take_completions(ok, wake, |s, now, wake| {
            for (local, cqe) in run {
                self.apply(s, *local, cqe, qp_failure, now, wake);
            }
        })
    }

    fn after_unlock(&self) {
        self.drop_retired();
    }

    fn on_driver_stopped(&self) {
        let mut wake = Deferred::default();
        {
            let mut s = self.lock();
            self.bump_changes(&s);
            s.proto.fail(QpFailure::DriverStopped);
            Self::wake_sq(&mut s, &mut wake);
            self.pump(&mut s, None, &mut wake);
            self.note_recv_idle(&s);
        }
        wake.run();
        self.drop_retired();
        self.kick.notify_one();
    }
}
