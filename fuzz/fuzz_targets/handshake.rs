//! Fuzzes the handshake decoder with arbitrary private data (what a peer's connect request or
//! accept reply carries): decoding never panics; whatever decodes re-encodes to bytes that
//! decode to the same parameters, also padded as the transport delivers them; the encoding is
//! stable (encode(decode(encode(p))) == encode(p)); negotiation against the defaults and
//! against itself never panics and gives each side the mirror image of the other's view.
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
    assert_eq!(again.encode().as_ref(), Ok(&wire), "the encoding is stable");
    // Padded as the transport delivers it.
    let mut padded = wire.to_vec();
    padded.resize(handshake::MAX_CONNECT_PRIVATE_DATA, 0);
    assert_eq!(Params::decode(&padded), Ok(params));
    // Negotiation of valid parameters never panics, and each side's view is the mirror image
    // of the other's.
    let default = Params::default();
    for other in [default, params] {
        match (
            handshake::negotiate(&params, &other),
            handshake::negotiate(&other, &params),
        ) {
            (Ok(a), Ok(b)) => {
                assert_eq!(a.send_credits, b.recv_credits);
                assert_eq!(a.recv_credits, b.send_credits);
                assert_eq!(a.send_initial_credits, b.recv_initial_credits);
                assert_eq!(a.recv_initial_credits, b.send_initial_credits);
                assert!(a.send_initial_credits >= 1 && a.send_initial_credits <= a.send_credits);
                // A chunk this side sends is exactly what one of the peer's receives takes.
                assert_eq!(a.max_send_size, b.recv_buf_size);
                assert_eq!(b.max_send_size, a.recv_buf_size);
                assert!(a.max_inline <= a.max_send_size && b.max_inline <= b.max_send_size);
                assert_eq!(a.max_message_size, b.max_message_size);
                assert!(a.max_message_size >= a.recv_buf_size.min(b.recv_buf_size).into());
                assert_eq!((a.one_sided, a.atomics), (b.one_sided, b.atomics));
                assert_eq!(a.rendezvous, b.rendezvous);
                assert_eq!(
                    a.peer_one_sided,
                    other.flags.contains(handshake::Flags::ONE_SIDED)
                );
            }
            (Err(_), Err(_)) => {}
            (a, b) => panic!("asymmetric negotiation: {a:?} vs {b:?}"),
        }
    }
});
