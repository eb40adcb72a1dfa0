//! The write side of an [`RdmaStream`](super::RdmaStream): what a `write` returning `Ok(n)`
//! promises, and how shutdown ends the direction.
//!
//! A write copies its bytes once, into a staging buffer of the connection (a write that
//! goes inline, or finds none free, into an owned message instead), and starts sending it in
//! the same call.
//! If the send is not on the device when the call returns (no credits yet, no staging buffer,
//! more chunks than fit at once), it goes on as a task of its own on the runtime: it makes
//! progress whether or not anyone polls the stream again, flushes it, or drops it, and it
//! holds the connection open until the message is on the device. The next write, `flush` or
//! `shutdown` waits for it (one message in flight per stream: backpressure) and reports its
//! outcome.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use tokio::task::JoinHandle;
use tracing::trace;

use super::exclusive::Exclusive;
use crate::conn::Connection;
use crate::error::{Error, QpFailure, Result};

type SendFut = Pin<Box<dyn Future<Output = Result<()>> + Send>>;

/// The most one write accepts: one message of at most this size, so one call copies and
/// posts a bounded amount (a larger write returns a short count, as a socket's does when its
/// buffer fills) and never holds its worker thread for a whole large message while credits
/// come back.
pub(super) const WRITE_MAX: usize = 256 << 10;

/// The message a write accepted that was not on the device yet when the write returned.
enum InFlight {
    /// On the runtime as a task of its own: it completes whether or not the stream is polled
    /// again (or dropped).
    Task(JoinHandle<Result<()>>),
    /// Polled outside a Tokio runtime (nothing to spawn on): driven by the stream's later
    /// calls, cancelled (the peer discards the partial message) if the stream is dropped first.
    Local(Exclusive<SendFut>),
}

/// Where the direction's shutdown stands.
enum Shutdown {
    Open,
    /// End of stream is queued behind the messages already accepted; waiting for the peer's
    /// acknowledgement.
    Closing(Exclusive<SendFut>),
    /// Finished: `Ok`, or the kind of error it ended with (reported again by later calls).
    Done(std::result::Result<(), io::ErrorKind>),
}

/// The write side's state (see the module docs).
pub(super) struct WriteState {
    inflight: Option<InFlight>,
    shutdown: Shutdown,
}

impl WriteState {
    pub(super) fn new() -> WriteState {
        WriteState {
            inflight: None,
            shutdown: Shutdown::Open,
        }
    }

    /// Whether `shutdown` was started (later writes fail with `BrokenPipe`).
    pub(super) fn is_shut(&self) -> bool {
        !matches!(self.shutdown, Shutdown::Open)
    }

