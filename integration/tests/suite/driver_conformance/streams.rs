//! Driver conformance of streams and events.
#![allow(unsafe_code)]

use super::*;

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
