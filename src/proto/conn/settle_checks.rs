//! Test support: the promises [`ConnProto::transmit_idle`] and
//! [`ConnProto::take_deadline_moved`] make to the shell (which skips its pump on them), checked
//! by the randomized tests at every step.

use std::fmt::Debug;
use std::time::Instant;

use super::{ConnProto, Transmit};

impl<B: AsRef<[u8]> + Debug> ConnProto<B> {
    /// [`poll_transmit`](Self::poll_transmit), checking first that when `transmit_idle`
    /// says there is nothing to do, `poll_transmit` hands out nothing and changes no state.
    pub(super) fn poll_transmit_checked(&mut self, now: Instant) -> Option<Transmit> {
        let idle = self.transmit_idle();
        let flag = self.deadline_moved;
        let before = idle.then(|| format!("{self:?}"));
        let t = self.poll_transmit(now);
        if let Some(before) = before {
            assert!(
                t.is_none(),
                "transmit_idle, yet poll_transmit handed out {t:?}"
            );
            // The one thing it may touch: the shell, which skips it, keeps the flag as it was.
            self.deadline_moved = flag;
            assert_eq!(
                before,
                format!("{self:?}"),
                "transmit_idle, yet poll_transmit changed the state"
            );
        }
        t
    }

    /// Takes the deadline flag as the shell's pump does and checks its promise: a deadline
    /// the flag did not announce is not earlier than `last` (the deadline at the last take).
    /// Returns the deadline now.
    pub(super) fn check_deadline(&mut self, last: Option<Instant>) -> Option<Instant> {
        let moved = self.take_deadline_moved();
        let now = self.poll_timeout();
        assert!(
            moved || !super::earlier(now, last),
            "the deadline moved earlier ({last:?} -> {now:?}) without the flag"
        );
        now
    }
}
