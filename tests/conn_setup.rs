//! Device tests of connection setup on rxe (soft-RoCE VM): the listener runs handshakes
//! concurrently (a stalled or garbage client delays no one), bounds them with a backlog and a
//! handshake timeout, refuses parameters that cannot work, and abandoned or closed connections
//! give every device resource back (checked with `rdma resource show`). A client's first
//! messages may complete on the server before its handshake task saw `ESTABLISHED`: their
//! credits come back once the server's queue pair is in RTS.
//!
//! Misbehaving clients are written with the raw layer (`tokio_rdma::verbs`): a client that
//! sends a valid connection request and then never completes it, or sends private data that
//! is not our handshake.
#![allow(clippy::print_stdout)]

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::within;
use tokio_rdma::Error;
use tokio_rdma::buf::{RemoteAccess, RemoteToken};
use tokio_rdma::conn::handshake::{Field, HandshakeError, Params};
use tokio_rdma::conn::{BACKLOG_FULL_REASON, ConnectOptions, Connection, Listener};
use tokio_rdma::verbs::{
    CmEvent, CmEventKind, CmId, CompletionQueue, ConnParam, Context, EventChannel,
    ProtectionDomain, QpInitAttr, QpState, QueuePair,
};

/// A port on rxe0's address (each test uses its own).
fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([192, 0, 2, 1], port))
}

/// Small connections: setting up many is quick under emulation.
fn small_opts() -> ConnectOptions {
    let mut o = ConnectOptions::default()
        .recv_credits(4)
        .recv_buf_size(4096)
        .max_message_size(1 << 20)
        .connect_timeout(Duration::from_secs(60))
        .user_pool(
            tokio_rdma::buf::PoolConfig::default()
                .classes([tokio_rdma::buf::SizeClass::new(4096, 4)]),
        );
    o.send_queue_depth = 16;
    o
}

/// A client written with the raw RDMA CM layer: it sends a connection request with any
/// private data, and does only what the test tells it afterwards.
struct RawClient {
    ch: EventChannel,
    id: CmId,
    _qp: QueuePair,
    _cq: CompletionQueue,
    _pd: ProtectionDomain,
    _ctx: Context,
}

/// Resolves, creates a queue pair (INIT) and sends a connection request carrying
/// `private_data`. Blocking: call from `spawn_blocking`.
fn raw_connect(to: SocketAddr, private_data: &[u8]) -> RawClient {
    let ch = EventChannel::new().expect("event channel");
    let id = ch.create_id().expect("cm id");
    id.resolve_addr(None, to, 10_000).expect("resolve_addr");
    wait_kind(&ch, CmEventKind::AddrResolved, Duration::from_secs(60));
    id.resolve_route(10_000).expect("resolve_route");
    wait_kind(&ch, CmEventKind::RouteResolved, Duration::from_secs(60));
    let ctx = Context::from_cm_id(&id).expect("context");
    let pd = ProtectionDomain::new(&ctx).expect("pd");
    let cq = CompletionQueue::new(&ctx, 16, None).expect("cq");
    let qp = QueuePair::new_rc(&pd, &QpInitAttr::new(&cq, &cq)).expect("qp");
    id.modify_qp(&qp, QpState::Init).expect("INIT");
    id.connect(&ConnParam::new(&qp).private_data(private_data))
        .expect("rdma_connect");
    RawClient {
        ch,
        id,
        _qp: qp,
        _cq: cq,
        _pd: pd,
        _ctx: ctx,
    }
}

async fn raw_connect_async(to: SocketAddr, private_data: Vec<u8>) -> RawClient {
    tokio::task::spawn_blocking(move || raw_connect(to, &private_data))
        .await
        .expect("raw client")
}

fn wait_kind(ch: &EventChannel, kind: CmEventKind, limit: Duration) -> CmEvent {
    let ev = ch
        .wait_event(limit)
        .expect("rdma_get_cm_event")
        .unwrap_or_else(|| panic!("no {kind} within {limit:?}"));
    ev.expect(kind)
        .unwrap_or_else(|e| panic!("waiting for {kind}: {e}"))
}

