//! RDMA CM (librdmacm): event channels, communication ids, and the connection-setup steps for
//! a queue pair this crate creates itself.
//!
//! RDMA CM resolves IP addresses to RDMA devices and routes, and runs the InfiniBand CM
//! exchange (REQ/REP/RTU, REJ, DREQ/DREP) that connects two RC queue pairs. Here the queue
//! pair is not created by librdmacm: it is an ordinary [`QueuePair`] (for example
//! [`AsyncQp::verbs`](crate::driver::AsyncQp::verbs) from a [`Driver`](crate::driver::Driver)
//! on [`Context::from_cm_id`]), whose number goes into the connection parameters and whose
//! transitions use the attributes RDMA CM computes ([`CmId::init_qp_attr`]).
//!
//! Every step is a separate, non-blocking call, and events are read without blocking from a
//! non-blocking [`EventChannel`] (register it with `tokio::io::unix::AsyncFd`), so the setup
//! can be driven by any event loop.
//!
//! # Active side
//!
//! | step                                   | event that follows     |
//! |----------------------------------------|------------------------|
//! | [`CmId::resolve_addr`]                 | `ADDR_RESOLVED`        |
//! | [`CmId::resolve_route`]                | `ROUTE_RESOLVED`       |
//! | create the QP on [`Context::from_cm_id`], [`CmId::modify_qp`] to INIT, post receives, [`CmId::connect`] with [`ConnParam::new`]`(&qp)` | `CONNECT_RESPONSE` (the peer's accept private data), or `REJECTED` / `UNREACHABLE` / `CONNECT_ERROR` |
//! | [`CmId::finish_connect`]: RTR, RTS, `rdma_establish` (sends the RTU) | none on this side; the peer gets `ESTABLISHED` |
//!
//! # Passive side
//!
//! | step                                   | event that follows     |
//! |----------------------------------------|------------------------|
//! | [`CmId::bind_addr`], [`CmId::listen`]  | `CONNECT_REQUEST` with a new id ([`CmEvent::take_id`](super::CmEvent::take_id)) and the client's private data |
//! | validate the private data; on failure [`CmId::reject`] | |
//! | create the QP, [`CmId::prepare_accept`] (INIT, RTR), post receives, [`CmId::accept`] | `ESTABLISHED` |
//! | [`CmId::modify_qp`] to RTS             |                        |
//!
//! Either side ends with [`CmId::disconnect`] (the queue pair moves to ERR; both sides get
//! `DISCONNECTED`; the side that receives it calls `disconnect` too).
//!
//! # Examples
//!
//! ```no_run
//! use std::time::Duration;
//! use tokio_rdma::verbs::*;
//!
//! # fn main() -> tokio_rdma::Result<()> {
//! let channel = EventChannel::new()?;
//! let id = CmId::new(&channel)?;
//! id.resolve_addr(None, "192.0.2.1:7471".parse().unwrap(), 2000)?;
//! let next = |kind| -> tokio_rdma::Result<CmEvent> {
//!     channel.wait_event(Duration::from_secs(10))?.expect("timed out").expect(kind)
//! };
//! next(CmEventKind::AddrResolved)?;
//! id.resolve_route(2000)?;
//! next(CmEventKind::RouteResolved)?;
//! let ctx = Context::from_cm_id(&id)?;
//! let pd = ProtectionDomain::new(&ctx)?;
//! let cq = CompletionQueue::new(&ctx, 256, None)?;
//! let qp = QueuePair::new_rc(&pd, &QpInitAttr::new(&cq, &cq))?;
//! id.modify_qp(&qp, QpState::Init)?;
//! // post receives here
//! id.connect(&ConnParam::new(&qp).private_data(b"hello"))?;
//! let reply = next(CmEventKind::ConnectResponse)?;
//! println!("server said {:?}", reply.private_data());
//! id.finish_connect(&qp)?;
//! # Ok(()) }
//! ```

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::ptr::NonNull;
use std::sync::Arc;

use super::cm_addr::{self, RawAddr};
use super::cm_qp::CmQpAttr;
use super::context::Context;
use super::qp::{QpState, QueuePair};
use super::types::AccessFlags;
use crate::error::{Error, InvalidArgument, Result};
use crate::sys;

/// Private data an RC connect request carries on InfiniBand and RoCE (`rdma_connect(3)`).
pub const MAX_CONNECT_PRIVATE_DATA: usize = 56;
/// Private data an accept reply carries on InfiniBand and RoCE (`rdma_accept(3)`).
pub const MAX_ACCEPT_PRIVATE_DATA: usize = 196;
/// Private data a reject carries on InfiniBand and RoCE (the IB CM REJ message).
pub const MAX_REJECT_PRIVATE_DATA: usize = 148;

