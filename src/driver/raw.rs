//! [`RawOp`]: the one future behind every queue-pair operation (the typed futures in
//! [`ops`](crate::ops) wrap it).
//!
//! * **Post on first poll**: constructing it does nothing; a future never polled posts nothing.
//! * **The request is built when it is posted**: the future keeps what the operation asks
//!   for in a few bytes (its [`Request`]: a remote token, immediate data) and builds the work
//!   request from that and its buffers on the first poll, on the stack, where it is posted
//!   from (or moved once into the queue pair's pending list). A request built at creation
//!   was ~100 bytes of every future, copied each time the future moved.
//! * **The buffers stay in the future** while the device uses them; only if the future is
//!   dropped before the completion do they move into the operation table (one allocation, on
//!   that path only), to be released when the completion arrives. So dropping (or forgetting)
//!   the future never frees memory the device may still touch.
//! * **Completions polled in place**: a waiting future polls the CQ itself, completing its own
//!   operation and any others it finds (their wakers are woken after the lock is released),
//!   then spins or sleeps as the completion mode says (see `wait.rs`).
//! * **Coalescing** ([`QpOptions::coalesce`](super::QpOptions::coalesce)): the first poll queues
//!   the request and yields once, so requests started in the same wake go in one doorbell.
//! * **Backpressure**: a full send queue makes the future wait; it is not an error.
//! * **No allocation** in steady state: a request (with up to
//!   [`INLINE_SGES`](crate::proto::INLINE_SGES) entries) is built on the stack and, if it must
//!   queue, moved into its queue pair's pending list (which keeps its memory); wakers are
//!   collected in a fixed array.

use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};
use std::task::{Context, Poll};

use super::counters::add_held;
use super::deferred::{Deferred, Payload};
use super::latency::WaitKind;
use super::post;
use super::shared::Shared;
use super::state::State;
use super::wait::Waiter;
use crate::error::Result;
use crate::proto::{Outcome, QpKey, Queue, SgList, WorkRequest, box_error};
use crate::verbs::QpCaps;

/// What one kind of operation asks for, kept by its future until the first poll builds the
/// work request from it and the buffers `B` ([`RawOp`]). An error building it (a buffer
/// without a key, too many entries, a remote slice out of bounds) is the operation's outcome,
/// and nothing is posted.
pub(crate) trait Request<B>: std::marker::Send + 'static {
    /// The queue its requests go to.
    const QUEUE: Queue;

    /// Writes the request for `buf` into `wr` (every field: `wr` may hold anything), checked
    /// against the queue pair's limits in `cfg`.
    fn build(&mut self, cfg: &OpConfig, buf: &mut B, wr: &mut WorkRequest) -> Result<()>;
}

/// What every operation of one queue pair needs to know, behind one pointer: each operation
/// future holds a clone (one reference count, 8 bytes of the future, not the 40 of the
/// fields, which it would copy on every construction and move).
#[derive(Debug, Clone)]
pub(crate) struct OpConfig(Arc<OpFields>);

/// The fields of an [`OpConfig`].
#[derive(Debug)]
pub(crate) struct OpFields {
    pub(crate) shared: Arc<Shared>,
    pub(crate) qp: QpKey,
    pub(crate) caps: QpCaps,
    pub(crate) coalesce: bool,
    pub(crate) inline: bool,
}

impl OpConfig {
    pub(crate) fn new(cfg: OpFields) -> OpConfig {
        OpConfig(Arc::new(cfg))
    }
}

impl std::ops::Deref for OpConfig {
    type Target = OpFields;

    #[inline]
    fn deref(&self) -> &OpFields {
        &self.0
    }
}

