//! Scenarios where the wire or the peer goes away: link down and partitions shorter than the
//! retry budget (the connection survives) and longer (every pending op fails within the
//! documented bound, then a new connection works), and a peer that dies (its process killed,
//! or its whole VM).

use std::time::{Duration, Instant};

use tokio_rdma::conn::{ConnectOptions, Connection};
use tokio_rdma::{Error, Result as RdmaResult};

use crate::Ctx;
use crate::ctl::{self, Side};
use crate::scenarios::{
    close_and_check, cross_check, exchange_grants, my_stream, peer_stream, stream_opts,
};
use crate::stream::{self, Counts, REGION, within};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A's eth0 down (rxe0's port on A goes down with it; B's stays up).
    Link,
    /// Both directions dropped (netem loss 100%), carrier up: a silent partition.
    Partition,
}

/// A send, receive or one-sided op must resolve within this long of the fault, or it hangs.
const HANG_LIMIT: Duration = Duration::from_secs(90);

/// Survivable outages: ACK timeout 19 (~2.1 s) x (6 retries + 1) ~ 15 s of transport budget,
/// and a keepalive timeout far above the 3 s outage.
fn survive_opts() -> ConnectOptions {
    stream_opts()
        .ack_timeout(Some(19))
        .retry_count(6)
        .keepalive(Some(Duration::from_secs(1)))
        .keepalive_timeout(Duration::from_secs(60))
}

/// Outages that must fail fast: keepalive every 1 s, declared dead after 4 s without an answer;
/// the transport's own budget: ACK timeout 16 (~0.27 s) x 7 ~ 1.9 s.
const KEEPALIVE: Duration = Duration::from_secs(1);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(4);
/// Allowance over the documented bound for this emulation (slow TCG guests; the instant the
/// fault was applied is known to within the 50 ms the answer file is polled).
const SLACK: Duration = Duration::from_secs(5);

fn fail_opts() -> ConnectOptions {
    stream_opts()
        .ack_timeout(Some(16))
        .retry_count(6)
        .keepalive(Some(KEEPALIVE))
        .keepalive_timeout(KEEPALIVE_TIMEOUT)
}

/// The documented bound: a dead peer is detected within keepalive + keepalive_timeout.
fn bound() -> Duration {
    KEEPALIVE + KEEPALIVE_TIMEOUT
}

/// Brings A's eth0 back and restores its neighbour entry for B (a link down flushes it, and
/// the kernel's RDMA CM then drops B's connection requests: it cannot address its reply).
pub async fn link_up(ctx: &mut Ctx) -> Result<(), String> {
    let peer = ctx.peer.to_string();
    let a_peer = if ctx.is(Side::A) {
        peer
    } else {
        ctx.me.to_string()
    };
    ctx.fault(Side::A, &["A", "link", "up"]).await?;
    ctx.fault(
        Side::A,
        &["A", "run", "ping", "-c", "1", "-W", "5", &a_peer],
    )
    .await?;
    Ok(())
}

