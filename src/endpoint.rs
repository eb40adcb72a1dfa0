//! [`Endpoint`]: the one object a user opens. It owns a device context, a completion queue and
//! its driver (the completion and async-event tasks), and the device-level options; every
//! connection made or accepted through it uses that completion queue, in a protection domain
//! of its own (or, with a shared receive queue, the queue's protection domain).
//!
//! The top of the crate's layers: the resources are a `conn::device::Device` (below the
//! connections, which take it), and this handle adds the public API that makes connections
//! and listeners on it.

use std::fmt;
use std::net::SocketAddr;
#[cfg(feature = "metrics")]
use std::time::Duration;

use crate::conn::device::Device;
pub use crate::conn::endpoint_options::{DEFAULT_MEMORY_BUDGET, EndpointOptions, MemoryStats};
use crate::conn::raw::listen_on;
use crate::conn::{
    ConnectOptions, Connection, Listener, RawConnection, RawConnector, RawListener, RawOptions,
    SrqStats,
};
use crate::driver::{Driver, DriverStats};
use crate::error::{Error, Result};
use crate::verbs::{Context, PortState};

/// An RDMA device opened for connections: its context, one completion queue with its driver,
/// and the options that apply to everything on it. Cheap to clone (a handle); the device and
/// its tasks stay up while any clone, connection or listener of it lives.
///
/// Several endpoints may be open on one device at once, each with its own device context,
/// completion queue and mode (the device's async events about one endpoint's objects reach
/// that endpoint only). [`Connection::connect`] and [`Listener::bind`] are shorthands that open an
/// endpoint with default options on the device the address resolves to.
///
/// # Examples
///
/// ```no_run
/// use tokio_rdma::{Endpoint, EndpointOptions};
/// use tokio_rdma::conn::ConnectOptions;
/// use tokio_rdma::driver::CompletionMode;
///
/// # async fn demo() -> tokio_rdma::Result<()> {
/// let ep = Endpoint::open_with(
///     "rxe0",
///     EndpointOptions::default().completion_mode(CompletionMode::BusyPoll),
/// )?;
/// let conn = ep.connect("192.0.2.1:7471", ConnectOptions::default()).await?;
/// conn.send(b"ping").await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Endpoint {
    dev: Device,
}

impl Endpoint {
    /// Opens the RDMA device `device` (as `ibv_devices` / `rdma link` name it) with default
    /// options. Must be called inside a Tokio runtime (the endpoint's tasks run there), with
    /// the time driver enabled.
    ///
    /// # Errors
    ///
    /// [`Error::DeviceNotFound`] listing the devices there are; verb errors creating the
    /// completion queue.
    pub fn open(device: &str) -> Result<Endpoint> {
        Endpoint::open_with(device, EndpointOptions::default())
    }

    /// Opens `device` with `opts`.
    ///
    /// # Errors
    ///
    /// As [`open`](Self::open); [`Error::InvalidArgument`] for an option the device cannot
    /// honour (e.g. a CQ larger than its `max_cqe`).
    pub fn open_with(device: &str, opts: EndpointOptions) -> Result<Endpoint> {
        let devices = Context::rdma_cm_devices()?;
        let names: Vec<String> = devices.iter().map(|c| c.name().to_string()).collect();
        let ctx = devices
            .into_iter()
            .find(|c| c.name() == device)
            .ok_or_else(|| Error::DeviceNotFound {
                name: device.to_string(),
                available: names,
            })?;
        Endpoint::on_context(ctx, opts)
    }

    /// Opens the first device with an active port, with default options.
    ///
    /// # Errors
    ///
    /// [`Error::NoActivePort`] if there is none.
    pub fn open_first_active() -> Result<Endpoint> {
        Endpoint::open_first_active_with(EndpointOptions::default())
    }

    /// Opens the first device with an active port, with `opts`.
    ///
    /// # Errors
    ///
    /// As [`open_first_active`](Self::open_first_active) and [`open_with`](Self::open_with).
    pub fn open_first_active_with(opts: EndpointOptions) -> Result<Endpoint> {
        let devices = Context::rdma_cm_devices()?;
        let names: Vec<String> = devices.iter().map(|c| c.name().to_string()).collect();
        for ctx in devices {
            let active = (1..=ctx.device_attr().phys_port_cnt)
                .any(|p| matches!(ctx.query_port(p), Ok(a) if a.state == PortState::Active));
            if active {
                return Endpoint::on_context(ctx, opts);
            }
        }
        Err(Error::NoActivePort { devices: names })
    }

    /// An endpoint on `ctx`, which must be one of librdmacm's contexts
    /// ([`Context::rdma_cm_devices`], [`Context::from_cm_id`]) to carry RDMA CM connections.
    fn on_context(cm_ctx: Context, opts: EndpointOptions) -> Result<Endpoint> {
        Ok(Endpoint {
            dev: Device::on_context(cm_ctx, opts)?,
        })
    }

