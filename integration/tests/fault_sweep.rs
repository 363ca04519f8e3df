//! Fault injection at every driver call.
//!
//! A reference workload (every public operation: device, pinned and mapped memory, pins,
//! views, copies, memset, streams, events, modules, `defer_cleanup`, IPC opened in a second
//! process, context reset, device reset) runs once per manager to count its driver calls, then
//! again once per call index with that call failing, for each of four error kinds. For every
//! run:
//!
//! - the error reaches the caller as a typed `EmmError` with a message, or, where Numba retries
//!   (out-of-memory of an allocation), the workload completes;
//! - nothing panics;
//! - nothing is freed twice (no free the driver itself refused);
//! - the runtime still works: a fresh allocation and copy succeed afterwards;
//! - once the runtime is dropped (its contexts reset and released), the simulator holds nothing.
//!
//! It prints how many injected faults were survived. Simulator only; it runs in CI.
#![allow(unsafe_code)]

use std::sync::Arc;

use driver_mock::{Fault, Op, SimConfig, SimDriver};
use driver_sys::ErrorKind;
use emm::{
    AllocationKind, DeviceAllocator, EmmError, FnFactory, HostLayer, HostOnly, IpcHandle,
    MemoryInfo, MemoryPointer, PinnableBuffer, Runtime,
};

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
        Ok(MemoryPointer::with_release(
            device,
            context,
            base,
            bytes,
            move |ptr, _| {
                let Some(_live) = cx.liveness.enter() else {
                    return;
                };
                // SAFETY: `ptr` was allocated above and this is its only release; the last pointer
                // to it just dropped; `_live` keeps the context alive.
                if let Err(e) = unsafe { cx.driver.mem_free(cx.context, ptr) } {
                    tracing::error!(error = %e, "immediate free failed");
                }
            },
        ))
    }

    fn initialize(&self, _: &HostLayer) -> Result<(), EmmError> {
        Ok(())
    }

    fn get_memory_info(&self, host: &HostLayer) -> Result<MemoryInfo, EmmError> {
        emm::DriverAllocator.get_memory_info(host)
    }

    fn get_ipc_handle(
        &self,
        host: &HostLayer,
        memory: &MemoryPointer,
    ) -> Result<IpcHandle, EmmError> {
        host.ipc_handle(memory)
    }
}

fn runtime(sim: &Arc<SimDriver>, manager: &str) -> Result<Runtime, EmmError> {
    Runtime::builder(sim.clone())
        .ignore_env()
        .register_manager(FnFactory::new("immediate", |cx| {
            Ok(Box::new(HostOnly::new(cx, ImmediateFree)))
        }))
        .memory_manager_name(manager)
        .build()
}

/// Every public operation once. Returns at the first error, dropping what it holds.
fn workload(
    sim: &Arc<SimDriver>,
    rt: &Runtime,
    others: &mut Vec<Arc<SimDriver>>,
    other_fault: Option<Fault>,
) -> Result<(), EmmError> {
    let ctx = rt.context(0)?;
    let a = ctx.to_device(&[1u8; 100])?;
    let view = a.view(10, None)?;
    let mut buf = [0u8; 90];
    ctx.copy_to_host(&mut buf, &view)?;
    let b = ctx.memalloc(4096)?;
    ctx.memset(&b, 7, 4096)?;
    ctx.copy_device(&b, &a, 100)?;
    ctx.device_extents(&view)?;
    ctx.get_memory_info()?;
    let mapped = ctx.memhostalloc(64, true, false, false)?;
    let pinned = ctx.memhostalloc(64, false, true, true)?;
    ctx.copy_pinned_to_device(&b, &pinned, 64)?;
    let mapped_pin = ctx.pin(Arc::new(PinnableBuffer::zeroed(64)), true)?;
    let pin = ctx.pin(Arc::new(PinnableBuffer::zeroed(64)), false)?;
    let stream = ctx.create_stream()?;
    let event = ctx.create_event(true)?;
    let module = ctx.load_module(PTX.as_bytes())?;
    {
        let _guard = ctx.defer_cleanup()?;
        drop((a, view, mapped));
        ctx.deallocations().expect("queue").flush()?;
    }
    ctx.deallocations().expect("queue").flush()?;
    // IPC: exported here, opened in another process, directly and staged.
    let handle = ctx.get_ipc_handle(&b.view(64, None)?)?;
    let other = Arc::new(sim.spawn_process());
    others.push(other.clone());
    if let Some(f) = other_fault {
        other.inject(f);
    }
    {
        let other_rt = Runtime::builder(other.clone()).ignore_env().build()?;
        if ctx.memory_manager_name() == emm::ASYNC_POOL_IPC_MANAGER {
            // Pool memory opens once the other process imported the pool.
            other_rt.import_pool(ctx.export_pool()?)?;
        }
        let other_ctx = other_rt.context(0)?;
        for staged in [false, true] {
            let imported = IpcHandle::from_bytes(&handle.to_bytes())?;
            let mem = if staged {
                imported.open_staged(&other_rt, &other_ctx)?
            } else {
                imported.open(&other_rt, &other_ctx)?
            };
            let mut seen = vec![0u8; mem.size()];
            other_ctx.copy_to_host(&mut seen, &mem)?;
            imported.close()?;
        }
    }
    drop(handle);
    drop((stream, event, module, pinned, mapped_pin, pin));
    ctx.reset()?;
    drop(b);
    rt.reset_device(0)?;
    Ok(())
}

