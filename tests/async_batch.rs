//! Device tests of `AsyncQp::batch` (src/driver/batch.rs): many sends and writes posted with
//! one doorbell and awaited as one, on rxe, with the data verified. Run in the soft-RoCE VM
//! (`scripts/test`); ignored on hosts without a device.
#![allow(clippy::print_stdout)]

mod common;

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll};

use common::{AsyncPair, all_access, async_pair_with, pattern, posted, reg_with, within};
use tokio_rdma::buf::RemoteToken;
use tokio_rdma::driver::{CompletionMode, DriverOptions, MAX_BATCH, QpOptions};
use tokio_rdma::ops::{Batch, BufList};
use tokio_rdma::verbs::{AccessFlags, RegisteredBuffer};
use tokio_rdma::{Error, InvalidArgument, QpFailure, WcStatus};

const LEN: usize = 64;

fn token(b: &RegisteredBuffer) -> RemoteToken {
    RemoteToken::new(b.addr(), b.len() as u64, b.rkey())
}

fn pair(mode: CompletionMode, depth: u32) -> AsyncPair {
    let mut driver = DriverOptions::default();
    driver.mode = mode;
    let mut qp = QpOptions::default();
    qp.caps.max_send_wr = depth;
    qp.caps.max_recv_wr = depth;
    async_pair_with(driver, qp)
}

fn modes() -> [CompletionMode; 3] {
    [
        CompletionMode::BusyPoll,
        CompletionMode::Event,
        CompletionMode::default(),
    ]
}

fn is_status(e: &Error, want: WcStatus) -> bool {
    matches!(e, Error::QpFailed(QpFailure::WorkCompletion { status, .. }) if *status == want)
}

/// A full batch of writes: write `n` (`part * MAX_BATCH + i`) carries `pattern(LEN, n)` to
/// slot `n` (`LEN` bytes) of `remote`.
fn writes(p: &AsyncPair, remote: RemoteToken, part: usize) -> Batch<RegisteredBuffer> {
    let mut batch = p.a.batch();
    for i in 0..MAX_BATCH {
        let n = part * MAX_BATCH + i;
        let tx = reg_with(&p.pd, &pattern(LEN, n as u8), AccessFlags::LOCAL_WRITE);
        let slot = remote
            .slice((n * LEN) as u64..((n + 1) * LEN) as u64)
            .unwrap();
        batch.write(tx, slot).map_err(|(e, _)| e).unwrap();
    }
    batch
}

/// Whether every write of batches `parts` (see [`writes`]) landed in `target`.
fn landed(target: &RegisteredBuffer, parts: std::ops::Range<usize>) -> bool {
    parts
        .flat_map(|part| part * MAX_BATCH..(part + 1) * MAX_BATCH)
        .all(|n| {
            let mut got = vec![0u8; LEN];
            target.read_at(n * LEN, &mut got);
            got == pattern(LEN, n as u8)
        })
}

/// Full batches of writes, each to its own slot of the target, in every completion mode: every
/// buffer comes back in order with its outcome, the data arrives, and each batch is one
/// doorbell with one signaled request.
#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn full_batches_of_writes_land_with_one_doorbell_each_in_every_mode() {
    for mode in modes() {
        let p = pair(mode, 2 * MAX_BATCH as u32);
        let target = RegisteredBuffer::new(&p.pd, MAX_BATCH * LEN, all_access()).unwrap();
        let remote = token(&target);
        let mut bufs: Vec<RegisteredBuffer> = (0..MAX_BATCH)
            .map(|_| RegisteredBuffer::new(&p.pd, LEN, AccessFlags::LOCAL_WRITE).unwrap())
            .collect();
        let mut batch = p.a.batch();
        for round in 0..20u8 {
            let before = p.driver.stats();
            for (i, mut buf) in bufs.drain(..).enumerate() {
                buf.write_at(0, &pattern(LEN, round.wrapping_add(i as u8)));
                let slot = remote
                    .slice((i * LEN) as u64..((i + 1) * LEN) as u64)
                    .unwrap();
                batch.write(buf, slot).map_err(|(e, _)| e).unwrap();
            }
            assert_eq!(batch.len(), MAX_BATCH);
            batch = within(60, "a batch of writes", batch.submit()).await;
            let outcomes = batch.outcomes();
            assert_eq!(outcomes.len(), MAX_BATCH);
            for (res, buf) in outcomes {
                res.unwrap_or_else(|e| panic!("{mode:?} round {round}: {e}"));
                bufs.push(buf);
            }
            assert!(batch.is_empty());
            let after = p.driver.stats();
            assert_eq!(after.posted - before.posted, MAX_BATCH as u64);
            assert_eq!(
                after.doorbells - before.doorbells,
                1,
                "{mode:?}: one doorbell"
            );
            assert_eq!(
                after.completions - before.completions,
                1,
                "{mode:?}: only the last is signaled"
            );
            for i in 0..MAX_BATCH {
                let mut got = vec![0u8; LEN];
                target.read_at(i * LEN, &mut got);
                assert_eq!(got, pattern(LEN, round.wrapping_add(i as u8)), "slot {i}");
            }
        }
        assert_eq!(p.driver.stats().ops_in_table, 0, "{mode:?}");
        println!("{mode:?}: 20 batches of {MAX_BATCH} writes ok");
    }
}

