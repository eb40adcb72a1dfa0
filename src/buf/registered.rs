//! Memory the caller keeps registered: [`RegisteredBytes`] owns a `Bytes` and the registration
//! of its memory, so the registration can never outlive the memory it names; and the index
//! through which a connection's `send_bytes` finds the registration of any bytes inside it.
//!
//! This is the safe form of "register once, send many times" for memory the application
//! allocated itself. The registration cache ([`RegCache`](super::RegCache)) keys registrations
//! by address and must trust that an address keeps its pages (an `unsafe` contract); here the
//! lease owns the memory, so while a lookup finds a live lease, the bytes at that address are
//! the lease's own bytes, and once the lease and every `Bytes` made from it are gone, nothing
//! maps that address any more.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::RangeBounds;
use std::sync::{Arc, Mutex, Weak};

use bytes::Bytes;

use super::registrar::{Registrar, Registration};
use crate::error::{Error, InvalidArgument, Result};
use crate::verbs::AccessFlags;

/// The registration and the memory it covers.
struct Inner {
    /// Declared first: deregistered before the bytes may be freed.
    reg: Box<dyn Registration>,
    bytes: Bytes,
}

/// A registration of a `Bytes`' memory that owns those bytes: made by
/// [`Connection::register_bytes`](crate::conn::Connection::register_bytes), valid on that
/// connection. While it (or any `Bytes` made from it) lives, [`send_bytes`] of the whole
/// memory or any part of it, through any `Bytes` that points there, goes without copying and
/// without registering; once it is dropped, the next sends from that memory are copied again.
///
/// Registrations are local only (the peer gets no key): the memory is a send source, never
/// written by the device. Cloning is cheap (a reference count).
///
/// [`send_bytes`]: crate::conn::Connection::send_bytes
///
/// # Examples
///
/// ```no_run
/// # async fn demo(conn: tokio_rdma::conn::Connection) -> tokio_rdma::Result<()> {
/// let table = bytes::Bytes::from(vec![7u8; 1 << 20]);
/// let reg = conn.register_bytes(table.clone())?; // ibv_reg_mr, once
/// for i in 0..16 {
///     conn.send_bytes(table.slice(i * 4096..(i + 1) * 4096)).await?; // no copy
/// }
/// assert_eq!(conn.stats().send_bytes_copied, 0);
/// drop(reg); // deregistered once the sends still in flight are done with it
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RegisteredBytes {
    inner: Arc<Inner>,
}

/// The owner of the `Bytes` that [`RegisteredBytes::bytes`] hands out.
struct Owner(Arc<Inner>);

impl AsRef<[u8]> for Owner {
    fn as_ref(&self) -> &[u8] {
        &self.0.bytes
    }
}

impl RegisteredBytes {
    /// Registers `bytes` through `registrar` for local reads.
    pub(crate) fn register(registrar: &dyn Registrar, bytes: Bytes) -> Result<RegisteredBytes> {
        if bytes.is_empty() {
            return Err(Error::InvalidArgument(InvalidArgument::EmptyRegistration));
        }
        // SAFETY: `bytes` never moves or frees its storage while a handle to it lives, and
        // `Inner` keeps it until after the registration is dropped (field order). Local read
        // access only: the device never writes through this key, so `Bytes`' immutability
        // holds.
        let reg = unsafe {
            registrar.register(bytes.as_ptr().cast_mut(), bytes.len(), AccessFlags::NONE)?
        };
        Ok(RegisteredBytes {
            inner: Arc::new(Inner { reg, bytes }),
        })
    }

    /// The local key of the registration.
    pub fn lkey(&self) -> u32 {
        self.inner.reg.lkey()
    }

    /// The number of bytes registered.
    pub fn len(&self) -> usize {
        self.inner.bytes.len()
    }

