//! The receive task of a connection: keeps the advertised number of receives posted, turns
//! completions into messages, returns credits, and sends keepalives.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::sync::mpsc;
use tracing::{Instrument, debug, trace};

use super::engine::Engine;
use crate::buf::PoolBuf;
use crate::core::{MsgHeader, MsgKind};
use crate::error::{Error, Result};
use crate::ops::RecvInfo;

/// What the receive task hands to `Connection::recv`.
pub(crate) type Delivery = Result<Bytes>;

type RecvOp = Pin<Box<dyn std::future::Future<Output = (Result<RecvInfo>, PoolBuf)> + Send>>;

/// Starts the receive task. Receives are posted before this returns, so the credits announced
/// in the handshake are backed by posted buffers before the peer can use them.
pub(crate) async fn start(
    engine: Arc<Engine>,
    keepalive: Option<Duration>,
    span: tracing::Span,
) -> Result<mpsc::UnboundedReceiver<Delivery>> {
    let (tx, rx) = mpsc::unbounded_channel();
    let mut posted = VecDeque::new();
    for _ in 0..engine.params.recv_credits {
        posted.push_back(post_one(&engine).await?);
    }
    tokio::spawn(run(engine, posted, tx, keepalive).instrument(span));
    Ok(rx)
}

/// Acquires a receive buffer and posts a receive into it (submitted on this first poll).
async fn post_one(engine: &Engine) -> Result<RecvOp> {
    let buf = engine
        .pool
        .acquire(engine.params.recv_buf_size as usize)
        .await?;
    Ok(submit(engine, buf))
}

fn submit(engine: &Engine, buf: PoolBuf) -> RecvOp {
    let mut op: RecvOp = Box::pin(engine.qp.recv(buf));
    // First poll submits (and, with coalescing, the second posts): do both now so the receive
    // is on the device before its credit is announced. Polled with a no-op waker: the receive
    // task polls the oldest receive with its own waker, and receives complete in order.
    let mut cx = std::task::Context::from_waker(futures::task::noop_waker_ref());
    for _ in 0..2 {
        if let std::task::Poll::Ready(out) = op.as_mut().poll(&mut cx) {
            // Resolved at once (the queue pair failed): keep the outcome for the task.
            return Box::pin(futures::future::ready(out));
        }
    }
    op
}

async fn run(
    engine: Arc<Engine>,
    mut posted: VecDeque<RecvOp>,
    tx: mpsc::UnboundedSender<Delivery>,
    keepalive: Option<Duration>,
) {
    let mut assembling: Option<BytesMut> = None;
    let mut deficit = 0u32; // receives to re-post when buffers free up
    let mut refill: Option<Pin<Box<crate::buf::Acquire>>> = None;
    let mut side: Option<Pin<Box<dyn std::future::Future<Output = ()> + Send>>> = None;
    let idle = keepalive.unwrap_or(Duration::from_secs(3600));
    let mut ticker = tokio::time::interval(idle);
    ticker.reset();
    let mut last_sends = engine.counters.sends.load(Ordering::Relaxed);
    loop {
        if refill.is_none() && deficit > 0 {
            refill = Some(Box::pin(
                engine.pool.acquire(engine.params.recv_buf_size as usize),
            ));
        }
        let Some(front) = posted.front_mut() else {
            debug!("receive task: nothing posted, stopping");
            return;
        };
        tokio::select! {
            (res, buf) = front => {
                posted.pop_front();
                match handle(&engine, res, buf, &mut assembling, &tx) {
                    Ok(Flow::Continue) => {}
                    Ok(Flow::Eof) => {
                        debug!("peer closed its side");
                        return;
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e));
                        return;
                    }
                }
                // Re-post at once if a buffer is free, else as soon as one is.
                match engine.pool.try_acquire(engine.params.recv_buf_size as usize) {
                    Ok(Some(buf)) if deficit == 0 => repost(&engine, &mut posted, buf),
                    _ => deficit += 1,
                }
            }
            buf = async { refill.as_mut().expect("set above").await }, if refill.is_some() => {
                refill = None;
                match buf {
                    Ok(buf) => {
                        deficit -= 1;
                        repost(&engine, &mut posted, buf);
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e));
                        return;
                    }
                }
            }
            () = async { side.as_mut().expect("set").await }, if side.is_some() => side = None,
            _ = ticker.tick(), if keepalive.is_some() => {
                let sends = engine.counters.sends.load(Ordering::Relaxed);
                if sends == last_sends && side.is_none() {
                    // Idle: a keepalive exercises the link; a dead peer makes it fail after
                    // the RC retries, which fails the connection.
                    trace!("keepalive");
                    side = engine.credit_message(true).map(|f| Box::pin(f) as _);
                }
                last_sends = sends;
            }
        }
        if side.is_none() {
            if let Some(f) = engine.credit_message(false) {
                side = Some(Box::pin(f));
            }
        }
    }
}

fn repost(engine: &Arc<Engine>, posted: &mut VecDeque<RecvOp>, buf: PoolBuf) {
    posted.push_back(submit(engine, buf));
    engine.credits().on_reposted();
}

enum Flow {
    Continue,
    Eof,
}

fn handle(
    engine: &Engine,
    res: Result<RecvInfo>,
    mut buf: PoolBuf,
    assembling: &mut Option<BytesMut>,
    tx: &mpsc::UnboundedSender<Delivery>,
) -> Result<Flow> {
    let info = match res {
        Ok(info) => info,
        Err(e) => {
            engine.fail_with(&e);
            return Err(e);
        }
    };
    engine.counters.receives.fetch_add(1, Ordering::Relaxed);
    let imm = info
        .imm
        .ok_or_else(|| Error::Protocol("a message arrived without immediate data".into()))?;
    let header = MsgHeader::decode(imm)?;
    trace!(kind = ?header.kind, credits = header.credits, len = info.len, "received");
    engine.credits().on_returned(u32::from(header.credits));
    engine.credit_changed.notify_waiters();
    match header.kind {
        MsgKind::Credit => Ok(Flow::Continue),
        MsgKind::Close => {
            engine.state().peer_closed = true;
            if assembling.is_some() {
                return Err(Error::Protocol(
                    "the peer closed in the middle of a message".into(),
                ));
            }
            Ok(Flow::Eof)
        }
        MsgKind::More | MsgKind::Last => {
            buf.set_len(info.len);
            let so_far = assembling.as_ref().map_or(0, BytesMut::len) + info.len;
            if so_far as u64 > engine.params.max_message_size {
                return Err(Error::Protocol(format!(
                    "message exceeds the negotiated limit of {} bytes",
                    engine.params.max_message_size
                )));
            }
            let message = match (header.kind, assembling.take()) {
                (MsgKind::More, acc) => {
                    let mut acc = acc.unwrap_or_default();
                    acc.extend_from_slice(&buf);
                    *assembling = Some(acc);
                    return Ok(Flow::Continue);
                }
                (_, Some(mut acc)) => {
                    acc.extend_from_slice(&buf);
                    acc.freeze()
                }
                // A single-chunk message: handed over without copying; the receive buffer
                // returns to the pool when the last `Bytes` clone is dropped.
                (_, None) => buf.freeze(),
            };
            engine
                .counters
                .messages_received
                .fetch_add(1, Ordering::Relaxed);
            engine
                .counters
                .bytes_received
                .fetch_add(message.len() as u64, Ordering::Relaxed);
            let _ = tx.send(Ok(message));
            Ok(Flow::Continue)
        }
    }
}
