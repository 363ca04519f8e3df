//! Context and device reset (Numba's `Context.reset`, `Device.reset`, `test_reset_device`).

use driver_mock::Op;
use emm::EmmError;
use integration::{Target, TestCtx};
use libtest_mimic::Failed;

/// `Context::reset` frees every live and pending allocation; pointers that outlive it free
/// nothing twice when they drop.
pub fn reset_frees_everything(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let queue = ctx.deallocations().expect("queue");
    // The driver's one-time costs of the manager's kind of memory are paid before the
    // baseline: the first managed pool of a process keeps about 96 MiB of the device after
    // its memory is freed and the pool destroyed (measured on an H100, driver 580).
    drop(ctx.memalloc(8 << 20)?);
    ctx.reset()?;
    queue.flush()?;
    let baseline = ctx.get_memory_info()?.free;
    let a = ctx.memalloc(8 << 20)?;
    let b = ctx.memalloc(8 << 20)?;
    let view = b.view(4096, None)?;
    drop(ctx.memalloc(8 << 20)?);
    if integration::defers_device_frees() {
        ensure_eq!(queue.len(), 1);
    }
    ctx.reset()?;
    ensure_eq!(queue.len(), 0);
    let free = ctx.get_memory_info()?.free;
    integration::ensure_memory_back(free, baseline, "after the reset")?;
    ensure!(!a.is_live() && !view.is_live(), "old pointers are stale");
    let stale = ctx.copy_to_device(&a, &[1, 2, 3]);
    ensure!(matches!(stale, Err(EmmError::Stale { .. })), "{stale:?}");
    drop((a, b, view));
    ensure_eq!(queue.len(), 0, "stale pointers queue nothing");
    if let Some(sim) = t.sim() {
        ensure!(
            sim.rejected_frees().is_empty(),
            "a free was issued twice: {:?}",
            sim.rejected_frees()
        );
        ensure!(
            sim.leak_report().no_memory_leaked(),
            "{}",
            sim.leak_report()
        );
    }
    let fresh = ctx.to_device(&[5u8; 16])?;
    let mut back = [0u8; 16];
    ctx.copy_to_host(&mut back, &fresh)?;
    ensure_eq!(back, [5u8; 16]);
    Ok(())
}

/// NBEP 7: `reset` may come before `initialize`.
pub fn reset_before_initialize(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let mcx = emm::contract::ManagerContext {
        driver: t.driver.clone(),
        device: 0.into(),
        context: t.driver.primary_ctx_retain(0.into())?,
        dealloc_config: emm::plugin::DeallocConfig::default(),
        liveness: std::sync::Arc::new(emm::plugin::ContextLiveness::new()),
        pinned_pool: None,
        host_memory_pool: false,
        events: Default::default(),
    };
    let mm = emm::plugin::DefaultManager::default_manager(&mcx);
    use emm::contract::MemoryManager;
    mm.reset()?;
    mm.initialize()?;
    let mem = mm.memalloc(128)?;
    drop(mem);
    mm.reset()?;
    ensure_eq!(mm.live_allocations(), 0);
    ensure_eq!(mm.deallocations().expect("queue").len(), 0);
    // SAFETY: matches the retain above; the manager freed everything it allocated.
    #[allow(unsafe_code)]
    unsafe {
        t.driver.primary_ctx_release(0.into())?
    };
    Ok(())
}

