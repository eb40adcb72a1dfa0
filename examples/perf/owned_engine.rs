//! `--engine owned`: the queue-pair loops on [`OwnedQp`], the queue pair owned by one task with
//! a CQ of its own (no driver, table or completion task): the library's fast path for one task
//! per queue pair, measured in the same loops as the async driver and the verbs layer.

use std::collections::VecDeque;
use std::time::Instant;

use tokio_rdma::owned::{MAX_BATCH, OwnedQp, Ticket};
use tokio_rdma::verbs::RegisteredBuffer;

use crate::args::{Test, TestConfig};
use crate::run::{SLOT_BYTES, Stamps, lat_scale, local_buf, marker, wait_byte};
use crate::setup::{Res, Side};

pub type Qp = OwnedQp<RegisteredBuffer>;

fn posted<T>(r: Result<T, (tokio_rdma::Error, RegisteredBuffer)>) -> Res<T> {
    r.map_err(|(e, _)| e.into())
}

async fn wait(qp: &mut Qp, t: Ticket) -> Res<RegisteredBuffer> {
    let (res, buf) = qp.wait(t)?.await;
    res?;
    Ok(buf)
}

/// The bandwidth tests' buffers: one per request in flight, `cfg.depth` of them unless that
/// many of `size` bytes would pass the benchmark's registration budget (then fewer, so fewer
/// requests are in flight).
fn bw_buffers(side: &Side, size: usize, want: usize) -> Res<Vec<RegisteredBuffer>> {
    let n = want.min((SLOT_BYTES / size.max(1)).max(1));
    (0..n).map(|_| local_buf(side, size)).collect()
}

/// Keeps every buffer of `bufs` in a request until `iters` requests completed: posts the free
/// buffers' requests (sends and writes in batches of up to [`MAX_BATCH`]: one doorbell and
/// one work completion per batch; reads one by one), then takes completions as they come,
/// oldest first, and posts again. With `cfg.op_latency`, pushes each request's
/// post-to-completion time (us) into `samples` (a send queue completes in order).
async fn bw_loop(
    qp: &mut Qp,
    side: &Side,
    cfg: &TestConfig,
    iters: usize,
    bufs: &mut Vec<RegisteredBuffer>,
    samples: &mut Vec<f64>,
) -> Res<()> {
    let remote = side.remote[0];
    let mut started = VecDeque::with_capacity(if cfg.op_latency { bufs.len() } else { 0 });
    let (mut left, mut in_flight) = (iters, 0usize);
    loop {
        while left > 0 && !bufs.is_empty() {
            let n = if cfg.test == Test::ReadBw {
                let buf = bufs.pop().expect("not empty");
                // Completions are taken in order by `next_completion`: no ticket is needed.
                let _ticket = posted(qp.post_read(buf, remote))?;
                1
            } else {
                let mut batch = qp.batch();
                while batch.len() < MAX_BATCH.min(left) {
                    let Some(buf) = bufs.pop() else { break };
                    let added = match cfg.test {
                        Test::WriteBw => batch.write(buf, remote, None),
                        _ => batch.send(buf, None),
                    };
                    let _ticket = posted(added)?;
                }
                let n = batch.len();
                batch.post().map_err(|(e, _)| e)?;
                n
            };
            if cfg.op_latency {
                started.extend(std::iter::repeat_n(Instant::now(), n));
            }
            left -= n;
            in_flight += n;
        }
        if in_flight == 0 {
            return Ok(());
        }
        let Some(mut done) = qp.next_completion().await else {
            return Err("a request in flight has no completion".into());
        };
        // This one, then every other completion already there: their successors go out
        // together.
        loop {
            let (_ticket, res, buf) = done;
            res?;
            in_flight -= 1;
            bufs.push(buf);
            if let Some(t) = started.pop_front() {
                samples.push(t.elapsed().as_secs_f64() * 1e6);
            }
            match qp.try_next_completion() {
                Some(next) => done = next,
                None => break,
            }
        }
    }
}

