//! emm's streams and events (Numba's stream kinds, events and `auto_synchronize`), on both
//! targets. A stream is held back with `cuStreamWaitValue32` on a flag in mapped pinned memory,
//! so that "not done yet" is certain on the GPU as on the simulator.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use emm::driver_sys::{Driver, StreamHandle, wait_value};
use emm::{EmmError, StreamKind};
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
