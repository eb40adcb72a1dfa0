//! On-demand paging (ODP), what the device offers (`odp_caps` of `ibv_query_device_ex`) and the
//! check made before registering memory with [`AccessFlags::ON_DEMAND`].
//!
//! An ODP registration pins nothing: the device faults pages in through the kernel when it
//! touches them and follows the process's mappings (a page unmapped and mapped again is seen
//! as the new page). soft-RoCE (`rdma_rxe`) has it from Linux 6.14 (RC send, receive, RDMA
//! READ/WRITE and atomics; UD send and receive), without implicit ODP.
//!
//! Registering and prefetching on-demand memory is `odp.rs`.

use std::fmt;
use std::ops::BitOr;
use std::ptr::NonNull;

use super::types::AccessFlags;
use crate::sys;

/// The kernel release from which soft-RoCE has ODP, named in the capability error.
pub(crate) const RXE_ODP_SINCE: &str = "Linux 6.14";

/// Operations a transport can run on ODP memory (`enum ibv_odp_transport_cap_bits`).
///
/// # Examples
///
/// ```
/// use tokio_rdma::verbs::OdpOps;
/// let ops = OdpOps::READ | OdpOps::WRITE;
/// assert!(ops.contains(OdpOps::READ) && !ops.contains(OdpOps::ATOMIC));
/// assert_eq!(format!("{ops:?}"), "OdpOps(WRITE | READ)");
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct OdpOps(u32);

impl OdpOps {
    /// No operation.
    pub const NONE: OdpOps = OdpOps(0);
    /// Sends from ODP memory.
    pub const SEND: OdpOps = OdpOps(sys::IBV_ODP_SUPPORT_SEND);
    /// Receives into ODP memory.
    pub const RECV: OdpOps = OdpOps(sys::IBV_ODP_SUPPORT_RECV);
    /// RDMA WRITE into (as responder) or from ODP memory.
    pub const WRITE: OdpOps = OdpOps(sys::IBV_ODP_SUPPORT_WRITE);
    /// RDMA READ from (as responder) or into ODP memory.
    pub const READ: OdpOps = OdpOps(sys::IBV_ODP_SUPPORT_READ);
    /// Atomics on ODP memory.
    pub const ATOMIC: OdpOps = OdpOps(sys::IBV_ODP_SUPPORT_ATOMIC);
    /// Receives through a shared receive queue into ODP memory.
    pub const SRQ_RECV: OdpOps = OdpOps(sys::IBV_ODP_SUPPORT_SRQ_RECV);

    const NAMES: [(OdpOps, &'static str); 6] = [
        (OdpOps::SEND, "SEND"),
        (OdpOps::RECV, "RECV"),
        (OdpOps::WRITE, "WRITE"),
        (OdpOps::READ, "READ"),
        (OdpOps::ATOMIC, "ATOMIC"),
        (OdpOps::SRQ_RECV, "SRQ_RECV"),
    ];

    /// The raw bits as the device reported them (bits this crate does not name included, e.g.
    /// rdma-core's newer FLUSH and ATOMIC_WRITE).
    pub fn bits(self) -> u32 {
        self.0
    }

    /// Whether every operation of `other` is in `self`.
    pub fn contains(self, other: OdpOps) -> bool {
        self.0 & other.0 == other.0
    }

    /// The operations of `self` missing from `have`.
    pub fn missing_from(self, have: OdpOps) -> OdpOps {
        OdpOps(self.0 & !have.0)
    }

    /// Whether no operation is set.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The operations registering with `access` lets a peer run on the memory (READ, WRITE,
    /// ATOMIC for the remote rights).
    pub fn for_remote_access(access: AccessFlags) -> OdpOps {
        let mut ops = OdpOps::NONE;
        if access.contains(AccessFlags::REMOTE_READ) {
            ops = ops | OdpOps::READ;
        }
        if access.contains(AccessFlags::REMOTE_WRITE) {
            ops = ops | OdpOps::WRITE;
        }
        if access.contains(AccessFlags::REMOTE_ATOMIC) {
            ops = ops | OdpOps::ATOMIC;
        }
        ops
    }
}

impl BitOr for OdpOps {
    type Output = OdpOps;
    fn bitor(self, rhs: OdpOps) -> OdpOps {
        OdpOps(self.0 | rhs.0)
    }
}

impl fmt::Debug for OdpOps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OdpOps({self})")
    }
}

