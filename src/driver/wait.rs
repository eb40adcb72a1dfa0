//! How a future waits for its completion: poll the CQ itself for a while (spin), or sleep
//! until the completion task wakes it.
//!
//! * [`CompletionMode::BusyPoll`]: spin until done (yielding to the runtime between polls).
//! * [`CompletionMode::Event`]: sleep at once; the completion task arms the CQ and wakes the
//!   future from the completion event, or, when only one task's futures sleep, they arm it
//!   and wait on the event themselves (`watch.rs`).
//! * [`CompletionMode::Adaptive`] (hybrid polling, as Linux blk-mq does for fast devices): the
//!   driver keeps a moving average of how long operations take to complete, separately for
//!   the send queue (bounded by the network) and for receives (bounded by the peer). A future
//!   spins for up to the larger of twice the average and an estimate of the 99th percentile
//!   of waits, plus a small floor, capped at `max_spin`, then sleeps;
//!   when the average itself exceeds `max_spin` (a peer that answers slowly), it sleeps at
//!   once, since spinning would mostly be wasted, except one wait in
//!   [`PROBE_EVERY`](super::latency::PROBE_EVERY), which spins `max_spin` to find out whether
//!   waits got short again (a sleeping future's sample includes its wake-up, so without
//!   probes the average could not come down: see [`Latency`](super::latency::Latency)).
//!   Every completion a future observes updates the average, so the policy follows the
//!   workload both ways.
//!
//! A spinning future returns `Pending` after waking itself, so the runtime runs other tasks
//! (and, on soft-RoCE, the kernel's rxe work gets the CPU) between two polls. While any future
//! spins, the completion task leaves the CQ unarmed: no interrupt, no event, no task hop per
//! completion.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::latency::WaitKind;
use super::options::CompletionMode;
use super::shared::Shared;
use super::state::Epoch;

/// [`Waiter::budget_ns`] before the wait decided its budget.
const NO_BUDGET: u64 = u64::MAX;

/// The waiting state of one future.
#[derive(Debug)]
pub(crate) struct Waiter {
    since: Option<Instant>,
    /// Adaptive mode: how long this wait spins, in nanoseconds, decided at its first spin
    /// ([`NO_BUDGET`] until then; a plain integer keeps the future 8 bytes smaller than an
    /// `Option<Duration>`).
    budget_ns: u64,
    /// This wait is a probe (see [`Latency`]).
    probing: bool,
    /// It went to sleep at least once (its sample then includes a wake-up).
    slept: bool,
    spinning: bool,
    /// Counted in `Shared::sleepers`.
    sleeping: bool,
    /// Polls of this wait so far (see [`in_place_polls`](Self::in_place_polls)).
    rounds: u8,
    /// Counted among the sleepers of the watch of this epoch ([`Watch`](super::state::Watch)).
    pub(crate) watch: Option<Epoch>,
    /// It went to sleep as the first sleeper: the completion task is to be woken, unless
    /// this future watches the channel itself ([`kick_if_due`](Self::kick_if_due)).
    kick_due: bool,
}

impl Default for Waiter {
    #[inline]
    fn default() -> Waiter {
        Waiter {
            since: None,
            budget_ns: NO_BUDGET,
            probing: false,
            slept: false,
            spinning: false,
            sleeping: false,
            rounds: 0,
            watch: None,
            kick_due: false,
        }
    }
}

impl Waiter {
    /// The operation was posted now (starts its latency sample). Only the adaptive mode
    /// reads the samples, so only it pays for the clock reads.
    #[inline]
    pub(crate) fn start(&mut self, shared: &Shared) {
        if self.since.is_none() && matches!(shared.mode, CompletionMode::Adaptive { .. }) {
            self.since = Some(Instant::now());
        }
    }

    /// How many times this poll of a queue-pair operation's future polls the CQ in place: the
    /// mode's number ([`Shared::in_place_polls`]: 64 in busy and adaptive modes) when no
    /// operation future of this driver waits to be posted ([`Shared::unposted`]), else 1, 4,
    /// 16, then the mode's number over the wait's first polls. A future polled beside others
    /// in one task must not spin its full count before they are polled: in `join!(recv,
    /// send)`, or after `poll!(&mut recv)` to post a receive before answering, the send the
    /// peer waits for went out only after 64 polls (`send_lat` 2 B busy 55-72 µs, then 25-30
    /// µs with the ramp, perftest 11 µs). But a wait with nothing left to post beside it (a
    /// lone `read`, or `join!(send, recv)` once the send is out) only lost by the ramp: each
    /// of its rounds that found nothing was a trip through the runtime (one per `send_lat` 2 B
    /// busy round trip under callgrind, about 1,200 instructions). A connection's waits
    /// (`conn::progress`) spin their full count from the first poll: its message sends are
    /// posted before it waits.
    #[inline]
    pub(crate) fn in_place_polls(&mut self, shared: &Shared) -> u32 {
        let max = shared.in_place_polls();
        let n = if shared.unposted.load(Ordering::Relaxed) == 0 {
            max
        } else {
            ramp(self.rounds, max)
        };
        self.rounds = self.rounds.saturating_add(1);
        n
    }

