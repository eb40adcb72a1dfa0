//! Device tests of `OwnedQp`, the queue pair owned by one task with a CQ of its own: every
//! operation with data verified in each completion mode, what a dropped wait or a dropped
//! queue pair does with buffers the device may still use, and the errors of bad input. Run
//! in the soft-RoCE VM (`scripts/test`); ignored on hosts without a device.
#![allow(clippy::print_stdout)]

mod common;

use std::time::Duration;

use common::{
    all_access, connect_qps, mr_count, open_device, pattern, reg_with, resource_counts, within,
};
use tokio_rdma::buf::RemoteToken;
use tokio_rdma::driver::CompletionMode;
use tokio_rdma::ops::BufList;
use tokio_rdma::owned::{MAX_BATCH, OwnedQp, OwnedQpOptions};
use tokio_rdma::verbs::{AccessFlags, ProtectionDomain, RegisteredBuffer};
use tokio_rdma::{Error, InvalidArgument, QpFailure, WcStatus};

type Qp = OwnedQp<RegisteredBuffer>;

struct Pair {
    pd: ProtectionDomain,
    a: Qp,
    b: Qp,
}

fn pair(mode: CompletionMode) -> Pair {
    pair_with(mode, 8)
}

fn pair_with(mode: CompletionMode, depth: u32) -> Pair {
    let (ctx, _port) = open_device();
    let pd = ProtectionDomain::new(&ctx).expect("pd");
    let mut opts = OwnedQpOptions::default();
    opts.mode = mode;
    opts.caps.max_send_wr = depth;
    opts.caps.max_recv_wr = depth;
    let a = Qp::new(&pd, opts).expect("qp a");
    let b = Qp::new(&pd, opts).expect("qp b");
    connect_qps(&ctx, a.verbs(), b.verbs(), all_access());
    Pair { pd, a, b }
}

fn token(b: &RegisteredBuffer) -> RemoteToken {
    RemoteToken::new(b.addr(), b.len() as u64, b.rkey())
}

fn modes() -> [CompletionMode; 3] {
    [
        CompletionMode::BusyPoll,
        CompletionMode::Event,
        CompletionMode::default(),
    ]
}

#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn every_operation_round_trips_in_every_mode() {
    for mode in modes() {
        let Pair { pd, mut a, mut b } = pair(mode);
        for (i, len) in [2usize, 64, 4096, 70_000].into_iter().enumerate() {
            let data = pattern(len, i as u8);
            // Send and receive, with immediate data.
            let rx = RegisteredBuffer::new(&pd, len, AccessFlags::LOCAL_WRITE).unwrap();
            let t = b.post_recv(rx).map_err(|(e, _)| e).unwrap();
            let tx = reg_with(&pd, &data, AccessFlags::LOCAL_WRITE);
            let sent = a
                .post_send(tx, Some(0xfeed_0000 + i as u32))
                .map_err(|(e, _)| e)
                .unwrap();
            let ((sres, _tx), (rres, rx)) = within(60, "send/recv", async {
                let s = a.wait(sent).unwrap().await;
                let r = b.wait(t).unwrap().await;
                (s, r)
            })
            .await;
            sres.unwrap();
            let got = rres.unwrap();
            assert_eq!(got.len, len, "{mode:?}: receive length");
            assert_eq!(got.imm, Some(0xfeed_0000 + i as u32));
            assert_eq!(rx.to_vec(), data, "{mode:?}: received bytes");
            // RDMA WRITE into b's buffer, then READ it back into a fresh one.
            let target = RegisteredBuffer::new(&pd, len, all_access()).unwrap();
            let (res, _src) = within(
                60,
                "write",
                a.write(
                    reg_with(&pd, &data, AccessFlags::LOCAL_WRITE),
                    token(&target),
                ),
            )
            .await;
            res.unwrap();
            assert_eq!(target.to_vec(), data, "{mode:?}: written bytes");
            let back = RegisteredBuffer::new(&pd, len, AccessFlags::LOCAL_WRITE).unwrap();
            let (res, back) = within(60, "read", b.read(back, token(&target))).await;
            assert_eq!(res.unwrap().len, len);
            assert_eq!(back.to_vec(), data, "{mode:?}: read bytes");
        }
        assert_eq!((a.in_flight(), b.in_flight()), (0, 0));
        println!("{mode:?}: ok");
    }
}

