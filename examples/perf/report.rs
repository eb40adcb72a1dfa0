//! Results: percentiles, the table, JSON lines, and the SVG latency CDF.

use std::fmt::Write as _;
use std::time::Duration;

use hdrhistogram::Histogram;
use tokio_rdma::driver::DriverStats;

use crate::args::{Test, TestConfig, mode_name};

/// Differences of the driver counters over one measured run.
#[derive(Debug, Clone, Copy, Default)]
pub struct StatsDelta {
    pub completions: u64,
    pub cq_events: u64,
    pub empty_events: u64,
    pub polls: u64,
    pub doorbells: u64,
    pub posted: u64,
    pub polled_in_place: u64,
    pub arms: u64,
    pub task_wakeups: u64,
}

impl StatsDelta {
    const FIELDS: [&'static str; 9] = [
        "completions",
        "cq_events",
        "empty_events",
        "polls",
        "doorbells",
        "posted",
        "polled_in_place",
        "arms",
        "task_wakeups",
    ];

    fn values(&self) -> [u64; 9] {
        [
            self.completions,
            self.cq_events,
            self.empty_events,
            self.polls,
            self.doorbells,
            self.posted,
            self.polled_in_place,
            self.arms,
            self.task_wakeups,
        ]
    }

    /// `name=value` pairs separated by spaces (the server's `stats` line).
    pub fn encode(&self) -> String {
        let kv: Vec<String> = Self::FIELDS
            .iter()
            .zip(self.values())
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        kv.join(" ")
    }

    /// The counters of an `encode`d line (None if any is missing).
    pub fn decode(line: &str) -> Option<StatsDelta> {
        let get = |name: &str| {
            line.split_whitespace()
                .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
                .and_then(|v| v.parse::<u64>().ok())
        };
        Some(StatsDelta {
            completions: get("completions")?,
            cq_events: get("cq_events")?,
            empty_events: get("empty_events")?,
            polls: get("polls")?,
            doorbells: get("doorbells")?,
            posted: get("posted")?,
            polled_in_place: get("polled_in_place")?,
            arms: get("arms")?,
            task_wakeups: get("task_wakeups")?,
        })
    }

    /// A JSON object of the counters.
    pub fn json(&self) -> String {
        let kv: Vec<String> = Self::FIELDS
            .iter()
            .zip(self.values())
            .map(|(k, v)| format!("\"{k}\":{v}"))
            .collect();
        format!("{{{}}}", kv.join(","))
    }

    pub fn between(a: &DriverStats, b: &DriverStats) -> StatsDelta {
        StatsDelta {
            polled_in_place: b.polled_in_place - a.polled_in_place,
            arms: b.arms - a.arms,
            task_wakeups: b.task_wakeups - a.task_wakeups,
            completions: b.completions - a.completions,
            cq_events: b.cq_events - a.cq_events,
            empty_events: b.empty_events - a.empty_events,
            polls: b.polls - a.polls,
            doorbells: b.doorbells - a.doorbells,
            posted: b.posted - a.posted,
        }
    }
}

/// The latency samples in µs of a loop's stamps (`stamps[k]` before iteration `k`,
/// `stamps[k + 1]` after it), from iteration `skip` on, each times `scale`; appended to
/// `out`. Part of the report, as perftest's differences of its `tstamp[]` are: plain
/// arithmetic, no call the measured loop shares.
pub fn lap_samples(stamps: &[libc::timespec], skip: usize, scale: f64, out: &mut Vec<f64>) {
    out.reserve(stamps.len().saturating_sub(skip + 1));
    for k in skip + 1..stamps.len() {
        let (a, b) = (&stamps[k - 1], &stamps[k]);
        let ns = (b.tv_sec - a.tv_sec) as f64 * 1e9 + (b.tv_nsec - a.tv_nsec) as f64;
        out.push(ns * 1e-3 * scale);
    }
}

/// User + system CPU time of this process so far.
pub fn cpu_time() -> Duration {
    // SAFETY: `ru` is a valid out-parameter of the right type.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// The device's hardware counters (rxe exposes retries, RNR NAKs, ...), if readable.
pub fn hw_counters(device: &str, port: u8) -> Vec<(String, u64)> {
    let dir = format!("/sys/class/infiniband/{device}/ports/{port}/hw_counters");
    let mut v: Vec<(String, u64)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let val = std::fs::read_to_string(e.path())
                .ok()?
                .trim()
                .parse()
                .ok()?;
            Some((name, val))
        })
        .collect();
    v.sort();
    v
}

