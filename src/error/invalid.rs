//! [`InvalidArgument`]: why an argument was refused before any verb was called, one variant per
//! cause, with the numbers the message names as typed fields.
//!
//! The error layer sits below `driver` and `buf` (`tests/layers.rs`), so a variant about one of
//! their types carries that type's data: a [`RemoteAccess`](crate::buf::RemoteAccess) as the
//! [`AccessFlags`] it maps to, a [`SizeClass`](crate::buf::SizeClass) as `(size, count)`, a
//! [`CompletionMode`](crate::driver::CompletionMode) as its name and `max_spin`. The messages
//! print them as those types' `Debug` does.

use std::fmt::Write as _;
use std::ops::{Bound, Range};
use std::time::Duration;

use crate::verbs::AccessFlags;

/// Why a buffer without an lkey (a plain `Vec` or `BytesMut`) is refused, and what to use.
const NO_LKEY: &str = "buffer has no lkey (a plain Vec or BytesMut is not \
    registered memory): on a Connection take it from the connection's pool \
    (`conn.pool()?.acquire(len)`; memory registered in any other protection domain is refused \
    too); on an AsyncQp use a pool or RegisteredBuffer of the queue pair's protection domain";

/// Why local memory from another protection domain is refused (the device would fail the
/// operation with `IBV_WC_LOC_PROT_ERR` and the connection with it).
const FOREIGN_LOCAL: &str = "the local buffer is not registered in this connection's \
    protection domain (each connection has its own): take it from this connection's pool \
    (`conn.pool()?.acquire(len)`), not from another connection's pool or a pool or \
    RegisteredBuffer on a protection domain of your own";

