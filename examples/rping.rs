//! An `rping`-compatible program (rdma-core's `librdmacm/examples/rping.c`) on the crate's raw
//! connections (`conn::{RawOptions, RawConnector, RawListener, RawConnection}`): RDMA CM with
//! rping's queue-pair sizes and parameters, and an [`AsyncQp`] with no framing of the crate's
//! own. It talks to C `rping` in both roles and is the template for talking to any C peer
//! (docs/interop.md).
//!
//! ```text
//! rping --server [-a ADDR] [-p PORT] [-C COUNT] [-S SIZE] [-v]
//! rping --client  -a ADDR  [-p PORT] [-C COUNT] [-S SIZE] [-v]
//! ```
//!
//! The wire protocol, per ping (all messages are 16 bytes: buffer address as big-endian u64,
//! rkey and length as big-endian u32):
//!
//! 1. the client fills its source buffer with `rdma-ping-N: ` and a rolling `A..z` pattern
//!    (NUL-terminated) and SENDs its address/rkey/length;
//! 2. the server RDMA READs it and SENDs a 16-byte "go ahead";
//! 3. the client SENDs the address/rkey/length of its sink buffer;
//! 4. the server RDMA WRITEs what it read (up to and including the NUL) there and SENDs a
//!    second "go ahead"; the client compares sink and source.
//!
//! The client ends with `rdma_disconnect`; the server serves pings until the peer
//! disconnects. Both sides verify every byte (the client the echo, the server the pattern of
//! ping N) and exit non-zero on a mismatch or a protocol error, printing how many pings
//! passed.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::net::{IpAddr, SocketAddr};
use std::pin::pin;
use std::time::{Duration, Instant};

use clap::Parser;
use tokio_rdma::Endpoint;
use tokio_rdma::buf::{IoBuf, RemoteToken};
use tokio_rdma::conn::{RawConnection, RawOptions};
use tokio_rdma::driver::AsyncQp;
use tokio_rdma::ops::Recv;
use tokio_rdma::verbs::{AccessFlags, RegisteredBuffer};

/// rping's message: where the peer may read or write, big-endian (`struct rping_rdma_info`).
const INFO_LEN: usize = 16;
/// rping's limits on `-S`: room for "rdma-ping-INT_MAX: " and a NUL, up to 64 KiB - 1.
const MIN_SIZE: usize = 26;
const MAX_SIZE: usize = 64 * 1024 - 1;
/// The server's RDMA buffer (rping's `RPING_BUFSIZE`): the largest ping it can take.
const SERVER_BUF: usize = 64 * 1024;
/// How long any one step may take (rxe under TCG is slow, but not this slow).
const STEP: Duration = Duration::from_secs(30);

/// An rping-compatible client or server (RDMA READ/WRITE ping-pong with data verification),
/// interoperable with rdma-core's `rping`.
#[derive(Debug, Parser)]
#[command(name = "rping")]
struct Args {
    /// Server side: listen on ADDR:PORT and serve pings until the client disconnects
    #[arg(
        short = 's',
        long,
        conflicts_with = "client",
        required_unless_present = "client"
    )]
    server: bool,
    /// Client side: connect to ADDR:PORT and send COUNT pings
    #[arg(short = 'c', long)]
    client: bool,
    /// Address (the server binds it; the client connects to it)
    #[arg(
        short = 'a',
        long = "addr",
        value_name = "ADDR",
        default_value = "0.0.0.0"
    )]
    addr: IpAddr,
    /// Port
    #[arg(short = 'p', long, value_name = "PORT", default_value_t = 7174)]
    port: u16,
    /// Pings (client: 0 = until interrupted; server: if given, exactly this many are expected)
    #[arg(short = 'C', long, value_name = "COUNT")]
    count: Option<u32>,
    /// Ping data size in bytes, 26..=65535 [default: 64] (server: if given, every ping must
    /// have this size)
    #[arg(short = 'S', long, value_name = "SIZE", value_parser = clap::value_parser!(u32).range(MIN_SIZE as i64..=MAX_SIZE as i64))]
    size: Option<u32>,
    /// Print the ping data (as rping -v does)
    #[arg(short = 'v', long)]
    verbose: bool,
    /// Accepted for rping compatibility: data is always validated
    #[arg(short = 'V', long)]
    validate: bool,
    /// The RDMA device (default: the first with an active port); ADDR must be on it
    #[arg(short = 'd', long, value_name = "DEVICE")]
    device: Option<String>,
}

