//! Replays of allocation logs (emm's own and RMM's) through the managers on the simulator,
//! with and without the GPU's progress.

use std::sync::Arc;

use driver_mock::{SimConfig, SimDriver};
use emm::contract::MemoryKind;
use emm::{Adaptor, EmmError, Runtime, replay};

use crate::common::runtime_with;

use crate::pools::{MIB, drop_behind_queued_work, on_a_gib};

/// The log adaptor writes RMM's columns; the log replays on a fresh simulator under another
/// manager, with the same allocations.
#[test]
fn a_logged_run_replays() {
    let text = logged_run("log", "default", vec![Adaptor::Stats], |_, ctx| {
        let a = ctx.memalloc(1000).unwrap();
        let b = ctx.memalloc(5 << 20).unwrap();
        let h = ctx.memhostalloc(4096, true, false, false).unwrap();
        drop(a);
        let c = ctx.memalloc(2000).unwrap();
        drop((b, c, h));
        let usage = ctx.usage().unwrap();
        assert_eq!(usage.device.total_count, 3);
        assert_eq!(usage.device.peak_count, 2);
        assert_eq!(usage.of(MemoryKind::Mapped).total_count, 1);
        assert_eq!(usage.device.current_bytes, 0);
    });
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some(emm::plugin::LOG_HEADER));
    assert_eq!(text.lines().count(), 1 + 8, "{text}");
    let events = replay::parse_log(&text).unwrap();
    assert_eq!(events.len(), 8);
    let (_sim, rt) = on_a_gib("pool");
    let report = replay::replay(&rt.context(0).unwrap(), &events).unwrap();
    assert_eq!(
        (report.allocations, report.frees, report.failures),
        (4, 4, 0),
        "{report:?}"
    );
    assert_eq!(report.peak_live, 3);
    // RMM's own six columns replay too.
    let rmm = "Thread,Time,Action,Pointer,Size,Stream\n1,0.1,allocate,0x10,256,0\n1,0.2,free,0x10,256,0\n";
    let events = replay::parse_log(rmm).unwrap();
    assert_eq!(events.len(), 2);
    let bad = replay::parse_log("1,0.1,reserve,0x10,256,0").unwrap_err();
    assert!(bad.to_string().contains("unknown action"), "{bad}");
}

/// The log's `Reached` column says how far the GPU had got through a stream when an allocation
/// came: the time of the latest marker it recorded there that has completed, or the
/// allocation's own time where the stream was idle. On the simulator, whose streams run only
/// when asked, it stays at the first marker's time until the streams run; memory without a
/// stream says `-`. The replay reads it back with each event's time.
#[test]
fn the_log_says_how_far_the_gpu_had_got() {
    let (text, allocs) = logged_allocations("reached", |sim, ctx| {
        let stream = ctx.create_stream().unwrap();
        let a = ctx.memalloc_on(1 << 20, &stream).unwrap();
        // Work queued on the stream, which runs only when the streams are run.
        let set = ctx.memset_async(&a, 0, &stream).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(1));
        let b = ctx.memalloc_on(1 << 20, &stream).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(1));
        let b2 = ctx.memalloc_on(1 << 20, &stream).unwrap();
        // The streams run: the work and the markers recorded so far complete.
        sim.run_streams();
        set.wait().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(1));
        let c = ctx.memalloc_on(1 << 20, &stream).unwrap();
        let plain = ctx.memalloc(4096).unwrap();
        drop((a, b, b2, c, plain));
        stream.synchronize().unwrap();
    });
    assert_eq!(allocs.len(), 5, "{text}");
    let at = |k: usize| allocs[k].at.expect("every line has its time");
    assert_eq!(
        allocs[0].reached,
        Some(at(0)),
        "a new stream is idle: nothing launched there before the first allocation is pending"
    );
    assert_eq!(
        allocs[1].reached,
        Some(at(0)),
        "the set is queued: the stream had got as far as the first allocation"
    );
    assert_eq!(
        allocs[2].reached,
        Some(at(0)),
        "the set and the marker recorded at the second allocation are still queued"
    );
    assert_eq!(
        allocs[3].reached,
        Some(at(3)),
        "after the streams ran, the stream was idle: its work before this allocation was done"
    );
    assert_eq!(allocs[4].reached, None, "memory without a stream: {text}");
    assert!(at(0) < at(1) && at(1) < at(2) && at(2) < at(3));
}

