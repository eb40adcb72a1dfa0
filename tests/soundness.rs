//! Device tests of ownership across the driver's boundary: nothing outside a driver can take
//! its completions or post under its `wr_id`s, and an operation future that outlives its queue
//! pair resolves with an error instead of panicking or posting on the queue pair that took its
//! key. Run in the soft-RoCE VM (`scripts/test`); ignored on hosts without a device.
#![allow(clippy::print_stdout)]

mod common;

use std::time::Duration;

use common::{all_access, async_pair, connect_qps, posted, reg_with, within};
use tokio_rdma::buf::{Grant, GrantKind, Pool, PoolConfig, RemoteAccess, SizeClass};
use tokio_rdma::driver::QpOptions;
use tokio_rdma::owned::{OwnedQp, OwnedQpOptions};
use tokio_rdma::verbs::{
    AccessFlags, CompletionQueue, QpInitAttr, QueuePair, RegisteredBuffer, WcBatch,
};
use tokio_rdma::{Error, QpFailure};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_driven_completion_queue_refuses_polls_and_events_from_outside() {
    let p = async_pair();
    let cq = p.a.verbs().send_cq();
    let mut batch = WcBatch::with_capacity(4);
    // At 61ac8ac these succeeded: a poll here takes completions the driver's futures wait for.
    assert!(
        matches!(cq.poll(&mut batch), Err(Error::DriverOwned(_))),
        "poll of the driver's CQ must be refused"
    );
    let mut out = [tokio_rdma::verbs::WorkCompletion::synthetic(0, 0, 0); 2];
    assert!(matches!(cq.poll_into(&mut out), Err(Error::DriverOwned(_))));
    assert!(matches!(cq.req_notify(false), Err(Error::DriverOwned(_))));
    assert!(matches!(cq.get_event(), Err(Error::DriverOwned(_))));
    assert!(p.a.verbs().is_driven());

    // The driver still works, and a plain verbs CQ still polls.
    let rx = RegisteredBuffer::new(&p.pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    let tx = reg_with(&p.pd, b"still driven", AccessFlags::LOCAL_WRITE);
    let ((r, rx), (s, _)) = within(60, "send/recv", async {
        tokio::join!(posted(p.b.recv(rx)), p.a.send(tx))
    })
    .await;
    s.unwrap();
    assert_eq!(r.unwrap().len, 12);
    assert_eq!(&rx.to_vec()[..12], b"still driven");
    let own = tokio_rdma::verbs::CompletionQueue::new(&p.ctx, 16, None).unwrap();
    assert!(own.poll(&mut batch).unwrap().is_empty());
}

/// A queue pair of one's own on a driver's CQ (or an `OwnedQp`'s), reachable through
/// `verbs().send_cq()`, is refused. Before: `QueuePair::new_rc` accepted it, and a
/// memory-window bind posted there with a chosen `wr_id` (safe: `Grant::window` on that
/// queue pair) completed another request of the driver's table, giving its buffer back while
/// the device could still write it (found by helper-20 for `OwnedQp`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn no_queue_pair_of_ones_own_is_created_on_a_driven_completion_queue() {
    let p = async_pair();
    let cq = p.a.verbs().send_cq();
    let err = QueuePair::new_rc(&p.pd, &QpInitAttr::new(cq, cq)).unwrap_err();
    assert!(matches!(err, Error::DriverOwned(_)), "{err}");
    let own = CompletionQueue::new(&p.ctx, 16, None).unwrap();
    let err = QueuePair::new_rc(&p.pd, &QpInitAttr::new(&own, cq)).unwrap_err();
    assert!(matches!(err, Error::DriverOwned(_)), "{err}");
    let owned: OwnedQp<RegisteredBuffer> = OwnedQp::new(&p.pd, OwnedQpOptions::default()).unwrap();
    let cq = owned.verbs().send_cq();
    let err = QueuePair::new_rc(&p.pd, &QpInitAttr::new(cq, cq)).unwrap_err();
    assert!(matches!(err, Error::DriverOwned(_)), "{err}");
    println!("a queue pair on a driven CQ: {err}");
    // A CQ of one's own still takes queue pairs.
    assert!(QueuePair::new_rc(&p.pd, &QpInitAttr::new(&own, &own)).is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn no_memory_window_is_bound_by_hand_on_a_driven_queue_pair() {
    let p = async_pair();
    let pool = Pool::with_pd(
        &p.pd,
        PoolConfig::default().classes([SizeClass::new(4096, 4)]),
    )
    .unwrap();
    let mut buf = pool.try_acquire(4096).unwrap().unwrap();
    buf.fill(0);
    // The bind's completion would reach the driver's table under wr_id 0 (the first
    // operation's id): refused before anything is posted.
    let err = Grant::window(p.a.verbs(), buf, 0..4096, RemoteAccess::WRITE, 0, |_| {
        panic!("nothing may be posted, so nothing is waited for")
    })
    .unwrap_err();
    assert!(matches!(err, Error::DriverOwned(_)), "{err}");
    println!("Grant::window on a driven queue pair: {err}");

    // Grant::new picks a registration there (no work request), and it works.
    let mut buf = pool.try_acquire(4096).unwrap().unwrap();
    buf.fill(0);
    let g = Grant::new(p.a.verbs(), buf, 0..4096, RemoteAccess::WRITE, 0, |_| {
        panic!("a registration posts nothing")
    })
    .unwrap();
    assert_eq!(g.kind(), GrantKind::Region);
    assert_eq!(p.driver.stats().unknown, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn an_operation_that_outlives_its_queue_pair_fails_and_touches_no_other() {
    let p = async_pair();
    let (ctx, pd, driver) = (p.ctx.clone(), p.pd.clone(), p.driver.clone());
    // Made on `a`, never polled: it is 'static and may be polled after `a` is gone.
    let stale =
        p.a.send(reg_with(&pd, b"stale bytes", AccessFlags::LOCAL_WRITE));
    drop(p);
    // Wait until the driver has reaped both queue pairs (their keys are free again).
    within(60, "queue pairs reaped", async {
        while driver.stats().queue_pairs != 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;

    // A new pair on the same driver takes the freed indices.
    let c = driver.create_qp(&pd, QpOptions::default()).unwrap();
    let d = driver.create_qp(&pd, QpOptions::default()).unwrap();
    connect_qps(&ctx, c.verbs(), d.verbs(), all_access());
    let rx = RegisteredBuffer::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    let mut recv = std::pin::pin!(posted(d.recv(rx)));
    // Posted, and waiting (its first poll).
    assert!(
        futures::poll!(recv.as_mut()).is_pending(),
        "nothing was sent yet"
    );

    // At 61ac8ac this panicked under the driver's lock ("queue pair is registered"), or posted
    // the stale bytes on `c`, whose key had taken the old one's place.
    let (res, _buf) = within(30, "stale send", stale).await;
    match res {
        Err(Error::QpFailed(QpFailure::Closed)) => {}
        other => panic!("a send on a dropped queue pair: {other:?}"),
    }

    // `d` got nothing from it: the first message it receives is `c`'s own.
    let tx = reg_with(&pd, b"fresh", AccessFlags::LOCAL_WRITE);
    let (r, s) = within(60, "fresh send", async { tokio::join!(recv, c.send(tx)) }).await;
    s.0.unwrap();
    let (info, rx) = (r.0.unwrap(), r.1);
    assert_eq!(&rx.to_vec()[..info.len], b"fresh");
    assert_eq!(driver.stats().unknown, 0);
}

/// Application bytes whose owner holds the last handle of a queue pair on the same driver.
struct Owner {
    buf: tokio_rdma::buf::PoolBuf,
    _qp: tokio_rdma::driver::AsyncQp,
}

impl AsRef<[u8]> for Owner {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn retired_application_bytes_are_dropped_outside_the_drivers_lock() {
    use tokio_rdma::buf::{PoolConfig, SizeClass};
    use tokio_rdma::conn::ConnectOptions;
    let ep = tokio_rdma::Endpoint::open(&common::device_name()).expect("endpoint");
    let opts = ConnectOptions::default()
        .rendezvous_threshold(None)
        .user_pool(PoolConfig::default().classes([SizeClass::new(16 << 10, 4)]));
    let addr = std::net::SocketAddr::from(([192, 0, 2, 1], 7431));
    let listener = ep.listen_with(addr, opts.clone()).await.expect("listen");
    let (c, s) = tokio::join!(ep.connect(addr, opts), listener.accept());
    let (client, server) = (c.expect("connect"), s.expect("accept"));

    let pd = tokio_rdma::verbs::ProtectionDomain::new(ep.driver().context()).unwrap();
    let qp = ep.driver().create_qp(&pd, QpOptions::default()).unwrap();
    let qps_with_it = ep.driver().stats().queue_pairs;
    let mut buf = client.pool().unwrap().acquire(16 << 10).await.unwrap();
    buf.set_len(16 << 10);
    buf.fill(0x42);
    let before = client.stats();
    // Sent without copying: the Bytes (and the queue pair its owner holds) live until the
    // device has read them, and are dropped when a completion retires the send. At 61ac8ac
    // that drop ran under the driver's lock, and the queue pair's Drop took it again: every
    // future on the endpoint hung.
    let bytes = bytes::Bytes::from_owner(Owner { buf, _qp: qp });
    let (sent, got) = within(60, "zero-copy send", async {
        tokio::join!(client.send_bytes(bytes), server.recv())
    })
    .await;
    sent.unwrap();
    let got = got.unwrap().expect("a message");
    assert!(got.iter().all(|&b| b == 0x42) && got.len() == 16 << 10);
    assert_eq!(
        client.stats().send_bytes_zero_copy - before.send_bytes_zero_copy,
        16 << 10
    );
    drop(got);
    // The endpoint keeps working, and the queue pair goes once its owner is dropped.
    for k in 0..20u8 {
        let msg = [k; 64];
        let (a, b) = within(60, "ping-pong after the drop", async {
            tokio::join!(client.send(&msg), server.recv())
        })
        .await;
        a.unwrap();
        assert_eq!(b.unwrap().expect("a message")[0], k);
    }
    within(60, "the owner's queue pair reaped", async {
        while ep.driver().stats().queue_pairs >= qps_with_it {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
}

/// Waits until the driver has reaped its closed queue pairs down to `n`.
async fn reaped_to(driver: &tokio_rdma::driver::Driver, n: u64) {
    while driver.stats().queue_pairs > n {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_queue_pair_slot_reused_thousands_of_times_works_and_its_old_keys_stay_dead() {
    // More reuses of one index than an 11-bit generation counts: until this was found the
    // 2,049th queue pair at an index was refused every request ("the queue pair was closed"),
    // so a server accepting connections one after another stopped working there.
    const ROUNDS: usize = 2_100;
    let p = async_pair();
    let (ctx, pd, driver) = (p.ctx.clone(), p.pd.clone(), p.driver.clone());
    let base = driver.stats().queue_pairs;
    let first = driver.create_qp(&pd, QpOptions::default()).unwrap();
    // Made on the first queue pair at the churned index, never polled, kept through every reuse.
    let stale = first.send(reg_with(&pd, b"stale bytes", AccessFlags::LOCAL_WRITE));
    drop(first);
    let started = std::time::Instant::now();
    within(300, "queue pair churn", async {
        reaped_to(&driver, base).await;
        for round in 0..ROUNDS {
            let qp = driver.create_qp(&pd, QpOptions::default()).unwrap();
            // A new queue pair is not failed: its key names it in the driver's core.
            assert_eq!(qp.failure(), None, "queue pair {round} of the churn");
            drop(qp);
            reaped_to(&driver, base).await;
        }
    })
    .await;
    println!(
        "{ROUNDS} queue pairs created and reaped one after another in {:.1} s",
        started.elapsed().as_secs_f64()
    );

    // The next two take the churned index and the one after it, and work.
    let c = driver.create_qp(&pd, QpOptions::default()).unwrap();
    let d = driver.create_qp(&pd, QpOptions::default()).unwrap();
    connect_qps(&ctx, c.verbs(), d.verbs(), all_access());
    let rx = RegisteredBuffer::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    let mut recv = std::pin::pin!(posted(d.recv(rx)));
    assert!(futures::poll!(recv.as_mut()).is_pending());
    match within(30, "stale send", stale).await.0 {
        Err(Error::QpFailed(QpFailure::Closed)) => {}
        other => panic!("a send on a queue pair dropped {ROUNDS} reuses ago: {other:?}"),
    }
    let tx = reg_with(&pd, b"fresh", AccessFlags::LOCAL_WRITE);
    let (r, s) = within(60, "send on the reused index", async {
        tokio::join!(recv, c.send(tx))
    })
    .await;
    s.0.unwrap();
    let (info, rx) = (r.0.unwrap(), r.1);
    assert_eq!(&rx.to_vec()[..info.len], b"fresh");
    // The pair made first still works beside them.
    let rx = RegisteredBuffer::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    let tx = reg_with(&pd, b"old pair", AccessFlags::LOCAL_WRITE);
    let ((r, rx), (s, _)) = within(60, "old pair", async {
        tokio::join!(posted(p.b.recv(rx)), p.a.send(tx))
    })
    .await;
    s.unwrap();
    assert_eq!(&rx.to_vec()[..r.unwrap().len], b"old pair");
    assert_eq!(driver.stats().unknown, 0);
}
