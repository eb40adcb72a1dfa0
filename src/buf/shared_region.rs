//! One buffer opened to many peers: a [`SharedRegion`] is registered once per connection
//! that is granted access to it ([`SharedGrant`], each in its connection's own protection
//! domain, each revocable on its own), so a table served to N clients by one-sided reads
//! exists once in memory, not N times.
//!
//! The same pages may be registered in several protection domains: each registration pins
//! them and gets its own rkey, valid only on the connections of its domain, so the isolation
//! between peers stays what it is for [`Grant`](super::Grant)s.
//!
//! The memory is 8-byte words that the application only ever touches through atomic loads
//! and stores (no `&[u8]` to it exists), because the peers may read and write it at any time.
//! That also makes the region `Sync`: several tasks may update it at once.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use super::{RemoteAccess, RemoteToken};
use crate::error::{Error, InvalidArgument, Result};
use crate::verbs::{AccessFlags, MemoryRegion, ProtectionDomain, explain_reg_error};

/// A zeroed buffer that several connections may be granted access to at once, without a
/// copy per connection: [`Connection::grant_shared`](crate::conn::Connection::grant_shared)
/// registers it in that connection's protection domain and returns a [`SharedGrant`] whose
/// token works only there. Cloning is cheap (a reference count); the memory is freed when the
/// last clone and the last grant are gone.
///
/// Local access is by copies ([`read_at`](Self::read_at), [`write_at`](Self::write_at)) and
/// 8-byte atomics ([`load_u64`](Self::load_u64), [`store_u64`](Self::store_u64)): a peer
/// reading a row while this side rewrites it can see it half written, so a reader needs a
/// way to tell (a version per row, see `examples/rowstore.rs` and docs/memory.md).
///
/// # Examples
///
/// ```no_run
/// use tokio_rdma::buf::{RemoteAccess, SharedRegion};
/// # async fn demo(a: tokio_rdma::conn::Connection, b: tokio_rdma::conn::Connection)
/// # -> tokio_rdma::Result<()> {
/// let table = SharedRegion::new(1 << 20);
/// table.write_at(0, b"row zero");
/// let to_a = a.grant_shared(&table, 0..table.len(), RemoteAccess::READ)?;
/// let to_b = b.grant_shared(&table, 0..table.len(), RemoteAccess::READ)?;
/// a.send(&to_a.token().to_bytes()).await?;
/// b.send(&to_b.token().to_bytes()).await?;
/// drop(to_a); // a's peer loses access; b's keeps it
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct SharedRegion {
    inner: Arc<Inner>,
}

struct Inner {
    words: Box<[AtomicU64]>,
    len: usize,
    grants: AtomicUsize,
}

