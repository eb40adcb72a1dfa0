//! Raw connections: RDMA CM setup with the user's queue-pair capabilities and private data,
//! yielding an [`AsyncQp`] with no framing of the crate's own. This is how tokio-rdma talks to
//! a C peer (`rping`, `rdma_server`, perftest, any verbs program); the message
//! [`Connection`](super::Connection) is built on the same setup, with its handshake in the
//! private data.
//!
//! The steps, each a type:
//!
//! * active side: [`Endpoint::raw_connector`](crate::Endpoint::raw_connector) resolves the
//!   address and route and creates the protection domain and queue pair ([`RawConnector`];
//!   post receives now), [`RawConnector::connect`] sends the request with your private data
//!   and waits for the answer ([`RawReply`], with the peer's private data), and
//!   [`RawReply::establish`] completes it ([`RawConnection`]).
//!   [`Endpoint::connect_raw`](crate::Endpoint::connect_raw) does all three.
//! * passive side: [`Endpoint::listen_raw`](crate::Endpoint::listen_raw) gives a
//!   [`RawListener`]; [`RawListener::next`] gives each [`RawRequest`] (the client's private
//!   data and parameters, on an event channel of its own); [`RawRequest::prepare`] creates the
//!   queue pair ([`RawAccepting`]; post receives now) and [`RawAccepting::accept`] answers
//!   with your private data and waits until the connection is established.
//!
//! See `docs/interop.md` for the recipe against the rdma-core tools.

mod active;
mod passive;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tracing::debug;

use super::cm_async::AsyncChannel;
use crate::conn::device::Device;
use crate::driver::{AsyncQp, QpOptions};
use crate::error::{Error, InvalidArgument, Result};
use crate::verbs::{
    AccessFlags, CmEventKind, CmId, ConnParam, Context, PeerConnParam, ProtectionDomain, QpCaps,
    QpState,
};

pub(crate) use active::resolve;
pub use active::{RawConnector, RawReply};
pub(crate) use passive::listen_on;
pub use passive::{RawAccepting, RawListener, RawRequest};

/// Options of a raw connection: the queue pair's capabilities and driver options, its remote
/// access, and the RDMA CM parameters sent to the peer.
///
/// The defaults: [`QpOptions::default`] with every send signalled and posted on its first poll
/// (so a receive you start is posted before the peer can send); remote READ and WRITE allowed
/// on the queue pair (memory still needs a registration with the rights, whose rkey the peer
/// must know), atomics not; up to 16 RDMA READ / atomic requests outstanding each way (capped
/// by the device); 7 transport retries and RNR retry forever (as librdmacm's examples and
/// perftest use); RDMA CM's ACK timeout; 10 s for each step of the setup.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use tokio_rdma::conn::RawOptions;
/// use tokio_rdma::verbs::AccessFlags;
///
/// let opts = RawOptions::default()
///     .send_queue(16)
///     .recv_queue(4)
///     .sges(1, 1)
///     .access(AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ)
///     .rd_atomic(1, 1)
///     .timeout(Duration::from_secs(5));
/// assert_eq!(opts.qp.caps.max_send_wr, 16);
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RawOptions {
    /// The queue pair: capabilities and driver options.
    pub qp: QpOptions,
    /// Access the queue pair grants the peer (`qp_access_flags`, set at INIT).
    pub access: AccessFlags,
    /// RDMA READ / atomic requests the peer may have outstanding here (`None`: up to 16,
    /// capped by the device's `max_qp_rd_atom`).
    pub responder_resources: Option<u8>,
    /// RDMA READ / atomic requests this side may have outstanding at the peer (`None`: up to
    /// 16, capped by the device; on the passive side also by the request).
    pub initiator_depth: Option<u8>,
    /// Transport retries, 0..=7.
    pub retry_count: u8,
    /// RNR retries, 0..=7 (7: forever).
    pub rnr_retry_count: u8,
    /// Local ACK timeout code (4.096 µs · 2^n, 0..=31); `None` keeps RDMA CM's path-derived value.
    pub ack_timeout: Option<u8>,
    /// The limit for each step of the setup (address, route, the peer's answer, the
    /// established event).
    pub timeout: Duration,
    /// Receive on the endpoint's shared receive queue, in its protection domain (message
    /// connections on an endpoint that has one).
    pub(crate) shared_recv: bool,
}

