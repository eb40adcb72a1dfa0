//! Scatter/gather sources and targets: one buffer or a list of buffers.

use crate::buf::{IoBuf, IoBufMut};
use crate::error::{Error, InvalidArgument, Result};
use crate::proto::SgList;
use crate::verbs::Sge;

mod sealed {
    pub trait Sealed {}
}

/// Local memory an operation reads from (sends, RDMA WRITE): any [`IoBuf`], or a
/// [`BufList`] of them for a scatter/gather list.
pub trait SgSource: sealed::Sealed + Send + 'static {
    /// Appends one entry per non-empty buffer covering its initialised bytes.
    #[doc(hidden)]
    fn source_segments(&self, out: &mut SgList) -> Result<()>;
    /// A single buffer's entry (`None` inside: empty) without building a list; `None` for a
    /// list of buffers.
    #[doc(hidden)]
    #[inline]
    fn source_single(&self) -> Option<Result<Option<Sge>>> {
        None
    }
}

/// Local memory an operation writes into (receives, RDMA READ): any [`IoBufMut`], or a
/// [`BufList`] of them.
pub trait SgTarget: sealed::Sealed + Send + 'static {
    /// Appends one entry per non-empty buffer covering its whole capacity.
    #[doc(hidden)]
    fn target_segments(&mut self, out: &mut SgList) -> Result<()>;
    /// A single buffer's entry (`None` inside: empty) without building a list; `None` for a
    /// list of buffers.
    #[doc(hidden)]
    #[inline]
    fn target_single(&mut self) -> Option<Result<Option<Sge>>> {
        None
    }
    /// Records that the first `n` bytes (across the list, in order) were written.
    #[doc(hidden)]
    fn set_filled(&mut self, n: usize);
}

/// Several buffers used as one scatter/gather list, in order.
///
/// # Examples
///
/// ```
/// use tokio_rdma::ops::BufList;
/// let list = BufList(vec![vec![1u8; 16], vec![2u8; 32]]);
/// assert_eq!(list.0.len(), 2);
/// ```
#[derive(Debug, Default)]
pub struct BufList<B>(pub Vec<B>);

#[inline]
fn sge(ptr: *const u8, len: usize, lkey: Option<u32>) -> Result<Option<Sge>> {
    if len == 0 {
        return Ok(None);
    }
    let Some(lkey) = lkey else {
        return Err(Error::InvalidArgument(InvalidArgument::NoLkey));
    };
    let Ok(len) = u32::try_from(len) else {
        return Err(Error::InvalidArgument(InvalidArgument::BufferTooLarge {
            len,
        }));
    };
    Ok(Some(Sge::new(ptr as u64, len, lkey)))
}

impl<B: IoBuf> sealed::Sealed for B {}

impl<B: IoBuf> SgSource for B {
    fn source_segments(&self, out: &mut SgList) -> Result<()> {
        if let Some(s) = sge(self.stable_ptr(), self.bytes_init(), self.lkey())? {
            out.push(s);
        }
        Ok(())
    }

    #[inline]
    fn source_single(&self) -> Option<Result<Option<Sge>>> {
        Some(sge(self.stable_ptr(), self.bytes_init(), self.lkey()))
    }
}

impl<B: IoBufMut> SgTarget for B {
    fn target_segments(&mut self, out: &mut SgList) -> Result<()> {
        if let Some(s) = sge(self.stable_mut_ptr(), self.bytes_total(), self.lkey())? {
            out.push(s);
        }
        Ok(())
    }

    #[inline]
    fn target_single(&mut self) -> Option<Result<Option<Sge>>> {
        Some(sge(self.stable_mut_ptr(), self.bytes_total(), self.lkey()))
    }

    fn set_filled(&mut self, n: usize) {
        let n = n.min(self.bytes_total());
        // SAFETY: the device wrote `n` bytes from the start of the buffer (the completion's
        // byte count), so they are initialised.
        unsafe { self.set_init(n) };
    }
}

