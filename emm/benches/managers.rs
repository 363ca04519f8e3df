//! Bookkeeping cost per operation of each manager, on the simulator (criterion).
//!
//! `cargo bench -p emm --bench managers`. The simulator's own cost is measured too
//! (`sim/raw_alloc_free`), so a manager's bookkeeping is its figure minus the raw one where it
//! calls the driver (the default manager), and its whole figure where it does not (the pools'
//! cached paths). GPU figures come from `bench_gpu` (BENCHMARKS.md).

// criterion's macros generate undocumented items.
#![allow(missing_docs)]

use std::hint::black_box;
use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use driver_mock::{SimConfig, SimDriver};
use emm::driver_sys::Driver;
use emm::{PinnedPoolConfig, Runtime};

fn runtime(sim: &Arc<SimDriver>, manager: &str, pinned: bool) -> Runtime {
    Runtime::builder(sim.clone())
        .ignore_env()
        .memory_manager_name(manager)
        .pinned_host_pool(pinned.then(PinnedPoolConfig::default))
        .build()
        .expect("runtime")
}

fn managers(c: &mut Criterion) {
    let sim = Arc::new(SimDriver::new(SimConfig::single(1 << 30)));
    let rt = runtime(&sim, "default", false);
    let ctx = rt.context(0).expect("context");
    let h = ctx.handle();
    c.bench_function("sim/raw_alloc_free_256B", |b| {
        b.iter(|| {
            let p = sim.mem_alloc(h, black_box(256)).expect("alloc");
            // SAFETY: allocated just above, freed once, never used.
            unsafe { sim.mem_free(h, p) }.expect("free");
        })
    });
    for manager in ["default", "pool", "async-pool"] {
        let rt = runtime(&sim, manager, false);
        let ctx = rt.context(0).expect("context");
        c.bench_function(&format!("{manager}/memalloc_drop_256B"), |b| {
            b.iter(|| drop(ctx.memalloc(black_box(256)).expect("memalloc")))
        });
    }
    let rt = runtime(&sim, "default", true);
    let ctx = rt.context(0).expect("context");
    c.bench_function("pinned-pool/memhostalloc_drop_4KiB", |b| {
        b.iter(|| {
            drop(
                ctx.memhostalloc(black_box(4096), false, false, false)
                    .expect("pinned"),
            )
        })
    });
}

/// A snapshot of a million live blocks under `pool` with the `history` adaptor (issue 42's
/// target: under a second), and the cached `pool` pair with and without the adaptor.
fn snapshots(c: &mut Criterion) {
    let sim = Arc::new(SimDriver::new(SimConfig::single(64 << 30)));
    let rt = Runtime::builder(sim.clone())
        .ignore_env()
        .memory_manager_name("pool")
        .adaptors(vec![emm::Adaptor::parse("history=1000").expect("adaptor")])
        .build()
        .expect("runtime");
    let ctx = rt.context(0).expect("context");
    c.bench_function("history/pool_pair_256B", |b| {
        b.iter(|| drop(ctx.memalloc(black_box(256)).expect("alloc")))
    });
    let live: Vec<_> = (0..1_000_000)
        .map(|_| ctx.memalloc(256).expect("alloc"))
        .collect();
    let mut group = c.benchmark_group("snapshot");
    group.sample_size(10);
    group.bench_function("pool_1M_live_blocks", |b| {
        b.iter(|| black_box(ctx.snapshot().segments.len()))
    });
    group.finish();
    drop(live);
}

criterion_group!(benches, managers, snapshots);
criterion_main!(benches);
