//! Scenarios on a degraded wire: loss, corruption, reordering, duplication (a checked stream
//! both ways plus one-sided I/O), and a reader that stops while the link is lossy.

use std::time::{Duration, Instant};

use tokio_rdma::buf::RemoteAccess;
use tokio_rdma::conn::{ConnectOptions, Connection};

use crate::Ctx;
use crate::ctl::{self, Side};
use crate::stream::{self, Counts, REGION, within};

/// The limit of one operation on a degraded wire: only turns a hang into a failure.
const OP_LIMIT: Duration = Duration::from_secs(120);

/// Options of the degraded-wire scenarios: the defaults (retry count 6, ACK timeout 17), one-sided
/// access offered, a keepalive timeout that a live but slow peer always meets.
pub fn stream_opts() -> ConnectOptions {
    ConnectOptions::default()
        .one_sided(true)
        .keepalive(Some(Duration::from_secs(2)))
        .keepalive_timeout(Duration::from_secs(60))
}

/// This side's stream number (A sends stream 1, B stream 2).
pub fn my_stream(ctx: &Ctx) -> u64 {
    if ctx.is(Side::A) { 1 } else { 2 }
}

pub fn peer_stream(ctx: &Ctx) -> u64 {
    3 - my_stream(ctx)
}

/// Grants the peer a region and exchanges tokens; returns (our grant, the peer's token).
pub async fn exchange_grants(
    ctx: &mut Ctx,
    conn: &Connection,
) -> Result<
    (
        tokio_rdma::buf::Grant<tokio_rdma::buf::PoolBuf>,
        tokio_rdma::buf::RemoteToken,
    ),
    String,
> {
    let pool = conn.pool().map_err(|e| format!("pool: {e}"))?;
    let region = within(OP_LIMIT, "acquire", pool.acquire(REGION))
        .await?
        .map_err(|e| format!("acquire: {e}"))?;
    let grant = conn
        .grant(region, 0..REGION, RemoteAccess::READ | RemoteAccess::WRITE)
        .map_err(|e| format!("grant: {e}"))?;
    let theirs = ctx.ctl.exchange(&stream::token_hex(&grant.token())).await?;
    Ok((grant, stream::token_from_hex(&theirs)?))
}

/// Tells the peer our counts and checks the two sides agree: everything one side sent the
/// other received and verified, exactly.
pub async fn cross_check(ctx: &mut Ctx, c: &Counts) -> Result<(u64, u64), String> {
    let mine = format!(
        "{} {} {}",
        c.get(&c.sent),
        c.get(&c.received),
        c.get(&c.verified)
    );
    let theirs = ctx.ctl.exchange(&mine).await?;
    let v: Vec<u64> = theirs
        .split(' ')
        .map(|x| x.parse().map_err(|_| format!("peer counts '{theirs}'")))
        .collect::<Result<_, _>>()?;
    let (p_sent, p_recv, p_ver) = (v[0], v[1], v[2]);
    if p_recv != c.get(&c.sent) || p_ver != c.get(&c.sent) {
        return Err(format!(
            "sent {} but the peer received {p_recv}, verified {p_ver}",
            c.get(&c.sent)
        ));
    }
    if c.get(&c.received) != p_sent || c.get(&c.verified) != p_sent {
        return Err(format!(
            "the peer sent {p_sent} but this side received {}, verified {}",
            c.get(&c.received),
            c.get(&c.verified)
        ));
    }
    Ok((p_sent, p_recv))
}

