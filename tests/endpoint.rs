//! Device tests of `Endpoint`: several endpoints with different completion modes on one
//! device, each driving its own connections; options that cannot apply are refused.
#![allow(clippy::print_stdout)]

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::within;
use tokio_rdma::conn::ConnectOptions;
use tokio_rdma::driver::CompletionMode;
use tokio_rdma::{Endpoint, EndpointOptions, Error};

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([192, 0, 2, 1], port))
}

fn open(mode: CompletionMode) -> Endpoint {
    Endpoint::open_with(
        &common::device_name(),
        EndpointOptions::default().completion_mode(mode),
    )
    .expect("endpoint")
}

#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn endpoints_with_different_modes_coexist_on_one_device() {
    let busy = open(CompletionMode::BusyPoll);
    let event = open(CompletionMode::Event);
    assert_eq!(busy.device_name(), event.device_name());
    let listener = event
        .listen(addr(7321))
        .await
        .expect("listen on the event endpoint");
    let (client, server) = tokio::join!(
        busy.connect(addr(7321), ConnectOptions::default()),
        listener.accept()
    );
    let (client, server) = (client.expect("connect"), server.expect("accept"));
    let before = (busy.stats(), event.stats());
    for i in 0..200u32 {
        let msg = i.to_be_bytes();
        // The server waits first (so on the event endpoint it sleeps on a completion event);
        // the client sends a moment later.
        let send_later = async {
            tokio::time::sleep(Duration::from_millis(1)).await;
            client.send(&msg).await
        };
        let (got, sent) = tokio::join!(server.recv(), send_later);
        sent.unwrap();
        assert_eq!(&got.unwrap().expect("message")[..], &msg);
        let (sent, got) = tokio::join!(server.send(&msg), client.recv());
        sent.unwrap();
        assert_eq!(&got.unwrap().expect("message")[..], &msg);
    }
    let (b, e) = (busy.stats(), event.stats());
    println!("busy endpoint: {b:?}\nevent endpoint: {e:?}");
    // Each endpoint saw its own connection's completions on its own completion queue.
    assert!(b.completions - before.0.completions >= 200, "busy: {b:?}");
    assert!(e.completions - before.1.completions >= 200, "event: {e:?}");
    // The busy endpoint's futures polled the CQ in place (its completion task arms the CQ
    // only after 64 rounds in a row with no future waiting, as in the 1 ms before each send
    // here: docs/architecture.md); the event endpoint's futures never polled, they slept and
    // its completion task armed.
    assert!(
        b.polled_in_place > before.0.polled_in_place,
        "busy mode polls in place: {b:?}"
    );
    assert_eq!(
        e.polled_in_place, before.1.polled_in_place,
        "event mode does not poll in place: {e:?}"
    );
    assert!(e.arms > before.1.arms, "event mode arms: {e:?}");
    client.close().await.unwrap();
    assert!(
        within(30, "server sees the close", server.recv())
            .await
            .unwrap()
            .is_none()
    );
}

/// In event mode on a current-thread runtime a receive that goes to sleep costs its endpoint's
/// completion task one run: the CQ event that brings the message. Nobody polls the CQ in place
/// in event mode and the task never sleeps without the CQ armed, so a sleeping wait has
/// nothing to hand it; waking it anyway (as a sleeping wait does in the other modes, where the
/// task may be leaving the CQ to spinning futures, and on a multi-thread runtime, where the
/// wake-up keeps the task on the sleeper's worker) was a second task run, and an empty poll,
/// per round trip. Counted, not timed: the server's receive is asleep before each message
/// (the client sends 1 ms later).
#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn in_event_mode_a_sleeping_receive_costs_one_completion_task_run() {
    let server_ep = open(CompletionMode::Event);
    let client_ep = open(CompletionMode::Event);
    let listener = server_ep.listen(addr(7323)).await.expect("listen");
    let (client, server) = tokio::join!(
        client_ep.connect(addr(7323), ConnectOptions::default()),
        listener.accept()
    );
    let (client, server) = (client.expect("connect"), server.expect("accept"));
    const ROUNDS: u64 = 200;
    let before = server_ep.stats();
    for i in 0..ROUNDS {
        let msg = i.to_be_bytes();
        let send_later = async {
            tokio::time::sleep(Duration::from_millis(1)).await;
            client.send(&msg).await
        };
        let (got, sent) = tokio::join!(server.recv(), send_later);
        sent.unwrap();
        assert_eq!(&got.unwrap().expect("message")[..], &msg);
    }
    let after = server_ep.stats();
    let runs = after.task_wakeups - before.task_wakeups;
    let events = after.cq_events - before.cq_events;
    println!(
        "{ROUNDS} sleeping receives: {runs} completion task runs, {events} CQ events ({:.2} runs per receive)",
        runs as f64 / ROUNDS as f64
    );
    // One run per event (a message's completion), and a few for what else completes (the
    // server's credit returns): well under the two per receive of a task woken by each sleep.
    assert!(events >= ROUNDS, "every message raised an event: {after:?}");
    assert!(
        runs * 4 < ROUNDS * 6,
        "{runs} task runs for {ROUNDS} sleeping receives: the sleeps woke the task ({after:?})"
    );
    client.close().await.unwrap();
}

#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn options_that_cannot_apply_are_refused() {
    let err = Endpoint::open("no-such-rdma-device").unwrap_err();
    println!("unknown device: {err}");
    assert!(matches!(err, Error::DeviceNotFound { .. }), "{err}");
    let max = {
        let ep = open(CompletionMode::Event);
        ep.context().device_attr().max_cqe
    };
    let err = Endpoint::open_with(
        &common::device_name(),
        EndpointOptions::default().cq_size(max + 1),
    )
    .unwrap_err();
    println!("CQ too large: {err}");
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    let ep = open(CompletionMode::Event);
    // A completion mode other than the endpoint's: refused, at listen and at connect.
    let other = ConnectOptions::default().completion_mode(CompletionMode::BusyPoll);
    let err = ep.listen_with(addr(7322), other.clone()).await.unwrap_err();
    println!("listen with another mode: {err}");
    assert!(err.to_string().contains("endpoint"), "{err}");
    let listener = ep.listen(addr(7322)).await.expect("listen");
    let err = ep.connect(addr(7322), other).await.unwrap_err();
    println!("connect with another mode: {err}");
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    // The same mode, said explicitly, is fine.
    let same = ConnectOptions::default().completion_mode(CompletionMode::Event);
    let (c, s) = tokio::join!(ep.connect(addr(7322), same), listener.accept());
    let (c, s) = (c.expect("connect"), s.expect("accept"));
    c.send(b"ok").await.unwrap();
    assert_eq!(&s.recv().await.unwrap().unwrap()[..], b"ok");
}
