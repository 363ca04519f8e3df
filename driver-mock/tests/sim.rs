//! The simulator's own contract: determinism, scripted faults, the leak report, and the page
//! model's invariants under random workloads (proptest).
#![allow(unsafe_code)]

use driver_mock::{Fault, Op, PAGE_SIZE, SMALL_MAX, SimConfig, SimDeviceConfig, SimDriver};
use driver_sys::{ContextHandle, DeviceOrdinal, DevicePtr, Driver, ErrorKind};
use proptest::prelude::*;

const DEV: DeviceOrdinal = DeviceOrdinal(0);

fn started(config: SimConfig) -> (SimDriver, ContextHandle) {
    let sim = SimDriver::new(config);
    sim.init().unwrap();
    let ctx = sim.primary_ctx_retain(DEV).unwrap();
    (sim, ctx)
}

fn free(sim: &SimDriver, ctx: ContextHandle, p: DevicePtr) -> Result<(), driver_sys::DriverError> {
    // SAFETY: the simulator's memory is simulated; misuse is answered with errors.
    unsafe { sim.mem_free(ctx, p) }
}

fn script(sim: &SimDriver, ctx: ContextHandle) -> Vec<DevicePtr> {
    let mut out = Vec::new();
    for bytes in [1, 700, 3 << 20, 64, 5 << 19] {
        out.push(sim.mem_alloc(ctx, bytes).unwrap());
    }
    free(sim, ctx, out[1]).unwrap();
    out.push(sim.mem_alloc(ctx, 100).unwrap());
    out
}

#[test]
fn same_calls_same_addresses_same_log() {
    let (a, actx) = started(SimConfig::default());
    let (b, bctx) = started(SimConfig::default());
    assert_eq!(script(&a, actx), script(&b, bctx));
    assert_eq!(a.calls(), b.calls());
}

#[test]
fn freed_space_is_reused_first_fit() {
    let (sim, ctx) = started(SimConfig::default());
    let p = script(&sim, ctx);
    // The 700-byte allocation (1024 bytes of span) was freed; 100 bytes fit in its place.
    assert_eq!(p[5], p[1]);
}

#[test]
fn calls_before_init_fail_as_not_initialized() {
    let sim = SimDriver::new(SimConfig::default());
    let e = sim.device_count().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotInitialized);
}

#[test]
fn nth_call_of_an_operation_fails_once() {
    let (sim, ctx) = started(SimConfig::default());
    sim.inject(Fault::nth(Op::MemAlloc, 2, ErrorKind::OutOfMemory));
    let first = sim.mem_alloc(ctx, 16).unwrap();
    let err = sim.mem_alloc(ctx, 16).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutOfMemory);
    assert!(err.to_string().contains("injected by SimDriver"), "{err}");
    let third = sim.mem_alloc(ctx, 16).unwrap();
    assert_ne!(first, third);
    let outcomes: Vec<_> = sim
        .calls()
        .iter()
        .filter(|c| c.op == Op::MemAlloc)
        .map(|c| c.outcome)
        .collect();
    assert_eq!(outcomes, vec![Ok(()), Err(ErrorKind::OutOfMemory), Ok(())]);
}

#[test]
fn nth_call_of_any_operation_fails_once() {
    let (sim, ctx) = started(SimConfig::default());
    sim.inject(Fault::nth_call(3, ErrorKind::ContextDestroyed));
    sim.mem_get_info(ctx).unwrap();
    let p = sim.mem_alloc(ctx, 16).unwrap();
    let err = free(&sim, ctx, p).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ContextDestroyed);
    assert_eq!(err.raw_code(), Some(709));
    // The faulted free did nothing: the allocation is still there and can be freed.
    free(&sim, ctx, p).unwrap();
}

#[test]
fn cleared_faults_do_not_fire() {
    let (sim, ctx) = started(SimConfig::default());
    sim.inject(Fault::nth(Op::MemAlloc, 1, ErrorKind::InvalidValue));
    sim.clear_faults();
    sim.mem_alloc(ctx, 8).unwrap();
}

#[test]
fn leak_report_lists_memory_and_contexts() {
    let (sim, ctx) = started(SimConfig::default());
    let p = sim.mem_alloc(ctx, 10).unwrap();
    let report = sim.leak_report();
    assert_eq!(report.allocations, vec![(DEV, p, 10)]);
    assert_eq!(report.retained_contexts, vec![(DEV, 1)]);
    assert!(
        report
            .to_string()
            .contains("10 bytes at 0x700000000000 still allocated"),
        "{report}"
    );
    free(&sim, ctx, p).unwrap();
    assert!(sim.leak_report().no_memory_leaked());
    // SAFETY: matches the retain in `started`.
    unsafe { sim.primary_ctx_release(DEV).unwrap() };
    assert!(sim.leak_report().is_clean());
}