impl Default for RawOptions {
    fn default() -> RawOptions {
        RawOptions {
            qp: QpOptions {
                signal_every: 1,
                coalesce: false,
                ..QpOptions::default()
            },
            access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE,
            responder_resources: None,
            initiator_depth: None,
            retry_count: 7,
            rnr_retry_count: 7,
            ack_timeout: None,
            timeout: Duration::from_secs(10),
            shared_recv: false,
        }
    }
}

impl RawOptions {
    /// Sets the queue pair's options (capabilities, signalling, coalescing, inline sends).
    pub fn qp_options(mut self, qp: QpOptions) -> Self {
        self.qp = qp;
        self
    }

    /// Sets the queue pair's capabilities.
    pub fn caps(mut self, caps: QpCaps) -> Self {
        self.qp.caps = caps;
        self
    }

    /// Sets the send queue's depth (`max_send_wr`).
    pub fn send_queue(mut self, n: u32) -> Self {
        self.qp.caps.max_send_wr = n;
        self
    }

    /// Sets the receive queue's depth (`max_recv_wr`).
    pub fn recv_queue(mut self, n: u32) -> Self {
        self.qp.caps.max_recv_wr = n;
        self
    }

    /// Sets the scatter/gather entries per send and per receive.
    pub fn sges(mut self, send: u32, recv: u32) -> Self {
        self.qp.caps.max_send_sge = send;
        self.qp.caps.max_recv_sge = recv;
        self
    }

    /// Sets the largest inline send (`max_inline_data`).
    pub fn max_inline(mut self, bytes: u32) -> Self {
        self.qp.caps.max_inline_data = bytes;
        self
    }

    /// Sets the access the queue pair grants the peer.
    pub fn access(mut self, access: AccessFlags) -> Self {
        self.access = access;
        self
    }

    /// Sets the RDMA READ / atomic depths: `responder` requests the peer may have outstanding
    /// here, `initiator` this side may have outstanding there.
    pub fn rd_atomic(mut self, responder: u8, initiator: u8) -> Self {
        self.responder_resources = Some(responder);
        self.initiator_depth = Some(initiator);
        self
    }

    /// Sets the transport retries (0..=7).
    pub fn retry_count(mut self, n: u8) -> Self {
        self.retry_count = n;
        self
    }

    /// Sets the RNR retries (0..=7, 7: forever).
    pub fn rnr_retry_count(mut self, n: u8) -> Self {
        self.rnr_retry_count = n;
        self
    }

    /// Sets the local ACK timeout code (0..=31: 4.096 us x 2^n, 0: no timeout; larger codes are
    /// refused).
    pub fn ack_timeout(mut self, code: Option<u8>) -> Self {
        self.ack_timeout = code;
        self
    }

    /// Sets the limit for each setup step.
    pub fn timeout(mut self, t: Duration) -> Self {
        self.timeout = t;
        self
    }

    /// Checks what can be checked before anything is created.
    pub(crate) fn validate(&self) -> Result<()> {
        check_ack_timeout(self.ack_timeout)?;
        if self.retry_count > 7 || self.rnr_retry_count > 7 {
            return Err(Error::InvalidArgument(InvalidArgument::RawRetryCount {
                retry_count: self.retry_count,
                rnr_retry_count: self.rnr_retry_count,
            }));
        }
        if self.qp.caps.max_send_wr == 0 && self.qp.caps.max_recv_wr == 0 {
            return Err(Error::InvalidArgument(InvalidArgument::RawQpWithoutQueues));
        }
        Ok(())
    }

    /// The connection parameters for `qp`.
    fn conn_param<'a>(&self, qp: &AsyncQp, private_data: &'a [u8]) -> ConnParam<'a> {
        let mut p = ConnParam::new(qp.verbs()).private_data(private_data);
        if let Some(r) = self.responder_resources {
            p.responder_resources = r;
        }
        if let Some(i) = self.initiator_depth {
            p.initiator_depth = i;
        }
        p.retry_count = self.retry_count;
        p.rnr_retry_count = self.rnr_retry_count;
        p
    }
}

