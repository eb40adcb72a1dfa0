//! FIFO queue of tasks waiting for a slot of one size class, with direct hand-off.
//!
//! A release first offers its slot to the oldest waiter ([`WaitQueue::hand_off`]); only when
//! nobody waits does the slot go back to the free list. A waiter registers under the queue lock
//! and then re-checks the free list ([`WaitQueue::register`]); a release that pushed to the free
//! list re-checks the waiter count afterwards ([`WaitQueue::rescue`]). Each side writes its
//! atomic, then a `SeqCst` fence, then reads the other's (a Dekker handshake), so one of the
//! two always sees the other and no wakeup is lost. (`SeqCst` accesses alone would do in the
//! C++ memory model, but `loom`, which checks this protocol (`loom_models.rs`), models them as
//! acquire/release and then finds the lost wakeup; with the fences the code is what it checks.
//! One fence per release that finds no waiter.)
//!
//! A waiter that is dropped after a slot was handed to it gives the slot back
//! ([`WaitQueue::cancel`] returns it), and the caller releases it again, which hands it to the
//! next waiter: cancelling an acquire never strands a slot.
//!
//! Wakers are always invoked after the lock is released.

use std::collections::{BTreeMap, HashMap};
use std::task::Waker;

use super::freelist::FreeList;
use crate::sync::atomic::{AtomicUsize, Ordering::SeqCst, fence};
use crate::sync::{Mutex, MutexGuard};

#[derive(Debug, Default)]
struct Queue {
    next_id: u64,
    /// Waiting tasks by id; ids increase, so the first entry is the oldest (FIFO).
    waiting: BTreeMap<u64, Waker>,
    /// Slots handed to waiters that have not polled yet.
    granted: HashMap<u64, u32>,
}

/// The waiters of one size class.
#[derive(Debug, Default)]
pub(super) struct WaitQueue {
    queue: Mutex<Queue>,
    /// Registered waiters plus registrations in progress (read without the lock).
    count: AtomicUsize,
}

/// The outcome of [`WaitQueue::register`].
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Registered {
    /// A slot was free after all.
    Slot(u32),
    /// Queued with this id.
    Queued(u64),
}

impl WaitQueue {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        // A panic while holding the lock cannot leave the queue inconsistent (every mutation
        // is a single map operation), so a poisoned lock is still usable.
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Tasks waiting right now.
    pub(super) fn len(&self) -> usize {
        self.lock().waiting.len()
    }

    /// Queues a waiter unless `try_pop` finds a slot once the waiter is visible to releases.
    pub(super) fn register(
        &self,
        waker: &Waker,
        try_pop: impl FnOnce() -> Option<u32>,
    ) -> Registered {
        let mut q = self.lock();
        self.count.fetch_add(1, SeqCst);
        // Our count before the free list's head (the other half is in `rescue`).
        fence(SeqCst);
        if let Some(slot) = try_pop() {
            self.count.fetch_sub(1, SeqCst);
            return Registered::Slot(slot);
        }
        let id = q.next_id;
        q.next_id += 1;
        q.waiting.insert(id, waker.clone());
        Registered::Queued(id)
    }

    /// Takes the slot handed to waiter `id`, or refreshes its waker.
    pub(super) fn poll(&self, id: u64, waker: &Waker) -> Option<u32> {
        let mut q = self.lock();
        if let Some(slot) = q.granted.remove(&id) {
            return Some(slot);
        }
        if let Some(w) = q.waiting.get_mut(&id) {
            if !w.will_wake(waker) {
                w.clone_from(waker);
            }
        }
        None
    }

    /// Removes waiter `id`; returns the slot already handed to it, which the caller must
    /// release again.
    pub(super) fn cancel(&self, id: u64) -> Option<u32> {
        let mut q = self.lock();
        if q.waiting.remove(&id).is_some() {
            self.count.fetch_sub(1, SeqCst);
            return None;
        }
        q.granted.remove(&id)
    }

