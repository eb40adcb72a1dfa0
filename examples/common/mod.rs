//! Small helpers shared by the examples: argument parsing and latency tables.
#![allow(dead_code, clippy::print_stdout, unreachable_pub)]

use std::net::SocketAddr;
use std::time::Duration;

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

/// Parses the common flags; returns the role and the remaining `(flag, value)` pairs.
pub fn parse(port: u16) -> (Role, bool, Vec<(String, String)>) {
    let mut role = Role::Both(default_addr(port));
    let mut smoke = false;
    let mut rest = Vec::new();
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--smoke" => smoke = true,
            "--listen" => {
                role = Role::Server(
                    it.next()
                        .expect("--listen ADDR")
                        .parse()
                        .expect("ADDR as ip:port"),
                )
            }
            "--connect" => {
                role = Role::Client(
                    it.next()
                        .expect("--connect ADDR")
                        .parse()
                        .expect("ADDR as ip:port"),
                )
            }
            flag if flag.starts_with("--") => {
                rest.push((flag.to_string(), it.next().unwrap_or_default()))
            }
            other => panic!("unexpected argument {other}"),
        }
    }
    (role, smoke, rest)
}

pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

/// Prints a perftest-style latency table of round-trip samples (also as half round trips,
/// which is what perftest's `ib_send_lat` reports).
pub fn latency_table(title: &str, size: usize, samples: &mut [Duration]) {
    samples.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!("{title}");
    println!(" #bytes  #iters  t_min[us]  t_p50[us]  t_p90[us]  t_p99[us]  t_p99.9[us]  t_max[us]");
    let row = |name: &str, div: f64| {
        println!(
            " {:<7} {:<7} {:>9.2} {:>10.2} {:>10.2} {:>10.2} {:>12.2} {:>10.2}   {name}",
            size,
            samples.len(),
            us(samples[0]) / div,
            us(percentile(samples, 0.50)) / div,
            us(percentile(samples, 0.90)) / div,
            us(percentile(samples, 0.99)) / div,
            us(percentile(samples, 0.999)) / div,
            us(*samples.last().expect("samples")) / div,
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
