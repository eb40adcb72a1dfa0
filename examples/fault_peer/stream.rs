//! The traffic of a fault scenario: numbered, checksummed messages of mixed sizes, checked on
//! arrival, and one-sided writes/reads of a granted region, checked by reading back.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio_rdma::buf::RemoteToken;
use tokio_rdma::conn::Connection;

/// Message sizes, in turn by sequence number: 1 B to 1 MiB, small ones between large ones.
pub const SIZES: [usize; 8] = [1, 4096, 24, 1 << 20, 65536, 1000, 300_000, 65537];
/// Header of a message of at least this size: sequence number (8), length (4), checksum (8).
const HDR: usize = 20;
/// The size of one-sided transfers (the granted region).
pub const REGION: usize = 64 << 10;

pub fn size_of(seq: u64) -> usize {
    SIZES[(seq % SIZES.len() as u64) as usize]
}

/// Pseudo-random bytes determined by `seed` (xorshift64*).
pub fn fill(seed: u64, out: &mut [u8]) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for chunk in out.chunks_mut(8) {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let v = x.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

/// FNV-1a style checksum over 8-byte words.
pub fn checksum(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for chunk in data.chunks(8) {
        let mut w = [0u8; 8];
        w[..chunk.len()].copy_from_slice(chunk);
        h = (h ^ u64::from_le_bytes(w)).wrapping_mul(0x0000_0100_0000_01b3);
        h ^= h >> 29;
    }
    h ^ data.len() as u64
}

/// Message `seq` of stream `stream`: a header (seq, length, checksum of the payload) and a
/// payload determined by both; messages shorter than a header are the first bytes of the
/// payload pattern alone.
pub fn message(stream: u64, seq: u64) -> Vec<u8> {
    let len = size_of(seq);
    let mut m = vec![0u8; len];
    let seed = stream << 32 | seq;
    if len < HDR {
        fill(seed, &mut m);
        return m;
    }
    fill(seed, &mut m[HDR..]);
    let sum = checksum(&m[HDR..]);
    m[..8].copy_from_slice(&seq.to_le_bytes());
    m[8..12].copy_from_slice(&(len as u32).to_le_bytes());
    m[12..20].copy_from_slice(&sum.to_le_bytes());
    m
}

/// Checks that `m` is message `expected` of `stream`: its sequence number, length and checksum
/// (and, for short ones, every byte).
pub fn verify(stream: u64, expected: u64, m: &[u8]) -> Result<(), String> {
    let len = size_of(expected);
    if len < HDR {
        if m != message(stream, expected) {
            return Err(format!(
                "message #{expected}: {} bytes {:02x?}, expected {len} bytes {:02x?}",
                m.len(),
                &m[..m.len().min(HDR)],
                message(stream, expected)
            ));
        }
        return Ok(());
    }
    if m.len() < HDR {
        return Err(format!(
            "message #{expected}: {} bytes, expected {len} (a short message out of turn)",
            m.len()
        ));
    }
    let seq = u64::from_le_bytes(m[..8].try_into().unwrap());
    let hlen = u32::from_le_bytes(m[8..12].try_into().unwrap()) as usize;
    let sum = u64::from_le_bytes(m[12..20].try_into().unwrap());
    if seq != expected {
        return Err(format!(
            "sequence: got message #{seq}, expected #{expected} (lost, duplicated or reordered)"
        ));
    }
    if hlen != len || m.len() != len {
        return Err(format!(
            "message #{seq}: {} bytes (header says {hlen}), expected {len}",
            m.len()
        ));
    }
    let got = checksum(&m[HDR..]);
    if got != sum {
        return Err(format!(
            "message #{seq}: checksum {got:016x}, header says {sum:016x} (corrupted)"
        ));
    }
    Ok(())
}

/// What one side's stream did.
#[derive(Debug, Default)]
pub struct Counts {
    pub sent: AtomicU64,
    pub received: AtomicU64,
    pub verified: AtomicU64,
    pub bytes_sent: AtomicU64,
    pub os_writes: AtomicU64,
    pub os_reads: AtomicU64,
    pub os_verified: AtomicU64,
}

impl Counts {
    pub fn get(&self, c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// Deliberately broken verification, to show the suite fails: `FAULTS_BREAK_SEQ=1` makes the
/// receiver throw away message #3 (as a library that lost it would), `FAULTS_BREAK=corrupt`
/// flips a byte of message #3 before the check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Break {
    None,
    DropOne,
    CorruptOne,
}

impl Break {
    pub fn from_env() -> Break {
        if std::env::var("FAULTS_BREAK_SEQ").is_ok_and(|v| v == "1") {
            return Break::DropOne;
        }
        match std::env::var("FAULTS_BREAK").as_deref() {
            Ok("drop") => Break::DropOne,
            Ok("corrupt") => Break::CorruptOne,
            _ => Break::None,
        }
    }
}

/// Runs `f` with a limit that fails the scenario (an operation that hangs).
pub async fn within<T>(
    limit: Duration,
    what: &str,
    f: impl std::future::Future<Output = T>,
) -> Result<T, String> {
    tokio::time::timeout(limit, f)
        .await
        .map_err(|_| format!("{what}: HUNG (not done within {limit:?})"))
}

/// Sends messages `from..to` of `stream`, each send within `limit`.
pub async fn send_range(
    conn: &Connection,
    stream: u64,
    from: u64,
    to: u64,
    counts: &Counts,
    limit: Duration,
) -> Result<(), String> {
    for seq in from..to {
        let m = message(stream, seq);
        within(limit, &format!("send #{seq}"), conn.send(&m))
            .await?
            .map_err(|e| format!("send #{seq}: {e}"))?;
        bump(&counts.sent, 1);
        bump(&counts.bytes_sent, m.len() as u64);
    }
    Ok(())
}

/// Receives messages `from..to` of `stream` and checks each.
pub async fn recv_range(
    conn: &Connection,
    stream: u64,
    from: u64,
    to: u64,
    counts: &Counts,
    limit: Duration,
    brk: Break,
) -> Result<(), String> {
    let mut expected = from;
    while expected < to {
        let msg = within(limit, &format!("recv #{expected}"), conn.recv())
            .await?
            .map_err(|e| format!("recv #{expected}: {e}"))?
            .ok_or_else(|| format!("recv #{expected}: the peer closed"))?;
        bump(&counts.received, 1);
        let mut bytes = msg.to_vec();
        drop(msg);
        if expected == 3 && counts.get(&counts.received) == 4 {
            match brk {
                Break::DropOne => continue, // the broken build "loses" it
                Break::CorruptOne => {
                    let mid = bytes.len() / 2;
                    bytes[mid] ^= 0x40
                }
                Break::None => {}
            }
        }
        verify(stream, expected, &bytes).map_err(|e| format!("VERIFY: {e}"))?;
        bump(&counts.verified, 1);
        expected += 1;
    }
    Ok(())
}

/// `n` rounds of: write a fresh pattern of `len` bytes into the peer's granted region, read it
/// back, compare.
pub async fn one_sided(
    conn: &Connection,
    token: RemoteToken,
    stream: u64,
    (n, len): (u64, usize),
    counts: &Counts,
    limit: Duration,
) -> Result<(), String> {
    let pool = conn.pool().map_err(|e| format!("pool: {e}"))?;
    let target = token
        .slice(0..len as u64)
        .map_err(|e| format!("token: {e}"))?;
    for k in 0..n {
        let mut buf = within(limit, "acquire", pool.acquire(len))
            .await?
            .map_err(|e| format!("acquire: {e}"))?;
        fill(one_sided_seed(stream, k), &mut buf);
        let (res, buf) = within(limit, &format!("write #{k}"), conn.write(buf, target)).await?;
        res.map_err(|e| format!("one-sided write #{k}: {e}"))?;
        bump(&counts.os_writes, 1);
        let mut back = buf;
        back.fill(0);
        let (res, back) = within(limit, &format!("read #{k}"), conn.read(back, target)).await?;
        res.map_err(|e| format!("one-sided read #{k}: {e}"))?;
        bump(&counts.os_reads, 1);
        let mut want = vec![0u8; len];
        fill(one_sided_seed(stream, k), &mut want);
        if back[..] != want[..] {
            return Err(format!(
                "VERIFY: one-sided #{k}: read back differs from what was written"
            ));
        }
        bump(&counts.os_verified, 1);
    }
    Ok(())
}

pub fn one_sided_seed(stream: u64, k: u64) -> u64 {
    (stream + 100) << 32 | k
}

/// `RemoteToken` as hex, for the control channel.
pub fn token_hex(t: &RemoteToken) -> String {
    t.to_bytes().iter().map(|b| format!("{b:02x}")).collect()
}

pub fn token_from_hex(s: &str) -> Result<RemoteToken, String> {
    let bytes: Result<Vec<u8>, _> = (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16))
        .collect();
    let bytes = bytes.map_err(|e| format!("token hex {s:?}: {e}"))?;
    RemoteToken::from_bytes(&bytes).map_err(|e| format!("token {s:?}: {e}"))
}
