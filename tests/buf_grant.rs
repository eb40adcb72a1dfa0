//! Device tests of remote grants on soft-RoCE: which mechanism rxe takes, a peer writing into
//! a granted range, and accesses outside the grant or after revocation failing with
//! `IBV_WC_REM_ACCESS_ERR` while canary bytes around the grant stay intact. Every mechanism
//! the device supports is tested (memory window and dedicated registration).

#![allow(clippy::print_stdout)]

mod common;

use common::{Pair, connected_pair, pattern, poll_one};
use tokio_rdma::WcStatus;
use tokio_rdma::buf::{
    Grant, GrantKind, Pool, PoolBuf, PoolConfig, RemoteAccess, RemoteToken, SizeClass,
};
use tokio_rdma::verbs::{
    AccessFlags, MemoryRegion, MemoryWindow, RegisteredBuffer, SendOp, SendWr, WorkCompletion,
};

const QP_ACCESS: AccessFlags = AccessFlags::REMOTE_READ
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_ATOMIC);
const PAGE: usize = 4096;
const CANARY: u8 = 0xa5;

fn pool(p: &Pair) -> Pool {
    let cfg = PoolConfig::default().classes([SizeClass::new(4 * PAGE, 8)]);
    Pool::with_pd(&p.pd, cfg).unwrap()
}

/// A 3-page pool buffer filled with canaries, granted `access` to its middle page.
fn grant(p: &Pair, pool: &Pool, kind: GrantKind, access: RemoteAccess) -> Grant<PoolBuf> {
    let mut buf = pool.try_acquire(3 * PAGE).unwrap().unwrap();
    buf.fill(CANARY);
    let range = PAGE..2 * PAGE;
    let g = match kind {
        GrantKind::Window => Grant::window(&p.b.qp, buf, range, access, 500, |id| {
            let wc = poll_one(&p.b.cq);
            assert_eq!(wc.wr_id(), id);
            Ok(wc)
        }),
        GrantKind::Region => Grant::region(&p.pd, buf, range, access),
    }
    .unwrap();
    assert_eq!(g.kind(), kind);
    g
}

/// The mechanisms the grant layer uses on this device (windows only where their bounds hold).
fn kinds(p: &Pair) -> Vec<GrantKind> {
    let mut k = vec![GrantKind::Region];
    if p.ctx.device_attr().supports_mw_type2() && MemoryWindow::bounds_enforced(&p.ctx) {
        k.push(GrantKind::Window);
    }
    k
}

/// `a` RDMA-writes `data` to `addr` with `rkey`; returns the completion.
fn remote_write(p: &Pair, token: RemoteToken, addr: u64, data: &[u8]) -> WorkCompletion {
    let mut src =
        RegisteredBuffer::new(&p.pd, data.len().max(1), AccessFlags::LOCAL_WRITE).unwrap();
    src.as_mut_slice().unwrap()[..data.len()].copy_from_slice(data);
    let sge = [src.sge(0..data.len())];
    let op = SendOp::Write {
        remote_addr: addr,
        rkey: token.rkey(),
    };
    // SAFETY: `src` outlives the completion polled here.
    unsafe { p.a.qp.post_send(&[SendWr::new(9, op, &sge)]).unwrap() };
    poll_one(&p.a.cq)
}

fn assert_canaries(g: &Grant<PoolBuf>) {
    let mut before = vec![0; PAGE];
    let mut after = vec![0; PAGE];
    g.read_at(0, &mut before);
    g.read_at(2 * PAGE, &mut after);
    assert!(
        before.iter().all(|&b| b == CANARY),
        "canary before the grant"
    );
    assert!(after.iter().all(|&b| b == CANARY), "canary after the grant");
}

#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn grant_path_chosen_on_this_device() {
    let p = connected_pair(QP_ACCESS);
    let attr = p.ctx.device_attr();
    let enforced = MemoryWindow::bounds_enforced(&p.ctx);
    println!(
        "{}: max_mw {} device_cap_flags {:#x} type-2 windows: {} window bounds enforced: {enforced}",
        p.ctx.name(),
        attr.max_mw,
        attr.device_cap_flags,
        attr.supports_mw_type2(),
    );
    let pool = pool(&p);
    let buf = pool.try_acquire(PAGE).unwrap().unwrap();
    let g = Grant::new(&p.b.qp, buf, 0..PAGE, RemoteAccess::WRITE, 1, |_| {
        Ok(poll_one(&p.b.cq))
    })
    .unwrap();
    println!("Grant::new on {} chose {:?}: {g:?}", p.ctx.name(), g.kind());
    assert!(!format!("{g:?}").contains(&format!("{:#x}", g.token().rkey())));
    if p.ctx.name().starts_with("rxe") {
        assert_eq!(g.kind(), GrantKind::Region, "rxe: dedicated registrations");
        let buf = pool.try_acquire(PAGE).unwrap().unwrap();
        let err = Grant::window(
            &p.b.qp,
            buf,
            0..PAGE,
            RemoteAccess::WRITE,
            2,
            |_| unreachable!(),
        )
        .unwrap_err();
        println!("Grant::window on rxe: {err}");
        assert!(matches!(err, tokio_rdma::Error::Unsupported(_)));
    }
    // Plain memory (no MW_BIND registration) always gets a dedicated registration.
    let g = Grant::new(
        &p.b.qp,
        vec![0u8; 64],
        0..64,
        RemoteAccess::READ,
        3,
        |_| unreachable!(),
    )
    .unwrap();
    assert_eq!(g.kind(), GrantKind::Region);
}

