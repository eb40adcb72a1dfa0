//! What an operator sees of a connection without polling it: its id (unique per
//! endpoint, a counter of its `Device`), the `conn` span that carries the id, the peer and the local queue pair
//! number, and one event each for setup, failure and teardown (how it ended). With the
//! `metrics` feature, also the registry the endpoint's exporter reads the live connections'
//! counters from (`export.rs`). Nothing here is on the message path: it runs at setup, at
//! close and at teardown. The events that need the connection's state are in `lifecycle.rs`.
//! The names are in `docs/observability.md`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Instant;

use tracing::field::Empty;
use tracing::{Span, info_span, warn};

use crate::error::{Error, QpFailure};

/// The `conn` span of a connection being set up on `side` ("client" or "server") with `peer`:
/// `conn_id` and `qpn` are recorded once known ([`record_id`], [`record_qpn`]).
pub(crate) fn conn_span(peer: Option<SocketAddr>, side: &'static str) -> Span {
    match peer {
        Some(p) => info_span!("conn", peer = %p, side, conn_id = Empty, qpn = Empty),
        None => info_span!("conn", peer = "unknown", side, conn_id = Empty, qpn = Empty),
    }
}

/// Records the connection's id on `span`.
pub(crate) fn record_id(span: &Span, id: u64) {
    span.record("conn_id", id);
}

/// Records the local queue pair number on `span`.
pub(crate) fn record_qpn(span: &Span, qpn: u32) {
    span.record("qpn", qpn);
}

/// The failure event of a connection whose setup failed (`span` is its `conn` span).
pub(crate) fn setup_failed(span: &Span, e: &Error) {
    warn!(parent: span, error = %e, detail = ?e, "connection setup failed");
}

/// How this side closed, first call wins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum ClosedBy {
    /// Not closed by this side (yet).
    Open = 0,
    /// [`Connection::close`](super::Connection::close) or
    /// [`shutdown`](super::Connection::shutdown).
    Close = 1,
    /// The handle (or a stream's write half) was dropped without a close.
    Drop = 2,
}

/// How a connection ended, as its teardown event's `ending` field says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ending {
    /// This side closed first (`close()`, `shutdown()`) and its end of stream was delivered.
    Close,
    /// The peer's end of stream came first (this side closed after it, or not at all).
    PeerClose,
    /// This side's handle was dropped without a close; its end of stream was delivered.
    Drop,
    /// The peer did not answer a keepalive in time.
    KeepaliveTimeout,
    /// Any other failure (the cause is in the event).
    Error,
}

impl Ending {
    /// The `ending` field's value.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Ending::Close => "close",
            Ending::PeerClose => "peer_close",
            Ending::Drop => "drop",
            Ending::KeepaliveTimeout => "keepalive_timeout",
            Ending::Error => "error",
        }
    }
}

/// How a connection ended, from its state when the teardown starts: `clean` is what `close`
/// reports (this side's end of stream delivered, or the peer's arrived with nothing of ours
/// lost), `peer_first` whether the peer's end of stream had arrived when this side closed.
pub(crate) fn classify(
    failure: Option<&QpFailure>,
    clean: bool,
    closed_by: ClosedBy,
    peer_first: bool,
) -> Ending {
    if matches!(failure, Some(QpFailure::KeepaliveTimeout(_))) {
        return Ending::KeepaliveTimeout;
    }
    if !clean {
        return Ending::Error;
    }
    match closed_by {
        _ if peer_first => Ending::PeerClose,
        ClosedBy::Open => Ending::PeerClose,
        ClosedBy::Close => Ending::Close,
        ClosedBy::Drop => Ending::Drop,
    }
}

