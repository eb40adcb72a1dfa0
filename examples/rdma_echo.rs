//! A peer of librdmacm's `rdma_server` / `rdma_client` (rdma-core's
//! `librdmacm/examples/rdma_server.c` and `rdma_client.c`), in both roles, on the crate's raw
//! connections (`conn::Raw*`).
//!
//! ```text
//! rdma_echo server [-s ADDR] [-p PORT] [-d DEVICE]    # in place of rdma_server
//! rdma_echo client  -s ADDR  [-p PORT] [-d DEVICE]    # in place of rdma_client
//! ```
//!
//! What the C programs do (port 7471 by default, RDMA CM's TCP port space, no private data,
//! librdmacm's default connection parameters):
//!
//! * `rdma_client` posts one 16-byte receive, connects, SENDs 16 bytes (inline when the device
//!   allows 16 inline bytes), waits for the send's completion, then for the receive's, and
//!   disconnects;
//! * `rdma_server` posts one 16-byte receive, accepts, waits for the client's message, SENDs
//!   16 bytes back, waits for the send's completion and disconnects.
//!
//! Both send buffers are static arrays the programs never write: every message on the wire is
//! 16 zero bytes. Both queue pairs have one send and one receive slot, so each side sends
//! exactly one message.
//!
//! This program does the same and checks everything it can see: the peer's message arrives
//! (length 16, no immediate data, all bytes zero: a longer message is caught because our
//! receive buffer has room for more), our send completes successfully, and the connection
//! closes. One exception is allowed and reported: the C programs disconnect as soon as their own
//! last operation completed, and rxe completes a receive before it sends its ACK, so a peer that
//! received our message may disconnect before that ACK leaves (seen under emulation); our send
//! is then flushed, and the output line says so (the client knows the message arrived: the
//! server only answers after it did). The server answers with the bytes it received (an echo; against the C client that is
//! the 16 zero bytes `rdma_server` would send). Any deviation ends the program with exit status
//! 1 and a line saying what was wrong.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use tokio_rdma::Endpoint;
use tokio_rdma::conn::{RawConnection, RawOptions};
use tokio_rdma::verbs::{AccessFlags, ProtectionDomain, RegisteredBuffer};

/// The size of every message of `rdma_server` / `rdma_client`.
const MSG: usize = 16;
/// Room in our receive buffer, so a peer sending more than [`MSG`] bytes is seen (not failed
/// with a local length error that names nothing).
const RECV_ROOM: usize = 64;
/// How long any one step may take (rxe under TCG emulation is slow, but not this slow).
const STEP: Duration = Duration::from_secs(30);

/// A peer of librdmacm's `rdma_server` / `rdma_client`: one 16-byte message each way over an
/// RDMA CM connection, every byte and completion checked.
#[derive(Debug, Parser)]
#[command(name = "rdma_echo")]
struct Args {
    #[command(subcommand)]
    role: Role,
}

#[derive(Debug, Subcommand)]
enum Role {
    /// Wait for one client (as rdma_server), receive its 16 bytes, send them back, disconnect
    Server(Opts),
    /// Connect (as rdma_client), send 16 zero bytes, receive 16 bytes, disconnect
    Client(Opts),
}

#[derive(Debug, clap::Args)]
struct Opts {
    /// Server address (the server binds it; the client connects to it) [server default:
    /// 0.0.0.0]
    #[arg(short = 's', long = "server", value_name = "ADDR")]
    addr: Option<IpAddr>,
    /// Port (rdma_server's and rdma_client's default)
    #[arg(short = 'p', long, value_name = "PORT", default_value_t = 7471)]
    port: u16,
    /// RDMA device [default: the first with an active port]
    #[arg(short = 'd', long, value_name = "DEVICE")]
    device: Option<String>,
}

type Res<T> = Result<T, Box<dyn std::error::Error>>;

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args = Args::parse();
    let t = Instant::now();
    let (name, res) = match &args.role {
        Role::Server(o) => ("server", server(o).await),
        Role::Client(o) => ("client", client(o).await),
    };
    let ms = t.elapsed().as_secs_f64() * 1e3;
    match res {
        Ok(peer) => println!(
            "rdma_echo {name}: ok, {MSG} bytes each way with {peer}, verified ({ms:.1} ms)"
        ),
        Err(e) => {
            eprintln!("rdma_echo {name}: FAILED: {e}");
            std::process::exit(1);
        }
    }
}

fn endpoint(o: &Opts) -> Res<Endpoint> {
    Ok(match &o.device {
        Some(d) => Endpoint::open(d)?,
        None => Endpoint::open_first_active()?,
    })
}

/// The C programs' queue pair: one send, one receive, one SGE each (ours has one slot more on
/// each queue; only one message is ever in flight).
fn options() -> RawOptions {
    RawOptions::default()
        .send_queue(2)
        .recv_queue(2)
        .sges(1, 1)
        .access(AccessFlags::LOCAL_WRITE)
        .timeout(STEP)
}

async fn within<F: Future>(what: &str, f: F) -> Res<F::Output> {
    tokio::time::timeout(STEP, f)
        .await
        .map_err(|_| format!("{what}: nothing within {STEP:?}").into())
}

