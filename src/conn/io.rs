//! [`ConnIo`]: the connection's message I/O, with no task in between. It owns the protocol
//! state machine (behind the connection's one lock), the receives and message sends posted on
//! the queue pair, and it is the queue pair's completion [`Sink`]: whoever polls the
//! completion queue (the application's own `recv` or `send` while it waits, or the driver's
//! completion task) hands it the connection's completions, which go straight into the state
//! machine. What the state machine then asks for (receives to re-post, credit returns and
//! other control messages) is posted right there ([`ConnState::pump`]), in the same call.
//!
//! Posting happens under the lock, directly on the queue pair (never through the driver's
//! lock, which may be held by the caller of [`Sink::on_completion`]): the wire order is the
//! order the state machine hands chunks out.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::task::Waker;
use std::time::Instant;

use tokio::sync::Notify;
use tracing::{trace, warn};

use bytes::Bytes;

use super::rendezvous::{Fetch, RdvSource};
use super::srq::{SRQ_BIT, SharedRecv, SrqShare};
use crate::buf::{Pool, PoolBuf};
use crate::driver::{Deferred, Sink};
use crate::error::{QpFailure, WcStatus};
use crate::proto::conn::{Chunk, ConnProto};
use crate::proto::{Cqe, MsgKind};
use crate::verbs::{QueuePair, RecvWr, SendOp, SendWr, Sge};

/// The state machine over the connection's receive buffers.
pub(crate) type Proto = ConnProto<PoolBuf>;

/// Low half of a sink `wr_id`: this bit marks a send, the rest is a sequence number.
const SEND_BIT: u32 = 1 << 31;

/// A send on the device, until its completion (or a later signaled one) retires it.
#[derive(Debug)]
pub(crate) enum Sent {
    /// A data chunk; what it was sent from is released once retired.
    Data(Held),
    /// A control message, reported to the state machine when retired.
    Control(MsgKind),
    /// A zero-length signaled send posted after the queue pair failed: its flush retires every
    /// send before it (sends that completed unsignaled raise no completion of their own).
    Marker,
    /// An RDMA READ of (a piece of) the rendezvous message being fetched into
    /// [`ConnState::fetch`]; `last`: the piece that completes it.
    Fetch {
        /// The last piece.
        last: bool,
    },
}

/// The memory a data chunk was sent from, held until the send is retired.
#[derive(Debug)]
pub(crate) enum Held {
    /// Sent inline: the device copied it at post time.
    Inline,
    /// Copied into a staging buffer of the connection's.
    Staged(#[allow(dead_code, reason = "held, never read")] PoolBuf),
    /// The application's own registered bytes, sent without copying.
    User(#[allow(dead_code, reason = "held, never read")] Bytes),
}

/// Where a message's bytes are sent from.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Source<'a> {
    /// Plain memory: chunks go inline or are copied into staging buffers.
    Copy(&'a [u8]),
    /// Bytes in memory registered in the connection's protection domain (`lkey`): chunks that
    /// are not inline are sent straight from them.
    Registered(&'a Bytes, u32),
    /// Bytes the caller already copied into one of the connection's staging buffers (`lkey`):
    /// sent straight from there, counted as copied.
    Staged(&'a Bytes, u32),
}

impl Source<'_> {
    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            Source::Copy(b) => b,
            Source::Registered(b, _) | Source::Staged(b, _) => b,
        }
    }
}

/// How a connection's sent bytes left: counters for [`ConnStats`](super::ConnStats), kept
/// under the connection's lock (the sends that count them hold it).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct SendBytes {
    pub(crate) inline: u64,
    pub(crate) staged: u64,
    pub(crate) zero_copy: u64,
}

/// How a connection's received bytes reached the application: copied by the CPU (reassembly,
/// a small message into [`recv_into`](super::Connection::recv_into)'s buffer) or read by the
/// device straight into their destination (rendezvous).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct RecvBytes {
    pub(crate) copied: u64,
    pub(crate) fetched: u64,
}

