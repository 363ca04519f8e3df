//! Driver conformance: what emm relies on, pinned on the simulator and the real driver alike.
//! Where the two disagreed on the GPU, the simulator was changed, never these tests.
#![allow(unsafe_code)]

mod capture;
mod host_ipc;
mod pools;
mod streams;

pub use capture::*;
pub use host_ipc::*;
pub use pools::*;
pub use streams::*;

use std::sync::Arc;

use driver_sys::{ContextHandle, DeviceOrdinal, DevicePtr, Driver, ErrorKind};
use integration::{Target, make_driver};
use libtest_mimic::Failed;

/// The alignment of `cuMemAlloc` results of up to 1 MiB, measured on an H200 (driver 580;
/// `ci/hardware-runs.md`): they are packed into shared pages at this granularity.
pub const ALLOC_ALIGNMENT: u64 = 512;
/// Larger allocations get whole pages of this size, aligned to it; `cuMemGetInfo` moves in it.
pub const PAGE: usize = 2 << 20;

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

/// Allocations of up to 1 MiB are aligned to [`ALLOC_ALIGNMENT`]; larger ones to [`PAGE`].
pub fn alignment_of_allocations(target: Target) -> Result<(), Failed> {
    let raw = Raw::new(target)?;
    let mut ptrs = Vec::new();
    let sizes = [
        1usize,
        3,
        100,
        255,
        256,
        257,
        511,
        512,
        513,
        1000,
        4096,
        65537,
        1 << 20,
    ];
    let large = [(1 << 20) + 1, 2 << 20, (2 << 20) + 1, 5 << 20];
    for bytes in sizes.into_iter().chain(large) {
        let p = raw.driver.mem_alloc(raw.ctx, bytes)?;
        ptrs.push((bytes, p));
    }
    let bad: Vec<_> = ptrs
        .iter()
        .filter(|(bytes, p)| {
            let align = if *bytes <= 1 << 20 {
                ALLOC_ALIGNMENT
            } else {
                PAGE as u64
            };
            p.0 % align != 0
        })
        .collect();
    let result = if bad.is_empty() {
        Ok(())
    } else {
        Err(format!("misaligned allocations: {bad:?}; all: {ptrs:?}").into())
    };
    for (_, p) in ptrs {
        raw.free(p)?;
    }
    result
}

/// Two small allocations made back to back in a fresh context share a page, 512 bytes apart,
/// and a size of 1000 occupies 1024 bytes.
pub fn small_allocations_are_packed(target: Target) -> Result<(), Failed> {
    let raw = Raw::new(target)?;
    let a = raw.driver.mem_alloc(raw.ctx, 1000)?;
    let b = raw.driver.mem_alloc(raw.ctx, 1)?;
    let c = raw.driver.mem_alloc(raw.ctx, 1)?;
    for p in [a, b, c] {
        raw.free(p)?;
    }
    ensure_eq!(b.0 - a.0, 1024, "a 1000-byte allocation spans 1024 bytes");
    ensure_eq!(
        c.0 - b.0,
        ALLOC_ALIGNMENT,
        "1-byte allocations are 512 bytes apart"
    );
    Ok(())
}

