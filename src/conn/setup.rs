//! Connection setup over RDMA CM: the queue pair and its protection domain, the active side's
//! resolve/connect/handshake, and the passive side's accept. The message engine itself lives in
//! the connection; setup hands it the prepared queue pair, then the established CM id.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use super::cm_async::AsyncChannel;
use super::connection::{Connection, Starting};
use super::handshake::{self, Flags, Params};
use super::options::ConnectOptions;
use crate::buf::{Pool, PoolConfig, SizeClass};
use crate::driver::{AsyncQp, QpOptions};
use crate::endpoint::{Endpoint, EndpointOptions};
use crate::error::{Error, Result};
use crate::proto::conn::CONTROL_RECVS;
use crate::verbs::{
    AccessFlags, CmEventKind, CmId, ConnParam, Context, EventChannel, PeerConnParam,
    ProtectionDomain, QpCaps, QpState,
};
use tracing::warn;

/// RNR retries: data never meets a receiver that is not ready (credits); a control message
/// may, for the moment between its receive completing at the peer and being re-posted, so it
/// is retried as long as it takes (7: forever). A dead peer is still detected: it sends no
/// RNR NAKs, so the transport retries (`retry_count`) and the keepalive timeout apply.
const RNR_RETRY: u8 = 7;

/// Send-queue entries for the connection's message sends (data chunks and control messages,
/// until retired by a signaled completion): room for two windows of the default 64 credits.
pub(crate) const SINK_SENDS: u32 = 2 * 64 + 2 * CONTROL_RECVS;

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

/// Where a connection's endpoint (completion queue, driver) comes from.
#[derive(Debug, Clone)]
pub(crate) enum EndpointChoice {
    /// The one the user opened: the id must be on its device, and a completion mode in the
    /// options must be the endpoint's.
    Given(Endpoint),
    /// A listener's: one endpoint per device requests arrive on, opened on first use with the
    /// completion mode of the options.
    PerDevice(Arc<Mutex<Vec<Endpoint>>>),
    /// A shorthand client's: an endpoint of its own, with the options' completion mode.
    Own,
}

