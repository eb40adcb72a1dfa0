//! Owned halves of an [`RdmaStream`], as [`TcpStream::into_split`](tokio::net::TcpStream::into_split)
//! gives: each half owns its direction's state and shares the connection, with no lock
//! between them (unlike `tokio::io::split`).

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use super::RdmaStream;
use super::read::ReadState;
use super::write::WriteState;
use crate::conn::Connection;

/// The read half of an [`RdmaStream`], from [`RdmaStream::into_split`]. Reads (and
/// `AsyncBufRead`) as the stream does.
pub struct OwnedReadHalf {
    pub(super) conn: Arc<Connection>,
    pub(super) rd: ReadState,
}

/// The write half of an [`RdmaStream`], from [`RdmaStream::into_split`]. Writes as the stream
/// does; dropping it shuts the direction down (end of stream goes out after the bytes already
/// written, the peer reads EOF), as dropping a `TcpStream`'s `OwnedWriteHalf` does. The
/// connection itself closes once both halves are gone.
pub struct OwnedWriteHalf {
    pub(super) conn: Arc<Connection>,
    pub(super) wr: WriteState,
    /// Set by `reunite`: the direction stays open.
    reunited: bool,
}

/// The halves given to [`OwnedReadHalf::reunite`] were not split from the same stream; both
/// are given back.
#[derive(Debug)]
pub struct ReuniteError(pub OwnedReadHalf, pub OwnedWriteHalf);

impl fmt::Display for ReuniteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("tried to reunite halves that are not from the same RdmaStream")
    }
}

impl std::error::Error for ReuniteError {}

impl RdmaStream {
    /// Splits the stream into a read half and a write half that can be used from different
    /// tasks at once, without a lock between them (`tokio::io::split` takes one). Dropping the
    /// write half shuts the write direction down; the connection closes once both halves are
    /// dropped. [`OwnedReadHalf::reunite`] puts them back together.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use tokio::io::{AsyncReadExt, AsyncWriteExt};
    /// # async fn demo(stream: tokio_rdma::conn::RdmaStream) -> std::io::Result<()> {
    /// let (mut rd, mut wr) = stream.into_split();
    /// let echo = tokio::spawn(async move {
    ///     let mut buf = vec![0u8; 4096];
    ///     let n = rd.read(&mut buf).await?;
    ///     Ok::<_, std::io::Error>(buf[..n].to_vec())
    /// });
    /// wr.write_all(b"hello").await?;
    /// drop(wr); // end of stream: the peer reads EOF after "hello"
    /// let _reply = echo.await.expect("task")?;
    /// # Ok(()) }
    /// ```
    pub fn into_split(self) -> (OwnedReadHalf, OwnedWriteHalf) {
        let RdmaStream { conn, rd, wr } = self;
        (
            OwnedReadHalf {
                conn: conn.clone(),
                rd,
            },
            OwnedWriteHalf {
                conn,
                wr,
                reunited: false,
            },
        )
    }
}

impl OwnedReadHalf {
    /// Puts the halves back together into the stream they came from.
    ///
    /// # Errors
    ///
    /// [`ReuniteError`] (with both halves) if they come from different streams.
    #[allow(
        clippy::result_large_err,
        reason = "both halves come back on error, as tokio's ReuniteError does"
    )]
    pub fn reunite(self, mut other: OwnedWriteHalf) -> Result<RdmaStream, ReuniteError> {
        if !Arc::ptr_eq(&self.conn, &other.conn) {
            return Err(ReuniteError(self, other));
        }
        other.reunited = true;
        let wr = std::mem::replace(&mut other.wr, WriteState::new());
        Ok(RdmaStream {
            conn: self.conn,
            rd: self.rd,
            wr,
        })
    }

    /// The connection underneath.
    pub fn connection(&self) -> &Connection {
        &self.conn
    }

    /// The peer's address, as [`RdmaStream::peer_addr`].
    ///
    /// # Errors
    ///
    /// As [`RdmaStream::peer_addr`].
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.conn.peer_addr()
    }

    /// This side's address, as [`RdmaStream::local_addr`].
    ///
    /// # Errors
    ///
    /// As [`RdmaStream::local_addr`].
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.conn.local_addr()
    }
}

impl OwnedWriteHalf {
    /// Puts the halves back together, as [`OwnedReadHalf::reunite`].
    ///
    /// # Errors
    ///
    /// As [`OwnedReadHalf::reunite`].
    #[allow(
        clippy::result_large_err,
        reason = "both halves come back on error, as tokio's ReuniteError does"
    )]
    pub fn reunite(self, other: OwnedReadHalf) -> Result<RdmaStream, ReuniteError> {
        other.reunite(self)
    }

    /// The connection underneath.
    pub fn connection(&self) -> &Connection {
        &self.conn
    }

    /// The peer's address, as [`RdmaStream::peer_addr`].
    ///
    /// # Errors
    ///
    /// As [`RdmaStream::peer_addr`].
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.conn.peer_addr()
    }

    /// This side's address, as [`RdmaStream::local_addr`].
    ///
    /// # Errors
    ///
    /// As [`RdmaStream::local_addr`].
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.conn.local_addr()
    }
}

impl Drop for OwnedWriteHalf {
    fn drop(&mut self) {
        if !self.reunited && !self.wr.is_shut() {
            // End of stream after the messages already accepted (a write still in flight
            // took its place in the order when it was accepted).
            let shared = &self.conn.shared;
            super::super::lifecycle::close(shared, super::super::observe::ClosedBy::Drop, false);
        }
    }
}

impl fmt::Debug for OwnedReadHalf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OwnedReadHalf")
            .field("conn", &self.conn)
            .field("buffered", &self.rd.buffered())
            .field("eof", &self.rd.eof())
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for OwnedWriteHalf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OwnedWriteHalf")
            .field("conn", &self.conn)
            .field("shut", &self.wr.is_shut())
            .finish_non_exhaustive()
    }
}

read_impls!(OwnedReadHalf);
write_impls!(OwnedWriteHalf);
