//! Device tests of an endpoint's shared receive queue (`EndpointOptions::shared_receive_queue`):
//! many connections receive into one set of buffers without a receiver-not-ready (rxe's RNR
//! counters are checked), credits above each connection's floor come and go with the queue,
//! a connection that does not fit is refused with the reason, a reader that stops does not
//! stall the others, options that cannot apply are refused, and every claim and buffer is
//! back when the connections are gone.
#![allow(clippy::print_stdout)]

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use common::within;
use tokio_rdma::conn::{ConnectOptions, Connection, Listener, SrqOptions, SrqStats};
use tokio_rdma::{Endpoint, EndpointOptions, Error};

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([192, 0, 2, 1], port))
}

fn srq_endpoint(buffers: u32) -> Endpoint {
    Endpoint::open_with(
        &common::device_name(),
        EndpointOptions::default()
            .shared_receive_queue(SrqOptions::default().buffers(buffers).buffer_size(4096)),
    )
    .expect("endpoint with a shared receive queue")
}

/// The client side: a plain endpoint, 4 KiB receives like the server's.
fn client_opts() -> ConnectOptions {
    ConnectOptions::default()
        .recv_buf_size(4096)
        .recv_credits(8)
}

/// rxe's RNR counters: NAKs sent and received, retries exhausted.
fn rnr_counters() -> BTreeMap<String, u64> {
    let dir = format!(
        "/sys/class/infiniband/{}/ports/1/hw_counters",
        common::device_name()
    );
    let mut out = BTreeMap::new();
    for name in ["rcvd_rnr_err", "send_rnr_err", "retry_rnr_exceeded_err"] {
        let v = std::fs::read_to_string(format!("{dir}/{name}"))
            .unwrap_or_else(|e| panic!("{dir}/{name}: {e}"));
        out.insert(name.to_string(), v.trim().parse().expect("a counter"));
    }
    out
}

fn message(conn: usize, seq: usize) -> Vec<u8> {
    // Sizes from 1 byte to three receive buffers (chunked).
    let len = 1 + (conn * 997 + seq * 331) % (3 * 4096);
    let mut m = common::pattern(len, (conn * 31 + seq) as u8);
    m[0] = conn as u8;
    m
}

/// A client connection to `listener` (on `port`) and its server side.
async fn pair(client_ep: &Endpoint, listener: &Listener, port: u16) -> (Connection, Connection) {
    let (c, s) = within(60, "connection setup", async {
        tokio::join!(
            client_ep.connect(addr(port), client_opts()),
            listener.accept()
        )
    })
    .await;
    (c.expect("connect"), s.expect("accept"))
}

/// One receive buffer's worth or less: a message the receiver holds in its receive buffer.
fn small(seq: usize) -> Vec<u8> {
    common::pattern(1000, seq as u8)
}

