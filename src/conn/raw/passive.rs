//! The passive side of a raw connection: listen, take a request, create the queue pair,
//! accept.

use std::net::SocketAddr;

use tracing::{debug, warn};

use super::{CmSetup, RawConnection, RawOptions, create_qp, reject};
use crate::conn::cm_async::AsyncChannel;
use crate::conn::device::Device;
use crate::driver::AsyncQp;
use crate::error::{Error, InvalidArgument, Result};
use crate::verbs::{CmEventKind, CmId, EventChannel, PeerConnParam, ProtectionDomain, QpState};

/// Listens for raw connection requests on an address: each [`next`](Self::next) gives one
/// request, on an event channel of its own, for you to accept or reject. Nothing is decoded:
/// the private data is the client's, whatever protocol it speaks.
///
/// Dropping the listener stops listening; requests already taken live on.
///
/// # Examples
///
/// ```no_run
/// use tokio_rdma::Endpoint;
/// use tokio_rdma::conn::RawOptions;
///
/// # async fn demo() -> tokio_rdma::Result<()> {
/// let ep = Endpoint::open("rxe0")?;
/// let listener = ep.listen_raw("192.0.2.1:7471".parse().unwrap(), 16)?;
/// loop {
///     let req = listener.next().await?;
///     if !req.private_data().starts_with(b"my protocol") {
///         req.reject(b"unknown protocol")?;
///         continue;
///     }
///     let accepting = req.prepare(RawOptions::default())?;
///     // post receives on accepting.qp() here
///     let conn = accepting.accept(b"ok").await?;
///     tokio::spawn(async move { conn.disconnected().await });
/// }
/// # }
/// ```
#[derive(Debug)]
pub struct RawListener {
    events: AsyncChannel,
    id: CmId,
    /// Where accepted queue pairs go (`None`: the message listener chooses per request).
    endpoint: Option<Device>,
}

/// Binds `addr` and listens with `backlog`, for requests accepted on `endpoint`.
pub(crate) fn listen_on(
    endpoint: Option<Device>,
    addr: SocketAddr,
    backlog: u32,
) -> Result<RawListener> {
    let events = AsyncChannel::new(EventChannel::new()?)?;
    let id = events.channel().create_id()?;
    id.bind_addr(addr)?;
    id.listen(i32::try_from(backlog).unwrap_or(i32::MAX))?;
    Ok(RawListener {
        events,
        id,
        endpoint,
    })
}

impl RawListener {
    /// The bound address (with the chosen port if bound to port 0).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.id.local_addr()
    }

    /// The next connection request. A request whose id cannot get an event channel of its
    /// own is rejected and logged, and the next one is awaited.
    ///
    /// # Errors
    ///
    /// [`Error::CmEventFailed`] if the device was removed; [`Error::CmChannel`] if the
    /// listener's event channel fails. Both end the listener.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a request is only taken from the channel when it is returned.
    pub async fn next(&self) -> Result<RawRequest> {
        loop {
            let mut ev = self.events.next().await?;
            match ev.kind() {
                CmEventKind::ConnectRequest => {}
                CmEventKind::DeviceRemoval => {
                    return Err(ev.error().unwrap_or(Error::CmEventFailed {
                        event: ev.name(),
                        status: ev.status(),
                        source: None,
                    }));
                }
                other => {
                    debug!(event = %other, "listener event ignored");
                    continue;
                }
            }
            let Some(mut id) = ev.take_id() else {
                continue;
            };
            // Every later event of the request's id goes to a channel of its own, so a
            // request that is being set up never waits on this listener.
            let events = EventChannel::new().and_then(|ch| {
                id.migrate(&ch)?;
                AsyncChannel::new(ch)
            });
            match events {
                Ok(events) => {
                    return Ok(RawRequest {
                        private_data: ev.private_data().to_vec(),
                        param: ev.conn_param().copied(),
                        setup: CmSetup { events, id },
                        endpoint: self.endpoint.clone(),
                    });
                }
                Err(e) => {
                    warn!(peer = ?id.peer_addr(), error = %e, "connection request refused");
                    if let Err(e) = id.reject(b"") {
                        warn!(error = %e, "rdma_reject failed");
                    }
                }
            }
        }
    }
}

/// A connection request: the client's private data and parameters. Accept it
/// ([`prepare`](Self::prepare), then [`RawAccepting::accept`]; or [`accept`](Self::accept)
/// when no receive must be posted first) or [`reject`](Self::reject) it. Dropping it rejects
/// it.
///
/// # Examples
///
/// See [`RawListener`].
#[derive(Debug)]
pub struct RawRequest {
    setup: CmSetup,
    private_data: Vec<u8>,
    param: Option<PeerConnParam>,
    endpoint: Option<Device>,
}

impl RawRequest {
    /// The private data of the request (it may be padded with zeros: an RC request carries 56
    /// bytes).
    pub fn private_data(&self) -> &[u8] {
        &self.private_data
    }

    /// The client's connection parameters (READ/atomic depths, retry counts, its QP number).
    pub fn conn_param(&self) -> Option<&PeerConnParam> {
        self.param.as_ref()
    }

