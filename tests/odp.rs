//! Device tests of on-demand paging (ODP) on rxe.
//!
//! Two groups, for two kernels (`scripts/test` runs each in its own VM boot):
//! * `odp_*`: need rxe with ODP (Linux 6.14+; `scripts/rxe-vm --kernel 6.19`): one-sided
//!   access by a peer into ODP grants over pages never touched, dropped with `MADV_DONTNEED`,
//!   file-backed, and re-mapped at the same address; an access to an unmapped page; locked
//!   memory after registering 1 GiB; an on-demand pool and registration cache.
//! * `capability_error_without_odp`: the default 6.1 kernel, whose rxe has no ODP: the same API fails with
//!   the capability error.
#![allow(clippy::print_stdout)]

mod common;

use std::net::SocketAddr;
use std::ptr::NonNull;

use common::within;
use tokio_rdma::buf::{
    CacheConfig, IoBuf, IoBufMut, PoolConfig, RemoteAccess, RemoteToken, SizeClass,
};
use tokio_rdma::conn::{ConnectOptions, Connection, Listener};
use tokio_rdma::verbs::{
    AccessFlags, MemoryRegion, Mtu, OdpMissing, OdpOps, Prefetch, ProtectionDomain,
    RegisteredBuffer,
};
use tokio_rdma::{Endpoint, Error};

const PAGE: usize = 4096;
/// Transfers are cut into pieces of the largest default pool class.
const CHUNK: usize = 64 << 10;

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([192, 0, 2, 1], port))
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

/// `kB` value of a line of /proc/self/status (VmPin, VmLck, VmRSS).
fn status_kb(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("{field} not in /proc/self/status"))
}

/// A mapping this test manages itself (anonymous or of a file), as a buffer a grant can take.
/// It does not unmap on drop: the tests unmap and re-map it explicitly.
struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the pointer is a process mapping, valid from any thread.
unsafe impl Send for Mapping {}

impl Mapping {
    /// `len` bytes of fresh anonymous memory (never touched: no page is allocated yet), at
    /// `at` if given (`MAP_FIXED`: replaces what is there).
    fn anon(len: usize, at: Option<NonNull<u8>>) -> Mapping {
        let (hint, fixed) = match at {
            Some(p) => (p.as_ptr().cast(), libc::MAP_FIXED),
            None => (std::ptr::null_mut(), 0),
        };
        // SAFETY: a fresh private anonymous mapping (or, with MAP_FIXED, one replacing the test's
        // own mapping at `at`); no Rust reference points into it.
        let p = unsafe {
            libc::mmap(
                hint,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | fixed,
                -1,
                0,
            )
        };
        assert_ne!(
            p,
            libc::MAP_FAILED,
            "mmap: {}",
            std::io::Error::last_os_error()
        );
        Mapping {
            ptr: NonNull::new(p.cast()).unwrap(),
            len,
        }
    }

    /// `len` bytes of a shared mapping of `fd`.
    fn file(fd: libc::c_int, len: usize) -> Mapping {
        // SAFETY: a shared mapping of the test's own memfd, at an address the kernel picks.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        assert_ne!(
            p,
            libc::MAP_FAILED,
            "mmap: {}",
            std::io::Error::last_os_error()
        );
        Mapping {
            ptr: NonNull::new(p.cast()).unwrap(),
            len,
        }
    }

    /// Another handle to the same addresses (the grant takes one, the test keeps one).
    fn alias(&self) -> Mapping {
        Mapping {
            ptr: self.ptr,
            len: self.len,
        }
    }

    fn write(&self, offset: usize, data: &[u8]) {
        assert!(offset + data.len() <= self.len);
        for (i, b) in data.iter().enumerate() {
            // SAFETY: in bounds (asserted) of a mapping of `len` bytes; volatile byte writes create
            // no references, so the device writing it meanwhile is not undefined behaviour.
            unsafe { self.ptr.as_ptr().add(offset + i).write_volatile(*b) };
        }
    }

    fn read(&self, offset: usize, len: usize) -> Vec<u8> {
        assert!(offset + len <= self.len);
        (0..len)
            // SAFETY: in bounds (asserted) of the mapping; volatile reads, as in `write`.
            .map(|i| unsafe { self.ptr.as_ptr().add(offset + i).read_volatile() })
            .collect()
    }

    fn madvise_dontneed(&self, offset: usize, len: usize) {
        // SAFETY: the range lies inside the test's own anonymous mapping, which no reference points
        // into.
        let rc = unsafe {
            libc::madvise(
                self.ptr.as_ptr().add(offset).cast(),
                len,
                libc::MADV_DONTNEED,
            )
        };
        assert_eq!(rc, 0, "madvise: {}", std::io::Error::last_os_error());
    }

    fn unmap(self) {
        // SAFETY: the test's own mapping, unmapped once; the grants over it are gone or only reach
        // it through the device.
        let rc = unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
        assert_eq!(rc, 0, "munmap: {}", std::io::Error::last_os_error());
    }
}

