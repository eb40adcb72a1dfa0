//! Reliable-connected queue pairs (`ibv_qp`): creation, state transitions from a plain endpoint
//! description, and posting.

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use super::cq::CompletionQueue;
use super::pd::ProtectionDomain;
use super::srq::SharedReceiveQueue;
use super::types::{AccessFlags, Gid, Mtu};
use super::wr::{RecvWr, SendWr, post_chain};
use crate::error::{Error, InvalidArgument, Result};
use crate::sys;

/// Queue pair state (`enum ibv_qp_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QpState {
    /// Freshly created.
    Reset,
    /// Initialised: receives may be posted.
    Init,
    /// Ready to receive.
    Rtr,
    /// Ready to send.
    Rts,
    /// Send queue drained.
    Sqd,
    /// Send queue error.
    Sqe,
    /// Error: every outstanding request is flushed with `IBV_WC_WR_FLUSH_ERR`.
    Err,
    /// A value this crate does not know.
    Unknown(u32),
}

impl QpState {
    pub(crate) fn to_raw(self) -> u32 {
        match self {
            QpState::Reset => sys::IBV_QPS_RESET,
            QpState::Init => sys::IBV_QPS_INIT,
            QpState::Rtr => sys::IBV_QPS_RTR,
            QpState::Rts => sys::IBV_QPS_RTS,
            QpState::Sqd => sys::IBV_QPS_SQD,
            QpState::Sqe => sys::IBV_QPS_SQE,
            QpState::Err => sys::IBV_QPS_ERR,
            QpState::Unknown(raw) => raw,
        }
    }

    pub(crate) fn from_raw(raw: u32) -> QpState {
        match raw {
            sys::IBV_QPS_RESET => QpState::Reset,
            sys::IBV_QPS_INIT => QpState::Init,
            sys::IBV_QPS_RTR => QpState::Rtr,
            sys::IBV_QPS_RTS => QpState::Rts,
            sys::IBV_QPS_SQD => QpState::Sqd,
            sys::IBV_QPS_SQE => QpState::Sqe,
            sys::IBV_QPS_ERR => QpState::Err,
            other => QpState::Unknown(other),
        }
    }
}

/// Queue sizes and limits of a queue pair (`struct ibv_qp_cap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Outstanding send-queue work requests.
    pub max_send_wr: u32,
    /// Outstanding receive-queue work requests.
    pub max_recv_wr: u32,
    /// Scatter/gather entries per send request.
    pub max_send_sge: u32,
    /// Scatter/gather entries per receive request.
    pub max_recv_sge: u32,
    /// Largest payload that can be sent inline.
    pub max_inline_data: u32,
}

impl Default for QpCaps {
    fn default() -> QpCaps {
        QpCaps {
            max_send_wr: 128,
            max_recv_wr: 128,
            max_send_sge: 4,
            max_recv_sge: 4,
            max_inline_data: 0,
        }
    }
}

/// Creation parameters of an RC queue pair.
///
/// # Examples
///
/// ```no_run
/// # use tokio_rdma::verbs::*;
/// # let ctx = Context::open("rxe0")?; let pd = ProtectionDomain::new(&ctx)?;
/// let cq = CompletionQueue::new(&ctx, 512, None)?;
/// let mut attr = QpInitAttr::new(&cq, &cq);
/// attr.caps.max_send_wr = 256;
/// attr.caps.max_inline_data = 64;
/// let qp = QueuePair::new_rc(&pd, &attr)?;
/// # Ok::<(), tokio_rdma::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct QpInitAttr {
    /// Completion queue for send-queue completions.
    pub send_cq: CompletionQueue,
    /// Completion queue for receive completions.
    pub recv_cq: CompletionQueue,
    /// Requested sizes (the device may grant more; see [`QueuePair::caps`]).
    pub caps: QpCaps,
    /// Signal every send-queue request regardless of its `signaled` flag.
    pub sq_sig_all: bool,
    /// Take receives from this shared receive queue instead of a receive queue of its own
    /// (`caps.max_recv_wr` is then ignored; the queue pair keeps the SRQ alive).
    pub srq: Option<SharedReceiveQueue>,
}

