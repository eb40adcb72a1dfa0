//! [`ConnProto`]: the protocol of one message connection as a sans-IO state machine.
//!
//! Everything a connection decides lives here: credits in both directions, the order of
//! messages and their chunking, reassembly, the receive budget, control messages (credit
//! returns, end of stream, abort, error), keepalive deadlines, close and failure. It performs no
//! I/O and reads no clock: the shell feeds it events and does what it asks, in the shape of
//! quinn-proto's `Connection`:
//!
//! * user calls: [`start_send`](ConnProto::start_send) / [`poll_chunk`](ConnProto::poll_chunk)
//!   / [`cancel_send`](ConnProto::cancel_send), [`poll_recv`](ConnProto::poll_recv) /
//!   [`consumed`](ConnProto::consumed), [`close`](ConnProto::close);
//! * what happened: [`established`](ConnProto::established) (the queue pair can send; a
//!   connection made [`opening`](ConnProto::opening) sends no control message before),
//!   [`handle_recv`](ConnProto::handle_recv) (a receive completed),
//!   [`handle_control_done`](ConnProto::handle_control_done) (a control send completed),
//!   [`handle_timeout`](ConnProto::handle_timeout), [`fail`](ConnProto::fail);
//! * what to do next: [`recvs_to_post`](ConnProto::recvs_to_post) then
//!   [`recvs_posted`](ConnProto::recvs_posted), [`poll_transmit`](ConnProto::poll_transmit)
//!   (control messages), [`poll_timeout`](ConnProto::poll_timeout), and
//!   [`take_wakers`](ConnProto::take_wakers) (tasks to wake, outside any lock).
//!
//! # Guarantees (each checked by the randomized tests in `tests.rs`)
//!
//! * **Message integrity.** Messages go out one at a time, in the order `start_send` was
//!   called; a message's chunks are contiguous on the wire. A send cancelled after some of its
//!   chunks were handed out is followed by an `Abort` before anything else, so the peer drops
//!   the partial message; a send cancelled before its first chunk leaves no trace.
//! * **Exactly once.** A delivered message leaves the queue only when `poll_recv` returns it.
//! * **Bounded receive memory.** A data receive is re-posted (and its credit returned) only
//!   while the application holds fewer than `recv_credits` receive buffers and fewer than
//!   `recv_budget` bytes of received data; otherwise the sender waits.
//! * **No deadlock, no receiver-not-ready.** Control messages have a window and receives of
//!   their own (see [`Credits`]), so credit returns never wait for the peer's application and
//!   never use a receive a data chunk was promised.
//! * **Nothing goes out before the handshake is done.** A connection made
//!   [`opening`](ConnProto::opening) takes the peer's messages but hands out no control
//!   message until [`established`](ConnProto::established); what it owes by then goes out
//!   after.
//! * **Failures are loud.** A protocol violation fails the connection with its
//!   [`ProtocolError`] (and tells the peer, unless the report cannot go out and complete
//!   within `keepalive_timeout`: the disconnect never waits longer for it); a failure is never
//!   reported as a clean close; a control message (or keepalive) outstanding for
//!   `keepalive_timeout` without any sign of life from the peer (no receive, no completion)
//!   fails it with [`QpFailure::KeepaliveTimeout`].
#![forbid(unsafe_code)]

mod close;
#[cfg(test)]
mod close_tests;
mod credits;
mod eos;
#[cfg(test)]
mod hostile_tests;
#[cfg(test)]
mod keepalive_tests;
mod rdv_state;
mod recv;
#[cfg(test)]
mod recv_tests;
mod rendezvous;
mod rx;
#[cfg(test)]
mod settle_checks;
#[cfg(test)]
mod tests;
mod types;

use std::collections::VecDeque;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

pub use credits::{CONTROL_RECVS, CONTROL_WINDOW, Credits};
pub use rdv_state::{DESCRIPTOR_LEN, RDV_WINDOW, RemoteMsg};
pub use types::{Chunk, ConnConfig, ConnCounters, Delivery, Transmit};

use super::msg::{MsgHeader, MsgKind};
use crate::error::{Error, InvalidArgument, ProtocolError, QpFailure};

#[derive(Debug)]
struct OutMsg {
    id: u64,
    len: u64,
    offset: u64,
    chunks: u32,
    waker: Option<Waker>,
    /// Goes by rendezvous: one descriptor instead of chunks.
    rdv: bool,
}

