//! Fuzzes the decoders of a remote token a peer sends: `RemoteToken::from_bytes` (20 bytes,
//! big endian) and serde's `Deserialize` (here from JSON). Decoding never panics; a decoded
//! token's range lies inside the address space, so `check` and `slice` with any arguments
//! never panic or overflow (the targets build with overflow checks); the byte format is
//! canonical (to_bytes(from_bytes(b)) == b); both decoders round-trip and agree with
//! `try_new`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokio_rdma::buf::RemoteToken;

fn exercise(t: RemoteToken, args: &[u8]) {
    assert!(
        t.addr().checked_add(t.len()).is_some(),
        "a token that wraps: {t:?}"
    );
    let word = |i: usize| {
        let mut w = [0u8; 8];
        for (k, b) in w.iter_mut().enumerate() {
            *b = args.get(i * 8 + k).copied().unwrap_or(0);
        }
        u64::from_le_bytes(w)
    };
    // Offsets near the token's edges and anywhere.
    for (a, b) in [
        (word(0), word(1)),
        (t.len().wrapping_sub(word(0) & 0xff), word(1) & 0xff),
        (
            word(0) % (t.len() + u64::from(t.len() < u64::MAX)),
            word(1) & 0xffff,
        ),
    ] {
        if let Ok(addr) = t.check(a, b) {
            assert!(a.checked_add(b).is_some_and(|end| end <= t.len()));
            assert_eq!(addr, t.addr() + a);
        }
        if let Ok(s) = t.slice(a..b) {
            assert!(a <= b && b <= t.len());
            assert_eq!(
                (s.addr(), s.len(), s.rkey()),
                (t.addr() + a, b - a, t.rkey())
            );
            assert!(s.slice(..).is_ok_and(|x| x == s));
        }
        let _ = t.slice(a..=b);
        let _ = t.slice(a..);
        let _ = t.slice(..b);
    }
}

fuzz_target!(|data: &[u8]| {
    // The byte form.
    let head = &data[..data.len().min(20)];
    match RemoteToken::from_bytes(head) {
        Ok(t) => {
            assert_eq!(&t.to_bytes()[..], head, "the byte format is canonical");
            assert_eq!(
                RemoteToken::try_new(t.addr(), t.len(), t.rkey()).ok(),
                Some(t)
            );
            exercise(t, &data[20..]);
        }
        Err(_) => {
            if let Ok(b) = <[u8; 20]>::try_from(head) {
                let addr = u64::from_be_bytes(b[..8].try_into().unwrap());
                let len = u64::from_be_bytes(b[8..16].try_into().unwrap());
                assert!(addr.checked_add(len).is_none(), "a valid token refused");
                assert!(RemoteToken::try_new(addr, len, 1).is_err());
            }
        }
    }
    // The serde form, as a peer may send it in JSON.
    if let Ok(t) = serde_json::from_slice::<RemoteToken>(data) {
        let text = serde_json::to_string(&t).expect("a token serializes");
        assert_eq!(
            serde_json::from_str::<RemoteToken>(&text).ok(),
            Some(t),
            "serde round trip"
        );
        assert_eq!(RemoteToken::from_bytes(&t.to_bytes()).ok(), Some(t));
        exercise(t, data);
    }
});
