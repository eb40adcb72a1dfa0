//! [`Endpoint`]: the one object a user opens. It owns a device context, a completion queue and
//! its driver (the completion and async-event tasks), and the device-level options; every
//! connection made or accepted through it uses that completion queue, in a protection domain
//! of its own (or, with a shared receive queue, the queue's protection domain).

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::conn::memory::{MemoryBudget, Reservation};
use crate::conn::raw::listen_on;
use crate::conn::srq::SharedRecv;
use crate::conn::{
    ConnectOptions, Connection, Listener, RawConnection, RawConnector, RawListener, RawOptions,
    SrqOptions, SrqStats,
};
use crate::driver::{CompletionMode, Driver, DriverOptions, DriverStats};
use crate::error::{Error, Result};
use crate::verbs::{Context, PortState};

/// Device-level options of an [`Endpoint`]: how futures wait for completions, the
/// completion queue's size, a shared receive queue, and the memory budget of its connections.
///
/// # Examples
///
/// ```
/// use tokio_rdma::EndpointOptions;
/// use tokio_rdma::driver::CompletionMode;
///
/// let opts = EndpointOptions::default()
///     .completion_mode(CompletionMode::BusyPoll)
///     .cq_size(8192);
/// assert_eq!(opts.completion_mode, CompletionMode::BusyPoll);
/// assert_eq!(opts.cq_size, Some(8192));
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct EndpointOptions {
    /// How a waiting future behaves (default: adaptive hybrid polling).
    pub completion_mode: CompletionMode,
    /// Completion queue entries: bounds the sum of the queue depths of all connections on the
    /// endpoint (186 per connection with default options, see `docs/connections.md`; 32,767
    /// entries, rxe's `max_cqe`, take 176 such connections). `None` (the default): the
    /// device's `max_cqe`, at most 65,536.
    pub cq_size: Option<u32>,
    /// Completions taken per poll of the completion queue (default 32).
    pub poll_batch: usize,
    /// A shared receive queue for the endpoint's message connections (default: none, every
    /// connection has receive buffers of its own). See [`shared_receive_queue`](Self::shared_receive_queue).
    pub shared_receive_queue: Option<SrqOptions>,
    /// Registered bytes the endpoint's message connections may hold in their own pools
    /// (receive and send staging) together; `None`: no limit. Default
    /// [`DEFAULT_MEMORY_BUDGET`] (1 GiB). See [`memory_budget`](Self::memory_budget).
    pub memory_budget: Option<u64>,
}

/// The default [`EndpointOptions::memory_budget`]: 1 GiB, some 300 connections with default
/// options (3.25 MiB each), or 98 whose peers announce the largest buffers a handshake allows
/// (10.44 MiB each under the default `max_send_chunk` and `max_staged_chunks`).
pub const DEFAULT_MEMORY_BUDGET: u64 = 1 << 30;

/// The memory budget of an [`Endpoint`] now ([`Endpoint::memory_stats`]).
///
/// # Examples
///
/// ```no_run
/// # fn f(ep: &tokio_rdma::Endpoint) {
/// let m = ep.memory_stats();
/// println!("{} of {:?} bytes in use, {} connections refused", m.in_use, m.budget, m.refused);
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct MemoryStats {
    /// The budget ([`EndpointOptions::memory_budget`]).
    pub budget: Option<u64>,
    /// Bytes the endpoint's message connections hold in their pools now (reserved at
    /// admission, given back when a connection's state is gone).
    pub in_use: u64,
    /// Connections refused with [`Error::MemoryBudgetExhausted`] so far.
    pub refused: u64,
}

impl Default for EndpointOptions {
    fn default() -> Self {
        let d = DriverOptions::default();
        EndpointOptions {
            completion_mode: d.mode,
            cq_size: None,
            poll_batch: d.poll_batch,
            shared_receive_queue: None,
            memory_budget: Some(DEFAULT_MEMORY_BUDGET),
        }
    }
}

impl EndpointOptions {
    /// Sets the completion mode.
    pub fn completion_mode(mut self, mode: CompletionMode) -> Self {
        self.completion_mode = mode;
        self
    }

