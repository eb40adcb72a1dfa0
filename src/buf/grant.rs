//! Remote grants: least-privilege, revocable remote access to a range of a buffer.
//!
//! A [`Grant`] takes a buffer by value, opens `range` of it to the peer with exactly the
//! rights asked for ([`RemoteAccess`]: read, write, atomic), and yields a [`RemoteToken`] to
//! send to the peer. Dropping the grant (or [`Grant::revoke`]) closes the access before the
//! buffer is released. Two mechanisms:
//!
//! * **Memory window** ([`GrantKind::Window`]): a type-2 window bound to the range with
//!   `IBV_WR_BIND_MW` on the queue pair the peer uses, revoked by deallocating the window.
//!   Needs a device with type-2 windows that confines accesses to the window
//!   ([`MemoryWindow::bounds_enforced`]) and a buffer whose registration allows `MW_BIND`
//!   (pool buffers do when the device supports windows). soft-RoCE (`rxe`) supports type-2
//!   windows but checks window accesses only against the underlying region's bounds (measured
//!   on Linux 6.1), so it takes the dedicated-registration path.
//! * **Dedicated registration** ([`GrantKind::Region`]): `ibv_reg_mr` of just the range with
//!   just the rights, deregistered on revoke. Works for any buffer on any device.
//!
//! While a grant lives the peer may change the bytes at any time, so the buffer is not
//! reachable as `&[u8]`: local access goes through [`Grant::read_at`] / [`Grant::write_at`]
//! (volatile copies) and [`Grant::load_u64`] (an atomic load). rkeys are never logged, and
//! the token's `Debug` does not show its rkey.

use std::fmt;
use std::mem::ManuallyDrop;
use std::ops::{BitOr, Range};
use std::sync::atomic::{AtomicU64, Ordering};

use super::{IoBufMut, PoolBuf, RemoteToken};
use crate::error::{Error, InvalidArgument, Result, Unsupported};
use crate::verbs::{
    AccessFlags, MemoryRegion, MemoryWindow, ProtectionDomain, QueuePair, WorkCompletion,
    explain_reg_error,
};

/// Remote rights a grant gives: any combination of read, write and atomic.
///
/// # Examples
///
/// ```
/// use tokio_rdma::buf::RemoteAccess;
/// let rw = RemoteAccess::READ | RemoteAccess::WRITE;
/// assert!(rw.contains(RemoteAccess::WRITE) && !rw.contains(RemoteAccess::ATOMIC));
/// assert_eq!(format!("{rw:?}"), "RemoteAccess(READ | WRITE)");
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct RemoteAccess(u8);

impl RemoteAccess {
    /// The peer may RDMA READ.
    pub const READ: RemoteAccess = RemoteAccess(1);
    /// The peer may RDMA WRITE.
    pub const WRITE: RemoteAccess = RemoteAccess(2);
    /// The peer may perform atomics (8-byte aligned words).
    pub const ATOMIC: RemoteAccess = RemoteAccess(4);
    /// Not a right but how the grant is registered: on demand
    /// ([`AccessFlags::ON_DEMAND`], ODP), pinning nothing; the peer's accesses fault pages in
    /// (pages never touched, dropped with `MADV_DONTNEED`, or of a file mapping) and follow the
    /// mapping if it is replaced. Always a dedicated registration ([`GrantKind::Region`]).
    /// Needs a device with ODP for the rights asked
    /// ([`Endpoint::odp_caps`](crate::Endpoint::odp_caps)), else the grant fails with
    /// [`Error::OdpUnsupported`]. An access to a page that is not mapped fails the peer's
    /// operation (and, RC being what it is, its connection).
    ///
    /// # Examples
    ///
    /// ```
    /// use tokio_rdma::buf::RemoteAccess;
    /// let odp = RemoteAccess::READ | RemoteAccess::ON_DEMAND;
    /// assert!(!odp.is_empty() && !odp.can_modify());
    /// assert!((RemoteAccess::ON_DEMAND).is_empty()); // no right
    /// ```
    pub const ON_DEMAND: RemoteAccess = RemoteAccess(8);

    const RIGHTS: u8 = 7;

    /// Whether every right in `other` is in `self`.
    pub fn contains(self, other: RemoteAccess) -> bool {
        self.0 & other.0 == other.0
    }

