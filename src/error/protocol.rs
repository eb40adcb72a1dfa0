//! [`ProtocolError`]: how a peer broke the connection protocol, and its wire codes.

/// How a peer broke the connection protocol. Carried by [`QpFailure::Protocol`](super::QpFailure::Protocol) (detected
/// locally) and [`QpFailure::PeerReported`](super::QpFailure::PeerReported) (the peer's verdict on this side).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolError {
    /// A message arrived without immediate data (every message of the protocol has a header
    /// there).
    #[error("a message arrived without immediate data")]
    NoImmediate,
    /// The header names an unknown message kind or sets reserved bits.
    #[error("malformed message header {0:#010x}")]
    BadHeader(u32),
    /// A data message consumed the receive the peer must keep for control messages: it sent
    /// more than its credits.
    #[error("the peer sent data beyond its credits")]
    CreditOverrun,
    /// A message grew past the negotiated maximum message size.
    #[error("a message exceeded the negotiated maximum of {0} bytes")]
    MessageTooLarge(u64),
    /// A control message (credit, close, abort) carried a payload.
    #[error("a control message carried {0} payload bytes")]
    ControlWithPayload(u32),
    /// An abort arrived with no message in progress.
    #[error("an abort arrived with no message in progress")]
    StrayAbort,
    /// End of stream arrived in the middle of a message.
    #[error("the peer closed in the middle of a message")]
    CloseMidMessage,
    /// A message arrived after the peer's end of stream.
    #[error("a message arrived after end of stream")]
    DataAfterClose,
    /// The peer returned more credits than this side ever granted.
    #[error("the peer returned more credits than were granted")]
    CreditInflation,
    /// A rendezvous descriptor that is not 24 bytes, sets reserved bits, or describes an empty
    /// message.
    #[error("a malformed rendezvous descriptor")]
    BadDescriptor,
    /// A rendezvous descriptor arrived in the middle of a chunked message.
    #[error("a rendezvous message arrived in the middle of a chunked message")]
    RendezvousMidMessage,
    /// A rendezvous descriptor arrived on a connection where this side did not offer
    /// rendezvous.
    #[error("a rendezvous message arrived although rendezvous was not negotiated")]
    RendezvousNotOffered,
    /// More rendezvous messages unacknowledged than the protocol's window allows.
    #[error("the peer exceeded the rendezvous window")]
    RendezvousOverrun,
    /// A `Fetched` acknowledgement for no rendezvous message in flight, or out of order.
    #[error("an acknowledgement for no rendezvous message in flight")]
    StrayFetched,
    /// An error code this version does not know (the peer's report).
    #[error("unknown protocol error code {0}")]
    Unknown(u16),
}

impl ProtocolError {
    /// The code carried on the wire in an error message.
    pub fn code(self) -> u16 {
        match self {
            ProtocolError::NoImmediate => 1,
            ProtocolError::BadHeader(_) => 2,
            ProtocolError::CreditOverrun => 3,
            ProtocolError::MessageTooLarge(_) => 4,
            ProtocolError::ControlWithPayload(_) => 5,
            ProtocolError::StrayAbort => 6,
            ProtocolError::CloseMidMessage => 7,
            ProtocolError::DataAfterClose => 8,
            ProtocolError::CreditInflation => 9,
            ProtocolError::BadDescriptor => 10,
            ProtocolError::RendezvousMidMessage => 11,
            ProtocolError::RendezvousNotOffered => 12,
            ProtocolError::RendezvousOverrun => 13,
            ProtocolError::StrayFetched => 14,
            ProtocolError::Unknown(c) => c,
        }
    }

    /// The error for a code received on the wire (details such as limits are not carried).
    pub fn from_code(code: u16) -> ProtocolError {
        match code {
            1 => ProtocolError::NoImmediate,
            2 => ProtocolError::BadHeader(0),
            3 => ProtocolError::CreditOverrun,
            4 => ProtocolError::MessageTooLarge(0),
            5 => ProtocolError::ControlWithPayload(0),
            6 => ProtocolError::StrayAbort,
            7 => ProtocolError::CloseMidMessage,
            8 => ProtocolError::DataAfterClose,
            9 => ProtocolError::CreditInflation,
            10 => ProtocolError::BadDescriptor,
            11 => ProtocolError::RendezvousMidMessage,
            12 => ProtocolError::RendezvousNotOffered,
            13 => ProtocolError::RendezvousOverrun,
            14 => ProtocolError::StrayFetched,
            c => ProtocolError::Unknown(c),
        }
    }
}
