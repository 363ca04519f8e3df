//! Deferred deallocation (Numba's `test_deallocations.py`) and the out-of-memory retry.

use driver_mock::Op;
use emm::plugin::DeallocConfig;
use emm::{EmmError, MemoryPointer};
use integration::{Target, TestCtx};
use libtest_mimic::Failed;

/// Numba `test_max_pending_count`: ten discarded allocations stay pending; the eleventh flushes.
pub fn test_max_pending_count(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let queue = ctx.deallocations().expect("queue");
    queue.flush()?;
    ensure_eq!(queue.len(), 0);
    let max = queue.config().max_count;
    ensure_eq!(max, 10);
    let frees_before = t.sim().map(|s| s.count(Op::MemFree));
    for i in 0..max {
        drop(ctx.to_device(&7u64.to_le_bytes())?);
        ensure_eq!(queue.len(), i + 1);
    }
    drop(ctx.to_device(&7u64.to_le_bytes())?);
    ensure_eq!(queue.len(), 0, "the 11th pending free flushes the queue");
    if let (Some(sim), Some(before)) = (t.sim(), frees_before) {
        ensure_eq!(
            sim.count(Op::MemFree) - before,
            11,
            "one cuMemFree per allocation"
        );
    }
    Ok(())
}

/// Numba `test_max_pending_bytes`: with the ratio set so the budget is 10^6 bytes, pending
/// bytes equal to the budget do not flush; one byte more does.
pub fn test_max_pending_bytes(target: Target) -> Result<(), Failed> {
    let total = {
        let probe = TestCtx::new(target)?;
        probe.context()?.get_memory_info()?.total
    };
    let ratio = 1e6 / total as f64;
    let t = TestCtx::with(target, |b| {
        b.dealloc_config(DeallocConfig {
            max_ratio: ratio,
            ..DeallocConfig::default()
        })
    })?;
    let ctx = t.context()?;
    let queue = ctx.deallocations().expect("queue");
    queue.flush()?;
    let max = queue.max_pending_bytes();
    ensure!(max.abs_diff(1_000_000) <= 1, "max pending bytes {max}");
    drop(ctx.memalloc(500_000)?);
    ensure_eq!(queue.len(), 1);
    drop(ctx.memalloc(max - 500_000)?);
    ensure_eq!(
        queue.len(),
        2,
        "pending bytes equal to the budget do not flush"
    );
    drop(ctx.memalloc(1)?);
    ensure_eq!(queue.len(), 0, "one byte over the budget flushes");
    Ok(())
}

/// Numba `test_defer_cleanup`: memory allocated before the guard and freed inside it, and
/// memory allocated and freed inside it, both stay queued, even through an explicit flush;
/// leaving the guard does not flush; a flush afterwards issues both.
pub fn test_defer_cleanup(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let queue = ctx.deallocations().expect("queue");
    let darr1 = ctx.to_device(&[1u8; 40])?;
    queue.flush()?;
    ensure_eq!(queue.len(), 0);
    let frees = t.sim().map(|s| s.count(Op::MemFree));
    {
        let _guard = ctx.defer_cleanup()?;
        let darr2 = ctx.to_device(&[1u8; 40])?;
        drop(darr1);
        ensure_eq!(queue.len(), 1, "the free from before the guard is queued");
        drop(darr2);
        ensure_eq!(queue.len(), 2);
        ensure_eq!(queue.flush()?, 0);
        ensure_eq!(queue.len(), 2, "flush inside defer_cleanup does nothing");
    }
    ensure_eq!(queue.len(), 2, "leaving defer_cleanup does not flush");
    if let (Some(sim), Some(before)) = (t.sim(), frees) {
        ensure_eq!(sim.count(Op::MemFree), before, "nothing was freed yet");
    }
    ensure_eq!(queue.flush()?, 2);
    ensure_eq!(queue.len(), 0);
    if let (Some(sim), Some(before)) = (t.sim(), frees) {
        ensure_eq!(
            sim.count(Op::MemFree),
            before + 2,
            "both frees issued after the guard"
        );
    }
    Ok(())
}

