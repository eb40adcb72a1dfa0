//! Operations as futures, one file per kind. Each takes its buffers by value and resolves to
//! `(Result<T>, B)`: the buffers always come back, success or failure.
//!
//! Every operation is built on one internal engine (`RawOp`), which implements the common rules:
//!
//! * **post on first poll**: constructing the future does nothing; a future that is never polled
//!   posts nothing and simply drops its buffers;
//! * **ownership in flight**: on first poll the buffers move into the driver's operation table,
//!   so dropping (or `mem::forget`ting) the future cannot free memory the device still uses;
//!   a dropped future's buffers are released when the completion arrives;
//! * **coalescing**: with [`QpOptions::coalesce`](crate::driver::QpOptions::coalesce) the first
//!   poll queues the request and yields once, so requests started in the same wake are posted
//!   as one chained list (one doorbell);
//! * **backpressure**: a full send queue makes the future wait, it is not an error.

mod atomic;
mod read;
mod recv;
mod send;
mod sg;
mod write;

use std::any::Any;
use std::sync::Arc;
use std::task::{Context, Poll};

pub use atomic::{CompareSwap, FetchAdd};
pub use read::Read;
pub use recv::{Recv, RecvInfo};
pub use send::Send;
pub use sg::{BufList, SgSource, SgTarget};
pub use write::Write;

use crate::core::{Completed, OpInfo, QpKey, WorkRequest};
use crate::driver::Shared;
use crate::error::{Error, Result};
use crate::verbs::QpCaps;

/// What every operation of one queue pair needs to know.
#[derive(Debug, Clone)]
pub(crate) struct OpConfig {
    pub(crate) shared: Arc<Shared>,
    pub(crate) qp: QpKey,
    pub(crate) caps: QpCaps,
    pub(crate) coalesce: bool,
    pub(crate) inline: bool,
}

/// The buffers an operation parks in the table.
struct Parked<B> {
    buf: B,
}

#[derive(Debug)]
enum RawState<B> {
    /// Not polled yet: nothing is posted.
    Init { buf: B, wr: WorkRequest },
    /// Rejected before posting; reported on first poll.
    Invalid { buf: B, err: Error },
    /// In the table (queued or posted). `flushed`: this future already asked for a post.
    InTable { wr_id: u64, flushed: bool },
    /// Resolved.
    Done,
}

/// The engine shared by all operation futures.
#[derive(Debug)]
pub(crate) struct RawOp<B: std::marker::Send + 'static> {
    cfg: OpConfig,
    state: RawState<B>,
}

impl<B: std::marker::Send + 'static> RawOp<B> {
    pub(crate) fn new(cfg: &OpConfig, buf: B, wr: Result<WorkRequest>) -> RawOp<B> {
        let state = match wr {
            Ok(wr) => RawState::Init { buf, wr },
            Err(err) => RawState::Invalid { buf, err },
        };
        RawOp {
            cfg: cfg.clone(),
            state,
        }
    }

    /// Drives the operation; on completion returns its outcome and the buffers.
    pub(crate) fn poll_raw(&mut self, cx: &mut Context<'_>) -> Poll<(Result<OpInfo>, B)> {
        // Split borrows: the shared state is borrowed (not cloned) while `state` changes.
        let RawOp { cfg, state } = self;
        let shared: &Shared = &cfg.shared;
        let qp = cfg.qp;
        let mut out = Completed::default();
        let result = match std::mem::replace(state, RawState::Done) {
            RawState::Done => panic!("operation future polled after completion"),
            RawState::Invalid { buf, err } => Poll::Ready((Err(err), buf)),
            RawState::Init { buf, wr } => {
                let mut st = shared.lock();
                let payload: Box<dyn Any + std::marker::Send> = Box::new(Parked { buf });
                match st.core.submit(qp, wr, payload) {
                    Err((err, payload)) => {
                        drop(st);
                        Poll::Ready((Err(err), unpark(payload)))
                    }
                    Ok(sub) => {
                        let flushed = !cfg.coalesce;
                        if flushed {
                            st.post(shared, qp, &mut out);
                        }
                        match st.core.poll_op(sub.wr_id, cx) {
                            Poll::Ready((res, payload)) => Poll::Ready((res, unpark(payload))),
                            Poll::Pending => {
                                *state = RawState::InTable {
                                    wr_id: sub.wr_id,
                                    flushed,
                                };
                                if !flushed {
                                    // Yield once so that siblings started in this wake queue up
                                    // too; the next poll posts them all with one doorbell.
                                    cx.waker().wake_by_ref();
                                }
                                Poll::Pending
                            }
                        }
                    }
                }
            }
            RawState::InTable { wr_id, flushed } => {
                let mut st = shared.lock();
                if !flushed {
                    st.post(shared, qp, &mut out);
                }
                match st.core.poll_op(wr_id, cx) {
                    Poll::Ready((res, payload)) => Poll::Ready((res, unpark(payload))),
                    Poll::Pending => {
                        *state = RawState::InTable {
                            wr_id,
                            flushed: true,
                        };
                        Poll::Pending
                    }
                }
            }
        };
        Shared::finish(&mut out);
        result
    }
}

fn unpark<B: 'static>(payload: Box<dyn Any + std::marker::Send>) -> B {
    payload
        .downcast::<Parked<B>>()
        .map(|p| p.buf)
        .unwrap_or_else(|_| unreachable!("an operation gets back the payload it parked"))
}

// The buffers are never pinned: they move into the table on first poll.
impl<B: std::marker::Send + 'static> Unpin for RawOp<B> {}

impl<B: std::marker::Send + 'static> Drop for RawOp<B> {
    fn drop(&mut self) {
        if let RawState::InTable { wr_id, .. } = self.state {
            let released = self.cfg.shared.lock().core.cancel(wr_id);
            // Dropped outside the lock: a buffer's destructor may do anything.
            drop(released);
        }
    }
}

/// Checks a local length against a remote token and returns the remote address.
pub(crate) fn check_remote(remote: &crate::buf::RemoteToken, len: u64) -> Result<u64> {
    remote.check(0, len)
}