pub fn hw_delta(a: &[(String, u64)], b: &[(String, u64)]) -> Vec<(String, u64)> {
    b.iter()
        .filter_map(|(k, vb)| {
            let va = a.iter().find(|(ka, _)| ka == k).map_or(0, |(_, v)| *v);
            (vb > &va).then(|| (k.clone(), vb - va))
        })
        .collect()
}

/// The outcome of one size.
#[derive(Debug, Clone)]
pub struct CaseResult {
    pub size: usize,
    /// Measured operations (all queue pairs).
    pub ops: u64,
    /// Latency samples in microseconds, sorted (definition: `Test::lat_definition`).
    pub samples: Vec<f64>,
    pub elapsed: Duration,
    pub cpu: Duration,
    pub peer_cpu: Option<Duration>,
    pub stats: StatsDelta,
    /// The server's driver counters over its part of the run.
    pub peer_stats: Option<StatsDelta>,
    pub hw: Vec<(String, u64)>,
}

/// Latency percentiles in microseconds, from an HDR histogram of the samples (nanosecond
/// resolution, 3 significant digits: each value within 0.1%). NaN without samples.
#[derive(Debug, Clone, Copy)]
pub struct Percentiles {
    pub min: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
    pub avg: f64,
}

impl Percentiles {
    /// The percentiles of `samples` (microseconds, any order).
    pub fn of(samples: &[f64]) -> Percentiles {
        let mut h = Histogram::<u64>::new_with_bounds(1, 3_600_000_000_000, 3)
            .expect("valid histogram bounds");
        for &us in samples {
            h.saturating_record(((us * 1e3).round() as u64).max(1));
        }
        if h.is_empty() {
            let nan = f64::NAN;
            return Percentiles {
                min: nan,
                p50: nan,
                p90: nan,
                p99: nan,
                p999: nan,
                max: nan,
                avg: nan,
            };
        }
        let us = |ns: u64| ns as f64 / 1e3;
        Percentiles {
            min: us(h.min()),
            p50: us(h.value_at_quantile(0.50)),
            p90: us(h.value_at_quantile(0.90)),
            p99: us(h.value_at_quantile(0.99)),
            p999: us(h.value_at_quantile(0.999)),
            max: us(h.max()),
            avg: h.mean() / 1e3,
        }
    }
}

impl CaseResult {
    pub fn bw_mib(&self) -> f64 {
        (self.size as f64 * self.ops as f64) / self.elapsed.as_secs_f64() / (1u64 << 20) as f64
    }
    pub fn mops(&self) -> f64 {
        self.ops as f64 / self.elapsed.as_secs_f64() / 1e6
    }
    pub fn percentiles(&self) -> Percentiles {
        Percentiles::of(&self.samples)
    }
    fn per_op(&self, d: Duration) -> f64 {
        d.as_secs_f64() * 1e6 / self.ops.max(1) as f64
    }
    fn ratio(&self, n: u64) -> f64 {
        n as f64 / self.ops.max(1) as f64
    }
}

pub fn header(cfg: &TestConfig, device: &str) -> String {
    format!(
        "# perf {}: device {device}, mode {}, inline {}, {} qp(s), depth {}, {} iterations (+{} warmup), signal_every {}, coalesce {}\n# latency: {}\n",
        cfg.test.name(),
        mode_name(cfg.mode),
        cfg.inline,
        cfg.qps,
        cfg.depth,
        cfg.iters,
        cfg.warmup,
        cfg.signal_every,
        if cfg.coalesce { "on" } else { "off" },
        cfg.test.lat_definition(),
    )
}

pub fn table_head() -> String {
    format!(
        "{:>8} {:>7} {:>8} {:>8} {:>8} {:>9} {:>9} {:>8} {:>10} {:>8} {:>8} {:>8} {:>6} {:>6} {:>6}",
        "#bytes",
        "#iters",
        "p50[us]",
        "p90[us]",
        "p99[us]",
        "p99.9[us]",
        "max[us]",
        "avg[us]",
        "BW[MiB/s]",
        "Mop/s",
        "cpu/op",
        "peer/op",
        "db/op",
        "poll/op",
        "ev/op"
    )
}