/// Where an operation is: plain data, so a change of state is one store and drops nothing.
/// What it asks for ([`RawOp::req`]) and the buffers ([`RawOp::buf`], moved once, out of the
/// resolved future) sit beside it; so does an outcome known before anyone waited for it
/// ([`RawOp::early`]).
#[derive(Debug, Clone, Copy)]
enum RawState {
    /// Not polled yet: nothing is built or posted.
    Init,
    /// Queued or posted. `flushed`: this future already asked for a post.
    InTable { wr_id: u64, flushed: bool },
    /// Resolved before anyone waited ([`RawOp::start`]): the outcome, in `early`, is for the
    /// next poll.
    Ready,
    /// Resolved.
    Done,
}

/// The engine shared by all operation futures.
#[derive(Debug)]
pub(crate) struct RawOp<B: Send + 'static, R> {
    cfg: OpConfig,
    state: RawState,
    /// What the operation asks for: its work request is built from it on the first poll.
    req: R,
    /// The outcome of an operation resolved by [`start`](Self::start) before anyone waited.
    early: Option<Outcome>,
    /// The operation's buffers: here from creation until the future resolves (then handed
    /// out) or is dropped (then parked in the table if the device may still use them).
    buf: Option<B>,
    waiter: Waiter,
    kind: WaitKind,
    /// Post on the first poll even on a coalescing queue pair ([`start`](Self::start)). Only
    /// `start` sets it, and only before its own (first) poll: a first poll with it set is
    /// `start`'s, which posts but does not poll the CQ in place, spin or sleep (nobody waits
    /// yet), nor count a round of the wait's ramp (the first real poll polls as any future's
    /// first poll does).
    eager: bool,
    /// Counted in [`Shared::unposted`]: made and not posted yet (see [`posted`]).
    unposted: bool,
}

