//! Device tests of the driver's locking (run in the soft-RoCE VM: `scripts/test` runs the
//! library's ignored tests there too).

use super::*;
use crate::verbs::{Context, QpState};

fn device() -> Context {
    let name = std::env::var("TOKIO_RDMA_DEVICE").unwrap_or_else(|_| "rxe0".into());
    Context::rdma_cm_devices()
        .expect("devices")
        .into_iter()
        .find(|c| c.name() == name)
        .unwrap_or_else(|| panic!("no device {name}"))
}

/// `ibv_modify_qp(ERR)` is a system call that waits for the kernel's queue-pair lock: it must
/// not run while the driver's lock is held (every future of the CQ waits for that lock). A
/// failure recorded under the lock moves the queue pair to ERR once the lock is released.
#[tokio::test(flavor = "current_thread")]
#[ignore = "needs an RDMA device; runs in the soft-RoCE VM via scripts/test"]
async fn a_failed_queue_pair_moves_to_err_after_the_lock_is_released() {
    let ctx = device();
    let driver = crate::driver::Driver::new(&ctx, Default::default()).expect("driver");
    let pd = ProtectionDomain::new(&ctx).expect("pd");
    let qp = driver.create_qp(&pd, Default::default()).expect("qp");
    // RESET may only go to INIT; from INIT on, any state may go to ERR.
    qp.verbs()
        .to_init(1, crate::verbs::AccessFlags::LOCAL_WRITE)
        .expect("INIT");
    assert_eq!(qp.verbs().state().expect("query"), QpState::Init);
    let mut wake = Deferred::default();
    {
        let mut st = qp.shared().lock();
        st.fail(qp.key, QpFailure::Closed, &mut wake);
        assert_eq!(
            qp.verbs().state().expect("query"),
            QpState::Init,
            "ibv_modify_qp ran under the driver's lock"
        );
    }
    wake.run();
    assert_eq!(qp.verbs().state().expect("query"), QpState::Err);
    // Asked twice before the lock is released (a failure recorded, then a failed post of
    // the same queue pair), it moves once.
    let mut wake = Deferred::default();
    wake.move_to_error(qp.verbs(), None);
    wake.move_to_error(qp.verbs(), None);
    assert_eq!(wake.pending_errors(), 1);
    wake.run();
    assert_eq!(wake.pending_errors(), 0);
}