#[test]
fn rejected_frees_are_visible() {
    let (sim, ctx) = started(SimConfig::default());
    let p = sim.mem_alloc(ctx, 10).unwrap();
    free(&sim, ctx, p).unwrap();
    assert_eq!(
        free(&sim, ctx, p).unwrap_err().kind(),
        ErrorKind::InvalidValue
    );
    assert_eq!(sim.rejected_frees().len(), 1);
}

/// Freeing an allocation while another process maps it is the driver's undefined behaviour:
/// the simulator counts it (for the test harness) and the free itself succeeds, as on the GPU.
/// After the importer lets go, the same free counts nothing.
#[test]
fn frees_while_imported_are_counted() {
    use driver_mock::frees_while_imported_on_this_thread as counted;
    use driver_sys::StreamHandle;
    let (sim, ctx) = started(SimConfig::default());
    let other = sim.spawn_process();
    other.init().unwrap();
    let octx = other.primary_ctx_retain(DEV).unwrap();
    let close = |p| {
        // SAFETY: a mapping the other process opened below, closed once.
        unsafe { other.ipc_close_mem_handle(octx, p) }.unwrap();
    };

    // Device memory through cuIpcOpenMemHandle.
    let before = counted();
    let p = sim.mem_alloc(ctx, 4096).unwrap();
    let m = other
        .ipc_open_mem_handle(octx, &sim.ipc_get_mem_handle(ctx, p).unwrap())
        .unwrap();
    free(&sim, ctx, p).unwrap();
    assert_eq!(counted(), before + 1, "a free while mapped is counted");
    close(m);
    let q = sim.mem_alloc(ctx, 4096).unwrap();
    let m = other
        .ipc_open_mem_handle(octx, &sim.ipc_get_mem_handle(ctx, q).unwrap())
        .unwrap();
    close(m);
    free(&sim, ctx, q).unwrap();
    assert_eq!(counted(), before + 1, "a free after the close is not");

    // Stream-ordered pool memory through cuMemPoolImportPointer.
    let s0 = StreamHandle::NULL;
    let pool = sim.mem_pool_create(ctx, DEV, true).unwrap();
    let fd = sim.mem_pool_export_fd(ctx, pool).unwrap();
    let imported = other
        .mem_pool_import_fd(octx, std::os::fd::AsFd::as_fd(&fd))
        .unwrap();
    let free_async = |d: &SimDriver, c, p| {
        // SAFETY: each pointer below is freed once, in the process that holds it.
        unsafe { d.mem_free_async(c, p, s0) }.unwrap();
    };
    for importer_first in [false, true] {
        let before = counted();
        let a = sim.mem_alloc_from_pool_async(ctx, pool, 4096, s0).unwrap();
        let data = sim.mem_pool_export_pointer(ctx, a).unwrap();
        let b = other
            .mem_pool_import_pointer(octx, imported, &data)
            .unwrap();
        if importer_first {
            free_async(&other, octx, b);
            free_async(&sim, ctx, a);
        } else {
            free_async(&sim, ctx, a);
            free_async(&other, octx, b);
        }
        let expected = before + u64::from(!importer_first);
        assert_eq!(
            counted(),
            expected,
            "pool memory, importer first: {importer_first}"
        );
    }

    // Destroying the exporter's context while the other process maps its memory.
    let before = counted();
    let r = sim.mem_alloc(ctx, 4096).unwrap();
    let m = other
        .ipc_open_mem_handle(octx, &sim.ipc_get_mem_handle(ctx, r).unwrap())
        .unwrap();
    // SAFETY: the imported pool is destroyed once, with nothing imported through it left.
    unsafe { other.mem_pool_destroy(octx, imported) }.unwrap();
    // SAFETY: ends the test's use of the exporter's context.
    unsafe { sim.primary_ctx_reset(DEV) }.unwrap();
    assert_eq!(
        counted(),
        before + 1,
        "a context destroyed while its memory is mapped"
    );
    close(m);
}

