//! What a connection's handle, its driver task, its messages and its byte stream share: the
//! queue pair, the private buffer pool, and the protocol state machine behind one lock.

use std::fmt;
use std::ops::Deref;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};

use bytes::Bytes;
use tokio::sync::Notify;

use super::handshake::Negotiated;
use crate::buf::{Pool, PoolBuf};
use crate::core::conn::{ConnProto, Delivery};
use crate::driver::AsyncQp;
use crate::verbs::ProtectionDomain;

/// The state machine over the connection's receive buffers.
pub(crate) type Proto = ConnProto<PoolBuf>;

#[derive(Debug)]
pub(crate) struct ConnShared {
    pub(crate) qp: AsyncQp,
    /// The connection's own protection domain (its queue pair, pools and grants live here).
    pub(crate) pd: ProtectionDomain,
    /// The connection's private message buffers: receives and send staging. Never handed to
    /// the application except inside a received [`Message`], and sized so the protocol can
    /// always post what its credits promise.
    pub(crate) pool: Pool,
    /// Send staging buffers: one per data credit, each as large as a chunk.
    pub(crate) staging: Pool,
    pub(crate) params: Negotiated,
    proto: Mutex<Proto>,
    /// Wakes the driver task: receives to post, control messages to send, a new deadline.
    pub(crate) kick: Notify,
}

impl ConnShared {
    pub(crate) fn new(
        qp: AsyncQp,
        pd: ProtectionDomain,
        pool: Pool,
        staging: Pool,
        params: Negotiated,
        proto: Proto,
    ) -> ConnShared {
        ConnShared {
            qp,
            pd,
            pool,
            staging,
            params,
            proto: Mutex::new(proto),
            kick: Notify::new(),
        }
    }

    /// The state machine, locked. Prefer [`with`](Self::with), which wakes what it asks for.
    pub(crate) fn lock(&self) -> MutexGuard<'_, Proto> {
        // The state machine has no invariant a panic elsewhere could half-apply.
        self.proto.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` on the state machine, then (outside the lock) wakes the tasks it woke and
    /// kicks the driver if it has new work.
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut Proto) -> R) -> R {
        let mut wakers = Vec::new();
        let (r, kick) = {
            let mut p = self.lock();
            let r = f(&mut p);
            wakers.extend(p.take_wakers());
            (r, p.take_driver_kick())
        };
        for w in wakers {
            w.wake();
        }
        if kick {
            self.kick.notify_one();
        }
        r
    }

    /// [`with`](Self::with) for the driver task itself: it does all pending work on every
    /// round, so the state machine's "new work" flag is cleared instead of waking the driver
    /// again (which would spin it while work is due but blocked, e.g. on the peer's
    /// confirmation).
    pub(crate) fn with_driver<R>(&self, f: impl FnOnce(&mut Proto) -> R) -> R {
        let mut wakers = Vec::new();
        let r = {
            let mut p = self.lock();
            let r = f(&mut p);
            wakers.extend(p.take_wakers());
            let _ = p.take_driver_kick();
            r
        };
        for w in wakers {
            w.wake();
        }
        r
    }

    /// Polls `f` with the state machine (see [`with`](Self::with)).
    pub(crate) fn poll_with<T>(
        &self,
        cx: &mut Context<'_>,
        f: impl FnOnce(&mut Proto, &mut Context<'_>) -> Poll<T>,
    ) -> Poll<T> {
        self.with(|p| f(p, cx))
    }
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
    conn: Arc<ConnShared>,
}

impl Message {
    pub(crate) fn new(delivery: Delivery<PoolBuf>, conn: Arc<ConnShared>) -> Message {
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
            self.conn.with(|p| p.consumed(buffer, len));
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
