//! The slot ring of an [`OwnedQp`](super::OwnedQp): who owns each posted work request's buffer
//! until its completion, and where a completion goes, found by its `wr_id` in O(1).
//!
//! Pure bookkeeping with no device and no clock, tested on the host. A slot is given out by
//! [`Ring::post`], owns the request's buffer from then on, and is free again only once its
//! completion was applied *and* taken (or its taker was dropped): so the `wr_id` of every
//! completion in the queue pair's own completion queue names a slot that is still waiting for
//! it, and no completion can reach another request's buffer.

use crate::error::{Error, InvalidArgument, QpFailure, WcStatus};

/// What a successful work completion reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completed {
    /// Bytes transferred: what a receive got, what an RDMA READ read (0 for sends and writes).
    pub len: usize,
    /// The immediate data of a receive, if the sender attached some.
    pub imm: Option<u32>,
}

/// One posted work request: [`OwnedQp::wait`](super::OwnedQp::wait) takes its outcome and its
/// buffer back. Not `Clone`: each completion is taken once.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a ticket not waited for keeps its slot (and buffer) until `next_completion()` takes it"]
pub struct Ticket {
    pub(super) owner: u32,
    pub(super) slot: u32,
    pub(super) generation: u32,
}

/// A work completion as the ring keeps it: plain values (a slot stays small, and a failure is
/// built into an [`Error`] only when it is taken).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Outcome {
    pub(super) status: WcStatus,
    pub(super) vendor_err: u32,
    pub(super) len: u32,
    pub(super) imm: Option<u32>,
}

