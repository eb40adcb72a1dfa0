//! Reading RDMA CM events asynchronously: the event channel's descriptor in an `AsyncFd`.

use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::time::Duration;

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

use crate::error::{Error, Result};
use crate::verbs::{CmEvent, CmEventKind, EventChannel};

/// Keeps the channel (and so its descriptor) alive while registered.
#[derive(Debug)]
pub(crate) struct ChannelFd(pub(crate) EventChannel);

impl AsRawFd for ChannelFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

/// An event channel readable from Tokio.
#[derive(Debug)]
pub(crate) struct AsyncChannel {
    fd: AsyncFd<ChannelFd>,
}

impl AsyncChannel {
    pub(crate) fn new(channel: EventChannel) -> Result<AsyncChannel> {
        // SAFETY: `ChannelFd` owns the channel, so its descriptor stays open and the same for
        // the life of the AsyncFd.
        let fd = unsafe { AsyncFd::register_with_interest(ChannelFd(channel), Interest::READABLE) }
            .map_err(|e| Error::CmChannel(e.into_parts().1))?;
        Ok(AsyncChannel { fd })
    }

    pub(crate) fn channel(&self) -> &EventChannel {
        &self.fd.get_ref().0
    }

    /// The next event.
    pub(crate) async fn next(&self) -> Result<CmEvent> {
        loop {
            if let Some(ev) = self.channel().get_event()? {
                return Ok(ev);
            }
            let mut guard = self.fd.readable().await.map_err(Error::CmChannel)?;
            match self.channel().get_event()? {
                Some(ev) => return Ok(ev),
                None => guard.clear_ready(),
            }
        }
    }

    /// The next event, which must be `kind`, within `timeout`.
    pub(crate) async fn expect(&self, kind: CmEventKind, timeout: Duration) -> Result<CmEvent> {
        match tokio::time::timeout(timeout, self.next()).await {
            Ok(ev) => ev?.expect(kind),
            Err(_) => Err(Error::Timeout {
                what: kind.name(),
                after: timeout,
            }),
        }
    }
}
