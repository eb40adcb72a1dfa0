//! Completion queues (`ibv_cq`): polling in batches, arming, and CQ events.

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use super::channel::CompletionChannel;
use super::context::Context;
use super::wc::{WcBatch, WorkCompletion};
use crate::error::{Error, InvalidArgument, Result};
use crate::sys;

/// A completion queue. Cheap to clone; destroyed when the last clone and every queue pair
/// using it are gone (pending CQ events are acknowledged first, as `ibv_destroy_cq` requires).
///
/// # Examples
///
/// ```no_run
/// use tokio_rdma::verbs::{CompletionQueue, Context, WcBatch};
/// let ctx = Context::open("rxe0")?;
/// let cq = CompletionQueue::new(&ctx, 256, None)?;
/// let mut batch = WcBatch::with_capacity(32);
/// for wc in cq.poll(&mut batch)? {
///     println!("wr_id {} status {}", wc.wr_id(), wc.status());
/// }
/// # Ok::<(), tokio_rdma::Error>(())
/// ```
#[derive(Clone)]
pub struct CompletionQueue {
    inner: Arc<CqInner>,
}

struct CqInner {
    cq: NonNull<sys::ibv_cq>,
    cqe: u32,
    unacked: AtomicU32,
    channel: Option<CompletionChannel>,
    ctx: Context,
    /// A [`Driver`](crate::driver::Driver) polls and arms this queue: the public polling and
    /// event calls refuse (they would take completions and events the driver is owed).
    driven: AtomicBool,
}

// SAFETY: polling, arming and event calls on a CQ are thread-safe in libibverbs (providers
// lock internally); the pointer is owned.
unsafe impl Send for CqInner {}
// SAFETY: see `Send`.
unsafe impl Sync for CqInner {}

/// An opaque identity of a completion queue, as returned by CQ events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CqId(usize);

impl CqId {
    pub(crate) fn from_ptr(cq: *mut sys::ibv_cq) -> CqId {
        CqId(cq as usize)
    }
}

impl CompletionQueue {
    /// Creates a completion queue with room for at least `cqe` completions, optionally
    /// attached to a completion channel (needed for event-driven completion).
    ///
    /// # Errors
    ///
    /// [`Error::CreateCq`] with the errno (e.g. `EINVAL` when `cqe` exceeds the device's
    /// `max_cqe`).
    pub fn new(
        ctx: &Context,
        cqe: u32,
        channel: Option<&CompletionChannel>,
    ) -> Result<CompletionQueue> {
        let ch = channel.map_or(std::ptr::null_mut(), |c| c.as_ptr());
        let n = i32::try_from(cqe)
            .map_err(|_| Error::InvalidArgument(InvalidArgument::CqeTooLarge { cqe }))?;
        // SAFETY: the context and (optional) channel are alive and the CQ keeps clones of both.
        let cq = unsafe { sys::ibv_create_cq(ctx.as_ptr(), n, std::ptr::null_mut(), ch, 0) };
        let cq = NonNull::new(cq)
            .ok_or_else(|| Error::last_os(|source| Error::CreateCq { cqe, source }))?;
        // SAFETY: `cq` was just created; `cqe` is a plain field holding the actual size.
        let actual = unsafe { (*cq.as_ptr()).cqe };
        Ok(CompletionQueue {
            inner: Arc::new(CqInner {
                cq,
                cqe: u32::try_from(actual).unwrap_or(cqe),
                unacked: AtomicU32::new(0),
                channel: channel.cloned(),
                ctx: ctx.clone(),
                driven: AtomicBool::new(false),
            }),
        })
    }

    /// The actual capacity, which may exceed the requested one.
    pub fn capacity(&self) -> u32 {
        self.inner.cqe
    }

    /// The device context.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// The completion channel this CQ reports to, if any.
    pub fn channel(&self) -> Option<&CompletionChannel> {
        self.inner.channel.as_ref()
    }

    /// The identity that CQ events of this queue carry.
    pub fn id(&self) -> CqId {
        CqId(self.inner.cq.as_ptr() as usize)
    }

