//! [`Core`]: the operation table and queue-pair accounting behind one API.

use std::task::{Context, Poll, Waker};

use super::key::QpKey;
use super::qp::{QpConfig, QpSlot};
use super::table::{Entry, Lifecycle, OpTable};
use super::wr::{Cqe, OpInfo, Outcome, PostItem, Queue, WorkRequest, box_error};
use crate::error::{Error, QpFailure, WcStatus};
use crate::verbs::WcOpcode;

/// The result of [`Core::submit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Submitted {
    /// The id to post with and to poll by.
    pub wr_id: u64,
}

/// What [`Core::complete`] (and the failure calls) produced; reused across calls to avoid
/// allocating. Wake the wakers and drop the payloads **after** releasing the core's lock.
#[derive(Debug)]
pub struct Completed<P> {
    /// Futures to wake.
    pub wakers: Vec<Waker>,
    /// Payloads of cancelled operations, now free to drop.
    pub released: Vec<P>,
    /// Queue pairs that have queued requests and queue space again: post them.
    pub postable: Vec<QpKey>,
    /// Queue pairs that failed during this call: move them to the error state so their
    /// posted requests are flushed.
    pub failed: Vec<QpKey>,
    /// Completions that matched no operation (stale, duplicate or spurious).
    pub unknown: u64,
}

impl<P> Default for Completed<P> {
    fn default() -> Self {
        Completed {
            // Room for a few wakers and queue pairs per call (a poll's batch usually
            // completes few operations): the lists rarely grow in steady state.
            wakers: Vec::with_capacity(16),
            released: Vec::new(),
            postable: Vec::with_capacity(4),
            failed: Vec::new(),
            unknown: 0,
        }
    }
}

impl<P> Completed<P> {
    /// Whether there is nothing to act on.
    pub fn is_empty(&self) -> bool {
        self.wakers.is_empty()
            && self.released.is_empty()
            && self.postable.is_empty()
            && self.failed.is_empty()
    }

    /// Clears the lists, keeping their memory.
    pub fn clear(&mut self) {
        self.wakers.clear();
        self.released.clear();
        self.postable.clear();
        self.failed.clear();
        self.unknown = 0;
    }
}

/// The sans-IO engine of one completion queue: every queue pair that reports to that CQ, and
/// every operation in flight on them. `P` is the payload parked with an operation (its buffers).
#[derive(Debug)]
pub struct Core<P> {
    table: OpTable<P>,
    qps: Vec<Option<QpSlot>>,
    /// The current generation of each index of `qps` (bumped when its queue pair goes).
    gens: Vec<u64>,
}

impl<P> Default for Core<P> {
    fn default() -> Self {
        Core::new()
    }
}

impl<P> Core<P> {
    /// An empty core.
    pub fn new() -> Core<P> {
        Core {
            table: OpTable::new(),
            qps: Vec::new(),
            gens: Vec::new(),
        }
    }

    /// Registers a queue pair; `None` if [`QpKey::MAX_INDEX`] queue pairs are registered.
    pub fn add_qp(&mut self, cfg: QpConfig) -> Option<QpKey> {
        let slot = Some(QpSlot::new(cfg));
        let i = match self.qps.iter().position(Option::is_none) {
            Some(i) => i,
            None if self.qps.len() < QpKey::MAX_INDEX => {
                self.qps.push(None);
                self.gens.push(0);
                self.qps.len() - 1
            }
            None => return None,
        };
        self.qps[i] = slot;
        Some(QpKey::new(i, self.gens[i]))
    }

    /// Whether `qp` names a registered queue pair (not one removed since).
    pub fn is_live(&self, qp: QpKey) -> bool {
        self.live(qp).is_some()
    }

