//! Sleeping futures that watch the completion channel themselves: a CQ event wakes the task
//! that waits for it, not the completion task, which would then wake the waiting task (two task
//! runs and a wake-up per event instead of one).
//!
//! A future that goes to sleep becomes a watcher when no future of another task sleeps on this
//! driver (and no connection or shared receive queue routes completions through it, whose
//! owners expect them applied while nobody waits). It then arms the CQ if it is not armed (and
//! polls once more: a completion before the arm raises no event), registers its task's waker
//! at the channel descriptor's reader slot, and, polled again, reads the event, re-arms and
//! drains the CQ itself, as [`OwnedQp`](crate::owned::OwnedQp)'s waits do.
//!
//! The invariant: **while some future sleeps, someone processes the channel's readiness when
//! it comes**, either the completion task or the one *watch task*. While there is a watch
//! task, every sleeper is one of its futures, and each of them, whenever it is polled, looks
//! at the descriptor: it reads a pending event (then re-arms and drains), or registers the
//! task at the reader slot. So after any poll of the task that leaves a sleeper pending, the
//! slot wakes the task, and whichever sleeper the task polls next learns of the event. A
//! sleeper the task does not poll (a receive polled once with `poll!` and kept) waits for
//! nothing meanwhile; the event stays pending until one is polled. No future's wake-up
//! depends on another task being polled:
//!
//! * a future of another task going to sleep ends the watch
//!   ([`Watch::end`](super::state::Watch::end)): it registers its waker in the table as
//!   every sleeper does, and wakes the completion task, which registers at the descriptor
//!   (the watch task's futures stop looking at it, under the same lock, so they do not take
//!   the reader slot back);
//! * the watch ends by itself when its last sleeper resolves or is dropped; if the table
//!   still holds operations then (started and not awaited, or dropped in flight with their
//!   buffers parked), the completion task is woken to watch for them;
//! * the reader slot holds one waker (the last registered). Everyone registers there under the
//!   driver's lock and records it ([`Watch::holder`](super::state::Watch::holder)); whoever
//!   finds the slot not the completion task's when the task is needed (a sleeper that cannot
//!   watch, an operation dropped in flight, a connection's sink set) wakes the task, which
//!   registers again; an operation dropped in flight, and a sink set, also end the watch (the
//!   watch task may not poll its sleepers for a while, and those completions are to be
//!   applied although nobody waits).
//!
//! Any party holding a readiness reads the event without blocking (at most one is pending:
//! the CQ is armed again only after the event of its last arm was read,
//! [`Shared::armed`](super::shared::Shared::armed)), so two that race read it once between
//! them; each clears the readiness it saw (not a newer one).

use std::task::{Context, Poll};

use tracing::warn;

use super::deferred::Deferred;
use super::shared::Shared;
use super::state::{Holder, State, TaskId};
use super::wait::Waiter;
use crate::proto::Outcome;

/// `waiter` resolved or is dropped (under the driver's lock): it leaves the watch. The last
/// one to leave wakes the completion task if the table still holds operations (a started one
/// nobody awaits yet, a dropped one's parked buffers): their completions must be applied
/// although nobody waits, and the reader slot holds this task's waker, not the completion
/// task's.
#[inline]
pub(crate) fn leave(st: &mut State, waiter: &mut Waiter, shared: &Shared) {
    if waiter.watch.is_some()
        && st.watch.leave(&mut waiter.watch, &shared.watched)
        && st.watch.task_needed()
        && st.core.ops_in_table() > 0
    {
        shared.notify.notify_one();
    }
}