    /// The operation is not complete after an in-place poll: whether to spin (wake itself
    /// and poll again) rather than sleep until woken.
    pub(crate) fn keep_spinning(&mut self, shared: &Shared, kind: WaitKind) -> bool {
        let spin = match shared.mode {
            CompletionMode::BusyPoll => true,
            CompletionMode::Event => false,
            CompletionMode::Adaptive { max_spin } => {
                if self.budget_ns == NO_BUDGET {
                    let (b, probing) = shared.latency.budget(kind, max_spin);
                    self.probing = probing;
                    // Saturated one short of the marker: a budget of 584 years spins as long.
                    self.budget_ns = b.as_nanos().min(u128::from(NO_BUDGET - 1)) as u64;
                }
                let budget = Duration::from_nanos(self.budget_ns);
                let since = *self.since.get_or_insert_with(Instant::now);
                !budget.is_zero() && since.elapsed() < budget
            }
        };
        if spin {
            if !self.spinning {
                self.spinning = true;
                shared.spinners.join();
            }
            if std::mem::take(&mut self.sleeping) {
                let _ = shared.sleepers.leave();
            }
        } else {
            if std::mem::take(&mut self.spinning) {
                shared.spinner_left();
            }
            if !self.sleeping {
                self.sleeping = true;
                self.slept = true;
                self.kick_due = shared.sleeper_joined();
            }
        }
        spin
    }

    /// Wakes the completion task if this wait's going to sleep asked for it (see
    /// [`Shared::sleeper_joined`]).
    #[inline]
    pub(crate) fn kick_if_due(&mut self, shared: &Shared) {
        if self.take_kick_due() {
            shared.notify.notify_one();
        }
    }

    /// Whether going to sleep asked for the completion task; asks no more.
    #[inline]
    pub(crate) fn take_kick_due(&mut self) -> bool {
        std::mem::take(&mut self.kick_due)
    }

    /// The operation completed: records its latency and stops spinning.
    ///
    /// Unlike [`leave`](Self::leave), the last spinner finishing this way wakes the completion
    /// task only when some future sleeps (it needs the task to watch the CQ for it). With
    /// nobody asleep there is nothing to hand off: this future has just polled the CQ (the
    /// task, leaving the CQ to futures that poll in place, sees the poll count move and goes
    /// on doing so until its next stale check), and the next operation usually polls in
    /// place again at once. Waking it anyway cost a cross-thread wake-up per operation on a
    /// multi-thread runtime, where the task runs on another worker (17-34 task runs per
    /// round trip in busy mode, against 0.4-0.6 on the current-thread runtime). A sleeper
    /// joining at the same moment wakes the task itself (`sleeper_joined`); a wake-up lost
    /// to that race costs at most the task's stale check (`STALE_SPIN_CHECK`), never a hang.
    #[inline]
    pub(crate) fn done(&mut self, shared: &Shared, kind: WaitKind) {
        if let Some(since) = self.since.take() {
            shared
                .latency
                .finish(kind, since.elapsed(), self.probing && !self.slept);
        }
        self.budget_ns = NO_BUDGET;
        self.probing = false;
        self.slept = false;
        self.rounds = 0;
        if std::mem::take(&mut self.spinning) && shared.spinners.leave() && shared.sleepers.any() {
            shared.notify.notify_one();
        }
        if std::mem::take(&mut self.sleeping) {
            let _ = shared.sleepers.leave();
        }
    }

    /// Stops spinning (the future is dropped, or goes to sleep).
    #[inline]
    pub(crate) fn leave(&mut self, shared: &Shared) {
        if std::mem::take(&mut self.spinning) {
            shared.spinner_left();
        }
        if std::mem::take(&mut self.sleeping) {
            let _ = shared.sleepers.leave();
        }
    }
}

/// In-place polls of a wait's poll number `round` (from 0): 1, 4, 16, ... up to `max` (none
/// if `max` is 0).
#[inline]
fn ramp(round: u8, max: u32) -> u32 {
    (1u32 << (2 * u32::from(round)).min(16)).min(max)
}

/// Waits until `done()` holds, woken by `notify`: the notification is registered before each
/// check, so one sent between the check and the wait is not lost.
pub(crate) async fn wait_until(notify: &tokio::sync::Notify, mut done: impl FnMut() -> bool) {
    loop {
        let notified = notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if done() {
            return;
        }
        notified.await;
    }
}

#[cfg(test)]
mod tests {
    use super::ramp;

    #[test]
    fn in_place_polls_grow_from_one_up_to_the_modes_number() {
        let busy: Vec<u32> = (0..6).map(|r| ramp(r, 64)).collect();
        assert_eq!(busy, [1, 4, 16, 64, 64, 64]);
        assert_eq!(ramp(u8::MAX, 64), 64);
        // Event mode polls never (once with its completion task gone).
        assert!((0..=u8::MAX).all(|r| ramp(r, 1) == 1 && ramp(r, 0) == 0));
    }
}
