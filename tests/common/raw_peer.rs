//! A raw peer for hostile-peer tests: an RDMA CM client (or server) with its own protection
//! domain, completion queue and queue pair, written with the public raw layer
//! (`tokio_rdma::verbs`). It speaks tokio-rdma's connection protocol by hand (the version-2
//! handshake in the private data, receives posted for data and control messages, SENDs with
//! the header in the immediate data) and can break it on purpose.
//!
//! Everything here blocks: use it from `spawn_blocking` (move the peer in and out).
#![allow(dead_code, unreachable_pub, clippy::print_stdout)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio_rdma::conn::handshake::{self, Negotiated, Params};
use tokio_rdma::conn::wire::CONTROL_RECVS;
use tokio_rdma::conn::wire::{MsgHeader, MsgKind};
use tokio_rdma::verbs::{
    AccessFlags, CmEvent, CmEventKind, CmId, CompletionQueue, ConnParam, Context, EventChannel,
    ProtectionDomain, QpInitAttr, QpState, QueuePair, RecvWr, RegisteredBuffer, SendOp, SendWr,
    Sge, WcBatch, WorkCompletion,
};
use tokio_rdma::{ProtocolError, WcStatus};

/// Send slots (sends this peer may have in flight).
const SEND_SLOTS: u64 = 16;
/// Marks a send's work-request id (receives use their slot number).
const SEND_BIT: u64 = 1 << 63;

/// How a raw peer sets itself up.
#[derive(Debug, Clone, Copy)]
pub struct RawOpts {
    /// What it announces in the handshake.
    pub params: Params,
    /// Receives it posts before connecting (normally its data credits plus the control
    /// receives; fewer to play a peer that refuses messages).
    pub post_recvs: u32,
    /// Re-post each receive once it completed (as the protocol requires).
    pub repost: bool,
    /// Confirm the other side's control messages in `ctrl_ack` (as the protocol requires);
    /// `false` plays a peer that re-posts their receives but never says so.
    pub confirm: bool,
    /// The largest SEND it can make.
    pub send_size: usize,
    /// Bytes of memory behind each receive it posts (`None`: its announced
    /// `recv_buf_size`): a peer may announce huge buffers and register small ones, so that
    /// what the other side pins can be measured apart from its own.
    pub recv_slot_size: Option<usize>,
    /// Transport retries of its queue pair.
    pub retry_count: u8,
    /// Local ACK timeout code of its queue pair.
    pub ack_timeout: u8,
}

impl RawOpts {
    /// A well-set-up peer announcing `params`: every receive posted and re-posted, sends up to
    /// 128 KiB, short transport timers (retry 3, ack timeout 14 = 67 ms).
    pub fn new(params: Params) -> RawOpts {
        RawOpts {
            params,
            post_recvs: params.recv_credits + CONTROL_RECVS,
            repost: true,
            confirm: true,
            send_size: 128 << 10,
            recv_slot_size: None,
            retry_count: 3,
            ack_timeout: 14,
        }
    }
}

impl RawOpts {
    /// Bytes behind each receive.
    pub fn slot_size(&self) -> usize {
        self.recv_slot_size
            .unwrap_or(self.params.recv_buf_size as usize)
    }

    /// Bytes this peer registers: its receive slots and its send slots.
    pub fn registered_bytes(&self) -> u64 {
        let slots = self.post_recvs.max(1) as usize;
        (slots * self.slot_size() + SEND_SLOTS as usize * self.send_size) as u64
    }
}

/// What the raw peer observed, in the order it observed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seen {
    /// A receive completed: `len` bytes, immediate data `imm`.
    Recv {
        /// Bytes received.
        len: u32,
        /// The immediate data (the protocol header).
        imm: Option<u32>,
    },
    /// A receive completed with an error status (flushes included).
    RecvFailed(WcStatus),
    /// A send completed with an error status.
    SendFailed(WcStatus),
    /// An RDMA CM event on the peer's channel.
    Cm(&'static str),
}

/// The raw peer.
pub struct RawPeer {
    /// Its RDMA CM id (connected).
    pub id: CmId,
    ch: EventChannel,
    /// Its queue pair.
    pub qp: QueuePair,
    cq: CompletionQueue,
    recv_mem: RegisteredBuffer,
    send_mem: RegisteredBuffer,
    /// A raw server keeps its listening id here.
    listen: Option<CmId>,
    pd: ProtectionDomain,
    ctx: Context,
    opts: RawOpts,
    /// The parameters of the connection, from this peer's point of view.
    pub negotiated: Negotiated,
    /// Data credits this peer has (the tokio-rdma side's receives it knows about); may go
    /// negative when the peer sends beyond them on purpose.
    pub credits: i64,
    /// The tokio-rdma side's control messages whose receives this peer re-posted (its
    /// `ctrl_ack`).
    ctrl_processed: u64,
    /// Data credits this peer owes the tokio-rdma side (receives re-posted after its chunks).
    owed: u32,
    sends_posted: u64,
    sends_done: u64,
    /// Everything observed, in order.
    pub log: Vec<Seen>,
    /// Error reports received (kind `Error`): the protocol error codes.
    pub reports: Vec<u16>,
    /// Data chunks received.
    pub data_received: u32,
    /// Control messages received (other than error reports).
    pub controls_received: u32,
}

