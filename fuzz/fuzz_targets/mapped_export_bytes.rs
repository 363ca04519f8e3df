//! The bytes that travel with a `vmm-pool` allocation's file descriptors
//! (`MappedExport::descriptor`), and how many descriptors come with them: arbitrary,
//! truncated, of another version, pieces that overflow or do not hold the memory, a device that
//! does not exist. The first input byte is the number of descriptors (0 to 3; pipes, not
//! physical memory), the rest the descriptor. Rebuilding an export never panics; an accepted
//! one gives back exactly the bytes it came from; opening it under `vmm-pool` fails with a
//! typed error (the descriptors are not memory), and leaves no reservation, mapping or
//! physical allocation behind.
#![no_main]

use std::sync::{Arc, OnceLock};

use driver_mock::{SimConfig, SimDriver};
use emm::contract::MappedExport;
use emm::{Context, Runtime};
use libfuzzer_sys::fuzz_target;

struct World {
    ctx: Context,
    sim: Arc<SimDriver>,
    _runtime: Runtime,
}

fn world() -> &'static std::sync::Mutex<World> {
    static W: OnceLock<std::sync::Mutex<World>> = OnceLock::new();
    W.get_or_init(|| {
        let sim = Arc::new(SimDriver::new(SimConfig::default()));
        let runtime = Runtime::builder(sim.clone())
            .ignore_env()
            .memory_manager_name("vmm-pool")
            .build()
            .unwrap();
        let ctx = runtime.context(0).unwrap();
        std::sync::Mutex::new(World {
            ctx,
            sim,
            _runtime: runtime,
        })
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&count, bytes)) = data.split_first() else {
        return;
    };
    let mut writers = Vec::new();
    let fds = (0..count % 4)
        .map(|_| {
            let (reader, writer) = std::io::pipe().unwrap();
            writers.push(writer);
            reader.into()
        })
        .collect();
    let Ok(export) = MappedExport::from_descriptor(bytes, fds) else {
        return;
    };
    assert_eq!(&export.descriptor()[..], bytes);
    assert_eq!(export.fds().len(), export.pieces().len());
    let w = world().lock().unwrap();
    let e = w
        .ctx
        .open_mapped(export)
        .expect_err("pipes opened as physical memory");
    assert!(!e.to_string().is_empty());
    let leaks = w.sim.leak_report();
    assert!(
        leaks.reservations.is_empty() && leaks.physical.is_empty(),
        "a refused open left memory: {leaks}"
    );
});
