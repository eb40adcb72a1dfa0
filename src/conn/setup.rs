//! The parts of a message connection's setup: the endpoint it goes on, its raw queue-pair
//! options, its receive side (private buffers or a claim on the shared receive queue), the
//! negotiated parameters and the pools' sizes. The steps that use them (connect, accept) are
//! in [`establish`](super::establish); the connection is assembled in `connection.rs`.

use std::sync::{Arc, Mutex};

use std::time::Duration;

use super::device::Device;
use super::endpoint_options::EndpointOptions;
use super::handshake::{self, Flags, Negotiated, Params};
use super::options::ConnectOptions;
use super::raw::{self, RawOptions};
use super::srq::{SharedRecv, SrqShare};
use crate::buf::{Pool, PoolConfig, SizeClass};
use crate::driver::QpOptions;
use crate::error::{Error, InvalidArgument, Result};
use crate::proto::conn::CONTROL_RECVS;
use crate::verbs::{AccessFlags, CmId, Context, ProtectionDomain, QpCaps};

/// RNR retries: data never meets a receiver that is not ready (credits); a control message
/// may, for the moment between its receive completing at the peer and being re-posted, so it
/// is retried as long as it takes (7: forever). A dead peer is still detected: it sends no
/// RNR NAKs, so the transport retries (`retry_count`) and the keepalive timeout apply.
const RNR_RETRY: u8 = 7;

/// The deepest `ConnectOptions::send_queue_depth` accepted: far above any device's
/// `max_qp_wr`, and small enough that no sum of queue depths made from it overflows.
pub(crate) const MAX_SEND_QUEUE_DEPTH: u32 = 1 << 24;

/// Send-queue entries for the connection's message sends (data chunks and control messages,
/// until retired by a signaled completion): room for two windows of this side's
/// `recv_credits` (a client creates its queue pair before it learns the peer's credits; with
/// the same options on both sides they are the peer's too), at most two windows of 64.
/// Every entry is also reserved in the endpoint's completion queue (a failed queue pair
/// flushes every request), so this share bounds how many connections one endpoint carries.
pub(crate) fn sink_sends(opts: &ConnectOptions) -> u32 {
    2 * opts.params.recv_credits.min(64) + 2 * CONTROL_RECVS
}

/// Where a connection's endpoint (completion queue, driver) comes from.
#[derive(Debug, Clone)]
pub(crate) enum EndpointChoice {
    /// The one the user opened: the id must be on its device, and a completion mode in the
    /// options must be the endpoint's.
    Given(Device),
    /// A listener's: one endpoint per device requests arrive on, opened on first use with the
    /// completion mode of the options.
    PerDevice(Arc<Mutex<Vec<Device>>>),
    /// A shorthand client's: an endpoint of its own, with the options' completion mode.
    Own,
}

impl EndpointChoice {
    /// The endpoint the user gave, known before any id is resolved.
    pub(crate) fn given(&self) -> Option<&Device> {
        match self {
            EndpointChoice::Given(ep) => Some(ep),
            _ => None,
        }
    }

    /// The shared receive queue of a given endpoint, if it has one (the implicit endpoints
    /// never do).
    pub(crate) fn shared_recv(&self) -> Option<Arc<SharedRecv>> {
        match self {
            EndpointChoice::Given(ep) => ep.shared_recv().cloned(),
            _ => None,
        }
    }

    /// The endpoint for a connection on `id`'s device.
    pub(crate) fn endpoint_for(&self, id: &CmId, opts: &ConnectOptions) -> Result<Device> {
        let ctx = Context::from_cm_id(id)?;
        let mode = opts.completion_mode.unwrap_or_default();
        let implicit = |cq_size: Option<u32>| {
            let mut o = EndpointOptions::default().completion_mode(mode);
            o.cq_size = cq_size;
            Device::on_context(ctx.clone(), o)
        };
        match self {
            EndpointChoice::Given(ep) => {
                raw::check_device(ep, id)?;
                match opts.completion_mode {
                    Some(m) if m != ep.options().completion_mode => Err(Error::InvalidArgument(
                        m.mismatch(ep.options().completion_mode),
                    )),
                    _ => Ok(ep.clone()),
                }
            }
            EndpointChoice::PerDevice(list) => {
                let mut list = list.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(ep) = list.iter().find(|ep| ep.owns(&ctx)) {
                    return Ok(ep.clone());
                }
                // Many connections: the device's largest completion queue.
                let ep = implicit(None)?;
                list.push(ep.clone());
                Ok(ep)
            }
            // One connection: a completion queue its size.
            EndpointChoice::Own => implicit(Some(
                (queue_entries(opts).next_multiple_of(256)).min(ctx.device_attr().max_cqe),
            )),
        }
    }
}

