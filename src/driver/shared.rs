//! State shared by the completion task, the queue-pair handles and the operation futures of
//! one completion queue, and the one place that polls it ([`Shared::poll_cq`]).
//!
//! Whoever polls (an operation's own future while it waits, a connection's `recv`, or the
//! completion task) takes the state lock, polls a batch, and applies every completion: table
//! operations through the sans-IO [`Core`], requests of queue pairs driven by a [`Sink`] (a
//! connection's receives and chunk sends) through that sink. Wakers are woken and released
//! buffers dropped after the lock is released ([`Deferred`]).

use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Waker;
use std::time::{Duration, Instant};

use smallvec::SmallVec;
use tokio::sync::Notify;
use tracing::{debug, warn};

use super::CompletionMode;
use super::post;
use super::spinners::Spinners;
use super::wait::Latency;
use crate::error::QpFailure;
use crate::proto::{Completed, Core, Cqe, PostItem, QpKey};
use crate::verbs::{CompletionQueue, QueuePair, SendOp, SendWr, WcBatch};

/// How many times a waiting future polls the CQ in place, in busy mode, before it returns
/// `Pending` (waking itself) so the runtime can run other tasks: a slice of a few microseconds
/// on hardware (tens under TCG), short enough that a worker shared with other tasks is not held
/// noticeably longer than by one task's poll, long enough that a completion arriving within
/// a round trip is seen without a trip through the runtime.
pub(crate) const IN_PLACE_POLLS: u32 = 64;

/// What a dropped operation parks in the table: its buffers, until the device is done.
pub(crate) type Payload = Box<dyn Any + Send>;

/// `wr_id`s with this bit set belong to a queue pair's [`Sink`]; bits 32..63 name the queue
/// pair ([`QpKey::to_bits`]: its index and generation), bits 0..32 are the sink's own.
pub(crate) const SINK_BIT: u64 = 1 << 63;

/// The `wr_id` of request `local` of the sink of `qp`.
pub(crate) fn sink_wr_id(qp: QpKey, local: u32) -> u64 {
    SINK_BIT | (u64::from(qp.to_bits()) << 32) | u64::from(local)
}

/// The queue-pair key of a sink `wr_id` (see [`sink_wr_id`]).
fn sink_key(wr_id: u64) -> QpKey {
    QpKey::from_bits(((wr_id & !SINK_BIT) >> 32) as u32)
}

/// The `wr_id` of receive `local` on the shared receive queue (the reserved key: which queue
/// pair consumed it is known only from its completion's `qp_num`). Its completion goes to the
/// sink of that queue pair, or (no such sink any more) to the SRQ's own sink.
pub(crate) fn srq_wr_id(local: u32) -> u64 {
    sink_wr_id(QpKey::reserved(), local)
}

/// Receives the completions of the requests a queue pair's owner posted itself (with
/// [`sink_wr_id`]s), in completion-queue order. Called with the driver's lock held: it must
/// not call back into the driver (post directly on the queue pair instead).
pub(crate) trait Sink: Send + Sync + std::fmt::Debug {
    /// One completion; `local` is the low half of its `wr_id`. `qp_failure` is the failure the
    /// driver recorded for the queue pair, if any (a flush reports that cause). Returns a
    /// failure to record for the queue pair (it then moves to the error state).
    fn on_completion(
        &self,
        local: u32,
        cqe: &Cqe,
        qp_failure: Option<&QpFailure>,
        wake: &mut Deferred,
    ) -> Option<QpFailure>;

    /// Called after the driver's lock is released, if `on_completion` asked for it with
    /// [`Deferred::after_unlock`]: release what must not be dropped under the lock.
    fn after_unlock(&self) {}

    /// The driver's completion task is gone (its runtime shut down): fail, and wake every
    /// waiter, which polls the completion queue itself from now on. Called without the lock.
    fn on_driver_stopped(&self) {}
}

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
    batch: WcBatch,
}

