//! Side B: the supervisor (kills and restarts the server when A asks) and the server (two
//! endpoints, one session per connection: every message checked and answered).
//!
//! Files in the soak directory (shared with A and the host): `kill.N` (A asks: kill the
//! server with SIGKILL, optionally `flap` the link meanwhile), `killed.N` (done, restarted),
//! `stop` (A is done: the server drains and exits), `B-<pid>.log` (each server's session
//! records and violations, one line each, written as they happen), `B-done` (the
//! supervisor's last word: the device's resources after the last server exited).

use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio_rdma::buf::RemoteAccess;
use tokio_rdma::conn::{ConnectOptions, Connection, Listener, SrqOptions};
use tokio_rdma::{Endpoint, EndpointOptions};

use crate::wire::{self, Head, Kind, NONE, Order, Verdict};
use crate::{Args, PORT, REGION, proc_stats, soak_dir};

/// The connection options of both sides: one-sided access on, a keepalive that finds a
/// silent peer in 8 s, the transport's retry budget (about 3.8 s) for a partition.
pub fn opts() -> ConnectOptions {
    ConnectOptions::default()
        .one_sided(true)
        .keepalive(Some(Duration::from_secs(2)))
        .keepalive_timeout(Duration::from_secs(6))
        .close_timeout(Duration::from_secs(20))
        .connect_timeout(Duration::from_secs(10))
}

/// Options of the private-pool endpoint's connections: 8 KiB chunks (8 packets: a lossy burst
/// spends the retry budget of a work request less often than with 64 KiB ones).
pub fn private_opts() -> ConnectOptions {
    opts().recv_buf_size(8 << 10)
}

/// Options of the shared-receive-queue endpoint's connections: no one-sided access (its
/// connections share one protection domain, so a grant would be open to every peer: refused).
pub fn srq_opts() -> ConnectOptions {
    opts().one_sided(false)
}

/// Options of a shared-receive-queue endpoint.
pub fn srq_endpoint() -> EndpointOptions {
    EndpointOptions::default().shared_receive_queue(SrqOptions::default().buffers(2048))
}

/// Device resources as one word: `cm_id:0,cq:3,...` (or `error`).
pub fn compact(r: &Result<std::collections::BTreeMap<String, u64>, String>) -> String {
    match r {
        Ok(m) => m
            .iter()
            .map(|(k, v)| format!("{k}:{v}"))
            .collect::<Vec<_>>()
            .join(","),
        Err(_) => "error".into(),
    }
}

fn exists(dir: &Path, name: &str) -> bool {
    dir.join(name).exists()
}

fn write_file(dir: &Path, name: &str, text: &str) {
    let tmp = dir.join(format!(".{name}.tmp"));
    if std::fs::write(&tmp, text).is_ok() {
        let _ = std::fs::rename(&tmp, dir.join(name));
    }
}

