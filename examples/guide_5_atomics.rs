//! Guide step 5 (docs/guide.md): RDMA atomics on granted memory.
//!
//! The server grants two 8-byte words for atomics: a counter and a lock. On the client, 4
//! tasks share one connection and fetch-and-add the counter: every previous value they get
//! back is distinct, and the server finds the exact total. Then a compare-and-swap takes the
//! lock, and a second one fails because the lock is taken. Server and client run in this
//! process.
//!
//! ```text
//! cargo run --example guide_5_atomics -- [--addr IP] [--port PORT] [--adds N]
//! ```
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use tokio::task::JoinSet;
use tokio_rdma::Endpoint;
use tokio_rdma::buf::{RemoteAccess, RemoteToken};
use tokio_rdma::conn::ConnectOptions;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const TASKS: u64 = 4;

/// A server granting a counter and a lock, a client updating them atomically.
#[derive(Parser)]
struct Args {
    /// An IP address of an RDMA device's netdev (rxe0's in the soft-RoCE VM)
    #[arg(long, default_value = "192.0.2.1")]
    addr: IpAddr,
    /// The port to listen on
    #[arg(long, default_value_t = 7485)]
    port: u16,
    /// Fetch-and-adds per task [default: 500, 25 with --smoke]
    #[arg(long)]
    adds: Option<u64>,
    /// Small counts (the test suite's smoke run)
    #[arg(long)]
    smoke: bool,
}

async fn run(args: Args) -> Result<(), BoxError> {
    let addr = SocketAddr::new(args.addr, args.port);
    let adds = args.adds.unwrap_or(if args.smoke { 25 } else { 500 });
    let ep = Endpoint::open_first_active()?;
    // Atomics are offered in the handshake: the granting side must offer them (set on both
    // sides here, so either side may grant).
    let opts = ConnectOptions::default().one_sided(true).atomics(true);

    let listener = ep.listen_with(addr, opts.clone()).await?;
    let server = tokio::spawn(async move {
        let conn = listener.accept().await?;
        // Two 8-byte aligned words (pool buffers are 64-byte aligned), zeroed, then granted.
        let mut words = conn.pool()?.acquire(16).await?;
        words.fill(0);
        let grant = conn.grant(words, 0..16, RemoteAccess::ATOMIC)?;
        conn.send(&grant.token().to_bytes()).await?;
        let done = conn.recv().await?.ok_or("the client left")?;
        // load_u64: an atomic load of a word the peer updates.
        let (counter, lock) = (grant.load_u64(0), grant.load_u64(8));
        println!("server: counter {counter}, lock {lock}");
        if &done[..] != b"done" || counter != TASKS * adds || lock != 42 {
            return Err("server: the words do not hold what the client did".into());
        }
        conn.send(b"ok").await?;
        while conn.recv().await?.is_some() {}
        conn.close().await?;
        Ok::<_, BoxError>(())
    });

    let conn = Arc::new(ep.connect(addr, opts).await?);
    let token = RemoteToken::from_bytes(&conn.recv().await?.ok_or("no token")?)?;
    let (counter, lock) = (token.slice(0..8)?, token.slice(8..16)?);

    // Fetch-and-add from several tasks on one connection.
    let mut tasks = JoinSet::new();
    for _ in 0..TASKS {
        let conn = conn.clone();
        tasks.spawn(async move {
            let mut buf = conn.pool()?.acquire(8).await?; // receives the previous value
            let mut seen = Vec::new();
            for _ in 0..adds {
                let (res, b) = conn.fetch_add(buf, counter, 1).await;
                seen.push(res?);
                buf = b;
            }
            Ok::<_, BoxError>(seen)
        });
    }
    let mut seen = Vec::new();
    while let Some(r) = tasks.join_next().await {
        seen.extend(r??);
    }
    seen.sort_unstable();
    if seen != (0..TASKS * adds).collect::<Vec<_>>() {
        return Err("fetch_add: the previous values are not 0..total, each once".into());
    }
    println!(
        "{} fetch_adds, each saw a distinct previous value",
        seen.len()
    );

    // Compare-and-swap: take the lock (0 -> 42); a second attempt finds it taken.
    let buf = conn.pool()?.acquire(8).await?;
    let (res, buf) = conn.compare_swap(buf, lock, 0, 42).await;
    let first = res?; // the previous value: 0 means the swap happened
    let (res, _) = conn.compare_swap(buf, lock, 0, 7).await;
    let second = res?; // 42: the compare failed, nothing was swapped
    println!("compare_swap: took the lock (was {first}), then found it held (was {second})");
    if (first, second) != (0, 42) {
        return Err(format!("compare_swap returned {first} and {second}").into());
    }
    conn.send(b"done").await?;
    if &conn.recv().await?.ok_or("the server left")?[..] != b"ok" {
        return Err("the server did not confirm".into());
    }
    conn.close().await?;
    server.await??;
    println!("guide_5_atomics: ok");
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    // Errors print with `Display`: what failed and, for common causes, what to do.
    match run(Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("guide_5_atomics: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}
