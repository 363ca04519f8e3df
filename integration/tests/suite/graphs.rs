//! CUDA graphs over emm memory, under the suite's manager, on both targets: capture through a
//! graph pool and replay, the pool's memory kept for the graph and flat over replays, and
//! what each manager does with an allocation on a captured stream outside a graph pool.

use emm::contract::StreamOrdering;
use emm::driver_sys::{CaptureMode, CaptureStatus};
use integration::{Target, TestCtx};
use libtest_mimic::Failed;

/// The device memory the driver counts as used.
fn used(ctx: &emm::Context) -> Result<usize, Failed> {
    let info = ctx.get_memory_info()?;
    Ok(info.total - info.free)
}

/// A graph captured through a graph pool replays 100 times with the result a plain run gives;
/// a block freed during the capture is reused within it; the pool's memory is the graph's
/// alone and stays the same over the replays; the graph and its blocks gone, the pool's
/// segments go back to the manager.
pub fn capture_and_replay_through_a_graph_pool(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let s = ctx.create_stream()?;
    let input = ctx.memalloc(1 << 16)?;
    ctx.memset(&input, 3, 1 << 16)?;
    let in_use = |ctx: &emm::Context| ctx.pool_stats().device.map(|d| d.in_use_bytes);
    let in_use_before = in_use(&ctx);
    let (graph, (out, scratch_at, reused_at)) = ctx.capture(&s, CaptureMode::Global, |s| {
        let scratch = ctx.memalloc_on(1 << 16, s)?;
        ctx.copy_device_async(&scratch, &input, s)?.wait()?;
        let scratch_at = scratch.device_ptr();
        let out = ctx.memalloc_on(1 << 16, s)?;
        ctx.copy_device_async(&out, &scratch, s)?.wait()?;
        drop(scratch);
        // Freed in the capture: the next block of its size reuses it.
        let again = ctx.memalloc_on(1 << 16, s)?;
        let reused_at = again.device_ptr();
        ctx.memset_async(&again, 9, s)?.wait()?;
        Ok((out, scratch_at, reused_at))
    })?;
    ensure_eq!(
        reused_at,
        scratch_at,
        "a block freed in the capture is reused in it"
    );
    let stats = graph.pool().stats();
    ensure_eq!(stats.in_use_blocks, 1, "{stats:?}");
    ensure!(stats.held_bytes >= 2 << 16, "{stats:?}");
    // Nothing ran during the capture.
    let mut back = vec![0u8; 1 << 16];
    ctx.copy_to_host(&mut back, &out)?;
    ensure!(
        back.iter().all(|&b| b != 3),
        "the captured copies ran early"
    );
    // Outside the capture, `s` allocates from the manager again, never from the pool.
    let outside = ctx.memalloc_on(1 << 16, &s)?;
    ensure!(
        outside.device_ptr() != out.device_ptr() && outside.device_ptr() != scratch_at,
        "an allocation after the capture got the graph's memory"
    );
    drop(outside);
    let before = used(&ctx)?;
    for round in 0..100 {
        ctx.memset(&out, 0, 1 << 16)?;
        graph.launch(&s)?;
        s.synchronize()?;
        ctx.copy_to_host(&mut back, &out)?;
        ensure!(
            back.iter().all(|&b| b == 3),
            "replay {round}: {:?}",
            &back[..8]
        );
    }
    ensure_eq!(graph.pool().stats(), stats, "the pool over 100 replays");
    ensure_eq!(used(&ctx)?, before, "device memory over 100 replays");
    // The graph's output lives on its own; once it and the graph are gone, so is the pool.
    let pool = graph.pool().clone();
    drop(graph);
    ensure_eq!(pool.stats().in_use_blocks, 1, "the output keeps its block");
    drop(out);
    ensure_eq!(pool.stats().in_use_blocks, 0);
    let held = pool.stats().held_bytes;
    drop(pool);
    ctx.flush_deallocations()?;
    ensure_eq!(
        in_use(&ctx),
        in_use_before,
        "the graph pool's {held} bytes went back to the manager"
    );
    Ok(())
}

