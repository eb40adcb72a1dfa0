//! Connection options.

use std::time::Duration;

use super::handshake::{Flags, Params};
use crate::buf::{PoolConfig, SizeClass};
use crate::driver::CompletionMode;

/// Options of [`Connection::connect_with`](super::Connection::connect_with) and
/// [`Listener::bind_with`](super::Listener::bind_with).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use tokio_rdma::conn::ConnectOptions;
/// let opts = ConnectOptions::default()
///     .recv_credits(32)
///     .recv_buf_size(16 << 10)
///     .connect_timeout(Duration::from_secs(5))
///     .handshake_timeout(Duration::from_secs(3))
///     .backlog(16);
/// assert_eq!(opts.handshake().recv_credits, 32);
/// assert_eq!(opts.backlog, 16);
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ConnectOptions {
    /// What this side announces in the handshake (receive credits and buffer size, inline
    /// limit, message size limit, features).
    pub params: Params,
    /// Send-queue depth for one-sided operations (message sends have a share of their own).
    /// At least 2 (raised to it if smaller), at most 16,777,216 (refused above: no device has
    /// send queues that deep).
    pub send_queue_depth: u32,
    /// How waiting futures wait. It belongs to the endpoint: the shorthands
    /// ([`Connection::connect_with`](super::Connection::connect_with),
    /// [`Listener::bind_with`](super::Listener::bind_with)) open their endpoint with it;
    /// through an [`Endpoint`](crate::Endpoint), a mode other than the endpoint's is refused.
    /// `None` (the default): the endpoint's mode, adaptive for the shorthands.
    pub completion_mode: Option<CompletionMode>,
    /// Client side: the limit for the whole of [`Connection::connect`](super::Connection::connect)
    /// (address and route resolution, the handshake, establishing the connection).
    pub connect_timeout: Duration,
    /// Server side: the limit for one client's handshake, from its connection request to the
    /// established connection. A client that stalls or vanishes half-way is torn down after
    /// this long (sooner if the transport reports it gone), without delaying other clients.
    pub handshake_timeout: Duration,
    /// Server side: the most handshakes a [`Listener`](super::Listener) runs at once, and the
    /// capacity of its queue of established connections not yet taken by
    /// [`accept`](super::Listener::accept). A connection request beyond it is rejected at
    /// once, with the reason `"tokio-rdma: listener backlog full"` in the reject's private
    /// data. At least 1, at most 1,048,576.
    pub backlog: usize,
    /// Send a keepalive this often (None: never): a small control message the peer's device
    /// must acknowledge. Not zero (refused); an interval too long to add to the clock
    /// (`Duration::MAX`) also means never.
    pub keepalive: Option<Duration>,
    /// Fail the connection with [`QpFailure::KeepaliveTimeout`](crate::QpFailure) when a
    /// keepalive (or any control message) has been outstanding this long with no sign of life
    /// from the peer (no receive arrived, nothing completed). With `keepalive`, a peer that
    /// dies silently (no disconnect arrives) is detected within `keepalive + keepalive_timeout`;
    /// the transport's own retries (`ack_timeout`, `retry_count`) may detect it sooner. A slow
    /// but live peer is not declared dead. It also bounds how long a closed connection waits
    /// in the background for the peer's end of stream and the confirmations before it
    /// disconnects (docs/connections.md, "Close and failure"). Not zero (refused); a timeout
    /// too long to add to the clock (`Duration::MAX`) means no limit: the peer is never
    /// declared dead for silence.
    pub keepalive_timeout: Duration,
    /// After [`close`](super::Connection::close), [`shutdown`](super::Connection::shutdown)
    /// or dropping the connection: how long what must go out before end of stream may take
    /// (messages still waiting for the peer's credits, and rendezvous messages the peer has
    /// not read yet, whose memory stays registered until it has). A peer that is alive but
    /// never takes them (never returns a credit, never acknowledges a read) would otherwise
    /// keep the close waiting, the memory registered and the connection's task running for
    /// ever; after this long the connection fails with
    /// [`QpFailure::CloseTimeout`](crate::QpFailure::CloseTimeout) and is torn down. Default
    /// 30 s; `Duration::MAX` (too long to add to the clock) means no limit.
    pub close_timeout: Duration,
    /// Transport retries of the queue pair before a send fails with `IBV_WC_RETRY_EXC_ERR`
    /// (0-6; 7 would mean "retry forever" on some devices, soft-RoCE among them, so it is
    /// refused).
    pub retry_count: u8,
    /// Bytes of received data the application may hold (queued, or delivered and not yet
    /// dropped) before this side stops returning credits and the peer's sends wait. At least
    /// the negotiated maximum message size (raised to it if smaller).
    pub recv_budget: u64,
    /// Local ACK timeout code of the queue pair (4.096 us * 2^n; 17 is about 0.5 s); with the
    /// 7 transport retries it bounds how long a silently dead peer goes unnoticed (about 4 s at
    /// 17). `None` keeps RDMA CM's value derived from the path (19 on RoCE, about 2 s). At
    /// most 31 (a 5-bit field; larger codes are refused).
    pub ack_timeout: Option<u8>,
    /// The pool behind [`Connection::pool`](super::Connection::pool), created on first use.
    pub user_pool: PoolConfig,
    /// Messages of at least this many bytes sent with
    /// [`send_bytes`](super::Connection::send_bytes) /
    /// [`send_buf`](super::Connection::send_buf) go by rendezvous when the peer takes part
    /// (`None`: never; this side then does not offer rendezvous at all; an empty message never
    /// does, even with `Some(0)`). See
    /// [`rendezvous_threshold`](Self::rendezvous_threshold).
    pub rendezvous_threshold: Option<u64>,
    /// The largest chunk this side sends in one SEND, whatever the peer announces: chunks
    /// are `min(peer's recv_buf_size, max_send_chunk)` bytes, and the send staging pool's
    /// buffers are that size. The peer's receive buffer size is the most it accepts, not what
    /// it must get: smaller chunks are always valid. Default
    /// [`DEFAULT_MAX_SEND_CHUNK`] (256 KiB). See [`max_send_chunk`](Self::max_send_chunk).
    pub max_send_chunk: u32,
    /// The most chunks copied into staging buffers that may be on the device at once, whatever
    /// the peer's credits: the send staging pool has `min(peer's recv_credits,
    /// max_staged_chunks, send-queue share) + 1` buffers. Default
    /// [`DEFAULT_MAX_STAGED_CHUNKS`] (32). See [`max_staged_chunks`](Self::max_staged_chunks).
    pub max_staged_chunks: u32,
    /// What the builder was told explicitly (an option that cannot apply on an endpoint with
    /// a shared receive queue is refused only if asked for, not by default).
    pub(crate) explicit: Explicit,
}

