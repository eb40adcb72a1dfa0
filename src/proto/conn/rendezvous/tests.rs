//! Rendezvous against a lying peer, and the sender's side of the exchange.

use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use super::super::tests::{config, hostile, imm};
use super::*;
use crate::error::{ProtocolError, QpFailure};
use crate::proto::conn::ConnConfig;
use crate::proto::msg::MsgHeader;

fn cx() -> Context<'static> {
    Context::from_waker(futures::task::noop_waker_ref())
}

/// Feeds `payload` as a rendezvous message (a 64-byte receive buffer).
fn descriptor(p: &mut ConnProto<Vec<u8>>, payload: &[u8]) {
    let mut buf = vec![0u8; 64];
    buf[..payload.len()].copy_from_slice(payload);
    p.handle_recv(Ok((payload.len() as u32, imm(MsgKind::Rendezvous, 0))), buf);
}

fn failure(p: &ConnProto<Vec<u8>>) -> Option<ProtocolError> {
    match p.failure() {
        Some(QpFailure::Protocol(e)) => Some(*e),
        None => None,
        other => panic!("unexpected failure {other:?}"),
    }
}

#[test]
fn malformed_descriptors_are_violations() {
    let good = RemoteMsg::encode(0x1000, 100, 7);
    let mut reserved = good;
    reserved[23] = 1;
    let zero = RemoteMsg::encode(0x1000, 0, 7);
    let huge = RemoteMsg::encode(0x1000, 64 * 6 + 1, 7);
    let cases: [(&str, &[u8], ProtocolError); 4] = [
        ("short", &good[..20], ProtocolError::BadDescriptor),
        ("reserved bits", &reserved, ProtocolError::BadDescriptor),
        ("empty message", &zero, ProtocolError::BadDescriptor),
        (
            "over the maximum",
            &huge,
            ProtocolError::MessageTooLarge(384),
        ),
    ];
    for (what, payload, want) in cases {
        let mut p = hostile(config(2, 64));
        descriptor(&mut p, payload);
        assert_eq!(failure(&p), Some(want), "{what}");
    }
    // Not negotiated.
    let mut p = hostile(ConnConfig {
        rendezvous: false,
        ..config(2, 64)
    });
    descriptor(&mut p, &good);
    assert_eq!(failure(&p), Some(ProtocolError::RendezvousNotOffered));
    // In the middle of a chunked message.
    let mut p = hostile(config(2, 64));
    p.handle_recv(Ok((64, imm(MsgKind::More, 0))), vec![0u8; 64]);
    descriptor(&mut p, &good);
    assert_eq!(failure(&p), Some(ProtocolError::RendezvousMidMessage));
}

#[test]
fn a_peer_past_the_window_is_a_violation_and_reads_free_the_window() {
    let mut p = hostile(config(16, 64));
    let mut cx = cx();
    for i in 0..RDV_WINDOW {
        descriptor(&mut p, &RemoteMsg::encode(u64::from(i) << 12, 10, i));
        // The receive goes straight back: a descriptor holds no buffer.
        let n = p.recvs_to_post();
        p.recvs_posted(n);
    }
    assert_eq!(failure(&p), None);
    // Read the first: it is the oldest, and its acknowledgement goes out.
    let Poll::Ready(Ok(Some(Delivery::Remote(m)))) = p.poll_recv(&mut cx) else {
        panic!("the first descriptor");
    };
    assert_eq!((m.addr, m.len, m.rkey, m.seq), (0, 10, 0, 0));
    assert!(p.poll_recv(&mut cx).is_pending(), "nothing while reading");
    assert!(p.peek_recv().is_none());
    p.fetch_done(Ok(()));
    let t = p.poll_transmit(Instant::now()).expect("Fetched");
    assert_eq!(t.kind, MsgKind::Fetched);
    assert_eq!(MsgHeader::decode(t.imm).unwrap().credits, 0);
    p.fetch_taken();
    assert_eq!(p.held().0, 10);
    p.consumed(false, 10);
    // One slot free again: one more is fine, two more are not.
    descriptor(&mut p, &RemoteMsg::encode(0x9000, 10, 8));
    assert_eq!(failure(&p), None);
    descriptor(&mut p, &RemoteMsg::encode(0xa000, 10, 9));
    assert_eq!(failure(&p), Some(ProtocolError::RendezvousOverrun));
}

