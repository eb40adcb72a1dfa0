//! Host unit tests of the cache logic with a fake registrar (real memory addresses, so the
//! mapping lookup in `/proc/self/maps` is exercised too).

use std::sync::atomic::Ordering::SeqCst;

use super::*;
use crate::buf::fake::{self, FakeRegistrar};
use crate::verbs::{HugePages, PageMapping};

const PAGE: usize = 4096;

fn cache(fake: FakeRegistrar, config: CacheConfig) -> RegCache {
    // SAFETY: the tests keep the memory they look up mapped for the cache's lifetime.
    unsafe { RegCache::new(fake, config) }
}

fn pages(n: usize) -> PageMapping {
    PageMapping::new(n * PAGE, HugePages::Never).unwrap()
}

#[test]
fn repeated_lookups_register_once() {
    let (f, _live, calls) = fake::shared();
    let c = cache(f, CacheConfig::default());
    let v = vec![1u8; 64 << 10];
    let a = c.lookup_or_register(v.as_ptr(), v.len()).unwrap();
    for off in [0, 100, 4096, 60_000] {
        let b = c.lookup_or_register(v[off..].as_ptr(), 1000).unwrap();
        assert_eq!(b.lkey(), a.lkey());
    }
    let m = c.metrics();
    assert_eq!((m.misses, m.hits, m.registrations), (1, 4, 1));
    let (addr, len, access) = calls.lock().unwrap()[0];
    assert_eq!(addr % PAGE as u64, 0, "page aligned");
    assert!(a.covers(v.as_ptr(), v.len()));
    assert_eq!(len as u64, a.len());
    assert_eq!(access, AccessFlags::LOCAL_WRITE);
    assert!(c.lookup_or_register(v.as_ptr(), 0).is_err(), "empty");
    assert!(
        c.lookup_or_register(usize::MAX as *const u8, 2).is_err(),
        "wraps"
    );
}

#[test]
fn adjacent_and_overlapping_ranges_merge() {
    let (f, _live, calls) = fake::shared();
    let c = cache(f, CacheConfig::default());
    let m = pages(16);
    let p = |i: usize| m.as_ptr().wrapping_add(i * PAGE).cast_const();
    c.lookup_or_register(p(0), PAGE).unwrap();
    c.lookup_or_register(p(1), PAGE).unwrap(); // adjacent: one range of 2 pages
    assert_eq!(c.metrics().entries, 1);
    assert_eq!(
        calls.lock().unwrap()[1],
        (p(0) as u64, 2 * PAGE, AccessFlags::LOCAL_WRITE)
    );
    c.lookup_or_register(p(3), PAGE).unwrap(); // a gap: separate
    assert_eq!(c.metrics().entries, 2);
    c.lookup_or_register(p(2).wrapping_add(10), 100).unwrap(); // fills the gap: all merge
    assert_eq!(c.metrics().entries, 1);
    assert_eq!(
        calls.lock().unwrap()[3],
        (p(0) as u64, 4 * PAGE, AccessFlags::LOCAL_WRITE)
    );
    // Overlapping: a range straddling the end merges too.
    let l = c
        .lookup_or_register(p(3).wrapping_add(100), 2 * PAGE)
        .unwrap();
    assert_eq!((l.addr(), l.len()), (p(0) as u64, 6 * PAGE as u64));
    let hit = c.lookup_or_register(p(5), 10).unwrap();
    assert_eq!(hit.lkey(), l.lkey());
    assert_eq!(c.metrics().registrations, 5);
}

#[test]
fn lru_eviction_keeps_leased_regions_alive() {
    let (f, live, _calls) = fake::shared();
    let c = cache(f, CacheConfig::default().max_bytes(3 * PAGE as u64));
    let m = pages(8);
    let p = |i: usize| m.as_ptr().wrapping_add(i * PAGE).cast_const();
    for i in [0, 2, 4] {
        c.lookup_or_register(p(i), PAGE).unwrap();
    }
    let held = c.lookup_or_register(p(2), PAGE).unwrap(); // hit: page 2 is now most recent
    c.lookup_or_register(p(0), PAGE).unwrap(); // page 0 most recent; page 4 is LRU
    c.lookup_or_register(p(6), PAGE).unwrap(); // over budget: evicts page 4
    let mt = c.metrics();
    assert_eq!((mt.evictions, mt.entries), (1, 3));
    assert_eq!(live.load(SeqCst), 3, "page 4 deregistered (no lease)");
    // Page 2 is evicted next, but its lease keeps it registered.
    c.lookup_or_register(p(0), PAGE).unwrap();
    c.lookup_or_register(p(6), PAGE).unwrap();
    c.lookup_or_register(p(4), PAGE).unwrap(); // miss; evicts page 2 (LRU)
    let mt = c.metrics();
    assert_eq!((mt.evictions, mt.misses), (2, 5));
    assert_eq!(live.load(SeqCst), 4, "evicted but leased");
    assert_eq!(mt.bytes_registered, 4 * PAGE as u64);
    assert_eq!(mt.bytes_in_use, PAGE as u64, "the held lease");
    assert_eq!(mt.bytes_free, 3 * PAGE as u64);
    assert_ne!(held.lkey(), 0);
    drop(held);
    assert_eq!(
        live.load(SeqCst),
        3,
        "deregistered when the last lease drops"
    );
    assert_eq!(c.metrics().bytes_registered, 3 * PAGE as u64);
}

