//! Receiving messages on a [`Connection`] ([`recv`](Connection::recv),
//! [`recv_into`](Connection::recv_into)), rendezvous messages included: the shell side of
//! [`proto::conn`](crate::proto::conn)'s rendezvous. The sender opens exactly the message's
//! memory to this peer for reading (`rdv_memory.rs`: a registration of its own, in the
//! connection's protection domain, kept with the bytes until the peer acknowledged); the
//! receiver reads it straight into its destination with RDMA READs posted on the connection's
//! queue pair and driven by its completions (`io/fetch.rs`), and `recv_into` lets that
//! destination be the caller's own buffer.

use std::task::Poll;

use super::connection::Connection;
use super::io::ConnIo;
use super::progress::Progress;
use super::rdv_memory::{Fetch, FetchBuf, UserDest, zeroed};
use super::shared::Message;
use crate::buf::{IoBufMut, PoolBuf};
use crate::error::{Error, InvalidArgument, Result};
use crate::proto::conn::{Delivery, RemoteMsg};

/// Marks the caller's fetch as nobody's when a `recv_into` is dropped while the device writes
/// into its buffer: the next receive then takes the message.
struct Lent<'a> {
    io: &'a ConnIo,
    owner: u64,
    armed: bool,
}

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        if self.armed {
            let owner = self.owner;
            self.io.with(|s| {
                if let Some(f) = s.fetch.as_mut().filter(|f| f.owner == owner) {
                    f.owner = 0;
                    s.proto.wake_receivers();
                }
            });
        }
    }
}

/// What a receive found.
enum Next {
    /// A message in the connection's buffers (or end of stream).
    Local(Option<Delivery<PoolBuf>>),
    /// A rendezvous message to read.
    Remote(RemoteMsg),
    /// A rendezvous message read and taken (boxed: every receive moves a `Next` around, and
    /// a small message's should not move a whole `Fetch`).
    Fetched(Box<Fetch>),
    /// A batch's receive ([`Connection::recv_many`]): this many messages were appended to
    /// its vector, in the same look at the state.
    Taken(usize),
}

/// Where a batch's receive puts the messages it takes (see [`Connection::recv_many`]).
struct Batch<'v> {
    out: &'v mut Vec<Message>,
    limit: usize,
}

fn too_big(len: u64, cap: usize) -> Error {
    Error::InvalidArgument(InvalidArgument::RecvBufferTooSmall { len, capacity: cap })
}

impl Connection {
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
    /// [`Error::MemoryBudgetExhausted`](crate::Error::MemoryBudgetExhausted) if the next
    /// message is a rendezvous message whose buffer the endpoint's memory budget cannot take
    /// now: the connection is fine and the message stays queued (call again later, or read it
    /// into your own buffer with [`recv_into`](Self::recv_into)).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a message leaves the connection only when this returns it; any number of
    /// tasks may wait at once.
    pub async fn recv(&self) -> Result<Option<Message>> {
        let io = &self.shared.io;
        let mut wait = Progress::receiving(self);
        loop {
            match self.next(&mut wait, None, 0, None).await? {
                Next::Local(d) => return Ok(d.map(|d| Message::new(d, io.clone()))),
                Next::Remote(m) => self.fetch_remote(m).await?,
                Next::Fetched(f) => return Ok(Some(self.fetched_message(*f))),
                Next::Taken(_) => unreachable!("no batch given"),
            }
        }
    }

