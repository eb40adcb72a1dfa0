//! Structure-aware fuzzing of the connection protocol state machine: two sans-IO `ConnProto`s
//! (the private core every `Connection` runs on, reached through the `fuzz-internals`
//! feature) joined by a simulated reliable-connected wire, as in the randomized tests of
//! `src/proto/conn/tests.rs`, but every decision comes from the fuzzer's bytes: the two
//! sides' handshake parameters (negotiated by the real `negotiate`), then a sequence of events
//! (sends and rendezvous sends, cancellations, reads, consumption, receives posted in part,
//! deliveries, send and receive completions, failed completions, rendezvous reads done or
//! failed, timer ticks of any length, closes) and **hostile packets** injected into either side
//! (any immediate, any payload, any reported length, forged rendezvous descriptors).
//!
//! Checked after every event, hostile or not: nothing panics (the build has overflow checks
//! and debug assertions); received data held stays within the receive budget plus the
//! chunks in flight plus one message; receive buffers in use stay within the pool; every
//! delivered message fits the negotiated maximum; a failure is sticky (the first cause is
//! kept, nothing is posted after it, only the error report goes out); a rendezvous number is
//! never reused while its memory is held and never released twice or unasked.
//!
//! While no packet was injected (both peers behave): no SEND ever finds no posted receive, no
//! well-behaved packet is called a violation, delivered messages are exactly a prefix of the
//! committed ones, in order and intact, a rendezvous message's memory is never released
//! before its reader read it; and, if no failure happened either, a final drain delivers
//! everything committed without deadlock.
#![no_main]

use std::collections::{HashMap, VecDeque};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use tokio_rdma::QpFailure;
use tokio_rdma::conn::handshake::{Flags, Negotiated, Params, negotiate};
use tokio_rdma::conn::wire::{
    CONTROL_RECVS, DESCRIPTOR_LEN, MsgHeader, MsgKind, RemoteMsg,
};
use tokio_rdma::proto::conn::{ConnConfig, ConnProto, Delivery};

/// A message's bytes: its number, then a pattern derived from it (self-checking).
fn message(no: u64, len: usize) -> Vec<u8> {
    let mut v: Vec<u8> = (0..len).map(|i| (no as usize * 31 + i * 7) as u8).collect();
    let id = no.to_le_bytes();
    let n = len.min(8);
    v[..n].copy_from_slice(&id[..n]);
    v
}

#[derive(Debug)]
struct Packet {
    /// The reported byte length (the payload's, unless a hostile peer lies).
    len: u32,
    imm: Option<u32>,
    payload: Vec<u8>,
    /// A control message (its completion goes to `handle_control_done`).
    control: Option<MsgKind>,
}

struct Active {
    id: u64,
    no: u64,
    data: Vec<u8>,
}

struct Side {
    proto: ConnProto<Vec<u8>>,
    cfg: ConnConfig,
    /// This side's receive buffer size (the peer's largest chunk).
    buf_size: usize,
    active: Vec<Active>,
    next_no: u64,
    /// Messages whose last chunk (or descriptor) went out: (number, length).
    committed: Vec<(u64, usize)>,
    /// Lengths of the messages delivered (their content is checked on delivery).
    delivered: Vec<u64>,
    /// Receives on the simulated device.
    rq: u32,
    /// Delivered messages the application holds: (holds a receive buffer, length).
    held: Vec<(bool, usize)>,
    saw_eof: bool,
    /// The memory of this side's rendezvous messages, by number, until released.
    rdv_mem: HashMap<u16, Vec<u8>>,
    /// Rendezvous sends whose descriptor went out, waiting for the peer's read.
    awaiting: Vec<u64>,
    /// The peer's rendezvous message this side is reading.
    fetch: Option<RemoteMsg>,
    /// The first failure seen.
    failure: Option<QpFailure>,
    /// An error report went out.
    error_sent: bool,
    /// The `ctrl ack` of this side's last header (a forger's best guess).
    last_ack: u8,
}

