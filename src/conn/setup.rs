//! Connection setup over RDMA CM: the queue pair and its protection domain, the active side's
//! resolve/connect/handshake, and the passive side's accept. The message engine itself lives in
//! the connection; setup hands it the prepared queue pair, then the established CM id.

use std::net::SocketAddr;
use std::sync::Arc;

use super::cm_async::AsyncChannel;
use super::connection::{Connection, Starting};
use super::handshake::{self, Flags, Negotiated, Params};
use super::options::ConnectOptions;
use super::registry;
use crate::buf::{Pool, PoolConfig, SizeClass};
use crate::core::conn::CONTROL_RECVS;
use crate::driver::{AsyncQp, QpOptions};
use crate::error::{Error, Result};
use crate::verbs::{
    AccessFlags, CmEventKind, CmId, ConnParam, Context, EventChannel, PeerConnParam,
    ProtectionDomain, QpCaps, QpState,
};

/// RNR retries: data never meets a receiver that is not ready (credits); a control message
/// may, for the moment between its receive completing at the peer and being re-posted, so it
/// is retried as long as it takes (7: forever). A dead peer is still detected: it sends no
/// RNR NAKs, so the transport retries (`retry_count`) and the keepalive timeout apply.
const RNR_RETRY: u8 = 7;

/// Everything set up before the handshake completes.
#[derive(Debug)]
pub(crate) struct Prepared {
    pub(crate) qp: AsyncQp,
    /// The connection's own protection domain: its queue pair, its buffers and every grant
    /// made for it live here and nowhere else, so no other connection's queue pair can reach
    /// them whatever rkey it presents.
    pub(crate) pd: ProtectionDomain,
    /// Registered buffers for the connection's own traffic (receives and send staging).
    pub(crate) pool: Pool,
}

/// Creates the connection's protection domain, its queue pair (in INIT) and its pool on the
/// id's device.
pub(crate) fn prepare(id: &CmId, opts: &ConnectOptions) -> Result<Prepared> {
    let ctx = Context::from_cm_id(id)?;
    let driver = registry::driver_for(&ctx, &opts.driver_options())?;
    let pd = ProtectionDomain::new(&ctx)?;
    let p = &opts.params;
    if opts.retry_count > 6 {
        return Err(Error::InvalidArgument(format!(
            "retry_count {} is not in 0..=6 (7 means retry forever on some devices)",
            opts.retry_count
        )));
    }
    let caps = QpCaps {
        max_send_wr: opts.send_queue_depth.max(2),
        max_recv_wr: p.recv_credits + CONTROL_RECVS + 1,
        max_send_sge: 2,
        max_recv_sge: 1,
        max_inline_data: p.max_inline,
    };
    let qopts = QpOptions {
        caps,
        signal_every: 1,
        // The connection submits under its state machine's lock to keep the wire order:
        // every operation posts on its first poll.
        coalesce: false,
        ..QpOptions::default()
    };
    let qp = driver.create_qp(&pd, qopts)?;
    // Least privilege: the queue pair admits remote READ/WRITE (and atomics) only if this side
    // offers them; the memory itself still needs a grant (an rkey) per buffer.
    let mut access = AccessFlags::LOCAL_WRITE;
    if p.flags.contains(Flags::ONE_SIDED) {
        access |= AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE;
    }
    if p.flags.contains(Flags::ATOMICS) {
        access |= AccessFlags::REMOTE_ATOMIC;
    }
    id.modify_qp_with_access(qp.verbs(), QpState::Init, access)?;
    // The private buffers: receives (posted, plus as many again held by the application
    // before credits stop) and send staging (one per data credit the peer can give us, which
    // bounds the chunks in flight). Registered once, here, never on the data path. The peer's
    // receive size (our chunk size) is only known after the handshake; until then size the
    // staging class for the largest chunk the handshake allows us to accept as ours.
    let pool = Pool::with_pd(&pd, private_pool_config(p.recv_buf_size, p.recv_credits))?;
    Ok(Prepared { qp, pd, pool })
}

