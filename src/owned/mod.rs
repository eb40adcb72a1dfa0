//! [`OwnedQp`]: a queue pair owned by one task, with a completion queue of its own.
//!
//! The [`AsyncQp`](crate::driver::AsyncQp) of a [`Driver`](crate::driver::Driver) shares its
//! completion queue with every queue pair of the driver: its operations are futures any task
//! may hold and drop, so every completion is routed through an operation table behind the
//! driver's lock, and a completion task watches what nobody polls. An `OwnedQp` gives that up
//! for the common case of one task driving one queue pair (a connection's handler, a
//! benchmark loop), as perftest and UCX's workers do:
//!
//! * its operations take `&mut self`: no lock, no shared table, nothing to route;
//! * a posted request's buffer is owned by a slot of the queue pair's ring, named by the
//!   request's `wr_id`, until its completion has been polled. Waiting futures only borrow the
//!   queue pair, so dropping or forgetting one cannot free memory the device uses;
//! * waits poll the queue pair's own CQ in place; to sleep, they arm it and wait on its
//!   channel's descriptor in the reactor, which wakes the waiting task directly (no
//!   completion task in between);
//! * dropped with requests in flight, it moves the queue pair to the error state and keeps
//!   their buffers until the device has flushed every one of them (in a task of the current
//!   runtime, then, if the device is slow, on its blocking pool, for up to 10 s in all, or,
//!   outside a runtime, for up to a second in place); buffers the
//!   device did not release by then are leaked, never freed.
//!
//! Instructions per operation against perftest's: docs/benchmarks-speed-3.md.
//!
//! # Examples
//!
//! ```no_run
//! use tokio_rdma::buf::RemoteToken;
//! use tokio_rdma::owned::{OwnedQp, OwnedQpOptions};
//! use tokio_rdma::verbs::{
//!     AccessFlags, Context, ProtectionDomain, RegisteredBuffer, RtrOptions, RtsOptions,
//! };
//!
//! # async fn demo(peer: tokio_rdma::verbs::QpAddress, remote: RemoteToken) -> tokio_rdma::Result<()> {
//! let (ctx, port) = Context::open_first_active()?;
//! let pd = ProtectionDomain::new(&ctx)?;
//! let mut qp: OwnedQp<RegisteredBuffer> = OwnedQp::new(&pd, OwnedQpOptions::default())?;
//! let gid = ctx.preferred_gid(port)?;
//! let me = qp.verbs().local_address(port, Some(gid.index))?;
//! // Exchange `me.to_bytes()` with the peer's address (`peer`), then:
//! let rtr = RtrOptions::new(port, gid.index as u8);
//! qp.verbs().connect(&me, &peer, &rtr, &RtsOptions::default(), AccessFlags::LOCAL_WRITE)?;
//! let buf = RegisteredBuffer::new(&pd, 4096, AccessFlags::LOCAL_WRITE)?;
//! let (res, buf) = qp.write(buf, remote).await;
//! res?;
//! # drop(buf); Ok(()) }
//! ```

mod atomic;
mod batch;
mod pending;
mod ring;
mod wait;

use std::future::Future;
use std::mem::ManuallyDrop;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use tracing::{debug, error, warn};

pub use self::atomic::AtomicWait;
pub use self::batch::Batch;
pub use self::pending::MAX_BATCH;
pub use self::ring::{Completed, Ticket};
use self::ring::{Kind, Ring};
use self::wait::{CqWait, Flushes};
use crate::buf::RemoteToken;
use crate::driver::{CompletionMode, off_runtime};
use crate::error::{Error, InvalidArgument, Result};
use crate::ops::{SgSource, SgTarget, check_sge_count};
use crate::proto::SgList;
use crate::verbs::{ProtectionDomain, QpCaps, QpInitAttr, QueuePair, RecvWr, SendOp, SendWr, Sge};

/// The deepest queue an owned queue pair accepts (each side): its ring has a slot per request
/// and the CQ an entry, allocated up front.
pub const MAX_QUEUE_DEPTH: u32 = 1 << 16;

