//! Posting the table's queued requests: one chained list per queue (one doorbell), work
//! requests built on the stack, no allocation.

use tracing::warn;

use super::counters::{Counters, add_held};
use super::deferred::Deferred;
use super::state::State;
use crate::error::Error;
use crate::proto::{PostItem, QpKey, Queue, WorkRequest};
use crate::verbs::{QueuePair, RecvWr, SendWr};

/// Requests chained per doorbell (a longer batch rings several; built on the stack, as the
/// verbs layer chains up to the same number without allocating).
const CHAIN: usize = crate::verbs::STACK_CHAIN;

/// Posts everything of `qp` that fits, as chained lists. A failed post fails the queue pair
/// (and has `wake` move it to the error state once the lock is released, so its posted
/// requests get flushed).
pub(crate) fn post(st: &mut State, counters: &Counters, qp: QpKey, wake: &mut Deferred) {
    let mut posts = std::mem::take(&mut st.posts);
    posts.clear();
    st.core.take_postable(qp, &mut posts);
    if !posts.is_empty() {
        let handle = &st.entry(qp).expect("registered").qp;
        let recv_end = posts
            .iter()
            .take_while(|p| p.wr.queue == Queue::Recv)
            .count();
        let (recvs, sends) = posts.split_at(recv_end);
        let (rdb, r) = post_recvs(handle, recvs);
        let (sdb, s) = if r.is_ok() {
            post_sends(handle, sends)
        } else {
            (0, Ok(()))
        };
        let failed = match (r, s) {
            (Err((bad, errno)), _) => Some((bad, errno)),
            (Ok(()), Err((bad, errno))) => Some((recv_end + bad, errno)),
            _ => None,
        };
        if let Some((first_bad, errno)) = failed {
            // Everything from the first request that did not reach the device on (the error
            // path may allocate).
            let ids: Vec<u64> = posts[first_bad..].iter().map(|p| p.wr_id).collect();
            let handle = handle.clone();
            not_posted(st, qp, &handle, &ids, errno, wake);
        }
        add_held(&counters.posted, posts.len() as u64, st);
        add_held(&counters.doorbells, rdb + sdb, st);
    }
    st.posts = posts;
    st.apply_failures(wake);
}

/// Posts one request the core accepted with
/// [`Core::submit_posted`](crate::proto::Core::submit_posted), straight from the future that
/// holds it (the driver's fast path: one doorbell, nothing copied into the core or a list).
/// A failed post fails the queue pair, as in [`post`].
#[inline]
pub(crate) fn post_one(
    st: &mut State,
    counters: &Counters,
    qp: QpKey,
    wr_id: u64,
    req: &WorkRequest,
    signaled: bool,
    wake: &mut Deferred,
) {
    let handle = &st.entry(qp).expect("registered").qp;
    let r = match req.queue {
        // SAFETY: the receive buffer stays with its future (or, once the future is dropped,
        // parked in the table) until the receive completes.
        Queue::Recv => unsafe { handle.post_recv_one(&RecvWr::new(wr_id, req.sges.as_slice())) },
        // SAFETY: its SGEs name memory its operation's future (or the table, once the future
        // is dropped) keeps allocated, registered and untouched until its completion.
        Queue::Send => unsafe { handle.post_send_one(&send_wr(wr_id, req, signaled)) },
    };
    add_held(&counters.posted, 1, st);
    add_held(&counters.doorbells, 1, st);
    if let Err(e) = r {
        let (_, errno) = post_error(e);
        let handle = handle.clone();
        not_posted(st, qp, &handle, &[wr_id], errno, wake);
        st.apply_failures(wake);
    }
}

