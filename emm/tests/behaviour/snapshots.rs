//! Snapshots tell the truth (property test, every manager, with the `history` adaptor): after
//! any sequence of allocations (tagged, on the stream or not), frees, trims and flushes, each
//! segment's blocks cover it in address order, the segments add up to what the pool holds,
//! the blocks that are not in use to what it holds and does not lend, and the in-use blocks
//! are exactly the live allocations, with their sizes, streams and tags.
//! `PROPTEST_CASES` runs more cases (CI: 128).

use std::collections::BTreeMap;
use std::sync::Arc;

use driver_mock::{SimConfig, SimDriver};
use emm::contract::{BlockState, HistoryAction};
use emm::{Adaptor, Context, MemoryPointer, MemorySnapshot, Runtime, Stream, Tag};
use proptest::prelude::*;

use crate::common::{cases, seed};

const MANAGERS: [&str; 5] = [
    "default",
    "pool",
    "vmm-pool",
    "async-pool",
    "async-pool-managed",
];

#[derive(Clone, Debug)]
enum Step {
    /// Allocate 2^(tenths / 10) bytes under tag `tag`, on the stream when `on_stream`.
    Alloc {
        log2_tenths: u16,
        on_stream: bool,
        tag: usize,
    },
    /// Free the live allocation at this index (modulo their count).
    Free(usize),
    Trim,
    Flush,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => (80u16..=250, any::<bool>(), 0usize..3)
            .prop_map(|(log2_tenths, on_stream, tag)| Step::Alloc { log2_tenths, on_stream, tag }),
        4 => any::<usize>().prop_map(Step::Free),
        1 => Just(Step::Trim),
        1 => Just(Step::Flush),
    ]
}

fn with_history(sim: &Arc<SimDriver>, manager: &str) -> Runtime {
    Runtime::builder(sim.clone())
        .ignore_env()
        .memory_manager_name(manager)
        .adaptors(vec![Adaptor::History {
            events: 1 << 16,
            stacks: false,
        }])
        .build()
        .unwrap()
}

/// What the program believes is live: address -> (requested bytes, stream, tag).
type Truth = BTreeMap<u64, (usize, Option<u64>, Tag)>;

/// Runs `step` on `ctx` (allocations on `stream` where the step says so and a stream is
/// given), keeping `live` and `truth` up to date.
fn apply(
    ctx: &Context,
    stream: Option<&Stream>,
    step: &Step,
    tags: &[Tag; 3],
    live: &mut Vec<MemoryPointer>,
    truth: &mut Truth,
) {
    match *step {
        Step::Alloc {
            log2_tenths,
            on_stream,
            tag,
        } => {
            let size = 2f64.powf(f64::from(log2_tenths) / 10.0) as usize;
            let _tag = tags[tag].scope();
            let on = stream.filter(|_| on_stream);
            let made = match on {
                Some(s) => ctx.memalloc_on(size, s),
                None => ctx.memalloc(size),
            }
            .unwrap();
            let on = on.map(|s| s.handle().raw());
            truth.insert(made.device_ptr().0, (size, on, tags[tag]));
            live.push(made);
        }
        Step::Free(i) if !live.is_empty() => {
            let n = live.len();
            let gone = live.swap_remove(i % n);
            truth.remove(&gone.device_ptr().0);
        }
        Step::Free(_) => {}
        Step::Trim => {
            ctx.trim().unwrap();
        }
        Step::Flush => {
            if let Some(s) = stream {
                s.synchronize().unwrap();
            }
            ctx.flush_deallocations().unwrap();
        }
    }
}

