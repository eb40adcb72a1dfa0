//! Unit tests of the parent module.
use super::*;

fn param(pd: &[u8]) -> ConnParam<'_> {
    ConnParam {
        private_data: pd,
        responder_resources: 4,
        initiator_depth: 4,
        flow_control: false,
        retry_count: 7,
        rnr_retry_count: 6,
        srq: false,
        qp_num: 0x11,
    }
}

#[test]
fn conn_param_limits() {
    let ok = [0u8; MAX_CONNECT_PRIVATE_DATA];
    let raw = param(&ok)
        .to_raw("rdma_connect", MAX_CONNECT_PRIVATE_DATA)
        .unwrap();
    assert_eq!(raw.private_data_len, 56);
    assert_eq!((raw.qp_num, raw.rnr_retry_count, raw.srq), (0x11, 6, 0));
    let long = [0u8; MAX_CONNECT_PRIVATE_DATA + 1];
    let Err(e) = param(&long).to_raw("rdma_connect", MAX_CONNECT_PRIVATE_DATA) else {
        panic!("57 bytes accepted");
    };
    assert!(
        matches!(
            e,
            Error::PrivateDataTooLong {
                len: 57,
                max: 56,
                ..
            }
        ),
        "{e}"
    );
    let raw = param(&[])
        .to_raw("rdma_accept", MAX_ACCEPT_PRIVATE_DATA)
        .unwrap();
    assert!(raw.private_data.is_null());
    let mut p = param(&[]);
    p.rnr_retry_count = 8;
    assert!(p.to_raw("rdma_connect", 56).is_err());
    let mut p = param(&[]);
    p.qp_num = 1 << 24;
    assert!(p.to_raw("rdma_connect", 56).is_err());
}

#[test]
fn answering_caps_initiator_depth() {
    let req = super::super::PeerConnParam {
        responder_resources: 1,
        initiator_depth: 2,
        flow_control: false,
        retry_count: 7,
        rnr_retry_count: 6,
        srq: false,
        qp_num: 5,
    };
    let p = param(b"x").answering(&req);
    assert_eq!((p.initiator_depth, p.responder_resources), (2, 4));
}

#[test]
fn loopback_is_refused_up_front() {
    for a in ["127.0.0.1:7470", "[::1]:7470", "[::ffff:127.0.0.1]:1"] {
        let addr: SocketAddr = a.parse().unwrap();
        let e = refuse_loopback(addr, "rdma_bind_addr").unwrap_err();
        assert!(matches!(e, Error::LoopbackAddress { .. }), "{e:?}");
        let text = e.to_string();
        assert!(
            text.contains("loopback") && text.contains("rdma link"),
            "{text}"
        );
        let io: std::io::Error = e.into();
        assert_eq!(io.kind(), std::io::ErrorKind::AddrNotAvailable);
    }
    refuse_loopback("0.0.0.0:0".parse().unwrap(), "rdma_bind_addr").unwrap();
    refuse_loopback("192.0.2.1:7470".parse().unwrap(), "rdma_resolve_addr").unwrap();
}
