//! What an operator sees of a connection without polling it: its id (unique per
//! [`Endpoint`]), the `conn` span that carries the id, the peer and the local queue pair
//! number, and one event each for setup, failure and teardown (how it ended). With the
//! `metrics` feature, also the registry the endpoint's exporter reads the live connections'
//! counters from (`crate::metrics`). Nothing here is on the message path: it runs at setup,
//! at close and at teardown. The names are in `docs/observability.md`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Instant;

use tracing::field::Empty;
use tracing::{Span, info, info_span, warn};

use super::connection::ConnStats;
use super::shared::ConnShared;
use crate::endpoint::Endpoint;
use crate::error::{Error, QpFailure};

/// The `conn` span of a connection being set up on `side` ("client" or "server") with `peer`:
/// `conn_id` and `qpn` are recorded once known ([`assign_id`], [`record_qpn`]).
pub(crate) fn conn_span(peer: Option<SocketAddr>, side: &'static str) -> Span {
    match peer {
        Some(p) => info_span!("conn", peer = %p, side, conn_id = Empty, qpn = Empty),
        None => info_span!("conn", peer = "unknown", side, conn_id = Empty, qpn = Empty),
    }
}

/// Takes the next connection id of `endpoint` and records it on `span`.
pub(crate) fn assign_id(span: &Span, endpoint: &Endpoint) -> u64 {
    let id = endpoint.next_connection_id();
    span.record("conn_id", id);
    id
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

/// A connection's identity and what its teardown event needs, kept in [`ConnShared`].
#[derive(Debug)]
pub(crate) struct Observed {
    /// The id, unique among the connections of its endpoint.
    pub(crate) id: u64,
    /// The `conn` span (with `conn_id`, `qpn`, `peer`, `side`).
    pub(crate) span: Span,
    pub(crate) peer: Option<SocketAddr>,
    started: Instant,
    closed_by: AtomicU8,
    /// The peer's end of stream had arrived when this side closed (0/1).
    peer_first: AtomicU8,
    #[cfg(feature = "metrics")]
    registry: std::sync::Arc<Registry>,
}

impl Observed {
    /// The connection `id` of `endpoint`, with its `span`, once set up.
    pub(crate) fn new(span: Span, id: u64, endpoint: &Endpoint) -> Observed {
        #[cfg(not(feature = "metrics"))]
        let _ = endpoint;
        Observed {
            id,
            span,
            peer: None,
            started: Instant::now(),
            closed_by: AtomicU8::new(ClosedBy::Open as u8),
            peer_first: AtomicU8::new(0),
            #[cfg(feature = "metrics")]
            registry: endpoint.conn_registry().clone(),
        }
    }

    fn closed_by(&self) -> ClosedBy {
        match self.closed_by.load(Ordering::Acquire) {
            1 => ClosedBy::Close,
            2 => ClosedBy::Drop,
            _ => ClosedBy::Open,
        }
    }
}

/// The setup event: the connection is established (`shared` is its new state).
pub(crate) fn established(shared: &std::sync::Arc<ConnShared>) {
    let p = &shared.params;
    info!(
        parent: &shared.obs.span,
        recv_credits = p.recv_credits,
        send_credits = p.send_credits,
        recv_buf_size = p.recv_buf_size,
        max_send_size = p.max_send_size,
        rendezvous = p.rendezvous,
        "connection established"
    );
    #[cfg(feature = "metrics")]
    shared.obs.registry.add(shared);
}

/// This side closes (`by`): notes how, the first time, then closes the state machine (`full`:
/// a full close, else a half close).
pub(crate) fn close(shared: &ConnShared, by: ClosedBy, full: bool) {
    shared.io.with(|s| {
        let obs = &shared.obs;
        if obs
            .closed_by
            .compare_exchange(
                ClosedBy::Open as u8,
                by as u8,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
        {
            obs.peer_first
                .store(u8::from(s.proto.peer_closed()), Ordering::Release);
        }
        if full {
            s.proto.close_full();
        } else {
            s.proto.close();
        }
    });
}

/// The teardown starts: how the connection ended, from its state now (before the teardown
/// fails it with `Closed`); a failure's event goes out here.
pub(crate) fn teardown_started(shared: &ConnShared) -> (Ending, Option<QpFailure>) {
    // Read only (no pump: the teardown's own first step follows).
    let (failure, clean) = {
        let s = shared.io.lock();
        let unaccounted = super::io::ConnIo::data_sends_outstanding(&s);
        (
            s.proto.failure().cloned(),
            s.proto.close_outcome(unaccounted).is_ok(),
        )
    };
    let obs = &shared.obs;
    let ending = classify(
        failure.as_ref(),
        clean,
        obs.closed_by(),
        obs.peer_first.load(Ordering::Acquire) == 1,
    );
    if let (Ending::Error | Ending::KeepaliveTimeout, Some(f)) = (ending, &failure) {
        warn!(parent: &obs.span, error = %f, detail = ?f, "connection failed");
    }
    (ending, failure)
}

/// The teardown event: the connection is gone (`drained`: every work request flushed), with
/// its lifetime totals.
pub(crate) fn torn_down(
    shared: &ConnShared,
    ending: Ending,
    cause: Option<&QpFailure>,
    drained: bool,
) {
    let stats = stats(shared);
    let c = &stats.protocol;
    let obs = &shared.obs;
    info!(
        parent: &obs.span,
        ending = ending.as_str(),
        cause = cause.map(tracing::field::display),
        drained,
        lifetime = ?obs.started.elapsed(),
        messages_sent = c.messages_sent,
        messages_received = c.messages_received,
        bytes_sent = c.bytes_sent,
        bytes_received = c.bytes_received,
        "connection closed"
    );
    #[cfg(feature = "metrics")]
    obs.registry.ended(obs.id, obs.peer, stats);
}

/// Counters of the connection `shared` ([`Connection::stats`](super::Connection::stats)).
pub(crate) fn stats(shared: &ConnShared) -> ConnStats {
    let (protocol, held, sent, recvd) = {
        let s = shared.io.lock();
        (
            s.proto.counters(),
            s.proto.held().0,
            s.sent_bytes,
            s.recv_bytes,
        )
    };
    ConnStats {
        protocol,
        recv_bytes_held: held,
        buffer_bytes_in_use: shared.io.buffer_bytes_in_use(),
        send_bytes_inline: sent.inline,
        send_bytes_copied: sent.staged,
        send_bytes_zero_copy: sent.zero_copy,
        recv_bytes_copied: recvd.copied + protocol.bytes_reassembled,
        recv_bytes_fetched: recvd.fetched,
        recv_pool: shared.io.pool().metrics(),
        staging_pool: shared.io.staging().metrics(),
    }
}

#[cfg(feature = "metrics")]
pub(crate) use registry::{ConnSnapshot, Registry};

/// The live connections of an endpoint, for its metrics exporter.
#[cfg(feature = "metrics")]
mod registry {
    use std::collections::HashMap;
    use std::net::SocketAddr;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex, MutexGuard, Weak};

    use super::super::connection::ConnStats;
    use super::super::shared::ConnShared;

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
        live: HashMap<u64, Weak<ConnShared>>,
        ended: Vec<ConnSnapshot>,
    }

    impl Registry {
        fn lock(&self) -> MutexGuard<'_, Inner> {
            self.inner.lock().unwrap_or_else(|e| e.into_inner())
        }

        pub(crate) fn add(&self, shared: &Arc<ConnShared>) {
            self.lock()
                .live
                .insert(shared.obs.id, Arc::downgrade(shared));
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
                    id: c.obs.id,
                    peer: c.obs.peer,
                    stats: super::stats(c),
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
