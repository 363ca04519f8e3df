//! Numba's `test_cuda_memory.py` and `test_cuda_array_interface::test_ownership`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use emm::MemoryPointer;
use emm::driver_sys::DevicePtr;
use integration::{Target, TestCtx};
use libtest_mimic::Failed;

fn template(mem: &MemoryPointer, size: usize) -> Result<(), Failed> {
    ensure!(!mem.device_ptr().is_null(), "a device pointer");
    ensure_eq!(mem.size(), size);
    ensure!(mem.is_live());
    Ok(())
}

/// Numba `test_device_memory`.
pub fn test_device_memory(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    template(&t.context()?.memalloc(1024)?, 1024)
}

/// Numba `test_device_view`.
pub fn test_device_view(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let m = t.context()?.memalloc(1024)?;
    let v = m.view(10, None)?;
    template(&v, 1014)?;
    ensure_eq!(v.device_ptr().0, m.device_ptr().0 + 10);
    Ok(())
}

/// Numba `test_host_alloc`: mapped host memory has a device pointer.
pub fn test_host_alloc(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let h = t.context()?.memhostalloc(1024, true, false, false)?;
    let m = h
        .mapped()
        .ok_or("memhostalloc(mapped) returns mapped memory")?;
    template(m.device(), 1024)
}

/// Numba `test_pinned_memory`: a pinned, mapped buffer has a device pointer that reaches it.
pub fn test_pinned_memory(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let data: Vec<u8> = (0i64..10).flat_map(|v| v.to_le_bytes()).collect();
    let buffer = Arc::new(emm::PinnableBuffer::from_slice(&data));
    let h = ctx.pin(buffer.clone(), true)?;
    let m = h.mapped().ok_or("mempin(mapped) returns mapped memory")?;
    template(m.device(), 80)?;
    let mut back = vec![0u8; 80];
    ctx.copy_to_host(&mut back, m.device())?;
    ensure_eq!(back, data, "the device pointer reaches the pinned bytes");
    Ok(())
}

/// Numba `test_user_extension`: a pointer made with a release action runs it once, when the
/// last handle (not a clone) drops.
pub fn test_user_extension(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = calls.clone();
    // SAFETY: nothing reads or writes the fake range: the test only counts the release (Numba's
    // test does the same).
    let ptr = unsafe {
        MemoryPointer::with_release(
            ctx.device(),
            ctx.handle(),
            DevicePtr(0xDEAD_BEEF),
            40,
            move |p, size| {
                assert_eq!((p, size), (DevicePtr(0xDEAD_BEEF), 40));
                seen.fetch_add(1, Ordering::SeqCst);
            },
        )
    };
    ensure_eq!(calls.load(Ordering::SeqCst), 0);
    let owned = ptr.clone();
    drop(owned);
    ensure_eq!(
        calls.load(Ordering::SeqCst),
        0,
        "dropping a clone does not release"
    );
    drop(ptr);
    ensure_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "the last drop releases, once"
    );
    Ok(())
}

/// Numba `test_memset`: 0xAB over 40 bytes reads back as 0xAB.
pub fn test_memset(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let m = ctx.memalloc(40)?;
    ctx.memset(&m, 0xAB, 40)?;
    let mut back = [0u8; 40];
    ctx.copy_to_host(&mut back, &m)?;
    ensure_eq!(back, [0xABu8; 40]);
    Ok(())
}

/// Numba `test_d2d`: host → device → device → host.
pub fn test_d2d(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let host: Vec<u8> = (0u32..100).flat_map(|v| v.to_le_bytes()).collect();
    let a = ctx.to_device(&host)?;
    let b = ctx.memalloc(host.len())?;
    ctx.copy_device(&b, &a, host.len())?;
    let mut back = vec![0u8; host.len()];
    ctx.copy_to_host(&mut back, &b)?;
    ensure_eq!(back, host);
    let overlap = ctx.copy_device(&a, &a.view(4, None)?, 16);
    ensure!(
        matches!(overlap, Err(emm::EmmError::OverlappingCopy { .. })),
        "{overlap:?}"
    );
    Ok(())
}

/// Numba `test_ownership`: a second owner keeps the allocation alive when the first drops;
/// the free is queued when the last one goes.
pub fn test_ownership(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let queue = ctx.deallocations().expect("queue");
    queue.flush()?;
    let d_arr = ctx.to_device(&[7u8; 64])?;
    let cvted = d_arr.clone();
    drop(d_arr);
    ensure_eq!(queue.len(), 0);
    let mut back = [0u8; 64];
    ctx.copy_to_host(&mut back, &cvted)?;
    ensure_eq!(back, [7u8; 64]);
    drop(cvted);
    if integration::defers_device_frees() {
        ensure_eq!(queue.len(), 1);
    }
    Ok(())
}