/// Physical memory exported as a file descriptor: only a shareable allocation exports, only an
/// exported descriptor imports, and the memory (the same bytes in both processes, counted once)
/// lives until the last handle and mapping of it go, also past its exporter's context.
/// A reservation larger than the process's address space, up to the largest aligned size, is
/// out of memory, as the driver says; the model's arithmetic does not overflow (the
/// `mapped_export_bytes` fuzz target found a forged export's span that did).
#[test]
fn a_reservation_past_the_address_space_is_out_of_memory() {
    let (sim, ctx) = started(SimConfig::default());
    let g = sim.mem_vmm_granularity(DEV).unwrap();
    // One reservation first: the next lies past it, where the sum overflowed.
    let small = sim.mem_address_reserve(ctx, g).unwrap();
    for size in [usize::MAX - g + 1, 1 << 62, 1 << 48] {
        assert_eq!(
            sim.mem_address_reserve(ctx, size).unwrap_err().kind(),
            ErrorKind::OutOfMemory,
            "{size} bytes"
        );
    }
    // SAFETY: reserved above, nothing mapped, freed once.
    unsafe { sim.mem_address_free(ctx, small, g) }.unwrap();
}

#[test]
fn shared_physical_memory_lives_until_its_last_handle() {
    let (sim, ctx) = started(SimConfig::default());
    let other = sim.spawn_process();
    other.init().unwrap();
    let octx = other.primary_ctx_retain(DEV).unwrap();
    let g = sim.mem_vmm_granularity(DEV).unwrap();
    let free0 = sim.mem_get_info(ctx).unwrap().free;

    let plain = sim.mem_create(ctx, DEV, g, false).unwrap();
    assert_eq!(
        sim.mem_export_fd(ctx, plain).unwrap_err().kind(),
        ErrorKind::InvalidValue,
        "an allocation made without the handle type"
    );
    // SAFETY: made above, never mapped, released once.
    unsafe { sim.mem_release(ctx, plain) }.unwrap();
    let (stranger, _writer) = std::io::pipe().unwrap();
    assert_eq!(
        other
            .mem_import_fd(octx, std::os::fd::AsFd::as_fd(&stranger))
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidValue,
        "a descriptor nothing was exported as"
    );

    let a = sim.mem_create(ctx, DEV, g, true).unwrap();
    let fd = sim.mem_export_fd(ctx, a).unwrap();
    let b = other
        .mem_import_fd(octx, std::os::fd::AsFd::as_fd(&fd))
        .unwrap();
    drop(fd);
    let (va, vb) = (
        sim.mem_address_reserve(ctx, g).unwrap(),
        other.mem_address_reserve(octx, g).unwrap(),
    );
    // SAFETY: each process maps into its own new reservation, where nothing is mapped.
    unsafe {
        sim.mem_map(ctx, va, g, a).unwrap();
        other.mem_map(octx, vb, g, b).unwrap();
    }
    sim.mem_set_access(ctx, va, g, DEV).unwrap();
    other.mem_set_access(octx, vb, g, DEV).unwrap();
    let mut back = [0u8; 4];
    // SAFETY: four bytes at the start of each process's accessible mapping.
    unsafe {
        sim.memcpy_htod(ctx, va, &[1, 2, 3, 4]).unwrap();
        other.memcpy_dtoh(octx, &mut back, vb).unwrap();
    }
    assert_eq!(
        back,
        [1, 2, 3, 4],
        "the importer reads what the exporter wrote"
    );
    assert_eq!(
        free0 - sim.mem_get_info(ctx).unwrap().free,
        g,
        "counted once"
    );

    // The exporter's context goes, its handle and mapping with it; the importer's stay.
    // SAFETY: ends the test's use of the exporter's context.
    unsafe { sim.primary_ctx_reset(DEV) }.unwrap();
    let mut again = [0u8; 4];
    // SAFETY: the importer's mapping, still accessible.
    unsafe { other.memcpy_dtoh(octx, &mut again, vb) }.unwrap();
    assert_eq!(again, [1, 2, 3, 4], "the memory outlives its exporter");
    assert_eq!(free0 - other.mem_get_info(octx).unwrap().free, g);
    assert!(
        sim.leak_report().no_memory_leaked(),
        "{}",
        sim.leak_report()
    );

    // SAFETY: the importer's last mapping and handle, used by no work.
    unsafe {
        other.mem_unmap(octx, vb, g).unwrap();
        other.mem_release(octx, b).unwrap();
        other.mem_address_free(octx, vb, g).unwrap();
    }
    assert_eq!(
        other.mem_get_info(octx).unwrap().free,
        free0,
        "gone with the last handle"
    );
    assert!(
        other.leak_report().no_memory_leaked(),
        "{}",
        other.leak_report()
    );
}

