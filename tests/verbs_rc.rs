//! Device tests of the verbs layer on a real device (soft-RoCE `rxe0` in the VM): two RC queue
//! pairs connected to each other, data verified for each operation by polling the CQ.

#![allow(clippy::print_stdout)]

mod common;

use common::{connected_pair, pattern, poll_one};
use tokio_rdma::WcStatus;
use tokio_rdma::verbs::{AccessFlags, RecvWr, RegisteredBuffer, SendOp, SendWr, WcOpcode};

const REMOTE_RW: AccessFlags = AccessFlags::LOCAL_WRITE
    .union(AccessFlags::REMOTE_READ)
    .union(AccessFlags::REMOTE_WRITE);

#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn device_and_port_queries() {
    let (ctx, port) = common::open_device();
    let attr = ctx.device_attr();
    assert!(
        attr.max_qp_wr > 0 && attr.max_sge > 0 && attr.max_cqe > 0,
        "{attr:?}"
    );
    let p = ctx.query_port(port).expect("query port");
    assert!(p.active_mtu.is_some(), "{p:?}");
    let table = ctx.gid_table(port).expect("gid table");
    assert!(!table.is_empty(), "rxe0 has GIDs");
    let gid = ctx.preferred_gid(port).expect("preferred gid");
    println!(
        "{}: port {port} {p:?}\n  preferred gid {gid:?}\n  {attr:?}",
        ctx.name()
    );
    let err = tokio_rdma::verbs::Context::open("no-such-device").unwrap_err();
    assert!(
        matches!(&err, tokio_rdma::Error::DeviceNotFound { available, .. } if available.contains(&ctx.name().to_string())),
        "{err}"
    );
}

#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn send_recv_round_trip() {
    let p = connected_pair(AccessFlags::NONE);
    for (i, len) in [1usize, 64, 4096, 65536].into_iter().enumerate() {
        let mut tx = RegisteredBuffer::new(&p.pd, len, AccessFlags::LOCAL_WRITE).unwrap();
        let rx = RegisteredBuffer::new(&p.pd, len, AccessFlags::LOCAL_WRITE).unwrap();
        let data = pattern(len, i as u8);
        tx.as_mut_slice().unwrap().copy_from_slice(&data);
        let rsge = [rx.sge(0..len)];
        let tsge = [tx.sge(0..len)];
        // SAFETY: both buffers outlive the completions polled below and are not touched until then.
        unsafe {
            p.b.qp
                .post_recv(&[RecvWr::new(100 + i as u64, &rsge)])
                .unwrap();
            p.a.qp
                .post_send(&[SendWr::new(i as u64, SendOp::Send, &tsge)])
                .unwrap();
        }
        let swc = poll_one(&p.a.cq);
        swc.result().unwrap();
        assert_eq!((swc.wr_id(), swc.opcode()), (i as u64, WcOpcode::Send));
        let rwc = poll_one(&p.b.cq);
        rwc.result().unwrap();
        assert_eq!(rwc.wr_id(), 100 + i as u64);
        assert_eq!(rwc.opcode(), WcOpcode::Recv);
        assert_eq!(rwc.byte_len() as usize, len);
        assert_eq!(rwc.qp_num(), p.b.qp.qpn());
        assert_eq!(rx.as_slice().unwrap(), &data[..], "payload of {len} bytes");
    }
}

#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn inline_send_with_imm_and_chained_post() {
    let p = connected_pair(AccessFlags::NONE);
    let rx: Vec<RegisteredBuffer> = (0..3)
        .map(|_| RegisteredBuffer::new(&p.pd, 64, AccessFlags::LOCAL_WRITE).unwrap())
        .collect();
    let rsges: Vec<_> = rx.iter().map(|b| [b.sge(0..64)]).collect();
    let recvs: Vec<RecvWr<'_>> = rsges
        .iter()
        .enumerate()
        .map(|(i, s)| RecvWr::new(i as u64, s))
        .collect();
    // Inline payload lives on the stack: the device copies it during the post.
    let msgs: Vec<Vec<u8>> = (0..3).map(|i| pattern(16 + i, i as u8)).collect();
    let tsges: Vec<_> = msgs
        .iter()
        .map(|m| {
            [tokio_rdma::verbs::Sge::new(
                m.as_ptr() as u64,
                m.len() as u32,
                0,
            )]
        })
        .collect();
    let sends: Vec<SendWr<'_>> = tsges
        .iter()
        .enumerate()
        .map(|(i, s)| {
            SendWr::new(10 + i as u64, SendOp::SendWithImm(0xabc0 + i as u32), s).inline(true)
        })
        .collect();
    // SAFETY: receive buffers outlive their completions; sends are inline.
    unsafe {
        p.b.qp.post_recv(&recvs).unwrap();
        p.a.qp.post_send(&sends).unwrap(); // one chained post, one doorbell
    }
    for i in 0..3u64 {
        poll_one(&p.a.cq).result().unwrap();
        let wc = poll_one(&p.b.cq);
        wc.result().unwrap();
        assert_eq!(wc.wr_id(), i, "receives complete in order");
        assert_eq!(wc.imm(), Some(0xabc0 + i as u32));
        let m = &msgs[i as usize];
        assert_eq!(wc.byte_len() as usize, m.len());
        assert_eq!(&rx[i as usize].as_slice().unwrap()[..m.len()], &m[..]);
    }
}

