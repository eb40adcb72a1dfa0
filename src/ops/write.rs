//! RDMA WRITE and WRITE with immediate.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use super::sg::{SgSource, source_list_into};
use crate::buf::RemoteToken;
use crate::driver::{OpConfig, RawOp, Request};
use crate::error::Result;
use crate::proto::{Queue, WorkRequest};
use crate::verbs::SendOp;

/// The future of [`AsyncQp::write`](crate::driver::AsyncQp::write) and
/// [`write_with_imm`](crate::driver::AsyncQp::write_with_imm).
///
/// The local length is checked against the remote token before anything is posted; a write
/// that does not fit resolves with [`Error::InvalidArgument`](crate::Error::InvalidArgument).
///
/// # Cancel safety
///
/// Dropping it before the first poll writes nothing. Dropped later, the write may still
/// happen; the buffer is released once the device is done with it.
#[derive(Debug)]
#[must_use = "operations do nothing until polled"]
pub struct Write<B: SgSource> {
    raw: RawOp<B, WriteReq>,
}

/// What a write asks for (its request is built when it is posted).
#[derive(Debug)]
pub(crate) struct WriteReq {
    remote: RemoteToken,
    imm: Option<u32>,
}

impl<B: SgSource> Request<B> for WriteReq {
    const QUEUE: Queue = Queue::Send;

    #[inline(always)]
    fn build(&mut self, cfg: &OpConfig, buf: &mut B, wr: &mut WorkRequest) -> Result<()> {
        fill_write(cfg, buf, self.remote, self.imm, wr)
    }
}

impl<B: SgSource> Write<B> {
    /// Posts the operation now, without waiting for its completion (a queue pair that
    /// coalesces posts it at once too); await the future later for the outcome, which also
    /// reports an error posting it. Calling it again, or after the first poll, does nothing.
    /// See [`Recv::start`](crate::ops::Recv::start).
    pub fn start(&mut self) {
        self.raw.start();
    }

    #[inline]
    pub(crate) fn new(cfg: &OpConfig, buf: B, remote: RemoteToken, imm: Option<u32>) -> Write<B> {
        Write {
            raw: RawOp::new(cfg, buf, WriteReq { remote, imm }),
        }
    }
}

/// The work request of a write of `buf` to `remote` (with immediate data if `imm`), checked
/// against the token and the queue pair's limits, written into `wr` where it lies (a batch's
/// slot, the stack of the poll that posts it: nothing moved).
#[inline]
pub(crate) fn fill_write<B: SgSource>(
    cfg: &OpConfig,
    buf: &B,
    remote: RemoteToken,
    imm: Option<u32>,
    wr: &mut WorkRequest,
) -> Result<()> {
    source_list_into(buf, cfg.caps.max_send_sge, &mut wr.sges)?;
    let total = wr.sges.total_len();
    let remote_addr = remote.check(0, total)?;
    let rkey = remote.rkey();
    wr.op = match imm {
        Some(imm) => SendOp::WriteWithImm {
            remote_addr,
            rkey,
            imm,
        },
        None => SendOp::Write { remote_addr, rkey },
    };
    wr.queue = Queue::Send;
    wr.solicited = false;
    wr.inline = cfg.inline && total > 0 && total <= u64::from(cfg.caps.max_inline_data);
    Ok(())
}

impl<B: SgSource> Future for Write<B> {
    type Output = (Result<()>, B);

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.raw
            .poll_raw(cx)
            .map(|(res, buf)| (res.map(|_| ()).map_err(|e| *e), buf))
    }
}
