//! Receive-credit flow control, as plain logic.
//!
//! Each side posts receive buffers and tells the peer how many (its *credits*). Two budgets:
//!
//! * **Data credits** (`recv_credits` of the handshake): a sender consumes one per data chunk
//!   and never sends a chunk without one, so a chunk always finds a posted receive. The
//!   receiver returns a data credit only when it re-posts the receive, and it re-posts only
//!   while the application's unconsumed data is within its budget: a slow reader slows the
//!   sender instead of growing memory. Re-posts go in batches (`ConnProto::recvs_to_post`), so
//!   up to a batch less one of the credits is held back between batches.
//! * **Control messages** (credit returns, keepalives, end of stream, abort, error) need no
//!   data credit and never wait for the peer's application. The receiver keeps
//!   [`CONTROL_RECVS`] receives posted for them beyond the data credits and re-posts the
//!   receive of each control message at once; every header carries `ctrl ack`, how many of the
//!   peer's control messages it has re-posted receives for. A sender keeps at most
//!   [`CONTROL_WINDOW`] control messages unconfirmed (sent, not yet counted in the peer's `ctrl
//!   ack`), so control messages can never use up the receives data relies on: the device never
//!   sees a receiver-not-ready, for data or control. When the peer has a full window waiting
//!   for confirmation, a *confirm-only* credit message may use the one extra receive, so two
//!   sides that each wait for the other's confirmation always get out (a shared budget with
//!   piggybacked returns can deadlock: both out of credits, each owing the other).
//!
//! Owed data credits travel piggybacked in the header of every outgoing message, or in a
//! credit message when enough are owed or the peer has none left.
//!
//! # Examples
//!
//! (Not a doc test: the module is private; its unit tests make the same calls.)
//!
//! ```ignore
//! use crate::proto::Credits;
//!
//! let mut c = Credits::new(4, 4, 4, 4); // the peer keeps 4 data receives for us; we keep 4 for it
//! for _ in 0..4 {
//!     assert!(c.try_take_data());
//! }
//! assert!(!c.try_take_data(), "out of data credits: wait");
//! c.on_returned(2).unwrap(); // the peer re-posted two receives
//! assert_eq!(c.data_available(), 2);
//! c.on_data_received().unwrap(); // the peer's chunk consumed one of our receives ...
//! c.on_data_reposted(); // ... which we re-posted: we owe the peer one credit
//! assert_eq!(c.take_owed(), 1); // piggybacked on the next message
//! ```
#![forbid(unsafe_code)]

use crate::error::ProtocolError;

/// Control messages a side may have unconfirmed by the peer's `ctrl ack`.
pub const CONTROL_WINDOW: u64 = 2;
/// Receives kept posted for the peer's control messages, beyond its data credits: the window
/// plus one for a confirm-only message.
pub const CONTROL_RECVS: u32 = CONTROL_WINDOW as u32 + 1;

/// Credit accounting of one connection (both directions).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credits {
    /// Data chunks we may send now (the peer's receives we know about).
    data_available: u32,
    /// The peer's data credits in total (its `recv_credits`): what we hold plus what is in
    /// flight never exceeds it.
    remote_depth: u32,
    /// Data chunks sent whose credit has not come back yet.
    data_in_use: u32,
    /// Control messages we sent.
    ctrl_sent: u64,
    /// Of those, how many the peer confirmed (re-posted their receives).
    ctrl_confirmed: u64,
    /// The peer's control messages whose receives we re-posted.
    ctrl_processed: u64,
    /// The value of `ctrl_processed` we last told the peer.
    ctrl_announced: u64,
    /// Data receives we re-posted that the peer does not know about yet.
    owed: u32,
    /// The data credits the peer believes it has: announced minus consumed.
    peer_view: u32,
    /// Send a credit message once this many credits are owed.
    threshold: u32,
}

