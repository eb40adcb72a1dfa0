//! [`Exclusive`]: the stream's futures, `Sync` without a lock.

/// Makes a `Send` value `Sync` by giving no access to it through a shared reference (the
/// stream's futures are only ever polled through `&mut`).
pub(super) struct Exclusive<T>(T);

impl<T> Exclusive<T> {
    pub(super) fn new(v: T) -> Exclusive<T> {
        Exclusive(v)
    }

    pub(super) fn get_mut(&mut self) -> &mut T {
        &mut self.0
    }
}

// SAFETY: an `&Exclusive<T>` gives no access to the `T` (every accessor takes `&mut self`), so
// sharing references between threads shares nothing; moving it to another thread needs
// `T: Send`.
unsafe impl<T: Send> Sync for Exclusive<T> {}
