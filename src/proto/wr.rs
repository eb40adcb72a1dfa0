//! Plain-data descriptions of work requests and completions, as the core sees them.

use crate::error::WcStatus;
use crate::verbs::{SendOp, Sge, WcOpcode};

/// Which queue of a queue pair a request goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Queue {
    /// The send queue (sends, RDMA WRITE/READ, atomics).
    Send,
    /// The receive queue.
    Recv,
}

/// Scatter/gather entries an [`SgList`] holds without allocating; a longer list spills to
/// the heap (one allocation per operation that uses it).
pub const INLINE_SGES: usize = 4;
const _: () = assert!(INLINE_SGES <= u8::MAX as usize, "an inline length is a u8");

/// A scatter/gather list: up to [`INLINE_SGES`] entries inline, more on the heap. Cloning
/// an inline list copies its entries and calls no allocator (a coalesced request is cloned
/// into its queue pair's pending list).
#[derive(Debug, Clone)]
pub struct SgList {
    repr: SgRepr,
}

/// Inline entries or a heap list, never both: 72 bytes, where a length, the inline array and
/// an (empty) `Vec` side by side took 96, in every operation future and every work request
/// moved through the driver.
#[derive(Debug, Clone)]
enum SgRepr {
    /// The first `len` entries of `sges`.
    Inline { len: u8, sges: [Sge; INLINE_SGES] },
    /// A list that outgrew the inline entries (it keeps its heap memory when cleared).
    Heap(Vec<Sge>),
}

impl Default for SgList {
    fn default() -> Self {
        SgList::new()
    }
}

impl SgList {
    /// An empty list (zero-length transfers).
    #[inline]
    pub const fn new() -> SgList {
        SgList {
            repr: SgRepr::Inline {
                len: 0,
                sges: [Sge::ZERO; INLINE_SGES],
            },
        }
    }

    /// Builds a list from entries.
    pub fn from_slice(sges: &[Sge]) -> SgList {
        let mut l = SgList::new();
        for s in sges {
            l.push(*s);
        }
        l
    }

    /// Appends an entry (spilling to the heap past [`INLINE_SGES`]).
    #[inline]
    pub fn push(&mut self, sge: Sge) {
        match &mut self.repr {
            SgRepr::Inline { len, sges } if usize::from(*len) < INLINE_SGES => {
                sges[usize::from(*len)] = sge;
                *len += 1;
            }
            _ => self.push_spilled(sge),
        }
    }

    /// [`push`](Self::push) past the inline entries, out of line: the inline case, every
    /// operation's, stays a few instructions in its caller.
    #[cold]
    #[inline(never)]
    fn push_spilled(&mut self, sge: Sge) {
        match &mut self.repr {
            SgRepr::Inline { sges, .. } => {
                let mut v = Vec::with_capacity(2 * INLINE_SGES);
                v.extend_from_slice(sges);
                v.push(sge);
                self.repr = SgRepr::Heap(v);
            }
            SgRepr::Heap(v) => v.push(sge),
        }
    }

    /// Empties the list (a spilled list keeps its heap memory for the next use).
    #[inline]
    pub fn clear(&mut self) {
        match &mut self.repr {
            SgRepr::Inline { len, .. } => *len = 0,
            SgRepr::Heap(v) => v.clear(),
        }
    }

    /// Number of entries.
    #[inline]
    pub fn len(&self) -> usize {
        self.as_slice().len()
    }

    /// Whether the list has no entry.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The entries.
    #[inline]
    pub fn as_slice(&self) -> &[Sge] {
        match &self.repr {
            SgRepr::Inline { len, sges } => &sges[..usize::from(*len)],
            SgRepr::Heap(v) => v,
        }
    }

    /// Total bytes.
    #[inline]
    pub fn total_len(&self) -> u64 {
        self.as_slice().iter().map(|s| u64::from(s.length())).sum()
    }
}

/// A work request to post: where it goes, what it does, which memory it uses.
#[derive(Debug, Clone)]
pub struct WorkRequest {
    /// Send or receive queue.
    pub queue: Queue,
    /// The operation (ignored for receives).
    pub op: SendOp,
    /// The local memory.
    pub sges: SgList,
    /// Send the payload inline (copied at post time).
    pub inline: bool,
    /// Set the solicited-event bit.
    pub solicited: bool,
}

