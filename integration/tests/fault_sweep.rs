//! Fault injection at every driver call.
//!
//! A reference workload (every public operation: device, pinned and mapped memory, pins,
//! views, copies, memset, streams, events, modules, `defer_cleanup`, trims, IPC opened in a
//! second process, context reset, device reset) runs once per manager to count its driver
//! calls, from the runtime's first `cuInit` on, then again once per call index with that call
//! failing, for each of four error kinds; and once more per pair of a call and a later one, so
//! that the cleanup a first fault sets off (drops, closes, resets) is faulted too. For every
//! run:
//!
//! - each injected fault fires, at the call it names;
//! - the error reaches the caller as a typed `EmmError` with a message; a fault the workload
//!   completes despite is one emm is entitled to absorb (out-of-memory of an allocation, which
//!   Numba retries, or a failed release, which emm logs and leaves to the context's end), and
//!   any other is a failure;
//! - nothing panics, and the bytes read back are the bytes written;
//! - the driver refuses no release call emm makes (a double free, a free into a destroyed
//!   context, a close of what is not open), in either process;
//! - destroying a context reclaims nothing emm still held, but for the memory a faulted
//!   release left behind: `SimDriver::reclaimed_by_destroy`, which sees what the leak report
//!   after the context's end cannot;
//! - the first flush afterwards returns an error only where it names a faulted call;
//! - the runtime still works: a fresh allocation and copy succeed afterwards;
//! - once the runtime is dropped, the simulator holds nothing.
//!
//! Those runs end their faults before the runtime is dropped; a third sweep faults each call of
//! `Runtime::drop` itself (resets, the teardown flush, the contexts' release) with memory of
//! every kind still held, and checks what the contexts' destruction reclaimed after it.
//!
//! The sweep fails when any `Driver` operation (`Op::ALL`) was never faulted by it. It prints
//! how many injected faults were survived. Simulator only; it runs in CI.
#![allow(unsafe_code)]

use std::sync::Arc;

use driver_mock::{Fault, Op, SimConfig, SimDeviceConfig, SimDriver};
use driver_sys::{CaptureMode, DeviceOrdinal, ErrorKind};
use emm::contract::FnFactory;
use emm::plugin::{AllocationKind, DeviceAllocator, HostLayer, HostOnly};
use emm::{Adaptor, EmmError, IpcHandle, MemoryPointer, PinnableBuffer, PinnedPoolConfig, Runtime};

const PTX: &str =
    ".version 8.0\n.target sm_90\n.address_size 64\n\n.visible .entry emm_noop()\n{\n\tret;\n}\n";
const KINDS: [ErrorKind; 4] = [
    ErrorKind::OutOfMemory,
    ErrorKind::InvalidValue,
    ErrorKind::ContextDestroyed,
    ErrorKind::DriverUnavailable,
];

/// A second manager design: device memory from the driver, freed at once by the pointer's own
/// release action (no queue); host memory from the host layer.
#[derive(Debug)]
struct ImmediateFree;

impl DeviceAllocator for ImmediateFree {
    fn memalloc(&self, host: &HostLayer, bytes: usize) -> Result<MemoryPointer, EmmError> {
        let cx = host.context().clone();
        let base = host.attempt_allocation("memalloc", AllocationKind::Device, bytes, || {
            cx.driver.mem_alloc(cx.context, bytes)
        })?;
        let (device, context) = (cx.device, cx.context);
        let release = move |ptr, _| {
            let Some(_live) = cx.liveness.enter() else {
                return;
            };
            // SAFETY: `ptr` was allocated above and this is its only release; the last pointer
            // to it just dropped; `_live` keeps the context alive.
            if let Err(e) = unsafe { cx.driver.mem_free(cx.context, ptr) } {
                tracing::error!(error = %e, "immediate free failed");
            }
        };
        // SAFETY: `base` was just allocated by `cuMemAlloc` for `bytes` bytes; the release
        // frees it once.
        Ok(unsafe { MemoryPointer::with_release(device, context, base, bytes, release) })
    }

    fn initialize(&self, _: &HostLayer) -> Result<(), EmmError> {
        Ok(())
    }
}

/// A runtime over `sim` with the manager `manager`; `pool+adaptors` is the pool with the
/// `limit`, `stats` and `trace` adaptors around it and the pinned host pool in its host layer.
fn runtime(sim: &Arc<SimDriver>, manager: &str) -> Result<Runtime, EmmError> {
    let builder = Runtime::builder(sim.clone())
        .ignore_env()
        .register_manager(FnFactory::new("immediate", |cx| {
            Ok(Box::new(HostOnly::new(cx, ImmediateFree)))
        }));
    match manager {
        // Not the `log` adaptor: it reads free and total memory at most once a millisecond, so
        // how many driver calls a run makes depends on the clock, and a sweep by call index
        // needs runs that repeat exactly. The suite runs under `log` in `.ci/run`.
        "pool+adaptors" => builder
            .memory_manager_name("pool")
            .adaptors(vec![
                Adaptor::Limit(64 << 20),
                Adaptor::Stats,
                Adaptor::Trace,
            ])
            .pinned_host_pool(Some(PinnedPoolConfig::default()))
            .build(),
        "default+host-pool" => builder
            .memory_manager_name("default")
            .host_memory_pool(true)
            .build(),
        name => builder.memory_manager_name(name).build(),
    }
}