type Res<T> = Result<T, Box<dyn std::error::Error>>;

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args = Args::parse();
    let role = if args.server { "server" } else { "client" };
    let mut done = 0u32;
    let t = Instant::now();
    let res = if args.server {
        server(&args, &mut done).await
    } else {
        client(&args, &mut done).await
    };
    let ms = t.elapsed().as_secs_f64() * 1e3;
    let size = args.size.unwrap_or(64);
    match res {
        Ok(()) => println!("rping {role}: ok, {done} pings of {size} bytes verified ({ms:.1} ms)"),
        Err(e) => {
            let of = args.count.map(|c| format!(" of {c}")).unwrap_or_default();
            eprintln!("rping {role}: FAILED after {done}{of} verified pings: {e}");
            std::process::exit(1);
        }
    }
}

/// rping's queue pair and connection parameters (`rping_setup_qp`, `rping_init_conn_param`):
/// 16 sends and 2 receives of one SGE, one RDMA READ in flight each way, 7 retries, RNR retry
/// forever; every send signalled and posted on its first poll. Remote READ and WRITE are
/// allowed on the queue pair (the client's buffers are read and written by the server).
fn raw_options() -> RawOptions {
    RawOptions::default()
        .send_queue(16)
        .recv_queue(4)
        .sges(1, 1)
        .rd_atomic(1, 1)
        .retry_count(7)
        .rnr_retry_count(7)
        .timeout(STEP)
}

fn endpoint(args: &Args) -> Res<Endpoint> {
    Ok(match &args.device {
        Some(name) => Endpoint::open(name)?,
        None => Endpoint::open_first_active()?,
    })
}

fn encode_info(buf: &mut RegisteredBuffer, addr: u64, rkey: u32, len: u32) {
    let mut m = [0u8; INFO_LEN];
    m[..8].copy_from_slice(&addr.to_be_bytes());
    m[8..12].copy_from_slice(&rkey.to_be_bytes());
    m[12..].copy_from_slice(&len.to_be_bytes());
    buf.write_at(0, &m);
}

/// The peer's advertisement, checked (a hostile address/length is refused, not trusted).
fn decode_info(buf: &RegisteredBuffer) -> tokio_rdma::Result<RemoteToken> {
    let mut m = [0u8; INFO_LEN];
    buf.read_at(0, &mut m);
    let addr = u64::from_be_bytes(m[..8].try_into().expect("8 bytes"));
    let rkey = u32::from_be_bytes(m[8..12].try_into().expect("4 bytes"));
    let len = u32::from_be_bytes(m[12..].try_into().expect("4 bytes"));
    RemoteToken::try_new(addr, u64::from(len), rkey)
}

/// rping's ping data for ping `n` (`rping_test_client`): "rdma-ping-N: ", then letters from
/// `'A' + n % 58` counting up and wrapping from 'z' (122) to 'A' (65), the last byte NUL.
fn fill_ping(buf: &mut [u8], n: u32) {
    let prefix = format!("rdma-ping-{n}: ");
    let k = prefix.len().min(buf.len() - 1);
    buf[..k].copy_from_slice(&prefix.as_bytes()[..k]);
    let mut c = b'A' + (n % 58) as u8;
    for b in &mut buf[k..] {
        *b = c;
        c = if c >= b'z' { b'A' } else { c + 1 };
    }
    *buf.last_mut().expect("non-empty") = 0;
}