/// The private pool of a connection whose receives are `recv_buf_size` bytes and whose
/// receive credits are `credits`: receives posted and held, plus control slack.
fn private_pool_config(recv_buf_size: u32, credits: u32) -> PoolConfig {
    let count = 2 * credits as usize + CONTROL_RECVS as usize;
    PoolConfig::default().classes([SizeClass::new(recv_buf_size as usize, count)])
}

/// The staging pool for chunks of `chunk` bytes: one per data credit (`send_credits`, the
/// chunks that can be in flight) and one for the next chunk waiting for a credit.
pub(crate) fn staging_pool_config(chunk: u32, send_credits: u32) -> PoolConfig {
    PoolConfig::default().classes([SizeClass::new(chunk as usize, send_credits as usize + 1)])
}

/// The active side: resolve, create the queue pair, connect with our handshake, negotiate
/// with the peer's, then establish.
pub(crate) async fn connect(
    addr: SocketAddr,
    opts: ConnectOptions,
    span: tracing::Span,
) -> Result<Connection> {
    let channel = AsyncChannel::new(EventChannel::new()?)?;
    let id = Arc::new(channel.channel().create_id()?);
    if let Some(t) = opts.ack_timeout {
        id.set_ack_timeout(t)?;
    }
    let ms = u32::try_from(opts.connect_timeout.as_millis())
        .unwrap_or(u32::MAX)
        .max(1000);
    id.resolve_addr(None, addr, ms)?;
    channel
        .expect(CmEventKind::AddrResolved, opts.connect_timeout)
        .await?;
    id.resolve_route(ms)?;
    channel
        .expect(CmEventKind::RouteResolved, opts.connect_timeout)
        .await?;
    let prepared = prepare(&id, &opts)?;
    let local: Params = opts.params;
    let hs = local.encode()?;
    let mut param = ConnParam::new(prepared.qp.verbs()).private_data(&hs);
    param.retry_count = opts.retry_count;
    param.rnr_retry_count = RNR_RETRY;
    id.connect(&param)?;
    let ev = channel.next().await?;
    let ev = ev.expect(CmEventKind::ConnectResponse)?;
    let remote = match Params::decode(ev.private_data()) {
        Ok(r) => r,
        Err(e) => {
            let _ = id.disconnect();
            return Err(e.into());
        }
    };
    let negotiated = handshake::negotiate(&local, &remote)?;
    let qp = prepared.qp.verbs().clone();
    // Receives are posted before the peer learns our credits (before establish).
    let starting = Connection::start(prepared, negotiated, &opts)?;
    id.modify_qp(&qp, QpState::Rtr)?;
    id.modify_qp_rts_with_retries(&qp, opts.retry_count, RNR_RETRY)?;
    id.establish()?;
    Ok(Connection::established(starting, id, channel, span))
}

/// The passive side, after the request's handshake was decoded and negotiated and the id
/// migrated to its own channel: RTR, receives posted, accept with our handshake, wait for
/// `ESTABLISHED`, RTS.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn accept(
    prepared: Prepared,
    negotiated: Negotiated,
    id: CmId,
    events: AsyncChannel,
    request: PeerConnParam,
    accept_data: &[u8],
    opts: &ConnectOptions,
    span: tracing::Span,
) -> Result<Connection> {
    // `prepare` moved the queue pair to INIT; RTR with the parameters of the request.
    id.modify_qp(prepared.qp.verbs(), QpState::Rtr)?;
    let qp = prepared.qp.verbs().clone();
    let starting: Starting = Connection::start(prepared, negotiated, opts)?;
    let param = ConnParam::new(&qp)
        .answering(&request)
        .private_data(accept_data);
    id.accept(&param)?;
    events
        .expect(CmEventKind::Established, opts.connect_timeout)
        .await?;
    id.modify_qp(&qp, QpState::Rts)?;
    Ok(Connection::established(
        starting,
        Arc::new(id),
        events,
        span,
    ))
}
