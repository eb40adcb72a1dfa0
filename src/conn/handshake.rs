//! The connection handshake: the parameters each side announces in the RDMA CM private data of
//! `rdma_connect` (client) and `rdma_accept` (server), their wire encoding, validation, and
//! [`negotiate`].
//!
//! Pure logic: no FFI, no I/O, no `unsafe`. Malformed input gets a typed error naming the
//! offending field before any queue pair is used for data.
//!
//! # Wire format (version 2)
//!
//! Version 2 is the message protocol of `docs/connections.md` (control window,
//! abort and error messages); version 1 peers are refused. The layout is unchanged.
//!
//! 32 bytes, big endian, well under the 56 bytes of private data an RC connect request carries
//! on InfiniBand and RoCE (the accept reply allows 196):
//!
//! | offset | size | field                                                           |
//! |-------:|-----:|-----------------------------------------------------------------|
//! | 0      | 4    | magic `b"TRDM"`                                                 |
//! | 4      | 1    | version (2)                                                     |
//! | 5      | 1    | encoded length (32; 28 without the last field; later revisions may append) |
//! | 6      | 2    | flags ([`Flags`])                                               |
//! | 8      | 4    | receive credits: receive buffers posted for the peer            |
//! | 12     | 4    | receive buffer size: the largest message one receive takes      |
//! | 16     | 4    | max inline: the largest payload this side sends inline          |
//! | 20     | 8    | max message size: the largest message this side accepts in total |
//! | 28     | 4    | initial credits: of the receive credits, those usable at once   |
//!
//! The transport pads private data with zeros (an InfiniBand connect request always delivers
//! 56 bytes, an accept reply 196): bytes after the encoded length are ignored.
//!
//! # Examples
//!
//! ```
//! use tokio_rdma::conn::handshake::{negotiate, Params};
//!
//! let client = Params { recv_credits: 32, ..Params::default() };
//! let wire = client.encode()?;
//! // What the server's CONNECT_REQUEST event carries: the bytes, zero-padded to 56.
//! let mut private_data = wire.to_vec();
//! private_data.resize(56, 0);
//! let seen = Params::decode(&private_data)?;
//! assert_eq!(seen, client);
//! let server = Params::default();
//! let eff = negotiate(&server, &seen)?;
//! assert_eq!(eff.send_credits, 32);
//! # Ok::<(), tokio_rdma::conn::handshake::HandshakeError>(())
//! ```

#![forbid(unsafe_code)]

use std::fmt;
use std::ops::BitOr;

/// The first four bytes of every handshake.
pub const MAGIC: [u8; 4] = *b"TRDM";
/// The handshake version this crate speaks.
pub const VERSION: u8 = 2;
/// Length of the encoding this crate sends (the initial-credits field appended to the
/// 28-byte base; a 28-byte handshake means initial credits = receive credits).
pub const ENCODED_LEN: usize = 32;
/// Length of the base encoding every version-2 handshake has.
pub const BASE_LEN: usize = 28;
/// Private data an RC connect request carries on InfiniBand/RoCE (`rdma_connect(3)`); the
/// encoding must fit.
pub const MAX_CONNECT_PRIVATE_DATA: usize = 56;
/// Fewest receive credits a side may announce: 2, so a sender always has a chunk in flight
/// while the previous chunk's credit returns. (Control messages have receives of their own on
/// top of the credits; see `docs/connections.md`.)
pub const MIN_CREDITS: u32 = 2;
/// Largest number of receive credits a side may announce.
pub const MAX_CREDITS: u32 = 65_535;
/// Smallest receive buffer size a side may announce.
pub const MIN_RECV_BUF_SIZE: u32 = 64;
/// Largest receive buffer size a side may announce (16 MiB).
pub const MAX_RECV_BUF_SIZE: u32 = 16 << 20;
/// Largest inline size a side may announce (no device inlines anywhere near this).
pub const MAX_INLINE_LIMIT: u32 = 64 << 10;
/// Largest total message size a side may announce (1 TiB).
pub const MAX_MESSAGE_LIMIT: u64 = 1 << 40;

