//! Side A's clients: each runs sessions back to back until the deadline (connect, a random
//! number of operations, then a clean close, an abrupt close or a drop), cancelling futures
//! at random, checking every answer, and recording what the server must have received.

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use tokio_rdma::Endpoint;
use tokio_rdma::buf::RemoteToken;
use tokio_rdma::conn::Connection;

use crate::peer::{private_opts, srq_opts};
use crate::wire::{self, HDR, Head, Kind, NONE, Order, Verdict};
use crate::{Count, PORT, REGION, Rng};

/// Counters of the whole run (all clients).
#[derive(Default)]
pub struct Stats {
    pub sessions: Count,
    pub clean: Count,
    pub abrupt: Count,
    pub dropped: Count,
    pub failed: Count,
    pub reconnects: Count,
    pub connect_errors: Count,
    pub close_errors: Count,
    pub msgs_sent: Count,
    pub bytes_sent: Count,
    pub zero_copy: Count,
    pub rendezvous: Count,
    pub replies: Count,
    pub reply_bytes: Count,
    pub os_writes: Count,
    pub os_reads: Count,
    pub os_checked: Count,
    pub corrupt: Count,
    pub duplicated: Count,
    pub lost: Count,
    pub hung: Count,
    /// Cancellations by kind: connect, send, send_bytes, recv, write, read, close.
    pub cancel: [Count; 7],
    pub active: Count,
    pub problems: Mutex<Vec<String>>,
    /// Round trips of small messages (<= 4 KiB) since the last sample, and over the run.
    pub lat: Mutex<Lat>,
    /// Sessions whose `close()` returned `Ok`: (session, last successful send's seq).
    pub closed_ok: Mutex<Vec<(u64, u64)>>,
}

/// Latency histograms (ns): since the last sample, and over the run.
pub struct Lat(pub Histogram<u64>, pub Histogram<u64>);

impl Default for Lat {
    fn default() -> Lat {
        let h = || Histogram::new_with_bounds(1, 3_600_000_000_000, 3).expect("histogram");
        Lat(h(), h())
    }
}

pub const CANCEL_KINDS: [&str; 7] = [
    "connect",
    "send",
    "send_bytes",
    "recv",
    "write",
    "read",
    "close",
];

impl Stats {
    pub fn new() -> Stats {
        Stats::default()
    }

    fn problem(&self, s: String) {
        println!("soak A: PROBLEM {s}");
        let mut p = self.problems.lock().expect("problems");
        if p.len() < 50 {
            p.push(s);
        }
    }
}

/// What every client shares.
pub struct Ctx {
    pub ep_priv: Endpoint,
    pub ep_srq: Endpoint,
    pub peer: IpAddr,
    pub clock: Arc<crate::Clock>,
    pub stats: Stats,
}

/// Why a session ended early.
enum Fail {
    /// The connection failed (an error from the library): reconnect. (The text is for a
    /// debugger; failures are expected under faults.)
    #[allow(dead_code, reason = "read in a debugger only")]
    Conn(String),
    /// An operation did not finish within its limit: a soak failure.
    Hung(String),
}

type Res<T> = Result<T, Fail>;

/// The limit of one operation: generous (a partition, a slow VM), only turns a hang into a
/// failure.
const OP_LIMIT: Duration = Duration::from_secs(120);

async fn limit<T>(what: &str, f: impl std::future::Future<Output = T>) -> Res<T> {
    tokio::time::timeout(OP_LIMIT, f)
        .await
        .map_err(|_| Fail::Hung(format!("{what} not done within {OP_LIMIT:?}")))
}

/// A short random limit that cancels the future now and then (None: no cancellation).
fn cancel_after(rng: &mut Rng, pct: u64) -> Option<Duration> {
    rng.pct(pct).then(|| Duration::from_micros(rng.below(3000)))
}

