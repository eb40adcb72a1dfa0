//! The control plane of a fault run: messages and barriers between A and B through files in
//! the directory both VMs share with the host (`$RXE_PAIR_OUT`), out of band, so the faults on
//! the wire never touch it (a TCP connection over the wire would stall through a partition and
//! come back only at its next retransmission); fault requests to scripts/rxe-pair through its
//! control directory; the device's counters (rxe hw_counters, `rdma resource show`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::proc_stats;

/// A side of the pair: `A` (listens, and requests most faults) or `B`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    A,
    B,
}

impl Side {
    pub fn name(self) -> &'static str {
        match self {
            Side::A => "A",
            Side::B => "B",
        }
    }
    pub fn other(self) -> Side {
        match self {
            Side::A => Side::B,
            Side::B => Side::A,
        }
    }
}

/// How long a barrier or a control message may take (the peer may be waiting for its own
/// operations' generous timeouts).
pub const CTL_TIMEOUT: Duration = Duration::from_secs(240);

/// The control channel: message `n` from side X is the file `DIR/X.n`, written to a temporary
/// name and renamed into place (complete when it appears).
pub struct Ctl {
    dir: PathBuf,
    side: Side,
    sent: u64,
    received: u64,
    /// A barrier line from the peer that ended a scenario early (it failed).
    peer_ended: Option<String>,
}