/// Completions come out of `next_completion()` in completion order, and `wait` on one ticket keeps the
/// others for theirs.
#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn completions_found_while_waiting_for_another_are_kept_for_their_tickets() {
    let Pair { pd, mut a, mut b } = pair(CompletionMode::Event);
    let mut tickets = Vec::new();
    for i in 0..4u8 {
        let rx = RegisteredBuffer::new(&pd, 16, AccessFlags::LOCAL_WRITE).unwrap();
        tickets.push((i, b.post_recv(rx).map_err(|(e, _)| e).unwrap()));
    }
    for i in 0..4u8 {
        let (res, _) = within(
            60,
            "send",
            a.send(reg_with(&pd, &[i; 16], AccessFlags::LOCAL_WRITE)),
        )
        .await;
        res.unwrap();
    }
    // Wait for the last receive first: the three before it are polled on the way.
    let (i, last) = tickets.pop().unwrap();
    let (res, buf) = within(60, "last recv", b.wait(last).unwrap()).await;
    assert_eq!((res.unwrap().len, buf.to_vec()), (16, vec![i; 16]));
    for (i, t) in tickets {
        let (res, buf) = within(60, "earlier recv", b.wait(t).unwrap()).await;
        assert_eq!(
            (res.unwrap().len, buf.to_vec()),
            (16, vec![i; 16]),
            "receive {i}"
        );
    }
    assert!(
        within(10, "next", b.next_completion()).await.is_none(),
        "nothing left"
    );
}

/// A wait dropped while its receive is posted: the buffer stays with the queue pair (the
/// device writes the next message into it) and is released once that completion is polled.
#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_dropped_wait_keeps_its_buffer_until_the_device_is_done_with_it() {
    let Pair { pd, mut a, mut b } = pair(CompletionMode::BusyPoll);
    let before = mr_count();
    let rx = RegisteredBuffer::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    {
        let wait = b.recv(rx);
        // Poll it a few times, then drop it with the receive posted.
        let _ = tokio::time::timeout(Duration::from_millis(5), wait).await;
    }
    assert_eq!(b.in_flight(), 1);
    assert_eq!(
        mr_count(),
        before + 1,
        "the receive's buffer is still registered"
    );
    let (res, _) = within(
        60,
        "send",
        a.send(reg_with(&pd, &[7; 64], AccessFlags::LOCAL_WRITE)),
    )
    .await;
    res.unwrap();
    // The given-up receive consumed that message; a later wait polls its completion.
    let rx2 = RegisteredBuffer::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    let t = b.post_recv(rx2).map_err(|(e, _)| e).unwrap();
    let (res, _) = within(
        60,
        "send 2",
        a.send(reg_with(&pd, &[8; 64], AccessFlags::LOCAL_WRITE)),
    )
    .await;
    res.unwrap();
    let (res, buf) = within(60, "recv 2", b.wait(t).unwrap()).await;
    assert_eq!((res.unwrap().len, buf.to_vec()), (64, vec![8; 64]));
    drop(buf);
    assert_eq!(b.in_flight(), 0);
    assert_eq!(mr_count(), before, "the given-up buffer was released");
}

