//! Unit tests of the parent module.
use super::*;

fn sample() -> Params {
    Params {
        flags: Flags::ONE_SIDED | Flags::REQUIRE_ONE_SIDED,
        recv_credits: 128,
        recv_buf_size: 8192,
        max_inline: 220,
        max_message_size: 64 << 20,
        initial_credits: None,
    }
}

fn field_of(e: HandshakeError) -> Field {
    match e {
        HandshakeError::InvalidField { field, .. } => field,
        other => panic!("expected InvalidField, got {other:?}"),
    }
}

fn with(f: impl FnOnce(&mut [u8; ENCODED_LEN])) -> Vec<u8> {
    let mut b = sample().encode().unwrap();
    f(&mut b);
    b.to_vec()
}

#[test]
fn round_trip() {
    let p = sample();
    let b = p.encode().unwrap();
    assert_eq!(b.len(), ENCODED_LEN);
    assert_eq!(&b[..4], b"TRDM");
    assert_eq!(b[4], VERSION);
    assert_eq!(Params::decode(&b).unwrap(), p);
    let d = Params::default();
    assert_eq!(Params::decode(&d.encode().unwrap()).unwrap(), d);
}

#[test]
fn wire_layout_is_big_endian() {
    let b = sample().encode().unwrap();
    assert_eq!(
        b,
        [
            b'T', b'R', b'D', b'M', 2, 32, 0x01, 0x01, 0, 0, 0, 128, 0, 0, 0x20, 0, 0, 0, 0, 220,
            0, 0, 0, 0, 0x04, 0, 0, 0, 0, 0, 0, 128
        ]
    );
}

#[test]
fn transport_padding_is_accepted() {
    let b = sample().encode().unwrap();
    for total in [56usize, 148, 196] {
        let mut padded = b.to_vec();
        padded.resize(total, 0);
        assert_eq!(Params::decode(&padded).unwrap(), sample(), "{total} bytes");
    }
    // A later compatible revision appends fields and says so in the length byte.
    let mut longer = b.to_vec();
    longer[5] = 40;
    longer.extend_from_slice(&[0xaa; 12]);
    longer.resize(56, 0);
    assert_eq!(Params::decode(&longer).unwrap(), sample());
}

#[test]
fn missing_and_truncated() {
    assert_eq!(Params::decode(&[]), Err(HandshakeError::Missing));
    assert_eq!(Params::decode(&[0; 56]), Err(HandshakeError::Missing));
    let b = sample().encode().unwrap();
    for n in 1..ENCODED_LEN {
        match Params::decode(&b[..n]) {
            Err(HandshakeError::Truncated { needed, got }) => {
                assert_eq!((needed, got), (ENCODED_LEN, n));
            }
            other => panic!("{n} bytes: {other:?}"),
        }
    }
    // The length byte promises more than is there.
    let mut v = b.to_vec();
    v[5] = 40;
    assert_eq!(
        Params::decode(&v),
        Err(HandshakeError::Truncated {
            needed: 40,
            got: 32
        })
    );
}

