//! tokio-util's `Framed` + `LengthDelimitedCodec` over the stream, unchanged from TCP: an
//! echo server, a client doing sequential small round trips (latency), then frames of 1 B to
//! 256 KiB pipelined both ways (every byte checked).

use std::time::Instant;

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use tokio_util::codec::{Framed, LengthDelimitedCodec};

use crate::net::{IoObj, Load, Measured, Net, Res, Rows, check, ensure, pair, payload};

/// The frame sizes of the pipelined run, in turn.
const SIZES: [usize; 8] = [1, 7, 64, 1000, 4096, 65_536, 100_003, 262_144];

/// Echoes every frame until the client closes.
async fn echo(io: Box<dyn IoObj>) -> Res<()> {
    let mut framed = Framed::new(io, LengthDelimitedCodec::new());
    while let Some(frame) = framed.next().await {
        framed.send(frame?.freeze()).await?;
    }
    SinkExt::<Bytes>::close(&mut framed).await?;
    Ok(())
}

/// The scenario on `net`: rows "Framed small" and "Framed 1 B-256 KiB".
pub async fn run(net: Net, load: Load) -> Res<Rows> {
    let (server, client) = pair(net).await?;
    let server = tokio::spawn(echo(server));
    let mut framed = Framed::new(client, LengthDelimitedCodec::new());

    // Sequential round trips of the small size (after a warm-up).
    let warmup = load.iters.min(100);
    let (mut small, mut start) = Measured::start();
    for seq in 0..warmup + load.iters {
        if seq == warmup {
            start = Instant::now();
        }
        let t = Instant::now();
        framed.send(Bytes::from(payload(seq, load.small))).await?;
        let reply = framed
            .next()
            .await
            .ok_or("Framed: the server closed early")??;
        let d = t.elapsed();
        check("Framed echo", seq, load.small, &reply)?;
        if seq >= warmup {
            small.record(d);
        }
    }
    small.elapsed = start.elapsed();

    // Pipelined: a writer sends every frame while this task reads and checks the echoes.
    let (mut sink, mut frames) = framed.split();
    let n = load.frames;
    let (mut bulk, start) = Measured::start();
    let writer = tokio::spawn(async move {
        for seq in 0..n {
            let size = SIZES[(seq % SIZES.len() as u64) as usize];
            sink.send(Bytes::from(payload(seq, size))).await?;
        }
        sink.close().await?;
        Res::Ok(())
    });
    let mut seq = 0;
    while let Some(frame) = frames.next().await {
        let size = SIZES[(seq % SIZES.len() as u64) as usize];
        check("Framed pipelined echo", seq, size, &frame?)?;
        bulk.bytes += size as u64;
        bulk.requests += 1;
        seq += 1;
    }
    bulk.elapsed = start.elapsed();
    ensure!(seq == n, "Framed: {seq} of {n} frames came back");
    writer.await??;
    server.await??;
    Ok(vec![("Framed small", small), ("Framed 1 B-256 KiB", bulk)])
}
