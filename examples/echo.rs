//! An echo server for many concurrent clients.
//!
//! ```text
//! echo                           # server and 16 clients in this process (192.0.2.1:7471)
//! echo --listen 10.0.0.1:7471    # server only
//! echo --connect 10.0.0.1:7471 [--clients N] [--messages M]
//! ```
//! Each client sends messages of varying sizes, checks every echo byte for byte, and the run
//! prints the aggregate message rate.
#![allow(clippy::print_stdout, clippy::print_stderr)]

mod common;

use std::net::SocketAddr;

use clap::Parser;
use common::{Role, RoleArgs};
use tokio_rdma::conn::{Connection, Listener};

async fn serve(addr: SocketAddr, max_conns: Option<usize>) -> tokio_rdma::Result<()> {
    let listener = Listener::bind(addr).await?;
    println!("echo server on {addr}");
    let mut tasks = tokio::task::JoinSet::new();
    let mut accepted = 0;
    while max_conns.is_none_or(|m| accepted < m) {
        let conn = listener.accept().await?;
        accepted += 1;
        tasks.spawn(async move {
            while let Some(msg) = conn.recv().await? {
                conn.send(&msg).await?;
            }
            conn.close().await
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.expect("echo task")?;
    }
    Ok(())
}

async fn run_client(addr: SocketAddr, id: usize, messages: usize) -> tokio_rdma::Result<u64> {
    let conn = Connection::connect(addr).await?;
    let mut bytes = 0;
    for i in 0..messages {
        let len = 1 + (id * 7919 + i * 104_729) % 9000;
        let msg: Vec<u8> = (0..len).map(|j| (j + i + id) as u8).collect();
        conn.send(&msg).await?;
        let back = conn.recv().await?.expect("server closed early");
        assert!(back[..] == msg[..], "client {id}: echo {i} differs");
        bytes += len as u64;
    }
    conn.close().await?;
    Ok(bytes)
}

async fn clients(addr: SocketAddr, n: usize, messages: usize) -> tokio_rdma::Result<()> {
    let (secs, bytes) = common::run_clients(n, |id| run_client(addr, id, messages)).await?;
    let bytes: u64 = bytes.iter().sum();
    println!(
        "echo: {n} clients x {messages} messages verified in {secs:.2} s: {:.0} msg/s, {:.2} MB/s each way",
        (n * messages) as f64 / secs,
        bytes as f64 / secs / 1e6
    );
    Ok(())
}

/// An echo server for many concurrent clients, and the clients, which verify every echo.
#[derive(Debug, Parser)]
#[command(
    after_help = "With neither --listen nor --connect, the server and the clients run in \
this process on $TOKIO_RDMA_ADDR, else 192.0.2.1:7471 (rxe0 in the soft-RoCE VM)."
)]
struct Args {
    #[command(flatten)]
    role: RoleArgs,
    /// Concurrent clients
    #[arg(long, value_name = "N", default_value_t = 16)]
    clients: usize,
    /// Messages per client [default: 500, 20 with --smoke]
    #[arg(long, value_name = "M")]
    messages: Option<usize>,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let role = args.role.role(7471);
    let n = args.clients;
    let messages = args
        .messages
        .unwrap_or(if args.role.smoke { 20 } else { 500 });
    match role {
        Role::Server(addr) => serve(addr, None).await?,
        Role::Client(addr) => clients(addr, n, messages).await?,
        Role::Both(addr) => {
            let srv = tokio::spawn(serve(addr, Some(n)));
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            clients(addr, n, messages).await?;
            srv.await??;
        }
    }
    Ok(())
}