/// What was wrong with an argument: the cause of [`Error::InvalidArgument`](crate::Error::InvalidArgument).
///
/// Each variant is one failure, its fields the values the message names; the message (its
/// `Display`) says what to do where there is a remedy. Match on a variant to handle one cause;
/// new variants may be added.
///
/// # Examples
///
/// ```
/// use tokio_rdma::buf::RemoteToken;
/// use tokio_rdma::{Error, InvalidArgument};
///
/// let token = RemoteToken::try_new(0x1000, 64, 7)?;
/// match token.check(60, 8) {
///     Err(Error::InvalidArgument(InvalidArgument::TokenRange { offset, len, token_len })) => {
///         assert_eq!((offset, len, token_len), (60, 8, 64));
///     }
///     other => panic!("{other:?}"),
/// }
/// # Ok::<(), tokio_rdma::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidArgument {
    // ---- Local buffers of operations (ops) ----
    /// A buffer with no lkey (not registered memory) given to an operation.
    ///
    /// What to do: on a `Connection` take it from `conn.pool()`; on an `AsyncQp` use a pool
    /// or `RegisteredBuffer` of the queue pair's protection domain.
    #[error("{}", NO_LKEY)]
    NoLkey,
    /// The local buffer of an atomic has no lkey (as [`NoLkey`](Self::NoLkey)).
    #[error("atomic {}", NO_LKEY)]
    AtomicNoLkey,
    /// A buffer longer than one scatter/gather entry can describe (4 GiB).
    #[error("buffer of {len} bytes exceeds 4 GiB")]
    BufferTooLarge {
        /// Its length.
        len: usize,
    },
    /// More scatter/gather entries than the queue pair takes per work request.
    #[error("{count} scatter/gather entries exceed the queue pair's limit of {max}")]
    TooManySges {
        /// Entries given.
        count: usize,
        /// The queue pair's `max_send_sge` / `max_recv_sge`.
        max: u32,
    },
    /// The local buffer of an atomic holds fewer than 8 bytes.
    #[error("an atomic needs an 8-byte local buffer")]
    AtomicBufferTooSmall,
    /// The remote address of an atomic is not 8-byte aligned.
    #[error("atomic target {addr:#x} is not 8-byte aligned")]
    AtomicUnaligned {
        /// The remote address.
        addr: u64,
    },

    // ---- Messages ----
    /// A message longer than the connection's negotiated maximum message size.
    #[error("message of {len} bytes exceeds the connection's limit of {max}")]
    MessageTooLarge {
        /// Its length.
        len: u64,
        /// The negotiated maximum.
        max: u64,
    },
    /// A rendezvous send on a connection that did not negotiate rendezvous.
    #[error("rendezvous was not negotiated on this connection")]
    RendezvousNotNegotiated,
    /// An empty message sent by rendezvous.
    #[error("an empty message cannot go by rendezvous")]
    EmptyRendezvous,
    /// The next message is larger than the buffer given to receive it; it stays queued.
    ///
    /// What to do: receive it with a larger buffer, or with `recv`.
    #[error(
        "the next message has {len} bytes, more than the {capacity}-byte buffer holds; it stays \
         queued (receive it with a larger buffer or with recv)"
    )]
    RecvBufferTooSmall {
        /// The message's length.
        len: u64,
        /// The buffer's capacity.
        capacity: usize,
    },
    /// A received message too large to allocate at all.
    #[error("a {len}-byte message does not fit memory")]
    MessageExceedsMemory {
        /// Its length.
        len: usize,
    },
    /// The allocator had no memory for a received message.
    ///
    /// What to do: receive it with `recv_into` into a buffer of your own.
    #[error(
        "no memory for a {len}-byte message (receive it with recv_into into a buffer of \
         your own)"
    )]
    NoMemoryForMessage {
        /// Its length.
        len: usize,
    },

    // ---- Completion queues and endpoint options ----
    /// The completion queue has too few entries left for another queue pair's depths.
    ///
    /// What to do: raise `cq_size` up to `max_cqe`, use shallower queues, or open another
    /// endpoint on the device.
    #[error(
        "completion queue of {capacity} entries cannot take another queue pair of depth {depth} \
         ({used} already used; every queue pair reserves its send and receive depths): \
         raise EndpointOptions::cq_size (or DriverOptions::cq_size) up to the \
         device's max_cqe {max_cqe}, use shallower queues (ConnectOptions::recv_credits, \
         send_queue_depth), or open another Endpoint on the device"
    )]
    CqFullForQp {
        /// The completion queue's entries.
        capacity: u64,
        /// The queue pair's send plus receive depth.
        depth: u64,
        /// Entries already reserved.
        used: u64,
        /// The device's `max_cqe`.
        max_cqe: u32,
    },
    /// The completion queue has too few entries left (for a shared receive queue's depth).
    ///
    /// What to do: raise `EndpointOptions::cq_size` up to `max_cqe`.
    #[error(
        "completion queue of {capacity} entries cannot take {needed} more ({used} already used): \
         raise EndpointOptions::cq_size up to the device's max_cqe {max_cqe}"
    )]
    CqFull {
        /// The completion queue's entries.
        capacity: u64,
        /// Entries asked for.
        needed: u64,
        /// Entries already reserved.
        used: u64,
        /// The device's `max_cqe`.
        max_cqe: u32,
    },
    /// `EndpointOptions::cq_size` is 0 or above the device's `max_cqe`.
    #[error("cq_size {cq_size} is not in 1..={max_cqe} (the device's max_cqe)")]
    CqSizeOutOfRange {
        /// The size asked for.
        cq_size: u32,
        /// The device's `max_cqe`.
        max_cqe: u32,
    },
    /// `EndpointOptions::poll_batch` is 0 or above 4096.
    #[error("poll_batch {poll_batch} is not in 1..=4096")]
    PollBatchOutOfRange {
        /// The batch asked for.
        poll_batch: usize,
    },
    /// An adaptive completion mode whose `max_spin` exceeds one second.
    ///
    /// What to do: use `CompletionMode::BusyPoll` to spin without limit.
    #[error(
        "adaptive max_spin {max_spin:?} exceeds one second: use BusyPoll to spin \
         without limit"
    )]
    AdaptiveSpinTooLong {
        /// The `max_spin` asked for.
        max_spin: Duration,
    },
    /// `ConnectOptions::completion_mode` differs from the endpoint's mode (boxed: the two
    /// modes would make every [`Error`](crate::Error) 8 bytes larger, and errors move through
    /// every operation's result).
    ///
    /// What to do: leave it unset; the mode belongs to the endpoint (`EndpointOptions`).
    #[error(
        "ConnectOptions::completion_mode {} differs from the endpoint's {}: \
         the mode belongs to the endpoint (EndpointOptions)",
        mode(.0.requested, .0.requested_max_spin),
        mode(.0.endpoint, .0.endpoint_max_spin)
    )]
    CompletionModeMismatch(Box<ModeMismatch>),
    /// `Endpoint::export_metrics` with a period of zero.
    #[error("a metrics export period of zero")]
    ZeroExportPeriod,
    /// `Endpoint::export_metrics` while an exporter of the endpoint runs.
    #[error("a metrics exporter of this endpoint is already running")]
    ExporterRunning,

    // ---- Connection options ----
    /// A listener's backlog of 0.
    #[error("a listener's backlog must be at least 1")]
    ZeroBacklog,
    /// A listener's backlog above the largest accepted.
    #[error("a listener's backlog of {backlog} is above {max}")]
    BacklogTooLarge {
        /// The backlog asked for.
        backlog: usize,
        /// The largest accepted.
        max: usize,
    },
    /// `ConnectOptions::retry_count` above 6.
    #[error("retry_count {retry_count} is not in 0..=6 (7 means retry forever on some devices)")]
    RetryCountOutOfRange {
        /// The count asked for.
        retry_count: u8,
    },
    /// `ConnectOptions::max_send_chunk` below the smallest receive buffer.
    #[error("max_send_chunk {max_send_chunk} is below {min} bytes")]
    SendChunkTooSmall {
        /// The chunk size asked for.
        max_send_chunk: u32,
        /// The least allowed.
        min: u32,
    },
    /// `ConnectOptions::send_queue_depth` above what any device's queue pair takes.
    #[error(
        "send_queue_depth {send_queue_depth} is above {max} (no device has send queues this \
         deep)"
    )]
    SendQueueDepthTooLarge {
        /// The depth asked for.
        send_queue_depth: u32,
        /// The largest allowed.
        max: u32,
    },
    /// A local ACK timeout code above 31 (`ConnectOptions::ack_timeout`,
    /// `RawOptions::ack_timeout`).
    #[error("ack_timeout {ack_timeout} is not in 0..=31 (a 5-bit code: 4.096 us x 2^n)")]
    AckTimeoutOutOfRange {
        /// The code asked for.
        ack_timeout: u8,
    },
    /// A keepalive interval or keepalive timeout of zero.
    #[error("ConnectOptions::{option} of zero (keepalive(None) sends no keepalives)")]
    ZeroKeepalive {
        /// The option: `"keepalive"` or `"keepalive_timeout"`.
        option: &'static str,
    },
    /// `ConnectOptions::max_staged_chunks` of 0.
    #[error("max_staged_chunks 0: copied sends could never go out")]
    ZeroStagedChunks,
    /// An offer of remote memory asked for on an endpoint with a shared receive queue.
    #[error(
        "ConnectOptions::{option} cannot apply on an endpoint with a shared receive queue: \
         its connections share one protection domain, so memory opened to one peer would \
         be open to every peer"
    )]
    OfferWithSrq {
        /// The option: `"one_sided(true)"`, `"atomics(true)"` or
        /// `"rendezvous_threshold(Some(..))"`.
        option: &'static str,
    },
    /// `ConnectOptions::recv_buf_size` other than the shared receive queue's buffer size.
    #[error(
        "ConnectOptions::recv_buf_size {recv_buf_size} differs from the shared receive queue's \
         buffer size {srq_buffer_size} (SrqOptions::buffer_size), which every connection on it \
         receives into"
    )]
    RecvBufSizeMismatch {
        /// The size asked for.
        recv_buf_size: u32,
        /// The queue's buffer size.
        srq_buffer_size: u32,
    },
    /// `SrqOptions::buffers` is 0 or too large.
    #[error("SrqOptions::buffers {buffers} is not in 1..{limit}")]
    SrqBuffersOutOfRange {
        /// The count asked for.
        buffers: u32,
        /// The exclusive upper bound.
        limit: u32,
    },
    /// `SrqOptions::buffer_size` outside 64 bytes ..= 16 MiB.
    #[error("SrqOptions::buffer_size {buffer_size} is not in 64..=16 MiB")]
    SrqBufferSizeOutOfRange {
        /// The size asked for.
        buffer_size: u32,
    },
    /// `SrqOptions::low_watermark` not below `buffers`.
    #[error("SrqOptions::low_watermark Some({low_watermark}) is not below buffers {buffers}")]
    SrqLowWatermark {
        /// The watermark asked for.
        low_watermark: u32,
        /// The queue's buffers.
        buffers: u32,
    },

    // ---- Grants and one-sided access on a connection ----
    /// A grant of read or write on a connection that does not offer one-sided access.
    ///
    /// What to do: `ConnectOptions::one_sided(true)` on this side.
    #[error(
        "a grant of {} on a connection that does not offer one-sided access \
         (ConnectOptions::one_sided(true) on this side)",
        remote_access_debug(*access)
    )]
    GrantWithoutOneSided {
        /// The rights asked for ([`RemoteAccess::to_flags`](crate::buf::RemoteAccess::to_flags)).
        access: AccessFlags,
    },
    /// A grant of atomics on a connection that does not offer atomics.
    ///
    /// What to do: `ConnectOptions::atomics(true)` on this side.
    #[error(
        "a grant of {} on a connection that does not offer atomics \
         (ConnectOptions::atomics(true) on this side)",
        remote_access_debug(*access)
    )]
    GrantWithoutAtomics {
        /// The rights asked for ([`RemoteAccess::to_flags`](crate::buf::RemoteAccess::to_flags)).
        access: AccessFlags,
    },
    /// A local buffer of a one-sided operation not registered in the connection's protection
    /// domain.
    ///
    /// What to do: take it from this connection's pool (`conn.pool()?.acquire(len)`).
    #[error("{}", FOREIGN_LOCAL)]
    ForeignLocalBuffer,
    /// An atomic on a connection whose peer does not offer atomics.
    #[error(
        "the peer does not offer atomics on this connection (ConnectOptions::atomics \
         on the peer's side)"
    )]
    PeerNoAtomics,
    /// A READ or WRITE on a connection whose peer does not offer one-sided access.
    #[error(
        "the peer does not offer one-sided access on this connection \
         (ConnectOptions::one_sided on the peer's side)"
    )]
    PeerNoOneSided,
    /// A grant with no right.
    #[error("a grant needs at least one right")]
    GrantWithoutRights,
    /// A grant range that is empty or beyond the buffer's initialised bytes.
    #[error("grant range {range:?} is empty or outside the {init} initialised bytes")]
    GrantRange {
        /// The range asked for.
        range: Range<usize>,
        /// The buffer's initialised bytes.
        init: usize,
    },
    /// `RemoteAccess::ON_DEMAND` asked of a window grant.
    ///
    /// What to do: use a dedicated registration (`Grant::region`).
    #[error(
        "a window grant uses the buffer's own registration; RemoteAccess::ON_DEMAND \
         needs a dedicated registration (Grant::region)"
    )]
    OnDemandWindow,
    /// A memory window bind's `wait` returned another request's completion (the window and
    /// its buffer are leaked).
    #[error("`wait` returned the completion of request {got} instead of the bind's ({expected})")]
    ForeignCompletion {
        /// The `wr_id` of the completion returned.
        got: u64,
        /// The bind's `wr_id`.
        expected: u64,
    },
    /// A shared grant with no right, or asked on demand.
    #[error(
        "a shared grant needs read, write or atomic rights and is pinned; got {}",
        remote_access_debug(*access)
    )]
    SharedGrantRights {
        /// The rights asked for ([`RemoteAccess::to_flags`](crate::buf::RemoteAccess::to_flags)).
        access: AccessFlags,
    },
    /// A shared grant range that is empty or beyond the region.
    #[error("grant range {range:?} is empty or outside the region's {region_len} bytes")]
    SharedGrantRange {
        /// The range asked for.
        range: Range<usize>,
        /// The region's length.
        region_len: usize,
    },

    // ---- Remote tokens ----
    /// A remote token whose range wraps the address space.
    #[error("remote token wraps the address space: {len} bytes at {addr:#x}")]
    TokenWraps {
        /// Its address.
        addr: u64,
        /// Its length.
        len: u64,
    },
    /// A slice of a remote token outside the token.
    #[error("remote slice {start:?}..{end:?} outside a token of {token_len} bytes")]
    TokenSlice {
        /// The slice's start bound.
        start: Bound<u64>,
        /// The slice's end bound.
        end: Bound<u64>,
        /// The token's length.
        token_len: u64,
    },
    /// An access range outside a remote token.
    #[error("{len} bytes at offset {offset} exceed a remote token of {token_len} bytes")]
    TokenRange {
        /// Offset into the token.
        offset: u64,
        /// Length of the access.
        len: u64,
        /// The token's length.
        token_len: u64,
    },
    /// An encoded remote token that is not 20 bytes.
    #[error("remote token: expected 20 bytes, got {got}")]
    TokenLength {
        /// The length given.
        got: usize,
    },

    // ---- Pools, registration and mappings ----
    /// A pool configuration with no size class.
    #[error("a pool needs a size class")]
    NoSizeClass,
    /// A size class of no buffers, of size 0, or too large.
    #[error("invalid size class SizeClass {{ size: {size}, count: {count} }}")]
    InvalidSizeClass {
        /// Its `size`.
        size: usize,
        /// Its `count`.
        count: usize,
    },
    /// Two size classes of one size (after rounding up to 64 bytes).
    #[error("duplicate size classes in {}", size_classes(classes))]
    DuplicateSizeClasses {
        /// The classes as given, `(size, count)`.
        classes: Vec<(usize, usize)>,
    },
    /// More than 65,535 size classes.
    #[error("too many size classes")]
    TooManySizeClasses,
    /// A pool buffer larger than the pool's largest size class.
    #[error("pool buffer of {len} bytes requested; the largest size class is {largest} bytes")]
    PoolBufferTooLarge {
        /// The length asked for.
        len: usize,
        /// The largest class's size.
        largest: usize,
    },
    /// An empty buffer to register.
    #[error("cannot register an empty buffer")]
    EmptyRegistration,
    /// A range to register through the registration cache that is empty or wraps.
    #[error("cannot register {len} bytes at {addr:#x}")]
    CacheRange {
        /// Its length.
        len: usize,
        /// Its address.
        addr: usize,
    },
    /// A buffer length no page-aligned allocation can have.
    #[error("buffer of {len} bytes: {error}")]
    BufferLayout {
        /// The length asked for.
        len: usize,
        /// Why the layout was refused.
        error: std::alloc::LayoutError,
    },
    /// The allocator had no memory for a registered buffer.
    #[error("allocation of {len} bytes failed")]
    AllocationFailed {
        /// The length asked for.
        len: usize,
    },
    /// A memory mapping of 0 bytes.
    #[error("cannot map 0 bytes")]
    EmptyMapping,
    /// A mapping length that overflows when rounded up to whole pages.
    #[error("mapping of {len} bytes overflows")]
    MappingOverflow {
        /// The length asked for.
        len: usize,
    },

    // ---- Verbs ----
    /// A completion queue size above `i32::MAX`.
    #[error("cqe {cqe} too large")]
    CqeTooLarge {
        /// The size asked for.
        cqe: u32,
    },
    /// Reading a completion event of a CQ made without a completion channel.
    #[error("CQ has no completion channel")]
    CqWithoutChannel,
    /// A completion event for another CQ arrived on this CQ's channel.
    #[error("CQ event for another completion queue on this channel")]
    ForeignCqEvent,
    /// Memory window rights other than remote rights.
    #[error("window rights must be remote rights only, got {access:?}")]
    WindowRights {
        /// The rights asked for.
        access: AccessFlags,
    },
    /// A memory window range outside its memory region.
    #[error("window range {addr:#x}+{len} is outside its memory region")]
    WindowRange {
        /// Its address.
        addr: u64,
        /// Its length.
        len: u64,
    },
    /// A prefetch of a region not registered on demand.
    #[error("prefetch needs a region registered with AccessFlags::ON_DEMAND")]
    PrefetchNotOnDemand,
    /// A prefetch range that is empty, longer than 4 GiB, or outside the region.
    #[error(
        "prefetch range {range:?} is empty, longer than 4 GiB or outside the {region_len}-byte \
         region"
    )]
    PrefetchRange {
        /// The range asked for.
        range: Range<usize>,
        /// The region's length.
        region_len: usize,
    },
    /// `MemoryRegion::prefetch` called outside a Tokio runtime.
    #[error("MemoryRegion::prefetch needs a Tokio runtime")]
    PrefetchWithoutRuntime,
    /// A shared receive queue size outside the device's limits.
    #[error(
        "a shared receive queue of {max_wr} receives x {max_sge} entries: {device} allows \
         1..={max_srq_wr} receives and 1..={max_srq_sge} entries (max_srq_wr, max_srq_sge)"
    )]
    SrqSize {
        /// Receives asked for.
        max_wr: u32,
        /// Entries per receive asked for.
        max_sge: u32,
        /// The device.
        device: String,
        /// The device's `max_srq_wr`.
        max_srq_wr: u32,
        /// The device's `max_srq_sge`.
        max_srq_sge: u32,
    },
    /// An encoded [`QpAddress`](crate::verbs::QpAddress) of the wrong length.
    #[error("endpoint: expected {expected} bytes, got {got}")]
    QpAddressLength {
        /// The encoded length.
        expected: usize,
        /// The length given.
        got: usize,
    },
    /// An encoded [`QpAddress`](crate::verbs::QpAddress) of an unknown version.
    #[error("endpoint: unsupported version {version}")]
    QpAddressVersion {
        /// The version byte.
        version: u8,
    },
    /// An encoded [`QpAddress`](crate::verbs::QpAddress) whose QPN or PSN exceeds 24 bits.
    #[error("endpoint: qpn/psn exceed 24 bits")]
    QpAddressQpnPsn {
        /// The QPN.
        qpn: u32,
        /// The PSN.
        psn: u32,
    },
    /// An encoded [`QpAddress`](crate::verbs::QpAddress) with an unknown MTU code.
    #[error("endpoint: invalid mtu code {code}")]
    QpAddressMtu {
        /// The MTU code.
        code: u8,
    },
    /// RDMA CM connection parameters with a retry count above 7.
    #[error(
        "{call}: retry_count {retry_count} / rnr_retry_count {rnr_retry_count} exceed 7 \
         (3-bit fields)"
    )]
    ConnParamRetryCount {
        /// The call: `"rdma_connect"` or `"rdma_accept"`.
        call: &'static str,
        /// The retry count.
        retry_count: u8,
        /// The RNR retry count.
        rnr_retry_count: u8,
    },
    /// RDMA CM connection parameters with a QP number above 24 bits.
    #[error("{call}: qp_num {qp_num:#x} exceeds 24 bits")]
    ConnParamQpNum {
        /// The call: `"rdma_connect"` or `"rdma_accept"`.
        call: &'static str,
        /// The QP number.
        qp_num: u32,
    },
    /// An RDMA CM id not bound to a device yet.
    ///
    /// What to do: resolve its address first, or use the id of a `CONNECT_REQUEST`.
    #[error(
        "the RDMA CM id is not bound to a device yet (resolve its address first, or \
         use the id of a CONNECT_REQUEST)"
    )]
    CmIdUnbound,
    /// An RDMA CM id whose device `rdma_get_devices` does not list.
    #[error("the RDMA CM id's device is not in rdma_get_devices()")]
    CmDeviceUnknown,

    // ---- Raw connections ----
    /// `RawOptions` retry counts above 7.
    #[error(
        "retry_count {retry_count} / rnr_retry_count {rnr_retry_count} exceed 7 (3-bit fields)"
    )]
    RawRetryCount {
        /// The retry count.
        retry_count: u8,
        /// The RNR retry count.
        rnr_retry_count: u8,
    },
    /// A raw queue pair with neither a send nor a receive queue.
    #[error("a raw queue pair needs a send or a receive queue")]
    RawQpWithoutQueues,
    /// The address is reached through another device than the endpoint's.
    ///
    /// What to do: use an endpoint on that device, or an address of the endpoint's device.
    #[error(
        "the address is reached through device {device}, not through the endpoint's device \
         {endpoint_device}"
    )]
    WrongDevice {
        /// The device the address is reached through.
        device: String,
        /// The endpoint's device.
        endpoint_device: String,
    },
    /// An [`OwnedQp`](crate::owned::OwnedQp) post on a full send queue (its requests in
    /// flight are as many as the queue holds).
    ///
    /// What to do: wait for a completion (`wait`, `next`) before posting more, or create the
    /// queue pair with a deeper send queue.
    #[error("the send queue is full ({depth} requests in flight)")]
    SendQueueFull {
        /// The queue's depth.
        depth: u32,
    },
    /// An [`OwnedQp`](crate::owned::OwnedQp) post on a full receive queue.
    ///
    /// What to do: wait for a receive to complete before posting more, or create the queue
    /// pair with a deeper receive queue.
    #[error("the receive queue is full ({depth} receives posted)")]
    RecvQueueFull {
        /// The queue's depth.
        depth: u32,
    },
    /// Every slot of an [`OwnedQp`](crate::owned::OwnedQp) holds a request in flight or a
    /// completion nobody took: tickets were dropped without being waited for.
    ///
    /// What to do: take completions with `next_completion()` (or wait for each ticket).
    #[error(
        "all {slots} request slots hold completions that were not taken (take them with next_completion())"
    )]
    UncollectedCompletions {
        /// The queue pair's slots.
        slots: u32,
    },
    /// A request added to an [`OwnedQp`](crate::owned::OwnedQp) batch that already holds its
    /// maximum.
    ///
    /// What to do: post the batch ([`Batch::post`](crate::owned::Batch::post)) and start
    /// another.
    #[error("the batch already holds {max} requests")]
    BatchFull {
        /// The most requests a batch holds.
        max: usize,
    },
    /// A [`Ticket`](crate::owned::Ticket) given to another queue pair than the one that issued
    /// it, or one whose completion was already taken.
    #[error("the ticket is not one of this queue pair's requests waiting to be taken")]
    ForeignTicket,
    /// An [`OwnedQp`](crate::owned::OwnedQp) queue deeper than its maximum, or no queue at all.
    #[error(
        "queue depths of {send} sends and {recv} receives: each must be at most {max}, and one non-zero"
    )]
    QueueDepthOutOfRange {
        /// The send queue's depth asked for.
        send: u32,
        /// The receive queue's.
        recv: u32,
        /// The maximum of each.
        max: u32,
    },
    /// An [`OwnedQp`](crate::owned::OwnedQp) created outside a Tokio runtime (its waits sleep
    /// in the runtime's reactor).
    #[error("an OwnedQp must be created inside a Tokio runtime")]
    OwnedQpWithoutRuntime,
    /// A raw request prepared on a listener that has no endpoint.
    #[error("the listener has no endpoint for raw requests")]
    NoRawEndpoint,
}