impl Outcome {
    /// A successful completion of `len` bytes.
    #[cfg(test)]
    pub(super) fn ok(len: u32) -> Outcome {
        Outcome {
            status: WcStatus::Success,
            vendor_err: 0,
            len,
            imm: None,
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum State {
    Free,
    /// Posted; the device may use the buffer.
    Posted {
        send: bool,
        detached: bool,
    },
    /// Completed, waiting to be taken.
    Done,
}

#[derive(Debug)]
struct Slot<B> {
    generation: u32,
    state: State,
    /// The completion, once `Done`.
    outcome: Outcome,
    /// Neighbours in the ring's list of completed slots, once `Done` ([`NONE`] at an end).
    prev: u32,
    next: u32,
    buf: Option<B>,
}

/// No slot: the end of the list of completed slots.
const NONE: u32 = u32::MAX;

/// The outcome a taker gets, and the buffer.
pub(super) type Taken<B> = (Ticket, Result<Completed, Error>, B);

#[derive(Debug)]
pub(super) struct Ring<B> {
    owner: u32,
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
}

impl<B> Ring<B> {
    /// Room for `max_send` and `max_recv` requests in flight; twice as many slots, so that
    /// completed requests waiting to be taken do not stop new posts at once.
    pub(super) fn new(owner: u32, max_send: u32, max_recv: u32) -> Ring<B> {
        let n = 2 * (max_send as usize + max_recv as usize);
        Ring {
            owner,
            slots: (0..n)
                .map(|_| Slot {
                    generation: 0,
                    state: State::Free,
                    outcome: Outcome {
                        status: WcStatus::Success,
                        vendor_err: 0,
                        len: 0,
                        imm: None,
                    },
                    prev: NONE,
                    next: NONE,
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
        }
    }

    /// Requests posted and not completed yet (the device may still use their buffers).
    pub(super) fn in_flight(&self) -> u32 {
        self.sends + self.recvs
    }

    /// Takes a slot for a request on the send (`send`) or receive queue and gives it the
    /// buffer. Returns the `wr_id` to post it with, or the error and the buffer if the queue
    /// is full or every slot holds a completion not taken yet.
    pub(super) fn post(&mut self, send: bool, buf: B) -> Result<(u64, Ticket), (Error, B)> {
        let full = if send {
            (self.sends >= self.max_send).then_some(InvalidArgument::SendQueueFull {
                depth: self.max_send,
            })
        } else {
            (self.recvs >= self.max_recv).then_some(InvalidArgument::RecvQueueFull {
                depth: self.max_recv,
            })
        };
        if let Some(e) = full {
            return Err((Error::InvalidArgument(e), buf));
        }
        let Some(i) = self.free.pop() else {
            let slots = self.slots.len() as u32;
            return Err((
                Error::InvalidArgument(InvalidArgument::UncollectedCompletions { slots }),
                buf,
            ));
        };
        let slot = &mut self.slots[i as usize];
        slot.generation = slot.generation.wrapping_add(1);
        slot.state = State::Posted {
            send,
            detached: false,
        };
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

    /// The request of `ticket` never reached the device (its post failed): frees its slot and
    /// gives the buffer back.
    pub(super) fn unpost(&mut self, ticket: Ticket) -> B {
        let slot = &mut self.slots[ticket.slot as usize];
        debug_assert_eq!(slot.generation, ticket.generation);
        let State::Posted { send, .. } = slot.state else {
            unreachable!("unpost of a request that is not posted");
        };
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
    /// taker is gone has its buffer dropped here and its slot freed.
    pub(super) fn complete(&mut self, wr_id: u64, outcome: Outcome) -> bool {
        if outcome.status != WcStatus::Success && outcome.status != WcStatus::WrFlushErr {
            self.failure.get_or_insert(QpFailure::WorkCompletion {
                status: outcome.status,
                vendor_err: outcome.vendor_err,
            });
        }
        let (i, generation) = split(wr_id);
        let Some(slot) = self.slots.get_mut(i as usize) else {
            return false;
        };
        let State::Posted { send, detached } = slot.state else {
            return false;
        };
        if slot.generation != generation {
            return false;
        }
        if detached {
            slot.state = State::Free;
            let buf = slot.buf.take();
            self.free.push(i);
            self.count_done(send);
            drop(buf);
            return true;
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
        true
    }

    /// Takes the outcome of `ticket`'s request if it has completed. The ticket must be one
    /// this ring [`owns`](Self::owns) (checked when the wait began).
    #[inline]
    pub(super) fn take(&mut self, ticket: &Ticket) -> Option<(Result<Completed, Error>, B)> {
        debug_assert!(self.owns(ticket));
        if !is_done(&self.slots, ticket.slot, ticket.generation) {
            return None;
        }
        Some(self.free_done(ticket.slot))
    }

    /// Takes the oldest completed request not taken yet.
    pub(super) fn take_next(&mut self) -> Option<Taken<B>> {
        let i = self.head;
        if i == NONE {
            return None;
        }
        let ticket = Ticket {
            owner: self.owner,
            slot: i,
            generation: self.slots[i as usize].generation,
        };
        let (res, buf) = self.free_done(i);
        Some((ticket, res, buf))
    }

    fn free_done(&mut self, i: u32) -> (Result<Completed, Error>, B) {
        let slot = &mut self.slots[i as usize];
        debug_assert!(matches!(slot.state, State::Done));
        slot.state = State::Free;
        let (prev, next) = (slot.prev, slot.next);
        let o = slot.outcome;
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
        (self.result(o), buf)
    }

    /// The outcome a taker gets: success with its length and immediate, or the failure; a
    /// flush reports the failure that moved the queue pair to the error state, if one was seen.
    fn result(&self, o: Outcome) -> Result<Completed, Error> {
        match o.status {
            WcStatus::Success => Ok(Completed {
                len: o.len as usize,
                imm: o.imm,
            }),
            WcStatus::WrFlushErr => Err(Error::QpFailed(
                self.failure.clone().unwrap_or(QpFailure::Flushed),
            )),
            status => Err(Error::QpFailed(QpFailure::WorkCompletion {
                status,
                vendor_err: o.vendor_err,
            })),
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
                drop(self.free_done(ticket.slot));
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

fn is_done<B>(slots: &[Slot<B>], i: u32, generation: u32) -> bool {
    slots
        .get(i as usize)
        .is_some_and(|s| s.generation == generation && matches!(s.state, State::Done))
}

fn wr_id(slot: u32, generation: u32) -> u64 {
    (u64::from(generation) << 32) | u64::from(slot)
}

fn split(wr_id: u64) -> (u32, u32) {
    (wr_id as u32, (wr_id >> 32) as u32)
}

#[cfg(test)]
mod tests;