/// An allocation's `Reached` is read before the manager serves it: a pool that grows waits
/// for the stream's work before it gives the stream's free chunk back, and a reading after
/// that would say the stream was idle where the pool found it busy.
#[test]
fn the_log_reads_the_stream_before_the_pool_serves_the_allocation() {
    let (text, allocs) = logged_allocations("before", |sim, ctx| {
        let stream = ctx.create_stream().unwrap();
        let a = ctx.memalloc_on(100 * MIB, &stream).unwrap();
        // Freed behind a set still queued: the stream's 100 MiB chunk is wholly free, and
        // the stream busy.
        drop_behind_queued_work(sim, ctx, a, &stream);
        std::thread::sleep(std::time::Duration::from_millis(1));
        // The chunk does not hold 150 MiB: the pool grows, and waits for the stream's work
        // before it gives the chunk back.
        let b = ctx.memalloc_on(150 * MIB, &stream).unwrap();
        assert!(
            stream.query().unwrap(),
            "the pool waited for the stream while it grew"
        );
        drop(b);
        stream.synchronize().unwrap();
    });
    assert_eq!(allocs.len(), 2, "{text}");
    let first = allocs[0].at.expect("every line has its time");
    assert_eq!(allocs[0].reached, Some(first), "a new stream is idle");
    assert_eq!(
        allocs[1].reached,
        Some(first),
        "the set was queued when the allocation came, whatever the pool waited for: {text}"
    );
}