#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn rdma_write_and_read() {
    let p = connected_pair(REMOTE_RW);
    let len = 1 << 20;
    let target = RegisteredBuffer::new(&p.pd, len, REMOTE_RW).unwrap();
    let mut src = RegisteredBuffer::new(&p.pd, len, AccessFlags::LOCAL_WRITE).unwrap();
    let data = pattern(len, 7);
    src.as_mut_slice().unwrap().copy_from_slice(&data);
    let sge = [src.sge(0..len)];
    let write = SendOp::Write {
        remote_addr: target.addr(),
        rkey: target.rkey(),
    };
    // SAFETY: `src` outlives the completion polled below.
    unsafe { p.a.qp.post_send(&[SendWr::new(1, write, &sge)]).unwrap() };
    let wc = poll_one(&p.a.cq);
    wc.result().unwrap();
    assert_eq!(wc.opcode(), WcOpcode::RdmaWrite);
    assert_eq!(target.to_vec(), data, "RDMA WRITE landed");

    // Read back a window from the middle into a fresh buffer.
    let back = RegisteredBuffer::new(&p.pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
    let bsge = [back.sge(0..4096)];
    let read = SendOp::Read {
        remote_addr: target.addr() + 12345,
        rkey: target.rkey(),
    };
    // SAFETY: `back` outlives the completion and is not read before it.
    unsafe { p.a.qp.post_send(&[SendWr::new(2, read, &bsge)]).unwrap() };
    let wc = poll_one(&p.a.cq);
    wc.result().unwrap();
    assert_eq!(wc.opcode(), WcOpcode::RdmaRead);
    assert_eq!(wc.byte_len(), 4096);
    assert_eq!(back.as_slice().unwrap(), &data[12345..12345 + 4096]);
}

#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn write_with_imm_consumes_a_receive() {
    let p = connected_pair(REMOTE_RW);
    let target = RegisteredBuffer::new(&p.pd, 8192, REMOTE_RW).unwrap();
    let mut src = RegisteredBuffer::new(&p.pd, 8192, AccessFlags::LOCAL_WRITE).unwrap();
    let data = pattern(8192, 3);
    src.as_mut_slice().unwrap().copy_from_slice(&data);
    // A zero-length receive is enough: the payload goes to the remote address.
    // SAFETY: no memory is named by the receive.
    unsafe { p.b.qp.post_recv(&[RecvWr::new(77, &[])]).unwrap() };
    let sge = [src.sge(0..8192)];
    let op = SendOp::WriteWithImm {
        remote_addr: target.addr(),
        rkey: target.rkey(),
        imm: 0xdead_beef,
    };
    // SAFETY: `src` outlives the completion.
    unsafe { p.a.qp.post_send(&[SendWr::new(5, op, &sge)]).unwrap() };
    poll_one(&p.a.cq).result().unwrap();
    let wc = poll_one(&p.b.cq);
    wc.result().unwrap();
    assert_eq!(wc.wr_id(), 77);
    assert_eq!(wc.opcode(), WcOpcode::RecvRdmaWithImm);
    assert_eq!(wc.imm(), Some(0xdead_beef));
    assert_eq!(wc.byte_len(), 8192);
    assert_eq!(target.to_vec(), data);
}

