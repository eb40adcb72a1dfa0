//! Device tests of the RDMA CM wrappers on soft-RoCE (`rxe0` at 192.0.2.1 in the VM): a
//! listener and a client in one process connect their own queue pairs through RDMA CM with a
//! handshake in the private data, exchange messages, and disconnect; refused and rejected
//! connections surface as clear errors.
#![allow(clippy::print_stdout)]

mod common;

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use common::{pattern, poll_one};
use tokio_rdma::Error;
use tokio_rdma::conn::handshake::{self, Params};
use tokio_rdma::verbs::{
    AccessFlags, CmEvent, CmEventKind, CmId, CompletionQueue, ConnParam, Context, EventChannel,
    ProtectionDomain, QpInitAttr, QpState, QueuePair, RecvWr, RegisteredBuffer, SendOp, SendWr,
    WcOpcode,
};

/// The address of rxe0 in the VM; override with `TOKIO_RDMA_CM_ADDR`.
fn rxe_ip() -> IpAddr {
    std::env::var("TOKIO_RDMA_CM_ADDR")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| "192.0.2.1".parse().unwrap())
}

/// Timeouts are generous: rxe under TCG is slow.
const WAIT: Duration = Duration::from_secs(30);
const RESOLVE_MS: u32 = 5000;

/// Waits for the next event on `ch` and checks its kind (an error event becomes the error).
fn next(ch: &EventChannel, kind: CmEventKind) -> tokio_rdma::Result<CmEvent> {
    let ev = ch
        .wait_event(WAIT)
        .expect("rdma_get_cm_event")
        .unwrap_or_else(|| panic!("no RDMA CM event within {WAIT:?} (waiting for {kind})"));
    println!(
        "  event {} status {} on {:?}",
        ev.name(),
        ev.status(),
        ev.id()
    );
    ev.expect(kind)
}

/// A listener on rxe0's address with a kernel-chosen port.
fn listener() -> (EventChannel, CmId, SocketAddr) {
    let ch = EventChannel::new().expect("event channel");
    let id = CmId::new(&ch).expect("listener id");
    id.bind_addr(SocketAddr::new(rxe_ip(), 0)).expect("bind");
    id.listen(8).expect("listen");
    let addr = id.local_addr().expect("listener address");
    assert_ne!(addr.port(), 0, "bound to a port");
    println!("listening on {addr}");
    (ch, id, addr)
}

/// One end's verbs objects, created on the CM id's device context.
struct End {
    _ctx: Context,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    qp: QueuePair,
}

fn end_on(id: &CmId) -> End {
    let ctx = Context::from_cm_id(id).expect("context of the CM id");
    assert!(ctx.is_rdma_cm());
    assert!(id.is_on(&ctx));
    let pd = ProtectionDomain::new(&ctx).expect("pd");
    let cq = CompletionQueue::new(&ctx, 64, None).expect("cq");
    let mut attr = QpInitAttr::new(&cq, &cq);
    attr.caps.max_send_wr = 16;
    attr.caps.max_recv_wr = 16;
    let qp = QueuePair::new_rc(&pd, &attr).expect("qp");
    End {
        _ctx: ctx,
        pd,
        cq,
        qp,
    }
}

/// Client: resolves the listener's address and route, returns the id (bound to rxe0).
fn client_resolved(ch: &EventChannel, to: SocketAddr) -> CmId {
    let id = CmId::new(ch).expect("client id");
    assert!(!id.has_device());
    id.resolve_addr(None, to, RESOLVE_MS).expect("resolve_addr");
    next(ch, CmEventKind::AddrResolved).expect("ADDR_RESOLVED");
    assert!(id.has_device());
    id.resolve_route(RESOLVE_MS).expect("resolve_route");
    next(ch, CmEventKind::RouteResolved).expect("ROUTE_RESOLVED");
    id
}

fn post_recv(end: &End, buf: &RegisteredBuffer, wr_id: u64) {
    let sge = [buf.sge(0..buf.len())];
    // SAFETY: every buffer posted here outlives the completion the test polls for it.
    unsafe {
        end.qp
            .post_recv(&[RecvWr::new(wr_id, &sge)])
            .expect("post_recv")
    };
}

