//! Live per-connection rates: an echo server and N clients on one endpoint in this process;
//! every second one line per connection (its id, peer, messages/s and MB/s each way, credit
//! waits/s, received bytes the application holds) and one line for the endpoint (the
//! driver's completions, polls, arms, in-place polls and CQ events per second).
//!
//! ```text
//! live_rates                                  # 4 clients, 10 s, 4 KiB messages
//! live_rates --clients 8 --seconds 30 --size 65536
//! live_rates --smoke                          # 2 clients, 3 s (the test suite's run)
//! live_rates --events                         # also the connections' setup/teardown events
//! ```
//!
//! The lines are `key=value` pairs, easy to grep:
//!
//! ```text
//! conn id=1 side=client peer=192.0.2.1:7481 tx_msgs/s=106 tx_MB/s=0.44 rx_msgs/s=108 rx_MB/s=0.44 credit_waits/s=0 held_bytes=4096
//! conn id=2 side=server peer=192.0.2.1:35339 tx_msgs/s=108 tx_MB/s=0.44 rx_msgs/s=106 rx_MB/s=0.44 credit_waits/s=0 held_bytes=0
//! endpoint device=rxe0 conns=4 completions/s=471 polls/s=441 arms/s=10 in_place/s=422 cq_events/s=10
//! ```
//!
//! Everything comes from `Connection::stats` and `Endpoint::stats`, read once a second (with
//! the `metrics` feature, `Endpoint::export_metrics` publishes the same counters to a
//! recorder instead). Runs on `$TOKIO_RDMA_ADDR`, else 192.0.2.1:7481 (rxe0 in the
//! soft-RoCE VM): `scripts/rxe-vm -- target/debug/examples/live_rates --smoke`.
#![allow(clippy::print_stdout, clippy::print_stderr)]

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use tokio_rdma::Endpoint;
use tokio_rdma::conn::{ConnStats, ConnectOptions, Connection};
use tokio_rdma::driver::DriverStats;

/// An echo server and N clients on one endpoint, printing live per-connection rates.
#[derive(Debug, Parser)]
struct Args {
    /// Concurrent clients
    #[arg(long, value_name = "N", default_value_t = 4)]
    clients: usize,
    /// How long the clients send
    #[arg(long, value_name = "S", default_value_t = 10)]
    seconds: u64,
    /// Message size in bytes
    #[arg(long, value_name = "BYTES", default_value_t = 4096)]
    size: usize,
    /// 2 clients for 3 seconds (the test suite's run)
    #[arg(long)]
    smoke: bool,
    /// Also print the crate's `tracing` events (connection setup, failure, teardown)
    #[arg(long)]
    events: bool,
}

/// A connection being watched, and its counters at the last report.
struct Watched {
    conn: Arc<Connection>,
    side: &'static str,
    last: ConnStats,
}

type Board = Arc<Mutex<Vec<Watched>>>;

fn watch(board: &Board, conn: &Arc<Connection>, side: &'static str) {
    board.lock().unwrap().push(Watched {
        conn: conn.clone(),
        side,
        last: conn.stats(),
    });
}

/// Echoes every message of each accepted connection.
async fn serve(listener: tokio_rdma::conn::Listener, n: usize, board: Board) {
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..n {
        let conn = Arc::new(listener.accept().await.expect("accept"));
        watch(&board, &conn, "server");
        tasks.spawn(async move {
            while let Some(msg) = conn.recv().await.expect("server recv") {
                conn.send(&msg).await.expect("echo");
            }
            conn.close().await.expect("server close");
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.expect("echo task");
    }
}

/// Sends `size`-byte messages and waits for each echo until `until`.
async fn client(conn: Arc<Connection>, size: usize, until: Instant) {
    let msg = vec![0x5a; size];
    while Instant::now() < until {
        conn.send(&msg).await.expect("send");
        let back = conn.recv().await.expect("recv").expect("echo");
        assert_eq!(back.len(), size, "echo length");
    }
    conn.close().await.expect("client close");
}

/// One line per connection and one for the endpoint: rates over `dt`.
fn report(ep: &Endpoint, board: &Board, last_ep: &mut DriverStats, dt: f64) {
    let rate = |now: u64, before: u64| now.saturating_sub(before) as f64 / dt;
    let mut board = board.lock().unwrap();
    for w in board.iter_mut() {
        let s = w.conn.stats();
        let (p, q) = (&s.protocol, &w.last.protocol);
        println!(
            "conn id={} side={} peer={} tx_msgs/s={:.0} tx_MB/s={:.2} rx_msgs/s={:.0} rx_MB/s={:.2} credit_waits/s={:.0} held_bytes={}",
            w.conn.id(),
            w.side,
            w.conn
                .peer_addr()
                .map_or_else(|_| "unknown".into(), |a| a.to_string()),
            rate(p.messages_sent, q.messages_sent),
            rate(p.bytes_sent, q.bytes_sent) / 1e6,
            rate(p.messages_received, q.messages_received),
            rate(p.bytes_received, q.bytes_received) / 1e6,
            rate(p.credit_waits, q.credit_waits),
            s.recv_bytes_held,
        );
        w.last = s;
    }
    let d = ep.stats();
    println!(
        "endpoint device={} conns={} completions/s={:.0} polls/s={:.0} arms/s={:.0} in_place/s={:.0} cq_events/s={:.0}",
        ep.device_name(),
        board.len(),
        rate(d.completions, last_ep.completions),
        rate(d.polls, last_ep.polls),
        rate(d.arms, last_ep.arms),
        rate(d.polled_in_place, last_ep.polled_in_place),
        rate(d.cq_events, last_ep.cq_events),
    );
    *last_ep = d;
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = Args::parse();
    if args.smoke {
        args.clients = 2;
        args.seconds = 3;
    }
    if args.events {
        tracing_subscriber::fmt()
            .with_env_filter("tokio_rdma=info")
            .with_writer(std::io::stderr)
            .init();
    }
    let addr = common::default_addr(7481);
    let ep = Endpoint::open_first_active()?;
    let listener = ep.listen_with(addr, ConnectOptions::default()).await?;
    let board: Board = Arc::default();
    let server = tokio::spawn(serve(listener, args.clients, board.clone()));
    let mut conns = Vec::new();
    for _ in 0..args.clients {
        let conn = Arc::new(ep.connect(addr, ConnectOptions::default()).await?);
        watch(&board, &conn, "client");
        conns.push(conn);
    }
    let until = Instant::now() + Duration::from_secs(args.seconds);
    let clients: Vec<_> = conns
        .into_iter()
        .map(|c| tokio::spawn(client(c, args.size, until)))
        .collect();
    let mut last_ep = ep.stats();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.tick().await;
    let mut t0 = Instant::now();
    while Instant::now() < until {
        tick.tick().await;
        let now = Instant::now();
        report(&ep, &board, &mut last_ep, (now - t0).as_secs_f64());
        t0 = now;
    }
    for c in clients {
        c.await?;
    }
    server.await?;
    println!("live_rates: {} clients done", args.clients);
    Ok(())
}
