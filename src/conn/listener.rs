//! [`Listener`]: accepts RDMA CM connections, Tokio style.

use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};

use tracing::{Instrument, info_span, warn};

use super::cm_async::AsyncChannel;
use super::connection::Connection;
use super::handshake::{self, Params};
use super::options::ConnectOptions;
use super::setup;
use crate::error::{Error, Result};
use crate::verbs::{CmEvent, CmEventKind, CmId, EventChannel};

/// Most bytes of a reason sent in a reject's private data.
const REJECT_REASON_MAX: usize = 140;

/// Listens for connections on an address.
///
/// A client whose handshake is malformed, truncated, of another version or incompatible is
/// rejected with the reason (its [`Connection::connect`] fails with
/// [`Error::ConnectionRejected`] carrying it) and the listener keeps serving the next one.
///
/// # Examples
///
/// ```no_run
/// use tokio_rdma::conn::Listener;
///
/// # async fn demo() -> tokio_rdma::Result<()> {
/// let listener = Listener::bind("192.0.2.1:7471".parse().unwrap()).await?;
/// loop {
///     let conn = listener.accept().await?;
///     tokio::spawn(async move {
///         while let Ok(Some(msg)) = conn.recv().await {
///             if conn.send(&msg).await.is_err() {
///                 break;
///             }
///         }
///     });
/// }
/// # }
/// ```
pub struct Listener {
    events: AsyncChannel,
    id: CmId,
    opts: ConnectOptions,
    rejected: AtomicU64,
}

impl Listener {
    /// Binds to `addr` (an address of an RDMA device; port 0 picks one) and listens, with
    /// default options.
    ///
    /// # Errors
    ///
    /// CM errors (e.g. the address is not on an RDMA device, or in use).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn bind(addr: SocketAddr) -> Result<Listener> {
        Listener::bind_with(addr, ConnectOptions::default()).await
    }

    /// Binds to `addr` with `opts` for every accepted connection.
    ///
    /// # Errors
    ///
    /// As [`bind`](Self::bind).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn bind_with(addr: SocketAddr, opts: ConnectOptions) -> Result<Listener> {
        opts.params.validate()?;
        let events = AsyncChannel::new(EventChannel::new()?)?;
        let id = events.channel().create_id()?;
        id.bind_addr(addr)?;
        id.listen(128)?;
        Ok(Listener {
            events,
            id,
            opts,
            rejected: AtomicU64::new(0),
        })
    }

    /// The bound address (with the chosen port if bound to port 0).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.id.local_addr()
    }

    /// Connection requests rejected so far (bad handshakes, failed setups).
    pub fn rejected(&self) -> u64 {
        self.rejected.load(Ordering::Relaxed)
    }

    /// Waits for the next client and completes its connection.
    ///
    /// # Errors
    ///
    /// Only errors of the listener itself (its event channel); a failing client is rejected,
    /// logged, counted in [`rejected`](Self::rejected), and the next one is served.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe while a request is being set up: a client being accepted when the
    /// future is dropped gets disconnected.
    pub async fn accept(&self) -> Result<Connection> {
        loop {
            let mut ev = self.events.next().await?;
            if ev.kind() != CmEventKind::ConnectRequest {
                tracing::debug!(event = %ev.kind(), "listener event ignored");
                continue;
            }
            let Some(id) = ev.take_id() else { continue };
            let span = info_span!("conn", peer = ?id.peer_addr(), side = "server");
            match self
                .accept_one(id, &ev, span.clone())
                .instrument(span.clone())
                .await
            {
                Ok(conn) => return Ok(conn),
                Err(e) => {
                    self.rejected.fetch_add(1, Ordering::Relaxed);
                    span.in_scope(|| warn!(error = %e, "connection request refused"));
                }
            }
        }
    }

    async fn accept_one(
        &self,
        mut id: CmId,
        ev: &CmEvent,
        span: tracing::Span,
    ) -> Result<Connection> {
        let local: Params = self.opts.params;
        let remote = match Params::decode(ev.private_data()) {
            Ok(r) => r,
            Err(e) => return Err(reject(&id, e.into())),
        };
        let negotiated = match handshake::negotiate(&local, &remote) {
            Ok(n) => n,
            Err(e) => return Err(reject(&id, e.into())),
        };
        let Some(request) = ev.conn_param().copied() else {
            return Err(reject(
                &id,
                Error::Handshake(handshake::HandshakeError::Missing),
            ));
        };
        // The connection gets its own event channel, so its DISCONNECTED goes to its watcher.
        let events = AsyncChannel::new(EventChannel::new()?)?;
        id.migrate(events.channel())?;
        if let Some(t) = self.opts.ack_timeout {
            id.set_ack_timeout(t)?;
        }
        let prepared = match setup::prepare(&id, &self.opts) {
            Ok(p) => p,
            Err(e) => return Err(reject(&id, e)),
        };
        let accept_data = local.encode()?.to_vec();
        let setup = setup::accept(
            prepared,
            negotiated,
            id,
            events,
            request,
            &accept_data,
            &self.opts,
            span,
        );
        match tokio::time::timeout(self.opts.connect_timeout, setup).await {
            Ok(r) => r,
            Err(_) => Err(Error::Timeout {
                what: "accepting a connection",
                after: self.opts.connect_timeout,
            }),
        }
    }
}

/// Rejects a request with `err`'s text as the reason, and returns `err`.
fn reject(id: &CmId, err: Error) -> Error {
    let mut reason = format!("tokio-rdma: {err}").into_bytes();
    reason.truncate(REJECT_REASON_MAX);
    if let Err(e) = id.reject(&reason) {
        warn!(error = %e, "rdma_reject failed");
    }
    err
}

impl fmt::Debug for Listener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Listener")
            .field("local_addr", &self.local_addr())
            .field("rejected", &self.rejected())
            .finish_non_exhaustive()
    }
}
