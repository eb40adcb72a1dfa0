//! Work requests: scatter/gather entries, send-queue requests and receive requests, and their
//! translation into chained `ibv_send_wr` / `ibv_recv_wr` lists (one doorbell per post).

use std::fmt;
use std::mem::MaybeUninit;

use crate::error::{Error, Result};
use crate::sys;

/// A scatter/gather entry: `length` bytes at `addr`, inside a region registered with `lkey`.
/// Laid out as `struct ibv_sge`.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct Sge(sys::ibv_sge);

impl Sge {
    /// An empty entry (no address, no length, no key): a placeholder in fixed arrays.
    pub const ZERO: Sge = Sge(sys::ibv_sge {
        addr: 0,
        length: 0,
        lkey: 0,
    });

    /// An entry covering `length` bytes at `addr` of the region with local key `lkey`.
    #[inline]
    pub fn new(addr: u64, length: u32, lkey: u32) -> Sge {
        Sge(sys::ibv_sge { addr, length, lkey })
    }

    /// Start address.
    #[inline]
    pub fn addr(&self) -> u64 {
        self.0.addr
    }

    /// Length in bytes.
    #[inline]
    pub fn length(&self) -> u32 {
        self.0.length
    }

    /// Local key of the covering region.
    pub fn lkey(&self) -> u32 {
        self.0.lkey
    }
}

impl fmt::Debug for Sge {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sge")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("length", &self.length())
            .finish_non_exhaustive()
    }
}

/// The operation of a send-queue work request. Remote addresses and keys come from the peer.
#[derive(Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SendOp {
    /// Two-sided send: consumes a receive at the peer.
    Send,
    /// Send with 32-bit immediate data (host byte order here).
    SendWithImm(u32),
    /// One-sided write into remote memory.
    Write {
        /// Remote virtual address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
    },
    /// One-sided write that also consumes a receive at the peer carrying `imm`.
    WriteWithImm {
        /// Remote virtual address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
        /// Immediate data (host byte order).
        imm: u32,
    },
    /// One-sided read from remote memory into the local scatter list.
    Read {
        /// Remote virtual address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
    },
    /// 64-bit atomic compare-and-swap at an 8-byte aligned remote address; the previous value
    /// lands in the (8-byte) local buffer.
    CompareSwap {
        /// Remote virtual address (8-byte aligned).
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
        /// Expected value.
        compare: u64,
        /// Value written if the expected one is found.
        swap: u64,
    },
    /// 64-bit atomic fetch-and-add; the previous value lands in the local buffer.
    FetchAdd {
        /// Remote virtual address (8-byte aligned).
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
        /// Value to add.
        add: u64,
    },
}

impl fmt::Debug for SendOp {
    // rkeys are capabilities: never print them.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SendOp::Send => f.write_str("Send"),
            SendOp::SendWithImm(imm) => write!(f, "SendWithImm({imm:#x})"),
            SendOp::Write { remote_addr, .. } => write!(f, "Write({remote_addr:#x})"),
            SendOp::WriteWithImm {
                remote_addr, imm, ..
            } => {
                write!(f, "WriteWithImm({remote_addr:#x}, imm {imm:#x})")
            }
            SendOp::Read { remote_addr, .. } => write!(f, "Read({remote_addr:#x})"),
            SendOp::CompareSwap { remote_addr, .. } => write!(f, "CompareSwap({remote_addr:#x})"),
            SendOp::FetchAdd { remote_addr, .. } => write!(f, "FetchAdd({remote_addr:#x})"),
        }
    }
}

/// A send-queue work request.
///
/// # Examples
///
/// ```
/// use tokio_rdma::verbs::{SendOp, SendWr, Sge};
/// let sges = [Sge::new(0x1000, 64, 0x42)];
/// let wr = SendWr::new(7, SendOp::Send, &sges).signaled(true).inline(true);
/// assert_eq!(wr.wr_id, 7);
/// ```
#[derive(Debug, Clone, Copy)]
pub struct SendWr<'a> {
    /// Identifier returned in the work completion.
    pub wr_id: u64,
    /// The operation.
    pub op: SendOp,
    /// Local memory to send from (or read into).
    pub sges: &'a [Sge],
    /// Generate a completion for this request (`IBV_SEND_SIGNALED`).
    pub signaled: bool,
    /// Copy the payload into the work request (`IBV_SEND_INLINE`); the buffers may be reused as
    /// soon as the post returns, and lkeys are not checked.
    pub inline: bool,
    /// Set the solicited-event bit (`IBV_SEND_SOLICITED`).
    pub solicited: bool,
    /// Wait for prior RDMA READ/atomics to finish first (`IBV_SEND_FENCE`).
    pub fence: bool,
}