/// `cuMemGetInfo` counts whole pages: 2 MiB + 1 bytes cost 4 MiB, 64 MiB + 1 cost 66 MiB, and
/// a small allocation costs either nothing (it fits an open page) or one page.
pub fn mem_get_info_counts_pages(target: Target) -> Result<(), Failed> {
    let raw = Raw::new(target)?;
    for (bytes, cost) in [
        (PAGE + 1, 2 * PAGE),
        (PAGE, PAGE),
        ((64 << 20) + 1, (64 << 20) + PAGE),
    ] {
        let before = raw.driver.mem_get_info(raw.ctx)?.free;
        let p = raw.driver.mem_alloc(raw.ctx, bytes)?;
        let during = raw.driver.mem_get_info(raw.ctx)?.free;
        raw.free(p)?;
        let after = raw.driver.mem_get_info(raw.ctx)?.free;
        ensure_eq!(before - during, cost, "cost of a {bytes}-byte allocation");
        ensure_eq!(after, before, "freeing it returns every page");
    }
    let before = raw.driver.mem_get_info(raw.ctx)?.free;
    let p = raw.driver.mem_alloc(raw.ctx, 1)?;
    let cost = before - raw.driver.mem_get_info(raw.ctx)?.free;
    raw.free(p)?;
    ensure!(
        cost == 0 || cost == PAGE,
        "a 1-byte allocation cost {cost} bytes"
    );
    let info = raw.driver.mem_get_info(raw.ctx)?;
    ensure!(
        info.free < info.total,
        "a live context takes memory of its own: {info:?}"
    );
    Ok(())
}

/// Freeing the null pointer succeeds and does nothing.
pub fn free_of_null_is_a_no_op(target: Target) -> Result<(), Failed> {
    let raw = Raw::new(target)?;
    let before = raw.driver.mem_get_info(raw.ctx)?;
    raw.free(DevicePtr(0))?;
    ensure_eq!(raw.driver.mem_get_info(raw.ctx)?, before);
    Ok(())
}

/// Releasing the last reference destroys the primary context: calls with its handle answer
/// `CONTEXT_IS_DESTROYED`, a further release `INVALID_CONTEXT`, and the next retain brings it
/// back with the same handle, without the old memory.
pub fn released_context_is_destroyed(target: Target) -> Result<(), Failed> {
    let (driver, _) = make_driver(target)?;
    driver.init()?;
    let dev = DeviceOrdinal(0);
    let ctx = driver.primary_ctx_retain(dev)?;
    let old = driver.mem_alloc(ctx, 4096)?;
    // SAFETY: matches the retain above; `old` is not used again except to show it is gone.
    unsafe { driver.primary_ctx_release(dev)? };
    expect_kind(
        "cuMemGetInfo",
        driver.mem_get_info(ctx),
        ErrorKind::ContextDestroyed,
    )?;
    expect_kind(
        "cuMemAlloc",
        driver.mem_alloc(ctx, 16),
        ErrorKind::ContextDestroyed,
    )?;
    // SAFETY: the context is destroyed; the driver must refuse.
    let r = unsafe { driver.mem_free(ctx, old) };
    expect_kind("cuMemFree", r, ErrorKind::ContextDestroyed)?;
    // SAFETY: no reference is held; the driver must refuse.
    let r = unsafe { driver.primary_ctx_release(dev) };
    expect_kind("release at 0", r, ErrorKind::InvalidContext)?;
    let again = driver.primary_ctx_retain(dev)?;
    ensure_eq!(again, ctx, "the primary context keeps its handle");
    // SAFETY: `old` died with the context; the driver must refuse it.
    let r = unsafe { driver.mem_free(again, old) };
    expect_kind("cuMemFree(old)", r, ErrorKind::InvalidValue)?;
    // SAFETY: matches the retain above.
    unsafe { driver.primary_ctx_release(dev)? };
    Ok(())
}

