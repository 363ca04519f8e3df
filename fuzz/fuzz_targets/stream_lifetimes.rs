//! Streams and the memory ordered on them, in any order: streams made and dropped, memory
//! allocated on one stream, used on others (`record_stream`), freed on a third (`free_on`),
//! dropped, flushed and trimmed, under every manager that orders memory on streams. A stream
//! emm made outlives the last memory ordered on it: the simulator refuses any call on a
//! destroyed stream, so a stream destroyed too early shows as a failed release. Nothing
//! panics, no release fails, and each input leaves the device's memory all free (one runtime
//! per manager serves every input).
#![no_main]

use std::sync::{Arc, Mutex, OnceLock};

use driver_mock::{SimConfig, SimDriver, failed_releases_on_this_thread};
use emm::{MemoryPointer, Runtime, Stream};
use libfuzzer_sys::fuzz_target;

const MANAGERS: [&str; 5] = ["default", "pool", "vmm-pool", "async-pool", "async-pool-managed"];

/// One simulated machine and runtime per manager, kept across inputs (making them is most of
/// an input's cost): each input must leave its device as it found it.
fn worlds() -> &'static [Mutex<(Runtime, Arc<SimDriver>)>] {
    static W: OnceLock<Vec<Mutex<(Runtime, Arc<SimDriver>)>>> = OnceLock::new();
    W.get_or_init(|| {
        MANAGERS
            .iter()
            .map(|m| {
                let sim = Arc::new(SimDriver::new(SimConfig::single(64 << 20)));
                let rt = Runtime::builder(sim.clone())
                    .ignore_env()
                    .memory_manager_name(*m)
                    .build()
                    .unwrap();
                Mutex::new((rt, sim))
            })
            .collect()
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&first, ops)) = data.split_first() else {
        return;
    };
    let failed_before = failed_releases_on_this_thread();
    let world = worlds()[usize::from(first) % MANAGERS.len()].lock().unwrap();
    let (rt, sim) = (&world.0, &world.1);
    let ctx = rt.context(0).unwrap();
    let mut streams: Vec<Stream> = vec![ctx.legacy_default_stream()];
    let mut memory: Vec<MemoryPointer> = Vec::new();
    for pair in ops.chunks(2).take(64) {
        let (op, arg) = (pair[0], usize::from(pair.get(1).copied().unwrap_or(0)));
        let stream = |k: usize| &streams[k % streams.len()];
        match op % 8 {
            0 if streams.len() < 6 => streams.push(ctx.create_stream().unwrap()),
            1 if streams.len() > 1 => drop(streams.remove(1 + arg % (streams.len() - 1))),
            2 => match ctx.memalloc_on((arg + 1) << ((op >> 5) * 3), stream(arg)) {
                Ok(mem) => memory.push(mem),
                Err(e) => assert!(e.is_out_of_memory(), "{e}"),
            },
            3 if !memory.is_empty() => {
                let mem = &memory[arg % memory.len()];
                mem.record_stream(stream(arg / 7)).unwrap();
            }
            4 if !memory.is_empty() => {
                let mem = &memory[arg % memory.len()];
                mem.free_on(stream(arg / 7)).unwrap();
            }
            5 if !memory.is_empty() => drop(memory.swap_remove(arg % memory.len())),
            6 => {
                ctx.flush_deallocations().unwrap();
            }
            7 => {
                ctx.trim().unwrap();
            }
            _ => {}
        }
    }
    drop(memory);
    drop(streams);
    // Every stream's queued work runs; then the frees waiting for it go, the pools give their
    // chunks back, and the streams and events emm no longer needs are destroyed.
    sim.run_streams();
    ctx.trim().unwrap();
    ctx.flush_deallocations().unwrap();
    ctx.own_deallocations().flush().unwrap();
    let info = ctx.get_memory_info().unwrap();
    assert_eq!(
        info.free,
        info.total,
        "the input left device memory behind: {}",
        sim.leak_report()
    );
    sim.clear_calls();
    assert_eq!(
        failed_releases_on_this_thread(),
        failed_before,
        "a release failed: a stream destroyed before the memory on it was freed?"
    );
});
