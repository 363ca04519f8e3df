//! [`CudaDriver`]: the real driver, over cudarc's `result` layer, dropping to `sys` where
//! cudarc has no wrapper (context push and pop, `cuDevicePrimaryCtxReset`,
//! `cuMemGetAddressRange`) (feature `cuda`).
//!
//! Unless the program picks cudarc's linking mode itself, cudarc opens libcuda at run time
//! (`fallback-dynamic-loading`), so this compiles and links on machines with no CUDA at all.
//! cudarc panics on the first call when libcuda is missing, so [`CudaDriver::load`] first tries
//! to open the library itself and turns a missing one into an ordinary
//! [`ErrorKind::DriverUnavailable`](crate::ErrorKind) error. The check works in every linking
//! mode (with `dynamic-linking` the library is already loaded, or the program would not run).
//!
//! The [`Driver`] implementation is made from the table of driver calls (`calls.rs`): it hands
//! each call to the method of the same name of `Calls`, written in this module's file for its
//! area (`context`, `memory`, `host`, `streams`, `capture`, `ipc`, `pools`, `vmm`, as the
//! simulator's model is split). Each wraps one driver call (the `_v2` ABI names where CUDA has
//! them) and links the CUDA documentation page it follows. Calls that name a context make it current for their
//! duration with [`CtxScope`], restoring the thread's previous context afterwards, so emm never
//! leaves a context current behind the host runtime's back.
#![allow(unsafe_code)]

mod capture;
mod context;
mod host;
mod ipc;
mod memory;
mod pools;
mod streams;
mod vmm;

use std::ffi::c_void;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::{result, sys};

#[cfg(unix)]
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use crate::{
    CaptureMode, CaptureStatus, ContextHandle, DeviceAttribute, DeviceOrdinal, DevicePtr, Driver,
    DriverError, EventHandle, GraphExecHandle, GraphHandle, HostFn, HostPtr, IpcMemHandle, MemInfo,
    MemLocation, MemPoolHandle, MemPoolUsage, ModuleHandle, PhysHandle, PoolPtrExportData,
    StreamHandle,
};

/// The real CUDA driver. Obtain it with [`CudaDriver::load`].
#[derive(Debug)]
pub struct CudaDriver {
    _loaded: (),
}

fn check(call: &'static str, r: sys::CUresult) -> Result<(), DriverError> {
    match r {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        other => Err(DriverError::from_code(call, other as u32)),
    }
}

/// Maps cudarc's error (whose formatting would call into libcuda) to ours, keeping the code.
fn err(call: &'static str) -> impl Fn(cudarc::driver::DriverError) -> DriverError {
    move |e| DriverError::from_code(call, e.0 as u32)
}

/// `Ok(true)` for success, `Ok(false)` for `CUDA_ERROR_NOT_READY` (work still pending).
fn check_ready(call: &'static str, r: sys::CUresult) -> Result<bool, DriverError> {
    match r {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        other => Err(DriverError::from_code(call, other as u32)),
    }
}

