//! [`RawBatch`]: the engine of [`ops::Batch`](crate::ops::Batch). Up to [`MAX_BATCH`] sends
//! and writes of one queue pair, gathered without a future each, posted as one chain (one
//! `ibv_post_send`, one doorbell) with only the last signaled (unless the queue pair's
//! `signal_every` asks for more), and waited for as one.
//!
//! * **The buffers stay in the batch** while the device uses them, as they stay in an
//!   operation's future; the wait owns the batch. If it is dropped before every request is
//!   complete, the buffers of the incomplete ones move into the operation table
//!   ([`Core::cancel_with`](crate::proto::Core::cancel_with)) until their completions arrive:
//!   the device never reads freed memory. A forgotten wait leaks the batch with its buffers.
//! * **Completion in order.** A send queue completes in order: the signaled last request's
//!   completion retires the others (the core's send ring), a failing one gets its own error
//!   completion, and the ones after it are flushed. The wait collects the outcomes oldest
//!   first and sleeps or spins only on the oldest one still missing, as any operation's
//!   future does (`raw::wait_outcome`).
//! * **Fast path**: with room for all of them and nothing queued before them, the requests are
//!   posted straight from the batch (`Core::submit_posted_sends`); otherwise they are queued
//!   like any operation's request and posted as room frees.
//! * **No allocation** in steady state: the batch keeps its storage across rounds; the chain
//!   is built on the stack.

use std::sync::MutexGuard;
use std::task::{Context, Poll};

use super::deferred::{Deferred, Payload};
use super::latency::WaitKind;
use super::post;
use super::raw::{OpConfig, wait_outcome};
use super::shared::Shared;
use super::state::State;
use super::wait::Waiter;
use crate::error::{Error, InvalidArgument, QpFailure, Result};
use crate::proto::{SgList, WorkRequest};
use crate::verbs::{SendOp, SendWr};

/// The most requests one [`Batch`](crate::ops::Batch) holds (one chain of work requests).
///
/// # Examples
///
/// ```no_run
/// # use tokio_rdma::driver::{AsyncQp, MAX_BATCH};
/// # use tokio_rdma::verbs::RegisteredBuffer;
/// # fn demo(qp: &AsyncQp, mut bufs: Vec<RegisteredBuffer>) {
/// let mut batch = qp.batch();
/// while batch.len() < MAX_BATCH {
///     let Some(buf) = bufs.pop() else { break };
///     batch.send(buf).map_err(|(e, _)| e).unwrap();
/// }
/// # }
/// ```
pub const MAX_BATCH: usize = 16;

/// Where the batch is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Taking requests; nothing is posted.
    Gathering,
    /// Submitted: the outcomes of requests `..next` are collected, the others are awaited.
    InFlight { next: usize },
    /// Every outcome is collected, not yet handed out.
    Done,
}

/// The engine behind [`ops::Batch`](crate::ops::Batch) (see the module's documentation).
///
/// The requests are kept column by column (work requests, buffers, ids): posting reads the
/// first, handing the outcomes out moves only the buffers, and a success is recorded as
/// nothing at all (the failures, rare, are listed with their index).
#[derive(Debug)]
pub(crate) struct RawBatch<B: Send + 'static> {
    cfg: OpConfig,
    /// The requests' work requests: slot `i` is request `i`'s while `i < bufs.len()` (the
    /// slots are kept and rewritten in place by each round).
    wrs: Vec<WorkRequest>,
    bufs: Vec<B>,
    /// The requests' `wr_id`s once submitted.
    ids: [u64; MAX_BATCH],
    /// The requests that failed, by index, in order (allocated on the first failure only).
    failed: Vec<(usize, Error)>,
    phase: Phase,
    waiter: Waiter,
}