/// Dropped with receives posted: the queue pair is moved to the error state, the buffers are
/// kept until their flush completions are polled (by a task of the runtime), then released,
/// and the queue pair destroyed.
#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_queue_pair_dropped_with_requests_in_flight_releases_them_once_flushed() {
    for mode in modes() {
        let Pair { pd, a, mut b } = pair(mode);
        let base = resource_counts();
        for _ in 0..8 {
            let rx = RegisteredBuffer::new(&pd, 256, AccessFlags::LOCAL_WRITE).unwrap();
            let _ticket = b.post_recv(rx).map_err(|(e, _)| e).unwrap();
        }
        assert_eq!(mr_count(), base["mr"] + 8);
        drop(b);
        // The reaper is a task of this (current-thread) runtime: it has not run yet, and the
        // buffers the device may still write are not freed by the drop itself.
        assert_eq!(
            mr_count(),
            base["mr"] + 8,
            "{mode:?}: freed before their flush"
        );
        within(30, "flush and release", async {
            while mr_count() != base["mr"] || resource_counts()["qp"] != base["qp"] - 1 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        drop(a);
        println!("{mode:?}: released");
    }
}

#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn bad_input_is_refused_with_the_buffer_back_and_a_failure_reaches_every_request() {
    let Pair { pd, mut a, mut b } = pair(CompletionMode::default());
    let target = RegisteredBuffer::new(&pd, 16, all_access()).unwrap();
    // A write longer than the remote slice: refused before posting.
    let src = reg_with(&pd, &[1; 32], AccessFlags::LOCAL_WRITE);
    let (e, src) = a.post_write(src, token(&target), None).unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidArgument(InvalidArgument::TokenRange { .. })
        ),
        "{e}"
    );
    assert_eq!(src.len(), 32);
    assert_eq!(a.in_flight(), 0);
    // A full receive queue.
    let mut kept = Vec::new();
    for _ in 0..8 {
        let rx = RegisteredBuffer::new(&pd, 16, AccessFlags::LOCAL_WRITE).unwrap();
        kept.push(b.post_recv(rx).map_err(|(e, _)| e).unwrap());
    }
    let rx = RegisteredBuffer::new(&pd, 16, AccessFlags::LOCAL_WRITE).unwrap();
    let (e, _) = b.post_recv(rx).unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidArgument(InvalidArgument::RecvQueueFull { depth: 8 })
        ),
        "{e}"
    );
    // A ticket of another queue pair.
    let e = a.wait(kept.pop().unwrap()).unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument(InvalidArgument::ForeignTicket)),
        "{e}"
    );
    // A write with a wrong rkey fails on the device; the request after it is flushed and
    // reports the same cause.
    let bad = RemoteToken::new(target.addr(), 16, target.rkey() ^ 0x55);
    let w1 = a
        .post_write(reg_with(&pd, &[2; 16], AccessFlags::LOCAL_WRITE), bad, None)
        .map_err(|(e, _)| e)
        .unwrap();
    let w2 = a
        .post_write(
            reg_with(&pd, &[3; 16], AccessFlags::LOCAL_WRITE),
            token(&target),
            None,
        )
        .map_err(|(e, _)| e)
        .unwrap();
    let (r1, _) = within(60, "bad write", a.wait(w1).unwrap()).await;
    let (r2, _) = within(60, "flushed write", a.wait(w2).unwrap()).await;
    let cause = QpFailure::WorkCompletion {
        status: WcStatus::RemAccessErr,
        vendor_err: 0,
    };
    for r in [r1, r2] {
        match r {
            Err(Error::QpFailed(f)) => assert!(
                matches!(
                    f,
                    QpFailure::WorkCompletion {
                        status: WcStatus::RemAccessErr,
                        ..
                    }
                ),
                "{f:?} (expected {cause:?})"
            ),
            other => panic!("expected a remote access failure, got {other:?}"),
        }
    }
    assert_eq!(target.to_vec(), vec![0; 16], "nothing was written");
}

