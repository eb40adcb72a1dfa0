//! Queue-pair attributes computed by RDMA CM (`rdma_init_qp_attr`), and applying them to a
//! queue pair this crate created itself.

use std::fmt;

use super::qp::{QpState, QueuePair};
use super::types::{AccessFlags, Mtu};
use crate::error::{Error, Result};
use crate::sys;

/// The attributes and attribute mask RDMA CM computed for moving a queue pair to one state
/// (from [`CmId::init_qp_attr`](super::CmId::init_qp_attr)): port, P_Key index, address
/// vector and GID index, path MTU, remote QPN, PSNs, timers, retry counts and read/atomic
/// depths, as negotiated by the connection. Apply it with
/// [`QueuePair::modify_with_attr`].
///
/// The access flags may be narrowed with [`set_access`](Self::set_access) before applying:
/// by default RDMA CM allows remote writes (and reads/atomics when the connection has
/// responder resources) at the queue-pair level, while this crate's memory is registered
/// `LOCAL_WRITE` only and remote access is granted per buffer.
#[derive(Clone, Copy)]
pub struct CmQpAttr {
    pub(super) attr: sys::ibv_qp_attr,
    pub(super) mask: i32,
}

const ACCESS_BITS: [AccessFlags; 5] = [
    AccessFlags::LOCAL_WRITE,
    AccessFlags::REMOTE_WRITE,
    AccessFlags::REMOTE_READ,
    AccessFlags::REMOTE_ATOMIC,
    AccessFlags::MW_BIND,
];

impl CmQpAttr {
    /// The target state.
    pub fn state(&self) -> QpState {
        QpState::from_raw(self.attr.qp_state)
    }

    fn has(&self, bit: u32) -> bool {
        (self.mask as u32) & bit != 0
    }

    /// The queue-pair access flags the transition sets, if it sets them.
    pub fn access(&self) -> Option<AccessFlags> {
        self.has(sys::IBV_QP_ACCESS_FLAGS).then(|| {
            ACCESS_BITS
                .iter()
                .filter(|f| self.attr.qp_access_flags & f.bits() != 0)
                .fold(AccessFlags::NONE, |acc, &f| acc | f)
        })
    }

    /// Sets the queue-pair access flags (remote operations the peer may direct at this queue
    /// pair; memory regions and windows must grant them too).
    pub fn set_access(&mut self, access: AccessFlags) -> &mut Self {
        self.attr.qp_access_flags = access.bits();
        self.mask |= sys::IBV_QP_ACCESS_FLAGS as i32;
        self
    }

    /// Sets the transport retry count and the RNR retry count (an RTS transition; each 0..=7,
    /// where an RNR retry count of 7 means "retry forever").
    pub fn set_retries(&mut self, retry_cnt: u8, rnr_retry: u8) -> &mut Self {
        self.attr.retry_cnt = retry_cnt.min(7);
        self.attr.rnr_retry = rnr_retry.min(7);
        self.mask |= (sys::IBV_QP_RETRY_CNT | sys::IBV_QP_RNR_RETRY) as i32;
        self
    }

    /// The transport retry count the transition sets, if it sets it.
    pub fn retry_cnt(&self) -> Option<u8> {
        self.has(sys::IBV_QP_RETRY_CNT)
            .then_some(self.attr.retry_cnt)
    }

    /// The remote queue pair number (set for RTR).
    pub fn dest_qpn(&self) -> Option<u32> {
        self.has(sys::IBV_QP_DEST_QPN)
            .then_some(self.attr.dest_qp_num)
    }

    /// The path MTU (set for RTR).
    pub fn path_mtu(&self) -> Option<Mtu> {
        if self.has(sys::IBV_QP_PATH_MTU) {
            Mtu::from_raw(self.attr.path_mtu)
        } else {
            None
        }
    }

    /// The port number (set for INIT).
    pub fn port(&self) -> Option<u8> {
        self.has(sys::IBV_QP_PORT).then_some(self.attr.port_num)
    }

    /// Responder resources: RDMA READ / atomic requests the peer may have outstanding here
    /// (set for RTR).
    pub fn max_dest_rd_atomic(&self) -> Option<u8> {
        self.has(sys::IBV_QP_MAX_DEST_RD_ATOMIC)
            .then_some(self.attr.max_dest_rd_atomic)
    }

