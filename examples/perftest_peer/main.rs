//! A perftest peer over RDMA CM: runs `send_lat`, `write_lat`, `read_lat` and `atomic_lat`
//! against perftest's `ib_send_lat`, `ib_write_lat`, `ib_read_lat` and `ib_atomic_lat` started
//! with `-R`, as client or as server, on the crate's raw connections (`conn::Raw*`).
//!
//! ```text
//! perftest_peer TEST [SERVER] -R [-p PORT] [-s SIZE] [-n ITERS] [-A OP] [-d DEVICE]
//!   ib_send_lat -R -s 64 -n 100 &  perftest_peer send_lat 192.0.2.1 -R -s 64 -n 100
//!   perftest_peer write_lat -R -s 64 -n 100 &  ib_write_lat -R -s 64 -n 100 192.0.2.1
//! ```
//!
//! As with perftest, a SERVER address makes this side the client; without one it serves (on
//! 0.0.0.0, port 18515 by default). The conversation, as perftest 4.5 has it with `-R`:
//!
//! 1. a side-channel connection (see `comm.rs`): version strings, page and cache line sizes,
//!    the MTU, then a `pingpong_dest` hand shake of zeros;
//! 2. the test connection: a second RDMA CM request to the same port (the client retries while
//!    the server is not listening yet, as perftest does), then another zero hand shake;
//! 3. hand shakes of each side's `pingpong_dest` (QP number, rkey and address of the memory the
//!    peer targets): 3 and a synchronisation for send_lat (receives posted before it), 4 for
//!    write_lat, read_lat and atomic_lat;
//! 4. the test (`lat.rs`), then a closing hand shake (send_lat, read_lat, atomic_lat; the
//!    read/atomic server only waits for it);
//! 5. the client disconnects the test connection; the server waits for that and answers.
//!
//! Our side checks what it can: every side-channel message's size, the peer's version (5.70 or
//! later), a sane MTU and sizes, the zero hand shakes (padding aside), that every later hand
//! shake repeats the first, that the peer's QP number is the one RDMA CM connected us to, its
//! GID is its address, its rkey and address are set; then the test's own checks (`lat.rs`), and
//! for a server, what the peer's READs / atomics left in our memory. Any deviation: exit 1.
#![allow(clippy::print_stdout, clippy::print_stderr)]

mod comm;
#[path = "../common/mod.rs"]
mod common;
mod lat;

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use clap::Parser;
use hdrhistogram::Histogram;
use tokio_rdma::buf::RemoteToken;
use tokio_rdma::conn::{RawConnection, RawOptions};
use tokio_rdma::driver::CompletionMode;
use tokio_rdma::verbs::{AccessFlags, RegisteredBuffer};
use tokio_rdma::{Endpoint, EndpointOptions, Error};

use comm::{Comm, DEST_LEN, DEST_PADDING, Dest};
use lat::AtomicOp;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// How long any one step may take (rxe under TCG emulation is slow, but not this slow).
const STEP: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
#[allow(clippy::enum_variant_names)]
#[value(rename_all = "snake_case")]
enum Test {
    SendLat,
    WriteLat,
    ReadLat,
    AtomicLat,
}

/// A peer of perftest's latency tests over RDMA CM (`ib_*_lat -R`), client or server.
#[derive(Debug, Parser)]
#[command(name = "perftest_peer")]
struct Args {
    /// The test: send_lat, write_lat, read_lat or atomic_lat
    #[arg(value_enum)]
    test: Test,
    /// The server to connect to (this side is then the client); none: serve
    server: Option<IpAddr>,
    /// Connect the test's queue pair with RDMA CM (required: perftest's TCP side channel is
    /// not implemented)
    #[arg(short = 'R', long = "rdma_cm", required = true)]
    rdma_cm: bool,
    /// Port (perftest's default)
    #[arg(short = 'p', long, default_value_t = 18515)]
    port: u16,
    /// Message size in bytes (atomic_lat: always 8) [default: 2, perftest's]
    #[arg(short = 's', long, value_parser = clap::value_parser!(u32).range(1..=(1 << 20)))]
    size: Option<u32>,
    /// Iterations
    #[arg(short = 'n', long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(2..=1_000_000))]
    iters: u64,
    /// atomic_lat's operation
    #[arg(
        short = 'A',
        long = "atomic_type",
        value_enum,
        default_value = "FETCH_AND_ADD"
    )]
    atomic: AtomicOp,
    /// RDMA device [default: the first with an active port]
    #[arg(short = 'd', long = "ib-dev")]
    device: Option<String>,
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args = Args::parse();
    let role = if args.server.is_some() {
        "client"
    } else {
        "server"
    };
    let test = format!("{:?}", args.test)
        .to_lowercase()
        .replace("lat", "_lat");
    let t = Instant::now();
    match run(&args).await {
        Ok(line) => println!(
            "perftest_peer {test} {role}: ok, {} ({:.1} ms)",
            line,
            t.elapsed().as_secs_f64() * 1e3
        ),
        Err(e) => {
            eprintln!("perftest_peer {test} {role}: FAILED: {e}");
            std::process::exit(1);
        }
    }
}