    /// Polls up to `batch.capacity()` completions into `batch` (reusing its memory) and returns
    /// them. An empty slice means the queue was empty.
    ///
    /// # Errors
    ///
    /// [`Error::PollCq`] if the provider reports a polling failure; [`Error::DriverOwned`]
    /// if a [`Driver`](crate::driver::Driver) polls this queue (a completion taken here would
    /// never reach the operation it belongs to).
    pub fn poll<'b>(&self, batch: &'b mut WcBatch) -> Result<&'b [WorkCompletion]> {
        self.not_driven()?;
        self.poll_driven(batch)
    }

    /// [`poll`](Self::poll) for the driver that owns the queue.
    pub(crate) fn poll_driven<'b>(&self, batch: &'b mut WcBatch) -> Result<&'b [WorkCompletion]> {
        let n = self.poll_into_unchecked(batch.spare())?;
        Ok(batch.filled(n))
    }

    /// Marks the queue as polled and armed by a driver from now on (see
    /// [`Error::DriverOwned`]).
    pub(crate) fn set_driven(&self) {
        self.inner.driven.store(true, Ordering::Relaxed);
    }

    pub(crate) fn not_driven(&self) -> Result<()> {
        if self.inner.driven.load(Ordering::Relaxed) {
            return Err(Error::DriverOwned("completion queue"));
        }
        Ok(())
    }

    /// Polls completions into `out` and returns how many were written.
    ///
    /// # Errors
    ///
    /// [`Error::PollCq`] if the provider reports a polling failure; [`Error::DriverOwned`]
    /// if a driver polls this queue.
    pub fn poll_into(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        self.not_driven()?;
        self.poll_into_unchecked(out)
    }

    fn poll_into_unchecked(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        let max = i32::try_from(out.len()).unwrap_or(i32::MAX);
        // SAFETY: `WorkCompletion` is `repr(transparent)` over `ibv_wc`, and `out` has room for
        // `max` of them; the CQ is alive.
        let n = unsafe { sys::ibv_poll_cq(self.as_ptr(), max, out.as_mut_ptr().cast()) };
        if n < 0 {
            // ibv_poll_cq returns a negative value without a reliable errno.
            return Err(Error::PollCq(std::io::Error::from_raw_os_error(
                if n == -1 { libc::EIO } else { -n },
            )));
        }
        Ok(n as usize)
    }

    /// Arms the CQ: the next completion (or next solicited one) produces an event on its
    /// channel. Poll once more after arming: completions that arrived before the arm do not
    /// produce an event.
    ///
    /// # Errors
    ///
    /// [`Error::ReqNotifyCq`] with the returned error code; [`Error::DriverOwned`] if a
    /// driver arms this queue.
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        self.not_driven()?;
        self.req_notify_driven(solicited_only)
    }

    /// [`req_notify`](Self::req_notify) for the driver that owns the queue.
    pub(crate) fn req_notify_driven(&self, solicited_only: bool) -> Result<()> {
        // SAFETY: the CQ is alive.
        let rc = unsafe { sys::ibv_req_notify_cq(self.as_ptr(), i32::from(solicited_only)) };
        if rc != 0 {
            return Err(Error::code(rc, Error::ReqNotifyCq));
        }
        Ok(())
    }

    /// Reads one CQ event from this queue's channel without blocking. Returns `Ok(false)` if
    /// none is pending. Each event read must be acknowledged; they are counted and acknowledged
    /// in a batch by [`ack_events`](Self::ack_events) (and on drop).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] if the CQ has no channel, or the event belongs to another
    /// CQ on a shared channel; [`Error::GetCqEvent`] with the errno; [`Error::DriverOwned`]
    /// if a driver reads this queue's events.
    pub fn get_event(&self) -> Result<bool> {
        self.not_driven()?;
        self.get_event_driven()
    }

    /// [`get_event`](Self::get_event) for the driver that owns the queue.
    pub(crate) fn get_event_driven(&self) -> Result<bool> {
        let Some(channel) = &self.inner.channel else {
            return Err(Error::InvalidArgument(InvalidArgument::CqWithoutChannel));
        };
        let mut cq: *mut sys::ibv_cq = std::ptr::null_mut();
        let mut cq_ctx: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: the channel is alive; the out-pointers are valid. The fd is non-blocking,
        // so this returns -1/EAGAIN instead of blocking when nothing is pending.
        let rc = unsafe { sys::ibv_get_cq_event(channel.as_ptr(), &mut cq, &mut cq_ctx) };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::WouldBlock {
                return Ok(false);
            }
            return Err(Error::GetCqEvent(err));
        }
        if cq != self.as_ptr() {
            // Not ours: acknowledge it on the CQ it belongs to is impossible without its
            // handle; report misuse (channels are one-per-CQ in this crate).
            return Err(Error::InvalidArgument(InvalidArgument::ForeignCqEvent));
        }
        self.inner.unacked.fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }

    /// CQ events read and not yet acknowledged.
    pub fn unacked_events(&self) -> u32 {
        self.inner.unacked.load(Ordering::Relaxed)
    }

    /// Acknowledges every CQ event read so far (one `ibv_ack_cq_events` call). Returns how many
    /// were acknowledged.
    pub fn ack_events(&self) -> u32 {
        let n = self.inner.unacked.swap(0, Ordering::AcqRel);
        if n > 0 {
            // SAFETY: exactly `n` events were read from this CQ and not yet acknowledged.
            unsafe { sys::ibv_ack_cq_events(self.as_ptr(), n) };
        }
        n
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::ibv_cq {
        self.inner.cq.as_ptr()
    }
}

impl Drop for CqInner {
    fn drop(&mut self) {
        let n = *self.unacked.get_mut();
        if n > 0 {
            // SAFETY: `n` events were read and never acknowledged; destroy waits for them.
            unsafe { sys::ibv_ack_cq_events(self.cq.as_ptr(), n) };
        }
        // SAFETY: every QP using this CQ holds a clone, so none is alive; destroyed once.
        let rc = unsafe { sys::ibv_destroy_cq(self.cq.as_ptr()) };
        if rc != 0 {
            tracing::warn!(rc, "ibv_destroy_cq failed");
        }
    }
}

impl fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionQueue")
            .field("capacity", &self.inner.cqe)
            .field("has_channel", &self.inner.channel.is_some())
            .finish()
    }
}