const _: () = assert!(ENCODED_LEN <= MAX_CONNECT_PRIVATE_DATA);

/// Capability and requirement bits of a handshake.
///
/// `ONE_SIDED` / `ATOMICS` say what this side offers: it grants the peer remote memory for
/// RDMA READ/WRITE, or for atomics. The `REQUIRE_*` bits say what this side needs the peer to
/// offer; [`negotiate`] fails if the peer does not. Unknown bits are rejected on decode.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Flags(u16);

impl Flags {
    /// No capabilities, no requirements.
    pub const NONE: Flags = Flags(0);
    /// This side grants remote memory for RDMA READ/WRITE.
    pub const ONE_SIDED: Flags = Flags(1 << 0);
    /// This side grants remote memory for atomics.
    pub const ATOMICS: Flags = Flags(1 << 1);
    /// This side takes part in rendezvous: it may send a large message as a descriptor of
    /// its memory for the peer to RDMA READ, and reads the messages the peer sends that way.
    /// Used when both sides set it.
    pub const RENDEZVOUS: Flags = Flags(1 << 2);
    /// This side needs the peer to offer [`ONE_SIDED`](Self::ONE_SIDED).
    pub const REQUIRE_ONE_SIDED: Flags = Flags(1 << 8);
    /// This side needs the peer to offer [`ATOMICS`](Self::ATOMICS).
    pub const REQUIRE_ATOMICS: Flags = Flags(1 << 9);
    /// Every bit this version defines.
    pub const KNOWN: Flags = Flags(0x0307);

    /// The raw bits.
    pub const fn bits(self) -> u16 {
        self.0
    }

    /// The flags for `bits`, or `None` if an unknown bit is set.
    pub const fn from_bits(bits: u16) -> Option<Flags> {
        if bits & !Self::KNOWN.0 == 0 {
            Some(Flags(bits))
        } else {
            None
        }
    }

    /// Whether every bit of `other` is set in `self`.
    pub const fn contains(self, other: Flags) -> bool {
        self.0 & other.0 == other.0
    }
}

impl BitOr for Flags {
    type Output = Flags;
    fn bitor(self, rhs: Flags) -> Flags {
        Flags(self.0 | rhs.0)
    }
}

impl fmt::Debug for Flags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = [
            (Flags::ONE_SIDED, "ONE_SIDED"),
            (Flags::ATOMICS, "ATOMICS"),
            (Flags::RENDEZVOUS, "RENDEZVOUS"),
            (Flags::REQUIRE_ONE_SIDED, "REQUIRE_ONE_SIDED"),
            (Flags::REQUIRE_ATOMICS, "REQUIRE_ATOMICS"),
        ];
        let mut first = true;
        for (flag, name) in names {
            if self.contains(flag) {
                f.write_str(if first { "" } else { " | " })?;
                f.write_str(name)?;
                first = false;
            }
        }
        let unknown = self.0 & !Flags::KNOWN.0;
        if unknown != 0 {
            write!(f, "{}{unknown:#06x}", if first { "" } else { " | " })?;
            first = false;
        }
        if first {
            f.write_str("NONE")?;
        }
        Ok(())
    }
}

/// The parameters one side announces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Params {
    /// Capabilities and requirements.
    pub flags: Flags,
    /// Receive buffers this side keeps posted for the peer's data: the peer may have this many
    /// chunks in flight ([`MIN_CREDITS`]..=[`MAX_CREDITS`]; control messages have a few more
    /// receives of their own).
    pub recv_credits: u32,
    /// Size of each posted receive buffer: the largest message the peer may send in one SEND
    /// ([`MIN_RECV_BUF_SIZE`]..=[`MAX_RECV_BUF_SIZE`]).
    pub recv_buf_size: u32,
    /// The largest payload this side sends inline (0..=[`MAX_INLINE_LIMIT`]).
    pub max_inline: u32,
    /// The largest message this side accepts in total, e.g. through one-sided transfers
    /// (`recv_buf_size..=`[`MAX_MESSAGE_LIMIT`]).
    pub max_message_size: u64,
    /// Of `recv_credits`, how many the peer may use at the start (`1..=recv_credits`); the
    /// rest this side grants later, as it finds receive buffers for them (a connection on a
    /// shared receive queue). `None`: all of them.
    pub initial_credits: Option<u32>,
}