/// The two completion modes of [`InvalidArgument::CompletionModeMismatch`], each as its name
/// (`"Event"`, `"BusyPoll"`, `"Adaptive"`) and `max_spin` (for `Adaptive`): the error layer sits
/// below the driver's `CompletionMode`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ModeMismatch {
    /// The mode asked for.
    pub requested: &'static str,
    /// Its `max_spin`, for `Adaptive`.
    pub requested_max_spin: Option<Duration>,
    /// The endpoint's mode.
    pub endpoint: &'static str,
    /// Its `max_spin`, for `Adaptive`.
    pub endpoint_max_spin: Option<Duration>,
}

/// A completion mode as its `Debug` shows it: `Event`, `Adaptive { max_spin: 2ms }`.
fn mode(name: &str, max_spin: Option<Duration>) -> String {
    match max_spin {
        Some(d) => format!("{name} {{ max_spin: {d:?} }}"),
        None => name.to_string(),
    }
}

/// Remote rights (as verbs flags) as `RemoteAccess`'s `Debug` shows them:
/// `RemoteAccess(READ | WRITE)` (that `Debug` calls this).
pub(crate) fn remote_access_debug(flags: AccessFlags) -> String {
    let names = [
        (AccessFlags::REMOTE_READ, "READ"),
        (AccessFlags::REMOTE_WRITE, "WRITE"),
        (AccessFlags::REMOTE_ATOMIC, "ATOMIC"),
        (AccessFlags::ON_DEMAND, "ON_DEMAND"),
    ];
    let set: Vec<&str> = names
        .iter()
        .filter(|(f, _)| flags.contains(*f))
        .map(|(_, n)| *n)
        .collect();
    if set.is_empty() {
        "RemoteAccess(NONE)".to_string()
    } else {
        format!("RemoteAccess({})", set.join(" | "))
    }
}

/// Size classes as `[SizeClass]`'s `Debug` shows them.
fn size_classes(classes: &[(usize, usize)]) -> String {
    let mut out = String::from("[");
    for (i, (size, count)) in classes.iter().enumerate() {
        let sep = if i == 0 { "" } else { ", " };
        let _ = write!(out, "{sep}SizeClass {{ size: {size}, count: {count} }}");
    }
    out.push(']');
    out
}
