//! Device stress tests of the async engine: many concurrent operations on one CQ, a
//! cancellation storm with drop probes, and a queue pair failing mid-flight. Run in the
//! soft-RoCE VM (`scripts/test`); ignored on hosts without a device.
#![allow(clippy::print_stdout, clippy::undocumented_unsafe_blocks)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{all_access, connect_qps, open_device, within};
use futures::FutureExt;
use tokio_rdma::buf::{IoBuf, IoBufMut, RemoteToken};
use tokio_rdma::driver::{AsyncQp, Driver, DriverOptions, QpOptions};
use tokio_rdma::verbs::{AccessFlags, ProtectionDomain, RegisteredBuffer};

/// A slot of a shared registered arena carrying a drop probe: the probe's strong count tells
/// whether the buffer is still held (by its future or by the driver's operation table).
struct ProbeBuf {
    arena: Arc<RegisteredBuffer>,
    off: usize,
    len: usize,
    init: usize,
    _probe: Arc<()>,
}

impl ProbeBuf {
    fn new(
        arena: &Arc<RegisteredBuffer>,
        slot: usize,
        len: usize,
        init: usize,
    ) -> (ProbeBuf, Arc<()>) {
        let probe = Arc::new(());
        let off = slot * len;
        assert!(off + len <= arena.len());
        (
            ProbeBuf {
                arena: arena.clone(),
                off,
                len,
                init,
                _probe: probe.clone(),
            },
            probe,
        )
    }
}

// SAFETY (test buffer): the arena is an `Arc`ed registered allocation that outlives every
// `ProbeBuf` pointing into it; `off + len` is within it (asserted in `new`); the arena's lkey
// covers it.
unsafe impl IoBuf for ProbeBuf {
    fn stable_ptr(&self) -> *const u8 {
        (self.arena.addr() as usize + self.off) as *const u8
    }
    fn bytes_init(&self) -> usize {
        self.init
    }
    fn bytes_total(&self) -> usize {
        self.len
    }
    fn lkey(&self) -> Option<u32> {
        Some(self.arena.lkey())
    }
}

// SAFETY: as above.
unsafe impl IoBufMut for ProbeBuf {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        (self.arena.addr() as usize + self.off) as *mut u8
    }
    unsafe fn set_init(&mut self, pos: usize) {
        self.init = self.init.max(pos);
    }
}

struct Rig {
    pd: ProtectionDomain,
    driver: Driver,
    pairs: Vec<(AsyncQp, AsyncQp)>,
}

fn rig(npairs: usize, qp_opts: QpOptions) -> Rig {
    let (ctx, _) = open_device();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let driver = Driver::new(&ctx, DriverOptions::default().cq_size(8192)).unwrap();
    let pairs = (0..npairs)
        .map(|_| {
            let a = driver.create_qp(&pd, qp_opts).unwrap();
            let b = driver.create_qp(&pd, qp_opts).unwrap();
            connect_qps(&ctx, a.verbs(), b.verbs(), all_access());
            (a, b)
        })
        .collect();
    Rig { pd, driver, pairs }
}

/// xorshift64*: deterministic randomness without a dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