#[test]
fn devices_are_separate_and_attributes_configurable() {
    let config = SimConfig::with_devices(vec![
        SimDeviceConfig::new(64 << 20),
        SimDeviceConfig::new(32 << 20).can_map_host_memory(false),
    ]);
    let sim = SimDriver::new(config);
    sim.init().unwrap();
    assert_eq!(sim.device_count().unwrap(), 2);
    use driver_sys::DeviceAttribute::*;
    assert_eq!(
        sim.device_attribute(DeviceOrdinal(1), CanMapHostMemory)
            .unwrap(),
        0
    );
    assert_eq!(
        sim.device_attribute(DeviceOrdinal(0), CanMapHostMemory)
            .unwrap(),
        1
    );
    assert_ne!(
        sim.device_attribute(DeviceOrdinal(0), PciBusId).unwrap(),
        sim.device_attribute(DeviceOrdinal(1), PciBusId).unwrap()
    );
    let c0 = sim.primary_ctx_retain(DeviceOrdinal(0)).unwrap();
    let c1 = sim.primary_ctx_retain(DeviceOrdinal(1)).unwrap();
    assert_ne!(c0, c1);
    let a = sim.mem_alloc(c0, 8).unwrap();
    let b = sim.mem_alloc(c1, 8).unwrap();
    assert_ne!(a, b, "unified addressing: devices never share addresses");
    assert_eq!(sim.mem_get_info(c1).unwrap().total, 32 << 20);
}

#[derive(Clone, Debug)]
enum Step {
    Alloc(usize),
    Free(prop::sample::Index),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => prop_oneof![1usize..=4096, 4097usize..=SMALL_MAX, SMALL_MAX + 1..=(6 << 20)].prop_map(Step::Alloc),
        3 => any::<prop::sample::Index>().prop_map(Step::Free),
    ]
}

/// `PROPTEST_CASES` if set, else `default`.
fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Where the property test writes its tag: the whole of a small allocation, or 64 bytes at
/// each end of a large one (enough to catch overlap, cheap enough for many cases). Under Miri,
/// which interprets every byte compared, 64 bytes at each end of any allocation above 64.
fn stamps(bytes: usize) -> Vec<(u64, usize)> {
    if bytes <= WHOLE_STAMP {
        vec![(0, bytes)]
    } else {
        vec![(0, 64), ((bytes - 64) as u64, 64)]
    }
}

/// The largest allocation the property test tags whole.
const WHOLE_STAMP: usize = if cfg!(miri) { 128 } else { 4096 };

/// The most steps of a property test case: under Miri, which checks every live allocation
/// after every step a thousand times slower, fewer, so that its time does not hang on the
/// lengths drawn.
const MOST_STEPS: usize = if cfg!(miri) { 24 } else { 60 };

proptest! {
    // 64 cases in CI; PROPTEST_CASES=N runs more.
    #![proptest_config(ProptestConfig { cases: cases(64), failure_persistence: None, ..ProptestConfig::default() })]

    /// After every step: live allocations never overlap, small ones are 512-aligned inside one
    /// page, large ones page-aligned; `free` equals total minus the pages that the live
    /// allocations touch; out-of-memory happens only when the pages needed are not free; every
    /// allocation still holds the bytes written to it.
    #[test]
    fn page_model_invariants(steps in prop::collection::vec(step(), 1..MOST_STEPS)) {
        let total = 24 << 20;
        let (sim, ctx) = started(SimConfig::single(total));
        let mut live: Vec<(DevicePtr, usize, u8)> = Vec::new();
        for (i, s) in steps.iter().enumerate() {
            match s {
                Step::Alloc(bytes) => {
                    let free_before = sim.mem_get_info(ctx).unwrap().free;
                    match sim.mem_alloc(ctx, *bytes) {
                        Ok(p) => {
                            let tag = i as u8;
                            for (at, len) in stamps(*bytes) {
                                // SAFETY: inside simulated memory just allocated.
                                unsafe { sim.memcpy_htod(ctx, DevicePtr(p.0 + at), &vec![tag; len]).unwrap() };
                            }
                            live.push((p, *bytes, tag));
                        }
                        Err(e) => {
                            prop_assert_eq!(e.kind(), ErrorKind::OutOfMemory);
                            let needed = if *bytes <= SMALL_MAX { PAGE_SIZE } else { bytes.next_multiple_of(PAGE_SIZE) };
                            prop_assert!(needed > free_before, "OOM with {free_before} free for {bytes}");
                        }
                    }
                }
                Step::Free(ix) => {
                    if !live.is_empty() {
                        let (p, _, _) = live.remove(ix.index(live.len()));
                        free(&sim, ctx, p).unwrap();
                    }
                }
            }
            let mut spans: Vec<(u64, u64)> = Vec::new();
            let mut pages = std::collections::BTreeSet::new();
            let page = PAGE_SIZE as u64;
            for &(p, bytes, tag) in &live {
                let span = if bytes <= SMALL_MAX { bytes.next_multiple_of(512) } else { bytes.next_multiple_of(PAGE_SIZE) } as u64;
                if bytes <= SMALL_MAX {
                    prop_assert_eq!(p.0 % 512, 0);
                    prop_assert_eq!(p.0 / page, (p.0 + span - 1) / page, "a small allocation stays in one page");
                } else {
                    prop_assert_eq!(p.0 % page, 0);
                }
                for q in p.0 / page..(p.0 + span).div_ceil(page) {
                    pages.insert(q);
                }
                spans.push((p.0, p.0 + span));
                for (at, len) in stamps(bytes) {
                    let mut back = vec![0u8; len];
                    // SAFETY: inside a live simulated allocation.
                    unsafe { sim.memcpy_dtoh(ctx, &mut back, DevicePtr(p.0 + at)).unwrap() };
                    prop_assert!(back.iter().all(|&b| b == tag), "allocation {p} lost its bytes");
                }
            }
            spans.sort();
            for w in spans.windows(2) {
                prop_assert!(w[0].1 <= w[1].0, "overlap: {:?}", w);
            }
            let info = sim.mem_get_info(ctx).unwrap();
            prop_assert_eq!(info.free, total - pages.len() * PAGE_SIZE);
        }
    }
}