    /// Whether no right is set ([`ON_DEMAND`](Self::ON_DEMAND) is not one).
    pub fn is_empty(self) -> bool {
        self.0 & Self::RIGHTS == 0
    }

    /// The verbs remote access flags for these rights.
    pub fn to_flags(self) -> AccessFlags {
        let mut f = AccessFlags::NONE;
        if self.contains(Self::READ) {
            f |= AccessFlags::REMOTE_READ;
        }
        if self.contains(Self::WRITE) {
            f |= AccessFlags::REMOTE_WRITE;
        }
        if self.contains(Self::ATOMIC) {
            f |= AccessFlags::REMOTE_ATOMIC;
        }
        if self.contains(Self::ON_DEMAND) {
            f |= AccessFlags::ON_DEMAND;
        }
        f
    }

    /// Whether the peer may change the bytes (write or atomic).
    pub fn can_modify(self) -> bool {
        self.0 & (Self::WRITE.0 | Self::ATOMIC.0) != 0
    }
}

impl BitOr for RemoteAccess {
    type Output = RemoteAccess;
    fn bitor(self, rhs: RemoteAccess) -> RemoteAccess {
        RemoteAccess(self.0 | rhs.0)
    }
}

impl fmt::Debug for RemoteAccess {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // One spelling, shared with the error messages that name rights (the error layer,
        // below this one, carries them as verbs flags).
        f.write_str(&crate::error::remote_access_debug(self.to_flags()))
    }
}

/// How a grant is enforced.
///
/// # Examples
///
/// ```no_run
/// # use tokio_rdma::buf::{Grant, GrantKind, RemoteAccess};
/// # fn f(pd: &tokio_rdma::verbs::ProtectionDomain) -> tokio_rdma::Result<()> {
/// let g = Grant::region(pd, vec![0u8; 64], 0..64, RemoteAccess::READ)?;
/// assert_eq!(g.kind(), GrantKind::Region);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GrantKind {
    /// A type-2 memory window bound on a queue pair.
    Window,
    /// A dedicated memory region covering only the granted range.
    Region,
}

/// Buffers that can be granted: any [`IoBufMut`]; those registered with `MW_BIND` (pool
/// buffers on devices with type-2 windows) can also be granted through a memory window.
///
/// # Examples
///
/// ```
/// use tokio_rdma::buf::GrantBuf;
/// assert!(vec![0u8; 16].window_region().is_none()); // plain memory: dedicated MR only
/// ```
pub trait GrantBuf: IoBufMut {
    /// The registration a memory window can be bound to, if any.
    fn window_region(&self) -> Option<&MemoryRegion> {
        None
    }
}

impl GrantBuf for Vec<u8> {}
impl GrantBuf for bytes::BytesMut {}
impl GrantBuf for PoolBuf {
    fn window_region(&self) -> Option<&MemoryRegion> {
        PoolBuf::window_region(self)
    }
}

/// What enforces the grant; held only for its `Drop`, which revokes.
#[allow(dead_code)]
enum Key {
    Window(MemoryWindow),
    Region(MemoryRegion),
}

/// Remote access to `range` of a buffer, revoked on drop. Design notes: `docs/memory.md`.
///
/// **The token works only through queue pairs of the grant's protection domain.** For a peer
/// on a [`Connection`](crate::conn::Connection), grant with
/// [`Connection::grant`](crate::conn::Connection::grant): each connection has its own
/// protection domain, so a grant made here on a `ProtectionDomain` of your own (or on another
/// connection) gives a token the peer can never use; its access fails with
/// `IBV_WC_REM_ACCESS_ERR` and kills its connection, and nothing on this side can notice. Use
/// `Grant` directly with queue pairs you made yourself, in the same domain.
///
/// # Examples
///
/// ```no_run
/// use tokio_rdma::buf::{Grant, RemoteAccess};
/// # fn f(pd: &tokio_rdma::verbs::ProtectionDomain) -> tokio_rdma::Result<()> {
/// let grant = Grant::region(pd, vec![0u8; 4096], 1024..2048, RemoteAccess::WRITE)?;
/// let token = grant.token(); // send to the peer (`token.to_bytes()`)
/// // ... the peer RDMA-writes into it ...
/// let mut seen = [0u8; 16];
/// grant.read_at(1024, &mut seen);
/// let buf: Vec<u8> = grant.revoke(); // the token stops working before the buffer returns
/// # let _ = (token, buf); Ok(()) }
/// ```
pub struct Grant<B: IoBufMut> {
    key: Option<Key>,
    buf: Option<B>,
    ptr: *mut u8,
    init: usize,
    range: Range<usize>,
    access: RemoteAccess,
    token: RemoteToken,
}

