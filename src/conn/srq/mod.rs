//! An endpoint's shared receive queue for its message connections ([`SrqOptions`]): one set of
//! receive buffers, posted on one `ibv_srq`, that every connection on the endpoint receives
//! into, so receive memory is the budget chosen here instead of growing with the number of
//! connections.
//!
//! # Credits over shared buffers
//!
//! A connection's peer may send only what this side granted (credits), and every credit
//! must stand for a receive the device can consume, or the peer meets receiver-not-ready.
//! With shared buffers, a credit is a claim on the shared queue. A connection's *footprint*
//! is what it granted (data credits outstanding plus its control receives) plus the
//! buffers its application holds (received messages not dropped yet). Two counters, kept
//! with atomics (no lock shared by the connections), track the claims:
//!
//! * `spare` = buffers - Σ max(footprint, floor). Each connection has a *floor*
//!   ([`MIN_CREDITS`](super::handshake::MIN_CREDITS) data credits, or fewer if its credits are
//!   fewer, plus the [`CONTROL_RECVS`] control receives), reserved when it is admitted:
//!   below its floor it can always grant again as its buffers come back, so it always makes
//!   progress, whatever the others do; a reader that stops holds at most its floor (plus
//!   what it grew into). Since Σ footprints never exceeds the buffers, every receive
//!   granted has a buffer.
//! * `slack` = receives on the queue - receives granted: the same promise in terms of what is
//!   posted right now (a buffer dropped by the application is free before it is re-posted);
//!   a grant takes one, and waits for a re-post when there is none.
//!
//! Credits above the floor (up to the connection's `recv_credits`) are granted only from
//! `spare`, never its last eighth (kept for the floors of connections to come), and only as
//! traffic earns them: each receive the peer used allows two claims
//! (re-grant it and grow by one), so an idle connection stays at its floor and a busy one
//! doubles its window each round trip. After a connection was refused, claims stop earning
//! growth until a quarter of the queue is unclaimed again: busy connections shrink back to
//! their floors as their peers use their credits, which makes room for new ones.
//!
//! A connection is admitted only if `spare` covers its floor; otherwise it is refused with
//! [`Error::ReceiveBudgetExhausted`]. Messages an application keeps after their connection
//! ended no longer count against anyone (their buffers are re-posted once dropped).
//!
//! The device gives a buffer to any SEND on the queue, credits or not: a peer that overruns
//! its credits is seen only when that completion is processed. Its connection then fails, and
//! its queue pair goes to the error state in the same poll (not after its error report), so it
//! takes no more buffers; those it took are never delivered and come back as their completions
//! are processed (`docs/security.md`).
//!
//! The queue is refilled as buffers come back: by the connection whose receive it was, on
//! its next step, and by a task waiting for the pool (which also re-arms the queue's limit
//! event, `IBV_EVENT_SRQ_LIMIT_REACHED`, counted in [`SrqStats::limit_events`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use tracing::{debug, warn};

use budget::{Budget, Claim};

use crate::buf::{Pool, PoolBuf, PoolConfig, PoolMetrics, SizeClass};
use crate::driver::{Deferred, Driver, Sink, srq_wr_id};
use crate::error::{Error, InvalidArgument, QpFailure, Result, Unsupported};
use crate::proto::Cqe;
use crate::proto::conn::CONTROL_RECVS;
use crate::verbs::{ProtectionDomain, RecvWr, SharedReceiveQueue};

mod budget;

/// Low half of a sink `wr_id`: this bit marks a receive on the shared queue (the rest is the
/// buffer's pool slot).
pub(crate) const SRQ_BIT: u32 = 1 << 30;

/// Options of an endpoint's shared receive queue
/// ([`EndpointOptions::shared_receive_queue`](crate::EndpointOptions::shared_receive_queue)).
///
/// # Examples
///
/// ```
/// use tokio_rdma::EndpointOptions;
/// use tokio_rdma::conn::SrqOptions;
///
/// // 8,192 receive buffers of 4 KiB (32 MiB) for every connection on the endpoint.
/// let opts = EndpointOptions::default()
///     .shared_receive_queue(SrqOptions::default().buffers(8192).buffer_size(4096));
/// assert_eq!(opts.shared_receive_queue.unwrap().buffers, 8192);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct SrqOptions {
    /// Receive buffers on the queue (the whole receive memory of the endpoint's message
    /// connections is `buffers * buffer_size`). Each connection needs a floor of 5 of them
    /// (2 data credits and 3 control receives) to be admitted. Default 4096.
    pub buffers: u32,
    /// Size of each buffer: the receive buffer size every connection on the endpoint
    /// announces (a [`ConnectOptions::recv_buf_size`](super::ConnectOptions::recv_buf_size)
    /// set to anything else is refused). Default 4096.
    pub buffer_size: u32,
    /// The queue's limit event fires when fewer than this many receives are posted (the
    /// applications hold the rest); it triggers a refill. Default `buffers / 8`.
    pub low_watermark: Option<u32>,
}

