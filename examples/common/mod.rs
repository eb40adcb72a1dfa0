//! Small helpers shared by the examples: the common `clap` flags and latency tables from an
//! HDR histogram.
#![allow(dead_code, clippy::print_stdout, unreachable_pub)]

pub mod proc_stats;

use std::net::SocketAddr;
use std::time::Duration;

use hdrhistogram::Histogram;

/// Where the examples listen/connect when no address is given: rxe0's address in the soft-RoCE
/// VM, or `$TOKIO_RDMA_ADDR`.
pub fn default_addr(port: u16) -> SocketAddr {
    std::env::var("TOKIO_RDMA_ADDR")
        .ok()
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| SocketAddr::from(([192, 0, 2, 1], port)))
}

/// `--listen ADDR` / `--connect ADDR` / neither (both ends in this process).
#[derive(Debug, Clone, Copy)]
pub enum Role {
    Both(SocketAddr),
    Server(SocketAddr),
    Client(SocketAddr),
}

/// The flags every connection example takes (flatten into its `clap` parser).
#[derive(Debug, Clone, clap::Args)]
pub struct RoleArgs {
    /// Run only the server, listening on ADDR (ip:port of an RDMA device's netdev)
    #[arg(long, value_name = "ADDR", conflicts_with = "connect")]
    pub listen: Option<SocketAddr>,
    /// Run only the client, connecting to ADDR (ip:port)
    #[arg(long, value_name = "ADDR")]
    pub connect: Option<SocketAddr>,
    /// Small iteration counts (the test suite's smoke run)
    #[arg(long)]
    pub smoke: bool,
}

impl RoleArgs {
    /// The role: server, client, or both in this process on [`default_addr`]`(port)`.
    pub fn role(&self, port: u16) -> Role {
        match (self.listen, self.connect) {
            (Some(a), _) => Role::Server(a),
            (None, Some(a)) => Role::Client(a),
            (None, None) => Role::Both(default_addr(port)),
        }
    }
}

/// A histogram of latencies in nanoseconds, 1 ns to 1 h at 3 significant digits.
pub fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000_000, 3).expect("valid histogram bounds")
}

/// Records one latency sample (saturating at the histogram's upper bound).
pub fn record(h: &mut Histogram<u64>, d: Duration) {
    let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX).max(1);
    h.saturating_record(ns);
}

/// Prints a perftest-style latency table of round-trip samples (also as half round trips,
/// which is what perftest's `ib_send_lat` reports).
pub fn latency_table(title: &str, size: usize, h: &Histogram<u64>) {
    let us = |ns: u64| ns as f64 / 1e3;
    println!("{title}");
    println!(" #bytes  #iters  t_min[us]  t_p50[us]  t_p90[us]  t_p99[us]  t_p99.9[us]  t_max[us]");
    let row = |name: &str, div: f64| {
        println!(
            " {:<7} {:<7} {:>9.2} {:>10.2} {:>10.2} {:>10.2} {:>12.2} {:>10.2}   {name}",
            size,
            h.len(),
            us(h.min()) / div,
            us(h.value_at_quantile(0.50)) / div,
            us(h.value_at_quantile(0.90)) / div,
            us(h.value_at_quantile(0.99)) / div,
            us(h.value_at_quantile(0.999)) / div,
            us(h.max()) / div,
        );
    };
    row("round trip", 1.0);
    row("half round trip (perftest's definition)", 2.0);
}

/// Runs `n` clients concurrently (`client(id)`), failing on the first error, and returns the
/// elapsed seconds and the clients' results.
pub async fn run_clients<F, Fut, T>(n: usize, client: F) -> tokio_rdma::Result<(f64, Vec<T>)>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = tokio_rdma::Result<T>> + Send + 'static,
    T: Send + 'static,
{
    let start = std::time::Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for id in 0..n {
        set.spawn(client(id));
    }
    let mut out = Vec::with_capacity(n);
    while let Some(r) = set.join_next().await {
        out.push(r.expect("client task")?);
    }
    Ok((start.elapsed().as_secs_f64(), out))
}
