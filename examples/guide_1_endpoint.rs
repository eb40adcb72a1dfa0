//! Guide step 1 (docs/guide.md): open an endpoint.
//!
//! An `Endpoint` is an RDMA device opened for connections: its context, one completion queue
//! and the task that drives it. Listeners and connections are made through it.
//!
//! ```text
//! cargo run --example guide_1_endpoint -- [--addr IP] [--port PORT]
//! ```
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;

use clap::Parser;
use tokio_rdma::driver::CompletionMode;
use tokio_rdma::{Endpoint, EndpointOptions, Error};

/// Opens an endpoint, and listens on ADDR through it.
#[derive(Parser)]
struct Args {
    /// An IP address of an RDMA device's netdev (rxe0's in the soft-RoCE VM)
    #[arg(long, default_value = "192.0.2.1")]
    addr: IpAddr,
    /// The port to listen on
    #[arg(long, default_value_t = 7481)]
    port: u16,
    /// Accepted for the test suite's smoke runs (this step is small anyway)
    #[arg(long)]
    smoke: bool,
}

async fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let addr = SocketAddr::new(args.addr, args.port);

    // The first device with an active port; `Endpoint::open("rxe0")` names one instead.
    let ep = Endpoint::open_first_active()?;
    println!("device {}", ep.device_name());
    println!("completion mode {:?}", ep.options().completion_mode);

    // Options are per endpoint: this one spins on its completion queue (lowest latency,
    // one busy core). Endpoints are cheap handles: clone them into tasks.
    let busy = Endpoint::open_with(
        ep.device_name(),
        EndpointOptions::default().completion_mode(CompletionMode::BusyPoll),
    )?;
    println!("second endpoint: {:?}", busy.options().completion_mode);

    // Listening checks the address: it must belong to this endpoint's device.
    let listener = ep.listen(addr).await?;
    println!("listening on {addr}");
    if listener.local_addr()? != addr {
        return Err(format!("bound {}, asked for {addr}", listener.local_addr()?).into());
    }

    // A loopback address is no RDMA address: refused with an error that says what to use.
    match ep
        .listen(SocketAddr::from(([127, 0, 0, 1], args.port)))
        .await
    {
        Err(e @ Error::LoopbackAddress { .. }) => println!("127.0.0.1 refused: {e}"),
        other => return Err(format!("127.0.0.1 was not refused: {other:?}").into()),
    }
    println!("guide_1_endpoint: ok");
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    // Errors print with `Display`: what failed and, for common causes, what to do.
    match run(Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("guide_1_endpoint: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}
