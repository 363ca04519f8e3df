//! `emm._emm`: the extension module behind the `emm` Python package.
//!
//! One emm [`Runtime`] per process (`configure`, or the environment at first use), shared by
//! everything the package offers: Numba's EMM plugin (`emm.numba`), CuPy's allocator
//! (`emm.cupy`) and PyTorch's pluggable allocator (`emm.torch`, through the C functions
//! [`emm_torch_malloc`] and [`emm_torch_free`] this library exports). Memory from all three
//! comes from one manager and shows in one `usage()`.
//!
//! Calls that may wait for the GPU or the driver (allocations, which may flush deferred frees;
//! copies; resets; flushes; trims; memory info) release the GIL while they run.
//!
//! Errors become Python exceptions: [`EmmError`]'s message (what happened, what
//! to do) in `emm.EmmError` (a `RuntimeError`), or `emm.OutOfMemoryError` (a `MemoryError`)
//! when memory ran out.
#![allow(unsafe_code)]

use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use streams::StreamArg;

use emm::driver_sys::{CudaDriver, DeviceOrdinal, Driver, HostPtr, StreamHandle};
use emm::{
    DeferCleanup, EmmError, HostMemory, IpcHandle, ManagedMemory, MemoryPointer, Runtime,
    StreamOrdering,
};
mod array;
mod cupy;
mod host_range;
mod streams;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

/// The package's exceptions, named as Python sees them (`emm.EmmError`,
/// `emm.OutOfMemoryError`).
mod exceptions {
    use pyo3::create_exception;
    use pyo3::exceptions::{PyMemoryError, PyRuntimeError};

    create_exception!(
        emm,
        EmmError,
        PyRuntimeError,
        "An emm operation failed; the message says what happened and what to do."
    );
    create_exception!(
        emm,
        OutOfMemoryError,
        PyMemoryError,
        "emm ran out of memory, after flushing its deferred frees and retrying."
    );
}

use exceptions::{EmmError as PyEmmError, OutOfMemoryError};

/// The Python exception for an emm error.
fn py_err(e: EmmError) -> PyErr {
    match e {
        EmmError::OutOfMemory { .. } | EmmError::OutOfHostMemory { .. } => {
            OutOfMemoryError::new_err(e.to_string())
        }
        e => PyEmmError::new_err(e.to_string()),
    }
}

/// How the process runtime was made.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Settings {
    manager: Option<String>,
    adaptors: Option<String>,
    driver: String,
    /// The simulated device's memory in bytes (driver "sim" only).
    sim_memory: Option<usize>,
}

/// `EMM_SIM_DEVICE_MEMORY`: the simulated device's memory when the runtime is made from the
/// environment on driver "sim".
const ENV_SIM_DEVICE_MEMORY: &str = "EMM_SIM_DEVICE_MEMORY";

/// The simulated device's memory when none is given: 1 GiB.
const SIM_DEFAULT_MEMORY: usize = 1 << 30;

/// A byte size from Python: an int, or a string with a unit as emm's variables take
/// (`"80GiB"`).
fn sim_memory_arg(value: Option<&Bound<'_, PyAny>>) -> PyResult<Option<usize>> {
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
    emm::runtime::config::parse_bytes(&text)
        .map(Some)
        .map_err(|e| PyValueError::new_err(format!("sim_memory: {e}")))
}

/// Checks `sim_memory` against the driver: a size only for the simulator, and one that
/// holds at least a page.
fn check_sim_memory(driver: &str, sim_memory: Option<usize>) -> PyResult<()> {
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
struct Shared {
    runtime: Arc<Runtime>,
    settings: Settings,
}

static RUNTIME: Mutex<Option<Shared>> = Mutex::new(None);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Builds a runtime with `settings`: explicit values win over the environment
/// (`EMM_MEMORY_MANAGER`, `EMM_MEMORY_ADAPTORS`, `EMM_PINNED_HOST_POOL`), as in emm.
fn build(settings: &Settings) -> PyResult<Runtime> {
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
        let adaptors = emm::runtime::config::adaptors_from_lookup(|k| {
            (k == emm::runtime::config::ENV_MEMORY_ADAPTORS).then(|| list.clone())
        })
        .map_err(py_err)?;
        builder = builder.adaptors(adaptors);
    }
    builder.build().map_err(py_err)
}

