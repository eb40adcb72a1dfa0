//! Running a call that may block in the kernel off the runtime's worker threads.

/// Runs `f`, which may block in the kernel (destroying a queue pair or an RDMA CM id), on the
/// runtime's blocking pool when called on a runtime, so no worker thread stalls on it (a task
/// woken onto a stalled worker's next-task slot waits with it); inline otherwise.
pub(crate) fn off_runtime(f: impl FnOnce() + Send + 'static) {
    match tokio::runtime::Handle::try_current() {
        Ok(rt) => {
            rt.spawn_blocking(f);
        }
        Err(_) => f(),
    }
}