pub fn table_row(r: &CaseResult) -> String {
    let p = r.percentiles();
    // No samples (a rate test without --op-latency): "-", not NaN.
    let us = |x: f64| {
        if x.is_finite() {
            format!("{x:.2}")
        } else {
            "-".into()
        }
    };
    format!(
        "{:>8} {:>7} {:>8} {:>8} {:>8} {:>9} {:>9} {:>8} {:>10.2} {:>8.4} {:>8.2} {:>8} {:>6.2} {:>6.1} {:>6.2}",
        r.size,
        r.ops,
        us(p.p50),
        us(p.p90),
        us(p.p99),
        us(p.p999),
        us(p.max),
        us(p.avg),
        r.bw_mib(),
        r.mops(),
        r.per_op(r.cpu),
        r.peer_cpu
            .map_or("-".to_string(), |c| format!("{:.2}", r.per_op(c))),
        r.ratio(r.stats.doorbells),
        r.ratio(r.stats.polls),
        r.ratio(r.stats.cq_events),
    )
}

fn jnum(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.3}")
    } else {
        "null".into()
    }
}

pub fn json_line(cfg: &TestConfig, device: &str, r: &CaseResult) -> String {
    let p = r.percentiles();
    let mut o = String::from("{");
    let _ = write!(
        o,
        "\"tool\":\"tokio-rdma-perf\",\"test\":\"{}\",\"device\":\"{device}\",\"size\":{},\"iters\":{},\"ops\":{},\"qps\":{},\"depth\":{},\"mode\":\"{}\",\"inline\":{},\"signal_every\":{},\"coalesce\":{},",
        cfg.test.name(),
        r.size,
        cfg.iters,
        r.ops,
        cfg.qps,
        cfg.depth,
        mode_name(cfg.mode),
        cfg.inline,
        cfg.signal_every,
        cfg.coalesce
    );
    let lat_def = match cfg.test {
        Test::WriteLat | Test::SendLat | Test::MsgLat => "half_rtt",
        Test::ReadLat => "full_op",
        _ => "op_under_load",
    };
    let _ = write!(
        o,
        "\"lat_def\":\"{lat_def}\",\"min_us\":{},\"p50_us\":{},\"p90_us\":{},\"p99_us\":{},\"p999_us\":{},\"max_us\":{},\"avg_us\":{},",
        jnum(p.min),
        jnum(p.p50),
        jnum(p.p90),
        jnum(p.p99),
        jnum(p.p999),
        jnum(p.max),
        jnum(p.avg)
    );
    let _ = write!(
        o,
        "\"elapsed_s\":{},\"bw_mib_s\":{},\"mops\":{},\"cpu_us_per_op\":{},\"peer_cpu_us_per_op\":{},",
        jnum(r.elapsed.as_secs_f64()),
        jnum(r.bw_mib()),
        format_args!("{:.6}", r.mops()),
        jnum(r.per_op(r.cpu)),
        r.peer_cpu.map_or("null".to_string(), |c| jnum(r.per_op(c)))
    );
    let _ = write!(
        o,
        "\"driver\":{},\"peer_driver\":{},\"hw\":{{",
        r.stats.json(),
        r.peer_stats.map_or("null".to_string(), |s| s.json())
    );
    let hw: Vec<String> = r.hw.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
    o.push_str(&hw.join(","));
    o.push_str("}}");
    o
}

