//! The async-event task: surfaces `IBV_EVENT_QP_FATAL`, CQ errors and device loss to the
//! affected queue pairs, whose operations then resolve with [`QpFailure::AsyncEvent`]. A port
//! error is only logged (see `AsyncEvent::is_fatal`).

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Weak};

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tracing::{debug, error, info, warn};

use super::deferred::Deferred;
use super::shared::Shared;
use crate::error::QpFailure;
use crate::proto::QpKey;
use crate::verbs::{AsyncEvent, Context, EventElement};

/// A duplicate of the context's async-event descriptor, registered with the reactor (several
/// endpoints on one device each register their own duplicate; the reactor refuses the same
/// descriptor twice). The context handle keeps the original open.
struct EventFd(#[allow(dead_code)] Context, OwnedFd);

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.1.as_raw_fd()
    }
}

pub(crate) async fn run(ctx: Context, shared: Weak<Shared>) {
    if let Err(e) = ctx.set_async_nonblocking() {
        error!(error = %e, "async events unavailable");
        return;
    }
    let dup = match ctx.async_fd().try_clone_to_owned() {
        Ok(fd) => fd,
        Err(e) => {
            error!(error = %e, "cannot duplicate the async event descriptor");
            return;
        }
    };
    // SAFETY: `EventFd` owns the duplicate descriptor, so it stays open and the same for the
    // whole life of the AsyncFd.
    let afd = match unsafe {
        AsyncFd::register_with_interest(EventFd(ctx.clone(), dup), Interest::READABLE)
    } {
        Ok(afd) => afd,
        Err(e) => {
            error!(error = %std::io::Error::from(e), "cannot register the async event descriptor");
            return;
        }
    };
    loop {
        let Some(strong) = shared.upgrade() else {
            return;
        };
        let stop = async {
            while !strong.shutdown.load(std::sync::atomic::Ordering::Acquire) {
                strong.notify_events.notified().await;
            }
        };
        tokio::select! {
            ready = afd.readable() => {
                let mut guard = match ready {
                    Ok(g) => g,
                    Err(e) => {
                        error!(error = %e, "async event readiness failed");
                        return;
                    }
                };
                loop {
                    match ctx.get_async_event() {
                        Ok(Some(ev)) => dispatch(&strong, &ev),
                        Ok(None) => {
                            guard.clear_ready();
                            break;
                        }
                        Err(e) => {
                            warn!(error = %e, "reading an async event failed");
                            guard.clear_ready();
                            break;
                        }
                    }
                }
            }
            () = stop => return,
        }
    }
}

fn dispatch(shared: &Arc<Shared>, ev: &AsyncEvent) {
    if ev.is_last_wqe_reached() {
        last_wqe_reached(shared, ev);
        return;
    }
    if !ev.is_fatal() {
        if let EventElement::Srq(_) = ev.element {
            // SRQ_LIMIT_REACHED: its owner refills and re-arms.
            debug!(event = ev.name, "shared receive queue limit reached");
            shared.srq_limit.notify_one();
            return;
        }
        info!(event = ev.name, element = ?ev.element, "async event");
        return;
    }
    warn!(event = ev.name, element = ?ev.element, "fatal async event");
    let mut wake = Deferred::default();
    {
        let mut st = shared.lock();
        let victims: Vec<QpKey> = match ev.element {
            EventElement::Qp(qpn) => st
                .qps
                .iter()
                .flatten()
                .filter(|e| e.qp.qpn() == qpn)
                .map(|e| e.key)
                .collect(),
            // A CQ error concerns the queue pairs of that CQ: this driver's only if it is ours
            // (several endpoints on one device share its events).
            EventElement::Cq(id) if id != shared.cq.id() => Vec::new(),
            // A shared receive queue's error: the queue pairs attached to it.
            EventElement::Srq(id) => st
                .qps
                .iter()
                .flatten()
                .filter(|e| e.qp.srq().is_some_and(|q| q.id() == id))
                .map(|e| e.key)
                .collect(),
            // Our CQ, or the device lost: every queue pair of this driver.
            _ => st.qps.iter().flatten().map(|e| e.key).collect(),
        };
        for qp in victims {
            st.fail(qp, QpFailure::AsyncEvent(ev.name), &mut wake);
            if ev.element == EventElement::Device {
                // No flush will come from a dead device, and it touches no memory any more.
                let mut out = std::mem::take(&mut st.out);
                st.core.abandon_qp(qp, &mut out);
                wake.take_from(&mut out);
                st.out = out;
            }
        }
    }
    wake.run();
    shared.notify.notify_one();
}

/// `IBV_EVENT_QP_LAST_WQE_REACHED`: the queue pair (in the error state, on a shared receive
/// queue) takes no more receives from the queue and has none still to complete: once closing,
/// it may be destroyed and its number reused (`State::reap_closed`).
fn last_wqe_reached(shared: &Arc<Shared>, ev: &AsyncEvent) {
    let EventElement::Qp(qpn) = ev.element else {
        return;
    };
    let found = {
        let mut st = shared.lock();
        let key = st.by_qpn.get(&qpn).copied();
        match key.and_then(|k| st.entry_mut(k)) {
            Some(e) => {
                e.last_wqe = true;
                true
            }
            None => false,
        }
    };
    if found {
        debug!(qpn, "last WQE reached");
        shared
            .counters
            .last_wqe_reached
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // The completion task reaps it if it is closing.
        shared.notify.notify_one();
    } else {
        debug!(
            qpn,
            "last WQE reached for a queue pair this driver does not have"
        );
    }
}
