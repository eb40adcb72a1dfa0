//! The read side of an [`RdmaStream`](super::RdmaStream): received messages consumed in order
//! across their boundaries. The stream holds one whole received message at a time (without
//! copying it), which is what `AsyncBufRead::poll_fill_buf` hands out.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes};
use tokio::io::ReadBuf;

use super::exclusive::Exclusive;
use crate::conn::{Connection, Message};
use crate::error::Result;

type RecvFut = Pin<Box<dyn Future<Output = Result<Option<Message>>> + Send>>;

/// The read side's state (see the module docs).
pub(super) struct ReadState {
    /// The rest of the message being read (its receive budget is held until it is consumed).
    buf: Bytes,
    /// A receive in progress (`Connection::recv` is cancel safe, so dropping it loses nothing).
    reading: Option<Exclusive<RecvFut>>,
    /// The peer's end of stream was read.
    eof: bool,
}

impl ReadState {
    pub(super) fn new() -> ReadState {
        ReadState {
            buf: Bytes::new(),
            reading: None,
            eof: false,
        }
    }

    /// Bytes of the current message not read yet.
    pub(super) fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Whether end of stream was read.
    pub(super) fn eof(&self) -> bool {
        self.eof
    }

    /// The unread rest of the current message, receiving the next one if it is empty; empty
    /// at end of stream.
    pub(super) fn poll_fill_buf(
        &mut self,
        conn: &Arc<Connection>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<&[u8]>> {
        while self.buf.is_empty() && !self.eof {
            let fut = self.reading.get_or_insert_with(|| {
                let conn = conn.clone();
                Exclusive::new(Box::pin(async move { conn.recv().await }))
            });
            let res = ready!(fut.get_mut().as_mut().poll(cx));
            self.reading = None;
            match res.map_err(io::Error::from)? {
                Some(msg) => self.buf = msg.into_bytes(),
                None => self.eof = true,
            }
        }
        Poll::Ready(Ok(&self.buf[..]))
    }

    pub(super) fn consume(&mut self, n: usize) {
        self.buf.advance(n.min(self.buf.len()));
    }

    pub(super) fn poll_read(
        &mut self,
        conn: &Arc<Connection>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let avail = ready!(self.poll_fill_buf(conn, cx))?;
        let n = out.remaining().min(avail.len());
        out.put_slice(&avail[..n]);
        self.consume(n);
        Poll::Ready(Ok(()))
    }
}