/// Every public operation once. Returns at the first error, dropping what it holds; the bytes
/// it reads back must be the bytes it wrote (a mismatch panics).
fn workload(
    sim: &Arc<SimDriver>,
    rt: &Runtime,
    others: &mut Vec<Arc<SimDriver>>,
    other_faults: &[Fault],
) -> Result<(), EmmError> {
    let ctx = rt.context(0)?;
    ctx.get_memory_info()?;
    let a = ctx.to_device(&[1u8; 100])?;
    let view = a.view(10, None)?;
    let mut buf = [0u8; 90];
    ctx.copy_to_host(&mut buf, &view)?;
    assert_eq!(buf, [1u8; 90], "bytes read back");
    let b = ctx.memalloc(4096)?;
    ctx.memset(&b, 7, 4096)?;
    ctx.copy_device(&b, &a, 100)?;
    let mut head = [0u8; 101];
    ctx.copy_to_host(&mut head, &b)?;
    assert_eq!(head[..100], [1u8; 100], "copied bytes");
    assert_eq!(head[100], 7, "set bytes");
    ctx.device_extents(&view)?;
    let mapped = ctx.memhostalloc(64, true, false, false)?;
    // Portable and write-combined memory only come from cuMemHostAlloc.
    let legacy = !rt.uses_host_memory_pool();
    let pinned = ctx.memhostalloc(64, false, legacy, legacy)?;
    pinned.write(0, &[3u8; 64])?;
    ctx.copy_pinned_to_device(&b, &pinned, 64)?;
    let managed = ctx.memallocmanaged(256, true)?;
    managed.write(0, &[4u8; 256])?;
    let mut seen = [0u8; 256];
    ctx.copy_to_host(&mut seen, managed.device())?;
    assert_eq!(seen, [4u8; 256], "managed bytes read back");
    let mapped_pin = ctx.pin(Arc::new(PinnableBuffer::zeroed(64)), true)?;
    let pin = ctx.pin(Arc::new(PinnableBuffer::zeroed(64)), false)?;
    let stream = ctx.create_stream()?;
    let event = ctx.create_event(true)?;
    // Streams and events at work: a prioritised stream, a host function, records, a
    // cross-stream wait, queries, a synchronisation and a timing.
    let (_, greatest) = ctx.stream_priority_range()?;
    let fast = ctx.create_stream_with(true, greatest)?;
    let start = ctx.create_event(true)?;
    start.record(&fast)?;
    fast.launch_host_func(|| {})?;
    event.record(&fast)?;
    stream.wait_event(&event)?;
    event.synchronize()?;
    assert!(
        event.query()? && fast.query()?,
        "done after the event's synchronisation"
    );
    event.elapsed_since(&start)?;
    assert_eq!(fast.priority()?, greatest, "the priority asked for");
    // Asynchronous copies and a set on the stream, through page-locked and pageable memory.
    let c = ctx.memalloc(64)?;
    let d = ctx.memalloc(64)?;
    let staging = ctx.memhostalloc(64, false, false, false)?;
    staging.write(0, &[6u8; 64])?;
    let staging = ctx.copy_to_device_async(&c, staging, &fast)?.wait()?;
    ctx.copy_device_async(&d, &c, &fast)?.wait()?;
    ctx.memset_async(&c, 8, &fast)?.wait()?;
    let staging = ctx.copy_to_host_async(staging, &d, &fast)?.wait()?;
    let mut got = [0u8; 64];
    staging.read(0, &mut got)?;
    assert_eq!(got, [6u8; 64], "bytes through the async copies");
    ctx.copy_to_device_on(&d, &[5u8; 64], &fast)?;
    ctx.copy_to_host_on(&mut got, &d, &fast)?;
    assert_eq!(
        got, [5u8; 64],
        "bytes through the stream-ordered pageable copies"
    );
    drop((c, d, staging));
    // Stream-ordered memory: allocated on one stream, used by another (recorded), freed on a
    // third; a second block freed where it was allocated; then allocations on other streams
    // (the pool takes other streams' blocks back here) and a synchronisation.
    if ctx.stream_ordering() != emm::contract::StreamOrdering::Unsupported {
        let e = ctx.memalloc_on(4096, &fast)?;
        ctx.memset_async(&e, 2, &fast)?.wait()?;
        e.record_stream(&stream)?;
        e.free_on(&ctx.legacy_default_stream())?;
        let f = ctx.memalloc_on(300, &stream)?;
        drop((e, f));
        let g = ctx.memalloc_on(4096, &stream)?;
        let h = ctx.memalloc_on(300, &fast)?;
        fast.synchronize()?;
        stream.synchronize()?;
        ctx.legacy_default_stream().synchronize()?;
        drop((g, h));
        drop(ctx.memalloc_on(64, &fast)?);
        fast.synchronize()?;
    }
    // A graph captured on a blocking stream through a graph pool, launched twice.
    {
        let input = ctx.memalloc(256)?;
        ctx.memset(&input, 1, 256)?;
        let (graph, out) = ctx.capture(&stream, CaptureMode::Global, |s| {
            let out = ctx.memalloc_on(256, s)?;
            ctx.copy_device_async(&out, &input, s)?.wait()?;
            Ok(out)
        })?;
        graph.launch(&stream)?;
        graph.launch(&stream)?;
        stream.synchronize()?;
        let mut seen = [0u8; 256];
        ctx.copy_to_host(&mut seen, &out)?;
        assert_eq!(seen, [1u8; 256], "bytes through the graph");
        drop((graph, out, input));
    }
    // A memory resource beside the manager: its own limited pool, a buffer on a stream, the
    // pool's figures, a deallocation on another stream, the close.
    {
        let mr = ctx.device_memory_resource(emm::DeviceMemoryResourceOptions {
            max_size: 16 << 20,
            ipc_enabled: false,
        })?;
        let buf = mr.allocate(4096, &fast)?;
        ctx.memset_async(&buf, 9, &fast)?.wait()?;
        mr.attributes()?;
        mr.reset_high_water()?;
        mr.deallocate(buf, &stream)?;
        stream.synchronize()?;
        mr.close()?;
        let pinned = ctx.pinned_memory_resource(emm::PinnedMemoryResourceOptions::default())?;
        let host = pinned.allocate(4096, &fast)?;
        fast.synchronize()?;
        host.write(0, &[4u8; 64])?;
        pinned.attributes()?;
        pinned.deallocate(host, &fast)?;
        fast.synchronize()?;
        pinned.close()?;
        let managed = ctx.managed_memory_resource(emm::ManagedMemoryResourceOptions::default())?;
        let m = managed.allocate(4096, &stream)?;
        stream.synchronize()?;
        m.write(0, &[5u8; 64])?;
        managed.deallocate(m, &stream)?;
        stream.synchronize()?;
        managed.close()?;
    }
    let module = ctx.load_module(PTX.as_bytes())?;
    {
        let _guard = ctx.defer_cleanup()?;
        drop((a, view, mapped, managed));
        ctx.flush_deallocations()?;
    }
    ctx.flush_deallocations()?;
    ctx.trim()?;
    let _ = ctx.pool_stats();
    ctx.can_access_peer(DeviceOrdinal(1))?;
    // Not under `async-pool` and `async-pool-managed`, whose pools are not created for export,
    // nor under `vmm-pool`, whose mapped memory the driver does not export by IPC handle:
    // get_ipc_handle refuses there (the suite checks how), and the memory travels as file
    // descriptors instead.
    let exports = ![
        emm::plugin::ASYNC_POOL_MANAGER,
        emm::plugin::ASYNC_POOL_MANAGED_MANAGER,
        emm::plugin::VMM_POOL_MANAGER,
    ]
    .contains(&ctx.memory_manager_name());
    if exports {
        ipc_round_trip(sim, &ctx, &b, others, other_faults)?;
    }
    if ctx.memory_manager_name() == emm::plugin::VMM_POOL_MANAGER {
        mapped_round_trip(sim, &ctx, &b, others, other_faults)?;
        // The pool's memory put to sleep, `b` offloaded, and woken with `b` back.
        let mut want = vec![0u8; b.size()];
        ctx.copy_to_host(&mut want, &b)?;
        ctx.sleep(&emm::SleepOptions::default())?;
        ctx.wake()?;
        let mut got = vec![0u8; b.size()];
        ctx.copy_to_host(&mut got, &b)?;
        assert_eq!(got, want, "an offloaded allocation after the wake");
    }
    // A copy to the second device, a peer, which asks for peer access first (not of the
    // driver's stream-ordered pool memory, which a peer copy cannot reach).
    if ctx.stream_ordering() != emm::contract::StreamOrdering::Driver {
        let second = rt.context(1)?;
        let copy = second.memalloc(b.size())?;
        second.copy_peer(&copy, &ctx, &b, b.size())?;
        let (mut want, mut got) = (vec![0u8; b.size()], vec![0u8; b.size()]);
        ctx.copy_to_host(&mut want, &b)?;
        second.copy_to_host(&mut got, &copy)?;
        assert_eq!(got, want, "bytes copied between devices");
    }
    drop((stream, fast, event, start, module, pinned, mapped_pin, pin));
    ctx.reset()?;
    drop(b);
    rt.reset_device(0)?;
    Ok(())
}

