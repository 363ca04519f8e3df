//! IPC across processes: the child processes the suite and the examples start (emm's
//! opens, the raw driver's imports, pools sent over a Unix socket), and how their results
//! come back.

use std::sync::Arc;

use driver_mock::SimDriver;
use driver_sys::{DeviceOrdinal, Driver, DriverError};
use emm::Runtime;

use crate::setup::{Target, TestCtx, make_driver};

/// How the other process opens an IPC handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IpcMode {
    /// `IpcHandle::open`: direct or staged, as peer access decides.
    Auto,
    /// `IpcHandle::open_staged`: forced through the source device.
    Staged,
}

impl IpcMode {
    fn name(self) -> &'static str {
        match self {
            IpcMode::Auto => "auto",
            IpcMode::Staged => "staged",
        }
    }
}

/// What the other process does with an IPC handle: builds its own runtime on `driver`,
/// imports the handle's stream-ordered pool if one came (`pool`), opens the handle in device
/// `device`'s context, reads the exported bytes, checks that opening again is refused with
/// Numba's text, closes it, and checks that a direct mapping is stale after the close. Returns
/// the bytes read.
pub fn ipc_child(
    driver: Arc<dyn Driver>,
    bytes: &[u8],
    mode: IpcMode,
    device: u32,
    pool: Option<emm::contract::PoolExport>,
) -> Result<Vec<u8>, String> {
    let rt = child_runtime(driver, pool)?;
    let ctx = rt.context(device).map_err(|e| e.to_string())?;
    let handle = emm::IpcHandle::from_bytes(bytes).map_err(|e| e.to_string())?;
    if handle.is_exporter() {
        return Err("a handle rebuilt from bytes must not be the exporter's".into());
    }
    let mem = match mode {
        IpcMode::Auto => handle.open(&rt, &ctx),
        IpcMode::Staged => handle.open_staged(&rt, &ctx),
    }
    .map_err(|e| format!("open ({}): {e}", mode.name()))?;
    if mem.size() != handle.size() {
        return Err(format!(
            "opened {} bytes, the handle says {}",
            mem.size(),
            handle.size()
        ));
    }
    let mut data = vec![0u8; mem.size()];
    ctx.copy_to_host(&mut data, &mem)
        .map_err(|e| format!("reading the opened memory: {e}"))?;
    match handle.open(&rt, &ctx) {
        Err(e) if e.to_string().contains("IpcHandle is already opened") => {}
        Err(e) => return Err(format!("reopening gave the wrong error: {e}")),
        Ok(_) => return Err("reopening an open handle succeeded".into()),
    }
    let staged = !mem.is_ipc_mapping();
    if mode == IpcMode::Staged && !staged {
        return Err("a forced staged open returned a mapping".into());
    }
    handle.close().map_err(|e| format!("close: {e}"))?;
    let mut again = vec![0u8; data.len()];
    let after = ctx.copy_to_host(&mut again, &mem);
    match (staged, after) {
        (false, Err(emm::EmmError::Stale { .. })) => {}
        (false, other) => {
            return Err(format!(
                "a closed direct mapping must be stale, got {other:?}"
            ));
        }
        (true, Ok(())) if again == data => {}
        (true, other) => {
            return Err(format!(
                "a staged copy must outlive the close, got {other:?}"
            ));
        }
    }
    match handle.close() {
        Err(e) if e.to_string().contains("IpcHandle not opened") => {}
        other => {
            return Err(format!(
                "closing twice: expected 'IpcHandle not opened', got {other:?}"
            ));
        }
    }
    Ok(data)
}

/// The variable that makes the suite binary act as the other process of an IPC test.
pub const IPC_CHILD_ENV: &str = "EMM_IPC_CHILD";

/// The variable that makes the suite binary the other process of [`ipc_child_many`]: a
/// comma-separated list of handles (hex).
pub const IPC_CHILD_MANY_ENV: &str = "EMM_IPC_CHILD_MANY";

/// The runtime of an IPC test's other process, with `pool` (if any) imported.
fn child_runtime(
    driver: Arc<dyn Driver>,
    pool: Option<emm::contract::PoolExport>,
) -> Result<Runtime, String> {
    let rt = Runtime::builder(driver)
        .ignore_env()
        .build()
        .map_err(|e| e.to_string())?;
    if let Some(export) = pool {
        let id = export.id();
        rt.import_pool(export)
            .map_err(|e| format!("import_pool: {e}"))?;
        // cuda.core's view of the same import: a mapped resource, found by the pool's id.
        let mapped = rt
            .imported_memory_resource(id)
            .ok_or_else(|| format!("pool {id} imported but not registered by its id"))?;
        if !mapped.is_mapped() || mapped.is_handle_owned() {
            return Err(format!(
                "the resource over imported pool {id} must be mapped, not owned"
            ));
        }
    }
    Ok(rt)
}

