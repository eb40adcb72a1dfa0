//! State shared by the completion task, the queue-pair handles and the operation futures of
//! one completion queue, and the one place that polls it ([`Shared::poll_cq`]).
//!
//! Whoever polls (an operation's own future while it waits, a connection's `recv`, or the
//! completion task) takes the state lock, polls a batch, and applies every completion: table
//! operations through the sans-IO [`Core`], requests of queue pairs driven by a [`Sink`] (a
//! connection's receives and chunk sends) through that sink. Wakers are woken and released
//! buffers dropped after the lock is released ([`Deferred`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use tokio::io::unix::{AsyncFd, AsyncFdReadyGuard};
use tokio::sync::Notify;
use tracing::{debug, warn};

use super::channel_fd::ChannelFd;
use super::counters::{Counters, add_held};
use super::deferred::{Deferred, Payload, Sink};
use super::kick::TaskKick;
use super::latency::Latency;
use super::offload::off_runtime;
use super::options::CompletionMode;
use super::post;
use super::sink::{SINK_BIT, sink_key};
use super::spinners::Spinners;
use super::state::{QpEntry, State, Watch};
use crate::error::QpFailure;
use crate::proto::{Completed, Core, Cqe, QpKey};
use crate::verbs::{CompletionQueue, WcBatch};

/// How many times a waiting future polls the CQ in place, in busy and adaptive modes, before
/// it returns `Pending` (waking itself, or sleeping once adaptive mode's spin budget is spent)
/// so the runtime can run other tasks: a slice of a few microseconds on hardware (tens under
/// TCG), short enough that a worker shared with other tasks is not held noticeably longer than
/// by one task's poll, long enough that a completion arriving within a round trip is seen
/// without a trip through the runtime. Adaptive mode checks its budget after each slice, so a
/// wait that ends up sleeping spins at most one slice past it.
pub(crate) const IN_PLACE_POLLS: u32 = 64;

/// Acknowledge CQ events once this many are pending (one `ibv_ack_cq_events` for all).
const ACK_BATCH: u32 = 32;

#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) state: Mutex<State>,
    pub(crate) cq: CompletionQueue,
    /// The CQ's completion channel, registered with the reactor: the completion task waits
    /// on it, and so does a watching future ([`watch`](super::watch)).
    pub(crate) events: AsyncFd<ChannelFd>,
    /// The CQ is armed: its next completion raises an event ([`arm`](Self::arm)).
    pub(crate) armed: AtomicBool,
    /// A watch task watches the channel ([`Watch::active`](super::state::Watch::active),
    /// mirrored for the completion task's lock-free look).
    pub(crate) watched: AtomicBool,
    pub(crate) mode: CompletionMode,
    /// The completion task runs on a current-thread runtime (see
    /// [`sleeper_joined`](Self::sleeper_joined)).
    pub(crate) one_thread: bool,
    /// Futures polling the CQ themselves right now: while there are any, the completion task
    /// leaves the CQ unarmed (they see every completion first).
    pub(crate) spinners: Spinners,
    /// Operation futures made and not yet posted (nor dropped): while there is any, a waiting
    /// future ramps its in-place polls up rather than spinning its full count at once, so the
    /// sibling beside it in its task gets polled, and posted, first
    /// (`Waiter::in_place_polls`). A hint, never a guarantee: counted without ordering, and a
    /// future leaked (`mem::forget`) before its first poll keeps it above zero for good (every
    /// wait then ramps, as all did before the count).
    pub(crate) unposted: AtomicUsize,
    /// Futures waiting for a wake-up (their waker registered) rather than polling: while there
    /// are any, the completion task must keep the CQ watched (polled or armed) itself.
    pub(crate) sleepers: Spinners,
    /// Observed completion latencies (the adaptive spin budget).
    pub(crate) latency: Latency,
    /// Wakes the completion task (shutdown, closing queue pairs, the last spinner leaving).
    pub(crate) notify: TaskKick,
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

