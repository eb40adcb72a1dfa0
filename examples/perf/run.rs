//! The measured loops, client and server side of each test.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio_rdma::buf::IoBuf;
use tokio_rdma::verbs::{AccessFlags, RegisteredBuffer};

use crate::args::{Test, TestConfig};
use crate::report::{CaseResult, StatsDelta, cpu_time, hw_counters, hw_delta};
use crate::setup::{Chunk, Ctrl, Res, Side, chunks};

/// Registered bytes a bandwidth test may use for distinct slots per queue pair.
pub(crate) const SLOT_BYTES: usize = 64 << 20;

/// Yields to the scheduler once by waking itself (no I/O-driver poll, unlike
/// `tokio::task::yield_now`), so the completion task runs between two polls of memory.
struct SelfYield(bool);

impl Future for SelfYield {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.0 {
            return Poll::Ready(());
        }
        self.0 = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

/// The iteration marker written into the last byte of a write_lat message (never 0).
pub fn marker(k: usize) -> u8 {
    (k % 255) as u8 + 1
}

/// Reads of the polled byte between two yields of [`wait_byte`]: as many as the driver's
/// in-place CQ polls in busy mode, so the memory wait spins like the CQ waits do (and like
/// perftest's, which never yields) while still letting the runtime run other tasks.
const MEMORY_POLLS: u32 = 64;

/// Spins until the last byte polled in `buf` at `off` is `want`: `MEMORY_POLLS` reads in
/// place, then a yield.
pub(crate) async fn wait_byte(buf: &RegisteredBuffer, off: usize, want: u8) {
    let mut b = [0u8; 1];
    loop {
        for _ in 0..MEMORY_POLLS {
            buf.read_at(off, &mut b);
            if b[0] == want {
                return;
            }
            std::hint::spin_loop();
        }
        SelfYield(false).await;
    }
}

fn reset_byte(buf: &mut RegisteredBuffer, off: usize) {
    buf.write_at(off, &[0]);
}

pub(crate) fn local_buf(side: &Side, len: usize) -> Res<RegisteredBuffer> {
    let mut b = RegisteredBuffer::new(&side.pd, len.max(1), AccessFlags::LOCAL_WRITE)?;
    b.as_mut_slice().expect("local").fill(0x5a);
    Ok(b)
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// The clock stamps of a latency loop: one clock read per iteration, stored, and the samples
/// (differences of consecutive stamps) computed after the loop
/// ([`report::lap_samples`](crate::report::lap_samples)), as perftest does (`get_cycles()`
/// into `tstamp[]` before each post; `print_report_lat` takes the differences). A sample is
/// the whole iteration, the loop's own bookkeeping included, and an iteration pays one
/// `clock_gettime(CLOCK_MONOTONIC)` (the clock `Instant` reads) and a store into reserved
/// memory. Subtracting and converting each sample in the loop cost ~60 more instructions per
/// operation in the callgrind counts of `scripts/bench-insn` (`Instant - Instant`,
/// `as_secs_f64`), which perftest does in its report, outside the loop the script counts; raw
/// stamps keep the report's arithmetic in the report (an `Instant`'s subtraction is a library
/// call the loop's other clock reads share, which the script would count in the loop).
pub struct Stamps(Vec<libc::timespec>);

impl Stamps {
    /// Stamps the start of a loop of `iters` iterations (room for every stamp is reserved now).
    pub fn start(iters: usize) -> Stamps {
        let mut s = Stamps(Vec::with_capacity(iters + 1));
        s.stamp();
        s
    }

    /// Stamps the end of an iteration.
    #[inline]
    pub fn stamp(&mut self) {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid out-parameter; CLOCK_MONOTONIC always exists on Linux.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
        self.0.push(ts);
    }

    /// The samples in µs of the iterations from `skip` on, each the time between its stamps
    /// times `scale` (perftest's latency sample: a read's whole time, half a ping-pong's round
    /// trip: see [`lat_scale`]).
    pub fn samples(&self, skip: usize, scale: f64, out: &mut Vec<f64>) {
        crate::report::lap_samples(&self.0, skip, scale, out);
    }
}

/// The factor of a latency test's sample: 1 for a read (its whole time), 1/2 for a ping-pong
/// (half its round trip), as perftest defines them.
pub fn lat_scale(test: Test) -> f64 {
    if test == Test::ReadLat { 1.0 } else { 0.5 }
}

/// Client side of one size.
pub async fn client_case(
    ctrl: &mut Ctrl,
    side: &mut Side,
    cfg: &TestConfig,
    size: usize,
) -> Res<CaseResult> {
    if cfg.test == Test::WriteLat {
        reset_byte(&mut side.exposed[0], size - 1);
    }
    let side = &*side;
    ctrl.send(&format!("run {size}")).await?;
    ctrl.expect("ready").await?;
    let mut samples = Vec::with_capacity(cfg.iters * cfg.qps);
    let mut start = Start::now(side);
    let mut mark = |k: usize| {
        if k == cfg.warmup {
            start = Start::now(side);
        }
    };
    let ops = if cfg.verbs {
        let all = crate::verbs_engine::client(side, cfg, size, &mut mark)?;
        samples.extend_from_slice(&all[cfg.warmup..]);
        cfg.iters as u64
    } else if cfg.batch {
        crate::batch_engine::bw_client(side, cfg, size, &mut samples, &mut mark).await?
    } else if cfg.owned && !cfg.test.is_lat() {
        crate::owned_engine::bw_client(side, cfg, size, &mut samples, &mut mark).await?
    } else if cfg.owned {
        let all = crate::owned_engine::client(side, cfg, size, &mut mark).await?;
        samples.extend_from_slice(&all[cfg.warmup..]);
        cfg.iters as u64
    } else {
        async_client(side, cfg, size, &mut samples, &mut mark).await?
    };
    let elapsed = start.t.elapsed();
    let cpu = cpu_time() - start.cpu;
    let stats = StatsDelta::between(&start.stats, &driver_stats(side));
    let hw = hw_delta(&start.hw, &hw_counters(&side.device, side.port));
    ctrl.send("done").await?;
    let peer = ctrl.expect("stats").await?;
    let peer_cpu = peer
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix("cpu_ns="))
        .and_then(|v| v.parse::<u64>().ok())
        .map(Duration::from_nanos);
    let peer_stats = StatsDelta::decode(&peer);
    samples.sort_by(f64::total_cmp);
    Ok(CaseResult {
        size,
        ops,
        samples,
        elapsed,
        cpu,
        peer_cpu,
        stats,
        peer_stats,
        hw,
    })
}

/// Counters at the start of the measured iterations.
struct Start {
    t: Instant,
    cpu: Duration,
    stats: tokio_rdma::driver::DriverStats,
    hw: Vec<(String, u64)>,
}

impl Start {
    fn now(side: &Side) -> Start {
        Start {
            stats: driver_stats(side),
            cpu: cpu_time(),
            hw: hw_counters(&side.device, side.port),
            t: Instant::now(),
        }
    }
}

fn driver_stats(side: &Side) -> tokio_rdma::driver::DriverStats {
    side.driver.as_ref().map(|d| d.stats()).unwrap_or_default()
}

/// The async engine's client loops; returns the number of measured operations.
async fn async_client(
    side: &Side,
    cfg: &TestConfig,
    size: usize,
    samples: &mut Vec<f64>,
    mark: &mut impl FnMut(usize),
) -> Res<u64> {
    if cfg.test.is_msg() {
        return crate::msg::client(side, cfg, size, samples, mark).await;
    }
    let total = cfg.warmup + cfg.iters;
    let qp = &side.qps[0];
    let ops;
    match cfg.test {
        Test::WriteLat => {
            let mut src = local_buf(side, size)?;
            let remote = side.remote[0].slice(0..size as u64)?;
            let mut clock = Stamps::start(total);
            for k in 0..total {
                mark(k);
                let m = marker(k);
                src.as_mut_slice().expect("local")[size - 1] = m;
                let ((res, s), ()) = tokio::join!(
                    qp.write(src.slice(0..size), remote),
                    wait_byte(&side.exposed[0], size - 1, m)
                );
                clock.stamp();
                res?;
                src = s.into_inner();
            }
            clock.samples(cfg.warmup, 0.5, samples);
            ops = cfg.iters as u64;
        }
        Test::SendLat => {
            let mut src = local_buf(side, size)?;
            let rx = local_buf(side, size)?;
            // Posted now; awaited (as `&mut`) in the loop. `start` posts without a poll, no
            // box or waker needed.
            let mut recv = qp.recv(rx);
            recv.start();
            let mut clock = Stamps::start(total);
            for k in 0..total {
                mark(k);
                // The send first, as perftest posts it first: once it is out, nothing waits
                // to be posted and both waits spin their full count at once (polled first,
                // the receive's first poll would poll once and yield, a runtime round per
                // round trip, for the send not yet posted beside it).
                let ((sres, s), (rres, rx)) = tokio::join!(qp.send(src.slice(0..size)), &mut recv);
                clock.stamp();
                sres?;
                let info = rres?;
                if info.len != size {
                    return Err(format!("pong of {} bytes, expected {size}", info.len).into());
                }
                src = s.into_inner();
                if k + 1 < total {
                    // The next pong's receive is posted before the next ping is sent.
                    recv = qp.recv(rx);
                    recv.start();
                }
            }
            clock.samples(cfg.warmup, 0.5, samples);
            ops = cfg.iters as u64;
        }
        Test::ReadLat => {
            let mut dst = local_buf(side, size)?;
            let remote = side.remote[0].slice(0..size as u64)?;
            let mut clock = Stamps::start(total);
            for k in 0..total {
                mark(k);
                let (res, d) = qp.read(dst.slice(0..size), remote).await;
                clock.stamp();
                res?;
                dst = d.into_inner();
            }
            clock.samples(cfg.warmup, 1.0, samples);
            ops = cfg.iters as u64;
        }
        Test::WriteBw | Test::SendBw | Test::ReadBw | Test::MsgLat | Test::MsgRate => {
            if cfg.warmup > 0 {
                bw_loop(side, cfg, size, cfg.warmup, &mut Vec::new()).await?;
            }
            mark(cfg.warmup);
            bw_loop(side, cfg, size, cfg.iters, samples).await?;
            ops = (cfg.iters * cfg.qps) as u64;
        }
    }
    Ok(ops)
}

/// The outcome of a [`BwOp`].
type BwOut = (tokio_rdma::Result<()>, Chunk);

/// One queue-pair operation of the bandwidth loops.
enum BwOp {
    Write(tokio_rdma::ops::Write<Chunk>),
    Read(tokio_rdma::ops::Read<Chunk>),
    Send(tokio_rdma::ops::Send<Chunk>),
}

impl Future for BwOp {
    type Output = BwOut;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut *self {
            BwOp::Write(f) => Pin::new(f).poll(cx),
            BwOp::Read(f) => Pin::new(f).poll(cx),
            BwOp::Send(f) => Pin::new(f).poll(cx),
        }
    }
}

