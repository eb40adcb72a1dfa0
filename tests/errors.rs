//! Errors that name their cause, shown on a real device (soft-RoCE `rxe0` at 192.0.2.1 in the
//! VM): a missing device, a busy address, a loopback address and a low locked-memory limit
//! each give an error whose text says what happened and what to do; a listener met by a
//! foreign (plain RDMA CM) client rejects it, says why, and counts it.
//!
//! The device tests are `#[ignore]`d; `scripts/test` runs them with `--ignored` in the VM. The
//! missing-device check also runs on the host, where there may be no device at all.
#![allow(clippy::print_stdout, clippy::undocumented_unsafe_blocks)]

mod common;

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use tokio_rdma::Error;
use tokio_rdma::conn::{Connection, Listener};
use tokio_rdma::verbs::{
    AccessFlags, CmEvent, CmEventKind, CmId, CompletionQueue, ConnParam, Context, EventChannel,
    ProtectionDomain, QpInitAttr, QpState, QueuePair, RegisteredBuffer, devices,
};

/// The address of rxe0 in the VM; override with `TOKIO_RDMA_CM_ADDR`.
fn rxe_ip() -> IpAddr {
    std::env::var("TOKIO_RDMA_CM_ADDR")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| "192.0.2.1".parse().unwrap())
}

const MISSING: &str = "no-such-rdma-device";

/// Opening a device that does not exist names it, lists the devices that do, and (with none
/// at all) says how to get one.
fn missing_device_named() -> Error {
    let err = Context::open(MISSING).expect_err("a device with that name exists");
    let text = err.to_string();
    println!("Context::open({MISSING:?}): {text}");
    match &err {
        Error::DeviceNotFound { name, available } => {
            assert_eq!(name, MISSING);
            assert!(text.contains(MISSING), "{text}");
            assert!(text.contains("rdma link"), "{text}");
            for dev in available {
                assert!(text.contains(dev.as_str()), "{text}");
            }
            if available.is_empty() {
                assert!(text.contains("rdma_rxe"), "{text}");
            }
        }
        // A host without any RDMA support: the enumeration itself fails, with the hint.
        Error::GetDeviceList(_) => {
            assert!(
                text.contains("rdma_rxe") && text.contains("rdma link"),
                "{text}"
            )
        }
        other => panic!("unexpected error {other:?}"),
    }
    err
}

#[test]
fn missing_device_name_is_named_on_any_host() {
    missing_device_named();
}

#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn missing_device_name_is_named_and_real_devices_listed() {
    let err = missing_device_named();
    let Error::DeviceNotFound { available, .. } = &err else {
        panic!("{err:?}");
    };
    let name = common::device_name();
    assert!(available.contains(&name), "{name} not in {available:?}");
    assert!(devices().unwrap().iter().any(|d| d.name == name));
    let io: std::io::Error = err.into();
    assert_eq!(io.kind(), std::io::ErrorKind::NotFound);
}

#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn busy_address_names_eaddrinuse() {
    let ch = EventChannel::new().unwrap();
    let first = CmId::new(&ch).unwrap();
    first.bind_addr(SocketAddr::new(rxe_ip(), 0)).unwrap();
    first.listen(4).unwrap();
    let taken = first.local_addr().unwrap();
    let second = CmId::new(&ch).unwrap();
    let err = second.bind_addr(taken).expect_err("bound a port in use");
    let text = err.to_string();
    println!("second rdma_bind_addr({taken}): {text}");
    assert!(
        matches!(err, Error::BindAddr { addr, .. } if addr == taken),
        "{err:?}"
    );
    assert_eq!(err.raw_os_error(), Some(libc::EADDRINUSE));
    assert!(text.contains("EADDRINUSE"), "{text}");
    assert!(text.contains(&taken.to_string()), "{text}");
    assert!(text.contains("another port"), "{text}");
    let io: std::io::Error = err.into();
    assert_eq!(io.kind(), std::io::ErrorKind::AddrInUse);
}

#[tokio::test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn busy_address_names_eaddrinuse_through_listener() {
    let first = Listener::bind(SocketAddr::new(rxe_ip(), 0)).await.unwrap();
    let taken = first.local_addr().unwrap();
    let Err(err) = Listener::bind(taken).await else {
        panic!("a second listener bound {taken}");
    };
    println!("second Listener::bind({taken}): {err}");
    assert!(err.to_string().contains("EADDRINUSE"), "{err}");
}

