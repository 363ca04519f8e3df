//! `emm.Context`: one device's context in the process runtime, and the IPC handles and
//! deferral guards it gives out.

use crate::snapshot::with_python_stack;
use std::sync::{Arc, Mutex};

use crate::buffers::{DeviceBuffer, HostBuffer, ManagedBuffer, host_buffer};
use crate::resources::{ManagedResource, MemoryResource, PinnedResource};
use crate::runtime::{lock, runtime};
use crate::streams::StreamArg;
use crate::{array, host_range};
use crate::{py_err, stream_ordering_name};
use emm::IpcHandle;
use emm::driver_sys::{DeviceOrdinal, HostPtr};
use emm::plugin::DeferCleanup;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

/// An IPC handle of emm memory: `handle` (the driver's 64 bytes, of the allocation's base),
/// `offset` into that allocation, `size`, and `data` (emm's own serialization, which
/// [`Context::open_ipc`] opens in another process).
#[pyclass(module = "emm._emm", frozen)]
pub(crate) struct Ipc {
    pub(crate) handle: IpcHandle,
}

#[pymethods]
impl Ipc {
    /// The driver's handle bytes (`cuIpcGetMemHandle`'s 64, or a pool export's 64).
    #[getter]
    fn handle<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let bytes: &[u8] = match self.handle.handle() {
            emm::contract::IpcMemory::Allocation(h) => &h.0,
            emm::contract::IpcMemory::PoolAllocation { data, .. } => &data.0,
        };
        PyBytes::new(py, bytes)
    }

    /// Whether the handle is a `cuIpcGetMemHandle` handle (which any CUDA process opens);
    /// `False` for stream-ordered pool memory (`async-pool-ipc`), which needs emm's import.
    #[getter]
    fn is_driver_handle(&self) -> bool {
        matches!(
            self.handle.handle(),
            emm::contract::IpcMemory::Allocation(_)
        )
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

/// A `defer_cleanup` guard as a Python context manager. The same object may be entered again
/// inside its own `with` (`with d: with d:`): each entry holds a guard of its own, and each
/// exit lets go of the latest, so deferral lasts until the outermost exit.
#[pyclass(module = "emm._emm", frozen)]
pub(crate) struct Deferral {
    pub(crate) ctx: emm::Context,
    pub(crate) guards: Mutex<Vec<DeferCleanup>>,
}

#[pymethods]
impl Deferral {
    fn __enter__(slf: PyRef<'_, Self>) -> PyResult<PyRef<'_, Self>> {
        let guard = slf.ctx.defer_cleanup().map_err(py_err)?;
        lock(&slf.guards).push(guard);
        Ok(slf)
    }

    fn __exit__(
        &self,
        _ty: Option<&Bound<'_, PyAny>>,
        _value: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> bool {
        let guard = lock(&self.guards).pop();
        drop(guard);
        false
    }
}

/// One device's context in the process runtime: every allocation of the package goes
/// through it.
#[pyclass(module = "emm._emm", frozen)]
pub(crate) struct Context {
    pub(crate) inner: emm::Context,
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
        with_python_stack(py, &self.inner, || py.detach(|| self.inner.memalloc(size)))
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
        with_python_stack(py, &self.inner, || {
            py.detach(|| self.inner.memalloc_on(size, &stream))
        })
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
        Ok(host_buffer(mem, false))
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
        // The owner must say where its memory lies (the buffer protocol), or nothing tells the
        // pointer and size apart from any address of the process.
        let Some(exported) = host_range::exported(owner.bind(py))? else {
            return Err(PyValueError::new_err(format!(
                "mempin of {size} bytes at {pointer:#x}: the owner ({}) exports no buffer, so \
                 emm cannot check that the range is its memory; pass an owner that exports its \
                 memory through the buffer protocol (a NumPy array, a bytearray, a memoryview)",
                owner.bind(py).get_type().name()?
            )));
        };
        let (start, end) = (exported.start, exported.end);
        let inside = pointer >= start && pointer.checked_add(size).is_some_and(|e| e <= end);
        if !inside {
            return Err(PyValueError::new_err(format!(
                "mempin of {size} bytes at {pointer:#x} reaches outside the {} bytes the \
                 owner exports at {start:#x}: pass the address and size of the owner's own \
                 memory (for a NumPy array, a.ctypes.data and a.nbytes)",
                end - start
            )));
        }
        // The Python object that owns the memory: the pin holds it until the pin ends.
        let keeper: emm::plugin::HostOwner = Arc::new(owner);
        // SAFETY: the caller (Numba's contract for `mempin`) passes `pointer .. pointer + size`
        // as memory `owner` keeps alive, and the pin holds `owner`; emm makes no references to
        // that memory.
        let mem =
            unsafe { self.inner.mempin(keeper, HostPtr(pointer), size, mapped) }.map_err(py_err)?;
        Ok(host_buffer(mem, exported.read_only))
    }

    /// `size` bytes of managed memory, attached globally unless `attach_global` is false.
    #[pyo3(signature = (size, attach_global=true))]
    fn memallocmanaged(
        &self,
        py: Python<'_>,
        size: usize,
        attach_global: bool,
    ) -> PyResult<ManagedBuffer> {
        let mem = with_python_stack(py, &self.inner, || {
            py.detach(|| self.inner.memallocmanaged(size, attach_global))
        })
        .map_err(py_err)?;
        Ok(ManagedBuffer {
            ptr: mem.device().device_ptr().0,
            size: mem.size(),
            read_only: false,
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
        crate::buffers::check_span("copy_to_host", n.unwrap_or(0), offset, mem.size())?;
        let view = mem.view(offset, None).map_err(py_err)?;
        let n = n.unwrap_or(view.size());
        crate::buffers::check_span("copy_to_host", n, 0, view.size())?;
        let mut out = vec![0u8; n];
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
            guards: Mutex::new(Vec::new()),
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

    /// Puts the context's device memory to sleep (`vmm-pool` only; other managers raise
    /// `emm.EmmError`): the physical memory goes back to the driver while every address stays
    /// valid for the wake. Each live allocation made under a tag listed in `offload` is copied
    /// to page-locked host memory and back at the wake, one listed in `discard` loses its
    /// contents, one listed in `keep` stays mapped; the rest get `default` (`"offload"`,
    /// `"discard"` or `"keep"`). Choices by tag need the `history` adaptor
    /// (`EMM_MEMORY_ADAPTORS=history`). Waits for the device's work first. Until `wake()`,
    /// allocations and emm's copies of sleeping memory raise, and a kernel that touches it
    /// faults. `keep_host_buffer=True` keeps the page-locked buffer of the offload after the
    /// wake for the next sleep (pinned once for a process that sleeps often; `trim()` frees
    /// it). Returns `held_before_bytes`, `held_asleep_bytes`, `kept_bytes`, `offloaded_bytes`,
    /// `discarded_bytes`, `seconds`, `offload_seconds` (the copies alone) and
    /// `host_buffer_reused`.
    #[pyo3(signature = (offload=Vec::new(), discard=Vec::new(), keep=Vec::new(), default="offload", keep_host_buffer=false))]
    fn sleep<'py>(
        &self,
        py: Python<'py>,
        offload: Vec<String>,
        discard: Vec<String>,
        keep: Vec<String>,
        default: &str,
        keep_host_buffer: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        use emm::{SleepChoice, SleepOptions, Tag};
        let choice = |name: &str| match name {
            "offload" => Ok(SleepChoice::Offload),
            "discard" => Ok(SleepChoice::Discard),
            "keep" => Ok(SleepChoice::Keep),
            other => Err(PyValueError::new_err(format!(
                "sleep(default={other:?}): the choices are \"offload\", \"discard\" and \"keep\""
            ))),
        };
        let mut options =
            SleepOptions::new(choice(default)?).with_host_buffer_kept(keep_host_buffer);
        let mut seen = std::collections::HashMap::new();
        for (names, c) in [
            (&offload, SleepChoice::Offload),
            (&discard, SleepChoice::Discard),
            (&keep, SleepChoice::Keep),
        ] {
            for name in names {
                if let Some(before) = seen.insert(name.clone(), c)
                    && before != c
                {
                    return Err(PyValueError::new_err(format!(
                        "sleep(): the tag {name:?} is listed under both {:?} and {:?}; give \
                         each tag one choice",
                        before.name(),
                        c.name()
                    )));
                }
                options = options.with_tag(Tag::named(name), c);
            }
        }
        let report = py.detach(|| self.inner.sleep(&options)).map_err(py_err)?;
        let d = PyDict::new(py);
        d.set_item("held_before_bytes", report.held_before)?;
        d.set_item("held_asleep_bytes", report.held_asleep)?;
        d.set_item("kept_bytes", report.kept_bytes)?;
        d.set_item("offloaded_bytes", report.offloaded_bytes)?;
        d.set_item("discarded_bytes", report.discarded_bytes)?;
        d.set_item("seconds", report.elapsed.as_secs_f64())?;
        d.set_item("host_buffer_reused", report.host_buffer_reused)?;
        d.set_item("offload_seconds", report.offload_elapsed.as_secs_f64())?;
        Ok(d)
    }

    /// Wakes the memory `sleep()` put to sleep: mapped again at the same addresses, the
    /// offloaded allocations copied back. Returns `mapped_bytes`, `restored_bytes`,
    /// `held_after_bytes`, `seconds` and `restore_seconds` (the copies alone).
    fn wake<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let report = py.detach(|| self.inner.wake()).map_err(py_err)?;
        let d = PyDict::new(py);
        d.set_item("mapped_bytes", report.mapped_bytes)?;
        d.set_item("restored_bytes", report.restored_bytes)?;
        d.set_item("held_after_bytes", report.held_after)?;
        d.set_item("seconds", report.elapsed.as_secs_f64())?;
        d.set_item("restore_seconds", report.restore_elapsed.as_secs_f64())?;
        Ok(d)
    }

    /// Whether the context's memory is asleep (`sleep()`).
    #[getter]
    fn is_asleep(&self) -> bool {
        self.inner.is_asleep()
    }

    /// Sets the out-of-memory callback (`None` removes it): `callback(nbytes)` is called when
    /// an allocation of `nbytes` fails after the manager's own retry; it may free memory and
    /// returns true to have the allocation tried again (at most three times an allocation).
    /// An exception in it is printed and counts as false.
    fn on_out_of_memory(&self, py: Python<'_>, callback: Option<Py<PyAny>>) -> PyResult<()> {
        if let Some(f) = &callback
            && !f.bind(py).is_callable()
        {
            return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                "on_out_of_memory takes a callable (called with the bytes requested, returning \
                 whether to retry) or None, not a {}",
                f.bind(py).get_type().name()?
            )));
        }
        self.inner.on_out_of_memory(callback.map(|f| {
            Arc::new(move |bytes: usize| {
                Python::attach(|py| match f.call1(py, (bytes,)) {
                    Ok(v) => v.is_truthy(py).unwrap_or(false),
                    Err(e) => {
                        e.write_unraisable(py, Some(f.bind(py)));
                        false
                    }
                })
            }) as Arc<emm::contract::OutOfMemoryCallback>
        }));
        Ok(())
    }

    /// Everything the manager holds, segment by segment and block by block (`emm.Snapshot`):
    /// export it with `dump_torch(path)` for PyTorch's memory_viz, or `save_html(path)`.
    /// Tags, streams, times (and stacks with `history-stacks`) need the `history` adaptor:
    /// `EMM_MEMORY_ADAPTORS=history`.
    fn snapshot(&self, py: Python<'_>) -> crate::snapshot::Snapshot {
        crate::snapshot::Snapshot {
            inner: py.detach(|| self.inner.snapshot()),
        }
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
    /// `chunks`, `grows`, `driver_allocations`, `driver_frees`, `stream_waits` (waits on the
    /// GPU for another stream's work), `host_waits` (waits on the host for a stream's work),
    /// `trimmed_bytes` and `largest_free_bytes` (`None` where the pool cannot tell).
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
                    d.set_item("driver_allocations", s.driver_allocations)?;
                    d.set_item("driver_frees", s.driver_frees)?;
                    d.set_item("stream_waits", s.stream_waits)?;
                    d.set_item("host_waits", s.host_waits)?;
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
