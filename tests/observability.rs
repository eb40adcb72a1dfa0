//! Device tests of what an operator sees of connections through `tracing`
//! (docs/observability.md): each connection's `conn` span carries its id (`Connection::id`,
//! unique per endpoint) and local queue pair number; setup, failure and teardown each emit one
//! event in it. A small in-test `Layer` captures the events with their `conn` span's fields.
#![allow(clippy::print_stdout)]

mod common;
#[path = "common/raw_peer.rs"]
mod raw_peer;

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::within;
use raw_peer::{RawOpts, RawPeer};
use tokio_rdma::Endpoint;
use tokio_rdma::conn::ConnectOptions;
use tokio_rdma::conn::handshake::Params;
use tokio_rdma::{Error, QpFailure};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

/// A port on rxe0's address (each test uses its own).
fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([192, 0, 2, 1], port))
}

type Fields = BTreeMap<String, String>;

/// One captured event: its level, message, own fields, and the fields of the `conn` span it
/// is in (if any).
#[derive(Debug, Clone)]
struct Captured {
    level: Level,
    message: String,
    fields: Fields,
    conn: Option<Fields>,
}

/// Records fields as strings.
struct Collect<'a>(&'a mut Fields);

impl Visit for Collect<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_string(), value.to_string());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0
            .insert(field.name().to_string(), format!("{value:?}"));
    }
}

/// A span's fields so far (`Empty` ones appear once recorded).
struct SpanFields(Fields);

/// The capturing layer.
#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<Captured>>>);

impl Capture {
    fn events(&self) -> Vec<Captured> {
        self.0.lock().unwrap().clone()
    }

    /// The events with `message` in a `conn` span.
    fn named(&self, message: &str) -> Vec<Captured> {
        self.events()
            .into_iter()
            .filter(|e| e.message == message && e.conn.is_some())
            .collect()
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut f = Fields::new();
        attrs.record(&mut Collect(&mut f));
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(SpanFields(f));
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id) {
            if let Some(f) = span.extensions_mut().get_mut::<SpanFields>() {
                values.record(&mut Collect(&mut f.0));
            }
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let mut fields = Fields::new();
        event.record(&mut Collect(&mut fields));
        let message = fields.remove("message").unwrap_or_default();
        let conn = ctx.event_scope(event).and_then(|scope| {
            scope
                .into_iter()
                .find(|s| s.name() == "conn")
                .and_then(|s| s.extensions().get::<SpanFields>().map(|f| f.0.clone()))
        });
        self.0.lock().unwrap().push(Captured {
            level: *event.metadata().level(),
            message,
            fields,
            conn,
        });
    }
}

/// Waits (bounded) until `n` events named `message` were captured.
async fn wait_for(cap: &Capture, message: &str, n: usize) -> Vec<Captured> {
    wait_until(cap, message, |got| got.len() >= n).await
}

/// Waits (bounded) until the events named `message` satisfy `done`; returns them.
async fn wait_until(
    cap: &Capture,
    message: &str,
    done: impl Fn(&[Captured]) -> bool,
) -> Vec<Captured> {
    within(60, message, async {
        loop {
            let got = cap.named(message);
            if done(&got) {
                return got;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
}

/// Captures this thread's events (the tests' runtime is current-thread: the connection
/// tasks run here) until the guard is dropped; and an endpoint on the test device.
fn capture() -> (Capture, tracing::subscriber::DefaultGuard, Endpoint) {
    let cap = Capture::default();
    let guard = tracing::subscriber::set_default(tracing_subscriber::registry().with(cap.clone()));
    let ep = Endpoint::open(&common::device_name()).expect("endpoint");
    (cap, guard, ep)
}

/// The event of `side` among `events` (exactly one).
fn of_side<'a>(events: &'a [Captured], side: &str) -> &'a Captured {
    let mine: Vec<_> = events
        .iter()
        .filter(|e| e.conn.as_ref().unwrap().get("side").map(String::as_str) == Some(side))
        .collect();
    assert_eq!(mine.len(), 1, "one event of the {side}: {events:#?}");
    mine[0]
}

fn conn_field<'a>(e: &'a Captured, name: &str) -> &'a str {
    e.conn
        .as_ref()
        .unwrap()
        .get(name)
        .unwrap_or_else(|| panic!("the conn span has no {name}: {e:#?}"))
}

