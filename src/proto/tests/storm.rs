//! Randomized cancellation storms against the model.
#![allow(unused_imports)]

use super::storm_model::*;
use super::*;

impl Storm {
    pub(super) fn new(seed: u64, qps: usize, max_depth: usize, err_den: u64) -> Storm {
        let mut s = Storm {
            seed,
            rng: Rng::new(seed),
            core: Core::new(),
            book: Rc::new(Book::default()),
            ops: Vec::new(),
            qps: Vec::new(),
            active: Vec::new(),
            cq: VecDeque::new(),
            live: Vec::new(),
            in_table: 0,
            out: Completed::default(),
            err_den,
            max_depth,
            stats: Stats::default(),
        };
        for _ in 0..qps {
            s.add_qp();
        }
        s
    }

    fn add_qp(&mut self) {
        let sq = self.rng.range(1, self.max_depth);
        let rq = self.rng.range(1, self.max_depth.min(8));
        let every = if self.rng.chance(1, 10) {
            1000
        } else {
            self.rng.range(1, 8)
        };
        let cfg = QpConfig::new(sq as u32, rq as u32, every as u32);
        let key = self.core.add_qp(cfg).expect("room for a queue pair");
        // Never a key still in use, nor (generations) one of the recently removed queue pairs:
        // their late completions and stale futures must not reach the new one.
        assert!(
            self.qps.iter().rev().take(1000).all(|q| q.key != key),
            "seed {}: key {key:?} handed out twice",
            self.seed
        );
        self.qps.push(QpModel {
            key,
            cfg,
            cause: None,
            removed: false,
            pend_sq: VecDeque::new(),
            pend_rq: VecDeque::new(),
            ring: VecDeque::new(),
            rq_posted: Vec::new(),
            run: 0,
            dev_sq: VecDeque::new(),
            dev_rq: Vec::new(),
            dev_err: false,
        });
        self.active.push(self.qps.len() - 1);
    }

    fn qp_of_key(&self, key: QpKey) -> usize {
        *self
            .active
            .iter()
            .find(|&&qi| self.qps[qi].key == key)
            .unwrap_or_else(|| panic!("seed {}: {key:?} is not an active QP", self.seed))
    }

    // --- the futures' side ---------------------------------------------------------------

    fn submit_batch(&mut self, qi: usize) {
        let n = self.rng.range(1, 8);
        for _ in 0..n {
            let queue = if self.rng.chance(3, 10) {
                Queue::Recv
            } else {
                Queue::Send
            };
            let id = self.ops.len();
            self.ops.push(OpModel {
                wr_id: u64::MAX,
                qp: qi,
                queue,
                st: St::Gone,
                parked: false,
                polled: false,
                expect: None,
                wakers: [WakeCounter::new(), WakeCounter::new()],
                registered: None,
                must_wake: None,
            });
            self.book.ops.borrow_mut().push(ProbeState::default());
            let wr = match queue {
                Queue::Send => send_wr(),
                Queue::Recv => recv_wr(),
            };
            let probe = Probe {
                op: id,
                book: self.book.clone(),
            };
            match self.core.submit(self.qps[qi].key, wr, probe) {
                Ok(sub) => {
                    let q = &mut self.qps[qi];
                    assert!(
                        q.cause.is_none(),
                        "seed {}: submit on a failed QP was accepted",
                        self.seed
                    );
                    match queue {
                        Queue::Send => q.pend_sq.push_back(id),
                        Queue::Recv => q.pend_rq.push_back(id),
                    }
                    let op = &mut self.ops[id];
                    op.wr_id = sub.wr_id;
                    op.st = St::Queued;
                    self.live.push(id);
                    self.in_table += 1;
                    self.stats.submitted += 1;
                    if self.rng.chance(3, 10) {
                        self.poll_live(self.live.len() - 1);
                    }
                }
                Err((err, payload)) => {
                    let cause = self.qps[qi].cause.clone().unwrap_or_else(|| {
                        panic!("seed {}: submit on a healthy QP failed: {err:?}", self.seed)
                    });
                    assert!(
                        outcome_matches(&Err(Box::new(err)), &Expect::Failed(cause)),
                        "seed {}: wrong fast failure",
                        self.seed
                    );
                    assert_eq!(payload.op, id, "seed {}: someone else's payload", self.seed);
                    drop(payload);
                    self.stats.rejected += 1;
                }
            }
        }
        if self.rng.chance(1, 10) {
            // The lock was released between submitting and posting: completions ran.
            let k = self.rng.range(1, 8);
            self.deliver(k);
        }
        self.post(qi);
    }