/// An outage of 3 s, shorter than the transport's and the keepalive's budgets. Partition:
/// traffic both ways runs into it. Link: A's eth0 goes down while the connection is idle (on
/// soft-RoCE a queue pair that transmits while its own port is down fails at once, see
/// docs/faults.md), then the traffic resumes. Either way: nothing lost, nothing failed.
pub async fn survive(ctx: &mut Ctx, kind: Kind) -> Result<String, String> {
    const N: u64 = 16;
    let opts = match kind {
        Kind::Partition => survive_opts(),
        // No keepalive may go out during the outage.
        Kind::Link => survive_opts().keepalive(Some(Duration::from_secs(60))),
    };
    let conn = ctx.connect(opts).await?;
    let (grant, token) = exchange_grants(ctx, &conn).await?;
    let (mine, theirs) = (my_stream(ctx), peer_stream(ctx));
    let c = Counts::default();
    let limit = HANG_LIMIT;
    let (s, r) = tokio::join!(
        stream::send_range(&conn, mine, 0, N / 2, &c, limit),
        stream::recv_range(&conn, theirs, 0, N / 2, &c, limit, ctx.brk),
    );
    s.and(r)?;
    ctx.ctl.barrier("first half").await?;
    let c0 = ctl::hw_counters();
    let at = match kind {
        Kind::Partition => ctx.fault(Side::A, &["both", "partition", "3"]).await?,
        Kind::Link => {
            let at = ctx.fault(Side::A, &["A", "link", "down"]).await?;
            // The scenario: the link stays down 3 s.
            tokio::time::sleep(Duration::from_secs(3)).await;
            link_up(ctx).await?;
            at
        }
    };
    // Traffic into (or after) the outage: the second half, and one-sided I/O.
    let (s, r, o) = tokio::join!(
        stream::send_range(&conn, mine, N / 2, N, &c, limit),
        stream::recv_range(&conn, theirs, N / 2, N, &c, limit, ctx.brk),
        stream::one_sided(&conn, token, mine, (4, REGION), &c, limit),
    );
    let secs = at.elapsed().as_secs_f64();
    let c1 = ctl::hw_counters();
    s.and(r)
        .and(o)
        .map_err(|e| format!("{e} (connection failure: {:?})", conn.failure()))?;
    if let Some(f) = conn.failure() {
        return Err(format!("the connection failed: {f}"));
    }
    ctx.ctl.barrier("traffic done").await?;
    drop(grant);
    cross_check(ctx, &c).await?;
    let closed = close_and_check(conn, true).await?;
    Ok(format!(
        "survived: sent {} received {} verified {}, one-sided {} writes {} reads verified {}; second half done {secs:.1} s after the fault; rxe: {}; {closed}",
        c.get(&c.sent),
        c.get(&c.received),
        c.get(&c.verified),
        c.get(&c.os_writes),
        c.get(&c.os_reads),
        c.get(&c.os_verified),
        ctl::counter_delta(&c0, &c1)
    ))
}

/// One pending op's outcome: when it resolved, and how.
type Outcome = (&'static str, Instant, RdmaResult<()>);

/// Waits for `f` (at most [`HANG_LIMIT`]: longer is a hang, and fails the scenario).
async fn timed<T>(
    what: &'static str,
    f: impl std::future::Future<Output = RdmaResult<T>>,
) -> Result<Outcome, String> {
    let r = within(HANG_LIMIT, what, f).await?;
    Ok((what, Instant::now(), r.map(|_| ())))
}

/// Pending ops when the wire or the peer dies: sends of 1 MiB messages, a receive, a one-sided
/// read. Posted at the first poll.
async fn pending_ops(
    conn: &Connection,
    token: tokio_rdma::buf::RemoteToken,
    big: &[u8],
) -> Result<Vec<Outcome>, String> {
    let pool = conn.pool().map_err(|e| format!("pool: {e}"))?;
    let buf = within(HANG_LIMIT, "acquire", pool.acquire(REGION))
        .await?
        .map_err(|e| format!("acquire: {e}"))?;
    let (s, r, o) = tokio::join!(
        timed("send", async {
            for _ in 0..8 {
                conn.send(big).await?;
            }
            Ok(())
        }),
        timed("recv", conn.recv()),
        timed("one-sided read", async {
            // Reads in a loop until one fails: one is always in flight when the fault hits.
            let mut buf = buf;
            loop {
                let (res, b) = conn.read(buf, token).await;
                res?;
                buf = b;
            }
            #[allow(unreachable_code)]
            Ok(())
        }),
    );
    Ok(vec![s?, r?, o?])
}

/// Checks every op failed with a connection failure, after `at` and within the bound of it;
/// then that a later send fails at once. Returns their descriptions.
async fn check_failed(
    conn: &Connection,
    ops: Vec<Outcome>,
    at: Instant,
) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for (what, done, res) in ops {
        let Some(t) = done.checked_duration_since(at) else {
            return Err(format!(
                "{what} resolved {:.1} s BEFORE the fault: {res:?}",
                at.duration_since(done).as_secs_f64()
            ));
        };
        match res {
            Ok(()) => return Err(format!("{what} succeeded across the fault")),
            Err(Error::QpFailed(f)) if t <= bound() + SLACK => {
                out.push(format!("{what} failed after {:.1} s: {f}", t.as_secs_f64()))
            }
            Err(Error::QpFailed(f)) => {
                return Err(format!(
                    "{what} failed after {:.1} s ({f}): later than keepalive + keepalive_timeout = {:?} (+{SLACK:?})",
                    t.as_secs_f64(),
                    bound()
                ));
            }
            Err(e) => return Err(format!("{what}: not a connection failure: {e}")),
        }
    }
    let t = Instant::now();
    match within(
        Duration::from_secs(5),
        "send after failure",
        conn.send(b"x"),
    )
    .await?
    {
        Err(Error::QpFailed(_)) => out.push(format!(
            "a later send failed in {:.0} ms",
            t.elapsed().as_secs_f64() * 1e3
        )),
        other => return Err(format!("a send after the failure: {other:?}")),
    }
    Ok(out)
}

