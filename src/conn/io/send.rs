//! Message sends on the connection's queue pair: the send queue's share, chunks (inline,
//! zero-copy or staged), signaled entries, and what a failed post does.

use std::task::Waker;

use tracing::warn;

use super::{ConnIo, ConnState, Held, SEND_BIT, Sent, Source};
use crate::buf::{Pool, PoolBuf};
use crate::driver::Deferred;
use crate::error::QpFailure;
use crate::proto::conn::Chunk;
use crate::verbs::{SendOp, SendWr, Sge};

/// The most messages [`ConnIo::post_inline_many`] posts as one chain (one `ibv_post_send`).
pub(crate) const SEND_CHAIN: usize = 16;

impl ConnIo {
    /// Hands out and posts, as one chained list (one `ibv_post_send`, one doorbell), the
    /// leading messages of `msgs` that can go at once as they are: each small enough to go
    /// inline (at most `max_inline` bytes), with a data credit, room in this side's share of
    /// the send queue and nothing queued before it ([`send_now`]), at most [`SEND_CHAIN`].
    /// Returns how many went (0: the first cannot go at once). The chunks are posted in the
    /// order they were handed out, before the lock is released: the wire order is the
    /// hand-out order, as for single sends.
    ///
    /// # Errors
    ///
    /// The state machine's refusal of the first message ([`send_now`]'s errors: too large,
    /// the connection failed); a refusal of a later one ends the chain and is left to the
    /// next send of that message. A failed post fails the connection
    /// ([`Error::QpFailed`](crate::Error::QpFailed)).
    ///
    /// [`send_now`]: crate::proto::conn::ConnProto::send_now
    pub(crate) fn post_inline_many<M: AsRef<[u8]>>(
        &self,
        s: &mut ConnState,
        msgs: &[M],
    ) -> crate::Result<usize> {
        let room = (self.sq_budget as usize).saturating_sub(s.sends.len());
        let mut imms = [0u32; SEND_CHAIN];
        let mut n = 0;
        for m in msgs.iter().take(SEND_CHAIN.min(room)) {
            let len = m.as_ref().len();
            if len > self.max_inline {
                break;
            }
            match s.proto.send_now(len as u64) {
                Ok(Some(chunk)) => {
                    imms[n] = chunk.imm;
                    n += 1;
                }
                Ok(None) => break,
                Err(e) if n == 0 => return Err(e),
                Err(_) => break,
            }
        }
        if n == 0 {
            return Ok(0);
        }
        let mut sges = [Sge::ZERO; SEND_CHAIN];
        for (sge, m) in sges.iter_mut().zip(&msgs[..n]) {
            let b = m.as_ref();
            // Inline: the device copies the bytes at post time, no key needed.
            *sge = Sge::new(b.as_ptr() as u64, b.len() as u32, 0);
        }
        let mut wrs = [SendWr::EMPTY; SEND_CHAIN];
        let mut seq = s.next_send;
        for i in 0..n {
            let len = msgs[i].as_ref().len();
            let list: &[Sge] = if len == 0 {
                &[]
            } else {
                std::slice::from_ref(&sges[i])
            };
            let signaled = self.signal(s, false);
            let wr_id = self.wr_base | u64::from(SEND_BIT | seq);
            wrs[i] = SendWr {
                inline: len > 0,
                signaled,
                ..SendWr::new(wr_id, SendOp::SendWithImm(imms[i]), list)
            };
            s.sent_bytes.inline += len as u64;
            seq = (seq + 1) & !SEND_BIT;
        }
        // Every entry with a payload is inline (at most `max_inline` bytes, the limit
        // `post_chunk`'s inline sends use), and these `wr_id`s are this connection's own (sink
        // bit and its key, `wr_base`): their completions come back to this sink.
        // SAFETY: the device copies the inline bytes during the call, and `msgs`, borrowed for
        // all of it, outlives it; no memory is named after it returns; the queue pair is driven.
        let posted = unsafe { self.qp.post_send(&wrs[..n]) };
        // Remembered whatever the post says: a request the device took before a failure
        // completes (flushed) against its entry. Inline entries hold no memory.
        for _ in 0..n {
            let seq = s.next_send;
            s.next_send = (seq + 1) & !SEND_BIT;
            s.sends.push_back((seq, Sent::Data(Held::Inline)));
        }
        match posted {
            Ok(()) => Ok(n),
            Err(e) => {
                self.post_failed(s, &e);
                Err(crate::Error::QpFailed(
                    s.proto.failure().cloned().unwrap_or(QpFailure::Flushed),
                ))
            }
        }
    }