    fn poll_live(&mut self, i: usize) {
        let id = self.live[i];
        let op = &mut self.ops[id];
        let which = match op.registered {
            Some(r) if !self.rng.chance(1, 10) => r,
            _ => self.rng.below(2),
        };
        // A fresh `Waker` each time: the same counter `will_wake`, the other one does not.
        let w = waker_of(&op.wakers[which]);
        op.polled = true;
        match self.core.poll_op(op.wr_id, &mut Context::from_waker(&w)) {
            Poll::Pending => {
                assert!(
                    matches!(op.st, St::Queued | St::Posted),
                    "seed {}: op {id} pending in state {:?}",
                    self.seed,
                    op.st
                );
                op.registered = Some(which);
            }
            Poll::Ready((res, payload)) => {
                assert_eq!(
                    op.st,
                    St::Done,
                    "seed {}: op {id} ready too early",
                    self.seed
                );
                assert_eq!(payload.op, id, "seed {}: someone else's payload", self.seed);
                let exp = op.expect.take().expect("done ops have an expectation");
                assert!(
                    outcome_matches(&res, &exp),
                    "seed {}: op {id}: got {res:?}, want {exp:?}",
                    self.seed
                );
                if let Some(r) = op.must_wake {
                    assert_eq!(
                        op.wakers[r].count(),
                        1,
                        "seed {}: op {id} ready but its waker was not woken",
                        self.seed
                    );
                }
                if res.is_ok() {
                    self.stats.collected_ok += 1;
                } else {
                    self.stats.collected_err += 1;
                }
                op.st = St::Gone;
                self.in_table -= 1;
                self.live.swap_remove(i);
                drop(payload);
            }
        }
    }

    /// A live op to drop: aims at a random state (queued, posted, completed, never polled) so
    /// that every kind of drop is common, whatever the mix of the live set.
    fn pick_drop_target(&mut self) -> Option<usize> {
        if self.live.is_empty() {
            return None;
        }
        let aim = self.rng.below(4);
        let mut i = self.rng.below(self.live.len());
        for _ in 0..16 {
            let op = &self.ops[self.live[i]];
            let hit = match aim {
                0 => op.st == St::Queued,
                1 => op.st == St::Posted,
                2 => op.st == St::Done,
                _ => !op.polled,
            };
            if hit {
                break;
            }
            i = self.rng.below(self.live.len());
        }
        Some(i)
    }

    /// Drops the future of `live[i]`.
    fn drop_live(&mut self, i: usize) {
        let id = self.live.swap_remove(i);
        let op = &mut self.ops[id];
        if !op.polled {
            self.stats.drop_unpolled += 1;
        }
        let back = self.core.cancel(op.wr_id);
        match op.st {
            St::Queued => {
                let payload = back.unwrap_or_else(|| {
                    panic!("seed {}: queued op {id} kept its payload", self.seed)
                });
                assert_eq!(payload.op, id);
                let q = &mut self.qps[op.qp];
                let list = match op.queue {
                    Queue::Send => &mut q.pend_sq,
                    Queue::Recv => &mut q.pend_rq,
                };
                let pos = list
                    .iter()
                    .position(|&x| x == id)
                    .expect("queued in the model");
                list.remove(pos);
                op.st = St::Gone;
                op.registered = None;
                self.in_table -= 1;
                self.stats.drop_queued += 1;
                drop(payload);
            }
            St::Posted => {
                assert!(
                    back.is_none(),
                    "seed {}: posted op {id} gave its payload back",
                    self.seed
                );
                op.parked = true;
                op.registered = None;
                self.stats.drop_posted += 1;
            }
            St::Done => {
                let payload = back.unwrap_or_else(|| {
                    panic!("seed {}: completed op {id} kept its payload", self.seed)
                });
                assert_eq!(payload.op, id);
                op.st = St::Gone;
                self.in_table -= 1;
                self.stats.drop_done += 1;
                drop(payload);
            }
            St::Gone => unreachable!("live ops are not gone"),
        }
    }