/// Under `pool` and `vmm-pool` without the adaptor (their own rings of each thread's and
/// each stream shard's last events): every recorded in-use block is a live allocation with
/// its size, stream and tag, and the blocks tile the segments.
fn ring_only_agrees(steps: &[Step], manager: &str, tags: &[Tag; 3]) -> Result<(), TestCaseError> {
    let sim = Arc::new(SimDriver::new(SimConfig::single(4 << 30)));
    let rt = crate::common::runtime_with(&sim, manager);
    let ctx = rt.context(0).unwrap();
    let stream = ctx.create_stream().unwrap();
    let mut truth = Truth::new();
    let mut live = Vec::new();
    for step in steps {
        apply(&ctx, Some(&stream), step, tags, &mut live, &mut truth);
        let snapshot = ctx.snapshot();
        covered(&snapshot)?;
        for b in snapshot.blocks().filter(|b| b.state == BlockState::InUse) {
            if let Some(a) = &b.allocation {
                prop_assert_eq!(
                    truth.get(&b.address),
                    Some(&(a.requested, a.stream, a.tag)),
                    "{}",
                    manager
                );
            }
        }
        let stats = ctx.pool_stats().device.unwrap();
        let queued: usize = ctx.deallocations().map_or(0, |q| q.pending_bytes());
        prop_assert_eq!(
            snapshot.held_bytes(),
            stats.held_bytes + queued,
            "{}",
            manager
        );
    }
    Ok(())
}

/// Each segment's blocks cover it, in address order, with no gap and no overlap.
fn covered(snapshot: &MemorySnapshot) -> Result<(), TestCaseError> {
    for s in &snapshot.segments {
        let mut at = s.address;
        for b in &s.blocks {
            prop_assert_eq!(b.address, at, "a gap or an overlap in {:?}", s);
            prop_assert!(b.bytes > 0, "an empty block in {:?}", s);
            at += b.bytes as u64;
        }
        prop_assert_eq!(at, s.address + s.bytes as u64, "blocks short of {:?}", s);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(128),
        rng_seed: seed(),
        ..ProptestConfig::default()
    })]

    #[test]
    fn snapshots_agree_with_the_live_allocations_and_the_pool(
        steps in prop::collection::vec(step(), 1..50),
    ) {
        let tags = [Tag::named("numba"), Tag::named("cupy"), Tag::named("torch")];
        for manager in MANAGERS {
            let sim = Arc::new(SimDriver::new(SimConfig::single(4 << 30)));
            let rt = with_history(&sim, manager);
            let ctx = rt.context(0).unwrap();
            let stream = ctx.create_stream().unwrap();
            let mut truth = Truth::new();
            let mut live = Vec::new();
            for step in &steps {
                apply(&ctx, Some(&stream), step, &tags, &mut live, &mut truth);
                let snapshot = ctx.snapshot();
                prop_assert!(snapshot.history_on);
                covered(&snapshot)?;
                prop_assert!(snapshot.unplaced.is_empty(), "{}: {:?}", manager, snapshot.unplaced);
                // In use: exactly the live allocations, each in one block, none unrecorded.
                let mut seen = BTreeMap::new();
                for b in snapshot.blocks().filter(|b| b.state == BlockState::InUse) {
                    let a = b.allocation.as_ref();
                    prop_assert!(a.is_some(), "{}: in use and not recorded: {:?}", manager, b);
                    let a = a.unwrap();
                    prop_assert!(b.bytes >= a.requested, "{}: {:?}", manager, b);
                    seen.insert(b.address, (a.requested, a.stream, a.tag));
                }
                prop_assert_eq!(&seen, &truth, "{}", manager);
                let by_tag = snapshot.by_tag();
                prop_assert_eq!(
                    by_tag.iter().map(|t| t.bytes).sum::<usize>(),
                    truth.values().map(|t| t.0).sum::<usize>()
                );
                // The driver's own pool hides its segments: each allocation is one.
                prop_assert_eq!(snapshot.segments_known, !manager.starts_with("async-pool"));
                if let Some(stats) = ctx.pool_stats().device.filter(|_| snapshot.segments_known) {
                    // A pool lists its chunks: they add up to what it holds, and what is not
                    // lent is free, cached or waiting for its stream.
                    let queued: usize = ctx.deallocations().map_or(0, |q| q.pending_bytes());
                    let pending = snapshot.bytes_in(BlockState::PendingFree);
                    prop_assert_eq!(
                        snapshot.held_bytes(),
                        stats.held_bytes + queued,
                        "{}: {:?}",
                        manager,
                        stats
                    );
                    prop_assert!(pending >= queued, "{}", manager);
                    if let Some(space) = ctx.free_space() {
                        prop_assert_eq!(
                            snapshot.bytes_in(BlockState::Free)
                                + snapshot.bytes_in(BlockState::Cached),
                            space.total_bytes(),
                            "{}",
                            manager
                        );
                    }
                }
            }
            if manager.contains("pool") && !manager.starts_with("async") {
                ring_only_agrees(&steps, manager, &tags)?;
            }
            // The ring saw every allocation and free, in order.
            let history = ctx.snapshot().history;
            let allocs = history.iter().filter(|e| e.action == HistoryAction::Alloc).count();
            let frees = history.iter().filter(|e| e.action == HistoryAction::Free).count();
            prop_assert_eq!(allocs - frees, truth.len(), "{}", manager);
            prop_assert!(history.windows(2).all(|w| w[0].time_us <= w[1].time_us));
        }
    }
}

