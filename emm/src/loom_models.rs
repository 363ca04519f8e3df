//! loom models of emm's concurrency: the deferred-free queue, `defer_cleanup`, manager reset and
//! device reset, each racing pointer drops on other threads. No free may be lost, none may be
//! issued twice, and none may reach a destroyed context. Every driver call of the simulated
//! machine is a scheduling point ([`machine`]), so loom also orders driver calls against each
//! other and against emm's locks.
//!
//! These models use only emm's public API (through `emm::`, the crate's name for itself in
//! its loom build), as an embedder would; they live in the library's test build with the
//! library's own models (`loom_models` in `sync` and `memory::record`) so that the `loom`
//! profile compiles emm once.
//!
//! Run: `RUSTFLAGS="--cfg emm_loom" LOOM_MAX_PREEMPTIONS=4 CARGO_TARGET_DIR=target/loom \
//!       cargo test -p emm --profile loom --lib -- loom_models` (`.ci/run` does; the `loom`
//!       profile optimises emm, loom and the simulator, not the test crates).
//! Raise the preemption bound for a deeper search (5 takes about a minute).

use std::sync::Arc;

use driver_mock::{Op, SimConfig, SimDriver};
use emm::Runtime;
use emm::plugin::{ContextLiveness, DeallocConfig};
use loom::sync::atomic::{AtomicBool, Ordering};
use loom::thread;

/// A simulated machine whose every driver call is a loom scheduling point: the call hook
/// touches one loom atomic, so loom may run another thread just before any call, and tries
/// every two calls in both orders. (The simulator's own lock is a plain mutex, invisible to
/// loom: without the hook, a call runs in one step with the code before it, and a model
/// cannot catch, for example, a pool handle read under a lock that is released before the
/// handle is used.)
fn machine() -> Arc<SimDriver> {
    let sim = Arc::new(SimDriver::new(SimConfig::default()));
    let point = Arc::new(loom::sync::atomic::AtomicUsize::new(0));
    sim.set_call_hook(Box::new(move |_| {
        point.fetch_add(1, Ordering::SeqCst);
    }));
    sim
}

fn runtime(max_count: usize) -> (Arc<SimDriver>, Runtime) {
    runtime_with(max_count, |b| b)
}

/// As [`runtime`], with more of the builder set by `more`.
fn runtime_with(
    max_count: usize,
    more: impl FnOnce(emm::RuntimeBuilder) -> emm::RuntimeBuilder,
) -> (Arc<SimDriver>, Runtime) {
    let sim = machine();
    let builder = Runtime::builder(sim.clone())
        .ignore_env()
        .dealloc_config(DeallocConfig {
            max_count,
            ..DeallocConfig::default()
        });
    (sim, more(builder).build().expect("runtime"))
}

/// Every free the simulator saw succeeded, and there were exactly `n` of them.
fn exactly_once(sim: &SimDriver, n: usize) {
    let frees: Vec<_> = sim
        .calls()
        .into_iter()
        .filter(|c| c.op == Op::MemFree)
        .collect();
    assert!(
        frees.iter().all(|c| c.outcome.is_ok()),
        "a free failed: {frees:?}"
    );
    assert_eq!(frees.len(), n, "{frees:?}");
}

/// Every `cuMemFreeHost` the simulator saw succeeded, there were exactly `n`, and no host
/// allocation is left.
fn host_frees_exactly(sim: &SimDriver, n: usize) {
    let frees: Vec<_> = sim
        .calls()
        .into_iter()
        .filter(|c| c.op == Op::MemFreeHost)
        .collect();
    assert!(frees.iter().all(|c| c.outcome.is_ok()), "{frees:?}");
    assert_eq!(frees.len(), n, "{frees:?}");
    assert!(sim.leak_report().host_allocations.is_empty());
}