    /// Gives `slot` to the oldest waiter, if any; otherwise returns it.
    pub(super) fn hand_off(&self, slot: u32) -> Result<(), u32> {
        if self.count.load(SeqCst) == 0 {
            return Err(slot);
        }
        let mut q = self.lock();
        let Some(waker) = Self::grant_first(&mut q, &self.count, slot) else {
            return Err(slot);
        };
        drop(q);
        waker.wake();
        Ok(())
    }

    /// After a slot was pushed to the free list: if a waiter registered meanwhile, move a free
    /// slot (popped with `pop`) to it.
    pub(super) fn rescue(&self, pop: impl FnOnce() -> Option<u32>) {
        // The pushed head before the waiter count (the other half is in `register`).
        fence(SeqCst);
        if self.count.load(SeqCst) == 0 {
            return;
        }
        let mut q = self.lock();
        if q.waiting.is_empty() {
            return;
        }
        let Some(slot) = pop() else { return };
        let waker = Self::grant_first(&mut q, &self.count, slot).expect("a waiter is queued");
        drop(q);
        waker.wake();
    }

    /// The whole acquire protocol on `free` (home shard `home`): a free slot, else queued
    /// (with the re-check of [`register`](Self::register)).
    pub(super) fn acquire(&self, free: &FreeList, home: usize, waker: &Waker) -> Registered {
        if let Some(slot) = free.pop(home) {
            return Registered::Slot(slot);
        }
        self.register(waker, || free.pop(home))
    }

    /// The whole release protocol: `slot` to the oldest waiter, else onto `free` (home shard
    /// `home`) and then to a waiter that registered meanwhile ([`rescue`](Self::rescue)).
    pub(super) fn release(&self, free: &FreeList, home: usize, slot: u32) {
        let Err(slot) = self.hand_off(slot) else {
            return;
        };
        free.push(home, slot);
        self.rescue(|| free.pop(home));
    }

    fn grant_first(q: &mut Queue, count: &AtomicUsize, slot: u32) -> Option<Waker> {
        let (id, waker) = q.waiting.pop_first()?;
        q.granted.insert(id, slot);
        count.fetch_sub(1, SeqCst);
        Some(waker)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;
    use std::task::Wake;

    #[derive(Default)]
    struct Flag(AtomicBool);
    impl Wake for Flag {
        fn wake(self: Arc<Self>) {
            self.0.store(true, SeqCst);
        }
    }

    #[test]
    fn fifo_hand_off_and_cancel() {
        let q = WaitQueue::default();
        let (f1, f2) = (Arc::new(Flag::default()), Arc::new(Flag::default()));
        let (w1, w2) = (Waker::from(f1.clone()), Waker::from(f2.clone()));
        let Registered::Queued(a) = q.register(&w1, || None) else {
            panic!()
        };
        let Registered::Queued(b) = q.register(&w2, || None) else {
            panic!()
        };
        assert_eq!(q.len(), 2);
        assert_eq!(q.hand_off(7), Ok(()));
        assert!(f1.0.load(SeqCst) && !f2.0.load(SeqCst), "oldest first");
        // The first waiter is dropped before it polls: its slot comes back to the caller.
        assert_eq!(q.cancel(a), Some(7));
        assert_eq!(q.hand_off(7), Ok(()));
        assert!(f2.0.load(SeqCst));
        assert_eq!(q.poll(b, &w2), Some(7));
        assert_eq!(q.hand_off(8), Err(8), "nobody waits");
        assert_eq!(
            q.register(&w1, || Some(3)),
            Registered::Slot(3),
            "re-check finds a slot"
        );
        assert_eq!(q.count.load(SeqCst), 0);
    }

    #[test]
    fn rescue_moves_a_free_slot_to_a_waiter() {
        let q = WaitQueue::default();
        let f = Arc::new(Flag::default());
        let w = Waker::from(f.clone());
        let Registered::Queued(id) = q.register(&w, || None) else {
            panic!()
        };
        q.rescue(|| Some(5));
        assert!(f.0.load(SeqCst));
        assert_eq!(q.poll(id, &w), Some(5));
        assert_eq!(q.cancel(id), None);
    }
}