// SAFETY: the grant owns the buffer; the raw pointer points into it.
unsafe impl<B: IoBufMut + Send> Send for Grant<B> {}
// SAFETY: `&Grant` only reads the bytes (volatile/atomic loads); writes need `&mut`.
unsafe impl<B: IoBufMut + Sync> Sync for Grant<B> {}

/// Checks `range` against `buf` and returns the buffer's pointer and initialised length.
fn prepare<B: IoBufMut>(
    buf: &mut B,
    range: &Range<usize>,
    access: RemoteAccess,
) -> Result<(*mut u8, usize)> {
    let init = buf.bytes_init();
    if access.is_empty() {
        return Err(Error::InvalidArgument(InvalidArgument::GrantWithoutRights));
    }
    if range.start >= range.end || range.end > init {
        return Err(Error::InvalidArgument(InvalidArgument::GrantRange {
            range: range.clone(),
            init,
        }));
    }
    Ok((buf.stable_mut_ptr(), init))
}

impl<B: IoBufMut> Grant<B> {
    /// Grants `access` to `range` of `buf` through a dedicated registration in `pd` of just
    /// that range with just those rights (plus `LOCAL_WRITE` when the peer may write, as the
    /// verbs require).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for no rights or a range that is empty or not within the
    /// buffer's initialised bytes; registration errors ([`Error::MemlockExhausted`], ...;
    /// [`Error::OdpUnsupported`] for [`RemoteAccess::ON_DEMAND`] on a device without ODP).
    pub fn region(
        pd: &ProtectionDomain,
        mut buf: B,
        range: Range<usize>,
        access: RemoteAccess,
    ) -> Result<Grant<B>> {
        let (ptr, init) = prepare(&mut buf, &range, access)?;
        let mut flags = access.to_flags();
        if access.can_modify() {
            flags |= AccessFlags::LOCAL_WRITE;
        }
        // SAFETY: `range.start < init`, inside the buffer's allocation.
        let start = unsafe { ptr.add(range.start) };
        // SAFETY: the grant owns `buf`, whose memory is stable while it lives, and drops the
        // region before releasing the buffer; it never exposes the bytes as references.
        let mr = unsafe { MemoryRegion::register(pd, start, range.len(), flags) }
            .map_err(explain_reg_error)?;
        tracing::debug!(
            len = range.len(),
            ?access,
            "granted remote access (dedicated MR)"
        );
        let token = RemoteToken::new(start as u64, range.len() as u64, mr.rkey());
        Ok(Grant {
            key: Some(Key::Region(mr)),
            buf: Some(buf),
            ptr,
            init,
            range,
            access,
            token,
        })
    }
}

impl<B: GrantBuf> Grant<B> {
    /// Grants `access` to `range` of `buf` the best way available: a memory window bound on
    /// `qp` when the device supports type-2 windows, enforces their bounds, and the buffer's
    /// registration allows binding,
    /// else a dedicated registration in `qp`'s protection domain. See [`Grant::window`] for
    /// `wr_id` and `wait` (unused on the registration path).
    ///
    /// # Errors
    ///
    /// As [`Grant::window`] or [`Grant::region`].
    pub fn new(
        qp: &QueuePair,
        buf: B,
        range: Range<usize>,
        access: RemoteAccess,
        wr_id: u64,
        wait: impl FnOnce(u64) -> Result<WorkCompletion>,
    ) -> Result<Grant<B>> {
        let ctx = qp.pd().context();
        let windows = ctx.device_attr().supports_mw_type2() && MemoryWindow::bounds_enforced(ctx);
        // A driven queue pair's work requests belong to its driver: no bind posted by hand.
        if windows
            && !qp.is_driven()
            && buf.window_region().is_some()
            && !access.contains(RemoteAccess::ON_DEMAND)
        {
            Grant::window(qp, buf, range, access, wr_id, wait)
        } else {
            Grant::region(qp.pd(), buf, range, access)
        }
    }

