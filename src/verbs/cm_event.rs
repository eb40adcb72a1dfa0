//! RDMA CM events (`struct rdma_cm_event`), copied out into an owned value and acknowledged
//! as they are read.

use std::ffi::CStr;
use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::time::{Duration, Instant};

use super::cm::{CmId, CmIdKey, EventChannel, PeerConnParam, cm_error};
use super::cm_addr;
use crate::error::{Error, Result};
use crate::sys;

macro_rules! cm_event_kinds {
    ($( $variant:ident = $c:ident, $doc:literal; )*) => {
        /// The type of an RDMA CM event (`enum rdma_cm_event_type`).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum CmEventKind {
            $( #[doc = $doc] $variant, )*
            /// A value this crate does not know.
            Unknown(u32),
        }

        impl CmEventKind {
            /// Converts the raw `rdma_cm_event_type`.
            pub fn from_raw(raw: u32) -> CmEventKind {
                match raw {
                    $( x if x == sys::$c => CmEventKind::$variant, )*
                    other => CmEventKind::Unknown(other),
                }
            }

            /// The raw `rdma_cm_event_type`.
            pub fn to_raw(self) -> u32 {
                match self {
                    $( CmEventKind::$variant => sys::$c, )*
                    CmEventKind::Unknown(raw) => raw,
                }
            }
        }
    };
}

cm_event_kinds! {
    AddrResolved = RDMA_CM_EVENT_ADDR_RESOLVED, "Address resolution (`rdma_resolve_addr`) succeeded.";
    AddrError = RDMA_CM_EVENT_ADDR_ERROR, "Address resolution failed.";
    RouteResolved = RDMA_CM_EVENT_ROUTE_RESOLVED, "Route resolution (`rdma_resolve_route`) succeeded.";
    RouteError = RDMA_CM_EVENT_ROUTE_ERROR, "Route resolution failed.";
    ConnectRequest = RDMA_CM_EVENT_CONNECT_REQUEST, "A connection request on a listener; carries a new id.";
    ConnectResponse = RDMA_CM_EVENT_CONNECT_RESPONSE, "The peer accepted (active side, queue pair managed by the caller).";
    ConnectError = RDMA_CM_EVENT_CONNECT_ERROR, "Establishing the connection failed.";
    Unreachable = RDMA_CM_EVENT_UNREACHABLE, "The peer is unreachable or did not respond.";
    Rejected = RDMA_CM_EVENT_REJECTED, "The peer rejected the request.";
    Established = RDMA_CM_EVENT_ESTABLISHED, "The connection is established.";
    Disconnected = RDMA_CM_EVENT_DISCONNECTED, "The connection was disconnected.";
    DeviceRemoval = RDMA_CM_EVENT_DEVICE_REMOVAL, "The id's device was removed; destroy the id.";
    MulticastJoin = RDMA_CM_EVENT_MULTICAST_JOIN, "A multicast join completed.";
    MulticastError = RDMA_CM_EVENT_MULTICAST_ERROR, "A multicast group failed.";
    AddrChange = RDMA_CM_EVENT_ADDR_CHANGE, "The network device behind the id changed its address.";
    TimewaitExit = RDMA_CM_EVENT_TIMEWAIT_EXIT, "The disconnected queue pair left its timewait state.";
}

