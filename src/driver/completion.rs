//! The completion task: completions nobody is polling for.
//!
//! One task per completion queue. Futures poll the CQ themselves while they wait (see
//! `wait.rs`), and a lone task's sleeping futures watch its channel themselves (`watch.rs`);
//! the task handles what they do not: completions of dropped operations, of sleeping futures
//! of several tasks, and of connection receives that arrive while no one is receiving.
//!
//! While some future spins, the task leaves the CQ unarmed and waits until the last one stops.
//! Then, in busy mode, it polls the CQ itself (yielding between polls) while anything is
//! outstanding; in adaptive mode it does so for the spin budget; otherwise (and after that) it
//! arms the CQ, polls once more (a completion that arrives between the last poll and the arm
//! raises no event), and waits on the completion channel's descriptor through `AsyncFd`;
//! events are acknowledged in batches.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::Poll;
use std::time::{Duration, Instant};

use tokio::io::unix::{AsyncFd, AsyncFdReadyGuard};

use super::channel_fd::ChannelFd;
use tokio::time::Sleep;
use tracing::{debug, error, trace};

use super::deferred::Deferred;
use super::latency::WaitKind;
use super::options::CompletionMode;
use super::shared::Shared;
use super::state::{Holder, LAST_WQE_WAIT, QpEntry};

/// While futures spin, how often the task checks that they still poll (see `run`).
const STALE_SPIN_CHECK: Duration = Duration::from_millis(2);
/// While a queue pair is closing, the task looks this often whether it can be reaped (one on a
/// shared receive queue waits for its last-WQE event up to a bound).
const CLOSING_CHECK: Duration = Duration::from_millis(50);

/// Busy mode: how many rounds in a row that find nothing the completion task polls the CQ
/// itself (yielding between them) while no future spins, before it arms the CQ and sleeps.
const TASK_SPIN_ROUNDS: u32 = 64;

