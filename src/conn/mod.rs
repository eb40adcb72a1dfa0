//! Connections over RDMA CM: a Tokio-style [`Listener`] / [`Connection::connect`], a versioned
//! handshake in the CM private data, messages under credit flow control, one-sided I/O against
//! granted remote memory, a byte-stream adapter, and graceful close.
//!
//! Each device gets one driver (completion queue and completion task), shared by all its
//! connections; each connection has its own protection domain.

mod addr;
mod close;
mod cm_async;
mod connection;
pub(crate) mod device;
mod driver;
pub(crate) mod endpoint_options;
mod establish;
#[cfg(feature = "metrics")]
pub(crate) mod export;
pub mod handshake;
mod io;
mod lifecycle;
mod listener;
pub(crate) mod memory;
mod messages;
pub(crate) mod observe;
mod one_sided;
mod options;
mod progress;
pub(crate) mod raw;
mod rdv_memory;
mod rendezvous;
mod setup;
mod shared;
pub(crate) mod srq;
mod stats;
mod stream;
pub mod wire;

pub(crate) use addr::first_ok as resolve_first_ok;
pub use connection::Connection;
pub use listener::{BACKLOG_FULL_REASON, Incoming, Listener};
pub use options::{
    ConnectOptions, DEFAULT_MAX_SEND_CHUNK, DEFAULT_MAX_STAGED_CHUNKS, DEFAULT_RENDEZVOUS_THRESHOLD,
};
pub use raw::{
    RawAccepting, RawConnection, RawConnector, RawListener, RawOptions, RawReply, RawRequest,
};
pub use shared::Message;
pub use srq::{SrqOptions, SrqStats};
pub use stats::ConnStats;
pub use stream::{OwnedReadHalf, OwnedWriteHalf, RdmaStream, ReuniteError};
