//! Graph capture under every shipped manager, for random programs (property test): captures
//! through graph pools, launches, ordinary allocations and frees on three streams, and graphs
//! dropped, interleaved. Checked after every step: no two live allocations overlap, and no
//! ordinary allocation overlaps memory a live graph writes when it is launched (the blocks its
//! capture allocated, freed in it or not); every launch writes what its capture recorded; and
//! once everything is dropped and the runtime gone, the simulated machine has nothing left.
//!
//! 48 cases per manager; `PROPTEST_CASES=N` for more.

use std::collections::BTreeMap;
use std::sync::Arc;

use driver_mock::{Op, SimConfig, SimDriver};
use emm::driver_sys::{CaptureMode, StreamHandle};
use emm::{Context, EmmError, Graph, MemoryPointer, Stream};
use proptest::prelude::*;

use crate::common::runtime_with;

#[derive(Clone, Debug)]
enum Step {
    /// `memalloc_on` (or `memalloc` for stream 3) of `2^log2` bytes.
    Alloc { log2: u8, stream: u8 },
    /// Drops the live allocation at an index.
    Free(usize),
    /// Captures on a stream: allocates blocks of the sizes given, drops those whose flag is
    /// set (within the capture), sets the rest to a value.
    Capture { stream: u8, blocks: Vec<(u8, bool)> },
    /// Launches the graph at an index and waits for it.
    Launch(usize),
    /// Drops the graph at an index with its kept blocks.
    DropGraph(usize),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (8u8..=21, 0u8..4).prop_map(|(log2, stream)| Step::Alloc { log2, stream }),
        3 => any::<usize>().prop_map(Step::Free),
        2 => (0u8..3, prop::collection::vec((8u8..=21, any::<bool>()), 1..5))
            .prop_map(|(stream, blocks)| Step::Capture { stream, blocks }),
        2 => any::<usize>().prop_map(Step::Launch),
        1 => any::<usize>().prop_map(Step::DropGraph),
    ]
}

struct Captured {
    graph: Graph,
    stream: usize,
    /// The blocks kept after the capture, and the value the graph sets them to.
    kept: Vec<(MemoryPointer, u8)>,
    /// Every range the capture allocated, kept or not: the graph writes them at launch.
    ranges: Vec<(u64, u64)>,
}

fn range(m: &MemoryPointer) -> (u64, u64) {
    let at = m.device_ptr().0;
    (at, at + m.size() as u64)
}

fn check(live: &[MemoryPointer], graphs: &[Captured]) -> Result<(), TestCaseError> {
    let mut owners: BTreeMap<u64, (u64, String)> = BTreeMap::new();
    let mut claim = |r: (u64, u64), who: String| -> Result<(), TestCaseError> {
        if let Some((_, (end, other))) = owners.range(..r.1).next_back()
            && *end > r.0
        {
            return Err(TestCaseError::fail(format!(
                "{who} at {r:x?} overlaps {other}"
            )));
        }
        if let Some((&start, (_, other))) = owners.range(r.0..).next()
            && start < r.1
        {
            return Err(TestCaseError::fail(format!(
                "{who} at {r:x?} overlaps {other}"
            )));
        }
        owners.insert(r.0, (r.1, who));
        Ok(())
    };
    for (i, m) in live.iter().enumerate() {
        claim(range(m), format!("live allocation {i}"))?;
    }
    // Blocks a graph kept are inside its ranges; its ranges may share memory among themselves
    // (a block freed in the capture is reused in it), never with anything else.
    for (g, c) in graphs.iter().enumerate() {
        let mut merged: Vec<(u64, u64)> = c.ranges.clone();
        merged.sort_unstable();
        let mut spans: Vec<(u64, u64)> = Vec::new();
        for r in merged {
            match spans.last_mut() {
                Some(last) if r.0 <= last.1 => last.1 = last.1.max(r.1),
                _ => spans.push(r),
            }
        }
        for s in spans {
            claim(s, format!("graph {g}'s memory"))?;
        }
        for (m, _) in &c.kept {
            let r = range(m);
            prop_assert!(
                c.ranges.iter().any(|&x| x.0 <= r.0 && r.1 <= x.1),
                "a kept block lies in its capture's ranges"
            );
        }
    }
    Ok(())
}

