//! Side A's run: endpoints, clients, faults and sampling for `--duration`, then the drain, the
//! server's records, the checks and the report.

use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio_rdma::Endpoint;

use crate::client::{self, Ctx, Stats};
use crate::faults::{self, Event};
use crate::peer::srq_endpoint;
use crate::report::{self, Sample};
use crate::{Args, soak_dir};

/// Runs side A; the exit status (0: every check passed).
pub async fn drive(args: Args) -> i32 {
    let menu = match faults::parse(&args.faults) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("soak: {e}");
            return 2;
        }
    };
    let peer: IpAddr = std::env::var("RXE_PAIR_PEER")
        .ok()
        .and_then(|a| a.parse().ok())
        .expect("RXE_PAIR_PEER");
    let dir = soak_dir();
    std::fs::create_dir_all(&dir).expect("soak directory");
    let ep_priv = Endpoint::open_first_active().expect("private endpoint");
    let ep_srq = Endpoint::open_first_active_with(srq_endpoint()).expect("SRQ endpoint");
    // Warm-up: librdmacm allocates a protection domain of its own for the device with the
    // first connection and keeps it for the life of the process; the baseline is taken
    // after one connection on each endpoint (retried until B's server listens).
    for (ep, port, o) in [
        (&ep_priv, crate::PORT, crate::peer::private_opts()),
        (&ep_srq, crate::PORT + 1, crate::peer::srq_opts()),
    ] {
        let t = Instant::now();
        loop {
            match ep
                .connect(std::net::SocketAddr::new(peer, port), o.clone())
                .await
            {
                Ok(c) => {
                    let _ = c.close().await;
                    break;
                }
                Err(e) if t.elapsed() > Duration::from_secs(180) => {
                    eprintln!("soak A: cannot reach B's server: {e}");
                    return 1;
                }
                Err(_) => tokio::time::sleep(Duration::from_secs(1)).await,
            }
        }
    }
    let _ = crate::peer::settled().await;
    let base = report::Snapshot::take();
    println!(
        "soak A: {} for {:?}, {} clients, faults every ~{:?}: {}; baseline {base}",
        if report::broken() {
            "DELIBERATELY BROKEN run"
        } else {
            "run"
        },
        args.duration,
        args.conns,
        args.fault_every,
        menu.join(",")
    );
    let clock = Arc::new(crate::Clock::start(args.duration));
    let ticker = {
        let clock = clock.clone();
        tokio::spawn(async move { clock.tick().await })
    };
    let ctx = Arc::new(Ctx {
        ep_priv,
        ep_srq,
        peer,
        clock: clock.clone(),
        stats: Stats::new(),
    });
    let events: Arc<Mutex<Vec<Event>>> = Arc::default();
    let samples: Arc<Mutex<Vec<Sample>>> = Arc::default();
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (ctx, samples, done) = (ctx.clone(), samples.clone(), done.clone());
        let every = args.interval;
        tokio::spawn(async move {
            // Paced by the guest's clock, stamped by the host's.
            let mut next = Instant::now() + every;
            while !done.load(Ordering::Relaxed) {
                tokio::time::sleep_until(next.into()).await;
                next += every;
                let s = Sample::take(&ctx.clock, &ctx.stats);
                println!("soak A: {s}");
                samples.lock().expect("samples").push(s);
            }
        })
    };
    let injector = tokio::spawn(faults::inject(
        menu,
        args.fault_every,
        clock.clone(),
        args.seed,
        events.clone(),
    ));
    let mut clients = tokio::task::JoinSet::new();
    for w in 0..args.conns as u64 {
        clients.spawn(client::client(w, ctx.clone(), args.seed));
    }
    // Every session ends within its operations' limits after the deadline.
    let drain_limit = Duration::from_secs(300);
    let mut hung_clients = 0;
    let _ = ticker.await;
    let end = tokio::time::Instant::now() + drain_limit;
    while !clients.is_empty() {
        match tokio::time::timeout_at(end, clients.join_next()).await {
            Ok(_) => {}
            Err(_) => {
                hung_clients = clients.len();
                clients.abort_all();
                break;
            }
        }
    }
    let _ = injector.await;
    let _ = faults::clear(9999).await;
    done.store(true, Ordering::Relaxed);
    sampler.abort();
    let traffic_s = clock.elapsed();
    samples
        .lock()
        .expect("samples")
        .push(Sample::take(&clock, &ctx.stats));
    // Dropped connections tear down in their driver tasks: give them time to finish.
    let settle = Instant::now();
    let mut fin = report::Snapshot::take();
    while !fin.same_resources(&base) && settle.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(200)).await;
        fin = report::Snapshot::take();
    }
    println!(
        "soak A: traffic over after {traffic_s:.0} s (host clock; the guest's says {:.0} s); \
         settled in {:.1} s: {fin}",
        clock.guest_elapsed(),
        settle.elapsed().as_secs_f64()
    );
    // The server drains, logs and exits; its supervisor reports the device after.
    let _ = std::fs::write(dir.join("stop"), "stop\n");
    let t_stop = Instant::now();
    let b_done = loop {
        if let Ok(s) = std::fs::read_to_string(dir.join("B-done")) {
            break Some(s);
        }
        if t_stop.elapsed() > Duration::from_secs(180) {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let ev = events.lock().expect("events").clone();
    let smp = samples.lock().expect("samples").clone();
    let verdict = report::finish(report::Inputs {
        args: &args,
        stats: &ctx.stats,
        base,
        fin,
        events: &ev,
        samples: &smp,
        b_done,
        hung_clients,
        dir: &dir,
        clock_rate: clock.guest_elapsed() / clock.elapsed().max(1e-3),
    });
    if verdict { 0 } else { 1 }
}