/// Everything behind the connection's lock.
#[derive(Debug)]
pub(crate) struct ConnState {
    pub(crate) proto: Proto,
    /// How the data bytes were sent.
    pub(crate) sent_bytes: SendBytes,
    /// How the data bytes were received (beyond the protocol's reassembly copies).
    pub(crate) recv_bytes: RecvBytes,
    /// The rendezvous message being read, with its destination (kept here, not in the
    /// future that started it, so the read completes into live memory and the message is
    /// delivered even if that future is dropped).
    pub(crate) fetch: Option<Fetch>,
    /// The memory of this side's rendezvous messages, by rendezvous number, until the peer
    /// read it.
    pub(crate) rdv_held: Vec<(u16, RdvSource)>,
    /// Hands out owner numbers to fetches.
    pub(crate) next_owner: u64,
    /// This connection's claim on the endpoint's shared receive queue, if it receives there
    /// (it then posts no receives of its own); given back at teardown.
    pub(crate) srq: Option<SrqShare>,
    /// Receives on the device, in posting order (their completions come in that order).
    /// `None`: the drain marker receive (posted after a failure, see
    /// [`ConnIo::post_drain_marker`]).
    recvs: VecDeque<Option<PoolBuf>>,
    next_recv: u32,
    /// Sends on the device, in posting order, with their sequence numbers.
    sends: VecDeque<(u32, Sent)>,
    next_send: u32,
    /// Sends posted since the last signaled one.
    unsignaled: u32,
    /// Staging buffers held by unsignaled sends.
    staged_unsignaled: u32,
    /// Tasks waiting for room in the send queue.
    sq_waiters: Vec<Waker>,
    /// Ran out of receive buffers: the driver task waits for one and posts again.
    pub(crate) short: bool,
    /// The deadline the driver task sleeps until (it is kicked only for an earlier one).
    pub(crate) driver_deadline: Option<Instant>,
    /// Set while tearing down: rings drained wakes `drained`.
    pub(crate) draining: bool,
    /// A post failed: the queue pair is to move to the error state, which the next `pump`
    /// hands to its `Deferred` (run after the locks: the connection's, and the driver's when
    /// a completion pumped). The teardown moves it there in any case.
    pub(crate) to_error: bool,
    /// The queue pair is being moved to the error state: post no receive any more.
    /// Soft-RoCE's `post_recv` does not enter the kernel, and its kernel flushes a receive
    /// queue only when the queue pair changes state or a packet arrives: a receive posted
    /// after that flush never completes (the teardown's drain then waits out its stall
    /// limit). Set under the lock before the state changes, so every receive posted before
    /// is flushed.
    pub(crate) in_error: bool,
}

/// The connection's message I/O (see the module docs).
#[derive(Debug)]
pub(crate) struct ConnIo {
    state: Mutex<ConnState>,
    qp: QueuePair,
    /// `wr_id` of the sink's request 0 (the sink's own ids are added to it).
    wr_base: u64,
    pool: Pool,
    staging: Pool,
    recv_size: usize,
    /// Payloads up to this size go inline (no staging buffer, no copy but the device's).
    max_inline: usize,
    /// Sends this side keeps on the device at most (its share of the send queue).
    sq_budget: u32,
    /// Signal at least every this many sends; and a staged send once this many staging buffers
    /// wait for a signal.
    signal_every: u32,
    staged_signal: u32,
    /// Wakes the connection's driver task (timers, CM events, refills, teardown).
    pub(crate) kick: Notify,
    /// Signalled when both rings are empty during teardown.
    pub(crate) drained: Notify,
    /// Bumped under the lock whenever the state may have changed (a completion, a user call):
    /// a spinning waiter re-examines the state only when it moved.
    changes: AtomicU64,
    /// Set (and `done` signalled) when the connection's teardown finished: everything flushed,
    /// every buffer back.
    pub(crate) torn_down: std::sync::atomic::AtomicBool,
    pub(crate) done: Notify,
    /// The application's bytes of retired zero-copy sends, dropped once the connection's lock
    /// is released: the last reference to a forwarded [`Message`](super::Message) re-posts its
    /// receive, which takes that lock. Also the memory of rendezvous messages the peer read
    /// (deregistering takes a while: not under the lock either).
    retired: Mutex<Vec<Retired>>,
    has_retired: std::sync::atomic::AtomicBool,
    /// The largest RDMA READ posted at once (a larger rendezvous message is read in pieces).
    pub(crate) max_read: u64,
    /// `send_bytes`/`send_buf` of at least this many bytes go by rendezvous (if negotiated).
    pub(crate) rdv_threshold: Option<u64>,
    /// The shared receive queue the connection receives on, if any (its buffers come back
    /// through here even after the claim was given back).
    shared_recv: Option<Arc<SharedRecv>>,
    /// This connection, for the shared receive queue to kick when buffers come back.
    me: Weak<ConnIo>,
}

