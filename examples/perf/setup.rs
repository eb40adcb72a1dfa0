//! Out-of-band control channel (TCP, one text line per message) and the RDMA resources of one
//! test: device, driver, connected queue pairs and registered buffers.

use std::sync::Arc;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio_rdma::buf::{IoBuf, IoBufMut, RemoteToken};
use tokio_rdma::driver::{AsyncQp, CompletionMode, Driver, DriverOptions, QpOptions};
use tokio_rdma::verbs::{
    AccessFlags, CompletionQueue, Context, PortState, ProtectionDomain, QpAddress, QpCaps,
    QpInitAttr, QueuePair, RegisteredBuffer, RtrOptions, RtsOptions,
};

use crate::args::{Test, TestConfig};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub type Res<T> = Result<T, BoxError>;

/// The TCP control channel: newline-terminated text lines.
pub struct Ctrl {
    rd: BufReader<OwnedReadHalf>,
    wr: OwnedWriteHalf,
    line: String,
}

impl Ctrl {
    pub fn new(s: TcpStream) -> Ctrl {
        s.set_nodelay(true).ok();
        let (r, w) = s.into_split();
        Ctrl {
            rd: BufReader::new(r),
            wr: w,
            line: String::new(),
        }
    }

    pub async fn send(&mut self, msg: &str) -> Res<()> {
        self.wr.write_all(msg.as_bytes()).await?;
        self.wr.write_all(b"\n").await?;
        Ok(())
    }

    pub async fn recv(&mut self) -> Res<String> {
        self.line.clear();
        if self.rd.read_line(&mut self.line).await? == 0 {
            return Err("peer closed the control connection".into());
        }
        Ok(self.line.trim_end().to_string())
    }

    /// Receives a line that starts with `word` and returns the rest.
    pub async fn expect(&mut self, word: &str) -> Res<String> {
        let l = self.recv().await?;
        match l.split_once(' ') {
            Some((w, rest)) if w == word => Ok(rest.to_string()),
            None if l == word => Ok(String::new()),
            _ => Err(format!("expected `{word}`, got `{l}`").into()),
        }
    }
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub fn unhex(s: &str) -> Res<Vec<u8>> {
    if s.len() % 2 != 0 {
        return Err(format!("odd hex length: {s}").into());
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).map_err(|e| e.into()))
        .collect()
}

/// A slot of one shared registered buffer, passed to operations by value (what perftest does:
/// every request of a bandwidth test uses the same registration). The `Arc` keeps the region
/// registered and allocated while any slot lives.
#[derive(Debug, Clone)]
pub struct Chunk {
    pub buf: Arc<RegisteredBuffer>,
    pub off: usize,
    pub len: usize,
}

// SAFETY: the memory belongs to a `RegisteredBuffer` kept alive by the `Arc`; its address never
// changes; `off + len` is within it (checked in `Chunk::new`); its lkey covers all of it, and
// every byte of a `RegisteredBuffer` is initialised.
unsafe impl IoBuf for Chunk {
    fn stable_ptr(&self) -> *const u8 {
        (self.buf.addr() as usize + self.off) as *const u8
    }
    fn bytes_init(&self) -> usize {
        self.len
    }
    fn bytes_total(&self) -> usize {
        self.len
    }
    fn lkey(&self) -> Option<u32> {
        Some(self.buf.lkey())
    }
}

// SAFETY: as above. Slots may overlap (sizes too large for one slot per outstanding request);
// the device then writes the same bytes concurrently, which this benchmark never reads.
unsafe impl IoBufMut for Chunk {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        (self.buf.addr() as usize + self.off) as *mut u8
    }
    unsafe fn set_init(&mut self, _pos: usize) {}
}

/// Carves `want` slots of `size` bytes out of one registration of at most `cap` bytes (slots
/// repeat when they do not all fit).
pub fn chunks(pd: &ProtectionDomain, size: usize, want: usize, cap: usize) -> Res<Vec<Chunk>> {
    let distinct = (cap / size).clamp(1, want.max(1));
    let buf = Arc::new(RegisteredBuffer::new(
        pd,
        distinct * size,
        AccessFlags::LOCAL_WRITE,
    )?);
    Ok((0..want.max(1))
        .map(|i| Chunk {
            buf: buf.clone(),
            off: (i % distinct) * size,
            len: size,
        })
        .collect())
}

/// One end of a test: its queue pairs connected to the peer's, and its buffers.
pub struct Side {
    pub pd: ProtectionDomain,
    /// None with the verbs engine.
    pub driver: Option<Driver>,
    pub qps: Vec<AsyncQp>,
    /// The verbs engine's queue pairs, each with its own CQ (polled directly).
    pub vqps: Vec<(QueuePair, CompletionQueue)>,
    /// The owned engine's queue pairs (borrowed by one loop at a time).
    pub oqps: tokio::sync::Mutex<Vec<crate::owned_engine::Qp>>,
    /// Per queue pair: memory the peer may write and read (the write/read target, and the
    /// buffer whose last byte write_lat polls).
    pub exposed: Vec<RegisteredBuffer>,
    /// Per queue pair: the peer's exposed buffer.
    pub remote: Vec<RemoteToken>,
    pub device: String,
    pub port: u8,
    /// The msg_* tests' RDMA CM connection (None for queue-pair tests).
    pub conn: Option<tokio_rdma::conn::Connection>,
}

pub fn open(device: Option<&str>) -> Res<(Context, u8)> {
    match device {
        None => Ok(Context::open_first_active()?),
        Some(name) => {
            let ctx = Context::open(name)?;
            let port = (1..=ctx.device_attr().phys_port_cnt)
                .find(|&p| {
                    ctx.query_port(p)
                        .is_ok_and(|a| a.state == PortState::Active)
                })
                .ok_or_else(|| format!("{name} has no active port"))?;
            Ok((ctx, port))
        }
    }
}

