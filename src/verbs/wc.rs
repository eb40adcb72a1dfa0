//! Work completions (`struct ibv_wc`) and a reusable polling buffer.

use std::fmt;

use crate::error::{Error, WcStatus};
use crate::sys;

/// One work completion, laid out exactly as `struct ibv_wc` so the CQ polls straight into it.
///
/// # Examples
///
/// ```no_run
/// # use tokio_rdma::verbs::{WorkCompletion, WcOpcode};
/// # fn handle(wc: &WorkCompletion) -> tokio_rdma::Result<()> {
/// wc.result()?; // an error status becomes `Error::QpFailed(QpFailure::WorkCompletion { .. })`
/// if wc.opcode() == WcOpcode::Recv {
///     println!("received {} bytes, imm {:?}", wc.byte_len(), wc.imm());
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct WorkCompletion(sys::ibv_wc);

/// What a work completion completed (`enum ibv_wc_opcode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WcOpcode {
    /// A send (with or without immediate).
    Send,
    /// An RDMA WRITE (with or without immediate), on the requester side.
    RdmaWrite,
    /// An RDMA READ.
    RdmaRead,
    /// An atomic compare-and-swap.
    CompSwap,
    /// An atomic fetch-and-add.
    FetchAdd,
    /// A memory window bind.
    BindMw,
    /// A local invalidate.
    LocalInv,
    /// A receive (a SEND arrived).
    Recv,
    /// An RDMA WRITE with immediate consumed a receive.
    RecvRdmaWithImm,
    /// A value this crate does not know.
    Unknown(u32),
}

impl WcOpcode {
    fn from_raw(raw: u32) -> WcOpcode {
        match raw {
            sys::IBV_WC_SEND => WcOpcode::Send,
            sys::IBV_WC_RDMA_WRITE => WcOpcode::RdmaWrite,
            sys::IBV_WC_RDMA_READ => WcOpcode::RdmaRead,
            sys::IBV_WC_COMP_SWAP => WcOpcode::CompSwap,
            sys::IBV_WC_FETCH_ADD => WcOpcode::FetchAdd,
            sys::IBV_WC_BIND_MW => WcOpcode::BindMw,
            sys::IBV_WC_LOCAL_INV => WcOpcode::LocalInv,
            sys::IBV_WC_RECV => WcOpcode::Recv,
            sys::IBV_WC_RECV_RDMA_WITH_IMM => WcOpcode::RecvRdmaWithImm,
            other => WcOpcode::Unknown(other),
        }
    }
}

impl WorkCompletion {
    /// Builds a completion from plain values (for tests and the sans-IO core).
    pub fn synthetic(wr_id: u64, status: u32, byte_len: u32) -> WorkCompletion {
        WorkCompletion(sys::ibv_wc {
            wr_id,
            status,
            byte_len,
            ..Default::default()
        })
    }

    /// The work request id given when posting.
    pub fn wr_id(&self) -> u64 {
        self.0.wr_id
    }

    /// The completion status.
    pub fn status(&self) -> WcStatus {
        WcStatus::from_raw(self.0.status)
    }

    /// Whether the work request succeeded.
    pub fn is_success(&self) -> bool {
        self.0.status == sys::IBV_WC_SUCCESS
    }

    /// `Ok(())` on success, else the failure it means for the queue pair:
    /// [`Error::QpFailed`] with [`QpFailure::WorkCompletion`](crate::QpFailure::WorkCompletion)
    /// and the status.
    ///
    /// # Errors
    ///
    /// [`Error::QpFailed`] if the status is not `IBV_WC_SUCCESS`.
    pub fn result(&self) -> Result<(), Error> {
        if self.is_success() {
            Ok(())
        } else {
            Err(Error::QpFailed(crate::QpFailure::WorkCompletion {
                status: self.status(),
                vendor_err: self.0.vendor_err,
            }))
        }
    }

    /// The operation. Only meaningful when the status is success (the verbs leave it
    /// undefined for failed completions).
    pub fn opcode(&self) -> WcOpcode {
        WcOpcode::from_raw(self.0.opcode)
    }

