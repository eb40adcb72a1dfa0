//! The driver task of one connection: does what the state machine asks (post receives, send
//! control messages), feeds it what happened (receive and control completions, deadlines,
//! RDMA CM events), and tears the connection down when it says so.
//!
//! It holds no protocol state of its own. Receives and control messages are submitted to the
//! queue pair while the state machine's lock is held, so what the state machine announces
//! (credits, ordering) is always already on the device.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::StreamExt;
use futures::stream::{FuturesOrdered, FuturesUnordered};
use tokio::time::Instant;
use tracing::{debug, trace, warn};

use super::cm_async::AsyncChannel;
use super::shared::ConnShared;
use crate::buf::{Acquire, PoolBuf};
use crate::core::MsgKind;
use crate::error::{Error, QpFailure, Result};
use crate::ops::{Recv, RecvInfo, Send};
use crate::verbs::{CmEventKind, CmId};

/// Longest the teardown waits for outstanding receives and sends to flush.
const DRAIN_LIMIT: Duration = Duration::from_secs(10);

type ControlOp = Pin<Box<dyn Future<Output = (MsgKind, Result<()>)> + std::marker::Send>>;

/// The failure an operation's error means for the connection.
pub(crate) fn failure_of(e: &Error) -> QpFailure {
    match e {
        Error::QpFailed(f) => f.clone(),
        _ => QpFailure::Flushed,
    }
}

/// Polls `op` once, which submits it (connection queue pairs post on first poll). Returns its
/// output if it resolved at once (the queue pair had failed).
pub(crate) fn submit<F: Future + Unpin>(op: &mut F) -> Option<F::Output> {
    let mut cx = Context::from_waker(futures::task::noop_waker_ref());
    match Pin::new(op).poll(&mut cx) {
        Poll::Ready(out) => Some(out),
        Poll::Pending => None,
    }
}

/// Receives posted on the device, in posting order (completions come in that order).
pub(crate) struct Posted {
    recvs: FuturesOrdered<Recv<PoolBuf>>,
}

impl Posted {
    pub(crate) fn new() -> Posted {
        Posted {
            recvs: FuturesOrdered::new(),
        }
    }

    /// Posts the receives the state machine asks for, as far as buffers allow; call with the
    /// state machine locked. Returns whether it ran short of buffers.
    pub(crate) fn post_due(&mut self, shared: &ConnShared, p: &mut super::shared::Proto) -> bool {
        let want = p.recvs_to_post();
        let size = shared.params.recv_buf_size as usize;
        let mut posted = 0;
        while posted < want {
            let Ok(Some(buf)) = shared.pool.try_acquire(size) else {
                break;
            };
            let mut op = shared.qp.recv(buf);
            if let Some((res, buf)) = submit(&mut op) {
                p.handle_recv(recv_outcome(res), buf);
                break;
            }
            self.recvs.push_back(op);
            posted += 1;
        }
        p.recvs_posted(posted);
        posted < want
    }
}

fn recv_outcome(res: Result<RecvInfo>) -> std::result::Result<(u32, Option<u32>), QpFailure> {
    res.map(|i| (i.len as u32, i.imm))
        .map_err(|e| failure_of(&e))
}

/// Runs the connection until it is torn down.
pub(crate) async fn run(
    shared: Arc<ConnShared>,
    mut posted: Posted,
    id: Arc<CmId>,
    events: AsyncChannel,
) {
    let mut controls: FuturesUnordered<ControlOp> = FuturesUnordered::new();
    let mut refill: Option<Pin<Box<Acquire>>> = None;
    let mut events_open = true;
    loop {
        let now = Instant::now();
        let (deadline, disconnect, short) = shared.with_driver(|p| {
            let short = posted.post_due(&shared, p);
            while let Some(t) = p.poll_transmit(now.into_std()) {
                trace!(kind = ?t.kind, imm = t.imm, "control message");
                let mut op: Send<Vec<u8>> = shared.qp.send_with_imm(Vec::new(), t.imm);
                let kind = t.kind;
                if let Some((res, _)) = submit(&mut op) {
                    p.handle_control_done(kind, res.map_err(|e| failure_of(&e)), now.into_std());
                    break;
                }
                controls.push(Box::pin(async move {
                    let (res, _) = op.await;
                    (kind, res)
                }));
            }
            (p.poll_timeout(), p.should_disconnect(), short)
        });
        if disconnect {
            break;
        }
        if short && refill.is_none() {
            // Every private buffer is in use (held by the application or in flight): wait for
            // one to come back, then post again.
            refill = Some(Box::pin(
                shared.pool.acquire(shared.params.recv_buf_size as usize),
            ));
        }
        let sleep = async {
            match deadline {
                Some(at) => tokio::time::sleep_until(Instant::from_std(at)).await,
                None => futures::future::pending().await,
            }
        };
        tokio::select! {
            Some((res, buf)) = posted.recvs.next(), if !posted.recvs.is_empty() => {
                let now = Instant::now().into_std();
                shared.with_driver(|p| {
                    if res.is_ok() {
                        p.heard(now);
                    }
                    p.handle_recv(recv_outcome(res), buf);
                });
            }
            Some((kind, res)) = controls.next(), if !controls.is_empty() => {
                if let Err(e) = &res {
                    debug!(?kind, error = %e, "control message failed");
                }
                let now = Instant::now().into_std();
                shared.with_driver(|p| p.handle_control_done(kind, res.map_err(|e| failure_of(&e)), now));
            }
            () = sleep => {
                let now = Instant::now().into_std();
                shared.with_driver(|p| p.handle_timeout(now));
            }
            () = shared.kick.notified() => {}
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
                        debug!("peer disconnected");
                        shared.qp.force_error(QpFailure::Disconnected);
                        if posted.recvs.is_empty() {
                            // No receive will flush to carry the news.
                            shared.with_driver(|p| p.fail(QpFailure::Disconnected));
                        }
                        events_open = false;
                    }
                    CmEventKind::DeviceRemoval => {
                        warn!("device removed");
                        shared.with_driver(|p| p.fail(QpFailure::AsyncEvent("RDMA_CM_EVENT_DEVICE_REMOVAL")));
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
    teardown(&shared, posted, controls, &id, &events).await;
}

/// Disconnects, moves the queue pair to the error state, and waits (bounded) until every
/// receive and control send has flushed, so their buffers are free again.
async fn teardown(
    shared: &ConnShared,
    mut posted: Posted,
    mut controls: FuturesUnordered<ControlOp>,
    id: &CmId,
    events: &AsyncChannel,
) {
    let cause = shared.with_driver(|p| {
        p.fail(QpFailure::Closed);
        p.failure().cloned()
    });
    debug!(?cause, "connection torn down");
    if let Err(e) = id.disconnect() {
        trace!(error = %e, "rdma_disconnect");
    }
    let drained = tokio::time::timeout(DRAIN_LIMIT, async {
        let qp_closed = shared.qp.close();
        tokio::pin!(qp_closed);
        let _ = (&mut qp_closed).await;
        while let Some((res, buf)) = posted.recvs.next().await {
            shared.with_driver(|p| p.handle_recv(recv_outcome(res), buf));
        }
        while controls.next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        warn!("outstanding work requests did not flush within {DRAIN_LIMIT:?}");
    }
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