impl RawClient {
    /// Reads this client's events until one of `kind` arrives (others are printed and
    /// skipped), within `limit`. Blocking.
    fn wait_for(&self, kind: CmEventKind, limit: Duration) -> Option<CmEvent> {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let ev = self.ch.wait_event(left).expect("rdma_get_cm_event")?;
            println!("    raw client {:?}: {}", self.id.key(), ev.name());
            if ev.kind() == kind {
                return Some(ev);
            }
        }
    }

    async fn wait_for_async(
        self: &Arc<Self>,
        kind: CmEventKind,
        limit: Duration,
    ) -> Option<CmEvent> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || me.wait_for(kind, limit))
            .await
            .expect("wait")
    }
}

/// The text of a reject's private data (zero padding removed).
fn reason(private_data: &[u8]) -> String {
    let used = private_data
        .iter()
        .rposition(|&b| b != 0)
        .map_or(0, |i| i + 1);
    String::from_utf8_lossy(&private_data[..used]).into_owned()
}

/// Polls `cond` every 20 ms until it holds, for at most `secs`; returns the time it took.
async fn wait_until(secs: u64, what: &str, mut cond: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < Duration::from_secs(secs),
            "{what}: not within {secs} s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    start.elapsed()
}

/// Serves every accepted connection: echoes messages; a message `TOKEN` + a remote token makes
/// it RDMA READ the granted region and send back what it read.
fn serve(listener: Arc<Listener>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let conn = match listener.accept().await {
                Ok(c) => c,
                Err(e) => {
                    println!("accept: {e}");
                    return;
                }
            };
            tokio::spawn(async move {
                while let Ok(Some(msg)) = conn.recv().await {
                    let reply = if let Some(t) = msg.strip_prefix(b"TOKEN") {
                        let token = RemoteToken::from_bytes(t).expect("token");
                        let buf = conn
                            .pool()
                            .expect("pool")
                            .acquire(token.len() as usize)
                            .await
                            .expect("buffer");
                        let (res, buf) = conn.read(buf, token).await;
                        res.expect("RDMA READ of the granted region");
                        buf[..].to_vec()
                    } else {
                        msg.to_vec()
                    };
                    if conn.send(&reply).await.is_err() {
                        break;
                    }
                }
            });
        }
    })
}

