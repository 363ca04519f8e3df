//! `emm.Array`: an n-d device array over emm memory that speaks DLPack both ways, through
//! `emm_array`'s untyped DLPack export and import (so PyTorch, CuPy, JAX and NumPy-style
//! consumers take emm's memory without a copy, and emm takes theirs).
//!
//! - `Context.device_array(shape, dtype, order="C")` allocates one from the context's
//!   manager; `Context.from_dlpack(obj)` imports any object with `__dlpack__` (the producer's
//!   deleter runs exactly once, when the last emm view of it is gone).
//! - `Array.__dlpack__` / `__dlpack_device__` export it: a versioned capsule when the consumer
//!   asks for DLPack 1.x, the legacy one otherwise; the capsule holds the memory until the
//!   consumer's deleter runs (or the unconsumed capsule is collected).

use std::ffi::{CStr, c_void};
use std::ptr::NonNull;

use dlpark::ffi::{
    DLDataType, DLDataTypeCode, DLDevice, DLManagedTensor, DLManagedTensorVersioned,
};
use dlpark::{Managed, ManagedTensorBase};
use emm::MemoryPointer;
use emm_array::dlpack::{export_memory, import_memory};
use emm_array::{Layout, Order};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyCapsule, PyTuple};

use crate::{PyEmmError, py_err};

const LEGACY: &CStr = c"dltensor";
const LEGACY_USED: &CStr = c"used_dltensor";
const VERSIONED: &CStr = c"dltensor_versioned";
const VERSIONED_USED: &CStr = c"used_dltensor_versioned";

/// An n-d array of device memory that speaks DLPack: `shape`, `strides` (bytes), `dtype` (a
/// NumPy-style name), `ptr`; `read()` and `write()` copy its bytes (a contiguous array only).
#[pyclass(module = "emm._emm", frozen)]
pub(crate) struct Array {
    mem: Option<MemoryPointer>,
    layout: Layout,
    dt: DLDataType,
    ctx: emm::Context,
}

/// The DLPack type of a dtype given as NumPy takes one: a name (`"float64"`, `"float"`), a
/// type string (`"f8"`, `"<f8"`, `"=f8"`, `"|u1"`), a one-letter code (`"d"`), a NumPy dtype
/// (`np.dtype("f8")`, read through its `str` and `name`) or a scalar type (`np.float64`,
/// Python's `float`, read through its `__name__`). Big-endian types are refused: device
/// memory holds the host's (little-endian) order.
pub(crate) fn dtype_from(obj: &Bound<'_, PyAny>) -> PyResult<DLDataType> {
    if let Ok(s) = obj.extract::<&str>() {
        return dtype_of(s);
    }
    // A NumPy dtype: its type string names the kind, size and order; a type NumPy has no
    // code for (ml_dtypes' bfloat16, "<V2") by its name.
    if let (Ok(typestr), Ok(name)) = (obj.getattr("str"), obj.getattr("name"))
        && let (Ok(typestr), Ok(name)) = (typestr.extract::<String>(), name.extract::<String>())
    {
        // A byte order other than the host's is refused, whatever the name says.
        if typestr.starts_with('>') {
            return dtype_of(&typestr);
        }
        return dtype_of(&typestr).or_else(|e| dtype_of(&name).map_err(|_| e));
    }
    if let Ok(name) = obj.getattr("__name__")
        && let Ok(name) = name.extract::<String>()
    {
        // NumPy's scalar types end in an underscore where the name is Python's (`bool_`).
        return dtype_of(name.trim_end_matches('_'));
    }
    Err(PyValueError::new_err(format!(
        "dtype {obj}: give a NumPy dtype, a scalar type such as numpy.float32, or a name such as \
         \"float32\" or \"f4\""
    )))
}