// SAFETY: the pointer stays valid (a mapping of `len` bytes, or re-mapped at the same address by
// the test) while the value lives; every byte of a mapping is initialised.
unsafe impl IoBuf for Mapping {
    fn stable_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.len
    }
    fn bytes_total(&self) -> usize {
        self.len
    }
}

// SAFETY: as above.
unsafe impl IoBufMut for Mapping {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    unsafe fn set_init(&mut self, _pos: usize) {}
}

/// The device's ODP capabilities, and a panic that says which kernel to boot when rxe lacks them.
///
/// Also the path MTU: rxe's ODP copy (`__rxe_odp_mr_copy`, Linux 6.19 and 7.3 alike) ignores
/// the offset inside a page and does not advance through multi-page copies, so only packets
/// that start on a page boundary and stay within one page carry the right bytes. With a
/// 4096-byte MTU, page-aligned transfers are such packets; the tests below transfer whole
/// pages, and `odp_rxe_sub_page_offsets_are_copied_wrongly` shows the bug itself.
fn require_odp() {
    let (ctx, port) = common::open_device();
    let odp = ctx.odp_caps();
    println!("{}: {odp:?}", ctx.name());
    assert!(
        odp.supported,
        "{} has no ODP: run the odp_* tests on a kernel whose rxe has it \
         (scripts/rxe-vm --kernel 6.19)",
        ctx.name()
    );
    let mtu = ctx.query_port(port).unwrap().active_mtu;
    assert_eq!(
        mtu,
        Some(Mtu::Mtu4096),
        "rxe's ODP copies are right only for whole-page packets: raise the netdev's MTU \
         (`ip link set dummy0 mtu 9000` in the VM, as scripts/test does)"
    );
}

/// A connected pair on `port`, both sides offering one-sided access and atomics:
/// (the side that grants, the side that accesses).
async fn pair(port: u16) -> (Connection, Connection) {
    let opts = ConnectOptions::default().one_sided(true).atomics(true);
    let listener = Listener::bind_with(addr(port), opts.clone())
        .await
        .expect("bind");
    let (server, client) = tokio::join!(
        listener.accept(),
        Connection::connect_with(addr(port), opts)
    );
    (server.expect("accept"), client.expect("connect"))
}

/// Panics naming the first differing byte (and how many differ) if `got != want`.
fn same(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        let n = got.iter().zip(want).filter(|(a, b)| a != b).count();
        // Where the wrong bytes come from, if from elsewhere in `want` (diagnostics).
        for at in (i..got.len()).step_by(1024).take(12) {
            let needle = &got[at..(at + 16).min(got.len())];
            let from = want.windows(needle.len()).position(|w| w == needle);
            println!("{what}: got[{at}..] found at want[{from:?}]");
        }
        panic!(
            "{what}: {n} of {} bytes differ, the first at {i}: got {:02x?}, want {:02x?}",
            got.len(),
            &got[i..(i + 16).min(got.len())],
            &want[i..(i + 16).min(want.len())]
        );
    }
}

/// The peer READs `len` bytes at `offset` of `token` into a pool buffer of its own.
async fn peer_read(peer: &Connection, token: &RemoteToken, offset: usize, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    let mut at = offset;
    while at < offset + len {
        let n = (offset + len - at).min(CHUNK);
        let buf = peer.pool().unwrap().acquire(n).await.unwrap();
        let remote = token.slice(at as u64..(at + n) as u64).unwrap();
        let (res, buf) = peer.read(buf, remote).await;
        res.unwrap_or_else(|e| panic!("RDMA READ of {n} bytes at {at}: {e}"));
        out.extend_from_slice(&buf[..n]);
        at += n;
    }
    out
}