// Current-thread runtime: the connection tasks run on the test's thread, under its subscriber.
#[tokio::test]
#[ignore = "needs an RDMA device; run in the soft-RoCE VM (scripts/rxe-vm)"]
async fn connect_and_close_emit_setup_and_teardown_events_with_one_id() {
    let (cap, _guard, ep) = capture();
    let listener = ep
        .listen_with(addr(7591), ConnectOptions::default())
        .await
        .expect("listen");
    let (client, server) = within(60, "connect", async {
        tokio::join!(
            ep.connect(addr(7591), ConnectOptions::default()),
            listener.accept()
        )
    })
    .await;
    let (client, server) = (client.expect("connect"), server.expect("accept"));
    assert_ne!(client.id(), server.id(), "ids are unique per endpoint");
    client.send(b"ping").await.expect("send");
    let msg = server.recv().await.expect("recv").expect("a message");
    assert_eq!(&msg[..], b"ping");
    drop(msg);
    let (client_id, server_id) = (client.id().to_string(), server.id().to_string());

    let established = wait_for(&cap, "connection established", 2).await;
    for (side, id) in [("client", &client_id), ("server", &server_id)] {
        let e = of_side(&established, side);
        assert_eq!(e.level, Level::INFO);
        assert_eq!(conn_field(e, "conn_id"), id, "{side}");
        let qpn: u32 = conn_field(e, "qpn").parse().expect("qpn is a number");
        assert!(qpn > 0, "{side}: qpn {qpn}");
        assert!(
            conn_field(e, "peer").contains(':'),
            "{side}: a peer address"
        );
    }

    // The client closes first (ending "close"); the server sees end of stream, then closes
    // (ending "peer_close").
    within(60, "client close", client.close())
        .await
        .expect("close");
    assert!(server.recv().await.expect("end of stream").is_none());
    within(60, "server close", server.close())
        .await
        .expect("server close");
    let closed = wait_for(&cap, "connection closed", 2).await;
    for (side, id, ending) in [
        ("client", &client_id, "close"),
        ("server", &server_id, "peer_close"),
    ] {
        let e = of_side(&closed, side);
        assert_eq!(e.level, Level::INFO);
        assert_eq!(conn_field(e, "conn_id"), id, "{side}: same id as at setup");
        let setup = of_side(&established, side);
        assert_eq!(
            conn_field(e, "qpn"),
            conn_field(setup, "qpn"),
            "{side}: same qpn"
        );
        assert_eq!(
            e.fields.get("ending").map(String::as_str),
            Some(ending),
            "{e:#?}"
        );
        assert_eq!(
            e.fields.get("messages_sent").map(String::as_str),
            Some(if side == "client" { "1" } else { "0" })
        );
    }
    let failures: Vec<_> = cap
        .events()
        .into_iter()
        .filter(|e| e.message.starts_with("connection") && e.level == Level::WARN)
        .collect();
    assert!(failures.is_empty(), "no failure events: {failures:#?}");
    // One setup and one teardown event per connection: nothing more arrives later.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(cap.named("connection established").len(), 2);
    assert_eq!(cap.named("connection closed").len(), 2);
    println!("events: {:#?}", cap.named("connection closed"));
}

#[tokio::test]
#[ignore = "needs an RDMA device; run in the soft-RoCE VM (scripts/rxe-vm)"]
async fn a_refused_connect_emits_one_failure_event() {
    let (cap, _guard, ep) = capture();
    // Nobody listens on this port: the peer's RDMA CM rejects the request.
    let opts = ConnectOptions::default().connect_timeout(Duration::from_secs(30));
    let err = within(60, "refused connect", ep.connect(addr(7592), opts))
        .await
        .expect_err("nobody listens");
    println!("connect failed: {err}");
    let failed = cap.named("connection setup failed");
    assert_eq!(failed.len(), 1, "{:#?}", cap.events());
    let e = &failed[0];
    assert_eq!(e.level, Level::WARN);
    assert_eq!(conn_field(e, "side"), "client");
    assert_eq!(conn_field(e, "peer"), addr(7592).to_string());
    assert_eq!(conn_field(e, "conn_id"), "1", "the endpoint's first id");
    assert_eq!(
        e.fields.get("error").map(String::as_str),
        Some(err.to_string().as_str()),
        "the error's Display"
    );
    assert!(e.fields.contains_key("detail"), "the error's Debug");
    assert!(cap.named("connection established").is_empty());
    assert!(cap.named("connection closed").is_empty());
}