impl Default for SrqOptions {
    fn default() -> Self {
        SrqOptions {
            buffers: 4096,
            buffer_size: 4096,
            low_watermark: None,
        }
    }
}

impl SrqOptions {
    /// Sets the number of buffers.
    pub fn buffers(mut self, n: u32) -> Self {
        self.buffers = n;
        self
    }

    /// Sets the buffer size.
    pub fn buffer_size(mut self, n: u32) -> Self {
        self.buffer_size = n;
        self
    }

    /// Sets the limit-event threshold.
    pub fn low_watermark(mut self, n: u32) -> Self {
        self.low_watermark = Some(n);
        self
    }
}

/// A snapshot of an endpoint's shared receive queue ([`Endpoint::shared_receive_stats`](crate::Endpoint::shared_receive_stats)).
///
/// # Examples
///
/// ```no_run
/// # fn f(ep: &tokio_rdma::Endpoint) {
/// if let Some(s) = ep.shared_receive_stats() {
///     println!("{} connections share {} bytes of receive buffers", s.connections, s.pool.bytes_registered);
/// }
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct SrqStats {
    /// Buffers of the queue.
    pub buffers: u32,
    /// Receives on the queue now.
    pub posted: u64,
    /// Connections admitted and not yet closed.
    pub connections: u32,
    /// Receives granted to peers now (data credits and control receives).
    pub granted: u64,
    /// Buffers no connection has claimed (`spare` in the module docs): what new connections'
    /// floors and busy connections' growth can take.
    pub spare: i64,
    /// Connections refused because the queue could not take their floor.
    pub refused: u64,
    /// Times the device reported the queue below its low watermark.
    pub limit_events: u64,
    /// Receive completions whose connection was gone (their buffers went back).
    pub orphans: u64,
    /// The buffers' pool: registered bytes are the endpoint's whole receive memory.
    pub pool: PoolMetrics,
}

/// A connection short of receives on the queue, told when buffers were posted again (the
/// connection's I/O implements it: the queue does not know the connection above it).
pub(crate) trait Waiter: Send + Sync {
    /// Buffers were posted on the queue again: look whether the claim can grant receives now.
    fn buffers_back(&self);
}

