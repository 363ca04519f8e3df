//! CuPy's allocator in C: two functions for `cupy.cuda.memory.CFunctionAllocator`, so that no
//! Python runs when CuPy allocates or frees (the Python allocator of `emm.cupy` built two
//! CuPy objects per call). CuPy calls them with the GIL held. They allocate on CuPy's current
//! stream, read through the C function CuPy exports for it (`get_current_stream_ptr` in
//! `cupy.cuda.stream`'s C API), and keep each allocation alive by address until CuPy frees it.

use std::cell::RefCell;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};

use emm::MemoryPointer;
use emm::contract::StreamOrdering;
use emm::driver_sys::StreamHandle;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyCapsuleMethods, PyDict};

use crate::py_err;
use crate::runtime::{AddressMap, drop_memory, with_device_context};

/// The C signature of CuPy's `get_current_stream_ptr`, as its capsule names it.
const STREAM_GETTER_SIGNATURE: &std::ffi::CStr = c"intptr_t (void)";

/// CuPy's current stream of the calling thread, as a `CUstream`.
type StreamGetter = unsafe extern "C" fn() -> isize;

/// What CuPy holds from emm: its allocations by address and, per device, their bytes.
struct CupyState {
    live: AddressMap<MemoryPointer>,
    /// Bytes live on each device, by ordinal (grown to the highest device seen).
    used: Vec<u64>,
}

impl CupyState {
    /// The bytes live on `device`, counted from here on.
    fn used_on(&mut self, device: u32) -> &mut u64 {
        let k = device as usize;
        if self.used.len() <= k {
            self.used.resize(k + 1, 0);
        }
        &mut self.used[k]
    }
}

/// State that only a thread holding the GIL touches, with the GIL as its lock: CuPy calls
/// its allocator's functions with the GIL held, as Python calls the functions that read the
/// state, so a lock of its own would only add atomic read-modify-writes to every call on
/// CuPy's allocation path (where CuPy's own pool has none). The package is built for
/// CPython's stable ABI, which free-threaded CPython does not load, so there is always a GIL
/// to hold.
struct GilGuarded<T>(RefCell<T>);

// SAFETY: the value is reached only through `with`, whose `Python` token shows that the
// calling thread holds the GIL; so one thread at a time reaches it, and the `RefCell`
// refuses a borrow reentered on that thread.
unsafe impl<T: Send> Sync for GilGuarded<T> {}

impl<T> GilGuarded<T> {
    /// `f` on the value, by the thread that holds the GIL (`_py`).
    fn with<R>(&self, _py: Python<'_>, f: impl FnOnce(&mut T) -> R) -> R {
        f(&mut self.0.borrow_mut())
    }
}

static CUPY: GilGuarded<CupyState> = GilGuarded(RefCell::new(CupyState {
    live: AddressMap::with_hasher(std::hash::BuildHasherDefault::new()),
    used: Vec::new(),
}));

/// CuPy's current-stream function ([`StreamGetter`]) as an address, 0 until
/// [`cupy_c_functions`] takes it.
static STREAM_GETTER: AtomicUsize = AtomicUsize::new(0);

/// The addresses of [`emm_cupy_malloc`] and [`emm_cupy_free`] for CuPy's
/// `CFunctionAllocator`, after taking CuPy's current-stream function from `stream_api` (the
/// capsule `cupy.cuda.stream.__pyx_capi__["get_current_stream_ptr"]`). A capsule of another
/// signature is refused: the functions would call it wrongly.
#[pyfunction]
pub(crate) fn cupy_c_functions(stream_api: &Bound<'_, PyCapsule>) -> PyResult<(usize, usize)> {
    let Ok(ptr) = stream_api.pointer_checked(Some(STREAM_GETTER_SIGNATURE)) else {
        // SAFETY: the name is read at once, while no Python code runs.
        let name = stream_api
            .name()?
            .map(|n| unsafe { n.as_cstr() }.to_string_lossy().into_owned());
        return Err(PyRuntimeError::new_err(format!(
            "CuPy's get_current_stream_ptr capsule is named {name:?}, not {STREAM_GETTER_SIGNATURE:?} \
             (or holds no function): this CuPy is one emm.cupy's C allocator does not know; use \
             emm.cupy.install(c_functions=False), the Python allocator"
        )));
    };
    // SAFETY: the capsule is CuPy's C API entry for `get_current_stream_ptr`, whose signature
    // its name states and was checked above; CuPy's module stays loaded for the process.
    let getter = unsafe { std::mem::transmute::<*mut c_void, StreamGetter>(ptr.as_ptr()) };
    STREAM_GETTER.store(getter as usize, Ordering::Release);
    Ok((
        emm_cupy_malloc as *const () as usize,
        emm_cupy_free as *const () as usize,
    ))
}

