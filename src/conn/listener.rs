//! [`Listener`]: accepts RDMA CM connections, Tokio style, with the handshakes of many clients
//! running at once.

use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{Mutex as AsyncMutex, mpsc};
use tokio::task::{JoinHandle, JoinSet};
use tracing::{Instrument, debug, info_span, warn};

use super::connection::Connection;
use super::device::Device;
use super::establish;
use super::handshake::HandshakeError;
use super::observe;
use super::options::ConnectOptions;
use super::raw::{self, RawListener, RawRequest};
use super::setup;
use super::stream::RdmaStream;
use crate::error::{Error, InvalidArgument, Result};

/// The reason a connection request gets, in its reject's private data, when
/// [`ConnectOptions::backlog`] handshakes are already pending.
pub const BACKLOG_FULL_REASON: &str = "tokio-rdma: listener backlog full";

/// The largest [`ConnectOptions::backlog`] accepted (the backlog also sizes the queue of
/// established connections, and a Tokio channel takes at most `usize::MAX >> 3`).
const MAX_BACKLOG: usize = 1 << 20;

/// Listens for connections on an address.
///
/// A background task (started by [`bind_with`](Self::bind_with)) reads the listening id's
/// RDMA CM events and runs each client's handshake in its own task, so a client that stalls,
/// vanishes half-way or sends garbage delays no one else:
///
/// * Each handshake (decode and negotiate the client's parameters, create its queue pair,
///   accept, wait for the connection to be established) is bounded by
///   [`ConnectOptions::handshake_timeout`]; a client that does not finish in time, or that the
///   transport reports gone (it rejected our reply, its process died), is torn down: its queue
///   pair, protection domain, buffers and CM id are freed.
/// * A client whose handshake is malformed, truncated, of another version, incompatible or not
///   ours at all (a foreign protocol) is rejected with the reason (its
///   [`Connection::connect`] fails with [`Error::ConnectionRejected`] carrying it).
/// * At most [`ConnectOptions::backlog`] handshakes run at once; a request beyond that is
///   rejected at once with [`BACKLOG_FULL_REASON`].
/// * Every refusal is logged (`tracing` warn, naming the peer and the reason) and counted in
///   [`rejected`](Self::rejected); a request without a valid tokio-rdma handshake (a foreign
///   client such as `rping`, or another version) also in
///   [`bad_handshakes`](Self::bad_handshakes).
///
/// Established connections wait in a queue of [`ConnectOptions::backlog`] connections until
/// [`accept`](Self::accept) takes them; while it is full, finished handshakes wait for room
/// (and still count as pending).
///
/// Dropping the listener stops its task, tears down the handshakes in progress, and drops the
/// queued connections nobody accepted (they close as a dropped [`Connection`] does).
///
/// # Examples
///
/// ```no_run
/// use tokio_rdma::conn::Listener;
///
/// # async fn demo() -> tokio_rdma::Result<()> {
/// let listener = Listener::bind("192.0.2.1:7471").await?;
/// loop {
///     let conn = listener.accept().await?;
///     tokio::spawn(async move {
///         while let Ok(Some(msg)) = conn.recv().await {
///             if conn.send(&msg).await.is_err() {
///                 break;
///             }
///         }
///     });
/// }
/// # }
/// ```
pub struct Listener {
    local_addr: Option<SocketAddr>,
    queue: AsyncMutex<mpsc::Receiver<Connection>>,
    shared: Arc<Shared>,
    task: JoinHandle<()>,
}

/// What the listener handle and its tasks share.
#[derive(Debug)]
struct Shared {
    rejected: AtomicU64,
    bad_handshakes: AtomicU64,
    pending: AtomicUsize,
    failure: Mutex<Failure>,
    /// The endpoint(s) accepted connections go on.
    endpoints: setup::EndpointChoice,
}

impl Default for Shared {
    fn default() -> Self {
        Shared {
            rejected: AtomicU64::default(),
            bad_handshakes: AtomicU64::default(),
            pending: AtomicUsize::default(),
            failure: Mutex::default(),
            endpoints: setup::EndpointChoice::PerDevice(Arc::default()),
        }
    }
}