/// How long a queue pair dropped outside a runtime waits in place for the device to flush its
/// requests in flight before leaking their buffers.
const BLOCKING_REAP: Duration = Duration::from_secs(1);

/// How long the task that reaps a dropped queue pair waits for the device to flush its
/// requests in flight before leaking their buffers.
const REAP_LIMIT: Duration = Duration::from_secs(10);

/// Polls the reaper makes on the runtime (yielding after each that finds nothing) before it
/// waits for the flushes on the blocking pool.
const REAP_YIELDS: u32 = 256;

/// How an [`OwnedQp`] is created.
///
/// # Examples
///
/// ```
/// use tokio_rdma::driver::CompletionMode;
/// use tokio_rdma::owned::OwnedQpOptions;
///
/// let mut opts = OwnedQpOptions::default();
/// opts.mode = CompletionMode::BusyPoll;
/// opts.caps.max_send_wr = 16;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct OwnedQpOptions {
    /// Queue sizes and limits (each queue at most [`MAX_QUEUE_DEPTH`]).
    pub caps: QpCaps,
    /// How waits poll and sleep (default: adaptive, as a driver's).
    pub mode: CompletionMode,
    /// Send small payloads inline (up to `caps.max_inline_data` bytes).
    pub inline: bool,
}

impl Default for OwnedQpOptions {
    fn default() -> Self {
        OwnedQpOptions {
            caps: QpCaps {
                max_send_wr: 64,
                max_recv_wr: 64,
                max_send_sge: 4,
                max_recv_sge: 4,
                max_inline_data: 64,
            },
            mode: CompletionMode::default(),
            inline: true,
        }
    }
}

/// A reliable-connected queue pair owned by one task, with a completion queue of its own (see
/// the [module](self) docs). Every request is posted at once by a `&mut self` method, and its
/// buffer `B` comes back with its outcome.
///
/// Must be created inside a Tokio runtime; its waits sleep in that runtime's reactor. Moved to
/// another runtime, its waits are woken only while the first one's reactor runs (a
/// current-thread runtime runs it only inside `block_on`); once that runtime is shut down,
/// they poll and yield instead of sleeping (`tests/owned_qp.rs`).
pub struct OwnedQp<B: SgSource + SgTarget> {
    /// Taken only by `drop`, which destroys it off the runtime's workers.
    qp: ManuallyDrop<QueuePair>,
    ring: Ring<B>,
    cq: CqWait,
    caps: QpCaps,
    inline: bool,
    /// The requests of the [`Batch`] being filled (empty between batches; room for
    /// [`MAX_BATCH`], allocated once).
    batch: Vec<pending::Item>,
    /// The scatter/gather entries of the batch's requests (room for [`MAX_BATCH`] requests of
    /// `caps.max_send_sge` entries, allocated once).
    batch_sges: Vec<Sge>,
}