impl Default for Params {
    /// 64 credits of 4 KiB receive buffers, 64 bytes inline, messages up to 1 MiB, one-sided
    /// access offered.
    fn default() -> Params {
        Params {
            flags: Flags::ONE_SIDED,
            recv_credits: 64,
            recv_buf_size: 4096,
            max_inline: 64,
            max_message_size: 1 << 20,
            initial_credits: None,
        }
    }
}

// The error types are defined with the crate's errors (below every layer that reports them)
// and are public here, where the handshake is.
pub use crate::error::handshake::{Feature, Field, HandshakeError, Side};

fn invalid(field: Field, value: u64, reason: &'static str) -> HandshakeError {
    HandshakeError::InvalidField {
        field,
        value,
        reason,
    }
}

impl Params {
    /// Checks every field against its bounds: no unknown flag bits;
    /// [`MIN_CREDITS`]..=[`MAX_CREDITS`] receive credits; a receive buffer size within
    /// [`MIN_RECV_BUF_SIZE`]..=[`MAX_RECV_BUF_SIZE`]; at most [`MAX_INLINE_LIMIT`] inline; a
    /// message size limit from the receive buffer size up to [`MAX_MESSAGE_LIMIT`].
    ///
    /// # Errors
    ///
    /// [`HandshakeError::InvalidField`] naming the first offending field.
    ///
    /// # Examples
    ///
    /// ```
    /// use tokio_rdma::conn::handshake::{Field, HandshakeError, Params};
    ///
    /// let one_credit = Params { recv_credits: 1, ..Params::default() };
    /// match one_credit.validate() {
    ///     Err(HandshakeError::InvalidField { field: Field::RecvCredits, value: 1, .. }) => {}
    ///     other => panic!("{other:?}"),
    /// }
    /// assert!(Params { recv_credits: 2, ..Params::default() }.validate().is_ok());
    /// ```
    pub fn validate(&self) -> Result<(), HandshakeError> {
        let flags = self.flags.bits();
        if Flags::from_bits(flags).is_none() {
            return Err(invalid(
                Field::Flags,
                u64::from(flags),
                "unknown flag bits set",
            ));
        }
        let credits = u64::from(self.recv_credits);
        if self.recv_credits == 0 {
            return Err(invalid(
                Field::RecvCredits,
                credits,
                "zero credits: the peer could never send",
            ));
        }
        if self.recv_credits < MIN_CREDITS {
            return Err(invalid(
                Field::RecvCredits,
                credits,
                "fewer than 2: the protocol keeps a chunk in flight while the previous credit returns",
            ));
        }
        if self.recv_credits > MAX_CREDITS {
            return Err(invalid(Field::RecvCredits, credits, "more than 65535"));
        }
        let size = u64::from(self.recv_buf_size);
        if self.recv_buf_size < MIN_RECV_BUF_SIZE {
            return Err(invalid(Field::RecvBufSize, size, "smaller than 64 bytes"));
        }
        if self.recv_buf_size > MAX_RECV_BUF_SIZE {
            return Err(invalid(Field::RecvBufSize, size, "larger than 16 MiB"));
        }
        if let Some(initial) = self.initial_credits {
            if initial == 0 || initial > self.recv_credits {
                return Err(invalid(
                    Field::InitialCredits,
                    u64::from(initial),
                    "not in 1..=recv_credits",
                ));
            }
        }
        if self.max_inline > MAX_INLINE_LIMIT {
            return Err(invalid(
                Field::MaxInline,
                u64::from(self.max_inline),
                "larger than 64 KiB",
            ));
        }
        if self.max_message_size < size {
            return Err(invalid(
                Field::MaxMessageSize,
                self.max_message_size,
                "smaller than the receive buffer size",
            ));
        }
        if self.max_message_size > MAX_MESSAGE_LIMIT {
            return Err(invalid(
                Field::MaxMessageSize,
                self.max_message_size,
                "larger than 1 TiB",
            ));
        }
        Ok(())
    }

