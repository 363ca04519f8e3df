//! The bytes that travel with a pool's file descriptor (`PoolExport::descriptor`): arbitrary,
//! truncated, of another version, naming devices that do not exist. Rebuilding an export never
//! panics; an accepted one gives back exactly the bytes it came from; importing it either
//! works or fails with a typed error (the descriptor here is a pipe, not a pool's), and the
//! importer holds nothing afterwards.
#![no_main]

use std::sync::{Arc, OnceLock};

use driver_mock::{SimConfig, SimDriver};
use emm::Runtime;
use emm::contract::PoolExport;
use libfuzzer_sys::fuzz_target;

struct World {
    importer: Runtime,
    sim: Arc<SimDriver>,
}

fn world() -> &'static std::sync::Mutex<World> {
    static W: OnceLock<std::sync::Mutex<World>> = OnceLock::new();
    W.get_or_init(|| {
        let sim = Arc::new(SimDriver::new(SimConfig::default()));
        let importer = Runtime::builder(sim.clone()).ignore_env().build().unwrap();
        std::sync::Mutex::new(World { importer, sim })
    })
}

fuzz_target!(|data: &[u8]| {
    let (reader, _writer) = std::io::pipe().unwrap();
    let Ok(export) = PoolExport::from_descriptor(data, reader.into()) else {
        return;
    };
    assert_eq!(&export.descriptor()[..], data);
    let w = world().lock().unwrap();
    assert!(
        w.importer.import_pool(export).is_err(),
        "a pipe imported as a pool"
    );
    assert_eq!(w.sim.leak_report().pools, 0, "a refused import left a pool");
});
