//! The raw baselines the stack is measured against: a message ping-pong on a `Connection`
//! (no stream, no protocol on top) and a `write_all`/`read_exact` ping-pong on a `TcpStream`,
//! of the same size. The ratio (stack p50 / raw p50) says what the stack costs on each
//! transport.

use std::net::SocketAddr;
use std::time::Instant;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rdma::conn::{Connection, Listener};

use crate::net::{Measured, Res, check, ensure, payload, tcp_pair};

/// `iters` round trips of `size`-byte messages on a raw `Connection` (after a warm-up).
pub async fn rdma(addr: SocketAddr, size: usize, iters: u64) -> Res<Measured> {
    let listener = Listener::bind(addr).await?;
    let (server, client) = tokio::join!(listener.accept(), Connection::connect(addr));
    let (server, client) = (server?, client?);
    drop(listener);
    let echo = tokio::spawn(async move {
        while let Some(msg) = server.recv().await? {
            server.send(&msg).await?;
        }
        server.close().await
    });
    let warmup = iters.min(100);
    let (mut m, mut start) = Measured::start();
    for seq in 0..warmup + iters {
        if seq == warmup {
            start = Instant::now();
        }
        let msg = payload(seq, size);
        let t = Instant::now();
        client.send(&msg).await?;
        let reply = client
            .recv()
            .await?
            .ok_or("raw echo: the server closed early")?;
        let d = t.elapsed();
        check("raw Connection echo", seq, size, &reply)?;
        if seq >= warmup {
            m.record(d);
        }
    }
    m.elapsed = start.elapsed();
    client.close().await?;
    echo.await??;
    Ok(m)
}

/// `iters` round trips of `size` bytes on a raw `TcpStream` (after a warm-up).
pub async fn tcp(size: usize, iters: u64) -> Res<Measured> {
    let (mut server, mut client) = tcp_pair().await?;
    let echo = tokio::spawn(async move {
        let mut buf = vec![0u8; size];
        loop {
            match server.read_exact(&mut buf).await {
                Ok(_) => server.write_all(&buf).await?,
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    });
    let warmup = iters.min(100);
    let (mut m, mut start) = Measured::start();
    let mut reply = vec![0u8; size];
    for seq in 0..warmup + iters {
        if seq == warmup {
            start = Instant::now();
        }
        let msg = payload(seq, size);
        let t = Instant::now();
        client.write_all(&msg).await?;
        client.read_exact(&mut reply).await?;
        let d = t.elapsed();
        check("raw TCP echo", seq, size, &reply)?;
        if seq >= warmup {
            m.record(d);
        }
    }
    m.elapsed = start.elapsed();
    client.shutdown().await?;
    let mut rest = Vec::new();
    client.read_to_end(&mut rest).await?;
    ensure!(rest.is_empty(), "raw TCP echo: {} stray bytes", rest.len());
    echo.await??;
    Ok(m)
}
