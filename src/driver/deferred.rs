//! The owners' side of a completion: [`Sink`], the callback of a queue pair whose owner posts
//! its own requests, and [`Deferred`], what runs once the driver's lock (or a connection's) is
//! released (wakers, released payloads, sinks' `after_unlock`, moves to the error state).

use std::any::Any;
use std::mem::ManuallyDrop;
use std::sync::Arc;
use std::task::Waker;

use smallvec::SmallVec;
use tracing::warn;

use crate::error::QpFailure;
use crate::proto::{Completed, Cqe};
use crate::verbs::{QueuePair, SendOp, SendWr};

/// What a dropped operation parks in the table: its buffers, until the device is done.
pub(crate) type Payload = Box<dyn Any + Send>;

/// Receives the completions of the requests a queue pair's owner posted itself (with
/// [`sink_wr_id`](super::sink::sink_wr_id)s), in completion-queue order. Called with the driver's lock held: it must
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

    /// Successful completions of this queue pair that came one after the other in one poll
    /// of the CQ, in order: the same as an [`on_completion`](Self::on_completion) for each,
    /// which a sink may do in one step (one look at its state for the run). The driver hands
    /// a failed completion alone, so a run's `qp_failure` holds for all of it.
    fn on_completions(
        &self,
        run: &[(u32, Cqe)],
        qp_failure: Option<&QpFailure>,
        wake: &mut Deferred,
    ) -> Option<QpFailure> {
        let mut failed = None;
        for (local, cqe) in run {
            if let Some(f) = self.on_completion(*local, cqe, qp_failure, wake) {
                failed.get_or_insert(f);
            }
        }
        failed
    }

    /// Called after the driver's lock is released, if `on_completion` asked for it with
    /// [`Deferred::after_unlock`]: release what must not be dropped under the lock.
    fn after_unlock(&self) {}

    /// The driver's completion task is gone (its runtime shut down): fail, and wake every
    /// waiter, which polls the completion queue itself from now on. Called without the lock.
    fn on_driver_stopped(&self) {}
}

/// What must happen once the driver's lock is released: queue pairs to move to the error
/// state, wakers to wake, buffers to drop, and sinks whose owners have memory to release
/// ([`Sink::after_unlock`]). Nothing foreign (a waker's wake, a payload's or application
/// buffer's drop) runs under the lock: a drop may release the last handle of a queue pair of
/// this very driver, which takes the lock. Nor does `ibv_modify_qp`: a system call that
/// waits for the kernel's queue-pair lock, while every future of the CQ waits for ours.
///
/// Holds up to 32 wakers without allocating; more spill to the heap.
///
/// One is set up per look at the CQ or the table (every poll of an operation's future), and
/// most stay empty: an untouched one costs neither a run nor its lists' drops (the lists sit
/// in `ManuallyDrop` and are dropped only once something was put in them; an empty list never
/// put to use holds no memory, so skipping its drop loses nothing).
#[derive(Debug, Default)]
pub(crate) struct Deferred {
    /// Something was put in (since creation): only then is there anything to run or drop.
    touched: bool,
    /// Inline up to 32 (uninitialised until pushed: creating and dropping an empty one costs
    /// nothing per slot), then on the heap.
    wakers: ManuallyDrop<SmallVec<[Waker; 32]>>,
    released: ManuallyDrop<Vec<Payload>>,
    /// Inline up to 4 (a poll rarely applies completions of more queue pairs whose owners
    /// have memory to release): no allocation on the data path.
    sinks: ManuallyDrop<SmallVec<[Arc<dyn Sink>; 4]>>,
    /// Failed queue pairs to move to ERR, each once, in the order they failed.
    to_error: ManuallyDrop<Vec<ToError>>,
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
        self.touched = true;
        self.wakers.push(w);
    }

    /// Calls `sink`'s [`after_unlock`](Sink::after_unlock) once the lock is released.
    pub(crate) fn after_unlock(&mut self, sink: Arc<dyn Sink>) {
        self.touched = true;
        if !self.sinks.iter().any(|s| Arc::ptr_eq(s, &sink)) {
            self.sinks.push(sink);
        }
    }

    /// Moves `qp` to the error state once the lock is released (once, however often it is
    /// asked), then posts the drain marker `marker` if given.
    pub(crate) fn move_to_error(&mut self, qp: &QueuePair, marker: Option<u64>) {
        self.touched = true;
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
    #[inline]
    pub(crate) fn take_from(&mut self, out: &mut Completed<Payload>) {
        // Only if a list holds something (most calls move nothing).
        if !out.wakers.is_empty() || !out.released.is_empty() {
            self.take_lists(out);
        }
    }

    fn take_lists(&mut self, out: &mut Completed<Payload>) {
        for w in out.wakers.drain(..) {
            self.push(w);
        }
        if !out.released.is_empty() {
            self.touched = true;
            self.released.append(&mut out.released);
        }
    }

    /// Moves queue pairs to ERR, wakes and drops. Call without the lock.
    #[inline]
    pub(crate) fn run(&mut self) {
        if self.touched {
            self.run_lists();
        }
        // Else nothing was ever put in (most polls): no call.
    }

    fn run_lists(&mut self) {
        // Each list is looked at only if it holds something: a drain's setup and drop cost
        // instructions.
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
    #[inline]
    fn drop(&mut self) {
        if self.touched {
            self.drop_lists();
        }
        // Else every list is empty and was never put to use: no memory to free, no call.
    }
}

impl Deferred {
    fn drop_lists(&mut self) {
        self.run_lists();
        // The lists are empty now; what is left is their memory, if they spilled to the heap
        // (each is then taken out, leaving an empty list that holds none, and dropped). An
        // inline list is not taken: moving a 32-slot `SmallVec` out copies its 520 bytes, which
        // cost ~190 instructions per message of `msg_lat` (every completion of a connection
        // wakes someone, so its `Deferred` is touched).
        if self.wakers.spilled() {
            drop(std::mem::take(&mut *self.wakers));
        }
        if self.released.capacity() > 0 {
            drop(std::mem::take(&mut *self.released));
        }
        if self.sinks.spilled() {
            drop(std::mem::take(&mut *self.sinks));
        }
        if self.to_error.capacity() > 0 {
            drop(std::mem::take(&mut *self.to_error));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Wake;

    use super::Deferred;

    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn dropping_wakes_what_was_put_in_also_past_the_inline_room() {
        let count = Arc::new(Count(AtomicUsize::new(0)));
        for n in [0, 1, 32, 33, 100] {
            count.0.store(0, Ordering::SeqCst);
            let mut d = Deferred::default();
            for _ in 0..n {
                d.push(count.clone().into());
            }
            drop(d);
            assert_eq!(count.0.load(Ordering::SeqCst), n, "{n} wakers");
            // Each waker's clone of the counter was released (woken by value).
            assert_eq!(Arc::strong_count(&count), 1, "{n} wakers");
        }
        // Run, then reused and dropped: each waker woken once.
        let mut d = Deferred::default();
        count.0.store(0, Ordering::SeqCst);
        for _ in 0..40 {
            d.push(count.clone().into());
        }
        d.run();
        d.push(count.clone().into());
        drop(d);
        assert_eq!(count.0.load(Ordering::SeqCst), 41);
        assert_eq!(Arc::strong_count(&count), 1);
    }
}