#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn atomics_return_the_previous_value_and_misaligned_targets_are_refused() {
    let Pair { pd, mut a, b: _b } = pair(CompletionMode::BusyPoll);
    let counter = reg_with(&pd, &5u64.to_ne_bytes(), all_access());
    let local = || RegisteredBuffer::new(&pd, 8, AccessFlags::LOCAL_WRITE).unwrap();
    let (before, _) = within(60, "fetch_add", a.fetch_add(local(), token(&counter), 3)).await;
    assert_eq!(before.unwrap(), 5);
    let (before, _) = within(60, "fetch_add 2", a.fetch_add(local(), token(&counter), 1)).await;
    assert_eq!(before.unwrap(), 8);
    // Compare-and-swap: a miss leaves the value, a hit swaps it.
    let (before, _) = within(
        60,
        "cas miss",
        a.compare_swap(local(), token(&counter), 1, 100),
    )
    .await;
    assert_eq!(before.unwrap(), 9);
    let (before, _) = within(
        60,
        "cas hit",
        a.compare_swap(local(), token(&counter), 9, 100),
    )
    .await;
    assert_eq!(before.unwrap(), 9);
    assert_eq!(counter.to_vec(), 100u64.to_ne_bytes().to_vec());
    // A target that is not 8-byte aligned: refused before posting, the buffer back.
    let wide = RegisteredBuffer::new(&pd, 16, all_access()).unwrap();
    let odd = RemoteToken::new(wide.addr() + 4, 8, wide.rkey());
    let (e, buf) = a.post_fetch_add(local(), odd, 1).unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidArgument(InvalidArgument::AtomicUnaligned { .. })
        ),
        "{e}"
    );
    assert_eq!(buf.len(), 8);
    // A local buffer too small for the value.
    let small = RegisteredBuffer::new(&pd, 4, AccessFlags::LOCAL_WRITE).unwrap();
    let (e, _) = a
        .post_compare_swap(small, token(&counter), 0, 0)
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidArgument(InvalidArgument::AtomicBufferTooSmall)
        ),
        "{e}"
    );
    assert_eq!(a.in_flight(), 0);
}

/// Scatter/gather lists: a send of three buffers lands in a receive of two, in order.
#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn scatter_gather_lists_send_and_receive_in_order() {
    let (ctx, _port) = open_device();
    let pd = ProtectionDomain::new(&ctx).expect("pd");
    let opts = OwnedQpOptions::default();
    let mut a: OwnedQp<BufList<RegisteredBuffer>> = OwnedQp::new(&pd, opts).unwrap();
    let mut b: OwnedQp<BufList<RegisteredBuffer>> = OwnedQp::new(&pd, opts).unwrap();
    connect_qps(&ctx, a.verbs(), b.verbs(), all_access());
    let parts = [pattern(100, 1), pattern(3000, 2), pattern(1, 3)];
    let rx = BufList(vec![
        RegisteredBuffer::new(&pd, 2000, AccessFlags::LOCAL_WRITE).unwrap(),
        RegisteredBuffer::new(&pd, 4096, AccessFlags::LOCAL_WRITE).unwrap(),
    ]);
    let t = b.post_recv(rx).map_err(|(e, _)| e).unwrap();
    let tx = BufList(
        parts
            .iter()
            .map(|d| reg_with(&pd, d, AccessFlags::LOCAL_WRITE))
            .collect(),
    );
    let (res, _) = within(60, "sg send", a.send(tx)).await;
    res.unwrap();
    let (res, rx) = within(60, "sg recv", b.wait(t).unwrap()).await;
    assert_eq!(res.unwrap().len, 3101);
    // The first buffer is filled whole, the second with the rest.
    let got: Vec<u8> = rx.0.iter().flat_map(|b| b.to_vec()).collect();
    assert!(got[..3101] == parts.concat()[..], "the bytes, in order");
}

/// A queue pair created on a runtime that is gone by the time it is used (its channel was
/// registered with that runtime's reactor): an event-mode wait cannot sleep there any more,
/// and polls instead of hanging.
#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn a_queue_pair_outliving_its_runtime_still_completes() {
    let first = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let Pair { pd, mut a, b } = first.block_on(async { pair(CompletionMode::Event) });
    drop(first);
    let second = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    second.block_on(async {
        let target = RegisteredBuffer::new(&pd, 64, all_access()).unwrap();
        let src = reg_with(&pd, &[9; 64], AccessFlags::LOCAL_WRITE);
        let (res, _) = within(
            30,
            "write after the runtime's end",
            a.write(src, token(&target)),
        )
        .await;
        res.unwrap();
        assert_eq!(target.to_vec(), vec![9; 64]);
    });
    drop((a, b));
}