struct Sim {
    now: Instant,
    sides: [Side; 2],
    /// In flight from side i to side 1 - i.
    wire: [VecDeque<Packet>; 2],
    /// Received by the peer, completion not yet seen by side i.
    acks: [VecDeque<Packet>; 2],
    /// A hostile packet was injected: only the safety invariants still hold.
    hostile: bool,
    /// Print each event (`CONN_PROTO_TRACE=1`, to read a crash's input).
    trace: bool,
}

fn cx() -> Context<'static> {
    Context::from_waker(std::task::Waker::noop())
}

fn params(u: &mut Unstructured<'_>) -> Result<Params> {
    let recv_credits = u.int_in_range(2..=8)?;
    let recv_buf_size = u.int_in_range(64..=320)?;
    let max_message_size =
        u.int_in_range(u64::from(recv_buf_size)..=u64::from(recv_buf_size) * 8)?;
    let initial_credits = if u.ratio(1, 3)? {
        Some(u.int_in_range(1..=recv_credits)?)
    } else {
        None
    };
    let flags = if u.ratio(2, 3)? {
        Flags::ONE_SIDED | Flags::RENDEZVOUS
    } else {
        Flags::ONE_SIDED
    };
    Ok(Params {
        flags,
        recv_credits,
        recv_buf_size,
        max_inline: 0,
        max_message_size,
        initial_credits,
    })
}

fn config(u: &mut Unstructured<'_>, n: &Negotiated) -> Result<ConnConfig> {
    let keepalive = if u.arbitrary()? {
        Some(Duration::from_millis(u.int_in_range(1..=500)?))
    } else {
        None
    };
    Ok(ConnConfig {
        send_credits: n.send_credits,
        send_initial: n.send_initial_credits,
        recv_credits: n.recv_credits,
        recv_initial: n.recv_initial_credits,
        max_send_size: n.max_send_size,
        max_message_size: n.max_message_size,
        // As the shell: at least one message.
        recv_budget: u.int_in_range(0..=4096)?.max(n.max_message_size),
        keepalive,
        keepalive_timeout: Duration::from_millis(u.int_in_range(1..=5000)?),
        // Fixed (not drawn from the input, so the committed corpus keeps its meaning): the
        // shell's default.
        close_timeout: Duration::from_secs(30),
        rendezvous: n.rendezvous,
    })
}

impl Side {
    fn new(cfg: ConnConfig, buf_size: usize, now: Instant) -> Side {
        let mut proto = ConnProto::new(cfg, now);
        // The shell posts the first receives before the handshake completes.
        let n = proto.recvs_to_post();
        proto.recvs_posted(n);
        Side {
            proto,
            cfg,
            buf_size,
            active: Vec::new(),
            next_no: 0,
            committed: Vec::new(),
            delivered: Vec::new(),
            rq: n,
            held: Vec::new(),
            saw_eof: false,
            rdv_mem: HashMap::new(),
            awaiting: Vec::new(),
            fetch: None,
            failure: None,
            error_sent: false,
            last_ack: 0,
        }
    }
}

impl Sim {
    fn new(u: &mut Unstructured<'_>) -> Result<Option<Sim>> {
        let (p0, p1) = (params(u)?, params(u)?);
        let (Ok(n0), Ok(n1)) = (negotiate(&p0, &p1), negotiate(&p1, &p0)) else {
            return Ok(None);
        };
        let now = Instant::now();
        let c0 = config(u, &n0)?;
        let c1 = config(u, &n1)?;
        Ok(Some(Sim {
            now,
            sides: [
                Side::new(c0, p0.recv_buf_size as usize, now),
                Side::new(c1, p1.recv_buf_size as usize, now),
            ],
            wire: [VecDeque::new(), VecDeque::new()],
            acks: [VecDeque::new(), VecDeque::new()],
            hostile: false,
            trace: std::env::var_os("CONN_PROTO_TRACE").is_some(),
        }))
    }

