//! What an errno means for the call that returned it: the `(ERRNO)` and hint that the
//! [`Error`](super::Error) messages append. Pure functions of the call and the code, so they are
//! tested without a device.

use std::fmt;
use std::io;
use std::net::{IpAddr, SocketAddr};

/// The hint for "there is no RDMA device at all".
pub(crate) const NO_DEVICE: &str = "no RDMA device is configured: load a driver (for soft-RoCE \
     `modprobe rdma_rxe` then `rdma link add rxe0 type rxe netdev eth0`) and check that \
     `rdma link` lists an ACTIVE link";

/// The hint for an address that no RDMA device owns.
const NOT_RDMA_ADDR: &str = "no RDMA device has (or routes to) that IP address: use an address \
     of an RDMA link's netdev (`rdma link` names the netdev, `ip -4 addr show dev NETDEV` its \
     address)";

const MEMLOCK: &str = "is RLIMIT_MEMLOCK / `ulimit -l` large enough?";

/// The verb or RDMA CM call that failed, as far as hints care.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Call {
    GetDeviceList,
    OpenDevice,
    CreateCq,
    CreateQp,
    CreateSrq,
    ModifySrq,
    ModifyQp,
    RegMr,
    PostSend,
    PostRecv,
    AllocMw,
    CreateEventChannel,
    CreateCmId,
    BindAddr,
    Listen,
    ResolveAddr,
    GetCmDevices,
    ResolveRoute,
    /// Any other call: the errno is named, no hint.
    Other,
}

/// The hint for `call` failing with `errno`, if the cause is a common one.
pub(crate) fn hint(call: Call, errno: i32) -> Option<&'static str> {
    use Call::*;
    Some(match (call, errno) {
        (GetDeviceList, _) => NO_DEVICE,
        (GetCmDevices | CreateEventChannel | CreateCmId, libc::ENODEV | libc::ENOENT) => {
            "RDMA CM found no device: load the RDMA CM module (`modprobe rdma_ucm`, which creates \
             /dev/infiniband/rdma_cm) and a driver (for soft-RoCE `modprobe rdma_rxe` then \
             `rdma link add rxe0 type rxe netdev eth0`); check `rdma link`"
        }
        (GetCmDevices | CreateEventChannel | CreateCmId, libc::ENOSYS) => {
            "the kernel has no RDMA CM support (`modprobe rdma_ucm`)"
        }
        (OpenDevice, libc::EACCES | libc::EPERM) => {
            "no permission to open /dev/infiniband/uverbs*: run as root or as a user the device \
             files allow"
        }
        (BindAddr | Listen, libc::EADDRINUSE) => {
            "another RDMA CM id (in this or another process) holds that address and \
             port; pick another port, or port 0 for a free one"
        }
        (BindAddr | ResolveAddr, libc::EADDRNOTAVAIL | libc::ENODEV | libc::ENETUNREACH) => {
            NOT_RDMA_ADDR
        }
        (ResolveRoute, libc::ENODEV | libc::ENETUNREACH | libc::EADDRNOTAVAIL) => {
            "no RDMA device routes to that address: 0.0.0.0 and :: (unspecified addresses) \
             name no peer, and the route to the peer must leave through an RDMA link's netdev; \
             connect to the peer's IP address on the RDMA link"
        }
        (BindAddr, libc::EINVAL) => "the id is already bound",
        (ResolveAddr, libc::EINVAL) => "the id is already bound to an address or connected",
        (RegMr | CreateCq | CreateQp | CreateSrq, libc::ENOMEM | libc::EPERM) => MEMLOCK,
        (RegMr, libc::EFAULT) => {
            "the range is not mapped memory of this process (or RLIMIT_MEMLOCK / `ulimit -l` is \
             too low)"
        }
        (CreateCq | CreateQp, libc::EINVAL) => {
            "a requested size exceeds the device's limits (max_cqe, max_qp_wr, max_sge, \
             max_inline_data: see `ibv_devinfo -v`)"
        }
        (CreateSrq, libc::EINVAL) => {
            "a requested size exceeds the device's limits (max_srq_wr, max_srq_sge: see \
             `ibv_devinfo -v`)"
        }
        (ModifySrq, libc::EINVAL) => {
            "the limit is larger than the queue's size, or the device cannot arm SRQ limits"
        }
        (ModifyQp, libc::EINVAL) => {
            "an attribute is invalid for this transition (port, GID index, MTU, PSN, or the \
             queue pair is not in the state the transition starts from)"
        }
        (PostSend | PostRecv, libc::ENOMEM) => "the work queue is full",
        (PostSend | PostRecv, libc::EINVAL) => {
            "a work request is invalid (too many scatter/gather entries, inline data too \
             large, or an opcode the queue pair does not allow)"
        }
        (AllocMw, libc::EOPNOTSUPP | libc::ENOSYS) => "the device has no memory windows",
        _ => return None,
    })
}