/// Writes one test's figures (`key=value` lines) where `cargo run -p ci -- doc-figures` reads
/// them to check, or write, docs/testing.md's account of the sweep: figures come from this
/// run, never by hand.
/// A binary run away from its build tree (the GPU bundle) has no target directory: it says so
/// and writes nothing, since only `.ci/run` checks the page.
fn record_figures(test: &str, figures: &[(&str, String)]) {
    let target = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
    if !target.is_dir() {
        println!(
            "fault sweep: {} is not here (a copied binary); its figures are not written",
            target.display()
        );
        return;
    }
    let dir = target.join("fault_sweep_figures");
    let text: String = figures.iter().map(|(k, v)| format!("{k}={v}\n")).collect();
    std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(dir.join(format!("{test}.txt")), text))
        .unwrap_or_else(|e| panic!("writing the sweep's figures to {}: {e}", dir.display()));
}

/// Two peer devices, so that IPC opens cross devices (direct, with pool access granted, and
/// staged).
fn machine() -> SimDriver {
    SimDriver::new(
        SimConfig::with_devices(vec![
            SimDeviceConfig::new(256 << 20),
            SimDeviceConfig::new(256 << 20),
        ])
        .peer_access(true),
    )
}

/// `Driver` operations emm never calls, so no workload of emm's can fault them: the raw
/// baselines of the GPU benchmark (`cuDeviceGetDefaultMemPool`) and the driver probe
/// (`cuDeviceTotalMem`), and the stream memory operations, which emm does not make (the
/// conformance suite and the stream tests call them). The sweep checks that its clean runs
/// indeed never call them.
fn not_called_by_emm() -> impl Iterator<Item = Op> {
    [
        Op::DeviceGetDefaultMemPool,
        Op::StreamWaitValue32,
        Op::StreamWriteValue32,
    ]
    .into_iter()
}

