//! Allocation, copies, views, memory info (Numba's `test_cuda_memory`, `test_context_stack`).

use emm::{EmmError, MemoryPointer};
use integration::{Target, TestCtx};
use libtest_mimic::Failed;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Allocate, write, read back, free: the walking skeleton end to end.
pub fn alloc_write_read_free(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let data = pattern(4096 + 3, 7);
    let mem = ctx.memalloc(data.len())?;
    ensure_eq!(mem.size(), data.len());
    ctx.copy_to_device(&mem, &data)?;
    let mut back = vec![0u8; data.len()];
    ctx.copy_to_host(&mut back, &mem)?;
    ensure!(
        back == data,
        "the bytes read back differ from the bytes written"
    );
    let queue = ctx
        .deallocations()
        .expect("the default manager has a queue");
    queue.flush()?;
    drop(mem);
    if integration::defers_device_frees() {
        ensure_eq!(queue.len(), 1, "the free is deferred");
        ensure_eq!(queue.flush()?, 1, "the flush frees it");
    } else {
        ctx.trim()?;
    }
    if let Some(sim) = t.sim() {
        ensure!(
            sim.leak_report().no_memory_leaked(),
            "{}",
            sim.leak_report()
        );
    }
    Ok(())
}

/// Numba `TestCudaMemoryFunctions.test_memcpy`: a host → device → host round trip of 100 u32.
pub fn test_memcpy(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let host: Vec<u8> = (0u32..100).flat_map(|v| v.to_le_bytes()).collect();
    let dev = ctx.to_device(&host)?;
    let mut back = vec![0u8; host.len()];
    ctx.copy_to_host(&mut back, &dev)?;
    ensure!(back == host, "round trip changed the data");
    Ok(())
}

/// `get_memory_info` reports free memory falling by at least an allocation's size, and rising
/// back once the free is flushed.
pub fn mem_get_info_reflects_allocations(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let queue = ctx.deallocations().expect("queue");
    let before = ctx.get_memory_info()?;
    ensure!(before.free <= before.total, "{before:?}");
    let bytes = 64 << 20;
    let mem = ctx.memalloc(bytes)?;
    let during = ctx.get_memory_info()?;
    ensure_eq!(during.total, before.total);
    ensure!(
        before.free - during.free >= bytes,
        "free fell by {} bytes for a {bytes}-byte allocation",
        before.free - during.free
    );
    drop(mem);
    queue.flush()?;
    // A pool keeps the memory until it is trimmed; the default manager has nothing to trim.
    ctx.trim()?;
    let after = ctx.get_memory_info()?;
    ensure_eq!(
        after.free,
        before.free,
        "all memory is back after the flush"
    );
    Ok(())
}

/// Numba `TestCudaMemory.test_derived_pointer`: views share the allocation and count as
/// references; a view's address is the owner's plus the offset.
pub fn test_derived_pointer(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    for offset in [0usize, 1] {
        let m = ctx.memalloc(1024)?;
        ensure_eq!(m.refct(), 1);
        let v1 = m.view(offset, None)?;
        ensure_eq!(m.refct(), 2);
        let v2 = v1.view(offset, None)?;
        ensure_eq!(m.refct(), 3);
        ensure!(
            v2.same_allocation(&m),
            "a view of a view shares the allocation"
        );
        ensure_eq!(v1.device_ptr().0, m.device_ptr().0 + offset as u64);
        ensure_eq!(v2.device_ptr().0, m.device_ptr().0 + 2 * offset as u64);
        ensure_eq!(v2.size(), 1024 - 2 * offset);
        drop(v2);
        ensure_eq!(m.refct(), 2);
        drop(v1);
        ensure_eq!(m.refct(), 1);
    }
    // The allocation outlives its first handle while a view holds it.
    let queue = ctx.deallocations().expect("queue");
    queue.flush()?;
    let m = ctx.memalloc(256)?;
    let tail = m.view(128, None)?;
    drop(m);
    let deferred = integration::defers_device_frees();
    ensure_eq!(queue.len(), 0, "a live view keeps the allocation");
    ctx.copy_to_device(&tail, &[9u8; 128])?;
    let blocks = ctx.pool_stats().device.map(|s| s.in_use_blocks);
    drop(tail);
    if deferred {
        ensure_eq!(queue.len(), 1, "the last view's drop queues the free");
    } else if let Some(before) = blocks {
        let after = ctx.pool_stats().device.map(|s| s.in_use_blocks);
        ensure_eq!(
            after,
            Some(before - 1),
            "the last view's drop returns the block"
        );
    }
    Ok(())
}

