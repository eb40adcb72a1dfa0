//! Device tests of a tokio-rdma `Listener` / `Connection` against hostile or dying peers (rxe,
//! soft-RoCE VM). The attacker is a raw peer (`common/raw_peer.rs`): an RDMA CM client or
//! server with its own PD, CQ and QP that speaks the protocol by hand (handshake version 2 in
//! the private data, SENDs with the header in the immediate data) and breaks it on purpose:
//! data beyond its credits, malformed headers, lengths that lie, vanishing mid-message, dying
//! silently; and a tokio-rdma client that uses a grant's token on another connection and
//! guesses rkeys.
//!
//! In every scenario the hostile connection fails with the precise error, a second,
//! well-behaved connection to the same listener keeps working (an echo round trip after the
//! attack), and the device resources (`rdma resource show`: qp, cq, mr, pd, cm_id) return to
//! what they were before the attack. Each test prints what happened: errors, times, counts.
//! Bounds on times are generous (several times the computed bound); nothing depends on
//! timing luck.
#![allow(clippy::print_stdout)]

#[path = "common/hostile_bench.rs"]
mod bench;
mod common;
#[path = "common/raw_peer.rs"]
mod raw_peer;

use bench::*;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{pattern, within};
use raw_peer::{RawListener, RawOpts, RawPeer, Seen};
use tokio::task::JoinHandle;
use tokio_rdma::buf::{RemoteAccess, RemoteToken};
use tokio_rdma::conn::handshake::Flags;
use tokio_rdma::conn::wire::{MsgHeader, MsgKind, RemoteMsg};
use tokio_rdma::conn::{Connection, Listener};
use tokio_rdma::{Error, ProtocolError, QpFailure, WcStatus};

const DISCONNECTED: &str = "RDMA_CM_EVENT_DISCONNECTED";

// ---- 1. credits --------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_peer_sending_beyond_its_credits_gets_a_protocol_error() {
    // 4 credits of 4 KiB and a receive budget of one message (4 KiB): a full chunk the
    // application holds stops the credit return, so the server returns no credit during the
    // attack and the fifth chunk is an overrun whatever the timing.
    let mut bench = Bench::new(7301, opts(4, 4096, 4096).recv_budget(0)).await;
    let (mut peer, conn) = bench.hostile(RawOpts::new(raw_params(4, 4096, 4096))).await;
    let credits = peer.credits;
    assert_eq!(credits, 4, "the server's recv_credits");
    let server = collect(conn);
    let t0 = Instant::now();
    let peer = blocking(move || {
        // recv_credits + 1 full chunks, posted back to back, without waiting for credits.
        for i in 0..=credits {
            peer.send_chunk(MsgKind::Last, 4096, i as u8);
        }
        let done = peer.wait_until(Duration::from_secs(60), |p| p.disconnected());
        assert!(done, "no DISCONNECTED within 60 s; saw {:?}", peer.log);
        peer
    })
    .await;
    let raw_done = t0.elapsed();
    let (msgs, end, at, conn) = within(60, "server", server).await.expect("server task");
    println!(
        "credit overrun: raw peer sent {} chunks with {credits} credits; server delivered {} messages, then recv() -> {end:?} after {:?}",
        credits + 1,
        msgs.len(),
        at - t0
    );
    println!(
        "  raw peer: error reports {:?} ({:?}), events {:?}, DISCONNECTED seen after {raw_done:?}",
        peer.reports,
        peer.report(),
        peer.log
            .iter()
            .filter(|s| !matches!(s, Seen::Recv { .. }) || is_report(s))
            .collect::<Vec<_>>()
    );
    assert!(
        is_protocol(&end, ProtocolError::CreditOverrun),
        "server recv: {end:?}"
    );
    assert_eq!(
        msgs.len(),
        4,
        "the chunks within the credits were delivered"
    );
    for (i, m) in msgs.iter().enumerate() {
        assert!(m[..] == pattern(4096, i as u8)[..], "message {i} intact");
    }
    assert_eq!(peer.reports, vec![ProtocolError::CreditOverrun.code()]);
    // The server disconnects only after its error report completed, i.e. after the raw
    // peer's device acknowledged it (rxe completes the receive before it acknowledges).
    let report = peer.position(is_report).expect("error report");
    let disc = peer
        .position(|s| *s == Seen::Cm(DISCONNECTED))
        .expect("disconnect");
    assert!(report < disc, "the report arrived before the disconnect");
    assert_eq!(peer.send_failed(), None, "every chunk reached the server");
    drop((msgs, conn));
    blocking(move || drop(peer)).await;
    bench.survived("a credit overrun").await;
}