pub(crate) async fn run(shared: Arc<Shared>) {
    let afd = &shared.events;
    let mut reaped = Vec::new();
    // Reused by every drain (emptied by each): its inline waker slots are set up once, not
    // per drain.
    let mut wake = Deferred::default();
    // The poll count after our own last drain (every CQ poll counts, in place or here).
    let mut spun_at: Option<u64> = None;
    // When the CQ was last watched (a spinner, or completions found by this task); adaptive
    // mode only (the other modes read no clock here).
    let adaptive = matches!(shared.mode, CompletionMode::Adaptive { .. });
    let mut watched = Instant::now();
    let seen = |n: usize, watched: &mut Instant| {
        if n > 0 && adaptive {
            *watched = Instant::now();
        }
        n > 0
    };
    // The event branch below has just drained the CQ: no need to poll again at once.
    let mut fresh = false;
    // Busy mode: rounds this task has polled the CQ in a row and found nothing.
    let mut idle_rounds = 0u32;
    // The one timer of the rounds that need one (spinners to check on, a closing queue pair),
    // made here and reset by each such round (made lazily, it was an allocation in the middle
    // of a busy-polling application's steady state: tests/alloc.rs). A Sleep joins the timer
    // wheel only when polled, so a round that needs none (every round in event mode) neither
    // reads the clock nor touches the wheel.
    let mut timer: Pin<Box<Sleep>> =
        Box::pin(tokio::time::sleep_until(tokio::time::Instant::now()));
    loop {
        shared.counters.task_wakeups.fetch_add(1, Ordering::Relaxed);
        let others_polled = spun_at != Some(shared.counters.polls.load(Ordering::Relaxed));
        if !std::mem::take(&mut fresh) {
            let found = shared.drain(&mut reaped, &mut wake);
            seen(found, &mut watched);
            idle_rounds = next_idle_rounds(idle_rounds, found);
        }
        if finished(&shared, &mut reaped) {
            break;
        }
        let spinners = shared.spinners.any();
        // A spinning future that stopped being polled (its task awaits something else) must
        // not leave the CQ unwatched for good: if nobody polled since the last check, go on
        // as if nobody spun.
        let stale = spinners && spun_at.is_some() && !others_polled;
        // Futures that poll in place (busy and adaptive modes) watch the CQ as well as this
        // task does, spinning or not: most find their completion within their in-place polls
        // and never count as spinners. While they keep polling and no future sleeps (waiting
        // for this task to wake it), the task leaves the CQ to them and looks again every
        // STALE_SPIN_CHECK: no arm, no CQ event, no thread woken per operation (on a
        // multi-thread runtime this task runs on another worker, and its spinning and events
        // took the CPU the futures and the peer need). Event mode is unchanged: its futures
        // never poll.
        let polled_in_place = shared.mode != CompletionMode::Event
            && spun_at.is_some()
            && others_polled
            && !shared.sleepers.any();
        let watched_by_others = (spinners && !stale) || polled_in_place;
        // The futures that sleep watch the channel themselves (`watch`): nothing to arm
        // or wait on here until one that cannot watch wakes this task.
        let watch_task = shared.watched.load(Ordering::Acquire);
        spun_at = Some(shared.counters.polls.load(Ordering::Relaxed));
        if watched_by_others || watch_task {
            idle_rounds = 0;
            if adaptive {
                watched = Instant::now();
            }
        } else if !shared.armed.load(Ordering::Acquire) {
            // Nobody polls the CQ: in busy mode this task does, while anything is
            // outstanding, for up to TASK_SPIN_ROUNDS rounds that find nothing (futures
            // that wait spin themselves; a task spinning beside them on another worker of
            // a multi-thread runtime only takes the CPU the device's kernel work and the
            // peer need); in adaptive mode for the spin budget after the CQ was last
            // watched (a future that just completed is usually followed by the next one
            // within it, so no arm, no event); otherwise it arms and sleeps.
            let spin = match shared.mode {
                CompletionMode::BusyPoll => {
                    idle_rounds < TASK_SPIN_ROUNDS && shared.has_outstanding()
                }
                CompletionMode::Adaptive { max_spin } => {
                    let budget = shared.latency.plain_budget(WaitKind::Send, max_spin);
                    watched.elapsed() < budget && shared.has_outstanding()
                }
                CompletionMode::Event => false,
            };
            if spin {
                SelfYield(false).await;
                continue;
            }
            if let Err(e) = shared.arm() {
                error!(error = %e, "arming the completion queue failed; falling back to polling");
                tokio::time::sleep(Duration::from_millis(1)).await;
                continue;
            }
            // Completions that arrived before the arm raise no event: poll once more.
            if seen(shared.drain(&mut reaped, &mut wake), &mut watched) {
                continue;
            }
        }
        // The timers this round needs (none in event mode): the earlier of the stale-spinner
        // check and the closing check.
        let timeout = match (watched_by_others, shared.closing.load(Ordering::Acquire)) {
            (true, _) => Some(STALE_SPIN_CHECK),
            (false, true) => Some(CLOSING_CHECK),
            (false, false) => None,
        };
        if let Some(d) = timeout {
            let at = tokio::time::Instant::now() + d;
            timer.as_mut().reset(at);
        }
        match wait(afd, &shared, timeout.map(|_| &mut timer)).await {
            Woken::Readable(guard) => {
                if shared.take_event(guard) {
                    if shared.mode == CompletionMode::Event && !shared.spinners.any() {
                        shared.rearm();
                    }
                    fresh = true;
                    if shared.drain(&mut reaped, &mut wake) == 0 {
                        // An event with no completions: normal (the arm/poll race, or a
                        // spinning future got there first), not an error.
                        shared.counters.empty_events.fetch_add(1, Ordering::Relaxed);
                    } else {
                        seen(1, &mut watched);
                    }
                }
            }
            Woken::Failed(e) => {
                error!(error = %e, "completion channel readiness failed");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Woken::Kicked => trace!("completion task notified"),
            // A closing queue pair may be waiting for a bound to pass (see `LAST_WQE_WAIT`),
            // or the futures that spin may have stopped polling: the loop looks.
            Woken::Timer => {}
        }
    }
    shared.cq.ack_events();
    debug!("completion task stopped");
}

/// What ended a wait of the completion task.
enum Woken<'a> {
    /// The completion channel's descriptor is readable: CQ events to read.
    Readable(AsyncFdReadyGuard<'a, ChannelFd>),
    /// Readiness failed.
    Failed(std::io::Error),
    /// [`Shared::notify`] was kicked (shutdown, a closing queue pair, the last spinner leaving,
    /// a future going to sleep, ...).
    Kicked,
    /// The round's timer fired.
    Timer,
}

/// Waits for the first of: a kick, the channel's readiness, `timer`. One hand-written future
/// that registers the task's waker with each source (the kick's slot, the descriptor's reader
/// slot, the timer) and keeps nothing on a waiter list: nothing to set up or tear down per
/// round, as `select!` over `Notify::notified()` and `AsyncFd::readable()` did (a list entry
/// joined and left under a lock, for each of the two, per CQ event).
///
/// # Cancel safety
///
/// Only awaited to completion by `run`: a kick is consumed only by the ready poll that
/// returns it, and readiness stays set until its guard clears it.
fn wait<'a>(
    afd: &'a AsyncFd<ChannelFd>,
    shared: &'a Shared,
    mut timer: Option<&'a mut Pin<Box<Sleep>>>,
) -> impl Future<Output = Woken<'a>> + 'a {
    std::future::poll_fn(move |cx| {
        if shared.notify.poll_kicked(cx).is_ready() {
            return Poll::Ready(Woken::Kicked);
        }
        // Under the driver's lock, which a watching future also registers under: while a
        // watch task watches, its futures hold the reader slot and this task leaves it to
        // them (taking it would leave them unwoken); otherwise it records that it holds it.
        {
            let mut st = shared.lock();
            if !st.watch.active() {
                match afd.poll_read_ready(cx) {
                    Poll::Ready(Ok(guard)) => return Poll::Ready(Woken::Readable(guard)),
                    Poll::Ready(Err(e)) => return Poll::Ready(Woken::Failed(e)),
                    Poll::Pending => st.watch.holder = Holder::Task,
                }
            }
        }
        if let Some(t) = timer.as_mut() {
            if t.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Woken::Timer);
            }
        }
        Poll::Pending
    })
}

