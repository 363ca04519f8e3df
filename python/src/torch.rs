//! PyTorch's pluggable allocator: the C functions this library exports, and the statistics
//! `emm.torch` reads.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::{Mutex, MutexGuard};

use crate::runtime::{AddressMap, drop_memory, lock, with_device_context};
use crate::streams::StreamArg;
use emm::MemoryPointer;
use emm::contract::StreamOrdering;
use emm::driver_sys::StreamHandle;
use pyo3::prelude::*;
use pyo3::types::PyDict;

// PyTorch's pluggable allocator: C functions this library exports, over the process runtime.

/// What PyTorch holds from emm: its allocations by address (kept alive until PyTorch frees
/// them) and, per device, the counts `emm.torch.memory_stats()` reports.
#[derive(Default)]
pub(crate) struct TorchState {
    pub(crate) live: AddressMap<MemoryPointer>,
    pub(crate) devices: BTreeMap<u32, TorchCounters>,
}

/// PyTorch's allocations on one device: bytes and counts now, at their peak (since the last
/// `reset_peak_memory_stats`), allocated and freed in all, and failures for lack of memory.
#[derive(Clone, Copy, Default)]
pub(crate) struct TorchCounters {
    pub(crate) current_bytes: u64,
    pub(crate) peak_bytes: u64,
    pub(crate) allocated_bytes: u64,
    pub(crate) freed_bytes: u64,
    pub(crate) current_count: u64,
    pub(crate) peak_count: u64,
    pub(crate) allocated_count: u64,
    pub(crate) freed_count: u64,
    pub(crate) ooms: u64,
}

pub(crate) static TORCH: Mutex<Option<TorchState>> = Mutex::new(None);
/// What went wrong in the last call PyTorch made, for `emm.torch.last_error()`.
pub(crate) static TORCH_ERROR: Mutex<Option<String>> = Mutex::new(None);

pub(crate) fn torch_state() -> MutexGuard<'static, Option<TorchState>> {
    lock(&TORCH)
}

pub(crate) fn torch_error(message: String) {
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
pub(crate) fn torch_allocate(
    size: isize,
    device: i32,
    stream: *mut c_void,
) -> Result<*mut c_void, String> {
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
            let _tag = crate::snapshot::framework_scope(crate::snapshot::torch_tag());
            if ctx.stream_ordering() == StreamOrdering::Unsupported {
                ctx.memalloc(size)
            } else {
                // SAFETY: PyTorch's stream of this device (its streams live as long as the
                // process; 0 is the legacy default stream), the one it will use the memory on
                // and pass back to `free`.
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

/// The allocation emm handed PyTorch at `addr`, still live (a pointer to it, which the caller
/// gives to [`drop_memory`]); `None` for memory emm did not allocate for PyTorch.
fn live_torch_allocation(addr: u64) -> Option<MemoryPointer> {
    torch_state()
        .as_ref()
        .and_then(|s| s.live.get(&addr).cloned())
}

/// PyTorch's record-stream hook of its pluggable allocator (`set_record_stream_fn`, which
/// `emm.torch.install()` sets): `recordStream`, from `Tensor.record_stream` or from PyTorch's
/// C++, tells the allocator that the allocation at `ptr` is used by work queued on `stream`
/// too, so that its free is not reused before that work is done. A pointer emm did not hand
/// PyTorch is not emm's to order (nothing is recorded); a failure is recorded for
/// `emm.torch.last_error()` and printed, as a free's is (the hook cannot raise).
#[unsafe(no_mangle)]
pub extern "C" fn emm_torch_record_stream(ptr: *mut c_void, stream: *mut c_void) {
    if ptr.is_null() {
        return;
    }
    let addr = ptr as usize as u64;
    let Some(mem) = live_torch_allocation(addr) else {
        return;
    };
    let raw = stream as usize as u64;
    let recorded = with_device_context(mem.device().0, |ctx| {
        // SAFETY: a stream PyTorch hands its allocator as a user of this memory, alive until
        // that work is done, as PyTorch's own caching allocator requires of it (it records an
        // event there at the free too); PyTorch's own streams live as long as the process.
        let stream = unsafe { ctx.external_stream(StreamHandle::from_raw(raw)) };
        mem.record_stream(&stream)
    });
    let failure = match recorded {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(e.to_string()),
        Err(e) => Some(e.to_string()),
    };
    if let Some(e) = failure {
        torch_error(format!(
            "record_stream of 0x{addr:x} on stream 0x{raw:x} was not recorded: {e}; synchronise \
             that stream before the tensor is freed"
        ));
    }
    drop_memory(mem);
}

/// PyTorch's `Tensor.record_stream` under `emm.torch.install()`, where PyTorch's pluggable
/// allocator has no record-stream hook to set (`install()` routes the method here): the allocation PyTorch got at
/// `ptr` is used by work queued on `stream` too, so that its free is not reused before that
/// work is done. Returns false where `ptr` is not an allocation emm made for PyTorch (memory
/// from elsewhere: nothing to record). Memory of a manager that does not allocate on streams
/// is refused: its frees are not stream ordered, so the program must synchronise before the
/// tensor is freed.
#[pyfunction]
pub(crate) fn torch_record_stream(py: Python<'_>, ptr: u64, stream: StreamArg) -> PyResult<bool> {
    let Some(mem) = live_torch_allocation(ptr) else {
        return Ok(false);
    };
    let recorded = with_device_context(mem.device().0, |ctx| {
        let stream = stream.stream(ctx);
        py.detach(|| mem.record_stream(&stream))
    })?;
    recorded.map_err(crate::py_err)?;
    drop_memory(mem);
    Ok(true)
}

/// The message of the last failed PyTorch allocator call, cleared by reading it.
#[pyfunction]
pub(crate) fn torch_last_error() -> Option<String> {
    lock(&TORCH_ERROR).take()
}

/// How many allocations PyTorch holds from emm now.
#[pyfunction]
pub(crate) fn torch_live() -> usize {
    torch_state().as_ref().map_or(0, |s| s.live.len())
}

/// PyTorch's allocations from emm on `device`: `current_bytes`, `peak_bytes`,
/// `allocated_bytes`, `freed_bytes`, the same four `_count`s, and `ooms`.
#[pyfunction]
pub(crate) fn torch_counters(py: Python<'_>, device: u32) -> PyResult<Bound<'_, PyDict>> {
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
pub(crate) fn torch_reset_peaks(device: u32) {
    if let Some(c) = torch_state()
        .as_mut()
        .and_then(|s| s.devices.get_mut(&device))
    {
        c.peak_bytes = c.current_bytes;
        c.peak_count = c.current_count;
    }
}
