//! [`RdmaStream`]: a connection as a byte stream (`AsyncRead + AsyncWrite`), so Tokio codecs
//! and `AsyncReadExt`/`AsyncWriteExt` work unchanged.

mod exclusive;
mod read;
mod write;

pub use split::{OwnedReadHalf, OwnedWriteHalf, ReuniteError};

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use super::connection::Connection;
use read::ReadState;
use write::WriteState;

/// A byte stream over a [`Connection`]: each write becomes one message, reads consume
/// messages in order across their boundaries. `shutdown` sends end-of-stream (a half-close:
/// reads go on until the peer shuts down too); a read then returns 0 at the peer. Dropping the
/// stream closes the connection once the bytes already written are on their way.
///
/// # What a write promises
///
/// A write that returns `Ok(n)` has accepted `n` bytes: they reach the peer, in order, unless
/// the connection fails, whether or not the stream is flushed, polled again or dropped (as
/// with a `TcpStream`, whose kernel keeps sending what `write` accepted). A send that cannot
/// finish within the write's call goes on as a task of its own on the current Tokio runtime;
/// the next write, `flush` or `shutdown` waits for it and reports its outcome. `shutdown` may
/// be called any number of times.
///
/// One write accepts at most 256 KiB (a larger buffer gives a short count; `write_all`
/// loops), so one call never holds its worker thread for a whole large message.
///
/// After the peer closed its side cleanly (its end of stream arrived) and then disconnected
/// (it dropped its stream), writes, `flush` and `shutdown` return `Ok` and the bytes are
/// discarded, as with TCP, whose kernel accepts a write after the peer's FIN. A peer that
/// failed or vanished without end of stream is an error (`ConnectionReset`, ...).
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
    rd: ReadState,
    wr: WriteState,
}

// In this file, above `connection.rs`: the connection does not know its stream adapter.
impl Connection {
    /// Turns the connection into a byte stream (`AsyncRead + AsyncWrite`), for codecs.
    pub fn into_stream(self) -> RdmaStream {
        RdmaStream::new(self)
    }
}

impl RdmaStream {
    pub(crate) fn new(conn: Connection) -> RdmaStream {
        RdmaStream {
            conn: Arc::new(conn),
            rd: ReadState::new(),
            wr: WriteState::new(),
        }
    }

    /// The connection underneath.
    pub fn connection(&self) -> &Connection {
        &self.conn
    }

    /// The peer's address ([`Connection::peer_addr`]).
    ///
    /// # Errors
    ///
    /// As [`Connection::peer_addr`].
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn demo(stream: &tokio_rdma::conn::RdmaStream) -> std::io::Result<()> {
    /// println!("{} -> {}", stream.local_addr()?, stream.peer_addr()?);
    /// # Ok(()) }
    /// ```
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.conn.peer_addr()
    }

    /// This side's address ([`Connection::local_addr`]).
    ///
    /// # Errors
    ///
    /// As [`Connection::local_addr`].
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.conn.local_addr()
    }

    /// The connection underneath, if this stream holds the only reference to it: no write of
    /// the stream is still in flight (see "What a write promises"; `flush` first) and no
    /// other handle shares it. Bytes the stream received but nobody read yet are lost.
    ///
    /// # Errors
    ///
    /// The stream, unchanged, if the connection is still shared.
    pub fn into_inner(self) -> Result<Connection, RdmaStream> {
        let RdmaStream { conn, rd, wr } = self;
        Arc::try_unwrap(conn).map_err(|conn| RdmaStream { conn, rd, wr })
    }
}

impl std::fmt::Debug for RdmaStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaStream")
            .field("conn", &self.conn)
            .field("buffered", &self.rd.buffered())
            .field("eof", &self.rd.eof())
            .field("shut", &self.wr.is_shut())
            .finish_non_exhaustive()
    }
}

/// `AsyncRead` and `AsyncBufRead` for a type with `conn: Arc<Connection>` and `rd: ReadState`
/// (the stream and its read half). The stream holds one whole received message at a time:
/// `poll_fill_buf` hands out the unread rest of it, without copying.
macro_rules! read_impls {
    ($t:ty) => {
        impl tokio::io::AsyncRead for $t {
            fn poll_read(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                out: &mut tokio::io::ReadBuf<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                let this = &mut *self;
                this.rd.poll_read(&this.conn, cx, out)
            }
        }

        impl tokio::io::AsyncBufRead for $t {
            fn poll_fill_buf(
                self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<&[u8]>> {
                let this = self.get_mut();
                this.rd.poll_fill_buf(&this.conn, cx)
            }

            fn consume(mut self: std::pin::Pin<&mut Self>, amt: usize) {
                self.rd.consume(amt);
            }
        }
    };
}

/// `AsyncWrite` for a type with `conn: Arc<Connection>` and `wr: WriteState` (the stream and
/// its write half). Vectored writes gather the slices into one message, copied once into a
/// staging buffer of the connection and sent from there (see `write.rs`).
macro_rules! write_impls {
    ($t:ty) => {
        impl tokio::io::AsyncWrite for $t {
            fn poll_write(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                buf: &[u8],
            ) -> std::task::Poll<std::io::Result<usize>> {
                let this = &mut *self;
                this.wr
                    .poll_write(&this.conn, cx, &[std::io::IoSlice::new(buf)])
            }

            fn poll_write_vectored(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                bufs: &[std::io::IoSlice<'_>],
            ) -> std::task::Poll<std::io::Result<usize>> {
                let this = &mut *self;
                this.wr.poll_write(&this.conn, cx, bufs)
            }

            fn is_write_vectored(&self) -> bool {
                true
            }

            fn poll_flush(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                let this = &mut *self;
                this.wr.poll_flush(&this.conn, cx)
            }

            fn poll_shutdown(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                let this = &mut *self;
                this.wr.poll_shutdown(&this.conn, cx)
            }
        }
    };
}

read_impls!(RdmaStream);
write_impls!(RdmaStream);

// After the macros, which it uses for the halves.
mod split;

#[cfg(test)]
mod tests {
    /// `RdmaStream` and its halves are `Send + Sync`, as `TcpStream` and its halves are.
    #[test]
    fn stream_and_halves_are_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<super::RdmaStream>();
        check::<super::OwnedReadHalf>();
        check::<super::OwnedWriteHalf>();
    }
}
