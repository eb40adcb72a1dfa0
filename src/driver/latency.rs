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

/// Completion latency per [`WaitKind`]: a smoothed average (weight 1/8 per sample) and an
/// estimate of the 99th percentile, in nanoseconds. The adaptive mode spins for the larger of
/// twice the average and that percentile (see [`spin_budget`]).
///
/// Why the percentile: waits on soft-RoCE under emulation scatter widely (a 64 B message round
/// trip of 40-90 µs at the median has a 99th percentile of 300-450 µs), so a budget of twice
/// the average alone gave up on 2-7% of the waits, and each of those slept, armed the CQ and
/// paid an event's wake-up (some 150 µs per side there) on top of the wait. A mean deviation
/// (TCP's retransmission timer, RFC 6298) does not cover such a tail: it decays between two
/// rare long waits. The percentile is tracked by steps (a sample above it raises it by 1/4,
/// one at or below lowers it by 1/396, so it settles where 1% of the samples exceed it), with
/// no memory of samples: it rises within a few long waits and comes down over some hundreds
/// of short ones (only spin time is lost meanwhile, bounded by `max_spin`).
///
/// The averages decide whether futures spin, and a future that sleeps measures its wake-up
/// too: on soft-RoCE under emulation an event costs some 150 µs per side, so a 4 KiB
/// ping-pong whose round trip is 240 µs spinning takes 600 µs sleeping. Once such samples
/// push the average past `max_spin`, every future sleeps at once and measures the slow path
/// only: the average can no longer come down (at 61ac8ac and up to this change, the 4 KiB
/// send ping-pong armed and slept on every operation in adaptive mode, 4.2x perftest). So
/// while futures sleep at once, one wait in [`PROBE_EVERY`] spins anyway (a probe); a probe
/// that sees its completion while spinning proves waits are short again and restarts the
/// estimate from its sample.
#[derive(Debug, Default)]
pub(crate) struct Latency {
    send: Estimate,
    recv: Estimate,
    /// Waits that slept at once since the last probe, per kind.
    send_skips: AtomicU32,
    recv_skips: AtomicU32,
}

/// One kind's smoothed average and 99th percentile, in nanoseconds (zero: no sample yet).
/// Racing updates may lose one; the estimate stays an estimate.
#[derive(Debug, Default)]
struct Estimate {
    avg_ns: AtomicU64,
    tail_ns: AtomicU64,
}

impl Estimate {
    fn record(&self, sample: u64) {
        let avg = self.avg_ns.load(Ordering::Relaxed);
        if avg == 0 {
            self.reset(sample);
            return;
        }
        // avg + (sample - avg) / 8, in signed arithmetic.
        let avg = (avg as i128 + (sample as i128 - avg as i128) / 8).max(1) as u64;
        let tail = self.tail_ns.load(Ordering::Relaxed);
        let tail = if sample > tail {
            tail.saturating_add(tail / 4 + 1)
        } else {
            tail - tail / 396
        };
        self.avg_ns.store(avg, Ordering::Relaxed);
        self.tail_ns.store(tail.max(1), Ordering::Relaxed);
    }

    /// Restarts from one sample.
    fn reset(&self, sample: u64) {
        self.avg_ns.store(sample.max(1), Ordering::Relaxed);
        self.tail_ns.store(sample.max(1), Ordering::Relaxed);
    }

    fn get(&self) -> (Duration, Duration) {
        (
            Duration::from_nanos(self.avg_ns.load(Ordering::Relaxed)),
            Duration::from_nanos(self.tail_ns.load(Ordering::Relaxed)),
        )
    }
}

impl Latency {
    fn cell(&self, kind: WaitKind) -> &Estimate {
        match kind {
            WaitKind::Send => &self.send,
            WaitKind::Recv => &self.recv,
        }
    }

    /// Adds a sample.
    pub(crate) fn record(&self, kind: WaitKind, sample: Duration) {
        self.cell(kind).record(nanos(sample));
    }

    /// Restarts the estimate from `sample` (a probe saw its completion while spinning).
    pub(crate) fn reset(&self, kind: WaitKind, sample: Duration) {
        self.cell(kind).reset(nanos(sample));
    }

    /// The current average (zero before any sample).
    #[cfg(test)]
    pub(crate) fn estimate(&self, kind: WaitKind) -> Duration {
        self.cell(kind).get().0
    }

    /// The current 99th-percentile estimate (zero before any sample).
    #[cfg(test)]
    pub(crate) fn tail(&self, kind: WaitKind) -> Duration {
        self.cell(kind).get().1
    }