/// A call on another thread (entered once, or twice: `nested`) racing `kill`: once `kill`
/// returns, no call that entered before is still inside, and none can enter.
fn kill_races_a_call(nested: bool) {
    loom::model(move || {
        let live = Arc::new(ContextLiveness::new());
        let inside = Arc::new(AtomicBool::new(false));
        let t = {
            let (live, inside) = (live.clone(), inside.clone());
            thread::spawn(move || {
                if let Some(_outer) = live.enter() {
                    inside.store(true, Ordering::SeqCst);
                    if nested {
                        drop(live.enter());
                    }
                    inside.store(false, Ordering::SeqCst);
                }
            })
        };
        live.kill();
        assert!(
            !inside.load(Ordering::SeqCst),
            "a call was in flight after kill returned"
        );
        assert!(live.enter().is_none());
        t.join().unwrap();
    });
}

/// Once `kill` returns, no call that entered before is still inside, and none can enter.
#[test]
fn kill_waits_for_calls_in_flight() {
    kill_races_a_call(false);
}

/// As [`kill_waits_for_calls_in_flight`], with the call entered twice on its thread (an
/// allocation that flushes after out-of-memory enters again): `kill` waits for the outer call,
/// not only the inner one.
#[test]
fn kill_waits_for_nested_calls_in_flight() {
    kill_races_a_call(true);
}

/// Two pointers dropped on two threads while the main thread flushes: both freed, once each.
#[test]
fn drops_race_a_flush() {
    loom::model(|| {
        let (sim, rt) = runtime(10);
        let ctx = rt.context(0).unwrap();
        let a = ctx.memalloc(8).unwrap();
        let b = ctx.memalloc(8).unwrap();
        let t1 = thread::spawn(move || drop(a));
        let t2 = thread::spawn(move || drop(b));
        ctx.deallocations().unwrap().flush().unwrap();
        t1.join().unwrap();
        t2.join().unwrap();
        ctx.deallocations().unwrap().flush().unwrap();
        exactly_once(&sim, 2);
        assert!(sim.leak_report().no_memory_leaked());
    });
}

/// A guard entered and left on one thread while two others drop pointers with a threshold of
/// zero: whether a drop's flush ran before, during or after the guard, after a final flush
/// both are freed, once each.
#[test]
fn defer_cleanup_races_drops() {
    loom::model(|| {
        let (sim, rt) = runtime(0);
        let ctx = rt.context(0).unwrap();
        let a = ctx.memalloc(8).unwrap();
        let b = ctx.memalloc(8).unwrap();
        let guarded = {
            let ctx = ctx.clone();
            thread::spawn(move || {
                let queue = ctx.deallocations().unwrap().clone();
                let guard = ctx.defer_cleanup().unwrap();
                let entered = queue.len();
                thread::yield_now();
                assert!(
                    queue.len() >= entered,
                    "the queue was flushed under defer_cleanup"
                );
                drop(guard);
            })
        };
        let dropper = thread::spawn(move || drop(a));
        drop(b);
        guarded.join().unwrap();
        dropper.join().unwrap();
        ctx.deallocations().unwrap().flush().unwrap();
        exactly_once(&sim, 2);
    });
}

/// A manager reset racing a drop: the allocation is freed exactly once, by whichever wins.
#[test]
fn reset_races_a_drop() {
    loom::model(|| {
        let (sim, rt) = runtime(10);
        let ctx = rt.context(0).unwrap();
        let a = ctx.memalloc(8).unwrap();
        let b = ctx.memalloc(8).unwrap();
        let t = thread::spawn(move || drop(a));
        ctx.reset().unwrap();
        t.join().unwrap();
        drop(b);
        ctx.deallocations().unwrap().flush().unwrap();
        exactly_once(&sim, 2);
    });
}