/// Keeps `cfg.depth` operations in flight on every queue pair until each has done `iters`;
/// with `cfg.op_latency`, pushes each operation's post-to-completion time (us) into `samples`
/// (otherwise the loop reads no clock: the run's rate is timed by the caller).
///
/// A ring of operations, oldest first, as an application pipelines requests on RC queue pairs
/// (each completes its requests in order): await the oldest; take the ones behind it that are
/// complete too (one look each); start as many new ones, which a coalescing queue pair
/// queues, and post them together with one more look at the newest (one doorbell, signaled
/// as sparsely as the driver's batch allows). This is perftest's loop (poll a batch of
/// completions, post as many requests) written with the crate's futures; no allocation or
/// task per operation (a `FuturesUnordered` allocates a node for each).
async fn bw_loop(
    side: &Side,
    cfg: &TestConfig,
    size: usize,
    iters: usize,
    samples: &mut Vec<f64>,
) -> Res<()> {
    let start = |q: usize, c: Chunk| {
        let qp = &side.qps[q];
        match cfg.test {
            Test::WriteBw => {
                let r = side.remote[q]
                    .slice(0..size as u64)
                    .expect("token covers the size");
                BwOp::Write(qp.write(c, r))
            }
            Test::ReadBw => {
                let r = side.remote[q]
                    .slice(0..size as u64)
                    .expect("token covers the size");
                BwOp::Read(qp.read(c, r))
            }
            _ => BwOp::Send(qp.send(c)),
        }
    };
    let mut left = vec![iters; cfg.qps];
    // The operations in flight stay where they were started: one slot each (queue pair,
    // start time, the operation, and its outcome if a look while starting found it complete
    // already), and a ring of slot numbers, oldest first. Nothing moves an operation's future
    // once it is in its slot (a future is a few hundred bytes: a ring of futures copied each
    // one in and out, as perftest's loop copies nothing).
    let mut slots: Vec<BwSlot> = (0..cfg.depth * cfg.qps)
        .map(|_| BwSlot::default())
        .collect();
    let mut free: Vec<usize> = (0..slots.len()).rev().collect();
    let mut ring: VecDeque<usize> = VecDeque::with_capacity(slots.len());
    // Reused: the buffers of the operations completed in one look, to start again.
    let mut done: Vec<(usize, Chunk)> = Vec::with_capacity(cfg.depth * cfg.qps);
    let mut flushed = vec![false; cfg.qps];
    for (q, left) in left.iter_mut().enumerate() {
        let n = cfg.depth.min(*left);
        for c in chunks(&side.pd, size, n, SLOT_BYTES / cfg.qps)? {
            done.push((q, c));
        }
        *left -= n;
    }
    loop {
        // Start what completed (or the first batch): queued by their first polls, posted
        // together by one more poll of the newest of each queue pair.
        let fresh = ring.len();
        for (q, c) in done.drain(..) {
            let i = free.pop().expect("a slot per operation in flight");
            let slot = &mut slots[i];
            slot.q = q;
            slot.t = cfg.op_latency.then(Instant::now);
            let op = slot.op.insert(start(q, c));
            slot.out = match futures::poll!(op) {
                Poll::Ready(out) => Some(out),
                Poll::Pending => None,
            };
            ring.push_back(i);
        }
        flushed.fill(false);
        for &i in ring.iter().skip(fresh).rev() {
            let slot = &mut slots[i];
            if slot.out.is_none() && !std::mem::replace(&mut flushed[slot.q], true) {
                if let Poll::Ready(o) = futures::poll!(slot.op.as_mut().expect("in flight")) {
                    slot.out = Some(o);
                }
            }
        }
        // The oldest, then every one behind it already complete.
        let Some(i) = ring.pop_front() else {
            break;
        };
        let out = match slots[i].out.take() {
            Some(o) => o,
            None => slots[i].op.as_mut().expect("in flight").await,
        };
        let mut finish = |slot: &mut BwSlot, (res, c): BwOut| -> Res<()> {
            slot.op = None;
            res?;
            if let Some(t) = slot.t {
                samples.push(us(t.elapsed()));
            }
            if left[slot.q] > 0 {
                left[slot.q] -= 1;
                done.push((slot.q, c));
            }
            Ok(())
        };
        finish(&mut slots[i], out)?;
        free.push(i);
        while let Some(&i) = ring.front() {
            let slot = &mut slots[i];
            let out = match slot.out.take() {
                Some(o) => o,
                None => match futures::poll!(slot.op.as_mut().expect("in flight")) {
                    Poll::Ready(o) => o,
                    Poll::Pending => break,
                },
            };
            ring.pop_front();
            finish(slot, out)?;
            free.push(i);
        }
    }
    Ok(())
}

