//! Side A's measurements and verdict: snapshots of the process and the device, per-interval
//! samples, the server's records reconciled with the clients', slopes, the summary and the
//! SVG.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::Path;

use crate::client::{CANCEL_KINDS, Stats};
use crate::faults::Event;
use crate::{Args, proc_stats, svg};

/// Whether this run is deliberately broken (`SOAK_BREAK`): it must fail.
pub fn broken() -> bool {
    std::env::var("SOAK_BREAK").is_ok_and(|v| !v.is_empty())
}

/// The process's fds and RSS and the device's resources at one instant.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub fds: usize,
    pub rss: u64,
    pub res: BTreeMap<String, u64>,
}

impl Snapshot {
    pub fn take() -> Snapshot {
        Snapshot {
            fds: proc_stats::fd_count(),
            rss: proc_stats::rss_bytes(),
            res: proc_stats::resource_counts("rxe0").unwrap_or_default(),
        }
    }
    /// Whether this (the end) holds no more than `o` (the start): the same device
    /// resources, no more fds.
    pub fn same_resources(&self, o: &Snapshot) -> bool {
        self.res == o.res && self.fds <= o.fds
    }
}

impl fmt::Display for Snapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "fds {} rss {:.1} MiB device", self.fds, mib(self.rss))?;
        for (k, v) in &self.res {
            write!(f, " {k}={v}")?;
        }
        Ok(())
    }
}

pub fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

/// One sample of the run.
#[derive(Debug, Clone)]
pub struct Sample {
    pub t: f64,
    pub snap: Snapshot,
    /// p99 of small-message round trips in the interval, in ms (None: no samples).
    pub p99_ms: Option<f64>,
    pub msgs: u64,
    pub active: u64,
    pub sessions: u64,
}

impl Sample {
    pub fn take(clock: &crate::Clock, st: &Stats) -> Sample {
        let p99_ms = {
            let mut l = st.lat.lock().expect("latency");
            let p = (!l.0.is_empty()).then(|| l.0.value_at_quantile(0.99) as f64 / 1e6);
            l.0.reset();
            p
        };
        Sample {
            t: clock.elapsed(),
            snap: Snapshot::take(),
            p99_ms,
            msgs: st.msgs_sent.get(),
            active: st.active.get(),
            sessions: st.sessions.get(),
        }
    }

    pub fn res(&self, k: &str) -> u64 {
        self.snap.res.get(k).copied().unwrap_or(0)
    }
}

impl fmt::Display for Sample {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "[{:.0}s] sent {} sessions {} active {} p99 {} ms {}",
            self.t,
            self.msgs,
            self.sessions,
            self.active,
            self.p99_ms
                .map_or_else(|| "-".into(), |p| format!("{p:.1}")),
            self.snap
        )
    }
}

/// Least-squares slope of `(x, y)` points (per unit of x); None with fewer than 3 points.
pub fn slope(pts: &[(f64, f64)]) -> Option<f64> {
    if pts.len() < 3 {
        return None;
    }
    let n = pts.len() as f64;
    let (mx, my) = pts
        .iter()
        .fold((0.0, 0.0), |(a, b), (x, y)| (a + x / n, b + y / n));
    let (num, den) = pts.iter().fold((0.0, 0.0), |(a, b), (x, y)| {
        (a + (x - mx) * (y - my), b + (x - mx) * (x - mx))
    });
    (den > 0.0).then(|| num / den)
}

/// What the server logged.
#[derive(Debug, Default)]
struct ServerLog {
    /// session -> (last seq received, how it ended)
    sessions: HashMap<u64, (Option<u64>, String)>,
    received: u64,
    violations: Vec<String>,
    corrupt: u64,
    duplicated: u64,
    lost: u64,
    finals: Vec<String>,
}

