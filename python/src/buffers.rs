//! The buffers Python holds: device, host and managed memory, released when the last reference
//! goes or at `release()`.

use std::sync::Mutex;

use crate::PyEmmError;
use crate::py_err;
use crate::runtime::{drop_memory, lock};
use emm::{EmmError, HostMemory, IpcHandle, ManagedMemory, MemoryPointer};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// Device memory from emm: released when the last Python reference goes (or at `release()`),
/// through the manager's deferred queue.
#[pyclass(module = "emm._emm", frozen)]
pub(crate) struct DeviceBuffer {
    pub(crate) mem: Mutex<Option<MemoryPointer>>,
    /// For memory opened from another process: the open handle, closed when the buffer is
    /// released (after the pointer).
    pub(crate) opened: Mutex<Option<IpcHandle>>,
    /// The device address.
    #[pyo3(get)]
    pub(crate) ptr: u64,
    /// Bytes.
    #[pyo3(get)]
    pub(crate) size: usize,
    /// The device ordinal.
    #[pyo3(get)]
    pub(crate) device: u32,
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if let Some(mem) = lock(&self.mem).take() {
            drop_memory(mem);
        }
    }
}

impl DeviceBuffer {
    pub(crate) fn new(mem: MemoryPointer) -> DeviceBuffer {
        DeviceBuffer {
            ptr: mem.device_ptr().0,
            size: mem.size(),
            device: mem.device().0,
            mem: Mutex::new(Some(mem)),
            opened: Mutex::new(None),
        }
    }

    pub(crate) fn pointer(&self) -> PyResult<MemoryPointer> {
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
pub(crate) struct HostBuffer {
    pub(crate) mem: Mutex<Option<HostMemory>>,
    /// The host address.
    #[pyo3(get)]
    pub(crate) host_ptr: usize,
    /// The device address of mapped memory; `None` when not mapped.
    #[pyo3(get)]
    pub(crate) device_ptr: Option<u64>,
    /// Bytes.
    #[pyo3(get)]
    pub(crate) size: usize,
    /// Pinned from memory its owner exports read-only (`bytes`): `write` refuses.
    #[pyo3(get)]
    pub(crate) read_only: bool,
}

/// The methods of the buffers the host reads and writes (page-locked and managed memory):
/// one definition for both classes.
macro_rules! host_side_methods {
    ($ty:ident) => {
        #[pymethods]
        impl $ty {
            /// Copies `data` into the memory at `offset`, from the host; refused for memory
            /// pinned from a read-only owner.
            #[pyo3(signature = (data, offset=0))]
            fn write(&self, data: &[u8], offset: usize) -> PyResult<()> {
                if self.read_only {
                    return Err(pyo3::exceptions::PyValueError::new_err(
                        "write to memory pinned from a read-only owner (such as bytes): its \
                         owner does not let it change; pin a writable buffer (a bytearray, a \
                         NumPy array) to write",
                    ));
                }
                with_live(&self.mem, |m| m.write(offset, data))
            }

            /// `n` bytes from `offset`, read on the host.
            #[pyo3(signature = (n, offset=0))]
            fn read<'py>(
                &self,
                py: Python<'py>,
                n: usize,
                offset: usize,
            ) -> PyResult<Bound<'py, PyBytes>> {
                // Bounded by the memory before anything is allocated for it: a size the host
                // cannot allocate would end the process.
                check_span("read", n, offset, self.size)?;
                let mut out = vec![0u8; n];
                with_live(&self.mem, |m| m.read(offset, &mut out))?;
                Ok(PyBytes::new(py, &out))
            }

            /// Gives the memory back (or unpins it) now; later use raises.
            fn release(&self) {
                lock(&self.mem).take();
            }
        }
    };
}

host_side_methods!(HostBuffer);
host_side_methods!(ManagedBuffer);

/// Refuses `n` bytes at `offset` of a buffer of `size` bytes that do not lie in it, with
/// Python's `ValueError`, before anything is allocated for them.
pub(crate) fn check_span(what: &str, n: usize, offset: usize, size: usize) -> PyResult<()> {
    if offset > size || n > size - offset {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "{what} of {n} bytes at offset {offset}: the buffer holds {size} bytes; ask for at \
             most {} bytes from there",
            size.saturating_sub(offset)
        )));
    }
    Ok(())
}

/// Runs `f` on a buffer's memory, unless the buffer was released.
pub(crate) fn with_live<M, T>(
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
pub(crate) struct ManagedBuffer {
    pub(crate) mem: Mutex<Option<ManagedMemory>>,
    /// The address, valid on the host and on the devices.
    #[pyo3(get)]
    pub(crate) ptr: u64,
    /// Bytes.
    #[pyo3(get)]
    pub(crate) size: usize,
    /// Always false: emm allocates managed memory itself (the shared methods ask).
    pub(crate) read_only: bool,
}

pub(crate) fn host_buffer(mem: HostMemory, read_only: bool) -> HostBuffer {
    HostBuffer {
        host_ptr: mem.host_ptr().0,
        device_ptr: mem.mapped().map(|m| m.device().device_ptr().0),
        size: mem.size(),
        read_only,
        mem: Mutex::new(Some(mem)),
    }
}
