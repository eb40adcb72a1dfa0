//! An opened device (`ibv_context`) and its capability queries.

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use tracing::debug;

use super::cm_device::CmDeviceList;
use super::device::DeviceList;
use super::odp_caps::{OdpCaps, query_odp_caps};
use super::types::{Gid, GidType, Mtu, PortState};
use crate::error::{Error, Result};
use crate::sys;

/// An opened RDMA device. Cheap to clone (an `Arc`); closed when the last clone and every
/// object created from it are dropped.
///
/// # Examples
///
/// ```no_run
/// use tokio_rdma::verbs::Context;
/// # fn main() -> tokio_rdma::Result<()> {
/// let ctx = Context::open("rxe0")?;
/// let attr = ctx.device_attr();
/// println!("{}: max_qp_wr {} max_sge {}", ctx.name(), attr.max_qp_wr, attr.max_sge);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Context {
    inner: Arc<ContextInner>,
}

struct ContextInner {
    ctx: NonNull<sys::ibv_context>,
    name: String,
    attr: DeviceAttr,
    odp: OdpCaps,
    owner: Owner,
}

/// Who closes the `ibv_context`.
enum Owner {
    /// Opened with `ibv_open_device`: closed on drop.
    Verbs,
    /// Opened by librdmacm: never closed here; the list keeps it open while we use it.
    RdmaCm {
        /// Held for its `Drop` only.
        _devices: Arc<CmDeviceList>,
    },
}

// SAFETY: libibverbs contexts are thread-safe: every verb on a context may be called from any
// thread concurrently (rdma-core documents verbs as thread-safe). The pointer is owned.
unsafe impl Send for ContextInner {}
// SAFETY: see `Send`; shared references only call thread-safe verbs.
unsafe impl Sync for ContextInner {}

/// Device capabilities (a subset of `struct ibv_device_attr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceAttr {
    /// Maximum number of queue pairs.
    pub max_qp: u32,
    /// Maximum outstanding work requests per queue.
    pub max_qp_wr: u32,
    /// Maximum scatter/gather entries per work request.
    pub max_sge: u32,
    /// Maximum completion queue entries.
    pub max_cqe: u32,
    /// Maximum number of memory regions.
    pub max_mr: u32,
    /// Largest registrable region in bytes.
    pub max_mr_size: u64,
    /// Maximum outstanding RDMA READ / atomic requests a QP can issue.
    pub max_qp_rd_atom: u32,
    /// Maximum outstanding RDMA READ / atomic requests a QP can serve.
    pub max_qp_init_rd_atom: u32,
    /// Number of memory windows supported (0 if none).
    pub max_mw: u32,
    /// Atomic support level (`enum ibv_atomic_cap`; 0 = none).
    pub atomic_cap: u32,
    /// Number of physical ports.
    pub phys_port_cnt: u8,
    /// Raw `device_cap_flags`.
    pub device_cap_flags: u32,
    /// Maximum number of shared receive queues (0: none).
    pub max_srq: u32,
    /// Maximum work requests per shared receive queue.
    pub max_srq_wr: u32,
    /// Maximum scatter/gather entries per shared receive queue request.
    pub max_srq_sge: u32,
}

impl DeviceAttr {
    /// Whether the device supports type-2 memory windows.
    pub fn supports_mw_type2(&self) -> bool {
        self.max_mw > 0
            && (self.device_cap_flags
                & (sys::IBV_DEVICE_MEM_WINDOW_TYPE_2A | sys::IBV_DEVICE_MEM_WINDOW_TYPE_2B))
                != 0
    }

    /// Whether the device supports RDMA atomics.
    pub fn supports_atomics(&self) -> bool {
        self.atomic_cap != sys::IBV_ATOMIC_NONE
    }
}

/// Port attributes (a subset of `struct ibv_port_attr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct PortAttr {
    /// Port number (1-based).
    pub port: u8,
    /// Logical port state.
    pub state: PortState,
    /// Largest MTU the port supports.
    pub max_mtu: Option<Mtu>,
    /// MTU currently active on the port.
    pub active_mtu: Option<Mtu>,
    /// Number of GID table entries.
    pub gid_tbl_len: u32,
    /// Local identifier (0 on RoCE).
    pub lid: u16,
    /// Largest message size in bytes.
    pub max_msg_sz: u32,
    /// Link layer (`IBV_LINK_LAYER_*`: 1 InfiniBand, 2 Ethernet).
    pub link_layer: u8,
}

