//! The process runtime behind the package: its settings (`configure`), the runtime made once,
//! each device's context (and the thread's cached one), and the capture-pool switch.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::PyEmmError;
use crate::context::Context;
use crate::py_err;
use emm::driver_sys::{CudaDriver, DeviceOrdinal, Driver};
use emm::{MemoryPointer, Runtime};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// How the process runtime was made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Settings {
    pub(crate) manager: Option<String>,
    pub(crate) adaptors: Option<String>,
    pub(crate) driver: String,
    /// The simulated device's memory in bytes (driver "sim" only).
    pub(crate) sim_memory: Option<usize>,
}

/// `EMM_SIM_DEVICE_MEMORY`: the simulated device's memory when the runtime is made from the
/// environment on driver "sim".
pub(crate) const ENV_SIM_DEVICE_MEMORY: &str = "EMM_SIM_DEVICE_MEMORY";

/// The simulated device's memory when none is given: 1 GiB.
pub(crate) const SIM_DEFAULT_MEMORY: usize = 1 << 30;

/// A byte size from Python: an int, or a string with a unit as emm's variables take
/// (`"80GiB"`).
pub(crate) fn sim_memory_arg(value: Option<&Bound<'_, PyAny>>) -> PyResult<Option<usize>> {
    let Some(value) = value else {
        return Ok(None);
    };
    if let Ok(n) = value.extract::<usize>() {
        return Ok(Some(n));
    }
    let text: String = value.extract().map_err(|_| {
        PyValueError::new_err(format!(
            "sim_memory must be a byte count (an int) or a size such as \"80GiB\", not {value}"
        ))
    })?;
    emm::internals::config::parse_bytes(&text)
        .map(Some)
        .map_err(|e| PyValueError::new_err(format!("sim_memory: {e}")))
}

/// Checks `sim_memory` against the driver: a size only for the simulator, and one that
/// holds at least a page.
pub(crate) fn check_sim_memory(driver: &str, sim_memory: Option<usize>) -> PyResult<()> {
    match sim_memory {
        Some(_) if driver != "sim" => Err(PyValueError::new_err(format!(
            "sim_memory sizes emm's simulated device; driver {driver:?} uses the GPU's own \
             memory: leave sim_memory out, or use driver=\"sim\""
        ))),
        Some(n) if n < 1 << 20 => Err(PyValueError::new_err(format!(
            "sim_memory of {n} bytes is too small for a simulated device: give at least 1 MiB \
             (\"1MiB\")"
        ))),
        _ => Ok(()),
    }
}

/// The process runtime and how it was made.
pub(crate) struct Shared {
    pub(crate) runtime: Arc<Runtime>,
    pub(crate) settings: Settings,
}

pub(crate) static RUNTIME: Mutex<Option<Shared>> = Mutex::new(None);

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Builds a runtime with `settings`: explicit values win over the environment
/// (`EMM_MEMORY_MANAGER`, `EMM_MEMORY_ADAPTORS`, `EMM_PINNED_HOST_POOL`), as in emm.
pub(crate) fn build(settings: &Settings) -> PyResult<Runtime> {
    let driver: Arc<dyn Driver> = match settings.driver.as_str() {
        "cuda" => Arc::new(CudaDriver::load().map_err(|e| PyEmmError::new_err(e.to_string()))?),
        "sim" => Arc::new(driver_mock::SimDriver::new(driver_mock::SimConfig::single(
            settings.sim_memory.unwrap_or(SIM_DEFAULT_MEMORY),
        ))),
        other => {
            return Err(PyValueError::new_err(format!(
                "unknown driver {other:?}: use \"cuda\" (the GPU) or \"sim\" (emm's simulated GPU, no hardware needed)"
            )));
        }
    };
    let mut builder = Runtime::builder(driver);
    if let Some(name) = &settings.manager {
        builder = builder.memory_manager_name(name.clone());
    }
    if let Some(list) = &settings.adaptors {
        let adaptors = emm::internals::config::adaptors_from_lookup(|k| {
            (k == emm::internals::config::ENV_MEMORY_ADAPTORS).then(|| list.clone())
        })
        .map_err(py_err)?;
        builder = builder.adaptors(adaptors);
    }
    builder.build().map_err(py_err)
}

