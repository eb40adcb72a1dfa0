//! # tokio-rdma
//!
//! Asynchronous RDMA for Tokio, on the crate's own bindings to libibverbs and librdmacm.
//!
//! The crate is built in layers:
//!
//! * [`verbs`]: safe RAII wrappers over the verbs objects (device context, protection domain,
//!   completion channel and queue, RC queue pair, memory region). The only FFI user.
//! * (next) a sans-IO core with the in-flight op table, and a Tokio driver whose completion
//!   task turns work completions into woken futures.
//!
//! ## Quick start (verbs level)
//!
//! ```no_run
//! use tokio_rdma::verbs::{self, Context};
//!
//! # fn main() -> tokio_rdma::Result<()> {
//! for dev in verbs::devices()? {
//!     println!("device {}", dev.name);
//! }
//! let (ctx, port) = Context::open_first_active()?;
//! let p = ctx.query_port(port)?;
//! println!("{} port {port}: {:?}, mtu {:?}", ctx.name(), p.state, p.active_mtu);
//! # Ok(()) }
//! ```
//!
//! Device tests run on soft-RoCE (`rdma_rxe`) in a QEMU VM: see `docs/testing.md`.

pub mod buf;
pub mod conn;
pub mod core;
pub mod driver;
mod endpoint;
mod error;
pub mod ops;
mod sys;
pub mod verbs;

pub use endpoint::{Endpoint, EndpointOptions};
pub use error::{Error, ProtocolError, QpFailure, Result, WcStatus};