/// A connection's identity and what its teardown event needs, kept in its `ConnShared`.
#[derive(Debug)]
pub(crate) struct Observed {
    /// The id, unique among the connections of its endpoint.
    pub(crate) id: u64,
    /// The `conn` span (with `conn_id`, `qpn`, `peer`, `side`).
    pub(crate) span: Span,
    /// The peer's address (set once established).
    pub(crate) peer: Option<SocketAddr>,
    started: Instant,
    closed_by: AtomicU8,
    /// The peer's end of stream had arrived when this side closed (0/1).
    peer_first: AtomicU8,
    #[cfg(feature = "metrics")]
    registry: std::sync::Arc<Registry>,
}

impl Observed {
    /// The connection `id` with its `span`; `registry`: its endpoint's (feature `metrics`).
    pub(crate) fn new(
        span: Span,
        id: u64,
        #[cfg(feature = "metrics")] registry: std::sync::Arc<Registry>,
    ) -> Observed {
        Observed {
            id,
            span,
            peer: None,
            started: Instant::now(),
            closed_by: AtomicU8::new(ClosedBy::Open as u8),
            peer_first: AtomicU8::new(0),
            #[cfg(feature = "metrics")]
            registry,
        }
    }

    /// How this side closed so far.
    pub(crate) fn closed_by(&self) -> ClosedBy {
        match self.closed_by.load(Ordering::Acquire) {
            1 => ClosedBy::Close,
            2 => ClosedBy::Drop,
            _ => ClosedBy::Open,
        }
    }

    /// This side closes (`by`): noted the first time, with whether the peer's end of stream
    /// had arrived (`peer_closed`).
    pub(crate) fn note_close(&self, by: ClosedBy, peer_closed: bool) {
        if self
            .closed_by
            .compare_exchange(
                ClosedBy::Open as u8,
                by as u8,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
        {
            self.peer_first
                .store(u8::from(peer_closed), Ordering::Release);
        }
    }

    /// Whether the peer's end of stream had arrived when this side closed.
    pub(crate) fn peer_first(&self) -> bool {
        self.peer_first.load(Ordering::Acquire) == 1
    }

    /// How long since the connection was set up.
    pub(crate) fn lifetime(&self) -> std::time::Duration {
        self.started.elapsed()
    }

    /// The endpoint's registry of live connections.
    #[cfg(feature = "metrics")]
    pub(crate) fn registry(&self) -> &Registry {
        &self.registry
    }
}

#[cfg(feature = "metrics")]
pub(crate) use registry::{ConnSnapshot, Registry, Source};

/// The live connections of an endpoint, for its metrics exporter.
#[cfg(feature = "metrics")]
mod registry {
    use std::collections::HashMap;
    use std::net::SocketAddr;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex, MutexGuard, Weak};

    use super::Observed;
    use crate::conn::stats::ConnStats;

    /// A live connection as the registry sees it (its state, in `lifecycle.rs`).
    pub(crate) trait Source: Send + Sync {
        /// Its identity.
        fn observed(&self) -> &Observed;
        /// Its counters now.
        fn stats(&self) -> ConnStats;
    }

    /// One connection's counters at an export.
    #[derive(Debug)]
    pub(crate) struct ConnSnapshot {
        pub(crate) id: u64,
        pub(crate) peer: Option<SocketAddr>,
        pub(crate) stats: ConnStats,
        /// `false`: the connection ended; these are its final counters (reported once).
        pub(crate) open: bool,
    }

    /// The endpoint's connections: a weak handle of each live one, and the final counters of
    /// those that ended since the last export (kept only while an exporter runs).
    #[derive(Debug, Default)]
    pub(crate) struct Registry {
        inner: Mutex<Inner>,
        exporting: AtomicBool,
    }

    #[derive(Debug, Default)]
    struct Inner {
        live: HashMap<u64, Weak<dyn Source>>,
        ended: Vec<ConnSnapshot>,
    }

    impl Registry {
        fn lock(&self) -> MutexGuard<'_, Inner> {
            self.inner.lock().unwrap_or_else(|e| e.into_inner())
        }

