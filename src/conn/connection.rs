//! [`Connection`]: an RC connection set up through RDMA CM, with messages under credit flow
//! control and one-sided operations. The protocol itself is the sans-IO
//! [`ConnProto`](crate::proto::conn::ConnProto); this is its shell.

use std::fmt;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use bytes::Bytes;
use tracing::Instrument;

use super::driver;
use super::handshake::{Flags, Negotiated};
use super::io::{ConnIo, IoConfig};
use super::lifecycle;
use super::memory::Reservation;
use super::observe::{ClosedBy, Observed};
use super::options::ConnectOptions;
use super::raw::RawConnection;
use super::setup;
use super::shared::ConnShared;
use super::srq::SrqShare;
use super::stats::ConnStats;
use crate::buf::{
    CacheConfig, Grant, IoBufMut, MrRegistrar, Pool, PoolConfig, RegCache, Registered,
    RegisteredBytes, RemoteAccess, SharedGrant, SharedRegion,
};
use crate::driver::AsyncQp;
use crate::error::{Error, InvalidArgument, Result};
use crate::proto::conn::{ConnConfig, ConnProto};
use crate::verbs::ProtectionDomain;

/// An established RDMA connection.
///
/// * Messages: [`send`](Self::send) / [`recv`](Self::recv), under credit-based flow control:
///   a sender never sends a chunk without a receive posted at the peer, and the receiver
///   returns credits only as the application consumes what arrived, so a slow reader slows
///   the sender instead of growing memory (see `docs/connections.md` for the budget). Messages
///   larger than the peer's receive buffers are split into chunks and reassembled; a
///   single-chunk message is received without copying. Any number of tasks may send and
///   receive at once; every message arrives whole, in each sender's order, and a cancelled
///   send never leaves a partial message at the peer.
/// * One-sided I/O: [`write`](Self::write), [`read`](Self::read) and atomics against
///   [`RemoteToken`](crate::buf::RemoteToken)s the peer granted with [`grant`](Self::grant).
///   Each connection has its own protection domain: a token works on the connection it was
///   granted for and on no other. (On an endpoint with a shared receive queue the
///   connections share one and grant nothing; see
///   [`EndpointOptions::shared_receive_queue`](crate::EndpointOptions::shared_receive_queue).)
/// * A byte stream: [`into_stream`](Self::into_stream) gives an `AsyncRead + AsyncWrite`.
/// * [`close`](Self::close) ends the stream cleanly (the peer's `recv` returns `Ok(None)`) and
///   resolves once that is delivered; the disconnect and the drain follow in the background.
///   Dropping the connection does the same without waiting. A failure is never reported as a
///   clean close.
///
/// # Examples
///
/// ```no_run
/// use tokio_rdma::conn::Connection;
///
/// # async fn demo() -> tokio_rdma::Result<()> {
/// let conn = Connection::connect("192.0.2.1:7471").await?;
/// conn.send(b"hello").await?;
/// if let Some(reply) = conn.recv().await? {
///     println!("got {} bytes", reply.len());
/// }
/// conn.close().await?;
/// # Ok(()) }
/// ```
pub struct Connection {
    pub(super) shared: Arc<ConnShared>,
    peer: Option<SocketAddr>,
    local: Option<SocketAddr>,
    pub(super) span: tracing::Span,
    /// What this side offered in the handshake (one-sided access, atomics).
    pub(super) offered: Flags,
    pub(super) user_pool: OnceLock<Pool>,
    user_pool_config: PoolConfig,
    /// Made by [`registration_cache`](Self::registration_cache): `send_bytes` of memory
    /// outside the pools looks it up there instead of copying.
    pub(super) reg_cache: OnceLock<RegCache>,
    /// What [`register_bytes`](Self::register_bytes) registered: `send_bytes` of memory inside
    /// a live registration sends it without copying.
    pub(super) registered: OnceLock<Registered>,
}

/// The largest RDMA READ to post at once: the device's largest message (ports of one device
/// share it in practice; port 1 is asked), at most 1 GiB.
fn max_read(pd: &ProtectionDomain) -> u64 {
    let device = pd
        .context()
        .query_port(1)
        .map_or(u64::MAX, |p| u64::from(p.max_msg_sz));
    device.clamp(4096, 1 << 30)
}

/// A connection whose receives are posted, waiting for the CM handshake to complete.
pub(crate) struct Starting {
    io: Arc<ConnIo>,
    memory: Reservation,
    negotiated: Negotiated,
    offered: Flags,
    user_pool_config: PoolConfig,
}

