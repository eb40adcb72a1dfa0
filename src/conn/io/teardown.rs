//! Teardown of the connection's rings: the drain markers posted after a failure, what is still
//! on the device, and giving up on requests the device never flushed.

use tracing::warn;

use super::{ConnIo, ConnState, SEND_BIT, Sent, next_recv_seq};
use crate::error::QpFailure;
use crate::verbs::{RecvWr, SendOp, SendWr};

impl ConnIo {
    /// After the queue pair was moved to the error state: posts a signaled zero-length send
    /// whose flush completion retires every send still in the ring (those that completed
    /// unsignaled before the failure would otherwise hold their staging buffers).
    ///
    /// Likewise a zero-length receive after the receives still posted: posting on a queue pair
    /// in the error state makes soft-RoCE run its flush of that queue again.
    pub(crate) fn post_drain_marker(&self) {
        let mut s = self.lock();
        self.post_recv_marker(&mut s);
        if s.sends.is_empty() {
            return;
        }
        let seq = s.next_send;
        let wr = SendWr::new(self.wr_base | u64::from(SEND_BIT | seq), SendOp::Send, &[]);
        // SAFETY: a zero-length send names no memory.
        match unsafe { self.qp.post_send(&[wr]) } {
            Ok(()) => {
                s.next_send = (seq + 1) & !SEND_BIT;
                s.sends.push_back((seq, Sent::Marker));
            }
            Err(e) => {
                warn!(error = %e, "posting the drain marker failed; staging buffers stay held until the connection is dropped")
            }
        }
    }

    pub(super) fn post_recv_marker(&self, s: &mut ConnState) {
        if s.recvs.is_empty() {
            return;
        }
        let seq = s.next_recv;
        let wr = RecvWr::new(self.wr_base | u64::from(seq), &[]);
        // SAFETY: a zero-length receive names no memory.
        match unsafe { self.qp.post_recv(&[wr]) } {
            Ok(()) => {
                s.next_recv = next_recv_seq(seq);
                s.recvs.push_back(None);
            }
            // The receive queue is full of unflushed requests: the drain limit applies.
            Err(e) => tracing::debug!(error = %e, "posting a receive drain marker failed"),
        }
    }

    /// Gives up on requests the device never flushed (seen on rxe: its flush of a failed
    /// queue pair's receive queue can stop one request short). Call only with the queue pair in
    /// the error state, which processes nothing, after waiting for the flushes: their buffers
    /// go back to the pools. (Keeping them until the queue pair is destroyed would be stronger,
    /// but the connection holds a queue-pair handle until it is dropped, and a closed
    /// connection must give its buffers back.) A late flush of them is harmless: the receive
    /// and send rings no longer hold them, and after the queue pair is reaped its key names
    /// nothing. Returns how many receives and sends were abandoned.
    pub(crate) fn abandon_unflushed(&self) -> (usize, usize) {
        let (recvs, sends) = {
            let mut s = self.lock();
            if Self::data_sends_outstanding(&s) {
                // Never flushed: whether the peer got them is unknown.
                s.proto.data_send_failed(QpFailure::Closed);
            }
            (std::mem::take(&mut s.recvs), std::mem::take(&mut s.sends))
        };
        // What held something (drain markers hold nothing).
        (
            recvs.iter().filter(|r| r.is_some()).count(),
            sends
                .iter()
                .filter(|(_, sent)| !matches!(sent, Sent::Marker))
                .count(),
        )
    }

    /// Receives and sends still on the device that hold something (a buffer, a control
    /// message to report): the drain markers do not count. Soft-RoCE's flush of a queue in the
    /// error state can stop one request short of its end; the marker posted last is that one,
    /// and nothing waits for it.
    pub(crate) fn outstanding(s: &ConnState) -> usize {
        s.recvs.iter().filter(|r| r.is_some()).count()
            + s.sends
                .iter()
                .filter(|(_, sent)| !matches!(sent, Sent::Marker))
                .count()
    }

    /// Whether data sends are still on the device (neither completed nor flushed).
    pub(crate) fn data_sends_outstanding(s: &ConnState) -> bool {
        s.sends
            .iter()
            .any(|(_, sent)| matches!(sent, Sent::Data(_)))
    }
}
