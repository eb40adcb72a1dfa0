//! Small value types shared by the verb objects.

use std::fmt;
use std::net::Ipv6Addr;
use std::ops::{BitOr, BitOrAssign};

use crate::sys;

/// Memory and queue-pair access rights (`enum ibv_access_flags`).
///
/// The crate's default for memory is [`AccessFlags::LOCAL_WRITE`] only; remote rights are
/// granted explicitly.
///
/// # Examples
///
/// ```
/// use tokio_rdma::verbs::AccessFlags;
/// let rw = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE;
/// assert!(rw.contains(AccessFlags::REMOTE_READ));
/// assert!(!rw.contains(AccessFlags::REMOTE_ATOMIC));
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct AccessFlags(u32);

impl AccessFlags {
    /// No access beyond local read.
    pub const NONE: AccessFlags = AccessFlags(0);
    /// The local device may write (receives, RDMA READ responses land here).
    pub const LOCAL_WRITE: AccessFlags = AccessFlags(sys::IBV_ACCESS_LOCAL_WRITE);
    /// Peers may RDMA WRITE.
    pub const REMOTE_WRITE: AccessFlags = AccessFlags(sys::IBV_ACCESS_REMOTE_WRITE);
    /// Peers may RDMA READ.
    pub const REMOTE_READ: AccessFlags = AccessFlags(sys::IBV_ACCESS_REMOTE_READ);
    /// Peers may perform atomics.
    pub const REMOTE_ATOMIC: AccessFlags = AccessFlags(sys::IBV_ACCESS_REMOTE_ATOMIC);
    /// Memory windows may be bound to this region.
    pub const MW_BIND: AccessFlags = AccessFlags(sys::IBV_ACCESS_MW_BIND);
    /// Register on demand (ODP, `IBV_ACCESS_ON_DEMAND`): nothing is pinned; the device faults
    /// pages in when it touches them and follows the process's mappings. Needs a device that
    /// reports ODP ([`Context::odp_caps`](super::Context::odp_caps); soft-RoCE from Linux
    /// 6.14): registering with it elsewhere fails with
    /// [`Error::OdpUnsupported`](crate::Error::OdpUnsupported). Not a right: it changes how the
    /// memory is registered, not who may access it. On soft-RoCE (Linux 6.19, 7.3) only packets
    /// that are whole, page-aligned pages are copied right (a kernel bug; `docs/memory.md`).
    pub const ON_DEMAND: AccessFlags = AccessFlags(sys::IBV_ACCESS_ON_DEMAND);

    /// The union of two sets of rights (usable in `const` items).
    pub const fn union(self, other: AccessFlags) -> AccessFlags {
        AccessFlags(self.0 | other.0)
    }

    /// The raw `ibv_access_flags` bits.
    pub fn bits(self) -> u32 {
        self.0
    }

    /// Whether every bit of `other` is set in `self`.
    pub fn contains(self, other: AccessFlags) -> bool {
        self.0 & other.0 == other.0
    }

    /// Whether any remote right (read, write, atomic) is set.
    pub fn is_remote(self) -> bool {
        self.0
            & (sys::IBV_ACCESS_REMOTE_WRITE
                | sys::IBV_ACCESS_REMOTE_READ
                | sys::IBV_ACCESS_REMOTE_ATOMIC)
            != 0
    }
}

impl BitOr for AccessFlags {
    type Output = AccessFlags;
    fn bitor(self, rhs: AccessFlags) -> AccessFlags {
        AccessFlags(self.0 | rhs.0)
    }
}

impl BitOrAssign for AccessFlags {
    fn bitor_assign(&mut self, rhs: AccessFlags) {
        self.0 |= rhs.0;
    }
}

impl fmt::Debug for AccessFlags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = [
            (Self::LOCAL_WRITE, "LOCAL_WRITE"),
            (Self::REMOTE_WRITE, "REMOTE_WRITE"),
            (Self::REMOTE_READ, "REMOTE_READ"),
            (Self::REMOTE_ATOMIC, "REMOTE_ATOMIC"),
            (Self::MW_BIND, "MW_BIND"),
            (Self::ON_DEMAND, "ON_DEMAND"),
        ];
        let set: Vec<&str> = names
            .iter()
            .filter(|(flag, _)| self.contains(*flag))
            .map(|(_, n)| *n)
            .collect();
        write!(
            f,
            "AccessFlags({})",
            if set.is_empty() {
                "NONE".to_string()
            } else {
                set.join(" | ")
            }
        )
    }
}

/// Path MTU (`enum ibv_mtu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mtu {
    /// 256 bytes.
    Mtu256,
    /// 512 bytes.
    Mtu512,
    /// 1024 bytes.
    Mtu1024,
    /// 2048 bytes.
    Mtu2048,
    /// 4096 bytes.
    Mtu4096,
}

