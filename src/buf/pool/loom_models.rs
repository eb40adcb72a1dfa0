//! `loom` models of the pool's slot protocol: the free list (`freelist.rs`) and the waiters
//! (`waiters.rs`) through [`WaitQueue::acquire`] and [`WaitQueue::release`], the functions
//! `Pool::release` and `Acquire` call. Run with `--cfg tokio_rdma_loom` (docs/testing.md#concurrency-models).
//!
//! Slot ownership is checked two ways: each slot has an owner flag that an acquire sets and
//! must find clear (one slot, two owners), and a `loom` cell that each owner writes, which
//! `loom` reports as a data race unless every hand-over of the slot (free-list push to pop,
//! hand-off to a waiter) orders the previous owner's writes before the next owner's. The
//! flags are `Relaxed`, so they add no ordering of their own that could hide a missing one.

use std::sync::Arc;
use std::task::{Wake, Waker};

use loom::cell::UnsafeCell;
use loom::sync::Notify;
use loom::sync::atomic::{AtomicBool, Ordering::Relaxed};

use crate::sync::model;

use super::freelist::FreeList;
use super::waiters::{Registered, WaitQueue};

/// One size class with `count` slots (on two shards) and what the model tracks of them.
struct Class {
    free: FreeList,
    waiters: WaitQueue,
    owned: Vec<AtomicBool>,
    data: SlotMemory,
}

/// Each slot's memory, as the pool's registered buffers are: shared by every thread, written
/// by the slot's current owner only.
struct SlotMemory(Vec<UnsafeCell<u64>>);

// SAFETY: a slot's cell is accessed only by the thread that owns the slot (`Class::own`), and
// whether ownership is exclusive and ordered is what the models check (loom's cell reports
// any two accesses not ordered by happens-before).
unsafe impl Sync for SlotMemory {}

impl Class {
    fn new(count: u32) -> Class {
        Class {
            free: FreeList::new_full(count, 2),
            waiters: WaitQueue::default(),
            owned: (0..count).map(|_| AtomicBool::new(false)).collect(),
            data: SlotMemory((0..count).map(|_| UnsafeCell::new(0)).collect()),
        }
    }

    /// Takes ownership of `slot`: nobody else owns it; the previous owner's writes are
    /// ordered before ours (loom checks the access).
    fn own(&self, slot: u32) {
        let s = slot as usize;
        assert!(
            !self.owned[s].swap(true, Relaxed),
            "slot {slot} has two owners"
        );
        // SAFETY: the pool's protocol makes this thread the slot's only owner (the flag above
        // checks it); loom reports the access if the hand-over did not order it after the
        // previous owner's.
        self.data.0[s].with_mut(|p| unsafe { *p += 1 });
    }

    fn disown(&self, slot: u32) {
        self.owned[slot as usize].store(false, Relaxed);
    }

    /// Acquires a slot, blocking (on the model's waker) until one is handed over.
    fn acquire(&self, home: usize) -> u32 {
        let wake = Arc::new(Wakeup(Notify::new()));
        let waker = Waker::from(wake.clone());
        let slot = match self.waiters.acquire(&self.free, home, &waker) {
            Registered::Slot(slot) => slot,
            Registered::Queued(id) => loop {
                // A lost wake-up blocks here for good: loom reports the deadlock.
                wake.0.wait();
                if let Some(slot) = self.waiters.poll(id, &waker) {
                    break slot;
                }
            },
        };
        self.own(slot);
        slot
    }

    fn release(&self, home: usize, slot: u32) {
        self.disown(slot);
        self.waiters.release(&self.free, home, slot);
    }

    /// Every slot is free again, exactly once, and nobody waits.
    fn check_quiescent(&self, count: u32) {
        assert_eq!(self.waiters.len(), 0, "a waiter was left behind");
        assert_eq!(self.free.len(), count as usize, "the free count");
        let mut seen = vec![false; count as usize];
        while let Some(s) = self.free.pop(0) {
            assert!(
                !std::mem::replace(&mut seen[s as usize], true),
                "slot {s} twice"
            );
        }
        assert!(seen.iter().all(|&s| s), "a slot was lost");
    }
}

/// A waker over a loom `Notify` (a permit: a wake before the wait is not lost).
struct Wakeup(Notify);

impl Wake for Wakeup {
    fn wake(self: Arc<Self>) {
        self.0.notify();
    }
}

/// A waiter that registers while the only slot is released is always given it: the release
/// either sees the waiter (hand-off), or pushes the slot where the waiter's re-check finds it,
/// or its `rescue` sees the waiter count. No lost wake-up, no slot left on the free list
/// while a task waits.
#[test]
fn loom_models_waiter_racing_a_release_is_woken() {
    model(3, || {
        let class = Arc::new(Class::new(1));
        let held = class.acquire(0);
        let c = class.clone();
        let waiter = loom::thread::spawn(move || {
            let slot = c.acquire(1);
            c.release(1, slot);
        });
        class.release(0, held);
        waiter.join().unwrap();
        class.check_quiescent(1);
    });
}

/// Two threads acquire and release concurrently over two shards with fewer slots than
/// threads: no slot ever has two owners (flag and loom cell), none is lost or duplicated on
/// the free lists, and every waiter gets a slot.
#[test]
fn loom_models_acquire_release_never_shares_or_loses_a_slot() {
    model(3, || {
        let class = Arc::new(Class::new(1));
        let threads: Vec<_> = (0..2)
            .map(|home| {
                let c = class.clone();
                loom::thread::spawn(move || {
                    let slot = c.acquire(home);
                    c.release(home, slot);
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        class.check_quiescent(1);
    });
}

/// The lock-free free list alone (two slots, two shards): both threads pop from shard 0
/// (contending on one stack, stealing from shard 1 when it is empty) and push to their own
/// shard, so slots move between stacks; each slot goes to one popper at a time, ordered
/// after its previous owner.
#[test]
fn loom_models_free_list_pop_push() {
    model(3, || {
        let class = Arc::new(Class::new(2));
        let threads: Vec<_> = (0..2)
            .map(|home| {
                let c = class.clone();
                loom::thread::spawn(move || {
                    for _ in 0..2 {
                        if let Some(slot) = c.free.pop(0) {
                            c.own(slot);
                            c.disown(slot);
                            c.free.push(home, slot);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        class.check_quiescent(2);
    });
}

/// A waiter gives up (its `Acquire` is dropped) while the only slot is released to it: the
/// slot it was handed, if any, is released again, so it is back on the free list at the end,
/// never stranded in the waiter table.
#[test]
fn loom_models_cancelled_waiter_strands_no_slot() {
    model(3, || {
        let class = Arc::new(Class::new(1));
        let held = class.acquire(0);
        let waker = Waker::from(Arc::new(Wakeup(Notify::new())));
        let Registered::Queued(id) = class.waiters.acquire(&class.free, 1, &waker) else {
            panic!("the only slot is held");
        };
        let c = class.clone();
        let canceller = loom::thread::spawn(move || {
            // What `Acquire`'s drop does.
            if let Some(slot) = c.waiters.cancel(id) {
                c.waiters.release(&c.free, 1, slot);
            }
        });
        class.release(0, held);
        canceller.join().unwrap();
        class.check_quiescent(1);
    });
}