#[test]
fn invalidate_drops_the_cache_reference_only() {
    let (f, live, _calls) = fake::shared();
    let c = cache(f, CacheConfig::default());
    let m = pages(4);
    let lease = c.lookup_or_register(m.as_ptr(), 2 * PAGE).unwrap();
    c.lookup_or_register(m.as_ptr().wrapping_add(3 * PAGE), 10)
        .unwrap();
    assert_eq!(c.invalidate(m.as_ptr().wrapping_add(PAGE), 1), 1);
    assert_eq!(c.metrics().invalidations, 1);
    assert_eq!(
        live.load(SeqCst),
        2,
        "leased registration survives invalidation"
    );
    let again = c.lookup_or_register(m.as_ptr(), 2 * PAGE).unwrap();
    assert_ne!(
        again.lkey(),
        lease.lkey(),
        "re-registered after invalidation"
    );
    drop(lease);
    assert_eq!(live.load(SeqCst), 2);
    c.clear();
    drop(again);
    assert_eq!(live.load(SeqCst), 0);
    assert_eq!(c.metrics().entries, 0);
}

#[test]
fn whole_mapping_registers_once_for_all_slices() {
    let (f, _live, calls) = fake::shared();
    let c = cache(f, CacheConfig::default().whole_mappings(Some(1 << 30)));
    let m = pages(64);
    for i in 0..64 {
        c.lookup_or_register(m.as_ptr().wrapping_add(i * PAGE), PAGE)
            .unwrap();
    }
    let mt = c.metrics();
    assert_eq!((mt.registrations, mt.misses, mt.hits), (1, 1, 63));
    let (addr, len, _) = calls.lock().unwrap()[0];
    assert!(addr <= m.as_ptr() as u64 && addr + len as u64 >= m.as_ptr() as u64 + m.len() as u64);
}

#[test]
fn failed_expansion_falls_back_to_the_pages_asked_for() {
    let f = FakeRegistrar::failing_above(2 * PAGE);
    let calls = f.calls.clone();
    let c = cache(f, CacheConfig::default().whole_mappings(Some(1 << 30)));
    let m = pages(16);
    let l = c.lookup_or_register(m.as_ptr(), 100).unwrap();
    assert_eq!((l.addr(), l.len()), (m.as_ptr() as u64, PAGE as u64));
    assert_eq!(calls.lock().unwrap().len(), 1);
    let err = c
        .lookup_or_register(m.as_ptr().wrapping_add(8 * PAGE), 3 * PAGE)
        .unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOMEM));
    assert_eq!(c.metrics().registration_failures, 1);
}

static READ_ONLY: [u8; 64] = [5; 64];

#[test]
fn read_only_memory_is_registered_for_local_reads() {
    let (f, _live, calls) = fake::shared();
    let c = cache(f, CacheConfig::default());
    let l = c
        .lookup_or_register(READ_ONLY.as_ptr(), READ_ONLY.len())
        .unwrap();
    assert!(!l.is_writable());
    assert_eq!(calls.lock().unwrap()[0].2, AccessFlags::NONE);
    let v = [0u8; 100];
    assert!(
        c.lookup_or_register(v.as_ptr(), v.len())
            .unwrap()
            .is_writable()
    );
}

/// A registrar that holds registrations longer than a page until released.
#[derive(Debug, Default)]
struct Gated {
    inner: FakeRegistrar,
    entered: Arc<std::sync::atomic::AtomicBool>,
    release: Arc<std::sync::atomic::AtomicBool>,
}

