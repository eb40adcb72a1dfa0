//! Device tests: what a hostile peer can make this side allocate (rxe, soft-RoCE VM). The
//! attacker is the raw peer of `common/raw_peer.rs`, announcing the largest buffers a
//! handshake allows with many credits (63 x 16 MiB) while registering little memory itself.
//!
//! Each test measures this process's pinned memory (`VmPin` in `/proc/self/status`: every
//! `ibv_reg_mr` pins its pages and counts there) across the hostile handshake, and asserts the
//! bound `docs/security.md` states: the victim's own pools under its local limits
//! (`ConnectOptions::max_send_chunk`, `max_staged_chunks`), plus what the raw peer registered
//! itself, plus rounding of the pools to huge pages. On 61ac8ac a default server pinned
//! +1,026 MiB for one such peer, and a default client as much for such a server. Then a
//! 1 MiB message shows the limit at work (chunks of at most `max_send_chunk` on the wire), and
//! the device resources return to the baseline.
//!
//! And a live peer that takes a rendezvous descriptor and never reads it (never sends
//! `Fetched`) cannot keep this side's registration, its `close()` and its connection task
//! beyond `ConnectOptions::close_timeout` (on 61ac8ac the close never resolved). On an
//! endpoint with a shared receive queue, a peer that overruns its credits takes no shared
//! buffer once the overrun was seen.
#![allow(clippy::print_stdout)]

#[path = "common/hostile_bench.rs"]
mod bench;
mod common;
#[path = "common/raw_peer.rs"]
mod raw_peer;

use bench::*;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{pattern, within};
use raw_peer::{RawListener, RawOpts, RawPeer, Seen};
use tokio::task::JoinHandle;
use tokio_rdma::conn::handshake::Flags;
use tokio_rdma::conn::wire::CONTROL_RECVS;
use tokio_rdma::conn::wire::{MsgHeader, MsgKind};
use tokio_rdma::conn::{
    ConnectOptions, Connection, DEFAULT_MAX_SEND_CHUNK, DEFAULT_MAX_STAGED_CHUNKS, SrqOptions,
};
use tokio_rdma::{Endpoint, EndpointOptions, Error, QpFailure};

const MIB: u64 = 1 << 20;
/// Pools are registered in whole 2 MiB huge pages where available: up to 2 MiB more per size
/// class, two pools (receive, staging) per connection.
const ROUNDING: u64 = 4 * MIB;