/// Runs the server as a child, restarting it after each kill A asks for, until `stop`.
pub fn supervise(_args: &Args) -> i32 {
    let dir = soak_dir();
    let _ = std::fs::create_dir_all(&dir);
    let exe = std::env::current_exe().expect("current exe");
    let mut argv: Vec<String> = std::env::args().skip(1).collect();
    argv.push("--worker".into());
    let base = proc_stats::resource_counts("rxe0");
    let mut kills = 0u64;
    let mut restarts = 0u64;
    loop {
        let mut child = match std::process::Command::new(&exe).args(&argv).spawn() {
            Ok(c) => c,
            Err(e) => {
                eprintln!("soak B: spawn server: {e}");
                return 1;
            }
        };
        println!("soak B: server {} started", child.id());
        let status = loop {
            if let Ok(Some(st)) = child.try_wait() {
                break Some(st);
            }
            let req = format!("kill.{kills}");
            if exists(&dir, &req) {
                let flap = std::fs::read_to_string(dir.join(&req)).unwrap_or_default();
                let _ = child.kill();
                let _ = child.wait();
                println!("soak B: server killed ({req} {})", flap.trim());
                if flap.trim() == "flap" {
                    // The kernel has disconnected the dead server's connections; now the link
                    // goes down with no connection on this host (docs/faults.md: a connection
                    // failing while its link is down wedges rxe's connection manager).
                    std::thread::sleep(Duration::from_secs(2));
                    let r = link(&["down"]);
                    std::thread::sleep(Duration::from_secs(3));
                    let r2 = link(&["up"]);
                    let _ = std::process::Command::new("ping")
                        .args(["-c", "1", "-W", "5"])
                        .arg(std::env::var("RXE_PAIR_PEER").unwrap_or_default())
                        .output();
                    println!("soak B: link flapped (down: {r}, up: {r2})");
                }
                std::thread::sleep(Duration::from_secs(1));
                write_file(&dir, &format!("killed.{kills}"), "restarted\n");
                kills += 1;
                break None;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        match status {
            None => restarts += 1,
            Some(st) => {
                println!("soak B: server exited: {st}");
                // Give the kernel a moment to release what the server's process held.
                std::thread::sleep(Duration::from_secs(2));
                let after = proc_stats::resource_counts("rxe0");
                let line = format!(
                    "B-done exit={} restarts={restarts} device={}->{}\n",
                    st.code().unwrap_or(-1),
                    compact(&base),
                    compact(&after)
                );
                print!("soak B: {line}");
                write_file(&dir, "B-done", &line);
                return if st.success() { 0 } else { 1 };
            }
        }
    }
}

fn link(state: &[&str]) -> String {
    match std::process::Command::new("ip")
        .args(["link", "set", "eth0"])
        .args(state)
        .status()
    {
        Ok(s) => s.to_string(),
        Err(e) => e.to_string(),
    }
}

/// The server's log: one line per record, written at once (a killed server loses none).
#[derive(Clone)]
struct Log(
    Arc<Mutex<std::fs::File>>,
    Arc<std::sync::atomic::AtomicBool>,
);

impl Log {
    fn line(&self, s: &str) {
        let mut f = self.0.lock().expect("log lock");
        let _ = f.write_all(format!("{s}\n").as_bytes());
        let _ = f.flush();
    }
}

/// The server: listens on both endpoints until `stop`, serves each connection as a session.
pub async fn serve(args: Args) -> i32 {
    let _ = args;
    let dir = soak_dir();
    let me: IpAddr = std::env::var("RXE_PAIR_SELF")
        .ok()
        .and_then(|a| a.parse().ok())
        .expect("RXE_PAIR_SELF");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(format!("B-{}.log", std::process::id())))
        .expect("server log");
    let log = Log(Arc::new(Mutex::new(file)), Arc::default());
    let ep_priv = Endpoint::open_first_active().expect("private endpoint");
    let ep_srq = Endpoint::open_first_active_with(srq_endpoint()).expect("SRQ endpoint");
    // Warm-up: librdmacm allocates a protection domain of its own for the device the first
    // time a connection is made, and keeps it for the life of the process; the baseline is
    // taken after one connection to itself on each endpoint, on ports of its own (A's
    // clients, reconnecting, would be accepted on the soak's ports before the baseline).
    for (ep, port, o) in [
        (&ep_priv, PORT + 10, private_opts()),
        (&ep_srq, PORT + 11, srq_opts()),
    ] {
        let l = listen(ep, SocketAddr::new(me, port), o.clone()).await;
        let accept = tokio::time::timeout(Duration::from_secs(60), l.accept());
        let (c, a) = tokio::join!(ep.connect(SocketAddr::new(me, port), o), accept);
        match (c, a) {
            (Ok(c), Ok(Ok(a))) => {
                let _ = tokio::join!(c.close(), a.close());
            }
            (c, a) => eprintln!(
                "soak B: warm-up connection: {:?} / {:?}",
                c.err(),
                a.map(|r| r.err())
            ),
        }
    }
    let (fd0, res0) = settled().await;
    let l_priv = listen(&ep_priv, SocketAddr::new(me, PORT), private_opts()).await;
    let l_srq = listen(&ep_srq, SocketAddr::new(me, PORT + 1), srq_opts()).await;
    println!("soak B: server {} listening", std::process::id());
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            c = l_priv.accept() => spawn_session(&mut tasks, c, &log, "private"),
            c = l_srq.accept() => spawn_session(&mut tasks, c, &log, "srq"),
            () = tokio::time::sleep(Duration::from_millis(200)) => {
                if exists(&dir, "stop") {
                    break;
                }
            }
        }
        while tasks.try_join_next().is_some() {}
    }
    drop((l_priv, l_srq));
    // A has closed or dropped every connection: the sessions end (end of stream or failure).
    let t0 = Instant::now();
    while !tasks.is_empty() && t0.elapsed() < Duration::from_secs(90) {
        let _ = tokio::time::timeout(Duration::from_secs(1), tasks.join_next()).await;
    }
    let hung = tasks.len();
    tasks.abort_all();
    // Dropped connections tear down in their driver tasks: wait for the device to settle.
    let t1 = Instant::now();
    let mut res = proc_stats::resource_counts("rxe0");
    while res != res0 && t1.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(200)).await;
        res = proc_stats::resource_counts("rxe0");
    }
    let fds = proc_stats::fd_count();
    if res != res0 {
        for kind in ["pd", "mr", "qp", "cq"] {
            if let Ok(o) = std::process::Command::new("rdma")
                .args(["resource", "show", kind, "-d"])
                .output()
            {
                for l in String::from_utf8_lossy(&o.stdout).lines() {
                    log.line(&format!("left {kind}: {l}"));
                }
            }
        }
    }
    log.line(&format!(
        "final hung_sessions={hung} fds={fd0}->{fds} device={}->{} rss={}",
        compact(&res0),
        compact(&res),
        proc_stats::rss_bytes()
    ));
    println!("soak B: server done: {hung} hung sessions, fds {fd0}->{fds}");
    drop((ep_priv, ep_srq));
    0
}

