//! [`Batch`]: sends and writes posted as one chained list (one doorbell), of which only the
//! last asks for a work completion.
//!
//! A send queue completes its requests in order, so the last one's completion says the others
//! are done: the ring links them to it ([`Ring::link_batch`](super::ring::Ring)) and completes
//! them with it. A request of the batch that fails gets a completion of its own (the verbs
//! report errors and flushes whether a request was signaled or not).

use tracing::warn;

use super::pending::{Entries, Item, MAX_BATCH};
use super::ring::{Kind, Ticket};
use super::{OwnedQp, Sges, send_op, write_op};
use crate::buf::RemoteToken;
use crate::error::{Error, InvalidArgument, Result};
use crate::ops::{SgSource, SgTarget};
use crate::verbs::{SendOp, SendWr};

/// Sends and writes of an [`OwnedQp`] gathered to be posted together: one `ibv_post_send`
/// (one doorbell) for all of them, and one work completion, the last one's, for all of them.
/// Made by [`OwnedQp::batch`].
///
/// Each request gets its [`Ticket`] (and its slot owns its buffer) when it is added; it
/// reaches the device when the batch is posted ([`post`](Self::post), or dropping the batch).
/// Its outcome is taken as any other's ([`OwnedQp::wait`], [`OwnedQp::next_completion`]):
/// the requests of a batch complete together, oldest first. A batch forgotten with
/// `mem::forget` is posted by the queue pair's next post, wait or batch (or, if the queue pair
/// is dropped first, its buffers are dropped with it: they never reached the device).
///
/// # Examples
///
/// ```no_run
/// # use tokio_rdma::buf::RemoteToken;
/// # use tokio_rdma::owned::OwnedQp;
/// # use tokio_rdma::verbs::RegisteredBuffer;
/// # async fn demo(
/// #     qp: &mut OwnedQp<RegisteredBuffer>,
/// #     bufs: Vec<RegisteredBuffer>,
/// #     remote: RemoteToken,
/// # ) -> tokio_rdma::Result<()> {
/// // Four writes to consecutive 64-byte slots of the peer's region, one doorbell.
/// let mut batch = qp.batch();
/// for (k, buf) in bufs.into_iter().take(4).enumerate() {
///     let to = remote.slice(64 * k as u64..64 * (k as u64 + 1))?;
///     let _ticket = batch.write(buf, to, None).map_err(|(e, _buf)| e)?;
/// }
/// batch.post().map_err(|(e, _bufs)| e)?;
/// while let Some((_ticket, res, _buf)) = qp.next_completion().await {
///     res?;
/// }
/// # Ok(()) }
/// ```
#[must_use = "a batch is posted by `post()` (or when dropped)"]
pub struct Batch<'a, B: SgSource + SgTarget> {
    qp: &'a mut OwnedQp<B>,
}

impl<B: SgSource + SgTarget> OwnedQp<B> {
    /// Starts a batch of sends and writes, posted together (see [`Batch`]).
    pub fn batch(&mut self) -> Batch<'_, B> {
        self.post_forgotten();
        Batch { qp: self }
    }

    /// Posts the requests of a batch that was neither posted nor dropped (`mem::forget`): the
    /// queue pair's next post, wait or batch sends them first, so their tickets still resolve.
    #[inline]
    pub(super) fn post_forgotten(&mut self) {
        if !self.batch.is_empty() {
            self.post_forgotten_now();
        }
    }

    #[cold]
    fn post_forgotten_now(&mut self) {
        warn!(
            requests = self.batch.len(),
            "posting a batch that was forgotten"
        );
        drop(Batch { qp: self });
    }

    /// The buffers of a forgotten batch's requests, which never reached the device (the queue
    /// pair is being dropped).
    pub(super) fn unpost_forgotten(&mut self) -> Vec<B> {
        self.unpost_batch_from(0)
    }

    /// Ends the batch being filled: its requests from `from` on, which are not on the device,
    /// give their slots up and their buffers back (those before `from` stay in flight).
    fn unpost_batch_from(&mut self, from: usize) -> Vec<B> {
        let owner = self.ring.owner();
        let mut back = Vec::with_capacity(self.batch.len().saturating_sub(from));
        for it in self.batch.drain(from..) {
            back.push(self.ring.unpost(Ticket {
                owner,
                slot: it.slot,
                generation: it.generation,
            }));
        }
        self.batch.clear();
        self.batch_sges.clear();
        back
    }
}