/// The process runtime, made from the environment (driver "cuda") at first use.
pub(crate) fn runtime() -> PyResult<Arc<Runtime>> {
    let mut slot = lock(&RUNTIME);
    if let Some(shared) = slot.as_ref() {
        return Ok(Arc::clone(&shared.runtime));
    }
    let driver = std::env::var("EMM_PYTHON_DRIVER").unwrap_or_else(|_| "cuda".to_owned());
    let sim_memory = match std::env::var(ENV_SIM_DEVICE_MEMORY) {
        // Read only for the simulator: a GPU run ignores a size left in the environment.
        Ok(v) if driver == "sim" => Some(emm::internals::config::parse_bytes(&v).map_err(|e| {
            PyEmmError::new_err(format!(
                "{ENV_SIM_DEVICE_MEMORY}={v:?} is not a byte size ({e}); set it as \"80GiB\" \
                 or unset it"
            ))
        })?),
        _ => None,
    };
    check_sim_memory(&driver, sim_memory)?;
    let settings = Settings {
        manager: None,
        adaptors: None,
        driver,
        sim_memory,
    };
    let runtime = Arc::new(build(&settings)?);
    crate::ledger::start(&runtime);
    *slot = Some(Shared {
        runtime: Arc::clone(&runtime),
        settings,
    });
    Ok(runtime)
}

/// Makes the process runtime: `manager` (a name, as `EMM_MEMORY_MANAGER` takes), `adaptors`
/// (as `EMM_MEMORY_ADAPTORS` takes), `driver` "cuda" or "sim", and for "sim" `sim_memory`, the
/// simulated device's size (bytes or `"80GiB"`; default 1 GiB, or `EMM_SIM_DEVICE_MEMORY`
/// when the runtime is made from the environment). Once made, the runtime stays: a second
/// call with the same settings does nothing, with other settings it raises.
#[pyfunction]
#[pyo3(signature = (manager=None, adaptors=None, driver="cuda", sim_memory=None))]
pub(crate) fn configure(
    manager: Option<String>,
    adaptors: Option<String>,
    driver: &str,
    sim_memory: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let sim_memory = sim_memory_arg(sim_memory)?;
    check_sim_memory(driver, sim_memory)?;
    let settings = Settings {
        manager,
        adaptors,
        driver: driver.to_owned(),
        sim_memory,
    };
    let mut slot = lock(&RUNTIME);
    if let Some(shared) = slot.as_ref() {
        if shared.settings == settings {
            return Ok(());
        }
        return Err(PyEmmError::new_err(format!(
            "the emm runtime of this process already exists ({:?}); configure emm once, before \
             the first allocation, or restart the process to change it",
            shared.settings
        )));
    }
    let runtime = Arc::new(build(&settings)?);
    crate::ledger::start(&runtime);
    *slot = Some(Shared { runtime, settings });
    Ok(())
}

