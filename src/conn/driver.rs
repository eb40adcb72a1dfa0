//! The driver task of one connection: timers, RDMA CM events, refills and teardown. It is
//! not on the message path (the connection's completions go straight into its state machine,
//! see `io/`); it is woken only when the state machine has a deadline earlier than the one
//! it sleeps until, ran out of receive buffers, or wants to disconnect.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tracing::{debug, trace, warn};

use super::cm_async::AsyncChannel;
use super::shared::ConnShared;
use crate::buf::Acquire;
use crate::error::QpFailure;
use crate::verbs::{CmEventKind, CmId};

/// Longest the teardown waits for outstanding receives and sends to flush.
const DRAIN_LIMIT: Duration = Duration::from_secs(10);
/// The teardown stops waiting once the flushes made no progress for this long: soft-RoCE's
/// flush of a failed queue pair can stop one request short, and no later completion comes
/// (the queue pair is in the error state: what is left goes back to the pools).
const STALL_LIMIT: Duration = Duration::from_secs(1);

/// Runs the connection until it is torn down.
pub(crate) async fn run(shared: Arc<ConnShared>, id: Arc<CmId>, events: AsyncChannel) {
    let _gone = TaskGone(shared.clone());
    let io = &shared.io;
    let mut refill: Option<std::pin::Pin<Box<Acquire>>> = None;
    let mut events_open = true;
    loop {
        let (deadline, disconnect, short) = io.with(|s| {
            let deadline = s.proto.poll_timeout();
            s.driver_deadline = deadline;
            (deadline, s.proto.disconnect_reason(), s.short)
        });
        if let Some(reason) = disconnect {
            debug!(qpn = shared.qp.qpn(), reason, "disconnect due");
            break;
        }
        if short && refill.is_none() {
            // Every private buffer is in use (held by the application or in flight): wait for
            // one to come back, then post again.
            refill = Some(Box::pin(io.pool().acquire(io.recv_size())));
        }
        let sleep = async {
            match deadline {
                Some(at) => tokio::time::sleep_until(Instant::from_std(at)).await,
                None => futures::future::pending().await,
            }
        };
        tokio::select! {
            () = sleep => {
                let now = Instant::now().into_std();
                io.with(|s| s.proto.handle_timeout(now));
            }
            () = io.kick.notified() => {}
            buf = async { refill.as_mut().expect("set").await }, if refill.is_some() => {
                refill = None;
                // Back to the pool at once; the next round posts from it.
                drop(buf);
            }
            ev = events.next(), if events_open => match ev {
                Ok(ev) => match ev.kind() {
                    CmEventKind::Disconnected => {
                        // Messages that arrived before the disconnect are still in the
                        // completion queue: fail the queue pair with the cause and let its
                        // receives complete in order (successful ones first, then flushes).
                        debug!(qpn = shared.qp.qpn(), "peer disconnected (RDMA CM)");
                        io.with(|s| s.in_error = true);
                        shared.qp.force_error(QpFailure::Disconnected);
                        // What is already in the completion queue arrived before the
                        // disconnect (the peer's end of stream among it): apply it first. On a
                        // shared receive queue nothing of this connection may be left to flush
                        // and carry it after the failure below.
                        for _ in 0..64 {
                            if shared.qp.poll_completions() == 0 {
                                break;
                            }
                        }
                        // Completions the queue pair still has (then its flushes) carry the news;
                        // with nothing posted, tell the state machine directly.
                        io.with(|s| {
                            if super::io::ConnIo::outstanding(s) == 0 {
                                s.proto.fail(QpFailure::Disconnected);
                            }
                        });
                        events_open = false;
                    }
                    CmEventKind::DeviceRemoval => {
                        warn!("device removed");
                        io.with(|s| s.proto.fail(QpFailure::AsyncEvent("RDMA_CM_EVENT_DEVICE_REMOVAL")));
                    }
                    other => debug!(event = %other, "CM event"),
                },
                Err(e) => {
                    warn!(error = %e, "CM event channel failed");
                    events_open = false;
                }
            },
        }
    }
    teardown(&shared, &id, &events).await;
    // `rdma_destroy_id` waits in the kernel for the id's CM work (under load on soft-RoCE:
    // up to seconds). On a runtime worker it would hold up every task woken onto that
    // worker (a `close()` the teardown just resolved among them: tokio does not steal a
    // worker's next task). `CmId`'s drop hands the destruction (and the channel it keeps
    // alive until then) to the blocking pool itself, so dropping both here does not block.
    debug!("connection task done; its RDMA CM id goes to the blocking pool");
    drop(id);
    drop(events);
}

/// Disconnects, moves the queue pair to the error state, and waits (bounded) until every
/// receive and send has flushed, so their buffers are free again.
/// At most this many CQ polls pick up a closing connection's last shared receives (see
/// `teardown`).
const SRQ_FINAL_POLLS: usize = 64;