/// Refuses a local ACK timeout code above 31: the queue pair's field has 5 bits, and RDMA CM
/// passes a larger code on unchecked (a device truncates it, 32 to 0: no timeout at all).
pub(crate) fn check_ack_timeout(code: Option<u8>) -> Result<()> {
    match code {
        Some(ack_timeout) if ack_timeout > 31 => Err(Error::InvalidArgument(
            InvalidArgument::AckTimeoutOutOfRange { ack_timeout },
        )),
        _ => Ok(()),
    }
}

/// An id, its event channel and the endpoint of its device, before the queue pair exists.
#[derive(Debug)]
pub(crate) struct CmSetup {
    pub(crate) events: AsyncChannel,
    pub(crate) id: CmId,
}

/// Checks that `id` is on `endpoint`'s device.
pub(crate) fn check_device(endpoint: &Device, id: &CmId) -> Result<()> {
    let ctx = Context::from_cm_id(id)?;
    if endpoint.owns(&ctx) {
        Ok(())
    } else {
        Err(Error::InvalidArgument(InvalidArgument::WrongDevice {
            device: ctx.name().to_string(),
            endpoint_device: endpoint.device_name().to_string(),
        }))
    }
}

/// Creates a protection domain and a queue pair on `endpoint` for `id` and moves the queue
/// pair to INIT with `opts.access`.
pub(crate) fn create_qp(
    endpoint: &Device,
    id: &CmId,
    opts: &RawOptions,
) -> Result<(AsyncQp, ProtectionDomain)> {
    check_device(endpoint, id)?;
    if let Some(t) = opts.ack_timeout {
        id.set_ack_timeout(t)?;
    }
    let srq = endpoint.shared_recv().filter(|_| opts.shared_recv);
    let pd = match srq {
        Some(q) => q.pd().clone(),
        None => ProtectionDomain::new(endpoint.context())?,
    };
    let qp = endpoint
        .driver()
        .create_qp_on(&pd, opts.qp, srq.map(|q| q.srq()))?;
    id.modify_qp_with_access(qp.verbs(), QpState::Init, opts.access)?;
    Ok((qp, pd))
}

/// Rejects a connection request with `err`'s text as the reason (`"tokio-rdma: ..."`, at most
/// [`REJECT_REASON_MAX`] bytes), and returns `err`.
pub(crate) fn reject(id: &CmId, err: Error) -> Error {
    reject_with(id, &format!("tokio-rdma: {err}"));
    err
}

/// Rejects a connection request with `reason` in the reject's private data.
pub(crate) fn reject_with(id: &CmId, reason: &str) {
    let mut reason = reason.as_bytes().to_vec();
    reason.truncate(REJECT_REASON_MAX);
    if let Err(e) = id.reject(&reason) {
        tracing::warn!(error = %e, "rdma_reject failed");
    }
}

/// Most bytes of a reason sent in a reject's private data (the transport carries 148).
pub(crate) const REJECT_REASON_MAX: usize = 140;

/// Waits for the next event of `events`, which must be `kind`, within `timeout`.
async fn expect(events: &AsyncChannel, kind: CmEventKind, timeout: Duration) -> Result<()> {
    events.expect(kind, timeout).await.map(drop)
}

/// A connected raw queue pair: RDMA CM established the connection, the queue pair is in RTS,
/// and nothing of the crate's own runs on it. Use [`qp`](Self::qp) for operations and
/// [`pd`](Self::pd) to register memory for them.
///
/// Dropping it destroys the CM id (the peer sees a disconnect) and closes the queue pair in
/// the background (outstanding operations fail with
/// [`QpFailure::Closed`](crate::QpFailure::Closed)); [`disconnect`](Self::disconnect) does it
/// in order and waits.
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
/// let conn = ep
///     .connect_raw("192.0.2.1:7471".parse().unwrap(), RawOptions::default(), b"hello")
///     .await?;
/// let buf = RegisteredBuffer::new(conn.pd(), 16, AccessFlags::LOCAL_WRITE)?;
/// let (res, _buf) = conn.qp().send(buf).await;
/// res?;
/// conn.disconnect().await
/// # }
/// ```
#[derive(Debug)]
pub struct RawConnection {
    qp: AsyncQp,
    pd: ProtectionDomain,
    peer_private_data: Vec<u8>,
    peer_param: Option<PeerConnParam>,
    events: AsyncChannel,
    /// Dropped after the queue pair (fields drop in order): its disconnect comes last.
    id: CmId,
    /// The peer's DISCONNECTED event was seen.
    peer_gone: AtomicBool,
    timeout: Duration,
}