/// The listener's own failure, reported by `accept` once the queue is drained.
#[derive(Debug, Default)]
enum Failure {
    /// None (yet).
    #[default]
    None,
    /// Not reported yet.
    Pending(Error),
    /// Reported once (the error is not `Clone`): later calls get its text.
    Reported(String),
}

impl Shared {
    fn refused(&self) {
        self.rejected.fetch_add(1, Ordering::Relaxed);
    }

    fn set_failure(&self, e: Error) {
        *self.failure.lock().unwrap_or_else(|e| e.into_inner()) = Failure::Pending(e);
    }

    fn take_failure(&self) -> Error {
        let mut f = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        match std::mem::take(&mut *f) {
            Failure::Pending(e) => {
                // The error's own text names its cause (the errno, or the message).
                *f = Failure::Reported(e.to_string());
                e
            }
            Failure::Reported(text) => {
                let e = Error::CmChannel(std::io::Error::other(format!(
                    "the listener stopped earlier: {text}"
                )));
                *f = Failure::Reported(text);
                e
            }
            Failure::None => Error::CmChannel(std::io::Error::other("the listener's task stopped")),
        }
    }
}

/// Counts a handshake as pending for as long as it lives (also when its task is aborted).
struct PendingSlot(Arc<Shared>);

impl PendingSlot {
    fn new(shared: &Arc<Shared>) -> PendingSlot {
        shared.pending.fetch_add(1, Ordering::AcqRel);
        PendingSlot(shared.clone())
    }
}

impl Drop for PendingSlot {
    fn drop(&mut self) {
        self.0.pending.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Listener {
    /// Binds to `addr` (an address of an RDMA device; port 0 picks one) and listens, with
    /// default options. `addr` is anything Tokio's networking types take (a `SocketAddr`, an
    /// `"IP:port"` string, a host name with a port); the first address that binds is used.
    ///
    /// # Errors
    ///
    /// [`Error::LookupHost`](crate::Error::LookupHost) if `addr` does not resolve; CM errors (e.g. the address is not on an RDMA device, or in use).
    ///
    /// # Panics
    ///
    /// Outside a Tokio runtime (the listener's task is spawned on the current one).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn bind(addr: impl tokio::net::ToSocketAddrs + std::fmt::Debug) -> Result<Listener> {
        Listener::bind_with(addr, ConnectOptions::default()).await
    }

    /// Binds to `addr` with `opts` for every accepted connection, and starts the listener's
    /// task on the current Tokio runtime. The server-side options are
    /// [`handshake_timeout`](ConnectOptions::handshake_timeout) and
    /// [`backlog`](ConnectOptions::backlog); `connect_timeout` is for clients.
    ///
    /// # Errors
    ///
    /// As [`bind`](Self::bind); [`Error::Handshake`] for invalid handshake parameters (e.g.
    /// fewer than 2 receive credits), [`Error::InvalidArgument`] for a backlog of 0 or above
    /// 1,048,576, or for an option no accepted connection could be set up with (as
    /// [`Connection::connect_with`](super::Connection::connect_with) refuses it).
    ///
    /// # Panics
    ///
    /// Outside a Tokio runtime.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn bind_with(
        addr: impl tokio::net::ToSocketAddrs + std::fmt::Debug,
        opts: ConnectOptions,
    ) -> Result<Listener> {
        super::addr::first_ok(addr, |a| Listener::bind_on(None, a, opts.clone())).await
    }