#[test]
fn wrong_magic_and_version() {
    let v = with(|b| b[0] = b'X');
    assert_eq!(
        Params::decode(&v),
        Err(HandshakeError::BadMagic { found: *b"XRDM" })
    );
    // Another protocol's bytes.
    assert!(matches!(
        Params::decode(b"HTTP"),
        Err(HandshakeError::BadMagic { .. })
    ));
    for version in [0u8, 1, 3, 255] {
        let v = with(|b| b[4] = version);
        assert_eq!(
            Params::decode(&v),
            Err(HandshakeError::UnsupportedVersion {
                found: version,
                supported: 2
            })
        );
    }
    let e = Params::decode(b"GET / HTTP/1.1\r\n").unwrap_err();
    assert_eq!(
        e.to_string(),
        "bad magic \"GET \" (expected \"TRDM\"): not a tokio-rdma peer"
    );
    let e = Params::decode(&[0xff, 0, 1, 2]).unwrap_err();
    assert!(e.to_string().contains(r#""\xff\x00\x01\x02""#), "{e}");
    let e = Params::decode(&with(|b| b[4] = 7)).unwrap_err();
    assert!(e.to_string().contains("version 7"), "{e}");
}

#[test]
fn encoded_len_below_v1_is_rejected() {
    let v = with(|b| b[5] = 27);
    assert_eq!(field_of(Params::decode(&v).unwrap_err()), Field::EncodedLen);
    let v = with(|b| b[5] = 0);
    assert_eq!(field_of(Params::decode(&v).unwrap_err()), Field::EncodedLen);
}

#[test]
fn unknown_flags_are_rejected() {
    let v = with(|b| b[7] |= 0x08);
    assert_eq!(field_of(Params::decode(&v).unwrap_err()), Field::Flags);
    let v = with(|b| b[6] = 0x80);
    assert_eq!(field_of(Params::decode(&v).unwrap_err()), Field::Flags);
}

#[test]
fn credits_bounds() {
    let set = |c: u32| {
        with(|b| {
            b[8..12].copy_from_slice(&c.to_be_bytes());
            b[28..32].copy_from_slice(&c.to_be_bytes());
        })
    };
    for bad in [0u32, 1, 65_536, u32::MAX] {
        let e = Params::decode(&set(bad)).unwrap_err();
        assert!(e.to_string().contains("recv_credits"), "{e}");
        assert_eq!(field_of(e), Field::RecvCredits);
    }
    let e = Params::decode(&set(1)).unwrap_err();
    assert!(e.to_string().contains("fewer than 2"), "{e}");
    for good in [2u32, 3, 65_535] {
        assert_eq!(Params::decode(&set(good)).unwrap().recv_credits, good);
    }
}

#[test]
fn recv_buf_size_bounds() {
    // Keep max_message_size above the tested sizes so only recv_buf_size can be wrong.
    let set = |s: u32| {
        with(|b| {
            b[12..16].copy_from_slice(&s.to_be_bytes());
            b[20..28].copy_from_slice(&(1u64 << 30).to_be_bytes());
        })
    };
    for bad in [0u32, 63, (16 << 20) + 1, u32::MAX] {
        let e = Params::decode(&set(bad)).unwrap_err();
        assert_eq!(field_of(e), Field::RecvBufSize, "size {bad}");
    }
    for good in [64u32, 16 << 20] {
        assert_eq!(Params::decode(&set(good)).unwrap().recv_buf_size, good);
    }
}

#[test]
fn max_inline_bounds() {
    let set = |s: u32| with(|b| b[16..20].copy_from_slice(&s.to_be_bytes()));
    assert_eq!(
        field_of(Params::decode(&set((64 << 10) + 1)).unwrap_err()),
        Field::MaxInline
    );
    assert_eq!(Params::decode(&set(0)).unwrap().max_inline, 0);
    assert_eq!(Params::decode(&set(64 << 10)).unwrap().max_inline, 64 << 10);
}

#[test]
fn max_message_size_bounds() {
    let set = |s: u64| with(|b| b[20..28].copy_from_slice(&s.to_be_bytes()));
    for bad in [0u64, 8191, (1 << 40) + 1, u64::MAX] {
        let e = Params::decode(&set(bad)).unwrap_err();
        assert_eq!(field_of(e), Field::MaxMessageSize, "size {bad}");
    }
    assert_eq!(Params::decode(&set(8192)).unwrap().max_message_size, 8192);
    assert_eq!(
        Params::decode(&set(1 << 40)).unwrap().max_message_size,
        1 << 40
    );
}

#[test]
fn one_credit_is_refused_everywhere() {
    let one = Params {
        recv_credits: 1,
        ..Params::default()
    };
    assert_eq!(
        one.validate(),
        Err(HandshakeError::InvalidField {
            field: Field::RecvCredits,
            value: 1,
            reason: "fewer than 2: the protocol keeps a chunk in flight while the \
                     previous credit returns",
        })
    );
    assert_eq!(field_of(one.encode().unwrap_err()), Field::RecvCredits);
    assert_eq!(
        field_of(negotiate(&Params::default(), &one).unwrap_err()),
        Field::RecvCredits
    );
    assert_eq!(
        field_of(negotiate(&one, &Params::default()).unwrap_err()),
        Field::RecvCredits
    );
    let two = Params {
        recv_credits: MIN_CREDITS,
        ..Params::default()
    };
    assert_eq!(negotiate(&Params::default(), &two).unwrap().send_credits, 2);
}

#[test]
fn chunks_are_the_peer_receive_size() {
    let small = Params {
        recv_buf_size: 4096,
        ..Params::default()
    };
    let large = Params {
        recv_buf_size: 64 << 10,
        max_message_size: 1 << 20,
        ..Params::default()
    };
    // Each side sends chunks as large as the peer's receives (it stages them in buffers of
    // that size, apart from its own receive buffers).
    assert_eq!(negotiate(&small, &large).unwrap().max_send_size, 64 << 10);
    assert_eq!(negotiate(&large, &small).unwrap().max_send_size, 4096);
    assert_eq!(negotiate(&large, &large).unwrap().max_send_size, 64 << 10);
}

#[test]
fn invalid_params_are_not_encoded() {
    let p = Params {
        recv_credits: 0,
        ..Params::default()
    };
    assert_eq!(field_of(p.encode().unwrap_err()), Field::RecvCredits);
    let p = Params {
        flags: Flags(0x8000),
        ..Params::default()
    };
    assert_eq!(field_of(p.encode().unwrap_err()), Field::Flags);
}

#[test]
fn negotiate_takes_the_peer_view() {
    let client = sample();
    let server = Params {
        flags: Flags::ONE_SIDED | Flags::ATOMICS,
        recv_credits: 16,
        recv_buf_size: 128,
        max_inline: 64,
        max_message_size: 1 << 20,
        initial_credits: None,
    };
    let c = negotiate(&client, &server).unwrap();
    assert_eq!(c.send_credits, 16);
    assert_eq!(c.recv_credits, 128);
    assert_eq!(c.max_send_size, 128);
    assert_eq!(c.recv_buf_size, 8192);
    assert_eq!(
        c.max_inline, 128,
        "inline capped by the peer's receive size"
    );
    assert_eq!(c.max_message_size, 1 << 20);
    assert!(c.one_sided);
    assert!(!c.atomics, "only the server offers atomics");
    let s = negotiate(&server, &client).unwrap();
    assert_eq!((s.send_credits, s.recv_credits), (128, 16));
    // The client takes 8 KiB chunks.
    assert_eq!((s.max_send_size, s.max_inline), (8192, 64));
    assert_eq!(s.max_message_size, c.max_message_size);
}

#[test]
fn negotiate_reports_missing_features() {
    let needs_atomics = Params {
        flags: Flags::REQUIRE_ATOMICS,
        ..Params::default()
    };
    let plain = Params {
        flags: Flags::NONE,
        ..Params::default()
    };
    assert_eq!(
        negotiate(&needs_atomics, &plain),
        Err(HandshakeError::Incompatible {
            required_by: Side::Local,
            feature: Feature::Atomics
        })
    );
    let e = negotiate(&plain, &needs_atomics).unwrap_err();
    assert_eq!(
        e,
        HandshakeError::Incompatible {
            required_by: Side::Remote,
            feature: Feature::Atomics
        }
    );
    assert!(
        e.to_string().contains("the peer requires remote atomics"),
        "{e}"
    );
    let needs_one_sided = Params {
        flags: Flags::REQUIRE_ONE_SIDED,
        ..Params::default()
    };
    assert!(matches!(
        negotiate(&needs_one_sided, &plain),
        Err(HandshakeError::Incompatible {
            feature: Feature::OneSided,
            ..
        })
    ));
    // Offered on both sides: fine.
    assert!(negotiate(&needs_one_sided, &Params::default()).is_ok());
}

#[test]
fn negotiate_validates_both_sides() {
    let bad = Params {
        recv_buf_size: 1,
        ..Params::default()
    };
    assert_eq!(
        field_of(negotiate(&Params::default(), &bad).unwrap_err()),
        Field::RecvBufSize
    );
    assert_eq!(
        field_of(negotiate(&bad, &Params::default()).unwrap_err()),
        Field::RecvBufSize
    );
}

#[test]
fn flags_debug_and_bits() {
    assert_eq!(format!("{:?}", Flags::NONE), "NONE");
    assert_eq!(
        format!("{:?}", Flags::ONE_SIDED | Flags::REQUIRE_ATOMICS),
        "ONE_SIDED | REQUIRE_ATOMICS"
    );
    assert_eq!(format!("{:?}", Flags(0x1008)), "0x1008");
    assert_eq!(format!("{:?}", Flags(0x0004)), "RENDEZVOUS");
    assert_eq!(format!("{:?}", Flags(0x1001)), "ONE_SIDED | 0x1000");
    assert_eq!(Flags::from_bits(0x0307), Some(Flags::KNOWN));
    assert_eq!(Flags::from_bits(0x0400), None);
}

#[test]
fn initial_credits_travel_and_are_checked() {
    let p = Params {
        initial_credits: Some(2),
        ..sample()
    };
    let b = p.encode().unwrap();
    assert_eq!(&b[28..32], &[0, 0, 0, 2]);
    assert_eq!(Params::decode(&b).unwrap(), p);
    let eff = negotiate(&Params::default(), &p).unwrap();
    assert_eq!((eff.send_credits, eff.send_initial_credits), (128, 2));
    assert_eq!((eff.recv_credits, eff.recv_initial_credits), (64, 64));
    // The 28-byte base encoding: everything usable at once.
    let mut base = b[..BASE_LEN].to_vec();
    base[5] = BASE_LEN as u8;
    assert_eq!(Params::decode(&base).unwrap().initial(), 128);
    for bad in [0u32, 129] {
        let mut w = b;
        w[28..32].copy_from_slice(&bad.to_be_bytes());
        assert_eq!(
            field_of(Params::decode(&w).unwrap_err()),
            Field::InitialCredits,
            "{bad}"
        );
    }
}
