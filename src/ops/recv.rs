//! Receives.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use super::sg::{SgTarget, target_list_into};
use crate::driver::{OpConfig, RawOp, Request};
use crate::error::Result;
use crate::proto::{Queue, WorkRequest};

/// What a completed receive reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvInfo {
    /// Bytes received (0 for a WRITE with immediate, whose payload went to remote memory).
    pub len: usize,
    /// Immediate data, if the sender attached any.
    pub imm: Option<u32>,
}

/// The future of [`AsyncQp::recv`](crate::driver::AsyncQp::recv): resolves when a message
/// arrives, with its length and immediate data, and the buffer (its initialised length set to
/// the message length).
///
/// # Cancel safety
///
/// Dropping it before the first poll posts nothing. Dropped later, the receive stays posted:
/// the next incoming message lands in the driver-owned buffer and is dropped with it.
#[derive(Debug)]
#[must_use = "operations do nothing until polled"]
pub struct Recv<B: SgTarget> {
    raw: RawOp<B, RecvReq>,
}

/// What a receive asks for: nothing but its buffers (its request is built when it is posted).
#[derive(Debug)]
pub(crate) struct RecvReq;

impl<B: SgTarget> Request<B> for RecvReq {
    const QUEUE: Queue = Queue::Recv;

    #[inline(always)]
    fn build(&mut self, cfg: &OpConfig, buf: &mut B, wr: &mut WorkRequest) -> Result<()> {
        target_list_into(buf, cfg.caps.max_recv_sge, &mut wr.sges)?;
        wr.queue = Queue::Recv;
        wr.inline = false;
        wr.solicited = false;
        Ok(())
    }
}

impl<B: SgTarget> Recv<B> {
    #[inline]
    pub(crate) fn new(cfg: &OpConfig, buf: B) -> Recv<B> {
        Recv {
            raw: RawOp::new(cfg, buf, RecvReq),
        }
    }

    /// Posts the receive now, without waiting for a message: call it before the send (or the
    /// connection step) that lets the peer send, then await the future for the message. An
    /// error posting it is reported when the future is awaited. Calling it again, or after the
    /// first poll, does nothing. It only posts: it polls no completion and does not count as
    /// a waiting future (the completion mode's spinning or sleeping starts when the future is
    /// first awaited, as for a receive posted by its first poll), so a started operation costs
    /// nothing while it waits to be awaited. Post ahead with `start`, not with a first poll
    /// (`futures::poll!`): in busy and adaptive modes a poll is a wait, and one with no other
    /// operation future of its driver made and not posted polls the completion queue its
    /// full in-place count (64 times) before it returns.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo(qp: &tokio_rdma::driver::AsyncQp, buf: tokio_rdma::verbs::RegisteredBuffer) {
    /// let mut reply = qp.recv(buf);
    /// reply.start(); // posted: the peer may answer from now on
    /// // ... send the request ...
    /// let (res, buf) = reply.await;
    /// # }
    /// ```
    pub fn start(&mut self) {
        self.raw.start();
    }
}

impl<B: SgTarget> Future for Recv<B> {
    type Output = (Result<RecvInfo>, B);

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.raw.poll_raw(cx).map(|(res, mut buf)| match res {
            Ok(info) => {
                let len = info.byte_len as usize;
                buf.set_filled(len);
                (Ok(RecvInfo { len, imm: info.imm }), buf)
            }
            Err(e) => (Err(*e), buf),
        })
    }
}