impl Connection {
    /// Setup, phase 1 (before the peer learns this side's credits): builds the state machine
    /// on `qp` (in `pd`, with the private buffers of `pool`) and posts its receives.
    /// `receive`: the receive pool, the claim on the shared receive queue if it receives
    /// there, and the connection's reservation in its endpoint's memory budget (held as long
    /// as the connection's state).
    pub(crate) fn start(
        qp: &AsyncQp,
        pd: &ProtectionDomain,
        receive: (Pool, Option<SrqShare>, Reservation),
        negotiated: Negotiated,
        opts: &ConnectOptions,
    ) -> Result<Starting> {
        let (pool, srq, memory) = receive;
        let cfg = ConnConfig {
            send_credits: negotiated.send_credits,
            send_initial: negotiated.send_initial_credits,
            recv_credits: negotiated.recv_credits,
            recv_initial: negotiated.recv_initial_credits,
            max_send_size: negotiated.max_send_size,
            max_message_size: negotiated.max_message_size,
            recv_budget: opts.recv_budget.max(negotiated.max_message_size),
            keepalive: opts.keepalive,
            keepalive_timeout: opts.keepalive_timeout,
            rendezvous: negotiated.rendezvous,
            close_timeout: opts.close_timeout,
        };
        let staging_count = setup::staging_buffers(&negotiated, opts);
        let staging = Pool::with_pd(pd, setup::staging_pool_config(&negotiated, opts))?;
        let io = Arc::new_cyclic(|me| {
            ConnIo::new(
                IoConfig {
                    qp: qp.verbs().clone(),
                    wr_base: qp.sink_wr_id(0),
                    pool,
                    staging,
                    recv_size: negotiated.recv_buf_size as usize,
                    max_inline: qp.caps().max_inline_data as usize,
                    sq_budget: setup::sink_sends(opts),
                    staging_count,
                    max_read: max_read(pd),
                    rdv_threshold: opts.rendezvous_threshold,
                    srq,
                },
                // Sends wait for RTS: the passive side's receives complete from RTR on.
                ConnProto::opening(cfg, Instant::now()),
                me.clone(),
            )
        });
        qp.set_sink(io.clone());
        // Posts the initial receives.
        let short = io.with(|s| s.short);
        if let Some(e) = io.lock().proto.failure().cloned() {
            return Err(Error::QpFailed(e));
        }
        debug_assert!(!short, "the private pool covers the initial receives");
        Ok(Starting {
            io,
            memory,
            negotiated,
            offered: opts.params.flags,
            user_pool_config: opts.user_pool.clone(),
        })
    }

    /// Setup, phase 2: the CM connection `raw` (the queue pair `start` was given) is
    /// established and its queue pair in RTS; the driver task starts. A peer that disconnected
    /// before the connection was handed out (its events were consumed by the setup) still has
    /// what it sent delivered, then the connection ends.
    pub(crate) fn established(
        starting: Starting,
        raw: RawConnection,
        mut obs: Observed,
    ) -> Connection {
        let Starting {
            io,
            memory,
            negotiated,
            offered,
            user_pool_config,
        } = starting;
        let parts = raw.into_parts();
        let peer = parts.id.peer_addr();
        let local = parts.id.local_addr();
        obs.peer = peer;
        let span = obs.span.clone();
        let shared = Arc::new(ConnShared {
            qp: parts.qp,
            pd: parts.pd,
            params: negotiated,
            io,
            memory,
            obs,
        });
        // The queue pair is in RTS: what the state machine held back (credit returns for
        // messages that arrived meanwhile) goes out now.
        shared.io.with(|s| s.proto.established(Instant::now()));
        if parts.peer_gone {
            shared.io.with(|s| s.in_error = true);
            shared.qp.force_error(crate::QpFailure::Disconnected);
        }
        // On a shared receive queue: credits beyond the first may be granted now (the driver
        // task's first step claims them).
        shared.io.with(|s| s.srq.as_mut().map(SrqShare::open));
        tokio::spawn(
            driver::run(shared.clone(), Arc::new(parts.id), parts.events).instrument(span.clone()),
        );
        lifecycle::established(&shared);
        Connection {
            shared,
            peer,
            local,
            span,
            offered,
            user_pool: OnceLock::new(),
            reg_cache: OnceLock::new(),
            registered: OnceLock::new(),
            user_pool_config,
        }
    }