/// The driver objects a faulted call of `op` leaves to its context's destruction: a release
/// leaves its object; an unmapping leaves the mapping and the reservation it sits in, which
/// cannot be freed around it; any other call leaves nothing.
fn left_by_fault(op: Op) -> usize {
    match op {
        Op::MemUnmap => 2,
        op if op.is_release() => 1,
        _ => 0,
    }
}

/// Checks the bytes another process read through IPC from the workload's view of `b` at byte
/// 64: the copied ones up to 100, then the set ones.
fn check_view_bytes(seen: &[u8], route: &str) {
    assert_eq!(seen[..36], [1u8; 36], "bytes seen through {route}");
    assert!(
        seen[36..].iter().all(|&x| x == 7),
        "bytes seen through {route}"
    );
}

/// A new process of `sim`'s machine with `faults` injected, pushed on `others`.
fn other_process(
    sim: &Arc<SimDriver>,
    others: &mut Vec<Arc<SimDriver>>,
    faults: &[Fault],
) -> Arc<SimDriver> {
    let other = Arc::new(sim.spawn_process());
    others.push(other.clone());
    for f in faults {
        other.inject(*f);
    }
    other
}

/// The workload's IPC step under `vmm-pool`: `b`'s bytes copied into memory allocated to
/// share, a view of it exported as file descriptors, sent over a socket pair, mapped in
/// another process (pushed on `others`, with `other_faults` injected) on the exporting device;
/// the bytes must arrive.
fn mapped_round_trip(
    sim: &Arc<SimDriver>,
    ctx: &emm::Context,
    b: &MemoryPointer,
    others: &mut Vec<Arc<SimDriver>>,
    other_faults: &[Fault],
) -> Result<(), EmmError> {
    let shared = ctx.memalloc_shared(b.size())?;
    ctx.copy_device(&shared, b, b.size())?;
    let export = ctx.export_mapped(&shared.view(64, None)?)?;
    let (tx, rx) = std::os::unix::net::UnixStream::pair().expect("a socket pair");
    export.send(&tx)?;
    let received = emm::contract::MappedExport::receive(&rx)?;
    let other = other_process(sim, others, other_faults);
    let other_rt = Runtime::builder(other.clone()).ignore_env().build()?;
    let other_ctx = other_rt.context(0)?;
    let mem = other_ctx.open_mapped(received)?;
    let mut seen = vec![0u8; mem.size()];
    other_ctx.copy_to_host(&mut seen, &mem)?;
    check_view_bytes(&seen, "a mapped export");
    Ok(())
}

/// The workload's IPC step: a view of `b` exported here, opened in another process (pushed on
/// `others`, with `other_faults` injected) directly and staged; the bytes must arrive.
fn ipc_round_trip(
    sim: &Arc<SimDriver>,
    ctx: &emm::Context,
    b: &MemoryPointer,
    others: &mut Vec<Arc<SimDriver>>,
    other_faults: &[Fault],
) -> Result<(), EmmError> {
    // IPC: exported here, opened in another process, directly and staged.
    let handle = ctx.get_ipc_handle(&b.view(64, None)?)?;
    let other = other_process(sim, others, other_faults);
    {
        let other_rt = Runtime::builder(other.clone()).ignore_env().build()?;
        if ctx.memory_manager_name() == emm::plugin::ASYNC_POOL_IPC_MANAGER {
            // Pool memory opens once the other process imported the pool.
            other_rt.import_pool(ctx.export_pool()?)?;
        }
        // On the second device, a peer of the first: direct opens map across devices (pool
        // memory after a grant of access), staged ones copy through the source device.
        let other_ctx = other_rt.context(1)?;
        for staged in [false, true] {
            let imported = IpcHandle::from_bytes(&handle.to_bytes())?;
            let mem = if staged {
                imported.open_staged(&other_rt, &other_ctx)?
            } else {
                imported.open(&other_rt, &other_ctx)?
            };
            let mut seen = vec![0u8; mem.size()];
            other_ctx.copy_to_host(&mut seen, &mem)?;
            check_view_bytes(&seen, "IPC");
            imported.close()?;
        }
    }
    Ok(())
}

/// What a run saw.
struct Outcome {
    /// Calls the faulted process made in the workload (from its first `cuInit`).
    calls: usize,
    error: Option<EmmError>,
    /// The operations whose calls were made to fail, in order.
    faulted: Vec<Op>,
}