    /// Forgets a queue pair. Returns `false` (and keeps it) while it has outstanding requests.
    /// Its index is reused with the next generation: `qp` names nothing from now on.
    pub fn remove_qp(&mut self, qp: QpKey) -> bool {
        match self.live(qp) {
            Some(slot) if slot.outstanding() > 0 => false,
            Some(_) => {
                let i = qp.index();
                self.qps[i] = None;
                self.gens[i] = self.gens[i].wrapping_add(1) & QpKey::GEN_MASK;
                true
            }
            None => true,
        }
    }

    fn live(&self, qp: QpKey) -> Option<&QpSlot> {
        let i = qp.index();
        if self.gens.get(i) != Some(&qp.generation()) {
            return None;
        }
        self.qps.get(i)?.as_ref()
    }

    fn live_mut(&mut self, qp: QpKey) -> Option<&mut QpSlot> {
        live_slot(&mut self.qps, &self.gens, qp)
    }

    /// The slot of a queue pair known to be live (it has entries in the table, or the caller
    /// checked).
    fn slot(&mut self, qp: QpKey) -> &mut QpSlot {
        self.live_mut(qp).expect("queue pair is registered")
    }

    /// Operations in the table (queued, posted, completed-but-uncollected, or cancelled).
    pub fn ops_in_table(&self) -> usize {
        self.table.len()
    }

    /// Requests of `qp` queued or posted and not yet completed.
    pub fn outstanding(&self, qp: QpKey) -> usize {
        self.live(qp).map_or(0, QpSlot::outstanding)
    }

    /// Posted requests of `qp` the device still owes a completion for.
    pub fn posted(&self, qp: QpKey) -> usize {
        self.live(qp).map_or(0, QpSlot::posted)
    }

    /// The failure of `qp`, if it failed; [`QpFailure::Closed`] for a key that names no
    /// registered queue pair (removed, as [`submit`](Self::submit) reports it too).
    pub fn failure(&self, qp: QpKey) -> Option<&QpFailure> {
        static CLOSED: QpFailure = QpFailure::Closed;
        match self.live(qp) {
            Some(slot) => slot.failure.as_ref(),
            None => Some(&CLOSED),
        }
    }

    /// Queues a request with its payload. The payload is owned by the table from now on.
    ///
    /// # Errors
    ///
    /// If the queue pair has failed, returns [`Error::QpFailed`] with its cause, and the
    /// payload back (nothing was queued); [`QpFailure::Closed`] if it was removed.
    pub fn submit(
        &mut self,
        qp: QpKey,
        wr: WorkRequest,
        payload: P,
    ) -> Result<Submitted, (Error, P)> {
        if let Err(e) = self.check_submit(qp) {
            return Err((e, payload));
        }
        Ok(self.insert(qp, wr, Some(payload)))
    }

    /// Queues a request whose buffers stay with its future (the driver's way: nothing moves
    /// into the table unless the future is dropped while the device owns the buffers, see
    /// [`cancel_with`](Self::cancel_with)). Collect the outcome with
    /// [`poll_result`](Self::poll_result).
    ///
    /// # Errors
    ///
    /// [`Error::QpFailed`] with the cause if the queue pair has failed (nothing was queued),
    /// with [`QpFailure::Closed`] if it was removed (its key is stale).
    pub fn submit_unparked(&mut self, qp: QpKey, wr: WorkRequest) -> Result<Submitted, Error> {
        self.check_submit(qp)?;
        Ok(self.insert(qp, wr, None))
    }

    fn check_submit(&self, qp: QpKey) -> Result<(), Error> {
        match self.live(qp) {
            None => Err(Error::QpFailed(QpFailure::Closed)),
            Some(slot) => match &slot.failure {
                Some(f) => Err(Error::QpFailed(f.clone())),
                None => Ok(()),
            },
        }
    }

