//! `Core::submit_posted`, the driver's fast path (a request posted straight from its future):
//! the same wr_ids, order, signaling and outcomes as queueing it and taking it back with
//! `take_postable`, and the same failure handling.

use std::task::Poll;

use super::storm_model::Rng;
use super::*;

/// What one core handed to the device, in order: `(wr_id, queue, signaled)`.
type Posted = Vec<(u64, Queue, bool)>;

/// Submits through the queue (`submit_unparked` + `take_postable`), the reference.
fn queued<P>(core: &mut Core<P>, qp: QpKey, wr: WorkRequest, dev: &mut Posted) -> u64 {
    let id = core.submit_unparked(qp, wr).expect("healthy").wr_id;
    for p in take(core, qp) {
        dev.push((p.wr_id, p.wr.queue, p.signaled));
    }
    id
}

/// Submits as the driver does: straight to the device when it can go now, else queued.
fn direct<P>(core: &mut Core<P>, qp: QpKey, wr: WorkRequest, dev: &mut Posted) -> u64 {
    match core.submit_posted(qp, wr.queue).expect("healthy") {
        Some((id, signaled)) => {
            dev.push((id, wr.queue, signaled));
            id
        }
        None => queued(core, qp, wr, dev),
    }
}

#[test]
fn a_lone_request_goes_at_once_signaled_and_completes_as_a_queued_one() {
    let mut core: Core<()> = Core::new();
    let qp = core.add_qp(QpConfig::new(2, 1, 4)).unwrap();
    let (s, signaled) = core.submit_posted(qp, Queue::Send).unwrap().unwrap();
    assert!(signaled, "a lone send is the last of its batch");
    let (r, _) = core.submit_posted(qp, Queue::Recv).unwrap().unwrap();
    assert_eq!((core.outstanding(qp), core.posted(qp)), (2, 2));
    assert!(take(&mut core, qp).is_empty(), "nothing is posted twice");
    // The receive queue is full: the next receive must queue.
    assert_eq!(core.submit_posted(qp, Queue::Recv).unwrap(), None);
    let out = complete(&mut core, cqe_recv(r, 9, None));
    assert!(out.is_empty() && out.unknown == 0, "{out:?}");
    assert!(matches!(
        core.poll_result(r, None),
        Poll::Ready(Ok(OpInfo { byte_len: 9, .. }))
    ));
    complete(&mut core, Cqe::success(s, 0));
    assert!(matches!(core.poll_result(s, None), Poll::Ready(Ok(_))));
    assert_eq!(core.ops_in_table(), 0);
    assert!(core.remove_qp(qp));
}

#[test]
fn a_request_behind_queued_ones_queues_too_so_order_holds() {
    let mut core: Core<()> = Core::new();
    let qp = core.add_qp(QpConfig::new(1, 4, 1)).unwrap();
    let mut dev = Posted::new();
    let a = direct(&mut core, qp, send_wr(), &mut dev);
    let b = direct(&mut core, qp, send_wr(), &mut dev);
    assert_eq!(dev.len(), 1, "the queue holds one send");
    let out = complete(&mut core, Cqe::success(a, 0));
    assert_eq!(out.postable, [qp], "b waits for the space a freed");
    // Space again, but b is queued: c must not overtake it.
    assert_eq!(core.submit_posted(qp, Queue::Send).unwrap(), None);
    let c = queued(&mut core, qp, send_wr(), &mut dev);
    assert_eq!(dev.iter().map(|d| d.0).collect::<Vec<_>>(), [a, b]);
    complete(&mut core, Cqe::success(b, 0));
    for p in take(&mut core, qp) {
        dev.push((p.wr_id, p.wr.queue, p.signaled));
    }
    assert_eq!(dev.iter().map(|d| d.0).collect::<Vec<_>>(), [a, b, c]);
}