/// `memalloc_on` of a captured stream outside a graph pool: `async-pool` and
/// `async-pool-managed` allocate with the driver's graph memory nodes (freed after a launch);
/// every other manager (`async-pool-ipc` too: the driver makes no graph memory of an
/// IPC-enabled pool's) refuses with an error that names graph pools and leaves the capture
/// intact.
pub fn allocation_on_a_captured_stream_outside_a_graph_pool(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    let s = ctx.create_stream()?;
    let d = &t.driver;
    d.stream_begin_capture(ctx.handle(), s.handle(), CaptureMode::Global)?;
    let got = ctx.memalloc_on(4096, &s);
    let status = d.stream_capture_status(ctx.handle(), s.handle())?;
    let ended = d.stream_end_capture(ctx.handle(), s.handle());
    ensure!(
        matches!(status, CaptureStatus::Active { .. }),
        "the capture survived: {status:?} ({got:?})"
    );
    let graph = ended?;
    match (ctx.stream_ordering(), got) {
        (StreamOrdering::Driver, Ok(mem)) => {
            let exec = d.graph_instantiate(ctx.handle(), graph)?;
            d.graph_launch(ctx.handle(), exec, s.handle())?;
            s.synchronize()?;
            // Freed after the launch, as the driver's rule says.
            drop(mem);
            ctx.flush_deallocations()?;
            s.synchronize()?;
            // SAFETY: made above, launched once and waited for.
            unsafe { d.graph_exec_destroy(ctx.handle(), exec)? };
        }
        // The driver makes no graph memory of an IPC-enabled pool's.
        (StreamOrdering::Driver, Err(e)) if !ctx.memory_manager_name().contains("ipc") => {
            return Err(format!("a driver-pool manager refused a captured allocation: {e}").into());
        }
        (_, Ok(_)) => return Err("a manager allocated on a captured stream".into()),
        (_, Err(e)) => {
            let text = e.to_string();
            ensure!(
                text.contains("graph pool") && text.contains("captured"),
                "the error says what to do: {text}"
            );
        }
    }
    // SAFETY: the graph made above, used no more.
    unsafe { d.graph_destroy(ctx.handle(), graph)? };
    Ok(())
}

/// A capture another library begins (here through the driver, as PyTorch and CuPy do), with
/// `enable_capture_pools` on: `memalloc_on_raw` of the captured stream is served from a pool of
/// that capture, under every manager; launches replay it; frees made while the capture is under
/// way, in relaxed mode, leave it intact; once the capture ended and its graph and blocks are
/// gone, `release_capture_pools` gives the memory back. (Under `async-pool`, the free of the
/// block from before the capture is first tried on its stream, which the capture refuses, then
/// made once the capture ended: one refused release, on purpose.)
pub fn captures_begun_elsewhere_get_graph_pools(target: Target) -> Result<(), Failed> {
    let t = TestCtx::new(target)?;
    let ctx = t.context()?;
    ctx.enable_capture_pools();
    let d = &t.driver;
    let s = ctx.create_stream()?;
    let in_use = |ctx: &emm::Context| ctx.pool_stats().device.map(|d| d.in_use_bytes);
    let before = (in_use(&ctx), used(&ctx)?);
    // Memory from before the capture, freed during it (PyTorch frees a temporary).
    let earlier = ctx.memalloc_on(4096, &s)?;
    s.synchronize()?;
    d.stream_begin_capture(ctx.handle(), s.handle(), CaptureMode::Global)?;
    // SAFETY: `s` is this context's stream, alive for the whole test.
    let out = unsafe { ctx.memalloc_on_raw(1 << 16, s.handle()) }?;
    // SAFETY: the same stream.
    let scratch = unsafe { ctx.memalloc_on_raw(1 << 16, s.handle()) }?;
    ctx.memset_async(&scratch, 4, &s)?.wait()?;
    ctx.copy_device_async(&out, &scratch, &s)?.wait()?;
    ensure!(ctx.capture_pools_open(), "the capture is under way");
    ensure!(
        emm::internals::capture_pools_may_be_open(),
        "the process-wide count sees it"
    );
    {
        let _relaxed = ctx.relaxed_capture();
        drop(scratch);
        drop(earlier);
    }
    let status = d.stream_capture_status(ctx.handle(), s.handle())?;
    ensure!(
        matches!(status, CaptureStatus::Active { .. }),
        "the capture survived the allocations and frees: {status:?}"
    );
    let graph = d.stream_end_capture(ctx.handle(), s.handle())?;
    ensure!(!ctx.capture_pools_open(), "the capture ended");
    let exec = d.graph_instantiate(ctx.handle(), graph)?;
    let mut back = vec![0u8; 1 << 16];
    for round in 0..10 {
        ctx.memset(&out, 0, 1 << 16)?;
        d.graph_launch(ctx.handle(), exec, s.handle())?;
        s.synchronize()?;
        ctx.copy_to_host(&mut back, &out)?;
        ensure!(back.iter().all(|&b| b == 4), "launch {round}");
    }
    // After the capture, the stream allocates from the manager again.
    let after = ctx.memalloc_on(1 << 16, &s)?;
    ensure!(after.device_ptr() != out.device_ptr());
    drop(after);
    // SAFETY: made above, its launches waited for.
    unsafe {
        d.graph_exec_destroy(ctx.handle(), exec)?;
        d.graph_destroy(ctx.handle(), graph)?;
    }
    drop(out);
    ensure_eq!(ctx.release_capture_pools(), 1, "the ended capture's pool");
    ctx.flush_deallocations()?;
    s.synchronize()?;
    ensure_eq!(
        in_use(&ctx),
        before.0,
        "the pool's memory went back to the manager"
    );
    let _ = before.1;
    Ok(())
}