fn run(manager: &str, steps: &[Step]) -> Result<(), TestCaseError> {
    let sim = Arc::new(SimDriver::new(SimConfig::default()));
    {
        let rt = runtime_with(&sim, manager);
        let ctx: Context = rt.context(0).unwrap();
        let streams: Vec<Stream> = (0..3).map(|_| ctx.create_stream().unwrap()).collect();
        let mut live: Vec<MemoryPointer> = Vec::new();
        let mut graphs: Vec<Captured> = Vec::new();
        let mut next_value = 1u8;
        for s in steps {
            match s {
                Step::Alloc { log2, stream } => {
                    let bytes = 1usize << log2;
                    let m = match streams.get(*stream as usize) {
                        Some(st) => ctx.memalloc_on(bytes, st).unwrap(),
                        None => ctx.memalloc(bytes).unwrap(),
                    };
                    live.push(m);
                }
                Step::Free(i) if !live.is_empty() => {
                    live.swap_remove(i % live.len());
                }
                Step::Capture { stream, blocks } => {
                    let value = next_value;
                    next_value = next_value % 250 + 1;
                    let st = &streams[*stream as usize];
                    let (graph, (kept, ranges)) = ctx
                        .capture(st, CaptureMode::Global, |s| {
                            let (mut kept, mut ranges) = (Vec::new(), Vec::new());
                            for &(log2, drop_it) in blocks {
                                let m = ctx.memalloc_on(1 << log2, s)?;
                                ranges.push(range(&m));
                                ctx.memset_async(&m, value, s)?.wait()?;
                                if !drop_it {
                                    kept.push((m, value));
                                }
                            }
                            Ok((kept, ranges))
                        })
                        .unwrap();
                    graphs.push(Captured {
                        graph,
                        stream: *stream as usize,
                        kept,
                        ranges,
                    });
                }
                Step::Launch(i) if !graphs.is_empty() => {
                    let c = &graphs[i % graphs.len()];
                    for (m, _) in &c.kept {
                        ctx.memset(m, 0, m.size()).unwrap();
                    }
                    c.graph.launch(&streams[c.stream]).unwrap();
                    streams[c.stream].synchronize().unwrap();
                    for (m, value) in &c.kept {
                        let mut back = vec![0u8; m.size()];
                        ctx.copy_to_host(&mut back, m).unwrap();
                        prop_assert!(
                            back.iter().all(|b| b == value),
                            "the launch set its block to {value}"
                        );
                    }
                }
                Step::DropGraph(i) if !graphs.is_empty() => {
                    let c = graphs.swap_remove(i % graphs.len());
                    drop(c);
                }
                _ => {}
            }
            check(&live, &graphs)?;
        }
        drop(graphs);
        drop(live);
        for s in &streams {
            s.synchronize().unwrap();
        }
        drop(streams);
        ctx.flush_deallocations().unwrap();
    }
    sim.run_streams();
    let leaks = sim.leak_report();
    prop_assert!(leaks.is_clean(), "left behind under {manager}: {leaks}");
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: crate::common::cases(48), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn captures_replays_and_ordinary_memory_never_share_a_block(
        steps in prop::collection::vec(step(), 1..40),
    ) {
        for manager in [
            emm::plugin::DEFAULT_MANAGER,
            emm::plugin::POOL_MANAGER,
            emm::plugin::VMM_POOL_MANAGER,
            emm::plugin::ASYNC_POOL_MANAGER,
            emm::plugin::ASYNC_POOL_IPC_MANAGER,
            emm::plugin::ASYNC_POOL_MANAGED_MANAGER,
        ] {
            run(manager, &steps)?;
        }
    }
}