/// Whether deadline `t` comes before deadline `than` (`None`: never).
pub fn earlier(t: Option<Instant>, than: Option<Instant>) -> bool {
    match (t, than) {
        (Some(t), Some(than)) => t < than,
        (Some(_), None) => true,
        _ => false,
    }
}

/// Wakers a connection has room for before its list grows.
const WAKERS_RESERVED: usize = 8;

/// The protocol state machine of one connection. `B` is a receive buffer.
#[derive(Debug)]
pub struct ConnProto<B> {
    cfg: ConnConfig,
    credits: Credits,
    failure: Option<QpFailure>,
    /// The application asked to close: no new messages; `Close` goes out after the queue.
    local_closed: bool,
    /// Since when end of stream has waited for what must go out before it (see
    /// [`ConnConfig::close_timeout`]).
    close_waiting_since: Option<Instant>,
    /// Disconnect once end of stream is acknowledged, without waiting for the peer's.
    full_close: bool,
    close_sent: bool,
    close_done: bool,
    close_wakers: Vec<Waker>,
    /// End-of-stream bookkeeping: delivery of both `Close`s, what a close reports.
    eos: eos::Eos,
    // Sending.
    next_id: u64,
    out: VecDeque<OutMsg>,
    pending_abort: bool,
    pending_error: Option<ProtocolError>,
    error_sent: bool,
    /// Since when the error report waits for room in the control window.
    error_blocked_since: Option<Instant>,
    /// The error report could not go out, or did not complete, within the keepalive timeout:
    /// the disconnect no longer waits for it.
    error_abandoned: bool,
    /// When each control message in flight (handed out, not completed) was handed out.
    control_inflight: VecDeque<Instant>,
    /// Since when a due control message waits for the peer's confirmation.
    ctrl_blocked_since: Option<Instant>,
    /// When the peer last showed it is alive (a receive arrived, or a control message of
    /// ours completed).
    last_heard: Instant,
    // Keepalive.
    keepalive_due: bool,
    next_keepalive: Option<Instant>,
    // Rendezvous messages whose descriptor went out.
    rdv: rdv_state::RdvSend,
    // Receiving.
    rx: rx::RecvState<B>,
    wakers: Vec<Waker>,
    driver_kick: bool,
    /// The earliest deadline ([`poll_timeout`](ConnProto::poll_timeout)) may have moved
    /// earlier since the shell last took this flag (see
    /// [`take_deadline_moved`](ConnProto::take_deadline_moved)).
    deadline_moved: bool,
    /// The handshake is not done yet: the queue pair may still be in RTR (the passive side
    /// accepted, and the client's messages may arrive, before `ESTABLISHED` moves it to
    /// RTS), where a send cannot be posted. Control messages wait until
    /// [`established`](ConnProto::established).
    opening: bool,
    counters: ConnCounters,
}

impl<B: AsRef<[u8]>> ConnProto<B> {
    /// A connection just established with `cfg`, at time `now`. Its first receives are due
    /// ([`recvs_to_post`](Self::recvs_to_post)): post them before the peer learns the credits.
    pub fn new(cfg: ConnConfig, now: Instant) -> ConnProto<B> {
        ConnProto {
            credits: Credits::new(
                cfg.send_initial,
                cfg.send_credits,
                cfg.recv_initial,
                cfg.recv_credits,
            ),
            rx: rx::RecvState::new(&cfg),
            cfg,
            failure: None,
            local_closed: false,
            close_waiting_since: None,
            full_close: false,
            close_sent: false,
            close_done: false,
            close_wakers: Vec::new(),
            eos: eos::Eos::default(),
            next_id: 0,
            out: VecDeque::new(),
            rdv: rdv_state::RdvSend::default(),
            pending_abort: false,
            pending_error: None,
            error_sent: false,
            error_blocked_since: None,
            error_abandoned: false,
            // The window bounds it (plus a confirm-only message's room of its own): reserved
            // now, so the first keepalive of a quiet connection does not allocate.
            control_inflight: VecDeque::with_capacity(CONTROL_WINDOW as usize + 1),
            ctrl_blocked_since: None,
            last_heard: now,
            keepalive_due: false,
            next_keepalive: cfg.keepalive.and_then(|k| now.checked_add(k)),
            // Room for the futures that usually wait at once (a sender and a receiver
            // per side, a close): waking them does not grow the list in steady state.
            wakers: Vec::with_capacity(WAKERS_RESERVED),
            driver_kick: false,
            deadline_moved: true,
            opening: false,
            counters: ConnCounters::default(),
        }
    }

