//! `--engine batch`: `write_bw` and `send_bw` on the driver's `AsyncQp` with
//! `AsyncQp::batch`: the requests in flight travel in batches of up to [`MAX_BATCH`], each
//! posted with one doorbell and awaited as one future, instead of a future per request (the
//! `async` engine). The peer is the `async` engine's server.

use std::collections::VecDeque;
use std::time::Instant;

use tokio_rdma::buf::RemoteToken;
use tokio_rdma::driver::MAX_BATCH;
use tokio_rdma::ops::{Batch, Submit};

use crate::args::{Test, TestConfig};
use crate::run::SLOT_BYTES;
use crate::setup::{Chunk, Res, Side, chunks};

/// The client of `write_bw` and `send_bw`: warmup, then `mark(cfg.warmup)`, then the measured
/// requests. Returns how many were measured.
pub async fn bw_client(
    side: &Side,
    cfg: &TestConfig,
    size: usize,
    samples: &mut Vec<f64>,
    mut mark: impl FnMut(usize),
) -> Res<u64> {
    let qp = &side.qps[0];
    // Writes only: a send's peer exposes no memory for it.
    let remote = match cfg.test {
        Test::WriteBw => Some(side.remote[0].slice(0..size as u64)?),
        _ => None,
    };
    let mut bufs = chunks(&side.pd, size, cfg.depth, SLOT_BYTES)?;
    // Enough batches for every buffer to be in one.
    let mut spare: Vec<Batch<Chunk>> = (0..bufs.len().div_ceil(MAX_BATCH))
        .map(|_| qp.batch())
        .collect();
    if cfg.warmup > 0 {
        let mut none = Vec::new();
        bw_loop(remote, cfg, cfg.warmup, &mut bufs, &mut spare, &mut none).await?;
    }
    mark(cfg.warmup);
    bw_loop(remote, cfg, cfg.iters, &mut bufs, &mut spare, samples).await?;
    Ok(cfg.iters as u64)
}

/// Keeps every buffer of `bufs` in a request until `iters` requests completed: the free
/// buffers go out in batches (each posted at once with [`Submit::start`]), the oldest batch
/// is awaited, and its buffers go out again. With `cfg.op_latency`, pushes each request's
/// post-to-completion time (us) into `samples`.
async fn bw_loop(
    remote: Option<RemoteToken>,
    cfg: &TestConfig,
    iters: usize,
    bufs: &mut Vec<Chunk>,
    spare: &mut Vec<Batch<Chunk>>,
    samples: &mut Vec<f64>,
) -> Res<()> {
    let mut ring: VecDeque<(Submit<Chunk>, Option<Instant>)> = VecDeque::with_capacity(spare.len());
    let mut left = iters;
    loop {
        while left > 0 && !bufs.is_empty() {
            let Some(mut batch) = spare.pop() else { break };
            while batch.len() < MAX_BATCH.min(left) {
                let Some(c) = bufs.pop() else { break };
                let added = match remote {
                    Some(remote) => batch.write(c, remote),
                    None => batch.send(c),
                };
                added.map_err(|(e, _)| e)?;
            }
            left -= batch.len();
            let mut sub = batch.submit();
            sub.start();
            ring.push_back((sub, cfg.op_latency.then(Instant::now)));
        }
        let Some((sub, t)) = ring.pop_front() else {
            return Ok(());
        };
        let mut batch = sub.await;
        for (res, c) in batch.outcomes() {
            res?;
            bufs.push(c);
            if let Some(t) = t {
                samples.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        spare.push(batch);
    }
}