/// Runs the workload with `faults` in the exporting process (or, with `in_other`, in the one
/// that opens its IPC handles), then checks everything the module's documentation lists.
fn run(manager: &str, faults: &[Fault], in_other: bool) -> Result<Outcome, String> {
    let sim = Arc::new(machine());
    let early_before = driver_mock::frees_while_imported_on_this_thread();
    if !in_other {
        // Before the runtime exists, so that its cuInit is faulted too.
        for f in faults {
            sim.inject(*f);
        }
    }
    let other_faults: &[Fault] = if in_other { faults } else { &[] };
    let mut others = Vec::new();
    let (rt, result) = match runtime(&sim, manager) {
        Ok(rt) => {
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                workload(&sim, &rt, &mut others, other_faults)
            }))
            .map_err(|p| {
                let why = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                format!("the workload panicked: {why}")
            })?;
            (Some(rt), result)
        }
        Err(e) => (None, Err(e)),
    };
    let faulty = if in_other {
        match others.first() {
            Some(o) => o.clone(),
            None if faults.is_empty() => {
                return Err("the workload never reached its IPC step".into());
            }
            // A fault in the exporter's part ended the run before the IPC step: nothing of the
            // importer was faulted, which the fired-faults check reports.
            None => Arc::new(sim.spawn_process()),
        }
    } else {
        sim.clone()
    };
    let calls = faulty.total_calls();
    let faulted: Vec<Op> = faulty
        .calls()
        .iter()
        .filter(|c| c.injected)
        .map(|c| c.op)
        .collect();
    faulty.clear_faults();
    if faulted.len() != faults.len() {
        return Err(format!(
            "{} of {} injected faults fired (after {calls} calls)",
            faulted.len(),
            faults.len()
        ));
    }
    if let Err(e) = &result {
        let text = e.to_string();
        if text.len() < 20 {
            return Err(format!("an unhelpful error message: {text:?}"));
        }
    }
    // A capture whose end failed twice (`Context::capture` tries twice) is still under way:
    // the driver refuses the frees it forbids until the stream is gone, which is the only
    // case where a refused release is not emm's fault.
    let stuck = faulted == [Op::StreamEndCapture, Op::StreamEndCapture];
    let explained = |refused: &[driver_mock::CallRecord]| {
        stuck
            && refused
                .iter()
                .all(|c| c.outcome == Err(ErrorKind::StreamCapture))
    };
    // Checked before the runtime goes: what the faulted run's contexts took with them. A
    // faulted release leaves its object; a faulted unmapping leaves the mapping and the
    // reservation it sits in, which cannot be freed around it.
    let absorbed_releases: usize = faulted.iter().map(|&op| left_by_fault(op)).sum();
    for (who, process) in
        std::iter::once(("exporter", &sim)).chain(others.iter().map(|o| ("importer", o)))
    {
        let refused = process.failed_releases();
        if !refused.is_empty() && !explained(&refused) {
            return Err(format!(
                "the driver refused release calls in the {who} (a double free, or a free into a destroyed context): {refused:?}"
            ));
        }
        let reclaimed = process.reclaimed_by_destroy();
        let held = reclaimed.objects();
        if held > absorbed_releases {
            return Err(format!(
                "destroying the {who}'s context reclaimed what emm still held ({held} objects, {absorbed_releases} explained by faulted releases): {reclaimed}"
            ));
        }
    }
    if let Some(rt) = rt {
        // The runtime still works.
        let ctx = rt
            .context(0)
            .map_err(|e| format!("context after the fault: {e}"))?;
        // The queue is consistent: a flush (faults are off now) issues everything it holds;
        // a free the fault refused is set aside for the context's teardown (at most one per
        // faulted release).
        if let Some(queue) = ctx.deallocations() {
            // The first flush reports what failed in a drop earlier (emm keeps such errors for
            // the next flush): one of the faulted calls, named; a second flush has nothing
            // left to report.
            if let Err(e) = queue.flush() {
                let text = e.to_string();
                let explained = faulted
                    .iter()
                    .any(|op| text.contains(&format!("cu{op:?} failed")))
                    || (stuck && text.contains("CUDA_ERROR_STREAM_CAPTURE"));
                if !explained {
                    return Err(format!(
                        "the first flush after the faults {faulted:?} reported an error none of them explains: {text}"
                    ));
                }
            }
            queue
                .flush()
                .map_err(|e| format!("a second flush after the fault: {e}"))?;
            if !queue.is_empty()
                || queue.pending_bytes() != 0
                || queue.failed().len() > absorbed_releases
            {
                return Err(format!(
                    "the queue after a flush: {} pending ({} bytes), {} failed",
                    queue.len(),
                    queue.pending_bytes(),
                    queue.failed().len()
                ));
            }
        }
        // A wake the fault stopped leaves the context asleep, as documented, with what it
        // offloaded: the caller's retry wakes it.
        if ctx.is_asleep() {
            ctx.wake()
                .map_err(|e| format!("a wake retried after the fault: {e}"))?;
        }
        let fresh = ctx
            .to_device(&[5u8; 32])
            .map_err(|e| format!("fresh allocation after the fault: {e}"))?;
        let mut back = [0u8; 32];
        ctx.copy_to_host(&mut back, &fresh)
            .map_err(|e| format!("copy after the fault: {e}"))?;
        if back != [5u8; 32] {
            return Err("wrong bytes after the fault".into());
        }
        drop((fresh, ctx));
        drop(rt);
    }
    for (who, process) in
        std::iter::once(("exporter", &sim)).chain(others.iter().map(|o| ("importer", o)))
    {
        let leaks = process.leak_report();
        if !leaks.is_clean() {
            return Err(format!(
                "left behind by the {who} after its runtime was dropped: {leaks}"
            ));
        }
        let refused = process.failed_releases();
        if !refused.is_empty() && !explained(&refused) {
            return Err(format!(
                "the driver refused release calls in the {who} at its runtime's end: {refused:?}"
            ));
        }
    }
    let early = driver_mock::frees_while_imported_on_this_thread() - early_before;
    if early > 0 {
        return Err(format!(
            "the exporter freed {early} allocation(s) the importer still had mapped (undefined behaviour on the GPU)"
        ));
    }
    Ok(Outcome {
        calls,
        error: result.err(),
        faulted,
    })
}

