//! Device tests of the endpoint's memory budget (`EndpointOptions::memory_budget`, rxe,
//! soft-RoCE VM): a budget that fits two connections refuses the third before anything of it
//! is registered, on the server (the client sees the rejection with the reason) and on the
//! client (the typed `Error::MemoryBudgetExhausted`); both sides clean up (the budget back to
//! what the live connections hold, `rdma resource show` back to the baseline), and a closed
//! connection makes room for a new one.
#![allow(clippy::print_stdout)]

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::within;
use tokio_rdma::conn::{ConnectOptions, Connection, Listener};
use tokio_rdma::{Endpoint, EndpointOptions, Error};

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([192, 0, 2, 1], port))
}

/// Small connections: 4 credits of 4 KiB each way.
fn small() -> ConnectOptions {
    let mut o = ConnectOptions::default()
        .recv_credits(4)
        .recv_buf_size(4096)
        .max_message_size(64 << 10)
        .connect_timeout(Duration::from_secs(60));
    o.send_queue_depth = 16;
    o
}

/// What one such connection reserves: its receive pool `(2 x 4 + 3) x 4 KiB` and its staging
/// pool `(min(4 credits, 32, 2 x 4 + 6) + 1) x 4 KiB`.
const PER_CONNECTION: u64 = 11 * 4096 + 5 * 4096;

/// Room for two connections and half of a third.
fn endpoint() -> Endpoint {
    Endpoint::open_with(
        &common::device_name(),
        EndpointOptions::default().memory_budget(Some(2 * PER_CONNECTION + PER_CONNECTION / 2)),
    )
    .expect("endpoint")
}

fn counts() -> BTreeMap<String, u64> {
    let mut c = common::resource_counts();
    c.retain(|k, _| ["qp", "cq", "mr", "pd", "cm_id"].contains(&k.as_str()));
    c
}

/// Waits (up to 60 s) until `cond` holds.
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "{what}: not within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits (up to 60 s) until the device resources are `baseline` again.
async fn back_to(baseline: &BTreeMap<String, u64>) {
    let t0 = Instant::now();
    while counts() != *baseline && t0.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(counts(), *baseline, "device resources back to the baseline");
    println!(
        "  resources back to the baseline {baseline:?} in {:?}",
        t0.elapsed()
    );
}

async fn pair(client: &Endpoint, listener: &Listener, port: u16) -> (Connection, Connection) {
    let (c, s) = tokio::join!(
        within(60, "connect", client.connect(addr(port), small())),
        within(60, "accept", listener.accept()),
    );
    let (c, s) = (c.expect("connect"), s.expect("accept"));
    c.send(b"ping").await.expect("send");
    assert_eq!(&s.recv().await.expect("recv").expect("msg")[..], b"ping");
    (c, s)
}