/// Options set through the builder (not just defaults).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Explicit {
    pub(crate) one_sided: bool,
    pub(crate) atomics: bool,
    pub(crate) rendezvous: bool,
    pub(crate) recv_buf_size: bool,
}

/// The default [`ConnectOptions::rendezvous_threshold`].
pub const DEFAULT_RENDEZVOUS_THRESHOLD: u64 = 256 << 10;

/// The default [`ConnectOptions::max_send_chunk`]: 256 KiB.
pub const DEFAULT_MAX_SEND_CHUNK: u32 = 256 << 10;

/// The default [`ConnectOptions::max_staged_chunks`]: 32.
pub const DEFAULT_MAX_STAGED_CHUNKS: u32 = 32;

impl Default for ConnectOptions {
    fn default() -> ConnectOptions {
        ConnectOptions {
            params: Params {
                recv_credits: 16,
                recv_buf_size: 64 << 10,
                max_message_size: 16 << 20,
                flags: Flags::ONE_SIDED | Flags::RENDEZVOUS,
                ..Params::default()
            },
            send_queue_depth: 128,
            completion_mode: None,
            connect_timeout: Duration::from_secs(30),
            handshake_timeout: Duration::from_secs(10),
            backlog: 128,
            keepalive: Some(Duration::from_secs(10)),
            keepalive_timeout: Duration::from_secs(10),
            close_timeout: Duration::from_secs(30),
            retry_count: 6,
            recv_budget: 16 << 20,
            ack_timeout: Some(17),
            user_pool: PoolConfig::default()
                .classes([SizeClass::new(4 << 10, 64), SizeClass::new(64 << 10, 8)]),
            rendezvous_threshold: Some(DEFAULT_RENDEZVOUS_THRESHOLD),
            max_send_chunk: DEFAULT_MAX_SEND_CHUNK,
            max_staged_chunks: DEFAULT_MAX_STAGED_CHUNKS,
            explicit: Explicit::default(),
        }
    }
}