    /// Bytes transferred (receives, RDMA READ, atomics).
    pub fn byte_len(&self) -> u32 {
        self.0.byte_len
    }

    /// The immediate data in host byte order, if the completion carries any.
    pub fn imm(&self) -> Option<u32> {
        if self.0.wc_flags & sys::IBV_WC_WITH_IMM != 0 {
            // SAFETY: with IBV_WC_WITH_IMM set the union holds the immediate (big endian).
            Some(u32::from_be(unsafe { self.0.__bindgen_anon_1.imm_data }))
        } else {
            None
        }
    }

    /// The local queue pair number.
    pub fn qp_num(&self) -> u32 {
        self.0.qp_num
    }

    /// The vendor syndrome for failed completions.
    pub fn vendor_err(&self) -> u32 {
        self.0.vendor_err
    }
}

impl fmt::Debug for WorkCompletion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("WorkCompletion");
        d.field("wr_id", &self.wr_id())
            .field("status", &self.status());
        if self.is_success() {
            d.field("opcode", &self.opcode())
                .field("byte_len", &self.byte_len());
            if let Some(imm) = self.imm() {
                d.field("imm", &imm);
            }
        }
        d.field("qp_num", &self.qp_num()).finish()
    }
}

/// A reusable buffer for polling a batch of completions without allocating.
#[derive(Debug)]
pub struct WcBatch {
    buf: Vec<WorkCompletion>,
}

impl WcBatch {
    /// The most completions one batch holds (3 MiB of `ibv_wc`): a larger capacity is
    /// clamped to it.
    pub const MAX_CAPACITY: usize = 1 << 16;

    /// A buffer that polls at most `n` completions at a time (at least 1, at most
    /// [`MAX_CAPACITY`](Self::MAX_CAPACITY)).
    pub fn with_capacity(n: usize) -> WcBatch {
        WcBatch {
            buf: vec![WorkCompletion(sys::ibv_wc::default()); n.clamp(1, Self::MAX_CAPACITY)],
        }
    }

    /// How many completions one poll can return.
    pub fn capacity(&self) -> usize {
        self.buf.len()
    }

    pub(crate) fn spare(&mut self) -> &mut [WorkCompletion] {
        &mut self.buf
    }

    pub(crate) fn filled(&self, n: usize) -> &[WorkCompletion] {
        &self.buf[..n]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `vec![_; n]` of a caller's `n`: `usize::MAX` panicked with "capacity overflow", and a
    /// large representable `n` asks for 48 bytes per entry (`1 << 32`: 192 GiB, an abort),
    /// for a poll that `ibv_poll_cq` caps at `i32::MAX` entries anyway. A driver's
    /// `DriverOptions::poll_batch` comes here unchecked through `Driver::new`.
    #[test]
    fn a_huge_batch_capacity_is_clamped() {
        assert_eq!(WcBatch::with_capacity(0).capacity(), 1);
        assert_eq!(WcBatch::with_capacity(32).capacity(), 32);
        for n in [usize::MAX, 1 << 32, WcBatch::MAX_CAPACITY + 1] {
            assert_eq!(WcBatch::with_capacity(n).capacity(), WcBatch::MAX_CAPACITY);
        }
    }

    #[test]
    fn synthetic_completion() {
        let wc = WorkCompletion::synthetic(7, sys::IBV_WC_REM_ACCESS_ERR, 0);
        assert_eq!(wc.wr_id(), 7);
        assert!(!wc.is_success());
        let err = wc.result().unwrap_err();
        assert!(err.to_string().contains("IBV_WC_REM_ACCESS_ERR"), "{err}");
        assert_eq!(wc.imm(), None);
        assert!(
            WorkCompletion::synthetic(1, sys::IBV_WC_SUCCESS, 5)
                .result()
                .is_ok()
        );
    }

    #[test]
    fn layout_matches_ibv_wc() {
        assert_eq!(
            std::mem::size_of::<WorkCompletion>(),
            std::mem::size_of::<sys::ibv_wc>()
        );
        assert_eq!(
            std::mem::align_of::<WorkCompletion>(),
            std::mem::align_of::<sys::ibv_wc>()
        );
    }
}