    /// Always false: empty buffers are never registered.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The registered bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.inner.bytes
    }

    /// A `Bytes` of the whole memory that keeps the registration alive as long as it lives.
    pub fn bytes(&self) -> Bytes {
        Bytes::from_owner(Owner(self.inner.clone()))
    }

    /// A `Bytes` of `range` of the memory that keeps the registration alive as long as it
    /// lives.
    ///
    /// # Panics
    ///
    /// If `range` is out of bounds (as `Bytes::slice`).
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Bytes {
        self.bytes().slice(range)
    }

    fn range(&self) -> (usize, usize) {
        let start = self.inner.bytes.as_ptr() as usize;
        (start, start + self.inner.bytes.len())
    }
}

impl fmt::Debug for RegisteredBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegisteredBytes")
            .field("addr", &self.inner.bytes.as_ptr())
            .field("len", &self.len())
            .field("lkey", &self.lkey())
            .finish()
    }
}

/// A live registration found by [`Registered::find`]: hold it until the device has read the
/// bytes.
pub(crate) struct Lease(#[allow(dead_code)] Arc<Inner>);

/// The registrations one connection made with `register_bytes`, by start address. Entries are
/// weak: the caller's handles decide how long a registration lives; dead entries are removed
/// on the next insertion or when a lookup meets them.
#[derive(Default)]
pub(crate) struct Registered {
    state: Mutex<Index>,
}

#[derive(Default)]
struct Index {
    by_start: BTreeMap<usize, Vec<(usize, Weak<Inner>)>>,
    /// The longest range ever inserted: a lookup looks no further back than this.
    longest: usize,
}

impl Registered {
    /// Adds `reg` to the index (and drops the entries of registrations that are gone).
    pub(crate) fn insert(&self, reg: &RegisteredBytes) {
        let (start, end) = reg.range();
        let mut ix = self.state.lock().unwrap_or_else(|e| e.into_inner());
        ix.by_start.retain(|_, v| {
            v.retain(|(_, w)| w.strong_count() > 0);
            !v.is_empty()
        });
        ix.longest = ix.longest.max(end - start);
        ix.by_start
            .entry(start)
            .or_default()
            .push((end, Arc::downgrade(&reg.inner)));
    }

    /// The lkey of a live registration covering `len` bytes at `addr`, with a lease that keeps
    /// it alive.
    pub(crate) fn find(&self, addr: usize, len: usize) -> Option<(u32, Lease)> {
        let end = addr.checked_add(len)?;
        let mut ix = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if len > ix.longest {
            // No registration is that long (and `lowest` below would pass `addr`).
            return None;
        }
        let lowest = end.saturating_sub(ix.longest);
        let mut dead = Vec::new();
        let mut found = None;
        'scan: for (&start, v) in ix.by_start.range(lowest..=addr).rev() {
            for (e, w) in v {
                if *e < end {
                    continue;
                }
                match w.upgrade() {
                    Some(inner) => {
                        found = Some((inner.reg.lkey(), Lease(inner)));
                        break 'scan;
                    }
                    None => dead.push(start),
                }
            }
        }
        for start in dead {
            if let Some(v) = ix.by_start.get_mut(&start) {
                v.retain(|(_, w)| w.strong_count() > 0);
                if v.is_empty() {
                    ix.by_start.remove(&start);
                }
            }
        }
        found
    }

    /// The number of entries (live or not yet removed).
    #[cfg(test)]
    fn entries(&self) -> usize {
        let ix = self.state.lock().unwrap();
        ix.by_start.values().map(Vec::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering::SeqCst;

    use super::*;
    use crate::buf::fake;

    fn reg(f: &fake::FakeRegistrar, b: &Bytes) -> RegisteredBytes {
        RegisteredBytes::register(f, b.clone()).unwrap()
    }

    #[test]
    fn a_lookup_finds_only_live_registrations_that_cover_the_whole_range() {
        let (f, live, calls) = fake::shared();
        let a = Bytes::from(vec![1u8; 8192]);
        let b = Bytes::from(vec![2u8; 4096]);
        let index = Registered::default();
        let ra = reg(&f, &a);
        let rb = reg(&f, &b);
        index.insert(&ra);
        index.insert(&rb);
        assert_eq!(
            calls.lock().unwrap()[0].2,
            AccessFlags::NONE,
            "local read only"
        );

        let at = |b: &Bytes, off: usize| b.as_ptr() as usize + off;
        assert_eq!(index.find(at(&a, 0), 8192).map(|l| l.0), Some(ra.lkey()));
        assert_eq!(index.find(at(&a, 100), 50).map(|l| l.0), Some(ra.lkey()));
        assert_eq!(index.find(at(&b, 4095), 1).map(|l| l.0), Some(rb.lkey()));
        assert!(index.find(at(&a, 8000), 193).is_none(), "past the end");
        assert!(
            index.find(at(&a, 0).wrapping_sub(1), 2).is_none(),
            "before it"
        );
        assert!(index.find(usize::MAX - 1, 4).is_none(), "wrapping range");

        // A lease keeps the registration after the caller's handle is gone.
        let (_, lease) = index.find(at(&a, 0), 1).unwrap();
        drop(ra);
        assert_eq!(live.load(SeqCst), 2);
        drop(lease);
        assert_eq!(live.load(SeqCst), 1, "deregistered with the last handle");
        assert!(
            index.find(at(&a, 0), 1).is_none(),
            "gone: never found again"
        );
        assert_eq!(
            index.entries(),
            1,
            "the dead entry was removed by the lookup"
        );
        drop(rb);
        assert_eq!(live.load(SeqCst), 0);
    }

    #[test]
    fn bytes_made_from_a_registration_keep_it_alive() {
        let (f, live, _) = fake::shared();
        let index = Registered::default();
        let r = reg(&f, &Bytes::from(vec![3u8; 4096]));
        index.insert(&r);
        let part = r.slice(1024..2048);
        assert_eq!(&part[..], &[3u8; 1024][..]);
        drop(r);
        assert_eq!(live.load(SeqCst), 1);
        assert!(index.find(part.as_ptr() as usize, part.len()).is_some());
        drop(part);
        assert_eq!(live.load(SeqCst), 0);
    }

    #[test]
    fn overlapping_and_nested_registrations_are_found_and_dead_ones_removed() {
        let (f, _, _) = fake::shared();
        let big = Bytes::from(vec![0u8; 1 << 16]);
        let index = Registered::default();
        let outer = reg(&f, &big);
        let inner = reg(&f, &big.slice(4096..8192));
        index.insert(&outer);
        index.insert(&inner);
        let p = big.as_ptr() as usize;
        // The nested one starts later and does not cover this range; the outer one does.
        assert_eq!(index.find(p + 4096, 8192).unwrap().0, outer.lkey());
        assert!(index.find(p + 5000, 10).is_some());
        drop(outer);
        assert!(index.find(p + 4096, 8192).is_none());
        assert_eq!(index.find(p + 5000, 10).unwrap().0, inner.lkey());
        // Insertion removes what is gone.
        let other = reg(&f, &Bytes::from(vec![9u8; 100]));
        index.insert(&other);
        assert_eq!(index.entries(), 2);
    }

    /// At 84e8c41 a lookup longer than every registration asked the index for the range
    /// `end - longest ..= addr`, whose start is then past its end: `BTreeMap::range` panicked.
    /// `send_bytes` of a message larger than anything `register_bytes` registered did that.
    #[test]
    fn a_lookup_longer_than_every_registration_finds_nothing() {
        let (f, _, _) = fake::shared();
        let index = Registered::default();
        let small = Bytes::from(vec![5u8; 4096]);
        let r = reg(&f, &small);
        index.insert(&r);
        let big = vec![0u8; 1 << 16];
        assert!(index.find(big.as_ptr() as usize, big.len()).is_none());
        let p = small.as_ptr() as usize;
        assert!(
            index.find(p, 4097).is_none(),
            "one byte past the registration"
        );
        assert_eq!(index.find(p, 4096).unwrap().0, r.lkey());
    }

    #[test]
    fn empty_buffers_and_failed_registrations_are_errors() {
        let f = fake::FakeRegistrar::failing_above(10);
        assert!(matches!(
            RegisteredBytes::register(&f, Bytes::new()),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            RegisteredBytes::register(&f, Bytes::from(vec![0u8; 11])),
            Err(Error::RegMr { .. })
        ));
    }
}
