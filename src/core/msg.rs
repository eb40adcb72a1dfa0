//! The per-message header of the connection protocol, carried entirely in the 32-bit immediate
//! data of each SEND (so payload bytes stay the user's and a receive buffer needs no header
//! room).
//!
//! ```text
//!  31      28 27            16 15                     0
//! +----------+----------------+------------------------+
//! |   kind   |  reserved (0)  |   credits returned     |
//! +----------+----------------+------------------------+
//! ```
//!
//! # Examples
//!
//! ```
//! use tokio_rdma::core::{MsgHeader, MsgKind};
//! let h = MsgHeader { kind: MsgKind::Last, credits: 7 };
//! assert_eq!(MsgHeader::decode(h.encode()).unwrap(), h);
//! assert!(MsgHeader::decode(0xf000_0000).is_err());
//! ```
#![forbid(unsafe_code)]

use crate::error::{Error, Result};

/// What a message is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MsgKind {
    /// The last (or only) chunk of a user message.
    Last,
    /// A chunk of a user message that continues in the next one.
    More,
    /// No payload: only returns credits (also used as a keepalive).
    Credit,
    /// The sender closed its side: no more messages follow (end of stream).
    Close,
}

impl MsgKind {
    fn code(self) -> u32 {
        match self {
            MsgKind::Last => 0,
            MsgKind::More => 1,
            MsgKind::Credit => 2,
            MsgKind::Close => 3,
        }
    }
}

/// A decoded immediate-data header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MsgHeader {
    /// What the message is.
    pub kind: MsgKind,
    /// Credits the sender returns with it.
    pub credits: u16,
}

impl MsgHeader {
    /// Encodes into immediate data (host order; the verbs layer converts to network order).
    pub fn encode(&self) -> u32 {
        (self.kind.code() << 28) | u32::from(self.credits)
    }

    /// Decodes immediate data.
    ///
    /// # Errors
    ///
    /// [`Error::Protocol`] for an unknown kind or non-zero reserved bits: the peer does not
    /// speak this protocol version.
    pub fn decode(imm: u32) -> Result<MsgHeader> {
        let kind = match imm >> 28 {
            0 => MsgKind::Last,
            1 => MsgKind::More,
            2 => MsgKind::Credit,
            3 => MsgKind::Close,
            k => {
                return Err(Error::Protocol(format!(
                    "unknown message kind {k} in immediate {imm:#010x}"
                )));
            }
        };
        if imm & 0x0fff_0000 != 0 {
            return Err(Error::Protocol(format!(
                "reserved header bits set in immediate {imm:#010x}"
            )));
        }
        Ok(MsgHeader {
            kind,
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
        ] {
            for credits in [0u16, 1, 255, u16::MAX] {
                let h = MsgHeader { kind, credits };
                assert_eq!(MsgHeader::decode(h.encode()).unwrap(), h);
            }
        }
    }

    #[test]
    fn rejects_unknown_kinds_and_reserved_bits() {
        assert!(MsgHeader::decode(4 << 28).is_err());
        assert!(
            MsgHeader::decode(0x0001_0000)
                .unwrap_err()
                .to_string()
                .contains("reserved")
        );
    }
}
