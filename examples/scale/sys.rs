//! What the scale run reads from the system: `rdma resource show`, the device's hw_counters,
//! RSS, open fds, the fd limit; and the report (text lines, plus one JSON object).

use std::collections::BTreeMap;

/// Raises the soft `RLIMIT_NOFILE` to the hard limit (each connection has a CM event channel,
/// one fd); returns (soft, hard) after.
pub(crate) fn raise_fd_limit() -> (u64, u64) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid rlimit for getrlimit/setrlimit to read and write.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                lim = raised;
            }
        }
    }
    (lim.rlim_cur, lim.rlim_max)
}

/// Resident memory of this process, from /proc.
pub(crate) fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
        })
        .unwrap_or(0)
        * 1024
}

/// Open file descriptors of this process.
pub(crate) fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// `rdma resource show` counts of `dev` (qp, cq, mr, pd, cm_id, ...).
pub(crate) fn resource_counts(dev: &str) -> Result<BTreeMap<String, u64>, String> {
    let out = std::process::Command::new("rdma")
        .args(["resource", "show"])
        .output()
        .map_err(|e| format!("run `rdma resource show` (iproute2): {e}"))?;
    if !out.status.success() {
        return Err(format!("rdma resource show: {out:?}"));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.split_whitespace().nth(1) == Some(&format!("{dev}:")))
        .ok_or_else(|| format!("no {dev} in `rdma resource show`:\n{text}"))?;
    let tokens: Vec<&str> = line.split_whitespace().collect();
    let mut counts = BTreeMap::new();
    for w in tokens.windows(2) {
        if let Ok(n) = w[1].parse::<u64>() {
            if w[0].chars().all(|c| c.is_ascii_lowercase() || c == '_') {
                counts.insert(w[0].to_string(), n);
            }
        }
    }
    Ok(counts)
}

/// The device's port-1 hw_counters (rxe: RNR NAKs sent and received, retries, duplicates...);
/// empty if it has none.
pub(crate) fn hw_counters(dev: &str) -> BTreeMap<String, u64> {
    let dir = format!("/sys/class/infiniband/{dev}/ports/1/hw_counters");
    let mut out = BTreeMap::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            if let Ok(v) = std::fs::read_to_string(e.path()) {
                if let Ok(v) = v.trim().parse() {
                    out.insert(e.file_name().to_string_lossy().into_owned(), v);
                }
            }
        }
    }
    out
}

/// Lines as they happen; with `json`, the numbers as one object at the end.
pub(crate) struct Report {
    json: bool,
    nums: Vec<(&'static str, f64)>,
}

impl Report {
    pub(crate) fn new(json: bool) -> Report {
        Report {
            json,
            nums: Vec::new(),
        }
    }

    pub(crate) fn line(&mut self, s: String) {
        println!("scale: {s}");
    }

    pub(crate) fn num(&mut self, key: &'static str, v: f64) {
        self.nums.push((key, v));
    }

    pub(crate) fn finish(&self) {
        if self.json {
            let body: Vec<String> = self
                .nums
                .iter()
                .map(|(k, v)| {
                    if v.fract() == 0.0 && v.abs() < 1e15 {
                        format!("\"{k}\":{}", *v as i64)
                    } else {
                        format!("\"{k}\":{v:.3}")
                    }
                })
                .collect();
            println!("{{{}}}", body.join(","));
        }
    }
}