/// Characterises rxe's type-2 windows at the verbs level: bind, in-bounds write, an access
/// beyond the window (rxe 6.1 lets it through when it stays inside the memory region: this is
/// why `MemoryWindow::bounds_enforced` is false for rxe), and revocation by deallocation.
#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn type2_window_bind_bounds_and_revoke_at_the_verbs_level() {
    let p = connected_pair(QP_ACCESS);
    if !p.ctx.device_attr().supports_mw_type2() {
        println!(
            "{}: no type-2 windows; nothing to characterise",
            p.ctx.name()
        );
        return;
    }
    let mut outer = RegisteredBuffer::new(&p.pd, 3 * PAGE, AccessFlags::LOCAL_WRITE).unwrap();
    outer.write_at(0, &[CANARY; 3 * PAGE]);
    // SAFETY: `outer` outlives `mr` (dropped at the end of the test, after `mr`).
    let mr = unsafe {
        MemoryRegion::register(
            &p.pd,
            outer.addr() as *mut u8,
            3 * PAGE,
            AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND,
        )
    }
    .unwrap();
    let mw = MemoryWindow::alloc_type2(&p.pd).unwrap();
    let addr = outer.addr() + PAGE as u64;
    // SAFETY: `mw`, `mr` and the QP outlive the bind's completion, polled right here.
    let rkey = unsafe {
        mw.post_bind(
            &p.b.qp,
            1,
            &mr,
            addr,
            PAGE as u64,
            AccessFlags::REMOTE_WRITE,
        )
    }
    .unwrap();
    let wc = poll_one(&p.b.cq);
    assert_eq!(wc.wr_id(), 1);
    wc.result().unwrap();
    let token = RemoteToken::new(addr, PAGE as u64, rkey);
    let data = pattern(PAGE, 8);
    remote_write(&p, token, addr, &data).result().unwrap();
    let mut seen = vec![0; PAGE];
    outer.read_at(PAGE, &mut seen);
    assert_eq!(seen, data, "write through the window landed");
    let oob = remote_write(&p, token, addr, &vec![0x11; PAGE + 1]);
    println!(
        "{}: write of window length + 1 through a type-2 window -> {}",
        p.ctx.name(),
        oob.status()
    );
    if oob.status() == WcStatus::Success {
        let mut b = [0u8; 1];
        outer.read_at(2 * PAGE, &mut b);
        println!(
            "  byte after the window is now {:#x} (canary {CANARY:#x})",
            b[0]
        );
        assert!(
            !MemoryWindow::bounds_enforced(&p.ctx),
            "the device let an access past the window through: bounds_enforced must say so"
        );
        drop(mw); // revoke
        let after = remote_write(&p, token, addr, &[0x22; 8]);
        println!("  write after ibv_dealloc_mw -> {}", after.status());
        assert_eq!(after.status(), WcStatus::RemAccessErr);
    } else {
        assert_eq!(oob.status(), WcStatus::RemAccessErr);
    }
    drop(mr);
}

#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn peer_writes_into_the_granted_range() {
    for kind in kinds(&connected_pair(QP_ACCESS)) {
        let p = connected_pair(QP_ACCESS);
        let pool = pool(&p);
        let g = grant(&p, &pool, kind, RemoteAccess::WRITE);
        let token = g.token();
        assert_eq!(token.len(), PAGE as u64);
        let data = pattern(PAGE, 3);
        remote_write(&p, token, token.addr(), &data)
            .result()
            .unwrap();
        let mut seen = vec![0; PAGE];
        g.read_at(PAGE, &mut seen);
        assert_eq!(seen, data, "{kind:?}: the peer's write is visible");
        // A sliced token works within its bounds.
        let part = token.slice(100..200).unwrap();
        remote_write(&p, part, part.addr(), &[7; 100])
            .result()
            .unwrap();
        g.read_at(PAGE + 100, &mut seen[..100]);
        assert!(seen[..100].iter().all(|&b| b == 7));
        assert!(token.slice(0..PAGE as u64 + 1).is_err());
        assert_canaries(&g);
        let buf = g.revoke();
        assert_eq!(buf[PAGE + 100], 7, "{kind:?}: buffer back after revoke");
        println!("{kind:?}: peer write into grant ok");
    }
}

