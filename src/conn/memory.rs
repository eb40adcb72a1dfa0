//! An endpoint's memory budget ([`EndpointOptions::memory_budget`](crate::EndpointOptions)):
//! the registered bytes of its message connections' own pools (private receive pool, send
//! staging pool), reserved at admission, before the pools are made, and given back when the
//! connection's state (and with it its pools) goes. Plain logic over one atomic, tested on the
//! host.
#![forbid(unsafe_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::Error;

/// The budget of one endpoint (shared by its clones).
#[derive(Debug)]
pub(crate) struct MemoryBudget {
    limit: Option<u64>,
    in_use: AtomicU64,
    refused: AtomicU64,
}

/// Bytes reserved in an endpoint's budget until dropped (a connection's pools, or the buffer
/// of a rendezvous message being read).
#[derive(Debug)]
pub(crate) struct Reservation {
    budget: Arc<MemoryBudget>,
    bytes: u64,
}

impl MemoryBudget {
    /// A budget of `limit` bytes (`None`: no limit, only accounting).
    pub(crate) fn new(limit: Option<u64>) -> Arc<MemoryBudget> {
        Arc::new(MemoryBudget {
            limit,
            in_use: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        })
    }

    /// Reserves `bytes` for a connection, or refuses it with
    /// [`Error::MemoryBudgetExhausted`] if the budget cannot take them.
    pub(crate) fn reserve(self: &Arc<Self>, bytes: u64) -> Result<Reservation, Error> {
        let limit = self.limit.unwrap_or(u64::MAX);
        let took = self
            .in_use
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|&total| total <= limit)
            });
        match took {
            Ok(_) => Ok(Reservation {
                budget: self.clone(),
                bytes,
            }),
            Err(in_use) => {
                self.refused.fetch_add(1, Ordering::Relaxed);
                Err(Error::MemoryBudgetExhausted {
                    budget: limit,
                    in_use,
                    needed: bytes,
                })
            }
        }
    }

    /// Bytes reserved now.
    pub(crate) fn in_use(&self) -> u64 {
        self.in_use.load(Ordering::Acquire)
    }

    /// Connections refused so far.
    pub(crate) fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

impl Reservation {
    /// The budget this reservation is in.
    pub(crate) fn budget(&self) -> &Arc<MemoryBudget> {
        &self.budget
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget.in_use.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_admits_what_fits_and_takes_back_what_is_dropped() {
        let b = MemoryBudget::new(Some(250));
        let one = b.reserve(100).expect("first");
        let two = b.reserve(100).expect("second");
        match b.reserve(100) {
            Err(Error::MemoryBudgetExhausted {
                budget: 250,
                in_use: 200,
                needed: 100,
            }) => {}
            other => panic!("the third: {other:?}"),
        }
        assert_eq!((b.in_use(), b.refused()), (200, 1));
        assert!(
            b.reserve(50).is_ok(),
            "what fits still fits (dropped at once)"
        );
        drop(one);
        let three = b.reserve(100).expect("room again");
        assert_eq!(b.in_use(), 200);
        drop((two, three));
        assert_eq!(b.in_use(), 0);
        let unlimited = MemoryBudget::new(None);
        let big = unlimited.reserve(u64::MAX / 2).expect("no limit");
        assert!(unlimited.reserve(u64::MAX).is_err(), "no overflow");
        drop(big);
    }

    #[test]
    fn concurrent_reservations_never_exceed_the_budget() {
        let b = MemoryBudget::new(Some(1000));
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let b = &b;
                s.spawn(move || {
                    let mut held = Vec::new();
                    for i in 0..2000u64 {
                        if (i + t) % 3 == 0 {
                            held.pop();
                        } else if let Ok(r) = b.reserve(10 + (i * 7 + t) % 90) {
                            held.push(r);
                        }
                        assert!(b.in_use() <= 1000);
                    }
                });
            }
        });
        assert_eq!(b.in_use(), 0);
    }
}