    fn start_send(&mut self, u: &mut Unstructured<'_>, i: usize) -> Result<()> {
        let s = &mut self.sides[i];
        if s.active.len() >= 4 {
            return Ok(());
        }
        let len = u.int_in_range(0..=s.cfg.max_message_size + 8)?;
        let rdv = u.ratio(1, 4)?;
        let r = if rdv {
            s.proto.start_send_rendezvous(len)
        } else {
            s.proto.start_send(len)
        };
        if self.trace {
            eprintln!("side {i}: start_send({len}, rendezvous {rdv}) = {r:?}");
        }
        match r {
            Ok(id) => {
                let no = s.next_no;
                s.next_no += 1;
                s.active.push(Active {
                    id,
                    no,
                    data: message(no, len as usize),
                });
            }
            Err(e) => {
                let legit = s.proto.failure().is_some()
                    || len > s.cfg.max_message_size
                    || (rdv && (len == 0 || !s.cfg.rendezvous))
                    || matches!(e, tokio_rdma::Error::QpFailed(QpFailure::Closed));
                assert!(legit, "start_send({len}, rendezvous {rdv}) refused: {e}");
            }
        }
        Ok(())
    }

    fn poll_chunk(&mut self, u: &mut Unstructured<'_>, i: usize) -> Result<()> {
        let s = &mut self.sides[i];
        if s.active.is_empty() {
            return Ok(());
        }
        let k = u.choose_index(s.active.len())?;
        let a = &s.active[k];
        let Poll::Ready(r) = s.proto.poll_chunk(a.id, &mut cx()) else {
            return Ok(());
        };
        let c = match r {
            Ok(c) => c,
            Err(_) => {
                assert!(
                    s.proto.failure().is_some(),
                    "poll_chunk failed without a failure"
                );
                // The send's future returns the error and is dropped.
                let a = s.active.remove(k);
                s.proto.cancel_send(a.id);
                return Ok(());
            }
        };
        let payload = match c.rendezvous {
            Some(seq) => {
                assert_eq!(c.len, DESCRIPTOR_LEN);
                // The "address" is the message number; the memory stays until released.
                let old = s.rdv_mem.insert(seq, a.data.clone());
                assert!(
                    old.is_none(),
                    "rendezvous number {seq} reused while its memory is held"
                );
                s.awaiting.push(a.id);
                RemoteMsg::encode(a.no, a.data.len() as u64, u32::from(seq)).to_vec()
            }
            None => {
                assert!(
                    c.len <= s.cfg.max_send_size,
                    "a chunk larger than the peer's buffers"
                );
                let start = c.offset as usize;
                a.data[start..start + c.len as usize].to_vec()
            }
        };
        s.last_ack = MsgHeader::decode(c.imm).expect("our own header").ctrl_ack;
        if self.trace {
            eprintln!(
                "side {i}: sends {:?} of {} bytes",
                MsgHeader::decode(c.imm),
                c.len
            );
        }
        self.wire[i].push_back(Packet {
            len: payload.len() as u32,
            imm: Some(c.imm),
            payload,
            control: None,
        });
        if c.last {
            let a = s.active.remove(k);
            s.committed.push((a.no, a.data.len()));
        }
        Ok(())
    }

    fn cancel(&mut self, u: &mut Unstructured<'_>, i: usize) -> Result<()> {
        let s = &mut self.sides[i];
        if !s.awaiting.is_empty() && u.arbitrary()? {
            // A send waiting for the peer's read is dropped: its memory must stay.
            let id = s.awaiting.swap_remove(u.choose_index(s.awaiting.len())?);
            s.proto.cancel_send(id);
        } else if !s.active.is_empty() {
            let a = s.active.remove(u.choose_index(s.active.len())?);
            s.proto.cancel_send(a.id);
            if self.trace {
                eprintln!("side {i}: cancel_send({})", a.id);
            }
        }
        Ok(())
    }