#[test]
fn acknowledgements_must_name_the_oldest_read() {
    let mut p = hostile(config(4, 64));
    // Nothing in flight.
    p.handle_recv(Ok((0, imm(MsgKind::Fetched, 0))), Vec::new());
    assert_eq!(failure(&p), Some(ProtocolError::StrayFetched));

    let mut p = hostile(config(4, 64));
    let mut cx = cx();
    let a = p.start_send_rendezvous(300).unwrap();
    let b = p.start_send_rendezvous(200).unwrap();
    for (id, seq) in [(a, 0), (b, 1)] {
        let Poll::Ready(Ok(c)) = p.poll_chunk(id, &mut cx) else {
            panic!("descriptor");
        };
        assert_eq!(
            (c.len, c.last, c.rendezvous),
            (DESCRIPTOR_LEN, true, Some(seq))
        );
    }
    assert!(p.poll_fetched(a, &mut cx).is_pending());
    // Out of order: the peer reads in message order.
    p.handle_recv(Ok((0, imm(MsgKind::Fetched, 1))), Vec::new());
    assert_eq!(failure(&p), Some(ProtocolError::StrayFetched));
}

#[test]
fn the_sender_releases_only_after_the_read_even_when_cancelled() {
    let mut p = hostile(config(4, 64));
    let mut cx = cx();
    let a = p.start_send_rendezvous(300).unwrap();
    let Poll::Ready(Ok(_)) = p.poll_chunk(a, &mut cx) else {
        panic!("descriptor");
    };
    p.close();
    p.cancel_send(a);
    assert_eq!(p.take_released().count(), 0, "still readable by the peer");
    assert!(
        p.poll_transmit(Instant::now()).is_none(),
        "end of stream waits for the read"
    );
    p.handle_recv(Ok((0, imm(MsgKind::Fetched, 0))), Vec::new());
    assert_eq!(failure(&p), None);
    assert_eq!(p.take_released().collect::<Vec<_>>(), vec![0]);
    assert_eq!(p.counters().rendezvous_sent, 1);
    let t = p.poll_transmit(Instant::now()).expect("end of stream");
    assert_eq!(t.kind, MsgKind::Close);
    // Rendezvous needs negotiation and a non-empty message.
    let mut q = hostile(ConnConfig {
        rendezvous: false,
        ..config(2, 64)
    });
    assert!(q.start_send_rendezvous(10).is_err());
    assert!(p.start_send_rendezvous(0).is_err());
}

#[test]
fn the_window_holds_the_ninth_send_back() {
    let mut p = hostile(config(16, 64));
    let mut cx = cx();
    let ids: Vec<u64> = (0..=RDV_WINDOW)
        .map(|_| p.start_send_rendezvous(100).unwrap())
        .collect();
    for &id in &ids[..RDV_WINDOW as usize] {
        assert!(p.poll_chunk(id, &mut cx).is_ready());
    }
    let last = ids[RDV_WINDOW as usize];
    assert!(p.poll_chunk(last, &mut cx).is_pending(), "window full");
    p.handle_recv(Ok((0, imm(MsgKind::Fetched, 0))), Vec::new());
    assert!(p.poll_fetched(ids[0], &mut cx).is_ready());
    assert!(p.poll_chunk(last, &mut cx).is_ready(), "room again");
}

/// A sender with `n` rendezvous descriptors out, closed at `t0` (by the application or by
/// dropping the connection: `close_full`).
fn closed_with_offers(n: u32, t0: Instant) -> (ConnProto<Vec<u8>>, Vec<u64>) {
    let cfg = ConnConfig {
        keepalive: None,
        close_timeout: Duration::from_secs(5),
        ..config(16, 64)
    };
    let mut p = ConnProto::new(cfg, t0);
    let k = p.recvs_to_post();
    p.recvs_posted(k);
    let mut cx = cx();
    let ids: Vec<u64> = (0..n)
        .map(|_| {
            let id = p.start_send_rendezvous(300).unwrap();
            assert!(p.poll_chunk(id, &mut cx).is_ready());
            id
        })
        .collect();
    p.close_full();
    // What the shell does right after any call: pump (end of stream cannot go yet).
    assert!(
        p.poll_transmit(t0).is_none(),
        "end of stream waits for the reads"
    );
    (p, ids)
}