/// With capture pools on, an allocation on the legacy default stream asks the driver nothing
/// about captures: that stream is never captured, and the question costs a driver call per
/// allocation (CuPy and PyTorch allocate there by default). A created stream is still asked,
/// once an allocation.
#[test]
fn the_legacy_stream_is_not_asked_about_captures() {
    for manager in [
        emm::plugin::POOL_MANAGER,
        emm::plugin::VMM_POOL_MANAGER,
        emm::plugin::ASYNC_POOL_MANAGER,
    ] {
        let sim = Arc::new(SimDriver::new(SimConfig::default()));
        let rt = runtime_with(&sim, manager);
        let ctx: Context = rt.context(0).unwrap();
        ctx.enable_capture_pools();
        let stream = ctx.create_stream().unwrap();
        // SAFETY: the legacy default stream outlives the runtime.
        let on_legacy = |legacy| unsafe { ctx.memalloc_on_raw(4096, legacy) }.unwrap();
        // The first allocations grow the pool, a slow path that asks (growth is refused on a
        // captured stream); held at once, each stream grows its own, and what follows is
        // served from what they left.
        let warm = [
            ctx.memalloc_on(4096, &stream).unwrap(),
            on_legacy(StreamHandle::NULL),
            on_legacy(StreamHandle::LEGACY),
        ];
        drop(warm);
        sim.clear_calls();
        for legacy in [StreamHandle::NULL, StreamHandle::LEGACY] {
            for _ in 0..4 {
                drop(on_legacy(legacy));
            }
        }
        assert_eq!(
            sim.count(Op::StreamGetCaptureInfo),
            0,
            "{manager}: allocations on the legacy stream asked about captures"
        );
        drop(ctx.memalloc_on(4096, &stream).unwrap());
        assert_eq!(
            sim.count(Op::StreamGetCaptureInfo),
            1,
            "{manager}: an allocation on a created stream asks once"
        );
    }
}

/// A graph keeps the memory its captured work uses: a block set by a captured `memset_async`
/// and dropped after the capture is not handed to the next allocation while the graph lives,
/// so a launch writes the graph's block, not the next owner's (under `pool` the freed block
/// came back at once, and a launch overwrote it). Once the graph is dropped, the block goes.
/// Work queued on the legacy default stream asks the driver nothing about captures either
/// (a queued copy asks whether its stream records into a graph before it marks the copy's end
/// with an event): the driver never captures that stream.
#[test]
fn work_on_the_legacy_stream_is_not_asked_about_captures() {
    let sim = Arc::new(SimDriver::new(SimConfig::default()));
    let rt = runtime_with(&sim, emm::plugin::DEFAULT_MANAGER);
    let ctx: Context = rt.context(0).unwrap();
    let (a, b) = (ctx.memalloc(4096).unwrap(), ctx.memalloc(4096).unwrap());
    let created = ctx.create_stream().unwrap();
    for (stream, asked) in [
        (ctx.legacy_default_stream(), 0),
        (ctx.default_stream(), 0),
        (created, 1),
    ] {
        sim.clear_calls();
        ctx.copy_device_async(&a, &b, &stream)
            .unwrap()
            .wait()
            .unwrap();
        assert!(sim.count(Op::MemcpyDtoDAsync) == 1, "the copy was queued");
        assert_eq!(
            sim.count(Op::StreamGetCaptureInfo),
            asked,
            "a copy on {:#x} asked about captures",
            stream.handle().raw()
        );
    }
}

