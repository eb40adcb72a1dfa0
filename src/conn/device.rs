//! [`Device`]: what an endpoint owns, below the connections that use it: its own device
//! context, librdmacm's context of the device (to tell which RDMA CM ids are on it), one
//! completion queue with its [`Driver`], the options in force, the shared receive queue if
//! any, and the memory budget. The public [`Endpoint`](crate::Endpoint) is a handle above
//! `conn/` that wraps one; connection setup, listeners and raw connections take a `Device`,
//! never the `Endpoint`.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::endpoint_options::{EndpointOptions, MemoryStats};
use super::memory::{MemoryBudget, Reservation};
use super::observe::{self, Observed};
use super::srq::{SharedRecv, SrqStats};
use crate::driver::Driver;
use crate::error::Result;
use crate::verbs::Context;

/// An opened device's resources (see the module docs). Cheap to clone (a handle); the
/// resources go when the last handle, connection or listener holding one is gone.
#[derive(Clone)]
pub(crate) struct Device {
    inner: Arc<Inner>,
}

struct Inner {
    /// The endpoint's own device context: every verbs object of the endpoint (its completion
    /// queue, protection domains, queue pairs, registrations, shared receive queue) lives
    /// here, so the device's async events about them come to this context's queue, read by
    /// this endpoint's driver alone.
    ctx: Context,
    /// librdmacm's context of the device, which RDMA CM ids bind to and which every endpoint
    /// on the device shares: only to tell which ids are on this device ([`Device::owns`]).
    cm_ctx: Context,
    driver: Driver,
    opts: EndpointOptions,
    srq: Option<Arc<SharedRecv>>,
    memory: Arc<MemoryBudget>,
    /// The id of the next connection made or accepted here (`Connection::id`).
    next_conn_id: AtomicU64,
    /// The live connections, for the metrics exporter.
    #[cfg(feature = "metrics")]
    conns: Arc<observe::Registry>,
}

impl Device {
    /// Opens a device on `cm_ctx`, which must be one of librdmacm's contexts
    /// ([`Context::rdma_cm_devices`], [`Context::from_cm_id`]) to carry RDMA CM connections.
    pub(crate) fn on_context(cm_ctx: Context, opts: EndpointOptions) -> Result<Device> {
        // A context of its own for its verbs objects: librdmacm opens each device once per
        // process, so its context (and that context's one queue of async events) is shared by
        // every endpoint on the device; an event about one endpoint's queue pair, CQ or SRQ
        // would go to whichever endpoint read it first. RDMA CM needs of a queue pair only its
        // number and attributes (`rdma_init_qp_attr`), valid on any context of the device.
        let ctx = Context::open(cm_ctx.name())?;
        let dopts = opts.validate(&ctx)?;
        let driver = Driver::new(&ctx, dopts)?;
        let srq = match opts.shared_receive_queue {
            Some(o) => Some(SharedRecv::new(&driver, o)?),
            None => None,
        };
        Ok(Device {
            inner: Arc::new(Inner {
                ctx,
                cm_ctx,
                driver,
                memory: MemoryBudget::new(opts.memory_budget),
                opts,
                srq,
                next_conn_id: AtomicU64::new(1),
                #[cfg(feature = "metrics")]
                conns: Arc::default(),
            }),
        })
    }

    /// Takes the next connection id (from 1) and records it on the connection's `span`.
    pub(crate) fn connection_id(&self, span: &tracing::Span) -> u64 {
        let id = self.inner.next_conn_id.fetch_add(1, Ordering::Relaxed);
        observe::record_id(span, id);
        id
    }

    /// The identity of the connection `id` set up on this device, with its `span`.
    pub(crate) fn observed(&self, span: tracing::Span, id: u64) -> Observed {
        Observed::new(
            span,
            id,
            #[cfg(feature = "metrics")]
            self.inner.conns.clone(),
        )
    }

    /// The registry of the live connections.
    #[cfg(feature = "metrics")]
    pub(crate) fn conn_registry(&self) -> &Arc<observe::Registry> {
        &self.inner.conns
    }

    /// A handle that does not keep the device open.
    #[cfg(feature = "metrics")]
    pub(crate) fn downgrade(&self) -> WeakDevice {
        WeakDevice(Arc::downgrade(&self.inner))
    }

    /// A snapshot of the shared receive queue, if there is one.
    pub(crate) fn shared_receive_stats(&self) -> Option<SrqStats> {
        self.inner.srq.as_ref().map(|s| s.stats())
    }

    /// The memory budget now.
    pub(crate) fn memory_stats(&self) -> MemoryStats {
        let m = &self.inner.memory;
        MemoryStats {
            budget: self.inner.opts.memory_budget,
            in_use: m.in_use(),
            refused: m.refused(),
        }
    }

    /// Reserves `bytes` of the memory budget for a connection.
    pub(crate) fn reserve_memory(&self, bytes: u64) -> Result<Reservation> {
        self.inner.memory.reserve(bytes)
    }

    /// The shared receive queue, if the options asked for one.
    pub(crate) fn shared_recv(&self) -> Option<&Arc<SharedRecv>> {
        self.inner.srq.as_ref()
    }

    /// The device's name.
    pub(crate) fn device_name(&self) -> &str {
        self.inner.ctx.name()
    }

    /// The device context of the verbs objects (the device's own, not librdmacm's).
    pub(crate) fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// The options in force.
    pub(crate) fn options(&self) -> &EndpointOptions {
        &self.inner.opts
    }

    /// The completion queue's driver.
    pub(crate) fn driver(&self) -> &Driver {
        &self.inner.driver
    }

    /// Whether `other` is a context of this device (the same librdmacm context).
    pub(crate) fn owns(&self, other: &Context) -> bool {
        self.inner.cm_ctx.as_ptr() == other.as_ptr()
    }
}

/// A [`Device`] that does not keep it open (the metrics exporter's).
#[cfg(feature = "metrics")]
pub(crate) struct WeakDevice(std::sync::Weak<Inner>);

#[cfg(feature = "metrics")]
impl WeakDevice {
    /// The device, if a handle of it is still open.
    pub(crate) fn upgrade(&self) -> Option<Device> {
        self.0.upgrade().map(|inner| Device { inner })
    }
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("device", &self.inner.ctx.name())
            .field("options", &self.inner.opts)
            .finish_non_exhaustive()
    }
}
