//! The crate's error type.
//!
//! Every failing verb has its own variant carrying the OS error it returned, so a log line or a
//! test failure names the exact call that failed. The message names the errno
//! (`rdma_bind_addr(192.0.2.1:7470) failed: EADDRINUSE (Address already in use); ...`) and,
//! where the cause is a common one (no RDMA device, address in use, an address no RDMA device
//! owns, the locked-memory limit), says what to do about it; the [`std::io::Error`] stays the
//! error's `source`. Failed work completions carry the [`WcStatus`] the device reported.

use std::fmt;
use std::io;
use std::net::SocketAddr;

use crate::verbs::QpState;

mod debug;
pub(crate) mod handshake;
mod hint;
mod invalid;
mod io_kind;
mod protocol;
mod unsupported;

pub(crate) use invalid::remote_access_debug;
pub use invalid::{InvalidArgument, ModeMismatch};
pub use protocol::ProtocolError;
pub use unsupported::Unsupported;

pub(crate) use hint::is_loopback;
use hint::{Call, cause, event_hint};

/// A specialised `Result` for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors from the RDMA verbs, the connection layer and the async engine.
///
/// Each verb that can fail has one variant holding the `errno` it returned as a
/// [`std::io::Error`] (its `source`); the message names the errno and, for common causes, what
/// to do. Convert into [`std::io::Error`] with `?` or `.into()`; [`Error::raw_os_error`] gives
/// the code.
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
///
/// `Debug` prints the same message as `Display` (with its hint), then the source's `Debug`
/// (`... (source: Os { code: 19, .. })`): what `fn main() -> Result<(), tokio_rdma::Error>`
/// shows when it fails.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `ibv_get_device_list` failed: the kernel has no RDMA verbs support (`ENOSYS`), or no
    /// device at all.
    ///
    /// What to do: load an RDMA driver (for soft-RoCE `modprobe rdma_rxe`, then
    /// `rdma link add rxe0 type rxe netdev eth0`) and check that `rdma link` lists a link.
    #[error("ibv_get_device_list failed{}", cause(Call::GetDeviceList, .0))]
    GetDeviceList(#[source] io::Error),
    /// No RDMA device with the requested name exists.
    ///
    /// What to do: use one of `available` (`rdma link` and `ibv_devices` list them too); if
    /// the list is empty, no RDMA device is configured (see [`Error::GetDeviceList`]).
    #[error(
        "RDMA device {name:?} not found (available: {available:?}); {}",
        device_hint(available)
    )]
    DeviceNotFound {
        /// The requested device name.
        name: String,
        /// The names of the devices that do exist.
        available: Vec<String>,
    },
    /// No device has a port in the ACTIVE state.
    ///
    /// What to do: bring a link up (`rdma link` shows its state; its netdev must be up:
    /// `ip link set NETDEV up`), or, if `devices` is empty, configure a device (see
    /// [`Error::GetDeviceList`]).
    #[error(
        "no RDMA device has an active port (devices: {devices:?}); {}",
        active_hint(devices)
    )]
    NoActivePort {
        /// The devices that were inspected.
        devices: Vec<String>,
    },
    /// `ibv_open_device` failed.
    ///
    /// What to do: `EACCES`/`EPERM` mean the process may not open `/dev/infiniband/uverbs*`
    /// (run as root, or give the user access); otherwise the device is unusable (`dmesg`).
    #[error("ibv_open_device({name}) failed{}", cause(Call::OpenDevice, source))]
    OpenDevice {
        /// The device name.
        name: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// `ibv_query_device` failed (also: reading the device's asynchronous events failed).
    ///
    /// What to do: the device is unusable; check `dmesg` and `rdma link`.
    #[error("ibv_query_device failed{}", cause(Call::Other, .0))]
    QueryDevice(#[source] io::Error),
    /// `ibv_query_port` failed.
    ///
    /// What to do: `EINVAL` means the port does not exist (ports count from 1 to
    /// [`DeviceAttr::phys_port_cnt`](crate::verbs::DeviceAttr::phys_port_cnt)).
    #[error("ibv_query_port(port {port}) failed{}", cause(Call::Other, source))]
    QueryPort {
        /// The port number.
        port: u8,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// `ibv_query_gid_table` / `ibv_query_gid` failed.
    ///
    /// What to do: check the port exists and its link is up (`rdma link`).
    #[error(
        "querying the GID table of port {port} failed{}",
        cause(Call::Other, source)
    )]
    QueryGid {
        /// The port number.
        port: u8,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The port has no GID usable for RoCE / InfiniBand addressing.
    ///
    /// What to do: for RoCE, give the link's netdev an IP address (`ip addr add ... dev
    /// NETDEV`) and bring it up; GIDs follow the netdev's addresses.
    #[error("port {port} has no usable GID (does the RDMA link's netdev have an IP address?)")]
    NoUsableGid {
        /// The port number.
        port: u8,
    },
    /// `ibv_alloc_pd` failed.
    ///
    /// What to do: usually out of memory or device resources; release protection domains.
    #[error("ibv_alloc_pd failed{}", cause(Call::Other, .0))]
    AllocPd(#[source] io::Error),
    /// `ibv_create_comp_channel` failed.
    ///
    /// What to do: `EMFILE` means the process is out of file descriptors (`ulimit -n`).
    #[error("ibv_create_comp_channel failed{}", cause(Call::Other, .0))]
    CreateCompChannel(#[source] io::Error),
    /// `ibv_create_cq` failed.
    ///
    /// What to do: `EINVAL`: ask for at most the device's `max_cqe`; `ENOMEM`: raise
    /// `RLIMIT_MEMLOCK` (`ulimit -l`) or use fewer/smaller queues.
    #[error("ibv_create_cq(cqe={cqe}) failed{}", cause(Call::CreateCq, source))]
    CreateCq {
        /// Requested number of entries.
        cqe: u32,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// `ibv_req_notify_cq` failed.
    ///
    /// What to do: the completion queue is unusable; drop it and its queue pairs.
    #[error("ibv_req_notify_cq failed{}", cause(Call::Other, .0))]
    ReqNotifyCq(#[source] io::Error),
    /// `ibv_poll_cq` failed.
    ///
    /// What to do: the completion queue is unusable (often it overran: make it larger than
    /// the work requests that can be outstanding on it).
    #[error("ibv_poll_cq failed{}", cause(Call::Other, .0))]
    PollCq(#[source] io::Error),
    /// `ibv_get_cq_event` failed.
    ///
    /// What to do: the completion channel is unusable; drop it and its completion queues.
    #[error("ibv_get_cq_event failed{}", cause(Call::Other, .0))]
    GetCqEvent(#[source] io::Error),
    /// `ibv_create_qp` failed.
    ///
    /// What to do: `EINVAL`: keep [`QpCaps`](crate::verbs::QpCaps) within the device's
    /// limits (`ibv_devinfo -v`); `ENOMEM`: raise `RLIMIT_MEMLOCK` or use smaller queues.
    #[error("ibv_create_qp failed{}", cause(Call::CreateQp, .0))]
    CreateQp(#[source] io::Error),
    /// `ibv_create_srq` failed.
    ///
    /// What to do: `EINVAL`: keep the queue within `max_srq_wr` / `max_srq_sge`
    /// (`ibv_devinfo -v`); `ENOMEM`: raise `RLIMIT_MEMLOCK` or use a smaller queue.
    #[error("ibv_create_srq failed{}", cause(Call::CreateSrq, .0))]
    CreateSrq(#[source] io::Error),
    /// `ibv_modify_srq` (arming the limit) or `ibv_query_srq` failed.
    ///
    /// What to do: keep the limit below the queue's size; check the device supports limits.
    #[error("ibv_modify_srq failed{}", cause(Call::ModifySrq, .0))]
    ModifySrq(#[source] io::Error),
    /// `ibv_modify_qp` failed while moving the queue pair to `to`.
    ///
    /// What to do: check the attributes of that transition (port, GID index, MTU, the
    /// peer's QPN/PSN) and that the queue pair is in the state the transition starts from.
    #[error("ibv_modify_qp to {to:?} failed{}", cause(Call::ModifyQp, source))]
    ModifyQp {
        /// The target state.
        to: QpState,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// `ibv_query_qp` failed.
    ///
    /// What to do: the queue pair is unusable; drop it.
    #[error("ibv_query_qp failed{}", cause(Call::Other, .0))]
    QueryQp(#[source] io::Error),
    /// `ibv_reg_mr` failed (for `ENOMEM`/`EPERM` with a finite limit, the registration
    /// layers report [`Error::MemlockExhausted`] instead).
    ///
    /// What to do: `ENOMEM`/`EPERM`: raise `RLIMIT_MEMLOCK` (`ulimit -l`); `EFAULT`: the range
    /// is not mapped memory of this process; `EINVAL`: access flags the device does not
    /// support.
    #[error("ibv_reg_mr of {len} bytes failed{}", cause(Call::RegMr, source))]
    RegMr {
        /// Length of the region.
        len: usize,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// `ibv_post_send` failed (nothing from index `bad_index` on was posted).
    ///
    /// What to do: `ENOMEM`: the send queue is full, wait for completions; `EINVAL`: the work
    /// request exceeds the queue pair's capabilities.
    #[error(
        "ibv_post_send failed at work request {bad_index}{}",
        cause(Call::PostSend, source)
    )]
    PostSend {
        /// Index of the first work request that was not posted.
        bad_index: usize,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// `ibv_post_recv` failed (nothing from index `bad_index` on was posted).
    ///
    /// What to do: as for [`Error::PostSend`], on the receive queue.
    #[error(
        "ibv_post_recv failed at work request {bad_index}{}",
        cause(Call::PostRecv, source)
    )]
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
    ///
    /// What to do: the queue pair (connection) is finished; open a new one. The
    /// [`QpFailure`] says whose fault it was (faults and timings: `docs/faults.md`):
    /// * `WorkCompletion` `IBV_WC_REM_ACCESS_ERR`: the peer's memory refused the access: a
    ///   revoked grant, a range outside it, or a token not made with `Connection::grant` on
    ///   this very connection (each connection has its own protection domain);
    ///   `IBV_WC_LOC_PROT_ERR`: a local buffer registered in another protection domain;
    ///   `IBV_WC_RETRY_EXC_ERR`: the peer or the path is gone (the transport gave up);
    ///   `IBV_WC_WR_FLUSH_ERR`: an earlier failure flushed this one.
    /// * `Disconnected`: the peer closed or its process died; `Closed`: this side closed.
    /// * `KeepaliveTimeout`: the peer or the path died silently.
    /// * `Protocol`: the peer is broken or hostile; `PeerReported`: the peer says this side
    ///   broke the protocol (a bug to report).
    #[error("queue pair failed: {0}")]
    QpFailed(QpFailure),
    /// Waiting for an RDMA CM event's descriptor failed.
    ///
    /// What to do: the event channel is unusable; drop it and the ids on it.
    #[error("RDMA CM event channel failed{}", cause(Call::Other, .0))]
    CmChannel(#[source] io::Error),
    /// A step did not finish in time.
    ///
    /// What to do: check the peer is up and reachable; under emulation (soft-RoCE in a VM)
    /// allow longer.
    #[error("{what} did not happen within {after:?}")]
    Timeout {
        /// What was awaited.
        what: &'static str,
        /// The time limit.
        after: std::time::Duration,
    },
    /// An argument was rejected before any verb was called. One-sided operations and grants
    /// check locally what would otherwise fail on the device and kill the connection (access
    /// the peer did not offer, a range outside the token, a local buffer not from the
    /// connection's pool): after this error the connection is still usable.
    ///
    /// What to do: fix the argument the message names; the [`InvalidArgument`] says which
    /// (match on it to handle one cause).
    #[error("invalid argument: {0}")]
    InvalidArgument(InvalidArgument),
    /// The verbs object is owned by a [`Driver`](crate::driver::Driver): polling its completion
    /// queue, reading its events, or posting on its queue pair from outside the driver would
    /// take completions the driver's operations are waiting for (or hand it completions it
    /// never issued).
    ///
    /// What to do: use the driver's operations ([`AsyncQp`](crate::driver::AsyncQp)'s futures,
    /// [`Grant::region`](crate::buf::Grant::region) instead of a window bound by hand), or
    /// create the queue pair and CQ with the verbs layer alone.
    #[error("the {0} is driven by a Driver; use the driver's operations instead")]
    DriverOwned(&'static str),
    /// A loopback address (127.0.0.0/8, `::1`) was given to RDMA CM. No RDMA device owns a
    /// loopback address: binding one appears to work, and the connection then fails when the
    /// route is resolved. Refused before any RDMA CM call.
    ///
    /// What to do: use an IP address of an RDMA link's netdev (`rdma link` names the netdev,
    /// `ip -4 addr show dev NETDEV` its address), or the unspecified address to listen on all.
    #[error(
        "{addr} is a loopback address, which is not an RDMA address ({call}): use an IP address \
         of an RDMA link's netdev (`rdma link` names the netdev, `ip -4 addr show dev NETDEV` \
         its address)"
    )]
    LoopbackAddress {
        /// The address given.
        addr: SocketAddr,
        /// The call that refused it: `"rdma_bind_addr"` or `"rdma_resolve_addr"`.
        call: &'static str,
    },
    /// `ibv_reg_mr` failed because the locked-memory limit is exhausted: registration pins
    /// memory, and pinned bytes count against `RLIMIT_MEMLOCK` (`ulimit -l`) unless the process
    /// has `CAP_IPC_LOCK`.
    ///
    /// What to do: raise the limit (`ulimit -l unlimited`, `memlock` in
    /// /etc/security/limits.conf, `LimitMEMLOCK=` for a systemd unit), or register less.
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
    ///
    /// What to do: `ENOMEM` with huge pages: reserve them (`vm.nr_hugepages`) or use
    /// [`HugePages::Never`](crate::verbs::HugePages::Never); otherwise use a smaller pool.
    #[error(
        "mmap of {len} bytes{kind} failed{}",
        cause(Call::Other, source),
        kind = if *huge { " (2 MiB huge pages)" } else { "" }
    )]
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
    ///
    /// What to do: `EOPNOTSUPP`: the device has no memory windows; grant memory with a
    /// memory region instead.
    #[error("ibv_alloc_mw failed{}", cause(Call::AllocMw, .0))]
    AllocMw(#[source] io::Error),
    /// Posting a memory-window bind (`IBV_WR_BIND_MW`) failed.
    ///
    /// What to do: as for [`Error::PostSend`]; check the region allows `MW_BIND`.
    #[error("posting a memory window bind failed{}", cause(Call::PostSend, .0))]
    BindMw(#[source] io::Error),
    /// The endpoint's shared receive queue cannot take another connection: the receives no
    /// connection has claimed (`spare`) do not cover the new connection's floor (its minimum
    /// credits plus its control receives). The connection was refused before it was used; a
    /// client sees the server's refusal as [`Error::ConnectionRejected`] with this text.
    ///
    /// What to do: raise `SrqOptions::buffers`, lower the connections' `recv_credits` (fewer
    /// credits above the floor are claimed), or close idle connections.
    #[error(
        "the shared receive queue cannot take another connection: {buffers} buffers, \
         {connections} connections, {spare} unclaimed, {floor} needed"
    )]
    ReceiveBudgetExhausted {
        /// Buffers of the queue.
        buffers: u32,
        /// Connections on it.
        connections: u32,
        /// Receives on the queue no connection had claimed.
        spare: i64,
        /// What the refused connection needed.
        floor: u32,
    },
    /// The endpoint's memory budget ([`EndpointOptions::memory_budget`](crate::EndpointOptions::memory_budget))
    /// cannot take `needed` more bytes: what its connections hold (`in_use` bytes: their
    /// registered receive and staging pools, and the buffers of the rendezvous messages being
    /// read) plus these would exceed it.
    ///
    /// From a connect or accept: the connection was refused before its pools were made; a
    /// client sees a server's refusal as [`Error::ConnectionRejected`] with this text. From
    /// [`Connection::recv`](crate::conn::Connection::recv): the next message is a rendezvous
    /// message that would need a buffer of `needed` bytes; it stays queued (nothing is lost),
    /// and a later `recv` tries again, or `recv_into` reads it into the caller's buffer.
    ///
    /// What to do: raise the budget, make connections smaller (`recv_credits`,
    /// `recv_buf_size`, `max_send_chunk`, `max_staged_chunks`, `max_message_size`), or close
    /// idle connections.
    #[error(
        "the endpoint's memory budget cannot take {needed} more bytes: {in_use} of {budget} \
         bytes in use"
    )]
    MemoryBudgetExhausted {
        /// The endpoint's budget, bytes.
        budget: u64,
        /// Bytes the endpoint's connections hold.
        in_use: u64,
        /// Bytes the refused connection needed.
        needed: u64,
    },
    /// Memory was to be registered on demand ([`AccessFlags::ON_DEMAND`](crate::verbs::AccessFlags::ON_DEMAND))
    /// but the device does not offer what that needs ([`Context::odp_caps`](crate::verbs::Context::odp_caps)).
    ///
    /// What to do: register pinned (without `ON_DEMAND`), or use a device with ODP:
    /// soft-RoCE (`rdma_rxe`) has it from Linux 6.14 (RC send, receive, READ, WRITE and atomics;
    /// no implicit ODP); `scripts/rxe-vm --kernel 6.19` boots such a kernel.
    #[error(
        "{device} does not support {missing}; soft-RoCE (rdma_rxe) has on-demand paging from {}, \
         without implicit ODP; register pinned memory instead",
        crate::verbs::RXE_ODP_SINCE
    )]
    OdpUnsupported {
        /// The device.
        device: String,
        /// The capability it lacks.
        missing: crate::verbs::OdpMissing,
    },
    /// `ibv_advise_mr` (a prefetch of on-demand memory) failed.
    ///
    /// What to do: `EOPNOTSUPP`: the device cannot prefetch (soft-RoCE got prefetch later than ODP; the 6.19 kernel of `scripts/rxe-vm` has it):
    /// let the first access fault the pages in; `EINVAL`/`ENOENT`: the range or key is not an
    /// on-demand region of this protection domain.
    #[error("ibv_advise_mr failed{}", cause(Call::Other, .0))]
    AdviseMr(#[source] io::Error),
    /// The device, or the buffer, does not support what was asked.
    ///
    /// What to do: do without the feature the [`Unsupported`] names, or use a device that has
    /// it.
    #[error("unsupported: {0}")]
    Unsupported(Unsupported),
    /// `rdma_create_event_channel` failed (`ENODEV`/`ENOSYS`: no RDMA CM support, e.g. the
    /// `rdma_ucm` module is not loaded or `/dev/infiniband/rdma_cm` is missing).
    ///
    /// What to do: `modprobe rdma_ucm` and configure an RDMA device (`rdma link`).
    #[error("rdma_create_event_channel failed{}", cause(Call::CreateEventChannel, .0))]
    CreateEventChannel(#[source] io::Error),
    /// `rdma_create_id` failed.
    ///
    /// What to do: as for [`Error::CreateEventChannel`]; `EMFILE`/`ENOMEM`: too many ids.
    #[error("rdma_create_id failed{}", cause(Call::CreateCmId, .0))]
    CreateCmId(#[source] io::Error),
    /// `rdma_bind_addr` failed.
    ///
    /// What to do: `EADDRINUSE`: another id holds the port, pick another (or 0);
    /// `EADDRNOTAVAIL`/`ENODEV`: bind an address of an RDMA link's netdev.
    #[error("rdma_bind_addr({addr}) failed{}", cause(Call::BindAddr, source))]
    BindAddr {
        /// The address to bind.
        addr: SocketAddr,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// `rdma_listen` failed.
    ///
    /// What to do: `EADDRINUSE`: another listener holds the port; pick another.
    #[error("rdma_listen failed{}", cause(Call::Listen, .0))]
    Listen(#[source] io::Error),
    /// `rdma_resolve_addr` failed to start.
    ///
    /// What to do: use a destination (and source) that an RDMA device routes to (`rdma link`,
    /// `ip route get DST`).
    #[error(
        "rdma_resolve_addr(to {dst}) failed{}",
        cause(Call::ResolveAddr, source)
    )]
    ResolveAddr {
        /// The destination address.
        dst: SocketAddr,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Looking up the addresses of a host name or address string failed (the
    /// [`ToSocketAddrs`](tokio::net::ToSocketAddrs) step of `connect`/`bind`, before any RDMA
    /// CM call), or it gave no address.
    ///
    /// What to do: check the name resolves (`getent hosts NAME`), or pass an IP address.
    #[error("looking up {what:?} failed: {source}")]
    LookupHost {
        /// What was looked up, as given.
        what: String,
        /// The resolver's error (`NotFound` when it gave no address).
        #[source]
        source: io::Error,
    },
    /// `rdma_resolve_route` failed to start.
    ///
    /// What to do: resolve the address first (wait for `ADDR_RESOLVED`); check the path to
    /// the peer goes over an RDMA link's netdev.
    #[error("rdma_resolve_route failed{}", cause(Call::ResolveRoute, .0))]
    ResolveRoute(#[source] io::Error),
    /// `rdma_connect` failed.
    ///
    /// What to do: the route must be resolved and the queue pair in INIT; retry with a new id.
    #[error("rdma_connect failed{}", cause(Call::Other, .0))]
    CmConnect(#[source] io::Error),
    /// `rdma_accept` failed.
    ///
    /// What to do: the request may have been withdrawn by the client; drop the id.
    #[error("rdma_accept failed{}", cause(Call::Other, .0))]
    CmAccept(#[source] io::Error),
    /// `rdma_reject` failed.
    ///
    /// What to do: nothing more to do for that request; drop its id.
    #[error("rdma_reject failed{}", cause(Call::Other, .0))]
    CmReject(#[source] io::Error),
    /// `rdma_establish` failed.
    ///
    /// What to do: the connection is not usable; drop the id and connect again.
    #[error("rdma_establish failed{}", cause(Call::Other, .0))]
    CmEstablish(#[source] io::Error),
    /// `rdma_disconnect` failed.
    ///
    /// What to do: usually the connection was already gone; drop the id.
    #[error("rdma_disconnect failed{}", cause(Call::Other, .0))]
    CmDisconnect(#[source] io::Error),
    /// `rdma_notify` failed.
    ///
    /// What to do: the id is not connected; drop it.
    #[error("rdma_notify failed{}", cause(Call::Other, .0))]
    CmNotify(#[source] io::Error),
    /// `rdma_migrate_id` failed.
    ///
    /// What to do: keep the id on its old channel, or drop it.
    #[error("rdma_migrate_id failed{}", cause(Call::Other, .0))]
    MigrateId(#[source] io::Error),
    /// `rdma_set_option` failed.
    ///
    /// What to do: the option (or its value) is not supported here; do without it.
    #[error("rdma_set_option({option}) failed{}", cause(Call::Other, source))]
    CmSetOption {
        /// The option.
        option: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// `rdma_get_cm_event` failed (other than "no event pending").
    ///
    /// What to do: the event channel is unusable; drop it and the ids on it.
    #[error("rdma_get_cm_event failed{}", cause(Call::Other, .0))]
    GetCmEvent(#[source] io::Error),
    /// `rdma_get_devices` failed.
    ///
    /// What to do: `ENODEV`: no RDMA device (see [`Error::GetDeviceList`]).
    #[error("rdma_get_devices failed{}", cause(Call::GetCmDevices, .0))]
    GetCmDevices(#[source] io::Error),
    /// `rdma_init_qp_attr` failed for the target state `to` (the CM id is not far enough in
    /// its connection setup for that state, or has no device yet).
    ///
    /// What to do: move the queue pair only after the matching CM step (INIT after address
    /// resolution, RTR/RTS after the connect response).
    #[error("rdma_init_qp_attr for {to:?} failed{}", cause(Call::Other, source))]
    InitQpAttr {
        /// The target state.
        to: QpState,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Private data longer than the transport carries in this message.
    ///
    /// What to do: send at most `max` bytes; put the rest in the first message.
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
    ///
    /// What to do: reason 8: start the server, or connect to the port it listens on; reason
    /// 28: read the peer's private data (a tokio-rdma listener says why in it).
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
    ///
    /// What to do: `ADDR_ERROR`/`ROUTE_ERROR`: the address is not reachable over an RDMA
    /// device (`rdma link`, `ip route get`); `UNREACHABLE`: the peer did not answer (is it
    /// running, is its link up?).
    #[error("{event} (status {status}{}){}", status_name(*status), event_note(event, *status))]
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
    ///
    /// What to do: the peer does not follow the expected protocol, or the ids were shared;
    /// drop the id and connect again.
    #[error("unexpected RDMA CM event {got} (expected {expected})")]
    UnexpectedCmEvent {
        /// What the setup was waiting for.
        expected: &'static str,
        /// The event that arrived.
        got: &'static str,
    },
    /// The connection handshake (private data) was malformed or incompatible.
    ///
    /// What to do: both sides must run compatible tokio-rdma versions with compatible
    /// options; a foreign peer (a C program) needs raw connections
    /// ([`RawConnector`](crate::conn::RawConnector), `docs/interop.md`).
    #[error("handshake: {0}")]
    Handshake(#[from] handshake::HandshakeError),
}

fn device_hint(available: &[String]) -> &'static str {
    if available.is_empty() {
        hint::NO_DEVICE
    } else {
        "check the name against `rdma link` or `ibv_devices`"
    }
}

fn active_hint(devices: &[String]) -> &'static str {
    if devices.is_empty() {
        hint::NO_DEVICE
    } else {
        "check `rdma link`: a link must be ACTIVE, with its netdev up"
    }
}

fn status_name(status: i32) -> String {
    match status.checked_neg().and_then(hint::errno_name) {
        Some(name) => format!(", {name}"),
        None => String::new(),
    }
}

fn event_note(event: &str, status: i32) -> String {
    event_hint(event, status).map_or_else(String::new, |h| format!("; {h}"))
}

fn private_data_note(pd: &[u8]) -> String {
    let used = pd.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
    if used == 0 {
        return String::new();
    }
    let shown = &pd[..used.min(crate::verbs::MAX_REJECT_PRIVATE_DATA)];
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
    /// The Tokio runtime that ran the endpoint's (or driver's) background tasks shut down: no
    /// completion can wake a waiting operation any more, and no timer or RDMA CM event of the
    /// connection is handled. Every queue pair of that driver was moved to the error state;
    /// operations still in flight resolve once their flush completion is polled (the waiting
    /// future polls for it itself), new ones fail at once.
    ///
    /// What to do: keep the runtime that opened the endpoint alive as long as its connections
    /// are used, or open a new endpoint on the runtime that uses them.
    #[error("the runtime that ran this endpoint's driver shut down")]
    DriverStopped,
    /// This side closed, and what had to go out before end of stream (messages waiting for
    /// credits, rendezvous messages the peer had not read) did not within the close timeout
    /// (`ConnectOptions::close_timeout`): the peer is alive but does not take them. The
    /// connection was torn down without a clean end of stream, and their memory released.
    #[error(
        "end of stream could not go out within {0:?} of the close: the peer did not take what was still to send"
    )]
    CloseTimeout(std::time::Duration),
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
mod invalid_tests;
#[cfg(test)]
mod tests;
