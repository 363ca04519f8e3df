//! The GPU benchmark: in one process, times the raw driver (`cuMemAlloc`, the driver's default
//! stream-ordered pool, `cuMemHostAlloc`, copies) and every emm manager on the same sizes and
//! workloads, and prints one CSV line per measurement (`section,subject,param,threads,value,unit`)
//! followed by nothing else; `BENCHMARKS.md` is made from that output.
//!
//! ```text
//! cargo run --release -p integration --example bench_gpu            # GPU (or the simulator)
//! EMM_DRIVER=sim cargo run --release -p integration --example bench_gpu
//! EMM_BENCH_QUICK=1 ...                                             # fewer iterations
//! ```
//!
//! Figures are medians of 5 batches; each batch times many operations and divides. On the
//! simulator (a device of 80 GiB, so that workloads sized by the device's memory are the GPU
//! run's) the numbers are bookkeeping plus the simulator's own cost, not GPU figures; a cached
//! `pool` pair makes no driver call, so there it is the same path as on the GPU.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use emm::driver_sys::{DevicePtr, Driver, StreamHandle};
use emm::{Adaptor, Context, PinnedPoolConfig, Runtime, replay};

const MANAGERS: [&str; 3] = ["default", "pool", "async-pool"];

/// `EMM_BENCH_QUICK`, read once at start-up (a malformed value stops the run there).
static QUICK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

fn quick() -> bool {
    *QUICK.get().expect("read at start-up")
}