#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn batches_post_with_one_completion_and_hand_every_request_back_in_order() {
    const LEN: usize = 64;
    for mode in modes() {
        let Pair { pd, mut a, mut b } = pair_with(mode, 2 * MAX_BATCH as u32);
        let target = RegisteredBuffer::new(&pd, MAX_BATCH * LEN, all_access()).unwrap();
        let remote = token(&target);
        // Many full batches of writes, each to its own slot of the target; every buffer comes
        // back, in posting order, with the ticket it was posted with.
        for round in 0..20u8 {
            let mut batch = a.batch();
            let mut tickets = Vec::new();
            for k in 0..MAX_BATCH {
                let src = reg_with(
                    &pd,
                    &pattern(LEN, round ^ k as u8),
                    AccessFlags::LOCAL_WRITE,
                );
                let to = remote
                    .slice((k * LEN) as u64..((k + 1) * LEN) as u64)
                    .unwrap();
                tickets.push(batch.write(src, to, None).map_err(|(e, _)| e).unwrap());
            }
            // One more is refused, with its buffer.
            let extra = reg_with(&pd, &[9; LEN], AccessFlags::LOCAL_WRITE);
            let (e, extra) = batch.write(extra, remote, None).unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::InvalidArgument(InvalidArgument::BatchFull { max: MAX_BATCH })
                ),
                "{e}"
            );
            assert_eq!(extra.len(), LEN);
            assert_eq!(batch.len(), MAX_BATCH);
            batch.post().map_err(|(e, _)| e).unwrap();
            assert_eq!(a.in_flight(), MAX_BATCH as u32);
            for (k, want) in tickets.into_iter().enumerate() {
                let (t, res, buf) = within(60, "batch completion", a.next_completion())
                    .await
                    .expect("in flight");
                assert_eq!(
                    t, want,
                    "{mode:?}: request {k} of round {round} out of order"
                );
                res.unwrap();
                assert_eq!(buf.to_vec(), pattern(LEN, round ^ k as u8));
            }
            assert!(a.try_next_completion().is_none());
            assert_eq!(a.in_flight(), 0);
            for k in 0..MAX_BATCH {
                let got = &target.to_vec()[k * LEN..(k + 1) * LEN];
                assert_eq!(got, pattern(LEN, round ^ k as u8), "{mode:?}: slot {k}");
            }
        }
        // Sends with immediate data in one batch arrive in order; a ticket of the batch is
        // waited for like any other (the batch's last completion covers it).
        let mut rx = Vec::new();
        for _ in 0..4 {
            let buf = RegisteredBuffer::new(&pd, LEN, AccessFlags::LOCAL_WRITE).unwrap();
            rx.push(b.post_recv(buf).map_err(|(e, _)| e).unwrap());
        }
        let mut batch = a.batch();
        let mut sent = Vec::new();
        for k in 0..4u8 {
            let tx = reg_with(&pd, &pattern(LEN, 100 + k), AccessFlags::LOCAL_WRITE);
            sent.push(
                batch
                    .send(tx, Some(u32::from(k)))
                    .map_err(|(e, _)| e)
                    .unwrap(),
            );
        }
        drop(batch); // posts it
        let (res, _) = within(60, "first send of a batch", a.wait(sent.remove(0)).unwrap()).await;
        res.unwrap();
        for (k, t) in rx.into_iter().enumerate() {
            let (res, buf) = within(60, "batch receive", b.wait(t).unwrap()).await;
            let got = res.unwrap();
            assert_eq!((got.len, got.imm), (LEN, Some(k as u32)), "{mode:?}");
            assert_eq!(buf.to_vec(), pattern(LEN, 100 + k as u8));
        }
        for t in sent {
            within(60, "batch send", a.wait(t).unwrap())
                .await
                .0
                .unwrap();
        }
    }
}