/// What is released outside the connection's lock.
#[derive(Debug)]
pub(crate) enum Retired {
    Bytes(#[allow(dead_code, reason = "held, never read")] Bytes),
    Rendezvous(#[allow(dead_code, reason = "held, never read")] RdvSource),
}

/// Parameters of a [`ConnIo`].
#[derive(Debug)]
pub(crate) struct IoConfig {
    pub(crate) qp: QueuePair,
    pub(crate) wr_base: u64,
    pub(crate) pool: Pool,
    pub(crate) staging: Pool,
    pub(crate) recv_size: usize,
    pub(crate) max_inline: usize,
    pub(crate) sq_budget: u32,
    pub(crate) staging_count: u32,
    pub(crate) max_read: u64,
    pub(crate) rdv_threshold: Option<u64>,
    /// Receive on the shared receive queue, with this claim on it.
    pub(crate) srq: Option<SrqShare>,
}

impl ConnIo {
    /// `me`: the `Arc` the connection is made in (`Arc::new_cyclic`).
    pub(crate) fn new(cfg: IoConfig, proto: Proto, me: Weak<ConnIo>) -> ConnIo {
        let sq_budget = cfg.sq_budget.max(2);
        let shared_recv = cfg.srq.as_ref().map(|s| s.shared().clone());
        ConnIo {
            state: Mutex::new(ConnState {
                proto,
                sent_bytes: SendBytes::default(),
                recv_bytes: RecvBytes::default(),
                fetch: None,
                rdv_held: Vec::new(),
                next_owner: 0,
                srq: cfg.srq,
                recvs: VecDeque::new(),
                next_recv: 0,
                sends: VecDeque::new(),
                next_send: 0,
                unsignaled: 0,
                staged_unsignaled: 0,
                sq_waiters: Vec::with_capacity(4),
                short: false,
                driver_deadline: None,
                draining: false,
                to_error: false,
                in_error: false,
            }),
            qp: cfg.qp,
            wr_base: cfg.wr_base,
            pool: cfg.pool,
            staging: cfg.staging,
            recv_size: cfg.recv_size,
            max_inline: cfg.max_inline,
            sq_budget,
            signal_every: (sq_budget / 2).max(1),
            staged_signal: (cfg.staging_count / 2).max(1),
            kick: Notify::new(),
            drained: Notify::new(),
            changes: AtomicU64::new(0),
            torn_down: std::sync::atomic::AtomicBool::new(false),
            done: Notify::new(),
            retired: Mutex::new(Vec::with_capacity(sq_budget as usize)),
            has_retired: std::sync::atomic::AtomicBool::new(false),
            max_read: cfg.max_read.max(1),
            rdv_threshold: cfg.rdv_threshold,
            shared_recv,
            me,
        }
    }

    pub(crate) fn retire(&self, r: Retired) {
        self.retired
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(r);
        self.has_retired.store(true, Ordering::Release);
    }

    /// Drops the retired application bytes, outside the connection's lock (and outside the
    /// list's own lock, popping one at a time: the list keeps its capacity).
    fn drop_retired(&self) {
        if !self.has_retired.swap(false, Ordering::AcqRel) {
            return;
        }
        loop {
            let b = self.retired.lock().unwrap_or_else(|e| e.into_inner()).pop();
            match b {
                Some(b) => drop(b),
                None => break,
            }
        }
    }

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

    fn post_recv_marker(&self, s: &mut ConnState) {
        if s.recvs.is_empty() {
            return;
        }
        let seq = s.next_recv;
        let wr = RecvWr::new(self.wr_base | u64::from(seq), &[]);
        // SAFETY: a zero-length receive names no memory.
        match unsafe { self.qp.post_recv(&[wr]) } {
            Ok(()) => {
                s.next_recv = (seq + 1) & !SEND_BIT;
                s.recvs.push_back(None);
            }
            // The receive queue is full of unflushed requests: the drain limit applies.
            Err(e) => tracing::debug!(error = %e, "posting a receive drain marker failed"),
        }
    }

    /// The lock. Prefer [`with`](Self::with), which posts and wakes what the change asks for.
    pub(crate) fn lock(&self) -> MutexGuard<'_, ConnState> {
        // The state machine has no invariant a panic elsewhere could half-apply.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` on the state, then does what the state machine asks (posts, control messages),
    /// wakes the tasks it woke (outside the lock), and kicks the driver task if needed.
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut ConnState) -> R) -> R {
        let mut wake = Deferred::default();
        let (r, kick) = {
            let mut s = self.lock();
            self.changes.fetch_add(1, Ordering::Release);
            let r = f(&mut s);
            let kick = self.pump(&mut s, Instant::now(), &mut wake);
            (r, kick)
        };
        wake.run();
        self.drop_retired();
        if kick {
            self.kick.notify_one();
        }
        r
    }

