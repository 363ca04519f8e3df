//! Prints what the driver does where emm's simulator must match it: allocation alignment and
//! placement, `cuMemGetInfo` accounting, address ranges, and the error of each misuse.
//!
//! `cargo run --example driver_probe` (uses `EMM_DRIVER`, so it runs on the simulator where no
//! GPU is present). The GPU job runs it and keeps its output beside the suite's log.
//! `EMM_PROBE_ONLY=waits` runs only the section on driver calls while a stream waits;
//! `EMM_PROBE_ONLY=pools` only the one on pool size limits and pools in host memory.

use driver_sys::{ContextHandle, DeviceOrdinal, DevicePtr, Driver, DriverError};

// The probe misuses the driver on purpose; these wrappers hold its one safety argument.

fn free(d: &dyn Driver, ctx: ContextHandle, p: DevicePtr) -> Result<(), DriverError> {
    // SAFETY: only device memory is named; the probe never uses memory it frees again, and
    // bad pointers are answered by the driver with errors.
    unsafe { d.mem_free(ctx, p) }
}

fn htod(d: &dyn Driver, ctx: ContextHandle, dst: DevicePtr, src: &[u8]) -> Result<(), DriverError> {
    // SAFETY: the destination is device memory the probe owns or no allocation at all (which the
    // driver refuses); `src` is a live slice.
    unsafe { d.memcpy_htod(ctx, dst, src) }
}

fn dtoh(
    d: &dyn Driver,
    ctx: ContextHandle,
    dst: &mut [u8],
    src: DevicePtr,
) -> Result<(), DriverError> {
    // SAFETY: `dst` is an exclusive host buffer; the source is device memory or nothing.
    unsafe { d.memcpy_dtoh(ctx, dst, src) }
}

fn release(d: &dyn Driver, dev: DeviceOrdinal) -> Result<(), DriverError> {
    // SAFETY: the probe uses no memory of the context after releasing it, except to show the
    // driver refusing it.
    unsafe { d.primary_ctx_release(dev) }
}

fn reset(d: &dyn Driver, dev: DeviceOrdinal) -> Result<(), DriverError> {
    // SAFETY: as for `release`.
    unsafe { d.primary_ctx_reset(dev) }
}

fn free_host(
    d: &dyn Driver,
    ctx: ContextHandle,
    p: driver_sys::HostPtr,
) -> Result<(), DriverError> {
    // SAFETY: frees what the probe allocated, or shows the refusal of a second free.
    unsafe { d.mem_free_host(ctx, p) }
}

fn register(
    d: &dyn Driver,
    ctx: ContextHandle,
    p: driver_sys::HostPtr,
    n: usize,
    flags: u32,
) -> Result<(), DriverError> {
    // SAFETY: `p` is the probe's own live buffer, untouched by references while registered.
    unsafe { d.mem_host_register(ctx, p, n, flags) }
}

fn unregister(
    d: &dyn Driver,
    ctx: ContextHandle,
    p: driver_sys::HostPtr,
) -> Result<(), DriverError> {
    // SAFETY: unregisters the probe's own buffer, or shows the refusal.
    unsafe { d.mem_host_unregister(ctx, p) }
}

fn close_ipc(d: &dyn Driver, ctx: ContextHandle, p: DevicePtr) -> Result<(), DriverError> {
    // SAFETY: `p` was never opened; the driver must refuse.
    unsafe { d.ipc_close_mem_handle(ctx, p) }
}

fn destroy_stream(
    d: &dyn Driver,
    ctx: ContextHandle,
    s: driver_sys::StreamHandle,
) -> Result<(), DriverError> {
    // SAFETY: the probe's own stream, destroyed once.
    unsafe { d.stream_destroy(ctx, s) }
}

fn destroy_event(
    d: &dyn Driver,
    ctx: ContextHandle,
    e: driver_sys::EventHandle,
) -> Result<(), DriverError> {
    // SAFETY: the probe's own event, destroyed once.
    unsafe { d.event_destroy(ctx, e) }
}

fn unload(
    d: &dyn Driver,
    ctx: ContextHandle,
    m: driver_sys::ModuleHandle,
) -> Result<(), DriverError> {
    // SAFETY: the probe's own module, unloaded once, never launched.
    unsafe { d.module_unload(ctx, m) }
}

fn show<T: std::fmt::Debug>(what: &str, r: Result<T, driver_sys::DriverError>) {
    match r {
        Ok(v) => println!("{what:<48} Ok({v:?})"),
        Err(e) => println!("{what:<48} Err({:?}, {})", e.kind(), e.code_name()),
    }
}

