//! Host unit tests of the pool with a fake registrar (no device: only the pool's own logic).

use std::sync::atomic::Ordering::SeqCst;

use super::*;
use crate::buf::fake::FakeRegistrar;
use crate::buf::{IoBuf, IoBufMut};

fn pool(classes: &[(usize, usize)]) -> Pool {
    let cfg = PoolConfig::default()
        .classes(classes.iter().map(|&(s, n)| SizeClass::new(s, n)))
        .huge_pages(HugePages::Never);
    Pool::new(&FakeRegistrar::default(), cfg).unwrap()
}

#[test]
fn size_classes_pick_the_smallest_fit() {
    let p = pool(&[(65536, 2), (4096, 4), (100, 3)]);
    let classes = p.size_classes();
    assert_eq!(
        classes,
        vec![
            SizeClass::new(128, 3),
            SizeClass::new(4096, 4),
            SizeClass::new(65536, 2)
        ],
        "sorted, rounded up to 64 bytes"
    );
    let a = p.try_acquire(0).unwrap().unwrap();
    assert_eq!((a.len(), a.capacity()), (0, 128));
    let b = p.try_acquire(4096).unwrap().unwrap();
    assert_eq!((b.len(), b.capacity()), (4096, 4096));
    let c = p.try_acquire(4097).unwrap().unwrap();
    assert_eq!(c.capacity(), 65536);
    assert_ne!(b.lkey(), c.lkey(), "one registration per class");
    assert_eq!(IoBuf::lkey(&b), Some(b.lkey()));
    assert_eq!(b.as_ptr() as usize % 64, 0);
    let err = p.try_acquire(65537).unwrap_err();
    assert!(err.to_string().contains("largest size class"), "{err}");
    assert!(Pool::new(&FakeRegistrar::default(), PoolConfig::default().classes([])).is_err());
    let dup = PoolConfig::default().classes([SizeClass::new(64, 1), SizeClass::new(60, 1)]);
    assert!(Pool::new(&FakeRegistrar::default(), dup).is_err());
    let zero = PoolConfig::default().classes([SizeClass::new(64, 0)]);
    assert!(Pool::new(&FakeRegistrar::default(), zero).is_err());
}

#[test]
fn buffers_are_distinct_and_writable() {
    let p = pool(&[(256, 4)]);
    let mut bufs: Vec<PoolBuf> = (0..4)
        .map(|_| p.try_acquire(256).unwrap().unwrap())
        .collect();
    for (i, b) in bufs.iter_mut().enumerate() {
        b.fill(i as u8);
    }
    for (i, b) in bufs.iter().enumerate() {
        assert!(b.iter().all(|&x| x == i as u8), "buffers do not overlap");
    }
    let mut addrs: Vec<u64> = bufs.iter().map(|b| b.addr()).collect();
    addrs.sort();
    addrs.dedup();
    assert_eq!(addrs.len(), 4);
    assert!(p.try_acquire(1).unwrap().is_none(), "exhausted");
    let mut b = bufs.pop().unwrap();
    b.truncate(10);
    assert_eq!(b.bytes_init(), 10);
    assert_eq!(
        b.bytes_total(),
        10,
        "a transfer covers the length, not the whole class"
    );
    b.set_len(100);
    assert_eq!(b.bytes_total(), 100);
    // SAFETY: the whole capacity of a pool buffer is initialised.
    unsafe { b.set_init(50) };
    assert_eq!(b.len(), 100, "set_init never shrinks");
    assert_eq!(b.sge(0..100).length(), 100);
}