/// Numba `test_nested_defer_cleanup`: as `test_defer_cleanup` with two guards; cleanup
/// resumes only after the outer one.
pub fn test_nested_defer_cleanup(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let queue = ctx.deallocations().expect("queue");
    let darr1 = ctx.to_device(&[1u8; 40])?;
    queue.flush()?;
    ensure_eq!(queue.len(), 0);
    {
        let _outer = ctx.defer_cleanup()?;
        {
            let _inner = ctx.defer_cleanup()?;
            let darr2 = ctx.to_device(&[1u8; 40])?;
            drop(darr1);
            ensure_eq!(queue.len(), 1, "the free from before the guards is queued");
            drop(darr2);
            ensure_eq!(queue.len(), 2);
            queue.flush()?;
            ensure_eq!(queue.len(), 2);
        }
        queue.flush()?;
        ensure_eq!(queue.len(), 2, "the outer guard still defers");
    }
    ensure_eq!(queue.flush()?, 2);
    ensure_eq!(queue.len(), 0);
    Ok(())
}

/// Numba `test_exception`: a free queued inside `defer_cleanup` survives a flush there; a
/// panic unwinds through the guard, which restores normal cleanup, and the free is issued by
/// the next flush; memory from before the guard is freed normally afterwards.
pub fn test_exception(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let queue = ctx.deallocations().expect("queue");
    let darr1 = ctx.to_device(&[1u8; 40])?;
    queue.flush()?;
    ensure_eq!(queue.len(), 0);
    let inside = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _guard = ctx.defer_cleanup().expect("guard");
        let darr2 = ctx.to_device(&[1u8; 40]).expect("allocation");
        drop(darr2);
        let queued = queue.len();
        let flushed = queue.flush().expect("flush");
        let after = queue.len();
        if (queued, flushed, after) == (1, 0, 1) {
            std::panic::panic_any(crate::EXPECTED_PANIC);
        }
        (queued, flushed, after)
    }));
    match inside {
        Err(_) => {}
        Ok(seen) => {
            return Err(format!(
                "inside the guard (queued, flushed, left) was {seen:?}, not (1, 0, 1)"
            )
            .into());
        }
    }
    ensure!(!queue.is_disabled(), "the guard was released by unwinding");
    ensure_eq!(
        queue.len(),
        1,
        "the free queued inside the guard survived the panic"
    );
    ensure_eq!(queue.flush()?, 1, "and is issued after it");
    ensure_eq!(queue.len(), 0);
    drop(darr1);
    ensure_eq!(queue.len(), 1);
    queue.flush()?;
    ensure_eq!(queue.len(), 0);
    Ok(())
}

/// Fills the device in chunks until the driver says out of memory; returns the chunks.
fn fill(ctx: &emm::Context, chunk: usize) -> Result<Vec<MemoryPointer>, Failed> {
    let mut held = Vec::new();
    loop {
        match ctx.memalloc(chunk) {
            Ok(m) => held.push(m),
            Err(e) if e.is_out_of_memory() => return Ok(held),
            Err(e) => return Err(format!("filling the device: {e}").into()),
        }
        ensure!(held.len() < 4096, "the device never ran out of memory");
    }
}