/// Views and copies never reach past the memory they refer to.
pub fn copies_are_bounds_checked(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let m = ctx.memalloc(100)?;
    let past_end = m.view(50, Some(101));
    ensure!(
        matches!(past_end, Err(EmmError::OutOfBounds { .. })),
        "{past_end:?}"
    );
    let reversed = m.view(60, Some(50));
    ensure!(
        matches!(reversed, Err(EmmError::OutOfBounds { .. })),
        "{reversed:?}"
    );
    let v: MemoryPointer = m.view(90, None)?;
    let too_long = ctx.copy_to_device(&v, &[0u8; 11]);
    ensure!(
        matches!(too_long, Err(EmmError::OutOfBounds { .. })),
        "{too_long:?}"
    );
    let mut buf = [0u8; 11];
    let too_long = ctx.copy_to_host(&mut buf, &v);
    ensure!(
        matches!(too_long, Err(EmmError::OutOfBounds { .. })),
        "{too_long:?}"
    );
    let msg = too_long.unwrap_err().to_string();
    ensure!(msg.contains("outside the 10-byte buffer"), "{msg}");
    ctx.copy_to_device(&v, &[1u8; 10])?;
    Ok(())
}

/// Numba `test_initialized_in_context` for the default manager: every `Runtime::context` call
/// runs `initialize`, which captures the device's total memory once.
pub fn initialize_runs_on_every_use(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let total = ctx.get_memory_info()?.total;
    let queue = ctx.deallocations().expect("queue");
    ensure_eq!(
        queue.capacity(),
        total,
        "initialize captured the total memory"
    );
    let again = t.context()?;
    ensure_eq!(again.handle(), ctx.handle(), "one context per device");
    ensure_eq!(queue.capacity(), total, "initialize is idempotent");
    ensure_eq!(
        queue.max_pending_bytes(),
        (total as f64 * 0.2).floor() as usize
    );
    Ok(())
}

/// Numba `TestContextAPI.test_context_memory`: free and total are consistent.
pub fn test_context_memory(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let info = ctx.get_memory_info()?;
    ensure!(info.total > 0 && info.free <= info.total, "{info:?}");
    Ok(())
}

/// `async-pool` out of memory while its own free is in flight: a block freed with
/// `cuMemFreeAsync` and not yet synchronised stays reserved, for every allocation (measured:
/// `driver_conformance::pool_cache_under_pressure`). A larger request that needs that memory
/// gets it anyway: the manager synchronises its stream and retries, and the caller sees
/// nothing.
///
/// The manager is not wrapped in the environment's adaptors: the requests are sized by the
/// device's free memory (six and seven tenths of it), and the GPU job's limit adaptor
/// (64 GiB, `pool+adapt`) refuses the second on a device with more than about 91 GiB free,
/// as it should (it failed so on an H200 at 51e99d8): that is the limit at work, not the
/// driver pool's out-of-memory this test is about.
pub fn async_pool_out_of_memory_waits_for_its_frees(target: Target) -> Result<(), Failed> {
    let t = TestCtx::with(target, |b| {
        b.memory_manager_name("async-pool").adaptors(Vec::new())
    })?;
    let ctx = t.context()?;
    let free = ctx.get_memory_info()?.free;
    let page = 2 << 20;
    let (first, second) = (free / 10 * 6 / page * page, free / 10 * 7 / page * page);
    drop(ctx.memalloc(first)?);
    let mem = ctx.memalloc(second)?;
    ensure_eq!(mem.size(), second);
    Ok(())
}
