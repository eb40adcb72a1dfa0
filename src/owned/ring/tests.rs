use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use super::*;

fn ok(len: usize) -> Outcome {
    Outcome::ok(len as u32)
}

#[test]
fn a_completion_reaches_the_request_it_names_and_gives_its_buffer_back() {
    let mut r: Ring<&'static str> = Ring::new(7, 2, 2);
    let (id_a, a) = r.post(true, "a").unwrap();
    let (id_b, b) = r.post(false, "b").unwrap();
    assert_eq!(r.in_flight(), 2);
    assert!(r.complete(id_b, ok(5)));
    // `a` has not completed.
    assert!(r.take(&a).is_none());
    let (res, buf) = r.take(&b).unwrap();
    assert_eq!((res.unwrap().len, buf), (5, "b"));
    assert!(!r.owns(&b), "taken");
    assert!(r.complete(id_a, ok(0)));
    let (res, buf) = r.take(&a).unwrap();
    assert_eq!((res.unwrap().len, buf), (0, "a"));
    assert_eq!(r.in_flight(), 0);
    // Taken: the id names nothing any more (a completion for it is ignored).
    assert!(!r.complete(id_a, ok(1)));
}

#[test]
fn full_queues_and_uncollected_completions_are_errors_that_return_the_buffer() {
    let mut r: Ring<u32> = Ring::new(1, 1, 1);
    let (s, _t) = r.post(true, 1).unwrap();
    let (e, buf) = r.post(true, 2).unwrap_err();
    assert_eq!(buf, 2);
    assert!(matches!(
        e,
        Error::InvalidArgument(InvalidArgument::SendQueueFull { depth: 1 })
    ));
    let (_, _r) = r.post(false, 3).unwrap();
    let (e, _) = r.post(false, 4).unwrap_err();
    assert!(matches!(
        e,
        Error::InvalidArgument(InvalidArgument::RecvQueueFull { depth: 1 })
    ));
    // Four slots: complete the send and never take it, three more times.
    assert!(r.complete(s, ok(0)));
    for n in 0..2 {
        let (id, _t) = r.post(true, 10 + n).unwrap();
        assert!(r.complete(id, ok(0)));
    }
    let (e, buf) = r.post(true, 99).unwrap_err();
    assert_eq!(buf, 99);
    assert!(
        matches!(
            e,
            Error::InvalidArgument(InvalidArgument::UncollectedCompletions { slots: 4 })
        ),
        "{e}"
    );
    // Taking them makes room again, oldest first.
    assert_eq!(r.take_next().unwrap().2, 1);
    assert_eq!(r.take_next().unwrap().2, 10);
    assert!(r.post(true, 5).is_ok());
}

#[test]
fn a_ticket_of_another_queue_pair_or_a_stale_one_is_refused() {
    let mut a: Ring<u8> = Ring::new(1, 4, 4);
    let mut b: Ring<u8> = Ring::new(2, 4, 4);
    let (ia, ta) = a.post(true, 1).unwrap();
    let (_ib, _tb) = b.post(true, 2).unwrap();
    assert!(a.complete(ia, ok(0)));
    // Same slot and generation, other owner.
    assert!(a.owns(&ta));
    assert!(!b.owns(&ta));
    // A ticket naming a slot that was reused since.
    let (t, _, _) = a.take_next().unwrap();
    let (_, _t2) = a.post(true, 3).unwrap();
    // `t` named slot 0 at its first use; the slot is reused with another generation.
    assert!(!a.owns(&t));
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
    };
    let mut r: Ring<u8> = Ring::new(1, 4, 4);
    let (i0, t0) = r.post(false, 0).unwrap();
    assert!(r.complete(i0, fail(WcStatus::WrFlushErr)));
    let (res, _) = r.take(&t0).unwrap();
    assert!(
        matches!(res, Err(Error::QpFailed(QpFailure::Flushed))),
        "{res:?}"
    );
    let (i1, t1) = r.post(true, 1).unwrap();
    let (i2, t2) = r.post(true, 2).unwrap();
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
    #[derive(Debug)]
    struct Buf(u32, Rc<RefCell<Vec<u32>>>);
    impl Drop for Buf {
        fn drop(&mut self) {
            self.1.borrow_mut().push(self.0);
        }
    }
    let mut r: Ring<Buf> = Ring::new(1, 2, 2);
    let (id, t) = r.post(true, Buf(1, dropped.clone())).unwrap();
    r.detach(&t);
    assert!(
        dropped.borrow().is_empty(),
        "dropped while the device may use it"
    );
    assert_eq!(r.in_flight(), 1);
    assert!(r.complete(id, ok(0)));
    assert_eq!(*dropped.borrow(), vec![1]);
    assert!(
        r.take_next().is_none(),
        "a detached completion is not handed out"
    );
    // Detaching a completed one drops it at once.
    let (id, t) = r.post(false, Buf(2, dropped.clone())).unwrap();
    assert!(r.complete(id, ok(0)));
    r.detach(&t);
    assert_eq!(*dropped.borrow(), vec![1, 2]);
    assert!(r.take_next().is_none());
}

