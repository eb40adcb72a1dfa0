//! The latency loops of `ib_send_lat`, `ib_write_lat`, `ib_read_lat` and `ib_atomic_lat`
//! (perftest_resources.c: `run_iter_lat_send`, `run_iter_lat_write`, `run_iter_lat`), each
//! checking what perftest's traffic must look like.

use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use tokio_rdma::buf::{IoBuf, RemoteToken};
use tokio_rdma::conn::RawConnection;
use tokio_rdma::verbs::{AccessFlags, RegisteredBuffer};

use crate::Res;
use crate::common::{histogram, record};

/// Bytes past the message in the WRITE target: a peer writing more than `-s` bytes lands
/// here (and is caught) instead of failing with a remote access error.
pub(crate) const WRITE_GUARD: usize = 64;
/// What the WRITE target holds before the peer writes (neither 0, perftest's data, nor 1, its
/// first counter).
const SENTINEL: u8 = 0xa5;
/// The value our ATOMIC target starts with.
pub(crate) const ATOMIC_START: u64 = 0x0123_4567_89ab_cdef;
/// perftest's `ATOMIC_ADD_VALUE`; its compare-and-swap compares with 0 and swaps in 0.
const ADD: u64 = 1;

/// `-A`: perftest's atomic operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum AtomicOp {
    #[value(name = "FETCH_AND_ADD")]
    FetchAndAdd,
    #[value(name = "CMP_AND_SWAP")]
    CmpAndSwap,
}

/// The memory the peer targets (WRITE, READ, atomic): registered with its remote right.
pub(crate) fn target(
    conn: &RawConnection,
    len: usize,
    access: AccessFlags,
) -> Res<RegisteredBuffer> {
    Ok(RegisteredBuffer::new(
        conn.pd(),
        len,
        AccessFlags::LOCAL_WRITE | access,
    )?)
}

/// Prepares the WRITE target: `size + WRITE_GUARD` bytes of the sentinel.
pub(crate) fn fill_write_target(t: &mut RegisteredBuffer) {
    t.write_at(0, &vec![SENTINEL; t.len()]);
}

/// The send_lat ping-pong: the client SENDs first; each side answers every message with one
/// of its own, `iters` each. Every message the peer sends must be `size` bytes and carry the
/// same bytes (perftest sends the same random buffer each time). Each of our sends is awaited
/// together with the receive of the answer; the samples are those round trips.
pub(crate) async fn send_lat(
    conn: &RawConnection,
    recvs: &mut [std::pin::Pin<Box<tokio_rdma::ops::Recv<RegisteredBuffer>>>],
    size: usize,
    iters: u64,
    client: bool,
    step: Duration,
) -> Res<Histogram<u64>> {
    let mut h = histogram();
    let mut tx = RegisteredBuffer::new(conn.pd(), size, AccessFlags::LOCAL_WRITE)?;
    tx.write_at(0, &vec![0x5a; size]);
    let mut tx = Some(tx);
    let mut first: Option<Vec<u8>> = None;
    let qp = conn.qp();
    let mut next = 0usize; // which posted receive the next message lands in (FIFO)
    let mut received = 0u64;
    if !client {
        let (r, rbuf) = within(
            step,
            "perftest's first send_lat message",
            recvs[next].as_mut(),
        )
        .await?;
        check_message(r, &rbuf, size, received, &mut first)?;
        received += 1;
        recvs[next] = repost(conn, rbuf);
        next = (next + 1) % recvs.len();
    }
    for k in 0..iters {
        let buf = tx.take().expect("send buffer");
        let t0 = Instant::now();
        let buf = if received < iters {
            let ((s, buf), (r, rbuf)) = within(step, "a send_lat round trip", async {
                tokio::join!(qp.send(buf.slice(0..size)), recvs[next].as_mut())
            })
            .await?;
            record(&mut h, t0.elapsed());
            s.map_err(|e| format!("send {k}: {e}"))?;
            check_message(r, &rbuf, size, received, &mut first)?;
            received += 1;
            recvs[next] = repost(conn, rbuf);
            next = (next + 1) % recvs.len();
            buf
        } else {
            // The server's last answer: nothing comes after it.
            let (s, buf) = within(step, "the last send", qp.send(buf.slice(0..size))).await?;
            s.map_err(|e| format!("send {k}: {e}"))?;
            buf
        };
        tx = Some(buf.into_inner());
    }
    Ok(h)
}

