//! The harness of `tests/conn_hostile.rs`: a listener with a well-behaved connection and a
//! resource baseline ([`Bench`]), and helpers to classify what a hostile peer's victim saw.
#![allow(dead_code, unreachable_pub, clippy::print_stdout)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::common::{self, within};
use super::raw_peer::{RawOpts, RawPeer, Seen};
use tokio::task::JoinHandle;
use tokio_rdma::buf::{PoolConfig, SizeClass};
use tokio_rdma::conn::handshake::Params;
use tokio_rdma::conn::wire::{MsgHeader, MsgKind};
use tokio_rdma::conn::{ConnectOptions, Connection, Listener, Message};
use tokio_rdma::{Error, ProtocolError, QpFailure, WcStatus};

pub fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([192, 0, 2, 1], port))
}

/// Small connections (quick to set up under emulation): `credits` receives of `buf` bytes,
/// messages up to `max_msg`.
pub fn opts(credits: u32, buf: u32, max_msg: u64) -> ConnectOptions {
    let mut o = ConnectOptions::default()
        .recv_credits(credits)
        .recv_buf_size(buf)
        .max_message_size(max_msg)
        .connect_timeout(Duration::from_secs(60))
        .user_pool(PoolConfig::default().classes([SizeClass::new(4096, 4)]));
    o.send_queue_depth = 16;
    o
}

/// What a raw peer announces.
pub fn raw_params(credits: u32, buf: u32, max_msg: u64) -> Params {
    Params {
        recv_credits: credits,
        recv_buf_size: buf,
        max_message_size: max_msg,
        ..Params::default()
    }
}

/// Runs blocking raw-peer code off the runtime's workers.
pub async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.expect("raw peer")
}

/// How a receive loop ended.
pub type End = std::result::Result<(), Error>;

/// Receives on `conn` until it fails or ends, holding every message (none is consumed, so
/// no credit goes back because of the application); returns the messages, how it ended
/// (`Ok(())`: end of stream), when, and the connection.
pub fn collect(conn: Connection) -> JoinHandle<(Vec<Message>, End, Instant, Connection)> {
    tokio::spawn(async move {
        let mut msgs = Vec::new();
        loop {
            match conn.recv().await {
                Ok(Some(m)) => msgs.push(m),
                Ok(None) => return (msgs, Ok(()), Instant::now(), conn),
                Err(e) => return (msgs, Err(e), Instant::now(), conn),
            }
        }
    })
}

pub fn is_protocol(end: &End, want: ProtocolError) -> bool {
    matches!(end, Err(Error::QpFailed(QpFailure::Protocol(p))) if *p == want)
}

pub fn wc_status(e: &Error) -> Option<WcStatus> {
    match e {
        Error::QpFailed(QpFailure::WorkCompletion { status, .. }) => Some(*status),
        _ => None,
    }
}

/// Whether a raw peer's log entry is an error report (a receive with kind `Error`).
pub fn is_report(s: &Seen) -> bool {
    matches!(s, Seen::Recv { imm: Some(i), .. }
        if MsgHeader::decode(*i).is_ok_and(|h| h.kind == MsgKind::Error))
}

// ---- device resources (`rdma resource show`, as in tests/conn_setup.rs) ----------------------

pub fn resource_counts() -> BTreeMap<String, u64> {
    let mut c = common::resource_counts();
    c.retain(|k, _| ["qp", "cq", "mr", "pd", "cm_id"].contains(&k.as_str()));
    c
}

/// The counts once they stayed the same for 2 s (earlier teardown finished).
pub async fn settled_counts() -> BTreeMap<String, u64> {
    let mut last = resource_counts();
    let mut same_since = Instant::now();
    let start = Instant::now();
    while same_since.elapsed() < Duration::from_secs(2) && start.elapsed() < Duration::from_secs(60)
    {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let now = resource_counts();
        if now != last {
            last = now;
            same_since = Instant::now();
        }
    }
    last
}

/// Waits (up to 60 s) until the counts are `baseline` again; panics with both if not.
pub async fn back_to(baseline: &BTreeMap<String, u64>, after: &str) {
    let t0 = Instant::now();
    let mut now = resource_counts();
    while now != *baseline && t0.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        now = resource_counts();
    }
    assert_eq!(
        now, *baseline,
        "{after}: device resources not back to the baseline within 60 s"
    );
    println!(
        "  resources after {after}: back to the baseline {baseline:?} within {:?}",
        t0.elapsed()
    );
}

// ---- the bench: a listener, a well-behaved connection, a resource baseline -----------------

pub struct Bench {
    pub addr: SocketAddr,
    pub listener: Arc<Listener>,
    pub good: Connection,
    pub echoes: u32,
    pub baseline: BTreeMap<String, u64>,
}

impl Bench {
    /// Binds a listener at `port` with `opts`, connects a well-behaved client (served by an
    /// echo task) and takes the resource baseline.
    pub async fn new(port: u16, opts: ConnectOptions) -> Bench {
        common::init_tracing();
        let a = addr(port);
        let listener = Arc::new(Listener::bind_with(a, opts.clone()).await.expect("bind"));
        let (good, served) = tokio::join!(
            within(60, "connect", Connection::connect_with(a, opts)),
            within(60, "accept", listener.accept()),
        );
        let served = served.expect("accept the well-behaved client");
        tokio::spawn(async move {
            while let Ok(Some(m)) = served.recv().await {
                if served.send(&m).await.is_err() {
                    break;
                }
            }
        });
        let mut bench = Bench {
            addr: a,
            listener,
            good: good.expect("connect the well-behaved client"),
            echoes: 0,
            baseline: BTreeMap::new(),
        };
        bench.good_still_works("setup").await;
        bench.baseline = settled_counts().await;
        println!(
            "baseline (listener + one well-behaved connection): {:?}",
            bench.baseline
        );
        bench
    }

    /// A raw peer connected to the listener, and the server's side of it.
    pub async fn hostile(&self, raw: RawOpts) -> (RawPeer, Connection) {
        let a = self.addr;
        let (peer, conn) = tokio::join!(
            blocking(move || RawPeer::connect(a, raw)),
            within(60, "accept the raw peer", self.listener.accept()),
        );
        (peer, conn.expect("accept the raw peer"))
    }

    /// An echo round trip on the well-behaved connection.
    pub async fn good_still_works(&mut self, after: &str) {
        self.echoes += 1;
        let msg = format!("echo {} after {after}", self.echoes);
        let t0 = Instant::now();
        within(60, "echo send", self.good.send(msg.as_bytes()))
            .await
            .unwrap_or_else(|e| panic!("well-behaved connection, send after {after}: {e}"));
        let back = within(60, "echo recv", self.good.recv())
            .await
            .unwrap_or_else(|e| panic!("well-behaved connection, recv after {after}: {e}"))
            .expect("not end of stream");
        assert_eq!(&back[..], msg.as_bytes());
        println!(
            "  well-behaved connection after {after}: echo round trip in {:?}",
            t0.elapsed()
        );
    }

    /// After an attack: the well-behaved connection works, the resources are back.
    pub async fn survived(&mut self, after: &str) {
        self.good_still_works(after).await;
        back_to(&self.baseline, after).await;
    }
}