/// The hint for an RDMA CM event that reported a failure.
pub(crate) fn event_hint(event: &str, status: i32) -> Option<&'static str> {
    Some(match event {
        "RDMA_CM_EVENT_ADDR_ERROR" => NOT_RDMA_ADDR,
        "RDMA_CM_EVENT_ROUTE_ERROR" => {
            "no route to the peer over the RDMA device (is the peer's address on the same \
             network as an RDMA link's netdev?)"
        }
        "RDMA_CM_EVENT_UNREACHABLE" if status == -libc::ETIMEDOUT => {
            "the peer did not answer: is it listening on that address, is its RDMA link up?"
        }
        "RDMA_CM_EVENT_DEVICE_REMOVAL" => "the RDMA device was removed (check `rdma link`)",
        _ => return None,
    })
}

/// The symbolic name of an errno value (`EADDRINUSE`), for the common ones.
pub(crate) fn errno_name(code: i32) -> Option<&'static str> {
    Some(match code {
        libc::EPERM => "EPERM",
        libc::ENOENT => "ENOENT",
        libc::EINTR => "EINTR",
        libc::EIO => "EIO",
        libc::ENXIO => "ENXIO",
        libc::EBADF => "EBADF",
        libc::EAGAIN => "EAGAIN",
        libc::ENOMEM => "ENOMEM",
        libc::EACCES => "EACCES",
        libc::EFAULT => "EFAULT",
        libc::EBUSY => "EBUSY",
        libc::EEXIST => "EEXIST",
        libc::ENODEV => "ENODEV",
        libc::EINVAL => "EINVAL",
        libc::EMFILE => "EMFILE",
        libc::ENOSPC => "ENOSPC",
        libc::ERANGE => "ERANGE",
        libc::ENOSYS => "ENOSYS",
        libc::EPROTONOSUPPORT => "EPROTONOSUPPORT",
        libc::EOPNOTSUPP => "EOPNOTSUPP",
        libc::EAFNOSUPPORT => "EAFNOSUPPORT",
        libc::EADDRINUSE => "EADDRINUSE",
        libc::EADDRNOTAVAIL => "EADDRNOTAVAIL",
        libc::ENETDOWN => "ENETDOWN",
        libc::ENETUNREACH => "ENETUNREACH",
        libc::ECONNABORTED => "ECONNABORTED",
        libc::ECONNRESET => "ECONNRESET",
        libc::ENOBUFS => "ENOBUFS",
        libc::EISCONN => "EISCONN",
        libc::ENOTCONN => "ENOTCONN",
        libc::ETIMEDOUT => "ETIMEDOUT",
        libc::ECONNREFUSED => "ECONNREFUSED",
        libc::EHOSTUNREACH => "EHOSTUNREACH",
        libc::EALREADY => "EALREADY",
        libc::EINPROGRESS => "EINPROGRESS",
        _ => return None,
    })
}

/// Formats the cause of a failed call: `": EADDRINUSE (Address already in use); hint"`. The
/// errno's name and its description are shown; the `io::Error` stays the error's `source`.
pub(crate) struct Cause<'a> {
    pub(crate) call: Call,
    pub(crate) err: &'a io::Error,
}

impl fmt::Display for Cause<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(code) = self.err.raw_os_error() else {
            // Not an errno (e.g. "rdma_create_id returned no id"): the message is the cause.
            return write!(f, ": {}", self.err);
        };
        match errno_name(code) {
            Some(name) => write!(f, ": {name}")?,
            None if code == 0 => write!(f, ": no errno was set")?,
            None => write!(f, ": errno {code}")?,
        }
        if code != 0 {
            let desc = io::Error::from_raw_os_error(code).to_string();
            let desc = desc.split(" (os error").next().unwrap_or(&desc);
            write!(f, " ({desc})")?;
        }
        match hint(self.call, code) {
            Some(h) => write!(f, "; {h}"),
            None => Ok(()),
        }
    }
}

