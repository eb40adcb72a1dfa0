//! One-sided operations on a [`Connection`], checked locally before anything is posted: an
//! operation the peer did not offer, one outside the token, or local memory registered in
//! another protection domain would fail on the device and kill the connection on both sides,
//! so it fails here instead and the connection lives on.

use super::connection::Connection;
use crate::buf::{IoBufMut, Pool, RemoteToken};
use crate::error::{Error, InvalidArgument, Result};
use crate::ops::{SgSource, SgTarget};
use crate::proto::SgList;

/// Refuses entries that do not lie in `pool` (the only memory a user can have registered in a
/// connection's protection domain); no pool yet means no such memory at all.
fn check_local(sges: &SgList, pool: Option<&Pool>) -> Result<()> {
    match pool {
        Some(p) if sges.as_slice().iter().all(|s| p.covers(s)) => Ok(()),
        _ if sges.as_slice().is_empty() => Ok(()),
        _ => Err(Error::InvalidArgument(InvalidArgument::ForeignLocalBuffer)),
    }
}

impl Connection {
    fn check_offer(&self, atomics: bool) -> Result<()> {
        let p = &self.shared.params;
        if atomics && !p.peer_atomics {
            return Err(Error::InvalidArgument(InvalidArgument::PeerNoAtomics));
        }
        if !atomics && !p.peer_one_sided {
            return Err(Error::InvalidArgument(InvalidArgument::PeerNoOneSided));
        }
        Ok(())
    }

    fn check_source<B: SgSource>(&self, buf: &B) -> Result<()> {
        let mut l = SgList::new();
        buf.source_segments(&mut l)?;
        check_local(&l, self.user_pool.get())
    }

    fn check_target<B: SgTarget>(&self, buf: &mut B) -> Result<()> {
        let mut l = SgList::new();
        buf.target_segments(&mut l)?;
        check_local(&l, self.user_pool.get())
    }

    /// Writes `buf` (registered memory, e.g. from [`pool`](Self::pool)) into the peer's
    /// memory at `remote`, a token the peer granted on this connection.
    ///
    /// # Errors
    ///
    /// Locally, before posting: [`Error::InvalidArgument`] if the peer did not offer
    /// one-sided access, `buf` does not fit in `remote`, or `buf` is not memory of this
    /// connection's [`pool`](Self::pool) (memory registered in any other protection domain,
    /// such as another connection's pool, would fail on the device). From the device: the work
    /// completion's status (e.g. `IBV_WC_REM_ACCESS_ERR` for a revoked or foreign token),
    /// which also fails the connection.
    ///
    /// # Cancel safety
    ///
    /// Dropped before its first poll, nothing is written; later, the write may still happen
    /// and the buffer is released once the device is done with it.
    pub async fn write<B: SgSource>(&self, buf: B, remote: RemoteToken) -> (Result<()>, B) {
        if let Err(e) = self
            .check_offer(false)
            .and_then(|()| self.check_source(&buf))
        {
            return (Err(e), buf);
        }
        self.shared.qp.write(buf, remote).await
    }

    /// Reads the peer's memory at the start of `remote` into `buf`: as many bytes as `buf`'s
    /// length, which for a pool buffer is what [`Pool::acquire`] asked for (not its size
    /// class's capacity: [`PoolBuf::set_len`](crate::buf::PoolBuf::set_len) first to read
    /// more). `buf` must come from this connection's [`pool`](Self::pool) (a plain `Vec` has
    /// no registration, and memory registered elsewhere is refused) and fit in `remote`.
    ///
    /// # Errors
    ///
    /// As [`write`](Self::write).
    ///
    /// # Cancel safety
    ///
    /// Dropped after its first poll, the device may still write into the buffer, which is
    /// released once the read completes.
    pub async fn read<B: SgTarget>(&self, mut buf: B, remote: RemoteToken) -> (Result<()>, B) {
        if let Err(e) = self
            .check_offer(false)
            .and_then(|()| self.check_target(&mut buf))
        {
            return (Err(e), buf);
        }
        self.shared.qp.read(buf, remote).await
    }

