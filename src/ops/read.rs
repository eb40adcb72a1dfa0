//! RDMA READ.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use super::sg::{SgTarget, target_list};
use crate::buf::RemoteToken;
use crate::driver::{OpConfig, RawOp};
use crate::error::Result;
use crate::proto::WorkRequest;
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
    raw: RawOp<B>,
    len: u64,
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
    pub(crate) fn new(cfg: &OpConfig, mut buf: B, remote: RemoteToken) -> Read<B> {
        let mut len = 0;
        let wr = target_list(&mut buf, cfg.caps.max_send_sge).and_then(|sges| {
            len = sges.total_len();
            let remote_addr = remote.check(0, len)?;
            Ok(WorkRequest::send_list(
                SendOp::Read {
                    remote_addr,
                    rkey: remote.rkey(),
                },
                sges,
            ))
        });
        Read {
            raw: RawOp::new(cfg, buf, wr),
            len,
        }
    }
}

impl<B: SgTarget> Future for Read<B> {
    type Output = (Result<()>, B);

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let len = self.len as usize;
        self.raw.poll_raw(cx).map(|(res, mut buf)| {
            if res.is_ok() {
                buf.set_filled(len);
            }
            (res.map(|_| ()).map_err(|e| *e), buf)
        })
    }
}
