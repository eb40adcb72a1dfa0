//! Host unit tests for the sans-IO core: the contract of [`Core`] as the driver relies on it.
//!
//! Everything here is plain data: completions are built by hand (or by a small device model in
//! the randomized storm at the end), wakers count their wakes, and payloads are probes that
//! report when they are dropped.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, Waker};

use futures::task::{ArcWake, noop_waker_ref, waker};

use super::qp::QpSlot;
use super::{Completed, Core, Cqe, OpInfo, PostItem, QpConfig, QpKey, Queue, WorkRequest};
use crate::error::{Error, QpFailure, WcStatus};
use crate::verbs::{SendOp, Sge, WcOpcode};

// ---------------------------------------------------------------------------------------------
// Helpers shared by the test modules
// ---------------------------------------------------------------------------------------------

/// A waker that counts how often it was woken.
#[derive(Debug, Default)]
pub(super) struct WakeCounter(pub(super) AtomicUsize);

impl ArcWake for WakeCounter {
    fn wake_by_ref(arc_self: &Arc<Self>) {
        arc_self.0.fetch_add(1, Ordering::SeqCst);
    }
}

impl WakeCounter {
    pub(super) fn new() -> Arc<WakeCounter> {
        Arc::new(WakeCounter::default())
    }

    pub(super) fn count(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

/// A fresh `Waker` for `counter` (a new `Waker` value each call, all of which `will_wake` each
/// other because they share the `Arc`).
pub(super) fn waker_of(counter: &Arc<WakeCounter>) -> Waker {
    waker(counter.clone())
}

pub(super) fn poll_with<P>(
    core: &mut Core<P>,
    wr_id: u64,
    w: &Waker,
) -> Poll<(Result<OpInfo, Error>, P)> {
    core.poll_op(wr_id, &mut Context::from_waker(w))
        .map(|(res, p)| (res.map_err(|e| *e), p))
}

/// Polls with a no-op waker and expects the operation to be complete.
#[track_caller]
pub(super) fn ready<P>(core: &mut Core<P>, wr_id: u64) -> (Result<OpInfo, Error>, P) {
    match poll_with(core, wr_id, noop_waker_ref()) {
        Poll::Ready(r) => r,
        Poll::Pending => panic!("operation {wr_id:#x} is still pending"),
    }
}

#[track_caller]
pub(super) fn pending<P>(core: &mut Core<P>, wr_id: u64, counter: &Arc<WakeCounter>) {
    assert!(
        poll_with(core, wr_id, &waker_of(counter)).is_pending(),
        "operation {wr_id:#x} completed unexpectedly"
    );
}

/// Wakes every collected waker (as the driver does after unlocking); returns how many.
pub(super) fn wake_all<P>(out: &mut Completed<P>) -> usize {
    let n = out.wakers.len();
    for w in out.wakers.drain(..) {
        w.wake();
    }
    n
}

pub(super) fn send_wr() -> WorkRequest {
    WorkRequest::send(SendOp::Send, &[Sge::new(0x1000, 64, 7)])
}

pub(super) fn recv_wr() -> WorkRequest {
    WorkRequest::recv(&[Sge::new(0x2000, 64, 7)])
}

pub(super) fn submit<P: std::fmt::Debug>(
    core: &mut Core<P>,
    qp: QpKey,
    wr: WorkRequest,
    payload: P,
) -> u64 {
    core.submit(qp, wr, payload)
        .expect("queue pair is healthy")
        .wr_id
}

pub(super) fn take<P>(core: &mut Core<P>, qp: QpKey) -> Vec<PostItem> {
    let mut out = Vec::new();
    core.take_postable(qp, &mut out);
    out
}

pub(super) fn ids(posts: &[PostItem]) -> Vec<u64> {
    posts.iter().map(|p| p.wr_id).collect()
}

pub(super) fn flags(posts: &[PostItem]) -> Vec<bool> {
    posts.iter().map(|p| p.signaled).collect()
}

pub(super) fn cqe_err(wr_id: u64, status: WcStatus, vendor_err: u32) -> Cqe {
    Cqe {
        vendor_err,
        ..Cqe::with_status(wr_id, status)
    }
}

pub(super) fn cqe_recv(wr_id: u64, byte_len: u32, imm: Option<u32>) -> Cqe {
    Cqe {
        opcode: WcOpcode::Recv,
        imm,
        ..Cqe::success(wr_id, byte_len)
    }
}

/// Applies one completion with a fresh `Completed`.
pub(super) fn complete<P>(core: &mut Core<P>, cqe: Cqe) -> Completed<P> {
    let mut out = Completed::default();
    core.complete(&cqe, &mut out);
    out
}

#[track_caller]
pub(super) fn assert_ok(r: &Result<OpInfo, Error>, byte_len: u32, imm: Option<u32>) {
    match r {
        Ok(info) => assert_eq!(*info, OpInfo { byte_len, imm }),
        Err(e) => panic!("expected success, got {e:?}"),
    }
}

#[track_caller]
pub(super) fn assert_wc_err(r: &Result<OpInfo, Error>, want_status: WcStatus, want_vendor: u32) {
    match r {
        Err(Error::QpFailed(QpFailure::WorkCompletion { status, vendor_err })) => {
            assert_eq!((*status, *vendor_err), (want_status, want_vendor));
        }
        other => panic!("expected QpFailure::WorkCompletion({want_status:?}), got {other:?}"),
    }
}

#[track_caller]
pub(super) fn assert_qp_failed(r: &Result<OpInfo, Error>, cause: &QpFailure) {
    match r {
        Err(Error::QpFailed(c)) => assert_eq!(c, cause),
        other => panic!("expected Error::QpFailed({cause:?}), got {other:?}"),
    }
}

/// The documented signaling policy, stated independently of the implementation: in a batch of
/// `n` sends posted behind `ring_before` unretired ones on a queue of `depth`, a send is
/// signaled when the unsignaled run reaches `k`, when it is the last of the batch, or when it
/// fills the queue.
pub(super) fn policy(ring_before: usize, depth: usize, k: usize, n: usize) -> Vec<bool> {
    let mut run = 0;
    (0..n)
        .map(|i| {
            run += 1;
            let signaled = run == k || i + 1 == n || ring_before + i + 1 == depth;
            if signaled {
                run = 0;
            }
            signaled
        })
        .collect()
}

mod basic;
mod direct;
mod failures;
mod storm;
pub(crate) mod storm_model;
mod storm_runs;
