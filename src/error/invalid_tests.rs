//! Unit tests of [`InvalidArgument`] and [`Unsupported`]: each message is the text the crate
//! printed when the cause was a string, and callers can match on a cause.

use std::io;
use std::ops::Bound;
use std::time::Duration;

use super::{Error, InvalidArgument, Unsupported};
use crate::buf::fake::FakeRegistrar;
use crate::buf::{Pool, PoolConfig, RemoteAccess, RemoteToken, SizeClass};
use crate::driver::CompletionMode;
use crate::verbs::{AccessFlags, QpAddress};

#[test]
fn messages_are_the_former_texts() {
    let cases = [
        (
            InvalidArgument::AtomicUnaligned { addr: 0x1004 },
            "atomic target 0x1004 is not 8-byte aligned",
        ),
        (
            InvalidArgument::TooManySges { count: 5, max: 4 },
            "5 scatter/gather entries exceed the queue pair's limit of 4",
        ),
        (
            InvalidArgument::MessageTooLarge {
                len: 2048,
                max: 1024,
            },
            "message of 2048 bytes exceeds the connection's limit of 1024",
        ),
        (
            InvalidArgument::AdaptiveSpinTooLong {
                max_spin: Duration::from_secs(2),
            },
            "adaptive max_spin 2s exceeds one second: use BusyPoll to spin without limit",
        ),
        (
            InvalidArgument::CqFullForQp {
                capacity: 32767,
                depth: 148,
                used: 32708,
                max_cqe: 65535,
            },
            "completion queue of 32767 entries cannot take another queue pair of depth 148 \
             (32708 already used; every queue pair reserves its send and receive depths): raise \
             EndpointOptions::cq_size (or DriverOptions::cq_size) up to the device's max_cqe \
             65535, use shallower queues (ConnectOptions::recv_credits, send_queue_depth), or \
             open another Endpoint on the device",
        ),
        (
            InvalidArgument::SrqLowWatermark {
                low_watermark: 8,
                buffers: 8,
            },
            "SrqOptions::low_watermark Some(8) is not below buffers 8",
        ),
        (
            InvalidArgument::TokenSlice {
                start: Bound::Included(3),
                end: Bound::Unbounded,
                token_len: 2,
            },
            "remote slice Included(3)..Unbounded outside a token of 2 bytes",
        ),
        (
            InvalidArgument::ConnParamQpNum {
                call: "rdma_connect",
                qp_num: 0x100_0000,
            },
            "rdma_connect: qp_num 0x1000000 exceeds 24 bits",
        ),
        (
            InvalidArgument::OfferWithSrq {
                option: "atomics(true)",
            },
            "ConnectOptions::atomics(true) cannot apply on an endpoint with a shared receive \
             queue: its connections share one protection domain, so memory opened to one peer \
             would be open to every peer",
        ),
    ];
    for (cause, text) in cases {
        assert_eq!(cause.to_string(), text);
        assert_eq!(
            Error::InvalidArgument(cause).to_string(),
            format!("invalid argument: {text}")
        );
    }
    let no_lkey = Error::InvalidArgument(InvalidArgument::NoLkey).to_string();
    assert!(
        no_lkey.starts_with("invalid argument: buffer has no lkey (a plain Vec or BytesMut"),
        "{no_lkey}"
    );
    assert!(no_lkey.contains("`conn.pool()?.acquire(len)`"), "{no_lkey}");
    let atomic = InvalidArgument::AtomicNoLkey.to_string();
    assert_eq!(atomic, format!("atomic {}", InvalidArgument::NoLkey));
    let foreign = InvalidArgument::ForeignLocalBuffer.to_string();
    assert!(foreign.contains("conn.pool()"), "{foreign}");
    let e = Error::Unsupported(Unsupported::NoMwType2 {
        device: "rxe0".into(),
    });
    assert_eq!(
        e.to_string(),
        "unsupported: rxe0 has no type-2 memory windows"
    );
}

