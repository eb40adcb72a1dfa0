//! The claim accounting of a shared receive queue (the parent module's docs say what the
//! counters mean), as plain logic over atomics: no verbs, no I/O, tested on the host with
//! randomized interleavings against a model of the queue, and model-checked with `loom`
//! (`budget/loom_models.rs`, docs/testing.md#concurrency-models).
#![forbid(unsafe_code)]

use crate::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, Ordering};

/// The queue-wide counters, shared by every connection's [`Claim`].
#[derive(Debug)]
pub(crate) struct Budget {
    buffers: u32,
    slack: AtomicI64,
    spare: AtomicI64,
    granted: AtomicI64,
    connections: AtomicU32,
    refused: AtomicU64,
    orphans: AtomicU64,
    /// A connection was refused lately: claims stop earning growth (busy connections shrink
    /// back to their floors as their peers use their credits) until a quarter of the queue is
    /// unclaimed again.
    pressure: AtomicBool,
}

/// Why a connection was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Refused {
    pub(crate) spare: i64,
    pub(crate) connections: u32,
}

impl Budget {
    pub(crate) fn new(buffers: u32) -> Budget {
        Budget {
            buffers,
            slack: AtomicI64::new(0),
            spare: AtomicI64::new(i64::from(buffers)),
            granted: AtomicI64::new(0),
            connections: AtomicU32::new(0),
            refused: AtomicU64::new(0),
            orphans: AtomicU64::new(0),
            pressure: AtomicBool::new(false),
        }
    }

    /// `n` buffers were posted on the queue.
    pub(crate) fn posted(&self, n: u32) {
        self.slack.fetch_add(i64::from(n), Ordering::AcqRel);
    }

    /// A receive completed for no admitted connection (its claim was given back, or its
    /// queue pair is gone); its buffer goes back to the pool.
    pub(crate) fn consumed_unclaimed(&self) {
        self.slack.fetch_sub(1, Ordering::AcqRel);
        self.orphans.fetch_add(1, Ordering::Relaxed);
    }

    /// Admits a connection with a floor of `floor` receives and claims them at once (they
    /// are granted in the handshake), or refuses it.
    pub(crate) fn admit(&self, floor: u32) -> Result<Claim, Refused> {
        let need = i64::from(floor);
        let took = self
            .spare
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| {
                (s >= need).then_some(s - need)
            });
        let refuse = |spare| {
            self.refused.fetch_add(1, Ordering::Relaxed);
            self.pressure.store(true, Ordering::Relaxed);
            Refused {
                spare,
                connections: self.connections.load(Ordering::Relaxed),
            }
        };
        if let Err(spare) = took {
            return Err(refuse(spare));
        }
        self.connections.fetch_add(1, Ordering::Relaxed);
        let mut claim = Claim {
            floor,
            granted: 0,
            held: 0,
            prepaid: 0,
            open: false,
            allowance: 0,
            released: false,
        };
        // Buffers the applications hold may leave fewer posted than the floors reserve.
        claim.prepaid = claim.claim(self, floor);
        if claim.prepaid < floor {
            claim.release(self);
            return Err(refuse(self.spare.load(Ordering::Relaxed)));
        }
        Ok(claim)
    }

    /// Takes one from `spare` to grow a window, if more than an eighth of the queue stays
    /// unclaimed (room for the floors of connections still to come).
    fn take_spare_for_growth(&self) -> bool {
        let reserve = i64::from(self.buffers / 8);
        self.spare
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |x| {
                (x > reserve).then_some(x - 1)
            })
            .is_ok()
    }

    /// `n` buffers' worth of claims come back to `spare`.
    fn give_back(&self, n: u32) {
        let spare = self.spare.fetch_add(i64::from(n), Ordering::AcqRel) + i64::from(n);
        if spare >= i64::from(self.buffers / 4) {
            self.pressure.store(false, Ordering::Relaxed);
        }
    }

    pub(crate) fn spare(&self) -> i64 {
        self.spare.load(Ordering::Relaxed)
    }

    pub(crate) fn granted(&self) -> u64 {
        self.granted.load(Ordering::Relaxed).max(0) as u64
    }

    pub(crate) fn connections(&self) -> u32 {
        self.connections.load(Ordering::Relaxed)
    }

    pub(crate) fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    pub(crate) fn orphans(&self) -> u64 {
        self.orphans.load(Ordering::Relaxed)
    }
}

