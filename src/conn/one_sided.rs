//! One-sided operations on a [`Connection`], checked locally before anything is posted: an
//! operation the peer did not offer, or one outside the token, would fail at the peer and
//! kill the connection on both sides, so it fails here instead and the connection lives on.

use super::connection::Connection;
use crate::buf::{IoBufMut, RemoteToken};
use crate::error::{Error, Result};
use crate::ops::{SgSource, SgTarget};

impl Connection {
    fn check_offer(&self, atomics: bool) -> Result<()> {
        let p = &self.shared.params;
        if atomics && !p.peer_atomics {
            return Err(Error::InvalidArgument(
                "the peer does not offer atomics on this connection (ConnectOptions::atomics \
                 on the peer's side)"
                    .into(),
            ));
        }
        if !atomics && !p.peer_one_sided {
            return Err(Error::InvalidArgument(
                "the peer does not offer one-sided access on this connection \
                 (ConnectOptions::one_sided on the peer's side)"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Writes `buf` (registered memory, e.g. from [`pool`](Self::pool)) into the peer's
    /// memory at `remote`, a token the peer granted on this connection.
    ///
    /// # Errors
    ///
    /// Locally, before posting: [`Error::InvalidArgument`] if the peer did not offer
    /// one-sided access or `buf` does not fit in `remote`. From the device: the work
    /// completion's status (e.g. `IBV_WC_REM_ACCESS_ERR` for a revoked or foreign token),
    /// which also fails the connection.
    ///
    /// # Cancel safety
    ///
    /// Dropped before its first poll, nothing is written; later, the write may still happen
    /// and the buffer is released once the device is done with it.
    pub async fn write<B: SgSource>(&self, buf: B, remote: RemoteToken) -> (Result<()>, B) {
        if let Err(e) = self.check_offer(false) {
            return (Err(e), buf);
        }
        self.shared.qp.write(buf, remote).await
    }

    /// Reads the peer's memory at `remote` into `buf` (its whole capacity).
    ///
    /// # Errors
    ///
    /// As [`write`](Self::write).
    ///
    /// # Cancel safety
    ///
    /// Dropped after its first poll, the device may still write into the buffer, which is
    /// released once the read completes.
    pub async fn read<B: SgTarget>(&self, buf: B, remote: RemoteToken) -> (Result<()>, B) {
        if let Err(e) = self.check_offer(false) {
            return (Err(e), buf);
        }
        self.shared.qp.read(buf, remote).await
    }

    /// Atomic compare-and-swap on the peer's 8-byte value at `remote` (8-byte aligned);
    /// resolves with the previous value, also written into `buf`.
    ///
    /// # Errors
    ///
    /// Locally: [`Error::InvalidArgument`] if the peer did not offer atomics, or `remote` is
    /// not an aligned 8-byte range of the token. From the device: as [`write`](Self::write).
    ///
    /// # Cancel safety
    ///
    /// Once polled, the swap may still happen.
    pub async fn compare_swap<B: IoBufMut>(
        &self,
        buf: B,
        remote: RemoteToken,
        compare: u64,
        swap: u64,
    ) -> (Result<u64>, B) {
        if let Err(e) = self.check_offer(true) {
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
        buf: B,
        remote: RemoteToken,
        add: u64,
    ) -> (Result<u64>, B) {
        if let Err(e) = self.check_offer(true) {
            return (Err(e), buf);
        }
        self.shared.qp.fetch_add(buf, remote, add).await
    }
}
