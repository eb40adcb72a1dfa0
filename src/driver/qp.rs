//! [`AsyncQp`]: a queue pair whose operations are futures resolved by the completion task.

use std::fmt;
use std::sync::Arc;

use tracing::{debug, info_span};

use super::shared::{QpEntry, Shared};
use super::{Driver, QpOptions};
use crate::buf::{IoBufMut, RemoteToken};
use crate::core::{Completed, QpConfig, QpKey};
use crate::error::{QpFailure, Result};
use crate::ops::{CompareSwap, FetchAdd, OpConfig, Read, Recv, Send, SgSource, SgTarget, Write};
use crate::verbs::{ProtectionDomain, QpCaps, QpInitAttr, QueuePair};

/// A reliable-connected queue pair driven by a [`Driver`]: every operation is a future that
/// posts on first poll and resolves on its work completion, taking its buffers by value and
/// giving them back with the result.
///
/// Dropping an `AsyncQp` closes it in the background: the queue pair moves to the error state,
/// every outstanding operation resolves with [`QpFailure::Closed`](crate::QpFailure::Closed)
/// (its buffers are returned to its future, or released if the future is gone), and the queue
/// pair is destroyed once the device has flushed everything. [`close`](Self::close) does the
/// same and waits for it.
pub struct AsyncQp {
    driver: Driver,
    key: QpKey,
    qp: QueuePair,
    cfg: OpConfig,
    span: tracing::Span,
}

impl AsyncQp {
    pub(super) fn create(
        driver: Driver,
        pd: &ProtectionDomain,
        opts: QpOptions,
        cq_need: u64,
    ) -> Result<AsyncQp> {
        let cq = driver.shared().cq.clone();
        let mut attr = QpInitAttr::new(&cq, &cq);
        attr.caps = opts.caps;
        let qp = QueuePair::new_rc(pd, &attr)?;
        let caps: QpCaps = qp.caps();
        let key = {
            let mut st = driver.shared().lock();
            let key = st.core.add_qp(QpConfig::new(
                opts.caps.max_send_wr.min(caps.max_send_wr),
                opts.caps.max_recv_wr.min(caps.max_recv_wr),
                opts.signal_every,
            ));
            if st.qps.len() <= key.index() {
                st.qps.resize_with(key.index() + 1, || None);
            }
            st.qps[key.index()] = Some(QpEntry {
                qp: qp.clone(),
                closing: false,
                cq_need,
            });
            key
        };
        let span = info_span!("qp", qpn = qp.qpn(), device = driver.context().name());
        span.in_scope(|| debug!(?caps, "queue pair created"));
        Ok(AsyncQp {
            cfg: OpConfig {
                shared: driver.shared().clone(),
                qp: key,
                caps,
                coalesce: opts.coalesce,
                inline: opts.inline,
            },
            driver,
            key,
            qp,
            span,
        })
    }

    /// The underlying verbs queue pair, for connecting it (INIT/RTR/RTS) and queries. Posting
    /// on it directly bypasses the driver and is not supported.
    pub fn verbs(&self) -> &QueuePair {
        &self.qp
    }

    /// The queue pair number.
    pub fn qpn(&self) -> u32 {
        self.qp.qpn()
    }

    /// The capabilities the device granted.
    pub fn caps(&self) -> QpCaps {
        self.cfg.caps
    }

    /// The driver.
    pub fn driver(&self) -> &Driver {
        &self.driver
    }

    /// The failure that stopped this queue pair, if any.
    pub fn failure(&self) -> Option<QpFailure> {
        self.shared().lock().core.failure(self.key).cloned()
    }

    /// Operations queued or posted on this queue pair and not yet completed.
    pub fn outstanding(&self) -> usize {
        self.shared().lock().core.outstanding(self.key)
    }

    fn shared(&self) -> &Arc<Shared> {
        &self.cfg.shared
    }

    /// Sends the initialised bytes of `buf` (or of each buffer of a
    /// [`BufList`](crate::ops::BufList)); the peer must have a receive posted.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before its first poll sends nothing. After that the send may still
    /// happen; the buffer stays owned by the driver until the device is done with it and is
    /// then dropped.
    pub fn send<B: SgSource>(&self, buf: B) -> Send<B> {
        Send::new(&self.cfg, buf, None)
    }

    /// Sends `buf` with 32-bit immediate data delivered in the peer's receive completion.
    ///
    /// # Cancel safety
    ///
    /// As for [`send`](Self::send).
    pub fn send_with_imm<B: SgSource>(&self, buf: B, imm: u32) -> Send<B> {
        Send::new(&self.cfg, buf, Some(imm))
    }

