//! Atomic compare-and-swap and fetch-and-add on 8-byte remote values.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use crate::buf::{IoBufMut, RemoteToken};
use crate::driver::{OpConfig, RawOp, Request};
use crate::error::{Error, InvalidArgument, Result};
use crate::proto::{Queue, WorkRequest};
use crate::verbs::{SendOp, Sge};

/// Validates an atomic's buffers and builds its request.
pub(crate) fn atomic_request<B: IoBufMut>(
    buf: &mut B,
    remote: &RemoteToken,
    op: impl FnOnce(u64, u32) -> SendOp,
) -> Result<WorkRequest> {
    let mut wr = WorkRequest::send(SendOp::Send, &[]);
    fill_atomic(buf, remote, op, &mut wr)?;
    Ok(wr)
}

/// [`atomic_request`] written into `wr` where it lies.
#[inline]
fn fill_atomic<B: IoBufMut>(
    buf: &mut B,
    remote: &RemoteToken,
    op: impl FnOnce(u64, u32) -> SendOp,
    wr: &mut WorkRequest,
) -> Result<()> {
    if buf.bytes_total() < 8 {
        return Err(Error::InvalidArgument(
            InvalidArgument::AtomicBufferTooSmall,
        ));
    }
    let remote_addr = remote.check(0, 8)?;
    if remote_addr % 8 != 0 {
        return Err(Error::InvalidArgument(InvalidArgument::AtomicUnaligned {
            addr: remote_addr,
        }));
    }
    let lkey = buf
        .lkey()
        .ok_or(Error::InvalidArgument(InvalidArgument::AtomicNoLkey))?;
    wr.sges.clear();
    wr.sges.push(Sge::new(buf.stable_mut_ptr() as u64, 8, lkey));
    wr.op = op(remote_addr, remote.rkey());
    wr.queue = Queue::Send;
    wr.inline = false;
    wr.solicited = false;
    Ok(())
}

/// What an atomic asks for (its request is built when it is posted).
#[derive(Debug)]
pub(crate) enum AtomicReq {
    CompareSwap {
        remote: RemoteToken,
        compare: u64,
        swap: u64,
    },
    FetchAdd {
        remote: RemoteToken,
        add: u64,
    },
}

impl<B: IoBufMut> Request<B> for AtomicReq {
    const QUEUE: Queue = Queue::Send;

    #[inline]
    fn build(&mut self, _cfg: &OpConfig, buf: &mut B, wr: &mut WorkRequest) -> Result<()> {
        match *self {
            AtomicReq::CompareSwap {
                ref remote,
                compare,
                swap,
            } => fill_atomic(
                buf,
                remote,
                |remote_addr, rkey| SendOp::CompareSwap {
                    remote_addr,
                    rkey,
                    compare,
                    swap,
                },
                wr,
            ),
            AtomicReq::FetchAdd { ref remote, add } => fill_atomic(
                buf,
                remote,
                |remote_addr, rkey| SendOp::FetchAdd {
                    remote_addr,
                    rkey,
                    add,
                },
                wr,
            ),
        }
    }
}

pub(crate) fn previous_value<B: IoBufMut>(buf: &mut B) -> u64 {
    // SAFETY: the buffer holds at least 8 bytes (checked before posting), the device wrote the
    // previous value into them and is done with the buffer (its completion was polled).
    let v = unsafe { std::ptr::read_unaligned(buf.stable_ptr().cast::<u64>()) };
    // SAFETY: the first 8 bytes were just written by the device.
    unsafe { buf.set_init(8) };
    // The responder returns the value in its memory's byte order; on the little-endian hosts
    // RoCE runs on this is the native order.
    v
}

macro_rules! atomic_future {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        ///
        /// # Cancel safety
        ///
        /// Dropping it before the first poll does nothing. Dropped later, the atomic may still
        /// happen; the buffer is released once the device is done with it.
        #[derive(Debug)]
        #[must_use = "operations do nothing until polled"]
        pub struct $name<B: IoBufMut> {
            raw: RawOp<B, AtomicReq>,
        }

        impl<B: IoBufMut> Future for $name<B> {
            type Output = (Result<u64>, B);

            fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
                self.raw.poll_raw(cx).map(|(res, mut buf)| match res {
                    Ok(_) => {
                        let v = previous_value(&mut buf);
                        (Ok(v), buf)
                    }
                    Err(e) => (Err(*e), buf),
                })
            }
        }
    };
}

atomic_future! {
    /// The future of [`AsyncQp::compare_swap`](crate::driver::AsyncQp::compare_swap): resolves
    /// to the value found at the remote address (the swap happened if it equals `compare`).
    CompareSwap
}

atomic_future! {
    /// The future of [`AsyncQp::fetch_add`](crate::driver::AsyncQp::fetch_add): resolves to the
    /// value before the addition.
    FetchAdd
}

impl<B: IoBufMut> CompareSwap<B> {
    /// Posts the operation now, without waiting for its completion (a queue pair that
    /// coalesces posts it at once too); await the future later for the outcome, which also
    /// reports an error posting it. Calling it again, or after the first poll, does nothing.
    /// See [`Recv::start`](crate::ops::Recv::start).
    pub fn start(&mut self) {
        self.raw.start();
    }

    #[inline]
    pub(crate) fn new(
        cfg: &OpConfig,
        buf: B,
        remote: RemoteToken,
        compare: u64,
        swap: u64,
    ) -> Self {
        let req = AtomicReq::CompareSwap {
            remote,
            compare,
            swap,
        };
        CompareSwap {
            raw: RawOp::new(cfg, buf, req),
        }
    }
}

impl<B: IoBufMut> FetchAdd<B> {
    /// Posts the operation now, without waiting for its completion (a queue pair that
    /// coalesces posts it at once too); await the future later for the outcome, which also
    /// reports an error posting it. Calling it again, or after the first poll, does nothing.
    /// See [`Recv::start`](crate::ops::Recv::start).
    pub fn start(&mut self) {
        self.raw.start();
    }

    #[inline]
    pub(crate) fn new(cfg: &OpConfig, buf: B, remote: RemoteToken, add: u64) -> Self {
        FetchAdd {
            raw: RawOp::new(cfg, buf, AtomicReq::FetchAdd { remote, add }),
        }
    }
}
