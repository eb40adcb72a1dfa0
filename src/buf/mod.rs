//! Buffers the device may access: the traits that let async operations take ownership of
//! memory, and (in submodules) the registered pool, the registration cache and remote grants.
//!
//! An operation takes its buffer **by value** and returns it with the result. The buffer's
//! memory must not move while the device may touch it, which these traits promise: the pointer
//! they report stays valid and unchanged for the life of the value, even when the value itself
//! is moved (it points to the heap or to a registered pool, never into the value).

pub(crate) mod blocking;
mod cache;
#[cfg(test)]
pub(crate) mod fake;
mod grant;
mod pool;
mod registered;
mod registrar;
mod shared_region;
mod token;

pub use cache::{CacheConfig, CacheMetrics, MrLease, RegCache};
pub use grant::{Grant, GrantBuf, GrantKind, RemoteAccess};
pub use pool::{Acquire, Pool, PoolBuf, PoolConfig, PoolMetrics, SizeClass};
pub(crate) use registered::Registered;
pub use registered::RegisteredBytes;
pub use registrar::{MrRegistrar, Registrar, Registration};
pub use shared_region::{SharedGrant, SharedRegion};
pub use token::RemoteToken;

use std::ops::{Bound, RangeBounds};

/// A buffer whose bytes the device may read (a send or RDMA WRITE source).
///
/// # Safety
///
/// Implementors guarantee that
/// * [`stable_ptr`](IoBuf::stable_ptr) returns the same pointer for as long as the value lives
///   (moving the value does not move the memory), and that `bytes_total()` bytes starting there
///   are allocated for as long as the value lives;
/// * the first `bytes_init()` bytes are initialised and `bytes_init() <= bytes_total()`;
/// * if [`lkey`](IoBuf::lkey) returns `Some(k)`, a memory region with local key `k` covers the
///   whole `[ptr, ptr + bytes_total())` range and stays registered as long as the value lives.
pub unsafe trait IoBuf: Send + 'static {
    /// Start of the memory.
    fn stable_ptr(&self) -> *const u8;
    /// Initialised bytes: what a send or write transfers.
    fn bytes_init(&self) -> usize;
    /// Allocated bytes: what a receive or read may fill.
    fn bytes_total(&self) -> usize;
    /// The local key of a registration covering the buffer, if the buffer carries one. Buffers
    /// without one (plain `Vec<u8>`, `Bytes`) are registered through a registration cache.
    fn lkey(&self) -> Option<u32> {
        None
    }

    /// A view of `range` of this buffer that can be passed to an operation in its place.
    ///
    /// # Panics
    ///
    /// If `range` exceeds `bytes_total()`.
    fn slice(self, range: impl std::ops::RangeBounds<usize>) -> Slice<Self>
    where
        Self: Sized,
    {
        Slice::new(self, range)
    }
}

/// A buffer the device may write (a receive, RDMA READ or atomic target).
///
/// # Safety
///
/// As for [`IoBuf`], and [`stable_mut_ptr`](IoBufMut::stable_mut_ptr) returns the same address
/// as `stable_ptr`, valid for writes of `bytes_total()` bytes.
pub unsafe trait IoBufMut: IoBuf {
    /// Start of the memory, for writing.
    fn stable_mut_ptr(&mut self) -> *mut u8;
    /// Records that the first `pos` bytes are now initialised (after a receive or read).
    ///
    /// # Safety
    ///
    /// The first `pos` bytes must really be initialised and `pos <= bytes_total()`.
    unsafe fn set_init(&mut self, pos: usize);
}

// SAFETY: a Vec's heap allocation does not move when the Vec is moved; `len <= capacity`.
// No lkey: registered on demand by the registration cache.
unsafe impl IoBuf for Vec<u8> {
    #[inline]
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    #[inline]
    fn bytes_init(&self) -> usize {
        self.len()
    }
    #[inline]
    fn bytes_total(&self) -> usize {
        self.capacity()
    }
}

// SAFETY: as above; `set_len` is only called with initialised lengths (caller contract).
unsafe impl IoBufMut for Vec<u8> {
    #[inline]
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
    #[inline]
    unsafe fn set_init(&mut self, pos: usize) {
        if self.len() < pos {
            // SAFETY: the caller guarantees `pos` bytes are initialised and within capacity.
            unsafe { self.set_len(pos) };
        }
    }
}

