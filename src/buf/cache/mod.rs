//! The registration cache: memory the user already has (`Vec<u8>`, `Bytes`, `BytesMut`, a
//! mapped file) registered on first use and reused by address range.
//!
//! * **Ranges**: registrations are page-aligned and never overlap in the cache. A lookup that
//!   falls inside a cached range is a hit. A miss registers the page-rounded range merged with
//!   every cached range it overlaps or touches (one registration replaces them), or, with
//!   [`CacheConfig::whole_mappings`], the whole mapping that holds it, so a large buffer used
//!   in small slices is registered once.
//! * **Leases**: a lookup returns an [`MrLease`], a reference-counted handle that keeps the
//!   registration alive. Eviction and invalidation only drop the cache's reference: a
//!   registration in use by an operation in flight is deregistered when its last lease goes.
//! * **Budget**: when cached bytes exceed [`CacheConfig::max_bytes`], least recently used
//!   ranges are evicted (never the one just registered).
//! * **Access**: memory in writable mappings is registered `LOCAL_WRITE`; read-only memory
//!   (a `Bytes` from a `static`, a read-only file mapping) with local read access only.
//! * **Errors**: `RLIMIT_MEMLOCK` exhaustion is reported as
//!   [`Error::MemlockExhausted`](crate::Error::MemlockExhausted), naming the limit.
//!
//! Lookups take a lock; a miss registers while holding it (registrations serialize).

mod index;
mod vma;

#[cfg(test)]
mod tests;

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};

use self::index::RangeIndex;
use super::registrar::{MrRegistrar, Registrar, Registration};
use crate::error::{Error, InvalidArgument, Result};
use crate::verbs::{AccessFlags, BASE_PAGE_SIZE, ProtectionDomain};

/// Cache configuration.
///
/// # Examples
///
/// ```
/// use tokio_rdma::buf::CacheConfig;
/// let cfg = CacheConfig::default()
///     .max_bytes(2 << 30)
///     .whole_mappings(Some(2 << 30));
/// ```
#[derive(Debug, Clone)]
pub struct CacheConfig {
    max_bytes: u64,
    whole_mappings: Option<u64>,
    on_demand: bool,
}

impl Default for CacheConfig {
    fn default() -> CacheConfig {
        CacheConfig {
            max_bytes: 1 << 30,
            whole_mappings: None,
            on_demand: false,
        }
    }
}

impl CacheConfig {
    /// Budget of cached (registered, pinned) bytes; least recently used ranges are evicted
    /// beyond it (default 1 GiB).
    pub fn max_bytes(mut self, bytes: u64) -> CacheConfig {
        self.max_bytes = bytes;
        self
    }

    /// On a miss, register the whole mapping (a run of contiguous mappings with the same
    /// access, not the heap or stack) that holds the range, if it is at most `max` bytes
    /// (default `None`: only the page-rounded range). This covers memory next to the buffer
    /// that shares its mapping: the cache's safety contract then extends to it.
    pub fn whole_mappings(mut self, max: Option<u64>) -> CacheConfig {
        self.whole_mappings = max;
        self
    }

    /// Register on demand ([`AccessFlags::ON_DEMAND`], default `false`): nothing is pinned,
    /// and each registration follows the process's mappings, so memory freed and mapped again
    /// at a cached address is sent with its new bytes (the stale-pages hazard of
    /// [`RegCache::new`] does not arise; an access to a range unmapped meanwhile fails that
    /// operation instead of reaching other memory). Needs a device with ODP
    /// ([`Endpoint::odp_caps`](crate::Endpoint::odp_caps)); elsewhere the first miss fails with
    /// [`Error::OdpUnsupported`](crate::Error::OdpUnsupported).
    ///
    /// # Examples
    ///
    /// ```
    /// use tokio_rdma::buf::CacheConfig;
    /// let cfg = CacheConfig::default().on_demand(true).max_bytes(64 << 30);
    /// assert!(cfg.is_on_demand());
    /// ```
    pub fn on_demand(mut self, yes: bool) -> CacheConfig {
        self.on_demand = yes;
        self
    }

    /// Whether the cache registers on demand.
    pub fn is_on_demand(&self) -> bool {
        self.on_demand
    }
}

