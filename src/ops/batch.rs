//! Batches: many sends and writes of one [`AsyncQp`] posted with one doorbell and awaited as
//! one ([`AsyncQp::batch`]).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use super::send::fill_send;
use super::sg::SgSource;
use super::write::fill_write;
use crate::buf::RemoteToken;
use crate::driver::{AsyncQp, RawBatch};
use crate::error::{Error, Result};

/// Up to [`MAX_BATCH`](crate::driver::MAX_BATCH) sends and writes of one queue pair, posted
/// together: one chained `ibv_post_send` (one doorbell) with only the last request signaled,
/// and one wait for all of them. Made by [`AsyncQp::batch`]; [`submit`](Self::submit) takes
/// it and gives it back with the outcomes, ready for the next round (its storage is allocated
/// once). Several batches may be in flight at once; each is one wait.
///
/// Adding a request builds and checks its work request (a write that does not fit its remote
/// token, too many scatter/gather entries); nothing is posted until
/// [`submit`](Self::submit)'s future is polled. The requests complete in order; each gets its
/// own outcome: a request that fails reports its cause, and the ones after it the queue
/// pair's failure.
///
/// # Examples
///
/// ```no_run
/// # use tokio_rdma::driver::AsyncQp;
/// # use tokio_rdma::buf::RemoteToken;
/// # use tokio_rdma::verbs::RegisteredBuffer;
/// # async fn demo(qp: &AsyncQp, bufs: Vec<RegisteredBuffer>, remote: RemoteToken)
/// #     -> tokio_rdma::Result<()> {
/// let mut batch = qp.batch();
/// for buf in bufs {
///     batch.write(buf, remote).map_err(|(e, _buf)| e)?;
/// }
/// let mut batch = batch.submit().await;
/// for (res, buf) in batch.outcomes() {
///     res?;
///     drop(buf); // or add it to the batch again for the next round
/// }
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Batch<B: SgSource> {
    /// Boxed once, when the batch is made: a batch moves into its submission and back out
    /// every round, and its engine (ids, lists, wait state) is a few hundred bytes.
    raw: Box<RawBatch<B>>,
}

impl AsyncQp {
    /// An empty [`Batch`] of sends and writes on this queue pair.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # use tokio_rdma::driver::AsyncQp;
    /// # use tokio_rdma::verbs::RegisteredBuffer;
    /// # async fn demo(qp: &AsyncQp, a: RegisteredBuffer, b: RegisteredBuffer) {
    /// let mut batch = qp.batch();
    /// batch.send(a).unwrap();
    /// batch.send(b).unwrap();
    /// let sent = batch.submit().await.outcomes().filter(|(res, _)| res.is_ok()).count();
    /// # }
    /// ```
    pub fn batch<B: SgSource>(&self) -> Batch<B> {
        Batch {
            raw: Box::new(RawBatch::new(self.op_config())),
        }
    }
}

impl<B: SgSource> Batch<B> {
    /// Adds a write of the initialised bytes of `buf` to `remote` (which must be at least as
    /// long).
    ///
    /// # Errors
    ///
    /// [`InvalidArgument`](crate::InvalidArgument) if the write does not fit `remote` or has
    /// too many scatter/gather entries, [`BatchFull`](crate::InvalidArgument::BatchFull) past
    /// [`MAX_BATCH`](crate::driver::MAX_BATCH) requests; the buffer comes back and nothing
    /// was added.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # use tokio_rdma::driver::AsyncQp;
    /// # use tokio_rdma::buf::RemoteToken;
    /// # use tokio_rdma::verbs::RegisteredBuffer;
    /// # fn demo(qp: &AsyncQp, buf: RegisteredBuffer, remote: RemoteToken) {
    /// let mut batch = qp.batch();
    /// if let Err((e, _buf)) = batch.write(buf, remote) {
    ///     eprintln!("not added: {e}");
    /// }
    /// # }
    /// ```
    pub fn write(&mut self, buf: B, remote: RemoteToken) -> Result<(), (Error, B)> {
        self.raw
            .push_with(buf, |cfg, b, wr| fill_write(cfg, b, remote, None, wr))
    }

    /// Adds a write of `buf` to `remote` that delivers `imm` in a receive completion at the
    /// peer (consuming one of its receives).
    ///
    /// # Errors
    ///
    /// As [`write`](Self::write).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # use tokio_rdma::driver::AsyncQp;
    /// # use tokio_rdma::buf::RemoteToken;
    /// # use tokio_rdma::verbs::RegisteredBuffer;
    /// # fn demo(qp: &AsyncQp, buf: RegisteredBuffer, remote: RemoteToken) {
    /// let mut batch = qp.batch();
    /// batch.write_with_imm(buf, remote, 7).map_err(|(e, _)| e).unwrap();
    /// # }
    /// ```
    pub fn write_with_imm(
        &mut self,
        buf: B,
        remote: RemoteToken,
        imm: u32,
    ) -> Result<(), (Error, B)> {
        self.raw
            .push_with(buf, |cfg, b, wr| fill_write(cfg, b, remote, Some(imm), wr))
    }

