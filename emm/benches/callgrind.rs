//! Instruction-count budgets for the hot paths, on the simulator, counted by callgrind through
//! gungraun: a regression fails `.ci/run` deterministically, however noisy the machine.
//!
//! `cargo bench -p emm --bench callgrind` (needs valgrind and `gungraun-runner` of the same
//! version as the `gungraun` dev-dependency on `PATH`; `.ci/run` installs it, and adds
//! `--profile callgrind`, which builds the counted crates as `bench` does and the rest
//! unoptimised). Each benchmark
//! makes [`PAIRS`] alloc + free pairs (or one flush of [`FLUSHED`] frees) on a runtime that the
//! setup made and warmed up, so the count is the steady state, not the first allocation; the
//! budget is per pair, checked as a hard limit on the whole function. The simulator's own
//! `cuMemAlloc` + `cuMemFree` pair (alternating, and in the default manager's own sequence of
//! eleven allocations then eleven frees) and its `cuMemAllocFromPoolAsync` + `cuMemFreeAsync`
//! pair are measured too, as the anchors for the default and `async-pool` managers'
//! bookkeeping (their figures minus the anchor). Wall-clock figures belong in BENCHMARKS.md, not
//! here.
//!
//! A budget is the count measured when it was set plus about 15 %; lower it when a path gets
//! cheaper, raise it only with a reason in the commit.

// gungraun's macros generate undocumented items.
#![allow(missing_docs)]

use std::hint::black_box;
use std::sync::Arc;

use driver_mock::{SimConfig, SimDriver};
use emm::driver_sys::{ContextHandle, Driver};
use emm::{Context, PinnedPoolConfig, Runtime};
use gungraun::{
    Callgrind, EventKind, LibraryBenchmarkConfig, library_benchmark, library_benchmark_group, main,
};

/// Pairs per benchmark.
const PAIRS: u64 = 1_000;
/// Frees in the flushed queue (the default manager flushes by itself at the 11th).
const FLUSHED: usize = 10;
/// The queued free at which the default manager flushes (Numba's count threshold, 10, is
/// crossed at the eleventh).
const DEFAULT_FLUSH_AT: usize = FLUSHED + 1;

/// Instructions per pair (per flush for the flush, per operation for the random workloads),
/// at most: each budget is the count measured when it was set or last lowered, plus headroom
/// for code layout, which moves counts by a few instructions without any change on the path.
/// A change that needs a budget raised says why in its commit; lower a budget when a path
/// gets cheaper for good. How each moved: `bench-results/callgrind-budgets.md`.
mod budget {
    pub const SIM_RAW: u64 = 2_600;
    pub const SIM_RAW_DEFERRED: u64 = 2_750;
    pub const SIM_POOL_RAW: u64 = 1_750;
    pub const DEFAULT: u64 = 3_150;
    pub const POOL: u64 = 340;
    pub const ASYNC_POOL: u64 = 2_230;
    pub const PINNED_POOL: u64 = 480;
    pub const POOL_LARGE: u64 = 375;
    pub const POOL_MID: u64 = 420;
    pub const FLUSH: u64 = 11_500;
    pub const RANDOM_POOL: u64 = 620;
    pub const RANDOM_POOL_LARGE: u64 = 720;
    pub const POOL_ON: u64 = 720;
    pub const ASYNC_POOL_ON: u64 = 2_900;
}

/// Allocations in one run of the random workload, and the largest request.
const RANDOM_ALLOCS: usize = 2_000;
const RANDOM_MAX: usize = 1 << 20;
/// The operations of one run: every block allocated is freed once, in the run or after it.
const RANDOM_OPS: u64 = 2 * RANDOM_ALLOCS as u64;
/// Allocations in one run of the larger random workload, and its operations.
const RANDOM_ALLOCS_LARGE: usize = 10_000;
const RANDOM_OPS_LARGE: u64 = 2 * RANDOM_ALLOCS_LARGE as u64;

/// A runtime on a fresh simulated GPU, its context, and the simulator.
struct Fixture {
    sim: Arc<SimDriver>,
    handle: ContextHandle,
    ctx: Context,
    /// Blocks a benchmark left allocated on the simulator, freed at the teardown (not
    /// counted).
    held: Vec<emm::driver_sys::DevicePtr>,
    _rt: Runtime,
}

