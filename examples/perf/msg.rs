//! The connection-message tests (`msg_lat`, `msg_rate`): an `Endpoint` on the device, an RDMA
//! CM connection between client and server (the server listens on an ephemeral port and says
//! which over the control channel), and `Connection::send` / `Connection::recv`.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio_rdma::buf::{PoolConfig, SizeClass};
use tokio_rdma::conn::{ConnectOptions, Connection};
use tokio_rdma::verbs::{PortState, ProtectionDomain};
use tokio_rdma::{Endpoint, EndpointOptions};

use crate::args::{Rendezvous, Test, TestConfig};
use crate::setup::{Ctrl, Res, Side};

/// The options both sides use: the crate's defaults, with the inline limit of `--inline` and,
/// for msg_rate, `--depth` receive credits (the window: the sender never has more messages in
/// flight than the receiver has credits).
fn conn_options(cfg: &TestConfig) -> ConnectOptions {
    let mut opts = ConnectOptions::default();
    opts.params.max_inline = cfg.inline;
    if cfg.test == Test::MsgRate {
        opts = opts.recv_credits(cfg.depth.max(2) as u32);
    }
    let max = cfg.max_size() as u64;
    if max > opts.params.max_message_size {
        opts = opts.max_message_size(max).recv_budget(2 * max);
    }
    if cfg.zero_copy {
        // One registered buffer per size, reused for every send (its bytes never change), and
        // one for recv_into.
        opts = opts.user_pool(
            PoolConfig::default().classes([SizeClass::new(cfg.max_size(), cfg.sizes.len() + 1)]),
        );
    }
    if cfg.rendezvous == Rendezvous::Off {
        opts = opts.rendezvous_threshold(None);
    }
    opts
}

/// What the client sends: a plain slice (copied) or bytes of the connection's pool.
enum Payload {
    Copied(Vec<u8>),
    Registered(Bytes),
}

impl Payload {
    async fn new(conn: &Connection, cfg: &TestConfig, size: usize) -> Res<Payload> {
        if !cfg.zero_copy {
            return Ok(Payload::Copied(vec![0x5au8; size]));
        }
        let mut b = conn.pool()?.acquire(size).await?;
        b.set_len(size);
        b.fill(0x5a);
        Ok(Payload::Registered(b.freeze()))
    }

    async fn send(&self, conn: &Connection) -> tokio_rdma::Result<()> {
        match self {
            Payload::Copied(v) => conn.send(v).await,
            Payload::Registered(b) => conn.send_bytes(b.clone()).await,
        }
    }
}

/// Opens the endpoint (in `cfg.mode`) and connects: the server (`client == None`) listens and
/// accepts, the client connects to `client`'s host on the port the server names.
pub async fn establish(
    ctrl: &mut Ctrl,
    cfg: &TestConfig,
    device: Option<&str>,
    client: Option<&str>,
) -> Res<Side> {
    let eopts = EndpointOptions::default().completion_mode(cfg.mode);
    let ep = match device {
        Some(name) => Endpoint::open_with(name, eopts)?,
        None => Endpoint::open_first_active_with(eopts)?,
    };
    let ctx = ep.context();
    let port = (1..=ctx.device_attr().phys_port_cnt)
        .find(|&p| {
            ctx.query_port(p)
                .is_ok_and(|a| a.state == PortState::Active)
        })
        .unwrap_or(1);
    let opts = conn_options(cfg);
    let conn = match client {
        None => {
            let any: SocketAddr = "0.0.0.0:0".parse().expect("address");
            let listener = ep.listen_with(any, opts).await?;
            let cm_port = listener.local_addr().map(|a| a.port())?;
            ctrl.send(&format!("cm {cm_port}")).await?;
            let conn = tokio::time::timeout(Duration::from_secs(60), listener.accept())
                .await
                .map_err(|_| "no RDMA CM connection within 60 s")??;
            ctrl.expect("connected").await?;
            ctrl.send("connected").await?;
            conn
        }
        Some(host) => {
            let cm_port: u16 = ctrl.expect("cm").await?.parse()?;
            let addr = tokio::net::lookup_host((host, cm_port))
                .await?
                .find(SocketAddr::is_ipv4)
                .ok_or_else(|| format!("{host}: no IPv4 address"))?;
            let conn = ep.connect(addr, opts).await?;
            ctrl.send("connected").await?;
            ctrl.expect("connected").await?;
            conn
        }
    };
    Ok(Side {
        pd: ProtectionDomain::new(ctx)?,
        driver: Some(ep.driver().clone()),
        qps: Vec::new(),
        vqps: Vec::new(),
        oqps: Default::default(),
        exposed: Vec::new(),
        remote: Vec::new(),
        device: ep.device_name().to_string(),
        port,
        conn: Some(conn),
    })
}

/// Closes the connection (if any) cleanly, giving up after a few seconds.
pub async fn close(side: &Side) {
    if let Some(conn) = &side.conn {
        let _ = tokio::time::timeout(Duration::from_secs(5), conn.close()).await;
    }
}

