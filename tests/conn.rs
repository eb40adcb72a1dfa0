//! Device tests of connections over RDMA CM on rxe (soft-RoCE VM): messages with credit flow
//! control, many concurrent connections, byte streams, one-sided I/O with exchanged tokens,
//! graceful close, dead peers, and malformed handshakes.
#![allow(clippy::print_stdout)]

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::within;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rdma::buf::RemoteToken;
use tokio_rdma::conn::{ConnectOptions, Connection, Listener};

/// A fresh port on rxe0's address for each test.
fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([192, 0, 2, 1], port))
}

/// rxe's RNR counters (sent and received RNR NAKs), summed; `None` if the device has none.
fn rnr_counters() -> Option<u64> {
    let dir = std::path::Path::new("/sys/class/infiniband/rxe0/ports/1/hw_counters");
    let mut total = 0;
    let mut found = false;
    for name in ["rcvd_rnr_err", "send_rnr_err", "retry_rnr_exceeded_err"] {
        if let Ok(s) = std::fs::read_to_string(dir.join(name)) {
            total += s.trim().parse::<u64>().unwrap_or(0);
            found = true;
        }
    }
    found.then_some(total)
}

/// Deterministic pseudo-random bytes.
fn payload(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn echo_messages_and_clean_close() {
    let listener = Listener::bind(addr(7001)).await.expect("bind");
    let server = tokio::spawn(async move {
        let conn = within(60, "accept", listener.accept())
            .await
            .expect("accept");
        let mut n = 0;
        while let Some(msg) = conn.recv().await.expect("server recv") {
            conn.send(&msg).await.expect("echo");
            n += 1;
        }
        // The client closed: our recv saw end-of-stream after every message.
        (n, conn.stats())
    });
    let conn = within(60, "connect", Connection::connect(addr(7001)))
        .await
        .expect("connect");
    let p = *conn.params();
    println!("negotiated: {p:?}");
    for (i, len) in [0usize, 1, 100, 4096, 65536, 65537, 300_000, 1 << 20]
        .into_iter()
        .enumerate()
    {
        let data = payload(i as u64, len);
        within(60, "send", conn.send(&data)).await.expect("send");
        let back = within(60, "recv", conn.recv())
            .await
            .expect("recv")
            .expect("not EOF");
        assert_eq!(back.len(), len);
        assert!(back[..] == data[..], "echo of {len} bytes");
    }
    let stats = conn.stats();
    within(60, "close", conn.close()).await.expect("close");
    let (n, server_stats) = within(60, "server", server).await.unwrap();
    assert_eq!(n, 8);
    println!("client {stats:?}\nserver {server_stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn sixty_four_connections_exchange_random_messages_without_rnr() {
    common::init_tracing();
    let conns: usize = std::env::var("TOKIO_RDMA_CONNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64);
    let per_conn: usize = std::env::var("TOKIO_RDMA_CONN_MSGS")
        .ok()
        .and_then(|v| v.parse().ok())
        // 250 by default: 16,000 round trips of random sizes, each connection's 1 B and 1 MiB
        // among them, flow control engaged throughout (1,000 took 145 s of the test run).
        .unwrap_or(250);
    let rnr_before = rnr_counters();
    // Small receive queues so that flow control is exercised constantly.
    // The listener runs the handshakes concurrently, but 64 at once under emulation are slow:
    // generous limits on both sides.
    let opts = ConnectOptions::default()
        .recv_credits(8)
        .recv_buf_size(16 << 10)
        .max_message_size(1 << 20)
        .connect_timeout(Duration::from_secs(300))
        .handshake_timeout(Duration::from_secs(300))
        // 64 connections moving 1 MiB messages at once through emulated rxe can leave one
        // queue pair unserved for longer than the default 10 s; this test is about flow
        // control, not dead-peer detection (tests/conn_hostile.rs covers that).
        .keepalive_timeout(Duration::from_secs(120));
    let listener = Arc::new(
        Listener::bind_with(addr(7002), opts.clone())
            .await
            .expect("bind"),
    );
    let started = Instant::now();
    let server = {
        let listener = listener.clone();
        tokio::spawn(async move {
            let mut tasks = tokio::task::JoinSet::new();
            for _ in 0..conns {
                let conn = within(120, "accept", listener.accept())
                    .await
                    .expect("accept");
                tasks.spawn(async move {
                    let mut n = 0u64;
                    while let Some(msg) = conn.recv().await.expect("server recv") {
                        conn.send(&msg).await.expect("echo");
                        n += 1;
                    }
                    (n, conn.stats())
                });
            }
            let mut total = 0;
            let mut waits = 0;
            while let Some(r) = tasks.join_next().await {
                let (n, s) = r.unwrap();
                total += n;
                waits += s.protocol.credit_waits;
            }
            (total, waits)
        })
    };
    let mut clients = tokio::task::JoinSet::new();
    for c in 0..conns {
        let opts = opts.clone();
        clients.spawn(async move {
            let conn = Connection::connect_with(addr(7002), opts)
                .await
                .expect("connect");
            let mut bytes = 0u64;
            let mut seed = c as u64 * 1_000_003 + 1;
            for i in 0..per_conn {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                // Random sizes from 1 B to 1 MiB, log-uniform within three bands so the total
                // stays within what soft-RoCE under emulation moves in minutes: mostly up to
                // 4 KiB, some up to 64 KiB, a few up to 1 MiB; every connection also sends
                // exactly 1 B and exactly 1 MiB.
                let r = (seed >> 33) % 1000;
                let max_bits = if r < 950 {
                    12
                } else if r < 995 {
                    16
                } else {
                    20
                };
                let bits = ((seed >> 17) % (max_bits + 1)) as u32;
                let len = match i {
                    0 => 1,
                    1 => 1 << 20,
                    _ => ((1usize << bits) + (seed as usize >> 7) % (1usize << bits))
                        .clamp(1, 1 << 20),
                };
                let data = payload(seed, len);
                conn.send(&data)
                    .await
                    .unwrap_or_else(|e| panic!("conn {c} send {i}: {e}"));
                let back = conn.recv().await.expect("recv").expect("not EOF");
                assert!(
                    back[..] == data[..],
                    "conn {c} message {i} ({len} bytes) corrupted"
                );
                bytes += len as u64;
            }
            let stats = conn.stats();
            conn.close().await.expect("close");
            (bytes, stats)
        });
    }
    let mut bytes = 0;
    let mut messages = 0;
    let mut credit_waits = 0;
    while let Some(r) = within(1800, "clients", clients.join_next()).await {
        let (b, s) = r.unwrap();
        bytes += b;
        messages += s.protocol.messages_received;
        credit_waits += s.protocol.credit_waits;
    }
    let (echoed, server_waits) = within(120, "server", server).await.unwrap();
    assert_eq!(messages as usize, conns * per_conn);
    assert_eq!(echoed as usize, conns * per_conn);
    let rnr_after = rnr_counters();
    println!(
        "{conns} connections x {per_conn} messages ({bytes} bytes each way) echoed and verified in {:?}; credit waits: clients {credit_waits}, server {server_waits}; rxe RNR counters before {rnr_before:?} after {rnr_after:?}",
        started.elapsed()
    );
    if let (Some(a), Some(b)) = (rnr_before, rnr_after) {
        assert_eq!(
            a, b,
            "RNR NAKs happened: flow control let a send overrun the receiver"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn byte_stream_with_codec_style_io() {
    let listener = Listener::bind(addr(7003)).await.expect("bind");
    let server = tokio::spawn(async move {
        let mut s = listener.accept().await.expect("accept").into_stream();
        let mut all = Vec::new();
        s.read_to_end(&mut all).await.expect("read to end");
        s.write_all(&(all.len() as u64).to_be_bytes())
            .await
            .unwrap();
        s.shutdown().await.unwrap();
        all
    });
    let mut s = Connection::connect(addr(7003))
        .await
        .expect("connect")
        .into_stream();
    let data = payload(42, 200_000);
    for part in data.chunks(7_777) {
        s.write_all(part).await.unwrap();
    }
    s.flush().await.unwrap();
    s.shutdown().await.unwrap();
    let mut len = [0u8; 8];
    s.read_exact(&mut len).await.unwrap();
    assert_eq!(u64::from_be_bytes(len), 200_000);
    let mut rest = Vec::new();
    assert_eq!(
        s.read_to_end(&mut rest).await.unwrap(),
        0,
        "EOF after the server's shutdown"
    );
    let got = within(60, "server", server).await.unwrap();
    assert!(got == data, "stream bytes in order");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn one_sided_io_with_an_exchanged_grant() {
    use tokio_rdma::buf::RemoteAccess;
    let listener = Listener::bind(addr(7004)).await.expect("bind");
    let server = tokio::spawn(async move {
        let conn = listener.accept().await.expect("accept");
        // Grant a 64 KiB region, readable and writable, and send the token.
        let buf = conn.pool().unwrap().acquire(65536).await.unwrap();
        let mut grant = conn
            .grant(buf, 0..65536, RemoteAccess::READ | RemoteAccess::WRITE)
            .expect("grant");
        grant.write_at(0, &payload(7, 65536));
        conn.send(&grant.token().to_bytes()).await.unwrap();
        // Wait for the client's "done", then check what it wrote.
        let done = conn.recv().await.unwrap().unwrap();
        assert_eq!(&done[..], b"done");
        let mut got = vec![0u8; 4096];
        grant.read_at(1000, &mut got);
        assert!(
            got == payload(8, 4096),
            "the client's RDMA WRITE is visible"
        );
        conn.send(b"ok").await.unwrap();
        let _ = conn.recv().await;
    });
    let conn = Connection::connect(addr(7004)).await.expect("connect");
    let token = RemoteToken::from_bytes(&conn.recv().await.unwrap().unwrap()).unwrap();
    let local = conn.pool().unwrap().acquire(4096).await.unwrap();
    let (res, local) = conn.read(local, token.slice(0..4096).unwrap()).await;
    res.unwrap();
    assert!(
        local[..] == payload(7, 65536)[..4096],
        "RDMA READ of the granted region"
    );
    let mut local = local;
    local.copy_from_slice(&payload(8, 4096));
    let (res, _local) = conn.write(local, token.slice(1000..5096).unwrap()).await;
    res.unwrap();
    conn.send(b"done").await.unwrap();
    assert_eq!(&conn.recv().await.unwrap().unwrap()[..], b"ok");
    // Outside the grant: rejected before posting (the token cannot be widened).
    assert!(token.slice(60_000..70_000).is_err());
    // Local memory registered in a protection domain of one's own: refused before posting
    // (the device would fail it with a local protection error and kill the connection).
    let ctx = tokio_rdma::verbs::Context::open("rxe0").unwrap();
    let pd = tokio_rdma::verbs::ProtectionDomain::new(&ctx).unwrap();
    let foreign = tokio_rdma::buf::Pool::with_pd(&pd, Default::default()).unwrap();
    let remote = token.slice(0..4096).unwrap();
    let (res, _) = conn
        .read(foreign.acquire(4096).await.unwrap(), remote)
        .await;
    let err = res.expect_err("a read into another protection domain's memory");
    println!("foreign local buffer: {err}");
    assert!(
        matches!(err, tokio_rdma::Error::InvalidArgument(_))
            && err.to_string().contains("conn.pool()"),
        "{err}"
    );
    let (res, _) = conn.write(foreign.acquire(64).await.unwrap(), remote).await;
    assert!(matches!(res, Err(tokio_rdma::Error::InvalidArgument(_))));
    // The connection lives on.
    let local = conn.pool().unwrap().acquire(4096).await.unwrap();
    let (res, _) = conn.read(local, remote).await;
    res.expect("a read with the connection's own pool after the refusals");
    conn.close().await.unwrap();
    within(60, "server", server).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn peer_closing_mid_stream_fails_pending_ops_and_frees_buffers() {
    let listener = Listener::bind(addr(7005)).await.expect("bind");
    let server = tokio::spawn(async move {
        let conn = listener.accept().await.expect("accept");
        // Read one message then vanish abruptly (drop without reading the rest).
        let _ = conn.recv().await;
        drop(conn);
    });
    let opts = ConnectOptions::default()
        .recv_credits(4)
        .recv_buf_size(4096);
    let conn = Arc::new(
        Connection::connect_with(addr(7005), opts)
            .await
            .expect("connect"),
    );
    conn.send(b"first").await.unwrap();
    within(60, "server", server).await.unwrap();
    // Pending receive and a stream of sends: all resolve with an error in bounded time.
    let started = Instant::now();
    let rconn = conn.clone();
    let pending_recv = tokio::spawn(async move { rconn.recv().await });
    let mut sends = 0;
    let err = loop {
        match within(60, "send after peer close", conn.send(&[0u8; 1000])).await {
            Ok(()) => sends += 1,
            Err(e) => break e,
        }
        assert!(sends < 100_000, "sends keep succeeding after the peer left");
    };
    let recv_result = within(60, "pending recv", pending_recv).await.unwrap();
    println!(
        "after the peer closed: {sends} sends accepted, then {err}; pending recv -> {recv_result:?}; in {:?}",
        started.elapsed()
    );
    assert!(matches!(recv_result, Ok(None) | Err(_)));
    // No buffer leaks: the pool's in-use count returns to zero once everything resolved.
    drop(recv_result);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let m = conn.stats();
        if m.buffer_bytes_in_use == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "pool buffers leaked: {m:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn malformed_handshakes_are_rejected_and_the_listener_keeps_serving() {
    use tokio_rdma::verbs::{CmEventKind, ConnParam, EventChannel, QpInitAttr, QueuePair};
    let listener = Arc::new(Listener::bind(addr(7006)).await.expect("bind"));
    let l2 = listener.clone();
    let server = tokio::spawn(async move {
        // A first, well-formed client that leaves at once.
        let first = within(120, "accept", l2.accept())
            .await
            .expect("accept the first client");
        let end = first.recv().await;
        assert!(matches!(end, Ok(None)), "the first client closed: {end:?}");
        // Then the bad ones are refused inside accept(), which returns the next good client.
        let conn = within(300, "accept", l2.accept())
            .await
            .expect("accept a good client after bad ones");
        assert_eq!(&conn.recv().await.unwrap().unwrap()[..], b"good");
    });
    let good = Connection::connect(addr(7006))
        .await
        .expect("first connect");
    good.close().await.unwrap();
    let valid = tokio_rdma::conn::handshake::Params::default()
        .encode()
        .unwrap();
    let mut wrong_version = valid;
    wrong_version[4] = 99; // the version byte
    let mut absurd = valid;
    absurd[8..12].copy_from_slice(&0u32.to_be_bytes()); // zero receive credits
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("truncated", valid[..10].to_vec()),
        ("wrong version", wrong_version.to_vec()),
        ("absurd sizes", absurd.to_vec()),
        ("garbage", b"GET / HTTP/1.1\r\n".to_vec()),
    ];
    // A raw CM client (verbs level) sends each bad handshake.
    for (what, data) in &cases {
        let ch = EventChannel::new().unwrap();
        let id = ch.create_id().unwrap();
        id.resolve_addr(None, addr(7006), 5000).unwrap();
        ch.wait_event(Duration::from_secs(30))
            .unwrap()
            .unwrap()
            .expect(CmEventKind::AddrResolved)
            .unwrap();
        id.resolve_route(5000).unwrap();
        ch.wait_event(Duration::from_secs(30))
            .unwrap()
            .unwrap()
            .expect(CmEventKind::RouteResolved)
            .unwrap();
        let ctx = tokio_rdma::verbs::Context::from_cm_id(&id).unwrap();
        let pd = tokio_rdma::verbs::ProtectionDomain::new(&ctx).unwrap();
        let cq = tokio_rdma::verbs::CompletionQueue::new(&ctx, 16, None).unwrap();
        let qp = QueuePair::new_rc(&pd, &QpInitAttr::new(&cq, &cq)).unwrap();
        id.modify_qp(&qp, tokio_rdma::verbs::QpState::Init).unwrap();
        id.connect(&ConnParam::new(&qp).private_data(data)).unwrap();
        let ev = tokio::task::block_in_place(|| ch.wait_event(Duration::from_secs(30)))
            .unwrap()
            .unwrap();
        let err = ev.expect(CmEventKind::ConnectResponse).unwrap_err();
        let text = err.to_string();
        println!("{what}: client sees: {text}");
        assert!(
            matches!(err, tokio_rdma::Error::ConnectionRejected { .. }),
            "{what}: {text}"
        );
        let io: std::io::Error = err.into();
        assert_eq!(io.kind(), std::io::ErrorKind::ConnectionRefused);
    }
    // A well-formed client is still served.
    let conn = within(60, "good connect", Connection::connect(addr(7006)))
        .await
        .expect("connect after bad ones");
    conn.send(b"good").await.unwrap();
    within(60, "server", server).await.unwrap();
    assert!(
        listener.rejected() >= cases.len() as u64,
        "rejected {}",
        listener.rejected()
    );
    conn.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn chunked_messages_one_connection() {
    let opts = ConnectOptions::default()
        .recv_credits(8)
        .recv_buf_size(16 << 10)
        .max_message_size(1 << 20);
    let listener = Listener::bind_with(addr(7007), opts.clone())
        .await
        .expect("bind");
    let server = tokio::spawn(async move {
        let conn = listener.accept().await.expect("accept");
        while let Some(msg) = conn.recv().await.expect("server recv") {
            conn.send(&msg).await.expect("echo");
        }
    });
    let conn = Connection::connect_with(addr(7007), opts)
        .await
        .expect("connect");
    for i in 0..40u64 {
        let len = [100_000usize, 1 << 20, 16 << 10, (16 << 10) + 1, 5][i as usize % 5];
        let data = payload(i, len);
        conn.send(&data).await.unwrap();
        let back = conn.recv().await.unwrap().unwrap();
        assert_eq!(back.len(), len, "message {i}");
        assert!(back[..] == data[..], "message {i}");
    }
    conn.close().await.unwrap();
    within(60, "server", server).await.unwrap();
}

/// Not a test on its own: the peer process of `killed_peer_fails_pending_ops_in_bounded_time`
/// (does nothing unless `TOKIO_RDMA_PEER_ADDR` is set).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn peer_process_helper() {
    let Ok(a) = std::env::var("TOKIO_RDMA_PEER_ADDR") else {
        return;
    };
    let opts = ConnectOptions::default()
        .recv_credits(2)
        .recv_buf_size(4096);
    let conn = Connection::connect_with(a.as_str(), opts)
        .await
        .expect("peer connect");
    conn.send(b"hello from the peer").await.unwrap();
    // Stay connected, never read again, until killed.
    tokio::time::sleep(Duration::from_secs(3600)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn killed_peer_fails_pending_ops_in_bounded_time() {
    let a = addr(7008);
    let opts = ConnectOptions::default()
        .recv_credits(4)
        .recv_buf_size(4096);
    let listener = Listener::bind_with(a, opts).await.expect("bind");
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "peer_process_helper", "--nocapture"])
        .env("TOKIO_RDMA_PEER_ADDR", a.to_string())
        .spawn()
        .expect("spawn the peer process");
    let conn = Arc::new(
        within(120, "accept", listener.accept())
            .await
            .expect("accept"),
    );
    assert_eq!(
        &conn.recv().await.unwrap().unwrap()[..],
        b"hello from the peer"
    );
    // A pending receive, and a sender that keeps sending (the peer never reads: once its
    // buffers are full it stops granting credits and the sender waits).
    let rconn = conn.clone();
    let pending_recv = tokio::spawn(async move { rconn.recv().await });
    let sconn = conn.clone();
    let sender = tokio::spawn(async move {
        let mut sent = 0u64;
        loop {
            match sconn.send(&[7u8; 1000]).await {
                Ok(()) => sent += 1,
                Err(e) => return (sent, e),
            }
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    child.kill().expect("kill the peer");
    let _ = child.wait();
    let killed = Instant::now();
    let recv = within(120, "pending recv after kill", pending_recv)
        .await
        .unwrap();
    assert!(
        recv.is_err(),
        "a pending receive fails when the peer is killed: {recv:?}"
    );
    let (sent, err) = within(120, "sender after kill", sender).await.unwrap();
    println!(
        "peer killed: pending recv -> {:?}; sender stopped after {sent} messages with: {err}; all within {:?}",
        recv.unwrap_err(),
        killed.elapsed()
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while conn.stats().buffer_bytes_in_use != 0 {
        assert!(
            Instant::now() < deadline,
            "pool buffers leaked: {:?}",
            conn.stats()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Tokio's cooperative scheduling: once the task's budget is spent, an operation that could
/// complete at once (a message already queued, a completion found in place) returns `Pending`
/// and wakes the task, so a loop of always-ready operations still lets the runtime's other
/// tasks run. Before, such a loop never yielded: `examples/kv` with 4 readers retrying on a
/// value being rewritten starved the writer's timer on a 2-worker runtime and hung.
#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn ready_operations_spend_the_tasks_cooperative_budget() {
    use std::task::Poll;
    use tokio::task::coop;
    use tokio_rdma::buf::RemoteAccess;
    let listener = Listener::bind(addr(7009)).await.expect("bind");
    let (c, s) = tokio::join!(Connection::connect(addr(7009)), listener.accept());
    let (client, server) = (c.expect("connect"), s.expect("accept"));
    let grant = server
        .grant(vec![5u8; 4096], 0..4096, RemoteAccess::READ)
        .expect("grant");
    let token = grant.token();
    for _ in 0..2 {
        server.send(b"queued").await.expect("send");
    }
    // The first message arrives; the second is queued behind it by then.
    let first = within(60, "first", client.recv()).await.expect("recv");
    assert_eq!(&first.expect("a message")[..], b"queued");
    let deadline = Instant::now() + Duration::from_secs(30);
    while client.stats().protocol.receives < 2 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let exhaust = || async {
        while coop::has_budget_remaining() {
            coop::consume_budget().await;
        }
    };
    exhaust().await;
    let recv = client.recv();
    tokio::pin!(recv);
    assert!(
        futures::poll!(recv.as_mut()).is_pending(),
        "a queued message is not handed out on a spent budget"
    );
    // Polled again (a fresh budget after the yield): delivered.
    let second = within(60, "second", recv).await.expect("recv");
    assert_eq!(&second.expect("a message")[..], b"queued");

    // A one-sided read: its first poll posts it whatever the budget; once its completion is
    // there, a poll on a spent budget returns Pending, and the next (after the yield) hands
    // the result out.
    let buf = client.pool().unwrap().acquire(4096).await.unwrap();
    let read = client.read(buf, token);
    tokio::pin!(read);
    exhaust().await;
    assert!(
        futures::poll!(read.as_mut()).is_pending(),
        "posted (complete or not, nothing is handed out on a spent budget)"
    );
    // Had the first poll not posted, the read would not be complete after this.
    tokio::time::sleep(Duration::from_millis(300)).await;
    exhaust().await;
    assert!(
        futures::poll!(read.as_mut()).is_pending(),
        "a complete read is not handed out on a spent budget"
    );
    tokio::task::yield_now().await;
    let Poll::Ready((res, buf)) = futures::poll!(read.as_mut()) else {
        panic!("the read completed 300 ms ago: ready once the budget is fresh");
    };
    res.expect("read");
    assert!(buf[..] == [5u8; 4096]);
    drop(grant);
}

/// `recv_many`: what has arrived is taken in one call, in order, up to the limit; a
/// rendezvous message ends a batch and comes alone; a cancelled call takes nothing; end of
/// stream is `Ok(0)`. The batches are made deterministic by waiting, without receiving,
/// until the state machine has delivered the messages (`messages_received` counts
/// deliveries, not receives).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn recv_many_takes_what_has_arrived_in_order() {
    let opts = ConnectOptions::default()
        .recv_credits(16)
        .recv_buf_size(16 << 10)
        .max_message_size(1 << 20)
        .rendezvous_threshold(Some(64 << 10));
    let listener = Listener::bind_with(addr(7010), opts.clone())
        .await
        .expect("bind");
    // Message i of the test: its length, and whether it goes by rendezvous.
    let first: Vec<usize> = (0..12)
        .map(|i| [5usize, 100, (16 << 10) + 1, 0][i % 4])
        .collect();
    let (small, big, last) = (vec![7usize, 64, 3000], 300_000usize, vec![1usize, 2]);
    let expect = {
        let (first, small, last) = (first.clone(), small.clone(), last.clone());
        move |i: usize| -> usize {
            let all: Vec<usize> = first
                .iter()
                .chain(&small)
                .chain(std::iter::once(&big))
                .chain(&last)
                .copied()
                .collect();
            all[i]
        }
    };
    let server = tokio::spawn(async move {
        let conn = listener.accept().await.expect("accept");
        let delivered = |n: u64| {
            let conn = &conn;
            async move {
                while conn.stats().protocol.messages_received < n {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }
        };
        let mut v = Vec::with_capacity(64);
        // Nothing sent yet: a call cancelled while it waits takes nothing.
        let waited = tokio::time::timeout(Duration::from_millis(50), conn.recv_many(&mut v, 8));
        assert!(waited.await.is_err(), "nothing to receive yet");
        assert!(v.is_empty());
        assert_eq!(conn.recv_many(&mut v, 0).await.expect("limit 0"), 0);
        conn.send(b"go").await.expect("go");
        let mut seen = 0usize;
        let mut check = |v: &mut Vec<tokio_rdma::conn::Message>| {
            for m in v.drain(..) {
                let len = expect(seen);
                assert_eq!(m.len(), len, "message {seen}");
                assert!(m[..] == payload(seen as u64, len)[..], "message {seen}");
                seen += 1;
            }
        };
        // 12 messages delivered (two of them reassembled from two chunks): one call takes
        // them all, in order.
        within(60, "12 deliveries", delivered(12)).await;
        let n = within(60, "recv_many", conn.recv_many(&mut v, 64))
            .await
            .expect("recv_many");
        assert_eq!(n, 12, "every delivered message in one call");
        check(&mut v);
        conn.send(b"more").await.expect("more");
        // Three small ones, then a rendezvous message: the limit holds, and the rendezvous
        // message is not taken behind the small ones.
        within(60, "3 deliveries", delivered(15)).await;
        assert_eq!(conn.recv_many(&mut v, 2).await.expect("limit 2"), 2);
        assert_eq!(conn.recv_many(&mut v, 64).await.expect("the third"), 1);
        check(&mut v);
        assert_eq!(conn.recv_many(&mut v, 64).await.expect("rendezvous"), 1);
        check(&mut v);
        assert_eq!(conn.stats().protocol.rendezvous_received, 1);
        // The rest, then end of stream, again and again.
        loop {
            let n = within(60, "recv_many", conn.recv_many(&mut v, 64))
                .await
                .expect("recv_many");
            if n == 0 {
                break;
            }
            check(&mut v);
        }
        assert_eq!(conn.recv_many(&mut v, 64).await.expect("after eos"), 0);
        seen
    });
    let conn = within(60, "connect", Connection::connect_with(addr(7010), opts))
        .await
        .expect("connect");
    let go = within(60, "go", conn.recv())
        .await
        .expect("go")
        .expect("not eof");
    assert_eq!(&go[..], b"go");
    let mut i = 0u64;
    for &len in &first {
        conn.send(&payload(i, len)).await.expect("send");
        i += 1;
    }
    // The server has taken the first 12 before any other is sent.
    let more = within(60, "more", conn.recv())
        .await
        .expect("more")
        .expect("not eof");
    assert_eq!(&more[..], b"more");
    for &len in &small {
        conn.send(&payload(i, len)).await.expect("send");
        i += 1;
    }
    conn.send_bytes(payload(i, big).into())
        .await
        .expect("rendezvous send");
    i += 1;
    for &len in &last {
        conn.send(&payload(i, len)).await.expect("send");
        i += 1;
    }
    within(60, "close", conn.close()).await.expect("close");
    let seen = within(60, "server", server).await.expect("server");
    assert_eq!(seen as u64, i, "every message once");
}

/// `send_many`: every message arrives once, whole and in order, whether it went in a chain
/// of inline messages, alone (larger, staged or in chunks), or after waiting for credits
/// (200 messages on 8 credits); a message too large for the connection fails the call after
/// the ones before it went, none after it, and the connection goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn send_many_delivers_every_message_once_in_order() {
    let opts = ConnectOptions::default()
        .recv_credits(8)
        .recv_buf_size(16 << 10)
        .max_message_size(1 << 20);
    let listener = Listener::bind_with(addr(7011), opts.clone())
        .await
        .expect("bind");
    let sizes: Vec<usize> = (0..200)
        .map(|i| [0usize, 1, 64, 65, 5000, (16 << 10) + 1, 20, 7][i % 8])
        .collect();
    let expect = sizes.clone();
    let server = tokio::spawn(async move {
        let conn = listener.accept().await.expect("accept");
        let mut got = Vec::new();
        while let Some(m) = within(60, "recv", conn.recv()).await.expect("recv") {
            got.push(m.to_vec());
        }
        got
    });
    let conn = within(60, "connect", Connection::connect_with(addr(7011), opts))
        .await
        .expect("connect");
    let inline = conn.params().max_inline as usize;
    let msgs: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &len)| payload(i as u64, len))
        .collect();
    within(60, "send_many", conn.send_many(&msgs))
        .await
        .expect("send_many");
    // Every chunk that fits inline went inline: the small messages, and the 1-byte last
    // chunk of each message one byte longer than a chunk.
    let chunk = conn.params().max_send_size as usize;
    let inline_bytes: usize = sizes
        .iter()
        .flat_map(|&l| (0..l).step_by(chunk).map(move |o| (l - o).min(chunk)))
        .filter(|&c| c <= inline)
        .sum();
    assert_eq!(
        conn.stats().send_bytes_inline,
        inline_bytes as u64,
        "the small ones went inline"
    );
    // One too large in the middle: the two before it go, the one after it does not.
    let too_large = vec![0u8; (1 << 20) + 1];
    let tail = [&b"a"[..], b"bc", &too_large, b"never"];
    let err = within(60, "send_many", conn.send_many(&tail))
        .await
        .expect_err("too large");
    assert!(
        matches!(err, tokio_rdma::Error::InvalidArgument(_)),
        "{err:?}"
    );
    conn.send(b"after").await.expect("the connection goes on");
    within(60, "close", conn.close()).await.expect("close");
    let got = within(60, "server", server).await.expect("server");
    assert_eq!(got.len(), expect.len() + 3, "every message once");
    for (i, len) in expect.iter().enumerate() {
        assert!(got[i] == payload(i as u64, *len), "message {i}");
    }
    assert_eq!(
        &got[expect.len()..],
        &[b"a".to_vec(), b"bc".to_vec(), b"after".to_vec()]
    );
}