impl<'a> SendWr<'a> {
    /// A placeholder (zero-length signaled SEND, `wr_id` 0) for fixed arrays of requests.
    pub const EMPTY: SendWr<'static> = SendWr {
        wr_id: 0,
        op: SendOp::Send,
        sges: &[],
        signaled: true,
        inline: false,
        solicited: false,
        fence: false,
    };

    /// A signaled request with no other flags.
    pub fn new(wr_id: u64, op: SendOp, sges: &'a [Sge]) -> SendWr<'a> {
        SendWr {
            wr_id,
            op,
            sges,
            signaled: true,
            inline: false,
            solicited: false,
            fence: false,
        }
    }

    /// Sets [`signaled`](Self::signaled).
    pub fn signaled(mut self, yes: bool) -> Self {
        self.signaled = yes;
        self
    }

    /// Sets [`inline`](Self::inline).
    pub fn inline(mut self, yes: bool) -> Self {
        self.inline = yes;
        self
    }

    /// Sets [`solicited`](Self::solicited).
    pub fn solicited(mut self, yes: bool) -> Self {
        self.solicited = yes;
        self
    }

    /// Total payload length of the scatter/gather list.
    pub fn len(&self) -> u64 {
        self.sges.iter().map(|s| u64::from(s.length())).sum()
    }

    /// Whether the payload is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Fills a raw `ibv_send_wr`, its `next` link NULL.
    pub(crate) fn raw(&self) -> sys::ibv_send_wr {
        let mut raw = sys::ibv_send_wr {
            wr_id: self.wr_id,
            // The verbs never write through sg_list; the cast only satisfies the C signature.
            sg_list: self.sges.as_ptr().cast::<sys::ibv_sge>().cast_mut(),
            num_sge: i32::try_from(self.sges.len()).unwrap_or(i32::MAX),
            ..Default::default()
        };
        let mut flags = 0;
        if self.signaled {
            flags |= sys::IBV_SEND_SIGNALED;
        }
        if self.inline {
            flags |= sys::IBV_SEND_INLINE;
        }
        if self.solicited {
            flags |= sys::IBV_SEND_SOLICITED;
        }
        if self.fence {
            flags |= sys::IBV_SEND_FENCE;
        }
        raw.send_flags = flags;
        let rdma = |remote_addr, rkey| sys::ibv_send_wr__bindgen_ty_2 {
            rdma: sys::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr, rkey },
        };
        let atomic = |remote_addr, rkey, compare_add, swap| sys::ibv_send_wr__bindgen_ty_2 {
            atomic: sys::ibv_send_wr__bindgen_ty_2__bindgen_ty_2 {
                remote_addr,
                compare_add,
                swap,
                rkey,
            },
        };
        match self.op {
            SendOp::Send => raw.opcode = sys::IBV_WR_SEND,
            SendOp::SendWithImm(imm) => {
                raw.opcode = sys::IBV_WR_SEND_WITH_IMM;
                raw.__bindgen_anon_1.imm_data = imm.to_be();
            }
            SendOp::Write { remote_addr, rkey } => {
                raw.opcode = sys::IBV_WR_RDMA_WRITE;
                raw.wr = rdma(remote_addr, rkey);
            }
            SendOp::WriteWithImm {
                remote_addr,
                rkey,
                imm,
            } => {
                raw.opcode = sys::IBV_WR_RDMA_WRITE_WITH_IMM;
                raw.wr = rdma(remote_addr, rkey);
                raw.__bindgen_anon_1.imm_data = imm.to_be();
            }
            SendOp::Read { remote_addr, rkey } => {
                raw.opcode = sys::IBV_WR_RDMA_READ;
                raw.wr = rdma(remote_addr, rkey);
            }
            SendOp::CompareSwap {
                remote_addr,
                rkey,
                compare,
                swap,
            } => {
                raw.opcode = sys::IBV_WR_ATOMIC_CMP_AND_SWP;
                raw.wr = atomic(remote_addr, rkey, compare, swap);
            }
            SendOp::FetchAdd {
                remote_addr,
                rkey,
                add,
            } => {
                raw.opcode = sys::IBV_WR_ATOMIC_FETCH_AND_ADD;
                raw.wr = atomic(remote_addr, rkey, add, 0);
            }
        }
        raw
    }
}