/// What our side of the test connection offers the peer.
struct Local {
    dest: Dest,
    /// The memory the peer WRITEs, READs or applies atomics to.
    target: Option<RegisteredBuffer>,
}

async fn run(args: &Args) -> Res<String> {
    let size = match args.test {
        Test::AtomicLat => 8,
        _ => args.size.unwrap_or(2) as usize,
    };
    let opts = EndpointOptions::default().completion_mode(CompletionMode::BusyPoll);
    let ep = match &args.device {
        Some(d) => Endpoint::open_with(d, opts)?,
        None => Endpoint::open_first_active_with(opts)?,
    };
    let port = ep.context().query_port(1)?;
    let mtu = port.active_mtu.ok_or("port 1 has no active MTU")?.to_raw();
    let client = args.server.is_some();

    // 1. The side channel and the preamble.
    let addr = SocketAddr::new(args.server.unwrap_or(IpAddr::from([0, 0, 0, 0])), args.port);
    let listener = if client {
        None
    } else {
        let l = ep.listen_raw(addr, 2)?;
        println!("perftest_peer: listening on {addr} ({})", ep.device_name());
        Some(l)
    };
    let mut comm = match &listener {
        None => Comm::connect(&ep, addr, STEP).await?,
        Some(l) => Comm::accept(l, STEP).await?,
    };
    let info = comm.preamble(mtu).await?;
    println!(
        "perftest_peer: side channel up; perftest {} (page {}, cache line {}, MTU code {} / ours {mtu})",
        info.version, info.cycle_buffer, info.cache_line, info.mtu
    );
    zero_hand_shake(&mut comm, "the sync before the test connection").await?;

    // 2. The test connection, on the same port.
    let topts = test_options(args.test);
    let (conn, peer_qpn) = match &listener {
        None => connect_test(&ep, addr, topts).await?,
        Some(l) => {
            let req = tokio::time::timeout(STEP, l.next())
                .await
                .map_err(|_| "no test connection request")??;
            let qpn = req
                .conn_param()
                .map(|p| p.qp_num)
                .ok_or("a request without parameters")?;
            (req.prepare(topts)?.accept(&[]).await?, qpn)
        }
    };
    drop(listener);
    zero_hand_shake(&mut comm, "the sync after the test connection").await?;

    // 3. Our memory and the pingpong_dest hand shakes.
    let local = local(&ep, &conn, args.test, size, port.lid)?;
    let mut check = PeerCheck {
        first: None,
        qpn: peer_qpn,
        conn: &conn,
        ethernet: port.is_ethernet(),
        seen: 0,
    };
    let mut recvs = Vec::new();
    let shakes = 4;
    let mut peer = Dest::default();
    for i in 0..shakes {
        if args.test == Test::SendLat && i == 3 {
            // Receives for the peer's first messages, before the synchronisation.
            for _ in 0..2 {
                let b = RegisteredBuffer::new(conn.pd(), size + 64, AccessFlags::LOCAL_WRITE)?;
                let mut r = Box::pin(conn.qp().recv(b));
                r.as_mut().start();
                recvs.push(r);
            }
        }
        let (raw, d) = comm
            .hand_shake(&local.dest, &format!("pingpong_dest hand shake {}", i + 1))
            .await?;
        check.dest(&raw, &d, args.test, size)?;
        peer = d;
    }
    // The peer's values, checked (a range that wraps is refused, not trusted).
    let token = |len: usize| RemoteToken::try_new(peer.vaddr, len as u64, peer.rkey);

    // 4. The test.
    let mut h: Option<Histogram<u64>> = None;
    let mut detail = String::new();
    match args.test {
        Test::SendLat => {
            h = Some(lat::send_lat(&conn, &mut recvs, size, args.iters, client, STEP).await?);
            close_hand_shake(&mut comm, &mut check, &local.dest, args.test, size).await?;
        }
        Test::WriteLat => {
            let target = local.target.as_ref().expect("write target");
            h = Some(
                lat::write_lat(&conn, target, token(size)?, size, args.iters, client, STEP).await?,
            );
        }
        Test::ReadLat | Test::AtomicLat if !client => {
            close_hand_shake(&mut comm, &mut check, &local.dest, args.test, size).await?;
            let target = local.target.as_ref().expect("target");
            let got = target.to_vec();
            if args.test == Test::ReadLat {
                if got != read_pattern(size) {
                    return Err("our READ target changed: perftest's READs must not write".into());
                }
                detail = "; our READ target unchanged".into();
            } else {
                let v = u64::from_ne_bytes(got[..8].try_into().expect("8 bytes"));
                let want = lat::atomic_expected(args.atomic, args.iters);
                if v != want {
                    return Err(format!(
                        "our atomic target holds {v:#x} after {} {:?}s from {:#x}: want {want:#x}",
                        args.iters,
                        args.atomic,
                        lat::ATOMIC_START
                    )
                    .into());
                }
                detail = format!(
                    "; our atomic target went {:#x} -> {v:#x}",
                    lat::ATOMIC_START
                );
            }
        }
        Test::ReadLat => {
            h = Some(lat::read_lat(&conn, token(size)?, size, args.iters, STEP).await?);
            close_hand_shake(&mut comm, &mut check, &local.dest, args.test, size).await?;
        }
        Test::AtomicLat => {
            let (hist, first, last) =
                lat::atomic_lat(&conn, token(8)?, args.atomic, args.iters, STEP).await?;
            h = Some(hist);
            detail = format!("; returned values {first:#x}..={last:#x}");
            close_hand_shake(&mut comm, &mut check, &local.dest, args.test, size).await?;
        }
    }

    // 5. Teardown: the client disconnects, the server answers.
    if client {
        conn.disconnect().await?;
    } else {
        tokio::time::timeout(STEP, conn.disconnected())
            .await
            .map_err(|_| "perftest did not disconnect the test connection")??;
        conn.disconnect().await?;
    }
    let msgs = comm.count;
    comm.close().await?;
    drop(local);

    let mut line = format!(
        "{} iterations of {size} bytes verified; {} side-channel exchanges{detail}",
        args.iters, msgs
    );
    if let Some(h) = h {
        let (def, div) = match args.test {
            Test::SendLat | Test::WriteLat => ("half a round trip", 2.0),
            _ => ("one operation", 1.0),
        };
        common::latency_table(
            &format!("perftest_peer {:?}, latency (round trips: ours)", args.test),
            size,
            &h,
        );
        let p50 = h.value_at_quantile(0.5) as f64 / 1e3 / div;
        line += &format!("; perftest-comparable p50 {p50:.2} us ({def})");
    }
    Ok(line)
}

