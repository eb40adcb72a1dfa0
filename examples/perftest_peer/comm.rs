//! perftest's side channel when it runs with `-R` (RDMA CM): a second RC connection of its own
//! (`perftest_communication.c`: `create_comm_struct`, `rdma_client_connect` /
//! `rdma_server_connect`, `ctx_xchg_data_rdma`, `ctx_hand_shake`), carrying the version, system
//! data, MTU and `struct pingpong_dest` exchanges and the synchronisation points of the tests.
//!
//! The wire rules, as perftest 4.5 (version string 6.06) implements them:
//!
//! * the side channel is the FIRST connection to the server's port (default 18515), with no
//!   private data and no RDMA READ/atomic depth; the server's listening id is destroyed once it
//!   is accepted, and the test connection is a second request to the same port;
//! * each side keeps one receive of `sizeof(struct pingpong_dest)` = 56 bytes posted, reposting
//!   it as soon as a message arrived (before answering);
//! * every exchange is symmetric: the client SENDs its N bytes first and then waits for the
//!   server's N bytes; the server waits first and then SENDs. N is 16 (version strings), 4, 4
//!   (page size and cache line size, big-endian), 2 (the MTU as a decimal digit and a NUL) or
//!   56 (a `pingpong_dest`, every field big-endian).

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::time::Duration;

use tokio_rdma::Endpoint;
use tokio_rdma::buf::IoBuf;
use tokio_rdma::conn::{RawConnection, RawListener, RawOptions};
use tokio_rdma::ops::Recv;
use tokio_rdma::verbs::{AccessFlags, RegisteredBuffer};

use crate::Res;

/// `sizeof(struct pingpong_dest)` on the 64-bit Linux perftest runs on.
pub(crate) const DEST_LEN: usize = 56;
/// Our side-channel receive buffer: room beyond [`DEST_LEN`], so an oversized message is seen
/// and named instead of failing the receive.
const RECV_ROOM: usize = 64;
/// The version we announce: the perftest release whose protocol this implements. perftest
/// refuses peers older than 5.70 and exchanges system data from 5.32 and a 2-byte MTU from
/// 5.31 on.
pub(crate) const VERSION: &str = "6.06";
/// perftest's `MAX_VERSION`: the version string's field.
const VERSION_LEN: usize = 16;
/// Our cycle buffer (the page size perftest sends) and cache line size.
pub(crate) const CYCLE_BUFFER: u32 = 4096;
pub(crate) const CACHE_LINE: u32 = 64;
/// The bytes of `struct pingpong_dest` that are padding (between `rkey` and `vaddr`): perftest
/// sends them uninitialised, so they are never compared.
pub(crate) const DEST_PADDING: std::ops::Range<usize> = 20..24;

/// `struct pingpong_dest`: what each side tells the other about its queue pair and memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Dest {
    pub(crate) lid: u32,
    pub(crate) out_reads: u32,
    pub(crate) qpn: u32,
    pub(crate) psn: u32,
    pub(crate) rkey: u32,
    pub(crate) vaddr: u64,
    pub(crate) gid: [u8; 16],
    pub(crate) srqn: u32,
    pub(crate) gid_index: u32,
}

impl Dest {
    /// The wire form: each integer big-endian at its C offset (`HAVE_ENDIAN` builds, as
    /// Debian's), the padding zero.
    pub(crate) fn encode(&self) -> [u8; DEST_LEN] {
        let mut b = [0u8; DEST_LEN];
        b[0..4].copy_from_slice(&self.lid.to_be_bytes());
        b[4..8].copy_from_slice(&self.out_reads.to_be_bytes());
        b[8..12].copy_from_slice(&self.qpn.to_be_bytes());
        b[12..16].copy_from_slice(&self.psn.to_be_bytes());
        b[16..20].copy_from_slice(&self.rkey.to_be_bytes());
        b[24..32].copy_from_slice(&self.vaddr.to_be_bytes());
        b[32..48].copy_from_slice(&self.gid);
        b[48..52].copy_from_slice(&self.srqn.to_be_bytes());
        b[52..56].copy_from_slice(&self.gid_index.to_be_bytes());
        b
    }

    /// Decodes the wire form (the padding is ignored).
    pub(crate) fn decode(b: &[u8]) -> Dest {
        let u32_at = |o: usize| u32::from_be_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        Dest {
            lid: u32_at(0),
            out_reads: u32_at(4),
            qpn: u32_at(8),
            psn: u32_at(12),
            rkey: u32_at(16),
            vaddr: u64::from_be_bytes(b[24..32].try_into().expect("8 bytes")),
            gid: b[32..48].try_into().expect("16 bytes"),
            srqn: u32_at(48),
            gid_index: u32_at(52),
        }
    }
}