impl QpInitAttr {
    /// Default capabilities with the given completion queues.
    pub fn new(send_cq: &CompletionQueue, recv_cq: &CompletionQueue) -> QpInitAttr {
        QpInitAttr {
            send_cq: send_cq.clone(),
            recv_cq: recv_cq.clone(),
            caps: QpCaps::default(),
            sq_sig_all: false,
            srq: None,
        }
    }
}

/// What a peer needs to know to connect its queue pair to ours: the plain queue-pair address
/// exchanged out of band (or carried by RDMA CM).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpAddress {
    /// Queue pair number.
    pub qpn: u32,
    /// Initial packet sequence number (24 bits) of the sender.
    pub psn: u32,
    /// The port's GID (mandatory on RoCE).
    pub gid: Gid,
    /// The port's LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// The largest MTU the endpoint's port uses.
    pub mtu: Mtu,
}

impl QpAddress {
    /// Size of the wire encoding.
    pub const WIRE_LEN: usize = 1 + 4 + 4 + 16 + 2 + 1;
    const WIRE_VERSION: u8 = 1;

    /// Encodes the endpoint for an out-of-band exchange (versioned, big endian).
    pub fn to_bytes(&self) -> [u8; Self::WIRE_LEN] {
        let mut b = [0u8; Self::WIRE_LEN];
        b[0] = Self::WIRE_VERSION;
        b[1..5].copy_from_slice(&self.qpn.to_be_bytes());
        b[5..9].copy_from_slice(&self.psn.to_be_bytes());
        b[9..25].copy_from_slice(&self.gid.0);
        b[25..27].copy_from_slice(&self.lid.to_be_bytes());
        b[27] = self.mtu.to_raw() as u8;
        b
    }

    /// Decodes and validates an encoded endpoint.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a wrong length, unknown version, QPN or PSN beyond 24
    /// bits, or an invalid MTU.
    pub fn from_bytes(b: &[u8]) -> Result<QpAddress> {
        let bad = |why: InvalidArgument| Err(Error::InvalidArgument(why));
        if b.len() != Self::WIRE_LEN {
            return bad(InvalidArgument::QpAddressLength {
                expected: Self::WIRE_LEN,
                got: b.len(),
            });
        }
        if b[0] != Self::WIRE_VERSION {
            return bad(InvalidArgument::QpAddressVersion { version: b[0] });
        }
        let word =
            |r: std::ops::Range<usize>| u32::from_be_bytes(b[r].try_into().expect("4 bytes"));
        let (qpn, psn) = (word(1..5), word(5..9));
        if qpn > 0xff_ffff || psn > 0xff_ffff {
            return bad(InvalidArgument::QpAddressQpnPsn { qpn, psn });
        }
        let Some(mtu) = Mtu::from_raw(u32::from(b[27])) else {
            return bad(InvalidArgument::QpAddressMtu { code: b[27] });
        };
        Ok(QpAddress {
            qpn,
            psn,
            gid: Gid(b[9..25].try_into().expect("16 bytes")),
            lid: u16::from_be_bytes([b[25], b[26]]),
            mtu,
        })
    }
}

/// Parameters of the INIT -> RTR transition that are local choices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RtrOptions {
    /// Local port number.
    pub port: u8,
    /// Index of the local GID to send from (see [`Context::preferred_gid`](super::Context::preferred_gid)).
    pub sgid_index: u8,
    /// Upper bound for the path MTU (the smaller of this and the peer's MTU is used).
    pub max_mtu: Mtu,
    /// RDMA READ / atomic requests the peer may have outstanding at us.
    pub max_dest_rd_atomic: u8,
    /// RNR NAK timer code (`min_rnr_timer`, 12 = 0.64 ms).
    pub min_rnr_timer: u8,
    /// IP hop limit / TTL.
    pub hop_limit: u8,
}

