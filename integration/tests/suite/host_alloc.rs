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