/// The peer WRITEs `data` at `offset` of `token`.
async fn peer_write(peer: &Connection, token: &RemoteToken, offset: usize, data: &[u8]) {
    for (i, chunk) in data.chunks(CHUNK).enumerate() {
        let at = offset + i * CHUNK;
        let mut buf = peer.pool().unwrap().acquire(chunk.len()).await.unwrap();
        buf.copy_from_slice(chunk);
        let remote = token.slice(at as u64..(at + chunk.len()) as u64).unwrap();
        let (res, _) = peer.write(buf, remote).await;
        res.unwrap_or_else(|e| panic!("RDMA WRITE of {} bytes at {at}: {e}", chunk.len()));
    }
}

/// fetch_add by the peer on the 8-byte word at `offset`; returns the previous value.
async fn peer_fetch_add(peer: &Connection, token: &RemoteToken, offset: usize, add: u64) -> u64 {
    let buf = peer.pool().unwrap().acquire(8).await.unwrap();
    let remote = token.slice(offset as u64..offset as u64 + 8).unwrap();
    let (res, _) = peer.fetch_add(buf, remote, add).await;
    res.unwrap_or_else(|e| panic!("fetch_add at {offset}: {e}"))
}

const RWA: RemoteAccess = RemoteAccess::READ;

fn rwa_odp() -> RemoteAccess {
    RWA | RemoteAccess::WRITE | RemoteAccess::ATOMIC | RemoteAccess::ON_DEMAND
}

