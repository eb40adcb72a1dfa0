//! Device tests of raw connections (`conn::Raw*`): RDMA CM with the user's private data both
//! ways and no framing of the crate's own; receives posted before the peer can send;
//! rejections that carry their reason; a raw client meeting the message listener and a message
//! client meeting a raw listener; abandoned setups that leave nothing behind.
#![allow(clippy::print_stdout)]

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::within;
use tokio_rdma::conn::handshake::MAGIC;
use tokio_rdma::conn::{ConnectOptions, RawOptions};
use tokio_rdma::verbs::{AccessFlags, RegisteredBuffer};
use tokio_rdma::{Endpoint, Error};

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([192, 0, 2, 1], port))
}

/// An endpoint, with librdmacm's per-device state warmed up: the first id bound to a device
/// makes librdmacm allocate a protection domain of its own, kept while the device is open, which
/// must be in the baseline of the resource counts.
fn endpoint() -> Endpoint {
    let ep = Endpoint::open(&common::device_name()).expect("endpoint");
    drop(ep.listen_raw(addr(0), 1).expect("bind"));
    ep
}

fn opts() -> RawOptions {
    RawOptions::default()
        .send_queue(8)
        .recv_queue(8)
        .sges(1, 1)
        .timeout(Duration::from_secs(20))
}

fn buffer(pd: &tokio_rdma::verbs::ProtectionDomain, data: &[u8]) -> RegisteredBuffer {
    let mut b = RegisteredBuffer::new(pd, data.len(), AccessFlags::LOCAL_WRITE).expect("register");
    b.write_at(0, data);
    b
}

/// The private data as the transport delivered it, without the zero padding.
fn trimmed(data: &[u8]) -> &[u8] {
    let end = data.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
    &data[..end]
}

fn rejected_with(e: &Error) -> Option<Vec<u8>> {
    match e {
        Error::ConnectionRejected { private_data, .. } => Some(trimmed(private_data).to_vec()),
        _ => None,
    }
}

/// The resources of the device are back to `base` (the kernel frees ids asynchronously).
async fn back_to(base: &std::collections::BTreeMap<String, u64>, after: &str) {
    for _ in 0..100 {
        if &common::resource_counts() == base {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!(
        "after {after}: resources {:?}, before {base:?}",
        common::resource_counts()
    );
}

#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn private_data_both_ways_and_first_messages_find_posted_receives() {
    common::init_tracing();
    let ep = endpoint();
    let base = common::resource_counts();
    let listener = ep.listen_raw(addr(7401), 4).expect("listen_raw");
    assert_eq!(listener.local_addr(), Some(addr(7401)));
    let server = async {
        let req = within(30, "request", listener.next())
            .await
            .expect("request");
        assert_eq!(trimmed(req.private_data()), b"hello from the client");
        assert!(req.conn_param().is_some());
        let accepting = req.prepare(opts()).expect("prepare");
        // Posted before the accept: the client sends at once when established.
        let rbuf = RegisteredBuffer::new(accepting.pd(), 64, AccessFlags::LOCAL_WRITE).unwrap();
        let mut first = accepting.qp().recv(rbuf);
        first.start();
        let conn = within(30, "accept", accepting.accept(b"hello from the server"))
            .await
            .expect("accept");
        assert_eq!(trimmed(conn.peer_private_data()), b"hello from the client");
        // The server speaks first too: the client posted its receive before connecting.
        let (res, _) = conn.qp().send(buffer(conn.pd(), b"server first")).await;
        res.expect("server send");
        let (res, got) = within(30, "client's message", first).await;
        let info = res.expect("server recv");
        assert_eq!(&got.to_vec()[..info.len], b"client first, 26 bytes long");
        within(30, "the client's disconnect", conn.disconnected())
            .await
            .expect("disconnected");
        conn.disconnect().await.expect("server disconnect");
    };
    let client = async {
        let c = within(30, "resolve", ep.raw_connector(addr(7401), opts()))
            .await
            .expect("raw_connector");
        let rbuf = RegisteredBuffer::new(c.pd(), 64, AccessFlags::LOCAL_WRITE).unwrap();
        let mut first = c.qp().recv(rbuf);
        first.start();
        let reply = within(30, "reply", c.connect(b"hello from the client"))
            .await
            .expect("connect");
        assert_eq!(trimmed(reply.private_data()), b"hello from the server");
        let conn = reply.establish().expect("establish");
        let (res, _) = conn
            .qp()
            .send(buffer(conn.pd(), b"client first, 26 bytes long"))
            .await;
        res.expect("client send");
        let (res, got) = within(30, "server's message", first).await;
        let info = res.expect("client recv");
        assert_eq!(&got.to_vec()[..info.len], b"server first");
        assert_eq!(conn.peer_addr(), Some(addr(7401)));
        within(30, "disconnect", conn.disconnect())
            .await
            .expect("client disconnect");
    };
    tokio::join!(server, client);
    drop(listener);
    back_to(&base, "a raw connection both ways").await;
    println!("raw connection: private data both ways, first messages delivered, nothing left");
}

/// How the server answers a request.
type Answer = Box<dyn Fn(tokio_rdma::conn::RawRequest)>;

#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn rejections_carry_their_reason_and_leave_nothing() {
    common::init_tracing();
    let ep = endpoint();
    let base = common::resource_counts();
    let listener = ep.listen_raw(addr(7402), 4).expect("listen_raw");
    let cases: [(&str, Answer); 3] = [
        (
            "reject",
            Box::new(|r| r.reject(b"go away").expect("reject")),
        ),
        ("drop", Box::new(drop)),
        (
            "prepare with options that cannot apply",
            Box::new(|r| {
                let e = r.prepare(opts().retry_count(9)).unwrap_err();
                assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
            }),
        ),
    ];
    for (what, answer) in cases {
        let client = ep.connect_raw(addr(7402), opts(), b"let me in");
        let server = async {
            let req = within(30, "request", listener.next())
                .await
                .expect("request");
            answer(req);
        };
        let (res, ()) = tokio::join!(within(30, what, client), server);
        let err = res.expect_err(what);
        let reason = rejected_with(&err).unwrap_or_else(|| panic!("{what}: {err:?}"));
        println!("{what}: the client got {err}");
        match what {
            "reject" => assert_eq!(reason, b"go away"),
            "drop" => {}
            _ => assert!(
                reason.starts_with(b"tokio-rdma: invalid argument"),
                "{what}: {:?}",
                String::from_utf8_lossy(&reason)
            ),
        }
    }
    drop(listener);
    back_to(&base, "three rejected raw requests").await;
}