impl<B: Send + 'static> RawBatch<B> {
    pub(crate) fn new(cfg: &OpConfig) -> RawBatch<B> {
        RawBatch {
            cfg: cfg.clone(),
            wrs: Vec::with_capacity(MAX_BATCH),
            bufs: Vec::with_capacity(MAX_BATCH),
            ids: [0; MAX_BATCH],
            failed: Vec::new(),
            phase: Phase::Gathering,
            waiter: Waiter::default(),
        }
    }

    /// Requests gathered and not yet submitted (after a submission, until its outcomes are
    /// taken: the requests of that submission).
    pub(crate) fn len(&self) -> usize {
        self.bufs.len()
    }

    /// Adds a request: `fill` writes its work request into the batch's next slot, where it
    /// stays (nothing is moved), or says why it cannot be posted.
    ///
    /// # Errors
    ///
    /// `fill`'s error, or [`InvalidArgument::BatchFull`]; the buffer comes back.
    #[inline]
    pub(crate) fn push_with(
        &mut self,
        buf: B,
        fill: impl FnOnce(&OpConfig, &B, &mut WorkRequest) -> Result<()>,
    ) -> Result<(), (Error, B)> {
        if self.phase != Phase::Gathering {
            self.reset();
        }
        let i = self.bufs.len();
        if i == MAX_BATCH {
            let full = InvalidArgument::BatchFull { max: MAX_BATCH };
            return Err((Error::InvalidArgument(full), buf));
        }
        if self.wrs.len() == i {
            // The slots are made once and reused by every round.
            self.wrs
                .push(WorkRequest::send_list(SendOp::Send, SgList::new()));
        }
        match fill(&self.cfg, &buf, &mut self.wrs[i]) {
            Ok(()) => {
                self.bufs.push(buf);
                Ok(())
            }
            Err(e) => Err((e, buf)),
        }
    }

    /// Makes the batch ready to gather: outcomes nobody took are dropped (and the requests of
    /// an unfinished submission, which its owning wait makes unreachable here, given up).
    #[cold]
    fn reset(&mut self) {
        match self.phase {
            Phase::Gathering => {}
            Phase::InFlight { .. } => self.abandon(),
            Phase::Done => {
                self.phase = Phase::Gathering;
                self.bufs.clear();
                self.failed.clear();
            }
        }
    }

    /// Submits and posts the gathered requests now, without waiting for them (the wait
    /// begins at the next [`poll_submit`](Self::poll_submit)). Does nothing once submitted.
    pub(crate) fn start(&mut self) {
        if self.phase == Phase::Gathering && !self.bufs.is_empty() {
            let mut cx = Context::from_waker(std::task::Waker::noop());
            // Pending, or Done (a failed queue pair): either way the next poll goes on.
            let _ = self.poll(&mut cx, true);
        }
    }

    /// Submits the gathered requests (at the first call) and drives them: Ready once every
    /// request has its outcome (see [`take_outcomes`](Self::take_outcomes)).
    pub(crate) fn poll_submit(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        self.poll(cx, false)
    }

    /// [`poll_submit`](Self::poll_submit); `starting`: [`start`](Self::start)'s call, which
    /// only posts.
    fn poll(&mut self, cx: &mut Context<'_>, starting: bool) -> Poll<()> {
        let RawBatch {
            cfg,
            wrs,
            bufs,
            ids,
            failed,
            phase,
            waiter,
        } = self;
        let n = bufs.len();
        let wrs = &wrs[..n];
        let ids = &mut ids[..n];
        let shared: &Shared = &cfg.shared;
        let mut wake = Deferred::default();
        let (mut next, mut st, mut fresh) = match *phase {
            Phase::Done => return finish(phase, cx),
            Phase::InFlight { next } => (next, shared.lock(), false),
            Phase::Gathering if n == 0 => {
                *phase = Phase::Done;
                return finish(phase, cx);
            }
            Phase::Gathering => {
                let mut st = shared.lock();
                waiter.start(shared);
                if let Err(f) = submit(cfg, wrs, ids, &mut st, &mut wake) {
                    drop(st);
                    wake.run();
                    failed.extend((0..n).map(|i| (i, Error::QpFailed(f.clone()))));
                    *phase = Phase::Done;
                    return finish(phase, cx);
                }
                wake.take_from(&mut st.out);
                if starting {
                    drop(st);
                    wake.run();
                    *phase = Phase::InFlight { next: 0 };
                    return Poll::Pending;
                }
                // Posted under this lock: no outcome yet unless posting failed.
                (0, st, true)
            }
        };
        loop {
            if !fresh {
                let from = next;
                next += st
                    .core
                    .collect_done(&ids[from..], |i, e| failed.push((from + i, e)));
            }
            let Some(&id) = ids.get(next) else {
                drop(st);
                wake.run();
                waiter.done(shared, WaitKind::Send);
                *phase = Phase::Done;
                return finish(phase, cx);
            };
            // The oldest request still missing its outcome: the others complete after it.
            let out = wait_outcome(
                shared,
                waiter,
                WaitKind::Send,
                id,
                st,
                fresh,
                false,
                &mut wake,
                cx,
            );
            match out {
                Poll::Ready(out) => {
                    if let Err(e) = out {
                        failed.push((next, *e));
                    }
                    next += 1;
                    fresh = false;
                    st = shared.lock();
                }
                Poll::Pending => {
                    *phase = Phase::InFlight { next };
                    return Poll::Pending;
                }
            }
        }
    }

    /// The finished submission's buffers, oldest first, and its failures (by index); the
    /// batch gathers again. Empty (and the batch untouched) unless every outcome is collected.
    pub(crate) fn take_outcomes(
        &mut self,
    ) -> (std::vec::Drain<'_, B>, std::vec::Drain<'_, (usize, Error)>) {
        if self.phase != Phase::Done {
            return (self.bufs.drain(..0), self.failed.drain(..0));
        }
        self.phase = Phase::Gathering;
        (self.bufs.drain(..), self.failed.drain(..))
    }

    /// A submission's wait was dropped before its end: gives up its requests.
    /// Queued ones are withdrawn; posted ones that are not complete keep their buffers in the
    /// table until their completions arrive. The other buffers are dropped after the lock is
    /// released.
    pub(crate) fn abandon(&mut self) {
        let Phase::InFlight { next } = self.phase else {
            return;
        };
        self.phase = Phase::Gathering;
        let shared: &Shared = &self.cfg.shared;
        self.waiter.leave(shared);
        self.failed.clear();
        let bufs = std::mem::replace(&mut self.bufs, Vec::with_capacity(MAX_BATCH));
        let mut kept = Vec::with_capacity(bufs.len());
        let mut st = shared.lock();
        super::watch::leave(&mut st, &mut self.waiter, shared);
        let mut parked = false;
        for (i, buf) in bufs.into_iter().enumerate() {
            if i < next {
                kept.push(buf);
                continue;
            }
            let mut buf = Some(buf);
            st.core.cancel_with(self.ids[i], || {
                Box::new(buf.take().expect("parked once")) as Payload
            });
            parked |= buf.is_none();
            kept.extend(buf);
        }
        if parked {
            // As a dropped operation's (`RawOp`): the completion task watches for them.
            super::watch::hand_to_task(&mut st, shared);
        }
        drop(st);
        drop(kept);
    }
}

