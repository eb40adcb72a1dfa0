//! Sink routing: requests a queue pair's owner posts itself carry a `wr_id` with the sink bit
//! and the queue pair's key, and their completions go to the owner's
//! [`Sink`](super::Sink) (a connection), not to the operation table.

use crate::proto::QpKey;

/// `wr_id`s with this bit set belong to a queue pair's [`Sink`](super::Sink); bits 32..63 name the queue
/// pair ([`QpKey::to_bits`]: its index and generation), bits 0..32 are the sink's own.
pub(crate) const SINK_BIT: u64 = 1 << 63;

/// The `wr_id` of request `local` of the sink of `qp`.
pub(crate) fn sink_wr_id(qp: QpKey, local: u32) -> u64 {
    SINK_BIT | (u64::from(qp.to_bits()) << 32) | u64::from(local)
}

/// The queue-pair key of a sink `wr_id` (see [`sink_wr_id`]).
pub(crate) fn sink_key(wr_id: u64) -> QpKey {
    QpKey::from_bits(((wr_id & !SINK_BIT) >> 32) as u32)
}

/// The `wr_id` of receive `local` on the shared receive queue (the reserved key: which queue
/// pair consumed it is known only from its completion's `qp_num`). Its completion goes to the
/// sink of that queue pair, or (no such sink any more) to the SRQ's own sink.
pub(crate) fn srq_wr_id(local: u32) -> u64 {
    sink_wr_id(QpKey::reserved(), local)
}