/// The sections `EMM_BENCH_ONLY` may name.
const SECTIONS: [&str; 14] = [
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
fn out(
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
fn per_op(iters: usize, mut batch: impl FnMut(usize)) -> f64 {
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
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// ns per 256-byte `malloc` + `free` pair of the host's C allocator, over `iters` pairs.
fn malloc_pair_ns(iters: usize) -> f64 {
    per_op(iters, |n| {
        for _ in 0..n {
            drop(std::hint::black_box(Vec::<u8>::with_capacity(256)));
        }
    })
}

/// [`per_op`] of `ctx.memalloc(size)` and its drop: ns per alloc + free pair.
fn memalloc_pairs(ctx: &Context, size: usize, iters: usize) -> f64 {
    per_op(iters, |n| {
        for _ in 0..n {
            drop(ctx.memalloc(size).expect("memalloc"));
        }
    })
}

fn runtime(
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

fn iters_for(size: usize, cheap: bool) -> usize {
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
static TOTAL: std::sync::OnceLock<usize> = std::sync::OnceLock::new();

fn sizes() -> Vec<usize> {
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
struct RawBlock<'a> {
    driver: &'a dyn Driver,
    ctx: driver_sys::ContextHandle,
    ptr: driver_sys::DevicePtr,
    stream: StreamHandle,
}

impl<'a> RawBlock<'a> {
    fn new(
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
fn raw_pool_pair(
    driver: &dyn Driver,
    ctx: driver_sys::ContextHandle,
    pool: driver_sys::MemPoolHandle,
    size: usize,
    stream: StreamHandle,
) {
    drop(RawBlock::new(driver, ctx, pool, size, stream));
}

/// Alloc + free pairs per size: raw driver, driver pool, every manager.
fn alloc_free_pairs(driver: &Arc<dyn Driver>) {
    let probe = runtime(driver, "default", false, vec![]);
    let ctx = probe.context(0).expect("context");
    let h = ctx.handle();
    let pool = driver
        .device_default_mem_pool(0.into())
        .expect("default pool");
    driver
        .mem_pool_set_release_threshold(h, pool, u64::MAX)
        .expect("release threshold");
    let stream = StreamHandle::NULL;
    for size in sizes() {
        let ns = per_op(iters_for(size, false), |n| {
            for _ in 0..n {
                let p = driver.mem_alloc(h, size).expect("cuMemAlloc");
                // SAFETY: allocated just above, unused, freed once.
                unsafe { driver.mem_free(h, p) }.expect("cuMemFree");
            }
        });
        out("pair", "cuMemAlloc", size, 1, ns, "ns");
        let ns = per_op(iters_for(size, true), |n| {
            for _ in 0..n {
                raw_pool_pair(&**driver, h, pool, size, stream);
            }
        });
        out("pair", "driver-pool", size, 1, ns, "ns");
    }
    driver.stream_synchronize(h, stream).expect("sync");
    driver.mem_pool_trim_to(h, pool, 0).expect("trim");
    drop(ctx);
    drop(probe);
    for manager in MANAGERS {
        let rt = runtime(driver, manager, false, vec![]);
        let ctx = rt.context(0).expect("context");
        for size in sizes() {
            let ns = memalloc_pairs(&ctx, size, iters_for(size, manager != "default"));
            out("pair", manager, size, 1, ns, "ns");
        }
        ctx.trim().expect("trim");
    }
    host_anchors();
}

/// `async-pool`'s pairs against the raw driver pool's, taking turns in short batches: the
/// host's pair time moves by half between phases that last seconds, even within a process, so
/// pairs timed one subject after another (the `pair` and `stream` sections) can land in
/// different phases. Here each round times a batch of every subject in turn, and each ratio
/// is the median over the rounds of the two batches' ratio in one round. The raw pair is on a
/// pool created as `async-pool` creates its own (release threshold at its maximum), on the
/// stream the manager uses: the legacy default stream for `memalloc`, a created stream (the
/// same one) for `memalloc_on` and for `memalloc_on_raw` (the same pair through the stream's
/// handle, keeping no owner of the stream). With no context current on the thread, then (on
/// the GPU) with device 0's primary context current, as host runtimes run.
fn interleaved_pairs(driver: &Arc<dyn Driver>, simulated: bool) {
    let (rounds, batch) = if quick() { (31, 1_000) } else { (101, 2_000) };
    let measure = |how: &str| {
        let rt = runtime(driver, "async-pool", false, vec![]);
        let ctx = rt.context(0).expect("context");
        let h = ctx.handle();
        let own = raw_pool(driver.as_ref(), &ctx);
        let s = ctx.create_stream_with(true, 0).expect("stream");
        let legacy = StreamHandle::NULL;
        for size in [256usize, 64 << 10, 1 << 20] {
            let subjects: [(&str, &dyn Fn()); 5] = [
                ("raw-own-pool legacy", &|| {
                    raw_pool_pair(&**driver, h, own, size, legacy)
                }),
                ("async-pool memalloc", &|| {
                    drop(ctx.memalloc(size).expect("memalloc"))
                }),
                ("raw-own-pool stream", &|| {
                    raw_pool_pair(&**driver, h, own, size, s.handle())
                }),
                ("async-pool memalloc_on", &|| {
                    drop(ctx.memalloc_on(size, &s).expect("memalloc_on"))
                }),
                // Through the stream's handle: no owner kept and no context check, the two
                // things `memalloc_on` does beyond it (bench-results/runs.md run AD).
                ("async-pool memalloc_on_raw", &|| {
                    // SAFETY: `s` outlives every block (synchronised before it drops below),
                    // and is a stream of `ctx`'s context.
                    drop(unsafe { ctx.memalloc_on_raw(size, s.handle()) }.expect("raw"))
                }),
            ];
            let mut ns = vec![Vec::with_capacity(rounds); subjects.len()];
            for round in 0..=rounds {
                for (i, (_, pair)) in subjects.iter().enumerate() {
                    let t = Instant::now();
                    for _ in 0..batch {
                        pair();
                    }
                    if round > 0 {
                        // round 0 warms up
                        ns[i].push(t.elapsed().as_nanos() as f64 / batch as f64);
                    }
                }
            }
            for (i, (name, _)) in subjects.iter().enumerate() {
                out(
                    "interleaved",
                    &format!("{name} ({how})"),
                    size,
                    1,
                    median(ns[i].clone()),
                    "ns",
                );
            }
            for (what, manager, raw) in [
                ("memalloc", 1, 0),
                ("memalloc_on", 3, 2),
                ("memalloc_on_raw", 4, 2),
            ] {
                let ratios = (0..rounds).map(|k| ns[manager][k] / ns[raw][k]).collect();
                out(
                    "interleaved",
                    &format!("async-pool {what} / raw ({how})"),
                    size,
                    1,
                    median(ratios),
                    "x",
                );
            }
        }
        s.synchronize().expect("sync");
        driver.stream_synchronize(h, legacy).expect("sync");
        ctx.trim().expect("trim");
        driver.mem_pool_trim_to(h, own, 0).expect("trim");
        // SAFETY: the pool is this function's; everything allocated from it was freed above,
        // and the streams it was used on are synchronised.
        unsafe { driver.mem_pool_destroy(h, own) }.expect("cuMemPoolDestroy");
    };
    measure("no context current");
    if !simulated {
        // Device 0's primary context, current on this thread while `_cuda` lives.
        let _cuda = cudarc::driver::CudaContext::new(0).expect("cudarc context");
        measure("context current");
    }
}

/// The host's own costs, in the same run as the pairs: the C allocator's 256-byte pair, and
/// the `pool` pair on the simulator (a cached pair makes no driver call, so it differs from
/// the `pool` row above only by the host's share). Two hosts' `pool` rows compare through
/// these.
fn host_anchors() {
    out(
        "pair",
        "host malloc",
        256,
        1,
        malloc_pair_ns(iters_for(256, true)),
        "ns",
    );
    let sim: Arc<dyn Driver> = Arc::new(driver_mock::SimDriver::new(
        driver_mock::SimConfig::single(1 << 30),
    ));
    let rt = runtime(&sim, "pool", false, vec![]);
    let ctx = rt.context(0).expect("context");
    let ns = memalloc_pairs(&ctx, 256, iters_for(256, true));
    out("pair", "pool on the simulator", 256, 1, ns, "ns");
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
fn threaded_median(threads: usize, per_thread: usize, work: impl Fn(usize) + Sync) -> f64 {
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
fn raw_pool(driver: &dyn Driver, ctx: &Context) -> driver_sys::MemPoolHandle {
    let h = ctx.handle();
    let pool = driver
        .mem_pool_create(h, ctx.device(), false)
        .expect("cuMemPoolCreate");
    driver
        .mem_pool_set_release_threshold(h, pool, u64::MAX)
        .expect("release threshold");
    pool
}

/// Aggregate throughput of small alloc + free pairs on 1 to 32 threads, beside the host C
/// allocator's and the raw driver pool's.
fn scaling(driver: &Arc<dyn Driver>) {
    // The host's own scaling, for the targets' ratios: the C allocator's pairs of the same
    // sizes in the same pattern (its per-thread caches share nothing), so that what the
    // host itself loses with threads (clock boost, hyper-threads sharing a core) shows
    // beside the pools' rows. The host-only rows (this and `pool`, whose cached pairs make no
    // driver call) run ten times the pairs of `async-pool`'s: a run of a few milliseconds,
    // long beside the threads' wake-up from the barrier.
    let host_only = if quick() { 200_000 } else { 2_000_000 };
    let per_thread = host_only;
    for threads in [1usize, 2, 4, 8, 16, 32] {
        let rate = threaded_median(threads, per_thread, |t| {
            holding(8, per_thread, |i| {
                std::hint::black_box(Vec::<u8>::with_capacity(256 << ((i + t) % 8)))
            });
        });
        out(
            "threads",
            "host malloc",
            "256B-32KiB",
            threads,
            rate / 1e6,
            "Mpairs/s",
        );
    }
    for manager in ["pool", "async-pool"] {
        let rt = runtime(driver, manager, false, vec![]);
        let ctx = rt.context(0).expect("context");
        let per_thread = match manager {
            "pool" => host_only,
            _ if quick() => 20_000,
            _ => 200_000,
        };
        for threads in [1usize, 2, 4, 8, 16, 32] {
            let rate = threaded_median(threads, per_thread, |t| {
                holding(8, per_thread, |i| {
                    ctx.memalloc(256 << ((i + t) % 8)).expect("memalloc")
                });
            });
            out(
                "threads",
                manager,
                "256B-32KiB",
                threads,
                rate / 1e6,
                "Mpairs/s",
            );
        }
        ctx.trim().expect("trim");
    }
    // The anchor: the raw driver pool's allocations and frees from the same threads in the
    // managers' pattern (eight allocations held, then freed, sizes cycling from 256 B to
    // 32 KiB), all on the legacy default stream (where `async-pool`'s `memalloc` orders them)
    // and each on its thread's default stream (`CU_STREAM_PER_THREAD`). Until aa1cb98 these
    // rows freed each block right after allocating it, which the managers' rows do not.
    let rt = runtime(driver, "default", false, vec![]);
    let ctx = rt.context(0).expect("context");
    let h = ctx.handle();
    let pool = raw_pool(driver.as_ref(), &ctx);
    let per_thread = if quick() { 20_000 } else { 100_000 };
    for (name, stream) in [
        ("raw pool legacy stream 8 held", StreamHandle::LEGACY),
        (
            "raw pool per-thread stream 8 held",
            StreamHandle::PER_THREAD,
        ),
    ] {
        for threads in [1usize, 2, 8, 16] {
            let rate = threaded_median(threads, per_thread, |t| {
                holding(8, per_thread, |i| {
                    RawBlock::new(driver.as_ref(), h, pool, 256 << ((i + t) % 8), stream)
                });
                driver.stream_synchronize(h, stream).expect("sync");
            });
            out(
                "threads",
                name,
                "256B-32KiB",
                threads,
                rate / 1e6,
                "Mpairs/s",
            );
        }
    }
    driver
        .stream_synchronize(h, StreamHandle::LEGACY)
        .expect("sync");
    // SAFETY: every allocation from the pool was freed, and the streams are synchronised.
    unsafe { driver.mem_pool_destroy(h, pool) }.expect("destroy");
}

/// The harness's two ways (issue 14, item 5), on the GPU only: every pair measured first with
/// no context current on the thread (so `CudaDriver` pushes and pops it around each call) and
/// then with device 0's primary context made current once, as host runtimes do (bound by
/// cudarc's `CudaContext::new`); and bare-cudarc anchors (`cuMemAlloc`, `cuMemAllocAsync` on
/// the device's default pool, `cuMemHostAlloc`, each with its free) in the same process, with
/// the context current.
fn anchors(driver: &Arc<dyn Driver>, simulated: bool) {
    if simulated {
        eprintln!("bench_gpu: section anchors skipped: it needs the CUDA driver (cudarc's calls)");
        return;
    }
    let sizes = [256usize, 1 << 20];
    let measure = |how: &str| {
        let rt = runtime(driver, "default", false, vec![]);
        let ctx = rt.context(0).expect("context");
        let h = ctx.handle();
        for size in sizes {
            let ns = per_op(2_000, |n| {
                for _ in 0..n {
                    let p = driver.mem_alloc(h, size).expect("cuMemAlloc");
                    // SAFETY: allocated just above, unused, freed once.
                    unsafe { driver.mem_free(h, p) }.expect("cuMemFree");
                }
            });
            out(
                "anchors",
                &format!("emm Driver cuMemAlloc ({how})"),
                size,
                1,
                ns,
                "ns/pair",
            );
            let ns = per_op(2_000, |n| {
                for _ in 0..n {
                    let p = driver.mem_host_alloc(h, size, 0).expect("cuMemHostAlloc");
                    // SAFETY: allocated just above, unused, freed once.
                    unsafe { driver.mem_free_host(h, p) }.expect("cuMemFreeHost");
                }
            });
            out(
                "anchors",
                &format!("emm Driver cuMemHostAlloc ({how})"),
                size,
                1,
                ns,
                "ns/pair",
            );
        }
        drop((ctx, rt));
        for manager in MANAGERS {
            let rt = runtime(driver, manager, false, vec![]);
            let ctx = rt.context(0).expect("context");
            for size in sizes {
                let iters = iters_for(size, manager != "default").min(20_000);
                let ns = memalloc_pairs(&ctx, size, iters);
                out(
                    "anchors",
                    &format!("{manager} ({how})"),
                    size,
                    1,
                    ns,
                    "ns/pair",
                );
            }
            ctx.trim().expect("trim");
        }
    };
    measure("no context current");
    // Device 0's primary context, current on this thread from here on: emm's calls find it
    // current and push nothing.
    let cuda = cudarc::driver::CudaContext::new(0).expect("cudarc context");
    measure("context current");
    let stream = std::ptr::null_mut(); // the legacy default stream
    for size in sizes {
        let ns = per_op(2_000, |n| {
            for _ in 0..n {
                // SAFETY: a plain allocation in the current context, freed at once, unused.
                unsafe {
                    let p = cudarc::driver::result::malloc_sync(size).expect("cuMemAlloc");
                    cudarc::driver::result::free_sync(p).expect("cuMemFree");
                }
            }
        });
        out("anchors", "bare cudarc cuMemAlloc", size, 1, ns, "ns/pair");
        let ns = per_op(20_000, |n| {
            for _ in 0..n {
                // SAFETY: stream-ordered on the legacy stream from the device's default pool,
                // freed on it at once, unused.
                unsafe {
                    let p = cudarc::driver::result::malloc_async(stream, size)
                        .expect("cuMemAllocAsync");
                    cudarc::driver::result::free_async(p, stream).expect("cuMemFreeAsync");
                }
            }
        });
        out(
            "anchors",
            "bare cudarc cuMemAllocAsync (default pool)",
            size,
            1,
            ns,
            "ns/pair",
        );
        let ns = per_op(2_000, |n| {
            for _ in 0..n {
                // SAFETY: page-locked host memory, freed at once, unused.
                unsafe {
                    let p = cudarc::driver::result::malloc_host(size, 0).expect("cuMemHostAlloc");
                    cudarc::driver::result::free_host(p).expect("cuMemFreeHost");
                }
            }
        });
        out(
            "anchors",
            "bare cudarc cuMemHostAlloc",
            size,
            1,
            ns,
            "ns/pair",
        );
    }
    cuda.synchronize().expect("sync");
}

/// The seeds of RMM's random workload (the first is the one the replay log records).
const SEEDS: [u64; 5] = [
    0x2545_f491_4f6c_dd1d,
    0x9e37_79b9_7f4a_7c15,
    0xd1b5_4a32_d192_ed03,
    0x6a09_e667_f3bc_c909,
    0xbb67_ae85_84ca_a73b,
];

/// Memory overhead of RMM's random workload: peak bytes held from the driver over peak bytes
/// live (asked for), per manager and seed, beside the raw driver pool's own reserved and used
/// high-water marks for the same sequence in the same run (`cuMemPoolGetAttribute`).
fn overhead(driver: &Arc<dyn Driver>) {
    let cap: usize = (16_000usize << 20).min(*TOTAL.get().expect("set by main") / 2);
    let seeds = &SEEDS[..3];
    let counts: &[usize] = if quick() {
        &[10_000]
    } else {
        &[10_000, 100_000]
    };
    for max_mib in [1usize, 64].into_iter().filter(|m| (m << 20) <= cap / 16) {
        for &n in counts {
            for (k, &seed) in seeds.iter().enumerate() {
                let param = format!("n={n} max={max_mib}MiB seed={k}");
                for manager in ["pool", "async-pool"] {
                    let rt = runtime(driver, manager, false, vec![]);
                    let ctx = rt.context(0).expect("context");
                    let (_, _, live) = run_random_seeded(&ctx, n, max_mib << 20, cap, seed);
                    let held = ctx.pool_stats().device.map_or(0, |s| s.peak_held_bytes);
                    out(
                        "overhead",
                        manager,
                        &param,
                        1,
                        held as f64 / live as f64,
                        "held/live",
                    );
                    ctx.trim().expect("trim");
                }
                // The raw driver pool, the same sequence (sizes and frees) on one stream.
                let rt = runtime(driver, "default", false, vec![]);
                let ctx = rt.context(0).expect("context");
                let h = ctx.handle();
                let pool = raw_pool(driver.as_ref(), &ctx);
                let stream = StreamHandle::LEGACY;
                let live = raw_random(
                    driver.as_ref(),
                    h,
                    pool,
                    stream,
                    n,
                    max_mib << 20,
                    cap,
                    seed,
                );
                driver.stream_synchronize(h, stream).expect("sync");
                let usage = driver.mem_pool_usage(h, pool).expect("usage");
                out(
                    "overhead",
                    "raw pool reserved",
                    &param,
                    1,
                    usage.reserved_high as f64 / live as f64,
                    "held/live",
                );
                out(
                    "overhead",
                    "raw pool used",
                    &param,
                    1,
                    usage.used_high as f64 / live as f64,
                    "held/live",
                );
                // SAFETY: the pool is this function's; everything allocated from it was freed
                // on `stream`, which is synchronised.
                unsafe { driver.mem_pool_destroy(h, pool) }.expect("destroy");
            }
        }
    }
}

/// Spawns and joins `n` threads that each make one `pool` allocation: thread churn, which with
/// a process-wide thread counter (before the dense slots of `pool/shards.rs`) put later live
/// threads on shards other live threads used.
fn churn(ctx: &Context, n: usize) {
    for _ in 0..n {
        std::thread::scope(|s| {
            s.spawn(|| drop(ctx.memalloc(256).expect("memalloc")));
        });
    }
}

/// `n` allocations from `alloc(i)`, each kept until `hold` are held, then all dropped.
fn holding<T>(hold: usize, n: usize, mut alloc: impl FnMut(usize) -> T) {
    let mut held = Vec::with_capacity(hold);
    for i in 0..n {
        held.push(alloc(i));
        if held.len() == hold {
            held.clear();
        }
    }
}

/// One row of the `mixes` table: 37 threads come and go, then `threads` threads each run
/// `work(t)` (`per_thread` pairs); M pairs/s, median of 3.
fn mix(
    ctx: &Context,
    subject: &str,
    param: &str,
    threads: usize,
    per_thread: usize,
    work: impl Fn(usize) + Sync,
) {
    churn(ctx, 37);
    let before = ctx.pool_stats().pinned_host.unwrap_or_default();
    let rate = threaded_median(threads, per_thread, work);
    out("mixes", subject, param, threads, rate / 1e6, "Mpairs/s");
    // The pinned pool's driver calls during the row: a cached pool should make none in its
    // steady state (a `cuMemHostAlloc` costs hundreds of microseconds on the GPU).
    if subject.starts_with("pinned") {
        let after = ctx.pool_stats().pinned_host.unwrap_or_default();
        let grows = after.grows - before.grows;
        let trimmed = after.trimmed_bytes - before.trimmed_bytes;
        out(
            "mixes",
            &format!("{subject} cuMemHostAlloc calls"),
            param,
            threads,
            grows as f64,
            "calls",
        );
        out(
            "mixes",
            &format!("{subject} bytes freed over the cache bound"),
            param,
            threads,
            trimmed as f64,
            "bytes",
        );
    }
}

/// The thread table's other mixes (issue 14): frees on another thread, blocks above 1 MiB,
/// the pinned host pool, each on 1 to 16 threads after 37 threads came and went; M pairs/s,
/// median of 3 runs timed inside the threads.
fn thread_mixes(driver: &Arc<dyn Driver>) {
    let rt = runtime(driver, "pool", true, vec![]);
    let ctx = rt.context(0).expect("context");
    let per_thread = if quick() { 20_000 } else { 100_000 };
    let total = *TOTAL.get().expect("set by main");
    for threads in [1usize, 2, 8, 16] {
        // Each thread allocates batches of 64 small blocks and hands each batch to the next
        // thread, which drops it: every block is freed on a thread other than its own (on one
        // thread, on itself). Small blocks (256 B to 1 KiB), since a thread that runs ahead
        // leaves its batches waiting in the next thread's mailbox.
        freed_elsewhere(
            &ctx,
            "pool freed on another thread",
            "256B-1KiB",
            threads,
            per_thread,
            |i, t| ctx.memalloc(256 << ((i + t) % 3)).expect("memalloc"),
        );
        // The same with the pinned host pool (4 to 16 KiB): a thread that misses its own
        // shard takes what others freed from theirs.
        freed_elsewhere(
            &ctx,
            "pinned pool freed on another thread",
            "4KiB-16KiB",
            threads,
            per_thread,
            |i, t| {
                ctx.memhostalloc(4096 << ((i + t) % 3), false, false, false)
                    .expect("memhostalloc")
            },
        );
        // Blocks of 2 to 16 MiB (the arena, not the size classes), 4 held per thread.
        if 16 * threads * (16 << 20) <= total / 2 {
            mix(
                &ctx,
                "pool 2-16 MiB",
                "2MiB-16MiB",
                threads,
                per_thread / 10,
                |t| {
                    holding(4, per_thread / 10, |i| {
                        ctx.memalloc((2 << 20) << ((i + t) % 4)).expect("memalloc")
                    });
                },
            );
        }
        // The pinned host pool: 4 KiB to 512 KiB, 8 held per thread.
        mix(
            &ctx,
            "pinned pool",
            "4KiB-512KiB",
            threads,
            per_thread,
            |t| {
                holding(8, per_thread, |i| {
                    ctx.memhostalloc(4096 << ((i + t) % 8), false, false, false)
                        .expect("memhostalloc")
                });
            },
        );
    }
    ctx.trim().expect("trim");
}

/// One row of [`thread_mixes`]: each of `threads` threads allocates batches of 64 blocks with
/// `alloc(i, thread)` and hands each batch to the next thread, which drops it. A thread whose
/// next thread already has [`IN_FLIGHT`] batches waiting drops what waits for itself until
/// that thread catches up, and a thread done with its batches keeps dropping what reaches it
/// until every thread is done. Without the bound, a thread the scheduler left behind (or one
/// that had finished) let batches pile up: the blocks in flight grew without limit (55 000
/// pinned blocks, 528 MB, at the end of a quick run on 16 threads), and the row timed the
/// driver's allocations of an ever larger working set, not the pool.
fn freed_elsewhere<T: Send>(
    ctx: &emm::Context,
    name: &str,
    param: &str,
    threads: usize,
    per_thread: usize,
    alloc: impl Fn(usize, usize) -> T + Sync,
) {
    /// The most batches that wait for one thread.
    const IN_FLIGHT: usize = 4;
    let mailboxes: Vec<std::sync::Mutex<Vec<Vec<T>>>> =
        (0..threads).map(|_| Default::default()).collect();
    // Threads done, over every run of the row (a run starts after the last one's joined).
    let finished = AtomicUsize::new(0);
    let drop_mine = |t: usize| drop(std::mem::take(&mut *mailboxes[t].lock().expect("mailbox")));
    mix(ctx, name, param, threads, per_thread, |t| {
        let all_done = (finished.load(Ordering::Acquire) / threads + 1) * threads;
        let next = (t + 1) % threads;
        let mut batch = Vec::with_capacity(64);
        for i in 0..per_thread {
            batch.push(alloc(i, t));
            if batch.len() == 64 {
                while next != t && mailboxes[next].lock().expect("mailbox").len() >= IN_FLIGHT {
                    drop_mine(t);
                    std::thread::yield_now();
                }
                mailboxes[next]
                    .lock()
                    .expect("mailbox")
                    .push(std::mem::take(&mut batch));
                drop_mine(t);
            }
        }
        finished.fetch_add(1, Ordering::AcqRel);
        while finished.load(Ordering::Acquire) < all_done {
            drop_mine(t);
            std::thread::yield_now();
        }
        drop_mine(t);
    });
}

/// The default manager measured fairly (issue 14): its frees are deferred, 10 at a time, so it
/// issues 11 `cuMemAlloc` and then 11 `cuMemFree`; the anchor is the raw driver making the same
/// sequence, beside the raw alternating pair, the manager with the deferral off
/// (`max_count` 0: every free flushed at once), and the bytes the deferred frees held.
fn default_fairly(driver: &Arc<dyn Driver>) {
    let total = *TOTAL.get().expect("set by main");
    let deferral_off = Runtime::builder(Arc::clone(driver))
        .ignore_env()
        .memory_manager_name("default")
        .dealloc_config(emm::DeallocConfig {
            max_count: 0,
            ..emm::DeallocConfig::default()
        })
        .build()
        .expect("runtime");
    let off = deferral_off.context(0).expect("context");
    let numba = runtime(driver, "default", false, vec![]);
    let ctx = numba.context(0).expect("context");
    let h = ctx.handle();
    for size in [256usize, 1 << 20, 64 << 20, 256 << 20]
        .into_iter()
        .filter(|&s| 11 * s <= total / 4)
    {
        let rounds = if quick() { 4 } else { 40 };
        let ns = per_op(rounds * 11, |n| {
            for _ in 0..n.div_ceil(11) {
                let held: Vec<DevicePtr> = (0..11)
                    .map(|_| driver.mem_alloc(h, size).expect("cuMemAlloc"))
                    .collect();
                for p in held {
                    // SAFETY: allocated just above, unused, freed once.
                    unsafe { driver.mem_free(h, p) }.expect("cuMemFree");
                }
            }
        });
        out(
            "default",
            "raw 11 allocs then 11 frees",
            size,
            1,
            ns,
            "ns/pair",
        );
        let ns = per_op(rounds * 11, |n| {
            for _ in 0..n {
                let p = driver.mem_alloc(h, size).expect("cuMemAlloc");
                // SAFETY: allocated just above, unused, freed once.
                unsafe { driver.mem_free(h, p) }.expect("cuMemFree");
            }
        });
        out("default", "raw alternating", size, 1, ns, "ns/pair");
        let mut peak_pending = 0usize;
        let ns = per_op(rounds * 11, |n| {
            for _ in 0..n {
                drop(ctx.memalloc(size).expect("memalloc"));
                let pending = ctx.deallocations().map_or(0, |q| q.pending_bytes());
                peak_pending = peak_pending.max(pending);
            }
        });
        out("default", "default manager", size, 1, ns, "ns/pair");
        out(
            "default",
            "default manager peak bytes in deferred frees",
            size,
            1,
            peak_pending as f64,
            "bytes",
        );
        let ns = per_op(rounds * 11, |n| {
            for _ in 0..n {
                drop(off.memalloc(size).expect("memalloc"));
            }
        });
        out(
            "default",
            "default manager max_count 0",
            size,
            1,
            ns,
            "ns/pair",
        );
    }
}

/// The workload's random numbers: xorshift64 from `seed`.
fn xorshift(mut rng: u64) -> impl FnMut() -> u64 {
    move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    }
}

/// The random workload of [`run_random_seeded`] on a raw driver pool; returns peak live bytes.
#[allow(clippy::too_many_arguments)]
fn raw_random(
    driver: &dyn Driver,
    ctx: driver_sys::ContextHandle,
    pool: driver_sys::MemPoolHandle,
    stream: StreamHandle,
    n: usize,
    max: usize,
    cap: usize,
    seed: u64,
) -> usize {
    let mut next = xorshift(seed);
    let mut live: Vec<(DevicePtr, usize)> = Vec::new();
    let (mut bytes, mut peak_bytes, mut allocs) = (0usize, 0usize, 0usize);
    let free = |p: DevicePtr| {
        // SAFETY: allocated from the pool on `stream`, freed once, on it.
        unsafe { driver.mem_free_async(ctx, p, stream) }.expect("cuMemFreeAsync")
    };
    while allocs < n {
        let alloc = (next() % 100) < 73 || live.is_empty();
        let size = (next() as usize % max) + 1;
        if alloc && bytes + size <= cap {
            let p = driver
                .mem_alloc_from_pool_async(ctx, pool, size, stream)
                .expect("cuMemAllocFromPoolAsync");
            bytes += size;
            live.push((p, size));
            peak_bytes = peak_bytes.max(bytes);
            allocs += 1;
        } else if !live.is_empty() {
            let k = next() as usize % live.len();
            let (p, size) = live.swap_remove(k);
            bytes -= size;
            free(p);
        }
    }
    for (p, _) in live {
        free(p);
    }
    peak_bytes
}

/// Pair cost with many blocks live: 0, 10 000, 100 000 and 1 000 000 blocks of 256 B held,
/// then alloc + free pairs of 256 B and 64 KiB beside them (median of 5 batches).
fn live_blocks(driver: &Arc<dyn Driver>, simulated: bool) {
    for manager in ["pool", "async-pool"] {
        let rt = runtime(driver, manager, false, vec![]);
        let ctx = rt.context(0).expect("context");
        // The host's side of a million live blocks without the blocks: as many heap boxes of
        // 112 B (about a pointer's record), held while no block is. A rise here comes from
        // the heap's size (the host's paging), not from the pool's state.
        let boxes: Vec<Box<[u64; 14]>> = (0..1_000_000u64).map(|i| Box::new([i; 14])).collect();
        live_pairs(&ctx, manager, 0, " (1000000 heap boxes of 112 B held)");
        drop(boxes);
        let mut held: Vec<emm::MemoryPointer> = Vec::new();
        for target in [0usize, 10_000, 100_000, 1_000_000] {
            if simulated && manager == "async-pool" && target > 100_000 {
                // The simulator places each small allocation by searching the pages in use:
                // holding a million of them did not finish in ten minutes (2026-11-24), and
                // the row would time the simulator, not emm.
                eprintln!(
                    "bench_gpu: live-blocks async-pool {target}: skipped on the simulator (its placement of a million small allocations takes minutes; the row would time the simulator, not emm)"
                );
                continue;
            }
            while held.len() < target {
                held.push(ctx.memalloc(256).expect("memalloc"));
            }
            live_pairs(&ctx, manager, target, "");
        }
        // The way back down, after the most blocks were held: a cost that follows the live
        // blocks falls again, while a drift of the host during the run does not.
        for target in [100_000usize, 10_000, 0] {
            if held.len() <= target {
                continue;
            }
            if simulated && manager == "async-pool" {
                // After many frees the simulator's pool placement and stream bookkeeping scan
                // what was freed on every call (callgrind, 2026-11-24: `place_small` and
                // `run_one`, 7 ns a pair per freed block): the row would time the simulator.
                eprintln!(
                    "bench_gpu: live-blocks async-pool on the way down: skipped on the simulator (after mass frees its placement scans the freed blocks on every call; the row would time the simulator, not emm)"
                );
                break;
            }
            held.truncate(target);
            live_pairs(&ctx, manager, target, " (on the way down)");
        }
        drop(held);
        ctx.trim().expect("trim");
    }
}

/// The pair cost at 256 B and 64 KiB with `live` blocks held, then at 256 B once more, as
/// `live-blocks` lines: a cost that only follows the allocation of many blocks (the host
/// settling after it) fades by the repeat, one that follows the blocks held does not.
fn live_pairs(ctx: &Context, manager: &str, live: usize, note: &str) {
    for (size, again) in [(256usize, ""), (64 << 10, ""), (256, " again")] {
        let ns = memalloc_pairs(ctx, size, 20_000);
        out(
            "live-blocks",
            manager,
            format!("{live} live {size} B{again}{note}"),
            1,
            ns,
            "ns/pair",
        );
    }
}

/// RMM's random allocations: each step allocates with probability 0.73 (a size uniform in
/// 1 ..= max), otherwise frees a random live block; a cap on live bytes turns an allocation
/// into a free.
fn random_workload(driver: &Arc<dyn Driver>, log_dir: Option<&std::path::Path>) {
    let cap: usize = (16_000usize << 20).min(*TOTAL.get().expect("set by main") / 2);
    let counts: &[usize] = if quick() {
        &[1_000, 10_000]
    } else {
        &[10_000, 100_000]
    };
    for max_mib in [1usize, 64, 256]
        .into_iter()
        .filter(|m| (m << 20) <= cap / 8)
    {
        for &n in counts {
            for manager in MANAGERS {
                if manager == "default" && n > 10_000 {
                    continue; // a driver call per op; the 10 000 case shows its cost.
                }
                // Each seed on a new runtime. Cold: the seed's sequence as the pool grows.
                // Warm: the next seed's sequence (another one, not a replay) on what the
                // first left cached, as a long-running pool sees it.
                for (k, &seed) in SEEDS.iter().enumerate() {
                    let param = format!("n={n} max={max_mib}MiB seed={k}");
                    let rt = runtime(driver, manager, false, vec![]);
                    let ctx = rt.context(0).expect("context");
                    let next_seed = SEEDS[(k + 1) % SEEDS.len()];
                    let (cold, peak, _) = run_random_seeded(&ctx, n, max_mib << 20, cap, seed);
                    let (warm, _, _) = run_random_seeded(&ctx, n, max_mib << 20, cap, next_seed);
                    out("random-cold", manager, &param, 1, cold, "ns/op");
                    out("random", manager, &param, 1, warm, "ns/op");
                    out(
                        "random-peak-live",
                        manager,
                        &param,
                        1,
                        peak as f64,
                        "blocks",
                    );
                    ctx.trim().expect("trim");
                    drop((ctx, rt));
                }
                // The log adaptor's cost, and the log the replay section reads.
                if manager == "pool" && n == counts[0] && max_mib == 1 {
                    let param = format!("n={n} max={max_mib}MiB");
                    let path = log_dir.map(|d| d.join("random.csv"));
                    let adaptors = path.iter().map(|p| Adaptor::Log(p.clone())).collect();
                    let rt = runtime(driver, manager, false, adaptors);
                    let ctx = rt.context(0).expect("context");
                    let (ns, _, _) = run_random_seeded(&ctx, n, max_mib << 20, cap, SEEDS[0]);
                    out("random-cold", "pool+log", &param, 1, ns, "ns/op");
                    ctx.trim().expect("trim");
                }
            }
        }
    }
}

/// RMM's random workload on `pool` alone, for A/B runs of two builds on one host (a few
/// seconds on the simulator, where the warm figure is the same path as on the GPU: a warm
/// `pool` calls the driver only to grow): per seed, one cold run, then the next seed's
/// sequence three times on what it left cached, reporting the fastest of the three.
fn random_pool(driver: &Arc<dyn Driver>) {
    let cap: usize = (16_000usize << 20).min(*TOTAL.get().expect("set by main") / 2);
    for (n, max_mib) in [(10_000, 1usize), (100_000, 1), (10_000, 64), (100_000, 64)] {
        if (max_mib << 20) > cap / 8 {
            continue;
        }
        for (k, &seed) in SEEDS.iter().enumerate() {
            let rt = runtime(driver, "pool", false, vec![]);
            let ctx = rt.context(0).expect("context");
            run_random_seeded(&ctx, n, max_mib << 20, cap, seed);
            let next_seed = SEEDS[(k + 1) % SEEDS.len()];
            let best = (0..3)
                .map(|_| run_random_seeded(&ctx, n, max_mib << 20, cap, next_seed).0)
                .fold(f64::INFINITY, f64::min);
            let param = format!("n={n} max={max_mib}MiB seed={k}");
            out("random-pool", "pool", &param, 1, best, "ns/op");
            ctx.trim().expect("trim");
        }
    }
}

/// RMM's random workload from `seed`: ns per operation, peak live blocks, and peak live bytes
/// (the bytes asked for).
fn run_random_seeded(
    ctx: &Context,
    n: usize,
    max: usize,
    cap: usize,
    seed: u64,
) -> (f64, usize, usize) {
    let mut next = xorshift(seed);
    let mut live: Vec<emm::MemoryPointer> = Vec::new();
    let mut bytes = 0usize;
    let mut peak = 0;
    let mut peak_bytes = 0;
    let start = Instant::now();
    let mut ops = 0usize;
    let mut allocs = 0usize;
    while allocs < n {
        let alloc = (next() % 100) < 73 || live.is_empty();
        let size = (next() as usize % max) + 1;
        if alloc && bytes + size <= cap {
            match ctx.memalloc(size) {
                Ok(m) => {
                    bytes += size;
                    live.push(m);
                    peak = peak.max(live.len());
                    peak_bytes = peak_bytes.max(bytes);
                }
                Err(e) => panic!("random workload: {e}"),
            }
            allocs += 1;
        } else if !live.is_empty() {
            let k = next() as usize % live.len();
            bytes -= live.swap_remove(k).size();
        }
        ops += 1;
    }
    ops += live.len();
    drop(live);
    (
        start.elapsed().as_nanos() as f64 / ops as f64,
        peak,
        peak_bytes,
    )
}

/// Replays the log recorded by the random workload under every manager.
fn replays(driver: &Arc<dyn Driver>, log_dir: &std::path::Path) {
    let Ok(text) = std::fs::read_to_string(log_dir.join("random.csv")) else {
        return;
    };
    let events = replay::parse_log(&text).expect("the recorded log parses");
    for manager in MANAGERS {
        let rt = runtime(driver, manager, false, vec![]);
        let ctx = rt.context(0).expect("context");
        let report = replay::replay(&ctx, &events).expect("the replay reads device memory");
        assert_eq!(report.failures, 0, "{manager}: {report:?}");
        let ns = report.elapsed.as_nanos() as f64 / events.len() as f64;
        out(
            "replay",
            manager,
            format!("{} events", events.len()),
            1,
            ns,
            "ns/event",
        );
        ctx.trim().expect("trim");
    }
}

/// Pinned host memory: raw `cuMemHostAlloc` + `cuMemFreeHost` against the pinned host pool.
fn pinned(driver: &Arc<dyn Driver>) {
    let rt = runtime(driver, "default", true, vec![]);
    let ctx = rt.context(0).expect("context");
    let h = ctx.handle();
    for size in [4usize << 10, 1 << 20, 64 << 20]
        .into_iter()
        .filter(|&s| quick() || s <= 64 << 20)
    {
        let iters = if size >= 64 << 20 { 4 } else { 40 };
        let ns = per_op(if quick() { 4 } else { iters }, |n| {
            for _ in 0..n {
                let p = driver.mem_host_alloc(h, size, 0).expect("cuMemHostAlloc");
                // SAFETY: allocated just above, unused, freed once.
                unsafe { driver.mem_free_host(h, p) }.expect("cuMemFreeHost");
            }
        });
        out("pinned", "cuMemHostAlloc", size, 1, ns, "ns");
        let ns = per_op(if quick() { 10_000 } else { 200_000 }, |n| {
            for _ in 0..n {
                drop(
                    ctx.memhostalloc(size, false, false, false)
                        .expect("memhostalloc"),
                );
            }
        });
        out("pinned", "pinned-pool", size, 1, ns, "ns");
    }
    ctx.trim().expect("trim");
}

/// Copy bandwidth, host to device: pinned (the pinned pool's memory) against pageable, through
/// emm and through the raw driver; device to device likewise.
fn copies(driver: &Arc<dyn Driver>) {
    let rt = runtime(driver, "pool", true, vec![]);
    let ctx = rt.context(0).expect("context");
    let h = ctx.handle();
    let max = if quick() { 64 << 20 } else { 1 << 30 }.min(*TOTAL.get().expect("set by main") / 8);
    let mut size = 1usize << 10;
    while size <= max {
        let dev = ctx.memalloc(size).expect("memalloc");
        let dev2 = ctx.memalloc(size).expect("memalloc");
        let pinned = ctx.memhostalloc(size, false, false, false).expect("pinned");
        let pageable = vec![1u8; size];
        let iters = ((1usize << 30) / size).clamp(3, 2000) / if quick() { 10 } else { 1 };
        let iters = iters.max(3);
        let gbs = |ns: f64| size as f64 / ns;
        let ns = per_op(iters, |n| {
            for _ in 0..n {
                ctx.copy_pinned_to_device(&dev, &pinned, size)
                    .expect("copy");
            }
        });
        out("copy-htod", "emm pinned", size, 1, gbs(ns), "GB/s");
        let ns = per_op(iters, |n| {
            for _ in 0..n {
                // SAFETY: `pinned` is live host memory of `size` bytes; `dev` is live device
                // memory of `size` bytes; nothing else uses either during the copy.
                unsafe {
                    driver.memcpy_htod(
                        h,
                        dev.device_ptr(),
                        std::slice::from_raw_parts(pinned.host_ptr().0 as *const u8, size),
                    )
                }
                .expect("cuMemcpyHtoD");
            }
        });
        out("copy-htod", "raw pinned", size, 1, gbs(ns), "GB/s");
        let ns = per_op(iters, |n| {
            for _ in 0..n {
                // SAFETY: `pinned` is live host memory of `size` bytes that nothing else reads
                // or writes during the copy; `dev` is live device memory of `size` bytes.
                unsafe {
                    driver.memcpy_dtoh(
                        h,
                        std::slice::from_raw_parts_mut(pinned.host_ptr().0 as *mut u8, size),
                        dev.device_ptr(),
                    )
                }
                .expect("cuMemcpyDtoH");
            }
        });
        out("copy-dtoh", "raw pinned", size, 1, gbs(ns), "GB/s");
        let ns = per_op(iters, |n| {
            for _ in 0..n {
                ctx.copy_to_device(&dev, &pageable).expect("copy");
            }
        });
        out("copy-htod", "emm pageable", size, 1, gbs(ns), "GB/s");
        let ns = per_op(iters, |n| {
            for _ in 0..n {
                ctx.copy_device(&dev2, &dev, size).expect("copy");
            }
            // Device-to-device copies return before they finish: the batch ends with a
            // synchronisation, inside the timing.
            driver
                .stream_synchronize(h, StreamHandle::NULL)
                .expect("sync");
        });
        out("copy-dtod", "emm", size, 1, gbs(ns), "GB/s");
        let ns = per_op(iters, |n| {
            for _ in 0..n {
                // SAFETY: both are live device allocations of `size` bytes that do not overlap.
                unsafe { driver.memcpy_dtod(h, dev2.device_ptr(), dev.device_ptr(), size) }
                    .expect("cuMemcpyDtoD");
            }
            driver
                .stream_synchronize(h, StreamHandle::NULL)
                .expect("sync");
        });
        out("copy-dtod", "raw", size, 1, gbs(ns), "GB/s");
        typed_copies(&ctx, size, iters);
        size *= 8;
    }
    ctx.trim().expect("trim");
}

/// The same copies through `emm_array`'s typed arrays (f32 elements), beside the raw figures
/// `copies` prints for the size: host to device from a page-locked slice (`with_pinned`), from
/// pageable memory, device to host into the pinned slice, and device to device.
fn typed_copies(ctx: &Context, size: usize, iters: usize) {
    use emm_array::{DeviceArray, Order, with_pinned};
    let n = size / 4;
    let gbs = |ns: f64| size as f64 / ns;
    let a = DeviceArray::<f32>::new(ctx, &[n], Order::C).expect("array");
    let b = DeviceArray::<f32>::new(ctx, &[n], Order::C).expect("array");
    let mut host = vec![1f32; n];
    with_pinned(ctx, &mut host, |pinned| {
        let ns = per_op(iters, |k| {
            for _ in 0..k {
                pinned.copy_to_device(ctx, &a).expect("copy");
            }
        });
        out("copy-htod", "array pinned", size, 1, gbs(ns), "GB/s");
        let ns = per_op(iters, |k| {
            for _ in 0..k {
                pinned.copy_from_device(ctx, &a).expect("copy");
            }
        });
        out("copy-dtoh", "array pinned", size, 1, gbs(ns), "GB/s");
    })
    .expect("pin");
    let ns = per_op(iters, |k| {
        for _ in 0..k {
            a.copy_from_host(ctx, &host).expect("copy");
        }
    });
    out("copy-htod", "array pageable", size, 1, gbs(ns), "GB/s");
    let ns = per_op(iters, |k| {
        for _ in 0..k {
            b.copy_to_device(ctx, &a).expect("copy");
        }
        ctx.default_stream().synchronize().expect("sync");
    });
    out("copy-dtod", "array", size, 1, gbs(ns), "GB/s");
}

/// Stream-ordered alloc + free pairs on a created (non-blocking) stream: the raw driver's pool
/// (a pool created as `async-pool` creates its own, and the device's default pool) against
/// every manager's `memalloc_on`; then aggregate throughput with 1, 8 and 16 threads, each on
/// its own stream, and 8 threads on one shared stream (the raw pool, `pool` and `async-pool`
/// in turn for each).
fn stream_ordered(driver: &Arc<dyn Driver>) {
    let probe = runtime(driver, "default", false, vec![]);
    let ctx = probe.context(0).expect("context");
    let h = ctx.handle();
    let own = raw_pool(driver.as_ref(), &ctx);
    let default_pool = driver
        .device_default_mem_pool(0.into())
        .expect("default pool");
    driver
        .mem_pool_set_release_threshold(h, default_pool, u64::MAX)
        .expect("release threshold");
    let raw_pair = |pool, size, stream| raw_pool_pair(&**driver, h, pool, size, stream);
    let sizes = [256usize, 64 << 10, 1 << 20, 16 << 20];
    {
        let s = ctx.create_stream_with(true, 0).expect("stream");
        for size in sizes {
            let ns = per_op(iters_for(size, true), |n| {
                for _ in 0..n {
                    raw_pair(own, size, s.handle());
                }
            });
            out("stream", "raw-own-pool", size, 1, ns, "ns");
            let ns = per_op(iters_for(size, true), |n| {
                for _ in 0..n {
                    raw_pair(default_pool, size, s.handle());
                }
            });
            out("stream", "raw-default-pool", size, 1, ns, "ns");
        }
        s.synchronize().expect("sync");
    }
    resources_on_a_stream(driver, &ctx, &sizes);
    for manager in MANAGERS {
        let rt = runtime(driver, manager, false, vec![]);
        let mctx = rt.context(0).expect("context");
        let s = mctx.create_stream_with(true, 0).expect("stream");
        for size in sizes {
            let cheap = manager != "default";
            let ns = per_op(iters_for(size, cheap), |n| {
                for _ in 0..n {
                    drop(mctx.memalloc_on(size, &s).expect("memalloc_on"));
                }
            });
            out("stream", manager, size, 1, ns, "ns");
        }
        s.synchronize().expect("sync");
        mctx.trim().expect("trim");
    }
    // Threads: each allocates and frees 4 KiB .. 512 KiB blocks. For each arrangement the
    // raw pair and the managers' take turns, so that all of them see the same phase of the
    // host (its pair time moves by half between phases); each figure is the median of 3 runs
    // timed inside the threads (`threaded_median`).
    let per_thread = if quick() { 5_000 } else { 50_000 };
    let pattern = |i: usize, t: usize| 4096 << ((i + t) % 8);
    let raw_streams: Vec<emm::Stream> = (0..16)
        .map(|_| ctx.create_stream_with(true, 0).expect("stream"))
        .collect();
    let managed: Vec<(&str, emm::Runtime, emm::Context, Vec<emm::Stream>)> = ["pool", "async-pool"]
        .into_iter()
        .map(|manager| {
            let rt = runtime(driver, manager, false, vec![]);
            let mctx = rt.context(0).expect("context");
            let streams = (0..16)
                .map(|_| mctx.create_stream_with(true, 0).expect("stream"))
                .collect();
            (manager, rt, mctx, streams)
        })
        .collect();
    for (threads, shared) in [(1, false), (8, false), (16, false), (8, true)] {
        let label = if shared { "one-stream" } else { "own-streams" };
        let stream_of = |t: usize| if shared { 0 } else { t };
        let v = threaded_median(threads, per_thread, |t| {
            let s = raw_streams[stream_of(t)].handle();
            for i in 0..per_thread {
                raw_pair(own, pattern(i, t), s);
            }
        });
        let row = |subject: &str, v: f64| {
            out(
                "stream-threads",
                subject,
                label,
                threads,
                v / 1e6,
                "Mpairs/s",
            );
        };
        row("raw-own-pool", v);
        if threads > 1 {
            // The raw pair again with the thread busy for a while between pairs, as a manager
            // is with its own work: how the driver's throughput under threads answers time
            // spent between its calls, apart from what that time is spent on.
            for gap_ns in [100u64, 300, 1000] {
                let gap = std::time::Duration::from_nanos(gap_ns);
                let v = threaded_median(threads, per_thread, |t| {
                    let s = raw_streams[stream_of(t)].handle();
                    for i in 0..per_thread {
                        raw_pair(own, pattern(i, t), s);
                        let until = Instant::now() + gap;
                        while Instant::now() < until {
                            std::hint::spin_loop();
                        }
                    }
                });
                row(&format!("raw-own-pool-gap-{gap_ns}ns"), v);
            }
        }
        for (manager, _, mctx, streams) in &managed {
            let v = threaded_median(threads, per_thread, |t| {
                let s = &streams[stream_of(t)];
                for i in 0..per_thread {
                    drop(mctx.memalloc_on(pattern(i, t), s).expect("memalloc_on"));
                }
            });
            row(manager, v);
            if *manager == "async-pool" {
                // The same through the stream's handle (`memalloc_on_raw`): no owner kept, so
                // the difference is what keeping the stream alive costs the pair.
                let v = threaded_median(threads, per_thread, |t| {
                    let s = streams[stream_of(t)].handle();
                    for i in 0..per_thread {
                        // SAFETY: the streams outlive every block (synchronised and trimmed
                        // below before they drop).
                        drop(unsafe { mctx.memalloc_on_raw(pattern(i, t), s) }.expect("raw"));
                    }
                });
                row("async-pool-handle", v);
            }
        }
    }
    for s in &raw_streams {
        s.synchronize().expect("sync");
    }
    driver.mem_pool_trim_to(h, own, 0).expect("trim");
    // SAFETY: the pool is this function's; everything allocated from it was freed above.
    unsafe { driver.mem_pool_destroy(h, own) }.expect("cuMemPoolDestroy");
    drop(raw_streams);
    for (_, rt, mctx, streams) in managed {
        for s in &streams {
            s.synchronize().expect("sync");
        }
        drop(streams);
        mctx.trim().expect("trim");
        drop((mctx, rt));
    }
}

/// cuda.core's resources in emm (device, pinned, managed: `allocate` on a stream, freed on it
/// by the drop), each beside the raw pair on a pool of its kind made the same way, in the same
/// process: for the device resource that is `raw-own-pool` above; for the others a pool in
/// host memory and a managed pool, measured here. A kind the driver lacks is reported as
/// skipped.
fn resources_on_a_stream(driver: &Arc<dyn Driver>, ctx: &emm::Context, sizes: &[usize]) {
    use emm::driver_sys::MemLocation;
    let h = ctx.handle();
    let s = ctx.create_stream_with(true, 0).expect("stream");
    let raw_pool = |kind: &str| -> Result<driver_sys::MemPoolHandle, String> {
        let pool = if kind == "pinned" {
            let pool = driver.mem_pool_create_limited(h, MemLocation::Host, false, 0);
            pool.and_then(|p| driver.mem_pool_grant_access(h, p, 0.into()).map(|()| p))
        } else {
            driver.mem_pool_create_managed(h, None)
        }
        .map_err(|e| e.to_string())?;
        driver
            .mem_pool_set_release_threshold(h, pool, u64::MAX)
            .map_err(|e| e.to_string())?;
        Ok(pool)
    };
    let time = |subject: String, pair: &dyn Fn(usize)| {
        for &size in sizes {
            let ns = per_op(iters_for(size, true), |n| {
                for _ in 0..n {
                    pair(size);
                }
            });
            out("stream", &subject, size, 1, ns, "ns");
        }
        s.synchronize().expect("sync");
    };
    for kind in ["device", "pinned", "managed"] {
        if kind != "device" {
            let pool = match raw_pool(kind) {
                Ok(p) => p,
                Err(e) => {
                    println!("stream,raw-{kind}-pool,skipped,1,0,{}", e.replace(',', ";"));
                    continue;
                }
            };
            time(format!("raw-{kind}-pool"), &|size| {
                raw_pool_pair(&**driver, h, pool, size, s.handle())
            });
            // SAFETY: the pool is this function's; everything allocated from it was freed.
            unsafe { driver.mem_pool_destroy(h, pool) }.expect("cuMemPoolDestroy");
        }
        let subject = format!("emm-{kind}-resource");
        match kind {
            "device" => {
                let mr = ctx
                    .device_memory_resource(Default::default())
                    .expect("device resource");
                time(subject, &|size| {
                    drop(mr.allocate(size, &s).expect("allocate"))
                });
            }
            "pinned" => {
                let mr = ctx
                    .pinned_memory_resource(Default::default())
                    .expect("pinned resource");
                time(subject, &|size| {
                    drop(mr.allocate(size, &s).expect("allocate"))
                });
            }
            _ => {
                let mr = ctx
                    .managed_memory_resource(Default::default())
                    .expect("managed resource");
                time(subject, &|size| {
                    drop(mr.allocate(size, &s).expect("allocate"))
                });
            }
        }
    }
}

/// The process's own host anchors, printed first by every run (`host` rows): the latency of a
/// dependent load from memory (a random cycle through 256 MiB, one cache line a step) and a
/// 256 B `malloc` + `free` pair. On the H200's host (a virtual machine) the raw driver pair is
/// bimodal by process, about 0.74 µs in some and 1.3 – 1.4 µs in others, whatever CPUs the
/// process is pinned to; these rows let each process's figures be read against its own host.
fn host_probe() {
    const LINE_WORDS: usize = 8; // 64-byte lines of u64 words
    let lines = (256usize << 20) / 64;
    // A random single cycle through the lines (Sattolo's shuffle), seeded for repeatability.
    let mut order: Vec<usize> = (0..lines).collect();
    let mut random = xorshift(0x9e37_79b9_7f4a_7c15);
    for i in (1..lines).rev() {
        order.swap(i, (random() % i as u64) as usize);
    }
    let mut next = vec![0u64; lines * LINE_WORDS];
    for (i, &j) in order.iter().enumerate() {
        next[i * LINE_WORDS] = j as u64;
    }
    let steps = if quick() { 1 << 20 } else { 1 << 22 };
    let ns = per_op(steps, |n| {
        let mut at = 0usize;
        for _ in 0..n {
            at = next[at * LINE_WORDS] as usize;
        }
        std::hint::black_box(at);
    });
    out("host", "memory-latency", "256 MiB", 1, ns, "ns");
    out("host", "host malloc", 256, 1, malloc_pair_ns(1 << 20), "ns");
}

/// The simulated device's memory when `EMM_DRIVER=sim`: an H100's 80 GiB.
const SIM_DEVICE_BYTES: usize = 80 << 30;

fn main() {
    // The ipc section re-runs this executable as the other process of its staged opens.
    integration::run_ipc_child_if_requested();
    let quick = integration::parse_flag(
        "EMM_BENCH_QUICK",
        std::env::var("EMM_BENCH_QUICK").ok().as_deref(),
    );
    let only = std::env::var("EMM_BENCH_ONLY").unwrap_or_default();
    let unknown: Vec<&str> = only
        .split(',')
        .filter(|s| !s.is_empty() && !SECTIONS.contains(s))
        .collect();
    match quick {
        Ok(q) => QUICK.set(q).expect("set once"),
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    }
    if !unknown.is_empty() {
        eprintln!(
            "EMM_BENCH_ONLY={only:?} names unknown sections {unknown:?}: use a comma-separated list of {}, or unset it",
            SECTIONS.join(", ")
        );
        std::process::exit(2);
    }
    let choice = match integration::driver_from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    eprintln!(
        "bench_gpu: driver {} ({})",
        choice.driver.name(),
        choice.reason
    );
    eprintln!(
        "bench_gpu: pool shards entered without a lock (membarrier): {}",
        emm::shards_without_locks()
    );
    let (driver, simulated) = (choice.driver, choice.simulated);
    // On the simulator, one device of an H100's memory (the suite's simulated device has 256
    // MiB): the sections size their workloads by the device's memory (the random workload's
    // cap, the live blocks), so that this way they run the GPU run's workloads.
    let driver = if simulated {
        Arc::new(driver_mock::SimDriver::new(
            driver_mock::SimConfig::with_devices(vec![driver_mock::SimDeviceConfig::new(
                SIM_DEVICE_BYTES,
            )]),
        )) as Arc<dyn Driver>
    } else {
        driver
    };
    let probe = runtime(&driver, "default", false, vec![]);
    let total = probe
        .context(0)
        .and_then(|c| c.get_memory_info())
        .expect("device memory info")
        .total;
    drop(probe);
    TOTAL.set(total).expect("set once");
    let log_dir = std::env::var_os("EMM_BENCH_DIR").map(std::path::PathBuf::from);
    println!("section,subject,param,threads,value,unit");
    host_probe();
    let want = |s: &str| only.is_empty() || only.split(',').any(|o| o == s);
    if want("pair") {
        alloc_free_pairs(&driver);
    }
    if want("interleaved") {
        interleaved_pairs(&driver, simulated);
    }
    if want("threads") {
        scaling(&driver);
    }
    if want("random") {
        random_workload(&driver, log_dir.as_deref());
        if let Some(dir) = &log_dir {
            replays(&driver, dir);
        }
    }
    if want("random-pool") {
        random_pool(&driver);
    }
    if want("pinned") {
        pinned(&driver);
    }
    if want("copy") {
        copies(&driver);
    }
    if want("stream") {
        stream_ordered(&driver);
    }
    if want("overhead") {
        overhead(&driver);
    }
    if want("live") {
        live_blocks(&driver, simulated);
    }
    if want("anchors") {
        anchors(&driver, simulated);
    }
    if want("mixes") {
        thread_mixes(&driver);
    }
    if want("default") {
        default_fairly(&driver);
    }
    if want("ipc") {
        staged_ipc(&driver, simulated);
    }
}

/// GB/s of the raw `cuMemcpyDtoD` of all of `src` into `dst`, issued in `ctx` (median of 5
/// batches, each ending with a synchronisation of `ctx`).
fn raw_dtod_gbs(
    driver: &dyn Driver,
    ctx: &Context,
    dst: &emm::MemoryPointer,
    src: &emm::MemoryPointer,
) -> f64 {
    let size = src.size();
    let iters = if size >= 256 << 20 { 5 } else { 50 };
    let ns = per_op(iters, |n| {
        for _ in 0..n {
            // SAFETY: both are live allocations of `size` bytes that do not overlap (unified
            // addressing: another device's memory is addressable from `ctx`), and nothing else
            // touches them during the copy.
            unsafe { driver.memcpy_dtod(ctx.handle(), dst.device_ptr(), src.device_ptr(), size) }
                .expect("cuMemcpyDtoD");
        }
        driver
            .stream_synchronize(ctx.handle(), StreamHandle::LEGACY)
            .expect("sync");
    });
    size as f64 / ns
}

/// The staged IPC open across devices (issue 14): memory exported on device 0 and opened on
/// device 1 by another process through `IpcHandle::open_staged` (mapped in device 0's
/// context, allocated on device 1 by the other process's `default` manager, copied), median of
/// 5 opens each synchronised, as GB/s of the exported size; beside it, in this process and
/// the same run, the raw `cuMemcpyDtoD` from device 0 to device 1 and within device 0. Needs
/// two devices (on the simulator, a machine of two is made for it).
fn staged_ipc(driver: &Arc<dyn Driver>, simulated: bool) {
    let sim = simulated.then(|| {
        let device = || driver_mock::SimDeviceConfig::new(1 << 30);
        Arc::new(driver_mock::SimDriver::new(
            driver_mock::SimConfig::with_devices(vec![device(), device()]),
        ))
    });
    let driver = match &sim {
        Some(sim) => Arc::clone(sim) as Arc<dyn Driver>,
        None => Arc::clone(driver),
    };
    let rt = runtime(&driver, "default", false, vec![]);
    let devices = rt.device_count().expect("device count");
    if devices < 2 {
        eprintln!(
            "bench_gpu: the ipc section needs two devices and this machine has {devices}: not measured"
        );
        return;
    }
    let (c0, c1) = (
        rt.context(0).expect("device 0"),
        rt.context(1).expect("device 1"),
    );
    let total = c0.get_memory_info().expect("memory info").total;
    let sizes: Vec<usize> = [1usize << 20, 16 << 20, 256 << 20, 1 << 30]
        .into_iter()
        .filter(|&s| s <= total / 8)
        .collect();
    let mut exported = Vec::new();
    for &size in &sizes {
        let mem = c0.memalloc(size).expect("memalloc on device 0");
        c0.memset(&mem, 7, size).expect("memset");
        let bytes = c0.get_ipc_handle(&mem).expect("get_ipc_handle").to_bytes();
        let to1 = c1.memalloc(size).expect("memalloc on device 1");
        let to0 = c0.memalloc(size).expect("memalloc on device 0");
        let across = raw_dtod_gbs(driver.as_ref(), &c1, &to1, &mem);
        out(
            "ipc-staged",
            "raw cuMemcpyDtoD device 0 -> 1",
            size,
            1,
            across,
            "GB/s",
        );
        let within = raw_dtod_gbs(driver.as_ref(), &c0, &to0, &mem);
        out(
            "ipc-staged",
            "raw cuMemcpyDtoD within device 0",
            size,
            1,
            within,
            "GB/s",
        );
        exported.push((mem, bytes, to1));
    }
    // The same copy across devices with peer access granted (device 1's context to device
    // 0's), as `Context::copy_peer` asks for it.
    if let Err(e) = driver.ctx_enable_peer_access(c1.handle(), c0.handle()) {
        eprintln!("bench_gpu: peer access from device 1 to device 0: {e}");
    }
    for (mem, _, to1) in &exported {
        let subject = "raw cuMemcpyDtoD device 0 -> 1 peer access granted";
        let gbs = raw_dtod_gbs(driver.as_ref(), &c1, to1, mem);
        out("ipc-staged", subject, mem.size(), 1, gbs, "GB/s");
    }
    let handles: Vec<Vec<u8>> = exported.iter().map(|(_, b, _)| b.clone()).collect();
    let times = integration::time_staged_opens(sim.as_ref(), &handles, 1, 5)
        .expect("staged opens in another process");
    for (&size, ns) in sizes.iter().zip(times) {
        out(
            "ipc-staged",
            "open_staged in another process device 0 -> 1",
            size,
            1,
            size as f64 / ns,
            "GB/s",
        );
        out(
            "ipc-staged-ns",
            "open_staged in another process device 0 -> 1",
            size,
            1,
            ns,
            "ns",
        );
    }
}