/// The DLPack type of a dtype string (see [`dtype_from`]).
fn dtype_of(name: &str) -> PyResult<DLDataType> {
    let unknown = || {
        PyValueError::new_err(format!(
            "unknown dtype {name:?}: use a NumPy name such as \"float32\", \"int64\", \
             \"uint8\", \"bfloat16\" or \"complex64\", or a type string such as \"f4\" or \"<i8\""
        ))
    };
    let (code, bits) = match name {
        "bool" | "?" => (DLDataTypeCode::BOOL, 8),
        "int8" | "b" => (DLDataTypeCode::INT, 8),
        "int16" | "h" => (DLDataTypeCode::INT, 16),
        "int32" | "i" => (DLDataTypeCode::INT, 32),
        "int64" | "int" | "l" | "q" => (DLDataTypeCode::INT, 64),
        "uint8" | "B" => (DLDataTypeCode::UINT, 8),
        "uint16" | "H" => (DLDataTypeCode::UINT, 16),
        "uint32" | "I" => (DLDataTypeCode::UINT, 32),
        "uint64" | "L" | "Q" => (DLDataTypeCode::UINT, 64),
        "float16" | "half" | "e" => (DLDataTypeCode::FLOAT, 16),
        "float32" | "single" | "f" => (DLDataTypeCode::FLOAT, 32),
        "float64" | "float" | "double" | "d" => (DLDataTypeCode::FLOAT, 64),
        "bfloat16" => (DLDataTypeCode::BFLOAT, 16),
        "complex64" | "F" => (DLDataTypeCode::COMPLEX, 64),
        "complex128" | "complex" | "D" => (DLDataTypeCode::COMPLEX, 128),
        other => {
            // A type string: an optional byte order, the kind, the size in bytes.
            let rest = match other.as_bytes().first() {
                Some(b'>') => {
                    return Err(PyValueError::new_err(format!(
                        "dtype {other:?} is big-endian: device memory holds little-endian \
                         values; use \"<{}\"",
                        &other[1..]
                    )));
                }
                Some(b'<' | b'=' | b'|') => &other[1..],
                _ => other,
            };
            let (kind, size) = rest.split_at_checked(1).ok_or_else(unknown)?;
            let bytes: u8 = size.parse().map_err(|_| unknown())?;
            let code = match kind {
                "b" if bytes == 1 => DLDataTypeCode::BOOL,
                "i" => DLDataTypeCode::INT,
                "u" => DLDataTypeCode::UINT,
                "f" => DLDataTypeCode::FLOAT,
                "c" => DLDataTypeCode::COMPLEX,
                _ => return Err(unknown()),
            };
            let known = match code {
                DLDataTypeCode::BOOL => bytes == 1,
                DLDataTypeCode::FLOAT => matches!(bytes, 2 | 4 | 8),
                DLDataTypeCode::COMPLEX => matches!(bytes, 8 | 16),
                _ => matches!(bytes, 1 | 2 | 4 | 8),
            };
            if !known {
                return Err(unknown());
            }
            (code, bytes * 8)
        }
    };
    Ok(DLDataType {
        code,
        bits,
        lanes: 1,
    })
}

/// The NumPy-style name of a DLPack type (`"dlpack(code=.., bits=.., lanes=..)"` for one
/// without a name).
fn dtype_name(d: DLDataType) -> String {
    let base = match d.code {
        DLDataTypeCode::BOOL => "bool",
        DLDataTypeCode::INT => "int",
        DLDataTypeCode::UINT => "uint",
        DLDataTypeCode::FLOAT => "float",
        DLDataTypeCode::BFLOAT => "bfloat",
        DLDataTypeCode::COMPLEX => "complex",
        _ => "",
    };
    match (base, d.lanes) {
        ("bool", 1) => "bool".to_owned(),
        ("", _) | (_, 2..) => format!(
            "dlpack(code={}, bits={}, lanes={})",
            d.code.0, d.bits, d.lanes
        ),
        (b, _) => format!("{b}{}", d.bits),
    }
}

impl Array {
    pub(crate) fn allocate(
        ctx: &emm::Context,
        py: Python<'_>,
        shape: Vec<usize>,
        dtype: &Bound<'_, PyAny>,
        order: &str,
    ) -> PyResult<Array> {
        let dt = dtype_from(dtype)?;
        let order = match order {
            "C" => Order::C,
            "F" => Order::F,
            other => {
                return Err(PyValueError::new_err(format!(
                    "order {other:?}: use \"C\" (row-major) or \"F\" (column-major)"
                )));
            }
        };
        let layout = Layout::contiguous(&shape, order, dt.element_size())
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let mem = match layout.nbytes() {
            0 => None,
            n => Some(py.detach(|| ctx.memalloc(n)).map_err(py_err)?),
        };
        Ok(Array {
            mem,
            layout,
            dt,
            ctx: ctx.clone(),
        })
    }