#[test]
fn a_peer_that_never_acknowledges_a_read_cannot_hold_the_close_for_ever() {
    let t0 = Instant::now();
    let (mut p, ids) = closed_with_offers(1, t0);
    let mut cx = cx();
    let limit = Duration::from_secs(5);
    assert_eq!(
        p.poll_timeout(),
        Some(t0 + limit),
        "the close has a deadline"
    );
    p.handle_timeout(t0 + limit - Duration::from_millis(1));
    assert!(p.failure().is_none() && !p.should_disconnect());
    assert!(p.poll_fetched(ids[0], &mut cx).is_pending());
    p.handle_timeout(t0 + limit);
    assert_eq!(p.failure(), Some(&QpFailure::CloseTimeout(limit)));
    assert!(
        p.should_disconnect(),
        "torn down: the shell releases the memory"
    );
    assert!(matches!(
        p.poll_fetched(ids[0], &mut cx),
        Poll::Ready(Err(_))
    ));
    assert!(matches!(p.poll_close(&mut cx), Poll::Ready(Err(_))));
    assert_eq!(p.poll_timeout(), None);
}

#[test]
fn a_peer_that_never_returns_credits_cannot_hold_the_close_for_ever() {
    let t0 = Instant::now();
    let cfg = ConnConfig {
        keepalive: None,
        close_timeout: Duration::from_secs(5),
        ..config(2, 64)
    };
    let mut p: ConnProto<Vec<u8>> = ConnProto::new(cfg, t0);
    let k = p.recvs_to_post();
    p.recvs_posted(k);
    let mut cx = cx();
    // Three chunks, two credits: the third waits for a credit that never comes.
    let id = p.start_send(3 * 64).unwrap();
    assert!(p.poll_chunk(id, &mut cx).is_ready());
    assert!(p.poll_chunk(id, &mut cx).is_ready());
    assert!(p.poll_chunk(id, &mut cx).is_pending());
    p.close();
    assert!(p.poll_transmit(t0).is_none());
    assert_eq!(p.poll_timeout(), Some(t0 + Duration::from_secs(5)));
    p.handle_timeout(t0 + Duration::from_secs(5));
    assert_eq!(
        p.failure(),
        Some(&QpFailure::CloseTimeout(Duration::from_secs(5)))
    );
    assert!(matches!(p.poll_chunk(id, &mut cx), Poll::Ready(Err(_))));
}

#[test]
fn random_acknowledgement_times_end_the_close_cleanly_or_at_the_deadline() {
    let limit = Duration::from_secs(5);
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    for seed in 0..500 {
        let t0 = Instant::now();
        let n = 1 + next(u64::from(RDV_WINDOW)) as u32;
        let (mut p, ids) = closed_with_offers(n, t0);
        // The peer acknowledges a random number of the reads, in order, at random times
        // (some after the deadline); the shell's timer fires at random times too.
        let acks = next(u64::from(n) + 1) as u32;
        let mut ack_at: Vec<Duration> = (0..acks)
            .map(|_| Duration::from_millis(next(8000)))
            .collect();
        ack_at.sort();
        let mut acked = 0u32;
        let mut now = t0;
        let mut closed_cleanly = false;
        while now < t0 + Duration::from_secs(10) {
            now += Duration::from_millis(1 + next(700));
            while (acked as usize) < ack_at.len() && t0 + ack_at[acked as usize] <= now {
                if p.failure().is_none() {
                    p.handle_recv(Ok((0, imm(MsgKind::Fetched, acked as u16))), Vec::new());
                }
                acked += 1;
            }
            if let Some(at) = p.poll_timeout() {
                assert!(
                    at <= t0 + limit,
                    "seed {seed}: deadline {at:?} past the limit"
                );
            }
            p.handle_timeout(now);
            if let Some(t) = p.poll_transmit(now) {
                assert_eq!(t.kind, MsgKind::Close, "seed {seed}");
                assert!(
                    now <= t0 + limit + Duration::from_millis(700),
                    "seed {seed}"
                );
                p.handle_control_done(MsgKind::Close, Ok(()), now);
                closed_cleanly = true;
            }
            if p.failure().is_some() || closed_cleanly {
                break;
            }
        }
        let all_read_in_time = acks == n && t0 + ack_at[n as usize - 1] < t0 + limit;
        match p.failure() {
            None => {
                assert!(closed_cleanly, "seed {seed}: neither closed nor failed");
                assert!(acks == n, "seed {seed}: closed with unread messages");
                assert!(matches!(p.poll_close(&mut cx()), Poll::Ready(Ok(()))));
                // A full close then waits for the peer's end of stream, at most the keepalive
                // timeout (close.rs), before it disconnects.
                assert!(!p.should_disconnect(), "seed {seed}");
                let _ = p.poll_transmit(now);
                let at = p.poll_timeout().expect("the wait has a deadline");
                assert_eq!(at, now + p.cfg.keepalive_timeout, "seed {seed}");
                p.handle_timeout(at);
                assert!(p.should_disconnect(), "seed {seed}");
            }
            Some(f) => {
                assert_eq!(f, &QpFailure::CloseTimeout(limit), "seed {seed}");
                assert!(
                    !all_read_in_time,
                    "seed {seed}: failed although every read was acknowledged in time"
                );
                assert!(
                    now >= t0 + limit,
                    "seed {seed}: failed early at {:?}",
                    now - t0
                );
                assert!(p.should_disconnect());
                // Every send still waiting resolves with the failure.
                let mut cx = cx();
                for &id in &ids[acked as usize..] {
                    assert!(matches!(p.poll_fetched(id, &mut cx), Poll::Ready(Err(_))));
                }
            }
        }
    }
}

