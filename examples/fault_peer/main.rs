//! The fault-injection suite's test program: the same binary runs on both VMs of
//! `scripts/rxe-pair` (role from `RXE_PAIR_SIDE`), runs the scenarios named on its command line
//! in order, and prints one `result SCENARIO SIDE PASS|FAIL details` line per scenario and side.
//! `scripts/test-faults` builds it, runs it and counts the results (see docs/faults.md).
//!
//! ```text
//! scripts/rxe-pair -- target/debug/examples/fault_peer loss1 loss5 link-short kill-cmd
//! ```
//! A listens and requests the faults (through `$RXE_PAIR_CTL`); the two sides meet at barriers
//! through files in `$RXE_PAIR_OUT`, out of band (the faults never touch the control channel).
#![allow(clippy::print_stdout, clippy::print_stderr)]
// A test program: its items are internal, not an API.
#![allow(missing_docs, unreachable_pub, missing_debug_implementations)]

mod ctl;
mod outage;
#[path = "../common/proc_stats.rs"]
#[allow(dead_code, reason = "fault_peer uses part of it")]
mod proc_stats;
mod scenarios;
mod stream;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use ctl::{Ctl, Side};
use scenarios::Wire;
use stream::{Break, within};
use tokio_rdma::conn::{ConnectOptions, Connection, Listener};

/// What a scenario needs: the sides, the control channel, ports.
pub struct Ctx {
    pub side: Side,
    pub me: IpAddr,
    pub peer: IpAddr,
    pub ctl: Ctl,
    pub brk: Break,
    port: u16,
    local_port: u16,
    /// When this side last requested a fault (the fault happens between this and the answer).
    pub requested: Option<Instant>,
    scenario: String,
    faults: u32,
}

/// Limit of a connect or accept.
const SETUP_LIMIT: Duration = Duration::from_secs(60);

impl Ctx {
    /// A connection between A (server) and B (client) with `opts` on both sides.
    pub async fn connect(&mut self, opts: ConnectOptions) -> Result<Connection, String> {
        self.port += 1;
        match self.side {
            Side::A => {
                let addr = SocketAddr::new(self.me, self.port);
                let l = Listener::bind_with(addr, opts)
                    .await
                    .map_err(|e| format!("bind {addr}: {e}"))?;
                self.ctl
                    .barrier(&format!("listening {}", self.port))
                    .await?;
                within(SETUP_LIMIT, "accept", l.accept())
                    .await?
                    .map_err(|e| format!("accept: {e}"))
            }
            Side::B => {
                let addr = SocketAddr::new(self.peer, self.port);
                self.ctl
                    .barrier(&format!("listening {}", self.port))
                    .await?;
                within(SETUP_LIMIT, "connect", Connection::connect_with(addr, opts))
                    .await?
                    .map_err(|e| format!("connect {addr}: {e}"))
            }
        }
    }

    /// A connection from this side to itself (a listener on its own address): the "other
    /// connection" of a survivor. Returns (client end, server end).
    pub async fn local_pair(&mut self) -> Result<(Connection, Connection), String> {
        // Its own port range: the peer does not follow (no barrier).
        self.local_port += 1;
        let addr = SocketAddr::new(self.me, self.local_port);
        let l = Listener::bind(addr)
            .await
            .map_err(|e| format!("bind {addr}: {e}"))?;
        let (c, s) = tokio::join!(
            within(SETUP_LIMIT, "local connect", Connection::connect(addr)),
            within(SETUP_LIMIT, "local accept", l.accept())
        );
        let c = c?.map_err(|e| format!("local connect: {e}"))?;
        let s = s?.map_err(|e| format!("local accept: {e}"))?;
        Ok((c, s))
    }

    /// `requester` asks for the fault `args`; both sides wait until it is applied (the host's
    /// answer file, seen by both) and get that instant.
    pub async fn fault(&mut self, requester: Side, args: &[&str]) -> Result<Instant, String> {
        self.faults += 1;
        let id = format!("{}-{}", self.scenario, self.faults);
        if self.side == requester {
            self.requested = Some(Instant::now());
            ctl::fault_request(&id, args)?;
        }
        let (at, msg) = ctl::fault_done(&id).await?;
        println!("  [{}] fault {}: {msg}", self.side.name(), args.join(" "));
        Ok(at)
    }

    pub fn is(&self, side: Side) -> bool {
        self.side == side
    }
}

/// The scenarios, by name: (name, sides whose result counts).
pub const SCENARIOS: &[&str] = &[
    "loss1",
    "loss5",
    "loss20",
    "corrupt1",
    "reorder",
    "duplicate",
    "slow-reader",
    "link-short",
    "link-long",
    "partition-short",
    "partition-long",
    "kill-cmd",
    "kill-vm",
];