    /// Whether a send can be posted now (room in this side's share of the send queue);
    /// otherwise registers `waker` for when a completion makes room.
    pub(crate) fn sq_ready(&self, s: &mut ConnState, waker: &Waker) -> bool {
        if self.sq_room(s) {
            return true;
        }
        if !s.sq_waiters.iter().any(|w| w.will_wake(waker)) {
            s.sq_waiters.push(waker.clone());
        }
        false
    }

    pub(crate) fn sq_room(&self, s: &ConnState) -> bool {
        (s.sends.len() as u32) < self.sq_budget
    }

    /// Whether a chunk of `len` bytes from `src` needs a staging buffer.
    pub(crate) fn needs_staging(&self, src: &Source<'_>, len: usize) -> bool {
        len > self.max_inline && matches!(src, Source::Copy(_))
    }

    /// Posts `chunk` of the message in `src`: inline when it fits, straight from registered
    /// bytes, or copied into the `staging` buffer (which the caller acquired; taken only
    /// then). A failed post fails the connection and returns `false`.
    pub(crate) fn post_chunk(
        &self,
        s: &mut ConnState,
        chunk: Chunk,
        src: Source<'_>,
        staging: &mut Option<PoolBuf>,
    ) -> bool {
        let range = chunk.offset as usize..(chunk.offset + u64::from(chunk.len)) as usize;
        let bytes = &src.bytes()[range.clone()];
        let seq = s.next_send;
        let wr_id = self.wr_base | u64::from(SEND_BIT | seq);
        let op = SendOp::SendWithImm(chunk.imm);
        let (sent, posted) = if bytes.len() <= self.max_inline {
            let sges;
            let list: &[Sge] = if bytes.is_empty() {
                &[]
            } else {
                // Inline: the device copies the bytes at post time, no key needed.
                sges = [Sge::new(bytes.as_ptr() as u64, bytes.len() as u32, 0)];
                &sges
            };
            let signaled = self.signal(s, false);
            let wr = SendWr {
                inline: !list.is_empty(),
                signaled,
                ..SendWr::new(wr_id, op, list)
            };
            s.sent_bytes.inline += bytes.len() as u64;
            // SAFETY: an inline payload is copied during the call; `bytes` outlives it.
            (Sent::Data(Held::Inline), unsafe {
                self.qp.post_send(&[wr])
            })
        } else if let Source::Registered(owner, lkey) | Source::Staged(owner, lkey) = src {
            let held = owner.slice(range);
            // The application waits for its buffer: the last chunk of the message always
            // asks for the completion that gives it back.
            let signaled = self.signal(s, true) || chunk.last;
            if signaled {
                s.unsignaled = 0;
                s.staged_unsignaled = 0;
            }
            let sge = [Sge::new(held.as_ptr() as u64, held.len() as u32, lkey)];
            let wr = SendWr {
                signaled,
                ..SendWr::new(wr_id, op, &sge)
            };
            if matches!(src, Source::Staged(..)) {
                s.sent_bytes.staged += held.len() as u64;
            } else {
                s.sent_bytes.zero_copy += held.len() as u64;
            }
            // SAFETY: `held` is registered in this QP's domain (`lkey`, checked by the caller),
            // immutable, and stays in `sends` until this send is retired by a completion.
            let r = unsafe { self.qp.post_send(&[wr]) };
            (Sent::Data(Held::User(held)), r)
        } else {
            let mut buf = staging
                .take()
                .expect("a staging buffer for a chunk that is not inline");
            buf.set_len(bytes.len());
            buf.copy_from_slice(bytes);
            let signaled = self.signal(s, true);
            let sge = [buf.sge(0..bytes.len())];
            let wr = SendWr {
                signaled,
                ..SendWr::new(wr_id, op, &sge)
            };
            s.sent_bytes.staged += bytes.len() as u64;
            // SAFETY: the staging buffer is registered in this queue pair's protection domain
            // and stays in `sends` (untouched) until this send is retired by a completion.
            let r = unsafe { self.qp.post_send(&[wr]) };
            (Sent::Data(Held::Staged(buf)), r)
        };
        match posted {
            Ok(()) => {
                s.next_send = (seq + 1) & !SEND_BIT;
                s.sends.push_back((seq, sent));
                true
            }
            Err(e) => {
                self.post_failed(s, &e);
                false
            }
        }
    }

