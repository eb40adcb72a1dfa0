//! Remote tokens: the `{addr, len, rkey}` triple a peer needs for one-sided access.

use std::fmt;
use std::ops::{Bound, RangeBounds};

use crate::error::{Error, InvalidArgument, Result};

/// A description of remote memory a peer granted us: address, length and remote key.
///
/// A token can only be narrowed ([`slice`](RemoteToken::slice)), never widened; operations
/// check local lengths against it before posting. The rkey is a capability, so `Debug` does
/// not print it. With the `serde` feature the token is serialisable for exchange.
///
/// Every token's range lies inside the address space (`addr + len` does not overflow): each
/// way to make one checks it ([`new`](RemoteToken::new) panics, [`try_new`](RemoteToken::try_new),
/// [`from_bytes`](RemoteToken::from_bytes) and serde's `Deserialize` return an error), so
/// [`slice`](RemoteToken::slice) and [`check`](RemoteToken::check) never compute an address
/// past the end. Build tokens from a peer's announcement with `try_new` or `from_bytes`.
///
/// # Examples
///
/// ```
/// use tokio_rdma::buf::RemoteToken;
/// let t = RemoteToken::new(0x1000, 4096, 0x1234);
/// let part = t.slice(1024..2048).unwrap();
/// assert_eq!((part.addr(), part.len()), (0x1400, 1024));
/// assert!(t.slice(4000..5000).is_err());
/// assert!(!format!("{t:?}").contains("1234"));
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct RemoteToken {
    addr: u64,
    len: u64,
    rkey: u32,
}

impl RemoteToken {
    /// A token for `len` bytes at `addr` accessible with `rkey`, for a range known to be
    /// valid (memory of this process, or a peer's announcement already checked). For values
    /// straight from a peer use [`try_new`](Self::try_new).
    ///
    /// # Panics
    ///
    /// If the range wraps the address space (`addr + len` overflows `u64`).
    #[track_caller]
    pub fn new(addr: u64, len: u64, rkey: u32) -> RemoteToken {
        match Self::try_new(addr, len, rkey) {
            Ok(t) => t,
            Err(e) => panic!("{e}"),
        }
    }

    /// A token for `len` bytes at `addr` accessible with `rkey` (as received from a peer).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] if the range wraps the address space (`addr + len`
    /// overflows `u64`).
    ///
    /// # Examples
    ///
    /// ```
    /// use tokio_rdma::buf::RemoteToken;
    /// assert!(RemoteToken::try_new(0x1000, 4096, 7).is_ok());
    /// assert!(RemoteToken::try_new(u64::MAX - 10, 11, 7).is_err());
    /// ```
    pub fn try_new(addr: u64, len: u64, rkey: u32) -> Result<RemoteToken> {
        if addr.checked_add(len).is_none() {
            return Err(Error::InvalidArgument(InvalidArgument::TokenWraps {
                addr,
                len,
            }));
        }
        Ok(RemoteToken { addr, len, rkey })
    }

    /// The remote start address.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// The length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the token covers no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The remote key.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    /// The sub-range `range` (relative to the token's start).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] if the range is not within the token.
    pub fn slice(&self, range: impl RangeBounds<u64>) -> Result<RemoteToken> {
        let start = match range.start_bound() {
            Bound::Included(&n) => Some(n),
            Bound::Excluded(&n) => n.checked_add(1),
            Bound::Unbounded => Some(0),
        };
        let end = match range.end_bound() {
            Bound::Included(&n) => n.checked_add(1),
            Bound::Excluded(&n) => Some(n),
            Bound::Unbounded => Some(self.len),
        };
        match (start, end) {
            (Some(s), Some(e)) if s <= e && e <= self.len => Ok(RemoteToken {
                addr: self.addr + s,
                len: e - s,
                rkey: self.rkey,
            }),
            _ => Err(Error::InvalidArgument(InvalidArgument::TokenSlice {
                start: range.start_bound().cloned(),
                end: range.end_bound().cloned(),
                token_len: self.len,
            })),
        }
    }

