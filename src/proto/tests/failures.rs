//! Errors, flushes, spurious completions, drops at every state, abandon, drain marker.
#![allow(unused_imports)]

use super::*;

// ---------------------------------------------------------------------------------------------
// Errors, failure and flush
// ---------------------------------------------------------------------------------------------

#[test]
fn error_completion_fails_the_op_the_qp_and_every_queued_op() {
    let mut core: Core<u32> = Core::new();
    let qp = core.add_qp(QpConfig::new(4, 2, 2)).unwrap();
    let s: Vec<u64> = (0..6)
        .map(|i| submit(&mut core, qp, send_wr(), i))
        .collect();
    let r: Vec<u64> = (0..3)
        .map(|i| submit(&mut core, qp, recv_wr(), 10 + i))
        .collect();
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
    assert_eq!(
        ws.iter().map(|w| w.count()).collect::<Vec<_>>(),
        [1, 1, 1, 0, 1, 1]
    );
    assert_eq!(wr.iter().map(|w| w.count()).collect::<Vec<_>>(), [0, 0, 1]);
    assert_wc_err(&ready(&mut core, s[2]).0, WcStatus::RemAccessErr, 0x42);
    for id in [s[4], s[5], r[2]] {
        assert_qp_failed(&ready(&mut core, id).0, &cause);
    }
    assert_eq!(
        (core.posted(qp), core.outstanding(qp)),
        (3, 3),
        "s[3], r[0], r[1]"
    );
    assert!(
        !core.remove_qp(qp),
        "posted requests are still owed completions"
    );

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
    assert_ok(&ready(&mut core, s[0]).0, 0, None);
    assert_ok(&ready(&mut core, s[1]).0, 0, None);
    assert_eq!((core.outstanding(qp), core.ops_in_table()), (0, 0));
    assert!(core.remove_qp(qp));
}

#[test]
fn receive_error_fails_the_qp_and_flushes_report_its_cause() {
    let mut core: Core<u32> = Core::new();
    let qp = core.add_qp(QpConfig::new(4, 4, 4)).unwrap();
    let r = submit(&mut core, qp, recv_wr(), 0);
    let s: Vec<u64> = (1..4)
        .map(|i| submit(&mut core, qp, send_wr(), i))
        .collect();
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
    let qp = core.add_qp(QpConfig::new(4, 4, 1)).unwrap();
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
    let qp = core.add_qp(QpConfig::new(4, 4, 3)).unwrap();
    let r: Vec<u64> = (0..3)
        .map(|i| submit(&mut core, qp, recv_wr(), i))
        .collect();
    let s: Vec<u64> = (3..9)
        .map(|i| submit(&mut core, qp, send_wr(), i))
        .collect();
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
    assert!(
        !core.remove_qp(qp),
        "posted requests are still owed completions"
    );
    assert_eq!(core.outstanding(qp), 7);

    // Flush: sends in post order, receives in any order, interleaved.
    let mut resolved = 0;
    for id in [s[0], r[2], s[1], r[0], s[2], s[3], r[1]] {
        let mut out = complete(&mut core, Cqe::with_status(id, WcStatus::WrFlushErr));
        assert_eq!(out.unknown, 0);
        resolved += wake_all(&mut out);
    }
    assert_eq!(resolved, 7);
    assert!(
        w.iter().all(|w| w.count() == 1),
        "each op woken exactly once"
    );
    for &id in &all {
        assert_qp_failed(&ready(&mut core, id).0, &QpFailure::Closed);
    }
    assert_eq!(
        (core.outstanding(qp), core.posted(qp), core.ops_in_table()),
        (0, 0, 0)
    );
    assert!(core.remove_qp(qp));
    assert!(core.remove_qp(qp), "removing an unknown QP is a no-op");
}

