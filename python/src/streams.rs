//! Streams as Python callers name them. The driver dereferences a stream handle unchecked (a
//! made-up one crashes the process), so a bare integer is taken only for the implicit streams;
//! any other stream comes as an object that vouches for itself (a stream of CuPy, PyTorch,
//! cuda.core or Numba, anything with `__cuda_stream__`), which the memory then holds so that
//! the stream outlives it, or as an `emm.ExternalStream`, where the caller vouches for a raw
//! handle.
//!
//! Vouching is the stream protocol's contract (as CuPy's and Numba's): emm cannot ask the driver
//! about a handle without the driver dereferencing it. What it can check it does: a handle
//! other than 0, 1 and 2 is the address of the driver's stream object, so one that is not
//! 8-byte aligned, or lies outside user space, is refused with a `ValueError` before any call
//! ([`check_shape`]). An aligned made-up handle still reaches the driver: the object's maker
//! answers for it.

use std::sync::Arc;

use emm::driver_sys::StreamHandle;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

/// A raw `CUstream` handle the caller vouches for: a live stream of the device's context that
/// outlives every buffer allocated or freed on it, or that `owner` (held by those buffers)
/// keeps alive. emm cannot check a raw handle: a wrong one crashes the process. Prefer passing
/// the stream object itself (CuPy's, PyTorch's, cuda.core's), which emm keeps alive.
#[pyclass(module = "emm._emm", frozen)]
pub(crate) struct ExternalStream {
    handle: u64,
    owner: Option<Py<PyAny>>,
}

#[pymethods]
impl ExternalStream {
    #[new]
    #[pyo3(signature = (handle, owner=None))]
    fn new(handle: u64, owner: Option<Py<PyAny>>) -> PyResult<ExternalStream> {
        if handle <= 2 {
            return Err(PyValueError::new_err(format!(
                "ExternalStream({handle}): 0, 1 and 2 are the implicit default streams; pass \
                 the integer itself where a stream is asked for"
            )));
        }
        check_shape(handle, || format!("ExternalStream({handle:#x})"))?;
        Ok(ExternalStream { handle, owner })
    }

    /// The `CUstream` handle, as an integer.
    #[getter]
    fn handle(&self) -> u64 {
        self.handle
    }

    /// The CUDA stream protocol: `(0, handle)`.
    fn __cuda_stream__(&self) -> (u32, u64) {
        (0, self.handle)
    }

    fn __repr__(&self) -> String {
        format!("emm.ExternalStream({:#x})", self.handle)
    }
}

/// A stream argument, resolved: its handle and what keeps it alive.
pub(crate) enum StreamArg {
    /// A stream nothing needs to hold: 0 (the legacy default stream as the null handle), 1
    /// (`CU_STREAM_LEGACY`) or 2 (`CU_STREAM_PER_THREAD`), never destroyed; or an
    /// `ExternalStream` with no owner, alive while the memory is, its maker said.
    Unheld(StreamHandle),
    /// A stream named by an object: another library's stream, or an `ExternalStream` with
    /// its owner. The object is held while memory ordered on the stream needs it.
    Held(StreamHandle, Py<PyAny>),
}

/// What every refusal says a caller may pass.
const WHAT_TO_PASS: &str = "pass the stream object (a CuPy, PyTorch, cuda.core or Numba \
     stream, or anything with __cuda_stream__), 0, 1 or 2 for the implicit default streams, \
     or emm.ExternalStream(handle) for a raw handle you vouch for";

/// The most a user-space address can be on the 64-bit platforms CUDA runs on (47 bits).
const USER_SPACE_END: u64 = 1 << 47;

/// Refuses `raw`, a handle other than the implicit streams' that `what` names, where it cannot
/// be the address of the driver's stream object: not 8-byte aligned (the driver allocates
/// them), or outside user space. The driver would dereference it and crash the process.
fn check_shape(raw: u64, what: impl FnOnce() -> String) -> PyResult<()> {
    if raw.is_multiple_of(8) && raw < USER_SPACE_END {
        return Ok(());
    }
    Err(PyValueError::new_err(format!(
        "{} names stream handle {raw:#x}, which no CUDA stream has (a handle is the address \
         of the driver's stream object: 8-byte aligned, in user space); the driver would crash \
         on it: check where the handle came from, or {WHAT_TO_PASS}",
        what()
    )))
}

/// The handle of an implicit stream, if `raw` is one.
fn implicit(raw: u64) -> Option<StreamHandle> {
    [
        StreamHandle::NULL,
        StreamHandle::LEGACY,
        StreamHandle::PER_THREAD,
    ]
    .into_iter()
    .find(|h| h.raw() == raw)
}