    /// Accepts up to the connection's message limit of the bytes in `bufs` as one message.
    pub(super) fn poll_write(
        &mut self,
        conn: &Arc<Connection>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if self.is_shut() {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "write after shutdown",
            )));
        }
        ready!(self.poll_flush(conn, cx))?;
        let limit = usize::try_from(conn.params().max_message_size)
            .unwrap_or(usize::MAX)
            .min(WRITE_MAX);
        let n = bufs.iter().map(|b| b.len()).sum::<usize>().min(limit);
        if n == 0 {
            return Poll::Ready(Ok(0));
        }
        let c = conn.clone();
        let (n, mut send): (usize, SendFut) = match staging_buffer(conn, n) {
            // One copy: straight into a staging buffer, sent from there (a write of more than
            // one chunk returns a short count, as a socket's does).
            Some(mut buf) => {
                let n = buf.capacity().min(n);
                buf.set_len(n);
                gather(bufs, &mut buf[..]);
                (n, Box::pin(async move { c.send_staged(buf).await }))
            }
            // Inline-sized writes, and no staging buffer free: the message is copied out of
            // `bufs` first (the send may outlive this call) and once more when it goes.
            None => {
                let mut data = vec![0u8; n];
                gather(bufs, &mut data);
                (n, Box::pin(async move { c.send(&data).await }))
            }
        };
        // Start it now: the message takes its place in the connection's order (before any
        // later write or end of stream) in this first poll.
        match send.as_mut().poll(cx) {
            Poll::Ready(res) => outcome(conn, res)?,
            Poll::Pending => self.inflight = Some(spawn(send)),
        }
        Poll::Ready(Ok(n))
    }

    /// Waits for the message in flight and reports its outcome.
    pub(super) fn poll_flush(
        &mut self,
        conn: &Arc<Connection>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
        let res = match self.inflight.as_mut() {
            None => return Poll::Ready(Ok(())),
            Some(InFlight::Task(handle)) => match ready!(Pin::new(handle).poll(cx)) {
                Ok(res) => res,
                Err(join) => {
                    self.inflight = None;
                    return Poll::Ready(Err(io::Error::other(join)));
                }
            },
            Some(InFlight::Local(send)) => ready!(send.get_mut().as_mut().poll(cx)),
        };
        self.inflight = None;
        Poll::Ready(outcome(conn, res))
    }

    /// Waits for the message in flight, then sends end of stream and waits for its
    /// acknowledgement. Idempotent: once done, later calls return the same outcome.
    pub(super) fn poll_shutdown(
        &mut self,
        conn: &Arc<Connection>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            match &mut self.shutdown {
                Shutdown::Done(Ok(())) => return Poll::Ready(Ok(())),
                Shutdown::Done(Err(kind)) => {
                    return Poll::Ready(Err(io::Error::new(
                        *kind,
                        "the stream's shutdown failed earlier",
                    )));
                }
                Shutdown::Open => {
                    ready!(self.poll_flush(conn, cx))?;
                    let c = conn.clone();
                    self.shutdown =
                        Shutdown::Closing(Exclusive::new(Box::pin(
                            async move { c.shutdown().await },
                        )));
                }
                Shutdown::Closing(fut) => {
                    let res = outcome(conn, ready!(fut.get_mut().as_mut().poll(cx)));
                    self.shutdown = Shutdown::Done(res.as_ref().map(|_| ()).map_err(|e| e.kind()));
                    return Poll::Ready(res);
                }
            }
        }
    }
}

/// A free staging buffer of the connection for a write of `n` bytes that does not go inline
/// (at most one chunk of it: the buffer's size).
fn staging_buffer(conn: &Connection, n: usize) -> Option<crate::buf::PoolBuf> {
    let io = &conn.shared.io;
    if n <= io.max_inline() {
        return None;
    }
    let chunk = usize::try_from(conn.shared.params.max_send_size).unwrap_or(usize::MAX);
    io.staging().try_acquire(n.min(chunk)).ok().flatten()
}

/// Copies the first `out.len()` bytes of `bufs` into `out`.
fn gather(bufs: &[io::IoSlice<'_>], out: &mut [u8]) {
    let mut at = 0;
    for b in bufs {
        let take = (out.len() - at).min(b.len());
        out[at..at + take].copy_from_slice(&b[..take]);
        at += take;
        if at == out.len() {
            break;
        }
    }
}

/// Puts a send that is not finished on the runtime, so it progresses on its own.
fn spawn(send: SendFut) -> InFlight {
    match tokio::runtime::Handle::try_current() {
        Ok(rt) => InFlight::Task(rt.spawn(send)),
        Err(_) => {
            trace!("stream write outside a Tokio runtime: driven by the stream's next calls");
            InFlight::Local(Exclusive::new(send))
        }
    }
}

/// A send's (or end of stream's) outcome as the stream reports it. After the peer closed its
/// side cleanly (its end of stream arrived) and then disconnected, what this side sends can
/// no longer arrive, and TCP still reports success (the kernel accepts a write after the
/// peer's FIN, and `shutdown` succeeds): so does the stream. The bytes are discarded.
fn outcome(conn: &Connection, res: Result<()>) -> io::Result<()> {
    match res {
        Ok(()) => Ok(()),
        Err(e) if peer_left_cleanly(conn, &e) => {
            trace!(error = %e, "the peer closed and left: discarding what this side sends");
            Ok(())
        }
        Err(e) => Err(io::Error::from(e)),
    }
}

/// Whether `e` is the disconnect that follows the peer's clean close (its end of stream was
/// received), not a failure.
fn peer_left_cleanly(conn: &Connection, e: &Error) -> bool {
    matches!(
        e,
        Error::QpFailed(QpFailure::Disconnected | QpFailure::Closed)
    ) && conn.shared.io.lock().proto.peer_closed()
}