/// CuPy's `malloc` (`void *(void *param, size_t size, int device_id)`): `size` bytes on
/// `device`, on CuPy's current stream where the manager allocates on streams. A failure sets
/// emm's Python exception and returns the address -1, which CuPy's Cython code checks for an
/// exception (a null pointer it would take for memory).
#[unsafe(no_mangle)]
pub extern "C" fn emm_cupy_malloc(_param: *mut c_void, size: usize, device: c_int) -> *mut c_void {
    // SAFETY: CuPy calls this function with the GIL held.
    let py = unsafe { Python::assume_attached() };
    let made = (|| -> PyResult<MemoryPointer> {
        let device = u32::try_from(device)
            .map_err(|_| PyRuntimeError::new_err(format!("a negative device ({device})")))?;
        let getter = STREAM_GETTER.load(Ordering::Acquire);
        let stream = if getter == 0 {
            0
        } else {
            // SAFETY: the address of CuPy's own function of no arguments, stored by
            // `cupy_c_functions` after checking its signature; called with the GIL held, as
            // CuPy calls this function.
            unsafe { std::mem::transmute::<usize, StreamGetter>(getter)() }
        };
        with_device_context(device, |ctx| {
            crate::snapshot::with_python_stack(py, ctx, || {
                let _tag = crate::snapshot::framework_scope(crate::snapshot::cupy_tag());
                if ctx.stream_ordering() == StreamOrdering::Unsupported {
                    return ctx.memalloc(size);
                }
                // SAFETY: CuPy's current stream of this device; emm.cupy's rule (docs/python.md's)
                // is that a CuPy stream outlives the memory allocated on it.
                unsafe { ctx.memalloc_on_raw(size, StreamHandle::from_raw(stream as u64)) }
            })
        })?
        .map_err(py_err)
    })();
    match made {
        Ok(mem) => {
            let ptr = mem.device_ptr().0;
            let displaced = CUPY.with(py, |state| {
                *state.used_on(mem.device().0) += mem.size() as u64;
                state.live.insert(ptr, mem)
            });
            // An address the manager handed out twice while live; dropped outside the state.
            drop(displaced);
            ptr as usize as *mut c_void
        }
        Err(e) => {
            e.restore(py);
            usize::MAX as *mut c_void
        }
    }
}

/// CuPy's `free` (`void (void *param, void *ptr, int device_id)`): gives back memory
/// [`emm_cupy_malloc`] returned. A pointer emm did not hand out frees nothing and is
/// reported on standard error (CuPy's free cannot raise).
#[unsafe(no_mangle)]
pub extern "C" fn emm_cupy_free(_param: *mut c_void, ptr: *mut c_void, device: c_int) {
    let addr = ptr as usize as u64;
    // SAFETY: CuPy calls this function with the GIL held.
    let py = unsafe { Python::assume_attached() };
    let mem = CUPY.with(py, |state| {
        let mem = state.live.remove(&addr);
        if let Some(mem) = &mem {
            *state.used_on(mem.device().0) -= mem.size() as u64;
        }
        mem
    });
    match mem {
        Some(mem) => drop_memory(mem),
        None => {
            tracing::error!(
                addr,
                device,
                "emm.cupy: free of memory emm did not allocate"
            );
            eprintln!(
                "emm.cupy: free of 0x{addr:x} (device {device}), which emm did not allocate for CuPy (or freed already); nothing was freed"
            );
        }
    }
}

/// CuPy's live allocations from emm through the C functions: on `device`, a dict of
/// `used_bytes` and `count` (all devices' count).
#[pyfunction]
pub(crate) fn cupy_usage(py: Python<'_>, device: u32) -> PyResult<Bound<'_, PyDict>> {
    let (used, count) = CUPY.with(py, |state| {
        let used = state.used.get(device as usize).copied().unwrap_or(0);
        (used, state.live.len())
    });
    let d = PyDict::new(py);
    d.set_item("used_bytes", used)?;
    d.set_item("count", count)?;
    Ok(d)
}

/// The allocation CuPy holds at `ptr` through the C functions: `(size, stream)`, the stream
/// as a `CUstream` (`None` for memory not allocated on a stream); `None` for an address emm
/// did not hand CuPy.
#[pyfunction]
pub(crate) fn cupy_allocation(py: Python<'_>, ptr: u64) -> Option<(usize, Option<u64>)> {
    CUPY.with(py, |state| {
        let mem = state.live.get(&ptr)?;
        Some((mem.size(), mem.stream().map(|s| s.raw())))
    })
}
