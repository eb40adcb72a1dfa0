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
//!     .connect("192.0.2.1:7471", ConnectOptions::default())
//!     .await?;
//! conn.send(b"ping").await?;
//! if let Some(reply) = conn.recv().await? {
//!     println!("{} bytes", reply.len());
//! }
//! conn.close().await
//! # }
//! ```
//!
//! New to the crate? `docs/guide.md` in the repository walks through the first hour in six
//! runnable, tested steps (`examples/guide_1_endpoint.rs` .. `examples/guide_6_shutdown.rs`):
//! an endpoint, accept and connect, messages, grants read and written with RDMA READ and
//! WRITE, atomics, and shutdown.
//!
//! # What is where
//!
//! * [`Endpoint`] and [`EndpointOptions`]: a device opened for connections (its context, one
//!   completion queue and the driver behind it, the completion mode); connections and
//!   listeners are made through it.
//! * [`conn`]: RDMA CM connections. [`Listener`](conn::Listener) and
//!   [`Connection`](conn::Connection) speak the crate's protocol: a handshake, messages under
//!   credit flow control, one-sided I/O and atomics against memory the peer granted with
//!   [`Connection::grant`](conn::Connection::grant) (a protection domain per connection), a
//!   byte stream, graceful close. Raw connections ([`RawConnector`](conn::RawConnector),
//!   [`RawListener`](conn::RawListener), [`RawConnection`](conn::RawConnection), ...) give an
//!   [`AsyncQp`](driver::AsyncQp) with no framing of the crate's own, to talk to C peers
//!   (`docs/interop.md`).
//! * [`buf`]: the buffer ownership traits ([`IoBuf`](buf::IoBuf),
//!   [`IoBufMut`](buf::IoBufMut)), registered buffer pools, the registration cache, remote
//!   grants and their [`RemoteToken`](buf::RemoteToken)s.
//! * [`driver`]: the operation engine (futures that post, then poll their completion queue in
//!   place and spin or sleep as the [`CompletionMode`](driver::CompletionMode) says), the
//!   completion task for what nobody polls, and [`AsyncQp`](driver::AsyncQp), an RC queue pair
//!   whose operations are futures; [`ops`] holds the typed operation futures.
//! * [`verbs`]: safe RAII wrappers over the verbs and RDMA CM objects; the only FFI user.
//! * [`Error`], [`Result`]: one error type; each variant's documentation says what to do about
//!   it, and its message names the failing call and, for common causes, the remedy. A refused
//!   argument or an unsupported feature has a typed cause to match on: [`InvalidArgument`],
//!   [`Unsupported`].
//!
//! Underneath, a private sans-IO core (`proto`: the in-flight operation table, queue
//! accounting, and the connection protocol state machine) holds every decision the Tokio shell
//! carries out. Each layer uses only the ones below it, in the order `sys`, `verbs`, `proto`,
//! `driver`, `buf`, `ops`, `conn`, `Endpoint` (`error` and `sync` are leaves every layer uses);
//! `tests/layers.rs` checks it, and that the files of no directory form an import cycle
//! (`docs/architecture.md`, "Layers, owners and locks").
//!
//! Device tests run on soft-RoCE (`rdma_rxe`) in a QEMU VM: see `docs/testing.md`.
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod buf;
pub mod conn;
pub mod driver;
mod endpoint;
mod error;
pub mod ops;
pub mod owned;
// The sans-IO core is private; the micro-benchmarks (`bench-internals`) and the fuzz targets
// (`fuzz-internals`, fuzz/) reach it through a hidden module, never through the normal API.
#[cfg(any(feature = "bench-internals", feature = "fuzz-internals"))]
#[doc(hidden)]
pub mod proto;
#[cfg(not(any(feature = "bench-internals", feature = "fuzz-internals")))]
mod proto;
mod sync;
mod sys;
#[cfg(test)]
mod test_task;
pub mod verbs;

#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub use conn::export::MetricsExporter;
pub use endpoint::{DEFAULT_MEMORY_BUDGET, Endpoint, EndpointOptions, MemoryStats};
pub use error::{
    Error, InvalidArgument, ModeMismatch, ProtocolError, QpFailure, Result, Unsupported, WcStatus,
};