impl RtrOptions {
    /// Defaults for `port` and `sgid_index`: MTU up to 4096, 16 outstanding reads, RNR timer 12.
    pub fn new(port: u8, sgid_index: u8) -> RtrOptions {
        RtrOptions {
            port,
            sgid_index,
            max_mtu: Mtu::Mtu4096,
            max_dest_rd_atomic: 16,
            min_rnr_timer: 12,
            hop_limit: 64,
        }
    }
}

/// Parameters of the RTR -> RTS transition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RtsOptions {
    /// Local ACK timeout code: 4.096 us * 2^timeout (14 is about 67 ms).
    pub timeout: u8,
    /// Transport retries before `IBV_WC_RETRY_EXC_ERR` (max 7).
    pub retry_cnt: u8,
    /// RNR retries (7 means infinite; the crate's default is 6 so a stuck peer is detected).
    pub rnr_retry: u8,
    /// RDMA READ / atomic requests we may have outstanding.
    pub max_rd_atomic: u8,
}

impl Default for RtsOptions {
    fn default() -> RtsOptions {
        RtsOptions {
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 6,
            max_rd_atomic: 16,
        }
    }
}

/// A reliable-connected queue pair. Cheap to clone; destroyed with the last clone. It keeps its
/// protection domain and completion queues alive.
///
/// # Examples
///
/// ```no_run
/// # use tokio_rdma::verbs::*;
/// # fn peer() -> QpAddress { unimplemented!() }
/// let (ctx, port) = Context::open_first_active()?;
/// let gid = ctx.preferred_gid(port)?;
/// let pd = ProtectionDomain::new(&ctx)?;
/// let cq = CompletionQueue::new(&ctx, 256, None)?;
/// let qp = QueuePair::new_rc(&pd, &QpInitAttr::new(&cq, &cq))?;
/// let me = qp.local_address(port, Some(gid.index))?; // send `me.to_bytes()` to the peer
/// let remote = peer();
/// qp.connect(&me, &remote, &RtrOptions::new(port, gid.index as u8), &RtsOptions::default(),
///            AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE)?;
/// # Ok::<(), tokio_rdma::Error>(())
/// ```
#[derive(Clone)]
pub struct QueuePair {
    inner: Arc<QpInner>,
}

struct QpInner {
    qp: NonNull<sys::ibv_qp>,
    qpn: u32,
    caps: QpCaps,
    pd: ProtectionDomain,
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
    /// Dropped after the QP (`Drop` destroys the QP first).
    srq: Option<SharedReceiveQueue>,
    /// A [`Driver`](crate::driver::Driver) owns its work requests and their `wr_id`s: nothing
    /// else may post on it (see [`QueuePair::is_driven`]).
    driven: std::sync::atomic::AtomicBool,
}

// SAFETY: posting and modifying a QP are thread-safe in libibverbs (providers lock their
// queues); the pointer is owned.
unsafe impl Send for QpInner {}
// SAFETY: see `Send`.
unsafe impl Sync for QpInner {}

impl QueuePair {
    /// Creates an RC queue pair (in the RESET state).
    ///
    /// # Errors
    ///
    /// [`Error::CreateQp`] with the errno (e.g. `EINVAL` if a capability exceeds the device's);
    /// [`Error::DriverOwned`] if a completion queue is a driver's or an
    /// [`OwnedQp`](crate::owned::OwnedQp)'s (reachable through `verbs().send_cq()`): a queue
    /// pair of one's own there would hand its completions to requests they do not belong to.
    pub fn new_rc(pd: &ProtectionDomain, attr: &QpInitAttr) -> Result<QueuePair> {
        attr.send_cq.not_driven()?;
        attr.recv_cq.not_driven()?;
        Self::new_rc_driven(pd, attr)
    }