/// The endpoint's shared receive queue (see the module docs).
#[derive(Debug)]
pub(crate) struct SharedRecv {
    pd: ProtectionDomain,
    srq: SharedReceiveQueue,
    pool: Pool,
    opts: SrqOptions,
    /// Buffers on the queue, by pool slot.
    posted: Mutex<Vec<Option<PoolBuf>>>,
    n_posted: AtomicU64,
    budget: Budget,
    limit_events: AtomicU64,
    /// Connections waiting for a receive to come back to re-grant their floor.
    waiters: Mutex<Vec<Weak<dyn Waiter>>>,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl SharedRecv {
    /// Creates the queue on `driver`'s device, in a protection domain of its own shared by
    /// every connection on it, registers and posts its buffers, and starts its refill task.
    pub(crate) fn new(driver: &Driver, opts: SrqOptions) -> Result<Arc<SharedRecv>> {
        let ctx = driver.context();
        let dev = ctx.device_attr();
        if opts.buffers == 0 || opts.buffers >= SRQ_BIT {
            return Err(Error::InvalidArgument(
                InvalidArgument::SrqBuffersOutOfRange {
                    buffers: opts.buffers,
                    limit: SRQ_BIT,
                },
            ));
        }
        if !(crate::conn::handshake::MIN_RECV_BUF_SIZE..=crate::conn::handshake::MAX_RECV_BUF_SIZE)
            .contains(&opts.buffer_size)
        {
            return Err(Error::InvalidArgument(
                InvalidArgument::SrqBufferSizeOutOfRange {
                    buffer_size: opts.buffer_size,
                },
            ));
        }
        if let Some(low_watermark) = opts.low_watermark.filter(|&w| w >= opts.buffers) {
            return Err(Error::InvalidArgument(InvalidArgument::SrqLowWatermark {
                low_watermark,
                buffers: opts.buffers,
            }));
        }
        if dev.max_srq == 0 {
            return Err(Error::Unsupported(Unsupported::NoSrq {
                device: ctx.name().to_string(),
            }));
        }
        let pd = ProtectionDomain::new(ctx)?;
        let srq = SharedReceiveQueue::new(&pd, opts.buffers, 1)?;
        let pool = Pool::with_pd(
            &pd,
            PoolConfig::default()
                .classes([SizeClass::new(
                    opts.buffer_size as usize,
                    opts.buffers as usize,
                )])
                // Local access only: nothing in the shared domain is ever opened to a peer.
                .memory_windows(false),
        )?;
        // Every receive on the queue may complete on the endpoint's completion queue.
        driver.reserve_cq(u64::from(opts.buffers))?;
        let shared = Arc::new(SharedRecv {
            pd,
            srq,
            pool,
            opts,
            posted: Mutex::new((0..opts.buffers).map(|_| None).collect()),
            n_posted: AtomicU64::new(0),
            budget: Budget::new(opts.buffers),
            limit_events: AtomicU64::new(0),
            waiters: Mutex::new(Vec::new()),
            task: Mutex::new(None),
        });
        let limit = driver.set_srq_sink(shared.clone());
        shared.refill();
        shared.arm();
        let weak = Arc::downgrade(&shared);
        let pool = shared.pool.clone();
        let size = opts.buffer_size as usize;
        let task = tokio::spawn(async move {
            loop {
                tokio::select! {
                    buf = pool.acquire(size) => {
                        let Some(me) = weak.upgrade() else { return };
                        me.refill_from(buf.ok());
                    }
                    () = limit.notified() => {
                        let Some(me) = weak.upgrade() else { return };
                        me.limit_events.fetch_add(1, Ordering::Relaxed);
                        me.refill();
                        me.arm();
                    }
                }
            }
        });
        *shared.task.lock().unwrap_or_else(|e| e.into_inner()) = Some(task);
        debug!(
            buffers = opts.buffers,
            buffer_size = opts.buffer_size,
            "shared receive queue ready"
        );
        Ok(shared)
    }

    fn arm(&self) {
        let limit = self.opts.low_watermark.unwrap_or(self.opts.buffers / 8);
        if limit == 0 {
            return;
        }
        if let Err(e) = self.srq.arm_limit(limit) {
            debug!(error = %e, "arming the shared receive queue's limit");
        }
    }

    /// The protection domain every connection on the queue shares.
    pub(crate) fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }

    pub(crate) fn srq(&self) -> &SharedReceiveQueue {
        &self.srq
    }

    pub(crate) fn pool(&self) -> &Pool {
        &self.pool
    }

    pub(crate) fn buffer_size(&self) -> u32 {
        self.opts.buffer_size
    }

    /// Posts every free buffer of the pool on the queue; wakes connections waiting for one.
    pub(crate) fn refill(&self) {
        self.refill_from(None);
    }

    /// [`refill`](Self::refill), starting with `first`.
    fn refill_from(&self, mut first: Option<PoolBuf>) {
        let mut n = 0i64;
        let size = self.opts.buffer_size as usize;
        while let Some(buf) = first
            .take()
            .or_else(|| self.pool.try_acquire(size).ok().flatten())
        {
            let slot = buf.slot();
            let sge = [buf.sge(0..buf.capacity())];
            let wr = RecvWr::new(srq_wr_id(SRQ_BIT | slot), &sge);
            let mut posted = self.posted.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: the buffer is registered in the queue's protection domain and is kept
            // in `posted` (untouched) until the completion of this receive takes it out.
            match unsafe { self.srq.post_recv(&[wr]) } {
                Ok(()) => {
                    posted[slot as usize] = Some(buf);
                    n += 1;
                }
                Err(e) => {
                    warn!(error = %e, "posting on the shared receive queue failed");
                    break;
                }
            }
        }
        if n == 0 {
            return;
        }
        self.n_posted.fetch_add(n as u64, Ordering::Relaxed);
        self.budget.posted(n as u32);
        let waiters = std::mem::take(&mut *self.waiters.lock().unwrap_or_else(|e| e.into_inner()));
        for w in waiters {
            if let Some(w) = w.upgrade() {
                w.buffers_back();
            }
        }
    }

