//! Receives on the connection's own queue pair, from its private pool.

use super::{ConnIo, ConnState, next_recv_seq};
use crate::verbs::RecvWr;

impl ConnIo {
    /// Posts the receives the state machine asks for: private buffers on this queue pair, or
    /// (on the shared receive queue) grants from the connection's claim.
    pub(super) fn post_recvs(&self, s: &mut ConnState) {
        let want = if s.in_error {
            0
        } else {
            s.proto.recvs_to_post()
        };
        if s.srq.is_some() {
            self.post_shared_recvs(s, want);
            return;
        }
        let mut posted = 0;
        while posted < want {
            let Ok(Some(buf)) = self.pool.try_acquire(self.recv_size) else {
                s.short = true;
                break;
            };
            let seq = s.next_recv;
            let sge = [buf.sge(0..buf.capacity())];
            let wr = RecvWr::new(self.wr_base | u64::from(seq), &sge);
            // SAFETY: the buffer is registered in this queue pair's protection domain and
            // stays in `recvs` (untouched) until its completion.
            match unsafe { self.qp.post_recv(&[wr]) } {
                Ok(()) => {
                    s.next_recv = next_recv_seq(seq);
                    s.recvs.push_back(Some(buf));
                    posted += 1;
                }
                Err(e) => {
                    self.post_failed(s, &e);
                    break;
                }
            }
        }
        if posted == want {
            s.short = false;
        }
        s.proto.recvs_posted(posted);
    }
}