/// Reads latency samples: one number per line, or perftest's `-U` output (`index, usec`).
pub fn read_samples(path: &str) -> Result<Vec<f64>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
    let mut v: Vec<f64> = text
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let field = match l.split_once(',') {
                Some((_, b)) => b.trim(),
                None => l,
            };
            field.parse::<f64>().ok()
        })
        .collect();
    if v.is_empty() {
        return Err(format!("{path}: no samples"));
    }
    v.sort_by(f64::total_cmp);
    Ok(v)
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// An SVG plot of the empirical CDFs of `series` (name, sorted samples in microseconds), on a
/// logarithmic latency axis so that the body (tens of microseconds) and the tail (milliseconds)
/// both show.
pub fn svg_cdf(title: &str, series: &[(String, Vec<f64>)]) -> String {
    const W: f64 = 960.0;
    const H: f64 = 480.0;
    let (l, r, t, b) = (70.0, 20.0, 40.0, 60.0);
    let (pw, ph) = (W - l - r, H - t - b);
    let lo = series
        .iter()
        .filter_map(|(_, s)| s.first().copied())
        .fold(f64::INFINITY, f64::min)
        .max(1e-3);
    let hi = series
        .iter()
        .filter_map(|(_, s)| s.last().copied())
        .fold(0.0f64, f64::max)
        .max(lo * 10.0);
    let (d0, d1) = (lo.log10().floor(), hi.log10().ceil());
    let sx = |x: f64| l + (x.max(1e-3).log10().clamp(d0, d1) - d0) / (d1 - d0) * pw;
    let sy = |p: f64| t + ph - p * ph;
    let colors = [
        "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
    ];
    let mut o = String::new();
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(o, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    let _ = writeln!(
        o,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="15">{}</text>"#,
        W / 2.0,
        esc(title)
    );
    // Grid: decades labelled, 2x and 5x lines light.
    let mut d = d0;
    while d <= d1 + 1e-9 {
        for (m, label) in [(1.0, true), (2.0, false), (5.0, false)] {
            let x = m * 10f64.powf(d);
            if x.log10() > d1 + 1e-9 {
                continue;
            }
            let px = sx(x);
            let stroke = if label { "#bbb" } else { "#e4e4e4" };
            let _ = writeln!(
                o,
                r#"<line x1="{px:.1}" y1="{t}" x2="{px:.1}" y2="{}" stroke="{stroke}"/>"#,
                t + ph
            );
            let text = if x >= 1.0 {
                format!("{x:.0}")
            } else {
                format!("{x}")
            };
            let _ = writeln!(
                o,
                r#"<text x="{px:.1}" y="{}" text-anchor="middle" fill="{}">{text}</text>"#,
                t + ph + 16.0,
                if label { "#000" } else { "#888" }
            );
        }
        d += 1.0;
    }
    for i in 0..=10 {
        let p = i as f64 / 10.0;
        let py = sy(p);
        let _ = writeln!(
            o,
            r##"<line x1="{l}" y1="{py:.1}" x2="{}" y2="{py:.1}" stroke="#e4e4e4"/><text x="{}" y="{:.1}" text-anchor="end">{}%</text>"##,
            l + pw,
            l - 6.0,
            py + 4.0,
            i * 10
        );
    }
    let _ = writeln!(
        o,
        r##"<rect x="{l}" y="{t}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>"##
    );
    let _ = writeln!(
        o,
        r#"<text x="{}" y="{}" text-anchor="middle">latency [us], logarithmic</text>"#,
        l + pw / 2.0,
        H - 18.0
    );
    let _ = writeln!(
        o,
        r#"<text x="16" y="{}" text-anchor="middle" transform="rotate(-90 16 {})">samples at or below</text>"#,
        t + ph / 2.0,
        t + ph / 2.0
    );
    for (i, (name, s)) in series.iter().enumerate() {
        let c = colors[i % colors.len()];
        let n = s.len();
        let stride = (n / 500).max(1);
        let mut pts = String::new();
        let mut prev_p = 0.0;
        for (j, &v) in s.iter().enumerate() {
            if j % stride != 0 && j + 1 != n {
                continue;
            }
            let p = (j + 1) as f64 / n as f64;
            let _ = write!(
                pts,
                "{:.1},{:.1} {:.1},{:.1} ",
                sx(v),
                sy(prev_p),
                sx(v),
                sy(p)
            );
            prev_p = p;
        }
        let _ = writeln!(
            o,
            r#"<polyline fill="none" stroke="{c}" stroke-width="1.8" points="{pts}"/>"#
        );
        // Legend in the lower right, where CDFs have no points.
        let lx = l + pw - 420.0;
        let ly = t + ph - 18.0 * (series.len() - i) as f64;
        let p = Percentiles::of(s);
        let _ = writeln!(
            o,
            r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{c}" stroke-width="3"/><text x="{}" y="{}">{} (p50 {:.1}, p99 {:.1} us, n={n})</text>"#,
            lx + 24.0,
            lx + 30.0,
            ly + 4.0,
            esc(name),
            p.p50,
            p.p99
        );
    }
    o.push_str("</svg>\n");
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles() {
        let v: Vec<f64> = (1..=1000).map(f64::from).collect();
        let p = Percentiles::of(&v);
        let near = |got: f64, want: f64| (got - want).abs() <= want * 1e-3;
        assert!(near(p.p50, 500.0), "{p:?}");
        assert!(near(p.p99, 990.0), "{p:?}");
        assert!(near(p.p999, 999.0), "{p:?}");
        assert!(near(p.max, 1000.0) && near(p.min, 1.0), "{p:?}");
        assert!(near(p.avg, 500.5), "{p:?}");
        assert!(Percentiles::of(&[]).p50.is_nan());
    }
}
