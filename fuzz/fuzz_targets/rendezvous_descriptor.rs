//! Fuzzes the rendezvous descriptor decoder: the payload of a peer's `Rendezvous` message,
//! which names the memory this side will RDMA READ. Decoding never panics; whatever decodes
//! is a non-empty message whose descriptor re-encodes to exactly the input (the format is
//! canonical: 24 bytes, reserved bytes zero); everything else is `BadDescriptor`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokio_rdma::ProtocolError;
use tokio_rdma::conn::wire::{DESCRIPTOR_LEN, RemoteMsg};

fuzz_target!(|data: &[u8]| {
    // The first two bytes choose the receiver's sequence number; the rest is the payload.
    let (seq, payload) = match data {
        [a, b, rest @ ..] => (u16::from_be_bytes([*a, *b]), rest),
        _ => (0, data),
    };
    match RemoteMsg::decode_received(payload, seq) {
        Ok(m) => {
            assert_eq!(payload.len(), DESCRIPTOR_LEN as usize);
            assert!(m.len > 0, "an empty rendezvous message accepted");
            assert_eq!(m.seq, seq, "the sequence number is the receiver's");
            assert_eq!(
                &RemoteMsg::encode(m.addr, m.len, m.rkey)[..],
                payload,
                "the descriptor format is canonical"
            );
            assert_eq!(
                RemoteMsg::decode_received(&RemoteMsg::encode(m.addr, m.len, m.rkey), seq),
                Ok(m)
            );
        }
        Err(e) => {
            assert_eq!(e, ProtocolError::BadDescriptor);
            let valid = payload.len() == DESCRIPTOR_LEN as usize
                && payload[20..24] == [0; 4]
                && payload[8..16] != [0; 8];
            assert!(!valid, "a valid descriptor refused");
        }
    }
});
