//! `perf`: a perftest-style benchmark for tokio-rdma (write / read / send; latency and
//! bandwidth), run as two processes that exchange queue-pair endpoints over TCP.
//!
//! ```text
//! perf --server                                   # on one end (or in one soft-RoCE VM)
//! perf --client 192.0.2.1 --test send_lat --sizes 2,64,4096 --mode busy
//! perf --client 192.0.2.1 --test write_bw --size 65536 --depth 128 --json
//! perf --client 192.0.2.1 --test msg_lat --sizes 64,4096 --mode adaptive
//! perf --client 192.0.2.1 --test msg_rate --size 64 --depth 64 --iters 5000
//! perf plot --svg cdf.svg ours=samples.txt perftest=perftest-U-output.txt
//! perf cpu-of -- ib_send_lat -e -n 1000         # a command's CPU time (wait4 rusage)
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
mod batch_engine;
mod msg;
mod owned_engine;
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
    let rt = match args.runtime {
        args::RuntimeKind::Current => tokio::runtime::Builder::new_current_thread(),
        args::RuntimeKind::Multi => tokio::runtime::Builder::new_multi_thread(),
    }
    .enable_all()
    .build()
    .expect("tokio runtime");
    if let Role::CpuOf { mark, cmd } = &args.role {
        std::process::exit(cpu_of(mark.as_deref(), cmd));
    }
    let res = match &args.role {
        Role::CpuOf { .. } => unreachable!("handled above"),
        Role::Plot { out, title, series } => plot(out, title, series),
        Role::Server { port } => rt.block_on(server(&args, *port)),
        Role::Client { .. } if args.in_task => {
            // The loop in a task of its own, as a server's per-connection work runs: the
            // runtime's scheduler, not `block_on`, polls it when woken.
            let args = std::sync::Arc::new(args);
            rt.block_on(async move {
                tokio::spawn(async move {
                    let Role::Client { host, port, cfg } = &args.role else {
                        unreachable!("matched above");
                    };
                    client(&args, host, *port, cfg).await
                })
                .await
                .map_err(|e| e.to_string().into())
                .and_then(|r| r)
            })
        }
        Role::Client { host, port, cfg } => rt.block_on(client(&args, host, *port, cfg)),
    };
    if let Err(e) = res {
        eprintln!("perf: {e}");
        std::process::exit(1);
    }
}

/// Runs `cmd`, prints its CPU time on stderr, returns its exit status (128+N for signal N).
/// With `mark`, also the CPU time between the output line containing it and the next line.
fn cpu_of(mark: Option<&str>, cmd: &[String]) -> i32 {
    use std::io::{BufRead, Write};
    use std::os::unix::process::ExitStatusExt;
    use std::process::{Command, Stdio};
    let mut command = Command::new(&cmd[0]);
    command.args(&cmd[1..]);
    if mark.is_some() {
        command.stdout(Stdio::piped());
    }
    let mut child = match command.spawn() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("perf cpu-of: {}: {e}", cmd[0]);
            return 127;
        }
    };
    let mut window: Option<u64> = None;
    if let (Some(mark), Some(out)) = (mark, child.stdout.take()) {
        let pid = child.id();
        let mut start = None;
        let mut stdout = std::io::stdout().lock();
        for line in std::io::BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            let now = task_cpu_ns(pid);
            if let (Some(t0), None) = (start, window) {
                window = now.map(|t1: u64| t1.saturating_sub(t0));
            }
            if start.is_none() && line.contains(mark) {
                start = now;
            }
            let _ = writeln!(stdout, "{line}");
        }
    }
    let status = match child.wait() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("perf cpu-of: waiting for {}: {e}", cmd[0]);
            return 127;
        }
    };
    // The child is waited for (and so are the children it waited for): RUSAGE_CHILDREN is
    // exactly its usage, as precise as the kernel's accounting (reported in microseconds),
    // unlike /proc/PID/stat's clock ticks.
    // SAFETY: `ru` is a valid out-parameter of the right type.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru) };
    let us = |t: libc::timeval| t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64;
    let (u, s) = (us(ru.ru_utime), us(ru.ru_stime));
    let window = window.map_or(String::new(), |ns| format!(" loop_cpu_us={}", ns / 1000));
    eprintln!("cpu_of: user_us={u} sys_us={s} cpu_us={}{window}", u + s);
    status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
}

/// CPU time of all threads of process `pid` so far (nanoseconds, the first field of each
/// /proc/PID/task/TID/schedstat: the scheduler's sum_exec_runtime, which getrusage reports too).
fn task_cpu_ns(pid: u32) -> Option<u64> {
    let mut total = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .ok()?
        .flatten()
    {
        let text = std::fs::read_to_string(task.path().join("schedstat")).ok()?;
        total += text.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(total)
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
    let mut side = if cfg.test.is_msg() {
        msg::establish(ctrl, &cfg, args.device.as_deref(), None).await?
    } else {
        setup::establish(ctrl, &cfg, args.device.as_deref(), false).await?
    };
    loop {
        let l = ctrl.recv().await?;
        if l == "bye" {
            msg::close(&side).await;
            return Ok(());
        }
        let size: usize = l
            .strip_prefix("run ")
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("unexpected `{l}`"))?;
        run::server_case(ctrl, &mut side, &cfg, size).await?;
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
    let mut side = if cfg.test.is_msg() {
        msg::establish(&mut ctrl, cfg, args.device.as_deref(), Some(host)).await?
    } else {
        setup::establish(&mut ctrl, cfg, args.device.as_deref(), true).await?
    };
    if !args.json {
        print!("{}", report::header(cfg, &side.device));
        println!("{}", report::table_head());
    }
    let mut results: Vec<CaseResult> = Vec::new();
    for &size in &cfg.sizes {
        let r = run::client_case(&mut ctrl, &mut side, cfg, size).await?;
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
    msg::close(&side).await;
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
                args::Test::WriteLat | args::Test::SendLat | args::Test::MsgLat =>
                    "half round trip",
                args::Test::ReadLat => "one read",
                _ => "post to completion under load",
            },
            args::mode_name(cfg.mode)
        );
        std::fs::write(path, report::svg_cdf(&title, &series))?;
    }
    Ok(())
}