    /// [`new_rc`](Self::new_rc) for the driver (or owned queue pair) that owns the CQs.
    pub(crate) fn new_rc_driven(pd: &ProtectionDomain, attr: &QpInitAttr) -> Result<QueuePair> {
        let mut raw = sys::ibv_qp_init_attr {
            send_cq: attr.send_cq.as_ptr(),
            recv_cq: attr.recv_cq.as_ptr(),
            cap: sys::ibv_qp_cap {
                max_send_wr: attr.caps.max_send_wr,
                max_recv_wr: attr.caps.max_recv_wr,
                max_send_sge: attr.caps.max_send_sge,
                max_recv_sge: attr.caps.max_recv_sge,
                max_inline_data: attr.caps.max_inline_data,
            },
            qp_type: sys::IBV_QPT_RC,
            sq_sig_all: i32::from(attr.sq_sig_all),
            srq: attr
                .srq
                .as_ref()
                .map_or(std::ptr::null_mut(), |q| q.as_ptr()),
            ..Default::default()
        };
        // SAFETY: the PD and CQs are alive and the QP keeps clones of them; `raw` is valid and
        // receives the granted capabilities.
        let qp = unsafe { sys::ibv_create_qp(pd.as_ptr(), &mut raw) };
        let qp = NonNull::new(qp).ok_or_else(|| Error::last_os(Error::CreateQp))?;
        // SAFETY: just created; `qp_num` is a plain field.
        let qpn = unsafe { (*qp.as_ptr()).qp_num };
        let c = raw.cap;
        Ok(QueuePair {
            inner: Arc::new(QpInner {
                qp,
                qpn,
                caps: QpCaps {
                    max_send_wr: c.max_send_wr,
                    max_recv_wr: c.max_recv_wr,
                    max_send_sge: c.max_send_sge,
                    max_recv_sge: c.max_recv_sge,
                    max_inline_data: c.max_inline_data,
                },
                pd: pd.clone(),
                send_cq: attr.send_cq.clone(),
                recv_cq: attr.recv_cq.clone(),
                srq: attr.srq.clone(),
                driven: std::sync::atomic::AtomicBool::new(false),
            }),
        })
    }

