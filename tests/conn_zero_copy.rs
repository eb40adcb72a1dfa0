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
    let mrs_before = common::mr_count();
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
    let mrs = common::mr_count();
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

/// Anonymous memory mapped by the test (at a chosen address, or anywhere), unmapped on drop:
/// what the allocator does with a large `Vec` behind a `Bytes`.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; nothing else refers to it.
unsafe impl Send for Mapping {}
// SAFETY: shared access only reads it.
unsafe impl Sync for Mapping {}

impl Mapping {
    fn new(at: Option<usize>, contents: &[u8]) -> Mapping {
        let len = contents.len();
        let flags =
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | at.map_or(0, |_| libc::MAP_FIXED_NOREPLACE);
        let hint = at.unwrap_or(0) as *mut libc::c_void;
        // SAFETY: a new private anonymous mapping; MAP_FIXED_NOREPLACE never replaces one.
        let ptr =
            unsafe { libc::mmap(hint, len, libc::PROT_READ | libc::PROT_WRITE, flags, -1, 0) };
        assert_ne!(
            ptr,
            libc::MAP_FAILED,
            "mmap: {}",
            std::io::Error::last_os_error()
        );
        let ptr = ptr.cast::<u8>();
        if let Some(at) = at {
            assert_eq!(ptr as usize, at, "mapped again at the same address");
        }
        // SAFETY: `len` writable bytes were just mapped at `ptr`; `contents` is elsewhere.
        unsafe { std::ptr::copy_nonoverlapping(contents.as_ptr(), ptr, len) };
        Mapping { ptr, len }
    }
}

impl AsRef<[u8]> for Mapping {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `len` initialised bytes are mapped at `ptr` while `self` lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: this value's own mapping; no reference to it outlives `self`.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Issue 22 §4: the safe "register once, send many times" of the application's own memory.
/// On 61ac8ac the only zero-copy path for such memory was the address-keyed registration
/// cache, whose registration outlived the `Bytes` that `send_bytes` dropped; memory mapped
/// at that address later was then sent from the old pages (the next test shows it). Here
/// the registration owns the bytes: sends from it are zero-copy, a registration dropped under
/// a send in flight stays until the device read the bytes, and once everything is dropped
/// and other memory is mapped at the same address, its bytes (not the old ones) are sent.
#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn registered_bytes_own_their_memory_and_a_reused_address_sends_its_new_bytes() {
    common::init_tracing();
    let ep = Endpoint::open(&common::device_name()).expect("endpoint");
    let (client, server) = pair(&ep, 7446).await;
    let mrs_before = common::mr_count();
    let first = common::pattern(BIG, 21);
    let map = Mapping::new(None, &first);
    let at = map.ptr as usize;
    let bytes = Bytes::from_owner(map);
    let reg = client
        .register_bytes(bytes.clone())
        .expect("register_bytes");
    assert_eq!(common::mr_count(), mrs_before + 1, "one registration");

    // Through the caller's own `Bytes` and through the registration's: no copy.
    let before = client.stats();
    let (r, ()) = tokio::join!(
        client.send_bytes(bytes.slice(..SMALL)),
        recv_exact(&server, &first[..SMALL], "own bytes")
    );
    r.expect("send");
    let (r, ()) = tokio::join!(
        client.send_bytes(reg.slice(BIG - SMALL..)),
        recv_exact(&server, &first[BIG - SMALL..], "registration's bytes")
    );
    r.expect("send");
    assert_eq!(sent(&before, &client.stats()), (2 * SMALL as u64, 0));

    // The registration dropped while a 1 MiB send (16 chunks) is in flight: the send keeps
    // it until the device read every chunk.
    let before = client.stats();
    let send = client.send_bytes(bytes.slice(..));
    let recv = async {
        drop(reg);
        recv_exact(&server, &first, "registration dropped under the send").await
    };
    let (r, ()) = tokio::join!(send, recv);
    r.expect("send");
    assert_eq!(sent(&before, &client.stats()), (BIG as u64, 0));

    // Everything dropped: deregistered, then unmapped; other memory at the same address.
    drop(bytes);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while common::mr_count() > mrs_before && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        common::mr_count(),
        mrs_before,
        "the registration went with the last handle"
    );
    let second = common::pattern(BIG, 22);
    let again = Bytes::from_owner(Mapping::new(Some(at), &second));
    let before = client.stats();
    let (r, ()) = tokio::join!(
        client.send_bytes(again.slice(..SMALL)),
        recv_exact(&server, &second[..SMALL], "new memory at the old address")
    );
    r.expect("send");
    assert_eq!(
        sent(&before, &client.stats()),
        (0, SMALL as u64),
        "no registration of the old memory is used: copied"
    );
    assert!(matches!(
        client.register_bytes(Bytes::new()),
        Err(tokio_rdma::Error::InvalidArgument(_))
    ));
    drop((client, server));
}

/// Why the registration cache is `unsafe` (and why its docs say to keep every `Bytes` sent):
/// a registration pins the pages mapped when it was made, so once the memory is unmapped and
/// other memory is mapped at the same address, a cache hit sends the OLD pages' bytes. This
/// is the hazard the cache's contract forbids, shown on purpose; `register_bytes` above
/// cannot reach it.
#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn the_registration_cache_contract_is_needed_a_remapped_address_sends_old_pages() {
    common::init_tracing();
    let ep = Endpoint::open(&common::device_name()).expect("endpoint");
    let (client, server) = pair(&ep, 7447).await;
    // SAFETY: deliberately broken below, to show what the contract prevents; the device
    // only reads the old pages, which the cached registration keeps pinned.
    let cache = unsafe { client.registration_cache(tokio_rdma::buf::CacheConfig::default()) };
    let first = common::pattern(SMALL, 31);
    let map = Mapping::new(None, &first);
    let at = map.ptr as usize;
    let (r, ()) = tokio::join!(
        client.send_bytes(Bytes::from_owner(map)),
        recv_exact(&server, &first, "first memory")
    );
    r.expect("send");
    // Once the send's completion retires it, send_bytes drops the last handle: the memory
    // is unmapped, its registration stays cached.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while cache.metrics().bytes_in_use > 0 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(cache.metrics().bytes_in_use, 0, "the send was retired");
    let second = common::pattern(SMALL, 32);
    let again = Bytes::from_owner(Mapping::new(Some(at), &second));
    let (r, got) = tokio::join!(client.send_bytes(again), server.recv());
    r.expect("send");
    let got = got.expect("recv").expect("a message");
    let m = cache.metrics();
    println!(
        "after the remap: cache {m:?}; the peer got the old bytes: {}",
        got[..] == first[..]
    );
    assert_eq!(m.hits, 1, "the second send hit the stale entry");
    assert!(
        got[..] == first[..],
        "the old pages were sent, not the new memory"
    );
    drop((client, server));
}
