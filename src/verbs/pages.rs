//! Page-granular anonymous memory (`mmap`/`munmap`), preferring 2 MiB huge pages, and the
//! locked-memory limit (`RLIMIT_MEMLOCK`) that registrations count against.
//!
//! The registered-buffer pool carves a few such mappings into size classes. Huge pages mean
//! fewer page-table and IOMMU/MTT entries per registered byte and faster registration.

use std::fmt;
use std::io;
use std::ptr::NonNull;

use crate::error::{Error, InvalidArgument, Result};

/// Size of a huge page as requested with `MAP_HUGE_2MB`.
pub const HUGE_PAGE_SIZE: usize = 2 << 20;
/// Size of a base page assumed for alignment (x86-64, aarch64 with 4 KiB pages).
pub const BASE_PAGE_SIZE: usize = 4096;

/// Whether a mapping should use 2 MiB huge pages.
///
/// # Examples
///
/// ```
/// use tokio_rdma::verbs::HugePages;
/// assert_eq!(HugePages::default(), HugePages::Auto);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HugePages {
    /// Try `MAP_HUGETLB` (2 MiB); fall back to base pages if the system has none free.
    #[default]
    Auto,
    /// Base (4 KiB) pages only.
    Never,
    /// Huge pages or an error ([`Error::MapMemory`]).
    Require,
}

/// An anonymous, private, zero-filled mapping, unmapped on drop.
///
/// The memory is always initialised (the kernel zero-fills it), so any byte range of it may be
/// viewed as `u8`s; who may view or write it when is up to the owner.
///
/// # Examples
///
/// ```
/// use tokio_rdma::verbs::{HugePages, PageMapping};
/// let m = PageMapping::new(10_000, HugePages::Never)?;
/// assert_eq!(m.len(), 12_288); // rounded up to whole 4 KiB pages
/// assert!(!m.is_huge());
/// # Ok::<(), tokio_rdma::Error>(())
/// ```
pub struct PageMapping {
    ptr: NonNull<u8>,
    len: usize,
    huge: bool,
}

// SAFETY: the mapping is plain memory owned by this value; it is not tied to a thread.
unsafe impl Send for PageMapping {}
// SAFETY: `&PageMapping` only exposes the address and length.
unsafe impl Sync for PageMapping {}

impl PageMapping {
    /// Maps at least `len` bytes (rounded up to the page size used).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for `len == 0`; [`Error::MapMemory`] if `mmap` fails (with
    /// [`HugePages::Require`]: if no huge pages are available).
    pub fn new(len: usize, huge: HugePages) -> Result<PageMapping> {
        if len == 0 {
            return Err(Error::InvalidArgument(InvalidArgument::EmptyMapping));
        }
        if huge != HugePages::Never {
            match map(round_up(len, HUGE_PAGE_SIZE)?, true) {
                Ok(m) => return Ok(m),
                Err(e) if huge == HugePages::Require => return Err(e),
                Err(e) => tracing::debug!(len, error = %e, "no huge pages; using 4 KiB pages"),
            }
        }
        map(round_up(len, BASE_PAGE_SIZE)?, false)
    }

    /// Start of the mapping.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length in bytes (a multiple of the page size).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: empty mappings cannot be created.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Whether the mapping is backed by 2 MiB huge pages.
    pub fn is_huge(&self) -> bool {
        self.huge
    }
}

fn round_up(len: usize, to: usize) -> Result<usize> {
    len.checked_next_multiple_of(to)
        .ok_or(Error::InvalidArgument(InvalidArgument::MappingOverflow {
            len,
        }))
}

fn map(len: usize, huge: bool) -> Result<PageMapping> {
    let mut flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
    if huge {
        flags |= libc::MAP_HUGETLB | libc::MAP_HUGE_2MB;
    }
    // SAFETY: an anonymous mapping at an address the kernel chooses; no existing memory is
    // affected. The result is checked against MAP_FAILED.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(Error::MapMemory {
            len,
            huge,
            source: io::Error::last_os_error(),
        });
    }
    let ptr = NonNull::new(p.cast::<u8>()).expect("mmap never returns NULL on success");
    tracing::debug!(len, huge, "mapped memory");
    Ok(PageMapping { ptr, len, huge })
}

