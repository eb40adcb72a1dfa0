//! The close phase of the scale run: every connection closed on both sides with `close()`,
//! each call timed (an HDR histogram of the durations), and every result counted by kind.
//!
//! Two patterns (`--close-pattern`):
//!
//! * `half`: a client half-closes (`shutdown`), reads the server's end of stream, then calls
//!   `close`; its server reads the client's end of stream, then calls `close`.
//! * `full`: a client calls `close` at once (it does not wait for the server's end of stream);
//!   its server reads the client's end of stream, then calls `close`.
//!
//! Every message was verified before this phase, so both are clean closes on both sides:
//! every `close` must return `Ok` (the run fails otherwise).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_rdma::conn::Connection;

/// How the two ends of a connection close (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum ClosePattern {
    /// Client: `shutdown`, `recv` -> end of stream, `close`. Server: `recv` -> end of stream,
    /// `close`.
    Half,
    /// Client: `close` at once. Server: `recv` -> end of stream, `close`.
    Full,
}

/// What the close phase measured.
pub(crate) struct CloseReport {
    /// Seconds from the first close to the last one's return.
    pub(crate) secs: f64,
    /// Durations of the `close()` calls (both sides), in nanoseconds.
    pub(crate) hist: hdrhistogram::Histogram<u64>,
    /// `close()` results by kind: `"Ok"` or the error's text, with how many of each side.
    pub(crate) results: BTreeMap<String, (u64, u64)>,
}

impl CloseReport {
    /// `close()` calls that returned an error.
    pub(crate) fn errors(&self) -> u64 {
        self.results
            .iter()
            .filter(|(k, _)| k.as_str() != "Ok")
            .map(|(_, (c, s))| c + s)
            .sum()
    }

    /// One line: the distribution of close durations.
    pub(crate) fn distribution_line(&self) -> String {
        let ms = |ns: u64| ns as f64 / 1e6;
        let h = &self.hist;
        format!(
            "close: {} close() calls in {:.2} s: p50 {:.1} ms, p90 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
            h.len(),
            self.secs,
            ms(h.value_at_quantile(0.50)),
            ms(h.value_at_quantile(0.90)),
            ms(h.value_at_quantile(0.99)),
            ms(h.max()),
        )
    }

    /// One line: the results by kind (client / server).
    pub(crate) fn results_line(&self) -> String {
        let kinds: Vec<String> = self
            .results
            .iter()
            .map(|(k, (c, s))| format!("{k}: {} (client {c}, server {s})", c + s))
            .collect();
        format!("close results: {}", kinds.join("; "))
    }
}

fn kind(r: &tokio_rdma::Result<()>) -> String {
    match r {
        Ok(()) => "Ok".to_string(),
        Err(e) => format!("Err({e})"),
    }
}

/// Closes every connection on both sides with `pattern`, at most `limit` connections closing
/// at once (`None`: all at once). Reading the peer's end of stream must succeed (anything
/// else fails the run); each `close()` is timed and its result counted.
pub(crate) async fn close_all(
    clients: Vec<Connection>,
    servers: Vec<Connection>,
    pattern: ClosePattern,
    limit: Option<usize>,
) -> Result<CloseReport, String> {
    let sem = Arc::new(Semaphore::new(limit.unwrap_or(Semaphore::MAX_PERMITS)));
    let start = Instant::now();
    let mut set = JoinSet::new();
    // A connection's two ends go together (one permit): the server side of client `i` is not
    // known here (the accept order differs), so the permits pace the clients; a server end
    // closes when its client's end of stream arrives.
    for c in clients {
        let sem = sem.clone();
        set.spawn(async move {
            let _permit = sem.acquire_owned().await.expect("semaphore");
            if pattern == ClosePattern::Half {
                c.shutdown()
                    .await
                    .map_err(|e| format!("client shutdown: {e}"))?;
                match c.recv().await {
                    Ok(None) => {}
                    Ok(Some(_)) => return Err("client: a message after the last one".to_string()),
                    Err(e) => return Err(format!("client recv at close: {e}")),
                }
            }
            let t0 = Instant::now();
            let r = c.close().await;
            Ok((true, t0.elapsed(), kind(&r)))
        });
    }
    for s in servers {
        set.spawn(async move {
            match s.recv().await {
                Ok(None) => {}
                Ok(Some(_)) => return Err("server: a message after the last one".to_string()),
                Err(e) => return Err(format!("server recv at close: {e}")),
            }
            let t0 = Instant::now();
            let r = s.close().await;
            Ok((false, t0.elapsed(), kind(&r)))
        });
    }
    let mut hist = super::common::histogram();
    let mut results: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    while let Some(r) = set.join_next().await {
        let (client, took, k) = r.expect("close task")?;
        super::common::record(&mut hist, took);
        let e = results.entry(k).or_default();
        if client {
            e.0 += 1;
        } else {
            e.1 += 1;
        }
    }
    Ok(CloseReport {
        secs: start.elapsed().as_secs_f64(),
        hist,
        results,
    })
}
