//! `loom` models of the claim budget: connections admitted, granting, consuming, growing,
//! dropping their buffers and closing concurrently, under every interleaving `loom` explores.
//! Run with `--cfg tokio_rdma_loom` (docs/testing.md#concurrency-models).
use std::sync::Arc;

use loom::sync::atomic::AtomicU32;

use crate::sync::model;

use super::*;

const BUFFERS: u32 = 4;
const FLOOR: u32 = 2;

/// What every step must keep: no receive granted without a posted buffer (`slack` is posted
/// minus granted), and the claims above the floors never take more than there is (`spare`).
fn check(b: &Budget) {
    let slack = b.slack.load(Ordering::Relaxed);
    assert!(
        slack >= 0,
        "granted more receives than are posted: slack {slack}"
    );
    let spare = b.spare.load(Ordering::Relaxed);
    assert!(spare >= 0, "claimed more than the queue has: spare {spare}");
}

/// One connection's life: admitted (its floor claimed at once), open, its peer uses a credit
/// (the buffer leaves the queue and its application holds it), the state machine re-grants
/// and asks for one more, the application drops the buffer (back on the queue), close.
fn connection(b: &Budget, inside: &AtomicU32) {
    let Ok(mut claim) = b.admit(FLOOR) else {
        check(b);
        return;
    };
    let now = inside.fetch_add(1, Ordering::Relaxed) + 1;
    assert!(
        now * FLOOR <= BUFFERS,
        "{now} floors of {FLOOR} admitted on {BUFFERS} buffers"
    );
    check(b);
    claim.open();
    claim.consumed(b);
    claim.set_held(b, 1);
    check(b);
    claim.post(b, 2);
    check(b);
    claim.set_held(b, 0);
    b.posted(1);
    check(b);
    inside.fetch_sub(1, Ordering::Relaxed);
    claim.release(b);
    check(b);
}

/// Two connections whose floors do not both fit the posted buffers (three posted, floors of
/// two): concurrent admissions never grant more than is posted nor claim more than the queue
/// has, the floors and the growth come back, and at the end everything is given back.
#[test]
fn loom_models_concurrent_claims_stay_within_the_queue() {
    model(2, || {
        let b = Arc::new(Budget::new(BUFFERS));
        b.posted(BUFFERS - 1);
        let inside = Arc::new(AtomicU32::new(0));
        let other = {
            let (b, inside) = (b.clone(), inside.clone());
            loom::thread::spawn(move || connection(&b, &inside))
        };
        connection(&b, &inside);
        other.join().unwrap();
        assert_eq!(
            b.spare(),
            i64::from(BUFFERS),
            "every floor and growth given back"
        );
        assert_eq!(
            b.slack.load(Ordering::Relaxed),
            i64::from(BUFFERS - 1),
            "no grant left"
        );
        assert_eq!(b.granted(), 0);
        assert_eq!(b.connections(), 0);
    });
}
