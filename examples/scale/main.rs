//! Many connections on one device (issue 14): connection setup rate, registered memory per
//! connection, message rate with every connection active at once, RNR counters, the
//! distribution of `close()` durations over every connection end (issue 25), and the device's
//! resources back to the baseline after teardown.
//!
//! ```text
//! scale --connections 1000 --messages 100 --size 64 --credits 8 --buf-size 4096
//! scale --smoke                 # 50 connections x 20 messages, a few seconds
//! scale --connections 100 --json
//! scale --connections 1000 --close-pattern full --close-concurrency 32
//! ```
//!
//! Both ends run in this process: the listener on a **server endpoint**, every client on one
//! **client endpoint** (`--shared-endpoint`: one endpoint for both). Two endpoints are the
//! default because they are what two hosts would have: each side's N connections on one
//! completion queue, each CQ with the device's `max_cqe` entries, so the limit the run finds
//! is the limit of one endpoint with N connections (a shared endpoint carries 2N queue pairs).
//!
//! The run fails (exit status 1) if a connection cannot be set up, a message is lost,
//! duplicated, reordered or corrupted, any `close()` returns an error (every close here is
//! clean on both sides: all messages were verified and each side reads the other's end of
//! stream), the device counted any RNR NAK, or the device's resources (`rdma resource show`:
//! qp, cq, mr, pd, cm_id) do not return to the baseline.
#![allow(clippy::print_stdout, clippy::print_stderr)]

mod close;
#[path = "../common/mod.rs"]
mod common;
mod sys;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use close::{ClosePattern, close_all};
use common::proc_stats::{fd_count, resource_counts, rss_bytes};
use sys::{Report, hw_counters, raise_fd_limit};
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;
use tokio_rdma::conn::{ConnectOptions, Connection, SrqOptions};
use tokio_rdma::{Endpoint, EndpointOptions};

/// N connections on one device: setup rate, memory per connection, message rate with all
/// connections active, RNR counters, resources back to the baseline.
#[derive(Debug, Parser)]
#[command(
    after_help = "Listens on $TOKIO_RDMA_ADDR, else 192.0.2.1:7490 (rxe0 in the \
soft-RoCE VM); --addr overrides it. Exit status 1 on any lost or corrupted message, close() error, \
RNR NAK, setup failure or leaked device resource."
)]
struct Args {
    /// Connections (client and server side each have this many)
    #[arg(long, value_name = "N")]
    connections: Option<usize>,
    /// Messages each client connection sends to its server peer [default: 100, 20 with --smoke]
    #[arg(long, value_name = "M")]
    messages: Option<usize>,
    /// Message size in bytes (at least 16: the connection id and sequence number)
    #[arg(long, value_name = "S", default_value_t = 64)]
    size: usize,
    /// Receive credits per connection (both sides)
    #[arg(long, value_name = "C", default_value_t = 8)]
    credits: u32,
    /// Receive buffer size per connection (both sides)
    #[arg(long, value_name = "B", default_value_t = 4096)]
    buf_size: u32,
    /// Connects in flight at once (the listener's backlog is set to twice this)
    #[arg(long, value_name = "K", default_value_t = 32)]
    concurrency: usize,
    /// Send-queue entries for one-sided operations per connection (none are used here)
    #[arg(long, value_name = "D", default_value_t = 2)]
    send_queue_depth: u32,
    /// Completion queue entries per endpoint [default: the device's max_cqe]
    #[arg(long, value_name = "E")]
    cq_size: Option<u32>,
    /// One endpoint (one CQ) for the listener and the clients
    #[arg(long)]
    shared_endpoint: bool,
    /// Give the server endpoint a shared receive queue of this many buffers (of --buf-size
    /// bytes): every server-side connection receives into them
    #[arg(long, value_name = "BUFFERS")]
    srq: Option<u32>,
    /// Connect and handshake timeout, seconds (TCG is slow)
    #[arg(long, value_name = "SECS", default_value_t = 120)]
    timeout: u64,
    /// Listen address (ip:port on the device's netdev)
    #[arg(long, value_name = "ADDR")]
    addr: Option<SocketAddr>,
    /// RDMA device [default: the first with an active port]
    #[arg(long, value_name = "NAME")]
    device: Option<String>,
    /// 50 connections x 20 messages (the test suite's smoke run)
    #[arg(long)]
    smoke: bool,
    /// How the two ends close: `half` (client: shutdown, read the server's end of stream,
    /// close; server: read the client's end of stream, close) or `full` (client: close at
    /// once; server: read the end of stream, close). Every close() must return Ok.
    #[arg(long, value_enum, value_name = "PATTERN", default_value = "half")]
    close_pattern: ClosePattern,
    /// Connections closing at once [default: all]
    #[arg(long, value_name = "K")]
    close_concurrency: Option<usize>,
    /// Also print the results as one JSON object (last line)
    #[arg(long)]
    json: bool,
}