impl<B: SgSource + SgTarget> OwnedQp<B> {
    /// Creates the queue pair and its completion queue on `pd`'s device, in the RESET state:
    /// connect it with [`verbs`](Self::verbs) (INIT, RTR, RTS) before posting.
    ///
    /// # Errors
    ///
    /// [`InvalidArgument::QueueDepthOutOfRange`] for a queue deeper than
    /// [`MAX_QUEUE_DEPTH`]; [`InvalidArgument::OwnedQpWithoutRuntime`] outside a Tokio
    /// runtime; the verbs' errors creating the channel, CQ and queue pair.
    ///
    /// # Panics
    ///
    /// Inside a Tokio runtime built without its IO driver (`enable_io`), as Tokio's own
    /// sockets do: the completion channel is registered with it.
    pub fn new(pd: &ProtectionDomain, opts: OwnedQpOptions) -> Result<OwnedQp<B>> {
        let (send, recv) = (opts.caps.max_send_wr, opts.caps.max_recv_wr);
        if send > MAX_QUEUE_DEPTH || recv > MAX_QUEUE_DEPTH || send + recv == 0 {
            return Err(Error::InvalidArgument(
                InvalidArgument::QueueDepthOutOfRange {
                    send,
                    recv,
                    max: MAX_QUEUE_DEPTH,
                },
            ));
        }
        opts.mode.check().map_err(Error::InvalidArgument)?;
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(Error::InvalidArgument(
                InvalidArgument::OwnedQpWithoutRuntime,
            ));
        }
        let cq = CqWait::new(pd.context(), send + recv, opts.mode)?;
        let mut attr = QpInitAttr::new(&cq.cq, &cq.cq);
        attr.caps = opts.caps;
        // The CQ is driven (this queue pair's only): the one queue pair allowed on it.
        let qp = QueuePair::new_rc_driven(pd, &attr)?;
        qp.set_driven();
        let mut cq = cq;
        cq.set_qpn(qp.qpn());
        let caps = qp.caps();
        debug!(qpn = qp.qpn(), ?caps, mode = ?opts.mode, "owned queue pair created");
        Ok(OwnedQp {
            ring: Ring::new(send.min(caps.max_send_wr), recv.min(caps.max_recv_wr)),
            qp: ManuallyDrop::new(qp),
            cq,
            caps,
            inline: opts.inline,
            batch: Vec::with_capacity(MAX_BATCH),
            batch_sges: Vec::with_capacity(MAX_BATCH * caps.max_send_sge as usize),
        })
    }

    /// The verbs queue pair, to connect it (INIT/RTR/RTS) and query it. Posting on it directly
    /// is refused by the safe APIs ([`QueuePair::is_driven`]).
    pub fn verbs(&self) -> &QueuePair {
        &self.qp
    }

    /// The queue pair number.
    pub fn qpn(&self) -> u32 {
        self.qp.qpn()
    }

    /// The queue pair's actual limits.
    pub fn caps(&self) -> QpCaps {
        self.caps
    }

    /// Requests posted whose completion has not been polled yet.
    pub fn in_flight(&self) -> u32 {
        self.ring.in_flight()
    }

    /// Posts a send of `buf`'s initialised bytes (with immediate data if `imm` is given).
    ///
    /// # Errors
    ///
    /// The buffer comes back with the error: a full send queue
    /// ([`InvalidArgument::SendQueueFull`]), completions not taken
    /// ([`InvalidArgument::UncollectedCompletions`]), a buffer without an lkey or with too
    /// many segments, or [`Error::PostSend`].
    pub fn post_send(&mut self, buf: B, imm: Option<u32>) -> Result<Ticket, (Error, B)> {
        self.post_source(buf, send_op(imm))
    }

    /// Posts an RDMA WRITE of `buf`'s initialised bytes to the start of `remote` (with
    /// immediate data, consuming a receive of the peer, if `imm` is given).
    ///
    /// # Errors
    ///
    /// As [`post_send`](Self::post_send), and [`InvalidArgument::TokenRange`] if the bytes do
    /// not fit in `remote` (nothing is posted).
    pub fn post_write(
        &mut self,
        buf: B,
        remote: RemoteToken,
        imm: Option<u32>,
    ) -> Result<Ticket, (Error, B)> {
        self.post_source(buf, write_op(remote, imm))
    }

    /// Posts an RDMA READ of `remote`'s first `buf.bytes_total()` bytes into `buf` (the whole
    /// of each buffer of a list); the outcome's `len` is what was read.
    ///
    /// # Errors
    ///
    /// As [`post_write`](Self::post_write).
    pub fn post_read(&mut self, mut buf: B, remote: RemoteToken) -> Result<Ticket, (Error, B)> {
        let sges = match target_sges(&mut buf, self.caps.max_send_sge) {
            Ok(s) => s,
            Err(e) => return Err((e, buf)),
        };
        let op = match remote.check(0, total_len(sges.as_slice())) {
            Ok(remote_addr) => SendOp::Read {
                remote_addr,
                rkey: remote.rkey(),
            },
            Err(e) => return Err((e, buf)),
        };
        let len = u32::try_from(total_len(sges.as_slice())).unwrap_or(u32::MAX);
        self.post_send_wr(buf, Kind::Read(len), op, sges.as_slice(), false)
    }

    /// Posts a receive into `buf` (its whole capacity); the outcome's `len` is what arrived,
    /// and `buf`'s initialised length is set to it.
    ///
    /// # Errors
    ///
    /// As [`post_send`](Self::post_send), with [`InvalidArgument::RecvQueueFull`] and
    /// [`Error::PostRecv`].
    pub fn post_recv(&mut self, mut buf: B) -> Result<Ticket, (Error, B)> {
        let sges = match target_sges(&mut buf, self.caps.max_recv_sge) {
            Ok(s) => s,
            Err(e) => return Err((e, buf)),
        };
        let (wr_id, ticket) = self.ring.post(Kind::Recv, buf)?;
        // The ring's slot owns the buffer until this request's completion is polled from this
        // queue pair's own CQ (if the queue pair is dropped first, until its flush completion
        // is; else the buffer is leaked, never freed).
        // SAFETY: the SGEs name the buffer's memory, which stays put when the buffer moves
        // (`IoBuf`'s stable pointer) and stays allocated while the ring owns it (above).
        match unsafe { self.qp.post_recv_one(&RecvWr::new(wr_id, sges.as_slice())) } {
            Ok(()) => Ok(ticket),
            Err(e) => Err((e, self.ring.unpost(ticket))),
        }
    }

    #[inline]
    fn post_source(
        &mut self,
        buf: B,
        op: impl FnOnce(u64) -> Result<SendOp>,
    ) -> Result<Ticket, (Error, B)> {
        let (sges, op, inline) = match self.source_request(&buf, op) {
            Ok(r) => r,
            Err(e) => return Err((e, buf)),
        };
        self.post_send_wr(buf, Kind::Source, op, sges.as_slice(), inline)
    }

    /// The entries, operation and inline flag of a request reading `buf` (a send or a write),
    /// checked against this queue pair's limits; `op` gets the request's length.
    #[inline]
    fn source_request(
        &self,
        buf: &B,
        op: impl FnOnce(u64) -> Result<SendOp>,
    ) -> Result<(Sges, SendOp, bool)> {
        let sges = source_sges(buf, self.caps.max_send_sge)?;
        let total = total_len(sges.as_slice());
        let op = op(total)?;
        let inline = self.inline && total > 0 && total <= u64::from(self.caps.max_inline_data);
        Ok((sges, op, inline))
    }

    #[inline]
    fn post_send_wr(
        &mut self,
        buf: B,
        kind: Kind,
        op: SendOp,
        sges: &[Sge],
        inline: bool,
    ) -> Result<Ticket, (Error, B)> {
        self.post_forgotten();
        let (wr_id, ticket) = self.ring.post(kind, buf)?;
        let wr = SendWr::new(wr_id, op, sges).inline(inline);
        // SAFETY: as in `post_recv`: the ring owns the buffer the SGEs name until the
        // request's completion (it is signaled) is polled from this CQ.
        match unsafe { self.qp.post_send_one(&wr) } {
            Ok(()) => Ok(ticket),
            Err(e) => Err((e, self.ring.unpost(ticket))),
        }
    }

    /// Waits for the request of `ticket`; resolves with its outcome and its buffer.
    /// Completions of other requests found meanwhile are kept for their own tickets (or
    /// [`next_completion`](Self::next_completion)).
    ///
    /// # Errors
    ///
    /// [`InvalidArgument::ForeignTicket`] if `ticket` is not of this queue pair's (the future
    /// then never exists).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # use tokio_rdma::owned::OwnedQp;
    /// # use tokio_rdma::verbs::RegisteredBuffer;
    /// # async fn demo(
    /// #     qp: &mut OwnedQp<RegisteredBuffer>,
    /// #     a: RegisteredBuffer,
    /// #     b: RegisteredBuffer,
    /// # ) -> tokio_rdma::Result<()> {
    /// // Two receives posted at once; each is waited for by its ticket, in any order.
    /// let first = qp.post_recv(a).map_err(|(e, _buf)| e)?;
    /// let second = qp.post_recv(b).map_err(|(e, _buf)| e)?;
    /// let (res, b) = qp.wait(second)?.await;
    /// let second_len = res?.len;
    /// let (res, a) = qp.wait(first)?.await;
    /// let first_len = res?.len;
    /// # let _ = (a, b, first_len, second_len);
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it resolves gives the request up: it stays posted, and its
    /// buffer is dropped once its completion is polled (by a later wait, or when the queue pair
    /// is dropped). Nothing else is lost.
    pub fn wait(&mut self, ticket: Ticket) -> Result<Wait<'_, B>> {
        if !self.ring.owns(&ticket) {
            return Err(Error::InvalidArgument(InvalidArgument::ForeignTicket));
        }
        self.post_forgotten();
        self.cq.begin_wait();
        Ok(Wait {
            qp: self,
            state: State::Waiting(ticket),
        })
    }

    /// Waits for the oldest completed request not taken yet; resolves to `None` at once if
    /// nothing is completed or in flight. The ticket it resolves with equals the one the
    /// request was posted with: that one is spent ([`wait`](Self::wait) refuses it).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # use tokio_rdma::owned::OwnedQp;
    /// # use tokio_rdma::verbs::RegisteredBuffer;
    /// # async fn demo(
    /// #     qp: &mut OwnedQp<RegisteredBuffer>,
    /// #     bufs: Vec<RegisteredBuffer>,
    /// # ) -> tokio_rdma::Result<()> {
    /// for buf in bufs {
    ///     // The tickets need not be kept: each completion is handed out in turn.
    ///     let _ticket = qp.post_recv(buf).map_err(|(e, _buf)| e)?;
    /// }
    /// while let Some((_ticket, res, buf)) = qp.next_completion().await {
    ///     let got = res?;
    ///     let message = &buf.to_vec()[..got.len];
    ///     # let _ = message;
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a completion is taken only when the future resolves with it.
    pub fn next_completion(&mut self) -> Next<'_, B> {
        self.post_forgotten();
        self.cq.begin_wait();
        Next { qp: self }
    }

    /// Takes the oldest completed request not taken yet without waiting: if none is, polls
    /// the completion queue once (one `ibv_poll_cq`) and looks again. `None`: nothing has
    /// completed yet. A loop that keeps many requests in flight takes, after each wait, every
    /// completion already there, and posts their successors together (see [`Batch`]).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # use tokio_rdma::owned::OwnedQp;
    /// # use tokio_rdma::verbs::RegisteredBuffer;
    /// # async fn demo(qp: &mut OwnedQp<RegisteredBuffer>) -> tokio_rdma::Result<()> {
    /// let mut free = Vec::new();
    /// if let Some((_ticket, res, buf)) = qp.next_completion().await {
    ///     res?;
    ///     free.push(buf);
    ///     while let Some((_ticket, res, buf)) = qp.try_next_completion() {
    ///         res?;
    ///         free.push(buf);
    ///     }
    /// }
    /// // Post the next requests of `free`'s buffers in one batch.
    /// # Ok(()) }
    /// ```
    pub fn try_next_completion(&mut self) -> Option<(Ticket, Result<Completed>, B)> {
        self.post_forgotten();
        if let Some(done) = take_next_filled(&mut self.ring) {
            return Some(done);
        }
        if self.ring.in_flight() == 0 || self.cq.poll_once(&mut self.ring) == 0 {
            return None;
        }
        take_next_filled(&mut self.ring)
    }

    /// Sends `buf` and waits for the send's completion (see [`post_send`](Self::post_send)
    /// and [`wait`](Self::wait)).
    ///
    /// # Cancel safety
    ///
    /// The request is posted by this call; dropping the future gives it up as
    /// [`wait`](Self::wait) says.
    pub fn send(&mut self, buf: B) -> Wait<'_, B> {
        let r = self.post_send(buf, None);
        self.waiting(r)
    }

    /// Posts a receive into `buf` and waits for a message (see [`post_recv`](Self::post_recv)).
    ///
    /// # Cancel safety
    ///
    /// As for [`send`](Self::send): a receive given up still consumes a message, whose buffer
    /// is dropped.
    pub fn recv(&mut self, buf: B) -> Wait<'_, B> {
        let r = self.post_recv(buf);
        self.waiting(r)
    }

    /// Writes `buf`'s initialised bytes to `remote` and waits for the completion (see
    /// [`post_write`](Self::post_write)).
    ///
    /// # Cancel safety
    ///
    /// As for [`send`](Self::send).
    pub fn write(&mut self, buf: B, remote: RemoteToken) -> Wait<'_, B> {
        let r = self.post_write(buf, remote, None);
        self.waiting(r)
    }

    /// Reads `remote` into `buf` and waits for the completion (see
    /// [`post_read`](Self::post_read)).
    ///
    /// # Cancel safety
    ///
    /// As for [`send`](Self::send).
    pub fn read(&mut self, buf: B, remote: RemoteToken) -> Wait<'_, B> {
        let r = self.post_read(buf, remote);
        self.waiting(r)
    }

    fn waiting(&mut self, posted: Result<Ticket, (Error, B)>) -> Wait<'_, B> {
        let state = match posted {
            Ok(t) => State::Waiting(t),
            Err(failed) => State::Failed(Box::new(failed)),
        };
        self.cq.begin_wait();
        Wait { qp: self, state }
    }

    /// Applies completions until `done` says the wait is over.
    fn poll_until<T>(
        &mut self,
        cx: &mut Context<'_>,
        mut done: impl FnMut(&mut Ring<B>) -> Option<T>,
    ) -> Poll<T> {
        loop {
            if let Some(t) = done(&mut self.ring) {
                return Poll::Ready(t);
            }
            if self.cq.poll_progress(cx, &mut self.ring).is_pending() {
                return Poll::Pending;
            }
        }
    }
}