/// An outage longer than every budget: pending ops on both sides fail within the bound, then
/// (once the wire is back) a new connection works.
pub async fn fail(ctx: &mut Ctx, kind: Kind) -> Result<String, String> {
    let conn = ctx.connect(fail_opts()).await?;
    let (grant, token) = exchange_grants(ctx, &conn).await?;
    let (mine, theirs) = (my_stream(ctx), peer_stream(ctx));
    let c = Counts::default();
    let (s, r) = tokio::join!(
        stream::send_range(&conn, mine, 0, 4, &c, HANG_LIMIT),
        stream::recv_range(&conn, theirs, 0, 4, &c, HANG_LIMIT, ctx.brk),
    );
    s.and(r)?;
    ctx.ctl.barrier("armed").await?;
    let args: &[&str] = match kind {
        Kind::Link => &["A", "link", "down"],
        Kind::Partition => &["both", "partition", "120"],
    };
    let at = ctx.fault(Side::A, args).await?;
    let big = stream::message(mine, 3); // 1 MiB
    let ops = pending_ops(&conn, token, &big).await?;
    let ops = check_failed(&conn, ops, at).await?;
    let failure = conn.failure().ok_or("no failure recorded")?;
    drop(grant);
    let closed = close_and_check(conn, false).await?;
    ctx.ctl.barrier("failed").await?;
    let desc = format!(
        "{} (bound keepalive {KEEPALIVE:?} + keepalive_timeout {KEEPALIVE_TIMEOUT:?} = {:?}); connection failure: {failure}; {closed}",
        ops.join(", "),
        bound()
    );
    if kind == Kind::Link {
        // Heal; no new connection: on soft-RoCE the disconnect this side sent while its link
        // was down leaves the host's RDMA CM unable to answer any connection request until the
        // rxe device is re-created (docs/faults.md), so this is the last scenario of its boot.
        link_up(ctx).await?;
        return Ok(format!(
            "{desc}; no reconnect after a link down (rxe: docs/faults.md)"
        ));
    }
    // Heal, then a new connection must work.
    ctx.fault(Side::A, &["both", "clear"]).await?;
    let conn = ctx.connect(survive_opts()).await?;
    let c2 = Counts::default();
    let (s, r) = tokio::join!(
        stream::send_range(&conn, mine, 0, 8, &c2, HANG_LIMIT),
        stream::recv_range(&conn, theirs, 0, 8, &c2, HANG_LIMIT, ctx.brk),
    );
    s.and(r)?;
    ctx.ctl.barrier("new connection done").await?;
    cross_check(ctx, &c2).await?;
    close_and_check(conn, true).await?;
    Ok(format!(
        "{desc}; after healing a new connection sent {} received {} verified {}",
        c2.get(&c2.sent),
        c2.get(&c2.received),
        c2.get(&c2.verified)
    ))
}