impl PortAttr {
    /// Whether the link layer is Ethernet (RoCE), where a GID is mandatory for addressing.
    pub fn is_ethernet(&self) -> bool {
        u32::from(self.link_layer) == sys::IBV_LINK_LAYER_ETHERNET
    }
}

/// One entry of a port's GID table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GidEntry {
    /// Index in the table (the `sgid_index` to use when addressing with it).
    pub index: u32,
    /// The GID.
    pub gid: Gid,
    /// What kind of GID it is.
    pub gid_type: GidType,
    /// The network interface index behind the entry (RoCE), 0 if none.
    pub ifindex: u32,
}

impl GidEntry {
    /// Whether the GID is an IPv4-mapped address (`::ffff:a.b.c.d`).
    pub fn is_ipv4_mapped(&self) -> bool {
        self.gid.0[..10] == [0; 10] && self.gid.0[10..12] == [0xff, 0xff]
    }
}

impl Context {
    /// Opens the device named `name` (e.g. `"rxe0"`).
    ///
    /// # Errors
    ///
    /// [`Error::DeviceNotFound`] (listing the devices that do exist) if there is no such
    /// device; [`Error::OpenDevice`] or [`Error::QueryDevice`] if the verbs fail.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// let ctx = tokio_rdma::verbs::Context::open("rxe0")?;
    /// # Ok::<(), tokio_rdma::Error>(())
    /// ```
    pub fn open(name: &str) -> Result<Context> {
        let list = DeviceList::get()?;
        let mut available = Vec::new();
        for dev in list.iter() {
            let info = list.info(dev);
            if info.name == name {
                return Context::open_raw(dev, info.name);
            }
            available.push(info.name);
        }
        Err(Error::DeviceNotFound {
            name: name.to_string(),
            available,
        })
    }

    /// Opens the first device that has a port in the ACTIVE state and returns it with that
    /// port's number.
    ///
    /// # Errors
    ///
    /// [`Error::NoActivePort`] if no device has an active port (including when there are no
    /// devices at all).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// let (ctx, port) = tokio_rdma::verbs::Context::open_first_active()?;
    /// println!("using {} port {port}", ctx.name());
    /// # Ok::<(), tokio_rdma::Error>(())
    /// ```
    pub fn open_first_active() -> Result<(Context, u8)> {
        let list = DeviceList::get()?;
        let mut devices = Vec::new();
        for dev in list.iter() {
            let info = list.info(dev);
            devices.push(info.name.clone());
            let ctx = match Context::open_raw(dev, info.name) {
                Ok(ctx) => ctx,
                Err(e) => {
                    debug!(error = %e, "skipping device that fails to open");
                    continue;
                }
            };
            for port in 1..=ctx.device_attr().phys_port_cnt {
                if matches!(ctx.query_port(port), Ok(p) if p.state == PortState::Active) {
                    return Ok((ctx, port));
                }
            }
        }
        Err(Error::NoActivePort { devices })
    }

    fn open_raw(dev: *mut sys::ibv_device, name: String) -> Result<Context> {
        // SAFETY: `dev` is a live entry of a device list held by the caller.
        let ptr = unsafe { sys::ibv_open_device(dev) };
        let ctx = NonNull::new(ptr).ok_or_else(|| {
            Error::last_os(|source| Error::OpenDevice {
                name: name.clone(),
                source,
            })
        })?;
        let attr = match query_device(ctx) {
            Ok(attr) => attr,
            Err(e) => {
                // SAFETY: we just opened it and nothing else refers to it.
                unsafe { sys::ibv_close_device(ctx.as_ptr()) };
                return Err(e);
            }
        };
        let odp = query_odp_caps(ctx);
        debug!(device = %name, ?attr, ?odp, "opened RDMA device");
        Ok(Context {
            inner: Arc::new(ContextInner {
                ctx,
                name,
                attr,
                odp,
                owner: Owner::Verbs,
            }),
        })
    }

