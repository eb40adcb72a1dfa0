//! Fuzzes the handshake decoder with arbitrary private data: decoding never panics, and
//! whatever decodes re-encodes to bytes that decode to the same parameters, which negotiate
//! with themselves and with the defaults without panicking.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokio_rdma::conn::handshake::{self, Params};

fuzz_target!(|data: &[u8]| {
    let Ok(params) = Params::decode(data) else {
        return;
    };
    let wire = params
        .encode()
        .expect("decoded parameters are valid, so they encode");
    assert!(wire.len() <= handshake::MAX_CONNECT_PRIVATE_DATA);
    let again = Params::decode(&wire).expect("re-encoded parameters decode");
    assert_eq!(again, params, "round trip");
    // Padded as the transport delivers it.
    let mut padded = wire.to_vec();
    padded.resize(handshake::MAX_CONNECT_PRIVATE_DATA, 0);
    assert_eq!(Params::decode(&padded), Ok(params));
    // Negotiation of valid parameters never panics and is symmetric in what it reports.
    let default = Params::default();
    match (
        handshake::negotiate(&params, &default),
        handshake::negotiate(&default, &params),
    ) {
        (Ok(a), Ok(b)) => {
            assert_eq!(a.send_credits, b.recv_credits);
            // A chunk fits the receiver's buffers and the sender's own staging buffers.
            assert!(a.max_send_size <= b.recv_buf_size && a.max_send_size <= a.recv_buf_size);
            assert_eq!(a.max_message_size, b.max_message_size);
            assert_eq!((a.one_sided, a.atomics), (b.one_sided, b.atomics));
        }
        (Err(_), Err(_)) => {}
        (a, b) => panic!("asymmetric negotiation: {a:?} vs {b:?}"),
    }
    let _ = handshake::negotiate(&params, &params);
});