/// One client: sessions until the deadline.
pub async fn client(w: u64, ctx: Arc<Ctx>, seed: u64) {
    let mut rng = Rng::new(seed ^ (w + 1) << 40);
    let st = &ctx.stats;
    let mut k = 0u64;
    let mut after_failure = false;
    while !ctx.clock.over() {
        k += 1;
        let id = w << 32 | k;
        let srq = rng.pct(50);
        let (ep, port, o) = if srq {
            (&ctx.ep_srq, PORT + 1, srq_opts())
        } else {
            (&ctx.ep_priv, PORT, private_opts())
        };
        let addr = SocketAddr::new(ctx.peer, port);
        let conn = if let Some(d) = cancel_after(&mut rng, 5) {
            match tokio::time::timeout(d.max(Duration::from_millis(1)) * 10, ep.connect(addr, o))
                .await
            {
                Err(_) => {
                    st.cancel[0].add(1);
                    continue;
                }
                Ok(r) => r,
            }
        } else {
            match tokio::time::timeout(OP_LIMIT, ep.connect(addr, o)).await {
                Err(_) => {
                    st.hung.add(1);
                    st.problem(format!("connect {addr} hung"));
                    continue;
                }
                Ok(r) => r,
            }
        };
        let conn = match conn {
            Ok(c) => c,
            Err(_) => {
                // The server is being restarted, or the wire is partitioned: retry.
                st.connect_errors.add(1);
                after_failure = true;
                tokio::time::sleep(Duration::from_millis(300 + rng.below(700))).await;
                continue;
            }
        };
        if after_failure {
            st.reconnects.add(1);
            after_failure = false;
        }
        st.sessions.add(1);
        st.active.add(1);
        let mut s = Session {
            conn: &conn,
            id,
            seq: 0,
            last_ok: NONE,
            order: Order::default(),
            st,
        };
        let res = s.run(&mut rng, &ctx.clock).await;
        let last_ok = s.last_ok;
        match res {
            Ok(End::Dropped) => {
                st.dropped.add(1);
                drop(conn);
            }
            Ok(end) => {
                // A clean or abrupt close, perhaps cancelled once and called again.
                if end == End::Clean {
                    st.clean.add(1);
                } else {
                    st.abrupt.add(1);
                }
                match close(&conn, &mut rng, st).await {
                    Ok(true) => st.closed_ok.lock().expect("records").push((id, last_ok)),
                    Ok(false) => st.close_errors.add(1),
                    Err(Fail::Hung(e)) => {
                        st.hung.add(1);
                        st.problem(format!("session {id:x}: {e}"));
                    }
                    Err(Fail::Conn(_)) => st.close_errors.add(1),
                }
            }
            Err(Fail::Conn(_)) => {
                st.failed.add(1);
                after_failure = true;
                if rng.pct(50) {
                    let _ = tokio::time::timeout(OP_LIMIT, conn.close()).await;
                } else {
                    drop(conn);
                }
            }
            Err(Fail::Hung(e)) => {
                st.hung.add(1);
                st.problem(format!("session {id:x}: {e}"));
            }
        }
        st.active
            .0
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Closes, cancelling the first `close()` at random; Ok(true) if the close returned `Ok`.
async fn close(conn: &Connection, rng: &mut Rng, st: &Stats) -> Res<bool> {
    if let Some(d) = cancel_after(rng, 10) {
        if tokio::time::timeout(d, conn.close()).await.is_err() {
            st.cancel[6].add(1);
        }
    }
    Ok(limit("close", conn.close()).await?.is_ok())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Clean,
    Abrupt,
    Dropped,
}

struct Session<'a> {
    conn: &'a Connection,
    id: u64,
    seq: u64,
    last_ok: u64,
    order: Order,
    st: &'a Stats,
}

impl Session<'_> {
    async fn run(&mut self, rng: &mut Rng, clock: &crate::Clock) -> Res<End> {
        let hello = self.send(Kind::Hello, HDR, 0, 0, false, None).await?;
        let (h, m) = self.reply(hello, rng).await?;
        // The server's grant (none on the SRQ endpoint: no one-sided access there).
        let token = match m.get(HDR..HDR + 20) {
            Some(t) => Some(
                RemoteToken::from_bytes(t)
                    .map_err(|e| Fail::Conn(format!("server's token: {e} ({h:?})")))?,
            ),
            None => None,
        };
        let n = 1 + rng.below(120);
        for _ in 0..n {
            if clock.over() {
                break;
            }
            match rng.below(100) {
                0..75 => self.data(rng).await?,
                75..92 if token.is_some() => self.one_sided(rng, token.expect("token")).await?,
                _ => {
                    let s = self.send(Kind::Sync, HDR, 0, 0, false, None).await?;
                    self.reply(s, rng).await?;
                }
            }
        }
        // After the deadline every session ends cleanly (the final checks count on it).
        let r = if clock.over() { 0 } else { rng.below(100) };
        Ok(match r {
            0..50 => {
                let s = self.send(Kind::Sync, HDR, 0, 0, false, None).await?;
                self.reply(s, rng).await?;
                End::Clean
            }
            50..75 => End::Abrupt,
            _ => End::Dropped,
        })
    }

    /// Sends message `self.seq`; returns its sequence number, or None if the send was
    /// cancelled (it may or may not arrive: the server accepts either).
    async fn send(
        &mut self,
        kind: Kind,
        len: usize,
        aux: u32,
        aux64: u64,
        zero_copy: bool,
        cancel: Option<Duration>,
    ) -> Res<Option<u64>> {
        let h = Head {
            kind,
            session: self.id,
            seq: self.seq,
            last_ok: self.last_ok,
            aux,
            aux64,
        };
        let m = wire::encode(&h, len, None);
        let seq = self.seq;
        self.seq += 1;
        let conn = self.conn;
        let fut = async move {
            if zero_copy {
                conn.send_bytes(Bytes::from(m)).await
            } else {
                conn.send(&m).await
            }
        };
        let res = match cancel {
            Some(d) => match tokio::time::timeout(d, fut).await {
                Err(_) => {
                    self.st.cancel[if zero_copy { 2 } else { 1 }].add(1);
                    return Ok(None);
                }
                Ok(r) => r,
            },
            None => limit("send", fut).await?,
        };
        res.map_err(|e| Fail::Conn(format!("send: {e}")))?;
        self.last_ok = seq;
        self.st.msgs_sent.add(1);
        self.st.bytes_sent.add(len as u64);
        if zero_copy {
            self.st.zero_copy.add(1);
            if len >= 256 << 10 {
                self.st.rendezvous.add(1);
            }
        }
        Ok(Some(seq))
    }

    /// Receives answers until the one to `seq` (earlier ones answer cancelled sends); every
    /// answer is checked. None (a cancelled send) waits for nothing.
    async fn reply(&mut self, seq: Option<u64>, rng: &mut Rng) -> Res<(Head, Vec<u8>)> {
        let Some(seq) = seq else {
            return Err(Fail::Conn("no reply to wait for".into()));
        };
        let t0 = Instant::now();
        loop {
            if t0.elapsed() > OP_LIMIT {
                return Err(Fail::Hung(format!("reply to #{seq}")));
            }
            let got = if let Some(d) = cancel_after(rng, 5) {
                match tokio::time::timeout(d, self.conn.recv()).await {
                    Err(_) => {
                        self.st.cancel[3].add(1);
                        continue;
                    }
                    Ok(r) => r,
                }
            } else {
                limit("recv", self.conn.recv()).await?
            };
            let m = got
                .map_err(|e| Fail::Conn(format!("recv: {e}")))?
                .ok_or_else(|| Fail::Conn("the server closed".into()))?;
            let bytes = m.to_vec();
            drop(m);
            let h = match wire::decode(&bytes) {
                Ok(h) if h.session == self.id => h,
                Ok(h) => {
                    self.violation_corrupt(format!("answer of session {:x}", h.session));
                    continue;
                }
                Err(e) => {
                    self.violation_corrupt(e);
                    continue;
                }
            };
            match self.order.check(h.seq, h.last_ok) {
                Verdict::Ok => {}
                Verdict::Duplicate => {
                    self.st.duplicated.add(1);
                    self.st.problem(format!(
                        "session {:x}: duplicate answer #{}",
                        self.id, h.seq
                    ));
                    continue;
                }
                Verdict::Lost => {
                    self.st.lost.add(1);
                    self.st.problem(format!(
                        "session {:x}: answer lost before #{}",
                        self.id, h.seq
                    ));
                }
            }
            self.st.replies.add(1);
            self.st.reply_bytes.add(bytes.len() as u64);
            if h.aux64 == seq {
                return Ok((h, bytes));
            }
            if h.aux64 > seq {
                self.violation_corrupt(format!("answer to #{} while waiting for #{seq}", h.aux64));
            }
        }
    }

    fn violation_corrupt(&self, what: String) {
        self.st.corrupt.add(1);
        self.st
            .problem(format!("session {:x}: corrupt: {what}", self.id));
    }

    async fn data(&mut self, rng: &mut Rng) -> Res<()> {
        let len = match rng.below(100) {
            0..40 => HDR + rng.below(200) as usize,
            40..60 => 4096,
            60..72 => 256 + rng.below(32 << 10) as usize,
            72..87 => (64 << 10) + 1,
            87..98 => 300_000,
            _ => 1 << 20,
        };
        let zero_copy = rng.pct(40);
        let cancel = cancel_after(rng, 4);
        let t0 = Instant::now();
        let seq = self.send(Kind::Data, len, 0, 0, zero_copy, cancel).await?;
        if seq.is_none() {
            return Ok(());
        }
        self.reply(seq, rng).await?;
        if len <= 4096 {
            let ns = u64::try_from(t0.elapsed().as_nanos())
                .unwrap_or(u64::MAX)
                .max(1);
            let mut l = self.st.lat.lock().expect("latency");
            l.0.saturating_record(ns);
            l.1.saturating_record(ns);
        }
        Ok(())
    }

    /// Writes a fresh pattern into the server's grant, reads it back, compares, then has the
    /// server check its region holds it.
    async fn one_sided(&mut self, rng: &mut Rng, token: RemoteToken) -> Res<()> {
        let len = 1 + rng.below(REGION as u64) as usize;
        let pattern = rng.next_u64();
        let pool = self
            .conn
            .pool()
            .map_err(|e| Fail::Conn(format!("pool: {e}")))?;
        let mut buf = limit("acquire", pool.acquire(len))
            .await?
            .map_err(|e| Fail::Conn(format!("acquire: {e}")))?;
        wire::fill(pattern, &mut buf);
        let target = token
            .slice(0..len as u64)
            .map_err(|e| Fail::Conn(format!("token: {e}")))?;
        let buf = match cancel_after(rng, 4) {
            Some(d) => match tokio::time::timeout(d, self.conn.write(buf, target)).await {
                Err(_) => {
                    self.st.cancel[4].add(1);
                    return Ok(()); // the region's contents are unknown until the next write
                }
                Ok(r) => r,
            },
            None => limit("write", self.conn.write(buf, target)).await?,
        };
        let (res, mut back) = buf;
        res.map_err(|e| Fail::Conn(format!("write: {e}")))?;
        self.st.os_writes.add(1);
        back.fill(0);
        let read = match cancel_after(rng, 4) {
            Some(d) => match tokio::time::timeout(d, self.conn.read(back, target)).await {
                Err(_) => {
                    self.st.cancel[5].add(1);
                    None
                }
                Ok(r) => Some(r),
            },
            None => Some(limit("read", self.conn.read(back, target)).await?),
        };
        if let Some((res, back)) = read {
            res.map_err(|e| Fail::Conn(format!("read: {e}")))?;
            self.st.os_reads.add(1);
            let mut want = vec![0u8; len];
            wire::fill(pattern, &mut want);
            if back[..] != want[..] {
                self.violation_corrupt(format!("one-sided read back of {len} bytes differs"));
            }
        }
        let s = self
            .send(Kind::Check, HDR, len as u32, pattern, false, None)
            .await?;
        let (h, _) = self.reply(s, rng).await?;
        if h.aux != 1 {
            self.violation_corrupt(format!("the server's region lacks the {len} bytes written"));
        } else {
            self.st.os_checked.add(1);
        }
        Ok(())
    }
}