/// Builds the error of a librdmacm call that returned `rc != 0`. librdmacm returns -1 and sets
/// `errno`; older versions returned `-errno` for a few codes (rdma_cm(7)).
pub(super) fn cm_error(rc: i32, f: impl FnOnce(io::Error) -> Error) -> Error {
    let err = io::Error::last_os_error();
    if rc < -1 {
        f(io::Error::from_raw_os_error(-rc))
    } else {
        f(err)
    }
}

fn check(rc: i32, f: impl FnOnce(io::Error) -> Error) -> Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(cm_error(rc, f))
    }
}

/// Refuses a loopback address up front: no RDMA device owns one. RDMA CM would accept it
/// (binding it, even resolving it) and fail only at `rdma_resolve_route`, with a bare errno.
fn refuse_loopback(addr: SocketAddr, call: &'static str) -> Result<()> {
    if crate::error::is_loopback(addr) {
        return Err(Error::LoopbackAddress { addr, call });
    }
    Ok(())
}

fn clamp_ms(ms: u32) -> i32 {
    i32::try_from(ms).unwrap_or(i32::MAX)
}

/// An RDMA CM event channel: the file descriptor on which the events of its ids arrive. The
/// descriptor is non-blocking, ready for `tokio::io::unix::AsyncFd`: when it is readable, call
/// [`get_event`](Self::get_event) until it returns `Ok(None)`.
///
/// Cheap to clone; destroyed when the last clone and every id on it are gone.
#[derive(Clone)]
pub struct EventChannel {
    inner: Arc<ChannelInner>,
}

struct ChannelInner {
    ch: NonNull<sys::rdma_event_channel>,
}

// SAFETY: rdma_get_cm_event and the id calls are thread-safe in librdmacm (each takes the
// library's locks and issues its own write/read on the descriptor); the pointer is owned.
unsafe impl Send for ChannelInner {}
// SAFETY: see `Send`.
unsafe impl Sync for ChannelInner {}

impl EventChannel {
    /// Creates an event channel and puts its descriptor in non-blocking mode.
    ///
    /// # Errors
    ///
    /// [`Error::CreateEventChannel`] with the errno (`ENODEV`/`ENOSYS` without RDMA CM
    /// support: no `/dev/infiniband/rdma_cm`, `rdma_ucm` not loaded), also if `fcntl` fails.
    pub fn new() -> Result<EventChannel> {
        // SAFETY: no preconditions; the channel is destroyed in `Drop`.
        let ch = unsafe { sys::rdma_create_event_channel() };
        let ch = NonNull::new(ch).ok_or_else(|| Error::last_os(Error::CreateEventChannel))?;
        let channel = EventChannel {
            inner: Arc::new(ChannelInner { ch }),
        };
        set_nonblocking(channel.as_raw_fd()).map_err(Error::CreateEventChannel)?;
        Ok(channel)
    }

    /// Creates an RC communication id (`RDMA_PS_TCP`) on this channel; same as
    /// [`CmId::new`].
    ///
    /// # Errors
    ///
    /// [`Error::CreateCmId`] with the errno.
    pub fn create_id(&self) -> Result<CmId> {
        CmId::new(self)
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::rdma_event_channel {
        self.inner.ch.as_ptr()
    }
}

fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: `fd` is an open descriptor owned by the channel; F_GETFL has no memory effects.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above; O_NONBLOCK only changes the blocking behaviour of reads.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

impl AsRawFd for EventChannel {
    fn as_raw_fd(&self) -> RawFd {
        // SAFETY: the channel is alive while `self` is; `fd` is a plain field set at creation.
        unsafe { (*self.as_ptr()).fd }
    }
}

impl AsFd for EventChannel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the descriptor stays open until the channel is destroyed in `Drop`, which
        // cannot happen while `self` is borrowed.
        unsafe { BorrowedFd::borrow_raw(self.as_raw_fd()) }
    }
}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        // SAFETY: every id on the channel holds a clone of it, so none is alive, and every
        // event read was acknowledged when it was read; destroyed exactly once.
        unsafe { sys::rdma_destroy_event_channel(self.ch.as_ptr()) };
    }
}

impl fmt::Debug for EventChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EventChannel")
            .field("fd", &self.as_raw_fd())
            .finish()
    }
}