fn send(end: &End, data: &[u8], wr_id: u64) {
    let mut buf = RegisteredBuffer::new(&end.pd, data.len(), AccessFlags::LOCAL_WRITE).unwrap();
    buf.write_at(0, data);
    let sge = [buf.sge(0..data.len())];
    // SAFETY: `buf` lives until the send completion is polled below.
    unsafe {
        end.qp
            .post_send(&[SendWr::new(wr_id, SendOp::Send, &sge)])
            .expect("post_send")
    };
    let wc = poll_one(&end.cq);
    wc.result().expect("send completion");
    assert_eq!((wc.wr_id(), wc.opcode()), (wr_id, WcOpcode::Send));
}

fn expect_recv(end: &End, buf: &RegisteredBuffer, wr_id: u64, data: &[u8]) {
    let wc = poll_one(&end.cq);
    wc.result().expect("receive completion");
    assert_eq!((wc.wr_id(), wc.opcode()), (wr_id, WcOpcode::Recv));
    assert_eq!(wc.byte_len() as usize, data.len());
    assert_eq!(&buf.to_vec()[..data.len()], data);
}

#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn connect_handshake_send_recv_disconnect() {
    let (sch, listen_id, addr) = listener();
    let cch = EventChannel::new().expect("client channel");
    let client_params = Params {
        recv_credits: 8,
        recv_buf_size: 256,
        ..Params::default()
    };
    let server_params = Params {
        recv_credits: 4,
        recv_buf_size: 512,
        max_inline: 0,
        ..Params::default()
    };

    // Client: resolve, create the QP on the CM context, INIT, post a receive, connect.
    let cid = client_resolved(&cch, addr);
    let client = end_on(&cid);
    let mut init = cid.init_qp_attr(QpState::Init).expect("INIT attributes");
    println!("client INIT attributes: {init:?}");
    assert_eq!(init.port(), Some(cid.port_num()));
    // RDMA CM gives the active side no remote access at INIT: grant RDMA WRITE explicitly.
    init.set_access(AccessFlags::REMOTE_WRITE);
    client.qp.modify_with_attr(&init).expect("client INIT");
    cid.set_ack_timeout(16).expect("ack timeout");
    let crx = RegisteredBuffer::new(&client.pd, 256, AccessFlags::LOCAL_WRITE).unwrap();
    post_recv(&client, &crx, 1);
    let hello = client_params.encode().unwrap();
    cid.connect(&ConnParam::new(&client.qp).private_data(&hello))
        .expect("connect");

    // Server: the request carries a new id and the client's handshake (padded by IB CM).
    let mut req = next(&sch, CmEventKind::ConnectRequest).expect("CONNECT_REQUEST");
    println!(
        "request from {:?} to {:?}, {} bytes of private data, {:?}",
        req.peer_addr(),
        req.local_addr(),
        req.private_data().len(),
        req.conn_param()
    );
    assert!(req.private_data().len() >= hello.len());
    assert_eq!(&req.private_data()[..hello.len()], &hello[..]);
    let seen = Params::decode(req.private_data()).expect("client handshake decodes");
    assert_eq!(seen, client_params);
    let peer_conn = *req.conn_param().expect("request parameters");
    assert_eq!(peer_conn.qp_num, client.qp.qpn(), "client QPN carried");
    assert_eq!(req.listen_id(), Some(listen_id.key()));
    assert_eq!(req.peer_addr().map(|a| a.ip()), Some(rxe_ip()));
    let sid = req.take_id().expect("new id");
    assert!(req.take_id().is_none());
    let eff = handshake::negotiate(&server_params, &seen).expect("negotiate");
    assert_eq!((eff.send_credits, eff.max_send_size), (8, 256));

    let server = end_on(&sid);
    println!(
        "server INIT attributes: {:?}",
        sid.init_qp_attr(QpState::Init).unwrap()
    );
    sid.prepare_accept(&server.qp).expect("server INIT+RTR");
    assert_eq!(server.qp.state().unwrap(), QpState::Rtr);
    let srx = RegisteredBuffer::new(&server.pd, 512, AccessFlags::LOCAL_WRITE).unwrap();
    post_recv(&server, &srx, 2);
    let reply = server_params.encode().unwrap();
    sid.accept(
        &ConnParam::new(&server.qp)
            .private_data(&reply)
            .answering(&peer_conn),
    )
    .expect("accept");

    // Client: the response carries the server's handshake; RTR, RTS, establish.
    let resp = next(&cch, CmEventKind::ConnectResponse).expect("CONNECT_RESPONSE");
    println!(
        "response: {} bytes of private data, {:?}",
        resp.private_data().len(),
        resp.conn_param()
    );
    assert_eq!(&resp.private_data()[..reply.len()], &reply[..]);
    assert_eq!(
        Params::decode(resp.private_data()).expect("server handshake decodes"),
        server_params
    );
    assert_eq!(
        resp.conn_param().map(|c| c.qp_num),
        Some(server.qp.qpn()),
        "server QPN carried"
    );
    let rtr = cid.init_qp_attr(QpState::Rtr).expect("RTR attributes");
    println!("client RTR attributes: {rtr:?}");
    assert_eq!(rtr.dest_qpn(), Some(server.qp.qpn()));
    client.qp.modify_with_attr(&rtr).expect("client RTR");
    let rts = cid.init_qp_attr(QpState::Rts).expect("RTS attributes");
    println!("client RTS attributes: {rts:?}");
    assert_eq!(
        rts.send_timers().map(|t| t.0),
        Some(16),
        "RDMA_OPTION_ID_ACK_TIMEOUT applied"
    );
    assert_eq!(rts.send_timers().map(|t| (t.1, t.2)), Some((7, 6)));
    client.qp.modify_with_attr(&rts).expect("client RTS");
    cid.establish().expect("establish");
    assert_eq!(client.qp.state().unwrap(), QpState::Rts);

    // Server: ESTABLISHED, then RTS.
    next(&sch, CmEventKind::Established).expect("ESTABLISHED on the server");
    let rts = sid.init_qp_attr(QpState::Rts).expect("RTS attributes");
    println!("server RTS attributes: {rts:?}");
    server.qp.modify_with_attr(&rts).expect("server RTS");
    assert_eq!(server.qp.state().unwrap(), QpState::Rts);

    // One message each way.
    let ping = pattern(200, 1);
    send(&client, &ping, 10);
    expect_recv(&server, &srx, 2, &ping);
    let pong = pattern(100, 2);
    send(&server, &pong, 20);
    expect_recv(&client, &crx, 1, &pong);

    // The client's QP allows RDMA WRITE (set at INIT): the server writes into its memory.
    let target = RegisteredBuffer::new(
        &client.pd,
        4096,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
    )
    .unwrap();
    let data = pattern(4096, 3);
    let mut src = RegisteredBuffer::new(&server.pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
    src.write_at(0, &data);
    let sge = [src.sge(0..4096)];
    let write = SendOp::Write {
        remote_addr: target.addr(),
        rkey: target.rkey(),
    };
    // SAFETY: `src` outlives the completion polled below.
    unsafe {
        server
            .qp
            .post_send(&[SendWr::new(30, write, &sge)])
            .unwrap()
    };
    let wc = poll_one(&server.cq);
    wc.result().expect("RDMA WRITE into the client");
    assert_eq!(target.to_vec(), data);

    // The active side gets no ESTABLISHED of its own after rdma_establish.
    match cch.wait_event(Duration::from_millis(500)).unwrap() {
        None => println!("client: no event after establish (as rdma_establish(3) implies)"),
        Some(ev) => println!("client: extra event after establish: {ev:?}"),
    }

    // Disconnect from the client; the server answers.
    cid.disconnect().expect("client disconnect");
    next(&sch, CmEventKind::Disconnected).expect("DISCONNECTED on the server");
    sid.disconnect().expect("server disconnect");
    next(&cch, CmEventKind::Disconnected).expect("DISCONNECTED on the client");
    // RDMA CM does not own our QPs: they are still in RTS until moved to ERR.
    client.qp.to_error().unwrap();
    server.qp.to_error().unwrap();
    // Ids go before the verbs objects here only to show that the order does not matter.
    drop(cid);
    drop(sid);
}

