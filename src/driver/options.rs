//! The driver's public options and counters: [`CompletionMode`], [`DriverOptions`],
//! [`QpOptions`] and [`DriverStats`].

use std::time::Duration;

use crate::error::{InvalidArgument, ModeMismatch};
use crate::verbs::QpCaps;

/// How a future waits for its completion (see `docs/architecture.md`, "Waiting").
///
/// In every mode a waiting future first polls the completion queue itself; the modes differ
/// in what it does when its completion is not there yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CompletionMode {
    /// Sleep at once; the completion task arms the CQ and wakes the future from the
    /// completion event: least CPU, an interrupt and a task wake per completion.
    Event,
    /// Keep polling (yielding to the runtime between polls) until the completion arrives:
    /// lowest latency; keeps a worker busy while operations are outstanding.
    ///
    /// On a current-thread runtime, spin in a spawned task rather than in the future given to
    /// `block_on` (a `#[tokio::main(flavor = "current_thread")]` body): each yield of that
    /// future makes the runtime poll its I/O driver (an `epoll_wait`), where a spawned task
    /// that yields just goes back on the run queue (`send_lat` 2 B busy on soft-RoCE: 21.1
    /// against 19.5 µs median; docs/architecture.md, "Waiting").
    BusyPoll,
    /// Hybrid polling (the default): spin for about twice the moving average of observed
    /// completion latency, or up to its estimated 99th percentile where waits scatter (at
    /// least a few microseconds, at most `max_spin`), then sleep as in `Event`; when the
    /// average exceeds `max_spin` (a slow peer), sleep at once.
    Adaptive {
        /// The longest a future spins before sleeping (default 2 ms: spinning pays while a
        /// wait is shorter than an event's wake-up, which on soft-RoCE under emulation costs
        /// 300-1,000 µs for a round trip whose two sides sleep; on hardware the averages, and
        /// so the spins, are far shorter). A cap below the wake-up cost traps a ping-pong in
        /// sleeping: each side's slept waits include its wake-up, keep its average above the
        /// cap, and it sleeps at once; with 500 µs, `msg_lat` 64 B ran at 220-370 µs median
        /// half round trip in about half the runs (20 µs in the others), with 2 ms at 19-21
        /// µs in all (docs/benchmarks-speed-2.md). Lower it where CPU matters more than latency for
        /// waits between the average and the cap.
        max_spin: Duration,
    },
}

impl Default for CompletionMode {
    fn default() -> Self {
        CompletionMode::Adaptive {
            max_spin: Duration::from_millis(2),
        }
    }
}

impl CompletionMode {
    /// Refuses an adaptive `max_spin` above one second (a wait would hold its worker that long
    /// before it sleeps).
    pub(crate) fn check(&self) -> Result<(), InvalidArgument> {
        if let CompletionMode::Adaptive { max_spin } = *self {
            if max_spin > Duration::from_secs(1) {
                return Err(InvalidArgument::AdaptiveSpinTooLong { max_spin });
            }
        }
        Ok(())
    }

    /// Why connection options asking for this mode are refused on an endpoint whose mode is
    /// `endpoint`. The error layer sits below the driver, so it carries each mode as its name
    /// and `max_spin` (and prints them as `Debug` does).
    pub(crate) fn mismatch(self, endpoint: CompletionMode) -> InvalidArgument {
        let parts = |m: CompletionMode| match m {
            CompletionMode::Event => ("Event", None),
            CompletionMode::BusyPoll => ("BusyPoll", None),
            CompletionMode::Adaptive { max_spin } => ("Adaptive", Some(max_spin)),
        };
        let ((requested, requested_max_spin), (endpoint, endpoint_max_spin)) =
            (parts(self), parts(endpoint));
        InvalidArgument::CompletionModeMismatch(Box::new(ModeMismatch {
            requested,
            requested_max_spin,
            endpoint,
            endpoint_max_spin,
        }))
    }
}

/// Options of a [`Driver`](super::Driver).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct DriverOptions {
    /// Completion queue entries: bounds the sum of the queue depths of all queue pairs.
    pub cq_size: u32,
    /// How the completion task waits.
    pub mode: CompletionMode,
    /// Completions polled per `ibv_poll_cq` call (1..=4096).
    pub poll_batch: usize,
}

impl Default for DriverOptions {
    fn default() -> Self {
        DriverOptions {
            cq_size: 4096,
            mode: CompletionMode::default(),
            poll_batch: 32,
        }
    }
}