    /// Connects to a listener at `addr`, which must resolve to this endpoint's device.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] if `addr` is reached through another device; otherwise as
    /// [`Connection::connect_with`].
    ///
    /// # Cancel safety
    ///
    /// Dropping the future abandons the attempt; the half-made connection is torn down.
    pub async fn connect(
        &self,
        addr: impl tokio::net::ToSocketAddrs + std::fmt::Debug,
        opts: ConnectOptions,
    ) -> Result<Connection> {
        crate::conn::resolve_first_ok(addr, |a| {
            Connection::connect_on(Some(self.dev.clone()), a, opts.clone())
        })
        .await
    }

    /// Listens on `addr` (a local address of this endpoint's device, or a wildcard; requests
    /// that arrive on another device are rejected) with default connection options.
    ///
    /// # Errors
    ///
    /// As [`Listener::bind`].
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future before it resolves leaves nothing listening.
    pub async fn listen(
        &self,
        addr: impl tokio::net::ToSocketAddrs + std::fmt::Debug,
    ) -> Result<Listener> {
        self.listen_with(addr, ConnectOptions::default()).await
    }

    /// Listens on `addr` with `opts` for every accepted connection.
    ///
    /// # Errors
    ///
    /// As [`Listener::bind_with`].
    ///
    /// # Cancel safety
    ///
    /// As [`listen`](Self::listen).
    pub async fn listen_with(
        &self,
        addr: impl tokio::net::ToSocketAddrs + std::fmt::Debug,
        opts: ConnectOptions,
    ) -> Result<Listener> {
        crate::conn::resolve_first_ok(addr, |a| {
            Listener::bind_on(Some(self.dev.clone()), a, opts.clone())
        })
        .await
    }

    /// Resolves `addr` (which must be reached through this endpoint's device) and creates a
    /// raw connection's protection domain and queue pair, ready for receives to be posted
    /// before [`RawConnector::connect`]. See [`conn::RawConnection`](crate::conn::RawConnection)
    /// and `docs/interop.md`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for options that cannot apply or an address reached through
    /// another device; resolution errors ([`Error::ResolveAddr`], [`Error::CmEventFailed`],
    /// [`Error::Timeout`]); verb errors.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future abandons the attempt and frees what it made.
    ///
    /// # Examples
    ///
    /// See [`RawConnector`].
    pub async fn raw_connector(&self, addr: SocketAddr, opts: RawOptions) -> Result<RawConnector> {
        RawConnector::new(&self.dev, addr, opts).await
    }

    /// Connects a raw queue pair to `addr` with `private_data` in the request: resolve,
    /// [`RawConnector::connect`], [`RawReply::establish`](crate::conn::RawReply::establish),
    /// for protocols whose server does not send before it hears from the client.
    ///
    /// # Errors
    ///
    /// As [`raw_connector`](Self::raw_connector) and [`RawConnector::connect`].
    ///
    /// # Cancel safety
    ///
    /// As [`raw_connector`](Self::raw_connector).
    ///
    /// # Examples
    ///
    /// See [`RawConnection`](crate::conn::RawConnection).
    pub async fn connect_raw(
        &self,
        addr: SocketAddr,
        opts: RawOptions,
        private_data: &[u8],
    ) -> Result<RawConnection> {
        let c = self.raw_connector(addr, opts).await?;
        c.connect(private_data).await?.establish()
    }

    /// Listens for raw connection requests on `addr` (a local address of this endpoint's
    /// device, or a wildcard), queueing up to `backlog` in the kernel.
    ///
    /// # Errors
    ///
    /// [`Error::BindAddr`] (address in use, not an RDMA address), [`Error::Listen`],
    /// [`Error::CmChannel`].
    ///
    /// # Examples
    ///
    /// See [`RawListener`].
    pub fn listen_raw(&self, addr: SocketAddr, backlog: u32) -> Result<RawListener> {
        listen_on(Some(self.dev.clone()), addr, backlog)
    }

    /// A snapshot of the shared receive queue, if the endpoint has one
    /// ([`EndpointOptions::shared_receive_queue`]).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use tokio_rdma::{Endpoint, EndpointOptions};
    /// use tokio_rdma::conn::SrqOptions;
    /// # async fn f() -> tokio_rdma::Result<()> {
    /// let ep = Endpoint::open_with(
    ///     "rxe0",
    ///     EndpointOptions::default().shared_receive_queue(SrqOptions::default()),
    /// )?;
    /// let s = ep.shared_receive_stats().expect("configured");
    /// assert_eq!(s.connections, 0);
    /// # Ok(()) }
    /// ```
    pub fn shared_receive_stats(&self) -> Option<SrqStats> {
        self.dev.shared_receive_stats()
    }

    /// The endpoint's memory budget now ([`EndpointOptions::memory_budget`]).
    pub fn memory_stats(&self) -> MemoryStats {
        self.dev.memory_stats()
    }

    /// The device's name.
    pub fn device_name(&self) -> &str {
        self.dev.device_name()
    }