    /// Imports `obj` (anything with `__dlpack__`) as memory of `ctx`.
    pub(crate) fn import(ctx: &emm::Context, obj: &Bound<'_, PyAny>) -> PyResult<Array> {
        let py = obj.py();
        if !obj.hasattr("__dlpack__")? {
            return Err(PyTypeError::new_err(format!(
                "from_dlpack takes an array that exports DLPack (has __dlpack__: a torch \
                 tensor, a CuPy or NumPy array...), not a {}",
                obj.get_type().name()?
            )));
        }
        // Stream 1: the producer orders its work before the legacy default stream, which emm's
        // synchronous copies use. DLPack 1.x when the producer knows it.
        let kwargs = [("stream", 1i64.into_pyobject(py)?.into_any())];
        let versioned = [
            kwargs[0].clone(),
            ("max_version", PyTuple::new(py, [1u32, 0])?.into_any()),
        ];
        let capsule = match obj.call_method("__dlpack__", (), Some(&into_dict(py, &versioned)?)) {
            Ok(c) => c,
            Err(e) if e.is_instance_of::<PyTypeError>(py) => {
                obj.call_method("__dlpack__", (), Some(&into_dict(py, &kwargs)?))?
            }
            Err(e) => return Err(e),
        };
        let capsule = capsule.cast_into::<PyCapsule>().map_err(|_| {
            PyTypeError::new_err("__dlpack__ returned something other than a capsule")
        })?;
        let is = |name: &CStr| {
            // SAFETY: `capsule` is a live capsule; `name` is a static C string.
            unsafe { pyo3::ffi::PyCapsule_IsValid(capsule.as_ptr(), name.as_ptr()) == 1 }
        };
        let (mem, layout, dt) = if is(VERSIONED) {
            let t = take::<DLManagedTensorVersioned>(&capsule, VERSIONED, VERSIONED_USED)?;
            import_memory(ctx, t)
        } else if is(LEGACY) {
            let t = take::<DLManagedTensor>(&capsule, LEGACY, LEGACY_USED)?;
            import_memory(ctx, t)
        } else {
            return Err(PyValueError::new_err(
                "the capsule is not an unconsumed \"dltensor\" or \"dltensor_versioned\" one \
                 (a DLPack capsule can be used once; call __dlpack__ again for another)",
            ));
        }
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(Array {
            mem,
            layout,
            dt,
            ctx: ctx.clone(),
        })
    }
}

fn into_dict<'py>(
    py: Python<'py>,
    items: &[(&str, Bound<'py, PyAny>)],
) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
    let d = pyo3::types::PyDict::new(py);
    for (k, v) in items {
        d.set_item(k, v)?;
    }
    Ok(d)
}

/// Takes the managed tensor out of an unconsumed capsule and marks the capsule used, so that
/// the producer's deleter is now ours to run (once, when the tensor drops).
fn take<M: ManagedTensorBase>(
    capsule: &Bound<'_, PyCapsule>,
    name: &CStr,
    used: &'static CStr,
) -> PyResult<Managed<M>> {
    // SAFETY: `capsule` is a live capsule whose name is `name` (checked by the caller).
    let raw = unsafe { pyo3::ffi::PyCapsule_GetPointer(capsule.as_ptr(), name.as_ptr()) } as *mut M;
    // SAFETY: a capsule named "dltensor" / "dltensor_versioned" holds a pointer to a managed
    // tensor of that ABI, which the consumer owns once it renames the capsule (the DLPack
    // Python protocol); the rename below comes right after, with no Python code between.
    let t = unsafe { Managed::from_raw(raw) }
        .map_err(|e| PyValueError::new_err(format!("the capsule holds no tensor: {e}")))?;
    // SAFETY: `capsule` is a live capsule object; `used` is a static C string, as
    // `PyCapsule_SetName` requires (it keeps the pointer).
    if unsafe { pyo3::ffi::PyCapsule_SetName(capsule.as_ptr(), used.as_ptr()) } != 0 {
        // Leave the tensor to the capsule's destructor rather than deleting it twice.
        std::mem::forget(t);
        return Err(PyErr::fetch(capsule.py()));
    }
    Ok(t)
}

/// The destructor of a capsule we made: runs the tensor's deleter unless a consumer took the
/// tensor (and renamed the capsule).
unsafe extern "C" fn drop_unconsumed<M: ManagedTensorBase + 'static>(
    capsule: *mut pyo3::ffi::PyObject,
) {
    let name = if std::any::TypeId::of::<M>() == std::any::TypeId::of::<DLManagedTensor>() {
        LEGACY
    } else {
        VERSIONED
    };
    // SAFETY: called by Python with the capsule being destroyed (the GIL held); a name check
    // first, so a renamed (consumed) capsule is left alone and no error is raised.
    unsafe {
        if pyo3::ffi::PyCapsule_IsValid(capsule, name.as_ptr()) == 1 {
            let raw = pyo3::ffi::PyCapsule_GetPointer(capsule, name.as_ptr()) as *mut M;
            if let Ok(t) = Managed::from_raw(raw) {
                drop(t);
            }
        }
    }
}