fn read_server_logs(dir: &Path) -> ServerLog {
    let mut out = ServerLog::default();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !(name.starts_with("B-") && name.ends_with(".log")) {
            continue;
        }
        let text = std::fs::read_to_string(e.path()).unwrap_or_default();
        for line in text.lines() {
            let mut w = line.split_whitespace();
            match w.next() {
                Some("session") => {
                    let id: u64 = w.next().and_then(|v| v.parse().ok()).unwrap_or(u64::MAX);
                    let kv: HashMap<&str, &str> = w.filter_map(|t| t.split_once('=')).collect();
                    let last = kv.get("last").and_then(|v| v.parse().ok());
                    out.received += kv.get("received").and_then(|v| v.parse().ok()).unwrap_or(0);
                    let end = kv.get("end").copied().unwrap_or("?").to_string();
                    out.sessions.insert(id, (last, end));
                }
                Some("violation") => {
                    match line.split_whitespace().nth(2) {
                        Some("corrupt") => out.corrupt += 1,
                        Some("duplicate") => out.duplicated += 1,
                        _ => out.lost += 1,
                    }
                    if out.violations.len() < 20 {
                        out.violations.push(line.to_string());
                    }
                }
                Some("final") => out.finals.push(line.to_string()),
                _ => {}
            }
        }
    }
    out
}

/// Everything the verdict needs.
pub struct Inputs<'a> {
    pub args: &'a Args,
    pub stats: &'a Stats,
    pub base: Snapshot,
    pub fin: Snapshot,
    pub events: &'a [Event],
    pub samples: &'a [Sample],
    pub b_done: Option<String>,
    pub hung_clients: usize,
    pub dir: &'a Path,
    /// Guest seconds per host second over the run.
    pub clock_rate: f64,
}

