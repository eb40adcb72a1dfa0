//! The message engine of one connection: credit-based flow control over SEND with immediate
//! data, chunking of large messages, and the connection's state.
//!
//! Protocol (see [`core::MsgHeader`](crate::core::MsgHeader)): every message is a SEND with
//! immediate data carrying its kind and the credits the sender returns. A message larger than
//! the peer's receive buffers goes as a sequence of `More` chunks ended by a `Last` chunk; the
//! receiver reassembles them (one copy; a single-chunk message is handed over without copying).
//! A sender takes one credit per chunk and never sends without one, so a SEND always finds a
//! posted receive.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use tokio::sync::Notify;
use tracing::debug;

use super::handshake::Negotiated;
use crate::buf::Pool;
use crate::core::{Credits, MsgHeader, MsgKind};
use crate::driver::AsyncQp;
use crate::error::{Error, QpFailure, Result};
use crate::verbs::ProtectionDomain;

/// Counters of one connection.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnStats {
    /// User messages sent.
    pub messages_sent: u64,
    /// User messages received.
    pub messages_received: u64,
    /// Payload bytes sent.
    pub bytes_sent: u64,
    /// Payload bytes received.
    pub bytes_received: u64,
    /// SENDs posted (chunks, credit and close messages).
    pub sends: u64,
    /// Receives completed.
    pub receives: u64,
    /// Credit-only messages sent.
    pub credit_messages: u64,
    /// Times a sender had to wait for a credit (flow control at work).
    pub credit_waits: u64,
    /// Bytes of the connection's private message buffers in use now (posted receives,
    /// received data the application still holds, sends in flight).
    pub buffer_bytes_in_use: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) messages_sent: AtomicU64,
    pub(crate) messages_received: AtomicU64,
    pub(crate) bytes_sent: AtomicU64,
    pub(crate) bytes_received: AtomicU64,
    pub(crate) sends: AtomicU64,
    pub(crate) receives: AtomicU64,
    pub(crate) credit_messages: AtomicU64,
    pub(crate) credit_waits: AtomicU64,
}

#[derive(Debug, Default)]
pub(crate) struct ConnState {
    /// We sent (or are sending) Close: no more user messages.
    pub(crate) local_closed: bool,
    /// The peer sent Close.
    pub(crate) peer_closed: bool,
    /// The connection failed: every operation reports this.
    pub(crate) failure: Option<QpFailure>,
}

/// Shared by the connection handle, its receive task and its byte stream.
#[derive(Debug)]
pub(crate) struct Engine {
    pub(crate) qp: AsyncQp,
    /// The connection's own protection domain (grants for this connection live here).
    pub(crate) pd: ProtectionDomain,
    pub(crate) pool: Pool,
    pub(crate) params: Negotiated,
    pub(crate) credits: Mutex<Credits>,
    pub(crate) credit_changed: Notify,
    pub(crate) send_lock: tokio::sync::Mutex<()>,
    pub(crate) state: Mutex<ConnState>,
    pub(crate) counters: Counters,
    /// The queue pair is in RTS: control messages may go out (before that a post would fail).
    pub(crate) ready: std::sync::atomic::AtomicBool,
}

impl Engine {
    pub(crate) fn new(qp: AsyncQp, pd: ProtectionDomain, pool: Pool, params: Negotiated) -> Engine {
        Engine {
            credits: Mutex::new(Credits::new(params.send_credits, params.recv_credits)),
            qp,
            pd,
            pool,
            params,
            credit_changed: Notify::new(),
            send_lock: tokio::sync::Mutex::new(()),
            state: Mutex::new(ConnState::default()),
            counters: Counters::default(),
            ready: std::sync::atomic::AtomicBool::new(false),
        }
    }