    // --- the driver's side ---------------------------------------------------------------

    /// `take_postable` for `qi`, checked against the model, and handed to the device.
    fn post(&mut self, qi: usize) {
        let mut items = Vec::new();
        self.core.take_postable(self.qps[qi].key, &mut items);
        let Storm {
            qps,
            ops,
            book,
            stats,
            ..
        } = self;
        let q = &mut qps[qi];
        if q.cause.is_some() {
            assert!(items.is_empty(), "seed {}: a failed QP posted", self.seed);
            return;
        }
        let depth = q.cfg.sq_depth as usize;
        let every = q.cfg.signal_every;
        let nr = (q.cfg.rq_depth as usize - q.rq_posted.len()).min(q.pend_rq.len());
        let ns = (depth - q.ring.len()).min(q.pend_sq.len());
        assert_eq!(items.len(), nr + ns, "seed {}: wrong batch size", self.seed);
        let mut book = book.ops.borrow_mut();
        for (i, item) in items.iter().enumerate() {
            let id = if i < nr {
                q.pend_rq.pop_front()
            } else {
                q.pend_sq.pop_front()
            }
            .expect("counted");
            let op = &mut ops[id];
            assert_eq!(
                item.wr_id, op.wr_id,
                "seed {}: posted out of order",
                self.seed
            );
            assert_eq!(item.wr.queue, op.queue);
            if i < nr {
                assert!(item.signaled, "receives are always signaled");
                q.rq_posted.push(id);
                q.dev_rq.push(id);
                stats.recvs += 1;
            } else {
                let j = i - nr;
                q.run += 1;
                let want = q.run == every || j + 1 == ns || q.ring.len() + 1 == depth;
                if want {
                    q.run = 0;
                }
                assert_eq!(
                    item.signaled,
                    want,
                    "seed {}: signaling of send {j}/{ns} (ring {}, depth {depth}, every {every})",
                    self.seed,
                    q.ring.len()
                );
                q.ring.push_back(id);
                q.dev_sq.push_back((id, want));
                stats.sends += 1;
                if want {
                    stats.signaled += 1;
                } else {
                    stats.unsignaled += 1;
                }
            }
            op.st = St::Posted;
            book[id].posted = true;
        }
        drop(book);
        if !items.is_empty() && self.rng.chance(1, 300) {
            self.post_fails(qi, &items, nr);
        }
    }

    /// `ibv_post_recv` / `ibv_post_send` rejected the request at some index, as the driver
    /// handles it: receives are posted first; if they fail, nothing after is posted.
    ///
    /// The device model moves the QP to ERR before it executes anything of this batch, so the
    /// posted prefix is flushed. (If it executed unsignaled sends of the prefix first, nothing
    /// would ever retire them: see the report on `post_failed`.)
    fn post_fails(&mut self, qi: usize, items: &[PostItem], nr: usize) {
        let ns = items.len() - nr;
        let first_bad = if nr > 0 && (ns == 0 || self.rng.chance(1, 2)) {
            self.rng.below(nr)
        } else {
            nr + self.rng.below(ns)
        };
        let not_posted: Vec<u64> = items[first_bad..].iter().map(|p| p.wr_id).collect();
        let ids: Vec<usize> = {
            let q = &self.qps[qi];
            let mut ids: Vec<usize> = q.ring.iter().chain(&q.rq_posted).copied().collect();
            ids.retain(|&id| not_posted.contains(&self.ops[id].wr_id));
            ids
        };
        assert_eq!(ids.len(), not_posted.len());
        {
            let q = &mut self.qps[qi];
            q.ring.retain(|id| !ids.contains(id));
            q.rq_posted.retain(|id| !ids.contains(id));
            q.dev_sq.retain(|(id, _)| !ids.contains(id));
            q.dev_rq.retain(|id| !ids.contains(id));
            q.dev_err = true;
            let mut book = self.book.ops.borrow_mut();
            for &id in &ids {
                book[id].posted = false; // never reached the device
            }
        }
        // Sometimes a future of an unposted request is dropped before the failure is handled.
        if let Some(&victim) = ids.get(self.rng.below(ids.len() * 2)) {
            if let Some(i) = self.live.iter().position(|&x| x == victim) {
                self.drop_live(i);
            }
        }
        let errno = [libc::EINVAL, libc::ENOMEM][self.rng.below(2)];
        let mut failed = Vec::new();
        let mut released = Vec::new();
        let cause = self.fail_model(qi, QpFailure::PostFailed(errno), &mut failed, &mut released);
        for &id in &ids {
            self.done(id, Expect::Failed(cause.clone()), &mut released);
        }
        let mut out = Completed::default();
        self.core
            .post_failed(self.qps[qi].key, &not_posted, errno, &mut out);
        self.stats.post_failures += 1;
        self.settle_out(&mut out, 0, &failed, released);
    }

