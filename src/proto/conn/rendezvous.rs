//! Rendezvous: large messages by reference. The sender hands out one descriptor (address,
//! length, rkey of memory it opened for RDMA READ) instead of chunks; the receiver reads the
//! message straight into its destination and answers `Fetched`; only then may the sender
//! release the memory. Messages keep their order: a descriptor is a data message in the
//! stream like any chunk, and the receiver hands out nothing after it until it was read.
//!
//! Both directions are bounded: at most [`RDV_WINDOW`] rendezvous messages are unacknowledged
//! (the sender waits for room; a peer that sends more is in violation), and `Fetched` must
//! name the oldest unacknowledged one (reads happen in message order).

use std::collections::VecDeque;
use std::task::{Context, Poll, Waker};

use super::rdv_state::{DESCRIPTOR_LEN, RDV_WINDOW, RdvOut, RemoteMsg};
use super::{Chunk, ConnProto, Delivery};
use crate::error::{Error, InvalidArgument, ProtocolError};
use crate::proto::msg::MsgKind;

impl<B: AsRef<[u8]>> ConnProto<B> {
    /// Queues a message of `len` bytes to go by rendezvous: its turn comes as for
    /// [`start_send`](Self::start_send), then [`poll_chunk`](Self::poll_chunk) hands out one
    /// chunk, the descriptor (post [`RemoteMsg::encode`] of memory the peer can READ), and
    /// [`poll_fetched`](Self::poll_fetched) resolves once the peer read it.
    ///
    /// # Errors
    ///
    /// As `start_send`; [`Error::InvalidArgument`] if rendezvous was not negotiated or the
    /// message is empty.
    pub fn start_send_rendezvous(&mut self, len: u64) -> Result<u64, Error> {
        if !self.cfg.rendezvous {
            return Err(Error::InvalidArgument(
                InvalidArgument::RendezvousNotNegotiated,
            ));
        }
        if len == 0 {
            return Err(Error::InvalidArgument(InvalidArgument::EmptyRendezvous));
        }
        self.start_send(len)?;
        let msg = self.out.back_mut().expect("just queued");
        msg.rdv = true;
        Ok(msg.id)
    }

    /// Hands out the front message's descriptor (its turn, a data credit and window room
    /// were checked).
    pub(super) fn descriptor_out(&mut self) -> Chunk {
        let msg = self.out.pop_front().expect("front");
        let seq = self.rdv.next_seq;
        self.rdv.next_seq = seq.wrapping_add(1);
        self.rdv.out.push_back(RdvOut {
            id: msg.id,
            seq,
            len: msg.len,
            waker: msg.waker,
            acked: false,
            abandoned: false,
        });
        let imm = self.header(MsgKind::Rendezvous);
        self.counters.sends += 1;
        self.wake_front();
        Chunk {
            offset: 0,
            len: DESCRIPTOR_LEN,
            imm,
            last: true,
            rendezvous: Some(seq),
        }
    }

