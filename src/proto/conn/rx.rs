//! [`RecvState`]: a connection's receive side (its methods on the connection are in
//! `recv.rs`).

use std::collections::VecDeque;
use std::task::Waker;

use super::credits::CONTROL_RECVS;
use super::types::{ConnConfig, Delivery};

#[derive(Debug)]
pub(super) struct RecvState<B> {
    /// Receives on the device.
    pub(super) posted: u32,
    /// The first receives to post (announced in the handshake).
    pub(super) due_initial: u32,
    /// Receives of control messages to re-post (each confirmed in `ctrl ack`).
    pub(super) due_ctrl: u32,
    /// Receives to post that each return a data credit.
    pub(super) due_data: u32,
    /// Data receives whose re-post waits for the application to consume.
    pub(super) withheld: u32,
    pub(super) assembling: Option<Vec<u8>>,
    pub(super) ready: VecDeque<Delivery<B>>,
    pub(super) rdv: super::rdv_state::RdvRecv,
    pub(super) wakers: Vec<Waker>,
    /// Received data the application holds: queued, delivered and not dropped, or partial.
    pub(super) held_bytes: u64,
    /// Receive buffers the application holds (single-chunk messages are not copied).
    pub(super) held_bufs: u32,
    /// Of `held_bytes`, the messages handed to the application and not yet consumed.
    pub(super) taken_bytes: u64,
    pub(super) peer_closed: bool,
}

impl<B> RecvState<B> {
    pub(super) fn new(cfg: &ConnConfig) -> RecvState<B> {
        RecvState {
            posted: 0,
            due_initial: cfg.recv_initial.min(cfg.recv_credits) + CONTROL_RECVS,
            due_ctrl: 0,
            // Credits granted later: each receive posted for them returns a credit.
            due_data: cfg.recv_credits.saturating_sub(cfg.recv_initial),
            withheld: 0,
            assembling: None,
            ready: VecDeque::new(),
            rdv: Default::default(),
            wakers: Vec::new(),
            held_bytes: 0,
            held_bufs: 0,
            taken_bytes: 0,
            peer_closed: false,
        }
    }

    pub(super) fn wake_all(&mut self, out: &mut Vec<Waker>) {
        out.append(&mut self.wakers);
    }
}
