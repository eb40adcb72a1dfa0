//! The sans-IO core: the in-flight operation table, send/receive queue accounting and the
//! signaling policy. No FFI, no Tokio, no clock: it takes work completions as plain data
//! ([`Cqe`]) and says which wakers to wake and which payloads to release.
//!
//! The Tokio driver owns one [`Core`] per completion queue, behind a mutex, and feeds it:
//!
//! 1. an operation's future, on first poll, [`submit`](Core::submit)s a [`WorkRequest`] with its
//!    payload (the buffers): ownership moves into the table, so dropping or forgetting the
//!    future can never free memory the device may still touch;
//! 2. the driver [`take_postable`](Core::take_postable)s queued requests (bounded by the queue
//!    depth, with the signaling policy applied) and posts them as one chained list; a request
//!    that can go at once (nothing queued ahead of it, room in its queue) is entered as posted
//!    with [`submit_posted`](Core::submit_posted) and posted by its future directly;
//! 3. the completion task hands each completion to [`complete`](Core::complete), which retires
//!    the operation (and any earlier unsignaled ones), records failures, and collects wakers;
//! 4. the future [`poll_op`](Core::poll_op)s its result and gets its payload back, or, if it was
//!    dropped, [`cancel`](Core::cancel) parks the payload until the completion arrives.
//!
//! Lifecycle of an operation: `Queued -> Submitted -> Waiting(waker) -> Completed(outcome)`,
//! or `Cancelled` (payload parked) when the future is dropped after posting.
//!
//! # Examples
//!
//! (Not a doc test: the module is private; its unit tests make the same calls.)
//!
//! ```ignore
//! use std::task::{Context, Poll};
//! use crate::proto::{Completed, Core, Cqe, QpConfig, WorkRequest};
//! use tokio_rdma::WcStatus;
//!
//! let mut core: Core<&'static str> = Core::new();
//! let qp = core.add_qp(QpConfig::new(16, 16, 1));
//! let sub = core.submit(qp, WorkRequest::recv(&[]), "buffer").unwrap();
//! let mut posts = Vec::new();
//! core.take_postable(qp, &mut posts);
//! assert_eq!(posts.len(), 1);
//! let mut done = Completed::default();
//! core.complete(&Cqe::success(sub.wr_id, 5), &mut done);
//! assert!(done.wakers.is_empty()); // nobody was waiting yet
//! let mut cx = Context::from_waker(futures::task::noop_waker_ref());
//! match core.poll_op(sub.wr_id, &mut cx) {
//!     Poll::Ready((Ok(info), payload)) => assert_eq!((info.byte_len, payload), (5, "buffer")),
//!     other => panic!("{other:?}"),
//! }
//! ```
#![forbid(unsafe_code)]
// The core's API is complete for its own tests (and the micro-benchmarks); the shell uses part.
#![allow(unreachable_pub, unused_imports)]
#![allow(dead_code)]

pub mod conn;
mod engine;
mod key;
mod msg;
mod qp;
mod table;
#[cfg(test)]
pub(crate) mod tests;
mod wr;

pub use conn::Credits;
pub use engine::{Completed, Core, Submitted};
pub use key::QpKey;
pub use msg::{MsgHeader, MsgKind};
pub use qp::QpConfig;
pub use wr::{Cqe, INLINE_SGES, OpInfo, Outcome, PostItem, Queue, SgList, WorkRequest, box_error};