/// A receive-queue work request.
#[derive(Debug, Clone, Copy)]
pub struct RecvWr<'a> {
    /// Identifier returned in the work completion.
    pub wr_id: u64,
    /// Where the incoming payload lands.
    pub sges: &'a [Sge],
}

impl<'a> RecvWr<'a> {
    /// A placeholder (no entries, `wr_id` 0) for fixed arrays of requests.
    pub const EMPTY: RecvWr<'static> = RecvWr {
        wr_id: 0,
        sges: &[],
    };

    /// A receive request into `sges`.
    pub fn new(wr_id: u64, sges: &'a [Sge]) -> RecvWr<'a> {
        RecvWr { wr_id, sges }
    }

    pub(crate) fn raw(&self) -> sys::ibv_recv_wr {
        sys::ibv_recv_wr {
            wr_id: self.wr_id,
            next: std::ptr::null_mut(),
            sg_list: self.sges.as_ptr().cast::<sys::ibv_sge>().cast_mut(),
            num_sge: i32::try_from(self.sges.len()).unwrap_or(i32::MAX),
        }
    }
}

/// Number of work requests chained on the stack before falling back to a heap list.
pub(crate) const STACK_CHAIN: usize = 64;

/// Builds a chained list of raw requests in `storage` and returns the head pointer.
/// `link` sets the `next` field of element `i` to point at element `i + 1`.
pub(crate) fn chain<T>(storage: &mut [T], mut link: impl FnMut(&mut T, *mut T)) -> *mut T {
    let n = storage.len();
    // All accesses below go through `base`, so the returned head stays valid (no reborrow of
    // `storage` invalidates it).
    let base = storage.as_mut_ptr();
    for i in 0..n {
        let next = if i + 1 < n {
            // SAFETY: `i + 1 < n`, so the pointer stays inside `storage`.
            unsafe { base.add(i + 1) }
        } else {
            std::ptr::null_mut()
        };
        // SAFETY: `i < n`; no other reference to element `i` exists during this call.
        link(unsafe { &mut *base.add(i) }, next);
    }
    base
}

/// A work request that posts as a chained list: its C form, the form's `next` link, and the
/// error naming the first request a failed post did not take.
pub(crate) trait Chained {
    /// The C request (`ibv_send_wr`, `ibv_recv_wr`), its `next` left NULL by [`raw`](Self::raw).
    type Raw;
    fn raw(&self) -> Self::Raw;
    fn link(raw: &mut Self::Raw, next: *mut Self::Raw);
    fn post_error(bad_index: usize, source: std::io::Error) -> Error;
}

impl Chained for SendWr<'_> {
    type Raw = sys::ibv_send_wr;

    #[inline]
    fn raw(&self) -> sys::ibv_send_wr {
        SendWr::raw(self)
    }

    #[inline]
    fn link(raw: &mut sys::ibv_send_wr, next: *mut sys::ibv_send_wr) {
        raw.next = next;
    }

    fn post_error(bad_index: usize, source: std::io::Error) -> Error {
        Error::PostSend { bad_index, source }
    }
}

impl Chained for RecvWr<'_> {
    type Raw = sys::ibv_recv_wr;

    #[inline]
    fn raw(&self) -> sys::ibv_recv_wr {
        RecvWr::raw(self)
    }

    #[inline]
    fn link(raw: &mut sys::ibv_recv_wr, next: *mut sys::ibv_recv_wr) {
        raw.next = next;
    }

    fn post_error(bad_index: usize, source: std::io::Error) -> Error {
        Error::PostRecv { bad_index, source }
    }
}