/// Counters of the completion machinery (read with [`Driver::stats`](super::Driver::stats)).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) completions: AtomicU64,
    pub(crate) cq_events: AtomicU64,
    pub(crate) empty_events: AtomicU64,
    pub(crate) polls: AtomicU64,
    pub(crate) doorbells: AtomicU64,
    pub(crate) posted: AtomicU64,
    pub(crate) unknown: AtomicU64,
    pub(crate) polled_in_place: AtomicU64,
    pub(crate) arms: AtomicU64,
    pub(crate) last_wqe_reached: AtomicU64,
    pub(crate) last_wqe_timeouts: AtomicU64,
}

#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) state: Mutex<State>,
    pub(crate) cq: CompletionQueue,
    pub(crate) mode: CompletionMode,
    /// Futures polling the CQ themselves right now: while there are any, the completion task
    /// leaves the CQ unarmed (they see every completion first).
    pub(crate) spinners: Spinners,
    /// Futures waiting for a wake-up (their waker registered) rather than polling: while there
    /// are any, the completion task must keep the CQ watched (polled or armed) itself.
    pub(crate) sleepers: Spinners,
    /// Observed completion latencies (the adaptive spin budget).
    pub(crate) latency: Latency,
    /// Wakes the completion task (shutdown, closing queue pairs, the last spinner leaving).
    pub(crate) notify: Notify,
    /// Wakes the async-event task (shutdown).
    pub(crate) notify_events: Notify,
    /// Signalled after the completion task applied completions, while [`closers`](Self::closers)
    /// is not zero.
    pub(crate) drained: Notify,
    /// `AsyncQp::close` calls waiting on `drained`.
    pub(crate) closers: AtomicUsize,
    pub(crate) shutdown: AtomicBool,
    /// The completion task is gone (its runtime shut down): see [`Shared::stop`].
    pub(crate) stopped: AtomicBool,
    /// Some queue pair is closing: reap it once drained.
    pub(crate) closing: AtomicBool,
    pub(crate) counters: Counters,
    /// Sum of the depths of the registered queue pairs (bounded by the CQ size).
    pub(crate) cq_budget: Arc<Mutex<u64>>,
    /// Signalled when the device reports the shared receive queue's limit reached.
    pub(crate) srq_limit: Arc<Notify>,
}

/// What must happen once the driver's lock is released: queue pairs to move to the error
/// state, wakers to wake, buffers to drop, and sinks whose owners have memory to release
/// ([`Sink::after_unlock`]). Nothing foreign (a waker's wake, a payload's or application
/// buffer's drop) runs under the lock: a drop may release the last handle of a queue pair of
/// this very driver, which takes the lock. Nor does `ibv_modify_qp`: a system call that
/// waits for the kernel's queue-pair lock, while every future of the CQ waits for ours.
///
/// Holds up to 32 wakers without allocating; more spill to the heap.
#[derive(Debug, Default)]
pub(crate) struct Deferred {
    /// Inline up to 32 (uninitialised until pushed: creating and dropping an empty one costs
    /// nothing per slot), then on the heap.
    wakers: SmallVec<[Waker; 32]>,
    released: Vec<Payload>,
    /// Inline up to 4 (a poll rarely applies completions of more queue pairs whose owners
    /// have memory to release): no allocation on the data path.
    sinks: SmallVec<[Arc<dyn Sink>; 4]>,
    /// Failed queue pairs to move to ERR, each once, in the order they failed.
    to_error: Vec<ToError>,
}

/// A failed queue pair to move to the error state after the lock is released, so the device
/// flushes what is posted on it.
///
/// Ordering: the core recorded the failure under the lock first (new requests fail fast, and
/// the queue pair's key stays registered while anything is posted: only the flushes, which
/// come after this move, let it go), and the handle here keeps the queue pair itself alive
/// until it has moved. A drain marker, if any, is posted right after the move, so it is
/// flushed, never executed.
#[derive(Debug)]
struct ToError {
    qp: QueuePair,
    /// A zero-length signaled send whose flush retires the sends before it (see `post`); its
    /// `wr_id` is already in the core's send ring.
    marker: Option<u64>,
}

impl Deferred {
    pub(crate) fn push(&mut self, w: Waker) {
        self.wakers.push(w);
    }

