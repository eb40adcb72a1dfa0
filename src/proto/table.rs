//! The in-flight operation table: a generational slab keyed by `wr_id`.
//!
//! `wr_id = (generation << 32) | slot`. A completion whose generation does not match the slot's
//! current occupant is stale or spurious and is ignored instead of completing the wrong
//! operation.

use std::task::Waker;

use super::key::QpKey;
use super::wr::{OpInfo, Queue};
use crate::error::Error;

/// Where an operation is in its life.
#[derive(Debug)]
pub(crate) enum Lifecycle {
    /// Submitted to the core, waiting for queue space to be posted (the request itself waits
    /// in its queue pair's pending list).
    Queued,
    /// Posted to the device; the future may be waiting (its waker is in the entry).
    Submitted,
    /// Succeeded; the outcome waits for the future to collect it (a change of state writes
    /// only these few bytes, not a whole `Result` with its error).
    Done(OpInfo),
    /// Failed; the error waits for the future to collect it (boxed: an entry, written whole
    /// on every submission, stays small, and so does every [`Outcome`] the waiting future's
    /// layers hand up, which a success moves without the 56 bytes of an `Error`).
    Failed(Box<Error>),
    /// The future was dropped after posting: the payload stays parked until the completion.
    Cancelled,
}

#[derive(Debug)]
pub(crate) struct Entry<P> {
    pub(crate) qp: QpKey,
    pub(crate) queue: Queue,
    pub(crate) lifecycle: Lifecycle,
    pub(crate) waker: Option<Waker>,
    pub(crate) payload: Option<P>,
}

#[derive(Debug)]
enum Slot<P> {
    Occupied {
        generation: u32,
        entry: Entry<P>,
    },
    Vacant {
        generation: u32,
        next_free: Option<u32>,
    },
}

/// A slab of entries with generation-checked ids.
#[derive(Debug)]
pub(crate) struct OpTable<P> {
    slots: Vec<Slot<P>>,
    free_head: Option<u32>,
    len: usize,
}

#[inline]
fn split(wr_id: u64) -> (u32, u32) {
    ((wr_id >> 32) as u32, wr_id as u32)
}

impl<P> OpTable<P> {
    pub(crate) fn new() -> OpTable<P> {
        OpTable {
            slots: Vec::new(),
            free_head: None,
            len: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Inserts an entry and returns its `wr_id`.
    #[inline]
    pub(crate) fn insert(&mut self, entry: Entry<P>) -> u64 {
        self.len += 1;
        match self.free_head {
            Some(idx) => {
                let slot = &mut self.slots[idx as usize];
                let Slot::Vacant {
                    generation,
                    next_free,
                } = *slot
                else {
                    unreachable!("free list points at an occupied slot");
                };
                // Generations use 31 bits: ids with the top bit set belong to queue pairs whose requests
                // the driver routes to a sink (see `SINK_BIT` in the driver), never to this table.
                let generation = generation.wrapping_add(1) & 0x7fff_ffff;
                self.free_head = next_free;
                *slot = Slot::Occupied { generation, entry };
                (u64::from(generation) << 32) | u64::from(idx)
            }
            None => {
                let idx =
                    u32::try_from(self.slots.len()).expect("fewer than 2^32 operations in flight");
                self.slots.push(Slot::Occupied {
                    generation: 0,
                    entry,
                });
                u64::from(idx)
            }
        }
    }

    #[inline]
    pub(crate) fn get_mut(&mut self, wr_id: u64) -> Option<&mut Entry<P>> {
        let (generation, idx) = split(wr_id);
        match self.slots.get_mut(idx as usize) {
            Some(Slot::Occupied {
                generation: g,
                entry,
            }) if *g == generation => Some(entry),
            _ => None,
        }
    }

    #[inline]
    pub(crate) fn get(&self, wr_id: u64) -> Option<&Entry<P>> {
        let (generation, idx) = split(wr_id);
        match self.slots.get(idx as usize) {
            Some(Slot::Occupied {
                generation: g,
                entry,
            }) if *g == generation => Some(entry),
            _ => None,
        }
    }

    /// Frees `wr_id`'s slot in place: what is left of its entry is dropped where it lies (the
    /// caller has taken out what it needs), nothing is moved out.
    ///
    /// # Panics
    ///
    /// If `wr_id` is not in the table.
    #[inline]
    pub(crate) fn free(&mut self, wr_id: u64) {
        let (generation, idx) = split(wr_id);
        let slot = &mut self.slots[idx as usize];
        assert!(
            matches!(slot, Slot::Occupied { generation: g, .. } if *g == generation),
            "freeing an entry that is not in the table"
        );
        *slot = Slot::Vacant {
            generation,
            next_free: self.free_head,
        };
        self.free_head = Some(idx);
        self.len -= 1;
    }

    pub(crate) fn remove(&mut self, wr_id: u64) -> Option<Entry<P>> {
        let (generation, idx) = split(wr_id);
        let slot = self.slots.get_mut(idx as usize)?;
        match slot {
            Slot::Occupied { generation: g, .. } if *g == generation => {}
            _ => return None,
        }
        let old = std::mem::replace(
            slot,
            Slot::Vacant {
                generation,
                next_free: self.free_head,
            },
        );
        self.free_head = Some(idx);
        self.len -= 1;
        match old {
            Slot::Occupied { entry, .. } => Some(entry),
            Slot::Vacant { .. } => unreachable!(),
        }
    }

    /// The ids of the entries matching `pred`.
    pub(crate) fn ids_where(&self, mut pred: impl FnMut(&Entry<P>) -> bool) -> Vec<u64> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(idx, slot)| match slot {
                Slot::Occupied { generation, entry } if pred(entry) => {
                    Some((u64::from(*generation) << 32) | idx as u64)
                }
                _ => None,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(p: u32) -> Entry<u32> {
        Entry {
            qp: QpKey::for_test(0),
            queue: Queue::Send,
            lifecycle: Lifecycle::Submitted,
            waker: None,
            payload: Some(p),
        }
    }

    #[test]
    fn reuse_bumps_generation_and_rejects_stale_ids() {
        let mut t = OpTable::new();
        let a = t.insert(entry(1));
        assert_eq!(t.remove(a).unwrap().payload, Some(1));
        let b = t.insert(entry(2));
        assert_eq!(a as u32, b as u32, "slot reused");
        assert_ne!(a, b, "generation differs");
        assert!(t.get_mut(a).is_none(), "stale id does not resolve");
        assert!(t.remove(a).is_none());
        assert_eq!(t.len(), 1);
        assert_eq!(t.ids_where(|e| e.payload == Some(2)), vec![b]);
    }

    #[test]
    fn free_vacates_the_slot_for_reuse_with_a_new_generation() {
        let mut t = OpTable::new();
        let a = t.insert(entry(1));
        let keep = t.insert(entry(9));
        t.free(a);
        assert_eq!(t.len(), 1);
        assert!(t.get_mut(a).is_none(), "freed");
        assert_eq!(
            t.get(keep).and_then(|e| e.payload),
            Some(9),
            "the other stays"
        );
        let b = t.insert(entry(2));
        assert_eq!(a as u32, b as u32, "the freed slot is reused");
        assert_ne!(a, b);
        assert!(
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| t.free(a))).is_err(),
            "a stale id"
        );
    }

    #[test]
    fn unknown_ids_are_ignored() {
        let mut t: OpTable<u32> = OpTable::new();
        assert!(t.get_mut(12345).is_none());
        assert!(t.remove(u64::MAX).is_none());
    }
}
