//! Ping-pong over an RDMA CM connection: the client sends a message, the server echoes it, and
//! the client prints a latency table (p50/p90/p99/p99.9, like perftest).
//!
//! ```text
//! pingpong                       # both ends in this process, on 192.0.2.1:7470 (rxe0 in the VM)
//! pingpong --listen 10.0.0.1:7470
//! pingpong --connect 10.0.0.1:7470 [--iters N] [--size BYTES]
//! ```
#![allow(clippy::print_stdout, clippy::print_stderr)]

mod common;

use std::net::SocketAddr;
use std::time::Instant;

use clap::Parser;
use common::{Role, RoleArgs};
use tokio_rdma::conn::{Connection, Listener};

async fn server(addr: SocketAddr, once: bool) -> tokio_rdma::Result<()> {
    let listener = Listener::bind(addr).await?;
    println!("listening on {addr}");
    loop {
        let conn = listener.accept().await?;
        let task = tokio::spawn(async move {
            while let Some(msg) = conn.recv().await? {
                conn.send(&msg).await?;
            }
            conn.close().await
        });
        if once {
            return task.await.expect("server task");
        }
    }
}

async fn client(addr: SocketAddr, iters: usize, size: usize) -> tokio_rdma::Result<()> {
    let conn = Connection::connect(addr).await?;
    println!("connected to {addr}: {:?}", conn.params());
    let msg = vec![0xa5u8; size];
    // Warm up (first-touch costs, connection ramp-up).
    for _ in 0..iters.min(100) {
        conn.send(&msg).await?;
        conn.recv().await?;
    }
    let mut hist = common::histogram();
    let start = Instant::now();
    for i in 0..iters {
        let t = Instant::now();
        conn.send(&msg).await?;
        let pong = conn.recv().await?.expect("server closed early");
        common::record(&mut hist, t.elapsed());
        assert_eq!(pong.len(), size, "pong {i}");
    }
    let wall = start.elapsed();
    conn.close().await?;
    println!();
    common::latency_table(
        &format!(
            "pingpong: {iters} round trips of {size} bytes over RDMA CM in {:.2} s",
            wall.as_secs_f64()
        ),
        size,
        &hist,
    );
    println!("connection: {:?}", conn.stats());
    Ok(())
}

/// Ping-pong over an RDMA CM connection; prints a latency table.
#[derive(Debug, Parser)]
#[command(
    after_help = "With neither --listen nor --connect, both ends run in this process on \
$TOKIO_RDMA_ADDR, else 192.0.2.1:7470 (rxe0 in the soft-RoCE VM)."
)]
struct Args {
    #[command(flatten)]
    role: RoleArgs,
    /// Measured round trips [default: 10000, 200 with --smoke]
    #[arg(long, value_name = "N")]
    iters: Option<usize>,
    /// Message size in bytes
    #[arg(long, value_name = "BYTES", default_value_t = 64)]
    size: usize,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let role = args.role.role(7470);
    let iters = args
        .iters
        .unwrap_or(if args.role.smoke { 200 } else { 10_000 });
    let size = args.size;
    for dev in tokio_rdma::verbs::devices()? {
        println!("device: {}", dev.name);
    }
    match role {
        Role::Server(addr) => server(addr, false).await?,
        Role::Client(addr) => client(addr, iters, size).await?,
        Role::Both(addr) => {
            let srv = tokio::spawn(server(addr, true));
            // The listener binds before accepting; give it a moment, then retry a refused connect.
            let mut tries = 0;
            loop {
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                match client(addr, iters, size).await {
                    Err(tokio_rdma::Error::ConnectionRejected { .. }) if tries < 20 => tries += 1,
                    other => break other?,
                }
            }
            srv.await??;
        }
    }
    Ok(())
}
