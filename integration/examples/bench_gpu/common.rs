//! What every section shares: the CSV line, medians of batches, sizes, runtimes, the raw
//! driver's blocks and pools, threads timed together, the seeds.

use std::sync::Arc;
use std::time::Instant;

use emm::driver_sys::{Driver, StreamHandle};
use emm::{Adaptor, Context, PinnedPoolConfig, Runtime};

pub(crate) const MANAGERS: [&str; 3] = ["default", "pool", "async-pool"];

/// `EMM_BENCH_QUICK`, read once at start-up (a malformed value stops the run there).
pub(crate) static QUICK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

pub(crate) fn quick() -> bool {
    *QUICK.get().expect("read at start-up")
}

/// The sections `EMM_BENCH_ONLY` may name.
pub(crate) const SECTIONS: [&str; 14] = [
    "pair",
    "interleaved",
    "threads",
    "random",
    "random-pool",
    "pinned",
    "copy",
    "stream",
    "overhead",
    "live",
    "anchors",
    "mixes",
    "default",
    "ipc",
];

/// One CSV line; its fields hold no comma (each would split the line's columns).
pub(crate) fn out(
    section: &str,
    subject: &str,
    param: impl std::fmt::Display,
    threads: usize,
    value: f64,
    unit: &str,
) {
    let param = param.to_string();
    assert!(
        ![section, subject, &param, unit]
            .iter()
            .any(|f| f.contains(',')),
        "a CSV field with a comma: {section:?} {subject:?} {param:?} {unit:?}"
    );
    println!("{section},{subject},{param},{threads},{value:.3},{unit}");
}

/// Median over 5 batches of the time per operation, in nanoseconds.
pub(crate) fn per_op(iters: usize, mut batch: impl FnMut(usize)) -> f64 {
    batch(iters.div_ceil(10).max(1)); // warm up
    let samples: Vec<f64> = (0..5)
        .map(|_| {
            let t = Instant::now();
            batch(iters);
            t.elapsed().as_nanos() as f64 / iters as f64
        })
        .collect();
    median(samples)
}

/// The median of `v` (the upper one of an even count), which is not empty.
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// ns per 256-byte `malloc` + `free` pair of the host's C allocator, over `iters` pairs.
pub(crate) fn malloc_pair_ns(iters: usize) -> f64 {
    per_op(iters, |n| {
        for _ in 0..n {
            drop(std::hint::black_box(Vec::<u8>::with_capacity(256)));
        }
    })
}

/// [`per_op`] of `ctx.memalloc(size)` and its drop: ns per alloc + free pair.
pub(crate) fn memalloc_pairs(ctx: &Context, size: usize, iters: usize) -> f64 {
    per_op(iters, |n| {
        for _ in 0..n {
            drop(ctx.memalloc(size).expect("memalloc"));
        }
    })
}

pub(crate) fn runtime(
    driver: &Arc<dyn Driver>,
    manager: &str,
    pinned: bool,
    adaptors: Vec<Adaptor>,
) -> Runtime {
    Runtime::builder(Arc::clone(driver))
        .ignore_env()
        .memory_manager_name(manager)
        .pinned_host_pool(pinned.then(PinnedPoolConfig::default))
        .adaptors(adaptors)
        .build()
        .expect("runtime")
}

pub(crate) fn iters_for(size: usize, cheap: bool) -> usize {
    let base = if cheap { 20_000 } else { 200 };
    let scaled = if size >= 256 << 20 { base / 20 } else { base };
    if quick() {
        (scaled / 10).max(2)
    } else {
        scaled.max(4)
    }
}

/// The device's total memory, read once by `main` (sizes and caps stay within it, so the
/// same binary runs on the simulator's small devices).
pub(crate) static TOTAL: std::sync::OnceLock<usize> = std::sync::OnceLock::new();

pub(crate) fn sizes() -> Vec<usize> {
    let total = *TOTAL.get().expect("set by main");
    [
        256,
        4 << 10,
        64 << 10,
        1 << 20,
        16 << 20,
        256 << 20,
        1 << 30,
    ]
    .into_iter()
    .filter(|&s| s <= total / 4)
    .collect()
}

/// A raw driver pool's allocation, freed on its stream when dropped (the raw anchor of the
/// managers' held-allocation pattern).
pub(crate) struct RawBlock<'a> {
    driver: &'a dyn Driver,
    ctx: driver_sys::ContextHandle,
    ptr: driver_sys::DevicePtr,
    stream: StreamHandle,
}