#[test]
fn post_failed_fails_the_unposted_suffix_and_the_qp() {
    let mut core: Core<Arc<()>> = Core::new();
    let token = Arc::new(());
    let qp = core.add_qp(QpConfig::new(4, 4, 4)).unwrap();
    let r = submit(&mut core, qp, recv_wr(), token.clone());
    let s: Vec<u64> = (0..3)
        .map(|_| submit(&mut core, qp, send_wr(), token.clone()))
        .collect();
    let r2 = submit(&mut core, qp, recv_wr(), token.clone());
    let posts = take(&mut core, qp);
    assert_eq!(ids(&posts), [r, r2, s[0], s[1], s[2]]);
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
    assert_eq!(core.posted(qp), 3, "r, r2 and s[0] were posted");

    for id in [s[0], r2, r] {
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
    let qp = core.add_qp(QpConfig::new(2, 2, 2)).unwrap();

    // Unknown ids, with success and error statuses (an error must not fail the QP).
    assert_ignored(&mut core, qp, Cqe::success(0x0000_0007_ffff_0000, 1));
    assert_ignored(
        &mut core,
        qp,
        Cqe::with_status(u64::MAX, WcStatus::RemAccessErr),
    );
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

    let out = complete(&mut core, Cqe::success(c, 0));
    assert_eq!(out.postable, [qp]);
    assert_eq!(ids(&take(&mut core, qp)), [e]);
    complete(&mut core, Cqe::success(d, 0));
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
    let _qp = core.add_qp(QpConfig::new(4, 4, 1)).unwrap();
    // A future dropped before its first poll never submitted: nothing to cancel.
    assert!(core.cancel(0).is_none());
    assert!(core.cancel(0x1_0000_0003).is_none());
    assert_eq!(core.ops_in_table(), 0);
}

#[test]
fn drop_while_queued_returns_the_payload_and_never_posts() {
    let token = Arc::new(());
    let mut core: Core<Arc<()>> = Core::new();
    let qp = core.add_qp(QpConfig::new(1, 1, 1)).unwrap();
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
    let p = core
        .cancel(s2)
        .expect("a queued request gives its payload back");
    assert!(Arc::ptr_eq(&p, &token));
    drop(p);
    let p = core
        .cancel(r2)
        .expect("a queued receive gives its payload back");
    drop(p);
    assert_eq!(Arc::strong_count(&token), 5);
    assert_eq!((core.ops_in_table(), core.outstanding(qp)), (4, 4));
    assert!(core.cancel(s2).is_none(), "second cancel is a no-op");

    let out = complete(&mut core, Cqe::success(s1, 0));
    assert_eq!(out.postable, [qp]);
    assert_eq!(
        ids(&take(&mut core, qp)),
        [s3],
        "the dropped s2 is never posted"
    );
    let out = complete(&mut core, cqe_recv(r1, 0, None));
    assert_eq!(out.postable, [qp]);
    assert_eq!(
        ids(&take(&mut core, qp)),
        [r3],
        "the dropped r2 is never posted"
    );
    complete(&mut core, Cqe::success(s3, 0));
    complete(&mut core, cqe_recv(r3, 0, None));
    for id in [s1, r1, s3, r3] {
        assert_ok(&ready(&mut core, id).0, 0, None);
    }
    assert_eq!(w.count(), 0, "a dropped future is not woken");
    assert_eq!(core.ops_in_table(), 0);
    assert_eq!(Arc::strong_count(&token), 1);
}

#[test]
fn drop_after_posting_parks_the_payload_until_the_completion() {
    let token = Arc::new(());
    let mut core: Core<Arc<()>> = Core::new();
    let qp = core.add_qp(QpConfig::new(4, 4, 1)).unwrap();
    let s = submit(&mut core, qp, send_wr(), token.clone());
    let r = submit(&mut core, qp, recv_wr(), token.clone());
    take(&mut core, qp);
    let w = WakeCounter::new();
    pending(&mut core, s, &w);
    pending(&mut core, r, &w);

    assert_eq!(Arc::strong_count(&w), 3, "the core holds both wakers");
    assert!(core.cancel(s).is_none(), "the device may still touch it");
    assert!(core.cancel(r).is_none());
    assert_eq!(
        Arc::strong_count(&w),
        1,
        "a dropped future's waker is not kept alive"
    );
    assert!(core.cancel(s).is_none(), "cancelling twice changes nothing");
    assert_eq!(Arc::strong_count(&token), 3, "both payloads parked");
    assert_eq!((core.ops_in_table(), core.posted(qp)), (2, 2));

    let out = complete(&mut core, Cqe::success(s, 0));
    assert!(
        out.wakers.is_empty(),
        "the waker was dropped with the future"
    );
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
    let qp = core.add_qp(QpConfig::new(8, 0, 4)).unwrap();
    let s: Vec<u64> = (0..4)
        .map(|_| submit(&mut core, qp, send_wr(), token.clone()))
        .collect();
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
    let qp = core.add_qp(QpConfig::new(4, 4, 1)).unwrap();
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
    let qp = core.add_qp(QpConfig::new(3, 2, 2)).unwrap();
    let s: Vec<u64> = (0..5)
        .map(|_| submit(&mut core, qp, send_wr(), token.clone()))
        .collect();
    let r: Vec<u64> = (0..3)
        .map(|_| submit(&mut core, qp, recv_wr(), token.clone()))
        .collect();
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
    let qp = core.add_qp(QpConfig::new(4, 4, 1)).unwrap();
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
    let qa = core.add_qp(QpConfig::new(4, 4, 1)).unwrap();
    let qb = core.add_qp(QpConfig::new(4, 4, 1)).unwrap();
    let a = submit(&mut core, qa, send_wr(), 1);
    take(&mut core, qa);
    complete(&mut core, Cqe::success(a, 5));
    // Completed but not collected: not outstanding, so the QP can go.
    assert_eq!(core.outstanding(qa), 0);
    assert!(core.remove_qp(qa));
    assert_eq!(core.outstanding(qa), 0);
    assert_eq!(core.posted(qa), 0);
    assert!(!core.has_postable(qa));
    assert!(
        matches!(core.failure(qa), Some(QpFailure::Closed)),
        "a removed queue pair reports itself closed"
    );

    let qc = core.add_qp(QpConfig::new(4, 4, 1)).unwrap();
    assert_eq!(qc.index(), qa.index(), "the free index is reused");
    assert_ne!(qc, qa, "with a new generation");
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

#[test]
fn drain_marker_retires_sends_posted_before_a_failed_post() {
    // u1, u2 unsignaled and posted; s3 (signaled, last) rejected by ibv_post_send.
    let mut core: Core<u32> = Core::new();
    let qp = core.add_qp(QpConfig::new(8, 8, 8)).unwrap();
    let u1 = submit(&mut core, qp, send_wr(), 1);
    let u2 = submit(&mut core, qp, send_wr(), 2);
    let s3 = submit(&mut core, qp, send_wr(), 3);
    let posts = take(&mut core, qp);
    assert_eq!(flags(&posts), vec![false, false, true]);
    let mut out = Completed::default();
    core.post_failed(qp, &[s3], libc::EINVAL, &mut out);
    assert_eq!(out.failed, vec![qp]);
    assert!(
        core.has_posted_sends(qp),
        "u1 and u2 are posted and unsignaled"
    );
    let (r3, p3) = ready(&mut core, s3);
    assert_qp_failed(&r3, &QpFailure::PostFailed(libc::EINVAL));
    assert_eq!(p3, 3);
    // u1 and u2 executed silently; the drain marker's flush retires them.
    let marker = core.drain_marker(qp);
    let mut out = complete(&mut core, cqe_err(marker, WcStatus::WrFlushErr, 0));
    assert_eq!(out.unknown, 0);
    wake_all(&mut out);
    assert_ok(&ready(&mut core, u1).0, 0, None);
    assert_ok(&ready(&mut core, u2).0, 0, None);
    assert_eq!(core.posted(qp), 0);
    assert_eq!(core.ops_in_table(), 0, "the marker leaves nothing behind");
    assert!(core.remove_qp(qp));
}

// ---------------------------------------------------------------------------------------------
// Stale queue-pair keys: an index is reused with a new generation
// ---------------------------------------------------------------------------------------------

#[test]
fn a_removed_queue_pairs_key_names_nothing_once_its_index_is_reused() {
    let mut core: Core<&'static str> = Core::new();
    let old = core.add_qp(QpConfig::new(4, 4, 1)).unwrap();
    assert!(core.remove_qp(old));
    let new = core.add_qp(QpConfig::new(4, 4, 1)).unwrap();
    assert_eq!(old.index(), new.index(), "the index is reused");
    assert_ne!(old, new, "with another generation");
    assert!(!core.is_live(old) && core.is_live(new));

    // A future created on the old queue pair and polled only now: an error, never a post on
    // the queue pair that took the index (at 61ac8ac this panicked, or queued on `new`).
    match core.submit_unparked(old, send_wr()) {
        Err(Error::QpFailed(QpFailure::Closed)) => {}
        other => panic!("submit on a removed queue pair: {other:?}"),
    }
    let Err((Error::QpFailed(QpFailure::Closed), "buf")) = core.submit(old, recv_wr(), "buf")
    else {
        panic!("submit with a payload on a removed queue pair must give it back");
    };
    assert_eq!(core.outstanding(new), 0);
    assert!(take(&mut core, old).is_empty());

    // Failing or abandoning the stale key touches nothing of the new queue pair.
    let r = submit(&mut core, new, recv_wr(), "new-recv");
    let mut out = Completed::default();
    core.fail_qp(old, QpFailure::Flushed, &mut out);
    core.abandon_qp(old, &mut out);
    assert!(out.is_empty(), "{out:?}");
    assert!(core.failure(new).is_none());
    assert_eq!(ids(&take(&mut core, new)), [r]);
    assert_eq!(core.posted(new), 1);
}

#[test]
fn generations_wrap_only_after_many_reuses() {
    let mut core: Core<()> = Core::new();
    let first = core.add_qp(QpConfig::new(1, 1, 1)).unwrap();
    assert!(core.remove_qp(first));
    let mut seen = vec![first];
    for _ in 0..2000 {
        let k = core.add_qp(QpConfig::new(1, 1, 1)).unwrap();
        assert!(
            !seen.contains(&k),
            "key {k:?} reused within 2000 generations"
        );
        seen.push(k);
        assert!(core.remove_qp(k));
    }
}
