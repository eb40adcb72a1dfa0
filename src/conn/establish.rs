//! How a message connection comes up: the active side ([`connect`], and the
//! [`Connection::connect`] family) and the passive side ([`accept`], for the listener), each
//! over the raw connection's RDMA CM steps with the handshake in the private data. The parts
//! come from below ([`setup`](super::setup): options, endpoint, receive side;
//! [`raw`](super::raw): the CM steps) and are assembled by [`Connection::start`] and
//! [`Connection::established`]; this file sits above `connection.rs`, which knows none of it.

use std::net::SocketAddr;

use tracing::Instrument;

use super::connection::Connection;
use super::device::Device;
use super::handshake::{self, Params};
use super::observe;
use super::options::ConnectOptions;
use super::raw::{self, RawConnector, RawRequest, reject};
use super::setup::{
    EndpointChoice, negotiate, on_shared_recv, pool_bytes, raw_options, receive_side,
};
use crate::error::{Error, Result};

impl Connection {
    /// Connects to a listener at `addr` with default options. `addr` is anything Tokio's
    /// networking types take: a `SocketAddr`, `"192.0.2.1:7471"`, `("host", 7471)`, a host
    /// name with a port; every address it resolves to is tried in order until one connects.
    ///
    /// # Errors
    ///
    /// [`Error::LookupHost`] if `addr` does not resolve; resolution or connection errors ([`Error::ConnectionRejected`] with the peer's reason,
    /// [`Error::CmEventFailed`] for an unreachable peer, [`Error::Timeout`]), handshake errors
    /// ([`Error::Handshake`]), or verb errors.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future abandons the attempt; the half-made connection is torn down.
    pub async fn connect(
        addr: impl tokio::net::ToSocketAddrs + std::fmt::Debug,
    ) -> Result<Connection> {
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
    pub async fn connect_with(
        addr: impl tokio::net::ToSocketAddrs + std::fmt::Debug,
        opts: ConnectOptions,
    ) -> Result<Connection> {
        super::addr::first_ok(addr, |a| Connection::connect_on(None, a, opts.clone())).await
    }

    /// Connects through `endpoint`, or (`None`) through an endpoint of its own on the device
    /// `addr` resolves to.
    pub(crate) async fn connect_on(
        endpoint: Option<Device>,
        addr: SocketAddr,
        opts: ConnectOptions,
    ) -> Result<Connection> {
        let span = observe::conn_span(Some(addr), "client");
        let timeout = opts.connect_timeout;
        let choice = match endpoint {
            Some(ep) => EndpointChoice::Given(ep),
            None => EndpointChoice::Own,
        };
        let res = match tokio::time::timeout(
            timeout,
            connect(choice, addr, opts, span.clone()).instrument(span.clone()),
        )
        .await
        {
            Ok(r) => r,
            Err(_) => Err(Error::Timeout {
                what: "connection setup",
                after: timeout,
            }),
        };
        if let Err(e) = &res {
            observe::setup_failed(&span, e);
        }
        res
    }
}

/// The active side: resolve, create the queue pair, connect with our handshake, negotiate
/// with the peer's, post receives, then establish (the raw connection's steps, with the
/// handshake in the private data).
///
/// Dropped at any await point (the caller's timeout, or the caller's own future dropped), it
/// frees what it made: the CM id (destroyed: a request already sent is rejected towards the
/// server, whose pending setup then ends), the queue pair, the protection domain and the pool.
pub(crate) async fn connect(
    choice: EndpointChoice,
    addr: SocketAddr,
    opts: ConnectOptions,
    span: tracing::Span,
) -> Result<Connection> {
    // The connection's id, as soon as its endpoint is known (a given one: now).
    let early_id = choice.given().map(|ep| ep.connection_id(&span));
    let srq = choice.shared_recv();
    let opts = match &srq {
        Some(q) => on_shared_recv(&opts, q)?,
        None => opts,
    };
    // Refused before anything is created or sent (e.g. fewer than 2 receive credits).
    opts.params.validate()?;
    let mut raw_opts = raw_options(&opts, opts.connect_timeout)?;
    raw_opts.shared_recv = srq.is_some();
    let local: Params = opts.params;
    let hs = local.encode()?;
    let resolved = raw::resolve(addr, opts.connect_timeout).await?;
    let endpoint = choice.endpoint_for(&resolved.id, &opts)?;
    let id = early_id.unwrap_or_else(|| endpoint.connection_id(&span));
    let connector = RawConnector::on(&endpoint, resolved, raw_opts)?;
    observe::record_qpn(&span, connector.qp().qpn());
    // A bad or incompatible answer: returning drops the reply, which rejects it (the server's
    // setup ends at once).
    let reply = connector.connect(&hs).await?;
    let remote = Params::decode(reply.private_data())?;
    let negotiated = negotiate(&opts, &remote)?;
    // The endpoint's budget, before any pool is made.
    let memory = endpoint.reserve_memory(pool_bytes(&negotiated, &opts, srq.is_some()))?;
    // Receives are posted before the peer learns our credits (before establish).
    let (pool, share) = receive_side(reply.pd(), &local, srq.as_ref())?;
    let starting = Connection::start(
        reply.qp(),
        reply.pd(),
        (pool, share, memory),
        negotiated,
        &opts,
    )?;
    let obs = endpoint.observed(span, id);
    Ok(Connection::established(starting, reply.establish()?, obs))
}

/// The passive side, for one connection `request` (on an event channel of its own): decode
/// and negotiate the client's handshake, prepare the queue pair (INIT, RTR), post receives,
/// accept with our handshake, wait for `ESTABLISHED`, RTS.
///
/// Every failure before the accept is sent rejects the request with the reason; a failure
/// after it (the client rejected our reply, vanished, or the transport gave up) ends here. The
/// caller bounds the whole by the handshake timeout; dropped at any await point it frees
/// everything: the id is destroyed (which rejects or disconnects the client) and the queue
/// pair is flushed and destroyed with its protection domain and pool.
pub(crate) async fn accept(
    request: RawRequest,
    opts: &ConnectOptions,
    choice: &EndpointChoice,
    span: tracing::Span,
) -> Result<Connection> {
    let early_id = choice.given().map(|ep| ep.connection_id(&span));
    let id = request.id();
    let srq = choice.shared_recv();
    let adapted;
    let opts = match &srq {
        Some(q) => {
            adapted = on_shared_recv(opts, q).map_err(|e| reject(id, e))?;
            &adapted
        }
        None => opts,
    };
    let local: Params = opts.params;
    let remote = Params::decode(request.private_data()).map_err(|e| reject(id, e.into()))?;
    let negotiated = negotiate(opts, &remote).map_err(|e| reject(id, e.into()))?;
    if request.conn_param().is_none() {
        return Err(reject(
            id,
            Error::Handshake(handshake::HandshakeError::Missing),
        ));
    }
    let accept_data = local.encode().map_err(|e| reject(id, e.into()))?;
    let mut raw_opts = raw_options(opts, opts.handshake_timeout).map_err(|e| reject(id, e))?;
    raw_opts.shared_recv = srq.is_some();
    let endpoint = choice.endpoint_for(id, opts).map_err(|e| reject(id, e))?;
    let conn_id = early_id.unwrap_or_else(|| endpoint.connection_id(&span));
    // The endpoint's budget, before the queue pair or any pool is made.
    let memory = endpoint
        .reserve_memory(pool_bytes(&negotiated, opts, srq.is_some()))
        .map_err(|e| reject(id, e))?;
    // On failure the request is rejected with the reason.
    let accepting = request.prepare_on(&endpoint, raw_opts)?;
    observe::record_qpn(&span, accepting.qp().qpn());
    let id = accepting.request().id();
    let (pool, share) =
        receive_side(accepting.pd(), &local, srq.as_ref()).map_err(|e| reject(id, e))?;
    let starting = Connection::start(
        accepting.qp(),
        accepting.pd(),
        (pool, share, memory),
        negotiated,
        opts,
    )
    .map_err(|e| reject(id, e))?;
    // From here on the client holds our reply: REJECTED (it refused our handshake or gave up),
    // UNREACHABLE (our reply was never answered) ... end the setup with the event's error;
    // dropping the id then tears the rest down. A client that established, sent, closed and
    // disconnected before ESTABLISHED reached us is handed over with what it sent.
    let raw = accepting.accept(&accept_data).await?;
    let obs = endpoint.observed(span, conn_id);
    Ok(Connection::established(starting, raw, obs))
}