    /// The buffer of the receive in `slot`, taken off the queue by its completion.
    pub(crate) fn take(&self, local: u32) -> Option<PoolBuf> {
        let slot = (local & !SRQ_BIT) as usize;
        let buf = self
            .posted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(slot)
            .and_then(Option::take);
        if buf.is_some() {
            self.n_posted.fetch_sub(1, Ordering::Relaxed);
        }
        buf
    }

    /// A receive was consumed by no admitted connection.
    pub(crate) fn consumed_unclaimed(&self) {
        self.budget.consumed_unclaimed();
    }

    /// Admits a connection with a floor of `floor` receives, or refuses it.
    pub(crate) fn admit(self: &Arc<Self>, floor: u32) -> Result<SrqShare> {
        match self.budget.admit(floor) {
            Ok(claim) => Ok(SrqShare {
                shared: self.clone(),
                claim,
            }),
            Err(r) => Err(Error::ReceiveBudgetExhausted {
                buffers: self.opts.buffers,
                connections: r.connections,
                spare: r.spare,
                floor,
            }),
        }
    }

    /// Asks `w` to be told when a buffer is posted again.
    pub(crate) fn wait(&self, w: Weak<dyn Waiter>) {
        self.waiters
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(w);
    }

    pub(crate) fn stats(&self) -> SrqStats {
        SrqStats {
            buffers: self.opts.buffers,
            posted: self.n_posted.load(Ordering::Relaxed),
            connections: self.budget.connections(),
            granted: self.budget.granted(),
            spare: self.budget.spare(),
            refused: self.budget.refused(),
            limit_events: self.limit_events.load(Ordering::Relaxed),
            orphans: self.budget.orphans(),
            pool: self.pool.metrics(),
        }
    }
}

impl Drop for SharedRecv {
    fn drop(&mut self) {
        if let Some(t) = self.task.lock().unwrap_or_else(|e| e.into_inner()).take() {
            t.abort();
        }
    }
}

/// Completions of receives whose queue pair is gone: the buffer goes back.
impl Sink for SharedRecv {
    fn on_completion(
        &self,
        local: u32,
        _cqe: &Cqe,
        _qp_failure: Option<&QpFailure>,
        _wake: &mut Deferred,
    ) -> Option<QpFailure> {
        if self.take(local).is_some() {
            self.consumed_unclaimed();
        }
        None
    }
}

/// One connection's claim on the shared receive queue (see the module docs). Dropping it
/// gives the claim back.
#[derive(Debug)]
pub(crate) struct SrqShare {
    shared: Arc<SharedRecv>,
    claim: Claim,
}

impl SrqShare {
    /// The data credits in the floor of a connection with `recv_credits`: its initial credits.
    pub(crate) fn floor_credits(recv_credits: u32) -> u32 {
        recv_credits.min(crate::conn::handshake::MIN_CREDITS)
    }

    /// The floor of a connection with `recv_credits` data credits: its initial credits and
    /// its control receives.
    pub(crate) fn floor_for(recv_credits: u32) -> u32 {
        Self::floor_credits(recv_credits) + CONTROL_RECVS
    }

    pub(crate) fn shared(&self) -> &Arc<SharedRecv> {
        &self.shared
    }

    /// Receives to report posted for `want` asked by the state machine ([`Claim::post`]).
    pub(crate) fn post(&mut self, want: u32) -> u32 {
        self.claim.post(&self.shared.budget, want)
    }

    /// The connection is established: claim more as the state machine asks.
    pub(crate) fn open(&mut self) {
        self.claim.open();
    }

    pub(crate) fn is_open(&self) -> bool {
        self.claim.is_open()
    }

    pub(crate) fn below_floor(&self) -> bool {
        self.claim.below_floor()
    }

    /// The application now holds `held` of this connection's buffers.
    pub(crate) fn set_held(&mut self, held: u32) {
        self.claim.set_held(&self.shared.budget, held);
    }

    /// One of this connection's receives completed.
    pub(crate) fn consumed(&mut self) {
        self.claim.consumed(&self.shared.budget);
    }
}

impl Drop for SrqShare {
    fn drop(&mut self) {
        self.claim.release(&self.shared.budget);
    }
}