impl fmt::Display for OdpOps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut names: Vec<String> = OdpOps::NAMES
            .iter()
            .filter(|(op, _)| self.contains(*op))
            .map(|(_, n)| (*n).to_string())
            .collect();
        let known = OdpOps::NAMES.iter().fold(0, |acc, (op, _)| acc | op.0);
        if self.0 & !known != 0 {
            names.push(format!("{:#x}", self.0 & !known));
        }
        if names.is_empty() {
            f.write_str("NONE")
        } else {
            f.write_str(&names.join(" | "))
        }
    }
}

/// What a device offers for on-demand paging (`struct ibv_odp_caps`), read once when the
/// device is opened ([`Context::odp_caps`](super::Context::odp_caps)).
///
/// # Examples
///
/// ```no_run
/// use tokio_rdma::verbs::{Context, OdpOps};
/// let ctx = Context::open("rxe0")?;
/// let odp = ctx.odp_caps();
/// if odp.supported && odp.rc.contains(OdpOps::READ | OdpOps::WRITE) {
///     println!("{}: RDMA READ/WRITE into ODP memory over RC", ctx.name());
/// }
/// # Ok::<(), tokio_rdma::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct OdpCaps {
    /// The device can register memory on demand (`IBV_ODP_SUPPORT`).
    pub supported: bool,
    /// Implicit ODP: one registration of the whole address space (`IBV_ODP_SUPPORT_IMPLICIT`).
    pub implicit: bool,
    /// Operations on ODP memory over reliable connections (the transport of this crate).
    pub rc: OdpOps,
    /// Operations over unreliable connections.
    pub uc: OdpOps,
    /// Operations over unreliable datagrams.
    pub ud: OdpOps,
}

impl OdpCaps {
    /// Checks that `access` (which must contain [`AccessFlags::ON_DEMAND`] to need anything)
    /// plus the RC operations `ops` can be used on ODP memory of this device; `implicit` asks
    /// for implicit ODP as well.
    ///
    /// # Errors
    ///
    /// The first capability that is missing, as [`OdpMissing`].
    pub fn check(
        &self,
        access: AccessFlags,
        ops: OdpOps,
        implicit: bool,
    ) -> std::result::Result<(), OdpMissing> {
        if !access.contains(AccessFlags::ON_DEMAND) {
            return Ok(());
        }
        if !self.supported {
            return Err(OdpMissing::Odp);
        }
        if implicit && !self.implicit {
            return Err(OdpMissing::Implicit);
        }
        let need = OdpOps::for_remote_access(access) | ops;
        let missing = need.missing_from(self.rc);
        if !missing.is_empty() {
            return Err(OdpMissing::Rc(missing));
        }
        Ok(())
    }
}

/// The ODP capability a request needed and the device lacks (in
/// [`Error::OdpUnsupported`](crate::Error::OdpUnsupported)).
///
/// # Examples
///
/// ```
/// use tokio_rdma::verbs::{AccessFlags, OdpCaps, OdpMissing, OdpOps};
/// let none = OdpCaps::default(); // a device without ODP (soft-RoCE before Linux 6.14)
/// let err = none.check(AccessFlags::ON_DEMAND, OdpOps::NONE, false).unwrap_err();
/// assert_eq!(err, OdpMissing::Odp);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OdpMissing {
    /// No on-demand paging at all (`IBV_ODP_SUPPORT` not reported).
    Odp,
    /// No implicit ODP (`IBV_ODP_SUPPORT_IMPLICIT`).
    Implicit,
    /// These operations are not supported on ODP memory over RC.
    Rc(OdpOps),
}