fn capsule<M: ManagedTensorBase + 'static>(
    py: Python<'_>,
    t: Managed<M>,
    name: &'static CStr,
) -> PyResult<Py<PyAny>> {
    let raw = t.into_raw();
    // SAFETY: `raw` is a managed tensor this capsule now owns; `name` is static; the
    // destructor deletes it unless a consumer renamed the capsule and took it.
    let cap = unsafe {
        pyo3::ffi::PyCapsule_New(
            raw as *mut c_void,
            name.as_ptr(),
            Some(drop_unconsumed::<M>),
        )
    };
    match NonNull::new(cap) {
        // SAFETY: a new reference Python just returned.
        Some(p) => Ok(unsafe { Py::from_owned_ptr(py, p.as_ptr()) }),
        None => {
            // SAFETY: the capsule was not made, so the tensor is still ours to delete.
            drop(unsafe { Managed::from_raw(raw) });
            Err(PyErr::fetch(py))
        }
    }
}

#[pymethods]
impl Array {
    /// The shape.
    #[getter]
    fn shape(&self) -> Vec<usize> {
        self.layout.shape().to_vec()
    }

    /// The strides, in bytes.
    #[getter]
    fn strides(&self) -> Vec<isize> {
        self.layout.strides().to_vec()
    }

    /// The element type's NumPy name.
    #[getter]
    fn dtype(&self) -> String {
        dtype_name(self.dt)
    }

    /// The first element's device address (0 without elements).
    #[getter]
    fn ptr(&self) -> u64 {
        self.mem.as_ref().map_or(0, |m| m.device_ptr().0)
    }

    /// Bytes the elements take.
    #[getter]
    fn nbytes(&self) -> usize {
        self.layout.nbytes()
    }

    /// The device ordinal.
    #[getter]
    fn device(&self) -> u32 {
        self.ctx.device().0
    }

    /// Copies `data` (exactly `nbytes` bytes, in the array's order) in. Contiguous arrays only.
    fn write(&self, py: Python<'_>, data: &[u8]) -> PyResult<()> {
        self.contiguous("write")?;
        if data.len() != self.layout.nbytes() {
            return Err(PyValueError::new_err(format!(
                "{} bytes for an array of {}; give exactly nbytes",
                data.len(),
                self.layout.nbytes()
            )));
        }
        match &self.mem {
            Some(m) => py
                .detach(|| self.ctx.copy_to_device(m, data))
                .map_err(py_err),
            None => Ok(()),
        }
    }

    /// The elements' bytes, in the array's order. Contiguous arrays only.
    fn read<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        self.contiguous("read")?;
        let mut out = vec![0u8; self.layout.nbytes()];
        if let Some(m) = &self.mem {
            py.detach(|| self.ctx.copy_to_host(&mut out, m))
                .map_err(py_err)?;
        }
        Ok(PyBytes::new(py, &out))
    }

    /// `(2, device)`: CUDA device memory of this device.
    fn __dlpack_device__(&self) -> (u32, u32) {
        (2, self.ctx.device().0)
    }

    /// A DLPack capsule of the array (the protocol's producer side): versioned when
    /// `max_version` is 1.x or later, legacy otherwise. emm's copies are synchronous, so the
    /// memory is ready for any `stream`; `dl_device` must be this device and `copy=True` is
    /// refused (emm exports without copying).
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<Py<PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(u32, u32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let _ = stream;
        if let Some(d) = dl_device
            && d != self.__dlpack_device__()
        {
            return Err(pyo3::exceptions::PyBufferError::new_err(format!(
                "dl_device {d:?}: the array is CUDA memory of device {}; emm does not copy between devices here",
                self.ctx.device().0
            )));
        }
        if copy == Some(true) {
            return Err(pyo3::exceptions::PyBufferError::new_err(
                "copy=True: emm exports its memory without copying; copy it on the consumer's side",
            ));
        }
        let device = DLDevice::cuda(self.ctx.device().0 as i32);
        let err = |e: emm_array::ArrayError| PyEmmError::new_err(e.to_string());
        if max_version.is_some_and(|(major, _)| major >= 1) {
            let t = export_memory::<DLManagedTensorVersioned>(
                self.mem.clone(),
                &self.layout,
                self.dt,
                device,
            )
            .map_err(err)?;
            capsule(py, t, VERSIONED)
        } else {
            let t =
                export_memory::<DLManagedTensor>(self.mem.clone(), &self.layout, self.dt, device)
                    .map_err(err)?;
            capsule(py, t, LEGACY)
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "Array(shape={:?}, dtype={}, device={}, ptr=0x{:x})",
            self.layout.shape(),
            dtype_name(self.dt),
            self.ctx.device().0,
            self.ptr()
        )
    }
}

impl Array {
    fn contiguous(&self, what: &str) -> PyResult<()> {
        if self.layout.is_contiguous(Order::C) || self.layout.is_contiguous(Order::F) {
            Ok(())
        } else {
            Err(PyValueError::new_err(format!(
                "{what} needs a contiguous array; this one has strides {:?} for shape {:?}",
                self.layout.strides(),
                self.layout.shape()
            )))
        }
    }
}