/// A raw connection's parts, for the message connection built on it.
pub(crate) struct RawParts {
    pub(crate) qp: AsyncQp,
    pub(crate) pd: ProtectionDomain,
    pub(crate) id: CmId,
    pub(crate) events: AsyncChannel,
    pub(crate) peer_gone: bool,
}

impl RawConnection {
    fn new(
        setup: CmSetup,
        qp: AsyncQp,
        pd: ProtectionDomain,
        peer: (Vec<u8>, Option<PeerConnParam>),
        peer_gone: bool,
        timeout: Duration,
    ) -> RawConnection {
        RawConnection {
            qp,
            pd,
            peer_private_data: peer.0,
            peer_param: peer.1,
            events: setup.events,
            id: setup.id,
            peer_gone: AtomicBool::new(peer_gone),
            timeout,
        }
    }

    /// The queue pair.
    pub fn qp(&self) -> &AsyncQp {
        &self.qp
    }

    /// The connection's protection domain: register the memory of its operations here.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }

    /// The private data of the peer's request or answer (as the transport delivered it: it
    /// may be padded with zeros).
    pub fn peer_private_data(&self) -> &[u8] {
        &self.peer_private_data
    }

    /// The connection parameters of the peer's request or answer (its queue pair number, its
    /// RDMA READ / atomic depths, retry counts).
    pub fn peer_conn_param(&self) -> Option<&PeerConnParam> {
        self.peer_param.as_ref()
    }

    /// The local address.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.id.local_addr()
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.id.peer_addr()
    }

    /// Resolves when the peer has disconnected (its `DISCONNECTED` event); at once if that
    /// was seen before. Other connection events are skipped.
    ///
    /// # Errors
    ///
    /// [`Error::CmEventFailed`] for a device removal; [`Error::CmChannel`] if the event
    /// channel fails.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: an event is only taken when it is handled.
    pub async fn disconnected(&self) -> Result<()> {
        while !self.peer_gone.load(Ordering::Acquire) {
            let ev = self.events.next().await?;
            match ev.kind() {
                CmEventKind::Disconnected => self.peer_gone.store(true, Ordering::Release),
                CmEventKind::DeviceRemoval => {
                    return ev.expect(CmEventKind::Disconnected).map(drop);
                }
                other => debug!(event = %other, "raw connection event"),
            }
        }
        Ok(())
    }

    /// Disconnects (or answers the peer's disconnect), waits for the `DISCONNECTED` event
    /// (up to the setup's step timeout: a peer that answers disconnects late, such as a C
    /// program that only does so when it exits, holds this up to that long), then closes the
    /// queue pair: outstanding operations resolve, flushed, before this returns.
    ///
    /// Let the side with unacknowledged work disconnect last: a disconnect moves the peer's
    /// queue pair to the error state, and a send of yours that the device has not yet seen
    /// acknowledged then fails (flushed) even if the peer received it.
    ///
    /// # Errors
    ///
    /// [`Error::CmDisconnect`]; [`Error::Timeout`] if no `DISCONNECTED` event came (the queue
    /// pair is closed all the same).
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: dropped half-way, the rest happens in the background as for a dropped
    /// connection.
    pub async fn disconnect(self) -> Result<()> {
        let gone = self.peer_gone.load(Ordering::Acquire);
        let sent = self.id.disconnect();
        let waited = if gone {
            Ok(())
        } else {
            match sent {
                Err(e) => Err(e),
                Ok(()) => match tokio::time::timeout(self.timeout, self.disconnected()).await {
                    Ok(r) => r,
                    Err(_) => Err(Error::Timeout {
                        what: "the DISCONNECTED event",
                        after: self.timeout,
                    }),
                },
            }
        };
        self.qp.close().await?;
        waited
    }

    pub(crate) fn into_parts(self) -> RawParts {
        let peer_gone = self.peer_gone.load(Ordering::Acquire);
        RawParts {
            qp: self.qp,
            pd: self.pd,
            id: self.id,
            events: self.events,
            peer_gone,
        }
    }
}
