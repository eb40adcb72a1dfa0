//! Atomics on an [`OwnedQp`]: compare-and-swap and fetch-and-add on an 8-byte remote value,
//! the previous value landing in the first 8 bytes of the local buffer.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use super::ring::Kind;
use super::{OwnedQp, Ticket, Wait};
use crate::buf::{IoBufMut, RemoteToken};
use crate::error::{Error, Result};
use crate::ops::{atomic_request, previous_value};
use crate::verbs::SendOp;

impl<B: IoBufMut> OwnedQp<B> {
    /// Posts an atomic fetch-and-add of `add` on the 8 bytes at the start of `remote`; the
    /// value before the addition is written into `buf`'s first 8 bytes (host order).
    ///
    /// # Errors
    ///
    /// The buffer comes back with the error: [`InvalidArgument::AtomicBufferTooSmall`],
    /// [`InvalidArgument::AtomicUnaligned`] (the remote address is not 8-byte aligned),
    /// [`InvalidArgument::AtomicNoLkey`], a remote range error, a full send queue, or
    /// [`Error::PostSend`].
    ///
    /// [`InvalidArgument::AtomicBufferTooSmall`]: crate::InvalidArgument::AtomicBufferTooSmall
    /// [`InvalidArgument::AtomicUnaligned`]: crate::InvalidArgument::AtomicUnaligned
    /// [`InvalidArgument::AtomicNoLkey`]: crate::InvalidArgument::AtomicNoLkey
    pub fn post_fetch_add(
        &mut self,
        mut buf: B,
        remote: RemoteToken,
        add: u64,
    ) -> Result<Ticket, (Error, B)> {
        match atomic_request(&mut buf, &remote, |remote_addr, rkey| SendOp::FetchAdd {
            remote_addr,
            rkey,
            add,
        }) {
            Ok(wr) => self.post_send_wr(buf, Kind::Atomic, wr.op, wr.sges.as_slice(), false),
            Err(e) => Err((e, buf)),
        }
    }

    /// Posts an atomic compare-and-swap on the 8 bytes at the start of `remote`: they become
    /// `swap` if they equal `compare`. The value before is written into `buf`'s first 8 bytes
    /// (the swap happened if it equals `compare`).
    ///
    /// # Errors
    ///
    /// As [`post_fetch_add`](Self::post_fetch_add).
    pub fn post_compare_swap(
        &mut self,
        mut buf: B,
        remote: RemoteToken,
        compare: u64,
        swap: u64,
    ) -> Result<Ticket, (Error, B)> {
        match atomic_request(&mut buf, &remote, |remote_addr, rkey| SendOp::CompareSwap {
            remote_addr,
            rkey,
            compare,
            swap,
        }) {
            Ok(wr) => self.post_send_wr(buf, Kind::Atomic, wr.op, wr.sges.as_slice(), false),
            Err(e) => Err((e, buf)),
        }
    }

    /// Fetch-and-add, waiting for the result: resolves with the value before the addition.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo(
    /// #     qp: &mut tokio_rdma::owned::OwnedQp<tokio_rdma::verbs::RegisteredBuffer>,
    /// #     buf: tokio_rdma::verbs::RegisteredBuffer,
    /// #     counter: tokio_rdma::buf::RemoteToken,
    /// # ) -> tokio_rdma::Result<()> {
    /// let (before, _buf) = qp.fetch_add(buf, counter, 1).await;
    /// println!("the counter was {}", before?);
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// As for [`send`](Self::send): the request is posted by this call, and a dropped future
    /// gives it up (the addition may still happen).
    pub fn fetch_add(&mut self, buf: B, remote: RemoteToken, add: u64) -> AtomicWait<'_, B> {
        let r = self.post_fetch_add(buf, remote, add);
        AtomicWait(self.waiting(r))
    }

    /// Compare-and-swap, waiting for the result: resolves with the value before (the swap
    /// happened if it equals `compare`).
    ///
    /// # Cancel safety
    ///
    /// As for [`fetch_add`](Self::fetch_add).
    pub fn compare_swap(
        &mut self,
        buf: B,
        remote: RemoteToken,
        compare: u64,
        swap: u64,
    ) -> AtomicWait<'_, B> {
        let r = self.post_compare_swap(buf, remote, compare, swap);
        AtomicWait(self.waiting(r))
    }
}

/// The future of [`OwnedQp::fetch_add`] and [`OwnedQp::compare_swap`]: the remote value
/// before the operation, and the buffer.
///
/// # Cancel safety
///
/// See [`OwnedQp::fetch_add`].
#[derive(Debug)]
#[must_use = "a dropped wait gives its request up"]
pub struct AtomicWait<'a, B: IoBufMut>(Wait<'a, B>);

impl<B: IoBufMut> Future for AtomicWait<'_, B> {
    type Output = (Result<u64>, B);

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.0)
            .poll(cx)
            .map(|(res, mut buf)| match res {
                Ok(_) => (Ok(previous_value(&mut buf)), buf),
                Err(e) => (Err(e), buf),
            })
    }
}