    /// A registered buffer pool for this connection's one-sided operations and grants,
    /// created on first use (its buffers are registered in this connection's protection
    /// domain, so they work on this connection only). The connection's own message traffic
    /// uses a separate, private budget: holding every buffer of this pool never stalls
    /// [`send`](Self::send) or [`recv`](Self::recv).
    ///
    /// The local buffers of [`read`](Self::read), [`write`](Self::write) and the atomics must
    /// come from here: any other memory (another connection's pool, a pool on a protection
    /// domain of your own) is refused with [`Error::InvalidArgument`] before posting.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo(
    /// #     conn: tokio_rdma::conn::Connection,
    /// #     token: tokio_rdma::buf::RemoteToken,
    /// # ) -> tokio_rdma::Result<()> {
    /// let buf = conn.pool()?.acquire(4096).await?;
    /// let (res, buf) = conn.read(buf, token.slice(0..4096)?).await;
    /// res?;
    /// println!("first byte {}", buf[0]);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// Registration errors from creating the pool ([`Error::MemlockExhausted`], ...).
    pub fn pool(&self) -> Result<&Pool> {
        if let Some(p) = self.user_pool.get() {
            return Ok(p);
        }
        let pool = Pool::with_pd(&self.shared.pd, self.user_pool_config.clone())?;
        Ok(self.user_pool.get_or_init(|| pool))
    }

    /// This connection's registration cache, made on the first call (with `config`; later
    /// calls return the same cache and ignore it), registering in this connection's
    /// protection domain. From then on [`send_bytes`](Self::send_bytes) of bytes outside the
    /// connection's pools sends them without copying: their pages are registered on the first
    /// send from them (a miss, `ibv_reg_mr`) and every later send from them is a cache hit;
    /// the registration (a lease) is held until the device has read the bytes. Use it for
    /// long-lived memory sent many times (a file mapping, an arena); the first send from each
    /// range pays a registration, which is slower than copying a small message.
    ///
    /// For memory the application allocates and frees itself, use
    /// [`register_bytes`](Self::register_bytes) instead: it is safe, because the registration
    /// owns the bytes.
    ///
    /// # Safety
    ///
    /// The cache's contract ([`RegCache::new`]): memory sent through `send_bytes` while the
    /// cache exists must not be unmapped or remapped (`munmap`, `mremap`,
    /// `madvise(MADV_DONTNEED)`, ...) without [`RegCache::invalidate`] first. Mind that
    /// `send_bytes` drops the `Bytes` it is given once the device has read them: if that was
    /// the last handle of a heap allocation, the allocator may unmap its pages (glibc does for
    /// allocations above its mmap threshold, 128 KiB by default) and map other memory at the
    /// same address later, and the cache then sends the old pages' bytes from there. So send
    /// only memory that outlives the cache (a `static`, a leaked arena, a file mapping you
    /// keep and invalidate before unmapping), or keep a handle to every `Bytes` you send, or
    /// use a cache with [`CacheConfig::on_demand`], whose registrations follow the mappings.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use tokio_rdma::buf::CacheConfig;
    /// # async fn demo(conn: tokio_rdma::conn::Connection) -> tokio_rdma::Result<()> {
    /// // A long-lived buffer, never freed while the cache lives.
    /// let arena: &'static [u8] = Box::leak(vec![7u8; 1 << 20].into_boxed_slice());
    /// // SAFETY: `arena` is never unmapped.
    /// unsafe { conn.registration_cache(CacheConfig::default()) };
    /// conn.send_bytes(bytes::Bytes::from_static(arena)).await?; // registers once, no copy
    /// conn.send_bytes(bytes::Bytes::from_static(&arena[..4096])).await?; // a cache hit
    /// assert_eq!(conn.stats().send_bytes_copied, 0);
    /// # Ok(()) }
    /// ```
    pub unsafe fn registration_cache(&self, config: CacheConfig) -> &RegCache {
        self.reg_cache.get_or_init(|| {
            // SAFETY: the caller's contract.
            unsafe { RegCache::with_pd(&self.shared.pd, config) }
        })
    }