/// Deterministic message `seq` of connection `id`: id and seq (little endian), then bytes of
/// an xorshift stream seeded by both.
fn payload(id: u64, seq: u64, buf: &mut [u8]) {
    buf[..8].copy_from_slice(&id.to_le_bytes());
    buf[8..16].copy_from_slice(&seq.to_le_bytes());
    let mut x = (id << 32 ^ seq).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for b in &mut buf[16..] {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
}

fn open_endpoint(args: &Args, srq: Option<u32>) -> tokio_rdma::Result<Endpoint> {
    let mut o = EndpointOptions::default();
    o.cq_size = args.cq_size;
    if let Some(buffers) = srq {
        o = o.shared_receive_queue(
            SrqOptions::default()
                .buffers(buffers)
                .buffer_size(args.buf_size),
        );
    }
    match &args.device {
        Some(d) => Endpoint::open_with(d, o),
        None => Endpoint::open_first_active_with(o),
    }
}

/// Sets up `n` connections, `k` connects in flight; returns (client, server) connections, the
/// setup latency histogram (client side, connect call to established) and the elapsed time.
async fn setup(
    client_ep: &Endpoint,
    listener: Arc<tokio_rdma::conn::Listener>,
    addr: SocketAddr,
    opts: &ConnectOptions,
    n: usize,
    k: usize,
) -> Result<
    (
        Vec<Connection>,
        Vec<Connection>,
        hdrhistogram::Histogram<u64>,
        f64,
    ),
    String,
> {
    let start = Instant::now();
    let acceptor = tokio::spawn(async move {
        let mut conns = Vec::with_capacity(n);
        while conns.len() < n {
            conns.push(listener.accept().await?);
        }
        Ok::<_, tokio_rdma::Error>(conns)
    });
    let sem = Arc::new(Semaphore::new(k));
    let mut set = JoinSet::new();
    for id in 0..n {
        let (ep, opts, sem) = (client_ep.clone(), opts.clone(), sem.clone());
        set.spawn(async move {
            let _permit = sem.acquire_owned().await.expect("semaphore");
            let t0 = Instant::now();
            let r = ep.connect(addr, opts).await;
            (id, t0.elapsed(), r)
        });
    }
    let mut hist = common::histogram();
    let mut clients = Vec::with_capacity(n);
    let mut first_err = None;
    while let Some(r) = set.join_next().await {
        let (id, took, r) = match r {
            Ok(x) => x,
            // The rest, aborted after the first failure.
            Err(e) if e.is_cancelled() => continue,
            Err(e) => panic!("connect task: {e}"),
        };
        match r {
            Ok(c) => {
                common::record(&mut hist, took);
                clients.push(c);
            }
            Err(e) => {
                if first_err.is_none() {
                    first_err = Some(format!(
                        "connect {id} failed after {took:?} ({} established): {e}",
                        clients.len()
                    ));
                    set.abort_all();
                }
            }
        }
    }
    if let Some(e) = first_err {
        acceptor.abort();
        return Err(e);
    }
    let servers = match tokio::time::timeout(Duration::from_secs(60), acceptor).await {
        Ok(Ok(Ok(s))) => s,
        Ok(Ok(Err(e))) => return Err(format!("accept failed: {e}")),
        Ok(Err(e)) => return Err(format!("accept task: {e}")),
        Err(_) => return Err("accept: not all connections arrived within 60 s".into()),
    };
    Ok((clients, servers, hist, start.elapsed().as_secs_f64()))
}

/// Outcome of the message phase.
struct Traffic {
    secs: f64,
    /// Per connection: messages / seconds from the start to its last message's arrival.
    rates: Vec<f64>,
    clients: Vec<Connection>,
    servers: Vec<Connection>,
}

/// Every client sends `m` messages of `size` bytes to its server peer, all at once (released
/// together); every server checks each message's connection id, sequence and bytes.
async fn traffic(
    clients: Vec<Connection>,
    servers: Vec<Connection>,
    m: usize,
    size: usize,
) -> Result<Traffic, String> {
    let n = clients.len();
    let (go_tx, go_rx) = watch::channel(None::<Instant>);
    let mut recv_set = JoinSet::new();
    for conn in servers {
        let mut go = go_rx.clone();
        recv_set.spawn(async move {
            let start = *go
                .wait_for(Option::is_some)
                .await
                .expect("gate")
                .as_ref()
                .unwrap();
            let mut expect = vec![0u8; size];
            let mut id = None;
            for seq in 0..m as u64 {
                let msg = match conn.recv().await {
                    Ok(Some(msg)) => msg,
                    Ok(None) => return Err(format!("peer closed after {seq} of {m} messages")),
                    Err(e) => return Err(format!("recv {seq}: {e}")),
                };
                if msg.len() != size {
                    return Err(format!(
                        "message {seq}: {} bytes, expected {size}",
                        msg.len()
                    ));
                }
                let got_id = u64::from_le_bytes(msg[..8].try_into().unwrap());
                let id = *id.get_or_insert(got_id);
                payload(id, seq, &mut expect);
                if msg[..] != expect[..] {
                    let got_seq = u64::from_le_bytes(msg[8..16].try_into().unwrap());
                    return Err(format!(
                        "connection {id}: message {seq} differs (id {got_id}, seq {got_seq})"
                    ));
                }
            }
            let secs = start.elapsed().as_secs_f64();
            Ok((id.unwrap_or(u64::MAX), secs, conn))
        });
    }
    let mut send_set = JoinSet::new();
    for (id, conn) in clients.into_iter().enumerate() {
        let mut go = go_rx.clone();
        send_set.spawn(async move {
            go.wait_for(Option::is_some).await.expect("gate");
            let mut buf = vec![0u8; size];
            for seq in 0..m as u64 {
                payload(id as u64, seq, &mut buf);
                conn.send(&buf)
                    .await
                    .map_err(|e| format!("send {id}/{seq}: {e}"))?;
            }
            Ok::<_, String>(conn)
        });
    }
    // Give every task a chance to wait on the gate, then open it.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let start = Instant::now();
    go_tx.send_replace(Some(start));
    let mut clients = Vec::with_capacity(n);
    while let Some(r) = send_set.join_next().await {
        clients.push(r.expect("send task")?);
    }
    let mut servers = Vec::with_capacity(n);
    let mut rates = Vec::with_capacity(n);
    let mut seen = vec![false; n];
    while let Some(r) = recv_set.join_next().await {
        let (id, secs, conn) = r.expect("recv task")?;
        let slot = seen
            .get_mut(id as usize)
            .ok_or_else(|| format!("unknown connection id {id}"))?;
        if std::mem::replace(slot, true) {
            return Err(format!(
                "two server connections got connection {id}'s messages"
            ));
        }
        rates.push(m as f64 / secs);
        servers.push(conn);
    }
    Ok(Traffic {
        secs: start.elapsed().as_secs_f64(),
        rates,
        clients,
        servers,
    })
}

/// Sum of the connections' registered pool bytes: (receive pool, staging pool).
fn registered(conns: &[Connection]) -> (u64, u64) {
    conns.iter().fold((0, 0), |(r, s), c| {
        let st = c.stats();
        (
            r + st.recv_pool.bytes_registered,
            s + st.staging_pool.bytes_registered,
        )
    })
}

#[tokio::main]
async fn main() {
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .init();
    }
    let args = Args::parse();
    match run(args).await {
        Ok(()) => {}
        Err(e) => {
            eprintln!("scale: FAILED: {e}");
            std::process::exit(1);
        }
    }
}

