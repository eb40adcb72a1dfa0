//! # tokio-rdma
//!
//! Asynchronous RDMA for Tokio, on the crate's own bindings to libibverbs and librdmacm.
//!
//! Open an [`Endpoint`] (a device, its completion queue and completion mode), then connect or
//! listen through it; a [`Connection`](conn::Connection) carries messages under credit flow
//! control and one-sided operations against memory the peer granted.
//!
//! ```no_run
//! use tokio_rdma::conn::ConnectOptions;
//! use tokio_rdma::Endpoint;
//!
//! # async fn demo() -> tokio_rdma::Result<()> {
//! let ep = Endpoint::open_first_active()?;
//! let conn = ep
//!     .connect("192.0.2.1:7471".parse().unwrap(), ConnectOptions::default())
//!     .await?;
//! conn.send(b"ping").await?;
//! if let Some(reply) = conn.recv().await? {
//!     println!("{} bytes", reply.len());
//! }
//! conn.close().await
//! # }
//! ```
//!
//! The layers, each using only the one below:
//!
//! * [`verbs`]: safe RAII wrappers over the verbs and RDMA CM objects; the only FFI user.
//! * `proto` (sans-IO, no unsafe; private): the in-flight operation table, queue accounting, and the
//!   connection protocol state machine.
//! * [`driver`]: the operation engine (futures that post, then poll their completion queue in
//!   place and spin or sleep as the [`CompletionMode`](driver::CompletionMode) says), the
//!   completion task for what nobody polls, and [`AsyncQp`](driver::AsyncQp); [`ops`] holds
//!   the typed operation futures.
//! * [`buf`]: registered buffer pools, the registration cache, remote grants and tokens.
//! * [`conn`] and [`Endpoint`]: RDMA CM connections, listeners and messages.
//!
//! Device tests run on soft-RoCE (`rdma_rxe`) in a QEMU VM: see `docs/testing.md`.

pub mod buf;
pub mod conn;
pub mod driver;
mod endpoint;
mod error;
pub mod ops;
#[cfg(feature = "bench-internals")]
#[doc(hidden)]
pub mod proto;
#[cfg(not(feature = "bench-internals"))]
mod proto;
mod sys;
pub mod verbs;

pub use endpoint::{Endpoint, EndpointOptions};
pub use error::{Error, ProtocolError, QpFailure, Result, WcStatus};
