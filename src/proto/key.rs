//! [`QpKey`]: how the core names a queue pair (an index and its generation).

/// Identifies a queue pair registered with a [`Core`](super::Core): a dense index and the generation of
/// that index, packed in 31 bits (so that a key fits in a sink's `wr_id` beside its flag bit).
///
/// An index is reused once its queue pair is removed, with the next generation: a key kept
/// past its queue pair's removal (an operation future that outlived its queue pair, a late
/// completion carrying the key in its `wr_id`) names nothing, and is never taken for the new
/// queue pair at that index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct QpKey(u32);

impl QpKey {
    /// Bits of the index.
    const INDEX_BITS: u32 = 20;
    /// Bits of the generation (the rest of the 31).
    const GEN_BITS: u32 = 11;
    const INDEX_MASK: u32 = (1 << Self::INDEX_BITS) - 1;
    const GEN_MASK: u32 = (1 << Self::GEN_BITS) - 1;
    /// Indices are below this; the all-ones key is reserved (the driver's shared receive
    /// queue marker).
    pub(crate) const MAX_INDEX: usize = Self::INDEX_MASK as usize;

    /// The key of `index` in its `generation` (the core hands keys out).
    pub(crate) fn new(index: usize, generation: u16) -> QpKey {
        debug_assert!(index < Self::MAX_INDEX);
        QpKey(index as u32 | ((u32::from(generation) & Self::GEN_MASK) << Self::INDEX_BITS))
    }

    #[cfg(test)]
    pub(crate) fn for_test(n: u32) -> QpKey {
        QpKey(n)
    }

    /// The dense index of this queue pair (for side tables: compare the whole key too).
    #[inline]
    pub(crate) fn index(self) -> usize {
        (self.0 & Self::INDEX_MASK) as usize
    }

    /// The generation of the index.
    #[inline]
    pub(crate) fn generation(self) -> u16 {
        ((self.0 >> Self::INDEX_BITS) & Self::GEN_MASK) as u16
    }

    /// The 31-bit packed form (index and generation), for `wr_id`s.
    pub(crate) fn to_bits(self) -> u32 {
        self.0
    }

    /// The key packed by [`to_bits`](Self::to_bits) (the top bit is ignored).
    pub(crate) fn from_bits(bits: u32) -> QpKey {
        QpKey(bits & ((1 << (Self::INDEX_BITS + Self::GEN_BITS)) - 1))
    }

    /// The reserved all-ones key.
    pub(crate) fn reserved() -> QpKey {
        QpKey((1 << (Self::INDEX_BITS + Self::GEN_BITS)) - 1)
    }
}
