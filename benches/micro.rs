//! Host micro-benchmarks (criterion, no RDMA device): the per-operation software costs of the
//! async layer that the soft-RoCE numbers cannot isolate.
//!
//! * `core/*`: the sans-IO op table (`core::Core`): submit -> take_postable -> complete ->
//!   poll_op for one operation and for a batch of 32 (one post, one signaled completion).
//! * `waker/*`: waker dispatch: a future registers its waker (`poll_op` pending), the
//!   completion collects it, and it is woken (an `Arc` waker, as a Tokio task's is).
//! * `pool/*`: `buf::Pool` acquire/release over a fake registrar (implemented here through the
//!   public `Registrar` trait; the crate's own fake is test-only).
//! * `wr/*`: building work requests through the public API: `core::WorkRequest` + `SgList`
//!   for one and four SGEs, and the `verbs::SendWr` list the driver builds for every post.
//!   (The final `ibv_send_wr` translation, `SendWr::raw`, is crate-private.)
//! * `token/*`: remote-token checks and endpoint encoding done per operation / connection.
//!
//! `cargo bench --bench micro` (add `-- --quick` for a shorter run).

#![allow(missing_docs, clippy::print_stdout)]

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::task::{Context, Poll, Wake, Waker};

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use tokio_rdma::buf::{IoBuf, Pool, PoolConfig, Registrar, Registration, RemoteToken, SizeClass};
use tokio_rdma::proto::{Completed, Core, Cqe, QpConfig, SgList, WorkRequest};
use tokio_rdma::verbs::{AccessFlags, Gid, HugePages, Mtu, QpAddress, SendOp, SendWr, Sge};

/// A registrar that hands out made-up keys without touching a device.
#[derive(Debug, Default)]
struct FakeRegistrar {
    next: AtomicU32,
}

#[derive(Debug)]
struct FakeReg(u32);

impl Registration for FakeReg {
    fn lkey(&self) -> u32 {
        self.0
    }
}

impl Registrar for FakeRegistrar {
    unsafe fn register(
        &self,
        _addr: *mut u8,
        _len: usize,
        _access: AccessFlags,
    ) -> tokio_rdma::Result<Box<dyn Registration>> {
        Ok(Box::new(FakeReg(
            0x100 + self.next.fetch_add(1, Ordering::Relaxed),
        )))
    }
}

/// A waker that counts its wakes (an `Arc` allocation, like a Tokio task's waker).
struct CountWaker(AtomicU64);