/// A device reset retires the context: old memory and old contexts refuse work, dropping old
/// pointers reaches no driver, and the next use builds a new context that works.
pub fn reset_device_makes_old_memory_stale(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let old = ctx.to_device(&[1u8; 64])?;
    let pending = ctx.memalloc(64)?;
    let guard = ctx.defer_cleanup()?;
    drop(pending);
    // A pool destroy frees a stream-ordered pool's memory, a release a mapped chunk's.
    let frees = |s: &driver_mock::SimDriver| {
        s.count(Op::MemFree) + s.count(Op::MemPoolDestroy) + s.count(Op::MemRelease)
    };
    let frees_before_reset = t.sim().map(frees);
    t.runtime.reset_device(0)?;
    if let (Some(sim), Some(before)) = (t.sim(), frees_before_reset) {
        // The default manager frees both allocations; a pool frees the chunk holding both, or
        // destroys the driver pool holding both.
        let expected = if integration::defers_device_frees() {
            2
        } else {
            1
        };
        ensure_eq!(
            frees(sim) - before,
            expected,
            "the live and the deferred allocation are freed before the context goes"
        );
        ensure!(
            sim.calls().iter().all(|c| c.outcome.is_ok()),
            "every call succeeded"
        );
    }
    drop(guard);
    ensure!(!ctx.is_alive(), "the old context is retired");
    let refused = ctx.memalloc(16);
    ensure!(
        matches!(refused, Err(EmmError::Stale { .. })),
        "{refused:?}"
    );
    let mut buf = [0u8; 64];
    let refused = ctx.copy_to_host(&mut buf, &old);
    ensure!(
        matches!(refused, Err(EmmError::Stale { .. })),
        "{refused:?}"
    );
    let text = refused.unwrap_err().to_string();
    ensure!(text.contains("after a reset"), "{text}");
    let frees_before = t.sim().map(|s| s.count(Op::MemFree));
    drop(old);
    if let (Some(sim), Some(before)) = (t.sim(), frees_before) {
        ensure_eq!(
            sim.count(Op::MemFree),
            before,
            "a pointer from before the reset freed nothing"
        );
    }
    let fresh_ctx = t.context()?;
    ensure!(fresh_ctx.is_alive(), "a new context");
    let fresh = fresh_ctx.to_device(&[2u8; 64])?;
    fresh_ctx.copy_to_host(&mut buf, &fresh)?;
    ensure_eq!(buf, [2u8; 64]);
    Ok(())
}

/// Numba `test_reset_device`: in a thread other than the main one, two rounds of using and
/// resetting every device raise nothing.
pub fn test_reset_device(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let result = std::thread::scope(|s| {
        s.spawn(|| -> Result<(), String> {
            let count = t.runtime.device_count().map_err(|e| e.to_string())?;
            for _ in 0..2 {
                for d in 0..count {
                    let ctx = t.runtime.context(d).map_err(|e| e.to_string())?;
                    drop(ctx.memalloc(1024).map_err(|e| e.to_string())?);
                    t.runtime.reset_device(d).map_err(|e| e.to_string())?;
                }
            }
            Ok(())
        })
        .join()
    });
    match result {
        Ok(r) => r.map_err(Failed::from),
        Err(_) => Err("the thread panicked".into()),
    }
}

/// Dropping the runtime resets its contexts and releases their primary contexts; pointers that
/// outlive it free nothing.
pub fn runtime_drop_releases_everything(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let kept = ctx.memalloc(4096)?;
    drop(ctx.memalloc(4096)?);
    let TestCtx { runtime, sim, .. } = t;
    drop(runtime);
    ensure!(!ctx.is_alive(), "contexts are retired with their runtime");
    // Counted, not read off the leak report: the destroyed context took its memory with it, so
    // a free issued now would leave the report clean all the same.
    let releases_before = sim.as_deref().map(release_calls);
    drop(kept);
    if let (Some(sim), Some(before)) = (sim.as_deref(), releases_before) {
        ensure_eq!(
            release_calls(sim),
            before,
            "a pointer that outlived its runtime released nothing"
        );
    }
    if let Some(sim) = sim {
        let report = sim.leak_report();
        ensure!(report.is_clean(), "{report}");
        // The leak report is clean once a context is destroyed, whatever was left in it: what
        // shows that the runtime freed everything itself is that the destruction took nothing.
        let reclaimed = sim.reclaimed_by_destroy();
        ensure!(
            reclaimed.is_clean(),
            "the context's destruction reclaimed what the runtime left: {reclaimed}"
        );
        ensure!(
            sim.rejected_frees().is_empty(),
            "{:?}",
            sim.rejected_frees()
        );
    }
    Ok(())
}

/// Calls that give memory back to the driver, of any kind.
fn release_calls(sim: &driver_mock::SimDriver) -> usize {
    [
        Op::MemFree,
        Op::MemFreeHost,
        Op::MemHostUnregister,
        Op::MemFreeAsync,
        Op::IpcCloseMemHandle,
    ]
    .into_iter()
    .map(|op| sim.count(op))
    .sum()
}
