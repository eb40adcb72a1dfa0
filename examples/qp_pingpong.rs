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

use std::time::{Duration, Instant};

use tokio_rdma::buf::IoBuf;
use tokio_rdma::driver::{CompletionMode, Driver, DriverOptions, QpOptions};
use tokio_rdma::verbs::{
    AccessFlags, Context, PortState, ProtectionDomain, RegisteredBuffer, RtrOptions, RtsOptions,
};

struct Args {
    iters: usize,
    size: usize,
    mode: CompletionMode,
}

fn parse() -> Args {
    let mut a = Args {
        iters: 10_000,
        size: 64,
        mode: CompletionMode::default(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut val = || it.next().unwrap_or_else(|| panic!("{arg} needs a value"));
        match arg.as_str() {
            "--iters" => a.iters = val().parse().expect("--iters N"),
            "--size" => a.size = val().parse().expect("--size BYTES"),
            "--mode" => {
                a.mode = match val().as_str() {
                    "busy" => CompletionMode::BusyPoll,
                    "event" => CompletionMode::Event,
                    "adaptive" => CompletionMode::default(),
                    m => panic!("unknown mode {m}"),
                }
            }
            "--smoke" => a.iters = 200,
            "-h" | "--help" => {
                println!(
                    "usage: qp_pingpong [--iters N] [--size BYTES] [--mode busy|adaptive|event] [--smoke]"
                );
                std::process::exit(0);
            }
            other => panic!("unknown argument {other}"),
        }
    }
    a
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse();
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
    let driver = Driver::new(&ctx, DriverOptions::default().mode(args.mode))?;
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
    let iters = args.iters;
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
        let mut recv = Box::pin(b.recv(first));
        assert!(futures::poll!(&mut recv).is_pending());
        let _ = ready_tx.send(()); // the first ping may go now
        for i in 0..iters {
            let (res, rx) = recv.await;
            assert_eq!(res?.len, size, "ping {i} length");
            recv = Box::pin(b.recv(spare));
            assert!(futures::poll!(&mut recv).is_pending());
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
    let mut samples = Vec::with_capacity(iters);
    let total = Instant::now();
    for i in 0..iters {
        let t = Instant::now();
        let mut a_recv = Box::pin(a.recv(a_rx));
        assert!(
            futures::poll!(&mut a_recv).is_pending(),
            "pong receive posted"
        );
        let ((sres, p), (rres, rx)) = tokio::join!(a.send(ping.slice(0..size)), a_recv);
        samples.push(t.elapsed());
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

    samples.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!();
    println!(
        "pingpong: {} round trips of {} bytes, mode {:?}, {:.2} s",
        args.iters,
        args.size,
        args.mode,
        wall.as_secs_f64()
    );
    println!(
        " #bytes  #iters  t_min[us]  t_p50[us]  t_p90[us]  t_p99[us]  t_p99.9[us]  t_max[us]  (round trip)"
    );
    println!(
        " {:<7} {:<7} {:>9.2} {:>10.2} {:>10.2} {:>10.2} {:>12.2} {:>10.2}",
        args.size,
        args.iters,
        us(samples[0]),
        us(percentile(&samples, 0.50)),
        us(percentile(&samples, 0.90)),
        us(percentile(&samples, 0.99)),
        us(percentile(&samples, 0.999)),
        us(*samples.last().expect("samples"))
    );
    let stats = driver.stats();
    println!("driver: {stats:?}");
    Ok(())
}