    /// The shell's turn: post receives (maybe fewer than due, as on a shared receive queue),
    /// hand out control messages, release rendezvous memory, resolve finished rendezvous sends.
    fn drive(&mut self, u: &mut Unstructured<'_>, i: usize, all: bool) -> Result<()> {
        let s = &mut self.sides[i];
        let due = s.proto.recvs_to_post();
        let n = if all { due } else { u.int_in_range(0..=due)? };
        s.rq += n;
        s.proto.recvs_posted(n);
        while let Some(t) = s.proto.poll_transmit(self.now) {
            let h = MsgHeader::decode(t.imm).expect("our own header");
            assert_eq!(h.kind, t.kind);
            if s.proto.failure().is_some() {
                assert!(
                    t.kind == MsgKind::Error && !s.error_sent,
                    "{t:?} after the failure"
                );
                s.error_sent = true;
            }
            s.last_ack = h.ctrl_ack;
            if self.trace {
                eprintln!("side {i}: sends control {h:?}");
            }
            self.wire[i].push_back(Packet {
                len: 0,
                imm: Some(t.imm),
                payload: Vec::new(),
                control: Some(t.kind),
            });
        }
        let _ = s.proto.take_driver_kick();
        let _ = s.proto.take_wakers().count();
        let released: Vec<u16> = s.proto.take_released().collect();
        for seq in released {
            assert!(
                s.rdv_mem.remove(&seq).is_some(),
                "released {seq} twice or never sent"
            );
        }
        let mut cx = cx();
        let proto = &mut s.proto;
        s.awaiting
            .retain(|&id| proto.poll_fetched(id, &mut cx).is_pending());
        Ok(())
    }

    /// Side i's read of the peer's rendezvous message completes (or fails).
    fn complete_fetch(&mut self, u: &mut Unstructured<'_>, i: usize, fail: bool) -> Result<()> {
        let Some(m) = self.sides[i].fetch.take() else {
            return Ok(());
        };
        if fail {
            self.sides[i].proto.fetch_done(Err(QpFailure::Flushed));
            return Ok(());
        }
        if let (false, Some((no, len))) = (self.hostile, self.expected(i)) {
            assert_eq!(
                (m.addr, m.len),
                (no, len as u64),
                "the next message by rendezvous"
            );
            let data = self.sides[1 - i]
                .rdv_mem
                .get(&(m.rkey as u16))
                .unwrap_or_else(|| panic!("message {no} released before it was read"));
            assert!(
                data == &message(no, len),
                "message {no} intact in the sender's memory"
            );
        }
        let s = &mut self.sides[i];
        s.proto.fetch_done(Ok(()));
        if s.proto.failure().is_some() {
            return Ok(());
        }
        assert_eq!(s.proto.fetch_ready(), Some(true));
        s.proto.fetch_taken();
        s.delivered.push(m.len);
        if u.ratio(7, 8)? {
            s.held.push((false, m.len as usize));
        } else {
            // The reader was dropped once the bytes were in: they are consumed at once.
            s.proto.consumed(false, m.len as usize);
        }
        Ok(())
    }

    /// Delivers the oldest packet from side i to its peer. Returns false if nothing moved.
    fn deliver(&mut self, i: usize) -> bool {
        let j = 1 - i;
        let Some(p) = self.wire[i].front() else {
            return false;
        };
        if self.sides[j].rq == 0 {
            let clean = !self.hostile && self.sides[j].proto.failure().is_none();
            assert!(
                !clean,
                "{} found no posted receive (receiver not ready)",
                if p.control.is_some() {
                    "a control message"
                } else {
                    "a data chunk"
                }
            );
            if self.sides[j].proto.failure().is_some() {
                // The receiver's queue pair is in the error state: the send fails.
                let p = self.wire[i].pop_front().expect("front");
                self.complete(i, p, Err(QpFailure::Flushed));
                return true;
            }
            return false; // receiver not ready: the device retries
        }
        let p = self.wire[i].pop_front().expect("front");
        self.receive(j, &p);
        if let (false, Some(QpFailure::Protocol(e))) = (self.hostile, self.sides[j].proto.failure())
        {
            panic!("side {j} called a well-behaved peer's {p:?} a violation: {e:?}");
        }
        self.acks[i].push_back(p);
        true
    }

    fn receive(&mut self, j: usize, p: &Packet) {
        let r = &mut self.sides[j];
        r.rq -= 1;
        let mut buf = vec![0u8; r.buf_size];
        let n = p.payload.len().min(buf.len());
        buf[..n].copy_from_slice(&p.payload[..n]);
        r.proto.heard(self.now);
        r.proto.handle_recv(Ok((p.len, p.imm)), buf);
        if self.trace {
            let h = p.imm.map(MsgHeader::decode);
            eprintln!(
                "side {j}: received {h:?}, {} bytes; failure {:?}",
                p.len,
                r.proto.failure()
            );
        }
    }

