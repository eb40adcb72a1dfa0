//! End of stream, the order of the disconnect, and what a close reports.
//!
//! Each side's `Close` is a control message; its *delivery* is known when its send completes
//! (the peer's device acknowledged it) or when the peer's `ctrl ack` counts it (the peer
//! processed it and re-posted its receive). A side that has the peer's `Close` and its own
//! delivered does **not** disconnect at once: its device may not have acknowledged the
//! peer's `Close` yet, and once this side's queue pair leaves RTS the peer's retransmission
//! meets nobody (the peer's `close` then failed with `IBV_WC_RETRY_EXC_ERR`, although both
//! ends of stream had arrived). Each side sends a control message whose `ctrl ack` counts the
//! peer's `Close` (its own `Close`, if that went out after the peer's arrived; else a
//! confirming credit message), and disconnects once *that* message is delivered and the
//! peer's confirmation of its own `Close` has arrived: the peer then knows its `Close` arrived
//! whatever becomes of the transport's acknowledgement, and the peer's confirmation, the last
//! message it sends, is in, so nothing is on its way into a queue pair that moves to the
//! error state (rxe's flush of a receive queue that a packet is entering can lose one request,
//! and the teardown's drain then waits out its stall limit). The side that closed second
//! disconnects when the first one's confirmation arrives; the first when its confirmation is
//! acknowledged, or on the disconnect. The wait is bounded by the keepalive timeout.
//!
//! A full close (`close()` or a drop) before the peer's `Close` arrived does not disconnect as
//! soon as its own `Close` is delivered either: it waits (in the background: `close()` has
//! returned) for the peer's `Close`, then confirms it as above, bounded by the keepalive
//! timeout, as TCP's `FIN_WAIT_2` waits for the peer's `FIN`. Disconnecting at once left the
//! peer's `Close` to meet a queue pair already gone: the peer's `close` then ended only with
//! the disconnect's arrival through RDMA CM or its own retries running out (seconds under
//! load; issue 25).
//!
//! What `close` reports ([`ConnProto::close_outcome`]): `Ok` when this side's end of stream
//! was delivered (so was every message before it: the connection is in order), or when the
//! peer's end of stream arrived and nothing this side sent can be missing (no data send
//! failed or is unaccounted for, no message was waiting to go out): a transport error after
//! both ends of stream were exchanged is not data loss. Anything else is the failure.

use std::task::{Context, Poll};
use std::time::Instant;

use super::ConnProto;
use crate::error::{Error, QpFailure};

impl<B: AsRef<[u8]>> ConnProto<B> {
    /// Closes this side: no new messages; end of stream goes out after the queued ones.
    pub fn close(&mut self) {
        if !self.local_closed {
            self.local_closed = true;
            self.check_close_ready();
        }
    }

    /// Closes fully: end of stream after the queued messages, then disconnect once the
    /// peer's end of stream arrived and both were confirmed, or the keepalive timeout after
    /// ours was delivered (see the module docs).
    pub fn close_full(&mut self) {
        self.full_close = true;
        self.close();
        self.kick();
    }

    /// Whether the shell should disconnect now and drain: the connection failed (after any
    /// error report went out); or this side's end of stream was delivered and either the
    /// peer's arrived, the peer confirmed ours and our confirmation of its was delivered, or
    /// that wait (for a full close: also the wait for the peer's end of stream) took the
    /// keepalive timeout.
    pub fn should_disconnect(&self) -> bool {
        if self.failure.is_some() {
            return !self.error_report_pending();
        }
        if !self.close_done {
            return false;
        }
        if self.rx.peer_closed {
            self.eos_settled() || self.eos.linger_over
        } else {
            self.full_close && self.eos.linger_over
        }
    }