impl<B: Send + 'static, R: Request<B>> RawOp<B, R> {
    #[inline]
    pub(crate) fn new(cfg: &OpConfig, buf: B, req: R) -> RawOp<B, R> {
        let kind = match R::QUEUE {
            Queue::Recv => WaitKind::Recv,
            Queue::Send => WaitKind::Send,
        };
        cfg.shared.unposted.fetch_add(1, Ordering::Relaxed);
        RawOp {
            cfg: cfg.clone(),
            state: RawState::Init,
            req,
            early: None,
            buf: Some(buf),
            waiter: Waiter::default(),
            kind,
            eager: false,
            unposted: true,
        }
    }

    /// What the operation asks for (as its first poll left it).
    #[inline]
    pub(crate) fn req(&self) -> &R {
        &self.req
    }

    /// Posts the request now, without waiting for its completion; the outcome (also an error
    /// posting it) is reported when the future is polled. Does nothing if already posted.
    pub(crate) fn start(&mut self) {
        if matches!(self.state, RawState::Init) {
            self.eager = true;
            let waker = std::task::Waker::noop();
            let mut cx = Context::from_waker(waker);
            // Posted (or complete, held back by a spent budget); its wait, spinning or
            // sleeping, begins at its first real poll.
            if let Poll::Ready(out) = self.poll_state(&mut cx) {
                self.state = RawState::Ready;
                self.early = Some(out);
            }
        }
    }

    /// Drives the operation; on completion returns its outcome and the buffers.
    pub(crate) fn poll_raw(&mut self, cx: &mut Context<'_>) -> Poll<(Outcome, B)> {
        match self.poll_state(cx) {
            Poll::Ready(out) => {
                let buf = self.buf.take().expect("a future resolves once");
                Poll::Ready((out, buf))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    /// Drives the operation; on completion returns its outcome (the buffers stay in
    /// [`buf`](Self::buf)).
    fn poll_state(&mut self, cx: &mut Context<'_>) -> Poll<Outcome> {
        let RawOp {
            cfg,
            state,
            req,
            early,
            buf,
            waiter,
            kind,
            eager,
            unposted,
        } = self;
        let shared: &Shared = &cfg.shared;
        let mut wake = Deferred::default();
        // The lock taken to post is kept for the first look at the result.
        let mut posted_under = None;
        // This is `start`'s poll (see `eager`): post only.
        let mut starting = false;
        // Matched in place: a new request is posted from where it lies and only then
        // overwritten by its table entry's id; an outcome moves out once.
        let (wr_id, flushed) = match state {
            RawState::InTable { wr_id, flushed, .. } => (*wr_id, std::mem::replace(flushed, true)),
            RawState::Init => {
                // Built where it is posted from (nothing moves it there), on the first poll
                // only: later polls find it posted.
                let mut wr = WorkRequest::recv_list(SgList::new());
                match build(cfg, req, buf, &mut wr)
                    .and_then(|()| submit(cfg, waiter, *eager, &mut wr, &mut wake))
                {
                    Err(err) => {
                        *state = RawState::Done;
                        posted(shared, unposted);
                        return Poll::Ready(Err(box_error(err)));
                    }
                    Ok((wr_id, None)) => {
                        // Queued on a coalescing queue pair: yield once so that siblings started
                        // in this wake queue up too; the next poll posts them all with one
                        // doorbell.
                        *state = RawState::InTable {
                            wr_id,
                            flushed: false,
                        };
                        cx.waker().wake_by_ref();
                        return Poll::Pending;
                    }
                    Ok((wr_id, Some(st))) => {
                        posted_under = Some(st);
                        starting = *eager;
                        *state = RawState::InTable {
                            wr_id,
                            flushed: true,
                        };
                        (wr_id, true)
                    }
                }
            }
            RawState::Ready => {
                // Complete, held back by a spent budget (below): hand it out on a fresh one.
                return match tokio::task::coop::poll_proceed(cx) {
                    Poll::Ready(coop) => {
                        coop.made_progress();
                        *state = RawState::Done;
                        Poll::Ready(early.take().expect("a ready operation holds its outcome"))
                    }
                    Poll::Pending => Poll::Pending,
                };
            }
            RawState::Done => panic!("operation future polled after completion"),
        };
        let just_posted = posted_under.is_some();
        let mut st = posted_under.unwrap_or_else(|| shared.lock());
        if !flushed {
            post::post(&mut st, &shared.counters, cfg.qp, &mut wake);
            wake.take_from(&mut st.out);
        }
        // Posted now (straight away, or from the queue just above; a full queue posts it as
        // room frees, which no poll of this task can hasten).
        posted(shared, unposted);
        match wait_outcome(
            shared,
            waiter,
            *kind,
            wr_id,
            st,
            just_posted,
            starting,
            &mut wake,
            cx,
        ) {
            Poll::Ready(outcome) => {
                *state = RawState::Done;
                // Tokio's cooperative budget, as its own I/O types: a loop of operations that
                // always complete within their in-place polls still yields to the runtime's
                // other tasks once the task's budget is spent. Checked only for the result,
                // never before posting: the first poll posts whatever the budget.
                match tokio::task::coop::poll_proceed(cx) {
                    Poll::Ready(coop) => {
                        coop.made_progress();
                        Poll::Ready(outcome)
                    }
                    Poll::Pending => {
                        // The task was woken; the next poll hands the result out.
                        *state = RawState::Ready;
                        *early = Some(outcome);
                        Poll::Pending
                    }
                }
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

/// The wait of posted request `wr_id` for its outcome, under the driver's lock `st`: polls the
/// CQ in place (busy and adaptive modes), then spins (wakes itself) or sleeps (registers the
/// waker) as the completion mode says. `fresh`: posted under this very lock, so it has no
/// outcome yet unless posting failed. `starting`: [`RawOp::start`]'s poll, which only posts
/// (it neither polls in place, spins nor sleeps). Ready: the outcome, the wait is `done`.
/// Runs `wake` once the lock is released. Shared by [`RawOp`] and the batches
/// ([`RawBatch`](super::batch::RawBatch)).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn wait_outcome<'s>(
    shared: &'s Shared,
    waiter: &mut Waiter,
    kind: WaitKind,
    wr_id: u64,
    mut st: MutexGuard<'s, State>,
    fresh: bool,
    starting: bool,
    wake: &mut Deferred,
    cx: &mut Context<'_>,
) -> Poll<Outcome> {
    // Busy mode polls in place up to IN_PLACE_POLLS times before it yields to the runtime
    // (a runtime round trip per empty poll costs several times the poll itself); the lock
    // is released between polls, so other threads post and poll meanwhile.
    let polls = if starting {
        0
    } else {
        waiter.in_place_polls(shared)
    };
    // A request posted by this very poll, under the lock still held, has no outcome yet
    // unless posting it failed (the core then records the failure as its outcome): its
    // first look at the table comes after the CQ poll, or, for a wait that sleeps at once,
    // with the registration of its waker (which reports such a failure as well).
    let mut res = if fresh {
        Poll::Pending
    } else {
        st.core.poll_result(wr_id, None)
    };
    let mut n = 0;
    while res.is_pending() && n < polls {
        if n > 0 {
            drop(st);
            wake.run();
            std::hint::spin_loop();
            st = shared.lock();
        }
        n += 1;
        add_held(&shared.counters.polled_in_place, 1, &st);
        shared.poll_cq(&mut st, wake);
        res = st.core.poll_result(wr_id, None);
    }
    let mut spin = false;
    if res.is_pending() && !starting {
        // With the completion task gone (its runtime shut down) nobody would wake a
        // sleeper: keep polling in place until the flush completion arrives.
        spin = waiter.keep_spinning(shared, kind) || shared.stopped.load(Ordering::Acquire);
        if !spin {
            // Sleep: the waker is registered under the lock, so a completion applied by
            // anyone after this point wakes us; the future may watch the channel itself.
            res = super::watch::sleep(shared, &mut st, waiter, wr_id, cx, wake);
        } else {
            waiter.kick_if_due(shared);
        }
    }
    if let Poll::Ready(outcome) = res {
        super::watch::leave(&mut st, waiter, shared);
        drop(st);
        wake.run();
        waiter.done(shared, kind);
        return Poll::Ready(outcome);
    }
    // Pending. `start`'s poll (`starting`) neither spins nor sleeps: nobody waits until the
    // first real poll (joining and leaving the spinners would hand the CQ to the
    // completion task, which arms it: a system call and a CQ event per operation that
    // `start` posts, for nothing).
    drop(st);
    wake.run();
    if spin {
        cx.waker().wake_by_ref();
    }
    Poll::Pending
}

/// The first poll of a request: submits it under the driver's lock and posts it, straight
/// from `wr` when it can go now (`Core::submit_posted`: nothing queued ahead of it, room in its
/// queue), else queued behind the others and posted with what fits. On a coalescing queue pair
/// (unless `start` posts it: `eager`) it only queues, and the next poll posts it with its
/// siblings: `Ok((wr_id, None))`. Posted: the lock, kept for the first look at the result.
///
/// # Errors
///
/// The queue pair failed (its cause) or is gone: nothing was submitted.
#[inline]
fn submit<'s>(
    cfg: &'s OpConfig,
    waiter: &mut Waiter,
    eager: bool,
    wr: &mut WorkRequest,
    wake: &mut Deferred,
) -> Result<(u64, Option<MutexGuard<'s, State>>)> {
    let shared: &Shared = &cfg.shared;
    let mut st = shared.lock();
    waiter.start(shared);
    let now = !cfg.coalesce || eager;
    let direct = if now {
        st.core.submit_posted(cfg.qp, wr.queue)?
    } else {
        None
    };
    let wr_id = match direct {
        Some((wr_id, signaled)) => {
            post::post_one(&mut st, &shared.counters, cfg.qp, wr_id, wr, signaled, wake);
            wr_id
        }
        // Queued: the request moves to its queue pair's pending list (the slow path).
        None => {
            let wr = std::mem::replace(wr, WorkRequest::recv_list(SgList::new()));
            st.core.submit_unparked(cfg.qp, wr)?.wr_id
        }
    };
    if !now {
        return Ok((wr_id, None));
    }
    if direct.is_none() {
        post::post(&mut st, &shared.counters, cfg.qp, wake);
    }
    wake.take_from(&mut st.out);
    Ok((wr_id, Some(st)))
}

/// The work request of `req` for `buf` (which a future holds until it resolves), built on
/// the stack of the poll that posts it.
#[inline(always)]
fn build<B, R: Request<B>>(
    cfg: &OpConfig,
    req: &mut R,
    buf: &mut Option<B>,
    wr: &mut WorkRequest,
) -> Result<()> {
    let buf = buf
        .as_mut()
        .expect("an operation holds its buffers until it resolves");
    req.build(cfg, buf, wr)
}

/// The operation no longer waits to be posted (it was, or it never will be): it stops holding
/// back the in-place spins of the futures beside it ([`Shared::unposted`]). Once per future.
#[inline]
fn posted(shared: &Shared, unposted: &mut bool) {
    if std::mem::take(unposted) {
        shared.unposted.fetch_sub(1, Ordering::Relaxed);
    }
}

// The buffers are never pinned: their memory is stable (the `IoBuf` contract) and the handles
// move freely.
impl<B: Send + 'static, R> Unpin for RawOp<B, R> {}

impl<B: Send + 'static, R> Drop for RawOp<B, R> {
    fn drop(&mut self) {
        let RawOp {
            cfg,
            state,
            waiter,
            buf,
            unposted,
            ..
        } = self;
        let shared: &Shared = &cfg.shared;
        waiter.leave(shared);
        posted(shared, unposted);
        let RawState::InTable { wr_id, .. } = *state else {
            // Resolved, or never posted: nothing of it is in the table.
            return;
        };
        let mut st = shared.lock();
        super::watch::leave(&mut st, waiter, shared);
        st.core.cancel_with(wr_id, || {
            Box::new(buf.take().expect("parked once")) as Payload
        });
        if buf.is_none() {
            // Parked until its completion, which nobody awaits: the completion task watches
            // for it (a watch task may not poll its sleepers for a while).
            super::watch::hand_to_task(&mut st, shared);
        }
        drop(st);
        // Not parked (never posted, or already complete): dropped with the future, outside the
        // lock.
    }
}

#[cfg(test)]
mod tests {
    use std::mem::size_of;

    use crate::buf::Slice;
    use crate::verbs::RegisteredBuffer;

    /// Every operation future is built, moved (into `join!`, a `select!`, a task, a slot of
    /// the caller's) and dropped whole, once per operation: its size is paid in copies on the
    /// data path (`send_lat` 2 B counted 274 instructions of `memcpy` per round trip at 336
    /// bytes, docs/benchmarks-speed-5.md). A field that makes it grow should be a choice.
    #[test]
    fn an_operation_future_stays_small() {
        // The buffer (a 64-byte `Slice` of a registered buffer here) is the caller's; the
        // engine around it: the shared configuration (one pointer), its state, what the
        // operation asks for (a remote token, immediate data: the work request is built when
        // it is posted, not carried), an early outcome and the waiting state.
        assert_eq!(size_of::<super::OpConfig>(), 8);
        assert!(size_of::<super::Waiter>() <= 40);
        type Buf = Slice<RegisteredBuffer>;
        let sizes = [
            ("Write", size_of::<crate::ops::Write<Buf>>(), 184),
            ("Read", size_of::<crate::ops::Read<Buf>>(), 184),
            ("Send", size_of::<crate::ops::Send<Buf>>(), 160),
            ("Recv", size_of::<crate::ops::Recv<Buf>>(), 152),
        ];
        for (op, size, max) in sizes {
            assert!(
                size <= max,
                "{op}<Slice<RegisteredBuffer>> is {size} bytes, more than {max}"
            );
        }
        // The list a batch or a queued request carries stays small too.
        assert!(size_of::<crate::proto::SgList>() <= 72);
    }
}