/// The other process of an IPC test with several handles that may name the same allocation
/// (views of one array): opens every handle on device 0 (after importing `pool`, if any) and
/// reads it, then closes them in order and, after each close, reads every handle still open
/// again: closing one must not take the memory from under another. Returns the first reads,
/// one after another.
pub fn ipc_child_many(
    driver: Arc<dyn Driver>,
    handles: &[Vec<u8>],
    pool: Option<emm::contract::PoolExport>,
) -> Result<Vec<u8>, String> {
    let rt = child_runtime(driver, pool)?;
    let ctx = rt.context(0).map_err(|e| e.to_string())?;
    let mut open = Vec::new();
    for (i, bytes) in handles.iter().enumerate() {
        let handle = emm::IpcHandle::from_bytes(bytes).map_err(|e| e.to_string())?;
        let mem = handle
            .open(&rt, &ctx)
            .map_err(|e| format!("opening handle {i}: {e}"))?;
        let mut data = vec![0u8; mem.size()];
        ctx.copy_to_host(&mut data, &mem)
            .map_err(|e| format!("reading handle {i}: {e}"))?;
        open.push((handle, mem, data));
    }
    let first: Vec<u8> = open.iter().flat_map(|(_, _, d)| d.clone()).collect();
    for closed in 0..open.len() {
        open[closed]
            .0
            .close()
            .map_err(|e| format!("closing handle {closed}: {e}"))?;
        for (i, (_, mem, data)) in open.iter().enumerate().skip(closed + 1) {
            let mut again = vec![0u8; data.len()];
            ctx.copy_to_host(&mut again, mem)
                .map_err(|e| format!("reading handle {i} after closing handle {closed}: {e}"))?;
            if &again != data {
                return Err(format!(
                    "handle {i} reads other bytes after closing handle {closed}"
                ));
            }
        }
    }
    Ok(first)
}

/// Runs [`ipc_child_many`] on `t`'s other process (as [`open_in_other_process`] does for one
/// handle), sending the pool of the first handle when it names pool memory.
pub fn open_many_in_other_process(t: &TestCtx, handles: &[Vec<u8>]) -> Result<Vec<u8>, String> {
    let first = emm::IpcHandle::from_bytes(handles.first().ok_or("no handles")?)
        .map_err(|e| e.to_string())?;
    let pool = match first.handle() {
        emm::contract::IpcMemory::PoolAllocation { .. } => Some(export_pool_of(t, &first)?),
        emm::contract::IpcMemory::Allocation(_) => None,
    };
    match &t.sim {
        Some(sim) => in_sim_process(sim, |other| ipc_child_many(other, handles, pool)),
        None => {
            let list: Vec<String> = handles.iter().map(|h| hex(h)).collect();
            spawn_child(
                &[(IPC_CHILD_MANY_ENV, list.join(","))],
                pool.as_ref().map(Outgoing::Pool),
            )
        }
    }
}

/// The variable that makes this executable the other process of [`time_staged_opens`]: a
/// comma-separated list of handles (hex); `EMM_IPC_DEVICE` names the device to open them on,
/// `EMM_IPC_REPS` how many timed opens each gets.
pub const IPC_STAGED_TIMING_ENV: &str = "EMM_IPC_STAGED_TIMING";

/// The other process of [`time_staged_opens`]: on a runtime of its own (the `default`
/// manager), opens each handle staged on `device` once to warm up and then `reps` times (the
/// open, which maps the handle in the source device's context, allocates on `device` and copies,
/// then a synchronisation of `device`'s context, all timed; then the close and the drop), and
/// returns each handle's median in nanoseconds, as the text `ns,ns,...`.
fn staged_open_times(
    driver: Arc<dyn Driver>,
    handles: &[Vec<u8>],
    device: u32,
    reps: usize,
) -> Result<Vec<u8>, String> {
    let rt = child_runtime(Arc::clone(&driver), None)?;
    let ctx = rt.context(device).map_err(|e| e.to_string())?;
    let mut medians = Vec::with_capacity(handles.len());
    for (i, bytes) in handles.iter().enumerate() {
        let handle = emm::IpcHandle::from_bytes(bytes).map_err(|e| e.to_string())?;
        let mut times = Vec::with_capacity(reps);
        for rep in 0..=reps.max(1) {
            let start = std::time::Instant::now();
            let mem = handle
                .open_staged(&rt, &ctx)
                .map_err(|e| format!("staged open of handle {i}: {e}"))?;
            // The device-to-device copy returns before it finishes.
            driver
                .stream_synchronize(ctx.handle(), driver_sys::StreamHandle::LEGACY)
                .map_err(|e| format!("synchronising device {device}: {e}"))?;
            let ns = start.elapsed().as_nanos() as f64;
            handle
                .close()
                .map_err(|e| format!("closing handle {i}: {e}"))?;
            drop(mem);
            if rep > 0 {
                times.push(ns);
            }
        }
        times.sort_by(f64::total_cmp);
        medians.push(format!("{:.0}", times[times.len() / 2]));
    }
    Ok(medians.join(",").into_bytes())
}