impl ConnectOptions {
    /// The handshake parameters this side announces.
    pub fn handshake(&self) -> &Params {
        &self.params
    }

    /// Sets the receive credits (data receives kept posted; at least
    /// [`MIN_CREDITS`](super::handshake::MIN_CREDITS):
    /// [`Connection::connect_with`](super::Connection::connect_with) and
    /// [`Listener::bind_with`](super::Listener::bind_with) refuse fewer).
    pub fn recv_credits(mut self, n: u32) -> Self {
        self.params.recv_credits = n;
        self
    }

    /// Sets the receive buffer size (the largest chunk the peer may send in one SEND).
    pub fn recv_buf_size(mut self, n: u32) -> Self {
        self.params.recv_buf_size = n;
        self.explicit.recv_buf_size = true;
        self
    }

    /// Sets the largest message accepted.
    pub fn max_message_size(mut self, n: u64) -> Self {
        self.params.max_message_size = n;
        self
    }

    /// Sets the connect timeout (client side, see
    /// [`connect_timeout`](Self::connect_timeout)).
    pub fn connect_timeout(mut self, t: Duration) -> Self {
        self.connect_timeout = t;
        self
    }

    /// Sets the handshake timeout (server side, see
    /// [`handshake_timeout`](Self::handshake_timeout)).
    pub fn handshake_timeout(mut self, t: Duration) -> Self {
        self.handshake_timeout = t;
        self
    }

    /// Sets the listener's backlog (server side, see [`backlog`](Self::backlog)).
    pub fn backlog(mut self, n: usize) -> Self {
        self.backlog = n;
        self
    }

    /// Sets the keepalive interval.
    pub fn keepalive(mut self, t: Option<Duration>) -> Self {
        self.keepalive = t;
        self
    }

    /// Sets the keepalive timeout (see [`keepalive_timeout`](Self::keepalive_timeout)).
    pub fn keepalive_timeout(mut self, t: Duration) -> Self {
        self.keepalive_timeout = t;
        self
    }

    /// Sets the close timeout (see [`close_timeout`](Self::close_timeout)).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use tokio_rdma::conn::ConnectOptions;
    /// let opts = ConnectOptions::default().close_timeout(Duration::from_secs(5));
    /// assert_eq!(opts.close_timeout, Duration::from_secs(5));
    /// ```
    pub fn close_timeout(mut self, t: Duration) -> Self {
        self.close_timeout = t;
        self
    }

    /// Sets the transport retry count (see [`retry_count`](Self::retry_count)).
    pub fn retry_count(mut self, n: u8) -> Self {
        self.retry_count = n;
        self
    }

    /// Sets the receive budget (see [`recv_budget`](Self::recv_budget)).
    pub fn recv_budget(mut self, bytes: u64) -> Self {
        self.recv_budget = bytes;
        self
    }

    /// Sets the local ACK timeout code (see [`ack_timeout`](Self::ack_timeout)).
    pub fn ack_timeout(mut self, code: Option<u8>) -> Self {
        self.ack_timeout = code;
        self
    }

    /// Sets the completion mode.
    pub fn completion_mode(mut self, mode: CompletionMode) -> Self {
        self.completion_mode = Some(mode);
        self
    }

    /// Offers the peer one-sided access (RDMA READ/WRITE into memory this side grants with
    /// [`Connection::grant`](super::Connection::grant)). Without it, grants for READ or
    /// WRITE are refused locally.
    pub fn one_sided(mut self, on: bool) -> Self {
        self.set_flag(Flags::ONE_SIDED, on);
        self.explicit.one_sided = on;
        self
    }