/// The default manager's parked records: a pointer dropped on one thread (its record parked in
/// the table) while another allocates (and may revive that record) and the main thread resets
/// the manager. Whatever the interleaving, every allocation is freed exactly once, a pointer
/// made after the reset is live, and one made before it is not.
#[test]
fn default_park_races_a_revive_and_a_reset() {
    loom::model(|| {
        let (sim, rt) = runtime(10);
        let ctx = rt.context(0).unwrap();
        let a = ctx.memalloc(8).unwrap();
        let dropper = thread::spawn(move || drop(a));
        let other = ctx.clone();
        let allocator = thread::spawn(move || other.memalloc(8).expect("an allocation"));
        ctx.reset().unwrap();
        dropper.join().unwrap();
        let b = allocator.join().unwrap();
        let c = ctx.memalloc(8).unwrap();
        assert!(c.is_live(), "made after the reset");
        // Every free due so far issued: the memory of each live pointer is still allocated
        // (a release of `a` must not have taken the entry `b` or `c` got after the reset).
        ctx.deallocations().unwrap().flush().unwrap();
        let held = sim.live_allocations(emm::driver_sys::DeviceOrdinal(0));
        for p in [&b, &c].into_iter().filter(|p| p.is_live()) {
            assert!(
                held.iter().any(|(base, _)| *base == p.device_ptr()),
                "a live pointer's memory was freed: {held:?}"
            );
        }
        drop((b, c));
        ctx.deallocations().unwrap().flush().unwrap();
        exactly_once(&sim, 3);
        assert!(sim.leak_report().no_memory_leaked());
    });
}

/// A device reset racing a drop: whichever wins, the allocation is freed exactly once and
/// before the context dies (the drop's own free, or the reset's); nothing reaches the destroyed
/// context and nothing is left to the context's destruction.
#[test]
fn device_reset_races_a_drop() {
    loom::model(|| {
        let (sim, rt) = runtime(0);
        let ctx = rt.context(0).unwrap();
        let a = ctx.memalloc(8).unwrap();
        let t = thread::spawn(move || drop(a));
        rt.reset_device(0).unwrap();
        t.join().unwrap();
        exactly_once(&sim, 1);
        assert!(sim.leak_report().no_memory_leaked());
    });
}

/// The host-only queue: mapped host memory dropped on one thread while another resets the
/// manager; it is freed exactly once (`cuMemFreeHost`), by whichever wins.
#[test]
fn host_memory_drop_races_a_reset() {
    loom::model(|| {
        let (sim, rt) = runtime(0);
        let ctx = rt.context(0).unwrap();
        let mapped = ctx.memhostalloc(64, true, false, false).unwrap();
        let t = thread::spawn(move || drop(mapped));
        ctx.reset().unwrap();
        t.join().unwrap();
        ctx.deallocations().unwrap().flush().unwrap();
        host_frees_exactly(&sim, 1);
    });
}

/// A mapped pin dropped on one thread while another resets: unpinned exactly once, and the
/// buffer stays alive until the unpin is done, so pinning it again afterwards works.
#[test]
fn pin_drop_races_a_reset() {
    loom::model(|| {
        let (sim, rt) = runtime(10);
        let ctx = rt.context(0).unwrap();
        let buffer = std::sync::Arc::new(emm::PinnableBuffer::zeroed(64));
        let pinned = ctx.pin(buffer.clone(), true).unwrap();
        let t = thread::spawn(move || drop(pinned));
        ctx.reset().unwrap();
        t.join().unwrap();
        let unpins: Vec<_> = sim
            .calls()
            .into_iter()
            .filter(|c| c.op == Op::MemHostUnregister)
            .collect();
        assert!(unpins.iter().all(|c| c.outcome.is_ok()), "{unpins:?}");
        assert_eq!(unpins.len(), 1, "{unpins:?}");
        drop(
            ctx.pin(buffer, true)
                .expect("the range can be pinned again"),
        );
    });
}

/// A runtime with the pinned host pool, its deferred frees flushed at once (a count of 0).
fn pinned_pool_runtime() -> (Arc<SimDriver>, Runtime) {
    runtime_with(0, |b| {
        b.pinned_host_pool(Some(emm::PinnedPoolConfig::default()))
    })
}