impl Fixture {
    fn new(sim: Arc<SimDriver>, ctx: Context, rt: Runtime) -> Fixture {
        Fixture {
            sim,
            handle: ctx.handle(),
            ctx,
            held: Vec::new(),
            _rt: rt,
        }
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        for p in self.held.drain(..) {
            // SAFETY: allocated by a benchmark on this context, freed once, never used.
            unsafe { self.sim.mem_free(self.handle, p) }.expect("free");
        }
    }
}

fn fixture(manager: &str, pinned_pool: bool) -> Fixture {
    let sim = Arc::new(SimDriver::new(SimConfig::single(1 << 30)));
    let rt = Runtime::builder(sim.clone())
        .ignore_env()
        .memory_manager_name(manager)
        .pinned_host_pool(pinned_pool.then(PinnedPoolConfig::default))
        .build()
        .expect("a runtime on the simulator");
    let ctx = rt.context(0).expect("context 0");
    // Warm up: the pools hold a block of each size used, the queues have their capacity.
    for _ in 0..100 {
        drop(ctx.memalloc(256).expect("memalloc"));
        if pinned_pool {
            drop(
                ctx.memhostalloc(4096, false, false, false)
                    .expect("memhostalloc"),
            );
        }
    }
    if let Some(queue) = ctx.deallocations() {
        queue.flush().expect("flush");
    }
    Fixture::new(sim, ctx, rt)
}

fn default_manager() -> Fixture {
    fixture("default", false)
}

fn pool() -> Fixture {
    fixture("pool", false)
}

fn async_pool() -> Fixture {
    fixture("async-pool", false)
}

fn pinned_pool() -> Fixture {
    fixture("default", true)
}

/// A [`Fixture`] and a stream created on its context (dropped first).
struct OnAStream {
    stream: emm::Stream,
    f: Fixture,
}

/// `manager` with a created stream, warmed by `memalloc_on` pairs on it.
fn on_a_stream(manager: &str) -> OnAStream {
    let f = fixture(manager, false);
    let stream = f.ctx.create_stream().expect("a stream");
    for _ in 0..100 {
        drop(f.ctx.memalloc_on(256, &stream).expect("memalloc_on"));
    }
    OnAStream { stream, f }
}

fn pool_on_a_stream() -> OnAStream {
    on_a_stream("pool")
}

fn async_pool_on_a_stream() -> OnAStream {
    on_a_stream("async-pool")
}

/// The size of [`pool_large_pair`]'s blocks: above a shard's byte bound
/// (`PoolConfig::cache_bytes_per_shard`, 32 MiB), so that each pair takes its block from the
/// shard's oversize slot and gives it back there (the arena's path until the slot came).
const LARGE: usize = 256 << 20;

/// A `pool` warmed with one [`LARGE`] block (its chunk grown once).
/// The size of [`pool_mid_pair`]'s blocks: above `small_max` (1 MiB), within a shard's byte
/// bound (32 MiB), so kept in the freeing thread's shard with its pointer's record.
const MID: usize = 16 << 20;

/// A `pool` that has made and freed one [`MID`] block.
fn pool_mid() -> Fixture {
    let f = fixture("pool", false);
    drop(f.ctx.memalloc(MID).expect("memalloc"));
    f
}

fn pool_large() -> Fixture {
    let f = fixture("pool", false);
    drop(f.ctx.memalloc(LARGE).expect("memalloc"));
    f
}

/// A `pool` on a 4 GiB simulated GPU, warmed by one run of the random workload from another
/// seed, so that the benchmark's run finds the chunks and caches a long-running pool has.
fn random_pool() -> Fixture {
    random_pool_of(RANDOM_ALLOCS, 4 << 30)
}

/// As [`random_pool`], for runs of [`RANDOM_ALLOCS_LARGE`] allocations, on 16 GiB.
fn random_pool_large() -> Fixture {
    random_pool_of(RANDOM_ALLOCS_LARGE, 16 << 30)
}

fn random_pool_of(allocs: usize, bytes: usize) -> Fixture {
    let sim = Arc::new(SimDriver::new(SimConfig::single(bytes)));
    let rt = Runtime::builder(sim.clone())
        .ignore_env()
        .memory_manager_name("pool")
        .build()
        .expect("a runtime on the simulator");
    let ctx = rt.context(0).expect("context 0");
    random_run(&ctx, 0x9e37_79b9_7f4a_7c15, allocs);
    Fixture::new(sim, ctx, rt)
}

