//! Rendezvous fetches: the RDMA READs of the message being fetched, posted on the connection's
//! send queue as room allows (whoever waits), and the release of this side's rendezvous
//! messages once the peer read them.

use super::{ConnIo, ConnState, Retired, Sent};
use crate::verbs::{SendOp, Sge};

impl ConnIo {
    /// Posts the READs of the fetch in progress that fit the send queue (called by the pump:
    /// the rest go as completions make room, whoever waits).
    pub(crate) fn post_fetch(&self, s: &mut ConnState) {
        loop {
            let room = self.sq_room(s);
            let Some(f) = s.fetch.as_mut() else { return };
            if f.posted == f.msg.len || !room || s.proto.failure().is_some() {
                return;
            }
            let piece = (f.msg.len - f.posted).min(self.max_read);
            let last = f.posted + piece == f.msg.len;
            let sge = [Sge::new(f.addr + f.posted, piece as u32, f.lkey)];
            let op = SendOp::Read {
                remote_addr: f.msg.addr.wrapping_add(f.posted),
                rkey: f.msg.rkey,
            };
            f.posted += piece;
            if !self.post_send_entry(s, op, &sge, Sent::Fetch { last }) {
                return;
            }
        }
    }

    /// Releases the memory of the rendezvous messages the peer finished reading.
    pub(crate) fn release_rendezvous(&self, s: &mut ConnState) {
        let ConnState {
            proto, rdv_held, ..
        } = s;
        for seq in proto.take_released() {
            if let Some(pos) = rdv_held.iter().position(|(q, _)| *q == seq) {
                let (_, src) = rdv_held.swap_remove(pos);
                self.retire(Retired::Rendezvous(src));
            }
        }
    }
}
