//! Registration micro-benchmark: pool `try_acquire` + drop (and the async `acquire`) against
//! `ibv_reg_mr` + `ibv_dereg_mr` of the same sizes (4 KiB, 64 KiB, 1 MiB).
//!
//! Needs an RDMA device (`$TOKIO_RDMA_DEVICE`, default `rxe0`). Build on the host with
//! `cargo bench --no-run`, run the binary in the soft-RoCE VM:
//! `scripts/rxe-vm -- target/release/deps/registration-<hash>`.
//! Prints min and median ns/op over several rounds.

#![allow(clippy::print_stdout, missing_docs)]

use std::hint::black_box;
use std::time::Instant;

use tokio_rdma::buf::{Pool, PoolConfig, SizeClass};
use tokio_rdma::verbs::{
    AccessFlags, Context, HugePages, MemoryRegion, PageMapping, ProtectionDomain,
};

const ROUNDS: usize = 7;

/// Runs `f` `iters` times per round and returns (min, median) ns per call.
fn measure(iters: usize, mut f: impl FnMut()) -> (f64, f64) {
    for _ in 0..iters.min(100) {
        f(); // warm up
    }
    let mut per_op: Vec<f64> = (0..ROUNDS)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..iters {
                f();
            }
            t.elapsed().as_nanos() as f64 / iters as f64
        })
        .collect();
    per_op.sort_by(f64::total_cmp);
    (per_op[0], per_op[ROUNDS / 2])
}

fn label(size: usize) -> String {
    if size >= 1 << 20 {
        format!("{} MiB", size >> 20)
    } else {
        format!("{} KiB", size >> 10)
    }
}

fn main() {
    let name = std::env::var("TOKIO_RDMA_DEVICE").unwrap_or_else(|_| "rxe0".into());
    let ctx = match Context::open(&name) {
        Ok(c) => c,
        Err(e) => {
            println!("registration bench skipped: {e}");
            return;
        }
    };
    let pd = ProtectionDomain::new(&ctx).expect("alloc pd");
    let cfg = PoolConfig::default().classes([
        SizeClass::new(4 << 10, 64),
        SizeClass::new(64 << 10, 16),
        SizeClass::new(1 << 20, 4),
    ]);
    let pool = Pool::with_pd(&pd, cfg).expect("pool");
    println!(
        "device {name}; pool huge pages: {}; {ROUNDS} rounds each, ns/op (min / median)",
        pool.metrics().huge_pages
    );
    for (size, reg_iters) in [(4 << 10, 2000), (64 << 10, 500), (1 << 20, 100)] {
        let (pmin, pmed) = measure(200_000, || {
            let b = pool.try_acquire(size).unwrap().unwrap();
            black_box(b.lkey());
        });
        let (amin, amed) = measure(100_000, || {
            let b = futures::executor::block_on(pool.acquire(size)).unwrap();
            black_box(b.lkey());
        });
        let mem = PageMapping::new(size, HugePages::Never).expect("map");
        // Touch every page so registration pins resident memory, as it would for a real buffer.
        for off in (0..size).step_by(4096) {
            // SAFETY: in bounds of the mapping, which nothing else references.
            unsafe { mem.as_ptr().add(off).write(1) };
        }
        let (rmin, rmed) = measure(reg_iters, || {
            // SAFETY: `mem` outlives the region, which is dropped (deregistered) right away.
            let mr = unsafe {
                MemoryRegion::register(&pd, mem.as_ptr(), size, AccessFlags::LOCAL_WRITE)
            }
            .expect("ibv_reg_mr");
            black_box(mr.lkey());
        });
        let l = label(size);
        println!("{l:>7} pool try_acquire+drop   min {pmin:>10.0} median {pmed:>10.0} ns/op");
        println!("{l:>7} pool acquire().await    min {amin:>10.0} median {amed:>10.0} ns/op");
        println!("{l:>7} ibv_reg_mr+ibv_dereg_mr min {rmin:>10.0} median {rmed:>10.0} ns/op");
        println!("{l:>7} ratio reg/pool (medians) {:.0}x", rmed / pmed);
    }
}
