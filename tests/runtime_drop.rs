//! Device tests of an endpoint whose runtime shut down while its connections and queue pairs
//! were still in use: used from another runtime afterwards, every operation fails with
//! `QpFailure::DriverStopped` within a bound, pending ones included, and `close()` returns;
//! nothing hangs (at 61ac8ac `send`/`recv` never woke and `close()` was still pending after
//! 15 s). Run in the soft-RoCE VM (`scripts/test`); ignored on hosts without a device.
#![allow(clippy::print_stdout)]

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::{all_access, connect_qps};
use tokio_rdma::conn::{ConnectOptions, Connection};
use tokio_rdma::driver::{AsyncQp, QpOptions};
use tokio_rdma::verbs::{AccessFlags, RegisteredBuffer};
use tokio_rdma::{Endpoint, Error, QpFailure};

/// How long each operation may take to fail on the second runtime (it polls the flush of its
/// queue pair itself; generous for a slow, shared TCG VM).
const BOUND: Duration = Duration::from_secs(10);

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

fn stopped<T: std::fmt::Debug>(what: &str, r: Result<T, Error>) {
    match r {
        Err(Error::QpFailed(QpFailure::DriverStopped)) => {}
        other => panic!("{what} after the runtime was dropped: {other:?}"),
    }
}

struct Leftovers {
    ep: Endpoint,
    client: Connection,
    server: Connection,
    a: AsyncQp,
    b: AsyncQp,
}

#[test]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
fn connections_and_queue_pairs_outliving_their_runtime_fail_fast() {
    let first = runtime();
    let left = first.block_on(async {
        let ep = Endpoint::open(&common::device_name()).expect("endpoint");
        let addr = SocketAddr::from(([192, 0, 2, 1], 7451));
        let listener = ep
            .listen_with(addr, ConnectOptions::default())
            .await
            .expect("listen");
        // The client names the server as a string, as `TcpStream::connect` takes one.
        let (c, s) = tokio::join!(
            ep.connect("192.0.2.1:7451", ConnectOptions::default()),
            listener.accept()
        );
        let (client, server) = (c.expect("connect"), s.expect("accept"));
        client.send(b"before").await.expect("send");
        assert_eq!(&server.recv().await.unwrap().unwrap()[..], b"before");
        // Two queue pairs on the endpoint's driver, connected to each other.
        let pd = tokio_rdma::verbs::ProtectionDomain::new(ep.driver().context()).unwrap();
        let a = ep.driver().create_qp(&pd, QpOptions::default()).unwrap();
        let b = ep.driver().create_qp(&pd, QpOptions::default()).unwrap();
        connect_qps(ep.driver().context(), a.verbs(), b.verbs(), all_access());
        Leftovers {
            ep,
            client,
            server,
            a,
            b,
        }
    });
    drop(first);

    let second = runtime();
    second.block_on(async {
        let Leftovers {
            ep,
            client,
            server,
            a,
            b,
        } = left;
        assert!(!ep.driver().is_running());
        let t = Instant::now();
        let r = tokio::time::timeout(BOUND, client.recv())
            .await
            .expect("recv must not hang");
        stopped("recv", r.map(|m| m.map(|m| m.len())));
        let r = tokio::time::timeout(BOUND, server.send(b"after"))
            .await
            .expect("send must not hang");
        stopped("send", r);
        let rx = RegisteredBuffer::new(a.verbs().pd(), 64, AccessFlags::LOCAL_WRITE).unwrap();
        let (r, _rx) = tokio::time::timeout(BOUND, b.recv(rx))
            .await
            .expect("a queue pair's recv must not hang");
        stopped("AsyncQp::recv", r);
        let r = tokio::time::timeout(BOUND, client.close())
            .await
            .expect("close must not hang");
        stopped("close", r);
        tokio::time::timeout(BOUND, a.close())
            .await
            .expect("AsyncQp::close must not hang")
            .unwrap();
        println!(
            "after the runtime was dropped: recv, send, AsyncQp::recv and both closes failed or \
             returned within {:.1?}",
            t.elapsed()
        );
        drop((client, server, a, b, ep));
    });
}