impl SharedRegion {
    /// A zeroed region of `len` bytes (at least 1; the allocation is rounded up to 8 bytes and
    /// 8-byte aligned).
    ///
    /// # Panics
    ///
    /// If `len` is 0.
    pub fn new(len: usize) -> SharedRegion {
        assert!(len > 0, "a shared region needs at least one byte");
        let words = (0..len.div_ceil(8)).map(|_| AtomicU64::new(0)).collect();
        SharedRegion {
            inner: Arc::new(Inner {
                words,
                len,
                grants: AtomicUsize::new(0),
            }),
        }
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// Always false: a region has at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }

    fn ptr(&self) -> *mut u8 {
        self.inner.words.as_ptr().cast_mut().cast()
    }

    fn check(&self, offset: usize, len: usize, what: &str) {
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.len()),
            "{what} of {len} bytes at {offset} is out of bounds of {} bytes",
            self.len()
        );
    }

    /// Copies the bytes at `offset` into `out` (word by word, with relaxed atomic loads).
    ///
    /// # Panics
    ///
    /// If the range exceeds the region.
    pub fn read_at(&self, offset: usize, out: &mut [u8]) {
        self.check(offset, out.len(), "read");
        let mut done = 0;
        while done < out.len() {
            let at = offset + done;
            let (w, skip) = (at / 8, at % 8);
            let n = (8 - skip).min(out.len() - done);
            let word = self.inner.words[w].load(Ordering::Relaxed).to_ne_bytes();
            out[done..done + n].copy_from_slice(&word[skip..skip + n]);
            done += n;
        }
    }

    /// Copies `data` into the region at `offset`: whole words with release stores, partial
    /// words with a compare-and-swap of the bytes around them, so concurrent local writers of
    /// neighbouring bytes never lose each other's bytes.
    ///
    /// # Panics
    ///
    /// If the range exceeds the region.
    pub fn write_at(&self, offset: usize, data: &[u8]) {
        self.check(offset, data.len(), "write");
        let mut done = 0;
        while done < data.len() {
            let at = offset + done;
            let (w, skip) = (at / 8, at % 8);
            let n = (8 - skip).min(data.len() - done);
            let part = &data[done..done + n];
            if n == 8 {
                let word = u64::from_ne_bytes(part.try_into().expect("8 bytes"));
                self.inner.words[w].store(word, Ordering::Release);
            } else {
                let _ =
                    self.inner.words[w].fetch_update(Ordering::Release, Ordering::Relaxed, |old| {
                        let mut b = old.to_ne_bytes();
                        b[skip..skip + n].copy_from_slice(part);
                        Some(u64::from_ne_bytes(b))
                    });
            }
            done += n;
        }
    }

    /// Atomically loads the native-endian `u64` at `offset` (a multiple of 8), with acquire
    /// ordering.
    ///
    /// # Panics
    ///
    /// If out of bounds or not a multiple of 8.
    pub fn load_u64(&self, offset: usize) -> u64 {
        self.word(offset).load(Ordering::Acquire)
    }

    /// Atomically stores the native-endian `u64` at `offset` (a multiple of 8), with release
    /// ordering: every write before it is visible before it.
    ///
    /// # Panics
    ///
    /// If out of bounds or not a multiple of 8.
    pub fn store_u64(&self, offset: usize, value: u64) {
        self.word(offset).store(value, Ordering::Release);
    }

    fn word(&self, offset: usize) -> &AtomicU64 {
        self.check(offset, 8, "u64 access");
        assert!(offset % 8 == 0, "offset {offset} is not a multiple of 8");
        &self.inner.words[offset / 8]
    }

    /// The number of grants on this region alive now.
    pub fn grants(&self) -> usize {
        self.inner.grants.load(Ordering::Relaxed)
    }

    /// Registers `range` of the region in `pd` for `access` by the peers of that domain's
    /// connections: what `Connection::grant_shared` calls with its own domain.
    pub(crate) fn grant(
        &self,
        pd: &ProtectionDomain,
        range: Range<usize>,
        access: RemoteAccess,
    ) -> Result<SharedGrant> {
        if access.is_empty() || access.contains(RemoteAccess::ON_DEMAND) {
            return Err(Error::InvalidArgument(InvalidArgument::SharedGrantRights {
                access: access.to_flags(),
            }));
        }
        if range.start >= range.end || range.end > self.len() {
            return Err(Error::InvalidArgument(InvalidArgument::SharedGrantRange {
                range,
                region_len: self.len(),
            }));
        }
        let mut flags = access.to_flags();
        if access.can_modify() {
            flags |= AccessFlags::LOCAL_WRITE;
        }
        // SAFETY: `range.start < len`, inside the allocation.
        let start = unsafe { self.ptr().add(range.start) };
        // SAFETY: the grant keeps a clone of the region, so the memory stays allocated and in
        // place until after the registration is dropped (field order of `SharedGrant`); the
        // application reaches the bytes only through atomics, so the device's accesses never
        // invalidate a reference.
        let mr = unsafe { MemoryRegion::register(pd, start, range.len(), flags) }
            .map_err(explain_reg_error)?;
        let token = RemoteToken::new(start as u64, range.len() as u64, mr.rkey());
        tracing::debug!(
            len = range.len(),
            ?access,
            "granted remote access to a shared region"
        );
        self.inner.grants.fetch_add(1, Ordering::Relaxed);
        Ok(SharedGrant {
            mr,
            region: GrantHold(self.clone()),
            range,
            access,
            token,
        })
    }
}

