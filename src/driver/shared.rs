//! State shared by the completion task, the queue-pair handles and the operation futures of
//! one completion queue.

use std::any::Any;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use tokio::sync::Notify;
use tracing::warn;

use crate::core::{Completed, Core, PostItem, QpKey, Queue};
use crate::error::{Error, QpFailure};
use crate::verbs::{CompletionQueue, QueuePair, RecvWr, SendOp, SendWr};

/// What an operation parks in the table: its buffers (and anything that must live as long).
pub(crate) type Payload = Box<dyn Any + Send>;

/// A queue pair as the driver tracks it.
#[derive(Debug)]
pub(crate) struct QpEntry {
    pub(crate) qp: QueuePair,
    /// Dropped or closed: remove it (and destroy the QP) once nothing is posted.
    pub(crate) closing: bool,
    /// Completion queue entries reserved for it.
    pub(crate) cq_need: u64,
}

#[derive(Debug)]
pub(crate) struct State {
    pub(crate) core: Core<Payload>,
    pub(crate) qps: Vec<Option<QpEntry>>,
    posts: Vec<PostItem>,
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
}

#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) state: Mutex<State>,
    pub(crate) cq: CompletionQueue,
    /// Wakes the completion task (shutdown, closing queue pairs).
    pub(crate) notify: Notify,
    /// Wakes the async-event task (shutdown).
    pub(crate) notify_events: Notify,
    /// Signalled after every pass of the completion task (for `close` waiting for a drain).
    pub(crate) drained: Notify,
    pub(crate) shutdown: AtomicBool,
    /// Some queue pair is closing: the completion task reaps it once drained.
    pub(crate) closing: AtomicBool,
    pub(crate) counters: Counters,
    /// Sum of the depths of the registered queue pairs (bounded by the CQ size).
    pub(crate) cq_budget: Mutex<u64>,
}

