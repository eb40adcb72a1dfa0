//! The async-event task: surfaces `IBV_EVENT_QP_FATAL`, CQ errors and device loss to the
//! affected queue pairs, whose operations then resolve with [`QpFailure::AsyncEvent`]. A port
//! error is only logged (see `AsyncEvent::is_fatal`).

use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Weak};

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tracing::{error, info, warn};

use super::shared::Shared;
use crate::core::{Completed, QpKey};
use crate::error::QpFailure;
use crate::verbs::{AsyncEvent, Context, EventElement};

/// Keeps the device context (and so its async-event descriptor) open while registered.
struct EventFd(Context);

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.async_fd().as_raw_fd()
    }
}

pub(crate) async fn run(ctx: Context, shared: Weak<Shared>) {
    if let Err(e) = ctx.set_async_nonblocking() {
        error!(error = %e, "async events unavailable");
        return;
    }
    // SAFETY: `EventFd` owns a context handle, so the descriptor stays open and the same for
    // the whole life of the AsyncFd.
    let afd = match unsafe {
        AsyncFd::register_with_interest(EventFd(ctx.clone()), Interest::READABLE)
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
    if !ev.is_fatal() {
        info!(event = ev.name, element = ?ev.element, "async event");
        return;
    }
    warn!(event = ev.name, element = ?ev.element, "fatal async event");
    let mut out = Completed::default();
    {
        let mut st = shared.lock();
        let victims: Vec<QpKey> = match ev.element {
            EventElement::Qp(qpn) => st
                .qps
                .iter()
                .enumerate()
                .filter(|(_, e)| e.as_ref().is_some_and(|e| e.qp.qpn() == qpn))
                .map(|(i, _)| QpKey::from_index(i))
                .collect(),
            // A CQ error or device loss affects every queue pair of this driver.
            _ => (0..st.qps.len())
                .filter(|&i| st.qps[i].is_some())
                .map(QpKey::from_index)
                .collect(),
        };
        for qp in victims {
            st.fail(qp, QpFailure::AsyncEvent(ev.name), &mut out);
            if ev.element == EventElement::Device {
                // No flush will come from a dead device, and it touches no memory any more.
                st.core.abandon_qp(qp, &mut out);
            }
        }
    }
    Shared::finish(&mut out);
    shared.notify.notify_one();
}