    /// Sets the completion queue size.
    pub fn cq_size(mut self, n: u32) -> Self {
        self.cq_size = Some(n);
        self
    }

    /// Sets how many completions one poll takes.
    pub fn poll_batch(mut self, n: usize) -> Self {
        self.poll_batch = n;
        self
    }

    /// Gives the endpoint's message connections one shared receive queue: `opts.buffers`
    /// receive buffers that every connection ([`Endpoint::connect`], [`Endpoint::listen`])
    /// receives into, instead of buffers of its own. Receive memory is then this budget,
    /// whatever the number of connections; each connection is admitted with a floor of 5
    /// receives and claims more credits (up to its `recv_credits`) as the queue has them
    /// (`docs/connections.md`, "Shared receive queue").
    ///
    /// Use it for many connections of which few are busy at once (thousands of clients of a
    /// server). Without it, each connection keeps `recv_credits` buffers posted, which suits
    /// a few busy connections. The connections share one protection domain, so they offer
    /// the peer no one-sided access, atomics or rendezvous (their grants would be reachable
    /// from every other connection's peer): asking for them on such an endpoint is refused;
    /// their own READ/WRITE/atomics on memory the peer grants still work. Raw connections
    /// ([`Endpoint::raw_connector`]) do not use the queue.
    ///
    /// # Examples
    ///
    /// ```
    /// use tokio_rdma::EndpointOptions;
    /// use tokio_rdma::conn::SrqOptions;
    ///
    /// let opts = EndpointOptions::default().shared_receive_queue(SrqOptions::default());
    /// assert_eq!(opts.shared_receive_queue.unwrap().buffer_size, 4096);
    /// ```
    pub fn shared_receive_queue(mut self, opts: SrqOptions) -> Self {
        self.shared_receive_queue = Some(opts);
        self
    }

    /// Bounds the registered memory of the endpoint's message connections: each connection
    /// reserves, before its pools are made, its private receive pool
    /// (`(2 x recv_credits + 3) x recv_buf_size`; nothing on a shared receive queue, whose
    /// buffers are the endpoint's own) and its send staging pool
    /// (`(min(peer's credits, max_staged_chunks, send-queue share) + 1) x min(peer's
    /// recv_buf_size, max_send_chunk)`), and gives it back when its state is gone. A connection
    /// that would exceed the budget is refused before anything of it is registered:
    /// [`Error::MemoryBudgetExhausted`] on this side, [`Error::ConnectionRejected`] with that
    /// text on the peer's. `None`: no limit. Not counted: the application's own pools
    /// ([`Connection::pool`]), registration caches, and the one rendezvous message a
    /// connection may be reading at a time (at most its `max_message_size`, registered for
    /// the read only); see `docs/security.md`.
    ///
    /// # Examples
    ///
    /// ```
    /// use tokio_rdma::EndpointOptions;
    /// let opts = EndpointOptions::default().memory_budget(Some(256 << 20));
    /// assert_eq!(opts.memory_budget, Some(256 << 20));
    /// ```
    pub fn memory_budget(mut self, bytes: Option<u64>) -> Self {
        self.memory_budget = bytes;
        self
    }

    fn validate(&self, ctx: &Context) -> Result<DriverOptions> {
        let max = ctx.device_attr().max_cqe;
        let cq_size = self.cq_size.unwrap_or(max.min(65536));
        if cq_size == 0 || cq_size > max {
            return Err(Error::InvalidArgument(format!(
                "cq_size {cq_size} is not in 1..={max} (the device's max_cqe)"
            )));
        }
        if self.poll_batch == 0 || self.poll_batch > 4096 {
            return Err(Error::InvalidArgument(format!(
                "poll_batch {} is not in 1..=4096",
                self.poll_batch
            )));
        }
        if let CompletionMode::Adaptive { max_spin } = self.completion_mode {
            if max_spin > Duration::from_secs(1) {
                return Err(Error::InvalidArgument(format!(
                    "adaptive max_spin {max_spin:?} exceeds one second: use BusyPoll to spin \
                     without limit"
                )));
            }
        }
        Ok(DriverOptions::default()
            .mode(self.completion_mode)
            .cq_size(cq_size)
            .poll_batch(self.poll_batch))
    }
}

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
    inner: Arc<Inner>,
}