/// Without the `history` adaptor a pool keeps its own history, a ring of each thread's last
/// events: a snapshot still lists every segment and block, the recent allocations carry their
/// tags, and allocations whose events fell out of the window show as unrecorded in-use space.
#[test]
fn the_pools_own_history_covers_its_recent_allocations() {
    let sim = Arc::new(SimDriver::new(SimConfig::single(1 << 30)));
    let rt = crate::common::runtime_with(&sim, "pool");
    let ctx = rt.context(0).unwrap();
    let old = {
        let _t = Tag::named("weights").scope();
        ctx.memalloc(3 << 20).unwrap()
    };
    let recent = {
        let _t = Tag::named("activations").scope();
        ctx.memalloc(5 << 20).unwrap()
    };
    let tag_at = |snapshot: &MemorySnapshot, addr: u64| {
        snapshot.blocks().find(|b| b.address == addr).and_then(|b| {
            b.allocation
                .as_ref()
                .map(|a| (a.tag.name().to_string(), a.requested))
        })
    };
    let snapshot = ctx.snapshot();
    assert!(snapshot.history_on, "the pool's own history is always on");
    assert!(snapshot.unplaced.is_empty());
    assert_eq!(
        tag_at(&snapshot, old.device_ptr().0),
        Some(("weights".to_string(), 3 << 20))
    );
    assert_eq!(
        tag_at(&snapshot, recent.device_ptr().0),
        Some(("activations".to_string(), 5 << 20))
    );
    // Many pairs later the two allocations' events are out of the window: their blocks are
    // in use, unrecorded, and nothing else is.
    for _ in 0..1000 {
        drop(ctx.memalloc(256).unwrap());
    }
    let snapshot = ctx.snapshot();
    covered(&snapshot).unwrap();
    assert!(snapshot.unplaced.is_empty());
    assert_eq!(tag_at(&snapshot, old.device_ptr().0), None);
    assert_eq!(tag_at(&snapshot, recent.device_ptr().0), None);
    let stats = ctx.pool_stats().device.unwrap();
    assert_eq!(snapshot.held_bytes(), stats.held_bytes);
    assert_eq!(snapshot.bytes_in(BlockState::InUse), stats.in_use_bytes);
    assert!(snapshot.history.len() <= 128, "one thread's ring");
    assert!(
        snapshot.history.iter().all(|e| e.bytes == 256),
        "only the last pairs are in the window"
    );
}