/// The pinned host pool's per-thread shards: a block returned on another thread (to that
/// thread's shard) races this thread taking a block (which looks in every shard) and then a
/// reset. Whatever the interleaving, no block is handed out twice, the reset frees every
/// cached block once, and the block returned after the reset is freed, not cached.
#[test]
fn pinned_pool_shards_race_a_take_and_a_reset() {
    loom::model(|| {
        let (sim, rt) = pinned_pool_runtime();
        let ctx = rt.context(0).unwrap();
        let a = ctx.memhostalloc(4096, false, false, false).unwrap();
        let a_addr = a.host_ptr();
        let t = thread::spawn(move || drop(a));
        let b = ctx.memhostalloc(4096, false, false, false).unwrap();
        t.join().unwrap();
        // `b` is `a`'s block if the return came first, a new one otherwise; never both live.
        let reused = b.host_ptr() == a_addr;
        ctx.reset().unwrap();
        drop(b);
        ctx.deallocations().unwrap().flush().unwrap();
        let allocs = sim.count(Op::MemHostAlloc);
        assert_eq!(allocs, if reused { 1 } else { 2 });
        host_frees_exactly(&sim, allocs);
    });
}

/// The pinned host pool: this thread takes a block back from its inbox (where another thread
/// returned it) with its own shard entered, while a third thread trims, which takes every
/// shard and every inbox. The trim must wait for this thread to leave its shard before it
/// holds any inbox: holding them all first and then waiting deadlocked on the GPU (on that
/// order, this model fails with loom's "Model exceeded maximum number of branches", both
/// threads spinning on each other). Whatever the
/// interleaving, both finish, no block is handed out twice, and every block is freed once.
#[test]
fn pinned_pool_refill_from_an_inbox_races_a_trim() {
    loom::model(|| {
        let (sim, rt) = pinned_pool_runtime();
        let ctx = rt.context(0).unwrap();
        let a = ctx.memhostalloc(4096, false, false, false).unwrap();
        // Freed away from home: to this thread's inbox.
        thread::spawn(move || drop(a)).join().unwrap();
        let trimmer = {
            let ctx = ctx.clone();
            thread::spawn(move || ctx.trim().unwrap())
        };
        let b = ctx.memhostalloc(4096, false, false, false).unwrap();
        trimmer.join().unwrap();
        drop(b);
        ctx.trim().unwrap();
        ctx.deallocations().unwrap().flush().unwrap();
        let allocs = sim.count(Op::MemHostAlloc);
        assert!((1..=2).contains(&allocs), "{allocs} host allocations");
        host_frees_exactly(&sim, allocs);
    });
}

/// The pinned host pool keeps a block's reference to the pool in the freeing thread's shard
/// for the next block (`HostReleaseHook::release_owned`), and the host layer's drop lets
/// every such reference go. Here this thread frees a block at home (its reference going to
/// its shard) while the runtime drops on another thread, with it the manager and its host
/// layer, which closes every shard. Whatever the interleaving, the pool is freed at the end:
/// nothing holds the driver but the test.
#[test]
fn pinned_block_drop_races_the_host_layers_drop() {
    loom::model(|| {
        let (sim, rt) = pinned_pool_runtime();
        let ctx = rt.context(0).unwrap();
        drop(ctx.memhostalloc(4096, false, false, false).unwrap()); // a spare reference
        let block = ctx.memhostalloc(4096, false, false, false).unwrap();
        drop(ctx);
        let t = thread::spawn(move || drop(rt));
        drop(block);
        t.join().unwrap();
        assert_eq!(
            Arc::strong_count(&sim),
            1,
            "the pool, or its queue, outlived the runtime"
        );
    });
}

fn pool_runtime() -> (Arc<SimDriver>, Runtime) {
    let sim = machine();
    let config = emm::PoolConfig {
        chunk_size: 2 << 20,
        ..emm::PoolConfig::default()
    };
    let rt = Runtime::builder(sim.clone())
        .ignore_env()
        .memory_manager(emm::plugin::PoolAllocator::factory_with("pool", config))
        .build()
        .expect("runtime");
    (sim, rt)
}

/// The pool holds nothing from the driver, and has nothing in use or cached.
fn assert_pool_empty(ctx: &emm::Context) {
    let stats = ctx.pool_stats().device.unwrap();
    assert_eq!(
        (stats.held_bytes, stats.in_use_blocks, stats.cached_bytes),
        (0, 0, 0),
        "{stats:?}"
    );
}

