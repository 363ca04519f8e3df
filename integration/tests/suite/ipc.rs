//! Numba's `test_ipc.py`: handles exported here, opened in another process (a simulated one, or
//! a real child process on the GPU), directly and staged.

use emm::{EmmError, IpcHandle};
use integration::{
    IpcMode, MAPPED_CHILD_MARK, Target, TestCtx, export_pool_of, open_in_other_process,
    open_in_other_process_with, open_mapped_in_other_process,
};
use libtest_mimic::Failed;

fn arange(n: i64) -> Vec<u8> {
    (0..n).flat_map(|v| v.to_le_bytes()).collect()
}

/// Numba `test_ipc_handle`: the raw handle bytes and the size go to the other process, which
/// sees the same data.
pub fn test_ipc_handle(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let data = arange(10);
    let mem = ctx.to_device(&data)?;
    let handle = ctx.get_ipc_handle(&mem)?;
    ensure_eq!(handle.size(), 80);
    ensure_eq!(handle.offset(), 0);
    // Numba's child builds the handle from the 64 bytes and the size alone, without a source.
    let bare = IpcHandle::new(*handle.handle(), handle.size(), 0, None);
    let seen = open_in_other_process(&t, &bare.to_bytes(), IpcMode::Auto, 0)?;
    ensure_eq!(seen, data);
    Ok(())
}

/// The four slices Numba's IPC tests export (`variants()`), in elements of 8 bytes: the whole
/// array, `[3:]`, `[3:8]` and `[:8]`.
const SLICES: [(usize, usize); 4] = [(0, 10), (3, 10), (3, 8), (0, 8)];

/// Numba `test_ipc_handle_serialization`: for four slices, the handle survives the trip to
/// bytes and back (size, offset and handle equal; the memory stays behind), and the other
/// process sees exactly the slice.
pub fn test_ipc_handle_serialization(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let data = arange(10);
    let mem = ctx.to_device(&data)?;
    for (start, stop) in SLICES {
        let view = mem.view(start * 8, Some(stop * 8))?;
        let handle = ctx.get_ipc_handle(&view)?;
        ensure_eq!(
            handle.offset(),
            start * 8,
            "the offset is the view's start from the base"
        );
        let back = IpcHandle::from_bytes(&handle.to_bytes())?;
        ensure!(!back.is_exporter(), "the memory does not travel");
        ensure_eq!(back.size(), handle.size());
        ensure_eq!(back.offset(), handle.offset());
        ensure_eq!(back.handle(), handle.handle());
        ensure_eq!(back.source(), handle.source());
        let seen = open_in_other_process(&t, &handle.to_bytes(), IpcMode::Auto, 0)?;
        ensure_eq!(
            seen,
            data[start * 8..stop * 8].to_vec(),
            "slice {start}..{stop}"
        );
    }
    Ok(())
}

/// Numba `test_ipc_array`, for each of its four slices: in the exporting process opening is
/// refused, and closing what is not open is refused; in the other process exactly the slice
/// arrives and a second open is refused with "IpcHandle is already opened" (checked by the
/// other process).
pub fn test_ipc_array(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let data = arange(10);
    let mem = ctx.to_device(&data)?;
    for (start, stop) in SLICES {
        let view = mem.view(start * 8, Some(stop * 8))?;
        let mut expect = vec![0u8; view.size()];
        ctx.copy_to_host(&mut expect, &view)?;
        ensure_eq!(expect, data[start * 8..stop * 8].to_vec());
        check_ipc_array(&t, &ctx, &view, &expect).map_err(|e| {
            Failed::from(format!(
                "slice {start}..{stop}: {}",
                e.message().unwrap_or("failed")
            ))
        })?;
    }
    Ok(())
}

/// Handles of overlapping views of one allocation, opened together in one other process:
/// closing one leaves the others' memory in place (beyond Numba, which opens one handle per
/// process in its tests). The driver counts repeated `cuIpcOpenMemHandle`s of one allocation;
/// it does not count repeated `cuMemPoolImportPointer`s (one free unmaps, measured on an
/// H100), so emm counts those.
pub fn test_ipc_overlapping_views(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let data = arange(10);
    let mem = ctx.to_device(&data)?;
    let mut handles = Vec::new();
    let mut expect = Vec::new();
    for (start, stop) in SLICES {
        let view = mem.view(start * 8, Some(stop * 8))?;
        handles.push(ctx.get_ipc_handle(&view)?.to_bytes());
        expect.extend_from_slice(&data[start * 8..stop * 8]);
    }
    let seen = integration::open_many_in_other_process(&t, &handles)?;
    ensure_eq!(seen, expect);
    Ok(())
}