/// The pool's own history has its stream-ordered allocations too, under `pool` and
/// `vmm-pool`: a block allocated on a stream (found in the stream's arena, or after a growth)
/// carries its stream, requested size and tag, and its free on the stream is an event with
/// the stream.
#[test]
fn the_pools_own_history_has_stream_ordered_allocations() {
    for manager in ["pool", "vmm-pool"] {
        let sim = Arc::new(SimDriver::new(SimConfig::single(1 << 30)));
        let rt = crate::common::runtime_with(&sim, manager);
        let ctx = rt.context(0).unwrap();
        let s = ctx.create_stream().unwrap();
        let raw = s.handle().raw();
        // The first grows the stream's arena; the second is found in it.
        let (grown, found) = {
            let _t = Tag::named("kv-cache").scope();
            (
                ctx.memalloc_on(3 << 20, &s).unwrap(),
                ctx.memalloc_on(1000, &s).unwrap(),
            )
        };
        let snapshot = ctx.snapshot();
        for (mem, bytes) in [(&grown, 3 << 20), (&found, 1000)] {
            let info = snapshot
                .blocks()
                .find(|b| b.address == mem.device_ptr().0)
                .and_then(|b| b.allocation.clone())
                .unwrap_or_else(|| panic!("{manager}: no record of a stream allocation"));
            assert_eq!(
                (info.requested, info.stream, &*info.tag.name()),
                (bytes, Some(raw), "kv-cache"),
                "{manager}"
            );
        }
        let addr = found.device_ptr().0;
        drop(found);
        let snapshot = ctx.snapshot();
        assert!(
            snapshot
                .history
                .iter()
                .any(|e| e.action == HistoryAction::Free
                    && e.address == addr
                    && e.stream == Some(raw)
                    && e.bytes == 1000),
            "{manager}: the free on the stream is in the history: {:?}",
            snapshot.history
        );
        drop(grown);
    }
}

/// The out-of-memory report names who holds the live memory, largest first.
#[test]
fn the_out_of_memory_report_names_the_largest_holders_by_tag() {
    let sim = Arc::new(SimDriver::new(SimConfig::single(64 << 20)));
    let rt = with_history(&sim, "pool");
    let ctx = rt.context(0).unwrap();
    let held: Vec<_> = [
        ("torch", 24usize << 20),
        ("cupy", 8 << 20),
        ("torch", 16 << 20),
    ]
    .into_iter()
    .map(|(tag, bytes)| {
        let _t = Tag::named(tag).scope();
        ctx.memalloc(bytes).unwrap()
    })
    .collect();
    let err = ctx.memalloc(32 << 20).unwrap_err();
    let report = err.out_of_memory_report().expect("a report");
    let tags: Vec<_> = report
        .live_by_tag
        .iter()
        .map(|t| (t.tag.as_str(), t.bytes, t.allocations, t.largest))
        .collect();
    assert_eq!(
        tags,
        [
            ("torch", 40 << 20, 2, 24 << 20),
            ("cupy", 8 << 20, 1, 8 << 20)
        ]
    );
    let text = err.to_string();
    assert!(
        text.contains("live memory by tag: torch 40.0 MiB in 2 allocations (largest 24.0 MiB); cupy 8.0 MiB in 1 allocation"),
        "{text}"
    );
    // The failure is in the history too.
    let last = ctx.snapshot().history.pop().unwrap();
    assert_eq!(last.action, HistoryAction::OutOfMemory);
    assert_eq!(last.bytes, 32 << 20);
    drop(held);
}

