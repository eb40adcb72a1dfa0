//! [`State`]: everything behind the driver's lock: the operation table ([`Core`]), the queue
//! pairs it drives (their handles and sinks), the `qpn -> key` map of the shared receive queue's
//! queue pairs, and the reused lists of the hot path.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::Waker;
use std::time::{Duration, Instant};

use tracing::warn;

use super::deferred::{Deferred, Payload, Sink};
use crate::error::QpFailure;
use crate::proto::{Completed, Core, Cqe, PostItem, QpKey};
use crate::verbs::{QueuePair, WcBatch};

/// A queue pair as the driver tracks it.
#[derive(Debug)]
pub(crate) struct QpEntry {
    /// Its key in the core (index and generation).
    pub(crate) key: QpKey,
    pub(crate) qp: QueuePair,
    /// Dropped or closed: remove it (and destroy the QP) once nothing is posted.
    pub(crate) closing: bool,
    /// Completion queue entries reserved for it.
    pub(crate) cq_need: u64,
    /// The owner of its sink-routed requests, if any.
    pub(crate) sink: Option<Arc<dyn Sink>>,
    /// On a shared receive queue: `IBV_EVENT_QP_LAST_WQE_REACHED` arrived (it takes no more
    /// receives from the queue, and none it took is still to complete).
    pub(crate) last_wqe: bool,
    /// When it started closing (the bound on waiting for the last-WQE event).
    pub(crate) closing_since: Option<Instant>,
}

/// How long a closing queue pair on a shared receive queue waits for
/// `IBV_EVENT_QP_LAST_WQE_REACHED` before it is destroyed anyway (a provider that never sends
/// the event: soft-RoCE before Linux 6.5; or the event was read by another driver on the same
/// device context). Counted in `DriverStats::last_wqe_timeouts`.
pub(crate) const LAST_WQE_WAIT: Duration = Duration::from_secs(2);

#[derive(Debug)]
pub(crate) struct State {
    pub(crate) core: Core<Payload>,
    /// By key index; an entry answers only to its own key ([`State::entry`]).
    pub(crate) qps: Vec<Option<QpEntry>>,
    /// Queue pairs on the shared receive queue, by number (its completions name no key).
    pub(crate) by_qpn: HashMap<u32, QpKey>,
    /// Takes the shared receive queue's completions whose queue pair has no sink any more.
    pub(crate) srq_sink: Option<Arc<dyn Sink>>,
    /// Reused lists (the hot path does not allocate).
    pub(crate) posts: Vec<PostItem>,
    pub(crate) out: Completed<Payload>,
    pub(crate) batch: WcBatch,
    /// Reused by [`Shared::poll_cq`](super::shared::Shared::poll_cq): a run of successful
    /// completions of one sink's queue pair, handed to it together.
    pub(crate) run: Vec<(u32, Cqe)>,
    /// Who watches the completion channel (see `driver::watch`).
    pub(crate) watch: Watch,
}

impl State {
    /// Has `wake` move newly failed queue pairs to the error state (so the device flushes
    /// them) once the lock is released.
    #[inline]
    pub(crate) fn apply_failures(&mut self, wake: &mut Deferred) {
        // Every poll calls this; a failure is rare.
        if !self.out.failed.is_empty() {
            self.move_failed_to_error(wake);
        }
    }

    #[cold]
    fn move_failed_to_error(&mut self, wake: &mut Deferred) {
        let mut failed = std::mem::take(&mut self.out.failed);
        for qp in failed.drain(..) {
            if let Some(e) = self.entry(qp) {
                wake.move_to_error(&e.qp, None);
            }
        }
        // Keep the list's memory.
        self.out.failed = failed;
    }

    /// Fails `qp` with `cause`; `wake` moves it to ERR (after the lock is released) and
    /// takes the wakers.
    pub(crate) fn fail(&mut self, qp: QpKey, cause: QpFailure, wake: &mut Deferred) {
        self.core.fail_qp(qp, cause, &mut self.out);
        self.apply_failures(wake);
        wake.take_from(&mut self.out);
    }

    /// The entry of `key`, if that queue pair is still registered (not another one that took
    /// its index since).
    #[inline]
    pub(crate) fn entry(&self, key: QpKey) -> Option<&QpEntry> {
        self.qps
            .get(key.index())
            .and_then(Option::as_ref)
            .filter(|e| e.key == key)
    }

    /// As [`entry`](Self::entry), mutably.
    pub(crate) fn entry_mut(&mut self, key: QpKey) -> Option<&mut QpEntry> {
        self.qps
            .get_mut(key.index())
            .and_then(Option::as_mut)
            .filter(|e| e.key == key)
    }