    fn insert(&mut self, qp: QpKey, wr: WorkRequest, payload: Option<P>) -> Submitted {
        let queue = wr.queue;
        let wr_id = self.table.insert(Entry {
            qp,
            queue,
            lifecycle: Lifecycle::Queued,
            waker: None,
            payload,
        });
        let slot = self.slot(qp);
        match queue {
            Queue::Send => slot.sq_pending.push_back((wr_id, wr)),
            Queue::Recv => slot.rq_pending.push_back((wr_id, wr)),
        }
        Submitted { wr_id }
    }

    /// Submits a request the caller posts right away, itself, while still holding the core's
    /// lock (the driver's fast path: the request is never copied into the core), if it can go
    /// now: no queued request of its queue waits before it, none of the other queue waits
    /// with room to go (they would have gone in its batch), and its queue has room. Returns
    /// its `wr_id` and whether to signal it (a lone send is the last of its batch: always);
    /// `Ok(None)` if it must queue ([`submit_unparked`](Self::submit_unparked)). If posting
    /// fails, report it with [`post_failed`](Self::post_failed) as for a queued request.
    ///
    /// # Errors
    ///
    /// As [`submit_unparked`](Self::submit_unparked).
    #[inline]
    pub fn submit_posted(&mut self, qp: QpKey, queue: Queue) -> Result<Option<(u64, bool)>, Error> {
        // One look at the queue pair's slot (checks, room, accounting), beside the table.
        let Core { table, qps, gens } = self;
        let Some(slot) = live_slot(qps, gens, qp) else {
            return Err(Error::QpFailed(QpFailure::Closed));
        };
        if let Some(f) = &slot.failure {
            return Err(Error::QpFailed(f.clone()));
        }
        let room = match queue {
            Queue::Send => slot.sq_space(),
            Queue::Recv => slot.rq_space(),
        };
        // Queued requests with room (of either queue) go first, in one batch with it; with
        // no room it queues (behind any queued before it).
        if room == 0 || slot.has_postable() {
            return Ok(None);
        }
        let wr_id = table.insert(Entry {
            qp,
            queue,
            lifecycle: Lifecycle::Submitted,
            waker: None,
            payload: None,
        });
        let signaled = match queue {
            Queue::Send => {
                let signaled = slot.next_signaled(true);
                slot.sq_ring.push_back(wr_id);
                signaled
            }
            Queue::Recv => {
                slot.rq_posted += 1;
                true
            }
        };
        Ok(Some((wr_id, signaled)))
    }

    /// [`submit_posted`](Self::submit_posted) for `n` sends the caller posts as one chain, in
    /// this order, while still holding the core's lock: if all of them can go now (nothing
    /// queued waits with room, room for all `n`), calls `each(i, wr_id, signaled)` for each
    /// and returns `Ok(true)`. Only the last is signaled unless the signaling policy asks for
    /// more (every `signal_every`-th, one that fills the queue). `Ok(false)`: nothing was
    /// submitted; queue them with [`submit_unparked`](Self::submit_unparked).
    ///
    /// # Errors
    ///
    /// The queue pair's failure ([`QpFailure::Closed`] if it was removed); nothing was
    /// submitted.
    pub fn submit_posted_sends(
        &mut self,
        qp: QpKey,
        n: usize,
        mut each: impl FnMut(usize, u64, bool),
    ) -> Result<bool, QpFailure> {
        let Core { table, qps, gens } = self;
        let Some(slot) = live_slot(qps, gens, qp) else {
            return Err(QpFailure::Closed);
        };
        if let Some(f) = &slot.failure {
            return Err(f.clone());
        }
        if slot.sq_space() < n || slot.has_postable() {
            return Ok(false);
        }
        for i in 0..n {
            let wr_id = table.insert(Entry {
                qp,
                queue: Queue::Send,
                lifecycle: Lifecycle::Submitted,
                waker: None,
                payload: None,
            });
            let signaled = slot.next_signaled(i + 1 == n);
            slot.sq_ring.push_back(wr_id);
            each(i, wr_id, signaled);
        }
        Ok(true)
    }

