use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use super::*;

fn ok(len: usize) -> Outcome {
    Outcome::ok(len as u32)
}

/// A buffer that records its drop (and may panic in it).
#[derive(Debug)]
struct Buf(u32, Rc<RefCell<Vec<u32>>>, bool);

impl Drop for Buf {
    fn drop(&mut self) {
        self.1.borrow_mut().push(self.0);
        if self.2 {
            panic!("buffer {} panics in drop", self.0);
        }
    }
}

#[test]
fn a_completion_reaches_the_request_it_names_and_gives_its_buffer_back() {
    let mut r: Ring<&'static str> = Ring::new(2, 2);
    let (id_a, a) = r.post(Kind::Source, "a").unwrap();
    let (id_b, b) = r.post(Kind::Recv, "b").unwrap();
    assert_eq!(r.in_flight(), 2);
    assert!(r.complete(id_b, ok(5)));
    // `a` has not completed.
    assert!(r.take(&a).is_none());
    let (res, buf, fills) = r.take(&b).unwrap();
    assert_eq!((res.unwrap().len, buf, fills), (5, "b", true));
    assert!(!r.owns(&b), "taken");
    assert!(r.complete(id_a, ok(0)));
    let (res, buf, fills) = r.take(&a).unwrap();
    assert_eq!((res.unwrap().len, buf, fills), (0, "a", false));
    assert_eq!(r.in_flight(), 0);
    // Taken: the id names nothing any more (a completion for it is ignored).
    assert!(!r.complete(id_a, ok(1)));
}

#[test]
fn full_queues_and_uncollected_completions_are_errors_that_return_the_buffer() {
    let mut r: Ring<u32> = Ring::new(1, 1);
    let (s, _t) = r.post(Kind::Source, 1).unwrap();
    let (e, buf) = r.post(Kind::Source, 2).unwrap_err();
    assert_eq!(buf, 2);
    assert!(matches!(
        e,
        Error::InvalidArgument(InvalidArgument::SendQueueFull { depth: 1 })
    ));
    let (_, _r) = r.post(Kind::Recv, 3).unwrap();
    let (e, _) = r.post(Kind::Recv, 4).unwrap_err();
    assert!(matches!(
        e,
        Error::InvalidArgument(InvalidArgument::RecvQueueFull { depth: 1 })
    ));
    // Four slots: complete the send and never take it, three more times.
    assert!(r.complete(s, ok(0)));
    for n in 0..2 {
        let (id, _t) = r.post(Kind::Source, 10 + n).unwrap();
        assert!(r.complete(id, ok(0)));
    }
    let (e, buf) = r.post(Kind::Source, 99).unwrap_err();
    assert_eq!(buf, 99);
    assert!(
        matches!(
            e,
            Error::InvalidArgument(InvalidArgument::UncollectedCompletions { slots: 4 })
        ),
        "{e}"
    );
    // Taking them makes room again, oldest first.
    assert_eq!(r.take_next().unwrap().1.1, 1);
    assert_eq!(r.take_next().unwrap().1.1, 10);
    assert!(r.post(Kind::Source, 5).is_ok());
}

/// Two rings made alike (as for queue pairs of two devices with the same number, or a device
/// reusing the number of a queue pair destroyed) refuse each other's tickets: one is never
/// handed the other's buffer. (Found by helper-20 when tickets named their queue pair by its
/// number.)
#[test]
fn rings_made_alike_refuse_each_others_tickets() {
    let mut a: Ring<u8> = Ring::new(4, 4);
    let mut b: Ring<u8> = Ring::new(4, 4);
    let (ia, ta) = a.post(Kind::Source, 1).unwrap();
    let (ib, _tb) = b.post(Kind::Source, 2).unwrap();
    assert!(a.complete(ia, ok(0)));
    assert!(b.complete(ib, ok(0)));
    assert!(a.owns(&ta));
    assert!(!b.owns(&ta), "same slot and generation, another ring");
    assert_eq!(b.take_next().unwrap().1.1, 2, "b's request is still b's");
}