#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn accesses_outside_the_grant_fail() {
    for kind in kinds(&connected_pair(QP_ACCESS)) {
        // One byte past the end, one byte before the start: each on a fresh connection (a
        // remote access error moves the requester's QP to the error state).
        for (name, offset, len) in [("past end", 0i64, PAGE + 1), ("before start", -1, 2)] {
            let p = connected_pair(QP_ACCESS);
            let pool = pool(&p);
            let g = grant(&p, &pool, kind, RemoteAccess::WRITE);
            let t = g.token();
            let addr = t.addr().wrapping_add_signed(offset);
            let wc = remote_write(&p, t, addr, &vec![0x11; len]);
            assert_eq!(
                wc.status(),
                WcStatus::RemAccessErr,
                "{kind:?} {name}: {wc:?}"
            );
            assert_canaries(&g);
            let mut inside = vec![0; PAGE];
            g.read_at(PAGE, &mut inside);
            assert!(
                inside.iter().all(|&b| b == CANARY),
                "{kind:?} {name}: nothing written"
            );
            println!("{kind:?}: write {name} -> {}", wc.status());
        }
    }
}

#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn access_after_revoke_fails() {
    for kind in kinds(&connected_pair(QP_ACCESS)) {
        let p = connected_pair(QP_ACCESS);
        let pool = pool(&p);
        let g = grant(&p, &pool, kind, RemoteAccess::WRITE);
        let token = g.token();
        remote_write(&p, token, token.addr(), &[1; 16])
            .result()
            .unwrap();
        let buf = g.revoke();
        let wc = remote_write(&p, token, token.addr(), &[2; 16]);
        assert_eq!(wc.status(), WcStatus::RemAccessErr, "{kind:?}: {wc:?}");
        assert!(
            buf[PAGE..PAGE + 16].iter().all(|&b| b == 1),
            "{kind:?}: unchanged"
        );
        assert!(buf[..PAGE].iter().all(|&b| b == CANARY));
        println!("{kind:?}: write after revoke -> {}", wc.status());
    }
}

#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn read_only_grant_rejects_writes() {
    for kind in kinds(&connected_pair(QP_ACCESS)) {
        let p = connected_pair(QP_ACCESS);
        let pool = pool(&p);
        let mut g = grant(&p, &pool, kind, RemoteAccess::READ);
        let data = pattern(PAGE, 5);
        g.write_at(PAGE, &data);
        let back = RegisteredBuffer::new(&p.pd, PAGE, AccessFlags::LOCAL_WRITE).unwrap();
        let sge = [back.sge(0..PAGE)];
        let t = g.token();
        let read = SendOp::Read {
            remote_addr: t.addr(),
            rkey: t.rkey(),
        };
        // SAFETY: `back` outlives the completion.
        unsafe { p.a.qp.post_send(&[SendWr::new(3, read, &sge)]).unwrap() };
        poll_one(&p.a.cq).result().unwrap();
        assert_eq!(
            back.as_slice().unwrap(),
            &data[..],
            "{kind:?}: read allowed"
        );
        let wc = remote_write(&p, t, t.addr(), &[0; 8]);
        assert_eq!(
            wc.status(),
            WcStatus::RemAccessErr,
            "{kind:?}: write refused"
        );
        assert_canaries(&g);
    }
}

#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn atomic_grant_counts() {
    for kind in kinds(&connected_pair(QP_ACCESS)) {
        let p = connected_pair(QP_ACCESS);
        let pool = pool(&p);
        let mut g = grant(&p, &pool, kind, RemoteAccess::ATOMIC);
        g.write_at(PAGE, &40u64.to_ne_bytes());
        let old = RegisteredBuffer::new(&p.pd, 8, AccessFlags::LOCAL_WRITE).unwrap();
        let sge = [old.sge(0..8)];
        let t = g.token();
        let fa = SendOp::FetchAdd {
            remote_addr: t.addr(),
            rkey: t.rkey(),
            add: 2,
        };
        // SAFETY: `old` outlives the completion.
        unsafe { p.a.qp.post_send(&[SendWr::new(4, fa, &sge)]).unwrap() };
        poll_one(&p.a.cq).result().unwrap();
        assert_eq!(u64::from_ne_bytes(old.to_vec().try_into().unwrap()), 40);
        assert_eq!(g.load_u64(PAGE), 42, "{kind:?}");
    }
}