#[test]
fn a_graph_keeps_the_memory_its_captured_work_writes() {
    for manager in [
        emm::plugin::POOL_MANAGER,
        emm::plugin::VMM_POOL_MANAGER,
        emm::plugin::ASYNC_POOL_MANAGER,
        "default",
    ] {
        let sim = Arc::new(SimDriver::new(SimConfig::default()));
        let rt = runtime_with(&sim, manager);
        let ctx: Context = rt.context(0).unwrap();
        let stream = ctx.create_stream().unwrap();
        let m = ctx.memalloc(4096).unwrap();
        let at = m.device_ptr().0;
        let (graph, ()) = ctx
            .capture(&stream, CaptureMode::Global, |s| {
                ctx.memset_async(&m, 0xAB, s)?.wait()?;
                Ok(())
            })
            .unwrap();
        drop(m);
        ctx.flush_deallocations().unwrap();
        let victim = ctx.memalloc(4096).unwrap();
        assert_ne!(
            victim.device_ptr().0,
            at,
            "{manager}: the graph's block went to another"
        );
        ctx.memset(&victim, 0, 4096).unwrap();
        graph.launch(&stream).unwrap();
        stream.synchronize().unwrap();
        let mut back = vec![0xFFu8; 4096];
        ctx.copy_to_host(&mut back, &victim).unwrap();
        assert!(
            back.iter().all(|&b| b == 0),
            "{manager}: a launch wrote another's memory"
        );
        drop((graph, victim));
        drop(stream);
        drop(ctx);
        drop(rt);
        let leaks = sim.leak_report();
        assert!(leaks.is_clean(), "{manager}: {leaks}");
    }
}

/// A graph whose memory a reset of its context freed is not launched: the launch would write
/// freed addresses, which the manager hands to the next allocation. It is refused as stale,
/// and no launch reaches the driver.
#[test]
fn a_graph_over_memory_a_reset_freed_is_refused() {
    for manager in [emm::plugin::POOL_MANAGER, "default"] {
        let sim = Arc::new(SimDriver::new(SimConfig::default()));
        let rt = runtime_with(&sim, manager);
        let ctx: Context = rt.context(0).unwrap();
        let stream = ctx.create_stream().unwrap();
        let m = ctx.memalloc(4096).unwrap();
        let (graph, ()) = ctx
            .capture(&stream, CaptureMode::Global, |s| {
                ctx.memset_async(&m, 0xAB, s)?.wait()?;
                Ok(())
            })
            .unwrap();
        ctx.reset().unwrap();
        let e = graph
            .launch(&stream)
            .expect_err("the graph's memory is gone");
        assert!(matches!(e, EmmError::Stale { .. }), "{manager}: {e}");
        let launches = (sim.calls().into_iter())
            .filter(|c| c.op == Op::GraphLaunch)
            .count();
        assert_eq!(launches, 0, "{manager}");
    }
}

/// A capture pool whose stream its owner (another library) destroyed after the capture ended
/// is let go: the driver no longer knows the handle, which can only mean the capture ended.
/// Before, the refused query counted the pool open for ever, so every free went the slow way
/// and `release_capture_pools` kept its memory.
#[test]
fn a_capture_pool_whose_stream_is_destroyed_is_let_go() {
    use emm::driver_sys::Driver;
    for manager in [
        emm::plugin::POOL_MANAGER,
        emm::plugin::VMM_POOL_MANAGER,
        emm::plugin::ASYNC_POOL_MANAGER,
    ] {
        let sim = Arc::new(SimDriver::new(SimConfig::default()));
        let rt = runtime_with(&sim, manager);
        let ctx: Context = rt.context(0).unwrap();
        ctx.enable_capture_pools();
        let theirs = sim.stream_create(ctx.handle(), 1).unwrap();
        sim.stream_begin_capture(ctx.handle(), theirs, CaptureMode::Relaxed)
            .unwrap();
        // SAFETY: the stream lives until the memory is dropped, below.
        let mem = unsafe { ctx.memalloc_on_raw(4096, theirs) }.unwrap();
        assert!(
            ctx.capture_pools_open(),
            "{manager}: the capture's pool is open"
        );
        let graph = sim.stream_end_capture(ctx.handle(), theirs).unwrap();
        drop(mem);
        ctx.trim().unwrap();
        // SAFETY: made above; its memory is dropped and trimmed, nothing is queued on it.
        unsafe { sim.stream_destroy(ctx.handle(), theirs) }.unwrap();
        assert!(
            !ctx.capture_pools_open(),
            "{manager}: a pool of a destroyed stream counted open"
        );
        assert_eq!(ctx.release_capture_pools(), 1, "{manager}");
        // SAFETY: the graph made above, destroyed once.
        unsafe { sim.graph_destroy(ctx.handle(), graph) }.unwrap();
    }
}
