//! Messages on a [`Connection`]: `send` hands the state machine's chunks to the queue pair,
//! `recv` takes delivered messages from it.

use std::future::Future;
use std::task::{Context, Poll};

use futures::StreamExt;
use futures::stream::FuturesUnordered;

use super::connection::Connection;
use super::driver::submit;
use super::shared::Message;
use crate::buf::PoolBuf;
use crate::error::Result;
use crate::ops::Send;

/// Cancels the message in the state machine if the send is dropped before handing out its
/// last chunk (the peer then gets an abort and drops the partial message).
struct SendGuard<'a> {
    conn: &'a Connection,
    id: u64,
    armed: bool,
}

impl Drop for SendGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            let id = self.id;
            self.conn.shared.with(|p| p.cancel_send(id));
        }
    }
}

impl Connection {
    /// Sends one message (copied into the connection's registered buffers; a message larger
    /// than the peer's receive buffers goes as several chunks). Waits for its turn (messages
    /// go out whole, one at a time, in the order their sends started), for credits and
    /// buffers (backpressure), and for the completion of every chunk.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) if it exceeds the negotiated
    /// message size; the connection's failure
    /// ([`Error::QpFailed`](crate::Error::QpFailed)) if it failed or was closed.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe in the sense that matters for a transport: dropped before its first chunk
    /// went out, the message is not sent at all; dropped part-way, the peer discards the
    /// chunks it got (an abort follows them) and never sees a partial message; dropped after
    /// the last chunk went out, the message is delivered whole. The connection stays usable
    /// in every case.
    pub async fn send(&self, msg: &[u8]) -> Result<()> {
        let id = self.shared.with(|p| p.start_send(msg.len() as u64))?;
        let mut guard = SendGuard {
            conn: self,
            id,
            armed: true,
        };
        let chunk_size = self.shared.params.max_send_size as usize;
        let mut inflight: FuturesUnordered<Send<PoolBuf>> = FuturesUnordered::new();
        let mut staging: Option<PoolBuf> = None;
        loop {
            if staging.is_none() {
                // Only the message whose turn it is takes a staging buffer.
                drive(
                    self,
                    &mut inflight,
                    std::future::poll_fn(|cx| {
                        self.shared.poll_with(cx, |p, cx| p.poll_turn(id, cx))
                    }),
                )
                .await?;
                let buf =
                    drive(self, &mut inflight, self.shared.staging.acquire(chunk_size)).await?;
                staging = Some(buf);
            }
            let (op, last) = drive(
                self,
                &mut inflight,
                std::future::poll_fn(|cx| {
                    self.shared.poll_with(cx, |p, cx| {
                        let chunk = match p.poll_chunk(id, cx) {
                            Poll::Ready(Ok(c)) => c,
                            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                            Poll::Pending => return Poll::Pending,
                        };
                        let mut buf = staging.take().expect("acquired above");
                        let start = chunk.offset as usize;
                        let len = chunk.len as usize;
                        buf.set_len(len);
                        buf.copy_from_slice(&msg[start..start + len]);
                        // Submitted under the lock: the wire order is the hand-out order.
                        let mut op = self.shared.qp.send_with_imm(buf, chunk.imm);
                        match submit(&mut op) {
                            Some((res, _)) => Poll::Ready(res.map(|()| (None, chunk.last))),
                            None => Poll::Ready(Ok((Some(op), chunk.last))),
                        }
                    })
                }),
            )
            .await?;
            if let Some(op) = op {
                inflight.push(op);
            }
            if last {
                break;
            }
        }
        // Every chunk is on the wire: the message is whole whatever happens to this future.
        guard.armed = false;
        while let Some((res, _buf)) = inflight.next().await {
            res?;
            self.heard();
        }
        Ok(())
    }

    /// Receives the next message. `Ok(None)` means the peer closed its side cleanly after
    /// every message it sent; a failure is always an error, never `Ok(None)`.
    ///
    /// Drop the [`Message`] when done with it: until then it counts against the receive
    /// budget, and the peer is held back when the budget is used up.
    ///
    /// # Errors
    ///
    /// The connection's failure ([`Error::QpFailed`](crate::Error::QpFailed)), e.g.
    /// [`QpFailure::Protocol`](crate::QpFailure::Protocol) if the peer broke the protocol.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a message leaves the connection only when this returns it; any number of
    /// tasks may wait at once.
    pub async fn recv(&self) -> Result<Option<Message>> {
        let d =
            std::future::poll_fn(|cx| self.shared.poll_with(cx, |p, cx| p.poll_recv(cx))).await?;
        Ok(d.map(|d| Message::new(d, self.shared.clone())))
    }
}

/// Awaits `fut` while also driving the in-flight chunk sends (their completions free
/// buffers). A failed chunk fails the whole message.
async fn drive<F, T>(
    conn: &Connection,
    inflight: &mut FuturesUnordered<Send<PoolBuf>>,
    fut: F,
) -> Result<T>
where
    F: Future<Output = Result<T>>,
{
    let mut fut = std::pin::pin!(fut);
    std::future::poll_fn(|cx: &mut Context<'_>| {
        if let Poll::Ready(v) = fut.as_mut().poll(cx) {
            return Poll::Ready(v);
        }
        let mut heard = false;
        while let Poll::Ready(Some((res, _buf))) = inflight.poll_next_unpin(cx) {
            res?;
            heard = true;
        }
        if heard {
            conn.heard();
        }
        Poll::Pending
    })
    .await
}

impl Connection {
    /// A chunk's send completed: the peer is alive (its keepalive deadline starts over).
    fn heard(&self) {
        let now = std::time::Instant::now();
        self.shared.with(|p| p.heard(now));
    }
}
