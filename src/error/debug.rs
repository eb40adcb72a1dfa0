//! `Debug` for [`Error`]: the `Display` message, hint included, then the source's `Debug`.
//! `fn main() -> Result<(), E>` prints `Debug`, and a derived `Debug`
//! (`CreateEventChannel(Os { code: 19, .. })`) would hide the remedy the message gives.

use std::fmt;

use super::Error;

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")?;
        if let Some(source) = std::error::Error::source(self) {
            write!(f, " (source: {source:?})")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::io;

    use super::Error;

    /// What `fn main() -> Result<..>` prints on a host without RDMA CM: the remedy, and the
    /// errno's details from the source.
    #[test]
    fn debug_shows_the_remedy_and_the_source() {
        let e = Error::CreateEventChannel(io::Error::from_raw_os_error(libc::ENODEV));
        let debug = format!("{e:?}");
        assert!(debug.contains("modprobe rdma_ucm"), "{debug}");
        assert!(
            debug.contains("rdma_create_event_channel failed"),
            "{debug}"
        );
        assert!(debug.contains("code: 19"), "{debug}");
    }

    /// Connecting to 0.0.0.0 fails in `rdma_resolve_route` with `ENODEV`: the message says why.
    #[test]
    fn resolve_route_enodev_explains_unspecified_addresses() {
        let e = Error::ResolveRoute(io::Error::from_raw_os_error(libc::ENODEV));
        let text = e.to_string();
        assert!(text.contains("ENODEV"), "{text}");
        assert!(text.contains("0.0.0.0"), "{text}");
        assert!(text.contains("RDMA link"), "{text}");
    }
}