#[test]
#[ignore = "needs an RDMA device with ODP (rxe on Linux 6.14+); scripts/test runs it on 6.19"]
fn odp_caps_of_rxe() {
    require_odp();
    let (ctx, _) = common::open_device();
    let odp = ctx.odp_caps();
    let ops = OdpOps::SEND | OdpOps::RECV | OdpOps::READ | OdpOps::WRITE | OdpOps::ATOMIC;
    assert!(odp.rc.contains(ops), "rxe's RC ODP operations: {}", odp.rc);
    assert!(
        ctx.require_odp(
            AccessFlags::ON_DEMAND | AccessFlags::REMOTE_ATOMIC,
            ops,
            false
        )
        .is_ok()
    );
    println!(
        "implicit ODP: {}; RC {}; UD {}",
        odp.implicit, odp.rc, odp.ud
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device with ODP (rxe on Linux 6.14+); scripts/test runs it on 6.19"]
async fn odp_grant_never_touched_and_madv_dontneed_pages() {
    common::init_tracing();
    let (owner, peer) = pair(7601).await;
    require_odp();
    let len = 4 << 20;
    let mem = Mapping::anon(len, None);
    let rss0 = status_kb("VmRSS");
    let grant = owner
        .grant(mem.alias(), 0..len, rwa_odp())
        .expect("ODP grant");
    let token = grant.token();
    // No page was touched: registering faulted nothing in.
    println!(
        "VmRSS before/after the grant: {rss0} / {} kB",
        status_kb("VmRSS")
    );

    // READ of never-touched pages: zeros, every byte.
    let got = within(120, "read untouched", peer_read(&peer, &token, 0, len)).await;
    assert!(
        got.iter().all(|&b| b == 0),
        "never-touched pages read as zeros"
    );

    // WRITE into never-touched pages (the second half was not even read): every byte lands.
    let fresh = Mapping::anon(len, None);
    let grant2 = owner
        .grant(fresh.alias(), 0..len, rwa_odp())
        .expect("ODP grant");
    let data = payload(1, len);
    within(
        120,
        "write untouched",
        peer_write(&peer, &grant2.token(), 0, &data),
    )
    .await;
    same(
        &fresh.read(0, len),
        &data,
        "the peer's WRITE into untouched pages",
    );

    // Atomics on a never-touched page of a third region.
    let atom = Mapping::anon(16 * PAGE, None);
    let grant3 = owner
        .grant(atom.alias(), 0..16 * PAGE, rwa_odp())
        .expect("ODP grant");
    let t3 = grant3.token();
    assert_eq!(peer_fetch_add(&peer, &t3, 7 * PAGE, 5).await, 0);
    assert_eq!(peer_fetch_add(&peer, &t3, 7 * PAGE, 6).await, 5);
    let buf = peer.pool().unwrap().acquire(8).await.unwrap();
    let (res, _) = peer
        .compare_swap(
            buf,
            t3.slice(9 * PAGE as u64..9 * PAGE as u64 + 8).unwrap(),
            0,
            42,
        )
        .await;
    assert_eq!(res.expect("compare_swap on an untouched page"), 0);
    assert_eq!(atom.read(7 * PAGE, 8), 11u64.to_ne_bytes());
    assert_eq!(atom.read(9 * PAGE, 8), 42u64.to_ne_bytes());

    // MADV_DONTNEED: the owner fills the first region, then drops half of its pages. The
    // device follows: the dropped pages read as zeros (a pinned registration would still see
    // the old pages), the others keep the bytes.
    let fill = payload(2, len);
    mem.write(0, &fill);
    let got = peer_read(&peer, &token, 0, len).await;
    same(&got, &fill, "the owner's bytes, read by the peer");
    mem.madvise_dontneed(len / 2, len / 2);
    let got = peer_read(&peer, &token, 0, len).await;
    assert!(got[..len / 2] == fill[..len / 2], "the pages not dropped");
    assert!(
        got[len / 2..].iter().all(|&b| b == 0),
        "dropped pages read as zeros"
    );
    // ... and a WRITE into dropped pages lands in the new pages the owner sees.
    mem.madvise_dontneed(0, len);
    let data = payload(3, len);
    peer_write(&peer, &token, 0, &data).await;
    assert!(
        mem.read(0, len) == data,
        "the peer's WRITE into dropped pages"
    );
    assert_eq!(peer_fetch_add(&peer, &t3, 7 * PAGE, 1).await, 11);

    drop((grant, grant2, grant3));
    peer.close().await.unwrap();
    mem.unmap();
    fresh.unmap();
    atom.unmap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device with ODP (rxe on Linux 6.14+); scripts/test runs it on 6.19"]
async fn odp_grant_file_backed_and_remapped() {
    common::init_tracing();
    let (owner, peer) = pair(7602).await;
    require_odp();

    // A file-backed mapping (memfd: a tmpfs file), its contents written with write(2) only:
    // the mapping's pages are never touched by the process before the peer reads them.
    let len = 1 << 20;
    // SAFETY: a plain system call with a NUL-terminated name.
    let fd = unsafe { libc::memfd_create(c"odp-test".as_ptr(), 0) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    let content = payload(4, len);
    // SAFETY: `content` is `len` readable bytes; `fd` is the memfd just created.
    let n = unsafe { libc::write(fd, content.as_ptr().cast(), len) };
    assert_eq!(n, len as isize);
    let file = Mapping::file(fd, len);
    let grant = owner
        .grant(file.alias(), 0..len, rwa_odp())
        .expect("ODP grant of a file");
    let token = grant.token();
    let got = peer_read(&peer, &token, 0, len).await;
    same(&got, &content, "the file's bytes, read by the peer");
    let data = payload(5, len / 2);
    peer_write(&peer, &token, len / 4, &data).await;
    let mut back = vec![0u8; len];
    // SAFETY: `back` has room for `len` bytes.
    let n = unsafe { libc::pread(fd, back.as_mut_ptr().cast(), len, 0) };
    assert_eq!(n, len as isize);
    assert!(back[..len / 4] == content[..len / 4]);
    assert!(
        back[len / 4..len / 4 + len / 2] == data[..],
        "the peer's WRITE is in the file"
    );
    assert!(back[len / 4 + len / 2..] == content[len / 4 + len / 2..]);
    drop(grant);
    file.unmap();
    // SAFETY: the test's own memfd, closed once (its mapping is unmapped already).
    unsafe { libc::close(fd) };

    // Re-mapped: the owner unmaps the granted range and maps new memory at the same address.
    // The ODP registration follows: the peer reads the new bytes, and its WRITE lands in the
    // new pages.
    let mem = Mapping::anon(len, None);
    let old = payload(6, len);
    mem.write(0, &old);
    let grant = owner
        .grant(mem.alias(), 0..len, rwa_odp())
        .expect("ODP grant");
    let token = grant.token();
    assert!(peer_read(&peer, &token, 0, len).await == old);
    let at = mem.ptr;
    mem.unmap();
    let mem = Mapping::anon(len, Some(at));
    assert_eq!(mem.ptr, at, "mapped again at the same address");
    let new = payload(7, len);
    mem.write(0, &new);
    let got = peer_read(&peer, &token, 0, len).await;
    assert!(
        got == new,
        "the peer reads the new mapping's bytes, not the old pages"
    );
    let data = payload(8, len);
    peer_write(&peer, &token, 0, &data).await;
    assert!(
        mem.read(0, len) == data,
        "the peer's WRITE lands in the new mapping"
    );
    drop(grant);
    peer.close().await.unwrap();
    mem.unmap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device with ODP (rxe on Linux 6.14+); scripts/test runs it on 6.19"]
async fn odp_access_to_an_unmapped_page_fails_that_operation() {
    common::init_tracing();
    let (owner, peer) = pair(7603).await;
    require_odp();
    let mem = Mapping::anon(4 * PAGE, None);
    mem.write(0, &payload(9, 4 * PAGE));
    let grant = owner
        .grant(mem.alias(), 0..4 * PAGE, rwa_odp())
        .expect("ODP grant");
    let token = grant.token();
    // Unmap the third page: the registration still covers it, nothing is mapped there.
    // SAFETY: the third page of the test's own mapping, which nothing in this process references.
    let rc = unsafe { libc::munmap(mem.ptr.as_ptr().add(2 * PAGE).cast(), PAGE) };
    assert_eq!(rc, 0);
    // The pages still mapped are readable.
    same(
        &peer_read(&peer, &token, 0, 2 * PAGE).await,
        &payload(9, 4 * PAGE)[..2 * PAGE],
        "the pages still mapped",
    );
    // A READ of the unmapped page fails, with an error (no signal, no hang).
    let buf = peer.pool().unwrap().acquire(PAGE).await.unwrap();
    let remote = token.slice(2 * PAGE as u64..3 * PAGE as u64).unwrap();
    let (res, _) = within(120, "read of an unmapped page", peer.read(buf, remote)).await;
    let err = res.expect_err("an RDMA READ of an unmapped page");
    println!("READ of an unmapped page of an ODP grant: {err}");
    assert!(matches!(err, Error::QpFailed(_)), "{err}");
    // RC: a remote access error ends the queue pair, so the connection is finished. The
    // connection learns it from its flushed receives, which the device completes after the
    // READ's error: usually in the same CQ poll, but a poll can fall between them (seen once
    // in a full run, 2026-12-02), so wait for them rather than look once.
    within(60, "the peer's connection reports its failure", async {
        while peer.failure().is_none() {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    })
    .await;
    println!(
        "peer connection after the error: failure = {:?}",
        peer.failure()
    );
    // The process and the owner are intact: the owner's memory is as it was, and a new
    // connection reads through a new grant of the same memory.
    assert_eq!(mem.read(0, PAGE), payload(9, 4 * PAGE)[..PAGE]);
    drop(grant);
    drop(peer);
    let (owner2, peer2) = pair(7604).await;
    let first = Mapping {
        ptr: mem.ptr,
        len: 2 * PAGE,
    };
    let grant = owner2
        .grant(first.alias(), 0..2 * PAGE, rwa_odp())
        .expect("ODP grant");
    let got = peer_read(&peer2, &grant.token(), 0, 2 * PAGE).await;
    assert!(
        got == payload(9, 4 * PAGE)[..2 * PAGE],
        "a new connection reads the same memory"
    );
    drop(grant);
    peer2.close().await.unwrap();
    drop(owner);
    first.unmap();
    Mapping {
        // SAFETY: `3 * PAGE` is inside the original 4-page mapping.
        ptr: NonNull::new(unsafe { mem.ptr.as_ptr().add(3 * PAGE) }).unwrap(),
        len: PAGE,
    }
    .unmap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device with ODP (rxe on Linux 6.14+); scripts/test runs it on 6.19"]
async fn odp_registering_1_gib_pins_nothing() {
    require_odp();
    let ep = Endpoint::open(&common::device_name()).expect("endpoint");
    let pd = ProtectionDomain::new(ep.context()).unwrap();
    // Pinned first, to show VmPin counts registrations at all: 64 MiB pinned.
    let pin0 = status_kb("VmPin");
    let pinned = RegisteredBuffer::new(&pd, 64 << 20, AccessFlags::LOCAL_WRITE).unwrap();
    let pin1 = status_kb("VmPin");
    assert_eq!(
        pin1 - pin0,
        64 << 10,
        "a pinned 64 MiB registration is in VmPin"
    );
    drop(pinned);
    // 1 GiB of fresh anonymous memory on demand: VmPin does not move, and nothing is faulted in.
    let mem = Mapping::anon(1 << 30, None);
    let base = status_kb("VmPin");
    let rss = status_kb("VmRSS");
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::ON_DEMAND;
    let t = std::time::Instant::now();
    // SAFETY: `mem` stays mapped until after `odp` is dropped below.
    let odp = unsafe { MemoryRegion::register(&pd, mem.ptr.as_ptr(), mem.len, access) }
        .expect("1 GiB on demand");
    let took = t.elapsed();
    let after = status_kb("VmPin");
    println!(
        "1 GiB ODP registration: {took:?}; VmPin {base} -> {after} kB, VmLck {} kB, \
         VmRSS {rss} -> {} kB",
        status_kb("VmLck"),
        status_kb("VmRSS")
    );
    assert_eq!(after, base, "an ODP registration pins nothing");
    assert!(odp.is_on_demand());
    // Prefetch: ibv_advise_mr. rdma-core's rxe provider must implement it; Debian 12's
    // (rdma-core 44) does not, and says EOPNOTSUPP before reaching the kernel.
    match odp.prefetch(0..4 << 20, Prefetch::Write).await {
        Ok(()) => println!("prefetch of 4 MiB: ok"),
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
            assert!(matches!(e, Error::AdviseMr(_)), "{e}");
            println!("prefetch: {e} (the user-space provider has no advise_mr)");
        }
        Err(e) => panic!("prefetch: {e}"),
    }
    let hint = odp.advise(4 << 20..8 << 20, Prefetch::Read);
    println!("prefetch hint: {hint:?}");
    assert!(
        odp.prefetch(0..0, Prefetch::Read).await.is_err(),
        "an empty range is refused"
    );
    assert_eq!(
        status_kb("VmPin"),
        base,
        "nothing pinned after prefetching either"
    );
    drop(odp);
    mem.unmap();
    // Implicit ODP: rxe does not report it, so the clear capability error.
    // SAFETY: the call fails (rxe has no implicit ODP) before anything is registered; had it
    // succeeded, the region gives no remote rights.
    let err = unsafe { MemoryRegion::register_implicit(&pd, AccessFlags::LOCAL_WRITE) }
        .expect_err("rxe has no implicit ODP");
    println!("implicit ODP: {err}");
    assert!(
        matches!(
            err,
            Error::OdpUnsupported {
                missing: OdpMissing::Implicit,
                ..
            }
        ),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device with ODP (rxe on Linux 6.14+); scripts/test runs it on 6.19"]
async fn odp_pool_and_registration_cache_follow_remapped_memory() {
    common::init_tracing();
    let odp_pool = PoolConfig::default()
        .classes([SizeClass::new(64 << 10, 64)])
        .on_demand(true);
    let opts = ConnectOptions::default().user_pool(odp_pool);
    let listener = Listener::bind_with(addr(7605), opts.clone()).await.unwrap();
    let (a, b) = tokio::join!(
        listener.accept(),
        Connection::connect_with(addr(7605), opts)
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    require_odp();

    // An on-demand pool: its buffers are sent from and received into without pinning.
    let mut buf = b.pool().unwrap().acquire(60_000).await.unwrap();
    buf.copy_from_slice(&payload(10, 60_000));
    b.send_buf(buf).await.expect("send from an ODP pool buffer");
    let got = within(60, "recv", a.recv()).await.unwrap().unwrap();
    same(
        &got,
        &payload(10, 60_000),
        "a message sent from an ODP pool buffer",
    );

    // A registration cache on demand: send_bytes from a mapping, re-map it at the same
    // address with new bytes, send again: a cache hit that sends the new bytes.
    let len = 64 << 10;
    let mem = Mapping::anon(len, None);
    mem.write(0, &payload(11, len));
    // SAFETY: on demand, the cache follows the mapping (CacheConfig::on_demand).
    // SAFETY: on demand, the cache follows the mapping (CacheConfig::on_demand); the memory sent is
    // the test's own mapping, re-mapped at the same address and unmapped only after the last send
    // completed.
    let cache = unsafe { b.registration_cache(CacheConfig::default().on_demand(true)) };
    // SAFETY: `len` bytes of the test's mapping; only read (by the device and the send path) while
    // mapped at this address, never written through this slice.
    let slice: &'static [u8] = unsafe { std::slice::from_raw_parts(mem.ptr.as_ptr(), len) };
    b.send_bytes(bytes::Bytes::from_static(slice))
        .await
        .unwrap();
    let got = within(60, "recv", a.recv()).await.unwrap().unwrap();
    assert!(got[..] == payload(11, len)[..]);
    let at = mem.ptr;
    mem.unmap();
    let mem = Mapping::anon(len, Some(at));
    mem.write(0, &payload(12, len));
    b.send_bytes(bytes::Bytes::from_static(slice))
        .await
        .unwrap();
    let got = within(60, "recv", a.recv()).await.unwrap().unwrap();
    assert!(
        got[..] == payload(12, len)[..],
        "the re-mapped memory's new bytes are sent"
    );
    let m = cache.metrics();
    println!("cache: {m:?}; copied {}", b.stats().send_bytes_copied);
    assert_eq!(m.registrations, 1, "one on-demand registration, reused");
    assert!(m.hits >= 1);
    b.close().await.unwrap();
    mem.unmap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device with ODP (rxe on Linux 6.14+); scripts/test runs it on 6.19"]
async fn odp_rxe_sub_page_offsets_are_copied_wrongly() {
    // A known kernel bug, checked so that the documentation's claim stays true: rxe's ODP copy
    // reads (and writes) a packet at the start of its page, whatever its offset in the page.
    // When this test fails, rxe got fixed: update docs/memory.md and the tests' MTU note.
    let (owner, peer) = pair(7607).await;
    require_odp();
    let mem = Mapping::anon(2 * PAGE, None);
    let fill = payload(13, 2 * PAGE);
    mem.write(0, &fill);
    let grant = owner
        .grant(mem.alias(), 0..2 * PAGE, rwa_odp())
        .expect("ODP grant");
    let got = peer_read(&peer, &grant.token(), 1024, 256).await;
    println!(
        "READ of 256 bytes at page offset 1024: right bytes {}, the page's first bytes {}",
        got == fill[1024..1280],
        got == fill[..256]
    );
    assert!(
        got == fill[..256] && got != fill[1024..1280],
        "rxe no longer copies sub-page ODP packets from the page start: the bug is fixed"
    );
    // A pinned grant of the same memory reads the right bytes.
    let pinned = owner
        .grant(mem.alias(), 0..2 * PAGE, RemoteAccess::READ)
        .expect("pinned grant");
    same(
        &peer_read(&peer, &pinned.token(), 1024, 256).await,
        &fill[1024..1280],
        "a pinned grant at the same offset",
    );
    drop((grant, pinned));
    peer.close().await.unwrap();
    mem.unmap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; scripts/test runs it on the default kernel (6.1, no ODP in rxe)"]
async fn capability_error_without_odp() {
    let ep = Endpoint::open(&common::device_name()).expect("endpoint");
    let odp = ep.odp_caps();
    println!("{}: {odp:?}", ep.device_name());
    assert!(
        !odp.supported,
        "this test is for a device without ODP (rxe before Linux 6.14)"
    );
    let pd = ProtectionDomain::new(ep.context()).unwrap();
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::ON_DEMAND;
    let err = RegisteredBuffer::new(&pd, 1 << 20, access).expect_err("no ODP on this device");
    println!("{err}");
    assert!(
        matches!(
            err,
            Error::OdpUnsupported {
                missing: OdpMissing::Odp,
                ..
            }
        ),
        "{err}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("IBV_ODP_SUPPORT") && msg.contains("Linux 6.14"),
        "{msg}"
    );
    assert_eq!(
        std::io::Error::from(err).kind(),
        std::io::ErrorKind::Unsupported
    );

    // A pool and a grant on a connection: the same error, before anything is registered.
    let pool = tokio_rdma::buf::Pool::with_pd(&pd, PoolConfig::default().on_demand(true));
    assert!(matches!(pool, Err(Error::OdpUnsupported { .. })));
    let (owner, _peer) = pair(7606).await;
    let err = owner
        .grant(
            vec![0u8; 4096],
            0..4096,
            RemoteAccess::READ | RemoteAccess::ON_DEMAND,
        )
        .expect_err("an ODP grant without ODP");
    assert!(matches!(err, Error::OdpUnsupported { .. }), "{err}");
    // Without ON_DEMAND the same grant works.
    owner
        .grant(vec![0u8; 4096], 0..4096, RemoteAccess::READ)
        .expect("a pinned grant");
}
