//! [`RdmaStream`]: a connection as a byte stream (`AsyncRead + AsyncWrite`), so Tokio codecs
//! and `AsyncReadExt`/`AsyncWriteExt` work unchanged.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::connection::Connection;
use super::shared::Message;
use crate::error::Result;

type BoxFut<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// A byte stream over a [`Connection`]: each write becomes one message, reads consume
/// messages in order across their boundaries. `shutdown` sends end-of-stream (a half-close:
/// reads go on until the peer shuts down too); a read then returns 0 at the peer. Dropping the
/// stream closes the connection.
///
/// A write returns as soon as its bytes are copied for sending; the send's outcome is reported
/// by the next write, `flush` or `shutdown`.
///
/// # Examples
///
/// ```no_run
/// use tokio::io::{AsyncReadExt, AsyncWriteExt};
/// # async fn demo(conn: tokio_rdma::conn::Connection) -> std::io::Result<()> {
/// let mut stream = conn.into_stream();
/// stream.write_all(b"ping").await?;
/// stream.flush().await?;
/// let mut buf = [0u8; 4];
/// stream.read_exact(&mut buf).await?;
/// stream.shutdown().await?;
/// # Ok(()) }
/// ```
pub struct RdmaStream {
    conn: Arc<Connection>,
    read_buf: Bytes,
    reading: Option<BoxFut<Result<Option<Message>>>>,
    eof: bool,
    writing: Option<BoxFut<Result<()>>>,
    closing: Option<BoxFut<Result<()>>>,
}

impl RdmaStream {
    pub(crate) fn new(conn: Connection) -> RdmaStream {
        RdmaStream {
            conn: Arc::new(conn),
            read_buf: Bytes::new(),
            reading: None,
            eof: false,
            writing: None,
            closing: None,
        }
    }

    /// The connection underneath.
    pub fn connection(&self) -> &Connection {
        &self.conn
    }

    fn poll_pending_write(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Some(fut) = self.writing.as_mut() {
            let res = ready!(fut.as_mut().poll(cx));
            self.writing = None;
            res.map_err(io::Error::from)?;
        }
        Poll::Ready(Ok(()))
    }
}

impl std::fmt::Debug for RdmaStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaStream")
            .field("conn", &self.conn)
            .field("buffered", &self.read_buf.len())
            .field("eof", &self.eof)
            .finish_non_exhaustive()
    }
}

impl AsyncRead for RdmaStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        while this.read_buf.is_empty() && !this.eof {
            let fut = this.reading.get_or_insert_with(|| {
                let conn = this.conn.clone();
                Box::pin(async move { conn.recv().await })
            });
            let res = ready!(fut.as_mut().poll(cx));
            this.reading = None;
            match res.map_err(io::Error::from)? {
                Some(msg) => this.read_buf = msg.into_bytes(),
                None => this.eof = true,
            }
        }
        let n = out.remaining().min(this.read_buf.len());
        out.put_slice(&this.read_buf[..n]);
        this.read_buf.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for RdmaStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        ready!(this.poll_pending_write(cx))?;
        let limit = usize::try_from(this.conn.params().max_message_size).unwrap_or(usize::MAX);
        let n = buf.len().min(limit);
        let data = buf[..n].to_vec();
        let conn = this.conn.clone();
        this.writing = Some(Box::pin(async move { conn.send(&data).await }));
        // Start it now so the bytes are on their way even if nobody flushes.
        if let Some(fut) = this.writing.as_mut() {
            if let Poll::Ready(res) = fut.as_mut().poll(cx) {
                this.writing = None;
                res.map_err(io::Error::from)?;
            }
        }
        Poll::Ready(Ok(n))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.poll_pending_write(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        ready!(this.poll_pending_write(cx))?;
        let fut = this.closing.get_or_insert_with(|| {
            let conn = this.conn.clone();
            Box::pin(async move { conn.shutdown().await })
        });
        let res = ready!(fut.as_mut().poll(cx));
        Poll::Ready(res.map_err(io::Error::from))
    }
}
