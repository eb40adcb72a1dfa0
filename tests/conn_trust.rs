//! Device tests of what a connection promises under misuse: many concurrent senders with sends
//! cancelled at random points, receives dropped at random points, a reader that stops reading,
//! and a user who holds every buffer of the connection's pool. Each test checks every byte.
#![allow(clippy::print_stdout)]

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::within;
use tokio_rdma::conn::{ConnectOptions, Connection, Listener};

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([192, 0, 2, 1], port))
}

/// A self-describing message: sender, sequence number, length, then bytes derived from them,
/// ending with a checksum of everything before it.
fn make(sender: u32, seq: u32, len: usize) -> Vec<u8> {
    let len = len.max(16);
    let mut v = Vec::with_capacity(len);
    v.extend_from_slice(&sender.to_le_bytes());
    v.extend_from_slice(&seq.to_le_bytes());
    v.extend_from_slice(&(len as u32).to_le_bytes());
    let mut x = u64::from(sender) << 32 | u64::from(seq) | 1;
    while v.len() < len - 4 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.push(x as u8);
    }
    let sum = checksum(&v);
    v.extend_from_slice(&sum.to_le_bytes());
    v
}

fn checksum(b: &[u8]) -> u32 {
    b.iter().fold(0x811c_9dc5u32, |h, &x| {
        (h ^ u32::from(x)).wrapping_mul(0x0100_0193)
    })
}

/// Checks a message made by [`make`]; returns (sender, seq).
fn verify(m: &[u8]) -> (u32, u32) {
    assert!(m.len() >= 16, "a message of {} bytes is too short", m.len());
    let word = |at: usize| u32::from_le_bytes(m[at..at + 4].try_into().unwrap());
    let (sender, seq, len) = (word(0), word(4), word(8) as usize);
    assert_eq!(len, m.len(), "message {sender}/{seq}: length field");
    assert_eq!(
        word(len - 4),
        checksum(&m[..len - 4]),
        "message {sender}/{seq}: checksum (corrupt or mixed with another message)"
    );
    assert!(
        m == make(sender, seq, len).as_slice(),
        "message {sender}/{seq}: bytes"
    );
    (sender, seq)
}

