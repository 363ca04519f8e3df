//! `vmm-pool` on the simulator: refused without virtual memory management, unmapping after
//! `defer_cleanup`, and growth in place into the pieces holes leave free.

use std::sync::Arc;

use driver_mock::{Op, SimConfig, SimDriver};
use emm::plugin::PoolAllocator;
use emm::{Adaptor, EmmError, PoolConfig, Runtime};

use crate::common::runtime_with;

use crate::pools::{MIB, on_a_gib};

/// A runtime over `sim` with `vmm-pool` in pieces of `piece` bytes (`None`: chosen per
/// growth) under `adaptors`, the environment ignored.
pub(crate) fn vmm_runtime(
    sim: &Arc<SimDriver>,
    piece: Option<usize>,
    adaptors: Vec<Adaptor>,
) -> Runtime {
    let config = PoolConfig {
        vmm_piece: piece,
        ..PoolConfig::vmm()
    };
    Runtime::builder(sim.clone())
        .ignore_env()
        .memory_manager(PoolAllocator::vmm_factory_with(config))
        .adaptors(adaptors)
        .build()
        .unwrap()
}

/// Where the device or its driver lacks virtual memory management, `vmm-pool` is refused when
/// its context is made, with an error that says so and names the managers that work.
#[test]
fn vmm_pool_is_refused_without_virtual_memory_management() {
    use driver_mock::SimDeviceConfig;
    let sim = Arc::new(SimDriver::new(SimConfig::with_devices(vec![
        SimDeviceConfig::new(1 << 30).vmm(false),
    ])));
    let rt = runtime_with(&sim, "vmm-pool");
    let err = rt.context(0).unwrap_err();
    assert!(matches!(err, EmmError::NoVirtualMemory { .. }), "{err:?}");
    let text = err.to_string();
    for needle in [
        "virtual memory management",
        "'pool'",
        "'async-pool'",
        "EMM_MEMORY_MANAGER",
    ] {
        assert!(text.contains(needle), "{needle:?} missing from: {text}");
    }
    // Where it has it, the pool works, grows in place and gives everything back.
    let (sim, rt) = on_a_gib("vmm-pool");
    let ctx = rt.context(0).unwrap();
    let blocks: Vec<_> = (0..8)
        .map(|i| ctx.memalloc((3 << 20) + i).unwrap())
        .collect();
    let data = vec![7u8; 3 << 20];
    ctx.copy_to_device(&blocks[3], &data).unwrap();
    let mut back = vec![0u8; 3 << 20];
    ctx.copy_to_host(&mut back, &blocks[3]).unwrap();
    assert_eq!(back, data);
    assert!(
        ctx.get_ipc_handle(&blocks[0]).is_err(),
        "mapped memory has no IPC handle"
    );
    drop(blocks);
    ctx.trim().unwrap();
    assert_eq!(ctx.pool_stats().device.unwrap().held_bytes, 0);
    drop(ctx);
    drop(rt);
    let leaks = sim.leak_report();
    assert!(leaks.is_clean(), "{leaks}");
}

/// `vmm-pool` keeps `defer_cleanup`'s promise: chunks it gives back inside the guard stay
/// mapped until the guard is gone, and the first trim or growth after it unmaps them. A reset
/// inside the guard gives up every block, so its chunks go at once; nothing leaks.
#[test]
fn vmm_pool_unmaps_after_defer_cleanup() {
    let (sim, rt) = on_a_gib("vmm-pool");
    let ctx = rt.context(0).unwrap();
    let blocks: Vec<_> = (0..4).map(|_| ctx.memalloc(16 << 20).unwrap()).collect();
    let guard = ctx.defer_cleanup().unwrap();
    drop(blocks);
    let trimmed = ctx.trim().unwrap();
    assert!(trimmed >= 64 << 20, "trimmed {trimmed}");
    assert_eq!(
        (sim.count(Op::MemUnmap), sim.count(Op::MemRelease)),
        (0, 0),
        "unmapped inside defer_cleanup"
    );
    drop(guard);
    // The next growth unmaps what waited, before it maps.
    let again = ctx.memalloc(8 << 20).unwrap();
    let unmapped = sim.count(Op::MemUnmap);
    assert!(unmapped > 0, "the waiting chunks stayed mapped");
    assert_eq!(sim.count(Op::MemRelease), unmapped);
    drop(again);
    let guard = ctx.defer_cleanup().unwrap();
    ctx.reset().unwrap();
    assert!(
        sim.count(Op::MemUnmap) > unmapped,
        "a reset inside defer_cleanup unmaps its chunks"
    );
    drop(guard);
    drop(ctx);
    drop(rt);
    let leaks = sim.leak_report();
    assert!(leaks.is_clean(), "{leaks}");
}