/// Hands `wrs` to `post` (a queue pair's `ibv_post_send` or `ibv_post_recv`, or a shared
/// receive queue's `ibv_post_srq_recv`, returning its code) as one NULL-terminated list: a
/// lone request (every latency-bound operation) as it is, more chained on the stack up to
/// `STACK_CHAIN`, beyond that in a `Vec`.
///
/// # Safety
///
/// As [`QueuePair::post_send`](super::QueuePair::post_send) and
/// [`QueuePair::post_recv`](super::QueuePair::post_recv): the memory of every request stays
/// valid until its completion.
pub(crate) unsafe fn post_chain<W: Chained>(
    wrs: &[W],
    post: impl FnOnce(*mut W::Raw, &mut *mut W::Raw) -> i32,
) -> Result<()> {
    match wrs {
        [] => return Ok(()),
        // SAFETY: as this function's contract.
        [one] => return unsafe { post_single(one, post) },
        _ => {}
    }
    let mut bad: *mut W::Raw = std::ptr::null_mut();
    let mut stack: [MaybeUninit<W::Raw>; STACK_CHAIN] =
        [const { MaybeUninit::uninit() }; STACK_CHAIN];
    let mut heap = Vec::new();
    let list: &mut [W::Raw] = if wrs.len() <= STACK_CHAIN {
        for (slot, wr) in stack.iter_mut().zip(wrs) {
            slot.write(wr.raw());
        }
        // SAFETY: the first `wrs.len()` slots were initialised just above.
        unsafe { std::slice::from_raw_parts_mut(stack.as_mut_ptr().cast(), wrs.len()) }
    } else {
        heap.extend(wrs.iter().map(W::raw));
        &mut heap
    };
    let head = chain(list, W::link);
    let rc = post(head, &mut bad);
    if rc != 0 {
        let bad_index = bad_index(head, bad, wrs.len());
        return Err(Error::code(rc, |source| W::post_error(bad_index, source)));
    }
    Ok(())
}

/// Posts one request: no chain to build (`raw()` leaves `next` NULL), no room reserved for
/// one on the stack (a driver operation's common case, see [`post_chain`]).
///
/// # Safety
///
/// As [`post_chain`].
#[inline]
pub(crate) unsafe fn post_single<W: Chained>(
    wr: &W,
    post: impl FnOnce(*mut W::Raw, &mut *mut W::Raw) -> i32,
) -> Result<()> {
    let mut bad: *mut W::Raw = std::ptr::null_mut();
    let mut raw = wr.raw();
    let rc = post(&mut raw, &mut bad);
    if rc != 0 {
        return Err(Error::code(rc, |source| W::post_error(0, source)));
    }
    Ok(())
}

pub(crate) fn bad_index<T>(head: *mut T, bad: *mut T, len: usize) -> usize {
    if bad.is_null() {
        return 0;
    }
    let offset = (bad as usize).wrapping_sub(head as usize) / std::mem::size_of::<T>();
    offset.min(len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn send_wr_translation() {
        let sges = [Sge::new(0x1000, 10, 1), Sge::new(0x2000, 6, 1)];
        let wr = SendWr::new(
            9,
            SendOp::WriteWithImm {
                remote_addr: 0xabc,
                rkey: 5,
                imm: 0x01020304,
            },
            &sges,
        )
        .inline(true);
        assert_eq!(wr.len(), 16);
        let raw = wr.raw();
        assert!(raw.next.is_null(), "a lone request is posted as it is");
        assert_eq!(raw.opcode, sys::IBV_WR_RDMA_WRITE_WITH_IMM);
        assert_eq!(raw.num_sge, 2);
        assert_eq!(
            raw.send_flags,
            sys::IBV_SEND_SIGNALED | sys::IBV_SEND_INLINE
        );
        // SAFETY: the union was written through `imm_data` / `rdma` just above.
        unsafe {
            assert_eq!(raw.__bindgen_anon_1.imm_data, 0x01020304u32.to_be());
            assert_eq!(raw.wr.rdma.remote_addr, 0xabc);
            assert_eq!(raw.wr.rdma.rkey, 5);
        }
    }

    #[test]
    fn atomic_translation() {
        let sges = [Sge::new(0x1000, 8, 1)];
        let raw = SendWr::new(
            1,
            SendOp::FetchAdd {
                remote_addr: 8,
                rkey: 3,
                add: 5,
            },
            &sges,
        )
        .signaled(false)
        .raw();
        assert_eq!(raw.opcode, sys::IBV_WR_ATOMIC_FETCH_AND_ADD);
        assert_eq!(raw.send_flags, 0);
        // SAFETY: written through `atomic` above.
        unsafe { assert_eq!(raw.wr.atomic.compare_add, 5) };
    }

    #[test]
    fn chain_links_in_order() {
        let mut v = vec![(0usize, std::ptr::null_mut::<()>()); 3];
        let head = chain(&mut v, |e, next| e.1 = next.cast());
        assert_eq!(head.cast_const(), v.as_ptr());
        assert_eq!(
            v[0].1.cast_const(),
            (&v[1] as *const (usize, *mut ())).cast()
        );
        assert!(v[2].1.is_null());
    }

    #[test]
    fn rkeys_are_not_printed() {
        let op = SendOp::Read {
            remote_addr: 0x10,
            rkey: 0xdeadbeef,
        };
        assert!(!format!("{op:?}").contains("deadbeef"));
    }
}