/// Times staged opens of `handles` (exported by this process) in another process on device
/// `device`: a process of the simulated machine `sim`, or on the GPU this executable re-run
/// with [`IPC_STAGED_TIMING_ENV`] set (its `main` must call [`run_ipc_child_if_requested`]
/// first). Returns the median nanoseconds of each handle's `reps` opens.
pub fn time_staged_opens(
    sim: Option<&Arc<SimDriver>>,
    handles: &[Vec<u8>],
    device: u32,
    reps: usize,
) -> Result<Vec<f64>, String> {
    let text = match sim {
        Some(sim) => in_sim_process(sim, |other| staged_open_times(other, handles, device, reps))?,
        None => {
            let list: Vec<String> = handles.iter().map(|h| hex(h)).collect();
            spawn_child(
                &[
                    (IPC_STAGED_TIMING_ENV, list.join(",")),
                    ("EMM_IPC_DEVICE", device.to_string()),
                    ("EMM_IPC_REPS", reps.to_string()),
                ],
                None,
            )?
        }
    };
    String::from_utf8_lossy(&text)
        .split(',')
        .map(|v| {
            v.parse()
                .map_err(|e| format!("the timing child reported {v:?}: {e}"))
        })
        .collect()
}

/// The variable that makes the suite binary a raw importer of one `cuIpcGetMemHandle` handle
/// (hex) for the IPC conformance test; `EMM_RAW_IPC_SIZE` gives the exported size.
pub const RAW_IPC_CHILD_ENV: &str = "EMM_RAW_IPC_CHILD";

/// The importing side of the IPC conformance test, with bare driver calls on device 0: the
/// pattern `0, 1, 2, ...` (bytes modulo 251) of an allocation of `size` bytes another process
/// exported as `handle` is seen through the mapping; a second open in the same context returns
/// the same address (the driver counts the opens), and one close leaves it mapped, the second
/// unmaps it, a third is `CUDA_ERROR_INVALID_VALUE`; `cuMemGetAddressRange` of the mapping
/// gives its base and at least the exported size.
pub fn raw_ipc_importer(driver: &dyn Driver, handle: &[u8], size: usize) -> Result<(), String> {
    use driver_sys::{DeviceOrdinal, ErrorKind, IpcMemHandle};
    let h = IpcMemHandle(
        handle
            .try_into()
            .map_err(|_| format!("a handle of {} bytes, not 64", handle.len()))?,
    );
    let e = |what: &str| {
        let what = what.to_owned();
        move |err: DriverError| format!("{what}: {err}")
    };
    driver.init().map_err(e("cuInit"))?;
    let dev = DeviceOrdinal(0);
    let ctx = driver.primary_ctx_retain(dev).map_err(e("retain"))?;
    let steps = (|| -> Result<(), String> {
        let a = driver
            .ipc_open_mem_handle(ctx, &h)
            .map_err(e("first open"))?;
        let b = driver
            .ipc_open_mem_handle(ctx, &h)
            .map_err(e("second open"))?;
        if a != b {
            return Err(format!("a second open mapped {b}, the first {a}"));
        }
        let (base, mapped) = driver
            .mem_get_address_range(ctx, a)
            .map_err(e("cuMemGetAddressRange of the mapping"))?;
        if base != a || mapped < size {
            return Err(format!(
                "the mapping's range is {base} + {mapped}, opened at {a} for {size} bytes"
            ));
        }
        let expect: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
        let read = |what: &str| -> Result<(), String> {
            let mut seen = vec![0u8; size];
            // SAFETY: `a .. a + size` is the open mapping of the exporter's allocation, which
            // the exporter keeps and does not write while this process runs.
            unsafe { driver.memcpy_dtoh(ctx, &mut seen, a) }.map_err(e(what))?;
            if seen != expect {
                return Err(format!("{what}: not the exported bytes"));
            }
            Ok(())
        };
        read("reading through the mapping")?;
        // SAFETY: opened twice above; this close undoes one open, the mapping stays.
        unsafe { driver.ipc_close_mem_handle(ctx, a) }.map_err(e("first close"))?;
        read("reading after one of two closes")?;
        // SAFETY: the second close undoes the last open; nothing reads the mapping afterwards.
        unsafe { driver.ipc_close_mem_handle(ctx, a) }.map_err(e("second close"))?;
        // SAFETY: not mapped any more; the driver must refuse.
        match unsafe { driver.ipc_close_mem_handle(ctx, a) } {
            Err(err) if err.kind() == ErrorKind::InvalidValue => Ok(()),
            other => Err(format!(
                "a third close: expected InvalidValue, got {other:?}"
            )),
        }
    })();
    // SAFETY: matches the retain above, whatever the steps found.
    let released = unsafe { driver.primary_ctx_release(dev) }.map_err(e("release"));
    steps.and(released)
}

