//! Data receives go back in batches (`ConnProto::recvs_to_post`): the batch boundaries, the
//! settled state between them, and control receives that never wait for a batch.

use std::task::{Context, Poll};

use super::tests::{config, hostile, imm};
use crate::proto::msg::MsgKind;

#[test]
fn data_receives_go_back_in_batches_and_never_run_out() {
    // 16 credits: a batch of 4. Control receives are not batched.
    let mut p = hostile(config(16, 64));
    assert_eq!(p.repost_batch(), 4);
    let waker = std::task::Waker::noop();
    let mut cx = Context::from_waker(waker);
    for round in 0..3 {
        for k in 1..=4u32 {
            p.handle_recv(Ok((8, imm(MsgKind::Last, 0))), vec![0u8; 8]);
            let Poll::Ready(Ok(Some(d))) = p.poll_recv(&mut cx) else {
                panic!("message {k} of round {round}");
            };
            p.consumed(d.holds_buffer(), d.len());
            // What the shell's pump takes after every change.
            let _ = (
                p.take_driver_kick(),
                p.take_deadline_moved(),
                p.take_wakers(),
            );
            let due = p.recvs_to_post();
            if k < 4 {
                assert_eq!(due, 0, "round {round}: {k} received, batch not complete");
                assert!(p.settled(), "round {round}: nothing for the shell to do");
            } else {
                assert_eq!(due, 4, "round {round}: the batch goes back at once");
                p.recvs_posted(due);
                // Their credits return on the next message out (as a reply's would).
                assert_eq!(p.credits.take_owed(), 4);
            }
        }
    }
    // A control message's receive goes back at once, without the data receives due.
    p.handle_recv(Ok((8, imm(MsgKind::Last, 0))), vec![0u8; 8]);
    let Poll::Ready(Ok(Some(d))) = p.poll_recv(&mut cx) else {
        panic!("a message");
    };
    p.consumed(d.holds_buffer(), d.len());
    p.handle_recv(Ok((0, imm(MsgKind::Credit, 0))), Vec::new());
    assert_eq!(p.recvs_to_post(), 1, "the control receive only");
    // One credit: every receive goes back at once.
    let p = hostile(config(1, 64));
    assert_eq!(p.repost_batch(), 1);
}