fn small_chunks() -> ConnectOptions {
    // Small receive buffers and few credits: every large message is many chunks, and flow
    // control is exercised constantly.
    ConnectOptions::default()
        .recv_credits(4)
        .recv_buf_size(4096)
        .max_message_size(1 << 20)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn concurrent_senders_and_cancelled_sends_never_corrupt_a_message() {
    common::init_tracing();
    const SENDERS: u32 = 4;
    const PER_SENDER: u32 = 40;
    let listener = Listener::bind_with(addr(7101), small_chunks())
        .await
        .expect("bind");
    let server = tokio::spawn(async move {
        let conn = listener.accept().await.expect("accept");
        let mut next = [0u32; SENDERS as usize + 1];
        let mut whole_cancelled = 0u32;
        let mut total = 0u32;
        let mut last_seen = false;
        while let Some(m) = conn.recv().await.expect("server recv") {
            let (sender, seq) = verify(&m);
            total += 1;
            if sender == 99 {
                last_seen = true;
                continue;
            }
            if sender == SENDERS {
                // The canceller's messages: any that arrive are whole (checked above) and in
                // order; most were cut off and must not appear at all.
                assert!(seq >= next[sender as usize], "canceller order");
                next[sender as usize] = seq + 1;
                whole_cancelled += 1;
            } else {
                assert_eq!(
                    seq, next[sender as usize],
                    "sender {sender}: in order, none lost"
                );
                next[sender as usize] += 1;
            }
        }
        assert!(
            last_seen,
            "the message sent after the cancellations arrived"
        );
        (next, whole_cancelled, total, conn.stats())
    });
    let conn = Arc::new(
        within(
            60,
            "connect",
            Connection::connect_with(addr(7101), small_chunks()),
        )
        .await
        .expect("connect"),
    );
    let mut tasks = tokio::task::JoinSet::new();
    for s in 0..SENDERS {
        let conn = conn.clone();
        tasks.spawn(async move {
            for seq in 0..PER_SENDER {
                // Mixed sizes: 16 B to ~200 KB (up to 50 chunks of 4 KiB).
                let len = match (s + seq) % 4 {
                    0 => 16,
                    1 => 3000,
                    2 => 40_000,
                    _ => 200_000 + seq as usize,
                };
                conn.send(&make(s, seq, len)).await.expect("send");
            }
        });
    }
    // The canceller: large sends abandoned after a random delay (mid-message, usually).
    let cancelled = Arc::new(AtomicU64::new(0));
    {
        let conn = conn.clone();
        let cancelled = cancelled.clone();
        tasks.spawn(async move {
            let mut x = 0x1234_5678u64;
            for seq in 0..60u32 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let delay = Duration::from_micros(x % 20_000);
                let msg = make(SENDERS, seq, 300_000);
                if tokio::time::timeout(delay, conn.send(&msg)).await.is_err() {
                    cancelled.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
    }
    while let Some(r) = within(600, "senders", tasks.join_next()).await {
        r.expect("sender task");
    }
    // Phase 2, the canceller alone: time one whole 300 KB send, then cut sends off at
    // fractions of that time, so most are cancelled part-way through their chunks.
    let t = Instant::now();
    conn.send(&make(SENDERS, 1000, 300_000))
        .await
        .expect("timed send");
    let whole = t.elapsed();
    for k in 0..30u32 {
        let cut = whole.mul_f64(f64::from(k % 10 + 1) / 12.0);
        let msg = make(SENDERS, 1001 + k, 300_000);
        if tokio::time::timeout(cut, conn.send(&msg)).await.is_err() {
            cancelled.fetch_add(1, Ordering::Relaxed);
        }
    }
    // The connection is still usable after all those cancellations.
    conn.send(&make(99, 0, 1000))
        .await
        .expect("send after cancellations");
    let conn = Arc::try_unwrap(conn).expect("sole owner");
    let stats = conn.stats();
    within(60, "close", conn.close()).await.expect("close");
    let (next, whole_cancelled, total, server_stats) =
        within(120, "server", server).await.expect("server task");
    println!(
        "{SENDERS} senders x {PER_SENDER} messages + 60 cancellable sends ({} cancelled, {whole_cancelled} arrived whole): server verified {total} messages; client aborts sent {}, server aborts received {}",
        cancelled.load(Ordering::Relaxed),
        stats.protocol.aborts_sent,
        server_stats.protocol.aborts_received
    );
    for (s, n) in next.iter().take(SENDERS as usize).enumerate() {
        assert_eq!(*n, PER_SENDER, "sender {s}: every message arrived");
    }
    assert!(
        stats.protocol.aborts_sent > 0,
        "the test cancelled some sends part-way (after their first chunk)"
    );
    assert_eq!(
        stats.protocol.aborts_sent, server_stats.protocol.aborts_received,
        "every abort reached the peer"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn receives_dropped_at_any_point_lose_and_duplicate_nothing() {
    const N: u32 = 400;
    let listener = Listener::bind_with(addr(7102), small_chunks())
        .await
        .expect("bind");
    let server = tokio::spawn(async move {
        let conn = listener.accept().await.expect("accept");
        for seq in 0..N {
            let len = if seq % 3 == 0 { 20_000 } else { 100 };
            conn.send(&make(1, seq, len)).await.expect("send");
        }
        let _ = conn.recv().await;
    });
    let conn = within(
        60,
        "connect",
        Connection::connect_with(addr(7102), small_chunks()),
    )
    .await
    .expect("connect");
    let mut next = 0u32;
    let mut dropped = 0u32;
    let mut x = 99u64;
    while next < N {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        // Give up on the receive after 0-2 ms, often while it waits for the next message.
        match tokio::time::timeout(Duration::from_micros(x % 2000), conn.recv()).await {
            Ok(m) => {
                let m = m.expect("recv").expect("not end of stream");
                let (_, seq) = verify(&m);
                assert_eq!(seq, next, "exactly once, in order");
                next += 1;
            }
            Err(_) => dropped += 1,
        }
    }
    println!(
        "{N} messages received exactly once in order; {dropped} receives dropped while waiting"
    );
    assert!(dropped > 0, "some receives were dropped");
    conn.close().await.expect("close");
    within(60, "server", server).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_reader_that_stops_reading_holds_the_sender_back_with_bounded_memory() {
    const MESSAGES: u32 = 40;
    let budget: u64 = 4 << 20;
    let opts = ConnectOptions::default()
        .recv_credits(8)
        .recv_buf_size(64 << 10)
        .max_message_size(1 << 20)
        .recv_budget(budget);
    let listener = Listener::bind_with(addr(7103), opts.clone())
        .await
        .expect("bind");
    let sent = Arc::new(AtomicU64::new(0));
    let client = {
        let sent = sent.clone();
        let opts = opts.clone();
        tokio::spawn(async move {
            let conn = Connection::connect_with(addr(7103), opts)
                .await
                .expect("connect");
            // As fast as flow control allows: 1 MiB messages (16 chunks each), ten times the
            // receive budget in all (200 took 111 s of the test run, for nothing more).
            for seq in 0..MESSAGES {
                match conn.send(&make(7, seq, 1 << 20)).await {
                    Ok(()) => sent.fetch_add(1, Ordering::Relaxed),
                    Err(e) => panic!("send {seq}: {e}"),
                };
            }
            conn.close().await.expect("close");
        })
    };
    let conn = listener.accept().await.expect("accept");
    let rss_start = common::rss_bytes();
    // Do not read for 8 s; sample memory and progress.
    let mut held_max = 0;
    for _ in 0..16 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        held_max = held_max.max(conn.stats().recv_bytes_held);
    }
    let stalled_sent = sent.load(Ordering::Relaxed);
    let rss_stalled = common::rss_bytes();
    println!(
        "reader stalled 8 s: sender completed {stalled_sent} MiB messages; receiver holds at most {held_max} bytes (budget {budget}); RSS {} -> {} MiB",
        rss_start >> 20,
        rss_stalled >> 20
    );
    assert!(
        held_max <= budget + (1 << 20),
        "held {held_max} bytes: over the budget"
    );
    assert!(
        stalled_sent <= 8,
        "the sender was held back ({stalled_sent} messages)"
    );
    assert!(
        rss_stalled < rss_start + (64 << 20),
        "memory grew while the reader stalled"
    );
    // Resume: everything arrives, intact and in order.
    let started = Instant::now();
    let mut next = 0;
    while let Some(m) = within(300, "recv", conn.recv()).await.expect("recv") {
        let (_, seq) = verify(&m);
        assert_eq!(seq, next);
        next += 1;
    }
    assert_eq!(next, MESSAGES, "every message arrived once reading resumed");
    println!(
        "after resuming: {MESSAGES} messages of 1 MiB verified in {:.1} s; withheld re-posts {}",
        started.elapsed().as_secs_f64(),
        conn.stats().protocol.reposts_withheld
    );
    within(120, "client", client).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_user_holding_the_whole_user_pool_never_stalls_messages() {
    let listener = Listener::bind(addr(7104)).await.expect("bind");
    let server = tokio::spawn(async move {
        let conn = listener.accept().await.expect("accept");
        while let Some(m) = conn.recv().await.expect("server recv") {
            conn.send(&m).await.expect("echo");
        }
    });
    let conn = within(60, "connect", Connection::connect(addr(7104)))
        .await
        .expect("connect");
    // Take every buffer of the user pool, in every size class.
    let pool = conn.pool().expect("pool");
    let mut hoard = Vec::new();
    for size in [4096usize, 65536] {
        while let Ok(Some(b)) = pool.try_acquire(size) {
            hoard.push(b);
        }
    }
    println!("holding {} user-pool buffers", hoard.len());
    assert!(!hoard.is_empty());
    for seq in 0..50u32 {
        let m = make(3, seq, if seq % 2 == 0 { 100 } else { 300_000 });
        within(60, "send while the pool is hoarded", conn.send(&m))
            .await
            .expect("send");
        let back = within(60, "echo", conn.recv()).await.unwrap().unwrap();
        assert_eq!(verify(&back), (3, seq));
    }
    drop(hoard);
    conn.close().await.expect("close");
    within(60, "server", server).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn one_sided_ops_that_cannot_succeed_fail_locally_and_the_connection_lives() {
    use tokio_rdma::buf::{RemoteAccess, RemoteToken};
    // The server offers one-sided access but not atomics.
    let listener = Listener::bind(addr(7105)).await.expect("bind");
    let server = tokio::spawn(async move {
        let conn = listener.accept().await.expect("accept");
        let buf = conn.pool().unwrap().acquire(4096).await.unwrap();
        // A grant for atomics this side never offered is refused here, not at the peer.
        let refused = conn.grant(vec![0u8; 64], 0..64, RemoteAccess::ATOMIC);
        assert!(refused.is_err(), "atomic grant without the offer");
        let grant = conn.grant(buf, 0..4096, RemoteAccess::READ).expect("grant");
        conn.send(&grant.token().to_bytes()).await.unwrap();
        while let Some(m) = conn.recv().await.expect("server recv") {
            conn.send(&m).await.expect("echo");
        }
        drop(grant);
    });
    let conn = within(60, "connect", Connection::connect(addr(7105)))
        .await
        .expect("connect");
    let token = RemoteToken::from_bytes(&conn.recv().await.unwrap().unwrap()).unwrap();
    let pool = conn.pool().unwrap();
    // Atomics were not offered by the peer: refused before posting.
    let (res, _) = conn
        .fetch_add(
            pool.acquire(8).await.unwrap(),
            token.slice(0..8).unwrap(),
            1,
        )
        .await;
    let err = res.expect_err("fetch_add without atomics");
    println!("fetch_add without the peer's offer: {err}");
    assert!(
        matches!(err, tokio_rdma::Error::InvalidArgument(_)),
        "{err}"
    );
    // Longer than the token: refused before posting.
    let (res, _) = conn.read(pool.acquire(8192).await.unwrap(), token).await;
    let err = res.expect_err("read past the token");
    println!("read past the token: {err}");
    // The connection is untouched: a read within bounds and messages still work.
    let (res, _) = conn.read(pool.acquire(4096).await.unwrap(), token).await;
    res.expect("read within bounds");
    conn.send(b"still alive").await.expect("send");
    assert_eq!(&conn.recv().await.unwrap().unwrap()[..], b"still alive");
    assert!(conn.failure().is_none());
    conn.close().await.expect("close");
    within(60, "server", server).await.unwrap();
}

/// Dropped messages are reported to the connection's state machine lazily (at its next look)
/// unless it needs the report now: receives withheld because the application holds its
/// receive budget, or a rendezvous message waiting for room in it. Here the application holds
/// messages in batches that use the whole budget, and drops them on another thread, all at
/// once, while the connection receives: every report the peer's credits wait on must come
/// through, or the sender stalls for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn messages_held_to_the_budget_and_dropped_on_another_thread_keep_the_peer_going() {
    const N: u32 = 1_500;
    // Every fifth message a multi-chunk one (reassembled), every 97th by rendezvous.
    let len = |seq: u32| match seq {
        s if s % 97 == 0 => 300_000,
        s if s % 5 == 0 => 20_000,
        _ => 100,
    };
    // No keepalive: its messages are looks at the state too, which would hide a lost report
    // sooner.
    let opts = || small_chunks().recv_budget(64 << 10).keepalive(None);
    let listener = Listener::bind_with(addr(7110), opts()).await.expect("bind");
    let server = tokio::spawn(async move {
        let conn = listener.accept().await.expect("accept");
        for seq in 0..N {
            let m = bytes::Bytes::from(make(1, seq, len(seq)));
            within(60, "send", conn.send_bytes(m)).await.expect("send");
        }
        conn.close().await.expect("close");
    });
    let conn = within(60, "connect", Connection::connect_with(addr(7110), opts()))
        .await
        .expect("connect");
    // The holder: keeps 1-6 messages, then drops them at once. With 4 credits and 64 KiB of
    // budget, it often holds all the connection can deliver: then no more come, and it drops
    // what it has once none came for 3 ms (a rendezvous message waits until it held none).
    let (tx, rx) = std::sync::mpsc::channel::<tokio_rdma::conn::Message>();
    let holder = std::thread::spawn(move || {
        use std::sync::mpsc::RecvTimeoutError;
        let mut held = Vec::new();
        let mut x = 7u64;
        let mut batch = 1;
        loop {
            match rx.recv_timeout(Duration::from_millis(3)) {
                Ok(m) => held.push(m),
                Err(RecvTimeoutError::Timeout) => batch = 0,
                Err(RecvTimeoutError::Disconnected) => break,
            }
            if held.len() >= batch {
                held.clear();
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                batch = 1 + (x % 6) as usize;
            }
        }
    });
    // A report lost while urgent leaves the peer without credits until some later look at
    // the state (a timer's): a mutant that never reported took 243-420 s here, against
    // 10-30 s for the real code in the VM.
    let started = Instant::now();
    let next = within(
        180,
        "all messages (a lost drop report stalls the peer)",
        async {
            let mut next = 0u32;
            while let Some(m) = conn.recv().await.expect("recv") {
                let (_, seq) = verify(&m);
                assert_eq!(seq, next, "exactly once, in order");
                next += 1;
                tx.send(m).expect("holder alive");
            }
            next
        },
    )
    .await;
    drop(tx);
    holder.join().expect("holder");
    assert_eq!(next, N, "every message arrived");
    let withheld = conn.stats().protocol.reposts_withheld;
    println!(
        "{N} messages in {:.1} s, held in batches and dropped on another thread; withheld \
         re-posts {withheld}",
        started.elapsed().as_secs_f64()
    );
    assert!(
        withheld > 0,
        "the budget was used up (the urgent reports ran)"
    );
    within(60, "server", server).await.unwrap();
}