/// On out-of-memory the manager flushes its pending frees and retries once; with nothing to
/// flush the error is clear and typed.
pub fn oom_flushes_and_retries_once(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let queue = ctx.deallocations().expect("queue");
    let total = ctx.get_memory_info()?.total;
    let chunk = (total / 32).next_multiple_of(2 << 20);
    let mut held = fill(&ctx, chunk)?;
    ensure!(held.len() >= 8, "only {} chunks fitted", held.len());
    queue.flush()?;
    drop(held.pop());
    ensure_eq!(queue.len(), 1, "the chunk's free is pending, not done");
    let allocs_before = t.sim().map(|s| s.count(Op::MemAlloc));
    let again = ctx.memalloc(chunk)?;
    ensure_eq!(queue.len(), 0, "the out-of-memory retry flushed the queue");
    if let (Some(sim), Some(before)) = (t.sim(), allocs_before) {
        ensure_eq!(sim.count(Op::MemAlloc) - before, 2, "exactly one retry");
    }
    held.push(again);
    // Nothing pending: the retry fails too, and the error says so.
    let err = ctx.memalloc(chunk).expect_err("the device is full");
    ensure!(
        matches!(err, EmmError::OutOfMemory { flushed: 0, .. }),
        "{err:?}"
    );
    let text = err.to_string();
    ensure!(
        text.contains(&format!("could not allocate {chunk} bytes")),
        "{text}"
    );
    ensure!(text.contains("drop buffers you no longer need"), "{text}");
    drop(held);
    queue.flush()?;
    ensure!(
        ctx.memalloc(chunk).is_ok(),
        "memory is usable again after the flush"
    );
    Ok(())
}

/// Inside `defer_cleanup` the retry flushes nothing, so it fails; the error says 0 flushed.
pub fn oom_inside_defer_cleanup_reports_clear_error(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let queue = ctx.deallocations().expect("queue");
    let total = ctx.get_memory_info()?.total;
    let chunk = (total / 32).next_multiple_of(2 << 20);
    let mut held = fill(&ctx, chunk)?;
    queue.flush()?;
    let guard = ctx.defer_cleanup()?;
    drop(held.pop());
    let allocs_before = t.sim().map(|s| s.count(Op::MemAlloc));
    let err = ctx
        .memalloc(chunk)
        .expect_err("deferred cleanup keeps the memory held");
    ensure!(
        matches!(err, EmmError::OutOfMemory { flushed: 0, .. }),
        "{err:?}"
    );
    if let (Some(sim), Some(before)) = (t.sim(), allocs_before) {
        ensure_eq!(
            sim.count(Op::MemAlloc) - before,
            2,
            "the retry still happens"
        );
    }
    ensure_eq!(queue.len(), 1);
    drop(guard);
    let again = ctx.memalloc(chunk)?;
    ensure_eq!(
        queue.len(),
        0,
        "after the guard, the retry's flush frees the chunk"
    );
    drop((again, held));
    Ok(())
}

/// The context's queue and the manager's queue flush without error (Numba's `test_del_*`:
/// "nothing printed to stderr").
fn flush_all(ctx: &emm::Context) -> Result<(), Failed> {
    ctx.deallocations().expect("queue").flush()?;
    ctx.own_deallocations().flush()?;
    Ok(())
}

/// Every driver call of the simulator succeeded.
fn no_failed_calls(t: &TestCtx) -> Result<(), Failed> {
    if let Some(sim) = t.sim() {
        let failed: Vec<_> = sim
            .calls()
            .into_iter()
            .filter(|c| c.outcome.is_err())
            .collect();
        ensure!(failed.is_empty(), "failed driver calls: {failed:?}");
    }
    Ok(())
}

/// Numba `test_del_stream`.
pub fn test_del_stream(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let s = ctx.create_stream()?;
    drop(s);
    ensure_eq!(
        ctx.own_deallocations().len(),
        1,
        "the destroy goes to the context's own queue"
    );
    ensure_eq!(
        ctx.deallocations().expect("queue").len(),
        0,
        "never to the manager's"
    );
    flush_all(&ctx)?;
    if let Some(sim) = t.sim() {
        ensure_eq!(sim.count(Op::StreamDestroy), 1);
    }
    no_failed_calls(&t)
}

/// Numba `test_del_event`.
pub fn test_del_event(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    drop(ctx.create_event(false)?);
    drop(ctx.create_event(true)?);
    ensure_eq!(ctx.own_deallocations().len(), 2);
    flush_all(&ctx)?;
    if let Some(sim) = t.sim() {
        ensure_eq!(sim.count(Op::EventDestroy), 2);
    }
    no_failed_calls(&t)
}