    /// The credits the peer may use at the start.
    pub fn initial(&self) -> u32 {
        self.initial_credits.unwrap_or(self.recv_credits)
    }

    /// Validates and encodes the parameters ([`VERSION`], [`ENCODED_LEN`] bytes).
    ///
    /// # Errors
    ///
    /// [`HandshakeError::InvalidField`] if a field is out of bounds: invalid parameters are
    /// never put on the wire.
    pub fn encode(&self) -> Result<[u8; ENCODED_LEN], HandshakeError> {
        self.validate()?;
        let mut b = [0u8; ENCODED_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        b[5] = ENCODED_LEN as u8;
        b[6..8].copy_from_slice(&self.flags.bits().to_be_bytes());
        b[8..12].copy_from_slice(&self.recv_credits.to_be_bytes());
        b[12..16].copy_from_slice(&self.recv_buf_size.to_be_bytes());
        b[16..20].copy_from_slice(&self.max_inline.to_be_bytes());
        b[20..28].copy_from_slice(&self.max_message_size.to_be_bytes());
        b[28..32].copy_from_slice(&self.initial().to_be_bytes());
        Ok(b)
    }

    /// Decodes and validates a handshake from private data. Bytes after the encoded length
    /// (transport padding, or fields of a compatible later revision) are ignored.
    ///
    /// # Errors
    ///
    /// [`HandshakeError::Missing`] for empty or all-zero input, [`Truncated`], [`BadMagic`],
    /// [`UnsupportedVersion`], or [`InvalidField`] naming the field.
    ///
    /// [`Truncated`]: HandshakeError::Truncated
    /// [`BadMagic`]: HandshakeError::BadMagic
    /// [`UnsupportedVersion`]: HandshakeError::UnsupportedVersion
    /// [`InvalidField`]: HandshakeError::InvalidField
    pub fn decode(input: &[u8]) -> Result<Params, HandshakeError> {
        if input.iter().all(|&b| b == 0) {
            return Err(HandshakeError::Missing);
        }
        let truncated = |needed: usize| HandshakeError::Truncated {
            needed,
            got: input.len(),
        };
        let Some(magic) = input.get(0..4) else {
            return Err(truncated(ENCODED_LEN));
        };
        if magic != MAGIC {
            let mut found = [0u8; 4];
            found.copy_from_slice(magic);
            return Err(HandshakeError::BadMagic { found });
        }
        let Some(&version) = input.get(4) else {
            return Err(truncated(ENCODED_LEN));
        };
        if version != VERSION {
            return Err(HandshakeError::UnsupportedVersion {
                found: version,
                supported: VERSION,
            });
        }
        let Some(&len) = input.get(5) else {
            return Err(truncated(ENCODED_LEN));
        };
        let len = usize::from(len);
        if len < BASE_LEN {
            return Err(invalid(
                Field::EncodedLen,
                len as u64,
                "shorter than the 28-byte encoding",
            ));
        }
        if input.len() < len {
            return Err(truncated(len));
        }
        let be16 = |at: usize| u16::from_be_bytes([input[at], input[at + 1]]);
        let be32 = |at: usize| {
            u32::from_be_bytes([input[at], input[at + 1], input[at + 2], input[at + 3]])
        };
        let be64 = |at: usize| (u64::from(be32(at)) << 32) | u64::from(be32(at + 4));
        let params = Params {
            flags: Flags(be16(6)),
            recv_credits: be32(8),
            recv_buf_size: be32(12),
            max_inline: be32(16),
            max_message_size: be64(20),
            initial_credits: None,
        };
        let initial = if len >= 32 {
            be32(28)
        } else {
            params.recv_credits
        };
        let params = Params {
            initial_credits: (initial != params.recv_credits).then_some(initial),
            ..params
        };
        params.validate()?;
        Ok(params)
    }
}

/// The effective parameters of a connection, from this side's point of view.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Negotiated {
    /// Sends this side may have in flight: the peer's receive credits.
    pub send_credits: u32,
    /// Of `send_credits`, those this side holds at the start (the peer grants the rest later).
    pub send_initial_credits: u32,
    /// Of `recv_credits`, those the peer holds at the start.
    pub recv_initial_credits: u32,
    /// Receive buffers this side keeps posted: its own receive credits.
    pub recv_credits: u32,
    /// The largest single SEND this side makes (one chunk of a message; larger messages are
    /// chunked): the peer's receive buffer size ([`negotiate`]); a connection caps it with
    /// its local limit ([`ConnectOptions::max_send_chunk`](super::ConnectOptions::max_send_chunk)).
    /// The connection stages its sends in buffers of this size, apart from its receive
    /// buffers.
    pub max_send_size: u32,
    /// The size of this side's receive buffers.
    pub recv_buf_size: u32,
    /// The largest payload this side sends inline: its own limit, capped by what one peer
    /// receive takes.
    pub max_inline: u32,
    /// The largest message either side may transfer in total: the smaller announcement.
    pub max_message_size: u64,
    /// Both sides offer one-sided access.
    pub one_sided: bool,
    /// Both sides offer atomics.
    pub atomics: bool,
    /// The peer offers one-sided access: this side may READ/WRITE memory the peer grants.
    pub peer_one_sided: bool,
    /// The peer offers atomics: this side may run atomics on memory the peer grants.
    pub peer_atomics: bool,
    /// Both sides take part in rendezvous: large messages may go as descriptors the
    /// receiver reads from.
    pub rendezvous: bool,
}