/// The process runtime, made from the environment (driver "cuda") at first use.
fn runtime() -> PyResult<Arc<Runtime>> {
    let mut slot = lock(&RUNTIME);
    if let Some(shared) = slot.as_ref() {
        return Ok(Arc::clone(&shared.runtime));
    }
    let driver = std::env::var("EMM_PYTHON_DRIVER").unwrap_or_else(|_| "cuda".to_owned());
    let sim_memory = match std::env::var(ENV_SIM_DEVICE_MEMORY) {
        // Read only for the simulator: a GPU run ignores a size left in the environment.
        Ok(v) if driver == "sim" => Some(emm::runtime::config::parse_bytes(&v).map_err(|e| {
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
fn configure(
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
    *slot = Some(Shared { runtime, settings });
    Ok(())
}

/// The process runtime's settings: `manager`, `adaptors`, `driver`, `sim_memory` (the
/// simulated device's bytes; `None` on the GPU); `None` before it exists.
#[pyfunction]
fn settings(py: Python<'_>) -> PyResult<Option<Bound<'_, PyDict>>> {
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
static CONTEXTS: Mutex<BTreeMap<u32, emm::Context>> = Mutex::new(BTreeMap::new());

fn device_context(device: u32) -> PyResult<emm::Context> {
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
fn with_device_context<T>(device: u32, f: impl FnOnce(&emm::Context) -> T) -> PyResult<T> {
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
struct AddressHasher(u64);

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
type AddressMap<V> = HashMap<u64, V, std::hash::BuildHasherDefault<AddressHasher>>;

/// Whether captures that PyTorch or CuPy begin get graph pools (`enable_capture_pools`):
/// `emm.torch.install()` and `emm.cupy.install()` turn it on for every context.
static CAPTURE_POOLS: AtomicBool = AtomicBool::new(false);

/// Gives every capture begun on a device's stream by another library a graph pool of its own
/// (`Context::enable_capture_pools`), on every context now and later.
#[pyfunction]
fn enable_capture_pools() {
    CAPTURE_POOLS.store(true, Ordering::Release);
    for ctx in lock(&CONTEXTS).values() {
        ctx.enable_capture_pools();
    }
}

/// Lets go of the graph pools of captures that ended, on every context (their memory goes
/// back to the manager once the graphs' tensors are freed): call it after deleting or
/// resetting the graphs. Returns how many pools were let go.
#[pyfunction]
fn release_capture_pools() -> usize {
    let contexts: Vec<emm::Context> = lock(&CONTEXTS).values().cloned().collect();
    contexts
        .iter()
        .map(emm::Context::release_capture_pools)
        .sum()
}

/// Drops `mem`, in relaxed capture mode while a capture with a graph pool may be under way
/// on its device: a global capture refuses the calls a manager's free may make (queries,
/// `cuMemFree`, stream-ordered frees on other streams).
fn drop_memory(mem: MemoryPointer) {
    if emm::runtime::graphs::capture_pools_may_be_open() {
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
fn context(device: u32) -> PyResult<Context> {
    Ok(Context {
        inner: device_context(device)?,
    })
}

/// How many devices the process runtime sees.
#[pyfunction]
fn device_count() -> PyResult<u32> {
    runtime()?.device_count().map_err(py_err)
}

/// Device memory from emm: released when the last Python reference goes (or at `release()`),
/// through the manager's deferred queue.
#[pyclass(module = "emm._emm", frozen)]
struct DeviceBuffer {
    mem: Mutex<Option<MemoryPointer>>,
    /// For memory opened from another process: the open handle, closed when the buffer is
    /// released (after the pointer).
    opened: Mutex<Option<IpcHandle>>,
    /// The device address.
    #[pyo3(get)]
    ptr: u64,
    /// Bytes.
    #[pyo3(get)]
    size: usize,
    /// The device ordinal.
    #[pyo3(get)]
    device: u32,
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if let Some(mem) = lock(&self.mem).take() {
            drop_memory(mem);
        }
    }
}

impl DeviceBuffer {
    fn new(mem: MemoryPointer) -> DeviceBuffer {
        DeviceBuffer {
            ptr: mem.device_ptr().0,
            size: mem.size(),
            device: mem.device().0,
            mem: Mutex::new(Some(mem)),
            opened: Mutex::new(None),
        }
    }

    fn pointer(&self) -> PyResult<MemoryPointer> {
        lock(&self.mem).clone().ok_or_else(|| {
            PyEmmError::new_err(
                "this DeviceBuffer was released; allocate a new one (release() ends a buffer for good)",
            )
        })
    }
}

#[pymethods]
impl DeviceBuffer {
    /// The `CUstream` handle the buffer was allocated on (`memalloc_on`), or None.
    #[getter]
    fn stream(&self) -> Option<u64> {
        lock(&self.mem)
            .as_ref()
            .and_then(|m| m.stream())
            .map(|s| s.raw())
    }

    /// Whether the memory is still usable (not released, not freed by a reset).
    #[getter]
    fn live(&self) -> bool {
        lock(&self.mem).as_ref().is_some_and(MemoryPointer::is_live)
    }

    /// Gives the memory back now rather than when the buffer is collected (memory opened
    /// from another process: closes the mapping).
    fn release(&self) -> PyResult<()> {
        if let Some(mem) = lock(&self.mem).take() {
            drop_memory(mem);
        }
        match lock(&self.opened).take() {
            Some(handle) => handle.close().map_err(py_err),
            None => Ok(()),
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "DeviceBuffer(ptr=0x{:x}, size={}, device={})",
            self.ptr, self.size, self.device
        )
    }
}

/// Page-locked host memory from emm (`memhostalloc`, `mempin`): `host_ptr`, and `device_ptr`
/// when mapped.
#[pyclass(module = "emm._emm", frozen)]
struct HostBuffer {
    mem: Mutex<Option<HostMemory>>,
    /// The host address.
    #[pyo3(get)]
    host_ptr: usize,
    /// The device address of mapped memory; `None` when not mapped.
    #[pyo3(get)]
    device_ptr: Option<u64>,
    /// Bytes.
    #[pyo3(get)]
    size: usize,
}

#[pymethods]
impl HostBuffer {
    /// Copies `data` into the memory at `offset`.
    #[pyo3(signature = (data, offset=0))]
    fn write(&self, data: &[u8], offset: usize) -> PyResult<()> {
        with_live(&self.mem, |m| m.write(offset, data))
    }

    /// `n` bytes from `offset`.
    #[pyo3(signature = (n, offset=0))]
    fn read<'py>(&self, py: Python<'py>, n: usize, offset: usize) -> PyResult<Bound<'py, PyBytes>> {
        let mut out = vec![0u8; n];
        with_live(&self.mem, |m| m.read(offset, &mut out))?;
        Ok(PyBytes::new(py, &out))
    }

    /// Gives the memory back (or unpins it) now.
    fn release(&self) {
        lock(&self.mem).take();
    }
}

/// Runs `f` on a buffer's memory, unless the buffer was released.
fn with_live<M, T>(
    slot: &Mutex<Option<M>>,
    f: impl FnOnce(&M) -> Result<T, EmmError>,
) -> PyResult<T> {
    let guard = lock(slot);
    let mem = guard
        .as_ref()
        .ok_or_else(|| PyEmmError::new_err("this buffer was released; allocate a new one"))?;
    f(mem).map_err(py_err)
}

/// Managed memory from emm: one address (`ptr`) for the host and the devices.
#[pyclass(module = "emm._emm", frozen)]
struct ManagedBuffer {
    mem: Mutex<Option<ManagedMemory>>,
    /// The address, valid on the host and on the devices.
    #[pyo3(get)]
    ptr: u64,
    /// Bytes.
    #[pyo3(get)]
    size: usize,
}

#[pymethods]
impl ManagedBuffer {
    /// Copies `data` into the memory at `offset`, from the host.
    #[pyo3(signature = (data, offset=0))]
    fn write(&self, data: &[u8], offset: usize) -> PyResult<()> {
        with_live(&self.mem, |m| m.write(offset, data))
    }

    /// `n` bytes from `offset`, read on the host.
    #[pyo3(signature = (n, offset=0))]
    fn read<'py>(&self, py: Python<'py>, n: usize, offset: usize) -> PyResult<Bound<'py, PyBytes>> {
        let mut out = vec![0u8; n];
        with_live(&self.mem, |m| m.read(offset, &mut out))?;
        Ok(PyBytes::new(py, &out))
    }

    /// Gives the memory back now.
    fn release(&self) {
        lock(&self.mem).take();
    }
}

/// An IPC handle of emm memory: `handle` (the driver's 64 bytes, of the allocation's base),
/// `offset` into that allocation, `size`, and `data` (emm's own serialization, which
/// [`Context::open_ipc`] opens in another process).
#[pyclass(module = "emm._emm", frozen)]
struct Ipc {
    handle: IpcHandle,
}

#[pymethods]
impl Ipc {
    /// The driver's handle bytes (`cuIpcGetMemHandle`'s 64, or a pool export's 64).
    #[getter]
    fn handle<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let bytes: &[u8] = match self.handle.handle() {
            emm::IpcMemory::Allocation(h) => &h.0,
            emm::IpcMemory::PoolAllocation { data, .. } => &data.0,
        };
        PyBytes::new(py, bytes)
    }

    /// Whether the handle is a `cuIpcGetMemHandle` handle (which any CUDA process opens);
    /// `False` for stream-ordered pool memory (`async-pool-ipc`), which needs emm's import.
    #[getter]
    fn is_driver_handle(&self) -> bool {
        matches!(self.handle.handle(), emm::IpcMemory::Allocation(_))
    }

    /// The offset of the exported memory in its allocation.
    #[getter]
    fn offset(&self) -> usize {
        self.handle.offset()
    }

    /// Bytes exported.
    #[getter]
    fn size(&self) -> usize {
        self.handle.size()
    }

    /// emm's serialization of the handle.
    #[getter]
    fn data<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.handle.to_bytes())
    }
}

/// A `defer_cleanup` guard as a Python context manager.
#[pyclass(module = "emm._emm", frozen)]
struct Deferral {
    ctx: emm::Context,
    guard: Mutex<Option<DeferCleanup>>,
}

#[pymethods]
impl Deferral {
    fn __enter__(slf: PyRef<'_, Self>) -> PyResult<PyRef<'_, Self>> {
        let guard = slf.ctx.defer_cleanup().map_err(py_err)?;
        *lock(&slf.guard) = Some(guard);
        Ok(slf)
    }

    fn __exit__(
        &self,
        _ty: Option<&Bound<'_, PyAny>>,
        _value: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> bool {
        lock(&self.guard).take();
        false
    }
}

/// One device's context in the process runtime: every allocation of the package goes
/// through it.
/// A stream-ordered memory resource (cuda.core's `DeviceMemoryResource`): a driver pool of
/// emm's, or the device's default pool. Streams are `CUstream` handles as integers (0: the
/// legacy default stream) that must outlive the buffers allocated on them.
#[pyclass(module = "emm._emm", frozen)]
struct MemoryResource {
    inner: emm::DeviceMemoryResource,
    ctx: emm::Context,
}

#[pymethods]
impl MemoryResource {
    /// `size` bytes on `stream`, freed there when the buffer is released or deallocated.
    #[pyo3(signature = (size, stream=StreamArg::NULL), text_signature = "(self, size, stream=0)")]
    fn allocate(&self, py: Python<'_>, size: usize, stream: StreamArg) -> PyResult<DeviceBuffer> {
        let stream = stream.stream(&self.ctx);
        py.detach(|| self.inner.allocate(size, &stream))
            .map(DeviceBuffer::new)
            .map_err(py_err)
    }

    /// Frees `buffer` on `stream` (the buffer is released: later use raises); a failed free
    /// raises here.
    #[pyo3(signature = (buffer, stream=StreamArg::NULL), text_signature = "(self, buffer, stream=0)")]
    fn deallocate(&self, py: Python<'_>, buffer: &DeviceBuffer, stream: StreamArg) -> PyResult<()> {
        let stream = stream.stream(&self.ctx);
        let mem = buffer.pointer()?;
        lock(&buffer.mem).take();
        py.detach(|| self.inner.deallocate(mem, &stream))
            .map_err(py_err)
    }

    /// The pool's figures: a dict of `reserved_current`, `reserved_high`, `used_current`,
    /// `used_high` and `release_threshold`, in bytes.
    fn attributes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        attributes_dict(py, self.inner.attributes().map_err(py_err)?)
    }

    /// Starts the high-water marks again from the current figures.
    fn reset_high_water(&self) -> PyResult<()> {
        self.inner.reset_high_water().map_err(py_err)
    }

    /// Whether emm created the pool (and destroys it at `close`).
    #[getter]
    fn is_handle_owned(&self) -> bool {
        self.inner.is_handle_owned()
    }

    /// Whether the pool's memory can be exported to other processes.
    #[getter]
    fn is_ipc_enabled(&self) -> bool {
        self.inner.is_ipc_enabled()
    }

    /// The device ordinal.
    #[getter]
    fn device_id(&self) -> u32 {
        self.inner.device().0
    }

    /// Buffers allocated and not freed yet.
    fn live_buffers(&self) -> usize {
        self.inner.live_buffers()
    }

    /// No more allocations; an owned pool is destroyed (live buffers stay valid until freed).
    fn close(&self) -> PyResult<()> {
        self.inner.close().map_err(py_err)
    }
}

/// A stream-ordered pinned memory resource (cuda.core's `PinnedMemoryResource`): a driver
/// pool in host memory; its buffers are host buffers with one address for the host and the
/// device. Streams as for `MemoryResource`.
#[pyclass(module = "emm._emm", frozen)]
struct PinnedResource {
    inner: emm::PinnedMemoryResource,
    ctx: emm::Context,
}

#[pymethods]
impl PinnedResource {
    /// `size` bytes of page-locked host memory on `stream` (synchronise the stream before the
    /// host touches them).
    #[pyo3(signature = (size, stream=StreamArg::NULL), text_signature = "(self, size, stream=0)")]
    fn allocate(&self, py: Python<'_>, size: usize, stream: StreamArg) -> PyResult<HostBuffer> {
        let stream = stream.stream(&self.ctx);
        py.detach(|| self.inner.allocate(size, &stream))
            .map(host_buffer)
            .map_err(py_err)
    }

    /// Frees `buffer` on `stream` (the buffer is released).
    #[pyo3(signature = (buffer, stream=StreamArg::NULL), text_signature = "(self, buffer, stream=0)")]
    fn deallocate(&self, py: Python<'_>, buffer: &HostBuffer, stream: StreamArg) -> PyResult<()> {
        let stream = stream.stream(&self.ctx);
        let mem = take_to_deallocate(&buffer.mem, "HostBuffer")?;
        py.detach(|| self.inner.deallocate(mem, &stream))
            .map_err(py_err)
    }

    /// The host NUMA node of the pool, or None.
    #[getter]
    fn numa_id(&self) -> Option<i32> {
        self.inner.numa_id()
    }

    /// Whether the pool's memory can be exported to other processes.
    #[getter]
    fn is_ipc_enabled(&self) -> bool {
        self.inner.is_ipc_enabled()
    }

    /// The pool's figures, as `MemoryResource.attributes()`.
    fn attributes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        attributes_dict(py, self.inner.attributes().map_err(py_err)?)
    }

    /// No more allocations; the pool is destroyed once its last buffer is freed (live buffers
    /// stay valid until then).
    fn close(&self) -> PyResult<()> {
        self.inner.close().map_err(py_err)
    }
}

/// Takes a buffer's memory out for `deallocate` (the buffer is released from then on); a
/// buffer released already raises.
fn take_to_deallocate<T>(slot: &Mutex<Option<T>>, kind: &str) -> PyResult<T> {
    lock(slot).take().ok_or_else(|| {
        PyEmmError::new_err(format!(
            "this {kind} was released already; nothing to deallocate"
        ))
    })
}

/// A stream-ordered managed memory resource (cuda.core's `ManagedMemoryResource`): a
/// managed-memory pool (CUDA 13 on); its buffers are managed buffers. Streams as for
/// `MemoryResource`.
#[pyclass(module = "emm._emm", frozen)]
struct ManagedResource {
    inner: emm::ManagedMemoryResource,
    ctx: emm::Context,
}

#[pymethods]
impl ManagedResource {
    /// `size` bytes of managed memory on `stream` (synchronise the stream before the host
    /// touches them).
    #[pyo3(signature = (size, stream=StreamArg::NULL), text_signature = "(self, size, stream=0)")]
    fn allocate(&self, py: Python<'_>, size: usize, stream: StreamArg) -> PyResult<ManagedBuffer> {
        let stream = stream.stream(&self.ctx);
        let mem = py
            .detach(|| self.inner.allocate(size, &stream))
            .map_err(py_err)?;
        Ok(ManagedBuffer {
            ptr: mem.device().device_ptr().0,
            size: mem.size(),
            mem: Mutex::new(Some(mem)),
        })
    }

    /// Frees `buffer` on `stream` (the buffer is released: later use raises).
    #[pyo3(signature = (buffer, stream=StreamArg::NULL), text_signature = "(self, buffer, stream=0)")]
    fn deallocate(
        &self,
        py: Python<'_>,
        buffer: &ManagedBuffer,
        stream: StreamArg,
    ) -> PyResult<()> {
        let stream = stream.stream(&self.ctx);
        let mem = take_to_deallocate(&buffer.mem, "ManagedBuffer")?;
        py.detach(|| self.inner.deallocate(mem, &stream))
            .map_err(py_err)
    }

    /// The pool's figures, as `MemoryResource.attributes()`.
    fn attributes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        attributes_dict(py, self.inner.attributes().map_err(py_err)?)
    }

    /// No more allocations; the pool is destroyed once its last buffer is freed (live buffers
    /// stay valid until then).
    fn close(&self) -> PyResult<()> {
        self.inner.close().map_err(py_err)
    }
}

#[pyclass(module = "emm._emm", frozen)]
struct Context {
    inner: emm::Context,
}

#[pymethods]
impl Context {
    /// The device ordinal.
    #[getter]
    fn device(&self) -> u32 {
        self.inner.device().0
    }

    /// The manager's name.
    #[getter]
    fn manager(&self) -> String {
        self.inner.memory_manager_name().to_owned()
    }

    /// A new n-d array of `shape` and `dtype` (a NumPy name: "float32", "int64", ...) in
    /// `order` ("C" or "F"), from the manager: `emm.Array`, which PyTorch, CuPy and other
    /// DLPack consumers take without a copy (`torch.from_dlpack(a)`).
    #[pyo3(signature = (shape, dtype, order="C"))]
    fn device_array(
        &self,
        py: Python<'_>,
        shape: Vec<usize>,
        dtype: &Bound<'_, PyAny>,
        order: &str,
    ) -> PyResult<array::Array> {
        array::Array::allocate(&self.inner, py, shape, dtype, order)
    }

    /// Another library's device array (anything with `__dlpack__`: a PyTorch tensor, a CuPy
    /// array) as an `emm.Array` of this device, without a copy; emm never frees it, and the
    /// producer's deleter runs once, when the last emm view of it is gone.
    // The name is the DLPack protocol's (`torch.from_dlpack`, `cupy.from_dlpack`).
    #[allow(clippy::wrong_self_convention)]
    fn from_dlpack(&self, obj: &Bound<'_, PyAny>) -> PyResult<array::Array> {
        array::Array::import(&self.inner, obj)
    }

    /// `size` bytes of device memory.
    fn memalloc(&self, py: Python<'_>, size: usize) -> PyResult<DeviceBuffer> {
        py.detach(|| self.inner.memalloc(size))
            .map(DeviceBuffer::new)
            .map_err(py_err)
    }

    /// `size` bytes of device memory for work on `stream`, freed on that stream when the
    /// buffer goes. `stream` is a stream object (CuPy's, PyTorch's, cuda.core's, Numba's:
    /// anything with `__cuda_stream__`), which the buffer holds so that the stream outlives
    /// it; 0, 1 or 2 for the implicit default streams; or an `ExternalStream` for a raw
    /// handle the caller vouches for. Other integers are refused: the driver would crash on a
    /// wrong handle. Under a manager that does not allocate on streams this is refused;
    /// `stream_ordering` says which kind this is.
    fn memalloc_on(
        &self,
        py: Python<'_>,
        size: usize,
        stream: StreamArg,
    ) -> PyResult<DeviceBuffer> {
        let stream = stream.stream(&self.inner);
        py.detach(|| self.inner.memalloc_on(size, &stream))
            .map(DeviceBuffer::new)
            .map_err(py_err)
    }

    /// A memory resource over a new driver pool of this device (cuda.core's
    /// `DeviceMemoryResource`): `max_size` bytes at most (0: no limit), `ipc_enabled` for a
    /// pool other processes can import.
    #[pyo3(signature = (max_size=0, ipc_enabled=false))]
    fn device_memory_resource(
        &self,
        max_size: usize,
        ipc_enabled: bool,
    ) -> PyResult<MemoryResource> {
        let options = emm::DeviceMemoryResourceOptions {
            max_size,
            ipc_enabled,
        };
        self.inner
            .device_memory_resource(options)
            .map(|inner| MemoryResource {
                inner,
                ctx: self.inner.clone(),
            })
            .map_err(py_err)
    }

    /// A pinned memory resource (cuda.core's `PinnedMemoryResource`) for this device:
    /// `max_size` bytes at most (0: no limit), `ipc_enabled`, `numa_id` (a host NUMA node).
    #[pyo3(signature = (max_size=0, ipc_enabled=false, numa_id=None))]
    fn pinned_memory_resource(
        &self,
        max_size: usize,
        ipc_enabled: bool,
        numa_id: Option<i32>,
    ) -> PyResult<PinnedResource> {
        let options = emm::PinnedMemoryResourceOptions {
            max_size,
            ipc_enabled,
            numa_id,
        };
        self.inner
            .pinned_memory_resource(options)
            .map(|inner| PinnedResource {
                inner,
                ctx: self.inner.clone(),
            })
            .map_err(py_err)
    }

    /// A managed memory resource (cuda.core's `ManagedMemoryResource`) for this device: a
    /// managed-memory pool; `preferred_location_type` "device" (with `preferred_location` a
    /// device ordinal), "host", "host_numa" (with a NUMA node), or None for no preference.
    #[pyo3(signature = (preferred_location_type=None, preferred_location=None))]
    fn managed_memory_resource(
        &self,
        preferred_location_type: Option<&str>,
        preferred_location: Option<i32>,
    ) -> PyResult<ManagedResource> {
        use emm::driver_sys::MemLocation;
        let preferred = match (preferred_location_type, preferred_location) {
            (None, None) => None,
            (Some("device"), Some(d)) if d >= 0 => {
                Some(MemLocation::Device(DeviceOrdinal(d as u32)))
            }
            (Some("host"), None) => Some(MemLocation::Host),
            (Some("host_numa"), Some(n)) if n >= 0 => Some(MemLocation::HostNuma(n)),
            (t, l) => {
                return Err(PyValueError::new_err(format!(
                    "preferred location ({t:?}, {l:?}): give None, ('device', ordinal), \
                     ('host', None) or ('host_numa', node)"
                )));
            }
        };
        let options = emm::ManagedMemoryResourceOptions {
            preferred_location: preferred,
        };
        self.inner
            .managed_memory_resource(options)
            .map(|inner| ManagedResource {
                inner,
                ctx: self.inner.clone(),
            })
            .map_err(py_err)
    }

    /// A memory resource over the device's default pool, which emm does not own.
    fn default_device_memory_resource(&self) -> PyResult<MemoryResource> {
        self.inner
            .default_device_memory_resource()
            .map(|inner| MemoryResource {
                inner,
                ctx: self.inner.clone(),
            })
            .map_err(py_err)
    }

    /// How the manager orders memory allocated on streams: "fenced", "per-stream", "driver",
    /// or "unsupported".
    fn stream_ordering(&self) -> &'static str {
        stream_ordering_name(self.inner.stream_ordering())
    }

    /// `size` bytes of page-locked host memory; `mapped` maps it into the device.
    #[pyo3(signature = (size, mapped=false, portable=false, wc=false))]
    fn memhostalloc(
        &self,
        py: Python<'_>,
        size: usize,
        mapped: bool,
        portable: bool,
        wc: bool,
    ) -> PyResult<HostBuffer> {
        let mem = py
            .detach(|| self.inner.memhostalloc(size, mapped, portable, wc))
            .map_err(py_err)?;
        Ok(host_buffer(mem))
    }

    /// Pins `size` bytes at `pointer`, which `owner` keeps alive (Numba's `mempin`); the pin
    /// holds a reference to `owner` until it is released. Where `owner` exports its memory
    /// (the buffer protocol: a NumPy array, a `bytearray`, a ctypes array), the range must lie
    /// within it.
    #[pyo3(signature = (owner, pointer, size, mapped=false))]
    fn mempin(
        &self,
        py: Python<'_>,
        owner: Py<PyAny>,
        pointer: usize,
        size: usize,
        mapped: bool,
    ) -> PyResult<HostBuffer> {
        if pointer == 0 {
            return Err(PyValueError::new_err(
                "mempin of a null pointer: pass the address of the owner's memory",
            ));
        }
        let exported = host_range::exported(owner.bind(py))?;
        if let Some((start, end)) = exported {
            let inside = pointer >= start && pointer.checked_add(size).is_some_and(|e| e <= end);
            if !inside {
                return Err(PyValueError::new_err(format!(
                    "mempin of {size} bytes at {pointer:#x} reaches outside the {} bytes the \
                     owner exports at {start:#x}: pass the address and size of the owner's own \
                     memory (for a NumPy array, a.ctypes.data and a.nbytes)",
                    end - start
                )));
            }
        }
        // The Python object that owns the memory: the pin holds it until the pin ends.
        let keeper: emm::HostOwner = Arc::new(owner);
        // SAFETY: the caller (Numba's contract for `mempin`) passes `pointer .. pointer + size`
        // as memory `owner` keeps alive, and the pin holds `owner`; emm makes no references to
        // that memory.
        let mem =
            unsafe { self.inner.mempin(keeper, HostPtr(pointer), size, mapped) }.map_err(py_err)?;
        Ok(host_buffer(mem))
    }

    /// `size` bytes of managed memory, attached globally unless `attach_global` is false.
    #[pyo3(signature = (size, attach_global=true))]
    fn memallocmanaged(
        &self,
        py: Python<'_>,
        size: usize,
        attach_global: bool,
    ) -> PyResult<ManagedBuffer> {
        let mem = py
            .detach(|| self.inner.memallocmanaged(size, attach_global))
            .map_err(py_err)?;
        Ok(ManagedBuffer {
            ptr: mem.device().device_ptr().0,
            size: mem.size(),
            mem: Mutex::new(Some(mem)),
        })
    }

    /// Copies `data` to `buffer` at `offset`.
    #[pyo3(signature = (buffer, data, offset=0))]
    fn copy_to_device(
        &self,
        py: Python<'_>,
        buffer: &DeviceBuffer,
        data: &[u8],
        offset: usize,
    ) -> PyResult<()> {
        let mem = buffer.pointer()?;
        let view = mem.view(offset, None).map_err(py_err)?;
        py.detach(|| self.inner.copy_to_device(&view, data))
            .map_err(py_err)
    }

    /// `n` bytes of `buffer` from `offset` (all of it from `offset` when `n` is `None`).
    #[pyo3(signature = (buffer, n=None, offset=0))]
    fn copy_to_host<'py>(
        &self,
        py: Python<'py>,
        buffer: &DeviceBuffer,
        n: Option<usize>,
        offset: usize,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let mem = buffer.pointer()?;
        let view = mem.view(offset, None).map_err(py_err)?;
        let mut out = vec![0u8; n.unwrap_or(view.size())];
        py.detach(|| self.inner.copy_to_host(&mut out, &view))
            .map_err(py_err)?;
        Ok(PyBytes::new(py, &out))
    }

    /// An IPC handle of `buffer`'s memory from `offset` (`size` bytes, or to its end).
    #[pyo3(signature = (buffer, offset=0, size=None))]
    fn get_ipc_handle(
        &self,
        buffer: &DeviceBuffer,
        offset: usize,
        size: Option<usize>,
    ) -> PyResult<Ipc> {
        let mem = buffer.pointer()?;
        let view = mem
            .view(offset, size.map(|s| offset.saturating_add(s)))
            .map_err(py_err)?;
        let handle = self.inner.get_ipc_handle(&view).map_err(py_err)?;
        Ok(Ipc { handle })
    }

    /// Opens, in this process, the handle another process exported (`Ipc.data`); the buffer
    /// closes the mapping when released.
    fn open_ipc(&self, data: &[u8]) -> PyResult<DeviceBuffer> {
        let handle = IpcHandle::from_bytes(data).map_err(py_err)?;
        let rt = runtime()?;
        let mem = handle.open(&rt, &self.inner).map_err(py_err)?;
        let buffer = DeviceBuffer::new(mem);
        *lock(&buffer.opened) = Some(handle);
        Ok(buffer)
    }

    /// `(free, total)` device memory in bytes, as the manager reports it.
    fn get_memory_info(&self, py: Python<'_>) -> PyResult<(usize, usize)> {
        let info = py.detach(|| self.inner.get_memory_info()).map_err(py_err)?;
        Ok((info.free, info.total))
    }

    /// Frees everything the manager allocated in the context (buffers become unusable).
    fn reset(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.reset()).map_err(py_err)
    }

    /// A context manager that defers frees until it exits (nested uses count).
    fn defer_cleanup(&self) -> Deferral {
        Deferral {
            ctx: self.inner.clone(),
            guard: Mutex::new(None),
        }
    }

    /// Issues the deferred frees now; returns how many.
    fn flush(&self, py: Python<'_>) -> PyResult<usize> {
        py.detach(|| self.inner.flush_deallocations())
            .map_err(py_err)
    }

    /// Frees queued in the deferred queue now.
    #[getter]
    fn pending(&self) -> usize {
        self.inner.deallocations().map_or(0, |q| q.len())
    }

    /// Releases what the manager holds back (pool chunks, cached pinned blocks); returns bytes.
    fn trim(&self, py: Python<'_>) -> PyResult<usize> {
        py.detach(|| self.inner.trim()).map_err(py_err)
    }

    /// Sets the out-of-memory callback (`None` removes it): `callback(nbytes)` is called when
    /// an allocation of `nbytes` fails after the manager's own retry; it may free memory and
    /// returns true to have the allocation tried again (at most three times an allocation).
    /// An exception in it is printed and counts as false.
    fn on_out_of_memory(&self, callback: Option<Py<PyAny>>) {
        self.inner.on_out_of_memory(callback.map(|f| {
            Arc::new(move |bytes: usize| {
                Python::attach(|py| match f.call1(py, (bytes,)) {
                    Ok(v) => v.is_truthy(py).unwrap_or(false),
                    Err(e) => {
                        e.write_unraisable(py, Some(f.bind(py)));
                        false
                    }
                })
            }) as Arc<emm::OutOfMemoryCallback>
        }));
    }

    /// How often allocations ran out of memory: `retries` (tried again after memory was
    /// freed, PyTorch's `num_alloc_retries`) and `ooms` (failures callers saw).
    fn allocation_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let e = self.inner.allocation_events();
        let d = PyDict::new(py);
        d.set_item("retries", e.retries())?;
        d.set_item("ooms", e.ooms())?;
        Ok(d)
    }

    /// What the `stats` adaptor counted, per kind (`None` without it): each kind a dict of
    /// `current_bytes`, `peak_bytes`, `total_bytes`, `current_count`, `peak_count`,
    /// `total_count`.
    fn usage<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(u) = self.inner.usage() else {
            return Ok(None);
        };
        let out = PyDict::new(py);
        for (name, k) in [
            ("device", u.device),
            ("pinned", u.pinned),
            ("mapped", u.mapped),
            ("pin", u.pin),
            ("managed", u.managed),
        ] {
            let d = PyDict::new(py);
            d.set_item("current_bytes", k.current_bytes)?;
            d.set_item("peak_bytes", k.peak_bytes)?;
            d.set_item("total_bytes", k.total_bytes)?;
            d.set_item("current_count", k.current_count)?;
            d.set_item("peak_count", k.peak_count)?;
            d.set_item("total_count", k.total_count)?;
            out.set_item(name, d)?;
        }
        Ok(Some(out))
    }

    /// The free space of the manager's device pool (`None` without a pool, or where it cannot
    /// tell): a dict of `blocks` (their count), `total_bytes`, `largest_bytes`,
    /// `fragmentation` (the share of free bytes outside the largest block), `histogram` (a
    /// list of `(upper, count, bytes)`, a bucket per power of two, sizes in `(upper / 2,
    /// upper]`) and, given `request`, `unusable_bytes`: the free bytes requests of that many
    /// bytes each cannot use.
    #[pyo3(signature = (request=None))]
    fn free_space<'py>(
        &self,
        py: Python<'py>,
        request: Option<usize>,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(space) = py.detach(|| self.inner.free_space()) else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        d.set_item("blocks", space.blocks.len())?;
        d.set_item("total_bytes", space.total_bytes())?;
        d.set_item("largest_bytes", space.largest_bytes())?;
        d.set_item("fragmentation", space.fragmentation())?;
        d.set_item("histogram", space.histogram())?;
        if let Some(request) = request {
            d.set_item("unusable_bytes", space.unusable_for(request))?;
        }
        Ok(Some(d))
    }

    /// What the manager's pools hold: `device` and `pinned_host`, each `None` or a dict of
    /// `held_bytes`, `in_use_bytes`, `in_use_blocks`, `cached_bytes`, `peak_held_bytes`,
    /// `chunks`, `grows`, `trimmed_bytes` and `largest_free_bytes` (`None` where the pool
    /// cannot tell).
    fn pool_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let report = self.inner.pool_stats();
        let out = PyDict::new(py);
        for (name, stats) in [
            ("device", report.device),
            ("pinned_host", report.pinned_host),
        ] {
            match stats {
                Some(s) => {
                    let d = PyDict::new(py);
                    d.set_item("held_bytes", s.held_bytes)?;
                    d.set_item("in_use_bytes", s.in_use_bytes)?;
                    d.set_item("in_use_blocks", s.in_use_blocks)?;
                    d.set_item("cached_bytes", s.cached_bytes)?;
                    d.set_item("peak_held_bytes", s.peak_held_bytes)?;
                    d.set_item("chunks", s.chunks)?;
                    d.set_item("grows", s.grows)?;
                    d.set_item("trimmed_bytes", s.trimmed_bytes)?;
                    d.set_item("largest_free_bytes", s.largest_free_bytes)?;
                    out.set_item(name, d)?;
                }
                None => out.set_item(name, py.None())?,
            }
        }
        Ok(out)
    }
}