/// The identity of a CM id, as carried by its events ([`CmEvent::id`](super::CmEvent::id)). Only meaningful while
/// the id lives: a destroyed id's key may be reused by a later id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CmIdKey(usize);

impl CmIdKey {
    pub(crate) fn from_ptr(id: *mut sys::rdma_cm_id) -> CmIdKey {
        CmIdKey(id as usize)
    }
}

/// An RDMA CM communication id (`rdma_cm_id`) of the reliable-connected port space
/// (`RDMA_PS_TCP`): a listener, or one end of a connection. Destroyed on drop.
///
/// Its events arrive on its [`EventChannel`]; an id that arrived with a `CONNECT_REQUEST`
/// uses the listener's channel. The queue pair of the connection is not attached to the id:
/// it is created by the caller, on [`Context::from_cm_id`].
///
/// Dropping the id destroys it (`rdma_destroy_id`), which tears the connection down if it is
/// still up. The destruction waits, in the kernel, for the id's callbacks and for the
/// acknowledgement of the id's events that were read: every event is acknowledged as it is
/// read ([`EventChannel::get_event`]), so this never waits on this crate. The call may sleep:
/// dropped inside a Tokio runtime, the id is destroyed on the runtime's blocking pool
/// (`spawn_blocking`), so the drop itself returns at once and the destruction follows shortly
/// after; outside a runtime it is destroyed before the drop returns.
pub struct CmId {
    id: NonNull<sys::rdma_cm_id>,
    channel: EventChannel,
}

// SAFETY: librdmacm's id calls are thread-safe (each issues its own command on the channel's
// descriptor; the library locks its id state). The fields this type reads (`verbs`,
// `port_num`, the route addresses) are written by librdmacm while it processes an event of
// this id in `rdma_get_cm_event`, which happens before that event is returned to anyone.
unsafe impl Send for CmId {}
// SAFETY: see `Send`.
unsafe impl Sync for CmId {}

/// Connection parameters for [`CmId::connect`] and [`CmId::accept`] (`struct
/// rdma_conn_param`). Build with [`ConnParam::new`] from the queue pair being connected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnParam<'a> {
    /// Private data for the peer: up to [`MAX_CONNECT_PRIVATE_DATA`] bytes in a connect,
    /// [`MAX_ACCEPT_PRIVATE_DATA`] in an accept. The peer may see it padded with zeros.
    pub private_data: &'a [u8],
    /// RDMA READ / atomic requests the peer may have outstanding at this side (at most the
    /// device's `max_qp_rd_atom`).
    pub responder_resources: u8,
    /// RDMA READ / atomic requests this side may have outstanding at the peer (at most the
    /// device's `max_qp_init_rd_atom`; in an accept, at most the request's
    /// [`initiator_depth`](super::PeerConnParam::initiator_depth)).
    pub initiator_depth: u8,
    /// Whether hardware flow control is available (exchanged, not used for the QP).
    pub flow_control: bool,
    /// Transport retries, 0..=7 (ignored in an accept).
    pub retry_count: u8,
    /// RNR retries the peer should make against this side, 0..=7 (7 = forever).
    pub rnr_retry_count: u8,
    /// Whether the queue pair uses a shared receive queue.
    pub srq: bool,
    /// The number of the queue pair being connected.
    pub qp_num: u32,
}

impl ConnParam<'static> {
    /// Parameters for connecting `qp`: its number, no SRQ, up to 16 outstanding RDMA READ /
    /// atomic requests each way (capped by the device), 7 transport retries, 6 RNR retries
    /// (a receiver that stays not-ready is detected instead of retried forever), no private
    /// data.
    pub fn new(qp: &QueuePair) -> ConnParam<'static> {
        let attr = qp.pd().context().device_attr();
        let cap = |v: u32| u8::try_from(v.min(16)).unwrap_or(16);
        ConnParam {
            private_data: &[],
            responder_resources: cap(attr.max_qp_rd_atom),
            initiator_depth: cap(attr.max_qp_init_rd_atom),
            flow_control: false,
            retry_count: 7,
            rnr_retry_count: 6,
            srq: false,
            qp_num: qp.qpn(),
        }
    }
}

