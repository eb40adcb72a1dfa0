//! Memory regions (`ibv_mr`) and a simple owned, registered allocation.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::fmt;
use std::ops::Range;
use std::ptr::NonNull;

use super::pd::ProtectionDomain;
use super::types::AccessFlags;
use super::wr::Sge;
use crate::error::{Error, InvalidArgument, Result};
use crate::sys;

/// A registration of a range of memory with the device: pins it and gives it a local key
/// (`lkey`) and a remote key (`rkey`). Deregistered on drop.
///
/// This type does not own the memory. [`RegisteredBuffer`] pairs a registration with the
/// allocation it covers.
pub struct MemoryRegion {
    mr: NonNull<sys::ibv_mr>,
    access: AccessFlags,
    pd: ProtectionDomain,
}

// SAFETY: an MR is immutable after registration; `ibv_dereg_mr` may run on any thread.
unsafe impl Send for MemoryRegion {}
// SAFETY: shared access only reads immutable fields.
unsafe impl Sync for MemoryRegion {}

impl MemoryRegion {
    /// Registers `len` bytes at `addr` with `access` rights.
    ///
    /// With [`AccessFlags::ON_DEMAND`] the region is registered on demand (ODP): nothing is
    /// pinned or counted against `RLIMIT_MEMLOCK`, pages are faulted in when the device
    /// touches them, and the region follows the process's mappings (a range unmapped and
    /// mapped again is seen with its new pages). The device must report ODP for the remote
    /// rights asked for ([`Context::odp_caps`](super::Context::odp_caps)).
    ///
    /// # Safety
    ///
    /// The memory must stay allocated (and not be remapped) until the region is dropped, and
    /// for as long as any work request or remote peer may still use its keys. With remote
    /// access the peer may write it at any time: the caller must not hold `&`/`&mut` references
    /// to it that assume it does not change. With `ON_DEMAND`, remapping is not a memory
    /// safety problem for the device (it follows the mapping, and an access to an unmapped
    /// page fails that work request), but whatever is mapped in the range later is reachable
    /// with the region's keys.
    ///
    /// # Errors
    ///
    /// [`Error::OdpUnsupported`] for `ON_DEMAND` on a device without the needed ODP
    /// capability (checked before calling the verb); [`Error::MemlockExhausted`] (naming the
    /// limit) for `ENOMEM`/`EPERM` while `RLIMIT_MEMLOCK` is finite; otherwise
    /// [`Error::RegMr`] with the errno.
    pub unsafe fn register(
        pd: &ProtectionDomain,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
    ) -> Result<MemoryRegion> {
        pd.context()
            .require_odp(access, super::OdpOps::NONE, false)?;
        let flags = i32::try_from(access.bits()).unwrap_or(0);
        // SAFETY: the PD is alive (the MR keeps a clone); the caller guarantees the memory.
        let mr = unsafe { sys::ibv_reg_mr(pd.as_ptr(), addr.cast(), len, flags) };
        let mr = NonNull::new(mr).ok_or_else(|| {
            crate::verbs::explain_reg_error(Error::last_os(|source| Error::RegMr { len, source }))
        })?;
        Ok(MemoryRegion {
            mr,
            access,
            pd: pd.clone(),
        })
    }

    /// Registers the process's whole address space on demand (implicit ODP:
    /// `ibv_reg_mr(pd, NULL, SIZE_MAX, IBV_ACCESS_ON_DEMAND | access)`): one lkey (and rkey,
    /// with remote rights) valid for any address of the process, faulted in as used.
    /// [`AccessFlags::ON_DEMAND`] is added to `access`.
    ///
    /// # Safety
    ///
    /// Every mapping of the process, now and later, becomes reachable by the device through
    /// the region's keys: with remote rights, a peer holding the rkey can read or write any
    /// memory of the process. Give remote rights only to a fully trusted peer, and never hold
    /// `&`/`&mut` references to memory a peer may write.
    ///
    /// # Errors
    ///
    /// [`Error::OdpUnsupported`] ([`OdpMissing::Implicit`](super::OdpMissing::Implicit)) when
    /// the device does not report implicit ODP (soft-RoCE does not); [`Error::RegMr`].
    pub unsafe fn register_implicit(
        pd: &ProtectionDomain,
        access: AccessFlags,
    ) -> Result<MemoryRegion> {
        let access = access | AccessFlags::ON_DEMAND;
        pd.context()
            .require_odp(access, super::OdpOps::NONE, true)?;
        let flags = i32::try_from(access.bits()).unwrap_or(0);
        // SAFETY: the PD is alive (the MR keeps a clone); a null address with `SIZE_MAX` is the
        // documented implicit-ODP form, which pins nothing; the caller accepts the exposure.
        let mr = unsafe { sys::ibv_reg_mr(pd.as_ptr(), std::ptr::null_mut(), usize::MAX, flags) };
        let mr = NonNull::new(mr).ok_or_else(|| {
            Error::last_os(|source| Error::RegMr {
                len: usize::MAX,
                source,
            })
        })?;
        Ok(MemoryRegion {
            mr,
            access,
            pd: pd.clone(),
        })
    }