fn wait_kind(ch: &EventChannel, kind: CmEventKind, limit: Duration) -> CmEvent {
    let ev = ch
        .wait_event(limit)
        .expect("rdma_get_cm_event")
        .unwrap_or_else(|| panic!("raw peer: no {kind} within {limit:?}"));
    ev.expect(kind)
        .unwrap_or_else(|e| panic!("raw peer: waiting for {kind}: {e}"))
}

/// Protection domain, CQ, queue pair (RESET) and memory for a peer on `id`'s device.
fn resources(
    id: &CmId,
    opts: &RawOpts,
) -> (
    Context,
    ProtectionDomain,
    CompletionQueue,
    QueuePair,
    RegisteredBuffer,
    RegisteredBuffer,
) {
    let ctx = Context::from_cm_id(id).expect("context");
    let pd = ProtectionDomain::new(&ctx).expect("pd");
    let slots = opts.params.recv_credits + CONTROL_RECVS;
    let cq = CompletionQueue::new(&ctx, 256, None).expect("cq");
    let mut attr = QpInitAttr::new(&cq, &cq);
    attr.caps.max_send_wr = SEND_SLOTS as u32;
    attr.caps.max_recv_wr = slots.max(1);
    attr.caps.max_send_sge = 1;
    attr.caps.max_recv_sge = 1;
    let qp = QueuePair::new_rc(&pd, &attr).expect("qp");
    // Receives reuse their slot: memory for the receives it posts.
    let recv_mem = RegisteredBuffer::new(
        &pd,
        opts.post_recvs.max(1) as usize * opts.slot_size(),
        AccessFlags::LOCAL_WRITE,
    )
    .expect("receive memory");
    let send_mem = RegisteredBuffer::new(
        &pd,
        SEND_SLOTS as usize * opts.send_size,
        AccessFlags::LOCAL_WRITE,
    )
    .expect("send memory");
    (ctx, pd, cq, qp, recv_mem, send_mem)
}

impl RawPeer {
    /// Connects to a tokio-rdma listener at `to` as a client announcing `opts.params`:
    /// resolves, creates its queue pair, posts its receives, connects with the version-2
    /// handshake, negotiates with the server's answer, and establishes.
    pub fn connect(to: SocketAddr, opts: RawOpts) -> RawPeer {
        let ch = EventChannel::new().expect("event channel");
        let id = ch.create_id().expect("cm id");
        id.set_ack_timeout(opts.ack_timeout).expect("ack timeout");
        id.resolve_addr(None, to, 10_000).expect("resolve_addr");
        wait_kind(&ch, CmEventKind::AddrResolved, Duration::from_secs(60));
        id.resolve_route(10_000).expect("resolve_route");
        wait_kind(&ch, CmEventKind::RouteResolved, Duration::from_secs(60));
        let (ctx, pd, cq, qp, recv_mem, send_mem) = resources(&id, &opts);
        id.modify_qp_with_access(&qp, QpState::Init, AccessFlags::LOCAL_WRITE)
            .expect("INIT");
        let hs = opts.params.encode().expect("handshake");
        let mut param = ConnParam::new(&qp).private_data(&hs);
        param.retry_count = opts.retry_count;
        param.rnr_retry_count = 6;
        let mut peer = RawPeer {
            id,
            ch,
            qp,
            cq,
            recv_mem,
            send_mem,
            listen: None,
            pd,
            ctx,
            opts,
            negotiated: handshake::negotiate(&opts.params, &opts.params).expect("self"),
            credits: 0,
            ctrl_processed: 0,
            owed: 0,
            sends_posted: 0,
            sends_done: 0,
            log: Vec::new(),
            reports: Vec::new(),
            data_received: 0,
            controls_received: 0,
        };
        for slot in 0..opts.post_recvs {
            peer.post_recv(slot);
        }
        peer.id.connect(&param).expect("rdma_connect");
        let ev = wait_kind(
            &peer.ch,
            CmEventKind::ConnectResponse,
            Duration::from_secs(60),
        );
        let remote = Params::decode(ev.private_data()).expect("the server's handshake");
        peer.established(remote);
        peer.id.modify_qp(&peer.qp, QpState::Rtr).expect("RTR");
        peer.id
            .modify_qp_rts_with_retries(&peer.qp, opts.retry_count, 6)
            .expect("RTS");
        peer.id.establish().expect("rdma_establish");
        peer
    }

