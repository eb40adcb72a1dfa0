//! The randomized storm runs.
#![allow(unused_imports)]

use super::storm_model::*;
use super::*;

#[test]
#[allow(clippy::print_stdout)]
fn randomized_cancellation_storm() {
    let mut storm = Storm::new(0x5eed_c0de, 4, 16, 2000);
    storm.run(100_000);
    let s = &storm.stats;
    println!("storm seed {:#x}: {s:?}", storm.seed);
    // The run exercised what it claims to.
    assert!(s.submitted >= 100_000);
    for (what, n) in [
        ("drops while queued", s.drop_queued),
        ("drops while posted", s.drop_posted),
        ("drops after completion", s.drop_done),
        ("drops before the first poll", s.drop_unpolled),
    ] {
        assert!(n >= 1_000, "only {n} {what}");
    }
    for (what, n) in [
        ("drops while queued", s.drop_queued),
        ("drops while posted", s.drop_posted),
        ("drops after completion", s.drop_done),
        ("drops before the first poll", s.drop_unpolled),
        ("unsignaled sends", s.unsignaled),
        ("retired sends", s.retired),
        ("error completions", s.errors),
        ("flushes", s.flushes),
        ("closes", s.closes),
        ("abandons", s.abandons),
        ("replaced QPs", s.qps_replaced),
        ("spurious completions", s.spurious),
        ("rejected submissions", s.rejected),
        ("refused removals", s.refused_removals),
        ("post failures", s.post_failures),
    ] {
        assert!(n > 0, "the storm never produced {what}");
    }
}

#[test]
#[allow(clippy::print_stdout)]
fn randomized_storm_small_queues_many_seeds() {
    // Tiny queues (constant backpressure, queue-filling signaled sends) and frequent errors.
    for seed in 1..=8u64 {
        let mut storm = Storm::new(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15), 3, 3, 300);
        storm.run(8_000);
        println!("seed {:#x}: {:?}", storm.seed, storm.stats);
    }
}