/// `vmm-pool`, its pieces set to 2 MiB (`PoolConfig::vmm_piece`). A growth moves the pieces
/// a hole between live blocks leaves free to where it needs memory (unmapped there, mapped
/// again past the end), up to what it maps: it makes new physical memory only for the rest,
/// and gives nothing back to the driver; a trim gives back every free piece.
#[test]
fn vmm_pool_moves_the_pieces_a_hole_leaves_free_to_its_growth() {
    let sim = Arc::new(SimDriver::new(SimConfig::single(1 << 30)));
    let rt = vmm_runtime(&sim, Some(2 * MIB), Vec::new());
    let ctx = rt.context(0).unwrap();
    let held = || ctx.pool_stats().device.unwrap().held_bytes;
    // 64 MiB, then 3 MiB past it (a growth in place of 4 MiB): 34 pieces.
    let a = ctx.memalloc(64 * MIB).unwrap();
    let pin = ctx.memalloc(3 * MIB).unwrap();
    assert_eq!(held(), 68 * MIB);
    assert_eq!(sim.count(Op::MemCreate), 34);
    // A hole of 32 pieces before the pinned block; 80 MiB fits in no free block. The growth
    // maps 80 MiB past the 1 MiB free at the end: the hole's 32 pieces, and 8 new ones.
    drop(a);
    let big = ctx.memalloc(80 * MIB).unwrap();
    assert_eq!(big.device_ptr().0, pin.device_ptr().0 + 3 * MIB as u64);
    assert_eq!(sim.count(Op::MemUnmap), 32, "the hole's pieces moved");
    assert_eq!(sim.count(Op::MemCreate), 42, "8 pieces made for the rest");
    assert_eq!(
        sim.count(Op::MemRelease),
        0,
        "nothing went back to the driver"
    );
    assert_eq!(held(), 84 * MIB);
    let stats = ctx.pool_stats().device.unwrap();
    assert_eq!((stats.driver_allocations, stats.driver_frees), (42, 0));
    // A 16 MiB block across nine pieces (it starts 1 MiB before the end of one), then 3 MiB
    // after it; freed, it leaves seven pieces wholly free, which the next growth (18 MiB past
    // the 2 MiB free at the end: nine pieces) moves, making two.
    let small = ctx.memalloc(16 * MIB).unwrap();
    let after = ctx.memalloc(3 * MIB).unwrap();
    let (creates, unmaps) = (sim.count(Op::MemCreate), sim.count(Op::MemUnmap));
    let held_before = held();
    drop(small);
    let more = ctx.memalloc(20 * MIB).unwrap();
    let moved = sim.count(Op::MemUnmap) - unmaps;
    let made = sim.count(Op::MemCreate) - creates;
    assert_eq!(moved, 7, "the pieces the hole left wholly free moved");
    assert_eq!(moved + made, 9, "the growth mapped 18 MiB");
    assert_eq!(held(), held_before + made * 2 * MIB);
    drop((pin, big, after, more));
    ctx.trim().unwrap();
    assert_eq!(held(), 0);
    assert_eq!(sim.count(Op::MemRelease), sim.count(Op::MemCreate));
    drop(ctx);
    drop(rt);
    let leaks = sim.leak_report();
    assert!(leaks.is_clean(), "{leaks}");
}