impl<'a> ConnParam<'a> {
    /// The same parameters with `data` as private data.
    pub fn private_data<'b>(self, data: &'b [u8]) -> ConnParam<'b> {
        ConnParam {
            private_data: data,
            responder_resources: self.responder_resources,
            initiator_depth: self.initiator_depth,
            flow_control: self.flow_control,
            retry_count: self.retry_count,
            rnr_retry_count: self.rnr_retry_count,
            srq: self.srq,
            qp_num: self.qp_num,
        }
    }

    /// Adjusts accept parameters to a connection request (`rdma_accept(3)`): the initiator
    /// depth may not exceed the requester's responder resources.
    pub fn answering(mut self, request: &PeerConnParam) -> ConnParam<'a> {
        self.initiator_depth = self.initiator_depth.min(request.initiator_depth);
        self
    }

    fn to_raw(self, what: &'static str, max: usize) -> Result<sys::rdma_conn_param> {
        if self.private_data.len() > max {
            return Err(Error::PrivateDataTooLong {
                what,
                len: self.private_data.len(),
                max,
            });
        }
        if self.retry_count > 7 || self.rnr_retry_count > 7 {
            return Err(Error::InvalidArgument(
                InvalidArgument::ConnParamRetryCount {
                    call: what,
                    retry_count: self.retry_count,
                    rnr_retry_count: self.rnr_retry_count,
                },
            ));
        }
        if self.qp_num > 0xff_ffff {
            return Err(Error::InvalidArgument(InvalidArgument::ConnParamQpNum {
                call: what,
                qp_num: self.qp_num,
            }));
        }
        Ok(sys::rdma_conn_param {
            private_data: if self.private_data.is_empty() {
                std::ptr::null()
            } else {
                self.private_data.as_ptr().cast()
            },
            private_data_len: self.private_data.len() as u8,
            responder_resources: self.responder_resources,
            initiator_depth: self.initiator_depth,
            flow_control: u8::from(self.flow_control),
            retry_count: self.retry_count,
            rnr_retry_count: self.rnr_retry_count,
            srq: u8::from(self.srq),
            qp_num: self.qp_num,
        })
    }
}

impl CmId {
    /// Creates an RC communication id (`rdma_create_id` with `RDMA_PS_TCP`) whose events go
    /// to `channel`.
    ///
    /// # Errors
    ///
    /// [`Error::CreateCmId`] with the errno.
    pub fn new(channel: &EventChannel) -> Result<CmId> {
        let mut id: *mut sys::rdma_cm_id = std::ptr::null_mut();
        // SAFETY: the channel is alive and the id keeps a clone of it; `id` is a valid
        // out-pointer; the id is destroyed in `Drop`.
        let rc = unsafe {
            sys::rdma_create_id(
                channel.as_ptr(),
                &mut id,
                std::ptr::null_mut(),
                sys::RDMA_PS_TCP,
            )
        };
        check(rc, Error::CreateCmId)?;
        let id = NonNull::new(id)
            .ok_or_else(|| Error::CreateCmId(io::Error::other("rdma_create_id returned no id")))?;
        // SAFETY: just created, owned by nobody else.
        Ok(unsafe { CmId::from_raw(id, channel.clone()) })
    }

    /// Wraps an id this crate owns.
    ///
    /// # Safety
    ///
    /// `id` must be a live id on `channel` that nothing else destroys.
    pub(crate) unsafe fn from_raw(id: NonNull<sys::rdma_cm_id>, channel: EventChannel) -> CmId {
        CmId { id, channel }
    }

    /// The key its events carry ([`CmEvent::id`](super::CmEvent::id)).
    pub fn key(&self) -> CmIdKey {
        CmIdKey::from_ptr(self.as_ptr())
    }

    /// The channel its events arrive on.
    pub fn channel(&self) -> &EventChannel {
        &self.channel
    }

    /// Binds to a local address (`rdma_bind_addr`); port 0 picks a free port (read it with
    /// [`local_addr`](Self::local_addr)). A specific IP address also binds the id to that
    /// address's RDMA device.
    ///
    /// # Errors
    ///
    /// [`Error::LoopbackAddress`] for a loopback address (127.0.0.0/8, `::1`), refused before
    /// any call: no RDMA device owns one, and a connection through it would fail later, when
    /// its route is resolved. [`Error::BindAddr`] with the errno (`EADDRINUSE`,
    /// `EADDRNOTAVAIL` for an address without an RDMA device, ...).
    pub fn bind_addr(&self, addr: SocketAddr) -> Result<()> {
        refuse_loopback(addr, "rdma_bind_addr")?;
        let mut raw = RawAddr::new(addr);
        // SAFETY: the id is alive; `raw` is a valid socket address for the call's duration.
        let rc = unsafe { sys::rdma_bind_addr(self.as_ptr(), raw.as_mut_ptr()) };
        check(rc, |source| Error::BindAddr { addr, source })
    }

