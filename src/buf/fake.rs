//! A fake [`Registrar`] for host unit tests of the pool and the cache: hands out made-up
//! lkeys, records what it registered, counts live registrations, and can fail like a device
//! whose `RLIMIT_MEMLOCK` is exhausted. It is only ever used to test pure logic.

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};

use super::registrar::{Registrar, Registration};
use crate::error::{Error, Result};
use crate::verbs::AccessFlags;

/// Every successful registration: (address, length, access).
pub(crate) type Calls = Arc<Mutex<Vec<(u64, usize, AccessFlags)>>>;

#[derive(Debug, Default)]
pub(crate) struct FakeRegistrar {
    next: AtomicU32,
    /// Registrations not yet dropped.
    pub(crate) live: Arc<AtomicUsize>,
    /// Every successful registration.
    pub(crate) calls: Calls,
    /// Registrations longer than this fail with ENOMEM.
    pub(crate) fail_above: Option<usize>,
}

#[derive(Debug)]
struct FakeReg {
    lkey: u32,
    live: Arc<AtomicUsize>,
}

impl Registration for FakeReg {
    fn lkey(&self) -> u32 {
        self.lkey
    }
}

impl Drop for FakeReg {
    fn drop(&mut self) {
        self.live.fetch_sub(1, SeqCst);
    }
}

impl FakeRegistrar {
    /// A registrar failing registrations longer than `max` bytes with ENOMEM.
    pub(crate) fn failing_above(max: usize) -> FakeRegistrar {
        FakeRegistrar {
            fail_above: Some(max),
            ..FakeRegistrar::default()
        }
    }
}

impl Registrar for FakeRegistrar {
    unsafe fn register(
        &self,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
    ) -> Result<Box<dyn Registration>> {
        if self.fail_above.is_some_and(|max| len > max) {
            return Err(Error::code(libc::ENOMEM, |source| Error::RegMr {
                len,
                source,
            }));
        }
        self.live.fetch_add(1, SeqCst);
        self.calls.lock().unwrap().push((addr as u64, len, access));
        Ok(Box::new(FakeReg {
            lkey: 0x100 + self.next.fetch_add(1, SeqCst),
            live: self.live.clone(),
        }))
    }
}

/// A fake registrar whose counters can still be read after it was moved into a cache.
pub(crate) fn shared() -> (FakeRegistrar, Arc<AtomicUsize>, Calls) {
    let f = FakeRegistrar::default();
    let (live, calls) = (f.live.clone(), f.calls.clone());
    (f, live, calls)
}