#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn atomics_return_previous_value() {
    let access = REMOTE_RW.union(AccessFlags::REMOTE_ATOMIC);
    let p = connected_pair(access);
    if !p.ctx.device_attr().supports_atomics() {
        panic!("{} reports no atomic support", p.ctx.name());
    }
    let mut target = RegisteredBuffer::new(&p.pd, 8, access).unwrap();
    target.write_at(0, &40u64.to_ne_bytes());
    let old = RegisteredBuffer::new(&p.pd, 8, AccessFlags::LOCAL_WRITE).unwrap();
    let sge = [old.sge(0..8)];
    let fa = SendOp::FetchAdd {
        remote_addr: target.addr(),
        rkey: target.rkey(),
        add: 2,
    };
    // SAFETY: `old` outlives the completion.
    unsafe { p.a.qp.post_send(&[SendWr::new(1, fa, &sge)]).unwrap() };
    poll_one(&p.a.cq).result().unwrap();
    assert_eq!(u64::from_ne_bytes(old.to_vec().try_into().unwrap()), 40);
    let cs = SendOp::CompareSwap {
        remote_addr: target.addr(),
        rkey: target.rkey(),
        compare: 42,
        swap: 7,
    };
    // SAFETY: as above.
    unsafe { p.a.qp.post_send(&[SendWr::new(2, cs, &sge)]).unwrap() };
    poll_one(&p.a.cq).result().unwrap();
    assert_eq!(u64::from_ne_bytes(old.to_vec().try_into().unwrap()), 42);
    let mut now = [0u8; 8];
    target.read_at(0, &mut now);
    assert_eq!(u64::from_ne_bytes(now), 7);
}

#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn out_of_bounds_write_is_a_remote_access_error() {
    let p = connected_pair(REMOTE_RW);
    // Canaries around the target: a 3-page buffer, only the middle page is registered remotely.
    let mut outer = RegisteredBuffer::new(&p.pd, 3 * 4096, AccessFlags::LOCAL_WRITE).unwrap();
    outer.write_at(0, &[0xa5; 3 * 4096]);
    // SAFETY: `outer` outlives `grant` (dropped first at the end of the test).
    let grant = unsafe {
        tokio_rdma::verbs::MemoryRegion::register(
            &p.pd,
            (outer.addr() + 4096) as *mut u8,
            4096,
            REMOTE_RW,
        )
    }
    .unwrap();
    let mut src = RegisteredBuffer::new(&p.pd, 8192, AccessFlags::LOCAL_WRITE).unwrap();
    src.as_mut_slice().unwrap().fill(0x11);
    let sge = [src.sge(0..4097)];
    // One byte past the end of the granted region.
    let op = SendOp::Write {
        remote_addr: grant.addr(),
        rkey: grant.rkey(),
    };
    // SAFETY: `src` outlives the completion.
    unsafe { p.a.qp.post_send(&[SendWr::new(9, op, &sge)]).unwrap() };
    let wc = poll_one(&p.a.cq);
    assert_eq!(wc.wr_id(), 9);
    assert_eq!(wc.status(), WcStatus::RemAccessErr, "{wc:?}");
    let err = wc.result().unwrap_err();
    assert!(err.to_string().contains("IBV_WC_REM_ACCESS_ERR"), "{err}");
    let io: std::io::Error = err.into();
    assert_eq!(io.kind(), std::io::ErrorKind::PermissionDenied);
    // The requester's QP is now in error: a later request is flushed.
    let sge1 = [src.sge(0..8)];
    // SAFETY: as above.
    unsafe {
        p.a.qp
            .post_send(&[SendWr::new(
                10,
                SendOp::Write {
                    remote_addr: grant.addr(),
                    rkey: grant.rkey(),
                },
                &sge1,
            )])
            .unwrap()
    };
    assert_eq!(poll_one(&p.a.cq).status(), WcStatus::WrFlushErr);
    drop(grant);
    // Canaries intact: the device wrote nothing outside (or inside) the grant.
    let all = outer.to_vec();
    assert!(
        all[..4096].iter().all(|&b| b == 0xa5),
        "canary before the grant"
    );
    assert!(
        all[8192..].iter().all(|&b| b == 0xa5),
        "canary after the grant"
    );
}

#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn qp_to_error_flushes_posted_receives() {
    let p = connected_pair(AccessFlags::NONE);
    let rx = RegisteredBuffer::new(&p.pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    let sge = [rx.sge(0..64)];
    // SAFETY: `rx` outlives the flush completion.
    unsafe { p.b.qp.post_recv(&[RecvWr::new(5, &sge)]).unwrap() };
    p.b.qp.to_error().unwrap();
    assert_eq!(p.b.qp.state().unwrap(), tokio_rdma::verbs::QpState::Err);
    let wc = poll_one(&p.b.cq);
    assert_eq!((wc.wr_id(), wc.status()), (5, WcStatus::WrFlushErr));
}
