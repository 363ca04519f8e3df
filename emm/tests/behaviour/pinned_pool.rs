//! The pinned host pool on the simulator: reuse, trims, making room for a new size, blocks
//! freed on other threads, and a property test of its accounting.
//!
//! `PROPTEST_CASES` sets the number of cases of the property test.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use driver_mock::{Op, SimConfig, SimDriver};
use emm::{PinnedPoolConfig, Runtime};
use proptest::prelude::*;

use crate::pools::Worker;

/// A runtime on `sim` with the pinned host pool configured as `config`.
fn pinned_runtime(sim: &Arc<SimDriver>, config: PinnedPoolConfig) -> Runtime {
    Runtime::builder(sim.clone())
        .ignore_env()
        .pinned_host_pool(Some(config))
        .build()
        .unwrap()
}

#[test]
fn pinned_host_pool_reuses_blocks_and_trims() {
    let sim = Arc::new(SimDriver::new(SimConfig::single(1 << 30)));
    let rt = pinned_runtime(&sim, PinnedPoolConfig::default());
    let ctx = rt.context(0).unwrap();
    drop(ctx.memhostalloc(4000, false, false, false).unwrap());
    drop(ctx.memhostalloc(4000, true, false, false).unwrap());
    let host_allocs = sim.count(Op::MemHostAlloc);
    for _ in 0..100 {
        let p = ctx.memhostalloc(3900, false, false, false).unwrap();
        p.write(0, &[1, 2, 3]).unwrap();
        let m = ctx.memhostalloc(4000, true, false, false).unwrap();
        drop((p, m));
    }
    assert_eq!(
        sim.count(Op::MemHostAlloc),
        host_allocs,
        "cached blocks are reused"
    );
    let stats = ctx.pool_stats().pinned_host.unwrap();
    assert_eq!(stats.in_use_blocks, 0);
    assert!(ctx.trim().unwrap() >= 8000);
    assert_eq!(ctx.pool_stats().pinned_host.unwrap().held_bytes, 0);
    assert_eq!(sim.count(Op::MemFreeHost), 2);
}

#[derive(Clone, Debug)]
enum PinStep {
    /// Unmapped (false) or mapped (true), on this thread or the worker.
    Alloc(usize, bool, bool),
    /// Dropped on this thread or the worker.
    Free(usize, bool),
    /// Allocates again the size and kind that the last `Free` released, on this thread or the
    /// worker: the pool must serve it from its cache, full or not, when the block was freed
    /// away from the thread it was handed to (it went to that thread's inbox, which every
    /// thread looks in) or when the same thread asks again (it is in that thread's lists).
    Again(bool),
    Trim,
}