/// Runs `work` on a simulated GiB under `manager` with the `log` adaptor, then `also`;
/// returns the log's text (a folder named after `name` holds the log meanwhile).
fn logged_run(
    name: &str,
    manager: &str,
    also: Vec<Adaptor>,
    work: impl FnOnce(&SimDriver, &emm::Context),
) -> String {
    let dir = std::env::temp_dir().join(format!("emm-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("run.csv");
    {
        let sim = Arc::new(SimDriver::new(SimConfig::single(1 << 30)));
        let mut adaptors = vec![Adaptor::Log(path.clone())];
        adaptors.extend(also);
        let rt = Runtime::builder(sim.clone())
            .ignore_env()
            .memory_manager_name(manager)
            .adaptors(adaptors)
            .build()
            .unwrap();
        work(&sim, &rt.context(0).unwrap());
    }
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    text
}

/// [`logged_run`] under `pool`: the log's text and its allocations.
fn logged_allocations(
    name: &str,
    work: impl FnOnce(&SimDriver, &emm::Context),
) -> (String, Vec<replay::ReplayEvent>) {
    let text = logged_run(name, "pool", Vec::new(), work);
    let allocs = replay::parse_log(&text)
        .unwrap()
        .into_iter()
        .filter(|e| e.action == replay::Action::Allocate)
        .collect();
    (text, allocs)
}

/// A replay with the recorded progress keeps a stream busy where the log says its work was
/// still running: a pool that grows for it then waits for that work before it gives the
/// stream's free chunk back (the simulator's stand-in work completes when a synchronisation
/// waits for it), and holds no more than the program needed, where a pool that left the chunk
/// behind a fence held both at once.
#[test]
fn a_replay_with_the_gpus_progress_keeps_streams_busy() {
    // Two 100 MiB blocks in turn, then 150 MiB, on one stream whose work never caught up
    // (progress 0): at the third, the stream's free chunk does not hold it.
    let log = "Thread,Time,Action,Pointer,Size,Stream,Kind,Reached
0,0.001,allocate,0x1000,104857600,0x0,device,0
0,0.002,free,0x1000,104857600,0x0,device,0
0,0.003,allocate,0x2000,157286400,0x0,device,0
0,0.004,free,0x2000,157286400,0x0,device,0
";
    let events = replay::parse_log(log).unwrap();
    assert_eq!(events[2].at, Some(3_000_000));
    assert_eq!(events[2].reached, Some(0));
    let (_, r) = replay_with_progress(&events);
    assert_eq!(r.failures, 0);
    assert_eq!(
        r.peak_held_bytes,
        150 * MIB,
        "the stream's free chunk went back before the pool grew"
    );
}

/// Between a stream's own events, a replay with progress lets the stream's work run on with
/// the log's clock: a thread that freed its block and waited for its stream leaves the stream
/// idle by the time another stream grows, as on the GPU, so its free chunk moves to that
/// stream with no wait on the GPU. Held as the stream's progress stood at its last event, the
/// stream stayed busy until its next event and the chunk moved behind a `cuStreamWaitEvent`.
#[test]
fn a_replay_lets_a_stream_run_on_between_its_events() {
    // Stream 0xa allocates 100 MiB and frees it (its work 1 ms behind), then its thread waits
    // for it: its next line, at 10 ms, finds it idle. Stream 0xb asks for 100 MiB at 6 ms,
    // after memory without a stream at 5 ms.
    let log = "Thread,Time,Action,Pointer,Size,Stream,Kind,Reached
0,0.001,allocate,0x1000,104857600,0xa,device,0
0,0.002,free,0x1000,104857600,0xa,device,1000000
1,0.005,allocate,0x9000,4096,-,device,-
1,0.006,allocate,0x2000,104857600,0xb,device,6000000
0,0.010,allocate,0x3000,1048576,0xa,device,10000000
1,0.011,free,0x2000,104857600,0xb,device,6000000
0,0.012,free,0x3000,1048576,0xa,device,10000000
1,0.013,free,0x9000,4096,-,device,-
";
    let events = replay::parse_log(log).unwrap();
    took_the_idle_streams_chunk(&events, "stream 0xa was idle at 6 ms");
}

/// A free's `Reached` is only the last marker the log found complete, which the GPU may have
/// passed long before; an allocation's is the stream's own answer (its time where the stream
/// was idle). A replay with progress takes a free's figure as a floor under where the stream
/// had got, and bounds a stream's progress by its next allocation's figure alone: a stream
/// idle at its allocation whose thread then freed its block is idle, as on the GPU, when
/// another stream asks for the block's memory just after the free. Held back to the free's
/// marker, the stream looked busy, the chunk moved behind a `cuStreamWaitEvent`, and a
/// four-stream server's replay held 1.69 × peak live where its run on the GPU held 1.23.
#[test]
fn a_replay_takes_a_frees_progress_as_a_floor() {
    // Stream 0xa is idle at its allocation at 1 ms (its thread had waited for it); its free at
    // 3 ms reads the marker of 1 ms. Stream 0xb asks for 100 MiB at 3.5 ms.
    let log = "Thread,Time,Action,Pointer,Size,Stream,Kind,Reached
0,0.001,allocate,0x1000,104857600,0xa,device,1000000
0,0.003,free,0x1000,104857600,0xa,device,1000000
1,0.0035,allocate,0x2000,104857600,0xb,device,3500000
0,0.010,allocate,0x3000,1048576,0xa,device,10000000
1,0.011,free,0x2000,104857600,0xb,device,11000000
0,0.012,free,0x3000,1048576,0xa,device,10000000
";
    let events = replay::parse_log(log).unwrap();
    took_the_idle_streams_chunk(&events, "stream 0xa had run on past its free by 3.5 ms");
}

/// Replays `events` with their progress and checks that stream 0xb's 100 MiB came from the
/// chunk stream 0xa had freed, found idle (`why`): no wait on the GPU, and no second chunk.
fn took_the_idle_streams_chunk(events: &[replay::ReplayEvent], why: &str) {
    let (sim, r) = replay_with_progress(events);
    assert_eq!(r.failures, 0);
    assert_eq!(
        sim.count(driver_mock::Op::StreamWaitEvent),
        0,
        "{why}: its chunk moved with no wait on the GPU"
    );
    assert!(
        r.peak_held_bytes < 2 * 100 * MIB,
        "stream 0xb took 0xa's chunk instead of growing: {r:?}"
    );
}

/// A manager decides inside its call, while the GPU runs on: a replay with progress takes the
/// stream's progress at the middle of the recorded call (its `Elapsed`), from where the log
/// read it before the call. A growth that took 4 ms on a stream 2 ms behind found the stream
/// idle, and gave its free chunk back with no wait; read at the call's start, as a log without
/// `Elapsed` replays, the stream is busy and the pool waits for it.
#[test]
fn a_replay_lets_the_gpu_run_on_during_a_recorded_call() {
    // One stream: 100 MiB, freed behind work 1 ms behind; then 150 MiB at 3 ms, the stream
    // still 2 ms behind when the log read it, in a call of 4 ms.
    let log = "Thread,Time,Action,Pointer,Size,Stream,Kind,Reached,Elapsed
0,0.001,allocate,0x1000,104857600,0xa,device,1000000,1000
0,0.002,free,0x1000,104857600,0xa,device,1000000,0
0,0.003,allocate,0x2000,157286400,0xa,device,1000000,4000000
0,0.008,free,0x2000,157286400,0xa,device,8000000,0
";
    let waits = |sim: &SimDriver| {
        sim.count(driver_mock::Op::EventSynchronize) + sim.count(driver_mock::Op::StreamSynchronize)
    };
    let events = replay::parse_log(log).unwrap();
    assert_eq!(events[2].elapsed, Some(4_000_000));
    let (sim, r) = replay_with_progress(&events);
    assert_eq!(r.failures, 0);
    assert_eq!(r.peak_held_bytes, 150 * MIB, "{r:?}");
    assert_eq!(
        waits(&sim),
        0,
        "by the middle of the 4 ms call the stream's work was done: no wait"
    );
    // The same log without the call's duration: the pool finds the stream busy, and waits.
    let at_start: Vec<_> = events
        .iter()
        .map(|e| replay::ReplayEvent {
            elapsed: None,
            ..*e
        })
        .collect();
    let (sim, r) = replay_with_progress(&at_start);
    assert_eq!(r.peak_held_bytes, 150 * MIB, "{r:?}");
    assert!(
        waits(&sim) > 0,
        "read at the call's start, the stream was busy"
    );
}

/// The simulator's stand-in work for a replay with progress, on the replay's own context.
struct SimWork<'a> {
    sim: &'a SimDriver,
    ctx: emm::driver_sys::ContextHandle,
}

impl replay::RecordedWork for SimWork<'_> {
    fn launched(&mut self, stream: emm::driver_sys::StreamHandle, at: u64) -> Result<(), EmmError> {
        self.sim
            .launch_recorded(self.ctx, stream, at)
            .map_err(|e| EmmError::driver("launch_recorded", emm::driver_sys::DeviceOrdinal(0), e))
    }

    fn reached(&mut self, stream: emm::driver_sys::StreamHandle, at: u64) -> Result<(), EmmError> {
        self.sim
            .reach_recorded(self.ctx, stream, at)
            .map_err(|e| EmmError::driver("reach_recorded", emm::driver_sys::DeviceOrdinal(0), e))
    }
}

