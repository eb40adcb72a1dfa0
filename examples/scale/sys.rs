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