/// Random posts, completions in random order (as a send and a receive queue complete
/// independently), takes by ticket and in order, and detaches: every buffer comes back
/// exactly once, through the request it was posted with, and `take_next` hands completions
/// out in completion order.
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
        let mut r: Ring<u64> = Ring::new(3, 3, 5);
        // Completed and not taken, in completion order (what `take_next` must follow).
        let mut done_order: Vec<u64> = Vec::new();
        // Posted and not completed, by wr_id: the buffer (a serial) and its ticket if kept.
        let mut posted: Vec<(u64, u64, Option<Ticket>)> = Vec::new();
        let mut tickets: Vec<(Ticket, u64)> = Vec::new();
        let mut outcome: HashMap<u64, usize> = HashMap::new();
        let mut back = 0u64;
        let mut detached = 0u64;
        let mut serial = 0u64;
        for _ in 0..3_000 {
            match next() % 5 {
                0 | 1 => {
                    serial += 1;
                    match r.post(next() % 2 == 0, serial) {
                        Ok((id, t)) => {
                            outcome.insert(serial, (next() % 1000) as usize);
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
                    assert!(r.complete(id, ok(outcome[&s])));
                    if let Some(t) = t {
                        tickets.push((t, s));
                        done_order.push(s);
                    }
                }
                3 if !tickets.is_empty() => {
                    let k = (next() as usize) % tickets.len();
                    let (t, s) = tickets.swap_remove(k);
                    let (res, buf) = r.take(&t).unwrap();
                    assert_eq!(buf, s, "seed {seed}: a ticket got another request's buffer");
                    done_order.retain(|&d| d != s);
                    assert_eq!(res.unwrap().len, outcome[&s]);
                    back += 1;
                }
                4 => {
                    if let Some((t, res, buf)) = r.take_next() {
                        assert_eq!(done_order.remove(0), buf, "seed {seed}: out of order");
                        let k = tickets.iter().position(|(_, s)| *s == buf).unwrap();
                        let (kept, s) = tickets.swap_remove(k);
                        assert_eq!(kept, t);
                        assert_eq!(res.unwrap().len, outcome[&s]);
                        back += 1;
                    }
                }
                _ => {}
            }
            assert_eq!(done_order.is_empty(), r.head == NONE, "seed {seed}");
            assert_eq!(r.in_flight() as usize, posted.len());
        }
        // Complete and take the rest.
        for (id, s, t) in posted.drain(..) {
            assert!(r.complete(id, ok(outcome[&s])));
            if let Some(t) = t {
                tickets.push((t, s));
            }
        }
        while r.take_next().is_some() {
            back += 1;
        }
        assert_eq!(back + detached, outcome.len() as u64, "seed {seed}");
        assert_eq!(r.free.len(), r.slots.len());
    }
}