/// Replays `events` once under `pool` on a fresh simulated GiB with their progress; returns
/// the simulator with the report.
fn replay_with_progress(events: &[replay::ReplayEvent]) -> (Arc<SimDriver>, replay::ReplayReport) {
    let (sim, rt) = on_a_gib("pool");
    let ctx = rt.context(0).unwrap();
    let mut replayer = replay::Replayer::new(&ctx).unwrap();
    let mut work = SimWork {
        sim: &sim,
        ctx: ctx.handle(),
    };
    let report = replayer
        .pass_recorded(events, &mut work, || {
            sim.run_streams();
        })
        .unwrap();
    drop(replayer);
    (sim, report)
}

/// A log in RMM's exact format (`logging_resource_adaptor`: pointers as bare hexadecimal,
/// `%llx`, actions `allocate`, `free` and `allocate failure` with a null pointer) replays;
/// so does one whose header puts the columns in another order, and one without a header
/// (RMM's order). Pointers with letters in them name the same allocation at its free.
#[test]
fn an_rmm_log_replays() {
    let rmm = "Thread,Time,Action,Pointer,Size,Stream
140573312345856,10:42:07.101372,allocate,7f8a40000000,1024,7f8a38001020
140573312345856,10:42:07.101390,allocate,7f8a40000400,2048,7f8a38001020
140573312345856,10:42:07.101401,allocate failure,0,1099511627776,7f8a38001020
140573312345856,10:42:07.101420,free,7f8a40000000,1024,7f8a38001020
140573312345856,10:42:07.101431,free,7f8a40000400,2048,7f8a38001020
";
    let events = replay::parse_log(rmm).unwrap();
    assert_eq!(events.len(), 4, "the failure is skipped: {events:?}");
    assert_eq!(events[0].ptr, 0x7f8a_4000_0000);
    assert_eq!(events[1].ptr, 0x7f8a_4000_0400);
    assert_eq!(
        events[3].ptr, events[1].ptr,
        "the free names the allocation"
    );
    let sim = Arc::new(SimDriver::new(SimConfig::default()));
    let rt = runtime_with(&sim, "pool");
    let report = replay::replay(&rt.context(0).unwrap(), &events).unwrap();
    assert_eq!(
        (report.allocations, report.frees, report.unmatched_frees),
        (2, 2, 0),
        "{report:?}"
    );
    // The same events with the columns in another order, and with no header at all.
    let reordered = "Size,Pointer,Action,Stream\n1024,7f8a40000000,allocate,0\n1024,0x7f8a40000000,deallocate,0\n";
    let events = replay::parse_log(reordered).unwrap();
    assert_eq!(
        events
            .iter()
            .map(|e| (e.action, e.ptr, e.size))
            .collect::<Vec<_>>(),
        [
            (replay::Action::Allocate, 0x7f8a_4000_0000, 1024),
            (replay::Action::Free, 0x7f8a_4000_0000, 1024),
        ]
    );
    let bare = "1,0.1,allocate,abc0,256,0\n1,0.2,free,abc0,256,0\n";
    assert_eq!(replay::parse_log(bare).unwrap().len(), 2);
    // A header without a size column, and a pointer that is not hexadecimal, are refused.
    let no_size = replay::parse_log("Thread,Time,Action,Pointer\n").unwrap_err();
    assert!(no_size.to_string().contains("\"size\""), "{no_size}");
    let not_hex = replay::parse_log("1,0.1,allocate,0xzz,256,0").unwrap_err();
    assert!(not_hex.to_string().contains("hexadecimal"), "{not_hex}");
}
