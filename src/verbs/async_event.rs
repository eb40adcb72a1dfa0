//! Asynchronous device events (`ibv_get_async_event`): queue-pair fatal errors, port state
//! changes, device loss.

use std::os::fd::{AsRawFd, BorrowedFd};

use super::context::Context;
use super::cq::CqId;
use crate::error::{Error, Result};
use crate::sys;

/// What an asynchronous event refers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum EventElement {
    /// A queue pair, by number.
    Qp(u32),
    /// A completion queue.
    Cq(CqId),
    /// A port.
    Port(u8),
    /// The whole device.
    Device,
    /// A shared receive queue, by [`SharedReceiveQueue::id`](super::SharedReceiveQueue::id).
    Srq(usize),
    /// A work queue (not used by this crate).
    Other,
}

/// One asynchronous event, already acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AsyncEvent {
    /// The verbs name of the event type, e.g. `"IBV_EVENT_QP_FATAL"`.
    pub name: &'static str,
    /// The raw `ibv_event_type`.
    pub raw: u32,
    /// What it refers to.
    pub element: EventElement,
}

impl AsyncEvent {
    /// Whether the event means the element can no longer be used (fatal QP/CQ errors, device
    /// loss).
    ///
    /// A port error (`IBV_EVENT_PORT_ERR`, the link went down) is not fatal: the queue pairs
    /// stay in RTS and RC retransmission carries them over a link that comes back within
    /// their retry budget; those whose peer stays unreachable fail by their own retries or
    /// keepalive (docs/faults.md).
    pub fn is_fatal(&self) -> bool {
        self.is_fatal_raw()
    }

    /// Whether this is `IBV_EVENT_QP_LAST_WQE_REACHED`: a queue pair on a shared receive
    /// queue, in the error state, will take no more receives from that queue and has no
    /// completion of one still to come.
    pub fn is_last_wqe_reached(&self) -> bool {
        self.raw == sys::IBV_EVENT_QP_LAST_WQE_REACHED
    }

    fn is_fatal_raw(&self) -> bool {
        matches!(
            self.raw,
            sys::IBV_EVENT_QP_FATAL
                | sys::IBV_EVENT_QP_REQ_ERR
                | sys::IBV_EVENT_QP_ACCESS_ERR
                | sys::IBV_EVENT_CQ_ERR
                | sys::IBV_EVENT_SRQ_ERR
                | sys::IBV_EVENT_DEVICE_FATAL
        )
    }
}

fn event_name(raw: u32) -> &'static str {
    match raw {
        sys::IBV_EVENT_CQ_ERR => "IBV_EVENT_CQ_ERR",
        sys::IBV_EVENT_QP_FATAL => "IBV_EVENT_QP_FATAL",
        sys::IBV_EVENT_QP_REQ_ERR => "IBV_EVENT_QP_REQ_ERR",
        sys::IBV_EVENT_QP_ACCESS_ERR => "IBV_EVENT_QP_ACCESS_ERR",
        sys::IBV_EVENT_COMM_EST => "IBV_EVENT_COMM_EST",
        sys::IBV_EVENT_SQ_DRAINED => "IBV_EVENT_SQ_DRAINED",
        sys::IBV_EVENT_PATH_MIG => "IBV_EVENT_PATH_MIG",
        sys::IBV_EVENT_PATH_MIG_ERR => "IBV_EVENT_PATH_MIG_ERR",
        sys::IBV_EVENT_DEVICE_FATAL => "IBV_EVENT_DEVICE_FATAL",
        sys::IBV_EVENT_PORT_ACTIVE => "IBV_EVENT_PORT_ACTIVE",
        sys::IBV_EVENT_PORT_ERR => "IBV_EVENT_PORT_ERR",
        sys::IBV_EVENT_LID_CHANGE => "IBV_EVENT_LID_CHANGE",
        sys::IBV_EVENT_PKEY_CHANGE => "IBV_EVENT_PKEY_CHANGE",
        sys::IBV_EVENT_SM_CHANGE => "IBV_EVENT_SM_CHANGE",
        sys::IBV_EVENT_SRQ_ERR => "IBV_EVENT_SRQ_ERR",
        sys::IBV_EVENT_SRQ_LIMIT_REACHED => "IBV_EVENT_SRQ_LIMIT_REACHED",
        sys::IBV_EVENT_QP_LAST_WQE_REACHED => "IBV_EVENT_QP_LAST_WQE_REACHED",
        sys::IBV_EVENT_CLIENT_REREGISTER => "IBV_EVENT_CLIENT_REREGISTER",
        sys::IBV_EVENT_GID_CHANGE => "IBV_EVENT_GID_CHANGE",
        sys::IBV_EVENT_WQ_FATAL => "IBV_EVENT_WQ_FATAL",
        _ => "IBV_EVENT_UNKNOWN",
    }
}