impl EndpointChoice {
    /// The endpoint for a connection on `id`'s device.
    pub(crate) fn endpoint_for(&self, id: &CmId, opts: &ConnectOptions) -> Result<Endpoint> {
        let ctx = Context::from_cm_id(id)?;
        let mode = opts.completion_mode.unwrap_or_default();
        let implicit = |cq_size: Option<u32>| {
            let mut o = EndpointOptions::default().completion_mode(mode);
            o.cq_size = cq_size;
            Endpoint::on_context(ctx.clone(), o)
        };
        match self {
            EndpointChoice::Given(ep) => {
                if !ep.owns(&ctx) {
                    return Err(Error::InvalidArgument(format!(
                        "the address is reached through device {}, not through the endpoint's \
                         device {}",
                        ctx.name(),
                        ep.device_name()
                    )));
                }
                match opts.completion_mode {
                    Some(m) if m != ep.options().completion_mode => {
                        Err(Error::InvalidArgument(format!(
                            "ConnectOptions::completion_mode {m:?} differs from the endpoint's \
                             {:?}: the mode belongs to the endpoint (EndpointOptions)",
                            ep.options().completion_mode
                        )))
                    }
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
    opts.send_queue_depth.max(2) + SINK_SENDS
}

fn recv_depth(opts: &ConnectOptions) -> u32 {
    opts.params.recv_credits + CONTROL_RECVS + 1
}

/// Creates the connection's protection domain, its queue pair (in INIT) and its pool on the
/// id's device, on the endpoint `choice` names.
pub(crate) fn prepare(
    id: &CmId,
    opts: &ConnectOptions,
    choice: &EndpointChoice,
) -> Result<Prepared> {
    let endpoint = choice.endpoint_for(id, opts)?;
    let driver = endpoint.driver();
    let ctx = endpoint.context().clone();
    let pd = ProtectionDomain::new(&ctx)?;
    let p = &opts.params;
    if opts.retry_count > 6 {
        return Err(Error::InvalidArgument(format!(
            "retry_count {} is not in 0..=6 (7 means retry forever on some devices)",
            opts.retry_count
        )));
    }
    let caps = QpCaps {
        max_send_wr: send_depth(opts),
        max_recv_wr: recv_depth(opts),
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
        sink_sends: SINK_SENDS,
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
///
/// Dropped at any await point (the caller's timeout, or the caller's own future dropped), it
/// frees what it made: the CM id (destroyed: a request already sent is rejected towards the
/// server, whose pending setup then ends), the queue pair, the protection domain and the pool.
pub(crate) async fn connect(
    choice: EndpointChoice,
    addr: SocketAddr,
    opts: ConnectOptions,
    span: tracing::Span,
) -> Result<Connection> {
    // Refused before anything is created or sent (e.g. fewer than 2 receive credits).
    opts.params.validate()?;
    let local: Params = opts.params;
    let hs = local.encode()?;
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
    let prepared = prepare(&id, &opts, &choice)?;
    let mut param = ConnParam::new(prepared.qp.verbs()).private_data(&hs);
    param.retry_count = opts.retry_count;
    param.rnr_retry_count = RNR_RETRY;
    id.connect(&param)?;
    let ev = channel.next().await?;
    let ev = ev.expect(CmEventKind::ConnectResponse)?;
    // A bad or incompatible answer: returning drops the id, which rejects the server's reply
    // (its setup ends at once).
    let remote = Params::decode(ev.private_data())?;
    let negotiated = handshake::negotiate(&local, &remote)?;
    let qp = prepared.qp.verbs().clone();
    // Receives are posted before the peer learns our credits (before establish).
    let starting = Connection::start(prepared, negotiated, &opts)?;
    id.modify_qp(&qp, QpState::Rtr)?;
    id.modify_qp_rts_with_retries(&qp, opts.retry_count, RNR_RETRY)?;
    id.establish()?;
    Ok(Connection::established(starting, id, channel, span))
}

/// Rejects a connection request with `err`'s text as the reason (`"tokio-rdma: ..."`, at most
/// [`REJECT_REASON_MAX`] bytes), and returns `err`.
pub(crate) fn reject(id: &CmId, err: Error) -> Error {
    reject_with(id, &format!("tokio-rdma: {err}"));
    err
}

/// Rejects a connection request with `reason` in the reject's private data.
pub(crate) fn reject_with(id: &CmId, reason: &str) {
    let mut reason = reason.as_bytes().to_vec();
    reason.truncate(REJECT_REASON_MAX);
    if let Err(e) = id.reject(&reason) {
        warn!(error = %e, "rdma_reject failed");
    }
}

/// Most bytes of a reason sent in a reject's private data (the transport carries 148).
pub(crate) const REJECT_REASON_MAX: usize = 140;

/// The passive side, for one connection request whose id was migrated to its own event
/// channel `events`: decode and negotiate the client's handshake (`private_data`), prepare the
/// queue pair (INIT, RTR), post receives, accept with our handshake, wait for `ESTABLISHED`,
/// RTS.
///
/// Every failure before the accept is sent rejects the request with the reason; a failure
/// after it (the client rejected our reply, vanished, or the transport gave up) ends here. The
/// caller bounds the whole by the handshake timeout; dropped at any await point it frees
/// everything: the id is destroyed (which rejects or disconnects the client) and the queue
/// pair is flushed and destroyed with its protection domain and pool.
pub(crate) async fn accept(
    id: CmId,
    events: AsyncChannel,
    private_data: &[u8],
    request: Option<PeerConnParam>,
    opts: &ConnectOptions,
    choice: &EndpointChoice,
    span: tracing::Span,
) -> Result<Connection> {
    let local: Params = opts.params;
    let remote = Params::decode(private_data).map_err(|e| reject(&id, e.into()))?;
    let negotiated = handshake::negotiate(&local, &remote).map_err(|e| reject(&id, e.into()))?;
    let Some(request) = request else {
        return Err(reject(
            &id,
            Error::Handshake(handshake::HandshakeError::Missing),
        ));
    };
    let accept_data = local.encode().map_err(|e| reject(&id, e.into()))?;
    if let Some(t) = opts.ack_timeout {
        id.set_ack_timeout(t).map_err(|e| reject(&id, e))?;
    }
    let prepared = prepare(&id, opts, choice).map_err(|e| reject(&id, e))?;
    // `prepare` moved the queue pair to INIT; RTR with the parameters of the request.
    id.modify_qp(prepared.qp.verbs(), QpState::Rtr)
        .map_err(|e| reject(&id, e))?;
    let qp = prepared.qp.verbs().clone();
    let starting: Starting =
        Connection::start(prepared, negotiated, opts).map_err(|e| reject(&id, e))?;
    let param = ConnParam::new(&qp)
        .answering(&request)
        .private_data(&accept_data);
    id.accept(&param).map_err(|e| reject(&id, e))?;
    // From here on the client holds our reply: REJECTED (it refused our handshake or gave up),
    // UNREACHABLE (our reply was never answered) ... end the setup with the event's error;
    // dropping the id then tears the rest down.
    let ev = events.next().await?;
    if ev.kind() == CmEventKind::Disconnected {
        // The client established, sent, closed and disconnected before ESTABLISHED reached
        // us. Our queue pair (in RTR) received what it sent: hand the connection over with the
        // disconnect applied, so its messages (and its clean close) are still delivered.
        tracing::debug!("the client disconnected before ESTABLISHED arrived");
        let conn = Connection::established(starting, Arc::new(id), events, span);
        conn.peer_disconnected();
        return Ok(conn);
    }
    ev.expect(CmEventKind::Established)?;
    id.modify_qp_rts_with_retries(&qp, opts.retry_count, RNR_RETRY)?;
    Ok(Connection::established(
        starting,
        Arc::new(id),
        events,
        span,
    ))
}
