//! The memory of rendezvous messages: the sender's message opened READ-only to the peer
//! ([`RdvSource`], kept until the peer acknowledged), and the receiver's destination with its
//! registration ([`Fetch`], kept in the connection's state until the reads completed). The
//! reads themselves are posted by the connection's I/O (`io/fetch.rs`); the receive API that
//! starts them is `rendezvous.rs`.

use std::any::Any;

use bytes::Bytes;

use super::memory::Reservation;
use crate::buf::{IoBufMut, blocking};
use crate::error::{Error, InvalidArgument, Result};
use crate::proto::conn::RemoteMsg;
use crate::verbs::{AccessFlags, MemoryRegion, ProtectionDomain, explain_reg_error};

/// The memory of a rendezvous message this side sent, until the peer read it.
#[derive(Debug)]
pub(crate) struct RdvSource {
    /// Declared first: deregistered before the bytes may go.
    _mr: MemoryRegion,
    _bytes: Bytes,
}

impl RdvSource {
    /// Opens `bytes` to the peer of `pd`'s connection for RDMA READ. The registration (which
    /// pins every page: long for a large message) runs off the runtime's worker threads; the
    /// bytes move into it, so a caller dropped meanwhile frees nothing it uses.
    pub(crate) async fn open(pd: &ProtectionDomain, bytes: Bytes) -> Result<RdvSource> {
        let pd = pd.clone();
        blocking::run_for(bytes.len(), move || RdvSource::register(&pd, bytes)).await
    }

    fn register(pd: &ProtectionDomain, bytes: Bytes) -> Result<RdvSource> {
        // SAFETY: the region is kept with `bytes` (which never move or free their storage
        // while a handle lives) and dropped first; READ-only access never writes the memory.
        let mr = unsafe {
            MemoryRegion::register(
                pd,
                bytes.as_ptr().cast_mut(),
                bytes.len(),
                AccessFlags::REMOTE_READ,
            )
        }
        .map_err(explain_reg_error)?;
        Ok(RdvSource {
            _mr: mr,
            _bytes: bytes,
        })
    }

    /// The message's length.
    pub(crate) fn len(&self) -> u64 {
        self._bytes.len() as u64
    }

    /// The descriptor the peer reads the message with.
    pub(crate) fn descriptor(&self) -> [u8; crate::proto::conn::DESCRIPTOR_LEN as usize] {
        RemoteMsg::encode(
            self._bytes.as_ptr() as u64,
            self._bytes.len() as u64,
            self._mr.rkey(),
        )
    }
}

/// A rendezvous read's destination.
pub(crate) trait FetchBuf: Send + std::fmt::Debug {
    /// The first `len` bytes (the read wrote them).
    fn bytes(&self, len: usize) -> &[u8];
    /// The first `len` bytes as a vector, and whether they had to be copied.
    fn into_vec(self: Box<Self>, len: usize) -> (Vec<u8>, bool);
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send>;
}

