//! Device tests of the registered-buffer pool on soft-RoCE: pool buffers as the local side of
//! SEND/RECV, RDMA WRITE and RDMA READ, posted at the verbs level with the buffers' own lkeys,
//! data verified; and a pool on 2 MiB huge pages.

#![allow(clippy::print_stdout)]

mod common;

use common::{connected_pair, pattern, poll_one};
use tokio_rdma::buf::{IoBuf, Pool, PoolConfig, SizeClass};
use tokio_rdma::verbs::{
    AccessFlags, HugePages, RecvWr, RegisteredBuffer, SendOp, SendWr, WcOpcode,
};

const REMOTE_RW: AccessFlags = AccessFlags::LOCAL_WRITE
    .union(AccessFlags::REMOTE_READ)
    .union(AccessFlags::REMOTE_WRITE);

fn classes() -> [SizeClass; 3] {
    [
        SizeClass::new(4 << 10, 64),
        SizeClass::new(64 << 10, 8),
        SizeClass::new(1 << 20, 4),
    ]
}

#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn send_recv_between_pool_buffers() {
    let p = connected_pair(AccessFlags::NONE);
    let pool = Pool::with_pd(&p.pd, PoolConfig::default().classes(classes())).unwrap();
    let m = pool.metrics();
    println!("pool on {}: {m:?}", p.ctx.name());
    assert_eq!(m.registrations, 3);
    for (i, len) in [1usize, 100, 4096, 65536, 1 << 20].into_iter().enumerate() {
        let mut tx = pool.try_acquire(len).unwrap().expect("free buffer");
        let rx = pool.try_acquire(len).unwrap().expect("free buffer");
        let data = pattern(len, i as u8);
        tx.copy_from_slice(&data);
        assert_eq!(IoBuf::lkey(&tx), Some(tx.lkey()));
        let (tsge, rsge) = ([tx.sge(0..len)], [rx.sge(0..len)]);
        // SAFETY: both buffers outlive the completions polled below and are not accessed
        // until then.
        unsafe {
            p.b.qp.post_recv(&[RecvWr::new(i as u64, &rsge)]).unwrap();
            p.a.qp
                .post_send(&[SendWr::new(i as u64, SendOp::Send, &tsge)])
                .unwrap();
        }
        poll_one(&p.a.cq).result().unwrap();
        let wc = poll_one(&p.b.cq);
        wc.result().unwrap();
        assert_eq!((wc.opcode(), wc.byte_len() as usize), (WcOpcode::Recv, len));
        assert_eq!(&rx[..], &data[..], "payload of {len} bytes");
    }
    assert_eq!(pool.metrics().bytes_in_use, 0, "every buffer went back");
}

#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn rdma_write_and_read_from_pool_buffers() {
    let p = connected_pair(REMOTE_RW);
    let pool = Pool::with_pd(&p.pd, PoolConfig::default().classes(classes())).unwrap();
    let len = 1 << 20;
    let target = RegisteredBuffer::new(&p.pd, len, REMOTE_RW).unwrap();
    let mut src = pool.try_acquire(len).unwrap().unwrap();
    let data = pattern(len, 9);
    src.copy_from_slice(&data);
    let sge = [src.sge(0..len)];
    let write = SendOp::Write {
        remote_addr: target.addr(),
        rkey: target.rkey(),
    };
    // SAFETY: `src` outlives the completion.
    unsafe { p.a.qp.post_send(&[SendWr::new(1, write, &sge)]).unwrap() };
    let wc = poll_one(&p.a.cq);
    wc.result().unwrap();
    assert_eq!(wc.opcode(), WcOpcode::RdmaWrite);
    assert_eq!(target.to_vec(), data, "WRITE from a pool buffer landed");

    let back = pool.try_acquire(60_000).unwrap().unwrap();
    let bsge = [back.sge(0..60_000)];
    let read = SendOp::Read {
        remote_addr: target.addr() + 777,
        rkey: target.rkey(),
    };
    // SAFETY: `back` outlives the completion and is not read before it.
    unsafe { p.a.qp.post_send(&[SendWr::new(2, read, &bsge)]).unwrap() };
    let wc = poll_one(&p.a.cq);
    wc.result().unwrap();
    assert_eq!((wc.opcode(), wc.byte_len()), (WcOpcode::RdmaRead, 60_000));
    assert_eq!(
        &back[..],
        &data[777..777 + 60_000],
        "READ into a pool buffer"
    );
}