    /// Whether a send can be posted now (room in this side's share of the send queue);
    /// otherwise registers `waker` for when a completion makes room.
    pub(crate) fn sq_ready(&self, s: &mut ConnState, waker: &Waker) -> bool {
        if self.sq_room(s) {
            return true;
        }
        if !s.sq_waiters.iter().any(|w| w.will_wake(waker)) {
            s.sq_waiters.push(waker.clone());
        }
        false
    }

    pub(crate) fn sq_room(&self, s: &ConnState) -> bool {
        (s.sends.len() as u32) < self.sq_budget
    }

    /// Whether a chunk of `len` bytes from `src` needs a staging buffer.
    pub(crate) fn needs_staging(&self, src: &Source<'_>, len: usize) -> bool {
        len > self.max_inline && matches!(src, Source::Copy(_))
    }

    /// Posts `chunk` of the message in `src`: inline when it fits, straight from registered
    /// bytes, or copied into the `staging` buffer (which the caller acquired; taken only
    /// then). A failed post fails the connection and returns `false`.
    pub(crate) fn post_chunk(
        &self,
        s: &mut ConnState,
        chunk: Chunk,
        src: Source<'_>,
        staging: &mut Option<PoolBuf>,
    ) -> bool {
        let range = chunk.offset as usize..(chunk.offset + u64::from(chunk.len)) as usize;
        let bytes = &src.bytes()[range.clone()];
        let seq = s.next_send;
        let wr_id = self.wr_base | u64::from(SEND_BIT | seq);
        let op = SendOp::SendWithImm(chunk.imm);
        let (sent, posted) = if bytes.len() <= self.max_inline {
            let sges;
            let list: &[Sge] = if bytes.is_empty() {
                &[]
            } else {
                // Inline: the device copies the bytes at post time, no key needed.
                sges = [Sge::new(bytes.as_ptr() as u64, bytes.len() as u32, 0)];
                &sges
            };
            let signaled = self.signal(s, false);
            let wr = SendWr {
                inline: !list.is_empty(),
                signaled,
                ..SendWr::new(wr_id, op, list)
            };
            s.sent_bytes.inline += bytes.len() as u64;
            // SAFETY: an inline payload is copied during the call; `bytes` outlives it.
            (Sent::Data(Held::Inline), unsafe {
                self.qp.post_send(&[wr])
            })
        } else if let Source::Registered(owner, lkey) | Source::Staged(owner, lkey) = src {
            let held = owner.slice(range);
            // The application waits for its buffer: the last chunk of the message always
            // asks for the completion that gives it back.
            let signaled = self.signal(s, true) || chunk.last;
            if signaled {
                s.unsignaled = 0;
                s.staged_unsignaled = 0;
            }
            let sge = [Sge::new(held.as_ptr() as u64, held.len() as u32, lkey)];
            let wr = SendWr {
                signaled,
                ..SendWr::new(wr_id, op, &sge)
            };
            if matches!(src, Source::Staged(..)) {
                s.sent_bytes.staged += held.len() as u64;
            } else {
                s.sent_bytes.zero_copy += held.len() as u64;
            }
            // SAFETY: `held` is registered in this QP's domain (`lkey`, checked by the caller),
            // immutable, and stays in `sends` until this send is retired by a completion.
            let r = unsafe { self.qp.post_send(&[wr]) };
            (Sent::Data(Held::User(held)), r)
        } else {
            let mut buf = staging
                .take()
                .expect("a staging buffer for a chunk that is not inline");
            buf.set_len(bytes.len());
            buf.copy_from_slice(bytes);
            let signaled = self.signal(s, true);
            let sge = [buf.sge(0..bytes.len())];
            let wr = SendWr {
                signaled,
                ..SendWr::new(wr_id, op, &sge)
            };
            s.sent_bytes.staged += bytes.len() as u64;
            // SAFETY: the staging buffer is registered in this queue pair's protection domain
            // and stays in `sends` (untouched) until this send is retired by a completion.
            let r = unsafe { self.qp.post_send(&[wr]) };
            (Sent::Data(Held::Staged(buf)), r)
        };
        match posted {
            Ok(()) => {
                s.next_send = (seq + 1) & !SEND_BIT;
                s.sends.push_back((seq, sent));
                true
            }
            Err(e) => {
                self.post_failed(s, &e);
                false
            }
        }
    }

