//! Driver conformance of page-locked host memory, IPC handles, peers, exported and imported
//! pools, and physical memory shared as file descriptors.
#![allow(unsafe_code)]

use super::*;

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