    fn complete(&mut self, i: usize, p: Packet, res: std::result::Result<(), QpFailure>) {
        let s = &mut self.sides[i];
        match p.control {
            Some(kind) => s.proto.handle_control_done(kind, res, self.now),
            None => match res {
                Ok(()) => s.proto.heard(self.now),
                Err(cause) => {
                    s.proto.fail(cause);
                }
            },
        }
    }

    fn ack(&mut self, i: usize, res: std::result::Result<(), QpFailure>) {
        if let Some(p) = self.acks[i].pop_front() {
            self.complete(i, p, res);
        }
    }

    /// The message side i must deliver next: its peer's next committed one.
    fn expected(&self, i: usize) -> Option<(u64, usize)> {
        let s = &self.sides[i];
        let next = self.sides[1 - i].committed.get(s.delivered.len()).copied();
        assert!(
            self.hostile || next.is_some(),
            "side {i} delivers a message its peer never committed"
        );
        next
    }

    fn read(&mut self, i: usize) {
        let hostile = self.hostile;
        if self.sides[i].fetch.is_some() {
            return;
        }
        let Poll::Ready(r) = self.sides[i].proto.poll_recv(&mut cx()) else {
            return;
        };
        let d = match r {
            Ok(Some(d)) => d,
            Ok(None) => {
                self.sides[i].saw_eof = true;
                return;
            }
            Err(_) => {
                assert!(
                    self.sides[i].proto.failure().is_some(),
                    "a receive error without a failure"
                );
                return;
            }
        };
        let s = &self.sides[i];
        assert!(!s.saw_eof || hostile, "a message after end of stream");
        assert!(
            d.len() as u64 <= s.cfg.max_message_size,
            "a message of {} bytes delivered, the limit is {}",
            d.len(),
            s.cfg.max_message_size
        );
        let bytes: &[u8] = match &d {
            Delivery::Remote(m) => {
                assert!(m.len > 0, "an empty rendezvous message");
                self.sides[i].fetch = Some(*m);
                return;
            }
            Delivery::Buf { buf, len } => &buf[..*len],
            Delivery::Assembled(v) => v,
        };
        if let (false, Some((no, len))) = (hostile, self.expected(i)) {
            assert_eq!(bytes.len(), len, "message {no}'s length");
            assert!(bytes == &message(no, len)[..], "message {no} intact");
        }
        let held = (d.holds_buffer(), d.len());
        let s = &mut self.sides[i];
        s.delivered.push(held.1 as u64);
        s.held.push(held);
    }

    fn drop_held(&mut self, u: &mut Unstructured<'_>, i: usize) -> Result<()> {
        let s = &mut self.sides[i];
        if s.held.is_empty() {
            return Ok(());
        }
        let (buffer, len) = s.held.swap_remove(u.choose_index(s.held.len())?);
        s.proto.consumed(buffer, len);
        Ok(())
    }

    fn inject(&mut self, u: &mut Unstructured<'_>, j: usize) -> Result<()> {
        if self.sides[j].rq == 0 {
            return Ok(()); // the forged SEND finds no receive: nothing arrives
        }
        let forged_as = &self.sides[1 - j];
        let kind = u.int_in_range(0u32..=9)?;
        let ctrl_ack = if u.arbitrary()? {
            forged_as.last_ack.wrapping_add(u.int_in_range(0..=2)?)
        } else {
            u.arbitrary()?
        };
        let credits: u16 = if u.arbitrary()? {
            u.int_in_range(0..=4)?
        } else {
            u.arbitrary()?
        };
        let mut imm = (kind << 28) | (u32::from(ctrl_ack) << 16) | u32::from(credits);
        if u.ratio(1, 16)? {
            imm |= u.int_in_range(1u32..=15)? << 24;
        }
        let imm = if u.ratio(1, 16)? { None } else { Some(imm) };
        let payload = if kind == 6 && u.ratio(3, 4)? {
            let len = if u.arbitrary()? {
                u.int_in_range(0..=2 * self.sides[j].cfg.max_message_size)?
            } else {
                u.arbitrary()?
            };
            RemoteMsg::encode(u.arbitrary()?, len, u.arbitrary()?).to_vec()
        } else if kind <= 1 || u.ratio(1, 8)? {
            let n = u.int_in_range(0..=self.sides[j].buf_size)?;
            u.bytes(n)?.to_vec()
        } else {
            Vec::new()
        };
        let len = if u.ratio(1, 16)? {
            u.arbitrary()?
        } else {
            payload.len() as u32
        };
        self.hostile = true;
        let p = Packet {
            len,
            imm,
            payload,
            control: None,
        };
        self.receive(j, &p);
        Ok(())
    }

