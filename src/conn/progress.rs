//! Waiting on a connection's state with its completions polled in place ([`Progress`]), and
//! the wait for the end of stream's delivery that `shutdown` and `close` share.

use std::task::{Context, Poll};

use super::connection::Connection;
use super::io::ConnState;
use crate::driver::{Deferred, WaitKind, Waiter};
use crate::error::Result;

impl Connection {
    /// Waits until end of stream was sent and acknowledged (or the connection failed).
    pub(super) async fn wait_close(&self) -> Result<()> {
        Progress::new(self)
            .run(|s, cx| s.proto.poll_close(cx))
            .await
    }
}

/// Waits on the connection's state with completions polled in place: each poll first looks at
/// the state, then polls the completion queue itself (the connection's completions go straight
/// into its state machine) and looks again, then spins or sleeps as the endpoint's completion
/// mode says. No task sits between a completion and the future that waits for it.
pub(crate) struct Progress<'a> {
    conn: &'a Connection,
    waiter: Waiter,
    /// What the in-place polls leave to run after the driver's lock: set up once per wait,
    /// at its first in-place poll (a wait that finds its answer at the first look, as a
    /// small message's send mostly does, sets up and drops none).
    wake: Option<Deferred>,
    /// A receive's wait: while the state holds nothing to receive (the connection's hint),
    /// each poll of the future polls the completion queue before it looks, so a message
    /// found there is taken in one look, with no waker registered for it first.
    receiving: bool,
}

impl<'a> Progress<'a> {
    pub(crate) fn new(conn: &'a Connection) -> Progress<'a> {
        let mut waiter = Waiter::default();
        waiter.start(conn.shared.qp.shared());
        Progress {
            conn,
            waiter,
            wake: None,
            receiving: false,
        }
    }

    /// A receive's wait (see `receiving`).
    pub(crate) fn receiving(conn: &'a Connection) -> Progress<'a> {
        let mut p = Progress::new(conn);
        p.receiving = true;
        p
    }

    pub(crate) async fn run<T>(
        &mut self,
        mut f: impl FnMut(&mut ConnState, &mut Context<'_>) -> Poll<Result<T>>,
    ) -> Result<T> {
        // The state's change count when `f` last looked (read under the lock, so any later
        // change counts past it): while spinning, `f` (and the state machine's pump behind
        // `with`) runs again only once something changed.
        let mut seen: Option<u64> = None;
        // The waker `f` registered last: polled with another one (the future moved to another
        // task, as a stream's write that goes on in a task of its own), `f` must look again to
        // register it, changed state or not.
        let mut registered: Option<std::task::Waker> = None;
        std::future::poll_fn(|cx| {
            // Tokio's cooperative budget, as its own I/O types: a task whose operations are
            // always ready at once (queued messages, completions found in place) still yields
            // to the runtime's other tasks once its budget is spent.
            let coop = std::task::ready!(tokio::task::coop::poll_proceed(cx));
            if !registered.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                registered = Some(cx.waker().clone());
                seen = None;
            }
            let conn = &self.conn.shared;
            let io = &conn.io;
            // Looks at the state unless it is unchanged since the last look. Looks first, then polls in place as many times as the mode says (none in event
            // mode: see `Shared::in_place_polls`), looking again after each poll that changed
            // the state.
            let polls = conn.qp.shared().in_place_polls();
            // A receive with nothing to take polls first: its first look then finds what
            // the poll delivered. Whatever the order, it looks at least once before it
            // returns `Pending` (`seen` is unset until it has looked with this waker).
            let first = u32::from(self.receiving && polls > 0 && io.recv_idle_hint());
            for n in first..=polls {
                if n > 0 {
                    if n > 1 {
                        std::hint::spin_loop();
                    }
                    conn.qp
                        .poll_completions_into(self.wake.get_or_insert_with(Deferred::default));
                }
                if seen == Some(io.changes()) {
                    continue;
                }
                let looked = io.with(|s| {
                    seen = Some(io.changes());
                    f(s, cx)
                });
                if let Poll::Ready(v) = looked {
                    coop.made_progress();
                    self.waiter.done(conn.qp.shared(), WaitKind::Recv);
                    return Poll::Ready(v);
                }
            }
            // `f` registered this task's waker the last time it looked; nothing changed since.
            if self.waiter.keep_spinning(conn.qp.shared(), WaitKind::Recv) {
                cx.waker().wake_by_ref();
            }
            // A connection's driver has sinks: its sleepers never watch the channel
            // themselves (`driver::watch`), the completion task does.
            self.waiter.kick_if_due(conn.qp.shared());
            Poll::Pending
        })
        .await
    }
}

impl Drop for Progress<'_> {
    fn drop(&mut self) {
        self.waiter.leave(self.conn.shared.qp.shared());
    }
}
