//! Randomized interleavings of admissions, grants, receives, applications holding and dropping
//! buffers, refills and closes, against a model of the queue's buffers. Checked after every
//! step: every receive granted has a posted buffer (no receiver-not-ready); after every
//! quiet point: every connection gets back to its floor, `spare` is what the module docs say;
//! at the end: everything is given back.
use super::*;

use crate::proto::tests::storm_model::Rng;

const FLOOR: u32 = 5;

struct Conn {
    claim: Claim,
    /// Buffers its application holds.
    held: u32,
    /// What its state machine keeps posted at most (credits plus control receives).
    target: u32,
}

struct Model {
    rng: Rng,
    buffers: u32,
    budget: Budget,
    /// Buffers on the queue.
    posted: u32,
    /// Buffers back in the pool, not posted yet.
    free: u32,
    conns: Vec<Conn>,
    /// Buffers held by applications of closed connections.
    orphan_held: u32,
    refusals: u64,
}

impl Model {
    fn new(seed: u64, buffers: u32) -> Model {
        let budget = Budget::new(buffers);
        budget.posted(buffers);
        Model {
            rng: Rng::new(seed),
            buffers,
            budget,
            posted: buffers,
            free: 0,
            conns: Vec::new(),
            orphan_held: 0,
            refusals: 0,
        }
    }

    fn granted(&self) -> u32 {
        self.conns.iter().map(|c| c.claim.granted).sum()
    }

    fn check(&self) {
        let slack = self.budget.slack.load(Ordering::Relaxed);
        assert_eq!(
            slack,
            i64::from(self.posted) - i64::from(self.granted()),
            "slack is posted minus granted"
        );
        assert!(
            slack >= 0,
            "a granted receive without a posted buffer (RNR)"
        );
        let held: u32 = self.conns.iter().map(|c| c.held).sum();
        assert_eq!(
            self.posted + self.free + held + self.orphan_held,
            self.buffers,
            "every buffer somewhere"
        );
    }

    fn want(c: &Conn) -> u32 {
        // What the state machine believes posted excludes what admission claimed for it and
        // it has not been told yet.
        c.target
            .saturating_sub(c.claim.granted - c.claim.prepaid + c.claim.held)
    }

    fn step(&mut self) {
        match self.rng.below(10) {
            0 => {
                if self.conns.len() < 40 {
                    let target = FLOOR + self.rng.below(12) as u32;
                    match self.budget.admit(FLOOR) {
                        Ok(claim) => {
                            let mut c = Conn {
                                claim,
                                held: 0,
                                target,
                            };
                            // Setup reports the first receives, then the connection opens.
                            let want = Self::want(&c);
                            assert_eq!(c.claim.post(&self.budget, want), FLOOR.min(want));
                            c.claim.open();
                            self.conns.push(c);
                        }
                        Err(_) => self.refusals += 1,
                    }
                }
            }
            1 if !self.conns.is_empty() && self.rng.below(4) == 0 => {
                let i = self.rng.below(self.conns.len());
                let mut c = self.conns.swap_remove(i);
                c.claim.release(&self.budget);
                self.orphan_held += c.held;
                // The queue pair is gone: its grants are no one's; its peer sends nothing.
            }
            2..=4 => {
                // A peer sends: consumes one of its grants, a posted buffer.
                if self.conns.is_empty() {
                    return;
                }
                let i = self.rng.below(self.conns.len());
                if self.conns[i].claim.granted == 0 {
                    return;
                }
                assert!(self.posted > 0, "receiver not ready");
                self.posted -= 1;
                let c = &mut self.conns[i];
                c.claim.consumed(&self.budget);
                // A control message or a copied chunk is released at once.
                if self.rng.below(3) == 0 {
                    self.free += 1;
                } else {
                    c.held += 1;
                }
                c.claim.set_held(&self.budget, c.held);
            }
            5 => {
                // An application drops a message.
                if self.orphan_held > 0 && self.rng.below(3) == 0 {
                    self.orphan_held -= 1;
                    self.free += 1;
                    return;
                }
                if self.conns.is_empty() {
                    return;
                }
                let i = self.rng.below(self.conns.len());
                let c = &mut self.conns[i];
                if c.held > 0 {
                    c.held -= 1;
                    self.free += 1;
                    c.claim.set_held(&self.budget, c.held);
                }
            }
            6 => self.refill(),
            _ => {
                // A connection's state machine asks for its receives.
                if self.conns.is_empty() {
                    return;
                }
                let i = self.rng.below(self.conns.len());
                let c = &mut self.conns[i];
                let want = Self::want(c);
                c.claim.post(&self.budget, want);
            }
        }
    }

