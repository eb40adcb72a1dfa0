//! The stack users put on a stream, over `RdmaStream` and, in the same run, over TCP loopback:
//! tokio-util's `Framed` + `LengthDelimitedCodec`, hyper 1.x HTTP/1.1 (keep-alive) and HTTP/2
//! (multiplexed), and a tonic gRPC service (unary and server streaming). Every payload is
//! checked (the run exits non-zero on any mismatch); each scenario prints requests/s and p50
//! for both transports, next to raw ping-pong baselines of the same size (a `Connection`
//! message ping-pong and a `TcpStream` ping-pong), so the cost of the stack on each transport
//! can be compared: (p50 over RdmaStream / p50 raw Connection) against (p50 over TcpStream /
//! p50 raw TCP).
//!
//! ```text
//! stack                      # every scenario, both ends in this process, on 192.0.2.1 (rxe0 in the VM)
//! stack --smoke http2 grpc   # a few seconds each (the test suite's run)
//! stack --addr 10.0.0.1 --iters 5000
//! stack --net rdma --no-baseline --streams 0 --iters 2000 http2   # one row, for a profiler
//! ```
//!
//! docs/ecosystem.md explains the glue; docs/benchmarks-stack.md has a table from the VM.
#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    missing_docs,
    unreachable_pub
)]

mod baseline;
mod framed;
mod grpc;
mod http;
mod net;

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use net::{Load, Measured, Net, Res, Rows};

/// A scenario of the stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Scenario {
    /// tokio-util Framed + LengthDelimitedCodec
    Framed,
    /// hyper HTTP/1.1 keep-alive
    Http1,
    /// hyper HTTP/2, multiplexed
    Http2,
    /// tonic gRPC, unary and server streaming
    Grpc,
}

/// hyper, tonic and tokio-util over RdmaStream, measured against TCP loopback in the same run.
#[derive(Debug, Parser)]
struct Args {
    /// Scenarios to run [default: all]
    #[arg(value_enum)]
    scenarios: Vec<Scenario>,
    /// IP address of the RDMA device's link (both ends run in this process) [default:
    /// $TOKIO_RDMA_ADDR's IP, else 192.0.2.1, rxe0 in the soft-RoCE VM]
    #[arg(long)]
    addr: Option<IpAddr>,
    /// First RDMA CM port; each scenario uses the next one
    #[arg(long, default_value_t = 7480)]
    port: u16,
    /// Sequential measured round trips per row [default: 5000, 30 with --smoke]
    #[arg(long)]
    iters: Option<u64>,
    /// The small request size in bytes (the raw baselines use it too)
    #[arg(long, default_value_t = 64)]
    small: usize,
    /// Small counts: a few seconds per scenario in the soft-RoCE VM (the test suite's run)
    #[arg(long)]
    smoke: bool,
    /// Run on this transport only (no comparison table) [default: both]
    #[arg(long, value_enum)]
    net: Option<Only>,
    /// Concurrent HTTP/2 streams of the multiplexed row; 0 skips that row
    #[arg(long, default_value_t = 8)]
    streams: u64,
    /// Skip the raw ping-pong baselines (the table then has no ratio to them)
    #[arg(long)]
    no_baseline: bool,
}

/// One transport, for `--net`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Only {
    /// RdmaStream (and the raw Connection baseline)
    Rdma,
    /// TcpStream on loopback (and the raw TCP baseline)
    Tcp,
}

/// A scenario's rows over both transports.
struct Compared {
    name: &'static str,
    rdma: Measured,
    tcp: Measured,
}

async fn run(scenario: Scenario, net: Net, load: Load) -> Res<Rows> {
    let work = async {
        match scenario {
            Scenario::Framed => framed::run(net, load).await,
            Scenario::Http1 => http::run_h1(net, load).await,
            Scenario::Http2 => http::run_h2(net, load).await,
            Scenario::Grpc => grpc::run(net, load).await,
        }
    };
    // Generous: only turns a hang into a failure (the VM is slow and noisy).
    tokio::time::timeout(Duration::from_secs(300), work)
        .await
        .map_err(|_| format!("{scenario:?} over {net}: no result after 300 s"))?
}

fn print_rows(scenario: Scenario, net: Net, rows: &Rows, took: Duration) {
    for (name, m) in rows {
        let mut line = format!(
            "{:<6} {:<24} {:>6} requests {:>8.0}/s",
            net.to_string(),
            name,
            m.requests,
            m.rate(),
        );
        if !m.hist.is_empty() {
            line += &format!("  p50 {:>9.1} us  p99 {:>9.1} us", m.p50_us(), m.p99_us());
        }
        if m.bytes > 0 {
            line += &format!("  {:>7.2} MB/s", m.mb_per_s());
        }
        println!("{line}");
    }
    println!(
        "       {scenario:?} over {net}: every payload checked, {:.1} s with setup",
        took.as_secs_f64()
    );
}

