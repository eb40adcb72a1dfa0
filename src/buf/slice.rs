//! A sub-range of an owned buffer.

use std::ops::{Bound, RangeBounds};

use super::{IoBuf, IoBufMut};

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
        let begin = match range.start_bound() {
            Bound::Included(&n) => n,
            Bound::Excluded(&n) => n + 1,
            Bound::Unbounded => 0,
        };
        let end = match range.end_bound() {
            Bound::Included(&n) => n + 1,
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
    fn stable_ptr(&self) -> *const u8 {
        self.buf.stable_ptr().wrapping_add(self.begin)
    }
    fn bytes_init(&self) -> usize {
        self.buf.bytes_init().clamp(self.begin, self.end) - self.begin
    }
    fn bytes_total(&self) -> usize {
        self.end - self.begin
    }
    fn lkey(&self) -> Option<u32> {
        self.buf.lkey()
    }
}

// SAFETY: as above.
unsafe impl<T: IoBufMut> IoBufMut for Slice<T> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.buf.stable_mut_ptr().wrapping_add(self.begin)
    }
    /// Records that the slice's first `pos` bytes are initialised. The inner buffer only
    /// tracks an initialised prefix, so this extends it only when the slice starts inside that
    /// prefix (or right at its end): otherwise the bytes between the prefix and the slice were
    /// never written, and the inner buffer's initialised length stays as it was.
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

    #[test]
    #[should_panic(expected = "out of bounds")]
    fn out_of_bounds_panics() {
        let _ = vec![0u8; 4].slice(0..5);
    }
}