/// A receiver peeks at a rendezvous message, registers its destination without the lock, then
/// takes it (`take_remote`). Meanwhile others may take it and 65,535 more: the next one then
/// carries the same 16-bit number at another address, and must not be taken for the stale one
/// (the shell compared the numbers alone until 6f70b85).
#[test]
fn a_stale_descriptor_whose_number_came_round_is_not_taken() {
    let mut p = hostile(config(16, 64));
    let mut cx = cx();
    let now = Instant::now();
    let remote = |p: &ConnProto<Vec<u8>>| match p.peek_recv() {
        Some(Delivery::Remote(m)) => *m,
        other => panic!("a rendezvous message next, not {other:?}"),
    };
    descriptor(&mut p, &RemoteMsg::encode(0x1000, 10, 1));
    let stale = remote(&p);
    // The peer re-posts a receive for each control message of ours it got (the
    // acknowledgements and credit returns) and says so on its next descriptor, as a live
    // peer does (a count mod 256).
    let mut ctrl = 0u8;
    for i in 0..=u64::from(u16::MAX) {
        if i > 0 {
            let d = RemoteMsg::encode(0x1000 + (i << 12), 10, 1);
            let mut buf = vec![0u8; 64];
            buf[..d.len()].copy_from_slice(&d);
            let imm = MsgHeader {
                kind: MsgKind::Rendezvous,
                ctrl_ack: ctrl,
                credits: 0,
            }
            .encode();
            p.handle_recv(Ok((d.len() as u32, Some(imm))), buf);
        }
        let n = p.recvs_to_post();
        p.recvs_posted(n);
        let Poll::Ready(Ok(Some(Delivery::Remote(_)))) = p.poll_recv(&mut cx) else {
            panic!(
                "message {i}: {:?} failure {:?}",
                p.poll_recv(&mut cx).map(|r| r.map(|d| d.map(|d| d.len()))),
                p.failure()
            );
        };
        p.fetch_done(Ok(()));
        while let Some(t) = p.poll_transmit(now) {
            p.handle_control_done(t.kind, Ok(()), now);
            ctrl = ctrl.wrapping_add(1);
        }
        p.fetch_taken();
        p.consumed(false, 10);
    }
    assert_eq!(failure(&p), None);
    descriptor(&mut p, &RemoteMsg::encode(0x9000_0000, 10, 2));
    let next = remote(&p);
    assert_eq!(next.seq, stale.seq, "the number came round");
    assert!(!p.take_remote(&stale), "taken for a stale descriptor");
    assert_eq!(remote(&p), next, "still queued");
    assert!(p.take_remote(&next));
    assert_eq!(p.fetch_ready(), Some(false), "now being read");
}