impl Shared {
    pub(crate) fn new(cq: CompletionQueue) -> Shared {
        Shared {
            state: Mutex::new(State {
                core: Core::new(),
                qps: Vec::new(),
                posts: Vec::new(),
            }),
            cq,
            notify: Notify::new(),
            notify_events: Notify::new(),
            drained: Notify::new(),
            shutdown: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            counters: Counters::default(),
            cq_budget: Mutex::new(0),
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves the core consistent enough to keep resolving
        // operations; never propagate poisoning into every future.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes the wakers and drops the released payloads of `out`. Call without the lock.
    /// Returns the CQ entries of reaped queue pairs and destroys them (drops the last QP
    /// handles). Call without the lock.
    pub(crate) fn release(&self, reaped: &mut Vec<QpEntry>) {
        let mut budget = self.cq_budget.lock().unwrap_or_else(|e| e.into_inner());
        for e in reaped.drain(..) {
            *budget = budget.saturating_sub(e.cq_need);
            tracing::debug!(qpn = e.qp.qpn(), "queue pair drained and destroyed");
        }
    }

    pub(crate) fn finish(out: &mut Completed<Payload>) {
        for w in out.wakers.drain(..) {
            w.wake();
        }
        out.released.clear();
    }
}

impl State {
    /// Posts everything of `qp` that fits, as one chained list per queue. Failed queue pairs
    /// are moved to the error state so their posted requests get flushed.
    pub(crate) fn post(&mut self, shared: &Shared, qp: QpKey, out: &mut Completed<Payload>) {
        let mut posts = std::mem::take(&mut self.posts);
        posts.clear();
        self.core.take_postable(qp, &mut posts);
        if !posts.is_empty() {
            let handle = self.qps[qp.index()]
                .as_ref()
                .expect("registered")
                .qp
                .clone();
            let recv_end = posts
                .iter()
                .take_while(|p| p.wr.queue == Queue::Recv)
                .count();
            let (recvs, sends) = posts.split_at(recv_end);
            let failed = if let Err((bad, errno)) = post_recvs(&handle, recvs) {
                let ids: Vec<u64> = posts[bad..].iter().map(|p| p.wr_id).collect();
                self.core.post_failed(qp, &ids, errno, out);
                true
            } else if let Err((bad, errno)) = post_sends(&handle, sends) {
                let ids: Vec<u64> = sends[bad..].iter().map(|p| p.wr_id).collect();
                self.core.post_failed(qp, &ids, errno, out);
                true
            } else {
                false
            };
            if failed && self.core.has_posted_sends(qp) {
                // Sends posted before the failure may have executed unsignaled: move the QP to
                // ERR, then post a signaled drain marker whose flush retires all of them.
                self.apply_failures(out);
                let wr_id = self.core.drain_marker(qp);
                let marker = [SendWr::new(wr_id, SendOp::Send, &[])];
                // SAFETY: a zero-length send names no memory.
                let posted = unsafe { handle.post_send(&marker) };
                if let Err(e) = posted {
                    // Releasing the buffers could let the device write freed memory: keep
                    // them parked (leaked) rather than risk it.
                    tracing::error!(error = %e, "posting the drain marker failed; the queue pair's earlier sends stay parked");
                }
            }
            let n = posts.len() as u64;
            shared.counters.posted.fetch_add(n, Ordering::Relaxed);
            shared.counters.doorbells.fetch_add(
                u64::from(!recvs.is_empty()) + u64::from(!sends.is_empty()),
                Ordering::Relaxed,
            );
        }
        self.posts = posts;
        self.apply_failures(out);
    }

    /// Moves newly failed queue pairs to the error state (so the device flushes them).
    pub(crate) fn apply_failures(&mut self, out: &mut Completed<Payload>) {
        for qp in out.failed.drain(..) {
            if let Some(Some(e)) = self.qps.get(qp.index()) {
                if let Err(err) = e.qp.to_error() {
                    warn!(qpn = e.qp.qpn(), error = %err, "moving a failed queue pair to ERR");
                }
            }
        }
    }

    /// Fails `qp` with `cause` and moves it to ERR.
    pub(crate) fn fail(&mut self, qp: QpKey, cause: QpFailure, out: &mut Completed<Payload>) {
        self.core.fail_qp(qp, cause, out);
        self.apply_failures(out);
    }

    /// Removes closing queue pairs with nothing left in flight (destroying the QP happens when
    /// the returned handles are dropped, outside the lock).
    pub(crate) fn reap_closed(&mut self, reaped: &mut Vec<QpEntry>) {
        for i in 0..self.qps.len() {
            let closing = matches!(&self.qps[i], Some(e) if e.closing);
            if closing && self.core.posted(QpKey::from_index(i)) == 0 {
                // Queued requests were failed when closing started; nothing is outstanding.
                if self.core.remove_qp(QpKey::from_index(i)) {
                    if let Some(e) = self.qps[i].take() {
                        reaped.push(e);
                    }
                }
            }
        }
    }
}

fn post_sends(qp: &QueuePair, items: &[PostItem]) -> Result<(), (usize, i32)> {
    if items.is_empty() {
        return Ok(());
    }
    let wrs: Vec<SendWr<'_>> = items
        .iter()
        .map(|p| SendWr {
            wr_id: p.wr_id,
            op: p.wr.op,
            sges: p.wr.sges.as_slice(),
            signaled: p.signaled,
            inline: p.wr.inline,
            solicited: p.wr.solicited,
            fence: false,
        })
        .collect();
    // The SGEs name memory owned by payloads parked in the operation table until the core
    // applies each request's completion (or its retirement by a later signaled completion);
    // SAFETY: so it stays allocated, registered (the payload keeps the lkey's MR) and unused.
    match unsafe { qp.post_send(&wrs) } {
        Ok(()) => Ok(()),
        Err(e) => Err(post_error(e)),
    }
}

fn post_recvs(qp: &QueuePair, items: &[PostItem]) -> Result<(), (usize, i32)> {
    if items.is_empty() {
        return Ok(());
    }
    let wrs: Vec<RecvWr<'_>> = items
        .iter()
        .map(|p| RecvWr::new(p.wr_id, p.wr.sges.as_slice()))
        .collect();
    // SAFETY: as in `post_sends`: the receive buffers are parked in the table until the
    // receive completes.
    match unsafe { qp.post_recv(&wrs) } {
        Ok(()) => Ok(()),
        Err(e) => Err(post_error(e)),
    }
}

fn post_error(e: Error) -> (usize, i32) {
    warn!(error = %e, "posting work requests failed");
    let errno = e.raw_os_error().unwrap_or(libc::EIO);
    match e {
        Error::PostSend { bad_index, .. } | Error::PostRecv { bad_index, .. } => (bad_index, errno),
        _ => (0, errno),
    }
}