/// Runs [`raw_ipc_importer`] in another process: a simulated one, or on the GPU a real child
/// process (this executable, re-run with [`RAW_IPC_CHILD_ENV`] set).
pub fn raw_ipc_import_in_other_process(
    sim: Option<&Arc<SimDriver>>,
    handle: &[u8],
    size: usize,
) -> Result<(), String> {
    match sim {
        Some(sim) => in_sim_process(sim, |other| {
            raw_ipc_importer(&*other, handle, size).map(|()| Vec::new())
        }),
        None => spawn_child(
            &[
                (RAW_IPC_CHILD_ENV, hex(handle)),
                ("EMM_RAW_IPC_SIZE", size.to_string()),
            ],
            None,
        ),
    }
    .map(drop)
}

/// The variable that starts this executable as the importer of [`raw_pool_importer`]; its
/// value is the hex of an emm handle of pool memory.
pub const RAW_POOL_CHILD_ENV: &str = "EMM_RAW_POOL_CHILD";

/// The pattern [`raw_pool_importer`] writes through its imported pointer, for the exporter to
/// read back.
pub fn importer_pattern(size: usize) -> Vec<u8> {
    (0..size).map(|i| (i % 253) as u8 ^ 0x5a).collect()
}

/// The importing side of a stream-ordered pool, with raw driver calls: imports the pool from
/// `fd` and the allocation `data` names (of `size` bytes, holding the suite's pattern
/// `i % 251`), and reports what the driver did as one line of `name=value` facts (the
/// conformance test compares them): whether the importing device may access the imported
/// pool, what allocating from it gives, whether the exporter's bytes read back, what a second
/// import of the same allocation gives, and what a second free of the imported pointer gives.
/// Before returning it writes [`importer_pattern`] through the pointer, frees it (and waits),
/// destroys the imported pool and releases its context.
pub fn raw_pool_importer(
    driver: &dyn Driver,
    fd: std::os::fd::BorrowedFd<'_>,
    data: &driver_sys::PoolPtrExportData,
    size: usize,
) -> Result<String, String> {
    use driver_sys::StreamHandle;
    let e = |what: &'static str| move |err: DriverError| format!("{what}: {err}");
    let kind = |r: Result<(), DriverError>| match r {
        Ok(()) => "ok".to_owned(),
        Err(err) => format!("{:?}", err.kind()),
    };
    let s0 = StreamHandle::NULL;
    driver.init().map_err(e("cuInit"))?;
    let dev = DeviceOrdinal(0);
    let ctx = driver.primary_ctx_retain(dev).map_err(e("retain"))?;
    let steps = (|| -> Result<String, String> {
        let pool = driver
            .mem_pool_import_fd(ctx, fd)
            .map_err(e("cuMemPoolImportFromShareableHandle"))?;
        let mut facts = Vec::new();
        let inner = (|| -> Result<(), String> {
            let access = driver
                .mem_pool_can_access(ctx, pool, dev)
                .map_err(e("cuMemPoolGetAccess"))?;
            facts.push(format!("access={access}"));
            let alloc = driver.mem_alloc_from_pool_async(ctx, pool, 4096, s0);
            if let Ok(p) = &alloc {
                // SAFETY: allocated just above, freed once; nothing uses it.
                unsafe { driver.mem_free_async(ctx, *p, s0) }.map_err(e("cuMemFreeAsync"))?;
            }
            facts.push(format!("alloc={}", kind(alloc.map(drop))));
            let p = driver
                .mem_pool_import_pointer(ctx, pool, data)
                .map_err(e("cuMemPoolImportPointer"))?;
            let mut seen = vec![0u8; size];
            // SAFETY: `p .. p + size` is the imported allocation, which the exporter keeps
            // and does not touch while this process runs.
            unsafe { driver.memcpy_dtoh(ctx, &mut seen, p) }.map_err(e("reading"))?;
            let expect: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
            facts.push(format!("read={}", seen == expect));
            let again = driver.mem_pool_import_pointer(ctx, pool, data);
            facts.push(format!(
                "reimport={}",
                match &again {
                    Ok(q) if *q == p => "same".to_owned(),
                    Ok(_) => "other".to_owned(),
                    Err(err) => format!("{:?}", err.kind()),
                }
            ));
            if let Ok(q) = again
                && q != p
            {
                // SAFETY: a second mapping of its own, freed once, unused.
                unsafe { driver.mem_free_async(ctx, q, s0) }.map_err(e("cuMemFreeAsync"))?;
            }
            // SAFETY: as for the read; the exporter reads these bytes only after this process
            // has ended.
            unsafe { driver.memcpy_htod(ctx, p, &importer_pattern(size)) }.map_err(e("writing"))?;
            // SAFETY: the imported pointer, freed once, then never used.
            unsafe { driver.mem_free_async(ctx, p, s0) }.map_err(e("cuMemFreeAsync"))?;
            driver
                .stream_synchronize(ctx, s0)
                .map_err(e("cuStreamSynchronize"))?;
            // SAFETY: freed just above; the driver must refuse a second free.
            let again = unsafe { driver.mem_free_async(ctx, p, s0) };
            facts.push(format!("second_free={}", kind(again)));
            Ok(())
        })();
        // SAFETY: the imported pool, destroyed once; its one imported pointer was freed.
        let destroyed = unsafe { driver.mem_pool_destroy(ctx, pool) };
        inner?;
        destroyed.map_err(e("cuMemPoolDestroy"))?;
        Ok(facts.join(" "))
    })();
    // SAFETY: matches the retain above, whatever the steps found.
    let released = unsafe { driver.primary_ctx_release(dev) }.map_err(e("release"));
    steps.and_then(|facts| released.map(|()| facts))
}

