//! Sending messages on a [`Connection`]: `send` (and `send_bytes`, `send_buf`) hands the
//! state machine's chunks to the queue pair, polling the completion queue in place while it
//! waits; a large owned message goes by rendezvous. The receive side is `rendezvous.rs`.

use std::task::{Context, Poll};

use super::connection::Connection;
use bytes::Bytes;

use super::io::{ConnState, SEND_CHAIN, Source};
use super::progress::Progress;
use super::rdv_memory::RdvSource;
use crate::buf::{PoolBuf, blocking};
use crate::error::{Error, QpFailure, Result};

/// Cancels the message in the state machine if the send is dropped after it was queued and
/// before handing out its last chunk (the peer then gets an abort and drops the partial
/// message).
struct SendGuard<'a> {
    conn: &'a Connection,
    /// The message's number once queued; `None` again once its last chunk is out.
    id: Option<u64>,
}

impl Drop for SendGuard<'_> {
    fn drop(&mut self) {
        if let Some(id) = self.id {
            self.conn.shared.io.with(|s| s.proto.cancel_send(id));
        }
    }
}

impl Connection {
    /// Sends one message: a small one inline in the work request, a larger one copied into the
    /// connection's registered staging buffers (a message larger than the peer's receive
    /// buffers goes as several chunks). Waits for its turn (messages go out whole, one at a
    /// time, in the order their sends started), for credits and buffers (backpressure), and
    /// resolves once its last chunk is handed to the device: `msg` may then be reused.
    /// Delivery failures after that fail the connection (the next operation reports them),
    /// as with a socket's `write`.
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
        self.send_from(Source::Copy(msg), None).await
    }

    /// Sends the messages of `msgs`, in order, as many calls of [`send`](Self::send) would,
    /// with fewer looks at the connection and fewer doorbells: the small messages that can
    /// go at once (each up to the queue pair's inline size,
    /// [`Negotiated::max_inline`](super::Negotiated), 64 B by default; with a credit and room
    /// in the send queue) are handed out in one look at the state and posted as one chained
    /// list, up to 16 per `ibv_post_send`. A message that cannot go at once (a larger one, or
    /// no credit left) is sent as `send` sends it, waiting for its turn, and the batch goes
    /// on behind it. Resolves once the last message is on the device.
    ///
    /// # Errors
    ///
    /// As [`send`](Self::send), for the first message that fails; the messages before it
    /// were sent, the ones after it were not.
    ///
    /// # Cancel safety
    ///
    /// Whole messages only, as with `send`: dropped part-way, the messages up to some point
    /// of `msgs` were sent whole, at most one is cancelled as `send` cancels it (the peer
    /// never sees part of it), and the rest are not sent. Which point is not reported: to know
    /// how many went, send them with `send` one by one.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo(conn: tokio_rdma::conn::Connection) -> tokio_rdma::Result<()> {
    /// let ticks: Vec<[u8; 16]> = (0..64u128).map(|i| i.to_le_bytes()).collect();
    /// conn.send_many(&ticks).await?; // 64 messages, four doorbells when credits allow
    /// # Ok(()) }
    /// ```
    pub async fn send_many<M: AsRef<[u8]>>(&self, msgs: &[M]) -> Result<()> {
        let io = &self.shared.io;
        let mut next = 0;
        while next < msgs.len() {
            let rest = &msgs[next..];
            let went = std::future::poll_fn(|cx| {
                // The cooperative budget, as `send`'s first look: a chain is one operation.
                let coop = std::task::ready!(tokio::task::coop::poll_proceed(cx));
                let r = io.with(|s| io.post_inline_many(s, rest));
                if !matches!(r, Ok(0)) {
                    coop.made_progress();
                }
                Poll::Ready(r)
            })
            .await?;
            next += went;
            if went < SEND_CHAIN.min(rest.len()) {
                // The next one cannot go at once: its own send waits for it.
                self.send(msgs[next].as_ref()).await?;
                next += 1;
            }
        }
        Ok(())
    }

    /// Sends `msg` like [`send`](Self::send), without copying it when its memory is
    /// registered in this connection's protection domain: a buffer of this connection's
    /// [`pool`](Self::pool) ([`PoolBuf::freeze`](crate::buf::PoolBuf::freeze), or
    /// [`send_buf`](Self::send_buf)), or a received [`Message`](super::Message)'s
    /// [`into_bytes`](super::Message::into_bytes) (forwarding it), or memory inside a live
    /// [`register_bytes`](Self::register_bytes) registration. Chunks go straight from those
    /// bytes to the peer; the connection keeps a reference to them until the device has read
    /// them, so their memory returns to its pool only then. Once the connection has a
    /// [`registration_cache`](Self::registration_cache), any other bytes go without copying
    /// too, under a lease of the cache (registered on the first send from them). Otherwise
    /// other bytes are copied as `send` copies them. [`ConnStats`](super::ConnStats) counts the
    /// bytes sent each way.
    ///
    /// # Errors
    ///
    /// As [`send`](Self::send); with a registration cache, its registration errors on a miss
    /// ([`Error::MemlockExhausted`], ...).
    ///
    /// A message of at least
    /// [`ConnectOptions::rendezvous_threshold`](super::ConnectOptions::rendezvous_threshold)
    /// bytes (default 256 KiB) goes by rendezvous when the peer takes part, from any memory:
    /// its bytes are registered for the peer to RDMA READ (READ-only, this connection only),
    /// the peer reads them straight into its destination, and this resolves once it has (the
    /// registration is then dropped). No copy on either side.
    ///
    /// # Cancel safety
    ///
    /// As [`send`](Self::send). A rendezvous message whose descriptor went out is delivered
    /// whole; its bytes stay with the connection until the peer read them.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo(conn: tokio_rdma::conn::Connection) -> tokio_rdma::Result<()> {
    /// let mut buf = conn.pool()?.acquire(1 << 20).await?;
    /// buf.set_len(1 << 20);
    /// buf.fill(7);
    /// conn.send_bytes(buf.freeze()).await?; // no copy: the chunks are sent from `buf`
    /// assert_eq!(conn.stats().send_bytes_copied, 0);
    /// # Ok(()) }
    /// ```
    pub async fn send_bytes(&self, msg: Bytes) -> Result<()> {
        if self.by_rendezvous(msg.len()) {
            let src = RdvSource::open(&self.shared.pd, msg).await?;
            let desc = src.descriptor();
            return self.send_from(Source::Copy(&desc), Some(src)).await;
        }
        // Inline payloads are copied by the device at post time whatever their memory.
        if msg.len() <= self.shared.io.max_inline() {
            return self.send_from(Source::Copy(&msg), None).await;
        }
        if let Some(lkey) =
            self.shared
                .io
                .lkey_of(msg.as_ptr() as usize, msg.len(), self.user_pool.get())
        {
            return self.send_from(Source::Registered(&msg, lkey), None).await;
        }
        let lease = self
            .registered
            .get()
            .and_then(|r| r.find(msg.as_ptr() as usize, msg.len()));
        if let Some((lkey, lease)) = lease {
            // The send ring keeps these bytes until the device read them: with them, the
            // registration they lie in.
            let held = Bytes::from_owner(Leased {
                bytes: msg,
                _lease: lease,
            });
            return self.send_from(Source::Registered(&held, lkey), None).await;
        }
        match self.reg_cache.get() {
            Some(cache) => {
                let lease = match cache.cached(msg.as_ptr(), msg.len()) {
                    Some(lease) => lease,
                    None => {
                        // A miss reads `/proc/self/maps` and pins the pages: off the runtime's
                        // worker threads, with a handle of the bytes keeping them alive.
                        let (cache, bytes) = (cache.clone(), msg.clone());
                        blocking::run_for(msg.len(), move || {
                            cache.lookup_or_register(bytes.as_ptr(), bytes.len())
                        })
                        .await?
                    }
                };
                let lkey = lease.lkey();
                // The send ring keeps these bytes until the device read them: with them, the
                // lease that keeps them registered.
                let held = Bytes::from_owner(Leased {
                    bytes: msg,
                    _lease: lease,
                });
                self.send_from(Source::Registered(&held, lkey), None).await
            }
            _ => self.send_from(Source::Copy(&msg), None).await,
        }
    }

    /// Sends the filled part of `buf`, a buffer of this connection's [`pool`](Self::pool),
    /// without copying: [`send_bytes`](Self::send_bytes) of `buf.freeze()`. The buffer returns
    /// to the pool once the device has read it.
    ///
    /// # Errors
    ///
    /// As [`send`](Self::send).
    ///
    /// # Cancel safety
    ///
    /// As [`send`](Self::send).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo(conn: tokio_rdma::conn::Connection) -> tokio_rdma::Result<()> {
    /// let mut buf = conn.pool()?.acquire(4096).await?;
    /// buf.set_len(4096);
    /// buf.copy_from_slice(&[1; 4096]);
    /// conn.send_buf(buf).await?;
    /// # Ok(()) }
    /// ```
    pub async fn send_buf(&self, buf: PoolBuf) -> Result<()> {
        self.send_bytes(buf.freeze()).await
    }

    /// Sends the filled part of `buf`, a staging buffer of this connection (the caller copied
    /// the message into it: one copy instead of two), straight from it. Falls back to a copy
    /// if `buf` is not one.
    pub(crate) async fn send_staged(&self, buf: PoolBuf) -> Result<()> {
        let bytes = buf.freeze();
        match self
            .shared
            .io
            .staging()
            .lkey_of(bytes.as_ptr() as usize, bytes.len())
        {
            Some(lkey) if bytes.len() > self.shared.io.max_inline() => {
                self.send_from(Source::Staged(&bytes, lkey), None).await
            }
            _ => self.send_from(Source::Copy(&bytes), None).await,
        }
    }

    /// Sends the message in `src`; with `rdv`, `src` is the descriptor of `rdv`'s message,
    /// which goes by rendezvous (resolving once the peer read it).
    ///
    /// A message that needs no staging buffer (inline, or sent from registered memory) is
    /// queued and, when credits and the send queue allow, handed out and posted in one look at
    /// the state: one lock for a small message's whole send.
    async fn send_from(&self, src: Source<'_>, mut rdv: Option<RdvSource>) -> Result<()> {
        let msg = src.bytes();
        let io = &self.shared.io;
        let by_rdv = rdv.is_some();
        let rdv_len = rdv.as_ref().map(RdvSource::len);
        let mut guard = SendGuard {
            conn: self,
            id: None,
        };
        // Queues the message in the state machine, on the first look.
        let queue = |s: &mut ConnState, guard: &mut SendGuard<'_>| -> Result<u64> {
            if let Some(id) = guard.id {
                return Ok(id);
            }
            let id = match rdv_len {
                Some(len) => s.proto.start_send_rendezvous(len)?,
                None => s.proto.start_send(msg.len() as u64)?,
            };
            guard.id = Some(id);
            Ok(id)
        };
        // Hands out the message's next chunk and posts it, under the lock: the wire order is
        // the hand-out order. Ready(true) once the last chunk is out.
        let hand_out = |s: &mut ConnState,
                        cx: &mut Context<'_>,
                        guard: &mut SendGuard<'_>,
                        staging: &mut Option<PoolBuf>,
                        rdv: &mut Option<RdvSource>|
         -> Poll<Result<bool>> {
            let id = queue(s, guard)?;
            if !io.sq_ready(s, cx.waker()) {
                return Poll::Pending;
            }
            let chunk = match s.proto.poll_chunk(id, cx) {
                Poll::Ready(Ok(c)) => c,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            };
            if io.post_chunk(s, chunk, src, staging) {
                if let Some(seq) = chunk.rendezvous {
                    let r = rdv.take().expect("one descriptor per rendezvous message");
                    s.sent_bytes.zero_copy += r.len();
                    s.rdv_held.push((seq, r));
                }
                Poll::Ready(Ok(chunk.last))
            } else {
                Poll::Ready(Err(Error::QpFailed(
                    s.proto.failure().cloned().unwrap_or(QpFailure::Flushed),
                )))
            }
        };
        let chunk_size = self.shared.params.max_send_size as usize;
        if !by_rdv && msg.len() <= chunk_size && !io.needs_staging(&src, msg.len()) {
            // A one-chunk message that needs no staging buffer mostly goes out at the first
            // look, before a wait is set up: the state machine hands it out whole if nothing
            // is queued before it and a credit is free (`send_now`). Else nothing changed (no
            // waker registered) and it is queued below, as any message.
            let first = std::future::poll_fn(|cx| {
                let coop = std::task::ready!(tokio::task::coop::poll_proceed(cx));
                let sent = io.with(|s| {
                    if !io.sq_room(s) {
                        return Ok(false);
                    }
                    let Some(chunk) = s.proto.send_now(msg.len() as u64)? else {
                        return Ok(false);
                    };
                    if io.post_chunk(s, chunk, src, &mut None) {
                        Ok(true)
                    } else {
                        Err(Error::QpFailed(
                            s.proto.failure().cloned().unwrap_or(QpFailure::Flushed),
                        ))
                    }
                });
                if !matches!(sent, Ok(false)) {
                    coop.made_progress();
                }
                Poll::Ready(sent)
            })
            .await;
            if first? {
                return Ok(());
            }
        }
        let mut wait = Progress::new(self);
        let mut staging: Option<PoolBuf> = None;
        let mut offset = 0usize;
        loop {
            let len = (msg.len() - offset).min(chunk_size);
            if io.needs_staging(&src, len) && staging.is_none() {
                // Only the message whose turn it is takes a staging buffer.
                wait.run(|s, cx| {
                    let id = queue(s, &mut guard)?;
                    s.proto.poll_turn(id, cx)
                })
                .await?;
                staging = Some(match io.staging().try_acquire(chunk_size)? {
                    Some(b) => b,
                    None => io.staging().acquire(chunk_size).await?,
                });
            }
            let last = wait
                .run(|s, cx| hand_out(s, cx, &mut guard, &mut staging, &mut rdv))
                .await?;
            offset += len;
            if last {
                break;
            }
        }
        if by_rdv {
            // The descriptor is out: the send resolves once the peer read the message (the
            // memory stays open until then even if this future is dropped).
            let id = guard.id.expect("queued");
            wait.run(|s, cx| s.proto.poll_fetched(id, cx)).await?;
        }
        // Every chunk is on the device: the message is whole whatever happens to this future.
        guard.id = None;
        Ok(())
    }
}

/// Bytes sent under a lease on their registration (the registration cache's, or
/// `register_bytes`'): the lease lives as long as the bytes.
struct Leased<L> {
    bytes: Bytes,
    _lease: L,
}

impl<L> AsRef<[u8]> for Leased<L> {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

impl Connection {
    /// Whether a message of `len` bytes from owned memory goes by rendezvous (never an empty
    /// one, which has nothing to read and could not be registered, whatever the threshold).
    pub(super) fn by_rendezvous(&self, len: usize) -> bool {
        len > 0
            && self.shared.params.rendezvous
            && self
                .shared
                .io
                .rdv_threshold
                .is_some_and(|t| len as u64 >= t)
    }
}
