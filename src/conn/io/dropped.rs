//! [`Dropped`]: the messages the application dropped, counted without the connection's lock
//! and reported to the state machine ([`ConnProto::consumed_many`]) at the next look at the
//! state, unless the state machine needs the report at once
//! ([`ConnProto::consumption_urgent`]: receives are withheld, or a rendezvous message waits
//! for room in the receive budget).
//!
//! Most dropped messages change nothing but the receive budget's counts, which only the next
//! receipt reads, and every receipt is a look at the state: a drop then costs two atomic adds,
//! a fence and a load instead of a lock, a look and the pump's checks.
//!
//! Never a lost report (a Dekker handshake): a drop adds its counts, then reads `urgent`; a
//! look that makes reports urgent sets `urgent`, then takes the counts again. A `SeqCst` fence
//! between each side's write and its read puts the two fences in one order: either the drop's
//! read comes after the look's write (the drop sees `urgent` and reports itself, under the
//! lock), or its adds come before the look's take (the look reports them). Fences rather
//! than `SeqCst` accesses alone, as in the pool's waiters, so that the `loom` model below
//! (docs/testing.md#concurrency-models) checks the code that runs.
//!
//! [`ConnProto::consumed_many`]: crate::proto::conn::ConnProto::consumed_many
//! [`ConnProto::consumption_urgent`]: crate::proto::conn::ConnProto::consumption_urgent

use crate::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering, fence};

/// See the module docs.
#[derive(Debug, Default)]
pub(crate) struct Dropped {
    /// Receive buffers of the messages dropped and not reported yet.
    bufs: AtomicU32,
    /// Their bytes.
    bytes: AtomicU64,
    /// The state machine wants reports at once. Written only under the connection's lock.
    urgent: AtomicBool,
}

impl Dropped {
    /// Counts a dropped message of `len` bytes (`buffer`: it held a receive buffer). Returns
    /// whether the caller must report now (look at the state, which takes the counts).
    pub(crate) fn record(&self, buffer: bool, len: usize) -> bool {
        self.bytes.fetch_add(len as u64, Ordering::Relaxed);
        if buffer {
            self.bufs.fetch_add(1, Ordering::Relaxed);
        }
        fence(Ordering::SeqCst);
        self.urgent.load(Ordering::Relaxed)
    }

    /// Takes the counts (receive buffers, bytes) not reported yet, if any. Under the lock.
    #[inline]
    pub(crate) fn take(&self) -> Option<(u32, u64)> {
        if self.bufs.load(Ordering::Relaxed) == 0 && self.bytes.load(Ordering::Relaxed) == 0 {
            return None;
        }
        Some((
            self.bufs.swap(0, Ordering::Relaxed),
            self.bytes.swap(0, Ordering::Relaxed),
        ))
    }

    /// Records whether reports are urgent now. Under the lock. Returns whether the caller must
    /// [`take`](Self::take) once more: reports just became urgent, and a drop that read the
    /// old value may have counted itself without reporting.
    #[inline]
    pub(crate) fn set_urgent(&self, urgent: bool) -> bool {
        if self.urgent.load(Ordering::Relaxed) == urgent {
            return false;
        }
        self.urgent.store(urgent, Ordering::Relaxed);
        if urgent {
            fence(Ordering::SeqCst);
        }
        urgent
    }
}

#[cfg(all(test, tokio_rdma_loom))]
mod loom_models {
    use loom::sync::Arc;

    use super::Dropped;
    use crate::sync::{Mutex, model};