/// Checks a received message: exactly [`MSG`] bytes, no immediate data, all zero (what both C
/// programs send).
fn check_message(info: tokio_rdma::ops::RecvInfo, buf: &RegisteredBuffer) -> Res<[u8; MSG]> {
    if info.len != MSG {
        return Err(format!(
            "the peer sent {} bytes; rdma_server/rdma_client send {MSG}",
            info.len
        )
        .into());
    }
    if let Some(imm) = info.imm {
        return Err(format!(
            "the peer's message carries immediate data {imm:#x}; the C programs send none"
        )
        .into());
    }
    let mut m = [0u8; MSG];
    buf.read_at(0, &mut m);
    if let Some(at) = m.iter().position(|&b| b != 0) {
        return Err(format!(
            "byte {at} of the peer's message is {:#04x}; the C programs send 16 zero bytes",
            m[at]
        )
        .into());
    }
    Ok(m)
}

/// How our send ended.
enum Sent {
    /// Completed successfully.
    Completed,
    /// The peer disconnected first: its disconnect flushes the send. The C programs disconnect
    /// as soon as their own last operation completed, and rxe completes a receive before it
    /// sends the ACK for it, so the ACK of our message can be lost to the peer's disconnect
    /// after the peer received the message.
    PeerDisconnected,
}

type SendFut = std::pin::Pin<Box<tokio_rdma::ops::Send<RegisteredBuffer>>>;

/// Posts a send of `data` now (its first poll posts it) and returns its future (`None`: it
/// already completed successfully).
async fn start_send(
    conn: &RawConnection,
    pd: &ProtectionDomain,
    data: &[u8],
) -> Res<Option<SendFut>> {
    let mut tx = RegisteredBuffer::new(pd, data.len(), AccessFlags::LOCAL_WRITE)?;
    tx.write_at(0, data);
    let mut send = Box::pin(conn.qp().send(tx));
    if let std::task::Poll::Ready((res, _)) = futures::poll!(&mut send) {
        res.map_err(|e| format!("our {MSG}-byte send failed: {e}"))?;
        return Ok(None);
    }
    Ok(Some(send))
}

/// Waits for the send `send` to complete successfully, or for the peer to disconnect.
async fn finish_send(conn: &RawConnection, send: Option<SendFut>) -> Res<Sent> {
    let Some(mut send) = send else {
        return Ok(Sent::Completed);
    };
    tokio::select! {
        biased;
        (res, _tx) = &mut send => {
            res.map_err(|e| format!("our {MSG}-byte send failed: {e}"))?;
            Ok(Sent::Completed)
        }
        gone = conn.disconnected() => {
            gone?;
            Ok(Sent::PeerDisconnected)
        }
        () = tokio::time::sleep(STEP) => Err(format!("our send's completion: nothing within {STEP:?}").into()),
    }
}

fn note(sent: &Sent, what: &str) -> String {
    match sent {
        Sent::Completed => String::new(),
        Sent::PeerDisconnected => format!(" (the peer disconnected before our send's ACK: {what})"),
    }
}

async fn server(o: &Opts) -> Res<String> {
    let ep = endpoint(o)?;
    let at = SocketAddr::new(o.addr.unwrap_or(IpAddr::from([0, 0, 0, 0])), o.port);
    let listener = ep.listen_raw(at, 1)?;
    println!("rdma_echo server: listening on {at} ({})", ep.device_name());
    let req = within("a connection request", listener.next()).await??;
    let peer = req
        .peer_addr()
        .map_or_else(|| "?".to_string(), |a| a.to_string());
    let accepting = req.prepare(options())?;
    // The client sends as soon as it is connected: the receive is posted before we accept.
    let rx = RegisteredBuffer::new(accepting.pd(), RECV_ROOM, AccessFlags::LOCAL_WRITE)?;
    let mut recv = accepting.qp().recv(rx);
    recv.start();
    let conn = accepting.accept(&[]).await?;
    println!("rdma_echo server: connection from {peer}");
    let (res, rx) = within("the client's message", recv).await?;
    let info = res.map_err(|e| format!("receiving the client's message: {e}"))?;
    let msg = check_message(info, &rx)?;
    let send = start_send(&conn, conn.pd(), &msg).await?;
    let sent = finish_send(&conn, send).await?;
    // rdma_server disconnects once its send completed; the client disconnects after its
    // receive completed: whichever DREQ comes first, this ends the connection.
    conn.disconnect().await?;
    Ok(peer + &note(&sent, "its delivery is unconfirmed here"))
}

async fn client(o: &Opts) -> Res<String> {
    let ep = endpoint(o)?;
    let addr = o
        .addr
        .ok_or("the client needs the server's address (-s ADDR)")?;
    let to = SocketAddr::new(addr, o.port);
    let connector = ep.raw_connector(to, options()).await?;
    // Posted before connecting, as rdma_client does (the server answers as soon as our
    // message arrives).
    let rx = RegisteredBuffer::new(connector.pd(), RECV_ROOM, AccessFlags::LOCAL_WRITE)?;
    let mut recv = connector.qp().recv(rx);
    recv.start();
    let conn = within("the server's answer", connector.connect(&[]))
        .await??
        .establish()?;
    println!("rdma_echo client: connected to {to} ({})", ep.device_name());
    let send = start_send(&conn, conn.pd(), &[0u8; MSG]).await?;
    // The server answers only after our message arrived: its answer proves the delivery.
    let (res, rx) = within("the server's message", recv).await?;
    let info = res.map_err(|e| format!("receiving the server's message: {e}"))?;
    check_message(info, &rx)?;
    let sent = finish_send(&conn, send).await?;
    conn.disconnect().await?;
    Ok(to.to_string() + &note(&sent, "its answer proves it received our message"))
}
