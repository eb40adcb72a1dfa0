//! Per-queue-pair accounting: queued and posted requests, queue depths, the signaling policy
//! and the failure state.

use std::collections::VecDeque;

use super::wr::WorkRequest;
use crate::error::QpFailure;

/// Queue sizes and signaling policy of a queue pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpConfig {
    /// Send-queue depth: at most this many send requests are posted and not yet retired.
    pub sq_depth: u32,
    /// Receive-queue depth.
    pub rq_depth: u32,
    /// Request a completion for every `signal_every`-th send (1 = all). The last request of
    /// every post batch is always signaled.
    pub signal_every: u32,
}

impl QpConfig {
    /// A configuration with the given depths and signaling interval.
    pub fn new(sq_depth: u32, rq_depth: u32, signal_every: u32) -> QpConfig {
        QpConfig {
            sq_depth: sq_depth.max(1),
            rq_depth,
            signal_every: signal_every.max(1),
        }
    }
}

#[derive(Debug)]
pub(crate) struct QpSlot {
    pub(crate) cfg: QpConfig,
    /// Posted send-queue requests in post order (signaled and unsignaled), oldest first.
    pub(crate) sq_ring: VecDeque<u64>,
    /// Send requests waiting for queue space, with their requests (the table's entries say
    /// only `Queued`: the request moves once, from here to the device).
    pub(crate) sq_pending: VecDeque<(u64, WorkRequest)>,
    /// Receive requests waiting for queue space.
    pub(crate) rq_pending: VecDeque<(u64, WorkRequest)>,
    /// Posted receives not yet completed.
    pub(crate) rq_posted: u32,
    /// Unsignaled sends posted since the last signaled one.
    pub(crate) unsignaled_run: u32,
    /// Set once: why the queue pair stopped.
    pub(crate) failure: Option<QpFailure>,
}

impl QpSlot {
    pub(crate) fn new(cfg: QpConfig) -> QpSlot {
        QpSlot {
            cfg,
            sq_ring: VecDeque::new(),
            sq_pending: VecDeque::new(),
            rq_pending: VecDeque::new(),
            rq_posted: 0,
            unsignaled_run: 0,
            failure: None,
        }
    }

    pub(crate) fn sq_space(&self) -> usize {
        (self.cfg.sq_depth as usize).saturating_sub(self.sq_ring.len())
    }

    pub(crate) fn rq_space(&self) -> usize {
        self.cfg.rq_depth.saturating_sub(self.rq_posted) as usize
    }

    /// Decides whether the next posted send is signaled: every `signal_every`-th, the last of a
    /// post batch (so every future resolves without waiting for unrelated traffic), and any that
    /// fills the queue (so the queue cannot fill with unsignaled requests).
    pub(crate) fn next_signaled(&mut self, last_in_batch: bool) -> bool {
        let run = self.unsignaled_run + 1;
        let fills = self.sq_ring.len() + 1 >= self.cfg.sq_depth as usize;
        let signaled = last_in_batch || run >= self.cfg.signal_every.max(1) || fills;
        self.unsignaled_run = if signaled { 0 } else { run };
        signaled
    }

    pub(crate) fn has_postable(&self) -> bool {
        (!self.sq_pending.is_empty() && self.sq_space() > 0)
            || (!self.rq_pending.is_empty() && self.rq_space() > 0)
    }

    /// Requests queued or posted and not yet completed.
    pub(crate) fn outstanding(&self) -> usize {
        self.sq_ring.len() + self.sq_pending.len() + self.rq_pending.len() + self.rq_posted as usize
    }

    /// Posted requests the device still owes a completion for.
    pub(crate) fn posted(&self) -> usize {
        self.sq_ring.len() + self.rq_posted as usize
    }
}