    /// Adds a send of the initialised bytes of `buf`; the peer must have a receive posted.
    ///
    /// # Errors
    ///
    /// [`TooManySges`](crate::InvalidArgument::TooManySges), or
    /// [`BatchFull`](crate::InvalidArgument::BatchFull) past
    /// [`MAX_BATCH`](crate::driver::MAX_BATCH) requests; the buffer comes back and nothing
    /// was added.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # use tokio_rdma::driver::AsyncQp;
    /// # use tokio_rdma::verbs::RegisteredBuffer;
    /// # fn demo(qp: &AsyncQp, buf: RegisteredBuffer) {
    /// let mut batch = qp.batch();
    /// batch.send(buf).map_err(|(e, _)| e).unwrap();
    /// assert_eq!(batch.len(), 1);
    /// # }
    /// ```
    pub fn send(&mut self, buf: B) -> Result<(), (Error, B)> {
        self.raw
            .push_with(buf, |cfg, b, wr| fill_send(cfg, b, None, wr))
    }

    /// Adds a send of `buf` with 32-bit immediate data.
    ///
    /// # Errors
    ///
    /// As [`send`](Self::send).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # use tokio_rdma::driver::AsyncQp;
    /// # use tokio_rdma::verbs::RegisteredBuffer;
    /// # fn demo(qp: &AsyncQp, buf: RegisteredBuffer) {
    /// let mut batch = qp.batch();
    /// batch.send_with_imm(buf, 42).map_err(|(e, _)| e).unwrap();
    /// # }
    /// ```
    pub fn send_with_imm(&mut self, buf: B, imm: u32) -> Result<(), (Error, B)> {
        self.raw
            .push_with(buf, |cfg, b, wr| fill_send(cfg, b, Some(imm), wr))
    }

    /// How many requests the batch holds.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # use tokio_rdma::driver::AsyncQp;
    /// # use tokio_rdma::verbs::RegisteredBuffer;
    /// # fn demo(qp: &AsyncQp) {
    /// let batch = qp.batch::<RegisteredBuffer>();
    /// assert_eq!(batch.len(), 0);
    /// # }
    /// ```
    pub fn len(&self) -> usize {
        self.raw.len()
    }

    /// Whether the batch holds no request.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # use tokio_rdma::driver::AsyncQp;
    /// # use tokio_rdma::verbs::RegisteredBuffer;
    /// # fn demo(qp: &AsyncQp) {
    /// assert!(qp.batch::<RegisteredBuffer>().is_empty());
    /// # }
    /// ```
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Posts the requests (at the future's first poll) and waits until every one has its
    /// outcome; resolves to the batch, whose [`outcomes`](Self::outcomes) then hand them out,
    /// oldest first, each with its buffers.
    ///
    /// The wait spins or sleeps as any operation's future does (the driver's
    /// [`CompletionMode`](crate::driver::CompletionMode)). If the queue pair failed before the
    /// post, every request reports that failure.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before its first poll posts nothing (the requests are dropped with
    /// the batch). After that the requests may still execute: those not complete are given
    /// up, and their buffers stay owned by the driver until the device is done with them, then
    /// are dropped. A forgotten future (`mem::forget`) leaks the batch and its buffers.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # use tokio_rdma::driver::AsyncQp;
    /// # use tokio_rdma::verbs::RegisteredBuffer;
    /// # async fn demo(qp: &AsyncQp, bufs: Vec<RegisteredBuffer>) -> tokio_rdma::Result<()> {
    /// let mut batch = qp.batch();
    /// for buf in bufs {
    ///     batch.send(buf).map_err(|(e, _)| e)?;
    /// }
    /// let mut batch = batch.submit().await;
    /// let mut back = Vec::new();
    /// for (res, buf) in batch.outcomes() {
    ///     res?;
    ///     back.push(buf);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn submit(self) -> Submit<B> {
        Submit { batch: Some(self) }
    }

    /// The outcomes of the last submission, oldest request first, each with its buffers; the
    /// batch is empty afterwards. Outcomes not taken are dropped when a request is added.
    /// Empty before a submission has resolved.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # use tokio_rdma::driver::AsyncQp;
    /// # use tokio_rdma::buf::RemoteToken;
    /// # use tokio_rdma::verbs::RegisteredBuffer;
    /// # async fn demo(qp: &AsyncQp, buf: RegisteredBuffer, remote: RemoteToken) {
    /// let mut batch = qp.batch();
    /// batch.write(buf, remote).map_err(|(e, _)| e).unwrap();
    /// let mut batch = batch.submit().await;
    /// let (res, buf) = batch.outcomes().next().expect("one request");
    /// # }
    /// ```
    pub fn outcomes(&mut self) -> Outcomes<'_, B> {
        let (bufs, failed) = self.raw.take_outcomes();
        Outcomes {
            bufs,
            failed: failed.peekable(),
            next: 0,
        }
    }
}