    /// Registers the memory of `bytes` in this connection's protection domain (for local
    /// reads: the peer gets no key) and returns the registration, which owns `bytes`. While it
    /// lives, [`send_bytes`](Self::send_bytes) of any `Bytes` pointing inside that memory
    /// sends it straight from there, neither copying nor registering (counted as
    /// [`ConnStats::send_bytes_zero_copy`]); each send keeps the registration alive until the
    /// device has read its bytes. Register once what you send many times (a table, a file's
    /// contents); a `Bytes` that is sent once is cheaper copied.
    ///
    /// Unlike [`registration_cache`](Self::registration_cache) this is safe: the memory cannot
    /// be freed while registered, and once the registration and every `Bytes` made from it
    /// are dropped, later sends from that address are copied from whatever is there then.
    ///
    /// This calls `ibv_reg_mr`, which pins every page and blocks the calling thread meanwhile
    /// (milliseconds per hundreds of MiB on hardware, longer on soft-RoCE): register large
    /// memory from [`tokio::task::spawn_blocking`] or at startup.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for empty `bytes`; the registration error otherwise
    /// ([`Error::MemlockExhausted`] names `RLIMIT_MEMLOCK`).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo(conn: tokio_rdma::conn::Connection) -> tokio_rdma::Result<()> {
    /// let page = bytes::Bytes::from(vec![1u8; 64 << 10]);
    /// let reg = conn.register_bytes(page.clone())?;
    /// conn.send_bytes(page.slice(..4096)).await?; // no copy
    /// conn.send_bytes(reg.slice(4096..)).await?; // no copy either
    /// assert_eq!(conn.stats().send_bytes_copied, 0);
    /// # Ok(()) }
    /// ```
    pub fn register_bytes(&self, bytes: Bytes) -> Result<RegisteredBytes> {
        let reg = RegisteredBytes::register(&MrRegistrar::new(&self.shared.pd), bytes)?;
        self.registered
            .get_or_init(Registered::default)
            .insert(&reg);
        Ok(reg)
    }

    /// Grants the peer `access` to `range` of `buf` through this connection only: the
    /// registration lives in this connection's protection domain, so the token is useless on
    /// any other connection (whatever rkey is presented there). Send the token to the peer
    /// ([`RemoteToken::to_bytes`](crate::buf::RemoteToken::to_bytes)); dropping the grant revokes
    /// it. `buf` may be any [`IoBufMut`] (a `Vec<u8>`, a pool buffer); the grant owns it.
    ///
    /// **This is the only way to make a token for this connection's peer.** A
    /// [`Grant`] made with [`Grant::region`] or [`Grant::new`] on a
    /// [`ProtectionDomain`](crate::verbs::ProtectionDomain) you opened yourself, a
    /// `RegisteredBuffer`'s key, or a grant of another connection gives a token that never
    /// works here: the peer's access fails with `IBV_WC_REM_ACCESS_ERR` and the device closes
    /// the connection, and this side cannot detect the mistake. A service with several clients
    /// grants once per connection.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use tokio_rdma::buf::RemoteAccess;
    /// # async fn demo(conn: tokio_rdma::conn::Connection) -> tokio_rdma::Result<()> {
    /// let table = vec![7u8; 4096];
    /// let grant = conn.grant(table, 0..4096, RemoteAccess::READ)?;
    /// conn.send(&grant.token().to_bytes()).await?; // the peer: RemoteToken::from_bytes
    /// // ... the peer reads with `conn.read(buf, token)` ...
    /// let _msg = conn.recv().await?; // e.g. "done"
    /// drop(grant); // revoked: the token stops working, then the Vec is freed
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an empty or out-of-range `range`, no rights, or rights
    /// this side did not offer in the handshake ([`ConnectOptions::one_sided`],
    /// [`ConnectOptions::atomics`]): the peer's access would fail and kill the connection, so
    /// the grant is refused here. Registration errors.
    pub fn grant<B: IoBufMut>(
        &self,
        buf: B,
        range: std::ops::Range<usize>,
        access: RemoteAccess,
    ) -> Result<Grant<B>> {
        self.check_offered(access)?;
        Grant::region(&self.shared.pd, buf, range, access)
    }

