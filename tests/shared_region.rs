//! One `SharedRegion` granted on several connections (issue 24: one table, many clients, no
//! copy per client): every client reads the same memory through its own grant, the owner's
//! writes are seen by all, revoking one grant leaves the others working, and a token of one
//! connection is useless on another. Runs in the soft-RoCE VM (scripts/test).
#![allow(clippy::print_stdout)]

mod common;

use std::net::SocketAddr;

use common::within;
use tokio_rdma::buf::{RemoteAccess, RemoteToken, SharedRegion};
use tokio_rdma::conn::{Connection, Listener};

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([192, 0, 2, 1], port))
}

const LEN: usize = 64 << 10;

/// Reads 4 KiB at `offset` of `token` on `conn`.
async fn read(conn: &Connection, token: &RemoteToken, offset: u64) -> tokio_rdma::Result<Vec<u8>> {
    let buf = conn.pool()?.acquire(4096).await?;
    let (res, buf) = within(
        60,
        "read",
        conn.read(buf, token.slice(offset..offset + 4096)?),
    )
    .await;
    res.map(|()| buf[..].to_vec())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn one_region_granted_on_three_connections_each_revocable_and_isolated() {
    common::init_tracing();
    let listener = Listener::bind(addr(7460)).await.expect("bind");
    let mut pairs = Vec::new();
    for _ in 0..3 {
        let (c, s) = tokio::join!(Connection::connect(addr(7460)), listener.accept());
        pairs.push((c.expect("connect"), s.expect("accept")));
    }
    // The clients' pools (for the reads' local buffers) first, so the count below is the
    // grants' alone.
    for (c, _) in &pairs {
        c.pool().expect("pool");
    }
    let region = SharedRegion::new(LEN);
    let first = common::pattern(LEN, 41);
    region.write_at(0, &first);
    let mrs_before = common::mr_count();
    let mut grants: Vec<_> = pairs
        .iter()
        .map(|(_, s)| {
            s.grant_shared(&region, 0..LEN, RemoteAccess::READ)
                .expect("grant_shared")
        })
        .collect();
    assert_eq!(region.grants(), 3);
    assert_eq!(
        common::mr_count(),
        mrs_before + 3,
        "one registration per connection"
    );
    let tokens: Vec<RemoteToken> = grants.iter().map(|g| g.token()).collect();
    assert!(
        tokens.iter().all(|t| t.addr() == tokens[0].addr()),
        "the same memory, not a copy per connection"
    );
    assert!(
        tokens[0].rkey() != tokens[1].rkey() && tokens[1].rkey() != tokens[2].rkey(),
        "a key per connection"
    );
    for (i, (c, _)) in pairs.iter().enumerate() {
        assert!(read(c, &tokens[i], 8192).await.expect("read") == first[8192..12288]);
    }

    // The owner's write is seen through every grant.
    let second = common::pattern(4096, 42);
    region.write_at(8192, &second);
    for (i, (c, _)) in pairs.iter().enumerate() {
        assert!(read(c, &tokens[i], 8192).await.expect("read") == second);
    }

    // Revoking the first grant: its client's next read fails; the others' keep working.
    drop(grants.remove(0));
    assert_eq!(region.grants(), 2);
    let err = read(&pairs[0].0, &tokens[0], 0).await.expect_err("revoked");
    println!("read after revocation: {err}");
    assert!(read(&pairs[1].0, &tokens[1], 0).await.expect("read") == first[..4096]);

    // Connection 2 presenting connection 1's live key: refused by the device (another
    // protection domain), while connection 1 itself still reads.
    let err = read(&pairs[2].0, &tokens[1], 0)
        .await
        .expect_err("a token of another connection");
    println!("read with another connection's token: {err}");
    assert!(read(&pairs[1].0, &tokens[1], 4096).await.expect("read") == first[4096..8192]);

    // Rights that were not offered or cannot apply are refused before registering.
    let on_demand = pairs[1].1.grant_shared(
        &region,
        0..LEN,
        RemoteAccess::READ | RemoteAccess::ON_DEMAND,
    );
    assert!(matches!(
        on_demand,
        Err(tokio_rdma::Error::InvalidArgument(_))
    ));
    let outside = pairs[1]
        .1
        .grant_shared(&region, 0..LEN + 1, RemoteAccess::READ);
    assert!(matches!(
        outside,
        Err(tokio_rdma::Error::InvalidArgument(_))
    ));

    drop(grants);
    assert_eq!(region.grants(), 0);
    assert_eq!(
        common::mr_count(),
        mrs_before,
        "every grant's registration is gone"
    );
    drop(pairs);
}
