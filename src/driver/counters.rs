//! The driver's counters ([`DriverStats`](super::DriverStats) is their snapshot).

use std::sync::atomic::AtomicU64;

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