/// Hands the outcomes out, within Tokio's cooperative budget as every operation's future does.
fn finish(phase: &mut Phase, cx: &mut Context<'_>) -> Poll<()> {
    debug_assert_eq!(*phase, Phase::Done);
    match tokio::task::coop::poll_proceed(cx) {
        Poll::Ready(coop) => {
            coop.made_progress();
            Poll::Ready(())
        }
        // The task was woken; the next poll hands them out.
        Poll::Pending => Poll::Pending,
    }
}

/// Submits and posts `wrs` under the lock `st`, their ids into `ids`: straight from the batch
/// as one chain when they can all go now, else queued behind the others and posted with what
/// fits.
///
/// # Errors
///
/// The queue pair failed (its cause) or is gone: nothing was submitted.
fn submit(
    cfg: &OpConfig,
    wrs: &[WorkRequest],
    ids: &mut [u64],
    st: &mut MutexGuard<'_, State>,
    wake: &mut Deferred,
) -> std::result::Result<(), QpFailure> {
    let n = wrs.len();
    let mut chain = [const { SendWr::EMPTY }; MAX_BATCH];
    let direct = st
        .core
        .submit_posted_sends(cfg.qp, n, |i, wr_id, signaled| {
            ids[i] = wr_id;
            chain[i] = post::send_wr(wr_id, &wrs[i], signaled);
        })?;
    if direct {
        // SAFETY: each request's buffers stay in this batch until its outcome is collected,
        // or move into the table first (`abandon`): the memory outlives the device's use.
        unsafe { post::post_send_list(st, &cfg.shared.counters, cfg.qp, &chain[..n], ids, wake) };
        return Ok(());
    }
    // Queued behind what waits for room (the slow path): the requests are copied into the
    // queue pair's pending list and posted as they fit.
    for (id, wr) in ids.iter_mut().zip(wrs) {
        let queued = st.core.submit_unparked(cfg.qp, wr.clone());
        *id = queued
            .expect("the queue pair was checked under this lock")
            .wr_id;
    }
    post::post(st, &cfg.shared.counters, cfg.qp, wake);
    Ok(())
}

impl<B: Send + 'static> Drop for RawBatch<B> {
    fn drop(&mut self) {
        self.abandon();
    }
}
