//! SEND and SEND with immediate.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use super::sg::{SgSource, source_list_into};
use crate::driver::{OpConfig, RawOp, Request};
use crate::error::Result;
use crate::proto::{Queue, WorkRequest};
use crate::verbs::SendOp;

/// The future of [`AsyncQp::send`](crate::driver::AsyncQp::send) and
/// [`send_with_imm`](crate::driver::AsyncQp::send_with_imm): resolves to the send's outcome and
/// the buffer.
///
/// # Cancel safety
///
/// Dropping it before the first poll sends nothing. Dropped later, the send may still happen;
/// the buffer is released once the device is done with it.
#[derive(Debug)]
#[must_use = "operations do nothing until polled"]
pub struct Send<B: SgSource> {
    raw: RawOp<B, SendReq>,
}

/// What a send asks for (its request is built when it is posted).
#[derive(Debug)]
pub(crate) struct SendReq {
    imm: Option<u32>,
}

impl<B: SgSource> Request<B> for SendReq {
    const QUEUE: Queue = Queue::Send;

    #[inline(always)]
    fn build(&mut self, cfg: &OpConfig, buf: &mut B, wr: &mut WorkRequest) -> Result<()> {
        fill_send(cfg, buf, self.imm, wr)
    }
}

impl<B: SgSource> Send<B> {
    /// Posts the operation now, without waiting for its completion (a queue pair that
    /// coalesces posts it at once too); await the future later for the outcome, which also
    /// reports an error posting it. Calling it again, or after the first poll, does nothing.
    /// See [`Recv::start`](crate::ops::Recv::start).
    pub fn start(&mut self) {
        self.raw.start();
    }

    #[inline]
    pub(crate) fn new(cfg: &OpConfig, buf: B, imm: Option<u32>) -> Send<B> {
        Send {
            raw: RawOp::new(cfg, buf, SendReq { imm }),
        }
    }
}

/// The work request of a send of `buf` (with immediate data if `imm`), checked against the
/// queue pair's limits, written into `wr` where it lies (a batch's slot, the stack of the poll
/// that posts it: nothing moved).
#[inline]
pub(crate) fn fill_send<B: SgSource>(
    cfg: &OpConfig,
    buf: &B,
    imm: Option<u32>,
    wr: &mut WorkRequest,
) -> Result<()> {
    source_list_into(buf, cfg.caps.max_send_sge, &mut wr.sges)?;
    wr.op = match imm {
        Some(imm) => SendOp::SendWithImm(imm),
        None => SendOp::Send,
    };
    let total = wr.sges.total_len();
    wr.queue = Queue::Send;
    wr.solicited = false;
    wr.inline = cfg.inline && total > 0 && total <= u64::from(cfg.caps.max_inline_data);
    Ok(())
}

impl<B: SgSource> Future for Send<B> {
    type Output = (Result<()>, B);

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.raw
            .poll_raw(cx)
            .map(|(res, buf)| (res.map(|_| ()).map_err(|e| *e), buf))
    }
}
