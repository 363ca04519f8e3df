//! Driver conformance: what emm relies on, pinned on the simulator and the real driver alike.
//! Where the two disagreed on the GPU, the simulator was changed, never these tests.
#![allow(unsafe_code)]

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

/// Measured on the H200: `cuMemHostAlloc(0)` succeeds with the null pointer, which
/// `cuMemFreeHost` accepts; any pinned memory (mapped or not) and any registered range has a
/// device address equal to its host address (unified addressing); registering twice and
/// unregistering twice give the dedicated codes.
pub fn host_memory_conformance(target: Target) -> Result<(), Failed> {
    use driver_sys::{HostPtr, host_register};
    let raw = Raw::new(target)?;
    let (d, ctx) = (&raw.driver, raw.ctx);
    let null = d.mem_host_alloc(ctx, 0, 0)?;
    ensure_eq!(null, HostPtr(0));
    // SAFETY: freeing the null pointer the driver returned.
    unsafe { d.mem_free_host(ctx, null)? };
    let h = d.mem_host_alloc(ctx, 4096, 0)?;
    ensure_eq!(
        d.mem_host_get_device_pointer(ctx, h)?.0,
        h.0 as u64,
        "unmapped pinned memory"
    );
    // SAFETY: allocated just above, freed once.
    unsafe { d.mem_free_host(ctx, h)? };
    // SAFETY: freed already; the driver must refuse.
    let r = unsafe { d.mem_free_host(ctx, h) };
    expect_kind("cuMemFreeHost twice", r, ErrorKind::InvalidValue)?;
    let buf = std::sync::Arc::new(emm::PinnableBuffer::zeroed(8192));
    let p = buf.host_ptr();
    for flags in [0, host_register::DEVICEMAP] {
        // SAFETY: `buf` is alive for the whole test and only reached through copies.
        unsafe { d.mem_host_register(ctx, p, 8192, flags)? };
        ensure_eq!(
            d.mem_host_get_device_pointer(ctx, p)?.0,
            p.0 as u64,
            "registered with flags {flags}"
        );
        // SAFETY: as above; registering the same range again must be refused.
        let again = unsafe { d.mem_host_register(ctx, p, 8192, flags) };
        expect_kind(
            "register twice",
            again,
            ErrorKind::HostMemoryAlreadyRegistered,
        )?;
        // SAFETY: registered above; nothing uses the mapping afterwards.
        unsafe { d.mem_host_unregister(ctx, p)? };
        // SAFETY: not registered any more; the driver must refuse.
        let again = unsafe { d.mem_host_unregister(ctx, p) };
        expect_kind(
            "unregister twice",
            again,
            ErrorKind::HostMemoryNotRegistered,
        )?;
    }
    // SAFETY: a zero-byte registration must be refused.
    let zero = unsafe { d.mem_host_register(ctx, p, 0, 0) };
    expect_kind("register 0 bytes", zero, ErrorKind::InvalidValue)?;
    Ok(())
}

/// Measured on the H200: an IPC handle may be taken at an address inside an allocation (it names
/// the allocation); opening a handle in the exporting process is `CUDA_ERROR_INVALID_CONTEXT`,
/// garbage handles and closing what was never opened `CUDA_ERROR_INVALID_VALUE`; a device is
/// not its own peer.
pub fn ipc_and_peer_conformance(target: Target) -> Result<(), Failed> {
    let raw = Raw::new(target)?;
    let (d, ctx) = (&raw.driver, raw.ctx);
    let a = d.mem_alloc(ctx, 1 << 20)?;
    let whole = d.ipc_get_mem_handle(ctx, a)?;
    d.ipc_get_mem_handle(ctx, DevicePtr(a.0 + 4096))?;
    expect_kind(
        "open in the exporting process",
        d.ipc_open_mem_handle(ctx, &whole),
        ErrorKind::InvalidContext,
    )?;
    let garbage = driver_sys::IpcMemHandle([7; 64]);
    expect_kind(
        "open garbage",
        d.ipc_open_mem_handle(ctx, &garbage),
        ErrorKind::InvalidValue,
    )?;
    // SAFETY: never opened; the driver must refuse.
    let close = unsafe { d.ipc_close_mem_handle(ctx, a) };
    expect_kind("close unopened", close, ErrorKind::InvalidValue)?;
    raw.free(a)?;
    ensure_eq!(
        d.device_can_access_peer(DeviceOrdinal(0), DeviceOrdinal(0))?,
        false
    );
    let bad = d.module_load_data(ctx, b"not an image");
    match bad {
        Err(e) if e.raw_code() == Some(driver_sys::code::INVALID_IMAGE) => Ok(()),
        other => Err(format!("garbage module image: {other:?}").into()),
    }
}

