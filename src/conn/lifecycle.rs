//! A connection's life as an operator sees it, on its state ([`ConnShared`]): the setup and
//! teardown events, how this side closed, how it ended, its counters, and (feature `metrics`)
//! its place in the endpoint's registry. The identity, span and the classification are below,
//! in `observe.rs`; names and fields in `docs/observability.md`. Off the message path.

use tracing::{info, warn};

use super::observe::{ClosedBy, Ending, classify};
use super::shared::ConnShared;
use super::stats::ConnStats;
use crate::error::QpFailure;

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
    shared.obs.registry().add(shared.clone());
}

/// This side closes (`by`): notes how, the first time, then closes the state machine (`full`:
/// a full close, else a half close).
pub(crate) fn close(shared: &ConnShared, by: ClosedBy, full: bool) {
    shared.io.with(|s| {
        shared.obs.note_close(by, s.proto.peer_closed());
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
    let ending = classify(failure.as_ref(), clean, obs.closed_by(), obs.peer_first());
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
        lifetime = ?obs.lifetime(),
        messages_sent = c.messages_sent,
        messages_received = c.messages_received,
        bytes_sent = c.bytes_sent,
        bytes_received = c.bytes_received,
        "connection closed"
    );
    #[cfg(feature = "metrics")]
    obs.registry().ended(obs.id, obs.peer, stats);
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
impl super::observe::Source for ConnShared {
    fn observed(&self) -> &super::observe::Observed {
        &self.obs
    }

    fn stats(&self) -> ConnStats {
        stats(self)
    }
}
