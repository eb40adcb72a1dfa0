//! [`Connection`]: an RC connection set up through RDMA CM, with messages under credit flow
//! control and one-sided operations.

use std::fmt;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use tokio::sync::{Mutex as AsyncMutex, mpsc};
use tracing::{Instrument, debug, info_span, warn};

use super::cm_async::AsyncChannel;
use super::engine::{ConnStats, Engine};
use super::handshake::{Flags, Negotiated};
use super::options::ConnectOptions;
use super::receiver::{self, Delivery};
use super::setup::{self, Prepared};
use super::stream::RdmaStream;
use crate::buf::{Grant, IoBufMut, Pool, PoolConfig, RemoteAccess, RemoteToken};
use crate::error::{Error, QpFailure, Result};
use crate::ops::{CompareSwap, FetchAdd, Read, SgSource, SgTarget, Write};
use crate::verbs::{CmEventKind, CmId};

/// An established RDMA connection.
///
/// * Messages: [`send`](Self::send) / [`recv`](Self::recv), with credit-based flow control (a
///   sender never sends without a receive posted at the peer, so the device never sees an RNR
///   NAK). Messages larger than the peer's receive buffers are split into chunks and
///   reassembled; a single-chunk message is received without copying.
/// * One-sided I/O: [`write`](Self::write), [`read`](Self::read) and atomics against
///   [`RemoteToken`]s the peer granted (exchange them with messages).
/// * A byte stream: [`into_stream`](Self::into_stream) gives an `AsyncRead + AsyncWrite`.
/// * [`close`](Self::close) ends the stream cleanly (the peer's `recv` returns `Ok(None)`) and
///   drains; dropping the connection does the same in the background.
///
/// # Examples
///
/// ```no_run
/// use tokio_rdma::conn::Connection;
///
/// # async fn demo() -> tokio_rdma::Result<()> {
/// let conn = Connection::connect("192.0.2.1:7471".parse().unwrap()).await?;
/// conn.send(b"hello").await?;
/// if let Some(reply) = conn.recv().await? {
///     println!("got {} bytes", reply.len());
/// }
/// conn.close().await?;
/// # Ok(()) }
/// ```
pub struct Connection {
    engine: Arc<Engine>,
    rx: AsyncMutex<mpsc::UnboundedReceiver<Delivery>>,
    id: Arc<CmId>,
    peer: Option<SocketAddr>,
    closed: std::sync::atomic::AtomicBool,
    span: tracing::Span,
    /// What this side offered in the handshake (one-sided access, atomics).
    offered: Flags,
    user_pool: OnceLock<Pool>,
    user_pool_config: PoolConfig,
}

/// A connection whose receives are posted, waiting for the CM handshake to complete.
pub(crate) struct Starting {
    engine: Arc<Engine>,
    rx: mpsc::UnboundedReceiver<Delivery>,
    offered: Flags,
    user_pool_config: PoolConfig,
}

impl Connection {
    /// Connects to a listener at `addr` with default options.
    ///
    /// # Errors
    ///
    /// Resolution or connection errors ([`Error::ConnectionRejected`] with the peer's reason,
    /// [`Error::CmEventFailed`] for an unreachable peer, [`Error::Timeout`]), handshake errors
    /// ([`Error::Handshake`]), or verb errors.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future abandons the attempt; the half-made connection is torn down.
    pub async fn connect(addr: SocketAddr) -> Result<Connection> {
        Connection::connect_with(addr, ConnectOptions::default()).await
    }

    /// Connects to `addr` with `opts`.
    ///
    /// # Errors
    ///
    /// As [`connect`](Self::connect).
    ///
    /// # Cancel safety
    ///
    /// As [`connect`](Self::connect).
    pub async fn connect_with(addr: SocketAddr, opts: ConnectOptions) -> Result<Connection> {
        let span = info_span!("conn", peer = %addr, side = "client");
        let timeout = opts.connect_timeout;
        match tokio::time::timeout(
            timeout,
            setup::connect(addr, opts, span.clone()).instrument(span),
        )
        .await
        {
            Ok(r) => r,
            Err(_) => Err(Error::Timeout {
                what: "connection setup",
                after: timeout,
            }),
        }
    }

    /// Setup, phase 1 (before the peer learns this side's credits): builds the connection's
    /// engine and posts its receives.
    pub(crate) async fn start(
        prepared: Prepared,
        negotiated: Negotiated,
        opts: &ConnectOptions,
        span: &tracing::Span,
    ) -> Result<Starting> {
        let engine = Arc::new(Engine::new(
            prepared.qp,
            prepared.pd,
            prepared.pool,
            negotiated,
        ));
        let rx = receiver::start(engine.clone(), opts.keepalive, span.clone()).await?;
        Ok(Starting {
            engine,
            rx,
            offered: opts.params.flags,
            user_pool_config: opts.user_pool.clone(),
        })
    }

