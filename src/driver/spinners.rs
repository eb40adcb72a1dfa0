//! The count of futures polling the CQ themselves (spinners), and the hand-off it decides.
//!
//! While any future spins, the completion task leaves the CQ unarmed: the spinners see every
//! completion first. So when the LAST spinner stops, nobody watches the CQ any more, and the
//! completion task must be told at once (it then arms the CQ and polls once more): a
//! completion that arrived after the last spinner's last poll would otherwise wait for the
//! task's next stale-spin check. [`Spinners::leave`] says when that is the case; the caller
//! notifies (`Shared::spinner_left`). A future that leaves because its own operation
//! completed notifies only if some future sleeps (`Waiter::done`): otherwise nothing waits
//! for the task, and the notification was a cross-thread wake-up per operation. The hand-off is model-checked with `loom` (the tests
//! below, docs/testing.md#concurrency-models).

use crate::sync::atomic::{AtomicUsize, Ordering};

/// Futures spinning on one CQ right now.
#[derive(Debug, Default)]
pub(crate) struct Spinners(AtomicUsize);

impl Spinners {
    /// A future starts polling the CQ itself.
    pub(crate) fn join(&self) {
        self.0.fetch_add(1, Ordering::AcqRel);
    }

    /// A future that joined stops polling the CQ; `true` when it was the last one, so the
    /// completion task must be woken to watch the CQ.
    #[must_use = "the last spinner leaving must wake the completion task"]
    pub(crate) fn leave(&self) -> bool {
        self.0.fetch_sub(1, Ordering::AcqRel) == 1
    }

    /// Whether some future spins (the completion task then leaves the CQ unarmed).
    pub(crate) fn any(&self) -> bool {
        self.0.load(Ordering::Acquire) > 0
    }

    pub(crate) fn count(&self) -> usize {
        self.0.load(Ordering::Acquire)
    }
}

#[cfg(all(test, tokio_rdma_loom))]
mod loom_models;