fn main() -> std::process::ExitCode {
    integration::exit_with(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let choice = integration::driver_from_env()?;
    let d = choice.driver;
    println!("driver: {} ({})", d.name(), choice.reason);
    d.init()?;
    let dev = DeviceOrdinal(0);
    println!("devices: {}", d.device_count()?);
    println!("total mem: {}", d.device_total_mem(dev)?);
    let ctx = d.primary_ctx_retain(dev)?;
    println!("context: {ctx}");
    // `EMM_PROBE_ONLY=waits`: only the section on driver calls while a stream waits, first
    // thing in a fresh process (so no earlier section leaves pools holding memory).
    match std::env::var("EMM_PROBE_ONLY").ok().as_deref() {
        None | Some("") => {}
        Some("waits") => {
            frees_while_a_stream_waits(&d, ctx)?;
            show("release", release(&*d, dev));
            return Ok(());
        }
        Some("pools") => {
            pool_limits_and_host_pools(&*d, ctx, dev)?;
            show("release", release(&*d, dev));
            return Ok(());
        }
        Some(v) if v.starts_with("free-after-destroy-") => {
            free_after_destroy(&*d, dev, v.ends_with("second"))?;
            return Ok(());
        }
        Some(v) if v.starts_with("default-pool-after-") => {
            default_pool_after_a_new_context(&*d, dev, v)?;
            return Ok(());
        }
        Some(other) => {
            return Err(format!(
                "EMM_PROBE_ONLY={other:?} names no section; use waits, pools or \
                 default-pool-after-{{nothing,stream,pool,default-pool}}, or unset it for all"
            )
            .into());
        }
    }
    let info0 = d.mem_get_info(ctx)?;
    println!("mem info at start: {info0:?}");

    println!("\n-- placement of small allocations (size -> address, delta, trailing zeros)");
    let mut prev: Option<DevicePtr> = None;
    let mut held = Vec::new();
    for bytes in [
        1usize,
        1,
        3,
        100,
        255,
        256,
        257,
        511,
        512,
        513,
        1000,
        1024,
        4096,
        4097,
        65536,
        1 << 20,
        (1 << 20) + 1,
        2 << 20,
        (2 << 20) + 1,
    ] {
        let p = d.mem_alloc(ctx, bytes)?;
        let delta = prev.map(|q| p.0 as i128 - q.0 as i128);
        println!(
            "{bytes:>9} -> {p} delta {delta:?} tz {}",
            p.0.trailing_zeros()
        );
        let (base, size) = d.mem_get_address_range(ctx, p)?;
        if base != p || size != bytes {
            println!("          address range: base {base} size {size}");
        }
        prev = Some(p);
        held.push(p);
    }
    let info1 = d.mem_get_info(ctx)?;
    println!(
        "free fell by {} bytes for those",
        info0.free as i128 - info1.free as i128
    );
    for p in held.drain(..) {
        free(&*d, ctx, p)?;
    }
    let info2 = d.mem_get_info(ctx)?;
    println!(
        "free after freeing them: {} (start {})",
        info2.free, info0.free
    );

    println!("\n-- accounting of single allocations (size -> fall in free)");
    for bytes in [
        1usize,
        512,
        4096,
        1 << 20,
        2 << 20,
        (2 << 20) + 1,
        64 << 20,
        (64 << 20) + 1,
    ] {
        let before = d.mem_get_info(ctx)?.free;
        let p = d.mem_get_info(ctx).and_then(|_| d.mem_alloc(ctx, bytes))?;
        let during = d.mem_get_info(ctx)?.free;
        free(&*d, ctx, p)?;
        let after = d.mem_get_info(ctx)?.free;
        println!(
            "{bytes:>10}: fell {} back {}",
            before as i128 - during as i128,
            after as i128 - during as i128
        );
    }

    println!("\n-- misuse");
    let total = info0.total;
    show("cuMemAlloc(0)", d.mem_alloc(ctx, 0));
    show("cuMemAlloc(total + 1)", d.mem_alloc(ctx, total + 1));
    show(
        "cuMemAlloc(usize::MAX / 2)",
        d.mem_alloc(ctx, usize::MAX / 2),
    );
    show("cuMemAlloc(usize::MAX)", d.mem_alloc(ctx, usize::MAX));
    let p = d.mem_alloc(ctx, 4096)?;
    show(
        "cuMemFree(base + 256)",
        free(&*d, ctx, DevicePtr(p.0 + 256)),
    );
    show(
        "cuMemGetAddressRange(base + 4095)",
        d.mem_get_address_range(ctx, DevicePtr(p.0 + 4095)),
    );
    show(
        "cuMemGetAddressRange(base + 4096)",
        d.mem_get_address_range(ctx, DevicePtr(p.0 + 4096)),
    );
    show(
        "cuMemcpyHtoD 8 bytes at base + 4092 (past end)",
        htod(&*d, ctx, DevicePtr(p.0 + 4092), &[0u8; 8]),
    );
    show(
        "cuMemcpyHtoD 8 bytes at 0x10",
        htod(&*d, ctx, DevicePtr(0x10), &[0u8; 8]),
    );
    let mut buf = [0u8; 8];
    show(
        "cuMemcpyDtoH 8 bytes from 0x10",
        dtoh(&*d, ctx, &mut buf, DevicePtr(0x10)),
    );
    show(
        "cuMemcpyHtoD 0 bytes at 0x10",
        htod(&*d, ctx, DevicePtr(0x10), &[]),
    );
    show("cuMemFree(base)", free(&*d, ctx, p));
    show("cuMemFree(base) again", free(&*d, ctx, p));
    show("cuMemFree(0x10)", free(&*d, ctx, DevicePtr(0x10)));
    show("cuMemFree(0)", free(&*d, ctx, DevicePtr(0)));
    show(
        "cuMemGetAddressRange(freed)",
        d.mem_get_address_range(ctx, p),
    );
    show(
        "cuDeviceTotalMem(device 99)",
        d.device_total_mem(DeviceOrdinal(99)),
    );
    show(
        "cuDevicePrimaryCtxRetain(device 99)",
        d.primary_ctx_retain(DeviceOrdinal(99)),
    );

    println!("\n-- host memory, IPC, streams, modules");
    use driver_sys::{host_alloc, host_register};
    show("cuMemHostAlloc(0)", d.mem_host_alloc(ctx, 0, 0));
    let h = d.mem_host_alloc(ctx, 4096, 0)?;
    show(
        "device pointer of unmapped cuMemHostAlloc memory",
        d.mem_host_get_device_pointer(ctx, h),
    );
    show("cuMemFreeHost", free_host(&*d, ctx, h));
    show("cuMemFreeHost again", free_host(&*d, ctx, h));
    let hm = d.mem_host_alloc(ctx, 4096, host_alloc::DEVICEMAP)?;
    show(
        "device pointer of mapped memory (same as host?)",
        d.mem_host_get_device_pointer(ctx, hm)
            .map(|p| (p, p.0 == hm.0 as u64)),
    );
    show("cuMemFreeHost(mapped)", free_host(&*d, ctx, hm));
    let mut buf = vec![0u8; 8192];
    let hp = driver_sys::HostPtr(buf.as_mut_ptr() as usize);
    show(
        "cuMemHostRegister(0 flags)",
        register(&*d, ctx, hp, 8192, 0),
    );
    show(
        "device pointer of registered, unmapped range",
        d.mem_host_get_device_pointer(ctx, hp),
    );
    show("cuMemHostRegister again", register(&*d, ctx, hp, 8192, 0));
    show("cuMemHostUnregister", unregister(&*d, ctx, hp));
    show("cuMemHostUnregister again", unregister(&*d, ctx, hp));
    show(
        "cuMemHostRegister(DEVICEMAP)",
        register(&*d, ctx, hp, 8192, host_register::DEVICEMAP),
    );
    show(
        "device pointer of registered, mapped range",
        d.mem_host_get_device_pointer(ctx, hp)
            .map(|p| (p, p.0 == hp.0 as u64)),
    );
    show("cuMemHostUnregister", unregister(&*d, ctx, hp));
    show("cuMemHostRegister(0 bytes)", register(&*d, ctx, hp, 0, 0));
    drop(buf);
    let a = d.mem_alloc(ctx, 1 << 20)?;
    show(
        "cuIpcGetMemHandle(base)",
        d.ipc_get_mem_handle(ctx, a).map(|_| "ok"),
    );
    show(
        "cuIpcGetMemHandle(base + 4096)",
        d.ipc_get_mem_handle(ctx, DevicePtr(a.0 + 4096))
            .map(|_| "ok"),
    );
    let ih = d.ipc_get_mem_handle(ctx, a)?;
    show(
        "cuIpcOpenMemHandle in the exporting process",
        d.ipc_open_mem_handle(ctx, &ih),
    );
    show(
        "cuIpcOpenMemHandle of garbage",
        d.ipc_open_mem_handle(ctx, &driver_sys::IpcMemHandle([7; 64])),
    );
    show("cuIpcCloseMemHandle(never opened)", close_ipc(&*d, ctx, a));
    free(&*d, ctx, a)?;
    let s = d.stream_create(ctx, 0)?;
    show("cuStreamDestroy", destroy_stream(&*d, ctx, s));
    let e = d.event_create(ctx, 2)?;
    show("cuEventDestroy", destroy_event(&*d, ctx, e));
    show(
        "cuModuleLoadData(garbage)",
        d.module_load_data(ctx, b"not an image"),
    );
    let ptx = ".version 8.0\n.target sm_90\n.address_size 64\n\n.visible .entry emm_noop()\n{\n\tret;\n}\n";
    let m = d.module_load_data(ctx, ptx.as_bytes());
    show("cuModuleLoadData(PTX)", m.clone());
    if let Ok(m) = m {
        show("cuModuleUnload", unload(&*d, ctx, m));
    }
    show(
        "cuDeviceCanAccessPeer(0, 0)",
        d.device_can_access_peer(dev, dev),
    );

    pool_cache_under_pressure(&*d, ctx, dev)?;
    frees_while_a_stream_waits(&d, ctx)?;

    println!("\n-- primary context life");
    let q = d.mem_alloc(ctx, 4096)?;
    show("release (count 1 -> 0)", release(&*d, dev));
    show("cuMemGetInfo on released context", d.mem_get_info(ctx));
    show("cuMemAlloc on released context", d.mem_alloc(ctx, 16));
    show("cuMemFree(old) on released context", free(&*d, ctx, q));
    show("release again (count 0)", release(&*d, dev));
    let ctx2 = d.primary_ctx_retain(dev)?;
    println!("retained again: {ctx2} (same handle: {})", ctx2 == ctx);
    show("cuMemFree(old) in the new context", free(&*d, ctx2, q));
    let r = d.mem_alloc(ctx2, 4096)?;
    show("cuDevicePrimaryCtxReset", reset(&*d, dev));
    show(
        "cuMemGetInfo after reset (count still 1)",
        d.mem_get_info(ctx2),
    );
    show("cuMemFree(from before reset)", free(&*d, ctx2, r));
    let ctx3 = d.primary_ctx_retain(dev)?;
    println!(
        "retained after reset: {ctx3} (same handle: {})",
        ctx3 == ctx
    );
    show("cuMemAlloc after reset + retain", d.mem_alloc(ctx3, 16));
    show("release", release(&*d, dev));
    show("release", release(&*d, dev));
    Ok(())
}

/// Whether `cuMemFree` (and `cuMemAlloc`, `cuMemFreeAsync`, `cuEventRecord` + `cuEventQuery`,
/// `cuMemFreeAsync` of `cuMemAlloc` memory, and `vmm-pool`'s calls: `cuMemCreate` +
/// `cuMemMap` + `cuMemSetAccess`, `cuMemUnmap` + `cuMemRelease`) return while another stream
/// of the context waits on a flag the host has not written (and has a set of memory queued
/// behind the wait): each runs on a thread, and the probe waits up to 3 s for it before it
/// writes the flag. `cuMemFreeAsync` of 64 MiB of `cuMemAlloc` memory on the waiting stream
/// itself prints the device's free bytes before and after the call and once the stream has run
/// past it: whether the memory comes back at the call or at the stream's free. The calls that
/// may not block come first, so that a call blocked before
/// them does not hold them up. The default manager's stream-ordered frees must not block a
/// thread on such a stream; a pool's growth or give-back that blocks stalls every stream's
/// thread that makes one.
fn frees_while_a_stream_waits(
    d: &std::sync::Arc<dyn Driver>,
    ctx: ContextHandle,
) -> Result<(), Box<dyn std::error::Error>> {
    use driver_sys::{host_alloc, stream_flags, wait_value};
    use std::time::{Duration, Instant};
    println!("\n-- driver calls while a stream waits on a flag");
    let flag = d.mem_host_alloc(ctx, 64, host_alloc::DEVICEMAP)?;
    let at = d.mem_host_get_device_pointer(ctx, flag)?;
    let word = flag.0 as *mut u32;
    // SAFETY: `flag` is 64 bytes of page-locked host memory owned here, freed at the end.
    unsafe { word.write_volatile(0) };
    let s = d.stream_create(ctx, stream_flags::NON_BLOCKING)?;
    let other = d.stream_create(ctx, stream_flags::NON_BLOCKING)?;
    // Made before the wait: memory for `cuMemFreeAsync`, and a reservation of two granules,
    // the first mapped (for the unmap) and the second free (for the map).
    let plain = d.mem_alloc(ctx, 4096)?;
    // Freed on the waiting stream itself: whether the driver gives its 64 MiB back at the call
    // or when the stream reaches the free shows in the device's free bytes before and after.
    const BIG: usize = 64 << 20;
    let big = d.mem_alloc(ctx, BIG)?;
    let granule = d.mem_vmm_granularity(DeviceOrdinal(0))?;
    let reserved = d.mem_address_reserve(ctx, 2 * granule)?;
    let mapped = d.mem_create(ctx, DeviceOrdinal(0), granule, false)?;
    // SAFETY: the reservation's first granule, nothing mapped there.
    unsafe { d.mem_map(ctx, reserved, granule, mapped)? };
    d.mem_set_access(ctx, reserved, granule, DeviceOrdinal(0))?;
    let second = DevicePtr(reserved.0 + granule as u64);
    // What the calls below did, for the clean-up to undo the rest: `plain` freed, the first
    // granule unmapped, the second mapped.
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    let flag_off = || std::sync::Arc::new(AtomicBool::new(false));
    let (freed_async, unmapped, mapped_second) = (flag_off(), flag_off(), flag_off());
    let (freed_async_set, unmapped_set, mapped_second_set) =
        (freed_async.clone(), unmapped.clone(), mapped_second.clone());
    let big_freed = flag_off();
    let big_freed_set = big_freed.clone();
    d.stream_wait_value32(ctx, s, at, 1, wait_value::EQ)?;
    let held = d.mem_alloc(ctx, 1 << 20)?;
    // SAFETY: `held` is live memory of this context until its free below (after the flag).
    unsafe { d.memset_d8_async(ctx, held, 7, 1 << 20, s)? };
    let pool = d.device_default_mem_pool(DeviceOrdinal(0))?;
    type Call = Box<dyn FnOnce(&dyn Driver) -> Result<(), DriverError> + Send>;
    let mib = |bytes: usize| bytes as f64 / (1 << 20) as f64;
    let calls: Vec<(&str, Call)> = vec![
        (
            "cuMemFreeAsync of 64 MiB of cuMemAlloc memory on the waiting stream",
            Box::new(move |d: &dyn Driver| {
                let before = d.mem_get_info(ctx)?.free;
                // SAFETY: allocated before the wait, unused by any work, freed once.
                unsafe { d.mem_free_async(ctx, big, s) }?;
                big_freed_set.store(true, SeqCst);
                let after = d.mem_get_info(ctx)?.free;
                println!(
                    "   (device free before the call {:.1} MiB, after it {:.1} MiB)",
                    mib(before),
                    mib(after)
                );
                Ok(())
            }),
        ),
        (
            "cuMemFreeAsync of cuMemAlloc memory on another stream",
            Box::new(move |d: &dyn Driver| {
                // SAFETY: allocated before the wait, unused by any work, freed once.
                unsafe { d.mem_free_async(ctx, plain, other) }?;
                freed_async_set.store(true, SeqCst);
                Ok(())
            }),
        ),
        (
            "cuMemCreate + cuMemMap + cuMemSetAccess (one granule)",
            Box::new(move |d: &dyn Driver| {
                let h = d.mem_create(ctx, DeviceOrdinal(0), granule, false)?;
                // SAFETY: the reservation's second granule, nothing mapped there.
                let map = unsafe { d.mem_map(ctx, second, granule, h) };
                if map.is_ok() {
                    mapped_second_set.store(true, SeqCst);
                }
                let access =
                    map.and_then(|()| d.mem_set_access(ctx, second, granule, DeviceOrdinal(0)));
                // SAFETY: created above and released once; a mapping keeps the memory.
                let release = unsafe { d.mem_release(ctx, h) };
                access.and(release)
            }),
        ),
        (
            "cuMemUnmap + cuMemRelease (a granule no stream uses)",
            Box::new(move |d: &dyn Driver| {
                // SAFETY: mapped before the wait, used by no work; unmapped once.
                unsafe { d.mem_unmap(ctx, reserved, granule) }?;
                unmapped_set.store(true, SeqCst);
                // SAFETY: created before the wait, released once, its mapping gone.
                unsafe { d.mem_release(ctx, mapped) }
            }),
        ),
        (
            "cuMemAlloc",
            Box::new(move |d: &dyn Driver| d.mem_alloc(ctx, 4096).map(|p| drop(free(d, ctx, p)))),
        ),
        (
            "cuMemFree (memory no stream uses)",
            Box::new(move |d: &dyn Driver| {
                let p = d.mem_alloc(ctx, 4096)?;
                free(d, ctx, p)
            }),
        ),
        (
            "cuMemAllocAsync + cuMemFreeAsync on another stream",
            Box::new(move |d: &dyn Driver| {
                let p = d.mem_alloc_from_pool_async(ctx, pool, 4096, other)?;
                // SAFETY: allocated just above on `other`, unused, freed once.
                unsafe { d.mem_free_async(ctx, p, other) }
            }),
        ),
        (
            "cuEventRecord + cuEventQuery on the waiting stream",
            Box::new(move |d: &dyn Driver| {
                let e = d.event_create(ctx, driver_sys::event_flags::DISABLE_TIMING)?;
                d.event_record(ctx, e, s)?;
                let done = d.event_query(ctx, e)?;
                println!("   (event query says done: {done})");
                // SAFETY: created above, destroyed once; the driver keeps it until its record ran.
                unsafe { d.event_destroy(ctx, e) }
            }),
        ),
    ];
    // Each call on a thread of its own, after a first call (`cuMemGetInfo`) that makes the
    // context current there, timed apart: a new thread's first call is not what is probed.
    let mut pending = Vec::new();
    for (what, call) in calls {
        let d2 = std::sync::Arc::clone(d);
        let (tx, rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            let start = Instant::now();
            let first = d2.mem_get_info(ctx).map(drop);
            let warm = start.elapsed();
            let start = Instant::now();
            let r = call(&*d2);
            let _ = tx.send((first, warm, r, start.elapsed()));
        });
        match rx.recv_timeout(Duration::from_secs(3)) {
            Ok((first, warm, r, took)) => {
                println!(
                    "{what}: returned in {took:?}: {r:?} (cuMemGetInfo first: {first:?} in {warm:?})"
                );
                t.join().expect("probe thread");
            }
            Err(_) => {
                println!("{what}: still blocked after 3 s (waits for the held stream)");
                pending.push((what, rx, t));
            }
        }
    }
    let released = Instant::now();
    // SAFETY: as above; the host writes the flag the stream waits for.
    unsafe { word.write_volatile(1) };
    for (what, rx, t) in pending {
        match rx.recv_timeout(Duration::from_secs(30)) {
            Ok((first, warm, r, took)) => println!(
                "{what}: after the flag, {r:?} in {took:?} (returned {:?} after the flag; cuMemGetInfo first: {first:?} in {warm:?})",
                released.elapsed()
            ),
            Err(e) => println!("{what}: no answer 30 s after the flag: {e}"),
        }
        t.join().expect("probe thread");
    }
    d.stream_synchronize(ctx, s)?;
    d.stream_synchronize(ctx, other)?;
    if big_freed.load(SeqCst) {
        println!(
            "device free once the waiting stream ran past its cuMemFreeAsync: {:.1} MiB",
            mib(d.mem_get_info(ctx)?.free)
        );
    } else {
        free(&**d, ctx, big)?;
    }
    free(&**d, ctx, held)?;
    if !freed_async.load(SeqCst) {
        free(&**d, ctx, plain)?;
    }
    // SAFETY: each granule still mapped is unused and unmapped once (the first's handle then
    // released, if its call did not); the reservation, with nothing mapped, is given back once.
    unsafe {
        if !unmapped.load(SeqCst) {
            d.mem_unmap(ctx, reserved, granule)?;
            d.mem_release(ctx, mapped)?;
        }
        if mapped_second.load(SeqCst) {
            d.mem_unmap(ctx, second, granule)?;
        }
        d.mem_address_free(ctx, reserved, 2 * granule)?;
    }
    destroy_stream(&**d, ctx, s)?;
    destroy_stream(&**d, ctx, other)?;
    free_host(&**d, ctx, flag)?;
    Ok(())
}