/// Waits until the queue settled back: no connection, every buffer posted, nothing claimed.
async fn settled(ep: &Endpoint, buffers: u32) -> SrqStats {
    within(30, "the shared receive queue settles", async {
        loop {
            let s = ep.shared_receive_stats().expect("configured");
            if s.connections == 0 && s.posted == u64::from(buffers) && s.granted == 0 {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn many_connections_share_the_queue_without_rnr() {
    common::init_tracing();
    const CONNS: usize = 8;
    const MSGS: usize = 150;
    const BUFFERS: u32 = 64;
    let server_ep = srq_endpoint(BUFFERS);
    let client_ep = Endpoint::open(&common::device_name()).expect("client endpoint");
    let before = settled(&server_ep, BUFFERS).await;
    assert_eq!(before.pool.buffers_in_use, u64::from(BUFFERS), "all posted");
    let rnr_before = rnr_counters();
    let listener = server_ep.listen(addr(7461)).await.expect("listen");
    let mut clients = Vec::new();
    let mut servers = Vec::new();
    for _ in 0..CONNS {
        let (c, s) = pair(&client_ep, &listener, 7461).await;
        clients.push(c);
        servers.push(s);
    }
    let p = servers[0].params();
    assert_eq!(p.recv_buf_size, 4096, "the queue's buffer size");
    assert!(!p.one_sided && !p.atomics && !p.rendezvous, "{p:?}");
    assert_eq!(
        p.recv_initial_credits, 2,
        "a floor of 2 data credits at the start"
    );
    let s = server_ep.shared_receive_stats().unwrap();
    println!("admitted {CONNS}: {s:?}");
    assert_eq!(s.connections as usize, CONNS);
    assert!(s.granted >= 5 * CONNS as u64, "every floor granted: {s:?}");
    assert!(
        s.granted <= u64::from(BUFFERS),
        "never more than the queue has: {s:?}"
    );

    // Every client sends MSGS messages at once; each server checks its own, in order, and
    // answers the last one.
    let sends = clients.iter().enumerate().map(|(i, c)| async move {
        for k in 0..MSGS {
            c.send(&message(i, k)).await.expect("send");
        }
        let reply = c.recv().await.expect("reply").expect("a reply");
        assert_eq!(&reply[..], format!("got {MSGS} from {i}").as_bytes());
    });
    let recvs = servers.iter().map(|s| async move {
        let first = s.recv().await.expect("recv").expect("a message");
        let i = first[0] as usize;
        assert!(first[..] == message(i, 0)[..], "conn {i} message 0 intact");
        for k in 1..MSGS {
            let m = s.recv().await.expect("recv").expect("a message");
            assert!(m[..] == message(i, k)[..], "conn {i} message {k} intact");
        }
        s.send(format!("got {MSGS} from {i}").as_bytes())
            .await
            .expect("reply");
        i
    });
    let (_, mut seen) = within(240, "all connections active", async {
        tokio::join!(
            futures::future::join_all(sends),
            futures::future::join_all(recvs)
        )
    })
    .await;
    seen.sort_unstable();
    assert_eq!(
        seen,
        (0..CONNS).collect::<Vec<_>>(),
        "every connection heard"
    );
    let during = server_ep.shared_receive_stats().unwrap();
    println!("after {} messages: {during:?}", CONNS * MSGS);
    let rnr_after = rnr_counters();
    assert_eq!(rnr_before, rnr_after, "no receiver-not-ready at all");

    for (c, s) in clients.iter().zip(&servers) {
        c.close().await.expect("client close");
        s.close().await.expect("server close");
    }
    drop((clients, servers));
    let after = settled(&server_ep, BUFFERS).await;
    println!("after close: {after:?}");
    assert_eq!(after.spare, i64::from(BUFFERS), "every claim given back");
    assert_eq!(after.orphans, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_full_queue_refuses_connections_and_a_stalled_reader_stalls_nobody_else() {
    common::init_tracing();
    // Room for two floors (5 each) and 2 receives more.
    const BUFFERS: u32 = 12;
    let server_ep = srq_endpoint(BUFFERS);
    let client_ep = Endpoint::open(&common::device_name()).expect("client endpoint");
    settled(&server_ep, BUFFERS).await;
    let rnr_before = rnr_counters();
    let listener = server_ep.listen(addr(7462)).await.expect("listen");
    let (a, a_srv) = pair(&client_ep, &listener, 7462).await;
    let (b, b_srv) = pair(&client_ep, &listener, 7462).await;

    // A third connection does not fit: refused with the reason, before anything was used.
    let third = within(
        30,
        "the refused connection",
        client_ep.connect(addr(7462), client_opts()),
    )
    .await
    .expect_err("no room for a third floor");
    println!("third connection: {third}");
    match &third {
        Error::ConnectionRejected { .. } => {
            assert!(
                third.to_string().contains("shared receive queue"),
                "{third}"
            )
        }
        other => panic!("expected ConnectionRejected, got {other:?}"),
    }
    let s = server_ep.shared_receive_stats().unwrap();
    assert_eq!((s.connections, s.refused), (2, 1), "{s:?}");

    // A's server side stops reading: A's messages pile up in the buffers A could claim,
    // then its sender waits for credits; B carries on through its floor.
    const A_MSGS: usize = 40;
    let a_sender = tokio::spawn(async move {
        for k in 0..A_MSGS {
            a.send(&small(k)).await.expect("a send");
        }
        a
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let b_traffic = async {
        for k in 0..100usize {
            b.send(&message(1, k)).await.expect("b send");
            let m = b_srv.recv().await.expect("b recv").expect("a message");
            assert!(m[..] == message(1, k)[..], "b message {k} intact");
        }
    };
    within(120, "b while a's reader is stalled", b_traffic).await;
    let held = server_ep.shared_receive_stats().unwrap();
    println!("b done while a's reader stalls: {held:?}");
    assert!(
        !a_sender.is_finished(),
        "a's sender is held back by its credits"
    );
    assert!(
        held.pool.buffers_in_use <= u64::from(BUFFERS),
        "a holds what it claimed, no more: {held:?}"
    );

    // A's reader comes back: everything, in order, and the sender finishes.
    within(60, "a's backlog", async {
        for k in 0..A_MSGS {
            let m = a_srv.recv().await.expect("a recv").expect("a message");
            assert!(m[..] == small(k)[..], "a message {k} intact");
        }
    })
    .await;
    let a = within(30, "a's sender", a_sender).await.expect("a's task");
    assert_eq!(rnr_before, rnr_counters(), "no receiver-not-ready");

    for c in [&a, &b, &a_srv, &b_srv] {
        let _ = c.close().await;
    }
    drop((a, b, a_srv, b_srv));
    let after = settled(&server_ep, BUFFERS).await;
    assert_eq!(after.spare, i64::from(BUFFERS), "{after:?}");
    // Room again: a new connection is admitted.
    let (c, s) = pair(&client_ep, &listener, 7462).await;
    c.send(b"room again").await.unwrap();
    assert_eq!(&s.recv().await.unwrap().unwrap()[..], b"room again");
}

#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn options_that_cannot_apply_on_a_shared_queue_are_refused() {
    common::init_tracing();
    let dev = common::device_name();
    for bad in [
        SrqOptions::default().buffers(0),
        SrqOptions::default().buffer_size(16),
        SrqOptions::default().buffers(8).low_watermark(8),
    ] {
        let e = Endpoint::open_with(&dev, EndpointOptions::default().shared_receive_queue(bad))
            .expect_err("refused");
        println!("{bad:?}: {e}");
        assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    }
    let ep = srq_endpoint(32);
    let plain = Endpoint::open(&dev).expect("endpoint");
    let listener = plain.listen(addr(7463)).await.expect("listen");
    for (what, opts) in [
        ("one_sided", ConnectOptions::default().one_sided(true)),
        ("atomics", ConnectOptions::default().atomics(true)),
        (
            "rendezvous",
            ConnectOptions::default().rendezvous_threshold(Some(1 << 20)),
        ),
        (
            "recv_buf_size",
            ConnectOptions::default().recv_buf_size(8192),
        ),
    ] {
        let e = ep.connect(addr(7463), opts).await.expect_err(what);
        println!("{what}: {e}");
        assert!(matches!(e, Error::InvalidArgument(_)), "{what}: {e:?}");
        assert!(e.to_string().contains(what), "{e}");
    }
    assert_eq!(listener.pending(), 0, "nothing reached the listener");
    // The defaults adapt: no offers, the queue's buffer size; the peer's grants still work
    // from this side.
    let (c, s) = tokio::join!(
        ep.connect(addr(7463), ConnectOptions::default()),
        listener.accept()
    );
    let (c, s) = (c.expect("connect"), s.expect("accept"));
    assert!(
        !c.params().one_sided && !s.params().peer_one_sided,
        "no offer from the shared queue's side"
    );
    assert!(c.params().peer_one_sided, "the plain side still offers");
    assert_eq!(c.params().recv_buf_size, 4096);
    let mut buf = s.pool().unwrap().acquire(64).await.unwrap();
    buf.copy_from_slice(&[7u8; 64]);
    let grant = s
        .grant(buf, 0..64, tokio_rdma::buf::RemoteAccess::READ)
        .expect("the plain side grants");
    s.send(&grant.token().to_bytes()).await.unwrap();
    let token = c.recv().await.unwrap().unwrap();
    let token = tokio_rdma::buf::RemoteToken::from_bytes(&token).expect("token");
    let mut local = c.pool().unwrap().acquire(64).await.unwrap();
    local.set_len(64);
    let (r, local) = c.read(local, token.slice(0..64).unwrap()).await;
    r.expect("READ from the plain side's grant");
    assert_eq!(&local[..], &[7u8; 64]);
    // And this side's grant is refused locally.
    let mine = c.pool().unwrap().acquire(64).await.unwrap();
    let e = c
        .grant(mine, 0..64, tokio_rdma::buf::RemoteAccess::READ)
        .expect_err("no grants on a shared queue's connection");
    println!("grant on the shared queue's side: {e}");
}