    /// Calls `sink`'s [`after_unlock`](Sink::after_unlock) once the lock is released.
    pub(crate) fn after_unlock(&mut self, sink: Arc<dyn Sink>) {
        if !self.sinks.iter().any(|s| Arc::ptr_eq(s, &sink)) {
            self.sinks.push(sink);
        }
    }

    /// Moves `qp` to the error state once the lock is released (once, however often it is
    /// asked), then posts the drain marker `marker` if given.
    pub(crate) fn move_to_error(&mut self, qp: &QueuePair, marker: Option<u64>) {
        match self.to_error.iter_mut().find(|t| t.qp.qpn() == qp.qpn()) {
            Some(t) => t.marker = t.marker.or(marker),
            None => self.to_error.push(ToError {
                qp: qp.clone(),
                marker,
            }),
        }
    }

    /// Queue pairs waiting to be moved to ERR.
    #[cfg(test)]
    pub(crate) fn pending_errors(&self) -> usize {
        self.to_error.len()
    }

    /// Moves what `out` collected (wakers, released payloads) in here.
    pub(crate) fn take_from(&mut self, out: &mut Completed<Payload>) {
        for w in out.wakers.drain(..) {
            self.push(w);
        }
        if !out.released.is_empty() {
            self.released.append(&mut out.released);
        }
    }

    /// Moves queue pairs to ERR, wakes and drops. Call without the lock.
    pub(crate) fn run(&mut self) {
        // Each list is looked at only if it holds something: most runs have nothing to do,
        // and a drain's setup and drop cost instructions on every poll.
        if !self.to_error.is_empty() {
            // First, so the flushes are under way before anyone woken below waits for them.
            for t in self.to_error.drain(..) {
                t.run();
            }
        }
        if !self.wakers.is_empty() {
            for w in self.wakers.drain(..) {
                w.wake();
            }
        }
        if !self.released.is_empty() {
            self.released.clear();
        }
        if !self.sinks.is_empty() {
            for s in self.sinks.drain(..) {
                s.after_unlock();
            }
        }
    }
}

impl ToError {
    fn run(self) {
        if let Err(err) = self.qp.to_error() {
            warn!(qpn = self.qp.qpn(), error = %err, "moving a failed queue pair to ERR");
        }
        let Some(wr_id) = self.marker else {
            return;
        };
        let marker = [SendWr::new(wr_id, SendOp::Send, &[])];
        // SAFETY: a zero-length send names no memory.
        if let Err(e) = unsafe { self.qp.post_send(&marker) } {
            // Releasing the buffers could let the device write freed memory: keep them
            // parked (leaked) rather than risk it.
            tracing::error!(error = %e, "posting the drain marker failed; the queue pair's earlier sends stay parked");
        }
    }
}

impl Drop for Deferred {
    fn drop(&mut self) {
        self.run();
    }
}

impl Shared {
    pub(crate) fn new(cq: CompletionQueue, mode: CompletionMode, batch: usize) -> Shared {
        Shared {
            state: Mutex::new(State {
                core: Core::new(),
                qps: Vec::new(),
                by_qpn: HashMap::new(),
                srq_sink: None,
                posts: Vec::new(),
                out: Completed::default(),
                batch: WcBatch::with_capacity(batch.max(1)),
            }),
            cq,
            mode,
            spinners: Spinners::default(),
            sleepers: Spinners::default(),
            latency: Latency::default(),
            notify: Notify::new(),
            notify_events: Notify::new(),
            drained: Notify::new(),
            closers: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            counters: Counters::default(),
            cq_budget: Arc::new(Mutex::new(0)),
            srq_limit: Arc::new(Notify::new()),
        }
    }

    /// Whether a waiting future polls the CQ itself. Not in event mode while the completion
    /// task runs: the task keeps the CQ armed whenever it sleeps, so a completion nobody has
    /// applied yet raises an event, and the task applies it and wakes its waiter; a future
    /// polled after that wake-up finds its outcome without polling. An in-place poll would
    /// (nearly) always find nothing. Without the task (its runtime gone) futures poll.
    pub(crate) fn polls_in_place(&self) -> bool {
        self.mode != CompletionMode::Event || self.stopped.load(Ordering::Acquire)
    }