/// What a stream-ordered pool's cache does when another allocation needs the memory it holds:
/// the pool (release threshold at its maximum) caches a freed block, the device is then
/// filled, by `cuMemAlloc` or from a second pool, and the first pool's reserved bytes and the
/// device's free bytes are printed at each step, before and after `cuMemPoolTrimTo(0)`.
fn pool_cache_under_pressure(
    d: &dyn Driver,
    ctx: ContextHandle,
    dev: DeviceOrdinal,
) -> Result<(), Box<dyn std::error::Error>> {
    use driver_sys::{MemPoolHandle, StreamHandle};
    println!("\n-- a stream-ordered pool's cache under memory pressure");
    let s0 = StreamHandle::NULL;
    let step = |what: &str, pool| {
        let reserved = d.mem_pool_usage(ctx, pool).map(|u| u.reserved);
        let free = d.mem_get_info(ctx).map(|i| i.free);
        println!("{what:<48} pool reserved {reserved:?}, device free {free:?}");
    };
    let total = d.mem_get_info(ctx)?.total;
    let cached = (256usize << 20).min(total / 8);
    // (fill with: none, cuMemAlloc, a second pool; free synchronised before the fill)
    let scenarios = [
        ("nothing", true),
        ("cuMemAlloc", true),
        ("cuMemAlloc", false),
        ("a second pool", true),
    ];
    for (fill, sync) in scenarios {
        println!("- filled with {fill}, the cached block's free synchronised: {sync}");
        let pool = d.mem_pool_create(ctx, dev, false)?;
        d.mem_pool_set_release_threshold(ctx, pool, u64::MAX)?;
        let p = d.mem_alloc_from_pool_async(ctx, pool, cached, s0)?;
        // SAFETY: allocated just above on stream 0, freed once; nothing uses it.
        unsafe { d.mem_free_async(ctx, p, s0)? };
        if sync {
            d.stream_synchronize(ctx, s0)?;
        }
        step("block allocated and freed", pool);
        let second: Option<MemPoolHandle> = (fill == "a second pool")
            .then(|| d.mem_pool_create(ctx, dev, false))
            .transpose()?;
        let alloc = |bytes| match second {
            Some(q) => d.mem_alloc_from_pool_async(ctx, q, bytes, s0),
            None => d.mem_alloc(ctx, bytes),
        };
        let mut held = Vec::new();
        if fill != "nothing" {
            let filled;
            (held, filled) = integration::fill_device(alloc);
            filled?;
            println!("{:<48} {} allocations", "device filled", held.len());
            step("after the fill", pool);
        }
        show("cuMemPoolTrimTo(0)", d.mem_pool_trim_to(ctx, pool, 0));
        step("after the trim", pool);
        if fill != "nothing" {
            show(
                "2 MiB more after the trim",
                alloc(2 << 20).map(|p| {
                    held.push(p);
                    "ok"
                }),
            );
        }
        for p in held {
            match second {
                // SAFETY: allocated above from the second pool, freed once, unused.
                Some(_) => unsafe { d.mem_free_async(ctx, p, s0)? },
                None => free(d, ctx, p)?,
            }
        }
        d.stream_synchronize(ctx, s0)?;
        if let Some(q) = second {
            // SAFETY: everything allocated from it was freed just above; destroyed once.
            unsafe { d.mem_pool_destroy(ctx, q)? };
        }
        // SAFETY: nothing of the pool is outstanding; destroyed once.
        unsafe { d.mem_pool_destroy(ctx, pool)? };
        let free = d.mem_get_info(ctx)?.free;
        println!(
            "{:<48} device free {free}",
            "everything freed, pools destroyed"
        );
    }
    Ok(())
}