/// Four batches started one after another (`Submit::start`: posted, not awaited) are in
/// flight together, then awaited oldest first, in every mode: four doorbells, four
/// completions, every write landed.
#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn batches_started_together_are_in_flight_together() {
    for mode in modes() {
        let p = pair(mode, 4 * MAX_BATCH as u32);
        let target = RegisteredBuffer::new(&p.pd, 4 * MAX_BATCH * LEN, all_access()).unwrap();
        let remote = token(&target);
        let before = p.driver.stats();
        let mut subs = Vec::new();
        for part in 0..4 {
            let mut sub = writes(&p, remote, part).submit();
            sub.start();
            sub.start(); // a second call does nothing
            subs.push(sub);
        }
        assert_eq!(
            p.driver.stats().posted - before.posted,
            4 * MAX_BATCH as u64
        );
        for sub in subs {
            let mut batch = within(60, "a started batch", sub).await;
            for (res, _) in batch.outcomes() {
                res.unwrap_or_else(|e| panic!("{mode:?}: {e}"));
            }
        }
        let after = p.driver.stats();
        assert_eq!(after.doorbells - before.doorbells, 4, "{mode:?}");
        assert_eq!(after.completions - before.completions, 4, "{mode:?}");
        assert!(landed(&target, 0..4), "{mode:?}: every write landed");
        assert_eq!(after.ops_in_table, 0, "{mode:?}");
    }
}

/// Sends with and without immediate data in one batch arrive in order at the peer's receives.
#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_batch_of_sends_arrives_in_order_with_its_immediates() {
    let p = pair(CompletionMode::default(), 16);
    let recvs: Vec<_> = (0..4)
        .map(|_| {
            let rx = RegisteredBuffer::new(&p.pd, LEN, AccessFlags::LOCAL_WRITE).unwrap();
            posted(p.b.recv(rx))
        })
        .collect();
    let mut batch = p.a.batch();
    for i in 0..4u8 {
        let tx = reg_with(&p.pd, &pattern(LEN, i), AccessFlags::LOCAL_WRITE);
        let added = if i % 2 == 0 {
            batch.send(tx)
        } else {
            batch.send_with_imm(tx, u32::from(i))
        };
        added.map_err(|(e, _)| e).unwrap();
    }
    let mut batch = within(60, "a batch of sends", batch.submit()).await;
    for (res, _) in batch.outcomes() {
        res.unwrap();
    }
    for (i, r) in recvs.into_iter().enumerate() {
        let (res, rx) = within(60, "a receive", r).await;
        let info = res.unwrap();
        assert_eq!(info.len, LEN);
        assert_eq!(info.imm, (i % 2 == 1).then_some(i as u32));
        assert_eq!(rx.to_vec(), pattern(LEN, i as u8), "message {i} in order");
    }
}