    /// Whether the region was registered on demand (ODP, nothing pinned).
    pub fn is_on_demand(&self) -> bool {
        self.access.contains(AccessFlags::ON_DEMAND)
    }

    /// Start address of the region.
    #[inline]
    pub fn addr(&self) -> u64 {
        // SAFETY: the MR is alive; `addr` is a plain field set at registration.
        unsafe { (*self.mr.as_ptr()).addr as u64 }
    }

    /// Length in bytes.
    #[inline]
    pub fn len(&self) -> usize {
        // SAFETY: as above.
        unsafe { (*self.mr.as_ptr()).length }
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The local key, used in scatter/gather entries.
    #[inline]
    pub fn lkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.mr.as_ptr()).lkey }
    }

    /// The remote key. Give it only to peers that should access the region; it is a capability.
    #[inline]
    pub fn rkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.mr.as_ptr()).rkey }
    }

    /// The access rights the region was registered with.
    pub fn access(&self) -> AccessFlags {
        self.access
    }

    /// The protection domain.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: registered in `register`, deregistered exactly once here.
        let rc = unsafe { sys::ibv_dereg_mr(self.mr.as_ptr()) };
        if rc != 0 {
            tracing::warn!(rc, "ibv_dereg_mr failed");
        }
    }
}

impl fmt::Debug for MemoryRegion {
    // The rkey is deliberately not printed.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("access", &self.access)
            .finish_non_exhaustive()
    }
}

