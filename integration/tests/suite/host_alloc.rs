//! Numba's `test_host_alloc.py` and `test_pinned.py`.

use std::sync::Arc;

use emm::HostMemory;
use integration::{Target, TestCtx};
use libtest_mimic::Failed;

fn u32s(value: u32, n: usize) -> Vec<u8> {
    (0..n).flat_map(|_| value.to_le_bytes()).collect()
}

/// Numba `test_host_alloc_driver`: a device memset of mapped memory is seen by the host, and a
/// host write is seen by the device.
pub fn test_host_alloc_driver(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let h = ctx.memhostalloc(32, true, false, false)?;
    let m = h.mapped().ok_or("mapped")?;
    ctx.memset(m.device(), 0xAB, 32)?;
    let mut host = [0u8; 32];
    m.read(0, &mut host)?;
    ensure_eq!(host, [0xABu8; 32]);
    m.write(0, &[32u8; 32])?;
    let mut back = [0u8; 32];
    ctx.copy_to_host(&mut back, m.device())?;
    ensure_eq!(back, [32u8; 32]);
    Ok(())
}

/// Numba `test_host_alloc_pinned`: pinned memory is copied to the device; a device memset
/// leaves the host alone; copying back brings the zeros.
pub fn test_host_alloc_pinned(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let h = ctx.memhostalloc(40, false, false, false)?;
    ensure!(
        matches!(h, HostMemory::Pinned(_)),
        "unmapped memhostalloc returns pinned memory"
    );
    h.write(0, &u32s(123, 10))?;
    let d = ctx.memalloc(40)?;
    ctx.copy_pinned_to_device(&d, &h, 40)?;
    ctx.memset(&d, 0, 40)?;
    let mut host = vec![0u8; 40];
    h.read(0, &mut host)?;
    ensure_eq!(
        host,
        u32s(123, 10),
        "the device memset did not touch the host"
    );
    ctx.copy_device_to_pinned(&h, &d, 40)?;
    h.read(0, &mut host)?;
    ensure_eq!(host, vec![0u8; 40]);
    Ok(())
}

/// Numba `test_host_alloc_mapped`: a device memset of mapped memory zeroes what the host sees.
pub fn test_host_alloc_mapped(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let h = ctx.memhostalloc(40, true, false, false)?;
    h.write(0, &u32s(123, 10))?;
    ctx.memset(h.mapped().ok_or("mapped")?.device(), 0, 40)?;
    let mut host = vec![0u8; 40];
    h.read(0, &mut host)?;
    ensure_eq!(host, vec![0u8; 40]);
    Ok(())
}

fn round_trip_keeps_source(target: Target, pinned: bool) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let n = 256 << 10;
    let data: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
    let buffer = Arc::new(emm::PinnableBuffer::from_slice(&data));
    let _pin = if pinned {
        Some(ctx.pin(buffer.clone(), false)?)
    } else {
        None
    };
    let d = ctx.memalloc(n)?;
    ctx.copy_to_device(&d, &buffer.to_vec())?;
    let mut back = vec![0u8; n];
    ctx.copy_to_host(&mut back, &d)?;
    ensure!(back == data, "the round trip changed the data");
    ensure!(buffer.to_vec() == data, "the source is unchanged");
    Ok(())
}

/// Numba `test_pinned`: copies through pinned memory leave it unchanged.
pub fn test_pinned(target: Target) -> Result<(), Failed> {
    round_trip_keeps_source(target, true)
}

/// Numba `test_unpinned`: the same with pageable memory.
pub fn test_unpinned(target: Target) -> Result<(), Failed> {
    round_trip_keeps_source(target, false)
}

