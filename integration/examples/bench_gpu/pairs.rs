//! Single-thread pairs: every manager against `cuMemAlloc` and the driver's pool, the
//! interleaved `async-pool` ratios, the host's anchors, the default manager's overhead.

use std::sync::Arc;
use std::time::Instant;

use crate::common::*;
use crate::random::{raw_random, run_random_seeded};
use emm::Runtime;
use emm::driver_sys::{DevicePtr, Driver, StreamHandle};

/// Alloc + free pairs per size: raw driver, driver pool, every manager.
pub(crate) fn alloc_free_pairs(driver: &Arc<dyn Driver>) {
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
pub(crate) fn interleaved_pairs(driver: &Arc<dyn Driver>, simulated: bool) {
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
                // things `memalloc_on` does beyond it.
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
pub(crate) fn host_anchors() {
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

/// The harness's two ways (issue 14, item 5), on the GPU only: every pair measured first with
/// no context current on the thread (so `CudaDriver` pushes and pops it around each call) and
/// then with device 0's primary context made current once, as host runtimes do (bound by
/// cudarc's `CudaContext::new`); and bare-cudarc anchors (`cuMemAlloc`, `cuMemAllocAsync` on
/// the device's default pool, `cuMemHostAlloc`, each with its free) in the same process, with
/// the context current.
pub(crate) fn anchors(driver: &Arc<dyn Driver>, simulated: bool) {
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

/// Memory overhead of RMM's random workload: peak bytes held from the driver over peak bytes
/// live (asked for), per manager and seed, beside the raw driver pool's own reserved and used
/// high-water marks for the same sequence in the same run (`cuMemPoolGetAttribute`).
pub(crate) fn overhead(driver: &Arc<dyn Driver>) {
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

/// The default manager measured fairly (issue 14): its frees are deferred, 10 at a time, so it
/// issues 11 `cuMemAlloc` and then 11 `cuMemFree`; the anchor is the raw driver making the same
/// sequence, beside the raw alternating pair, the manager with the deferral off
/// (`max_count` 0: every free flushed at once), and the bytes the deferred frees held.
pub(crate) fn default_fairly(driver: &Arc<dyn Driver>) {
    let total = *TOTAL.get().expect("set by main");
    let deferral_off = Runtime::builder(Arc::clone(driver))
        .ignore_env()
        .memory_manager_name("default")
        .dealloc_config(emm::plugin::DeallocConfig {
            max_count: 0,
            ..emm::plugin::DeallocConfig::default()
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

/// The process's own host anchors, printed first by every run (`host` rows): the latency of a
/// dependent load from memory (a random cycle through 256 MiB, one cache line a step) and a
/// 256 B `malloc` + `free` pair. On the H200's host (a virtual machine) the raw driver pair is
/// bimodal by process, about 0.74 µs in some and 1.3 – 1.4 µs in others, whatever CPUs the
/// process is pinned to; these rows let each process's figures be read against its own host.
pub(crate) fn host_probe() {
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