    fn refill(&mut self) {
        self.budget.posted(self.free);
        self.posted += self.free;
        self.free = 0;
    }

    /// Applications drop everything, the queue is refilled: every connection gets back to
    /// at least its floor, and `spare` is buffers - Σ max(footprint, floor).
    fn quiesce(&mut self) {
        for c in &mut self.conns {
            self.free += c.held;
            c.held = 0;
            c.claim.set_held(&self.budget, 0);
        }
        self.free += self.orphan_held;
        self.orphan_held = 0;
        self.refill();
        for c in &mut self.conns {
            let want = Self::want(c);
            c.claim.post(&self.budget, want);
            assert!(
                !c.claim.below_floor(),
                "a connection cannot get back to its floor: {:?}",
                c.claim
            );
        }
        let reserved: i64 = self
            .conns
            .iter()
            .map(|c| i64::from((c.claim.granted + c.claim.held).max(FLOOR)))
            .sum();
        assert_eq!(self.budget.spare(), i64::from(self.buffers) - reserved);
        self.check();
    }
}

#[test]
fn claims_never_outrun_the_posted_buffers_and_floors_always_come_back() {
    let (mut admitted_max, mut refusals) = (0usize, 0u64);
    for seed in 0..300u64 {
        let buffers = 12 + (seed % 7) as u32 * 9;
        let mut m = Model::new(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5eed, buffers);
        for round in 0..2000 {
            m.step();
            m.check();
            if round % 250 == 249 {
                m.quiesce();
            }
            admitted_max = admitted_max.max(m.conns.len());
        }
        m.quiesce();
        refusals += m.refusals;
        for mut c in m.conns.drain(..) {
            c.claim.release(&m.budget);
        }
        assert_eq!(m.budget.spare(), i64::from(buffers), "every claim back");
        assert_eq!(m.budget.connections(), 0);
        assert_eq!(m.budget.granted(), 0);
    }
    assert!(
        refusals > 100 && admitted_max > 5,
        "{refusals} {admitted_max}"
    );
}

#[test]
fn growth_is_earned_by_traffic_and_stops_under_pressure() {
    let b = Budget::new(64);
    b.posted(64);
    let mut c = b.admit(FLOOR).expect("admitted");
    c.open();
    assert_eq!(c.post(&b, 20), FLOOR, "idle: the floor only");
    // Two receives used and dropped: re-granted (below the floor, free) and four claims
    // earned above it.
    for _ in 0..2 {
        c.consumed(&b);
    }
    c.set_held(&b, 0);
    assert_eq!(c.post(&b, 20), 6);
    assert_eq!(
        b.spare(),
        64 - 9,
        "the four above the floor came from spare"
    );
    // Refusals put the queue under pressure: nothing more is earned.
    let mut others = Vec::new();
    while let Ok(o) = b.admit(FLOOR) {
        others.push(o);
    }
    assert!(b.pressure.load(Ordering::Relaxed));
    c.consumed(&b);
    c.set_held(&b, 0);
    assert_eq!(c.post(&b, 20), 0, "above the floor, nothing earned");
    // The refused connection's floor is back once others close.
    for mut o in others.drain(..) {
        o.release(&b);
    }
    assert!(!b.pressure.load(Ordering::Relaxed));
    c.release(&b);
    assert_eq!(b.spare(), 64);
}
