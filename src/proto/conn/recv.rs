//! The receive side of [`ConnProto`]: posted receives, reassembly, the delivery queue and the
//! receive budget.

use std::collections::VecDeque;
use std::task::{Context, Poll, Waker};

use super::credits::CONTROL_RECVS;
use super::{ConnConfig, ConnProto, Delivery};
use crate::error::{Error, ProtocolError, QpFailure};
use crate::proto::msg::{MsgHeader, MsgKind};
impl<B: AsRef<[u8]>> ConnProto<B> {
    /// Receives to post now (each into a receive buffer of the negotiated size). Report what
    /// was posted with [`recvs_posted`](Self::recvs_posted).
    ///
    /// Data receives go back in batches (see [`data_reposts_due`](Self::data_reposts_due));
    /// the first receives and those of control messages go at once.
    pub fn recvs_to_post(&self) -> u32 {
        if self.failure.is_some() {
            return 0;
        }
        self.rx.due_initial + self.rx.due_ctrl + self.data_reposts_due()
    }

    /// Data receives to re-post now: none until a batch is due
    /// ([`repost_batch`](Self::repost_batch)), then all, so most messages received cost no
    /// post (nor a look by the shell's pump) and the receives that go back share one call.
    /// While some are withheld (the application holds its receive budget) every one that may
    /// go, goes at once.
    ///
    /// Never a deadlock: while nothing is withheld, every data receive but the `due_data`
    /// waiting here is on the device, so at least `recv_credits - batch + 1` (one or more, as
    /// the batch is at most `recv_credits`) stay posted for the peer, whose credits return
    /// as soon as the chunks it sends into them complete the batch.
    fn data_reposts_due(&self) -> u32 {
        if self.rx.due_data >= self.repost_batch() || self.rx.withheld > 0 {
            self.rx.due_data
        } else {
            0
        }
    }

    /// Data receives re-posted together: a quarter of `recv_credits`, 1 to 16 (16 credits,
    /// the default: 4).
    pub(super) fn repost_batch(&self) -> u32 {
        (self.cfg.recv_credits / 4).clamp(1, 16)
    }

    /// `n` receives (at most [`recvs_to_post`](Self::recvs_to_post)) were posted.
    pub fn recvs_posted(&mut self, n: u32) {
        let initial = n.min(self.rx.due_initial);
        self.rx.due_initial -= initial;
        let ctrl = (n - initial).min(self.rx.due_ctrl);
        self.rx.due_ctrl -= ctrl;
        for _ in 0..ctrl {
            self.credits.on_ctrl_reposted();
        }
        let data = (n - initial - ctrl).min(self.rx.due_data);
        self.rx.due_data -= data;
        for _ in 0..data {
            self.credits.on_data_reposted();
        }
        self.rx.posted += initial + ctrl + data;
        if self.credits.credit_message_due() || self.credits.confirm_due() {
            self.kick();
        }
    }

    /// A posted receive completed: `Ok((len, imm))` or the failure of its work completion;
    /// `buf` is the receive buffer.
    pub fn handle_recv(&mut self, result: Result<(u32, Option<u32>), QpFailure>, buf: B) {
        self.rx.posted = self.rx.posted.saturating_sub(1);
        let (len, imm) = match result {
            Ok(r) => r,
            Err(cause) => {
                self.fail(cause);
                return;
            }
        };
        if self.failure.is_some() {
            // Delivered before the failure reached us (a disconnect is handled before the
            // completions queued ahead of its flushes): nothing is delivered any more, but its
            // `ctrl ack` may still confirm our end of stream.
            if let Some(h) = imm.and_then(|imm| MsgHeader::decode(imm).ok()) {
                if h.kind != MsgKind::Error && self.credits.on_ctrl_ack(h.ctrl_ack).is_ok() {
                    self.update_eos();
                }
            }
            return;
        }
        self.counters.receives += 1;
        if let Err(e) = self.receive(len, imm, buf) {
            self.violation(e);
        }
        self.update_eos();
    }