impl<B: SgSource + SgTarget> std::fmt::Debug for OwnedQp<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnedQp")
            .field("qpn", &self.qp.qpn())
            .field("in_flight", &self.ring.in_flight())
            .field("caps", &self.caps)
            .finish_non_exhaustive()
    }
}

impl<B: SgSource + SgTarget> std::fmt::Debug for Wait<'_, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.state {
            State::Waiting(_) => "waiting",
            State::Failed(..) => "failed to post",
            State::Finished => "finished",
        };
        f.debug_struct("Wait")
            .field("qpn", &self.qp.qp.qpn())
            .field("state", &state)
            .finish()
    }
}

impl<B: SgSource + SgTarget> std::fmt::Debug for Next<'_, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Next")
            .field("qpn", &self.qp.qp.qpn())
            .finish()
    }
}

/// The operation of an RDMA WRITE of `len` bytes to the start of `remote`, checked against it.
#[inline]
fn write_op(remote: RemoteToken, imm: Option<u32>) -> impl FnOnce(u64) -> Result<SendOp> {
    move |len| {
        let remote_addr = remote.check(0, len)?;
        let rkey = remote.rkey();
        Ok(match imm {
            Some(imm) => SendOp::WriteWithImm {
                remote_addr,
                rkey,
                imm,
            },
            None => SendOp::Write { remote_addr, rkey },
        })
    }
}