impl<B: SgSource + SgTarget> Batch<'_, B> {
    /// Adds an RDMA WRITE of `buf`'s initialised bytes to the start of `remote` (with immediate
    /// data if `imm` is given), as [`OwnedQp::post_write`] does but posted with the batch.
    ///
    /// # Errors
    ///
    /// As [`OwnedQp::post_write`] (except [`Error::PostSend`], which [`post`](Self::post)
    /// reports), and [`InvalidArgument::BatchFull`] once the batch holds [`MAX_BATCH`]
    /// requests. The buffer comes back with the error.
    pub fn write(
        &mut self,
        buf: B,
        remote: RemoteToken,
        imm: Option<u32>,
    ) -> Result<Ticket, (Error, B)> {
        self.add(buf, write_op(remote, imm))
    }

    /// Adds a send of `buf`'s initialised bytes (with immediate data if `imm` is given), as
    /// [`OwnedQp::post_send`] does but posted with the batch.
    ///
    /// # Errors
    ///
    /// As [`write`](Self::write).
    pub fn send(&mut self, buf: B, imm: Option<u32>) -> Result<Ticket, (Error, B)> {
        self.add(buf, send_op(imm))
    }

    /// Requests in the batch.
    pub fn len(&self) -> usize {
        self.qp.batch.len()
    }

    /// Whether the batch holds no request.
    pub fn is_empty(&self) -> bool {
        self.qp.batch.is_empty()
    }

    #[inline]
    fn add(
        &mut self,
        buf: B,
        op: impl FnOnce(u64) -> Result<SendOp>,
    ) -> Result<Ticket, (Error, B)> {
        if self.qp.batch.len() >= MAX_BATCH {
            let e = InvalidArgument::BatchFull { max: MAX_BATCH };
            return Err((Error::InvalidArgument(e), buf));
        }
        let (sges, op, inline) = match self.qp.source_request(&buf, op) {
            Ok(r) => r,
            Err(e) => return Err((e, buf)),
        };
        let (wr_id, ticket) = self.qp.ring.post(Kind::Source, buf)?;
        let sges = match sges {
            Sges::One(one) => Entries::One(one),
            Sges::List(list) => {
                let first = self.qp.batch_sges.len() as u32;
                // Within the room reserved: at most `max_send_sge` entries per request.
                self.qp.batch_sges.extend_from_slice(list.as_slice());
                Entries::List(first, list.len() as u32)
            }
        };
        self.qp.batch.push(Item {
            slot: ticket.slot,
            generation: ticket.generation,
            wr_id,
            op,
            sges,
            inline,
        });
        Ok(ticket)
    }

    /// Posts the batch's requests as one chained list, only the last one signaled.
    ///
    /// # Errors
    ///
    /// [`Error::PostSend`] with the buffers of the requests that did not reach the device
    /// (from the error's `bad_index` on), whose tickets are void from then on. If some did
    /// reach it (a `bad_index` above 0, which the checks made when each was added leave to
    /// a provider's failure), they asked for no completion: the queue pair is moved to the
    /// error state so that they are flushed, and their waits resolve with the failure.
    pub fn post(mut self) -> Result<(), (Error, Vec<B>)> {
        self.post_now()
    }

    fn post_now(&mut self) -> Result<(), (Error, Vec<B>)> {
        let qp = &mut *self.qp;
        let n = qp.batch.len();
        if n == 0 {
            return Ok(());
        }
        let mut wrs = [SendWr::EMPTY; MAX_BATCH];
        let mut linked = [(0u32, 0u64); MAX_BATCH];
        for (k, it) in qp.batch.iter().enumerate() {
            let sges = match &it.sges {
                Entries::One(one) => one.as_slice(),
                &Entries::List(first, len) => {
                    &qp.batch_sges[first as usize..(first + len) as usize]
                }
            };
            wrs[k] = SendWr::new(it.wr_id, it.op, sges)
                .inline(it.inline)
                .signaled(k + 1 == n);
            linked[k] = (it.slot, it.generation);
        }
        // SAFETY: each slot owns the buffer its entries name until its own completion, or the
        // last one's that covers it (`link_batch`), is polled from this queue pair's own CQ.
        let posted = unsafe { qp.qp.post_send(&wrs[..n]) };
        let bad = match posted {
            Ok(()) => {
                qp.ring.link_batch(&linked[..n]);
                qp.batch.clear();
                qp.batch_sges.clear();
                return Ok(());
            }
            Err(Error::PostSend { bad_index, .. }) => bad_index.min(n),
            Err(_) => 0,
        };
        let err = posted.expect_err("matched above");
        if bad > 0 {
            // Requests before `bad` are on the device and asked for no completion: flush them.
            warn!(posted = bad, error = %err, "a batch was posted in part; flushing the queue pair");
            if let Err(e) = qp.qp.to_error() {
                warn!(error = %e, "moving the queue pair to the error state failed");
            }
        }
        Err((err, qp.unpost_batch_from(bad)))
    }
}

impl<B: SgSource + SgTarget> Drop for Batch<'_, B> {
    /// Posts what the batch holds (its requests were accepted); a failure is logged and the
    /// buffers that did not reach the device are dropped.
    fn drop(&mut self) {
        if let Err((e, bufs)) = self.post_now() {
            warn!(error = %e, returned = bufs.len(), "posting a dropped batch failed");
        }
    }
}

impl<B: SgSource + SgTarget> std::fmt::Debug for Batch<'_, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch")
            .field("qpn", &self.qp.qpn())
            .field("len", &self.len())
            .finish()
    }
}