impl CmEventKind {
    /// The event name as `rdma_event_str` prints it, e.g. `"RDMA_CM_EVENT_ESTABLISHED"`.
    pub fn name(self) -> &'static str {
        // SAFETY: rdma_event_str returns a pointer to a static NUL-terminated string for any
        // value (an "unknown" string for values it does not know).
        let s = unsafe { CStr::from_ptr(sys::rdma_event_str(self.to_raw())) };
        s.to_str().unwrap_or("RDMA_CM_EVENT_?")
    }

    /// Whether the event reports a failure of the operation it completes.
    pub fn is_error(self) -> bool {
        matches!(
            self,
            CmEventKind::AddrError
                | CmEventKind::RouteError
                | CmEventKind::ConnectError
                | CmEventKind::Unreachable
                | CmEventKind::Rejected
                | CmEventKind::DeviceRemoval
                | CmEventKind::MulticastError
        )
    }

    /// Whether the event carries connection parameters and private data from the peer.
    fn carries_conn(self) -> bool {
        matches!(
            self,
            CmEventKind::ConnectRequest
                | CmEventKind::ConnectResponse
                | CmEventKind::Established
                | CmEventKind::Rejected
        )
    }
}

impl fmt::Display for CmEventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One RDMA CM event, copied out of librdmacm's event and already acknowledged
/// (`rdma_ack_cm_event`), so it never holds up the destruction of a CM id.
///
/// A `CONNECT_REQUEST` carries the new [`CmId`] of the incoming connection: take it with
/// [`take_id`](Self::take_id) to accept or reject it. If the event is dropped with the id
/// still inside, the id is destroyed, which refuses the request.
pub struct CmEvent {
    kind: CmEventKind,
    status: i32,
    id: CmIdKey,
    listen_id: Option<CmIdKey>,
    private_data: Vec<u8>,
    conn: Option<PeerConnParam>,
    local_addr: Option<SocketAddr>,
    peer_addr: Option<SocketAddr>,
    new_id: Option<CmId>,
}

impl CmEvent {
    /// Copies an event out of librdmacm's structure. The caller acknowledges it afterwards.
    ///
    /// # Safety
    ///
    /// `ev` must be an event just returned by `rdma_get_cm_event` on `channel` and not yet
    /// acknowledged, for an id of the `RDMA_PS_TCP` port space. For a `CONNECT_REQUEST`,
    /// ownership of `ev.id` moves into the returned event.
    pub(crate) unsafe fn copy_from(ev: &sys::rdma_cm_event, channel: &EventChannel) -> CmEvent {
        let kind = CmEventKind::from_raw(ev.event);
        let (mut private_data, mut conn) = (Vec::new(), None);
        if kind.carries_conn() {
            // SAFETY: for RDMA_PS_TCP ids librdmacm fills the `conn` member of the union
            // (plain integers and a pointer).
            let c = unsafe { ev.param.conn };
            if !c.private_data.is_null() && c.private_data_len > 0 {
                // SAFETY: librdmacm points `private_data` at `private_data_len` bytes that
                // live until the event is acknowledged, which happens after this copy.
                private_data = unsafe {
                    std::slice::from_raw_parts(
                        c.private_data.cast::<u8>(),
                        usize::from(c.private_data_len),
                    )
                }
                .to_vec();
            }
            if kind != CmEventKind::Rejected {
                conn = Some(PeerConnParam {
                    responder_resources: c.responder_resources,
                    initiator_depth: c.initiator_depth,
                    flow_control: c.flow_control != 0,
                    retry_count: c.retry_count,
                    rnr_retry_count: c.rnr_retry_count,
                    srq: c.srq != 0,
                    qp_num: c.qp_num,
                });
            }
        }
        let (local_addr, peer_addr) = if ev.id.is_null() {
            (None, None)
        } else {
            // SAFETY: The id is alive (ours, whose destruction waits for this event's ack, or the new
            // id of a request); the pointers address its route's sockaddr_storage fields.
            unsafe {
                (
                    cm_addr::from_raw(sys::rdma_get_local_addr(ev.id)),
                    cm_addr::from_raw(sys::rdma_get_peer_addr(ev.id)),
                )
            }
        };
        let new_id = if kind == CmEventKind::ConnectRequest {
            // SAFETY: a CONNECT_REQUEST's id is a new id on this channel that nobody else owns
            // (rdma_get_cm_event(3)); the caller hands its ownership to us.
            std::ptr::NonNull::new(ev.id).map(|id| unsafe { CmId::from_raw(id, channel.clone()) })
        } else {
            None
        };
        CmEvent {
            kind,
            status: ev.status,
            id: CmIdKey::from_ptr(ev.id),
            listen_id: (!ev.listen_id.is_null()).then(|| CmIdKey::from_ptr(ev.listen_id)),
            private_data,
            conn,
            local_addr,
            peer_addr,
            new_id,
        }
    }