    /// Checks that `len` bytes at `offset` fit in the token and returns their address.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] if they do not fit.
    #[inline]
    pub fn check(&self, offset: u64, len: u64) -> Result<u64> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.addr + offset),
            _ => Err(Error::InvalidArgument(InvalidArgument::TokenRange {
                offset,
                len,
                token_len: self.len,
            })),
        }
    }

    /// Encodes the token as 20 bytes (big endian) for exchange without serde.
    pub fn to_bytes(&self) -> [u8; 20] {
        let mut b = [0u8; 20];
        b[..8].copy_from_slice(&self.addr.to_be_bytes());
        b[8..16].copy_from_slice(&self.len.to_be_bytes());
        b[16..].copy_from_slice(&self.rkey.to_be_bytes());
        b
    }

    /// Decodes [`to_bytes`](Self::to_bytes).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a wrong length or a range that wraps the address space.
    pub fn from_bytes(b: &[u8]) -> Result<RemoteToken> {
        let b: &[u8; 20] = b
            .try_into()
            .map_err(|_| Error::InvalidArgument(InvalidArgument::TokenLength { got: b.len() }))?;
        let addr = u64::from_be_bytes(b[..8].try_into().expect("8 bytes"));
        let len = u64::from_be_bytes(b[8..16].try_into().expect("8 bytes"));
        let rkey = u32::from_be_bytes(b[16..].try_into().expect("4 bytes"));
        RemoteToken::try_new(addr, len, rkey)
    }
}

/// The derived form (a struct `RemoteToken` with fields `addr`, `len`, `rkey`), checked like
/// [`RemoteToken::try_new`]: a token that wraps the address space is a deserialization error.
#[cfg(feature = "serde")]
impl<'de> serde::Deserialize<'de> for RemoteToken {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        #[serde(rename = "RemoteToken")]
        struct Unchecked {
            addr: u64,
            len: u64,
            rkey: u32,
        }
        let t = Unchecked::deserialize(d)?;
        RemoteToken::try_new(t.addr, t.len, t.rkey).map_err(serde::de::Error::custom)
    }
}

impl fmt::Debug for RemoteToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteToken")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::reversed_empty_ranges)]
    fn slicing_stays_in_bounds() {
        let t = RemoteToken::new(100, 10, 7);
        assert_eq!(t.slice(..).unwrap(), t);
        assert_eq!(t.slice(2..=4).unwrap().len(), 3);
        assert!(t.slice(0..11).is_err());
        assert!(t.slice(5..4).is_err());
        assert!(t.slice(u64::MAX..).is_err());
        assert!(t.slice(..=u64::MAX).is_err());
        let s = t.slice(4..).unwrap();
        assert!(s.slice(0..7).is_err(), "a slice cannot be widened back");
        assert_eq!(t.check(8, 2).unwrap(), 108);
        assert!(t.check(8, 3).is_err());
        assert!(t.check(u64::MAX, 2).is_err());
    }

    #[test]
    fn bytes_round_trip() {
        let t = RemoteToken::new(0xdead_0000, 4096, 0x55);
        assert_eq!(RemoteToken::from_bytes(&t.to_bytes()).unwrap(), t);
        assert!(RemoteToken::from_bytes(&[0; 19]).is_err());
        let mut wrap = [0u8; 20];
        wrap[..8].copy_from_slice(&u64::MAX.to_be_bytes());
        wrap[8..16].copy_from_slice(&2u64.to_be_bytes());
        assert!(RemoteToken::from_bytes(&wrap).is_err());
    }

    /// At 61ac8ac `new` built a token that wraps the address space; its `check` then
    /// overflowed (a panic in debug builds, a wrapped address in release builds).
    #[test]
    #[should_panic(expected = "wraps the address space")]
    fn new_refuses_a_range_that_wraps() {
        let t = RemoteToken::new(u64::MAX - 1, 4, 1);
        // Reached only without the check: the address computed here is past the end.
        let _ = t.check(3, 1);
    }

    #[test]
    fn the_largest_ranges_stay_in_the_address_space() {
        let end = RemoteToken::new(u64::MAX - 4, 4, 1);
        assert_eq!(end.check(3, 1).unwrap(), u64::MAX - 1);
        assert_eq!(end.slice(4..).unwrap().addr(), u64::MAX);
        assert!(RemoteToken::new(0, u64::MAX, 1).slice(u64::MAX..).is_ok());
    }

    /// At 61ac8ac the derived `Deserialize` accepted a token that wraps the address space.
    #[cfg(feature = "serde")]
    #[test]
    fn deserialize_checks_the_range() {
        use serde::Deserialize;
        use serde::de::value::{Error as DeError, SeqDeserializer};
        let de = |v: [u64; 3]| {
            RemoteToken::deserialize(SeqDeserializer::<_, DeError>::new(v.into_iter()))
        };
        assert_eq!(
            de([0x1000, 4096, 7]).unwrap(),
            RemoteToken::new(0x1000, 4096, 7)
        );
        let err = de([u64::MAX - 1, 4, 1]).unwrap_err();
        assert!(err.to_string().contains("wraps"), "{err}");
    }
}
