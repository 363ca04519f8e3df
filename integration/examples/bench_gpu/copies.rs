//! Pinned host memory, copies through the runtime and typed arrays, and the staged IPC copy.

use std::sync::Arc;

use crate::common::*;
use emm::Context;
use emm::driver_sys::{Driver, StreamHandle};

/// Pinned host memory: raw `cuMemHostAlloc` + `cuMemFreeHost` against the pinned host pool.
pub(crate) fn pinned(driver: &Arc<dyn Driver>) {
    let rt = runtime(driver, "default", true, vec![]);
    let ctx = rt.context(0).expect("context");
    let h = ctx.handle();
    for size in [4usize << 10, 1 << 20, 64 << 20]
        .into_iter()
        .filter(|&s| quick() || s <= 64 << 20)
    {
        let iters = if size >= 64 << 20 { 4 } else { 40 };
        let ns = per_op(if quick() { 4 } else { iters }, |n| {
            for _ in 0..n {
                let p = driver.mem_host_alloc(h, size, 0).expect("cuMemHostAlloc");
                // SAFETY: allocated just above, unused, freed once.
                unsafe { driver.mem_free_host(h, p) }.expect("cuMemFreeHost");
            }
        });
        out("pinned", "cuMemHostAlloc", size, 1, ns, "ns");
        let ns = per_op(if quick() { 10_000 } else { 200_000 }, |n| {
            for _ in 0..n {
                drop(
                    ctx.memhostalloc(size, false, false, false)
                        .expect("memhostalloc"),
                );
            }
        });
        out("pinned", "pinned-pool", size, 1, ns, "ns");
    }
    ctx.trim().expect("trim");
}

/// Copy bandwidth, host to device: pinned (the pinned pool's memory) against pageable, through
/// emm and through the raw driver; device to device likewise.
pub(crate) fn copies(driver: &Arc<dyn Driver>) {
    let rt = runtime(driver, "pool", true, vec![]);
    let ctx = rt.context(0).expect("context");
    let h = ctx.handle();
    let max = if quick() { 64 << 20 } else { 1 << 30 }.min(*TOTAL.get().expect("set by main") / 8);
    let mut size = 1usize << 10;
    while size <= max {
        let dev = ctx.memalloc(size).expect("memalloc");
        let dev2 = ctx.memalloc(size).expect("memalloc");
        let pinned = ctx.memhostalloc(size, false, false, false).expect("pinned");
        let pageable = vec![1u8; size];
        let iters = ((1usize << 30) / size).clamp(3, 2000) / if quick() { 10 } else { 1 };
        let iters = iters.max(3);
        let gbs = |ns: f64| size as f64 / ns;
        let ns = per_op(iters, |n| {
            for _ in 0..n {
                ctx.copy_pinned_to_device(&dev, &pinned, size)
                    .expect("copy");
            }
        });
        out("copy-htod", "emm pinned", size, 1, gbs(ns), "GB/s");
        let ns = per_op(iters, |n| {
            for _ in 0..n {
                // SAFETY: `pinned` is live host memory of `size` bytes; `dev` is live device
                // memory of `size` bytes; nothing else uses either during the copy.
                unsafe {
                    driver.memcpy_htod(
                        h,
                        dev.device_ptr(),
                        std::slice::from_raw_parts(pinned.host_ptr().0 as *const u8, size),
                    )
                }
                .expect("cuMemcpyHtoD");
            }
        });
        out("copy-htod", "raw pinned", size, 1, gbs(ns), "GB/s");
        let ns = per_op(iters, |n| {
            for _ in 0..n {
                // SAFETY: `pinned` is live host memory of `size` bytes that nothing else reads
                // or writes during the copy; `dev` is live device memory of `size` bytes.
                unsafe {
                    driver.memcpy_dtoh(
                        h,
                        std::slice::from_raw_parts_mut(pinned.host_ptr().0 as *mut u8, size),
                        dev.device_ptr(),
                    )
                }
                .expect("cuMemcpyDtoH");
            }
        });
        out("copy-dtoh", "raw pinned", size, 1, gbs(ns), "GB/s");
        let ns = per_op(iters, |n| {
            for _ in 0..n {
                ctx.copy_to_device(&dev, &pageable).expect("copy");
            }
        });
        out("copy-htod", "emm pageable", size, 1, gbs(ns), "GB/s");
        let ns = per_op(iters, |n| {
            for _ in 0..n {
                ctx.copy_device(&dev2, &dev, size).expect("copy");
            }
            // Device-to-device copies return before they finish: the batch ends with a
            // synchronisation, inside the timing.
            driver
                .stream_synchronize(h, StreamHandle::NULL)
                .expect("sync");
        });
        out("copy-dtod", "emm", size, 1, gbs(ns), "GB/s");
        let ns = per_op(iters, |n| {
            for _ in 0..n {
                // SAFETY: both are live device allocations of `size` bytes that do not overlap.
                unsafe { driver.memcpy_dtod(h, dev2.device_ptr(), dev.device_ptr(), size) }
                    .expect("cuMemcpyDtoD");
            }
            driver
                .stream_synchronize(h, StreamHandle::NULL)
                .expect("sync");
        });
        out("copy-dtod", "raw", size, 1, gbs(ns), "GB/s");
        typed_copies(&ctx, size, iters);
        size *= 8;
    }
    ctx.trim().expect("trim");
}