impl<'a> RawBlock<'a> {
    pub(crate) fn new(
        driver: &'a dyn Driver,
        ctx: driver_sys::ContextHandle,
        pool: driver_sys::MemPoolHandle,
        size: usize,
        stream: StreamHandle,
    ) -> RawBlock<'a> {
        let ptr = driver
            .mem_alloc_from_pool_async(ctx, pool, size, stream)
            .expect("cuMemAllocFromPoolAsync");
        RawBlock {
            driver,
            ctx,
            ptr,
            stream,
        }
    }
}

impl Drop for RawBlock<'_> {
    fn drop(&mut self) {
        // SAFETY: allocated by `new` on the same stream, unused, freed once.
        unsafe { self.driver.mem_free_async(self.ctx, self.ptr, self.stream) }
            .expect("cuMemFreeAsync");
    }
}

/// One raw `cuMemAllocFromPoolAsync` + `cuMemFreeAsync` pair from `pool` on `stream`.
pub(crate) fn raw_pool_pair(
    driver: &dyn Driver,
    ctx: driver_sys::ContextHandle,
    pool: driver_sys::MemPoolHandle,
    size: usize,
    stream: StreamHandle,
) {
    drop(RawBlock::new(driver, ctx, pool, size, stream));
}

/// Aggregate pairs per second of `threads` threads, each running `work(t)` (which does
/// `per_thread` pairs): timed inside the threads, from a common start to the last one's end;
/// the median of 3 runs.
///
/// The threads start together: each checks in and spins until this thread, seeing them all
/// in, gives the start (a blocking barrier let a thread that slept in it wake a scheduler
/// tick late, which the span then counted). Each thread's own time is not used either: threads
/// that did not all run at once (more of them than cores, or a short run) would count their
/// pairs as if they had.
pub(crate) fn threaded_median(
    threads: usize,
    per_thread: usize,
    work: impl Fn(usize) + Sync,
) -> f64 {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let runs: Vec<f64> = (0..3)
        .map(|_| {
            let (ready, go) = (AtomicUsize::new(0), AtomicBool::new(false));
            std::thread::scope(|s| {
                let handles: Vec<_> = (0..threads)
                    .map(|t| {
                        let (ready, go, work) = (&ready, &go, &work);
                        s.spawn(move || {
                            ready.fetch_add(1, Ordering::AcqRel);
                            while !go.load(Ordering::Acquire) {
                                if threads >= cores {
                                    std::thread::yield_now(); // leave the cores to the others
                                } else {
                                    std::hint::spin_loop();
                                }
                            }
                            work(t);
                            Instant::now()
                        })
                    })
                    .collect();
                while ready.load(Ordering::Acquire) < threads {
                    std::thread::yield_now();
                }
                let start = Instant::now();
                go.store(true, Ordering::Release);
                let last = handles
                    .into_iter()
                    .map(|h| h.join().expect("thread"))
                    .max()
                    .expect("threads");
                (threads * per_thread) as f64 / (last - start).as_secs_f64()
            })
        })
        .collect();
    median(runs)
}

/// A driver pool of device 0 that keeps what it reserves (release threshold at its maximum),
/// as `async-pool` creates its own.
pub(crate) fn raw_pool(driver: &dyn Driver, ctx: &Context) -> driver_sys::MemPoolHandle {
    let h = ctx.handle();
    let pool = driver
        .mem_pool_create(h, ctx.device(), false)
        .expect("cuMemPoolCreate");
    driver
        .mem_pool_set_release_threshold(h, pool, u64::MAX)
        .expect("release threshold");
    pool
}

/// The seeds of RMM's random workload (the first is the one the replay log records).
pub(crate) const SEEDS: [u64; 5] = [
    0x2545_f491_4f6c_dd1d,
    0x9e37_79b9_7f4a_7c15,
    0xd1b5_4a32_d192_ed03,
    0x6a09_e667_f3bc_c909,
    0xbb67_ae85_84ca_a73b,
];

/// The workload's random numbers: xorshift64 from `seed`.
pub(crate) fn xorshift(mut rng: u64) -> impl FnMut() -> u64 {
    move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    }
}

/// The simulated device's memory when `EMM_DRIVER=sim`: an H100's 80 GiB.
pub(crate) const SIM_DEVICE_BYTES: usize = 80 << 30;