/// The exports: PyTorch's format names every block, with its state and frames, and the
/// history as a device trace; the HTML page draws every segment.
#[test]
fn exports_carry_every_segment_block_and_event() {
    let sim = Arc::new(SimDriver::new(SimConfig::single(1 << 30)));
    let rt = Runtime::builder(sim.clone())
        .ignore_env()
        .memory_manager_name("pool")
        .adaptors(vec![Adaptor::parse("history-stacks=100").unwrap()])
        .build()
        .unwrap();
    let ctx = rt.context(0).unwrap();
    let _t = Tag::named("embedder").scope();
    let kept = ctx.memalloc(3 << 20).unwrap();
    drop(ctx.memalloc(1000).unwrap());
    let snapshot = ctx.snapshot();
    let block = snapshot
        .blocks()
        .find(|b| b.address == kept.device_ptr().0)
        .unwrap();
    let stack = block.allocation.as_ref().unwrap().stack.as_deref().unwrap();
    assert!(stack.lines().count() >= 3, "{stack}");
    // A stripped binary (the GPU bundle's) captures the frames but cannot name them.
    let symbolised = !stack.contains("<unknown>");
    assert!(
        !symbolised || stack.contains("exports_carry_every_segment_block_and_event"),
        "{stack}"
    );
    let json = snapshot.to_torch_json();
    assert_eq!(
        json.matches("\"total_size\"").count(),
        snapshot.segments.len()
    );
    assert_eq!(
        json.matches("\"requested_size\"").count(),
        snapshot.segments.len() + snapshot.blocks().count()
    );
    assert!(json.contains(&format!(
        "{{\"address\":{},\"size\":{},\"requested_size\":{},\"state\":\"active_allocated\"",
        kept.device_ptr().0,
        block.bytes,
        3 << 20
    )));
    assert_eq!(json.matches("\"action\":\"alloc\"").count(), 2);
    assert_eq!(json.matches("\"action\":\"free_requested\"").count(), 1);
    assert!(json.contains("\"embedder\":{\"bytes\":3145728,\"allocations\":1}"));
    let html = snapshot.to_html();
    assert_eq!(html.matches("<svg").count(), snapshot.segments.len());
    assert!(html.contains("embedder"));
}

/// A snapshot of a million live blocks takes well under a second on the simulator (the
/// issue's target; the benchmark measures it, this only checks that it is whole).
#[test]
fn a_snapshot_of_many_blocks_is_whole() {
    let sim = Arc::new(SimDriver::new(SimConfig::single(4 << 30)));
    let rt = with_history(&sim, "pool");
    let ctx = rt.context(0).unwrap();
    let live: Vec<_> = (0..20_000).map(|_| ctx.memalloc(512).unwrap()).collect();
    let snapshot = ctx.snapshot();
    let recorded = snapshot.blocks().filter(|b| b.allocation.is_some()).count();
    assert_eq!(recorded, live.len());
}

/// A graph pool's segment shows its carved blocks, marked with the pool, in place of the one
/// in-use block the manager sees, under every manager; its allocation stays on the first.
#[test]
fn graph_pools_show_their_carved_blocks() {
    for manager in MANAGERS {
        let sim = Arc::new(SimDriver::new(SimConfig::single(1 << 30)));
        let rt = with_history(&sim, manager);
        let ctx = rt.context(0).unwrap();
        let stream = ctx.create_stream().unwrap();
        let (graph, kept) = ctx
            .capture(&stream, emm::driver_sys::CaptureMode::Global, |s| {
                let kept = ctx.memalloc_on(4096, s)?;
                drop(ctx.memalloc_on(100_000, s)?);
                Ok(kept)
            })
            .unwrap();
        let pool = graph.pool().id();
        let snapshot = ctx.snapshot();
        covered(&snapshot).unwrap();
        let carved: Vec<_> = snapshot
            .blocks()
            .filter(|b| b.graph_pool == Some(pool))
            .collect();
        let in_use: Vec<_> = carved
            .iter()
            .filter(|b| b.state == BlockState::InUse)
            .map(|b| (b.address, b.bytes))
            .collect();
        assert_eq!(in_use, [(kept.device_ptr().0, 4096)], "{manager}");
        // The pool's segments, and the manager's rounding past them.
        let held: usize = carved.iter().map(|b| b.bytes).sum();
        assert!(held >= graph.pool().stats().held_bytes, "{manager}");
        assert!(
            carved.iter().any(|b| b.state == BlockState::Cached),
            "{manager}: the freed block stays with the pool"
        );
        assert!(
            carved[0].allocation.is_some(),
            "{manager}: the segment's allocation"
        );
        drop(kept);
        drop(graph);
        let after = ctx.snapshot();
        assert!(after.blocks().all(|b| b.graph_pool.is_none()), "{manager}");
    }
}