/// `clear_calls` empties the log and leaves the model alone (a long-lived simulator's log would
/// otherwise grow without bound).
#[test]
fn clear_calls_empties_the_log_only() {
    let sim = SimDriver::new(SimConfig::default());
    sim.init().unwrap();
    let ctx = sim.primary_ctx_retain(DeviceOrdinal(0)).unwrap();
    let p = sim.mem_alloc(ctx, 4096).unwrap();
    assert_eq!(sim.total_calls(), 3);
    sim.clear_calls();
    assert_eq!(sim.total_calls(), 0);
    assert!(sim.calls().is_empty());
    assert_eq!(sim.live_allocations(DeviceOrdinal(0)), vec![(p, 4096)]);
    // SAFETY: allocated above, freed once.
    unsafe { sim.mem_free(ctx, p).unwrap() };
    assert_eq!(sim.ops(), vec![Op::MemFree]);
}

/// The stream model: queued work runs only when something lets it (a synchronisation, or
/// `run_streams`), in queue order, and waits hold it back.
mod streams {
    use std::sync::{Arc, Mutex};

    use driver_mock::{SimConfig, SimDriver};
    use driver_sys::{
        ContextHandle, DevicePtr, Driver, ErrorKind, HostPtr, StreamHandle, host_alloc,
        stream_flags, wait_value,
    };

    use super::started;

    /// A mapped pinned flag word, its device address, and a setter.
    fn flag(sim: &SimDriver, ctx: ContextHandle) -> (HostPtr, DevicePtr) {
        let h = sim.mem_host_alloc(ctx, 64, host_alloc::DEVICEMAP).unwrap();
        let d = sim.mem_host_get_device_pointer(ctx, h).unwrap();
        set(h, 0);
        (h, d)
    }

    fn set(h: HostPtr, v: u32) {
        // SAFETY: the test's own live pinned flag word; the simulator reads it only under its
        // lock, from this thread.
        unsafe { std::ptr::write_volatile(h.0 as *mut u32, v) }
    }

    fn log(
        sim: &SimDriver,
        ctx: ContextHandle,
        s: StreamHandle,
        seen: &Arc<Mutex<Vec<u32>>>,
        n: u32,
    ) {
        let seen = Arc::clone(seen);
        sim.launch_host_func(ctx, s, Box::new(move || seen.lock().unwrap().push(n)))
            .unwrap();
    }

    #[test]
    fn work_runs_in_order_when_let() {
        let (sim, ctx) = started(SimConfig::default());
        let s = sim.stream_create(ctx, stream_flags::NON_BLOCKING).unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        for n in 1..=3 {
            log(&sim, ctx, s, &seen, n);
        }
        assert!(seen.lock().unwrap().is_empty(), "nothing runs by itself");
        assert!(!sim.stream_query(ctx, s).unwrap());
        assert_eq!(sim.run_streams(), 0);
        assert_eq!(*seen.lock().unwrap(), vec![1, 2, 3]);
        assert!(sim.stream_query(ctx, s).unwrap());
    }