// ---- 2. malformed headers ---------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn malformed_headers_fail_only_that_connection() {
    let mut bench = Bench::new(7310, opts(4, 4096, 1 << 16)).await;
    let header = |kind, credits| {
        MsgHeader {
            kind,
            ctrl_ack: 0,
            credits,
        }
        .encode()
    };
    let cases: Vec<(&str, usize, Option<u32>, ProtocolError)> = vec![
        (
            "unknown kind 8",
            16,
            Some(8 << 28),
            ProtocolError::BadHeader(8 << 28),
        ),
        (
            "reserved bit 24 set (a Last chunk)",
            16,
            Some(header(MsgKind::Last, 0) | 1 << 24),
            ProtocolError::BadHeader(1 << 24),
        ),
        (
            "data without immediate data (plain SEND)",
            100,
            None,
            ProtocolError::NoImmediate,
        ),
        (
            "a credit message with 8 payload bytes",
            8,
            Some(header(MsgKind::Credit, 0)),
            ProtocolError::ControlWithPayload(8),
        ),
        (
            "a credit returned that was never granted",
            0,
            Some(header(MsgKind::Credit, 1)),
            ProtocolError::CreditInflation,
        ),
        (
            "an abort with no message in progress",
            0,
            Some(header(MsgKind::Abort, 0)),
            ProtocolError::StrayAbort,
        ),
        (
            "a rendezvous descriptor from a peer that did not offer rendezvous",
            24,
            Some(header(MsgKind::Rendezvous, 0)),
            ProtocolError::RendezvousNotOffered,
        ),
        (
            "a rendezvous acknowledgement for nothing in flight",
            0,
            Some(header(MsgKind::Fetched, 0)),
            ProtocolError::StrayFetched,
        ),
    ];
    for (what, len, imm, want) in cases {
        let (mut peer, conn) = bench
            .hostile(RawOpts::new(raw_params(4, 4096, 1 << 16)))
            .await;
        let server = collect(conn);
        let t0 = Instant::now();
        let peer = blocking(move || {
            peer.post_send(len, 9, imm);
            let done = peer.wait_until(Duration::from_secs(60), |p| p.disconnected());
            assert!(
                done,
                "{what}: no DISCONNECTED within 60 s; saw {:?}",
                peer.log
            );
            peer
        })
        .await;
        let (msgs, end, at, conn) = within(60, "server", server).await.expect("server task");
        println!(
            "{what} (imm {imm:x?}, {len} bytes): server recv() -> {end:?} after {:?}; raw peer got reports {:?} ({:?}) before DISCONNECTED",
            at - t0,
            peer.reports,
            peer.report()
        );
        assert!(is_protocol(&end, want), "{what}: server recv: {end:?}");
        assert!(msgs.is_empty(), "{what}: nothing delivered");
        assert_eq!(peer.reports, vec![want.code()], "{what}: the peer is told");
        let report = peer.position(is_report).expect("report");
        let disc = peer.position(|s| *s == Seen::Cm(DISCONNECTED)).expect("dc");
        assert!(report < disc, "{what}: report before the disconnect");
        drop(conn);
        blocking(move || drop(peer)).await;
        bench.survived(what).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_peer_that_never_takes_the_error_report_is_still_let_go() {
    // The peer breaks the protocol but leaves no way for the server's error report to arrive:
    // (a) it has no receive posted (the report meets receiver-not-ready NAKs; the connection's
    // RNR retry count is 7, "for ever" by the specification), or (b) it never confirms the
    // server's control messages, so the server's control window is full and the report cannot
    // even be sent. Either way the server must give up on the report after its keepalive
    // timeout and tear the connection down, instead of holding it for as long as the peer
    // stays connected.
    let keepalive_timeout = Duration::from_secs(3);
    // No keepalives: the server's control messages are only the ones the test provokes.
    let mut bench = Bench::new(
        7315,
        opts(4, 4096, 1 << 16)
            .keepalive(None)
            .keepalive_timeout(keepalive_timeout),
    )
    .await;
    for case in ["no receive posted", "control window full"] {
        let mut raw = RawOpts::new(raw_params(4, 4096, 1 << 16));
        if case == "no receive posted" {
            raw.post_recvs = 0;
            raw.repost = false;
        } else {
            raw.confirm = false;
        }
        let (mut peer, conn) = bench.hostile(raw).await;
        let server = collect(conn);
        let (peer, violated, disc) = blocking(move || {
            if case == "control window full" {
                // Every two control messages of ours make the server owe a confirmation, which
                // it sends as a credit message; we never confirm those: after three rounds its
                // window (2, plus 1 for a confirmation) is full.
                for round in 1..=3 {
                    peer.send_control(MsgKind::Credit);
                    peer.send_control(MsgKind::Credit);
                    assert!(
                        peer.wait_until(Duration::from_secs(30), |p| p.controls_received >= round),
                        "server confirmation {round}"
                    );
                }
            }
            let t0 = Instant::now();
            peer.post_send(16, 1, Some(8 << 28));
            let done = peer.wait_until(Duration::from_secs(60), |p| p.disconnected());
            (peer, t0, done.then(|| t0.elapsed()))
        })
        .await;
        let (_, end, at, conn) = within(60, "server", server).await.expect("server task");
        println!(
            "{case}: the peer sends a bad header: server recv() -> {end:?} after {:?}; the server disconnected after {disc:?} (keepalive timeout {keepalive_timeout:?}); raw peer saw {:?}",
            at - violated,
            peer.log
                .iter()
                .filter(|s| !matches!(s, Seen::Recv { .. }))
                .collect::<Vec<_>>()
        );
        assert!(
            is_protocol(&end, ProtocolError::BadHeader(8 << 28)),
            "{case}: {end:?}"
        );
        let disc = disc.unwrap_or_else(|| {
            panic!("{case}: the server held the connection (no disconnect within 60 s)")
        });
        // Bound: the keepalive timeout after the report was due; asserted with 10x slack.
        assert!(
            disc < keepalive_timeout * 10,
            "{case}: disconnected after {disc:?}"
        );
        assert!(
            peer.reports.is_empty(),
            "{case}: the report could not arrive"
        );
        drop(conn);
        blocking(move || drop(peer)).await;
        bench.survived(case).await;
    }
}

// ---- 3. lengths -------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_peer_lying_about_lengths_is_stopped() {
    const BUF: u32 = 64 << 10;
    const MAX: u64 = 2 << 20;
    let mut bench = Bench::new(7320, opts(8, BUF, MAX)).await;

    // (a) A chunk one byte larger than the server's receive buffers.
    let (mut peer, conn) = bench.hostile(RawOpts::new(raw_params(4, 4096, MAX))).await;
    let server = collect(conn);
    let t0 = Instant::now();
    let peer = blocking(move || {
        peer.send_chunk(MsgKind::Last, BUF as usize + 1, 1);
        let done = peer.wait_until(Duration::from_secs(60), |p| p.disconnected());
        assert!(done, "oversized chunk: no DISCONNECTED; saw {:?}", peer.log);
        // The sender's own completion (printed, not asserted: it is the transport's business).
        peer.wait_sends(Duration::from_secs(10));
        peer
    })
    .await;
    let (msgs, end, at, conn) = within(60, "server", server).await.expect("server task");
    let err = end
        .as_ref()
        .expect_err("the oversized chunk fails the connection");
    println!(
        "a chunk of {} bytes into {BUF}-byte receives: server recv() -> {err} ({err:?}) after {:?}; the raw sender's SEND completed with {:?}",
        BUF + 1,
        at - t0,
        peer.send_failed()
    );
    // The verbs say IBV_WC_LOC_LEN_ERR. rxe (Linux 6.1) reports IBV_WC_LOC_QP_OP_ERR instead:
    // its copy_data() returns -EINVAL, not -ENOSPC, for a payload longer than the receive, so
    // the responder takes its malformed-WQE path (and NAKs the sender with a remote operation
    // error). Either way the error names the device's status.
    let status = wc_status(err).expect("a work-completion failure");
    assert!(
        matches!(status, WcStatus::LocLenErr | WcStatus::LocQpOpErr),
        "{err:?}"
    );
    assert!(err.to_string().contains(status.name()), "{err}");
    assert!(msgs.is_empty());
    drop(conn);
    blocking(move || drop(peer)).await;
    bench.survived("an oversized chunk").await;

    // (b) `More` chunks that add up past the negotiated maximum: the peer means to send 1 GiB
    // as one message; the server stops at MAX, holding at most MAX bytes for it.
    let (mut peer, conn) = bench.hostile(RawOpts::new(raw_params(4, 4096, MAX))).await;
    let rss0 = common::rss_bytes();
    let peak = Arc::new(AtomicU64::new(rss0));
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = {
        let (peak, sampling) = (peak.clone(), sampling.clone());
        tokio::spawn(async move {
            while sampling.load(Ordering::Relaxed) {
                peak.fetch_max(common::rss_bytes(), Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let server = collect(conn);
    let t0 = Instant::now();
    let (peer, chunks) = blocking(move || {
        let intended: u64 = 1 << 30;
        let mut chunks = 0u64;
        while chunks * u64::from(BUF) < intended {
            let ok = peer.wait_until(Duration::from_secs(60), |p| {
                p.credits > 0 || !p.reports.is_empty() || p.disconnected()
            });
            assert!(ok, "no credit within 60 s after {chunks} chunks");
            if !peer.reports.is_empty() || peer.disconnected() {
                break;
            }
            peer.send_chunk(MsgKind::More, BUF as usize, chunks as u8);
            chunks += 1;
        }
        let done = peer.wait_until(Duration::from_secs(60), |p| p.disconnected());
        assert!(done, "no DISCONNECTED; saw {:?}", peer.log);
        (peer, chunks)
    })
    .await;
    let (msgs, end, at, conn) = within(60, "server", server).await.expect("server task");
    sampling.store(false, Ordering::Relaxed);
    sampler.await.unwrap();
    let grew = peak.load(Ordering::Relaxed).saturating_sub(rss0);
    println!(
        "a message meant to be 1 GiB in {BUF}-byte More chunks (max {MAX}): raw peer sent {chunks} chunks before it stopped; server recv() -> {end:?} after {:?}; reports {:?}; RSS {} MiB, peak +{} KiB during the attack",
        at - t0,
        peer.report(),
        rss0 >> 20,
        grew >> 10
    );
    assert!(
        is_protocol(&end, ProtocolError::MessageTooLarge(MAX)),
        "{end:?}"
    );
    assert!(msgs.is_empty(), "no partial message delivered");
    assert_eq!(peer.reports, vec![ProtocolError::MessageTooLarge(0).code()]);
    let limit = MAX / u64::from(BUF) + 1;
    assert!(
        chunks >= limit && chunks <= limit + 8,
        "stopped after the offending chunk ({limit}) plus at most the credits in flight: {chunks}"
    );
    // The partial message is at most MAX bytes (a Vec that doubles: up to 2 * MAX allocated);
    // 32 MiB leaves room for allocator noise and is far below what the peer meant to send.
    assert!(grew < 32 << 20, "RSS grew by {grew} bytes");
    drop(conn);
    blocking(move || drop(peer)).await;
    bench.survived("a message past the maximum").await;
}

// ---- 4. vanishing mid-message -----------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_peer_vanishing_mid_message_is_an_error_not_a_close() {
    let mut bench = Bench::new(7330, opts(4, 4096, 1 << 16)).await;
    for how in ["rdma_disconnect", "destroyed (process death)", "Close"] {
        let (mut peer, conn) = bench
            .hostile(RawOpts::new(raw_params(4, 4096, 1 << 16)))
            .await;
        let server = collect(conn);
        let t0 = Instant::now();
        let peer = blocking(move || {
            peer.send_chunk(MsgKind::More, 4096, 1);
            assert!(
                peer.wait_sends(Duration::from_secs(60)),
                "chunk acknowledged"
            );
            assert_eq!(peer.send_failed(), None);
            match how {
                "rdma_disconnect" => peer.id.disconnect().expect("rdma_disconnect"),
                "Close" => {
                    peer.send_control(MsgKind::Close);
                    assert!(peer.wait_until(Duration::from_secs(60), |p| p.disconnected()));
                }
                _ => {
                    drop(peer);
                    return None;
                }
            }
            Some(peer)
        })
        .await;
        let (msgs, end, at, conn) = within(60, "server", server).await.expect("server task");
        let stats = conn.stats();
        println!(
            "a More chunk, then the peer {how}: server recv() -> {end:?} after {:?}; messages delivered {}",
            at - t0,
            stats.protocol.messages_received
        );
        if how == "Close" {
            assert!(is_protocol(&end, ProtocolError::CloseMidMessage), "{end:?}");
        } else {
            assert!(
                matches!(end, Err(Error::QpFailed(QpFailure::Disconnected))),
                "{how}: {end:?}"
            );
        }
        assert!(msgs.is_empty(), "the partial message is never delivered");
        assert_eq!(stats.protocol.messages_received, 0);
        drop(conn);
        blocking(move || drop(peer)).await;
        bench.survived(how).await;
    }
}

// ---- 5. silently dead peers -------------------------------------------------------------------

/// Starts a pending `recv()` and a pending `send()` of 256 KiB on `conn`; each reports its
/// result and when it came.
/// How a silently dead peer is detected: the transport gives up on a send (the keepalive or
/// a chunk), or the keepalive timeout fires.
fn dead_peer_error(res: &End) -> bool {
    match res {
        Err(Error::QpFailed(QpFailure::KeepaliveTimeout(_))) => true,
        Err(e) => wc_status(e) == Some(WcStatus::RetryExcErr),
        Ok(()) => false,
    }
}

/// A pending operation: its result and when it came.
type Pending = JoinHandle<(End, Instant)>;

fn pending_ops(conn: Connection) -> (Pending, Pending) {
    let conn = Arc::new(conn);
    let c = conn.clone();
    let recv = tokio::spawn(async move {
        let r = match c.recv().await {
            Ok(Some(m)) => panic!("a dead peer sent {} bytes", m.len()),
            Ok(None) => Ok(()),
            Err(e) => Err(e),
        };
        (r, Instant::now())
    });
    let send = tokio::spawn(async move {
        let r = conn.send(&vec![7u8; 256 << 10]).await;
        (r, Instant::now())
    });
    (recv, send)
}

/// Lets the raw peer take the first chunks of the pending send (so the send waits for the
/// credits the peer will never return), then kills its queue pair without any CM message.
/// Returns the peer (kept alive: its CM id stays connected) and the time of the kill.
async fn die_silently(mut peer: RawPeer) -> (RawPeer, Instant) {
    blocking(move || {
        assert!(
            peer.wait_until(Duration::from_secs(60), |p| p.data_received >= 4),
            "the send's first chunks arrive"
        );
        peer.qp.to_error().expect("QP to ERR");
        (peer, Instant::now())
    })
    .await
}

/// Starts a pending `recv()` and `send()` on `conn`, makes `peer` die silently, and checks
/// both fail with a dead-peer error within `limit`, printing what each got and when.
async fn expect_detected(side: &str, conn: Connection, peer: RawPeer, limit: Duration) {
    let (recv, send) = pending_ops(conn);
    let (peer, killed) = die_silently(peer).await;
    let (r, r_at) = within(60, "recv", recv).await.unwrap();
    let (s, s_at) = within(60, "send", send).await.unwrap();
    println!(
        "{side}: recv() -> {r:?} after {:?}; send(256 KiB) -> {s:?} after {:?}",
        r_at - killed,
        s_at - killed
    );
    for (what, res, at) in [("recv", &r, r_at), ("send", &s, s_at)] {
        assert!(dead_peer_error(res), "{side}, {what}: {res:?}");
        assert!(
            at - killed < limit,
            "{side}, {what}: after {:?}",
            at - killed
        );
    }
    blocking(move || drop(peer)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_silently_dead_peer_is_detected_within_the_keepalive_bound() {
    let keepalive = Duration::from_secs(1);
    let keepalive_timeout = Duration::from_secs(3);
    let (retry, ack) = (3u8, 14u8);
    let o = opts(4, 4096, 1 << 20)
        .keepalive(Some(keepalive))
        .keepalive_timeout(keepalive_timeout)
        .retry_count(retry)
        .ack_timeout(Some(ack));
    // The bound: the next keepalive goes out within `keepalive`; the peer's silence is then
    // detected by the transport (ack timeout 4.096 us * 2^ack, retry + 1 tries) or at the
    // latest by the keepalive timeout.
    let transport = Duration::from_nanos(4096 << ack) * (u32::from(retry) + 1);
    let bound = keepalive + keepalive_timeout + transport;
    let slack = 4;
    println!(
        "bound: keepalive {keepalive:?} + keepalive timeout {keepalive_timeout:?} + transport {transport:?} = {bound:?}; asserted with {slack}x slack"
    );
    let mut bench = Bench::new(7340, o.clone()).await;

    // (a) A tokio-rdma server, a raw client.
    let (peer, conn) = bench
        .hostile(RawOpts::new(raw_params(4, 4096, 1 << 20)))
        .await;
    expect_detected("server side, raw client dead", conn, peer, bound * slack).await;
    bench.good_still_works("a dead raw client").await;

    // (b) A tokio-rdma client, a raw server.
    let a = addr(7341);
    let raw_listener = blocking(move || RawListener::bind(a)).await;
    let (peer, client) = tokio::join!(
        blocking(move || raw_listener.accept(RawOpts::new(raw_params(4, 4096, 1 << 20)))),
        within(60, "connect", Connection::connect_with(a, o.clone())),
    );
    let client = client.expect("connect to the raw server");
    expect_detected("client side, raw server dead", client, peer, bound * slack).await;
    bench.survived("two dead peers").await;
}

// ---- 6. grants --------------------------------------------------------------------------------

fn is_rem_access(e: &Error) -> bool {
    wc_status(e) == Some(WcStatus::RemAccessErr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_grant_is_unreachable_from_another_connection() {
    common::init_tracing();
    let a = addr(7360);
    let o = opts(4, 4096, 1 << 16);
    let listener = Arc::new(Listener::bind_with(a, o.clone()).await.expect("bind"));
    let (a_client, a_server) = tokio::join!(
        within(60, "connect A", Connection::connect_with(a, o.clone())),
        within(60, "accept A", listener.accept()),
    );
    let (a_client, a_server) = (a_client.expect("A"), a_server.expect("accept A"));
    // Every later connection: echoed, and how it ended is counted.
    let ends: Arc<Mutex<BTreeMap<String, u32>>> = Arc::default();
    let accepted = Arc::new(AtomicU64::new(0));
    let sink = {
        let (listener, ends, accepted) = (listener.clone(), ends.clone(), accepted.clone());
        tokio::spawn(async move {
            while let Ok(c) = listener.accept().await {
                accepted.fetch_add(1, Ordering::Relaxed);
                let ends = ends.clone();
                tokio::spawn(async move {
                    let end = loop {
                        match c.recv().await {
                            Ok(Some(m)) => {
                                if let Err(e) = c.send(&m).await {
                                    break e.to_string();
                                }
                            }
                            Ok(None) => break "end of stream".to_string(),
                            Err(e) => break e.to_string(),
                        }
                    };
                    *ends.lock().unwrap().entry(end).or_default() += 1;
                });
            }
        })
    };

    // The server grants 4 KiB on A and sends the token over A.
    let (p1, p2) = (pattern(4096, 1), pattern(4096, 2));
    let buf = a_server.pool().unwrap().acquire(4096).await.unwrap();
    let mut grant = a_server
        .grant(buf, 0..4096, RemoteAccess::READ | RemoteAccess::WRITE)
        .expect("grant");
    grant.write_at(0, &p1);
    a_server.send(&grant.token().to_bytes()).await.unwrap();
    let msg = a_client.recv().await.unwrap().expect("token");
    let token = RemoteToken::from_bytes(&msg).expect("token");
    drop(msg);
    let granted = || {
        let mut now = vec![0u8; 4096];
        grant.read_at(0, &mut now);
        now
    };
    // Through A: read and write work.
    let rbuf = a_client.pool().unwrap().acquire(4096).await.unwrap();
    let (res, rbuf) = a_client.read(rbuf, token).await;
    res.expect("read through A");
    assert!(rbuf[..] == p1[..], "A read the granted bytes");
    drop(rbuf);
    let mut wbuf = a_client.pool().unwrap().acquire(4096).await.unwrap();
    wbuf.copy_from_slice(&p2);
    let (res, wbuf) = a_client.write(wbuf, token).await;
    res.expect("write through A");
    drop(wbuf);
    assert!(granted() == p2, "A's write landed");
    println!("through A: read and write of the 4 KiB grant work");
    let baseline = settled_counts().await;
    println!("baseline (listener, connection A, its grant): {baseline:?}");

    // Through B: A's exact token.
    let b = within(60, "connect B", Connection::connect_with(a, o.clone()))
        .await
        .expect("B");
    let t0 = Instant::now();
    let rbuf = b.pool().unwrap().acquire(4096).await.unwrap();
    let (res, rbuf) = within(60, "read through B", b.read(rbuf, token)).await;
    let err = res.expect_err("A's token must not work through B");
    println!(
        "read through B with A's token: {err} after {:?}",
        t0.elapsed()
    );
    assert!(is_rem_access(&err), "{err:?}");
    assert!(
        rbuf[..] != p2[..],
        "nothing of the grant leaked into B's buffer"
    );
    drop((rbuf, b));
    let b2 = within(60, "connect B2", Connection::connect_with(a, o.clone()))
        .await
        .expect("B2");
    let mut wbuf = b2.pool().unwrap().acquire(4096).await.unwrap();
    wbuf.copy_from_slice(&pattern(4096, 3));
    let (res, wbuf) = within(60, "write through B2", b2.write(wbuf, token)).await;
    let err = res.expect_err("A's token must not work through another connection");
    println!("write through another connection with A's token: {err}");
    assert!(is_rem_access(&err), "{err:?}");
    drop((wbuf, b2));
    assert!(granted() == p2, "the granted bytes are unchanged");

    // Key guessing: A's rkey index with every 8-bit key (A's own first), each a write through
    // a fresh connection (every failure kills its connection), 8 at a time.
    let base = token.rkey() & !0xff;
    let own = token.rkey() & 0xff;
    let keys: Vec<u32> = std::iter::once(own)
        .chain((0..256).filter(|&k| k != own))
        .collect();
    let budget = Duration::from_secs(90);
    let started = Instant::now();
    let permits = Arc::new(tokio::sync::Semaphore::new(8));
    let mut set = tokio::task::JoinSet::new();
    let mut tried = 0u32;
    for (i, k) in keys.into_iter().enumerate() {
        if started.elapsed() > budget {
            break;
        }
        let permit = permits.clone().acquire_owned().await.unwrap();
        tried += 1;
        let guess = RemoteToken::new(token.addr(), token.len(), base | k);
        let o = o.clone();
        set.spawn(async move {
            let _permit = permit;
            let c = within(60, "connect", Connection::connect_with(a, o))
                .await
                .expect("connect for a guess");
            let mut buf = c.pool().unwrap().acquire(4096).await.unwrap();
            buf.copy_from_slice(&pattern(4096, (i as u8).wrapping_add(100)));
            let (res, _buf) = within(60, "guessed write", c.write(buf, guess)).await;
            res.map_err(|e| (is_rem_access(&e), e.to_string()))
        });
    }
    let mut failed: BTreeMap<String, u32> = BTreeMap::new();
    let mut breaches = 0u32;
    let mut other = 0u32;
    while let Some(r) = within(120, "guesses", set.join_next()).await {
        match r.expect("guess task") {
            Ok(()) => breaches += 1,
            Err((rem_access, e)) => {
                if !rem_access {
                    other += 1;
                }
                *failed.entry(e).or_default() += 1;
            }
        }
    }
    let took = started.elapsed();
    let attempts_failed: u32 = failed.values().sum();
    println!(
        "rkey sweep: {tried} of 256 key bytes tried with A's index (A's exact rkey first), each a 4 KiB write through a fresh connection, 8 at a time, in {took:?}: {attempts_failed} failed, {breaches} succeeded; client errors {failed:?}"
    );
    if tried < 256 {
        println!(
            "  NOTE: the {budget:?} budget ran out: {} key bytes were not tried",
            256 - tried
        );
    }
    assert_eq!(
        breaches, 0,
        "a guessed rkey reached A's grant from another connection"
    );
    assert_eq!(other, 0, "every failure is a remote access error");
    assert_eq!(attempts_failed, tried);
    assert!(
        granted() == p2,
        "the granted bytes are unchanged after the sweep"
    );

    // A still works both ways.
    a_client.send(b"still here").await.unwrap();
    let m = within(60, "A recv", a_server.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&m[..], b"still here");
    a_server.send(&m).await.unwrap();
    drop(m);
    let back = within(60, "A echo", a_client.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&back[..], b"still here");
    drop(back);
    println!("connection A still works after the attempts");
    back_to(&baseline, "the rkey sweep").await;
    let ended = || {
        ends.lock()
            .unwrap()
            .values()
            .map(|&n| u64::from(n))
            .sum::<u64>()
    };
    let t0 = Instant::now();
    while ended() < accepted.load(Ordering::Relaxed) && t0.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A guess often reaches the server's queue pair while it is still in RTR (the client may
    // send as soon as it is established; the server moves to RTS on ESTABLISHED): the access
    // error then kills it during its setup, which the listener counts as rejected.
    println!(
        "server side: {} other connections accepted (ended: {:?}), {} setups failed (listener.rejected())",
        accepted.load(Ordering::Relaxed),
        ends.lock().unwrap(),
        listener.rejected()
    );
    assert_eq!(
        ended(),
        accepted.load(Ordering::Relaxed),
        "every accepted one ended"
    );
    drop(grant);
    sink.abort();
}

// ---- rendezvous: a descriptor naming memory the peer never opened ------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_lying_rendezvous_descriptor_fails_only_that_connection() {
    let mut bench = Bench::new(7318, opts(4, 4096, 1 << 20)).await;
    let mut params = raw_params(4, 4096, 1 << 20);
    params.flags = params.flags | Flags::RENDEZVOUS;
    let (mut peer, conn) = bench.hostile(RawOpts::new(params)).await;
    let server = collect(conn);
    let peer = blocking(move || {
        // 64 KiB at a made-up address under a made-up rkey: the server's READ must fail.
        let desc = RemoteMsg::encode(0x7f00_dead_0000, 64 << 10, 0x00de_ad42);
        let imm = peer.header(MsgKind::Rendezvous);
        peer.post_send_bytes(&desc, Some(imm));
        let done = peer.wait_until(Duration::from_secs(60), |p| p.disconnected());
        assert!(done, "no DISCONNECTED within 60 s; saw {:?}", peer.log);
        peer
    })
    .await;
    let (msgs, end, _, conn) = within(60, "server", server).await.expect("server task");
    println!("a lying descriptor: server recv() -> {end:?}");
    assert!(msgs.is_empty(), "nothing delivered");
    assert!(
        matches!(&end, Err(Error::QpFailed(QpFailure::WorkCompletion { .. }))),
        "the failed READ's status: {end:?}"
    );
    drop(conn);
    blocking(move || drop(peer)).await;
    bench.survived("a lying rendezvous descriptor").await;
}
