//! Observed completion latency ([`Latency`], a moving average per [`WaitKind`]) and the
//! adaptive mode's spin budget derived from it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The least an adaptive future spins before sleeping.
pub(crate) const SPIN_FLOOR: Duration = Duration::from_micros(5);

/// Which latency an operation's wait follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WaitKind {
    /// Send-queue operations: sends, RDMA WRITE/READ, atomics.
    Send,
    /// Receives (and connection messages): bounded by when the peer sends.
    Recv,
}

/// Moving averages of completion latency, in nanoseconds (weight 1/8 per sample).
#[derive(Debug, Default)]
pub(crate) struct Latency {
    send_ns: AtomicU64,
    recv_ns: AtomicU64,
}

impl Latency {
    fn cell(&self, kind: WaitKind) -> &AtomicU64 {
        match kind {
            WaitKind::Send => &self.send_ns,
            WaitKind::Recv => &self.recv_ns,
        }
    }

    /// Adds a sample. Racing updates may lose one; the average stays an average.
    pub(crate) fn record(&self, kind: WaitKind, sample: Duration) {
        let cell = self.cell(kind);
        let s = u64::try_from(sample.as_nanos()).unwrap_or(u64::MAX);
        let old = cell.load(Ordering::Relaxed);
        let new = if old == 0 {
            s
        } else {
            // old + (s - old) / 8, in signed arithmetic.
            (old as i128 + (s as i128 - old as i128) / 8).max(1) as u64
        };
        cell.store(new, Ordering::Relaxed);
    }

    /// The current average (zero before any sample).
    pub(crate) fn estimate(&self, kind: WaitKind) -> Duration {
        Duration::from_nanos(self.cell(kind).load(Ordering::Relaxed))
    }
}

/// How long a future whose operations average `est` spins in adaptive mode (zero: sleep at
/// once).
pub(crate) fn spin_budget(est: Duration, max_spin: Duration) -> Duration {
    if est > max_spin {
        return Duration::ZERO;
    }
    (est * 2 + SPIN_FLOOR).min(max_spin)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_average_follows_samples_both_ways() {
        let l = Latency::default();
        assert_eq!(l.estimate(WaitKind::Send), Duration::ZERO);
        l.record(WaitKind::Send, Duration::from_micros(80));
        assert_eq!(l.estimate(WaitKind::Send), Duration::from_micros(80));
        for _ in 0..64 {
            l.record(WaitKind::Send, Duration::from_micros(8));
        }
        let e = l.estimate(WaitKind::Send);
        assert!(e < Duration::from_micros(9), "{e:?}");
        assert_eq!(
            l.estimate(WaitKind::Recv),
            Duration::ZERO,
            "kinds are separate"
        );
        for _ in 0..64 {
            l.record(WaitKind::Send, Duration::from_micros(500));
        }
        assert!(l.estimate(WaitKind::Send) > Duration::from_micros(400));
    }

    #[test]
    fn budget_spins_around_twice_the_average_and_gives_up_on_slow_peers() {
        let cap = Duration::from_micros(100);
        assert_eq!(spin_budget(Duration::ZERO, cap), SPIN_FLOOR);
        assert_eq!(
            spin_budget(Duration::from_micros(10), cap),
            Duration::from_micros(25)
        );
        assert_eq!(spin_budget(Duration::from_micros(60), cap), cap, "capped");
        assert_eq!(
            spin_budget(Duration::from_micros(101), cap),
            Duration::ZERO,
            "slower than the cap: sleep at once"
        );
    }
}