/// A ticket kept after `take_next` took its request is stale: refused, even once its slot was
/// reused 2^32 times (a `wr_id` carries only 32 bits of the generation).
#[test]
fn a_stale_ticket_is_refused_even_after_its_slot_was_reused_2_pow_32_times() {
    let mut r: Ring<u8> = Ring::new(1, 1);
    let (id, t) = r.post(Kind::Source, 1).unwrap();
    assert!(r.complete(id, ok(0)));
    let (dup, _) = r.take_next().unwrap();
    assert_eq!(dup, t);
    // 2^32 - 1 more uses of the slot (the free list hands it out again next).
    r.slots[t.slot as usize].generation += u64::from(u32::MAX);
    let (id2, _t2) = r.post(Kind::Source, 2).unwrap();
    assert_eq!(id2 as u32, t.slot);
    assert_eq!(id2 >> 32, id >> 32, "same wr_id as the first use");
    assert!(r.complete(id2, ok(0)));
    assert!(!r.owns(&t));
    assert_eq!(r.take_next().unwrap().1.1, 2);
}

/// The verbs define a completion's byte count and immediate for receives (and a read's and an
/// atomic's count), and a provider may leave another completion's there for a send: a send or
/// write reports no length and no immediate and fills nothing, a read the length it asked
/// for, an atomic 8, a receive what arrived, and a receive consumed by an RDMA WRITE with
/// immediate its immediate and no bytes.
#[test]
fn each_kind_of_request_reports_what_its_completion_defines() {
    let mut r: Ring<&'static str> = Ring::new(4, 4);
    let stale = |write_imm| Outcome {
        status: WcStatus::Success,
        vendor_err: 0,
        len: 4096,
        imm: Some(7),
        write_imm,
    };
    let posts = [
        (Kind::Source, false, 0, None, false),
        (Kind::Read(100), false, 100, None, true),
        (Kind::Atomic, false, 8, None, true),
        (Kind::Recv, false, 4096, Some(7), true),
        (Kind::Recv, true, 0, Some(7), true),
    ];
    for (kind, write_imm, len, imm, fills) in posts {
        let (id, t) = r.post(kind, "b").unwrap();
        assert!(r.complete(id, stale(write_imm)));
        let (res, _, f) = r.take(&t).unwrap();
        assert_eq!(res.unwrap(), Completed { len, imm }, "{kind:?}");
        assert_eq!(f, fills, "{kind:?}");
    }
}

