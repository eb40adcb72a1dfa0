//! Two [`ConnProto`]s joined by a simulated reliable-connected wire, driven by random
//! interleavings of sends, cancellations, reads, stalls, completions, timeouts and failures.
//! Every step checks the invariants; every run ends with a drain that must deliver exactly
//! the committed messages, in order, without deadlock.

#![allow(clippy::print_stdout)]

use std::collections::{HashMap, VecDeque};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use super::*;
use crate::error::QpFailure;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// A message's bytes: its number, then a pattern derived from it.
pub(super) fn message(no: u64, len: usize) -> Vec<u8> {
    let mut v: Vec<u8> = (0..len).map(|i| (no as usize * 31 + i * 7) as u8).collect();
    let id = no.to_le_bytes();
    let n = len.min(8);
    v[..n].copy_from_slice(&id[..n]);
    v
}

#[derive(Debug)]
struct Packet {
    imm: u32,
    payload: Vec<u8>,
    control: Option<MsgKind>,
}

struct Active {
    id: u64,
    no: u64,
    data: Vec<u8>,
}

/// Rendezvous state of one simulated side.
#[derive(Default)]
struct Rdv {
    /// The memory of this side's rendezvous messages, by number, until released.
    mem: HashMap<u16, Vec<u8>>,
    /// Sends whose descriptor went out, waiting for the peer's read.
    awaiting: Vec<u64>,
    /// The peer's message this side is reading.
    fetch: Option<RemoteMsg>,
}

struct Side {
    proto: ConnProto<Vec<u8>>,
    active: Vec<Active>,
    next_no: u64,
    /// Messages whose last chunk went out (the peer must deliver exactly these, in order).
    committed: Vec<u64>,
    delivered: Vec<u64>,
    /// Receives on the simulated device.
    rq: u32,
    held: Vec<Delivery<Vec<u8>>>,
    /// Messages dropped and not reported yet (receive buffers, bytes): the shell holds
    /// reports back while `consumption_urgent` allows and gives them at a later look.
    unreported: (u32, u64),
    stalled: u32,
    closed: bool,
    saw_eof: bool,
    rdv: Rdv,
    /// The deadline when the shell last took it (see `check_deadline`).
    deadline: Option<Instant>,
    /// The handshake is not done on this side yet (`ConnProto::opening`): the peer may send,
    /// this side's application has no connection yet, and nothing may go out.
    opening: bool,
}

struct Sim {
    rng: Rng,
    now: Instant,
    sides: [Side; 2],
    /// In flight from side i to side 1 - i.
    wire: [VecDeque<Packet>; 2],
    /// Received by the peer, completion not yet seen by side i.
    acks: [VecDeque<Packet>; 2],
    cfg: ConnConfig,
}

pub(super) fn config(credits: u32, chunk: u32) -> ConnConfig {
    ConnConfig {
        send_credits: credits,
        send_initial: credits,
        recv_credits: credits,
        recv_initial: credits,
        max_send_size: chunk,
        max_message_size: u64::from(chunk) * 6,
        recv_budget: u64::from(chunk) * 8,
        keepalive: Some(Duration::from_millis(50)),
        keepalive_timeout: Duration::from_secs(3600),
        rendezvous: true,
        close_timeout: Duration::from_secs(3600),
    }
}

impl Sim {
    fn new(seed: u64, cfg: ConnConfig) -> Sim {
        let now = Instant::now();
        let side = || Side {
            proto: ConnProto::new(cfg, now),
            active: Vec::new(),
            next_no: 0,
            committed: Vec::new(),
            delivered: Vec::new(),
            rq: 0,
            held: Vec::new(),
            unreported: (0, 0),
            stalled: 0,
            closed: false,
            saw_eof: false,
            rdv: Rdv::default(),
            deadline: None,
            opening: false,
        };
        let mut sides = [side(), side()];
        for s in &mut sides {
            // The shell posts the first receives before the handshake completes.
            let n = s.proto.recvs_to_post();
            s.rq = n;
            s.proto.recvs_posted(n);
        }
        Sim {
            rng: Rng(seed | 1),
            now,
            sides,
            wire: [VecDeque::new(), VecDeque::new()],
            acks: [VecDeque::new(), VecDeque::new()],
            cfg,
        }
    }