/// Yields to the scheduler once by waking itself (no I/O-driver poll, unlike
/// `tokio::task::yield_now`).
struct SelfYield(bool);

impl std::future::Future for SelfYield {
    type Output = ();

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        if self.0 {
            return std::task::Poll::Ready(());
        }
        self.0 = true;
        cx.waker().wake_by_ref();
        std::task::Poll::Pending
    }
}

/// The count of rounds in a row that found nothing, after a round that found `found`
/// completions. Saturating: in event mode on a multi-thread runtime nearly every round finds
/// nothing, and a plain `+ 1` overflowed (a panic in debug builds, which stopped the driver)
/// after 2^32 rounds.
fn next_idle_rounds(idle: u32, found: usize) -> u32 {
    if found > 0 { 0 } else { idle.saturating_add(1) }
}

/// Shut down and nothing left in flight.
fn finished(shared: &Shared, reaped: &mut Vec<QpEntry>) -> bool {
    if !shared.shutdown.load(Ordering::Acquire) {
        return false;
    }
    let mut st = shared.lock();
    // Shutting down, the async-event task stops too: no last-WQE event will be read, so
    // queue pairs on a shared receive queue do not wait for one (whose bound is for numbers
    // reused while the driver lives).
    st.reap_closed(reaped, std::time::Instant::now() + LAST_WQE_WAIT);
    let idle = st.qps.iter().all(Option::is_none);
    drop(st);
    shared.release(reaped);
    idle
}

#[cfg(test)]
mod tests {
    use super::next_idle_rounds;

    #[test]
    fn the_idle_round_count_saturates_and_resets() {
        assert_eq!(next_idle_rounds(0, 0), 1);
        assert_eq!(next_idle_rounds(u32::MAX - 1, 0), u32::MAX);
        assert_eq!(
            next_idle_rounds(u32::MAX, 0),
            u32::MAX,
            "no overflow after 2^32 rounds"
        );
        assert_eq!(next_idle_rounds(u32::MAX, 3), 0);
    }
}