    fn established(&mut self, remote: Params) {
        self.negotiated = handshake::negotiate(&self.opts.params, &remote).expect("negotiate");
        self.credits = i64::from(self.negotiated.send_credits);
    }

    fn post_recv(&mut self, slot: u32) {
        let size = self.opts.slot_size();
        let at = slot as usize * size;
        let sge = [self.recv_mem.sge(at..at + size)];
        // SAFETY: the slot's memory belongs to `recv_mem`, which lives as long as the queue
        // pair (both are fields of `self`, and the queue pair is destroyed first); nothing
        // reads or writes the slot until its completion is polled.
        unsafe { self.qp.post_recv(&[RecvWr::new(u64::from(slot), &sge)]) }.expect("post_recv");
    }

    /// A header of `kind` carrying this peer's `ctrl_ack` and the credits it owes.
    pub fn header(&mut self, kind: MsgKind) -> u32 {
        let credits = std::mem::take(&mut self.owed) as u16;
        MsgHeader {
            kind,
            ctrl_ack: self.ctrl_processed as u8,
            credits,
        }
        .encode()
    }

    /// Posts a SEND of `len` bytes (a pattern seeded with `seed`) with immediate data `imm`
    /// (`None`: a plain SEND). Waits only for a free send slot.
    pub fn post_send(&mut self, len: usize, seed: u8, imm: Option<u32>) {
        let data: Vec<u8> = (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect();
        self.post_send_bytes(&data, imm);
    }

    /// Posts a SEND of `data` with immediate data `imm` (`None`: a plain SEND). Waits only for
    /// a free send slot.
    pub fn post_send_bytes(&mut self, data: &[u8], imm: Option<u32>) {
        let len = data.len();
        assert!(len <= self.opts.send_size, "send of {len} bytes: too large");
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.sends_posted - self.sends_done >= SEND_SLOTS {
            assert!(Instant::now() < deadline, "raw peer: sends do not complete");
            self.poll();
            std::thread::sleep(Duration::from_millis(1));
        }
        let at = (self.sends_posted % SEND_SLOTS) as usize * self.opts.send_size;
        if len > 0 {
            self.send_mem.write_at(at, data);
        }
        let sge = [self.send_mem.sge(at..at + len)];
        let sges: &[Sge] = if len == 0 { &[] } else { &sge };
        let op = match imm {
            Some(imm) => SendOp::SendWithImm(imm),
            None => SendOp::Send,
        };
        let wr = SendWr::new(SEND_BIT | self.sends_posted, op, sges);
        // SAFETY: the slot's memory belongs to `send_mem`, which outlives the queue pair; a
        // slot is reused only after SEND_SLOTS later sends were posted, i.e. after its own
        // completion (send completions arrive in order) was polled above.
        unsafe { self.qp.post_send(&[wr]) }.expect("post_send");
        self.sends_posted += 1;
    }

    /// Sends a data chunk (`More`/`Last`) of `len` bytes with a proper header, spending a
    /// data credit whether or not the peer has one left.
    pub fn send_chunk(&mut self, kind: MsgKind, len: usize, seed: u8) {
        assert!(kind.is_data());
        self.credits -= 1;
        let imm = self.header(kind);
        self.post_send(len, seed, Some(imm));
    }

    /// Sends a control message (zero length) with a proper header.
    pub fn send_control(&mut self, kind: MsgKind) {
        let imm = self.header(kind);
        self.post_send(0, 0, Some(imm));
    }

    /// Polls the completion queue once and handles what it finds. Returns how many.
    pub fn poll(&mut self) -> usize {
        let mut batch = WcBatch::with_capacity(32);
        let wcs: Vec<WorkCompletion> = self.cq.poll(&mut batch).expect("poll cq").to_vec();
        for wc in &wcs {
            self.handle(wc);
        }
        wcs.len()
    }

    fn handle(&mut self, wc: &WorkCompletion) {
        if wc.wr_id() & SEND_BIT != 0 {
            self.sends_done += 1;
            if !wc.is_success() {
                self.log.push(Seen::SendFailed(wc.status()));
            }
            return;
        }
        if !wc.is_success() {
            self.log.push(Seen::RecvFailed(wc.status()));
            return;
        }
        let (len, imm) = (wc.byte_len(), wc.imm());
        self.log.push(Seen::Recv { len, imm });
        if let Some(h) = imm.and_then(|i| MsgHeader::decode(i).ok()) {
            if h.kind == MsgKind::Error {
                self.reports.push(h.credits);
                return;
            }
            self.credits += i64::from(h.credits);
            if h.kind.is_data() {
                self.data_received += 1;
                if self.opts.repost {
                    self.owed += 1;
                }
            } else {
                self.controls_received += 1;
                if self.opts.repost && self.opts.confirm {
                    self.ctrl_processed += 1;
                }
            }
        }
        if self.opts.repost {
            self.post_recv(wc.wr_id() as u32);
        }
    }

    /// Reads pending RDMA CM events (after draining the completion queue, so completions that
    /// were there before an event are logged before it).
    pub fn poll_cm(&mut self) {
        while let Some(ev) = self.ch.get_event().expect("rdma_get_cm_event") {
            while self.poll() > 0 {}
            self.log.push(Seen::Cm(ev.name()));
        }
    }

    /// Whether the peer saw `DISCONNECTED`.
    pub fn disconnected(&self) -> bool {
        self.log
            .contains(&Seen::Cm(CmEventKind::Disconnected.name()))
    }

    /// Whether any of its sends failed.
    pub fn send_failed(&self) -> Option<WcStatus> {
        self.log.iter().find_map(|s| match s {
            Seen::SendFailed(st) => Some(*st),
            _ => None,
        })
    }

    /// Polls completions and CM events until `cond` holds (true) or `limit` passes (false).
    pub fn wait_until(&mut self, limit: Duration, mut cond: impl FnMut(&RawPeer) -> bool) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            self.poll();
            self.poll_cm();
            if cond(self) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Waits until every posted send has completed.
    pub fn wait_sends(&mut self, limit: Duration) -> bool {
        self.wait_until(limit, |p| p.sends_done == p.sends_posted)
    }

    /// The first error report received, as a protocol error.
    pub fn report(&self) -> Option<ProtocolError> {
        self.reports.first().map(|&c| ProtocolError::from_code(c))
    }

    /// Index in the log of the first entry matching `f`.
    pub fn position(&self, f: impl Fn(&Seen) -> bool) -> Option<usize> {
        self.log.iter().position(f)
    }
}

/// A raw RDMA CM server that accepts one tokio-rdma client.
pub struct RawListener {
    ch: EventChannel,
    id: CmId,
}

impl RawListener {
    /// Binds and listens at `addr`.
    pub fn bind(addr: SocketAddr) -> RawListener {
        let ch = EventChannel::new().expect("event channel");
        let id = ch.create_id().expect("cm id");
        id.bind_addr(addr).expect("bind");
        id.listen(4).expect("listen");
        RawListener { ch, id }
    }

