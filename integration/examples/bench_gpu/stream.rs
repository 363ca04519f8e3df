//! Stream-ordered pairs on created streams, for the managers and cuda.core's resources.

use std::sync::Arc;
use std::time::Instant;

use crate::common::*;
use emm::driver_sys::Driver;

/// Stream-ordered alloc + free pairs on a created (non-blocking) stream: the raw driver's pool
/// (a pool created as `async-pool` creates its own, and the device's default pool) against
/// every manager's `memalloc_on`; then aggregate throughput with 1, 8 and 16 threads, each on
/// its own stream, and 8 threads on one shared stream (the raw pool, `pool` and `async-pool`
/// in turn for each).
pub(crate) fn stream_ordered(driver: &Arc<dyn Driver>) {
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
pub(crate) fn resources_on_a_stream(driver: &Arc<dyn Driver>, ctx: &emm::Context, sizes: &[usize]) {
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