/// The client of `write_bw`, `read_bw` and `send_bw`: warmup, then `mark(cfg.warmup)`, then
/// the measured requests. Returns how many were measured.
pub async fn bw_client(
    side: &Side,
    cfg: &TestConfig,
    size: usize,
    samples: &mut Vec<f64>,
    mut mark: impl FnMut(usize),
) -> Res<u64> {
    let mut qps = side.oqps.lock().await;
    let qp = &mut qps[0];
    let mut bufs = bw_buffers(side, size, cfg.depth)?;
    if cfg.warmup > 0 {
        bw_loop(qp, side, cfg, cfg.warmup, &mut bufs, &mut Vec::new()).await?;
    }
    mark(cfg.warmup);
    bw_loop(qp, side, cfg, cfg.iters, &mut bufs, samples).await?;
    Ok(cfg.iters as u64)
}

/// Runs the client's iterations; returns one sample (us, RTT halved where perftest halves it)
/// per iteration, warmup included (the caller drops those).
pub async fn client(
    side: &Side,
    cfg: &TestConfig,
    size: usize,
    mut mark: impl FnMut(usize),
) -> Res<Vec<f64>> {
    let mut qps = side.oqps.lock().await;
    let qp = &mut qps[0];
    let total = cfg.warmup + cfg.iters;
    let mut src = local_buf(side, size)?;
    let mut rx = local_buf(side, size)?;
    let remote = side.remote[0];
    let mut recv = None;
    if cfg.test == Test::SendLat {
        recv = Some(posted(qp.post_recv(rx))?);
        rx = local_buf(side, 1)?;
    }
    let mut clock = Stamps::start(total);
    for k in 0..total {
        mark(k);
        match cfg.test {
            Test::SendLat => {
                let sent = posted(qp.post_send(src, None))?;
                src = wait(qp, sent).await?;
                let got = wait(qp, recv.take().expect("posted")).await?;
                if k + 1 < total {
                    recv = Some(posted(qp.post_recv(got))?);
                }
            }
            Test::WriteLat => {
                let m = marker(k);
                src.write_at(size - 1, &[m]);
                let (res, back) = qp.write(src, remote).await;
                res?;
                src = back;
                wait_byte(&side.exposed[0], size - 1, m).await;
            }
            Test::ReadLat => {
                let (res, back) = qp.read(rx, remote).await;
                res?;
                rx = back;
            }
            _ => return Err("the owned engine runs the queue-pair latency tests only".into()),
        }
        clock.stamp();
    }
    let mut out = Vec::with_capacity(total);
    clock.samples(0, lat_scale(cfg.test), &mut out);
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
    let mut qps = side.oqps.lock().await;
    let qp = &mut qps[0];
    let total = cfg.warmup + cfg.iters;
    let mut src = Some(local_buf(side, size)?);
    let remote = side.remote[0];
    match cfg.test {
        Test::SendLat => {
            let mut recv = Some(posted(qp.post_recv(local_buf(side, size)?))?);
            ready().await?;
            let mut sent: Option<Ticket> = None;
            for k in 0..total {
                let got = wait(qp, recv.take().expect("posted")).await?;
                // The previous reply's buffer comes back before it is sent again (its
                // acknowledgement came with, or before, this message).
                if let Some(t) = sent.take() {
                    src = Some(wait(qp, t).await?);
                }
                if k + 1 < total {
                    recv = Some(posted(qp.post_recv(got))?);
                }
                sent = Some(posted(qp.post_send(src.take().expect("returned"), None))?);
            }
            if let Some(t) = sent {
                wait(qp, t).await?;
            }
        }
        Test::WriteLat => {
            ready().await?;
            let mut buf = src.take().expect("buffer");
            for k in 0..total {
                let m = marker(k);
                wait_byte(&side.exposed[0], size - 1, m).await;
                buf.write_at(size - 1, &[m]);
                let (res, back) = qp.write(buf, remote).await;
                res?;
                buf = back;
            }
        }
        Test::SendBw => {
            // Receives kept posted (`rx_depth` of them), each posted again as it completes.
            let mut left = total;
            for buf in bw_buffers(side, size, cfg.rx_depth.min(total))? {
                let _ticket = posted(qp.post_recv(buf))?;
                left -= 1;
            }
            ready().await?;
            for _ in 0..total {
                let Some((_ticket, res, buf)) = qp.next_completion().await else {
                    return Err("a receive in flight has no completion".into());
                };
                res?;
                if left > 0 {
                    let _ticket = posted(qp.post_recv(buf))?;
                    left -= 1;
                }
            }
        }
        _ => ready().await?,
    }
    Ok(())
}
