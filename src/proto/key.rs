//! [`QpKey`]: how the core names a queue pair (an index and its generation).

/// Identifies a queue pair registered with a [`Core`](super::Core): a dense index and the
/// generation of that index.
///
/// An index is reused once its queue pair is removed, with the next generation: a key kept
/// past its queue pair's removal (an operation future that outlived its queue pair) names
/// nothing, and is never taken for the new queue pair at that index. The generation has 44
/// bits, so it does not come round again in any real process's life (2^44 queue pairs at one
/// index: at a million a second, 200 days); an 11-bit one came round after 2,048 connections
/// accepted one after another, and the 2,049th queue pair's key then matched no generation
/// the core held, so every request on it failed as closed.
///
/// [`to_bits`](Self::to_bits) packs the index and the low 11 bits of the generation into 31
/// bits, for the `wr_id`s of requests a queue pair's owner posts itself (see
/// `driver::sink`): those name a queue pair only while its requests are outstanding, and a
/// queue pair is removed only once none is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct QpKey(u64);

impl QpKey {
    /// Bits of the index.
    const INDEX_BITS: u32 = 20;
    /// Bits of the generation in the packed form ([`to_bits`](Self::to_bits)).
    const SHORT_GEN_BITS: u32 = 11;
    const INDEX_MASK: u64 = (1 << Self::INDEX_BITS) - 1;
    /// Generations wrap at 2^44.
    pub(crate) const GEN_MASK: u64 = (1 << (64 - Self::INDEX_BITS)) - 1;
    const SHORT_MASK: u32 = (1 << (Self::INDEX_BITS + Self::SHORT_GEN_BITS)) - 1;
    /// Indices are below this; the all-ones index is reserved (the driver's shared receive
    /// queue marker).
    pub(crate) const MAX_INDEX: usize = Self::INDEX_MASK as usize;

    /// The key of `index` in its `generation` (the core hands keys out).
    pub(crate) fn new(index: usize, generation: u64) -> QpKey {
        debug_assert!(index < Self::MAX_INDEX);
        QpKey(index as u64 | ((generation & Self::GEN_MASK) << Self::INDEX_BITS))
    }

    #[cfg(test)]
    pub(crate) fn for_test(n: u32) -> QpKey {
        QpKey(u64::from(n))
    }

    /// The dense index of this queue pair (for side tables: compare the whole key too).
    #[inline]
    pub(crate) fn index(self) -> usize {
        (self.0 & Self::INDEX_MASK) as usize
    }

    /// The generation of the index.
    #[inline]
    pub(crate) fn generation(self) -> u64 {
        self.0 >> Self::INDEX_BITS
    }

    /// The 31-bit packed form (index and the low bits of the generation), for `wr_id`s.
    #[inline]
    pub(crate) fn to_bits(self) -> u32 {
        (self.0 as u32) & Self::SHORT_MASK
    }

    /// A key with the index and short generation packed by [`to_bits`](Self::to_bits) (the
    /// top bit is ignored): compare it with a full key by their `to_bits`.
    pub(crate) fn from_bits(bits: u32) -> QpKey {
        QpKey(u64::from(bits & Self::SHORT_MASK))
    }

    /// The reserved key (all-ones index and short generation); no queue pair has it.
    pub(crate) fn reserved() -> QpKey {
        QpKey(u64::from(Self::SHORT_MASK))
    }
}