/// Completion queue entries one connection with `opts` may use: its send and receive queues.
fn queue_entries(opts: &ConnectOptions) -> u32 {
    send_depth(opts) + recv_depth(opts)
}

fn send_depth(opts: &ConnectOptions) -> u32 {
    // One-sided operations (the driver's table), plus the connection's own message sends.
    opts.send_queue_depth.max(2) + sink_sends(opts)
}

fn recv_depth(opts: &ConnectOptions) -> u32 {
    opts.params.recv_credits + CONTROL_RECVS + 1
}

/// The raw connection options of a message connection with `opts`: its queue sizes, remote
/// access only for what this side offers, its retry counts, and `timeout` for each CM step.
pub(crate) fn raw_options(opts: &ConnectOptions, timeout: Duration) -> Result<RawOptions> {
    check_limits(opts)?;
    if opts.retry_count > 6 {
        return Err(Error::InvalidArgument(
            InvalidArgument::RetryCountOutOfRange {
                retry_count: opts.retry_count,
            },
        ));
    }
    let p = &opts.params;
    let qp = QpOptions {
        caps: QpCaps {
            max_send_wr: send_depth(opts),
            max_recv_wr: recv_depth(opts),
            max_send_sge: 2,
            max_recv_sge: 1,
            max_inline_data: p.max_inline,
        },
        signal_every: 1,
        // The connection submits under its state machine's lock to keep the wire order:
        // every operation posts on its first poll.
        coalesce: false,
        sink_sends: sink_sends(opts),
        ..QpOptions::default()
    };
    // Least privilege: the queue pair admits remote READ/WRITE (and atomics) only if this side
    // offers them; the memory itself still needs a grant (an rkey) per buffer.
    let mut access = AccessFlags::LOCAL_WRITE;
    if p.flags.contains(Flags::ONE_SIDED) {
        access |= AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE;
    }
    if p.flags.contains(Flags::ATOMICS) {
        access |= AccessFlags::REMOTE_ATOMIC;
    }
    // The peer reads rendezvous messages from memory opened per message (a registration of
    // just the message, for reading, until it acknowledged).
    if p.flags.contains(Flags::RENDEZVOUS) {
        access |= AccessFlags::REMOTE_READ;
    }
    Ok(RawOptions::default()
        .qp_options(qp)
        .access(access)
        .retry_count(opts.retry_count)
        .rnr_retry_count(RNR_RETRY)
        .ack_timeout(opts.ack_timeout)
        .timeout(timeout))
}

/// The options of a connection on the shared receive queue `srq`: it receives into the
/// queue's buffers (their size is its receive buffer size), starts its peer with its floor of
/// credits and grants the rest as the queue has them, and offers no remote access to memory
/// (the queue's protection domain is every connection's). Options asked for explicitly that
/// cannot apply are refused.
pub(crate) fn on_shared_recv(opts: &ConnectOptions, srq: &SharedRecv) -> Result<ConnectOptions> {
    let e = opts.explicit;
    let refused = [
        (e.one_sided, "one_sided(true)"),
        (e.atomics, "atomics(true)"),
        (e.rendezvous, "rendezvous_threshold(Some(..))"),
    ];
    if let Some(&(_, option)) = refused.iter().find(|(asked, _)| *asked) {
        return Err(Error::InvalidArgument(InvalidArgument::OfferWithSrq {
            option,
        }));
    }
    let size = srq.buffer_size();
    if e.recv_buf_size && opts.params.recv_buf_size != size {
        return Err(Error::InvalidArgument(
            InvalidArgument::RecvBufSizeMismatch {
                recv_buf_size: opts.params.recv_buf_size,
                srq_buffer_size: size,
            },
        ));
    }
    let mut o = opts.clone();
    let offers = Flags::ONE_SIDED.bits() | Flags::ATOMICS.bits() | Flags::RENDEZVOUS.bits();
    o.params.flags = Flags::from_bits(o.params.flags.bits() & !offers).expect("known bits");
    o.rendezvous_threshold = None;
    o.params.recv_buf_size = size;
    o.params.max_message_size = o.params.max_message_size.max(u64::from(size));
    let floor = SrqShare::floor_credits(o.params.recv_credits);
    o.params.initial_credits = (floor < o.params.recv_credits).then_some(floor);
    Ok(o)
}

