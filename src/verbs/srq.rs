//! Shared receive queues (`ibv_create_srq(3)`): one pool of posted receives that any number of
//! queue pairs of a protection domain consume from, so receive memory need not grow with the
//! number of connections. A queue pair uses one when created with
//! [`QpInitAttr::srq`](super::QpInitAttr::srq); its receive completions then carry the queue
//! pair's number (`WorkCompletion::qp_num()`) to tell them apart. [`arm_limit`] asks for one
//! `IBV_EVENT_SRQ_LIMIT_REACHED` asynchronous event when fewer than `limit` receives remain
//! posted (the low-watermark refill signal); it must be re-armed after each event.
//!
//! [`arm_limit`]: SharedReceiveQueue::arm_limit

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use super::pd::ProtectionDomain;
use super::wr::RecvWr;
use super::wr::post_chain;
use crate::error::{Error, InvalidArgument, Result, Unsupported};
use crate::sys;

/// The attributes of a shared receive queue, as the device granted them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct SrqAttr {
    /// Receives the queue holds at most.
    pub max_wr: u32,
    /// Scatter/gather entries per receive.
    pub max_sge: u32,
    /// The armed limit (0: not armed).
    pub limit: u32,
}

struct SrqInner {
    srq: NonNull<sys::ibv_srq>,
    /// Kept alive while the queue lives.
    pd: ProtectionDomain,
}

// SAFETY: posting to and modifying an SRQ are thread-safe in libibverbs (providers lock the
// queue); the pointer is owned.
unsafe impl Send for SrqInner {}
// SAFETY: see `Send`.
unsafe impl Sync for SrqInner {}

impl Drop for SrqInner {
    fn drop(&mut self) {
        // SAFETY: the queue is owned; every queue pair using it holds a clone of this `Arc`
        // and was destroyed before the last clone goes.
        let rc = unsafe { sys::ibv_destroy_srq(self.srq.as_ptr()) };
        if rc != 0 {
            tracing::warn!(rc, "ibv_destroy_srq failed");
        }
    }
}

/// A shared receive queue (cheap to clone; destroyed with the last clone, after the queue
/// pairs that use it).
///
/// # Examples
///
/// ```no_run
/// use tokio_rdma::verbs::{
///     CompletionQueue, Context, ProtectionDomain, QpInitAttr, QueuePair, SharedReceiveQueue,
/// };
/// # fn demo() -> tokio_rdma::Result<()> {
/// let ctx = Context::open("rxe0")?;
/// let pd = ProtectionDomain::new(&ctx)?;
/// let cq = CompletionQueue::new(&ctx, 256, None)?;
/// let srq = SharedReceiveQueue::new(&pd, 128, 1)?;
/// srq.arm_limit(16)?; // IBV_EVENT_SRQ_LIMIT_REACHED once fewer than 16 remain
/// let mut attr = QpInitAttr::new(&cq, &cq);
/// attr.srq = Some(srq.clone());
/// let a = QueuePair::new_rc(&pd, &attr)?;
/// let b = QueuePair::new_rc(&pd, &attr)?; // both consume srq's receives
/// # let _ = (a, b); Ok(()) }
/// ```
#[derive(Clone)]
pub struct SharedReceiveQueue {
    inner: Arc<SrqInner>,
}