/// Computes the effective parameters of a connection from this side's announcement (`local`)
/// and the peer's (`remote`). Symmetric: the peer computes the mirror image.
///
/// # Errors
///
/// [`HandshakeError::InvalidField`] if either side's parameters are out of bounds;
/// [`HandshakeError::Incompatible`] if a side requires a feature the other does not offer.
pub fn negotiate(local: &Params, remote: &Params) -> Result<Negotiated, HandshakeError> {
    local.validate()?;
    remote.validate()?;
    let requirements = [
        (
            Flags::REQUIRE_ONE_SIDED,
            Flags::ONE_SIDED,
            Feature::OneSided,
        ),
        (Flags::REQUIRE_ATOMICS, Flags::ATOMICS, Feature::Atomics),
    ];
    for (require, offer, feature) in requirements {
        if local.flags.contains(require) && !remote.flags.contains(offer) {
            return Err(HandshakeError::Incompatible {
                required_by: Side::Local,
                feature,
            });
        }
        if remote.flags.contains(require) && !local.flags.contains(offer) {
            return Err(HandshakeError::Incompatible {
                required_by: Side::Remote,
                feature,
            });
        }
    }
    let both = |f: Flags| local.flags.contains(f) && remote.flags.contains(f);
    Ok(Negotiated {
        send_credits: remote.recv_credits,
        send_initial_credits: remote.initial(),
        recv_credits: local.recv_credits,
        recv_initial_credits: local.initial(),
        max_send_size: remote.recv_buf_size,
        recv_buf_size: local.recv_buf_size,
        max_inline: local.max_inline.min(remote.recv_buf_size),
        max_message_size: local.max_message_size.min(remote.max_message_size),
        one_sided: both(Flags::ONE_SIDED),
        atomics: both(Flags::ATOMICS),
        peer_one_sided: remote.flags.contains(Flags::ONE_SIDED),
        peer_atomics: remote.flags.contains(Flags::ATOMICS),
        rendezvous: both(Flags::RENDEZVOUS),
    })
}

#[cfg(test)]
mod tests;