    /// The event type.
    pub fn kind(&self) -> CmEventKind {
        self.kind
    }

    /// The event name as `rdma_event_str` prints it.
    pub fn name(&self) -> &'static str {
        self.kind.name()
    }

    /// The status: 0 on success, else a negative errno or a transport-specific value (for
    /// `REJECTED` on InfiniBand/RoCE, the IB CM reject reason).
    pub fn status(&self) -> i32 {
        self.status
    }

    /// The id the event is for (for a `CONNECT_REQUEST`, the new id). Compare with
    /// [`CmId::key`] to route events of a shared channel.
    pub fn id(&self) -> CmIdKey {
        self.id
    }

    /// Whether the event is for `id`.
    pub fn is_for(&self, id: &CmId) -> bool {
        self.id == id.key()
    }

    /// For a `CONNECT_REQUEST`, the listening id that received it.
    pub fn listen_id(&self) -> Option<CmIdKey> {
        self.listen_id
    }

    /// The private data the peer sent with `rdma_connect` (`CONNECT_REQUEST`), `rdma_accept`
    /// (`CONNECT_RESPONSE`, `ESTABLISHED`) or `rdma_reject` (`REJECTED`). The transport may
    /// pad it with zeros beyond what the peer sent (InfiniBand/RoCE: 56 bytes for a request,
    /// 196 for an accept, 148 for a reject). Empty if none.
    pub fn private_data(&self) -> &[u8] {
        &self.private_data
    }

    /// The peer's connection parameters, for `CONNECT_REQUEST`, `CONNECT_RESPONSE` and
    /// `ESTABLISHED`.
    pub fn conn_param(&self) -> Option<&PeerConnParam> {
        self.conn.as_ref()
    }

    /// The local address of the event's id, when it has one.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.local_addr
    }

    /// The peer address of the event's id, when it has one (for a `CONNECT_REQUEST`, the
    /// requester's address).
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.peer_addr
    }

    /// Takes the new id of a `CONNECT_REQUEST`; `None` for other events or once taken. The
    /// id belongs to the listener's channel: its later events (`ESTABLISHED`,
    /// `DISCONNECTED`) arrive there unless it is [migrated](CmId::migrate).
    pub fn take_id(&mut self) -> Option<CmId> {
        self.new_id.take()
    }

    /// The error this event reports, if it reports one: [`Error::ConnectionRejected`] for
    /// `REJECTED` (with the reject private data), [`Error::CmEventFailed`] for the other
    /// error events or a non-zero status.
    pub fn error(&self) -> Option<Error> {
        if self.kind == CmEventKind::Rejected {
            return Some(Error::ConnectionRejected {
                status: self.status,
                reason: reject_reason(self.status),
                private_data: self.private_data.clone(),
            });
        }
        if self.kind.is_error() || self.status != 0 {
            return Some(Error::CmEventFailed {
                event: self.name(),
                status: self.status,
                source: (self.status < 0).then(|| std::io::Error::from_raw_os_error(-self.status)),
            });
        }
        None
    }

    /// Checks that this is a successful event of kind `expected`.
    ///
    /// # Errors
    ///
    /// The event's own [`error`](Self::error) if it reports one, else
    /// [`Error::UnexpectedCmEvent`].
    pub fn expect(self, expected: CmEventKind) -> Result<CmEvent> {
        if let Some(e) = self.error() {
            return Err(e);
        }
        if self.kind != expected {
            return Err(Error::UnexpectedCmEvent {
                expected: expected.name(),
                got: self.name(),
            });
        }
        Ok(self)
    }
}

