//! [`PoolInner`]: what a pool and its buffers share: the size classes, each with its
//! registered memory, free list and waiters.

use std::sync::atomic::AtomicU64;

use super::freelist::{FreeList, home_hint};
use super::waiters::WaitQueue;
use crate::buf::registrar::Registration;
use crate::error::{Error, InvalidArgument, Result};
use crate::verbs::PageMapping;

/// The state shared by a [`Pool`](super::Pool)'s clones and its [`PoolBuf`](super::PoolBuf)s.
pub(crate) struct PoolInner {
    pub(super) classes: Box<[Class]>,
    pub(super) waits: AtomicU64,
    pub(super) huge: bool,
}

pub(super) struct Class {
    pub(super) size: usize,
    pub(super) count: u32,
    // Field order matters: deregister before unmapping.
    pub(super) reg: Box<dyn Registration>,
    pub(super) mem: PageMapping,
    pub(super) free: FreeList,
    pub(super) waiters: WaitQueue,
}

impl PoolInner {
    pub(super) fn class_for(&self, len: usize) -> Result<usize> {
        let i = self.classes.partition_point(|c| c.size < len);
        if i == self.classes.len() {
            let max = self.classes.last().map_or(0, |c| c.size);
            return Err(Error::InvalidArgument(
                InvalidArgument::PoolBufferTooLarge { len, largest: max },
            ));
        }
        Ok(i)
    }

    /// The lkey that covers `len` bytes at `addr` if they lie in this pool's registered
    /// memory (whatever buffer they belong to), else `None`.
    pub(crate) fn lkey_of(&self, addr: usize, len: usize) -> Option<u32> {
        self.classes.iter().find_map(|c| {
            let start = c.mem.as_ptr() as usize;
            let end = start + c.mem.len();
            (addr >= start && addr.checked_add(len)? <= end).then(|| c.reg.lkey())
        })
    }

    pub(crate) fn class_size(&self, class: u16) -> usize {
        self.classes[usize::from(class)].size
    }

    pub(crate) fn registration(&self, class: u16) -> &dyn Registration {
        &*self.classes[usize::from(class)].reg
    }

    /// Returns `slot` of `class`: to the oldest waiter, else to the free list.
    pub(crate) fn release(&self, class: u16, slot: u32) {
        let c = &self.classes[usize::from(class)];
        c.waiters.release(&c.free, home_hint(), slot);
    }
}