/// With `last` the pool's one block in use: dropped and trimmed, every chunk the pool took
/// (one or two, as the race went) is freed exactly once and nothing is left.
fn one_in_use_then_every_chunk_back(sim: &SimDriver, ctx: &emm::Context, last: emm::MemoryPointer) {
    let stats = ctx.pool_stats().device.unwrap();
    assert_eq!(stats.in_use_blocks, 1, "{stats:?}");
    drop(last);
    ctx.trim().unwrap();
    assert_pool_empty(ctx);
    let grown = sim.calls().iter().filter(|c| c.op == Op::MemAlloc).count();
    assert!((1..=2).contains(&grown), "{grown} chunks");
    exactly_once(sim, grown);
}

/// The pool's reset racing the drops of a small block and a large one (both kept in the
/// dropping thread's shard): whichever wins, every chunk is freed exactly once by the reset,
/// no stale block comes back into the pool, and the pool works afterwards.
#[test]
fn pool_reset_races_drops() {
    // Every allocation and the reset read the context's graph routes (loom's atomics): more
    // branches per execution than loom's default bound of 1 000 allows.
    let mut model = loom::model::Builder::new();
    model.max_branches = 10_000;
    model.check(|| {
        let (sim, rt) = pool_runtime();
        let ctx = rt.context(0).unwrap();
        let small = ctx.memalloc(100).unwrap();
        let large = ctx.memalloc(3 << 20).unwrap();
        let chunks = ctx.pool_stats().device.unwrap().chunks;
        let t = thread::spawn(move || drop((small, large)));
        ctx.reset().unwrap();
        t.join().unwrap();
        assert_pool_empty(&ctx);
        exactly_once(&sim, chunks);
        let again = ctx.memalloc(100).unwrap();
        assert!(again.is_live());
    });
}

/// A block of `bytes` allocated on this thread, dropped on another (it goes to that thread's
/// shard: a small block with its pointer's record parked with it, a large one to the shard's
/// exact-size slots, its record and hook clone to that thread's spares), racing an allocation here that
/// refills from the depot or the arena, then a second allocation here and a trim: with
/// `chunks` given, this thread's blocks are never the one waiting in the other shard and the
/// trim gets every one of those chunks back exactly once; without, the pool may take that
/// block back to grow by less, and the trim gets every chunk it took back exactly once.
fn freed_elsewhere_races_allocations_and_a_trim(bytes: usize, chunks: Option<usize>) {
    loom::model(move || {
        let (sim, rt) = pool_runtime();
        let ctx = rt.context(0).unwrap();
        let a = ctx.memalloc(bytes).unwrap();
        let a_addr = a.device_ptr();
        let t = thread::spawn(move || drop(a));
        let b = ctx.memalloc(bytes).unwrap();
        assert!(b.is_live());
        t.join().unwrap();
        let again = ctx.memalloc(bytes).unwrap();
        assert_ne!(b.device_ptr(), again.device_ptr(), "two live blocks");
        if chunks.is_some() {
            for mine in [&b, &again] {
                assert_ne!(
                    mine.device_ptr(),
                    a_addr,
                    "a block cached on another shard is not this thread's"
                );
            }
        }
        drop((b, again));
        ctx.trim().unwrap();
        assert_pool_empty(&ctx);
        let grown = sim.calls().iter().filter(|c| c.op == Op::MemAlloc).count();
        exactly_once(&sim, chunks.unwrap_or(grown));
    });
}

/// A small block: all three come from the first 2 MiB chunk, none from the other shard.
#[test]
fn pool_cross_thread_free_races_an_allocation_and_a_trim() {
    freed_elsewhere_races_allocations_and_a_trim(100, Some(1));
}

