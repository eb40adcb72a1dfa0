//! A hostile peer against one [`ConnProto`]: messages that break the protocol get a
//! protocol error and an error report to the peer, and an error report the peer never takes
//! is given up after the keepalive timeout.

use std::time::{Duration, Instant};

use super::tests::{config, hostile, imm, message};
use super::*;
use crate::error::QpFailure;

#[test]
fn hostile_peers_get_a_protocol_error_and_an_error_report() {
    let cfg = config(2, 64);
    type Case = (&'static str, Vec<(u32, Option<u32>)>, ProtocolError);
    let cases: Vec<Case> = vec![
        ("no immediate", vec![(4, None)], ProtocolError::NoImmediate),
        (
            "unknown kind",
            vec![(0, Some(9 << 28))],
            ProtocolError::BadHeader(9 << 28),
        ),
        (
            "beyond credits",
            vec![
                (1, imm(MsgKind::Last, 0)),
                (1, imm(MsgKind::Last, 0)),
                (1, imm(MsgKind::Last, 0)),
            ],
            ProtocolError::CreditOverrun,
        ),
        (
            "credit inflation",
            vec![(0, imm(MsgKind::Credit, 5))],
            ProtocolError::CreditInflation,
        ),
        (
            "payload on control",
            vec![(3, imm(MsgKind::Credit, 0))],
            ProtocolError::ControlWithPayload(3),
        ),
        (
            "stray abort",
            vec![(0, imm(MsgKind::Abort, 0))],
            ProtocolError::StrayAbort,
        ),
        (
            "close mid-message",
            vec![(64, imm(MsgKind::More, 0)), (0, imm(MsgKind::Close, 0))],
            ProtocolError::CloseMidMessage,
        ),
        (
            "data after close",
            vec![(0, imm(MsgKind::Close, 0)), (1, imm(MsgKind::Last, 0))],
            ProtocolError::DataAfterClose,
        ),
    ];
    for (what, msgs, want) in cases {
        let mut p = hostile(cfg);
        for (len, imm) in msgs {
            p.handle_recv(Ok((len, imm)), vec![0u8; 64]);
        }
        assert_eq!(p.failure(), Some(&QpFailure::Protocol(want)), "{what}");
        assert!(p.error_report_pending(), "{what}: the peer is told");
        let t = p.poll_transmit(Instant::now()).expect("error report");
        assert_eq!(t.kind, MsgKind::Error);
        assert_eq!(
            MsgHeader::decode(t.imm).unwrap().credits,
            want.code(),
            "{what}"
        );
    }
    // Too large: a message past the maximum (6 chunks of 64).
    let mut p = hostile(ConnConfig {
        recv_credits: 16,
        recv_initial: 16,
        ..cfg
    });
    for _ in 0..7 {
        p.handle_recv(Ok((64, imm(MsgKind::More, 0))), vec![0u8; 64]);
    }
    assert_eq!(
        p.failure(),
        Some(&QpFailure::Protocol(ProtocolError::MessageTooLarge(384)))
    );
    // The peer's own report.
    let mut p = hostile(cfg);
    p.handle_recv(Ok((0, imm(MsgKind::Error, 3))), Vec::new());
    assert_eq!(
        p.failure(),
        Some(&QpFailure::PeerReported(ProtocolError::CreditOverrun))
    );
}

#[test]
fn an_error_report_the_peer_never_takes_is_given_up_after_the_keepalive_timeout() {
    let cfg = ConnConfig {
        keepalive: None,
        keepalive_timeout: Duration::from_secs(3),
        ..config(4, 64)
    };
    let t0 = Instant::now();
    // (a) The peer never confirms our control messages: after three rounds of its two control
    // messages (each round makes us send a confirmation) our window is full, and the report
    // of its violation cannot be sent at all.
    let mut p = hostile(cfg);
    for _ in 0..3 {
        for _ in 0..2 {
            p.handle_recv(Ok((0, imm(MsgKind::Credit, 0))), Vec::new());
            let n = p.recvs_to_post();
            p.recvs_posted(n);
        }
        let t = p.poll_transmit(t0).expect("a confirmation");
        assert_eq!(t.kind, MsgKind::Credit);
        p.handle_control_done(MsgKind::Credit, Ok(()), t0);
    }
    assert_eq!(p.credits().ctrl_unconfirmed(), 3);
    p.handle_recv(Ok((0, Some(9 << 28))), Vec::new());
    assert!(p.poll_transmit(t0).is_none(), "no room for the report");
    assert!(p.error_report_pending() && !p.should_disconnect());
    assert_eq!(p.poll_timeout(), Some(t0 + Duration::from_secs(3)));
    p.handle_timeout(t0 + Duration::from_secs(2));
    assert!(!p.should_disconnect(), "still within the keepalive timeout");
    p.handle_timeout(t0 + Duration::from_secs(3));
    assert!(!p.error_report_pending() && p.should_disconnect());
    assert!(p.poll_transmit(t0 + Duration::from_secs(3)).is_none());
    assert_eq!(p.poll_timeout(), None);
    assert_eq!(
        p.failure(),
        Some(&QpFailure::Protocol(ProtocolError::BadHeader(9 << 28)))
    );

    // (b) The report went out but never completes (the peer has no receive for it and the
    // device retries for ever).
    let mut p = hostile(cfg);
    p.handle_recv(Ok((0, Some(9 << 28))), Vec::new());
    assert_eq!(p.poll_transmit(t0).map(|t| t.kind), Some(MsgKind::Error));
    assert!(!p.should_disconnect());
    assert_eq!(p.poll_timeout(), Some(t0 + Duration::from_secs(3)));
    p.handle_timeout(t0 + Duration::from_secs(3));
    assert!(p.should_disconnect());
    // Completed in time, the report needs no deadline.
    let mut p = hostile(cfg);
    p.handle_recv(Ok((0, Some(9 << 28))), Vec::new());
    assert!(p.poll_transmit(t0).is_some());
    p.handle_control_done(MsgKind::Error, Ok(()), t0);
    assert!(p.should_disconnect());
    assert_eq!(p.poll_timeout(), None);
}
