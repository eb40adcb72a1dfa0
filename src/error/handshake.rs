//! Why a handshake was rejected ([`HandshakeError`]) and the names it uses. Public as
//! [`conn::handshake`](crate::conn::handshake)'s; defined here, with the crate's errors, so
//! that [`Error::Handshake`](crate::Error::Handshake) needs nothing above this module.

use std::fmt;

/// A field of the handshake, as named in errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Field {
    /// The encoded-length byte.
    EncodedLen,
    /// [`Params::flags`](crate::conn::handshake::Params::flags).
    Flags,
    /// [`Params::recv_credits`](crate::conn::handshake::Params::recv_credits).
    RecvCredits,
    /// [`Params::recv_buf_size`](crate::conn::handshake::Params::recv_buf_size).
    RecvBufSize,
    /// [`Params::max_inline`](crate::conn::handshake::Params::max_inline).
    MaxInline,
    /// [`Params::max_message_size`](crate::conn::handshake::Params::max_message_size).
    MaxMessageSize,
    /// [`Params::initial_credits`](crate::conn::handshake::Params::initial_credits).
    InitialCredits,
}

impl fmt::Display for Field {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Field::EncodedLen => "encoded_len",
            Field::Flags => "flags",
            Field::RecvCredits => "recv_credits",
            Field::InitialCredits => "initial_credits",
            Field::RecvBufSize => "recv_buf_size",
            Field::MaxInline => "max_inline",
            Field::MaxMessageSize => "max_message_size",
        })
    }
}

/// Which side of a negotiation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    /// This side.
    Local,
    /// The peer.
    Remote,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Local => "this side",
            Side::Remote => "the peer",
        })
    }
}

/// A capability one side may require of the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Feature {
    /// RDMA READ/WRITE into granted memory.
    OneSided,
    /// Remote atomics.
    Atomics,
}

impl fmt::Display for Feature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Feature::OneSided => "one-sided access (RDMA READ/WRITE)",
            Feature::Atomics => "remote atomics",
        })
    }
}

/// Why a handshake was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    /// The private data is empty or all zeros: the peer sent no handshake.
    #[error("no handshake: the peer sent no private data")]
    Missing,
    /// The input ends before the encoded length.
    #[error("truncated: {got} bytes, need {needed}")]
    Truncated {
        /// Bytes needed.
        needed: usize,
        /// Bytes present.
        got: usize,
    },
    /// The magic is wrong: the peer does not speak this protocol.
    #[error("bad magic \"{}\" (expected \"TRDM\"): not a tokio-rdma peer", found.escape_ascii())]
    BadMagic {
        /// The first four bytes received.
        found: [u8; 4],
    },
    /// The version is not one this side speaks.
    #[error("unsupported version {found} (this side speaks version {supported})")]
    UnsupportedVersion {
        /// The version received.
        found: u8,
        /// The version this side speaks.
        supported: u8,
    },
    /// A field holds an invalid value.
    #[error("invalid {field}: {value} ({reason})")]
    InvalidField {
        /// The offending field.
        field: Field,
        /// Its value.
        value: u64,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// Both sides are well-formed but cannot talk to each other.
    #[error(
        "incompatible peer: {required_by} requires {feature}, which the other side does not offer"
    )]
    Incompatible {
        /// The side that requires the feature.
        required_by: Side,
        /// The feature.
        feature: Feature,
    },
}
