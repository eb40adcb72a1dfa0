//! Memory windows (`ibv_mw`, type 2): revocable remote access to a sub-range of a memory
//! region, bound by posting `IBV_WR_BIND_MW` on a queue pair and revoked by deallocation.

use std::fmt;
use std::ptr::NonNull;

use super::context::Context;
use super::mr::MemoryRegion;
use super::pd::ProtectionDomain;
use super::qp::QueuePair;
use super::types::AccessFlags;
use crate::error::{Error, InvalidArgument, Result};
use crate::sys;

/// A type-2 memory window. Remote peers can use it only after a bind (posted with
/// [`post_bind`](Self::post_bind)) has completed, only through the queue pair it was bound on,
/// and only within the bound range and rights. Dropping it deallocates it (`ibv_dealloc_mw`),
/// which invalidates its rkey.
///
/// # Examples
///
/// ```no_run
/// # use tokio_rdma::verbs::*;
/// # fn f(qp: &QueuePair, mr: &MemoryRegion) -> tokio_rdma::Result<()> {
/// if qp.pd().context().device_attr().supports_mw_type2() {
///     let mw = MemoryWindow::alloc_type2(qp.pd())?;
///     // SAFETY: `mw` and `mr` outlive the bind's completion, polled before the rkey is used.
///     let rkey = unsafe {
///         mw.post_bind(qp, 1, mr, mr.addr(), 4096, AccessFlags::REMOTE_WRITE)?
///     };
///     // ... poll the send CQ for wr_id 1, then hand `rkey` to the peer ...
/// #   let _ = rkey;
/// }
/// # Ok(()) }
/// ```
pub struct MemoryWindow {
    mw: NonNull<sys::ibv_mw>,
    pd: ProtectionDomain,
}

// SAFETY: binding and deallocating windows are thread-safe verbs; the pointer is owned.
unsafe impl Send for MemoryWindow {}
// SAFETY: `&self` methods read immutable fields or call thread-safe verbs.
unsafe impl Sync for MemoryWindow {}

impl MemoryWindow {
    /// Allocates an unbound type-2 window in `pd`.
    ///
    /// # Errors
    ///
    /// [`Error::AllocMw`] with the errno (e.g. `EOPNOTSUPP` on devices without windows).
    pub fn alloc_type2(pd: &ProtectionDomain) -> Result<MemoryWindow> {
        // SAFETY: the PD is alive and the window keeps a clone of it.
        let mw = unsafe { sys::ibv_alloc_mw(pd.as_ptr(), sys::IBV_MW_TYPE_2) };
        let mw = NonNull::new(mw).ok_or_else(|| Error::last_os(Error::AllocMw))?;
        Ok(MemoryWindow { mw, pd: pd.clone() })
    }

    /// The protection domain.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }

    /// Posts a signaled `IBV_WR_BIND_MW` work request with id `wr_id` on `qp`, binding the
    /// window to `len` bytes at `addr` of `mr` with the remote rights in `access`, and returns
    /// the rkey the window has once the bind completes (a fresh key: earlier tokens for this
    /// window stop working).
    ///
    /// `mr` must have been registered with [`AccessFlags::MW_BIND`] (and `LOCAL_WRITE` when
    /// `access` includes remote write or atomic rights).
    ///
    /// # Safety
    ///
    /// Until the bind's completion is polled, `self`, `mr` and the queue pair must stay alive.
    /// Once bound, the peer may access the range (per `access`) until the window is dropped:
    /// the memory must stay allocated until then, and local code must not hold `&`/`&mut`
    /// references to it that assume it does not change. If the completion is never observed,
    /// the window must be leaked rather than dropped while the memory is reused.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] if the range is not inside `mr` or `access` has non-remote
    /// bits; [`Error::BindMw`] with the code `ibv_post_send` returned.
    pub unsafe fn post_bind(
        &self,
        qp: &QueuePair,
        wr_id: u64,
        mr: &MemoryRegion,
        addr: u64,
        len: u64,
        access: AccessFlags,
    ) -> Result<u32> {
        let remote = AccessFlags::REMOTE_READ
            .union(AccessFlags::REMOTE_WRITE)
            .union(AccessFlags::REMOTE_ATOMIC);
        if access.bits() & !remote.bits() != 0 {
            return Err(Error::InvalidArgument(InvalidArgument::WindowRights {
                access,
            }));
        }
        let inside = addr >= mr.addr()
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= mr.addr() + mr.len() as u64);
        if !inside {
            return Err(Error::InvalidArgument(InvalidArgument::WindowRange {
                addr,
                len,
            }));
        }
        // SAFETY: the window is alive; `rkey` is a plain field.
        let current = unsafe { (*self.mw.as_ptr()).rkey };
        // SAFETY: `ibv_inc_rkey` is a pure function of its argument.
        let rkey = unsafe { sys::ibv_inc_rkey(current) };
        let mut wr = sys::ibv_send_wr {
            wr_id,
            opcode: sys::IBV_WR_BIND_MW,
            send_flags: sys::IBV_SEND_SIGNALED,
            ..Default::default()
        };
        wr.__bindgen_anon_2.bind_mw = sys::ibv_send_wr__bindgen_ty_4__bindgen_ty_1 {
            mw: self.mw.as_ptr(),
            rkey,
            bind_info: sys::ibv_mw_bind_info {
                mr: mr.as_ptr(),
                addr,
                length: len,
                mw_access_flags: access.bits(),
            },
        };
        let mut bad: *mut sys::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: `wr` is a valid one-element list (next is NULL) living across the call; the
        // caller keeps the window, region and QP alive until the completion.
        let rc = unsafe { sys::ibv_post_send(qp.as_ptr(), &mut wr, &mut bad) };
        if rc != 0 {
            return Err(Error::code(rc, Error::BindMw));
        }
        tracing::trace!(qpn = qp.qpn(), len, ?access, "posted memory window bind");
        Ok(rkey)
    }
}

/// The vendor id soft-RoCE (`rdma_rxe`) reports.
const RXE_VENDOR_ID: u32 = 0xff_ffff;

impl MemoryWindow {
    /// Whether the device is known to confine accesses through a type-2 window to the window's
    /// own range. False for soft-RoCE (`rxe`): measured on Linux 6.1, its responder checks an
    /// access through a window only against the bounds of the memory region under it, so a
    /// peer holding the window's rkey could reach the whole region (see `tests/buf_grant.rs`).
    /// Grants therefore use dedicated registrations there.
    pub fn bounds_enforced(ctx: &Context) -> bool {
        vendor_id(ctx) != Some(RXE_VENDOR_ID) && !ctx.name().starts_with("rxe")
    }
}

fn vendor_id(ctx: &Context) -> Option<u32> {
    let mut raw = sys::ibv_device_attr::default();
    // SAFETY: the context is open and `raw` is a valid out-parameter.
    let rc = unsafe { sys::ibv_query_device(ctx.as_ptr(), &mut raw) };
    (rc == 0).then_some(raw.vendor_id)
}

impl Drop for MemoryWindow {
    fn drop(&mut self) {
        // SAFETY: allocated in `alloc_type2`, deallocated exactly once; this invalidates any
        // binding, so the rkey stops working.
        let rc = unsafe { sys::ibv_dealloc_mw(self.mw.as_ptr()) };
        if rc != 0 {
            tracing::warn!(rc, "ibv_dealloc_mw failed");
        }
    }
}

impl fmt::Debug for MemoryWindow {
    // The rkey is a capability: never printed.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryWindow")
            .field("device", &self.pd.context().name())
            .finish_non_exhaustive()
    }
}