    /// Whether `qp` has queued requests that fit in its queues now.
    pub fn has_postable(&self, qp: QpKey) -> bool {
        self.live(qp).is_some_and(QpSlot::has_postable)
    }

    /// Moves as many queued requests of `qp` as its queues have room for into `out` (receives
    /// first, then sends), marking them posted and applying the signaling policy. The caller
    /// must post exactly these, in this order, while still holding the core's lock (the send
    /// queue's order is how unsignaled requests are retired).
    pub fn take_postable(&mut self, qp: QpKey, out: &mut Vec<PostItem>) {
        let Core { table, qps, gens } = self;
        let Some(slot) = live_slot(qps, gens, qp) else {
            return;
        };
        if slot.failure.is_some() {
            return;
        }
        let n = slot.rq_space().min(slot.rq_pending.len());
        for _ in 0..n {
            let (wr_id, wr) = slot.rq_pending.pop_front().expect("counted");
            slot.rq_posted += 1;
            mark_posted(table, wr_id);
            out.push(PostItem {
                wr_id,
                wr,
                signaled: true,
            });
        }
        let n = slot.sq_space().min(slot.sq_pending.len());
        for i in 0..n {
            let (wr_id, wr) = slot.sq_pending.pop_front().expect("counted");
            let signaled = slot.next_signaled(i + 1 == n);
            slot.sq_ring.push_back(wr_id);
            mark_posted(table, wr_id);
            out.push(PostItem {
                wr_id,
                wr,
                signaled,
            });
        }
    }

    /// Polls an operation: its outcome and payload once complete, else registers the waker.
    ///
    /// # Panics
    ///
    /// If `wr_id` is not in the table (the future already collected it: a bug in the caller),
    /// or if it was submitted without a payload.
    pub fn poll_op(&mut self, wr_id: u64, cx: &mut Context<'_>) -> Poll<(Outcome, P)> {
        self.poll_entry(wr_id, Some(cx))
            .map(|(outcome, payload)| (outcome, payload.expect("payload parked until collected")))
    }

    /// Polls an operation submitted with [`submit_unparked`](Self::submit_unparked): its
    /// outcome once complete (the entry is then gone), else registers the waker (if `cx` is
    /// given: a future that keeps polling by itself passes `None`).
    ///
    /// # Panics
    ///
    /// If `wr_id` is not in the table.
    #[inline]
    pub fn poll_result(&mut self, wr_id: u64, cx: Option<&mut Context<'_>>) -> Poll<Outcome> {
        self.poll_entry(wr_id, cx).map(|(outcome, _)| outcome)
    }

    /// Forgets the waker registered for `wr_id`, if any (its future is being polled and
    /// registers again if it stays pending). Does nothing for an id not in the table.
    #[inline]
    pub fn clear_waker(&mut self, wr_id: u64) {
        if let Some(entry) = self.table.get_mut(wr_id) {
            entry.waker = None;
        }
    }

    #[inline]
    fn poll_entry(
        &mut self,
        wr_id: u64,
        cx: Option<&mut Context<'_>>,
    ) -> Poll<(Outcome, Option<P>)> {
        let entry = self
            .table
            .get_mut(wr_id)
            .expect("operation is in the table");
        // Only the outcome and the payload move out; the slot is freed where it lies.
        let outcome = match &mut entry.lifecycle {
            Lifecycle::Done(info) => Ok(*info),
            Lifecycle::Failed(_) => {
                let Lifecycle::Failed(err) =
                    std::mem::replace(&mut entry.lifecycle, Lifecycle::Cancelled)
                else {
                    unreachable!("matched above");
                };
                Err(err)
            }
            _ => {
                if let Some(cx) = cx {
                    match &entry.waker {
                        Some(w) if w.will_wake(cx.waker()) => {}
                        _ => entry.waker = Some(cx.waker().clone()),
                    }
                }
                return Poll::Pending;
            }
        };
        let payload = entry.payload.take();
        self.table.free(wr_id);
        Poll::Ready((outcome, payload))
    }