    /// Setup, phase 2: the CM connection is established and the queue pair is in RTS.
    pub(crate) fn established(
        starting: Starting,
        id: Arc<CmId>,
        events: AsyncChannel,
        span: tracing::Span,
    ) -> Connection {
        let Starting {
            engine,
            rx,
            offered,
            user_pool_config,
        } = starting;
        engine
            .ready
            .store(true, std::sync::atomic::Ordering::Release);
        let peer = id.peer_addr();
        tokio::spawn(watch_cm(events, engine.clone(), id.clone()).instrument(span.clone()));
        span.in_scope(|| debug!(negotiated = ?engine.params, "connection established"));
        Connection {
            engine,
            rx: AsyncMutex::new(rx),
            id,
            peer,
            closed: std::sync::atomic::AtomicBool::new(false),
            span,
            offered,
            user_pool: OnceLock::new(),
            user_pool_config,
        }
    }

    /// Sends one message (copied into registered buffers; larger messages are chunked).
    /// Waits for credits and buffers (backpressure), and for the message's completion.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] if it exceeds the negotiated message size; the connection's
    /// failure ([`Error::QpFailed`]) if it failed or was closed.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: dropped midway, part of a chunked message may have been sent, and the
    /// peer would then see a protocol error at the next message. Drop the connection instead.
    pub async fn send(&self, msg: &[u8]) -> Result<()> {
        self.engine.send_message(msg).await
    }

    /// Receives the next message. `Ok(None)` means the peer closed its side cleanly.
    ///
    /// # Errors
    ///
    /// The connection's failure, or [`Error::Protocol`] if the peer broke the protocol.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a message is only taken when this returns it.
    pub async fn recv(&self) -> Result<Option<Bytes>> {
        let mut rx = self.rx.lock().await;
        match rx.recv().await {
            Some(Ok(m)) => Ok(Some(m)),
            Some(Err(e)) => Err(e),
            None => match self.engine.failure() {
                Some(e) if !self.engine.state().peer_closed => Err(e),
                _ => Ok(None),
            },
        }
    }

    /// Writes `buf` (registered memory) into the peer's memory at `remote`.
    ///
    /// # Cancel safety
    ///
    /// As [`AsyncQp::write`](crate::driver::AsyncQp::write).
    pub fn write<B: SgSource>(&self, buf: B, remote: RemoteToken) -> Write<B> {
        self.engine.qp.write(buf, remote)
    }

    /// Reads the peer's memory at `remote` into `buf`.
    ///
    /// # Cancel safety
    ///
    /// As [`AsyncQp::read`](crate::driver::AsyncQp::read).
    pub fn read<B: SgTarget>(&self, buf: B, remote: RemoteToken) -> Read<B> {
        self.engine.qp.read(buf, remote)
    }

    /// Atomic compare-and-swap on the peer's 8-byte value at `remote`.
    ///
    /// # Cancel safety
    ///
    /// As [`AsyncQp::compare_swap`](crate::driver::AsyncQp::compare_swap).
    pub fn compare_swap<B: IoBufMut>(
        &self,
        buf: B,
        remote: RemoteToken,
        compare: u64,
        swap: u64,
    ) -> CompareSwap<B> {
        self.engine.qp.compare_swap(buf, remote, compare, swap)
    }

    /// Atomic fetch-and-add on the peer's 8-byte value at `remote`.
    ///
    /// # Cancel safety
    ///
    /// As [`AsyncQp::fetch_add`](crate::driver::AsyncQp::fetch_add).
    pub fn fetch_add<B: IoBufMut>(&self, buf: B, remote: RemoteToken, add: u64) -> FetchAdd<B> {
        self.engine.qp.fetch_add(buf, remote, add)
    }

    /// A registered buffer pool for this connection's one-sided operations and grants,
    /// created on first use (its buffers are registered in this connection's protection
    /// domain, so they work on this connection only). The connection's own message traffic
    /// uses a separate, private budget: holding every buffer of this pool never stalls
    /// [`send`](Self::send) or [`recv`](Self::recv).
    ///
    /// # Errors
    ///
    /// Registration errors from creating the pool ([`Error::MemlockExhausted`], ...).
    pub fn pool(&self) -> Result<&Pool> {
        if let Some(p) = self.user_pool.get() {
            return Ok(p);
        }
        let pool = Pool::with_pd(&self.engine.pd, self.user_pool_config.clone())?;
        Ok(self.user_pool.get_or_init(|| pool))
    }