impl Ctl {
    pub fn open(side: Side, dir: PathBuf) -> Result<Ctl, String> {
        std::fs::create_dir_all(&dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
        Ok(Ctl {
            dir,
            side,
            sent: 0,
            received: 0,
            peer_ended: None,
        })
    }

    /// Sends one line.
    pub fn send(&mut self, line: &str) -> Result<(), String> {
        let name = format!("{}.{}", self.side.name(), self.sent);
        let tmp = self.dir.join(format!(".{name}.tmp"));
        std::fs::write(&tmp, line).map_err(|e| format!("write {}: {e}", tmp.display()))?;
        std::fs::rename(&tmp, self.dir.join(&name)).map_err(|e| format!("rename {name}: {e}"))?;
        self.sent += 1;
        Ok(())
    }

    /// Receives the peer's next line; an error if the peer ended the scenario (it failed).
    pub async fn recv(&mut self) -> Result<String, String> {
        let line = self.recv_raw().await?;
        if line.starts_with("end ") {
            let msg = format!("the peer failed: {line}");
            self.peer_ended = Some(line);
            return Err(msg);
        }
        Ok(line)
    }

    async fn recv_raw(&mut self) -> Result<String, String> {
        let path = self
            .dir
            .join(format!("{}.{}", self.side.other().name(), self.received));
        let t0 = Instant::now();
        loop {
            // A file appearing on a 9p share: polling is the only way to see it.
            if let Ok(line) = std::fs::read_to_string(&path) {
                self.received += 1;
                return Ok(line);
            }
            if t0.elapsed() > CTL_TIMEOUT {
                return Err(format!(
                    "control: nothing from {} within {CTL_TIMEOUT:?}",
                    self.side.other().name()
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Sends `msg` and returns the peer's line for the same step.
    pub async fn exchange(&mut self, msg: &str) -> Result<String, String> {
        self.send(msg)?;
        self.recv().await
    }

    /// Both sides reach step `name`. An error if the peer is elsewhere (it failed and went to
    /// the end of the scenario: see [`Ctl::end`]).
    pub async fn barrier(&mut self, name: &str) -> Result<(), String> {
        let theirs = self.exchange(&format!("barrier {name}")).await?;
        if theirs == format!("barrier {name}") {
            return Ok(());
        }
        Err(format!("barrier {name}: the peer is at '{theirs}'"))
    }

    /// The end of scenario `name`: both sides meet here whatever happened (a side that failed
    /// comes straight here); returns the peer's verdict line.
    pub async fn end(&mut self, name: &str, verdict: &str) -> Result<String, String> {
        self.send(&format!("end {name} {verdict}"))?;
        if let Some(line) = self.peer_ended.take() {
            return Ok(line);
        }
        loop {
            let line = self.recv_raw().await?;
            if line.starts_with(&format!("end {name} ")) {
                return Ok(line);
            }
            // Skipped: steps the peer took that this side, having failed, did not.
        }
    }
}

/// Requests a fault from scripts/rxe-pair, writing the request file itself (no shell: every
/// exec costs 0.1-0.4 s in the guests). `id` names the request: a peer that knows it can wait
/// for the same answer with [`fault_done`].
pub fn fault_request(id: &str, args: &[&str]) -> Result<(), String> {
    let ctl = ctl_dir()?;
    let side = std::env::var("RXE_PAIR_SIDE").unwrap_or_else(|_| "host".into());
    let mut text = format!("rxe-pair-request {side} {}\n", args.len());
    for a in args {
        text.push_str(a);
        text.push('\n');
    }
    text.push_str("end\n");
    let path = ctl.join("requests").join(format!("{id}.req"));
    std::fs::write(&path, text).map_err(|e| format!("write {}: {e}", path.display()))
}

/// Waits for the answer to request `id` (the host writes `requests/ID.done`, complete, once
/// the fault was applied or refused). Returns the time it was seen.
pub async fn fault_done(id: &str) -> Result<(Instant, String), String> {
    let path = ctl_dir()?.join("requests").join(format!("{id}.done"));
    let t0 = Instant::now();
    loop {
        // The only event there is: the file appearing on a 9p share (polled).
        if let Ok(text) = std::fs::read_to_string(&path) {
            let at = Instant::now();
            let mut lines = text.lines();
            let first = lines.next().unwrap_or("");
            return match first.strip_prefix("ok ") {
                Some(msg) => Ok((at, msg.to_string())),
                None => Err(format!("fault {id}: {text}")),
            };
        }
        if t0.elapsed() > Duration::from_secs(90) {
            return Err(format!("fault {id}: no answer within 90 s"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn ctl_dir() -> Result<PathBuf, String> {
    std::env::var_os("RXE_PAIR_CTL")
        .map(PathBuf::from)
        .ok_or_else(|| "RXE_PAIR_CTL not set: run under scripts/rxe-pair".into())
}

/// rxe's port counters (/sys/class/infiniband/rxe0/ports/1/hw_counters), by name.
pub fn hw_counters() -> BTreeMap<String, u64> {
    let dir = "/sys/class/infiniband/rxe0/ports/1/hw_counters";
    let mut out = BTreeMap::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Ok(v) = std::fs::read_to_string(e.path()) {
                if let Ok(n) = v.trim().parse() {
                    out.insert(name, n);
                }
            }
        }
    }
    out
}

/// The change of the interesting counters between two snapshots, as "name=N ..." (zeros left
/// out).
pub fn counter_delta(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>) -> String {
    const NAMES: [&str; 10] = [
        "sent_pkts",
        "rcvd_pkts",
        "rcvd_seq_err",
        "completer_retry_err",
        "duplicate_request",
        "out_of_sequence",
        "retry_exceeded_err",
        "rcvd_rnr_err",
        "send_rnr_err",
        "link_downed",
    ];
    let mut s = Vec::new();
    for n in NAMES {
        let d = after
            .get(n)
            .copied()
            .unwrap_or(0)
            .saturating_sub(before.get(n).copied().unwrap_or(0));
        if d > 0 || n == "sent_pkts" {
            s.push(format!("{n}={d}"));
        }
    }
    s.join(" ")
}

/// `rdma resource show` counts of rxe0: qp, cq, mr, pd, cm_id.
pub fn resource_counts() -> Result<BTreeMap<String, u64>, String> {
    let mut c = proc_stats::resource_counts("rxe0")?;
    c.retain(|k, _| ["qp", "cq", "mr", "pd", "cm_id"].contains(&k.as_str()));
    Ok(c)
}

#[allow(unused_imports)]
pub use proc_stats::rss_bytes;
