//! The driver's counters ([`DriverStats`](super::DriverStats) is their snapshot).

use std::sync::atomic::{AtomicU64, Ordering};

use super::state::State;

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
    pub(crate) task_wakeups: AtomicU64,
    pub(crate) last_wqe_reached: AtomicU64,
    pub(crate) last_wqe_timeouts: AtomicU64,
}

/// Adds `n` to `counter`, one of the counters only ever written with the driver's lock held
/// (`polls`, `polled_in_place`, `posted`, `doorbells`, `completions`, `unknown`; `_held`, the
/// locked state, shows the caller holds it): no other thread writes it meanwhile, so a load and
/// a store do, without a locked read-modify-write (a few of these per operation). Readers
/// ([`Driver::stats`](super::Driver::stats)) load it without the lock and see either value.
#[inline]
pub(crate) fn add_held(counter: &AtomicU64, n: u64, _held: &State) {
    counter.store(
        counter.load(Ordering::Relaxed).wrapping_add(n),
        Ordering::Relaxed,
    );
}