    /// The model's side of a completion being applied to op `id` (queued or posted).
    fn done(&mut self, id: usize, exp: Expect, released: &mut Vec<usize>) {
        self.book.ops.borrow_mut()[id].applied = true;
        let op = &mut self.ops[id];
        assert!(
            matches!(op.st, St::Queued | St::Posted),
            "op {id} done twice"
        );
        if op.parked {
            op.st = St::Gone;
            self.in_table -= 1;
            released.push(id);
        } else {
            op.st = St::Done;
            op.expect = Some(exp);
            op.must_wake = op.registered;
        }
    }

    /// The model's side of `fail_qp`: records the cause (first wins) and fails queued ops.
    fn fail_model(
        &mut self,
        qi: usize,
        cause: QpFailure,
        failed: &mut Vec<QpKey>,
        released: &mut Vec<usize>,
    ) -> QpFailure {
        let q = &mut self.qps[qi];
        if q.cause.is_none() {
            q.cause = Some(cause);
            failed.push(q.key);
        }
        let cause = q.cause.clone().expect("set");
        let queued: Vec<usize> = q.pend_sq.drain(..).chain(q.pend_rq.drain(..)).collect();
        for id in queued {
            self.done(id, Expect::Failed(cause.clone()), released);
        }
        cause
    }

    /// The model's side of applying a completion for posted op `id`.
    fn apply(&mut self, id: usize, cqe: &Cqe, failed: &mut Vec<QpKey>, released: &mut Vec<usize>) {
        let qi = self.ops[id].qp;
        match self.ops[id].queue {
            Queue::Send => loop {
                let front = self.qps[qi].ring.pop_front().unwrap_or_else(|| {
                    panic!("seed {}: completion for a send not in the ring", self.seed)
                });
                if front == id {
                    break;
                }
                self.stats.retired += 1;
                self.done(front, Expect::Ok(OpInfo::default()), released);
            },
            Queue::Recv => {
                let q = &mut self.qps[qi];
                let pos = q.rq_posted.iter().position(|&x| x == id).expect("posted");
                q.rq_posted.swap_remove(pos);
            }
        }
        let exp = match cqe.status {
            WcStatus::Success => Expect::Ok(OpInfo {
                byte_len: cqe.byte_len,
                imm: cqe.imm,
            }),
            WcStatus::WrFlushErr => {
                Expect::Failed(self.fail_model(qi, QpFailure::Flushed, failed, released))
            }
            status => {
                let cause = QpFailure::WorkCompletion {
                    status,
                    vendor_err: cqe.vendor_err,
                };
                self.fail_model(qi, cause, failed, released);
                Expect::Wc(status, cqe.vendor_err)
            }
        };
        self.done(id, exp, released);
    }

    /// Checks `self.out` against the model's predictions, then acts on it like the driver:
    /// posts the postable QPs, moves failed ones to ERR, wakes, and drops released payloads.
    fn settle(&mut self, unknown: u64, failed: &[QpKey], released: Vec<usize>) {
        let mut out = std::mem::take(&mut self.out);
        self.settle_out(&mut out, unknown, failed, released);
        self.out = out;
    }

