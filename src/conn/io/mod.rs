//! [`ConnIo`]: the connection's message I/O, with no task in between. It owns the protocol
//! state machine (behind the connection's one lock), the receives and message sends posted on
//! the queue pair, and it is the queue pair's completion [`Sink`](crate::driver::Sink): whoever polls the
//! completion queue (the application's own `recv` or `send` while it waits, or the driver's
//! completion task) hands it the connection's completions, which go straight into the state
//! machine. What the state machine then asks for (receives to re-post, credit returns and
//! other control messages) is posted right there ([`ConnIo::pump`]), in the same call.
//!
//! Posting happens under the lock, directly on the queue pair (never through the driver's
//! lock, which may be held by the caller of [`Sink::on_completion`](crate::driver::Sink::on_completion)): the wire order is the
//! order the state machine hands chunks out.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::task::Waker;
use std::time::Instant;

use tokio::sync::Notify;
use tracing::trace;

use bytes::Bytes;

use super::rdv_memory::{Fetch, RdvSource};
use super::srq::{SRQ_BIT, SharedRecv, SrqShare};
use crate::buf::{Pool, PoolBuf};
use crate::driver::Deferred;
use crate::proto::MsgKind;
use crate::proto::conn::{ConnProto, earlier};
use crate::verbs::{QueuePair, SendOp};

mod completion;
mod dropped;
mod fetch;
mod recv;
mod retire;
mod send;
pub(crate) use send::SEND_CHAIN;
mod srq_route;
mod teardown;
#[cfg(test)]
mod tests;

/// The state machine over the connection's receive buffers.
pub(crate) type Proto = ConnProto<PoolBuf>;

/// Low half of a sink `wr_id`: this bit marks a send, the rest is a sequence number.
const SEND_BIT: u32 = 1 << 31;

/// Receive sequence numbers wrap below [`SRQ_BIT`], which marks a receive taken from the
/// endpoint's shared receive queue: with 31 bits, the 2^30-th receive of a connection (a day at
/// 12,000 messages a second) had that bit set and its completion was taken for a shared one.
const RECV_SEQ_MASK: u32 = SRQ_BIT - 1;

/// The receive sequence number after `seq`.
#[inline]
fn next_recv_seq(seq: u32) -> u32 {
    seq.wrapping_add(1) & RECV_SEQ_MASK
}

/// What the low half of a sink `wr_id` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Local {
    /// A receive of this connection's own.
    Recv,
    /// A receive from the shared receive queue (its slot there).
    Shared,
    /// A send (its sequence number).
    Send(u32),
}