#[test]
fn metrics_track_use_and_registration() {
    let reg = FakeRegistrar::default();
    let cfg = PoolConfig::default()
        .classes([SizeClass::new(4096, 4), SizeClass::new(8192, 2)])
        .huge_pages(HugePages::Never);
    let p = Pool::new(&reg, cfg).unwrap();
    let m = p.metrics();
    assert_eq!(m.registrations, 2);
    assert_eq!(m.bytes_registered, 4 * 4096 + 2 * 8192);
    assert_eq!((m.bytes_in_use, m.bytes_free), (0, 32768));
    let a = p.try_acquire(10).unwrap().unwrap();
    let b = p.try_acquire(5000).unwrap().unwrap();
    let m = p.metrics();
    assert_eq!((m.bytes_in_use, m.buffers_in_use), (4096 + 8192, 2));
    assert_eq!(m.bytes_free, 32768 - 4096 - 8192);
    drop((a, b));
    assert_eq!(p.metrics().bytes_in_use, 0);
    // The registrations live until the pool and every buffer are gone.
    let c = p.try_acquire(1).unwrap().unwrap();
    drop(p);
    assert_eq!(reg.live.load(SeqCst), 2);
    drop(c);
    assert_eq!(
        reg.live.load(SeqCst),
        0,
        "deregistered after the last buffer"
    );
}

#[tokio::test]
async fn exhaustion_waits_and_release_wakes() {
    let p = pool(&[(4096, 1)]);
    let held = p.acquire(4096).await.unwrap();
    let mut waiting = crate::test_task::spawn(p.acquire(100));
    assert!(waiting.poll().is_pending(), "exhausted: waits, no error");
    assert_eq!(p.metrics().waiters, 1);
    assert!(!waiting.is_woken());
    drop(held);
    assert!(waiting.is_woken(), "release wakes the waiter");
    let buf = match waiting.poll() {
        std::task::Poll::Ready(r) => r.unwrap(),
        std::task::Poll::Pending => panic!("still pending after release"),
    };
    assert_eq!(buf.len(), 100);
    let m = p.metrics();
    assert_eq!((m.waiters, m.waits, m.buffers_in_use), (0, 1, 1));
}

#[tokio::test]
async fn waiters_are_served_in_order() {
    let p = pool(&[(64, 1)]);
    let held = p.try_acquire(1).unwrap().unwrap();
    let mut first = crate::test_task::spawn(p.acquire(1));
    let mut second = crate::test_task::spawn(p.acquire(2));
    assert!(first.poll().is_pending() && second.poll().is_pending());
    drop(held);
    assert!(first.is_woken() && !second.is_woken());
    // A newcomer cannot barge in: the slot was handed to `first`.
    assert!(p.try_acquire(1).unwrap().is_none());
    let std::task::Poll::Ready(Ok(b1)) = first.poll() else {
        panic!("first waiter not served")
    };
    drop(b1);
    assert!(second.is_woken());
    let std::task::Poll::Ready(Ok(b2)) = second.poll() else {
        panic!("second waiter not served")
    };
    assert_eq!(b2.len(), 2);
}

#[tokio::test]
async fn cancelled_acquires_lose_no_wakeup() {
    let p = pool(&[(64, 1)]);
    let held = p.try_acquire(1).unwrap().unwrap();
    // Cancelled while queued: nothing to give back.
    let mut gone = crate::test_task::spawn(p.acquire(1));
    assert!(gone.poll().is_pending());
    drop(gone);
    assert_eq!(p.metrics().waiters, 0);
    // Cancelled after the slot was handed to it: the slot moves on to the next waiter.
    let mut first = crate::test_task::spawn(p.acquire(1));
    let mut second = crate::test_task::spawn(p.acquire(1));
    assert!(first.poll().is_pending() && second.poll().is_pending());
    drop(held);
    assert!(first.is_woken());
    drop(first);
    assert!(second.is_woken(), "the dropped waiter's slot went on");
    let std::task::Poll::Ready(Ok(b)) = second.poll() else {
        panic!("second waiter not served")
    };
    drop(b);
    // With nobody waiting, a cancelled grant returns to the free list.
    let held = p.try_acquire(1).unwrap().unwrap();
    let mut w = crate::test_task::spawn(p.acquire(1));
    assert!(w.poll().is_pending());
    drop(held);
    drop(w);
    assert!(p.try_acquire(1).unwrap().is_some());
    assert_eq!(p.metrics().bytes_in_use, 0);
}

