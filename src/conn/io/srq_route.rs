//! SRQ routing: a connection on the endpoint's shared receive queue posts no receives of its
//! own; it grants receives from its claim on the queue, and its receive completions (routed
//! to it by queue-pair number) carry a buffer of the queue's, taken out of the queue's slot
//! table here.

use std::time::Instant;

use tracing::warn;

use super::{ConnIo, ConnState};
use crate::conn::srq::Waiter;
use crate::error::QpFailure;
use crate::proto::Cqe;

impl ConnIo {
    /// Grants up to `want` receives from the connection's claim on the shared receive queue,
    /// after posting back on the queue the buffers that came back.
    pub(super) fn post_shared_recvs(&self, s: &mut ConnState, want: u32) {
        let Some(share) = s.srq.as_mut() else {
            return;
        };
        // The buffers are the shared queue's: post back what came back, then grant what
        // the claim allows (the rest stays due and is retried at the next step).
        if want == 0 {
            share.set_held(s.proto.held().1);
            return;
        }
        share.shared().refill();
        share.set_held(s.proto.held().1);
        let n = share.post(want);
        s.short = share.is_open() && n < want && share.below_floor();
        if s.short {
            share.shared().wait(self.me.clone());
        }
        s.proto.recvs_posted(n);
    }

    /// A receive of the shared receive queue completed for this connection (slot `local`):
    /// its buffer goes to the state machine, or back to the queue if the connection's claim
    /// was already given back.
    pub(super) fn shared_received(
        &self,
        s: &mut ConnState,
        local: u32,
        cqe: &Cqe,
        qp_failure: Option<&QpFailure>,
        now: Instant,
    ) {
        let buf = self.shared_recv.as_ref().and_then(|q| q.take(local));
        match (buf, s.srq.as_mut()) {
            (Some(buf), Some(share)) => {
                share.consumed();
                Self::received(s, buf, cqe, qp_failure, now);
                let held = s.proto.held().1;
                if let Some(share) = s.srq.as_mut() {
                    share.set_held(held);
                }
            }
            // Torn down (its claim given back): the buffer just goes back.
            (Some(buf), None) => {
                drop(buf);
                if let Some(q) = &self.shared_recv {
                    q.consumed_unclaimed();
                }
            }
            (None, _) => warn!(local, "a shared-queue completion with no buffer posted"),
        }
    }
}

impl Waiter for ConnIo {
    fn buffers_back(&self) {
        self.kick.notify_one();
    }
}
