//! `--engine verbs`: the latency loops on the crate's verbs layer (post, then busy-poll the CQ
//! in the same thread, as perftest does), without the async driver. It measures what the
//! device and the bindings cost, so that the difference to the async engine is the driver's.

use tokio_rdma::verbs::{
    CompletionQueue, QueuePair, RecvWr, RegisteredBuffer, SendOp, SendWr, WcBatch, WorkCompletion,
};

use crate::args::{Test, TestConfig};
use crate::setup::{Res, Side};

const SEND_ID: u64 = 1;
const RECV_ID: u64 = 2;

/// Polls at most one completion (`batch` has capacity 1, so none is dropped).
fn poll(cq: &CompletionQueue, batch: &mut WcBatch) -> Res<Option<WorkCompletion>> {
    match cq.poll(batch)?.first() {
        Some(wc) => {
            wc.result()?;
            Ok(Some(*wc))
        }
        None => Ok(None),
    }
}

fn send_wr<'a>(op: SendOp, sge: &'a [tokio_rdma::verbs::Sge], inline: bool) -> SendWr<'a> {
    SendWr::new(SEND_ID, op, sge).inline(inline)
}

fn post_send(qp: &QueuePair, wr: SendWr<'_>) -> Res<()> {
    // SAFETY: every SGE names a `RegisteredBuffer` that outlives the loop, and the loop waits
    // for this request's completion before the buffer is touched or posted again.
    unsafe { qp.post_send(&[wr])? };
    Ok(())
}

fn post_recv(qp: &QueuePair, buf: &RegisteredBuffer, size: usize) -> Res<()> {
    let sge = [buf.sge(0..size)];
    // SAFETY: as above; the receive buffer is not read until its completion is polled.
    unsafe { qp.post_recv(&[RecvWr::new(RECV_ID, &sge)])? };
    Ok(())
}

fn last_byte(buf: &RegisteredBuffer, off: usize) -> u8 {
    let mut b = [0u8; 1];
    buf.read_at(off, &mut b);
    b[0]
}

/// Runs the client's iterations; returns one sample (us, RTT halved where perftest halves it)
/// per iteration, warmup included (the caller drops those).
pub fn client(
    side: &Side,
    cfg: &TestConfig,
    size: usize,
    mut mark: impl FnMut(usize),
) -> Res<Vec<f64>> {
    let (qp, cq) = &side.vqps[0];
    let total = cfg.warmup + cfg.iters;
    let inline = cfg.inline > 0 && size <= qp.caps().max_inline_data as usize;
    let mut batch = WcBatch::with_capacity(1);
    let mut src =
        RegisteredBuffer::new(&side.pd, size, tokio_rdma::verbs::AccessFlags::LOCAL_WRITE)?;
    let rx = RegisteredBuffer::new(&side.pd, size, tokio_rdma::verbs::AccessFlags::LOCAL_WRITE)?;
    let remote = side.remote[0];
    if cfg.test == Test::SendLat {
        post_recv(qp, &rx, size)?;
    }
    let mut clock = crate::run::Stamps::start(total);
    for k in 0..total {
        mark(k);
        match cfg.test {
            Test::SendLat => {
                let sge = [src.sge(0..size)];
                post_send(qp, send_wr(SendOp::Send, &sge, inline))?;
                let (mut sent, mut got) = (false, false);
                while !(sent && got) {
                    if let Some(wc) = poll(cq, &mut batch)? {
                        match wc.wr_id() {
                            SEND_ID => sent = true,
                            _ => got = true,
                        }
                    }
                }
                if k + 1 < total {
                    post_recv(qp, &rx, size)?;
                }
            }
            Test::WriteLat => {
                let m = crate::run::marker(k);
                src.write_at(size - 1, &[m]);
                let sge = [src.sge(0..size)];
                let op = SendOp::Write {
                    remote_addr: remote.addr(),
                    rkey: remote.rkey(),
                };
                post_send(qp, send_wr(op, &sge, inline))?;
                let (mut sent, mut got) = (false, false);
                while !(sent && got) {
                    if !sent {
                        sent = poll(cq, &mut batch)?.is_some();
                    }
                    if !got {
                        got = last_byte(&side.exposed[0], size - 1) == m;
                    }
                }
            }
            Test::ReadLat => {
                let sge = [rx.sge(0..size)];
                let op = SendOp::Read {
                    remote_addr: remote.addr(),
                    rkey: remote.rkey(),
                };
                post_send(qp, send_wr(op, &sge, false))?;
                while poll(cq, &mut batch)?.is_none() {}
            }
            _ => return Err("the verbs engine runs latency tests only".into()),
        }
        clock.stamp();
    }
    let mut out = Vec::with_capacity(total);
    clock.samples(0, crate::run::lat_scale(cfg.test), &mut out);
    Ok(out)
}

/// The server's part of send_lat / write_lat (nothing for read_lat). `ready` is called once
/// the server can take the first message.
pub async fn server(
    side: &Side,
    cfg: &TestConfig,
    size: usize,
    ready: impl AsyncFnOnce() -> Res<()>,
) -> Res<()> {
    let (qp, cq) = &side.vqps[0];
    let total = cfg.warmup + cfg.iters;
    let inline = cfg.inline > 0 && size <= qp.caps().max_inline_data as usize;
    let mut batch = WcBatch::with_capacity(1);
    let mut src =
        RegisteredBuffer::new(&side.pd, size, tokio_rdma::verbs::AccessFlags::LOCAL_WRITE)?;
    let rx = RegisteredBuffer::new(&side.pd, size, tokio_rdma::verbs::AccessFlags::LOCAL_WRITE)?;
    let remote = side.remote[0];
    match cfg.test {
        Test::SendLat => {
            post_recv(qp, &rx, size)?;
            ready().await?;
            let sge = [src.sge(0..size)];
            for k in 0..total {
                loop {
                    if let Some(wc) = poll(cq, &mut batch)? {
                        if wc.wr_id() == RECV_ID {
                            break;
                        }
                    }
                }
                if k + 1 < total {
                    post_recv(qp, &rx, size)?;
                }
                post_send(qp, send_wr(SendOp::Send, &sge, inline))?;
            }
            // The last send's completion.
            loop {
                if let Some(wc) = poll(cq, &mut batch)? {
                    if wc.wr_id() == SEND_ID {
                        break;
                    }
                }
            }
        }
        Test::WriteLat => {
            ready().await?;
            let op = SendOp::Write {
                remote_addr: remote.addr(),
                rkey: remote.rkey(),
            };
            for k in 0..total {
                let m = crate::run::marker(k);
                while last_byte(&side.exposed[0], size - 1) != m {}
                src.write_at(size - 1, &[m]);
                let sge = [src.sge(0..size)];
                post_send(qp, send_wr(op, &sge, inline))?;
                while poll(cq, &mut batch)?.is_none() {}
            }
        }
        _ => ready().await?,
    }
    Ok(())
}