fn check_ipc_array(
    t: &TestCtx,
    ctx: &emm::Context,
    mem: &emm::MemoryPointer,
    data: &[u8],
) -> Result<(), Failed> {
    let handle = ctx.get_ipc_handle(mem)?;
    ensure!(handle.is_exporter());
    match handle.open(&t.runtime, ctx) {
        Err(e @ EmmError::Ipc { .. }) => {
            ensure!(
                e.to_string()
                    .starts_with("opening IpcHandle from original process"),
                "{e}"
            )
        }
        other => return Err(format!("opening in the exporting process: {other:?}").into()),
    }
    match handle.close() {
        Err(e) => ensure!(e.to_string().starts_with("IpcHandle not opened"), "{e}"),
        Ok(()) => return Err("closing an unopened handle succeeded".into()),
    }
    let seen = open_in_other_process(t, &handle.to_bytes(), IpcMode::Auto, 0)?;
    ensure_eq!(seen, data.to_vec());
    Ok(())
}

/// Numba `TestIpcStaged.test_staged`: for every device, the other process opens through the
/// staged path (forced, since the devices may be peers) and gets the data; the staged copy is
/// its own memory.
pub fn test_staged(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let data = arange(10);
    let mem = ctx.to_device(&data)?;
    let view = mem.view(16, Some(64))?;
    let handle = ctx.get_ipc_handle(&view)?;
    let bytes = handle.to_bytes();
    for device in 0..t.runtime.device_count()? {
        let seen = open_in_other_process(&t, &bytes, IpcMode::Staged, device)?;
        ensure_eq!(
            seen,
            data[16..64].to_vec(),
            "staged through device {device}"
        );
    }
    Ok(())
}

/// Numba `TestIpcStaged.test_ipc_array`: for every device, a new array is exported whole and
/// the other process opens it through the staged path on that device (forced, since the
/// devices may be peers), and gets exactly its data.
pub fn test_ipc_array_staged(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    for device in 0..t.runtime.device_count()? {
        // Numba's array is `np.random.random(10)`: ten f64 values that differ per device.
        let data: Vec<u8> = (0..10u32)
            .flat_map(|i| (f64::from(i) * 0.37 + f64::from(device) * 11.0).to_le_bytes())
            .collect();
        let mem = ctx.to_device(&data)?;
        let handle = ctx.get_ipc_handle(&mem)?;
        let seen = open_in_other_process(&t, &handle.to_bytes(), IpcMode::Staged, device)?;
        ensure_eq!(seen, data, "staged through device {device}");
    }
    Ok(())
}

/// A staged open without a source device is refused with Numba's text; garbled bytes are a
/// clear error.
pub fn ipc_handle_errors(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let mem = ctx.to_device(&[1u8; 8])?;
    let handle = ctx.get_ipc_handle(&mem)?;
    let bare = IpcHandle::new(*handle.handle(), 8, 0, None);
    match bare.open_staged(&t.runtime, &ctx) {
        Err(e) => ensure!(
            e.to_string()
                .starts_with("IPC handle doesn't have source info"),
            "{e}"
        ),
        Ok(_) => return Err("a staged open without a source succeeded".into()),
    }
    let mut bytes = handle.to_bytes();
    bytes.truncate(50);
    let e = IpcHandle::from_bytes(&bytes).expect_err("truncated");
    ensure!(e.to_string().contains("50 bytes instead of 118"), "{e}");
    let mut bytes = handle.to_bytes();
    bytes[6] = 9;
    let e = IpcHandle::from_bytes(&bytes).expect_err("other version");
    ensure!(e.to_string().contains("format version 9"), "{e}");
    Ok(())
}

