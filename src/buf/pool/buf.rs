//! [`PoolBuf`]: a buffer handed out by the pool.

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::Arc;

use bytes::Bytes;

use super::inner::PoolInner;
use crate::buf::{IoBuf, IoBufMut};
use crate::verbs::{MemoryRegion, Sge};

/// A registered buffer from a [`Pool`](super::Pool): local memory (registered `LOCAL_WRITE`,
/// never remotely accessible by itself) that carries its lkey, derefs to its bytes, and
/// returns to the pool when dropped.
///
/// Its `len()` is the length asked for; its `capacity()` the size of its class. All of the
/// capacity is initialised memory, so [`set_len`](Self::set_len) is safe.
///
/// # Examples
///
/// ```no_run
/// # async fn f(pool: tokio_rdma::buf::Pool) -> tokio_rdma::Result<()> {
/// let mut buf = pool.acquire(5).await?;
/// buf.copy_from_slice(b"hello");
/// let sge = buf.sge(0..5); // for verbs-level posting
/// assert_eq!(sge.lkey(), buf.lkey());
/// let bytes: bytes::Bytes = buf.freeze(); // zero-copy; returns to the pool on last drop
/// # Ok(()) }
/// ```
pub struct PoolBuf {
    pool: Arc<PoolInner>,
    ptr: NonNull<u8>,
    len: usize,
    slot: u32,
    class: u16,
}

// SAFETY: the buffer exclusively owns its slot of pool memory until it is dropped; the pool
// itself is shared through an `Arc` of `Send + Sync` parts.
unsafe impl Send for PoolBuf {}
// SAFETY: `&PoolBuf` only gives shared read access to the bytes.
unsafe impl Sync for PoolBuf {}

impl PoolBuf {
    pub(super) fn new(
        pool: Arc<PoolInner>,
        class: u16,
        slot: u32,
        ptr: NonNull<u8>,
        len: usize,
    ) -> PoolBuf {
        debug_assert!(len <= pool.class_size(class));
        PoolBuf {
            pool,
            ptr,
            len,
            slot,
            class,
        }
    }

    /// The buffer's slot in its size class (unique among the buffers of the class).
    pub(crate) fn slot(&self) -> u32 {
        self.slot
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the length is zero.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The size of the buffer's class: the most it can hold.
    pub fn capacity(&self) -> usize {
        self.pool.class_size(self.class)
    }

    /// Sets the length (the bytes between the old and new length keep what they held).
    ///
    /// # Panics
    ///
    /// If `len > capacity()`.
    pub fn set_len(&mut self, len: usize) {
        assert!(len <= self.capacity(), "len {len} exceeds capacity");
        self.len = len;
    }

    /// Shortens the buffer to `len` bytes (no effect if it is shorter already).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// The local key of the pool registration covering this buffer.
    pub fn lkey(&self) -> u32 {
        self.pool.registration(self.class).lkey()
    }

    /// Start address, as the device sees it.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// A scatter/gather entry for `range` of the buffer's capacity.
    ///
    /// # Panics
    ///
    /// If `range` exceeds the capacity or is longer than `u32::MAX`.
    pub fn sge(&self, range: std::ops::Range<usize>) -> Sge {
        assert!(
            range.start <= range.end && range.end <= self.capacity(),
            "range {range:?} out of bounds"
        );
        let len = u32::try_from(range.len()).expect("SGE length fits in u32");
        Sge::new(self.addr() + range.start as u64, len, self.lkey())
    }

    /// Converts into [`Bytes`] without copying; the buffer returns to the pool when the last
    /// clone of the `Bytes` (or of any slice of it) is dropped.
    pub fn freeze(self) -> Bytes {
        Bytes::from_owner(self)
    }

    /// The verbs region behind the pool registration, if the pool is registered with
    /// `MW_BIND` on a real device (memory windows can then be bound to this buffer).
    pub(crate) fn window_region(&self) -> Option<&MemoryRegion> {
        self.pool
            .registration(self.class)
            .memory_region()
            .filter(|mr| mr.access().contains(crate::verbs::AccessFlags::MW_BIND))
    }
}

impl Deref for PoolBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len <= capacity` initialised bytes owned by this buffer; the registration is
        // LOCAL_WRITE only, so only work the owner posts (an op holding the buffer by value,
        // or under the unsafe posting contract) writes it.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for PoolBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` excludes other local references.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl AsRef<[u8]> for PoolBuf {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl AsMut<[u8]> for PoolBuf {
    fn as_mut(&mut self) -> &mut [u8] {
        self
    }
}

impl From<PoolBuf> for Bytes {
    fn from(buf: PoolBuf) -> Bytes {
        buf.freeze()
    }
}

// SAFETY: the slot's memory is part of a mapping the pool keeps (through the `Arc` this buffer
// holds) until every buffer is gone, so the pointer is stable and `capacity()` bytes are
// allocated and initialised; the class registration covers the whole mapping and lives as long.
unsafe impl IoBuf for PoolBuf {
    fn stable_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.len
    }
    fn bytes_total(&self) -> usize {
        // The acquired length, not the class size: a read or receive fills what was asked
        // for (`set_len` first to use more of the class).
        self.len
    }
    fn lkey(&self) -> Option<u32> {
        Some(PoolBuf::lkey(self))
    }
}

// SAFETY: as above; the pointer is valid for writes of `capacity()` bytes.
unsafe impl IoBufMut for PoolBuf {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    unsafe fn set_init(&mut self, pos: usize) {
        if self.len < pos {
            self.set_len(pos);
        }
    }
}

impl Drop for PoolBuf {
    fn drop(&mut self) {
        self.pool.release(self.class, self.slot);
    }
}

impl fmt::Debug for PoolBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolBuf")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len)
            .field("capacity", &self.capacity())
            .finish_non_exhaustive()
    }
}
