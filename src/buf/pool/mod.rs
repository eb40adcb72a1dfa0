//! The registered-buffer pool: a few large registrations carved into size classes, handing out
//! [`PoolBuf`]s that carry their lkey and return to the pool when dropped.
//!
//! * **Memory**: one anonymous mapping per size class, on 2 MiB huge pages when the system has
//!   them ([`HugePages::Auto`]), else 4 KiB pages; each mapping is one registration
//!   (`LOCAL_WRITE`, plus `MW_BIND` where the device has type-2 memory windows so that
//!   [grants](crate::buf::Grant) can bind windows to it; `MW_BIND` gives peers nothing).
//! * **Size classes**: a request takes a slot of the smallest class that fits; it never spills
//!   into a larger class, so each class's capacity is exactly what was configured.
//! * **Free lists**: per class, several lock-free stacks (shards); a thread uses its home shard
//!   and steals from the others, so many tasks on a multi-thread runtime do not serialize.
//! * **Backpressure**: [`Pool::acquire`] waits while its class is exhausted. Releases hand
//!   slots directly to the oldest waiter (FIFO per class). Dropping a waiting acquire is safe
//!   at any point: a slot already handed to it goes to the next waiter.
//!
//! # Examples
//!
//! ```no_run
//! use tokio_rdma::buf::{Pool, PoolConfig};
//! use tokio_rdma::verbs::{Context, ProtectionDomain};
//! # async fn demo() -> tokio_rdma::Result<()> {
//! let pd = ProtectionDomain::new(&Context::open("rxe0")?)?;
//! let pool = Pool::with_pd(&pd, PoolConfig::default())?;
//! let mut buf = pool.acquire(1000).await?; // a 4 KiB-class slot, len 1000
//! buf[..5].copy_from_slice(b"hello");
//! let msg = buf.freeze(); // bytes::Bytes; the slot returns when the last clone drops
//! assert_eq!(&msg[..5], b"hello");
//! # Ok(()) }
//! ```

mod buf;
mod freelist;
mod inner;
mod waiters;

#[cfg(all(test, tokio_rdma_loom))]
mod loom_models;
#[cfg(test)]
mod tests;

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::task::{Context, Poll};

pub use buf::PoolBuf;

use self::inner::{Class, PoolInner};

use self::freelist::{FreeList, home_hint};
use self::waiters::{Registered, WaitQueue};
use super::registrar::{MrRegistrar, Registrar};
use crate::error::{Error, InvalidArgument, Result};
use crate::verbs::{AccessFlags, HugePages, OdpOps, PageMapping, ProtectionDomain};

/// Slot sizes are rounded up to this, so every buffer is cache-line (and 8-byte) aligned.
const SLOT_ALIGN: usize = 64;

/// One size class: `count` buffers of `size` bytes.
///
/// # Examples
///
/// ```
/// use tokio_rdma::buf::SizeClass;
/// let c = SizeClass::new(64 << 10, 32);
/// assert_eq!((c.size, c.count), (65536, 32));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SizeClass {
    /// Bytes per buffer (rounded up to a multiple of 64).
    pub size: usize,
    /// Number of buffers.
    pub count: usize,
}

impl SizeClass {
    /// A class of `count` buffers of `size` bytes.
    pub fn new(size: usize, count: usize) -> SizeClass {
        SizeClass { size, count }
    }
}

/// Pool configuration.
///
/// The default is 512 x 4 KiB, 32 x 64 KiB and 4 x 1 MiB (8 MiB registered, 10 MiB with huge
/// pages because each class is rounded up to whole 2 MiB pages), huge pages when available,
/// and one free-list shard per CPU (at most 16).
///
/// # Examples
///
/// ```
/// use tokio_rdma::buf::{PoolConfig, SizeClass};
/// use tokio_rdma::verbs::HugePages;
/// let cfg = PoolConfig::default()
///     .classes([SizeClass::new(4096, 1024), SizeClass::new(1 << 20, 8)])
///     .huge_pages(HugePages::Never)
///     .shards(4);
/// assert_eq!(cfg.size_classes().len(), 2);
/// ```
#[derive(Debug, Clone)]
pub struct PoolConfig {
    classes: Vec<SizeClass>,
    huge_pages: HugePages,
    shards: usize,
    windows: Option<bool>,
    on_demand: bool,
}

impl Default for PoolConfig {
    fn default() -> PoolConfig {
        PoolConfig {
            classes: vec![
                SizeClass::new(4 << 10, 512),
                SizeClass::new(64 << 10, 32),
                SizeClass::new(1 << 20, 4),
            ],
            huge_pages: HugePages::Auto,
            shards: 0,
            windows: None,
            on_demand: false,
        }
    }
}