    pub(crate) fn state(&self) -> std::sync::MutexGuard<'_, ConnState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn credits(&self) -> std::sync::MutexGuard<'_, Credits> {
        self.credits.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records a failure (keeping the first) and wakes everyone waiting for credits.
    pub(crate) fn fail(&self, cause: QpFailure) {
        {
            let mut st = self.state();
            if st.failure.is_none() {
                debug!(%cause, "connection failed");
                st.failure = Some(cause.clone());
            }
        }
        self.qp.force_error(cause);
        self.credit_changed.notify_waiters();
    }

    pub(crate) fn failure(&self) -> Option<Error> {
        self.state().failure.clone().map(Error::QpFailed)
    }

    /// Waits for a credit (a data credit, or, for control messages, possibly the reserve).
    async fn take_credit(&self, control: bool) -> Result<()> {
        let mut waited = false;
        loop {
            let notified = self.credit_changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(e) = self.failure() {
                return Err(e);
            }
            {
                let mut c = self.credits();
                let ok = if control {
                    c.try_take_control()
                } else {
                    c.try_take_data()
                };
                if ok {
                    return Ok(());
                }
            }
            if !waited {
                waited = true;
                self.counters.credit_waits.fetch_add(1, Ordering::Relaxed);
                let c = self.credits();
                tracing::trace!(
                    available = c.available(),
                    owed = c.owed(),
                    control,
                    "waiting for a credit"
                );
            }
            notified.await;
        }
    }

    /// The header of an outgoing message, piggybacking every credit owed to the peer.
    fn header(&self, kind: MsgKind) -> u32 {
        let owed = self.credits().take_owed();
        MsgHeader {
            kind,
            credits: owed as u16,
        }
        .encode()
    }

    /// Sends one user message (chunked if larger than the peer's receive buffers). Waits for
    /// credits and pool buffers (backpressure), and for every chunk's completion.
    pub(crate) async fn send_message(&self, data: &[u8]) -> Result<()> {
        if data.len() as u64 > self.params.max_message_size {
            return Err(Error::InvalidArgument(format!(
                "message of {} bytes exceeds the connection's limit of {}",
                data.len(),
                self.params.max_message_size
            )));
        }
        {
            let st = self.state();
            if let Some(f) = &st.failure {
                return Err(Error::QpFailed(f.clone()));
            }
            if st.local_closed {
                return Err(Error::QpFailed(QpFailure::Closed));
            }
        }
        let _serial = self.send_lock.lock().await;
        let chunk = self.params.max_send_size as usize;
        let n_chunks = data.len().div_ceil(chunk).max(1);
        let mut inflight = FuturesUnordered::new();
        for i in 0..n_chunks {
            let part = &data[(i * chunk).min(data.len())..((i + 1) * chunk).min(data.len())];
            // Credits and buffers free up as earlier chunks complete: keep driving them.
            drive_while(&mut inflight, self.take_credit(false)).await?;
            let buf = match drive_while(&mut inflight, self.pool.acquire(part.len())).await {
                Ok(b) => b,
                Err(e) => {
                    self.credits().untake();
                    return Err(e);
                }
            };
            let mut buf = buf;
            buf.copy_from_slice(part);
            let kind = if i + 1 == n_chunks {
                MsgKind::Last
            } else {
                MsgKind::More
            };
            let mut op = Box::pin(self.qp.send_with_imm(buf, self.header(kind)));
            // Submit now, in chunk order.
            if let std::task::Poll::Ready((res, _)) = futures::poll!(&mut op) {
                res?;
            } else {
                inflight.push(op);
            }
            self.counters.sends.fetch_add(1, Ordering::Relaxed);
        }
        while let Some((res, _buf)) = inflight.next().await {
            res?;
        }
        self.counters.messages_sent.fetch_add(1, Ordering::Relaxed);
        self.counters
            .bytes_sent
            .fetch_add(data.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Starts a credit-only message returning the owed credits: when enough are owed, or, as a
    /// keepalive, whenever a control credit is free. Returns the send to drive, if started.
    /// A failure of the send (e.g. the transport's retries ran out: the peer is gone) fails
    /// the connection.
    pub(crate) fn credit_message(
        self: &Arc<Self>,
        keepalive: bool,
    ) -> Option<impl std::future::Future<Output = ()> + Send + 'static> {
        // Before RTS a post would fail the queue pair.
        if !self.ready.load(Ordering::Acquire) {
            return None;
        }
        {
            let mut c = self.credits();
            if !(keepalive || c.credit_message_due()) || !c.try_take_control() {
                return None;
            }
        }
        let imm = self.header(MsgKind::Credit);
        tracing::trace!(returned = imm & 0xffff, keepalive, "credit message");
        let op = self.qp.send_with_imm(Vec::<u8>::new(), imm);
        self.counters
            .credit_messages
            .fetch_add(1, Ordering::Relaxed);
        self.counters.sends.fetch_add(1, Ordering::Relaxed);
        let this = self.clone();
        Some(async move {
            let (res, _) = op.await;
            if let Err(e) = res {
                if keepalive {
                    tracing::warn!(error = %e, "keepalive failed: the peer is gone");
                } else {
                    debug!(error = %e, "credit message failed");
                }
                this.fail_with(&e);
            }
        })
    }

    /// Fails the connection with the cause carried by an operation's error, if it has one.
    pub(crate) fn fail_with(&self, e: &Error) {
        match e {
            Error::QpFailed(f) => self.fail(f.clone()),
            Error::WorkCompletion { status, vendor_err } => self.fail(QpFailure::WorkCompletion {
                status: *status,
                vendor_err: *vendor_err,
            }),
            _ => {}
        }
    }

    /// Sends Close (end of stream) once: later sends fail, the peer's `recv` returns `None`.
    pub(crate) async fn send_close(&self) -> Result<()> {
        {
            let mut st = self.state();
            if st.local_closed {
                return Ok(());
            }
            st.local_closed = true;
            if let Some(f) = &st.failure {
                return Err(Error::QpFailed(f.clone()));
            }
        }
        // Wait for messages being sent to finish, then take any credit (the reserve is fine).
        let _serial = self.send_lock.lock().await;
        self.take_credit(true).await?;
        let (res, _) = self
            .qp
            .send_with_imm(Vec::<u8>::new(), self.header(MsgKind::Close))
            .await;
        self.counters.sends.fetch_add(1, Ordering::Relaxed);
        res
    }

    pub(crate) fn stats(&self) -> ConnStats {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ConnStats {
            messages_sent: get(&c.messages_sent),
            messages_received: get(&c.messages_received),
            bytes_sent: get(&c.bytes_sent),
            bytes_received: get(&c.bytes_received),
            sends: get(&c.sends),
            receives: get(&c.receives),
            credit_messages: get(&c.credit_messages),
            credit_waits: get(&c.credit_waits),
            buffer_bytes_in_use: self.pool.metrics().bytes_in_use,
        }
    }
}

/// Awaits `fut` while also driving the in-flight chunk sends (so their completions free credits
/// and buffers). A failed chunk fails the whole message.
async fn drive_while<F, T, S, B>(inflight: &mut FuturesUnordered<S>, fut: F) -> Result<T>
where
    F: std::future::Future<Output = Result<T>>,
    S: std::future::Future<Output = (Result<()>, B)> + Unpin,
{
    tokio::pin!(fut);
    loop {
        tokio::select! {
            biased;
            v = &mut fut => return v,
            Some((res, _buf)) = inflight.next(), if !inflight.is_empty() => res?,
        }
    }
}