/// A large block, kept in the other thread's shard's large slots until a request here has to
/// grow the pool, which first takes every shard's cached blocks back: each 3 MiB request gets
/// the block freed elsewhere or a chunk of its own, and every chunk the pool took (two or
/// three, as the race went) is freed exactly once.
#[test]
fn pool_large_block_freed_elsewhere_races_an_allocation_and_a_trim() {
    freed_elsewhere_races_allocations_and_a_trim(3 << 20, None);
}

/// A block above a shard's byte bound (32 MiB), dropped on another thread (it waits in that
/// thread's oversize slot with its record), racing an allocation of its size here, which
/// misses its own shard and the arena and takes every shard's oversize block back before it
/// grows the pool: the allocation gets a live block either way (the dropped one, or a new
/// chunk's when it ran first), and after a drop and a trim every chunk the pool took is freed
/// exactly once, with nothing left cached.
#[test]
fn pool_oversize_block_freed_elsewhere_races_an_allocation() {
    loom::model(|| {
        let (sim, rt) = pool_runtime();
        let ctx = rt.context(0).unwrap();
        let bytes = 33 << 20;
        let a = ctx.memalloc(bytes).unwrap();
        let t = thread::spawn(move || drop(a));
        let b = ctx.memalloc(bytes).unwrap();
        assert!(b.is_live());
        t.join().unwrap();
        one_in_use_then_every_chunk_back(&sim, &ctx, b);
    });
}

/// A trim racing a drop: the block is either trimmed with its chunk after the drop, or the
/// chunk stays; never freed while in use, never lost.
#[test]
fn pool_trim_races_a_drop() {
    loom::model(|| {
        let (sim, rt) = pool_runtime();
        let ctx = rt.context(0).unwrap();
        let a = ctx.memalloc(100).unwrap();
        let t = thread::spawn(move || drop(a));
        ctx.trim().unwrap();
        t.join().unwrap();
        ctx.trim().unwrap();
        let stats = ctx.pool_stats().device.unwrap();
        assert_eq!((stats.held_bytes, stats.in_use_blocks), (0, 0), "{stats:?}");
        exactly_once(&sim, 1);
    });
}

/// Another thread drops a small block (its record is parked with it in that thread's shard)
/// and allocates the same size again (the parked record is revived: the same block), racing a
/// trim, which lets every parked record go (and frees the chunk, if nothing is in use when it
/// runs, so that the allocation grows the pool again): the second pointer is live either way,
/// and after both are dropped and trimmed every chunk the pool took is freed exactly once.
#[test]
fn pool_trim_races_a_park_and_a_revive() {
    loom::model(|| {
        let (sim, rt) = pool_runtime();
        let ctx = rt.context(0).unwrap();
        let a = ctx.memalloc(100).unwrap();
        let ctx2 = ctx.clone();
        let t = thread::spawn(move || {
            drop(a);
            let b = ctx2.memalloc(100).unwrap();
            assert!(b.is_live());
            b
        });
        ctx.trim().unwrap();
        let b = t.join().unwrap();
        one_in_use_then_every_chunk_back(&sim, &ctx, b);
    });
}

/// A runtime under `async-pool` on a [`machine`] (its frees do not go through the deferred
/// queue, whose count is left at the default).
fn async_pool_runtime() -> (Arc<SimDriver>, Runtime) {
    runtime_with(DeallocConfig::default().max_count, |b| {
        b.memory_manager_name("async-pool")
    })
}

/// Every stream-ordered allocation and free the simulator saw succeeded, and there were as
/// many frees as allocations.
fn every_pool_call_ok_and_each_allocation_freed_once(sim: &SimDriver) {
    let calls = sim.calls();
    let count = |op: Op| calls.iter().filter(|c| c.op == op).count();
    assert!(
        calls
            .iter()
            .filter(|c| matches!(c.op, Op::MemAllocFromPoolAsync | Op::MemFreeAsync))
            .all(|c| c.outcome.is_ok()),
        "a pool call failed: {calls:?}"
    );
    assert_eq!(
        count(Op::MemFreeAsync),
        count(Op::MemAllocFromPoolAsync),
        "{calls:?}"
    );
}