/// The connection's receive side: on the shared receive queue `srq` (admitted with its
/// floor), or private buffers in `pd`.
pub(crate) fn receive_side(
    pd: &ProtectionDomain,
    p: &Params,
    srq: Option<&Arc<SharedRecv>>,
) -> Result<(Pool, Option<SrqShare>)> {
    match srq {
        Some(q) => {
            let share = q.admit(SrqShare::floor_for(p.recv_credits))?;
            Ok((q.pool().clone(), Some(share)))
        }
        None => Ok((private_pool(pd, p)?, None)),
    }
}

/// The connection's private buffers, in its protection domain `pd`: receives (posted, plus
/// as many again held by the application before credits stop) and control slack. Registered
/// once, here, never on the data path.
fn private_pool(pd: &ProtectionDomain, p: &Params) -> Result<Pool> {
    Pool::with_pd(pd, private_pool_config(p.recv_buf_size, p.recv_credits))
}

/// The private pool of a connection whose receives are `recv_buf_size` bytes and whose
/// receive credits are `credits`: receives posted and held, plus control slack.
fn private_pool_config(recv_buf_size: u32, credits: u32) -> PoolConfig {
    let count = 2 * credits as usize + CONTROL_RECVS as usize;
    PoolConfig::default().classes([SizeClass::new(recv_buf_size as usize, count)])
}

/// The connection's parameters from this side's options and the peer's announcement, under
/// this side's limits: the chunks it sends are at most `opts.max_send_chunk` bytes, however
/// large the peer says its receive buffers are (sending smaller chunks than the peer accepts
/// is always valid). The peer's credits stay as announced (see [`staging_buffers`]).
pub(crate) fn negotiate(
    opts: &ConnectOptions,
    remote: &Params,
) -> std::result::Result<Negotiated, handshake::HandshakeError> {
    let mut n = handshake::negotiate(&opts.params, remote)?;
    n.max_send_size = n.max_send_size.min(opts.max_send_chunk);
    n.max_inline = n.max_inline.min(n.max_send_size);
    Ok(n)
}

/// Staging buffers of a connection with `n` and `opts`: one per copied chunk that may be on
/// the device (the peer's credits, at most `max_staged_chunks`, at most the send queue's share
/// of message sends, beyond which no chunk can be posted) and one for the next chunk being
/// filled. Credits beyond it are not lost: a copied chunk waits for a staging buffer, which
/// comes back when the device completed an earlier send, not when the peer consumed it (a cap
/// on the credits themselves could stall: a receiver returns credits lazily, in batches of half
/// its window, when the sender seems to have plenty).
pub(crate) fn staging_buffers(n: &Negotiated, opts: &ConnectOptions) -> u32 {
    n.send_credits
        .min(opts.max_staged_chunks.max(1))
        .min(sink_sends(opts))
        + 1
}

/// The staging pool of a connection with `n` and `opts`: [`staging_buffers`] buffers of the
/// negotiated chunk size.
pub(crate) fn staging_pool_config(n: &Negotiated, opts: &ConnectOptions) -> PoolConfig {
    PoolConfig::default().classes([SizeClass::new(
        n.max_send_size as usize,
        staging_buffers(n, opts) as usize,
    )])
}

/// Registered bytes of a connection's own buffers that the endpoint's memory budget counts:
/// its private receive pool (none on a shared receive queue, whose buffers the endpoint
/// already has) and its send staging pool.
pub(crate) fn pool_bytes(n: &Negotiated, opts: &ConnectOptions, shared_recv: bool) -> u64 {
    let class = |size: u32, count: u32| u64::from(size) * u64::from(count);
    let recv = if shared_recv {
        0
    } else {
        class(
            opts.params.recv_buf_size,
            2 * opts.params.recv_credits + CONTROL_RECVS,
        )
    };
    recv + class(n.max_send_size, staging_buffers(n, opts))
}

