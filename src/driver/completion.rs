//! The completion task: turns work completions into woken futures.
//!
//! One task per completion queue. In event mode it waits on the completion channel's
//! descriptor through `AsyncFd`; after every event it reads (and, in batches, acknowledges) the
//! CQ events, polls the CQ in batches until it is empty, re-arms, and polls once more (a
//! completion that arrives between the last poll and the arm raises no event). Wakers are woken
//! after the core's lock is released.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tracing::{debug, error, trace, warn};

use super::CompletionMode;
use super::shared::{Payload, QpEntry, Shared};
use crate::core::{Completed, Cqe};
use crate::verbs::{CompletionChannel, WcBatch};

/// Acknowledge CQ events once this many are pending (one `ibv_ack_cq_events` for all).
const ACK_BATCH: u32 = 32;

/// Keeps the completion channel (and so its descriptor) open while registered.
struct ChannelFd(CompletionChannel);

impl AsRawFd for ChannelFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

pub(crate) async fn run(shared: Arc<Shared>, mode: CompletionMode, batch_size: usize) {
    let channel = shared
        .cq
        .channel()
        .expect("driver CQs have a channel")
        .clone();
    // SAFETY: `ChannelFd` owns a handle of the channel, so the descriptor stays open and the
    // same for the whole life of the AsyncFd.
    let afd = match unsafe {
        AsyncFd::register_with_interest(ChannelFd(channel), Interest::READABLE)
    } {
        Ok(afd) => afd,
        Err(e) => {
            error!(error = %std::io::Error::from(e), "cannot register the completion channel with the reactor");
            return;
        }
    };
    let mut poller = Poller {
        shared: &shared,
        batch: WcBatch::with_capacity(batch_size),
        out: Completed::default(),
        reaped: Vec::new(),
    };
    let mut last_activity = Instant::now();
    loop {
        let n = poller.drain();
        if n > 0 {
            last_activity = Instant::now();
        }
        if poller.finished() {
            break;
        }
        let spin = match mode {
            CompletionMode::BusyPoll => true,
            CompletionMode::Adaptive { spin } => last_activity.elapsed() < spin,
            CompletionMode::Event => false,
        };
        if spin {
            // Let the woken operations run, then poll again. A self-wake keeps the task in the
            // run queue without making the runtime poll its I/O driver (an `epoll_wait`) on
            // every round, as `tokio::task::yield_now` would.
            SelfYield(false).await;
            continue;
        }
        if let Err(e) = shared.cq.req_notify(false) {
            error!(error = %e, "arming the completion queue failed; falling back to polling");
            tokio::time::sleep(Duration::from_millis(1)).await;
            continue;
        }
        // Completions that arrived before the arm raise no event: poll once more.
        if poller.drain() > 0 {
            last_activity = Instant::now();
            continue;
        }
        tokio::select! {
            ready = afd.readable() => match ready {
                Ok(mut guard) => {
                    let mut events = 0u64;
                    loop {
                        match shared.cq.get_event() {
                            Ok(true) => events += 1,
                            Ok(false) => {
                                guard.clear_ready();
                                break;
                            }
                            Err(e) => {
                                warn!(error = %e, "reading a CQ event failed");
                                guard.clear_ready();
                                break;
                            }
                        }
                    }
                    shared.counters.cq_events.fetch_add(events, Ordering::Relaxed);
                    if poller.drain() == 0 && events > 0 {
                        // An event with no completions: normal (the arm/poll race), not an error.
                        shared.counters.empty_events.fetch_add(1, Ordering::Relaxed);
                    } else {
                        last_activity = Instant::now();
                    }
                    if shared.cq.unacked_events() >= ACK_BATCH {
                        shared.cq.ack_events();
                    }
                }
                Err(e) => {
                    error!(error = %e, "completion channel readiness failed");
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            },
            () = shared.notify.notified() => trace!("completion task notified"),
        }
    }
    shared.cq.ack_events();
    debug!("completion task stopped");
}

/// Yields to the scheduler once by waking itself.
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

struct Poller<'a> {
    shared: &'a Shared,
    batch: WcBatch,
    out: Completed<Payload>,
    reaped: Vec<QpEntry>,
}

impl Poller<'_> {
    /// Polls until the CQ is empty, applying every completion. Returns how many there were.
    fn drain(&mut self) -> usize {
        let shared = self.shared;
        let mut total = 0;
        loop {
            shared.counters.polls.fetch_add(1, Ordering::Relaxed);
            let wcs = match shared.cq.poll(&mut self.batch) {
                Ok(wcs) => wcs,
                Err(e) => {
                    error!(error = %e, "polling the completion queue failed");
                    break;
                }
            };
            let n = wcs.len();
            if n == 0 {
                // An empty poll touches nothing else: no lock, no wakeups (the spin loop runs
                // this path most of the time). Closing queue pairs are reaped separately.
                self.reap_if_closing();
                break;
            }
            {
                let mut st = shared.lock();
                for wc in wcs {
                    if !wc.is_success() {
                        debug!(wr_id = wc.wr_id(), qpn = wc.qp_num(), status = %wc.status(), "work completion error");
                    }
                    st.core.complete(&Cqe::from(wc), &mut self.out);
                }
                for qp in std::mem::take(&mut self.out.postable) {
                    st.post(shared, qp, &mut self.out);
                }
                st.apply_failures(&mut self.out);
                if shared.closing.load(Ordering::Acquire) {
                    st.reap_closed(&mut self.reaped);
                }
            }
            if self.out.unknown > 0 {
                warn!(
                    count = self.out.unknown,
                    "completions that match no operation were ignored"
                );
                shared
                    .counters
                    .unknown
                    .fetch_add(self.out.unknown, Ordering::Relaxed);
                self.out.unknown = 0;
            }
            Shared::finish(&mut self.out);
            shared.drained.notify_waiters();
            // Destroy reaped queue pairs outside the lock.
            if !self.reaped.is_empty() {
                shared.release(&mut self.reaped);
            }
            total += n;
            shared
                .counters
                .completions
                .fetch_add(n as u64, Ordering::Relaxed);
            if n < self.batch.capacity() {
                break;
            }
        }
        total
    }

    /// Reaps drained closing queue pairs (only when some queue pair is closing).
    fn reap_if_closing(&mut self) {
        let shared = self.shared;
        if !shared.closing.load(Ordering::Acquire) {
            return;
        }
        {
            let mut st = shared.lock();
            st.reap_closed(&mut self.reaped);
            if !st.qps.iter().flatten().any(|e| e.closing) {
                shared.closing.store(false, Ordering::Release);
            }
        }
        shared.drained.notify_waiters();
        if !self.reaped.is_empty() {
            shared.release(&mut self.reaped);
        }
    }

    /// Shut down and nothing left in flight.
    fn finished(&mut self) -> bool {
        if !self.shared.shutdown.load(Ordering::Acquire) {
            return false;
        }
        let mut st = self.shared.lock();
        st.reap_closed(&mut self.reaped);
        let idle = st.qps.iter().all(Option::is_none);
        drop(st);
        self.shared.release(&mut self.reaped);
        idle
    }
}