    /// Removes closing queue pairs with nothing left in flight (destroying the QP happens when
    /// the returned handles are dropped, outside the lock). A queue pair on a shared receive
    /// queue also waits for `IBV_EVENT_QP_LAST_WQE_REACHED`, up to [`LAST_WQE_WAIT`] after it
    /// started closing: until then its number stays mapped to it, so a receive it took from
    /// the queue completes to its key (the buffer goes back to the queue), and the number is
    /// not given to a new queue pair that could take the old peer's bytes. Returns how many
    /// were destroyed without the event (the bound passed).
    pub(crate) fn reap_closed(&mut self, reaped: &mut Vec<QpEntry>, now: Instant) -> u64 {
        let mut timeouts = 0;
        for i in 0..self.qps.len() {
            let (key, waited_out) = match &self.qps[i] {
                Some(e) if e.closing => {
                    let waiting = e.qp.srq().is_some() && !e.last_wqe;
                    let since = e.closing_since.unwrap_or(now);
                    if waiting && now.duration_since(since) < LAST_WQE_WAIT {
                        continue;
                    }
                    (e.key, waiting)
                }
                _ => continue,
            };
            if self.core.posted(key) == 0 && self.core.remove_qp(key) {
                if waited_out {
                    timeouts += 1;
                    warn!(
                        qpn = self.qps[i].as_ref().map(|e| e.qp.qpn()),
                        "no IBV_EVENT_QP_LAST_WQE_REACHED within {LAST_WQE_WAIT:?} of closing a \
                         queue pair on the shared receive queue: destroyed without it"
                    );
                }
                if let Some(e) = self.qps[i].take() {
                    if self.by_qpn.get(&e.qp.qpn()) == Some(&e.key) {
                        self.by_qpn.remove(&e.qp.qpn());
                    }
                    reaped.push(e);
                }
            }
        }
        timeouts
    }
}

/// The identity of the waker a task's futures are polled with (its data and vtable
/// addresses, compared, never followed): [`Waker::will_wake`] of the waker as passed, not of a
/// clone, whose vtable may differ (Tokio polls with a borrowed waker whose clone is an owned
/// one: the same task, another vtable, so a clone never "will wake" the next poll's waker).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TaskId(usize, usize);

impl TaskId {
    pub(crate) fn of(waker: &Waker) -> TaskId {
        TaskId(
            waker.data() as usize,
            std::ptr::from_ref(waker.vtable()) as usize,
        )
    }
}

/// Who registered last at the channel descriptor's reader slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Holder {
    /// The completion task: it processes the readiness.
    Task,
    /// A watch task's future (maybe one that resolved since): the completion task must be
    /// woken to register again before it is relied on.
    Future,
}

/// The number of a watch ([`Watch`]'s epoch): nonzero, so that a waiter's `Option<Epoch>`
/// takes 8 bytes.
pub(crate) type Epoch = std::num::NonZeroU64;

/// The watch, under the driver's lock.
#[derive(Debug)]
pub(crate) struct Watch {
    /// The watch task: every sleeping future is in it. `None`: the completion task watches.
    task: Option<TaskId>,
    /// Its sleeping futures (those whose `Waiter::watch` is this watch's `epoch`).
    sleepers: usize,
    /// Counts the watches: a waiter of an ended one is not counted in a later one.
    epoch: Epoch,
    pub(crate) holder: Holder,
    /// Queue pairs with a sink (connections) and the shared receive queue's: while there are
    /// any, nobody but the completion task watches.
    pub(crate) sinks: usize,
}

impl Default for Watch {
    fn default() -> Watch {
        Watch {
            task: None,
            sleepers: 0,
            epoch: Epoch::MIN,
            holder: Holder::Task,
            sinks: 0,
        }
    }
}

impl Watch {
    /// Whether a watch task watches (the completion task then leaves the descriptor to it).
    #[inline]
    pub(crate) fn active(&self) -> bool {
        self.task.is_some()
    }

    /// Ends the watch (its futures sleep on as plain sleepers, woken through the table); the
    /// caller wakes the completion task.
    pub(crate) fn end(&mut self, watched: &AtomicBool) {
        if self.task.take().is_some() {
            self.sleepers = 0;
            // Never zero (a waiter holds an `Option<Epoch>` in 8 bytes); 2^64 watches do
            // not happen, and one that wrapped would only start over at 1.
            self.epoch = self.epoch.checked_add(1).unwrap_or(Epoch::MIN);
            watched.store(false, Ordering::Release);
        }
    }

    /// Whether the completion task must be woken so that it registers at the descriptor.
    #[inline]
    pub(crate) fn task_needed(&self) -> bool {
        self.holder != Holder::Task
    }

    /// A sleeper counted in the watch of epoch `joined` (taken) resolved or is dropped: it
    /// stops counting in it (the last one ends it). Returns whether it ended the watch.
    #[inline]
    pub(crate) fn leave(&mut self, joined: &mut Option<Epoch>, watched: &AtomicBool) -> bool {
        if let Some(epoch) = joined.take() {
            if epoch == self.epoch && self.task.is_some() {
                self.sleepers -= 1;
                if self.sleepers == 0 {
                    self.end(watched);
                    return true;
                }
            }
        }
        false
    }

    /// Whether task `me` is the watch task.
    #[inline]
    pub(crate) fn is(&self, me: TaskId) -> bool {
        self.task == Some(me)
    }

    /// Task `me` becomes the watch task (none was).
    pub(crate) fn begin(&mut self, me: TaskId, watched: &AtomicBool) {
        debug_assert!(self.task.is_none());
        self.task = Some(me);
        self.sleepers = 0;
        watched.store(true, Ordering::Release);
    }

    /// A sleeper of the watch task that was not counted yet (`joined` is not this watch's
    /// epoch) counts in it now.
    #[inline]
    pub(crate) fn join(&mut self, joined: &mut Option<Epoch>) {
        if *joined != Some(self.epoch) {
            *joined = Some(self.epoch);
            self.sleepers += 1;
        }
    }
}