    /// How many times one poll of a waiting future polls the CQ in place before it spins
    /// (wakes itself) or sleeps: [`IN_PLACE_POLLS`] in busy mode, none in event mode (see
    /// [`polls_in_place`](Self::polls_in_place)), once otherwise.
    pub(crate) fn in_place_polls(&self) -> u32 {
        match self.mode {
            _ if !self.polls_in_place() => 0,
            CompletionMode::BusyPoll => IN_PLACE_POLLS,
            _ => 1,
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves the core consistent enough to keep resolving
        // operations; never propagate poisoning into every future.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Polls one batch of completions and applies them; returns how many there were. Call
    /// with the state locked; run `wake` after unlocking.
    pub(crate) fn poll_cq(&self, st: &mut State, wake: &mut Deferred) -> usize {
        self.counters.polls.fetch_add(1, Ordering::Relaxed);
        let State {
            core,
            qps,
            by_qpn,
            srq_sink,
            out,
            batch,
            ..
        } = st;
        let wcs = match self.cq.poll_driven(batch) {
            Ok(wcs) => wcs,
            Err(e) => {
                warn!(error = %e, "polling the completion queue failed");
                return 0;
            }
        };
        let n = wcs.len();
        for wc in wcs {
            let cqe = Cqe::from(wc);
            if !wc.is_success() {
                debug!(wr_id = cqe.wr_id, qpn = wc.qp_num(), status = %cqe.status, "work completion error");
            }
            if cqe.wr_id & SINK_BIT == 0 {
                core.complete(&cqe, out);
                continue;
            }
            let mut key = sink_key(cqe.wr_id);
            let on_srq = key == QpKey::reserved();
            if on_srq {
                if let Some(&k) = by_qpn.get(&wc.qp_num()) {
                    key = k;
                }
            }
            // Only the queue pair this key was issued to: a late completion of a queue pair
            // removed since (its index reused, with another generation) reaches nobody.
            let sink = qps
                .get(key.index())
                .and_then(Option::as_ref)
                .filter(|e| e.key == key)
                .and_then(|e| e.sink.clone());
            if sink.is_none() && on_srq {
                // Its queue pair is gone (or never was ours): the buffer goes back.
                match srq_sink.as_ref() {
                    Some(srq) => {
                        srq.on_completion(cqe.wr_id as u32, &cqe, None, wake);
                    }
                    None => out.unknown += 1,
                }
                continue;
            }
            match sink {
                Some(sink) => {
                    let failure = core.failure(key).cloned();
                    if let Some(cause) =
                        sink.on_completion(cqe.wr_id as u32, &cqe, failure.as_ref(), wake)
                    {
                        core.fail_qp(key, cause, out);
                    }
                }
                None => out.unknown += 1,
            }
        }
        if n == 0 {
            return 0;
        }
        self.counters
            .completions
            .fetch_add(n as u64, Ordering::Relaxed);
        if !st.out.postable.is_empty() {
            // Keep the list's memory: `post` does not add to it.
            let mut postable = std::mem::take(&mut st.out.postable);
            for qp in postable.drain(..) {
                post::post(st, self, qp, wake);
            }
            st.out.postable = postable;
        }
        st.apply_failures(wake);
        if st.out.unknown > 0 {
            warn!(
                count = st.out.unknown,
                "completions that match no operation were ignored"
            );
            self.counters
                .unknown
                .fetch_add(st.out.unknown, Ordering::Relaxed);
            st.out.unknown = 0;
        }
        wake.take_from(&mut st.out);
        n
    }

    /// Polls until the CQ is empty (the completion task's way). Returns how many completions.
    pub(crate) fn drain(&self, reaped: &mut Vec<QpEntry>) -> usize {
        let mut total = 0;
        let mut wake = Deferred::default();
        loop {
            let (n, full) = {
                let mut st = self.lock();
                let n = self.poll_cq(&mut st, &mut wake);
                let full = n == st.batch.capacity();
                if self.closing.load(Ordering::Acquire) {
                    let timeouts = st.reap_closed(reaped, Instant::now());
                    if timeouts > 0 {
                        self.counters
                            .last_wqe_timeouts
                            .fetch_add(timeouts, Ordering::Relaxed);
                    }
                    if !st.qps.iter().flatten().any(|e| e.closing) {
                        self.closing.store(false, Ordering::Release);
                    }
                }
                (n, full)
            };
            wake.run();
            total += n;
            // A batch not filled means the CQ was empty when polled: no second poll to see it.
            if !full {
                break;
            }
        }
        // `AsyncQp::close` waits for this (the completion task's drains only: not the hot path).
        // A closer registers before it looks at what is posted, and that look takes the lock
        // this drain applied its completions under: if it saw work left, this load sees it.
        if self.closers.load(Ordering::Acquire) > 0 {
            self.drained.notify_waiters();
        }
        self.release(reaped);
        total
    }

    /// Returns the CQ entries of reaped queue pairs and destroys them (drops the last QP
    /// handles). Call without the lock.
    ///
    /// `ibv_destroy_qp` may wait in the kernel (soft-RoCE under load: up to seconds), so the
    /// handles are dropped on the blocking pool ([`off_runtime`](super::off_runtime)): the
    /// completion task, which wakes futures onto its worker, never stalls on it. The CQ
    /// entries are given back only once the queue pair is destroyed.
    pub(crate) fn release(&self, reaped: &mut Vec<QpEntry>) {
        if reaped.is_empty() {
            return;
        }
        let entries: Vec<QpEntry> = std::mem::take(reaped);
        let budget = self.cq_budget.clone();
        super::off_runtime(move || {
            for e in entries {
                let (qpn, need) = (e.qp.qpn(), e.cq_need);
                let t = std::time::Instant::now();
                drop(e);
                let mut budget = budget.lock().unwrap_or_else(|e| e.into_inner());
                *budget = budget.saturating_sub(need);
                debug!(qpn, took = ?t.elapsed(), "queue pair drained and destroyed");
            }
        });
    }

    /// Whether anything may still complete: operations in the table, or queue pairs whose
    /// owner posts requests itself (a connection always has receives posted).
    pub(crate) fn has_outstanding(&self) -> bool {
        let st = self.lock();
        st.core.ops_in_table() > 0 || st.qps.iter().flatten().any(|e| e.sink.is_some())
    }

    /// The completion task is gone: nothing will wake a sleeping operation on a completion
    /// again. Every queue pair fails with [`QpFailure::DriverStopped`] (and moves to ERR, so its
    /// posted requests flush), every waiter is woken, and from now on waiting futures poll the
    /// CQ themselves instead of sleeping (`RawOp`, `AsyncQp::close`).
    pub(crate) fn stop(&self) {
        if self.stopped.swap(true, Ordering::AcqRel) {
            return;
        }
        let mut wake = Deferred::default();
        let sinks: Vec<Arc<dyn Sink>> = {
            let mut st = self.lock();
            let keys: Vec<QpKey> = st.qps.iter().flatten().map(|e| e.key).collect();
            for k in keys {
                st.fail(k, QpFailure::DriverStopped, &mut wake);
            }
            let mut out = std::mem::take(&mut st.out);
            st.core.take_all_wakers(&mut out);
            wake.take_from(&mut out);
            st.out = out;
            st.qps
                .iter()
                .flatten()
                .filter_map(|e| e.sink.clone())
                .collect()
        };
        wake.run();
        for s in sinks {
            s.on_driver_stopped();
        }
        self.drained.notify_waiters();
    }

    /// A future stopped polling the CQ itself: if it was the last, let the completion task
    /// arm the CQ so completions nobody polls for raise an event.
    pub(crate) fn spinner_left(&self) {
        if self.spinners.leave() {
            self.notify.notify_one();
        }
    }

    /// A future goes to sleep until woken: if it is the first, the completion task (which may
    /// be leaving the CQ to the futures that poll it in place) must watch it now.
    pub(crate) fn sleeper_joined(&self) {
        self.sleepers.join();
        if self.sleepers.count() == 1 {
            self.notify.notify_one();
        }
    }
}

impl State {
    /// Has `wake` move newly failed queue pairs to the error state (so the device flushes
    /// them) once the lock is released.
    pub(crate) fn apply_failures(&mut self, wake: &mut Deferred) {
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
