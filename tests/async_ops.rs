//! Device tests of the async engine: every operation kind round-trips on rxe with data
//! verified. Run in the soft-RoCE VM (`scripts/test`); ignored on hosts without a device.
#![allow(clippy::print_stdout)]

mod common;

use common::{all_access, async_pair, pattern, posted, reg_with, within};
use tokio_rdma::buf::{IoBuf, RemoteToken};
use tokio_rdma::ops::BufList;
use tokio_rdma::verbs::{AccessFlags, RegisteredBuffer};

fn token(b: &RegisteredBuffer) -> RemoteToken {
    RemoteToken::new(b.addr(), b.len() as u64, b.rkey())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn send_recv_sizes() {
    let p = async_pair();
    let inline_max = p.a.caps().max_inline_data as usize;
    for (i, len) in [0usize, 1, inline_max, 4096, 1 << 20]
        .into_iter()
        .enumerate()
    {
        let data = pattern(len, i as u8);
        let tx = reg_with(&p.pd, &data, AccessFlags::LOCAL_WRITE);
        let rx = RegisteredBuffer::new(&p.pd, len.max(1), AccessFlags::LOCAL_WRITE).unwrap();
        let recv = posted(p.b.recv(rx));
        let send = p.a.send(tx.slice(0..len));
        let ((rres, rx), (sres, _tx)) =
            within(60, "send/recv", async { tokio::join!(recv, send) }).await;
        sres.unwrap_or_else(|e| panic!("send of {len} bytes: {e}"));
        let info = rres.unwrap_or_else(|e| panic!("recv of {len} bytes: {e}"));
        assert_eq!(info.len, len);
        assert_eq!(info.imm, None);
        assert_eq!(&rx.to_vec()[..len], &data[..], "payload of {len} bytes");
        println!("send/recv {len} bytes ok");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn send_with_imm_and_sg_lists() {
    let p = async_pair();
    let parts = [pattern(100, 1), pattern(3000, 2), pattern(1, 3)];
    let tx = BufList(
        parts
            .iter()
            .map(|d| reg_with(&p.pd, d, AccessFlags::LOCAL_WRITE))
            .collect(),
    );
    // Receive into two buffers: 2000 + 4096 bytes.
    let rx = BufList(vec![
        RegisteredBuffer::new(&p.pd, 2000, AccessFlags::LOCAL_WRITE).unwrap(),
        RegisteredBuffer::new(&p.pd, 4096, AccessFlags::LOCAL_WRITE).unwrap(),
    ]);
    let (r, s) = within(60, "sg send", async {
        tokio::join!(posted(p.b.recv(rx)), p.a.send_with_imm(tx, 0x5eed))
    })
    .await;
    s.0.unwrap();
    let (info, rx) = (r.0.unwrap(), r.1);
    assert_eq!(info.imm, Some(0x5eed));
    assert_eq!(info.len, 3101);
    let got: Vec<u8> = rx.0.iter().flat_map(|b| b.to_vec()).take(3101).collect();
    let want: Vec<u8> = parts.concat();
    assert_eq!(got, want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn write_read_and_write_with_imm() {
    let p = async_pair();
    let len = 1 << 20;
    let target = RegisteredBuffer::new(&p.pd, len, all_access()).unwrap();
    let data = pattern(len, 9);
    let src = reg_with(&p.pd, &data, AccessFlags::LOCAL_WRITE);
    let (res, src) = within(60, "write", p.a.write(src, token(&target))).await;
    res.unwrap();
    assert_eq!(target.to_vec(), data);

    for n in [1usize, 64, 4096] {
        let dst = RegisteredBuffer::new(&p.pd, n, AccessFlags::LOCAL_WRITE).unwrap();
        let remote = token(&target).slice(777..777 + n as u64).unwrap();
        let (res, dst) = within(60, "read", p.a.read(dst, remote)).await;
        res.unwrap();
        assert_eq!(dst.to_vec(), &data[777..777 + n], "read {n}");
    }

    // WRITE with immediate consumes a (zero-length) receive at the peer.
    let small = src.slice(0..4096);
    let recv = posted(p.b.recv(Vec::<u8>::new()));
    let write =
        p.a.write_with_imm(small, token(&target).slice(8192..).unwrap(), 77);
    let ((rres, _), (wres, _)) =
        within(60, "write_with_imm", async { tokio::join!(recv, write) }).await;
    wres.unwrap();
    let info = rres.unwrap();
    assert_eq!(info.imm, Some(77));

    // Local length beyond the remote token: rejected before posting.
    let big = RegisteredBuffer::new(&p.pd, 8192, AccessFlags::LOCAL_WRITE).unwrap();
    let (res, _big) = p.a.write(big, token(&target).slice(0..4096).unwrap()).await;
    let err = res.unwrap_err();
    assert!(
        matches!(err, tokio_rdma::Error::InvalidArgument(_)),
        "{err}"
    );
    assert!(
        p.a.failure().is_none(),
        "a rejected op does not fail the queue pair"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn atomics_return_previous_values() {
    let p = async_pair();
    let mut target = RegisteredBuffer::new(&p.pd, 64, all_access()).unwrap();
    target.write_at(8, &100u64.to_ne_bytes());
    let remote = token(&target).slice(8..16).unwrap();
    let buf = RegisteredBuffer::new(&p.pd, 8, AccessFlags::LOCAL_WRITE).unwrap();
    let (prev, buf) = within(60, "fetch_add", p.a.fetch_add(buf, remote, 5)).await;
    assert_eq!(prev.unwrap(), 100);
    let (prev, buf) = within(60, "cas miss", p.a.compare_swap(buf, remote, 1, 2)).await;
    assert_eq!(prev.unwrap(), 105, "compare failed: value unchanged");
    let (prev, _buf) = within(60, "cas hit", p.a.compare_swap(buf, remote, 105, 7)).await;
    assert_eq!(prev.unwrap(), 105);
    let mut now = [0u8; 8];
    target.read_at(8, &mut now);
    assert_eq!(u64::from_ne_bytes(now), 7);
    // Misaligned targets are rejected before posting.
    let buf = RegisteredBuffer::new(&p.pd, 8, AccessFlags::LOCAL_WRITE).unwrap();
    let (res, _) =
        p.a.fetch_add(buf, token(&target).slice(3..11).unwrap(), 1)
            .await;
    assert!(matches!(res, Err(tokio_rdma::Error::InvalidArgument(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn remote_access_error_fails_the_qp_and_everything_after() {
    let p = async_pair();
    let target = RegisteredBuffer::new(&p.pd, 4096, all_access()).unwrap();
    let src = RegisteredBuffer::new(&p.pd, 8192, AccessFlags::LOCAL_WRITE).unwrap();
    // A forged token one page longer than the region: the device rejects it.
    let forged = RemoteToken::new(target.addr(), 8192, target.rkey());
    let (res, src) = within(60, "bad write", p.a.write(src, forged)).await;
    let err = res.unwrap_err();
    assert!(
        matches!(
            err,
            tokio_rdma::Error::QpFailed(tokio_rdma::QpFailure::WorkCompletion {
                status: tokio_rdma::WcStatus::RemAccessErr,
                ..
            })
        ),
        "{err}"
    );
    // New ops fail fast with the same cause.
    let (res, _) = p.a.send(src).await;
    let err = res.unwrap_err();
    assert!(
        matches!(
            &err,
            tokio_rdma::Error::QpFailed(tokio_rdma::QpFailure::WorkCompletion {
                status: tokio_rdma::WcStatus::RemAccessErr,
                ..
            })
        ),
        "{err}"
    );
    let io: std::io::Error = err.into();
    assert_eq!(io.kind(), std::io::ErrorKind::PermissionDenied);
    println!("stats: {:?}", p.driver.stats());
}

#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn ops_started_in_one_wake_share_one_doorbell() {
    let p = async_pair();
    let target = RegisteredBuffer::new(&p.pd, 64 * 64, all_access()).unwrap();
    let before = p.driver.stats();
    let ops: Vec<_> = (0..64u64)
        .map(|i| {
            let src = reg_with(&p.pd, &pattern(64, i as u8), AccessFlags::LOCAL_WRITE);
            p.a.write(src, token(&target).slice(i * 64..(i + 1) * 64).unwrap())
        })
        .collect();
    let results = within(60, "64 writes", futures::future::join_all(ops)).await;
    for (res, _) in results {
        res.unwrap();
    }
    let after = p.driver.stats();
    let doorbells = after.doorbells - before.doorbells;
    let posted = after.posted - before.posted;
    println!(
        "64 writes started in one wake: {posted} work requests, {doorbells} doorbell(s), {} completions",
        after.completions - before.completions
    );
    assert_eq!(posted, 64);
    assert_eq!(
        doorbells, 1,
        "coalescing posts everything queued in one wake as one chained list"
    );
    // Selective signaling: 64 writes, signal every 16th and the last: 4 completions.
    assert_eq!(after.completions - before.completions, 4);
    for i in 0..64u64 {
        let mut b = vec![0u8; 64];
        target.read_at(i as usize * 64, &mut b);
        assert_eq!(b, pattern(64, i as u8));
    }
}

/// In busy and adaptive modes a waiting operation polls the CQ in place, but not its full
/// count (64) on its first polls while an operation future of its driver waits to be posted:
/// beside it in the same task, as in `join!(recv, send)` or after `poll!(&mut recv)` to post a
/// receive before answering, 64 empty polls before the send went out delayed every ping
/// (`send_lat` 2 B busy at 4-5x perftest's). With nothing waiting to be posted it spins its
/// full count from its first poll: each ramp round that found nothing was a trip through the
/// runtime. Adaptive mode spins in place as busy mode does (it polled once per poll of the
/// future, `[1, 1, 1, 1]`, and every empty poll was a trip through the runtime). Counted, not
/// timed: nothing can complete the receives until the sends below, and on the current-thread
/// runtime the completion task cannot run while the test polls by hand.
#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_waiting_operation_does_not_spin_its_full_count_before_its_siblings_run() {
    use tokio_rdma::driver::CompletionMode;
    for mode in [CompletionMode::BusyPoll, CompletionMode::default()] {
        let mut qp = tokio_rdma::driver::QpOptions::default();
        qp.coalesce = false;
        let p =
            common::async_pair_with(tokio_rdma::driver::DriverOptions::default().mode(mode), qp);
        // A send made and not polled yet: the receive beside it ramps.
        let data = pattern(48, 7);
        let send = p.a.send(reg_with(&p.pd, &data, AccessFlags::LOCAL_WRITE));
        let rx = RegisteredBuffer::new(&p.pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
        let mut recv = Box::pin(p.b.recv(rx));
        let mut in_place = Vec::new();
        for _ in 0..4 {
            let before = p.driver.stats().polled_in_place;
            assert!(futures::poll!(&mut recv).is_pending(), "nothing was sent");
            in_place.push(p.driver.stats().polled_in_place - before);
        }
        println!("{mode:?}: in-place polls of the receive's first four polls: {in_place:?}");
        assert_eq!(in_place, [1, 4, 16, 64], "{mode:?}");
        // The receive still gets the message sent after it.
        let ((rres, rx), (sres, _)) =
            within(60, "send/recv", async { tokio::join!(recv, send) }).await;
        sres.unwrap();
        assert_eq!(rres.unwrap().len, data.len());
        assert_eq!(&rx.to_vec()[..data.len()], &data[..]);
        // Alone (nothing made and not posted): the full count from the first poll.
        let rx = RegisteredBuffer::new(&p.pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
        let mut alone = Box::pin(p.b.recv(rx));
        let before = p.driver.stats().polled_in_place;
        assert!(futures::poll!(&mut alone).is_pending(), "nothing was sent");
        let first = p.driver.stats().polled_in_place - before;
        println!("{mode:?}: in-place polls of a lone receive's first poll: {first}");
        assert_eq!(first, 64, "{mode:?}");
        // A send made and dropped unpolled posts nothing and holds nothing back.
        drop(p.a.send(reg_with(&p.pd, &data, AccessFlags::LOCAL_WRITE)));
        let before = p.driver.stats().polled_in_place;
        assert!(futures::poll!(&mut alone).is_pending(), "nothing was sent");
        assert_eq!(p.driver.stats().polled_in_place - before, 64, "{mode:?}");
        let data = pattern(33, 9);
        let ((rres, rx), (sres, _)) = within(60, "send/recv alone", async {
            tokio::join!(
                alone,
                p.a.send(reg_with(&p.pd, &data, AccessFlags::LOCAL_WRITE))
            )
        })
        .await;
        sres.unwrap();
        assert_eq!(rres.unwrap().len, data.len());
        assert_eq!(&rx.to_vec()[..data.len()], &data[..]);
    }
}

/// `start` posts and does nothing else: no in-place poll, no round of the in-place ramp (the
/// first real poll beside a future not posted yet polls once, as a fresh future's does, not
/// four times), and no turn as a
/// spinner or a sleeper (one that joined and left the spinners handed the CQ to the
/// completion task, which armed it: `send_lat` 2 B adaptive with its receive started went
/// from 24-31 µs to 84-97 µs). Counted, not timed: on the current-thread runtime nothing
/// polls the CQ while the test does not.
#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn start_posts_without_polling_or_spinning() {
    use tokio_rdma::driver::{CompletionMode, DriverOptions, QpOptions};
    for mode in [
        CompletionMode::BusyPoll,
        CompletionMode::default(),
        CompletionMode::Event,
    ] {
        // Coalescing on: `start` posts at once all the same.
        let mut qp = QpOptions::default();
        qp.coalesce = true;
        let p = common::async_pair_with(DriverOptions::default().mode(mode), qp);
        let before = p.driver.stats();
        let mut recvs: Vec<_> = (0..4)
            .map(|_| {
                let rx = RegisteredBuffer::new(&p.pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
                let mut r = p.b.recv(rx);
                r.start();
                r
            })
            .collect();
        let after = p.driver.stats();
        assert_eq!(after.posted - before.posted, 4, "{mode:?}: posted at once");
        assert_eq!(
            after.polled_in_place - before.polled_in_place,
            0,
            "{mode:?}: start polls nothing"
        );
        // A send made and not polled: the started receive's wait ramps.
        let held =
            p.a.send(reg_with(&p.pd, &[1u8; 8], AccessFlags::LOCAL_WRITE));
        let before = after.polled_in_place;
        assert!(
            futures::poll!(&mut recvs[0]).is_pending(),
            "nothing was sent"
        );
        drop(held);
        let first = p.driver.stats().polled_in_place - before;
        let want = if mode == CompletionMode::Event { 0 } else { 1 };
        println!("{mode:?}: in-place polls of a started receive's first poll: {first}");
        assert_eq!(
            first, want,
            "{mode:?}: the first poll is the ramp's first round"
        );
        for i in 0..4u8 {
            let data = pattern(40 + usize::from(i), i);
            let (res, _) = within(
                60,
                "send",
                p.a.send(reg_with(&p.pd, &data, AccessFlags::LOCAL_WRITE)),
            )
            .await;
            res.unwrap();
        }
        for (i, r) in recvs.into_iter().enumerate() {
            let (res, rx) = within(60, "a started receive", r).await;
            let data = pattern(40 + i, i as u8);
            assert_eq!(res.unwrap().len, data.len(), "{mode:?}");
            assert_eq!(&rx.to_vec()[..data.len()], &data[..], "{mode:?}");
        }
    }
}

/// Event mode: a future that waits alone watches the completion channel itself, so a CQ event
/// wakes its task directly and the completion task is not run per operation
/// (`driver::watch`). Then futures of two tasks wait at once (the completion task watches
/// for both), then one of a join of two in one task, and a watching future dropped while it
/// waits: every operation completes, with the right bytes.
#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_lone_sleeper_watches_the_channel_and_hands_over_to_others() {
    use tokio_rdma::driver::{CompletionMode, DriverOptions, QpOptions};
    let p = std::sync::Arc::new(common::async_pair_with(
        DriverOptions::default().mode(CompletionMode::Event),
        QpOptions::default(),
    ));
    let len = 4096;
    let data = pattern(len, 3);
    let target = reg_with(&p.pd, &data, all_access());
    let remote = token(&target);
    let n = 200u64;
    let before = p.driver.stats();
    let mut dst = RegisteredBuffer::new(&p.pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    for i in 0..n {
        let at = (i * 8) % (len as u64 - 64);
        let (res, d) = within(
            60,
            "read",
            p.a.read(dst, remote.slice(at..at + 64).unwrap()),
        )
        .await;
        res.unwrap();
        assert_eq!(d.to_vec(), &data[at as usize..at as usize + 64]);
        dst = d;
    }
    let after = p.driver.stats();
    let runs = after.task_wakeups - before.task_wakeups;
    let events = after.cq_events - before.cq_events;
    println!("{n} lone reads: {runs} completion-task runs, {events} CQ events");
    assert!(events >= n / 2, "the reads slept on CQ events: {events}");
    assert!(
        runs < n / 10,
        "a lone waiter's events woke its own task, not the completion task: {runs} runs"
    );

    // A join of a send and its receive in one task: both sleep in the watch task.
    let before = p.driver.stats();
    for i in 0..50u8 {
        let msg = pattern(32, i);
        let recv =
            p.b.recv(RegisteredBuffer::new(&p.pd, 64, AccessFlags::LOCAL_WRITE).unwrap());
        let recv = posted(recv);
        let send = p.a.send(reg_with(&p.pd, &msg, AccessFlags::LOCAL_WRITE));
        let ((rres, rx), (sres, _)) = within(60, "join", async { tokio::join!(recv, send) }).await;
        sres.unwrap();
        assert_eq!(rres.unwrap().len, 32);
        assert_eq!(&rx.to_vec()[..32], &msg[..]);
    }
    let runs = p.driver.stats().task_wakeups - before.task_wakeups;
    println!("50 joins of a send and its receive: {runs} completion-task runs");
    assert!(runs < 10, "one task's sleepers watch together: {runs} runs");

    // Two tasks wait at once: the second one's sleep hands the channel to the completion
    // task, which wakes both.
    for round in 0..20u8 {
        let q = p.clone();
        let waiting = tokio::spawn(async move {
            let rx = RegisteredBuffer::new(&q.pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
            let (res, rx) = q.b.recv(rx).await;
            (res.unwrap().len, rx.to_vec())
        });
        // Let the receive go to sleep (it becomes the watcher) before this task waits.
        tokio::task::yield_now().await;
        tokio::task::yield_now().await;
        let msg = pattern(16, round);
        let (res, _) = within(
            60,
            "a send beside another task's receive",
            p.a.send(reg_with(&p.pd, &msg, AccessFlags::LOCAL_WRITE)),
        )
        .await;
        res.unwrap();
        let (len, got) = within(60, "the other task's receive", waiting)
            .await
            .unwrap();
        assert_eq!(len, 16);
        assert_eq!(&got[..16], &msg[..]);
    }

    // A watching future dropped while it waits: its receive stays posted (its buffer parked
    // until the completion). The message comes from a send that is started and not awaited,
    // so nobody waits when the completions arrive: the completion task, woken by the drop,
    // must apply them (and release the parked buffer).
    for round in 0..10u8 {
        // Posted by `start` (a coalescing queue pair's first poll only queues).
        let mut parked =
            posted(p.b.recv(RegisteredBuffer::new(&p.pd, 64, AccessFlags::LOCAL_WRITE).unwrap()));
        assert!(futures::poll!(&mut parked).is_pending(), "nothing was sent");
        drop(parked);
        assert_eq!(p.driver.stats().ops_in_table, 1, "the receive stays posted");
        let before = p.driver.stats().completions;
        let mut send = p.a.send(reg_with(
            &p.pd,
            &pattern(8, round),
            AccessFlags::LOCAL_WRITE,
        ));
        send.start();
        within(60, "completions nobody waits for", async {
            while p.driver.stats().completions < before + 2 {
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
        })
        .await;
        assert_eq!(
            p.driver.stats().ops_in_table,
            1,
            "the parked buffer is released; the send's outcome waits for its future"
        );
        let (res, _) = within(60, "the started send", send).await;
        res.unwrap();
        assert_eq!(p.driver.stats().ops_in_table, 0);
    }
    drop(target);
}