#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_raw_client_meets_the_message_listener() {
    common::init_tracing();
    let ep = endpoint();
    let base = common::resource_counts();
    // A foreign (raw) client against the message listener: rejected with a reason, counted.
    let listener = ep.listen(addr(7403)).await.expect("listen");
    let err = within(
        30,
        "raw client",
        ep.connect_raw(addr(7403), opts(), b"RPNG not a handshake"),
    )
    .await
    .expect_err("a foreign client is rejected");
    let reason = rejected_with(&err).unwrap_or_else(|| panic!("{err:?}"));
    let reason = String::from_utf8_lossy(&reason).into_owned();
    println!("raw client at the message listener: {err}; reason {reason:?}");
    assert!(reason.starts_with("tokio-rdma: "), "{reason}");
    assert!(reason.contains("magic"), "{reason}");
    for _ in 0..100 {
        if listener.bad_handshakes() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(listener.bad_handshakes(), 1);
    assert_eq!(listener.rejected(), 1);
    drop(listener);
    back_to(&base, "a raw client at the message listener").await;
}

#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_message_client_meets_a_raw_listener() {
    common::init_tracing();
    let ep = endpoint();
    let base = common::resource_counts();
    // The raw side sees the tokio-rdma handshake in the private data, and refuses.
    let raw = ep.listen_raw(addr(7404), 4).expect("listen_raw");
    let client = ep.connect(addr(7404), ConnectOptions::default());
    let server = async {
        let req = within(30, "request", raw.next()).await.expect("request");
        assert_eq!(&req.private_data()[..4], &MAGIC);
        req.reject(b"raw only").expect("reject");
    };
    let (res, ()) = tokio::join!(within(30, "message client", client), server);
    let err = res.expect_err("rejected");
    assert_eq!(
        rejected_with(&err).as_deref(),
        Some(&b"raw only"[..]),
        "{err:?}"
    );
    drop(raw);
    back_to(&base, "both mismatched pairs").await;
}

#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn an_unanswered_request_times_out_and_an_abandoned_one_frees_everything() {
    common::init_tracing();
    let ep = endpoint();
    let base = common::resource_counts();
    let listener = ep.listen_raw(addr(7405), 4).expect("listen_raw");
    // The server takes the request and never answers: the client's step limit ends it.
    let short = opts().timeout(Duration::from_secs(2));
    let (res, req) = tokio::join!(
        ep.connect_raw(addr(7405), short.clone(), b"anyone?"),
        listener.next()
    );
    let err = res.expect_err("no answer");
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    drop(req);
    // A client that gives up half-way (its future dropped while waiting for the answer).
    let abandoned = tokio::time::timeout(
        Duration::from_millis(500),
        ep.connect_raw(addr(7405), opts(), b"never mind"),
    );
    let (res, req) = tokio::join!(abandoned, listener.next());
    assert!(res.is_err(), "the client was abandoned");
    let req = req.expect("request");
    // The request is still answerable; the accept fails as the client is gone.
    let accepted = within(60, "accept to a gone client", async {
        req.accept(opts().timeout(Duration::from_secs(5)), b"too late")
            .await
    })
    .await;
    assert!(accepted.is_err(), "accepting a gone client fails");
    println!(
        "timeout: {err}; accept to an abandoned client: {}",
        accepted.unwrap_err()
    );
    drop(listener);
    back_to(&base, "an unanswered and an abandoned request").await;
}