    /// Posts one signaled work request on the send queue, remembered as `sent` until its
    /// completion. A failed post fails the connection and returns `false`.
    pub(crate) fn post_send_entry(
        &self,
        s: &mut ConnState,
        op: SendOp,
        sges: &[Sge],
        sent: Sent,
    ) -> bool {
        let seq = s.next_send;
        let wr = SendWr::new(self.wr_base | u64::from(SEND_BIT | seq), op, sges);
        // SAFETY: the callers' memory (a rendezvous destination in `ConnState::fetch`) stays
        // registered and alive until this request's completion retires `sent`.
        match unsafe { self.qp.post_send(&[wr]) } {
            Ok(()) => {
                s.next_send = (seq + 1) & !SEND_BIT;
                s.sends.push_back((seq, sent));
                s.unsignaled = 0;
                s.staged_unsignaled = 0;
                true
            }
            Err(e) => {
                self.post_failed(s, &e);
                false
            }
        }
    }

    /// Whether a rendezvous READ is on the device.
    pub(crate) fn fetch_on_device(&self, s: &ConnState) -> bool {
        s.sends
            .iter()
            .any(|(_, sent)| matches!(sent, Sent::Fetch { .. }))
    }

    /// Wakes `waker` at the next send completion.
    pub(crate) fn park_sq(&self, s: &mut ConnState, waker: &Waker) {
        if !s.sq_waiters.iter().any(|w| w.will_wake(waker)) {
            s.sq_waiters.push(waker.clone());
        }
    }

    /// The lkey under which the `len` bytes at `addr` can be sent (or received into) without
    /// copying: they lie in one of this connection's pools (`extra`: the application's pool of
    /// the connection, if made). An address range, not a slice: the bytes may be uninitialised
    /// memory a receive will fill.
    pub(crate) fn lkey_of(&self, addr: usize, len: usize, extra: Option<&Pool>) -> Option<u32> {
        extra
            .and_then(|p| p.lkey_of(addr, len))
            .or_else(|| self.pool.lkey_of(addr, len))
    }

    /// Whether the next send is signaled: often enough that the send queue and the staging
    /// buffers are always given back.
    pub(super) fn signal(&self, s: &mut ConnState, staged: bool) -> bool {
        s.unsignaled += 1;
        if staged {
            s.staged_unsignaled += 1;
        }
        let due = s.unsignaled >= self.signal_every || s.staged_unsignaled >= self.staged_signal;
        if due {
            s.unsignaled = 0;
            s.staged_unsignaled = 0;
        }
        due
    }

    pub(super) fn post_failed(&self, s: &mut ConnState, e: &crate::Error) {
        let errno = e.raw_os_error().unwrap_or(libc::EIO);
        warn!(error = %e, "posting on a connection failed");
        if s.proto.fail(QpFailure::PostFailed(errno)) {
            // Not here: this may run under the driver's lock (a refill from a completion).
            // No receive is posted from now on (see `in_error`).
            s.in_error = true;
            s.to_error = true;
        }
    }

    /// Wakes the tasks waiting for send-queue room.
    pub(super) fn wake_sq(s: &mut ConnState, wake: &mut Deferred) {
        for w in s.sq_waiters.drain(..) {
            wake.push(w);
        }
    }
}