/// Whether the driver knows `ptr` as memory it manages (device, pinned, managed, or a pool's
/// host memory): `cuPointerGetAttribute` answers for such memory and refuses other addresses.
fn driver_knows(ptr: u64) -> bool {
    let mut kind: u32 = 0;
    // SAFETY: the memory-type attribute is a 32-bit `CUmemorytype`, which `kind` holds; the
    // driver only reads `ptr` as an address to look up.
    let r = unsafe {
        sys::cuPointerGetAttribute(
            (&raw mut kind).cast::<c_void>(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            ptr,
        )
    };
    r == sys::CUresult::CUDA_SUCCESS
}

/// The typed copies (`cuMemcpyHtoD`, `DtoH`, `DtoD` and their `Async` forms) refuse memory
/// of a pool in host memory with `CUDA_ERROR_INVALID_VALUE` (measured on an H100, driver
/// 580): they want device memory on the device side. `cuMemcpy` infers each side's kind from
/// the unified address space and takes it. Where a typed copy was refused and every address
/// the caller named as device memory is memory the driver knows, the copy goes again through
/// `copy`; any other error, or an address the driver does not know, is returned as it was.
fn retry_untyped(
    first: Result<(), DriverError>,
    device_side: &[u64],
    copy: impl FnOnce() -> Result<(), DriverError>,
) -> Result<(), DriverError> {
    match first {
        Err(e)
            if e.kind() == crate::ErrorKind::InvalidValue
                && device_side.iter().all(|&p| driver_knows(p)) =>
        {
            copy()
        }
        other => other,
    }
}

fn cu_stream(stream: StreamHandle) -> sys::CUstream {
    stream.0 as usize as sys::CUstream
}

fn cu_capture_mode(mode: CaptureMode) -> sys::CUstreamCaptureMode {
    match mode {
        CaptureMode::Global => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
        CaptureMode::ThreadLocal => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        CaptureMode::Relaxed => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
    }
}

fn cu_event(event: EventHandle) -> sys::CUevent {
    event.0 as usize as sys::CUevent
}

/// `cuLaunchHostFunc`'s callback: runs the boxed [`HostFn`] it was given once.
unsafe extern "C" fn run_host_fn(data: *mut c_void) {
    // SAFETY: `data` is the `Box<HostFn>` `launch_host_func` leaked for this one call; the
    // driver calls the callback exactly once, so the box is taken back exactly once.
    let f = unsafe { Box::from_raw(data.cast::<HostFn>()) };
    // A panic must not unwind into the driver's thread: it is stopped here and logged.
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err() {
        tracing::error!(
            "a host function panicked on the driver's thread; the panic was stopped there"
        );
    }
}

fn as_cu_ctx(ctx: ContextHandle) -> sys::CUcontext {
    ctx.0 as usize as sys::CUcontext
}

/// Makes a context current for one call and restores the thread's previous one on drop.
struct CtxScope {
    pushed: bool,
}

impl CtxScope {
    fn enter(ctx: ContextHandle) -> Result<CtxScope, DriverError> {
        let current = result::ctx::get_current().map_err(err("cuCtxGetCurrent"))?;
        if current == Some(as_cu_ctx(ctx)) {
            return Ok(CtxScope { pushed: false });
        }
        // SAFETY: pushing a context handle the caller obtained from this driver; an invalid or
        // destroyed handle is reported by the driver as an error, not undefined behaviour.
        check("cuCtxPushCurrent", unsafe {
            sys::cuCtxPushCurrent_v2(as_cu_ctx(ctx))
        })?;
        Ok(CtxScope { pushed: true })
    }
}

impl Drop for CtxScope {
    fn drop(&mut self) {
        if self.pushed {
            let mut popped = MaybeUninit::<sys::CUcontext>::uninit();
            // SAFETY: pops the context this scope pushed on this thread; `popped` is a valid
            // place for the handle the driver returns.
            let r = unsafe { sys::cuCtxPopCurrent_v2(popped.as_mut_ptr()) };
            if r != sys::CUresult::CUDA_SUCCESS {
                tracing::error!(
                    code = r as u32,
                    "cuCtxPopCurrent failed restoring the caller's context"
                );
            }
        }
    }
}

fn cu_device(dev: DeviceOrdinal) -> Result<sys::CUdevice, DriverError> {
    let ordinal = i32::try_from(dev.0)
        .map_err(|_| DriverError::from_code("cuDeviceGet", crate::code::INVALID_DEVICE))?;
    result::device::get(ordinal).map_err(err("cuDeviceGet"))
}

/// The names the CUDA driver library goes by: the versioned soname first (what the driver
/// package installs), then the development link.
#[cfg(unix)]
const DRIVER_LIBRARIES: &[&str] = &["libcuda.so.1", "libcuda.so"];
#[cfg(windows)]
const DRIVER_LIBRARIES: &[&str] = &["nvcuda.dll"];

/// Release calls (frees, unpins, closes, destroys) the driver refused, in this process.
static FAILED_RELEASES: AtomicU64 = AtomicU64::new(0);

/// Counts a release call the driver refused.
fn counted(result: Result<(), DriverError>) -> Result<(), DriverError> {
    if result.is_err() {
        FAILED_RELEASES.fetch_add(1, Ordering::Relaxed);
    }
    result
}

impl CudaDriver {
    /// How many release calls (`cuMemFree`, `cuMemFreeHost`, `cuMemHostUnregister`,
    /// `cuMemFreeAsync`, `cuIpcCloseMemHandle`, `cuStreamDestroy`, `cuEventDestroy`,
    /// `cuModuleUnload`, `cuMemPoolDestroy`) the driver refused in this process, through any
    /// `CudaDriver`. In correct use emm never makes one (a refused free is a double free or a
    /// free of memory that is not the caller's), so a test that does not provoke one on purpose
    /// can check that this count stays put.
    pub fn failed_releases() -> u64 {
        FAILED_RELEASES.load(Ordering::Relaxed)
    }

    /// Loads libcuda and calls `cuInit(0)`.
    ///
    /// Fails with [`ErrorKind::DriverUnavailable`](crate::ErrorKind::DriverUnavailable) when no
    /// libcuda can be loaded (or it is a stub), and with
    /// [`ErrorKind::NoDevice`](crate::ErrorKind::NoDevice) when the driver sees no GPU. Never
    /// panics.
    pub fn load() -> Result<CudaDriver, DriverError> {
        if !Self::library_present() {
            return Err(DriverError::unavailable(
                "cuInit",
                "libcuda.so / libcuda.so.1 not found on the loader path",
            ));
        }
        let driver = CudaDriver { _loaded: () };
        driver.init()?;
        Ok(driver)
    }

    /// The context current on the calling thread, if any (`cuCtxGetCurrent`). emm's calls leave
    /// it as they found it.
    pub fn current_context(&self) -> Result<Option<ContextHandle>, DriverError> {
        let current = result::ctx::get_current().map_err(err("cuCtxGetCurrent"))?;
        Ok(current.map(|c| ContextHandle(c as usize as u64)))
    }

    /// Pushes `ctx` onto the calling thread's context stack (`cuCtxPushCurrent`), as a host
    /// runtime does to make a context current. Pair it with [`pop_current`](Self::pop_current).
    pub fn push_current(&self, ctx: ContextHandle) -> Result<(), DriverError> {
        // SAFETY: an invalid or destroyed handle is reported by the driver as an error.
        check("cuCtxPushCurrent", unsafe {
            sys::cuCtxPushCurrent_v2(as_cu_ctx(ctx))
        })
    }

    /// Pops the calling thread's current context (`cuCtxPopCurrent`) and returns it.
    pub fn pop_current(&self) -> Result<Option<ContextHandle>, DriverError> {
        let mut popped = MaybeUninit::<sys::CUcontext>::uninit();
        // SAFETY: `popped` is a valid place for one handle; with no current context the driver
        // answers with an error.
        check("cuCtxPopCurrent", unsafe {
            sys::cuCtxPopCurrent_v2(popped.as_mut_ptr())
        })?;
        // SAFETY: the pop succeeded and wrote `popped`.
        let popped = unsafe { popped.assume_init() };
        Ok((!popped.is_null()).then_some(ContextHandle(popped as usize as u64)))
    }

    /// Whether a CUDA driver library can be loaded. Makes no CUDA call.
    pub fn library_present() -> bool {
        DRIVER_LIBRARIES.iter().any(|name| {
            // SAFETY: opening the CUDA driver library runs only its initialisers, which the
            // driver documents as safe to run at any time; the handle is closed at once (cudarc
            // opens the library again for its own calls), and no symbol is called here.
            unsafe { libloading::Library::new(*name) }.is_ok()
        })
    }
}

/// What [`CudaDriver`]'s calls are written on: the driver itself (through `Deref`), with one
/// method per call, in the file of its area; the [`Driver`] implementation hands each call to
/// the method of the same name.
struct Calls<'a>(&'a CudaDriver);

