//! [`TaskKick`]: how the driver wakes its completion task ("look again").

use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use futures::task::AtomicWaker;

/// A wake-up for one waiting task that is never lost: a kick while the task is not waiting is
/// kept (one, however many came) and ends its next wait at once, as
/// [`Notify::notify_one`](tokio::sync::Notify::notify_one)'s permit does.
///
/// The completion task polls it beside its other wake-up sources inside one hand-written
/// future, so a round of its loop sets up no waiter list entry and tears none down (a
/// `Notified` future joins the `Notify`'s list under its lock when first polled, and leaves it
/// under the lock again when dropped: twice per CQ event in event mode).
#[derive(Debug, Default)]
pub(crate) struct TaskKick {
    pending: AtomicBool,
    waker: AtomicWaker,
}

impl TaskKick {
    /// Wakes the task, now or at its next wait.
    pub(crate) fn notify_one(&self) {
        self.pending.store(true, Ordering::Release);
        self.waker.wake();
    }

    /// Ready once (and consumed) if a kick came since the last ready poll; else registers the
    /// task's waker. The flag is checked again after the registration, so a kick between the
    /// first check and the registration is seen now rather than lost.
    pub(crate) fn poll_kicked(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.take() {
            return Poll::Ready(());
        }
        self.waker.register(cx.waker());
        if self.take() {
            return Poll::Ready(());
        }
        Poll::Pending
    }

    fn take(&self) -> bool {
        // A plain load first: most polls find no kick, and a load is cheaper than a swap.
        self.pending.load(Ordering::Acquire) && self.pending.swap(false, Ordering::AcqRel)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::task::Poll;

    use super::TaskKick;

    #[test]
    fn a_kick_before_the_wait_is_kept_once_and_one_during_it_wakes() {
        let kick = Arc::new(TaskKick::default());
        let mut task = crate::test_task::spawn(());
        // Two kicks with nobody waiting: one wake-up is kept, not two.
        kick.notify_one();
        kick.notify_one();
        assert!(task.enter(|cx, _| kick.poll_kicked(cx)).is_ready());
        assert!(task.enter(|cx, _| kick.poll_kicked(cx)).is_pending());
        assert!(!task.is_woken());
        // A kick while waiting wakes the task, and its next poll is ready.
        kick.notify_one();
        assert!(task.is_woken());
        assert_eq!(task.enter(|cx, _| kick.poll_kicked(cx)), Poll::Ready(()));
        // From another thread.
        assert!(task.enter(|cx, _| kick.poll_kicked(cx)).is_pending());
        let k = kick.clone();
        std::thread::spawn(move || k.notify_one()).join().unwrap();
        assert!(task.is_woken());
        assert!(task.enter(|cx, _| kick.poll_kicked(cx)).is_ready());
    }
}