    /// Binds on `endpoint` (its device only), or (`None`) on an endpoint per device that
    /// requests arrive on, opened on first use.
    pub(crate) async fn bind_on(
        endpoint: Option<Device>,
        addr: SocketAddr,
        opts: ConnectOptions,
    ) -> Result<Listener> {
        opts.params.validate()?;
        if let (Some(ep), Some(m)) = (&endpoint, opts.completion_mode) {
            if m != ep.options().completion_mode {
                return Err(Error::InvalidArgument(
                    m.mismatch(ep.options().completion_mode),
                ));
            }
        }
        if opts.backlog == 0 {
            return Err(Error::InvalidArgument(InvalidArgument::ZeroBacklog));
        }
        if opts.backlog > MAX_BACKLOG {
            return Err(Error::InvalidArgument(InvalidArgument::BacklogTooLarge {
                backlog: opts.backlog,
                max: MAX_BACKLOG,
            }));
        }
        // Every accepted connection is set up with these options: what cannot apply is
        // refused now, not with each client's request while the listener accepts nobody.
        let on_srq = match endpoint.as_ref().and_then(|ep| ep.shared_recv()) {
            Some(q) => Some(setup::on_shared_recv(&opts, q)?),
            None => None,
        };
        let checked = on_srq.as_ref().unwrap_or(&opts);
        setup::raw_options(checked, checked.handshake_timeout)?;
        let raw = raw::listen_on(None, addr, u32::try_from(opts.backlog).unwrap_or(u32::MAX))?;
        let local_addr = raw.local_addr();
        let (tx, rx) = mpsc::channel(opts.backlog);
        let mut shared = Shared::default();
        if let Some(ep) = endpoint {
            shared.endpoints = setup::EndpointChoice::Given(ep);
        }
        let shared = Arc::new(shared);
        let span = info_span!("listener", addr = ?local_addr);
        let task = tokio::spawn(run(raw, Arc::new(opts), tx, shared.clone()).instrument(span));
        Ok(Listener {
            local_addr,
            queue: AsyncMutex::new(rx),
            shared,
            task,
        })
    }

    /// The bound address (with the chosen port if bound to port 0), as
    /// `TcpListener::local_addr` gives it.
    ///
    /// # Errors
    ///
    /// `NotConnected` if RDMA CM reported no address for the listening id (not seen in
    /// practice).
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.local_addr.ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::NotConnected, "no local address")
        })
    }

    /// The established connections as a [`Stream`](futures::Stream) of byte streams, for
    /// APIs that take one (tonic's `serve_with_incoming`, `futures`' combinators), as
    /// `tokio_stream::wrappers::TcpListenerStream` is for a `TcpListener`. Each item is
    /// [`accept`](Self::accept) then [`Connection::into_stream`]; the stream never ends (a
    /// failure of the listener itself is an `Err` item).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use futures::StreamExt;
    /// use tokio::io::AsyncWriteExt;
    /// use tokio_rdma::conn::Listener;
    ///
    /// # async fn demo() -> std::io::Result<()> {
    /// let listener = Listener::bind("192.0.2.1:7471").await?;
    /// let mut incoming = listener.into_incoming();
    /// while let Some(stream) = incoming.next().await {
    ///     let mut stream = stream?;
    ///     tokio::spawn(async move { stream.write_all(b"hello\n").await });
    /// }
    /// # Ok(()) }
    /// ```
    pub fn into_incoming(self) -> Incoming {
        Incoming {
            listener: Arc::new(self),
            accept: None,
        }
    }

    /// Connection requests refused so far: bad or foreign handshakes, a full backlog, and
    /// setups that failed or timed out (the client stalled, vanished, or refused our reply).
    pub fn rejected(&self) -> u64 {
        self.shared.rejected.load(Ordering::Relaxed)
    }

    /// Connection requests refused because they carried no tokio-rdma handshake, or an
    /// invalid or incompatible one: a foreign client (`rping`, a C `rdma_client`, a perftest
    /// tool; these need the raw layer, [`crate::verbs::CmId`]), or a tokio-rdma peer of another
    /// version or with options this side cannot meet. Each is also counted in
    /// [`rejected`](Self::rejected) and logged as a `tracing` warn event with the peer's address
    /// and the reason; the client gets [`Error::ConnectionRejected`] with the reason.
    pub fn bad_handshakes(&self) -> u64 {
        self.shared.bad_handshakes.load(Ordering::Relaxed)
    }

    /// Handshakes in progress now (at most [`ConnectOptions::backlog`]), counting finished ones
    /// that wait for room in the queue of established connections.
    pub fn pending(&self) -> usize {
        self.shared.pending.load(Ordering::Acquire)
    }

    /// Takes the next established connection, waiting for one.
    ///
    /// # Errors
    ///
    /// Only errors of the listener itself (its event channel failed), once the connections
    /// established before are all taken. A failing client is rejected, logged, counted in
    /// [`rejected`](Self::rejected), and never seen here.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a connection is only taken from the queue when this returns it, so a
    /// dropped `accept` future loses none (the next call gets it).
    pub async fn accept(&self) -> Result<Connection> {
        let mut queue = self.queue.lock().await;
        match queue.recv().await {
            Some(conn) => Ok(conn),
            None => Err(self.shared.take_failure()),
        }
    }
}