impl PoolConfig {
    /// Replaces the size classes.
    pub fn classes(mut self, classes: impl IntoIterator<Item = SizeClass>) -> PoolConfig {
        self.classes = classes.into_iter().collect();
        self
    }

    /// The configured size classes.
    pub fn size_classes(&self) -> &[SizeClass] {
        &self.classes
    }

    /// Huge-page policy (default [`HugePages::Auto`]).
    pub fn huge_pages(mut self, huge: HugePages) -> PoolConfig {
        self.huge_pages = huge;
        self
    }

    /// Free-list shards per class (0, the default: one per CPU, at most 16). Any value is
    /// capped at each class's buffer count.
    pub fn shards(mut self, shards: usize) -> PoolConfig {
        self.shards = shards;
        self
    }

    /// Whether to register with `MW_BIND` so grants can bind memory windows to pool buffers
    /// (default: when the registrar's device supports type-2 windows).
    pub fn memory_windows(mut self, yes: bool) -> PoolConfig {
        self.windows = Some(yes);
        self
    }

    /// Register the classes on demand ([`AccessFlags::ON_DEMAND`], default `false`): nothing
    /// is pinned and pages are faulted in as buffers are first used, so a large pool costs no
    /// locked memory and registers in constant time; the first use of each page pays a
    /// fault (docs/benchmarks-odp.md). The device must offer ODP for RC send and receive
    /// ([`Endpoint::odp_caps`](crate::Endpoint::odp_caps)), else creating the pool fails with
    /// [`Error::OdpUnsupported`](crate::Error::OdpUnsupported).
    ///
    /// # Examples
    ///
    /// ```
    /// use tokio_rdma::buf::{PoolConfig, SizeClass};
    /// let big = PoolConfig::default().classes([SizeClass::new(1 << 20, 1024)]).on_demand(true);
    /// assert!(big.is_on_demand());
    /// ```
    pub fn on_demand(mut self, yes: bool) -> PoolConfig {
        self.on_demand = yes;
        self
    }

    /// Whether the pool registers on demand.
    pub fn is_on_demand(&self) -> bool {
        self.on_demand
    }
}

/// A snapshot of a pool's counters.
///
/// # Examples
///
/// ```no_run
/// # fn f(pool: &tokio_rdma::buf::Pool) {
/// let m = pool.metrics();
/// println!("{} of {} bytes in use", m.bytes_in_use, m.bytes_registered);
/// # }
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolMetrics {
    /// Bytes registered with the device (whole mappings, including rounding).
    pub bytes_registered: u64,
    /// Bytes of the buffers handed out (slot sizes).
    pub bytes_in_use: u64,
    /// Bytes of free slots.
    pub bytes_free: u64,
    /// Number of registrations (one per size class).
    pub registrations: u64,
    /// Buffers handed out.
    pub buffers_in_use: u64,
    /// Tasks waiting in `acquire` right now.
    pub waiters: u64,
    /// Acquires that had to wait, since the pool was created.
    pub waits: u64,
    /// Whether the pool's memory is on huge pages.
    pub huge_pages: bool,
}

/// A pool of registered buffers. Cheap to clone; the memory is deregistered and unmapped when
/// the last clone and the last [`PoolBuf`] are gone.
///
/// Design (size classes, huge pages, sharded lock-free free lists, FIFO hand-off to waiters):
/// `docs/memory.md`.
///
/// # Examples
///
/// ```no_run
/// use tokio_rdma::buf::{Pool, PoolConfig};
/// # fn f(pd: &tokio_rdma::verbs::ProtectionDomain) -> tokio_rdma::Result<()> {
/// let pool = Pool::with_pd(pd, PoolConfig::default())?;
/// if let Some(buf) = pool.try_acquire(4096)? {
///     assert_eq!(buf.len(), 4096);
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Pool {
    inner: Arc<PoolInner>,
}

impl Pool {
    /// A pool whose memory is registered in `pd` (`ibv_reg_mr`).
    ///
    /// # Errors
    ///
    /// As [`Pool::new`].
    pub fn with_pd(pd: &ProtectionDomain, config: PoolConfig) -> Result<Pool> {
        Pool::new(&MrRegistrar::new(pd), config)
    }