    /// Posts a receive into `buf`; resolves with the received length (and immediate data) and
    /// the buffer, whose initialised length is set to what arrived.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future after its first poll leaves the receive posted: the next message
    /// from the peer is consumed into the (driver-owned) buffer and discarded.
    pub fn recv<B: SgTarget>(&self, buf: B) -> Recv<B> {
        Recv::new(&self.cfg, buf)
    }

    /// Writes the initialised bytes of `buf` to `remote` (which must be at least as long).
    ///
    /// # Cancel safety
    ///
    /// As for [`send`](Self::send): once polled, the write may still happen.
    pub fn write<B: SgSource>(&self, buf: B, remote: RemoteToken) -> Write<B> {
        Write::new(&self.cfg, buf, remote, None)
    }

    /// Writes `buf` to `remote` and delivers `imm` in a receive completion at the peer (which
    /// consumes one of its receives).
    ///
    /// # Cancel safety
    ///
    /// As for [`write`](Self::write).
    pub fn write_with_imm<B: SgSource>(&self, buf: B, remote: RemoteToken, imm: u32) -> Write<B> {
        Write::new(&self.cfg, buf, remote, Some(imm))
    }

    /// Reads `remote` into `buf` (its whole capacity, which must not exceed `remote`).
    ///
    /// # Cancel safety
    ///
    /// Once polled, the device may still write into the buffer, so the buffer stays owned by
    /// the driver until the read completes and is then dropped.
    pub fn read<B: SgTarget>(&self, buf: B, remote: RemoteToken) -> Read<B> {
        Read::new(&self.cfg, buf, remote)
    }

    /// Atomically replaces the 8-byte value at `remote` with `swap` if it equals `compare`;
    /// resolves with the previous value. `buf` (at least 8 bytes) receives it.
    ///
    /// # Cancel safety
    ///
    /// Once polled, the swap may still happen.
    pub fn compare_swap<B: IoBufMut>(
        &self,
        buf: B,
        remote: RemoteToken,
        compare: u64,
        swap: u64,
    ) -> CompareSwap<B> {
        CompareSwap::new(&self.cfg, buf, remote, compare, swap)
    }

    /// Atomically adds `add` to the 8-byte value at `remote`; resolves with the previous value.
    ///
    /// # Cancel safety
    ///
    /// Once polled, the addition may still happen.
    pub fn fetch_add<B: IoBufMut>(&self, buf: B, remote: RemoteToken, add: u64) -> FetchAdd<B> {
        FetchAdd::new(&self.cfg, buf, remote, add)
    }

    /// Moves the queue pair to the error state and fails its operations with `cause` (the
    /// connection layer uses it when the peer disconnects).
    pub(crate) fn force_error(&self, cause: QpFailure) {
        let mut out = Completed::default();
        self.shared().lock().fail(self.key, cause, &mut out);
        Shared::finish(&mut out);
        self.shared().notify.notify_one();
    }

    /// Closes the queue pair: moves it to ERR, waits until every outstanding operation has
    /// resolved (each exactly once, with [`QpFailure::Closed`] unless it completed first).
    /// The queue pair is destroyed when this handle is dropped.
    ///
    /// # Errors
    ///
    /// None today; the `Result` leaves room for drain timeouts.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future stops waiting; the queue pair stays closed.
    pub async fn close(&self) -> Result<()> {
        let _g = self.span.enter();
        self.force_error(QpFailure::Closed);
        loop {
            let drained = self.shared().drained.notified();
            tokio::pin!(drained);
            drained.as_mut().enable();
            if self.shared().lock().core.posted(self.key) == 0 {
                break;
            }
            self.shared().notify.notify_one();
            drained.await;
        }
        debug!("queue pair drained");
        Ok(())
    }
}

impl Drop for AsyncQp {
    fn drop(&mut self) {
        let mut out = Completed::default();
        {
            let mut st = self.shared().lock();
            st.fail(self.key, QpFailure::Closed, &mut out);
            if let Some(Some(e)) = st.qps.get_mut(self.key.index()) {
                e.closing = true;
            }
            self.shared()
                .closing
                .store(true, std::sync::atomic::Ordering::Release);
        }
        Shared::finish(&mut out);
        // The completion task reaps the queue pair once the device has flushed it.
        self.shared().notify.notify_one();
    }
}

impl fmt::Debug for AsyncQp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AsyncQp")
            .field("qpn", &self.qp.qpn())
            .field("caps", &self.cfg.caps)
            .finish_non_exhaustive()
    }
}
