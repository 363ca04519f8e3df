//! emm's streams and events (Numba's stream kinds, events and `auto_synchronize`), on both
//! targets. A stream is held back with `cuStreamWaitValue32` on a flag in mapped pinned memory,
//! so that "not done yet" is certain on the GPU as on the simulator.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use emm::EmmError;
use emm::driver_sys::{Driver, StreamHandle, wait_value};
use emm::streams::StreamKind;
use integration::{Target, TestCtx};
use libtest_mimic::Failed;

/// A flag word in mapped pinned memory: the host writes it, a stream waits on it.
struct Flag {
    mem: emm::HostMemory,
}

impl Flag {
    fn new(ctx: &emm::Context) -> Result<Flag, Failed> {
        let mem = ctx.memhostalloc(64, true, false, false)?;
        mem.write(0, &0u32.to_le_bytes())?;
        Ok(Flag { mem })
    }

    /// Holds `stream` until the flag is 1.
    fn hold(
        &self,
        driver: &dyn Driver,
        ctx: &emm::Context,
        stream: &emm::Stream,
    ) -> Result<(), Failed> {
        let at = self.mem.mapped().ok_or("mapped")?.device().device_ptr();
        driver.stream_wait_value32(ctx.handle(), stream.handle(), at, 1, wait_value::EQ)?;
        Ok(())
    }

    fn release(&self) -> Result<(), Failed> {
        self.mem.write(0, &1u32.to_le_bytes())?;
        Ok(())
    }
}

/// The stream kinds: created (blocking or not, with a priority clamped into the range), the
/// legacy and per-thread default streams, and an external stream that emm never destroys.
pub fn stream_kinds(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let (least, greatest) = ctx.stream_priority_range()?;
    let s = ctx.create_stream_with(true, greatest - 10)?;
    ensure_eq!(
        s.kind(),
        StreamKind::Created {
            non_blocking: true,
            priority: greatest
        }
    );
    ensure_eq!(s.priority()?, greatest);
    let low = ctx.create_stream_with(false, least + 10)?;
    ensure_eq!(low.priority()?, least);
    let plain = ctx.create_stream()?;
    ensure_eq!(
        plain.kind(),
        StreamKind::Created {
            non_blocking: false,
            priority: 0
        }
    );
    let legacy = ctx.legacy_default_stream();
    ensure_eq!(legacy.kind(), StreamKind::LegacyDefault);
    ensure_eq!(legacy.handle(), StreamHandle::LEGACY);
    ensure_eq!(ctx.default_stream().handle(), StreamHandle::LEGACY);
    let per_thread = ctx.per_thread_default_stream();
    ensure_eq!(per_thread.kind(), StreamKind::PerThreadDefault);
    for stream in [&s, &low, &plain, &legacy, &per_thread] {
        stream.synchronize()?;
        ensure!(stream.query()?, "{stream:?} has nothing pending");
    }
    // An external stream: used, dropped, and still alive for its owner.
    let raw = t.driver.stream_create(ctx.handle(), 0)?;
    // SAFETY: `raw` is a stream of this context, destroyed below after the wrapper is gone.
    let external = unsafe { ctx.external_stream(raw) };
    ensure_eq!(external.kind(), StreamKind::External);
    external.synchronize()?;
    drop(external);
    ctx.flush_deallocations()?;
    ensure!(
        t.driver.stream_query(ctx.handle(), raw)?,
        "emm did not destroy it"
    );
    // SAFETY: created above, destroyed once, nothing uses it any more.
    unsafe { t.driver.stream_destroy(ctx.handle(), raw)? };
    Ok(())
}

