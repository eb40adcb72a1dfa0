//! The active side of a raw connection: resolve, create the queue pair, connect, establish.

use std::net::SocketAddr;
use std::time::Duration;

use super::{CmSetup, RawConnection, RawOptions, create_qp, expect};
use crate::conn::cm_async::AsyncChannel;
use crate::conn::device::Device;
use crate::driver::AsyncQp;
use crate::error::{Error, Result};
use crate::verbs::{CmEventKind, EventChannel, PeerConnParam, ProtectionDomain, QpState};

/// Resolves `addr` (address, then route) on a new id with an event channel of its own. Each
/// wait is bounded by `timeout`.
pub(crate) async fn resolve(addr: SocketAddr, timeout: Duration) -> Result<CmSetup> {
    let events = AsyncChannel::new(EventChannel::new()?)?;
    let id = events.channel().create_id()?;
    let ms = u32::try_from(timeout.as_millis())
        .unwrap_or(u32::MAX)
        .max(1000);
    id.resolve_addr(None, addr, ms)?;
    expect(&events, CmEventKind::AddrResolved, timeout).await?;
    id.resolve_route(ms)?;
    expect(&events, CmEventKind::RouteResolved, timeout).await?;
    Ok(CmSetup { events, id })
}

/// A resolved raw connection attempt: the route to the peer is known and the queue pair
/// exists (in INIT), not yet connected. Post the receives the peer's first messages need on
/// [`qp`](Self::qp) ([`Recv::start`](crate::ops::Recv::start)), then
/// [`connect`](Self::connect).
///
/// Dropping it frees the queue pair, the protection domain and the id.
///
/// # Examples
///
/// ```no_run
/// use tokio_rdma::Endpoint;
/// use tokio_rdma::conn::RawOptions;
/// use tokio_rdma::verbs::{AccessFlags, RegisteredBuffer};
///
/// # async fn demo() -> tokio_rdma::Result<()> {
/// let ep = Endpoint::open("rxe0")?;
/// let c = ep
///     .raw_connector("192.0.2.1:7471".parse().unwrap(), RawOptions::default())
///     .await?;
/// let buf = RegisteredBuffer::new(c.pd(), 64, AccessFlags::LOCAL_WRITE)?;
/// let mut first = c.qp().recv(buf);
/// first.start(); // posted before the peer can send
/// let reply = c.connect(b"my protocol v1").await?;
/// assert!(reply.private_data().starts_with(b"ok"));
/// let conn = reply.establish()?;
/// let (res, _buf) = first.await;
/// println!("first message: {} bytes", res?.len);
/// # drop(conn);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct RawConnector {
    qp: AsyncQp,
    pd: ProtectionDomain,
    setup: CmSetup,
    opts: RawOptions,
}

impl RawConnector {
    /// Resolves `addr` and creates the queue pair on `endpoint` (the device `addr` is reached
    /// through must be the endpoint's).
    pub(crate) async fn new(
        endpoint: &Device,
        addr: SocketAddr,
        opts: RawOptions,
    ) -> Result<RawConnector> {
        let setup = resolve(addr, opts.timeout).await?;
        RawConnector::on(endpoint, setup, opts)
    }

    /// Creates the queue pair for the resolved `setup` on `endpoint`.
    pub(crate) fn on(endpoint: &Device, setup: CmSetup, opts: RawOptions) -> Result<RawConnector> {
        opts.validate()?;
        let (qp, pd) = create_qp(endpoint, &setup.id, &opts)?;
        Ok(RawConnector {
            qp,
            pd,
            setup,
            opts,
        })
    }

    /// The queue pair (in INIT: receives may be posted, nothing sent yet).
    pub fn qp(&self) -> &AsyncQp {
        &self.qp
    }

    /// The protection domain of the queue pair.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }

    /// Sends the connection request with `private_data` (at most 56 bytes) and waits for the
    /// peer's answer.
    ///
    /// # Errors
    ///
    /// [`Error::PrivateDataTooLong`]; [`Error::ConnectionRejected`] with the peer's reason
    /// (its private data) if it rejected the request; [`Error::CmEventFailed`] if it is
    /// unreachable; [`Error::Timeout`] after the options' step timeout.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future abandons the attempt: the id is destroyed (an answer that arrives
    /// is rejected) and the queue pair freed.
    pub async fn connect(self, private_data: &[u8]) -> Result<RawReply> {
        let param = self.opts.conn_param(&self.qp, private_data);
        self.setup.id.connect(&param)?;
        let ev = tokio::time::timeout(self.opts.timeout, self.setup.events.next())
            .await
            .map_err(|_| Error::Timeout {
                what: CmEventKind::ConnectResponse.name(),
                after: self.opts.timeout,
            })??
            .expect(CmEventKind::ConnectResponse)?;
        Ok(RawReply {
            private_data: ev.private_data().to_vec(),
            param: ev.conn_param().copied(),
            connector: self,
        })
    }
}

/// The peer accepted a raw connection request: its private data is here, the connection is
/// not established yet. [`establish`](Self::establish) it, or drop it to refuse the answer
/// (the peer's accepted connection then fails).
///
/// # Examples
///
/// See [`RawConnector`].
#[derive(Debug)]
pub struct RawReply {
    connector: RawConnector,
    private_data: Vec<u8>,
    param: Option<PeerConnParam>,
}

impl RawReply {
    /// The private data of the peer's answer (it may be padded with zeros).
    pub fn private_data(&self) -> &[u8] {
        &self.private_data
    }

    /// The connection parameters of the peer's answer.
    pub fn conn_param(&self) -> Option<&PeerConnParam> {
        self.param.as_ref()
    }

    /// The queue pair (receives may still be posted before the connection is established).
    pub fn qp(&self) -> &AsyncQp {
        &self.connector.qp
    }

    /// The protection domain of the queue pair.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.connector.pd
    }

    /// Moves the queue pair to RTR and RTS (with the options' retry counts) and establishes
    /// the connection: the peer may send from now on.
    ///
    /// # Errors
    ///
    /// [`Error::ModifyQp`], [`Error::InitQpAttr`], [`Error::CmEstablish`].
    pub fn establish(self) -> Result<RawConnection> {
        let RawConnector {
            qp,
            pd,
            setup,
            opts,
        } = self.connector;
        let id = &setup.id;
        id.modify_qp(qp.verbs(), QpState::Rtr)?;
        id.modify_qp_rts_with_retries(qp.verbs(), opts.retry_count, opts.rnr_retry_count)?;
        id.establish()?;
        Ok(RawConnection::new(
            setup,
            qp,
            pd,
            (self.private_data, self.param),
            false,
            opts.timeout,
        ))
    }
}