/// Creates this side's resources, exchanges endpoints and tokens with the peer over `ctrl`
/// (the client speaks first) and connects the queue pairs.
pub async fn establish(
    ctrl: &mut Ctrl,
    cfg: &TestConfig,
    device: Option<&str>,
    client: bool,
) -> Res<Side> {
    let (ctx, port) = open(device)?;
    let gid = ctx.preferred_gid(port)?;
    let pd = ProtectionDomain::new(&ctx)?;
    let is_send = matches!(cfg.test, Test::SendLat | Test::SendBw);
    let sq = if cfg.test.is_lat() {
        16
    } else {
        cfg.depth.max(16)
    } as u32;
    let rq = if !is_send {
        1
    } else if cfg.test.is_lat() {
        16
    } else {
        cfg.rx_depth.max(16)
    } as u32;
    let cq_size = (cfg.qps as u32 * (sq + rq)).max(256) + 64;
    let caps = QpCaps {
        max_send_wr: sq,
        max_recv_wr: rq,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: cfg.inline,
    };
    // A server with no completions on its critical path (the target of writes and reads)
    // sleeps on events, as perftest's does on its socket: a busy-polling bystander would only
    // take a CPU from the device (on rxe, the kernel does the transfers).
    let passive = !client && matches!(cfg.test, Test::ReadLat | Test::WriteBw | Test::ReadBw);
    let mode = if passive {
        CompletionMode::Event
    } else {
        cfg.mode
    };
    let driver = if cfg.verbs || cfg.owned {
        None
    } else {
        Some(Driver::new(
            &ctx,
            DriverOptions::default().mode(mode).cq_size(cq_size),
        )?)
    };
    let mut opts = QpOptions::default();
    opts.caps = caps;
    opts.inline = cfg.inline > 0;
    opts.signal_every = cfg.signal_every;
    opts.coalesce = cfg.coalesce;
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    let mut qps = Vec::new();
    let mut vqps = Vec::new();
    let mut oqps = Vec::new();
    let mut exposed = Vec::new();
    let mut lines = Vec::new();
    let mut local_eps = Vec::new();
    for _ in 0..cfg.qps {
        let vqp = match &driver {
            Some(d) => {
                qps.push(d.create_qp(&pd, opts)?);
                qps.last().expect("pushed").verbs().clone()
            }
            None if cfg.owned => {
                let mut o = tokio_rdma::owned::OwnedQpOptions::default();
                o.caps = caps;
                o.mode = mode;
                o.inline = cfg.inline > 0;
                let qp = crate::owned_engine::Qp::new(&pd, o)?;
                let v = qp.verbs().clone();
                oqps.push(qp);
                v
            }
            None => {
                let cq = CompletionQueue::new(&ctx, cq_size, None)?;
                let mut attr = QpInitAttr::new(&cq, &cq);
                attr.caps = caps;
                let qp = QueuePair::new_rc(&pd, &attr)?;
                vqps.push((qp.clone(), cq));
                qp
            }
        };
        let ep = vqp.local_address(port, Some(gid.index))?;
        // Write/read tests expose the largest size; others still exchange a small token.
        let len = if is_send { 64 } else { cfg.max_size() };
        let buf = RegisteredBuffer::new(&pd, len, access)?;
        let token = RemoteToken::new(buf.addr(), buf.len() as u64, buf.rkey());
        lines.push(format!(
            "qp {} {}",
            hex(&ep.to_bytes()),
            hex(&token.to_bytes())
        ));
        local_eps.push((vqp, ep));
        exposed.push(buf);
    }
    let peer = if client {
        for l in &lines {
            ctrl.send(l).await?;
        }
        read_peers(ctrl, cfg.qps).await?
    } else {
        let peer = read_peers(ctrl, cfg.qps).await?;
        for l in &lines {
            ctrl.send(l).await?;
        }
        peer
    };
    let rtr = RtrOptions::new(port, gid.index as u8);
    // As perftest: RNR retries never run out (7), so a receiver that falls behind costs RNR
    // delays (counted in the hw counters), not a failed test.
    let rts = RtsOptions {
        rnr_retry: 7,
        ..RtsOptions::default()
    };
    for ((qp, me), (them, _)) in local_eps.iter().zip(&peer) {
        qp.connect(me, them, &rtr, &rts, access)?;
    }
    // Both sides are in RTS before either starts (a request to a QP still in INIT is dropped
    // and costs a retransmission timeout).
    if client {
        ctrl.send("connected").await?;
        ctrl.expect("connected").await?;
    } else {
        ctrl.expect("connected").await?;
        ctrl.send("connected").await?;
    }
    Ok(Side {
        pd,
        driver,
        qps,
        vqps,
        oqps: tokio::sync::Mutex::new(oqps),
        exposed,
        remote: peer.into_iter().map(|(_, t)| t).collect(),
        device: ctx.name().to_string(),
        port,
        conn: None,
    })
}

async fn read_peers(ctrl: &mut Ctrl, n: usize) -> Res<Vec<(QpAddress, RemoteToken)>> {
    let mut peer = Vec::new();
    for _ in 0..n {
        let rest = ctrl.expect("qp").await?;
        let (ep, tok) = rest.split_once(' ').ok_or("bad qp line")?;
        peer.push((
            QpAddress::from_bytes(&unhex(ep)?)?,
            RemoteToken::from_bytes(&unhex(tok)?)?,
        ));
    }
    Ok(peer)
}
