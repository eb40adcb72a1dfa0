//! Shared setup for device tests: two RC queue pairs on one device, connected to each other.
//!
//! Device tests are `#[ignore]`d so that a plain `cargo test` on a host without RDMA shows them
//! as not run; `scripts/test` runs them with `--ignored` inside the soft-RoCE VM, where a
//! missing device makes them fail.
#![allow(
    dead_code,
    unreachable_pub,
    clippy::print_stdout,
    clippy::undocumented_unsafe_blocks
)]

#[path = "../../examples/common/proc_stats.rs"]
pub mod proc_stats;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use tokio_rdma::verbs::{
    AccessFlags, CompletionQueue, Context, QpAddress, QpInitAttr, QueuePair, RtrOptions,
    RtsOptions, WcBatch, WorkCompletion,
};

/// The device under test: `$TOKIO_RDMA_DEVICE`, else `rxe0`.
pub fn device_name() -> String {
    std::env::var("TOKIO_RDMA_DEVICE").unwrap_or_else(|_| "rxe0".to_string())
}

/// Opens the device under test; panics with the list of devices if it is missing.
pub fn open_device() -> (Context, u8) {
    init_tracing();
    let name = device_name();
    let ctx = Context::open(&name).unwrap_or_else(|e| panic!("opening {name}: {e}"));
    let port = (1..=ctx.device_attr().phys_port_cnt)
        .find(|&p| {
            ctx.query_port(p)
                .is_ok_and(|a| a.state == tokio_rdma::verbs::PortState::Active)
        })
        .unwrap_or_else(|| panic!("{name} has no active port"));
    (ctx, port)
}

/// One side of a connected pair.
pub struct Side {
    pub qp: QueuePair,
    pub cq: CompletionQueue,
    pub ep: QpAddress,
}

/// Two RC queue pairs on the same device, connected to each other, each with its own CQ.
pub struct Pair {
    pub ctx: Context,
    pub pd: tokio_rdma::verbs::ProtectionDomain,
    pub a: Side,
    pub b: Side,
}

pub fn connected_pair(access: AccessFlags) -> Pair {
    let (ctx, port) = open_device();
    let gid = ctx.preferred_gid(port).expect("GID");
    let pd = tokio_rdma::verbs::ProtectionDomain::new(&ctx).expect("alloc pd");
    let side = || {
        let cq = CompletionQueue::new(&ctx, 256, None).expect("create cq");
        let mut attr = QpInitAttr::new(&cq, &cq);
        attr.caps.max_inline_data = 64;
        let qp = QueuePair::new_rc(&pd, &attr).expect("create qp");
        let ep = qp.local_address(port, Some(gid.index)).expect("endpoint");
        Side { qp, cq, ep }
    };
    let (a, b) = (side(), side());
    let rtr = RtrOptions::new(port, gid.index as u8);
    // Short timers: a failing test should fail fast in the slow VM.
    let rts = RtsOptions {
        timeout: 14,
        retry_cnt: 3,
        rnr_retry: 3,
        max_rd_atomic: 16,
    };
    a.qp.connect(&a.ep, &b.ep, &rtr, &rts, access)
        .expect("connect a");
    b.qp.connect(&b.ep, &a.ep, &rtr, &rts, access)
        .expect("connect b");
    Pair { ctx, pd, a, b }
}

/// Polls `cq` until one completion arrives (generous timeout: TCG is slow).
pub fn poll_one(cq: &CompletionQueue) -> WorkCompletion {
    let mut batch = WcBatch::with_capacity(1);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(wc) = cq.poll(&mut batch).expect("poll cq").first() {
            return *wc;
        }
        assert!(Instant::now() < deadline, "no completion within 30 s");
        std::thread::yield_now();
    }
}

/// A deterministic byte pattern.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Two driver-managed queue pairs on one device and one driver, connected to each other.
pub struct AsyncPair {
    pub ctx: Context,
    pub pd: tokio_rdma::verbs::ProtectionDomain,
    pub driver: tokio_rdma::driver::Driver,
    pub a: tokio_rdma::driver::AsyncQp,
    pub b: tokio_rdma::driver::AsyncQp,
}