/// The operation of a send (with immediate data if `imm` is given).
#[inline]
fn send_op(imm: Option<u32>) -> impl FnOnce(u64) -> Result<SendOp> {
    move |_| {
        Ok(match imm {
            Some(imm) => SendOp::SendWithImm(imm),
            None => SendOp::Send,
        })
    }
}

/// A request's scatter/gather entries: a single buffer's without building a list (the
/// common case), a list's in an [`SgList`].
enum Sges {
    One(Option<Sge>),
    List(SgList),
}

impl Sges {
    #[inline]
    fn as_slice(&self) -> &[Sge] {
        match self {
            Sges::One(s) => s.as_slice(),
            Sges::List(l) => l.as_slice(),
        }
    }
}

#[inline]
fn total_len(sges: &[Sge]) -> u64 {
    sges.iter().map(|s| u64::from(s.length())).sum()
}

#[inline]
fn source_sges<S: SgSource>(buf: &S, max: u32) -> Result<Sges> {
    let sges = match buf.source_single() {
        Some(one) => Sges::One(one?),
        None => {
            let mut l = SgList::new();
            buf.source_segments(&mut l)?;
            Sges::List(l)
        }
    };
    check_sge_count(sges.as_slice().len(), max)?;
    Ok(sges)
}

#[inline]
fn target_sges<T: SgTarget>(buf: &mut T, max: u32) -> Result<Sges> {
    let sges = match buf.target_single() {
        Some(one) => Sges::One(one?),
        None => {
            let mut l = SgList::new();
            buf.target_segments(&mut l)?;
            Sges::List(l)
        }
    };
    check_sge_count(sges.as_slice().len(), max)?;
    Ok(sges)
}