/// The process runtime's settings: `manager`, `adaptors`, `driver`, `sim_memory` (the
/// simulated device's bytes; `None` on the GPU); `None` before it exists.
#[pyfunction]
pub(crate) fn settings(py: Python<'_>) -> PyResult<Option<Bound<'_, PyDict>>> {
    let slot = lock(&RUNTIME);
    let Some(shared) = slot.as_ref() else {
        return Ok(None);
    };
    let d = PyDict::new(py);
    d.set_item("manager", shared.runtime.memory_manager_name())?;
    d.set_item("adaptors", shared.settings.adaptors.clone())?;
    d.set_item("driver", shared.settings.driver.clone())?;
    let sim_memory = (shared.settings.driver == "sim")
        .then(|| shared.settings.sim_memory.unwrap_or(SIM_DEFAULT_MEMORY));
    d.set_item("sim_memory", sim_memory)?;
    Ok(Some(d))
}

/// The process runtime's context of each device, looked up once: the runtime keeps its
/// contexts for its life (Python has no device reset, and a context's reset leaves it usable),
/// so the allocators' hot paths skip the runtime's lookup and the manager's `initialize` that
/// every lookup runs.
pub(crate) static CONTEXTS: Mutex<BTreeMap<u32, emm::Context>> = Mutex::new(BTreeMap::new());

pub(crate) fn device_context(device: u32) -> PyResult<emm::Context> {
    if let Some(ctx) = lock(&CONTEXTS).get(&device) {
        return Ok(ctx.clone());
    }
    let ctx = runtime()?.context(DeviceOrdinal(device)).map_err(py_err)?;
    if CAPTURE_POOLS.load(Ordering::Acquire) {
        ctx.enable_capture_pools();
    }
    Ok(lock(&CONTEXTS).entry(device).or_insert(ctx).clone())
}

thread_local! {
    /// The context this thread used last, with its device: the allocators' hot paths take it
    /// without the map's lock or a clone.
    static LAST_CONTEXT: std::cell::RefCell<Option<(u32, emm::Context)>> =
        const { std::cell::RefCell::new(None) };
}

/// Runs `f` on `device`'s context, the one this thread used last when it is that device's.
pub(crate) fn with_device_context<T>(
    device: u32,
    f: impl FnOnce(&emm::Context) -> T,
) -> PyResult<T> {
    LAST_CONTEXT.with(|last| {
        if let Ok(slot) = last.try_borrow()
            && let Some((d, ctx)) = &*slot
            && *d == device
        {
            return Ok(f(ctx));
        }
        let ctx = device_context(device)?;
        let out = f(&ctx);
        // Not cached while an outer call on this thread still reads the slot (a callback
        // that allocated from inside an allocation).
        if let Ok(mut slot) = last.try_borrow_mut() {
            *slot = Some((device, ctx));
        }
        Ok(out)
    })
}

/// A hasher for device addresses, which are aligned: their bits are mixed so that the low
/// bits a hash table indexes by differ (the standard hasher costs more than the table).
#[derive(Default)]
pub(crate) struct AddressHasher(u64);

impl std::hash::Hasher for AddressHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(self.0.rotate_left(8) ^ u64::from(b));
        }
    }

    fn write_u64(&mut self, x: u64) {
        let mixed = (x ^ (x >> 17)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 = mixed ^ (mixed >> 32);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// Memory handed to a framework, by address.
pub(crate) type AddressMap<V> = HashMap<u64, V, std::hash::BuildHasherDefault<AddressHasher>>;

/// Whether captures that PyTorch or CuPy begin get graph pools (`enable_capture_pools`):
/// `emm.torch.install()` and `emm.cupy.install()` turn it on for every context.
pub(crate) static CAPTURE_POOLS: AtomicBool = AtomicBool::new(false);

/// Gives every capture begun on a device's stream by another library a graph pool of its own
/// (`Context::enable_capture_pools`), on every context now and later.
#[pyfunction]
pub(crate) fn enable_capture_pools() {
    CAPTURE_POOLS.store(true, Ordering::Release);
    for ctx in lock(&CONTEXTS).values() {
        ctx.enable_capture_pools();
    }
}

/// Lets go of the graph pools of captures that ended, on every context (their memory goes
/// back to the manager once the graphs' tensors are freed): call it after deleting or
/// resetting the graphs. Returns how many pools were let go.
#[pyfunction]
pub(crate) fn release_capture_pools() -> usize {
    let contexts: Vec<emm::Context> = lock(&CONTEXTS).values().cloned().collect();
    contexts
        .iter()
        .map(emm::Context::release_capture_pools)
        .sum()
}

/// Drops `mem`, in relaxed capture mode while a capture with a graph pool may be under way
/// on its device: a global capture refuses the calls a manager's free may make (queries,
/// `cuMemFree`, stream-ordered frees on other streams).
pub(crate) fn drop_memory(mem: MemoryPointer) {
    if emm::internals::capture_pools_may_be_open() {
        let ctx = lock(&CONTEXTS).get(&mem.device().0).cloned();
        if let Some(ctx) = ctx
            && ctx.capture_pools_open()
        {
            let _relaxed = ctx.relaxed_capture();
            drop(mem);
            return;
        }
    }
    drop(mem);
}

/// Device `device`'s context in the process runtime.
#[pyfunction]
#[pyo3(signature = (device=0))]
pub(crate) fn context(device: u32) -> PyResult<Context> {
    Ok(Context {
        inner: device_context(device)?,
    })
}

/// How many devices the process runtime sees.
#[pyfunction]
pub(crate) fn device_count() -> PyResult<u32> {
    runtime()?.device_count().map_err(py_err)
}