/// Reset frees mapped host memory and mapped pins; unmapped pinned memory is not tracked and
/// stays usable until its handle drops (Numba).
pub fn reset_frees_tracked_host_memory(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let mapped = ctx.memhostalloc(64, true, false, false)?;
    let pinned = ctx.memhostalloc(64, false, false, false)?;
    let buffer = Arc::new(emm::PinnableBuffer::zeroed(64));
    let mapped_pin = ctx.pin(buffer.clone(), true)?;
    ctx.reset()?;
    ensure!(!mapped.mapped().ok_or("mapped")?.device().is_live());
    ensure!(!mapped_pin.mapped().ok_or("mapped")?.device().is_live());
    let refused = mapped.write(0, &[1]);
    ensure!(
        matches!(refused, Err(emm::EmmError::Stale { .. })),
        "{refused:?}"
    );
    pinned.write(0, &[1, 2, 3])?;
    // The buffer can be pinned again: the reset unpinned it.
    drop(ctx.pin(buffer.clone(), true)?);
    drop((mapped, mapped_pin, pinned));
    ctx.deallocations().expect("queue").flush()?;
    if let Some(sim) = t.sim() {
        let leaks = sim.leak_report();
        ensure!(
            leaks.host_allocations.is_empty() && leaks.host_registrations.is_empty(),
            "{leaks}"
        );
        ensure!(
            sim.rejected_frees().is_empty(),
            "{:?}",
            sim.rejected_frees()
        );
    }
    Ok(())
}

/// Managed memory (`memallocmanaged`, beyond Numba's tests): one address for the host and the
/// device, attached globally or to the host; device views and copies reach it; a reset frees
/// it (the host side is refused afterwards, as for mapped memory); zero bytes is refused.
pub fn test_managed_memory(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    for attach_global in [true, false] {
        let m = ctx.memallocmanaged(4096, attach_global)?;
        ensure_eq!(m.attached_globally(), attach_global);
        ensure_eq!(m.size(), 4096);
        ensure_eq!(m.host_ptr().0 as u64, m.device().device_ptr().0);
        let pattern: Vec<u8> = (0..4096).map(|i| (i % 241) as u8).collect();
        m.write(0, &pattern)?;
        let mut back = vec![0u8; 4096];
        ctx.copy_to_host(&mut back, m.device())?;
        ensure!(back == pattern, "the device side reads the host's bytes");
        ctx.memset(&m.device().view(1024, Some(2048))?, 0x5a, 1024)?;
        let mut host = vec![0u8; 4096];
        m.read(0, &mut host)?;
        ensure!(
            host[1024..2048].iter().all(|&b| b == 0x5a) && host[..1024] == pattern[..1024],
            "the host reads the device's memset of a view"
        );
        ensure!(
            m.write(4000, &[0u8; 100]).is_err(),
            "a host write past the end is refused"
        );
    }
    match ctx.memallocmanaged(0, true) {
        Err(emm::EmmError::ZeroSize { .. }) => {}
        other => return Err(format!("zero bytes: {other:?}").into()),
    }
    let kept = ctx.memallocmanaged(256, true)?;
    ctx.reset()?;
    ensure!(!kept.device().is_live(), "a reset frees managed memory");
    let refused = kept.write(0, &[1]);
    ensure!(
        matches!(refused, Err(emm::EmmError::Stale { .. })),
        "{refused:?}"
    );
    drop(kept);
    ctx.deallocations().expect("queue").flush()?;
    if let Some(sim) = t.sim() {
        let leaks = sim.leak_report();
        ensure!(leaks.allocations.is_empty(), "{leaks}");
    }
    Ok(())
}

/// Managed memory's free goes through the deferred queue and counts by size, as device
/// memory's does (Numba's `_alloc_finalizer`).
pub fn managed_frees_are_deferred(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let queue = ctx.deallocations().expect("queue");
    queue.flush()?;
    drop(ctx.memallocmanaged(10_000, true)?);
    ensure_eq!(queue.len(), 1);
    ensure_eq!(queue.pending_bytes(), 10_000);
    queue.flush()?;
    ensure_eq!(queue.len(), 0);
    Ok(())
}