    /// Side 1 is the passive side whose receives complete before its queue pair reaches
    /// RTS: a random step of [`step`](Self::step) (or the drain) establishes it.
    fn with_late_open(mut self) -> Sim {
        let s = &mut self.sides[1];
        s.proto = ConnProto::opening(self.cfg, self.now);
        let n = s.proto.recvs_to_post();
        s.rq = n;
        s.proto.recvs_posted(n);
        s.opening = true;
        self
    }

    fn establish(&mut self, i: usize) {
        let s = &mut self.sides[i];
        if std::mem::take(&mut s.opening) {
            s.proto.established(self.now);
        }
    }

    fn cx() -> Context<'static> {
        Context::from_waker(futures::task::noop_waker_ref())
    }

    fn start_send(&mut self, i: usize) {
        let s = &mut self.sides[i];
        if s.closed || s.active.len() >= 3 {
            return;
        }
        let max = self.cfg.max_send_size as u64 * 4;
        let len = 8 + self.rng.below(max + 1) as usize;
        let no = s.next_no;
        // The shell's fast path for a one-chunk message, tried first half the time: handed
        // out at once, or nothing changed and the message is queued as usual.
        if self.rng.chance(50) {
            if let Some(c) = s.proto.send_now(len as u64).expect("send_now") {
                assert!(c.last && c.offset == 0 && c.len as usize == len && c.rendezvous.is_none());
                s.next_no += 1;
                self.wire[i].push_back(Packet {
                    imm: c.imm,
                    payload: message(no, len),
                    control: None,
                });
                s.committed.push(no);
                return;
            }
        }
        let id = if self.rng.chance(25) {
            s.proto.start_send_rendezvous(len as u64)
        } else {
            s.proto.start_send(len as u64)
        }
        .expect("start");
        s.next_no += 1;
        s.active.push(Active {
            id,
            no,
            data: message(no, len),
        });
    }

    fn poll_chunk(&mut self, i: usize) {
        let s = &mut self.sides[i];
        if s.active.is_empty() {
            return;
        }
        let k = self.rng.below(s.active.len() as u64) as usize;
        let a = &s.active[k];
        if let Poll::Ready(r) = s.proto.poll_chunk(a.id, &mut Self::cx()) {
            let c = r.expect("chunk");
            let start = c.offset as usize;
            let payload = match c.rendezvous {
                Some(seq) => {
                    // The "address" is the message number; the memory stays until released.
                    s.rdv.mem.insert(seq, a.data.clone());
                    s.rdv.awaiting.push(a.id);
                    RemoteMsg::encode(a.no, a.data.len() as u64, u32::from(seq)).to_vec()
                }
                None => a.data[start..start + c.len as usize].to_vec(),
            };
            self.wire[i].push_back(Packet {
                imm: c.imm,
                payload,
                control: None,
            });
            if c.last {
                let a = s.active.remove(k);
                s.committed.push(a.no);
            }
        }
    }

    fn cancel(&mut self, i: usize) {
        let s = &mut self.sides[i];
        if !s.rdv.awaiting.is_empty() && self.rng.chance(50) {
            // A send waiting for the peer's read is dropped: its memory must stay.
            let k = self.rng.below(s.rdv.awaiting.len() as u64) as usize;
            let id = s.rdv.awaiting.swap_remove(k);
            s.proto.cancel_send(id);
            return;
        }
        if s.active.is_empty() {
            return;
        }
        let k = self.rng.below(s.active.len() as u64) as usize;
        let a = s.active.remove(k);
        s.proto.cancel_send(a.id);
    }

    fn drive(&mut self, i: usize) {
        // A shell on a shared receive queue posts what its budget allows: maybe less.
        let partial = self.cfg.recv_initial < self.cfg.recv_credits;
        let s = &mut self.sides[i];
        let mut n = s.proto.recvs_to_post();
        if partial {
            n = self.rng.below(u64::from(n) + 1) as u32;
        }
        s.rq += n;
        s.proto.recvs_posted(n);
        while let Some(t) = s.proto.poll_transmit_checked(self.now) {
            assert!(!s.opening, "{t:?} handed out before the handshake was done");
            self.wire[i].push_back(Packet {
                imm: t.imm,
                payload: Vec::new(),
                control: Some(t.kind),
            });
        }
        let _ = s.proto.take_driver_kick();
        let _ = s.proto.take_wakers().count();
        let released: Vec<u16> = s.proto.take_released().collect();
        for seq in released {
            assert!(s.rdv.mem.remove(&seq).is_some(), "released {seq} twice");
        }
        let mut cx = Self::cx();
        let proto = &mut s.proto;
        s.rdv
            .awaiting
            .retain(|&id| proto.poll_fetched(id, &mut cx).is_pending());
    }

    /// Side i's read of the peer's rendezvous message completes: the memory must still be
    /// there.
    fn complete_fetch(&mut self, i: usize) {
        let Some(m) = self.sides[i].rdv.fetch.take() else {
            return;
        };
        let data = self.sides[1 - i]
            .rdv
            .mem
            .get(&(m.rkey as u16))
            .unwrap_or_else(|| panic!("message {} released before it was read", m.addr))
            .clone();
        assert_eq!(data.len() as u64, m.len);
        let s = &mut self.sides[i];
        s.proto.fetch_done(Ok(()));
        assert_eq!(s.proto.fetch_ready(), Some(true));
        s.proto.fetch_taken();
        s.delivered.push(m.addr);
        s.held.push(Delivery::Assembled(data));
    }

    /// Delivers the oldest packet from side i to its peer. Returns false if nothing moved.
    fn deliver(&mut self, i: usize) -> bool {
        let j = 1 - i;
        let Some(p) = self.wire[i].front() else {
            return false;
        };
        if self.sides[j].rq == 0 {
            panic!(
                "{} found no posted receive (receiver not ready): {}",
                if p.control.is_some() {
                    "a control message"
                } else {
                    "a data chunk"
                },
                self.describe()
            );
        }
        let p = self.wire[i].pop_front().expect("front");
        let r = &mut self.sides[j];
        r.rq -= 1;
        let mut buf = vec![0u8; self.cfg.max_send_size as usize];
        buf[..p.payload.len()].copy_from_slice(&p.payload);
        r.proto
            .handle_recv(Ok((p.payload.len() as u32, Some(p.imm))), buf);
        assert!(
            r.proto.failure().is_none(),
            "side {j} failed: {:?}",
            r.proto.failure()
        );
        self.acks[i].push_back(p);
        true
    }

    fn ack(&mut self, i: usize) {
        if let Some(p) = self.acks[i].pop_front() {
            if let Some(kind) = p.control {
                self.sides[i]
                    .proto
                    .handle_control_done(kind, Ok(()), self.now);
            }
        }
    }

    fn read(&mut self, i: usize) {
        let s = &mut self.sides[i];
        if let Poll::Ready(r) = s.proto.poll_recv(&mut Self::cx()) {
            match r.expect("recv") {
                Some(Delivery::Remote(m)) => {
                    assert!(!s.saw_eof, "a message after end of stream");
                    s.rdv.fetch = Some(m);
                }
                Some(d) => {
                    let bytes: &[u8] = match &d {
                        Delivery::Buf { buf, len } => &buf[..*len],
                        Delivery::Assembled(v) => v,
                        Delivery::Remote(_) => unreachable!(),
                    };
                    assert!(!s.saw_eof, "a message after end of stream");
                    let no = u64::from_le_bytes(bytes[..8].try_into().expect("8-byte id"));
                    let expect = message(no, bytes.len());
                    assert!(bytes == &expect[..], "message {no} intact");
                    s.delivered.push(no);
                    s.held.push(d);
                }
                None => s.saw_eof = true,
            }
        }
    }

    fn drop_held(&mut self, i: usize) {
        let s = &mut self.sides[i];
        if s.held.is_empty() {
            return;
        }
        let k = self.rng.below(s.held.len() as u64) as usize;
        let d = s.held.swap_remove(k);
        if !s.proto.consumption_urgent() && self.rng.chance(50) {
            // Held back, as the shell's drop of a message does when nothing needs it now.
            s.unreported.0 += u32::from(d.holds_buffer());
            s.unreported.1 += d.len() as u64;
        } else {
            s.proto.consumed(d.holds_buffer(), d.len());
        }
    }

    /// Gives the reports side `i` held back: the shell does at its next look (sometimes), and
    /// at once when the state makes them urgent.
    fn report_dropped(&mut self, i: usize) {
        let s = &mut self.sides[i];
        if s.unreported != (0, 0) && (s.proto.consumption_urgent() || self.rng.chance(10)) {
            let (bufs, bytes) = std::mem::take(&mut s.unreported);
            s.proto.consumed_many(bufs, bytes);
        }
    }

    fn check(&self) {
        for (i, s) in self.sides.iter().enumerate() {
            let peer = &self.sides[1 - i];
            // Exactly the peer's committed messages, in order: cancelled ones never appear.
            assert!(
                peer.committed.starts_with(&s.delivered),
                "delivered {:?} is not a prefix of committed {:?}",
                s.delivered,
                peer.committed
            );
            let (bytes, bufs) = s.proto.held();
            let c = self.cfg;
            // The budget, the chunks in flight, and one rendezvous message.
            assert!(
                bytes
                    <= c.recv_budget
                        + u64::from(c.max_send_size) * u64::from(c.send_credits)
                        + c.max_message_size,
                "held {bytes} bytes: over budget"
            );
            assert!(
                s.rq + bufs <= 2 * c.recv_credits + CONTROL_RECVS,
                "receive buffers in use {} + {}: over the pool",
                s.rq,
                bufs
            );
        }
    }

    fn step(&mut self) {
        if self.sides[1].opening && self.rng.chance(2) {
            self.establish(1);
        }
        let i = self.rng.below(2) as usize;
        // An opening side has no application yet and no driver task (no timers): only
        // completions and the completion handler's pump reach it.
        let user = !self.sides[i].opening;
        match self.rng.below(20) {
            0 | 1 if user => self.start_send(i),
            2..=5 if user => self.poll_chunk(i),
            6 if user && self.rng.chance(30) => self.cancel(i),
            7 | 8 => self.drive(i),
            9..=11 => {
                self.deliver(i);
            }
            12 | 13 => self.ack(i),
            14 | 15 if user => {
                if self.sides[i].stalled == 0 {
                    if self.rng.chance(50) {
                        self.complete_fetch(i);
                    }
                    self.read(i);
                }
            }
            16 if user => {
                if self.sides[i].stalled == 0 {
                    self.drop_held(i);
                }
            }
            17 => {
                if self.rng.chance(5) {
                    self.sides[i].stalled = 200 + self.rng.below(800) as u32;
                }
            }
            0..=6 | 14..=16 => {}
            _ => {
                self.now += Duration::from_millis(self.rng.below(20));
                for s in self.sides.iter_mut().filter(|s| !s.opening) {
                    s.proto.handle_timeout(self.now);
                }
            }
        }
        for i in 0..2 {
            self.report_dropped(i);
        }
        for s in &mut self.sides {
            s.stalled = s.stalled.saturating_sub(1);
            s.deadline = s.proto.check_deadline(s.deadline);
        }
        self.check();
    }

    /// Everyone reads and finishes; nothing new starts. Must reach quiescence.
    fn drain(&mut self) {
        self.establish(1);
        for s in &mut self.sides {
            s.stalled = 0;
        }
        let mut idle_rounds = 0;
        for _ in 0..200_000 {
            let before = self.progress_marker();
            for i in 0..2 {
                self.poll_chunk(i);
                self.drive(i);
                while self.deliver(i) {}
                while !self.acks[i].is_empty() {
                    self.ack(i);
                }
                self.complete_fetch(i);
                self.read(i);
                while !self.sides[i].held.is_empty() {
                    self.drop_held(i);
                }
                self.report_dropped(i);
            }
            self.check();
            if self.quiescent() {
                return;
            }
            if self.progress_marker() == before {
                idle_rounds += 1;
                assert!(idle_rounds < 1000, "deadlock: {}", self.describe());
            } else {
                idle_rounds = 0;
            }
        }
        panic!("no quiescence: {}", self.describe());
    }

    fn progress_marker(&self) -> (usize, usize, usize, usize, usize, usize, usize) {
        (
            self.sides[0].rdv.mem.len() + self.sides[1].rdv.mem.len(),
            self.sides[0].delivered.len(),
            self.sides[1].delivered.len(),
            self.sides[0].committed.len() + self.sides[0].active.len(),
            self.sides[1].committed.len() + self.sides[1].active.len(),
            self.wire[0].len() + self.acks[0].len(),
            self.wire[1].len() + self.acks[1].len(),
        )
    }

    fn quiescent(&self) -> bool {
        (0..2).all(|i| {
            let s = &self.sides[i];
            s.active.is_empty()
                && s.rdv.mem.is_empty()
                && s.rdv.awaiting.is_empty()
                && self.wire[i].is_empty()
                && self.acks[i].is_empty()
                && self.sides[1 - i].delivered.len() == s.committed.len()
        })
    }

    fn describe(&self) -> String {
        let mut out = String::new();
        for (i, s) in self.sides.iter().enumerate() {
            out += &format!(
                "\nside {i}: active {} committed {} delivered {} rq {} held {:?} credits {:?} wire {} acks {}",
                s.active.len(),
                s.committed.len(),
                s.delivered.len(),
                s.rq,
                s.proto.held(),
                s.proto.credits(),
                self.wire[i].len(),
                self.acks[i].len()
            );
        }
        out
    }
}

