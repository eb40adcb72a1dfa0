//! RDMA READ.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use super::sg::{SgTarget, target_list_into};
use crate::buf::RemoteToken;
use crate::driver::{OpConfig, RawOp, Request};
use crate::error::Result;
use crate::proto::{Queue, WorkRequest};
use crate::verbs::SendOp;

/// The future of [`AsyncQp::read`](crate::driver::AsyncQp::read): fills the buffer's whole
/// capacity from the remote token and resolves to the outcome and the buffer (its initialised
/// length set to what was read).
///
/// # Cancel safety
///
/// Dropping it before the first poll reads nothing. Dropped later, the device may still write
/// into the buffer, which the driver therefore keeps until the read completes, then drops.
#[derive(Debug)]
#[must_use = "operations do nothing until polled"]
pub struct Read<B: SgTarget> {
    raw: RawOp<B, ReadReq>,
}

/// What a read asks for (its request is built when it is posted).
#[derive(Debug)]
pub(crate) struct ReadReq {
    remote: RemoteToken,
    /// Bytes read: the buffers' whole capacity, known once the request is built.
    len: u64,
}

impl<B: SgTarget> Request<B> for ReadReq {
    const QUEUE: Queue = Queue::Send;

    #[inline(always)]
    fn build(&mut self, cfg: &OpConfig, buf: &mut B, wr: &mut WorkRequest) -> Result<()> {
        target_list_into(buf, cfg.caps.max_send_sge, &mut wr.sges)?;
        let len = wr.sges.total_len();
        let remote_addr = self.remote.check(0, len)?;
        self.len = len;
        wr.op = SendOp::Read {
            remote_addr,
            rkey: self.remote.rkey(),
        };
        wr.queue = Queue::Send;
        wr.inline = false;
        wr.solicited = false;
        Ok(())
    }
}

impl<B: SgTarget> Read<B> {
    /// Posts the operation now, without waiting for its completion (a queue pair that
    /// coalesces posts it at once too); await the future later for the outcome, which also
    /// reports an error posting it. Calling it again, or after the first poll, does nothing.
    /// See [`Recv::start`](crate::ops::Recv::start).
    pub fn start(&mut self) {
        self.raw.start();
    }

    #[inline]
    pub(crate) fn new(cfg: &OpConfig, buf: B, remote: RemoteToken) -> Read<B> {
        Read {
            raw: RawOp::new(cfg, buf, ReadReq { remote, len: 0 }),
        }
    }
}

impl<B: SgTarget> Future for Read<B> {
    type Output = (Result<()>, B);

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let raw = &mut self.raw;
        raw.poll_raw(cx).map(|(res, mut buf)| {
            let len = raw.req().len as usize;
            if res.is_ok() {
                buf.set_filled(len);
            }
            (res.map(|_| ()).map_err(|e| *e), buf)
        })
    }
}
