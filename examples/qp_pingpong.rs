//! Ping-pong latency over RDMA SEND/RECV at the queue-pair level (no RDMA CM, no flow
//! control): two `AsyncQp`s connected directly. See `pingpong.rs` for the connection API.
//!
//! With no arguments, both ends run in this process on the first active device (rxe0 in the
//! soft-RoCE VM): queue pair A sends a message, B echoes it back, and the round-trip times go
//! into a perftest-style latency table.
//!
//! ```text
//! cargo run --release --example qp_pingpong -- [--iters N] [--size BYTES] [--mode busy|adaptive|event] [--smoke]
//! ```
#![allow(clippy::print_stdout, clippy::print_stderr)]

mod common;

use std::time::Instant;

use clap::Parser;
use tokio_rdma::buf::IoBuf;
use tokio_rdma::driver::{CompletionMode, Driver, DriverOptions, QpOptions};
use tokio_rdma::verbs::{
    AccessFlags, Context, PortState, ProtectionDomain, RegisteredBuffer, RtrOptions, RtsOptions,
};

/// Ping-pong latency over RDMA SEND/RECV between two queue pairs of this process, on the
/// first active device (no RDMA CM, no flow control).
#[derive(Debug, Parser)]
struct Args {
    /// Measured round trips [default: 10000, 200 with --smoke]
    #[arg(long, value_name = "N")]
    iters: Option<usize>,
    /// Message size in bytes
    #[arg(long, value_name = "BYTES", default_value_t = 64)]
    size: usize,
    /// How the driver waits for completions
    #[arg(long, value_enum, default_value_t = Mode::Adaptive)]
    mode: Mode,
    /// Small iteration count (the test suite's smoke run)
    #[arg(long)]
    smoke: bool,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Mode {
    /// Poll the completion queue without sleeping
    Busy,
    /// Spin a while, then sleep on the completion channel (the driver's default)
    Adaptive,
    /// Sleep on the completion channel
    Event,
}

impl Mode {
    fn completion_mode(self) -> CompletionMode {
        match self {
            Mode::Busy => CompletionMode::BusyPoll,
            Mode::Adaptive => CompletionMode::default(),
            Mode::Event => CompletionMode::Event,
        }
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let iters = args.iters.unwrap_or(if args.smoke { 200 } else { 10_000 });
    let mode = args.mode.completion_mode();
    for dev in tokio_rdma::verbs::devices()? {
        println!("device: {} (guid {:#018x})", dev.name, dev.guid);
    }
    let (ctx, port) = Context::open_first_active()?;
    let attr = ctx.query_port(port)?;
    assert_eq!(attr.state, PortState::Active);
    let gid = ctx.preferred_gid(port)?;
    println!(
        "using {} port {port}, gid {} (index {}), mtu {:?}",
        ctx.name(),
        gid.gid,
        gid.index,
        attr.active_mtu
    );

    let pd = ProtectionDomain::new(&ctx)?;
    let driver = Driver::new(&ctx, DriverOptions::default().mode(mode))?;
    // Post on first poll: the receives below are posted before the message they wait for is
    // sent (a send that finds no receive is NAKed and retried after the RNR timer).
    let mut opts = QpOptions::default();
    opts.coalesce = false;
    let a = driver.create_qp(&pd, opts)?;
    let b = driver.create_qp(&pd, opts)?;
    let (ea, eb) = (
        a.verbs().local_address(port, Some(gid.index))?,
        b.verbs().local_address(port, Some(gid.index))?,
    );
    let rtr = RtrOptions::new(port, gid.index as u8);
    a.verbs()
        .connect(&ea, &eb, &rtr, &RtsOptions::default(), AccessFlags::NONE)?;
    b.verbs()
        .connect(&eb, &ea, &rtr, &RtsOptions::default(), AccessFlags::NONE)?;

    let len = args.size.max(1);
    let size = args.size;
    let mut ping = RegisteredBuffer::new(&pd, len, AccessFlags::LOCAL_WRITE)?;
    ping.as_mut_slice().expect("local buffer").fill(0xab);
    let mut a_rx = RegisteredBuffer::new(&pd, len, AccessFlags::LOCAL_WRITE)?;
    let b_bufs = [
        RegisteredBuffer::new(&pd, len, AccessFlags::LOCAL_WRITE)?,
        RegisteredBuffer::new(&pd, len, AccessFlags::LOCAL_WRITE)?,
    ];

    // B: an echo task. Its receive for the next ping is posted before it echoes the current
    // one, so a ping never finds the receive queue empty.
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
    let echo = tokio::spawn(async move {
        let [first, mut spare] = b_bufs;
        let mut recv = b.recv(first);
        recv.start(); // posted: the first ping may go now
        let _ = ready_tx.send(());
        for i in 0..iters {
            let (res, rx) = recv.await;
            assert_eq!(res?.len, size, "ping {i} length");
            recv = b.recv(spare);
            recv.start();
            let (res, rx) = b.send(rx.slice(0..size)).await;
            res?;
            spare = rx.into_inner();
        }
        drop(recv);
        Ok::<_, tokio_rdma::Error>(b)
    });

    // A: the client, timing round trips: send the ping and wait for the pong (the send's own
    // completion is awaited in parallel, as perftest harvests it).
    ready_rx.await?;
    let mut hist = common::histogram();
    let total = Instant::now();
    for i in 0..iters {
        let t = Instant::now();
        let mut a_recv = a.recv(a_rx);
        a_recv.start(); // the pong's receive, posted before the ping
        let ((sres, p), (rres, rx)) = tokio::join!(a.send(ping.slice(0..size)), a_recv);
        common::record(&mut hist, t.elapsed());
        sres?;
        ping = p.into_inner();
        assert_eq!(rres?.len, size, "pong {i} length");
        a_rx = rx;
    }
    let wall = total.elapsed();
    assert_eq!(
        &a_rx.as_slice().expect("local")[..size],
        &vec![0xab; size][..],
        "pong payload"
    );
    let _b = echo.await??;

    println!();
    common::latency_table(
        &format!(
            "pingpong: {iters} round trips of {size} bytes, mode {mode:?}, {:.2} s",
            wall.as_secs_f64()
        ),
        size,
        &hist,
    );
    let stats = driver.stats();
    println!("driver: {stats:?}");
    Ok(())
}