/// How the driver holds a pool to its `maxSize` (how far past it an allocation gets), and what
/// the device may do with memory of a pool in host memory: the access it reports before and
/// after `cuMemPoolSetAccess`, and which copies and sets take its addresses.
fn pool_limits_and_host_pools(
    d: &dyn Driver,
    ctx: ContextHandle,
    dev: DeviceOrdinal,
) -> Result<(), Box<dyn std::error::Error>> {
    use driver_sys::{MemLocation, StreamHandle};
    let s0 = StreamHandle::NULL;
    let mib = 1usize << 20;
    println!("\n-- a pool's maxSize: 2 MiB blocks until the pool refuses (at most 4 x maxSize)");
    for max in [8 * mib, 64 * mib, 512 * mib] {
        let pool = d.mem_pool_create_limited(ctx, MemLocation::Device(dev), false, max)?;
        let mut held = Vec::new();
        let mut refusal = None;
        while held.len() * 2 * mib < 4 * max {
            match d.mem_alloc_from_pool_async(ctx, pool, 2 * mib, s0) {
                Ok(p) => held.push(p),
                Err(e) => {
                    refusal = Some(e);
                    break;
                }
            }
        }
        let usage = d.mem_pool_usage(ctx, pool);
        println!(
            "maxSize {:>4} MiB: {} blocks ({} MiB) allocated, then {:?}; usage {usage:?}",
            max / mib,
            held.len(),
            held.len() * 2,
            refusal.map(|e| e.to_string())
        );
        let one = d.mem_alloc_from_pool_async(ctx, pool, max + mib, s0);
        println!(
            "  one block of maxSize + 1 MiB with the above held: {:?}",
            one.as_ref().map(|_| "ok")
        );
        for p in held.into_iter().chain(one.ok()) {
            // SAFETY: allocated above from this pool on stream 0, unused, freed once.
            unsafe { d.mem_free_async(ctx, p, s0)? };
        }
        d.stream_synchronize(ctx, s0)?;
        let single = d.mem_alloc_from_pool_async(ctx, pool, max + mib, s0);
        println!(
            "  one block of maxSize + 1 MiB in the empty pool: {:?}",
            single.as_ref().map(|_| "ok").map_err(|e| e.to_string())
        );
        if let Ok(p) = single {
            // SAFETY: allocated just above on stream 0, unused, freed once.
            unsafe { d.mem_free_async(ctx, p, s0)? };
        }
        d.stream_synchronize(ctx, s0)?;
        // SAFETY: nothing of the pool is outstanding; destroyed once.
        unsafe { d.mem_pool_destroy(ctx, pool)? };
    }
    println!("\n-- pools in host memory: access, copies and sets");
    let len = mib;
    let dmem = d.mem_alloc(ctx, len)?;
    for location in [MemLocation::Host, MemLocation::HostNuma(0)] {
        println!("- location {location:?}");
        let pool = match d.mem_pool_create_limited(ctx, location, false, 0) {
            Ok(p) => p,
            Err(e) => {
                println!("  cuMemPoolCreate: {e}");
                continue;
            }
        };
        show(
            "  device access before cuMemPoolSetAccess",
            d.mem_pool_can_access(ctx, pool, dev),
        );
        show(
            "  cuMemPoolSetAccess(device, rw)",
            d.mem_pool_grant_access(ctx, pool, dev),
        );
        show(
            "  device access after",
            d.mem_pool_can_access(ctx, pool, dev),
        );
        let p = d.mem_alloc_from_pool_async(ctx, pool, len, s0)?;
        d.stream_synchronize(ctx, s0)?;
        println!("  address {p}");
        show("  cuMemGetAddressRange", d.mem_get_address_range(ctx, p));
        // SAFETY: the block is `len` bytes of this pool, allocated just above and synchronised;
        // each call names only it and `dmem` (`len` bytes), and nothing else uses either.
        unsafe {
            show(
                "  cuMemcpyDtoD(device <- pool)",
                d.memcpy_dtod(ctx, dmem, p, len),
            );
            show(
                "  cuMemcpyDtoD(pool <- device)",
                d.memcpy_dtod(ctx, p, dmem, len),
            );
            show(
                "  cuMemcpyDtoDAsync(device <- pool)",
                d.memcpy_dtod_async(ctx, dmem, p, len, s0),
            );
            show("  cuMemsetD8(pool)", d.memset_d8(ctx, p, 5, len));
            show(
                "  cuMemsetD8Async(pool)",
                d.memset_d8_async(ctx, p, 5, len, s0),
            );
            show(
                "  cuMemcpyHtoD(pool <- host)",
                d.memcpy_htod(ctx, p, &vec![9u8; len]),
            );
            let mut back = vec![0u8; len];
            show(
                "  cuMemcpyDtoH(host <- pool)",
                d.memcpy_dtoh(ctx, &mut back, p),
            );
            println!(
                "  bytes read back: first {} (9 if the HtoD reached it)",
                back[0]
            );
        }
        show("  synchronize", d.stream_synchronize(ctx, s0));
        // SAFETY: allocated above on stream 0, the copies are done, freed once.
        unsafe { d.mem_free_async(ctx, p, s0)? };
        d.stream_synchronize(ctx, s0)?;
        // SAFETY: nothing of the pool is outstanding; destroyed once.
        unsafe { d.mem_pool_destroy(ctx, pool)? };
    }
    free(d, ctx, dmem)?;
    println!(
        "\n-- a managed-memory pool: device free memory through allocation, free, trim, destroy"
    );
    let info = |what: &str| {
        println!(
            "  {what:<44} device free {:?}",
            d.mem_get_info(ctx).map(|i| i.free)
        )
    };
    for (touch, sync_before_destroy) in [(false, true), (false, false), (true, true)] {
        println!(
            "- pages touched by a set: {touch}; frees synchronised before the destroy: {sync_before_destroy}"
        );
        let pool = match d.mem_pool_create_managed(ctx, None) {
            Ok(p) => p,
            Err(e) => {
                println!("  managed pool: {e}");
                break;
            }
        };
        d.mem_pool_set_release_threshold(ctx, pool, u64::MAX)?;
        info("pool created");
        let mut held = Vec::new();
        for _ in 0..3 {
            let p = d.mem_alloc_from_pool_async(ctx, pool, 8 * mib, s0)?;
            if touch {
                // SAFETY: 8 MiB of this pool, allocated just above on stream 0.
                unsafe { d.memset_d8_async(ctx, p, 1, 8 * mib, s0)? };
            }
            held.push(p);
        }
        d.stream_synchronize(ctx, s0)?;
        info("3 x 8 MiB allocated");
        show("  usage", d.mem_pool_usage(ctx, pool));
        for p in held {
            // SAFETY: allocated above from this pool on stream 0, freed once.
            unsafe { d.mem_free_async(ctx, p, s0)? };
        }
        if sync_before_destroy {
            d.stream_synchronize(ctx, s0)?;
            info("freed");
            show("  cuMemPoolTrimTo(0)", d.mem_pool_trim_to(ctx, pool, 0));
            info("trimmed");
        }
        // SAFETY: every allocation was freed above (maybe still in flight); destroyed once.
        unsafe { d.mem_pool_destroy(ctx, pool)? };
        info("destroyed");
        d.stream_synchronize(ctx, s0)?;
        info("stream 0 synchronised after the destroy");
    }
    Ok(())
}