    /// Grants `access` to `range` of `buf` through a type-2 memory window bound on `qp`: the
    /// bind is posted (signaled, id `wr_id`) and `wait(wr_id)` must return its work completion
    /// (for example by polling `qp`'s send CQ, or from the async engine). The peer must use
    /// `qp`'s connection: type-2 windows are tied to the queue pair they were bound on.
    ///
    /// If `wait` fails, the bind's outcome is unknown: the window and the buffer are then
    /// leaked (never reused) rather than risk a late bind exposing reused memory.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] if the device lacks type-2 windows, does not enforce window
    /// bounds ([`MemoryWindow::bounds_enforced`]: soft-RoCE), or the buffer has no `MW_BIND`
    /// registration; [`Error::InvalidArgument`] for a bad range;
    /// [`Error::AllocMw`], [`Error::BindMw`]; [`Error::QpFailed`] with the work completion's status if the bind failed
    /// (which also moves `qp` to the error state); `wait`'s error.
    pub fn window(
        qp: &QueuePair,
        mut buf: B,
        range: Range<usize>,
        access: RemoteAccess,
        wr_id: u64,
        wait: impl FnOnce(u64) -> Result<WorkCompletion>,
    ) -> Result<Grant<B>> {
        let ctx = qp.pd().context();
        if qp.is_driven() {
            // The bind's completion would reach the driver's table under `wr_id`, resolving
            // (or corrupting) whichever operation holds that id.
            return Err(Error::DriverOwned("queue pair"));
        }
        if access.contains(RemoteAccess::ON_DEMAND) {
            return Err(Error::InvalidArgument(InvalidArgument::OnDemandWindow));
        }
        if !ctx.device_attr().supports_mw_type2() {
            return Err(Error::Unsupported(Unsupported::NoMwType2 {
                device: ctx.name().to_string(),
            }));
        }
        if !MemoryWindow::bounds_enforced(ctx) {
            return Err(Error::Unsupported(Unsupported::WindowBoundsNotEnforced {
                device: ctx.name().to_string(),
            }));
        }
        let (ptr, init) = prepare(&mut buf, &range, access)?;
        let Some(mr) = buf.window_region() else {
            return Err(Error::Unsupported(Unsupported::NoMwBindRegistration));
        };
        let mw = MemoryWindow::alloc_type2(qp.pd())?;
        let addr = ptr as u64 + range.start as u64;
        // SAFETY: `qp` is not driven (checked above), so the bind's completion comes back
        // through `wait`. `mw` and `mr` (owned by `buf`) stay alive until `wait` returns that
        // completion, and both are leaked if it never comes. Once bound, the window is
        // deallocated (Drop of `Grant`) before the buffer is released, and the granted bytes
        // are only reached locally through raw volatile accesses (`read_at`/`write_at`), never
        // as references, while the window lives.
        let rkey =
            unsafe { mw.post_bind(qp, wr_id, mr, addr, range.len() as u64, access.to_flags())? };
        let wc = match wait(wr_id) {
            Ok(wc) => wc,
            Err(e) => {
                tracing::warn!(error = %e, "memory window bind not observed; leaking the window and its buffer");
                std::mem::forget(mw);
                let _ = ManuallyDrop::new(buf);
                return Err(e);
            }
        };
        if wc.wr_id() != wr_id {
            // Not the bind's completion: its outcome is unknown, so the window may still be
            // bound later. Leak rather than release memory a peer might reach.
            tracing::warn!(
                expected = wr_id,
                got = wc.wr_id(),
                "memory window bind: `wait` returned another request's completion; leaking the window and its buffer"
            );
            std::mem::forget(mw);
            let _ = ManuallyDrop::new(buf);
            return Err(Error::InvalidArgument(InvalidArgument::ForeignCompletion {
                got: wc.wr_id(),
                expected: wr_id,
            }));
        }
        wc.result()?;
        tracing::debug!(
            len = range.len(),
            ?access,
            "granted remote access (memory window)"
        );
        Ok(Grant {
            key: Some(Key::Window(mw)),
            buf: Some(buf),
            ptr,
            init,
            token: RemoteToken::new(addr, range.len() as u64, rkey),
            range,
            access,
        })
    }
}

impl<B: IoBufMut> Grant<B> {
    /// The token to give the peer: address, length and rkey of the granted range.
    pub fn token(&self) -> RemoteToken {
        self.token
    }

    /// How the grant is enforced.
    pub fn kind(&self) -> GrantKind {
        match self.key {
            Some(Key::Window(_)) => GrantKind::Window,
            _ => GrantKind::Region,
        }
    }