/// Pool export, as measured on the H200: a pool created without a shareable handle type does
/// not export; an IPC-enabled pool's allocation is refused by `cuMemPoolExportPointer`
/// (`CUDA_ERROR_INVALID_VALUE`) until the pool itself was exported once, and exports after
/// that, also once the pool's descriptor was closed; the pool's own device has read-write
/// access to it.
pub fn pool_export_conformance(target: Target) -> Result<(), Failed> {
    let raw = Raw::new(target)?;
    let (d, ctx, dev) = (&raw.driver, raw.ctx, DeviceOrdinal(0));
    let stream = driver_sys::StreamHandle::NULL;
    let plain = d.mem_pool_create(ctx, dev, false)?;
    expect_kind(
        "exporting a pool created without a handle type",
        d.mem_pool_export_fd(ctx, plain).map(|_| ()),
        ErrorKind::InvalidValue,
    )?;
    let pool = d.mem_pool_create(ctx, dev, true)?;
    ensure!(
        d.mem_pool_can_access(ctx, pool, dev)?,
        "the pool's own device has read-write access"
    );
    let ptr = d.mem_alloc_from_pool_async(ctx, pool, 4096, stream)?;
    d.stream_synchronize(ctx, stream)?;
    expect_kind(
        "exporting an allocation before the pool",
        d.mem_pool_export_pointer(ctx, ptr),
        ErrorKind::InvalidValue,
    )?;
    drop(d.mem_pool_export_fd(ctx, pool)?);
    let data = d.mem_pool_export_pointer(ctx, ptr)?;
    ensure!(
        data.0 != [0; 64],
        "the export data is not all zeros: {data:?}"
    );
    // SAFETY: `ptr` came from the pool above and is freed once; then both pools, created
    // above with nothing else allocated from them, are destroyed once.
    unsafe {
        d.mem_free_async(ctx, ptr, stream)?;
        d.stream_synchronize(ctx, stream)?;
        d.mem_pool_destroy(ctx, pool)?;
        d.mem_pool_destroy(ctx, plain)?;
    }
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

/// Stream-ordered pools as emm's `async-pool` uses them: usage is counted in `reserved` and
/// `used`; with the release threshold at 0 a synchronisation returns freed memory to the
/// system, at its maximum the pool keeps it until `cuMemPoolTrimTo(0)`; a pool destroyed with
/// an allocation outstanding releases its memory only once that allocation is freed (measured
/// on the H200; emm's reset frees first for that reason).
pub fn stream_ordered_pool_conformance(target: Target) -> Result<(), Failed> {
    use driver_sys::StreamHandle;
    let raw = Raw::new(target)?;
    let (d, ctx, dev) = (&raw.driver, raw.ctx, DeviceOrdinal(0));
    let s0 = StreamHandle::NULL;
    let pool = d.mem_pool_create(ctx, dev, false)?;
    let usage = d.mem_pool_usage(ctx, pool)?;
    ensure_eq!(
        (usage.reserved, usage.used),
        (0, 0),
        "a new pool holds nothing"
    );
    for threshold in [0, u64::MAX] {
        d.mem_pool_set_release_threshold(ctx, pool, threshold)?;
        let p = d.mem_alloc_from_pool_async(ctx, pool, 1 << 20, s0)?;
        d.stream_synchronize(ctx, s0)?;
        let usage = d.mem_pool_usage(ctx, pool)?;
        ensure_eq!(usage.used, 1 << 20, "threshold {threshold}: in use");
        ensure!(
            usage.reserved >= 1 << 20,
            "threshold {threshold}: reserved {} for 1 MiB in use",
            usage.reserved
        );
        // SAFETY: allocated just above on stream 0, freed once; nothing uses it afterwards.
        unsafe { d.mem_free_async(ctx, p, s0)? };
        d.stream_synchronize(ctx, s0)?;
        let usage = d.mem_pool_usage(ctx, pool)?;
        ensure_eq!(usage.used, 0, "threshold {threshold}: freed");
        if threshold == 0 {
            ensure_eq!(
                usage.reserved,
                0,
                "threshold 0: released at the synchronisation"
            );
        } else {
            ensure!(
                usage.reserved >= 1 << 20,
                "threshold max: kept, reserved {}",
                usage.reserved
            );
            d.mem_pool_trim_to(ctx, pool, 0)?;
            ensure_eq!(d.mem_pool_usage(ctx, pool)?.reserved, 0, "trimmed to 0");
        }
    }
    // Destroyed with an allocation outstanding: the memory stays until it is freed.
    let before = d.mem_get_info(ctx)?.free;
    let p = d.mem_alloc_from_pool_async(ctx, pool, 8 << 20, s0)?;
    d.stream_synchronize(ctx, s0)?;
    let held = d.mem_get_info(ctx)?.free;
    ensure!(
        held + (8 << 20) <= before,
        "8 MiB taken: {before} -> {held}"
    );
    // SAFETY: the pool is destroyed once; `p` stays valid until its free below.
    unsafe { d.mem_pool_destroy(ctx, pool)? };
    ensure!(
        d.mem_get_info(ctx)?.free + (8 << 20) <= before,
        "the outstanding allocation keeps its memory after the pool is destroyed"
    );
    // SAFETY: `p` came from the destroyed pool and is freed once, here.
    unsafe { d.mem_free_async(ctx, p, s0)? };
    d.stream_synchronize(ctx, s0)?;
    ensure_eq!(
        d.mem_get_info(ctx)?.free,
        before,
        "the memory is back once the allocation is freed"
    );
    Ok(())
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

/// IPC mappings in the importing process, with bare driver calls (the importer is another
/// process: a simulated one, or a real child on the GPU; see
/// [`integration::raw_ipc_importer`]): the exported bytes arrive; a second open in one context
/// returns the same address and counts (one close leaves the mapping, the second unmaps it, a
/// third is `CUDA_ERROR_INVALID_VALUE`); the mapping's address range starts at it and covers
/// the allocation. The exporter frees only after the importer closed: freeing first is
/// undefined by the driver's documentation (`cuIpcGetMemHandle`), so it is not pinned here;
/// emm's exporting handle keeps the memory until it is dropped.
pub fn ipc_mapping_conformance(target: Target) -> Result<(), Failed> {
    let (driver, sim) = make_driver(target)?;
    driver.init()?;
    let dev = DeviceOrdinal(0);
    let ctx = driver.primary_ctx_retain(dev)?;
    let size = 1 << 20;
    let result = (|| -> Result<(), Failed> {
        let p = driver.mem_alloc(ctx, size)?;
        let pattern: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
        let imported = (|| -> Result<(), Failed> {
            // SAFETY: `p` is this context's allocation of `size` bytes, not otherwise in use.
            unsafe { driver.memcpy_htod(ctx, p, &pattern)? };
            let handle = driver.ipc_get_mem_handle(ctx, p)?;
            integration::raw_ipc_import_in_other_process(sim.as_ref(), &handle.0, size)?;
            Ok(())
        })();
        // SAFETY: allocated above, freed once, after the importer closed its mapping.
        unsafe { driver.mem_free(ctx, p)? };
        imported
    })();
    // SAFETY: matches the retain above.
    unsafe { driver.primary_ctx_release(dev)? };
    result
}

/// A stream-ordered pool seen from the process that imports it, as emm's importer relies on
/// (`emm::ipc::imports`): after `cuMemPoolImportFromShareableHandle` the importing device may
/// access the pool (emm asks with `cuMemPoolGetAccess` and grants access only when it may
/// not); allocating from an imported pool is refused; the imported pointer reads the
/// exporter's bytes and its writes reach the exporter; a second import of the same allocation
/// gives the same address, and one free unmaps it (imports are not counted). The exporter is
/// emm under `async-pool-ipc`; the importer makes raw driver calls in another process
/// (`integration::raw_pool_importer`).
pub fn imported_pool_conformance(target: Target) -> Result<(), Failed> {
    let t = integration::TestCtx::with(target, |b| b.memory_manager_name("async-pool-ipc"))?;
    let ctx = t.context()?;
    let size = 1 << 20;
    let pattern: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
    let mem = ctx.to_device(&pattern)?;
    let handle = ctx.get_ipc_handle(&mem)?;
    let export = ctx.export_pool()?;
    let facts =
        integration::raw_pool_import_in_other_process(t.sim.as_ref(), &handle.to_bytes(), &export)?;
    ensure_eq!(
        facts,
        "access=true alloc=InvalidValue read=true reimport=same second_free=InvalidValue"
    );
    let mut back = vec![0u8; size];
    ctx.copy_to_host(&mut back, &mem)?;
    ensure!(
        back == integration::importer_pattern(size),
        "the importer's writes reach the exporter's allocation"
    );
    Ok(())
}

/// What a stream-ordered pool's cache does under memory pressure, as `async-pool`'s
/// out-of-memory retry relies on (measured on an H100, 2026-11-23; the driver probe prints the
/// steps): with the release threshold at its maximum, a pool keeps a freed block; when a
/// `cuMemAlloc`, or an allocation from another pool, then needs that memory, the driver takes
/// it from the cache itself, without a trim, provided the host has observed the free (a
/// synchronisation). A block whose free was not yet observed stays reserved: allocations are
/// out of memory and even `cuMemPoolTrimTo(0)` keeps it, until a synchronisation.
pub fn pool_cache_under_pressure(target: Target) -> Result<(), Failed> {
    use driver_sys::{MemPoolHandle, StreamHandle};
    let raw = Raw::new(target)?;
    let (d, ctx, dev) = (&raw.driver, raw.ctx, DeviceOrdinal(0));
    let s0 = StreamHandle::NULL;
    let total = d.mem_get_info(ctx)?.total;
    let cached = (256 << 20).min(total / 8 / PAGE * PAGE);
    let reserved = |pool| d.mem_pool_usage(ctx, pool).map(|u| u.reserved);
    // Fills the device by `cuMemAlloc`, or from `from`; returns what it took.
    let fill = |from: Option<MemPoolHandle>| {
        integration::fill_device(|chunk| match from {
            Some(q) => d.mem_alloc_from_pool_async(ctx, q, chunk, s0),
            None => d.mem_alloc(ctx, chunk),
        })
    };
    let release = |held: Vec<DevicePtr>, from: Option<MemPoolHandle>| -> Result<(), Failed> {
        for p in held {
            match from {
                // SAFETY: allocated by `fill` from that pool, freed once, unused.
                Some(_) => unsafe { d.mem_free_async(ctx, p, s0)? },
                None => raw.free(p)?,
            }
        }
        d.stream_synchronize(ctx, s0)?;
        Ok(())
    };
    for (filler, synchronised) in [
        ("cuMemAlloc", true),
        ("cuMemAlloc", false),
        ("a second pool", true),
    ] {
        let what = format!("filled by {filler}, the free synchronised: {synchronised}");
        let pool = d.mem_pool_create(ctx, dev, false)?;
        let second = match filler {
            "a second pool" => Some(d.mem_pool_create(ctx, dev, false)?),
            _ => None,
        };
        let mut held = Vec::new();
        let result = (|| -> Result<(), Failed> {
            d.mem_pool_set_release_threshold(ctx, pool, u64::MAX)?;
            let p = d.mem_alloc_from_pool_async(ctx, pool, cached, s0)?;
            // SAFETY: allocated just above on stream 0, freed once; nothing uses it.
            unsafe { d.mem_free_async(ctx, p, s0)? };
            if synchronised {
                d.stream_synchronize(ctx, s0)?;
            }
            ensure!(
                reserved(pool)? >= cached as u64,
                "{what}: the pool caches the block"
            );
            let filled;
            (held, filled) = fill(second);
            filled?;
            if synchronised {
                ensure_eq!(reserved(pool)?, 0, "{what}: the fill took the cache");
                return Ok(());
            }
            ensure!(reserved(pool)? >= cached as u64, "{what}: the cache stays");
            d.mem_pool_trim_to(ctx, pool, 0)?;
            ensure!(
                reserved(pool)? >= cached as u64,
                "{what}: a trim keeps it too"
            );
            expect_kind(
                "cuMemAlloc before the synchronisation",
                d.mem_alloc(ctx, 2 << 20),
                ErrorKind::OutOfMemory,
            )?;
            d.stream_synchronize(ctx, s0)?;
            held.push(d.mem_alloc(ctx, 2 << 20)?);
            ensure!(
                reserved(pool)? < cached as u64,
                "{what}: after it, the allocation took the cache"
            );
            Ok(())
        })();
        let released = release(std::mem::take(&mut held), second);
        // SAFETY: nothing of either pool is outstanding (`release` freed the second pool's
        // allocations and waited); each is destroyed once.
        unsafe {
            if let Some(q) = second {
                d.mem_pool_destroy(ctx, q)?;
            }
            d.mem_pool_destroy(ctx, pool)?;
        }
        result?;
        released?;
    }
    Ok(())
}

/// Managed memory (`cuMemAllocManaged`), as emm's `memallocmanaged` relies on: the device
/// supports it; zero bytes and flags other than one attach flag are `CUDA_ERROR_INVALID_VALUE`;
/// the address is valid on the host and in copies alike (bytes written through one are read
/// through the other), `cuMemGetAddressRange` names the allocation, `cuMemFree` frees it once;
/// it is not pinned host memory (`cuMemHostGetDevicePointer` refuses it) and does not export
/// with `cuIpcGetMemHandle`. (A context's destruction takes it:
/// `context_destruction_reclaims_all_its_memory`.)
pub fn managed_memory_conformance(target: Target) -> Result<(), Failed> {
    use driver_sys::{DeviceAttribute, HostPtr, mem_attach};
    let raw = Raw::new(target)?;
    let (d, ctx, dev) = (&raw.driver, raw.ctx, DeviceOrdinal(0));
    ensure_eq!(d.device_attribute(dev, DeviceAttribute::ManagedMemory)?, 1);
    for (what, bytes, flags) in [
        ("zero bytes", 0, mem_attach::GLOBAL),
        ("no attach flag", 4096, 0),
        (
            "both attach flags",
            4096,
            mem_attach::GLOBAL | mem_attach::HOST,
        ),
    ] {
        expect_kind(
            what,
            d.mem_alloc_managed(ctx, bytes, flags),
            ErrorKind::InvalidValue,
        )?;
    }
    let size = 1 << 20;
    for flags in [mem_attach::GLOBAL, mem_attach::HOST] {
        let p = d.mem_alloc_managed(ctx, size, flags)?;
        let checked = (|| -> Result<(), Failed> {
            let host = p.0 as usize as *mut u8;
            let pattern: Vec<u8> = (0..size).map(|i| (i % 249) as u8).collect();
            // SAFETY: `p` is a live managed allocation of `size` bytes, valid on the host, and
            // no device work uses it.
            unsafe { std::ptr::copy_nonoverlapping(pattern.as_ptr(), host, size) };
            let mut seen = vec![0u8; size];
            // SAFETY: as above; `seen` is the test's own buffer.
            unsafe { d.memcpy_dtoh(ctx, &mut seen, p)? };
            ensure!(
                seen == pattern,
                "a copy reads what the host wrote (flags {flags})"
            );
            let other = vec![0x3cu8; size];
            // SAFETY: as above.
            unsafe { d.memcpy_htod(ctx, p, &other)? };
            // SAFETY: as above: the copy returned, nothing else writes the memory.
            let back = unsafe { std::slice::from_raw_parts(host, size) }.to_vec();
            ensure!(
                back == other,
                "the host reads what a copy wrote (flags {flags})"
            );
            ensure_eq!(
                d.mem_get_address_range(ctx, DevicePtr(p.0 + 4096))?,
                (p, size)
            );
            expect_kind(
                "cuMemHostGetDevicePointer of managed memory",
                d.mem_host_get_device_pointer(ctx, HostPtr(p.0 as usize)),
                ErrorKind::InvalidValue,
            )?;
            expect_kind(
                "cuIpcGetMemHandle of managed memory",
                d.ipc_get_mem_handle(ctx, p),
                ErrorKind::InvalidValue,
            )?;
            Ok(())
        })();
        raw.free(p)?;
        checked?;
        expect_kind("a second cuMemFree", raw.free(p), ErrorKind::InvalidValue)?;
    }
    Ok(())
}

/// Streams and events, as emm's stream work relies on and the simulator models (its queues run
/// only at synchronisations, so every check here holds whatever the GPU's timing): a stream held
/// by `cuStreamWaitValue32` on a flag in mapped pinned memory runs none of its later work (host
/// functions, event records, sets, copies) and `cuStreamQuery` / `cuEventQuery` say so; a
/// stream that waits on its event is held too; once the host writes the flag, a synchronisation
/// finds all of it done, host functions in order; async copies through pinned memory round trip;
/// priorities are clamped into the range; an event never recorded is complete; elapsed time
/// needs two recorded timing events.
pub fn stream_and_event_conformance(target: Target) -> Result<(), Failed> {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::{Arc, Mutex};

    use driver_sys::{HostPtr, StreamHandle, event_flags, host_alloc, stream_flags, wait_value};
    let raw = Raw::new(target)?;
    let (d, ctx) = (&raw.driver, raw.ctx);

    // Priorities.
    let (least, greatest) = d.stream_priority_range(ctx)?;
    ensure!(greatest <= least, "range ({least}, {greatest})");
    expect_kind(
        "cuStreamCreateWithPriority with unknown flags",
        d.stream_create_with_priority(ctx, 0x4, 0),
        ErrorKind::InvalidValue,
    )?;
    let mut streams = Vec::new();
    for (asked, expect) in [
        (greatest - 10, greatest),
        (least + 10, least),
        (least, least),
    ] {
        let s = d.stream_create_with_priority(ctx, stream_flags::NON_BLOCKING, asked)?;
        streams.push(s);
        ensure_eq!(d.stream_priority(ctx, s)?, expect, "priority asked {asked}");
    }

    let size = 1 << 16;
    let flag_host = d.mem_host_alloc(ctx, 4096, host_alloc::DEVICEMAP)?;
    let pinned = d.mem_host_alloc(ctx, size, 0)?;
    let buf = d.mem_alloc(ctx, size)?;
    let buf2 = d.mem_alloc(ctx, size)?;
    let flag = |v: u32| {
        // SAFETY: the flag word is the test's own mapped pinned memory, live until the end;
        // the device only reads it (a volatile write so the GPU's poll sees it).
        unsafe { std::ptr::write_volatile(flag_host.0 as *mut u32, v) }
    };
    flag(0);
    let flag_dev = d.mem_host_get_device_pointer(ctx, flag_host)?;
    let (a, b) = (streams[0], streams[1]);
    let timing = d.event_create(ctx, event_flags::DEFAULT)?;
    let start = d.event_create(ctx, event_flags::DEFAULT)?;
    let untimed = d.event_create(ctx, event_flags::DISABLE_TIMING)?;
    let order = Arc::new(Mutex::new(Vec::new()));
    let ran = Arc::new(AtomicU32::new(0));

    let checks = (|| -> Result<(), Failed> {
        ensure!(
            d.event_query(ctx, timing)?,
            "an event never recorded is complete"
        );
        expect_kind(
            "elapsed time of an event never recorded",
            d.event_elapsed_time(ctx, start, timing),
            ErrorKind::InvalidHandle,
        )?;
        d.event_record(ctx, start, a)?;
        d.stream_wait_value32(ctx, a, flag_dev, 1, wait_value::EQ)?;
        for n in [1, 2] {
            let order = Arc::clone(&order);
            d.launch_host_func(ctx, a, Box::new(move || order.lock().unwrap().push(n)))?;
        }
        // SAFETY: `buf` is this test's allocation; nothing else uses it.
        unsafe { d.memset_d8_async(ctx, buf, 7, size, a)? };
        d.event_record(ctx, timing, a)?;
        d.event_record(ctx, untimed, a)?;
        d.stream_wait_event(ctx, b, timing)?;
        let r = Arc::clone(&ran);
        d.launch_host_func(
            ctx,
            b,
            Box::new(move || {
                r.fetch_add(1, Ordering::SeqCst);
            }),
        )?;
        // Held: nothing after the wait has run.
        ensure!(!d.stream_query(ctx, a)?, "the held stream has work pending");
        ensure!(
            !d.stream_query(ctx, b)?,
            "the stream waiting on its event too"
        );
        ensure!(
            !d.event_query(ctx, timing)?,
            "the event after the wait is pending"
        );
        ensure!(order.lock().unwrap().is_empty(), "no host function ran");
        ensure_eq!(ran.load(Ordering::SeqCst), 0);
        expect_kind(
            "elapsed time of a pending event",
            d.event_elapsed_time(ctx, start, timing),
            ErrorKind::Other,
        )?;
        flag(1);
        d.stream_synchronize(ctx, a)?;
        d.stream_synchronize(ctx, b)?;
        ensure_eq!(
            *order.lock().unwrap(),
            vec![1, 2],
            "host functions in order"
        );
        ensure_eq!(ran.load(Ordering::SeqCst), 1);
        ensure!(
            d.stream_query(ctx, a)? && d.stream_query(ctx, b)?,
            "drained"
        );
        ensure!(d.event_query(ctx, timing)?, "the event completed");
        let ms = d.event_elapsed_time(ctx, start, timing)?;
        ensure!(ms.is_finite() && ms.is_sign_positive(), "elapsed {ms} ms");
        expect_kind(
            "elapsed time of a DISABLE_TIMING event",
            d.event_elapsed_time(ctx, start, untimed),
            ErrorKind::InvalidHandle,
        )?;
        // The set ran; async copies through pinned memory round trip.
        let mut seen = vec![0u8; size];
        // SAFETY: `buf` is live and no work is queued on it.
        unsafe { d.memcpy_dtoh(ctx, &mut seen, buf)? };
        ensure!(seen.iter().all(|&x| x == 7), "the set ran in stream order");
        let pattern: Vec<u8> = (0..size).map(|i| (i % 253) as u8).collect();
        // SAFETY: `pinned` is the test's pinned block of `size` bytes; no work uses it.
        unsafe { std::ptr::copy_nonoverlapping(pattern.as_ptr(), pinned.0 as *mut u8, size) };
        // SAFETY: the three copies use the test's own memory, kept live until the
        // synchronisation below; nothing else touches it meanwhile.
        unsafe {
            d.memcpy_htod_async(ctx, buf, pinned, size, b)?;
            d.memcpy_dtod_async(ctx, buf2, buf, size, b)?;
            d.memset_d8_async(ctx, buf, 0, size, b)?;
            d.memcpy_dtoh_async(ctx, HostPtr(pinned.0), buf2, size, b)?;
        }
        d.stream_synchronize(ctx, b)?;
        // SAFETY: the copies completed at the synchronisation; `pinned` holds `size` bytes.
        let back = unsafe { std::slice::from_raw_parts(pinned.0 as *const u8, size) };
        ensure!(
            back == pattern.as_slice(),
            "the async copies round trip in stream order"
        );
        Ok(())
    })();
    // Whatever happened: release the held stream before anything waits on it.
    flag(1);
    let synced = d.stream_synchronize(ctx, StreamHandle::LEGACY);
    let settled = d
        .stream_synchronize(ctx, a)
        .and(d.stream_synchronize(ctx, b));
    // SAFETY: every queue is drained; each object below was made above and is released once.
    unsafe {
        for e in [timing, start, untimed] {
            d.event_destroy(ctx, e)?;
        }
        for s in streams {
            d.stream_destroy(ctx, s)?;
        }
        d.mem_free_host(ctx, flag_host)?;
        d.mem_free_host(ctx, pinned)?;
    }
    raw.free(buf)?;
    raw.free(buf2)?;
    checks?;
    synced?;
    settled?;
    Ok(())
}

/// Pools with a size limit, and pools in host memory (measured on an H100, driver 580;
/// `ci/hardware-runs.md`):
/// - a limit of 8 MiB holds the pool to 32 MiB (the driver rounds `maxSize` up to 32 MiB):
///   sixteen 2 MiB blocks fit, 9 MiB more does not;
/// - a pool in host memory gives its context's device no access until `cuMemPoolSetAccess`
///   grants it; then copies to, from and within its memory work (the driver takes them with
///   `cuMemcpy` where the typed copies refuse host-pool addresses) and a set reaches the host.
pub fn pool_limits_and_host_pools_conformance(target: Target) -> Result<(), Failed> {
    use driver_sys::{DeviceAttribute, MemLocation, StreamHandle};
    let raw = Raw::new(target)?;
    let (d, ctx, dev) = (&raw.driver, raw.ctx, DeviceOrdinal(0));
    let s0 = StreamHandle::NULL;
    let mib = 1usize << 20;
    let pool = d.mem_pool_create_limited(ctx, MemLocation::Device(dev), false, 8 * mib)?;
    let mut held = Vec::new();
    for i in 0..16 {
        held.push(
            d.mem_alloc_from_pool_async(ctx, pool, 2 * mib, s0)
                .map_err(|e| format!("block {i} of 2 MiB under a limit of 8 MiB: {e}"))?,
        );
    }
    let past = d.mem_alloc_from_pool_async(ctx, pool, 9 * mib, s0);
    if let Ok(p) = past {
        held.push(p);
    }
    for p in held {
        // SAFETY: allocated above from this pool on stream 0, unused, freed once.
        unsafe { d.mem_free_async(ctx, p, s0)? };
    }
    d.stream_synchronize(ctx, s0)?;
    // SAFETY: everything allocated from it was freed above; destroyed once.
    unsafe { d.mem_pool_destroy(ctx, pool)? };
    expect_kind("9 MiB past 32 MiB held", past, ErrorKind::OutOfMemory)?;

    if d.device_attribute(dev, DeviceAttribute::HostMemoryPoolsSupported)? != 1 {
        // Reported, not passed over: the limits above ran; the host-pool half did not.
        eprintln!(
            "note: pool_limits_and_host_pools_conformance ({target:?}): the host-pool half is not \
             run: CU_DEVICE_ATTRIBUTE_HOST_MEMORY_POOLS_SUPPORTED is 0 on this device"
        );
        return Ok(());
    }
    let pool = d.mem_pool_create_limited(ctx, MemLocation::Host, false, 0)?;
    ensure!(
        !d.mem_pool_can_access(ctx, pool, dev)?,
        "a host pool gives the device no access before it is granted"
    );
    d.mem_pool_grant_access(ctx, pool, dev)?;
    ensure!(d.mem_pool_can_access(ctx, pool, dev)?, "granted");
    let p = d.mem_alloc_from_pool_async(ctx, pool, mib, s0)?;
    let dmem = d.mem_alloc(ctx, mib)?;
    d.stream_synchronize(ctx, s0)?;
    let data: Vec<u8> = (0..mib).map(|i| (i % 249) as u8).collect();
    let mut back = vec![0u8; mib];
    // SAFETY: `p` is 1 MiB of the host pool and `dmem` 1 MiB of device memory, both allocated
    // above and synchronised; the copies and sets name only them and finish before the frees.
    unsafe {
        d.memcpy_htod(ctx, p, &data)?;
        d.memcpy_dtod(ctx, dmem, p, mib)?;
        d.memset_d8(ctx, p, 0, mib)?;
        d.memcpy_dtod_async(ctx, p, dmem, mib, s0)?;
        d.stream_synchronize(ctx, s0)?;
        d.memcpy_dtoh(ctx, &mut back, p)?;
    }
    ensure!(
        back == data,
        "bytes went host -> pool -> device -> pool -> host"
    );
    // SAFETY: as above.
    unsafe { d.memset_d8_async(ctx, p, 7, mib, s0)? };
    d.stream_synchronize(ctx, s0)?;
    // SAFETY: a host pool's block is host memory at its address, `mib` bytes, and no work
    // on any stream touches it now (synchronised above).
    let host = unsafe { std::slice::from_raw_parts(p.0 as usize as *const u8, mib) };
    ensure!(host.iter().all(|&b| b == 7), "the set reached the host");
    raw.free(dmem)?;
    // SAFETY: allocated above on stream 0, the work on it is done; freed once.
    unsafe { d.mem_free_async(ctx, p, s0)? };
    d.stream_synchronize(ctx, s0)?;
    // SAFETY: nothing of the pool is outstanding; destroyed once.
    unsafe { d.mem_pool_destroy(ctx, pool)? };
    Ok(())
}

/// Virtual memory management as `vmm-pool` uses it: the granularity is 2 MiB; a physical
/// allocation costs device memory from its creation, mapped memory is reached only after
/// `cuMemSetAccess` and reads back what was written across two mappings side by side, a
/// reservation with a mapping in it is not freed, a released allocation lives until it is
/// unmapped, and everything comes back.
pub fn virtual_memory_conformance(target: Target) -> Result<(), Failed> {
    let raw = Raw::new(target)?;
    let (d, ctx, dev) = (&raw.driver, raw.ctx, DeviceOrdinal(0));
    ensure_eq!(
        d.device_attribute(dev, driver_sys::DeviceAttribute::VirtualMemoryManagement)?,
        1,
        "the device supports virtual memory management"
    );
    let g = d.mem_vmm_granularity(dev)?;
    ensure_eq!(g, PAGE, "the granularity");
    expect_kind(
        "a reservation of 0 bytes",
        d.mem_address_reserve(ctx, 0),
        ErrorKind::InvalidValue,
    )?;
    let free0 = d.mem_get_info(ctx)?.free;
    let base = d.mem_address_reserve(ctx, 8 * g)?;
    ensure_eq!(
        base.0 % g as u64,
        0,
        "a reservation is aligned to the granularity"
    );
    ensure_eq!(
        d.mem_get_info(ctx)?.free,
        free0,
        "a reservation takes no memory"
    );
    let a = d.mem_create(ctx, dev, g, false)?;
    let b = d.mem_create(ctx, dev, 2 * g, false)?;
    ensure_eq!(
        free0 - d.mem_get_info(ctx)?.free,
        3 * g,
        "physical memory counts from its creation"
    );
    // SAFETY: the ranges lie in this test's reservation, where nothing is mapped.
    unsafe {
        d.mem_map(ctx, base, g, a)?;
        d.mem_map(ctx, DevicePtr(base.0 + g as u64), 2 * g, b)?;
    }
    // Not reached before access is granted.
    // SAFETY: a deliberately refused copy into this test's own mapping.
    let refused = unsafe { d.memcpy_htod(ctx, base, &[1u8; 16]) };
    ensure!(
        refused.is_err(),
        "a copy before cuMemSetAccess was refused: {refused:?}"
    );
    d.mem_set_access(ctx, base, 3 * g, dev)?;
    // A write across the boundary of the two mappings reads back whole.
    let at = DevicePtr(base.0 + g as u64 - 8);
    let data: Vec<u8> = (0..16).collect();
    let mut back = [0u8; 16];
    // SAFETY: 16 bytes inside the two mappings this test made accessible.
    unsafe {
        d.memcpy_htod(ctx, at, &data)?;
        d.memcpy_dtoh(ctx, &mut back, at)?;
    }
    ensure_eq!(&back[..], &data[..], "bytes across two mappings");
    // SAFETY: deliberately refused: the reservation has mappings in it.
    let refused = unsafe { d.mem_address_free(ctx, base, 8 * g) };
    ensure!(
        refused.is_err(),
        "freeing a reservation with mappings in it was refused: {refused:?}"
    );
    // Released while mapped: the memory stays until the mapping goes.
    // SAFETY: `b`, made above, released once; its mapping is unmapped below.
    unsafe { d.mem_release(ctx, b)? };
    ensure_eq!(
        free0 - d.mem_get_info(ctx)?.free,
        3 * g,
        "a released allocation lives while mapped"
    );
    // SAFETY: this test's mappings, used by no work.
    unsafe {
        d.mem_unmap(ctx, DevicePtr(base.0 + g as u64), 2 * g)?;
        d.mem_unmap(ctx, base, g)?;
        d.mem_release(ctx, a)?;
        d.mem_address_free(ctx, base, 8 * g)?;
    }
    ensure_eq!(d.mem_get_info(ctx)?.free, free0, "everything came back");
    Ok(())
}

/// Physical memory shared through POSIX file descriptors, as `vmm-pool`'s IPC uses it: the
/// device supports the handle type; only an allocation made shareable exports; an imported
/// handle maps the same memory (written through one mapping, read through the other), which
/// counts once on the device and lives until the last handle and mapping of it go.
pub fn shareable_physical_memory_conformance(target: Target) -> Result<(), Failed> {
    let raw = Raw::new(target)?;
    let (d, ctx, dev) = (&raw.driver, raw.ctx, DeviceOrdinal(0));
    ensure_eq!(
        d.device_attribute(
            dev,
            driver_sys::DeviceAttribute::HandleTypePosixFileDescriptor
        )?,
        1,
        "the device exports physical memory as POSIX file descriptors"
    );
    let g = d.mem_vmm_granularity(dev)?;
    let plain = d.mem_create(ctx, dev, g, false)?;
    let refused = d.mem_export_fd(ctx, plain);
    ensure!(
        refused.is_err(),
        "an allocation made without the handle type was exported: {refused:?}"
    );
    // SAFETY: made above, never mapped, released once.
    unsafe { d.mem_release(ctx, plain)? };
    let free0 = d.mem_get_info(ctx)?.free;
    let a = d.mem_create(ctx, dev, g, true)?;
    let fd = d.mem_export_fd(ctx, a)?;
    let b = d.mem_import_fd(ctx, std::os::fd::AsFd::as_fd(&fd))?;
    // The descriptor is not needed once imported.
    drop(fd);
    ensure_eq!(
        free0 - d.mem_get_info(ctx)?.free,
        g,
        "an imported handle costs no memory of its own"
    );
    let base = d.mem_address_reserve(ctx, 2 * g)?;
    let other = DevicePtr(base.0 + g as u64);
    // SAFETY: both ranges lie in this test's reservation, where nothing is mapped.
    unsafe {
        d.mem_map(ctx, base, g, a)?;
        d.mem_map(ctx, other, g, b)?;
    }
    d.mem_set_access(ctx, base, 2 * g, dev)?;
    let data: Vec<u8> = (0..64).map(|i| i as u8 ^ 0x5a).collect();
    let mut back = [0u8; 64];
    // SAFETY: 64 bytes at the start of each of this test's two accessible mappings.
    unsafe {
        d.memcpy_htod(ctx, base, &data)?;
        d.memcpy_dtoh(ctx, &mut back, other)?;
    }
    ensure_eq!(
        &back[..],
        &data[..],
        "bytes written through the exporter's mapping, read through the imported one"
    );
    // The exporter's handle and mapping go; the imported ones keep the memory.
    // SAFETY: `a` released once; its mapping is unmapped and used by no work.
    unsafe {
        d.mem_release(ctx, a)?;
        d.mem_unmap(ctx, base, g)?;
    }
    let mut again = [0u8; 64];
    // SAFETY: the imported mapping, still accessible.
    unsafe { d.memcpy_dtoh(ctx, &mut again, other)? };
    ensure_eq!(
        &again[..],
        &data[..],
        "the memory lives while an imported handle maps it"
    );
    ensure_eq!(free0 - d.mem_get_info(ctx)?.free, g, "still counted once");
    // SAFETY: this test's last mapping and handle, used by no work; the reservation is empty
    // afterwards.
    unsafe {
        d.mem_unmap(ctx, other, g)?;
        d.mem_release(ctx, b)?;
        d.mem_address_free(ctx, base, 2 * g)?;
    }
    ensure_eq!(
        d.mem_get_info(ctx)?.free,
        free0,
        "the memory goes with its last handle"
    );
    Ok(())
}

/// What a call made during a capture gave: `ok`, or the error's code name.
fn outcome<T>(r: &Result<T, driver_sys::DriverError>) -> String {
    match r {
        Ok(_) => "ok".into(),
        Err(e) => e.code_name().to_string(),
    }
}

/// Stream capture: which calls a capture records, refuses or lets through, and how a refused
/// call invalidates it. Each row is one fact: the observed outcome beside the expected one; the
/// test fails listing every row that differs.
pub fn stream_capture_conformance(target: Target) -> Result<(), Failed> {
    use driver_sys::{CaptureMode, CaptureStatus, StreamHandle, stream_flags};
    let raw = Raw::new(target)?;
    let (d, ctx, dev) = (&raw.driver, raw.ctx, DeviceOrdinal(0));
    let mut rows: Vec<(&str, String, &str)> = Vec::new();
    let s = d.stream_create(ctx, stream_flags::NON_BLOCKING)?;
    let other = d.stream_create(ctx, stream_flags::NON_BLOCKING)?;
    let blocking = d.stream_create(ctx, 0)?;
    let buf = d.mem_alloc(ctx, 4096)?;
    // Every copy and set below writes ranges inside `buf`, this test's own allocation.
    // SAFETY: see above.
    unsafe { d.memset_d8(ctx, buf, 0, 4096)? };
    let status = |st: StreamHandle| d.stream_capture_status(ctx, st);
    let read = |at: u64| -> Result<u8, Failed> {
        let mut b = [0u8; 1];
        // SAFETY: see above.
        unsafe { d.memcpy_dtoh(ctx, &mut b, DevicePtr(buf.0 + at))? };
        Ok(b[0])
    };

    rows.push((
        "begin capture on the legacy stream",
        outcome(&d.stream_begin_capture(ctx, StreamHandle::NULL, CaptureMode::Global)),
        "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
    ));
    rows.push((
        "end capture on a stream not capturing",
        outcome(&d.stream_end_capture(ctx, s)),
        "CUDA_ERROR_ILLEGAL_STATE",
    ));
    ensure_eq!(status(s)?, CaptureStatus::None, "status before a capture");

    // 1. Recorded work runs only when the graph is launched, at every launch.
    d.stream_begin_capture(ctx, s, CaptureMode::Global)?;
    let first = status(s)?;
    ensure!(matches!(first, CaptureStatus::Active { .. }), "{first:?}");
    ensure_eq!(status(other)?, CaptureStatus::None, "another stream");
    // SAFETY: see above.
    unsafe { d.memset_d8_async(ctx, DevicePtr(buf.0), 7, 16, s)? };
    let in_graph = d.event_create(ctx, driver_sys::event_flags::DISABLE_TIMING)?;
    d.event_record(ctx, in_graph, s)?;
    let g = d.stream_end_capture(ctx, s)?;
    rows.push((
        "cuEventQuery, after the capture, of an event recorded in it",
        outcome(&d.event_query(ctx, in_graph)),
        "CUDA_ERROR_INVALID_VALUE",
    ));
    d.event_record(ctx, in_graph, s)?;
    rows.push((
        "cuEventSynchronize of that event recorded again outside",
        outcome(&d.event_synchronize(ctx, in_graph)),
        "ok",
    ));
    // SAFETY: made above, waited for.
    unsafe { d.event_destroy(ctx, in_graph)? };
    ensure_eq!(status(s)?, CaptureStatus::None, "status after the capture");
    ensure_eq!(read(0)?, 0, "captured work did not run");
    let exec = d.graph_instantiate(ctx, g)?;
    for round in 0..3u8 {
        // SAFETY: see above.
        unsafe { d.memset_d8(ctx, buf, round, 16)? };
        d.graph_launch(ctx, exec, s)?;
        d.stream_synchronize(ctx, s)?;
        ensure_eq!(read(0)?, 7, "launch {round} ran the captured set");
    }
    // SAFETY: made above, used no more.
    unsafe {
        d.graph_exec_destroy(ctx, exec)?;
        d.graph_destroy(ctx, g)?;
    }

    // 2. Calls a global capture refuses, each in a capture of its own: the refusal's code,
    // whether it left the capture invalidated, and what ending the capture gave.
    type Probe<'a> = Box<dyn Fn() -> Result<(), driver_sys::DriverError> + 'a>;
    let outside = d.mem_alloc_from_pool_async(ctx, d.device_default_mem_pool(dev)?, 1024, s)?;
    d.stream_synchronize(ctx, s)?;
    let spare = std::cell::Cell::new(d.mem_alloc(ctx, 4096)?);
    let done = d.event_create(ctx, driver_sys::event_flags::DISABLE_TIMING)?;
    d.event_record(ctx, done, other)?;
    d.stream_synchronize(ctx, other)?;
    let relaxed = |f: &dyn Fn() -> Result<(), driver_sys::DriverError>| {
        let was = d.thread_exchange_capture_mode(CaptureMode::Relaxed)?;
        let r = f();
        d.thread_exchange_capture_mode(was)?;
        r
    };
    let probes: Vec<(&str, Probe<'_>, &str, &str)> = vec![
        (
            "cuStreamQuery of another stream in relaxed mode",
            Box::new(|| relaxed(&|| d.stream_query(ctx, other).map(drop))),
            "ok",
            "active",
        ),
        (
            "cuStreamQuery of the captured stream in relaxed mode",
            Box::new(|| relaxed(&|| d.stream_query(ctx, s).map(drop))),
            "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
            "invalidated",
        ),
        (
            "cuEventQuery of an event recorded outside the capture",
            Box::new(|| d.event_query(ctx, done).map(drop)),
            "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
            "invalidated",
        ),
        (
            "cuEventSynchronize of an event recorded outside the capture",
            Box::new(|| d.event_synchronize(ctx, done)),
            "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
            "invalidated",
        ),
        (
            "cuEventRecord on another stream",
            Box::new(|| d.event_record(ctx, done, other)),
            "ok",
            "active",
        ),
        (
            "cuMemPoolGetAttribute in relaxed mode",
            Box::new(|| {
                relaxed(&|| {
                    d.mem_pool_usage(ctx, d.device_default_mem_pool(dev)?)
                        .map(drop)
                })
            }),
            "ok",
            "active",
        ),
        (
            "cuMemPoolSetAttribute",
            Box::new(|| d.mem_pool_set_release_threshold(ctx, d.device_default_mem_pool(dev)?, 0)),
            "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
            "invalidated",
        ),
        (
            "cuMemFree",
            // SAFETY: `spare` is this test's, used by no work, freed once (here or below).
            Box::new(|| unsafe { d.mem_free(ctx, spare.get()) }.map(|()| spare.set(DevicePtr(0)))),
            "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
            "invalidated",
        ),
        (
            "cuMemcpyHtoD",
            // SAFETY: into `buf`, this test's.
            Box::new(|| unsafe { d.memcpy_htod(ctx, buf, &[0u8; 4]) }),
            "ok",
            "active",
        ),
        (
            "cuMemPoolTrimTo",
            Box::new(|| d.mem_pool_trim_to(ctx, d.device_default_mem_pool(dev)?, 0)),
            "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
            "invalidated",
        ),
        (
            "cuMemAllocFromPoolAsync and cuMemFreeAsync on another stream",
            Box::new(|| {
                let p =
                    d.mem_alloc_from_pool_async(ctx, d.device_default_mem_pool(dev)?, 4096, other)?;
                // SAFETY: allocated just now, used by no work.
                unsafe { d.mem_free_async(ctx, p, other) }
            }),
            "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
            "invalidated",
        ),
        (
            "cuMemFreeAsync on the captured stream of memory allocated outside, in relaxed mode",
            // SAFETY: allocated above, used by no work; freed once (a refusal frees nothing).
            Box::new(|| relaxed(&|| unsafe { d.mem_free_async(ctx, outside, s) })),
            "CUDA_ERROR_INVALID_VALUE",
            "active",
        ),
        (
            "cuStreamQuery of the captured stream",
            Box::new(|| d.stream_query(ctx, s).map(drop)),
            "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
            "invalidated",
        ),
        (
            "cuStreamQuery of another stream",
            Box::new(|| d.stream_query(ctx, other).map(drop)),
            "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
            "invalidated",
        ),
        (
            "cuMemGetInfo",
            Box::new(|| d.mem_get_info(ctx).map(drop)),
            "ok",
            "active",
        ),
        (
            "cuStreamSynchronize of another stream",
            Box::new(|| d.stream_synchronize(ctx, other)),
            "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
            "invalidated",
        ),
        (
            "cuStreamSynchronize of the captured stream",
            Box::new(|| d.stream_synchronize(ctx, s)),
            "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
            "invalidated",
        ),
        (
            "cuMemAlloc",
            Box::new(|| {
                let p = d.mem_alloc(ctx, 1 << 20)?;
                // SAFETY: just allocated, unused.
                unsafe { d.mem_free(ctx, p) }
            }),
            "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
            "invalidated",
        ),
        (
            "cuMemAlloc in relaxed mode",
            Box::new(|| {
                let was = d.thread_exchange_capture_mode(CaptureMode::Relaxed)?;
                // SAFETY: just allocated, unused.
                let r = d
                    .mem_alloc(ctx, 1 << 20)
                    .and_then(|p| unsafe { d.mem_free(ctx, p) });
                d.thread_exchange_capture_mode(was)?;
                r
            }),
            "ok",
            "active",
        ),
        (
            "cuMemHostAlloc",
            Box::new(|| {
                let h = d.mem_host_alloc(ctx, 4096, 0)?;
                // SAFETY: just allocated, unused.
                unsafe { d.mem_free_host(ctx, h) }
            }),
            "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
            "invalidated",
        ),
        (
            "cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap",
            Box::new(|| {
                let gran = d.mem_vmm_granularity(dev)?;
                let va = d.mem_address_reserve(ctx, gran)?;
                let h = d.mem_create(ctx, dev, gran, false)?;
                // SAFETY: this probe's own reservation and memory, used by no work.
                unsafe {
                    d.mem_map(ctx, va, gran, h)?;
                    d.mem_set_access(ctx, va, gran, dev)?;
                    d.mem_unmap(ctx, va, gran)?;
                    d.mem_release(ctx, h)?;
                    d.mem_address_free(ctx, va, gran)
                }
            }),
            "ok",
            "active",
        ),
        (
            "cuMemAllocFromPoolAsync and cuMemFreeAsync on the captured stream",
            Box::new(|| {
                let p =
                    d.mem_alloc_from_pool_async(ctx, d.device_default_mem_pool(dev)?, 4096, s)?;
                // SAFETY: allocated in this capture, used by no work.
                unsafe { d.mem_free_async(ctx, p, s) }
            }),
            "ok",
            "active",
        ),
        (
            "cuMemFreeAsync of memory allocated outside the capture",
            // SAFETY: allocated above, used by no work; freed once (the refusal frees nothing).
            Box::new(|| unsafe { d.mem_free_async(ctx, outside, s) }),
            "CUDA_ERROR_INVALID_VALUE",
            "active",
        ),
        (
            "cuMemPoolGetAttribute",
            Box::new(|| {
                d.mem_pool_usage(ctx, d.device_default_mem_pool(dev)?)
                    .map(drop)
            }),
            "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
            "invalidated",
        ),
        (
            "cuEventQuery of an event recorded in the capture",
            Box::new(|| {
                let e = d.event_create(ctx, driver_sys::event_flags::DISABLE_TIMING)?;
                d.event_record(ctx, e, s)?;
                let r = d.event_query(ctx, e).map(drop);
                // SAFETY: made above, used by no later work.
                unsafe { d.event_destroy(ctx, e)? };
                r
            }),
            "CUDA_ERROR_CAPTURED_EVENT",
            "invalidated",
        ),
        // The trait's host functions run once; a graph would run one at every launch, so both
        // drivers refuse them on a captured stream, leaving the capture as it was.
        (
            "cuLaunchHostFunc on the captured stream",
            Box::new(|| d.launch_host_func(ctx, s, Box::new(|| {}))),
            "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
            "active",
        ),
    ];
    for (what, probe, expect, after) in &probes {
        d.stream_begin_capture(ctx, s, CaptureMode::Global)?;
        let got = outcome(&probe());
        rows.push((what, got, expect));
        let st = match status(s)? {
            CaptureStatus::Active { .. } => "active",
            CaptureStatus::Invalidated { .. } => "invalidated",
            CaptureStatus::None => "none",
        };
        rows.push((what, format!("capture {st}"), after_row(after)));
        match d.stream_end_capture(ctx, s) {
            // SAFETY: the graph just made, never instantiated.
            Ok(g) => unsafe { d.graph_destroy(ctx, g)? },
            Err(e) => rows.push((
                what,
                format!("end: {}", e.code_name()),
                "end: CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
            )),
        }
        ensure_eq!(status(s)?, CaptureStatus::None, "{what}: ended");
    }
    // SAFETY: allocated above, used by no work; the event by none either.
    unsafe {
        d.mem_free_async(ctx, outside, s)?;
        d.event_destroy(ctx, done)?;
        if spare.get() != DevicePtr(0) {
            raw.free(spare.get())?;
        }
    }

    // An IPC-enabled pool makes no graph memory.
    let ipc_pool = d.mem_pool_create(ctx, dev, true)?;
    d.stream_begin_capture(ctx, s, CaptureMode::Global)?;
    let from_ipc = d.mem_alloc_from_pool_async(ctx, ipc_pool, 4096, s);
    rows.push((
        "cuMemAllocFromPoolAsync from an IPC-enabled pool on the captured stream",
        outcome(&from_ipc),
        "CUDA_ERROR_NOT_SUPPORTED",
    ));
    let after = match status(s)? {
        CaptureStatus::Active { .. } => "capture active",
        CaptureStatus::Invalidated { .. } => "capture invalidated",
        CaptureStatus::None => "capture none",
    };
    rows.push((
        "cuMemAllocFromPoolAsync from an IPC-enabled pool on the captured stream",
        after.into(),
        "capture active",
    ));
    match d.stream_end_capture(ctx, s) {
        // SAFETY: the graph just made, never instantiated.
        Ok(g) => unsafe { d.graph_destroy(ctx, g)? },
        Err(e) => rows.push(("ending it", e.code_name().to_string(), "ok")),
    }
    // SAFETY: nothing was allocated from the pool.
    unsafe { d.mem_pool_destroy(ctx, ipc_pool)? };

    // 3. The legacy stream during the capture of a blocking stream.
    let pool0 = d.device_default_mem_pool(dev)?;
    d.stream_begin_capture(ctx, blocking, CaptureMode::Global)?;
    // SAFETY: see above.
    let legacy = unsafe { d.memset_d8_async(ctx, buf, 1, 16, StreamHandle::NULL) };
    rows.push((
        "work on the legacy stream while a blocking stream captures",
        outcome(&legacy),
        "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
    ));
    let ended = d.stream_end_capture(ctx, blocking);
    rows.push((
        "ending the blocking stream's capture after that",
        outcome(&ended),
        "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
    ));
    if let Ok(g) = ended {
        // SAFETY: the graph just made, never instantiated.
        unsafe { d.graph_destroy(ctx, g)? };
    }
    d.stream_begin_capture(ctx, blocking, CaptureMode::Global)?;
    let was = d.thread_exchange_capture_mode(CaptureMode::Relaxed)?;
    let legacy = d.mem_alloc_from_pool_async(ctx, pool0, 4096, StreamHandle::NULL);
    d.thread_exchange_capture_mode(was)?;
    rows.push((
        "cuMemAllocFromPoolAsync on the legacy stream in relaxed mode while a blocking stream \
         captures",
        outcome(&legacy),
        "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
    ));
    let ended = d.stream_end_capture(ctx, blocking);
    if let Ok(p) = legacy {
        // SAFETY: allocated just now, used by no work.
        unsafe { d.mem_free_async(ctx, p, StreamHandle::NULL)? };
    }
    rows.push((
        "ending the blocking stream's capture after that",
        outcome(&ended),
        "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
    ));
    if let Ok(g) = ended {
        // SAFETY: the graph just made, never instantiated.
        unsafe { d.graph_destroy(ctx, g)? };
    }

    // 4. Memory a capture allocates exists from the graph's launch: freeing it before the launch
    // is refused, after it allowed.
    let pool = d.device_default_mem_pool(dev)?;
    d.stream_begin_capture(ctx, s, CaptureMode::Global)?;
    let p = d.mem_alloc_from_pool_async(ctx, pool, 4096, s)?;
    // SAFETY: `p` is the capture's allocation, 4096 bytes.
    unsafe { d.memset_d8_async(ctx, p, 9, 4096, s)? };
    let g = d.stream_end_capture(ctx, s)?;
    let exec = d.graph_instantiate(ctx, g)?;
    // SAFETY: deliberately refused (the graph has not run): nothing is freed.
    let early = unsafe { d.mem_free_async(ctx, p, other) };
    rows.push((
        "cuMemFreeAsync of a capture's allocation before the launch",
        outcome(&early),
        "CUDA_ERROR_INVALID_VALUE",
    ));
    d.graph_launch(ctx, exec, s)?;
    d.stream_synchronize(ctx, s)?;
    let mut back = [0u8; 4];
    // SAFETY: `p` is live after the launch; 4 bytes of it.
    unsafe { d.memcpy_dtoh(ctx, &mut back, p)? };
    ensure_eq!(
        back,
        [9u8; 4],
        "the graph's allocation holds what the graph wrote"
    );
    rows.push((
        "cuGraphLaunch while the last launch's allocation is live",
        outcome(&d.graph_launch(ctx, exec, s)),
        "CUDA_ERROR_INVALID_VALUE",
    ));
    d.stream_synchronize(ctx, s)?;
    // SAFETY: live after the launch, used by no more work.
    let after = unsafe { d.mem_free_async(ctx, p, s) };
    rows.push((
        "cuMemFreeAsync of a capture's allocation after the launch",
        outcome(&after),
        "ok",
    ));
    d.stream_synchronize(ctx, s)?;
    // SAFETY: made above, used no more.
    unsafe {
        d.graph_exec_destroy(ctx, exec)?;
        d.graph_destroy(ctx, g)?;
    }

    // 5. A relaxed capture lets cuMemAlloc through.
    d.stream_begin_capture(ctx, s, CaptureMode::Relaxed)?;
    let q = d.mem_alloc(ctx, 4096);
    rows.push(("cuMemAlloc during a relaxed capture", outcome(&q), "ok"));
    let g = d.stream_end_capture(ctx, s)?;
    // SAFETY: unused graph and allocation.
    unsafe {
        d.graph_destroy(ctx, g)?;
        if let Ok(q) = q {
            d.mem_free(ctx, q)?;
        }
    }

    // SAFETY: this test's streams and buffer, with no work left queued.
    unsafe {
        d.stream_synchronize(ctx, StreamHandle::NULL)?;
        d.stream_destroy(ctx, s)?;
        d.stream_destroy(ctx, other)?;
        d.stream_destroy(ctx, blocking)?;
        raw.free(buf)?;
    }
    let wrong: Vec<String> = rows
        .iter()
        .filter(|(_, got, expect)| got != expect)
        .map(|(what, got, expect)| format!("{what}: got {got}, expected {expect}"))
        .collect();
    ensure!(
        wrong.is_empty(),
        "{} of {} capture facts differ:\n{}",
        wrong.len(),
        rows.len(),
        wrong.join("\n")
    );
    Ok(())
}

fn after_row(after: &str) -> &'static str {
    match after {
        "active" => "capture active",
        "invalidated" => "capture invalidated",
        _ => "capture none",
    }
}
