//! The host memory a Python object exports through the buffer protocol, as an address range:
//! what `mempin` checks a caller's pointer and size against.

use pyo3::ffi;
use pyo3::prelude::*;

/// What `obj` exports through the buffer protocol: `[start, end)`, the bytes every element of
/// a strided view lies within (an empty buffer gives an empty range), and whether the buffer is
/// read-only.
pub(crate) struct Exported {
    pub(crate) start: usize,
    pub(crate) end: usize,
    pub(crate) read_only: bool,
}

/// What `obj` exports ([`Exported`]), or `None` when it exports no buffer.
pub(crate) fn exported(obj: &Bound<'_, PyAny>) -> PyResult<Option<Exported>> {
    let mut view = std::mem::MaybeUninit::<ffi::Py_buffer>::zeroed();
    // SAFETY: `obj` is a live object (the GIL is held through `obj`), and `view` is storage
    // for one `Py_buffer`, which a successful call fills and `PyBuffer_Release` below frees.
    let rc =
        unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), view.as_mut_ptr(), ffi::PyBUF_RECORDS_RO) };
    if rc != 0 {
        // No buffer: nothing to check against. The exception the refusal raised is dropped.
        drop(PyErr::take(obj.py()));
        return Ok(None);
    }
    // SAFETY: filled by the successful call above.
    let mut view = unsafe { view.assume_init() };
    let (start, end) = extent(&view);
    let read_only = view.readonly != 0;
    // SAFETY: `view` came from `PyObject_GetBuffer` and is released once.
    unsafe { ffi::PyBuffer_Release(&mut view) };
    Ok(Some(Exported {
        start,
        end,
        read_only,
    }))
}

/// The address range a filled `Py_buffer` spans.
fn extent(view: &ffi::Py_buffer) -> (usize, usize) {
    let start = view.buf as usize;
    let ndim = usize::try_from(view.ndim).unwrap_or(0);
    if ndim == 0 || view.shape.is_null() || view.strides.is_null() {
        // Contiguous or a scalar: `len` bytes.
        return (
            start,
            start.saturating_add(usize::try_from(view.len).unwrap_or(0)),
        );
    }
    // SAFETY: with PyBUF_STRIDES requested, `shape` and `strides` point to `ndim` entries each,
    // alive until the buffer is released (after this returns).
    let (shape, strides) = unsafe {
        (
            std::slice::from_raw_parts(view.shape, ndim),
            std::slice::from_raw_parts(view.strides, ndim),
        )
    };
    if shape.contains(&0) {
        return (start, start);
    }
    let (mut low, mut high) = (start as i128, start as i128 + view.itemsize as i128);
    for (&n, &s) in shape.iter().zip(strides) {
        let reach = (n as i128 - 1) * s as i128;
        if reach < 0 {
            low += reach;
        } else {
            high += reach;
        }
    }
    (low.max(0) as usize, high.min(usize::MAX as i128) as usize)
}
