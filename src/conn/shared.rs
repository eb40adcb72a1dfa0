//! What a connection's handle, its driver task, its messages and its byte stream share: the
//! queue pair (for one-sided operations), the protection domain, the negotiated parameters,
//! and the message I/O ([`ConnIo`], which owns the protocol state machine).

use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

use bytes::Bytes;

use super::handshake::Negotiated;
use super::io::ConnIo;
use super::memory::Reservation;
use crate::buf::PoolBuf;
use crate::driver::AsyncQp;
use crate::proto::conn::Delivery;
use crate::verbs::ProtectionDomain;

#[derive(Debug)]
pub(crate) struct ConnShared {
    pub(crate) qp: AsyncQp,
    /// The connection's own protection domain (its queue pair, pools and grants live here).
    pub(crate) pd: ProtectionDomain,
    pub(crate) params: Negotiated,
    /// Messages: the state machine, the posted receives and sends.
    pub(crate) io: Arc<ConnIo>,
    /// The connection's pools in its endpoint's memory budget, given back with this.
    pub(crate) memory: Reservation,
    /// The connection's id and span, and how it closed (`observe.rs`).
    pub(crate) obs: super::observe::Observed,
}

/// A received message: the bytes, in the connection's receive buffer (a single-chunk message,
/// not copied) or reassembled (a larger one, copied once).
///
/// The message counts against the connection's receive budget until it is dropped: while the
/// application holds `recv_credits` messages, or `recv_budget` bytes, the connection stops
/// returning credits and the peer's sends wait. Drop messages (or copy out what you keep) to
/// let the peer go on. [`into_bytes`](Self::into_bytes) keeps the accounting: the budget is
/// released when the last clone of the `Bytes` is dropped.
///
/// # Examples
///
/// ```no_run
/// # async fn demo(conn: tokio_rdma::conn::Connection) -> tokio_rdma::Result<()> {
/// while let Some(msg) = conn.recv().await? {
///     println!("{} bytes: {:?}", msg.len(), &msg[..msg.len().min(8)]);
///     // dropping `msg` returns its receive buffer and credit
/// }
/// # Ok(()) }
/// ```
pub struct Message {
    delivery: Option<Delivery<PoolBuf>>,
    conn: Arc<ConnIo>,
}

impl Message {
    pub(crate) fn new(delivery: Delivery<PoolBuf>, conn: Arc<ConnIo>) -> Message {
        Message {
            delivery: Some(delivery),
            conn,
        }
    }

    /// The message as [`Bytes`], without copying; the receive budget is released when the
    /// last clone is dropped.
    pub fn into_bytes(self) -> Bytes {
        Bytes::from_owner(self)
    }

    fn bytes(&self) -> &[u8] {
        match self.delivery.as_ref().expect("present until dropped") {
            Delivery::Buf { buf, len } => &buf[..*len],
            Delivery::Assembled(v) => v,
            Delivery::Remote(_) => unreachable!("read before it becomes a message"),
        }
    }
}

impl Deref for Message {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.bytes()
    }
}

impl AsRef<[u8]> for Message {
    fn as_ref(&self) -> &[u8] {
        self.bytes()
    }
}

impl Drop for Message {
    fn drop(&mut self) {
        if let Some(d) = self.delivery.take() {
            let (buffer, len) = (d.holds_buffer(), d.len());
            // The receive buffer goes back to the pool first, so the driver can re-post it.
            drop(d);
            // Counted, and reported to the state machine at the connection's next look; at
            // once, with re-posts and credits, when it needs the report now (no task in
            // between either way).
            self.conn.message_dropped(buffer, len);
        }
    }
}

impl fmt::Debug for Message {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Message")
            .field("len", &self.len())
            .finish_non_exhaustive()
    }
}
