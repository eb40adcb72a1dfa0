//! One driver (completion queue + tasks) per device, shared by every connection on that device
//! (each connection has its own protection domain).

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use crate::driver::{Driver, DriverOptions};
use crate::error::Result;
use crate::verbs::Context;

struct Entry {
    handle: Driver,
}

fn table() -> &'static Mutex<HashMap<usize, Entry>> {
    static TABLE: OnceLock<Mutex<HashMap<usize, Entry>>> = OnceLock::new();
    TABLE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The shared driver and PD of `ctx`'s device, created on first use on the current runtime
/// (its tasks run there). A driver whose completion task is gone (its runtime shut down) is
/// replaced. The registry keeps each device's driver for the life of the process.
pub(crate) fn driver_for(ctx: &Context, opts: &DriverOptions) -> Result<Driver> {
    let key = ctx.as_ptr() as usize;
    let mut t = table().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(e) = t.get(&key) {
        if e.handle.is_running() {
            return Ok(e.handle.clone());
        }
    }
    let cap = ctx.device_attr().max_cqe.clamp(256, 65536);
    let mut o = opts.clone();
    o.cq_size = o.cq_size.max(cap);
    let handle = Driver::new(ctx, o)?;
    t.insert(
        key,
        Entry {
            handle: handle.clone(),
        },
    );
    Ok(handle)
}