/// The established connections of a [`Listener`] as byte streams: a
/// [`Stream`](futures::Stream) of `io::Result<RdmaStream>`, from
/// [`Listener::into_incoming`].
///
/// Polling it is cancel safe (it keeps its one [`accept`](Listener::accept) in progress, which
/// takes a connection from the queue only when it returns it); dropping it drops the listener.
pub struct Incoming {
    listener: Arc<Listener>,
    accept: Option<Pin<Box<dyn Future<Output = Result<Connection>> + Send>>>,
}

impl Incoming {
    /// The listener (its address, counters).
    pub fn listener(&self) -> &Listener {
        &self.listener
    }
}

impl futures::Stream for Incoming {
    type Item = std::io::Result<RdmaStream>;

    fn poll_next(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        let this = &mut *self;
        let accept = this.accept.get_or_insert_with(|| {
            let listener = this.listener.clone();
            Box::pin(async move { listener.accept().await })
        });
        let res = std::task::ready!(accept.as_mut().poll(cx));
        this.accept = None;
        std::task::Poll::Ready(Some(
            res.map(Connection::into_stream)
                .map_err(std::io::Error::from),
        ))
    }
}

impl fmt::Debug for Incoming {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Incoming")
            .field("listener", &self.listener)
            .finish_non_exhaustive()
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        // Dropping the task's future drops its set of handshake tasks, which aborts them
        // (each tears down what it made); the queue's connections drop with `self.queue`.
        self.task.abort();
    }
}

impl fmt::Debug for Listener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Listener")
            .field("local_addr", &self.local_addr)
            .field("pending", &self.pending())
            .field("rejected", &self.rejected())
            .finish_non_exhaustive()
    }
}

/// The listener's task: takes the raw listener's connection requests and spawns a handshake
/// task for each.
async fn run(
    raw: RawListener,
    opts: Arc<ConnectOptions>,
    tx: mpsc::Sender<Connection>,
    shared: Arc<Shared>,
) {
    let mut setups = JoinSet::new();
    let failure = loop {
        tokio::select! {
            req = raw.next() => match req {
                Ok(req) => on_request(req, &opts, &tx, &shared, &mut setups),
                Err(e) => break e,
            },
            Some(done) = setups.join_next(), if !setups.is_empty() => {
                if let Err(e) = done {
                    if e.is_panic() {
                        warn!(error = %e, "a handshake task panicked");
                    }
                }
            }
        }
    };
    warn!(error = %failure, "listener stopped");
    shared.set_failure(failure);
    // No new requests; the handshakes in progress may still deliver their connections.
    drop(raw);
    drop(tx);
    while setups.join_next().await.is_some() {}
}