/// A failure is reported as itself; the requests flushed after it report it as their cause,
/// and a flush with no failure before it is `Flushed`.
#[test]
fn flushed_requests_report_the_failure_that_moved_the_queue_pair_to_error() {
    let fail = |status| Outcome {
        status,
        vendor_err: 7,
        len: 0,
        imm: None,
        write_imm: false,
    };
    let mut r: Ring<u8> = Ring::new(4, 4);
    let (i0, t0) = r.post(Kind::Recv, 0).unwrap();
    assert!(r.complete(i0, fail(WcStatus::WrFlushErr)));
    let (res, _, _) = r.take(&t0).unwrap();
    assert!(
        matches!(res, Err(Error::QpFailed(QpFailure::Flushed))),
        "{res:?}"
    );
    let (i1, t1) = r.post(Kind::Source, 1).unwrap();
    let (i2, t2) = r.post(Kind::Source, 2).unwrap();
    assert!(r.complete(i1, fail(WcStatus::RemAccessErr)));
    assert!(r.complete(i2, fail(WcStatus::WrFlushErr)));
    let cause = QpFailure::WorkCompletion {
        status: WcStatus::RemAccessErr,
        vendor_err: 7,
    };
    for t in [t1, t2] {
        match r.take(&t).unwrap().0 {
            Err(Error::QpFailed(f)) => assert_eq!(f, cause),
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn a_detached_request_drops_its_buffer_when_it_completes_not_before() {
    let dropped = Rc::new(RefCell::new(Vec::new()));
    let mut r: Ring<Buf> = Ring::new(2, 2);
    let (id, t) = r
        .post(Kind::Source, Buf(1, dropped.clone(), false))
        .unwrap();
    r.detach(&t);
    assert!(
        dropped.borrow().is_empty(),
        "dropped while the device may use it"
    );
    assert_eq!(r.in_flight(), 1);
    assert!(r.complete(id, ok(0)));
    // Dropped once the batch it came in is applied (as the CQ poll does).
    r.drop_released();
    assert_eq!(*dropped.borrow(), vec![1]);
    assert!(
        r.take_next().is_none(),
        "a detached completion is not handed out"
    );
    // Detaching a completed one drops it at once.
    let (id, t) = r.post(Kind::Recv, Buf(2, dropped.clone(), false)).unwrap();
    assert!(r.complete(id, ok(0)));
    r.detach(&t);
    assert_eq!(*dropped.borrow(), vec![1, 2]);
    assert!(r.take_next().is_none());
}

/// However a ring is dropped (with its queue pair's fields while a panic unwinds, or in a
/// reaper task a runtime drops), the buffers of requests in flight are leaked, not freed: the
/// device may still write them. Settled ones are dropped.
#[test]
fn a_ring_dropped_with_requests_in_flight_never_frees_their_buffers() {
    let dropped = Rc::new(RefCell::new(Vec::new()));
    let mut r: Ring<Buf> = Ring::new(2, 2);
    let (_, _t1) = r
        .post(Kind::Source, Buf(1, dropped.clone(), false))
        .unwrap();
    let (_, t2) = r.post(Kind::Recv, Buf(2, dropped.clone(), false)).unwrap();
    r.detach(&t2);
    let (id3, _t3) = r.post(Kind::Recv, Buf(3, dropped.clone(), false)).unwrap();
    assert!(r.complete(id3, ok(0)));
    drop(r);
    assert_eq!(
        *dropped.borrow(),
        vec![3],
        "only the completed request's buffer"
    );
}

/// A buffer's `Drop` may panic. The completions of one CQ poll are all applied before any
/// buffer of a request given up is dropped (a panic cannot cut the batch short and leave
/// requests the device has finished counted in flight forever), and a panic while dropping
/// them leaves the ring consistent.
#[test]
fn a_panicking_buffer_drop_loses_no_completion_and_leaves_the_ring_consistent() {
    use std::panic::{AssertUnwindSafe, catch_unwind};
    let dropped = Rc::new(RefCell::new(Vec::new()));
    let mut r: Ring<Buf> = Ring::new(4, 4);
    let (ia, ta) = r.post(Kind::Source, Buf(1, dropped.clone(), true)).unwrap();
    r.detach(&ta);
    let (ib, tb) = r.post(Kind::Recv, Buf(2, dropped.clone(), false)).unwrap();
    let (ic, tc) = r.post(Kind::Recv, Buf(3, dropped.clone(), false)).unwrap();
    r.detach(&tb);
    // One batch, as a CQ poll applies it.
    for id in [ia, ib, ic] {
        let applied = catch_unwind(AssertUnwindSafe(|| r.complete(id, ok(8))));
        assert!(
            matches!(applied, Ok(true)),
            "complete() ran a buffer's Drop"
        );
    }
    assert_eq!(r.in_flight(), 0);
    assert!(dropped.borrow().is_empty());
    let p = catch_unwind(AssertUnwindSafe(|| r.drop_released()));
    assert!(p.is_err(), "a buffer's Drop panicked");
    r.drop_released();
    let mut d = dropped.borrow().clone();
    d.sort_unstable();
    assert_eq!(d, vec![1, 2]);
    let (res, buf, _) = r.take(&tc).unwrap();
    assert_eq!((res.unwrap().len, buf.0), (8, 3));
    assert_eq!(r.free.len(), r.slots.len(), "every slot free again");
}

/// A post the device refused gives the buffer back and leaves nothing behind: the slot is free
/// again, nothing is in flight, its id completes nothing and its ticket names nothing.
#[test]
fn a_refused_post_leaves_nothing_in_the_ring() {
    let mut r: Ring<u8> = Ring::new(1, 1);
    let (id, t) = r.post(Kind::Source, 1).unwrap();
    let dup = Ticket {
        owner: t.owner,
        slot: t.slot,
        generation: t.generation,
    };
    assert_eq!(r.unpost(t), 1);
    assert_eq!(r.in_flight(), 0);
    assert_eq!(r.free.len(), r.slots.len());
    assert!(!r.owns(&dup));
    assert!(!r.complete(id, ok(0)));
    assert!(r.post(Kind::Source, 2).is_ok(), "the queue has room again");
}

/// Random posts of every kind, completions in random order (as a send and a receive queue
/// complete independently) applied in batches, takes by ticket and in order, and detaches:
/// every buffer comes back exactly once, through the request it was posted with, with what
/// its kind reports, and `take_next` hands completions out in completion order.
#[test]
fn randomized_interleavings_never_misroute_or_lose_a_buffer() {
    for seed in 1..200u64 {
        let mut rng = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut r: Ring<u64> = Ring::new(3, 5);
        // Posted and not completed, by wr_id: the buffer (a serial) and its ticket if kept.
        let mut posted: Vec<(u64, u64, Option<Ticket>)> = Vec::new();
        let mut tickets: Vec<(Ticket, u64)> = Vec::new();
        // What the device reports for each request, and what its taker must see.
        let mut device: HashMap<u64, usize> = HashMap::new();
        let mut expect: HashMap<u64, usize> = HashMap::new();
        // Completed and not taken, in completion order (what `take_next` must follow).
        let mut done_order: Vec<u64> = Vec::new();
        let mut back = 0u64;
        let mut detached = 0u64;
        let mut serial = 0u64;
        for _ in 0..3_000 {
            match next() % 5 {
                0 | 1 => {
                    serial += 1;
                    let read = (next() % 1000) as u32;
                    let kind = match next() % 3 {
                        0 => Kind::Source,
                        1 => Kind::Read(read),
                        _ => Kind::Recv,
                    };
                    match r.post(kind, serial) {
                        Ok((id, t)) => {
                            let dev = (next() % 1000) as usize;
                            device.insert(serial, dev);
                            expect.insert(
                                serial,
                                match kind {
                                    Kind::Source => 0,
                                    Kind::Read(len) => len as usize,
                                    Kind::Atomic => 8,
                                    Kind::Recv => dev,
                                },
                            );
                            if next() % 4 == 0 {
                                r.detach(&t);
                                detached += 1;
                                posted.push((id, serial, None));
                            } else {
                                posted.push((id, serial, Some(t)));
                            }
                        }
                        Err((_, b)) => assert_eq!(b, serial),
                    }
                }
                2 if !posted.is_empty() => {
                    let k = (next() as usize) % posted.len();
                    let (id, s, t) = posted.swap_remove(k);
                    assert!(r.complete(id, ok(device[&s])));
                    if let Some(t) = t {
                        tickets.push((t, s));
                        done_order.push(s);
                    }
                    // Batches of one or more completions.
                    if next() % 2 == 0 {
                        r.drop_released();
                    }
                }
                3 if !tickets.is_empty() => {
                    let k = (next() as usize) % tickets.len();
                    let (t, s) = tickets.swap_remove(k);
                    let (res, buf, _) = r.take(&t).unwrap();
                    assert_eq!(buf, s, "seed {seed}: a ticket got another request's buffer");
                    assert_eq!(res.unwrap().len, expect[&s]);
                    done_order.retain(|&d| d != s);
                    back += 1;
                }
                4 => {
                    if let Some((t, (res, buf, _))) = r.take_next() {
                        assert_eq!(done_order.remove(0), buf, "seed {seed}: out of order");
                        let k = tickets.iter().position(|(_, s)| *s == buf).unwrap();
                        let (kept, s) = tickets.swap_remove(k);
                        assert_eq!(kept, t);
                        assert_eq!(res.unwrap().len, expect[&s]);
                        back += 1;
                    }
                }
                _ => {}
            }
            assert_eq!(done_order.is_empty(), r.head == NONE, "seed {seed}");
            assert_eq!(r.in_flight() as usize, posted.len());
        }
        // Complete and take the rest.
        for (id, s, _) in posted.drain(..) {
            assert!(r.complete(id, ok(device[&s])));
        }
        r.drop_released();
        while r.take_next().is_some() {
            back += 1;
        }
        assert_eq!(back + detached, device.len() as u64, "seed {seed}");
        assert_eq!(r.free.len(), r.slots.len());
    }
}

/// Posts a batch of sends (buffers `first..first + n`), linked as `Batch::post` links them.
fn post_batch(r: &mut Ring<u32>, first: u32, n: u32) -> Vec<(u64, Ticket)> {
    let posted: Vec<(u64, Ticket)> = (first..first + n)
        .map(|b| r.post(Kind::Source, b).unwrap())
        .collect();
    let linked: Vec<(u32, u64)> = posted.iter().map(|(_, t)| (t.slot, t.generation)).collect();
    r.link_batch(&linked);
    posted
}

#[test]
fn a_batch_completes_with_its_last_request_oldest_first() {
    let mut r: Ring<u32> = Ring::new(4, 0);
    let batch = post_batch(&mut r, 0, 3);
    assert_eq!(r.in_flight(), 3);
    // Only the last asked for a completion: it completes all three, oldest first.
    assert!(r.complete(batch[2].0, ok(0)));
    assert_eq!(r.in_flight(), 0);
    for want in 0..3 {
        let (_, (res, buf, _)) = r.take_next().unwrap();
        assert_eq!((res.unwrap().len, buf), (0, want));
    }
    assert!(r.take_next().is_none());
    // A batch of one is a plain signaled request.
    let one = post_batch(&mut r, 9, 1);
    assert!(r.complete(one[0].0, ok(0)));
    assert_eq!(r.take_next().unwrap().1.1, 9);
}

#[test]
fn a_failed_request_of_a_batch_completes_alone_and_the_others_as_the_device_says() {
    let fail = |status| Outcome {
        status,
        vendor_err: 0,
        len: 0,
        imm: None,
        write_imm: false,
    };
    let mut r: Ring<u32> = Ring::new(4, 0);
    let b = post_batch(&mut r, 0, 3);
    // The middle one fails: its completion is its own (the one before it is not done yet,
    // as far as the ring knows, and the one after it is flushed on its own).
    assert!(r.complete(b[1].0, fail(WcStatus::RemAccessErr)));
    assert_eq!(r.in_flight(), 2);
    assert!(r.take(&b[0].1).is_none());
    // The last one's flush covers the first, which succeeded before the failure.
    assert!(r.complete(b[2].0, fail(WcStatus::WrFlushErr)));
    assert_eq!(r.in_flight(), 0);
    assert!(r.take(&b[0].1).unwrap().0.is_ok());
    let cause = QpFailure::WorkCompletion {
        status: WcStatus::RemAccessErr,
        vendor_err: 0,
    };
    for t in [&b[1].1, &b[2].1] {
        match r.take(t).unwrap().0 {
            Err(Error::QpFailed(f)) => assert_eq!(f, cause),
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn a_batch_never_completes_a_request_that_reused_one_of_its_slots() {
    let mut r: Ring<u32> = Ring::new(4, 0);
    let b = post_batch(&mut r, 0, 3);
    let flushed = Outcome {
        status: WcStatus::WrFlushErr,
        ..Outcome::SUCCESS
    };
    // The oldest completes on its own (flushed), is taken, and its slot goes to a new request.
    assert!(r.complete(b[0].0, flushed));
    let _ = r.take(&b[0].1).unwrap();
    let (_, newer) = r.post(Kind::Source, 7).unwrap();
    assert_eq!(newer.slot, b[0].1.slot, "the freed slot is reused");
    // The last one's completion stops at the stale link: the new request stays in flight
    // (and the middle one, which would have had its own flush, is not reached either).
    assert!(r.complete(b[2].0, flushed));
    assert!(r.take(&newer).is_none());
    assert!(r.take(&b[1].1).is_none());
    assert_eq!(r.in_flight(), 2);
}

#[test]
fn given_up_requests_of_a_batch_drop_their_buffers_when_the_batch_completes() {
    let dropped = Rc::new(RefCell::new(Vec::new()));
    let mut r: Ring<Buf> = Ring::new(4, 0);
    let posted: Vec<(u64, Ticket)> = (0..3)
        .map(|k| {
            r.post(Kind::Source, Buf(k, dropped.clone(), false))
                .ok()
                .unwrap()
        })
        .collect();
    let linked: Vec<(u32, u64)> = posted.iter().map(|(_, t)| (t.slot, t.generation)).collect();
    r.link_batch(&linked);
    r.detach(&posted[0].1);
    r.detach(&posted[1].1);
    assert!(dropped.borrow().is_empty(), "still on the device");
    assert!(r.complete(posted[2].0, ok(0)));
    r.drop_released();
    assert_eq!(*dropped.borrow(), vec![1, 0]);
    let (res, buf, _) = r.take(&posted[2].1).unwrap();
    assert!(res.is_ok() && buf.0 == 2);
    drop(buf);
    assert_eq!(r.free.len(), r.slots.len());
}
