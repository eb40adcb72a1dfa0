//! The soak's messages: a fixed header (magic, kind, session, sequence number, the sender's
//! last successful send, length, two auxiliary fields, checksum) and a payload of
//! pseudo-random bytes. The checksum covers the header fields and the payload, so any changed
//! byte, a short or long message and a message of another session are all found.

/// Header bytes: magic 4, kind 1, pad 3, session 8, seq 8, last_ok 8, len 4, aux 4, aux64 8,
/// checksum 8.
pub const HDR: usize = 56;
const MAGIC: u32 = 0x534f_414b; // "SOAK"
/// `last_ok` when no send of the session has returned `Ok` yet.
pub const NONE: u64 = u64::MAX;

/// What a message asks for (A to B) or answers (B to A).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// First message of a session (A to B); B answers with its grant's token in the payload.
    Hello = 1,
    /// Data (A to B); B answers with an `Ack` echoing the sequence number in `aux64`.
    Data = 2,
    /// "Does your granted region hold pattern `aux64` over its first `aux` bytes?" (A to B);
    /// B answers `Ack` with `aux` 1 (yes) or 0 (no).
    Check = 3,
    /// "Answer this one": after it, every earlier answer has arrived (A to B).
    Sync = 4,
    /// An answer (B to A); `aux64` is the sequence number answered.
    Ack = 5,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Hello,
            2 => Kind::Data,
            3 => Kind::Check,
            4 => Kind::Sync,
            5 => Kind::Ack,
            _ => return None,
        })
    }
}

/// A decoded header.
#[derive(Debug, Clone, Copy)]
pub struct Head {
    pub kind: Kind,
    pub session: u64,
    pub seq: u64,
    pub last_ok: u64,
    pub aux: u32,
    pub aux64: u64,
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

/// A 64-bit checksum over 8-byte words (FNV-like multiply, with a shift to spread high bits).
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

/// Builds a message of `len` bytes (at least [`HDR`]) with header `h`; the payload is
/// `payload` if given (its length must be `len - HDR`), else pseudo-random bytes.
pub fn encode(h: &Head, len: usize, payload: Option<&[u8]>) -> Vec<u8> {
    let len = len.max(HDR);
    let mut m = vec![0u8; len];
    match payload {
        Some(p) => m[HDR..HDR + p.len()].copy_from_slice(p),
        None => fill(
            h.session ^ h.seq.rotate_left(20) ^ h.kind as u64,
            &mut m[HDR..],
        ),
    }
    m[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    m[4] = h.kind as u8;
    m[8..16].copy_from_slice(&h.session.to_le_bytes());
    m[16..24].copy_from_slice(&h.seq.to_le_bytes());
    m[24..32].copy_from_slice(&h.last_ok.to_le_bytes());
    m[32..36].copy_from_slice(&(len as u32).to_le_bytes());
    m[36..40].copy_from_slice(&h.aux.to_le_bytes());
    m[40..48].copy_from_slice(&h.aux64.to_le_bytes());
    let sum = sum_of(&m);
    m[48..56].copy_from_slice(&sum.to_le_bytes());
    m
}

fn sum_of(m: &[u8]) -> u64 {
    checksum(&m[..48]) ^ checksum(&m[HDR..]).rotate_left(1)
}

fn u64_at(m: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(m[at..at + 8].try_into().expect("8 bytes"))
}

fn u32_at(m: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(m[at..at + 4].try_into().expect("4 bytes"))
}

/// The header of a message that failed [`decode`], unchecked (to answer it anyway), if its
/// magic and kind are right.
pub fn peek(m: &[u8]) -> Option<Head> {
    if m.len() < HDR || u32_at(m, 0) != MAGIC {
        return None;
    }
    Some(Head {
        kind: Kind::from_u8(m[4])?,
        session: u64_at(m, 8),
        seq: u64_at(m, 16),
        last_ok: u64_at(m, 24),
        aux: u32_at(m, 36),
        aux64: u64_at(m, 40),
    })
}

/// Decodes and checks a message: magic, length and checksum. An error means a corrupt message.
pub fn decode(m: &[u8]) -> Result<Head, String> {
    if m.len() < HDR {
        return Err(format!("{} bytes, shorter than a header", m.len()));
    }
    if u32_at(m, 0) != MAGIC {
        return Err(format!("bad magic {:08x}", u32_at(m, 0)));
    }
    let len = u32_at(m, 32) as usize;
    if len != m.len() {
        return Err(format!("{} bytes, header says {len}", m.len()));
    }
    let (want, got) = (u64_at(m, 48), sum_of(m));
    if want != got {
        return Err(format!("checksum {got:016x}, header says {want:016x}"));
    }
    let kind = Kind::from_u8(m[4]).ok_or_else(|| format!("bad kind {}", m[4]))?;
    Ok(Head {
        kind,
        session: u64_at(m, 8),
        seq: u64_at(m, 16),
        last_ok: u64_at(m, 24),
        aux: u32_at(m, 36),
        aux64: u64_at(m, 40),
    })
}

/// What the receiving end of one direction of a session has seen: checks order and loss from
/// the sequence numbers and the sender's `last_ok`.
#[derive(Debug, Default, Clone, Copy)]
pub struct Order {
    /// The last sequence number received, if any.
    pub last: Option<u64>,
    pub received: u64,
}

/// The verdict on one received message's sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Ok,
    /// Sequence number not above the last one received: a duplicate (or reordering).
    Duplicate,
    /// The sender's `last_ok` (a send that returned `Ok`) was never received: lost.
    Lost,
}

impl Order {
    /// Checks message `seq` sent after the sender's successful send `last_ok`; messages in
    /// between may be missing only if their sends were cancelled or failed.
    pub fn check(&mut self, seq: u64, last_ok: u64) -> Verdict {
        if let Some(l) = self.last {
            if seq <= l {
                return Verdict::Duplicate;
            }
        }
        self.received += 1;
        let prev = self.last;
        self.last = Some(seq);
        if last_ok != NONE && prev.is_none_or(|p| p < last_ok) {
            return Verdict::Lost;
        }
        Verdict::Ok
    }
}