#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn connect_without_listener_is_refused() {
    // A port that was just listened on and closed again: nothing listens there now.
    let addr = {
        let (_ch, _id, addr) = listener();
        addr
    };
    let cch = EventChannel::new().unwrap();
    let cid = client_resolved(&cch, addr);
    let client = end_on(&cid);
    cid.modify_qp(&client.qp, QpState::Init).unwrap();
    let hello = Params::default().encode().unwrap();
    cid.connect(&ConnParam::new(&client.qp).private_data(&hello))
        .unwrap();
    let err = next(&cch, CmEventKind::ConnectResponse).unwrap_err();
    println!("connect to {addr} without a listener: {err}");
    match &err {
        Error::ConnectionRejected { status, .. } => {
            assert_eq!(*status, 8, "IB CM reject reason: invalid service ID")
        }
        Error::CmEventFailed { event, .. } => assert_eq!(*event, "RDMA_CM_EVENT_UNREACHABLE"),
        other => panic!("unexpected error {other:?}"),
    }
    let io: std::io::Error = err.into();
    assert!(
        matches!(
            io.kind(),
            std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::HostUnreachable
        ),
        "{io}"
    );
}

#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn listener_rejects_with_reason() {
    let (sch, _listen_id, addr) = listener();
    let cch = EventChannel::new().unwrap();

    // A client that speaks another protocol: the server's decode fails, and it rejects with
    // the decode error as the reason.
    let cid = client_resolved(&cch, addr);
    let client = end_on(&cid);
    cid.modify_qp(&client.qp, QpState::Init).unwrap();
    cid.connect(&ConnParam::new(&client.qp).private_data(b"GET / HTTP/1.1"))
        .unwrap();

    let mut req = next(&sch, CmEventKind::ConnectRequest).unwrap();
    let decode_err = Params::decode(req.private_data()).unwrap_err();
    assert!(
        matches!(decode_err, handshake::HandshakeError::BadMagic { .. }),
        "{decode_err}"
    );
    let as_crate_error: Error = decode_err.clone().into();
    println!("server: {as_crate_error}");
    let reason = format!("tokio-rdma: {decode_err}");
    let reason = &reason.as_bytes()[..reason.len().min(tokio_rdma::verbs::MAX_REJECT_PRIVATE_DATA)];
    let sid = req.take_id().unwrap();
    sid.reject(reason).expect("reject");

    let err = next(&cch, CmEventKind::ConnectResponse).unwrap_err();
    println!("client: {err}");
    match &err {
        Error::ConnectionRejected {
            status,
            private_data,
            ..
        } => {
            assert_eq!(*status, 28, "consumer-defined reject");
            assert!(
                private_data.starts_with(reason),
                "reject private data {private_data:02x?}"
            );
            assert!(
                private_data[reason.len()..].iter().all(|&b| b == 0),
                "padding is zeros"
            );
        }
        other => panic!("expected ConnectionRejected, got {other:?}"),
    }
    assert!(err.to_string().contains("bad magic"), "{err}");

    // An over-long reject reason is refused before any verb is called.
    let too_long = [b'x'; tokio_rdma::verbs::MAX_REJECT_PRIVATE_DATA + 1];
    assert!(matches!(
        sid.reject(&too_long),
        Err(Error::PrivateDataTooLong { .. })
    ));
}

