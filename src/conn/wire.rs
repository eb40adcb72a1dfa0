//! The connection protocol's wire format, for peers written in other languages and for
//! tests that play a peer: every message and control message is a SEND with immediate data,
//! whose 32-bit immediate is a [`MsgHeader`] (`kind:4 | reserved:4 | ctrl_ack:8 |
//! credits:16`, see `docs/connections.md`). Each side keeps [`CONTROL_RECVS`] receives for
//! control messages besides its data credits, and has at most [`CONTROL_WINDOW`] control
//! messages unconfirmed. A rendezvous message is a `Rendezvous` SEND whose payload is a
//! [`DESCRIPTOR_LEN`]-byte descriptor ([`RemoteMsg::encode`]); at most [`RDV_WINDOW`] are
//! unacknowledged (by `Fetched`) at a time.
//!
//! # Examples
//!
//! ```
//! use tokio_rdma::conn::wire::{MsgHeader, MsgKind};
//!
//! let h = MsgHeader { kind: MsgKind::Last, ctrl_ack: 0, credits: 3 };
//! assert_eq!(MsgHeader::decode(h.encode()).unwrap(), h);
//! ```

pub use crate::proto::conn::{
    CONTROL_RECVS, CONTROL_WINDOW, DESCRIPTOR_LEN, RDV_WINDOW, RemoteMsg,
};
pub use crate::proto::{MsgHeader, MsgKind};