    /// Collects the outcomes of the operations `ids` (submitted with
    /// [`submit_unparked`](Self::submit_unparked)), oldest first, while they are complete:
    /// a success is dropped, a failure handed to `failed` with its index. Returns how many
    /// were collected (their entries are gone); the next one is not complete yet. A batch's
    /// look at its requests: no waker registered, no outcome built for a success.
    ///
    /// # Panics
    ///
    /// If an id is not in the table.
    pub fn collect_done(&mut self, ids: &[u64], mut failed: impl FnMut(usize, Error)) -> usize {
        for (i, &wr_id) in ids.iter().enumerate() {
            let entry = self
                .table
                .get_mut(wr_id)
                .expect("operation is in the table");
            match &mut entry.lifecycle {
                Lifecycle::Done(_) => {}
                Lifecycle::Failed(_) => {
                    let Lifecycle::Failed(err) =
                        std::mem::replace(&mut entry.lifecycle, Lifecycle::Cancelled)
                    else {
                        unreachable!("matched above");
                    };
                    failed(i, *err);
                }
                _ => return i,
            }
            self.table.free(wr_id);
        }
        ids.len()
    }

    /// Whether operation `wr_id` has its outcome (cheap check, no waker registered).
    pub fn is_complete(&self, wr_id: u64) -> bool {
        self.table
            .get(wr_id)
            .is_some_and(|e| matches!(e.lifecycle, Lifecycle::Done(_) | Lifecycle::Failed(_)))
    }

    /// The future of `wr_id` was dropped. A queued request is withdrawn and its payload
    /// returned; a posted one is marked cancelled and its payload stays parked until its
    /// completion (then appears in [`Completed::released`]); a completed one is removed and its
    /// payload returned.
    pub fn cancel(&mut self, wr_id: u64) -> Option<P> {
        let entry = self.table.get_mut(wr_id)?;
        match entry.lifecycle {
            Lifecycle::Queued => {
                let (qp, queue) = (entry.qp, entry.queue);
                let slot = self.slot(qp);
                let list = match queue {
                    Queue::Send => &mut slot.sq_pending,
                    Queue::Recv => &mut slot.rq_pending,
                };
                if let Some(pos) = list.iter().position(|&(id, _)| id == wr_id) {
                    list.remove(pos);
                }
                self.table.remove(wr_id).and_then(|e| e.payload)
            }
            Lifecycle::Submitted => {
                entry.lifecycle = Lifecycle::Cancelled;
                entry.waker = None;
                None
            }
            Lifecycle::Done(_) | Lifecycle::Failed(_) => {
                self.table.remove(wr_id).and_then(|e| e.payload)
            }
            Lifecycle::Cancelled => None,
        }
    }

    /// The future of an operation submitted with [`submit_unparked`](Self::submit_unparked)
    /// was dropped, still holding its buffers. Queued (never posted) or already completed: the
    /// entry goes and `park` is not called (the future drops its buffers). Posted: the device
    /// may still use the buffers, so `park()` moves them into the table until the completion
    /// arrives (then they appear in [`Completed::released`]).
    pub fn cancel_with(&mut self, wr_id: u64, park: impl FnOnce() -> P) {
        let Some(entry) = self.table.get_mut(wr_id) else {
            return;
        };
        if matches!(entry.lifecycle, Lifecycle::Submitted) {
            entry.payload = Some(park());
        }
        drop(self.cancel(wr_id));
    }

