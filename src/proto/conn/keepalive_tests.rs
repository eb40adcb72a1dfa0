//! Keepalive and dead-peer detection of the state machine: what counts as a sign of life,
//! the silence bound, live idle peers never declared dead.

use std::time::{Duration, Instant};

use super::tests::config;
use super::*;
use crate::error::QpFailure;

#[test]
fn an_unanswered_control_message_fails_the_connection_after_the_keepalive_timeout() {
    let cfg = ConnConfig {
        keepalive: Some(Duration::from_secs(1)),
        keepalive_timeout: Duration::from_secs(3),
        ..config(2, 64)
    };
    let t0 = Instant::now();
    let mut p: ConnProto<Vec<u8>> = ConnProto::new(cfg, t0);
    let n = p.recvs_to_post();
    p.recvs_posted(n);
    assert_eq!(p.poll_timeout(), Some(t0 + Duration::from_secs(1)));
    p.handle_timeout(t0 + Duration::from_secs(1));
    let t = p
        .poll_transmit(t0 + Duration::from_secs(1))
        .expect("keepalive");
    assert_eq!(t.kind, MsgKind::Credit);
    // The next keepalive would be due at 2 s; the one in flight must be answered by 4 s.
    assert_eq!(p.poll_timeout(), Some(t0 + Duration::from_secs(2)));
    p.handle_timeout(t0 + Duration::from_secs(3));
    assert!(
        p.poll_transmit(t0 + Duration::from_secs(3)).is_some(),
        "a second keepalive fits the control window"
    );
    assert!(p.failure().is_none());
    p.handle_timeout(t0 + Duration::from_secs(4));
    assert_eq!(
        p.failure(),
        Some(&QpFailure::KeepaliveTimeout(Duration::from_secs(3)))
    );
}

#[test]
fn a_stopped_peer_whose_nic_still_acks_is_found_within_keepalive_plus_timeout() {
    // The peer process is stopped (SIGSTOP): its kernel still acknowledges our sends, so every
    // keepalive completes successfully, but nothing comes from the peer. At 61ac8ac each
    // completion counted as a sign of life and the connection failed only once the control
    // window ran dry (39 s with the 10 s / 10 s defaults).
    for (k, kt) in [(10, 10), (1, 5), (5, 1), (1, 30)] {
        let (k, kt) = (Duration::from_secs(k), Duration::from_secs(kt));
        let cfg = ConnConfig {
            keepalive: Some(k),
            keepalive_timeout: kt,
            ..config(2, 64)
        };
        let t0 = Instant::now();
        let mut p: ConnProto<Vec<u8>> = ConnProto::new(cfg, t0);
        let n = p.recvs_to_post();
        p.recvs_posted(n);
        // The peer was last heard at t0. Drive the timers as the shell does, completing every
        // transmit successfully at once (acknowledged by the stopped peer's NIC).
        let bound = t0 + k + kt;
        let mut now = t0;
        while p.failure().is_none() {
            now = p.poll_timeout().expect("a timer while the peer is silent");
            assert!(
                now <= bound,
                "{k:?}/{kt:?}: next deadline {:?} past the bound",
                now - t0
            );
            p.handle_timeout(now);
            while let Some(t) = p.poll_transmit(now) {
                p.handle_control_done(t.kind, Ok(()), now);
            }
        }
        assert_eq!(p.failure(), Some(&QpFailure::KeepaliveTimeout(kt)));
        assert!(now <= bound, "{k:?}/{kt:?}: found after {:?}", now - t0);
    }
}

/// Moves every transmit of `x` to `y` (and back) at `now` until both are quiet, completing
/// each send at once, as an idle connection's shells would.
fn exchange(a: &mut ConnProto<Vec<u8>>, b: &mut ConnProto<Vec<u8>>, now: Instant) {
    fn one_way(x: &mut ConnProto<Vec<u8>>, y: &mut ConnProto<Vec<u8>>, now: Instant) -> bool {
        let mut moved = false;
        while let Some(t) = x.poll_transmit(now) {
            x.handle_control_done(t.kind, Ok(()), now);
            y.heard(now);
            y.handle_recv(Ok((0, Some(t.imm))), Vec::new());
            let n = y.recvs_to_post();
            y.recvs_posted(n);
            moved = true;
        }
        moved
    }
    while one_way(a, b, now) | one_way(b, a, now) {}
}

