//! Handles of stream-ordered pool memory (`async-pool-ipc`, handle kind 1) from another
//! process: arbitrary bytes spliced over a real pool handle's, so that pool ids, export data,
//! sizes and offsets are garbled. Decoding never panics; a decoded handle re-encodes to the
//! same bytes; opening it in the importing (simulated) process either maps live memory of the
//! imported pool or fails with a typed error (an unknown pool is `PoolNotImported`), and
//! nothing stays imported after close.
#![no_main]

use std::sync::{Arc, OnceLock};

use driver_mock::{SimConfig, SimDriver};
use emm::Runtime;
use libfuzzer_sys::fuzz_target;

#[path = "splice.rs"]
mod splice;

struct World {
    importer: Runtime,
    sim: Arc<SimDriver>,
    /// Bytes of a handle to live pool memory, to splice inputs into.
    live: Vec<u8>,
    _exporter: Runtime,
    _keep: emm::MemoryPointer,
}

fn world() -> &'static std::sync::Mutex<World> {
    static W: OnceLock<std::sync::Mutex<World>> = OnceLock::new();
    W.get_or_init(|| {
        let sim = Arc::new(SimDriver::new(SimConfig::default()));
        let exporter = Runtime::builder(sim.clone())
            .ignore_env()
            .memory_manager_name(emm::plugin::ASYNC_POOL_IPC_MANAGER)
            .build()
            .unwrap();
        let ctx = exporter.context(0).unwrap();
        let keep = ctx.to_device(&[7u8; 4096]).unwrap();
        let live = ctx.get_ipc_handle(&keep).unwrap().to_bytes();
        let export = ctx.export_pool().unwrap();
        let other = Arc::new(sim.spawn_process());
        let importer = Runtime::builder(other.clone())
            .ignore_env()
            .build()
            .unwrap();
        importer.import_pool(export).unwrap();
        std::sync::Mutex::new(World {
            importer,
            sim: other,
            live,
            _exporter: exporter,
            _keep: keep,
        })
    })
}

fuzz_target!(|data: &[u8]| {
    splice::check_round_trip(data);
    let w = world().lock().unwrap();
    // The world lives for the whole campaign: its call log would grow without bound (10 million
    // runs took it past 4 GiB, found by a campaign of 2026-11-23).
    w.sim.clear_calls();
    splice::open_spliced(&w.importer, &w.sim, &w.live, data);
});