fn pin_steps() -> impl Strategy<Value = Vec<PinStep>> {
    #[cfg(not(miri))]
    let (size, steps) = (
        prop_oneof![3 => 1usize..16 << 10, 1 => (16usize << 10)..(2 << 20)],
        1..60,
    );
    #[cfg(miri)]
    let (size, steps) = (1usize..16 << 10, 1..12);
    prop::collection::vec(
        prop_oneof![
            5 => (size, any::<bool>(), any::<bool>()).prop_map(|(b, m, w)| PinStep::Alloc(b, m, w)),
            4 => (any::<usize>(), any::<bool>()).prop_map(|(k, w)| PinStep::Free(k, w)),
            2 => any::<bool>().prop_map(PinStep::Again),
            1 => Just(PinStep::Trim),
        ],
        steps,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(48)
    ))]

    /// The pinned host pool's per-thread shards, with allocations and frees on two threads and
    /// a cache bound small enough to be hit: the shards together never cache more than the
    /// bound, what the pool holds is what is cached plus what is in use, a block is never
    /// handed out twice, the block freed last is always kept (a full cache evicts older
    /// blocks for it) where the next request finds it (see `Again`), and after everything is
    /// freed and trimmed the driver has it all back.
    #[test]
    fn pinned_pool_shards_keep_the_cache_bound(steps in pin_steps()) {
        let sim = Arc::new(SimDriver::new(SimConfig::single(1 << 30)));
        let config = PinnedPoolConfig { max_block: 4 << 20, max_cached: 3 << 20 };
        let rt = pinned_runtime(&sim, config);
        let ctx = rt.context(0).unwrap();
        let worker = Worker::new();
        // Each live block with its size, whether it is mapped, and whether the worker got it.
        let mut live: BTreeMap<u64, (emm::HostMemory, usize, bool, bool)> = BTreeMap::new();
        let mut last_freed = None;
        let alloc = |bytes: usize, mapped: bool, elsewhere: bool| {
            if elsewhere {
                let ctx = ctx.clone();
                worker.run(move || ctx.memhostalloc(bytes, mapped, false, false))
            } else {
                ctx.memhostalloc(bytes, mapped, false, false)
            }
            .unwrap()
        };
        for step in &steps {
            match *step {
                PinStep::Alloc(bytes, mapped, elsewhere) => {
                    let mem = alloc(bytes, mapped, elsewhere);
                    last_freed = None; // it may have taken that block
                    let addr = mem.host_ptr().0 as u64;
                    prop_assert!(live.insert(addr, (mem, bytes, mapped, elsewhere)).is_none(), "{addr:#x} handed out twice");
                }
                PinStep::Free(k, elsewhere) if !live.is_empty() => {
                    let key = *live.keys().nth(k % live.len()).unwrap();
                    let (mem, bytes, mapped, got_elsewhere) = live.remove(&key).unwrap();
                    last_freed = Some((bytes, mapped, got_elsewhere, elsewhere));
                    if elsewhere {
                        worker.run(move || drop(mem));
                    } else {
                        drop(mem);
                    }
                }
                PinStep::Free(..) => {}
                PinStep::Again(elsewhere) => {
                    if let Some((bytes, mapped, got_elsewhere, freed_elsewhere)) = last_freed.take() {
                        let calls = sim.count(Op::MemHostAlloc);
                        let mem = alloc(bytes, mapped, elsewhere);
                        if got_elsewhere != freed_elsewhere || elsewhere == got_elsewhere {
                            prop_assert_eq!(sim.count(Op::MemHostAlloc), calls, "the block just freed ({} bytes) was not kept", bytes);
                        }
                        let addr = mem.host_ptr().0 as u64;
                        prop_assert!(live.insert(addr, (mem, bytes, mapped, elsewhere)).is_none(), "{addr:#x} handed out twice");
                    }
                }
                PinStep::Trim => {
                    ctx.trim().unwrap();
                    last_freed = None;
                }
            }
            let stats = ctx.pool_stats().pinned_host.unwrap();
            prop_assert!(stats.cached_bytes <= config.max_cached, "{:?}", stats);
            prop_assert_eq!(stats.held_bytes, stats.cached_bytes + stats.in_use_bytes, "{:?}", stats);
            prop_assert_eq!(stats.in_use_blocks, live.len());
        }
        live.clear();
        ctx.trim().unwrap();
        if let Some(q) = ctx.deallocations() {
            q.flush().unwrap();
        }
        let stats = ctx.pool_stats().pinned_host.unwrap();
        prop_assert_eq!((stats.held_bytes, stats.cached_bytes), (0, 0), "{:?}", stats);
        prop_assert_eq!(sim.count(Op::MemHostAlloc), sim.count(Op::MemFreeHost));
    }
}

