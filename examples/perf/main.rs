//! `perf`: a perftest-style benchmark for tokio-rdma (write / read / send; latency and
//! bandwidth), run as two processes that exchange queue-pair endpoints over TCP.
//!
//! ```text
//! perf --server                                   # on one end (or in one soft-RoCE VM)
//! perf --client 192.0.2.1 --test send_lat --sizes 2,64,4096 --mode busy
//! perf --client 192.0.2.1 --test write_bw --size 65536 --depth 128 --json
//! perf plot --svg cdf.svg ours=samples.txt perftest=perftest-U-output.txt
//! ```
//!
//! See `perf --help` and docs/benchmarks.md for what each number means and how they compare
//! with perftest's.
#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    missing_docs,
    unreachable_pub
)]

mod args;
mod report;
mod run;
mod setup;
mod verbs_engine;

use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};

use args::{Args, Role, TestConfig};
use report::CaseResult;
use setup::{Ctrl, Res};

fn main() {
    let args = args::parse();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let res = match &args.role {
        Role::Plot { out, title, series } => plot(out, title, series),
        Role::Server { port } => rt.block_on(server(&args, *port)),
        Role::Client { host, port, cfg } => rt.block_on(client(&args, host, *port, cfg)),
    };
    if let Err(e) = res {
        eprintln!("perf: {e}");
        std::process::exit(1);
    }
}

fn plot(out: &str, title: &str, series: &[(String, String)]) -> Res<()> {
    let mut data = Vec::new();
    for (name, file) in series {
        data.push((name.clone(), report::read_samples(file)?));
    }
    std::fs::write(out, report::svg_cdf(title, &data))?;
    Ok(())
}

async fn server(args: &Args, port: u16) -> Res<()> {
    let listener = TcpListener::bind(("0.0.0.0", port)).await?;
    if !args.quiet {
        eprintln!("perf: server listening on port {port}");
    }
    let mut served = 0;
    loop {
        let (sock, peer) = listener.accept().await?;
        let mut ctrl = Ctrl::new(sock);
        let res = serve_one(&mut ctrl, args).await;
        match &res {
            Ok(()) if !args.quiet => eprintln!("perf: served {peer}"),
            Ok(()) => {}
            Err(e) => eprintln!("perf: client {peer}: {e}"),
        }
        served += 1;
        if args.clients != 0 && served >= args.clients {
            return res;
        }
    }
}

async fn serve_one(ctrl: &mut Ctrl, args: &Args) -> Res<()> {
    let line = ctrl.expect("hello").await?;
    let cfg = TestConfig::decode(&line)?;
    let side = setup::establish(ctrl, &cfg, args.device.as_deref(), false).await?;
    loop {
        let l = ctrl.recv().await?;
        if l == "bye" {
            return Ok(());
        }
        let size: usize = l
            .strip_prefix("run ")
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("unexpected `{l}`"))?;
        run::server_case(ctrl, &side, &cfg, size).await?;
    }
}

async fn connect(host: &str, port: u16) -> Res<TcpStream> {
    // The server may still be starting (a few seconds in an emulated VM).
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match TcpStream::connect((host, port)).await {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() > deadline => {
                return Err(format!("connecting to {host}:{port}: {e}").into());
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

async fn client(args: &Args, host: &str, port: u16, cfg: &TestConfig) -> Res<()> {
    let mut ctrl = Ctrl::new(connect(host, port).await?);
    ctrl.send(&format!("hello {}", cfg.encode())).await?;
    let side = setup::establish(&mut ctrl, cfg, args.device.as_deref(), true).await?;
    if !args.json {
        print!("{}", report::header(cfg, &side.device));
        println!("{}", report::table_head());
    }
    let mut results: Vec<CaseResult> = Vec::new();
    for &size in &cfg.sizes {
        let r = run::client_case(&mut ctrl, &side, cfg, size).await?;
        if args.json {
            println!("{}", report::json_line(cfg, &side.device, &r));
        } else {
            println!("{}", report::table_row(&r));
            if !r.hw.is_empty() && !args.quiet {
                let hw: Vec<String> = r.hw.iter().map(|(k, v)| format!("{k}={v}")).collect();
                eprintln!("#   hw counters: {}", hw.join(" "));
            }
        }
        results.push(r);
    }
    ctrl.send("bye").await?;
    if let Some(path) = &args.samples {
        let mut text = String::new();
        for r in &results {
            for s in &r.samples {
                text.push_str(&format!("{s:.3}\n"));
            }
        }
        std::fs::write(path, text)?;
    }
    if let Some(path) = &args.svg {
        let series: Vec<(String, Vec<f64>)> = results
            .iter()
            .map(|r| (format!("{} B", r.size), r.samples.clone()))
            .collect();
        let title = format!(
            "tokio-rdma {} ({}), mode {}",
            cfg.test.name(),
            match cfg.test {
                args::Test::WriteLat | args::Test::SendLat => "half round trip",
                args::Test::ReadLat => "one read",
                _ => "post to completion under load",
            },
            args::mode_name(cfg.mode)
        );
        std::fs::write(path, report::svg_cdf(&title, &series))?;
    }
    Ok(())
}
