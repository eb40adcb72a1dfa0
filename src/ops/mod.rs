//! Operations as futures, one file per kind. Each takes its buffers by value and resolves to
//! `(Result<T>, B)`: the buffers always come back, success or failure.
//!
//! This layer is thin: it builds the typed work request and maps the outcome. Every operation
//! is the driver's one engine (`RawOp`, in `driver/raw.rs`), which implements the common rules:
//!
//! * **post on first poll**: constructing the future does nothing; a future that is never polled
//!   posts nothing and simply drops its buffers;
//! * **ownership in flight**: the buffers stay in the future while the device uses them; a
//!   future dropped before its completion parks them in the driver's operation table until
//!   the completion arrives, so dropping (or `mem::forget`ting) it cannot free memory the
//!   device still uses;
//! * **completions polled in place**: a waiting future polls the completion queue itself, then
//!   spins or sleeps as the [`CompletionMode`](crate::driver::CompletionMode) says;
//! * **no allocation** per operation in steady state;
//! * **coalescing**: with [`QpOptions::coalesce`](crate::driver::QpOptions::coalesce) the first
//!   poll queues the request and yields once, so requests started in the same wake are posted
//!   as one chained list (one doorbell);
//! * **backpressure**: a full send queue makes the future wait, it is not an error;
//! * **batches** ([`AsyncQp::batch`]): up to [`MAX_BATCH`](crate::driver::MAX_BATCH) sends and writes gathered without a
//!   future each, posted with one doorbell and awaited with one future.

mod atomic;
mod batch;
mod read;
mod recv;
mod send;
mod sg;
mod write;

pub use atomic::{CompareSwap, FetchAdd};
pub(crate) use atomic::{atomic_request, previous_value};
pub use batch::{Batch, Outcomes, Submit};
pub use read::Read;
pub use recv::{Recv, RecvInfo};
pub use send::Send;
pub(crate) use sg::check_count as check_sge_count;
pub use sg::{BufList, SgSource, SgTarget};
pub use write::Write;

use crate::buf::{IoBufMut, RemoteToken};
use crate::driver::AsyncQp;

impl AsyncQp {
    /// Sends the initialised bytes of `buf` (or of each buffer of a
    /// [`BufList`](crate::ops::BufList)); the peer must have a receive posted.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before its first poll sends nothing. After that the send may still
    /// happen; the buffer stays owned by the driver until the device is done with it and is
    /// then dropped.
    #[inline]
    pub fn send<B: SgSource>(&self, buf: B) -> Send<B> {
        Send::new(self.op_config(), buf, None)
    }

    /// Sends `buf` with 32-bit immediate data delivered in the peer's receive completion.
    ///
    /// # Cancel safety
    ///
    /// As for [`send`](Self::send).
    #[inline]
    pub fn send_with_imm<B: SgSource>(&self, buf: B, imm: u32) -> Send<B> {
        Send::new(self.op_config(), buf, Some(imm))
    }

    /// Posts a receive into `buf`; resolves with the received length (and immediate data) and
    /// the buffer, whose initialised length is set to what arrived.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future after its first poll leaves the receive posted: the next message
    /// from the peer is consumed into the (driver-owned) buffer and discarded.
    #[inline]
    pub fn recv<B: SgTarget>(&self, buf: B) -> Recv<B> {
        Recv::new(self.op_config(), buf)
    }

    /// Writes the initialised bytes of `buf` to `remote` (which must be at least as long).
    ///
    /// # Cancel safety
    ///
    /// As for [`send`](Self::send): once polled, the write may still happen.
    #[inline]
    pub fn write<B: SgSource>(&self, buf: B, remote: RemoteToken) -> Write<B> {
        Write::new(self.op_config(), buf, remote, None)
    }

    /// Writes `buf` to `remote` and delivers `imm` in a receive completion at the peer (which
    /// consumes one of its receives).
    ///
    /// # Cancel safety
    ///
    /// As for [`write`](Self::write).
    #[inline]
    pub fn write_with_imm<B: SgSource>(&self, buf: B, remote: RemoteToken, imm: u32) -> Write<B> {
        Write::new(self.op_config(), buf, remote, Some(imm))
    }

    /// Reads `remote` into `buf` (its whole capacity, which must not exceed `remote`).
    ///
    /// # Cancel safety
    ///
    /// Once polled, the device may still write into the buffer, so the buffer stays owned by
    /// the driver until the read completes and is then dropped.
    #[inline]
    pub fn read<B: SgTarget>(&self, buf: B, remote: RemoteToken) -> Read<B> {
        Read::new(self.op_config(), buf, remote)
    }

    /// Atomically replaces the 8-byte value at `remote` with `swap` if it equals `compare`;
    /// resolves with the previous value. `buf` (at least 8 bytes) receives it.
    ///
    /// # Cancel safety
    ///
    /// Once polled, the swap may still happen.
    #[inline]
    pub fn compare_swap<B: IoBufMut>(
        &self,
        buf: B,
        remote: RemoteToken,
        compare: u64,
        swap: u64,
    ) -> CompareSwap<B> {
        CompareSwap::new(self.op_config(), buf, remote, compare, swap)
    }

    /// Atomically adds `add` to the 8-byte value at `remote`; resolves with the previous value.
    ///
    /// # Cancel safety
    ///
    /// Once polled, the addition may still happen.
    #[inline]
    pub fn fetch_add<B: IoBufMut>(&self, buf: B, remote: RemoteToken, add: u64) -> FetchAdd<B> {
        FetchAdd::new(self.op_config(), buf, remote, add)
    }
}