    /// Listens for connection requests (`rdma_listen`), which arrive as `CONNECT_REQUEST`
    /// events. The id must be bound first.
    ///
    /// # Errors
    ///
    /// [`Error::Listen`] with the errno.
    pub fn listen(&self, backlog: i32) -> Result<()> {
        // SAFETY: the id is alive.
        let rc = unsafe { sys::rdma_listen(self.as_ptr(), backlog) };
        check(rc, Error::Listen)
    }

    /// Starts resolving `dst` (and the optional source `src`) to an RDMA address
    /// (`rdma_resolve_addr`); completes with `ADDR_RESOLVED` or `ADDR_ERROR`, after which
    /// the id is bound to a device ([`Context::from_cm_id`]).
    ///
    /// # Errors
    ///
    /// [`Error::LoopbackAddress`] if `dst` or `src` is a loopback address (refused before any
    /// call, see [`bind_addr`](Self::bind_addr)); [`Error::ResolveAddr`] with the errno if the
    /// resolution cannot start.
    pub fn resolve_addr(
        &self,
        src: Option<SocketAddr>,
        dst: SocketAddr,
        timeout_ms: u32,
    ) -> Result<()> {
        refuse_loopback(dst, "rdma_resolve_addr")?;
        if let Some(src) = src {
            refuse_loopback(src, "rdma_resolve_addr")?;
        }
        let mut src_raw = src.map(RawAddr::new);
        let mut dst_raw = RawAddr::new(dst);
        let src_ptr = src_raw
            .as_mut()
            .map_or(std::ptr::null_mut(), RawAddr::as_mut_ptr);
        // SAFETY: the id is alive; both addresses live until the call returns (librdmacm
        // copies them).
        let rc = unsafe {
            sys::rdma_resolve_addr(
                self.as_ptr(),
                src_ptr,
                dst_raw.as_mut_ptr(),
                clamp_ms(timeout_ms),
            )
        };
        check(rc, |source| Error::ResolveAddr { dst, source })
    }

    /// Starts resolving the route to the resolved address (`rdma_resolve_route`); completes
    /// with `ROUTE_RESOLVED` or `ROUTE_ERROR`.
    ///
    /// # Errors
    ///
    /// [`Error::ResolveRoute`] with the errno.
    pub fn resolve_route(&self, timeout_ms: u32) -> Result<()> {
        // SAFETY: the id is alive.
        let rc = unsafe { sys::rdma_resolve_route(self.as_ptr(), clamp_ms(timeout_ms)) };
        check(rc, Error::ResolveRoute)
    }

    /// Sends the connection request (`rdma_connect`) for the queue pair `param.qp_num`, which
    /// should be in INIT with its receives posted. Completes with `CONNECT_RESPONSE` (then
    /// call [`finish_connect`](Self::finish_connect)), or `REJECTED` / `UNREACHABLE` /
    /// `CONNECT_ERROR`.
    ///
    /// # Errors
    ///
    /// [`Error::PrivateDataTooLong`] beyond [`MAX_CONNECT_PRIVATE_DATA`] bytes,
    /// [`Error::InvalidArgument`] for out-of-range fields, [`Error::CmConnect`] with the errno.
    pub fn connect(&self, param: &ConnParam<'_>) -> Result<()> {
        let mut raw = param.to_raw("rdma_connect", MAX_CONNECT_PRIVATE_DATA)?;
        // SAFETY: the id is alive; `raw` and the private data it points to live until the
        // call returns (librdmacm copies them).
        let rc = unsafe { sys::rdma_connect(self.as_ptr(), &mut raw) };
        check(rc, Error::CmConnect)
    }

    /// Completes an active connection after `CONNECT_RESPONSE` (`rdma_establish`): sends the
    /// ready-to-use message, after which the peer gets `ESTABLISHED`. Move the queue pair to
    /// RTR and RTS first ([`finish_connect`](Self::finish_connect) does all three).
    ///
    /// # Errors
    ///
    /// [`Error::CmEstablish`] with the errno.
    pub fn establish(&self) -> Result<()> {
        // SAFETY: the id is alive and has no librdmacm-created QP (rdma_establish(3)).
        let rc = unsafe { sys::rdma_establish(self.as_ptr()) };
        check(rc, Error::CmEstablish)
    }

