//! Driver conformance: what emm relies on, pinned on the simulator and the real driver alike.
//! Where the two disagreed on the GPU, the simulator was changed, never these tests.
#![allow(unsafe_code)]

use std::sync::Arc;

use driver_sys::{ContextHandle, DeviceOrdinal, DevicePtr, Driver, ErrorKind};
use integration::{Target, make_driver};
use libtest_mimic::Failed;

/// The alignment every `cuMemAlloc` result has on the real driver (measured on an H100/H200;
/// see `ci/hardware-runs.md`) and on the simulator.
pub const ALLOC_ALIGNMENT: u64 = 512;

/// A retained primary context on device 0, released on drop.
struct Raw {
    driver: Arc<dyn Driver>,
    ctx: ContextHandle,
}

impl Raw {
    fn new(target: Target) -> Result<Raw, Failed> {
        let (driver, _) = make_driver(target)?;
        driver.init()?;
        let ctx = driver.primary_ctx_retain(DeviceOrdinal(0))?;
        Ok(Raw { driver, ctx })
    }

    fn free(&self, ptr: DevicePtr) -> Result<(), driver_sys::DriverError> {
        // SAFETY: conformance tests free only what they allocated, or deliberately bad pointers
        // the driver must reject; nothing else uses this context's memory.
        unsafe { self.driver.mem_free(self.ctx, ptr) }
    }
}

impl Drop for Raw {
    fn drop(&mut self) {
        // SAFETY: matches the retain in `new`.
        let _ = unsafe { self.driver.primary_ctx_release(DeviceOrdinal(0)) };
    }
}

fn expect_kind<T: std::fmt::Debug>(
    what: &str,
    r: Result<T, driver_sys::DriverError>,
    kind: ErrorKind,
) -> Result<(), Failed> {
    match r {
        Err(e) if e.kind() == kind => Ok(()),
        Err(e) => Err(format!("{what}: expected {kind:?}, got {:?} ({e})", e.kind()).into()),
        Ok(v) => Err(format!("{what}: expected {kind:?}, got Ok({v:?})").into()),
    }
}

/// Every allocation is aligned to [`ALLOC_ALIGNMENT`].
pub fn alignment_of_allocations(target: Target) -> Result<(), Failed> {
    let raw = Raw::new(target)?;
    let mut ptrs = Vec::new();
    for bytes in [1usize, 3, 100, 255, 256, 257, 511, 512, 513, 1000, 4096, 65537, 1 << 20] {
        let p = raw.driver.mem_alloc(raw.ctx, bytes)?;
        ptrs.push((bytes, p));
    }
    let bad: Vec<_> = ptrs.iter().filter(|(_, p)| p.0 % ALLOC_ALIGNMENT != 0).collect();
    let result = if bad.is_empty() {
        Ok(())
    } else {
        Err(format!("allocations not {ALLOC_ALIGNMENT}-aligned: {bad:?}; all: {ptrs:?}").into())
    };
    for (_, p) in ptrs {
        raw.free(p)?;
    }
    result
}

/// `cuMemAlloc(0)` is `CUDA_ERROR_INVALID_VALUE`.
pub fn zero_byte_alloc_is_invalid_value(target: Target) -> Result<(), Failed> {
    let raw = Raw::new(target)?;
    expect_kind("cuMemAlloc(0)", raw.driver.mem_alloc(raw.ctx, 0), ErrorKind::InvalidValue)
}

/// More than the device's memory is `CUDA_ERROR_OUT_OF_MEMORY`, however large.
pub fn oversized_alloc_is_out_of_memory(target: Target) -> Result<(), Failed> {
    let raw = Raw::new(target)?;
    let total = raw.driver.mem_get_info(raw.ctx)?.total;
    expect_kind("cuMemAlloc(total + 1)", raw.driver.mem_alloc(raw.ctx, total + 1), ErrorKind::OutOfMemory)?;
    expect_kind("cuMemAlloc(usize::MAX / 2)", raw.driver.mem_alloc(raw.ctx, usize::MAX / 2), ErrorKind::OutOfMemory)
}

/// Freeing twice, or freeing an address never allocated, is `CUDA_ERROR_INVALID_VALUE`.
pub fn double_free_is_invalid_value(target: Target) -> Result<(), Failed> {
    let raw = Raw::new(target)?;
    let p = raw.driver.mem_alloc(raw.ctx, 4096)?;
    raw.free(p)?;
    expect_kind("second cuMemFree", raw.free(p), ErrorKind::InvalidValue)?;
    expect_kind("cuMemFree(0x10)", raw.free(DevicePtr(0x10)), ErrorKind::InvalidValue)
}

/// Freeing an address inside an allocation (not its base) is `CUDA_ERROR_INVALID_VALUE`, and
/// the allocation survives.
pub fn interior_pointer_free_is_invalid_value(target: Target) -> Result<(), Failed> {
    let raw = Raw::new(target)?;
    let p = raw.driver.mem_alloc(raw.ctx, 4096)?;
    expect_kind("cuMemFree(base + 256)", raw.free(DevicePtr(p.0 + 256)), ErrorKind::InvalidValue)?;
    raw.free(p)?;
    Ok(())
}

/// `cuMemGetAddressRange` of an interior address gives the allocation's base and its requested
/// size (the IPC offset of a view relies on it).
pub fn address_range_of_interior_pointer(target: Target) -> Result<(), Failed> {
    let raw = Raw::new(target)?;
    let p = raw.driver.mem_alloc(raw.ctx, 1000)?;
    let (base, size) = raw.driver.mem_get_address_range(raw.ctx, DevicePtr(p.0 + 100))?;
    raw.free(p)?;
    ensure_eq!(base, p);
    ensure_eq!(size, 1000);
    Ok(())
}

/// A copy wholly outside any allocation is `CUDA_ERROR_INVALID_VALUE`.
pub fn out_of_range_copy_is_invalid_value(target: Target) -> Result<(), Failed> {
    let raw = Raw::new(target)?;
    // SAFETY: the destination is an address no allocation holds; the driver must refuse it.
    let r = unsafe { raw.driver.memcpy_htod(raw.ctx, DevicePtr(0x10), &[0u8; 8]) };
    expect_kind("cuMemcpyHtoD to 0x10", r, ErrorKind::InvalidValue)
}

/// A 64 MiB allocation lowers `free` by exactly 64 MiB, and its free gives it all back.
pub fn mem_get_info_accounts_large_allocations(target: Target) -> Result<(), Failed> {
    let raw = Raw::new(target)?;
    let before = raw.driver.mem_get_info(raw.ctx)?;
    let p = raw.driver.mem_alloc(raw.ctx, 64 << 20)?;
    let during = raw.driver.mem_get_info(raw.ctx)?;
    raw.free(p)?;
    let after = raw.driver.mem_get_info(raw.ctx)?;
    ensure_eq!(before.free - during.free, 64 << 20, "bytes taken by a 64 MiB allocation");
    ensure_eq!(after.free, before.free);
    Ok(())
}