#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn dropped_request_is_refused_and_ids_outlive_nothing() {
    // Dropping a CONNECT_REQUEST without taking its id destroys the id, which refuses the
    // request; dropping ids and channels in any order must not hang (events are acked).
    let (sch, listen_id, addr) = listener();
    let cch = EventChannel::new().unwrap();
    let cid = client_resolved(&cch, addr);
    let client = end_on(&cid);
    cid.modify_qp(&client.qp, QpState::Init).unwrap();
    cid.connect(&ConnParam::new(&client.qp)).unwrap();
    let req = next(&sch, CmEventKind::ConnectRequest).unwrap();
    assert!(req.private_data().iter().all(|&b| b == 0));
    assert_eq!(
        Params::decode(req.private_data()),
        Err(handshake::HandshakeError::Missing)
    );
    drop(req);
    let err = next(&cch, CmEventKind::ConnectResponse).unwrap_err();
    println!("client after the server dropped the request: {err}");
    assert!(
        matches!(
            err,
            Error::ConnectionRejected { .. } | Error::CmEventFailed { .. }
        ),
        "{err:?}"
    );
    drop(sch); // the listener id still holds the channel
    drop(listen_id);
    drop(cid);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn driver_queue_pairs_over_rdma_cm() {
    use tokio_rdma::driver::{Driver, DriverOptions, QpOptions};

    // The CM exchange is synchronous here (blocking this worker briefly); the data path is
    // the async driver, created on the CM id's context and shared by both ends.
    let (sch, _listen_id, addr) = listener();
    let cch = EventChannel::new().unwrap();
    let cid = client_resolved(&cch, addr);
    let ctx = Context::from_cm_id(&cid).unwrap();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let driver = Driver::new(&ctx, DriverOptions::default()).unwrap();
    let opts = QpOptions::default();
    let cqp = driver.create_qp(&pd, opts).unwrap();
    cid.modify_qp(cqp.verbs(), QpState::Init).unwrap();
    let crx = RegisteredBuffer::new(&pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
    // Posted now (`start`), before the peer can send: not left to the spawned task's first poll.
    let crecv = tokio::spawn(common::posted(cqp.recv(crx)));
    let hello = Params::default().encode().unwrap();
    cid.connect(&ConnParam::new(cqp.verbs()).private_data(&hello))
        .unwrap();

    let mut req = next(&sch, CmEventKind::ConnectRequest).unwrap();
    let sid = req.take_id().unwrap();
    assert!(
        sid.is_on(&ctx),
        "both ends use rxe0's one librdmacm context"
    );
    let sqp = driver.create_qp(&pd, opts).unwrap();
    sid.prepare_accept(sqp.verbs()).unwrap();
    let srx = RegisteredBuffer::new(&pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
    let srecv = tokio::spawn(common::posted(sqp.recv(srx)));
    sid.accept(
        &ConnParam::new(sqp.verbs())
            .private_data(&hello)
            .answering(req.conn_param().unwrap()),
    )
    .unwrap();
    next(&cch, CmEventKind::ConnectResponse).unwrap();
    cid.finish_connect(cqp.verbs()).unwrap();
    next(&sch, CmEventKind::Established).unwrap();
    sid.modify_qp(sqp.verbs(), QpState::Rts).unwrap();

    let data = pattern(3000, 9);
    let tx = common::reg_with(&pd, &data, AccessFlags::LOCAL_WRITE);
    let (res, tx) = common::within(60, "client send", cqp.send(tx)).await;
    res.expect("client send");
    let (info, srx) = common::within(60, "server recv", srecv).await.unwrap();
    assert_eq!(info.expect("server recv").len, data.len());
    assert_eq!(&srx.to_vec()[..data.len()], &data[..]);
    let (res, _tx) = common::within(60, "server send", sqp.send(tx)).await;
    res.expect("server send");
    let (info, crx) = common::within(60, "client recv", crecv).await.unwrap();
    assert_eq!(info.expect("client recv").len, data.len());
    assert_eq!(&crx.to_vec()[..data.len()], &data[..]);

    sid.disconnect().unwrap();
    next(&cch, CmEventKind::Disconnected).unwrap();
    cid.disconnect().unwrap();
    next(&sch, CmEventKind::Disconnected).unwrap();
    common::within(60, "close client qp", cqp.close())
        .await
        .unwrap();
    common::within(60, "close server qp", sqp.close())
        .await
        .unwrap();
}

/// `wait_event(Duration::MAX)`, the usual spelling of "no limit", waits for the event: it
/// computed `Instant::now() + timeout`, which panics for a timeout the clock cannot add.
#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn waiting_without_a_limit_returns_the_event() {
    let (_lch, _listener, addr) = listener();
    let ch = EventChannel::new().expect("event channel");
    let id = CmId::new(&ch).expect("client id");
    id.resolve_addr(None, addr, RESOLVE_MS)
        .expect("resolve_addr");
    // Address resolution ends in an event either way (resolved, or an error after RESOLVE_MS).
    let ev = ch
        .wait_event(Duration::MAX)
        .expect("rdma_get_cm_event")
        .expect("an event, not a timeout");
    ev.expect(CmEventKind::AddrResolved).expect("ADDR_RESOLVED");
}