    /// Grants the peer `access` to `range` of `buf` through this connection only: the
    /// registration lives in this connection's protection domain, so the token is useless on
    /// any other connection (whatever rkey is presented there). Send the token to the peer
    /// ([`RemoteToken::to_bytes`]); dropping the grant revokes it.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an empty or out-of-range `range`, no rights, or rights
    /// this side did not offer in the handshake ([`ConnectOptions::one_sided`],
    /// [`ConnectOptions::atomics`]): the peer's access would fail and kill the connection, so
    /// the grant is refused here. Registration errors.
    pub fn grant<B: IoBufMut>(
        &self,
        buf: B,
        range: std::ops::Range<usize>,
        access: RemoteAccess,
    ) -> Result<Grant<B>> {
        let offered = self.offered;
        if (access.contains(RemoteAccess::READ) || access.contains(RemoteAccess::WRITE))
            && !offered.contains(Flags::ONE_SIDED)
        {
            return Err(Error::InvalidArgument(format!(
                "a grant of {access:?} on a connection that does not offer one-sided access \
                 (ConnectOptions::one_sided(true) on this side)"
            )));
        }
        if access.contains(RemoteAccess::ATOMIC) && !offered.contains(Flags::ATOMICS) {
            return Err(Error::InvalidArgument(format!(
                "a grant of {access:?} on a connection that does not offer atomics \
                 (ConnectOptions::atomics(true) on this side)"
            )));
        }
        Grant::region(&self.engine.pd, buf, range, access)
    }

    /// The negotiated parameters.
    pub fn params(&self) -> &Negotiated {
        &self.engine.params
    }

    /// Counters of this connection.
    pub fn stats(&self) -> ConnStats {
        self.engine.stats()
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.peer
    }

    /// Turns the connection into a byte stream (`AsyncRead + AsyncWrite`), for codecs.
    pub fn into_stream(self) -> RdmaStream {
        RdmaStream::new(self)
    }

    /// Half-closes the connection: sends end-of-stream (the peer's [`recv`](Self::recv) returns
    /// `Ok(None)` after the messages already sent); this side can still receive until the peer
    /// closes too. Later sends fail.
    ///
    /// # Errors
    ///
    /// The connection's failure.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: end-of-stream is sent at most once.
    pub async fn shutdown(&self) -> Result<()> {
        self.engine.send_close().await
    }

    /// Closes the connection: sends end-of-stream (the peer's [`recv`](Self::recv) returns
    /// `Ok(None)` after the messages already sent), disconnects, and waits until every
    /// outstanding operation has resolved.
    ///
    /// # Errors
    ///
    /// The connection's failure if it had already failed (it is closed anyway).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe in the sense that the connection ends up closed by `Drop` either way.
    pub async fn close(&self) -> Result<()> {
        self.closed
            .store(true, std::sync::atomic::Ordering::Release);
        let res = close_engine(&self.engine, &self.id)
            .instrument(self.span.clone())
            .await;
        self.engine.qp.close().await?;
        res
    }
}

async fn close_engine(engine: &Arc<Engine>, id: &CmId) -> Result<()> {
    let sent = tokio::time::timeout(std::time::Duration::from_secs(10), engine.send_close()).await;
    if let Err(e) = id.disconnect() {
        debug!(error = %e, "rdma_disconnect");
    }
    engine.fail(QpFailure::Closed);
    match sent {
        // The peer closed or left first: the connection is closed all the same.
        Ok(Err(Error::QpFailed(QpFailure::Disconnected | QpFailure::Closed))) => Ok(()),
        Ok(r) => r,
        Err(_) => Err(Error::Timeout {
            what: "sending end-of-stream",
            after: std::time::Duration::from_secs(10),
        }),
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        if self.closed.load(std::sync::atomic::Ordering::Acquire) {
            return;
        }
        let (engine, id) = (self.engine.clone(), self.id.clone());
        let span = self.span.clone();
        // Close in the background; never block the executor here.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(
                async move {
                    if let Err(e) = close_engine(&engine, &id).await {
                        debug!(error = %e, "background close");
                    }
                }
                .instrument(span),
            );
        } else {
            self.engine.fail(QpFailure::Closed);
            let _ = self.id.disconnect();
        }
    }
}

impl fmt::Debug for Connection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Connection")
            .field("peer", &self.peer)
            .field("qpn", &self.engine.qp.qpn())
            .field("params", &self.engine.params)
            .finish_non_exhaustive()
    }
}

/// Watches the connection's CM events: a `DISCONNECTED` fails the connection (every pending
/// and later operation resolves with [`QpFailure::Disconnected`] unless it closed first).
async fn watch_cm(events: AsyncChannel, engine: Arc<Engine>, id: Arc<CmId>) {
    loop {
        match events.next().await {
            Ok(ev) => match ev.kind() {
                CmEventKind::Disconnected => {
                    debug!("peer disconnected");
                    let _ = id.disconnect();
                    engine.fail(QpFailure::Disconnected);
                }
                CmEventKind::TimewaitExit => return,
                CmEventKind::DeviceRemoval => {
                    warn!("device removed");
                    engine.fail(QpFailure::AsyncEvent("RDMA_CM_EVENT_DEVICE_REMOVAL"));
                    return;
                }
                other => debug!(event = %other, "CM event"),
            },
            Err(e) => {
                warn!(error = %e, "CM event channel");
                return;
            }
        }
        if std::sync::Arc::strong_count(&engine) == 1 {
            return;
        }
    }
}
