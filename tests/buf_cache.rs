//! Device tests of the registration cache on soft-RoCE: repeated lookups register once, a
//! 1 GiB buffer used in 4 KiB slices registers once, leases keep evicted registrations alive
//! for operations in flight, read-only memory is sent, and `RLIMIT_MEMLOCK` exhaustion is
//! reported by name.

#![allow(clippy::print_stdout)]

mod common;

use common::{Pair, connected_pair, pattern, poll_one};
use tokio_rdma::buf::{CacheConfig, RegCache};
use tokio_rdma::verbs::{AccessFlags, RecvWr, RegisteredBuffer, SendOp, SendWr, Sge};

fn cache(p: &Pair, config: CacheConfig) -> RegCache {
    // SAFETY: the tests invalidate or keep alive every buffer they look up while the cache
    // lives; none is unmapped or reallocated meanwhile.
    unsafe { RegCache::with_pd(&p.pd, config) }
}

/// Sends `len` bytes at `ptr` (covered by `lkey`) from `a` to `b` and returns what `b` got.
fn send_through(p: &Pair, ptr: *const u8, len: usize, lkey: u32) -> Vec<u8> {
    let rx = RegisteredBuffer::new(&p.pd, len, AccessFlags::LOCAL_WRITE).unwrap();
    let rsge = [rx.sge(0..len)];
    let tsge = [Sge::new(ptr as u64, len as u32, lkey)];
    // SAFETY: the caller keeps the memory alive until this returns; `rx` outlives the recv.
    unsafe {
        p.b.qp.post_recv(&[RecvWr::new(1, &rsge)]).unwrap();
        p.a.qp
            .post_send(&[SendWr::new(1, SendOp::Send, &tsge)])
            .unwrap();
    }
    poll_one(&p.a.cq).result().unwrap();
    poll_one(&p.b.cq).result().unwrap();
    rx.to_vec()
}

#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn repeated_lookups_of_a_user_buffer_register_once() {
    let p = connected_pair(AccessFlags::NONE);
    let c = cache(&p, CacheConfig::default());
    let data = pattern(64 << 10, 2);
    for round in 0..10 {
        let lease = c.lookup_or_register(data.as_ptr(), data.len()).unwrap();
        if round % 3 == 0 {
            assert_eq!(
                send_through(&p, data.as_ptr(), data.len(), lease.lkey()),
                data
            );
        }
    }
    let m = c.metrics();
    println!("after 10 lookups: {m:?}");
    assert_eq!((m.registrations, m.misses, m.hits), (1, 1, 9));
    assert_eq!(c.invalidate(data.as_ptr(), data.len()), 1);
}

#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn one_gib_buffer_in_4k_slices_registers_once() {
    const GIB: usize = 1 << 30;
    const SLICE: usize = 4096;
    let p = connected_pair(AccessFlags::NONE);
    let c = cache(
        &p,
        CacheConfig::default()
            .max_bytes(2 << 30)
            .whole_mappings(Some(2 << 30)),
    );
    let mut big = vec![0u8; GIB];
    for (i, chunk) in big
        .chunks_mut(SLICE)
        .enumerate()
        .filter(|(i, _)| i % 4099 == 0)
    {
        chunk.copy_from_slice(&pattern(SLICE, i as u8));
    }
    let t = std::time::Instant::now();
    let mut lkeys = std::collections::HashSet::new();
    for off in (0..GIB).step_by(SLICE) {
        let lease = c.lookup_or_register(big[off..].as_ptr(), SLICE).unwrap();
        lkeys.insert(lease.lkey());
    }
    let m = c.metrics();
    println!(
        "1 GiB in {} slices: {m:?} in {:?}",
        GIB / SLICE,
        t.elapsed()
    );
    assert_eq!(m.registrations, 1, "registered once");
    assert_eq!((m.misses, m.hits), (1, (GIB / SLICE) as u64 - 1));
    assert_eq!(lkeys.len(), 1);
    assert!(m.bytes_registered >= GIB as u64);
    // Slices really work with the lease's key: send some, receive into one.
    for i in [0usize, 4099, 4099 * 63] {
        let off = i * SLICE;
        let lease = c.lookup_or_register(big[off..].as_ptr(), SLICE).unwrap();
        let got = send_through(&p, big[off..].as_ptr(), SLICE, lease.lkey());
        assert_eq!(got, pattern(SLICE, i as u8), "slice {i}");
    }
    let last = GIB - SLICE;
    let lease = c.lookup_or_register(big[last..].as_ptr(), SLICE).unwrap();
    assert!(lease.is_writable());
    let mut src = RegisteredBuffer::new(&p.pd, SLICE, AccessFlags::LOCAL_WRITE).unwrap();
    src.write_at(0, &pattern(SLICE, 77));
    let rsge = [Sge::new(
        big[last..].as_ptr() as u64,
        SLICE as u32,
        lease.lkey(),
    )];
    let tsge = [src.sge(0..SLICE)];
    // SAFETY: `big` and `src` outlive the completions polled right below.
    unsafe {
        p.b.qp.post_recv(&[RecvWr::new(2, &rsge)]).unwrap();
        p.a.qp
            .post_send(&[SendWr::new(2, SendOp::Send, &tsge)])
            .unwrap();
    }
    poll_one(&p.a.cq).result().unwrap();
    poll_one(&p.b.cq).result().unwrap();
    assert_eq!(
        &big[last..],
        &pattern(SLICE, 77)[..],
        "received into the last slice"
    );
    assert_eq!(c.metrics().registrations, 1);
    drop(lease);
    c.invalidate(big.as_ptr(), big.len());
    drop(big);
}