    /// How long a wait of `kind` spins with nothing else known: [`spin_budget`] of the
    /// current estimate.
    pub(crate) fn plain_budget(&self, kind: WaitKind, max_spin: Duration) -> Duration {
        let (avg, tail) = self.cell(kind).get();
        spin_budget(avg, tail, max_spin)
    }

    /// How long a wait spins, and whether it is a probe: [`spin_budget`], except that one
    /// wait in [`PROBE_EVERY`] of those that would sleep at once spins `max_spin`.
    pub(crate) fn budget(&self, kind: WaitKind, max_spin: Duration) -> (Duration, bool) {
        let budget = self.plain_budget(kind, max_spin);
        if budget.is_zero() && self.probe(kind) {
            return (max_spin, true);
        }
        (budget, false)
    }

    /// A wait took `sample`; `probe_hit`: it was a probe and saw its completion while
    /// spinning, so the estimate restarts from it.
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

/// How long a future whose waits average `avg`, 99% of them within `tail`, spins in adaptive
/// mode (zero: sleep at once): the larger of twice the average and `tail`, plus
/// [`SPIN_FLOOR`], capped at `max_spin`; zero once the average itself exceeds `max_spin`
/// (spinning would mostly be wasted).
pub(crate) fn spin_budget(avg: Duration, tail: Duration, max_spin: Duration) -> Duration {
    if avg > max_spin {
        return Duration::ZERO;
    }
    (avg.saturating_mul(2).max(tail) + SPIN_FLOOR).min(max_spin)
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
        let us = Duration::from_micros;
        assert_eq!(spin_budget(Duration::ZERO, Duration::ZERO, cap), SPIN_FLOOR);
        assert_eq!(spin_budget(us(10), us(12), cap), us(25), "steady: twice");
        assert_eq!(
            spin_budget(us(10), us(40), cap),
            us(45),
            "scattered: the tail"
        );
        assert_eq!(spin_budget(us(60), Duration::ZERO, cap), cap, "capped");
        assert_eq!(
            spin_budget(us(101), Duration::ZERO, cap),
            Duration::ZERO,
            "slower than the cap: sleep at once"
        );
        assert_eq!(
            spin_budget(us(101), us(50), cap),
            Duration::ZERO,
            "the tail does not keep a slow peer's waits spinning"
        );
    }

    #[test]
    fn scattered_waits_widen_the_budget_and_steady_ones_keep_twice_the_average() {
        let max_spin = Duration::from_millis(2);
        let us = Duration::from_micros;
        // Steady 50 µs waits: twice the average rules.
        let steady = Latency::default();
        for _ in 0..200 {
            steady.record(WaitKind::Recv, us(50));
        }
        assert!(steady.tail(WaitKind::Recv) < us(65));
        assert_eq!(steady.plain_budget(WaitKind::Recv, max_spin), us(105));
        // Waits of 40-90 µs with one of 400 µs in twenty (a 64 B round trip on soft-RoCE
        // under emulation): twice the average gave up on every 400 µs wait; the percentile
        // covers most of them.
        let scattered = Latency::default();
        let mut slept = 0;
        for i in 0..2000u64 {
            let sample = if i % 20 == 19 { 400 } else { 40 + (i * 7) % 50 };
            let budget = scattered.plain_budget(WaitKind::Recv, max_spin);
            if i >= 200 && us(sample) > budget {
                slept += 1;
            }
            scattered.record(WaitKind::Recv, us(sample));
        }
        let avg = scattered.estimate(WaitKind::Recv);
        assert!(avg < us(200), "{avg:?}");
        assert!(
            scattered.plain_budget(WaitKind::Recv, max_spin) > avg * 2,
            "wider than twice the average"
        );
        assert!(slept < 27, "{slept} of 1800 waits outlasted the budget");
        let old_rule = (avg * 2 + SPIN_FLOOR).min(max_spin);
        assert!(
            old_rule < us(400),
            "the old rule would have slept: {old_rule:?}"
        );
    }

    #[test]
    fn a_probe_hit_restarts_average_and_percentile() {
        let l = Latency::default();
        let us = Duration::from_micros;
        for _ in 0..8 {
            l.record(WaitKind::Send, us(900));
        }
        l.finish(WaitKind::Send, us(100), true);
        assert_eq!(l.estimate(WaitKind::Send), us(100));
        assert_eq!(l.tail(WaitKind::Send), us(100));
    }
}
