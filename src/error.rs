//! The crate's error type.
//!
//! Every failing verb has its own variant carrying the OS error it returned, so a log line or a
//! test failure names the exact call that failed. Failed work completions carry the
//! [`WcStatus`] the device reported.

use std::fmt;
use std::io;

use crate::verbs::QpState;

/// A specialised `Result` for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors from the RDMA verbs, the connection layer and the async engine.
///
/// Each verb that can fail has one variant holding the `errno` it returned as a
/// [`std::io::Error`] (its `source`). Convert into [`std::io::Error`] with `?` or `.into()`.
///
/// # Examples
///
/// ```no_run
/// use tokio_rdma::verbs::Context;
///
/// match Context::open("no-such-device") {
///     Err(tokio_rdma::Error::DeviceNotFound { name, available }) => {
///         eprintln!("{name} not found; devices here: {available:?}");
///     }
///     other => { let _ = other; }
/// }
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `ibv_get_device_list` failed (for example the kernel has no RDMA support).
    #[error("ibv_get_device_list failed")]
    GetDeviceList(#[source] io::Error),
    /// No RDMA device with the requested name exists.
    #[error("RDMA device {name:?} not found (available: {available:?})")]
    DeviceNotFound {
        /// The requested device name.
        name: String,
        /// The names of the devices that do exist.
        available: Vec<String>,
    },
    /// No device has a port in the ACTIVE state.
    #[error("no RDMA device has an active port (devices: {devices:?})")]
    NoActivePort {
        /// The devices that were inspected.
        devices: Vec<String>,
    },
    /// `ibv_open_device` failed.
    #[error("ibv_open_device({name}) failed")]
    OpenDevice {
        /// The device name.
        name: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// `ibv_query_device` failed.
    #[error("ibv_query_device failed")]
    QueryDevice(#[source] io::Error),
    /// `ibv_query_port` failed.
    #[error("ibv_query_port(port {port}) failed")]
    QueryPort {
        /// The port number.
        port: u8,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// `ibv_query_gid_table` / `ibv_query_gid` failed.
    #[error("querying the GID table of port {port} failed")]
    QueryGid {
        /// The port number.
        port: u8,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The port has no GID usable for RoCE / InfiniBand addressing.
    #[error("port {port} has no usable GID")]
    NoUsableGid {
        /// The port number.
        port: u8,
    },
    /// `ibv_alloc_pd` failed.
    #[error("ibv_alloc_pd failed")]
    AllocPd(#[source] io::Error),
    /// `ibv_create_comp_channel` failed.
    #[error("ibv_create_comp_channel failed")]
    CreateCompChannel(#[source] io::Error),
    /// `ibv_create_cq` failed.
    #[error("ibv_create_cq(cqe={cqe}) failed")]
    CreateCq {
        /// Requested number of entries.
        cqe: u32,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// `ibv_req_notify_cq` failed.
    #[error("ibv_req_notify_cq failed")]
    ReqNotifyCq(#[source] io::Error),
    /// `ibv_poll_cq` failed.
    #[error("ibv_poll_cq failed")]
    PollCq(#[source] io::Error),
    /// `ibv_get_cq_event` failed.
    #[error("ibv_get_cq_event failed")]
    GetCqEvent(#[source] io::Error),
    /// `ibv_create_qp` failed.
    #[error("ibv_create_qp failed")]
    CreateQp(#[source] io::Error),
    /// `ibv_modify_qp` failed while moving the queue pair to `to`.
    #[error("ibv_modify_qp to {to:?} failed")]
    ModifyQp {
        /// The target state.
        to: QpState,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// `ibv_query_qp` failed.
    #[error("ibv_query_qp failed")]
    QueryQp(#[source] io::Error),
    /// `ibv_reg_mr` failed.
    ///
    /// `ENOMEM`/`EPERM`/`EFAULT` here usually mean the locked-memory limit (`RLIMIT_MEMLOCK`,
    /// `ulimit -l`) is too low for the registration.
    #[error("ibv_reg_mr of {len} bytes failed{hint}", hint = memlock_hint(source))]
    RegMr {
        /// Length of the region.
        len: usize,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// `ibv_post_send` failed (nothing from index `bad_index` on was posted).
    #[error("ibv_post_send failed at work request {bad_index}")]
    PostSend {
        /// Index of the first work request that was not posted.
        bad_index: usize,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// `ibv_post_recv` failed (nothing from index `bad_index` on was posted).
    #[error("ibv_post_recv failed at work request {bad_index}")]
    PostRecv {
        /// Index of the first work request that was not posted.
        bad_index: usize,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The queue pair failed, or was closed: the one error shape for every operation that did
    /// not complete. The operation whose work completion failed first and every operation
    /// outstanding on the queue pair, or started later, report the same cause (for a failed
    /// work completion, [`QpFailure::WorkCompletion`] with its status).
    #[error("queue pair failed: {0}")]
    QpFailed(QpFailure),
    /// Waiting for an RDMA CM event's descriptor failed.
    #[error("RDMA CM event channel failed")]
    CmChannel(#[source] io::Error),
    /// A step did not finish in time.
    #[error("{what} did not happen within {after:?}")]
    Timeout {
        /// What was awaited.
        what: &'static str,
        /// The time limit.
        after: std::time::Duration,
    },
    /// An argument was rejected before any verb was called.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// `ibv_reg_mr` failed because the locked-memory limit is exhausted: registration pins
    /// memory, and pinned bytes count against `RLIMIT_MEMLOCK` (`ulimit -l`) unless the process
    /// has `CAP_IPC_LOCK`.
    #[error(
        "ibv_reg_mr of {len} bytes failed: RLIMIT_MEMLOCK (ulimit -l) is {limit} bytes{locked}; \
         raise it (e.g. `ulimit -l unlimited`, or memlock in /etc/security/limits.conf)",
        locked = locked_note(*locked)
    )]
    MemlockExhausted {
        /// Length of the region that could not be registered.
        len: usize,
        /// The soft `RLIMIT_MEMLOCK` in bytes.
        limit: u64,
        /// Bytes the process had locked already (`VmLck`), if known.
        locked: Option<u64>,
        /// The OS error `ibv_reg_mr` returned (`ENOMEM` or `EPERM`).
        #[source]
        source: io::Error,
    },
    /// `mmap` of memory for a registered-buffer pool failed.
    #[error("mmap of {len} bytes{kind} failed", kind = if *huge { " (2 MiB huge pages)" } else { "" })]
    MapMemory {
        /// Requested length.
        len: usize,
        /// Whether huge pages were requested.
        huge: bool,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// `ibv_alloc_mw` failed.
    #[error("ibv_alloc_mw failed")]
    AllocMw(#[source] io::Error),
    /// Posting a memory-window bind (`IBV_WR_BIND_MW`) failed.
    #[error("posting a memory window bind failed")]
    BindMw(#[source] io::Error),
    /// The device, or the buffer, does not support what was asked.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// `rdma_create_event_channel` failed (`ENODEV`/`ENOSYS`: no RDMA CM support, e.g. the
    /// `rdma_ucm` module is not loaded or `/dev/infiniband/rdma_cm` is missing).
    #[error("rdma_create_event_channel failed")]
    CreateEventChannel(#[source] io::Error),
    /// `rdma_create_id` failed.
    #[error("rdma_create_id failed")]
    CreateCmId(#[source] io::Error),
    /// `rdma_bind_addr` failed.
    #[error("rdma_bind_addr({addr}) failed")]
    BindAddr {
        /// The address to bind.
        addr: std::net::SocketAddr,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// `rdma_listen` failed.
    #[error("rdma_listen failed")]
    Listen(#[source] io::Error),
    /// `rdma_resolve_addr` failed to start.
    #[error("rdma_resolve_addr(to {dst}) failed")]
    ResolveAddr {
        /// The destination address.
        dst: std::net::SocketAddr,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// `rdma_resolve_route` failed to start.
    #[error("rdma_resolve_route failed")]
    ResolveRoute(#[source] io::Error),
    /// `rdma_connect` failed.
    #[error("rdma_connect failed")]
    CmConnect(#[source] io::Error),
    /// `rdma_accept` failed.
    #[error("rdma_accept failed")]
    CmAccept(#[source] io::Error),
    /// `rdma_reject` failed.
    #[error("rdma_reject failed")]
    CmReject(#[source] io::Error),
    /// `rdma_establish` failed.
    #[error("rdma_establish failed")]
    CmEstablish(#[source] io::Error),
    /// `rdma_disconnect` failed.
    #[error("rdma_disconnect failed")]
    CmDisconnect(#[source] io::Error),
    /// `rdma_notify` failed.
    #[error("rdma_notify failed")]
    CmNotify(#[source] io::Error),
    /// `rdma_migrate_id` failed.
    #[error("rdma_migrate_id failed")]
    MigrateId(#[source] io::Error),
    /// `rdma_set_option` failed.
    #[error("rdma_set_option({option}) failed")]
    CmSetOption {
        /// The option.
        option: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// `rdma_get_cm_event` failed (other than "no event pending").
    #[error("rdma_get_cm_event failed")]
    GetCmEvent(#[source] io::Error),
    /// `rdma_get_devices` failed.
    #[error("rdma_get_devices failed")]
    GetCmDevices(#[source] io::Error),
    /// `rdma_init_qp_attr` failed for the target state `to` (the CM id is not far enough in
    /// its connection setup for that state, or has no device yet).
    #[error("rdma_init_qp_attr for {to:?} failed")]
    InitQpAttr {
        /// The target state.
        to: QpState,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Private data longer than the transport carries in this message.
    #[error("{len} bytes of private data exceed the {max}-byte limit of {what}")]
    PrivateDataTooLong {
        /// The message: `"rdma_connect"`, `"rdma_accept"` or `"rdma_reject"`.
        what: &'static str,
        /// Length given.
        len: usize,
        /// Limit.
        max: usize,
    },
    /// The peer rejected the connection request (`RDMA_CM_EVENT_REJECTED`). `private_data`
    /// is what the peer passed to `rdma_reject` (padded with zeros by the transport); `status`
    /// is the transport's reject reason (InfiniBand CM: 8 = no listener on that service ID /
    /// port, 28 = rejected by the peer application).
    #[error(
        "connection rejected (RDMA_CM_EVENT_REJECTED, reason {status}: {reason}){pd}",
        pd = private_data_note(private_data)
    )]
    ConnectionRejected {
        /// The transport reject reason.
        status: i32,
        /// A description of `status`.
        reason: &'static str,
        /// The reject private data.
        private_data: Vec<u8>,
    },
    /// An RDMA CM event reported a failure: `RDMA_CM_EVENT_ADDR_ERROR`, `ROUTE_ERROR`,
    /// `CONNECT_ERROR`, `UNREACHABLE`, `DEVICE_REMOVAL`, or an error status on another event.
    /// `source` holds the errno when the status is a negative errno.
    #[error("{event} (status {status})")]
    CmEventFailed {
        /// The event name as `rdma_event_str` prints it.
        event: &'static str,
        /// The event status (negative errno or a transport-specific value).
        status: i32,
        /// The errno, when `status` is a negative errno.
        #[source]
        source: Option<io::Error>,
    },
    /// An RDMA CM event arrived that the connection setup did not expect at this step.
    #[error("unexpected RDMA CM event {got} (expected {expected})")]
    UnexpectedCmEvent {
        /// What the setup was waiting for.
        expected: &'static str,
        /// The event that arrived.
        got: &'static str,
    },
    /// The connection handshake (private data) was malformed or incompatible.
    #[error("handshake: {0}")]
    Handshake(#[from] crate::conn::handshake::HandshakeError),
}

fn private_data_note(pd: &[u8]) -> String {
    let used = pd.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
    if used == 0 {
        return String::new();
    }
    let shown = &pd[..used.min(64)];
    match std::str::from_utf8(shown) {
        Ok(text) if text.chars().all(|c| !c.is_control()) => format!(", peer said {text:?}"),
        _ => format!(", private data {shown:02x?}"),
    }
}

fn locked_note(locked: Option<u64>) -> String {
    locked.map_or_else(String::new, |b| format!(" ({b} bytes already locked)"))
}

/// Why a queue pair stopped carrying operations. Cheap to clone: every affected operation gets
/// a copy.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum QpFailure {
    /// An operation completed with an error status, which moved the queue pair to the error
    /// state (remote access error, retry exceeded, local protection error, ...).
    #[error("a work request failed with {status}")]
    WorkCompletion {
        /// The status of the first failed work request.
        status: WcStatus,
        /// Its vendor syndrome.
        vendor_err: u32,
    },
    /// Requests were flushed without a recorded cause (the queue pair was moved to ERR).
    #[error("work requests were flushed")]
    Flushed,
    /// The queue pair was closed locally.
    #[error("the queue pair was closed")]
    Closed,
    /// The peer disconnected (RDMA CM `DISCONNECTED`), or the connection was torn down.
    #[error("the peer disconnected")]
    Disconnected,
    /// The device reported an asynchronous error event for the queue pair or its port.
    #[error("asynchronous event {0}")]
    AsyncEvent(&'static str),
    /// Posting a work request failed with this errno.
    #[error("posting failed with errno {0}")]
    PostFailed(i32),
    /// The peer broke the connection protocol; detected here. The connection is torn down and
    /// the peer is told why (an error message) where a credit allows.
    #[error("the peer broke the protocol: {0}")]
    Protocol(ProtocolError),
    /// The peer reported that this side broke the protocol (its error message), then
    /// disconnected.
    #[error("the peer reported a protocol error: {0}")]
    PeerReported(ProtocolError),
    /// A keepalive probe got no acknowledgement within the keepalive timeout: the peer (or the
    /// path to it) is dead although no disconnect arrived.
    #[error("the peer did not answer a keepalive within {0:?}")]
    KeepaliveTimeout(std::time::Duration),
}

/// How a peer broke the connection protocol. Carried by [`QpFailure::Protocol`] (detected
/// locally) and [`QpFailure::PeerReported`] (the peer's verdict on this side).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolError {
    /// A message arrived without immediate data (every message of the protocol has a header
    /// there).
    #[error("a message arrived without immediate data")]
    NoImmediate,
    /// The header names an unknown message kind or sets reserved bits.
    #[error("malformed message header {0:#010x}")]
    BadHeader(u32),
    /// A data message consumed the receive the peer must keep for control messages: it sent
    /// more than its credits.
    #[error("the peer sent data beyond its credits")]
    CreditOverrun,
    /// A message grew past the negotiated maximum message size.
    #[error("a message exceeded the negotiated maximum of {0} bytes")]
    MessageTooLarge(u64),
    /// A control message (credit, close, abort) carried a payload.
    #[error("a control message carried {0} payload bytes")]
    ControlWithPayload(u32),
    /// An abort arrived with no message in progress.
    #[error("an abort arrived with no message in progress")]
    StrayAbort,
    /// End of stream arrived in the middle of a message.
    #[error("the peer closed in the middle of a message")]
    CloseMidMessage,
    /// A message arrived after the peer's end of stream.
    #[error("a message arrived after end of stream")]
    DataAfterClose,
    /// The peer returned more credits than this side ever granted.
    #[error("the peer returned more credits than were granted")]
    CreditInflation,
    /// An error code this version does not know (the peer's report).
    #[error("unknown protocol error code {0}")]
    Unknown(u16),
}

impl ProtocolError {
    /// The code carried on the wire in an error message.
    pub fn code(self) -> u16 {
        match self {
            ProtocolError::NoImmediate => 1,
            ProtocolError::BadHeader(_) => 2,
            ProtocolError::CreditOverrun => 3,
            ProtocolError::MessageTooLarge(_) => 4,
            ProtocolError::ControlWithPayload(_) => 5,
            ProtocolError::StrayAbort => 6,
            ProtocolError::CloseMidMessage => 7,
            ProtocolError::DataAfterClose => 8,
            ProtocolError::CreditInflation => 9,
            ProtocolError::Unknown(c) => c,
        }
    }

    /// The error for a code received on the wire (details such as limits are not carried).
    pub fn from_code(code: u16) -> ProtocolError {
        match code {
            1 => ProtocolError::NoImmediate,
            2 => ProtocolError::BadHeader(0),
            3 => ProtocolError::CreditOverrun,
            4 => ProtocolError::MessageTooLarge(0),
            5 => ProtocolError::ControlWithPayload(0),
            6 => ProtocolError::StrayAbort,
            7 => ProtocolError::CloseMidMessage,
            8 => ProtocolError::DataAfterClose,
            9 => ProtocolError::CreditInflation,
            c => ProtocolError::Unknown(c),
        }
    }
}

fn memlock_hint(err: &io::Error) -> &'static str {
    match err.raw_os_error() {
        Some(libc::ENOMEM) | Some(libc::EPERM) | Some(libc::EFAULT) => {
            " (is RLIMIT_MEMLOCK / `ulimit -l` large enough?)"
        }
        _ => "",
    }
}

impl Error {
    /// The underlying OS error code, if this error came from a failing verb.
    pub fn raw_os_error(&self) -> Option<i32> {
        std::error::Error::source(self)
            .and_then(|s| s.downcast_ref::<io::Error>())
            .and_then(io::Error::raw_os_error)
    }

    /// Builds the error for a verb that returned `-1` and set `errno`.
    pub(crate) fn last_os(f: impl FnOnce(io::Error) -> Error) -> Error {
        f(io::Error::last_os_error())
    }

    /// Builds the error for a verb that returns its error code directly (`ibv_post_send`,
    /// `ibv_modify_qp`, ...). Some providers return a negative code; both are accepted.
    pub(crate) fn code(code: i32, f: impl FnOnce(io::Error) -> Error) -> Error {
        f(io::Error::from_raw_os_error(code.abs()))
    }
}

impl From<Error> for io::Error {
    fn from(err: Error) -> io::Error {
        let kind = match &err {
            Error::DeviceNotFound { .. } | Error::NoActivePort { .. } => io::ErrorKind::NotFound,
            Error::InvalidArgument(_) => io::ErrorKind::InvalidInput,
            Error::QpFailed(QpFailure::Protocol(_) | QpFailure::PeerReported(_)) => {
                io::ErrorKind::InvalidData
            }
            Error::QpFailed(QpFailure::KeepaliveTimeout(_)) => io::ErrorKind::TimedOut,
            Error::Timeout { .. } => io::ErrorKind::TimedOut,
            Error::QpFailed(QpFailure::Disconnected) => io::ErrorKind::ConnectionReset,
            Error::Unsupported(_) => io::ErrorKind::Unsupported,
            Error::MemlockExhausted { .. } => io::ErrorKind::OutOfMemory,
            Error::QpFailed(QpFailure::WorkCompletion { status, .. }) => status.io_kind(),
            Error::QpFailed(QpFailure::Closed) => io::ErrorKind::NotConnected,
            Error::QpFailed(_) => io::ErrorKind::ConnectionAborted,
            Error::RegMr { source, .. } if source.raw_os_error() == Some(libc::ENOMEM) => {
                io::ErrorKind::OutOfMemory
            }
            Error::ConnectionRejected { .. } => io::ErrorKind::ConnectionRefused,
            Error::CmEventFailed { event, .. } if *event == "RDMA_CM_EVENT_UNREACHABLE" => {
                io::ErrorKind::HostUnreachable
            }
            Error::PrivateDataTooLong { .. } => io::ErrorKind::InvalidInput,
            Error::Handshake(_) => io::ErrorKind::InvalidData,
            Error::UnexpectedCmEvent { .. } => io::ErrorKind::ConnectionAborted,
            other => match other.raw_os_error() {
                Some(code) => io::Error::from_raw_os_error(code).kind(),
                None => io::ErrorKind::Other,
            },
        };
        io::Error::new(kind, err)
    }
}

macro_rules! wc_status {
    ($( $variant:ident = $c:ident, $desc:literal; )*) => {
        /// The status of a work completion (`enum ibv_wc_status`).
        ///
        /// `Display` prints the verbs name (e.g. `IBV_WC_REM_ACCESS_ERR`) and a description.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum WcStatus {
            $(
                #[doc = $desc]
                $variant,
            )*
            /// A status value this crate does not know.
            Unknown(u32),
        }

        impl WcStatus {
            /// Converts the raw `ibv_wc_status` value.
            pub fn from_raw(raw: u32) -> WcStatus {
                match raw {
                    $( x if x == crate::sys::$c => WcStatus::$variant, )*
                    other => WcStatus::Unknown(other),
                }
            }

            /// The verbs name of the status, e.g. `"IBV_WC_SUCCESS"`.
            pub fn name(self) -> &'static str {
                match self {
                    $( WcStatus::$variant => stringify!($c), )*
                    WcStatus::Unknown(_) => "IBV_WC_UNKNOWN",
                }
            }

            /// A short description of the status.
            pub fn description(self) -> &'static str {
                match self {
                    $( WcStatus::$variant => $desc, )*
                    WcStatus::Unknown(_) => "unknown status",
                }
            }
        }
    };
}

wc_status! {
    Success = IBV_WC_SUCCESS, "Success.";
    LocLenErr = IBV_WC_LOC_LEN_ERR, "Local length error.";
    LocQpOpErr = IBV_WC_LOC_QP_OP_ERR, "Local QP operation error.";
    LocEecOpErr = IBV_WC_LOC_EEC_OP_ERR, "Local EE context operation error.";
    LocProtErr = IBV_WC_LOC_PROT_ERR, "Local protection error.";
    WrFlushErr = IBV_WC_WR_FLUSH_ERR, "Work request flushed (the queue pair is in the error state).";
    MwBindErr = IBV_WC_MW_BIND_ERR, "Memory window bind error.";
    BadRespErr = IBV_WC_BAD_RESP_ERR, "Bad response error.";
    LocAccessErr = IBV_WC_LOC_ACCESS_ERR, "Local access error.";
    RemInvReqErr = IBV_WC_REM_INV_REQ_ERR, "Remote invalid request error.";
    RemAccessErr = IBV_WC_REM_ACCESS_ERR, "Remote access error.";
    RemOpErr = IBV_WC_REM_OP_ERR, "Remote operation error.";
    RetryExcErr = IBV_WC_RETRY_EXC_ERR, "Transport retry counter exceeded.";
    RnrRetryExcErr = IBV_WC_RNR_RETRY_EXC_ERR, "RNR retry counter exceeded.";
    LocRddViolErr = IBV_WC_LOC_RDD_VIOL_ERR, "Local RDD violation error.";
    RemInvRdReqErr = IBV_WC_REM_INV_RD_REQ_ERR, "Remote invalid RD request.";
    RemAbortErr = IBV_WC_REM_ABORT_ERR, "Remote aborted error.";
    InvEecnErr = IBV_WC_INV_EECN_ERR, "Invalid EE context number.";
    InvEecStateErr = IBV_WC_INV_EEC_STATE_ERR, "Invalid EE context state.";
    FatalErr = IBV_WC_FATAL_ERR, "Fatal error.";
    RespTimeoutErr = IBV_WC_RESP_TIMEOUT_ERR, "Response timeout error.";
    GeneralErr = IBV_WC_GENERAL_ERR, "General error.";
    TmErr = IBV_WC_TM_ERR, "Tag matching error.";
    TmRndvIncomplete = IBV_WC_TM_RNDV_INCOMPLETE, "Tag matching rendezvous incomplete.";
}

impl WcStatus {
    /// Whether this is [`WcStatus::Success`].
    pub fn is_success(self) -> bool {
        self == WcStatus::Success
    }

    fn io_kind(self) -> io::ErrorKind {
        match self {
            WcStatus::RemAccessErr | WcStatus::LocProtErr | WcStatus::LocAccessErr => {
                io::ErrorKind::PermissionDenied
            }
            WcStatus::RetryExcErr | WcStatus::RespTimeoutErr => io::ErrorKind::TimedOut,
            WcStatus::WrFlushErr => io::ErrorKind::ConnectionAborted,
            WcStatus::RnrRetryExcErr | WcStatus::RemAbortErr => io::ErrorKind::ConnectionReset,
            WcStatus::LocLenErr | WcStatus::RemInvReqErr => io::ErrorKind::InvalidInput,
            _ => io::ErrorKind::Other,
        }
    }
}

impl fmt::Display for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WcStatus::Unknown(raw) => write!(f, "IBV_WC_UNKNOWN({raw})"),
            s => write!(
                f,
                "{} ({})",
                s.name(),
                s.description().trim_end_matches('.')
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wc_status_names_round_trip() {
        assert_eq!(
            WcStatus::from_raw(crate::sys::IBV_WC_SUCCESS),
            WcStatus::Success
        );
        let s = WcStatus::from_raw(crate::sys::IBV_WC_REM_ACCESS_ERR);
        assert_eq!(s.name(), "IBV_WC_REM_ACCESS_ERR");
        assert_eq!(s.to_string(), "IBV_WC_REM_ACCESS_ERR (Remote access error)");
        assert_eq!(WcStatus::from_raw(9999), WcStatus::Unknown(9999));
    }

    #[test]
    fn io_error_kinds() {
        let e: io::Error = Error::QpFailed(QpFailure::WorkCompletion {
            status: WcStatus::RemAccessErr,
            vendor_err: 0,
        })
        .into();
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied);
        let e: io::Error = Error::DeviceNotFound {
            name: "x".into(),
            available: vec![],
        }
        .into();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        let e: io::Error =
            Error::code(libc::ENOMEM, |source| Error::RegMr { len: 1, source }).into();
        assert_eq!(e.kind(), io::ErrorKind::OutOfMemory);
        assert!(
            Error::code(-libc::EINVAL, Error::AllocPd).raw_os_error() == Some(libc::EINVAL),
            "negative codes are normalised"
        );
    }

    #[test]
    fn reg_mr_names_memlock() {
        let e = Error::code(libc::ENOMEM, |source| Error::RegMr { len: 4096, source });
        assert!(e.to_string().contains("RLIMIT_MEMLOCK"), "{e}");
    }
}