/// The sleep of request `wr_id`'s future, under the driver's lock: it registers its waker in
/// the table (so a completion applied by anyone later wakes it), and watches the channel itself if it may (see the module), reading,
/// re-arming and draining as events come; else it makes sure the completion task watches.
/// Ready: the outcome (found by a drain here).
pub(super) fn sleep(
    shared: &Shared,
    st: &mut State,
    waiter: &mut Waiter,
    wr_id: u64,
    cx: &mut Context<'_>,
    wake: &mut Deferred,
) -> Poll<Outcome> {
    let me = TaskId::of(cx.waker());
    let mine = st.watch.is(me);
    let mut kick = waiter.take_kick_due();
    if !mine && st.watch.active() {
        // A sleeper of another task: the completion task watches from now on.
        st.watch.end(&shared.watched);
        kick = true;
    } else if !mine && st.watch.sinks == 0 && shared.sleepers.count() == 1 {
        // Nobody else sleeps: this task watches.
        st.watch.begin(me, &shared.watched);
    }
    if !st.watch.active() {
        if kick || st.watch.task_needed() {
            shared.notify.notify_one();
        }
        return st.core.poll_result(wr_id, Some(cx));
    }
    // Counted in the watch from now on. No shortcut for a second sleeper of the task (a
    // sibling registered the task at the descriptor already): the sibling may never be polled
    // again (a receive polled once with `poll!` and kept), and a readiness that woke the task
    // and was read since has emptied the slot. Tried: a sender beside such a receive waited
    // for its timeout (tests/async_ops.rs `start_posts_without_polling_or_spinning`, 60 s per
    // send in event mode).
    st.watch.join(&mut waiter.watch);
    // A drain below that completes this very request must not wake its task (it is being
    // polled): the waker an earlier poll left in the table goes, and is registered again
    // only if this poll ends pending.
    st.core.clear_waker(wr_id);
    loop {
        match shared.arm() {
            // A completion that came before the arm raises no event.
            Ok(true) => {
                if let Poll::Ready(out) = drain_for(shared, st, wr_id, wake) {
                    return Poll::Ready(out);
                }
            }
            Ok(false) => {}
            Err(e) => {
                warn!(error = %e, "arming the completion queue failed; the completion task watches");
                return hand_over(shared, st, waiter, wr_id, cx);
            }
        }
        let guard = match shared.events.poll_read_ready(cx) {
            Poll::Pending => {
                st.watch.holder = Holder::Future;
                return st.core.poll_result(wr_id, Some(cx));
            }
            Poll::Ready(Ok(guard)) => guard,
            Poll::Ready(Err(e)) => {
                warn!(error = %e, "completion channel readiness failed; the completion task watches");
                return hand_over(shared, st, waiter, wr_id, cx);
            }
        };
        shared.take_event(guard);
        if shared.mode == super::options::CompletionMode::Event && !shared.spinners.any() {
            // Re-arm before draining, as the completion task does.
            shared.rearm();
        }
        if let Poll::Ready(out) = drain_for(shared, st, wr_id, wake) {
            return Poll::Ready(out);
        }
    }
}

/// Polls the CQ until empty (one batch short of full), then looks at `wr_id`'s outcome.
fn drain_for(shared: &Shared, st: &mut State, wr_id: u64, wake: &mut Deferred) -> Poll<Outcome> {
    while shared.poll_cq(st, wake) == st.batch.capacity() {}
    st.core.poll_result(wr_id, None)
}

/// The completion task watches from now on (an operation dropped in flight parked its
/// buffers, or a sink was set: completions to apply although nobody waits): the watch ends,
/// and the task is woken if the reader slot is not its own.
pub(crate) fn hand_to_task(st: &mut State, shared: &Shared) {
    st.watch.end(&shared.watched);
    if st.watch.task_needed() {
        shared.notify.notify_one();
    }
}

/// Watching failed: the watch ends and the completion task takes over (the waker stays in the
/// table).
fn hand_over(
    shared: &Shared,
    st: &mut State,
    waiter: &mut Waiter,
    wr_id: u64,
    cx: &mut Context<'_>,
) -> Poll<Outcome> {
    let _ = st.watch.leave(&mut waiter.watch, &shared.watched);
    st.watch.end(&shared.watched);
    st.watch.holder = Holder::Future;
    shared.notify.notify_one();
    st.core.poll_result(wr_id, Some(cx))
}