#[tokio::test]
async fn timeouts_around_acquire_do_not_leak() {
    let p = pool(&[(64, 1)]);
    let held = p.try_acquire(1).unwrap().unwrap();
    for _ in 0..100 {
        let r = tokio::time::timeout(std::time::Duration::from_micros(1), p.acquire(1)).await;
        assert!(r.is_err());
    }
    assert_eq!(p.metrics().waiters, 0);
    drop(held);
    assert!(p.try_acquire(1).unwrap().is_some());
}

#[tokio::test]
async fn too_large_fails_immediately() {
    let p = pool(&[(64, 1)]);
    assert!(p.acquire(65).await.is_err());
}

#[test]
fn bytes_conversion_returns_on_last_clone() {
    let p = pool(&[(4096, 1)]);
    let mut buf = p.try_acquire(5).unwrap().unwrap();
    buf.copy_from_slice(b"hello");
    let ptr = buf.as_ptr();
    let bytes = buf.freeze();
    assert_eq!(&bytes[..], b"hello");
    assert_eq!(bytes.as_ptr(), ptr, "no copy");
    let tail = bytes::Bytes::slice(&bytes, 1..);
    let clone = bytes.clone();
    drop(bytes);
    drop(clone);
    assert!(
        p.try_acquire(1).unwrap().is_none(),
        "a slice still holds it"
    );
    assert_eq!(&tail[..], b"ello");
    drop(tail);
    assert_eq!(p.metrics().bytes_in_use, 0);
    assert!(
        p.try_acquire(1).unwrap().is_some(),
        "back after the last drop"
    );
}

#[test]
fn stress_on_a_multi_thread_runtime() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    // Fewer buffers than tasks in one class, so tasks really wait on each other.
    let p = pool(&[(4096, 3), (65536, 2)]);
    rt.block_on(async {
        let tasks: Vec<_> = (0..8)
            .map(|t| {
                let p = p.clone();
                tokio::spawn(async move {
                    for i in 0..10_000usize {
                        let len = if (i + t) % 3 == 0 { 10_000 } else { 100 };
                        let mut b = p.acquire(len).await.unwrap();
                        b[0] = t as u8;
                        if i % 64 == 0 {
                            tokio::task::yield_now().await;
                        }
                        assert_eq!(b[0], t as u8, "nobody else holds this buffer");
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
    });
    let m = p.metrics();
    assert_eq!((m.bytes_in_use, m.buffers_in_use, m.waiters), (0, 0, 0));
    assert_eq!(m.bytes_free, 3 * 4096 + 2 * 65536);
    let all: Vec<PoolBuf> = std::iter::from_fn(|| p.try_acquire(1).unwrap()).collect();
    assert_eq!(all.len(), 3, "no slot lost or duplicated");
}

/// An explicit shard count is not capped like the default: `shards(usize::MAX)` made
/// `FreeList::new_full` collect `usize::MAX` shards (a capacity-overflow panic; a large but
/// representable count, an allocation the size of the count). Shards beyond the class's
/// buffers can never hold one.
#[test]
fn an_extreme_shard_count_is_clamped() {
    for shards in [usize::MAX, 1 << 40] {
        let cfg = PoolConfig::default()
            .classes([SizeClass::new(4096, 8)])
            .huge_pages(HugePages::Never)
            .shards(shards);
        let p = Pool::new(&FakeRegistrar::default(), cfg).unwrap();
        let bufs: Vec<_> = (0..8)
            .map(|_| p.try_acquire(10).unwrap().unwrap())
            .collect();
        assert!(p.try_acquire(10).unwrap().is_none());
        drop(bufs);
        assert_eq!(p.metrics().buffers_in_use, 0);
    }
}
