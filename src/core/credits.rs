//! Receive-credit flow control for message passing, as plain logic.
//!
//! Each side posts receive buffers and tells the peer how many (its *credits*). A sender
//! consumes one credit per SEND and never sends without one, so a SEND always finds a posted
//! receive and the device never answers with an RNR NAK. When the receiver re-posts a buffer it
//! owes the peer one credit; owed credits travel back piggybacked in the immediate data of the
//! next outgoing message, or, when enough are owed and nothing is going out, in a small credit
//! message.
//!
//! A credit message itself consumes a receive at the peer, so one credit is **reserved** for
//! them: data never takes the last credit. Without the reserve both sides could run out of
//! credits with credits owed to each other and no way to say so.
//!
//! # Examples
//!
//! ```
//! use tokio_rdma::core::Credits;
//!
//! let mut c = Credits::new(4, 4);   // the peer posted 4 receives; we post 4
//! assert!(c.try_take_data());       // 3 data credits + 1 reserved
//! assert!(c.try_take_data());
//! assert!(c.try_take_data());
//! assert!(!c.try_take_data(), "the last credit is reserved for credit messages");
//! c.on_returned(2);                 // the peer re-posted two buffers
//! assert_eq!(c.available(), 3);
//! c.on_reposted();                  // we re-posted one of ours
//! assert_eq!(c.take_owed(), 1);     // piggyback it on the next message
//! ```
#![forbid(unsafe_code)]

/// Credit accounting of one connection (both directions).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credits {
    /// Receives the peer has posted that we have not consumed yet (including the reserve).
    available: u32,
    /// Receives we re-posted that the peer does not know about yet.
    owed: u32,
    /// Our receive queue size (what we advertised).
    local_depth: u32,
    /// Send a credit message once this many credits are owed and none went out piggybacked.
    threshold: u32,
}

impl Credits {
    /// Starts with the peer's advertised credits and our own receive depth. The credit-message
    /// threshold is half our depth (at least 1).
    pub fn new(remote_credits: u32, local_depth: u32) -> Credits {
        Credits {
            available: remote_credits,
            owed: 0,
            local_depth,
            threshold: (local_depth / 2).max(1),
        }
    }

    /// Credits that may be consumed now (including the reserved one).
    pub fn available(&self) -> u32 {
        self.available
    }

    /// Credits we owe the peer.
    pub fn owed(&self) -> u32 {
        self.owed
    }

    /// Takes a credit for a data message, leaving the reserve. `false`: wait for credits.
    pub fn try_take_data(&mut self) -> bool {
        if self.available > 1 {
            self.available -= 1;
            true
        } else {
            false
        }
    }

    /// Takes a credit for a control message (credit return, close, keepalive); may use the
    /// reserve. `false`: none left at all.
    pub fn try_take_control(&mut self) -> bool {
        if self.available > 0 {
            self.available -= 1;
            true
        } else {
            false
        }
    }

    /// Gives back a credit taken for a message that was never sent (cancelled before posting).
    pub fn untake(&mut self) {
        self.available += 1;
    }

    /// The peer returned `n` credits.
    pub fn on_returned(&mut self, n: u32) {
        self.available = self.available.saturating_add(n);
    }

    /// We re-posted one receive buffer: one more credit is owed to the peer.
    pub fn on_reposted(&mut self) {
        self.owed = (self.owed + 1).min(self.local_depth.max(1) * 2);
    }

    /// Takes every owed credit (at most `u16::MAX`) to piggyback on an outgoing message.
    pub fn take_owed(&mut self) -> u32 {
        let n = self.owed.min(u32::from(u16::MAX));
        self.owed -= n;
        n
    }

    /// Puts credits back that were taken with [`take_owed`](Self::take_owed) but not sent.
    pub fn restore_owed(&mut self, n: u32) {
        self.owed += n;
    }

    /// Whether enough credits are owed that a credit message should go out now.
    pub fn credit_message_due(&self) -> bool {
        self.owed >= self.threshold
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserve_is_only_for_control() {
        let mut c = Credits::new(2, 8);
        assert!(c.try_take_data());
        assert!(!c.try_take_data());
        assert!(c.try_take_control(), "the reserve serves control messages");
        assert!(!c.try_take_control());
        c.untake();
        assert_eq!(c.available(), 1);
    }

    #[test]
    fn owed_credits_and_threshold() {
        let mut c = Credits::new(8, 8);
        for _ in 0..3 {
            c.on_reposted();
        }
        assert!(!c.credit_message_due(), "3 < 8/2");
        c.on_reposted();
        assert!(c.credit_message_due());
        let n = c.take_owed();
        assert_eq!(n, 4);
        assert_eq!(c.owed(), 0);
        c.restore_owed(n);
        assert_eq!(c.owed(), 4);
    }

    /// Two peers exchanging messages under the protocol never send without a credit and never
    /// deadlock: whatever the interleaving, every queued message is eventually delivered.
    #[test]
    fn simulated_peers_never_overrun_and_never_deadlock() {
        let depth = 4u32;
        let mut rng = 0x1234_5678_9abc_def0u64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        // side[i]: credits, messages to send, posted receives, in-flight messages to the peer.
        let mut credits = [Credits::new(depth, depth), Credits::new(depth, depth)];
        let mut to_send = [500u32, 300u32];
        let mut posted = [depth, depth];
        let mut wire: [Vec<(bool, u32)>; 2] = [Vec::new(), Vec::new()]; // (is_data, piggyback)
        let mut delivered = [0u32, 0u32];
        for _step in 0..1_000_000 {
            if to_send == [0, 0] && wire[0].is_empty() && wire[1].is_empty() {
                break;
            }
            let i = (next() % 2) as usize;
            let j = 1 - i;
            match next() % 3 {
                0 if to_send[i] > 0 && credits[i].try_take_data() => {
                    to_send[i] -= 1;
                    let owed = credits[i].take_owed();
                    wire[i].push((true, owed));
                }
                1 if !wire[j].is_empty() => {
                    // Deliver the peer's oldest message to side i: it consumes a receive.
                    let (is_data, n) = wire[j].remove(0);
                    assert!(
                        posted[i] > 0,
                        "a message arrived with no receive posted (RNR)"
                    );
                    posted[i] -= 1;
                    credits[i].on_returned(n);
                    if is_data {
                        delivered[i] += 1;
                    }
                    // Re-post the buffer at once.
                    posted[i] += 1;
                    credits[i].on_reposted();
                }
                _ => {
                    if credits[i].credit_message_due() && credits[i].try_take_control() {
                        let owed = credits[i].take_owed();
                        wire[i].push((false, owed));
                    }
                }
            }
        }
        assert_eq!(
            delivered,
            [300, 500],
            "every message delivered, no deadlock"
        );
    }
}
