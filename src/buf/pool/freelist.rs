//! Sharded lock-free free lists of slot indices.
//!
//! Each shard is a Treiber stack whose head packs a 32-bit ABA tag with a 32-bit slot index;
//! the `next` links live in one array shared by the shards of a size class (a slot is on at
//! most one stack at a time). A thread pops from its home shard first and steals from the
//! others when that is empty, and pushes to its home shard, so threads mostly touch different
//! cache lines. Everything is `SeqCst`: the waiter protocol in `waiters.rs` relies on a push
//! and a later check of the waiter count being totally ordered with a waiter's registration and
//! its re-check of the free list (a Dekker-style handshake, with `SeqCst` fences there).

use std::cell::Cell;

use crate::sync::atomic::{AtomicIsize, AtomicU32, AtomicU64, Ordering::SeqCst};

const NIL: u32 = u32::MAX;

/// One stack, alone on its cache lines.
#[repr(align(128))]
#[derive(Debug)]
struct Shard {
    /// `tag << 32 | index` of the top slot (`NIL` when empty).
    head: AtomicU64,
    /// Slots on this stack (may be transiently off by one under concurrency).
    len: AtomicIsize,
}

/// The free slots of one size class.
#[derive(Debug)]
pub(super) struct FreeList {
    shards: Box<[Shard]>,
    next: Box<[AtomicU32]>,
}

impl FreeList {
    /// A list holding all of `0..count`, spread over `shards` stacks.
    pub(super) fn new_full(count: u32, shards: usize) -> FreeList {
        assert!(count < NIL, "too many slots");
        let shards = shards.max(1);
        let list = FreeList {
            shards: (0..shards)
                .map(|_| Shard {
                    head: AtomicU64::new(u64::from(NIL)),
                    len: AtomicIsize::new(0),
                })
                .collect(),
            next: (0..count).map(|_| AtomicU32::new(NIL)).collect(),
        };
        // Push in reverse so low slots come out first (nicer for debugging and locality).
        for slot in (0..count).rev() {
            list.push(slot as usize % shards, slot);
        }
        list
    }

    /// Pops a free slot, from shard `home` first, then from the others.
    pub(super) fn pop(&self, home: usize) -> Option<u32> {
        let n = self.shards.len();
        (0..n).find_map(|i| self.pop_shard(&self.shards[(home + i) % n]))
    }

    fn pop_shard(&self, shard: &Shard) -> Option<u32> {
        let mut head = shard.head.load(SeqCst);
        loop {
            let idx = head as u32;
            if idx == NIL {
                return None;
            }
            // A stale read (the slot was popped and pushed again meanwhile) is harmless: the
            // tag then differs and the exchange fails.
            let next = self.next[idx as usize].load(SeqCst);
            let new = (((head >> 32) + 1) << 32) | u64::from(next);
            match shard.head.compare_exchange_weak(head, new, SeqCst, SeqCst) {
                Ok(_) => {
                    shard.len.fetch_sub(1, SeqCst);
                    return Some(idx);
                }
                Err(h) => head = h,
            }
        }
    }

    /// Pushes `slot` (which must not be on any stack) onto shard `home`.
    pub(super) fn push(&self, home: usize, slot: u32) {
        let shard = &self.shards[home % self.shards.len()];
        let mut head = shard.head.load(SeqCst);
        loop {
            self.next[slot as usize].store(head as u32, SeqCst);
            let new = (((head >> 32) + 1) << 32) | u64::from(slot);
            match shard.head.compare_exchange_weak(head, new, SeqCst, SeqCst) {
                Ok(_) => {
                    shard.len.fetch_add(1, SeqCst);
                    return;
                }
                Err(h) => head = h,
            }
        }
    }

    /// Free slots right now (exact when nothing runs concurrently).
    pub(super) fn len(&self) -> usize {
        let sum: isize = self.shards.iter().map(|s| s.len.load(SeqCst)).sum();
        usize::try_from(sum).unwrap_or(0)
    }
}

/// The calling thread's home shard hint: threads get consecutive numbers on first use.
pub(super) fn home_hint() -> usize {
    // A hint only (never `loom`'s: a static is no state of a model).
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    thread_local! {
        static HOME: Cell<Option<usize>> = const { Cell::new(None) };
    }
    HOME.with(|h| match h.get() {
        Some(v) => v,
        None => {
            let v = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            h.set(Some(v));
            v
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::sync::Arc;

    #[test]
    fn pops_every_slot_once_then_empty() {
        let list = FreeList::new_full(10, 3);
        assert_eq!(list.len(), 10);
        let got: HashSet<u32> = std::iter::from_fn(|| list.pop(1)).collect();
        assert_eq!(got, (0..10).collect());
        assert_eq!(list.len(), 0);
        assert_eq!(list.pop(0), None);
        list.push(2, 4);
        assert_eq!(list.pop(0), Some(4), "steals from other shards");
    }

    #[test]
    fn concurrent_pop_push_keeps_every_slot() {
        let list = Arc::new(FreeList::new_full(64, 4));
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let list = list.clone();
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        if let Some(s) = list.pop(t) {
                            list.push(t, s);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(list.len(), 64);
        let got: HashSet<u32> = std::iter::from_fn(|| list.pop(0)).collect();
        assert_eq!(got.len(), 64, "no slot lost or duplicated");
    }
}