impl DriverOptions {
    /// Refuses a batch of 0 or above 4096 and an adaptive `max_spin` above one second (the
    /// checks [`Driver::new`](super::Driver::new) and `EndpointOptions` share).
    pub(crate) fn check(&self) -> Result<(), InvalidArgument> {
        if self.poll_batch == 0 || self.poll_batch > 4096 {
            return Err(InvalidArgument::PollBatchOutOfRange {
                poll_batch: self.poll_batch,
            });
        }
        self.mode.check()
    }

    /// Sets the completion mode.
    pub fn mode(mut self, mode: CompletionMode) -> Self {
        self.mode = mode;
        self
    }

    /// Sets the completion queue size.
    pub fn cq_size(mut self, n: u32) -> Self {
        self.cq_size = n;
        self
    }

    /// Sets how many completions one poll takes.
    pub fn poll_batch(mut self, n: usize) -> Self {
        self.poll_batch = n;
        self
    }
}

/// Options of an [`AsyncQp`](super::AsyncQp).
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct QpOptions {
    /// Queue sizes (the device may grant more).
    pub caps: QpCaps,
    /// Request a completion every this many sends (1: every send). The last send of every
    /// post batch is always signaled.
    pub signal_every: u32,
    /// Defer posting to the next poll so that operations started in the same wake are posted
    /// together (one doorbell). Off: every operation is posted on its first poll.
    pub coalesce: bool,
    /// Send payloads up to the queue pair's `max_inline_data` inline.
    pub inline: bool,
    /// Send-queue entries the owner posts itself (a connection's message sends), kept out of
    /// the operation table's depth.
    pub(crate) sink_sends: u32,
}

impl Default for QpOptions {
    fn default() -> Self {
        QpOptions {
            caps: QpCaps {
                max_send_wr: 256,
                max_recv_wr: 256,
                max_send_sge: 4,
                max_recv_sge: 4,
                max_inline_data: 64,
            },
            signal_every: 16,
            coalesce: true,
            inline: true,
            sink_sends: 0,
        }
    }
}

/// Counters of a driver's completion machinery.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DriverStats {
    /// Work completions polled.
    pub completions: u64,
    /// CQ events read from the channel.
    pub cq_events: u64,
    /// CQ events after which the CQ turned out empty (normal; counts the arm/poll race).
    pub empty_events: u64,
    /// `ibv_poll_cq` calls.
    pub polls: u64,
    /// `ibv_post_send`/`ibv_post_recv` calls.
    pub doorbells: u64,
    /// Work requests posted.
    pub posted: u64,
    /// Completions that matched no operation.
    pub unknown: u64,
    /// Times a waiting future polled the CQ itself.
    pub polled_in_place: u64,
    /// Times the completion task armed the CQ for an event.
    pub arms: u64,
    /// Times the completion task ran (woken by a CQ event, a notification, its timer or its
    /// own yield). On a multi-thread runtime each is a wake-up of the worker it runs on: a
    /// busy-path cost that the in-place polling of waiting futures exists to avoid.
    pub task_wakeups: u64,
    /// Operations in the table now.
    pub ops_in_table: u64,
    /// Queue pairs registered with the driver, closing ones included (a dropped queue pair
    /// leaves once the device can produce no more completions for it).
    pub queue_pairs: u64,
    /// `IBV_EVENT_QP_LAST_WQE_REACHED` events for this driver's queue pairs on a shared
    /// receive queue (one closing is destroyed only after its event, or see
    /// [`last_wqe_timeouts`](Self::last_wqe_timeouts)).
    pub last_wqe_reached: u64,
    /// Queue pairs on a shared receive queue destroyed without that event, 2 s after they
    /// started closing (a provider that does not send it: soft-RoCE before Linux 6.5).
    pub last_wqe_timeouts: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_options_outside_their_ranges_are_refused() {
        let ok = DriverOptions::default();
        assert!(ok.check().is_ok());
        for n in [0, 4097, usize::MAX] {
            assert_eq!(
                ok.clone().poll_batch(n).check(),
                Err(InvalidArgument::PollBatchOutOfRange { poll_batch: n })
            );
        }
        let max_spin = Duration::MAX;
        assert_eq!(
            ok.mode(CompletionMode::Adaptive { max_spin }).check(),
            Err(InvalidArgument::AdaptiveSpinTooLong { max_spin })
        );
    }
}