    /// Takes one connection request, answers it with `opts.params` (receives posted first),
    /// and waits until it is established.
    pub fn accept(self, opts: RawOpts) -> RawPeer {
        let mut req = wait_kind(
            &self.ch,
            CmEventKind::ConnectRequest,
            Duration::from_secs(60),
        );
        let remote = Params::decode(req.private_data()).expect("the client's handshake");
        let request = *req.conn_param().expect("request parameters");
        let id = req.take_id().expect("new id");
        id.set_ack_timeout(opts.ack_timeout).expect("ack timeout");
        let (ctx, pd, cq, qp, recv_mem, send_mem) = resources(&id, &opts);
        id.modify_qp_with_access(&qp, QpState::Init, AccessFlags::LOCAL_WRITE)
            .expect("INIT");
        id.modify_qp(&qp, QpState::Rtr).expect("RTR");
        let mut peer = RawPeer {
            id,
            ch: self.ch,
            qp,
            cq,
            recv_mem,
            send_mem,
            listen: Some(self.id),
            pd,
            ctx,
            opts,
            negotiated: handshake::negotiate(&opts.params, &remote).expect("negotiate"),
            credits: 0,
            ctrl_processed: 0,
            owed: 0,
            sends_posted: 0,
            sends_done: 0,
            log: Vec::new(),
            reports: Vec::new(),
            data_received: 0,
            controls_received: 0,
        };
        peer.established(remote);
        for slot in 0..opts.post_recvs {
            peer.post_recv(slot);
        }
        let hs = opts.params.encode().expect("handshake");
        let param = ConnParam::new(&peer.qp)
            .answering(&request)
            .private_data(&hs);
        peer.id.accept(&param).expect("rdma_accept");
        wait_kind(&peer.ch, CmEventKind::Established, Duration::from_secs(60));
        peer.id
            .modify_qp_rts_with_retries(&peer.qp, opts.retry_count, 6)
            .expect("RTS");
        peer
    }
}