    /// The safety invariants, which hold whatever the peer sends.
    fn check(&mut self) {
        for s in &mut self.sides {
            let c = s.cfg;
            let (bytes, bufs) = s.proto.held();
            // The budget, the chunks in flight, and one rendezvous message.
            let bound =
                c.recv_budget + s.buf_size as u64 * u64::from(c.recv_credits) + c.max_message_size;
            assert!(bytes <= bound, "held {bytes} bytes: over the bound {bound}");
            assert!(
                s.rq + bufs <= 2 * c.recv_credits + CONTROL_RECVS,
                "receive buffers in use {} + {}: over the pool",
                s.rq,
                bufs
            );
            match (&s.failure, s.proto.failure()) {
                (None, f) => s.failure = f.cloned(),
                (Some(first), now) => assert_eq!(Some(first), now, "the first failure is kept"),
            }
            if s.failure.is_some() {
                assert_eq!(
                    s.proto.recvs_to_post(),
                    0,
                    "receives posted after the failure"
                );
                assert!(s.proto.start_send(1).is_err(), "a send after the failure");
            }
        }
    }

    fn step(&mut self, u: &mut Unstructured<'_>) -> Result<()> {
        let i = usize::from(u.arbitrary::<bool>()?);
        let event = u.int_in_range(0u8..=22)?;
        if self.trace {
            eprintln!("side {i}: event {event}");
        }
        match event {
            0 | 1 => self.start_send(u, i)?,
            2..=4 => self.poll_chunk(u, i)?,
            5 => self.cancel(u, i)?,
            6 | 7 => self.drive(u, i, false)?,
            8..=10 => {
                self.deliver(i);
            }
            11 | 12 => self.ack(i, Ok(())),
            13 => self.read(i),
            14 => self.complete_fetch(u, i, false)?,
            15 => self.drop_held(u, i)?,
            16 => {
                let ms = if u.arbitrary()? {
                    u.int_in_range(0..=50)?
                } else {
                    u.int_in_range(0..=10_000)?
                };
                self.now += Duration::from_millis(ms);
                for s in &mut self.sides {
                    if s.proto.poll_timeout().is_some_and(|t| t <= self.now) || u.ratio(1, 4)? {
                        s.proto.handle_timeout(self.now);
                    }
                }
            }
            17 => {
                if self.trace {
                    eprintln!("side {i}: close");
                }
                if u.arbitrary()? {
                    self.sides[i].proto.close();
                } else {
                    self.sides[i].proto.close_full();
                }
            }
            18 => self.inject(u, i)?,
            19 => match u.int_in_range(0u8..=4)? {
                // Faults of the device or the transport (not the peer's fault).
                0 => self.ack(i, Err(QpFailure::Flushed)),
                1 => {
                    if self.sides[i].rq > 0 {
                        self.sides[i].rq -= 1;
                        let buf = vec![0u8; self.sides[i].buf_size];
                        self.sides[i]
                            .proto
                            .handle_recv(Err(QpFailure::Flushed), buf);
                    }
                }
                2 => self.complete_fetch(u, i, true)?,
                3 => {
                    self.sides[i].proto.fail(QpFailure::Disconnected);
                }
                _ => {
                    let _ = self.sides[i].proto.should_disconnect();
                    let _ = self.sides[i].proto.poll_close(&mut cx());
                }
            },
            _ => {
                let _ = self.sides[i].proto.peek_recv().map(|d| d.len());
                self.read(i);
            }
        }
        self.check();
        Ok(())
    }