    /// Initiator depth: RDMA READ / atomic requests this side may have outstanding (set for
    /// RTS).
    pub fn max_rd_atomic(&self) -> Option<u8> {
        self.has(sys::IBV_QP_MAX_QP_RD_ATOMIC)
            .then_some(self.attr.max_rd_atomic)
    }

    /// `(timeout, retry_cnt, rnr_retry)` of the send side (set for RTS).
    pub fn send_timers(&self) -> Option<(u8, u8, u8)> {
        self.has(sys::IBV_QP_TIMEOUT).then_some((
            self.attr.timeout,
            self.attr.retry_cnt,
            self.attr.rnr_retry,
        ))
    }

    /// The raw attribute mask (`enum ibv_qp_attr_mask` bits), for diagnostics.
    pub fn mask_bits(&self) -> u32 {
        self.mask as u32
    }
}

impl fmt::Debug for CmQpAttr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CmQpAttr")
            .field("state", &self.state())
            .field("mask", &format_args!("{:#x}", self.mask))
            .field("port", &self.port())
            .field("access", &self.access())
            .field("path_mtu", &self.path_mtu())
            .field("dest_qpn", &self.dest_qpn())
            .field("max_dest_rd_atomic", &self.max_dest_rd_atomic())
            .field("max_rd_atomic", &self.max_rd_atomic())
            .field("send_timers", &self.send_timers())
            .finish_non_exhaustive()
    }
}

impl QueuePair {
    /// Moves the queue pair with attributes computed by RDMA CM (see
    /// [`CmId::init_qp_attr`](super::CmId::init_qp_attr) and
    /// [`CmId::modify_qp`](super::CmId::modify_qp)).
    ///
    /// # Errors
    ///
    /// [`Error::ModifyQp`] with the returned error code.
    pub fn modify_with_attr(&self, attr: &CmQpAttr) -> Result<()> {
        let mut raw = attr.attr;
        self.modify_raw(&mut raw, attr.mask)
    }

    /// `ibv_modify_qp` with a raw attribute and mask (e.g. from `rdma_init_qp_attr`).
    pub(crate) fn modify_raw(&self, attr: &mut sys::ibv_qp_attr, mask: i32) -> Result<()> {
        let to = QpState::from_raw(attr.qp_state);
        // SAFETY: The QP is alive; the fields of `attr` named in `mask` were set (by rdma_init_qp_attr
        // or the caller). ibv_modify_qp returns its error code directly.
        let rc = unsafe { sys::ibv_modify_qp(self.as_ptr(), attr, mask) };
        if rc != 0 {
            return Err(Error::code(rc, |source| Error::ModifyQp { to, source }));
        }
        tracing::trace!(qpn = self.qpn(), state = ?to, mask = format_args!("{mask:#x}"), "queue pair transition (RDMA CM attributes)");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_mapping_round_trips() {
        for s in [
            QpState::Reset,
            QpState::Init,
            QpState::Rtr,
            QpState::Rts,
            QpState::Sqd,
            QpState::Sqe,
            QpState::Err,
            QpState::Unknown(77),
        ] {
            assert_eq!(QpState::from_raw(QpState::to_raw(s)), s);
        }
    }

    #[test]
    fn access_override_sets_the_mask() {
        let mut a = CmQpAttr {
            attr: sys::ibv_qp_attr {
                qp_state: sys::IBV_QPS_RTR,
                qp_access_flags: sys::IBV_ACCESS_REMOTE_WRITE | sys::IBV_ACCESS_REMOTE_READ,
                ..Default::default()
            },
            mask: (sys::IBV_QP_STATE | sys::IBV_QP_ACCESS_FLAGS) as i32,
        };
        assert_eq!(a.state(), QpState::Rtr);
        assert_eq!(
            a.access(),
            Some(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ)
        );
        a.mask = sys::IBV_QP_STATE as i32;
        assert_eq!(a.access(), None);
        a.set_access(AccessFlags::NONE);
        assert_eq!(a.access(), Some(AccessFlags::NONE));
        assert_ne!(a.mask_bits() & sys::IBV_QP_ACCESS_FLAGS, 0);
        assert_eq!(a.dest_qpn(), None);
    }
}
