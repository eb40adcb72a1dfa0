//! `--engine owned`: the latency loops on [`OwnedQp`], the queue pair owned by one task with a
//! CQ of its own (no driver, table or completion task): the library's fast path for one task
//! per queue pair, measured in the same loops as the async driver and the verbs layer.

use tokio_rdma::owned::{OwnedQp, Ticket};
use tokio_rdma::verbs::RegisteredBuffer;

use crate::args::{Test, TestConfig};
use crate::run::{Lap, local_buf, marker, wait_byte};
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
    let mut out = Vec::with_capacity(total);
    let mut recv = None;
    if cfg.test == Test::SendLat {
        recv = Some(posted(qp.post_recv(rx))?);
        rx = local_buf(side, 1)?;
    }
    let mut clock = Lap::start();
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
        out.push(crate::run::lat_sample(cfg.test, clock.lap()));
    }
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
        _ => ready().await?,
    }
    Ok(())
}
