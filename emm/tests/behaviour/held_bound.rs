//! Held memory bounded by live memory, for random sequences: whatever a program allocates and
//! frees (sizes spread evenly in log scale from 256 bytes to 256 MiB, without a stream and on
//! one or three streams, up to 1 GiB live), `pool` never holds more device memory than 2.25
//! times the most the program had live, and `vmm-pool` 1.5 times, plus the pool's largest
//! growth step (128 MiB), on any of three passes of the sequence in a row: what they hold does
//! not grow with what they have seen.
//!
//! CI draws a fresh seed each run and prints it (`PROPTEST_RNG_SEED` reruns one). With
//! `PROPTEST_CASES=2000`, `pool` passes seeds 1 to 16 (seeds 5 and 9 found sequences where a
//! small block on a stream, placed in a large wholly free chunk of the stream's, kept the
//! chunk from going back before
//! a larger request grew the pool; such a block now comes from a partly used chunk:
//! `pools::a_small_block_on_a_stream_leaves_its_large_free_chunk_whole`). `vmm-pool` passes
//! seeds 1 to 16 (seed 11 found a sequence where a stream grew in place by 436 MiB while the
//! shared arena kept 375 MiB of wholly free pieces, too short for the request, and held 883 MB
//! for 490 MB live; those pieces now go back first:
//! `pools::vmm_pool_a_stream_growing_in_place_gives_back_the_shared_free_pieces`). Its bound
//! at 1.25 times instead of 1.5 fails seed 1.
//! A sequence over its bound is written out with `EMM_HELD_BOUND_DUMP` ([`dump`]).
//!
//! Such sequences are harsher than real programs: over 600 of them (`PROPTEST_CASES=300`) the
//! pool held a median 1.30 - 1.37 times peak live, 1.56 - 1.66 at the 95th percentile and
//! at most 2.01, per pass; a pool that kept every freed block on its stream filled the 16 GiB
//! device. Large blocks freed at random and split by smaller ones leave holes between live
//! blocks; `vmm-pool` maps its memory in pieces (a sixteenth of each growth, at least 2 MiB)
//! and gives back those that holes leave free, so its bound is the tighter. The trace corpus holds every manager to tighter bounds
//! on real programs (`integration/tests/traces.rs`).

use std::sync::Arc;

use driver_mock::{SimConfig, SimDriver};
use emm::contract::MemoryKind;
use emm::replay::{Action, ReplayEvent, Replayer};
use proptest::prelude::*;

use crate::common::runtime_with;

/// The most bytes live at once in a sequence.
const CAP: usize = 1 << 30;

/// One step of a program: allocate (size exponent in tenths of a power of two, and the stream:
/// none, or one of three) or free the live allocation at an index.
#[derive(Clone, Debug)]
enum Step {
    Alloc {
        log2_tenths: u16,
        stream: Option<u8>,
    },
    Free(usize),
}

/// A step whose allocations are made on streams `streams` (`0..0`: none on a stream).
fn step(streams: std::ops::Range<u8>) -> impl Strategy<Value = Step> {
    let on = if streams.is_empty() {
        Just(None).boxed()
    } else {
        prop::option::of(streams).boxed()
    };
    prop_oneof![
        3 => (80u16..=280, on)
            .prop_map(|(log2_tenths, stream)| Step::Alloc { log2_tenths, stream }),
        2 => any::<usize>().prop_map(Step::Free),
    ]
}

/// The steps as a log: allocations that would bring live bytes past [`CAP`] are left out.
fn events(steps: &[Step]) -> Vec<ReplayEvent> {
    let mut live: Vec<(u64, usize, Option<u64>)> = Vec::new();
    let (mut bytes, mut next, mut out) = (0usize, 1u64, Vec::new());
    for s in steps {
        match *s {
            Step::Alloc {
                log2_tenths,
                stream,
            } => {
                let size = 2f64.powf(f64::from(log2_tenths) / 10.0) as usize;
                if bytes + size > CAP {
                    continue;
                }
                // Recorded handles 0 (the legacy stream) and two streams of their own.
                let stream = stream.map(|s| [0u64, 0x100, 0x200][s as usize]);
                out.push(ReplayEvent {
                    action: Action::Allocate,
                    ptr: next,
                    size,
                    stream,
                    kind: MemoryKind::Device,
                    at: None,
                    reached: None,
                    elapsed: None,
                });
                live.push((next, size, stream));
                bytes += size;
                next += 1;
            }
            Step::Free(i) if !live.is_empty() => {
                let (ptr, size, stream) = live.swap_remove(i % live.len());
                bytes -= size;
                out.push(ReplayEvent {
                    action: Action::Free,
                    ptr,
                    size,
                    stream,
                    kind: MemoryKind::Device,
                    at: None,
                    reached: None,
                    elapsed: None,
                });
            }
            Step::Free(_) => {}
        }
    }
    out
}