#[test]
fn live_idle_peers_are_never_declared_dead() {
    // Both ends idle for a minute of timers; the peer's keepalive is ours, or a longer one
    // within our keepalive + timeout (it confirms our control messages every two of them).
    for (ours, theirs) in [
        ((1, 1), (1, 1)),
        ((10, 10), (10, 10)),
        ((1, 5), (3, 5)),
        ((5, 1), (5, 1)),
    ] {
        let cfg = |(k, t): (u64, u64)| ConnConfig {
            keepalive: Some(Duration::from_secs(k)),
            keepalive_timeout: Duration::from_secs(t),
            ..config(2, 64)
        };
        let t0 = Instant::now();
        let mut a: ConnProto<Vec<u8>> = ConnProto::new(cfg(ours), t0);
        let mut b: ConnProto<Vec<u8>> = ConnProto::new(cfg(theirs), t0);
        for p in [&mut a, &mut b] {
            let n = p.recvs_to_post();
            p.recvs_posted(n);
        }
        let mut now = t0;
        while now < t0 + Duration::from_secs(120) {
            now = [a.poll_timeout(), b.poll_timeout()]
                .into_iter()
                .flatten()
                .min()
                .expect("keepalive timers");
            a.handle_timeout(now);
            b.handle_timeout(now);
            exchange(&mut a, &mut b, now);
            assert!(
                a.failure().is_none() && b.failure().is_none(),
                "{ours:?}/{theirs:?}: declared dead at {:?}: {:?} {:?}",
                now - t0,
                a.failure(),
                b.failure()
            );
        }
        // Then the peer stops (nothing from it any more; our sends still complete).
        let stopped = now;
        let (k, t) = ours;
        while a.failure().is_none() {
            now = a.poll_timeout().expect("a timer");
            a.handle_timeout(now);
            while let Some(x) = a.poll_transmit(now) {
                a.handle_control_done(x.kind, Ok(()), now);
            }
        }
        assert!(
            now - stopped <= Duration::from_secs(k + t),
            "found after {:?}",
            now - stopped
        );
    }
}

#[test]
fn a_slow_but_live_peer_is_not_declared_dead() {
    let cfg = ConnConfig {
        keepalive: Some(Duration::from_secs(1)),
        keepalive_timeout: Duration::from_secs(3),
        ..config(2, 64)
    };
    let t0 = Instant::now();
    let mut p: ConnProto<Vec<u8>> = ConnProto::new(cfg, t0);
    let n = p.recvs_to_post();
    p.recvs_posted(n);
    p.handle_timeout(t0 + Duration::from_secs(1));
    assert!(p.poll_transmit(t0 + Duration::from_secs(1)).is_some());
    // The keepalive's completion is stuck behind other traffic, but receives keep arriving.
    for s in 2..10 {
        let now = t0 + Duration::from_secs(s);
        p.heard(now);
        p.handle_timeout(now);
        assert!(p.failure().is_none(), "alive at {s} s: {:?}", p.failure());
    }
    // Then silence: dead 3 s after the last sign of life.
    p.handle_timeout(t0 + Duration::from_secs(11));
    assert!(p.failure().is_none());
    p.handle_timeout(t0 + Duration::from_secs(12));
    assert_eq!(
        p.failure(),
        Some(&QpFailure::KeepaliveTimeout(Duration::from_secs(3)))
    );
}

/// A timeout too long to add to an `Instant` (`Duration::MAX` for "never") means no deadline.
/// At 84e8c41 every deadline was `Instant + Duration` unchecked: `keepalive: Some(MAX)` panicked
/// in `ConnProto::new`, a `keepalive_timeout` or `close_timeout` of `MAX` in `poll_timeout`
/// (the connection's pump, under its lock).
#[test]
fn timeouts_too_long_for_an_instant_mean_never() {
    let (long, secs) = (Duration::MAX, Duration::from_secs);
    for (keepalive, keepalive_timeout, close_timeout) in [
        (Some(long), secs(3), secs(3)),
        (Some(secs(1)), long, secs(3)),
        (Some(secs(1)), secs(3), long),
        (None, long, long),
    ] {
        let cfg = ConnConfig {
            keepalive,
            keepalive_timeout,
            close_timeout,
            ..config(2, 64)
        };
        let t0 = Instant::now();
        let mut p: ConnProto<Vec<u8>> = ConnProto::new(cfg, t0);
        let n = p.recvs_to_post();
        p.recvs_posted(n);
        // Every kind of deadline armed: a message waiting for credits under a close, control
        // messages in flight, the keepalive.
        let mut cx = Context::from_waker(std::task::Waker::noop());
        for _ in 0..3 {
            let id = p.start_send(10).unwrap();
            let _ = p.poll_chunk(id, &mut cx);
        }
        p.close();
        for step in 1..=4 {
            let now = t0 + secs(step);
            let _ = p.poll_timeout();
            p.handle_timeout(now);
            while p.poll_transmit(now).is_some() {}
        }
        let _ = p.poll_timeout();
        // The finite timeouts still fire.
        let failed = p.failure().is_some();
        let finite = keepalive_timeout < long || close_timeout < long;
        assert_eq!(
            failed, finite,
            "{keepalive:?} {keepalive_timeout:?} {close_timeout:?}"
        );
    }
}
