//! Fuzzes `QpAddress::from_bytes`, the decoder of a queue-pair address exchanged out of band
//! (from a peer). Decoding never panics; whatever decodes has 24-bit QPN and PSN, and the
//! format is canonical (to_bytes(from_bytes(b)) == b).
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokio_rdma::verbs::QpAddress;

fuzz_target!(|data: &[u8]| {
    match QpAddress::from_bytes(data) {
        Ok(a) => {
            assert!(a.qpn <= 0xff_ffff && a.psn <= 0xff_ffff);
            assert_eq!(&a.to_bytes()[..], data, "the format is canonical");
            assert_eq!(QpAddress::from_bytes(&a.to_bytes()).ok(), Some(a));
            assert!(a.mtu.bytes() >= 256 && a.mtu.bytes() <= 4096);
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
});
