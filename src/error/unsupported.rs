//! [`Unsupported`]: what the device, or the buffer, does not support, one variant per cause.

/// What the device, or the buffer, does not support: the cause of
/// [`Error::Unsupported`](crate::Error::Unsupported).
///
/// What to do: do without the feature the variant names, or use a device that has it. New
/// variants may be added.
///
/// # Examples
///
/// ```
/// use tokio_rdma::{Error, Unsupported};
///
/// /// The device an SRQ was refused on, if that is why `err` happened.
/// fn no_srq_on(err: &Error) -> Option<&str> {
///     match err {
///         Error::Unsupported(Unsupported::NoSrq { device }) => Some(device),
///         _ => None,
///     }
/// }
///
/// let err = Error::Unsupported(Unsupported::NoSrq { device: "rxe0".into() });
/// assert_eq!(no_srq_on(&err), Some("rxe0"));
/// assert_eq!(err.to_string(), "unsupported: rxe0 has no shared receive queues");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Unsupported {
    /// The device has no shared receive queues (`max_srq` is 0).
    ///
    /// What to do: open the endpoint without `EndpointOptions::shared_receive_queue`.
    #[error("{device} has no shared receive queues")]
    NoSrq {
        /// The device.
        device: String,
    },
    /// A completion queue already carries the most queue pairs a driver can tell apart.
    ///
    /// What to do: open another endpoint (or driver) for more queue pairs.
    #[error("more than {max} queue pairs on one completion queue")]
    TooManyQueuePairs {
        /// The most queue pairs on one completion queue.
        max: usize,
    },
    /// The device has no type-2 memory windows.
    ///
    /// What to do: grant with a dedicated registration (`Grant::region`).
    #[error("{device} has no type-2 memory windows")]
    NoMwType2 {
        /// The device.
        device: String,
    },
    /// The device does not confine a window's accesses to the window's range.
    ///
    /// What to do: use a dedicated registration (`Grant::region`).
    #[error(
        "{device} does not confine window accesses to the window's range; \
         use a dedicated registration (Grant::region)"
    )]
    WindowBoundsNotEnforced {
        /// The device.
        device: String,
    },
    /// The buffer's registration does not allow binding memory windows (`MW_BIND`).
    ///
    /// What to do: use a pool buffer of a pool registered with `MW_BIND` on a real device, or
    /// `Grant::region`.
    #[error("the buffer has no MW_BIND registration to bind a window to")]
    NoMwBindRegistration,
}