    /// Posts one signaled work request on the send queue, remembered as `sent` until its
    /// completion. A failed post fails the connection and returns `false`.
    pub(crate) fn post_send_entry(
        &self,
        s: &mut ConnState,
        op: SendOp,
        sges: &[Sge],
        sent: Sent,
    ) -> bool {
        let seq = s.next_send;
        let wr = SendWr::new(self.wr_base | u64::from(SEND_BIT | seq), op, sges);
        // SAFETY: the callers' memory (a rendezvous destination in `ConnState::fetch`) stays
        // registered and alive until this request's completion retires `sent`.
        match unsafe { self.qp.post_send(&[wr]) } {
            Ok(()) => {
                s.next_send = (seq + 1) & !SEND_BIT;
                s.sends.push_back((seq, sent));
                s.unsignaled = 0;
                s.staged_unsignaled = 0;
                true
            }
            Err(e) => {
                self.post_failed(s, &e);
                false
            }
        }
    }

    /// Whether a rendezvous READ is on the device.
    pub(crate) fn fetch_on_device(&self, s: &ConnState) -> bool {
        s.sends
            .iter()
            .any(|(_, sent)| matches!(sent, Sent::Fetch { .. }))
    }

    /// Wakes `waker` at the next send completion.
    pub(crate) fn park_sq(&self, s: &mut ConnState, waker: &Waker) {
        if !s.sq_waiters.iter().any(|w| w.will_wake(waker)) {
            s.sq_waiters.push(waker.clone());
        }
    }

    /// The lkey under which the `len` bytes at `addr` can be sent (or received into) without
    /// copying: they lie in one of this connection's pools (`extra`: the application's pool of
    /// the connection, if made). An address range, not a slice: the bytes may be uninitialised
    /// memory a receive will fill.
    pub(crate) fn lkey_of(&self, addr: usize, len: usize, extra: Option<&Pool>) -> Option<u32> {
        extra
            .and_then(|p| p.lkey_of(addr, len))
            .or_else(|| self.pool.lkey_of(addr, len))
    }

    /// Whether the next send is signaled: often enough that the send queue and the staging
    /// buffers are always given back.
    fn signal(&self, s: &mut ConnState, staged: bool) -> bool {
        s.unsignaled += 1;
        if staged {
            s.staged_unsignaled += 1;
        }
        let due = s.unsignaled >= self.signal_every || s.staged_unsignaled >= self.staged_signal;
        if due {
            s.unsignaled = 0;
            s.staged_unsignaled = 0;
        }
        due
    }

    fn post_failed(&self, s: &mut ConnState, e: &crate::Error) {
        let errno = e.raw_os_error().unwrap_or(libc::EIO);
        warn!(error = %e, "posting on a connection failed");
        if s.proto.fail(QpFailure::PostFailed(errno)) {
            // Not here: this may run under the driver's lock (a refill from a completion).
            // No receive is posted from now on (see `in_error`).
            s.in_error = true;
            s.to_error = true;
        }
    }