fn host_buffer(mem: HostMemory) -> HostBuffer {
    HostBuffer {
        host_ptr: mem.host_ptr().0,
        device_ptr: mem.mapped().map(|m| m.device().device_ptr().0),
        size: mem.size(),
        mem: Mutex::new(Some(mem)),
    }
}

// PyTorch's pluggable allocator: C functions this library exports, over the process runtime.

/// What PyTorch holds from emm: its allocations by address (kept alive until PyTorch frees
/// them) and, per device, the counts `emm.torch.memory_stats()` reports.
#[derive(Default)]
struct TorchState {
    live: AddressMap<MemoryPointer>,
    devices: BTreeMap<u32, TorchCounters>,
}

/// PyTorch's allocations on one device: bytes and counts now, at their peak (since the last
/// `reset_peak_memory_stats`), allocated and freed in all, and failures for lack of memory.
#[derive(Clone, Copy, Default)]
struct TorchCounters {
    current_bytes: u64,
    peak_bytes: u64,
    allocated_bytes: u64,
    freed_bytes: u64,
    current_count: u64,
    peak_count: u64,
    allocated_count: u64,
    freed_count: u64,
    ooms: u64,
}

static TORCH: Mutex<Option<TorchState>> = Mutex::new(None);
/// What went wrong in the last call PyTorch made, for `emm.torch.last_error()`.
static TORCH_ERROR: Mutex<Option<String>> = Mutex::new(None);

