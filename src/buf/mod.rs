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
mod slice;
mod token;

pub use cache::{CacheConfig, CacheMetrics, MrLease, RegCache};
pub use grant::{Grant, GrantBuf, GrantKind, RemoteAccess};
pub use pool::{Acquire, Pool, PoolBuf, PoolConfig, PoolMetrics, SizeClass};
pub(crate) use registered::Registered;
pub use registered::RegisteredBytes;
pub use registrar::{MrRegistrar, Registrar, Registration};
pub use shared_region::{SharedGrant, SharedRegion};
pub use slice::Slice;
pub use token::RemoteToken;

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
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.len()
    }
    fn bytes_total(&self) -> usize {
        self.capacity()
    }
}

// SAFETY: as above; `set_len` is only called with initialised lengths (caller contract).
unsafe impl IoBufMut for Vec<u8> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
    unsafe fn set_init(&mut self, pos: usize) {
        if self.len() < pos {
            // SAFETY: the caller guarantees `pos` bytes are initialised and within capacity.
            unsafe { self.set_len(pos) };
        }
    }
}

// SAFETY: `Bytes` never moves or frees its storage while a handle lives; it is read-only.
unsafe impl IoBuf for bytes::Bytes {
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.len()
    }
    fn bytes_total(&self) -> usize {
        self.len()
    }
}

// SAFETY: a `BytesMut`'s storage does not move while it is not resized (operations take it by
// value, so nobody can resize it while the device uses it).
unsafe impl IoBuf for bytes::BytesMut {
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.len()
    }
    fn bytes_total(&self) -> usize {
        self.capacity()
    }
}

// SAFETY: as above; `set_len` only with initialised lengths.
unsafe impl IoBufMut for bytes::BytesMut {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
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
    fn stable_ptr(&self) -> *const u8 {
        self.addr() as *const u8
    }
    fn bytes_init(&self) -> usize {
        self.len()
    }
    fn bytes_total(&self) -> usize {
        self.len()
    }
    fn lkey(&self) -> Option<u32> {
        Some(crate::verbs::RegisteredBuffer::lkey(self))
    }
}

// SAFETY: as above; every byte is always initialised, so `set_init` has nothing to record.
unsafe impl IoBufMut for crate::verbs::RegisteredBuffer {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.addr() as *mut u8
    }
    unsafe fn set_init(&mut self, _pos: usize) {}
}