        pub(crate) fn add(&self, conn: Arc<dyn Source>) {
            let id = conn.observed().id;
            self.lock().live.insert(id, Arc::downgrade(&conn));
        }

        pub(crate) fn ended(&self, id: u64, peer: Option<SocketAddr>, stats: ConnStats) {
            let mut g = self.lock();
            g.live.remove(&id);
            if self.exporting.load(Ordering::Acquire) {
                g.ended.push(ConnSnapshot {
                    id,
                    peer,
                    stats,
                    open: false,
                });
            }
        }

        /// Claims the registry for one exporter; `false` if one runs already.
        pub(crate) fn start_export(&self) -> bool {
            !self.exporting.swap(true, Ordering::AcqRel)
        }

        /// The exporter stopped: ended connections are no longer kept.
        pub(crate) fn stop_export(&self) {
            self.exporting.store(false, Ordering::Release);
            self.lock().ended.clear();
        }

        /// The live connections' counters, then those of the connections that ended since
        /// the last call (taken).
        pub(crate) fn snapshot(&self) -> Vec<ConnSnapshot> {
            let (live, ended): (Vec<_>, Vec<_>) = {
                let mut g = self.lock();
                g.live.retain(|_, w| w.strong_count() > 0);
                let live = g.live.values().filter_map(Weak::upgrade).collect();
                (live, std::mem::take(&mut g.ended))
            };
            // Counted outside the registry's lock (each takes its connection's lock).
            let mut out: Vec<ConnSnapshot> = live
                .iter()
                .map(|c| ConnSnapshot {
                    id: c.observed().id,
                    peer: c.observed().peer,
                    stats: c.stats(),
                    open: true,
                })
                .collect();
            out.extend(ended);
            out
        }

        /// Live connections now.
        pub(crate) fn live(&self) -> usize {
            self.lock().live.len()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::WcStatus;

    #[test]
    fn teardown_ending_names_who_closed_and_how() {
        let ka = QpFailure::KeepaliveTimeout(std::time::Duration::from_secs(3));
        let wc = QpFailure::WorkCompletion {
            status: WcStatus::RetryExcErr,
            vendor_err: 0,
        };
        let gone = QpFailure::Disconnected;
        // Clean ends: who closed first, and how this side closed.
        assert_eq!(classify(None, true, ClosedBy::Close, false), Ending::Close);
        assert_eq!(classify(None, true, ClosedBy::Drop, false), Ending::Drop);
        assert_eq!(
            classify(None, true, ClosedBy::Close, true),
            Ending::PeerClose
        );
        assert_eq!(
            classify(Some(&gone), true, ClosedBy::Open, false),
            Ending::PeerClose,
            "the peer's end of stream, then its disconnect, before this side closed"
        );
        // A transport error after both ends of stream is not a failure of the connection.
        assert_eq!(
            classify(Some(&wc), true, ClosedBy::Close, false),
            Ending::Close
        );
        // Failures.
        assert_eq!(
            classify(Some(&ka), false, ClosedBy::Open, false),
            Ending::KeepaliveTimeout
        );
        assert_eq!(
            classify(Some(&ka), true, ClosedBy::Close, false),
            Ending::KeepaliveTimeout,
            "the peer died while this side waited for its end of stream"
        );
        assert_eq!(
            classify(Some(&wc), false, ClosedBy::Close, false),
            Ending::Error
        );
        assert_eq!(
            classify(Some(&gone), false, ClosedBy::Open, false),
            Ending::Error,
            "a disconnect without the peer's end of stream"
        );
        let names: Vec<_> = [
            Ending::Close,
            Ending::PeerClose,
            Ending::Drop,
            Ending::KeepaliveTimeout,
            Ending::Error,
        ]
        .iter()
        .map(|e| e.as_str())
        .collect();
        assert_eq!(
            names,
            ["close", "peer_close", "drop", "keepalive_timeout", "error"]
        );
    }
}
