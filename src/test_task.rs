//! A future polled by hand under a waker that records its wake-ups: what the unit tests of
//! wakers (the pool's waiters, the driver's kick) need. The crate does not depend on
//! tokio-test for this: its dependency on Tokio's `test-util` feature would reach every
//! example too (Cargo unifies the features of dev-dependencies), and that feature's mockable
//! clock takes a lock and reads the clock twice on every `Instant` Tokio's time driver reads,
//! so the benchmarks and the ping-pong example would measure a slower Tokio than users run
//! (about 500 instructions per event-mode message round trip).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Wake, Waker};

/// Records whether it was woken since the last poll.
#[derive(Default)]
struct Woken(AtomicBool);

impl Wake for Woken {
    fn wake(self: Arc<Self>) {
        self.0.store(true, Ordering::SeqCst);
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// A future (or any value, for [`enter`](MockTask::enter)) and the waker it is polled with.
pub(crate) struct MockTask<F> {
    fut: Pin<Box<F>>,
    woken: Arc<Woken>,
    waker: Waker,
}

/// Wraps `fut` for polling by hand.
pub(crate) fn spawn<F>(fut: F) -> MockTask<F> {
    let woken = Arc::new(Woken::default());
    MockTask {
        fut: Box::pin(fut),
        waker: Waker::from(woken.clone()),
        woken,
    }
}

impl<F> MockTask<F> {
    /// Runs `f` with the task's context (clearing the wake-up record first, as a poll does).
    pub(crate) fn enter<R>(&mut self, f: impl FnOnce(&mut Context<'_>, Pin<&mut F>) -> R) -> R {
        self.woken.0.store(false, Ordering::SeqCst);
        let mut cx = Context::from_waker(&self.waker);
        f(&mut cx, self.fut.as_mut())
    }

    /// Whether the task was woken since its last poll.
    pub(crate) fn is_woken(&self) -> bool {
        self.woken.0.load(Ordering::SeqCst)
    }
}

impl<F: Future> MockTask<F> {
    /// Polls the future once.
    pub(crate) fn poll(&mut self) -> Poll<F::Output> {
        self.enter(|cx, fut| fut.poll(cx))
    }
}