/// What the peer announced before the test connection.
#[derive(Debug, Clone)]
pub(crate) struct PeerInfo {
    pub(crate) version: String,
    pub(crate) cycle_buffer: u32,
    pub(crate) cache_line: u32,
    pub(crate) mtu: u32,
}

type PinnedRecv = Pin<Box<Recv<RegisteredBuffer>>>;

/// The side channel: a raw connection with one receive always posted.
pub(crate) struct Comm {
    conn: RawConnection,
    client: bool,
    tx: Option<RegisteredBuffer>,
    recv: Option<PinnedRecv>,
    step: Duration,
    /// Messages exchanged so far (for error messages).
    pub(crate) count: u32,
}

/// The side channel's options: one message in flight each way, no READ/atomic depth (perftest
/// connects its side channel with `verb = SEND`).
fn options(step: Duration) -> RawOptions {
    RawOptions::default()
        .send_queue(2)
        .recv_queue(2)
        .sges(1, 1)
        .access(AccessFlags::LOCAL_WRITE)
        .rd_atomic(0, 0)
        .timeout(step)
}

impl Comm {
    /// Connects the side channel to a perftest server at `addr` (perftest's client posts its
    /// receive before connecting; so do we).
    pub(crate) async fn connect(ep: &Endpoint, addr: SocketAddr, step: Duration) -> Res<Comm> {
        let c = ep.raw_connector(addr, options(step)).await?;
        let recv = post(
            c.qp(),
            RegisteredBuffer::new(c.pd(), RECV_ROOM, AccessFlags::LOCAL_WRITE)?,
        );
        let tx = RegisteredBuffer::new(c.pd(), DEST_LEN, AccessFlags::LOCAL_WRITE)?;
        let conn = within(step, "the side channel's accept", c.connect(&[]))
            .await??
            .establish()?;
        Ok(Comm {
            conn,
            client: true,
            tx: Some(tx),
            recv: Some(recv),
            step,
            count: 0,
        })
    }

    /// Accepts the side channel: the first request on `listener`.
    pub(crate) async fn accept(listener: &RawListener, step: Duration) -> Res<Comm> {
        let req = within(step, "perftest's side-channel connection", listener.next()).await??;
        let a = req.prepare(options(step))?;
        let recv = post(
            a.qp(),
            RegisteredBuffer::new(a.pd(), RECV_ROOM, AccessFlags::LOCAL_WRITE)?,
        );
        let tx = RegisteredBuffer::new(a.pd(), DEST_LEN, AccessFlags::LOCAL_WRITE)?;
        let conn = a.accept(&[]).await?;
        Ok(Comm {
            conn,
            client: false,
            tx: Some(tx),
            recv: Some(recv),
            step,
            count: 0,
        })
    }

    async fn send(&mut self, data: &[u8], what: &str) -> Res<()> {
        let mut tx = self.tx.take().expect("send buffer");
        tx.write_at(0, data);
        let (res, tx) = within(
            self.step,
            what,
            self.conn.qp().send(tx.slice(0..data.len())),
        )
        .await?;
        self.tx = Some(tx.into_inner());
        res.map_err(|e| format!("side channel: sending {what}: {e}"))?;
        Ok(())
    }

    /// Waits for the peer's message of exactly `len` bytes and reposts the receive before
    /// returning it.
    async fn recv(&mut self, len: usize, what: &str) -> Res<Vec<u8>> {
        let mut recv = self.recv.take().expect("a posted receive");
        let (res, buf) = tokio::select! {
            out = &mut recv => out,
            gone = self.conn.disconnected() => {
                gone?;
                return Err(format!("side channel: perftest disconnected while we waited for {what}").into());
            }
            () = tokio::time::sleep(self.step) => {
                return Err(format!("side channel: no {what} within {:?}", self.step).into());
            }
        };
        let info = res.map_err(|e| format!("side channel: receiving {what}: {e}"))?;
        if info.len != len || info.imm.is_some() {
            return Err(format!(
                "side channel: {what} is {} bytes{}; perftest sends {len}",
                info.len,
                if info.imm.is_some() {
                    " with immediate data"
                } else {
                    ""
                }
            )
            .into());
        }
        let mut out = vec![0u8; len];
        buf.read_at(0, &mut out);
        self.recv = Some(post(self.conn.qp(), buf));
        Ok(out)
    }

    /// One exchange of `mine` for the peer's message of the same size: the client sends first.
    pub(crate) async fn exchange(&mut self, mine: &[u8], what: &str) -> Res<Vec<u8>> {
        self.count += 1;
        let theirs = if self.client {
            self.send(mine, what).await?;
            self.recv(mine.len(), what).await?
        } else {
            let t = self.recv(mine.len(), what).await?;
            self.send(mine, what).await?;
            t
        };
        Ok(theirs)
    }