/// The same copies through `emm_array`'s typed arrays (f32 elements), beside the raw figures
/// `copies` prints for the size: host to device from a page-locked slice (`with_pinned`), from
/// pageable memory, device to host into the pinned slice, and device to device.
pub(crate) fn typed_copies(ctx: &Context, size: usize, iters: usize) {
    use emm_array::{DeviceArray, Order, with_pinned};
    let n = size / 4;
    let gbs = |ns: f64| size as f64 / ns;
    let a = DeviceArray::<f32>::new(ctx, &[n], Order::C).expect("array");
    let b = DeviceArray::<f32>::new(ctx, &[n], Order::C).expect("array");
    let mut host = vec![1f32; n];
    with_pinned(ctx, &mut host, |pinned| {
        let ns = per_op(iters, |k| {
            for _ in 0..k {
                pinned.copy_to_device(ctx, &a).expect("copy");
            }
        });
        out("copy-htod", "array pinned", size, 1, gbs(ns), "GB/s");
        let ns = per_op(iters, |k| {
            for _ in 0..k {
                pinned.copy_from_device(ctx, &a).expect("copy");
            }
        });
        out("copy-dtoh", "array pinned", size, 1, gbs(ns), "GB/s");
    })
    .expect("pin");
    let ns = per_op(iters, |k| {
        for _ in 0..k {
            a.copy_from_host(ctx, &host).expect("copy");
        }
    });
    out("copy-htod", "array pageable", size, 1, gbs(ns), "GB/s");
    let ns = per_op(iters, |k| {
        for _ in 0..k {
            b.copy_to_device(ctx, &a).expect("copy");
        }
        ctx.default_stream().synchronize().expect("sync");
    });
    out("copy-dtod", "array", size, 1, gbs(ns), "GB/s");
}

/// GB/s of the raw `cuMemcpyDtoD` of all of `src` into `dst`, issued in `ctx` (median of 5
/// batches, each ending with a synchronisation of `ctx`).
pub(crate) fn raw_dtod_gbs(
    driver: &dyn Driver,
    ctx: &Context,
    dst: &emm::MemoryPointer,
    src: &emm::MemoryPointer,
) -> f64 {
    let size = src.size();
    let iters = if size >= 256 << 20 { 5 } else { 50 };
    let ns = per_op(iters, |n| {
        for _ in 0..n {
            // SAFETY: both are live allocations of `size` bytes that do not overlap (unified
            // addressing: another device's memory is addressable from `ctx`), and nothing else
            // touches them during the copy.
            unsafe { driver.memcpy_dtod(ctx.handle(), dst.device_ptr(), src.device_ptr(), size) }
                .expect("cuMemcpyDtoD");
        }
        driver
            .stream_synchronize(ctx.handle(), StreamHandle::LEGACY)
            .expect("sync");
    });
    size as f64 / ns
}