/// Connects, exchanges a message, grants a region that the server reads, and closes (by
/// `close` or by drop).
async fn full_connection(to: SocketAddr, opts: ConnectOptions, i: usize, close: bool) {
    let conn = Connection::connect_with(to, opts)
        .await
        .unwrap_or_else(|e| panic!("connection {i}: {e}"));
    let hello = format!("hello {i}");
    conn.send(hello.as_bytes()).await.expect("send");
    let back = conn.recv().await.expect("recv").expect("not EOF");
    assert_eq!(&back[..], hello.as_bytes());
    let data = common::pattern(4096, i as u8);
    let buf = conn.pool().expect("pool").acquire(4096).await.expect("buf");
    let mut grant = conn.grant(buf, 0..4096, RemoteAccess::READ).expect("grant");
    grant.write_at(0, &data);
    let mut msg = b"TOKEN".to_vec();
    msg.extend_from_slice(&grant.token().to_bytes());
    conn.send(&msg).await.expect("send token");
    let read = conn.recv().await.expect("recv").expect("not EOF");
    assert!(
        read[..] == data[..],
        "connection {i}: the peer read the grant"
    );
    drop(grant);
    if close {
        conn.close().await.expect("close");
    } else {
        drop(conn);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_stalled_client_delays_no_one() {
    common::init_tracing();
    let handshake_timeout = Duration::from_secs(60);
    let a = addr(7101);
    let listener = Arc::new(
        Listener::bind_with(a, small_opts().handshake_timeout(handshake_timeout))
            .await
            .expect("bind"),
    );
    let server = serve(listener.clone());

    // A client that sends a valid request, then never answers (never establishes).
    let valid = Params::default().encode().unwrap().to_vec();
    let staller = Arc::new(raw_connect_async(a, valid.clone()).await);
    let t = wait_until(60, "the staller's handshake pending", || {
        listener.pending() >= 1
    })
    .await;
    println!("staller pending at the listener after {t:?}");

    // Meanwhile: a garbage client and 8 normal clients, all at once.
    let started = Instant::now();
    let garbage = tokio::spawn(async move {
        let c = Arc::new(raw_connect_async(a, b"GET / HTTP/1.1\r\n".to_vec()).await);
        let ev = c
            .wait_for_async(CmEventKind::Rejected, Duration::from_secs(60))
            .await
            .expect("the garbage client is rejected");
        (reason(ev.private_data()), started.elapsed())
    });
    let mut clients = tokio::task::JoinSet::new();
    for i in 0..8 {
        clients.spawn(async move {
            let t0 = Instant::now();
            let conn = Connection::connect_with(a, small_opts())
                .await
                .unwrap_or_else(|e| panic!("client {i}: {e}"));
            let connected = t0.elapsed();
            let msg = format!("client {i}");
            conn.send(msg.as_bytes()).await.expect("send");
            let back = conn.recv().await.expect("recv").expect("not EOF");
            assert_eq!(&back[..], msg.as_bytes());
            conn.close().await.expect("close");
            (i, connected, t0.elapsed())
        });
    }
    while let Some(r) = within(120, "clients", clients.join_next()).await {
        let (i, connected, done) = r.unwrap();
        println!("client {i}: connected in {connected:?}, message + close done in {done:?}");
    }
    let all = started.elapsed();
    let pending_then = listener.pending();
    let (why, garbage_after) = within(120, "garbage client", garbage).await.unwrap();
    println!(
        "8 clients done in {all:?} (handshake timeout {handshake_timeout:?}); the staller still pending: {pending_then} pending; garbage client rejected after {garbage_after:?}: {why:?}; listener rejected {}",
        listener.rejected()
    );
    assert!(
        pending_then >= 1,
        "the staller's handshake is still pending while the others are done"
    );
    assert!(
        all < handshake_timeout / 2,
        "8 clients took {all:?}: something waited for the staller"
    );
    assert!(why.starts_with("tokio-rdma: handshake: bad magic"), "{why}");
    assert!(listener.rejected() >= 1, "the garbage client is counted");

    // A second listener with a short handshake timeout: its staller is torn down, counted,
    // and the client learns it (the server's id is destroyed: the reply is rejected).
    let b = addr(7102);
    let short = Duration::from_secs(3);
    let listener2 = Listener::bind_with(b, small_opts().handshake_timeout(short))
        .await
        .expect("bind");
    let staller2 = Arc::new(raw_connect_async(b, valid).await);
    let t0 = Instant::now();
    let took = wait_until(120, "the short-timeout staller torn down", || {
        listener2.rejected() == 1 && listener2.pending() == 0
    })
    .await;
    println!(
        "listener 2 (handshake timeout {short:?}): staller torn down after {took:?}, rejected {} pending {}",
        listener2.rejected(),
        listener2.pending()
    );
    let seen = staller2
        .wait_for_async(CmEventKind::Rejected, Duration::from_secs(60))
        .await;
    println!(
        "staller 2 sees {:?} {:?} after {:?}",
        seen.as_ref().map(CmEvent::name),
        seen.as_ref().map(|e| e.status()),
        t0.elapsed()
    );
    assert!(seen.is_some(), "the torn-down staller's client is rejected");

    // Dropping the first listener tears its pending staller down too.
    server.abort();
    let _ = server.await;
    let listener = Arc::into_inner(listener).expect("the only reference");
    assert_eq!(listener.pending(), 1);
    drop(listener);
    let t0 = Instant::now();
    let seen = staller
        .wait_for_async(CmEventKind::Rejected, Duration::from_secs(60))
        .await;
    println!(
        "listener 1 dropped: its staller sees {:?} after {:?}",
        seen.as_ref().map(CmEvent::name),
        t0.elapsed()
    );
    assert!(
        seen.is_some(),
        "dropping the listener rejects its stalled client"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn backlog_limits_pending_handshakes() {
    common::init_tracing();
    let a = addr(7103);
    let handshake_timeout = Duration::from_secs(60);
    let listener = Arc::new(
        Listener::bind_with(
            a,
            small_opts().backlog(2).handshake_timeout(handshake_timeout),
        )
        .await
        .expect("bind"),
    );
    let server = serve(listener.clone());
    let valid = Params::default().encode().unwrap().to_vec();
    let s1 = raw_connect_async(a, valid.clone()).await;
    let s2 = raw_connect_async(a, valid.clone()).await;
    let t = wait_until(60, "two stalled handshakes pending", || {
        listener.pending() == 2
    })
    .await;
    println!("2 stallers pending after {t:?}");

    // Two more stallers and a normal client: rejected at once, with the reason.
    for n in 3..=4 {
        let t0 = Instant::now();
        let c = Arc::new(raw_connect_async(a, valid.clone()).await);
        let ev = c
            .wait_for_async(CmEventKind::Rejected, Duration::from_secs(60))
            .await
            .expect("rejected");
        let why = reason(ev.private_data());
        println!(
            "staller {n}: rejected (status {}) after {:?}: {why:?}",
            ev.status(),
            t0.elapsed()
        );
        assert_eq!(why, BACKLOG_FULL_REASON);
    }
    let t0 = Instant::now();
    let err = Connection::connect_with(a, small_opts())
        .await
        .expect_err("the backlog is full");
    println!("normal client while full: {err} (after {:?})", t0.elapsed());
    match &err {
        Error::ConnectionRejected { private_data, .. } => {
            assert_eq!(reason(private_data), BACKLOG_FULL_REASON);
        }
        other => panic!("expected ConnectionRejected, got {other:?}"),
    }
    assert_eq!(listener.rejected(), 3);
    assert_eq!(listener.pending(), 2);

    // The two stallers vanish (their ids are destroyed): their setups end long before the
    // handshake timeout, and the listener takes clients again.
    let t0 = Instant::now();
    drop(s1);
    drop(s2);
    let took = wait_until(120, "vanished stallers' setups end", || {
        listener.pending() == 0
    })
    .await;
    println!(
        "stallers vanished: their setups ended after {took:?} (handshake timeout {handshake_timeout:?}); rejected {}",
        listener.rejected()
    );
    assert!(
        t0.elapsed() < handshake_timeout,
        "ended by the client's reject, not the timeout"
    );
    assert_eq!(listener.rejected(), 5);
    let conn = within(60, "connect", Connection::connect_with(a, small_opts()))
        .await
        .expect("connect once the backlog has room");
    conn.send(b"room again").await.unwrap();
    assert_eq!(&conn.recv().await.unwrap().unwrap()[..], b"room again");
    conn.close().await.unwrap();

    // A stalled client whose process is killed: its setup ends too (the kernel destroys the
    // process's ids, which rejects our reply), long before the handshake timeout.
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "stalled_client_process_helper",
            "--nocapture",
        ])
        .env("TOKIO_RDMA_STALL_ADDR", a.to_string())
        .spawn()
        .expect("spawn the stalled client process");
    wait_until(120, "the stalled process's handshake pending", || {
        listener.pending() == 1
    })
    .await;
    let t0 = Instant::now();
    child.kill().expect("kill");
    let _ = child.wait();
    let exited = t0.elapsed();
    wait_until(120, "the killed client's setup ends", || {
        listener.pending() == 0
    })
    .await;
    println!(
        "stalled client process killed (exited after {exited:?}): its setup ended {:?} after the kill; rejected {}",
        t0.elapsed(),
        listener.rejected()
    );
    assert!(t0.elapsed() < handshake_timeout, "ended before the timeout");
    assert_eq!(listener.rejected(), 6);
    server.abort();
}

/// Not a test on its own: the stalled client process of `backlog_limits_pending_handshakes`
/// (does nothing unless `TOKIO_RDMA_STALL_ADDR` is set). Sends a valid request, never
/// completes it, and waits to be killed.
#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn stalled_client_process_helper() {
    let Ok(a) = std::env::var("TOKIO_RDMA_STALL_ADDR") else {
        return;
    };
    let valid = Params::default().encode().unwrap();
    let _client = raw_connect(a.parse().unwrap(), &valid);
    std::thread::sleep(Duration::from_secs(3600));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn cancelled_accepts_lose_no_connection_and_a_dropped_listener_closes_its_queue() {
    common::init_tracing();
    let a = addr(7108);
    let listener = Listener::bind_with(a, small_opts()).await.expect("bind");
    // Accept calls cancelled before any client came.
    let mut cancelled = 0u64;
    for _ in 0..3 {
        let r = tokio::time::timeout(Duration::from_millis(10), listener.accept()).await;
        assert!(r.is_err(), "no client yet");
        cancelled += 1;
    }
    let mut clients = tokio::task::JoinSet::new();
    for i in 0..6u8 {
        clients.spawn(async move {
            let conn = Connection::connect_with(a, small_opts())
                .await
                .unwrap_or_else(|e| panic!("client {i}: {e}"));
            conn.send(&[i]).await.expect("send");
            // The server answers with our number.
            let back = conn.recv().await.expect("recv").expect("not EOF");
            assert_eq!(&back[..], &[i]);
            conn.close().await.expect("close");
        });
    }
    // Accept with 1 ms timeouts: most accept futures are dropped, some as a connection
    // arrives; none may lose it.
    let mut got = 0;
    let t0 = Instant::now();
    while got < 6 {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "accepted {got} of 6"
        );
        match tokio::time::timeout(Duration::from_millis(1), listener.accept()).await {
            Ok(conn) => {
                let conn = conn.expect("accept");
                let msg = conn.recv().await.expect("recv").expect("not EOF");
                conn.send(&msg).await.expect("send");
                tokio::spawn(async move { while let Ok(Some(_)) = conn.recv().await {} });
                got += 1;
            }
            Err(_) => cancelled += 1,
        }
    }
    while let Some(r) = within(120, "clients", clients.join_next()).await {
        r.unwrap();
    }
    println!(
        "6 connections accepted; {cancelled} accept calls cancelled in all (3 before any client)"
    );

    // Connections established but never accepted close when the listener is dropped.
    let mut waiting = Vec::new();
    for _ in 0..2 {
        waiting.push(
            within(60, "connect", Connection::connect_with(a, small_opts()))
                .await
                .expect("connect without accept"),
        );
    }
    wait_until(60, "both queued", || listener.pending() == 0).await;
    drop(listener);
    let t0 = Instant::now();
    for (i, conn) in waiting.iter().enumerate() {
        let r = within(60, "recv after the listener dropped", conn.recv()).await;
        println!(
            "queued connection {i}: after the listener dropped, recv -> {r:?} ({:?})",
            t0.elapsed()
        );
        assert!(matches!(r, Ok(None) | Err(_)), "{r:?}");
    }
}

/// Prints `rdma resource show qp|pd|cq|cm_id` (which process holds what, QP states).
fn print_resource_details() {
    for kind in ["qp", "cq", "pd", "cm_id"] {
        if let Ok(out) = std::process::Command::new("rdma")
            .args(["resource", "show", kind])
            .output()
        {
            print!("{}", String::from_utf8_lossy(&out.stdout));
        }
    }
}

fn watched(c: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    c.iter()
        .filter(|(k, _)| ["qp", "cq", "mr", "pd", "cm_id"].contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), *v))
        .collect()
}

