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
use crate::proto::{OpInfo, WorkRequest};
use crate::verbs::SendWr;

/// The most requests one batch holds (one chain of work requests).
pub const MAX_BATCH: usize = 16;

/// One request of a batch: what to post, its buffers, and once posted its id and outcome.
#[derive(Debug)]
pub(crate) struct Item<B> {
    wr: WorkRequest,
    pub(crate) buf: B,
    wr_id: u64,
    pub(crate) outcome: Option<Result<OpInfo>>,
}

/// Where the batch is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Taking requests; nothing is posted.
    Gathering,
    /// Submitted: the outcomes of items `..next` are collected, the others are awaited.
    InFlight { next: usize },
    /// Every outcome is collected, not yet handed out.
    Done,
}

/// The engine behind [`ops::Batch`](crate::ops::Batch) (see the module's documentation).
#[derive(Debug)]
pub(crate) struct RawBatch<B: Send + 'static> {
    cfg: OpConfig,
    items: Vec<Item<B>>,
    phase: Phase,
    waiter: Waiter,
}

impl<B: Send + 'static> RawBatch<B> {
    pub(crate) fn new(cfg: &OpConfig) -> RawBatch<B> {
        RawBatch {
            cfg: cfg.clone(),
            items: Vec::with_capacity(MAX_BATCH),
            phase: Phase::Gathering,
            waiter: Waiter::default(),
        }
    }

    pub(crate) fn cfg(&self) -> &OpConfig {
        &self.cfg
    }

    /// Requests gathered and not yet submitted (after a submission, until its outcomes are
    /// taken: the requests of that submission).
    pub(crate) fn len(&self) -> usize {
        self.items.len()
    }

    /// Adds a request (`wr`: its work request, or why it cannot be posted).
    ///
    /// # Errors
    ///
    /// `wr`'s error, or [`InvalidArgument::BatchFull`]; the buffer comes back.
    pub(crate) fn push(&mut self, wr: Result<WorkRequest>, buf: B) -> Result<(), (Error, B)> {
        self.reset();
        if self.items.len() == MAX_BATCH {
            let full = InvalidArgument::BatchFull { max: MAX_BATCH };
            return Err((Error::InvalidArgument(full), buf));
        }
        match wr {
            Ok(wr) => {
                self.items.push(Item {
                    wr,
                    buf,
                    wr_id: 0,
                    outcome: None,
                });
                Ok(())
            }
            Err(e) => Err((e, buf)),
        }
    }

    /// Makes the batch ready to gather: outcomes nobody took are dropped (and the requests of
    /// an unfinished submission, which its owning wait makes unreachable here, given up).
    fn reset(&mut self) {
        match self.phase {
            Phase::Gathering => {}
            Phase::InFlight { .. } => self.abandon(),
            Phase::Done => {
                self.phase = Phase::Gathering;
                self.items.clear();
            }
        }
    }

    /// Submits and posts the gathered requests now, without waiting for them (the wait
    /// begins at the next [`poll_submit`](Self::poll_submit)). Does nothing once submitted.
    pub(crate) fn start(&mut self) {
        if self.phase == Phase::Gathering && !self.items.is_empty() {
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
            items,
            phase,
            waiter,
        } = self;
        let shared: &Shared = &cfg.shared;
        let mut wake = Deferred::default();
        let (mut next, mut st, mut fresh) = match *phase {
            Phase::Done => return finish(phase, cx),
            Phase::InFlight { next } => (next, shared.lock(), false),
            Phase::Gathering if items.is_empty() => {
                *phase = Phase::Done;
                return finish(phase, cx);
            }
            Phase::Gathering => {
                let mut st = shared.lock();
                waiter.start(shared);
                if let Err(f) = submit(cfg, items, &mut st, &mut wake) {
                    drop(st);
                    wake.run();
                    for item in items.iter_mut() {
                        item.outcome = Some(Err(Error::QpFailed(f.clone())));
                    }
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
                while let Some(item) = items.get_mut(next) {
                    match st.core.poll_result(item.wr_id, None) {
                        Poll::Ready(out) => {
                            item.outcome = Some(out);
                            next += 1;
                        }
                        Poll::Pending => break,
                    }
                }
            }
            let Some(item) = items.get_mut(next) else {
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
                item.wr_id,
                st,
                fresh,
                false,
                &mut wake,
                cx,
            );
            match out {
                Poll::Ready(out) => {
                    item.outcome = Some(out);
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

    /// The requests of the finished submission with their outcomes, oldest first; the batch
    /// gathers again.
    pub(crate) fn take_outcomes(&mut self) -> std::vec::Drain<'_, Item<B>> {
        let done = self.phase == Phase::Done;
        self.phase = Phase::Gathering;
        // Nothing to hand out unless every outcome is collected.
        let n = if done { self.items.len() } else { 0 };
        self.items.drain(..n)
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
        let items = std::mem::replace(&mut self.items, Vec::with_capacity(MAX_BATCH));
        let mut kept = Vec::with_capacity(items.len());
        let mut st = shared.lock();
        for (i, item) in items.into_iter().enumerate() {
            if i < next {
                kept.push(item.buf);
                continue;
            }
            let mut buf = Some(item.buf);
            st.core.cancel_with(item.wr_id, || {
                Box::new(buf.take().expect("parked once")) as Payload
            });
            kept.extend(buf);
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

/// Submits and posts `items` under the lock `st`: straight from the batch as one chain when
/// they can all go now, else queued behind the others and posted with what fits.
///
/// # Errors
///
/// The queue pair failed (its cause) or is gone: nothing was submitted.
fn submit<B>(
    cfg: &OpConfig,
    items: &mut [Item<B>],
    st: &mut MutexGuard<'_, State>,
    wake: &mut Deferred,
) -> std::result::Result<(), QpFailure> {
    let n = items.len();
    let mut signaled = [false; MAX_BATCH];
    let direct = st.core.submit_posted_sends(cfg.qp, n, |i, wr_id, s| {
        items[i].wr_id = wr_id;
        signaled[i] = s;
    })?;
    if direct {
        let mut wrs = [const { SendWr::EMPTY }; MAX_BATCH];
        let mut ids = [0u64; MAX_BATCH];
        for (i, item) in items.iter().enumerate() {
            wrs[i] = post::send_wr(item.wr_id, &item.wr, signaled[i]);
            ids[i] = item.wr_id;
        }
        // SAFETY: each request's buffers stay in this batch until its outcome is collected,
        // or move into the table first (`abandon`): the memory outlives the device's use.
        unsafe {
            post::post_send_list(st, &cfg.shared.counters, cfg.qp, &wrs[..n], &ids[..n], wake)
        };
        return Ok(());
    }
    // Queued behind what waits for room (the slow path): the requests are copied into the
    // queue pair's pending list and posted as they fit.
    for item in items.iter_mut() {
        let queued = st.core.submit_unparked(cfg.qp, item.wr.clone());
        item.wr_id = queued
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
