//! Retirement: what a completion releases (the application's bytes of zero-copy sends, the
//! memory of rendezvous messages the peer read) is kept here and dropped only once the
//! connection's lock (and the driver's) is released.

use std::sync::atomic::Ordering;

use super::{ConnIo, Retired};

impl ConnIo {
    /// Keeps `r` to be released after the connection's lock (see `ConnIo::retired`).
    pub(crate) fn retire(&self, r: Retired) {
        self.retired
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(r);
        self.has_retired.store(true, Ordering::Release);
    }

    /// Drops the retired application bytes, outside the connection's lock (and outside the
    /// list's own lock, popping one at a time: the list keeps its capacity).
    ///
    /// Called after every look at the state: the common case (nothing retired) is one plain
    /// load, inlined, with no read-modify-write.
    #[inline]
    pub(super) fn drop_retired(&self) {
        if self.has_retired.load(Ordering::Acquire) {
            self.drop_retired_now();
        }
    }

    fn drop_retired_now(&self) {
        if !self.has_retired.swap(false, Ordering::AcqRel) {
            return;
        }
        loop {
            let b = self.retired.lock().unwrap_or_else(|e| e.into_inner()).pop();
            match b {
                Some(b) => drop(b),
                None => break,
            }
        }
    }
}