/// RMM's random workload (as `bench_gpu`'s): each step allocates with probability 0.73 a
/// size uniform in 1 ..= [`RANDOM_MAX`], else frees a random live block; then the rest are
/// freed (twice `allocs` operations in all).
fn random_run(ctx: &Context, seed: u64, allocs_wanted: usize) {
    let mut rng = seed;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut live: Vec<emm::MemoryPointer> = Vec::with_capacity(allocs_wanted);
    let mut allocs = 0;
    while allocs < allocs_wanted {
        let alloc = next() % 100 < 73 || live.is_empty();
        let size = (next() as usize % RANDOM_MAX) + 1;
        if alloc {
            live.push(ctx.memalloc(black_box(size)).expect("memalloc"));
            allocs += 1;
        } else {
            let k = next() as usize % live.len();
            drop(black_box(live.swap_remove(k)));
        }
    }
    drop(live);
}

/// The default manager with [`FLUSHED`] frees queued.
fn queued() -> Fixture {
    let f = fixture("default", false);
    for _ in 0..FLUSHED {
        drop(f.ctx.memalloc(256).expect("memalloc"));
    }
    assert_eq!(queue(&f.ctx).len(), FLUSHED, "frees queued");
    f
}

fn queue(ctx: &Context) -> &Arc<emm::plugin::PendingDeallocs> {
    ctx.deallocations()
        .expect("the default manager has a deferred queue")
}

fn limit(per_pair: u64, pairs: u64) -> LibraryBenchmarkConfig {
    LibraryBenchmarkConfig::default()
        .tool(Callgrind::default().hard_limits([(EventKind::Ir, per_pair * pairs)]))
        .clone()
}

// Each benchmark returns its fixture so that the runtime's teardown is not counted.

#[library_benchmark(config = limit(budget::SIM_RAW, PAIRS))]
#[bench::pair_256b(setup = default_manager)]
fn sim_raw(f: Fixture) -> Fixture {
    for _ in 0..PAIRS {
        let p = f.sim.mem_alloc(f.handle, black_box(256)).expect("alloc");
        // SAFETY: allocated just above, freed once, never used.
        unsafe { f.sim.mem_free(f.handle, p) }.expect("free");
    }
    f
}

// The simulator making the driver calls the default manager makes for [`PAIRS`] pairs: its
// frees are deferred and issued eleven at a time (the flush at the eleventh queued free), so
// the simulator holds up to eleven blocks and frees them in a row. This is the default
// manager's anchor: its figure minus this one is emm's own work.
#[library_benchmark(config = limit(budget::SIM_RAW_DEFERRED, PAIRS))]
#[bench::deferred_256b(setup = default_manager)]
fn sim_raw_deferred(mut f: Fixture) -> Fixture {
    let batch = DEFAULT_FLUSH_AT;
    let mut held = Vec::with_capacity(batch);
    for _ in 0..PAIRS {
        held.push(f.sim.mem_alloc(f.handle, black_box(256)).expect("alloc"));
        if held.len() == batch {
            for p in held.drain(..) {
                // SAFETY: allocated above, freed once, never used.
                unsafe { f.sim.mem_free(f.handle, p) }.expect("free");
            }
        }
    }
    // The manager's run leaves these frees queued: the fixture's teardown frees them.
    f.held = held;
    f
}

#[library_benchmark(config = limit(budget::SIM_POOL_RAW, PAIRS))]
#[bench::pair_256b(setup = default_manager)]
fn sim_pool_raw(f: Fixture) -> Fixture {
    let pool = f
        .sim
        .mem_pool_create(f.handle, f.ctx.device(), false)
        .expect("pool");
    let stream = emm::driver_sys::StreamHandle::NULL;
    for _ in 0..PAIRS {
        let p = f
            .sim
            .mem_alloc_from_pool_async(f.handle, pool, black_box(256), stream)
            .expect("alloc");
        // SAFETY: allocated just above, freed once, never used.
        unsafe { f.sim.mem_free_async(f.handle, p, stream) }.expect("free");
    }
    f
}