    /// The device context the endpoint's verbs objects live on: one of its own (opened with
    /// `ibv_open_device`), not librdmacm's (which RDMA CM ids bind to and every endpoint on
    /// the device shares), so the device's async events about this endpoint's queue pairs,
    /// completion queue and shared receive queue come to this endpoint only. Create objects
    /// to use with the endpoint's driver here.
    pub fn context(&self) -> &Context {
        self.dev.context()
    }

    /// What the device offers for on-demand paging ([`Context::odp_caps`]): whether pools
    /// ([`PoolConfig::on_demand`](crate::buf::PoolConfig::on_demand)), registration caches
    /// ([`CacheConfig::on_demand`](crate::buf::CacheConfig::on_demand)) and grants
    /// ([`RemoteAccess::ON_DEMAND`](crate::buf::RemoteAccess::ON_DEMAND)) can register on
    /// demand here.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use tokio_rdma::verbs::OdpOps;
    /// let ep = tokio_rdma::Endpoint::open("rxe0")?;
    /// let odp = ep.odp_caps();
    /// if odp.supported && odp.rc.contains(OdpOps::READ | OdpOps::WRITE) {
    ///     println!("grants can be on demand");
    /// }
    /// # Ok::<(), tokio_rdma::Error>(())
    /// ```
    pub fn odp_caps(&self) -> crate::verbs::OdpCaps {
        self.dev.context().odp_caps()
    }

    /// The options in force.
    pub fn options(&self) -> &EndpointOptions {
        self.dev.options()
    }

    /// The completion queue's driver: create raw queue pairs on it
    /// ([`Driver::create_qp`]).
    pub fn driver(&self) -> &Driver {
        self.dev.driver()
    }

    /// Counters of the endpoint's completion machinery.
    pub fn stats(&self) -> DriverStats {
        self.dev.driver().stats()
    }
}

#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
impl Endpoint {
    /// Starts exporting this endpoint's counters through the `metrics` facade every `period`
    /// (feature `metrics`), labelled `device = <device name>`: the driver's [`DriverStats`](crate::driver::DriverStats),
    /// the memory budget, the shared receive queue's [`SrqStats`](crate::conn::SrqStats) and pool (if configured),
    /// the number of live connections, and each connection's [`ConnStats`](crate::conn::ConnStats) and pools
    /// (labels `conn_id`, [`Connection::id`](crate::conn::Connection::id), and `peer`). The
    /// series names are `tokio_rdma_*` (`docs/observability.md`). A connection's series get
    /// their final values when it ends, and `tokio_rdma_conn_open` goes to 0; the facade
    /// cannot remove a series, so let the recorder expire idle ones (e.g.
    /// metrics-exporter-prometheus's `idle_timeout`).
    ///
    /// The task runs on the current Tokio runtime; it reads snapshots only (no lock held
    /// across the export, nothing added to the data path), and stops when the returned
    /// [`MetricsExporter`](crate::MetricsExporter) is dropped or the endpoint is closed (its last handle dropped).
    /// Install the recorder before calling this.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a zero `period`, or if an exporter of this endpoint is
    /// already running (one at a time: it reports each ended connection once).
    ///
    /// # Panics
    ///
    /// Outside a Tokio runtime.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use tokio_rdma::Endpoint;
    ///
    /// # async fn demo() -> tokio_rdma::Result<()> {
    /// // metrics_exporter_prometheus::PrometheusBuilder::new().install()? or any recorder.
    /// let ep = Endpoint::open_first_active()?;
    /// let _exporter = ep.export_metrics(Duration::from_secs(5))?;
    /// let listener = ep.listen("0.0.0.0:7471").await?;
    /// # Ok(()) }
    /// ```
    pub fn export_metrics(&self, period: Duration) -> Result<crate::MetricsExporter> {
        self.export_metrics_labeled(period, Vec::new())
    }

    /// As [`export_metrics`](Self::export_metrics), with `labels` added to every series (to
    /// tell several endpoints on one device apart, whose connection ids repeat).
    ///
    /// # Errors
    ///
    /// As [`export_metrics`](Self::export_metrics).
    ///
    /// # Panics
    ///
    /// Outside a Tokio runtime.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn f(ep: &tokio_rdma::Endpoint) -> tokio_rdma::Result<()> {
    /// let _exporter = ep.export_metrics_labeled(
    ///     std::time::Duration::from_secs(1),
    ///     vec![("endpoint", "frontend".to_string())],
    /// )?;
    /// # Ok(()) }
    /// ```
    pub fn export_metrics_labeled(
        &self,
        period: Duration,
        labels: Vec<(&'static str, String)>,
    ) -> Result<crate::MetricsExporter> {
        crate::conn::export::start(&self.dev, period, labels)
    }
}

impl fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Endpoint")
            .field("device", &self.dev.device_name())
            .field("options", self.dev.options())
            .finish_non_exhaustive()
    }
}
