//! Device tests of rendezvous: large messages go as a descriptor the receiver RDMA READs
//! straight into its destination. Checked: the bytes (16 MiB, and message order around
//! eager messages), zero payload copies on both sides (counted), `recv_into` into the
//! caller's buffer (a plain `Vec` and a buffer of the connection's pool) and its "too small"
//! refusal that leaves the message queued, a send dropped while its registration runs off
//! the runtime (never sent, its registration released), a send dropped after its descriptor
//! went out (the message still arrives whole and its memory is released), a `recv_into`
//! dropped while the device writes into its buffer (the next receive gets the message), end of
//! stream after a rendezvous message, a peer without rendezvous (chunked instead), an empty
//! message under a threshold of 0 (sent plainly), and that
//! every registration is gone afterwards (`rdma resource`).
#![allow(clippy::print_stdout)]

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::within;
use tokio_rdma::Endpoint;
use tokio_rdma::buf::{PoolConfig, SizeClass};
use tokio_rdma::conn::{ConnectOptions, Connection};

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([192, 0, 2, 1], port))
}

const BIG: usize = 16 << 20;

fn opts() -> ConnectOptions {
    ConnectOptions::default()
        .max_message_size(32 << 20)
        .recv_budget(64 << 20)
        .user_pool(PoolConfig::default().classes([SizeClass::new(BIG, 2)]))
}

async fn pair(ep: &Endpoint, port: u16, o: ConnectOptions) -> (Connection, Connection) {
    let listener = ep.listen_with(addr(port), o.clone()).await.expect("listen");
    let (c, s) = tokio::join!(ep.connect(addr(port), o), listener.accept());
    (c.expect("connect"), s.expect("accept"))
}

fn mrs() -> u64 {
    common::resource_counts().get("mr").copied().unwrap_or(0)
}

#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn sixteen_mib_by_rendezvous_with_zero_copies_and_order_kept() {
    common::init_tracing();
    let ep = Endpoint::open(&common::device_name()).expect("endpoint");
    let (client, server) = pair(&ep, 7431, opts()).await;
    assert!(client.params().rendezvous && server.params().rendezvous);
    let mrs_before = mrs();
    let pattern = common::pattern(BIG, 3);

    // Eager, rendezvous (from a pool buffer), eager: delivered in that order.
    let mut buf = client.pool().unwrap().acquire(BIG).await.unwrap();
    buf.set_len(BIG);
    buf.copy_from_slice(&pattern);
    let send = async {
        client.send(b"before").await?;
        client.send_buf(buf).await?;
        client.send(b"after").await
    };
    let recv = async {
        let a = server.recv().await.unwrap().unwrap();
        let big = server.recv().await.unwrap().unwrap();
        let b = server.recv().await.unwrap().unwrap();
        (a.to_vec(), big, b.to_vec())
    };
    let (sent, (a, big, b)) = within(120, "16 MiB by rendezvous", async {
        tokio::join!(send, recv)
    })
    .await;
    sent.expect("sends");
    assert_eq!(&a[..], b"before");
    assert_eq!(big.len(), BIG);
    assert!(big[..] == pattern[..], "16 MiB intact");
    assert_eq!(&b[..], b"after");
    drop(big);
    let (cs, ss) = (client.stats(), server.stats());
    println!(
        "client: zero-copy {} B, copied {} B, rendezvous sent {}; server: fetched {} B, \
         copied {} B, rendezvous received {}",
        cs.send_bytes_zero_copy,
        cs.send_bytes_copied,
        cs.protocol.rendezvous_sent,
        ss.recv_bytes_fetched,
        ss.recv_bytes_copied,
        ss.protocol.rendezvous_received
    );
    assert_eq!(cs.send_bytes_copied, 0, "the sender copied nothing");
    assert_eq!(cs.send_bytes_zero_copy, BIG as u64);
    assert_eq!(ss.recv_bytes_copied, 0, "the receiver copied nothing");
    assert_eq!(ss.recv_bytes_fetched, BIG as u64);
    assert_eq!(
        (cs.protocol.rendezvous_sent, ss.protocol.rendezvous_received),
        (1, 1)
    );

    // recv_into a plain Vec (registered for the read) and into a pool buffer (used as is).
    for round in 0..2 {
        let bytes = bytes::Bytes::from(common::pattern(BIG, 10 + round));
        let want = bytes.clone();
        let into = async {
            if round == 0 {
                let (got, v) = server.recv_into(vec![0u8; BIG]).await;
                (got.expect("recv_into"), v[..].to_vec())
            } else {
                let b = server.pool().unwrap().acquire(BIG).await.unwrap();
                let (got, b) = server.recv_into(b).await;
                (got.expect("recv_into"), b[..].to_vec())
            }
        };
        let (sent, (len, got)) = within(120, "recv_into", async {
            tokio::join!(client.send_bytes(bytes), into)
        })
        .await;
        sent.expect("send_bytes of heap Bytes: registered for the peer's read");
        assert_eq!(len, Some(BIG));
        assert!(got[..] == want[..], "round {round}: bytes intact");
    }
    let ss = server.stats();
    assert_eq!(ss.recv_bytes_copied, 0, "recv_into read in place");
    assert_eq!(ss.recv_bytes_fetched, 3 * BIG as u64);

    // Too small: refused, the message stays queued for a larger buffer.
    let bytes = bytes::Bytes::from(common::pattern(BIG, 20));
    let want = bytes.clone();
    let small = async {
        let (got, v) = server.recv_into(vec![0u8; 4096]).await;
        let err = got.expect_err("too small");
        assert_eq!(v.len(), 4096, "the buffer comes back");
        println!("too small: {err}");
        server.recv().await.unwrap().unwrap()
    };
    let (sent, msg) = within(120, "too small", async {
        tokio::join!(client.send_bytes(bytes), small)
    })
    .await;
    sent.expect("send");
    assert!(msg[..] == want[..]);
    drop(msg);

    client.close().await.expect("close");
    assert!(server.recv().await.expect("end of stream").is_none());
    server.close().await.expect("close");
    drop((client, server));
    tokio::time::sleep(Duration::from_millis(200)).await;
    println!("memory regions before {mrs_before}, after {}", mrs());
    assert!(
        mrs() <= mrs_before,
        "every per-message registration is gone"
    );
}