/// `vmm-pool`: a stream's arena that grows in place takes the shared arena's wholly free pieces
/// first, up to what the growth maps: they move past the stream's free block, and only the rest
/// is new physical memory. (The held-bound property test once found a stream growing by
/// 436 MiB while the shared arena kept 375 MiB free in pieces too short for it: seed 11.)
#[test]
fn vmm_pool_a_stream_growing_in_place_takes_the_shared_free_pieces() {
    let (sim, rt) = on_a_gib("vmm-pool");
    let ctx = rt.context(0).unwrap();
    let held = || ctx.pool_stats().device.unwrap().held_bytes;
    let stream = ctx.create_stream().unwrap();
    // The shared arena's two 40 MiB blocks apart, then the stream's 5 MiB.
    let a = ctx.memalloc(40 * MIB).unwrap();
    let pin = ctx.memalloc(2 * MIB).unwrap();
    let b = ctx.memalloc(40 * MIB).unwrap();
    let on = ctx.memalloc_on(5 * MIB, &stream).unwrap();
    let held_before = held();
    let creates = sim.count(Op::MemCreate);
    // 40 MiB free in the shared arena: the stream's growth of 48 MiB moves its 20 pieces and
    // makes 4.
    drop(a);
    let first = ctx.memalloc_on(48 * MIB, &stream).unwrap();
    assert_eq!(
        first.device_ptr().0,
        on.device_ptr().0 + 5 * MIB as u64,
        "the stream's free block grew in place"
    );
    assert_eq!(sim.count(Op::MemUnmap), 20, "the shared pieces moved");
    assert_eq!(sim.count(Op::MemCreate) - creates, 4);
    assert_eq!(held(), held_before + 8 * MIB);
    assert_eq!(sim.count(Op::MemRelease), 0);
    drop((b, pin, on, first));
    stream.synchronize().unwrap();
    ctx.trim().unwrap();
    assert_eq!(held(), 0);
    drop((stream, ctx));
    drop(rt);
    let leaks = sim.leak_report();
    assert!(leaks.is_clean(), "{leaks}");
}

/// `vmm-pool` grows in place: a request larger than the free block at the end of its memory
/// maps only what it lacks just past that block, so the block keeps its address; and a loop
/// whose sizes vary from step to step (as a training loop's with shapes drawn per step) makes
/// its memory in its first round of shapes, then makes none, moving a piece a round at most.
#[test]
fn vmm_pool_grows_in_place_and_a_varying_loop_settles() {
    let (sim, rt) = on_a_gib("vmm-pool");
    let ctx = rt.context(0).unwrap();
    let a = ctx.memalloc(12 << 20).unwrap();
    let at = a.device_ptr();
    drop(a);
    let b = ctx.memalloc(40 << 20).unwrap();
    assert_eq!(b.device_ptr(), at, "the free block grew in place");
    assert_eq!(
        sim.count(Op::MemCreate),
        20,
        "growths of up to 32 MiB map pieces of 2 MiB"
    );
    assert_eq!(sim.count(Op::MemUnmap), 0);
    drop(b);
    // Five step shapes in turn: blocks of 2 – 30 MiB, all freed at the step's end.
    let shapes: [&[usize]; 5] = [
        &[30, 4, 4, 17, 2],
        &[9, 9, 9, 9, 9, 9],
        &[25, 25, 3],
        &[2, 28, 14, 7, 6],
        &[16, 16, 16, 16],
    ];
    let step = |shape: &[usize]| {
        let blocks: Vec<_> = shape
            .iter()
            .map(|&mib| ctx.memalloc((mib << 20) + 4096).unwrap())
            .collect();
        drop(blocks);
    };
    for shape in shapes {
        step(shape);
    }
    let (made, unmapped, released) = (
        sim.count(Op::MemCreate),
        sim.count(Op::MemUnmap),
        sim.count(Op::MemRelease),
    );
    for _ in 0..20 {
        for shape in shapes {
            step(shape);
        }
    }
    assert_eq!(
        sim.count(Op::MemCreate),
        made,
        "the loop made physical memory after its first round"
    );
    // What moves (or, moved and not mapped, goes back) is a piece a round at most: where a
    // shape's block finds the free space split.
    let (moved, back) = (
        sim.count(Op::MemUnmap) - unmapped,
        sim.count(Op::MemRelease) - released,
    );
    assert!(
        moved <= 20 && back <= moved,
        "{moved} pieces moved and {back} went back in 20 rounds"
    );
    let stats = ctx.pool_stats().device.unwrap();
    let peak_live = (64 << 20) + 4 * 4096; // the largest step: 4 × 16 MiB and 4 KiB
    assert!(
        stats.held_bytes <= peak_live * 115 / 100,
        "held {} for a largest step of {peak_live}",
        stats.held_bytes
    );
    drop(ctx);
    drop(rt);
    let leaks = sim.leak_report();
    assert!(leaks.is_clean(), "{leaks}");
}

