//! [`Context::from_cm_id`]: the librdmacm device context an RDMA CM id is bound to. Here, not
//! in `context.rs`, so that the device context does not know RDMA CM ids.

use std::sync::Arc;

use super::cm::CmId;
use super::cm_device::CmDeviceList;
use super::context::Context;
use crate::error::{Error, InvalidArgument, Result};

impl Context {
    /// The device context a CM id is bound to: the `ibv_context` librdmacm opened for it.
    /// Create the protection domain, completion queue, [`Driver`](crate::driver::Driver) and
    /// queue pair of an RDMA CM connection on this context.
    ///
    /// The context is librdmacm's and is never closed by this handle; it stays open while the
    /// handle (or anything created from it) lives. Every call returns a new handle to the same
    /// `ibv_context`: create it once per device and reuse it for later ids bound to the same
    /// device (check with [`CmId::is_on`]), so that one driver serves the device.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] if the id is not bound to a device yet (call it after
    /// `RDMA_CM_EVENT_ADDR_RESOLVED`, on the id of a `CONNECT_REQUEST`, or after binding to a
    /// specific local address); [`Error::GetCmDevices`] or [`Error::QueryDevice`] if the
    /// queries fail.
    pub fn from_cm_id(id: &CmId) -> Result<Context> {
        let Some(want) = id.verbs_ptr() else {
            return Err(Error::InvalidArgument(InvalidArgument::CmIdUnbound));
        };
        let list = Arc::new(CmDeviceList::get()?);
        if !list.iter().any(|c| c == want) {
            return Err(Error::InvalidArgument(InvalidArgument::CmDeviceUnknown));
        }
        Context::wrap_cm(want, list)
    }
}
