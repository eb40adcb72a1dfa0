//! The device contexts librdmacm opened (`rdma_get_devices`).
//!
//! librdmacm opens each RDMA device once and binds CM ids to those contexts. A context
//! wrapping one of them (see [`Context::from_cm_id`](super::Context::from_cm_id)) must not
//! close it; it holds this list instead, which keeps every context in it open (librdmacm
//! counts a reference per listed device until `rdma_free_devices`).

use std::ptr::NonNull;

use crate::error::{Error, Result};
use crate::sys;

/// Owns the array returned by `rdma_get_devices`; frees it on drop.
pub(crate) struct CmDeviceList {
    ptr: NonNull<*mut sys::ibv_context>,
    len: usize,
}

// SAFETY: the array is immutable after creation and only freed in `Drop`; the contexts it
// names are thread-safe verbs objects.
unsafe impl Send for CmDeviceList {}
// SAFETY: see `Send`.
unsafe impl Sync for CmDeviceList {}

impl CmDeviceList {
    pub(crate) fn get() -> Result<CmDeviceList> {
        let mut n: i32 = 0;
        // SAFETY: `n` is a valid out-pointer; the array is freed in `Drop`.
        let ptr = unsafe { sys::rdma_get_devices(&mut n) };
        match NonNull::new(ptr) {
            Some(ptr) => Ok(CmDeviceList {
                ptr,
                len: usize::try_from(n).unwrap_or(0),
            }),
            None => Err(Error::last_os(Error::GetCmDevices)),
        }
    }

    /// The contexts, valid while `self` lives.
    pub(crate) fn iter(&self) -> impl Iterator<Item = NonNull<sys::ibv_context>> + '_ {
        // SAFETY: librdmacm returned an array of `len` context pointers (plus a NULL
        // terminator) that stays valid until `rdma_free_devices`, which only `Drop` calls.
        let slice = unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) };
        slice.iter().filter_map(|&p| NonNull::new(p))
    }
}

impl Drop for CmDeviceList {
    fn drop(&mut self) {
        // SAFETY: the array came from `rdma_get_devices` and is freed exactly once; contexts
        // wrapping its entries hold an `Arc` of this list, so none is alive any more.
        unsafe { sys::rdma_free_devices(self.ptr.as_ptr()) };
    }
}