#[test]
fn a_failed_or_removed_queue_pair_refuses_the_fast_path_with_its_cause() {
    let mut core: Core<()> = Core::new();
    let qp = core.add_qp(QpConfig::new(4, 4, 1)).unwrap();
    let (s, _) = core.submit_posted(qp, Queue::Send).unwrap().unwrap();
    // The post itself failed: the request fails with the errno, and so does the queue pair.
    let mut out = Completed::default();
    core.post_failed(qp, &[s], libc::ENOMEM, &mut out);
    assert_eq!(out.failed, [qp]);
    match core.poll_result(s, None).map(|r| r.map_err(|e| *e)) {
        Poll::Ready(Err(Error::QpFailed(QpFailure::PostFailed(e)))) => assert_eq!(e, libc::ENOMEM),
        other => panic!("{other:?}"),
    }
    assert!(
        !core.has_posted_sends(qp),
        "nothing left for a drain marker"
    );
    match core.submit_posted(qp, Queue::Recv) {
        Err(Error::QpFailed(QpFailure::PostFailed(e))) => assert_eq!(e, libc::ENOMEM),
        other => panic!("{other:?}"),
    }
    assert!(core.remove_qp(qp));
    assert!(matches!(
        core.submit_posted(qp, Queue::Send),
        Err(Error::QpFailed(QpFailure::Closed))
    ));
}

/// Random submits (sends and receives, two queue pairs, small queues, selective signaling)
/// and completions in device order, fed to two cores: one queues every request, the other
/// takes the fast path whenever it says yes. Both must hand the device the same requests
/// (ids, order, signaling) and report the same outcomes.
#[test]
fn the_fast_path_is_indistinguishable_from_queueing() {
    for seed in 1..=300u64 {
        let mut rng = Rng::new(seed);
        let mut a: Core<()> = Core::new();
        let mut b: Core<()> = Core::new();
        let cfgs = [
            QpConfig::new(
                rng.range(1, 4) as u32,
                rng.range(1, 3) as u32,
                rng.range(1, 3) as u32,
            ),
            QpConfig::new(rng.range(1, 4) as u32, rng.range(1, 3) as u32, 1),
        ];
        let keys: Vec<(QpKey, QpKey)> = cfgs
            .iter()
            .map(|c| (a.add_qp(*c).unwrap(), b.add_qp(*c).unwrap()))
            .collect();
        let (mut dev_a, mut dev_b) = (Posted::new(), Posted::new());
        // Posted and not yet completed, per queue pair and queue, in post order.
        let mut sq: [VecDeque<u64>; 2] = Default::default();
        let mut rq: [VecDeque<u64>; 2] = Default::default();
        let mut seen = 0;
        let mut ids = Vec::new();
        // Which queue pair each request went to.
        let mut qp_of = std::collections::HashMap::new();
        for _ in 0..200 {
            let q = rng.below(2);
            let (ka, kb) = keys[q];
            match rng.below(4) {
                0 | 1 => {
                    let wr = if rng.chance(1, 2) {
                        send_wr()
                    } else {
                        recv_wr()
                    };
                    let ia = queued(&mut a, ka, wr.clone(), &mut dev_a);
                    let ib = direct(&mut b, kb, wr, &mut dev_b);
                    assert_eq!(ia, ib, "seed {seed}: wr_ids differ");
                    ids.push(ia);
                    qp_of.insert(ia, q);
                }
                _ => {
                    // The device completes the oldest posted request of one queue (a send
                    // completes only if it was signaled; unsignaled ones retire with it).
                    let recv = rng.chance(1, 2);
                    let list = if recv { &mut rq[q] } else { &mut sq[q] };
                    let Some(id) = list.pop_front() else { continue };
                    let cqe = if recv {
                        cqe_recv(id, 3, None)
                    } else {
                        Cqe::success(id, 0)
                    };
                    let (oa, ob) = (complete(&mut a, cqe), complete(&mut b, cqe));
                    assert_eq!(oa.postable, ob.postable, "seed {seed}");
                    // The driver posts what the completion made room for, but a submit may
                    // come first (it then must not overtake the queued requests).
                    let post_now = rng.chance(1, 2);
                    for (core, dev, key) in [(&mut a, &mut dev_a, ka), (&mut b, &mut dev_b, kb)] {
                        if post_now && core.has_postable(key) {
                            for p in take(core, key) {
                                dev.push((p.wr_id, p.wr.queue, p.signaled));
                            }
                        }
                    }
                }
            }
            assert_eq!(
                dev_a, dev_b,
                "seed {seed}: the device saw different requests"
            );
            // Newly posted requests join their queue's device list (signaled sends only: an
            // unsignaled one never completes by itself).
            for &(id, queue, signaled) in &dev_a[seen..] {
                let q = qp_of[&id];
                match queue {
                    Queue::Recv => rq[q].push_back(id),
                    Queue::Send if signaled => sq[q].push_back(id),
                    Queue::Send => {}
                }
            }
            seen = dev_a.len();
        }
        for id in ids {
            let (ra, rb) = (a.poll_result(id, None), b.poll_result(id, None));
            assert_eq!(
                format!("{ra:?}"),
                format!("{rb:?}"),
                "seed {seed}: op {id:#x}"
            );
        }
        for (ka, kb) in keys {
            assert_eq!(a.outstanding(ka), b.outstanding(kb), "seed {seed}");
            assert_eq!(a.posted(ka), b.posted(kb), "seed {seed}");
        }
    }
}

