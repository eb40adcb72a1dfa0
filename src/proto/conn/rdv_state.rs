//! Rendezvous state: the descriptor ([`RemoteMsg`]) and the bookkeeping of both directions
//! ([`RdvSend`], [`RdvRecv`]); the protocol's rendezvous steps are in `rendezvous.rs`.

use std::collections::VecDeque;
use std::task::Waker;

use crate::error::ProtocolError;

/// Unacknowledged rendezvous messages a sender may have.
pub const RDV_WINDOW: u32 = 8;

/// Length of a rendezvous descriptor: address (8), length (8), rkey (4), reserved zero (4),
/// big endian.
pub const DESCRIPTOR_LEN: u32 = 24;

/// A rendezvous message as the receiver sees it: where to read it from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteMsg {
    /// The sender's address of the message.
    pub addr: u64,
    /// The message's length.
    pub len: u64,
    /// The key to read it with (valid on this connection only, until acknowledged).
    pub rkey: u32,
    /// Its rendezvous number (mod 2^16), echoed in `Fetched`.
    pub seq: u16,
}

impl RemoteMsg {
    /// The descriptor's wire form.
    ///
    /// # Examples
    ///
    /// ```
    /// use tokio_rdma::conn::wire::{DESCRIPTOR_LEN, RemoteMsg};
    /// let d = RemoteMsg::encode(0x1000, 1 << 20, 0x42);
    /// assert_eq!(d.len(), DESCRIPTOR_LEN as usize);
    /// assert_eq!(&d[16..20], &0x42u32.to_be_bytes());
    /// ```
    pub fn encode(addr: u64, len: u64, rkey: u32) -> [u8; DESCRIPTOR_LEN as usize] {
        let mut b = [0u8; DESCRIPTOR_LEN as usize];
        b[0..8].copy_from_slice(&addr.to_be_bytes());
        b[8..16].copy_from_slice(&len.to_be_bytes());
        b[16..20].copy_from_slice(&rkey.to_be_bytes());
        b
    }

    /// The decoder of a received descriptor, for the fuzz targets only (`fuzz-internals`):
    /// `seq` is the receiver's count, not a wire field.
    #[cfg(feature = "fuzz-internals")]
    #[doc(hidden)]
    pub fn decode_received(b: &[u8], seq: u16) -> Result<RemoteMsg, ProtocolError> {
        Self::decode(b, seq)
    }

    pub(super) fn decode(b: &[u8], seq: u16) -> Result<RemoteMsg, ProtocolError> {
        if b.len() != DESCRIPTOR_LEN as usize || b[20..24] != [0; 4] {
            return Err(ProtocolError::BadDescriptor);
        }
        let word = |r: std::ops::Range<usize>| {
            let mut w = [0u8; 8];
            w[8 - r.len()..].copy_from_slice(&b[r]);
            u64::from_be_bytes(w)
        };
        let len = word(8..16);
        if len == 0 {
            return Err(ProtocolError::BadDescriptor);
        }
        Ok(RemoteMsg {
            addr: word(0..8),
            len,
            rkey: word(16..20) as u32,
            seq,
        })
    }
}

#[derive(Debug)]
pub(super) struct RdvOut {
    pub(super) id: u64,
    pub(super) seq: u16,
    pub(super) len: u64,
    pub(super) waker: Option<Waker>,
    pub(super) acked: bool,
    /// The send was dropped: forget the entry once acknowledged.
    pub(super) abandoned: bool,
}

/// The sending side's rendezvous messages whose descriptor went out.
#[derive(Debug, Default)]
pub(super) struct RdvSend {
    pub(super) next_seq: u16,
    pub(super) out: VecDeque<RdvOut>,
    pub(super) released: Vec<u16>,
}

impl RdvSend {
    pub(super) fn unacked(&self) -> u32 {
        self.out.iter().filter(|r| !r.acked).count() as u32
    }

    pub(super) fn has_room(&self) -> bool {
        self.unacked() < RDV_WINDOW
    }

    pub(super) fn abandon(&mut self, id: u64) {
        if let Some(pos) = self.out.iter().position(|r| r.id == id) {
            if self.out[pos].acked {
                self.out.remove(pos);
            } else {
                self.out[pos].abandoned = true;
                self.out[pos].waker = None;
            }
        }
    }

    pub(super) fn wake_all(&mut self, out: &mut Vec<Waker>) {
        out.extend(self.out.iter_mut().filter_map(|r| r.waker.take()));
    }
}

/// The receiving side's rendezvous state.
#[derive(Debug, Default)]
pub(super) struct RdvRecv {
    pub(super) next_seq: u16,
    /// Descriptors received and not yet acknowledged.
    pub(super) unacked: u32,
    /// The rendezvous message being read (handed out by `poll_recv`), and whether the read is
    /// done.
    pub(super) fetching: Option<(RemoteMsg, bool)>,
    /// `Fetched` acknowledgements to send, oldest first.
    pub(super) acks: VecDeque<u16>,
}

impl RdvRecv {
    pub(super) fn ack_due(&self) -> Option<u16> {
        self.acks.front().copied()
    }

    pub(super) fn ack_sent(&mut self) {
        self.acks.pop_front();
    }
}