fn repost(
    conn: &RawConnection,
    buf: RegisteredBuffer,
) -> std::pin::Pin<Box<tokio_rdma::ops::Recv<RegisteredBuffer>>> {
    let mut r = Box::pin(conn.qp().recv(buf));
    r.as_mut().start();
    r
}

fn check_message(
    res: tokio_rdma::Result<tokio_rdma::ops::RecvInfo>,
    buf: &RegisteredBuffer,
    size: usize,
    k: u64,
    first: &mut Option<Vec<u8>>,
) -> Res<()> {
    let info = res.map_err(|e| format!("receive {k}: {e}"))?;
    if info.len != size || info.imm.is_some() {
        return Err(format!(
            "message {k} is {} bytes{}; -s says {size}",
            info.len,
            if info.imm.is_some() {
                " with immediate data"
            } else {
                ""
            }
        )
        .into());
    }
    let got = &buf.as_slice().expect("a local buffer")[..size];
    match first {
        None => *first = Some(got.to_vec()),
        Some(f) if f[..] != *got => {
            let at = f.iter().zip(got).position(|(a, b)| a != b).unwrap_or(0);
            return Err(format!("message {k} differs from message 0 at byte {at}: perftest sends the same buffer every time").into());
        }
        Some(_) => {}
    }
    Ok(())
}

/// The write_lat ping-pong: each side RDMA WRITEs `size` bytes into the other's target, the
/// last byte being its iteration counter (1, 2, ... as a byte), and waits until the peer's
/// counter appears in its own target's last byte. The SERVER writes first. The peer's bytes
/// before the counter are zeros (perftest's write_lat buffer is zeroed); a counter anywhere
/// else or a byte past the message changed means the peer's `-s` differs from ours.
pub(crate) async fn write_lat(
    conn: &RawConnection,
    target: &RegisteredBuffer,
    peer: RemoteToken,
    size: usize,
    iters: u64,
    client: bool,
    step: Duration,
) -> Res<Histogram<u64>> {
    let mut h = histogram();
    let mut src = RegisteredBuffer::new(conn.pd(), size, AccessFlags::LOCAL_WRITE)?;
    src.write_at(0, &vec![0u8; size]);
    let mut src = Some(src);
    let qp = conn.qp();
    let mut posted_at: Option<Instant> = None;
    for k in 1..=iters {
        if client || k > 1 {
            // The peer's write k (client) or k-1 (server)...
            let want = if client { k } else { k - 1 };
            wait_counter(target, size, want, step).await?;
            if let Some(t0) = posted_at.take() {
                record(&mut h, t0.elapsed());
            }
        }
        let mut buf = src.take().expect("source buffer");
        buf.write_at(size - 1, &[k as u8]);
        posted_at = Some(Instant::now());
        let (res, buf) = within(step, "an RDMA WRITE", qp.write(buf, peer)).await?;
        res.map_err(|e| format!("RDMA WRITE {k}: {e}"))?;
        src = Some(buf);
    }
    if !client {
        wait_counter(target, size, iters, step).await?;
        if let Some(t0) = posted_at.take() {
            record(&mut h, t0.elapsed());
        }
    }
    // The whole target: zeros, the last counter, the guard untouched.
    let got = target.to_vec();
    if let Some(at) = got[..size - 1].iter().position(|&b| b != 0) {
        return Err(format!(
            "byte {at} of the peer's writes is {:#04x}; perftest writes zeros before its counter",
            got[at]
        )
        .into());
    }
    if got[size - 1] != iters as u8 {
        return Err(format!(
            "the last counter is {}, want {}",
            got[size - 1],
            iters as u8
        )
        .into());
    }
    check_guard(&got, size)?;
    Ok(h)
}

fn check_guard(got: &[u8], size: usize) -> Res<()> {
    if let Some(at) = got[size..].iter().position(|&b| b != SENTINEL) {
        return Err(format!(
            "the peer wrote byte {} (past the {size} bytes -s says): its messages are longer",
            size + at
        )
        .into());
    }
    Ok(())
}