/// A pinned cache filled to its bound with blocks of one size does not turn every later pair
/// of another size into driver calls: the returned block displaces cached blocks (of the
/// lists holding the most bytes), and the new size is served from the cache after its
/// first allocation. Before, each free of the new size found no room, was freed through the
/// driver, and the next allocation called `cuMemHostAlloc` again (hundreds of microseconds on
/// a GPU), for as long as the old blocks sat in the cache.
#[test]
fn pinned_pool_makes_room_for_a_new_size_when_full() {
    let sim = Arc::new(SimDriver::new(SimConfig::single(1 << 30)));
    let config = PinnedPoolConfig {
        max_block: 4 << 20,
        max_cached: 4 << 20,
    };
    let rt = pinned_runtime(&sim, config);
    let ctx = rt.context(0).unwrap();
    // Fill the cache with 4 KiB blocks, some freed here and some on another thread (whose
    // shard then holds them).
    let small: Vec<_> = (0..1024)
        .map(|_| ctx.memhostalloc(4096, false, false, false).unwrap())
        .collect();
    let (here, there): (Vec<_>, Vec<_>) =
        small.into_iter().enumerate().partition(|(i, _)| i % 2 == 0);
    drop(here);
    std::thread::spawn(move || drop(there)).join().unwrap();
    let full = ctx.pool_stats().pinned_host.unwrap();
    assert_eq!(full.cached_bytes, 4 << 20, "{full:?}");
    // Now a workload of 256 KiB blocks, four live at a time.
    let calls = sim.count(Op::MemHostAlloc);
    for round in 0..50 {
        let blocks: Vec<_> = (0..4)
            .map(|_| ctx.memhostalloc(256 << 10, false, false, false).unwrap())
            .collect();
        blocks[0].write(0, &[round as u8]).unwrap();
        drop(blocks);
        let stats = ctx.pool_stats().pinned_host.unwrap();
        assert!(stats.cached_bytes <= config.max_cached, "{stats:?}");
        assert_eq!(
            stats.held_bytes,
            stats.cached_bytes + stats.in_use_bytes,
            "{stats:?}"
        );
    }
    assert_eq!(
        sim.count(Op::MemHostAlloc) - calls,
        4,
        "only the first round allocates from the driver"
    );
    ctx.trim().unwrap();
    if let Some(q) = ctx.deallocations() {
        q.flush().unwrap();
    }
    assert_eq!(sim.count(Op::MemHostAlloc), sim.count(Op::MemFreeHost));
}

/// Pinned blocks made on one thread and freed on another (so cached in that thread's shard)
/// come back to the first without the driver: a thread whose own lists are empty takes from
/// the other shards before any `cuMemHostAlloc`. Mapped and unmapped blocks alike, the same 40
/// blocks every round, none handed out twice; the statistics stay exact, and a trim frees
/// every block.
#[test]
fn pinned_blocks_freed_on_another_thread_return_without_the_driver() {
    let sim = Arc::new(SimDriver::new(SimConfig::single(1 << 30)));
    let rt = pinned_runtime(&sim, PinnedPoolConfig::default());
    let ctx = rt.context(0).unwrap();
    let worker = Worker::new();
    let alloc_all = |n: usize| -> Vec<emm::HostMemory> {
        (0..n)
            .map(|i| {
                let m = ctx.memhostalloc(4096, i % 2 == 0, false, false).unwrap();
                m.write(0, &[i as u8]).unwrap();
                m
            })
            .collect()
    };
    let blocks = alloc_all(40);
    let first: BTreeSet<u64> = blocks.iter().map(|m| m.host_ptr().0 as u64).collect();
    let calls = sim.count(Op::MemHostAlloc);
    assert_eq!(calls, 40);
    worker.run(move || drop(blocks));
    let stats = ctx.pool_stats().pinned_host.unwrap();
    assert_eq!(
        (stats.in_use_blocks, stats.cached_bytes),
        (0, 40 * 4096),
        "{stats:?}"
    );
    for round in 0..3 {
        let again = alloc_all(40);
        assert_eq!(
            sim.count(Op::MemHostAlloc),
            calls,
            "round {round}: a block came from the driver"
        );
        let addrs: BTreeSet<u64> = again.iter().map(|m| m.host_ptr().0 as u64).collect();
        assert_eq!(
            addrs, first,
            "round {round}: the same 40 blocks, none twice"
        );
        let stats = ctx.pool_stats().pinned_host.unwrap();
        assert_eq!(stats.in_use_blocks, 40, "{stats:?}");
        assert_eq!(
            stats.held_bytes,
            stats.cached_bytes + stats.in_use_bytes,
            "{stats:?}"
        );
        worker.run(move || drop(again));
    }
    assert_eq!(ctx.trim().unwrap(), 40 * 4096);
    if let Some(q) = ctx.deallocations() {
        q.flush().unwrap();
    }
    assert_eq!(ctx.pool_stats().pinned_host.unwrap().held_bytes, 0);
    assert_eq!(sim.count(Op::MemFreeHost), 40);
}
