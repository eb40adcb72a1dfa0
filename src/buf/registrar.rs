//! The registration seam shared by the pool and the registration cache: something that turns
//! an address range into a registration with a local key. The real one is [`MrRegistrar`]
//! (`ibv_reg_mr` through [`MemoryRegion`]); host unit tests substitute a fake.

use std::fmt;

use crate::error::Result;
use crate::verbs::{AccessFlags, MemoryRegion, OdpOps, ProtectionDomain, explain_reg_error};

/// A live registration of a range of memory: deregistered when dropped.
///
/// # Examples
///
/// ```
/// use tokio_rdma::buf::Registration;
/// #[derive(Debug)]
/// struct Fake(u32);
/// impl Registration for Fake {
///     fn lkey(&self) -> u32 { self.0 }
/// }
/// assert_eq!(Fake(7).lkey(), 7);
/// assert!(Fake(7).memory_region().is_none());
/// ```
pub trait Registration: Send + Sync + fmt::Debug {
    /// The local key covering the registered range.
    fn lkey(&self) -> u32;
    /// The verbs memory region behind the registration, if it is a real one (needed to bind
    /// memory windows).
    fn memory_region(&self) -> Option<&MemoryRegion> {
        None
    }
}

impl Registration for MemoryRegion {
    fn lkey(&self) -> u32 {
        MemoryRegion::lkey(self)
    }
    fn memory_region(&self) -> Option<&MemoryRegion> {
        Some(self)
    }
}

/// Registers memory for local device access.
///
/// # Examples
///
/// ```no_run
/// use tokio_rdma::buf::{MrRegistrar, Registrar};
/// use tokio_rdma::verbs::{AccessFlags, Context, ProtectionDomain};
/// let pd = ProtectionDomain::new(&Context::open("rxe0")?)?;
/// let registrar = MrRegistrar::new(&pd);
/// let mut v = vec![0u8; 4096];
/// // SAFETY: `v` outlives the registration and is not reallocated meanwhile.
/// let reg = unsafe { registrar.register(v.as_mut_ptr(), v.len(), AccessFlags::LOCAL_WRITE)? };
/// println!("lkey {:#x}", reg.lkey());
/// # Ok::<(), tokio_rdma::Error>(())
/// ```
pub trait Registrar: Send + Sync + fmt::Debug + 'static {
    /// Registers `len` bytes at `addr` with `access`.
    ///
    /// # Safety
    ///
    /// The range must be mapped, and stay mapped to the same pages, until the returned
    /// registration is dropped.
    ///
    /// # Errors
    ///
    /// The registration error; [`Error::MemlockExhausted`](crate::Error::MemlockExhausted)
    /// when `RLIMIT_MEMLOCK` is the reason.
    unsafe fn register(
        &self,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
    ) -> Result<Box<dyn Registration>>;

    /// Whether registrations may carry [`AccessFlags::MW_BIND`] and windows can be bound to
    /// them (the device supports type-2 memory windows).
    fn supports_windows(&self) -> bool {
        false
    }

    /// Checks that registrations with `access` can serve the RC operations `ops` (for
    /// [`AccessFlags::ON_DEMAND`]: the device's ODP capabilities). The default accepts all.
    ///
    /// # Errors
    ///
    /// [`Error::OdpUnsupported`](crate::Error::OdpUnsupported) naming what is missing.
    fn require(&self, access: AccessFlags, ops: OdpOps) -> Result<()> {
        let _ = (access, ops);
        Ok(())
    }
}

/// The real [`Registrar`]: `ibv_reg_mr` in a protection domain.
///
/// # Examples
///
/// ```no_run
/// use tokio_rdma::buf::MrRegistrar;
/// use tokio_rdma::verbs::{Context, ProtectionDomain};
/// let pd = ProtectionDomain::new(&Context::open("rxe0")?)?;
/// let registrar = MrRegistrar::new(&pd);
/// # Ok::<(), tokio_rdma::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct MrRegistrar {
    pd: ProtectionDomain,
}

impl MrRegistrar {
    /// A registrar for `pd`.
    pub fn new(pd: &ProtectionDomain) -> MrRegistrar {
        MrRegistrar { pd: pd.clone() }
    }

    /// The protection domain registrations go to.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }
}

impl Registrar for MrRegistrar {
    unsafe fn register(
        &self,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
    ) -> Result<Box<dyn Registration>> {
        // SAFETY: forwarded contract: the range stays mapped until the region is dropped.
        let mr = unsafe { MemoryRegion::register(&self.pd, addr, len, access) }
            .map_err(explain_reg_error)?;
        tracing::debug!(len, ?access, "registered memory");
        Ok(Box::new(mr))
    }

    fn supports_windows(&self) -> bool {
        self.pd.context().device_attr().supports_mw_type2()
    }

    fn require(&self, access: AccessFlags, ops: OdpOps) -> Result<()> {
        self.pd.context().require_odp(access, ops, false)
    }
}