    /// Waits for the next message of the caller `owner` (0: `recv`); with `fits`, a message
    /// larger than that stays queued and [`Error::InvalidArgument`] says so.
    ///
    /// With `batch`, a message in the connection's buffers is not returned but appended to
    /// the batch's vector with every one already queued behind it (up to its limit, and up to
    /// the first rendezvous message), under the same lock: [`Next::Taken`].
    async fn next(
        &self,
        wait: &mut Progress<'_>,
        fits: Option<usize>,
        owner: u64,
        mut batch: Option<Batch<'_>>,
    ) -> Result<Next> {
        let io = &self.shared.io;
        wait.run(|s, cx| {
            if let Some(f) = s
                .fetch
                .as_ref()
                .filter(|_| s.proto.fetch_ready() == Some(true))
            {
                if f.owner != 0 && f.owner != owner {
                    // Another live `recv_into`'s buffer: that call takes it.
                    s.proto.park_recv(cx);
                    return Poll::Pending;
                }
                if let Some(cap) = fits.filter(|&c| f.owner != owner && f.len() > c as u64) {
                    return Poll::Ready(Err(too_big(f.len(), cap)));
                }
                let f = s.fetch.take().expect("checked");
                s.proto.fetch_taken();
                return Poll::Ready(Ok(Next::Fetched(Box::new(f))));
            }
            if let Some(d) = s.proto.peek_recv() {
                if let Some(cap) = fits.filter(|&c| d.len() > c) {
                    return Poll::Ready(Err(too_big(d.len() as u64, cap)));
                }
                if let Delivery::Remote(m) = d {
                    return Poll::Ready(Ok(Next::Remote(*m)));
                }
            }
            let Some(b) = batch.as_mut() else {
                return s.proto.poll_recv(cx).map(|r| r.map(Next::Local));
            };
            match std::task::ready!(s.proto.poll_recv(cx)) {
                Ok(Some(d)) => {
                    b.out.push(Message::new(d, io.clone()));
                    let mut n = 1;
                    // What is queued behind it, as long as it is a message in the connection's
                    // buffers (`peek_recv` shows none while a rendezvous read is under way).
                    while n < b.limit
                        && s.proto
                            .peek_recv()
                            .is_some_and(|d| !matches!(d, Delivery::Remote(_)))
                    {
                        let Poll::Ready(Ok(Some(d))) = s.proto.poll_recv(cx) else {
                            unreachable!("peeked a local message");
                        };
                        b.out.push(Message::new(d, io.clone()));
                        n += 1;
                    }
                    Poll::Ready(Ok(Next::Taken(n)))
                }
                r => Poll::Ready(r.map(Next::Local)),
            }
        })
        .await
    }

    /// Starts reading `fetch` if its message is still the next one (another receive may have
    /// taken it meanwhile: then the fetch comes back).
    fn start_fetch(&self, fetch: Fetch) -> Option<Fetch> {
        self.shared.io.with(|s| {
            // Compared whole by the state machine: other receivers may have taken it, and as
            // many as 65,536 more, while this one registered its destination without the lock.
            if !s.proto.take_remote(&fetch.msg) {
                return Some(fetch);
            }
            s.fetch = Some(fetch);
            // The pump (after this closure) posts the reads.
            None
        })
    }

    /// Receives up to `limit` messages at once and appends them to `out`, oldest first:
    /// waits for the first as [`recv`](Self::recv) does, then takes every message already
    /// delivered behind it, up to `limit` in all, in the same look at the connection's state
    /// (one lock and one look for the batch, where a `recv` per message takes one each).
    /// Returns how many it appended. `Ok(0)` means the peer closed its side cleanly after
    /// every message it sent (or `limit` is 0: then it returns at once). A rendezvous message
    /// (read into a buffer of its own, as `recv` does) ends a batch: it comes alone, or
    /// stays queued for the next call behind the messages taken before it.
    ///
    /// Like [`tokio::sync::mpsc::Receiver::recv_many`]: `out` keeps what it held, and one
    /// vector reused with a fixed capacity takes batches without allocating. Each
    /// [`Message`] counts against the receive budget until dropped, as with `recv`.
    ///
    /// # Errors
    ///
    /// As [`recv`](Self::recv). An error appends nothing.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: messages are appended to `out` only in the poll that returns, so a
    /// future dropped before it completes has taken nothing; any number of tasks may wait at
    /// once.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo(conn: tokio_rdma::conn::Connection) -> tokio_rdma::Result<()> {
    /// let mut batch = Vec::with_capacity(32);
    /// while conn.recv_many(&mut batch, 32).await? > 0 {
    ///     for msg in batch.drain(..) {
    ///         println!("{} bytes", msg.len()); // dropping `msg` returns its credit
    ///     }
    /// }
    /// // The peer closed cleanly after its last message.
    /// # Ok(()) }
    /// ```
    pub async fn recv_many(&self, out: &mut Vec<Message>, limit: usize) -> Result<usize> {
        if limit == 0 {
            return Ok(0);
        }
        let mut wait = Progress::receiving(self);
        loop {
            let batch = Batch {
                out: &mut *out,
                limit,
            };
            match self.next(&mut wait, None, 0, Some(batch)).await? {
                Next::Taken(n) => return Ok(n),
                Next::Local(None) => return Ok(0),
                Next::Local(Some(_)) => unreachable!("a batch takes local messages"),
                Next::Remote(m) => self.fetch_remote(m).await?,
                Next::Fetched(f) => {
                    out.push(self.fetched_message(*f));
                    return Ok(1);
                }
            }
        }
    }