/// The process's fds and the device's resources once they stopped changing for 2 s (earlier
/// teardown, which closes fds and destroys ids in the background, finished).
pub async fn settled() -> (
    usize,
    Result<std::collections::BTreeMap<String, u64>, String>,
) {
    let now = || (proc_stats::fd_count(), proc_stats::resource_counts("rxe0"));
    let mut last = now();
    let (mut same_since, t0) = (Instant::now(), Instant::now());
    while same_since.elapsed() < Duration::from_secs(2) && t0.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let n = now();
        if n != last {
            last = n;
            same_since = Instant::now();
        }
    }
    last
}

async fn listen(ep: &Endpoint, addr: SocketAddr, opts: ConnectOptions) -> Listener {
    loop {
        match ep.listen_with(addr, opts.clone().backlog(64)).await {
            Ok(l) => return l,
            Err(e) => {
                // A killed predecessor's port may take a moment to be free.
                eprintln!("soak B: listen {addr}: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
}

fn spawn_session(
    tasks: &mut tokio::task::JoinSet<()>,
    c: tokio_rdma::Result<Connection>,
    log: &Log,
    ep: &'static str,
) {
    match c {
        Ok(conn) => {
            let log = log.clone();
            tasks.spawn(async move { session(conn, log, ep).await });
        }
        Err(e) => log.line(&format!("accept_error {ep} {e}")),
    }
}

/// The limit of one operation of the server: only turns a hang into a record.
const OP_LIMIT: Duration = Duration::from_secs(120);

async fn session(conn: Connection, log: Log, ep: &'static str) {
    let mut id = NONE;
    let mut order = Order::default();
    let mut my_seq = 0u64;
    let mut last_ok = NONE;
    let mut grant = None;
    let end: String = loop {
        let msg = match tokio::time::timeout(OP_LIMIT, conn.recv()).await {
            Err(_) => break "hung recv".into(),
            Ok(Err(e)) => break format!("err:{e}"),
            Ok(Ok(None)) => break "eof".into(),
            Ok(Ok(Some(m))) => m,
        };
        let mut bytes = msg.to_vec();
        drop(msg);
        let brk = broken_once(&bytes, &log.1);
        if brk == Some("corrupt") {
            bytes[wire::HDR] ^= 0x40;
        }
        let h = match wire::decode(&bytes) {
            Ok(h) => h,
            Err(e) => {
                log.line(&format!("violation {id} corrupt {e}"));
                // Answer it anyway if the header is readable: the client waits for it.
                match wire::peek(&bytes) {
                    Some(h) => h,
                    None => continue,
                }
            }
        };
        if id == NONE {
            id = h.session;
        } else if h.session != id {
            log.line(&format!(
                "violation {id} corrupt session {} in session {id}",
                h.session
            ));
            continue;
        }
        // A deliberately broken server "loses" the message (it still answers it).
        let verdict = if brk == Some("lost") {
            Verdict::Ok
        } else {
            order.check(h.seq, h.last_ok)
        };
        match verdict {
            Verdict::Ok => {}
            Verdict::Duplicate => {
                log.line(&format!(
                    "violation {id} duplicate seq {} after {:?}",
                    h.seq, order.last
                ));
                continue;
            }
            Verdict::Lost => log.line(&format!(
                "violation {id} lost: seq {} says {} was sent, last received {:?}",
                h.seq, h.last_ok, order.last
            )),
        }
        let (len, aux, payload, zero_copy) = match h.kind {
            // A grant on the private-pool endpoint; none on the SRQ one (no one-sided access).
            Kind::Hello if ep == "srq" => (wire::HDR, 0, None, false),
            Kind::Hello => {
                let g = match make_grant(&conn).await {
                    Ok(g) => g,
                    Err(e) => break format!("err:grant: {e}"),
                };
                let token = g.token().to_bytes();
                grant = Some(g);
                (wire::HDR + token.len(), 0, Some(token.to_vec()), false)
            }
            Kind::Data => match h.seq % 64 {
                9 => (300_000, 0, None, true), // rendezvous back
                5 | 21 | 37 => (4096, 0, None, false),
                _ => (64, 0, None, false),
            },
            Kind::Check => {
                let ok = grant.as_ref().is_some_and(|g| {
                    let n = (h.aux as usize).min(REGION);
                    let mut got = vec![0u8; n];
                    g.read_at(0, &mut got);
                    let mut want = vec![0u8; n];
                    wire::fill(h.aux64, &mut want);
                    got == want
                });
                if !ok {
                    log.line(&format!(
                        "violation {id} corrupt grant: region does not hold pattern {:x}",
                        h.aux64
                    ));
                }
                (64, u32::from(ok), None, false)
            }
            Kind::Sync => (64, 0, None, false),
            Kind::Ack => {
                log.line(&format!(
                    "violation {id} corrupt: an Ack sent to the server"
                ));
                continue;
            }
        };
        let reply = Head {
            kind: if h.kind == Kind::Hello {
                Kind::Hello
            } else {
                Kind::Ack
            },
            session: id,
            seq: my_seq,
            last_ok,
            aux,
            aux64: h.seq,
        };
        let m = wire::encode(&reply, len, payload.as_deref());
        let sent = if zero_copy {
            tokio::time::timeout(OP_LIMIT, conn.send_bytes(Bytes::from(m))).await
        } else {
            tokio::time::timeout(OP_LIMIT, conn.send(&m)).await
        };
        match sent {
            Err(_) => break "hung send".into(),
            Ok(Err(e)) => break format!("err:send: {e}"),
            Ok(Ok(())) => {
                last_ok = my_seq;
                my_seq += 1;
            }
        }
    };
    let close = match tokio::time::timeout(OP_LIMIT, conn.close()).await {
        Err(_) => "hung".to_string(),
        Ok(Ok(())) => "ok".to_string(),
        Ok(Err(e)) => format!("err:{e}"),
    };
    drop(grant);
    let last = order.last.map_or_else(|| "none".into(), |l| l.to_string());
    log.line(&format!(
        "session {id} ep={ep} last={last} received={} sent_ok={my_seq} end={} close={}",
        order.received,
        end.replace(' ', "_"),
        close.replace(' ', "_")
    ));
}

/// `SOAK_BREAK=lost` or `corrupt`: the first data message of 1 KiB or more (sequence number 5
/// or later) this server receives is lost or corrupted on purpose (proves the soak fails).
fn broken_once(m: &[u8], done: &std::sync::atomic::AtomicBool) -> Option<&'static str> {
    let how = match std::env::var("SOAK_BREAK").as_deref() {
        Ok("lost") => "lost",
        Ok("corrupt") => "corrupt",
        _ => return None,
    };
    let h = wire::peek(m)?;
    if h.kind != Kind::Data || h.seq < 5 || m.len() < 1024 {
        return None;
    }
    (!done.swap(true, std::sync::atomic::Ordering::Relaxed)).then_some(how)
}

async fn make_grant(
    conn: &Connection,
) -> Result<tokio_rdma::buf::Grant<tokio_rdma::buf::PoolBuf>, String> {
    let pool = conn.pool().map_err(|e| format!("pool: {e}"))?;
    let buf = tokio::time::timeout(OP_LIMIT, pool.acquire(REGION))
        .await
        .map_err(|_| "acquire hung".to_string())?
        .map_err(|e| format!("acquire: {e}"))?;
    conn.grant(buf, 0..REGION, RemoteAccess::READ | RemoteAccess::WRITE)
        .map_err(|e| format!("grant: {e}"))
}
