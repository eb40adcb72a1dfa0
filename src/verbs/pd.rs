//! Protection domains (`ibv_pd`).

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use super::context::Context;
use crate::error::{Error, Result};
use crate::sys;

/// A protection domain: memory regions and queue pairs can only be used together if they
/// belong to the same one. Cheap to clone; deallocated when the last clone and every child
/// object are gone.
///
/// # Examples
///
/// ```no_run
/// use tokio_rdma::verbs::{Context, ProtectionDomain};
/// let ctx = Context::open("rxe0")?;
/// let pd = ProtectionDomain::new(&ctx)?;
/// # Ok::<(), tokio_rdma::Error>(())
/// ```
#[derive(Clone)]
pub struct ProtectionDomain {
    inner: Arc<PdInner>,
}

struct PdInner {
    pd: NonNull<sys::ibv_pd>,
    ctx: Context,
}

// SAFETY: a PD is only passed to thread-safe verbs; the pointer is owned.
unsafe impl Send for PdInner {}
// SAFETY: see `Send`.
unsafe impl Sync for PdInner {}

impl ProtectionDomain {
    /// Allocates a protection domain on `ctx`.
    ///
    /// # Errors
    ///
    /// [`Error::AllocPd`] with the errno.
    pub fn new(ctx: &Context) -> Result<ProtectionDomain> {
        // SAFETY: the context is open for as long as `ctx` lives, and the PD keeps a clone.
        let pd = unsafe { sys::ibv_alloc_pd(ctx.as_ptr()) };
        let pd = NonNull::new(pd).ok_or_else(|| Error::last_os(Error::AllocPd))?;
        Ok(ProtectionDomain {
            inner: Arc::new(PdInner {
                pd,
                ctx: ctx.clone(),
            }),
        })
    }

    /// The device context this domain belongs to.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::ibv_pd {
        self.inner.pd.as_ptr()
    }
}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: all MRs/QPs hold a clone of the PD, so none is alive; freed exactly once.
        let rc = unsafe { sys::ibv_dealloc_pd(self.pd.as_ptr()) };
        if rc != 0 {
            tracing::warn!(rc, "ibv_dealloc_pd failed");
        }
    }
}

impl fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProtectionDomain")
            .field("device", &self.inner.ctx.name())
            .finish()
    }
}