    /// Reads the rendezvous message `m` into a buffer of its own (in the endpoint's memory
    /// budget, or refused with the message left queued: see `MemoryBudgetExhausted`); the
    /// next look of the receive takes it ([`Next::Fetched`]).
    async fn fetch_remote(&self, m: RemoteMsg) -> Result<()> {
        let reserved = self.shared.memory.budget().reserve(m.len)?;
        // Allocated and registered outside the connection's lock.
        let mut v = zeroed(m.len as usize)?;
        let at = (v.as_mut_ptr() as usize, None);
        let mut fetch = Fetch::open(&self.shared.pd, m, at, Box::new(v), 0)
            .await
            .map_err(|(e, _)| e)?;
        fetch.reserved = Some(reserved);
        drop(self.start_fetch(fetch));
        Ok(())
    }

    /// A rendezvous message read into a buffer of its own, as a [`Message`].
    fn fetched_message(&self, f: Fetch) -> Message {
        let io = &self.shared.io;
        let len = f.len() as usize;
        let (v, copied) = f.into_dest().into_vec(len);
        if copied {
            // A dropped `recv_into`'s buffer: the one copy on this path.
            io.with(|s| s.recv_bytes.copied += len as u64);
        }
        Message::new(Delivery::Assembled(v), io.clone())
    }