    /// Accepts the connection request this id arrived with (`rdma_accept`), for the queue pair
    /// `param.qp_num`, which should be in RTR with its receives posted
    /// ([`prepare_accept`](Self::prepare_accept)). Completes with `ESTABLISHED`, after which
    /// move the queue pair to RTS.
    ///
    /// # Errors
    ///
    /// [`Error::PrivateDataTooLong`] beyond [`MAX_ACCEPT_PRIVATE_DATA`] bytes,
    /// [`Error::InvalidArgument`] for out-of-range fields, [`Error::CmAccept`] with the errno.
    pub fn accept(&self, param: &ConnParam<'_>) -> Result<()> {
        let mut raw = param.to_raw("rdma_accept", MAX_ACCEPT_PRIVATE_DATA)?;
        // SAFETY: as in `connect`.
        let rc = unsafe { sys::rdma_accept(self.as_ptr(), &mut raw) };
        check(rc, Error::CmAccept)
    }

    /// Rejects the connection request this id arrived with (`rdma_reject`), passing
    /// `private_data` (e.g. a reason) to the requester's `REJECTED` event.
    ///
    /// # Errors
    ///
    /// [`Error::PrivateDataTooLong`] beyond [`MAX_REJECT_PRIVATE_DATA`] bytes;
    /// [`Error::CmReject`] with the errno.
    pub fn reject(&self, private_data: &[u8]) -> Result<()> {
        if private_data.len() > MAX_REJECT_PRIVATE_DATA {
            return Err(Error::PrivateDataTooLong {
                what: "rdma_reject",
                len: private_data.len(),
                max: MAX_REJECT_PRIVATE_DATA,
            });
        }
        let ptr = if private_data.is_empty() {
            std::ptr::null()
        } else {
            private_data.as_ptr().cast()
        };
        // SAFETY: the id is alive; the data lives until the call returns (it is copied).
        let rc = unsafe { sys::rdma_reject(self.as_ptr(), ptr, private_data.len() as u8) };
        check(rc, Error::CmReject)
    }

    /// Disconnects (`rdma_disconnect`); both sides then get `DISCONNECTED`. Both sides should
    /// call it: the one that receives `DISCONNECTED` first answers the peer's request by
    /// calling it. The queue pair is not touched (RDMA CM does not own it): move it to ERR
    /// ([`QueuePair::to_error`]) to flush its outstanding work requests.
    ///
    /// # Errors
    ///
    /// [`Error::CmDisconnect`] with the errno (`EINVAL` if not connected).
    pub fn disconnect(&self) -> Result<()> {
        // SAFETY: the id is alive.
        let rc = unsafe { sys::rdma_disconnect(self.as_ptr()) };
        check(rc, Error::CmDisconnect)
    }

    /// Tells RDMA CM that the queue pair saw traffic before `ESTABLISHED` arrived
    /// (`rdma_notify` with `IBV_EVENT_COMM_EST`, on the async event of that name): on the
    /// passive side this completes the connection if the ready-to-use message was lost.
    ///
    /// # Errors
    ///
    /// [`Error::CmNotify`] with the errno.
    pub fn notify_comm_established(&self) -> Result<()> {
        // SAFETY: the id is alive.
        let rc = unsafe { sys::rdma_notify(self.as_ptr(), sys::IBV_EVENT_COMM_EST) };
        check(rc, Error::CmNotify)
    }

    /// Moves the id to another event channel (`rdma_migrate_id`), e.g. an accepted id off the
    /// listener's channel onto a per-connection one. Its pending events move with it.
    ///
    /// # Errors
    ///
    /// [`Error::MigrateId`] with the errno.
    pub fn migrate(&mut self, channel: &EventChannel) -> Result<()> {
        // SAFETY: the id and both channels are alive; every event of the id that was read
        // has been acknowledged.
        let rc = unsafe { sys::rdma_migrate_id(self.as_ptr(), channel.as_ptr()) };
        check(rc, Error::MigrateId)?;
        self.channel = channel.clone();
        Ok(())
    }

    /// Sets the local ACK timeout RDMA CM puts in the RTS attributes
    /// (`RDMA_OPTION_ID_ACK_TIMEOUT`; 4.096 us * 2^`timeout`), instead of the one derived from
    /// the path's packet lifetime (on RoCE that gives 19, about 2 s, measured on rxe).
    /// Call before connecting / accepting.
    ///
    /// # Errors
    ///
    /// [`Error::CmSetOption`] with the errno.
    pub fn set_ack_timeout(&self, timeout: u8) -> Result<()> {
        let mut v = timeout;
        // SAFETY: the id is alive; the option value is one byte that lives for the call.
        let rc = unsafe {
            sys::rdma_set_option(
                self.as_ptr(),
                sys::RDMA_OPTION_ID as i32,
                sys::RDMA_OPTION_ID_ACK_TIMEOUT as i32,
                (&raw mut v).cast(),
                1,
            )
        };
        check(rc, |source| Error::CmSetOption {
            option: "RDMA_OPTION_ID_ACK_TIMEOUT",
            source,
        })
    }