async fn run(args: Args) -> Result<(), String> {
    let n = args
        .connections
        .unwrap_or(if args.smoke { 50 } else { 100 });
    let m = args.messages.unwrap_or(if args.smoke { 20 } else { 100 });
    if args.size < 16 {
        return Err("--size must be at least 16 (connection id and sequence number)".into());
    }
    let k = args.concurrency.max(1);
    if args.srq.is_some() && args.shared_endpoint {
        return Err("--srq gives the server endpoint a shared receive queue: use it without --shared-endpoint".into());
    }
    let addr = args.addr.unwrap_or_else(|| common::default_addr(7490));
    let mut rep = Report::new(args.json);
    let (soft, hard) = raise_fd_limit();
    rep.line(format!(
        "fd limit (RLIMIT_NOFILE): soft raised to {soft} (hard {hard})"
    ));

    let server_ep = open_endpoint(&args, args.srq).map_err(|e| format!("open endpoint: {e}"))?;
    let client_ep = if args.shared_endpoint {
        server_ep.clone()
    } else {
        open_endpoint(&args, None).map_err(|e| format!("open endpoint: {e}"))?
    };
    let dev = server_ep.device_name().to_string();
    let attr = server_ep.context().device_attr();
    let cq = args.cq_size.unwrap_or(attr.max_cqe.min(65536));
    rep.line(format!(
        "device {dev}: max_qp {} max_cqe {} max_mr {}; endpoints: {} (CQ of {cq} entries each)",
        attr.max_qp,
        attr.max_cqe,
        attr.max_mr,
        if args.shared_endpoint {
            "1 shared"
        } else {
            "server + client"
        },
    ));
    let mut opts = ConnectOptions::default()
        .recv_credits(args.credits)
        .recv_buf_size(args.buf_size)
        .connect_timeout(Duration::from_secs(args.timeout))
        .handshake_timeout(Duration::from_secs(args.timeout))
        .backlog(2 * k);
    opts.send_queue_depth = args.send_queue_depth;
    let listener = server_ep
        .listen_with(addr, opts.clone())
        .await
        .map_err(|e| format!("listen on {addr}: {e}"))?;
    let listener = Arc::new(listener);

    // Warm-up: the first connection on a device makes librdmacm's per-device state (a PD).
    let (c, s, _, _) = setup(&client_ep, listener.clone(), addr, &opts, 1, 1)
        .await
        .map_err(|e| format!("warm-up: {e}"))?;
    let t = traffic(c, s, 1, args.size)
        .await
        .map_err(|e| format!("warm-up: {e}"))?;
    let warm = close_all(t.clients, t.servers, args.close_pattern, None)
        .await
        .map_err(|e| format!("warm-up: {e}"))?;
    if warm.errors() > 0 {
        return Err(format!("warm-up: {}", warm.results_line()));
    }
    // Queue pairs on a shared receive queue are destroyed after their last-WQE event, or 2 s
    // after closing where the device sends none (rxe before Linux 6.5): let them go first.
    tokio::time::sleep(Duration::from_millis(2500)).await;

    let res0 = resource_counts(&dev)?;
    let hw0 = hw_counters(&dev);
    let (rss0, fds0) = (rss_bytes(), fd_count());
    rep.line(format!(
        "baseline: rss {:.1} MiB, fds {fds0}, resources {res0:?}",
        mib(rss0)
    ));
    rep.num("connections", n as f64);
    rep.num("messages", m as f64);
    rep.num("size", args.size as f64);
    rep.num("credits", f64::from(args.credits));
    rep.num("buf_size", f64::from(args.buf_size));

    // ---- setup -----------------------------------------------------------------------
    let (clients, servers, hist, secs) = setup(&client_ep, listener.clone(), addr, &opts, n, k)
        .await
        .map_err(|e| format!("setup of {n} connections ({k} in flight): {e}"))?;
    let ms = |q: f64| hist.value_at_quantile(q) as f64 / 1e6;
    rep.line(format!(
        "setup: {n} connections in {secs:.2} s ({k} in flight): {:.1} conn/s; connect latency p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms; listener rejected {}",
        n as f64 / secs,
        ms(0.5),
        ms(0.99),
        hist.max() as f64 / 1e6,
        listener.rejected()
    ));
    rep.num("setup_secs", secs);
    rep.num("setup_conn_per_s", n as f64 / secs);
    rep.num("setup_p50_ms", ms(0.5));
    rep.num("setup_p99_ms", ms(0.99));
    rep.num("setup_max_ms", hist.max() as f64 / 1e6);

    // ---- memory ----------------------------------------------------------------------
    let (crecv, cstage) = registered(&clients);
    let (srecv, sstage) = registered(&servers);
    let nn = n as u64;
    // The server side's receive memory: its connections' receive pools, or the shared
    // receive queue's one pool.
    let server_recv = match server_ep.shared_receive_stats() {
        Some(q) => {
            rep.line(format!(
                "server receive memory: shared receive queue of {} buffers x {} B = {} B registered for {n} connections ({} B per connection); {} receives granted, {} buffers unclaimed",
                q.buffers,
                args.buf_size,
                q.pool.bytes_registered,
                q.pool.bytes_registered / nn,
                q.granted,
                q.spare
            ));
            q.pool.bytes_registered
        }
        None => {
            rep.line(format!(
                "server receive memory: {srecv} B registered in {n} private receive pools ({} B per connection)",
                srecv / nn
            ));
            srecv
        }
    };
    let res1 = resource_counts(&dev)?;
    let (rss1, fds1) = (rss_bytes(), fd_count());
    let b = u64::from(args.buf_size).next_multiple_of(64);
    let c = u64::from(args.credits);
    let page = |x: u64| x.next_multiple_of(4096);
    let (want_recv, want_stage) = (page((2 * c + 3) * b), page((c + 1) * b));
    rep.line(format!(
        "registered per connection: receive pool {} B, staging pool {} B, total {} B (formula: (2x{c}+3)x{b} = {want_recv}, ({c}+1)x{b} = {want_stage}, page-rounded)",
        crecv / nn,
        cstage / nn,
        (crecv + cstage) / nn
    ));
    rep.line(format!(
        "registered in all ({} connection ends): receive {:.1} MiB, staging {:.1} MiB, total {:.1} MiB; server side per connection: receive {} B, staging {} B",
        2 * n,
        mib(crecv + server_recv),
        mib(cstage + sstage),
        mib(crecv + server_recv + cstage + sstage),
        server_recv / nn,
        sstage / nn
    ));
    rep.line(format!(
        "with {n} connections up: rss {:.1} MiB (+{:.1} KiB per connection end), fds {fds1} (+{}), resources {res1:?}",
        mib(rss1),
        (rss1.saturating_sub(rss0)) as f64 / 1024.0 / (2 * n) as f64,
        fds1 as i64 - fds0 as i64,
    ));
    rep.num("server_recv_bytes", server_recv as f64);
    rep.num("server_recv_bytes_per_conn", (server_recv / nn) as f64);
    rep.num("recv_registered_per_conn", (crecv / nn) as f64);
    rep.num("staging_registered_per_conn", (cstage / nn) as f64);
    rep.num(
        "registered_total_bytes",
        (crecv + server_recv + cstage + sstage) as f64,
    );
    rep.num("rss_bytes", rss1 as f64);
    rep.num("fds", fds1 as f64);
    if (crecv / nn, cstage / nn) != (want_recv, want_stage) {
        rep.line("note: registered bytes differ from the formula (huge pages?)".to_string());
    }

    // ---- traffic ---------------------------------------------------------------------
    let t = traffic(clients, servers, m, args.size).await?;
    let total = (n * m) as f64;
    let (lo, hi) = t
        .rates
        .iter()
        .fold((f64::MAX, 0f64), |(l, h), &r| (l.min(r), h.max(r)));
    rep.line(format!(
        "traffic: {n} connections x {m} messages of {} B, all active: {:.0} msg/s in all ({:.2} s), per connection {lo:.1}..{hi:.1} msg/s (max/min {:.2}); every message verified",
        args.size,
        total / t.secs,
        t.secs,
        hi / lo
    ));
    rep.num("msg_per_s", total / t.secs);
    rep.num("traffic_secs", t.secs);
    rep.num("conn_rate_min", lo);
    rep.num("conn_rate_max", hi);
    let hw1 = hw_counters(&dev);
    let delta: BTreeMap<&str, u64> = hw1
        .iter()
        .map(|(k, v)| (k.as_str(), v.saturating_sub(*hw0.get(k).unwrap_or(&0))))
        .filter(|(_, d)| *d > 0)
        .collect();
    let rnr: u64 = ["rcvd_rnr_err", "send_rnr_err", "retry_rnr_exceeded_err"]
        .iter()
        .map(|k| delta.get(k).copied().unwrap_or(0))
        .sum();
    rep.line(format!(
        "{dev} hw_counters during the run (non-zero deltas): {delta:?}; RNR NAKs {}",
        if hw1.is_empty() {
            "n/a".to_string()
        } else {
            rnr.to_string()
        }
    ));
    rep.num("rnr", rnr as f64);
    if let Some(q) = server_ep.shared_receive_stats() {
        rep.line(format!(
            "shared receive queue after the traffic: {} posted of {}, {} granted, {} unclaimed, {} refused, {} limit events, {} orphans",
            q.posted, q.buffers, q.granted, q.spare, q.refused, q.limit_events, q.orphans
        ));
        rep.num("srq_limit_events", q.limit_events as f64);
    }

    // ---- teardown --------------------------------------------------------------------
    let closed = close_all(
        t.clients,
        t.servers,
        args.close_pattern,
        args.close_concurrency,
    )
    .await?;
    // close() returns once its outcome is known; the queue pairs' teardown may still run.
    let closed_at = Instant::now();
    let deadline = closed_at + Duration::from_secs(60);
    let res2 = loop {
        let r = resource_counts(&dev)?;
        let same = ["qp", "cq", "mr", "pd", "cm_id"]
            .iter()
            .all(|k| r.get(*k) == res0.get(*k));
        if same || Instant::now() > deadline {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let settled = closed_at.elapsed().as_secs_f64();
    let (rss2, fds2) = (rss_bytes(), fd_count());
    rep.line(format!(
        "teardown ({:?} close, {} at once): {} connection ends closed in {:.2} s, resources settled {:.2} s after the last close; rss {:.1} MiB, fds {fds2}, resources {res2:?}",
        args.close_pattern,
        args.close_concurrency
            .map_or_else(|| "all".to_string(), |k| k.to_string()),
        2 * n,
        closed.secs,
        settled,
        mib(rss2)
    ));
    rep.line(closed.distribution_line());
    rep.line(closed.results_line());
    let ms = |ns: u64| ns as f64 / 1e6;
    rep.num("teardown_secs", closed.secs);
    rep.num("close_p50_ms", ms(closed.hist.value_at_quantile(0.5)));
    rep.num("close_p90_ms", ms(closed.hist.value_at_quantile(0.9)));
    rep.num("close_p99_ms", ms(closed.hist.value_at_quantile(0.99)));
    rep.num("close_max_ms", ms(closed.hist.max()));
    rep.num("close_errors", closed.errors() as f64);
    let leaked: Vec<String> = ["qp", "cq", "mr", "pd", "cm_id"]
        .iter()
        .filter(|k| res2.get(**k) != res0.get(**k))
        .map(|k| format!("{k} {:?} -> {:?}", res0.get(*k), res2.get(*k)))
        .collect();
    rep.finish();
    if closed.errors() > 0 {
        return Err(format!(
            "{} clean closes returned an error ({})",
            closed.errors(),
            closed.results_line()
        ));
    }
    if rnr > 0 {
        return Err(format!("{rnr} RNR NAKs during the run"));
    }
    if !leaked.is_empty() {
        return Err(format!(
            "resources not back to the baseline: {}",
            leaked.join(", ")
        ));
    }
    if fds2 > fds0 {
        return Err(format!("fds {fds0} -> {fds2} after teardown"));
    }
    drop(listener);
    Ok(())
}

fn mib(b: u64) -> f64 {
    b as f64 / (1 << 20) as f64
}
