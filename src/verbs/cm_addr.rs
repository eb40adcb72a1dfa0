//! Conversions between `std::net::SocketAddr` and the C socket addresses RDMA CM takes and
//! returns.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

use crate::sys;

/// A socket address in C layout (`sockaddr_storage`), for passing to librdmacm.
pub(crate) struct RawAddr {
    storage: libc::sockaddr_storage,
}

impl RawAddr {
    pub(crate) fn new(addr: SocketAddr) -> RawAddr {
        // SAFETY: `sockaddr_storage` is plain integers; all zeros is a valid (AF_UNSPEC) value.
        let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        match addr {
            SocketAddr::V4(a) => {
                let sin = libc::sockaddr_in {
                    sin_family: libc::AF_INET as libc::sa_family_t,
                    sin_port: a.port().to_be(),
                    sin_addr: libc::in_addr {
                        s_addr: u32::from_ne_bytes(a.ip().octets()),
                    },
                    sin_zero: [0; 8],
                };
                // SAFETY: `sockaddr_storage` is larger than `sockaddr_in` and aligned for any
                // socket address type, as POSIX requires.
                unsafe { std::ptr::write((&raw mut storage).cast::<libc::sockaddr_in>(), sin) };
            }
            SocketAddr::V6(a) => {
                let sin6 = libc::sockaddr_in6 {
                    sin6_family: libc::AF_INET6 as libc::sa_family_t,
                    sin6_port: a.port().to_be(),
                    sin6_flowinfo: a.flowinfo(),
                    sin6_addr: libc::in6_addr {
                        s6_addr: a.ip().octets(),
                    },
                    sin6_scope_id: a.scope_id(),
                };
                // SAFETY: as above, for `sockaddr_in6`.
                unsafe { std::ptr::write((&raw mut storage).cast::<libc::sockaddr_in6>(), sin6) };
            }
        }
        RawAddr { storage }
    }

    pub(crate) fn as_mut_ptr(&mut self) -> *mut sys::sockaddr {
        (&raw mut self.storage).cast()
    }
}

/// Reads an IPv4 or IPv6 socket address. Returns `None` for a null pointer, an unset address
/// (`AF_UNSPEC`) or another family (e.g. `AF_IB`).
///
/// # Safety
///
/// `sa` must be null or point to a readable socket address whose `sa_family` tells its type,
/// with at least the size of that type (librdmacm's addresses are `sockaddr_storage`-sized).
pub(crate) unsafe fn from_raw(sa: *const sys::sockaddr) -> Option<SocketAddr> {
    if sa.is_null() {
        return None;
    }
    // SAFETY: the caller guarantees a readable `sockaddr`.
    let family = i32::from(unsafe { (*sa).sa_family });
    match family {
        libc::AF_INET => {
            // SAFETY: the family says it is a `sockaddr_in`; `read_unaligned` needs no alignment.
            let sin = unsafe { std::ptr::read_unaligned(sa.cast::<libc::sockaddr_in>()) };
            let ip = Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
            Some(SocketAddr::V4(SocketAddrV4::new(
                ip,
                u16::from_be(sin.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says it is a `sockaddr_in6`.
            let sin6 = unsafe { std::ptr::read_unaligned(sa.cast::<libc::sockaddr_in6>()) };
            Some(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(sin6.sin6_addr.s6_addr),
                u16::from_be(sin6.sin6_port),
                sin6.sin6_flowinfo,
                sin6.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_v4_and_v6() {
        for addr in [
            "192.0.2.1:7471".parse::<SocketAddr>().unwrap(),
            "0.0.0.0:0".parse().unwrap(),
            "[fe80::1%3]:65535".parse().unwrap(),
            "[::ffff:192.0.2.1]:1".parse().unwrap(),
        ] {
            let mut raw = RawAddr::new(addr);
            // SAFETY: `raw` holds a valid address of its family.
            let back = unsafe { from_raw(raw.as_mut_ptr()) };
            assert_eq!(back, Some(addr));
        }
    }

    #[test]
    fn network_byte_order() {
        let mut raw = RawAddr::new("192.0.2.1:258".parse().unwrap());
        // SAFETY: an AF_INET address was written into the storage.
        let sin = unsafe { std::ptr::read(raw.as_mut_ptr().cast::<libc::sockaddr_in>()) };
        assert_eq!(sin.sin_port.to_ne_bytes(), [1, 2]);
        assert_eq!(sin.sin_addr.s_addr.to_ne_bytes(), [192, 0, 2, 1]);
    }

    #[test]
    fn other_families_are_none() {
        // SAFETY: null is allowed.
        assert_eq!(unsafe { from_raw(std::ptr::null()) }, None);
        // SAFETY: an all-zero storage is AF_UNSPEC.
        let storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        // SAFETY: a readable, zeroed storage.
        assert_eq!(unsafe { from_raw((&raw const storage).cast()) }, None);
    }
}