async fn teardown(shared: &ConnShared, id: &CmId, events: &AsyncChannel) {
    let io = &shared.io;
    // How it ended, before the failure below (an event if it failed).
    let (ending, failure) = super::lifecycle::teardown_started(shared);
    let cause = io.with(|s| {
        s.proto.fail(QpFailure::Closed);
        s.draining = true;
        s.in_error = true;
        s.proto.failure().cloned()
    });
    debug!(qpn = shared.qp.qpn(), ?cause, "connection torn down");
    if let Err(e) = id.disconnect() {
        trace!(error = %e, "rdma_disconnect");
    }
    // Everything posted now flushes; the marker's flush retires sends that completed
    // unsignaled (they raise no completion of their own).
    shared.qp.force_error(QpFailure::Closed);
    io.post_drain_marker();
    let started = Instant::now();
    let drained = async {
        let qp_closed = shared.qp.close();
        tokio::pin!(qp_closed);
        // The table's requests (if any) flush first; bounded like the rest.
        let _ = tokio::time::timeout(DRAIN_LIMIT, &mut qp_closed).await;
        let mut last = (usize::MAX, Instant::now());
        loop {
            let notified = io.drained.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let left = super::io::ConnIo::outstanding(&io.lock());
            if left == 0 {
                return true;
            }
            // Nobody else may be polling: make sure the flushes are applied.
            shared.qp.poll_completions();
            let left = super::io::ConnIo::outstanding(&io.lock());
            if left == 0 {
                return true;
            }
            let now = Instant::now();
            if left < last.0 {
                last = (left, now);
            } else if now - last.1 >= STALL_LIMIT || now - started >= DRAIN_LIMIT {
                return false;
            }
            let _ = tokio::time::timeout(Duration::from_millis(50), notified).await;
        }
    }
    .await;
    debug!(
        qpn = shared.qp.qpn(),
        drained,
        waited = ?started.elapsed(),
        "teardown: drain over"
    );
    if !drained {
        let (recvs, sends) = io.abandon_unflushed();
        warn!(
            recvs,
            sends,
            waited = ?started.elapsed(),
            "work requests did not flush (no progress for {STALL_LIMIT:?}, or {DRAIN_LIMIT:?} in \
             all); the queue pair is in the error state (it processes nothing): their buffers \
             are released"
        );
    }
    // Receives this queue pair took from the shared receive queue before it entered the
    // error state may still sit in the CQ, unpolled (the drain above counts only the
    // connection's own requests, and a future whose operation completed no longer wakes the
    // completion task): poll them in now, so each reaches this connection rather than
    // arriving after its claim is gone (an orphan). Bounded: on a CQ other connections keep
    // busy a poll may always find something.
    if io.with(|s| s.srq.is_some()) {
        for _ in 0..SRQ_FINAL_POLLS {
            if shared.qp.poll_completions() == 0 {
                break;
            }
        }
    }
    // The queue pair is in the error state and consumes no more shared receives: give the
    // claim on the shared receive queue back. Nothing can read this side's rendezvous
    // messages any more: their registrations go (outside the lock), whoever still holds the
    // connection.
    drop(io.with(|s| {
        for (_, src) in s.rdv_held.drain(..) {
            io.retire(super::io::Retired::Rendezvous(src));
        }
        s.srq.take()
    }));
    io.torn_down
        .store(true, std::sync::atomic::Ordering::Release);
    io.done.notify_waiters();
    super::lifecycle::torn_down(shared, ending, failure.as_ref(), drained);
    // Consume the CM events that follow a disconnect (TIMEWAIT_EXIT) so the id can go.
    let _ = tokio::time::timeout(Duration::from_millis(100), async {
        while let Ok(ev) = events.next().await {
            if ev.kind() == CmEventKind::TimewaitExit {
                break;
            }
        }
    })
    .await;
}

/// Held by the connection's task. Dropped before the teardown finished, the task was dropped
/// with its runtime: nothing will run the timers, the CM events or the teardown any more. The
/// connection fails with [`QpFailure::DriverStopped`] (every waiter wakes with it) and counts
/// as torn down, so `close()` returns instead of waiting for a task that is gone; its buffers
/// are released when the connection is dropped.
struct TaskGone(Arc<ConnShared>);

impl Drop for TaskGone {
    fn drop(&mut self) {
        let io = &self.0.io;
        if io.torn_down.load(std::sync::atomic::Ordering::Acquire) {
            return;
        }
        debug!("connection task dropped before its teardown (runtime shut down)");
        io.with(|s| s.proto.fail(QpFailure::DriverStopped));
        let (ending, failure) = super::lifecycle::teardown_started(&self.0);
        super::lifecycle::torn_down(&self.0, ending, failure.as_ref(), false);
        self.0.qp.force_error(QpFailure::DriverStopped);
        io.torn_down
            .store(true, std::sync::atomic::Ordering::Release);
        io.done.notify_waiters();
    }
}