    /// The queue-pair attributes RDMA CM computed for moving this connection's queue pair to
    /// `to` (`rdma_init_qp_attr`): INIT once the id has a device, RTR once the peer's
    /// parameters are known (`CONNECT_REQUEST` on the passive side, `CONNECT_RESPONSE` on the
    /// active side), RTS after that.
    ///
    /// # Errors
    ///
    /// [`Error::InitQpAttr`] with the errno (`EINVAL` when the id is not far enough along).
    pub fn init_qp_attr(&self, to: QpState) -> Result<CmQpAttr> {
        let mut attr = sys::ibv_qp_attr {
            qp_state: to.to_raw(),
            ..Default::default()
        };
        let mut mask: i32 = 0;
        // SAFETY: the id is alive; `attr` (with the requested state set, as the call expects)
        // and `mask` are valid out-parameters.
        let rc = unsafe { sys::rdma_init_qp_attr(self.as_ptr(), &mut attr, &mut mask) };
        check(rc, |source| Error::InitQpAttr { to, source })?;
        Ok(CmQpAttr { attr, mask })
    }

    /// Moves `qp` to `to` with the attributes RDMA CM computed
    /// ([`init_qp_attr`](Self::init_qp_attr) + [`QueuePair::modify_with_attr`]).
    ///
    /// The queue-pair access flags are RDMA CM's choice, and they differ by side: measured on
    /// rxe (Linux 6.1), INIT gets no remote access on the active side but
    /// `REMOTE_WRITE | REMOTE_READ | REMOTE_ATOMIC` on the passive side (when the request has
    /// responder resources), and RTR/RTS do not change them. Use
    /// [`modify_qp_with_access`](Self::modify_qp_with_access) for INIT to choose them.
    ///
    /// # Errors
    ///
    /// [`Error::InitQpAttr`] or [`Error::ModifyQp`].
    pub fn modify_qp(&self, qp: &QueuePair, to: QpState) -> Result<()> {
        qp.modify_with_attr(&self.init_qp_attr(to)?)
    }

    /// Like [`modify_qp`](Self::modify_qp), with the queue-pair access flags set to `access`
    /// (remote operations the peer may direct at this queue pair; memory must grant them
    /// too). Typically used for INIT, so both sides get the same, explicit rights.
    ///
    /// # Errors
    ///
    /// [`Error::InitQpAttr`] or [`Error::ModifyQp`].
    pub fn modify_qp_with_access(
        &self,
        qp: &QueuePair,
        to: QpState,
        access: AccessFlags,
    ) -> Result<()> {
        let mut attr = self.init_qp_attr(to)?;
        attr.set_access(access);
        qp.modify_with_attr(&attr)
    }

    /// Passive side, after `CONNECT_REQUEST`: moves `qp` (in RESET) to INIT and RTR with
    /// RDMA CM's attributes (including its access flags, see [`modify_qp`](Self::modify_qp)).
    /// Post the receives the peer's first messages need, then [`accept`](Self::accept).
    ///
    /// # Errors
    ///
    /// As [`modify_qp`](Self::modify_qp).
    pub fn prepare_accept(&self, qp: &QueuePair) -> Result<()> {
        self.modify_qp(qp, QpState::Init)?;
        self.modify_qp(qp, QpState::Rtr)
    }

    /// Active side, after `CONNECT_RESPONSE`: moves `qp` to RTR and RTS, then
    /// [`establish`](Self::establish)es the connection. The queue pair may send when this
    /// returns.
    ///
    /// # Errors
    ///
    /// As [`modify_qp`](Self::modify_qp), or [`Error::CmEstablish`].
    pub fn finish_connect(&self, qp: &QueuePair) -> Result<()> {
        self.modify_qp(qp, QpState::Rtr)?;
        self.modify_qp(qp, QpState::Rts)?;
        self.establish()
    }

    /// Moves `qp` to RTS with the attributes RDMA CM computes, but with these transport and
    /// RNR retry counts instead of the ones exchanged in the connection request (the passive
    /// side otherwise inherits whatever the peer asked for).
    ///
    /// # Errors
    ///
    /// [`Error::InitQpAttr`] or [`Error::ModifyQp`].
    pub fn modify_qp_rts_with_retries(
        &self,
        qp: &QueuePair,
        retry_cnt: u8,
        rnr_retry: u8,
    ) -> Result<()> {
        let mut attr = self.init_qp_attr(QpState::Rts)?;
        attr.set_retries(retry_cnt, rnr_retry);
        qp.modify_with_attr(&attr)
    }