/// Prints the report, writes the SVG and the summary; true if every check passed.
pub fn finish(i: Inputs<'_>) -> bool {
    let st = i.stats;
    let b = read_server_logs(i.dir);
    let mut fails: Vec<String> = Vec::new();
    // A session whose close() returned Ok: the server must have received every message whose
    // send returned Ok, then end of stream.
    let (mut verified, mut unverified, mut lost_at_close, mut eos_lost) = (0u64, 0u64, 0u64, 0u64);
    for (id, last_ok) in st.closed_ok.lock().expect("records").iter() {
        match b.sessions.get(id) {
            None => unverified += 1,
            Some((last, end)) => {
                let got_all = *last_ok == crate::wire::NONE || last.is_some_and(|l| l >= *last_ok);
                if got_all && end == "eof" {
                    verified += 1;
                } else {
                    // Data not received is lost; all data received but a failure instead of
                    // the end of stream means the acknowledged `Close` itself was lost.
                    let n = if got_all {
                        &mut eos_lost
                    } else {
                        &mut lost_at_close
                    };
                    *n += 1;
                    if *n <= 5 {
                        fails.push(format!(
                            "session {id:x}: close() returned Ok after send #{last_ok}, the \
                             server received up to {last:?} and ended with {end}{}",
                            if got_all {
                                " (every message arrived; the end of stream did not)"
                            } else {
                                ""
                            }
                        ));
                    }
                }
            }
        }
    }
    let kills = i
        .events
        .iter()
        .filter(|e| e.name == "kill" || e.name == "flap")
        .count();
    let corrupt = st.corrupt.get() + b.corrupt;
    let duplicated = st.duplicated.get() + b.duplicated;
    let lost = st.lost.get() + b.lost + lost_at_close;
    let secs = i.samples.last().map_or(0.0, |s| s.t);
    // Warm-up: the first sixth of the run, at least a minute.
    let warm = (secs / 6.0).max(60.0);
    let after: Vec<&Sample> = i.samples.iter().filter(|s| s.t >= warm).collect();
    let rss_slope = slope(
        &after
            .iter()
            .map(|s| (s.t / 600.0, mib(s.snap.rss)))
            .collect::<Vec<_>>(),
    );
    let p99_slope = slope(
        &after
            .iter()
            .filter_map(|s| s.p99_ms.map(|p| (s.t / 600.0, p)))
            .collect::<Vec<_>>(),
    );
    let all = st.lat.lock().expect("latency").1.clone();
    let q = |x: f64| all.value_at_quantile(x) as f64 / 1e6;

    let mut lines = vec![
        format!(
            "soak: {secs:.0} s of traffic, {} clients, {} faults ({} kills/flaps)",
            i.args.conns,
            i.events.len(),
            kills
        ),
        format!(
            "messages: {} sent Ok by A ({:.1} MB; {} zero-copy, {} rendezvous), {} received and \
             checked by B; {} answers received and checked by A ({:.1} MB)",
            st.msgs_sent.get(),
            st.bytes_sent.get() as f64 / 1e6,
            st.zero_copy.get(),
            st.rendezvous.get(),
            b.received,
            st.replies.get(),
            st.reply_bytes.get() as f64 / 1e6
        ),
        format!(
            "one-sided: {} writes, {} reads read back and compared, {} regions checked by B",
            st.os_writes.get(),
            st.os_reads.get(),
            st.os_checked.get()
        ),
        format!(
            "sessions: {} ({} clean close, {} abrupt close, {} dropped, {} failed by faults), \
             {} reconnects, {} connect errors, {} close errors",
            st.sessions.get(),
            st.clean.get(),
            st.abrupt.get(),
            st.dropped.get(),
            st.failed.get(),
            st.reconnects.get(),
            st.connect_errors.get(),
            st.close_errors.get()
        ),
        format!(
            "cancelled: {}",
            CANCEL_KINDS
                .iter()
                .zip(&st.cancel)
                .map(|(k, c)| format!("{k} {}", c.get()))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        format!(
            "closed Ok: {verified} verified against the server's records, {unverified} \
             unverifiable (server killed before its record)"
        ),
        format!(
            "corrupt {corrupt}, lost {lost}, duplicated {duplicated}, hung {}; end of stream \
             lost after close() returned Ok: {eos_lost}",
            st.hung.get()
        ),
        format!(
            "latency (round trip, <= 4 KiB): p50 {:.2} ms, p99 {:.2} ms, p99.9 {:.2} ms, max \
             {:.1} ms over {} samples",
            q(0.5),
            q(0.99),
            q(0.999),
            all.max() as f64 / 1e6,
            all.len()
        ),
        format!(
            "times by the host's clock; the guest's clock ran {:.2}x as fast",
            i.clock_rate
        ),
        format!("A start: {}", i.base),
        format!("A end:   {}", i.fin),
        format!(
            "RSS slope after {warm:.0} s warm-up: {} MiB per 10 min; p99 slope: {} ms per 10 min",
            rss_slope.map_or_else(|| "n/a".into(), |s| format!("{s:+.3}")),
            p99_slope.map_or_else(|| "n/a".into(), |s| format!("{s:+.2}"))
        ),
    ];
    for f in &b.finals {
        lines.push(format!("B {f}"));
    }
    lines.push(format!(
        "B {}",
        i.b_done.as_deref().unwrap_or("no B-done").trim()
    ));

    if corrupt + lost + duplicated > 0 {
        fails.push(format!(
            "corrupt {corrupt}, lost {lost}, duplicated {duplicated} (must all be 0)"
        ));
    }
    if eos_lost > 0 {
        fails.push(format!(
            "{eos_lost} sessions: the client's close() returned Ok, the server received every \
             message but its recv() failed instead of returning the end of stream"
        ));
    }
    if st.hung.get() > 0 || i.hung_clients > 0 {
        fails.push(format!(
            "{} operations hung, {} clients did not finish",
            st.hung.get(),
            i.hung_clients
        ));
    }
    if !i.fin.same_resources(&i.base) {
        fails.push(format!("A leaked: start {} / end {}", i.base, i.fin));
        // What is left, for the diagnosis.
        for kind in ["pd", "mr", "qp", "cq"] {
            if let Ok(o) = std::process::Command::new("rdma")
                .args(["resource", "show", kind, "-d"])
                .output()
            {
                for l in String::from_utf8_lossy(&o.stdout).lines() {
                    lines.push(format!("A left: {kind}: {l}"));
                }
            }
        }
    }
    match &i.b_done {
        None => fails.push("B's supervisor did not report".into()),
        Some(s) => {
            // device=BEFORE->AFTER: the device once the last server exited, as before the first.
            let same = s.split_whitespace().any(|w| {
                w.strip_prefix("device=")
                    .and_then(|v| v.split_once("->"))
                    .is_some_and(|(a, b)| a == b && a != "error")
            });
            if !same {
                fails.push(format!("B's device after the server exited: {}", s.trim()));
            }
        }
    }
    for f in &b.finals {
        // fds=START->END (more at the end is a leak), device=START->END (must be equal).
        let leak = f.split_whitespace().any(|w| {
            w.split_once('=').is_some_and(|(k, v)| {
                v.split_once("->").is_some_and(|(a, b)| match k {
                    "fds" => b.parse::<u64>().ok() > a.parse::<u64>().ok(),
                    "device" => a != b,
                    _ => false,
                })
            })
        });
        if leak || !f.contains("hung_sessions=0") {
            fails.push(format!("B's last server: {f}"));
        }
    }
    if b.finals.is_empty() {
        fails.push("B's last server wrote no final line".into());
    }
    if unverified > 0 && kills == 0 {
        fails.push(format!(
            "{unverified} closed sessions without a server record"
        ));
    }
    if st.msgs_sent.get() == 0 || verified == 0 {
        fails.push("no traffic verified".into());
    }
    if secs >= 1200.0 {
        if let Some(s) = rss_slope.filter(|s| *s > i.args.max_rss_slope) {
            fails.push(format!(
                "RSS grows {s:.3} MiB per 10 min (bound {} MiB)",
                i.args.max_rss_slope
            ));
        }
    }
    for v in b.violations.iter().take(5) {
        lines.push(format!("B violation: {v}"));
    }
    for p in st.problems.lock().expect("problems").iter().take(10) {
        lines.push(format!("A problem: {p}"));
    }
    for e in i.events {
        lines.push(format!(
            "fault {} {:.0}-{:.0} s: {}",
            e.name, e.start, e.end, e.outcome
        ));
    }
    for f in &fails {
        lines.push(format!("FAIL: {f}"));
    }
    let pass = fails.is_empty();
    lines.push(format!("soak: {}", if pass { "PASS" } else { "FAIL" }));
    let text = lines.join("\n") + "\n";
    print!(
        "{}",
        text.lines().map(|l| format!("{l}\n")).collect::<String>()
    );
    let _ = std::fs::write(i.dir.join("summary.txt"), &text);
    let _ = std::fs::write(i.dir.join("samples.csv"), csv(i.samples));
    let path = i.args.svg.clone().unwrap_or_else(|| i.dir.join("soak.svg"));
    let title = format!(
        "tokio-rdma soak: {:.0} min, {} clients, {} faults; corrupt {corrupt} lost {lost} \
         duplicated {duplicated}",
        secs / 60.0,
        i.args.conns,
        i.events.len()
    );
    if let Err(e) = std::fs::write(&path, svg::render(&title, i.samples, i.events)) {
        println!("soak: cannot write {}: {e}", path.display());
    }
    pass
}

fn csv(samples: &[Sample]) -> String {
    let mut s = String::from("t_s,rss_bytes,fds,qp,cq,mr,cm_id,p99_ms,msgs_sent,active,sessions\n");
    for x in samples {
        s.push_str(&format!(
            "{:.1},{},{},{},{},{},{},{},{},{},{}\n",
            x.t,
            x.snap.rss,
            x.snap.fds,
            x.res("qp"),
            x.res("cq"),
            x.res("mr"),
            x.res("cm_id"),
            x.p99_ms.map_or_else(String::new, |p| format!("{p:.3}")),
            x.msgs,
            x.active,
            x.sessions
        ));
    }
    s
}