/// Refusals keep the buffer and add nothing: a write longer than its remote slice, and a
/// request past `MAX_BATCH`.
#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_refused_request_comes_back_and_leaves_the_batch_as_it_was() {
    let p = pair(CompletionMode::default(), 32);
    let target = RegisteredBuffer::new(&p.pd, LEN, all_access()).unwrap();
    let short = token(&target).slice(0..8).unwrap();
    let mut batch = p.a.batch();
    let buf = RegisteredBuffer::new(&p.pd, LEN, AccessFlags::LOCAL_WRITE).unwrap();
    let (e, buf) = batch.write(buf, short).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert!(batch.is_empty());
    drop(buf);
    for _ in 0..MAX_BATCH {
        let b = RegisteredBuffer::new(&p.pd, LEN, AccessFlags::LOCAL_WRITE).unwrap();
        batch.write(b, token(&target)).map_err(|(e, _)| e).unwrap();
    }
    let extra = RegisteredBuffer::new(&p.pd, LEN, AccessFlags::LOCAL_WRITE).unwrap();
    let (e, _extra) = batch.write(extra, token(&target)).unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidArgument(InvalidArgument::BatchFull { max: MAX_BATCH })
        ),
        "{e}"
    );
    // Nothing to hand out before a submission, and asking leaves the requests in place.
    assert_eq!(batch.outcomes().len(), 0);
    assert_eq!(batch.len(), MAX_BATCH);
    let mut batch = within(60, "a full batch", batch.submit()).await;
    assert_eq!(
        batch.outcomes().filter(|(r, _)| r.is_ok()).count(),
        MAX_BATCH
    );
}

/// A list with more scatter/gather entries than the send queue takes is refused; the slot it
/// was written into is rewritten by the next request, which carries only its own bytes (the
/// refused list had spilled its entries to the heap).
#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_refused_list_leaves_nothing_behind_in_its_slot() {
    let p = pair(CompletionMode::default(), 8);
    let max = p.a.caps().max_send_sge as usize;
    let target = RegisteredBuffer::new(&p.pd, 4 * LEN, all_access()).unwrap();
    let part = |seed: u8| reg_with(&p.pd, &pattern(LEN, seed), AccessFlags::LOCAL_WRITE);
    let mut batch = p.a.batch::<BufList<RegisteredBuffer>>();
    let long = BufList((0..=max).map(|i| part(i as u8)).collect());
    let (e, _long) = batch.write(long, token(&target)).unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidArgument(InvalidArgument::TooManySges { .. })
        ),
        "{e}"
    );
    assert!(batch.is_empty());
    let two = BufList(vec![part(100), part(200)]);
    batch
        .write(two, token(&target))
        .map_err(|(e, _)| e)
        .unwrap();
    let mut batch = within(60, "the batch after a refusal", batch.submit()).await;
    for (res, _) in batch.outcomes() {
        res.unwrap();
    }
    let mut got = vec![0u8; 4 * LEN];
    target.read_at(0, &mut got);
    assert_eq!(&got[..LEN], &pattern(LEN, 100)[..]);
    assert_eq!(&got[LEN..2 * LEN], &pattern(LEN, 200)[..]);
    assert_eq!(
        &got[2 * LEN..],
        &vec![0u8; 2 * LEN][..],
        "nothing of the refused list"
    );
}

/// A bad rkey in the middle of a batch: the request before it succeeds, it reports the
/// remote access error, and the one after it (flushed) the queue pair's failure, the same
/// cause. A later batch on the failed queue pair reports it for every request.
#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_bad_rkey_in_the_middle_fails_it_and_what_follows_not_what_precedes() {
    let p = pair(CompletionMode::BusyPoll, 16);
    let target = RegisteredBuffer::new(&p.pd, 2 * LEN, all_access()).unwrap();
    let forged = RemoteToken::new(target.addr(), LEN as u64, target.rkey() ^ 0x5a5a_0000);
    let mut batch = p.a.batch();
    for (i, remote) in [token(&target), forged, token(&target)]
        .into_iter()
        .enumerate()
    {
        let tx = reg_with(&p.pd, &pattern(LEN, i as u8), AccessFlags::LOCAL_WRITE);
        batch.write(tx, remote).map_err(|(e, _)| e).unwrap();
    }
    let mut batch = within(60, "a failing batch", batch.submit()).await;
    let out: Vec<_> = batch.outcomes().map(|(r, _)| r).collect();
    assert!(out[0].is_ok(), "{:?}", out[0]);
    for r in &out[1..] {
        let e = r.as_ref().unwrap_err();
        assert!(is_status(e, WcStatus::RemAccessErr), "{e}");
    }
    let mut got = vec![0u8; LEN];
    target.read_at(0, &mut got);
    assert_eq!(got, pattern(LEN, 0), "the first write landed");
    let tx = RegisteredBuffer::new(&p.pd, LEN, AccessFlags::LOCAL_WRITE).unwrap();
    batch.write(tx, token(&target)).map_err(|(e, _)| e).unwrap();
    let mut batch = within(60, "a batch on a failed queue pair", batch.submit()).await;
    for (r, _) in batch.outcomes() {
        assert!(is_status(&r.unwrap_err(), WcStatus::RemAccessErr));
    }
    assert_eq!(p.driver.stats().ops_in_table, 0);
}

