//! Many threads: aggregate pairs per second, and mixes of sizes and of threads that free what
//! others allocated.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::common::*;
use emm::Context;
use emm::driver_sys::{Driver, StreamHandle};

/// Aggregate throughput of small alloc + free pairs on 1 to 32 threads, beside the host C
/// allocator's and the raw driver pool's.
pub(crate) fn scaling(driver: &Arc<dyn Driver>) {
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

/// Spawns and joins `n` threads that each make one `pool` allocation: thread churn, which with
/// a process-wide thread counter (before the dense slots of `pool/shards.rs`) put later live
/// threads on shards other live threads used.
pub(crate) fn churn(ctx: &Context, n: usize) {
    for _ in 0..n {
        std::thread::scope(|s| {
            s.spawn(|| drop(ctx.memalloc(256).expect("memalloc")));
        });
    }
}

/// `n` allocations from `alloc(i)`, each kept until `hold` are held, then all dropped.
pub(crate) fn holding<T>(hold: usize, n: usize, mut alloc: impl FnMut(usize) -> T) {
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
pub(crate) fn mix(
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
pub(crate) fn thread_mixes(driver: &Arc<dyn Driver>) {
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
pub(crate) fn freed_elsewhere<T: Send>(
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
