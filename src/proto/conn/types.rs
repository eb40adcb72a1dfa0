//! The plain types of the connection protocol's API: its configuration, what it hands out
//! (chunks to send, control messages, deliveries) and its counters.

use std::time::Duration;

use super::rdv_state::RemoteMsg;
use crate::error::QpFailure;
use crate::proto::msg::MsgKind;

/// The parameters of one connection, from its handshake and options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnConfig {
    /// Data chunks this side may have outstanding: the peer's receive credits.
    pub send_credits: u32,
    /// Of `send_credits`, those usable at the start (the peer grants the rest later).
    pub send_initial: u32,
    /// Data receives this side keeps posted for the peer: its own receive credits.
    pub recv_credits: u32,
    /// Of `recv_credits`, those the peer may use at the start: the rest are posted (and
    /// granted) when the shell finds buffers for them ([`ConnProto::recvs_to_post`](super::ConnProto::recvs_to_post) asks for
    /// them from the start).
    pub recv_initial: u32,
    /// The largest chunk this side sends (the peer's receive buffer size).
    pub max_send_size: u32,
    /// The largest message in either direction.
    pub max_message_size: u64,
    /// Bytes of received data the application may hold before this side stops returning
    /// credits (at least `max_message_size`).
    pub recv_budget: u64,
    /// Send a keepalive this often (`None`: never).
    pub keepalive: Option<Duration>,
    /// Fail the connection when a control message or keepalive is unacknowledged this long.
    pub keepalive_timeout: Duration,
    /// Both sides offer rendezvous: large messages may go by reference (a descriptor the
    /// receiver RDMA READs from), see [`ConnProto::start_send_rendezvous`](super::ConnProto::start_send_rendezvous).
    pub rendezvous: bool,
    /// Once this side closed: how long what must go out before end of stream (queued
    /// messages waiting for credits, rendezvous messages the peer has not read yet) may take
    /// before the connection fails with [`QpFailure::CloseTimeout`] (a live peer that never
    /// reads or never acknowledges would otherwise keep the close, and the memory, forever).
    pub close_timeout: Duration,
}

/// A chunk of a message to post now: `len` bytes at `offset` of the message, as a SEND with
/// immediate data `imm`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    /// Offset of the chunk in the message.
    pub offset: u64,
    /// Length of the chunk.
    pub len: u32,
    /// The immediate data (header) to send it with.
    pub imm: u32,
    /// Whether this is the message's last chunk.
    pub last: bool,
    /// A rendezvous message: the chunk is its descriptor (`len` is
    /// [`DESCRIPTOR_LEN`](super::DESCRIPTOR_LEN)), and this is its rendezvous number. The memory it names must stay
    /// readable until [`ConnProto::take_released`](super::ConnProto::take_released) returns the number.
    pub rendezvous: Option<u16>,
}

/// A control message to post now: a zero-length SEND with immediate data `imm`. Report its
/// completion with [`ConnProto::handle_control_done`](super::ConnProto::handle_control_done).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transmit {
    /// What it is.
    pub kind: MsgKind,
    /// The immediate data (header).
    pub imm: u32,
}

/// A message ready for the application.
#[derive(Debug)]
pub enum Delivery<B> {
    /// A single-chunk message, still in its receive buffer (`len` bytes of it).
    Buf {
        /// The receive buffer.
        buf: B,
        /// Bytes of it that are the message.
        len: usize,
    },
    /// A message reassembled from several chunks.
    Assembled(Vec<u8>),
    /// A rendezvous message: the bytes are still in the peer's memory. The shell reads them
    /// and reports [`ConnProto::fetch_done`](super::ConnProto::fetch_done); until it takes the result
    /// ([`ConnProto::fetch_taken`](super::ConnProto::fetch_taken)) no later message is handed out.
    Remote(RemoteMsg),
}

impl<B> Delivery<B> {
    /// The message's length.
    pub fn len(&self) -> usize {
        match self {
            Delivery::Buf { len, .. } => *len,
            Delivery::Assembled(v) => v.len(),
            Delivery::Remote(r) => r.len as usize,
        }
    }

    /// Whether the message is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether it holds a receive buffer (report it with `consumed(true, ..)`).
    pub fn holds_buffer(&self) -> bool {
        matches!(self, Delivery::Buf { .. })
    }
}

/// Counters of one connection.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnCounters {
    /// User messages whose every chunk was handed out for sending.
    pub messages_sent: u64,
    /// User messages delivered.
    pub messages_received: u64,
    /// Payload bytes of the messages sent.
    pub bytes_sent: u64,
    /// Payload bytes of the messages delivered.
    pub bytes_received: u64,
    /// SENDs handed out (chunks and control messages).
    pub sends: u64,
    /// Receives completed.
    pub receives: u64,
    /// Credit messages (including keepalives) handed out.
    pub credit_messages: u64,
    /// Times a sender had to wait for a data credit.
    pub credit_waits: u64,
    /// Sends cancelled part-way (an abort went out).
    pub aborts_sent: u64,
    /// Partial messages the peer withdrew.
    pub aborts_received: u64,
    /// Data receives whose re-post waited for the application to consume (backpressure).
    pub reposts_withheld: u64,
    /// Messages sent by rendezvous (counted in `messages_sent` once the peer read them).
    pub rendezvous_sent: u64,
    /// Messages received by rendezvous (read from the peer's memory).
    pub rendezvous_received: u64,
    /// Bytes copied to reassemble chunked messages.
    pub bytes_reassembled: u64,
}