    /// Applies one work completion.
    #[inline]
    pub fn complete(&mut self, cqe: &Cqe, out: &mut Completed<P>) {
        let Some((qp, had_postable, settled)) = self.retire_through(cqe, out) else {
            return;
        };
        // `settled`: recorded by `retire_through` with its one look at the entry.
        if !settled && cqe.status == WcStatus::Success {
            finish_ok(&mut self.table, cqe.wr_id, ok_info(cqe), out);
        } else if !settled {
            let cause = if cqe.status == WcStatus::WrFlushErr {
                QpFailure::Flushed
            } else {
                QpFailure::WorkCompletion {
                    status: cqe.status,
                    vendor_err: cqe.vendor_err,
                }
            };
            let failure = self.fail_qp(qp, cause.clone(), out);
            // A flushed request reports the queue pair's cause; the request whose own
            // completion failed reports its status (same shape either way).
            let outcome = if cqe.status == WcStatus::WrFlushErr {
                Err(Error::QpFailed(failure))
            } else {
                Err(Error::QpFailed(cause))
            };
            finish(&mut self.table, cqe.wr_id, outcome, out);
        }
        if had_postable == Some(false)
            && self.live(qp).is_some_and(QpSlot::has_postable)
            && !out.postable.contains(&qp)
        {
            out.postable.push(qp);
        }
    }

    /// The part of [`complete`](Self::complete) before the outcome, in one pass (one look at
    /// the entry, one at its queue pair's slot): checks that `cqe` is for a posted request of a
    /// live queue pair (else counts it unknown and returns `None`), and retires what its
    /// completion settles on its queue: on a send queue every request posted before it
    /// without its own completion (completions arrive in post order, so those succeeded).
    /// Returns the queue pair, if it has queued requests whether they had room before, and
    /// whether it recorded the outcome too: a success that retires only its own request (a
    /// receive, or a send at the head of its ring) whose future still waits, the common case,
    /// is settled with the same look at the entry.
    #[inline]
    fn retire_through(
        &mut self,
        cqe: &Cqe,
        out: &mut Completed<P>,
    ) -> Option<(QpKey, Option<bool>, bool)> {
        let Core { table, qps, gens } = self;
        let Some(entry) = table.get_mut(cqe.wr_id) else {
            out.unknown += 1;
            return None;
        };
        if !matches!(entry.lifecycle, Lifecycle::Submitted | Lifecycle::Cancelled) {
            // A second completion for a completed (or never posted) request: keep exactly-once.
            out.unknown += 1;
            return None;
        }
        let (qp, queue) = (entry.qp, entry.queue);
        let Some(slot) = live_slot(qps, gens, qp) else {
            // Posted requests keep their queue pair registered: unreachable, but never apply a
            // completion to a queue pair that is gone.
            out.unknown += 1;
            return None;
        };
        // Queued requests can only become postable if there are any (most often none).
        let queued = !slot.sq_pending.is_empty() || !slot.rq_pending.is_empty();
        let had_postable = queued.then(|| slot.has_postable());
        let alone = match queue {
            Queue::Send => slot.sq_ring.front() == Some(&cqe.wr_id),
            Queue::Recv => true,
        };
        if !alone {
            // A send whose unsignaled predecessors complete with it (or one not in the ring:
            // everything before it is retired).
            while let Some(id) = slot.sq_ring.pop_front() {
                if id == cqe.wr_id {
                    break;
                }
                finish_ok(table, id, OpInfo::default(), out);
            }
            return Some((qp, had_postable, false));
        }
        match queue {
            Queue::Send => {
                slot.sq_ring.pop_front();
            }
            Queue::Recv => slot.rq_posted = slot.rq_posted.saturating_sub(1),
        }
        let settled =
            cqe.status == WcStatus::Success && matches!(entry.lifecycle, Lifecycle::Submitted);
        if settled {
            entry.lifecycle = Lifecycle::Done(ok_info(cqe));
            if let Some(w) = entry.waker.take() {
                out.wakers.push(w);
            }
        }
        Some((qp, had_postable, settled))
    }