/// The device's default pool in a primary context made again: the first context does
/// `first` (nothing, a stream, a pool of its own, or the default pool), is released (which
/// destroys it), and a new one allocates from the default pool on a new stream, frees, and
/// synchronises. Run one variant per process (`EMM_PROBE_ONLY=default-pool-after-...`): a
/// driver that fails here may take the process down.
fn default_pool_after_a_new_context(
    d: &dyn Driver,
    dev: DeviceOrdinal,
    variant: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    let first = variant.trim_start_matches("default-pool-after-");
    let ctx = d.primary_ctx_retain(dev)?; // the retain in `run` plus this one
    show("release the probe's own retain", release(d, dev));
    let use_default = |ctx: ContextHandle, what: &str| -> Result<(), Box<dyn std::error::Error>> {
        let s = d.stream_create(ctx, 1)?;
        let pool = d.device_default_mem_pool(dev)?;
        let p = d.mem_alloc_from_pool_async(ctx, pool, 1 << 20, s)?;
        // SAFETY: allocated just above on `s`, unused, freed once.
        unsafe { d.mem_free_async(ctx, p, s)? };
        show(
            &format!("{what}: synchronize after a default-pool pair"),
            d.stream_synchronize(ctx, s),
        );
        destroy_stream(d, ctx, s)?;
        Ok(())
    };
    match first {
        "nothing" => {}
        "stream" => destroy_stream(d, ctx, d.stream_create(ctx, 1)?)?,
        "pool" => {
            let pool = d.mem_pool_create(ctx, dev, false)?;
            let p =
                d.mem_alloc_from_pool_async(ctx, pool, 1 << 20, driver_sys::StreamHandle::NULL)?;
            // SAFETY: allocated just above on stream 0, unused, freed once.
            unsafe { d.mem_free_async(ctx, p, driver_sys::StreamHandle::NULL)? };
            d.stream_synchronize(ctx, driver_sys::StreamHandle::NULL)?;
            // SAFETY: nothing of the pool is outstanding; destroyed once.
            unsafe { d.mem_pool_destroy(ctx, pool)? };
        }
        "default-pool" => use_default(ctx, "first context")?,
        other => return Err(format!("no variant {other:?}").into()),
    }
    show("release the first context (destroys it)", release(d, dev));
    let again = d.primary_ctx_retain(dev)?;
    println!("second context: {again} (first was {ctx})");
    use_default(again, "second context")?;
    show("release", release(d, dev));
    println!("default pool after {first}: survived");
    Ok(())
}