    /// Does what the state machine asks: receives to post, control messages to send. Collects
    /// its wakers into `wake`. Returns whether the driver task must look (a deadline earlier
    /// than the one it sleeps until, missing buffers, a disconnect, or teardown progress).
    pub(crate) fn pump(&self, s: &mut ConnState, now: Instant, wake: &mut Deferred) -> bool {
        self.post_recvs(s);
        self.post_fetch(s);
        self.release_rendezvous(s);
        while (s.sends.len() as u32) < self.sq_budget {
            let Some(t) = s.proto.poll_transmit(now) else {
                break;
            };
            trace!(kind = ?t.kind, imm = t.imm, "control message");
            // Control messages are always signaled: their completion is reported.
            let op = SendOp::SendWithImm(t.imm);
            if !self.post_send_entry(s, op, &[], Sent::Control(t.kind)) {
                break;
            }
        }
        if std::mem::take(&mut s.to_error) {
            wake.move_to_error(&self.qp, None);
        }
        for w in s.proto.take_wakers() {
            wake.push(w);
        }
        let kicked = s.proto.take_driver_kick();
        let earlier = match (s.proto.poll_timeout(), s.driver_deadline) {
            (Some(t), Some(d)) => t < d,
            (Some(_), None) => true,
            _ => false,
        };
        let teardown = s.draining && Self::outstanding(s) == 0;
        if teardown {
            self.drained.notify_one();
        }
        (kicked && (earlier || s.short || s.proto.should_disconnect())) || earlier
    }

    fn post_recvs(&self, s: &mut ConnState) {
        let want = if s.in_error {
            0
        } else {
            s.proto.recvs_to_post()
        };
        if let Some(share) = s.srq.as_mut() {
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
                    s.next_recv = (seq + 1) & !SEND_BIT;
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

    /// How often the state may have changed so far (see `changes`).
    pub(crate) fn changes(&self) -> u64 {
        self.changes.load(Ordering::Acquire)
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

    /// Wakes the tasks waiting for send-queue room.
    fn wake_sq(s: &mut ConnState, wake: &mut Deferred) {
        for w in s.sq_waiters.drain(..) {
            wake.push(w);
        }
    }

    /// Bytes in the staging pool in use (for stats).
    pub(crate) fn buffer_bytes_in_use(&self) -> u64 {
        self.pool.metrics().bytes_in_use + self.staging.metrics().bytes_in_use
    }

    pub(crate) fn pool(&self) -> &Pool {
        &self.pool
    }

    pub(crate) fn staging(&self) -> &Pool {
        &self.staging
    }

    pub(crate) fn recv_size(&self) -> usize {
        self.recv_size
    }

    pub(crate) fn max_inline(&self) -> usize {
        self.max_inline
    }
}

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
    fn received(
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

impl Sink for ConnIo {
    fn on_completion(
        &self,
        local: u32,
        cqe: &Cqe,
        qp_failure: Option<&QpFailure>,
        wake: &mut Deferred,
    ) -> Option<QpFailure> {
        let now = Instant::now();
        let ok = cqe.status == WcStatus::Success;
        let mut s = self.lock();
        self.changes.fetch_add(1, Ordering::Release);
        let was_failed = s.proto.failure().is_some();
        if local & (SEND_BIT | SRQ_BIT) == SRQ_BIT {
            let buf = self.shared_recv.as_ref().and_then(|q| q.take(local));
            match (buf, s.srq.as_mut()) {
                (Some(buf), Some(share)) => {
                    share.consumed();
                    Self::received(&mut s, buf, cqe, qp_failure, now);
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
        } else if local & SEND_BIT == 0 {
            let Some(entry) = s.recvs.pop_front() else {
                warn!(local, "a receive completion with no receive posted");
                return None;
            };
            let seq = s.next_recv.wrapping_sub(s.recvs.len() as u32 + 1) & !SEND_BIT;
            debug_assert_eq!(seq, local, "receive completions come in posting order");
            // The drain marker's flush carries nothing for the state machine.
            if let Some(buf) = entry {
                Self::received(&mut s, buf, cqe, qp_failure, now);
            }
        } else {
            let seq = local & !SEND_BIT;
            if !s.sends.iter().any(|(q, _)| *q == seq) {
                warn!(local, "a send completion that matches no send");
                return None;
            }
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
            Self::wake_sq(&mut s, wake);
        }
        let kick = self.pump(&mut s, now, wake);
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

    fn after_unlock(&self) {
        self.drop_retired();
    }

    fn on_driver_stopped(&self) {
        let mut wake = Deferred::default();
        {
            let mut s = self.lock();
            self.changes.fetch_add(1, Ordering::Release);
            s.proto.fail(QpFailure::DriverStopped);
            Self::wake_sq(&mut s, &mut wake);
            self.pump(&mut s, Instant::now(), &mut wake);
        }
        wake.run();
        self.drop_retired();
        self.kick.notify_one();
    }
}