// A device alloc + free pair through each manager.
#[library_benchmark]
#[bench::default_256b(setup = default_manager, config = limit(budget::DEFAULT, PAIRS))]
#[bench::pool_256b(setup = pool, config = limit(budget::POOL, PAIRS))]
#[bench::async_pool_256b(setup = async_pool, config = limit(budget::ASYNC_POOL, PAIRS))]
fn device_pair(f: Fixture) -> Fixture {
    for _ in 0..PAIRS {
        drop(black_box(f.ctx.memalloc(black_box(256)).expect("memalloc")));
    }
    f
}

// A stream-ordered alloc + free pair (`memalloc_on` a created stream) through the managers
// that order reuse by stream themselves (`pool`) or through the driver (`async-pool`).
#[library_benchmark]
#[bench::pool_256b(setup = pool_on_a_stream, config = limit(budget::POOL_ON, PAIRS))]
#[bench::async_pool_256b(setup = async_pool_on_a_stream, config = limit(budget::ASYNC_POOL_ON, PAIRS))]
fn stream_pair(s: OnAStream) -> OnAStream {
    for _ in 0..PAIRS {
        drop(black_box(
            s.f.ctx
                .memalloc_on(black_box(256), &s.stream)
                .expect("memalloc_on"),
        ));
    }
    s
}

#[library_benchmark(config = limit(budget::PINNED_POOL, PAIRS))]
#[bench::pair_4kib(setup = pinned_pool)]
fn pinned_pool_pair(f: Fixture) -> Fixture {
    for _ in 0..PAIRS {
        let m = f
            .ctx
            .memhostalloc(black_box(4096), false, false, false)
            .expect("memhostalloc");
        drop(black_box(m));
    }
    f
}

// A `pool` pair of a block too large for the shards' caches: the arena's take and give. Its
// time on the GPU hosts against issue 14's target is in BENCHMARKS.md.
#[library_benchmark(config = limit(budget::POOL_LARGE, PAIRS))]
#[bench::pair_256mib(setup = pool_large)]
fn pool_large_pair(f: Fixture) -> Fixture {
    for _ in 0..PAIRS {
        drop(black_box(
            f.ctx.memalloc(black_box(LARGE)).expect("memalloc"),
        ));
    }
    f
}

#[library_benchmark(config = limit(budget::POOL_MID, PAIRS))]
#[bench::pair_16mib(setup = pool_mid)]
fn pool_mid_pair(f: Fixture) -> Fixture {
    for _ in 0..PAIRS {
        drop(black_box(f.ctx.memalloc(black_box(MID)).expect("memalloc")));
    }
    f
}

#[library_benchmark(config = limit(budget::FLUSH, 1))]
#[bench::ten_frees(setup = queued)]
fn flush(f: Fixture) -> Fixture {
    let n = queue(&f.ctx).flush().expect("flush");
    assert_eq!(n, FLUSHED);
    f
}

// The arena's path: most of the workload's requests are above 256 KiB, where a shard caches
// few blocks, so about half its operations take or give a block in the arena.
#[library_benchmark(config = limit(budget::RANDOM_POOL, RANDOM_OPS))]
#[bench::pool_2000_allocs_1mib(setup = random_pool)]
fn random_workload(f: Fixture) -> Fixture {
    random_run(&f.ctx, 0x2545_f491_4f6c_dd1d, RANDOM_ALLOCS);
    f
}

// Thousands of pointers live at the peak (about 4 600), more than the threads' spare lists
// hold: the records' boxes go through the process-wide depot and back.
#[library_benchmark(config = limit(budget::RANDOM_POOL_LARGE, RANDOM_OPS_LARGE))]
#[bench::pool_10000_allocs_1mib(setup = random_pool_large)]
fn random_workload_large(f: Fixture) -> Fixture {
    random_run(&f.ctx, 0x2545_f491_4f6c_dd1d, RANDOM_ALLOCS_LARGE);
    f
}

library_benchmark_group!(
    name = hot_paths;
    benchmarks = sim_raw, sim_raw_deferred, sim_pool_raw, device_pair, stream_pair, pool_mid_pair, pool_large_pair, pinned_pool_pair, flush, random_workload, random_workload_large
);

main!(library_benchmark_groups = hot_paths);