#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn eviction_does_not_deregister_a_region_in_flight() {
    let p = connected_pair(AccessFlags::NONE);
    let c = cache(&p, CacheConfig::default().max_bytes(64 << 10));
    let a = pattern(64 << 10, 1);
    let lease = c.lookup_or_register(a.as_ptr(), a.len()).unwrap();
    let rx = RegisteredBuffer::new(&p.pd, a.len(), AccessFlags::LOCAL_WRITE).unwrap();
    let rsge = [rx.sge(0..a.len())];
    let tsge = [Sge::new(a.as_ptr() as u64, a.len() as u32, lease.lkey())];
    // SAFETY: `a` (leased) and `rx` outlive the completions polled below.
    unsafe {
        p.b.qp.post_recv(&[RecvWr::new(1, &rsge)]).unwrap();
        p.a.qp
            .post_send(&[SendWr::new(1, SendOp::Send, &tsge)])
            .unwrap();
    }
    // While the send may be in flight, another buffer pushes `a` out of the cache.
    let b = vec![3u8; 64 << 10];
    let _other = c.lookup_or_register(b.as_ptr(), b.len()).unwrap();
    let m = c.metrics();
    assert!(m.evictions >= 1, "{m:?}");
    assert!(
        m.bytes_in_use >= a.len() as u64,
        "the leased region is still registered: {m:?}"
    );
    poll_one(&p.a.cq).result().unwrap();
    poll_one(&p.b.cq).result().unwrap();
    assert_eq!(rx.to_vec(), a);
    drop(lease);
    c.clear();
}

static GREETING: &[u8] = b"read-only memory in .rodata, registered without LOCAL_WRITE";

#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn read_only_bytes_are_sent() {
    let p = connected_pair(AccessFlags::NONE);
    let c = cache(&p, CacheConfig::default());
    let msg = bytes::Bytes::from_static(GREETING);
    let lease = c.lookup_or_register(msg.as_ptr(), msg.len()).unwrap();
    assert!(!lease.is_writable());
    assert_eq!(
        send_through(&p, msg.as_ptr(), msg.len(), lease.lkey()),
        GREETING
    );
}

const CHILD_ENV: &str = "TOKIO_RDMA_MEMLOCK_CHILD";

#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn memlock_exhaustion_names_the_limit() {
    // Root has CAP_IPC_LOCK, which bypasses the limit: run the registration in a child that
    // lowers RLIMIT_MEMLOCK and drops to an unprivileged user.
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "memlock_child", "--nocapture"])
        .env(CHILD_ENV, "1")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    println!("{text}");
    assert!(out.status.success(), "child failed");
    assert!(text.contains("memlock error: ibv_reg_mr of"), "{text}");
    assert!(text.contains("RLIMIT_MEMLOCK"), "{text}");
}

#[test]
#[ignore = "helper of memlock_exhaustion_names_the_limit (runs only in its child process)"]
fn memlock_child() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let lim = libc::rlimit {
        rlim_cur: 64 << 10,
        rlim_max: 64 << 10,
    };
    // SAFETY: plain libc calls with valid arguments; this child process exits after the test.
    unsafe {
        assert_eq!(libc::setrlimit(libc::RLIMIT_MEMLOCK, &lim), 0);
        if libc::geteuid() == 0 {
            assert_eq!(libc::setgid(65534), 0);
            assert_eq!(libc::setuid(65534), 0);
        }
    }
    let p = connected_pair(AccessFlags::NONE);
    let c = cache(&p, CacheConfig::default());
    let big = vec![1u8; 4 << 20];
    let err = c.lookup_or_register(big.as_ptr(), big.len()).unwrap_err();
    println!("memlock error: {err}");
    assert!(
        matches!(
            err,
            tokio_rdma::Error::MemlockExhausted { limit: 65536, .. }
        ),
        "{err:?}"
    );
    assert_eq!(c.metrics().registration_failures, 1);
}