/// The two endings the first test cannot produce: a peer that goes silent (a raw peer that
/// connects and then never sends, confirms or polls anything: its queue pair still acknowledges
/// every send, as a stopped process's would) ends with `keepalive_timeout` and one warning
/// with the cause; a connection dropped without `close` ends with `drop`.
#[tokio::test]
#[ignore = "needs an RDMA device; run in the soft-RoCE VM (scripts/rxe-vm)"]
async fn a_silent_peer_and_a_dropped_connection_end_with_their_own_events() {
    let (cap, _guard, ep) = capture();
    let (keepalive, timeout) = (Duration::from_millis(300), Duration::from_secs(1));
    let opts = ConnectOptions::default()
        .keepalive(Some(keepalive))
        .keepalive_timeout(timeout);
    let listener = ep
        .listen_with(addr(7593), opts.clone())
        .await
        .expect("listen");

    // A silent peer: the server's pending receive fails with the keepalive timeout.
    let raw = RawOpts::new(Params::default());
    let (peer, server) = tokio::join!(
        tokio::task::spawn_blocking(move || RawPeer::connect(addr(7593), raw)),
        within(60, "accept the raw peer", listener.accept())
    );
    let (peer, server) = (peer.expect("raw peer"), server.expect("accept"));
    let id = server.id().to_string();
    let end = within(60, "the silent peer's verdict", server.recv()).await;
    println!("silent peer: recv() -> {end:?}");
    assert!(
        matches!(end, Err(Error::QpFailed(QpFailure::KeepaliveTimeout(t))) if t == timeout),
        "{end:?}"
    );
    let closed = wait_for(&cap, "connection closed", 1).await;
    let e = &closed[0];
    assert_eq!(conn_field(e, "conn_id"), id);
    assert_eq!(
        e.fields.get("ending").map(String::as_str),
        Some("keepalive_timeout"),
        "{e:#?}"
    );
    let failed = cap.named("connection failed");
    assert_eq!(failed.len(), 1, "one failure event: {:#?}", cap.events());
    assert_eq!(failed[0].level, Level::WARN);
    assert_eq!(conn_field(&failed[0], "conn_id"), id);
    let cause = failed[0]
        .fields
        .values()
        .cloned()
        .collect::<Vec<_>>()
        .join(" ");
    assert!(
        cause.contains("keepalive"),
        "the cause is named: {failed:#?}"
    );
    drop(server);
    drop(peer);

    // A connection dropped without close(): its event says so.
    let (client, server) = within(60, "connect", async {
        tokio::join!(ep.connect(addr(7593), opts.clone()), listener.accept())
    })
    .await;
    let (client, server) = (client.expect("connect"), server.expect("accept"));
    let id = client.id().to_string();
    drop(client);
    let end = within(60, "the server's verdict", server.recv()).await;
    println!("dropped client: server recv() -> {end:?}");
    let of_client = |e: &Captured| e.conn.as_ref().unwrap().get("conn_id") == Some(&id);
    wait_until(&cap, "connection closed", |got| got.iter().any(of_client)).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let closed = cap.named("connection closed");
    let mine: Vec<_> = closed.iter().filter(|e| of_client(e)).collect();
    assert_eq!(mine.len(), 1, "one event per connection: {closed:#?}");
    assert_eq!(
        mine[0].fields.get("ending").map(String::as_str),
        Some("drop"),
        "{:#?}",
        mine[0]
    );
    println!("events: {:#?}", cap.named("connection closed"));
}