    /// An event recorded on a held stream, then again on an idle one: a wait made after the
    /// first record waits for that record, even once the second has run (found by emm's
    /// stream-reuse property test: the simulator once kept one completion mark per event).
    #[test]
    fn a_wait_names_the_record_it_waits_for() {
        let (sim, ctx) = started(SimConfig::default());
        let (fh, fd) = flag(&sim, ctx);
        let [held, idle, waiter] =
            [(); 3].map(|_| sim.stream_create(ctx, stream_flags::NON_BLOCKING).unwrap());
        let e = sim
            .event_create(ctx, driver_sys::event_flags::DISABLE_TIMING)
            .unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        sim.stream_wait_value32(ctx, held, fd, 1, wait_value::EQ)
            .unwrap();
        sim.event_record(ctx, e, held).unwrap();
        sim.stream_wait_event(ctx, waiter, e).unwrap();
        log(&sim, ctx, waiter, &seen, 1);
        sim.event_record(ctx, e, idle).unwrap();
        sim.run_streams();
        assert!(sim.event_query(ctx, e).unwrap(), "the last record ran");
        assert!(
            seen.lock().unwrap().is_empty(),
            "the wait is for the first record, still held"
        );
        set(fh, 1);
        sim.run_streams();
        assert_eq!(*seen.lock().unwrap(), vec![1]);
    }

    #[test]
    fn a_wait_holds_until_the_flag_and_a_hang_is_an_error() {
        let (sim, ctx) = started(SimConfig::default());
        let (fh, fd) = flag(&sim, ctx);
        let s = sim.stream_create(ctx, stream_flags::NON_BLOCKING).unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        sim.stream_wait_value32(ctx, s, fd, 5, wait_value::GEQ)
            .unwrap();
        log(&sim, ctx, s, &seen, 1);
        assert_eq!(sim.run_streams(), 2, "the wait and what follows it wait");
        assert_eq!(
            sim.stream_synchronize(ctx, s).unwrap_err().kind(),
            ErrorKind::Other,
            "synchronising a stream nothing will release: the GPU would hang"
        );
        set(fh, 6);
        sim.stream_synchronize(ctx, s).unwrap();
        assert_eq!(*seen.lock().unwrap(), vec![1]);
    }

    #[test]
    fn the_legacy_stream_waits_for_blocking_streams_only() {
        let (sim, ctx) = started(SimConfig::default());
        let (fh, fd) = flag(&sim, ctx);
        let blocking = sim.stream_create(ctx, stream_flags::DEFAULT).unwrap();
        let free = sim.stream_create(ctx, stream_flags::NON_BLOCKING).unwrap();
        let p = sim.mem_alloc(ctx, 64).unwrap();
        let mut out = [0u8; 4];
        // Held non-blocking work does not hold a synchronous copy.
        sim.stream_wait_value32(ctx, free, fd, 1, wait_value::EQ)
            .unwrap();
        // SAFETY: `p` is live; `out` is the test's buffer.
        unsafe { sim.memcpy_dtoh(ctx, &mut out, p) }.unwrap();
        // Held blocking work does: the GPU would hang, the simulator refuses.
        sim.stream_wait_value32(ctx, blocking, fd, 1, wait_value::EQ)
            .unwrap();
        // SAFETY: as above.
        let held = unsafe { sim.memcpy_dtoh(ctx, &mut out, p) };
        assert_eq!(held.unwrap_err().kind(), ErrorKind::Other);
        // Work queued on a blocking stream after legacy work waits for it.
        let seen = Arc::new(Mutex::new(Vec::new()));
        set(fh, 1);
        sim.run_streams();
        set(fh, 0);
        sim.stream_wait_value32(ctx, StreamHandle::LEGACY, fd, 1, wait_value::EQ)
            .unwrap();
        log(&sim, ctx, blocking, &seen, 1);
        log(&sim, ctx, free, &seen, 2);
        sim.run_streams();
        assert_eq!(
            *seen.lock().unwrap(),
            vec![2],
            "the blocking stream waits for legacy work"
        );
        set(fh, 1);
        sim.run_streams();
        assert_eq!(*seen.lock().unwrap(), vec![2, 1]);
    }

