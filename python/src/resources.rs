//! cuda.core's memory resources over emm: device, pinned and managed memory pools.

use std::sync::Mutex;

use crate::PyEmmError;
use crate::buffers::{DeviceBuffer, HostBuffer, ManagedBuffer, host_buffer};
use crate::py_err;
use crate::runtime::lock;
use crate::streams::StreamArg;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// A stream-ordered memory resource (cuda.core's `DeviceMemoryResource`): a driver pool of
/// emm's, or the device's default pool. Streams are taken as `Context.memalloc_on` takes them:
/// a stream object (held by the buffer), 0, 1 or 2, or an `ExternalStream`.
#[pyclass(module = "emm._emm", frozen)]
pub(crate) struct MemoryResource {
    pub(crate) inner: emm::DeviceMemoryResource,
    pub(crate) ctx: emm::Context,
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
pub(crate) struct PinnedResource {
    pub(crate) inner: emm::PinnedMemoryResource,
    pub(crate) ctx: emm::Context,
}

#[pymethods]
impl PinnedResource {
    /// `size` bytes of page-locked host memory on `stream` (synchronise the stream before the
    /// host touches them).
    #[pyo3(signature = (size, stream=StreamArg::NULL), text_signature = "(self, size, stream=0)")]
    fn allocate(&self, py: Python<'_>, size: usize, stream: StreamArg) -> PyResult<HostBuffer> {
        let stream = stream.stream(&self.ctx);
        py.detach(|| self.inner.allocate(size, &stream))
            .map(|m| host_buffer(m, false))
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
pub(crate) fn take_to_deallocate<T>(slot: &Mutex<Option<T>>, kind: &str) -> PyResult<T> {
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
pub(crate) struct ManagedResource {
    pub(crate) inner: emm::ManagedMemoryResource,
    pub(crate) ctx: emm::Context,
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
            read_only: false,
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

/// A pool's figures as the dict the resources' `attributes()` return.
pub(crate) fn attributes_dict(
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