impl FetchBuf for Vec<u8> {
    fn bytes(&self, len: usize) -> &[u8] {
        &self[..len]
    }
    fn into_vec(self: Box<Self>, len: usize) -> (Vec<u8>, bool) {
        let mut v = *self;
        v.truncate(len);
        (v, false)
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send> {
        self
    }
}

/// The caller's buffer of a [`recv_into`](super::Connection::recv_into).
#[derive(Debug)]
pub(crate) struct UserDest<B>(pub(crate) B);

impl<B: IoBufMut + std::fmt::Debug> FetchBuf for UserDest<B> {
    fn bytes(&self, len: usize) -> &[u8] {
        assert!(len <= self.0.bytes_total());
        // SAFETY: the buffer's memory is stable and `bytes_total()` long; the read that
        // completed wrote its first `len` bytes.
        unsafe { std::slice::from_raw_parts(self.0.stable_ptr(), len) }
    }
    fn into_vec(self: Box<Self>, len: usize) -> (Vec<u8>, bool) {
        (self.bytes(len).to_vec(), true)
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send> {
        self
    }
}

/// `len` zeroed bytes (lazily, from the allocator's zeroed pages), or an error instead of
/// aborting when memory runs out.
pub(crate) fn zeroed(len: usize) -> Result<Vec<u8>> {
    if len == 0 {
        return Ok(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u8>(len)
        .map_err(|_| Error::InvalidArgument(InvalidArgument::MessageExceedsMemory { len }))?;
    // SAFETY: `layout` has a non-zero size.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return Err(Error::InvalidArgument(
            InvalidArgument::NoMemoryForMessage { len },
        ));
    }
    // SAFETY: allocated by the global allocator with this layout, all `len` bytes zeroed.
    Ok(unsafe { Vec::from_raw_parts(ptr, len, len) })
}

/// The rendezvous message being read, with its destination.
#[derive(Debug)]
pub(crate) struct Fetch {
    pub(crate) msg: RemoteMsg,
    /// Declared before `dest`: a dedicated registration goes before the memory.
    mr: Option<MemoryRegion>,
    pub(crate) dest: Box<dyn FetchBuf>,
    pub(crate) addr: u64,
    pub(crate) lkey: u32,
    /// Bytes whose READ is posted.
    pub(crate) posted: u64,
    /// The live `recv_into` call whose buffer `dest` is (0: none, any receive may take it).
    pub(crate) owner: u64,
    /// `dest`'s bytes in the endpoint's memory budget when the crate allocated it (`recv`),
    /// given back with the fetch (after `dest`).
    pub(crate) reserved: Option<Reservation>,
}

impl Fetch {
    pub(crate) fn len(&self) -> u64 {
        self.msg.len
    }

    /// [`Fetch::new`] with the registration (if any) off the runtime's worker threads. `dest`
    /// moves into the blocking call and comes back in the fetch (or the error): a caller
    /// dropped meanwhile frees nothing the registration uses (the pool drops the result, the
    /// region before `dest`).
    pub(crate) async fn open(
        pd: &ProtectionDomain,
        msg: RemoteMsg,
        (addr, lkey): (usize, Option<u32>),
        dest: Box<dyn FetchBuf>,
        owner: u64,
    ) -> std::result::Result<Fetch, (Error, Box<dyn FetchBuf>)> {
        // An address, not a pointer, is held across the await: `dest` owns the memory it names.
        if lkey.is_some() {
            return Fetch::new(pd, msg, (addr as *mut u8, lkey), dest, owner);
        }
        let pd = pd.clone();
        blocking::run_for(msg.len as usize, move || {
            Fetch::new(&pd, msg, (addr as *mut u8, None), dest, owner)
        })
        .await
    }

    /// A fetch of `msg` into `dest`, whose memory starts at `ptr`: under `lkey` if given,
    /// else through a registration of its own. On failure `dest` comes back.
    pub(crate) fn new(
        pd: &ProtectionDomain,
        msg: RemoteMsg,
        (ptr, lkey): (*mut u8, Option<u32>),
        dest: Box<dyn FetchBuf>,
        owner: u64,
    ) -> std::result::Result<Fetch, (Error, Box<dyn FetchBuf>)> {
        let (mr, lkey) = match lkey {
            Some(k) => (None, k),
            None => {
                // SAFETY: `dest` (stable memory of at least `msg.len` bytes at `ptr`) moves
                // into this fetch, after the region in drop order.
                let reg = unsafe {
                    MemoryRegion::register(pd, ptr, msg.len as usize, AccessFlags::LOCAL_WRITE)
                };
                match reg {
                    Ok(mr) => {
                        let k = mr.lkey();
                        (Some(mr), k)
                    }
                    Err(e) => return Err((explain_reg_error(e), dest)),
                }
            }
        };
        Ok(Fetch {
            msg,
            mr,
            dest,
            addr: ptr as u64,
            lkey,
            posted: 0,
            owner,
            reserved: None,
        })
    }

    /// The destination, its registration released first.
    pub(crate) fn into_dest(self) -> Box<dyn FetchBuf> {
        drop(self.mr);
        self.dest
    }
}