/// Pool export under every manager. `async-pool-ipc`: the export names this device; a handle
/// opens in a process that imported the pool and in no other (a clear error naming
/// `Runtime::import_pool`); after a reset the pool is new, so a handle of the old pool is
/// refused even by a process that imported the new one, and handles of the new pool open.
/// Every other manager refuses `export_pool` with advice naming `async-pool-ipc`, and
/// `async-pool` refuses `get_ipc_handle` the same way.
pub fn pool_export_per_manager(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let data = arange(64);
    let mem = ctx.to_device(&data)?;
    if ctx.memory_manager_name() != emm::plugin::ASYNC_POOL_IPC_MANAGER {
        let e = ctx
            .export_pool()
            .expect_err("only async-pool-ipc exports a pool");
        ensure!(matches!(e, EmmError::NotSupported { .. }), "{e:?}");
        ensure!(e.to_string().contains("async-pool-ipc"), "{e}");
        if ctx.memory_manager_name() == emm::plugin::ASYNC_POOL_MANAGER {
            let e = ctx
                .get_ipc_handle(&mem)
                .expect_err("async-pool exports no memory");
            ensure!(matches!(e, EmmError::NotSupported { .. }), "{e:?}");
            ensure!(e.to_string().contains("async-pool-ipc"), "{e}");
        }
        return Ok(());
    }
    let export = ctx.export_pool()?;
    ensure_eq!(export.source(), ctx.device_identity()?);
    let view = mem.view(8, Some(200))?;
    let handle = ctx.get_ipc_handle(&view)?;
    ensure!(
        matches!(handle.handle(), emm::contract::IpcMemory::PoolAllocation { pool, .. } if *pool == export.id()),
        "the handle names the exported pool: {handle:?}"
    );
    ensure_eq!(handle.offset(), 8);
    let bytes = handle.to_bytes();
    // Not imported: refused, with what to do.
    match open_in_other_process_with(&t, &bytes, IpcMode::Auto, 0, None) {
        Err(e) => ensure!(
            e.contains("has not imported") && e.contains("Runtime::import_pool"),
            "{e}"
        ),
        Ok(_) => return Err("a pool handle opened without its pool".into()),
    }
    let seen = open_in_other_process_with(&t, &bytes, IpcMode::Auto, 0, Some(export))?;
    ensure_eq!(seen, data[8..200].to_vec());
    // A reset makes a new pool: the old handle is refused by a process that imported it.
    drop(handle);
    drop((view, mem));
    ctx.reset()?;
    let ctx = t.context()?;
    let fresh = ctx.export_pool()?;
    match open_in_other_process_with(&t, &bytes, IpcMode::Auto, 0, Some(fresh)) {
        Err(e) => ensure!(e.contains("has not imported"), "{e}"),
        Ok(_) => return Err("a handle of the pool before the reset opened".into()),
    }
    let mem = ctx.to_device(&data)?;
    let handle = ctx.get_ipc_handle(&mem)?;
    let export = export_pool_of(&t, &handle)?;
    let seen =
        open_in_other_process_with(&t, &handle.to_bytes(), IpcMode::Staged, 0, Some(export))?;
    ensure_eq!(seen, data);
    Ok(())
}

/// Mapped export under every manager. `vmm-pool`: a view of memory allocated to share
/// (`memalloc_shared`, physical memory of its own) is exported as a file descriptor, sent over
/// a Unix socket and mapped by the other process, which reads exactly the view's bytes; its
/// write lands in the exporter's memory. The pool's own blocks are refused for export (their
/// physical memory holds other allocations). Every other manager refuses `memalloc_shared` and
/// `export_mapped` with advice naming `get_ipc_handle`.
pub fn mapped_export_per_manager(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    if ctx.memory_manager_name() != emm::plugin::VMM_POOL_MANAGER {
        let mem = ctx.to_device(&arange(64))?;
        let e = ctx
            .export_mapped(&mem)
            .expect_err("only vmm-pool exports mapped memory");
        ensure!(matches!(e, EmmError::NotSupported { .. }), "{e:?}");
        ensure!(e.to_string().contains("get_ipc_handle"), "{e}");
        let e = ctx
            .memalloc_shared(64)
            .expect_err("only vmm-pool allocates memory to share");
        ensure!(e.to_string().contains("get_ipc_handle"), "{e}");
        return Ok(());
    }
    let pooled = ctx.memalloc(1 << 20)?;
    let e = ctx
        .export_mapped(&pooled)
        .expect_err("a pool block shares its physical memory");
    ensure!(e.to_string().contains("memalloc_shared"), "{e}");
    let size = 100 << 20;
    let big = ctx.memalloc_shared(size)?;
    let data: Vec<u8> = (0..size).map(|i| (i % 253) as u8).collect();
    ctx.copy_to_device(&big, &data)?;
    let (start, stop) = (4096, size - 8192);
    let export = ctx.export_mapped(&big.view(start, Some(stop))?)?;
    ensure_eq!(
        export.pieces().len(),
        1,
        "the allocation's own physical memory"
    );
    ensure_eq!(export.size(), stop - start);
    ensure_eq!(export.source(), ctx.device_identity()?);
    let seen = open_mapped_in_other_process(&t, export)?;
    ensure!(
        seen == data[start..stop],
        "the other process read other bytes"
    );
    let mut back = vec![0u8; 32];
    ctx.copy_to_host(&mut back, &big.view(start, Some(start + 32))?)?;
    ensure_eq!(
        &back[..16],
        &[MAPPED_CHILD_MARK; 16][..],
        "the other process's write"
    );
    ensure_eq!(&back[16..], &data[start + 16..start + 32]);
    Ok(())
}
