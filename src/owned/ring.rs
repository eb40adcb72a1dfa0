//! The slot ring of an [`OwnedQp`](super::OwnedQp): who owns each posted work request's buffer
//! until its completion, and where a completion goes, found by its `wr_id` in O(1).
//!
//! Pure bookkeeping with no device and no clock, tested on the host. A slot is given out by
//! [`Ring::post`], owns the request's buffer from then on, and is free again only once its
//! completion was applied *and* taken (or its taker was dropped): so the `wr_id` of every
//! completion in the queue pair's own completion queue names a slot that is still waiting for
//! it, and no completion can reach another request's buffer.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};

use crate::error::{Error, InvalidArgument, QpFailure, WcStatus};

/// What a successful work completion reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completed {
    /// Bytes placed in the buffer: what a receive got (0 for a receive consumed by an RDMA
    /// WRITE with immediate, whose data went to the write's target), what an RDMA READ read, 8
    /// for an atomic; 0 for sends and writes.
    pub len: usize,
    /// The immediate data of a receive, if the sender attached some (`None` for every other
    /// request).
    pub imm: Option<u32>,
}

/// What a slot's request is: which queue it is on, and what its completion puts in its buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// A send or an RDMA WRITE: the device reads the buffer; nothing is filled.
    Source,
    /// An RDMA READ of this many bytes into the buffer.
    Read(u32),
    /// An atomic: the previous value, 8 bytes.
    Atomic,
    /// A receive: what the completion reports.
    Recv,
}

impl Kind {
    fn send_queue(self) -> bool {
        !matches!(self, Kind::Recv)
    }
}

/// One posted work request: [`OwnedQp::wait`](super::OwnedQp::wait) takes its outcome and its
/// buffer back. Not `Clone`: each completion is taken once.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a ticket not waited for keeps its slot (and buffer) until `next_completion()` takes it"]
pub struct Ticket {
    pub(super) owner: u64,
    pub(super) slot: u32,
    pub(super) generation: u64,
}

/// A work completion as the ring keeps it: plain values (a slot stays small, and a failure is
/// built into an [`Error`] only when it is taken).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Outcome {
    pub(super) status: WcStatus,
    pub(super) vendor_err: u32,
    /// The completion's byte count (only a receive's and a read's mean anything).
    pub(super) len: u32,
    pub(super) imm: Option<u32>,
    /// A receive consumed by an RDMA WRITE with immediate: nothing was written to it.
    pub(super) write_imm: bool,
}

impl Outcome {
    /// The success of a request that asked for no completion of its own.
    pub(super) const SUCCESS: Outcome = Outcome {
        status: WcStatus::Success,
        vendor_err: 0,
        len: 0,
        imm: None,
        write_imm: false,
    };