impl fmt::Debug for CmEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CmEvent")
            .field("kind", &self.name())
            .field("status", &self.status)
            .field("id", &self.id)
            .field("listen_id", &self.listen_id)
            .field("private_data_len", &self.private_data.len())
            .field("conn", &self.conn)
            .field("local_addr", &self.local_addr)
            .field("peer_addr", &self.peer_addr)
            .field("new_id", &self.new_id.is_some())
            .finish()
    }
}

/// A description of the reject reason in a `REJECTED` event's status: the InfiniBand CM
/// reject reason codes (IBTA spec, REJ message) used on InfiniBand and RoCE, or a negative
/// errno (iWARP).
pub fn reject_reason(status: i32) -> &'static str {
    match status {
        1 => "no QP available at the peer",
        2 => "no EE context available at the peer",
        3 => "no resources at the peer",
        4 => "timeout",
        5 => "unsupported request",
        6 => "invalid communication ID",
        7 => "invalid communication instance",
        8 => "invalid service ID: nothing listens on that address and port",
        9 => "invalid transport type",
        10 => "stale connection",
        12 => "invalid GID",
        13 => "invalid LID",
        14 => "invalid service level",
        15 => "invalid traffic class",
        16 => "invalid hop limit",
        17 => "invalid packet rate",
        24 => "port redirection",
        26 => "invalid MTU",
        27 => "insufficient responder resources",
        28 => "rejected by the peer application",
        29 => "invalid RNR retry count",
        30 => "duplicate local communication ID",
        31 => "invalid class version",
        32 => "invalid flow label",
        s if s == -libc::ECONNREFUSED => "connection refused",
        s if s < 0 => "transport error",
        _ => "unknown reject reason",
    }
}

// Here, not in cm.rs: the channel's events are made here, and the channel does not know them.
impl EventChannel {
    /// Reads the next event without blocking: `Ok(None)` if none is pending. The event is
    /// copied out and acknowledged (`rdma_ack_cm_event`) before it is returned.
    ///
    /// # Errors
    ///
    /// [`Error::GetCmEvent`] with the errno.
    pub fn get_event(&self) -> Result<Option<CmEvent>> {
        let mut ev: *mut sys::rdma_cm_event = std::ptr::null_mut();
        // SAFETY: the channel is alive and `ev` is a valid out-pointer. The descriptor is
        // non-blocking, so the call fails with EAGAIN instead of blocking.
        let rc = unsafe { sys::rdma_get_cm_event(self.as_ptr(), &mut ev) };
        if rc != 0 {
            let err = cm_error(rc, Error::GetCmEvent);
            if err.raw_os_error() == Some(libc::EAGAIN) {
                return Ok(None);
            }
            return Err(err);
        }
        let Some(ev) = NonNull::new(ev) else {
            return Err(Error::GetCmEvent(io::Error::other(
                "rdma_get_cm_event returned no event",
            )));
        };
        // SAFETY: `ev` was just returned for this channel and is not acknowledged yet; all our
        // ids use RDMA_PS_TCP. A CONNECT_REQUEST's new id is owned by the copy from now on.
        let out = unsafe { CmEvent::copy_from(ev.as_ref(), self) };
        // SAFETY: acknowledged exactly once, after the last access to the event's memory.
        let rc = unsafe { sys::rdma_ack_cm_event(ev.as_ptr()) };
        if rc != 0 {
            tracing::warn!(event = out.name(), "rdma_ack_cm_event failed");
        }
        tracing::debug!(event = out.name(), status = out.status(), id = ?out.id(), "RDMA CM event");
        Ok(Some(out))
    }