/// `cuDevicePrimaryCtxReset` destroys the context while it is still retained, until the next
/// retain re-creates it; memory from before the reset is gone.
pub fn reset_destroys_context_until_retained(target: Target) -> Result<(), Failed> {
    let (driver, _) = make_driver(target)?;
    driver.init()?;
    let dev = DeviceOrdinal(0);
    let ctx = driver.primary_ctx_retain(dev)?;
    let old = driver.mem_alloc(ctx, 4096)?;
    // SAFETY: nothing of the context is used afterwards except to show it is gone.
    unsafe { driver.primary_ctx_reset(dev)? };
    expect_kind(
        "cuMemGetInfo after reset",
        driver.mem_get_info(ctx),
        ErrorKind::ContextDestroyed,
    )?;
    // SAFETY: the context is destroyed; the driver must refuse.
    let r = unsafe { driver.mem_free(ctx, old) };
    expect_kind("cuMemFree after reset", r, ErrorKind::ContextDestroyed)?;
    let again = driver.primary_ctx_retain(dev)?;
    ensure_eq!(again, ctx);
    let fresh = driver.mem_alloc(again, 16)?;
    // SAFETY: allocated just above.
    unsafe { driver.mem_free(again, fresh)? };
    // SAFETY: two retains, two releases.
    unsafe {
        driver.primary_ctx_release(dev)?;
        driver.primary_ctx_release(dev)?;
    }
    Ok(())
}

/// `cuMemAlloc(0)` is `CUDA_ERROR_INVALID_VALUE`.
pub fn zero_byte_alloc_is_invalid_value(target: Target) -> Result<(), Failed> {
    let raw = Raw::new(target)?;
    expect_kind(
        "cuMemAlloc(0)",
        raw.driver.mem_alloc(raw.ctx, 0),
        ErrorKind::InvalidValue,
    )
}

/// More than the device's memory is `CUDA_ERROR_OUT_OF_MEMORY`, however large.
pub fn oversized_alloc_is_out_of_memory(target: Target) -> Result<(), Failed> {
    let raw = Raw::new(target)?;
    let total = raw.driver.mem_get_info(raw.ctx)?.total;
    expect_kind(
        "cuMemAlloc(total + 1)",
        raw.driver.mem_alloc(raw.ctx, total + 1),
        ErrorKind::OutOfMemory,
    )?;
    expect_kind(
        "cuMemAlloc(usize::MAX / 2)",
        raw.driver.mem_alloc(raw.ctx, usize::MAX / 2),
        ErrorKind::OutOfMemory,
    )
}

/// Freeing twice, or freeing an address never allocated, is `CUDA_ERROR_INVALID_VALUE`.
pub fn double_free_is_invalid_value(target: Target) -> Result<(), Failed> {
    let raw = Raw::new(target)?;
    let p = raw.driver.mem_alloc(raw.ctx, 4096)?;
    raw.free(p)?;
    expect_kind("second cuMemFree", raw.free(p), ErrorKind::InvalidValue)?;
    expect_kind(
        "cuMemFree(0x10)",
        raw.free(DevicePtr(0x10)),
        ErrorKind::InvalidValue,
    )
}

/// Freeing an address inside an allocation (not its base) is `CUDA_ERROR_INVALID_VALUE`, and
/// the allocation survives.
pub fn interior_pointer_free_is_invalid_value(target: Target) -> Result<(), Failed> {
    let raw = Raw::new(target)?;
    let p = raw.driver.mem_alloc(raw.ctx, 4096)?;
    expect_kind(
        "cuMemFree(base + 256)",
        raw.free(DevicePtr(p.0 + 256)),
        ErrorKind::InvalidValue,
    )?;
    raw.free(p)?;
    Ok(())
}

/// `cuMemGetAddressRange` of an interior address gives the allocation's base and its requested
/// size (the IPC offset of a view relies on it).
pub fn address_range_of_interior_pointer(target: Target) -> Result<(), Failed> {
    let raw = Raw::new(target)?;
    let p = raw.driver.mem_alloc(raw.ctx, 1000)?;
    let (base, size) = raw
        .driver
        .mem_get_address_range(raw.ctx, DevicePtr(p.0 + 100))?;
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
    ensure_eq!(
        before.free - during.free,
        64 << 20,
        "bytes taken by a 64 MiB allocation"
    );
    ensure_eq!(after.free, before.free);
    Ok(())
}