    /// Whether a [`Driver`](crate::driver::Driver) owns this queue pair's work requests (it
    /// was created by an [`AsyncQp`](crate::driver::AsyncQp) or a connection). Posting on it
    /// from anywhere else would hand the driver completions it never issued: the safe APIs that
    /// post (memory-window grants) refuse such a queue pair.
    pub fn is_driven(&self) -> bool {
        self.inner.driven.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Marks the queue pair as owned by a driver (see [`is_driven`](Self::is_driven)).
    pub(crate) fn set_driven(&self) {
        self.inner
            .driven
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// The shared receive queue its receives come from, if created with one.
    pub fn srq(&self) -> Option<&SharedReceiveQueue> {
        self.inner.srq.as_ref()
    }

    /// The queue pair number.
    pub fn qpn(&self) -> u32 {
        self.inner.qpn
    }

    /// The capabilities the device granted (may exceed the requested ones).
    pub fn caps(&self) -> QpCaps {
        self.inner.caps
    }

    /// The protection domain.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.inner.pd
    }

    /// The send completion queue.
    pub fn send_cq(&self) -> &CompletionQueue {
        &self.inner.send_cq
    }

    /// The receive completion queue.
    pub fn recv_cq(&self) -> &CompletionQueue {
        &self.inner.recv_cq
    }

    /// Describes this end for the peer: QPN, a fresh random PSN, and the GID/LID/MTU of `port`.
    /// `gid_index` defaults to [`Context::preferred_gid`](super::Context::preferred_gid).
    ///
    /// # Errors
    ///
    /// Port or GID query errors.
    pub fn local_address(&self, port: u8, gid_index: Option<u32>) -> Result<QpAddress> {
        let ctx = self.inner.pd.context();
        let attr = ctx.query_port(port)?;
        let gid = match gid_index {
            Some(i) => {
                ctx.gid_table(port)?
                    .into_iter()
                    .find(|e| e.index == i)
                    .ok_or(Error::NoUsableGid { port })?
                    .gid
            }
            None => ctx.preferred_gid(port)?.gid,
        };
        Ok(QpAddress {
            qpn: self.qpn(),
            psn: random_psn(),
            gid,
            lid: attr.lid,
            mtu: attr.active_mtu.unwrap_or(Mtu::Mtu1024),
        })
    }

    /// RESET -> INIT on `port`, allowing the peer the remote operations in `access`.
    ///
    /// # Errors
    ///
    /// [`Error::ModifyQp`] with the returned error code.
    pub fn to_init(&self, port: u8, access: AccessFlags) -> Result<()> {
        let mut a = sys::ibv_qp_attr {
            qp_state: sys::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: port,
            qp_access_flags: access.bits(),
            ..Default::default()
        };
        self.modify(
            QpState::Init,
            &mut a,
            sys::IBV_QP_STATE
                | sys::IBV_QP_PKEY_INDEX
                | sys::IBV_QP_PORT
                | sys::IBV_QP_ACCESS_FLAGS,
        )
    }

    /// INIT -> RTR towards `remote`.
    ///
    /// # Errors
    ///
    /// [`Error::ModifyQp`] with the returned error code.
    pub fn to_rtr(&self, remote: &QpAddress, opts: &RtrOptions) -> Result<()> {
        let mtu = remote.mtu.min(opts.max_mtu);
        let mut a = sys::ibv_qp_attr {
            qp_state: sys::IBV_QPS_RTR,
            path_mtu: mtu.to_raw(),
            dest_qp_num: remote.qpn,
            rq_psn: remote.psn & 0xff_ffff,
            max_dest_rd_atomic: opts.max_dest_rd_atomic,
            min_rnr_timer: opts.min_rnr_timer,
            ..Default::default()
        };
        a.ah_attr.dlid = remote.lid;
        a.ah_attr.sl = 0;
        a.ah_attr.src_path_bits = 0;
        a.ah_attr.port_num = opts.port;
        if !remote.gid.is_zero() {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid = remote.gid.to_raw();
            a.ah_attr.grh.sgid_index = opts.sgid_index;
            a.ah_attr.grh.hop_limit = opts.hop_limit;
        }
        self.modify(
            QpState::Rtr,
            &mut a,
            sys::IBV_QP_STATE
                | sys::IBV_QP_AV
                | sys::IBV_QP_PATH_MTU
                | sys::IBV_QP_DEST_QPN
                | sys::IBV_QP_RQ_PSN
                | sys::IBV_QP_MAX_DEST_RD_ATOMIC
                | sys::IBV_QP_MIN_RNR_TIMER,
        )
    }

    /// RTR -> RTS, sending from `sq_psn` (the PSN this end advertised in its [`QpAddress`]).
    ///
    /// # Errors
    ///
    /// [`Error::ModifyQp`] with the returned error code.
    pub fn to_rts(&self, sq_psn: u32, opts: &RtsOptions) -> Result<()> {
        let mut a = sys::ibv_qp_attr {
            qp_state: sys::IBV_QPS_RTS,
            sq_psn: sq_psn & 0xff_ffff,
            timeout: opts.timeout,
            retry_cnt: opts.retry_cnt,
            rnr_retry: opts.rnr_retry,
            max_rd_atomic: opts.max_rd_atomic,
            ..Default::default()
        };
        self.modify(
            QpState::Rts,
            &mut a,
            sys::IBV_QP_STATE
                | sys::IBV_QP_TIMEOUT
                | sys::IBV_QP_RETRY_CNT
                | sys::IBV_QP_RNR_RETRY
                | sys::IBV_QP_SQ_PSN
                | sys::IBV_QP_MAX_QP_RD_ATOMIC,
        )
    }

    /// RESET -> INIT -> RTR -> RTS in one call: `local` is the endpoint this side advertised
    /// (its PSN is used as the send PSN), `remote` the peer's.
    ///
    /// # Errors
    ///
    /// [`Error::ModifyQp`] naming the transition that failed.
    pub fn connect(
        &self,
        local: &QpAddress,
        remote: &QpAddress,
        rtr: &RtrOptions,
        rts: &RtsOptions,
        access: AccessFlags,
    ) -> Result<()> {
        self.to_init(rtr.port, access)?;
        self.to_rtr(remote, rtr)?;
        self.to_rts(local.psn, rts)
    }

    /// Moves the queue pair to ERR: outstanding requests are flushed with
    /// `IBV_WC_WR_FLUSH_ERR` and new ones complete in error.
    ///
    /// # Errors
    ///
    /// [`Error::ModifyQp`] with the returned error code.
    pub fn to_error(&self) -> Result<()> {
        let mut a = sys::ibv_qp_attr {
            qp_state: sys::IBV_QPS_ERR,
            ..Default::default()
        };
        self.modify(QpState::Err, &mut a, sys::IBV_QP_STATE)
    }

    /// Queries the current state.
    ///
    /// # Errors
    ///
    /// [`Error::QueryQp`] with the returned error code.
    pub fn state(&self) -> Result<QpState> {
        let mut a = sys::ibv_qp_attr::default();
        let mut init = sys::ibv_qp_init_attr::default();
        // SAFETY: the QP is alive; both out-parameters are valid.
        let rc = unsafe {
            sys::ibv_query_qp(self.as_ptr(), &mut a, sys::IBV_QP_STATE as i32, &mut init)
        };
        if rc != 0 {
            return Err(Error::code(rc, Error::QueryQp));
        }
        Ok(QpState::from_raw(a.qp_state))
    }

    fn modify(&self, to: QpState, attr: &mut sys::ibv_qp_attr, mask: u32) -> Result<()> {
        debug_assert_eq!(attr.qp_state, to.to_raw());
        // SAFETY: the QP is alive and `attr` is fully initialised for the fields in `mask`.
        // ibv_modify_qp returns its error code directly (errno is not reliable).
        let rc = unsafe { sys::ibv_modify_qp(self.as_ptr(), attr, mask as i32) };
        if rc != 0 {
            return Err(Error::code(rc, |source| Error::ModifyQp { to, source }));
        }
        tracing::trace!(qpn = self.qpn(), state = ?to, "queue pair transition");
        Ok(())
    }

    /// Posts send-queue work requests as one chained list (one doorbell).
    ///
    /// # Safety
    ///
    /// Until the completion of each request is polled (or, for unsignaled requests, of a later
    /// signaled request on this queue pair), the memory named by its scatter/gather entries must
    /// stay allocated, registered, and not be accessed in a way that conflicts with the device
    /// (the device reads it for sends/writes, writes it for reads/atomics). Inline requests only
    /// need their memory during this call. The queue pair must not be
    /// [driven](Self::is_driven) by a driver (unless the caller is that driver and owns the
    /// `wr_id`s): its completions would reach the driver's table instead of the caller.
    ///
    /// # Errors
    ///
    /// [`Error::PostSend`] with the index of the first request that was not posted (earlier
    /// ones were) and the returned error code (`ENOMEM`: send queue full; `EINVAL`: bad request).
    pub unsafe fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<()> {
        // SAFETY: the caller's contract covers the memory the requests name.
        unsafe { post_chain(wrs, self.send_doorbell()) }
    }

    /// Posts receive work requests as one chained list.
    ///
    /// # Safety
    ///
    /// The memory named by each request's scatter/gather entries must stay allocated and
    /// registered, and must not be read or written locally, until its completion is polled.
    /// As for [`post_send`](Self::post_send), not on a [driven](Self::is_driven) queue pair.
    ///
    /// # Errors
    ///
    /// [`Error::PostRecv`] with the index of the first request not posted.
    pub unsafe fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        // SAFETY: the caller's contract covers the memory the requests name.
        unsafe { post_chain(wrs, self.recv_doorbell()) }
    }

