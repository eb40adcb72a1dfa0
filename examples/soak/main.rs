//! The soak: hours of traffic on a bad wire between the two VMs of `scripts/rxe-pair`
//! (`scripts/soak` runs it; docs/faults.md, "Soak", has the figures).
//!
//! ```text
//! scripts/rxe-pair -- target/debug/examples/soak --duration 2m
//! ```
//! Side B is a supervisor: it runs the server (this binary with `--worker`) as a child and
//! kills and restarts it when A asks. The server listens on two endpoints, one with a shared
//! receive queue and one with private pools, grants each session a region, checks every
//! message (sequence number, checksum, the sender's last successful send) and answers each.
//! Side A runs `--conns` clients with churn (connect, a random number of operations, then a
//! clean close, an abrupt close or a drop), mixed sizes (copied chunks, zero-copy
//! `send_bytes`, rendezvous), one-sided writes and reads on the server's grant (read back and
//! checked by the server), random cancellation of connect, send, send_bytes, recv, write, read
//! and close futures, and injects faults from the fault suite's menu. A samples RSS, fds,
//! device resources and latency every `--interval`, writes an SVG and a summary, and exits
//! non-zero on any corrupt, lost or duplicated message, hang or leak.
#![allow(clippy::print_stdout, clippy::print_stderr)]
// A test program: its items are internal, not an API.
#![allow(missing_docs, unreachable_pub, missing_debug_implementations)]

mod client;
#[path = "../fault_peer/ctl.rs"]
#[allow(dead_code, reason = "the soak uses the fault requests only")]
mod ctl;
mod faults;
mod peer;
#[path = "../common/proc_stats.rs"]
mod proc_stats;
mod report;
mod run;
mod svg;
mod wire;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use clap::Parser;

/// Port of the server's private-pool endpoint; the shared-receive-queue one is the next.
pub const PORT: u16 = 7800;
/// Size of the region the server grants each session.
pub const REGION: usize = 64 << 10;

#[derive(Debug, Clone, Parser)]
#[command(about = "Soak under random faults on two soft-RoCE VMs (run by scripts/soak)")]
pub struct Args {
    /// How long A drives traffic (e.g. 120s, 2m, 1h); the drain and checks come after
    #[arg(long, default_value = "2m", value_parser = parse_duration)]
    pub duration: Duration,
    /// Concurrent client connections (each with churn)
    #[arg(long, default_value_t = 12)]
    pub conns: usize,
    /// Sampling interval of RSS, fds, device resources and p99 latency
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub interval: Duration,
    /// Mean time between faults (each starts 0.5x..1.5x this after the previous one ended)
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub fault_every: Duration,
    /// Faults to cycle through, comma-separated (loss,corrupt,reorder,duplicate,
    /// partition-short,partition-long,kill,flap); "none" for none
    #[arg(
        long,
        default_value = "loss,kill,partition-long,corrupt,reorder,flap,partition-short,duplicate"
    )]
    pub faults: String,
    /// Seed of the random choices
    #[arg(long, default_value_t = 25)]
    pub seed: u64,
    /// Where to write the SVG (default: soak.svg in $RXE_PAIR_OUT)
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// RSS slope bound after warm-up, MiB per 10 minutes (checked on runs of 20 min or more)
    #[arg(long, default_value_t = 1.0)]
    pub max_rss_slope: f64,
    /// Run the server (side B's child; the supervisor passes it)
    #[arg(long, hide = true)]
    pub worker: bool,
}

pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let (num, unit) = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .map_or((s, "s"), |i| (&s[..i], &s[i..]));
    let n: f64 = num.parse().map_err(|_| format!("bad duration {s:?}"))?;
    let mult = match unit {
        "ms" => 0.001,
        "s" => 1.0,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        _ => return Err(format!("bad duration unit in {s:?} (ms, s, m, h)")),
    };
    Ok(Duration::from_secs_f64(n * mult))
}

/// The soak's shared directory (on the share both VMs and the host see).
pub fn soak_dir() -> PathBuf {
    let out = std::env::var_os("RXE_PAIR_OUT").map_or_else(|| PathBuf::from("."), PathBuf::from);
    out.join("soak")
}

/// Seconds since the epoch by the host's clock: the modification time the host gives a file
/// written on the share. The guests' own clocks are not to be trusted for durations: a TCG
/// guest calibrates its TSC against emulated timers under load, and was measured running 1x
/// to 5x as fast as the host's clock (docs/faults.md, "Soak"). None if the share is unusable.
pub fn host_now() -> Option<f64> {
    let side = std::env::var("RXE_PAIR_SIDE").unwrap_or_default();
    let path = soak_dir().join(format!(".clock-{side}"));
    std::fs::write(&path, b"t").ok()?;
    let m = std::fs::metadata(&path).ok()?.modified().ok()?;
    Some(m.duration_since(std::time::UNIX_EPOCH).ok()?.as_secs_f64())
}

/// The run's time by the host's clock (see [`host_now`]), with the guest's as a fallback.
#[derive(Debug)]
pub struct Clock {
    host0: Option<f64>,
    guest0: std::time::Instant,
    duration: f64,
    over: std::sync::atomic::AtomicBool,
}

impl Clock {
    pub fn start(duration: Duration) -> Clock {
        Clock {
            host0: host_now(),
            guest0: std::time::Instant::now(),
            duration: duration.as_secs_f64(),
            over: std::sync::atomic::AtomicBool::new(false),
        }
    }
    /// Host seconds since the start (guest seconds if the host's clock cannot be read).
    pub fn elapsed(&self) -> f64 {
        match (self.host0, host_now()) {
            (Some(a), Some(b)) => b - a,
            _ => self.guest_elapsed(),
        }
    }
    pub fn guest_elapsed(&self) -> f64 {
        self.guest0.elapsed().as_secs_f64()
    }
    /// Host seconds left until the end of the traffic.
    pub fn left(&self) -> f64 {
        self.duration - self.elapsed()
    }
    /// Whether the traffic time is over (updated by [`Clock::tick`]).
    pub fn over(&self) -> bool {
        self.over.load(Ordering::Relaxed)
    }
    /// Reads the host's clock every half second until the traffic time is over.
    pub async fn tick(&self) {
        while self.left() > 0.0 {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        self.over.store(true, Ordering::Relaxed);
    }
}

/// A small random generator (xorshift64*), one per task: no global state.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    /// True with probability `pct` percent.
    pub fn pct(&mut self, pct: u64) -> bool {
        self.below(100) < pct
    }
}

/// A counter shared by tasks.
#[derive(Debug, Default)]
pub struct Count(AtomicU64);

impl Count {
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

fn main() {
    let args = Args::parse();
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .init();
    }
    let side = std::env::var("RXE_PAIR_SIDE").unwrap_or_default();
    let code = match (side.as_str(), args.worker) {
        ("B", false) => peer::supervise(&args),
        ("B", true) => runtime().block_on(peer::serve(args)),
        ("A", _) => runtime().block_on(run::drive(args)),
        _ => {
            eprintln!("soak: run under scripts/rxe-pair (RXE_PAIR_SIDE A or B)");
            2
        }
    };
    std::process::exit(code);
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}