#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn dropped_futures_neither_lose_nor_leak() {
    common::init_tracing();
    let ep = Endpoint::open(&common::device_name()).expect("endpoint");
    let (client, server) = pair(&ep, 7432, opts()).await;
    let mrs_before = mrs();

    // Progress is judged by what only a rendezvous message moves: a descriptor posted adds
    // the message's length to `send_bytes_zero_copy`, a `recv_into` whose read started has
    // its buffer registered (one more memory region). Not `protocol.sends` / `.receives`:
    // they count control messages too (credit returns, keepalives every 10 s).
    let zero_copy = || client.stats().send_bytes_zero_copy;

    // A send dropped after one poll: its registration of 16 MiB runs off the runtime, so
    // usually the descriptor is not out yet and the message is never sent; if the
    // registration already finished within that poll, the descriptor went out and the
    // message must arrive whole. Either way the next message sent follows it in order, and
    // nothing is lost or duplicated (checked by content below).
    let first = bytes::Bytes::from(common::pattern(BIG, 4));
    let zc = zero_copy();
    {
        let send = client.send_bytes(first.clone());
        tokio::pin!(send);
        assert!(futures::poll!(send.as_mut()).is_pending(), "not read yet");
    }
    let first_went_out = zero_copy() > zc;
    println!("send dropped after one poll: descriptor out {first_went_out}");
    if first_went_out {
        let got = within(120, "first message", server.recv())
            .await
            .unwrap()
            .unwrap();
        assert!(got[..] == first[..], "a descriptor out is delivered whole");
    } else {
        // The registration (moved to the blocking pool with a handle of the bytes) finishes
        // there and is dropped, region first: once `first` is the bytes' only handle, it is
        // gone. (The region count alone cannot tell "not registered yet" from "released".)
        let release = async {
            while !first.is_unique() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        within(60, "the dropped send's registration finished", release).await;
        assert!(
            mrs() <= mrs_before,
            "the dropped send's registration released"
        );
    }

    // A send dropped once its descriptor is out: the message still arrives whole, and the
    // memory is released when the peer read it.
    let pattern = bytes::Bytes::from(common::pattern(BIG, 5));
    {
        let send = client.send_bytes(pattern.clone());
        tokio::pin!(send);
        // Polled until the descriptor is out (the registration runs off the runtime first;
        // credits are free); then the future is dropped.
        let zc = zero_copy();
        let out = async {
            while zero_copy() == zc {
                assert!(futures::poll!(send.as_mut()).is_pending(), "not read yet");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        };
        within(60, "the second message's descriptor out", out).await;
    }
    let got = within(120, "message of a dropped send", server.recv())
        .await
        .unwrap()
        .unwrap();
    assert!(got[..] == pattern[..], "whole despite the dropped send");
    drop(got);
    // The receiver's region went with the read, the sender's goes when `Fetched` arrives.
    let released = async {
        while mrs() > mrs_before {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    within(60, "the dropped send's memory released once read", released).await;

    // A recv_into dropped while the device writes into its buffer: the next recv gets the
    // message (copied once, counted).
    let pattern = bytes::Bytes::from(common::pattern(BIG, 6));
    let (sent, ()) = {
        let send = client.send_bytes(pattern.clone());
        tokio::pin!(send);
        // Driven until its descriptor is out (its registration runs off the runtime first).
        let zc = zero_copy();
        let out = async {
            while zero_copy() == zc {
                assert!(futures::poll!(send.as_mut()).is_pending(), "not read yet");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        };
        within(60, "the third message's descriptor out", out).await;
        let registered = mrs();
        let dropped = async {
            let into = server.recv_into(vec![0u8; BIG]);
            tokio::pin!(into);
            // Polled until its read is under way: the poll that takes the descriptor registers
            // the buffer (inline) and posts the read; a 16 MiB read takes far longer than that.
            loop {
                assert!(futures::poll!(into.as_mut()).is_pending(), "not done yet");
                if mrs() > registered {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        };
        within(120, "dropped recv_into", async {
            tokio::join!(send.as_mut(), dropped)
        })
        .await
    };
    sent.expect("the send completes: the read finished into the dropped buffer");
    let before = server.stats().recv_bytes_copied;
    let got = within(60, "next recv", server.recv())
        .await
        .unwrap()
        .unwrap();
    assert!(got[..] == pattern[..], "delivered to the next receive");
    println!(
        "after a dropped recv_into: copied {} B",
        server.stats().recv_bytes_copied - before
    );
    drop(got);

    client.close().await.expect("close");
    assert!(server.recv().await.unwrap().is_none());
    drop((client, server));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(mrs() <= mrs_before, "no registration leaked");
}

#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn without_rendezvous_on_one_side_large_messages_are_chunked() {
    common::init_tracing();
    let ep = Endpoint::open(&common::device_name()).expect("endpoint");
    let listener = ep
        .listen_with(addr(7433), opts().rendezvous_threshold(None))
        .await
        .expect("listen");
    let (c, s) = tokio::join!(ep.connect(addr(7433), opts()), listener.accept());
    let (client, server) = (c.unwrap(), s.unwrap());
    assert!(!client.params().rendezvous);
    let pattern = bytes::Bytes::from(common::pattern(1 << 20, 9));
    let (sent, got) = within(120, "chunked", async {
        tokio::join!(client.send_bytes(pattern.clone()), server.recv())
    })
    .await;
    sent.unwrap();
    let got = got.unwrap().unwrap();
    assert!(got[..] == pattern[..]);
    assert_eq!(client.stats().protocol.rendezvous_sent, 0);
    assert!(server.stats().recv_bytes_copied > 0, "reassembled");
}

/// With `rendezvous_threshold(Some(0))` every `send_bytes` goes by rendezvous, except an empty
/// one: there is nothing to register (`ibv_reg_mr` of zero bytes fails), so it goes as a plain
/// send and arrives as an empty message. Until a2b9fc3 it failed with a registration error.
#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn an_empty_message_is_sent_plainly_even_when_everything_goes_by_rendezvous() {
    common::init_tracing();
    let ep = Endpoint::open(&common::device_name()).expect("endpoint");
    let (client, server) = pair(&ep, 7434, opts().rendezvous_threshold(Some(0))).await;
    assert!(client.params().rendezvous);
    // A plain send resolves once handed to the device, without the receiver.
    within(60, "empty send", client.send_bytes(bytes::Bytes::new()))
        .await
        .expect("an empty send_bytes");
    let got = within(60, "empty message", server.recv()).await;
    assert_eq!(got.unwrap().expect("a message").len(), 0);
    // A non-empty one still goes by rendezvous.
    let (sent, got) = within(60, "one byte", async {
        tokio::join!(
            client.send_bytes(bytes::Bytes::from_static(&[7])),
            server.recv()
        )
    })
    .await;
    sent.unwrap();
    assert_eq!(&got.unwrap().unwrap()[..], &[7]);
    assert_eq!(client.stats().protocol.rendezvous_sent, 1);
}