    fn settle_out(
        &mut self,
        out: &mut Completed<Probe>,
        unknown: u64,
        failed: &[QpKey],
        mut released: Vec<usize>,
    ) {
        let seed = self.seed;
        assert_eq!(out.unknown, unknown, "seed {seed}: unknown completions");
        assert_eq!(out.failed, failed, "seed {seed}: failed QPs");
        let mut got: Vec<usize> = out.released.iter().map(|p| p.op).collect();
        got.sort_unstable();
        released.sort_unstable();
        assert_eq!(got, released, "seed {seed}: released payloads");
        self.stats.released_parked += released.len() as u64;
        self.stats.unknown += out.unknown;
        for (i, k) in out.postable.iter().enumerate() {
            assert!(
                !out.postable[..i].contains(k),
                "seed {seed}: {k:?} listed twice"
            );
        }
        for key in out.postable.drain(..) {
            let qi = self.qp_of_key(key);
            self.post(qi);
        }
        for key in out.failed.drain(..) {
            let qi = self.qp_of_key(key);
            self.qps[qi].dev_err = true;
        }
        self.stats.wakes += wake_all(out) as u64;
        out.released.clear(); // the probes check they may go
        out.clear();
    }

    /// The completion task: applies up to `k` completions from the CQ as one batch.
    fn deliver(&mut self, k: usize) {
        let mut unknown = 0;
        let mut failed = Vec::new();
        let mut released = Vec::new();
        for _ in 0..k {
            let Some((cqe, owner)) = self.cq.pop_front() else {
                break;
            };
            self.stats.cqes += 1;
            match owner {
                Some(id) if self.ops[id].st == St::Posted => {
                    self.apply(id, &cqe, &mut failed, &mut released);
                }
                // Spurious, or for a QP that was abandoned meanwhile.
                _ => unknown += 1,
            }
            self.core.complete(&cqe, &mut self.out);
        }
        self.settle(unknown, &failed, released);
    }

    fn close(&mut self, qi: usize) {
        let mut failed = Vec::new();
        let mut released = Vec::new();
        let want = self.fail_model(qi, QpFailure::Closed, &mut failed, &mut released);
        let got = self
            .core
            .fail_qp(self.qps[qi].key, QpFailure::Closed, &mut self.out);
        assert_eq!(got, want, "seed {}: recorded cause", self.seed);
        self.qps[qi].dev_err = true;
        self.stats.closes += 1;
        self.settle(0, &failed, released);
    }

    /// The QP was destroyed: the device can no longer touch its memory.
    fn abandon(&mut self, qi: usize) {
        let mut failed = Vec::new();
        let mut released = Vec::new();
        let cause = self.fail_model(qi, QpFailure::Closed, &mut failed, &mut released);
        let q = &mut self.qps[qi];
        let posted: Vec<usize> = q.ring.drain(..).chain(q.rq_posted.drain(..)).collect();
        q.dev_sq.clear();
        q.dev_rq.clear();
        q.dev_err = true;
        for id in posted {
            self.done(id, Expect::Failed(cause.clone()), &mut released);
        }
        self.core.abandon_qp(self.qps[qi].key, &mut self.out);
        self.stats.abandons += 1;
        self.settle(0, &failed, released);
    }

    // --- the device's side ---------------------------------------------------------------

    fn device_step(&mut self, qi: usize, budget: usize) {
        for _ in 0..budget {
            let q = &mut self.qps[qi];
            let (has_s, has_r) = (!q.dev_sq.is_empty(), !q.dev_rq.is_empty());
            if !has_s && !has_r {
                return;
            }
            let use_send = has_s && (!has_r || self.rng.chance(7, 10));
            let (id, signaled) = if use_send {
                q.dev_sq.pop_front().expect("non-empty")
            } else {
                let i = self.rng.below(q.dev_rq.len());
                (q.dev_rq.swap_remove(i), true)
            };
            let wr_id = self.ops[id].wr_id;
            let cqe = if q.dev_err {
                self.stats.flushes += 1;
                Some(cqe_err(
                    wr_id,
                    WcStatus::WrFlushErr,
                    self.rng.below(0x300) as u32,
                ))
            } else if self.rng.chance(1, self.err_den) {
                q.dev_err = true;
                self.stats.errors += 1;
                let status = if use_send {
                    SEND_ERRORS[self.rng.below(SEND_ERRORS.len())]
                } else {
                    RECV_ERRORS[self.rng.below(RECV_ERRORS.len())]
                };
                Some(cqe_err(wr_id, status, self.rng.below(0x100) as u32))
            } else if use_send {
                // Unsignaled sends execute without a completion.
                signaled.then(|| Cqe::success(wr_id, self.rng.below(4096) as u32))
            } else {
                let imm = self.rng.chance(1, 2).then(|| self.rng.next() as u32);
                Some(cqe_recv(wr_id, self.rng.below(4096) as u32, imm))
            };
            if let Some(cqe) = cqe {
                self.cq.push_back((cqe, Some(id)));
            }
        }
    }

