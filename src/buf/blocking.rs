//! Calls that may block for long (memory registration of large ranges, reading
//! `/proc/self/maps`) run here off the runtime's worker threads, so the other tasks of a
//! worker (another connection's ping-pong, the completion task) keep running meanwhile.

/// Registrations of fewer bytes than this run inline: pinning a few pages costs less than the
/// hand-off to a blocking thread and back.
pub(crate) const OFFLOAD_MIN: usize = 64 << 10;

/// Runs `f` on Tokio's blocking pool when called inside a runtime, else inline.
///
/// `f` owns everything it touches (memory being registered moves into it, and what it
/// returns owns the registration before that memory), so a caller dropped while `f` runs
/// frees nothing `f` still uses: the result is then dropped by the pool, the registration
/// before the memory.
pub(crate) async fn run<T, F>(f: F) -> T
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    match tokio::runtime::Handle::try_current() {
        Ok(rt) => match rt.spawn_blocking(f).await {
            Ok(t) => t,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            // Only a runtime shutting down cancels a blocking task before it started; the
            // caller's task is being dropped with it.
            Err(e) => panic!("blocking call cancelled: {e}"),
        },
        Err(_) => f(),
    }
}

/// [`run`] for calls that handle `len` bytes: inline below [`OFFLOAD_MIN`].
pub(crate) async fn run_for<T, F>(len: usize, f: F) -> T
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    if len < OFFLOAD_MIN { f() } else { run(f).await }
}