// SAFETY: `Bytes` never moves or frees its storage while a handle lives; it is read-only.
unsafe impl IoBuf for bytes::Bytes {
    #[inline]
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    #[inline]
    fn bytes_init(&self) -> usize {
        self.len()
    }
    #[inline]
    fn bytes_total(&self) -> usize {
        self.len()
    }
}

// SAFETY: a `BytesMut`'s storage does not move while it is not resized (operations take it by
// value, so nobody can resize it while the device uses it).
unsafe impl IoBuf for bytes::BytesMut {
    #[inline]
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    #[inline]
    fn bytes_init(&self) -> usize {
        self.len()
    }
    #[inline]
    fn bytes_total(&self) -> usize {
        self.capacity()
    }
}

// SAFETY: as above; `set_len` only with initialised lengths.
unsafe impl IoBufMut for bytes::BytesMut {
    #[inline]
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
    #[inline]
    unsafe fn set_init(&mut self, pos: usize) {
        if self.len() < pos {
            // SAFETY: the caller guarantees `pos` bytes are initialised and within capacity.
            unsafe { self.set_len(pos) };
        }
    }
}

// SAFETY: a `RegisteredBuffer` owns a heap allocation that never moves, registered as one
// region for its whole life; all its bytes are initialised (zeroed at allocation).
unsafe impl IoBuf for crate::verbs::RegisteredBuffer {
    #[inline]
    fn stable_ptr(&self) -> *const u8 {
        self.addr() as *const u8
    }
    #[inline]
    fn bytes_init(&self) -> usize {
        self.len()
    }
    #[inline]
    fn bytes_total(&self) -> usize {
        self.len()
    }
    #[inline]
    fn lkey(&self) -> Option<u32> {
        Some(crate::verbs::RegisteredBuffer::lkey(self))
    }
}

// SAFETY: as above; every byte is always initialised, so `set_init` has nothing to record.
unsafe impl IoBufMut for crate::verbs::RegisteredBuffer {
    #[inline]
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.addr() as *mut u8
    }
    #[inline]
    unsafe fn set_init(&mut self, _pos: usize) {}
}

// The trait and its sub-range view depend on each other (`IoBuf::slice` makes a `Slice`, a
// `Slice` is an `IoBuf`): one file.
/// A range of an owned buffer, passed to an operation in place of the whole buffer; the whole
/// buffer comes back with [`into_inner`](Slice::into_inner).
///
/// # Examples
///
/// ```
/// use tokio_rdma::buf::IoBuf;
/// let s = vec![1u8, 2, 3, 4, 5].slice(1..3);
/// assert_eq!((s.begin(), s.end()), (1, 3));
/// assert_eq!(s.into_inner().len(), 5);
/// ```
#[derive(Debug)]
pub struct Slice<T> {
    buf: T,
    begin: usize,
    end: usize,
}

impl<T: IoBuf> Slice<T> {
    pub(crate) fn new(buf: T, range: impl RangeBounds<usize>) -> Slice<T> {
        let total = buf.bytes_total();
        // A bound past `usize::MAX` (`n + 1` overflows) is out of bounds, never wrapped.
        let past = |n: usize| {
            n.checked_add(1)
                .unwrap_or_else(|| panic!("slice bound {n} + 1 out of bounds of {total}"))
        };
        let begin = match range.start_bound() {
            Bound::Included(&n) => n,
            Bound::Excluded(&n) => past(n),
            Bound::Unbounded => 0,
        };
        let end = match range.end_bound() {
            Bound::Included(&n) => past(n),
            Bound::Excluded(&n) => n,
            Bound::Unbounded => buf.bytes_init(),
        };
        assert!(
            begin <= end && end <= total,
            "slice {begin}..{end} out of bounds of {total}"
        );
        Slice { buf, begin, end }
    }

    /// Offset of the start of the range.
    pub fn begin(&self) -> usize {
        self.begin
    }

    /// Offset of the end of the range.
    pub fn end(&self) -> usize {
        self.end
    }

    /// The underlying buffer.
    pub fn get_ref(&self) -> &T {
        &self.buf
    }

    /// Gives back the underlying buffer.
    pub fn into_inner(self) -> T {
        self.buf
    }
}