/// Closes `conn` (within a limit) and checks its private buffers all came back.
pub async fn close_and_check(conn: Connection, expect_ok: bool) -> Result<String, String> {
    let res = within(Duration::from_secs(60), "close", conn.close()).await?;
    if expect_ok {
        res.map_err(|e| format!("close: {e}"))?;
    }
    // The flushed receives come back as the driver reaps them, just after close returns.
    let t0 = Instant::now();
    let first = conn.stats().buffer_bytes_in_use;
    loop {
        let in_use = conn.stats().buffer_bytes_in_use;
        if in_use == 0 {
            break;
        }
        if t0.elapsed() > Duration::from_secs(10) {
            return Err(format!(
                "{in_use} bytes of private buffers still in use 10 s after close"
            ));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(format!(
        "private buffers in use 0 ({first} B at close's return, 0 after {} ms)",
        t0.elapsed().as_millis()
    ))
}

fn mbps(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / secs.max(1e-3) / 1e6
}

/// Checks that our granted region holds what the peer wrote last (its `n`-th pattern).
fn check_region(
    grant: &tokio_rdma::buf::Grant<tokio_rdma::buf::PoolBuf>,
    peer_stream: u64,
    (n, len): (u64, usize),
) -> Result<(), String> {
    if n == 0 {
        return Ok(());
    }
    let mut got = vec![0u8; len];
    grant.read_at(0, &mut got);
    let mut want = vec![0u8; len];
    stream::fill(stream::one_sided_seed(peer_stream, n - 1), &mut want);
    if got != want {
        return Err("the granted region does not hold the peer's last write".into());
    }
    Ok(())
}

/// A degraded-wire scenario: `n` checked messages each way (sequence numbers `first..first + n`,
/// so sizes by [`stream::SIZES`] from `first` on) in chunks of `chunk` bytes, and
/// `os` one-sided write+read rounds of `os_len` bytes each way, at once, with `netem` on both
/// sides' egress.
pub struct Wire<'a> {
    pub netem: &'a [&'a str],
    pub first: u64,
    pub n: u64,
    pub chunk: u32,
    pub os: (u64, usize),
    /// The wire may be too bad for the transport's retry budget: then the connection must fail
    /// cleanly (a connection failure on both sides, no hang, every message received before it
    /// intact and in order, buffers back) instead of delivering everything.
    pub may_fail: bool,
}

pub async fn stream(ctx: &mut Ctx, w: Wire<'_>) -> Result<String, String> {
    let conn = ctx.connect(stream_opts().recv_buf_size(w.chunk)).await?;
    let (grant, token) = exchange_grants(ctx, &conn).await?;
    let mut args = vec!["both", "netem"];
    args.extend_from_slice(w.netem);
    ctx.fault(Side::A, &args).await?;
    let (mine, theirs) = (my_stream(ctx), peer_stream(ctx));
    let (c, first, end) = (Counts::default(), w.first, w.first + w.n);
    let c0 = ctl::hw_counters();
    let t0 = Instant::now();
    let (s, r, o) = tokio::join!(
        stream::send_range(&conn, mine, first, end, &c, OP_LIMIT),
        stream::recv_range(&conn, theirs, first, end, &c, OP_LIMIT, ctx.brk),
        stream::one_sided(&conn, token, mine, w.os, &c, OP_LIMIT),
    );
    let secs = t0.elapsed().as_secs_f64();
    let c1 = ctl::hw_counters();
    let counts = format!(
        "sent {} received {} verified {}, one-sided writes {} reads {} verified {}",
        c.get(&c.sent),
        c.get(&c.received),
        c.get(&c.verified),
        c.get(&c.os_writes),
        c.get(&c.os_reads),
        c.get(&c.os_verified)
    );
    let rxe = ctl::counter_delta(&c0, &c1);
    if let Err(e) = s.and(r).and(o) {
        let failure = conn.failure();
        let clean = failure.is_some() && !e.contains("HUNG") && !e.contains("VERIFY");
        if !(w.may_fail && clean) {
            return Err(format!("{e} [{counts}, failure {failure:?}]"));
        }
        // A clean failure: every message received was verified (recv_range stops at the first
        // bad one), nothing hung; the peer received no more than this side sent.
        ctx.ctl.barrier("traffic done").await?;
        drop(grant);
        ctx.fault(Side::A, &["both", "clear"]).await?;
        let theirs = ctx.ctl.exchange(&c.get(&c.received).to_string()).await?;
        let p_recv: u64 = theirs.parse().map_err(|_| format!("peer: '{theirs}'"))?;
        if p_recv > c.get(&c.sent) {
            return Err(format!(
                "the peer received {p_recv} of {} sent",
                c.get(&c.sent)
            ));
        }
        let closed = close_and_check(conn, false).await?;
        return Ok(format!(
            "failed cleanly after {secs:.1} s: {e}; before that: {counts} (all received intact, in order; the peer received {p_recv}); rxe: {rxe}; {closed}"
        ));
    }
    ctx.ctl.barrier("traffic done").await?;
    check_region(&grant, theirs, w.os)?;
    drop(grant);
    ctx.fault(Side::A, &["both", "clear"]).await?;
    if w.may_fail {
        ctx.ctl.exchange(&c.get(&c.received).to_string()).await?;
    }
    cross_check(ctx, &c).await?;
    let bytes = c.get(&c.bytes_sent);
    let closed = close_and_check(conn, true).await?;
    Ok(format!(
        "{counts}; {bytes} B sent in {secs:.1} s ({:.2} MB/s this way, + {} KiB one-sided); chunks of {} B; rxe: {rxe}; {closed}",
        mbps(bytes, secs),
        c.get(&c.os_writes) * 2 * w.os.1 as u64 / 1024,
        w.chunk
    ))
}

