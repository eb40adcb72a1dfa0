//! [`ChannelFd`]: a completion channel as the reactor sees it.

use std::os::fd::{AsRawFd, RawFd};

use crate::verbs::CompletionChannel;

/// Keeps the completion channel (and so its descriptor) open while registered with the
/// reactor (the completion task's, and an [`OwnedQp`](crate::owned::OwnedQp)'s waits).
pub(crate) struct ChannelFd(pub(crate) CompletionChannel);

impl std::fmt::Debug for ChannelFd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("ChannelFd")
            .field(&self.0.as_raw_fd())
            .finish()
    }
}

impl AsRawFd for ChannelFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}