    /// Offers the peer atomics on memory this side grants. Without it, grants for atomics
    /// are refused locally.
    pub fn atomics(mut self, on: bool) -> Self {
        self.set_flag(Flags::ATOMICS, on);
        self.explicit.atomics = on;
        self
    }

    /// Sets the configuration of the pool behind
    /// [`Connection::pool`](super::Connection::pool).
    pub fn user_pool(mut self, config: PoolConfig) -> Self {
        self.user_pool = config;
        self
    }

    /// Large messages by rendezvous: a [`send_bytes`](super::Connection::send_bytes) or
    /// [`send_buf`](super::Connection::send_buf) of at least `bytes` sends a 24-byte
    /// descriptor instead of chunks; the receiver RDMA READs the message straight into its
    /// destination (a buffer of its own for [`recv`](super::Connection::recv), the caller's
    /// for [`recv_into`](super::Connection::recv_into)) and acknowledges, and the send resolves
    /// on that acknowledgement. No copy on either side. The memory is opened to this peer
    /// only, for reading only, for exactly the message, until the acknowledgement (a
    /// registration of its own per message). `None` turns rendezvous off: this side then
    /// neither sends nor accepts descriptors. Plain [`send`](super::Connection::send) of a
    /// borrowed slice always copies (its memory cannot be kept until the peer read it).
    ///
    /// The default, 256 KiB, is where one registration per message costs less than copying
    /// the chunks (measured in `docs/benchmarks-large.md`).
    ///
    /// # Examples
    ///
    /// ```
    /// use tokio_rdma::conn::ConnectOptions;
    /// let opts = ConnectOptions::default().rendezvous_threshold(Some(1 << 20));
    /// assert_eq!(opts.rendezvous_threshold, Some(1 << 20));
    /// ```
    pub fn rendezvous_threshold(mut self, bytes: Option<u64>) -> Self {
        self.rendezvous_threshold = bytes;
        self.set_flag(Flags::RENDEZVOUS, bytes.is_some());
        self.explicit.rendezvous = bytes.is_some();
        self
    }

    /// Caps the chunks this side sends at `bytes` (at least 64), whatever the peer's receive
    /// buffer size: the peer announces the largest SEND it accepts, and a hostile or
    /// careless one may announce 16 MiB. With the cap, the send staging pool (registered
    /// memory) is at most `(max_staged_chunks + 1) x max_send_chunk` bytes, 8.25 MiB with the
    /// defaults, where a peer announcing 65,535 credits of 16 MiB would otherwise make this
    /// side register 1 TiB. Raise it (with `recv_buf_size` on the peer) for fewer, larger
    /// chunks per message.
    ///
    /// # Examples
    ///
    /// ```
    /// use tokio_rdma::conn::ConnectOptions;
    /// let opts = ConnectOptions::default().max_send_chunk(1 << 20);
    /// assert_eq!(opts.max_send_chunk, 1 << 20);
    /// ```
    pub fn max_send_chunk(mut self, bytes: u32) -> Self {
        self.max_send_chunk = bytes;
        self
    }

    /// Caps the chunks copied into staging buffers that may be on the device at once (at
    /// least 1), whatever the peer's credits: the staging pool has one buffer more than that.
    /// The peer's credits are not reduced (chunks sent inline or from registered memory use
    /// them all); a copied chunk beyond the cap waits for a staging buffer to come back,
    /// which happens as soon as the device completed an earlier one (not when the peer's
    /// application consumed it). The send queue's share of message sends
    /// (`2 x min(recv_credits, 64) + 6`) caps it too: more staging buffers than sends on the
    /// device would never be used.
    ///
    /// # Examples
    ///
    /// ```
    /// use tokio_rdma::conn::ConnectOptions;
    /// let opts = ConnectOptions::default().max_staged_chunks(8);
    /// assert_eq!(opts.max_staged_chunks, 8);
    /// ```
    pub fn max_staged_chunks(mut self, n: u32) -> Self {
        self.max_staged_chunks = n;
        self
    }

    fn set_flag(&mut self, flag: Flags, on: bool) {
        let bits = if on {
            self.params.flags.bits() | flag.bits()
        } else {
            self.params.flags.bits() & !flag.bits()
        };
        self.params.flags = Flags::from_bits(bits).expect("known bits");
    }
}