impl Registrar for Gated {
    unsafe fn register(
        &self,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
    ) -> Result<Box<dyn Registration>> {
        if len > PAGE {
            self.entered.store(true, SeqCst);
            while !self.release.load(SeqCst) {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        // SAFETY: forwarded contract.
        unsafe { self.inner.register(addr, len, access) }
    }
}

/// Starts a lookup of 4 pages at `at` on a thread and returns once its registration is under
/// way (held by the gate).
fn blocked_miss(c: &RegCache, g: &Gated, at: usize) -> std::thread::JoinHandle<Result<MrLease>> {
    let c2 = c.clone();
    let t = std::thread::spawn(move || c2.lookup_or_register(at as *const u8, 4 * PAGE));
    while !g.entered.load(SeqCst) {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    t
}

fn gated() -> (Gated, Gated) {
    let g = Gated::default();
    let view = Gated {
        inner: FakeRegistrar::default(),
        entered: g.entered.clone(),
        release: g.release.clone(),
    };
    (g, view)
}

/// A miss registers (and reads `/proc/self/maps`) without the cache's lock: a hit on another
/// thread is served while a slow registration is under way. At 61ac8ac the hit waited for it
/// (the whole miss path ran under the lock).
#[test]
fn a_hit_is_not_held_up_by_a_slow_miss() {
    let (g, view) = gated();
    let c = cache_of(g);
    let m = pages(16);
    let p = |i: usize| m.as_ptr().wrapping_add(i * PAGE).cast_const();
    let held = c.lookup_or_register(p(12), PAGE).unwrap(); // cached (one page: not gated)
    let slow = blocked_miss(&c, &view, p(0) as usize);
    let (tx, rx) = std::sync::mpsc::channel();
    let c2 = c.clone();
    let at = p(12) as usize;
    std::thread::spawn(move || {
        let _ = tx.send(
            c2.lookup_or_register(at as *const u8, 100)
                .map(|l| l.lkey()),
        );
    });
    let hit = rx.recv_timeout(std::time::Duration::from_secs(5));
    view.release.store(true, SeqCst);
    slow.join().unwrap().unwrap();
    let hit = hit.expect("a hit waited for another thread's registration");
    assert_eq!(hit.unwrap(), held.lkey());
    let mt = c.metrics();
    assert_eq!((mt.hits, mt.misses, mt.entries), (1, 2, 2));
}

/// An invalidation that runs while a miss registers keeps that registration out of the cache
/// (its range may be what is about to be unmapped); the lookup still gets its lease.
#[test]
fn an_invalidation_during_a_miss_keeps_it_uncached() {
    let (g, view) = gated();
    let c = cache_of(g);
    let m = pages(8);
    let slow = blocked_miss(&c, &view, m.as_ptr() as usize);
    let (tx, rx) = std::sync::mpsc::channel();
    let (c2, at) = (c.clone(), m.as_ptr() as usize);
    std::thread::spawn(move || {
        let _ = tx.send(c2.invalidate(at as *const u8, 4 * PAGE));
    });
    let removed = rx.recv_timeout(std::time::Duration::from_secs(5));
    view.release.store(true, SeqCst);
    assert_eq!(
        removed,
        Ok(0),
        "the invalidation ran at once, nothing cached yet"
    );
    let lease = slow.join().unwrap().unwrap();
    assert!(lease.covers(m.as_ptr(), 4 * PAGE));
    let mt = c.metrics();
    assert_eq!((mt.registrations, mt.entries), (1, 0));
}

fn cache_of(g: Gated) -> RegCache {
    // SAFETY: the tests keep the memory they look up mapped for the cache's lifetime.
    unsafe { RegCache::new(g, CacheConfig::default()) }
}

/// A range that does not wrap the address space but ends in its last page: rounding its end
/// up to a page overflowed (a panic with overflow checks; without, an end of 0 and a
/// registration of `0 - start` bytes).
#[test]
fn a_range_in_the_last_page_is_refused_not_rounded_past_the_end() {
    let (f, live, _calls) = fake::shared();
    let c = cache(f, CacheConfig::default());
    for (addr, len) in [
        (usize::MAX - 10, 5),
        (usize::MAX - PAGE, PAGE),
        (usize::MAX - 1, 1),
    ] {
        match c.lookup_or_register(addr as *const u8, len) {
            Err(Error::InvalidArgument(InvalidArgument::CacheRange { .. })) => {}
            other => panic!("{addr:#x}+{len}: {other:?}"),
        }
    }
    assert_eq!(live.load(SeqCst), 0);
    assert_eq!(c.metrics().registrations, 0);
}