/// Where one operation of [`bw_loop`] stays while in flight.
#[derive(Default)]
struct BwSlot {
    q: usize,
    t: Option<Instant>,
    op: Option<BwOp>,
    out: Option<BwOut>,
}

/// Server side of one size (after `run SIZE`): prepares, says `ready`, plays its part, waits
/// for `done`, and answers with its CPU time and driver counters.
pub async fn server_case(
    ctrl: &mut Ctrl,
    side: &mut Side,
    cfg: &TestConfig,
    size: usize,
) -> Res<()> {
    if cfg.test == Test::WriteLat && !side.exposed.is_empty() {
        // The byte the peer's writes land on starts at 0 (a marker is never 0).
        reset_byte(&mut side.exposed[0], size - 1);
    }
    let side = &*side;
    let total = cfg.warmup + cfg.iters;
    let cpu0 = cpu_time();
    let stats0 = driver_stats(side);
    let finish = async |ctrl: &mut Ctrl| -> Res<()> {
        ctrl.expect("done").await?;
        let cpu = cpu_time() - cpu0;
        let st = StatsDelta::between(&stats0, &driver_stats(side));
        ctrl.send(&format!("stats cpu_ns={} {}", cpu.as_nanos(), st.encode()))
            .await?;
        Ok(())
    };
    if cfg.verbs {
        crate::verbs_engine::server(side, cfg, size, async || ctrl.send("ready").await).await?;
        return finish(ctrl).await;
    }
    if cfg.owned {
        crate::owned_engine::server(side, cfg, size, async || ctrl.send("ready").await).await?;
        return finish(ctrl).await;
    }
    if cfg.test.is_msg() {
        ctrl.send("ready").await?;
        crate::msg::server(side, cfg, size).await?;
        return finish(ctrl).await;
    }
    let qp = &side.qps[0];
    match cfg.test {
        Test::WriteLat => {
            let mut src = local_buf(side, size)?;
            let remote = side.remote[0].slice(0..size as u64)?;
            ctrl.send("ready").await?;
            for k in 0..total {
                let m = marker(k);
                wait_byte(&side.exposed[0], size - 1, m).await;
                src.as_mut_slice().expect("local")[size - 1] = m;
                let (res, s) = qp.write(src.slice(0..size), remote).await;
                res?;
                src = s.into_inner();
            }
        }
        Test::SendLat => {
            let mut src = local_buf(side, size)?;
            let rx = local_buf(side, size)?;
            let mut recv = qp.recv(rx);
            recv.start();
            ctrl.send("ready").await?;
            for k in 0..total {
                let (res, rx) = (&mut recv).await;
                res?;
                if k + 1 < total {
                    // Post the next ping's receive before answering this one.
                    recv = qp.recv(rx);
                    recv.start();
                }
                let (res, s) = qp.send(src.slice(0..size)).await;
                res?;
                src = s.into_inner();
            }
        }
        Test::SendBw => {
            // A ring of started receives, awaited oldest first (a queue pair completes its
            // receives in the order they were posted): no allocation or task per receive, as
            // an application's receive loop would be written.
            let per_qp = total; // warmup and measured sends both arrive here
            let mut ring = VecDeque::with_capacity(cfg.rx_depth.min(per_qp) * cfg.qps);
            let mut posted = vec![0usize; cfg.qps];
            for (q, qp) in side.qps.iter().enumerate() {
                let n = cfg.rx_depth.min(per_qp);
                for c in chunks(&side.pd, size, n, SLOT_BYTES / cfg.qps)? {
                    let mut r = qp.recv(c);
                    // Posted now, before the client is told to start.
                    r.start();
                    ring.push_back((q, r));
                }
                posted[q] = n;
            }
            ctrl.send("ready").await?;
            let mut need = per_qp * cfg.qps;
            while need > 0 {
                let Some((q, mut r)) = ring.pop_front() else {
                    break;
                };
                let (res, c) = (&mut r).await;
                res?;
                need -= 1;
                if posted[q] < per_qp {
                    posted[q] += 1;
                    let mut r = side.qps[q].recv(c);
                    r.start();
                    ring.push_back((q, r));
                }
            }
        }
        Test::ReadLat | Test::WriteBw | Test::ReadBw | Test::MsgLat | Test::MsgRate => {
            ctrl.send("ready").await?;
        }
    }
    finish(ctrl).await
}
