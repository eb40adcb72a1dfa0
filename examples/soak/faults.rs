//! Side A's fault injector: the fault suite's menu in turn, each held a while, with random
//! gaps; every fault is logged with its start and end (the SVG marks them).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::{Rng, ctl, soak_dir};

/// A fault as it happened: name and seconds since the start of the run.
#[derive(Debug, Clone)]
pub struct Event {
    pub name: String,
    pub start: f64,
    pub end: f64,
    pub outcome: String,
}

pub const MENU: [&str; 8] = [
    "loss",
    "corrupt",
    "reorder",
    "duplicate",
    "partition-short",
    "partition-long",
    "kill",
    "flap",
];

/// Checks a comma-separated list of fault names.
pub fn parse(list: &str) -> Result<Vec<String>, String> {
    if list == "none" {
        return Ok(Vec::new());
    }
    list.split(',')
        .map(|f| {
            if MENU.contains(&f) {
                Ok(f.to_string())
            } else {
                Err(format!("unknown fault {f:?} (one of {MENU:?}, or none)"))
            }
        })
        .collect()
}

/// Injects `menu` in turn until `stop_at` (no fault starts later); events go to `log`.
pub async fn inject(
    menu: Vec<String>,
    every: Duration,
    clock: Arc<crate::Clock>,
    seed: u64,
    log: Arc<Mutex<Vec<Event>>>,
) {
    if menu.is_empty() {
        return;
    }
    let mut rng = Rng::new(seed ^ 0xfa17);
    let mut n = 0u64;
    loop {
        let gap = every.mul_f64(0.5 + rng.below(1000) as f64 / 1000.0);
        // No fault starts in the last 20 s plus the gap (by the guest's clock: roughly).
        if clock.left() < gap.as_secs_f64() + 20.0 {
            return;
        }
        tokio::time::sleep(gap).await;
        let name = &menu[(n as usize) % menu.len()];
        let start = clock.elapsed();
        println!("soak A: [{start:.0}s] fault {name}");
        let outcome = apply(name, n).await;
        let end = clock.elapsed();
        println!("soak A: [{end:.0}s] fault {name} over: {outcome}");
        log.lock().expect("faults").push(Event {
            name: name.clone(),
            start,
            end,
            outcome,
        });
        n += 1;
    }
}

/// Held this long: a netem fault, a short partition (rides through), a long one (connections
/// fail by their retries and reconnect).
const HOLD: Duration = Duration::from_secs(10);
const SHORT: u64 = 2;
const LONG: u64 = 15;

async fn apply(name: &str, n: u64) -> String {
    let r = match name {
        "loss" => netem(n, &["loss", "2%"]).await,
        "corrupt" => netem(n, &["corrupt", "1%"]).await,
        "reorder" => netem(n, &["delay", "5ms", "reorder", "25%", "50%"]).await,
        "duplicate" => netem(n, &["duplicate", "5%"]).await,
        "partition-short" => partition(n, SHORT).await,
        "partition-long" => partition(n, LONG).await,
        "kill" => kill("kill").await,
        "flap" => kill("flap").await,
        other => Err(format!("unknown fault {other}")),
    };
    match r {
        Ok(s) => s,
        Err(e) => {
            println!("soak A: fault {name} FAILED to apply: {e}");
            format!("not applied: {e}")
        }
    }
}

async fn request(id: &str, args: &[&str]) -> Result<String, String> {
    ctl::fault_request(id, args)?;
    Ok(ctl::fault_done(id).await?.1)
}

async fn netem(n: u64, spec: &[&str]) -> Result<String, String> {
    let mut args = vec!["both", "netem"];
    args.extend_from_slice(spec);
    request(&format!("soak-{n}"), &args).await?;
    tokio::time::sleep(HOLD).await;
    clear(n).await
}

/// Removes any netem setting on both sides.
pub async fn clear(n: u64) -> Result<String, String> {
    request(&format!("soak-{n}-clear"), &["both", "clear"]).await
}

async fn partition(n: u64, secs: u64) -> Result<String, String> {
    let s = secs.to_string();
    request(&format!("soak-{n}"), &["both", "partition", &s]).await?;
    tokio::time::sleep(Duration::from_secs(secs + 1)).await;
    Ok(format!("both partitioned {secs} s"))
}

/// Asks B's supervisor to kill its server (SIGKILL) and restart it, flapping B's link in
/// between for "flap"; waits until it is back.
async fn kill(how: &str) -> Result<String, String> {
    let dir = soak_dir();
    // The supervisor counts its kills from 0: the request names the next one.
    let k = std::fs::read_dir(&dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("killed."))
        .count();
    let (req, done) = (format!("kill.{k}"), format!("killed.{k}"));
    let tmp = dir.join(format!(".{req}.tmp"));
    std::fs::write(&tmp, how).map_err(|e| format!("write {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, dir.join(&req)).map_err(|e| format!("rename {req}: {e}"))?;
    let t0 = Instant::now();
    while !dir.join(&done).exists() {
        if t0.elapsed() > Duration::from_secs(90) {
            return Err(format!("B did not answer {req} within 90 s"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(format!(
        "B's server killed{} and restarted in {:.1} s",
        if how == "flap" {
            ", its link down 3 s,"
        } else {
            ""
        },
        t0.elapsed().as_secs_f64()
    ))
}
