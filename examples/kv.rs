//! A one-sided key-value read service with live updates: the server keeps ONE table
//! ([`SharedRegion`]) and grants each client read access to it (a registration of the same
//! pages in that client's connection, no copy per client); clients fetch values with RDMA
//! READ, without any server CPU per lookup, while the server rewrites values under them.
//!
//! Consistency without locks, seqlock style: each value starts with a version word. The server
//! makes the version odd, rewrites the value (slowly on purpose: half, a pause, the rest), then
//! makes the version even again. A client posts three READs on its connection at once: the
//! version, the value, the version again. The peer executes the READs of one queue pair in
//! order, so if both versions are equal and even, no rewrite overlapped the value's read;
//! otherwise the client reads again. Every accepted value is checked against the bytes the
//! server writes for that key and version: a torn value accepted fails the run (exit 1).
//!
//! ```text
//! kv                             # server and 4 clients in this process (192.0.2.1:7472)
//! kv --listen 10.0.0.1:7472      # server only
//! kv --connect 10.0.0.1:7472 [--clients N] [--lookups M]
//! ```
#![allow(clippy::print_stdout, clippy::print_stderr)]

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use clap::Parser;
use common::{Role, RoleArgs};
use tokio_rdma::buf::{RemoteAccess, RemoteToken, SharedRegion};
use tokio_rdma::conn::{Connection, Listener};

const KEYS: usize = 4096;
/// One value: its version word, then the payload.
const VALUE: usize = 256;
const PAYLOAD: usize = VALUE - 8;
/// The keys the server rewrites, and that clients read half the time.
const HOT: usize = 16;

/// The payload stored under `key` at `version`: bytes a client can check.
fn payload_of(key: usize, version: u64) -> [u8; PAYLOAD] {
    let mut v = [0u8; PAYLOAD];
    v[..8].copy_from_slice(&(key as u64).to_le_bytes());
    for (i, b) in v[8..].iter_mut().enumerate() {
        *b = (key as u64 * 31 + version * 7 + i as u64) as u8;
    }
    v
}

/// Rewrites hot keys until `stop`: version odd, half the payload, a pause, the rest, version
/// even. Returns the number of rewrites.
async fn update(table: SharedRegion, stop: Arc<AtomicBool>) -> u64 {
    let mut n = 0u64;
    let mut key = 0;
    while !stop.load(Ordering::Relaxed) {
        key = (key * 7 + 3) % HOT;
        let at = key * VALUE;
        let v = table.load_u64(at);
        table.store_u64(at, v + 1);
        let new = payload_of(key, v + 2);
        table.write_at(at + 8, &new[..PAYLOAD / 2]);
        // A slow writer: readers meet this value half written (odd version) and retry.
        tokio::time::sleep(Duration::from_millis(1)).await;
        table.write_at(at + 8 + PAYLOAD / 2, &new[PAYLOAD / 2..]);
        table.store_u64(at, v + 2);
        n += 1;
    }
    n
}

async fn serve(addr: SocketAddr, max_conns: Option<usize>) -> tokio_rdma::Result<()> {
    let listener = Listener::bind(addr).await?;
    // One table for every client, filled once; each client gets a grant of its own on it.
    let table = SharedRegion::new(KEYS * VALUE);
    for key in 0..KEYS {
        table.write_at(key * VALUE + 8, &payload_of(key, 0));
    }
    println!(
        "kv server on {addr}: {KEYS} keys of {VALUE} bytes, one {} KiB table shared by every client; keys 0..{HOT} rewritten continuously",
        KEYS * VALUE / 1024
    );
    let stop = Arc::new(AtomicBool::new(false));
    let updater = tokio::spawn(update(table.clone(), stop.clone()));
    let most_grants = Arc::new(AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    let mut accepted = 0;
    while max_conns.is_none_or(|m| accepted < m) {
        let conn = listener.accept().await?;
        accepted += 1;
        let (table, most) = (table.clone(), most_grants.clone());
        tasks.spawn(async move {
            let grant = conn.grant_shared(&table, 0..table.len(), RemoteAccess::READ)?;
            most.fetch_max(table.grants() as u64, Ordering::Relaxed);
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
    stop.store(true, Ordering::Relaxed);
    let rewrites = updater.await.expect("updater");
    println!(
        "kv server: {rewrites} rewrites; up to {} grants on the one table at once, {} now",
        most_grants.load(Ordering::Relaxed),
        table.grants()
    );
    Ok(())
}

/// What one client saw.
#[derive(Default)]
struct Seen {
    lookups: u64,
    retries: u64,
}

async fn run_client(addr: SocketAddr, id: usize, lookups: usize) -> tokio_rdma::Result<Seen> {
    let conn = Connection::connect(addr).await?;
    let token = RemoteToken::from_bytes(&conn.recv().await?.expect("token"))?;
    let pool = conn.pool()?;
    let (mut before, mut value, mut after) = (
        pool.acquire(8).await?,
        pool.acquire(PAYLOAD).await?,
        pool.acquire(8).await?,
    );
    let mut seen = Seen::default();
    let mut key = id * 977;
    for i in 0..lookups {
        key = (key * 1_103_515_245 + 12_345) % KEYS;
        let k = if i % 2 == 0 { key % HOT } else { key };
        let at = (k * VALUE) as u64;
        let version = token.slice(at..at + 8)?;
        let data = token.slice(at + 8..at + VALUE as u64)?;
        loop {
            // Posted in this order on one queue pair, executed by the peer in this order.
            let ((r1, b1), (r2, b2), (r3, b3)) = tokio::join!(
                conn.read(before, version),
                conn.read(value, data),
                conn.read(after, version)
            );
            (before, value, after) = (b1, b2, b3);
            r1?;
            r2?;
            r3?;
            let v1 = u64::from_ne_bytes(before[..8].try_into().expect("8 bytes"));
            let v2 = u64::from_ne_bytes(after[..8].try_into().expect("8 bytes"));
            if v1 != v2 || v1 % 2 == 1 {
                seen.retries += 1;
                continue;
            }
            if value[..] != payload_of(k, v1)[..] {
                eprintln!("kv: client {id}: key {k} version {v1}: a torn value was accepted");
                std::process::exit(1);
            }
            seen.lookups += 1;
            break;
        }
    }
    conn.close().await?;
    Ok(seen)
}

async fn clients(addr: SocketAddr, n: usize, lookups: usize) -> tokio_rdma::Result<()> {
    let (secs, seen) = common::run_clients(n, |id| run_client(addr, id, lookups)).await?;
    let total: u64 = seen.iter().map(|s| s.lookups).sum();
    let retries: u64 = seen.iter().map(|s| s.retries).sum();
    println!(
        "kv: {n} clients x {lookups} lookups of {VALUE} bytes (3 RDMA READs each) verified in {secs:.2} s: {:.0} lookups/s; {retries} re-reads of values being rewritten, 0 torn values accepted",
        total as f64 / secs
    );
    Ok(())
}

/// A key-value service read with one-sided RDMA READs: the server shares one table with every
/// client and rewrites values while they read; clients never accept a half-written value.
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
            tokio::time::sleep(Duration::from_millis(300)).await;
            clients(addr, n, lookups).await?;
            srv.await??;
        }
    }
    Ok(())
}
