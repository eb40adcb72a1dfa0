//! Fuzzes the decoders of a message's 32-bit immediate data, which the peer chooses freely:
//! the header (`MsgHeader::decode`) and, in an `Error` message, the protocol error code in its
//! low 16 bits (`ProtocolError::from_code`). Decoding never panics; the header format is
//! canonical (every accepted immediate re-encodes to itself, every header round-trips); every
//! code maps to an error whose code is the same number, and decoding is idempotent.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokio_rdma::ProtocolError;
use tokio_rdma::conn::wire::{MsgHeader, MsgKind};

fuzz_target!(|data: &[u8]| {
    let mut b = [0u8; 4];
    let n = data.len().min(4);
    b[..n].copy_from_slice(&data[..n]);
    let imm = u32::from_be_bytes(b);

    match MsgHeader::decode(imm) {
        Ok(h) => {
            assert_eq!(h.encode(), imm, "the header format is canonical");
            assert_eq!(MsgHeader::decode(h.encode()), Ok(h));
            assert_eq!(imm & 0x0f00_0000, 0, "reserved bits accepted");
            assert_eq!(
                h.kind.is_data(),
                matches!(h.kind, MsgKind::Last | MsgKind::More | MsgKind::Rendezvous)
            );
        }
        Err(e) => {
            assert_eq!(e, ProtocolError::BadHeader(imm));
            assert!(
                imm >> 28 > 7 || imm & 0x0f00_0000 != 0,
                "a valid header refused"
            );
        }
    }

    // The error code an `Error` message carries (the low 16 bits), and any 16 bits of input.
    for code in [imm as u16, (imm >> 16) as u16] {
        let e = ProtocolError::from_code(code);
        assert_eq!(e.code(), code, "code {code} round trip");
        assert_eq!(
            ProtocolError::from_code(e.code()),
            e,
            "decoding is idempotent"
        );
        assert!(!e.to_string().is_empty());
        // Sent in an `Error` header, it arrives unchanged.
        let h = MsgHeader {
            kind: MsgKind::Error,
            ctrl_ack: (imm >> 8) as u8,
            credits: e.code(),
        };
        assert_eq!(MsgHeader::decode(h.encode()).map(|h| h.credits), Ok(code));
    }
});