/// The peer (`victim`) dies with pending ops on the survivor: a held send, a receive and
/// one-sided reads. They fail within the bound; the survivor's other connection (to itself)
/// keeps working; device resources return to the baseline after close.
pub async fn peer_death(ctx: &mut Ctx, victim: Side, how: &str) -> Result<String, String> {
    let survivor = victim.other();
    // The victim reads nothing and holds a small budget: the survivor's sends are held.
    let budget = 1u64 << 20;
    let opts = fail_opts()
        .max_message_size(budget)
        .recv_budget(budget)
        .recv_credits(4);
    if ctx.is(victim) {
        let conn = ctx.connect(opts).await?;
        let (_grant, _token) = exchange_grants(ctx, &conn).await?;
        ctx.ctl.barrier("armed").await?;
        tokio::time::sleep(HANG_LIMIT).await;
        return Err(format!(
            "{how}: still alive {HANG_LIMIT:?} after the fault was armed"
        ));
    }
    // Warm up (the device's driver, kept for the process), then the baseline.
    let (a, b) = ctx.local_pair().await?;
    drop(a);
    drop(b);
    let base = settle(&None).await?;
    let (lc, ls) = ctx.local_pair().await?;
    let conn = ctx.connect(opts).await?;
    let (grant, token) = exchange_grants(ctx, &conn).await?;
    ctx.ctl.barrier("armed").await?;
    let c = Counts::default();
    // Fill the victim's budget: these complete, later ones are held.
    stream::send_range(&conn, my_stream(ctx), 0, 2, &c, HANG_LIMIT).await?;
    let target: &str = victim.name();
    let big = stream::message(my_stream(ctx), 3); // 1 MiB
    let t_posted = Instant::now();
    // The kill, requested once the ops are posted (at their first poll, join! polls them
    // first); their times count from its answer.
    let kill = [target, how];
    let (ops, done) = tokio::join!(pending_ops(&conn, token, &big), ctx.fault(survivor, &kill));
    let done = done?;
    // The kill happens between the request and its answer (the peer may notice before the
    // answer arrives): the times count from the request, an upper bound.
    let at = ctx.requested.ok_or("no kill requested")?;
    let ops = check_failed(&conn, ops?, at).await?;
    let failure = conn.failure().ok_or("no failure recorded")?;
    drop(grant);
    let closed = close_and_check(conn, false).await?;
    // The other connection still works.
    let c2 = Counts::default();
    let (s, r) = tokio::join!(
        stream::send_range(&lc, 7, 0, 8, &c2, HANG_LIMIT),
        stream::recv_range(&ls, 7, 0, 8, &c2, HANG_LIMIT, ctx.brk),
    );
    s.and(r)?;
    // Both ends close together, as an application closing its two ends does. Closed one
    // after the other, `lc`'s close is a full close waiting for `ls`'s end of stream: its
    // teardown (and the return of its buffers) came only at the keepalive timeout, 10 s
    // after its close, the very limit of `close_and_check`: a race, lost in 2 of 4 runs on
    // 2026-11-26 (the logs of e90a3dc show the same 10 s wait).
    let (l, s) = tokio::join!(close_and_check(lc, true), close_and_check(ls, false));
    l?;
    s?;
    let after = settle(&Some(base.clone())).await?;
    Ok(format!(
        "{how} of {target} requested {:.1} s after the ops were posted, answered {:.1} s later; times from the request: {}; connection failure: {failure}; {closed}; the other connection sent {} received {} verified {}; rdma resources {after:?} = baseline",
        at.duration_since(t_posted).as_secs_f64(),
        done.duration_since(at).as_secs_f64(),
        ops.join(", "),
        c2.get(&c2.sent),
        c2.get(&c2.received),
        c2.get(&c2.verified)
    ))
}

/// `rdma resource show` counts: once they stop changing (`want` None), or once they equal
/// `want` (within 30 s: teardown finishes in the kernel after close returns).
async fn settle(
    want: &Option<std::collections::BTreeMap<String, u64>>,
) -> Result<std::collections::BTreeMap<String, u64>, String> {
    let t0 = Instant::now();
    let mut last = ctl::resource_counts()?;
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = ctl::resource_counts()?;
        match want {
            Some(w) if &now == w => return Ok(now),
            None if now == last => return Ok(now),
            _ => {}
        }
        if t0.elapsed() > Duration::from_secs(30) {
            return Err(format!(
                "rdma resources {now:?}, expected {:?}",
                want.as_ref().unwrap_or(&last)
            ));
        }
        last = now;
    }
}
