//! The cache's pure bookkeeping: non-overlapping address ranges with an LRU order.

use std::collections::BTreeMap;

#[derive(Debug)]
struct Entry<V> {
    end: u64,
    tick: u64,
    value: V,
}

/// Non-overlapping `[start, end)` ranges, each with a value, ordered by address and by last use.
#[derive(Debug)]
pub(super) struct RangeIndex<V> {
    by_start: BTreeMap<u64, Entry<V>>,
    lru: BTreeMap<u64, u64>,
    tick: u64,
    bytes: u64,
}

impl<V> Default for RangeIndex<V> {
    fn default() -> Self {
        RangeIndex {
            by_start: BTreeMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            bytes: 0,
        }
    }
}

impl<V> RangeIndex<V> {
    /// Total bytes of all ranges.
    pub(super) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Number of ranges.
    pub(super) fn len(&self) -> usize {
        self.by_start.len()
    }

    /// The value of the range that contains all of `[start, end)`, marked most recently used.
    pub(super) fn covering(&mut self, start: u64, end: u64) -> Option<&V> {
        let (&s, e) = self.by_start.range_mut(..=start).next_back()?;
        if e.end < end {
            return None;
        }
        self.tick += 1;
        self.lru.remove(&e.tick);
        e.tick = self.tick;
        self.lru.insert(self.tick, s);
        Some(&e.value)
    }

    /// The value of the range starting at `start`.
    pub(super) fn get(&self, start: u64) -> Option<&V> {
        self.by_start.get(&start).map(|e| &e.value)
    }

    /// Starts of the ranges that overlap `[start, end)` or touch it (`adjacent`).
    pub(super) fn touching(&self, start: u64, end: u64, adjacent: bool) -> Vec<u64> {
        let upto = if adjacent { end } else { end.saturating_sub(1) };
        let mut out: Vec<u64> = self
            .by_start
            .range(..=upto)
            .rev()
            .take_while(|(_, e)| {
                if adjacent {
                    e.end >= start
                } else {
                    e.end > start
                }
            })
            .map(|(&s, _)| s)
            .collect();
        if !adjacent && end == start {
            out.clear();
        }
        out.reverse();
        out
    }

    /// The smallest range containing `[start, end)` and the ranges at `starts`.
    pub(super) fn span(&self, start: u64, end: u64, starts: &[u64]) -> (u64, u64) {
        starts.iter().fold((start, end), |(s, e), k| {
            let entry = &self.by_start[k];
            (s.min(*k), e.max(entry.end))
        })
    }

    /// Inserts `[start, end)`, which must not overlap an existing range.
    pub(super) fn insert(&mut self, start: u64, end: u64, value: V) {
        debug_assert!(self.touching(start, end, false).is_empty(), "overlap");
        self.tick += 1;
        self.lru.insert(self.tick, start);
        self.bytes += end - start;
        self.by_start.insert(
            start,
            Entry {
                end,
                tick: self.tick,
                value,
            },
        );
    }

    /// Removes the range starting at `start`.
    pub(super) fn remove(&mut self, start: u64) -> Option<(u64, V)> {
        let e = self.by_start.remove(&start)?;
        self.lru.remove(&e.tick);
        self.bytes -= e.end - start;
        Some((e.end, e.value))
    }

    /// Removes the least recently used range, unless it is the one starting at `keep`.
    pub(super) fn pop_lru_except(&mut self, keep: u64) -> Option<(u64, u64, V)> {
        let start = self.lru.values().copied().find(|&s| s != keep)?;
        let (end, v) = self.remove(start)?;
        Some((start, end, v))
    }

    /// Every range with its value.
    pub(super) fn iter(&self) -> impl Iterator<Item = (u64, u64, &V)> {
        self.by_start.iter().map(|(&s, e)| (s, e.end, &e.value))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn covering_and_touching() {
        let mut ix = RangeIndex::default();
        ix.insert(100, 200, 'a');
        ix.insert(300, 400, 'b');
        assert_eq!(ix.bytes(), 200);
        assert_eq!(ix.covering(150, 200), Some(&'a'));
        assert_eq!(ix.covering(150, 201), None);
        assert_eq!(ix.covering(250, 260), None);
        assert_eq!(ix.covering(50, 60), None);
        assert_eq!(
            ix.touching(200, 300, true),
            vec![100, 300],
            "adjacent both sides"
        );
        assert!(ix.touching(200, 300, false).is_empty());
        assert_eq!(ix.touching(199, 301, false), vec![100, 300]);
        assert_eq!(ix.touching(0, 1000, false), vec![100, 300]);
        assert_eq!(ix.span(200, 300, &[100, 300]), (100, 400));
    }

    #[test]
    fn lru_order_follows_use() {
        let mut ix = RangeIndex::default();
        ix.insert(0, 10, 0);
        ix.insert(10, 20, 1);
        ix.insert(20, 30, 2);
        ix.covering(0, 5); // 0 becomes most recent
        assert_eq!(ix.pop_lru_except(99).map(|x| x.2), Some(1));
        assert_eq!(
            ix.pop_lru_except(20).map(|x| x.2),
            Some(0),
            "keeps the protected one"
        );
        assert_eq!(ix.pop_lru_except(20), None);
        assert_eq!(ix.len(), 1);
        assert_eq!(ix.bytes(), 10);
        assert_eq!(ix.remove(20).map(|x| x.1), Some(2));
        assert_eq!(ix.bytes(), 0);
    }
}