#[test]
fn random_interleavings_deliver_exactly_the_committed_messages() {
    let mut totals = (0u64, 0u64, 0u64, 0u64, 0u64);
    for seed in 0..200u64 {
        // Small windows (a receive batch of 1) and larger ones (batches of 2 to 5).
        let credits = [2u32, 3, 4, 5, 6, 8, 12, 16, 21][(seed % 9) as usize];
        let chunk = [64u32, 100, 256][(seed % 3) as usize];
        // Every fourth run starts with fewer credits than the depth and grants the rest
        // piecemeal, as a connection on a shared receive queue does.
        let initial = if seed % 4 == 3 {
            1 + (seed / 4) as u32 % credits
        } else {
            credits
        };
        // Every fifth run without keepalives: then a control message blocked on the window
        // (not only one in flight) sets the earliest deadline, and the deadline checks see it.
        let keepalive = if seed % 5 == 4 {
            None
        } else {
            config(credits, chunk).keepalive
        };
        let mut sim = Sim::new(
            seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xdead_beef,
            ConnConfig {
                send_initial: initial,
                recv_initial: initial,
                keepalive,
                ..config(credits, chunk)
            },
        );
        // Every other run, side 1 receives before its handshake is done (the passive side's
        // queue pair in RTR until `ESTABLISHED`).
        if seed % 2 == 1 {
            sim = sim.with_late_open();
        }
        for _ in 0..3000 {
            sim.step();
        }
        sim.drain();
        for i in 0..2 {
            // The shell gives what it held back at its next look.
            let (bufs, bytes) = std::mem::take(&mut sim.sides[i].unreported);
            sim.sides[i].proto.consumed_many(bufs, bytes);
        }
        for s in &sim.sides {
            let c = s.proto.counters();
            totals.0 += c.messages_received;
            totals.1 += c.aborts_received;
            totals.2 += c.reposts_withheld;
            totals.3 += c.credit_messages;
            totals.4 += c.rendezvous_received;
            assert_eq!(s.proto.held(), (0, 0), "everything consumed");
        }
    }
    println!(
        "delivered {} messages ({} by rendezvous), {} aborts, {} withheld re-posts, {} credit \
         messages",
        totals.0, totals.4, totals.1, totals.2, totals.3
    );
    assert!(
        totals.0 > 5_000 && totals.1 > 100 && totals.2 > 100 && totals.4 > 1_000,
        "{totals:?}"
    );
}