impl Wake for CountWaker {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

fn sge() -> Sge {
    Sge::new(0x7f00_0000_1000, 64, 0x1234)
}

fn write_op() -> SendOp {
    SendOp::Write {
        remote_addr: 0x5000,
        rkey: 0x77,
    }
}

/// The payload an operation parks in the driver's table (a boxed `Any`).
type Payload = Box<dyn std::any::Any + Send>;

fn bench_core(c: &mut Criterion) {
    let mut g = c.benchmark_group("core");
    let noop = futures::task::noop_waker();
    let mut cx = Context::from_waker(&noop);

    // One operation through its whole life, as a latency-bound ping-pong does it.
    let mut core: Core<Payload> = Core::new();
    let qp = core.add_qp(QpConfig::new(256, 256, 16)).unwrap();
    let mut posts = Vec::new();
    let mut done = Completed::default();
    let sges = [sge()];
    g.throughput(Throughput::Elements(1));
    g.bench_function("op_cycle", |b| {
        b.iter(|| {
            let payload: Payload = Box::new(0u64);
            let sub = core
                .submit(qp, WorkRequest::send(write_op(), &sges), payload)
                .unwrap_or_else(|_| panic!("submit"));
            posts.clear();
            core.take_postable(qp, &mut posts);
            assert!(core.poll_op(sub.wr_id, &mut cx).is_pending());
            core.complete(&Cqe::success(sub.wr_id, 0), &mut done);
            done.clear();
            match core.poll_op(sub.wr_id, &mut cx) {
                Poll::Ready((res, p)) => {
                    black_box((res.is_ok(), p));
                }
                Poll::Pending => panic!("completed"),
            }
        })
    });

    // 32 operations posted together (signal_every 16: two signaled), one completion each for
    // the signaled ones, as a bandwidth test does it.
    g.throughput(Throughput::Elements(32));
    g.bench_function("batch32", |b| {
        let mut ids = Vec::with_capacity(32);
        b.iter(|| {
            ids.clear();
            for _ in 0..32 {
                let payload: Payload = Box::new(0u64);
                let sub = core
                    .submit(qp, WorkRequest::send(write_op(), &sges), payload)
                    .unwrap_or_else(|_| panic!("submit"));
                ids.push(sub.wr_id);
            }
            posts.clear();
            core.take_postable(qp, &mut posts);
            for &id in &ids {
                let _ = core.poll_op(id, &mut cx);
            }
            for p in posts.iter().filter(|p| p.signaled) {
                core.complete(&Cqe::success(p.wr_id, 0), &mut done);
            }
            done.clear();
            for &id in &ids {
                black_box(core.poll_op(id, &mut cx).is_ready());
            }
        })
    });
    g.finish();
}

fn bench_waker(c: &mut Criterion) {
    let mut g = c.benchmark_group("waker");
    let counter = Arc::new(CountWaker(AtomicU64::new(0)));
    let waker = Waker::from(counter.clone());
    let mut cx = Context::from_waker(&waker);
    let mut core: Core<u64> = Core::new();
    let qp = core.add_qp(QpConfig::new(256, 256, 1)).unwrap();
    let mut posts = Vec::new();
    let mut done = Completed::default();
    g.throughput(Throughput::Elements(1));
    g.bench_function("register_complete_wake", |b| {
        b.iter(|| {
            let sub = core
                .submit(qp, WorkRequest::recv(&[sge()]), 7)
                .unwrap_or_else(|_| panic!("submit"));
            posts.clear();
            core.take_postable(qp, &mut posts);
            // The future's first poll clones its waker into the table.
            assert!(core.poll_op(sub.wr_id, &mut cx).is_pending());
            core.complete(&Cqe::success(sub.wr_id, 8), &mut done);
            // The driver wakes outside its lock.
            for w in done.wakers.drain(..) {
                w.wake();
            }
            black_box(core.poll_op(sub.wr_id, &mut cx).is_ready());
        })
    });
    // The bare cost of one Arc waker clone + wake (the floor of the above).
    g.bench_function("clone_wake", |b| {
        b.iter(|| {
            let w = black_box(&waker).clone();
            w.wake();
        })
    });
    g.finish();
    assert!(counter.0.load(Ordering::Relaxed) > 0);
}

fn bench_pool(c: &mut Criterion) {
    let mut g = c.benchmark_group("pool");
    let cfg = PoolConfig::default()
        .classes([SizeClass::new(4 << 10, 256), SizeClass::new(64 << 10, 16)])
        .huge_pages(HugePages::Never)
        .memory_windows(false);
    let pool = Pool::new(&FakeRegistrar::default(), cfg).expect("pool over the fake registrar");
    g.throughput(Throughput::Elements(1));
    g.bench_function("try_acquire_release_4k", |b| {
        b.iter(|| {
            let buf = pool
                .try_acquire(black_box(1000))
                .expect("ok")
                .expect("free");
            black_box(buf.lkey());
        })
    });
    g.bench_function("try_acquire_release_64k", |b| {
        b.iter(|| {
            let buf = pool
                .try_acquire(black_box(60_000))
                .expect("ok")
                .expect("free");
            black_box(buf.lkey());
        })
    });
    g.bench_function("acquire_async_4k", |b| {
        b.iter(|| {
            let buf = futures::executor::block_on(pool.acquire(black_box(1000))).expect("ok");
            black_box(buf.lkey());
        })
    });
    // Sixteen held at once, released in reverse (free-list pushes and pops under churn).
    g.throughput(Throughput::Elements(16));
    g.bench_function("hold16_4k", |b| {
        b.iter_batched_ref(
            || Vec::with_capacity(16),
            |held| {
                for _ in 0..16 {
                    held.push(pool.try_acquire(4096).expect("ok").expect("free"));
                }
                held.clear();
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

fn bench_wr(c: &mut Criterion) {
    let mut g = c.benchmark_group("wr");
    let one = [sge()];
    let four = [sge(), sge(), sge(), sge()];
    g.throughput(Throughput::Elements(1));
    g.bench_function("work_request_1sge", |b| {
        b.iter(|| black_box(WorkRequest::send(black_box(write_op()), black_box(&one))))
    });
    g.bench_function("work_request_4sge", |b| {
        b.iter(|| black_box(WorkRequest::send(black_box(write_op()), black_box(&four))))
    });
    g.bench_function("sglist_from_vec_1sge", |b| {
        // What an operation future does: collect the buffer's entries, then SgList::from_slice.
        b.iter(|| {
            let mut v = Vec::new();
            black_box(&mut v).extend([black_box(sge())]);
            black_box(SgList::from_slice(&v))
        })
    });
    // What the driver builds from the core's post items for every post (one Vec per post).
    let mut core: Core<u64> = Core::new();
    let qp = core.add_qp(QpConfig::new(256, 256, 16)).unwrap();
    let mut posts = Vec::new();
    for i in 0..32 {
        core.submit(qp, WorkRequest::send(write_op(), &one), i)
            .unwrap_or_else(|_| panic!("submit"));
    }
    core.take_postable(qp, &mut posts);
    for (n, label) in [(1, "send_wr_list_1"), (32, "send_wr_list_32")] {
        g.throughput(Throughput::Elements(n as u64));
        g.bench_function(label, |b| {
            b.iter(|| {
                let wrs: Vec<SendWr<'_>> = posts[..n]
                    .iter()
                    .map(|p| {
                        let mut w = SendWr::new(p.wr_id, p.wr.op, p.wr.sges.as_slice());
                        w.signaled = p.signaled;
                        w.inline = p.wr.inline;
                        w
                    })
                    .collect();
                black_box(wrs)
            })
        });
    }
    g.finish();
}

fn bench_token(c: &mut Criterion) {
    let mut g = c.benchmark_group("token");
    let t = RemoteToken::new(0x10_0000, 1 << 20, 0x99);
    g.bench_function("slice_check", |b| {
        b.iter(|| {
            black_box(t)
                .slice(black_box(4096u64)..black_box(8192u64))
                .expect("in range")
        })
    });
    let ep = QpAddress {
        qpn: 0x11,
        psn: 0x22,
        gid: Gid([3; 16]),
        lid: 0,
        mtu: Mtu::Mtu1024,
    };
    g.bench_function("endpoint_round_trip", |b| {
        b.iter(|| QpAddress::from_bytes(&black_box(ep).to_bytes()).expect("valid"))
    });
    let v = vec![0u8; 64];
    g.bench_function("iobuf_slice", |b| {
        b.iter(|| black_box(black_box(v.clone()).slice(0..32)))
    });
    g.finish();
}

criterion_group!(
    benches,
    bench_core,
    bench_waker,
    bench_pool,
    bench_wr,
    bench_token
);
criterion_main!(benches);
