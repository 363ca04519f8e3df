//! `emm._emm`: the extension module behind the `emm` Python package.
//!
//! One emm [`Runtime`](emm::Runtime) per process (`configure`, or the environment at first
//! use), shared by everything the package offers: Numba's EMM plugin (`emm.numba`), CuPy's
//! allocator (`emm.cupy`) and PyTorch's pluggable allocator (`emm.torch`, through the C
//! functions `emm_torch_malloc` and `emm_torch_free` this library exports, in `torch.rs`).
//! Memory from all three comes from one manager and shows in one `usage()`.
//!
//! Calls that may wait for the GPU or the driver (allocations, which may flush deferred frees;
//! copies; resets; flushes; trims; memory info) release the GIL while they run.
//!
//! Errors become Python exceptions: [`EmmError`]'s message (what happened, what
//! to do) in `emm.EmmError` (a `RuntimeError`), or `emm.OutOfMemoryError` (a `MemoryError`)
//! when memory ran out.
#![allow(unsafe_code)]

use emm::EmmError;
use emm::contract::StreamOrdering;
mod array;
mod buffers;
mod context;
mod cupy;
mod host_range;
mod ledger;
mod resources;
mod runtime;
mod snapshot;
mod streams;
mod torch;

use pyo3::prelude::*;

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

use crate::buffers::{DeviceBuffer, HostBuffer, ManagedBuffer};
use crate::context::{Context, Deferral, Ipc};
use crate::resources::{ManagedResource, MemoryResource, PinnedResource};
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

/// The Python name of a stream ordering.
fn stream_ordering_name(o: StreamOrdering) -> &'static str {
    match o {
        StreamOrdering::Fenced => "fenced",
        StreamOrdering::PerStream => "per-stream",
        StreamOrdering::Driver => "driver",
        StreamOrdering::Unsupported => "unsupported",
    }
}

/// Writes out what the `log` adaptor buffered (the package calls it at exit: the process's
/// runtime lives until then, and a buffered line would be lost).
#[pyfunction]
fn flush_logs() {
    emm::Adaptor::flush_logs();
}

/// The extension module.
#[pymodule]
fn _emm(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // Logs go to standard error: a program's output stays its own.
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("EMM_LOG"))
        .try_init();
    m.add_function(wrap_pyfunction!(runtime::configure, m)?)?;
    m.add_function(wrap_pyfunction!(runtime::settings, m)?)?;
    m.add_function(wrap_pyfunction!(runtime::context, m)?)?;
    m.add_function(wrap_pyfunction!(runtime::device_count, m)?)?;
    m.add_function(wrap_pyfunction!(runtime::enable_capture_pools, m)?)?;
    m.add_function(wrap_pyfunction!(runtime::release_capture_pools, m)?)?;
    m.add_function(wrap_pyfunction!(flush_logs, m)?)?;
    m.add_function(wrap_pyfunction!(torch::torch_last_error, m)?)?;
    m.add_function(wrap_pyfunction!(torch::torch_live, m)?)?;
    m.add_function(wrap_pyfunction!(torch::torch_record_stream, m)?)?;
    m.add_function(wrap_pyfunction!(ledger::ledger_publish, m)?)?;
    m.add_function(wrap_pyfunction!(ledger::ledger_forget, m)?)?;
    m.add_function(wrap_pyfunction!(torch::torch_counters, m)?)?;
    m.add_function(wrap_pyfunction!(cupy::cupy_c_functions, m)?)?;
    m.add_function(wrap_pyfunction!(cupy::cupy_usage, m)?)?;
    m.add_function(wrap_pyfunction!(cupy::cupy_allocation, m)?)?;
    m.add_function(wrap_pyfunction!(torch::torch_reset_peaks, m)?)?;
    m.add_class::<streams::ExternalStream>()?;
    m.add_class::<snapshot::Snapshot>()?;
    m.add_class::<snapshot::TagBlock>()?;
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
