//! What every scenario shares: a connected pair of streams over RDMA or TCP loopback, the
//! payload pattern every byte is checked against, and the measurements.

use std::fmt;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use futures::StreamExt;
use hdrhistogram::Histogram;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio_rdma::conn::{Connection, Listener, RdmaStream};

/// Any error, with its message (a payload mismatch is one too: the run exits non-zero).
pub type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Returns a mismatch error from the enclosing function unless `cond` holds.
macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(format!("payload check failed: {}", format!($($fmt)+)).into());
        }
    };
}
pub(crate) use ensure;

/// The transport of one run of a scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Net {
    /// `RdmaStream` over RDMA CM on this address (rxe0's in the VM).
    Rdma(SocketAddr),
    /// `TcpStream` over the loopback interface (`TCP_NODELAY` set on both ends, as tonic and
    /// most RPC stacks do).
    Tcp,
}

impl fmt::Display for Net {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Net::Rdma(_) => "RDMA",
            Net::Tcp => "TCP",
        })
    }
}

/// One connected pair over RDMA: the server end from the listener's stream of incoming
/// connections (`Listener::into_incoming`, what `serve_with_incoming`-style APIs take), the
/// client end from `Connection::connect(..).into_stream()`.
pub async fn rdma_pair(addr: SocketAddr) -> Res<(RdmaStream, RdmaStream)> {
    let mut incoming = Listener::bind(addr).await?.into_incoming();
    let (server, client) = tokio::join!(incoming.next(), Connection::connect(addr));
    let server = server.ok_or("the listener's stream ended")??;
    Ok((server, client?.into_stream()))
}

/// One connected pair over TCP loopback.
pub async fn tcp_pair() -> Res<(TcpStream, TcpStream)> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let (server, client) = tokio::join!(
        listener.accept(),
        TcpStream::connect(listener.local_addr()?)
    );
    let (server, client) = (server?.0, client?);
    server.set_nodelay(true)?;
    client.set_nodelay(true)?;
    Ok((server, client))
}

/// A fresh connected pair (server end, client end) over `net`.
pub async fn pair(net: Net) -> Res<(Box<dyn IoObj>, Box<dyn IoObj>)> {
    Ok(match net {
        Net::Rdma(addr) => {
            let (s, c) = rdma_pair(addr).await?;
            (Box::new(s), Box::new(c))
        }
        Net::Tcp => {
            let (s, c) = tcp_pair().await?;
            (Box::new(s), Box::new(c))
        }
    })
}

/// The rows of one scenario on one transport: (row name, measurements).
pub type Rows = Vec<(&'static str, Measured)>;

/// How much each scenario does.
#[derive(Debug, Clone, Copy)]
pub struct Load {
    /// Measured sequential round trips of the small size.
    pub iters: u64,
    /// The small request size (the raw baselines use it too).
    pub small: usize,
    /// Frames each way in the pipelined Framed run.
    pub frames: u64,
    /// 1 MiB bodies in the HTTP/1.1 run.
    pub large: u64,
    /// Concurrent HTTP/2 streams, each doing `iters / streams` echoes (0: no multiplexed row).
    pub streams: u64,
    /// Messages per gRPC server-streaming call, and calls.
    pub stream_msgs: u64,
}

/// A boxed byte stream: the scenarios are written once, for both transports.
pub trait IoObj: AsyncRead + AsyncWrite + Unpin + Send + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> IoObj for T {}

/// `len` bytes of the pattern of message `seq`: any byte lost, duplicated, reordered or
/// delivered to the wrong request breaks the comparison.
pub fn payload(seq: u64, len: usize) -> Vec<u8> {
    let mut x = seq.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Checks `got` against [`payload`]`(seq, len)`, naming the first differing byte.
pub fn check(what: &str, seq: u64, len: usize, got: &[u8]) -> Res<()> {
    let want = payload(seq, len);
    ensure!(
        got.len() == len,
        "{what} #{seq}: {} bytes, expected {len}",
        got.len()
    );
    if let Some(i) = (0..len).find(|&i| got[i] != want[i]) {
        return Err(format!("payload check failed: {what} #{seq}: byte {i} differs").into());
    }
    Ok(())
}

/// A histogram of latencies in nanoseconds.
pub fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000_000, 3).expect("valid histogram bounds")
}

/// The measurements of one scenario on one transport.
#[derive(Debug, Clone)]
pub struct Measured {
    /// Latency of each request (round trip), nanoseconds.
    pub hist: Histogram<u64>,
    /// Requests completed (all of them checked).
    pub requests: u64,
    /// Wall time of the measured part.
    pub elapsed: Duration,
    /// Payload bytes moved each way (for a bandwidth figure; 0 if not measured).
    pub bytes: u64,
}

impl Measured {
    /// An empty measurement, started now.
    pub fn start() -> (Measured, Instant) {
        (
            Measured {
                hist: histogram(),
                requests: 0,
                elapsed: Duration::ZERO,
                bytes: 0,
            },
            Instant::now(),
        )
    }

    /// Records one request that took `d`.
    pub fn record(&mut self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX).max(1);
        self.hist.saturating_record(ns);
        self.requests += 1;
    }

    /// Adds the samples of `other` (another client of the same run).
    pub fn merge(&mut self, other: &Measured) {
        self.hist.add(&other.hist).expect("same histogram bounds");
        self.requests += other.requests;
        self.bytes += other.bytes;
    }

    /// Requests per second over the measured wall time.
    pub fn rate(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// Median latency in microseconds.
    pub fn p50_us(&self) -> f64 {
        self.hist.value_at_quantile(0.5) as f64 / 1e3
    }

    /// 99th percentile latency in microseconds.
    pub fn p99_us(&self) -> f64 {
        self.hist.value_at_quantile(0.99) as f64 / 1e3
    }

    /// Payload megabytes per second each way (0 if no bytes were counted).
    pub fn mb_per_s(&self) -> f64 {
        self.bytes as f64 / 1e6 / self.elapsed.as_secs_f64().max(1e-9)
    }
}
