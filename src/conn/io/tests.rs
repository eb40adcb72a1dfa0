//! Host unit tests of the connection I/O's pure parts.

use super::{Local, RECV_SEQ_MASK, SEND_BIT, next_recv_seq};
use crate::conn::srq::SRQ_BIT;

#[test]
fn receive_sequence_numbers_wrap_before_they_look_like_shared_or_send_ones() {
    // From zero, and across the wrap: every receive a connection posts reads as its own
    // receive, never as one from the shared receive queue (the 2^30-th receive did) or a send.
    let mut seq = 0;
    for _ in 0..4 {
        assert_eq!(Local::of(seq), Local::Recv, "seq {seq:#x}");
        seq = next_recv_seq(seq);
    }
    let mut seq = RECV_SEQ_MASK - 3;
    for _ in 0..8 {
        assert_eq!(Local::of(seq), Local::Recv, "seq {seq:#x}");
        seq = next_recv_seq(seq);
    }
    assert_eq!(seq, 4, "the sequence wrapped to 0");
    assert_eq!(next_recv_seq(SRQ_BIT - 1), 0);
    // The other kinds.
    assert_eq!(Local::of(SRQ_BIT | 7), Local::Shared);
    assert_eq!(Local::of(SEND_BIT | 7), Local::Send(7));
    assert_eq!(Local::of(SEND_BIT | SRQ_BIT | 7), Local::Send(SRQ_BIT | 7));
}