/// Posts sends the core accepted with
/// [`Core::submit_posted_sends`](crate::proto::Core::submit_posted_sends) as one chain (one
/// doorbell), straight from the batch that holds them; `ids[i]` is `wrs[i]`'s id. A failed
/// post fails the queue pair and the requests from the first one not posted on, as in
/// [`post`].
///
/// # Safety
///
/// Each request's SGEs name memory that stays allocated, registered and untouched until the
/// core applies its completion (its batch holds it, or the table once the batch is dropped).
pub(crate) unsafe fn post_send_list(
    st: &mut State,
    counters: &Counters,
    qp: QpKey,
    wrs: &[SendWr<'_>],
    ids: &[u64],
    wake: &mut Deferred,
) {
    let handle = &st.entry(qp).expect("registered").qp;
    // SAFETY: the caller keeps each request's memory as this function's contract says.
    let r = unsafe { handle.post_send(wrs) };
    add_held(&counters.posted, wrs.len() as u64, st);
    add_held(&counters.doorbells, 1, st);
    if let Err(e) = r {
        let (bad, errno) = post_error(e);
        let handle = handle.clone();
        not_posted(st, qp, &handle, &ids[bad.min(ids.len())..], errno, wake);
        st.apply_failures(wake);
    }
}

/// Requests `ids` of `qp` never reached the device (the post failed with `errno`): they fail,
/// and so does the queue pair.
fn not_posted(
    st: &mut State,
    qp: QpKey,
    handle: &QueuePair,
    ids: &[u64],
    errno: i32,
    wake: &mut Deferred,
) {
    st.core.post_failed(qp, ids, errno, &mut st.out);
    if st.core.has_posted_sends(qp) {
        // Sends posted before the failure may have executed unsignaled: move the QP to ERR,
        // then post a signaled drain marker whose flush retires all of them (both after the
        // lock is released; the marker counts as posted from now on, so the key stays until
        // its flush).
        let wr_id = st.core.drain_marker(qp);
        wake.move_to_error(handle, Some(wr_id));
    }
}

/// The work request to post for `req`.
#[inline]
pub(crate) fn send_wr(wr_id: u64, req: &WorkRequest, signaled: bool) -> SendWr<'_> {
    SendWr {
        wr_id,
        op: req.op,
        sges: req.sges.as_slice(),
        signaled,
        inline: req.inline,
        solicited: req.solicited,
        fence: false,
    }
}

/// The work request of a queued item.
fn wr(p: &PostItem) -> SendWr<'_> {
    send_wr(p.wr_id, &p.wr, p.signaled)
}

/// Posts `items` in chains of up to [`CHAIN`]; returns the doorbells rung, or the index of
/// the first request not posted and the errno.
fn post_sends(qp: &QueuePair, items: &[PostItem]) -> (u64, Result<(), (usize, i32)>) {
    // The SGEs name memory owned by each operation's future (or parked in the table once the
    // future is dropped) until the core applies its completion or retirement: so it stays
    // allocated, registered and unused locally until the device is done.
    if let [one] = items {
        // A lone request (every latency-bound operation): no chain array to set up.
        // SAFETY: its SGEs name memory its operation's future (or the table, once the future
        // is dropped) keeps allocated, registered and untouched until its completion.
        let r = unsafe { qp.post_send(&[wr(one)]) };
        return (1, r.map_err(post_error));
    }
    let mut doorbells = 0;
    for (c, chunk) in items.chunks(CHAIN).enumerate() {
        let mut wrs = [const { SendWr::EMPTY }; CHAIN];
        for (w, p) in wrs.iter_mut().zip(chunk) {
            *w = wr(p);
        }
        doorbells += 1;
        // SAFETY: each request's SGEs name memory its future (or the table) keeps allocated,
        // registered and untouched until its completion.
        if let Err(e) = unsafe { qp.post_send(&wrs[..chunk.len()]) } {
            let (bad, errno) = post_error(e);
            return (doorbells, Err((c * CHAIN + bad, errno)));
        }
    }
    (doorbells, Ok(()))
}

fn post_recvs(qp: &QueuePair, items: &[PostItem]) -> (u64, Result<(), (usize, i32)>) {
    // The receive buffers stay with their futures (or parked) until the receive completes.
    if let [one] = items {
        // SAFETY: the receive buffer stays with its future (or parked in the table) until the
        // receive completes; a lone request needs no chain array.
        let r = unsafe { qp.post_recv(&[RecvWr::new(one.wr_id, one.wr.sges.as_slice())]) };
        return (1, r.map_err(post_error));
    }
    let mut doorbells = 0;
    for (c, chunk) in items.chunks(CHAIN).enumerate() {
        let mut wrs = [const { RecvWr::EMPTY }; CHAIN];
        for (w, p) in wrs.iter_mut().zip(chunk) {
            *w = RecvWr::new(p.wr_id, p.wr.sges.as_slice());
        }
        doorbells += 1;
        // SAFETY: each receive buffer stays with its future (or parked in the table) until
        // its receive completes.
        if let Err(e) = unsafe { qp.post_recv(&wrs[..chunk.len()]) } {
            let (bad, errno) = post_error(e);
            return (doorbells, Err((c * CHAIN + bad, errno)));
        }
    }
    (doorbells, Ok(()))
}

fn post_error(e: Error) -> (usize, i32) {
    warn!(error = %e, "posting work requests failed");
    let errno = e.raw_os_error().unwrap_or(libc::EIO);
    match e {
        Error::PostSend { bad_index, .. } | Error::PostRecv { bad_index, .. } => (bad_index, errno),
        _ => (0, errno),
    }
}