#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn frozen_pool_buffer_is_sent_and_returns_on_last_drop() {
    let p = connected_pair(AccessFlags::NONE);
    let pool = Pool::with_pd(&p.pd, PoolConfig::default().classes(classes())).unwrap();
    let mut tx = pool.try_acquire(5000).unwrap().unwrap();
    tx.copy_from_slice(&pattern(5000, 1));
    let lkey = tx.lkey();
    let bytes = tx.freeze();
    let rx = pool.try_acquire(5000).unwrap().unwrap();
    let rsge = [rx.sge(0..5000)];
    // The Bytes still points into the registered slot, so the slot's lkey covers it.
    let tsge = [tokio_rdma::verbs::Sge::new(
        bytes.as_ptr() as u64,
        5000,
        lkey,
    )];
    // SAFETY: `bytes` and `rx` outlive the completions.
    unsafe {
        p.b.qp.post_recv(&[RecvWr::new(1, &rsge)]).unwrap();
        p.a.qp
            .post_send(&[SendWr::new(1, SendOp::Send, &tsge)])
            .unwrap();
    }
    poll_one(&p.a.cq).result().unwrap();
    poll_one(&p.b.cq).result().unwrap();
    assert_eq!(&rx[..], &bytes[..]);
    let copy = bytes.clone();
    drop(bytes);
    assert_eq!(pool.metrics().buffers_in_use, 2);
    drop((copy, rx));
    assert_eq!(pool.metrics().buffers_in_use, 0);
}

#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn huge_page_pool_registers_and_carries_data() {
    let path = "/proc/sys/vm/nr_hugepages";
    let have: u64 = std::fs::read_to_string(path)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    if have < 8 {
        // The VM runs as root: reserve a few 2 MiB pages for this test.
        std::fs::write(path, "16").expect("reserve huge pages (needs root)");
    }
    let p = connected_pair(AccessFlags::NONE);
    let cfg = PoolConfig::default()
        .classes([SizeClass::new(4096, 512), SizeClass::new(1 << 20, 2)])
        .huge_pages(HugePages::Require);
    let pool = Pool::with_pd(&p.pd, cfg).unwrap();
    let m = pool.metrics();
    println!("huge-page pool: {m:?}");
    assert!(m.huge_pages);
    assert_eq!(m.bytes_registered, 4 << 20);
    let mut tx = pool.try_acquire(1 << 20).unwrap().unwrap();
    assert_eq!(
        tx.addr() % (1 << 20),
        0,
        "1 MiB slots of a huge-page-aligned mapping"
    );
    let rx = pool.try_acquire(1 << 20).unwrap().unwrap();
    let data = pattern(1 << 20, 4);
    tx.copy_from_slice(&data);
    let (tsge, rsge) = ([tx.sge(0..1 << 20)], [rx.sge(0..1 << 20)]);
    // SAFETY: both buffers outlive the completions.
    unsafe {
        p.b.qp.post_recv(&[RecvWr::new(1, &rsge)]).unwrap();
        p.a.qp
            .post_send(&[SendWr::new(1, SendOp::Send, &tsge)])
            .unwrap();
    }
    poll_one(&p.a.cq).result().unwrap();
    poll_one(&p.b.cq).result().unwrap();
    assert_eq!(&rx[..], &data[..]);
}

#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn async_acquire_waits_for_a_buffer_on_a_real_pool() {
    let p = connected_pair(AccessFlags::NONE);
    let cfg = PoolConfig::default().classes([SizeClass::new(4096, 2)]);
    let pool = Pool::with_pd(&p.pd, cfg).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let a = pool.acquire(4096).await.unwrap();
        let b = pool.acquire(4096).await.unwrap();
        let p2 = pool.clone();
        let waiter = tokio::spawn(async move { p2.acquire(10).await.unwrap().lkey() });
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(!waiter.is_finished(), "exhausted: the acquire waits");
        let lkey = a.lkey();
        drop(a);
        assert_eq!(waiter.await.unwrap(), lkey);
        drop(b);
    });
    let m = pool.metrics();
    assert_eq!((m.bytes_in_use, m.waits), (0, 1));
}
