//! [`ConnStats`]: the counters of one connection, as
//! [`Connection::stats`](super::Connection::stats) returns them and the metrics exporter
//! publishes them (below the connection, so the observability code can name them).

use crate::buf::PoolMetrics;
use crate::proto::conn::ConnCounters;

/// Counters of one connection.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnStats {
    /// The protocol's counters (messages, chunks, credits, aborts, withheld re-posts).
    pub protocol: ConnCounters,
    /// Bytes of received data the application holds now (the receive budget in use).
    pub recv_bytes_held: u64,
    /// Bytes of the connection's private message buffers in use now (posted receives,
    /// received data the application still holds, sends in flight).
    pub buffer_bytes_in_use: u64,
    /// Message bytes sent inline in the work request (copied by the device at post time).
    pub send_bytes_inline: u64,
    /// Message bytes copied into the connection's staging buffers to be sent.
    pub send_bytes_copied: u64,
    /// Message bytes sent straight from the application's registered memory
    /// ([`send_bytes`](super::Connection::send_bytes), [`send_buf`](super::Connection::send_buf)),
    /// including the messages the peer read by rendezvous (whose 24-byte descriptors count as
    /// inline).
    pub send_bytes_zero_copy: u64,
    /// Received message bytes the CPU copied: chunks reassembled into one message, messages
    /// copied into a [`recv_into`](super::Connection::recv_into) buffer.
    pub recv_bytes_copied: u64,
    /// Received message bytes the device read by rendezvous straight into their destination.
    pub recv_bytes_fetched: u64,
    /// The connection's private receive pool, registered once at setup:
    /// `(2 x recv_credits + 3)` buffers of `recv_buf_size` bytes (posted receives, as many
    /// again held by the application, and the control receives). Its `bytes_registered` is
    /// the registered receive memory of this connection (pages rounded up).
    pub recv_pool: PoolMetrics,
    /// The connection's send staging pool, registered once at setup: `min(send_credits,
    /// max_staged_chunks, send-queue share) + 1` buffers of the chunk size,
    /// `min(peer's recv_buf_size, max_send_chunk)` ([`ConnectOptions::max_staged_chunks`](super::ConnectOptions::max_staged_chunks),
    /// [`ConnectOptions::max_send_chunk`](super::ConnectOptions::max_send_chunk)): local limits, whatever the peer announced.
    pub staging_pool: PoolMetrics,
}
