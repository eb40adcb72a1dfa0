//! Unit tests of the error type.
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
    let e: io::Error = Error::code(libc::ENOMEM, |source| Error::RegMr { len: 1, source }).into();
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

#[test]
fn verb_errors_name_their_errno_and_hint() {
    let e = Error::code(libc::EADDRINUSE, |source| Error::BindAddr {
        addr: "192.0.2.1:7470".parse().unwrap(),
        source,
    });
    assert_eq!(
        e.to_string(),
        "rdma_bind_addr(192.0.2.1:7470) failed: EADDRINUSE (Address already in use); another \
         RDMA CM id (in this or another process) holds that address and port; pick another \
         port, or port 0 for a free one"
    );
    assert_eq!(e.raw_os_error(), Some(libc::EADDRINUSE));
    let e = Error::code(libc::ENOSYS, Error::GetDeviceList);
    assert!(
        e.to_string()
            .starts_with("ibv_get_device_list failed: ENOSYS"),
        "{e}"
    );
    assert!(e.to_string().contains("modprobe rdma_rxe"), "{e}");
    let e = Error::code(libc::ENODEV, Error::CreateEventChannel);
    assert!(
        e.to_string().contains("ENODEV") && e.to_string().contains("rdma_ucm"),
        "{e}"
    );
    let none = Error::DeviceNotFound {
        name: "mlx5_9".into(),
        available: vec![],
    };
    assert!(none.to_string().contains("rdma_rxe"), "{none}");
    let some = Error::DeviceNotFound {
        name: "mlx5_9".into(),
        available: vec!["rxe0".into()],
    };
    assert!(some.to_string().contains("`rdma link`"), "{some}");
    let ev = Error::CmEventFailed {
        event: "RDMA_CM_EVENT_ADDR_ERROR",
        status: -libc::ENODEV,
        source: Some(io::Error::from_raw_os_error(libc::ENODEV)),
    };
    assert!(ev.to_string().contains("status -19, ENODEV"), "{ev}");
    assert!(ev.to_string().contains("rdma link"), "{ev}");
}