impl Context {
    /// The descriptor that becomes readable when an asynchronous event is pending. Call
    /// [`set_async_nonblocking`](Self::set_async_nonblocking) before polling it with `AsyncFd`.
    pub fn async_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the descriptor belongs to the open context and lives as long as `self`.
        unsafe { BorrowedFd::borrow_raw((*self.as_ptr()).async_fd) }
    }

    /// Puts the async-event descriptor in non-blocking mode.
    ///
    /// # Errors
    ///
    /// [`Error::QueryDevice`] carrying the `fcntl` errno.
    pub fn set_async_nonblocking(&self) -> Result<()> {
        let fd = self.async_fd().as_raw_fd();
        // SAFETY: `fd` is the context's open descriptor; F_GETFL/F_SETFL touch no memory.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: as above.
        if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
            return Err(Error::last_os(Error::QueryDevice));
        }
        Ok(())
    }

    /// Reads and acknowledges one pending asynchronous event; `Ok(None)` if none is pending
    /// (with a non-blocking descriptor).
    ///
    /// # Errors
    ///
    /// [`Error::QueryDevice`] carrying the errno if reading fails.
    pub fn get_async_event(&self) -> Result<Option<AsyncEvent>> {
        let mut ev = sys::ibv_async_event::default();
        // SAFETY: the context is open; `ev` is a valid out-parameter.
        let rc = unsafe { sys::ibv_get_async_event(self.as_ptr(), &mut ev) };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::WouldBlock {
                return Ok(None);
            }
            return Err(Error::QueryDevice(err));
        }
        let raw = ev.event_type;
        // SAFETY: the union member to read is determined by the event type (ibv_get_async_event(3));
        // the QP/CQ pointed to cannot be destroyed before the event is acknowledged below.
        let element = unsafe {
            match raw {
                sys::IBV_EVENT_QP_FATAL
                | sys::IBV_EVENT_QP_REQ_ERR
                | sys::IBV_EVENT_QP_ACCESS_ERR
                | sys::IBV_EVENT_COMM_EST
                | sys::IBV_EVENT_SQ_DRAINED
                | sys::IBV_EVENT_PATH_MIG
                | sys::IBV_EVENT_PATH_MIG_ERR
                | sys::IBV_EVENT_QP_LAST_WQE_REACHED => EventElement::Qp((*ev.element.qp).qp_num),
                sys::IBV_EVENT_CQ_ERR => EventElement::Cq(CqId::from_ptr(ev.element.cq)),
                sys::IBV_EVENT_PORT_ACTIVE
                | sys::IBV_EVENT_PORT_ERR
                | sys::IBV_EVENT_LID_CHANGE
                | sys::IBV_EVENT_PKEY_CHANGE
                | sys::IBV_EVENT_SM_CHANGE
                | sys::IBV_EVENT_CLIENT_REREGISTER
                | sys::IBV_EVENT_GID_CHANGE => {
                    EventElement::Port(u8::try_from(ev.element.port_num).unwrap_or(0))
                }
                sys::IBV_EVENT_DEVICE_FATAL => EventElement::Device,
                sys::IBV_EVENT_SRQ_ERR | sys::IBV_EVENT_SRQ_LIMIT_REACHED => {
                    EventElement::Srq(ev.element.srq as usize)
                }
                _ => EventElement::Other,
            }
        };
        // SAFETY: `ev` was filled by ibv_get_async_event and is acknowledged exactly once.
        unsafe { sys::ibv_ack_async_event(&mut ev) };
        Ok(Some(AsyncEvent {
            name: event_name(raw),
            raw,
            element,
        }))
    }
}