struct Outcome {
    calls: usize,
    error: Option<EmmError>,
    /// The operation whose call was made to fail, if the fault fired.
    faulted: Option<Op>,
}

/// Runs the workload with `fault` (if any), then checks the runtime still works and that
/// nothing is left once it is dropped.
fn run(manager: &str, fault: Option<Fault>, in_other: bool) -> Result<Outcome, String> {
    let sim = Arc::new(SimDriver::new(SimConfig::single(256 << 20)));
    let rt = runtime(&sim, manager).map_err(|e| format!("runtime: {e}"))?;
    if let (Some(f), false) = (fault, in_other) {
        sim.inject(f);
    }
    let mut others = Vec::new();
    let other_fault = fault.filter(|_| in_other);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        workload(&sim, &rt, &mut others, other_fault)
    }))
    .map_err(|_| "the workload panicked".to_string())?;
    let faulty = if in_other {
        others
            .first()
            .cloned()
            .ok_or("the workload never reached its IPC step")?
    } else {
        sim.clone()
    };
    let calls = faulty.total_calls();
    let faulted = faulty.calls().iter().find(|c| c.injected).map(|c| c.op);
    faulty.clear_faults();
    if let Err(e) = &result {
        let text = e.to_string();
        if text.is_empty() || text.len() < 20 {
            return Err(format!("an unhelpful error message: {text:?}"));
        }
    }
    // The runtime still works.
    let ctx = rt
        .context(0)
        .map_err(|e| format!("context after the fault: {e}"))?;
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
    let leaks = sim.leak_report();
    if !leaks.is_clean() {
        return Err(format!(
            "left behind after the runtime was dropped: {leaks}"
        ));
    }
    for other in others {
        let leaks = other.leak_report();
        if !leaks.is_clean() {
            return Err(format!(
                "left behind by the other process of the IPC step: {leaks}"
            ));
        }
    }
    if !sim.rejected_frees().is_empty() {
        return Err(format!(
            "a free the driver refused (double free?): {:?}",
            sim.rejected_frees()
        ));
    }
    Ok(Outcome {
        calls,
        error: result.err(),
        faulted,
    })
}

#[test]
fn every_driver_call_fails_once_and_emm_survives() {
    let mut survived = 0usize;
    let mut failures = Vec::new();
    // Faults in the exporting process, then in the process that opens its IPC handles.
    for (manager, in_other) in [
        ("default", false),
        ("immediate", false),
        ("async-pool-ipc", false),
        ("default", true),
        ("async-pool-ipc", true),
    ] {
        let clean = run(manager, None, in_other)
            .unwrap_or_else(|e| panic!("{manager}: the clean run failed: {e}"));
        assert!(clean.error.is_none(), "{manager}: {:?}", clean.error);
        let n = clean.calls as u64;
        assert!(n > 20, "{manager}: the workload made only {n} driver calls");
        let (manager, process) = (manager, if in_other { "importer" } else { "exporter" });
        for nth in 1..=n {
            for kind in KINDS {
                let fault = Fault::nth_call(nth, kind);
                match run(manager, Some(fault), in_other) {
                    Ok(outcome) => {
                        survived += 1;
                        // Out-of-memory on an allocation is retried after a flush (Numba), so
                        // the workload goes on; any other injected failure must surface.
                        if let Some(e) = &outcome.error
                            && kind == ErrorKind::OutOfMemory
                            && matches!(
                                outcome.faulted,
                                Some(Op::MemAlloc | Op::MemAllocFromPoolAsync)
                            )
                        {
                            failures.push(format!(
                                "{manager} ({process}) call {nth}: out-of-memory was not retried: {e}"
                            ));
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
    println!(
        "fault sweep: {survived} injected faults survived, {} failed",
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "{} of the injected faults were not survived:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// The retry rule, sharply: an out-of-memory on the workload's first `cuMemAlloc` is invisible
/// to the caller.
#[test]
fn out_of_memory_on_an_allocation_is_retried() {
    let sim = Arc::new(SimDriver::new(SimConfig::single(256 << 20)));
    let rt = runtime(&sim, "default").unwrap();
    sim.inject(Fault::nth(Op::MemAlloc, 1, ErrorKind::OutOfMemory));
    workload(&sim, &rt, &mut Vec::new(), None).expect("the retry hides the fault");
}