fn wire<'a>(netem: &'a [&'a str], n: u64, chunk: u32, os: (u64, usize)) -> Wire<'a> {
    Wire {
        netem,
        first: 0,
        n,
        chunk,
        os,
        may_fail: false,
    }
}

async fn run_one(ctx: &mut Ctx, name: &str) -> Result<String, String> {
    match name {
        // Chunks of 4 KiB (4 packets at rxe's 1024-byte MTU) and of 1 KiB on the lossier
        // wires: rxe counts every retransmission round of a work request against the retry
        // count and resets it only on an acknowledgement, which comes at the end of a work
        // request; 64-packet chunks exhaust 6 retries at 5% loss (docs/faults.md).
        "loss1" => scenarios::stream(ctx, wire(&["loss", "1%"], 16, 4 << 10, (4, 16 << 10))).await,
        "loss5" => scenarios::stream(ctx, wire(&["loss", "5%"], 8, 1 << 10, (4, 4 << 10))).await,
        // 20% loss: messages #4..#8 (64 KiB, 1,000 B, 300,000 B, 64 KiB + 1: 432,073 B each
        // way, ~420 chunks), not #0..#4, whose 1 MiB message alone took 90 s of the suite.
        "loss20" => {
            let w = Wire {
                first: 4,
                may_fail: true,
                ..wire(&["loss", "20%"], 4, 1 << 10, (2, 1 << 10))
            };
            scenarios::stream(ctx, w).await
        }
        "corrupt1" => {
            scenarios::stream(ctx, wire(&["corrupt", "1%"], 16, 4 << 10, (4, 16 << 10))).await
        }
        "reorder" => {
            let netem = &["delay", "10ms", "reorder", "25%", "50%"];
            scenarios::stream(ctx, wire(netem, 16, 1 << 10, (4, 4 << 10))).await
        }
        "duplicate" => {
            scenarios::stream(ctx, wire(&["duplicate", "5%"], 16, 64 << 10, (4, 64 << 10))).await
        }
        "slow-reader" => scenarios::slow_reader(ctx).await,
        "link-short" => outage::survive(ctx, outage::Kind::Link).await,
        "link-long" => outage::fail(ctx, outage::Kind::Link).await,
        "partition-short" => outage::survive(ctx, outage::Kind::Partition).await,
        "partition-long" => outage::fail(ctx, outage::Kind::Partition).await,
        // B's process is killed (the survivor A requests it); then B's VM powers off.
        "kill-cmd" => outage::peer_death(ctx, Side::B, "kill-cmd").await,
        // A's VM is killed (the survivor B requests it).
        "kill-vm" => outage::peer_death(ctx, Side::A, "kill-vm").await,
        other => Err(format!("unknown scenario {other}")),
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .init();
    }
    let side = match std::env::var("RXE_PAIR_SIDE").as_deref() {
        Ok("A") => Side::A,
        Ok("B") => Side::B,
        _ => {
            eprintln!("fault_peer: run under scripts/rxe-pair (RXE_PAIR_SIDE A or B)");
            std::process::exit(2);
        }
    };
    let addr = |v: &str| -> IpAddr {
        std::env::var(v)
            .ok()
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("{v} is not an address"))
    };
    let names: Vec<String> = std::env::args().skip(1).collect();
    for n in &names {
        if !SCENARIOS.contains(&n.as_str()) {
            eprintln!("fault_peer: unknown scenario {n} (one of {SCENARIOS:?})");
            std::process::exit(2);
        }
    }
    let out = PathBuf::from(std::env::var("RXE_PAIR_OUT").expect("RXE_PAIR_OUT"));
    let mut ctx = Ctx {
        side,
        me: addr("RXE_PAIR_SELF"),
        peer: addr("RXE_PAIR_PEER"),
        ctl: Ctl::open(side, out.join("faultctl")).expect("control directory"),
        brk: Break::from_env(),
        port: 7500,
        local_port: 8500,
        requested: None,
        scenario: String::new(),
        faults: 0,
    };
    if ctx.brk != Break::None {
        println!(
            "fault_peer: DELIBERATELY BROKEN verification: {:?}",
            ctx.brk
        );
    }
    let mut failed = 0;
    for name in &names {
        ctx.scenario = name.clone();
        ctx.faults = 0;
        println!("== {name} [{}]", side.name());
        let t0 = Instant::now();
        let res = run_one(&mut ctx, name).await;
        let secs = t0.elapsed().as_secs_f64();
        let (verdict, details) = match &res {
            Ok(d) => ("PASS", d.clone()),
            Err(e) => ("FAIL", e.clone()),
        };
        if res.is_err() {
            failed += 1;
            if side == Side::A && !name.starts_with("kill") {
                // Leave a clean wire for the next scenario.
                let _ = ctx.fault(Side::A, &["both", "clear"]).await;
                let _ = ctx.fault(Side::A, &["A", "link", "up"]).await;
                let _ = ctx
                    .fault(
                        Side::A,
                        &[
                            "A",
                            "run",
                            "ping",
                            "-c",
                            "1",
                            "-W",
                            "5",
                            &ctx.peer.to_string(),
                        ],
                    )
                    .await;
            }
        }
        println!(
            "result {name} {} {verdict} ({secs:.1} s) {details}",
            side.name()
        );
        if !name.starts_with("kill") {
            match ctx.ctl.end(name, verdict).await {
                Ok(peer) => println!("  [{}] peer: {peer}", side.name()),
                Err(e) => {
                    println!("fault_peer: control channel lost ({e}): stopping");
                    std::process::exit(1);
                }
            }
        }
    }
    println!("fault_peer {}: {failed} scenario(s) failed", side.name());
    std::process::exit(if failed == 0 { 0 } else { 1 });
}
