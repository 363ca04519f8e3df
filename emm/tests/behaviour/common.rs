//! What the test modules share: simulated machines and runtimes over them that ignore the
//! process environment (each test says what it wants).

use std::sync::Arc;

use driver_mock::{SimConfig, SimDriver};
use emm::Runtime;

/// A simulated machine with one device.
pub fn sim() -> Arc<SimDriver> {
    Arc::new(SimDriver::new(SimConfig::default()))
}

/// A runtime over `sim` with the default manager, whatever the environment says.
pub fn runtime(sim: &Arc<SimDriver>) -> Runtime {
    Runtime::builder(sim.clone()).ignore_env().build().unwrap()
}

/// A runtime over `sim` with the manager registered as `manager`.
pub fn runtime_with(sim: &Arc<SimDriver>, manager: &str) -> Runtime {
    Runtime::builder(sim.clone())
        .ignore_env()
        .memory_manager_name(manager)
        .build()
        .unwrap()
}

/// The number of cases of a property test: `PROPTEST_CASES` when set, else `default` (what
/// CI runs).
pub fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The seed of a property test's random cases: `PROPTEST_RNG_SEED` when set (`.ci/run` draws a
/// fresh one each run and prints it), else a fixed one, so that a local run repeats itself.
pub fn seed() -> proptest::test_runner::RngSeed {
    let fixed = std::env::var("PROPTEST_RNG_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x05ee_de33);
    proptest::test_runner::RngSeed::Fixed(fixed)
}