struct Inner {
    /// The endpoint's own device context: every verbs object of the endpoint (its completion
    /// queue, protection domains, queue pairs, registrations, shared receive queue) lives
    /// here, so the device's async events about them come to this context's queue, read by
    /// this endpoint's driver alone.
    ctx: Context,
    /// librdmacm's context of the device, which RDMA CM ids bind to and which every endpoint
    /// on the device shares: only to tell which ids are on this device ([`Endpoint::owns`]).
    cm_ctx: Context,
    driver: Driver,
    opts: EndpointOptions,
    srq: Option<Arc<SharedRecv>>,
    memory: Arc<MemoryBudget>,
    /// The id of the next connection made or accepted here ([`Connection::id`]).
    next_conn_id: AtomicU64,
    /// The live connections, for the metrics exporter.
    #[cfg(feature = "metrics")]
    conns: Arc<crate::conn::observe::Registry>,
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
    pub(crate) fn on_context(cm_ctx: Context, opts: EndpointOptions) -> Result<Endpoint> {
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
        Ok(Endpoint {
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
            Connection::connect_on(Some(self.clone()), a, opts.clone())
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
            Listener::bind_on(Some(self.clone()), a, opts.clone())
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
        RawConnector::new(self, addr, opts).await
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
        listen_on(Some(self.clone()), addr, backlog)
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
        self.inner.srq.as_ref().map(|s| s.stats())
    }

    /// The endpoint's memory budget now ([`EndpointOptions::memory_budget`]).
    pub fn memory_stats(&self) -> MemoryStats {
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

    /// The next connection id (from 1).
    pub(crate) fn next_connection_id(&self) -> u64 {
        self.inner.next_conn_id.fetch_add(1, Ordering::Relaxed)
    }

    /// The registry of the endpoint's live connections.
    #[cfg(feature = "metrics")]
    pub(crate) fn conn_registry(&self) -> &Arc<crate::conn::observe::Registry> {
        &self.inner.conns
    }

    /// A handle that does not keep the endpoint open.
    #[cfg(feature = "metrics")]
    pub(crate) fn downgrade(&self) -> WeakEndpoint {
        WeakEndpoint(Arc::downgrade(&self.inner))
    }

    pub(crate) fn shared_recv(&self) -> Option<&Arc<SharedRecv>> {
        self.inner.srq.as_ref()
    }

    /// The device's name.
    pub fn device_name(&self) -> &str {
        self.inner.ctx.name()
    }

    /// The device context the endpoint's verbs objects live on: one of its own (opened with
    /// `ibv_open_device`), not librdmacm's (which RDMA CM ids bind to and every endpoint on
    /// the device shares), so the device's async events about this endpoint's queue pairs,
    /// completion queue and shared receive queue come to this endpoint only. Create objects
    /// to use with the endpoint's driver here.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
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
        self.inner.ctx.odp_caps()
    }

    /// The options in force.
    pub fn options(&self) -> &EndpointOptions {
        &self.inner.opts
    }

    /// The completion queue's driver: create raw queue pairs on it
    /// ([`Driver::create_qp`]).
    pub fn driver(&self) -> &Driver {
        &self.inner.driver
    }

    /// Counters of the endpoint's completion machinery.
    pub fn stats(&self) -> DriverStats {
        self.inner.driver.stats()
    }

    /// Whether `other` is a context of this endpoint's device (the same librdmacm context).
    pub(crate) fn owns(&self, other: &Context) -> bool {
        self.inner.cm_ctx.as_ptr() == other.as_ptr()
    }
}

/// An [`Endpoint`] that does not keep it open (the metrics exporter's).
#[cfg(feature = "metrics")]
pub(crate) struct WeakEndpoint(std::sync::Weak<Inner>);

#[cfg(feature = "metrics")]
impl WeakEndpoint {
    /// The endpoint, if a handle of it is still open.
    pub(crate) fn upgrade(&self) -> Option<Endpoint> {
        self.0.upgrade().map(|inner| Endpoint { inner })
    }
}

impl fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Endpoint")
            .field("device", &self.inner.ctx.name())
            .field("options", &self.inner.opts)
            .finish_non_exhaustive()
    }
}