/// A batch deeper than the send queue (16 requests, 4 slots) is queued and posted as room
/// frees; every request completes and the data arrives.
#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_batch_deeper_than_the_send_queue_is_posted_as_room_frees() {
    for mode in modes() {
        let p = pair(mode, 4);
        let target = RegisteredBuffer::new(&p.pd, MAX_BATCH * LEN, all_access()).unwrap();
        let remote = token(&target);
        let batch = writes(&p, remote, 0);
        let mut batch = within(60, "a deep batch", batch.submit()).await;
        for (res, _) in batch.outcomes() {
            res.unwrap_or_else(|e| panic!("{mode:?}: {e}"));
        }
        assert!(landed(&target, 0..1), "{mode:?}: every write landed");
        assert_eq!(p.driver.stats().ops_in_table, 0, "{mode:?}");
    }
}

/// A submission dropped after its first poll (the requests posted): the writes still happen,
/// the driver keeps their buffers until their completions (then the table is empty), and the
/// queue pair goes on. One forgotten with `mem::forget` leaks its batch: its writes happen too.
#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_dropped_or_forgotten_submission_gives_its_requests_up_safely() {
    let p = pair(CompletionMode::Event, 32);
    let target = RegisteredBuffer::new(&p.pd, 3 * MAX_BATCH * LEN, all_access()).unwrap();
    let remote = token(&target);
    let waker = std::task::Waker::noop();
    let mut cx = Context::from_waker(waker);
    // A receive of this task sleeps first and watches the completion channel
    // (`driver::watch`), so the submissions polled below with another waker (as if from a
    // task of their own) sleep without draining the CQ: their first poll leaves them in
    // flight. A lone sleeper arms the CQ and drains it once, and could find every write done.
    let mut recv =
        p.b.recv(RegisteredBuffer::new(&p.pd, 8, AccessFlags::LOCAL_WRITE).unwrap());
    recv.start();
    assert!(futures::poll!(&mut recv).is_pending(), "nothing was sent");
    // Dropped after the first poll, which posts (event mode: it sleeps, it does not spin).
    {
        let mut sub = pin!(writes(&p, remote, 0).submit());
        assert!(sub.as_mut().poll(&mut cx).is_pending());
    }
    // The next batch goes on the same queue pair, behind the given-up one.
    let mut batch = within(60, "the batch after", writes(&p, remote, 1).submit()).await;
    assert_eq!(
        batch.outcomes().filter(|(r, _)| r.is_ok()).count(),
        MAX_BATCH
    );
    within(60, "the given-up requests' completions", async {
        // Down to the sleeping receive.
        while p.driver.stats().ops_in_table > 1 {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(landed(&target, 0..2), "every write of both batches landed");
    // Forgotten after the first poll: its writes happen all the same.
    let mut sub = Box::pin(writes(&p, remote, 2).submit());
    assert!(sub.as_mut().poll(&mut cx).is_pending());
    std::mem::forget(sub);
    within(60, "the forgotten batch's writes", async {
        while !landed(&target, 2..3) {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    })
    .await;
    drop(recv);
}

/// An empty batch posts nothing and resolves at its first poll.
#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn an_empty_batch_resolves_at_once_with_nothing() {
    let p = pair(CompletionMode::default(), 8);
    let batch = p.a.batch::<RegisteredBuffer>();
    let waker = std::task::Waker::noop();
    let mut cx = Context::from_waker(waker);
    match pin!(batch.submit()).poll(&mut cx) {
        Poll::Ready(mut batch) => assert_eq!(batch.outcomes().len(), 0),
        Poll::Pending => panic!("an empty batch has nothing to wait for"),
    }
    assert_eq!(p.driver.stats().posted, 0);
}

/// A batch and its submission move to other tasks and threads (`tokio::spawn` on the
/// multi-thread runtime): checked at compile time, no device needed.
#[test]
fn a_batch_and_its_submission_are_send() {
    fn send<T: Send>() {}
    send::<tokio_rdma::ops::Batch<RegisteredBuffer>>();
    send::<tokio_rdma::ops::Submit<RegisteredBuffer>>();
}