/// A snapshot of a cache's counters.
///
/// # Examples
///
/// ```no_run
/// # fn f(cache: &tokio_rdma::buf::RegCache) {
/// let m = cache.metrics();
/// println!("hit rate {:.2}", m.hits as f64 / (m.hits + m.misses).max(1) as f64);
/// # }
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CacheMetrics {
    /// Lookups served from the cache.
    pub hits: u64,
    /// Lookups that had to register.
    pub misses: u64,
    /// Successful registrations.
    pub registrations: u64,
    /// Failed registrations.
    pub registration_failures: u64,
    /// Ranges evicted to stay within the budget.
    pub evictions: u64,
    /// Ranges removed by [`RegCache::invalidate`] or [`RegCache::clear`].
    pub invalidations: u64,
    /// Ranges in the cache.
    pub entries: u64,
    /// Bytes registered by the cache and still alive (cached, or evicted but leased).
    pub bytes_registered: u64,
    /// Of those, bytes of registrations with outstanding leases.
    pub bytes_in_use: u64,
    /// Bytes cached without outstanding leases.
    pub bytes_free: u64,
}

#[derive(Debug, Default)]
struct Counters {
    pinned: AtomicU64,
}

/// One registration made by the cache.
#[derive(Debug)]
struct Cached {
    reg: Box<dyn Registration>,
    start: u64,
    len: u64,
    writable: bool,
    counters: Arc<Counters>,
}

impl Drop for Cached {
    fn drop(&mut self) {
        self.counters.pinned.fetch_sub(self.len, Relaxed);
        tracing::debug!(len = self.len, "deregistering cached range");
    }
}

/// A handle that keeps a cached registration alive: pass its [`lkey`](Self::lkey) in the
/// scatter/gather entries of an operation and hold the lease until the operation completes.
///
/// # Examples
///
/// ```no_run
/// # fn f(cache: &tokio_rdma::buf::RegCache, data: &[u8]) -> tokio_rdma::Result<()> {
/// let lease = cache.lookup_or_register(data.as_ptr(), data.len())?;
/// let sge = tokio_rdma::verbs::Sge::new(data.as_ptr() as u64, data.len() as u32, lease.lkey());
/// # let _ = sge; Ok(()) }
/// ```
#[derive(Clone)]
pub struct MrLease {
    reg: Arc<Cached>,
}

impl MrLease {
    /// The local key covering the looked-up range.
    pub fn lkey(&self) -> u32 {
        self.reg.reg.lkey()
    }

    /// Start of the whole registration (page aligned; it may extend beyond the lookup).
    pub fn addr(&self) -> u64 {
        self.reg.start
    }

    /// Length of the whole registration.
    pub fn len(&self) -> u64 {
        self.reg.len
    }

    /// Always false: empty ranges are never registered.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Whether the registration allows local writes (receives, RDMA READ targets). Memory in
    /// read-only mappings is registered for local reads (sends, RDMA WRITE sources) only.
    pub fn is_writable(&self) -> bool {
        self.reg.writable
    }

    /// Whether `len` bytes at `ptr` lie inside the registration.
    pub fn covers(&self, ptr: *const u8, len: usize) -> bool {
        let start = ptr as u64;
        start >= self.reg.start
            && start
                .checked_add(len as u64)
                .is_some_and(|end| end <= self.reg.start + self.reg.len)
    }
}

impl fmt::Debug for MrLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MrLease")
            .field("addr", &format_args!("{:#x}", self.reg.start))
            .field("len", &self.reg.len)
            .field("writable", &self.reg.writable)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Default)]
struct State {
    index: RangeIndex<Arc<Cached>>,
    hits: u64,
    misses: u64,
    registrations: u64,
    failures: u64,
    evictions: u64,
    invalidations: u64,
    /// Bumped by every invalidation: a miss registering meanwhile does not cache its range.
    epoch: u64,
}

/// A registration cache for user memory. Cheap to clone (shared state). See the
/// design notes in `docs/memory.md`.
///
/// # Examples
///
/// ```no_run
/// use tokio_rdma::buf::{CacheConfig, RegCache};
/// # fn f(pd: &tokio_rdma::verbs::ProtectionDomain) -> tokio_rdma::Result<()> {
/// // SAFETY: memory given to this cache is not unmapped or remapped while cached (we call
/// // `invalidate` first).
/// let cache = unsafe { RegCache::with_pd(pd, CacheConfig::default()) };
/// let data = vec![7u8; 1 << 20];
/// let a = cache.lookup_or_register(data.as_ptr(), data.len())?; // registers
/// let b = cache.lookup_or_register(data[4096..].as_ptr(), 4096)?; // hit
/// assert_eq!(a.lkey(), b.lkey());
/// assert_eq!(cache.metrics().registrations, 1);
/// cache.invalidate(data.as_ptr(), data.len());
/// drop(data);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RegCache {
    inner: Arc<CacheInner>,
}