    /// Receives the next message into `buf` (its whole capacity,
    /// [`bytes_total`](crate::buf::IoBuf::bytes_total)), returning the message's length, or
    /// `None` at the peer's end of stream. A rendezvous message (see
    /// [`ConnectOptions::rendezvous_threshold`](super::ConnectOptions::rendezvous_threshold))
    /// is read by the device straight into `buf`: no copy, however large (memory of this
    /// connection's [`pool`](Self::pool) is used as it is, other memory is registered for the
    /// read). A message that came in the connection's receive buffers is copied into `buf`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] if the next message is larger than `buf` (it stays queued:
    /// receive it with a larger buffer, or [`recv`](Self::recv)); registration errors for
    /// `buf`; the connection's failure (`buf` comes back once the device is done with it).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe for messages: dropped before the read into `buf` started, nothing
    /// happened. Dropped while the device writes into `buf`, the connection keeps `buf` until
    /// the read completed, then delivers the message to the next receive (copied once) and
    /// drops `buf`: it is not returned.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo(conn: tokio_rdma::conn::Connection) -> tokio_rdma::Result<()> {
    /// let buf = vec![0u8; 16 << 20];
    /// let (got, buf) = conn.recv_into(buf).await;
    /// if let Some(len) = got? {
    ///     println!("{len} bytes, first {}", buf[0]);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn recv_into<B>(&self, buf: B) -> (Result<Option<usize>>, B)
    where
        B: IoBufMut + std::fmt::Debug,
    {
        let io = &self.shared.io;
        let owner = io.with(|s| {
            s.next_owner += 1;
            s.next_owner
        });
        let cap = buf.bytes_total();
        let mut wait = Progress::receiving(self);
        let mut lent = Lent {
            io,
            owner,
            armed: false,
        };
        let mut buf = Some(buf);
        loop {
            let next = match self.next(&mut wait, Some(cap), owner, None).await {
                Ok(n) => n,
                Err(e) => {
                    let b = match buf.take() {
                        Some(b) => b,
                        None => self.reclaim(&mut wait, owner).await,
                    };
                    lent.armed = false;
                    return (Err(e), b);
                }
            };
            let fetched = |b: &mut B, len: usize, copied: bool| {
                io.with(|s| {
                    if copied {
                        s.recv_bytes.copied += len as u64;
                    }
                    // The bytes are the caller's now, not the connection's.
                    s.proto.consumed(false, len);
                });
                // SAFETY: `len` bytes were written (by the device or copied).
                unsafe { b.set_init(len) };
            };
            match next {
                Next::Taken(_) => unreachable!("no batch given"),
                Next::Local(None) => return (Ok(None), buf.expect("not lent: no read")),
                Next::Local(Some(d)) => {
                    let mut b = buf.expect("not lent: no read");
                    let msg = Message::new(d, io.clone());
                    copy_into(&mut b, &msg);
                    io.with(|s| s.recv_bytes.copied += msg.len() as u64);
                    return (Ok(Some(msg.len())), b);
                }
                Next::Remote(m) => {
                    let mut b = buf.take().expect("not lent: no read");
                    let ptr = b.stable_mut_ptr();
                    // The capacity may be uninitialised: only its address range is looked up.
                    let lkey = io.lkey_of(ptr as usize, cap, self.user_pool.get());
                    let dest = Box::new(UserDest(b));
                    // Registered inline: dropped at any await, this call must leave either nothing
                    // started or a read under way (tests/conn_rendezvous.rs relies on it).
                    match Fetch::new(&self.shared.pd, m, (ptr, lkey), dest, owner) {
                        Err((e, dest)) => return (Err(e), take_user(dest)),
                        Ok(f) => match self.start_fetch(f) {
                            Some(back) => buf = Some(take_user(back.into_dest())),
                            None => lent.armed = true,
                        },
                    }
                }
                Next::Fetched(f) if f.owner == owner => {
                    lent.armed = false;
                    let len = f.len() as usize;
                    let mut b: B = take_user(f.into_dest());
                    fetched(&mut b, len, false);
                    return (Ok(Some(len)), b);
                }
                Next::Fetched(f) => {
                    // Another receive's read, whose future was dropped: copied once.
                    let mut b = buf.expect("not lent: no read");
                    let len = f.len() as usize;
                    copy_into(&mut b, f.dest.bytes(len));
                    fetched(&mut b, len, true);
                    return (Ok(Some(len)), b);
                }
            }
        }
    }

    /// After a failure: the caller's buffer, once no read into it is on the device.
    async fn reclaim<B: IoBufMut + std::fmt::Debug>(
        &self,
        wait: &mut Progress<'_>,
        owner: u64,
    ) -> B {
        let io = &self.shared.io;
        let dest = wait
            .run(|s, cx| {
                if io.fetch_on_device(s) {
                    io.park_sq(s, cx.waker());
                    return Poll::Pending;
                }
                let f = s.fetch.take_if(|f| f.owner == owner);
                Poll::Ready(Ok(
                    f.expect("a live recv_into's fetch stays until it takes it")
                ))
            })
            .await
            .expect("never fails");
        take_user(dest.into_dest())
    }
}

fn take_user<B: IoBufMut + std::fmt::Debug>(dest: Box<dyn FetchBuf>) -> B {
    match dest.into_any().downcast::<UserDest<B>>() {
        Ok(d) => d.0,
        Err(_) => unreachable!("a fetch returns the destination it was given"),
    }
}

fn copy_into<B: IoBufMut>(buf: &mut B, bytes: &[u8]) {
    assert!(bytes.len() <= buf.bytes_total());
    // SAFETY: `buf` has `bytes_total()` bytes of stable writable memory, the source is
    // another allocation, and the copied bytes are then initialised.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.stable_mut_ptr(), bytes.len());
        buf.set_init(bytes.len());
    }
}