    /// Marks `qp` failed (keeping an earlier cause if there is one) and fails its queued
    /// requests at once. Posted requests complete when the device flushes them; the caller
    /// must move the queue pair to the error state (it is listed in [`Completed::failed`] the
    /// first time). Returns the recorded cause.
    ///
    /// A removed queue pair (stale key) has nothing to fail: `cause` is returned as is.
    pub fn fail_qp(&mut self, qp: QpKey, cause: QpFailure, out: &mut Completed<P>) -> QpFailure {
        let Some(slot) = self.live_mut(qp) else {
            return cause;
        };
        if slot.failure.is_none() {
            slot.failure = Some(cause);
            out.failed.push(qp);
        }
        let failure = slot.failure.clone().expect("set above");
        let queued: Vec<u64> = slot
            .sq_pending
            .drain(..)
            .chain(slot.rq_pending.drain(..))
            .map(|(id, _)| id)
            .collect();
        for id in queued {
            finish(
                &mut self.table,
                id,
                Err(Error::QpFailed(failure.clone())),
                out,
            );
        }
        failure
    }

    /// Posting failed with `errno` and the requests `not_posted` (a suffix of what
    /// [`take_postable`](Self::take_postable) returned) never reached the device: they fail at
    /// once, and the queue pair is failed (listed in [`Completed::failed`]).
    ///
    /// Unsignaled sends that *were* posted before the failure may already have executed, so no
    /// flush will report them; the caller must then post the drain marker returned by
    /// [`drain_marker`](Self::drain_marker) (a signaled zero-length send, after moving the queue
    /// pair to ERR): its flush completion arrives last and retires them.
    pub fn post_failed(
        &mut self,
        qp: QpKey,
        not_posted: &[u64],
        errno: i32,
        out: &mut Completed<P>,
    ) {
        let failure = self.fail_qp(qp, QpFailure::PostFailed(errno), out);
        for &id in not_posted {
            let Some(entry) = self.table.get_mut(id) else {
                continue;
            };
            let queue = entry.queue;
            let slot = self.slot(qp);
            match queue {
                Queue::Send => {
                    if let Some(pos) = slot.sq_ring.iter().rposition(|&x| x == id) {
                        slot.sq_ring.remove(pos);
                    }
                }
                Queue::Recv => slot.rq_posted = slot.rq_posted.saturating_sub(1),
            }
            finish(
                &mut self.table,
                id,
                Err(Error::QpFailed(failure.clone())),
                out,
            );
        }
    }

    /// Appends an internal, signaled "drain" request to the send queue of `qp` and returns its
    /// `wr_id`; the caller posts it as a zero-length signaled SEND on the queue pair (in the
    /// error state it completes with a flush). Its completion retires every earlier send, as
    /// any signaled completion does, and the marker itself resolves no future.
    ///
    /// # Panics
    ///
    /// If `qp` is not registered.
    pub fn drain_marker(&mut self, qp: QpKey) -> u64 {
        assert!(self.is_live(qp), "queue pair is registered");
        let wr_id = self.table.insert(Entry {
            qp,
            queue: Queue::Send,
            // Behaves as a posted request whose future is gone.
            lifecycle: Lifecycle::Cancelled,
            waker: None,
            payload: None,
        });
        self.slot(qp).sq_ring.push_back(wr_id);
        wr_id
    }

    /// Whether `qp` has posted sends that only a later completion can retire (used after a
    /// failed post to decide whether a drain marker is needed).
    pub fn has_posted_sends(&self, qp: QpKey) -> bool {
        self.live(qp).is_some_and(|s| !s.sq_ring.is_empty())
    }

    /// Completes every posted request of `qp` with its failure, without waiting for the
    /// device. Only for a queue pair that was destroyed (the device can no longer touch the
    /// memory) or whose device is gone.
    pub fn abandon_qp(&mut self, qp: QpKey, out: &mut Completed<P>) {
        if !self.is_live(qp) {
            return;
        }
        let failure = self.fail_qp(qp, QpFailure::Closed, out);
        let slot = self.slot(qp);
        slot.sq_ring.clear();
        slot.rq_posted = 0;
        let ids: Vec<u64> = self.table.ids_where(|e| e.qp == qp);
        for id in ids {
            finish(
                &mut self.table,
                id,
                Err(Error::QpFailed(failure.clone())),
                out,
            );
        }
    }

