//! Device tests of the verbs-level shared receive queue: two receiving queue pairs consume one
//! SRQ's receives (each completion names its queue pair, each payload lands in the buffer of
//! the receive it consumed), the armed limit raises `IBV_EVENT_SRQ_LIMIT_REACHED` for that
//! queue once fewer receives remain, and sizes beyond the device's are refused with its limits
//! named.
#![allow(clippy::print_stdout)]

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::{connect_qps, open_device, poll_one};
use tokio_rdma::Error;
use tokio_rdma::verbs::{
    AccessFlags, CompletionQueue, EventElement, ProtectionDomain, QpInitAttr, QueuePair, RecvWr,
    RegisteredBuffer, SendOp, SendWr, SharedReceiveQueue,
};

const SLOT: usize = 256;

#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn two_queue_pairs_share_receives_and_the_limit_event_fires() {
    let (ctx, _) = open_device();
    let pd = ProtectionDomain::new(&ctx).expect("pd");
    let attr = ctx.device_attr();
    println!(
        "{}: max_srq {} max_srq_wr {} max_srq_sge {}",
        ctx.name(),
        attr.max_srq,
        attr.max_srq_wr,
        attr.max_srq_sge
    );

    // Refused sizes name the device's limits.
    let err = SharedReceiveQueue::new(&pd, attr.max_srq_wr + 1, 1).expect_err("too deep");
    println!("too deep: {err}");
    assert!(
        matches!(err, Error::InvalidArgument(ref m) if m.to_string().contains("max_srq_wr")),
        "{err}"
    );

    let srq = SharedReceiveQueue::new(&pd, 16, 1).expect("srq");
    let rcq = CompletionQueue::new(&ctx, 64, None).expect("cq");
    let scq = CompletionQueue::new(&ctx, 64, None).expect("cq");
    let mut rattr = QpInitAttr::new(&rcq, &rcq);
    rattr.srq = Some(srq.clone());
    let sattr = QpInitAttr::new(&scq, &scq);
    let receivers = [
        QueuePair::new_rc(&pd, &rattr).expect("qp"),
        QueuePair::new_rc(&pd, &rattr).expect("qp"),
    ];
    let senders = [
        QueuePair::new_rc(&pd, &sattr).expect("qp"),
        QueuePair::new_rc(&pd, &sattr).expect("qp"),
    ];
    for (r, s) in receivers.iter().zip(&senders) {
        connect_qps(&ctx, r, s, AccessFlags::LOCAL_WRITE);
    }
    assert!(receivers[0].srq().is_some() && senders[0].srq().is_none());

    // A receive queue pair on an SRQ has no receive queue of its own.
    let rbuf = RegisteredBuffer::new(&pd, 8 * SLOT, AccessFlags::LOCAL_WRITE).expect("mr");
    let sge = [rbuf.sge(0..SLOT)];
    // SAFETY: nothing is posted if this fails as it must; `rbuf` outlives the queue pairs.
    let own = unsafe { receivers[0].post_recv(&[RecvWr::new(99, &sge)]) };
    println!("post_recv on a queue pair with an SRQ: {own:?}");
    assert!(
        own.is_err(),
        "a queue pair on an SRQ takes no receives of its own"
    );

    // 8 receives in the SRQ, slot i at wr_id i; the limit armed at 4.
    let sges: Vec<_> = (0..8)
        .map(|i| [rbuf.sge(i * SLOT..(i + 1) * SLOT)])
        .collect();
    let wrs: Vec<RecvWr<'_>> = (0..8).map(|i| RecvWr::new(i as u64, &sges[i])).collect();
    // SAFETY: `rbuf` stays registered and untouched until the completions are polled.
    unsafe { srq.post_recv(&wrs) }.expect("post to the srq");
    srq.arm_limit(4).expect("arm");
    assert_eq!(srq.query().expect("query").limit, 4);
    ctx.set_async_nonblocking().expect("nonblocking");

    // Three messages from each sender: 6 receives consumed, 2 left (< 4).
    let mut sbuf = RegisteredBuffer::new(&pd, 6 * SLOT, AccessFlags::LOCAL_WRITE).expect("mr");
    let mut expect: BTreeMap<u32, Vec<Vec<u8>>> = BTreeMap::new();
    for k in 0..6 {
        let who = k % 2;
        let msg: Vec<u8> = format!("from sender {who}, message {k}").into_bytes();
        sbuf.write_at(k * SLOT, &msg);
        let sge = [sbuf.sge(k * SLOT..k * SLOT + msg.len())];
        let wr = SendWr::new(k as u64, SendOp::Send, &sge);
        // SAFETY: `sbuf` is registered and outlives the send's completion, polled next.
        unsafe { senders[who].post_send(&[wr]) }.expect("send");
        let wc = poll_one(&scq);
        assert!(wc.is_success(), "send {k}: {wc:?}");
        expect.entry(receivers[who].qpn()).or_default().push(msg);
    }
    let mut got: BTreeMap<u32, Vec<Vec<u8>>> = BTreeMap::new();
    let mut slots = Vec::new();
    for _ in 0..6 {
        let wc = poll_one(&rcq);
        assert!(wc.is_success(), "receive: {wc:?}");
        let slot = wc.wr_id() as usize;
        let mut data = vec![0u8; wc.byte_len() as usize];
        rbuf.read_at(slot * SLOT, &mut data);
        got.entry(wc.qp_num()).or_default().push(data);
        slots.push(slot);
    }
    println!("receives consumed, by slot: {slots:?}");
    assert_eq!(
        got, expect,
        "each queue pair's messages, in order, in the slots consumed"
    );
    slots.sort_unstable();
    slots.dedup();
    assert_eq!(slots.len(), 6, "every receive consumed once");

    // Fewer than 4 remain: the limit event arrives, for this SRQ, and disarms the limit.
    let deadline = Instant::now() + Duration::from_secs(30);
    let event = loop {
        if let Some(ev) = ctx.get_async_event().expect("async event") {
            if ev.name == "IBV_EVENT_SRQ_LIMIT_REACHED" {
                break ev;
            }
            println!("other event: {ev:?}");
        }
        assert!(Instant::now() < deadline, "no SRQ limit event within 30 s");
        std::thread::sleep(Duration::from_millis(5));
    };
    println!("event: {event:?}");
    assert_eq!(event.element, EventElement::Srq(srq.id()));
    assert!(!event.is_fatal());
    assert_eq!(
        srq.query().expect("query").limit,
        0,
        "disarmed by the event"
    );

    // The queue pairs keep the SRQ alive; it goes with the last of them.
    drop(srq);
    drop(receivers);
}