    /// A completion that must match nothing: an unknown id, or a duplicate / stale id of an op
    /// whose outcome is already known.
    fn inject_spurious(&mut self) {
        let wr_id = if self.rng.chance(1, 3) || self.ops.is_empty() {
            (self.rng.next() & 0xffff_ffff_0000_0000)
                | (0xffff_0000 | self.rng.below(0xffff) as u64)
        } else {
            let id = self.rng.below(self.ops.len());
            if !matches!(self.ops[id].st, St::Done | St::Gone) {
                return;
            }
            self.ops[id].wr_id
        };
        let status = if self.rng.chance(1, 2) {
            WcStatus::Success
        } else {
            SEND_ERRORS[self.rng.below(SEND_ERRORS.len())]
        };
        let cqe = Cqe {
            byte_len: 77,
            ..cqe_err(wr_id, status, 0x5a)
        };
        self.stats.spurious += 1;
        self.cq.push_back((cqe, None));
    }

    // --- bookkeeping -----------------------------------------------------------------------

    /// Removes failed QPs with nothing outstanding (optionally replacing them).
    fn reap(&mut self, replace: bool) {
        let mut i = 0;
        while i < self.active.len() {
            let qi = self.active[i];
            let q = &self.qps[qi];
            if q.cause.is_some() && q.outstanding() == 0 {
                assert_eq!(self.core.outstanding(q.key), 0);
                assert!(
                    self.core.remove_qp(q.key),
                    "seed {}: remove_qp refused",
                    self.seed
                );
                self.qps[qi].removed = true;
                self.active.swap_remove(i);
                self.stats.qps_replaced += 1;
                if replace {
                    self.add_qp();
                }
            } else {
                i += 1;
            }
        }
    }

    fn try_remove_busy(&mut self, qi: usize) {
        let q = &self.qps[qi];
        if q.outstanding() > 0 {
            assert!(
                !self.core.remove_qp(q.key),
                "seed {}: removed a busy QP",
                self.seed
            );
            self.stats.refused_removals += 1;
        }
    }

    fn check_invariants(&self) {
        let seed = self.seed;
        for &qi in &self.active {
            let q = &self.qps[qi];
            let posted = q.ring.len() + q.rq_posted.len();
            assert_eq!(
                self.core.posted(q.key),
                posted,
                "seed {seed}: posted of {qi}"
            );
            assert_eq!(
                self.core.outstanding(q.key),
                q.outstanding(),
                "seed {seed}: outstanding"
            );
            assert_eq!(
                self.core.failure(q.key),
                q.cause.as_ref(),
                "seed {seed}: failure"
            );
            // Whoever made a QP postable has posted it: nothing is left waiting unnoticed.
            assert!(
                !self.core.has_postable(q.key),
                "seed {seed}: QP {qi} left postable"
            );
            assert!(q.ring.len() <= q.cfg.sq_depth as usize);
            assert!(q.rq_posted.len() <= q.cfg.rq_depth as usize);
        }
        assert_eq!(
            self.core.ops_in_table(),
            self.in_table,
            "seed {seed}: ops in table"
        );
        let violations = self.book.violations.borrow();
        assert!(violations.is_empty(), "seed {seed}: {violations:?}");
    }