async fn close_all(conns: Vec<Connection>) {
    for c in &conns {
        let _ = within(60, "close", c.close()).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_servers_budget_for_two_connections_refuses_the_third() {
    common::init_tracing();
    let server_ep = endpoint();
    let client_ep = Endpoint::open(&common::device_name()).expect("client endpoint");
    let listener = server_ep
        .listen_with(addr(7481), small())
        .await
        .expect("listen");
    // Taken once the device is open (librdmacm keeps a protection domain per device for the
    // process from then on).
    let baseline = counts();
    let (a, a_srv) = pair(&client_ep, &listener, 7481).await;
    let (b, b_srv) = pair(&client_ep, &listener, 7481).await;
    assert_eq!(server_ep.memory_stats().in_use, 2 * PER_CONNECTION);

    let third = within(
        60,
        "the third connection",
        client_ep.connect(addr(7481), small()),
    )
    .await
    .expect_err("no room for a third connection");
    println!("server budget, third connection: {third}");
    assert!(
        matches!(third, Error::ConnectionRejected { .. })
            && third.to_string().contains("memory budget"),
        "{third:?}"
    );
    let m = server_ep.memory_stats();
    println!("  server endpoint: {m:?}");
    assert_eq!((m.in_use, m.refused), (2 * PER_CONNECTION, 1));
    // The client's half-made connection is gone too.
    eventually("the client's budget", || {
        client_ep.memory_stats().in_use == 2 * PER_CONNECTION
    })
    .await;

    // A closed connection gives its share back: a new one is admitted.
    close_all(vec![a, a_srv]).await;
    eventually("a's share back", || {
        server_ep.memory_stats().in_use == PER_CONNECTION
    })
    .await;
    let (c, c_srv) = pair(&client_ep, &listener, 7481).await;
    close_all(vec![b, b_srv, c, c_srv]).await;
    eventually("every share back", || {
        server_ep.memory_stats().in_use == 0 && client_ep.memory_stats().in_use == 0
    })
    .await;
    back_to(&baseline).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_clients_budget_for_two_connections_refuses_the_third_with_the_typed_error() {
    common::init_tracing();
    let server_ep = Endpoint::open(&common::device_name()).expect("server endpoint");
    let client_ep = endpoint();
    let listener = server_ep
        .listen_with(addr(7482), small())
        .await
        .expect("listen");
    // Taken once the device is open (librdmacm keeps a protection domain per device for the
    // process from then on).
    let baseline = counts();
    let (a, a_srv) = pair(&client_ep, &listener, 7482).await;
    let (b, b_srv) = pair(&client_ep, &listener, 7482).await;

    let third = within(
        60,
        "the third connection",
        client_ep.connect(addr(7482), small()),
    )
    .await
    .expect_err("no room for a third connection");
    println!("client budget, third connection: {third}");
    match third {
        Error::MemoryBudgetExhausted {
            budget,
            in_use,
            needed,
        } => {
            assert_eq!(budget, 2 * PER_CONNECTION + PER_CONNECTION / 2);
            assert_eq!((in_use, needed), (2 * PER_CONNECTION, PER_CONNECTION));
        }
        other => panic!("expected MemoryBudgetExhausted, got {other:?}"),
    }
    assert_eq!(client_ep.memory_stats().refused, 1);
    // The server's half of it (our reply was rejected) is torn down, nothing accepted.
    eventually("the server's budget", || {
        server_ep.memory_stats().in_use == 2 * PER_CONNECTION
    })
    .await;
    let nothing = tokio::time::timeout(Duration::from_secs(2), listener.accept()).await;
    assert!(
        nothing.is_err(),
        "no third connection reached the server: {nothing:?}"
    );

    close_all(vec![a, a_srv, b, b_srv]).await;
    eventually("every share back", || {
        server_ep.memory_stats().in_use == 0 && client_ep.memory_stats().in_use == 0
    })
    .await;
    back_to(&baseline).await;
}

/// Slack above one connection's pools, for the rendezvous read test below.
const SLACK: u64 = 64 << 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_rendezvous_read_past_the_budget_is_refused_and_the_message_stays_queued() {
    common::init_tracing();
    // One connection's pools plus 64 KiB: a 256 KiB rendezvous message cannot be read into a
    // buffer of the crate's own (that buffer is registered memory of this endpoint), a 48 KiB
    // one can. At 08b6742 and before, `recv` allocated and registered any announced size up to
    // `max_message_size` outside the budget.
    let server_ep = Endpoint::open_with(
        &common::device_name(),
        EndpointOptions::default().memory_budget(Some(PER_CONNECTION + SLACK)),
    )
    .expect("server endpoint");
    let client_ep = Endpoint::open(&common::device_name()).expect("client endpoint");
    let o = small()
        .max_message_size(1 << 20)
        .rendezvous_threshold(Some(32 << 10));
    let listener = server_ep
        .listen_with(addr(7483), o.clone())
        .await
        .expect("listen");
    let (c, s) = tokio::join!(
        within(60, "connect", client_ep.connect(addr(7483), o)),
        within(60, "accept", listener.accept()),
    );
    let (c, s) = (c.expect("connect"), s.expect("accept"));
    assert!(s.params().rendezvous, "rendezvous negotiated");
    assert_eq!(server_ep.memory_stats().in_use, PER_CONNECTION);

    let big = bytes::Bytes::from(common::pattern(256 << 10, 7));
    let small_msg = bytes::Bytes::from(common::pattern(48 << 10, 8));
    let sender = {
        let (big, small_msg) = (big.clone(), small_msg.clone());
        tokio::spawn(async move {
            c.send_bytes(big).await?;
            c.send_bytes(small_msg).await?;
            Ok::<_, Error>(c)
        })
    };

    // `recv` refuses the big one, twice: it stays queued, nothing registered for it.
    for attempt in 0..2 {
        let err = within(60, "recv", s.recv())
            .await
            .expect_err("no room for a 256 KiB read buffer");
        println!("recv attempt {attempt}: {err}");
        match err {
            Error::MemoryBudgetExhausted {
                budget,
                in_use,
                needed,
            } => {
                assert_eq!(budget, PER_CONNECTION + SLACK);
                assert_eq!((in_use, needed), (PER_CONNECTION, 256 << 10));
            }
            other => panic!("expected MemoryBudgetExhausted, got {other:?}"),
        }
    }
    let m = server_ep.memory_stats();
    println!("  server endpoint after the refusals: {m:?}");
    assert_eq!((m.in_use, m.refused), (PER_CONNECTION, 2));

    // The caller's own buffer takes it: nothing was lost, and the order holds.
    let (got, v) = within(60, "recv_into", s.recv_into(vec![0u8; 256 << 10])).await;
    assert_eq!(got.expect("recv_into"), Some(256 << 10));
    assert!(v[..] == big[..], "the big message, intact");
    // A message that fits the slack is read into a buffer of the crate's, in the budget
    // while it is read, and given back after.
    let msg = within(60, "recv", s.recv())
        .await
        .expect("recv")
        .expect("a message");
    assert!(msg[..] == small_msg[..], "the 48 KiB message, intact");
    drop(msg);
    assert_eq!(server_ep.memory_stats().in_use, PER_CONNECTION);
    let c = within(60, "sender", sender)
        .await
        .expect("sender task")
        .expect("both sends");
    close_all(vec![c, s]).await;
    eventually("every share back", || server_ep.memory_stats().in_use == 0).await;
}