    /// Why [`should_disconnect`](Self::should_disconnect) holds (for the teardown's log);
    /// `None` while it does not.
    pub fn disconnect_reason(&self) -> Option<&'static str> {
        if !self.should_disconnect() {
            return None;
        }
        Some(if self.failure.is_some() {
            "failed"
        } else if !self.rx.peer_closed {
            "full close: the peer's end of stream did not come (keepalive timeout)"
        } else if self.eos_settled() {
            "both ends of stream confirmed"
        } else {
            "confirmation wait over (keepalive timeout)"
        })
    }

    /// Whether our control message number `seq` (1-based) is known delivered: its send
    /// completed, or the peer's `ctrl ack` counts it.
    fn delivered(&self, seq: u64) -> bool {
        self.eos.ctrl_completed >= seq || self.credits.ctrl_confirmed() >= seq
    }

    /// Whether the message confirming the peer's `Close` was delivered.
    fn confirm_delivered(&self) -> bool {
        self.eos.confirm_seq.is_some_and(|k| self.delivered(k))
    }

    /// Both ends of stream are settled: the peer confirmed our `Close` (so the message that
    /// confirms it, the last the peer sends, has arrived: nothing is on its way to us any more),
    /// and our confirmation of the peer's `Close` was delivered.
    fn eos_settled(&self) -> bool {
        self.eos
            .close_seq
            .is_some_and(|k| self.credits.ctrl_confirmed() >= k)
            && self.confirm_delivered()
    }

    /// Whether a credit message must go out to confirm the peer's `Close`: we closed too, and
    /// no control message of ours has counted it yet (our `Close` went out before it arrived,
    /// or before its receive was re-posted).
    pub(super) fn eos_confirm_due(&self) -> bool {
        self.failure.is_none()
            && self.close_sent
            && self.eos.confirm_seq.is_none()
            && self
                .eos
                .peer_close_at
                .is_some_and(|n| self.credits.ctrl_processed() >= n)
    }

    /// A control message of ours was just handed out with the current `ctrl ack`: note it if
    /// it is the first to confirm the peer's `Close`, and our `Close`'s number.
    pub(super) fn note_control_out(&mut self, close: bool) {
        let seq = self.credits.ctrl_sent();
        if close {
            self.eos.close_seq = Some(seq);
        }
        if self.eos.confirm_seq.is_none()
            && self
                .eos
                .peer_close_at
                .is_some_and(|n| self.credits.ctrl_announced() >= n)
        {
            self.eos.confirm_seq = Some(seq);
        }
    }

    /// A control message of the peer's arrived (`close`: its end of stream).
    pub(super) fn note_control_in(&mut self, close: bool) {
        self.eos.ctrl_received += 1;
        if close {
            self.eos.peer_close_at = Some(self.eos.ctrl_received);
        }
    }

    /// A control message of ours completed successfully.
    pub(super) fn note_control_done(&mut self) {
        self.eos.ctrl_completed += 1;
        self.update_eos();
    }

    /// Our `Close` may have been confirmed, or our confirmation of the peer's delivered.
    pub(super) fn update_eos(&mut self) {
        if !self.close_done && self.eos.close_seq.is_some_and(|k| self.delivered(k)) {
            self.close_done = true;
            self.wakers.append(&mut self.close_wakers);
            self.kick();
        } else if self.close_done && self.rx.peer_closed {
            // The disconnect may be due now.
            self.kick();
        }
    }

    /// A data send failed with `cause` (or, with the queue pair in the error state, never
    /// flushed): what it carried may not have reached the peer.
    pub fn data_send_failed(&mut self, cause: QpFailure) {
        self.eos.send_failed = true;
        self.fail(cause);
    }

    /// At the first failure: messages still to go out (or rendezvous messages the peer has
    /// not read) may never reach the peer.
    pub(super) fn note_failure(&mut self) {
        if !self.out.is_empty() || self.rdv.unacked() > 0 {
            self.eos.queued_at_failure = true;
        }
    }

    /// What `close` reports once the connection is torn down. `sends_unaccounted`: data
    /// sends the shell never saw complete or flush (their fate is unknown).
    ///
    /// `Ok` if our end of stream was delivered; or if the peer's arrived, nothing was waiting
    /// to go out, the failure is the transport's (not a protocol violation), and every data
    /// chunk we sent is known to have reached the peer: its send completed (none failed, none
    /// is unaccounted for), or the peer returned its credit (it re-posted the receive the
    /// chunk had used, so an acknowledgement lost on the wire does not count as a loss). Then
    /// only our end of stream may not have arrived.
    ///
    /// # Errors
    ///
    /// The connection's failure ([`QpFailure::Closed`] if it has none): messages this side
    /// sent may not have reached the peer.
    pub fn close_outcome(&self, sends_unaccounted: bool) -> Result<(), Error> {
        if self.close_done {
            return Ok(());
        }
        let protocol = matches!(
            self.failure,
            Some(QpFailure::Protocol(_) | QpFailure::PeerReported(_))
        );
        let acked = !self.eos.send_failed && !sends_unaccounted;
        let chunks_arrived = acked || self.credits.all_returned();
        if self.rx.peer_closed && !self.eos.queued_at_failure && chunks_arrived && !protocol {
            return Ok(());
        }
        Err(self
            .failed_error()
            .unwrap_or(Error::QpFailed(QpFailure::Closed)))
    }

    /// Nothing left to send before end of stream: the queue is empty and the peer read every
    /// rendezvous message (a disconnect before that would fail its reads).
    pub(super) fn all_sent(&self) -> bool {
        self.out.is_empty() && self.rdv.unacked() == 0
    }

    /// Starts the close timeout if end of stream waits for something (messages still to go
    /// out, rendezvous messages still to be read), and the linger if the disconnect waits for
    /// the confirmation of the peer's `Close`, or (a full close) for the peer's `Close`.
    pub(super) fn note_close_wait(&mut self, now: Instant) {
        if self.local_closed && !self.close_sent && self.failure.is_none() && !self.all_sent() {
            self.close_waiting_since.get_or_insert(now);
        }
        let waits = if self.rx.peer_closed {
            !self.eos_settled()
        } else {
            self.full_close
        };
        if self.failure.is_none() && self.close_done && waits {
            self.eos.linger_since.get_or_insert(now);
        }
    }

    /// When the close timeout expires, if end of stream is still waiting for something to go
    /// out (once everything went, end of stream itself is under the keepalive's deadline).
    pub(super) fn close_deadline(&self) -> Option<Instant> {
        self.close_waiting_since
            .filter(|_| !self.close_sent && !self.all_sent())
            .and_then(|t| t.checked_add(self.cfg.close_timeout))
    }

    /// When the disconnect stops waiting for the peer's `Close` (a full close) or for the
    /// confirmations: the keepalive timeout after the wait began, whatever it waits for.
    pub(super) fn linger_deadline(&self) -> Option<Instant> {
        self.eos
            .linger_since
            .filter(|_| !self.eos.linger_over && !self.eos_settled())
            .and_then(|t| t.checked_add(self.cfg.keepalive_timeout))
    }

    /// Time passed: the linger may be over.
    pub(super) fn linger_timeout(&mut self, now: Instant) {
        if self.linger_deadline().is_some_and(|at| now >= at) {
            self.eos.linger_over = true;
            self.kick();
        }
    }

    pub(super) fn check_close_ready(&mut self) {
        if self.local_closed && !self.close_sent && self.all_sent() {
            self.kick();
        }
    }

    /// Ready once end of stream was delivered (its send completed, or the peer confirmed it),
    /// or the connection failed.
    ///
    /// # Errors
    ///
    /// The connection's failure, if it failed before end of stream was known delivered.
    pub fn poll_close(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        if self.close_done {
            return Poll::Ready(Ok(()));
        }
        if let Some(e) = self.failed_error() {
            return Poll::Ready(Err(e));
        }
        if !self.close_wakers.iter().any(|w| w.will_wake(cx.waker())) {
            self.close_wakers.push(cx.waker().clone());
        }
        Poll::Pending
    }
}