/// The pool's rings are per thread: with threads allocating and freeing each other's memory,
/// the merged window still names only live allocations, each with its thread's tag, and
/// leaves nothing outside the segments. The main thread frees fewer blocks than a ring holds,
/// so that its ring, all frees, never fills and bounds the window: a worker's ring does, and
/// the window holds that ring's live allocations however the threads were scheduled.
#[test]
fn the_pools_own_history_merges_the_threads_rings() {
    let sim = Arc::new(SimDriver::new(SimConfig::single(1 << 30)));
    let rt = crate::common::runtime_with(&sim, "pool");
    let ctx = rt.context(0).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let kept: Vec<_> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..4)
            .map(|t| {
                let (ctx, tx) = (ctx.clone(), tx.clone());
                s.spawn(move || {
                    let tag = Tag::named(&format!("thread-{t}"));
                    let _t = tag.scope();
                    let mut kept = Vec::new();
                    for i in 0..300usize {
                        let m = ctx.memalloc(256 << (i % 9)).unwrap();
                        match i % 12 {
                            0 | 3 | 6 | 9 => kept.push((m, tag)),
                            // Freed by the main thread: 25 blocks from each worker.
                            1 => tx.send(m).unwrap(),
                            _ => drop(m),
                        }
                    }
                    kept
                })
            })
            .collect();
        drop(tx);
        for m in rx {
            drop(m);
        }
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap())
            .collect()
    });
    let truth: BTreeMap<u64, (usize, Tag)> = kept
        .iter()
        .map(|(m, tag)| (m.device_ptr().0, (m.size(), *tag)))
        .collect();
    let snapshot = ctx.snapshot();
    covered(&snapshot).unwrap();
    assert!(snapshot.unplaced.is_empty());
    let mut recorded = 0;
    for b in snapshot.blocks().filter(|b| b.state == BlockState::InUse) {
        if let Some(a) = &b.allocation {
            assert_eq!(truth.get(&b.address), Some(&(a.requested, a.tag)), "{b:?}");
            recorded += 1;
        }
    }
    assert!(recorded > 0, "the window holds the last allocations");
}

/// A block allocated on one thread and freed on another, then allocated again there from that
/// thread's cache, is named by its last allocation: the free's history stamp follows the
/// allocation's (which the pointer carries) whatever the freeing thread's clock said, and the
/// allocation after it follows the free, though neither read the time-stamp counter.
#[test]
fn a_block_freed_on_another_thread_is_named_by_its_last_allocation() {
    let sim = Arc::new(SimDriver::new(SimConfig::single(1 << 30)));
    let rt = crate::common::runtime_with(&sim, "pool");
    let ctx = rt.context(0).unwrap();
    let consumer = Tag::named("consumer");
    let _t = consumer.scope();
    // This thread's ring reads the counter at its first allocation, then counts.
    drop(ctx.memalloc(4096).unwrap());
    std::thread::sleep(std::time::Duration::from_millis(2));
    let produced = std::thread::scope(|s| {
        s.spawn(|| {
            let _t = Tag::named("producer").scope();
            ctx.memalloc(4096).unwrap()
        })
        .join()
        .unwrap()
    });
    let at = produced.device_ptr().0;
    drop(produced); // cached on this thread
    let again = ctx.memalloc(4096).unwrap();
    assert_eq!(
        again.device_ptr().0,
        at,
        "the block freed last comes back first"
    );
    let snapshot = ctx.snapshot();
    let named = snapshot
        .blocks()
        .find(|b| b.address == at)
        .and_then(|b| b.allocation.as_ref().map(|a| a.tag));
    assert_eq!(named, Some(consumer), "{:?}", snapshot.history);
}
