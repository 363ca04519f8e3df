//! The pool's free space, block by block, agrees with its figures after any sequence of
//! allocations, frees and trims (property test): the free blocks add up to what the pool
//! holds and does not lend, the largest is the largest the figures name, and the derived
//! figures (histogram, fragmentation, what a request size cannot use) are consistent.
//! `PROPTEST_CASES` runs more cases (CI: 64).

use std::sync::Arc;

use driver_mock::{SimConfig, SimDriver};
use emm::contract::FreeSpace;
use proptest::prelude::*;

use crate::common::{cases, runtime_with, seed};

#[derive(Clone, Debug)]
enum Step {
    /// Allocate 2^(tenths / 10) bytes, on the stream when `on_stream`.
    Alloc {
        log2_tenths: u16,
        on_stream: bool,
    },
    /// Free the live allocation at this index (modulo their count).
    Free(usize),
    Trim,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        5 => (80u16..=260, any::<bool>())
            .prop_map(|(log2_tenths, on_stream)| Step::Alloc { log2_tenths, on_stream }),
        4 => any::<usize>().prop_map(Step::Free),
        1 => Just(Step::Trim),
    ]
}

/// The figures any free space must satisfy on its own.
fn consistent(space: &FreeSpace) {
    let total = space.total_bytes();
    assert!(
        space.blocks.windows(2).all(|w| w[0] >= w[1]),
        "largest first"
    );
    assert!(space.blocks.iter().all(|&b| b > 0));
    let histogram = space.histogram();
    assert_eq!(
        histogram.iter().map(|h| h.1).sum::<usize>(),
        space.blocks.len()
    );
    assert_eq!(histogram.iter().map(|h| h.2).sum::<usize>(), total);
    for &(upper, count, bytes) in &histogram {
        assert!(upper.is_power_of_two() && count > 0);
        assert!(
            bytes <= count * upper && bytes > count * (upper / 2),
            "{histogram:?}"
        );
    }
    assert!(histogram.windows(2).all(|w| w[0].0 < w[1].0));
    let frag = space.fragmentation();
    assert!((0.0..=1.0).contains(&frag));
    assert_eq!(space.unusable_for(0), total);
    assert_eq!(space.unusable_for(1), 0);
    // Requests as large as the largest block can use the blocks of that size whole, nothing
    // smaller.
    if let Some(&largest) = space.blocks.first() {
        let of_largest = space.blocks.iter().filter(|&&b| b == largest).count();
        assert_eq!(space.unusable_for(largest), total - largest * of_largest);
        assert_eq!(space.unusable_for(largest + 1), total);
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(64),
        rng_seed: seed(),
        ..ProptestConfig::default()
    })]

    #[test]
    fn free_blocks_add_up_to_what_the_pool_holds_and_does_not_lend(
        steps in prop::collection::vec(step(), 1..60),
    ) {
        for manager in ["pool", "vmm-pool"] {
            let sim = Arc::new(SimDriver::new(SimConfig::single(4 << 30)));
            let rt = runtime_with(&sim, manager);
            let ctx = rt.context(0).unwrap();
            let stream = ctx.create_stream().unwrap();
            let mut live = Vec::new();
            for step in &steps {
                match *step {
                    Step::Alloc { log2_tenths, on_stream } => {
                        let size = 2f64.powf(f64::from(log2_tenths) / 10.0) as usize;
                        let made = if on_stream {
                            ctx.memalloc_on(size, &stream)
                        } else {
                            ctx.memalloc(size)
                        };
                        live.push(made.unwrap());
                    }
                    Step::Free(i) if !live.is_empty() => {
                        let n = live.len();
                        live.swap_remove(i % n);
                    }
                    Step::Free(_) => {}
                    Step::Trim => {
                        ctx.trim().unwrap();
                    }
                }
                // Stream-ordered frees wait for the stream: once it is done, none is pending.
                stream.synchronize().unwrap();
                ctx.flush_deallocations().unwrap();
                let space = ctx.free_space().expect("a pool tells its free space");
                let stats = ctx.pool_stats().device.unwrap();
                consistent(&space);
                prop_assert_eq!(
                    space.total_bytes(),
                    stats.held_bytes - stats.in_use_bytes,
                    "{}: {:?}",
                    manager,
                    stats
                );
                prop_assert_eq!(Some(space.largest_bytes()), stats.largest_free_bytes);
            }
        }
    }
}

#[test]
fn managers_without_a_pool_of_their_own_cannot_tell() {
    for manager in ["default", "async-pool"] {
        let sim = Arc::new(SimDriver::new(SimConfig::single(1 << 30)));
        let rt = runtime_with(&sim, manager);
        let ctx = rt.context(0).unwrap();
        let _mem = ctx.memalloc(1 << 20).unwrap();
        assert_eq!(ctx.free_space(), None, "{manager}");
    }
}

#[test]
fn the_histogram_and_unusable_bytes_of_known_blocks() {
    let space = FreeSpace::from_blocks(vec![3 << 20, 1 << 20, 0, 700, 1 << 20, 5000]);
    assert_eq!(space.blocks, vec![3 << 20, 1 << 20, 1 << 20, 5000, 700]);
    assert_eq!(
        space.histogram(),
        vec![
            (1024, 1, 700),
            (8192, 1, 5000),
            (1 << 20, 2, 2 << 20),
            (4 << 20, 1, 3 << 20)
        ]
    );
    // Requests of 2 MiB: one fits the 3 MiB block; everything else is too small.
    assert_eq!(space.unusable_for(2 << 20), (1 << 20) * 3 + 5700);
    assert_eq!(space.largest_bytes(), 3 << 20);
    let total = (5 << 20) + 5700;
    assert_eq!(space.total_bytes(), total);
    let frag = space.fragmentation();
    assert!((frag - (1.0 - (3 << 20) as f64 / total as f64)).abs() < 1e-12);
}
