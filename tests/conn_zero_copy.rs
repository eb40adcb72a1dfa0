//! Device tests of zero-copy message sends: a buffer of the connection's pool and a forwarded
//! received message go to the peer without being copied (counted), while plain memory, heap
//! `Bytes` and a buffer registered for ANOTHER connection are copied (that connection's lkey
//! means nothing on this queue pair). The data arrives intact every time, and the buffers go
//! back to their pools once the device has read them.
#![allow(clippy::print_stdout)]

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use common::within;
use tokio_rdma::Endpoint;
use tokio_rdma::buf::{PoolConfig, SizeClass};
use tokio_rdma::conn::{ConnStats, ConnectOptions, Connection};

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([192, 0, 2, 1], port))
}

const BIG: usize = 1 << 20;
const SMALL: usize = 32 << 10;

/// Rendezvous off: these are the chunked paths (tests/conn_rendezvous.rs has the other).
fn opts() -> ConnectOptions {
    ConnectOptions::default()
        .rendezvous_threshold(None)
        .recv_buf_size(64 << 10)
        .user_pool(PoolConfig::default().classes([SizeClass::new(BIG, 4)]))
}

async fn pair(ep: &Endpoint, port: u16) -> (Connection, Connection) {
    let listener = ep.listen_with(addr(port), opts()).await.expect("listen");
    let (c, s) = tokio::join!(ep.connect(addr(port), opts()), listener.accept());
    (c.expect("connect"), s.expect("accept"))
}

async fn recv_exact(conn: &Connection, want: &[u8], what: &str) {
    let got = within(60, what, conn.recv())
        .await
        .expect("recv")
        .expect("a message");
    assert_eq!(got.len(), want.len(), "{what}: length");
    assert!(&got[..] == want, "{what}: bytes differ");
}

fn sent(a: &ConnStats, b: &ConnStats) -> (u64, u64) {
    (
        b.send_bytes_zero_copy - a.send_bytes_zero_copy,
        b.send_bytes_copied - a.send_bytes_copied,
    )
}

#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn registered_bytes_go_without_copying_and_everything_else_is_copied() {
    common::init_tracing();
    let ep = Endpoint::open(&common::device_name()).expect("endpoint");
    let (client, server) = pair(&ep, 7411).await;
    let pattern = common::pattern(BIG, 7);

    // 1. A 1 MiB buffer of the connection's pool (16 chunks): zero copies.
    let before = client.stats();
    let mut buf = client.pool().unwrap().acquire(BIG).await.unwrap();
    buf.set_len(BIG);
    buf.copy_from_slice(&pattern);
    let (sent_res, ()) = tokio::join!(
        client.send_buf(buf),
        recv_exact(&server, &pattern, "pool buffer")
    );
    sent_res.expect("send_buf");
    let (zc, copied) = sent(&before, &client.stats());
    println!("pool buffer of {BIG} B: zero-copy {zc} B, copied {copied} B");
    assert_eq!((zc, copied), (BIG as u64, 0));

    // The buffer returns to the pool once its last chunk's completion is seen.
    let pool = client.pool().unwrap();
    for _ in 0..200 {
        if pool.metrics().buffers_in_use == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        pool.metrics().buffers_in_use,
        0,
        "the sent buffer came back"
    );

    // 2. The same bytes from plain memory and from heap `Bytes`: copied.
    let before = client.stats();
    let (r, ()) = tokio::join!(
        client.send(&pattern),
        recv_exact(&server, &pattern, "slice")
    );
    r.expect("send");
    let heap = Bytes::from(pattern.clone());
    let (r, ()) = tokio::join!(
        client.send_bytes(heap),
        recv_exact(&server, &pattern, "heap bytes")
    );
    r.expect("send_bytes of heap bytes");
    let (zc, copied) = sent(&before, &client.stats());
    println!("slice and heap Bytes: zero-copy {zc} B, copied {copied} B");
    assert_eq!((zc, copied), (0, 2 * BIG as u64));

    // 3. The server forwards a received single-chunk message (its receive buffer, registered
    // in the server connection's domain): zero copies; the client gets it intact.
    let small = &pattern[..SMALL];
    let before = server.stats();
    client.send(small).await.expect("send small");
    let msg = within(60, "small", server.recv())
        .await
        .unwrap()
        .expect("message");
    let (r, ()) = tokio::join!(
        server.send_bytes(msg.into_bytes()),
        recv_exact(&client, small, "forwarded")
    );
    r.expect("forward");
    let (zc, copied) = sent(&before, &server.stats());
    println!("forwarded message of {SMALL} B: zero-copy {zc} B, copied {copied} B");
    assert_eq!((zc, copied), (SMALL as u64, 0));

    // 4. A buffer of ANOTHER connection's pool: its lkey belongs to another protection domain,
    // so it must be copied (sent from it, the device would fail the queue pair).
    let (other, other_peer) = pair(&ep, 7412).await;
    let mut foreign = other.pool().unwrap().acquire(BIG).await.unwrap();
    foreign.set_len(BIG);
    foreign.copy_from_slice(&pattern);
    let before = client.stats();
    let (r, ()) = tokio::join!(
        client.send_buf(foreign),
        recv_exact(&server, &pattern, "foreign buffer")
    );
    r.expect("send_buf of a foreign buffer");
    let (zc, copied) = sent(&before, &client.stats());
    println!("another connection's buffer: zero-copy {zc} B, copied {copied} B");
    assert_eq!((zc, copied), (0, BIG as u64));
    assert!(client.failure().is_none());

    for c in [client, server, other, other_peer] {
        within(30, "close", c.close()).await.expect("close");
    }
}