/// A pool destroyed while a block is still allocated, the block freed on a stream afterwards
/// (which the driver documents as allowed: the pool goes when its last block does), then a
/// default-pool pair on the same stream and a synchronisation: in the process's first primary
/// context, or (`second`) in one made again after the first was destroyed.
/// `EMM_PROBE_ONLY=free-after-destroy-first` or `-second`, one per process.
fn free_after_destroy(
    d: &dyn Driver,
    dev: DeviceOrdinal,
    second: bool,
) -> Result<(), Box<dyn std::error::Error>> {
    use driver_sys::MemLocation;
    let mut ctx = d.primary_ctx_retain(dev)?;
    show("release the probe's own retain", release(d, dev));
    if second {
        show("release the first context (destroys it)", release(d, dev));
        ctx = d.primary_ctx_retain(dev)?;
    }
    let s = d.stream_create(ctx, 1)?;
    let pool = d.mem_pool_create_limited(ctx, MemLocation::Device(dev), false, 64 << 20)?;
    d.mem_pool_set_release_threshold(ctx, pool, u64::MAX)?;
    let p = d.mem_alloc_from_pool_async(ctx, pool, 24 << 20, s)?;
    d.stream_synchronize(ctx, s)?;
    // SAFETY: the probe's pool, destroyed once; the block still allocated is what is probed.
    show("cuMemPoolDestroy with a block allocated", unsafe {
        d.mem_pool_destroy(ctx, pool)
    });
    // SAFETY: allocated above from the destroyed pool, unused, freed once.
    show("cuMemFreeAsync of that block", unsafe {
        d.mem_free_async(ctx, p, s)
    });
    let default = d.device_default_mem_pool(dev)?;
    let q = d.mem_alloc_from_pool_async(ctx, default, 1 << 20, s)?;
    // SAFETY: allocated just above on `s`, unused, freed once.
    unsafe { d.mem_free_async(ctx, q, s)? };
    show("synchronize", d.stream_synchronize(ctx, s));
    destroy_stream(d, ctx, s)?;
    show("release", release(d, dev));
    println!("free after destroy (second context: {second}): survived");
    Ok(())
}
