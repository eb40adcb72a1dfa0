//! The per-message header of the connection protocol, carried entirely in the 32-bit immediate
//! data of each SEND (so payload bytes stay the user's and a receive buffer needs no header
//! room).
//!
//! ```text
//!  31      28 27    24 23        16 15                     0
//! +----------+--------+------------+------------------------+
//! |   kind   | rsvd 0 |  ctrl ack  |  credits returned, or  |
//! |          |        |  (mod 256) |  the error code        |
//! +----------+--------+------------+------------------------+
//! ```
//!
//! `ctrl ack` counts (mod 256) the control messages of the peer whose receives this side has
//! re-posted: it bounds the peer's control messages in flight (see
//! [`Credits`](crate::proto::Credits)).
//!
//! Kinds: `Last` (the last or only chunk of a message), `More` (a chunk that continues),
//! `Credit` (no payload: returns credits), `Close` (end of stream), `Abort` (the message in
//! progress is withdrawn: its chunks so far are discarded), `Error` (the sender found a
//! protocol violation and is disconnecting; the low 16 bits carry a
//! [`ProtocolError`] code instead of credits), `Rendezvous` (a large message by reference: the
//! payload is a 24-byte descriptor of the sender's memory, which the receiver RDMA READs),
//! `Fetched` (the receiver read the oldest rendezvous message: the sender may release its
//! memory; the low 16 bits carry that message's rendezvous number instead of credits).
//!
//! # Examples
//!
//! (Not a doc test: the module is private; its unit tests make the same calls.)
//!
//! ```ignore
//! use crate::proto::{MsgHeader, MsgKind};
//! let h = MsgHeader { kind: MsgKind::Last, ctrl_ack: 3, credits: 7 };
//! assert_eq!(MsgHeader::decode(h.encode()).unwrap(), h);
//! assert!(MsgHeader::decode(0xf000_0000).is_err());
//! ```
#![forbid(unsafe_code)]

use crate::error::ProtocolError;

/// What a message is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MsgKind {
    /// The last (or only) chunk of a user message.
    Last,
    /// A chunk of a user message that continues in the next one.
    More,
    /// No payload: only returns credits.
    Credit,
    /// The sender closed its side: no more messages follow (end of stream).
    Close,
    /// The sender withdrew the message in progress (its send was cancelled part-way): the
    /// receiver discards the chunks received so far.
    Abort,
    /// The sender detected a protocol violation (code in the low 16 bits) and disconnects.
    Error,
    /// A whole message by reference: the payload is a rendezvous descriptor (address, length,
    /// rkey of the sender's memory); the receiver RDMA READs the message from there.
    Rendezvous,
    /// The receiver finished reading a rendezvous message (its number, mod 2^16, in the low
    /// 16 bits): the sender's memory is released.
    Fetched,
}

impl MsgKind {
    fn code(self) -> u32 {
        match self {
            MsgKind::Last => 0,
            MsgKind::More => 1,
            MsgKind::Credit => 2,
            MsgKind::Close => 3,
            MsgKind::Abort => 4,
            MsgKind::Error => 5,
            MsgKind::Rendezvous => 6,
            MsgKind::Fetched => 7,
        }
    }

    /// Whether the kind takes a data credit (a chunk of a message, or a rendezvous
    /// descriptor).
    pub fn is_data(self) -> bool {
        matches!(self, MsgKind::Last | MsgKind::More | MsgKind::Rendezvous)
    }
}

/// A decoded immediate-data header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MsgHeader {
    /// What the message is.
    pub kind: MsgKind,
    /// The peer's control messages the sender has re-posted receives for (mod 256).
    pub ctrl_ack: u8,
    /// Credits the sender returns with it (for [`MsgKind::Error`]: the error code; for
    /// [`MsgKind::Fetched`]: the rendezvous number).
    pub credits: u16,
}

impl MsgHeader {
    /// Encodes into immediate data (host order; the verbs layer converts to network order).
    pub fn encode(&self) -> u32 {
        (self.kind.code() << 28) | (u32::from(self.ctrl_ack) << 16) | u32::from(self.credits)
    }

    /// Decodes immediate data.
    ///
    /// # Errors
    ///
    /// [`ProtocolError::BadHeader`] for an unknown kind or non-zero reserved bits: the peer
    /// does not speak this protocol version.
    pub fn decode(imm: u32) -> Result<MsgHeader, ProtocolError> {
        let kind = match imm >> 28 {
            0 => MsgKind::Last,
            1 => MsgKind::More,
            2 => MsgKind::Credit,
            3 => MsgKind::Close,
            4 => MsgKind::Abort,
            5 => MsgKind::Error,
            6 => MsgKind::Rendezvous,
            7 => MsgKind::Fetched,
            _ => return Err(ProtocolError::BadHeader(imm)),
        };
        if imm & 0x0f00_0000 != 0 {
            return Err(ProtocolError::BadHeader(imm));
        }
        Ok(MsgHeader {
            kind,
            ctrl_ack: (imm >> 16) as u8,
            credits: (imm & 0xffff) as u16,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_every_kind() {
        for kind in [
            MsgKind::Last,
            MsgKind::More,
            MsgKind::Credit,
            MsgKind::Close,
            MsgKind::Abort,
            MsgKind::Error,
            MsgKind::Rendezvous,
            MsgKind::Fetched,
        ] {
            for credits in [0u16, 1, 255, u16::MAX] {
                let h = MsgHeader {
                    kind,
                    ctrl_ack: credits as u8 ^ 0x5a,
                    credits,
                };
                assert_eq!(MsgHeader::decode(h.encode()).unwrap(), h);
            }
        }
    }

    #[test]
    fn rejects_unknown_kinds_and_reserved_bits() {
        assert_eq!(
            MsgHeader::decode(8 << 28),
            Err(ProtocolError::BadHeader(8 << 28))
        );
        assert!(MsgHeader::decode(0x0100_0000).is_err());
    }
}