/// Connects two verbs queue pairs of `ctx` to each other with test timers.
pub fn connect_qps(ctx: &Context, a: &QueuePair, b: &QueuePair, access: AccessFlags) {
    let port = (1..=ctx.device_attr().phys_port_cnt)
        .find(|&p| {
            ctx.query_port(p)
                .is_ok_and(|a| a.state == tokio_rdma::verbs::PortState::Active)
        })
        .expect("active port");
    let gid = ctx.preferred_gid(port).expect("GID");
    let ea = a.local_address(port, Some(gid.index)).expect("endpoint");
    let eb = b.local_address(port, Some(gid.index)).expect("endpoint");
    let rtr = RtrOptions::new(port, gid.index as u8);
    let rts = RtsOptions {
        timeout: 14,
        retry_cnt: 3,
        rnr_retry: 3,
        max_rd_atomic: 16,
    };
    a.connect(&ea, &eb, &rtr, &rts, access).expect("connect a");
    b.connect(&eb, &ea, &rtr, &rts, access).expect("connect b");
}

pub fn all_access() -> AccessFlags {
    AccessFlags::LOCAL_WRITE
        | AccessFlags::REMOTE_READ
        | AccessFlags::REMOTE_WRITE
        | AccessFlags::REMOTE_ATOMIC
}

/// Must run inside a Tokio runtime.
pub fn async_pair_with(
    driver_opts: tokio_rdma::driver::DriverOptions,
    qp_opts: tokio_rdma::driver::QpOptions,
) -> AsyncPair {
    let (ctx, _port) = open_device();
    let pd = tokio_rdma::verbs::ProtectionDomain::new(&ctx).expect("pd");
    let driver = tokio_rdma::driver::Driver::new(&ctx, driver_opts).expect("driver");
    let a = driver.create_qp(&pd, qp_opts).expect("qp a");
    let b = driver.create_qp(&pd, qp_opts).expect("qp b");
    connect_qps(&ctx, a.verbs(), b.verbs(), all_access());
    AsyncPair {
        ctx,
        pd,
        driver,
        a,
        b,
    }
}

pub fn async_pair() -> AsyncPair {
    async_pair_with(Default::default(), Default::default())
}

/// A registered buffer filled with `data` (local write + remote rights for one-sided tests).
pub fn reg_with(
    pd: &tokio_rdma::verbs::ProtectionDomain,
    data: &[u8],
    access: AccessFlags,
) -> tokio_rdma::verbs::RegisteredBuffer {
    let mut b =
        tokio_rdma::verbs::RegisteredBuffer::new(pd, data.len().max(1), access).expect("register");
    b.write_at(0, data);
    b
}

/// `r`, posted now ([`Recv::start`](tokio_rdma::ops::Recv::start)): a message may arrive from
/// here on. A receive posted by its first poll inside `tokio::join!(recv, send)` can go after
/// the send: the macro rotates which future it polls first, and on a coalescing queue pair a
/// first poll only queues. A message that arrives before its receive is answered with RNR NAKs,
/// fatal after the queue pair's `rnr_retry` (3 x 0.64 ms here): the send fails with
/// `RNR_RETRY_EXC_ERR` and the receive waits for good (seen under load in the VM).
pub fn posted<B: tokio_rdma::ops::SgTarget>(
    mut r: tokio_rdma::ops::Recv<B>,
) -> tokio_rdma::ops::Recv<B> {
    r.start();
    r
}

/// Runs `f` with a timeout that fails the test instead of hanging it.
pub async fn within<F: std::future::Future>(secs: u64, what: &str, f: F) -> F::Output {
    match tokio::time::timeout(Duration::from_secs(secs), f).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: not done within {secs} s"),
    }
}

/// Installs a `tracing` subscriber when `RUST_LOG` is set (e.g. `--env RUST_LOG=tokio_rdma=debug`).
pub fn init_tracing() {
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
    }
}

/// `rdma resource show` counts of the device under test (qp, cq, mr, pd, cm_id, ...).
pub fn resource_counts() -> BTreeMap<String, u64> {
    proc_stats::resource_counts(&device_name()).unwrap_or_else(|e| panic!("{e}"))
}

/// Memory regions of the device under test (`rdma resource show`'s `mr` count).
pub fn mr_count() -> u64 {
    resource_counts().get("mr").copied().unwrap_or(0)
}

/// Resident memory of this process.
pub fn rss_bytes() -> u64 {
    proc_stats::rss_bytes()
}