/// The test connection's options: perftest's depths (READ/atomic depth only for read_lat and
/// atomic_lat) and the remote right its traffic needs.
fn test_options(test: Test) -> RawOptions {
    let o = RawOptions::default()
        .send_queue(4)
        .recv_queue(4)
        .sges(1, 1)
        .timeout(STEP);
    match test {
        Test::SendLat => o.access(AccessFlags::LOCAL_WRITE).rd_atomic(0, 0),
        Test::WriteLat => o
            .access(AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
            .rd_atomic(0, 0),
        Test::ReadLat => o.access(AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ),
        Test::AtomicLat => o.access(AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_ATOMIC),
    }
}

/// Connects the test connection, retrying while the server is not listening yet (perftest's
/// server listens again only after the hand shake before it; perftest's client retries 10
/// times, 100 ms apart). Returns the connection and the peer's QP number.
async fn connect_test(
    ep: &Endpoint,
    addr: SocketAddr,
    opts: RawOptions,
) -> Res<(RawConnection, u32)> {
    let start = Instant::now();
    let mut tries = 0u32;
    loop {
        tries += 1;
        let attempt = async {
            let reply = ep
                .raw_connector(addr, opts.clone())
                .await?
                .connect(&[])
                .await?;
            let qpn = reply.conn_param().map(|p| p.qp_num);
            Ok::<_, Error>((reply.establish()?, qpn))
        }
        .await;
        match attempt {
            Ok((conn, Some(qpn))) => return Ok((conn, qpn)),
            Ok((_, None)) => return Err("the server's answer carries no parameters".into()),
            Err(e @ (Error::ConnectionRejected { .. } | Error::CmEventFailed { .. })) => {
                if start.elapsed() > STEP {
                    return Err(
                        format!("the test connection failed {tries} times; last: {e}").into(),
                    );
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(format!("the test connection: {e}").into()),
        }
    }
}

/// The bytes of our READ target.
fn read_pattern(size: usize) -> Vec<u8> {
    (0..size).map(|i| (i * 7 + 3) as u8).collect()
}

/// Our memory for the test and the `pingpong_dest` describing it.
fn local(ep: &Endpoint, conn: &RawConnection, test: Test, size: usize, lid: u16) -> Res<Local> {
    let target = match test {
        Test::SendLat => None,
        Test::WriteLat => {
            let mut t = lat::target(conn, size + lat::WRITE_GUARD, AccessFlags::REMOTE_WRITE)?;
            lat::fill_write_target(&mut t);
            Some(t)
        }
        Test::ReadLat => {
            let mut t = lat::target(conn, size, AccessFlags::REMOTE_READ)?;
            t.write_at(0, &read_pattern(size));
            Some(t)
        }
        Test::AtomicLat => {
            let mut t = lat::target(conn, 8, AccessFlags::REMOTE_ATOMIC)?;
            t.write_at(0, &lat::ATOMIC_START.to_ne_bytes());
            Some(t)
        }
    };
    let gid = ep.context().preferred_gid(1)?;
    let dest = Dest {
        lid: u32::from(lid),
        out_reads: 1,
        qpn: conn.qp().qpn(),
        psn: 0, // RDMA CM chose the PSNs; perftest ignores this field with -R
        rkey: target.as_ref().map_or(0, |t| t.rkey()),
        vaddr: target.as_ref().map_or(0, |t| t.addr()),
        gid: gid.gid.0,
        srqn: 0,
        gid_index: gid.index,
    };
    Ok(Local { dest, target })
}

async fn zero_hand_shake(comm: &mut Comm, what: &str) -> Res<()> {
    let (raw, _) = comm.hand_shake(&Dest::default(), what).await?;
    if let Some(at) = (0..DEST_LEN).find(|i| !DEST_PADDING.contains(i) && raw[*i] != 0) {
        return Err(format!(
            "{what}: byte {at} is {:#04x}; perftest sends a zeroed pingpong_dest here",
            raw[at]
        )
        .into());
    }
    Ok(())
}

async fn close_hand_shake(
    comm: &mut Comm,
    check: &mut PeerCheck<'_>,
    mine: &Dest,
    test: Test,
    size: usize,
) -> Res<()> {
    let (raw, d) = comm.hand_shake(mine, "the closing hand shake").await?;
    check.dest(&raw, &d, test, size)
}

/// Checks the peer's `pingpong_dest`s against the test connection and each other.
struct PeerCheck<'a> {
    first: Option<[u8; DEST_LEN]>,
    qpn: u32,
    conn: &'a RawConnection,
    ethernet: bool,
    seen: u32,
}

impl PeerCheck<'_> {
    fn dest(&mut self, raw: &[u8; DEST_LEN], d: &Dest, test: Test, size: usize) -> Res<()> {
        self.seen += 1;
        let n = self.seen;
        let masked = |b: &[u8; DEST_LEN]| {
            let mut m = *b;
            m[DEST_PADDING].fill(0);
            m
        };
        if let Some(f) = &self.first {
            if masked(f) != masked(raw) {
                return Err(format!("pingpong_dest {n} differs from the first: {d:?}").into());
            }
            return Ok(());
        }
        self.first = Some(*raw);
        if d.qpn != self.qpn {
            return Err(format!(
                "perftest's QP number is {:#x}, RDMA CM connected us to {:#x}",
                d.qpn, self.qpn
            )
            .into());
        }
        if self.ethernet && d.lid != 0 {
            return Err(format!("perftest's LID is {} on RoCE", d.lid).into());
        }
        if d.out_reads == 0 {
            return Err("perftest's out_reads is 0".into());
        }
        if let Some(SocketAddr::V4(a)) = self.conn.peer_addr() {
            let mut want = [0u8; 16];
            want[10] = 0xff;
            want[11] = 0xff;
            want[12..].copy_from_slice(&a.ip().octets());
            if d.gid != want {
                return Err(format!(
                    "perftest's GID {:02x?} is not its address {}",
                    d.gid,
                    a.ip()
                )
                .into());
            }
        }
        if test != Test::SendLat {
            if d.rkey == 0 || d.vaddr == 0 {
                return Err(format!(
                    "perftest's rkey {:#x} / address {:#x} for {size} bytes",
                    d.rkey, d.vaddr
                )
                .into());
            }
            if test == Test::AtomicLat && d.vaddr % 8 != 0 {
                return Err(format!(
                    "perftest's atomic target {:#x} is not 8-byte aligned",
                    d.vaddr
                )
                .into());
            }
        }
        Ok(())
    }
}
