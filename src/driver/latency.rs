//! Observed completion latency ([`Latency`], a moving average per [`WaitKind`]) and the
//! adaptive mode's spin budget derived from it.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// The least an adaptive future spins before sleeping.
pub(crate) const SPIN_FLOOR: Duration = Duration::from_micros(5);

/// While the average exceeds `max_spin` (futures sleep at once), one wait in this many still
/// spins for up to `max_spin`: a probe (see [`Latency::probe`]).
pub(crate) const PROBE_EVERY: u32 = 8;

/// Which latency an operation's wait follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WaitKind {
    /// Send-queue operations: sends, RDMA WRITE/READ, atomics.
    Send,
    /// Receives (and connection messages): bounded by when the peer sends.
    Recv,
}

/// Moving averages of completion latency, in nanoseconds (weight 1/8 per sample).
///
/// The averages decide whether futures spin, and a future that sleeps measures its wake-up
/// too: on soft-RoCE under emulation an event costs some 150 µs per side, so a 4 KiB
/// ping-pong whose round trip is 240 µs spinning takes 600 µs sleeping. Once such samples
/// push the average past `max_spin`, every future sleeps at once and measures the slow path
/// only: the average can no longer come down (at 61ac8ac and up to this change, the 4 KiB
/// send ping-pong armed and slept on every operation in adaptive mode, 4.2x perftest). So
/// while futures sleep at once, one wait in [`PROBE_EVERY`] spins anyway (a probe); a probe
/// that sees its completion while spinning proves waits are short again and resets the
/// average to its sample.
#[derive(Debug, Default)]
pub(crate) struct Latency {
    send_ns: AtomicU64,
    recv_ns: AtomicU64,
    /// Waits that slept at once since the last probe, per kind.
    send_skips: AtomicU32,
    recv_skips: AtomicU32,
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
        let s = nanos(sample);
        let old = cell.load(Ordering::Relaxed);
        let new = if old == 0 {
            s
        } else {
            // old + (s - old) / 8, in signed arithmetic.
            (old as i128 + (s as i128 - old as i128) / 8).max(1) as u64
        };
        cell.store(new, Ordering::Relaxed);
    }

    /// Replaces the average with `sample` (a probe saw its completion while spinning).
    pub(crate) fn reset(&self, kind: WaitKind, sample: Duration) {
        self.cell(kind)
            .store(nanos(sample).max(1), Ordering::Relaxed);
    }

    /// The current average (zero before any sample).
    pub(crate) fn estimate(&self, kind: WaitKind) -> Duration {
        Duration::from_nanos(self.cell(kind).load(Ordering::Relaxed))
    }

    /// How long a wait spins, and whether it is a probe: [`spin_budget`], except that one
    /// wait in [`PROBE_EVERY`] of those that would sleep at once spins `max_spin`.
    pub(crate) fn budget(&self, kind: WaitKind, max_spin: Duration) -> (Duration, bool) {
        let budget = spin_budget(self.estimate(kind), max_spin);
        if budget.is_zero() && self.probe(kind) {
            return (max_spin, true);
        }
        (budget, false)
    }

    /// A wait took `sample`; `probe_hit`: it was a probe and saw its completion while
    /// spinning, so the average restarts from it.
    pub(crate) fn finish(&self, kind: WaitKind, sample: Duration, probe_hit: bool) {
        if probe_hit {
            self.reset(kind, sample);
        } else {
            self.record(kind, sample);
        }
    }

    /// Whether a wait that would sleep at once (the average exceeds `max_spin`) probes
    /// instead: true once in [`PROBE_EVERY`] such waits.
    pub(crate) fn probe(&self, kind: WaitKind) -> bool {
        let skips = match kind {
            WaitKind::Send => &self.send_skips,
            WaitKind::Recv => &self.recv_skips,
        };
        if skips.fetch_add(1, Ordering::Relaxed) + 1 >= PROBE_EVERY {
            skips.store(0, Ordering::Relaxed);
            return true;
        }
        false
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
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

    /// The 4 KiB send ping-pong on soft-RoCE: a wait completes after 240 µs when the future
    /// spins, after 600 µs when it sleeps (an event's wake-up on each side). Started from a
    /// few slow samples, the average must come back under `max_spin` and stay there.
    #[test]
    fn a_sleeping_regime_is_left_once_a_probe_sees_short_waits() {
        let l = Latency::default();
        let max_spin = Duration::from_micros(500);
        for _ in 0..4 {
            l.record(WaitKind::Recv, Duration::from_micros(600));
        }
        assert!(
            l.estimate(WaitKind::Recv) > max_spin,
            "trapped to begin with"
        );
        let mut spun = Vec::new();
        for _ in 0..64 {
            let (budget, probing) = l.budget(WaitKind::Recv, max_spin);
            let spins = budget >= Duration::from_micros(240);
            let sample = Duration::from_micros(if spins { 240 } else { 600 });
            l.finish(WaitKind::Recv, sample, probing && spins);
            spun.push(spins);
        }
        let first = spun.iter().position(|&s| s).expect("a probe spun");
        assert!(first < PROBE_EVERY as usize, "probed at wait {first}");
        assert!(spun[first..].iter().all(|&s| s), "{spun:?}");
        assert_eq!(l.estimate(WaitKind::Recv), Duration::from_micros(240));
    }

    #[test]
    fn a_slow_peer_keeps_waits_asleep_but_for_one_probe_in_eight() {
        let l = Latency::default();
        let max_spin = Duration::from_micros(500);
        l.record(WaitKind::Recv, Duration::from_millis(10));
        let mut probes = 0;
        for _ in 0..(PROBE_EVERY * 4) {
            let (budget, probing) = l.budget(WaitKind::Recv, max_spin);
            if probing {
                probes += 1;
                assert_eq!(budget, max_spin);
            } else {
                assert_eq!(budget, Duration::ZERO);
            }
            // The peer answers after 10 ms: even a probe ends up sleeping.
            l.finish(WaitKind::Recv, Duration::from_millis(10), false);
        }
        assert_eq!(probes, 4);
        assert_eq!(
            l.estimate(WaitKind::Send),
            Duration::ZERO,
            "kinds are separate"
        );
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