/// The final table: both transports side by side, and for the small rows the stack's cost
/// over the raw ping-pong on each transport.
fn print_table(
    rows: &[Compared],
    raw_rdma: Option<&Measured>,
    raw_tcp: Option<&Measured>,
    small: usize,
) {
    let raw = raw_rdma.zip(raw_tcp);
    if let Some((raw_rdma, raw_tcp)) = raw {
        println!();
        println!(
            "raw ping-pong of {small} B: RDMA Connection p50 {:.1} us ({:.0}/s), TCP p50 {:.1} us ({:.0}/s)",
            raw_rdma.p50_us(),
            raw_rdma.rate(),
            raw_tcp.p50_us(),
            raw_tcp.rate()
        );
    }
    println!();
    println!(
        "| scenario | RDMA req/s | TCP req/s | req/s RDMA/TCP | RDMA p50 us | TCP p50 us | p50 RDMA/TCP | RDMA p50 / raw Connection | TCP p50 / raw TCP | (RDMA/raw) / (TCP/raw) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        let (a, b) = (&r.rdma, &r.tcp);
        let ratio = if let Some((raw_rdma, raw_tcp)) = raw.filter(|_| r.name.ends_with("small")) {
            let x = a.p50_us() / raw_rdma.p50_us();
            let y = b.p50_us() / raw_tcp.p50_us();
            format!("{x:.2} | {y:.2} | {:.2}", x / y)
        } else {
            "- | - | -".to_string()
        };
        let p50 = if a.hist.is_empty() || b.hist.is_empty() {
            format!(
                "- | - | - (MB/s: {:.2} vs {:.2})",
                a.mb_per_s(),
                b.mb_per_s()
            )
        } else {
            format!(
                "{:.1} | {:.1} | {:.2}",
                a.p50_us(),
                b.p50_us(),
                a.p50_us() / b.p50_us()
            )
        };
        println!(
            "| {} | {:.1} | {:.1} | {:.2} | {p50} | {ratio} |",
            r.name,
            a.rate(),
            b.rate(),
            a.rate() / b.rate(),
        );
    }
}

async fn main_inner(args: Args) -> Res<()> {
    let ip = args.addr.unwrap_or_else(|| {
        std::env::var("TOKIO_RDMA_ADDR")
            .ok()
            .and_then(|a| a.parse::<SocketAddr>().ok().map(|s| s.ip()))
            .unwrap_or(IpAddr::from([192, 0, 2, 1]))
    });
    let iters = args.iters.unwrap_or(if args.smoke { 30 } else { 5000 });
    let load = Load {
        iters,
        small: args.small,
        frames: if args.smoke { 24 } else { 2000 },
        large: if args.smoke { 1 } else { 50 },
        streams: args.streams,
        stream_msgs: if args.smoke { 20 } else { 200 },
    };
    let scenarios = if args.scenarios.is_empty() {
        vec![
            Scenario::Framed,
            Scenario::Http1,
            Scenario::Http2,
            Scenario::Grpc,
        ]
    } else {
        args.scenarios.clone()
    };
    let rdma_at = |i: u16| Net::Rdma(SocketAddr::new(ip, args.port + i));
    println!("stack: {scenarios:?} over RDMA ({ip}) and TCP loopback, {load:?}");

    let (rdma_on, tcp_on) = (args.net != Some(Only::Tcp), args.net != Some(Only::Rdma));
    let mut raw_rdma = None;
    let mut raw_tcp = None;
    if !args.no_baseline && rdma_on {
        let m = baseline::rdma(SocketAddr::new(ip, args.port), load.small, iters).await?;
        println!(
            "RDMA   raw Connection ping-pong      {:>7} requests {:>10.0}/s  p50 {:>9.1} us",
            m.requests,
            m.rate(),
            m.p50_us()
        );
        raw_rdma = Some(m);
    }
    if !args.no_baseline && tcp_on {
        let m = baseline::tcp(load.small, iters).await?;
        println!(
            "TCP    raw TcpStream ping-pong       {:>7} requests {:>10.0}/s  p50 {:>9.1} us",
            m.requests,
            m.rate(),
            m.p50_us()
        );
        raw_tcp = Some(m);
    }

    let mut table = Vec::new();
    for (i, &scenario) in scenarios.iter().enumerate() {
        let mut rdma = Rows::new();
        let mut tcp = Rows::new();
        if rdma_on {
            let t = Instant::now();
            rdma = run(scenario, rdma_at(1 + i as u16), load).await?;
            print_rows(scenario, rdma_at(0), &rdma, t.elapsed());
        }
        if tcp_on {
            let t = Instant::now();
            tcp = run(scenario, Net::Tcp, load).await?;
            print_rows(scenario, Net::Tcp, &tcp, t.elapsed());
        }
        for ((name, a), (_, b)) in rdma.into_iter().zip(tcp) {
            table.push(Compared {
                name,
                rdma: a,
                tcp: b,
            });
        }
    }
    if rdma_on && tcp_on {
        print_table(&table, raw_rdma.as_ref(), raw_tcp.as_ref(), load.small);
    }
    Ok(())
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    if let Err(e) = main_inner(args).await {
        eprintln!("stack: FAILED: {e}");
        std::process::exit(1);
    }
    println!("stack: ok (every payload checked)");
}
