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

use super::{Completed, Core, Cqe, OpInfo, PostItem, QpConfig, QpKey, Queue, WorkRequest};
use crate::error::{Error, QpFailure, WcStatus};
use crate::verbs::{SendOp, Sge, WcOpcode};

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// A waker that counts how often it was woken.
#[derive(Debug, Default)]
struct WakeCounter(AtomicUsize);

impl ArcWake for WakeCounter {
    fn wake_by_ref(arc_self: &Arc<Self>) {
        arc_self.0.fetch_add(1, Ordering::SeqCst);
    }
}

impl WakeCounter {
    fn new() -> Arc<WakeCounter> {
        Arc::new(WakeCounter::default())
    }

    fn count(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

/// A fresh `Waker` for `counter` (a new `Waker` value each call, all of which `will_wake` each
/// other because they share the `Arc`).
fn waker_of(counter: &Arc<WakeCounter>) -> Waker {
    waker(counter.clone())
}

fn poll_with<P>(core: &mut Core<P>, wr_id: u64, w: &Waker) -> Poll<(Result<OpInfo, Error>, P)> {
    core.poll_op(wr_id, &mut Context::from_waker(w))
}

/// Polls with a no-op waker and expects the operation to be complete.
#[track_caller]
fn ready<P>(core: &mut Core<P>, wr_id: u64) -> (Result<OpInfo, Error>, P) {
    match poll_with(core, wr_id, noop_waker_ref()) {
        Poll::Ready(r) => r,
        Poll::Pending => panic!("operation {wr_id:#x} is still pending"),
    }
}

#[track_caller]
fn pending<P>(core: &mut Core<P>, wr_id: u64, counter: &Arc<WakeCounter>) {
    assert!(
        poll_with(core, wr_id, &waker_of(counter)).is_pending(),
        "operation {wr_id:#x} completed unexpectedly"
    );
}

/// Wakes every collected waker (as the driver does after unlocking); returns how many.
fn wake_all<P>(out: &mut Completed<P>) -> usize {
    let n = out.wakers.len();
    for w in out.wakers.drain(..) {
        w.wake();
    }
    n
}

fn send_wr() -> WorkRequest {
    WorkRequest::send(SendOp::Send, &[Sge::new(0x1000, 64, 7)])
}

fn recv_wr() -> WorkRequest {
    WorkRequest::recv(&[Sge::new(0x2000, 64, 7)])
}

fn submit<P: std::fmt::Debug>(core: &mut Core<P>, qp: QpKey, wr: WorkRequest, payload: P) -> u64 {
    core.submit(qp, wr, payload).expect("queue pair is healthy").wr_id
}

fn take<P>(core: &mut Core<P>, qp: QpKey) -> Vec<PostItem> {
    let mut out = Vec::new();
    core.take_postable(qp, &mut out);
    out
}

fn ids(posts: &[PostItem]) -> Vec<u64> {
    posts.iter().map(|p| p.wr_id).collect()
}

fn flags(posts: &[PostItem]) -> Vec<bool> {
    posts.iter().map(|p| p.signaled).collect()
}

fn cqe_err(wr_id: u64, status: WcStatus, vendor_err: u32) -> Cqe {
    Cqe {
        vendor_err,
        ..Cqe::with_status(wr_id, status)
    }
}

fn cqe_recv(wr_id: u64, byte_len: u32, imm: Option<u32>) -> Cqe {
    Cqe {
        opcode: WcOpcode::Recv,
        imm,
        ..Cqe::success(wr_id, byte_len)
    }
}

/// Applies one completion with a fresh `Completed`.
fn complete<P>(core: &mut Core<P>, cqe: Cqe) -> Completed<P> {
    let mut out = Completed::default();
    core.complete(&cqe, &mut out);
    out
}

#[track_caller]
fn assert_ok(r: &Result<OpInfo, Error>, byte_len: u32, imm: Option<u32>) {
    match r {
        Ok(info) => assert_eq!(*info, OpInfo { byte_len, imm }),
        Err(e) => panic!("expected success, got {e:?}"),
    }
}

#[track_caller]
fn assert_wc_err(r: &Result<OpInfo, Error>, want_status: WcStatus, want_vendor: u32) {
    match r {
        Err(Error::WorkCompletion { status, vendor_err }) => {
            assert_eq!((*status, *vendor_err), (want_status, want_vendor));
        }
        other => panic!("expected Error::WorkCompletion({want_status:?}), got {other:?}"),
    }
}

#[track_caller]
fn assert_qp_failed(r: &Result<OpInfo, Error>, cause: &QpFailure) {
    match r {
        Err(Error::QpFailed(c)) => assert_eq!(c, cause),
        other => panic!("expected Error::QpFailed({cause:?}), got {other:?}"),
    }
}

/// The documented signaling policy, stated independently of the implementation: in a batch of
/// `n` sends posted behind `ring_before` unretired ones on a queue of `depth`, a send is
/// signaled when the unsignaled run reaches `k`, when it is the last of the batch, or when it
/// fills the queue.
fn policy(ring_before: usize, depth: usize, k: usize, n: usize) -> Vec<bool> {
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

// ---------------------------------------------------------------------------------------------
// Basic round trip and payload ownership
// ---------------------------------------------------------------------------------------------

#[test]
fn submit_post_complete_poll_round_trip() {
    let mut core: Core<&'static str> = Core::new();
    let qp = core.add_qp(QpConfig::new(4, 4, 1));
    assert!(!core.has_postable(qp));

    let s = submit(&mut core, qp, send_wr(), "send-buf");
    let r = submit(&mut core, qp, recv_wr(), "recv-buf");
    assert_ne!(s, r);
    assert_eq!(core.ops_in_table(), 2);
    assert_eq!((core.outstanding(qp), core.posted(qp)), (2, 0));
    assert!(core.has_postable(qp));

    let posts = take(&mut core, qp);
    assert_eq!(ids(&posts), [r, s], "receives first");
    assert_eq!(posts[0].wr.queue, Queue::Recv);
    assert_eq!(posts[1].wr.queue, Queue::Send);
    assert_eq!(posts[1].wr.sges.total_len(), 64);
    assert!(!core.has_postable(qp));
    assert!(take(&mut core, qp).is_empty(), "nothing is posted twice");
    assert_eq!((core.outstanding(qp), core.posted(qp)), (2, 2));

    let out = complete(&mut core, Cqe::success(s, 0));
    assert!(out.is_empty() && out.unknown == 0, "{out:?}");
    let out = complete(&mut core, cqe_recv(r, 100, Some(0xfeed)));
    assert!(out.is_empty() && out.unknown == 0, "{out:?}");
    assert_eq!((core.outstanding(qp), core.posted(qp)), (0, 0));
    assert_eq!(core.ops_in_table(), 2, "completed but not yet collected");

    let (res, p) = ready(&mut core, s);
    assert_ok(&res, 0, None);
    assert_eq!(p, "send-buf");
    let (res, p) = ready(&mut core, r);
    assert_ok(&res, 100, Some(0xfeed));
    assert_eq!(p, "recv-buf");
    assert_eq!(core.ops_in_table(), 0);
    assert!(core.remove_qp(qp));
}

#[test]
fn table_owns_the_payload_from_submit_until_collection() {
    let token = Arc::new(());
    let mut core: Core<Arc<()>> = Core::new();
    let qp = core.add_qp(QpConfig::new(4, 4, 1));
    let id = submit(&mut core, qp, send_wr(), token.clone());
    assert_eq!(Arc::strong_count(&token), 2, "held while queued");
    take(&mut core, qp);
    assert_eq!(Arc::strong_count(&token), 2, "held while posted");
    complete(&mut core, Cqe::success(id, 8));
    assert_eq!(Arc::strong_count(&token), 2, "held until collected");
    let (res, p) = ready(&mut core, id);
    assert_ok(&res, 8, None);
    assert!(Arc::ptr_eq(&p, &token), "the very same payload comes back");
    drop(p);
    assert_eq!(Arc::strong_count(&token), 1);
    assert_eq!(core.ops_in_table(), 0);
}

#[test]
fn qp_config_clamps_degenerate_values() {
    let cfg = QpConfig::new(0, 0, 0);
    assert_eq!((cfg.sq_depth, cfg.rq_depth, cfg.signal_every), (1, 0, 1));
    let cfg = QpConfig::new(8, 3, 5);
    assert_eq!((cfg.sq_depth, cfg.rq_depth, cfg.signal_every), (8, 3, 5));
}

#[test]
fn completed_clear_and_is_empty() {
    let mut out: Completed<u8> = Completed::default();
    assert!(out.is_empty());
    out.unknown = 3;
    assert!(out.is_empty(), "unknown completions need no action");
    out.released.push(1);
    out.postable.push(QpKey::for_test(0));
    out.failed.push(QpKey::for_test(1));
    out.wakers.push(noop_waker_ref().clone());
    assert!(!out.is_empty());
    out.clear();
    assert!(out.is_empty());
    assert_eq!(out.unknown, 0);
}

// ---------------------------------------------------------------------------------------------
// Wakers
// ---------------------------------------------------------------------------------------------

#[test]
fn pending_poll_stores_the_waker_and_completion_wakes_it_once() {
    let mut core: Core<u32> = Core::new();
    let qp = core.add_qp(QpConfig::new(4, 4, 1));
    let id = submit(&mut core, qp, send_wr(), 1);
    let w = WakeCounter::new();
    pending(&mut core, id, &w); // while queued
    take(&mut core, qp);
    pending(&mut core, id, &w); // while posted

    let mut out = complete(&mut core, Cqe::success(id, 3));
    assert_eq!(wake_all(&mut out), 1);
    assert_eq!(w.count(), 1);

    // A duplicate completion is ignored and wakes nobody.
    let mut out = complete(&mut core, Cqe::success(id, 99));
    assert_eq!(out.unknown, 1);
    assert_eq!(wake_all(&mut out), 0);

    let (res, p) = ready(&mut core, id);
    assert_ok(&res, 3, None);
    assert_eq!(p, 1);
    assert_eq!(w.count(), 1, "woken exactly once");
}

#[test]
fn repolling_with_an_equivalent_waker_does_not_duplicate_it() {
    let mut core: Core<u32> = Core::new();
    let qp = core.add_qp(QpConfig::new(4, 4, 1));
    let id = submit(&mut core, qp, send_wr(), 1);
    take(&mut core, qp);
    let w = WakeCounter::new();
    for _ in 0..5 {
        pending(&mut core, id, &w); // a new `Waker` each time, all `will_wake` each other
    }
    let mut out = complete(&mut core, Cqe::success(id, 0));
    assert_eq!(out.wakers.len(), 1);
    wake_all(&mut out);
    assert_eq!(w.count(), 1);
    ready(&mut core, id);
}

#[test]
fn a_different_waker_replaces_the_stored_one() {
    let mut core: Core<u32> = Core::new();
    let qp = core.add_qp(QpConfig::new(4, 4, 1));
    let id = submit(&mut core, qp, send_wr(), 1);
    take(&mut core, qp);
    let (old, new) = (WakeCounter::new(), WakeCounter::new());
    pending(&mut core, id, &old);
    pending(&mut core, id, &new); // the task moved
    let mut out = complete(&mut core, Cqe::success(id, 0));
    assert_eq!(wake_all(&mut out), 1);
    assert_eq!((old.count(), new.count()), (0, 1));
    ready(&mut core, id);
}

#[test]
fn completion_before_any_poll_has_no_waker_and_is_ready_immediately() {
    let mut core: Core<u32> = Core::new();
    let qp = core.add_qp(QpConfig::new(4, 4, 1));
    let id = submit(&mut core, qp, recv_wr(), 5);
    take(&mut core, qp);
    let out = complete(&mut core, cqe_recv(id, 12, None));
    assert!(out.wakers.is_empty());
    let w = WakeCounter::new();
    match poll_with(&mut core, id, &waker_of(&w)) {
        Poll::Ready((res, p)) => {
            assert_ok(&res, 12, None);
            assert_eq!(p, 5);
        }
        Poll::Pending => panic!("completed operation reported pending"),
    }
    assert_eq!(w.count(), 0, "a ready poll does not wake");
}

// ---------------------------------------------------------------------------------------------
// Receives
// ---------------------------------------------------------------------------------------------

#[test]
fn receives_are_posted_before_sends_and_always_signaled() {
    let mut core: Core<u32> = Core::new();
    let qp = core.add_qp(QpConfig::new(8, 8, 100));
    let s1 = submit(&mut core, qp, send_wr(), 1);
    let r1 = submit(&mut core, qp, recv_wr(), 2);
    let s2 = submit(&mut core, qp, send_wr(), 3);
    let r2 = submit(&mut core, qp, recv_wr(), 4);
    let s3 = submit(&mut core, qp, send_wr(), 5);
    let posts = take(&mut core, qp);
    assert_eq!(ids(&posts), [r1, r2, s1, s2, s3]);
    assert_eq!(flags(&posts), [true, true, false, false, true]);
    let queues: Vec<Queue> = posts.iter().map(|p| p.wr.queue).collect();
    assert_eq!(queues, [Queue::Recv, Queue::Recv, Queue::Send, Queue::Send, Queue::Send]);
}

#[test]
fn rq_depth_bounds_posted_receives_and_completions_match_by_wr_id() {
    let mut core: Core<u32> = Core::new();
    let qp = core.add_qp(QpConfig::new(4, 2, 1));
    let r: Vec<u64> = (0..5).map(|i| submit(&mut core, qp, recv_wr(), i)).collect();

    let posts = take(&mut core, qp);
    assert_eq!(ids(&posts), [r[0], r[1]]);
    assert!(flags(&posts).iter().all(|&s| s));
    assert!(!core.has_postable(qp));
    assert!(take(&mut core, qp).is_empty());
    assert_eq!((core.posted(qp), core.outstanding(qp)), (2, 5));

    // The second posted receive completes first: matched by wr_id, and it frees a slot.
    let out = complete(&mut core, cqe_recv(r[1], 11, None));
    assert_eq!(out.postable, [qp]);
    assert_eq!(ids(&take(&mut core, qp)), [r[2]]);
    let out = complete(&mut core, cqe_recv(r[2], 22, Some(2)));
    assert_eq!(out.postable, [qp]);
    assert_eq!(ids(&take(&mut core, qp)), [r[3]]);
    let out = complete(&mut core, cqe_recv(r[0], 0, None));
    assert_eq!(out.postable, [qp]);
    assert_eq!(ids(&take(&mut core, qp)), [r[4]]);
    assert_eq!((core.posted(qp), core.outstanding(qp)), (2, 2));

    // Nothing left queued: a completion frees space but lists nothing.
    let out = complete(&mut core, cqe_recv(r[4], 44, None));
    assert!(out.postable.is_empty());
    complete(&mut core, cqe_recv(r[3], 33, Some(3)));

    let want = [(0, None), (11, None), (22, Some(2)), (33, Some(3)), (44, None)];
    for (i, &(len, imm)) in want.iter().enumerate() {
        let (res, p) = ready(&mut core, r[i]);
        assert_ok(&res, len, imm);
        assert_eq!(p, i as u32);
    }
    assert_eq!(core.ops_in_table(), 0);
    assert_eq!(core.outstanding(qp), 0);
}

// ---------------------------------------------------------------------------------------------
// Send queue depth and selective signaling
// ---------------------------------------------------------------------------------------------

#[test]
fn send_queue_depth_is_backpressure_not_an_error() {
    let mut core: Core<u32> = Core::new();
    let qp = core.add_qp(QpConfig::new(3, 0, 1));
    let s: Vec<u64> = (0..7).map(|i| submit(&mut core, qp, send_wr(), i)).collect();

    let posts = take(&mut core, qp);
    assert_eq!(ids(&posts), &s[..3]);
    assert_eq!((core.posted(qp), core.outstanding(qp)), (3, 7));
    assert!(!core.has_postable(qp));
    assert!(take(&mut core, qp).is_empty());

    // One completion frees one slot: the QP is listed once and one more request fits.
    let out = complete(&mut core, Cqe::success(s[0], 0));
    assert_eq!(out.postable, [qp]);
    assert!(core.has_postable(qp));
    assert_eq!(ids(&take(&mut core, qp)), [s[3]]);

    // Two completions into the same `Completed`: listed once.
    let mut out = Completed::default();
    core.complete(&Cqe::success(s[1], 0), &mut out);
    core.complete(&Cqe::success(s[2], 0), &mut out);
    assert_eq!(out.postable, [qp]);
    assert_eq!(ids(&take(&mut core, qp)), [s[4], s[5]]);

    for &id in &s[3..6] {
        let out = complete(&mut core, Cqe::success(id, 0));
        if id == s[3] {
            assert_eq!(out.postable, [qp]);
            assert_eq!(ids(&take(&mut core, qp)), [s[6]]);
        } else {
            assert!(out.postable.is_empty(), "nothing left queued");
        }
    }
    complete(&mut core, Cqe::success(s[6], 0));
    for (i, &id) in s.iter().enumerate() {
        let (res, p) = ready(&mut core, id);
        assert_ok(&res, 0, None);
        assert_eq!(p, i as u32);
    }
    assert_eq!((core.ops_in_table(), core.outstanding(qp)), (0, 0));
}

#[test]
fn selective_signaling_examples() {
    // Every 3rd plus the last of the batch.
    let mut core: Core<u32> = Core::new();
    let qp = core.add_qp(QpConfig::new(16, 0, 3));
    for i in 0..7 {
        submit(&mut core, qp, send_wr(), i);
    }
    assert_eq!(
        flags(&take(&mut core, qp)),
        [false, false, true, false, false, true, true]
    );

    // The send that fills the queue is signaled even though the batch continues... and the
    // batch is cut at the depth.
    let mut core: Core<u32> = Core::new();
    let qp = core.add_qp(QpConfig::new(4, 0, 10));
    for i in 0..6 {
        submit(&mut core, qp, send_wr(), i);
    }
    assert_eq!(flags(&take(&mut core, qp)), [false, false, false, true]);

    // signal_every = 1: every send is signaled.
    let mut core: Core<u32> = Core::new();
    let qp = core.add_qp(QpConfig::new(8, 0, 1));
    for i in 0..5 {
        submit(&mut core, qp, send_wr(), i);
    }
    assert!(flags(&take(&mut core, qp)).iter().all(|&s| s));
}

#[test]
fn selective_signaling_matches_the_policy_for_all_small_configs() {
    for depth in 1..=9usize {
        for k in 1..=6usize {
            for m in 1..=12usize {
                let ctx = format!("depth={depth} k={k} m={m}");
                let mut core: Core<usize> = Core::new();
                let qp = core.add_qp(QpConfig::new(depth as u32, 0, k as u32));
                let s: Vec<u64> = (0..m).map(|i| submit(&mut core, qp, send_wr(), i)).collect();

                let first = take(&mut core, qp);
                let n = m.min(depth);
                assert_eq!(ids(&first), &s[..n], "{ctx}");
                assert_eq!(flags(&first), policy(0, depth, k, n), "{ctx}");
                assert_eq!(core.posted(qp), n, "{ctx}");

                // Complete the first signaled send: it retires itself and everything before it.
                let f = flags(&first).iter().position(|&x| x).expect("a batch ends signaled");
                let out = complete(&mut core, Cqe::success(s[f], 7));
                assert_eq!(out.unknown, 0, "{ctx}");
                let ring = n - (f + 1);
                assert_eq!(core.posted(qp), ring, "{ctx}");
                assert_eq!(out.postable.is_empty(), m == n, "{ctx}");

                // The next batch starts a fresh run but sees the unretired sends in the ring.
                let second = take(&mut core, qp);
                let n2 = (m - n).min(depth - ring);
                assert_eq!(ids(&second), &s[n..n + n2], "{ctx}");
                assert_eq!(flags(&second), policy(ring, depth, k, n2), "{ctx}");

                for (i, &id) in s.iter().enumerate().take(f + 1) {
                    let (res, p) = ready(&mut core, id);
                    assert_ok(&res, if i == f { 7 } else { 0 }, None);
                    assert_eq!(p, i);
                }
            }
        }
    }
}

#[test]
fn signaled_completion_retires_earlier_sends_in_order_and_wakes_each() {
    let mut core: Core<usize> = Core::new();
    let qp = core.add_qp(QpConfig::new(16, 0, 4));
    let s: Vec<u64> = (0..8).map(|i| submit(&mut core, qp, send_wr(), i)).collect();
    let w: Vec<Arc<WakeCounter>> = (0..8).map(|_| WakeCounter::new()).collect();
    for (id, w) in s.iter().zip(&w) {
        pending(&mut core, *id, w);
    }
    let posts = take(&mut core, qp);
    assert_eq!(flags(&posts), [false, false, false, true, false, false, false, true]);

    let mut out = complete(&mut core, Cqe::success(s[3], 42));
    assert_eq!(out.wakers.len(), 4);
    // The wakers come in post order: wake them one at a time and watch which one moves.
    for (i, wk) in out.wakers.drain(..).enumerate() {
        wk.wake();
        let counts: Vec<usize> = w.iter().map(|c| c.count()).collect();
        let want: Vec<usize> = (0..8).map(|j| usize::from(j <= i)).collect();
        assert_eq!(counts, want, "waker {i}");
    }
    assert_eq!(core.posted(qp), 4);
    for (i, &id) in s.iter().enumerate().take(4) {
        let (res, p) = ready(&mut core, id);
        assert_ok(&res, if i == 3 { 42 } else { 0 }, None);
        assert_eq!(p, i);
    }
    for (id, w) in s[4..].iter().zip(&w[4..]) {
        pending(&mut core, *id, w);
    }

    let mut out = complete(&mut core, Cqe::success(s[7], 1));
    assert_eq!(wake_all(&mut out), 4);
    assert!(w.iter().all(|c| c.count() == 1));
    for (i, &id) in s.iter().enumerate().skip(4) {
        let (res, _) = ready(&mut core, id);
        assert_ok(&res, if i == 7 { 1 } else { 0 }, None);
    }
    assert_eq!((core.posted(qp), core.ops_in_table()), (0, 0));
}

#[test]
fn retirement_frees_queue_space_for_every_retired_send() {
    let mut core: Core<usize> = Core::new();
    let qp = core.add_qp(QpConfig::new(4, 0, 4));
    let s: Vec<u64> = (0..10).map(|i| submit(&mut core, qp, send_wr(), i)).collect();
    let first = take(&mut core, qp);
    assert_eq!(flags(&first), [false, false, false, true]);
    let out = complete(&mut core, Cqe::success(s[3], 0));
    assert_eq!(out.postable, [qp]);
    let second = take(&mut core, qp);
    assert_eq!(ids(&second), &s[4..8], "four slots freed by one completion");
    assert_eq!(flags(&second), [false, false, false, true]);
}

// ---------------------------------------------------------------------------------------------
// Two queue pairs on one core
// ---------------------------------------------------------------------------------------------

#[test]
fn interleaved_sends_of_two_qps_post_and_retire_independently() {
    let mut core: Core<(char, usize)> = Core::new();
    let qa = core.add_qp(QpConfig::new(4, 0, 2));
    let qb = core.add_qp(QpConfig::new(3, 0, 3));
    assert_ne!(qa, qb);
    let mut a = Vec::new();
    let mut b = Vec::new();
    for i in 0..6 {
        a.push(submit(&mut core, qa, send_wr(), ('a', i)));
        b.push(submit(&mut core, qb, send_wr(), ('b', i)));
    }
    let wa: Vec<Arc<WakeCounter>> = (0..6).map(|_| WakeCounter::new()).collect();
    let wb: Vec<Arc<WakeCounter>> = (0..6).map(|_| WakeCounter::new()).collect();
    for i in 0..6 {
        pending(&mut core, a[i], &wa[i]);
        pending(&mut core, b[i], &wb[i]);
    }

    // Each QP posts only its own requests, in submission order, with its own policy.
    let pb = take(&mut core, qb);
    assert_eq!(ids(&pb), &b[..3]);
    assert_eq!(flags(&pb), [false, false, true]);
    let pa = take(&mut core, qa);
    assert_eq!(ids(&pa), &a[..4]);
    assert_eq!(flags(&pa), [false, true, false, true]);
    assert_eq!((core.posted(qa), core.posted(qb)), (4, 3));

    // B's signaled completion retires only B's earlier sends.
    let mut out = complete(&mut core, Cqe::success(b[2], 5));
    assert_eq!(out.postable, [qb]);
    assert_eq!(wake_all(&mut out), 3);
    assert!(wb[..3].iter().all(|w| w.count() == 1));
    assert!(wa.iter().all(|w| w.count() == 0), "A untouched");
    assert_eq!((core.posted(qa), core.posted(qb)), (4, 0));

    // A's first signaled completion retires a[0] only, then B posts its rest.
    let mut out = complete(&mut core, Cqe::success(a[1], 6));
    assert_eq!(out.postable, [qa]);
    assert_eq!(wake_all(&mut out), 2);
    assert_eq!(ids(&take(&mut core, qb)), &b[3..6]);
    assert_eq!(ids(&take(&mut core, qa)), &a[4..6]);
    assert_eq!((core.posted(qa), core.posted(qb)), (4, 3));

    // Interleaved completions across the two rings.
    let mut out = Completed::default();
    core.complete(&Cqe::success(a[3], 0), &mut out);
    core.complete(&Cqe::success(b[5], 0), &mut out);
    core.complete(&Cqe::success(a[5], 0), &mut out);
    assert!(out.postable.is_empty());
    assert_eq!(wake_all(&mut out), 7);
    assert!(wa.iter().chain(&wb).all(|w| w.count() == 1));
    for (i, (&x, &y)) in a.iter().zip(&b).enumerate() {
        let (ra, pa) = ready(&mut core, x);
        let (rb, pb) = ready(&mut core, y);
        assert!(ra.is_ok() && rb.is_ok());
        assert_eq!((pa, pb), (('a', i), ('b', i)));
    }
    assert_eq!(core.ops_in_table(), 0);
}

#[test]
fn an_error_on_one_qp_leaves_the_other_alone() {
    let mut core: Core<u32> = Core::new();
    let qa = core.add_qp(QpConfig::new(4, 4, 1));
    let qb = core.add_qp(QpConfig::new(4, 4, 1));
    let a = submit(&mut core, qa, send_wr(), 1);
    let b = submit(&mut core, qb, send_wr(), 2);
    take(&mut core, qa);
    take(&mut core, qb);
    let out = complete(&mut core, cqe_err(a, WcStatus::RetryExcErr, 0x81));
    assert_eq!(out.failed, [qa]);
    assert!(core.failure(qb).is_none());
    let b2 = submit(&mut core, qb, send_wr(), 3);
    assert_eq!(ids(&take(&mut core, qb)), [b2]);
    complete(&mut core, Cqe::success(b, 0));
    complete(&mut core, Cqe::success(b2, 0));
    assert_wc_err(&ready(&mut core, a).0, WcStatus::RetryExcErr, 0x81);
    assert_ok(&ready(&mut core, b).0, 0, None);
    assert_ok(&ready(&mut core, b2).0, 0, None);
}

// ---------------------------------------------------------------------------------------------
// Errors, failure and flush
// ---------------------------------------------------------------------------------------------

#[test]
fn error_completion_fails_the_op_the_qp_and_every_queued_op() {
    let mut core: Core<u32> = Core::new();
    let qp = core.add_qp(QpConfig::new(4, 2, 2));
    let s: Vec<u64> = (0..6).map(|i| submit(&mut core, qp, send_wr(), i)).collect();
    let r: Vec<u64> = (0..3).map(|i| submit(&mut core, qp, recv_wr(), 10 + i)).collect();
    let ws: Vec<Arc<WakeCounter>> = (0..6).map(|_| WakeCounter::new()).collect();
    let wr: Vec<Arc<WakeCounter>> = (0..3).map(|_| WakeCounter::new()).collect();
    for (id, w) in s.iter().zip(&ws).chain(r.iter().zip(&wr)) {
        pending(&mut core, *id, w);
    }

    let posts = take(&mut core, qp);
    assert_eq!(ids(&posts), [r[0], r[1], s[0], s[1], s[2], s[3]]);
    assert_eq!(flags(&posts), [true, true, false, true, false, true]);

    // s[1] succeeds (retiring s[0]); then the unsignaled s[2] fails: errors always complete.
    let mut out = complete(&mut core, Cqe::success(s[1], 0));
    assert_eq!(wake_all(&mut out), 2);
    let mut out = complete(&mut core, cqe_err(s[2], WcStatus::RemAccessErr, 0x42));
    let cause = QpFailure::WorkCompletion {
        status: WcStatus::RemAccessErr,
        vendor_err: 0x42,
    };
    assert_eq!(core.failure(qp), Some(&cause));
    assert_eq!(out.failed, [qp], "listed exactly once");
    assert!(out.postable.is_empty());
    assert!(out.released.is_empty());
    // s[2] itself plus the queued s[4], s[5] and r[2] resolve now.
    assert_eq!(wake_all(&mut out), 4);
    assert_eq!(ws.iter().map(|w| w.count()).collect::<Vec<_>>(), [1, 1, 1, 0, 1, 1]);
    assert_eq!(wr.iter().map(|w| w.count()).collect::<Vec<_>>(), [0, 0, 1]);
    assert_wc_err(&ready(&mut core, s[2]).0, WcStatus::RemAccessErr, 0x42);
    for id in [s[4], s[5], r[2]] {
        assert_qp_failed(&ready(&mut core, id).0, &cause);
    }
    assert_eq!((core.posted(qp), core.outstanding(qp)), (3, 3), "s[3], r[0], r[1]");
    assert!(!core.remove_qp(qp), "posted requests are still owed completions");

    // Nothing more is posted, and new submissions fail fast with the same cause.
    assert!(!core.has_postable(qp));
    assert!(take(&mut core, qp).is_empty());
    match core.submit(qp, send_wr(), 77) {
        Err((Error::QpFailed(c), payload)) => assert_eq!((c, payload), (cause.clone(), 77)),
        other => panic!("expected a fast failure, got {other:?}"),
    }
    match core.submit(qp, recv_wr(), 78) {
        Err((Error::QpFailed(c), payload)) => assert_eq!((c, payload), (cause.clone(), 78)),
        other => panic!("expected a fast failure, got {other:?}"),
    }

    // The device flushes what was posted: each reports the original cause, nobody relisted.
    for id in [r[1], s[3], r[0]] {
        let mut out = complete(&mut core, cqe_err(id, WcStatus::WrFlushErr, 0x249));
        assert!(out.failed.is_empty());
        assert_eq!(wake_all(&mut out), 1);
        assert_qp_failed(&ready(&mut core, id).0, &cause);
    }
    assert_eq!(core.failure(qp), Some(&cause));
    assert!(ws.iter().chain(&wr).all(|w| w.count() == 1));
    assert_eq!((core.outstanding(qp), core.ops_in_table()), (0, 0));
    assert!(core.remove_qp(qp));
}

#[test]
fn receive_error_fails_the_qp_and_flushes_report_its_cause() {
    let mut core: Core<u32> = Core::new();
    let qp = core.add_qp(QpConfig::new(4, 4, 4));
    let r = submit(&mut core, qp, recv_wr(), 0);
    let s: Vec<u64> = (1..4).map(|i| submit(&mut core, qp, send_wr(), i)).collect();
    assert_eq!(flags(&take(&mut core, qp)), [true, false, false, true]);
    let out = complete(&mut core, cqe_err(r, WcStatus::LocLenErr, 7));
    assert_eq!(out.failed, [qp]);
    let cause = QpFailure::WorkCompletion {
        status: WcStatus::LocLenErr,
        vendor_err: 7,
    };
    // The device flushes every posted send, unsignaled ones included, in post order.
    for &id in &s {
        complete(&mut core, Cqe::with_status(id, WcStatus::WrFlushErr));
    }
    assert_wc_err(&ready(&mut core, r).0, WcStatus::LocLenErr, 7);
    for &id in &s {
        assert_qp_failed(&ready(&mut core, id).0, &cause);
    }
    assert_eq!((core.outstanding(qp), core.ops_in_table()), (0, 0));
}

#[test]
fn a_flush_without_a_recorded_cause_records_flushed() {
    let mut core: Core<u32> = Core::new();
    let qp = core.add_qp(QpConfig::new(4, 4, 1));
    let a = submit(&mut core, qp, send_wr(), 0);
    let b = submit(&mut core, qp, send_wr(), 1);
    take(&mut core, qp);
    let out = complete(&mut core, Cqe::with_status(a, WcStatus::WrFlushErr));
    assert_eq!(out.failed, [qp]);
    assert_eq!(core.failure(qp), Some(&QpFailure::Flushed));
    let out = complete(&mut core, cqe_err(b, WcStatus::RemOpErr, 1));
    assert!(out.failed.is_empty(), "the first cause is kept");
    assert_eq!(core.failure(qp), Some(&QpFailure::Flushed));
    assert_qp_failed(&ready(&mut core, a).0, &QpFailure::Flushed);
    assert_wc_err(&ready(&mut core, b).0, WcStatus::RemOpErr, 1);
}

#[test]
fn fail_qp_then_flush_every_posted_op_resolves_everything_once() {
    let mut core: Core<u32> = Core::new();
    let qp = core.add_qp(QpConfig::new(4, 4, 3));
    let r: Vec<u64> = (0..3).map(|i| submit(&mut core, qp, recv_wr(), i)).collect();
    let s: Vec<u64> = (3..9).map(|i| submit(&mut core, qp, send_wr(), i)).collect();
    let all: Vec<u64> = r.iter().chain(&s).copied().collect();
    let w: Vec<Arc<WakeCounter>> = all.iter().map(|_| WakeCounter::new()).collect();
    for (id, wk) in all.iter().zip(&w) {
        pending(&mut core, *id, wk);
    }
    let posts = take(&mut core, qp);
    assert_eq!(posts.len(), 7, "3 receives + 4 sends; 2 sends stay queued");
    assert!(!core.remove_qp(qp));

    let mut out = Completed::default();
    let cause = core.fail_qp(qp, QpFailure::Closed, &mut out);
    assert_eq!(cause, QpFailure::Closed);
    assert_eq!(out.failed, [qp]);
    assert_eq!(wake_all(&mut out), 2, "the two queued sends fail at once");
    // A second failure keeps the first cause and is not listed again.
    let mut out = Completed::default();
    let again = core.fail_qp(qp, QpFailure::AsyncEvent("IBV_EVENT_QP_FATAL"), &mut out);
    assert_eq!(again, QpFailure::Closed);
    assert!(out.is_empty());
    assert!(!core.remove_qp(qp), "posted requests are still owed completions");
    assert_eq!(core.outstanding(qp), 7);

    // Flush: sends in post order, receives in any order, interleaved.
    let mut resolved = 0;
    for id in [s[0], r[2], s[1], r[0], s[2], s[3], r[1]] {
        let mut out = complete(&mut core, Cqe::with_status(id, WcStatus::WrFlushErr));
        assert_eq!(out.unknown, 0);
        resolved += wake_all(&mut out);
    }
    assert_eq!(resolved, 7);
    assert!(w.iter().all(|w| w.count() == 1), "each op woken exactly once");
    for &id in &all {
        assert_qp_failed(&ready(&mut core, id).0, &QpFailure::Closed);
    }
    assert_eq!((core.outstanding(qp), core.posted(qp), core.ops_in_table()), (0, 0, 0));
    assert!(core.remove_qp(qp));
    assert!(core.remove_qp(qp), "removing an unknown QP is a no-op");
}

#[test]
fn post_failed_fails_the_unposted_suffix_and_the_qp() {
    let mut core: Core<Arc<()>> = Core::new();
    let token = Arc::new(());
    let qp = core.add_qp(QpConfig::new(4, 4, 4));
    let r = submit(&mut core, qp, recv_wr(), token.clone());
    let s: Vec<u64> = (0..3).map(|_| submit(&mut core, qp, send_wr(), token.clone())).collect();
    let queued = submit(&mut core, qp, recv_wr(), token.clone());
    // Make the recv depth 1 worth of room only... (it is 4; post all, then pretend a failure)
    let posts = take(&mut core, qp);
    assert_eq!(ids(&posts), [r, queued, s[0], s[1], s[2]]);
    assert_eq!(Arc::strong_count(&token), 6);
    // The future of s[2] was dropped after take_postable: its payload is parked.
    assert!(core.cancel(s[2]).is_none());

    // ibv_post_send rejected the second send: s[1] and s[2] never reached the device.
    let mut out = Completed::default();
    core.post_failed(qp, &[s[1], s[2]], libc::EINVAL, &mut out);
    let cause = QpFailure::PostFailed(libc::EINVAL);
    assert_eq!(core.failure(qp), Some(&cause));
    assert_eq!(out.failed, [qp]);
    assert_eq!(out.released.len(), 1, "never posted: released at once");
    out.released.clear();
    assert_eq!(Arc::strong_count(&token), 5);
    assert_qp_failed(&ready(&mut core, s[1]).0, &cause);
    assert_eq!(core.posted(qp), 3, "r, queued and s[0] were posted");

    for id in [s[0], queued, r] {
        complete(&mut core, Cqe::with_status(id, WcStatus::WrFlushErr));
        assert_qp_failed(&ready(&mut core, id).0, &cause);
    }
    assert_eq!((core.outstanding(qp), core.ops_in_table()), (0, 0));
    assert_eq!(Arc::strong_count(&token), 1);
}

// ---------------------------------------------------------------------------------------------
// Spurious, duplicate and stale completions
// ---------------------------------------------------------------------------------------------

/// Everything observable about one QP and the table.
fn snapshot<P>(core: &Core<P>, qp: QpKey) -> (usize, usize, usize, bool, Option<QpFailure>) {
    (
        core.ops_in_table(),
        core.outstanding(qp),
        core.posted(qp),
        core.has_postable(qp),
        core.failure(qp).cloned(),
    )
}

#[track_caller]
fn assert_ignored<P>(core: &mut Core<P>, qp: QpKey, cqe: Cqe) {
    let before = snapshot(core, qp);
    let out = complete(core, cqe);
    assert_eq!(out.unknown, 1, "{cqe:?}");
    assert!(out.is_empty(), "{cqe:?} had effects");
    assert_eq!(snapshot(core, qp), before, "{cqe:?} changed the core");
}

#[test]
fn unknown_duplicate_and_stale_completions_are_counted_and_ignored() {
    let mut core: Core<u32> = Core::new();
    let qp = core.add_qp(QpConfig::new(2, 2, 2));

    // Unknown ids, with success and error statuses (an error must not fail the QP).
    assert_ignored(&mut core, qp, Cqe::success(0x0000_0007_ffff_0000, 1));
    assert_ignored(&mut core, qp, Cqe::with_status(u64::MAX, WcStatus::RemAccessErr));
    assert_ignored(&mut core, qp, Cqe::with_status(0, WcStatus::WrFlushErr));

    // A completion for a request that was never posted (still queued).
    let a = submit(&mut core, qp, send_wr(), 1);
    let b = submit(&mut core, qp, send_wr(), 2);
    let c = submit(&mut core, qp, send_wr(), 3);
    assert_ignored(&mut core, qp, Cqe::success(a, 1));
    assert_ignored(&mut core, qp, Cqe::with_status(a, WcStatus::FatalErr));
    let posts = take(&mut core, qp);
    assert_eq!(ids(&posts), [a, b]);
    assert_eq!(flags(&posts), [false, true]);
    assert_ignored(&mut core, qp, Cqe::success(c, 1)); // c is still queued

    // Duplicates: b completes (retiring a); a late completion for the retired a and a second
    // one for b are ignored, and the recorded outcomes are unchanged.
    let w = WakeCounter::new();
    pending(&mut core, b, &w);
    let mut out = complete(&mut core, Cqe::success(b, 10));
    assert_eq!(wake_all(&mut out), 1);
    assert_eq!(ids(&take(&mut core, qp)), [c]);
    assert_ignored(&mut core, qp, Cqe::success(a, 99));
    assert_ignored(&mut core, qp, Cqe::with_status(b, WcStatus::RemAccessErr));
    assert_eq!(w.count(), 1);
    assert_ok(&ready(&mut core, a).0, 0, None);
    assert_ok(&ready(&mut core, b).0, 10, None);
    // After collection the ids are simply unknown.
    assert_ignored(&mut core, qp, Cqe::success(b, 10));

    // Stale generation: a's slot is reused by d; a's id must not complete d.
    let d = submit(&mut core, qp, send_wr(), 4);
    let e = submit(&mut core, qp, send_wr(), 5);
    assert!(
        [a as u32, b as u32].contains(&(d as u32)),
        "slot reused: {a:#x} {b:#x} {d:#x}"
    );
    assert!(![a, b].contains(&d), "with a new generation");
    assert_eq!(ids(&take(&mut core, qp)), [d]);
    let stale = if d as u32 == a as u32 { a } else { b };
    assert_ignored(&mut core, qp, Cqe::success(stale, 1));
    assert_ignored(&mut core, qp, Cqe::with_status(stale, WcStatus::LocProtErr));
    assert!(core.failure(qp).is_none());

    complete(&mut core, Cqe::success(c, 0));
    let out = complete(&mut core, Cqe::success(d, 0));
    assert_eq!(out.postable, [qp]);
    take(&mut core, qp);
    complete(&mut core, Cqe::success(e, 0));
    for id in [c, d, e] {
        assert!(ready(&mut core, id).0.is_ok());
    }
    assert_eq!(core.ops_in_table(), 0);
}

// ---------------------------------------------------------------------------------------------
// Drops (cancellation) at every state
// ---------------------------------------------------------------------------------------------

#[test]
fn drop_before_submit_leaves_nothing_behind() {
    let mut core: Core<Arc<()>> = Core::new();
    let _qp = core.add_qp(QpConfig::new(4, 4, 1));
    // A future dropped before its first poll never submitted: nothing to cancel.
    assert!(core.cancel(0).is_none());
    assert!(core.cancel(0x1_0000_0003).is_none());
    assert_eq!(core.ops_in_table(), 0);
}

#[test]
fn drop_while_queued_returns_the_payload_and_never_posts() {
    let token = Arc::new(());
    let mut core: Core<Arc<()>> = Core::new();
    let qp = core.add_qp(QpConfig::new(1, 1, 1));
    let s1 = submit(&mut core, qp, send_wr(), token.clone());
    let r1 = submit(&mut core, qp, recv_wr(), token.clone());
    assert_eq!(ids(&take(&mut core, qp)), [r1, s1]);
    let s2 = submit(&mut core, qp, send_wr(), token.clone());
    let s3 = submit(&mut core, qp, send_wr(), token.clone());
    let r2 = submit(&mut core, qp, recv_wr(), token.clone());
    let r3 = submit(&mut core, qp, recv_wr(), token.clone());
    assert_eq!((core.ops_in_table(), core.outstanding(qp)), (6, 6));

    let w = WakeCounter::new();
    pending(&mut core, s2, &w);
    let p = core.cancel(s2).expect("a queued request gives its payload back");
    assert!(Arc::ptr_eq(&p, &token));
    drop(p);
    let p = core.cancel(r2).expect("a queued receive gives its payload back");
    drop(p);
    assert_eq!(Arc::strong_count(&token), 5);
    assert_eq!((core.ops_in_table(), core.outstanding(qp)), (4, 4));
    assert!(core.cancel(s2).is_none(), "second cancel is a no-op");

    let out = complete(&mut core, Cqe::success(s1, 0));
    assert_eq!(out.postable, [qp]);
    assert_eq!(ids(&take(&mut core, qp)), [s3], "the dropped s2 is never posted");
    let out = complete(&mut core, cqe_recv(r1, 0, None));
    assert_eq!(out.postable, [qp]);
    assert_eq!(ids(&take(&mut core, qp)), [r3], "the dropped r2 is never posted");
    complete(&mut core, Cqe::success(s3, 0));
    complete(&mut core, cqe_recv(r3, 0, None));
    for id in [s1, r1, s3, r3] {
        ready(&mut core, id);
    }
    assert_eq!(w.count(), 0, "a dropped future is not woken");
    assert_eq!(core.ops_in_table(), 0);
    assert_eq!(Arc::strong_count(&token), 1);
}

#[test]
fn drop_after_posting_parks_the_payload_until_the_completion() {
    let token = Arc::new(());
    let mut core: Core<Arc<()>> = Core::new();
    let qp = core.add_qp(QpConfig::new(4, 4, 1));
    let s = submit(&mut core, qp, send_wr(), token.clone());
    let r = submit(&mut core, qp, recv_wr(), token.clone());
    take(&mut core, qp);
    let w = WakeCounter::new();
    pending(&mut core, s, &w);
    pending(&mut core, r, &w);

    assert!(core.cancel(s).is_none(), "the device may still touch it");
    assert!(core.cancel(r).is_none());
    assert!(core.cancel(s).is_none(), "cancelling twice changes nothing");
    assert_eq!(Arc::strong_count(&token), 3, "both payloads parked");
    assert_eq!((core.ops_in_table(), core.posted(qp)), (2, 2));

    let out = complete(&mut core, Cqe::success(s, 0));
    assert!(out.wakers.is_empty(), "the waker was dropped with the future");
    assert_eq!(out.released.len(), 1);
    assert!(Arc::ptr_eq(&out.released[0], &token));
    drop(out);
    assert_eq!(Arc::strong_count(&token), 2);

    let out = complete(&mut core, cqe_err(r, WcStatus::LocLenErr, 0));
    assert_eq!(out.released.len(), 1, "released on an error completion too");
    assert_eq!(out.failed, [qp]);
    drop(out);
    assert_eq!(Arc::strong_count(&token), 1);
    assert_eq!(w.count(), 0);
    assert_eq!((core.ops_in_table(), core.outstanding(qp)), (0, 0));
    assert!(core.cancel(s).is_none() && core.cancel(r).is_none());
}

#[test]
fn dropped_unsignaled_sends_are_released_by_the_retiring_completion() {
    let token = Arc::new(());
    let mut core: Core<Arc<()>> = Core::new();
    let qp = core.add_qp(QpConfig::new(8, 0, 4));
    let s: Vec<u64> = (0..4).map(|_| submit(&mut core, qp, send_wr(), token.clone())).collect();
    assert_eq!(flags(&take(&mut core, qp)), [false, false, false, true]);
    assert!(core.cancel(s[0]).is_none());
    assert!(core.cancel(s[2]).is_none());
    assert_eq!(Arc::strong_count(&token), 5);

    let mut out = complete(&mut core, Cqe::success(s[3], 0));
    assert_eq!(out.released.len(), 2, "s[0] and s[2] retired with s[3]");
    out.released.clear();
    assert_eq!(Arc::strong_count(&token), 3);
    drop(ready(&mut core, s[1]));
    drop(ready(&mut core, s[3]));
    assert_eq!(Arc::strong_count(&token), 1);
    assert_eq!(core.ops_in_table(), 0);
}

#[test]
fn drop_after_completion_returns_the_payload() {
    let token = Arc::new(());
    let mut core: Core<Arc<()>> = Core::new();
    let qp = core.add_qp(QpConfig::new(4, 4, 1));
    let s = submit(&mut core, qp, send_wr(), token.clone());
    take(&mut core, qp);
    let w = WakeCounter::new();
    pending(&mut core, s, &w);
    let mut out = complete(&mut core, Cqe::success(s, 0));
    wake_all(&mut out);
    let p = core.cancel(s).expect("completed: the payload comes back");
    assert!(Arc::ptr_eq(&p, &token));
    drop(p);
    assert_eq!(Arc::strong_count(&token), 1);
    assert_eq!(core.ops_in_table(), 0);
    assert!(core.cancel(s).is_none());
    assert_eq!(complete(&mut core, Cqe::success(s, 0)).unknown, 1);

    // Also for an op failed while queued.
    let q1 = submit(&mut core, qp, send_wr(), token.clone());
    let mut out = Completed::default();
    core.fail_qp(qp, QpFailure::Closed, &mut out);
    assert!(core.cancel(q1).is_some());
    assert_eq!(Arc::strong_count(&token), 1);
    assert_eq!(core.ops_in_table(), 0);
}

// ---------------------------------------------------------------------------------------------
// Abandon and QP lifecycle
// ---------------------------------------------------------------------------------------------

#[test]
fn abandon_qp_completes_every_posted_op_and_releases_cancelled_payloads() {
    let token = Arc::new(());
    let mut core: Core<Arc<()>> = Core::new();
    let qp = core.add_qp(QpConfig::new(3, 2, 2));
    let s: Vec<u64> = (0..5).map(|_| submit(&mut core, qp, send_wr(), token.clone())).collect();
    let r: Vec<u64> = (0..3).map(|_| submit(&mut core, qp, recv_wr(), token.clone())).collect();
    let w: Vec<Arc<WakeCounter>> = (0..8).map(|_| WakeCounter::new()).collect();
    for (id, wk) in s.iter().chain(&r).zip(&w) {
        pending(&mut core, *id, wk);
    }
    assert_eq!(ids(&take(&mut core, qp)), [r[0], r[1], s[0], s[1], s[2]]);
    // r[0] completes before (kept, uncollected); s[1] and r[1] are dropped while posted.
    let mut out = complete(&mut core, cqe_recv(r[0], 9, None));
    wake_all(&mut out);
    assert!(core.cancel(s[1]).is_none());
    assert!(core.cancel(r[1]).is_none());
    assert_eq!(Arc::strong_count(&token), 9);

    let mut out = Completed::default();
    core.abandon_qp(qp, &mut out);
    assert_eq!(out.failed, [qp]);
    assert_eq!(core.failure(qp), Some(&QpFailure::Closed));
    assert_eq!(out.released.len(), 2);
    out.released.clear();
    assert_eq!(Arc::strong_count(&token), 7);
    // s[0], s[2] (posted) and s[3], s[4], r[2] (queued) resolve now.
    assert_eq!(wake_all(&mut out), 5);
    assert_eq!((core.outstanding(qp), core.posted(qp)), (0, 0));
    let counts: Vec<usize> = w.iter().map(|c| c.count()).collect();
    assert_eq!(counts, [1, 0, 1, 1, 1, 1, 0, 1]);

    // The device's late completions (if any) are unknown now.
    assert_eq!(complete(&mut core, Cqe::success(s[2], 0)).unknown, 1);
    assert_eq!(
        complete(&mut core, Cqe::with_status(r[1], WcStatus::WrFlushErr)).unknown,
        1
    );

    assert_ok(&ready(&mut core, r[0]).0, 9, None);
    for id in [s[0], s[2], s[3], s[4], r[2]] {
        assert_qp_failed(&ready(&mut core, id).0, &QpFailure::Closed);
    }
    assert_eq!(core.ops_in_table(), 0);
    assert_eq!(Arc::strong_count(&token), 1);
    assert!(core.remove_qp(qp));
}

#[test]
fn abandon_keeps_an_earlier_cause() {
    let mut core: Core<u32> = Core::new();
    let qp = core.add_qp(QpConfig::new(4, 4, 1));
    let a = submit(&mut core, qp, send_wr(), 0);
    let b = submit(&mut core, qp, send_wr(), 1);
    take(&mut core, qp);
    let out = complete(&mut core, cqe_err(a, WcStatus::RetryExcErr, 3));
    assert_eq!(out.failed, [qp]);
    let mut out = Completed::default();
    core.abandon_qp(qp, &mut out);
    assert!(out.failed.is_empty(), "already listed once");
    let cause = QpFailure::WorkCompletion {
        status: WcStatus::RetryExcErr,
        vendor_err: 3,
    };
    assert_qp_failed(&ready(&mut core, b).0, &cause);
    assert_wc_err(&ready(&mut core, a).0, WcStatus::RetryExcErr, 3);
    assert!(core.remove_qp(qp));
}

#[test]
fn qp_keys_are_reused_after_removal_without_disturbing_uncollected_ops() {
    let mut core: Core<u32> = Core::new();
    let qa = core.add_qp(QpConfig::new(4, 4, 1));
    let qb = core.add_qp(QpConfig::new(4, 4, 1));
    let a = submit(&mut core, qa, send_wr(), 1);
    take(&mut core, qa);
    complete(&mut core, Cqe::success(a, 5));
    // Completed but not collected: not outstanding, so the QP can go.
    assert_eq!(core.outstanding(qa), 0);
    assert!(core.remove_qp(qa));
    assert_eq!(core.outstanding(qa), 0);
    assert_eq!(core.posted(qa), 0);
    assert!(!core.has_postable(qa));
    assert!(core.failure(qa).is_none());

    let qc = core.add_qp(QpConfig::new(4, 4, 1));
    assert_eq!(qc, qa, "the free key is reused");
    assert_ne!(qc, qb);
    let c = submit(&mut core, qc, send_wr(), 3);
    take(&mut core, qc);
    let mut out = Completed::default();
    core.abandon_qp(qc, &mut out);
    assert_ok(&ready(&mut core, a).0, 5, None);
    assert_qp_failed(&ready(&mut core, c).0, &QpFailure::Closed);
    assert!(core.remove_qp(qc));
    assert!(core.remove_qp(qb));
    assert_eq!(core.ops_in_table(), 0);
}
