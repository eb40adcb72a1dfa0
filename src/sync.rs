//! The synchronization primitives of the crate's lock-free logic, swappable for `loom`'s.
//!
//! Normally these are `std::sync`'s. Under `--cfg tokio_rdma_loom` (test builds only: `loom` is a
//! dev-dependency) they are `loom`'s, whose model checker runs the `#[cfg(tokio_rdma_loom)]` tests of the
//! modules that use this one under every interleaving and every weak-memory outcome their
//! orderings allow (docs/testing.md#concurrency-models). Only the logic those models check
//! uses it: the pool's free list and waiters (`buf::pool`), the SRQ claim budget
//! (`conn::srq::budget`), the spinner count (`driver::spinners`) and a connection's dropped
//! messages (`conn::io::dropped`). A leaf module: it
//! imports nothing of the crate.

#[cfg(not(all(tokio_rdma_loom, test)))]
pub(crate) use std::sync::{Mutex, MutexGuard};

#[cfg(all(tokio_rdma_loom, test))]
pub(crate) use loom::sync::{Mutex, MutexGuard};

/// Atomic integers and orderings (`std`'s, or `loom`'s under `--cfg tokio_rdma_loom`).
pub(crate) mod atomic {
    #[cfg(not(all(tokio_rdma_loom, test)))]
    pub(crate) use std::sync::atomic::{
        AtomicBool, AtomicI64, AtomicIsize, AtomicU32, AtomicU64, AtomicUsize, Ordering, fence,
    };

    #[cfg(all(tokio_rdma_loom, test))]
    pub(crate) use loom::sync::atomic::{
        AtomicBool, AtomicI64, AtomicIsize, AtomicU32, AtomicU64, AtomicUsize, Ordering, fence,
    };
}

/// Runs `f` under `loom`'s model checker, exploring interleavings with at most `preemptions`
/// preemptions unless `LOOM_MAX_PREEMPTIONS` says otherwise (the other `LOOM_*` variables
/// apply as documented by `loom`).
#[cfg(all(tokio_rdma_loom, test))]
pub(crate) fn model(preemptions: usize, f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    if b.preemption_bound.is_none() {
        b.preemption_bound = Some(preemptions);
    }
    let iterations = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = iterations.clone();
    b.check(move || {
        counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        f()
    });
    let n = iterations.load(std::sync::atomic::Ordering::Relaxed);
    // A model with a single interleaving checks nothing concurrent.
    assert!(n > 1, "the model explored {n} interleaving(s)");
}