/// Pinned memory of this process (`VmPin`), in bytes.
fn vm_pin() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find(|l| l.starts_with("VmPin:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<u64>().ok())
        .expect("VmPin in /proc/self/status")
        * 1024
}

/// The attacker: announces 63 credits of 16 MiB, posts 11 receives of 256 KiB (enough for
/// the chunks it is sent, and control messages).
fn huge_announcement() -> RawOpts {
    let mut o = RawOpts::new(raw_params(63, 16 << 20, 16 << 20));
    o.post_recvs = 8 + CONTROL_RECVS;
    o.recv_slot_size = Some(DEFAULT_MAX_SEND_CHUNK as usize);
    o
}

/// What a connection with default options registers for itself against any peer: its
/// receive pool `(2 x 16 + 3) x 64 KiB` and its staging pool
/// `(min(63, max_staged_chunks, 38) + 1) x min(16 MiB, max_send_chunk)`.
fn default_victim_bytes() -> u64 {
    let d = ConnectOptions::default();
    let recv =
        u64::from(2 * d.params.recv_credits + CONTROL_RECVS) * u64::from(d.params.recv_buf_size);
    let staging =
        u64::from(DEFAULT_MAX_STAGED_CHUNKS.min(63) + 1) * u64::from(DEFAULT_MAX_SEND_CHUNK);
    recv + staging
}

/// The receives the raw peer saw with data (their lengths), in order.
fn chunk_lens(peer: &RawPeer) -> Vec<u32> {
    peer.log
        .iter()
        .filter_map(|s| match s {
            Seen::Recv { len, .. } if *len > 0 => Some(*len),
            _ => None,
        })
        .collect()
}

fn check_chunks(who: &str, peer: &RawPeer) {
    let lens = chunk_lens(peer);
    println!("  {who}: a 1 MiB message arrived as chunks of {lens:?}");
    assert_eq!(lens.iter().map(|&l| u64::from(l)).sum::<u64>(), MIB);
    assert!(
        lens.iter().all(|&l| l <= DEFAULT_MAX_SEND_CHUNK),
        "chunks within max_send_chunk, not the announced 16 MiB: {lens:?}"
    );
}

fn check_pinned(who: &str, grew: u64, raw: &RawOpts, conn: &Connection) {
    let own = default_victim_bytes();
    let bound = own + raw.registered_bytes() + ROUNDING;
    let staging = conn.stats().staging_pool.bytes_registered;
    println!(
        "  {who}: VmPin +{:.2} MiB across the hostile handshake (bound {:.2} MiB: own pools \
         {:.2} + the raw peer's {:.2} + rounding {:.2}); staging pool {:.2} MiB, chunk {} bytes, \
         send credits {}",
        grew as f64 / MIB as f64,
        bound as f64 / MIB as f64,
        own as f64 / MIB as f64,
        raw.registered_bytes() as f64 / MIB as f64,
        ROUNDING as f64 / MIB as f64,
        staging as f64 / MIB as f64,
        conn.params().max_send_size,
        conn.params().send_credits,
    );
    assert_eq!(conn.params().max_send_size, DEFAULT_MAX_SEND_CHUNK);
    assert_eq!(
        conn.params().send_credits,
        63,
        "the peer's credits are kept"
    );
    assert!(
        staging
            <= u64::from(DEFAULT_MAX_STAGED_CHUNKS + 1) * u64::from(DEFAULT_MAX_SEND_CHUNK)
                + 2 * MIB,
        "staging pool {staging} bytes"
    );
    assert!(
        grew <= bound,
        "{who} pinned {grew} bytes for one hostile peer, more than {bound}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_client_announcing_huge_buffers_cannot_size_a_default_servers_memory() {
    let opts = ConnectOptions::default().connect_timeout(Duration::from_secs(60));
    let mut bench = Bench::new(7380, opts).await;
    let raw = huge_announcement();
    let before = vm_pin();
    let (peer, conn) = bench.hostile(raw).await;
    let grew = vm_pin().saturating_sub(before);
    check_pinned("default server", grew, &raw, &conn);
    within(60, "send 1 MiB", conn.send(&pattern(1 << 20, 3)))
        .await
        .expect("send to the raw peer");
    let peer = blocking(move || {
        let mut peer = peer;
        let got = peer.wait_until(Duration::from_secs(60), |p| {
            chunk_lens(p).iter().map(|&l| u64::from(l)).sum::<u64>() >= MIB
        });
        assert!(got, "the message did not arrive: {:?}", peer.log);
        peer
    })
    .await;
    check_chunks("default server", &peer);
    drop(conn);
    let peer = blocking(move || {
        let mut peer = peer;
        let gone = peer.wait_until(Duration::from_secs(60), RawPeer::disconnected);
        assert!(
            gone,
            "no DISCONNECTED after the server dropped its connection"
        );
        peer
    })
    .await;
    blocking(move || drop(peer)).await;
    bench.survived("a client announcing 63 x 16 MiB").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_server_answering_huge_buffers_cannot_size_a_default_clients_memory() {
    common::init_tracing();
    let baseline = settled_counts().await;
    let a = addr(7381);
    let listener = RawListener::bind(a);
    let raw = huge_announcement();
    let before = vm_pin();
    let server = tokio::task::spawn_blocking(move || listener.accept(raw));
    let conn = within(
        60,
        "connect",
        Connection::connect_with(
            a,
            ConnectOptions::default().connect_timeout(Duration::from_secs(60)),
        ),
    )
    .await
    .expect("connect to the raw server");
    let peer = within(60, "raw accept", server).await.expect("raw server");
    let grew = vm_pin().saturating_sub(before);
    check_pinned("default client", grew, &raw, &conn);
    within(60, "send 1 MiB", conn.send(&pattern(1 << 20, 5)))
        .await
        .expect("send to the raw server");
    let peer = blocking(move || {
        let mut peer = peer;
        let got = peer.wait_until(Duration::from_secs(60), |p| {
            chunk_lens(p).iter().map(|&l| u64::from(l)).sum::<u64>() >= MIB
        });
        assert!(got, "the message did not arrive: {:?}", peer.log);
        peer
    })
    .await;
    check_chunks("default client", &peer);
    // The raw server re-posts receives only while it polls: poll while the client closes.
    let closing = tokio::spawn(async move {
        let r = within(60, "close", conn.close()).await;
        drop(conn);
        r
    });
    let peer = blocking(move || {
        let mut peer = peer;
        let gone = peer.wait_until(Duration::from_secs(60), RawPeer::disconnected);
        assert!(gone, "no DISCONNECTED after the client closed");
        peer
    })
    .await;
    closing.await.expect("close task").expect("close");
    blocking(move || drop(peer)).await;
    back_to(&baseline, "a server answering 63 x 16 MiB").await;
}

/// Whether the raw peer received a rendezvous descriptor.
fn got_descriptor(p: &RawPeer) -> bool {
    p.log.iter().any(|s| {
        matches!(s, Seen::Recv { imm: Some(i), .. }
            if MsgHeader::decode(*i).is_ok_and(|h| h.kind == MsgKind::Rendezvous))
    })
}

/// A raw client taking part in rendezvous that takes descriptors and never reads them (never
/// sends `Fetched`), while staying alive (its device acknowledges everything).
async fn never_reading(bench: &Bench) -> (RawPeer, Connection) {
    let mut params = raw_params(4, 4096, 4 << 20);
    params.flags = params.flags | Flags::RENDEZVOUS;
    bench.hostile(RawOpts::new(params)).await
}

/// Sends a 1 MiB message by rendezvous in a task of its own (it resolves only when the peer
/// read it) and waits until the raw peer has the descriptor.
async fn offer(conn: &Arc<Connection>, peer: RawPeer) -> (RawPeer, JoinHandle<Result<(), Error>>) {
    let c = conn.clone();
    let send = tokio::spawn(async move { c.send_bytes(Bytes::from(vec![7u8; 1 << 20])).await });
    let peer = blocking(move || {
        let mut peer = peer;
        let got = peer.wait_until(Duration::from_secs(60), got_descriptor);
        assert!(got, "no descriptor: {:?}", peer.log);
        peer
    })
    .await;
    (peer, send)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_live_peer_that_never_reads_a_rendezvous_message_cannot_hold_the_close() {
    const LIMIT: Duration = Duration::from_secs(3);
    let mut bench = Bench::new(7382, opts(4, 4096, 4 << 20).close_timeout(LIMIT)).await;

    // (a) close(): resolves after the close timeout with the cause; the send with it.
    let (peer, conn) = never_reading(&bench).await;
    let conn = Arc::new(conn);
    let (peer, send) = offer(&conn, peer).await;
    let t0 = Instant::now();
    let closed = within(60, "close with an unread rendezvous message", conn.close()).await;
    let took = t0.elapsed();
    let sent = within(60, "the rendezvous send", send)
        .await
        .expect("send task");
    println!("close with an unread rendezvous message: {closed:?} after {took:?}; send: {sent:?}");
    assert!(
        matches!(closed, Err(Error::QpFailed(QpFailure::CloseTimeout(d))) if d == LIMIT),
        "close: {closed:?}"
    );
    assert!(
        took >= LIMIT && took < LIMIT + Duration::from_secs(30),
        "{took:?}"
    );
    assert!(matches!(sent, Err(Error::QpFailed(_))), "send: {sent:?}");
    let peer = blocking(move || {
        let mut peer = peer;
        let gone = peer.wait_until(Duration::from_secs(60), RawPeer::disconnected);
        assert!(gone, "no DISCONNECTED after the close timeout");
        assert!(
            peer.reports.is_empty(),
            "no error report: not a protocol violation"
        );
        peer
    })
    .await;
    drop(conn);
    blocking(move || drop(peer)).await;
    bench
        .survived("close with an unread rendezvous message")
        .await;

    // (b) The connection dropped with the message unread: its task tears it down after the
    // close timeout, and the registration goes (the resources come back without anyone
    // holding the connection or waiting).
    let (peer, conn) = never_reading(&bench).await;
    let conn = Arc::new(conn);
    let (peer, send) = offer(&conn, peer).await;
    send.abort();
    let _ = send.await;
    let conn = Arc::into_inner(conn).expect("the only handle");
    drop(conn);
    let peer = blocking(move || {
        let mut peer = peer;
        let gone = peer.wait_until(Duration::from_secs(60), RawPeer::disconnected);
        assert!(gone, "no DISCONNECTED after dropping the connection");
        peer
    })
    .await;
    blocking(move || drop(peer)).await;
    bench
        .survived("a dropped connection with an unread rendezvous message")
        .await;
}

/// On a shared receive queue every SEND of a peer takes a shared buffer, credits or not. A
/// peer that sends beyond its credits is caught when the completion of its first excess SEND
/// is processed: from then on its queue pair is in the error state and consumes nothing of the
/// shared queue, even while its error report cannot go out (this peer posts no receive for
/// it). On 61ac8ac the queue pair stayed ready until the report completed or the keepalive
/// timeout passed, and every later SEND took a shared buffer from the other connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn an_overrunning_peer_on_a_shared_receive_queue_takes_nothing_after_detection() {
    common::init_tracing();
    const BUFFERS: u32 = 64;
    const AFTER: usize = 10;
    let ep = Endpoint::open_with(
        &common::device_name(),
        EndpointOptions::default()
            .shared_receive_queue(SrqOptions::default().buffers(BUFFERS).buffer_size(4096)),
    )
    .expect("endpoint with a shared receive queue");
    // The application holds what it receives and the budget is 0: no credit goes back, so
    // the chunk past the initial credits is an overrun whatever the timing.
    let server_opts = opts(8, 4096, 4096).recv_budget(0);
    let a = addr(7383);
    let listener = ep.listen_with(a, server_opts).await.expect("listen");
    let (good, good_srv) = tokio::join!(
        within(
            60,
            "connect",
            Connection::connect_with(a, opts(8, 4096, 4096))
        ),
        within(60, "accept", listener.accept()),
    );
    let (good, good_srv) = (good.expect("connect"), good_srv.expect("accept"));
    let echo = |n: u8| {
        let (good, good_srv) = (&good, &good_srv);
        async move {
            good.send(&[n; 100]).await.expect("good send");
            let m = good_srv
                .recv()
                .await
                .expect("good recv")
                .expect("a message");
            assert_eq!(&m[..], &[n; 100]);
        }
    };
    within(60, "echo before", echo(1)).await;
    let baseline = settled_counts().await;

    // The raw peer never confirms the server's control messages: once three are
    // unconfirmed the server's control window is full and its error report cannot go out.
    let mut raw = RawOpts::new(raw_params(8, 4096, 4096));
    raw.confirm = false;
    let (peer, conn) = tokio::join!(
        blocking(move || RawPeer::connect(a, raw)),
        within(60, "accept the raw peer", listener.accept()),
    );
    let conn = conn.expect("accept the raw peer");
    let server = collect(conn);
    let (mut peer, credits) = blocking(move || {
        let mut peer = peer;
        // The floor's credits are granted in the handshake, more right after (as returns).
        peer.wait_until(Duration::from_secs(2), |p| p.controls_received > 0);
        while peer.controls_received < 3 {
            // Two control messages of ours make the server owe a confirmation.
            let seen = peer.controls_received;
            peer.send_control(MsgKind::Credit);
            peer.send_control(MsgKind::Credit);
            assert!(
                peer.wait_until(Duration::from_secs(30), |p| p.controls_received > seen),
                "a confirmation from the server"
            );
        }
        // The raw peer counts the announced depth as its start; the server granted the floor.
        let n = &peer.negotiated;
        let credits = peer.credits - i64::from(n.send_credits - n.send_initial_credits);
        println!(
            "  raw peer: {credits} credits, {} server control messages unconfirmed",
            peer.controls_received
        );
        for i in 0..=credits {
            peer.send_chunk(MsgKind::Last, 4096, i as u8);
        }
        (peer, credits)
    })
    .await;
    let (msgs, end, _, conn) = within(60, "server", server).await.expect("server task");
    println!("overrun on the shared queue: server recv() -> {end:?}");
    assert!(
        is_protocol(&end, tokio_rdma::ProtocolError::CreditOverrun),
        "{end:?}"
    );
    assert_eq!(msgs.len() as i64, credits);
    let taken_before = ep.shared_receive_stats().expect("srq").posted;
    // Detected. More SENDs: none may take a shared buffer.
    peer = blocking(move || {
        std::thread::sleep(Duration::from_millis(200));
        for i in 0..AFTER {
            peer.send_chunk(MsgKind::Last, 4096, i as u8);
        }
        assert!(peer.wait_sends(Duration::from_secs(60)), "sends unresolved");
        peer
    })
    .await;
    let failed = peer
        .log
        .iter()
        .filter(|s| matches!(s, Seen::SendFailed(_)))
        .count();
    println!(
        "  {AFTER} SENDs after the detection: {failed} failed ({:?}); receives on the shared queue {taken_before} -> {}",
        peer.send_failed(),
        ep.shared_receive_stats().expect("srq").posted
    );
    assert_eq!(
        failed, AFTER,
        "every SEND after the detection was refused by the device, none took a shared buffer"
    );
    within(60, "echo after", echo(2)).await;
    drop((msgs, conn));
    blocking(move || drop(peer)).await;
    within(60, "echo after teardown", echo(3)).await;
    back_to(&baseline, "an overrun on the shared receive queue").await;
    let s = ep.shared_receive_stats().expect("srq");
    assert_eq!(s.connections, 1, "{s:?}");
}
