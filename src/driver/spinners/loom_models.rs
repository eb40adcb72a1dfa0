//! A `loom` model of the spinner/arm hand-off between waiting futures (`wait.rs`) and the
//! completion task (`completion.rs`), over the real [`Spinners`] count. Run with `--cfg tokio_rdma_loom`
//! (docs/testing.md#concurrency-models).
//!
//! Modelled: the device completes one operation; if the CQ is armed it raises one event and
//! disarms. Each future joins the spinners, polls the CQ a bounded number of times (taking
//! the completion if it is there), and leaves; the last one leaving notifies the task
//! (`Shared::spinner_left`). The task loops as `completion::run` does: drain; if any future
//! spins, sleep until notified (the CQ stays unarmed); otherwise arm, drain once more, and
//! sleep until the event or a notification. The model's task has no other wake-up (the real
//! one also re-checks every `STALE_SPIN_CHECK` for spinners that stopped being polled, a
//! fallback the hand-off must not need): if a completion could be left with nobody polling
//! and the task asleep, loom reports the deadlock.

use std::sync::Arc;

use loom::sync::atomic::{AtomicBool, Ordering::SeqCst};
use loom::sync::{Mutex, Notify};

use crate::sync::model;

use super::Spinners;

/// The CQ as the model sees it: a completion waiting to be polled, whether it is armed.
#[derive(Default)]
struct Cq {
    pending: bool,
    armed: bool,
}

#[derive(Default)]
struct World {
    cq: Mutex<Cq>,
    spinners: Spinners,
    /// The completion task's wake-ups: `shared.notify` and the completion channel's
    /// readiness, which `completion::run` awaits together (a `Notify` keeps one permit, as
    /// tokio's `notify_one` does).
    task: Notify,
    /// The completion was polled by someone (a future or the task).
    handled: AtomicBool,
}

impl World {
    /// Polls the CQ: takes the completion if it is there.
    fn drain(&self) -> bool {
        let taken = std::mem::take(&mut self.cq.lock().unwrap().pending);
        if taken {
            assert!(
                !self.handled.swap(true, SeqCst),
                "one completion polled twice"
            );
        }
        taken
    }

    fn complete(&self) {
        let mut cq = self.cq.lock().unwrap();
        cq.pending = true;
        if std::mem::take(&mut cq.armed) {
            drop(cq);
            self.task.notify();
        }
    }

    /// A future that spins for `polls` polls of the CQ, then sleeps (or completes).
    fn spin(&self, polls: usize) {
        self.spinners.join();
        for _ in 0..polls {
            if self.drain() {
                break;
            }
            loom::thread::yield_now();
        }
        if self.spinners.leave() {
            self.task.notify();
        }
    }

    /// The completion task, until the completion was handled.
    fn task(&self) {
        loop {
            self.drain();
            if self.handled.load(SeqCst) {
                return;
            }
            if !self.spinners.any() {
                self.cq.lock().unwrap().armed = true;
                // A completion before the arm raises no event: poll once more.
                if self.drain() {
                    return;
                }
            }
            self.task.wait();
        }
    }
}

/// One spinning future, the device and the completion task: the completion is always
/// polled, by the future or by the task, and the task never sleeps on it unarmed.
#[test]
fn loom_models_last_spinner_leaving_wakes_the_task() {
    model(3, || {
        let w = Arc::new(World::default());
        let device = {
            let w = w.clone();
            loom::thread::spawn(move || w.complete())
        };
        let future = {
            let w = w.clone();
            loom::thread::spawn(move || w.spin(1))
        };
        w.task();
        device.join().unwrap();
        future.join().unwrap();
        assert!(w.handled.load(SeqCst));
    });
}

/// Two spinning futures: only the last one to leave notifies, and that is enough whichever
/// order they join and leave in.
#[test]
fn loom_models_two_spinners_hand_off_to_the_task() {
    model(2, || {
        let w = Arc::new(World::default());
        let device = {
            let w = w.clone();
            loom::thread::spawn(move || w.complete())
        };
        let futures: Vec<_> = (0..2)
            .map(|_| {
                let w = w.clone();
                loom::thread::spawn(move || w.spin(1))
            })
            .collect();
        w.task();
        device.join().unwrap();
        for f in futures {
            f.join().unwrap();
        }
        assert!(w.handled.load(SeqCst));
    });
}