#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_failing_request_of_a_batch_fails_alone_and_flushes_the_rest() {
    let Pair { pd, mut a, b: _b } = pair(CompletionMode::default());
    let target = RegisteredBuffer::new(&pd, 48, all_access()).unwrap();
    let remote = token(&target);
    let bad = RemoteToken::new(target.addr(), 48, target.rkey() ^ 0x55);
    // A batch deeper than the send queue is refused at the request that does not fit.
    let mut batch = a.batch();
    let mut held = Vec::new();
    for _ in 0..8 {
        let src = reg_with(&pd, &[1; 16], AccessFlags::LOCAL_WRITE);
        held.push(batch.write(src, remote, None).map_err(|(e, _)| e).unwrap());
    }
    let (e, _) = batch
        .write(
            reg_with(&pd, &[1; 16], AccessFlags::LOCAL_WRITE),
            remote,
            None,
        )
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidArgument(InvalidArgument::SendQueueFull { depth: 8 })
        ),
        "{e}"
    );
    batch.post().map_err(|(e, _)| e).unwrap();
    for t in held {
        within(60, "write", a.wait(t).unwrap()).await.0.unwrap();
    }
    // The first write lands, the second has a wrong rkey, the third is flushed: the first
    // reports success (the failure's completion comes after it), the others the failure.
    let mut batch = a.batch();
    let mut t = Vec::new();
    for (k, to) in [
        remote.slice(0..16).unwrap(),
        bad,
        remote.slice(32..48).unwrap(),
    ]
    .into_iter()
    .enumerate()
    {
        let src = reg_with(&pd, &[7 + k as u8; 16], AccessFlags::LOCAL_WRITE);
        t.push(batch.write(src, to, None).map_err(|(e, _)| e).unwrap());
    }
    batch.post().map_err(|(e, _)| e).unwrap();
    let mut results = Vec::new();
    for ticket in t {
        results.push(within(60, "batch outcome", a.wait(ticket).unwrap()).await.0);
    }
    assert!(results[0].is_ok(), "{:?}", results[0]);
    for r in &results[1..] {
        assert!(
            matches!(
                r,
                Err(Error::QpFailed(QpFailure::WorkCompletion {
                    status: WcStatus::RemAccessErr,
                    ..
                }))
            ),
            "{r:?}"
        );
    }
    assert_eq!(&target.to_vec()[..16], &[7; 16]);
    assert_eq!(a.in_flight(), 0);
}

/// A batch forgotten (`mem::forget`) instead of posted: the queue pair's next wait posts it, so
/// its tickets still resolve; forgotten and the queue pair dropped, its buffers (which never
/// reached the device) are released with the queue pair.
#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_forgotten_batch_is_posted_by_the_next_wait_or_released_with_the_queue_pair() {
    let Pair { pd, mut a, b: _b } = pair(CompletionMode::BusyPoll);
    let target = RegisteredBuffer::new(&pd, 64, all_access()).unwrap();
    let mut batch = a.batch();
    let src = reg_with(&pd, &[5; 64], AccessFlags::LOCAL_WRITE);
    let t = batch
        .write(src, token(&target), None)
        .map_err(|(e, _)| e)
        .unwrap();
    std::mem::forget(batch);
    assert_eq!(a.in_flight(), 1, "the slot owns the buffer");
    let (res, _src) = within(60, "forgotten batch", a.wait(t).unwrap()).await;
    res.unwrap();
    assert_eq!(target.to_vec(), vec![5; 64]);
    let before = mr_count();
    let mut batch = a.batch();
    let src = reg_with(&pd, &[6; 64], AccessFlags::LOCAL_WRITE);
    let _t = batch
        .write(src, token(&target), None)
        .map_err(|(e, _)| e)
        .unwrap();
    std::mem::forget(batch);
    assert_eq!(mr_count(), before + 1);
    drop(a);
    assert_eq!(
        mr_count(),
        before,
        "the forgotten request's buffer was released"
    );
    assert_eq!(target.to_vec(), vec![5; 64], "it never reached the device");
}