fn held_stays_bounded(manager: &str, steps: &[Step]) -> Result<(), TestCaseError> {
    let events = events(steps);
    let sim = Arc::new(SimDriver::new(SimConfig::single(16 << 30)));
    let rt = runtime_with(&sim, manager);
    let ctx = rt.context(0).unwrap();
    let mut replayer = Replayer::new(&ctx).unwrap();
    // The simulated GPU keeps up with the program: streams' queued work runs between events.
    let mut run = || {
        sim.run_streams();
    };
    for pass in 1..=PASSES {
        let r = replayer.pass_with(&events, &mut run).unwrap();
        prop_assert_eq!(r.failures, 0, "{}: pass {}: {:?}", manager, pass, r);
        let bound = r.peak_live_bytes * share(manager) / 4 + SLACK;
        if r.peak_held_bytes > bound {
            dump(manager, &events);
        }
        prop_assert!(
            r.peak_held_bytes <= bound,
            "{}: pass {}: held {} bytes for {} live (bound {})",
            manager,
            pass,
            r.peak_held_bytes,
            r.peak_live_bytes,
            bound
        );
    }
    Ok(())
}

/// With `EMM_HELD_BOUND_DUMP` set to a directory, a sequence over its bound is written there
/// as a log the replay tool reads (`cargo run --release -p integration --example replay --
/// FILE --manager pool --passes 3 --device-memory 16GiB`), one file per manager, the last
/// (the most shrunk) sequence kept.
fn dump(manager: &str, events: &[ReplayEvent]) {
    let Some(dir) = std::env::var_os("EMM_HELD_BOUND_DUMP") else {
        return;
    };
    let mut log = String::from("Thread,Time,Action,Pointer,Size,Stream,Kind\n");
    for (i, e) in events.iter().enumerate() {
        let action = match e.action {
            Action::Allocate => "allocate",
            Action::Free => "free",
        };
        let stream = e.stream.map_or("-".to_string(), |s| format!("{s:#x}"));
        log += &format!("0,{i},{action},{:#x},{},{stream},device\n", e.ptr, e.size);
    }
    let path = std::path::Path::new(&dir).join(format!("held-bound-{manager}.csv"));
    std::fs::write(&path, log).expect("the dump directory is writable");
}

/// Passes of each sequence: held memory must stay within the bound on every one, not only on
/// a fresh pool.
const PASSES: usize = 3;

/// The bound's share of live bytes, in quarters: 2.25 for `pool`, 1.5 for `vmm-pool`.
fn share(manager: &str) -> usize {
    if manager == "vmm-pool" { 6 } else { 9 }
}

/// What the bound allows beyond its share of live bytes: the pool's largest growth step.
const SLACK: usize = 128 << 20;

proptest! {
    #![proptest_config(ProptestConfig {
        cases: crate::common::cases(if cfg!(miri) { 2 } else { 48 }),
        failure_persistence: None,
        rng_seed: crate::common::seed(),
        ..ProptestConfig::default()
    })]

    #[test]
    fn pool_holds_what_its_live_blocks_need_one_stream(steps in prop::collection::vec(step(0..1), 1..400)) {
        held_stays_bounded("pool", &steps)?;
    }

    #[test]
    fn pool_holds_what_its_live_blocks_need_three_streams(steps in prop::collection::vec(step(0..3), 1..400)) {
        held_stays_bounded("pool", &steps)?;
    }

    #[test]
    fn vmm_pool_holds_what_its_live_blocks_need(steps in prop::collection::vec(step(0..3), 1..400)) {
        held_stays_bounded("vmm-pool", &steps)?;
    }
}
