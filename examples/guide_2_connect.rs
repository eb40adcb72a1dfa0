//! Guide step 2 (docs/guide.md): accept and connect.
//!
//! A server listens and accepts 8 clients, each connection in its own task; the clients
//! connect to it. Server and clients run in this process.
//!
//! ```text
//! cargo run --example guide_2_connect -- [--addr IP] [--port PORT] [--clients N]
//! ```
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;

use clap::Parser;
use tokio::task::JoinSet;
use tokio_rdma::Endpoint;
use tokio_rdma::conn::{ConnectOptions, Connection};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A listener accepting N clients, and N clients connecting to it.
#[derive(Parser)]
struct Args {
    /// An IP address of an RDMA device's netdev (rxe0's in the soft-RoCE VM)
    #[arg(long, default_value = "192.0.2.1")]
    addr: IpAddr,
    /// The port to listen on
    #[arg(long, default_value_t = 7482)]
    port: u16,
    /// How many clients connect
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// Accepted for the test suite's smoke runs (this step is small anyway)
    #[arg(long)]
    smoke: bool,
}

/// The server's side of one connection (step 3 puts messages here).
async fn serve(conn: Connection) -> Result<SocketAddr, BoxError> {
    Ok(conn.peer_addr()?)
}

async fn run(args: Args) -> Result<(), BoxError> {
    let addr = SocketAddr::new(args.addr, args.port);
    let ep = Endpoint::open_first_active()?;

    // Server: bind first, then accept in a loop, one task per connection.
    let listener = ep.listen(addr).await?;
    let clients = args.clients;
    let server = tokio::spawn(async move {
        let mut tasks = JoinSet::new();
        for _ in 0..clients {
            let conn = listener.accept().await?;
            tasks.spawn(serve(conn));
        }
        let mut peers = Vec::new();
        while let Some(peer) = tasks.join_next().await {
            peers.push(peer??);
        }
        Ok::<_, BoxError>(peers)
    });

    // Clients: connect concurrently (each is one RDMA CM connection with its own queue pair).
    let mut tasks = JoinSet::new();
    for _ in 0..clients {
        let ep = ep.clone();
        tasks.spawn(async move { ep.connect(addr, ConnectOptions::default()).await });
    }
    let mut conns = Vec::new();
    while let Some(conn) = tasks.join_next().await {
        let conn = conn??;
        if conn.peer_addr()? != addr {
            return Err(format!("connected to {}, not {addr}", conn.peer_addr()?).into());
        }
        conns.push(conn);
    }
    println!(
        "{} clients connected; negotiated: {:?}",
        conns.len(),
        conns[0].params()
    );

    let mut peers = server.await??;
    peers.sort();
    peers.dedup();
    println!("server accepted {} distinct clients", peers.len());
    if peers.len() != clients {
        return Err(format!("server saw {peers:?}").into());
    }
    // Dropping a connection closes it in the background; step 6 closes and waits.
    drop(conns);
    println!("guide_2_connect: ok");
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    // Errors print with `Display`: what failed and, for common causes, what to do.
    match run(Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("guide_2_connect: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}