    fn receive(&mut self, len: u32, imm: Option<u32>, buf: B) -> Result<(), ProtocolError> {
        let header = MsgHeader::decode(imm.ok_or(ProtocolError::NoImmediate)?)?;
        if header.kind != MsgKind::Error {
            self.credits.on_ctrl_ack(header.ctrl_ack)?;
        }
        if !header.kind.is_data() {
            if len > 0 {
                return Err(ProtocolError::ControlWithPayload(len));
            }
            drop(buf);
            return self.receive_control(header);
        }
        if self.rx.peer_closed {
            return Err(ProtocolError::DataAfterClose);
        }
        self.credits.on_data_received()?;
        self.credits.on_returned(u32::from(header.credits))?;
        self.wake_front();
        if header.kind == MsgKind::Rendezvous {
            let data = buf.as_ref();
            let got = data
                .get(..len as usize)
                .ok_or(ProtocolError::BadDescriptor)?;
            self.receive_descriptor(got)?;
            drop(buf);
            self.repost_data();
            return Ok(());
        }
        let so_far = self.rx.assembling.as_ref().map_or(0, Vec::len) as u64 + u64::from(len);
        if so_far > self.cfg.max_message_size {
            return Err(ProtocolError::MessageTooLarge(self.cfg.max_message_size));
        }
        let data = buf.as_ref();
        let len = len as usize;
        if len > data.len() {
            // The device never reports more than the buffer holds; treat it as a lie.
            return Err(ProtocolError::MessageTooLarge(data.len() as u64));
        }
        self.rx.held_bytes += len as u64;
        match (header.kind, self.rx.assembling.take()) {
            (MsgKind::More, acc) => {
                let mut acc = acc.unwrap_or_default();
                acc.extend_from_slice(&data[..len]);
                self.counters.bytes_reassembled += len as u64;
                self.rx.assembling = Some(acc);
                drop(buf);
            }
            (_, Some(mut acc)) => {
                acc.extend_from_slice(&data[..len]);
                self.counters.bytes_reassembled += len as u64;
                drop(buf);
                self.deliver(Delivery::Assembled(acc));
            }
            (_, None) => {
                self.rx.held_bufs += 1;
                self.deliver(Delivery::Buf { buf, len });
            }
        }
        self.repost_data();
        Ok(())
    }

    fn receive_control(&mut self, header: MsgHeader) -> Result<(), ProtocolError> {
        if header.kind == MsgKind::Error {
            self.fail(QpFailure::PeerReported(ProtocolError::from_code(
                header.credits,
            )));
            return Ok(());
        }
        if header.kind == MsgKind::Fetched {
            // The low bits name the rendezvous message, not credits.
            self.receive_fetched(header.credits)?;
        } else {
            self.credits.on_returned(u32::from(header.credits))?;
            self.wake_front();
        }
        match header.kind {
            MsgKind::Close => {
                if self.rx.assembling.is_some() {
                    return Err(ProtocolError::CloseMidMessage);
                }
                if self.rx.peer_closed {
                    return Err(ProtocolError::DataAfterClose);
                }
                self.rx.peer_closed = true;
                self.rx.wake_all(&mut self.wakers);
            }
            MsgKind::Abort => {
                let Some(partial) = self.rx.assembling.take() else {
                    return Err(ProtocolError::StrayAbort);
                };
                self.rx.held_bytes -= partial.len() as u64;
                self.counters.aborts_received += 1;
                self.release_withheld();
            }
            _ => {}
        }
        // A control message's receive goes straight back (confirmed in `ctrl ack`).
        self.note_control_in(header.kind == MsgKind::Close);
        self.rx.due_ctrl += 1;
        self.kick();
        Ok(())
    }

    fn deliver(&mut self, d: Delivery<B>) {
        self.counters.messages_received += 1;
        self.counters.bytes_received += d.len() as u64;
        self.rx.ready.push_back(d);
        self.rx.wake_all(&mut self.wakers);
    }

    fn may_repost(&self) -> bool {
        self.rx.held_bufs < self.cfg.recv_credits && self.rx.held_bytes < self.cfg.recv_budget
    }

    /// A data receive completed: re-post it (with its batch) if the budget allows, else later.
    fn repost_data(&mut self) {
        if self.may_repost() {
            self.rx.due_data += 1;
            if self.data_reposts_due() > 0 {
                self.kick();
            }
        } else {
            self.rx.withheld += 1;
            self.counters.reposts_withheld += 1;
        }
    }

    fn release_withheld(&mut self) {
        while self.rx.withheld > 0 && self.may_repost() {
            self.rx.withheld -= 1;
            self.rx.due_data += 1;
            self.kick();
        }
    }