impl Credits {
    /// Starts with `remote_initial` of the peer's `remote_depth` data credits (the peer grants
    /// the rest later, as returns), and `local_initial` of our `local_depth`. The
    /// credit-message threshold is half our depth (at least 1): a window that starts small
    /// and grows batches its returns like a full one.
    pub fn new(
        remote_initial: u32,
        remote_depth: u32,
        local_initial: u32,
        local_depth: u32,
    ) -> Credits {
        let remote_initial = remote_initial.min(remote_depth);
        let local_credits = local_initial;
        Credits {
            data_available: remote_initial,
            remote_depth,
            // Credits not granted yet count as in use: the peer's later grants arrive as
            // returns, and never exceed its depth.
            data_in_use: remote_depth - remote_initial,
            ctrl_sent: 0,
            ctrl_confirmed: 0,
            ctrl_processed: 0,
            ctrl_announced: 0,
            owed: 0,
            peer_view: local_credits,
            threshold: (local_depth / 2).max(1),
        }
    }

    /// Data credits we may use now.
    pub fn data_available(&self) -> u32 {
        self.data_available
    }

    /// Control messages sent and not yet confirmed by the peer.
    pub fn ctrl_unconfirmed(&self) -> u64 {
        self.ctrl_sent - self.ctrl_confirmed
    }

    /// Control messages we sent.
    pub fn ctrl_sent(&self) -> u64 {
        self.ctrl_sent
    }

    /// Of our control messages, how many the peer confirmed (counted in its `ctrl ack`).
    pub fn ctrl_confirmed(&self) -> u64 {
        self.ctrl_confirmed
    }

    /// The peer's control messages whose receives we re-posted.
    pub fn ctrl_processed(&self) -> u64 {
        self.ctrl_processed
    }

    /// The `ctrl ack` we last told the peer.
    pub fn ctrl_announced(&self) -> u64 {
        self.ctrl_announced
    }

    /// Whether the peer returned the credit of every data chunk we sent (and granted all of
    /// its depth): it re-posted the receive of each, so every chunk reached it.
    pub fn all_returned(&self) -> bool {
        self.data_in_use == 0
    }

    /// Credits we owe the peer.
    pub fn owed(&self) -> u32 {
        self.owed
    }

    /// The data credits the peer believes it has.
    pub fn peer_view(&self) -> u32 {
        self.peer_view
    }

    /// Takes a data credit. `false`: none left, wait for the peer to return some.
    pub fn try_take_data(&mut self) -> bool {
        if self.data_available == 0 {
            return false;
        }
        self.data_available -= 1;
        self.data_in_use += 1;
        true
    }

    /// Takes room for a control message. `confirm_only`: a credit message sent because the
    /// peer waits for our confirmation ([`confirm_due`](Self::confirm_due)), which may use the
    /// extra receive. `false`: the window is full; wait for the peer's `ctrl ack`.
    pub fn try_take_control(&mut self, confirm_only: bool) -> bool {
        let limit = CONTROL_WINDOW + u64::from(confirm_only);
        if self.ctrl_unconfirmed() >= limit {
            return false;
        }
        self.ctrl_sent += 1;
        true
    }

    /// The `ctrl ack` of a header from the peer (mod 256).
    ///
    /// # Errors
    ///
    /// [`ProtocolError::CreditInflation`] if it confirms more than we sent.
    pub fn on_ctrl_ack(&mut self, ack: u8) -> Result<(), ProtocolError> {
        let delta = u64::from(ack.wrapping_sub(self.ctrl_confirmed as u8));
        if self.ctrl_confirmed + delta > self.ctrl_sent {
            return Err(ProtocolError::CreditInflation);
        }
        self.ctrl_confirmed += delta;
        Ok(())
    }

    /// We re-posted the receive of one of the peer's control messages.
    pub fn on_ctrl_reposted(&mut self) {
        self.ctrl_processed += 1;
    }

    /// The `ctrl ack` for an outgoing header.
    pub fn take_ctrl_ack(&mut self) -> u8 {
        self.ctrl_announced = self.ctrl_processed;
        self.ctrl_processed as u8
    }

    /// Whether the peer may be waiting for our confirmation: a full window of its control
    /// messages is re-posted but not yet confirmed.
    pub fn confirm_due(&self) -> bool {
        self.ctrl_processed - self.ctrl_announced >= CONTROL_WINDOW
    }