    #[test]
    fn pageable_sources_are_taken_at_once_pinned_ones_when_the_copy_runs() {
        let (sim, ctx) = started(SimConfig::default());
        let s = sim.stream_create(ctx, stream_flags::NON_BLOCKING).unwrap();
        let p = sim.mem_alloc(ctx, 8).unwrap();
        let q = sim.mem_alloc(ctx, 8).unwrap();
        let mut pageable = [1u8; 8];
        let pinned = sim.mem_host_alloc(ctx, 8, 0).unwrap();
        // SAFETY: the test's own buffers stay live until the streams ran below; `pinned` is
        // written through its address only while no copy runs.
        unsafe {
            sim.memcpy_htod_async(ctx, p, HostPtr(pageable.as_ptr() as usize), 8, s)
                .unwrap();
            std::ptr::write_bytes(pinned.0 as *mut u8, 1, 8);
            sim.memcpy_htod_async(ctx, q, pinned, 8, s).unwrap();
        }
        pageable.fill(2);
        // SAFETY: as above.
        unsafe { std::ptr::write_bytes(pinned.0 as *mut u8, 2, 8) };
        sim.stream_synchronize(ctx, s).unwrap();
        let (mut a, mut b) = ([0u8; 8], [0u8; 8]);
        // SAFETY: live allocations, the test's buffers.
        unsafe {
            sim.memcpy_dtoh(ctx, &mut a, p).unwrap();
            sim.memcpy_dtoh(ctx, &mut b, q).unwrap();
        }
        assert_eq!(a, [1; 8], "pageable: the bytes at the call");
        assert_eq!(b, [2; 8], "pinned: the bytes when the copy ran");
    }

    #[test]
    fn a_destroyed_streams_work_still_runs() {
        let (sim, ctx) = started(SimConfig::default());
        let s = sim.stream_create(ctx, 0).unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        log(&sim, ctx, s, &seen, 7);
        // SAFETY: the stream is destroyed once; its queued host function stays valid.
        unsafe { sim.stream_destroy(ctx, s) }.unwrap();
        assert_eq!(sim.run_streams(), 0);
        assert_eq!(*seen.lock().unwrap(), vec![7]);
    }
}

/// A stream destroyed with work queued keeps its queue until that work has run, and not after:
/// a long-lived simulator that makes and destroys busy streams keeps no queue per stream it
/// ever made (the `stream_lifetimes` fuzz target slowed down as they piled up).
#[test]
fn a_destroyed_streams_queue_goes_once_its_work_has_run() {
    let (sim, ctx) = started(SimConfig::default());
    let p = sim.mem_alloc(ctx, 4096).unwrap();
    let before = sim.stream_queues();
    for round in 0..3 {
        let s = sim.stream_create(ctx, 0).unwrap();
        // SAFETY: `p` is this context's memory, live until the end of the test.
        unsafe { sim.memset_d8_async(ctx, p, 7, 4096, s).unwrap() };
        // SAFETY: `s` is a stream of `ctx`, used by nothing after.
        unsafe { sim.stream_destroy(ctx, s).unwrap() };
        assert_eq!(
            sim.stream_queues(),
            before + 1,
            "round {round}: its work is queued"
        );
        assert_eq!(sim.run_streams(), 0);
        assert_eq!(
            sim.stream_queues(),
            before,
            "round {round}: its work has run"
        );
    }
    free(&sim, ctx, p).unwrap();
}

/// Stream-ordered pool memory: blocks of a device pool share its 2 MiB pages (what the pool
/// reserves and the device counts as used is pages, not blocks), a page goes when its last
/// block is released, and `cuMemFree` of a pool's block gives it back to the pool, not to the
/// system.
#[test]
fn pool_blocks_share_pages_and_cu_mem_free_returns_them_to_their_pool() {
    use driver_sys::StreamHandle;
    let (sim, ctx) = started(SimConfig::default());
    let pool = sim.device_default_mem_pool(DEV).unwrap();
    let used = |sim: &SimDriver| {
        let info = sim.mem_get_info(ctx).unwrap();
        info.total - info.free
    };
    let base = used(&sim);
    let s = StreamHandle::NULL;
    let a = sim.mem_alloc_from_pool_async(ctx, pool, 4096, s).unwrap();
    let b = sim.mem_alloc_from_pool_async(ctx, pool, 4096, s).unwrap();
    assert_eq!(b.0, a.0 + 4096, "packed");
    let usage = sim.mem_pool_usage(ctx, pool).unwrap();
    assert_eq!((usage.used, usage.reserved), (8192, PAGE_SIZE as u64));
    assert_eq!(used(&sim) - base, PAGE_SIZE, "one page for both blocks");

    free(&sim, ctx, a).unwrap();
    let usage = sim.mem_pool_usage(ctx, pool).unwrap();
    assert_eq!(
        usage.used, 4096,
        "cuMemFree gave the block back to the pool"
    );
    let c = sim.mem_alloc_from_pool_async(ctx, pool, 4096, s).unwrap();
    assert_eq!(c, a, "and the pool serves it again");

    // SAFETY: each block is freed once; nothing uses them.
    unsafe {
        sim.mem_free_async(ctx, b, s).unwrap();
        sim.mem_free_async(ctx, c, s).unwrap();
    }
    sim.stream_synchronize(ctx, s).unwrap();
    sim.mem_pool_trim_to(ctx, pool, 0).unwrap();
    assert_eq!(sim.mem_pool_usage(ctx, pool).unwrap().reserved, 0);
    assert_eq!(used(&sim), base, "the page went with the last block");
}