/// A page-aligned, zero-initialised allocation registered as one memory region.
///
/// When the region grants remote access, a peer may change the bytes at any time, so the
/// buffer is not readable as `&[u8]` then: use [`read_at`](Self::read_at) /
/// [`write_at`](Self::write_at), which use volatile accesses.
///
/// # Examples
///
/// ```no_run
/// use tokio_rdma::verbs::{AccessFlags, Context, ProtectionDomain, RegisteredBuffer};
/// let ctx = Context::open("rxe0")?;
/// let pd = ProtectionDomain::new(&ctx)?;
/// let mut buf = RegisteredBuffer::new(&pd, 4096, AccessFlags::LOCAL_WRITE)?;
/// buf.as_mut_slice().unwrap()[..5].copy_from_slice(b"hello");
/// let sge = buf.sge(0..5);
/// assert_eq!(sge.length(), 5);
/// # Ok::<(), tokio_rdma::Error>(())
/// ```
pub struct RegisteredBuffer {
    // Declared before `ptr`'s deallocation in Drop: deregister first, then free.
    mr: Option<MemoryRegion>,
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the buffer owns its allocation (a raw pointer only because the device also reaches
// it); moving it to another thread moves that ownership, and the registration handle is Send.
unsafe impl Send for RegisteredBuffer {}
// SAFETY: through `&self` the bytes are only read: `as_slice` (no remote access, so only work
// the caller posted under the unsafe posting contract can write them) and the volatile reads of
// `read_at`/`to_vec`. Every local write takes `&mut self` (`as_mut_slice`, `write_at`), so
// shared references on several threads never race with a local write.
unsafe impl Sync for RegisteredBuffer {}

const PAGE: usize = 4096;

impl RegisteredBuffer {
    /// Allocates `len` zeroed bytes (page aligned) and registers them with `access`
    /// (with [`AccessFlags::ON_DEMAND`]: on demand, nothing pinned).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for `len == 0`; [`Error::OdpUnsupported`],
    /// [`Error::MemlockExhausted`] or [`Error::RegMr`] if registration fails (see
    /// [`MemoryRegion::register`]).
    pub fn new(pd: &ProtectionDomain, len: usize, access: AccessFlags) -> Result<RegisteredBuffer> {
        if len == 0 {
            return Err(Error::InvalidArgument(InvalidArgument::EmptyRegistration));
        }
        let layout = Layout::from_size_align(len, PAGE).map_err(|error| {
            Error::InvalidArgument(InvalidArgument::BufferLayout { len, error })
        })?;
        // SAFETY: `layout` has non-zero size.
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) }).ok_or(Error::InvalidArgument(
            InvalidArgument::AllocationFailed { len },
        ))?;
        // SAFETY: the allocation lives until `Drop`, which deregisters before freeing.
        let mr = unsafe { MemoryRegion::register(pd, ptr.as_ptr(), len, access) };
        match mr {
            Ok(mr) => Ok(RegisteredBuffer {
                mr: Some(mr),
                ptr,
                layout,
            }),
            Err(e) => {
                // SAFETY: allocated above with `layout`, never registered.
                unsafe { dealloc(ptr.as_ptr(), layout) };
                Err(e)
            }
        }
    }

    #[inline]
    fn mr(&self) -> &MemoryRegion {
        self.mr.as_ref().expect("registered until drop")
    }

    /// Length in bytes.
    #[inline]
    pub fn len(&self) -> usize {
        self.layout.size()
    }

    /// Always false: empty buffers cannot be created.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Start address, as the device sees it.
    #[inline]
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// The local key.
    #[inline]
    pub fn lkey(&self) -> u32 {
        self.mr().lkey()
    }

    /// The remote key (a capability: share only with the intended peer).
    #[inline]
    pub fn rkey(&self) -> u32 {
        self.mr().rkey()
    }

    /// The registration's access rights.
    pub fn access(&self) -> AccessFlags {
        self.mr().access()
    }

    /// The memory region (for [`MemoryRegion::prefetch`] of an on-demand buffer).
    pub fn memory_region(&self) -> &MemoryRegion {
        self.mr()
    }

    /// A scatter/gather entry for `range` of this buffer.
    ///
    /// # Panics
    ///
    /// If `range` is out of bounds or longer than `u32::MAX`.
    pub fn sge(&self, range: Range<usize>) -> Sge {
        assert!(
            range.start <= range.end && range.end <= self.len(),
            "range {range:?} out of bounds"
        );
        let len = u32::try_from(range.len()).expect("SGE length fits in u32");
        Sge::new(self.addr() + range.start as u64, len, self.lkey())
    }

    /// The bytes, if no remote access was granted (a peer could otherwise change them under a
    /// shared reference).
    pub fn as_slice(&self) -> Option<&[u8]> {
        if self.access().is_remote() {
            return None;
        }
        // No peer can write it (no remote access); local writes need `&mut self`, excluded by
        // this borrow; device writes come only from work posted under the unsafe contract.
        // SAFETY: `len` bytes owned by `self`, zeroed at creation, so initialised and stable.
        Some(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len()) })
    }

    /// The bytes mutably, if no remote access was granted.
    pub fn as_mut_slice(&mut self) -> Option<&mut [u8]> {
        if self.access().is_remote() {
            return None;
        }
        // SAFETY: as in `as_slice`, and `&mut self` excludes other local references.
        Some(unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len()) })
    }

    /// Copies bytes starting at `offset` into `out` with volatile reads (valid even while a
    /// peer may write the buffer).
    ///
    /// # Panics
    ///
    /// If the range is out of bounds.
    pub fn read_at(&self, offset: usize, out: &mut [u8]) {
        assert!(
            offset
                .checked_add(out.len())
                .is_some_and(|end| end <= self.len()),
            "read out of bounds"
        );
        for (i, b) in out.iter_mut().enumerate() {
            // SAFETY: in bounds (checked above) of an allocation owned by `self`.
            *b = unsafe { self.ptr.as_ptr().add(offset + i).read_volatile() };
        }
    }

    /// Copies `data` into the buffer at `offset` with volatile writes (a peer with remote
    /// access may write the buffer meanwhile). Takes `&mut self`: no slice from
    /// [`as_slice`](Self::as_slice) can be alive while the bytes change under it.
    ///
    /// ```compile_fail
    /// # fn f(buf: &mut tokio_rdma::verbs::RegisteredBuffer) {
    /// let view = buf.as_slice().unwrap();
    /// buf.write_at(0, b"x"); // error: `buf` is already borrowed by `view`
    /// assert_eq!(view[0], b'x');
    /// # }
    /// ```
    ///
    /// # Panics
    ///
    /// If the range is out of bounds.
    pub fn write_at(&mut self, offset: usize, data: &[u8]) {
        assert!(
            offset
                .checked_add(data.len())
                .is_some_and(|end| end <= self.len()),
            "write out of bounds"
        );
        for (i, b) in data.iter().enumerate() {
            // SAFETY: in bounds of our allocation; volatile byte writes do not create
            // references, so concurrent device access is not undefined behaviour in Rust.
            unsafe { self.ptr.as_ptr().add(offset + i).write_volatile(*b) };
        }
    }

    /// A copy of the whole buffer (volatile reads).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0; self.len()];
        self.read_at(0, &mut v);
        v
    }
}

impl Drop for RegisteredBuffer {
    fn drop(&mut self) {
        drop(self.mr.take());
        // SAFETY: allocated with `layout` in `new`; the registration is gone.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

impl fmt::Debug for RegisteredBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegisteredBuffer")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("access", &self.access())
            .finish_non_exhaustive()
    }
}

impl MemoryRegion {
    /// The raw `ibv_mr`, for binding memory windows to this region (`mw.rs`).
    pub(crate) fn as_ptr(&self) -> *mut sys::ibv_mr {
        self.mr.as_ptr()
    }
}