    /// Everyone reads and finishes; nothing new starts. Must reach quiescence.
    fn drain(&mut self) {
        let mut u = Unstructured::new(&[]);
        let mut idle_rounds = 0;
        for _ in 0..100_000 {
            let before = self.progress_marker();
            for i in 0..2 {
                while !self.sides[i].active.is_empty() {
                    let n = self.sides[i].active.len();
                    let _ = self.poll_chunk(&mut u, i);
                    if self.sides[i].active.len() == n {
                        break;
                    }
                }
                let _ = self.drive(&mut u, i, true);
                while self.deliver(i) {}
                while !self.acks[i].is_empty() {
                    self.ack(i, Ok(()));
                }
                let _ = self.complete_fetch(&mut u, i, false);
                self.read(i);
                while !self.sides[i].held.is_empty() {
                    let _ = self.drop_held(&mut u, i);
                }
            }
            self.check();
            if self.quiescent() {
                for i in 0..2 {
                    let s = &self.sides[i];
                    let peer = &self.sides[1 - i];
                    assert_eq!(
                        s.delivered.len(),
                        peer.committed.len(),
                        "everything delivered"
                    );
                    assert_eq!(s.proto.held(), (0, 0), "everything consumed");
                }
                return;
            }
            if self.progress_marker() == before {
                idle_rounds += 1;
                assert!(idle_rounds < 100, "deadlock: {}", self.describe());
            } else {
                idle_rounds = 0;
            }
        }
        panic!("no quiescence: {}", self.describe());
    }

    fn describe(&self) -> String {
        let mut out = String::new();
        for (i, s) in self.sides.iter().enumerate() {
            out += &format!(
                "\nside {i}: active {} committed {} delivered {} rq {} held {:?} awaiting {} \
                 rdv_mem {} fetch {:?} wire {} acks {} failure {:?} cfg {:?}\n  credits {:?}",
                s.active.len(),
                s.committed.len(),
                s.delivered.len(),
                s.rq,
                s.proto.held(),
                s.awaiting.len(),
                s.rdv_mem.len(),
                s.fetch,
                self.wire[i].len(),
                self.acks[i].len(),
                s.proto.failure(),
                s.cfg,
                s.proto.credits(),
            );
        }
        out
    }

    fn progress_marker(&self) -> [usize; 7] {
        [
            self.sides[0].rdv_mem.len() + self.sides[1].rdv_mem.len(),
            self.sides[0].delivered.len(),
            self.sides[1].delivered.len(),
            self.sides[0].committed.len() + self.sides[0].active.len(),
            self.sides[1].committed.len() + self.sides[1].active.len(),
            self.wire[0].len() + self.acks[0].len(),
            self.wire[1].len() + self.acks[1].len(),
        ]
    }

    fn quiescent(&self) -> bool {
        (0..2).all(|i| {
            let s = &self.sides[i];
            s.active.is_empty()
                && s.rdv_mem.is_empty()
                && s.awaiting.is_empty()
                && self.wire[i].is_empty()
                && self.acks[i].is_empty()
                && self.sides[1 - i].delivered.len() == s.committed.len()
                // Nothing partial left (an abort still to go out, say).
                && s.proto.held() == (0, 0)
        })
    }

    /// The delivered messages are a prefix of the peer's committed ones (their content and
    /// order were checked one by one on delivery).
    fn check_order(&self) {
        for i in 0..2 {
            let s = &self.sides[i];
            let committed = &self.sides[1 - i].committed;
            assert!(
                s.delivered.len() <= committed.len(),
                "more delivered than committed"
            );
            for (&d, &(no, len)) in s.delivered.iter().zip(committed) {
                assert_eq!(d, len as u64, "message {no} delivered with another length");
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let Ok(Some(mut sim)) = Sim::new(&mut u) else {
        return;
    };
    while !u.is_empty() {
        if sim.step(&mut u).is_err() {
            break;
        }
        if !sim.hostile {
            sim.check_order();
        }
    }
    if !sim.hostile && sim.sides.iter().all(|s| s.proto.failure().is_none()) {
        sim.drain();
        sim.check_order();
    }
});
