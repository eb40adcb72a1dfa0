//! Device tests of dead-peer detection against a real stopped process: the peer is this test
//! binary run again as a child (`peer_process`), which connects, says hello and idles; the
//! parent then stops it with SIGSTOP. Its kernel's soft-RoCE keeps acknowledging every send,
//! so only the silence of the peer itself can reveal it. The parent's pending `recv` must fail
//! with `KeepaliveTimeout` within `keepalive + keepalive_timeout` (plus a stated slack) of the
//! stop, with the default options and with short ones. Run in the soft-RoCE VM
//! (`scripts/test`); ignored on hosts without a device.
#![allow(clippy::print_stdout)]

mod common;

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::within;
use tokio_rdma::conn::{ConnectOptions, Listener};
use tokio_rdma::{Error, QpFailure};

/// What detection may take beyond `keepalive + keepalive_timeout`: the connection task's timer
/// wake-up and the teardown that fails the pending receive, on a slow, shared TCG VM.
const SLACK: Duration = Duration::from_secs(4);

const PORT_ENV: &str = "TOKIO_RDMA_DEAD_PEER_PORT";
const KEEPALIVE_ENV: &str = "TOKIO_RDMA_DEAD_PEER_KEEPALIVE_MS";
const TIMEOUT_ENV: &str = "TOKIO_RDMA_DEAD_PEER_TIMEOUT_MS";

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([192, 0, 2, 1], port))
}

/// The child's part (does nothing unless started by `stopped_peer`): connect with `opts`
/// matching the parent's, say hello, then idle until killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn peer_process() {
    let Ok(port) = std::env::var(PORT_ENV) else {
        return;
    };
    let port: u16 = port.parse().expect("port");
    // The parent's keepalive options (milliseconds), so both ends use the same interval.
    let ms = |name: &str| {
        Duration::from_millis(
            std::env::var(name)
                .expect("set by the parent")
                .parse()
                .expect("milliseconds"),
        )
    };
    let opts = ConnectOptions::default()
        .keepalive(Some(ms(KEEPALIVE_ENV)))
        .keepalive_timeout(ms(TIMEOUT_ENV));
    let conn = tokio_rdma::conn::Connection::connect_with(addr(port), opts)
        .await
        .expect("child: connect");
    conn.send(b"hello").await.expect("child: hello");
    // Idle: the connection task keeps sending keepalives until the parent stops us.
    tokio::time::sleep(Duration::from_secs(3600)).await;
}

struct Peer(Child);

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn signal(child: &Child, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .expect("kill")
        .success();
    assert!(ok, "kill {sig}");
}

async fn stopped_peer(port: u16, keepalive: Duration, timeout: Duration) {
    common::init_tracing();
    let opts = ConnectOptions::default()
        .keepalive(Some(keepalive))
        .keepalive_timeout(timeout);
    let listener = Listener::bind_with(addr(port), opts).await.expect("listen");
    let peer = Peer(
        Command::new(std::env::current_exe().expect("test binary"))
            .args(["--ignored", "--exact", "peer_process", "--nocapture"])
            .env(PORT_ENV, port.to_string())
            .env(KEEPALIVE_ENV, keepalive.as_millis().to_string())
            .env(TIMEOUT_ENV, timeout.as_millis().to_string())
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn the peer process"),
    );
    let conn = within(120, "accept the child", listener.accept())
        .await
        .expect("accept");
    let hello = within(60, "hello", conn.recv())
        .await
        .expect("recv")
        .expect("a message");
    assert_eq!(&hello[..], b"hello");
    drop(hello);
    // Let a few keepalives pass both ways: the peer is alive and must not be declared dead.
    let alive_for = keepalive * 2 + Duration::from_millis(500);
    let recv = conn.recv();
    let mut recv = std::pin::pin!(recv);
    assert!(
        tokio::time::timeout(alive_for, recv.as_mut())
            .await
            .is_err(),
        "a live, idle peer is not declared dead"
    );
    signal(&peer.0, "-STOP");
    let stopped = Instant::now();
    let bound = keepalive + timeout + SLACK;
    let res = within(bound.as_secs() + 60, "the stopped peer's verdict", recv).await;
    let took = stopped.elapsed();
    println!(
        "keepalive {keepalive:?}, timeout {timeout:?}: stopped peer found after {took:.1?} \
         (bound {:?} + slack {SLACK:?}): {res:?}",
        keepalive + timeout
    );
    match res {
        Err(Error::QpFailed(QpFailure::KeepaliveTimeout(t))) => assert_eq!(t, timeout),
        other => panic!("a stopped peer: {other:?}"),
    }
    assert!(took <= bound, "found after {took:?}, bound {bound:?}");
    signal(&peer.0, "-CONT");
    drop(peer);
    within(60, "close", conn.close()).await.ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_stopped_peer_is_found_within_the_default_bound() {
    // The defaults: keepalive 10 s, keepalive_timeout 10 s (found after 39 s at 61ac8ac).
    let d = ConnectOptions::default();
    stopped_peer(
        7441,
        d.keepalive.expect("on by default"),
        d.keepalive_timeout,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_stopped_peer_is_found_within_a_short_bound() {
    // 1 s / 5 s: found after 7.0 s at 61ac8ac.
    stopped_peer(7442, Duration::from_secs(1), Duration::from_secs(5)).await;
}