    /// The client's address.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.setup.id.peer_addr()
    }

    /// The local address the request arrived on.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.setup.id.local_addr()
    }

    /// Rejects the request with `private_data` (the client's connect fails with
    /// [`Error::ConnectionRejected`] carrying it; at most 148 bytes).
    ///
    /// # Errors
    ///
    /// [`Error::CmReject`], [`Error::PrivateDataTooLong`].
    pub fn reject(self, private_data: &[u8]) -> Result<()> {
        self.setup.id.reject(private_data)
    }

    /// Creates the queue pair on the listener's endpoint and moves it to INIT and RTR with
    /// the request's parameters, ready for receives to be posted before
    /// [`RawAccepting::accept`].
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for options that cannot apply, or a request that arrived on
    /// another device than the endpoint's; verb errors. The request is then rejected with
    /// the error's text as the reason (`"tokio-rdma: ..."`).
    pub fn prepare(self, opts: RawOptions) -> Result<RawAccepting> {
        let endpoint = self
            .endpoint
            .clone()
            .ok_or(Error::InvalidArgument(InvalidArgument::NoRawEndpoint))?;
        self.prepare_on(&endpoint, opts)
    }

    /// [`prepare`](Self::prepare) on `endpoint`.
    pub(crate) fn prepare_on(self, endpoint: &Device, opts: RawOptions) -> Result<RawAccepting> {
        let id = &self.setup.id;
        let made = opts.validate().and_then(|()| {
            let (qp, pd) = create_qp(endpoint, id, &opts)?;
            id.modify_qp(qp.verbs(), QpState::Rtr)?;
            Ok((qp, pd))
        });
        let (qp, pd) = made.map_err(|e| reject(id, e))?;
        Ok(RawAccepting {
            qp,
            pd,
            request: self,
            opts,
        })
    }

    /// [`prepare`](Self::prepare) and [`RawAccepting::accept`] in one: for protocols whose
    /// client does not send before it hears from the server.
    ///
    /// # Errors
    ///
    /// As the two steps.
    ///
    /// # Cancel safety
    ///
    /// As [`RawAccepting::accept`].
    pub async fn accept(self, opts: RawOptions, private_data: &[u8]) -> Result<RawConnection> {
        self.prepare(opts)?.accept(private_data).await
    }

    /// The id, to reject with a reason.
    pub(crate) fn id(&self) -> &CmId {
        &self.setup.id
    }
}

/// A request whose queue pair is ready (INIT, RTR): post the receives the client's first
/// messages need on [`qp`](Self::qp), then [`accept`](Self::accept). Dropping it rejects the
/// request and frees the queue pair.
///
/// # Examples
///
/// See [`RawListener`].
#[derive(Debug)]
pub struct RawAccepting {
    qp: AsyncQp,
    pd: ProtectionDomain,
    request: RawRequest,
    opts: RawOptions,
}

impl RawAccepting {
    /// The queue pair.
    pub fn qp(&self) -> &AsyncQp {
        &self.qp
    }

    /// The protection domain of the queue pair.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }

    /// The request being accepted.
    pub fn request(&self) -> &RawRequest {
        &self.request
    }

    /// Rejects the request after all, with `private_data`.
    ///
    /// # Errors
    ///
    /// As [`RawRequest::reject`].
    pub fn reject(self, private_data: &[u8]) -> Result<()> {
        self.request.setup.id.reject(private_data)
    }

    /// Accepts with `private_data` (at most 196 bytes), waits for the connection to be
    /// established (the client's confirmation) and moves the queue pair to RTS (with the
    /// options' retry counts).
    ///
    /// A client that established, sent and disconnected before the confirmation reached us is
    /// still handed over: its messages are in the receive queue, and
    /// [`RawConnection::disconnected`] resolves at once.
    ///
    /// # Errors
    ///
    /// [`Error::CmAccept`], [`Error::PrivateDataTooLong`]; [`Error::CmEventFailed`] or
    /// [`Error::ConnectionRejected`] if the client gave up or refused the answer;
    /// [`Error::Timeout`] after the options' step timeout.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future abandons the connection: the id is destroyed (the client sees a
    /// reject or a disconnect) and the queue pair closed.
    pub async fn accept(self, private_data: &[u8]) -> Result<RawConnection> {
        let RawAccepting {
            qp,
            pd,
            request,
            opts,
        } = self;
        let mut param = opts.conn_param(&qp, private_data);
        if let Some(req) = &request.param {
            param = param.answering(req);
        }
        let setup = request.setup;
        setup.id.accept(&param)?;
        let ev = tokio::time::timeout(opts.timeout, setup.events.next())
            .await
            .map_err(|_| Error::Timeout {
                what: CmEventKind::Established.name(),
                after: opts.timeout,
            })??;
        let peer_gone = ev.kind() == CmEventKind::Disconnected;
        if peer_gone {
            debug!("the client disconnected before ESTABLISHED arrived");
        } else {
            ev.expect(CmEventKind::Established)?;
            setup.id.modify_qp_rts_with_retries(
                qp.verbs(),
                opts.retry_count,
                opts.rnr_retry_count,
            )?;
        }
        Ok(RawConnection::new(
            setup,
            qp,
            pd,
            (request.private_data, request.param),
            peer_gone,
            opts.timeout,
        ))
    }
}