fn torch_state() -> MutexGuard<'static, Option<TorchState>> {
    lock(&TORCH)
}

fn torch_error(message: String) {
    tracing::error!(%message, "emm.torch");
    eprintln!("emm.torch: {message}");
    *lock(&TORCH_ERROR) = Some(message);
}

unsafe extern "C-unwind" {
    /// Throws a C++ `std::runtime_error` carrying `message` (copied), through the caller:
    /// `src/throw.cpp`.
    fn emm_throw_runtime_error(message: *const std::ffi::c_char) -> !;
}

/// PyTorch's `malloc` for `emm.torch.install()`: `size` bytes on `device` (0 bytes: a null
/// pointer, no allocation), on `stream`, the stream PyTorch will use the memory on, where the
/// manager allocates on streams (else in the order of the legacy default stream). An
/// allocation that fails throws a C++ exception with emm's message, which PyTorch raises as a
/// `RuntimeError` (its pluggable allocator would take a null pointer for memory); the message
/// is also kept for `emm.torch.last_error()`.
#[unsafe(no_mangle)]
pub extern "C-unwind" fn emm_torch_malloc(
    size: isize,
    device: i32,
    stream: *mut c_void,
) -> *mut c_void {
    match torch_allocate(size, device, stream) {
        Ok(ptr) => ptr,
        Err(message) => {
            let message = std::ffi::CString::new(message.replace('\0', " ")).unwrap_or_default();
            // SAFETY: a NUL-terminated string that lives until the exception has copied it;
            // this frame is `C-unwind`, its caller PyTorch's C++, which catches the exception.
            unsafe { emm_throw_runtime_error(message.as_ptr()) }
        }
    }
}

