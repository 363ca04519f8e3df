//! One test suite, two targets.
//!
//! Suite tests are written once against a [`TestCtx`] and instantiated for every available
//! [`Target`]: the simulator always, the real CUDA driver when a GPU is present. Test names
//! carry the target (`sim::alloc_write_read_free`, `cuda::alloc_write_read_free`).
//!
//! | variable | values | effect |
//! | --- | --- | --- |
//! | `EMM_TEST_TARGET` | `all` (default), `sim`, `cuda` | which targets the suite runs on |
//! | `EMM_REQUIRE_GPU` | `1` | a missing GPU fails the run instead of skipping the CUDA tests |
//! | `EMM_DRIVER` | `auto` (default), `sim`, `cuda` | which driver [`driver_from_env`] picks (examples) |

use std::fmt;
use std::sync::Arc;

use driver_mock::{SimConfig, SimDeviceConfig, SimDriver};
use driver_sys::{DeviceOrdinal, Driver, DriverError};
use emm::{DeallocConfig, Runtime, RuntimeBuilder};

/// Where a suite test runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Target {
    /// The simulated driver.
    Sim,
    /// The real CUDA driver on device 0.
    Cuda,
}

impl Target {
    /// The prefix of test names for this target.
    pub fn name(self) -> &'static str {
        match self {
            Target::Sim => "sim",
            Target::Cuda => "cuda",
        }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The simulated system the suite uses: one device of 256 MiB that can map host memory, whose
/// context takes 6 MiB before anything is allocated (as a real context does), so that `free`
/// starts below `total` as on the GPU.
pub fn suite_sim_config() -> SimConfig {
    SimConfig::with_devices(vec![
        SimDeviceConfig::new(256 << 20).context_overhead(6 << 20),
    ])
}

/// Whether a real GPU can be used, and why not.
pub fn cuda_availability() -> Result<(), String> {
    #[cfg(feature = "cuda")]
    {
        let driver = driver_sys::CudaDriver::load().map_err(|e| e.to_string())?;
        match driver.device_count() {
            Ok(0) => Err("the CUDA driver reports no device".into()),
            Ok(_) => Ok(()),
            Err(e) => Err(e.to_string()),
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err("integration was built without its `cuda` feature".into())
    }
}

/// Whether `EMM_REQUIRE_GPU` asks for a GPU (`1`, `true` or `yes`).
pub fn gpu_required() -> bool {
    std::env::var("EMM_REQUIRE_GPU")
        .map(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes"))
        .unwrap_or(false)
}

/// The targets `EMM_TEST_TARGET` asks for.
pub fn requested_targets() -> Result<Vec<Target>, String> {
    match std::env::var("EMM_TEST_TARGET").as_deref().map(str::trim) {
        Err(_) | Ok("all") | Ok("") => Ok(vec![Target::Sim, Target::Cuda]),
        Ok("sim") => Ok(vec![Target::Sim]),
        Ok("cuda") => Ok(vec![Target::Cuda]),
        Ok(other) => Err(format!(
            "EMM_TEST_TARGET={other:?} is invalid: use all, sim or cuda (or unset it)"
        )),
    }
}

/// What a suite test gets: a fresh runtime over a fresh driver of its target.
pub struct TestCtx {
    /// The target.
    pub target: Target,
    /// The driver (the same object the runtime uses).
    pub driver: Arc<dyn Driver>,
    /// The simulator, on the simulator target: for assertions about calls and leaks.
    pub sim: Option<Arc<SimDriver>>,
    /// The runtime under test.
    pub runtime: Runtime,
}

impl fmt::Debug for TestCtx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestCtx")
            .field("target", &self.target)
            .finish()
    }
}

/// A fresh driver, and the simulator behind it when it is one.
pub type TargetDriver = (Arc<dyn Driver>, Option<Arc<SimDriver>>);

/// The driver for `target`, fresh.
pub fn make_driver(target: Target) -> Result<TargetDriver, DriverError> {
    match target {
        Target::Sim => {
            let sim = Arc::new(SimDriver::new(suite_sim_config()));
            Ok((sim.clone() as Arc<dyn Driver>, Some(sim)))
        }
        Target::Cuda => {
            #[cfg(feature = "cuda")]
            {
                Ok((
                    Arc::new(driver_sys::CudaDriver::load()?) as Arc<dyn Driver>,
                    None,
                ))
            }
            #[cfg(not(feature = "cuda"))]
            {
                Err(DriverError::unavailable(
                    "cuInit",
                    "integration was built without `cuda`",
                ))
            }
        }
    }
}

impl TestCtx {
    /// A context for `target` with the default configuration (environment ignored, so the
    /// suite's expectations hold whatever the caller's shell exports).
    pub fn new(target: Target) -> Result<TestCtx, String> {
        Self::with(target, |b| b)
    }

    /// A context for `target` whose runtime builder is adjusted by `configure`.
    pub fn with(
        target: Target,
        configure: impl FnOnce(RuntimeBuilder) -> RuntimeBuilder,
    ) -> Result<TestCtx, String> {
        let (driver, sim) = make_driver(target).map_err(|e| e.to_string())?;
        let builder = Runtime::builder(Arc::clone(&driver))
            .ignore_env()
            .dealloc_config(DeallocConfig::default());
        let runtime = configure(builder).build().map_err(|e| e.to_string())?;
        Ok(TestCtx {
            target,
            driver,
            sim,
            runtime,
        })
    }

    /// Device 0's context.
    pub fn context(&self) -> Result<emm::Context, emm::EmmError> {
        self.runtime.context(DeviceOrdinal(0))
    }

    /// The simulator, or `None` on the GPU.
    pub fn sim(&self) -> Option<&SimDriver> {
        self.sim.as_deref()
    }
}

/// Which driver `EMM_DRIVER` picks, and why.
#[derive(Debug)]
pub struct DriverChoice {
    /// The driver.
    pub driver: Arc<dyn Driver>,
    /// Whether it is the simulator.
    pub simulated: bool,
    /// Why this driver was chosen (for the user).
    pub reason: String,
}

/// The driver `EMM_DRIVER` asks for: `cuda` (the GPU, or an error), `sim` (the simulator), or
/// `auto` (default: the GPU where one is usable, otherwise the simulator, saying why).
pub fn driver_from_env() -> Result<DriverChoice, String> {
    let mode = std::env::var("EMM_DRIVER").unwrap_or_else(|_| "auto".into());
    let sim = || DriverChoice {
        driver: Arc::new(SimDriver::new(SimConfig::default())),
        simulated: true,
        reason: String::new(),
    };
    match mode.trim() {
        "sim" => Ok(DriverChoice {
            reason: "EMM_DRIVER=sim".into(),
            ..sim()
        }),
        "cuda" => cuda_driver().map_err(|e| format!("EMM_DRIVER=cuda, but {e}")),
        "auto" | "" => Ok(cuda_driver().unwrap_or_else(|why| DriverChoice {
            reason: format!("no usable GPU ({why})"),
            ..sim()
        })),
        other => Err(format!(
            "EMM_DRIVER={other:?} is invalid: use auto, sim or cuda (or unset it)"
        )),
    }
}

fn cuda_driver() -> Result<DriverChoice, String> {
    cuda_availability()?;
    let (driver, _) = make_driver(Target::Cuda).map_err(|e| e.to_string())?;
    Ok(DriverChoice {
        driver,
        simulated: false,
        reason: "a CUDA GPU is present".into(),
    })
}