impl Mtu {
    /// Converts the raw `ibv_mtu` value (1..=5).
    pub fn from_raw(raw: u32) -> Option<Mtu> {
        Some(match raw {
            sys::IBV_MTU_256 => Mtu::Mtu256,
            sys::IBV_MTU_512 => Mtu::Mtu512,
            sys::IBV_MTU_1024 => Mtu::Mtu1024,
            sys::IBV_MTU_2048 => Mtu::Mtu2048,
            sys::IBV_MTU_4096 => Mtu::Mtu4096,
            _ => return None,
        })
    }

    /// The raw `ibv_mtu` value.
    pub fn to_raw(self) -> u32 {
        match self {
            Mtu::Mtu256 => sys::IBV_MTU_256,
            Mtu::Mtu512 => sys::IBV_MTU_512,
            Mtu::Mtu1024 => sys::IBV_MTU_1024,
            Mtu::Mtu2048 => sys::IBV_MTU_2048,
            Mtu::Mtu4096 => sys::IBV_MTU_4096,
        }
    }

    /// The MTU in bytes.
    pub fn bytes(self) -> usize {
        256 << (self.to_raw() - 1)
    }
}

/// State of a device port (`enum ibv_port_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PortState {
    /// Reserved / no state.
    Nop,
    /// Link is down.
    Down,
    /// Link is up, not yet armed.
    Init,
    /// Link is armed.
    Armed,
    /// Link is active: usable for traffic.
    Active,
    /// Active, deferred.
    ActiveDefer,
    /// A value this crate does not know.
    Unknown(u32),
}

impl PortState {
    pub(crate) fn from_raw(raw: u32) -> PortState {
        match raw {
            sys::IBV_PORT_NOP => PortState::Nop,
            sys::IBV_PORT_DOWN => PortState::Down,
            sys::IBV_PORT_INIT => PortState::Init,
            sys::IBV_PORT_ARMED => PortState::Armed,
            sys::IBV_PORT_ACTIVE => PortState::Active,
            sys::IBV_PORT_ACTIVE_DEFER => PortState::ActiveDefer,
            other => PortState::Unknown(other),
        }
    }
}

/// A 128-bit global identifier (`union ibv_gid`): an IPv6 address for RoCE.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// Whether every byte is zero (an empty GID table slot).
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }

    pub(crate) fn to_raw(self) -> sys::ibv_gid {
        sys::ibv_gid { raw: self.0 }
    }

    pub(crate) fn from_raw(raw: &sys::ibv_gid) -> Gid {
        // SAFETY: both members of the union are plain 16-byte data; reading `raw` is always valid.
        Gid(unsafe { raw.raw })
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({self})")
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        Ipv6Addr::from(self.0).fmt(f)
    }
}

/// The kind of a GID table entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GidType {
    /// InfiniBand.
    Ib,
    /// RoCE v1 (Ethernet, no IP header).
    RoceV1,
    /// RoCE v2 (UDP/IP encapsulated).
    RoceV2,
    /// A value this crate does not know.
    Unknown(u32),
}

impl GidType {
    pub(crate) fn from_raw(raw: u32) -> GidType {
        match raw {
            sys::IBV_GID_TYPE_IB => GidType::Ib,
            sys::IBV_GID_TYPE_ROCE_V1 => GidType::RoceV1,
            sys::IBV_GID_TYPE_ROCE_V2 => GidType::RoceV2,
            other => GidType::Unknown(other),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mtu_bytes() {
        assert_eq!(Mtu::Mtu256.bytes(), 256);
        assert_eq!(Mtu::Mtu1024.bytes(), 1024);
        assert_eq!(Mtu::Mtu4096.bytes(), 4096);
        for m in [
            Mtu::Mtu256,
            Mtu::Mtu512,
            Mtu::Mtu1024,
            Mtu::Mtu2048,
            Mtu::Mtu4096,
        ] {
            assert_eq!(Mtu::from_raw(m.to_raw()), Some(m));
        }
        assert_eq!(Mtu::from_raw(0), None);
    }

    #[test]
    fn access_flags_debug() {
        let f = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ;
        assert_eq!(format!("{f:?}"), "AccessFlags(LOCAL_WRITE | REMOTE_READ)");
        assert!(f.is_remote());
        assert!(!AccessFlags::LOCAL_WRITE.is_remote());
    }

    #[test]
    fn gid_display_is_ipv6() {
        let mut g = [0u8; 16];
        g[10] = 0xff;
        g[11] = 0xff;
        g[12..].copy_from_slice(&[192, 0, 2, 1]);
        assert_eq!(Gid(g).to_string(), "::ffff:192.0.2.1");
    }
}