impl SharedReceiveQueue {
    /// Creates a queue of `max_wr` receives of up to `max_sge` entries each in `pd`.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] if the device has no shared receive queues;
    /// [`Error::InvalidArgument`] naming the device's `max_srq_wr` / `max_srq_sge` when a size
    /// exceeds it; [`Error::CreateSrq`] with the errno.
    pub fn new(pd: &ProtectionDomain, max_wr: u32, max_sge: u32) -> Result<SharedReceiveQueue> {
        let ctx = pd.context();
        let dev = ctx.device_attr();
        if dev.max_srq == 0 {
            return Err(Error::Unsupported(Unsupported::NoSrq {
                device: ctx.name().to_string(),
            }));
        }
        if max_wr == 0 || max_wr > dev.max_srq_wr || max_sge == 0 || max_sge > dev.max_srq_sge {
            return Err(Error::InvalidArgument(InvalidArgument::SrqSize {
                max_wr,
                max_sge,
                device: ctx.name().to_string(),
                max_srq_wr: dev.max_srq_wr,
                max_srq_sge: dev.max_srq_sge,
            }));
        }
        let mut init = sys::ibv_srq_init_attr {
            attr: sys::ibv_srq_attr {
                max_wr,
                max_sge,
                srq_limit: 0,
            },
            ..Default::default()
        };
        // SAFETY: the PD is alive (kept by the queue); `init` is a valid in/out parameter.
        let srq = unsafe { sys::ibv_create_srq(pd.as_ptr(), &mut init) };
        let srq = NonNull::new(srq).ok_or_else(|| Error::last_os(Error::CreateSrq))?;
        Ok(SharedReceiveQueue {
            inner: Arc::new(SrqInner {
                srq,
                pd: pd.clone(),
            }),
        })
    }

    /// Posts receive work requests as one chained list. Any queue pair using the queue may
    /// consume any of them.
    ///
    /// # Safety
    ///
    /// As [`QueuePair::post_recv`](super::QueuePair::post_recv): the memory named by each
    /// request must stay allocated, registered in this queue's protection domain and untouched
    /// until its completion is polled (or the queue is destroyed).
    ///
    /// # Errors
    ///
    /// [`Error::PostRecv`] with the index of the first request not posted (`ENOMEM`: the
    /// queue is full).
    pub unsafe fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        let post = |head, bad: &mut _| {
            // SAFETY: the queue is alive; the chain is valid for the call.
            unsafe { sys::ibv_post_srq_recv(self.as_ptr(), head, bad) }
        };
        // SAFETY: the caller's contract covers the memory the requests name.
        unsafe { post_chain(wrs, post) }
    }

    /// Arms the limit: one `IBV_EVENT_SRQ_LIMIT_REACHED` asynchronous event (element
    /// [`EventElement::Srq`](super::EventElement::Srq) with this queue's [`id`](Self::id))
    /// when fewer than `limit` receives remain posted. Disarmed by the event; arm again after
    /// refilling.
    ///
    /// # Errors
    ///
    /// [`Error::ModifySrq`] with the errno (`EINVAL`: `limit` is not below the queue's size).
    pub fn arm_limit(&self, limit: u32) -> Result<()> {
        let mut attr = sys::ibv_srq_attr {
            max_wr: 0,
            max_sge: 0,
            srq_limit: limit,
        };
        // SAFETY: the queue is alive; `attr` is valid for the call.
        let rc =
            unsafe { sys::ibv_modify_srq(self.as_ptr(), &mut attr, sys::IBV_SRQ_LIMIT as i32) };
        if rc != 0 {
            return Err(Error::code(rc, Error::ModifySrq));
        }
        Ok(())
    }

    /// The queue's attributes.
    ///
    /// # Errors
    ///
    /// [`Error::ModifySrq`] with the errno of `ibv_query_srq`.
    pub fn query(&self) -> Result<SrqAttr> {
        let mut attr = sys::ibv_srq_attr::default();
        // SAFETY: the queue is alive; `attr` is a valid out-parameter.
        let rc = unsafe { sys::ibv_query_srq(self.as_ptr(), &mut attr) };
        if rc != 0 {
            return Err(Error::code(rc, Error::ModifySrq));
        }
        Ok(SrqAttr {
            max_wr: attr.max_wr,
            max_sge: attr.max_sge,
            limit: attr.srq_limit,
        })
    }

    /// An identity for matching asynchronous events ([`EventElement::Srq`](super::EventElement::Srq)).
    pub fn id(&self) -> usize {
        self.as_ptr() as usize
    }

    /// The protection domain of the queue (its receives' memory must be registered there).
    pub fn pd(&self) -> &ProtectionDomain {
        &self.inner.pd
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::ibv_srq {
        self.inner.srq.as_ptr()
    }
}

impl fmt::Debug for SharedReceiveQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedReceiveQueue")
            .field("id", &format_args!("{:#x}", self.id()))
            .finish_non_exhaustive()
    }
}