#[test]
fn a_slow_reader_bounds_memory_and_slows_the_sender() {
    let cfg = config(4, 256);
    let mut sim = Sim::new(7, cfg);
    sim.sides[1].stalled = u32::MAX;
    for _ in 0..20_000 {
        sim.start_send(0);
        sim.poll_chunk(0);
        sim.drive(0);
        sim.drive(1);
        sim.deliver(0);
        sim.deliver(1);
        sim.ack(0);
        sim.ack(1);
        sim.check();
    }
    let (bytes, _) = sim.sides[1].proto.held();
    assert!(bytes <= cfg.recv_budget + 256 * 4);
    let sent = sim.sides[0].committed.len();
    assert!(
        sent < 100,
        "the sender was held back: {sent} messages committed"
    );
    sim.drain();
}

#[test]
fn close_after_messages_gives_end_of_stream_after_all_of_them() {
    for seed in 0..50 {
        let mut sim = Sim::new(seed + 1000, config(3, 64));
        for _ in 0..500 {
            sim.step();
        }
        // Sends still queued are cancelled (their futures dropped); close goes out after.
        for a in std::mem::take(&mut sim.sides[0].active) {
            sim.sides[0].proto.cancel_send(a.id);
        }
        sim.sides[0].proto.close();
        sim.sides[0].closed = true;
        assert!(
            sim.sides[0].proto.start_send(1).is_err(),
            "no sends after close"
        );
        sim.drain();
        // Quiescence says nothing about the close, which may still wait for a control receive
        // that side's driver has not posted yet, or for a timer: run the drivers, the wire
        // and the clock until the peer reads end of stream.
        for _ in 0..10_000 {
            sim.read(1);
            if sim.sides[1].saw_eof {
                break;
            }
            sim.now += Duration::from_millis(10);
            for i in 0..2 {
                sim.sides[i].proto.handle_timeout(sim.now);
                sim.drive(i);
                while sim.deliver(i) {}
                while !sim.acks[i].is_empty() {
                    sim.ack(i);
                }
            }
        }
        assert!(sim.sides[1].saw_eof, "end of stream seen (seed {seed})");
        assert_eq!(sim.sides[1].delivered.len(), sim.sides[0].committed.len());
    }
}