// SAFETY: the range lies inside the inner buffer's stable allocation (checked in `new`), so
// every promise of the inner buffer holds for the sub-range; the lkey covers it too.
unsafe impl<T: IoBuf> IoBuf for Slice<T> {
    #[inline]
    fn stable_ptr(&self) -> *const u8 {
        self.buf.stable_ptr().wrapping_add(self.begin)
    }
    #[inline]
    fn bytes_init(&self) -> usize {
        self.buf.bytes_init().clamp(self.begin, self.end) - self.begin
    }
    #[inline]
    fn bytes_total(&self) -> usize {
        self.end - self.begin
    }
    #[inline]
    fn lkey(&self) -> Option<u32> {
        self.buf.lkey()
    }
}

// SAFETY: as above.
unsafe impl<T: IoBufMut> IoBufMut for Slice<T> {
    #[inline]
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.buf.stable_mut_ptr().wrapping_add(self.begin)
    }
    /// Records that the slice's first `pos` bytes are initialised. The inner buffer only
    /// tracks an initialised prefix, so this extends it only when the slice starts inside that
    /// prefix (or right at its end): otherwise the bytes between the prefix and the slice were
    /// never written, and the inner buffer's initialised length stays as it was.
    #[inline]
    unsafe fn set_init(&mut self, pos: usize) {
        if self.buf.bytes_init() < self.begin {
            return;
        }
        // SAFETY: bytes `..begin` of the inner buffer are initialised (its prefix reaches
        // `begin`, checked above) and the caller guarantees `begin..begin + pos`, which lies
        // within the inner buffer since `pos <= bytes_total() = end - begin`.
        unsafe { self.buf.set_init(self.begin + pos) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_and_init() {
        let mut v = Vec::with_capacity(16);
        v.extend_from_slice(&[0u8; 8]);
        let s = v.slice(4..12);
        assert_eq!(s.bytes_total(), 8);
        assert_eq!(s.bytes_init(), 4, "only 4 of the 8 bytes are initialised");
        let s = s.into_inner().slice(..);
        assert_eq!((s.begin(), s.end()), (0, 8));
    }

    #[test]
    fn set_init_past_the_initialised_prefix_leaves_the_gap_uninitialised() {
        // A receive into 2048..4096 of an empty Vec writes bytes 2048.. only: bytes ..2048 were
        // never written, so the Vec must not claim them.
        let v: Vec<u8> = Vec::with_capacity(4096);
        let mut s = v.slice(2048..4096);
        // SAFETY: stands for a device write of 100 bytes at the slice start (within capacity).
        unsafe {
            std::ptr::write_bytes(s.stable_mut_ptr(), 7, 100);
            s.set_init(100);
        }
        let v = s.into_inner();
        assert_eq!(v.len(), 0, "no byte of the gap may count as initialised");

        // Starting inside the initialised prefix extends it.
        let mut v = vec![1u8; 10];
        v.reserve(100);
        let mut s = v.slice(5..50);
        // SAFETY: writes 20 bytes within the slice (inside capacity), then records them.
        unsafe {
            std::ptr::write_bytes(s.stable_mut_ptr(), 9, 20);
            s.set_init(20);
        }
        let v = s.into_inner();
        assert_eq!(v.len(), 25);
        assert_eq!(&v[..5], &[1; 5]);
        assert_eq!(&v[5..25], &[9; 20]);
    }

    /// At 84e8c41 a bound at `usize::MAX` overflowed `n + 1`: debug builds panicked with an
    /// arithmetic overflow, release builds wrapped it to 0 and accepted the slice (`..=MAX`
    /// became an empty slice, `(Excluded(MAX), ..)` the whole buffer).
    #[test]
    fn a_bound_past_usize_max_is_out_of_bounds() {
        let msg = |r: (Bound<usize>, Bound<usize>)| {
            let e = std::panic::catch_unwind(|| vec![0u8; 4].slice(r)).unwrap_err();
            let s = e.downcast_ref::<&str>().map(|s| s.to_string());
            e.downcast_ref::<String>()
                .cloned()
                .or(s)
                .unwrap_or_default()
        };
        let starts_past = msg((Bound::Excluded(usize::MAX), Bound::Unbounded));
        assert!(starts_past.contains("out of bounds"), "{starts_past}");
        let ends_past = msg((Bound::Unbounded, Bound::Included(usize::MAX)));
        assert!(ends_past.contains("out of bounds"), "{ends_past}");
    }

    #[test]
    #[should_panic(expected = "out of bounds")]
    fn out_of_bounds_panics() {
        let _ = vec![0u8; 4].slice(0..5);
    }
}