/// The bytes before the first NUL, as text.
fn c_str(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

/// The first offset where `got` differs from `want`.
fn mismatch(got: &[u8], want: &[u8]) -> Option<usize> {
    got.iter().zip(want).position(|(a, b)| a != b)
}

/// Posts a receive into `buf` now (so the peer's next SEND finds it) and returns the future
/// that completes it.
fn post_recv(qp: &AsyncQp, buf: RegisteredBuffer) -> Recv<RegisteredBuffer> {
    let mut recv = qp.recv(buf);
    recv.start();
    recv
}

/// What ended a wait for a message.
enum Got {
    Message(RegisteredBuffer),
    Disconnected,
}

/// Waits for the posted receive `recv` to complete with rping's 16-byte message, or for the
/// peer to disconnect.
async fn wait_message(conn: &RawConnection, recv: Recv<RegisteredBuffer>, what: &str) -> Res<Got> {
    let mut recv = pin!(recv);
    let deadline = tokio::time::sleep(STEP);
    let mut deadline = pin!(deadline);
    tokio::select! {
        biased;
        (res, buf) = &mut recv => {
            let info = res.map_err(|e| format!("receive of {what}: {e}"))?;
            if info.len != INFO_LEN {
                return Err(format!("{what}: {} bytes received, rping sends {INFO_LEN}", info.len).into());
            }
            Ok(Got::Message(buf))
        }
        gone = conn.disconnected() => {
            gone?;
            Ok(Got::Disconnected)
        }
        () = &mut deadline => Err(format!("no {what} within {STEP:?}").into()),
    }
}

/// Sends the 16 bytes of `msg` and waits for the send's completion.
async fn send_msg(qp: &AsyncQp, msg: RegisteredBuffer, what: &str) -> Res<RegisteredBuffer> {
    let (res, msg) = within(qp.send(msg), what).await;
    res.map_err(|e| format!("send of {what}: {e}"))?;
    Ok(msg)
}

async fn within<F: std::future::Future>(f: F, what: &str) -> F::Output {
    match tokio::time::timeout(STEP, f).await {
        Ok(v) => v,
        Err(_) => {
            eprintln!("rping: {what} did not complete within {STEP:?}");
            std::process::exit(1);
        }
    }
}

async fn client(args: &Args, done: &mut u32) -> Res<()> {
    let size = args.size.unwrap_or(64) as usize;
    let count = args.count.unwrap_or(0);
    let to = SocketAddr::new(args.addr, args.port);
    let ep = endpoint(args)?;
    let connector = ep.raw_connector(to, raw_options()).await?;
    let pd = connector.pd().clone();
    // The server RDMA READs the source buffer and RDMA WRITEs the sink.
    let remote = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE;
    let mut start = RegisteredBuffer::new(&pd, size, remote)?;
    let mut sink = RegisteredBuffer::new(&pd, size, remote)?;
    let mut tx = RegisteredBuffer::new(&pd, INFO_LEN, AccessFlags::LOCAL_WRITE)?;
    let rx = RegisteredBuffer::new(&pd, INFO_LEN, AccessFlags::LOCAL_WRITE)?;
    let mut recv = post_recv(connector.qp(), rx);
    // rping sends no private data; RTR, RTS and the ready-to-use message in `establish`.
    let conn = connector.connect(&[]).await?.establish()?;
    let qp = conn.qp();
    println!("rping client: connected to {to} on {}", ep.device_name());

    let mut ping = 0u32;
    let mut want = vec![0u8; size];
    let t = Instant::now();
    while count == 0 || ping < count {
        // Ping N: the server reads our source buffer.
        fill_ping(&mut want, ping);
        start.write_at(0, &want);
        sink.write_at(0, &vec![0u8; size]);
        encode_info(&mut tx, start.addr(), start.rkey(), size as u32);
        tx = send_msg(qp, tx, "the source buffer's address").await?;
        let Got::Message(buf) = wait_message(&conn, recv, "the server's go-ahead").await? else {
            return Err("the server disconnected mid-ping".into());
        };
        recv = post_recv(qp, buf);
        // The server writes the data back into our sink buffer.
        encode_info(&mut tx, sink.addr(), sink.rkey(), size as u32);
        tx = send_msg(qp, tx, "the sink buffer's address").await?;
        let Got::Message(buf) = wait_message(&conn, recv, "the server's write-done").await? else {
            return Err("the server disconnected mid-ping".into());
        };
        recv = post_recv(qp, buf);
        let got = sink.to_vec();
        if let Some(at) = mismatch(&got, &want) {
            return Err(format!(
                "data mismatch in ping {ping} at byte {at}: got {:#04x}, sent {:#04x}",
                got[at], want[at]
            )
            .into());
        }
        if args.verbose {
            println!("ping data: {}", c_str(&got));
        }
        ping += 1;
        *done = ping;
    }
    let us = t.elapsed().as_secs_f64() * 1e6;
    println!(
        "rping client: {ping} pings in {:.1} ms ({:.1} us per ping)",
        us / 1e3,
        us / f64::from(ping.max(1))
    );
    drop(recv);
    within(conn.disconnect(), "disconnecting").await?;
    Ok(())
}

async fn server(args: &Args, done: &mut u32) -> Res<()> {
    let at = SocketAddr::new(args.addr, args.port);
    let ep = endpoint(args)?;
    let listener = ep.listen_raw(at, 3)?;
    println!("rping server: listening on {at}");
    let req = within(listener.next(), "a connection request").await?;
    let from = req.peer_addr();
    let accepting = req.prepare(raw_options())?; // INIT and RTR with RDMA CM's attributes
    let pd = accepting.pd().clone();
    let data = RegisteredBuffer::new(&pd, SERVER_BUF, AccessFlags::LOCAL_WRITE)?;
    let mut data = Some(data);
    let mut tx = RegisteredBuffer::new(&pd, INFO_LEN, AccessFlags::LOCAL_WRITE)?;
    let rx = RegisteredBuffer::new(&pd, INFO_LEN, AccessFlags::LOCAL_WRITE)?;
    let mut recv = post_recv(accepting.qp(), rx);
    let conn = accepting.accept(&[]).await?;
    let qp = conn.qp();
    println!(
        "rping server: connection from {} on {}",
        from.map_or("?".into(), |a| a.to_string()),
        ep.device_name()
    );

    let mut ping = 0u32;
    let mut want = Vec::new();
    loop {
        // Ping N: the client's source buffer (or the client disconnects: the end).
        let buf = match wait_message(&conn, recv, "the client's source address").await? {
            Got::Message(buf) => buf,
            Got::Disconnected => break,
        };
        let src = decode_info(&buf)?;
        recv = post_recv(qp, buf);
        let len = src.len() as usize;
        if !(MIN_SIZE..=MAX_SIZE).contains(&len) {
            return Err(format!("ping {ping}: the client offers {len} bytes").into());
        }
        if let Some(s) = args.size.filter(|&s| s as usize != len) {
            return Err(format!("ping {ping}: {len} bytes, -S says {s}").into());
        }
        let buf = data.take().expect("data buffer");
        let (res, slice) = within(qp.read(buf.slice(0..len), src), "RDMA READ").await;
        res.map_err(|e| format!("RDMA READ of ping {ping}: {e}"))?;
        let buf = slice.into_inner();
        let got = buf.to_vec();
        want.resize(len, 0);
        fill_ping(&mut want, ping);
        if let Some(at) = mismatch(&got[..len], &want) {
            return Err(format!(
                "ping {ping} is not rping's pattern at byte {at}: got {:#04x}, expected {:#04x}",
                got[at], want[at]
            )
            .into());
        }
        if args.verbose {
            println!("server ping data: {}", c_str(&got[..len]));
        }
        tx.write_at(0, &[0u8; INFO_LEN]);
        tx = send_msg(qp, tx, "the go-ahead").await?;

        // The client's sink buffer: echo the string (with its NUL) there, as rping does.
        let sink = match wait_message(&conn, recv, "the client's sink address").await? {
            Got::Message(b) => {
                let t = decode_info(&b)?;
                recv = post_recv(qp, b);
                t
            }
            Got::Disconnected => return Err("the client disconnected mid-ping".into()),
        };
        let echo = got[..len]
            .iter()
            .position(|&c| c == 0)
            .map_or(len, |p| p + 1);
        if sink.len() < echo as u64 {
            return Err(format!("ping {ping}: sink of {} bytes < {echo}", sink.len()).into());
        }
        let (res, slice) = within(qp.write(buf.slice(0..echo), sink), "RDMA WRITE").await;
        res.map_err(|e| format!("RDMA WRITE of ping {ping}: {e}"))?;
        data = Some(slice.into_inner());
        tx = send_msg(qp, tx, "the write-done").await?;
        ping += 1;
        *done = ping;
    }
    // Answers the client's disconnect and closes the queue pair.
    within(conn.disconnect(), "disconnecting").await?;
    drop(listener);
    match args.count {
        Some(c) if c != ping => Err(format!("the client did {ping} pings, -C says {c}").into()),
        _ => Ok(()),
    }
}