/// Whether a run that completed despite its first fault on `op` of `kind` is right to: Numba
/// retries an allocation that ran out of memory, and a release that fails is logged, with the
/// memory left to its context's end.
fn may_absorb(op: Op, kind: ErrorKind) -> bool {
    op.is_release()
        // Released once more before it is reported (`Runtime::reset_device`, the runtime's
        // end): one failure is absorbed; the second-fault sweep fails the retry too.
        || op == Op::PrimaryCtxRelease
        // A statistics read (`pool_stats`): the report then has no device pool, and a
        // warning says why.
        || op == Op::MemPoolGetAttribute
        // The thread's capture mode relaxed around a slow path: a warning says the capture
        // may refuse what follows (none is under way in the workload).
        || op == Op::ThreadExchangeStreamCaptureMode
        // Whether a stream whose chunks the pool would take back is captured: unanswered, the
        // chunks stay with the stream (held a little longer, nothing lost).
        || op == Op::StreamGetCaptureInfo
        // Peer access asked for before a copy between devices: refused, the copy goes through
        // host memory instead (slower, the same bytes), and a warning says why.
        || op == Op::CtxEnablePeerAccess
        // `vmm-pool` asking which devices may reach its chunks as peers: a device that does
        // not answer is left out (its copies stage through the host), and a warning says why.
        || op == Op::DeviceCanAccessPeer
        || (kind == ErrorKind::OutOfMemory
            && matches!(
                op,
                Op::MemAlloc
                    | Op::MemAllocFromPoolAsync
                    | Op::MemAllocManaged
                    | Op::MemHostAlloc
                    | Op::MemHostRegister
                    // A growth of `vmm-pool`: the pool gives back what it can and retries.
                    | Op::MemAddressReserve
                    | Op::MemCreate
                    | Op::MemMap
                    | Op::MemSetAccess
            ))
}

/// The operations a clean run's processes call.
fn clean_calls(manager: &str) -> std::collections::BTreeSet<Op> {
    let sim = Arc::new(machine());
    let rt = runtime(&sim, manager).expect("runtime");
    let mut others = Vec::new();
    workload(&sim, &rt, &mut others, &[]).expect("clean run");
    drop(rt);
    std::iter::once(&sim)
        .chain(&others)
        .flat_map(|p| p.ops())
        .collect()
}

const CONFIGS: [(&str, bool); 12] = [
    ("default", false),
    ("default+host-pool", false),
    ("immediate", false),
    ("pool", false),
    ("pool+adaptors", false),
    ("vmm-pool", false),
    ("async-pool", false),
    ("async-pool-ipc", false),
    ("async-pool-managed", false),
    ("default", true),
    ("async-pool-ipc", true),
    ("vmm-pool", true),
];