/// Events and host functions on a held stream: nothing after the hold is done, and the
/// queries say so; `auto_synchronize` waits for all of it once the flag is written; events
/// time the work; a stream may wait for an event.
pub fn events_host_functions_and_auto_synchronize(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let flag = Flag::new(&ctx)?;
    let a = ctx.create_stream_with(true, 0)?;
    let b = ctx.create_stream_with(true, 0)?;
    let (start, end) = (ctx.create_event(true)?, ctx.create_event(true)?);
    ensure!(end.query()?, "an event never recorded is done");
    let ran = Arc::new(AtomicU32::new(0));
    let checks = (|| -> Result<(), Failed> {
        start.record(&a)?;
        flag.hold(t.driver.as_ref(), &ctx, &a)?;
        let r = Arc::clone(&ran);
        a.launch_host_func(move || {
            r.fetch_add(1, Ordering::SeqCst);
        })?;
        a.record(&end)?;
        b.wait_event(&end)?;
        let r = Arc::clone(&ran);
        b.launch_host_func(move || {
            r.fetch_add(10, Ordering::SeqCst);
        })?;
        ensure!(!a.query()? && !b.query()?, "held work is pending");
        ensure!(!end.query()?, "the event after the hold is pending");
        ensure_eq!(ran.load(Ordering::SeqCst), 0);
        flag.release()?;
        {
            let _a = a.auto_synchronize();
            let guard = b.auto_synchronize();
            guard.finish()?;
        }
        ensure_eq!(ran.load(Ordering::SeqCst), 11, "both host functions ran");
        ensure!(end.query()? && a.query()?, "done after auto_synchronize");
        let took = end.elapsed_since(&start)?;
        ensure!(took.as_secs() < 60, "elapsed {took:?}");
        let untimed = ctx.create_event(false)?;
        ensure!(!untimed.is_timing());
        untimed.record(&a)?;
        untimed.synchronize()?;
        match untimed.elapsed_since(&start) {
            Err(EmmError::Driver { .. }) => {}
            other => return Err(format!("timing an untimed event: {other:?}").into()),
        }
        Ok(())
    })();
    // Whatever happened, release the held stream before it is synchronised or destroyed.
    flag.release()?;
    a.synchronize()?;
    b.synchronize()?;
    checks
}

/// After a device reset, a stream and an event of the old context refuse work with a clear
/// error instead of reaching a destroyed context.
pub fn streams_refuse_work_after_a_reset(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let s = ctx.create_stream()?;
    let e = ctx.create_event(false)?;
    t.runtime.reset_device(0)?;
    for r in [s.synchronize(), e.synchronize(), s.record(&e)] {
        match r {
            Err(EmmError::Stale { .. }) => {}
            other => return Err(format!("after a reset: {other:?}").into()),
        }
    }
    Ok(())
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(7).wrapping_add(seed))
        .collect()
}

/// Asynchronous copies through emm: page-locked host memory travels with the work and comes
/// back from `wait`; device to device and a set in stream order; held work has not run (a
/// synchronous read of the destination on another stream still sees the old bytes) and runs
/// once the hold is released.
pub fn async_copies_in_stream_order(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let len = 64 << 10;
    let s = ctx.create_stream_with(true, 0)?;
    let (d1, d2) = (ctx.memalloc(len)?, ctx.memalloc(len)?);
    let data = pattern(len, 3);
    let h1 = ctx.memhostalloc(len, false, false, false)?;
    h1.write(0, &data)?;
    let up = ctx.copy_to_device_async(&d1, h1, &s)?;
    let across = ctx.copy_device_async(&d2, &d1, &s)?;
    let down = ctx.copy_to_host_async(ctx.memhostalloc(len, true, false, false)?, &d2, &s)?;
    let h1 = up.wait()?;
    across.wait()?;
    let h2 = down.wait()?;
    let mut back = vec![0u8; len];
    h2.read(0, &mut back)?;
    ensure!(back == data, "host → device → device → host round trip");
    ctx.memset_async(&d1, 9, &s)?.wait()?;
    ctx.copy_to_host(&mut back, &d1)?;
    ensure!(back.iter().all(|&b| b == 9), "the set ran");

    // Held work has not run.
    let flag = Flag::new(&ctx)?;
    let other = pattern(len, 101);
    h1.write(0, &other)?;
    flag.hold(t.driver.as_ref(), &ctx, &s)?;
    let queued = ctx.copy_to_device_async(&d1, h1, &s);
    let checks = (|| -> Result<(), Failed> {
        let queued = queued?;
        ensure!(!queued.is_done()?, "the copy waits behind the hold");
        ctx.copy_to_host(&mut back, &d1)?;
        ensure!(
            back.iter().all(|&b| b == 9),
            "the destination still holds the set's bytes"
        );
        flag.release()?;
        drop(queued.wait()?);
        ctx.copy_to_host(&mut back, &d1)?;
        ensure!(back == other, "the copy ran once released");
        Ok(())
    })();
    flag.release()?;
    s.synchronize()?;
    checks?;

    // Pageable memory goes through the explicit, waiting calls.
    let plain = pattern(len, 55);
    ctx.copy_to_device_on(&d2, &plain, &s)?;
    let mut seen = vec![0u8; len];
    ctx.copy_to_host_on(&mut seen, &d2, &s)?;
    ensure!(seen == plain, "pageable round trip on a stream");

    // Host memory smaller than the copy is refused before anything is queued.
    let small = ctx.memhostalloc(16, false, false, false)?;
    match ctx.copy_to_device_async(&d1, small, &s) {
        Err(EmmError::OutOfBounds { .. }) => {}
        other => return Err(format!("a short source: {other:?}").into()),
    }
    Ok(())
}