    /// The next message, `Ok(None)` after the peer's end of stream (every message sent before
    /// it was delivered), or the connection's failure. A message leaves the queue only when
    /// returned here. When the application is done with it, report
    /// [`consumed`](Self::consumed).
    ///
    /// # Errors
    ///
    /// The connection's failure (never reported as end of stream).
    ///
    /// A [`Delivery::Remote`] is the rendezvous message the shell must now read (then
    /// [`fetch_done`](Self::fetch_done) and [`fetch_taken`](Self::fetch_taken)); until it was
    /// taken, this waits.
    pub fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<Delivery<B>>, Error>> {
        if self.rx.rdv.fetching.is_some() {
            if let Some(e) = self.failed_error() {
                return Poll::Ready(Err(e));
            }
            self.park_recv(cx);
            return Poll::Pending;
        }
        if !self.front_admissible() {
            self.park_recv(cx);
            return Poll::Pending;
        }
        if let Some(d) = self.rx.ready.pop_front() {
            match &d {
                Delivery::Remote(m) => self.rx.rdv.fetching = Some((*m, false)),
                d => self.rx.taken_bytes += d.len() as u64,
            }
            return Poll::Ready(Ok(Some(d)));
        }
        if self.rx.peer_closed {
            return Poll::Ready(Ok(None));
        }
        if let Some(e) = self.failed_error() {
            return Poll::Ready(Err(e));
        }
        self.park_recv(cx);
        Poll::Pending
    }

    /// Whether a receive would find nothing to return now: no message queued, no rendezvous
    /// read under way, no end of stream and no failure. Only a hint for the shell (it polls
    /// its completion queue before it looks at the state when this says so); a receive always
    /// looks before it waits.
    pub fn recv_idle(&self) -> bool {
        self.rx.ready.is_empty()
            && self.rx.rdv.fetching.is_none()
            && !self.rx.peer_closed
            && self.failure.is_none()
    }

    /// The next message `poll_recv` would return, if one is queued and no rendezvous read is
    /// in progress (to check its length first).
    pub fn peek_recv(&self) -> Option<&Delivery<B>> {
        match self.rx.rdv.fetching {
            Some(_) => None,
            None => self.rx.ready.front().filter(|_| self.front_admissible()),
        }
    }

    /// Whether the next message may be handed out: a rendezvous message is read only while
    /// the received data leaves room for it in the receive budget, or when the application
    /// holds no message (so data queued behind it never blocks it for good). Received data
    /// thus stays within the budget plus the chunks in flight plus one message.
    fn front_admissible(&self) -> bool {
        match self.rx.ready.front() {
            Some(Delivery::Remote(m)) => {
                self.rx.taken_bytes == 0 || self.rx.held_bytes + m.len <= self.cfg.recv_budget
            }
            _ => true,
        }
    }

    /// Whether a consumed message must be reported now rather than at the shell's next look:
    /// receives are withheld (the report lets them go back, and the peer may wait for their
    /// credits), or a rendezvous message waits for room in the receive budget. Otherwise a
    /// report only lowers the counts that the next receipt checks, and every receipt is a
    /// look at the state, where the shell gives the reports it held back first. The
    /// randomized tests hold reports back whenever this allows.
    pub fn consumption_urgent(&self) -> bool {
        self.rx.withheld > 0 || matches!(self.rx.ready.front(), Some(Delivery::Remote(_)))
    }

    /// Wakes every task waiting to receive (the shell changed who may take what).
    pub fn wake_receivers(&mut self) {
        self.rx.wake_all(&mut self.wakers);
    }

    /// Registers the task to wake when a message arrives (or the state changes).
    pub fn park_recv(&mut self, cx: &mut Context<'_>) {
        if !self.rx.wakers.iter().any(|w| w.will_wake(cx.waker())) {
            if self.rx.wakers.len() >= 64 {
                // Receives dropped while waiting leave their wakers behind: wake them all
                // (harmless) rather than let the list grow.
                self.rx.wake_all(&mut self.wakers);
            }
            self.rx.wakers.push(cx.waker().clone());
        }
    }

    /// The application dropped a delivered message of `len` bytes (`buffer`: it held a
    /// receive buffer, [`Delivery::holds_buffer`]). Withheld receives may go back.
    pub fn consumed(&mut self, buffer: bool, len: usize) {
        self.consumed_many(u32::from(buffer), len as u64);
    }

    /// The application dropped delivered messages of `bytes` bytes in all, `bufs` of which
    /// held a receive buffer: the same as a [`consumed`](Self::consumed) for each.
    ///
    /// A shell may hold such reports back and give them together, at its next look at the
    /// state, while [`consumption_urgent`](Self::consumption_urgent) is false: until then a
    /// report changes nothing but the counts.
    pub fn consumed_many(&mut self, bufs: u32, bytes: u64) {
        self.rx.held_bytes = self.rx.held_bytes.saturating_sub(bytes);
        self.rx.taken_bytes = self.rx.taken_bytes.saturating_sub(bytes);
        self.rx.held_bufs = self.rx.held_bufs.saturating_sub(bufs);
        self.release_withheld();
        if matches!(self.rx.ready.front(), Some(Delivery::Remote(_))) {
            // It may fit the budget now.
            self.rx.wake_all(&mut self.wakers);
        }
    }
}
