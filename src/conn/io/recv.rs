//! Receives on the connection's own queue pair, from its private pool.

use super::{ConnIo, ConnState, next_recv_seq};
use crate::verbs::{RecvWr, Sge};

/// Receives posted by one `ibv_post_recv` call at most: the state machine hands data receives
/// back in batches (`ConnProto::recvs_to_post`), and a batch goes in one chained call.
const CHAIN: usize = 16;

impl ConnIo {
    /// Posts the receives the state machine asks for: private buffers on this queue pair, in
    /// chains of up to [`CHAIN`], or (on the shared receive queue) grants from the
    /// connection's claim.
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
            let n = ((want - posted) as usize).min(CHAIN);
            let mut sges = [Sge::ZERO; CHAIN];
            // The batch's buffers join `recvs` (in posting order) before the call; those it
            // does not post leave again below.
            let base = s.recvs.len();
            let mut got = 0;
            while got < n {
                let Ok(Some(buf)) = self.pool.try_acquire(self.recv_size) else {
                    s.short = true;
                    break;
                };
                sges[got] = buf.sge(0..buf.capacity());
                s.recvs.push_back(Some(buf));
                got += 1;
            }
            if got == 0 {
                break;
            }
            let mut wrs = [RecvWr::EMPTY; CHAIN];
            let mut seq = s.next_recv;
            for (wr, sge) in wrs.iter_mut().zip(&sges).take(got) {
                *wr = RecvWr::new(self.wr_base | u64::from(seq), std::slice::from_ref(sge));
                seq = next_recv_seq(seq);
            }
            // SAFETY: each buffer is ours alone (just taken from the pool), registered in this
            // PD, and kept untouched in `recvs` until its completion if posted (`ok` below).
            let res = unsafe { self.qp.post_recv(&wrs[..got]) };
            // Posted: all, or those before the failed call's bad index. Any other error
            // (`post_recv` reports none) counts as all posted: a buffer the device may still
            // write stays in `recvs` (given back at teardown) rather than going to the pool.
            let ok = match &res {
                Err(crate::Error::PostRecv { bad_index, .. }) => (*bad_index).min(got),
                Ok(()) | Err(_) => got,
            };
            // `next_recv` is the number after the last of `recvs` (completions find their
            // buffer by it): it advances by what was posted; the rest, never on the device,
            // leave `recvs` for the pool.
            s.recvs.truncate(base + ok);
            for _ in 0..ok {
                s.next_recv = next_recv_seq(s.next_recv);
            }
            posted += ok as u32;
            if let Err(e) = res {
                self.post_failed(s, &e);
                break;
            }
            if got < n {
                break;
            }
        }
        if posted == want {
            s.short = false;
        }
        s.proto.recvs_posted(posted);
    }
}
