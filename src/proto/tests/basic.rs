//! Round trip, wakers, receives, send-queue depth and signaling, two queue pairs.
#![allow(unused_imports)]

use super::*;

// ---------------------------------------------------------------------------------------------
// Basic round trip and payload ownership
// ---------------------------------------------------------------------------------------------

#[test]
fn submit_post_complete_poll_round_trip() {
    let mut core: Core<&'static str> = Core::new();
    let qp = core.add_qp(QpConfig::new(4, 4, 1)).unwrap();
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
    let qp = core.add_qp(QpConfig::new(4, 4, 1)).unwrap();
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
    let qp = core.add_qp(QpConfig::new(4, 4, 1)).unwrap();
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
    let qp = core.add_qp(QpConfig::new(4, 4, 1)).unwrap();
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
    assert_ok(&ready(&mut core, id).0, 0, None);
}

#[test]
fn a_different_waker_replaces_the_stored_one() {
    let mut core: Core<u32> = Core::new();
    let qp = core.add_qp(QpConfig::new(4, 4, 1)).unwrap();
    let id = submit(&mut core, qp, send_wr(), 1);
    take(&mut core, qp);
    let (old, new) = (WakeCounter::new(), WakeCounter::new());
    pending(&mut core, id, &old);
    pending(&mut core, id, &new); // the task moved
    let mut out = complete(&mut core, Cqe::success(id, 0));
    assert_eq!(wake_all(&mut out), 1);
    assert_eq!((old.count(), new.count()), (0, 1));
    assert_ok(&ready(&mut core, id).0, 0, None);
}

#[test]
fn completion_before_any_poll_has_no_waker_and_is_ready_immediately() {
    let mut core: Core<u32> = Core::new();
    let qp = core.add_qp(QpConfig::new(4, 4, 1)).unwrap();
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
    let qp = core.add_qp(QpConfig::new(8, 8, 100)).unwrap();
    let s1 = submit(&mut core, qp, send_wr(), 1);
    let r1 = submit(&mut core, qp, recv_wr(), 2);
    let s2 = submit(&mut core, qp, send_wr(), 3);
    let r2 = submit(&mut core, qp, recv_wr(), 4);
    let s3 = submit(&mut core, qp, send_wr(), 5);
    let posts = take(&mut core, qp);
    assert_eq!(ids(&posts), [r1, r2, s1, s2, s3]);
    assert_eq!(flags(&posts), [true, true, false, false, true]);
    let queues: Vec<Queue> = posts.iter().map(|p| p.wr.queue).collect();
    assert_eq!(
        queues,
        [
            Queue::Recv,
            Queue::Recv,
            Queue::Send,
            Queue::Send,
            Queue::Send
        ]
    );
}

#[test]
fn rq_depth_bounds_posted_receives_and_completions_match_by_wr_id() {
    let mut core: Core<u32> = Core::new();
    let qp = core.add_qp(QpConfig::new(4, 2, 1)).unwrap();
    let r: Vec<u64> = (0..5)
        .map(|i| submit(&mut core, qp, recv_wr(), i))
        .collect();

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

    let want = [
        (0, None),
        (11, None),
        (22, Some(2)),
        (33, Some(3)),
        (44, None),
    ];
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
    let qp = core.add_qp(QpConfig::new(3, 0, 1)).unwrap();
    let s: Vec<u64> = (0..7)
        .map(|i| submit(&mut core, qp, send_wr(), i))
        .collect();

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
    let qp = core.add_qp(QpConfig::new(16, 0, 3)).unwrap();
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
    let qp = core.add_qp(QpConfig::new(4, 0, 10)).unwrap();
    for i in 0..6 {
        submit(&mut core, qp, send_wr(), i);
    }
    assert_eq!(flags(&take(&mut core, qp)), [false, false, false, true]);

    // signal_every = 1: every send is signaled.
    let mut core: Core<u32> = Core::new();
    let qp = core.add_qp(QpConfig::new(8, 0, 1)).unwrap();
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
                let qp = core
                    .add_qp(QpConfig::new(depth as u32, 0, k as u32))
                    .unwrap();
                let s: Vec<u64> = (0..m)
                    .map(|i| submit(&mut core, qp, send_wr(), i))
                    .collect();

                let first = take(&mut core, qp);
                let n = m.min(depth);
                assert_eq!(ids(&first), &s[..n], "{ctx}");
                assert_eq!(flags(&first), policy(0, depth, k, n), "{ctx}");
                assert_eq!(core.posted(qp), n, "{ctx}");

                // Complete the first signaled send: it retires itself and everything before it.
                let f = flags(&first)
                    .iter()
                    .position(|&x| x)
                    .expect("a batch ends signaled");
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
fn next_signaled_signals_the_send_that_fills_the_queue() {
    // Through `take_postable` the filling send is always the last of its batch (batches are
    // capped at the free space), so the fill rule is checked on the slot itself.
    let mut slot = QpSlot::new(QpConfig::new(3, 0, 100));
    assert!(!slot.next_signaled(false));
    slot.sq_ring.push_back(1);
    assert!(!slot.next_signaled(false));
    slot.sq_ring.push_back(2);
    assert!(slot.next_signaled(false), "fills the queue");
    slot.sq_ring.push_back(3);
    assert_eq!(slot.sq_space(), 0);
    // The run restarted after the signaled one.
    let mut slot = QpSlot::new(QpConfig::new(100, 0, 2));
    let got: Vec<bool> = (0..5).map(|_| slot.next_signaled(false)).collect();
    assert_eq!(got, [false, true, false, true, false]);
    assert!(slot.next_signaled(true), "last of a batch");
    assert!(
        !slot.next_signaled(false),
        "the run restarts after the last of a batch"
    );
}

#[test]
fn signaled_completion_retires_earlier_sends_in_order_and_wakes_each() {
    let mut core: Core<usize> = Core::new();
    let qp = core.add_qp(QpConfig::new(16, 0, 4)).unwrap();
    let s: Vec<u64> = (0..8)
        .map(|i| submit(&mut core, qp, send_wr(), i))
        .collect();
    let w: Vec<Arc<WakeCounter>> = (0..8).map(|_| WakeCounter::new()).collect();
    for (id, w) in s.iter().zip(&w) {
        pending(&mut core, *id, w);
    }
    let posts = take(&mut core, qp);
    assert_eq!(
        flags(&posts),
        [false, false, false, true, false, false, false, true]
    );

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
    let qp = core.add_qp(QpConfig::new(4, 0, 4)).unwrap();
    let s: Vec<u64> = (0..10)
        .map(|i| submit(&mut core, qp, send_wr(), i))
        .collect();
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
    let qa = core.add_qp(QpConfig::new(4, 0, 2)).unwrap();
    let qb = core.add_qp(QpConfig::new(3, 0, 3)).unwrap();
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
    let qa = core.add_qp(QpConfig::new(4, 4, 1)).unwrap();
    let qb = core.add_qp(QpConfig::new(4, 4, 1)).unwrap();
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