    /// A pool whose memory is registered through `registrar`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an empty or invalid class list; [`Error::MapMemory`] if
    /// the memory cannot be mapped; the registrar's error (e.g. [`Error::MemlockExhausted`])
    /// if it cannot be registered.
    pub fn new(registrar: &dyn Registrar, config: PoolConfig) -> Result<Pool> {
        let classes = normalize(&config.classes)?;
        let shards = match config.shards {
            0 => std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .min(16),
            n => n,
        };
        let windows = config
            .windows
            .unwrap_or_else(|| registrar.supports_windows());
        let mut access = AccessFlags::LOCAL_WRITE;
        if windows {
            access |= AccessFlags::MW_BIND;
        }
        if config.on_demand {
            access |= AccessFlags::ON_DEMAND;
            registrar.require(access, OdpOps::SEND | OdpOps::RECV)?;
        }
        let mut built = Vec::with_capacity(classes.len());
        let mut huge = true;
        for c in classes {
            let len = c.size * c.count;
            let mem = PageMapping::new(len, config.huge_pages)?;
            huge &= mem.is_huge();
            // SAFETY: the mapping lives in the same `Class` and is dropped after `reg`.
            let reg = unsafe { registrar.register(mem.as_ptr(), mem.len(), access)? };
            built.push(Class {
                size: c.size,
                count: c.count as u32,
                reg,
                mem,
                // More shards than buffers could never all hold one.
                free: FreeList::new_full(c.count as u32, shards.min(c.count)),
                waiters: WaitQueue::default(),
            });
        }
        tracing::debug!(classes = built.len(), huge, ?access, "created buffer pool");
        Ok(Pool {
            inner: Arc::new(PoolInner {
                classes: built.into_boxed_slice(),
                waits: AtomicU64::new(0),
                huge,
            }),
        })
    }

    /// The size classes after normalisation (sorted, sizes rounded up to 64 bytes).
    pub fn size_classes(&self) -> Vec<SizeClass> {
        self.inner
            .classes
            .iter()
            .map(|c| SizeClass::new(c.size, c.count as usize))
            .collect()
    }

    /// A buffer of `len` bytes if its size class has one free now, else `None`.
    ///
    /// The buffer's `len()` is `len`, its capacity the class size. Its contents are whatever
    /// the previous user left (zero at first): overwrite what you send.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] if `len` exceeds the largest class.
    pub fn try_acquire(&self, len: usize) -> Result<Option<PoolBuf>> {
        let class = self.inner.class_for(len)?;
        Ok(self.inner.classes[class]
            .free
            .pop(home_hint())
            .map(|slot| self.make(class, slot, len)))
    }

    /// A buffer of `len` bytes, waiting while its size class is exhausted (backpressure, not
    /// an error). Waiters of a class are served in FIFO order as buffers are dropped.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] if `len` exceeds the largest class (the future resolves
    /// immediately).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future before it resolves loses nothing; if a buffer was
    /// already handed to it, the buffer goes to the next waiter (or back to the pool).
    pub fn acquire(&self, len: usize) -> Acquire {
        Acquire {
            pool: self.clone(),
            len,
            state: match self.inner.class_for(len) {
                Ok(class) => State::Start(class),
                Err(e) => State::Failed(Some(e)),
            },
        }
    }

    /// The lkey covering `len` bytes at `addr`, if they lie in this pool's memory.
    pub(crate) fn lkey_of(&self, addr: usize, len: usize) -> Option<u32> {
        self.inner.lkey_of(addr, len)
    }

    /// A snapshot of the pool's counters.
    pub fn metrics(&self) -> PoolMetrics {
        let mut m = PoolMetrics {
            waits: self.inner.waits.load(Relaxed),
            huge_pages: self.inner.huge,
            ..PoolMetrics::default()
        };
        for c in self.inner.classes.iter() {
            let free = (c.free.len() as u64).min(u64::from(c.count));
            let used = u64::from(c.count) - free;
            m.bytes_registered += c.mem.len() as u64;
            m.bytes_free += free * c.size as u64;
            m.bytes_in_use += used * c.size as u64;
            m.buffers_in_use += used;
            m.registrations += 1;
            m.waiters += c.waiters.len() as u64;
        }
        m
    }

    /// Whether the scatter/gather entry `sge` lies in this pool's memory under the lkey of
    /// its registration there: an entry made from one of this pool's buffers (or a slice of
    /// one). Used to refuse memory registered in another protection domain before posting.
    pub(crate) fn covers(&self, sge: &crate::verbs::Sge) -> bool {
        usize::try_from(sge.addr())
            .is_ok_and(|addr| self.lkey_of(addr, sge.length() as usize) == Some(sge.lkey()))
    }

