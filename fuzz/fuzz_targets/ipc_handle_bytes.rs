//! IPC handle bytes from another process: arbitrary, truncated, garbled, of another version, or
//! naming memory that no longer exists. Decoding never panics; a decoded handle re-encodes to
//! the same bytes; opening it in another (simulated) process either maps live memory of the
//! exporter or fails with a typed error, and leaves nothing mapped after close.
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
    /// Bytes of a handle to live memory and of one to freed memory, to splice inputs into.
    live: Vec<u8>,
    freed: Vec<u8>,
    _exporter: Runtime,
    _keep: emm::MemoryPointer,
}

fn world() -> &'static std::sync::Mutex<World> {
    static W: OnceLock<std::sync::Mutex<World>> = OnceLock::new();
    W.get_or_init(|| {
        let sim = Arc::new(SimDriver::new(SimConfig::default()));
        let exporter = Runtime::builder(sim.clone()).ignore_env().build().unwrap();
        let ctx = exporter.context(0).unwrap();
        let keep = ctx.to_device(&[7u8; 4096]).unwrap();
        let live = ctx.get_ipc_handle(&keep).unwrap().to_bytes();
        let gone = ctx.memalloc(4096).unwrap();
        let freed = ctx.get_ipc_handle(&gone).unwrap().to_bytes();
        drop(gone);
        ctx.deallocations().unwrap().flush().unwrap();
        let other = Arc::new(sim.spawn_process());
        let importer = Runtime::builder(other.clone())
            .ignore_env()
            .build()
            .unwrap();
        std::sync::Mutex::new(World {
            importer,
            sim: other,
            live,
            freed,
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
    // Splice the input over a real handle's bytes (each in turn), so that opens reach the driver.
    for base in [&w.live, &w.freed] {
        splice::open_spliced(&w.importer, &w.sim, base, data);
    }
});