    /// Waits up to `timeout` for an event, blocking the calling thread (`poll(2)` on the
    /// descriptor): for synchronous code and tests. A timeout past what the clock can add
    /// (`Duration::MAX`) waits without limit. Async code registers the descriptor with
    /// `AsyncFd` and calls [`get_event`](Self::get_event) instead.
    ///
    /// # Errors
    ///
    /// [`Error::GetCmEvent`] if `poll` or `rdma_get_cm_event` fails.
    pub fn wait_event(&self, timeout: Duration) -> Result<Option<CmEvent>> {
        // A timeout too long to add to the clock (`Duration::MAX`) waits for good.
        let deadline = Instant::now().checked_add(timeout);
        loop {
            if let Some(ev) = self.get_event()? {
                return Ok(Some(ev));
            }
            let left = match deadline {
                Some(d) => d.saturating_duration_since(Instant::now()),
                None => Duration::MAX,
            };
            if left.is_zero() {
                return Ok(None);
            }
            let mut pfd = libc::pollfd {
                fd: self.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = i32::try_from(left.as_millis().max(1)).unwrap_or(i32::MAX);
            // SAFETY: `pfd` is one valid pollfd for a descriptor the channel keeps open.
            let n = unsafe { libc::poll(&mut pfd, 1, ms) };
            if n < 0 {
                let err = io::Error::last_os_error();
                if err.kind() != io::ErrorKind::Interrupted {
                    return Err(Error::GetCmEvent(err));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_round_trip_and_have_rdma_event_str_names() {
        for raw in 0..=15u32 {
            let k = CmEventKind::from_raw(raw);
            assert!(!matches!(k, CmEventKind::Unknown(_)), "{raw}");
            assert_eq!(k.to_raw(), raw);
            assert!(k.name().starts_with("RDMA_CM_EVENT_"), "{}", k.name());
        }
        assert_eq!(CmEventKind::Established.name(), "RDMA_CM_EVENT_ESTABLISHED");
        assert_eq!(CmEventKind::from_raw(99), CmEventKind::Unknown(99));
        assert!(CmEventKind::Rejected.is_error());
        assert!(!CmEventKind::Disconnected.is_error());
    }

    fn event(kind: CmEventKind, status: i32, private_data: &[u8]) -> CmEvent {
        CmEvent {
            kind,
            status,
            id: CmIdKey::from_ptr(std::ptr::null_mut()),
            listen_id: None,
            private_data: private_data.to_vec(),
            conn: None,
            local_addr: None,
            peer_addr: None,
            new_id: None,
        }
    }

    #[test]
    fn errors_from_events() {
        let mut pd = b"go away".to_vec();
        pd.resize(148, 0);
        let e = event(CmEventKind::Rejected, 28, &pd)
            .expect(CmEventKind::ConnectResponse)
            .unwrap_err();
        let text = e.to_string();
        assert!(text.contains("rejected by the peer application"), "{text}");
        assert!(text.contains("\"go away\""), "{text}");
        assert!(
            matches!(&e, Error::ConnectionRejected { status: 28, private_data, .. } if private_data.starts_with(b"go away"))
        );
        let io: std::io::Error = e.into();
        assert_eq!(io.kind(), std::io::ErrorKind::ConnectionRefused);

        let e = event(CmEventKind::Unreachable, -libc::ETIMEDOUT, &[])
            .expect(CmEventKind::ConnectResponse)
            .unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ETIMEDOUT));
        assert!(e.to_string().contains("RDMA_CM_EVENT_UNREACHABLE"), "{e}");
        let io: std::io::Error = e.into();
        assert_eq!(io.kind(), std::io::ErrorKind::HostUnreachable);

        let e = event(CmEventKind::Disconnected, 0, &[])
            .expect(CmEventKind::Established)
            .unwrap_err();
        assert!(matches!(e, Error::UnexpectedCmEvent { .. }), "{e}");
        assert!(
            event(CmEventKind::Established, 0, &[])
                .expect(CmEventKind::Established)
                .is_ok()
        );
    }
}