    /// A drop racing the look that makes reports urgent: the count is reported exactly once,
    /// by the look or by the drop itself, whatever the interleaving.
    #[test]
    fn loom_models_a_drop_racing_urgency_is_reported() {
        model(3, || {
            let d = Arc::new(Dropped::default());
            let state = Arc::new(Mutex::new((0u32, 0u64)));
            let dropper = {
                let (d, state) = (d.clone(), state.clone());
                loom::thread::spawn(move || {
                    if d.record(true, 5) {
                        let mut s = state.lock().unwrap();
                        if let Some((b, n)) = d.take() {
                            s.0 += b;
                            s.1 += n;
                        }
                    }
                })
            };
            {
                let mut s = state.lock().unwrap();
                if let Some((b, n)) = d.take() {
                    s.0 += b;
                    s.1 += n;
                }
                if d.set_urgent(true) {
                    if let Some((b, n)) = d.take() {
                        s.0 += b;
                        s.1 += n;
                    }
                }
            }
            dropper.join().unwrap();
            assert_eq!(*state.lock().unwrap(), (1, 5), "the drop was not reported");
            assert_eq!(d.take(), None);
        });
    }
}

#[cfg(all(test, not(tokio_rdma_loom)))]
mod tests {
    use super::Dropped;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};

    #[test]
    fn counts_add_up_and_are_taken_once() {
        let d = Dropped::default();
        assert_eq!(d.take(), None);
        assert!(!d.record(true, 10));
        assert!(!d.record(false, 5));
        assert!(!d.record(true, 0));
        assert_eq!(d.take(), Some((2, 15)));
        assert_eq!(d.take(), None);
        assert!(d.set_urgent(true), "became urgent: take again");
        assert!(!d.set_urgent(true), "no change");
        assert!(d.record(true, 1), "urgent: the drop reports itself");
        assert!(!d.set_urgent(false));
        assert!(!d.record(true, 1));
        assert_eq!(d.take(), Some((2, 2)));
    }

    /// Threads drop messages while a "lock holder" turns urgency on and off, taking the counts
    /// as the shell does, and half-way through turns it on for good while they still drop.
    /// After that nobody looks again: every count must then have been taken, by that look or
    /// by the drop's own report (a lost report would be a peer waiting forever for credits).
    #[test]
    fn no_drop_goes_unreported_once_urgent() {
        const PER_THREAD: u64 = 20_000;
        for round in 0..20 {
            let d = Arc::new(Dropped::default());
            // What was reported, under the state's lock.
            let state = Arc::new(Mutex::new((0u32, 0u64)));
            let report = |d: &Dropped, s: &mut (u32, u64)| {
                if let Some((b, n)) = d.take() {
                    s.0 += b;
                    s.1 += n;
                }
            };
            let dropped = Arc::new(AtomicU64::new(0));
            let droppers: Vec<_> = (0..3u64)
                .map(|t| {
                    let (d, state, dropped) = (d.clone(), state.clone(), dropped.clone());
                    std::thread::spawn(move || {
                        for i in 0..PER_THREAD {
                            dropped.fetch_add(1, Ordering::Relaxed);
                            if d.record(true, 1 + ((i + t) % 3) as usize) {
                                let mut s = state.lock().unwrap();
                                report(&d, &mut s);
                            }
                        }
                    })
                })
                .collect();
            let mut flip = round % 2 == 0;
            while dropped.load(Ordering::Relaxed) < 3 * PER_THREAD / 2 {
                let mut s = state.lock().unwrap();
                report(&d, &mut s);
                if d.set_urgent(flip) {
                    report(&d, &mut s);
                }
                flip = !flip;
            }
            {
                let mut s = state.lock().unwrap();
                report(&d, &mut s);
                if d.set_urgent(true) {
                    report(&d, &mut s);
                }
            }
            for t in droppers {
                t.join().unwrap();
            }
            assert_eq!(d.take(), None, "round {round}: a count left unreported");
            let s = *state.lock().unwrap();
            assert_eq!(u64::from(s.0), 3 * PER_THREAD, "round {round}: buffers");
            let bytes: u64 = (0..3u64)
                .map(|t| (0..PER_THREAD).map(|i| 1 + (i + t) % 3).sum::<u64>())
                .sum();
            assert_eq!(s.1, bytes, "round {round}: bytes");
        }
    }
}
