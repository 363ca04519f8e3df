//! Driver conformance of stream capture: what each driver call does on a captured stream.
#![allow(unsafe_code)]

use super::*;

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