struct CacheInner {
    registrar: Box<dyn Registrar>,
    config: CacheConfig,
    counters: Arc<Counters>,
    state: Mutex<State>,
}

impl RegCache {
    /// A cache registering in `pd` (`ibv_reg_mr`).
    ///
    /// # Safety
    ///
    /// As for [`RegCache::new`].
    pub unsafe fn with_pd(pd: &ProtectionDomain, config: CacheConfig) -> RegCache {
        // SAFETY: forwarded contract.
        unsafe { RegCache::new(MrRegistrar::new(pd), config) }
    }

    /// A cache registering through `registrar`.
    ///
    /// # Safety
    ///
    /// A cached registration pins the pages that were mapped at its addresses when it was
    /// made, and later lookups trust that those addresses still map the same pages. So memory
    /// passed to this cache (and, with [`CacheConfig::whole_mappings`], the rest of the mapping
    /// that holds it) must not be unmapped or remapped (`munmap`, `mremap`, e.g. by `realloc`
    /// of a large buffer, `madvise(MADV_DONTNEED)`, a file mapping truncated or replaced)
    /// while it is cached: call [`invalidate`](Self::invalidate) first. Otherwise the device
    /// could access pages that now belong to other memory. With [`CacheConfig::on_demand`]
    /// the registrations follow the mappings instead, and this hazard does not arise: the
    /// contract is then only that memory mapped at a cached address later may be reached
    /// through the cache's keys (by this process's own operations; the cache grants no
    /// remote access).
    pub unsafe fn new(registrar: impl Registrar, config: CacheConfig) -> RegCache {
        RegCache {
            inner: Arc::new(CacheInner {
                registrar: Box::new(registrar),
                config,
                counters: Arc::default(),
                state: Mutex::default(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every mutation keeps the index consistent between statements that can panic.
        self.inner.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A lease on a registration covering `len` bytes at `ptr`: from the cache, or registered
    /// now.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an empty range or one that wraps the address space
    /// (rounded up to whole pages); the registration error if
    /// a miss cannot be registered ([`Error::MemlockExhausted`] names `RLIMIT_MEMLOCK`; an
    /// unmapped range gives [`Error::RegMr`] with `EFAULT`).
    pub fn lookup_or_register(&self, ptr: *const u8, len: usize) -> Result<MrLease> {
        let start = ptr as u64;
        let page = BASE_PAGE_SIZE as u64;
        // The range and its page-rounded end must fit the address space.
        let ends = start
            .checked_add(len as u64)
            .filter(|_| len > 0)
            .and_then(|end| Some((end, end.div_ceil(page).checked_mul(page)?)));
        let Some((end, page_end)) = ends else {
            return Err(Error::InvalidArgument(InvalidArgument::CacheRange {
                len,
                addr: ptr as usize,
            }));
        };
        if let Some(lease) = self.hit(start, end) {
            return Ok(lease);
        }
        // A miss reads `/proc/self/maps` and registers (pinning every page) WITHOUT the
        // cache's lock: lookups of other threads (hits above all) go on meanwhile.
        let pg = (start & !(page - 1), page_end);
        let mapping = vma::find(pg.0, pg.1);
        let writable = mapping.as_ref().is_none_or(|m| m.writable);
        let mut want = pg;
        if let (Some(max), Some(m)) = (self.inner.config.whole_mappings, &mapping) {
            if !m.special && m.range.end - m.range.start <= max {
                want = (m.range.start, m.range.end);
            }
        }
        let (candidates, epoch) = {
            let mut st = self.lock();
            // Re-checked: another thread may have registered the range meanwhile.
            if let Some(reg) = st.index.covering(start, end) {
                let reg = reg.clone();
                st.hits += 1;
                return Ok(MrLease { reg });
            }
            st.misses += 1;
            // Merge with the cached ranges it overlaps or touches, if they have the same access.
            let merge: Vec<u64> = st
                .index
                .touching(want.0, want.1, true)
                .into_iter()
                .filter(|s| st.index.get(*s).is_some_and(|c| c.writable == writable))
                .collect();
            let merged = st.index.span(want.0, want.1, &merge);
            let mut candidates = vec![merged];
            if merged != pg {
                candidates.push(pg);
            }
            (candidates, st.epoch)
        };
        let mut last_err = None;
        for (s, e) in candidates {
            match self.register(s, e, writable) {
                Ok(reg) => {
                    let mut dropped = Vec::new();
                    let mut st = self.lock();
                    st.registrations += 1;
                    if st.epoch != epoch {
                        // An invalidation ran while this registered: the range it removed
                        // may be in this one (and about to be unmapped). Leased, not cached.
                        return Ok(MrLease { reg });
                    }
                    // Drop what the new range replaces (leases keep those regions alive), after
                    // the lock: the last handle of a region deregisters it.
                    for k in st.index.touching(s, e, false) {
                        dropped.extend(st.index.remove(k));
                    }
                    st.index.insert(s, e, reg.clone());
                    while st.index.bytes() > self.inner.config.max_bytes {
                        match st.index.pop_lru_except(s) {
                            Some((_, _, r)) => dropped.push((0, r)),
                            None => break,
                        }
                        st.evictions += 1;
                    }
                    drop(st);
                    drop(dropped);
                    return Ok(MrLease { reg });
                }
                Err(err) => {
                    tracing::debug!(len = e - s, error = %err, "cache registration failed");
                    last_err = Some(err);
                }
            }
        }
        self.lock().failures += 1;
        Err(last_err.expect("at least one candidate"))
    }

    /// A lease on a cached registration covering `len` bytes at `ptr`, if there is one: the
    /// non-blocking half of [`lookup_or_register`](Self::lookup_or_register) (a miss is not
    /// counted; the caller goes on with `lookup_or_register`, off the runtime if it can).
    pub(crate) fn cached(&self, ptr: *const u8, len: usize) -> Option<MrLease> {
        let start = ptr as u64;
        let end = start.checked_add(len as u64).filter(|_| len > 0)?;
        self.hit(start, end)
    }

    /// A lease on a cached registration covering `start..end`, if there is one (a hit).
    fn hit(&self, start: u64, end: u64) -> Option<MrLease> {
        let mut st = self.lock();
        let reg = st.index.covering(start, end)?.clone();
        st.hits += 1;
        Some(MrLease { reg })
    }

    fn register(&self, start: u64, end: u64, writable: bool) -> Result<Arc<Cached>> {
        let len = (end - start) as usize;
        let mut access = if writable {
            AccessFlags::LOCAL_WRITE
        } else {
            AccessFlags::NONE
        };
        if self.inner.config.on_demand {
            access |= AccessFlags::ON_DEMAND;
        }
        // SAFETY: the range is page-rounded around memory the caller named (or a whole mapping
        // holding it); `RegCache::new`'s contract keeps it mapped while cached or leased.
        let reg = unsafe {
            self.inner
                .registrar
                .register(start as *mut u8, len, access)?
        };
        self.inner.counters.pinned.fetch_add(len as u64, Relaxed);
        Ok(Arc::new(Cached {
            reg,
            start,
            len: len as u64,
            writable,
            counters: self.inner.counters.clone(),
        }))
    }

    /// Removes every cached range overlapping `len` bytes at `ptr` (call before unmapping or
    /// remapping that memory). Registrations still leased stay alive until their leases drop.
    /// Returns the number of ranges removed.
    pub fn invalidate(&self, ptr: *const u8, len: usize) -> usize {
        let start = ptr as u64;
        let end = start.saturating_add(len as u64);
        let mut st = self.lock();
        let keys = st.index.touching(start, end, false);
        for k in &keys {
            st.index.remove(*k);
        }
        st.invalidations += keys.len() as u64;
        st.epoch += 1;
        keys.len()
    }

    /// Removes every cached range.
    pub fn clear(&self) {
        let mut st = self.lock();
        let keys: Vec<u64> = st.index.iter().map(|(s, _, _)| s).collect();
        for k in &keys {
            st.index.remove(*k);
        }
        st.invalidations += keys.len() as u64;
        st.epoch += 1;
    }

    /// A snapshot of the cache's counters.
    pub fn metrics(&self) -> CacheMetrics {
        let st = self.lock();
        let cached = st.index.bytes();
        let leased: u64 = st
            .index
            .iter()
            .filter(|(_, _, c)| Arc::strong_count(c) > 1)
            .map(|(s, e, _)| e - s)
            .sum();
        let pinned = self.inner.counters.pinned.load(Relaxed);
        CacheMetrics {
            hits: st.hits,
            misses: st.misses,
            registrations: st.registrations,
            registration_failures: st.failures,
            evictions: st.evictions,
            invalidations: st.invalidations,
            entries: st.index.len() as u64,
            bytes_registered: pinned,
            bytes_in_use: leased + pinned.saturating_sub(cached),
            bytes_free: cached - leased,
        }
    }
}

impl fmt::Debug for RegCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegCache")
            .field("config", &self.inner.config)
            .field("metrics", &self.metrics())
            .finish_non_exhaustive()
    }
}