/// By default a growth maps pieces of a sixteenth of it (a power of two, from 2 MiB up to
/// 64 MiB): a small growth maps pieces of 2 MiB, each growth of a GiB sixteen pieces of
/// 64 MiB, so that a sleep gives 4 GiB back in 64 unmappings, where pieces of 2 MiB would
/// take 2 048 (the driver's cost is per piece, whatever its size). A piece moved by a later
/// growth is mapped again at its own size.
#[test]
fn a_large_growth_maps_large_pieces_and_sleeps_in_few_calls() {
    use emm::contract::{SleepChoice, SleepOptions};
    let sim = Arc::new(SimDriver::new(SimConfig::single(8 << 30)));
    let rt = runtime_with(&sim, "vmm-pool");
    let ctx = rt.context(0).unwrap();
    let small = ctx.memalloc(3 * MIB).unwrap();
    let small_pieces = sim.count(Op::MemCreate);
    assert_eq!(
        small_pieces,
        ctx.pool_stats().device.unwrap().held_bytes / (2 * MIB),
        "a small growth maps pieces of 2 MiB"
    );
    let blocks: Vec<_> = (0..4).map(|_| ctx.memalloc(1 << 30).unwrap()).collect();
    let held = ctx.pool_stats().device.unwrap().held_bytes;
    assert!(held >= 4 << 30, "held {held}");
    let pieces = sim.count(Op::MemCreate) - small_pieces;
    assert!(
        pieces <= 4 * 17,
        "{pieces} pieces for 4 GiB in growths of a GiB and a little"
    );
    let unmapped = sim.count(Op::MemUnmap);
    let report = ctx.sleep(&SleepOptions::new(SleepChoice::Discard)).unwrap();
    assert_eq!(report.held_asleep, 0);
    let slept = sim.count(Op::MemUnmap) - unmapped;
    assert!(slept <= 4 * 17 + small_pieces, "{slept} unmappings");
    let woke = ctx.wake().unwrap();
    assert_eq!(
        woke.held_after, report.held_before,
        "every piece mapped again"
    );
    // A hole of a GiB serves a later growth whose pieces are smaller: the moved pieces keep
    // their size.
    drop(blocks);
    let more = ctx.memalloc(5 << 30).unwrap();
    let mut out = [0u8; 16];
    ctx.copy_to_device(&more, &[7u8; 16]).unwrap();
    ctx.copy_to_host(&mut out, &more).unwrap();
    assert_eq!(out, [7u8; 16]);
    drop((more, small));
    ctx.trim().unwrap();
    assert_eq!(ctx.pool_stats().device.unwrap().held_bytes, 0);
    drop(ctx);
    drop(rt);
    assert!(sim.leak_report().is_clean(), "{}", sim.leak_report());
}
