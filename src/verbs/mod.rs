//! Safe RAII wrappers over libibverbs: the only module that calls FFI.
//!
//! One file per verb object. Every handle keeps its parent alive through an `Arc`, so a
//! [`ProtectionDomain`] outlives the [`MemoryRegion`]s and [`QueuePair`]s created from it, and
//! the [`Context`] outlives everything. `Drop` destroys the object.
//!
//! Posting work requests is `unsafe` at this level: the device reads and writes the memory the
//! scatter/gather entries name until the work completion is polled, which the type system
//! cannot see here. The async layer above wraps posting in futures that own their buffers.
//!
//! # Examples
//!
//! ```no_run
//! use tokio_rdma::verbs::{Context, CompletionQueue, ProtectionDomain, QpInitAttr, QueuePair};
//!
//! # fn main() -> tokio_rdma::Result<()> {
//! let (ctx, port) = Context::open_first_active()?;
//! let pd = ProtectionDomain::new(&ctx)?;
//! let cq = CompletionQueue::new(&ctx, 256, None)?;
//! let qp = QueuePair::new_rc(&pd, &QpInitAttr::new(&cq, &cq))?;
//! let me = qp.local_address(port, None)?;
//! println!("qpn {} on {} port {port}", me.qpn, ctx.name());
//! # Ok(()) }
//! ```

mod async_event;
mod channel;
mod cm;
mod cm_addr;
mod cm_context;
mod cm_device;
mod cm_event;
mod cm_qp;
mod context;
mod cq;
mod device;
mod mr;
mod mw;
mod odp;
mod odp_caps;
mod pages;
mod pd;
mod qp;
mod srq;
mod types;
mod wc;
mod wr;

pub use async_event::{AsyncEvent, EventElement};
pub use channel::CompletionChannel;
pub use cm::{
    CmId, CmIdKey, ConnParam, EventChannel, MAX_ACCEPT_PRIVATE_DATA, MAX_CONNECT_PRIVATE_DATA,
    MAX_REJECT_PRIVATE_DATA, PeerConnParam,
};
pub use cm_event::{CmEvent, CmEventKind, reject_reason};
pub use cm_qp::CmQpAttr;
pub use context::{Context, DeviceAttr, GidEntry, PortAttr};
pub use cq::{CompletionQueue, CqId};
pub use device::{DeviceInfo, devices};
pub use mr::{MemoryRegion, RegisteredBuffer};
pub use mw::MemoryWindow;
pub use odp::Prefetch;
pub(crate) use odp_caps::RXE_ODP_SINCE;
pub use odp_caps::{OdpCaps, OdpMissing, OdpOps};
pub(crate) use pages::explain_reg_error;
pub use pages::{BASE_PAGE_SIZE, HUGE_PAGE_SIZE, HugePages, PageMapping, memlock_limit};
pub use pd::ProtectionDomain;
pub use qp::{QpAddress, QpCaps, QpInitAttr, QpState, QueuePair, RtrOptions, RtsOptions};
pub use srq::{SharedReceiveQueue, SrqAttr};
pub use types::{AccessFlags, Gid, GidType, Mtu, PortState};
pub use wc::{WcBatch, WcOpcode, WorkCompletion};
pub(crate) use wr::STACK_CHAIN;
pub use wr::{RecvWr, SendOp, SendWr, Sge};