impl std::ops::Deref for Calls<'_> {
    type Target = CudaDriver;

    fn deref(&self) -> &CudaDriver {
        self.0
    }
}

/// The table's callback that implements [`Driver`] for [`CudaDriver`].
macro_rules! cuda_driver_impl {
    (ops [$($ops:tt)*] methods [$(
        $(#[$doc:meta])*
        $(@[$attr:meta])*
        $([$unsafe:ident])? fn $name:ident $(<$lt:lifetime>)? ($($arg:ident : [$($ty:tt)*]),*) -> [$($ret:tt)*] => $op:ident $([$custom:ident])?;
    )*]) => {
        impl Driver for CudaDriver {
            fn name(&self) -> &'static str {
                "cuda"
            }

            $(
                $(#[$attr])*
                $($unsafe)? fn $name $(<$lt>)? (&self, $($arg: $($ty)*),*) -> Result<$($ret)*, DriverError> {
                    crate::__forward_call!($($unsafe)? ; Calls(self).$name($($arg),*))
                }
            )*
        }
    };
}

crate::driver_calls!(cuda_driver_impl);

/// The properties of pinned memory on device `dev`, as `cuMemCreate` and
/// `cuMemGetAllocationGranularity` take them (no shareable handle type).
/// The descriptor an export call (`call`) wrote: owned by the caller, or an error where the
/// driver reported success and wrote no descriptor.
///
/// # Safety
///
/// `fd`, if not negative, was opened by the call for the caller and nothing else owns it.
#[cfg(unix)]
unsafe fn exported_fd(call: &'static str, fd: i32) -> Result<OwnedFd, DriverError> {
    if fd < 0 {
        return Err(DriverError::from_code(call, crate::code::INVALID_VALUE));
    }
    // SAFETY: the caller vouches that `fd` is the call's new descriptor, owned by no one else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn device_memory_prop(dev: DeviceOrdinal) -> sys::CUmemAllocationProp {
    // SAFETY: an all-zero `CUmemAllocationProp` is valid (integers, enums whose zero is a
    // variant, a null pointer); the type and location are set below.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location = device_location(dev);
    prop
}

/// The location of device `dev`'s memory, for the pool access calls.
/// Read and write access for device `dev` (`cuMemPoolSetAccess`, `cuMemSetAccess`).
fn read_write_access(dev: DeviceOrdinal) -> sys::CUmemAccessDesc {
    sys::CUmemAccessDesc {
        location: device_location(dev),
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

fn device_location(dev: DeviceOrdinal) -> sys::CUmemLocation {
    // SAFETY: an all-zero `CUmemLocation` is valid (plain integers); both fields are set.
    let mut location: sys::CUmemLocation = unsafe { std::mem::zeroed() };
    location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    location.id = dev.0 as i32;
    location
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a machine without libcuda, `load` is an ordinary error, not a panic.
    #[test]
    fn load_never_panics() {
        match CudaDriver::load() {
            Ok(d) => {
                // A GPU machine: the driver answers.
                d.device_count()
                    .expect("cuDeviceGetCount after a successful load");
            }
            Err(e) => {
                let kind = e.kind();
                assert!(
                    matches!(
                        kind,
                        crate::ErrorKind::DriverUnavailable | crate::ErrorKind::NoDevice
                    ),
                    "unexpected error kind {kind:?}: {e}"
                );
                // Formatting must not call into libcuda (cudarc's own error would panic here).
                assert!(!e.to_string().is_empty());
            }
        }
    }
}
