//! The `io::ErrorKind` each failure maps to, for `AsyncRead`/`AsyncWrite` users and `?` into
//! `io::Result`.

use std::io;

use super::{Error, QpFailure};

impl From<Error> for io::Error {
    fn from(err: Error) -> io::Error {
        let kind = match &err {
            Error::DeviceNotFound { .. } | Error::NoActivePort { .. } => io::ErrorKind::NotFound,
            Error::InvalidArgument(_) => io::ErrorKind::InvalidInput,
            Error::LoopbackAddress { .. } => io::ErrorKind::AddrNotAvailable,
            Error::QpFailed(QpFailure::Protocol(_) | QpFailure::PeerReported(_)) => {
                io::ErrorKind::InvalidData
            }
            Error::QpFailed(QpFailure::KeepaliveTimeout(_) | QpFailure::CloseTimeout(_)) => {
                io::ErrorKind::TimedOut
            }
            Error::Timeout { .. } => io::ErrorKind::TimedOut,
            Error::QpFailed(QpFailure::Disconnected) => io::ErrorKind::ConnectionReset,
            Error::Unsupported(_) | Error::OdpUnsupported { .. } => io::ErrorKind::Unsupported,
            Error::ReceiveBudgetExhausted { .. } | Error::MemoryBudgetExhausted { .. } => {
                io::ErrorKind::OutOfMemory
            }
            Error::MemlockExhausted { .. } => io::ErrorKind::OutOfMemory,
            Error::QpFailed(QpFailure::WorkCompletion { status, .. }) => status.io_kind(),
            Error::QpFailed(QpFailure::Closed) => io::ErrorKind::NotConnected,
            Error::QpFailed(_) => io::ErrorKind::ConnectionAborted,
            Error::RegMr { source, .. } if source.raw_os_error() == Some(libc::ENOMEM) => {
                io::ErrorKind::OutOfMemory
            }
            Error::ConnectionRejected { .. } => io::ErrorKind::ConnectionRefused,
            Error::CmEventFailed { event, .. } if *event == "RDMA_CM_EVENT_UNREACHABLE" => {
                io::ErrorKind::HostUnreachable
            }
            Error::PrivateDataTooLong { .. } => io::ErrorKind::InvalidInput,
            Error::Handshake(_) => io::ErrorKind::InvalidData,
            Error::UnexpectedCmEvent { .. } => io::ErrorKind::ConnectionAborted,
            other => match other.raw_os_error() {
                Some(code) => io::Error::from_raw_os_error(code).kind(),
                None => io::ErrorKind::Other,
            },
        };
        io::Error::new(kind, err)
    }
}
