//! The requests of a [`Batch`](super::Batch) not posted yet, as the queue pair keeps them: plain
//! data (a leaf below both the queue pair and the batch).

use crate::verbs::{SendOp, Sge};

/// The most requests a [`Batch`](super::Batch) holds.
pub const MAX_BATCH: usize = 16;

/// A batched request's scatter/gather entries.
pub(super) enum Entries {
    /// A single buffer's (`None`: empty).
    One(Option<Sge>),
    /// A list's, in the queue pair's `batch_sges`: the first, and how many.
    List(u32, u32),
}

/// One request of a batch, its slot taken: what its work request needs.
pub(super) struct Item {
    pub(super) slot: u32,
    pub(super) generation: u64,
    pub(super) wr_id: u64,
    pub(super) op: SendOp,
    pub(super) sges: Entries,
    pub(super) inline: bool,
}
