//! Guide step 4 (docs/guide.md): grant memory to the peer; the peer reads and writes it with
//! RDMA READ and WRITE, without the granting side's CPU.
//!
//! The server grants a 64 KiB table through the connection and sends the token; the client
//! reads part of it, checks it, writes 16 bytes into it and says "done"; the server checks
//! the bytes arrived. Server and client run in this process.
//!
//! ```text
//! cargo run --example guide_4_grant -- [--addr IP] [--port PORT]
//! ```
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;

use clap::Parser;
use tokio_rdma::Endpoint;
use tokio_rdma::buf::{RemoteAccess, RemoteToken};
use tokio_rdma::conn::ConnectOptions;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const TABLE: usize = 64 << 10;
const NOTE: &[u8; 16] = b"written by peer!";

/// A server granting memory, a client reading and writing it.
#[derive(Parser)]
struct Args {
    /// An IP address of an RDMA device's netdev (rxe0's in the soft-RoCE VM)
    #[arg(long, default_value = "192.0.2.1")]
    addr: IpAddr,
    /// The port to listen on
    #[arg(long, default_value_t = 7484)]
    port: u16,
    /// Accepted for the test suite's smoke runs (this step is small anyway)
    #[arg(long)]
    smoke: bool,
}

fn table_byte(i: usize) -> u8 {
    (i % 251) as u8
}

async fn run(args: Args) -> Result<(), BoxError> {
    let addr = SocketAddr::new(args.addr, args.port);
    let ep = Endpoint::open_first_active()?;

    // The granting side offers one-sided access (the default; shown for clarity).
    let listener = ep
        .listen_with(addr, ConnectOptions::default().one_sided(true))
        .await?;
    let server = tokio::spawn(async move {
        let conn = listener.accept().await?;
        // Any buffer can be granted (a Vec here). Grant it through THIS connection: the
        // token works on this connection only.
        let table: Vec<u8> = (0..TABLE).map(table_byte).collect();
        let access = RemoteAccess::READ | RemoteAccess::WRITE;
        let grant = conn.grant(table, 0..TABLE, access)?;
        conn.send(&grant.token().to_bytes()).await?; // 20 bytes: address, length, rkey
        // While granted, the memory is read with copies (the peer may write it any time).
        let done = conn.recv().await?.ok_or("the client left")?;
        let mut note = [0u8; 16];
        grant.read_at(4096, &mut note);
        if &done[..] != b"done" || &note != NOTE {
            return Err(format!("server: found {note:?} after {:?}", &done[..]).into());
        }
        conn.send(b"ok").await?;
        drop(grant); // revokes: the token stops working, then the Vec is freed
        while conn.recv().await?.is_some() {}
        conn.close().await?;
        Ok::<_, BoxError>(())
    });

    let conn = ep.connect(addr, ConnectOptions::default()).await?;
    let token = RemoteToken::from_bytes(&conn.recv().await?.ok_or("no token")?)?;
    // Local memory for one-sided operations comes from this connection's pool.
    let buf = conn.pool()?.acquire(4096).await?;
    let (res, buf) = conn.read(buf, token.slice(0..4096)?).await; // the buffer comes back
    res?;
    if (0..4096).any(|i| buf[i] != table_byte(i)) {
        return Err("RDMA READ returned other bytes than the table's".into());
    }
    println!("read 4096 bytes of the peer's table");
    let mut note = conn.pool()?.acquire(NOTE.len()).await?;
    note.copy_from_slice(NOTE);
    let (res, _note) = conn.write(note, token.slice(4096..4112)?).await;
    res?;
    println!("wrote {} bytes into it", NOTE.len());
    conn.send(b"done").await?; // after the write, on the same connection: it sees the bytes
    let reply = conn.recv().await?.ok_or("the server left")?;
    if &reply[..] != b"ok" {
        return Err(format!("server said {:?}", &reply[..]).into());
    }
    conn.close().await?;
    server.await??;
    println!("guide_4_grant: ok");
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    // Errors print with `Display`: what failed and, for common causes, what to do.
    match run(Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("guide_4_grant: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}