/// The future of [`Batch::submit`]: resolves to the batch, with every request's outcome.
///
/// # Cancel safety
///
/// See [`Batch::submit`].
///
/// # Examples
///
/// ```no_run
/// # use tokio_rdma::driver::AsyncQp;
/// # use tokio_rdma::verbs::RegisteredBuffer;
/// # async fn demo(qp: &AsyncQp, buf: RegisteredBuffer) {
/// let mut batch = qp.batch();
/// batch.send(buf).map_err(|(e, _)| e).unwrap();
/// let submission = batch.submit(); // nothing posted yet
/// let mut batch = submission.await; // posted, then every outcome in
/// assert_eq!(batch.outcomes().len(), 1);
/// # }
/// ```
#[derive(Debug)]
#[must_use = "a batch is posted when its submission is polled"]
pub struct Submit<B: SgSource> {
    batch: Option<Batch<B>>,
}

// Nothing in a batch is pinned: its buffers' memory is stable (the `IoBuf` contract) and the
// batch moves freely.
impl<B: SgSource> Unpin for Submit<B> {}

impl<B: SgSource> Submit<B> {
    /// Posts the batch now, without waiting for its completions (no CQ poll, no spin); await
    /// the future later for the outcomes. Does nothing after the first call or poll. Keeps
    /// several batches in flight from one task without a poll of each.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # use tokio_rdma::driver::AsyncQp;
    /// # use tokio_rdma::buf::RemoteToken;
    /// # use tokio_rdma::verbs::RegisteredBuffer;
    /// # async fn demo(
    /// #     qp: &AsyncQp, a: RegisteredBuffer, b: RegisteredBuffer, remote: RemoteToken,
    /// # ) {
    /// let (mut first, mut second) = (qp.batch(), qp.batch());
    /// first.write(a, remote).map_err(|(e, _)| e).unwrap();
    /// second.write(b, remote).map_err(|(e, _)| e).unwrap();
    /// let (mut first, mut second) = (first.submit(), second.submit());
    /// first.start();
    /// second.start();
    /// let (first, second) = (first.await, second.await);
    /// # }
    /// ```
    pub fn start(&mut self) {
        if let Some(batch) = self.batch.as_mut() {
            batch.raw.start();
        }
    }
}

impl<B: SgSource> Future for Submit<B> {
    type Output = Batch<B>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let batch = self.batch.as_mut().expect("a submission resolves once");
        if batch.raw.poll_submit(cx).is_pending() {
            return Poll::Pending;
        }
        Poll::Ready(self.batch.take().expect("checked above"))
    }
}

/// The outcomes of a batch ([`Batch::outcomes`]), oldest request first: each request's result
/// and its buffers. Dropping it drops the buffers not taken yet.
///
/// # Examples
///
/// ```no_run
/// # use tokio_rdma::driver::AsyncQp;
/// # use tokio_rdma::verbs::RegisteredBuffer;
/// # async fn demo(qp: &AsyncQp, a: RegisteredBuffer, b: RegisteredBuffer) {
/// let mut batch = qp.batch();
/// batch.send(a).map_err(|(e, _)| e).unwrap();
/// batch.send(b).map_err(|(e, _)| e).unwrap();
/// let mut batch = batch.submit().await;
/// let (ok, failed): (Vec<_>, Vec<_>) = batch.outcomes().partition(|(res, _)| res.is_ok());
/// # }
/// ```
#[derive(Debug)]
pub struct Outcomes<'a, B: SgSource> {
    bufs: std::vec::Drain<'a, B>,
    /// The failed requests, by index, in order.
    failed: std::iter::Peekable<std::vec::Drain<'a, (usize, Error)>>,
    /// The index of the next request.
    next: usize,
}

impl<B: SgSource> Iterator for Outcomes<'_, B> {
    type Item = (Result<()>, B);

    #[inline]
    fn next(&mut self) -> Option<Self::Item> {
        let buf = self.bufs.next()?;
        let i = self.next;
        self.next += 1;
        let res = match self.failed.next_if(|(at, _)| *at == i) {
            Some((_, e)) => Err(e),
            None => Ok(()),
        };
        Some((res, buf))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.bufs.size_hint()
    }
}

impl<B: SgSource> ExactSizeIterator for Outcomes<'_, B> {}