    /// [`post_send`](Self::post_send) of one request (the driver's fast path: no chain).
    ///
    /// # Safety
    ///
    /// As [`post_send`](Self::post_send).
    #[inline]
    pub(crate) unsafe fn post_send_one(&self, wr: &SendWr<'_>) -> Result<()> {
        // SAFETY: the caller's contract covers the memory the request names.
        unsafe { super::wr::post_single(wr, self.send_doorbell()) }
    }

    /// [`post_recv`](Self::post_recv) of one request (the driver's fast path: no chain).
    ///
    /// # Safety
    ///
    /// As [`post_recv`](Self::post_recv).
    #[inline]
    pub(crate) unsafe fn post_recv_one(&self, wr: &RecvWr<'_>) -> Result<()> {
        // SAFETY: the caller's contract covers the memory the request names.
        unsafe { super::wr::post_single(wr, self.recv_doorbell()) }
    }

    /// `ibv_post_send` on this queue pair, for [`post_chain`] and `post_single`, which hand it
    /// a valid, NULL-terminated list that lives until the call returns.
    #[inline]
    fn send_doorbell(
        &self,
    ) -> impl FnOnce(*mut sys::ibv_send_wr, &mut *mut sys::ibv_send_wr) -> i32 + '_ {
        |head, bad| {
            // SAFETY: the QP is alive (`self` holds it); `post_chain` and `post_single` pass a
            // valid, NULL-terminated list that lives until the call returns.
            unsafe { sys::ibv_post_send(self.as_ptr(), head, bad) }
        }
    }

    /// `ibv_post_recv` on this queue pair, as [`send_doorbell`](Self::send_doorbell).
    #[inline]
    fn recv_doorbell(
        &self,
    ) -> impl FnOnce(*mut sys::ibv_recv_wr, &mut *mut sys::ibv_recv_wr) -> i32 + '_ {
        |head, bad| {
            // SAFETY: as in `send_doorbell`.
            unsafe { sys::ibv_post_recv(self.as_ptr(), head, bad) }
        }
    }

    #[inline]
    pub(crate) fn as_ptr(&self) -> *mut sys::ibv_qp {
        self.inner.qp.as_ptr()
    }
}