async fn wait_table_empty(driver: &Driver, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while driver.stats().ops_in_table != 0 {
        assert!(
            Instant::now() < deadline,
            "{what}: op table not empty: {:?}",
            driver.stats()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn ten_thousand_concurrent_ops_on_eight_qps() {
    let r = Arc::new(rig(4, QpOptions::default()));
    let target = Arc::new(RegisteredBuffer::new(&r.pd, 1 << 20, all_access()).unwrap());
    let arena =
        Arc::new(RegisteredBuffer::new(&r.pd, 10_000 * 64, AccessFlags::LOCAL_WRITE).unwrap());
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    // 8 queue pairs, one CQ: on each pair, A writes into `target` and B reads from it;
    // 10,000 operations started at once (far more than the queue depths: backpressure).
    for i in 0..10_000usize {
        let (r, target, arena) = (r.clone(), target.clone(), arena.clone());
        tasks.spawn(async move {
            let (a, b) = &r.pairs[i % 4];
            let qp = if i % 2 == 0 { a } else { b };
            let remote = RemoteToken::new(target.addr(), target.len() as u64, target.rkey())
                .slice((i as u64 % 16_000) * 64..(i as u64 % 16_000) * 64 + 64)
                .unwrap();
            let (buf, probe) = ProbeBuf::new(&arena, i, 64, 64);
            let (res, buf) = if i % 4 < 2 {
                qp.write(buf, remote).await
            } else {
                qp.read(buf, remote).await
            };
            res.unwrap_or_else(|e| panic!("op {i}: {e}"));
            drop(buf);
            assert_eq!(
                Arc::strong_count(&probe),
                1,
                "buffer returned with the result"
            );
            i
        });
    }
    let mut seen = vec![false; 10_000];
    while let Some(res) = within(600, "10k ops", tasks.join_next()).await {
        let i = res.unwrap();
        assert!(!seen[i], "op {i} resolved twice");
        seen[i] = true;
    }
    assert!(seen.iter().all(|&s| s), "every op resolved");
    let stats = r.driver.stats();
    assert_eq!(stats.ops_in_table, 0, "{stats:?}");
    assert_eq!(
        stats.unknown, 0,
        "no completion matched the wrong op: {stats:?}"
    );
    println!(
        "10000 ops on 8 QPs / 1 CQ in {:?}: completions {} doorbells {} posted {} cq_events {}",
        started.elapsed(),
        stats.completions,
        stats.doorbells,
        stats.posted,
        stats.cq_events
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn cancellation_storm_with_drop_probes() {
    let r = rig(2, QpOptions::default());
    let arena =
        Arc::new(RegisteredBuffer::new(&r.pd, 4096 * 32, AccessFlags::LOCAL_WRITE).unwrap());
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut total_ops = 0u64;
    let (mut dropped_unpolled, mut dropped_posted, mut completed) = (0u64, 0u64, 0u64);
    let mut round = 0;
    let started = Instant::now();
    while total_ops < 100_000 {
        round += 1;
        let (a, b) = &r.pairs[round % 2];
        // Phase 1: receives on B, dropped at random points. No send is in flight, so a dropped
        // posted receive cannot have completed: its buffer must still be parked.
        // At most the receive queue's depth (256), so every polled receive is really posted
        // (beyond the depth a receive waits in the queue, and dropping it withdraws it).
        let n = 64 + rng.below(192) as usize;
        let mut live = Vec::new();
        let mut parked = Vec::new();
        for i in 0..n {
            let (buf, probe) = ProbeBuf::new(&arena, i % 4096, 32, 0);
            let mut fut = Box::pin(b.recv(buf));
            match rng.below(4) {
                0 => {
                    drop(fut); // never polled: nothing posted, buffer released now
                    assert_eq!(
                        Arc::strong_count(&probe),
                        1,
                        "unpolled op released its buffer"
                    );
                    dropped_unpolled += 1;
                }
                1 => {
                    // Posted (two polls with coalescing), then dropped.
                    assert!((&mut fut).now_or_never().is_none());
                    assert!((&mut fut).now_or_never().is_none());
                    drop(fut);
                    assert_eq!(
                        Arc::strong_count(&probe),
                        2,
                        "posted receive's buffer is parked, not released"
                    );
                    parked.push(probe);
                    dropped_posted += 1;
                }
                _ => {
                    // Posted (the second poll posts with coalescing) and kept.
                    assert!((&mut fut).now_or_never().is_none());
                    assert!((&mut fut).now_or_never().is_none());
                    live.push((fut, probe));
                }
            }
        }
        total_ops += n as u64;
        // Receives posted in phase 1: all but the ones dropped before their first poll.
        let posted_recvs = live.len() + parked.len();
        // Phase 2: sends from A until every posted receive has been consumed; send futures are
        // dropped at random points too (unpolled: nothing sent; polled: it may still be sent).
        let mut sends_done = 0usize;
        let mut live = live;
        let mut awaited = Vec::new();
        while sends_done < posted_recvs {
            let (mut buf, probe) =
                ProbeBuf::new(&arena, 4096 * 31 / 32 + (sends_done % 64), 32, 32);
            buf.init = 8;
            let fut = a.send(buf);
            total_ops += 1;
            if rng.below(8) == 0 {
                drop(fut);
                assert_eq!(Arc::strong_count(&probe), 1);
                dropped_unpolled += 1;
                continue;
            }
            let mut fut = Box::pin(fut);
            if rng.below(8) == 0 {
                // Poll until posted, then drop: the send still happens (every receive below
                // completes, which proves it), and the buffer is released once it completes.
                let _ = (&mut fut).now_or_never();
                let _ = (&mut fut).now_or_never();
                drop(fut);
                parked.push(probe);
                dropped_posted += 1;
            } else {
                awaited.push(async move {
                    let (res, buf) = fut.await;
                    res.unwrap();
                    drop(buf);
                    assert_eq!(Arc::strong_count(&probe), 1);
                });
            }
            sends_done += 1;
        }
        // The awaited sends run concurrently (posted together: few doorbells).
        completed += awaited.len() as u64;
        within(120, "sends", futures::future::join_all(awaited)).await;
        // Every live receive resolves exactly once.
        for (fut, probe) in live.drain(..) {
            let (res, buf) = within(60, "recv", fut).await;
            assert_eq!(res.unwrap().len, 8);
            drop(buf);
            assert_eq!(Arc::strong_count(&probe), 1);
            completed += 1;
        }
        // Parked buffers are released once their completions were applied.
        let deadline = Instant::now() + Duration::from_secs(60);
        while parked.iter().any(|p| Arc::strong_count(p) != 1) {
            assert!(
                Instant::now() < deadline,
                "parked buffers not released after their completions"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        wait_table_empty(&r.driver, "storm round").await;
    }
    let stats = r.driver.stats();
    assert_eq!(stats.unknown, 0, "{stats:?}");
    println!(
        "cancellation storm: {total_ops} ops in {round} rounds, {:?}: completed {completed}, dropped before poll {dropped_unpolled}, dropped after post {dropped_posted}; table empty, all probes released",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn qp_forced_to_error_mid_flight_resolves_everything_once() {
    let r = rig(1, QpOptions::default());
    let (a, b) = &r.pairs[0];
    let arena = Arc::new(RegisteredBuffer::new(&r.pd, 1 << 20, all_access()).unwrap());
    let remote = RemoteToken::new(arena.addr(), arena.len() as u64, arena.rkey());
    // Receives on B that will never be matched, plus a stream of writes and reads on A.
    let mut recvs = Vec::new();
    let mut probes = Vec::new();
    for i in 0..200 {
        let (buf, probe) = ProbeBuf::new(&arena, i, 1024, 0);
        probes.push(probe);
        recvs.push(tokio::spawn(b.recv(buf)));
    }
    let mut ops = Vec::new();
    for i in 0..500usize {
        let (buf, probe) = ProbeBuf::new(&arena, 200 + (i % 600), 1024, 1024);
        probes.push(probe);
        let rem = remote.slice(0..1024).unwrap();
        ops.push(if i % 2 == 0 {
            tokio::spawn(a.write(buf, rem).map(|(r, b)| (r.map(|_| ()), b)))
        } else {
            tokio::spawn(a.read(buf, rem).map(|(r, b)| (r.map(|_| ()), b)))
        });
    }
    tokio::task::yield_now().await;
    let forced = Instant::now();
    // Close both queue pairs mid-flight (moves them to ERR; every op resolves exactly once).
    let (ra, rb) = tokio::join!(a.close(), b.close());
    ra.unwrap();
    rb.unwrap();
    let (mut ok, mut failed) = (0, 0);
    for h in recvs {
        let (res, _buf) = within(60, "recv after ERR", h).await.unwrap();
        let err = res.unwrap_err();
        assert!(
            matches!(
                err,
                tokio_rdma::Error::QpFailed(tokio_rdma::QpFailure::Closed)
            ),
            "{err}"
        );
        failed += 1;
    }
    for h in ops {
        match within(60, "op after ERR", h).await.unwrap().0 {
            Ok(()) => ok += 1,
            // Flushed (the usual case), or failed by the transport before the flush.
            Err(tokio_rdma::Error::QpFailed(_)) => failed += 1,
            Err(e) => panic!("unexpected error {e}"),
        }
    }
    let elapsed = forced.elapsed();
    // New operations fail fast with the same cause.
    let (buf, _p) = ProbeBuf::new(&arena, 900, 64, 64);
    let (res, _) = a.send(buf).await;
    assert!(matches!(
        res,
        Err(tokio_rdma::Error::QpFailed(tokio_rdma::QpFailure::Closed))
    ));
    wait_table_empty(&r.driver, "after ERR").await;
    assert!(
        probes.iter().all(|p| Arc::strong_count(p) == 1),
        "every buffer came back"
    );
    println!(
        "forced ERR: 700 ops resolved exactly once ({ok} completed before the error, {failed} failed) within {elapsed:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn close_drains_and_drop_closes_in_background() {
    let r = rig(1, QpOptions::default());
    let Rig {
        pd,
        driver,
        mut pairs,
    } = r;
    let (a, b) = pairs.pop().unwrap();
    let arena = Arc::new(RegisteredBuffer::new(&pd, 64 * 100, AccessFlags::LOCAL_WRITE).unwrap());
    let mut probes = Vec::new();
    let mut handles = Vec::new();
    for i in 0..100 {
        let (buf, probe) = ProbeBuf::new(&arena, i, 64, 0);
        probes.push(probe);
        let fut = b.recv(buf);
        handles.push(tokio::spawn(fut));
    }
    tokio::task::yield_now().await;
    within(60, "close", b.close()).await.unwrap();
    for h in handles {
        let (res, _) = h.await.unwrap();
        assert!(matches!(
            res,
            Err(tokio_rdma::Error::QpFailed(tokio_rdma::QpFailure::Closed))
        ));
    }
    assert_eq!(b.outstanding(), 0);
    // Dropping a queue pair with posted receives: they are flushed in the background.
    let (buf, probe) = ProbeBuf::new(&arena, 0, 64, 0);
    let mut fut = Box::pin(a.recv(buf));
    assert!((&mut fut).now_or_never().is_none());
    assert!((&mut fut).now_or_never().is_none());
    drop(fut);
    drop(a);
    drop(b);
    let deadline = Instant::now() + Duration::from_secs(60);
    while Arc::strong_count(&probe) != 1 {
        assert!(
            Instant::now() < deadline,
            "dropped queue pair never released its buffers"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    wait_table_empty(&driver, "after drop").await;
    assert!(probes.iter().all(|p| Arc::strong_count(p) == 1));
}