fn conn(side: &Side) -> &Connection {
    side.conn.as_ref().expect("a msg test has a connection")
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Client side of one size; returns the number of measured operations.
pub async fn client(
    side: &Side,
    cfg: &TestConfig,
    size: usize,
    samples: &mut Vec<f64>,
    mark: &mut impl FnMut(usize),
) -> Res<u64> {
    let conn = conn(side);
    let msg = Payload::new(conn, cfg, size).await?;
    match cfg.test {
        Test::MsgLat => {
            // One clock read per round trip, as perftest's (crate::run::Stamps).
            let mut clock = crate::run::Stamps::start(cfg.warmup + cfg.iters);
            for k in 0..cfg.warmup + cfg.iters {
                mark(k);
                msg.send(conn).await?;
                let pong = conn.recv().await?.ok_or("the server closed early")?;
                clock.stamp();
                if pong.len() != size {
                    return Err(format!("pong of {} bytes, expected {size}", pong.len()).into());
                }
                // Dropping the pong returns its credit: in the next sample, as perftest's
                // re-post of its receive falls between two of its stamps.
                drop(pong);
            }
            clock.samples(cfg.warmup, 0.5, samples);
        }
        _ => {
            if cfg.warmup > 0 {
                stream(
                    conn,
                    &msg,
                    cfg.warmup,
                    in_flight(cfg),
                    false,
                    &mut Vec::new(),
                )
                .await?;
            }
            mark(cfg.warmup);
            stream(
                conn,
                &msg,
                cfg.iters,
                in_flight(cfg),
                cfg.op_latency,
                samples,
            )
            .await?;
        }
    }
    Ok(cfg.iters as u64)
}

/// Sends at once: `depth` when large messages may go by rendezvous, else one.
fn in_flight(cfg: &TestConfig) -> usize {
    if cfg.zero_copy && cfg.rendezvous != Rendezvous::Off {
        cfg.depth
    } else {
        1
    }
}

/// Messages per `send_many` call of the untimed stream.
const SEND_BATCH: usize = 64;

/// Sends `n` messages back to back, then waits for the receiver's 1-byte acknowledgement of
/// the last. A send resolves once its chunks are posted (the window is the receiver's
/// credits), one after the other; a rendezvous send resolves only once the receiver read it,
/// so with rendezvous `depth` sends run at once. With `timed`, each send's time (start to
/// resolve, us) goes into `samples`; otherwise no clock is read per message, and copied
/// messages go `SEND_BATCH` at a time through `send_many`.
async fn stream(
    conn: &Connection,
    msg: &Payload,
    n: usize,
    depth: usize,
    timed: bool,
    samples: &mut Vec<f64>,
) -> Res<()> {
    if let (Payload::Copied(v), false, true) = (msg, timed, depth <= 1) {
        // Untimed copied messages go in batches (`send_many`: the ones that can go at once
        // in one look and one doorbell), as perftest posts back to back.
        let batch = vec![&v[..]; SEND_BATCH.min(n.max(1))];
        let mut left = n;
        while left > 0 {
            let k = left.min(batch.len());
            conn.send_many(&batch[..k]).await?;
            left -= k;
        }
    } else if depth <= 1 {
        // One send at a time: a plain loop, as an application writes it (`buffered(1)` would
        // add a task allocation and the futures crate's bookkeeping to every message).
        for _ in 0..n {
            let t = timed.then(Instant::now);
            msg.send(conn).await?;
            if let Some(t) = t {
                samples.push(us(t.elapsed()));
            }
        }
    } else {
        use futures::StreamExt;
        let mut sends = futures::stream::iter(0..n)
            .map(|_| async {
                let t = timed.then(Instant::now);
                msg.send(conn).await.map(|()| t.map(|t| us(t.elapsed())))
            })
            .buffered(depth);
        while let Some(r) = sends.next().await {
            if let Some(us) = r? {
                samples.push(us);
            }
        }
    }
    let ack = conn.recv().await?.ok_or("the server closed early")?;
    if ack.len() != 1 {
        return Err(format!("ack of {} bytes", ack.len()).into());
    }
    Ok(())
}

/// Server side of one size, after `ready`: echo each ping, or take a stream and acknowledge it.
pub async fn server(side: &Side, cfg: &TestConfig, size: usize) -> Res<()> {
    let conn = conn(side);
    let next = async || -> Res<_> {
        let m = conn.recv().await?.ok_or("the client closed early")?;
        if m.len() != size {
            return Err(format!("message of {} bytes, expected {size}", m.len()).into());
        }
        Ok(m)
    };
    match cfg.test {
        Test::MsgLat => {
            for _ in 0..cfg.warmup + cfg.iters {
                let m = next().await?;
                if cfg.zero_copy {
                    // A single-chunk message goes back from its receive buffer.
                    conn.send_bytes(m.into_bytes()).await?;
                } else {
                    conn.send(&m[..]).await?;
                }
            }
        }
        _ if cfg.rendezvous == Rendezvous::Into => {
            // One buffer of the connection's pool, read into again and again.
            let mut buf = conn.pool()?.acquire(size).await?;
            for n in [cfg.warmup, cfg.iters] {
                for _ in 0..n {
                    let (got, b) = conn.recv_into(buf).await;
                    buf = b;
                    match got? {
                        Some(len) if len == size => {}
                        other => {
                            return Err(format!("recv_into: {other:?}, expected {size}").into());
                        }
                    }
                }
                if n > 0 {
                    conn.send(&[1]).await?;
                }
            }
        }
        _ => {
            // Messages are taken in batches of what has arrived (`recv_many`: one look at the
            // connection per batch), as perftest's receiver polls a batch of completions.
            let cap = cfg.depth.max(1);
            let mut batch = Vec::with_capacity(cap);
            for n in [cfg.warmup, cfg.iters] {
                let mut left = n;
                while left > 0 {
                    let got = conn.recv_many(&mut batch, left.min(cap)).await?;
                    if got == 0 {
                        return Err("the client closed early".into());
                    }
                    if let Some(m) = batch.iter().find(|m| m.len() != size) {
                        return Err(format!("message of {} bytes, expected {size}", m.len()).into());
                    }
                    left -= got;
                    // Dropping them returns their credits.
                    batch.clear();
                }
                if n > 0 {
                    conn.send(&[1]).await?;
                }
            }
        }
    }
    Ok(())
}