/// `async-pool`'s reset racing another thread that drops an allocation and allocates again:
/// allocations and frees hold the pool's lock for reading across their driver call, the reset
/// holds it for writing. Whatever the interleaving, no driver call reaches a destroyed pool,
/// and every allocation is freed exactly once (by its drop or by the reset).
#[test]
fn async_pool_reset_races_a_drop_and_an_allocation() {
    loom::model(|| {
        let (sim, rt) = async_pool_runtime();
        let ctx = rt.context(0).unwrap();
        let a = ctx.memalloc(256).unwrap();
        let other = ctx.clone();
        let t = thread::spawn(move || {
            drop(a);
            drop(other.memalloc(256).expect("an allocation racing a reset"));
        });
        ctx.reset().unwrap();
        t.join().unwrap();
        ctx.reset().unwrap();
        every_pool_call_ok_and_each_allocation_freed_once(&sim);
    });
}

/// `async-pool`'s parked records: a `memalloc` pointer dropped on one thread (its last drop
/// frees its block and parks its record in the block's shard) while another resets the
/// manager and allocates on a stream, which may get the same address and the same slot in the
/// new pool. Whatever the interleaving, a stale pointer's park frees nothing of the new pool
/// (its generation is checked under the pool's read lock), the new allocation stays live, and
/// every allocation is freed exactly once.
#[test]
#[allow(unsafe_code)]
fn async_pool_stale_park_races_a_reset_and_a_new_allocation() {
    loom::model(|| {
        let (sim, rt) = async_pool_runtime();
        let ctx = rt.context(0).unwrap();
        let a = ctx.memalloc(256).unwrap();
        let t = thread::spawn(move || drop(a));
        ctx.reset().unwrap();
        // SAFETY: the legacy default stream, alive as long as the context.
        let b = unsafe { ctx.memalloc_on_raw(256, emm::driver_sys::StreamHandle::NULL) }.unwrap();
        t.join().unwrap();
        assert!(b.is_live());
        let calls = sim.calls();
        let count = |op: Op| calls.iter().filter(|c| c.op == op).count();
        assert_eq!(
            count(Op::MemFreeAsync) + 1,
            count(Op::MemAllocFromPoolAsync),
            "the new allocation was freed while live: {calls:?}"
        );
        drop(b);
        ctx.reset().unwrap();
        every_pool_call_ok_and_each_allocation_freed_once(&sim);
    });
}

/// Cross-stream reuse: a block freed on stream A while A is held behind a flag (its work on
/// the block still pending), dropped on one thread while another allocates the same size on
/// stream B and a third trims. Whatever the interleaving, B never receives A's block while A
/// is held unless B's work waits for A's: `default` never hands it over, and `pool` may hand
/// A's free chunk to B behind a wait on A (B's queue then cannot drain while A is held); once
/// A ran, nothing was lost (the pool's stats, the default manager's frees). One test per
/// manager, so that the two models run side by side.
fn stream_ordered_free_races_an_allocation_on_another_stream(manager: &'static str) {
    use emm::driver_sys::{Driver, wait_value};
    loom::model(move || {
        let (sim, rt) = if manager == "pool" {
            pool_runtime()
        } else {
            runtime(10)
        };
        let ctx = rt.context(0).unwrap();
        let (a, b) = (
            ctx.create_stream_with(true, 0).unwrap(),
            ctx.create_stream_with(true, 0).unwrap(),
        );
        let flag = ctx.memhostalloc(64, true, false, false).unwrap();
        flag.write(0, &0u32.to_le_bytes()).unwrap();
        let at = flag.mapped().unwrap().device().device_ptr();
        sim.stream_wait_value32(ctx.handle(), a.handle(), at, 1, wait_value::EQ)
            .unwrap();
        let x = ctx.memalloc_on(4096, &a).unwrap();
        let held = x.device_ptr();
        let t = thread::spawn(move || drop(x));
        let trimmer = {
            let ctx = ctx.clone();
            thread::spawn(move || {
                ctx.trim().unwrap();
            })
        };
        let y = ctx.memalloc_on(4096, &b).unwrap();
        t.join().unwrap();
        trimmer.join().unwrap();
        let z = ctx.memalloc_on(4096, &b).unwrap();
        if y.device_ptr() == held || z.device_ptr() == held {
            assert_eq!(
                manager, "pool",
                "{manager}: B got A's block while A was held"
            );
            sim.run_streams();
            assert!(
                !b.query().unwrap(),
                "{manager}: B got A's block while A was held, and nothing made B wait for A"
            );
        }
        flag.write(0, &1u32.to_le_bytes()).unwrap();
        a.synchronize().unwrap();
        drop((y, z));
        b.synchronize().unwrap();
        if manager == "pool" {
            ctx.trim().unwrap();
            ctx.trim().unwrap();
            let stats = ctx.pool_stats().device.unwrap();
            assert_eq!((stats.in_use_blocks, stats.held_bytes), (0, 0), "{stats:?}");
        } else {
            // The frees whose streams are done are queued by the next allocation; a flush
            // frees all three blocks, each once.
            drop(ctx.memalloc(256).unwrap());
            ctx.flush_deallocations().unwrap();
            let frees = sim
                .calls()
                .into_iter()
                .filter(|c| c.op == Op::MemFree)
                .count();
            assert!(frees >= 3, "{frees} frees");
        }
    });
}