/// Refuses local limits that cannot work.
fn check_limits(opts: &ConnectOptions) -> Result<()> {
    if opts.max_send_chunk < handshake::MIN_RECV_BUF_SIZE {
        return Err(Error::InvalidArgument(InvalidArgument::SendChunkTooSmall {
            max_send_chunk: opts.max_send_chunk,
            min: handshake::MIN_RECV_BUF_SIZE,
        }));
    }
    if opts.max_staged_chunks == 0 {
        return Err(Error::InvalidArgument(InvalidArgument::ZeroStagedChunks));
    }
    raw::check_ack_timeout(opts.ack_timeout)?;
    // A zero interval makes the next keepalive due as soon as the last one completed; a zero
    // timeout declares the peer dead after one keepalive interval of silence.
    let zero = [
        (opts.keepalive == Some(Duration::ZERO), "keepalive"),
        (opts.keepalive_timeout.is_zero(), "keepalive_timeout"),
    ];
    if let Some(&(_, option)) = zero.iter().find(|(z, _)| *z) {
        return Err(Error::InvalidArgument(InvalidArgument::ZeroKeepalive {
            option,
        }));
    }
    if opts.send_queue_depth > MAX_SEND_QUEUE_DEPTH {
        return Err(Error::InvalidArgument(
            InvalidArgument::SendQueueDepthTooLarge {
                send_queue_depth: opts.send_queue_depth,
                max: MAX_SEND_QUEUE_DEPTH,
            },
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conn::{DEFAULT_MAX_SEND_CHUNK, DEFAULT_MAX_STAGED_CHUNKS};

    fn hostile(credits: u32, buf: u32) -> Params {
        Params {
            recv_credits: credits,
            recv_buf_size: buf,
            max_message_size: u64::from(buf),
            ..Params::default()
        }
    }

    /// Registered bytes of the staging pool a connection with `opts` makes for `remote`.
    fn staging_bytes(opts: &ConnectOptions, remote: &Params) -> u64 {
        let n = negotiate(opts, remote).expect("negotiate");
        staging_pool_config(&n, opts)
            .size_classes()
            .iter()
            .map(|c| (c.size * c.count) as u64)
            .sum()
    }

    #[test]
    fn a_peer_cannot_size_the_staging_pool_beyond_local_limits() {
        let opts = ConnectOptions::default();
        // A default peer: 16 credits of 64 KiB, 17 staging buffers (1.06 MiB), as before.
        let default_peer = staging_bytes(&opts, &opts.params);
        assert_eq!(default_peer, 17 * (64 << 10));
        // The measurement (63 x 16 MiB) and the handshake's limit (65,535 x 16 MiB):
        // 33 buffers of 256 KiB (8.25 MiB), not 64 or 65,536 of 16 MiB.
        let bound = u64::from(DEFAULT_MAX_STAGED_CHUNKS + 1) * u64::from(DEFAULT_MAX_SEND_CHUNK);
        for (credits, buf) in [(63, 16 << 20), (handshake::MAX_CREDITS, 16 << 20)] {
            let got = staging_bytes(&opts, &hostile(credits, buf));
            assert_eq!(got, bound, "{credits} x {buf}");
            assert!(
                got <= 8 * default_peer,
                "{got} is a small multiple of {default_peer}"
            );
        }
        let n = negotiate(&opts, &hostile(63, 16 << 20)).expect("negotiate");
        assert_eq!(n.max_send_size, DEFAULT_MAX_SEND_CHUNK, "chunks are capped");
        assert_eq!(n.send_credits, 63, "credits stay the peer's");
        // Tighter local limits bound it further; fewer peer credits than the cap use fewer.
        let tight = ConnectOptions::default()
            .max_send_chunk(4096)
            .max_staged_chunks(4);
        assert_eq!(staging_bytes(&tight, &hostile(63, 16 << 20)), 5 * 4096);
        assert_eq!(staging_bytes(&tight, &hostile(2, 1024)), 3 * 1024);
        // The send queue's share caps it too: no more buffers than sends can be posted.
        let few = ConnectOptions::default().recv_credits(2);
        assert_eq!(sink_sends(&few), 10);
        assert_eq!(
            staging_bytes(&few, &hostile(63, 16 << 20)),
            11 * u64::from(DEFAULT_MAX_SEND_CHUNK)
        );
    }

    #[test]
    fn the_memory_budget_counts_both_pools() {
        let opts = ConnectOptions::default();
        let n = negotiate(&opts, &hostile(63, 16 << 20)).expect("negotiate");
        let recv = 35 * (64 << 10);
        let staging = 33 * u64::from(DEFAULT_MAX_SEND_CHUNK);
        assert_eq!(pool_bytes(&n, &opts, false), recv + staging);
        assert_eq!(
            pool_bytes(&n, &opts, true),
            staging,
            "the shared queue is the endpoint's"
        );
    }

    #[test]
    fn unusable_limits_are_refused() {
        let t = Duration::from_secs(1);
        let small = ConnectOptions::default().max_send_chunk(63);
        assert!(matches!(
            raw_options(&small, t),
            Err(Error::InvalidArgument(_))
        ));
        let none = ConnectOptions::default().max_staged_chunks(0);
        assert!(matches!(
            raw_options(&none, t),
            Err(Error::InvalidArgument(_))
        ));
        assert!(raw_options(&ConnectOptions::default(), t).is_ok());
    }

    /// `send_queue_depth` is added to the message sends' share: at u32::MAX the sum overflowed
    /// (a panic with overflow checks, a wrap to a tiny send queue without).
    #[test]
    fn an_extreme_send_queue_depth_is_refused_not_wrapped() {
        let t = Duration::from_secs(1);
        for depth in [u32::MAX, u32::MAX - 100, 1 << 30] {
            let opts = ConnectOptions {
                send_queue_depth: depth,
                ..ConnectOptions::default()
            };
            match raw_options(&opts, t) {
                Err(Error::InvalidArgument(InvalidArgument::SendQueueDepthTooLarge {
                    send_queue_depth,
                    ..
                })) => assert_eq!(send_queue_depth, depth),
                other => panic!("{depth}: {other:?}"),
            }
        }
        let deep = ConnectOptions {
            send_queue_depth: MAX_SEND_QUEUE_DEPTH,
            ..ConnectOptions::default()
        };
        let qp = raw_options(&deep, t).expect("the largest depth").qp;
        assert_eq!(
            qp.caps.max_send_wr,
            MAX_SEND_QUEUE_DEPTH + sink_sends(&deep)
        );
    }

    /// The local ACK timeout is a 5-bit code: RDMA CM passes a larger one on unchecked and the
    /// device truncates or shifts it (32 becomes 0, "wait forever", in a 5-bit field).
    #[test]
    fn an_ack_timeout_beyond_five_bits_is_refused() {
        let t = Duration::from_secs(1);
        for code in [32, 200, u8::MAX] {
            let opts = ConnectOptions::default().ack_timeout(Some(code));
            match raw_options(&opts, t) {
                Err(Error::InvalidArgument(InvalidArgument::AckTimeoutOutOfRange {
                    ack_timeout,
                })) => assert_eq!(ack_timeout, code),
                other => panic!("{code}: {other:?}"),
            }
        }
        for code in [None, Some(0), Some(31)] {
            let opts = ConnectOptions::default().ack_timeout(code);
            assert!(raw_options(&opts, t).is_ok(), "{code:?}");
        }
        // The raw connector's options too.
        let raw = RawOptions::default().ack_timeout(Some(32));
        assert!(matches!(
            raw.validate(),
            Err(Error::InvalidArgument(
                InvalidArgument::AckTimeoutOutOfRange { ack_timeout: 32 }
            ))
        ));
    }

    /// A keepalive interval of zero made the next keepalive due at once whenever one completed
    /// (`poll_timeout` at `now`: the connection's task wakes again immediately); a keepalive
    /// timeout of zero failed an idle healthy connection after one keepalive interval, before
    /// the peer's own keepalive could arrive.
    #[test]
    fn zero_keepalive_durations_are_refused() {
        let t = Duration::from_secs(1);
        for (opts, name) in [
            (
                ConnectOptions::default().keepalive(Some(Duration::ZERO)),
                "keepalive",
            ),
            (
                ConnectOptions::default().keepalive_timeout(Duration::ZERO),
                "keepalive_timeout",
            ),
        ] {
            match raw_options(&opts, t) {
                Err(Error::InvalidArgument(InvalidArgument::ZeroKeepalive { option })) => {
                    assert_eq!(option, name);
                }
                other => panic!("{name}: {other:?}"),
            }
        }
        let off = ConnectOptions::default().keepalive(None);
        assert!(raw_options(&off, t).is_ok());
    }
}