/// Runs [`raw_pool_importer`] on `target`'s other process for the pool allocation `handle`
/// names (emm's handle bytes), sending it `export`; returns its facts line.
pub fn raw_pool_import_in_other_process(
    sim: Option<&Arc<SimDriver>>,
    handle: &[u8],
    export: &emm::contract::PoolExport,
) -> Result<String, String> {
    let parsed = emm::IpcHandle::from_bytes(handle).map_err(|e| e.to_string())?;
    let emm::contract::IpcMemory::PoolAllocation { data, .. } = parsed.handle() else {
        return Err("not a handle of pool memory".into());
    };
    let bytes = match sim {
        Some(sim) => in_sim_process(sim, |other| {
            raw_pool_importer(&*other, export.fd(), data, parsed.size()).map(String::into_bytes)
        })?,
        None => spawn_child(
            &[(RAW_POOL_CHILD_ENV, hex(handle))],
            Some(Outgoing::Pool(export)),
        )?,
    };
    String::from_utf8(bytes).map_err(|e| e.to_string())
}

/// Fills the device through `alloc` (`cuMemAlloc`, or a pool's allocation) in ever smaller
/// pieces (1 GiB, 64 MiB, 2 MiB), each until it is out of memory. Returns what it took, to be
/// freed by the caller, and the first error other than out-of-memory, which ends the fill.
pub fn fill_device(
    mut alloc: impl FnMut(usize) -> Result<driver_sys::DevicePtr, DriverError>,
) -> (Vec<driver_sys::DevicePtr>, Result<(), DriverError>) {
    let mut held = Vec::new();
    for chunk in [1usize << 30, 64 << 20, 2 << 20] {
        loop {
            match alloc(chunk) {
                Ok(p) => held.push(p),
                Err(e) if e.kind() == driver_sys::ErrorKind::OutOfMemory => break,
                Err(e) => return (held, Err(e)),
            }
        }
    }
    (held, Ok(()))
}

/// The variable that tells the IPC child where to receive a pool export (a Unix socket path).
const IPC_POOL_SOCKET_ENV: &str = "EMM_IPC_POOL_SOCKET";

/// The variable that makes the suite binary the other process of [`mapped_child`]: it
/// receives a mapped export over the socket [`IPC_POOL_SOCKET_ENV`] names.
const IPC_MAPPED_CHILD_ENV: &str = "EMM_IPC_MAPPED_CHILD";