impl Local {
    #[inline]
    fn of(local: u32) -> Local {
        if local & SEND_BIT != 0 {
            Local::Send(local & !SEND_BIT)
        } else if local & SRQ_BIT != 0 {
            Local::Shared
        } else {
            Local::Recv
        }
    }
}

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
    /// Whether a receive would find nothing in the state ([`ConnProto::recv_idle`]), as of
    /// the last change made through [`with`](Self::with) or a completion. A hint, never relied
    /// on: a waiting receive polls the completion queue before it looks when it says so.
    recv_idle: AtomicBool,
    /// The messages the application dropped, reported at the next look (`dropped.rs`).
    dropped: dropped::Dropped,
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
            recv_idle: AtomicBool::new(true),
            dropped: dropped::Dropped::default(),
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

    /// The lock. Prefer [`with`](Self::with), which posts and wakes what the change asks for.
    pub(crate) fn lock(&self) -> MutexGuard<'_, ConnState> {
        // The state machine has no invariant a panic elsewhere could half-apply.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` on the state, then does what the state machine asks (posts, control messages),
    /// wakes the tasks it woke (outside the lock), and kicks the driver task if needed.
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut ConnState) -> R) -> R {
        let mut s = self.lock();
        self.bump_changes(&s);
        self.report_dropped(&mut s);
        let r = f(&mut s);
        self.settle_dropped(&mut s);
        self.note_recv_idle(&s);
        if Self::settled(&s) {
            // Nothing to post, wake or kick (most looks): no `Deferred` to set up either.
            drop(s);
            self.drop_retired();
            return r;
        }
        let mut wake = Deferred::default();
        let kick = self.pump_unsettled(&mut s, None, &mut wake);
        drop(s);
        wake.run();
        self.drop_retired();
        if kick {
            self.kick.notify_one();
        }
        r
    }

    /// Does what the state machine asks: receives to post, control messages to send. Collects
    /// its wakers into `wake`. Returns whether the driver task must look (a deadline earlier
    /// than the one it sleeps until, missing buffers, a disconnect, or teardown progress).
    /// `now`: the time, if the caller has read the clock (else it is read only if needed).
    ///
    /// Most calls find the state settled (a look that found no message, a chunk handed out):
    /// then they return at once, without reading the clock (see [`Self::settled`]).
    pub(crate) fn pump(
        &self,
        s: &mut ConnState,
        now: Option<Instant>,
        wake: &mut Deferred,
    ) -> bool {
        if Self::settled(s) {
            return false;
        }
        self.pump_unsettled(s, now, wake)
    }

    /// [`pump`](Self::pump) for a caller that found the state not settled.
    fn pump_unsettled(&self, s: &mut ConnState, now: Option<Instant>, wake: &mut Deferred) -> bool {
        // Each step only if it may have something to do (a completion that woke a receiver
        // has no receive to post and, mostly, no control message to send).
        if s.srq.is_some() || s.short || s.proto.recvs_to_post() > 0 {
            self.post_recvs(s);
        }
        if s.fetch.is_some() {
            self.post_fetch(s);
        }
        self.release_rendezvous(s);
        if !s.proto.transmit_idle() {
            let now = now.unwrap_or_else(Instant::now);
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
        }
        if std::mem::take(&mut s.to_error) {
            wake.move_to_error(&self.qp, None);
        }
        for w in s.proto.take_wakers() {
            wake.push(w);
        }
        let kicked = s.proto.take_driver_kick();
        // The deadline can only have moved later unless the state machine says otherwise
        // (its randomized tests check that): then the driver task's timer stands.
        let sooner = if s.proto.take_deadline_moved() {
            let t = s.proto.poll_timeout();
            let sooner = earlier(t, s.driver_deadline);
            if sooner {
                // The driver task is kicked: it looks by then.
                s.driver_deadline = t;
            }
            sooner
        } else {
            Self::check_deadline(s);
            false
        };
        let teardown = s.draining && Self::outstanding(s) == 0;
        if teardown {
            self.drained.notify_one();
        }
        (kicked && (sooner || s.short || s.proto.should_disconnect())) || sooner
    }

    /// Whether the pump has nothing to do (see [`ConnProto::settled`]): the plain open state,
    /// with no receive queue shared, no buffers missing, no rendezvous read or memory in play,
    /// and no teardown or move to the error state under way.
    fn settled(s: &ConnState) -> bool {
        let settled = s.srq.is_none()
            && !s.short
            && !s.in_error
            && !s.to_error
            && !s.draining
            && s.fetch.is_none()
            && s.rdv_held.is_empty()
            && s.proto.settled();
        if settled {
            Self::check_deadline(s);
        }
        settled
    }

    /// Debug builds check the deadline flag's promise: a deadline earlier than the one the
    /// driver task sleeps until is never missed.
    fn check_deadline(s: &ConnState) {
        debug_assert!(
            !earlier(s.proto.poll_timeout(), s.driver_deadline),
            "a deadline moved earlier ({:?} < {:?}) without the state machine saying so",
            s.proto.poll_timeout(),
            s.driver_deadline
        );
    }

    /// A message was dropped (`buffer`: it held a receive buffer): reported to the state
    /// machine at the next look, or now if it needs the report now (`dropped.rs`).
    pub(crate) fn message_dropped(&self, buffer: bool, len: usize) {
        if self.dropped.record(buffer, len) {
            // The look reports it (and every other drop not reported yet).
            self.with(|_| ());
        }
    }

    /// Reports the messages dropped since the last look. Every look does, first.
    #[inline]
    pub(crate) fn report_dropped(&self, s: &mut ConnState) {
        if let Some((bufs, bytes)) = self.dropped.take() {
            s.proto.consumed_many(bufs, bytes);
        }
    }

    /// After a change: whether drops must report at once from now on (and, if that just
    /// became so, the drops that counted themselves meanwhile). Before the pump, which posts
    /// what the reports released.
    #[inline]
    pub(crate) fn settle_dropped(&self, s: &mut ConnState) {
        if self.dropped.set_urgent(s.proto.consumption_urgent()) {
            self.report_dropped(s);
        }
    }

    /// Counts a change of the state; the caller holds the lock (`_s`), so no other thread
    /// writes `changes` meanwhile: a load and a store, no atomic read-modify-write.
    pub(crate) fn bump_changes(&self, _s: &ConnState) {
        let n = self.changes.load(Ordering::Relaxed);
        self.changes.store(n.wrapping_add(1), Ordering::Release);
    }

    /// Records whether a receive would find nothing now (see `recv_idle`).
    #[inline]
    pub(crate) fn note_recv_idle(&self, s: &ConnState) {
        self.recv_idle
            .store(s.proto.recv_idle() && s.fetch.is_none(), Ordering::Relaxed);
    }

    /// Whether a receive would find nothing in the state, as of the last change (a hint).
    #[inline]
    pub(crate) fn recv_idle_hint(&self) -> bool {
        self.recv_idle.load(Ordering::Relaxed)
    }

    /// How often the state may have changed so far (see `changes`).
    pub(crate) fn changes(&self) -> u64 {
        self.changes.load(Ordering::Acquire)
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