#[tokio::test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn loopback_address_is_named_before_any_cm_call() {
    let ch = EventChannel::new().unwrap();
    let id = CmId::new(&ch).unwrap();
    for addr in ["127.0.0.1:7471", "[::1]:7471"] {
        let addr: SocketAddr = addr.parse().unwrap();
        let err = id.bind_addr(addr).expect_err("bound a loopback address");
        println!("rdma_bind_addr({addr}): {err}");
        assert!(
            matches!(
                err,
                Error::LoopbackAddress {
                    call: "rdma_bind_addr",
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("loopback"), "{err}");
        let err = id
            .resolve_addr(None, addr, 1000)
            .expect_err("resolved a loopback address");
        assert!(err.to_string().contains("loopback"), "{err}");
    }
    // The id is still usable: nothing was bound.
    id.bind_addr(SocketAddr::new(rxe_ip(), 0)).unwrap();

    // Through the connection API, without waiting for a route that never comes.
    let connect = Connection::connect("127.0.0.1:7471");
    let err = tokio::time::timeout(Duration::from_secs(10), connect)
        .await
        .expect("connect to loopback failed fast")
        .expect_err("connected to loopback");
    println!("Connection::connect(127.0.0.1:7471): {err}");
    assert!(err.to_string().contains("loopback"), "{err}");
    let Err(err) = Listener::bind("127.0.0.1:0").await else {
        panic!("a listener bound loopback");
    };
    println!("Listener::bind(127.0.0.1:0): {err}");
    assert!(err.to_string().contains("loopback"), "{err}");
}

/// A name that does not resolve is refused before any RDMA CM call, with the name (runs on any
/// host: no device is touched).
#[tokio::test]
async fn an_unresolvable_name_is_a_lookup_error() {
    for err in [
        Connection::connect("no-such-host.invalid:7471")
            .await
            .expect_err("connected to a name that does not exist"),
        Listener::bind("no-such-host.invalid:0")
            .await
            .expect_err("bound a name that does not exist"),
    ] {
        println!("{err}");
        match &err {
            tokio_rdma::Error::LookupHost { what, .. } => {
                assert!(what.contains("no-such-host.invalid"), "{err}")
            }
            other => panic!("expected a lookup error, got {other:?}"),
        }
    }
}

const CHILD_ENV: &str = "TOKIO_RDMA_ERRORS_MEMLOCK_CHILD";

#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn low_memlock_names_rlimit_memlock() {
    // Root has CAP_IPC_LOCK, which bypasses the limit: the registration runs in a child that
    // lowers RLIMIT_MEMLOCK and drops to an unprivileged user.
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "memlock_child", "--nocapture"])
        .env(CHILD_ENV, "1")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    println!("{text}");
    assert!(out.status.success(), "child failed");
    assert!(text.contains("memlock error: ibv_reg_mr of"), "{text}");
    assert!(text.contains("RLIMIT_MEMLOCK"), "{text}");
}

#[test]
#[ignore = "helper of low_memlock_names_rlimit_memlock (runs only in its child process)"]
fn memlock_child() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    const LIMIT: u64 = 64 << 10;
    let lim = libc::rlimit {
        rlim_cur: LIMIT,
        rlim_max: LIMIT,
    };
    // SAFETY: plain libc calls with valid arguments; this child process exits after the test.
    unsafe {
        assert_eq!(libc::setrlimit(libc::RLIMIT_MEMLOCK, &lim), 0);
        if libc::geteuid() == 0 {
            assert_eq!(libc::setgid(65534), 0);
            assert_eq!(libc::setuid(65534), 0);
        }
    }
    let (ctx, _port) = common::open_device();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let err = RegisteredBuffer::new(&pd, 4 << 20, AccessFlags::LOCAL_WRITE)
        .expect_err("registered 4 MiB under a 64 KiB memlock limit");
    println!("memlock error: {err}");
    assert!(
        matches!(err, Error::MemlockExhausted { limit: LIMIT, len, .. } if len == 4 << 20),
        "{err:?}"
    );
    assert!(err.to_string().contains(&LIMIT.to_string()), "{err}");
    let io: std::io::Error = err.into();
    assert_eq!(io.kind(), std::io::ErrorKind::OutOfMemory);
}

/// A client that speaks plain RDMA CM, as `rping` does: a connection request whose private
/// data is `private_data` (empty: none). Returns the event that answers it. Blocking.
fn foreign_connect(to: SocketAddr, private_data: &[u8]) -> tokio_rdma::Result<CmEvent> {
    let wait = |ch: &EventChannel| {
        ch.wait_event(Duration::from_secs(60))
            .expect("rdma_get_cm_event")
            .expect("an RDMA CM event within 60 s")
    };
    let ch = EventChannel::new()?;
    let id = CmId::new(&ch)?;
    id.resolve_addr(None, to, 10_000)?;
    wait(&ch).expect(CmEventKind::AddrResolved)?;
    id.resolve_route(10_000)?;
    wait(&ch).expect(CmEventKind::RouteResolved)?;
    let ctx = Context::from_cm_id(&id)?;
    let pd = ProtectionDomain::new(&ctx)?;
    let cq = CompletionQueue::new(&ctx, 16, None)?;
    let qp = QueuePair::new_rc(&pd, &QpInitAttr::new(&cq, &cq))?;
    id.modify_qp(&qp, QpState::Init)?;
    id.connect(&ConnParam::new(&qp).private_data(private_data))?;
    Ok(wait(&ch))
}

#[tokio::test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn listener_names_a_foreign_client() {
    let listener = Listener::bind(SocketAddr::new(rxe_ip(), 0)).await.unwrap();
    let to = listener.local_addr().unwrap();
    for (n, pd) in [&b""[..], b"rping says hello, not TRDM"]
        .into_iter()
        .enumerate()
    {
        let pd = pd.to_vec();
        let ev = tokio::task::spawn_blocking(move || foreign_connect(to, &pd))
            .await
            .unwrap()
            .unwrap();
        let err = ev
            .expect(CmEventKind::Established)
            .expect_err("a foreign client was accepted");
        println!("foreign client {n}: {err}");
        assert!(
            matches!(err, Error::ConnectionRejected { status: 28, .. }),
            "{err:?}"
        );
        assert!(err.to_string().contains("tokio-rdma"), "{err}");
        assert_eq!(listener.bad_handshakes(), n as u64 + 1);
    }
    assert_eq!(listener.rejected(), 2);
    assert_eq!(listener.pending(), 0);
}
