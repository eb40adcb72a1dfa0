//! The list of RDMA devices (`ibv_get_device_list`).

use std::ffi::CStr;
use std::ptr::NonNull;

use crate::error::{Error, Result};
use crate::sys;

/// An entry of the device list: enough to choose a device before opening it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Kernel name of the device, e.g. `rxe0` or `mlx5_0`.
    pub name: String,
    /// Node GUID, in host byte order.
    pub guid: u64,
}

/// Lists the RDMA devices of this host.
///
/// An empty list is not an error: it is what a host without RDMA hardware or soft-RoCE sees.
///
/// # Errors
///
/// [`Error::GetDeviceList`] if the verbs library cannot enumerate devices at all (for example
/// the kernel has no `ib_uverbs` support and the library reports `ENOSYS`).
///
/// # Examples
///
/// ```no_run
/// for dev in tokio_rdma::verbs::devices()? {
///     println!("{} guid {:#018x}", dev.name, dev.guid);
/// }
/// # Ok::<(), tokio_rdma::Error>(())
/// ```
pub fn devices() -> Result<Vec<DeviceInfo>> {
    let list = DeviceList::get()?;
    Ok(list.iter().map(|dev| list.info(dev)).collect())
}

/// Owns the array returned by `ibv_get_device_list`; frees it on drop.
pub(crate) struct DeviceList {
    ptr: NonNull<*mut sys::ibv_device>,
    len: usize,
}

impl DeviceList {
    pub(crate) fn get() -> Result<DeviceList> {
        let mut n: i32 = 0;
        // SAFETY: `n` is a valid out-pointer; the returned array is freed in `Drop`.
        let ptr = unsafe { sys::ibv_get_device_list(&mut n) };
        match NonNull::new(ptr) {
            Some(ptr) => Ok(DeviceList {
                ptr,
                len: usize::try_from(n).unwrap_or(0),
            }),
            None => Err(Error::last_os(Error::GetDeviceList)),
        }
    }

    /// The raw device pointers, valid while `self` lives.
    pub(crate) fn iter(&self) -> impl Iterator<Item = *mut sys::ibv_device> + '_ {
        // SAFETY: the library returned an array of `len` valid device pointers (plus a NULL
        // terminator) that stays valid until `ibv_free_device_list`, which only `Drop` calls.
        let slice = unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) };
        slice.iter().copied()
    }

    pub(crate) fn info(&self, dev: *mut sys::ibv_device) -> DeviceInfo {
        // SAFETY: `dev` comes from this list, which is alive; the name is a NUL-terminated
        // string owned by the device structure.
        let name = unsafe { CStr::from_ptr(sys::ibv_get_device_name(dev)) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: as above; the GUID is returned by value in network byte order.
        let guid = u64::from_be(unsafe { sys::ibv_get_device_guid(dev) });
        DeviceInfo { name, guid }
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: the pointer came from `ibv_get_device_list` and is freed exactly once. Opened
        // contexts stay valid after the list is freed (documented by ibv_get_device_list(3)).
        unsafe { sys::ibv_free_device_list(self.ptr.as_ptr()) }
    }
}