/// Stand-in work of a recorded program (`launch_recorded`) holds its stream until the stream's
/// progress (`reach_recorded`) passes its time: queries say busy, an event recorded behind it
/// is not done, and running the streams does not pass it. A synchronisation passes it (the
/// host waited for the GPU), and so does a `cuMemFree`, which waits for the device's work.
#[test]
fn recorded_work_holds_its_stream_until_it_is_reached() {
    let (sim, ctx) = started(SimConfig::single(1 << 30));
    let stream = sim.stream_create(ctx, 0).unwrap();
    let event = sim.event_create(ctx, 0).unwrap();
    sim.launch_recorded(ctx, stream, 100).unwrap();
    sim.event_record(ctx, event, stream).unwrap();
    sim.run_streams();
    assert!(!sim.stream_query(ctx, stream).unwrap());
    assert!(!sim.event_query(ctx, event).unwrap());
    sim.reach_recorded(ctx, stream, 50).unwrap();
    assert!(!sim.event_query(ctx, event).unwrap(), "not reached yet");
    sim.reach_recorded(ctx, stream, 100).unwrap();
    assert!(sim.event_query(ctx, event).unwrap());
    assert!(sim.stream_query(ctx, stream).unwrap());
    // Progress never goes back; a synchronisation passes what is queued.
    sim.reach_recorded(ctx, stream, 10).unwrap();
    sim.launch_recorded(ctx, stream, 200).unwrap();
    assert!(!sim.stream_query(ctx, stream).unwrap());
    sim.stream_synchronize(ctx, stream).unwrap();
    assert!(sim.stream_query(ctx, stream).unwrap());
    // A free waits for the device's work.
    let p = sim.mem_alloc(ctx, 4096).unwrap();
    sim.launch_recorded(ctx, stream, 300).unwrap();
    free(&sim, ctx, p).unwrap();
    assert!(
        sim.stream_query(ctx, stream).unwrap(),
        "the free waited for the device"
    );
    // A handle the process does not have is refused.
    // SAFETY: a made-up handle, which the simulator looks up and refuses.
    let stranger = unsafe { driver_sys::StreamHandle::from_raw(0xdead_0000) };
    assert!(sim.launch_recorded(ctx, stranger, 1).is_err());
}

#[test]
fn cu_mem_alloc_memory_freed_on_a_stream_goes_when_the_stream_gets_there() {
    let (sim, ctx) = started(SimConfig::single(1 << 30));
    let stream = sim.stream_create(ctx, 0).unwrap();
    let p = sim.mem_alloc(ctx, 8 << 20).unwrap();
    let before = sim.mem_get_info(ctx).unwrap().free;
    sim.launch_recorded(ctx, stream, 100).unwrap();
    let free_async = || {
        // SAFETY: the simulator's memory is simulated; misuse is answered with errors.
        unsafe { sim.mem_free_async(ctx, p, stream) }
    };
    free_async().unwrap();
    assert_eq!(
        sim.mem_get_info(ctx).unwrap().free,
        before,
        "in use until the stream reaches the free"
    );
    // Freed once: another free of it, either kind, is a double free.
    assert_eq!(
        free(&sim, ctx, p).unwrap_err().kind(),
        ErrorKind::InvalidValue
    );
    assert_eq!(free_async().unwrap_err().kind(), ErrorKind::InvalidValue);
    sim.reach_recorded(ctx, stream, 100).unwrap();
    assert_eq!(sim.mem_get_info(ctx).unwrap().free, before + (8 << 20));
    assert_eq!(
        free(&sim, ctx, p).unwrap_err().kind(),
        ErrorKind::InvalidValue
    );
    assert!(
        sim.leak_report().no_memory_leaked(),
        "{}",
        sim.leak_report()
    );
}
