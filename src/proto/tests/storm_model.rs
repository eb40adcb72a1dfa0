//! The model behind the randomized storms.
#![allow(unused_imports)]

use super::*;

// ---------------------------------------------------------------------------------------------
// Randomized cancellation storm
// ---------------------------------------------------------------------------------------------
//
// A model of the driver and of a device drives one `Core` through random interleavings of
// submissions, posts, device progress, completion delivery, polls, drops, QP failures, closes,
// abandons and spurious completions. The device behaves like a real one: a QP's send queue
// executes in post order and only signaled sends (or failed/flushed ones) produce completions;
// receives complete in any order; an error moves the QP to ERR, after which everything posted is
// flushed. The model predicts every outcome, wake, release and counter, and every payload is a
// probe that checks, when dropped, that the device could no longer touch it and that it was not
// dropped before.

/// xorshift64*: small, deterministic, no dependency.
#[derive(Debug)]
pub(crate) struct Rng(pub(super) u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }

    pub(crate) fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `0..n` (n > 0).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// Uniform in `lo..=hi`.
    pub(super) fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }

    /// True with probability `num / den`.
    pub(super) fn chance(&mut self, num: u64, den: u64) -> bool {
        self.next() % den < num
    }
}

/// What a probe may check about its operation when it is dropped.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct ProbeState {
    /// Handed to the device by `take_postable`.
    pub(super) posted: bool,
    /// A completion covering it (its own, a later signaled one, or an abandon) was applied.
    pub(super) applied: bool,
    /// Times the payload was dropped.
    pub(super) releases: u32,
}

#[derive(Debug, Default)]
pub(super) struct Book {
    pub(super) ops: RefCell<Vec<ProbeState>>,
    pub(super) violations: RefCell<Vec<String>>,
}

/// A payload that records its own drop.
pub(super) struct Probe {
    pub(super) op: usize,
    pub(super) book: Rc<Book>,
}

impl std::fmt::Debug for Probe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Probe({})", self.op)
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        let mut ops = self.book.ops.borrow_mut();
        let st = &mut ops[self.op];
        let mut violations = self.book.violations.borrow_mut();
        if st.posted && !st.applied {
            violations.push(format!(
                "op {} released while the device could still touch it",
                self.op
            ));
        }
        if st.releases > 0 {
            violations.push(format!("op {} released twice", self.op));
        }
        st.releases += 1;
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum St {
    /// Submitted, waiting for queue space.
    Queued,
    /// Handed to the device, no completion applied yet.
    Posted,
    /// Outcome known, not collected.
    Done,
    /// Collected, given back by `cancel`, released, or rejected at submit.
    Gone,
}

#[derive(Debug, Clone, PartialEq)]
pub(super) enum Expect {
    Ok(OpInfo),
    Wc(WcStatus, u32),
    Failed(QpFailure),
}

pub(super) fn outcome_matches(res: &crate::proto::Outcome, exp: &Expect) -> bool {
    match (res.as_ref().map_err(|e| &**e), exp) {
        (Ok(got), Expect::Ok(want)) => got == want,
        (
            Err(Error::QpFailed(QpFailure::WorkCompletion { status, vendor_err })),
            Expect::Wc(s, v),
        ) => status == s && vendor_err == v,
        (Err(Error::QpFailed(got)), Expect::Failed(want)) => got == want,
        _ => false,
    }
}

#[derive(Debug)]
pub(super) struct OpModel {
    pub(super) wr_id: u64,
    pub(super) qp: usize,
    pub(super) queue: Queue,
    pub(super) st: St,
    /// The future was dropped while the request was posted: the payload is parked.
    pub(super) parked: bool,
    pub(super) polled: bool,
    pub(super) expect: Option<Expect>,
    pub(super) wakers: [Arc<WakeCounter>; 2],
    /// The waker the core currently holds for it.
    pub(super) registered: Option<usize>,
    /// The waker its completion had to wake.
    pub(super) must_wake: Option<usize>,
}

#[derive(Debug)]
pub(super) struct QpModel {
    pub(super) key: QpKey,
    pub(super) cfg: QpConfig,
    pub(super) cause: Option<QpFailure>,
    pub(super) removed: bool,
    /// Queued in the core.
    pub(super) pend_sq: VecDeque<usize>,
    pub(super) pend_rq: VecDeque<usize>,
    /// Posted sends not retired by an applied completion (the core's view), in post order.
    pub(super) ring: VecDeque<usize>,
    /// Posted receives whose completion was not applied.
    pub(super) rq_posted: Vec<usize>,
    /// The signaling run.
    pub(super) run: u32,
    /// Device side: posted sends not executed yet (with their signaled flag), in order.
    pub(super) dev_sq: VecDeque<(usize, bool)>,
    /// Device side: posted receives not consumed yet.
    pub(super) dev_rq: Vec<usize>,
    /// The device QP is in the error state: everything left is flushed.
    pub(super) dev_err: bool,
}

impl QpModel {
    pub(super) fn outstanding(&self) -> usize {
        self.ring.len() + self.rq_posted.len() + self.pend_sq.len() + self.pend_rq.len()
    }
}

#[derive(Debug, Default)]
pub(super) struct Stats {
    pub(super) steps: u64,
    pub(super) submitted: u64,
    pub(super) rejected: u64,
    pub(super) sends: u64,
    pub(super) recvs: u64,
    pub(super) signaled: u64,
    pub(super) unsignaled: u64,
    pub(super) cqes: u64,
    pub(super) errors: u64,
    pub(super) flushes: u64,
    pub(super) retired: u64,
    pub(super) spurious: u64,
    pub(super) unknown: u64,
    pub(super) closes: u64,
    pub(super) abandons: u64,
    pub(super) qps_replaced: u64,
    pub(super) refused_removals: u64,
    pub(super) post_failures: u64,
    pub(super) collected_ok: u64,
    pub(super) collected_err: u64,
    pub(super) drop_queued: u64,
    pub(super) drop_posted: u64,
    pub(super) drop_done: u64,
    pub(super) drop_unpolled: u64,
    pub(super) released_parked: u64,
    pub(super) wakes: u64,
    pub(super) max_live: usize,
}

pub(super) const SEND_ERRORS: [WcStatus; 5] = [
    WcStatus::RemAccessErr,
    WcStatus::RetryExcErr,
    WcStatus::RnrRetryExcErr,
    WcStatus::LocProtErr,
    WcStatus::RemOpErr,
];
pub(super) const RECV_ERRORS: [WcStatus; 3] = [
    WcStatus::LocLenErr,
    WcStatus::LocProtErr,
    WcStatus::LocAccessErr,
];

#[derive(Debug)]
pub(super) struct Storm {
    pub(super) seed: u64,
    pub(super) rng: Rng,
    pub(super) core: Core<Probe>,
    pub(super) book: Rc<Book>,
    pub(super) ops: Vec<OpModel>,
    pub(super) qps: Vec<QpModel>,
    pub(super) active: Vec<usize>,
    /// The completion queue: completions in generation order, with the op they belong to
    /// (`None` for injected spurious ones).
    pub(super) cq: VecDeque<(Cqe, Option<usize>)>,
    /// Ops whose future is alive (not collected, not dropped).
    pub(super) live: Vec<usize>,
    pub(super) in_table: usize,
    pub(super) out: Completed<Probe>,
    /// Per device event, an error with probability 1 / `err_den`.
    pub(super) err_den: u64,
    pub(super) max_depth: usize,
    pub(super) stats: Stats,
}