    /// `ctx_hand_shake`: our `pingpong_dest` for the peer's.
    pub(crate) async fn hand_shake(
        &mut self,
        mine: &Dest,
        what: &str,
    ) -> Res<([u8; DEST_LEN], Dest)> {
        let raw = self.exchange(&mine.encode(), what).await?;
        let raw: [u8; DEST_LEN] = raw.try_into().expect("checked length");
        Ok((raw, Dest::decode(&raw)))
    }

    /// The exchanges before the test connection (`exchange_versions`, `check_sys_data`,
    /// `check_mtu`), with our port's active MTU (`enum ibv_mtu`, 1..=5).
    pub(crate) async fn preamble(&mut self, mtu: u32) -> Res<PeerInfo> {
        let mut v = [0u8; VERSION_LEN];
        v[..VERSION.len()].copy_from_slice(VERSION.as_bytes());
        let theirs = self.exchange(&v, "the version string").await?;
        let version = c_string(&theirs);
        let number = leading_float(&version);
        if number.is_nan() || number < 5.70 {
            return Err(format!(
                "perftest announced version {version:?}; its protocol needs 5.70 or later"
            )
            .into());
        }
        let cycle = be_u32(
            &self
                .exchange(&CYCLE_BUFFER.to_be_bytes(), "the page size")
                .await?,
        );
        let line = be_u32(
            &self
                .exchange(&CACHE_LINE.to_be_bytes(), "the cache line size")
                .await?,
        );
        if !cycle.is_power_of_two() || !line.is_power_of_two() {
            return Err(format!(
                "perftest's page size {cycle} / cache line {line}: not powers of two"
            )
            .into());
        }
        let digit = u8::try_from(mtu)
            .ok()
            .filter(|m| (1..=5).contains(m))
            .ok_or("our MTU is not 1..=5")?;
        let theirs = self.exchange(&[b'0' + digit, 0], "the MTU").await?;
        let peer_mtu = match theirs[..] {
            [d @ b'1'..=b'5', 0] => u32::from(d - b'0'),
            _ => {
                return Err(format!(
                    "perftest's MTU field {theirs:?} is not a digit 1..5 and a NUL"
                )
                .into());
            }
        };
        Ok(PeerInfo {
            version,
            cycle_buffer: cycle,
            cache_line: line,
            mtu: peer_mtu,
        })
    }

    /// Closes the side channel (perftest never disconnects it: its process exit does).
    pub(crate) async fn close(self) -> Res<()> {
        drop(self.recv);
        self.conn.disconnect().await?;
        Ok(())
    }
}

/// Starts a receive into `buf` now.
fn post(qp: &tokio_rdma::driver::AsyncQp, buf: RegisteredBuffer) -> PinnedRecv {
    let mut r = Box::pin(qp.recv(buf));
    r.as_mut().start();
    r
}

async fn within<F: Future>(step: Duration, what: &str, f: F) -> Res<F::Output> {
    tokio::time::timeout(step, f)
        .await
        .map_err(|_| format!("{what}: nothing within {step:?}").into())
}

fn be_u32(b: &[u8]) -> u32 {
    u32::from_be_bytes(b.try_into().expect("4 bytes"))
}

/// The bytes before the first NUL, as text.
fn c_string(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

/// `atof`: the number at the start of `s` (NaN if there is none).
fn leading_float(s: &str) -> f64 {
    let end = s
        .char_indices()
        .find(|&(i, c)| !(c.is_ascii_digit() || (c == '.' && !s[..i].contains('.'))))
        .map_or(s.len(), |(i, _)| i);
    s[..end].parse().unwrap_or(f64::NAN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dest_round_trips_big_endian() {
        let d = Dest {
            lid: 1,
            out_reads: 2,
            qpn: 0x11,
            psn: 0xabcdef,
            rkey: 0x1234,
            vaddr: 0x7f00_0000_1000,
            gid: [7; 16],
            srqn: 0,
            gid_index: 1,
        };
        let b = d.encode();
        assert_eq!(&b[8..12], &[0, 0, 0, 0x11]);
        assert_eq!(&b[24..32], &[0, 0, 0x7f, 0, 0, 0, 0x10, 0]);
        assert_eq!(Dest::decode(&b), d);
    }

    #[test]
    fn versions_parse_like_atof() {
        assert_eq!(leading_float("6.06"), 6.06);
        assert_eq!(leading_float("5.70-beta"), 5.70);
        assert!(leading_float("x").is_nan());
    }
}