/// A random 24-bit packet sequence number.
fn random_psn() -> u32 {
    let mut b = [0u8; 4];
    // SAFETY: `b` is a valid 4-byte buffer; getrandom writes at most that many bytes.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != 4 {
        // Fall back to address and time entropy; PSN randomness is defence in depth only.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        return (t ^ (&b as *const _ as usize as u32)) & 0xff_ffff;
    }
    u32::from_ne_bytes(b) & 0xff_ffff
}

impl Drop for QpInner {
    fn drop(&mut self) {
        // SAFETY: the last handle is gone; destroyed exactly once. Its CQs and PD outlive it
        // because this struct holds clones of them.
        let rc = unsafe { sys::ibv_destroy_qp(self.qp.as_ptr()) };
        if rc != 0 {
            tracing::warn!(qpn = self.qpn, rc, "ibv_destroy_qp failed");
        }
    }
}

impl fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QueuePair")
            .field("qpn", &self.inner.qpn)
            .field("caps", &self.inner.caps)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::wr::bad_index;

    #[test]
    fn endpoint_round_trip_and_validation() {
        let ep = QpAddress {
            qpn: 0x12,
            psn: 0xabcdef,
            gid: Gid([7; 16]),
            lid: 3,
            mtu: Mtu::Mtu1024,
        };
        let b = ep.to_bytes();
        assert_eq!(QpAddress::from_bytes(&b).unwrap(), ep);
        assert!(QpAddress::from_bytes(&b[..10]).is_err(), "truncated");
        let mut v = b;
        v[0] = 9;
        assert!(
            QpAddress::from_bytes(&v)
                .unwrap_err()
                .to_string()
                .contains("version")
        );
        let mut v = b;
        v[27] = 0;
        assert!(
            QpAddress::from_bytes(&v)
                .unwrap_err()
                .to_string()
                .contains("mtu")
        );
        let mut v = b;
        v[1] = 0xff;
        assert!(QpAddress::from_bytes(&v).is_err(), "qpn > 24 bits");
    }

    #[test]
    fn psn_is_24_bits() {
        for _ in 0..100 {
            assert!(random_psn() <= 0xff_ffff);
        }
    }

    #[test]
    fn bad_index_math() {
        let v = [0u64; 4];
        let base = v.as_ptr().cast_mut();
        // SAFETY: index 2 is inside `v`.
        let bad = unsafe { base.add(2) };
        assert_eq!(bad_index(base, bad, 4), 2);
        assert_eq!(bad_index(base, std::ptr::null_mut(), 4), 0);
    }
}