/// One index reused more times than the key's generation field counts (2^11): every new queue
/// pair at that index is live and takes work, and the key of an earlier one never names it. A
/// server that accepts connections one after another reuses index 0 for each.
#[test]
fn an_index_reused_past_the_generation_width_stays_usable_and_stale_keys_stay_dead() {
    let mut core: Core<u32> = Core::new();
    let mut earlier = Vec::new();
    for round in 0..5_000 {
        let qp = core.add_qp(QpConfig::new(4, 4, 1)).unwrap();
        assert_eq!(qp.index(), 0);
        assert!(
            core.is_live(qp),
            "round {round}: a new queue pair is not live"
        );
        let (s, signaled) = core
            .submit_posted(qp, Queue::Send)
            .unwrap_or_else(|e| panic!("round {round}: a new queue pair refuses work: {e}"))
            .expect("room");
        assert!(signaled);
        let mut out = Completed::default();
        core.complete(&Cqe::success(s, 0), &mut out);
        assert_eq!(out.unknown, 0);
        assert!(core.poll_result(s, None).is_ready());
        for &old in earlier.iter().rev().take(3) {
            assert!(
                !core.is_live(old),
                "round {round}: an old key names the new queue pair"
            );
        }
        assert!(core.remove_qp(qp));
        earlier.push(qp);
    }
}

/// A receive consumed by an RDMA WRITE with immediate reports no bytes: the completion's count
/// is the write's, whose data went to the write's target (`Recv` sets the buffer's initialised
/// length from it). Before: `OpInfo { byte_len: 4096, .. }`.
#[test]
fn a_receive_consumed_by_a_write_with_immediate_reports_no_bytes() {
    let mut core: Core<()> = Core::new();
    let qp = core.add_qp(QpConfig::new(2, 2, 4)).unwrap();
    let (r, _) = core.submit_posted(qp, Queue::Recv).unwrap().unwrap();
    let mut cqe = cqe_recv(r, 4096, Some(7));
    cqe.opcode = WcOpcode::RecvRdmaWithImm;
    complete(&mut core, cqe);
    assert!(matches!(
        core.poll_result(r, None),
        Poll::Ready(Ok(OpInfo {
            byte_len: 0,
            imm: Some(7)
        }))
    ));
}

/// `submit_posted_sends` (a batch posted straight from its storage): the same ids, order and
/// signaling as queueing the sends and taking them back; only the last of a batch (and every
/// `signal_every`-th) is signaled, and its completion completes the others.
#[test]
fn a_batch_of_sends_goes_at_once_like_queued_ones_and_completes_by_its_last() {
    for (depth, every, n) in [(16, 16, 16), (16, 4, 9), (8, 16, 8), (4, 1, 3)] {
        let mut a: Core<()> = Core::new();
        let mut b: Core<()> = Core::new();
        let (ka, kb) = (
            a.add_qp(QpConfig::new(depth, 1, every)).unwrap(),
            b.add_qp(QpConfig::new(depth, 1, every)).unwrap(),
        );
        let mut dev_a = Posted::new();
        for _ in 0..n {
            a.submit_unparked(ka, send_wr()).unwrap();
        }
        for p in take(&mut a, ka) {
            dev_a.push((p.wr_id, p.wr.queue, p.signaled));
        }
        let mut dev_b = Posted::new();
        let went = b
            .submit_posted_sends(kb, n, |i, id, s| {
                assert_eq!(i, dev_b.len());
                dev_b.push((id, Queue::Send, s));
            })
            .unwrap();
        assert!(went, "room for {n} of {depth}");
        assert_eq!(dev_a, dev_b, "depth {depth} every {every} n {n}");
        assert!(dev_b.last().unwrap().2, "the last is signaled");
        assert!(take(&mut b, kb).is_empty(), "nothing is posted twice");
        for &(id, _, signaled) in &dev_b {
            if signaled {
                complete(&mut b, Cqe::success(id, 0));
            }
        }
        for &(id, _, _) in &dev_b {
            assert!(matches!(b.poll_result(id, None), Poll::Ready(Ok(_))));
        }
        assert_eq!((b.outstanding(kb), b.ops_in_table()), (0, 0));
    }
}