    /// The peer returned `n` data credits.
    ///
    /// # Errors
    ///
    /// [`ProtocolError::CreditInflation`] if it returns more than are in use.
    pub fn on_returned(&mut self, n: u32) -> Result<(), ProtocolError> {
        if n > self.data_in_use {
            return Err(ProtocolError::CreditInflation);
        }
        self.data_in_use -= n;
        self.data_available += n;
        debug_assert!(self.data_available + self.data_in_use <= self.remote_depth);
        Ok(())
    }

    /// A data chunk from the peer consumed one of our receives.
    ///
    /// # Errors
    ///
    /// [`ProtocolError::CreditOverrun`] if the peer had no data credit left.
    pub fn on_data_received(&mut self) -> Result<(), ProtocolError> {
        if self.peer_view == 0 {
            return Err(ProtocolError::CreditOverrun);
        }
        self.peer_view -= 1;
        Ok(())
    }

    /// We re-posted a receive a data chunk consumed: one more data credit is owed.
    pub fn on_data_reposted(&mut self) {
        self.owed += 1;
    }

    /// Takes every owed credit (at most `u16::MAX`) to piggyback on an outgoing message.
    pub fn take_owed(&mut self) -> u16 {
        let n = self.owed.min(u32::from(u16::MAX));
        self.owed -= n;
        self.peer_view += n;
        n as u16
    }

    /// Whether a credit message should go out now: enough credits are owed, or the peer has
    /// no data credit left and we owe it some.
    pub fn credit_message_due(&self) -> bool {
        self.owed > 0 && (self.owed >= self.threshold || self.peer_view == 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_messages_have_a_window_confirmed_by_the_peer() {
        let mut c = Credits::new(2, 2, 8, 8);
        assert!(c.try_take_data() && c.try_take_data() && !c.try_take_data());
        assert!(c.try_take_control(false), "control needs no data credit");
        assert!(c.try_take_control(false));
        assert!(!c.try_take_control(false), "window of 2");
        assert!(c.try_take_control(true), "one more, confirm-only");
        assert!(!c.try_take_control(true));
        c.on_ctrl_ack(2).unwrap();
        assert_eq!(c.ctrl_unconfirmed(), 1);
        assert!(c.try_take_control(false));
        assert_eq!(c.on_ctrl_ack(9), Err(ProtocolError::CreditInflation));
    }

    #[test]
    fn confirmation_is_due_after_a_window_of_peer_controls() {
        let mut c = Credits::new(2, 2, 2, 2);
        c.on_ctrl_reposted();
        assert!(!c.confirm_due());
        c.on_ctrl_reposted();
        assert!(c.confirm_due());
        assert_eq!(c.take_ctrl_ack(), 2);
        assert!(!c.confirm_due());
    }

    #[test]
    fn credit_messages_when_owed_or_when_the_peer_ran_dry() {
        let mut c = Credits::new(8, 8, 8, 8);
        for _ in 0..3 {
            c.on_data_received().unwrap();
            c.on_data_reposted();
        }
        assert!(!c.credit_message_due(), "3 < 8/2 and the peer still has 5");
        c.on_data_received().unwrap();
        c.on_data_reposted();
        assert!(c.credit_message_due());
        assert_eq!(c.take_owed(), 4);
        assert_eq!(c.peer_view(), 8);
        // The peer spends everything; we re-post one: due at once (it has none).
        for _ in 0..8 {
            c.on_data_received().unwrap();
        }
        assert_eq!(
            c.on_data_received(),
            Err(ProtocolError::CreditOverrun),
            "a ninth chunk overruns"
        );
        c.on_data_reposted();
        assert!(c.credit_message_due());
    }

    #[test]
    fn credits_granted_later_arrive_as_returns_up_to_the_depth() {
        let mut c = Credits::new(2, 8, 2, 2);
        assert_eq!(c.data_available(), 2);
        c.on_returned(6).unwrap();
        assert_eq!(c.data_available(), 8);
        assert_eq!(c.on_returned(1), Err(ProtocolError::CreditInflation));
    }

    #[test]
    fn returning_more_than_in_use_is_a_violation() {
        let mut c = Credits::new(4, 4, 4, 4);
        assert!(c.try_take_data());
        assert_eq!(c.on_returned(2), Err(ProtocolError::CreditInflation));
        assert_eq!(c.on_returned(1), Ok(()));
    }
}