#[test]
fn a_failure_resolves_every_waiter_and_is_never_a_clean_close() {
    let mut sim = Sim::new(42, config(2, 64));
    for _ in 0..300 {
        sim.step();
    }
    let p = &mut sim.sides[0].proto;
    assert!(p.fail(QpFailure::Disconnected));
    assert!(!p.fail(QpFailure::Flushed), "the first cause is kept");
    let mut cx = Sim::cx();
    // Queued messages may still be read; then the failure, not end of stream.
    loop {
        match p.poll_recv(&mut cx) {
            Poll::Ready(Ok(Some(_))) => continue,
            Poll::Ready(Err(Error::QpFailed(QpFailure::Disconnected))) => break,
            other => panic!("expected the failure, got {other:?}"),
        }
    }
    assert!(p.start_send(1).is_err());
    assert!(matches!(p.poll_close(&mut cx), Poll::Ready(Err(_))));
    assert!(p.poll_transmit(sim.now).is_none());
    assert_eq!(p.recvs_to_post(), 0);
}

pub(super) fn hostile(cfg: ConnConfig) -> ConnProto<Vec<u8>> {
    let mut p = ConnProto::new(cfg, Instant::now());
    let n = p.recvs_to_post();
    p.recvs_posted(n);
    p
}

pub(super) fn imm(kind: MsgKind, credits: u16) -> Option<u32> {
    Some(
        MsgHeader {
            kind,
            ctrl_ack: 0,
            credits,
        }
        .encode(),
    )
}

#[test]
fn an_opening_side_holds_its_control_messages_until_established() {
    // The passive side's queue pair is in RTR until `ESTABLISHED`: the client's first messages
    // complete there, and a credit return posted then fails (EINVAL) and kills the connection.
    let cfg = config(8, 64);
    let mut sim = Sim::new(3, cfg).with_late_open();
    // The client sends what its credits allow (no credit comes back meanwhile).
    for _ in 0..200 {
        sim.start_send(0);
        sim.poll_chunk(0);
    }
    assert!(sim.wire[0].len() >= 4, "{}", sim.describe());
    while sim.deliver(0) {}
    sim.drive(1);
    assert!(
        sim.sides[1].proto.credits().credit_message_due(),
        "{}",
        sim.describe()
    );
    assert!(sim.wire[1].is_empty(), "nothing goes out while opening");
    assert!(sim.sides[1].proto.transmit_idle());
    sim.establish(1);
    assert!(
        !sim.sides[1].proto.settled(),
        "established: the shell must pump"
    );
    sim.drive(1);
    assert!(
        sim.wire[1].iter().any(|p| p.control.is_some()),
        "the held credit return goes out once established"
    );
    sim.drain();
    assert_eq!(sim.sides[1].delivered, sim.sides[0].committed);
}