impl fmt::Display for OdpMissing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OdpMissing::Odp => f.write_str("on-demand paging (IBV_ODP_SUPPORT)"),
            OdpMissing::Implicit => {
                f.write_str("implicit on-demand paging (IBV_ODP_SUPPORT_IMPLICIT)")
            }
            OdpMissing::Rc(ops) => write!(f, "on-demand paging of RC {ops} (rc_odp_caps)"),
        }
    }
}

/// Reads the device's ODP capabilities; a device or library without `ibv_query_device_ex`
/// (or a failing query) reports none.
pub(crate) fn query_odp_caps(ctx: NonNull<sys::ibv_context>) -> OdpCaps {
    let mut raw = sys::ibv_device_attr_ex::default();
    // SAFETY: `ctx` is an open context; the input may be null (no comp_mask); `raw` is a
    // zeroed out-parameter of the size the inline function passes to the provider.
    let rc = unsafe { sys::ibv_query_device_ex(ctx.as_ptr(), std::ptr::null(), &mut raw) };
    if rc != 0 {
        tracing::debug!(
            rc,
            "ibv_query_device_ex failed: assuming no on-demand paging"
        );
        return OdpCaps::default();
    }
    let odp = raw.odp_caps;
    let general = odp.general_caps;
    OdpCaps {
        supported: general & u64::from(sys::IBV_ODP_SUPPORT) != 0,
        implicit: general & u64::from(sys::IBV_ODP_SUPPORT_IMPLICIT) != 0,
        rc: OdpOps(odp.per_transport_caps.rc_odp_caps),
        uc: OdpOps(odp.per_transport_caps.uc_odp_caps),
        ud: OdpOps(odp.per_transport_caps.ud_odp_caps),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rxe_6_19() -> OdpCaps {
        // What ibv_devinfo -v shows for rxe0 on Linux 6.19 (plus FLUSH and ATOMIC_WRITE bits).
        OdpCaps {
            supported: true,
            implicit: false,
            rc: OdpOps(0x3f | 0xc0),
            uc: OdpOps::NONE,
            ud: OdpOps::SEND | OdpOps::RECV | OdpOps::SRQ_RECV,
        }
    }

    #[test]
    fn pinned_registrations_need_nothing() {
        let rw = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ;
        assert_eq!(OdpCaps::default().check(rw, OdpOps::SEND, true), Ok(()));
    }

    #[test]
    fn missing_capabilities_are_named() {
        let odp = AccessFlags::ON_DEMAND | AccessFlags::REMOTE_ATOMIC;
        assert_eq!(
            OdpCaps::default().check(odp, OdpOps::NONE, false),
            Err(OdpMissing::Odp)
        );
        let caps = rxe_6_19();
        assert_eq!(caps.check(odp, OdpOps::SEND | OdpOps::RECV, false), Ok(()));
        assert_eq!(
            caps.check(odp, OdpOps::NONE, true),
            Err(OdpMissing::Implicit)
        );
        let weak = OdpCaps {
            rc: OdpOps::SEND | OdpOps::RECV | OdpOps::READ,
            ..caps
        };
        let missing = weak.check(odp | AccessFlags::REMOTE_WRITE, OdpOps::NONE, false);
        assert_eq!(missing, Err(OdpMissing::Rc(OdpOps::WRITE | OdpOps::ATOMIC)));
        assert_eq!(
            missing.unwrap_err().to_string(),
            "on-demand paging of RC WRITE | ATOMIC (rc_odp_caps)"
        );
        assert_eq!(
            format!("{}", caps.rc),
            "SEND | RECV | WRITE | READ | ATOMIC | SRQ_RECV | 0xc0"
        );
    }
}