    /// Every device librdmacm has opened (`rdma_get_devices`), as contexts that
    /// [`CmId::is_on`](super::CmId::is_on) recognises: open them once, then pick the one an id is bound to.
    ///
    /// # Errors
    ///
    /// [`Error::GetCmDevices`] (e.g. `ENODEV` with no RDMA devices or no RDMA CM support);
    /// [`Error::QueryDevice`].
    pub fn rdma_cm_devices() -> Result<Vec<Context>> {
        let list = Arc::new(CmDeviceList::get()?);
        list.iter()
            .map(|ctx| Context::wrap_cm(ctx, list.clone()))
            .collect()
    }

    pub(super) fn wrap_cm(
        ctx: NonNull<sys::ibv_context>,
        list: Arc<CmDeviceList>,
    ) -> Result<Context> {
        // SAFETY: `ctx` is an open context of `list` (alive); its `device`'s name is a C string.
        let name =
            unsafe { std::ffi::CStr::from_ptr(sys::ibv_get_device_name((*ctx.as_ptr()).device)) }
                .to_string_lossy()
                .into_owned();
        let attr = query_device(ctx)?;
        let odp = query_odp_caps(ctx);
        debug!(device = %name, "using the RDMA CM device context");
        Ok(Context {
            inner: Arc::new(ContextInner {
                ctx,
                name,
                attr,
                odp,
                owner: Owner::RdmaCm { _devices: list },
            }),
        })
    }

    /// Whether this context is librdmacm's (from [`from_cm_id`](Self::from_cm_id) or
    /// [`rdma_cm_devices`](Self::rdma_cm_devices)) rather than opened by name.
    pub fn is_rdma_cm(&self) -> bool {
        matches!(self.inner.owner, Owner::RdmaCm { .. })
    }

    /// The device name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The device capabilities, queried once when the device was opened.
    pub fn device_attr(&self) -> &DeviceAttr {
        &self.inner.attr
    }

    /// What the device offers for on-demand paging (ODP), read with `ibv_query_device_ex`
    /// when the device was opened. All false / empty on a device without ODP (soft-RoCE
    /// before Linux 6.14).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// let ctx = tokio_rdma::verbs::Context::open("rxe0")?;
    /// let odp = ctx.odp_caps();
    /// println!("ODP {} implicit {} RC {}", odp.supported, odp.implicit, odp.rc);
    /// # Ok::<(), tokio_rdma::Error>(())
    /// ```
    pub fn odp_caps(&self) -> OdpCaps {
        self.inner.odp
    }

    /// Checks that memory registered with `access` can be used for the RC operations `ops`
    /// on this device (nothing to check without [`AccessFlags::ON_DEMAND`](super::AccessFlags::ON_DEMAND)).
    ///
    /// # Errors
    ///
    /// [`Error::OdpUnsupported`] naming the missing capability.
    pub fn require_odp(
        &self,
        access: super::AccessFlags,
        ops: super::OdpOps,
        implicit: bool,
    ) -> Result<()> {
        self.inner
            .odp
            .check(access, ops, implicit)
            .map_err(|missing| Error::OdpUnsupported {
                device: self.inner.name.clone(),
                missing,
            })
    }