/// What one run of the cross-stream scenario saw.
#[derive(Debug)]
struct Reuse {
    /// A block handed to stream B (which nothing orders after A) overlapped the block
    /// stream A still used. (Stream C, where the block of `RecordedByA` is freed, waits for
    /// A's work in its own order, so a block reused there is ordered; its bytes are checked.)
    overlapped: bool,
    /// Stream B's bytes were intact at the end (A's late write did not land on them).
    intact: bool,
    /// B's and C's work ran before the flag was written (always on the simulator; on the GPU
    /// unless something made them wait: a dependency the driver inserted, or a tool such as
    /// compute-sanitizer that serialises work).
    ran_first: bool,
}

/// How the block of the scenario reaches stream A.
#[derive(Clone, Copy, Debug)]
enum Use {
    /// Allocated on A and freed there.
    FreedOnA,
    /// Allocated on stream C, used by A (`record_stream`), freed on C.
    RecordedByA,
}

/// Waits (at most a few seconds) for stream `s` to finish what it can: the simulator runs its
/// queues; on the GPU, work not held up by anything finishes by itself. A stream that the
/// driver made wait for the held stream (a dependency it inserts when it reuses a block) is
/// left waiting; that is not an error.
fn let_run(t: &TestCtx, s: &emm::Stream) -> Result<bool, Failed> {
    if let Some(sim) = t.sim() {
        sim.run_streams();
        return Ok(s.query()?);
    }
    let until = std::time::Instant::now() + std::time::Duration::from_secs(3);
    while !s.query()? {
        if std::time::Instant::now() >= until {
            return Ok(false);
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    Ok(true)
}

/// Stream A is held on a flag; a block A still writes (a set queued behind the hold) is freed;
/// stream B then allocates blocks of the same size and sets them. Reports whether B got A's
/// block before the flag was written, and whether B's bytes survived A's late write.
fn cross_stream_scenario(t: &TestCtx, how: Use) -> Result<Reuse, Failed> {
    let ctx = t.context()?;
    let len = 256 << 10;
    let (a, b, c) = (
        ctx.create_stream_with(true, 0)?,
        ctx.create_stream_with(true, 0)?,
        ctx.create_stream_with(true, 0)?,
    );
    let flag = Flag::new(&ctx)?;
    flag.hold(t.driver.as_ref(), &ctx, &a)?;
    let run = (|| -> Result<Reuse, Failed> {
        let x = match how {
            Use::FreedOnA => ctx.memalloc_on(len, &a)?,
            Use::RecordedByA => {
                let x = ctx.memalloc_on(len, &c)?;
                x.record_stream(&a)?;
                x
            }
        };
        let (lo, hi) = (x.device_ptr().0, x.device_ptr().0 + len as u64);
        // Behind the hold, A still writes x after its last pointer is gone, as a kernel
        // launched on A would (emm's own `memset_async` would keep x alive instead).
        // SAFETY: x is live memory of this context of `len` bytes; whether it stays live
        // until the set runs is what the manager under test must ensure, and the simulator
        // and the check below catch it when it does not (the memory stays allocated to the
        // manager either way, so the write lands in the process's own memory).
        unsafe {
            t.driver
                .memset_d8_async(ctx.handle(), x.device_ptr(), 0xAA, len, a.handle())?
        };
        drop(x);
        let mut taken = Vec::new();
        let mut overlapped = false;
        let streams: &[&emm::Stream] = match how {
            Use::FreedOnA => &[&b, &b, &b],
            Use::RecordedByA => &[&b, &c, &b],
        };
        for s in streams {
            let y = ctx.memalloc_on(len, s)?;
            let p = y.device_ptr().0;
            overlapped |= std::ptr::eq(*s, &b) && p < hi && lo < p + len as u64;
            // SAFETY: y is live memory of this context of `len` bytes, kept in `taken` until
            // every stream was synchronised below.
            unsafe {
                t.driver
                    .memset_d8_async(ctx.handle(), y.device_ptr(), 0x55, len, s.handle())?
            };
            taken.push((y, *s));
        }
        let ran_first = let_run(t, &b)? & let_run(t, &c)?;
        flag.release()?;
        a.synchronize()?;
        b.synchronize()?;
        c.synchronize()?;
        let mut intact = true;
        let mut back = vec![0u8; len];
        for (y, _) in &taken {
            ctx.copy_to_host(&mut back, y)?;
            intact &= back.iter().all(|&v| v == 0x55);
        }
        Ok(Reuse {
            overlapped,
            intact,
            ran_first,
        })
    })();
    flag.release()?;
    a.synchronize()?;
    b.synchronize()?;
    c.synchronize()?;
    run
}

/// The shipped managers' stream-ordered memory under the scenario: a block freed on a stream
/// (or used by a recorded stream) is never reused under that stream's pending work, unless
/// the stream that reuses it waits for that work on the GPU. Each manager is built here (the
/// suite's manager setting is ignored), so one run covers all. `pool` may hand a busy
/// stream's wholly free chunk to B after making B wait for A's work (`cuStreamWaitEvent`), and
/// under `async-pool` the driver may hand the block to B with a dependency on A's free (it is
/// allowed to): a block B received while A was held is then one whose work on B did not run
/// before A's, and B's bytes survive. The simulator's model of the driver's pool inserts no
/// such dependency: there `async-pool` is held to the address.
pub fn cross_stream_reuse(target: Target) -> Result<(), Failed> {
    for manager in ["default", "pool", "async-pool"] {
        for how in [Use::FreedOnA, Use::RecordedByA] {
            let t = TestCtx::with(target, |b| b.memory_manager_name(manager))?;
            let ordering = t.context()?.stream_ordering();
            let seen = cross_stream_scenario(&t, how)?;
            ensure!(
                seen.intact,
                "{manager} ({ordering:?}), {how:?}: stream B's bytes were overwritten by A's held work"
            );
            ensure!(
                !(seen.overlapped && seen.ran_first),
                "{manager} ({ordering:?}), {how:?}: stream B received memory A may still use, and nothing made B wait for A"
            );
            let model = ordering == emm::contract::StreamOrdering::Driver && t.sim().is_some();
            ensure!(
                !(model && seen.overlapped),
                "{manager} ({ordering:?}), {how:?}: the simulator's driver pool handed B memory A may still use"
            );
        }
    }
    Ok(())
}

/// The scenario can fail: a manager that puts a freed block straight back on one free list,
/// whatever the stream, hands A's block to B, and B's bytes are overwritten when A runs
/// (where B's work ran first: under compute-sanitizer on the GPU it does not, and the bytes
/// survive by luck, so only the address tells).
pub fn cross_stream_check_catches_early_reuse(target: Target) -> Result<(), Failed> {
    let t = TestCtx::with(target, |b| b.memory_manager(eager::factory()))?;
    let seen = cross_stream_scenario(&t, Use::FreedOnA)?;
    ensure!(
        seen.overlapped,
        "the eager manager reused the block: {seen:?}"
    );
    ensure!(
        !seen.ran_first || !seen.intact,
        "and B's bytes were lost: {seen:?}"
    );
    ensure!(
        t.sim().is_none() || seen.ran_first,
        "the simulator ran B first: {seen:?}"
    );
    Ok(())
}

/// A deliberately wrong stream-ordered plugin: one free list, no regard for streams.
mod eager {
    use std::sync::{Arc, Mutex};

    use emm::contract::{FnFactory, ManagerContext};
    use emm::driver_sys::{DevicePtr, StreamHandle};
    use emm::plugin::{DeviceAllocator, HostLayer, HostOnly, ReleaseHook};
    use emm::streams::StreamUse;
    use emm::{EmmError, MemoryPointer};

    #[derive(Debug, Default)]
    struct Free(Mutex<Vec<(u64, usize)>>);

    impl ReleaseHook for Free {
        fn release(&self, base: DevicePtr, size: usize, _tag: u64) {
            self.0.lock().unwrap().push((base.0, size));
        }

        fn release_on_streams(&self, base: DevicePtr, size: usize, tag: u64, _: StreamUse) {
            self.release(base, size, tag); // the mistake under test
        }

        fn is_live(&self, _tag: u64) -> bool {
            true
        }
    }

    #[derive(Debug)]
    struct Eager {
        cx: ManagerContext,
        free: Arc<Free>,
        all: Mutex<Vec<u64>>,
    }

    impl DeviceAllocator for Eager {
        fn memalloc(&self, host: &HostLayer, bytes: usize) -> Result<MemoryPointer, EmmError> {
            self.memalloc_on(host, bytes, StreamHandle::NULL)
        }

        fn memalloc_on(
            &self,
            _host: &HostLayer,
            bytes: usize,
            stream: StreamHandle,
        ) -> Result<MemoryPointer, EmmError> {
            let cx = &self.cx;
            let reuse = {
                let mut free = self.free.0.lock().unwrap();
                let found = free.iter().position(|&(_, s)| s == bytes);
                found.map(|k| free.swap_remove(k).0)
            };
            let base = match reuse {
                Some(b) => DevicePtr(b),
                None => {
                    let _live = cx.enter("memalloc_on")?;
                    let b = cx
                        .driver
                        .mem_alloc(cx.context, bytes)
                        .map_err(|e| cx.driver_error("memalloc_on", e))?;
                    self.all.lock().unwrap().push(b.0);
                    b
                }
            };
            let hook = Arc::clone(&self.free) as Arc<dyn ReleaseHook>;
            // SAFETY: `base` came from `cuMemAlloc` (or the plugin's free list of such blocks) for
            // at least `bytes` bytes, handed out once; the hook takes it back.
            Ok(unsafe {
                MemoryPointer::with_hook_on(cx.device, cx.context, base, bytes, hook, 0, stream)
            })
        }

        fn initialize(&self, _host: &HostLayer) -> Result<(), EmmError> {
            Ok(())
        }

        fn reset(&self, _host: &HostLayer) -> Result<(), EmmError> {
            let cx = &self.cx;
            let Some(_live) = cx.liveness.enter() else {
                return Ok(());
            };
            self.free.0.lock().unwrap().clear();
            for b in self.all.lock().unwrap().drain(..) {
                // SAFETY: allocated above by `cuMemAlloc`, freed once (drained), and every
                // pointer to it is gone when the manager is reset at the end of the test.
                unsafe { cx.driver.mem_free(cx.context, DevicePtr(b)) }
                    .map_err(|e| cx.driver_error("reset", e))?;
            }
            Ok(())
        }
    }

    pub fn factory() -> FnFactory {
        FnFactory::new("eager-reuse", |cx: &ManagerContext| {
            let eager = Eager {
                cx: cx.clone(),
                free: Arc::default(),
                all: Mutex::new(Vec::new()),
            };
            Ok(Box::new(HostOnly::new(cx, eager)))
        })
    }
}

/// cuda.core's device memory resource: a pool of its own with `max_size` (an allocation past
/// it is refused with an error that names the limit, and fits again once a buffer was freed on
/// its stream), its attributes (current and high-water figures, reset), `deallocate` on a
/// stream, `close` (allocations refused after it; a buffer still live is freed later without
/// a refused call), and the device's default pool, which emm does not own or destroy.
pub fn device_memory_resource_conformance(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let s = ctx.create_stream_with(true, 0)?;
    let mib = 1usize << 20;
    let mr = ctx.device_memory_resource(emm::DeviceMemoryResourceOptions {
        // A multiple of 32 MiB: the driver rounds a pool's limit up to one.
        max_size: 64 * mib,
        ipc_enabled: false,
    })?;
    ensure!(mr.is_handle_owned() && !mr.is_ipc_enabled());
    let a = mr.allocate(48 * mib, &s)?;
    ctx.memset_async(&a, 1, &s)?.wait()?;
    match mr.allocate(24 * mib, &s) {
        Err(EmmError::InvalidArgument { reason, .. }) => {
            ensure!(reason.contains("max_size"), "{reason}")
        }
        other => return Err(format!("past max_size: {other:?}").into()),
    }
    let at = mr.attributes()?;
    ensure!(
        at.used >= 48 * mib as u64 && at.reserved <= 64 * mib as u64 && at.used_high >= at.used,
        "{at:?}"
    );
    ensure_eq!(
        at.release_threshold,
        u64::MAX,
        "cached, as cuda.core's pools are"
    );
    mr.deallocate(a, &s)?;
    s.synchronize()?;
    let b = mr.allocate(24 * mib, &s)?;
    mr.reset_high_water()?;
    let after = mr.attributes()?;
    ensure!(
        after.used_high >= 24 * mib as u64 && after.used_high <= at.used_high,
        "{after:?} after the reset, {at:?} before"
    );
    mr.close()?;
    mr.close()?;
    match mr.allocate(mib, &s) {
        Err(EmmError::InvalidArgument { reason, .. }) => {
            ensure!(reason.contains("closed"), "{reason}")
        }
        other => return Err(format!("after close: {other:?}").into()),
    }
    // Freed after the close: a refused free would fail the test (the suite counts them).
    drop(b);
    s.synchronize()?;

    let default = ctx.default_device_memory_resource()?;
    ensure!(!default.is_handle_owned());
    let c = default.allocate(mib, &s)?;
    default.close()?;
    drop(c);
    s.synchronize()?;
    let pool = t.driver.device_default_mem_pool(ctx.device())?;
    ensure_eq!(pool, default.handle(), "the same pool");
    let p = t
        .driver
        .mem_alloc_from_pool_async(ctx.handle(), pool, mib, s.handle())?;
    // SAFETY: allocated just above on `s`, unused, freed once.
    unsafe { t.driver.mem_free_async(ctx.handle(), p, s.handle())? };
    s.synchronize()?;
    Ok(())
}

/// cuda.core's pinned memory resource: a pool in host memory whose buffers are one address
/// for the host and the device. Bytes the host writes reach device memory through a copy on
/// the device; a set queued on a stream reaches the host once the stream is done; the pool's
/// figures count the buffer; it is freed on a stream, and the pool closes.
pub fn pinned_memory_resource_conformance(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let s = ctx.create_stream_with(true, 0)?;
    let len = 1usize << 20;
    let mr = ctx.pinned_memory_resource(emm::PinnedMemoryResourceOptions::default())?;
    ensure!(mr.is_handle_owned() && mr.numa_id().is_none());
    let buf = mr.allocate(len, &s)?;
    s.synchronize()?;
    let data = pattern(len, 17);
    buf.write(0, &data)?;
    let mapped = buf.mapped().ok_or("a pinned resource's buffer is mapped")?;
    ensure_eq!(
        mapped.host_ptr().0 as u64,
        mapped.device().device_ptr().0,
        "one address for the host and the device"
    );
    let d = ctx.memalloc(len)?;
    ctx.copy_device_async(&d, mapped.device(), &s)?.wait()?;
    let mut back = vec![0u8; len];
    ctx.copy_to_host(&mut back, &d)?;
    ensure!(back == data, "host bytes reached the device");
    ctx.memset_async(mapped.device(), 7, &s)?.wait()?;
    buf.read(0, &mut back)?;
    ensure!(
        back.iter().all(|&b| b == 7),
        "the device's set reached the host"
    );
    let at = mr.attributes()?;
    ensure!(at.used >= len as u64 && at.used_high >= at.used, "{at:?}");
    mr.deallocate(buf, &s)?;
    s.synchronize()?;
    mr.close()?;
    Ok(())
}

/// cuda.core's managed memory resource (a managed-memory pool, CUDA 13 on): one address for
/// the host and the device; the host's bytes reach device memory through a copy on the device,
/// a set on a stream reaches the host once the stream is done; a preferred location is
/// accepted; freed on a stream; the pool closes.
pub fn managed_memory_resource_conformance(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let s = ctx.create_stream_with(true, 0)?;
    let len = 1usize << 20;
    let mr = ctx.managed_memory_resource(emm::ManagedMemoryResourceOptions::default())?;
    ensure!(mr.is_handle_owned() && mr.preferred_location().is_none());
    let buf = mr.allocate(len, &s)?;
    s.synchronize()?;
    let data = pattern(len, 29);
    buf.write(0, &data)?;
    let d = ctx.memalloc(len)?;
    ctx.copy_device_async(&d, buf.device(), &s)?.wait()?;
    let mut back = vec![0u8; len];
    ctx.copy_to_host(&mut back, &d)?;
    ensure!(back == data, "host bytes reached the device");
    ctx.memset_async(buf.device(), 3, &s)?.wait()?;
    buf.read(0, &mut back)?;
    ensure!(
        back.iter().all(|&b| b == 3),
        "the device's set reached the host"
    );
    ensure!(mr.attributes()?.used >= len as u64);
    mr.deallocate(buf, &s)?;
    s.synchronize()?;
    mr.close()?;
    let on_device = ctx.managed_memory_resource(emm::ManagedMemoryResourceOptions {
        preferred_location: Some(emm::driver_sys::MemLocation::Device(ctx.device())),
    })?;
    drop(on_device.allocate(4096, &s)?);
    s.synchronize()?;
    on_device.close()?;
    Ok(())
}

/// `memhostalloc` from the driver's pool in host memory (`host_memory_pool`, what cuda.core's
/// pinned resource allocates from) under the suite's manager: mapped memory is one address
/// for the host and the device, and bytes go both ways through it; unmapped memory serves a
/// pinned copy; a reset frees what is live.
pub fn memhostalloc_from_the_host_memory_pool(target: Target) -> Result<(), Failed> {
    let t = TestCtx::with(target, |b| b.pinned_host_pool(None).host_memory_pool(true))?;
    let ctx = t.context()?;
    let len = 256usize << 10;
    let mapped = ctx.memhostalloc(len, true, false, false)?;
    let m = mapped.mapped().ok_or("mapped")?;
    ensure_eq!(m.host_ptr().0 as u64, m.device().device_ptr().0);
    let data = pattern(len, 41);
    mapped.write(0, &data)?;
    let d = ctx.memalloc(len)?;
    ctx.copy_device(&d, m.device(), len)?;
    let mut back = vec![0u8; len];
    ctx.copy_to_host(&mut back, &d)?;
    ensure!(back == data, "host bytes reached the device");
    ctx.memset(m.device(), 2, len)?;
    mapped.read(0, &mut back)?;
    ensure!(
        back.iter().all(|&b| b == 2),
        "the device's set reached the host"
    );
    let plain = ctx.memhostalloc(len, false, false, false)?;
    plain.write(0, &data)?;
    ctx.copy_pinned_to_device(&d, &plain, len)?;
    ctx.copy_to_host(&mut back, &d)?;
    ensure!(back == data, "a pinned copy from unmapped pool memory");
    let live = ctx.memhostalloc(4096, true, false, false)?;
    ctx.reset()?;
    ensure!(!live.mapped().ok_or("mapped")?.device().is_live());
    Ok(())
}

/// cuda.core's IPC of memory resources between processes: an IPC-enabled device resource and
/// an IPC-enabled pinned resource (on the device's host NUMA node, or node 0 where the device
/// names none) send their pool to another process as an allocation handle; there it becomes a
/// mapped resource registered by the pool's id (the child checks), and a view of a buffer
/// allocated on a stream opens with the exporter's bytes, on every device, directly and
/// through the staged path.
pub fn memory_resources_between_processes(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let s = ctx.create_stream_with(true, 0)?;
    let len = 256usize << 10;
    let data = pattern(len, 41);
    let (off, n) = (4096, 64 << 10);
    let devices = t.runtime.device_count()?;
    let check = |what: &str,
                 bytes: Vec<u8>,
                 export: &dyn Fn() -> Result<emm::contract::PoolExport, EmmError>| {
        for device in 0..devices {
            for mode in [integration::IpcMode::Auto, integration::IpcMode::Staged] {
                let seen = integration::open_in_other_process_with(
                    &t,
                    &bytes,
                    mode,
                    device,
                    Some(export()?),
                )?;
                ensure!(
                    seen == data[off..off + n],
                    "{what}: the other process read other bytes on device {device} ({mode:?})"
                );
            }
        }
        Ok::<(), Failed>(())
    };

    let mr = ctx.device_memory_resource(emm::DeviceMemoryResourceOptions {
        max_size: 0,
        ipc_enabled: true,
    })?;
    let buf = mr.allocate(len, &s)?;
    s.synchronize()?;
    ctx.copy_to_device(&buf, &data)?;
    let handle = mr.get_ipc_handle(&buf.view(off, Some(off + n))?)?;
    check("device resource", handle.to_bytes(), &|| {
        mr.allocation_handle()
    })?;
    drop(handle);
    mr.deallocate(buf, &s)?;
    s.synchronize()?;
    mr.close()?;

    let options = emm::PinnedMemoryResourceOptions {
        ipc_enabled: true,
        ..Default::default()
    };
    let pinned = match ctx.pinned_memory_resource(options) {
        Err(EmmError::DeviceCannot { advice, .. }) if advice.contains("host_numa_id is -1") => ctx
            .pinned_memory_resource(emm::PinnedMemoryResourceOptions {
                numa_id: Some(0),
                ..options
            })?,
        other => other?,
    };
    ensure!(pinned.is_ipc_enabled() && pinned.numa_id().is_some());
    let buf = pinned.allocate(len, &s)?;
    s.synchronize()?;
    buf.write(0, &data)?;
    let handle = pinned.get_ipc_handle(&buf)?;
    ensure_eq!(handle.size(), len);
    let whole = integration::open_in_other_process_with(
        &t,
        &handle.to_bytes(),
        integration::IpcMode::Auto,
        0,
        Some(pinned.allocation_handle()?),
    )?;
    ensure!(
        whole == data,
        "pinned resource: the other process read other bytes"
    );
    let e = pinned.get_ipc_handle(&ctx.memhostalloc(64, true, false, false)?);
    ensure!(
        e.is_err(),
        "memory of another allocator is not the resource's to export"
    );
    drop(handle);
    pinned.deallocate(buf, &s)?;
    s.synchronize()?;
    pinned.close()?;
    Ok(())
}
