//! Pinned vs on-demand (ODP) memory, measured: the time and locked memory (VmPin/VmLck) to
//! register regions of several sizes; first-touch (page fault) vs steady latency of RDMA READ,
//! WRITE and send; RDMA WRITE bandwidth at 64 KiB. Prints markdown tables (docs/benchmarks-odp.md).
//!
//! ```text
//! odp_bench                          # both ends in this process, on 192.0.2.1 (rxe0 in the VM)
//! odp_bench --sizes 64M,1G --iters 200 --bw-mib 64
//! ```
//!
//! Needs a device with ODP (soft-RoCE from Linux 6.14: `scripts/rxe-vm --kernel 6.19`). On
//! rxe, ODP copies are right only for whole-page packets (see docs/memory.md): run it with a
//! 4096-byte path MTU (`ip link set dummy0 mtu 9000` in the VM); the transfers here are whole,
//! page-aligned pages. Pinned sizes that do not fit in the machine's available memory are
//! skipped (pinning faults in and locks every page).
#![allow(clippy::print_stdout, clippy::print_stderr)]

mod common;

use std::ptr::NonNull;
use std::time::Instant;

use bytes::Bytes;
use clap::Parser;
use hdrhistogram::Histogram;
use tokio_rdma::buf::{CacheConfig, Grant, IoBuf, IoBufMut, RemoteAccess, RemoteToken};
use tokio_rdma::conn::{ConnectOptions, Connection, Listener};
use tokio_rdma::verbs::{AccessFlags, Context, MemoryRegion, ProtectionDomain};

const PAGE: usize = 4096;

#[derive(Parser, Debug)]
#[command(about = "Pinned vs on-demand (ODP) registration, latency and bandwidth")]
struct Args {
    /// Region sizes to register, with K/M/G suffixes
    #[arg(long, value_delimiter = ',', default_value = "64M,1G")]
    sizes: Vec<String>,
    /// Samples per latency row (each first-touch sample uses a fresh page)
    #[arg(long, default_value_t = 200)]
    iters: usize,
    /// MiB written per bandwidth row
    #[arg(long, default_value_t = 64)]
    bw_mib: usize,
    /// Device
    #[arg(long, default_value = "rxe0")]
    device: String,
    /// Small counts (the test suite's smoke run)
    #[arg(long)]
    smoke: bool,
}

fn parse_size(s: &str) -> usize {
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>().expect("a size like 64M") * mult
}