/// Waits until the counts are the same for 2 s in a row (earlier teardown finished).
async fn settled_counts() -> BTreeMap<String, u64> {
    let mut last = watched(&common::resource_counts());
    let mut same_since = Instant::now();
    let start = Instant::now();
    while same_since.elapsed() < Duration::from_secs(2) && start.elapsed() < Duration::from_secs(60)
    {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let now = watched(&common::resource_counts());
        if now != last {
            last = now;
            same_since = Instant::now();
        }
    }
    last
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn abandoned_connects_and_closed_connections_leave_no_resources() {
    common::init_tracing();
    let a = addr(7104);
    let listener = Arc::new(
        Listener::bind_with(a, small_opts().handshake_timeout(Duration::from_secs(5)))
            .await
            .expect("bind"),
    );
    let server = serve(listener.clone());
    println!("before anything: {:?}", common::resource_counts());
    print_resource_details();
    // Warm-up: the first connection creates the device's driver (one CQ for the process, kept
    // by the registry); the baseline is taken after it.
    full_connection(a, small_opts(), 0, true).await;
    let baseline = settled_counts().await;
    println!("baseline (listener up, after one warm-up connection): {baseline:?}");

    // ~100 connects cancelled at varied points, 10 at a time.
    let started = Instant::now();
    let mut outcomes: BTreeMap<&'static str, u32> = BTreeMap::new();
    for batch in 0..10 {
        let mut set = tokio::task::JoinSet::new();
        for k in 0..10usize {
            let i = batch * 10 + k;
            set.spawn(async move {
                let connect = Connection::connect_with(a, small_opts());
                match i % 5 {
                    0 => {
                        // Dropped right after spawning (maybe before its first poll).
                        let h = tokio::spawn(connect);
                        h.abort();
                        match h.await {
                            Ok(Ok(_conn)) => "completed (then dropped)",
                            Ok(Err(_)) => "failed",
                            Err(_) => "aborted right after spawn",
                        }
                    }
                    1 => {
                        let h = tokio::spawn(connect);
                        tokio::task::yield_now().await;
                        tokio::time::sleep(Duration::from_millis(1)).await;
                        h.abort();
                        match h.await {
                            Ok(Ok(_conn)) => "completed (then dropped)",
                            Ok(Err(_)) => "failed",
                            Err(_) => "aborted after 1 ms",
                        }
                    }
                    _ => {
                        let delay = Duration::from_millis(((i * 37) % 200) as u64);
                        match tokio::time::timeout(delay, connect).await {
                            Ok(Ok(_conn)) => "completed (then dropped)",
                            Ok(Err(_)) => "failed",
                            Err(_) => "cancelled by a 0-200 ms timeout",
                        }
                    }
                }
            });
        }
        while let Some(r) = set.join_next().await {
            *outcomes.entry(r.unwrap()).or_default() += 1;
        }
    }
    println!(
        "100 abandoned connects in {:?}: {outcomes:?}; listener pending {} rejected {}",
        started.elapsed(),
        listener.pending(),
        listener.rejected()
    );

    // 10 connects that are certainly cancelled while waiting for the response: a raw listener
    // takes their requests and never answers (it counts the requests, which proves each
    // client got that far, then drops the ids once the clients gave up).
    let silent = addr(7107);
    let (gave_up_tx, gave_up_rx) = std::sync::mpsc::channel::<()>();
    let silent_listener = tokio::task::spawn_blocking(move || {
        let ch = EventChannel::new().expect("channel");
        let id = ch.create_id().expect("id");
        id.bind_addr(silent).expect("bind");
        id.listen(16).expect("listen");
        let (mut requests, mut others, mut held) = (0, Vec::new(), Vec::new());
        let deadline = Instant::now() + Duration::from_secs(120);
        while gave_up_rx.try_recv().is_err() && Instant::now() < deadline {
            let Some(mut ev) = ch.wait_event(Duration::from_millis(100)).expect("event") else {
                continue;
            };
            if ev.kind() == CmEventKind::ConnectRequest {
                requests += 1;
                held.push(ev.take_id().expect("new id"));
            } else {
                others.push(ev.name());
            }
        }
        drop(held);
        drop(id);
        (requests, others)
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..10 {
        set.spawn(async move {
            tokio::time::timeout(
                Duration::from_secs(3),
                Connection::connect_with(silent, small_opts()),
            )
            .await
            .is_err()
        });
    }
    while let Some(r) = set.join_next().await {
        assert!(r.unwrap(), "a connect to a silent listener timed out");
    }
    gave_up_tx.send(()).unwrap();
    let (requests, others) = within(180, "silent listener", silent_listener)
        .await
        .unwrap();
    println!(
        "10 connects cancelled while waiting for the response: the silent listener saw {requests} requests (and then {others:?})"
    );
    assert_eq!(requests, 10);

    // 50 full connections with traffic and a grant: half closed, half dropped.
    let started = Instant::now();
    for batch in 0..5 {
        let mut set = tokio::task::JoinSet::new();
        for k in 0..10usize {
            let i = 1 + batch * 10 + k;
            set.spawn(full_connection(a, small_opts(), i, i % 2 == 0));
        }
        while let Some(r) = within(300, "full connections", set.join_next()).await {
            r.unwrap();
        }
    }
    println!(
        "50 full connections (message, grant read by the peer, 25 closed + 25 dropped) in {:?}",
        started.elapsed()
    );

    // Everything returns: poll up to 60 s.
    let t0 = Instant::now();
    let mut now = watched(&common::resource_counts());
    while now != baseline && t0.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_millis(250)).await;
        now = watched(&common::resource_counts());
    }
    println!(
        "after: {now:?} (baseline {baseline:?}) after waiting {:?}; listener pending {} rejected {}",
        t0.elapsed(),
        listener.pending(),
        listener.rejected()
    );
    assert_eq!(now, baseline, "device resources leaked");
    assert_eq!(listener.pending(), 0);
    server.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn one_receive_credit_is_refused() {
    common::init_tracing();
    let a = addr(7105);
    // A listener with one credit cannot be made.
    let err = Listener::bind_with(a, small_opts().recv_credits(1))
        .await
        .expect_err("one credit refused");
    println!("listener with 1 credit: {err}");
    assert!(matches!(
        err,
        Error::Handshake(HandshakeError::InvalidField {
            field: Field::RecvCredits,
            value: 1,
            ..
        })
    ));
    let listener = Listener::bind_with(a, small_opts()).await.expect("bind");

    // A client with one credit is refused locally, before anything is sent.
    let t0 = Instant::now();
    let err = Connection::connect_with(a, small_opts().recv_credits(1))
        .await
        .expect_err("one credit refused");
    println!("client with 1 credit: {err} (after {:?})", t0.elapsed());
    assert!(matches!(
        err,
        Error::Handshake(HandshakeError::InvalidField {
            field: Field::RecvCredits,
            value: 1,
            ..
        })
    ));
    assert!(err.to_string().contains("fewer than 2"), "{err}");
    assert_eq!(listener.rejected(), 0, "nothing reached the listener");

    // A raw client announcing one credit on the wire is rejected by the server with the reason.
    let mut one_credit = Params::default().encode().unwrap();
    one_credit[8..12].copy_from_slice(&1u32.to_be_bytes());
    let c = Arc::new(raw_connect_async(a, one_credit.to_vec()).await);
    let ev = c
        .wait_for_async(CmEventKind::Rejected, Duration::from_secs(60))
        .await
        .expect("rejected");
    let why = reason(ev.private_data());
    println!("raw client with 1 credit: rejected: {why:?}");
    assert!(
        why.starts_with("tokio-rdma: handshake: invalid recv_credits: 1 (fewer than 2"),
        "{why}"
    );
    wait_until(30, "counted", || listener.rejected() == 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn mismatched_receive_buffer_sizes_carry_large_messages_both_ways() {
    common::init_tracing();
    let a = addr(7106);
    // Server: 64 KiB receive buffers; client: 4 KiB.
    let listener = Arc::new(
        Listener::bind_with(a, small_opts().recv_buf_size(64 << 10))
            .await
            .expect("bind"),
    );
    let server = serve(listener.clone());
    let conn = within(60, "connect", Connection::connect_with(a, small_opts()))
        .await
        .expect("connect");
    println!("client's view: {:?}", conn.params());
    for len in [100usize, 4096, 4097, 65536, 100_000] {
        let data = common::pattern(len, len as u8);
        within(60, "send", conn.send(&data))
            .await
            .unwrap_or_else(|e| panic!("send of {len} bytes: {e}"));
        let back = within(60, "recv", conn.recv())
            .await
            .expect("recv")
            .expect("not EOF");
        assert!(back[..] == data[..], "{len} bytes echoed");
        println!("{len} bytes there and back");
    }
    conn.close().await.unwrap();
    server.abort();
}

#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn messages_that_arrive_before_the_server_is_established_get_their_credits_back() {
    common::init_tracing();
    let a = addr(7109);
    // One endpoint for both sides, on one thread: the client's waits poll the endpoint's
    // completion queue in place and so complete the server's receives while the server's
    // handshake task has not run since the client established (the server's queue pair is
    // still in RTR). Its credit returns must wait for RTS: posted in RTR they fail (EINVAL)
    // and so does the connection.
    let ep = tokio_rdma::Endpoint::open_first_active().expect("endpoint");
    let listener = ep.listen(a).await.expect("listen");
    let opts = small_opts();
    let burst = 4 * opts.params.recv_credits as usize;
    for round in 0..3 {
        let server = async {
            let conn = listener.accept().await?;
            let mut n = 0;
            while conn.recv().await?.is_some() {
                n += 1;
            }
            conn.close().await?;
            Ok::<_, Error>(n)
        };
        let client = async {
            let conn = ep.connect(a, opts.clone()).await?;
            // At once, without yielding first: beyond the initial credits, so the later sends
            // wait for credits the server returns.
            for i in 0..burst {
                conn.send(format!("message {i}").as_bytes()).await?;
            }
            conn.close().await?;
            Ok::<_, Error>(())
        };
        // A failed server connection never reaches `accept`: the client's error ends the round.
        let (got, ()) = within(60, "round", async { tokio::try_join!(server, client) })
            .await
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        assert_eq!(got, burst, "round {round}: every message arrived");
    }
    println!("3 rounds of {burst} messages sent straight after connecting: all delivered");
}