/// What a test sends its child process over the socket.
enum Outgoing<'a> {
    Pool(&'a emm::contract::PoolExport),
    Mapped(&'a emm::contract::MappedExport),
}

/// The byte the other process of [`mapped_child`] writes over the first 16 bytes it opened.
pub const MAPPED_CHILD_MARK: u8 = 0xa5;

/// What the other process does with a mapped export (`vmm-pool` memory as file descriptors):
/// builds its own runtime on `driver`, opens the export in the context of its source device,
/// checks the size, reads the bytes, writes [`MAPPED_CHILD_MARK`] over the first 16 of them
/// (the exporter then sees the write) and drops the mapping. Returns the bytes read.
pub fn mapped_child(
    driver: Arc<dyn Driver>,
    export: emm::contract::MappedExport,
) -> Result<Vec<u8>, String> {
    let rt = child_runtime(driver, None)?;
    let device = rt
        .device_with_identity(&export.source())
        .map_err(|e| e.to_string())?;
    let ctx = rt.context(device).map_err(|e| e.to_string())?;
    let size = export.size();
    let mem = ctx
        .open_mapped(export)
        .map_err(|e| format!("open_mapped: {e}"))?;
    if mem.size() != size {
        return Err(format!(
            "opened {} bytes, the export says {size}",
            mem.size()
        ));
    }
    let mut data = vec![0u8; size];
    ctx.copy_to_host(&mut data, &mem)
        .map_err(|e| format!("reading the opened memory: {e}"))?;
    let mark = mem.view(0, Some(size.min(16))).map_err(|e| e.to_string())?;
    ctx.copy_to_device(&mark, &vec![MAPPED_CHILD_MARK; mark.size()])
        .map_err(|e| format!("writing the opened memory: {e}"))?;
    drop((mark, mem));
    Ok(data)
}

/// Runs [`mapped_child`] on `target`'s other process (a simulated one, or this executable run
/// again as a real child, which receives the export over a Unix socket); returns the bytes it
/// read.
pub fn open_mapped_in_other_process(
    t: &TestCtx,
    export: emm::contract::MappedExport,
) -> Result<Vec<u8>, String> {
    match &t.sim {
        Some(sim) => {
            // Across a socket, as between real processes.
            let (a, b) = std::os::unix::net::UnixStream::pair().map_err(|e| e.to_string())?;
            export.send(&a).map_err(|e| e.to_string())?;
            drop(export);
            let received = emm::contract::MappedExport::receive(&b).map_err(|e| e.to_string())?;
            in_sim_process(sim, |other| mapped_child(other, received))
        }
        None => spawn_child(
            &[(IPC_MAPPED_CHILD_ENV, "1".to_owned())],
            Some(Outgoing::Mapped(&export)),
        ),
    }
}

/// Runs [`ipc_child`] on `target`'s other process: a process spawned on the simulated machine,
/// or on the GPU a real child process (this executable, re-run with [`IPC_CHILD_ENV`] set; its
/// `main` must call [`run_ipc_child_if_requested`] first). A handle of stream-ordered pool
/// memory takes its pool along: the exporting context exports it, and a real child receives
/// it over a Unix socket ([`emm::contract::PoolExport::send`]).
pub fn open_in_other_process(
    t: &TestCtx,
    bytes: &[u8],
    mode: IpcMode,
    device: u32,
) -> Result<Vec<u8>, String> {
    let handle = emm::IpcHandle::from_bytes(bytes).map_err(|e| e.to_string())?;
    let pool = match handle.handle() {
        emm::contract::IpcMemory::PoolAllocation { .. } => Some(export_pool_of(t, &handle)?),
        emm::contract::IpcMemory::Allocation(_) => None,
    };
    open_in_other_process_with(t, bytes, mode, device, pool)
}

/// The pool export for a pool handle: from the context of the handle's source device (device
/// 0 for a handle without one).
pub fn export_pool_of(
    t: &TestCtx,
    handle: &emm::IpcHandle,
) -> Result<emm::contract::PoolExport, String> {
    let device = match handle.source() {
        Some(id) => t
            .runtime
            .device_with_identity(&id)
            .map_err(|e| e.to_string())?,
        None => DeviceOrdinal(0),
    };
    t.runtime
        .context(device)
        .and_then(|ctx| ctx.export_pool())
        .map_err(|e| format!("export_pool: {e}"))
}

/// [`open_in_other_process`] with the pool export to send given explicitly (`None`: the
/// child imports no pool).
pub fn open_in_other_process_with(
    t: &TestCtx,
    bytes: &[u8],
    mode: IpcMode,
    device: u32,
    pool: Option<emm::contract::PoolExport>,
) -> Result<Vec<u8>, String> {
    match &t.sim {
        Some(sim) => in_sim_process(sim, |other| ipc_child(other, bytes, mode, device, pool)),
        None => spawn_child(
            &[
                (IPC_CHILD_ENV, hex(bytes)),
                ("EMM_IPC_MODE", mode.name().to_owned()),
                ("EMM_IPC_DEVICE", device.to_string()),
            ],
            pool.as_ref().map(Outgoing::Pool),
        ),
    }
}

/// Runs this executable again as a child process with `env` set, sends it `pool` (an export,
/// if any) over a fresh Unix socket, and returns what it reported ([`child_result`]).
fn spawn_child(env: &[(&str, String)], pool: Option<Outgoing<'_>>) -> Result<Vec<u8>, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut cmd = std::process::Command::new(exe);
    cmd.envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let listener = match pool {
        Some(_) => {
            let path = socket_path();
            let listener = emm::bind_owner_only(&path)
                .map_err(|e| format!("binding {}: {e}", path.display()))?;
            cmd.env(IPC_POOL_SOCKET_ENV, &path);
            Some((listener, path))
        }
        None => None,
    };
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("starting the child process: {e}"))?;
    let sent = match (pool, &listener) {
        (Some(export), Some((listener, _))) => send_to_child(listener, &mut child, export),
        _ => Ok(()),
    };
    if let Some((_, path)) = &listener {
        let _ = std::fs::remove_file(path);
    }
    let out = child
        .wait_with_output()
        .map_err(|e| format!("waiting for the child process: {e}"))?;
    sent?;
    child_result(&out)
}

