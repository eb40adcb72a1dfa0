//! What a test or example reads from the system about itself and the device: the process's
//! resident memory and open fds, and the device's `rdma resource show` counts. Shared by the
//! examples (through `common`) and by the device tests (`tests/common`, by path).

use std::collections::BTreeMap;

/// Resident memory of this process, from /proc (0 if unreadable).
pub fn rss_bytes() -> u64 {
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
pub fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// `rdma resource show` counts of device `dev` (qp, cq, mr, pd, cm_id, ...); an error if the
/// tool fails, the device is not listed, or one of qp, cq, mr, pd, cm_id is missing.
pub fn resource_counts(dev: &str) -> Result<BTreeMap<String, u64>, String> {
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
    for key in ["qp", "cq", "mr", "pd", "cm_id"] {
        if !counts.contains_key(key) {
            return Err(format!("no {key} count in {line:?}"));
        }
    }
    Ok(counts)
}