/// What destroying a context (its last release) takes with it, as emm relies on when it frees
/// everything before a context goes: its device memory and its pinned host memory, portable
/// or not, are gone afterwards (a free of any is `CUDA_ERROR_INVALID_VALUE` in the re-created
/// context, and portable memory no longer has a device address). Measured on the H200: the
/// `PORTABLE` flag makes memory pinned for every context, not outlive the one that allocated
/// it.
pub fn context_destruction_reclaims_all_its_memory(target: Target) -> Result<(), Failed> {
    use driver_sys::host_alloc;
    let (driver, _) = make_driver(target)?;
    driver.init()?;
    let dev = DeviceOrdinal(0);
    let ctx = driver.primary_ctx_retain(dev)?;
    let made = (|| {
        Ok::<_, driver_sys::DriverError>((
            driver.mem_alloc(ctx, 1 << 20)?,
            driver.mem_host_alloc(ctx, 4096, 0)?,
            driver.mem_host_alloc(ctx, 4096, host_alloc::PORTABLE)?,
            driver.mem_alloc_managed(ctx, 1 << 20, driver_sys::mem_attach::GLOBAL)?,
        ))
    })();
    // SAFETY: matches the retain above: the context is destroyed with what it holds, which is
    // not used again except to show that it is gone.
    unsafe { driver.primary_ctx_release(dev)? };
    let (device, pinned, portable, managed) = made?;
    let again = driver.primary_ctx_retain(dev)?;
    let checks = (|| -> Result<(), Failed> {
        for (what, p) in [("device", device), ("managed", managed)] {
            // SAFETY: `p` died with the context; the driver must refuse it.
            let r = unsafe { driver.mem_free(again, p) };
            expect_kind(
                &format!("cuMemFree of the old context's {what} memory"),
                r,
                ErrorKind::InvalidValue,
            )?;
        }
        expect_kind(
            "cuMemHostGetDevicePointer of the old context's portable memory",
            driver.mem_host_get_device_pointer(again, portable),
            ErrorKind::InvalidValue,
        )?;
        for (what, p) in [("pinned", pinned), ("portable pinned", portable)] {
            // SAFETY: `p` died with the context; the driver must refuse it.
            let r = unsafe { driver.mem_free_host(again, p) };
            expect_kind(
                &format!("cuMemFreeHost of the old context's {what} memory"),
                r,
                ErrorKind::InvalidValue,
            )?;
        }
        Ok(())
    })();
    // SAFETY: matches the retain above, whatever the checks found.
    unsafe { driver.primary_ctx_release(dev)? };
    checks
}

/// The attributes emm reads: device 0 can map host memory (emm refuses mapped pins where it
/// cannot), and the PCI ids that name a device across processes are non-negative and differ
/// between devices.
pub fn device_attributes_conformance(target: Target) -> Result<(), Failed> {
    use driver_sys::DeviceAttribute;
    let (driver, _) = make_driver(target)?;
    driver.init()?;
    let count = driver.device_count()?;
    ensure!(count >= 1);
    ensure_eq!(
        driver.device_attribute(DeviceOrdinal(0), DeviceAttribute::CanMapHostMemory)?,
        1,
        "device 0 maps host memory"
    );
    let mut ids = Vec::new();
    for d in 0..count {
        let dev = DeviceOrdinal(d);
        let id = (
            driver.device_attribute(dev, DeviceAttribute::PciDomainId)?,
            driver.device_attribute(dev, DeviceAttribute::PciBusId)?,
            driver.device_attribute(dev, DeviceAttribute::PciDeviceId)?,
        );
        ensure!(id.0 >= 0 && id.1 >= 0 && id.2 >= 0, "device {d}: {id:?}");
        ensure!(!ids.contains(&id), "device {d} shares PCI ids {id:?}");
        ids.push(id);
    }
    expect_kind(
        "an attribute of a device that does not exist",
        driver.device_attribute(DeviceOrdinal(count), DeviceAttribute::PciBusId),
        ErrorKind::InvalidDevice,
    )?;
    Ok(())
}