#[test]
fn a_batch_without_room_or_behind_queued_sends_is_refused_and_submits_nothing() {
    let mut core: Core<()> = Core::new();
    let qp = core.add_qp(QpConfig::new(4, 1, 16)).unwrap();
    let never = |_: usize, _: u64, _: bool| panic!("nothing may be submitted");
    assert_eq!(core.submit_posted_sends(qp, 5, never), Ok(false));
    assert_eq!(core.ops_in_table(), 0);
    // Two posted, two free: a batch of three waits.
    assert!(core.submit_posted_sends(qp, 2, |_, _, _| {}).unwrap());
    assert_eq!(core.submit_posted_sends(qp, 3, never), Ok(false));
    // A queued send with room (the driver has not posted it yet) goes before any batch.
    core.submit_unparked(qp, send_wr()).unwrap();
    assert_eq!(core.submit_posted_sends(qp, 1, never), Ok(false));
    assert_eq!(core.outstanding(qp), 3);
    core.fail_qp(
        qp,
        QpFailure::PostFailed(libc::EIO),
        &mut Completed::default(),
    );
    assert_eq!(
        core.submit_posted_sends(qp, 1, never),
        Err(QpFailure::PostFailed(libc::EIO))
    );
    let gone = core.add_qp(QpConfig::new(4, 1, 16)).unwrap();
    assert!(core.remove_qp(gone));
    assert_eq!(
        core.submit_posted_sends(gone, 1, never),
        Err(QpFailure::Closed)
    );
}

/// A batch whose second request fails on the device: the first (unsignaled, executed before
/// it) succeeds, the second reports its status, and the rest, flushed, the queue pair's
/// failure; every request has its outcome and the table empties.
#[test]
fn a_batch_failing_in_the_middle_gives_each_request_its_outcome() {
    let mut core: Core<()> = Core::new();
    let qp = core.add_qp(QpConfig::new(16, 1, 16)).unwrap();
    let mut ids = Vec::new();
    assert!(
        core.submit_posted_sends(qp, 4, |_, id, _| ids.push(id))
            .unwrap()
    );
    let none = |i: usize, e: Error| panic!("request {i} failed: {e}");
    assert_eq!(core.collect_done(&ids, none), 0, "nothing complete yet");
    let out = complete(&mut core, cqe_err(ids[1], WcStatus::RemAccessErr, 0));
    assert_eq!(out.failed, [qp]);
    for &id in &ids[2..] {
        complete(&mut core, cqe_err(id, WcStatus::WrFlushErr, 0));
    }
    let mut failed = Vec::new();
    assert_eq!(core.collect_done(&ids, |i, e| failed.push((i, e))), 4);
    assert_eq!(failed.iter().map(|f| f.0).collect::<Vec<_>>(), [1, 2, 3]);
    for (i, e) in failed {
        match e {
            Error::QpFailed(QpFailure::WorkCompletion { status, .. }) => {
                assert_eq!(status, WcStatus::RemAccessErr, "request {i}")
            }
            other => panic!("request {i}: {other:?}"),
        }
    }
    assert_eq!(core.ops_in_table(), 0);
}

/// `collect_done` stops at the first request without its outcome and takes nothing past it;
/// the same requests collected one by one with `poll_result` give the same outcomes.
#[test]
fn collecting_a_batch_stops_at_the_first_incomplete_request() {
    let mut core: Core<()> = Core::new();
    // Every other send signaled: the first two complete together, the last two wait.
    let qp = core.add_qp(QpConfig::new(16, 1, 2)).unwrap();
    let mut ids = Vec::new();
    assert!(
        core.submit_posted_sends(qp, 4, |_, id, _| ids.push(id))
            .unwrap()
    );
    complete(&mut core, Cqe::success(ids[1], 0));
    let none = |i: usize, e: Error| panic!("request {i} failed: {e}");
    assert_eq!(core.collect_done(&ids, none), 2);
    assert_eq!(core.ops_in_table(), 2, "the incomplete ones stay");
    assert!(core.poll_result(ids[2], None).is_pending());
    complete(&mut core, Cqe::success(ids[3], 0));
    assert_eq!(core.collect_done(&ids[2..], none), 2);
    assert_eq!(core.ops_in_table(), 0);
}