    fn make(&self, class: usize, slot: u32, len: usize) -> PoolBuf {
        let c = &self.inner.classes[class];
        // SAFETY: `slot < count`, so the offset lies inside the class's mapping.
        let ptr = unsafe { c.mem.as_ptr().add(slot as usize * c.size) };
        let ptr = NonNull::new(ptr).expect("mapping is non-null");
        PoolBuf::new(self.inner.clone(), class as u16, slot, ptr, len)
    }
}

fn normalize(classes: &[SizeClass]) -> Result<Vec<SizeClass>> {
    if classes.is_empty() {
        return Err(Error::InvalidArgument(InvalidArgument::NoSizeClass));
    }
    let mut out: Vec<SizeClass> = Vec::with_capacity(classes.len());
    for c in classes {
        let size = c
            .size
            .checked_next_multiple_of(SLOT_ALIGN)
            .filter(|&s| s > 0);
        let ok = size.zip(Some(c.count)).filter(|&(s, n)| {
            n > 0 && u32::try_from(n).is_ok_and(|n| n < u32::MAX) && s.checked_mul(n).is_some()
        });
        let Some((size, count)) = ok else {
            return Err(Error::InvalidArgument(InvalidArgument::InvalidSizeClass {
                size: c.size,
                count: c.count,
            }));
        };
        out.push(SizeClass { size, count });
    }
    out.sort_by_key(|c| c.size);
    if out.windows(2).any(|w| w[0].size == w[1].size) {
        return Err(Error::InvalidArgument(
            InvalidArgument::DuplicateSizeClasses {
                classes: classes.iter().map(|c| (c.size, c.count)).collect(),
            },
        ));
    }
    if out.len() > usize::from(u16::MAX) {
        return Err(Error::InvalidArgument(InvalidArgument::TooManySizeClasses));
    }
    Ok(out)
}

/// The future of [`Pool::acquire`].
///
/// # Examples
///
/// ```no_run
/// # async fn f(pool: tokio_rdma::buf::Pool) -> tokio_rdma::Result<()> {
/// use std::time::Duration;
/// // Give up after a second; dropping the future on timeout loses nothing.
/// match tokio::time::timeout(Duration::from_secs(1), pool.acquire(4096)).await {
///     Ok(buf) => println!("got {:?}", buf?),
///     Err(_) => println!("pool still exhausted"),
/// }
/// # Ok(()) }
/// ```
///
/// # Cancel safety
///
/// Dropping it before completion loses no buffer and no wakeup.
#[must_use = "futures do nothing unless polled"]
pub struct Acquire {
    pool: Pool,
    len: usize,
    state: State,
}

enum State {
    Start(usize),
    Waiting { class: usize, id: u64 },
    Failed(Option<Error>),
    Done,
}

impl Future for Acquire {
    type Output = Result<PoolBuf>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<PoolBuf>> {
        let this = self.get_mut();
        match this.state {
            State::Start(class) => {
                let c = &this.pool.inner.classes[class];
                let home = home_hint();
                match c.waiters.acquire(&c.free, home, cx.waker()) {
                    Registered::Slot(slot) => {
                        this.state = State::Done;
                        Poll::Ready(Ok(this.pool.make(class, slot, this.len)))
                    }
                    Registered::Queued(id) => {
                        this.pool.inner.waits.fetch_add(1, Relaxed);
                        this.state = State::Waiting { class, id };
                        Poll::Pending
                    }
                }
            }
            State::Waiting { class, id } => {
                match this.pool.inner.classes[class].waiters.poll(id, cx.waker()) {
                    Some(slot) => {
                        this.state = State::Done;
                        Poll::Ready(Ok(this.pool.make(class, slot, this.len)))
                    }
                    None => Poll::Pending,
                }
            }
            State::Failed(ref mut e) => {
                let e = e.take().expect("polled after completion");
                this.state = State::Done;
                Poll::Ready(Err(e))
            }
            State::Done => panic!("`Acquire` polled after completion"),
        }
    }
}

impl Drop for Acquire {
    fn drop(&mut self) {
        if let State::Waiting { class, id } = self.state {
            if let Some(slot) = self.pool.inner.classes[class].waiters.cancel(id) {
                self.pool.inner.release(class as u16, slot);
            }
        }
    }
}

impl fmt::Debug for Acquire {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Acquire")
            .field("len", &self.len)
            .field("waiting", &matches!(self.state, State::Waiting { .. }))
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("classes", &self.size_classes())
            .field("huge_pages", &self.inner.huge)
            .finish_non_exhaustive()
    }
}
