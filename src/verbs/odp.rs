//! On-demand paging (ODP) registrations: prefetching (`ibv_advise_mr`) the pages of a range
//! of an ODP region. What the device offers, and the check before registering, is
//! `odp_caps.rs`.

use std::ops::Range;

use super::mr::MemoryRegion;
use super::pd::ProtectionDomain;
use crate::error::{Error, InvalidArgument, Result};
use crate::sys;

/// What [`MemoryRegion::prefetch`] asks the device to do with the pages of a range
/// (`enum ibv_advise_mr_advice`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Prefetch {
    /// Fault the pages in for reading (`IBV_ADVISE_MR_ADVICE_PREFETCH`).
    Read,
    /// Fault the pages in writable (`IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE`): what a later
    /// receive, RDMA WRITE or atomic into them needs.
    Write,
    /// Map only the pages present already, without faulting any in
    /// (`IBV_ADVISE_MR_ADVICE_PREFETCH_NO_FAULT`).
    NoFault,
}

impl Prefetch {
    fn raw(self) -> u32 {
        match self {
            Prefetch::Read => sys::IB_UVERBS_ADVISE_MR_ADVICE_PREFETCH,
            Prefetch::Write => sys::IB_UVERBS_ADVISE_MR_ADVICE_PREFETCH_WRITE,
            Prefetch::NoFault => sys::IB_UVERBS_ADVISE_MR_ADVICE_PREFETCH_NO_FAULT,
        }
    }
}

/// The `ibv_sge` of `range` of `mr`, checked against the region.
fn advise_sge(mr: &MemoryRegion, range: &Range<usize>) -> Result<sys::ibv_sge> {
    if !mr.is_on_demand() {
        return Err(Error::InvalidArgument(InvalidArgument::PrefetchNotOnDemand));
    }
    let length = u32::try_from(range.len())
        .ok()
        .filter(|_| range.start < range.end && range.end <= mr.len());
    let Some(length) = length else {
        return Err(Error::InvalidArgument(InvalidArgument::PrefetchRange {
            range: range.clone(),
            region_len: mr.len(),
        }));
    };
    Ok(sys::ibv_sge {
        addr: mr.addr() + range.start as u64,
        length,
        lkey: mr.lkey(),
    })
}

/// `ibv_advise_mr` of one entry; `flush`: wait until the pages are mapped.
fn advise(
    pd: &ProtectionDomain,
    advice: Prefetch,
    flush: bool,
    mut sge: sys::ibv_sge,
) -> Result<()> {
    let flags = if flush {
        sys::IB_UVERBS_ADVISE_MR_FLAG_FLUSH
    } else {
        0
    };
    // The kernel validates the key and range: a region deregistered meanwhile fails the call.
    // SAFETY: the PD is alive (borrowed); `sge` is one valid entry (lkey, range) of this PD.
    let rc = unsafe { sys::ibv_advise_mr(pd.as_ptr(), advice.raw(), flags, &mut sge, 1) };
    if rc != 0 {
        return Err(Error::code(rc, Error::AdviseMr));
    }
    Ok(())
}

impl MemoryRegion {
    /// Asks the device to fault in `range` (offsets into the region) of an on-demand region
    /// ahead of use, without waiting (`ibv_advise_mr` without `IBV_ADVISE_MR_FLAG_FLUSH`): the
    /// kernel queues the work and returns. A hint: the first access pays the fault if the
    /// prefetch has not run yet.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a region that is not on demand or a range outside it
    /// (or longer than 4 GiB); [`Error::AdviseMr`] with the errno (`EOPNOTSUPP`: the device
    /// has no prefetch; soft-RoCE got it later than ODP, Linux 6.19's has it).
    pub fn advise(&self, range: Range<usize>, advice: Prefetch) -> Result<()> {
        let sge = advise_sge(self, &range)?;
        advise(self.pd(), advice, false, sge)
    }

    /// Faults in `range` (offsets into the region) of an on-demand region and resolves when the
    /// pages are mapped for the device (`ibv_advise_mr` with `IBV_ADVISE_MR_FLAG_FLUSH`). The
    /// call blocks in the kernel while it faults the pages in, so it runs on Tokio's blocking
    /// thread pool (`spawn_blocking`): the runtime's workers keep running.
    ///
    /// # Errors
    ///
    /// As [`advise`](Self::advise); [`Error::InvalidArgument`] outside a Tokio runtime.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future leaves the prefetch running to its end on the blocking
    /// pool; it only maps pages, and changes nothing the region's users could observe.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use tokio_rdma::verbs::{AccessFlags, Context, Prefetch, ProtectionDomain, RegisteredBuffer};
    /// # async fn demo() -> tokio_rdma::Result<()> {
    /// let pd = ProtectionDomain::new(&Context::open("rxe0")?)?;
    /// let access = AccessFlags::LOCAL_WRITE | AccessFlags::ON_DEMAND;
    /// let buf = RegisteredBuffer::new(&pd, 1 << 30, access)?; // 1 GiB, nothing pinned
    /// buf.memory_region().prefetch(0..(4 << 20), Prefetch::Write).await?; // first 4 MiB ready
    /// # Ok(()) }
    /// ```
    pub async fn prefetch(&self, range: Range<usize>, advice: Prefetch) -> Result<()> {
        let sge = advise_sge(self, &range)?;
        let pd = self.pd().clone();
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return Err(Error::InvalidArgument(
                InvalidArgument::PrefetchWithoutRuntime,
            ));
        };
        match handle
            .spawn_blocking(move || advise(&pd, advice, true, sge))
            .await
        {
            Ok(res) => res,
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        }
    }
}
