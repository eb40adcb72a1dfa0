//! Connections over RDMA CM: a Tokio-style [`Listener`] / [`Connection::connect`], a versioned
//! handshake in the CM private data, messages under credit flow control, one-sided I/O against
//! granted remote memory, a byte-stream adapter, and graceful close.
//!
//! Each device gets one driver (completion queue and completion task), shared by all its
//! connections; each connection has its own protection domain.

mod cm_async;
mod connection;
mod engine;
pub mod handshake;
mod listener;
mod options;
mod receiver;
mod registry;
mod setup;
mod stream;

pub use connection::Connection;
pub use engine::ConnStats;
pub use listener::{BACKLOG_FULL_REASON, Listener};
pub use options::ConnectOptions;
pub use stream::RdmaStream;