    /// A connection whose handshake is not done yet, at time `now`: as [`new`](Self::new)
    /// (its first receives are due), but it hands out no control message (credit returns,
    /// keepalives, error reports for what the peer sent meanwhile) until
    /// [`established`](Self::established): its receives may complete while the queue pair
    /// cannot send yet.
    pub fn opening(cfg: ConnConfig, now: Instant) -> ConnProto<B> {
        let mut p = Self::new(cfg, now);
        p.opening = true;
        p
    }

    /// The handshake is done (the queue pair can send): control messages held since
    /// [`opening`](Self::opening) are due, and the keepalive counts from `now`. Idempotent.
    pub fn established(&mut self, now: Instant) {
        if !std::mem::take(&mut self.opening) {
            return;
        }
        self.last_heard = self.last_heard.max(now);
        self.next_keepalive = self.cfg.keepalive.and_then(|k| now.checked_add(k));
        self.deadline_moved = true;
        self.kick();
    }

    /// The configuration.
    pub fn config(&self) -> &ConnConfig {
        &self.cfg
    }

    /// The counters.
    pub fn counters(&self) -> ConnCounters {
        self.counters
    }

    /// The credit state (for diagnostics and tests).
    pub fn credits(&self) -> &Credits {
        &self.credits
    }

    /// The failure, if the connection failed.
    pub fn failure(&self) -> Option<&QpFailure> {
        self.failure.as_ref()
    }

    /// Bytes of received data the application holds (delivered or queued, and partial
    /// messages), and receive buffers it holds.
    pub fn held(&self) -> (u64, u32) {
        (self.rx.held_bytes, self.rx.held_bufs)
    }

    /// Whether the peer sent end of stream.
    pub fn peer_closed(&self) -> bool {
        self.rx.peer_closed
    }