/// With a pinned host pool, a dropped block goes back to the pool (nothing is queued), and a
/// trim queues and flushes its free.
fn pinned_block_back_in_pool(ctx: &emm::Context) -> Result<(), Failed> {
    let queue = ctx.deallocations().expect("queue");
    ensure_eq!(queue.len(), 0, "a pooled block is returned, not freed");
    let stats = ctx
        .pool_stats()
        .pinned_host
        .expect("the pinned host pool is on");
    ensure_eq!(stats.in_use_blocks, 0);
    ensure!(stats.cached_bytes >= 32, "{stats:?}");
    let released = ctx.trim()?;
    ensure!(released >= 32, "trim released {released} bytes");
    ensure_eq!(ctx.pool_stats().pinned_host.map(|s| s.held_bytes), Some(0));
    Ok(())
}

/// Numba `test_del_pinned_memory`: unmapped pinned memory's free is deferred, counted as 0 bytes.
pub fn test_del_pinned_memory(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let queue = ctx.deallocations().expect("queue");
    queue.flush()?;
    drop(ctx.memhostalloc(32, false, false, false)?);
    if integration::host_calls_direct() {
        ensure_eq!(queue.len(), 1);
        ensure_eq!(
            queue.pending_bytes(),
            0,
            "unmapped pinned memory counts as 0 bytes (Numba)"
        );
    } else {
        pinned_block_back_in_pool(&ctx)?;
    }
    flush_all(&ctx)?;
    no_failed_calls(&t)
}

/// Numba `test_del_mapped_memory`: mapped memory's free is deferred, counted by size.
pub fn test_del_mapped_memory(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let queue = ctx.deallocations().expect("queue");
    queue.flush()?;
    drop(ctx.memhostalloc(32, true, false, false)?);
    if integration::host_calls_direct() {
        ensure_eq!(queue.len(), 1);
        ensure_eq!(queue.pending_bytes(), 32);
    } else {
        pinned_block_back_in_pool(&ctx)?;
    }
    flush_all(&ctx)?;
    no_failed_calls(&t)
}

/// Numba `test_del_device_memory`.
pub fn test_del_device_memory(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    drop(ctx.memalloc(32)?);
    flush_all(&ctx)?;
    no_failed_calls(&t)
}

fn pin_again_and_again(target: Target, mapped: bool) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let buffer = std::sync::Arc::new(emm::PinnableBuffer::zeroed(8));
    for _ in 0..2 {
        drop(ctx.pin(buffer.clone(), mapped)?);
    }
    {
        let _guard = ctx.defer_cleanup()?;
        for _ in 0..2 {
            drop(ctx.pin(buffer.clone(), mapped)?);
        }
    }
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _pinned = ctx.pin(buffer.clone(), mapped).expect("pin");
        std::panic::panic_any(crate::EXPECTED_PANIC);
    }));
    ensure!(caught.is_err());
    drop(ctx.pin(buffer.clone(), mapped)?);
    flush_all(&ctx)?;
    if let Some(sim) = t.sim() {
        ensure_eq!(sim.count(Op::MemHostRegister), 6);
        ensure_eq!(
            sim.count(Op::MemHostUnregister),
            6,
            "every unpin happened at once"
        );
    }
    no_failed_calls(&t)
}

/// Numba `test_del_pinned_contextmanager`: the same memory can be pinned again at once, inside
/// `defer_cleanup` too, and after a panic left the scope of an earlier pin.
pub fn test_del_pinned_contextmanager(target: Target) -> Result<(), Failed> {
    pin_again_and_again(target, false)
}

/// Numba `test_del_mapped_contextmanager`: as above, mapped.
pub fn test_del_mapped_contextmanager(target: Target) -> Result<(), Failed> {
    pin_again_and_again(target, true)
}