/// Handles one connection request: refused at once if the backlog is full, else its handshake
/// runs in a task of its own.
fn on_request(
    req: RawRequest,
    opts: &Arc<ConnectOptions>,
    tx: &mpsc::Sender<Connection>,
    shared: &Arc<Shared>,
    setups: &mut JoinSet<()>,
) {
    let peer = req.peer_addr();
    let span = observe::conn_span(peer, "server");
    let pending = shared.pending.load(Ordering::Acquire);
    if pending >= opts.backlog {
        shared.refused();
        span.in_scope(|| {
            warn!(
                pending,
                backlog = opts.backlog,
                "connection request rejected: listener backlog full"
            );
        });
        raw::reject_with(req.id(), BACKLOG_FULL_REASON);
        return;
    }
    let slot = PendingSlot::new(shared);
    let (opts, tx, shared) = (opts.clone(), tx.clone(), shared.clone());
    setups.spawn(
        async move {
            let timeout = opts.handshake_timeout;
            let setup = establish::accept(req, &opts, &shared.endpoints, tracing::Span::current());
            let result = match tokio::time::timeout(timeout, setup).await {
                Ok(r) => r,
                Err(_) => Err(Error::Timeout {
                    what: "the client's handshake",
                    after: timeout,
                }),
            };
            match result {
                Ok(conn) => {
                    debug!("connection established, queued for accept");
                    // Waits while the queue is full; fails only if the listener is gone (the
                    // connection is then dropped, which closes it).
                    let _ = tx.send(conn).await;
                }
                Err(e) => {
                    shared.refused();
                    match &e {
                        Error::Handshake(h) => {
                            shared.bad_handshakes.fetch_add(1, Ordering::Relaxed);
                            warn!(
                                peer = ?peer,
                                reason = %h,
                                foreign = is_foreign(h),
                                "connection request rejected: no valid tokio-rdma handshake"
                            );
                        }
                        _ => observe::setup_failed(&tracing::Span::current(), &e),
                    }
                }
            }
            drop(slot);
        }
        .instrument(span),
    );
}

/// Whether a handshake failure means the client does not speak tokio-rdma at all (no
/// private data, too little of it, or not our magic), rather than another version or options.
fn is_foreign(e: &HandshakeError) -> bool {
    matches!(
        e,
        HandshakeError::Missing
            | HandshakeError::Truncated { .. }
            | HandshakeError::BadMagic { .. }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn foreign_handshakes_are_told_from_incompatible_ones() {
        assert!(is_foreign(&HandshakeError::Missing));
        assert!(is_foreign(&HandshakeError::BadMagic { found: *b"RPNG" }));
        assert!(!is_foreign(&HandshakeError::UnsupportedVersion {
            found: 9,
            supported: 1
        }));
    }

    #[test]
    fn the_listener_failure_is_reported_once_then_by_its_text() {
        let shared = Shared::default();
        let e = shared.take_failure();
        assert!(
            e.to_string().contains("RDMA CM event channel failed"),
            "{e}"
        );
        shared.set_failure(Error::CmChannel(std::io::Error::other("fd gone")));
        let first = shared.take_failure();
        assert!(
            matches!(&first, Error::CmChannel(io) if io.to_string() == "fd gone"),
            "{first:?}"
        );
        let again = shared.take_failure();
        match &again {
            Error::CmChannel(io) => assert!(
                io.to_string()
                    == "the listener stopped earlier: RDMA CM event channel failed: fd gone",
                "{io}"
            ),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_pending_slot_counts_while_it_lives() {
        let shared = Arc::new(Shared::default());
        let a = PendingSlot::new(&shared);
        let b = PendingSlot::new(&shared);
        assert_eq!(shared.pending.load(Ordering::Acquire), 2);
        drop(a);
        assert_eq!(shared.pending.load(Ordering::Acquire), 1);
        drop(b);
        assert_eq!(shared.pending.load(Ordering::Acquire), 0);
    }

    #[tokio::test]
    async fn options_are_checked_before_binding() {
        let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let err = Listener::bind_with(addr, ConnectOptions::default().backlog(0))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        let err = Listener::bind_with(addr, ConnectOptions::default().recv_credits(1))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Handshake(_)), "{err}");
    }

    /// Options every accepted connection is refused with were accepted by `bind` (the
    /// listener then rejected every client and `accept` never returned), and a backlog above
    /// Tokio's channel limit panicked in `mpsc::channel` once bound.
    #[tokio::test]
    async fn options_no_connection_can_use_are_refused_at_bind() {
        let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let bind = |o: ConnectOptions| Listener::bind_with(addr, o);
        let err = bind(ConnectOptions::default().max_staged_chunks(0))
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidArgument(InvalidArgument::ZeroStagedChunks)
            ),
            "{err}"
        );
        let err = bind(ConnectOptions::default().retry_count(7))
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidArgument(InvalidArgument::RetryCountOutOfRange { .. })
            ),
            "{err}"
        );
        let err = bind(ConnectOptions::default().backlog(usize::MAX))
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidArgument(InvalidArgument::BacklogTooLarge { .. })
            ),
            "{err}"
        );
    }
}