enum State<B> {
    Waiting(Ticket),
    /// The post failed (boxed: the future stays small on the path that posts).
    Failed(Box<(Error, B)>),
    Finished,
}

/// The future of [`OwnedQp::wait`] and of the operations that post and wait: resolves with the
/// request's outcome and its buffer (a receive's or read's buffer has its initialised length
/// set to what arrived).
///
/// # Cancel safety
///
/// See [`OwnedQp::wait`].
///
/// # Panics
///
/// If polled again after it resolved.
#[must_use = "a dropped wait gives its request up"]
pub struct Wait<'a, B: SgSource + SgTarget> {
    qp: &'a mut OwnedQp<B>,
    state: State<B>,
}

// The future never pins its buffer (it only moves it out), so it is `Unpin` whatever `B` is.
impl<B: SgSource + SgTarget> Unpin for Wait<'_, B> {}

impl<B: SgSource + SgTarget> Future for Wait<'_, B> {
    type Output = (Result<Completed>, B);

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let State::Waiting(ticket) = &this.state else {
            return match std::mem::replace(&mut this.state, State::Finished) {
                State::Failed(failed) => {
                    let (e, b) = *failed;
                    Poll::Ready((Err(e), b))
                }
                _ => panic!("`Wait` polled after it resolved"),
            };
        };
        let (res, mut buf, fills) = ready!(this.qp.poll_until(cx, |ring| ring.take(ticket)));
        this.state = State::Finished;
        if let (Ok(c), true) = (&res, fills) {
            buf.set_filled(c.len);
        }
        Poll::Ready((res, buf))
    }
}