    /// Queries a port's attributes (ports are numbered from 1).
    ///
    /// # Errors
    ///
    /// [`Error::QueryPort`] with the errno (e.g. `EINVAL` for a port that does not exist).
    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        let mut raw = sys::ibv_port_attr::default();
        // SAFETY: the context is open; `raw` is a valid, zeroed out-parameter of the type the
        // inline `___ibv_query_port` expects.
        let rc = unsafe { sys::___ibv_query_port(self.as_ptr(), port, &mut raw) };
        if rc != 0 {
            return Err(Error::code(rc, |source| Error::QueryPort { port, source }));
        }
        Ok(PortAttr {
            port,
            state: PortState::from_raw(raw.state),
            max_mtu: Mtu::from_raw(raw.max_mtu),
            active_mtu: Mtu::from_raw(raw.active_mtu),
            gid_tbl_len: u32::try_from(raw.gid_tbl_len).unwrap_or(0),
            lid: raw.lid,
            max_msg_sz: raw.max_msg_sz,
            link_layer: raw.link_layer,
        })
    }

    /// Reads the valid entries of a port's GID table.
    ///
    /// # Errors
    ///
    /// [`Error::QueryGid`] with the errno.
    pub fn gid_table(&self, port: u8) -> Result<Vec<GidEntry>> {
        let attr = self.query_port(port)?;
        // The table call returns entries of every port; size the buffer for all of them.
        let max =
            (attr.gid_tbl_len as usize).max(1) * usize::from(self.inner.attr.phys_port_cnt.max(1));
        let mut raw: Vec<sys::ibv_gid_entry> = vec![Default::default(); max];
        // SAFETY: `raw` has room for `max` entries, which is what we pass; flags must be 0.
        let n = unsafe { sys::ibv_query_gid_table(self.as_ptr(), raw.as_mut_ptr(), max, 0) };
        if n < 0 {
            let code = i32::try_from(n).unwrap_or(libc::EINVAL);
            return Err(Error::code(code, |source| Error::QueryGid { port, source }));
        }
        raw.truncate(n as usize);
        Ok(raw
            .iter()
            .filter(|e| e.port_num == u32::from(port))
            .map(|e| GidEntry {
                index: e.gid_index,
                gid: Gid::from_raw(&e.gid),
                gid_type: GidType::from_raw(e.gid_type),
                ifindex: e.ndev_ifindex,
            })
            .filter(|e| !e.gid.is_zero())
            .collect())
    }

    /// Chooses the GID to address this port with: on RoCE a RoCE v2 IPv4-mapped entry if there
    /// is one, then any RoCE v2 entry, then the first entry; on InfiniBand the first entry.
    ///
    /// # Errors
    ///
    /// [`Error::NoUsableGid`] if the table is empty; [`Error::QueryGid`] if the query fails.
    pub fn preferred_gid(&self, port: u8) -> Result<GidEntry> {
        let table = self.gid_table(port)?;
        let pick = table
            .iter()
            .find(|e| e.gid_type == GidType::RoceV2 && e.is_ipv4_mapped())
            .or_else(|| table.iter().find(|e| e.gid_type == GidType::RoceV2))
            .or_else(|| table.first());
        pick.copied().ok_or(Error::NoUsableGid { port })
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::ibv_context {
        self.inner.ctx.as_ptr()
    }
}

fn query_device(ctx: NonNull<sys::ibv_context>) -> Result<DeviceAttr> {
    let mut raw = sys::ibv_device_attr::default();
    // SAFETY: `ctx` is an open context and `raw` a valid out-parameter.
    let rc = unsafe { sys::ibv_query_device(ctx.as_ptr(), &mut raw) };
    if rc != 0 {
        return Err(Error::code(rc, Error::QueryDevice));
    }
    let u = |v: i32| u32::try_from(v).unwrap_or(0);
    Ok(DeviceAttr {
        max_qp: u(raw.max_qp),
        max_qp_wr: u(raw.max_qp_wr),
        max_sge: u(raw.max_sge),
        max_cqe: u(raw.max_cqe),
        max_mr: u(raw.max_mr),
        max_mr_size: raw.max_mr_size,
        max_qp_rd_atom: u(raw.max_qp_rd_atom),
        max_qp_init_rd_atom: u(raw.max_qp_init_rd_atom),
        max_mw: u(raw.max_mw),
        atomic_cap: raw.atomic_cap,
        phys_port_cnt: raw.phys_port_cnt,
        device_cap_flags: raw.device_cap_flags,
        max_srq: u(raw.max_srq),
        max_srq_wr: u(raw.max_srq_wr),
        max_srq_sge: u(raw.max_srq_sge),
    })
}

impl Drop for ContextInner {
    fn drop(&mut self) {
        if let Owner::RdmaCm { .. } = self.owner {
            // librdmacm owns the context; dropping the list (after this) releases our hold.
            return;
        }
        // SAFETY: every child object holds a `Context` clone, so none is alive any more; the
        // pointer was opened by `ibv_open_device` and is closed exactly once.
        let rc = unsafe { sys::ibv_close_device(self.ctx.as_ptr()) };
        if rc != 0 {
            tracing::warn!(device = %self.name, rc, "ibv_close_device failed");
        }
    }
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("name", &self.inner.name)
            .field("rdma_cm", &self.is_rdma_cm())
            .finish_non_exhaustive()
    }
}