impl<B: IoBuf> sealed::Sealed for BufList<B> {}

impl<B: IoBuf> SgSource for BufList<B> {
    fn source_segments(&self, out: &mut SgList) -> Result<()> {
        for b in &self.0 {
            b.source_segments(out)?;
        }
        Ok(())
    }
}

impl<B: IoBufMut> SgTarget for BufList<B> {
    fn target_segments(&mut self, out: &mut SgList) -> Result<()> {
        for b in &mut self.0 {
            b.target_segments(out)?;
        }
        Ok(())
    }

    fn set_filled(&mut self, mut n: usize) {
        for b in &mut self.0 {
            let here = n.min(b.bytes_total());
            b.set_filled(here);
            n -= here;
        }
    }
}

/// Builds the scatter/gather list of a source into `out` (emptied first; a spilled one keeps
/// its memory), checking the queue pair's SGE limit.
#[inline]
pub(crate) fn source_list_into<S: SgSource>(src: &S, max_sge: u32, out: &mut SgList) -> Result<()> {
    out.clear();
    src.source_segments(out)?;
    check_count(out.len(), max_sge)
}

/// Builds the scatter/gather list of a target into `out` (emptied first; a spilled one keeps
/// its memory), checking the queue pair's SGE limit.
#[inline]
pub(crate) fn target_list_into<T: SgTarget>(
    dst: &mut T,
    max_sge: u32,
    out: &mut SgList,
) -> Result<()> {
    out.clear();
    dst.target_segments(out)?;
    check_count(out.len(), max_sge)
}

/// Refuses more scatter/gather entries than a queue allows (`TooManySges`).
#[inline]
pub(crate) fn check_count(n: usize, max_sge: u32) -> Result<()> {
    if n > max_sge as usize {
        return Err(Error::InvalidArgument(InvalidArgument::TooManySges {
            count: n,
            max: max_sge,
        }));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source_list<S: SgSource>(src: &S, max_sge: u32) -> Result<SgList> {
        let mut l = SgList::new();
        source_list_into(src, max_sge, &mut l)?;
        Ok(l)
    }

    #[test]
    fn unregistered_memory_is_rejected_with_a_clear_error() {
        let err = source_list(&vec![1u8; 4], 4).unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument(InvalidArgument::NoLkey)),
            "{err}"
        );
        assert!(err.to_string().contains("no lkey"), "{err}");
        // It names what works on a connection (a RegisteredBuffer of one's own is refused
        // there: each connection has its own protection domain).
        assert!(err.to_string().contains("conn.pool()"), "{err}");
        // Empty buffers need no key and produce no entry.
        assert!(
            source_list(&Vec::<u8>::new(), 4)
                .unwrap()
                .as_slice()
                .is_empty()
        );
    }

    /// A list refilled in place (a batch's slot) holds only the new entries, also after it
    /// had spilled to the heap.
    #[test]
    fn a_list_refilled_in_place_holds_only_the_new_entries() {
        let mut l = SgList::new();
        for i in 0..6u32 {
            l.push(crate::verbs::Sge::new(u64::from(i) * 8, 8, 7));
        }
        assert_eq!(l.len(), 6);
        let empty: Vec<u8> = Vec::new();
        source_list_into(&empty, 4, &mut l).unwrap();
        assert!(l.as_slice().is_empty());
        for i in 0..2u32 {
            l.push(crate::verbs::Sge::new(u64::from(i), 1, 7));
        }
        assert_eq!(l.as_slice().len(), 2);
        assert_eq!(l.total_len(), 2);
    }

    #[test]
    fn filled_bytes_spread_over_a_list() {
        let mut list = BufList(vec![Vec::<u8>::with_capacity(4), Vec::with_capacity(4)]);
        list.0[0].resize(4, 9);
        list.0[1].resize(4, 9);
        list.0[1].truncate(0);
        list.set_filled(6);
        assert_eq!(list.0[0].len(), 4);
        assert_eq!(list.0[1].len(), 2);
    }
}