/// One connection's claim on the queue. Give it back with [`release`](Self::release).
#[derive(Debug)]
pub(crate) struct Claim {
    floor: u32,
    /// Receives granted to the peer and not consumed yet.
    granted: u32,
    /// Buffers of this connection's receives its application holds (as last seen).
    held: u32,
    /// Of `granted`, claimed at admission and not yet handed to the state machine.
    prepaid: u32,
    /// The connection is established: credits beyond the first may be claimed (granting
    /// them sends a credit message, which needs the queue pair ready to send).
    open: bool,
    /// Claims above the floor this connection has earned: each receive its peer used earns
    /// two (re-grant it, grow by one), none under pressure.
    allowance: u32,
    released: bool,
}

impl Claim {
    /// Claims up to `want` receives to grant; returns how many it got. Below the floor a
    /// claim needs only a posted receive no one has claimed (`slack`); above it, an earned
    /// allowance and room in `spare` too.
    fn claim(&mut self, b: &Budget, want: u32) -> u32 {
        let mut got = 0;
        while got < want {
            let took = b
                .slack
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |x| {
                    (x > 0).then_some(x - 1)
                });
            if took.is_err() {
                break;
            }
            let above = self.granted + self.held >= self.floor;
            if above && (self.allowance == 0 || !b.take_spare_for_growth()) {
                b.slack.fetch_add(1, Ordering::AcqRel);
                break;
            }
            if above {
                self.allowance -= 1;
            }
            self.granted += 1;
            got += 1;
        }
        b.granted.fetch_add(i64::from(got), Ordering::Relaxed);
        got
    }

    /// Receives to report posted when the state machine asks for `want`: those claimed at
    /// admission first, then (once open) new claims.
    pub(crate) fn post(&mut self, b: &Budget, want: u32) -> u32 {
        let pre = self.prepaid.min(want);
        self.prepaid -= pre;
        if !self.open {
            return pre;
        }
        pre + self.claim(b, want - pre)
    }

    /// The connection is established: claim more as the state machine asks.
    pub(crate) fn open(&mut self) {
        self.open = true;
    }

    pub(crate) fn is_open(&self) -> bool {
        self.open
    }

    /// Whether the footprint (granted plus held) is below the floor.
    pub(crate) fn below_floor(&self) -> bool {
        self.granted + self.held < self.floor
    }

    /// The application now holds `held` of this connection's buffers (it dropped the rest).
    pub(crate) fn set_held(&mut self, b: &Budget, held: u32) {
        if held >= self.held {
            return;
        }
        let before = (self.granted + self.held).max(self.floor);
        self.held = held;
        let after = (self.granted + self.held).max(self.floor);
        // The footprint above the floor shrank: that much is unclaimed again.
        if before > after {
            b.give_back(before - after);
        }
    }

    /// One of this connection's receives completed (it took a buffer off the queue).
    pub(crate) fn consumed(&mut self, b: &Budget) {
        if self.granted == 0 {
            // More completions than grants: only a peer that ignored credits gets here (the
            // state machine fails the connection for it).
            b.consumed_unclaimed();
            return;
        }
        // The footprint stays: the buffer moves from granted to held.
        self.granted -= 1;
        self.held += 1;
        if !b.pressure.load(Ordering::Relaxed) {
            self.allowance = self.allowance.saturating_add(2);
        }
        b.granted.fetch_sub(1, Ordering::Relaxed);
    }

    /// Gives the claim back (its queue pair consumes nothing any more). Idempotent.
    pub(crate) fn release(&mut self, b: &Budget) {
        if std::mem::replace(&mut self.released, true) {
            return;
        }
        b.slack.fetch_add(i64::from(self.granted), Ordering::AcqRel);
        b.give_back((self.granted + self.held).max(self.floor));
        b.granted
            .fetch_sub(i64::from(self.granted), Ordering::Relaxed);
        b.connections.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(all(test, tokio_rdma_loom))]
mod loom_models;
#[cfg(test)]
mod tests;