impl<B: SgSource + SgTarget> Drop for Wait<'_, B> {
    fn drop(&mut self) {
        if let State::Waiting(t) = &self.state {
            self.qp.ring.detach(t);
        }
    }
}

/// The future of [`OwnedQp::next_completion`]: the ticket, outcome and buffer of the oldest completed
/// request not taken yet, or `None` if nothing is completed or in flight.
///
/// # Cancel safety
///
/// Cancel safe.
#[must_use = "futures do nothing unless polled"]
pub struct Next<'a, B: SgSource + SgTarget> {
    qp: &'a mut OwnedQp<B>,
}

impl<B: SgSource + SgTarget> Future for Next<'_, B> {
    type Output = Option<(Ticket, Result<Completed>, B)>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        this.qp.poll_until(cx, |ring| match take_next_filled(ring) {
            Some(done) => Some(Some(done)),
            None if ring.in_flight() == 0 => Some(None),
            None => None,
        })
    }
}

/// The oldest completed request not taken yet, its buffer's initialised length set to what the
/// device wrote into it.
#[inline(always)]
fn take_next_filled<B: SgTarget>(ring: &mut Ring<B>) -> Option<(Ticket, Result<Completed>, B)> {
    let (t, (res, mut buf, fills)) = ring.take_next()?;
    if let (Ok(c), true) = (&res, fills) {
        buf.set_filled(c.len);
    }
    Some((t, res, buf))
}