#[test]
fn stream_ordered_free_races_an_allocation_on_another_stream_under_pool() {
    stream_ordered_free_races_an_allocation_on_another_stream("pool");
}

#[test]
fn stream_ordered_free_races_an_allocation_on_another_stream_under_default() {
    stream_ordered_free_races_an_allocation_on_another_stream("default");
}

/// A host-side write of mapped memory on one thread races `Context::reset`, which frees the
/// memory, on another. The write either lands before the free or is refused as stale; it never
/// lands after (the simulator keeps freed host blocks poisoned, and a write after the free
/// would show there). Checking the memory's generation and then writing, as the write did
/// before, let the reset free the memory between the two.
#[test]
fn mapped_write_races_a_reset() {
    loom::model(|| {
        let (sim, rt) = runtime(10);
        sim.quarantine_host_frees();
        let ctx = rt.context(0).unwrap();
        let mapped = Arc::new(ctx.memhostalloc(64, true, false, false).unwrap());
        let writer = {
            let mapped = Arc::clone(&mapped);
            thread::spawn(move || mapped.write(0, &[0xAB; 64]))
        };
        ctx.reset().unwrap();
        let wrote = writer.join().unwrap();
        assert!(
            sim.freed_host_untouched(),
            "the write landed after the reset freed the memory (it returned {wrote:?})"
        );
        assert!(
            matches!(wrote, Ok(()) | Err(emm::EmmError::Stale { .. })),
            "{wrote:?}"
        );
        host_frees_exactly(&sim, 1);
    });
}

/// A synchronous copy to device memory on one thread races `Context::reset`, which frees the
/// memory, on another. The copy either reaches the driver while the memory exists or is
/// refused as stale; no copy reaches freed memory (where the simulator refuses the address,
/// a real driver would write whatever was allocated there since). Checking the pointer and
/// then copying, as copies did before, let the reset free the memory between the two.
#[test]
fn device_copy_races_a_reset() {
    loom::model(|| {
        let (sim, rt) = runtime(10);
        let ctx = rt.context(0).unwrap();
        let mem = ctx.memalloc(64).unwrap();
        let copier = {
            let ctx = ctx.clone();
            thread::spawn(move || ctx.copy_to_device(&mem, &[0xAB; 64]))
        };
        ctx.reset().unwrap();
        let copied = copier.join().unwrap();
        assert!(
            matches!(copied, Ok(()) | Err(emm::EmmError::Stale { .. })),
            "{copied:?}"
        );
        let copies: Vec<_> = (sim.calls().into_iter())
            .filter(|c| c.op == Op::MemcpyHtoD)
            .collect();
        assert!(copies.iter().all(|c| c.outcome.is_ok()), "{copies:?}");
        exactly_once(&sim, 1);
    });
}