/// Formats `": ERRNO (description); hint"` for `call` failing with `err`.
pub(crate) fn cause(call: Call, err: &io::Error) -> Cause<'_> {
    Cause { call, err }
}

/// Whether `addr` is a loopback address (127.0.0.0/8, `::1`, or IPv4-mapped 127.x), which no
/// RDMA device owns.
pub(crate) fn is_loopback(addr: SocketAddr) -> bool {
    match addr.ip() {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(call: Call, code: i32) -> String {
        cause(call, &io::Error::from_raw_os_error(code)).to_string()
    }

    #[test]
    fn bind_addr_in_use_names_eaddrinuse_once() {
        let t = text(Call::BindAddr, libc::EADDRINUSE);
        assert!(
            t.starts_with(": EADDRINUSE (Address already in use); another"),
            "{t}"
        );
        assert_eq!(t.matches("EADDRINUSE").count(), 1, "{t}");
        assert!(text(Call::Listen, libc::EADDRINUSE).contains("pick another port"));
    }

    #[test]
    fn no_device_hints_name_rdma_rxe_and_rdma_link() {
        for (call, code) in [
            (Call::GetDeviceList, libc::ENOSYS),
            (Call::GetDeviceList, libc::ENOENT),
            (Call::CreateEventChannel, libc::ENODEV),
            (Call::GetCmDevices, libc::ENODEV),
            (Call::CreateCmId, libc::ENODEV),
        ] {
            let t = text(call, code);
            assert!(
                t.contains("rdma_rxe") && t.contains("rdma link"),
                "{call:?}: {t}"
            );
        }
        assert!(text(Call::CreateEventChannel, libc::ENODEV).contains("rdma_ucm"));
    }

    #[test]
    fn address_without_device_points_at_rdma_link() {
        for code in [libc::EADDRNOTAVAIL, libc::ENODEV, libc::ENETUNREACH] {
            assert!(text(Call::BindAddr, code).contains("rdma link"), "{code}");
            assert!(
                text(Call::ResolveAddr, code).contains("rdma link"),
                "{code}"
            );
        }
        let t = event_hint("RDMA_CM_EVENT_ADDR_ERROR", -libc::ENODEV).unwrap();
        assert!(t.contains("rdma link"));
        assert!(event_hint("RDMA_CM_EVENT_ESTABLISHED", 0).is_none());
    }

    #[test]
    fn memlock_hint_for_registration_and_queues() {
        for call in [Call::RegMr, Call::CreateCq, Call::CreateQp, Call::CreateSrq] {
            assert!(
                text(call, libc::ENOMEM).contains("RLIMIT_MEMLOCK"),
                "{call:?}"
            );
        }
        assert!(text(Call::RegMr, libc::EFAULT).contains("not mapped"));
        assert!(!text(Call::RegMr, libc::EINVAL).contains("RLIMIT_MEMLOCK"));
    }

    #[test]
    fn unknown_codes_and_non_errno_errors() {
        assert_eq!(
            text(Call::Other, libc::EINVAL),
            ": EINVAL (Invalid argument)"
        );
        assert_eq!(text(Call::Other, 4000).split(' ').next(), Some(":"));
        assert!(text(Call::Other, 4000).starts_with(": errno 4000"));
        assert_eq!(text(Call::Other, 0), ": no errno was set");
        let other = io::Error::other("rdma_create_id returned no id");
        assert_eq!(
            cause(Call::CreateCmId, &other).to_string(),
            ": rdma_create_id returned no id"
        );
        assert_eq!(hint(Call::Other, libc::EADDRINUSE), None);
    }

    #[test]
    fn loopback_detection() {
        for a in [
            "127.0.0.1:1",
            "127.9.9.9:0",
            "[::1]:7",
            "[::ffff:127.0.0.1]:7",
        ] {
            assert!(is_loopback(a.parse().unwrap()), "{a}");
        }
        for a in ["192.0.2.1:1", "0.0.0.0:0", "[::]:0", "[fe80::1]:1"] {
            assert!(!is_loopback(a.parse().unwrap()), "{a}");
        }
    }

    #[test]
    fn errno_names_match_libc() {
        assert_eq!(errno_name(libc::EADDRINUSE), Some("EADDRINUSE"));
        assert_eq!(errno_name(libc::ENODEV), Some("ENODEV"));
        assert_eq!(errno_name(-1), None);
    }
}