    /// Grants the peer `access` to `range` of a [`SharedRegion`] that other connections may be
    /// granted too: the region's pages are registered once more, in this connection's
    /// protection domain (no copy), and the token works on this connection only. Each grant is
    /// revoked on its own by dropping it; the region lives while any grant or handle does. This
    /// is how one table is served to many clients by one-sided reads (`examples/rowstore.rs`
    /// shows the whole service, with a version per row so readers never accept a row this side
    /// was rewriting).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use tokio_rdma::buf::{RemoteAccess, SharedRegion};
    /// # async fn demo(clients: Vec<tokio_rdma::conn::Connection>) -> tokio_rdma::Result<()> {
    /// let table = SharedRegion::new(16 << 20);
    /// let mut grants = Vec::new();
    /// for conn in &clients {
    ///     let g = conn.grant_shared(&table, 0..table.len(), RemoteAccess::READ)?;
    ///     conn.send(&g.token().to_bytes()).await?;
    ///     grants.push(g);
    /// }
    /// assert_eq!(table.grants(), clients.len()); // one table in memory, a key per client
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// As [`grant`](Self::grant); on-demand access is refused (the region is pinned).
    pub fn grant_shared(
        &self,
        region: &SharedRegion,
        range: std::ops::Range<usize>,
        access: RemoteAccess,
    ) -> Result<SharedGrant> {
        self.check_offered(access)?;
        region.grant(&self.shared.pd, range, access)
    }

    /// Refuses rights this side did not offer in the handshake.
    fn check_offered(&self, access: RemoteAccess) -> Result<()> {
        let offered = self.offered;
        if (access.contains(RemoteAccess::READ) || access.contains(RemoteAccess::WRITE))
            && !offered.contains(Flags::ONE_SIDED)
        {
            return Err(Error::InvalidArgument(
                InvalidArgument::GrantWithoutOneSided {
                    access: access.to_flags(),
                },
            ));
        }
        if access.contains(RemoteAccess::ATOMIC) && !offered.contains(Flags::ATOMICS) {
            return Err(Error::InvalidArgument(
                InvalidArgument::GrantWithoutAtomics {
                    access: access.to_flags(),
                },
            ));
        }
        Ok(())
    }

    /// The negotiated parameters.
    pub fn params(&self) -> &Negotiated {
        &self.shared.params
    }

    /// Counters of this connection.
    pub fn stats(&self) -> ConnStats {
        lifecycle::stats(&self.shared)
    }

    /// This connection's id: unique among the connections of its
    /// [`Endpoint`](crate::Endpoint) (a counter from 1; the shorthands
    /// [`connect`](Self::connect) and [`Listener::bind`] use an endpoint per client or per
    /// device, so their ids repeat across endpoints). It is the `conn_id` field of the
    /// connection's `conn` tracing span, which also carries `peer`, `side` and the local
    /// `qpn`, and the `conn_id` label of its metrics (`docs/observability.md`).
    ///
    /// [`Listener::bind`]: crate::conn::Listener::bind
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo(conn: tokio_rdma::conn::Connection) {
    /// let s = conn.stats();
    /// println!("conn {}: {} messages sent", conn.id(), s.protocol.messages_sent);
    /// # }
    /// ```
    pub fn id(&self) -> u64 {
        self.shared.obs.id
    }

    /// The peer's address (its IP address on the RDMA link and RDMA CM port), as
    /// `TcpStream::peer_addr` gives it.
    ///
    /// # Errors
    ///
    /// `NotConnected` if RDMA CM reported no address for the peer (not seen in practice).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo(conn: tokio_rdma::conn::Connection) -> std::io::Result<()> {
    /// println!("{} -> {}", conn.local_addr()?, conn.peer_addr()?);
    /// # Ok(()) }
    /// ```
    pub fn peer_addr(&self) -> std::io::Result<SocketAddr> {
        self.peer
            .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotConnected, "no peer address"))
    }

    /// This side's address (the IP address of the RDMA device's link and the RDMA CM
    /// port), as `TcpStream::local_addr` gives it.
    ///
    /// # Errors
    ///
    /// `NotConnected` if RDMA CM reported no local address (not seen in practice).
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.local.ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::NotConnected, "no local address")
        })
    }

    /// The failure that ended this connection, if it failed (a clean close is not a failure).
    pub fn failure(&self) -> Option<crate::QpFailure> {
        self.shared.io.lock().proto.failure().cloned()
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        // The driver task closes (end of stream, disconnect, drain) in the background; it
        // never blocks here.
        lifecycle::close(&self.shared, ClosedBy::Drop, true);
    }
}

impl fmt::Debug for Connection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Connection")
            .field("id", &self.shared.obs.id)
            .field("peer", &self.peer)
            .field("qpn", &self.shared.qp.qpn())
            .field("params", &self.shared.params)
            .finish_non_exhaustive()
    }
}