/// The handle `obj` names as a stream object, if it is one: the CUDA stream protocol first,
/// then PyTorch's `cuda_stream` and CuPy's `ptr` on those libraries' own stream types.
fn handle_of_object(obj: &Bound<'_, PyAny>) -> PyResult<Option<u64>> {
    if obj.hasattr("__cuda_stream__")? {
        let answer = obj.call_method0("__cuda_stream__")?;
        let (version, handle): (i64, u64) = answer.extract().map_err(|_| {
            PyTypeError::new_err(format!(
                "{}.__cuda_stream__() returned {}, not (version, handle) integers",
                type_name(obj),
                answer.repr().map_or_else(|_| "?".into(), |r| r.to_string())
            ))
        })?;
        if version != 0 {
            return Err(PyValueError::new_err(format!(
                "{}.__cuda_stream__() speaks version {version} of the CUDA stream protocol; \
                 emm reads version 0",
                type_name(obj)
            )));
        }
        return Ok(Some(handle));
    }
    let module = obj
        .get_type()
        .module()
        .map(|m| m.to_string())
        .unwrap_or_default();
    let attribute = match module.split('.').next() {
        Some("torch") => "cuda_stream",
        Some("cupy" | "cupy_backends") => "ptr",
        _ => return Ok(None),
    };
    match obj.getattr(attribute) {
        Ok(v) => Ok(Some(v.extract()?)),
        Err(_) => Ok(None),
    }
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map_or_else(|_| "?".into(), |n| n.to_string())
}

impl<'a, 'py> FromPyObject<'a, 'py> for StreamArg {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<StreamArg> {
        if obj.is_none() {
            return Ok(StreamArg::Unheld(StreamHandle::NULL));
        }
        if let Ok(external) = obj.cast::<ExternalStream>() {
            let e = external.get();
            // SAFETY: `ExternalStream`'s maker vouched for the handle (its documented
            // contract): a live stream of this context while the memory, or `owner`, lives.
            let handle = unsafe { StreamHandle::from_raw(e.handle) };
            return Ok(match &e.owner {
                Some(owner) => StreamArg::Held(handle, owner.clone_ref(obj.py())),
                None => StreamArg::Unheld(handle),
            });
        }
        if let Ok(raw) = obj.extract::<u64>() {
            return implicit(raw).map(StreamArg::Unheld).ok_or_else(|| {
                PyValueError::new_err(format!(
                    "stream {raw:#x} is a raw handle emm cannot check, and the driver would \
                     crash on a wrong one: {WHAT_TO_PASS}"
                ))
            });
        }
        if obj.is_instance_of::<pyo3::types::PyInt>() {
            return Err(PyValueError::new_err(format!(
                "stream {} is no handle (negative or past 64 bits): {WHAT_TO_PASS}",
                obj.repr()?
            )));
        }
        match handle_of_object(&obj)? {
            Some(raw) => {
                if implicit(raw).is_none() {
                    check_shape(raw, || format!("a {}", type_name(&obj)))?;
                }
                // SAFETY: the stream object's library made the handle and keeps the stream
                // alive while the object lives (CuPy and cuda.core destroy a stream when its
                // object goes; PyTorch never destroys its streams); the memory holds the
                // object for as long as it is ordered on the stream.
                let handle = implicit(raw).unwrap_or(unsafe { StreamHandle::from_raw(raw) });
                Ok(StreamArg::Held(handle, obj.to_owned().unbind()))
            }
            None => Err(PyTypeError::new_err(format!(
                "a {} is no stream: {WHAT_TO_PASS}",
                type_name(&obj)
            ))),
        }
    }
}

impl StreamArg {
    /// The null stream (the legacy default stream), where a stream argument is left out.
    pub(crate) const NULL: StreamArg = StreamArg::Unheld(StreamHandle::NULL);

    /// The stream as `ctx` orders memory on it, holding what keeps it alive.
    pub(crate) fn stream(self, ctx: &emm::Context) -> emm::Stream {
        match self {
            // SAFETY: the implicit streams are never destroyed, and a vouched handle is alive
            // while the memory is (`ExternalStream`'s contract).
            StreamArg::Unheld(h) => unsafe { ctx.external_stream(h) },
            // SAFETY: `owner` keeps the stream alive (see `extract`), and the stream and every
            // memory ordered on it hold `owner`.
            StreamArg::Held(h, owner) => unsafe {
                ctx.external_stream_owned(h, Arc::new(owner) as emm::plugin::HostOwner)
            },
        }
    }
}