/// The staged IPC open across devices (issue 14): memory exported on device 0 and opened on
/// device 1 by another process through `IpcHandle::open_staged` (mapped in device 0's
/// context, allocated on device 1 by the other process's `default` manager, copied), median of
/// 5 opens each synchronised, as GB/s of the exported size; beside it, in this process and
/// the same run, the raw `cuMemcpyDtoD` from device 0 to device 1 and within device 0. Needs
/// two devices (on the simulator, a machine of two is made for it).
pub(crate) fn staged_ipc(driver: &Arc<dyn Driver>, simulated: bool) {
    let sim = simulated.then(|| {
        let device = || driver_mock::SimDeviceConfig::new(1 << 30);
        Arc::new(driver_mock::SimDriver::new(
            driver_mock::SimConfig::with_devices(vec![device(), device()]),
        ))
    });
    let driver = match &sim {
        Some(sim) => Arc::clone(sim) as Arc<dyn Driver>,
        None => Arc::clone(driver),
    };
    let rt = runtime(&driver, "default", false, vec![]);
    let devices = rt.device_count().expect("device count");
    if devices < 2 {
        eprintln!(
            "bench_gpu: the ipc section needs two devices and this machine has {devices}: not measured"
        );
        return;
    }
    let (c0, c1) = (
        rt.context(0).expect("device 0"),
        rt.context(1).expect("device 1"),
    );
    let total = c0.get_memory_info().expect("memory info").total;
    let sizes: Vec<usize> = [1usize << 20, 16 << 20, 256 << 20, 1 << 30]
        .into_iter()
        .filter(|&s| s <= total / 8)
        .collect();
    let mut exported = Vec::new();
    for &size in &sizes {
        let mem = c0.memalloc(size).expect("memalloc on device 0");
        c0.memset(&mem, 7, size).expect("memset");
        let bytes = c0.get_ipc_handle(&mem).expect("get_ipc_handle").to_bytes();
        let to1 = c1.memalloc(size).expect("memalloc on device 1");
        let to0 = c0.memalloc(size).expect("memalloc on device 0");
        let across = raw_dtod_gbs(driver.as_ref(), &c1, &to1, &mem);
        out(
            "ipc-staged",
            "raw cuMemcpyDtoD device 0 -> 1",
            size,
            1,
            across,
            "GB/s",
        );
        let within = raw_dtod_gbs(driver.as_ref(), &c0, &to0, &mem);
        out(
            "ipc-staged",
            "raw cuMemcpyDtoD within device 0",
            size,
            1,
            within,
            "GB/s",
        );
        exported.push((mem, bytes, to1));
    }
    // The same copy across devices with peer access granted (device 1's context to device
    // 0's), as `Context::copy_peer` asks for it.
    if let Err(e) = driver.ctx_enable_peer_access(c1.handle(), c0.handle()) {
        eprintln!("bench_gpu: peer access from device 1 to device 0: {e}");
    }
    for (mem, _, to1) in &exported {
        let subject = "raw cuMemcpyDtoD device 0 -> 1 peer access granted";
        let gbs = raw_dtod_gbs(driver.as_ref(), &c1, to1, mem);
        out("ipc-staged", subject, mem.size(), 1, gbs, "GB/s");
    }
    let handles: Vec<Vec<u8>> = exported.iter().map(|(_, b, _)| b.clone()).collect();
    let times = integration::time_staged_opens(sim.as_ref(), &handles, 1, 5)
        .expect("staged opens in another process");
    for (&size, ns) in sizes.iter().zip(times) {
        out(
            "ipc-staged",
            "open_staged in another process device 0 -> 1",
            size,
            1,
            size as f64 / ns,
            "GB/s",
        );
        out(
            "ipc-staged-ns",
            "open_staged in another process device 0 -> 1",
            size,
            1,
            ns,
            "ns",
        );
    }
}
