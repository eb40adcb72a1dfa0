//! Device tests of a queue pair's teardown on an endpoint's shared receive queue: it is
//! destroyed (its number free for reuse, its key released) only after
//! `IBV_EVENT_QP_LAST_WQE_REACHED` told that it takes no more receives from the queue, or,
//! on a provider that never sends the event (soft-RoCE before Linux 6.5), after a bound of
//! 2 s (`DriverStats::last_wqe_timeouts`). Run on the default 6.1 guest the fallback is
//! checked; on `scripts/rxe-vm --kernel 6.19` the event. With a second endpoint open on the
//! device, every event still reaches the endpoint whose queue pairs it names (each endpoint
//! has a device context of its own, so none reads another's events).
#![allow(clippy::print_stdout)]

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::within;
use tokio_rdma::conn::{ConnectOptions, Connection, Listener, SrqOptions};
use tokio_rdma::{Endpoint, EndpointOptions};

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([192, 0, 2, 1], port))
}

/// Connects to `listener` (on `port`) from `ep` and accepts: (client, server).
async fn pair(
    ep: &Endpoint,
    listener: &Listener,
    port: u16,
    opts: &ConnectOptions,
) -> (Connection, Connection) {
    let (c, s) = within(60, "connection setup", async {
        tokio::join!(ep.connect(addr(port), opts.clone()), listener.accept())
    })
    .await;
    (c.expect("connect"), s.expect("accept"))
}

/// Whether this kernel's rxe sends the last-WQE event (Linux 6.5 and later).
fn rxe_sends_last_wqe() -> bool {
    let rel = std::fs::read_to_string("/proc/sys/kernel/osrelease").expect("osrelease");
    let mut it = rel
        .trim()
        .split(['.', '-'])
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (it.next().unwrap_or(0), it.next().unwrap_or(0));
    println!("kernel {}", rel.trim());
    (major, minor) >= (6, 5)
}

#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_queue_pair_on_the_shared_receive_queue_is_destroyed_after_its_last_wqe_event() {
    common::init_tracing();
    let with_event = rxe_sends_last_wqe();
    // Both ends on the one endpoint: its driver owns both queue pairs (both on the queue).
    let ep = Endpoint::open_with(
        &common::device_name(),
        EndpointOptions::default()
            .shared_receive_queue(SrqOptions::default().buffers(32).buffer_size(4096)),
    )
    .expect("endpoint with a shared receive queue");
    let opts = ConnectOptions::default()
        .recv_buf_size(4096)
        .recv_credits(8);
    let listener = ep
        .listen_with(addr(7491), opts.clone())
        .await
        .expect("listen");
    let (client, server) = pair(&ep, &listener, 7491, &opts).await;
    let (sent, got) = within(60, "a message", async {
        tokio::join!(client.send(b"on the queue"), server.recv())
    })
    .await;
    sent.expect("send");
    assert_eq!(&got.expect("recv").expect("a message")[..], b"on the queue");
    let before = ep.stats();
    println!("before the close: {before:?}");
    assert!(before.queue_pairs >= 2, "both connections' queue pairs");

    let t0 = Instant::now();
    within(60, "close", async {
        let (a, b) = tokio::join!(client.close(), server.recv());
        a.expect("close");
        assert!(b.expect("end of stream").is_none());
        server.close().await.expect("close");
    })
    .await;
    drop((client, server));
    let after = within(60, "both queue pairs destroyed", async {
        loop {
            let st = ep.stats();
            if st.queue_pairs + 2 <= before.queue_pairs {
                return st;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let took = t0.elapsed();
    let events = after.last_wqe_reached - before.last_wqe_reached;
    let timeouts = after.last_wqe_timeouts - before.last_wqe_timeouts;
    println!("destroyed {took:?} after the close: {events} last-WQE events, {timeouts} timeouts");
    if with_event {
        assert!(events >= 2, "each queue pair's event reached its driver");
        assert_eq!(timeouts, 0, "destroyed after the event, not at the bound");
    } else {
        assert_eq!(
            timeouts, 2,
            "without the event: destroyed at the bound, counted"
        );
        assert!(took >= Duration::from_secs(2), "not before the bound");
    }
}

/// Several endpoints on one device: each has a device context of its own (one more `ctx` in
/// `rdma resource` per endpoint), so the device's async events about one endpoint's queue
/// pairs reach that endpoint and no other. With librdmacm's context shared (as before), an
/// idle second endpoint's event task read about half of the first one's last-WQE events,
/// whose queue pairs then waited for the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn endpoints_on_one_device_each_get_their_own_async_events() {
    common::init_tracing();
    const CONNS: u64 = 4;
    let with_event = rxe_sends_last_wqe();
    let ctxs = || common::resource_counts().get("ctx").copied().unwrap_or(0);
    let ep = Endpoint::open_with(
        &common::device_name(),
        EndpointOptions::default()
            .shared_receive_queue(SrqOptions::default().buffers(64).buffer_size(4096)),
    )
    .expect("endpoint with a shared receive queue");
    let one = ctxs();
    // Another endpoint on the device, idle: its event task reads its own context's events.
    let other = Endpoint::open(&common::device_name()).expect("another endpoint");
    let two = ctxs();
    println!("device contexts: {one} with one endpoint, {two} with two");

    let opts = ConnectOptions::default()
        .recv_buf_size(4096)
        .recv_credits(4);
    let listener = ep
        .listen_with(addr(7492), opts.clone())
        .await
        .expect("listen");
    let mut conns = Vec::new();
    for _ in 0..CONNS {
        conns.push(pair(&ep, &listener, 7492, &opts).await);
    }
    let before = ep.stats();
    let t0 = Instant::now();
    for (client, server) in conns {
        within(60, "close", async {
            let (a, b) = tokio::join!(client.close(), server.recv());
            a.expect("close");
            assert!(b.expect("end of stream").is_none());
            server.close().await.expect("close");
        })
        .await;
    }
    let after = within(60, "every queue pair destroyed", async {
        loop {
            let st = ep.stats();
            if st.queue_pairs + 2 * CONNS <= before.queue_pairs {
                return st;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let events = after.last_wqe_reached - before.last_wqe_reached;
    let timeouts = after.last_wqe_timeouts - before.last_wqe_timeouts;
    println!(
        "{} queue pairs destroyed {:?} after the closes began: {events} last-WQE events, \
         {timeouts} timeouts; the other endpoint: {:?}",
        2 * CONNS,
        t0.elapsed(),
        other.stats()
    );
    if with_event {
        assert!(
            events >= 2 * CONNS,
            "every queue pair's event reached its endpoint"
        );
        assert_eq!(timeouts, 0, "none waited for the bound");
    } else {
        assert_eq!(timeouts, 2 * CONNS, "without the event: the bound, counted");
    }
    assert_eq!(two, one + 1, "the second endpoint has a context of its own");
    drop(other);
}