#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_registration_cache_lease_sends_any_memory_without_copying() {
    common::init_tracing();
    let ep = Endpoint::open(&common::device_name()).expect("endpoint");
    let (client, server) = pair(&ep, 7445).await;
    // Long-lived memory outside every pool (leaked: never unmapped while cached).
    let arena: &'static mut [u8] = Box::leak(common::pattern(2 * BIG, 9).into_boxed_slice());
    let arena: &'static [u8] = arena;
    let mrs_before = common::resource_counts().get("mr").copied().unwrap_or(0);
    // SAFETY: `arena` is never unmapped or remapped.
    let cache = unsafe { client.registration_cache(tokio_rdma::buf::CacheConfig::default()) };
    let before = client.stats();
    for (what, range) in [
        ("miss", 0..BIG),
        ("hit", 4096..4096 + SMALL),
        ("second half", BIG..2 * BIG),
    ] {
        let bytes = Bytes::from_static(&arena[range.clone()]);
        let (r, ()) = tokio::join!(
            client.send_bytes(bytes),
            recv_exact(&server, &arena[range], what)
        );
        r.expect("send_bytes under a lease");
    }
    let (zc, copied) = sent(&before, &client.stats());
    println!(
        "leased sends: {zc} bytes zero-copy, {copied} copied; cache {:?}",
        cache.metrics()
    );
    assert_eq!(
        (zc, copied),
        ((2 * BIG + SMALL) as u64, 0),
        "nothing copied"
    );
    let m = cache.metrics();
    assert!(m.hits >= 1 && m.misses >= 1, "{m:?}");
    let mrs = common::resource_counts().get("mr").copied().unwrap_or(0);
    assert!(
        mrs > mrs_before,
        "the arena is registered ({mrs_before} -> {mrs})"
    );
    // Small messages still go inline.
    let before = client.stats();
    let (r, ()) = tokio::join!(
        client.send_bytes(Bytes::from_static(&arena[..16])),
        recv_exact(&server, &arena[..16], "inline")
    );
    r.expect("inline");
    assert_eq!(
        client.stats().send_bytes_inline - before.send_bytes_inline,
        16
    );
    drop((client, server));
    tokio::time::sleep(Duration::from_millis(200)).await;
}