/// PyTorch's `malloc` for `emm.torch.mem_pool()`, where PyTorch's caching allocator calls it
/// for segments: as [`emm_torch_malloc`], but a failure returns null, which the caching
/// allocator handles (it frees what it caches, retries, and raises its own out-of-memory
/// error).
#[unsafe(no_mangle)]
pub extern "C" fn emm_torch_pool_malloc(
    size: isize,
    device: i32,
    stream: *mut c_void,
) -> *mut c_void {
    torch_allocate(size, device, stream).unwrap_or(std::ptr::null_mut())
}

/// An allocation for PyTorch, counted; a failure's message is recorded and returned.
fn torch_allocate(size: isize, device: i32, stream: *mut c_void) -> Result<*mut c_void, String> {
    if size == 0 {
        // An empty buffer: a null pointer, without the manager (as PyTorch's own allocator).
        return Ok(std::ptr::null_mut());
    }
    // The error's text, and whether it was for lack of memory.
    let made = (|| -> Result<MemoryPointer, (String, bool)> {
        let size =
            usize::try_from(size).map_err(|_| (format!("a negative size ({size})"), false))?;
        let device =
            u32::try_from(device).map_err(|_| (format!("a negative device ({device})"), false))?;
        let mem = with_device_context(device, |ctx| {
            if ctx.stream_ordering() == StreamOrdering::Unsupported {
                ctx.memalloc(size)
            } else {
                // SAFETY: PyTorch's stream of this device (its streams live as long as the
                // process; 0 is the legacy default stream), the one it will use the memory
                // on and pass back to `free`.
                unsafe { ctx.memalloc_on_raw(size, StreamHandle::from_raw(stream as usize as u64)) }
            }
        })
        .map_err(|e| (e.to_string(), false))?;
        mem.map_err(|e| (e.to_string(), e.is_out_of_memory()))
    })();
    match made {
        Ok(mem) => {
            let ptr = mem.device_ptr().0;
            let bytes = mem.size() as u64;
            let mut state = torch_state();
            let state = state.get_or_insert_with(TorchState::default);
            let c = state.devices.entry(mem.device().0).or_default();
            c.current_bytes += bytes;
            c.peak_bytes = c.peak_bytes.max(c.current_bytes);
            c.allocated_bytes += bytes;
            c.current_count += 1;
            c.peak_count = c.peak_count.max(c.current_count);
            c.allocated_count += 1;
            state.live.insert(ptr, mem);
            Ok(ptr as usize as *mut c_void)
        }
        Err((e, oom)) => {
            if oom && let Ok(d) = u32::try_from(device) {
                let mut state = torch_state();
                let state = state.get_or_insert_with(TorchState::default);
                state.devices.entry(d).or_default().ooms += 1;
            }
            let message = format!("malloc of {size} bytes on device {device}: {e}");
            torch_error(message.clone());
            Err(message)
        }
    }
}

