//! Closing a connection: [`Connection::shutdown`] (half-close) and [`Connection::close`]
//! (end of stream, then the outcome once it is known). The teardown itself runs in the
//! connection's task (`driver.rs`).

use std::sync::atomic::Ordering;
use std::time::Instant;

use tracing::debug;

use super::connection::Connection;
use super::io::ConnIo;
use crate::error::Result;

impl Connection {
    /// Half-closes the connection: end of stream goes out after the messages already being
    /// sent (the peer's [`recv`](Self::recv) returns `Ok(None)` after them); this side can
    /// still receive until the peer closes too. Later sends fail. Resolves once the peer's
    /// device acknowledged the end of stream.
    ///
    /// # Errors
    ///
    /// The connection's failure.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: end of stream is sent once, whether or not this future is polled again.
    pub async fn shutdown(&self) -> Result<()> {
        super::lifecycle::close(&self.shared, super::observe::ClosedBy::Close, false);
        self.wait_close().await
    }

    /// Closes the connection: end of stream after the messages already being sent; resolves
    /// once the outcome is known. The disconnect and the teardown (the queue pair moved to the
    /// error state, every outstanding operation resolved exactly once, buffers back to their
    /// pools, the queue pair destroyed) follow in the connection's task, as for a drop.
    ///
    /// `Ok` comes as soon as this side's end of stream is delivered (acknowledged by the
    /// peer's device, or confirmed by the peer): it does not wait for the disconnect's round
    /// trip through RDMA CM nor for the flushes. In the background the connection then
    /// confirms the peer's end of stream, or waits for it if it has not arrived (a full close:
    /// at most the keepalive timeout, as TCP's `FIN_WAIT_2`), and disconnects once both ends
    /// know (docs/connections.md, "Close and failure"), so that a clean close returns `Ok` on
    /// both sides. A failure is reported once every data send is accounted for (completed,
    /// or flushed by the teardown).
    ///
    /// # Errors
    ///
    /// `Ok` means every message this side sent reached the peer: its end of stream was
    /// acknowledged or confirmed, or the peer's end of stream had arrived and every data send
    /// was acknowledged. An error is the connection's failure, and means messages whose
    /// `send` returned `Ok` may not have reached the peer (it is closed anyway).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the close goes on in the background if the future is dropped.
    pub async fn close(&self) -> Result<()> {
        let t0 = Instant::now();
        super::lifecycle::close(&self.shared, super::observe::ClosedBy::Close, true);
        let res = self.wait_close().await;
        if res.is_ok() {
            debug!(
                parent: &self.span,
                qpn = self.shared.qp.qpn(),
                took = ?t0.elapsed(),
                "close(): end of stream delivered (the teardown goes on in the background)"
            );
            return res;
        }
        // Failed before our end of stream was known delivered. What reached the peer is known
        // once every data send is accounted for (completed, flushed, or given up): at once if
        // none is outstanding, else after the teardown's drain (bounded by its limits).
        let io = &self.shared.io;
        if io.with(|s| ConnIo::data_sends_outstanding(s)) {
            crate::driver::wait_until(&io.done, || io.torn_down.load(Ordering::Acquire)).await;
        }
        let out = io.with(|s| {
            let unaccounted = ConnIo::data_sends_outstanding(s);
            s.proto.close_outcome(unaccounted)
        });
        debug!(
            parent: &self.span,
            qpn = self.shared.qp.qpn(),
            took = ?t0.elapsed(),
            ok = out.is_ok(),
            "close(): the connection failed first; outcome once every data send is accounted for"
        );
        out
    }
}