/// A (the reader) stops reading for `PAUSE` while B sends as fast as flow control allows, on a
/// 1%-lossy wire: B must be held (fewer messages complete than it wants to send, no more bytes
/// than A's receive budget and credits can hold), A's held bytes stay within the bound, and all
/// messages arrive intact once A reads again.
pub async fn slow_reader(ctx: &mut Ctx) -> Result<String, String> {
    const PAUSE: Duration = Duration::from_secs(6);
    const M: u64 = 24; // 3 x 1.49 MB
    let (budget, credits, buf) = (1u64 << 20, 8u32, 64u32 << 10);
    let opts = stream_opts()
        .max_message_size(budget)
        .recv_budget(budget)
        .recv_credits(credits)
        .recv_buf_size(buf);
    let bound = budget + u64::from(credits) * u64::from(buf);
    let conn = ctx.connect(opts).await?;
    ctx.fault(Side::A, &["both", "netem", "loss", "1%"]).await?;
    let c = Counts::default();
    let detail;
    if ctx.is(Side::B) {
        let sender = stream::send_range(&conn, 2, 0, M, &c, OP_LIMIT);
        tokio::pin!(sender);
        // Until A asks (after its pause), then answer with what completed so far.
        let ask = ctx.ctl.recv();
        let line = tokio::select! {
            r = &mut sender => { r?; return Err(format!("all {M} sends completed while the reader was stopped: no flow control")); }
            l = ask => l?,
        };
        if line != "paused" {
            return Err(format!("control: '{line}'"));
        }
        let (sent, bytes) = (c.get(&c.sent), c.get(&c.bytes_sent));
        ctx.ctl.send(&format!("{sent} {bytes}"))?;
        sender.await?;
        detail = format!("sender held at {sent}/{M} messages, {bytes} B while the reader paused");
    } else {
        let rss0 = ctl::rss_bytes();
        tokio::time::sleep(PAUSE).await; // the scenario: a reader that does not read for 6 s
        let st = conn.stats();
        let rss1 = ctl::rss_bytes();
        let line = ctx.ctl.exchange("paused").await?;
        let v: Vec<u64> = line.split(' ').filter_map(|x| x.parse().ok()).collect();
        let (sent, bytes) = (v[0], v[1]);
        if st.recv_bytes_held > bound {
            return Err(format!(
                "the stopped reader holds {} B, more than budget + credits x buffer = {bound}",
                st.recv_bytes_held
            ));
        }
        if sent >= M || bytes > bound {
            return Err(format!(
                "the sender completed {sent}/{M} messages, {bytes} B (bound {bound}) while the reader was stopped"
            ));
        }
        stream::recv_range(&conn, 2, 0, M, &c, OP_LIMIT, ctx.brk).await?;
        detail = format!(
            "reader stopped {PAUSE:?}: held {} B (bound {bound}), private buffers {} B, RSS {} -> {} KiB; sender held at {sent}/{M} ({bytes} B); then received {} verified {}",
            st.recv_bytes_held,
            st.buffer_bytes_in_use,
            rss0 / 1024,
            rss1 / 1024,
            c.get(&c.received),
            c.get(&c.verified)
        );
    }
    ctx.ctl.barrier("traffic done").await?;
    ctx.fault(Side::A, &["both", "clear"]).await?;
    cross_check(ctx, &c).await?;
    let closed = close_and_check(conn, true).await?;
    Ok(format!("{detail}; {closed}"))
}