    /// Tasks to wake (after releasing any lock around the state machine).
    pub fn take_wakers(&mut self) -> impl Iterator<Item = Waker> + '_ {
        self.wakers.drain(..)
    }

    /// Whether the shell's driver has new work (receives to post, control messages, a new
    /// timeout); clears the flag.
    pub fn take_driver_kick(&mut self) -> bool {
        std::mem::take(&mut self.driver_kick)
    }

    fn kick(&mut self) {
        self.driver_kick = true;
    }

    /// Whether the shell's pump would find nothing to do: no receives to post, no control
    /// message due ([`poll_transmit`](Self::poll_transmit) would return `None` and change
    /// nothing), no task to wake, no driver kick, no rendezvous memory to release, and no
    /// deadline that may have moved earlier. The shell then skips the pump (and its clock
    /// read): most looks at the state (a receive that finds nothing, a send that hands out a
    /// chunk) leave it settled. Only the open connection's steady state counts as settled: a
    /// closing or failed one always pumps.
    pub fn settled(&self) -> bool {
        !self.driver_kick
            && !self.deadline_moved
            && self.wakers.is_empty()
            && self.rdv.released.is_empty()
            && self.recvs_to_post() == 0
            && self.transmit_idle()
    }

    /// Whether [`poll_transmit`](Self::poll_transmit) has nothing to do: it would return
    /// `None` and change no state. A conservative test (the randomized tests check it against
    /// `poll_transmit`): the handshake is not done yet (nothing goes out), or the connection
    /// is open and not failed, and no control message is due or blocked.
    pub fn transmit_idle(&self) -> bool {
        self.opening
            || (self.failure.is_none()
                && self.pending_error.is_none()
                && !self.local_closed
                && !self.close_done
                && !self.rx.peer_closed
                && !self.pending_abort
                && !self.keepalive_due
                && self.ctrl_blocked_since.is_none()
                && self.rx.rdv.ack_due().is_none()
                && !self.credits.credit_message_due()
                && !self.credits.confirm_due()
                && !self.eos_confirm_due())
    }

    /// Whether [`poll_timeout`](Self::poll_timeout) may be earlier than it was when this was
    /// last called; clears the flag. While it returns `false`, the deadline only stayed or
    /// moved later (the peer was heard, a control message completed), so a shell whose timer
    /// is set for the deadline it last took need not look again. A closing or failed
    /// connection always answers `true`.
    pub fn take_deadline_moved(&mut self) -> bool {
        let moved = std::mem::take(&mut self.deadline_moved);
        moved
            || self.failure.is_some()
            || self.local_closed
            || self.close_done
            || self.rx.peer_closed
    }

    fn failed_error(&self) -> Option<Error> {
        self.failure.clone().map(Error::QpFailed)
    }

    // ---- sending -------------------------------------------------------------------------

    /// Queues a message of `len` bytes; its chunks are handed out by
    /// [`poll_chunk`](Self::poll_chunk) in queue order.
    ///
    /// # Errors
    ///
    /// The connection's failure; [`QpFailure::Closed`] after [`close`](Self::close);
    /// [`Error::InvalidArgument`] for a message over the negotiated maximum.
    pub fn start_send(&mut self, len: u64) -> Result<u64, Error> {
        self.check_send(len)?;
        Ok(self.queue(len, false))
    }

    /// Whether a message of `len` bytes may be sent now (see [`start_send`](Self::start_send)'s
    /// errors).
    fn check_send(&self, len: u64) -> Result<(), Error> {
        if let Some(e) = self.failed_error() {
            return Err(e);
        }
        if self.local_closed {
            return Err(Error::QpFailed(QpFailure::Closed));
        }
        if len > self.cfg.max_message_size {
            return Err(Error::InvalidArgument(InvalidArgument::MessageTooLarge {
                len,
                max: self.cfg.max_message_size,
            }));
        }
        Ok(())
    }

    /// A one-chunk message of `len` bytes handed out at once, the way
    /// [`start_send`](Self::start_send) then [`poll_chunk`](Self::poll_chunk) would hand it
    /// out: `Some(chunk)` when it fits one chunk, no message is queued before it, no abort is
    /// pending and a data credit is free (the caller must post the chunk before the next
    /// hand-out). `None`: nothing changed; queue the message with `start_send`.
    ///
    /// # Errors
    ///
    /// As [`start_send`](Self::start_send).
    pub fn send_now(&mut self, len: u64) -> Result<Option<Chunk>, Error> {
        self.check_send(len)?;
        if len > u64::from(self.cfg.max_send_size)
            || !self.out.is_empty()
            || self.pending_abort
            || !self.credits.try_take_data()
        {
            return Ok(None);
        }
        // As if queued and handed out whole: its number is taken, nobody waits behind it.
        self.next_id += 1;
        let imm = self.header(MsgKind::Last);
        self.counters.sends += 1;
        self.counters.messages_sent += 1;
        self.counters.bytes_sent += len;
        Ok(Some(Chunk {
            offset: 0,
            len: len as u32,
            imm,
            last: true,
            rendezvous: None,
        }))
    }

    fn queue(&mut self, len: u64, rdv: bool) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.out.push_back(OutMsg {
            id,
            len,
            offset: 0,
            chunks: 0,
            waker: None,
            rdv,
        });
        id
    }

    /// Ready once message `id` is the one being sent (all before it went out whole or were
    /// cancelled, and any abort is posted): then acquire the staging buffer for its next chunk
    /// and call [`poll_chunk`](Self::poll_chunk). Only the message whose turn it is should hold
    /// a staging buffer, so waiting messages never starve it.
    ///
    /// # Errors
    ///
    /// The connection's failure.
    pub fn poll_turn(&mut self, id: u64, cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        if let Some(e) = self.failed_error() {
            return Poll::Ready(Err(e));
        }
        if !self.pending_abort && self.out.front().is_some_and(|m| m.id == id) {
            return Poll::Ready(Ok(()));
        }
        self.park(id, cx);
        Poll::Pending
    }

    fn park(&mut self, id: u64, cx: &mut Context<'_>) {
        let msg = self
            .out
            .iter_mut()
            .find(|m| m.id == id)
            .expect("message is queued");
        match &msg.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            _ => msg.waker = Some(cx.waker().clone()),
        }
    }

    /// The next chunk of message `id`, once it is the message being sent and a data credit is
    /// free. The caller must post the chunk (copying `len` bytes at `offset`) before the next
    /// call that may hand out a SEND, so the wire order is the order of hand-out.
    ///
    /// # Errors
    ///
    /// The connection's failure.
    ///
    /// # Panics
    ///
    /// If `id` is not queued (already finished or cancelled).
    pub fn poll_chunk(&mut self, id: u64, cx: &mut Context<'_>) -> Poll<Result<Chunk, Error>> {
        if let Some(e) = self.failed_error() {
            return Poll::Ready(Err(e));
        }
        let blocked = self.pending_abort
            || self
                .out
                .front()
                .is_none_or(|m| m.id != id || (m.rdv && !self.rdv.has_room()));
        if blocked || !self.credits.try_take_data() {
            if !blocked {
                self.counters.credit_waits += 1;
            }
            self.park(id, cx);
            return Poll::Pending;
        }
        if self.out.front().is_some_and(|m| m.rdv) {
            return Poll::Ready(Ok(self.descriptor_out()));
        }
        let msg = self.out.front_mut().expect("checked above");
        let len = (msg.len - msg.offset).min(u64::from(self.cfg.max_send_size)) as u32;
        let offset = msg.offset;
        msg.offset += u64::from(len);
        msg.chunks += 1;
        let last = msg.offset == msg.len;
        let kind = if last { MsgKind::Last } else { MsgKind::More };
        let imm = self.header(kind);
        self.counters.sends += 1;
        if last {
            let done = self.out.pop_front().expect("front");
            self.counters.messages_sent += 1;
            self.counters.bytes_sent += done.len;
            self.wake_front();
        }
        Poll::Ready(Ok(Chunk {
            offset,
            len,
            imm,
            last,
            rendezvous: None,
        }))
    }

    /// The send of message `id` was dropped. Not started: forgotten. Part-way: an `Abort`
    /// goes out before anything else, so the peer drops the partial message. Already fully
    /// handed out: nothing to do (the message is complete on the wire).
    /// A rendezvous message whose descriptor went out stays on the books until the peer read
    /// it (its memory is released only then, see [`take_released`](Self::take_released)).
    pub fn cancel_send(&mut self, id: u64) {
        let Some(pos) = self.out.iter().position(|m| m.id == id) else {
            self.rdv.abandon(id);
            return;
        };
        let msg = self.out.remove(pos).expect("found");
        if msg.chunks > 0 {
            self.pending_abort = true;
            self.counters.aborts_sent += 1;
            self.kick();
        }
        if pos == 0 {
            self.wake_front();
        }
        self.check_close_ready();
    }

    fn wake_front(&mut self) {
        if let Some(w) = self.out.front_mut().and_then(|m| m.waker.take()) {
            self.wakers.push(w);
        }
    }

    fn header(&mut self, kind: MsgKind) -> u32 {
        MsgHeader {
            kind,
            ctrl_ack: self.credits.take_ctrl_ack(),
            credits: self.credits.take_owed(),
        }
        .encode()
    }

    /// The next control message to post, if one is due and the control window has room: a
    /// pending error report, an abort, end of stream, a keepalive, or a credit return.
    pub fn poll_transmit(&mut self, now: Instant) -> Option<Transmit> {
        if self.opening {
            return None;
        }
        self.note_close_wait(now);
        if let Some(e) = self.pending_error {
            if self.error_sent || self.error_abandoned {
                return None;
            }
            if !self.take_control(now, true) {
                // The peer has not confirmed our last control messages (a hostile peer may
                // never): the report waits, at most the keepalive timeout.
                self.error_blocked_since.get_or_insert(now);
                return None;
            }
            self.error_sent = true;
            let imm = MsgHeader {
                kind: MsgKind::Error,
                ctrl_ack: self.credits.take_ctrl_ack(),
                credits: e.code(),
            }
            .encode();
            return Some(Transmit {
                kind: MsgKind::Error,
                imm,
            });
        }
        if self.failure.is_some() {
            return None;
        }
        // A `Fetched` waiting for room in the control window must not keep a confirm-only
        // credit message (which has room of its own) from going out: two sides each waiting
        // for the other's confirmation would wait forever.
        let rdv_ack =
            self.rx.rdv.ack_due().filter(|_| {
                !self.pending_abort && self.credits.ctrl_unconfirmed() < CONTROL_WINDOW
            });
        let kind = if self.pending_abort {
            MsgKind::Abort
        } else if let Some(seq) = rdv_ack {
            let taken = self.take_control(now, false);
            debug_assert!(taken, "room checked above");
            self.ctrl_blocked_since = None;
            self.rx.rdv.ack_sent();
            let imm = MsgHeader {
                kind: MsgKind::Fetched,
                ctrl_ack: self.credits.take_ctrl_ack(),
                credits: seq,
            }
            .encode();
            self.note_control_out(false);
            return Some(Transmit {
                kind: MsgKind::Fetched,
                imm,
            });
        } else if self.local_closed && !self.close_sent && self.all_sent() {
            MsgKind::Close
        } else if self.keepalive_due
            || self.credits.credit_message_due()
            || self.credits.confirm_due()
            || self.eos_confirm_due()
        {
            MsgKind::Credit
        } else if self.rx.rdv.ack_due().is_some() {
            // Blocked by the window (checked above).
            self.note_ctrl_blocked(now);
            return None;
        } else {
            self.ctrl_blocked_since = None;
            return None;
        };
        let confirm_only = kind == MsgKind::Credit && self.credits.confirm_due();
        if !self.take_control(now, confirm_only) {
            // The peer has not confirmed our last control messages yet. If it waits for our
            // confirmation too, an abort or end of stream that does not fit must not keep the
            // confirm-only credit message (room of its own) from going out.
            if kind != MsgKind::Credit && self.credits.confirm_due() && self.take_control(now, true)
            {
                self.note_ctrl_blocked(now);
                self.counters.credit_messages += 1;
                let imm = self.header(MsgKind::Credit);
                self.note_control_out(false);
                return Some(Transmit {
                    kind: MsgKind::Credit,
                    imm,
                });
            }
            self.note_ctrl_blocked(now);
            return None;
        }
        self.ctrl_blocked_since = None;
        match kind {
            MsgKind::Abort => {
                self.pending_abort = false;
                self.wake_front();
            }
            MsgKind::Close => self.close_sent = true,
            _ => {
                self.keepalive_due = false;
                self.counters.credit_messages += 1;
            }
        }
        let imm = self.header(kind);
        self.note_control_out(kind == MsgKind::Close);
        Some(Transmit { kind, imm })
    }

    /// A due control message waits for the peer's confirmation: from now on, under the
    /// keepalive timeout's deadline.
    fn note_ctrl_blocked(&mut self, now: Instant) {
        if self.ctrl_blocked_since.is_none() {
            self.ctrl_blocked_since = Some(now);
            self.deadline_moved = true;
        }
    }

    fn take_control(&mut self, now: Instant, confirm_only: bool) -> bool {
        if !self.credits.try_take_control(confirm_only) {
            return false;
        }
        // In flight from now: under the keepalive timeout's deadline (and a keepalive that
        // was due goes out, so the next one's time counts again).
        self.deadline_moved = true;
        self.control_inflight.push_back(now);
        self.counters.sends += 1;
        true
    }

    /// A control message handed out by [`poll_transmit`](Self::poll_transmit) completed.
    pub fn handle_control_done(
        &mut self,
        kind: MsgKind,
        result: Result<(), QpFailure>,
        now: Instant,
    ) {
        self.control_inflight.pop_front();
        self.deadline_moved = true;
        if let Err(cause) = result {
            self.fail(cause);
            return;
        }
        // Not a sign of life: the peer's NIC (or its kernel, for soft-RoCE) acknowledges a
        // send even while the peer process is stopped. Only what the peer sends counts.
        // Our `Close` delivered, or our confirmation of the peer's (see `close.rs`).
        self.note_control_done();
        if kind == MsgKind::Credit {
            if let Some(k) = self.cfg.keepalive {
                self.next_keepalive = now.checked_add(k);
            }
        }
        self.kick();
    }

    // ---- time ----------------------------------------------------------------------------

    /// When [`handle_timeout`](Self::handle_timeout) must be called next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.failure.is_some() {
            // Only an error report still to go out (or to complete) has a deadline.
            if !self.error_report_pending() {
                return None;
            }
            return self
                .error_report_since()
                .and_then(|t| t.checked_add(self.cfg.keepalive_timeout));
        }
        let deadline = [
            self.waiting_since()
                .and_then(|t| t.checked_add(self.cfg.keepalive_timeout)),
            self.silence_deadline(),
        ]
        .into_iter()
        .flatten()
        .min();
        let keepalive = if self.keepalive_due {
            None
        } else {
            self.next_keepalive
        };
        [
            deadline,
            keepalive,
            self.close_deadline(),
            self.linger_deadline(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Time passed: a keepalive may be due, a control message overdue (the peer is gone), or
    /// the close timeout expired (see [`ConnConfig::close_timeout`]).
    pub fn handle_timeout(&mut self, now: Instant) {
        self.deadline_moved = true;
        if self.failure.is_some() {
            let overdue = self
                .error_report_since()
                .is_some_and(|t| now.saturating_duration_since(t) >= self.cfg.keepalive_timeout);
            if self.error_report_pending() && overdue {
                // The peer takes no error report (no receive posted, or it never confirms our
                // control messages): disconnect without it.
                self.error_abandoned = true;
                self.kick();
            }
            return;
        }
        let waited_out = self.waiting_since().is_some_and(|since| {
            now.saturating_duration_since(since) >= self.cfg.keepalive_timeout
        });
        let silent = self.silence_deadline().is_some_and(|at| now >= at);
        if waited_out || silent {
            self.fail(QpFailure::KeepaliveTimeout(self.cfg.keepalive_timeout));
            return;
        }
        self.note_close_wait(now);
        self.linger_timeout(now);
        if self.close_deadline().is_some_and(|at| now >= at) {
            // A live peer that does not take what is left (never returns credits, never reads
            // a rendezvous message): tear down without end of stream, releasing the memory.
            self.fail(QpFailure::CloseTimeout(self.cfg.close_timeout));
            return;
        }
        if let Some(at) = self.next_keepalive {
            if now >= at && !self.keepalive_due {
                self.keepalive_due = true;
                self.next_keepalive = self.cfg.keepalive.and_then(|k| now.checked_add(k));
                self.kick();
            }
        }
    }

    /// The peer showed it is alive at `now` (a receive arrived): the keepalive deadline runs
    /// from the last sign of life, so a slow but live peer is not declared dead.
    pub fn heard(&mut self, now: Instant) {
        if now > self.last_heard {
            self.last_heard = now;
        }
    }

    /// With keepalives on, a live peer sends something (its own keepalive at least) every
    /// `keepalive` (both ends use the same interval; a peer with a longer one is still heard
    /// every two of our control messages, when it confirms them): silence for `keepalive +
    /// keepalive_timeout` since the last thing received means the peer is gone, even when every
    /// send of ours completes (a stopped process's NIC or kernel still acknowledges them).
    fn silence_deadline(&self) -> Option<Instant> {
        self.cfg.keepalive.and_then(|k| {
            self.last_heard
                .checked_add(k)?
                .checked_add(self.cfg.keepalive_timeout)
        })
    }

    /// Since when this side has been waiting for the peer without hearing from it: the oldest
    /// control message in flight or blocked on the window, unless the peer was heard since.
    fn waiting_since(&self) -> Option<Instant> {
        let oldest = [
            self.control_inflight.front().copied(),
            self.ctrl_blocked_since,
        ]
        .into_iter()
        .flatten()
        .min()?;
        Some(oldest.max(self.last_heard))
    }

    // ---- failure -------------------------------------------------------------------------

    /// Fails the connection with `cause` (the first cause is kept). Every waiting task is
    /// woken; every later call reports the failure. Returns whether this was the first
    /// failure (the shell then moves the queue pair to the error state and disconnects, after
    /// the error report, if one is pending, went out).
    pub fn fail(&mut self, cause: QpFailure) -> bool {
        if self.failure.is_some() {
            return false;
        }
        self.failure = Some(cause);
        self.deadline_moved = true;
        self.note_failure();
        for m in &mut self.out {
            if let Some(w) = m.waker.take() {
                self.wakers.push(w);
            }
        }
        self.wakers.append(&mut self.close_wakers);
        self.rdv.wake_all(&mut self.wakers);
        self.rx.wake_all(&mut self.wakers);
        self.kick();
        true
    }

    /// The peer broke the protocol: fail with [`QpFailure::Protocol`] and queue an error
    /// report to the peer.
    fn violation(&mut self, e: ProtocolError) {
        if self.fail(QpFailure::Protocol(e)) {
            self.pending_error = Some(e);
        }
    }

    /// Whether an error report to the peer is still to go out (hold the disconnect until it
    /// completed or, after the keepalive timeout, was given up; see
    /// [`handle_timeout`](Self::handle_timeout)).
    pub fn error_report_pending(&self) -> bool {
        self.pending_error.is_some()
            && !self.error_abandoned
            && (!self.error_sent || !self.control_inflight.is_empty())
    }

    /// Since when the error report has been waiting: for room in the control window, or for
    /// the completion of the control messages in flight (the report among them).
    fn error_report_since(&self) -> Option<Instant> {
        [
            self.error_blocked_since,
            self.control_inflight.front().copied(),
        ]
        .into_iter()
        .flatten()
        .min()
    }
}