/// PyTorch's `free`: gives back memory [`emm_torch_malloc`] returned (a null pointer: nothing
/// to do). A pointer emm did not
/// hand out is refused (nothing is freed); a size that differs from the allocation's is
/// reported, and the memory freed all the same (the pointer names it). Both are recorded for
/// `emm.torch.last_error()` and printed.
#[unsafe(no_mangle)]
pub extern "C" fn emm_torch_free(ptr: *mut c_void, size: isize, device: i32, stream: *mut c_void) {
    if ptr.is_null() {
        return;
    }
    let addr = ptr as usize as u64;
    let mem = {
        let mut state = torch_state();
        let Some(state) = state.as_mut() else {
            drop(state);
            return torch_error(format!(
                "free of 0x{addr:x} ({size} bytes, device {device}), which emm did not allocate for PyTorch; nothing was freed"
            ));
        };
        let mem = state.live.remove(&addr);
        if let Some(mem) = &mem {
            let c = state.devices.entry(mem.device().0).or_default();
            c.current_bytes -= mem.size() as u64;
            c.freed_bytes += mem.size() as u64;
            c.current_count -= 1;
            c.freed_count += 1;
        }
        mem
    };
    let Some(mem) = mem else {
        torch_error(format!(
            "free of 0x{addr:x} ({size} bytes, device {device}), which emm did not allocate for PyTorch (or freed already); nothing was freed"
        ));
        return;
    };
    if usize::try_from(size).ok() != Some(mem.size()) {
        torch_error(format!(
            "free of 0x{addr:x} with size {size}, but it was allocated with {} bytes; freed",
            mem.size()
        ));
    }
    // PyTorch frees on the stream it allocated on; if it names another, the free goes there
    // (after the allocation stream's work, which the manager orders).
    let raw = stream as usize as u64;
    if mem.stream().is_some_and(|s| s.raw() != raw) {
        let moved = with_device_context(mem.device().0, |ctx| {
            // SAFETY: PyTorch's stream of this device (its streams live as long as the
            // process), which PyTorch hands to `free` as the memory's last user.
            let stream = unsafe { ctx.external_stream(StreamHandle::from_raw(raw)) };
            mem.free_on(&stream)
        });
        if !matches!(moved, Ok(Ok(()))) {
            torch_error(format!(
                "free of 0x{addr:x} on stream 0x{raw:x}: the memory was not allocated on a stream; freed"
            ));
        }
    }
    drop_memory(mem);
}

