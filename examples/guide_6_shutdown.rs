//! Guide step 6 (docs/guide.md): shut down cleanly, and what the peer sees.
//!
//! The client sends its messages, then half-closes (`shutdown`): the server receives every
//! message, then `None` (end of stream), answers with a summary on its still-open direction
//! and closes; the client reads the summary, then `None`, and closes. After `close`, sends
//! fail. A second connection that the server just drops ends the same way for the client.
//! Server and client run in this process.
//!
//! ```text
//! cargo run --example guide_6_shutdown -- [--addr IP] [--port PORT]
//! ```
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;

use clap::Parser;
use tokio_rdma::Endpoint;
use tokio_rdma::conn::ConnectOptions;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const MESSAGES: usize = 10;

/// Half-close, close, and a dropped connection, seen from both sides.
#[derive(Parser)]
struct Args {
    /// An IP address of an RDMA device's netdev (rxe0's in the soft-RoCE VM)
    #[arg(long, default_value = "192.0.2.1")]
    addr: IpAddr,
    /// The port to listen on
    #[arg(long, default_value_t = 7486)]
    port: u16,
    /// Accepted for the test suite's smoke runs (this step is small anyway)
    #[arg(long)]
    smoke: bool,
}

async fn run(args: Args) -> Result<(), BoxError> {
    let addr = SocketAddr::new(args.addr, args.port);
    let ep = Endpoint::open_first_active()?;

    let listener = ep.listen(addr).await?;
    let server = tokio::spawn(async move {
        let conn = listener.accept().await?;
        let mut got = 0;
        while let Some(_msg) = conn.recv().await? {
            got += 1;
        }
        // `Ok(None)`: the client's end of stream, after all it sent. This side can still send.
        conn.send(format!("got {got}").as_bytes()).await?;
        conn.close().await?; // end of stream; Ok once it is delivered (teardown in the background)

        // A second connection, dropped without a word: it closes in the background.
        let conn = listener.accept().await?;
        drop(conn);
        Ok::<_, BoxError>(())
    });

    let conn = ep.connect(addr, ConnectOptions::default()).await?;
    for i in 0..MESSAGES {
        conn.send(format!("message {i}").as_bytes()).await?;
    }
    conn.shutdown().await?; // half-close: no more sends from here, receiving goes on
    let summary = conn.recv().await?.ok_or("no summary")?;
    println!("server says {:?}", String::from_utf8_lossy(&summary));
    if summary[..] != *format!("got {MESSAGES}").as_bytes() {
        return Err("the server did not get every message".into());
    }
    drop(summary);
    if conn.recv().await?.is_some() {
        return Err("expected the server's end of stream".into());
    }
    println!("server closed: recv returned Ok(None)");
    conn.close().await?;
    match conn.send(b"late").await {
        Err(e) => println!("send after close: {e}"),
        Ok(()) => return Err("a send after close succeeded".into()),
    }

    let dropped = ep.connect(addr, ConnectOptions::default()).await?;
    match dropped.recv().await {
        Ok(None) => println!("connection dropped by the server: recv returned Ok(None)"),
        other => return Err(format!("after the server's drop: {other:?}").into()),
    }
    dropped.close().await?;
    server.await??;
    println!("guide_6_shutdown: ok");
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    // Errors print with `Display`: what failed and, for common causes, what to do.
    match run(Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("guide_6_shutdown: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}