#[test]
fn every_driver_call_fails_once_and_emm_survives() {
    let mut survived = 0usize;
    let mut failures = Vec::new();
    let mut absorbed: std::collections::BTreeMap<String, usize> = Default::default();
    let mut reached = std::collections::BTreeSet::new();
    let mut single_faults = 0u64;
    for (manager, in_other) in CONFIGS {
        let clean = run(manager, &[], in_other)
            .unwrap_or_else(|e| panic!("{manager}: the clean run failed: {e}"));
        assert!(clean.error.is_none(), "{manager}: {:?}", clean.error);
        let sim_calls = clean_calls(manager);
        for op in not_called_by_emm() {
            assert!(
                !sim_calls.contains(&op),
                "{manager}: emm now calls {op:?}; take it off not_called_by_emm"
            );
        }
        let n = clean.calls as u64;
        // The importer only opens what the exporter made.
        let least = if in_other { 15 } else { 20 };
        assert!(
            n > least,
            "{manager}: the workload made only {n} driver calls"
        );
        let process = if in_other { "importer" } else { "exporter" };
        single_faults += n * KINDS.len() as u64;
        for nth in 1..=n {
            for kind in KINDS {
                match run(manager, &[Fault::nth_call(nth, kind)], in_other) {
                    Ok(outcome) => {
                        survived += 1;
                        let op = outcome.faulted[0];
                        reached.insert(format!("{op:?}"));
                        match &outcome.error {
                            None if may_absorb(op, kind) => {
                                *absorbed.entry(format!("{op:?} {kind:?}")).or_default() += 1;
                            }
                            None => failures.push(format!(
                                "{manager} ({process}) call {nth} ({op:?}) failing with {kind:?}: the workload completed as if nothing failed"
                            )),
                            Some(e)
                                if kind == ErrorKind::OutOfMemory
                                    && matches!(
                                        op,
                                        Op::MemAlloc
                                            | Op::MemAllocFromPoolAsync
                                            | Op::MemAllocManaged
                                    ) =>
                            {
                                failures.push(format!(
                                    "{manager} ({process}) call {nth}: out-of-memory was not retried: {e}"
                                ));
                            }
                            Some(_) => {}
                        }
                    }
                    Err(e) => failures.push(format!(
                        "{manager} ({process}), call {nth} failing with {kind:?}: {e}"
                    )),
                }
            }
        }
        println!(
            "fault sweep: manager '{manager}', faults in the {process}: {n} driver calls x {} error kinds",
            KINDS.len()
        );
    }
    println!("fault sweep: absorbed without an error (allowed): {absorbed:?}");
    let never: Vec<Op> = Op::ALL
        .into_iter()
        .filter(|op| {
            !not_called_by_emm().any(|n| n == *op) && !reached.contains(&format!("{op:?}"))
        })
        .collect();
    if !never.is_empty() {
        failures.push(format!(
            "operations the sweep never faulted (extend the workload): {never:?}"
        ));
    }
    println!(
        "fault sweep: {survived} injected faults survived, {} failed",
        failures.len()
    );
    let configurations: Vec<String> = CONFIGS
        .iter()
        .map(|(m, other)| format!("{m}{}", if *other { " (importer)" } else { "" }))
        .collect();
    let never: Vec<&str> = not_called_by_emm().map(Op::call_name).collect();
    record_figures(
        "single",
        &[
            ("configurations", configurations.join(", ")),
            ("error_kinds", KINDS.len().to_string()),
            ("single_faults", single_faults.to_string()),
            ("never_called", never.join(", ")),
        ],
    );
    assert!(
        failures.is_empty(),
        "{} of the injected faults were not survived:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// The cleanup a first fault sets off (drops, closes, resets, the runtime's end) is faulted
/// too: for each first fault, every later call of that run fails in turn.
/// `f` for each of [`CONFIGS`], on as many threads as the machine runs at once (each run has a
/// simulated machine of its own), the results in the order of [`CONFIGS`].
fn per_config<T: Send>(f: impl Fn(&'static str, bool) -> T + Sync) -> Vec<T> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut done: Vec<(usize, T)> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads.min(CONFIGS.len()))
            .map(|_| {
                scope.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&(manager, in_other)) = CONFIGS.get(i) else {
                            return mine;
                        };
                        mine.push((i, f(manager, in_other)));
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().expect("a sweep thread panicked"))
            .collect()
    });
    done.sort_by_key(|(i, _)| *i);
    done.into_iter().map(|(_, t)| t).collect()
}

#[test]
fn cleanup_after_a_fault_survives_a_second_fault() {
    let swept = per_config(|manager, in_other| {
        let mut runs = 0usize;
        let mut failures = Vec::new();
        let n = run(manager, &[], in_other).expect("clean run").calls as u64;
        for first in 1..=n {
            let one = [Fault::nth_call(first, ErrorKind::InvalidValue)];
            let Ok(outcome) = run(manager, &one, in_other) else {
                continue; // reported by the single-fault sweep
            };
            // Counted from the first fault's injection: the calls after the first fault.
            for second in first + 1..=outcome.calls as u64 {
                for kind in [ErrorKind::InvalidValue, ErrorKind::ContextDestroyed] {
                    let faults = [one[0], Fault::nth_call(second, kind)];
                    runs += 1;
                    if let Err(e) = run(manager, &faults, in_other) {
                        failures.push(format!(
                            "{manager} ({}), call {first} then call {second} failing with {kind:?}: {e}",
                            if in_other { "importer" } else { "exporter" }
                        ));
                    }
                }
            }
        }
        (runs, failures)
    });
    let runs: usize = swept.iter().map(|(r, _)| r).sum();
    let failures: Vec<String> = swept.into_iter().flat_map(|(_, f)| f).collect();
    println!(
        "fault sweep: {runs} runs with a second fault, {} failed",
        failures.len()
    );
    record_figures("pairs", &[("pair_runs", runs.to_string())]);
    assert!(
        failures.is_empty(),
        "{} runs with a second fault failed:\n{}",
        failures.len(),
        failures
            .iter()
            .take(40)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// The retry rule, sharply: an out-of-memory on the workload's first `cuMemAlloc` is invisible
/// to the caller.
#[test]
fn out_of_memory_on_an_allocation_is_retried() {
    let sim = Arc::new(machine());
    let rt = runtime(&sim, "default").unwrap();
    sim.inject(Fault::nth(Op::MemAlloc, 1, ErrorKind::OutOfMemory));
    workload(&sim, &rt, &mut Vec::new(), &[]).expect("the retry hides the fault");
}

/// What a faulted teardown left: the calls `Runtime::drop` made, the faulted operation, and
/// how many objects the contexts' destruction reclaimed.
struct Teardown {
    calls: usize,
    faulted: Option<Op>,
    reclaimed: usize,
    report: String,
}

/// The workload, then objects of every kind held across the runtime's end (device memory and
/// mapped pinned memory, which the manager tracks and its reset frees; unmapped pinned memory,
/// a stream and an event, which it does not track, as Numba does not, and which the context's
/// destruction takes), then `Runtime::drop` with the `fault` (the nth call of the teardown
/// failing) injected. Checks that the fault fires and nothing panics; that the driver refused
/// no release; that what was held across the end reaches no driver when dropped; and that the
/// simulator holds nothing at the end. What the destruction reclaimed (read after the drop) is
/// returned for the caller to compare with a clean teardown's.
fn teardown(manager: &str, fault: Option<(u64, ErrorKind)>) -> Result<Teardown, String> {
    let sim = Arc::new(machine());
    let rt = runtime(&sim, manager).map_err(|e| format!("runtime: {e}"))?;
    workload(&sim, &rt, &mut Vec::new(), &[]).map_err(|e| format!("clean workload: {e}"))?;
    let ctx = rt.context(0).map_err(|e| e.to_string())?;
    let block = ctx.memalloc(4096).map_err(|e| e.to_string())?;
    let mapped = ctx
        .memhostalloc(64, true, false, false)
        .map_err(|e| e.to_string())?;
    let pinned = ctx
        .memhostalloc(64, false, false, false)
        .map_err(|e| e.to_string())?;
    let stream = ctx.create_stream().map_err(|e| e.to_string())?;
    let event = ctx.create_event(false).map_err(|e| e.to_string())?;
    let before = sim.total_calls();
    if let Some((nth, kind)) = fault {
        sim.inject(Fault::nth_call(nth, kind));
    }
    let dropped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(rt)));
    if dropped.is_err() {
        return Err("the runtime's drop panicked".into());
    }
    let log = sim.calls();
    let calls = log.len() - before;
    let faulted: Vec<Op> = log[before..]
        .iter()
        .filter(|c| c.injected)
        .map(|c| c.op)
        .collect();
    sim.clear_faults();
    if faulted.len() != usize::from(fault.is_some()) {
        return Err(format!(
            "{} of {} injected faults fired in the teardown's {calls} calls",
            faulted.len(),
            usize::from(fault.is_some())
        ));
    }
    let after_drop = sim.total_calls();
    drop((block, mapped, pinned, stream, event, ctx));
    if sim.total_calls() != after_drop {
        return Err(format!(
            "memory held across the runtime's end reached the driver when dropped: {:?}",
            &sim.ops()[after_drop..]
        ));
    }
    let refused = sim.failed_releases();
    if !refused.is_empty() {
        return Err(format!(
            "the driver refused release calls in the teardown: {refused:?}"
        ));
    }
    let reclaimed = sim.reclaimed_by_destroy();
    let held = reclaimed.objects();
    // The test's own plugin (`immediate`) frees a block only when its pointer drops, as a
    // plugin may: a block held across the runtime's end is its context's to take.
    let tracked = manager != "immediate";
    if tracked
        && fault.is_none()
        && !(reclaimed.allocations.is_empty() && reclaimed.physical.is_empty())
    {
        return Err(format!(
            "the clean teardown left device memory to the context's destruction: {reclaimed}"
        ));
    }
    let leaks = sim.leak_report();
    if !leaks.is_clean() {
        return Err(format!("left behind after the runtime's end: {leaks}"));
    }
    Ok(Teardown {
        calls,
        faulted: faulted.first().copied(),
        reclaimed: held,
        report: reclaimed.to_string(),
    })
}

/// `Runtime::drop` (each context's reset, the teardown flush, the destruction of what the
/// runtime made, the primary context's release) with each of its calls failing in turn, for
/// every manager: the faults above end before the drop, so this is where the teardown's own
/// error paths are faulted.
#[test]
fn the_runtimes_teardown_survives_a_fault_at_every_call() {
    let mut failures = Vec::new();
    let mut runs = 0usize;
    let mut reached = std::collections::BTreeSet::new();
    for (manager, in_other) in CONFIGS {
        if in_other {
            continue; // the importer's runtime ends inside the workload
        }
        let clean = teardown(manager, None)
            .unwrap_or_else(|e| panic!("{manager}: the clean teardown failed: {e}"));
        assert!(
            clean.calls >= 3,
            "{manager}: the teardown made only {} driver calls",
            clean.calls
        );
        for nth in 1..=clean.calls as u64 {
            for kind in [ErrorKind::InvalidValue, ErrorKind::ContextDestroyed] {
                runs += 1;
                match teardown(manager, Some((nth, kind))) {
                    Ok(t) => {
                        reached.extend(t.faulted);
                        // A faulted release leaves its object to the destruction, with what
                        // only it would have freed: a driver pool with the blocks held in it
                        // (the three this test holds at most), a mapping with the reservation
                        // it sits in. Nothing else may be left beyond what the clean teardown
                        // left.
                        let explained = match t.faulted {
                            Some(Op::MemPoolDestroy) => 4,
                            Some(op) => left_by_fault(op),
                            None => 0,
                        };
                        if t.reclaimed > clean.reclaimed + explained {
                            failures.push(format!(
                                "{manager}: teardown call {nth} ({:?}) failing with {kind:?}: the context's destruction reclaimed {} objects, the clean teardown's {} and {explained} explained by the fault: {}",
                                t.faulted, t.reclaimed, clean.reclaimed, t.report
                            ));
                        }
                    }
                    Err(e) => failures.push(format!(
                        "{manager}: teardown call {nth} failing with {kind:?}: {e}"
                    )),
                }
            }
        }
    }
    println!(
        "fault sweep: {runs} faulted teardowns, {} failed; operations faulted there: {reached:?}",
        failures.len()
    );
    record_figures("teardown", &[("teardown_runs", runs.to_string())]);
    assert!(
        reached.contains(&Op::PrimaryCtxRelease) && reached.contains(&Op::MemFree),
        "the teardown's releases were not faulted: {reached:?}"
    );
    assert!(
        failures.is_empty(),
        "{} faulted teardowns failed:\n{}",
        failures.len(),
        failures
            .iter()
            .take(40)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}