/// Runs `child` as a new process of the simulated machine `sim`; whatever its outcome, that
/// process must end holding nothing.
fn in_sim_process(
    sim: &Arc<SimDriver>,
    child: impl FnOnce(Arc<dyn Driver>) -> Result<Vec<u8>, String>,
) -> Result<Vec<u8>, String> {
    let other = Arc::new(sim.spawn_process());
    let data = child(other.clone());
    let leaks = other.leak_report();
    if !leaks.is_clean() {
        return Err(format!("the other process leaked: {leaks}"));
    }
    data
}

/// A fresh socket path for one pool export.
fn socket_path() -> std::path::PathBuf {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    std::env::temp_dir().join(format!("emm-ipc-{}-{n}.sock", std::process::id()))
}

/// Waits (up to a minute) for the child to connect, then sends it the export. Gives up early
/// if the child exits first.
fn send_to_child(
    listener: &std::os::unix::net::UnixListener,
    child: &mut std::process::Child,
    export: Outgoing<'_>,
) -> Result<(), String> {
    listener
        .set_nonblocking(true)
        .map_err(|e| format!("socket: {e}"))?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                stream
                    .set_nonblocking(false)
                    .map_err(|e| format!("socket: {e}"))?;
                return match export {
                    Outgoing::Pool(e) => e.send(&stream),
                    Outgoing::Mapped(e) => e.send(&stream),
                }
                .map_err(|e| e.to_string());
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if let Ok(Some(status)) = child.try_wait() {
                    return Err(format!(
                        "the child exited ({status}) before taking the pool export"
                    ));
                }
                if std::time::Instant::now() > deadline {
                    return Err("the child did not connect for the pool export in 60 s".into());
                }
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            Err(e) => return Err(format!("accepting the child's connection: {e}")),
        }
    }
}