    /// A successful completion of `len` bytes.
    #[cfg(test)]
    pub(super) fn ok(len: u32) -> Outcome {
        Outcome {
            status: WcStatus::Success,
            vendor_err: 0,
            len,
            imm: None,
            write_imm: false,
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum State {
    Free,
    /// Posted; the device may use the buffer.
    Posted {
        detached: bool,
    },
    /// Completed, waiting to be taken.
    Done,
}

#[derive(Debug)]
struct Slot<B> {
    /// 64 bits: a ticket kept past its request never names a later one (the `wr_id` carries
    /// the low 32, enough there: a slot holds one posted request at a time).
    generation: u64,
    kind: Kind,
    state: State,
    /// The completion, once `Done`.
    outcome: Outcome,
    /// Neighbours in the ring's list of completed slots, once `Done` ([`NONE`] at an end).
    prev: u32,
    next: u32,
    /// While posted, a batch's signaled last request: the oldest of the batch's unsignaled
    /// requests, which this one's completion also completes, with its generation ([`NONE`]:
    /// none).
    cover: (u32, u64),
    /// While posted, an unsignaled request of a batch: the next one of the batch ([`NONE`]:
    /// none; the last one's completion covers them all). Not followed from this request's own
    /// completion (an error or a flush): the ones after it are flushed and complete on their own.
    batch_next: (u32, u64),
    buf: Option<B>,
}

/// No slot: the end of the list of completed slots.
const NONE: u32 = u32::MAX;

/// What a taker gets: the outcome, the buffer, and whether the buffer was written (a receive,
/// a read, an atomic: its initialised length is then the outcome's `len`).
pub(super) type Taken<B> = (Result<Completed, Error>, B, bool);

#[derive(Debug)]
pub(super) struct Ring<B> {
    /// A random id (std's per-process random hash keys, different for each ring): a ticket of
    /// another ring, live or dropped, is refused (queue pair numbers repeat across devices and
    /// are reused within one).
    owner: u64,
    slots: Vec<Slot<B>>,
    free: Vec<u32>,
    /// The completed slots not taken yet, in completion order: a list linked through the
    /// slots (`prev`, `next`), so a take by ticket unlinks its slot in O(1) and nothing grows.
    head: u32,
    tail: u32,
    sends: u32,
    recvs: u32,
    max_send: u32,
    max_recv: u32,
    /// The first failure a completion reported (in completion order): a flushed request
    /// reports it as its cause.
    failure: Option<QpFailure>,
    /// Buffers of given-up requests whose completions were applied, dropped by
    /// [`drop_released`](Self::drop_released) once the whole batch is (a panicking `Drop`
    /// then loses no completion). Room for every slot: never grows.
    released: Vec<B>,
}

impl<B> Ring<B> {
    /// Room for `max_send` and `max_recv` requests in flight; twice as many slots, so that
    /// completed requests waiting to be taken do not stop new posts at once.
    pub(super) fn new(max_send: u32, max_recv: u32) -> Ring<B> {
        let n = 2 * (max_send as usize + max_recv as usize);
        Ring {
            owner: RandomState::new().build_hasher().finish(),
            slots: (0..n)
                .map(|_| Slot {
                    generation: 0,
                    kind: Kind::Recv,
                    state: State::Free,
                    outcome: Outcome {
                        status: WcStatus::Success,
                        vendor_err: 0,
                        len: 0,
                        imm: None,
                        write_imm: false,
                    },
                    prev: NONE,
                    next: NONE,
                    cover: (NONE, 0),
                    batch_next: (NONE, 0),
                    buf: None,
                })
                .collect(),
            free: (0..n as u32).rev().collect(),
            head: NONE,
            tail: NONE,
            sends: 0,
            recvs: 0,
            max_send,
            max_recv,
            failure: None,
            released: Vec::with_capacity(n),
        }
    }

    /// The ring's id, which its tickets carry.
    pub(super) fn owner(&self) -> u64 {
        self.owner
    }

    /// Requests posted and not completed yet (the device may still use their buffers).
    pub(super) fn in_flight(&self) -> u32 {
        self.sends + self.recvs
    }

    /// Takes a slot for a request of `kind` and gives it the buffer. Returns the `wr_id` to
    /// post it with, or the error and the buffer if its queue is full or every slot holds a
    /// completion not taken yet.
    #[inline]
    pub(super) fn post(&mut self, kind: Kind, buf: B) -> Result<(u64, Ticket), (Error, B)> {
        let send = kind.send_queue();
        let room = if send {
            self.sends < self.max_send
        } else {
            self.recvs < self.max_recv
        };
        let free = if room { self.free.pop() } else { None };
        let Some(i) = free else {
            return Err((self.refusal(send, room), buf));
        };
        let slot = &mut self.slots[i as usize];
        slot.generation += 1;
        slot.kind = kind;
        slot.state = State::Posted { detached: false };
        slot.cover = (NONE, 0);
        slot.batch_next = (NONE, 0);
        slot.buf = Some(buf);
        if send {
            self.sends += 1;
        } else {
            self.recvs += 1;
        }
        let ticket = Ticket {
            owner: self.owner,
            slot: i,
            generation: slot.generation,
        };
        Ok((wr_id(i, slot.generation), ticket))
    }

    /// Why [`post`](Self::post) refused a request: its queue is full, or (with `room`) every
    /// slot holds a completion not taken yet.
    #[cold]
    fn refusal(&self, send: bool, room: bool) -> Error {
        Error::InvalidArgument(match (room, send) {
            (false, true) => InvalidArgument::SendQueueFull {
                depth: self.max_send,
            },
            (false, false) => InvalidArgument::RecvQueueFull {
                depth: self.max_recv,
            },
            (true, _) => InvalidArgument::UncollectedCompletions {
                slots: self.slots.len() as u32,
            },
        })
    }

    /// The request of `ticket` never reached the device (its post failed): frees its slot and
    /// gives the buffer back.
    pub(super) fn unpost(&mut self, ticket: Ticket) -> B {
        let slot = &mut self.slots[ticket.slot as usize];
        debug_assert_eq!(slot.generation, ticket.generation);
        let State::Posted { .. } = slot.state else {
            unreachable!("unpost of a request that is not posted");
        };
        let send = slot.kind.send_queue();
        self.count_done(send);
        let slot = &mut self.slots[ticket.slot as usize];
        slot.state = State::Free;
        self.free.push(ticket.slot);
        slot.buf.take().expect("a posted slot holds its buffer")
    }

    fn count_done(&mut self, send: bool) {
        if send {
            self.sends -= 1;
        } else {
            self.recvs -= 1;
        }
    }

    /// Applies the completion of `wr_id`. Returns `false` if it names no posted request (which
    /// the queue pair's own completion queue cannot produce; it is ignored). A request whose
    /// taker is gone has its slot freed and its buffer put aside for
    /// [`drop_released`](Self::drop_released).
    pub(super) fn complete(&mut self, wr_id: u64, outcome: Outcome) -> bool {
        if outcome.status != WcStatus::Success && outcome.status != WcStatus::WrFlushErr {
            self.failure.get_or_insert(QpFailure::WorkCompletion {
                status: outcome.status,
                vendor_err: outcome.vendor_err,
            });
        }
        let (i, generation) = split(wr_id);
        let Some(slot) = self.slots.get(i as usize) else {
            return false;
        };
        if !matches!(slot.state, State::Posted { .. }) || slot.generation as u32 != generation {
            return false;
        }
        // A send queue completes its requests in order: the unsignaled ones posted before
        // this one (its batch) are done too, and succeeded (a failed or flushed request gets
        // a completion of its own, signaled or not, and has left the chain by then).
        let mut cover = slot.cover;
        while cover.0 != NONE {
            let c = &self.slots[cover.0 as usize];
            if !matches!(c.state, State::Posted { .. }) || c.generation != cover.1 {
                break;
            }
            let next = c.batch_next;
            self.apply(cover.0, Outcome::SUCCESS);
            cover = next;
        }
        self.apply(i, outcome);
        true
    }

    /// Links the requests of a batch, posted unsignaled but for the last, oldest first: the
    /// last one's completion completes the others ([`complete`](Self::complete)).
    pub(super) fn link_batch(&mut self, batch: &[(u32, u64)]) {
        let Some((&(last, _), rest)) = batch.split_last() else {
            return;
        };
        let mut newer = NONE;
        let mut newer_gen = 0;
        for &(i, generation) in rest.iter().rev() {
            self.slots[i as usize].batch_next = (newer, newer_gen);
            (newer, newer_gen) = (i, generation);
        }
        self.slots[last as usize].cover = (newer, newer_gen);
    }

    /// Applies a completion to the posted slot `i`.
    fn apply(&mut self, i: u32, outcome: Outcome) {
        let slot = &mut self.slots[i as usize];
        let State::Posted { detached } = slot.state else {
            unreachable!("a completion applied to a slot that is not posted");
        };
        slot.cover = (NONE, 0);
        slot.batch_next = (NONE, 0);
        let send = slot.kind.send_queue();
        if detached {
            slot.state = State::Free;
            let buf = slot.buf.take();
            self.free.push(i);
            self.count_done(send);
            self.released.extend(buf);
            return;
        }
        slot.state = State::Done;
        slot.outcome = outcome;
        slot.prev = self.tail;
        slot.next = NONE;
        match self.tail {
            NONE => self.head = i,
            t => self.slots[t as usize].next = i,
        }
        self.tail = i;
        self.count_done(send);
    }

    /// Takes the outcome of `ticket`'s request if it has completed. The ticket must be one
    /// this ring [`owns`](Self::owns) (checked when the wait began).
    #[inline(always)]
    pub(super) fn take(&mut self, ticket: &Ticket) -> Option<Taken<B>> {
        debug_assert!(self.owns(ticket));
        if !is_done(&self.slots, ticket.slot, ticket.generation) {
            return None;
        }
        Some(self.free_done(ticket.slot))
    }

    /// Takes the oldest completed request not taken yet.
    #[inline(always)]
    pub(super) fn take_next(&mut self) -> Option<(Ticket, Taken<B>)> {
        let i = self.head;
        if i == NONE {
            return None;
        }
        let ticket = Ticket {
            owner: self.owner,
            slot: i,
            generation: self.slots[i as usize].generation,
        };
        Some((ticket, self.free_done(i)))
    }

    /// Drops the buffers of given-up requests whose completions were applied (after a whole
    /// batch: see [`complete`](Self::complete)).
    pub(super) fn drop_released(&mut self) {
        while let Some(b) = self.released.pop() {
            drop(b);
        }
    }

    #[inline(always)]
    fn free_done(&mut self, i: u32) -> Taken<B> {
        let slot = &mut self.slots[i as usize];
        debug_assert!(matches!(slot.state, State::Done));
        slot.state = State::Free;
        let (prev, next) = (slot.prev, slot.next);
        let (o, kind) = (slot.outcome, slot.kind);
        let buf = slot.buf.take().expect("a done slot holds its buffer");
        match prev {
            NONE => self.head = next,
            p => self.slots[p as usize].next = next,
        }
        match next {
            NONE => self.tail = prev,
            n => self.slots[n as usize].prev = prev,
        }
        self.free.push(i);
        (self.result(o, kind), buf, kind != Kind::Source)
    }

    /// The outcome a taker gets: success with what its kind of request reports (the verbs
    /// define a completion's byte count and immediate for receives only, and a provider may
    /// leave them stale in others), or the failure; a flush reports the failure that moved the
    /// queue pair to the error state, if one was seen.
    #[inline]
    fn result(&self, o: Outcome, kind: Kind) -> Result<Completed, Error> {
        if o.status != WcStatus::Success {
            return Err(self.failed(o));
        }
        Ok(match kind {
            Kind::Source => Completed { len: 0, imm: None },
            Kind::Read(len) => Completed {
                len: len as usize,
                imm: None,
            },
            Kind::Atomic => Completed { len: 8, imm: None },
            Kind::Recv => Completed {
                len: if o.write_imm { 0 } else { o.len as usize },
                imm: o.imm,
            },
        })
    }

    /// The error of a failed completion: a flush reports the failure that moved the queue pair
    /// to the error state, if one was seen.
    #[cold]
    fn failed(&self, o: Outcome) -> Error {
        match o.status {
            WcStatus::WrFlushErr => {
                Error::QpFailed(self.failure.clone().unwrap_or(QpFailure::Flushed))
            }
            status => Error::QpFailed(QpFailure::WorkCompletion {
                status,
                vendor_err: o.vendor_err,
            }),
        }
    }

    /// The taker of `ticket` is gone: a completed request's buffer is dropped now, a posted
    /// one's when its completion arrives.
    pub(super) fn detach(&mut self, ticket: &Ticket) {
        let Some(slot) = self.slots.get_mut(ticket.slot as usize) else {
            return;
        };
        if slot.generation != ticket.generation || ticket.owner != self.owner {
            return;
        }
        match &mut slot.state {
            State::Posted { detached, .. } => *detached = true,
            State::Done => {
                let (_, buf, _) = self.free_done(ticket.slot);
                drop(buf);
            }
            State::Free => {}
        }
    }

    /// Whether `ticket` names a request of this ring that was not taken yet.
    pub(super) fn owns(&self, ticket: &Ticket) -> bool {
        ticket.owner == self.owner
            && self.slots.get(ticket.slot as usize).is_some_and(|s| {
                s.generation == ticket.generation && !matches!(s.state, State::Free)
            })
    }

    /// Every request in flight is given up (the queue pair is dropped): each buffer is
    /// dropped when its completion is applied.
    pub(super) fn detach_all(&mut self) {
        for slot in &mut self.slots {
            if let State::Posted { detached, .. } = &mut slot.state {
                *detached = true;
            }
        }
    }

    /// Leaks the buffer of every request still in flight (the device may still use it);
    /// returns how many.
    pub(super) fn leak_in_flight(&mut self) -> usize {
        let mut n = 0;
        for slot in &mut self.slots {
            if matches!(slot.state, State::Posted { .. }) {
                if let Some(b) = slot.buf.take() {
                    std::mem::forget(b);
                    n += 1;
                }
            }
        }
        n
    }

    /// Every buffer of a request that is not in flight: taken out, for dropping once the
    /// caller has released what it holds. In-flight buffers stay.
    pub(super) fn release_settled(&mut self) -> Vec<B> {
        let mut out = Vec::new();
        for (i, slot) in self.slots.iter_mut().enumerate() {
            if matches!(slot.state, State::Done) {
                slot.state = State::Free;
                self.free.push(i as u32);
                out.extend(slot.buf.take());
            }
        }
        self.head = NONE;
        self.tail = NONE;
        out
    }
}

impl<B> Drop for Ring<B> {
    /// Buffers of requests still in flight are leaked, never freed: however the ring goes (a
    /// panic unwinding through its queue pair's `drop`, a reaper cut short), the device may
    /// still write them.
    fn drop(&mut self) {
        self.leak_in_flight();
    }
}

fn is_done<B>(slots: &[Slot<B>], i: u32, generation: u64) -> bool {
    slots
        .get(i as usize)
        .is_some_and(|s| s.generation == generation && matches!(s.state, State::Done))
}

/// A request's `wr_id`: the slot and the low 32 bits of its generation.
fn wr_id(slot: u32, generation: u64) -> u64 {
    ((generation & 0xffff_ffff) << 32) | u64::from(slot)
}

fn split(wr_id: u64) -> (u32, u32) {
    (wr_id as u32, (wr_id >> 32) as u32)
}

#[cfg(test)]
mod tests;
