//! The suite's set-up: which targets run, what the environment asks for, the managers'
//! traits the tests branch on, and [`TestCtx`], one target's runtime for one test.

use std::fmt;
use std::sync::Arc;

use driver_mock::{SimConfig, SimDeviceConfig, SimDriver};
use driver_sys::{DeviceOrdinal, Driver, DriverError};
use emm::plugin::DeallocConfig;
use emm::{Runtime, RuntimeBuilder};

use crate::examples_support::log_from_env;

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

/// A yes-or-no variable's value: `1`, `true`, `yes` or `0`, `false`, `no` (any case); unset is
/// `false`. Anything else is an error that names the variable, never a silent default.
pub fn parse_flag(name: &str, value: Option<&str>) -> Result<bool, String> {
    match value.map(|v| v.trim().to_ascii_lowercase()).as_deref() {
        None => Ok(false),
        Some("1" | "true" | "yes") => Ok(true),
        Some("0" | "false" | "no") => Ok(false),
        Some(other) => Err(format!(
            "{name}={other:?} is invalid: set it to 1 (or true, yes) or 0 (or false, no), or unset it"
        )),
    }
}

/// A whole-number variable's value at least `min`: `default` when unset. Anything else (a
/// negative number, a fraction, an empty string) is an error that names the variable.
pub fn parse_count(name: &str, value: Option<&str>, default: u64, min: u64) -> Result<u64, String> {
    let Some(v) = value else {
        return Ok(default);
    };
    match v.trim().replace('_', "").parse::<u64>() {
        Ok(n) if n >= min => Ok(n),
        Ok(n) => Err(format!(
            "{name}={n} is too small: set it to {min} or more (default {default}), or unset it"
        )),
        Err(e) => Err(format!(
            "{name}={v:?} is invalid ({e}): set it to a whole number of {min} or more (default {default}), or unset it"
        )),
    }
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// How many GPUs `EMM_REQUIRE_GPUS` demands (0 when unset); a malformed value is an error.
pub fn gpus_required() -> Result<u32, String> {
    let n = parse_count("EMM_REQUIRE_GPUS", env("EMM_REQUIRE_GPUS").as_deref(), 0, 0)?;
    u32::try_from(n).map_err(|_| format!("EMM_REQUIRE_GPUS={n} is more GPUs than a machine has"))
}

/// The operations of the stress test: `EMM_STRESS_OPS`, 32 000 when unset (the CI size; the
/// GPU job runs a million); a malformed value is an error.
pub fn stress_ops() -> Result<usize, String> {
    let n = parse_count(
        "EMM_STRESS_OPS",
        env("EMM_STRESS_OPS").as_deref(),
        32_000,
        1,
    )?;
    usize::try_from(n).map_err(|_| format!("EMM_STRESS_OPS={n} does not fit this machine"))
}

/// The number of CUDA devices, or why there are none.
pub fn cuda_device_count() -> Result<u32, String> {
    cuda_availability()?;
    let (driver, _) = make_driver(Target::Cuda).map_err(|e| e.to_string())?;
    driver.device_count().map_err(|e| e.to_string())
}

/// Whether `EMM_REQUIRE_GPU` asks for a GPU (`1`, `true` or `yes`); a malformed value is an
/// error.
pub fn gpu_required() -> Result<bool, String> {
    parse_flag("EMM_REQUIRE_GPU", env("EMM_REQUIRE_GPU").as_deref())
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

/// The manager configuration the suite runs under, from the environment: `EMM_MEMORY_MANAGER`
/// (default `default`), `EMM_MEMORY_ADAPTORS` and `EMM_PINNED_HOST_POOL`. The deallocation
/// thresholds are always Numba's defaults, whatever the shell exports.
#[derive(Clone, Debug)]
pub struct SuiteSetup {
    /// The manager's name.
    pub manager: String,
    /// The adaptors around it.
    pub adaptors: Vec<emm::Adaptor>,
    /// The pinned host pool.
    pub pinned_pool: Option<emm::PinnedPoolConfig>,
}

impl SuiteSetup {
    /// Whether the suite runs emm's default manager with no adaptor and no pinned pool: the
    /// configuration whose driver calls the Numba tests count.
    pub fn is_plain_default(&self) -> bool {
        self.manager == emm::plugin::DEFAULT_MANAGER
            && self.adaptors.is_empty()
            && self.pinned_pool.is_none()
    }

    /// A one-line description, for the suite's notes.
    pub fn describe(&self) -> String {
        let mut s = self.manager.clone();
        for a in &self.adaptors {
            s = format!("{a:?}({s})");
        }
        if let Some(p) = &self.pinned_pool {
            s.push_str(&format!(
                " + pinned host pool ({} bytes cached at most)",
                p.max_cached
            ));
        }
        s
    }
}

/// Whether the suite's manager frees device memory through the deferred queue, one
/// `cuMemFree` per allocation (emm's `default` manager, adaptors or not): the behaviour Numba's
/// deallocation tests count. A pool returns blocks to itself instead.
pub fn defers_device_frees() -> bool {
    suite_setup().is_ok_and(|s| s.manager == emm::plugin::DEFAULT_MANAGER)
}

/// Whether the suite's manager hands out managed memory (`async-pool-managed`), whose device
/// footprint the driver settles lazily: `cuMemGetInfo` may show a destroyed managed pool's
/// memory as used until later (measured on an H100: 32 MiB came back only after the next
/// pool's reset).
pub fn hands_out_managed_memory() -> bool {
    suite_setup().is_ok_and(|s| s.manager == emm::plugin::ASYNC_POOL_MANAGED_MANAGER)
}

/// Checks that the device's free memory is back at `baseline` after a test gave everything
/// back (`what` names the moment): exactly, or, under a manager that hands out managed
/// memory ([`hands_out_managed_memory`]), at least (the driver may still count a managed
/// pool destroyed before the baseline; it never counts less than emm holds).
pub fn ensure_memory_back(free: usize, baseline: usize, what: &str) -> Result<(), String> {
    let back = if hands_out_managed_memory() {
        free >= baseline
    } else {
        free == baseline
    };
    if back {
        Ok(())
    } else {
        Err(format!(
            "{what}: {free} bytes free, {baseline} before; not every byte came back"
        ))
    }
}

/// Whether the suite's manager exports device memory to other processes: all but
/// `async-pool` and `async-pool-managed`, whose pools are not created for export (the driver
/// exports stream-ordered pool memory only from such a pool, and not with
/// `cuIpcGetMemHandle`; `async-pool-ipc` does).
pub fn exports_ipc_handles() -> bool {
    suite_setup().is_ok_and(|s| {
        s.manager != emm::plugin::ASYNC_POOL_MANAGER
            && s.manager != emm::plugin::ASYNC_POOL_MANAGED_MANAGER
            && s.manager != emm::plugin::VMM_POOL_MANAGER
    })
}

/// Whether the suite's manager hands out device memory, which `cuMemGetInfo` counts at once:
/// all but `async-pool-managed`, whose managed memory the driver places on first touch.
pub fn allocates_device_memory() -> bool {
    suite_setup().is_ok_and(|s| s.manager != emm::plugin::ASYNC_POOL_MANAGED_MANAGER)
}

/// Whether host allocations reach the driver one call each (no pinned host pool).
pub fn host_calls_direct() -> bool {
    suite_setup().is_ok_and(|s| s.pinned_pool.is_none())
}

/// The suite's manager configuration (see [`SuiteSetup`]).
pub fn suite_setup() -> Result<SuiteSetup, String> {
    let env = |n: &str| std::env::var(n).ok();
    Ok(SuiteSetup {
        manager: emm::internals::config::manager_name_from_lookup(env)
            .map_err(|e| e.to_string())?
            .unwrap_or_else(|| emm::plugin::DEFAULT_MANAGER.to_owned()),
        adaptors: emm::internals::config::adaptors_from_lookup(env).map_err(|e| e.to_string())?,
        pinned_pool: emm::internals::config::pinned_pool_from_lookup(env)
            .map_err(|e| e.to_string())?,
    })
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
                    Arc::new(emm::driver_sys::CudaDriver::load()?) as Arc<dyn Driver>,
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
        Self::with_sim_config(target, suite_sim_config(), configure)
    }

    /// As [`with`](Self::with), with `sim` as the simulated machine (ignored on the GPU).
    pub fn with_sim_config(
        target: Target,
        sim: SimConfig,
        configure: impl FnOnce(RuntimeBuilder) -> RuntimeBuilder,
    ) -> Result<TestCtx, String> {
        let (driver, sim) = match target {
            Target::Sim => {
                let sim = Arc::new(SimDriver::new(sim));
                (sim.clone() as Arc<dyn Driver>, Some(sim))
            }
            Target::Cuda => make_driver(target).map_err(|e| e.to_string())?,
        };
        let setup = suite_setup()?;
        let builder = Runtime::builder(Arc::clone(&driver))
            .ignore_env()
            .dealloc_config(DeallocConfig::default())
            .memory_manager_name(setup.manager)
            .adaptors(setup.adaptors)
            .pinned_host_pool(setup.pinned_pool);
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

/// What the kernel examples share: on the GPU, a runtime under each registered manager in turn,
/// handed to `each` with the manager's name; returns the managers run. Without a usable GPU it
/// says why and returns `None`, unless `EMM_REQUIRE_GPU=1`, which makes that an error.
pub fn on_the_gpu_under_every_manager(
    mut each: impl FnMut(Runtime, &str) -> Result<(), Box<dyn std::error::Error>>,
) -> Result<Option<Vec<String>>, Box<dyn std::error::Error>> {
    log_from_env();
    if let Err(why) = cuda_availability() {
        if gpu_required()? {
            return Err(format!("EMM_REQUIRE_GPU=1, but there is no usable GPU: {why}").into());
        }
        println!("skipped: a kernel needs a GPU, and there is none here ({why})");
        return Ok(None);
    }
    let driver: Arc<dyn Driver> = Arc::new(emm::driver_sys::CudaDriver::load()?);
    let managers = Runtime::builder(Arc::clone(&driver))
        .ignore_env()
        .build()?
        .registered_managers();
    for name in &managers {
        let runtime = Runtime::builder(Arc::clone(&driver))
            .memory_manager_name(name)
            .ignore_env()
            .build()?;
        each(runtime, name)?;
    }
    Ok(Some(managers))
}