    fn step(&mut self) {
        self.stats.steps += 1;
        let qi = self.active[self.rng.below(self.active.len())];
        match self.rng.below(1000) {
            0..=199 => {
                let q = &self.qps[qi];
                let room = q.pend_sq.len() + q.pend_rq.len() < 64;
                if room && (q.cause.is_none() || self.rng.chance(1, 10)) {
                    self.submit_batch(qi);
                }
            }
            200..=449 => {
                let budget = self.rng.range(1, 8);
                self.device_step(qi, budget);
            }
            450..=599 => {
                let k = self.rng.range(1, 16);
                self.deliver(k);
            }
            600..=849 => {
                for _ in 0..self.rng.range(1, 8) {
                    if !self.live.is_empty() {
                        let i = self.rng.below(self.live.len());
                        self.poll_live(i);
                    }
                }
            }
            850..=969 => {
                if let Some(i) = self.pick_drop_target() {
                    self.drop_live(i);
                }
            }
            970..=979 => self.inject_spurious(),
            980..=989 => self.try_remove_busy(qi),
            990..=994 => {
                if self.rng.chance(1, 5) {
                    self.close(qi);
                }
            }
            995..=996 => {
                if self.rng.chance(1, 5) {
                    self.abandon(qi);
                }
            }
            _ => {
                for _ in 0..32 {
                    if self.live.is_empty() {
                        break;
                    }
                    let i = self.rng.below(self.live.len());
                    self.poll_live(i);
                }
            }
        }
        self.stats.max_live = self.stats.max_live.max(self.live.len());
    }

    /// Runs until `target` ops were submitted, then lets the device finish everything.
    pub(super) fn run(&mut self, target: u64) {
        while self.stats.submitted < target {
            self.step();
            self.reap(true);
            self.check_invariants();
        }
        // Drain: the device completes everything, the completion task applies it all.
        let mut rounds = 0;
        loop {
            rounds += 1;
            assert!(
                rounds < 100_000,
                "seed {}: the drain does not converge",
                self.seed
            );
            let mut idle = self.cq.is_empty();
            for qi in self.active.clone() {
                let q = &self.qps[qi];
                if !q.dev_sq.is_empty() || !q.dev_rq.is_empty() {
                    idle = false;
                    self.device_step(qi, 64);
                }
            }
            let n = self.cq.len();
            self.deliver(n);
            self.reap(false);
            self.check_invariants();
            if idle {
                break;
            }
        }
        for &qi in &self.active {
            let q = &self.qps[qi];
            assert_eq!(
                q.outstanding(),
                0,
                "seed {}: QP {qi} stuck: {q:?}",
                self.seed
            );
        }
        // Every surviving future resolves.
        while let Some(&id) = self.live.last() {
            assert_eq!(
                self.ops[id].st,
                St::Done,
                "seed {}: op {id} never resolved",
                self.seed
            );
            self.poll_live(self.live.len() - 1);
        }
        assert_eq!(
            self.core.ops_in_table(),
            0,
            "seed {}: table not empty",
            self.seed
        );
        assert_eq!(self.in_table, 0);
        for qi in std::mem::take(&mut self.active) {
            assert!(self.core.remove_qp(self.qps[qi].key));
        }
        self.final_checks();
    }

    fn final_checks(&self) {
        let seed = self.seed;
        let violations = self.book.violations.borrow();
        assert!(violations.is_empty(), "seed {seed}: {violations:?}");
        let book = self.book.ops.borrow();
        for (id, (op, probe)) in self.ops.iter().zip(book.iter()).enumerate() {
            assert_eq!(op.st, St::Gone, "seed {seed}: op {id} not finished");
            assert_eq!(
                probe.releases, 1,
                "seed {seed}: op {id} payload released {} times",
                probe.releases
            );
            if probe.posted {
                assert!(
                    probe.applied,
                    "seed {seed}: op {id} posted but never completed"
                );
            }
            for (w, counter) in op.wakers.iter().enumerate() {
                let want = usize::from(op.must_wake == Some(w));
                assert_eq!(
                    counter.count(),
                    want,
                    "seed {seed}: op {id} waker {w} wakes"
                );
            }
        }
        let s = &self.stats;
        let resolved = s.collected_ok + s.collected_err + s.rejected;
        let dropped = s.drop_queued + s.drop_posted + s.drop_done;
        assert_eq!(
            resolved + dropped,
            self.ops.len() as u64,
            "seed {seed}: every op accounted"
        );
        assert_eq!(
            s.released_parked, s.drop_posted,
            "seed {seed}: every parked payload released"
        );
    }
}