impl WorkRequest {
    /// A send-queue request.
    pub fn send(op: SendOp, sges: &[Sge]) -> WorkRequest {
        WorkRequest {
            queue: Queue::Send,
            op,
            sges: SgList::from_slice(sges),
            inline: false,
            solicited: false,
        }
    }

    /// A send-queue request that takes `sges` as it is (no copy of the list).
    #[inline]
    pub fn send_list(op: SendOp, sges: SgList) -> WorkRequest {
        WorkRequest {
            queue: Queue::Send,
            op,
            sges,
            inline: false,
            solicited: false,
        }
    }

    /// A receive request that takes `sges` as it is.
    #[inline]
    pub fn recv_list(sges: SgList) -> WorkRequest {
        WorkRequest {
            queue: Queue::Recv,
            op: SendOp::Send,
            sges,
            inline: false,
            solicited: false,
        }
    }

    /// A receive request.
    pub fn recv(sges: &[Sge]) -> WorkRequest {
        WorkRequest {
            queue: Queue::Recv,
            op: SendOp::Send,
            sges: SgList::from_slice(sges),
            inline: false,
            solicited: false,
        }
    }
}

/// A request the driver must post now, in this order.
#[derive(Debug, Clone)]
pub struct PostItem {
    /// The `wr_id` to post it with.
    pub wr_id: u64,
    /// The request.
    pub wr: WorkRequest,
    /// Whether to request a completion (send queue only; receives always complete).
    pub signaled: bool,
}

/// A work completion as plain data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cqe {
    /// The `wr_id` it was posted with.
    pub wr_id: u64,
    /// Its status.
    pub status: WcStatus,
    /// Vendor syndrome (errors).
    pub vendor_err: u32,
    /// What completed (only meaningful on success).
    pub opcode: WcOpcode,
    /// Bytes received / read.
    pub byte_len: u32,
    /// Immediate data (host order), if any.
    pub imm: Option<u32>,
}

impl Cqe {
    /// A successful completion (tests and examples).
    pub fn success(wr_id: u64, byte_len: u32) -> Cqe {
        Cqe {
            wr_id,
            status: WcStatus::Success,
            vendor_err: 0,
            opcode: WcOpcode::Send,
            byte_len,
            imm: None,
        }
    }

    /// A completion with `status` (tests and examples).
    pub fn with_status(wr_id: u64, status: WcStatus) -> Cqe {
        Cqe {
            status,
            ..Cqe::success(wr_id, 0)
        }
    }
}

impl From<&crate::verbs::WorkCompletion> for Cqe {
    #[inline]
    fn from(wc: &crate::verbs::WorkCompletion) -> Cqe {
        let ok = wc.is_success();
        Cqe {
            wr_id: wc.wr_id(),
            status: wc.status(),
            vendor_err: wc.vendor_err(),
            opcode: if ok {
                wc.opcode()
            } else {
                WcOpcode::Unknown(u32::MAX)
            },
            byte_len: if ok { wc.byte_len() } else { 0 },
            imm: if ok { wc.imm() } else { None },
        }
    }
}

/// What a successful operation reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OpInfo {
    /// Bytes received / read (0 for requests retired without their own completion).
    pub byte_len: u32,
    /// Immediate data received, if any.
    pub imm: Option<u32>,
}

/// The outcome of an operation as the core and the driver hand it up to the operation's
/// future: a success's few bytes, or a boxed error (failures are rare and allocate; a
/// success moves through every layer in two registers rather than as a 64-byte `Result`).
pub type Outcome = Result<OpInfo, Box<crate::error::Error>>;

/// Boxes the error of an [`Outcome`], out of line: the paths that may fail (building a
/// future, finishing an operation) stay small enough to be inlined into their callers.
#[cold]
#[inline(never)]
pub fn box_error(err: crate::error::Error) -> Box<crate::error::Error> {
    Box::new(err)
}