impl Drop for PageMapping {
    fn drop(&mut self) {
        // SAFETY: the mapping was created by `map` with exactly this address and length and is
        // unmapped once. Owners deregister it before dropping it.
        let rc = unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
        if rc != 0 {
            tracing::warn!(len = self.len, error = %io::Error::last_os_error(), "munmap failed");
        }
    }
}

impl fmt::Debug for PageMapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PageMapping")
            .field("addr", &format_args!("{:#x}", self.ptr.as_ptr() as usize))
            .field("len", &self.len)
            .field("huge", &self.huge)
            .finish()
    }
}

/// The process's `RLIMIT_MEMLOCK` (soft, hard) in bytes; `None` stands for unlimited.
///
/// # Errors
///
/// The OS error if `getrlimit` fails.
///
/// # Examples
///
/// ```
/// let (soft, _hard) = tokio_rdma::verbs::memlock_limit()?;
/// match soft {
///     Some(bytes) => println!("may lock {bytes} bytes"),
///     None => println!("unlimited"),
/// }
/// # Ok::<(), std::io::Error>(())
/// ```
pub fn memlock_limit() -> io::Result<(Option<u64>, Option<u64>)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid out-parameter for getrlimit.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    let conv = |v: libc::rlim_t| (v != libc::RLIM_INFINITY).then_some(v);
    Ok((conv(lim.rlim_cur), conv(lim.rlim_max)))
}

/// Bytes this process has locked (`VmLck` in `/proc/self/status`), if readable.
fn locked_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmLck:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Turns an `ibv_reg_mr` failure with `ENOMEM`/`EPERM` into [`Error::MemlockExhausted`] when
/// `RLIMIT_MEMLOCK` is finite (the usual cause); any other error is returned unchanged.
pub(crate) fn explain_reg_error(err: Error) -> Error {
    let Error::RegMr { len, source } = err else {
        return err;
    };
    let errno = source.raw_os_error();
    if !matches!(errno, Some(libc::ENOMEM) | Some(libc::EPERM)) {
        return Error::RegMr { len, source };
    }
    match memlock_limit() {
        Ok((Some(limit), _)) => Error::MemlockExhausted {
            len,
            limit,
            locked: locked_bytes(),
            source,
        },
        _ => Error::RegMr { len, source },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_pages_round_up_and_are_zeroed() {
        let m = PageMapping::new(1, HugePages::Never).unwrap();
        assert_eq!(m.len(), BASE_PAGE_SIZE);
        assert_eq!(m.as_ptr() as usize % BASE_PAGE_SIZE, 0);
        // SAFETY: the mapping is `len` readable bytes owned by `m`.
        let bytes = unsafe { std::slice::from_raw_parts(m.as_ptr(), m.len()) };
        assert!(bytes.iter().all(|&b| b == 0));
    }

    #[test]
    fn auto_falls_back_or_uses_huge_pages() {
        let m = PageMapping::new(3 << 20, HugePages::Auto).unwrap();
        if m.is_huge() {
            assert_eq!(m.len(), 4 << 20);
            assert_eq!(m.as_ptr() as usize % HUGE_PAGE_SIZE, 0);
        } else {
            assert_eq!(m.len(), 3 << 20);
        }
        assert!(PageMapping::new(0, HugePages::Auto).is_err());
    }

    #[test]
    fn memlock_error_names_the_limit() {
        let err = Error::code(libc::ENOMEM, |source| Error::RegMr {
            len: 1 << 30,
            source,
        });
        let explained = explain_reg_error(err);
        match memlock_limit().unwrap().0 {
            Some(limit) => {
                let msg = explained.to_string();
                assert!(msg.contains("RLIMIT_MEMLOCK"), "{msg}");
                assert!(msg.contains(&limit.to_string()), "{msg}");
                assert_eq!(explained.raw_os_error(), Some(libc::ENOMEM));
            }
            None => assert!(matches!(explained, Error::RegMr { .. })),
        }
        let other = Error::code(libc::EINVAL, |source| Error::RegMr { len: 1, source });
        assert!(matches!(explain_reg_error(other), Error::RegMr { .. }));
    }
}
