//! Completion channels (`ibv_comp_channel`): the file descriptor that becomes readable when an
//! armed completion queue gets a completion.

use std::fmt;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::ptr::NonNull;
use std::sync::Arc;

use super::context::Context;
use crate::error::{Error, Result};
use crate::sys;

/// A completion channel whose file descriptor is non-blocking, ready for
/// `tokio::io::unix::AsyncFd`.
///
/// In this crate a channel serves exactly one [`CompletionQueue`](super::CompletionQueue):
/// the completion task of that CQ owns the channel's readiness.
///
/// # Examples
///
/// ```no_run
/// use std::os::fd::AsFd;
/// use tokio_rdma::verbs::{CompletionChannel, CompletionQueue, Context};
/// let ctx = Context::open("rxe0")?;
/// let channel = CompletionChannel::new(&ctx)?;
/// let cq = CompletionQueue::new(&ctx, 128, Some(&channel))?;
/// let _fd = channel.as_fd(); // register with AsyncFd
/// # Ok::<(), tokio_rdma::Error>(())
/// ```
#[derive(Clone)]
pub struct CompletionChannel {
    pub(crate) inner: Arc<ChannelInner>,
}

pub(crate) struct ChannelInner {
    pub(crate) ch: NonNull<sys::ibv_comp_channel>,
    _ctx: Context,
}

// SAFETY: `ibv_get_cq_event` and friends are thread-safe; the pointer is owned.
unsafe impl Send for ChannelInner {}
// SAFETY: see `Send`.
unsafe impl Sync for ChannelInner {}

impl CompletionChannel {
    /// Creates a completion channel and puts its descriptor in non-blocking mode.
    ///
    /// # Errors
    ///
    /// [`Error::CreateCompChannel`] with the errno (also if `fcntl` fails).
    pub fn new(ctx: &Context) -> Result<CompletionChannel> {
        // SAFETY: the context is open; the channel keeps a clone of it.
        let ch = unsafe { sys::ibv_create_comp_channel(ctx.as_ptr()) };
        let ch = NonNull::new(ch).ok_or_else(|| Error::last_os(Error::CreateCompChannel))?;
        let channel = CompletionChannel {
            inner: Arc::new(ChannelInner {
                ch,
                _ctx: ctx.clone(),
            }),
        };
        set_nonblocking(channel.as_raw_fd()).map_err(Error::CreateCompChannel)?;
        Ok(channel)
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::ibv_comp_channel {
        self.inner.ch.as_ptr()
    }
}

fn set_nonblocking(fd: RawFd) -> std::io::Result<()> {
    // SAFETY: `fd` is an open descriptor owned by the channel; F_GETFL has no memory effects.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above; setting O_NONBLOCK only changes blocking behaviour of reads.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

impl AsRawFd for CompletionChannel {
    fn as_raw_fd(&self) -> RawFd {
        // SAFETY: the channel is alive while `self` is, and `fd` is a plain field.
        unsafe { (*self.as_ptr()).fd }
    }
}

impl AsFd for CompletionChannel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the descriptor stays open until the channel is destroyed in `Drop`, which
        // cannot happen while `self` is borrowed.
        unsafe { BorrowedFd::borrow_raw(self.as_raw_fd()) }
    }
}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        // SAFETY: CQs attached to this channel hold a clone of it, so none is alive; destroyed
        // exactly once.
        let rc = unsafe { sys::ibv_destroy_comp_channel(self.ch.as_ptr()) };
        if rc != 0 {
            tracing::warn!(rc, "ibv_destroy_comp_channel failed");
        }
    }
}

impl fmt::Debug for CompletionChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionChannel")
            .field("fd", &self.as_raw_fd())
            .finish()
    }
}