impl<B: SgSource + SgTarget> Drop for OwnedQp<B> {
    fn drop(&mut self) {
        // The settled buffers are dropped last: a panicking `Drop` of one must not stop the
        // requests in flight from being handed over (the ring's own drop leaks them anyway).
        let mut settled = self.ring.release_settled();
        settled.extend(self.unpost_forgotten());
        // SAFETY: `drop` runs once, and `self.qp` is not used after this (the other fields
        // drop without touching it).
        let qp = unsafe { ManuallyDrop::take(&mut self.qp) };
        if self.ring.in_flight() == 0 {
            // Destroying the queue pair (and, with its last handle, the CQ) may block in the
            // kernel: not on a worker thread.
            off_runtime(move || drop(qp));
            drop(settled);
            return;
        }
        // The device may still use the buffers of requests in flight: move the queue pair to
        // the error state, so that each is flushed, and keep them until every completion is
        // polled.
        if let Err(e) = qp.to_error() {
            warn!(qpn = qp.qpn(), error = %e, "moving a dropped owned queue pair to the error state failed");
        }
        self.ring.detach_all();
        let ring = std::mem::replace(&mut self.ring, Ring::new(0, 0));
        let reap = Reap {
            ring,
            cq: self.cq.flushes(),
            qp: Some(qp),
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(reap.run());
            }
            Err(_) => reap.run_blocking(),
        }
        drop(settled);
    }
}

/// What a dropped queue pair leaves until the device has flushed its requests in flight.
struct Reap<B> {
    ring: Ring<B>,
    cq: Flushes,
    /// Taken by `drop`, which destroys it off the runtime's workers.
    qp: Option<QueuePair>,
}

impl<B> Reap<B> {
    /// Polls, yielding between polls, until every request in flight has completed: a flush
    /// takes the device microseconds. A device that takes longer (a stalled soft-RoCE, a
    /// hung NIC) is waited for on the blocking pool, sleeping between polls rather than
    /// spinning on a worker, for at most [`REAP_LIMIT`]: then what is left leaks.
    async fn run(mut self)
    where
        B: Send + 'static,
    {
        for _ in 0..REAP_YIELDS {
            if self.ring.in_flight() == 0 {
                debug!("a dropped owned queue pair was reaped");
                return;
            }
            if self.cq.poll(&mut self.ring) == 0 {
                tokio::task::yield_now().await;
            }
        }
        tokio::task::spawn_blocking(move || self.poll_sleeping(REAP_LIMIT));
    }

    /// [`run`](Self::run) outside a runtime: polls in place for at most [`BLOCKING_REAP`].
    fn run_blocking(mut self) {
        self.poll_sleeping(BLOCKING_REAP);
    }

    /// Polls until nothing is in flight or `limit` has passed, sleeping between empty polls
    /// (200 us at first, doubling up to 10 ms).
    fn poll_sleeping(&mut self, limit: Duration) {
        let start = Instant::now();
        let mut nap = Duration::from_micros(200);
        while self.ring.in_flight() > 0 && start.elapsed() < limit {
            if self.cq.poll(&mut self.ring) == 0 {
                std::thread::sleep(nap);
                nap = (nap * 2).min(Duration::from_millis(10));
            }
        }
        debug!(
            left = self.ring.in_flight(),
            "a dropped owned queue pair was reaped"
        );
    }
}

impl<B> Drop for Reap<B> {
    fn drop(&mut self) {
        // Still in flight (the runtime shut down, or the device never flushed them): the
        // device may write them yet. Leak them rather than free memory it may use.
        let leaked = self.ring.leak_in_flight();
        if leaked > 0 {
            error!(
                leaked,
                "an owned queue pair was dropped and its requests were not flushed; their buffers are leaked"
            );
        }
        if let Some(qp) = self.qp.take() {
            off_runtime(move || drop(qp));
        }
    }
}
