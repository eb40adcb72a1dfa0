//! The device-level options of an endpoint ([`EndpointOptions`]) and its memory budget's
//! report ([`MemoryStats`]), public at the crate root. Below the connection code, which reads
//! them; `Endpoint` itself is above it.

use super::srq::SrqOptions;
use crate::driver::{CompletionMode, DriverOptions};
use crate::error::{Error, InvalidArgument, Result};
use crate::verbs::Context;

/// Device-level options of an [`Endpoint`](crate::Endpoint): how futures wait for completions, the
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

/// The memory budget of an [`Endpoint`](crate::Endpoint) now ([`Endpoint::memory_stats`](crate::Endpoint::memory_stats)).
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
    /// Bytes the endpoint's message connections hold now: their pools (reserved at admission,
    /// given back when a connection's state is gone) and the buffers of the rendezvous
    /// messages being read (reserved when a read starts, given back when it ends).
    pub in_use: u64,
    /// Reservations refused with [`Error::MemoryBudgetExhausted`](crate::Error::MemoryBudgetExhausted) so far: connections, and
    /// `recv` calls whose rendezvous message did not fit.
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
    /// receive buffers that every connection ([`Endpoint::connect`](crate::Endpoint::connect), [`Endpoint::listen`](crate::Endpoint::listen))
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
    /// ([`Endpoint::raw_connector`](crate::Endpoint::raw_connector)) do not use the queue.
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
    /// [`Error::MemoryBudgetExhausted`](crate::Error::MemoryBudgetExhausted) on this side, [`Error::ConnectionRejected`] with that
    /// text on the peer's. `None`: no limit. Not counted: the application's own pools
    /// ([`Connection::pool`](super::Connection::pool)), registration caches, and the one rendezvous message a
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

    pub(crate) fn validate(&self, ctx: &Context) -> Result<DriverOptions> {
        let max = ctx.device_attr().max_cqe;
        let cq_size = self.cq_size.unwrap_or(max.min(65536));
        if cq_size == 0 || cq_size > max {
            return Err(Error::InvalidArgument(InvalidArgument::CqSizeOutOfRange {
                cq_size,
                max_cqe: max,
            }));
        }
        let opts = DriverOptions::default()
            .mode(self.completion_mode)
            .cq_size(cq_size)
            .poll_batch(self.poll_batch);
        opts.check().map_err(Error::InvalidArgument)?;
        Ok(opts)
    }
}