    /// Hands every registered waker to `out` (for a driver that can no longer wake them on
    /// completions: each future polls again and sees the new state).
    pub fn take_all_wakers(&mut self, out: &mut Completed<P>) {
        for id in self.table.ids_where(|e| e.waker.is_some()) {
            if let Some(w) = self.table.get_mut(id).and_then(|e| e.waker.take()) {
                out.wakers.push(w);
            }
        }
    }
}

/// The slot of `qp` if the key names a registered queue pair (its generation is the index's
/// current one). A free function over the two fields, so that a caller can hold the slot and
/// the operation table at once.
#[inline]
fn live_slot<'a>(qps: &'a mut [Option<QpSlot>], gens: &[u64], qp: QpKey) -> Option<&'a mut QpSlot> {
    let i = qp.index();
    if gens.get(i) != Some(&qp.generation()) {
        return None;
    }
    qps.get_mut(i)?.as_mut()
}

/// What a successful completion reports.
#[inline]
fn ok_info(cqe: &Cqe) -> OpInfo {
    OpInfo {
        // A receive consumed by an RDMA WRITE with immediate: the completion's count is the
        // write's, whose bytes went to the write's target, not into this buffer.
        byte_len: if cqe.opcode == WcOpcode::RecvRdmaWithImm {
            0
        } else {
            cqe.byte_len
        },
        imm: cqe.imm,
    }
}

/// Records `outcome` for `wr_id` (or releases the payload of a cancelled one) and collects its
/// waker.
fn finish<P>(
    table: &mut OpTable<P>,
    wr_id: u64,
    outcome: Result<OpInfo, Error>,
    out: &mut Completed<P>,
) {
    match outcome {
        Ok(info) => finish_ok(table, wr_id, info, out),
        Err(err) => settle(table, wr_id, Lifecycle::Failed(box_error(err)), out),
    }
}

/// [`finish`] with a success: only the few bytes of its [`OpInfo`] are written.
#[inline]
fn finish_ok<P>(table: &mut OpTable<P>, wr_id: u64, info: OpInfo, out: &mut Completed<P>) {
    if let Some(entry) = table.get_mut(wr_id) {
        if matches!(entry.lifecycle, Lifecycle::Queued | Lifecycle::Submitted) {
            entry.lifecycle = Lifecycle::Done(info);
            if let Some(w) = entry.waker.take() {
                out.wakers.push(w);
            }
            return;
        }
    }
    settle(table, wr_id, Lifecycle::Done(info), out);
}

fn settle<P>(table: &mut OpTable<P>, wr_id: u64, outcome: Lifecycle, out: &mut Completed<P>) {
    let Some(entry) = table.get_mut(wr_id) else {
        return;
    };
    match entry.lifecycle {
        Lifecycle::Cancelled => {
            if let Some(p) = table.remove(wr_id).and_then(|e| e.payload) {
                out.released.push(p);
            }
        }
        Lifecycle::Done(_) | Lifecycle::Failed(_) => {}
        Lifecycle::Queued | Lifecycle::Submitted => {
            entry.lifecycle = outcome;
            if let Some(w) = entry.waker.take() {
                out.wakers.push(w);
            }
        }
    }
}

fn mark_posted<P>(table: &mut OpTable<P>, wr_id: u64) {
    let entry = table
        .get_mut(wr_id)
        .expect("queued request is in the table");
    assert!(
        matches!(entry.lifecycle, Lifecycle::Queued),
        "queued list held a request in state {:?}",
        entry.lifecycle
    );
    entry.lifecycle = Lifecycle::Submitted;
}