/// The message of the last failed PyTorch allocator call, cleared by reading it.
#[pyfunction]
fn torch_last_error() -> Option<String> {
    lock(&TORCH_ERROR).take()
}

/// How many allocations PyTorch holds from emm now.
#[pyfunction]
fn torch_live() -> usize {
    torch_state().as_ref().map_or(0, |s| s.live.len())
}

/// PyTorch's allocations from emm on `device`: `current_bytes`, `peak_bytes`,
/// `allocated_bytes`, `freed_bytes`, the same four `_count`s, and `ooms`.
#[pyfunction]
fn torch_counters(py: Python<'_>, device: u32) -> PyResult<Bound<'_, PyDict>> {
    let c = torch_state()
        .as_ref()
        .and_then(|s| s.devices.get(&device).copied())
        .unwrap_or_default();
    let d = PyDict::new(py);
    for (k, v) in [
        ("current_bytes", c.current_bytes),
        ("peak_bytes", c.peak_bytes),
        ("allocated_bytes", c.allocated_bytes),
        ("freed_bytes", c.freed_bytes),
        ("current_count", c.current_count),
        ("peak_count", c.peak_count),
        ("allocated_count", c.allocated_count),
        ("freed_count", c.freed_count),
        ("ooms", c.ooms),
    ] {
        d.set_item(k, v)?;
    }
    Ok(d)
}

/// Sets the peaks of PyTorch's allocations on `device` to what is allocated now.
#[pyfunction]
fn torch_reset_peaks(device: u32) {
    if let Some(c) = torch_state()
        .as_mut()
        .and_then(|s| s.devices.get_mut(&device))
    {
        c.peak_bytes = c.current_bytes;
        c.peak_count = c.current_count;
    }
}

/// A pool's figures as the dict the resources' `attributes()` return.
fn attributes_dict(
    py: Python<'_>,
    a: emm::driver_sys::MemPoolUsage,
) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("reserved_current", a.reserved)?;
    d.set_item("reserved_high", a.reserved_high)?;
    d.set_item("used_current", a.used)?;
    d.set_item("used_high", a.used_high)?;
    d.set_item("release_threshold", a.release_threshold)?;
    Ok(d)
}