    /// Atomic compare-and-swap on the peer's 8-byte value at `remote` (8-byte aligned);
    /// resolves with the previous value, also written into `buf`.
    ///
    /// # Errors
    ///
    /// Locally: [`Error::InvalidArgument`] if the peer did not offer atomics, `remote` is
    /// not an aligned 8-byte range of the token, or `buf` is not from this connection's
    /// [`pool`](Self::pool). From the device: as [`write`](Self::write).
    ///
    /// # Cancel safety
    ///
    /// Once polled, the swap may still happen.
    pub async fn compare_swap<B: IoBufMut>(
        &self,
        mut buf: B,
        remote: RemoteToken,
        compare: u64,
        swap: u64,
    ) -> (Result<u64>, B) {
        if let Err(e) = self
            .check_offer(true)
            .and_then(|()| self.check_target(&mut buf))
        {
            return (Err(e), buf);
        }
        self.shared
            .qp
            .compare_swap(buf, remote, compare, swap)
            .await
    }

    /// Atomic fetch-and-add on the peer's 8-byte value at `remote` (8-byte aligned);
    /// resolves with the previous value.
    ///
    /// # Errors
    ///
    /// As [`compare_swap`](Self::compare_swap).
    ///
    /// # Cancel safety
    ///
    /// Once polled, the addition may still happen.
    pub async fn fetch_add<B: IoBufMut>(
        &self,
        mut buf: B,
        remote: RemoteToken,
        add: u64,
    ) -> (Result<u64>, B) {
        if let Err(e) = self
            .check_offer(true)
            .and_then(|()| self.check_target(&mut buf))
        {
            return (Err(e), buf);
        }
        self.shared.qp.fetch_add(buf, remote, add).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buf::fake::FakeRegistrar;
    use crate::buf::{PoolConfig, SizeClass};

    fn pool(reg: &FakeRegistrar) -> Pool {
        let config =
            PoolConfig::default().classes([SizeClass::new(4096, 4), SizeClass::new(65536, 2)]);
        Pool::new(reg, config).unwrap()
    }

    fn segments<B: SgSource>(buf: &B) -> SgList {
        let mut l = SgList::new();
        buf.source_segments(&mut l).unwrap();
        l
    }

    #[test]
    fn memory_of_another_pool_is_refused_before_posting() {
        // Two pools on one registrar stand for two protection domains (two connections).
        let reg = FakeRegistrar::default();
        let (own, other) = (pool(&reg), pool(&reg));
        let mine = own.try_acquire(4096).unwrap().unwrap();
        let theirs = other.try_acquire(100).unwrap().unwrap();
        assert!(check_local(&segments(&mine), Some(&own)).is_ok());
        let err = check_local(&segments(&theirs), Some(&own)).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        assert!(err.to_string().contains("conn.pool()"), "{err}");
        // No pool yet: no memory can be in the connection's domain.
        assert!(check_local(&segments(&mine), None).is_err());
        // A slice of a pool buffer is still that pool's memory; a list with one foreign
        // entry is refused.
        let big = own.try_acquire(65536).unwrap().unwrap();
        assert!(
            check_local(
                &segments(&crate::buf::IoBuf::slice(big, 100..200)),
                Some(&own)
            )
            .is_ok()
        );
        let list = crate::ops::BufList(vec![mine, theirs]);
        assert!(check_local(&segments(&list), Some(&own)).is_err());
        // Nothing to transfer: nothing to check.
        assert!(check_local(&SgList::new(), None).is_ok());
    }

    #[test]
    fn an_entry_past_the_pool_memory_is_refused() {
        let reg = FakeRegistrar::default();
        let own = pool(&reg);
        let b = own.try_acquire(4096).unwrap().unwrap();
        let s = segments(&b).as_slice()[0];
        let past = crate::verbs::Sge::new(s.addr() + 4 * 4096, 64, s.lkey());
        let mut l = SgList::new();
        l.push(past);
        assert!(
            check_local(&l, Some(&own)).is_err(),
            "same lkey, outside the class memory"
        );
    }
}