impl Shared {
    pub(crate) fn new(
        cq: CompletionQueue,
        events: AsyncFd<ChannelFd>,
        mode: CompletionMode,
        batch: usize,
        one_thread: bool,
    ) -> Shared {
        Shared {
            state: Mutex::new(State {
                core: Core::new(),
                qps: Vec::new(),
                by_qpn: HashMap::new(),
                srq_sink: None,
                posts: Vec::new(),
                out: Completed::default(),
                batch: WcBatch::with_capacity(batch.max(1)),
                run: Vec::with_capacity(batch.max(1)),
                watch: Watch::default(),
            }),
            cq,
            events,
            armed: AtomicBool::new(false),
            watched: AtomicBool::new(false),
            mode,
            one_thread,
            spinners: Spinners::default(),
            unposted: AtomicUsize::new(0),
            sleepers: Spinners::default(),
            latency: Latency::default(),
            notify: TaskKick::default(),
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
    #[inline]
    pub(crate) fn polls_in_place(&self) -> bool {
        self.mode != CompletionMode::Event || self.stopped.load(Ordering::Acquire)
    }

    /// How many times one poll of a waiting future polls the CQ in place before it spins
    /// (wakes itself) or sleeps: [`IN_PLACE_POLLS`] in busy and adaptive modes, none in event
    /// mode (see [`polls_in_place`](Self::polls_in_place)); with the completion task gone,
    /// once in event mode. Adaptive mode polled once per poll of the future until
    /// `msg_lat` 64 B showed the cost: each empty poll then went through the runtime (a
    /// self-wake and a task poll, several times the poll itself), and adaptive mode's round
    /// trip was 38-64 µs against busy mode's 23-52 µs in the same VM; with the slice, 21.6-27.4
    /// µs (docs/benchmarks-speed-2.md).
    #[inline]
    pub(crate) fn in_place_polls(&self) -> u32 {
        match self.mode {
            _ if !self.polls_in_place() => 0,
            CompletionMode::BusyPoll | CompletionMode::Adaptive { .. } => IN_PLACE_POLLS,
            CompletionMode::Event => 1,
        }
    }

    #[inline]
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves the core consistent enough to keep resolving
        // operations; never propagate poisoning into every future.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Polls one batch of completions and applies them; returns how many there were. Call
    /// with the state locked; run `wake` after unlocking.
    pub(crate) fn poll_cq(&self, st: &mut State, wake: &mut Deferred) -> usize {
        add_held(&self.counters.polls, 1, st);
        let State {
            core,
            qps,
            by_qpn,
            srq_sink,
            out,
            batch,
            run,
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
        // Successful completions of one sink's queue pair that come one after the other are
        // handed to it together (`Sink::on_completions`: a connection looks at its state once
        // for them); anything else hands the run over first, so each queue pair's completions
        // still reach their owners in the order of the CQ.
        let mut run_of: Option<(QpKey, &Arc<dyn Sink>)> = None;
        for (i, wc) in wcs.iter().enumerate() {
            let cqe = Cqe::from(wc);
            if !wc.is_success() {
                debug!(wr_id = cqe.wr_id, qpn = wc.qp_num(), status = %cqe.status, "work completion error");
            }
            if cqe.wr_id & SINK_BIT == 0 {
                hand_run(run, run_of.take(), core, out, wake);
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
            // removed since (its index reused, with another generation) reaches nobody. The
            // `wr_id` carries the key's packed form; the entry's full key is the one the core
            // knows.
            let found = qps
                .get(key.index())
                .and_then(Option::as_ref)
                .filter(|e| e.key == key || (!on_srq && e.key.to_bits() == key.to_bits()))
                .and_then(|e| Some((e.key, e.sink.as_ref()?)));
            let sink = found.map(|(full, sink)| {
                key = full;
                sink
            });
            if let Some(sink) = sink.filter(|_| wc.is_success()) {
                if run_of.is_none_or(|(k, _)| k != key) {
                    hand_run(run, run_of.take(), core, out, wake);
                    // A run starts only if the next completion may belong to it (its queue
                    // pair's number and a sink's `wr_id`; the next round checks the key and
                    // the status): a lone completion (a ping-pong's) goes straight in.
                    let joins = wcs
                        .get(i + 1)
                        .is_some_and(|n| n.qp_num() == wc.qp_num() && n.wr_id() & SINK_BIT != 0);
                    if !joins {
                        let failed =
                            sink.on_completion(cqe.wr_id as u32, &cqe, core.failure(key), wake);
                        if let Some(cause) = failed {
                            core.fail_qp(key, cause, out);
                        }
                        continue;
                    }
                    run_of = Some((key, sink));
                }
                run.push((cqe.wr_id as u32, cqe));
                continue;
            }
            hand_run(run, run_of.take(), core, out, wake);
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
                    let failed =
                        sink.on_completion(cqe.wr_id as u32, &cqe, core.failure(key), wake);
                    if let Some(cause) = failed {
                        core.fail_qp(key, cause, out);
                    }
                }
                None => out.unknown += 1,
            }
        }
        hand_run(run, run_of, core, out, wake);
        if n == 0 {
            return 0;
        }
        add_held(&self.counters.completions, n as u64, st);
        if !st.out.postable.is_empty() {
            // Keep the list's memory: `post` does not add to it.
            let mut postable = std::mem::take(&mut st.out.postable);
            for qp in postable.drain(..) {
                post::post(st, &self.counters, qp, wake);
            }
            st.out.postable = postable;
        }
        st.apply_failures(wake);
        if st.out.unknown > 0 {
            warn!(
                count = st.out.unknown,
                "completions that match no operation were ignored"
            );
            add_held(&self.counters.unknown, st.out.unknown, st);
            st.out.unknown = 0;
        }
        wake.take_from(&mut st.out);
        n
    }

    /// Polls until the CQ is empty (the completion task's way). Returns how many completions.
    /// `wake` is run (emptied) after each batch; the task passes the same one every time.
    pub(crate) fn drain(&self, reaped: &mut Vec<QpEntry>, wake: &mut Deferred) -> usize {
        let mut total = 0;
        loop {
            let (n, full) = {
                let mut st = self.lock();
                let n = self.poll_cq(&mut st, wake);
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
    /// handles are dropped on the blocking pool ([`off_runtime`](super::offload::off_runtime)): the
    /// completion task, which wakes futures onto its worker, never stalls on it. The CQ
    /// entries are given back only once the queue pair is destroyed.
    pub(crate) fn release(&self, reaped: &mut Vec<QpEntry>) {
        if reaped.is_empty() {
            return;
        }
        let entries: Vec<QpEntry> = std::mem::take(reaped);
        let budget = self.cq_budget.clone();
        off_runtime(move || {
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

    /// A future goes to sleep until woken. Returns whether the completion task is to be
    /// woken (the caller does it, unless the future watches the channel itself,
    /// [`watch`](super::watch)): if it is the first sleeper, the task (which may be leaving the
    /// CQ to the futures that poll it in place) must watch it now.
    ///
    /// In event mode the task always watches (it never sleeps without the CQ armed): the
    /// wake-up is then a task run and an empty poll per sleeping wait, for nothing on a
    /// current-thread runtime, where it is skipped (`one_thread`). On Tokio's multi-thread
    /// runtime it stays: skipping it there too (tried 2026-11-26) took `msg_lat` 64 B event
    /// from 243-376 µs to 490-527 µs (interleaved in one VM, 3 rounds), because the wake-up
    /// runs the completion task on the sleeping future's worker, so the CQ event's wake-up
    /// later stays on one thread (docs/benchmarks-speed-2.md).
    #[must_use = "the completion task may have to be woken"]
    pub(crate) fn sleeper_joined(&self) -> bool {
        self.sleepers.join();
        self.sleepers.count() == 1 && (self.polls_in_place() || !self.one_thread)
    }

    /// Arms the CQ unless it is armed (its next completion raises an event). Returns whether
    /// it armed it now. Anyone may arm (the completion task, a watching future), never twice
    /// for one event: `armed` is cleared only when the event of the last arm is read
    /// ([`take_event`](Self::take_event)), so at most one event is ever pending.
    ///
    /// # Errors
    ///
    /// [`Error::ReqNotifyCq`](crate::Error::ReqNotifyCq) from the provider (the CQ stays
    /// unarmed).
    pub(crate) fn arm(&self) -> crate::Result<bool> {
        if self.armed.swap(true, Ordering::AcqRel) {
            return Ok(false);
        }
        if let Err(e) = self.cq.req_notify_driven(false) {
            self.armed.store(false, Ordering::Release);
            return Err(e);
        }
        self.counters.arms.fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }

    /// [`arm`](Self::arm) after an event, before draining (as perftest does: a completion
    /// after the arm raises the next event, one found by the drain was there before it, so
    /// one poll per event); a failure is logged (the next wait arms again).
    pub(crate) fn rearm(&self) {
        if let Err(e) = self.arm() {
            warn!(error = %e, "re-arming the completion queue failed");
        }
    }

    /// Reads the CQ event the channel's readiness `guard` announces, without blocking, and
    /// clears that readiness. Returns whether there was one (another reader may have taken
    /// it: a watching future and the completion task can both hold a readiness).
    ///
    /// One event at most is pending (see [`arm`](Self::arm)): after reading it the channel is
    /// empty until the next arm, whose event is a new edge. Reading on until EAGAIN was one
    /// more system call per event (`strace -c`, `send_lat` event: 2 reads per round trip, one
    /// of them EAGAIN).
    pub(crate) fn take_event(&self, mut guard: AsyncFdReadyGuard<'_, ChannelFd>) -> bool {
        let got = match self.cq.get_event_driven() {
            Ok(got) => got,
            Err(e) => {
                warn!(error = %e, "reading a CQ event failed");
                false
            }
        };
        guard.clear_ready();
        if got {
            // The event consumed the arm.
            self.armed.store(false, Ordering::Release);
            self.counters.cq_events.fetch_add(1, Ordering::Relaxed);
        }
        if self.cq.unacked_events() >= ACK_BATCH {
            self.cq.ack_events();
        }
        got
    }
}

/// Hands the run of completions gathered in `run` to the sink it belongs to (`to`), if any,
/// and records the failure the sink reports for its queue pair.
#[inline]
fn hand_run(
    run: &mut Vec<(u32, Cqe)>,
    to: Option<(QpKey, &Arc<dyn Sink>)>,
    core: &mut Core<Payload>,
    out: &mut Completed<Payload>,
    wake: &mut Deferred,
) {
    let Some((key, sink)) = to else {
        return;
    };
    let failed = sink.on_completions(run, core.failure(key), wake);
    run.clear();
    if let Some(cause) = failed {
        core.fail_qp(key, cause, out);
    }
}