impl fmt::Debug for SharedRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedRegion")
            .field("addr", &self.ptr())
            .field("len", &self.len())
            .field("grants", &self.grants())
            .finish_non_exhaustive()
    }
}

/// A grant's hold on its region: counts the grant while it lives.
struct GrantHold(SharedRegion);

impl Drop for GrantHold {
    fn drop(&mut self) {
        self.0.inner.grants.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One connection's access to a [`SharedRegion`]: a registration of the granted range in that
/// connection's protection domain with exactly the rights asked for. Dropping it (or
/// [`revoke`](Self::revoke)) revokes this connection's access only; the region and the other
/// grants stay.
pub struct SharedGrant {
    /// Declared first: deregistered before the region may be freed.
    mr: MemoryRegion,
    region: GrantHold,
    range: Range<usize>,
    access: RemoteAccess,
    token: RemoteToken,
}

impl SharedGrant {
    /// The token to give the peer: address, length and rkey of the granted range.
    pub fn token(&self) -> RemoteToken {
        self.token
    }

    /// The granted rights.
    pub fn access(&self) -> RemoteAccess {
        self.access
    }

    /// The granted range of the region.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// The region.
    pub fn region(&self) -> &SharedRegion {
        &self.region.0
    }

    /// Revokes the access now (the peer's next access fails); the same as dropping it.
    pub fn revoke(self) {
        drop(self);
    }
}

impl fmt::Debug for SharedGrant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedGrant")
            .field("range", &self.range)
            .field("access", &self.access)
            .field("lkey", &self.mr.lkey())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_in_and_out_at_any_offset_and_length() {
        let r = SharedRegion::new(37);
        assert_eq!(r.len(), 37);
        let data: Vec<u8> = (1..=37).collect();
        for start in 0..37 {
            for len in 0..=(37 - start) {
                let z = SharedRegion::new(37);
                z.write_at(start, &data[..len]);
                let mut all = [0u8; 37];
                z.read_at(0, &mut all);
                let mut want = [0u8; 37];
                want[start..start + len].copy_from_slice(&data[..len]);
                assert_eq!(all, want, "write of {len} at {start}");
                let mut part = vec![0u8; len];
                z.read_at(start, &mut part);
                assert_eq!(part, &data[..len]);
            }
        }
        r.store_u64(24, u64::MAX);
        assert_eq!(r.load_u64(24), u64::MAX);
        let mut word = [0u8; 8];
        r.read_at(24, &mut word);
        assert_eq!(word, [0xff; 8]);
        let last = std::panic::catch_unwind(|| r.load_u64(32));
        assert!(
            last.is_err(),
            "the word holding the last 5 bytes reaches past the end"
        );
    }

    #[test]
    fn neighbouring_bytes_written_from_many_threads_are_all_kept() {
        let r = SharedRegion::new(64);
        std::thread::scope(|s| {
            for t in 0..8u8 {
                let r = &r;
                s.spawn(move || {
                    for round in 0..2000u32 {
                        // Thread t owns bytes t, t+8, ... : every word is shared by 8 threads.
                        for i in (usize::from(t)..64).step_by(8) {
                            r.write_at(i, &[t.wrapping_add(round as u8)]);
                        }
                    }
                    for i in (usize::from(t)..64).step_by(8) {
                        r.write_at(i, &[t + 100]);
                    }
                });
            }
        });
        let mut all = [0u8; 64];
        r.read_at(0, &mut all);
        for (i, b) in all.iter().enumerate() {
            assert_eq!(*b, (i % 8) as u8 + 100, "byte {i}");
        }
    }

    #[test]
    #[should_panic(expected = "out of bounds")]
    fn a_read_past_the_end_panics() {
        SharedRegion::new(10).read_at(8, &mut [0u8; 3]);
    }

    #[test]
    #[should_panic(expected = "not a multiple of 8")]
    fn an_unaligned_u64_panics() {
        SharedRegion::new(16).load_u64(4);
    }
}
