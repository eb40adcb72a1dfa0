//! A one-sided key-value read service: the server stores fixed-size values in one registered
//! region, grants clients read access to it once (the token travels in a message), and clients
//! fetch values with RDMA READ, without any server CPU per lookup.
//!
//! ```text
//! kv                             # server and 4 clients in this process (192.0.2.1:7472)
//! kv --listen 10.0.0.1:7472      # server only
//! kv --connect 10.0.0.1:7472 [--clients N] [--lookups M]
//! ```
#![allow(clippy::print_stdout, clippy::print_stderr)]

mod common;

use std::net::SocketAddr;

use clap::Parser;
use common::{Role, RoleArgs};
use tokio_rdma::buf::{RemoteAccess, RemoteToken};
use tokio_rdma::conn::{Connection, Listener};

const KEYS: usize = 4096;
const VALUE: usize = 256;

/// The value stored under `key`: recognisable bytes a client can check.
fn value_of(key: usize) -> [u8; VALUE] {
    let mut v = [0u8; VALUE];
    v[..8].copy_from_slice(&(key as u64).to_le_bytes());
    for (i, b) in v[8..].iter_mut().enumerate() {
        *b = (key * 31 + i) as u8;
    }
    v
}

async fn serve(addr: SocketAddr, max_conns: Option<usize>) -> tokio_rdma::Result<()> {
    let listener = Listener::bind(addr).await?;
    println!("kv server on {addr}: {KEYS} keys of {VALUE} bytes");
    let mut tasks = tokio::task::JoinSet::new();
    let mut accepted = 0;
    while max_conns.is_none_or(|m| accepted < m) {
        let conn = listener.accept().await?;
        accepted += 1;
        tasks.spawn(async move {
            // One region per connection (ordinary memory, registered for this grant only),
            // filled once and granted read-only.
            let region = vec![0u8; KEYS * VALUE];
            let mut grant = conn.grant(region, 0..KEYS * VALUE, RemoteAccess::READ)?;
            for key in 0..KEYS {
                grant.write_at(key * VALUE, &value_of(key));
            }
            conn.send(&grant.token().to_bytes()).await?;
            // Nothing to do per lookup: wait for the client to leave, then revoke (drop).
            while conn.recv().await?.is_some() {}
            drop(grant);
            conn.close().await
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.expect("kv task")?;
    }
    Ok(())
}

async fn run_client(addr: SocketAddr, id: usize, lookups: usize) -> tokio_rdma::Result<()> {
    let conn = Connection::connect(addr).await?;
    let token = RemoteToken::from_bytes(&conn.recv().await?.expect("token"))?;
    let mut buf = conn.pool()?.acquire(VALUE).await?;
    let mut key = id * 977;
    for _ in 0..lookups {
        key = (key * 1_103_515_245 + 12_345) % KEYS;
        let remote = token.slice((key * VALUE) as u64..((key + 1) * VALUE) as u64)?;
        let (res, b) = conn.read(buf, remote).await;
        res?;
        assert!(
            b[..] == value_of(key)[..],
            "client {id}: key {key} read wrong bytes"
        );
        buf = b;
    }
    conn.close().await
}

async fn clients(addr: SocketAddr, n: usize, lookups: usize) -> tokio_rdma::Result<()> {
    let (secs, _) = common::run_clients(n, |id| run_client(addr, id, lookups)).await?;
    println!(
        "kv: {n} clients x {lookups} RDMA READ lookups of {VALUE} bytes verified in {secs:.2} s: {:.0} lookups/s",
        (n * lookups) as f64 / secs
    );
    Ok(())
}

/// A key-value service read with one-sided RDMA READs: the server grants its table, clients
/// look values up without involving the server's CPU.
#[derive(Debug, Parser)]
#[command(
    after_help = "With neither --listen nor --connect, the server and the clients run in \
this process on $TOKIO_RDMA_ADDR, else 192.0.2.1:7472 (rxe0 in the soft-RoCE VM)."
)]
struct Args {
    #[command(flatten)]
    role: RoleArgs,
    /// Concurrent clients
    #[arg(long, value_name = "N", default_value_t = 4)]
    clients: usize,
    /// Lookups per client [default: 5000, 100 with --smoke]
    #[arg(long, value_name = "N")]
    lookups: Option<usize>,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let role = args.role.role(7472);
    let n = args.clients;
    let lookups = args
        .lookups
        .unwrap_or(if args.role.smoke { 100 } else { 5000 });
    match role {
        Role::Server(addr) => serve(addr, None).await?,
        Role::Client(addr) => clients(addr, n, lookups).await?,
        Role::Both(addr) => {
            let srv = tokio::spawn(serve(addr, Some(n)));
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            clients(addr, n, lookups).await?;
            srv.await??;
        }
    }
    Ok(())
}
