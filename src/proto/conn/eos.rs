//! [`Eos`]: a connection's end-of-stream bookkeeping (its methods are in `close.rs`).

use std::time::Instant;

/// The end-of-stream bookkeeping of a connection.
#[derive(Debug, Default)]
pub(super) struct Eos {
    /// Our `Close`'s number among our control messages (1-based), once handed out.
    pub(super) close_seq: Option<u64>,
    /// The peer's control messages received so far (its error report excepted).
    pub(super) ctrl_received: u64,
    /// `ctrl_received` at the peer's `Close`: a `ctrl ack` of at least this confirms it.
    pub(super) peer_close_at: Option<u64>,
    /// Our first control message whose `ctrl ack` confirms the peer's `Close`.
    pub(super) confirm_seq: Option<u64>,
    /// Our control messages whose sends completed successfully (they complete in order).
    pub(super) ctrl_completed: u64,
    /// A data send failed, or was given up unflushed: its chunk may not have reached the
    /// peer (unless the peer returned its credit).
    pub(super) send_failed: bool,
    /// Messages were still to go out at the failure (or rendezvous messages the peer had not
    /// read): they never reach the peer.
    pub(super) queued_at_failure: bool,
    /// Since when the disconnect waits for the confirmation of the peer's `Close` (or, after
    /// a full close, for the peer's `Close` itself).
    pub(super) linger_since: Option<Instant>,
    /// That wait reached the keepalive timeout: disconnect without it.
    pub(super) linger_over: bool,
}