/// The error layer sits below `buf` and `driver` and carries their values as data: the
/// messages still print them as their own `Debug` does.
#[test]
fn carried_values_print_as_their_types_do() {
    // `RemoteAccess`'s `Debug` is the error layer's spelling (one function): check the
    // spelling itself.
    for (access, shown) in [
        (RemoteAccess::default(), "RemoteAccess(NONE)"),
        (RemoteAccess::READ, "RemoteAccess(READ)"),
        (
            RemoteAccess::READ | RemoteAccess::WRITE | RemoteAccess::ATOMIC,
            "RemoteAccess(READ | WRITE | ATOMIC)",
        ),
        (
            RemoteAccess::WRITE | RemoteAccess::ON_DEMAND,
            "RemoteAccess(WRITE | ON_DEMAND)",
        ),
    ] {
        assert_eq!(format!("{access:?}"), shown);
        let err = InvalidArgument::SharedGrantRights {
            access: access.to_flags(),
        };
        assert_eq!(
            err.to_string(),
            format!("a shared grant needs read, write or atomic rights and is pinned; got {shown}")
        );
    }
    let modes = [
        CompletionMode::Event,
        CompletionMode::BusyPoll,
        CompletionMode::Adaptive {
            max_spin: Duration::from_micros(500),
        },
    ];
    for m in modes {
        for e in modes {
            assert_eq!(
                m.mismatch(e).to_string(),
                format!(
                    "ConnectOptions::completion_mode {m:?} differs from the endpoint's {e:?}: \
                     the mode belongs to the endpoint (EndpointOptions)"
                )
            );
        }
    }
    let c = SizeClass::new(0, 3);
    let err = InvalidArgument::InvalidSizeClass {
        size: c.size,
        count: c.count,
    };
    assert_eq!(err.to_string(), format!("invalid size class {c:?}"));
    let ptr = 0x7f00_1000 as *const u8;
    let err = InvalidArgument::CacheRange {
        len: 0,
        addr: ptr as usize,
    };
    assert_eq!(
        err.to_string(),
        format!("cannot register 0 bytes at {ptr:p}")
    );
    let err = InvalidArgument::WindowRights {
        access: AccessFlags::LOCAL_WRITE,
    };
    assert_eq!(
        err.to_string(),
        "window rights must be remote rights only, got AccessFlags(LOCAL_WRITE)"
    );
}

/// Callers match on the cause a real call returns.
#[test]
fn callers_match_on_the_cause() {
    let token = RemoteToken::try_new(0x1000, 64, 7).unwrap();
    assert!(matches!(
        token.check(60, 8),
        Err(Error::InvalidArgument(InvalidArgument::TokenRange {
            offset: 60,
            len: 8,
            token_len: 64
        }))
    ));
    assert!(matches!(
        RemoteToken::from_bytes(&[0; 3]),
        Err(Error::InvalidArgument(InvalidArgument::TokenLength {
            got: 3
        }))
    ));
    assert!(matches!(
        RemoteToken::try_new(u64::MAX - 10, 11, 7),
        Err(Error::InvalidArgument(InvalidArgument::TokenWraps { .. }))
    ));
    assert!(matches!(
        QpAddress::from_bytes(&[9; 28]),
        Err(Error::InvalidArgument(InvalidArgument::QpAddressVersion {
            version: 9
        }))
    ));
    let classes = [SizeClass::new(64, 1), SizeClass::new(60, 2)];
    let dup = PoolConfig::default().classes(classes);
    match Pool::new(&FakeRegistrar::default(), dup) {
        Err(Error::InvalidArgument(InvalidArgument::DuplicateSizeClasses { classes: got })) => {
            assert_eq!(got, vec![(64, 1), (60, 2)]);
            let err = InvalidArgument::DuplicateSizeClasses { classes: got };
            assert_eq!(
                err.to_string(),
                format!("duplicate size classes in {classes:?}")
            );
        }
        other => panic!("{:?}", other.err()),
    }
}

#[test]
fn io_error_kinds() {
    let e: io::Error = Error::InvalidArgument(InvalidArgument::NoLkey).into();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    let e: io::Error = Error::Unsupported(Unsupported::NoMwBindRegistration).into();
    assert_eq!(e.kind(), io::ErrorKind::Unsupported);
}

#[test]
fn an_error_stays_small_enough_to_move_through_every_result() {
    // Every operation's outcome is a `Result<_, Error>` moved through several layers: a
    // variant that grows `Error` costs every operation (the mode mismatch is boxed for this).
    assert!(
        std::mem::size_of::<crate::Error>() <= 56,
        "Error is {} bytes",
        std::mem::size_of::<crate::Error>()
    );
}