/// Spins until the target's last message byte is `k` as a byte. While waiting for the first
/// counter it also checks that the peer's write did not land elsewhere (a different `-s`).
async fn wait_counter(target: &RegisteredBuffer, size: usize, k: u64, step: Duration) -> Res<()> {
    let want = k as u8;
    let start = Instant::now();
    let mut spins = 0u32;
    let mut b = [0u8; 1];
    loop {
        target.read_at(size - 1, &mut b);
        if b[0] == want {
            return Ok(());
        }
        spins = spins.wrapping_add(1);
        if spins % 256 == 0 {
            if k == 1 {
                let got = target.to_vec();
                if let Some(at) = got[..size - 1].iter().position(|&x| x == 1) {
                    return Err(format!(
                        "perftest's first write ended at byte {at}: its messages are {} bytes, -s says {size}",
                        at + 1
                    )
                    .into());
                }
                check_guard(&got, size)?;
            }
            if start.elapsed() > step {
                return Err(format!("the peer's RDMA WRITE {k} did not arrive within {step:?} (its last byte is {:#04x})", b[0]).into());
            }
            tokio::task::yield_now().await;
        } else {
            std::hint::spin_loop();
        }
    }
}

/// The read_lat client: `iters` RDMA READs of `size` bytes of the peer's buffer, one at a time.
/// perftest's read_lat buffer is random and never changes: every read must return the same
/// bytes.
pub(crate) async fn read_lat(
    conn: &RawConnection,
    peer: RemoteToken,
    size: usize,
    iters: u64,
    step: Duration,
) -> Res<Histogram<u64>> {
    let mut h = histogram();
    let mut buf = Some(RegisteredBuffer::new(
        conn.pd(),
        size,
        AccessFlags::LOCAL_WRITE,
    )?);
    let mut first: Option<Vec<u8>> = None;
    for k in 0..iters {
        let b = buf.take().expect("read buffer");
        let t0 = Instant::now();
        let (res, b) = within(step, "an RDMA READ", conn.qp().read(b, peer)).await?;
        record(&mut h, t0.elapsed());
        res.map_err(|e| format!("RDMA READ {k}: {e}"))?;
        let got = b.as_slice().expect("a local buffer");
        match &first {
            None => first = Some(got.to_vec()),
            Some(f) if f[..] != *got => {
                return Err(format!("RDMA READ {k} returned other bytes than READ 0: perftest's buffer does not change").into());
            }
            Some(_) => {}
        }
        buf = Some(b);
    }
    Ok(h)
}

/// The atomic_lat client: `iters` fetch-and-adds of 1 (or compare-and-swaps of 0 with 0) on the
/// peer's 8 bytes. Fetch-and-add must return consecutive values (nobody else touches them);
/// compare-and-swap always the same one.
pub(crate) async fn atomic_lat(
    conn: &RawConnection,
    peer: RemoteToken,
    op: AtomicOp,
    iters: u64,
    step: Duration,
) -> Res<(Histogram<u64>, u64, u64)> {
    let mut h = histogram();
    let mut buf = Some(RegisteredBuffer::new(
        conn.pd(),
        8,
        AccessFlags::LOCAL_WRITE,
    )?);
    let mut first = None;
    let mut last = 0;
    for k in 0..iters {
        let b = buf.take().expect("atomic buffer");
        let t0 = Instant::now();
        let (res, b) = match op {
            AtomicOp::FetchAndAdd => {
                within(step, "a fetch-and-add", conn.qp().fetch_add(b, peer, ADD)).await?
            }
            AtomicOp::CmpAndSwap => {
                within(
                    step,
                    "a compare-and-swap",
                    conn.qp().compare_swap(b, peer, 0, 0),
                )
                .await?
            }
        };
        record(&mut h, t0.elapsed());
        let v = res.map_err(|e| format!("atomic {k}: {e}"))?;
        let f = *first.get_or_insert(v);
        let want = match op {
            AtomicOp::FetchAndAdd => f.wrapping_add(k * ADD),
            AtomicOp::CmpAndSwap => f,
        };
        if v != want {
            return Err(format!(
                "atomic {k} returned {v:#x}, want {want:#x} ({op:?} on memory only we change)"
            )
            .into());
        }
        last = v;
        buf = Some(b);
    }
    Ok((h, first.unwrap_or(0), last))
}

/// What our atomic target must hold after the peer's `iters` operations.
pub(crate) fn atomic_expected(op: AtomicOp, iters: u64) -> u64 {
    match op {
        AtomicOp::FetchAndAdd => ATOMIC_START.wrapping_add(iters * ADD),
        AtomicOp::CmpAndSwap => ATOMIC_START, // compare 0 never matches
    }
}

async fn within<F: std::future::Future>(step: Duration, what: &str, f: F) -> Res<F::Output> {
    tokio::time::timeout(step, f)
        .await
        .map_err(|_| format!("{what}: nothing within {step:?}").into())
}