    /// The granted rights.
    pub fn access(&self) -> RemoteAccess {
        self.access
    }

    /// The granted range of the buffer.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// Bytes of the buffer accessible locally through the grant (its initialised length).
    pub fn buf_len(&self) -> usize {
        self.init
    }

    fn check(&self, offset: usize, len: usize, what: &str) {
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.init),
            "{what} of {len} bytes at {offset} is out of bounds of {} bytes",
            self.init
        );
    }

    /// Copies the buffer's bytes at `offset` (any part of the buffer, granted or not) into
    /// `out` with volatile reads, which are sound while the peer may write.
    ///
    /// # Panics
    ///
    /// If the range exceeds the buffer's initialised bytes.
    pub fn read_at(&self, offset: usize, out: &mut [u8]) {
        self.check(offset, out.len(), "read");
        for (i, b) in out.iter_mut().enumerate() {
            // SAFETY: in bounds of the owned, initialised buffer (checked above); a volatile
            // read creates no reference the device's writes could invalidate.
            *b = unsafe { self.ptr.add(offset + i).read_volatile() };
        }
    }

    /// Copies `data` into the buffer at `offset` with volatile writes.
    ///
    /// # Panics
    ///
    /// If the range exceeds the buffer's initialised bytes.
    pub fn write_at(&mut self, offset: usize, data: &[u8]) {
        self.check(offset, data.len(), "write");
        for (i, b) in data.iter().enumerate() {
            // SAFETY: in bounds (checked above); `&mut self` excludes other local access.
            unsafe { self.ptr.add(offset + i).write_volatile(*b) };
        }
    }

    /// Atomically loads the native-endian `u64` at `offset` (8-byte aligned), e.g. a counter
    /// the peer updates with RDMA atomics.
    ///
    /// # Panics
    ///
    /// If out of bounds or not 8-byte aligned.
    pub fn load_u64(&self, offset: usize) -> u64 {
        self.check(offset, 8, "load");
        // SAFETY: in bounds (checked above).
        let p = unsafe { self.ptr.add(offset) };
        assert!(p as usize % 8 == 0, "offset {offset} is not 8-byte aligned");
        // SAFETY: aligned, in bounds, and only ever accessed locally through volatile/atomic
        // operations while the grant lives.
        unsafe { AtomicU64::from_ptr(p.cast()) }.load(Ordering::Acquire)
    }

    /// Revokes the grant (the token stops working) and gives the buffer back.
    pub fn revoke(mut self) -> B {
        self.close();
        self.buf.take().expect("buffer present until revoked")
    }

    fn close(&mut self) {
        if let Some(key) = self.key.take() {
            drop(key);
            tracing::debug!(len = self.range.len(), "revoked remote grant");
        }
    }
}

impl<B: IoBufMut> Drop for Grant<B> {
    fn drop(&mut self) {
        // Revoke first; the buffer (dropped after this) is then no longer remotely reachable.
        self.close();
    }
}

impl<B: IoBufMut> fmt::Debug for Grant<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Grant")
            .field("kind", &self.kind())
            .field("access", &self.access)
            .field("range", &self.range)
            .field("token", &self.token)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_flags_are_least_privilege() {
        assert_eq!(RemoteAccess::READ.to_flags(), AccessFlags::REMOTE_READ);
        let w = RemoteAccess::WRITE.to_flags();
        assert!(w.contains(AccessFlags::REMOTE_WRITE) && !w.contains(AccessFlags::REMOTE_READ));
        assert!(!RemoteAccess::READ.can_modify());
        assert!(RemoteAccess::ATOMIC.can_modify());
        assert!(RemoteAccess::default().is_empty());
        assert_eq!(
            format!("{:?}", RemoteAccess::default()),
            "RemoteAccess(NONE)"
        );
    }

    #[test]
    fn ranges_are_checked_before_any_verb() {
        let mut v = Vec::with_capacity(64);
        v.extend_from_slice(&[0u8; 32]);
        assert!(prepare(&mut v, &(0..32), RemoteAccess::READ).is_ok());
        assert!(
            prepare(&mut v, &(0..33), RemoteAccess::READ).is_err(),
            "beyond len"
        );
        assert!(
            prepare(&mut v, &(4..4), RemoteAccess::READ).is_err(),
            "empty"
        );
        assert!(
            prepare(&mut v, &(0..8), RemoteAccess::default()).is_err(),
            "no rights"
        );
    }
}