    /// Ready once the peer read rendezvous message `id` (its memory is released).
    ///
    /// # Errors
    ///
    /// The connection's failure before the peer acknowledged the read.
    pub fn poll_fetched(&mut self, id: u64, cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        let Some(pos) = self.rdv.out.iter().position(|r| r.id == id) else {
            return Poll::Ready(Ok(()));
        };
        if self.rdv.out[pos].acked {
            self.rdv.out.remove(pos);
            return Poll::Ready(Ok(()));
        }
        if let Some(e) = self.failed_error() {
            return Poll::Ready(Err(e));
        }
        let r = &mut self.rdv.out[pos];
        if !r.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            r.waker = Some(cx.waker().clone());
        }
        Poll::Pending
    }

    /// Rendezvous numbers the peer finished reading since the last call: release the memory
    /// their descriptors named.
    pub fn take_released(&mut self) -> impl Iterator<Item = u16> + '_ {
        self.rdv.released.drain(..)
    }

    /// `Fetched` for `seq` arrived.
    pub(super) fn receive_fetched(&mut self, seq: u16) -> Result<(), ProtocolError> {
        let Some(pos) = self.rdv.out.iter().position(|r| !r.acked) else {
            return Err(ProtocolError::StrayFetched);
        };
        let r = &mut self.rdv.out[pos];
        if r.seq != seq {
            return Err(ProtocolError::StrayFetched);
        }
        r.acked = true;
        self.counters.messages_sent += 1;
        self.counters.rendezvous_sent += 1;
        self.counters.bytes_sent += r.len;
        self.rdv.released.push(seq);
        if let Some(w) = r.waker.take() {
            self.wakers.push(w);
        }
        if r.abandoned {
            self.rdv.out.remove(pos);
        }
        // Room in the window for the next message; maybe end of stream may go.
        self.wake_front();
        self.check_close_ready();
        self.kick();
        Ok(())
    }

    /// A descriptor (`data`, the received payload) arrived; its data credit was taken.
    pub(super) fn receive_descriptor(&mut self, data: &[u8]) -> Result<(), ProtocolError> {
        if !self.cfg.rendezvous {
            return Err(ProtocolError::RendezvousNotOffered);
        }
        if self.rx.assembling.is_some() {
            return Err(ProtocolError::RendezvousMidMessage);
        }
        let msg = RemoteMsg::decode(data, self.rx.rdv.next_seq)?;
        if msg.len > self.cfg.max_message_size {
            return Err(ProtocolError::MessageTooLarge(self.cfg.max_message_size));
        }
        if self.rx.rdv.unacked >= RDV_WINDOW {
            return Err(ProtocolError::RendezvousOverrun);
        }
        self.rx.rdv.unacked += 1;
        self.rx.rdv.next_seq = self.rx.rdv.next_seq.wrapping_add(1);
        self.rx.ready.push_back(Delivery::Remote(msg));
        self.rx.wake_all(&mut self.wakers);
        Ok(())
    }

    /// The read of the rendezvous message handed out by `poll_recv` finished (`Ok`: the bytes
    /// are in the destination) or failed (the connection fails with the cause).
    pub fn fetch_done(&mut self, result: Result<(), crate::error::QpFailure>) {
        if let Err(cause) = result {
            self.fail(cause);
            return;
        }
        let Some((msg, done)) = self.rx.rdv.fetching.as_mut() else {
            debug_assert!(false, "fetch_done without a fetch");
            return;
        };
        *done = true;
        let seq = msg.seq;
        self.rx.rdv.unacked -= 1;
        self.rx.rdv.acks.push_back(seq);
        self.rx.wake_all(&mut self.wakers);
        self.kick();
    }

    /// Whether the rendezvous message being read is in its destination, ready to hand out
    /// (`None`: no read in progress).
    pub fn fetch_ready(&self) -> Option<bool> {
        self.rx.rdv.fetching.map(|(_, done)| done)
    }

    /// Takes the next message if it is the rendezvous message `msg`, compared whole (address,
    /// length, key and number); returns whether it did. The shell peeks at a rendezvous
    /// message, registers its destination without the lock, then takes it with this: other
    /// receivers may have taken it meanwhile, and the 16-bit number alone comes round every
    /// 65,536 messages, so a later message with the same number must not be taken for it
    /// (its read would use the stale descriptor's address and key).
    pub fn take_remote(&mut self, msg: &RemoteMsg) -> bool {
        if !matches!(self.peek_recv(), Some(Delivery::Remote(m)) if m == msg) {
            return false;
        }
        let popped = self.poll_recv(&mut Context::from_waker(Waker::noop()));
        debug_assert!(matches!(popped, Poll::Ready(Ok(Some(Delivery::Remote(_))))));
        true
    }

    /// The shell handed the read rendezvous message to the application: it now holds its
    /// bytes (report [`consumed`](Self::consumed) when dropped); later messages may go out.
    pub fn fetch_taken(&mut self) {
        let Some((msg, true)) = self.rx.rdv.fetching.take() else {
            debug_assert!(false, "fetch_taken before fetch_done");
            return;
        };
        self.counters.messages_received += 1;
        self.counters.rendezvous_received += 1;
        self.counters.bytes_received += msg.len;
        self.rx.held_bytes += msg.len;
        self.rx.taken_bytes += msg.len;
        self.rx.wake_all(&mut self.wakers);
    }
}

#[cfg(test)]
mod tests;