/// The Python name of a stream ordering.
fn stream_ordering_name(o: StreamOrdering) -> &'static str {
    match o {
        StreamOrdering::Fenced => "fenced",
        StreamOrdering::PerStream => "per-stream",
        StreamOrdering::Driver => "driver",
        StreamOrdering::Unsupported => "unsupported",
    }
}

/// The extension module.
#[pymodule]
fn _emm(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // Logs go to standard error: a program's output stays its own.
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("EMM_LOG"))
        .try_init();
    m.add_function(wrap_pyfunction!(configure, m)?)?;
    m.add_function(wrap_pyfunction!(settings, m)?)?;
    m.add_function(wrap_pyfunction!(context, m)?)?;
    m.add_function(wrap_pyfunction!(device_count, m)?)?;
    m.add_function(wrap_pyfunction!(enable_capture_pools, m)?)?;
    m.add_function(wrap_pyfunction!(release_capture_pools, m)?)?;
    m.add_function(wrap_pyfunction!(torch_last_error, m)?)?;
    m.add_function(wrap_pyfunction!(torch_live, m)?)?;
    m.add_function(wrap_pyfunction!(torch_counters, m)?)?;
    m.add_function(wrap_pyfunction!(cupy::cupy_c_functions, m)?)?;
    m.add_function(wrap_pyfunction!(cupy::cupy_usage, m)?)?;
    m.add_function(wrap_pyfunction!(cupy::cupy_allocation, m)?)?;
    m.add_function(wrap_pyfunction!(torch_reset_peaks, m)?)?;
    m.add_class::<streams::ExternalStream>()?;
    m.add_class::<Context>()?;
    m.add_class::<MemoryResource>()?;
    m.add_class::<PinnedResource>()?;
    m.add_class::<ManagedResource>()?;
    m.add_class::<DeviceBuffer>()?;
    m.add_class::<array::Array>()?;
    m.add_class::<HostBuffer>()?;
    m.add_class::<ManagedBuffer>()?;
    m.add_class::<Ipc>()?;
    m.add_class::<Deferral>()?;
    m.add("EmmError", m.py().get_type::<PyEmmError>())?;
    m.add("OutOfMemoryError", m.py().get_type::<OutOfMemoryError>())?;
    Ok(())
}