/// If this process was started as the other process of an IPC test, does that job, prints its
/// result and exits; otherwise returns.
pub fn run_ipc_child_if_requested() {
    if let Ok(bytes) = std::env::var(RAW_IPC_CHILD_ENV) {
        let size = std::env::var("EMM_RAW_IPC_SIZE")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let result = unhex(&bytes).and_then(|bytes| {
            let (driver, _) = make_driver(Target::Cuda).map_err(|e| e.to_string())?;
            raw_ipc_importer(&*driver, &bytes, size)
        });
        report_to_parent(result.map(|()| Vec::new()));
    }
    if let Ok(bytes) = std::env::var(RAW_POOL_CHILD_ENV) {
        let result = (|| -> Result<Vec<u8>, String> {
            let export = receive_pool()?.ok_or("no pool export socket was named")?;
            let bytes = unhex(&bytes)?;
            let handle = emm::IpcHandle::from_bytes(&bytes).map_err(|e| e.to_string())?;
            let emm::contract::IpcMemory::PoolAllocation { data, .. } = handle.handle() else {
                return Err("not a handle of pool memory".into());
            };
            let (driver, _) = make_driver(Target::Cuda).map_err(|e| e.to_string())?;
            raw_pool_importer(&*driver, export.fd(), data, handle.size()).map(String::into_bytes)
        })();
        report_to_parent(result);
    }
    if std::env::var(IPC_MAPPED_CHILD_ENV).is_ok() {
        let result = (|| -> Result<Vec<u8>, String> {
            let path = std::env::var(IPC_POOL_SOCKET_ENV)
                .map_err(|_| format!("{IPC_POOL_SOCKET_ENV} names no socket"))?;
            let socket = std::os::unix::net::UnixStream::connect(&path)
                .map_err(|e| format!("connecting to {path}: {e}"))?;
            let export =
                emm::contract::MappedExport::receive(&socket).map_err(|e| e.to_string())?;
            let (driver, _) = make_driver(Target::Cuda).map_err(|e| e.to_string())?;
            mapped_child(driver, export)
        })();
        report_to_parent(result);
    }
    if let Ok(list) = std::env::var(IPC_CHILD_MANY_ENV) {
        let result = (|| -> Result<Vec<u8>, String> {
            let pool = receive_pool()?;
            let handles = list.split(',').map(unhex).collect::<Result<Vec<_>, _>>()?;
            let (driver, _) = make_driver(Target::Cuda).map_err(|e| e.to_string())?;
            ipc_child_many(driver, &handles, pool)
        })();
        report_to_parent(result);
    }
    if let Ok(list) = std::env::var(IPC_STAGED_TIMING_ENV) {
        let number = |name: &str| {
            std::env::var(name)
                .ok()
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| format!("{name} is not set to a number"))
        };
        let result = (|| -> Result<Vec<u8>, String> {
            let handles = list.split(',').map(unhex).collect::<Result<Vec<_>, _>>()?;
            let (driver, _) = make_driver(Target::Cuda).map_err(|e| e.to_string())?;
            let (device, reps) = (number("EMM_IPC_DEVICE")?, number("EMM_IPC_REPS")?);
            staged_open_times(driver, &handles, device, reps as usize)
        })();
        report_to_parent(result);
    }
    let Ok(bytes) = std::env::var(IPC_CHILD_ENV) else {
        return;
    };
    let mode = match std::env::var("EMM_IPC_MODE").as_deref() {
        Ok("staged") => IpcMode::Staged,
        _ => IpcMode::Auto,
    };
    let device = std::env::var("EMM_IPC_DEVICE")
        .ok()
        .and_then(|d| d.parse().ok())
        .unwrap_or(0);
    let pool = receive_pool();
    let result = unhex(&bytes).and_then(|bytes| {
        let (driver, _) = make_driver(Target::Cuda).map_err(|e| e.to_string())?;
        ipc_child(driver, &bytes, mode, device, pool?)
    });
    report_to_parent(result);
}

/// In a child process: the pool export its parent sends over the socket it names, if it
/// names one.
fn receive_pool() -> Result<Option<emm::contract::PoolExport>, String> {
    match std::env::var(IPC_POOL_SOCKET_ENV) {
        Ok(path) => std::os::unix::net::UnixStream::connect(&path)
            .map_err(|e| format!("connecting to {path}: {e}"))
            .and_then(|s| emm::contract::PoolExport::receive(&s).map_err(|e| e.to_string()))
            .map(Some),
        Err(_) => Ok(None),
    }
}

/// The IPC child's last act: prints its result on the one line [`child_result`] reads (the
/// bytes it read back, hex-encoded, or the error) and exits.
fn report_to_parent(result: Result<Vec<u8>, String>) -> ! {
    match result {
        Ok(data) => println!("{CHILD_RESULT_PREFIX}ok {}", hex(&data)),
        Err(e) => println!("{CHILD_RESULT_PREFIX}err {}", e.replace('\n', " ")),
    }
    std::process::exit(0);
}

/// What an IPC child process reported through [`report_to_parent`]: the bytes it read back, or
/// its error; an error too when it printed no result (it crashed: its exit and stderr say how).
pub(crate) fn child_result(out: &std::process::Output) -> Result<Vec<u8>, String> {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix(CHILD_RESULT_PREFIX))
        .ok_or_else(|| {
            format!(
                "the child printed no result (exit {:?}); stderr: {}",
                out.status.code(),
                String::from_utf8_lossy(&out.stderr)
            )
        })?;
    match line.split_once(' ') {
        Some(("ok", data)) => unhex(data),
        Some(("err", msg)) => Err(format!("in the child process: {msg}")),
        _ => Err(format!("unreadable child result {line:?}")),
    }
}

/// The start of the line on which an IPC child process reports its result.
const CHILD_RESULT_PREFIX: &str = "EMM_IPC_RESULT ";

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Result<Vec<u8>, String> {
    let s = s.trim();
    if !s.len().is_multiple_of(2) {
        return Err("odd-length hex".into());
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).map_err(|e| format!("bad hex: {e}")))
        .collect()
}
