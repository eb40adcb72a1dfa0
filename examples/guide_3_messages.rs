//! Guide step 3 (docs/guide.md): send and receive messages.
//!
//! A request/response server with 8 clients: each client sends requests and checks that the
//! server's replies are its requests back, then sends one 1 MiB message (larger than a receive
//! buffer: it travels in chunks and arrives whole). Server and clients run in this process.
//!
//! ```text
//! cargo run --example guide_3_messages -- [--addr IP] [--port PORT] [--clients N] [--rounds N]
//! ```
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;

use clap::Parser;
use tokio::task::JoinSet;
use tokio_rdma::Endpoint;
use tokio_rdma::conn::{ConnectOptions, Connection};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// An echo server and clients that check every reply.
#[derive(Parser)]
struct Args {
    /// An IP address of an RDMA device's netdev (rxe0's in the soft-RoCE VM)
    #[arg(long, default_value = "192.0.2.1")]
    addr: IpAddr,
    /// The port to listen on
    #[arg(long, default_value_t = 7483)]
    port: u16,
    /// How many clients connect
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// Requests per client [default: 1000, 20 with --smoke]
    #[arg(long)]
    rounds: Option<usize>,
    /// Small round count (the test suite's smoke run)
    #[arg(long)]
    smoke: bool,
}

/// The server's side of one connection: every message goes back as it came.
async fn serve(conn: Connection) -> Result<(), BoxError> {
    // `None`: the client closed cleanly after its last message.
    while let Some(msg) = conn.recv().await? {
        conn.send(&msg).await?; // `msg` derefs to `[u8]`
    } // dropping `msg` gives its receive buffer back (and the sender its credit)
    conn.close().await?;
    Ok(())
}

/// One client: requests and replies, then a large message.
async fn client(ep: Endpoint, addr: SocketAddr, id: usize, rounds: usize) -> Result<(), BoxError> {
    let conn = ep.connect(addr, ConnectOptions::default()).await?;
    for i in 0..rounds {
        let request = format!("client {id} request {i}");
        conn.send(request.as_bytes()).await?;
        let reply = conn.recv().await?.ok_or("the server closed early")?;
        if reply[..] != *request.as_bytes() {
            return Err(format!("client {id}: request {i} came back as {:?}", &reply[..]).into());
        }
    }
    let big: Vec<u8> = (0..1 << 20).map(|i: usize| (i * 7 + id) as u8).collect();
    conn.send(&big).await?;
    let reply = conn.recv().await?.ok_or("the server closed early")?;
    if reply[..] != big[..] {
        return Err(format!("client {id}: the 1 MiB message came back altered").into());
    }
    conn.close().await?;
    Ok(())
}

async fn run(args: Args) -> Result<(), BoxError> {
    let addr = SocketAddr::new(args.addr, args.port);
    let rounds = args.rounds.unwrap_or(if args.smoke { 20 } else { 1000 });
    let ep = Endpoint::open_first_active()?;

    let listener = ep.listen(addr).await?;
    let clients = args.clients;
    let server = tokio::spawn(async move {
        let mut tasks = JoinSet::new();
        for _ in 0..clients {
            let conn = listener.accept().await?;
            tasks.spawn(serve(conn));
        }
        while let Some(r) = tasks.join_next().await {
            r??;
        }
        Ok::<_, BoxError>(())
    });

    let started = std::time::Instant::now();
    let mut tasks = JoinSet::new();
    for id in 0..clients {
        tasks.spawn(client(ep.clone(), addr, id, rounds));
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    server.await??;
    println!(
        "{clients} clients x {rounds} requests and one 1 MiB message each, every reply checked, \
         in {:.2} s",
        started.elapsed().as_secs_f64()
    );
    println!("guide_3_messages: ok");
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    // Errors print with `Display`: what failed and, for common causes, what to do.
    match run(Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("guide_3_messages: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}
