//! An allocation log from anywhere (RMM's CSV, the `log` adaptor's, a recorded trace): any
//! bytes, with any header, actions, addresses, sizes and streams. Parsing never panics and
//! refuses with a typed error naming the line; a parsed log's summary never overflows; and a
//! replay of its first events on a small simulated device either runs or fails with a typed
//! error, leaving no memory behind.
#![no_main]

use std::sync::{Arc, OnceLock};

use driver_mock::{SimConfig, SimDriver};
use emm::Runtime;
use libfuzzer_sys::fuzz_target;

fn world() -> &'static std::sync::Mutex<(Runtime, Arc<SimDriver>)> {
    static W: OnceLock<std::sync::Mutex<(Runtime, Arc<SimDriver>)>> = OnceLock::new();
    W.get_or_init(|| {
        let sim = Arc::new(SimDriver::new(SimConfig::single(64 << 20)));
        let rt = Runtime::builder(sim.clone())
            .ignore_env()
            .memory_manager_name("pool")
            .build()
            .unwrap();
        std::sync::Mutex::new((rt, sim))
    })
}

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let events = match emm::replay::parse_log(&text) {
        Ok(events) => events,
        Err(e) => {
            assert!(e.to_string().contains("line "), "{e}");
            return;
        }
    };
    let summary = emm::replay::summarize(&events);
    assert!(summary.frees <= summary.allocations);
    let w = world().lock().unwrap();
    let ctx = w.0.context(0).unwrap();
    let first = &events[..events.len().min(64)];
    let _ = emm::replay::replay(&ctx, first);
    // The replay frees what it allocated, and a trim gives the pool's chunks back.
    ctx.trim().unwrap();
    let info = ctx.get_memory_info().unwrap();
    assert_eq!(info.free, info.total, "a replay left memory behind");
    w.1.clear_calls();
});