/// A `kB` field of /proc/self/status or /proc/meminfo.
fn kb(file: &str, field: &str) -> u64 {
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Fresh anonymous memory, never touched, not reserved against overcommit; unmapped on drop.
struct Anon {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a process mapping, usable from any thread.
unsafe impl Send for Anon {}

impl Anon {
    fn new(len: usize) -> Anon {
        // SAFETY: a fresh anonymous mapping at an address the kernel picks; no Rust reference
        // points into it.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED, "mmap of {len} bytes failed");
        Anon {
            ptr: NonNull::new(p.cast()).unwrap(),
            len,
        }
    }
}

impl Drop for Anon {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once; the registrations and grants over it
        // are dropped before it (they are created after it).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

// SAFETY: the mapping stays at `ptr` for the value's life; all its bytes are initialised.
unsafe impl IoBuf for Anon {
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
unsafe impl IoBufMut for Anon {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    unsafe fn set_init(&mut self, _pos: usize) {}
}

fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 => format!("{} MiB", b >> 20),
        b => format!("{} KiB", b >> 10),
    }
}

fn registration_table(pd: &ProtectionDomain, sizes: &[usize]) {
    println!("| size | memory | registration | VmPin after | VmLck after | VmRSS growth |");
    println!("|---|---|---|---|---|---|");
    for &size in sizes {
        for odp in [false, true] {
            let kind = if odp { "ODP" } else { "pinned" };
            let avail = kb("/proc/meminfo", "MemAvailable") * 1024;
            if !odp && size as u64 > avail * 9 / 10 {
                println!(
                    "| {} | {kind} | does not fit ({} MiB available) | | | |",
                    human(size),
                    avail >> 20
                );
                continue;
            }
            let mem = Anon::new(size);
            let rss0 = kb("/proc/self/status", "VmRSS");
            let mut access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ;
            if odp {
                access |= AccessFlags::ON_DEMAND;
            }
            let t = Instant::now();
            // SAFETY: `mem` stays mapped until after `mr` is dropped (below, in this loop
            // iteration).
            let mr = unsafe { MemoryRegion::register(pd, mem.ptr.as_ptr(), size, access) };
            let took = t.elapsed();
            match mr {
                Ok(mr) => {
                    println!(
                        "| {} | {kind} | {:.1} ms | {} MiB | {} MiB | {} MiB |",
                        human(size),
                        took.as_secs_f64() * 1e3,
                        kb("/proc/self/status", "VmPin") >> 10,
                        kb("/proc/self/status", "VmLck") >> 10,
                        kb("/proc/self/status", "VmRSS").saturating_sub(rss0) >> 10
                    );
                    drop(mr);
                }
                Err(e) => println!("| {} | {kind} | failed: {e} | | | |", human(size)),
            }
        }
    }
}

/// p50 / p99 in microseconds.
fn pct(h: &Histogram<u64>) -> String {
    format!(
        "{:.0} | {:.0}",
        h.value_at_quantile(0.5) as f64 / 1e3,
        h.value_at_quantile(0.99) as f64 / 1e3
    )
}

async fn pair(port: u16) -> (Connection, Connection) {
    let addr = common::default_addr(port);
    let opts = ConnectOptions::default().one_sided(true);
    let listener = Listener::bind_with(addr, opts.clone()).await.expect("bind");
    let (a, b) = tokio::join!(listener.accept(), Connection::connect_with(addr, opts));
    (a.expect("accept"), b.expect("connect"))
}

#[derive(Clone, Copy, PartialEq)]
enum Op {
    Read,
    Write,
}

/// One-sided 4 KiB operations by `peer` on `token`; page `i` of sample `i` when `fresh`, else
/// page 0 every time (after one warm-up).
async fn one_sided(
    peer: &Connection,
    token: &RemoteToken,
    op: Op,
    n: usize,
    fresh: bool,
) -> Histogram<u64> {
    let mut h = common::histogram();
    let mut buf = Some(peer.pool().unwrap().acquire(PAGE).await.unwrap());
    for i in 0..=n {
        let page = if fresh { i } else { 0 };
        let remote = token
            .slice((page * PAGE) as u64..((page + 1) * PAGE) as u64)
            .unwrap();
        let b = buf.take().unwrap();
        let t = Instant::now();
        let (res, b) = match op {
            Op::Read => peer.read(b, remote).await,
            Op::Write => peer.write(b, remote).await,
        };
        let took = t.elapsed();
        res.expect("one-sided operation");
        buf = Some(b);
        if i > 0 || fresh {
            common::record(&mut h, took);
        }
    }
    h
}

/// Round trips of a 4 KiB message sent from `mem` through `sender`'s registration cache (page
/// `i` when `fresh`, page 0 otherwise) and a 1-byte reply.
async fn sends(
    sender: &Connection,
    echo: &Connection,
    mem: &Anon,
    n: usize,
    fresh: bool,
) -> Histogram<u64> {
    let mut h = common::histogram();
    for i in 0..=n {
        let page = if fresh { i } else { 0 };
        let bytes: &'static [u8] =
            // SAFETY: page `page` of `mem`, mapped for the whole benchmark and never written while
            // the device reads it.
            unsafe { std::slice::from_raw_parts(mem.ptr.as_ptr().add(page * PAGE), PAGE) };
        let t = Instant::now();
        sender
            .send_bytes(Bytes::from_static(bytes))
            .await
            .expect("send");
        let got = echo.recv().await.expect("recv").expect("a message");
        assert_eq!(got.len(), PAGE);
        echo.send(&[1]).await.expect("reply");
        sender.recv().await.expect("recv").expect("the reply");
        let took = t.elapsed();
        if i > 0 || fresh {
            common::record(&mut h, took);
        }
    }
    h
}

/// MB/s of `total` bytes of 64 KiB RDMA WRITEs by `peer` into `token`, 8 in flight.
async fn bandwidth(peer: &Connection, token: &RemoteToken, total: usize) -> f64 {
    const SIZE: usize = 64 << 10;
    let region = token.len() as usize;
    let chunks = total / SIZE;
    let t = Instant::now();
    let lanes = (0..8).map(|lane| async move {
        let mut buf = Some(peer.pool().unwrap().acquire(SIZE).await.unwrap());
        for c in (0..chunks).filter(|c| c % 8 == lane) {
            let at = (c * SIZE) % region;
            let remote = token.slice(at as u64..(at + SIZE) as u64).unwrap();
            let (res, b) = peer.write(buf.take().unwrap(), remote).await;
            res.expect("RDMA WRITE");
            buf = Some(b);
        }
    });
    futures::future::join_all(lanes).await;
    (chunks * SIZE) as f64 / t.elapsed().as_secs_f64() / 1e6
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    let (iters, bw) = if args.smoke {
        (10, 4 << 20)
    } else {
        (args.iters, args.bw_mib << 20)
    };
    let sizes: Vec<usize> = if args.smoke {
        vec![4 << 20]
    } else {
        args.sizes.iter().map(|s| parse_size(s)).collect()
    };
    let ctx = Context::open(&args.device).expect("device");
    let odp = ctx.odp_caps();
    println!("{}: {odp:?}", ctx.name());
    if !odp.supported {
        eprintln!(
            "{} has no on-demand paging (rxe has it from Linux 6.14)",
            ctx.name()
        );
        std::process::exit(2);
    }
    let pd = ProtectionDomain::new(&ctx).expect("pd");
    println!("\n### Registration\n");
    registration_table(&pd, &sizes);

    let (owner, peer) = pair(7640).await;
    let region = (iters + 2) * PAGE;
    let pinned = owner
        .grant(
            Anon::new(region),
            0..region,
            RemoteAccess::READ | RemoteAccess::WRITE,
        )
        .expect("pinned grant");
    let odp_grant = |access: RemoteAccess| -> Grant<Anon> {
        owner
            .grant(
                Anon::new(region),
                0..region,
                access | RemoteAccess::ON_DEMAND,
            )
            .expect("ODP grant")
    };
    println!("\n### Latency of 4 KiB operations (us, p50 | p99; {iters} samples)\n");
    println!(
        "| operation | pinned p50 | pinned p99 | ODP steady p50 | ODP steady p99 | ODP first touch p50 | ODP first touch p99 |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (name, op) in [("RDMA READ", Op::Read), ("RDMA WRITE", Op::Write)] {
        let pin = one_sided(&peer, &pinned.token(), op, iters, false).await;
        let g = odp_grant(RemoteAccess::READ | RemoteAccess::WRITE);
        let first = one_sided(&peer, &g.token(), op, iters, true).await;
        let steady = one_sided(&peer, &g.token(), op, iters, false).await;
        println!(
            "| {name} | {} | {} | {} |",
            pct(&pin),
            pct(&steady),
            pct(&first)
        );
    }
    // Sends: the sender's bytes come from a registration cache, pinned or on demand.
    let (a, b) = pair(7641).await;
    let (c, d) = pair(7642).await;
    let pinned_mem = Anon::new(region);
    let odp_mem = Anon::new(region);
    // SAFETY: the caches register memory (`Anon` mappings) that stays mapped while they live (on
    // demand, they would follow it anyway).
    unsafe {
        a.registration_cache(CacheConfig::default());
        c.registration_cache(CacheConfig::default().on_demand(true));
    }
    let pin = sends(&a, &b, &pinned_mem, iters, false).await;
    let first = sends(&c, &d, &odp_mem, iters, true).await;
    let steady = sends(&c, &d, &odp_mem, iters, false).await;
    println!(
        "| send + 1-byte reply | {} | {} | {} |",
        pct(&pin),
        pct(&steady),
        pct(&first)
    );

    println!(
        "\n### RDMA WRITE bandwidth, 64 KiB, 8 in flight ({} MiB per row)\n",
        bw >> 20
    );
    println!("| target | MB/s |");
    println!("|---|---|");
    let big = bw.max(64 << 10);
    let pinned_big = owner
        .grant(Anon::new(big), 0..big, RemoteAccess::WRITE)
        .expect("pinned grant");
    let odp_big = owner
        .grant(
            Anon::new(big),
            0..big,
            RemoteAccess::WRITE | RemoteAccess::ON_DEMAND,
        )
        .expect("ODP grant");
    println!(
        "| pinned | {:.1} |",
        bandwidth(&peer, &pinned_big.token(), bw).await
    );
    println!(
        "| ODP, first touch (every page faulted in) | {:.1} |",
        bandwidth(&peer, &odp_big.token(), bw).await
    );
    println!(
        "| ODP, steady (pages present) | {:.1} |",
        bandwidth(&peer, &odp_big.token(), bw).await
    );
    for conn in [&peer, &a, &c] {
        conn.close().await.expect("close");
    }
}
