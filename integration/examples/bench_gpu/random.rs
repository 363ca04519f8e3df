//! RMM's random workload, live blocks, and replays of allocation logs.

use std::sync::Arc;
use std::time::Instant;

use crate::common::*;
use emm::driver_sys::{DevicePtr, Driver, StreamHandle};
use emm::{Adaptor, Context, replay};

/// The random workload of [`run_random_seeded`] on a raw driver pool; returns peak live bytes.
#[allow(clippy::too_many_arguments)]
pub(crate) fn raw_random(
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
pub(crate) fn live_blocks(driver: &Arc<dyn Driver>, simulated: bool) {
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
pub(crate) fn live_pairs(ctx: &Context, manager: &str, live: usize, note: &str) {
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
pub(crate) fn random_workload(driver: &Arc<dyn Driver>, log_dir: Option<&std::path::Path>) {
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
pub(crate) fn random_pool(driver: &Arc<dyn Driver>) {
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
pub(crate) fn run_random_seeded(
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
pub(crate) fn replays(driver: &Arc<dyn Driver>, log_dir: &std::path::Path) {
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