    /// Whether the id is bound to a device yet.
    pub fn has_device(&self) -> bool {
        self.verbs_ptr().is_some()
    }

    /// Whether the id is bound to `ctx`'s device context (the one
    /// [`Context::from_cm_id`] would wrap).
    pub fn is_on(&self, ctx: &Context) -> bool {
        self.verbs_ptr().is_some_and(|p| p.as_ptr() == ctx.as_ptr())
    }

    /// The device port the id is bound to (0 if none yet).
    pub fn port_num(&self) -> u8 {
        // SAFETY: the id is alive; `port_num` is a plain field (see the `Send` note).
        unsafe { (*self.as_ptr()).port_num }
    }

    /// The local address (after binding or resolving; for a listener bound to port 0, the
    /// chosen port).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        // SAFETY: the id is alive; the pointer addresses its route's source address storage.
        unsafe { cm_addr::from_raw(sys::rdma_get_local_addr(self.as_ptr())) }
    }

    /// The peer address (after resolving, or of an accepted request).
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        // SAFETY: as above, for the destination address.
        unsafe { cm_addr::from_raw(sys::rdma_get_peer_addr(self.as_ptr())) }
    }

    /// The device context librdmacm bound the id to, if any.
    pub(crate) fn verbs_ptr(&self) -> Option<NonNull<sys::ibv_context>> {
        // SAFETY: the id is alive; `verbs` is a plain field (see the `Send` note).
        NonNull::new(unsafe { (*self.as_ptr()).verbs })
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::rdma_cm_id {
        self.id.as_ptr()
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        let doomed = Doomed {
            id: self.id,
            _channel: self.channel.clone(),
        };
        // `rdma_destroy_id` may sleep (a connected id's teardown, the kernel waiting for the
        // id's callbacks): inside a Tokio runtime it runs on the blocking pool, not on the
        // worker thread that dropped the id. The id is unreachable from here on (this handle
        // was its only owner), so nothing uses it while the destruction is pending.
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn_blocking(move || drop(doomed))),
            Err(_) => drop(doomed),
        }
    }
}

/// A CM id on its way to `rdma_destroy_id`, with its channel (which must outlive it).
/// Destroyed on drop: run by the blocking pool, or dropped unrun by a runtime shutting down.
struct Doomed {
    id: NonNull<sys::rdma_cm_id>,
    _channel: EventChannel,
}

// SAFETY: only `rdma_destroy_id` is called on the id, once, from whichever thread drops this;
// librdmacm's id calls are thread-safe (see `CmId`'s `Send`).
unsafe impl Send for Doomed {}

impl Drop for Doomed {
    fn drop(&mut self) {
        // Taken from the `CmId` that owned the id, which is gone. No librdmacm QP is attached
        // (ours are separate objects) and every event read was acknowledged as it was read, so
        // this does not wait on us; the channel outlives the call (its clone is a field,
        // dropped after this body).
        // SAFETY: the id is owned by this value alone and destroyed exactly once, here.
        let rc = unsafe { sys::rdma_destroy_id(self.id.as_ptr()) };
        if rc != 0 {
            tracing::warn!(error = %io::Error::last_os_error(), "rdma_destroy_id failed");
        }
    }
}

impl fmt::Debug for CmId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CmId")
            .field("key", &self.key())
            .field("local_addr", &self.local_addr())
            .field("peer_addr", &self.peer_addr())
            .field("port_num", &self.port_num())
            .finish_non_exhaustive()
    }
}

/// The connection parameters the peer sent (`CONNECT_REQUEST`, `CONNECT_RESPONSE`,
/// `ESTABLISHED`), as reported in the event (`rdma_get_cm_event(3)`, CONN EVENT DATA).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct PeerConnParam {
    /// Responder resources requested of this side: the peer's initiator depth.
    pub responder_resources: u8,
    /// RDMA READ / atomic requests this side may have outstanding at the peer: the peer's
    /// responder resources.
    pub initiator_depth: u8,
    /// Whether the peer provides hardware flow control.
    pub flow_control: bool,
    /// Transport retries the peer asks for (`CONNECT_REQUEST` only).
    pub retry_count: u8,
    /// RNR retries the peer asks for.
    pub rnr_retry_count: u8,
    /// Whether the peer uses a shared receive queue.
    pub srq: bool,
    /// The peer's queue pair number.
    pub qp_num: u32,
}

#[cfg(test)]
mod tests;
