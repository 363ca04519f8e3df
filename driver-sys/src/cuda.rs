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
//! Each method wraps one driver call (the `_v2` ABI names where CUDA has them) and links the
//! CUDA documentation page it follows. Calls that name a context make it current for their
//! duration with [`CtxScope`], restoring the thread's previous context afterwards, so emm never
//! leaves a context current behind the host runtime's back.
#![allow(unsafe_code)]

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

impl Driver for CudaDriver {
    fn name(&self) -> &'static str {
        "cuda"
    }

    /// [cuInit](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__INITIALIZE.html)
    fn init(&self) -> Result<(), DriverError> {
        result::init().map_err(err("cuInit"))
    }

    /// [cuDeviceGetCount](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html)
    fn device_count(&self) -> Result<u32, DriverError> {
        let n = result::device::get_count().map_err(err("cuDeviceGetCount"))?;
        Ok(u32::try_from(n).unwrap_or(0))
    }

    /// [cuDeviceTotalMem](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html)
    fn device_total_mem(&self, dev: DeviceOrdinal) -> Result<usize, DriverError> {
        let device = cu_device(dev)?;
        // SAFETY: `device` came from cuDeviceGet.
        unsafe { result::device::total_mem(device) }.map_err(err("cuDeviceTotalMem"))
    }

    /// [cuDeviceGetAttribute](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html)
    fn device_attribute(
        &self,
        dev: DeviceOrdinal,
        attr: DeviceAttribute,
    ) -> Result<i32, DriverError> {
        use sys::CUdevice_attribute as A;
        let device = cu_device(dev)?;
        let attr = match attr {
            DeviceAttribute::CanMapHostMemory => A::CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY,
            DeviceAttribute::PciBusId => A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID,
            DeviceAttribute::PciDeviceId => A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID,
            DeviceAttribute::PciDomainId => A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID,
            DeviceAttribute::ManagedMemory => A::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY,
            DeviceAttribute::ConcurrentManagedAccess => {
                A::CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS
            }
            DeviceAttribute::HostNumaId => A::CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID,
            #[cfg(feature = "cuda-13000")]
            DeviceAttribute::HostNumaMemoryPoolsSupported => {
                A::CU_DEVICE_ATTRIBUTE_HOST_NUMA_MEMORY_POOLS_SUPPORTED
            }
            #[cfg(feature = "cuda-13000")]
            DeviceAttribute::HostMemoryPoolsSupported => {
                A::CU_DEVICE_ATTRIBUTE_HOST_MEMORY_POOLS_SUPPORTED
            }
            DeviceAttribute::VirtualMemoryManagement => {
                A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
            }
            DeviceAttribute::HandleTypePosixFileDescriptor => {
                A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
            }
            #[cfg(not(feature = "cuda-13000"))]
            DeviceAttribute::HostNumaMemoryPoolsSupported
            | DeviceAttribute::HostMemoryPoolsSupported => {
                return Err(DriverError::from_kind(
                    "cuDeviceGetAttribute",
                    crate::ErrorKind::NotSupported,
                )
                .with_detail(
                    "emm was built against CUDA headers older than 13.0, which do not name \
                     this attribute; build driver-sys with its `cuda-13000` feature",
                ));
            }
        };
        // SAFETY: `attr` is a valid enum value; `device` came from cuDeviceGet.
        unsafe { result::device::get_attribute(device, attr) }.map_err(err("cuDeviceGetAttribute"))
    }

    /// [cuDevicePrimaryCtxRetain](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__PRIMARY__CTX.html)
    fn primary_ctx_retain(&self, dev: DeviceOrdinal) -> Result<ContextHandle, DriverError> {
        let device = cu_device(dev)?;
        // SAFETY: `device` came from cuDeviceGet; the caller releases what it retains.
        let ctx = unsafe { result::primary_ctx::retain(device) }
            .map_err(err("cuDevicePrimaryCtxRetain"))?;
        Ok(ContextHandle(ctx as usize as u64))
    }

    /// [cuDevicePrimaryCtxRelease](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__PRIMARY__CTX.html)
    unsafe fn primary_ctx_release(&self, dev: DeviceOrdinal) -> Result<(), DriverError> {
        let device = cu_device(dev)?;
        // SAFETY: the caller matches this release with an earlier retain (trait contract).
        unsafe { result::primary_ctx::release(device) }.map_err(err("cuDevicePrimaryCtxRelease"))
    }

    /// [cuDevicePrimaryCtxReset](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__PRIMARY__CTX.html)
    /// (no `result` wrapper in cudarc).
    unsafe fn primary_ctx_reset(&self, dev: DeviceOrdinal) -> Result<(), DriverError> {
        let device = cu_device(dev)?;
        // SAFETY: the caller guarantees nothing of the context is used again (trait contract).
        check("cuDevicePrimaryCtxReset", unsafe {
            sys::cuDevicePrimaryCtxReset_v2(device)
        })
    }

    /// [cuMemAlloc](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
    fn mem_alloc(&self, ctx: ContextHandle, bytes: usize) -> Result<DevicePtr, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the context is current; the new allocation is owned by the caller.
        let ptr = unsafe { result::malloc_sync(bytes) }.map_err(err("cuMemAlloc"))?;
        Ok(DevicePtr(ptr))
    }

    /// [cuMemAllocManaged](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
    fn mem_alloc_managed(
        &self,
        ctx: ContextHandle,
        bytes: usize,
        flags: u32,
    ) -> Result<DevicePtr, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let mut ptr = MaybeUninit::<sys::CUdeviceptr>::uninit();
        // SAFETY: `ptr` is a valid place for one device pointer; the driver validates the size
        // and the flags; the context is current and the new allocation is the caller's.
        check("cuMemAllocManaged", unsafe {
            sys::cuMemAllocManaged(ptr.as_mut_ptr(), bytes, flags)
        })?;
        // SAFETY: written by the successful call above.
        Ok(DevicePtr(unsafe { ptr.assume_init() }))
    }

    /// [cuMemFree](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
    unsafe fn mem_free(&self, ctx: ContextHandle, ptr: DevicePtr) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the caller guarantees `ptr` is a live allocation of `ctx`, freed once and no
        // longer used (trait contract); the driver rejects unknown pointers with an error.
        counted(unsafe { result::free_sync(ptr.0) }.map_err(err("cuMemFree")))
    }

    /// [cuMemGetInfo](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
    fn mem_get_info(&self, ctx: ContextHandle) -> Result<MemInfo, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let (free, total) = result::mem_get_info().map_err(err("cuMemGetInfo"))?;
        Ok(MemInfo { free, total })
    }

    /// [cuMemGetAddressRange](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
    /// (no `result` wrapper in cudarc).
    fn mem_get_address_range(
        &self,
        ctx: ContextHandle,
        ptr: DevicePtr,
    ) -> Result<(DevicePtr, usize), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let mut base = 0 as sys::CUdeviceptr;
        let mut size = 0usize;
        // SAFETY: `base` and `size` are valid places; the driver only reads its own tables for
        // `ptr` and reports an unknown pointer as an error.
        check("cuMemGetAddressRange", unsafe {
            sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr.0)
        })?;
        Ok((DevicePtr(base), size))
    }

    /// [cuMemcpyHtoD](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
    unsafe fn memcpy_htod(
        &self,
        ctx: ContextHandle,
        dst: DevicePtr,
        src: &[u8],
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY:
        // - `src` is a live slice of `src.len()` readable bytes for the whole (synchronous) call.
        // - the caller guarantees the destination range is a live allocation nobody else
        //   touches during the copy (trait contract).
        let first = unsafe { result::memcpy_htod_sync(dst.0, src) }.map_err(err("cuMemcpyHtoD"));
        retry_untyped(first, &[dst.0], || {
            // SAFETY: as above; `cuMemcpy` reads `src` as host memory (an address the
            // driver does not know is pageable host memory in the unified address space).
            check("cuMemcpy", unsafe {
                sys::cuMemcpy(dst.0, src.as_ptr() as u64, src.len())
            })
        })
    }

    /// [cuMemcpyDtoD](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
    unsafe fn memcpy_dtod(
        &self,
        ctx: ContextHandle,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the caller guarantees both ranges are live device memory nobody else writes
        // during the (synchronous) copy (trait contract).
        let first =
            unsafe { result::memcpy_dtod_sync(dst.0, src.0, bytes) }.map_err(err("cuMemcpyDtoD"));
        retry_untyped(first, &[dst.0, src.0], || {
            // SAFETY: as above; both addresses are memory the driver knows.
            check("cuMemcpy", unsafe { sys::cuMemcpy(dst.0, src.0, bytes) })
        })
    }

    /// [cuMemsetD8](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
    unsafe fn memset_d8(
        &self,
        ctx: ContextHandle,
        dst: DevicePtr,
        value: u8,
        bytes: usize,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the caller guarantees the range is live memory nobody else uses during the
        // (synchronous) call (trait contract).
        unsafe { result::memset_d8_sync(dst.0, value, bytes) }.map_err(err("cuMemsetD8"))
    }

    /// [cuMemHostAlloc](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
    fn mem_host_alloc(
        &self,
        ctx: ContextHandle,
        bytes: usize,
        flags: u32,
    ) -> Result<HostPtr, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the driver allocates new host memory owned by the caller; `flags` are plain
        // bits the driver validates.
        let ptr = unsafe { result::malloc_host(bytes, flags) }.map_err(err("cuMemHostAlloc"))?;
        Ok(HostPtr(ptr as usize))
    }

    /// [cuMemFreeHost](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
    unsafe fn mem_free_host(&self, ctx: ContextHandle, ptr: HostPtr) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the caller guarantees `ptr` came from cuMemHostAlloc, is freed once and is not
        // used afterwards (trait contract).
        counted(unsafe { result::free_host(ptr.0 as *mut c_void) }.map_err(err("cuMemFreeHost")))
    }

    /// [cuMemHostRegister](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
    /// (no `result` wrapper in cudarc).
    unsafe fn mem_host_register(
        &self,
        ctx: ContextHandle,
        ptr: HostPtr,
        bytes: usize,
        flags: u32,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the caller keeps the range alive until it is unregistered and holds no Rust
        // reference to it while a mapping is used (trait contract).
        check("cuMemHostRegister", unsafe {
            sys::cuMemHostRegister_v2(ptr.0 as *mut c_void, bytes, flags)
        })
    }

    /// [cuMemHostUnregister](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
    /// (no `result` wrapper in cudarc).
    unsafe fn mem_host_unregister(
        &self,
        ctx: ContextHandle,
        ptr: HostPtr,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the caller guarantees the range was registered and its mapping is unused
        // afterwards (trait contract); an unregistered pointer is an error, not UB.
        counted(check("cuMemHostUnregister", unsafe {
            sys::cuMemHostUnregister(ptr.0 as *mut c_void)
        }))
    }

    /// [cuMemHostGetDevicePointer](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
    /// (no `result` wrapper in cudarc).
    fn mem_host_get_device_pointer(
        &self,
        ctx: ContextHandle,
        ptr: HostPtr,
    ) -> Result<DevicePtr, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let mut dptr = 0 as sys::CUdeviceptr;
        // SAFETY: `dptr` is a valid place; the driver only looks the host address up in its own
        // tables and reports an unmapped one as an error.
        check("cuMemHostGetDevicePointer", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut dptr, ptr.0 as *mut c_void, 0)
        })?;
        Ok(DevicePtr(dptr))
    }

    /// [cuStreamCreate](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
    fn stream_create(&self, ctx: ContextHandle, flags: u32) -> Result<StreamHandle, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let mut stream = MaybeUninit::<sys::CUstream>::uninit();
        // SAFETY: `stream` is a valid place for one handle; the driver validates `flags`.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(stream.as_mut_ptr(), flags)
        })?;
        // SAFETY: the call succeeded and wrote `stream`.
        Ok(StreamHandle(unsafe { stream.assume_init() } as usize as u64))
    }

    /// [cuStreamDestroy](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
    unsafe fn stream_destroy(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the caller destroys a stream of `ctx` once (trait contract).
        counted(
            unsafe { result::stream::destroy(stream.0 as usize as sys::CUstream) }
                .map_err(err("cuStreamDestroy")),
        )
    }

    /// [cuStreamCreateWithPriority](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
    fn stream_create_with_priority(
        &self,
        ctx: ContextHandle,
        flags: u32,
        priority: i32,
    ) -> Result<StreamHandle, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let mut stream = MaybeUninit::<sys::CUstream>::uninit();
        // SAFETY: `stream` is a valid place for one handle; the driver validates the rest.
        check("cuStreamCreateWithPriority", unsafe {
            sys::cuStreamCreateWithPriority(stream.as_mut_ptr(), flags, priority)
        })?;
        // SAFETY: the call succeeded and wrote `stream`.
        Ok(StreamHandle(unsafe { stream.assume_init() } as usize as u64))
    }

    /// [cuCtxGetStreamPriorityRange](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__CTX.html)
    fn stream_priority_range(&self, ctx: ContextHandle) -> Result<(i32, i32), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let (mut least, mut greatest) = (0i32, 0i32);
        // SAFETY: both are valid places for one int.
        check("cuCtxGetStreamPriorityRange", unsafe {
            sys::cuCtxGetStreamPriorityRange(&raw mut least, &raw mut greatest)
        })?;
        Ok((least, greatest))
    }

    /// [cuStreamGetPriority](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
    fn stream_priority(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
    ) -> Result<i32, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let mut priority = 0i32;
        // SAFETY: `priority` is a valid place for one int; the driver validates the handle.
        check("cuStreamGetPriority", unsafe {
            sys::cuStreamGetPriority(cu_stream(stream), &raw mut priority)
        })?;
        Ok(priority)
    }

    /// [cuStreamQuery](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
    fn stream_query(&self, ctx: ContextHandle, stream: StreamHandle) -> Result<bool, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the driver validates the stream handle.
        check_ready("cuStreamQuery", unsafe {
            sys::cuStreamQuery(cu_stream(stream))
        })
    }

    /// [cuStreamBeginCapture](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
    fn stream_begin_capture(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
        mode: CaptureMode,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the driver validates the stream handle and refuses the legacy stream.
        check("cuStreamBeginCapture", unsafe {
            sys::cuStreamBeginCapture_v2(cu_stream(stream), cu_capture_mode(mode))
        })
    }

    /// [cuStreamEndCapture](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
    fn stream_end_capture(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
    ) -> Result<GraphHandle, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: `graph` is a valid out-parameter; the driver validates the stream handle.
        check("cuStreamEndCapture", unsafe {
            sys::cuStreamEndCapture(cu_stream(stream), &mut graph)
        })?;
        Ok(GraphHandle(graph as usize as u64))
    }

    /// [cuStreamGetCaptureInfo](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
    fn stream_capture_status(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
    ) -> Result<CaptureStatus, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let mut id: sys::cuuint64_t = 0;
        // SAFETY: both out-parameters are valid, the others are null (the driver skips null
        // outputs); the driver validates the stream handle.
        check("cuStreamGetCaptureInfo", unsafe {
            sys::cuStreamGetCaptureInfo_v3(
                cu_stream(stream),
                &mut status,
                &mut id,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        })?;
        Ok(match status {
            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => CaptureStatus::None,
            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => {
                CaptureStatus::Active { id }
            }
            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED => {
                CaptureStatus::Invalidated { id }
            }
        })
    }

    /// [cuThreadExchangeStreamCaptureMode](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
    fn thread_exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode, DriverError> {
        let mut m = cu_capture_mode(mode);
        // SAFETY: `m` is a valid in/out parameter.
        check("cuThreadExchangeStreamCaptureMode", unsafe {
            sys::cuThreadExchangeStreamCaptureMode(&mut m)
        })?;
        Ok(match m {
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL => CaptureMode::Global,
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL => {
                CaptureMode::ThreadLocal
            }
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED => CaptureMode::Relaxed,
        })
    }

    /// [cuGraphInstantiateWithFlags](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html)
    fn graph_instantiate(
        &self,
        ctx: ContextHandle,
        graph: GraphHandle,
    ) -> Result<GraphExecHandle, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: `exec` is a valid out-parameter; the driver validates the graph handle.
        check("cuGraphInstantiateWithFlags", unsafe {
            sys::cuGraphInstantiateWithFlags(&mut exec, graph.0 as usize as sys::CUgraph, 0)
        })?;
        Ok(GraphExecHandle(exec as usize as u64))
    }

    /// [cuGraphLaunch](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html)
    fn graph_launch(
        &self,
        ctx: ContextHandle,
        exec: GraphExecHandle,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the driver validates both handles.
        check("cuGraphLaunch", unsafe {
            sys::cuGraphLaunch(exec.0 as usize as sys::CUgraphExec, cu_stream(stream))
        })
    }

    /// [cuGraphExecDestroy](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html)
    unsafe fn graph_exec_destroy(
        &self,
        ctx: ContextHandle,
        exec: GraphExecHandle,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the caller does not use `exec` again (this method's contract).
        check("cuGraphExecDestroy", unsafe {
            sys::cuGraphExecDestroy(exec.0 as usize as sys::CUgraphExec)
        })
    }

    /// [cuGraphDestroy](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html)
    unsafe fn graph_destroy(
        &self,
        ctx: ContextHandle,
        graph: GraphHandle,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the caller does not use `graph` again (this method's contract).
        check("cuGraphDestroy", unsafe {
            sys::cuGraphDestroy(graph.0 as usize as sys::CUgraph)
        })
    }

    /// [cuEventRecord](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html)
    fn event_record(
        &self,
        ctx: ContextHandle,
        event: EventHandle,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the driver validates both handles.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(cu_event(event), cu_stream(stream))
        })
    }

    /// [cuStreamWaitEvent](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
    fn stream_wait_event(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
        event: EventHandle,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the driver validates both handles; flags must be 0.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(cu_stream(stream), cu_event(event), 0)
        })
    }

    /// [cuEventQuery](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html)
    fn event_query(&self, ctx: ContextHandle, event: EventHandle) -> Result<bool, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the driver validates the handle.
        check_ready("cuEventQuery", unsafe {
            sys::cuEventQuery(cu_event(event))
        })
    }

    /// [cuEventSynchronize](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html)
    fn event_synchronize(&self, ctx: ContextHandle, event: EventHandle) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the driver validates the handle.
        check("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(cu_event(event))
        })
    }

    /// [cuEventElapsedTime](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html)
    fn event_elapsed_time(
        &self,
        ctx: ContextHandle,
        start: EventHandle,
        end: EventHandle,
    ) -> Result<f32, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let mut ms = 0f32;
        // SAFETY: `ms` is a valid place for one float; the driver validates the handles.
        check("cuEventElapsedTime", unsafe {
            sys::cuEventElapsedTime_v2(&raw mut ms, cu_event(start), cu_event(end))
        })?;
        Ok(ms)
    }

    /// [cuLaunchHostFunc](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EXEC.html)
    fn launch_host_func(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
        f: HostFn,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // A captured host function would run at every launch of the graph, and `f` runs once:
        // refused on a captured stream (the trait's rule).
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: `status` is a valid out-parameter; the driver validates the stream handle.
        check("cuStreamIsCapturing", unsafe {
            sys::cuStreamIsCapturing(cu_stream(stream), &mut status)
        })?;
        if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
            return Err(DriverError::from_code(
                "cuLaunchHostFunc",
                crate::code::STREAM_CAPTURE_UNSUPPORTED,
            )
            .with_detail(
                "the stream is being captured, and a host function given to the driver runs \
                 once, where a graph would run it at every launch",
            ));
        }
        let data = Box::into_raw(Box::new(f)).cast::<c_void>();
        // SAFETY: `run_host_fn` matches `CUhostFn`; `data` is a leaked `Box<HostFn>` it takes
        // back once when the driver calls it.
        let launched = check("cuLaunchHostFunc", unsafe {
            sys::cuLaunchHostFunc(cu_stream(stream), Some(run_host_fn), data)
        });
        if launched.is_err() {
            // SAFETY: the launch failed, so the driver will never call back with `data`.
            drop(unsafe { Box::from_raw(data.cast::<HostFn>()) });
        }
        launched
    }

    /// [cuStreamWaitValue32](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEMOP.html)
    fn stream_wait_value32(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u32,
        flags: u32,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the driver validates the stream, the address and the flags; waiting reads
        // the word only.
        check("cuStreamWaitValue32", unsafe {
            sys::cuStreamWaitValue32_v2(cu_stream(stream), addr.0, value, flags)
        })
    }

    /// [cuStreamWriteValue32](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEMOP.html)
    unsafe fn stream_write_value32(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u32,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the caller owns the word at `addr` (trait contract); the driver validates
        // the handles.
        check("cuStreamWriteValue32", unsafe {
            sys::cuStreamWriteValue32_v2(cu_stream(stream), addr.0, value, 0)
        })
    }

    /// [cuMemcpyHtoDAsync](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
    unsafe fn memcpy_htod_async(
        &self,
        ctx: ContextHandle,
        dst: DevicePtr,
        src: HostPtr,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the caller keeps both ranges live until the copy completes (trait contract).
        let first = check("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst.0, src.0 as *const c_void, bytes, cu_stream(stream))
        });
        retry_untyped(first, &[dst.0], || {
            // SAFETY: as above.
            check("cuMemcpyAsync", unsafe {
                sys::cuMemcpyAsync(dst.0, src.0 as u64, bytes, cu_stream(stream))
            })
        })
    }

    /// [cuMemcpyDtoHAsync](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
    unsafe fn memcpy_dtoh_async(
        &self,
        ctx: ContextHandle,
        dst: HostPtr,
        src: DevicePtr,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: as for `memcpy_htod_async`.
        let first = check("cuMemcpyDtoHAsync", unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst.0 as *mut c_void, src.0, bytes, cu_stream(stream))
        });
        retry_untyped(first, &[src.0], || {
            // SAFETY: as above.
            check("cuMemcpyAsync", unsafe {
                sys::cuMemcpyAsync(dst.0 as u64, src.0, bytes, cu_stream(stream))
            })
        })
    }

    /// [cuMemcpyDtoDAsync](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
    unsafe fn memcpy_dtod_async(
        &self,
        ctx: ContextHandle,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: as for `memcpy_htod_async`.
        let first = check("cuMemcpyDtoDAsync", unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst.0, src.0, bytes, cu_stream(stream))
        });
        retry_untyped(first, &[dst.0, src.0], || {
            // SAFETY: as above.
            check("cuMemcpyAsync", unsafe {
                sys::cuMemcpyAsync(dst.0, src.0, bytes, cu_stream(stream))
            })
        })
    }

    /// [cuMemsetD8Async](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
    unsafe fn memset_d8_async(
        &self,
        ctx: ContextHandle,
        dst: DevicePtr,
        value: u8,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the caller keeps the range live until the set completes (trait contract).
        check("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(dst.0, value, bytes, cu_stream(stream))
        })
    }

    /// [cuEventCreate](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html)
    fn event_create(&self, ctx: ContextHandle, flags: u32) -> Result<EventHandle, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let mut event = MaybeUninit::<sys::CUevent>::uninit();
        // SAFETY: `event` is a valid place for one handle; the driver validates `flags`.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(event.as_mut_ptr(), flags)
        })?;
        // SAFETY: the call succeeded and wrote `event`.
        Ok(EventHandle(unsafe { event.assume_init() } as usize as u64))
    }

    /// [cuEventDestroy](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html)
    unsafe fn event_destroy(
        &self,
        ctx: ContextHandle,
        event: EventHandle,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the caller destroys an event of `ctx` once (trait contract).
        counted(check("cuEventDestroy", unsafe {
            sys::cuEventDestroy_v2(event.0 as usize as sys::CUevent)
        }))
    }

    /// [cuModuleLoadData](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MODULE.html)
    fn module_load_data(
        &self,
        ctx: ContextHandle,
        image: &[u8],
    ) -> Result<ModuleHandle, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // PTX is read as a C string: make sure it ends.
        let mut owned = image.to_vec();
        if owned.last() != Some(&0) {
            owned.push(0);
        }
        // SAFETY: `owned` is a live, NUL-terminated image for the whole call; the driver copies
        // what it needs and validates the image.
        let module = unsafe { result::module::load_data(owned.as_ptr().cast()) }
            .map_err(err("cuModuleLoadData"))?;
        Ok(ModuleHandle(module as usize as u64))
    }

    /// [cuModuleUnload](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MODULE.html)
    unsafe fn module_unload(
        &self,
        ctx: ContextHandle,
        module: ModuleHandle,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the caller unloads a module of `ctx` once, with nothing of it in use.
        counted(
            unsafe { result::module::unload(module.0 as usize as sys::CUmodule) }
                .map_err(err("cuModuleUnload")),
        )
    }

    /// [cuIpcGetMemHandle](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
    /// (no `result` wrapper in cudarc).
    fn ipc_get_mem_handle(
        &self,
        ctx: ContextHandle,
        ptr: DevicePtr,
    ) -> Result<IpcMemHandle, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let mut handle = MaybeUninit::<sys::CUipcMemHandle>::uninit();
        // SAFETY: `handle` is a valid place for one handle; the driver validates `ptr`.
        check("cuIpcGetMemHandle", unsafe {
            sys::cuIpcGetMemHandle(handle.as_mut_ptr(), ptr.0)
        })?;
        // SAFETY: the call succeeded and wrote `handle`.
        let handle = unsafe { handle.assume_init() };
        Ok(IpcMemHandle(handle.reserved.map(|b| b as u8)))
    }

    /// [cuIpcOpenMemHandle](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
    /// (no `result` wrapper in cudarc).
    fn ipc_open_mem_handle(
        &self,
        ctx: ContextHandle,
        handle: &IpcMemHandle,
    ) -> Result<DevicePtr, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let raw = sys::CUipcMemHandle {
            reserved: handle.0.map(|b| b as _),
        };
        let mut ptr = 0 as sys::CUdeviceptr;
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        // SAFETY: `ptr` is a valid place; the handle is plain bytes the driver validates.
        check("cuIpcOpenMemHandle", unsafe {
            sys::cuIpcOpenMemHandle_v2(&mut ptr, raw, flags)
        })?;
        Ok(DevicePtr(ptr))
    }

    /// [cuIpcCloseMemHandle](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
    /// (no `result` wrapper in cudarc).
    unsafe fn ipc_close_mem_handle(
        &self,
        ctx: ContextHandle,
        ptr: DevicePtr,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the caller closes a mapping it opened, once, and does not use it afterwards.
        counted(check("cuIpcCloseMemHandle", unsafe {
            sys::cuIpcCloseMemHandle(ptr.0)
        }))
    }

    /// [cuCtxEnablePeerAccess](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__PEER__ACCESS.html)
    /// (no `result` wrapper in cudarc).
    fn ctx_enable_peer_access(
        &self,
        ctx: ContextHandle,
        peer: ContextHandle,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: `peer` is a context handle from this driver (an invalid or destroyed one is
        // reported as an error); flags must be 0.
        check("cuCtxEnablePeerAccess", unsafe {
            sys::cuCtxEnablePeerAccess(as_cu_ctx(peer), 0)
        })
    }

    /// [cuDeviceCanAccessPeer](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__PEER__ACCESS.html)
    /// (no `result` wrapper in cudarc).
    fn device_can_access_peer(
        &self,
        dev: DeviceOrdinal,
        peer: DeviceOrdinal,
    ) -> Result<bool, DriverError> {
        let (a, b) = (cu_device(dev)?, cu_device(peer)?);
        let mut can = 0i32;
        // SAFETY: `can` is a valid place for one int; both devices came from cuDeviceGet.
        check("cuDeviceCanAccessPeer", unsafe {
            sys::cuDeviceCanAccessPeer(&mut can, a, b)
        })?;
        Ok(can != 0)
    }

    /// [cuMemcpyDtoH](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
    unsafe fn memcpy_dtoh(
        &self,
        ctx: ContextHandle,
        dst: &mut [u8],
        src: DevicePtr,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY:
        // - `dst` is a live, exclusively borrowed slice of `dst.len()` writable bytes for the
        //   whole (synchronous) call.
        // - the caller guarantees the source range is a live allocation nobody writes during
        //   the copy (trait contract).
        let first =
            unsafe { result::memcpy_dtoh_sync(&mut *dst, src.0) }.map_err(err("cuMemcpyDtoH"));
        retry_untyped(first, &[src.0], || {
            // SAFETY: as above; `cuMemcpy` writes `dst` as host memory.
            check("cuMemcpy", unsafe {
                sys::cuMemcpy(dst.as_mut_ptr() as u64, src.0, dst.len())
            })
        })
    }

    /// [cuStreamSynchronize](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
    fn stream_synchronize(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the driver validates the stream handle (0 is the legacy default stream).
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(stream.0 as usize as sys::CUstream)
        })
    }

    /// [cuDeviceGetDefaultMemPool](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html)
    fn device_default_mem_pool(&self, dev: DeviceOrdinal) -> Result<MemPoolHandle, DriverError> {
        let device = cu_device(dev)?;
        let mut pool = MaybeUninit::<sys::CUmemoryPool>::uninit();
        // SAFETY: `pool` is a valid place for one handle; `device` came from cuDeviceGet.
        check("cuDeviceGetDefaultMemPool", unsafe {
            sys::cuDeviceGetDefaultMemPool(pool.as_mut_ptr(), device)
        })?;
        // SAFETY: the call succeeded and wrote `pool`.
        Ok(MemPoolHandle(unsafe { pool.assume_init() } as usize as u64))
    }

    /// [cuMemPoolCreate](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html)
    fn mem_pool_create_limited(
        &self,
        ctx: ContextHandle,
        location: MemLocation,
        ipc: bool,
        max_size: usize,
    ) -> Result<MemPoolHandle, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: an all-zero `CUmemPoolProps` is valid (null pointers, zero sizes); the
        // fields that matter are set below.
        let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.handleTypes = if ipc {
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        } else {
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE
        };
        use sys::CUmemLocationType as L;
        let (type_, id) = match location {
            MemLocation::Device(dev) => (L::CU_MEM_LOCATION_TYPE_DEVICE, dev.0 as i32),
            MemLocation::Host => (L::CU_MEM_LOCATION_TYPE_HOST, 0),
            MemLocation::HostNuma(node) => (L::CU_MEM_LOCATION_TYPE_HOST_NUMA, node),
        };
        props.location.type_ = type_;
        props.location.id = id;
        // `maxSize` follows `win32SecurityAttributes` in the driver's struct (CUDA 12.2 on);
        // headers before 12.2 call those bytes `reserved`, so it is written by offset: the
        // layout is the driver's, whichever header cudarc was built with.
        let at = std::mem::offset_of!(sys::CUmemPoolProps, win32SecurityAttributes)
            + std::mem::size_of::<*mut c_void>();
        debug_assert!(at + std::mem::size_of::<usize>() <= std::mem::size_of_val(&props));
        // SAFETY: `at .. at + 8` lies inside `props` (the struct is 88 bytes in every header;
        // checked above in debug builds), and the bytes are plain data (`maxSize` or zeroed
        // reserved bytes); an unaligned write needs no alignment.
        unsafe {
            (&raw mut props)
                .cast::<u8>()
                .add(at)
                .cast::<usize>()
                .write_unaligned(max_size)
        };
        let mut pool = MaybeUninit::<sys::CUmemoryPool>::uninit();
        // SAFETY: `props` is initialised and outlives the call; `pool` is a valid place.
        check("cuMemPoolCreate", unsafe {
            sys::cuMemPoolCreate(pool.as_mut_ptr(), &props)
        })?;
        // SAFETY: the call succeeded and wrote `pool`.
        Ok(MemPoolHandle(unsafe { pool.assume_init() } as usize as u64))
    }

    /// [cuMemPoolDestroy](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html)
    unsafe fn mem_pool_destroy(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the caller destroys a pool it created, once (trait contract).
        counted(check("cuMemPoolDestroy", unsafe {
            sys::cuMemPoolDestroy(pool.0 as usize as sys::CUmemoryPool)
        }))
    }

    /// [cuMemPoolSetAttribute](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html)
    fn mem_pool_set_release_threshold(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
        bytes: u64,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let mut value: u64 = bytes;
        // SAFETY: the release threshold is a cuuint64_t, which `value` is; the driver
        // validates the pool handle.
        check("cuMemPoolSetAttribute", unsafe {
            sys::cuMemPoolSetAttribute(
                pool.0 as usize as sys::CUmemoryPool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&raw mut value).cast::<c_void>(),
            )
        })
    }

    /// [cuMemPoolTrimTo](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html)
    fn mem_pool_trim_to(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
        keep: usize,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the driver validates the pool handle.
        check("cuMemPoolTrimTo", unsafe {
            sys::cuMemPoolTrimTo(pool.0 as usize as sys::CUmemoryPool, keep)
        })
    }

    /// [cuMemPoolGetAttribute](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html)
    fn mem_pool_usage(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
    ) -> Result<MemPoolUsage, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let read = |attr| {
            let mut value: u64 = 0;
            // SAFETY: both attributes read are cuuint64_t, which `value` is.
            check("cuMemPoolGetAttribute", unsafe {
                sys::cuMemPoolGetAttribute(
                    pool.0 as usize as sys::CUmemoryPool,
                    attr,
                    (&raw mut value).cast::<c_void>(),
                )
            })
            .map(|()| value)
        };
        use sys::CUmemPool_attribute as A;
        Ok(MemPoolUsage {
            reserved: read(A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
            used: read(A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
            reserved_high: read(A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
            used_high: read(A::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
            release_threshold: read(A::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)?,
        })
    }

    /// [cuMemPoolCreate](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html)
    /// with `CU_MEM_ALLOCATION_TYPE_MANAGED`.
    #[cfg(feature = "cuda-13000")]
    fn mem_pool_create_managed(
        &self,
        ctx: ContextHandle,
        preferred: Option<MemLocation>,
    ) -> Result<MemPoolHandle, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: an all-zero `CUmemPoolProps` is valid (null pointers, zero sizes); the
        // fields that matter are set below.
        let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_MANAGED;
        props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
        use sys::CUmemLocationType as L;
        let (type_, id) = match preferred {
            None => (L::CU_MEM_LOCATION_TYPE_INVALID, -1),
            Some(MemLocation::Device(dev)) => (L::CU_MEM_LOCATION_TYPE_DEVICE, dev.0 as i32),
            Some(MemLocation::Host) => (L::CU_MEM_LOCATION_TYPE_HOST, -1),
            Some(MemLocation::HostNuma(node)) => (L::CU_MEM_LOCATION_TYPE_HOST_NUMA, node),
        };
        props.location.type_ = type_;
        props.location.id = id;
        let mut pool = MaybeUninit::<sys::CUmemoryPool>::uninit();
        // SAFETY: `props` is initialised and outlives the call; `pool` is a valid place.
        check("cuMemPoolCreate", unsafe {
            sys::cuMemPoolCreate(pool.as_mut_ptr(), &props)
        })?;
        // SAFETY: the call succeeded and wrote `pool`.
        Ok(MemPoolHandle(unsafe { pool.assume_init() } as usize as u64))
    }

    /// Headers before CUDA 13 name no managed pools.
    #[cfg(not(feature = "cuda-13000"))]
    fn mem_pool_create_managed(
        &self,
        _ctx: ContextHandle,
        _preferred: Option<MemLocation>,
    ) -> Result<MemPoolHandle, DriverError> {
        Err(
            DriverError::from_kind("cuMemPoolCreate", crate::ErrorKind::NotSupported).with_detail(
                "emm was built against CUDA headers older than 13.0, which have no managed \
                 memory pools; build driver-sys with its `cuda-13000` feature",
            ),
        )
    }

    /// [cuMemPoolSetAttribute](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html)
    fn mem_pool_reset_high_water(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        use sys::CUmemPool_attribute as A;
        for attr in [
            A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
            A::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
        ] {
            let mut zero: u64 = 0;
            // SAFETY: both attributes take a cuuint64_t, which `zero` is (the driver accepts
            // only 0 for them).
            check("cuMemPoolSetAttribute", unsafe {
                sys::cuMemPoolSetAttribute(
                    pool.0 as usize as sys::CUmemoryPool,
                    attr,
                    (&raw mut zero).cast::<c_void>(),
                )
            })?;
        }
        Ok(())
    }

    /// [cuMemAllocFromPoolAsync](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html)
    fn mem_alloc_from_pool_async(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<DevicePtr, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is a valid place; the driver validates the pool and stream handles.
        check("cuMemAllocFromPoolAsync", unsafe {
            sys::cuMemAllocFromPoolAsync(
                &raw mut ptr,
                bytes,
                pool.0 as usize as sys::CUmemoryPool,
                stream.0 as usize as sys::CUstream,
            )
        })?;
        Ok(DevicePtr(ptr))
    }

    /// [cuMemFreeAsync](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html)
    unsafe fn mem_free_async(
        &self,
        ctx: ContextHandle,
        ptr: DevicePtr,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the caller frees a pool allocation once, ordered on `stream` (trait contract).
        counted(check("cuMemFreeAsync", unsafe {
            sys::cuMemFreeAsync(ptr.0, stream.0 as usize as sys::CUstream)
        }))
    }

    /// [cuMemPoolExportToShareableHandle](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html)
    #[cfg(unix)]
    fn mem_pool_export_fd(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
    ) -> Result<OwnedFd, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let mut fd: i32 = -1;
        // SAFETY: for POSIX file descriptors the driver writes one int through the handle
        // pointer, and `fd` is that int; the driver validates the pool handle.
        check("cuMemPoolExportToShareableHandle", unsafe {
            sys::cuMemPoolExportToShareableHandle(
                (&raw mut fd).cast::<c_void>(),
                pool.0 as usize as sys::CUmemoryPool,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        // SAFETY: the call succeeded and wrote `fd`, opened for the caller.
        unsafe { exported_fd("cuMemPoolExportToShareableHandle", fd) }
    }

    /// [cuMemPoolImportFromShareableHandle](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html)
    #[cfg(unix)]
    fn mem_pool_import_fd(
        &self,
        ctx: ContextHandle,
        fd: BorrowedFd<'_>,
    ) -> Result<MemPoolHandle, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let mut pool = MaybeUninit::<sys::CUmemoryPool>::uninit();
        // SAFETY: for POSIX file descriptors the handle argument is the descriptor's value
        // itself; `fd` is open for the whole call; `pool` is a valid place for one handle.
        check("cuMemPoolImportFromShareableHandle", unsafe {
            sys::cuMemPoolImportFromShareableHandle(
                pool.as_mut_ptr(),
                fd.as_raw_fd() as usize as *mut c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        // SAFETY: the call succeeded and wrote `pool`.
        Ok(MemPoolHandle(unsafe { pool.assume_init() } as usize as u64))
    }

    /// [cuMemPoolExportPointer](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html)
    fn mem_pool_export_pointer(
        &self,
        ctx: ContextHandle,
        ptr: DevicePtr,
    ) -> Result<PoolPtrExportData, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let mut data = sys::CUmemPoolPtrExportData { reserved: [0; 64] };
        // SAFETY: `data` is a valid place for the 64 bytes; the driver validates `ptr`.
        check("cuMemPoolExportPointer", unsafe {
            sys::cuMemPoolExportPointer(&raw mut data, ptr.0)
        })?;
        Ok(PoolPtrExportData(data.reserved))
    }

    /// [cuMemPoolImportPointer](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html)
    fn mem_pool_import_pointer(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
        data: &PoolPtrExportData,
    ) -> Result<DevicePtr, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let mut raw = sys::CUmemPoolPtrExportData { reserved: data.0 };
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` and `raw` are valid for the call; the export data is plain bytes the
        // driver validates, as it does the pool handle.
        check("cuMemPoolImportPointer", unsafe {
            sys::cuMemPoolImportPointer(
                &raw mut ptr,
                pool.0 as usize as sys::CUmemoryPool,
                &raw mut raw,
            )
        })?;
        Ok(DevicePtr(ptr))
    }

    /// [cuMemPoolGetAccess](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html)
    fn mem_pool_can_access(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
        dev: DeviceOrdinal,
    ) -> Result<bool, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let mut location = device_location(dev);
        // Read as a plain integer: the driver may answer a value the enum does not list.
        let mut flags: u32 = 0;
        // SAFETY: `CUmemAccess_flags` is a 32-bit C enum, so `flags` is a valid place for it;
        // `location` is initialised; the driver validates the pool handle.
        check("cuMemPoolGetAccess", unsafe {
            sys::cuMemPoolGetAccess(
                (&raw mut flags).cast::<sys::CUmemAccess_flags>(),
                pool.0 as usize as sys::CUmemoryPool,
                &raw mut location,
            )
        })?;
        Ok(flags == sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE as u32)
    }

    /// [cuMemPoolSetAccess](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html)
    fn mem_pool_grant_access(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
        dev: DeviceOrdinal,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let desc = read_write_access(dev);
        // SAFETY: one initialised descriptor, alive for the call; the driver validates the
        // pool handle and the device.
        check("cuMemPoolSetAccess", unsafe {
            sys::cuMemPoolSetAccess(pool.0 as usize as sys::CUmemoryPool, &raw const desc, 1)
        })
    }

    /// [cuMemGetAllocationGranularity](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html)
    fn mem_vmm_granularity(&self, dev: DeviceOrdinal) -> Result<usize, DriverError> {
        let prop = device_memory_prop(dev);
        let mut granularity = 0usize;
        // SAFETY: `prop` is initialised and alive for the call; the driver writes one size_t.
        check("cuMemGetAllocationGranularity", unsafe {
            sys::cuMemGetAllocationGranularity(
                &raw mut granularity,
                &raw const prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        })?;
        Ok(granularity)
    }

    /// [cuMemAddressReserve](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html)
    fn mem_address_reserve(
        &self,
        ctx: ContextHandle,
        size: usize,
    ) -> Result<DevicePtr, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: the driver writes one address; alignment 0 asks for the default, address 0
        // for any.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&raw mut ptr, size, 0, 0, 0)
        })?;
        Ok(DevicePtr(ptr))
    }

    /// [cuMemAddressFree](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html)
    unsafe fn mem_address_free(
        &self,
        ctx: ContextHandle,
        ptr: DevicePtr,
        size: usize,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the caller vouches the range is a whole reservation with nothing mapped.
        check("cuMemAddressFree", unsafe {
            sys::cuMemAddressFree(ptr.0, size)
        })
    }

    /// [cuMemCreate](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html)
    fn mem_create(
        &self,
        ctx: ContextHandle,
        dev: DeviceOrdinal,
        size: usize,
        shareable: bool,
    ) -> Result<PhysHandle, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let mut prop = device_memory_prop(dev);
        if shareable {
            prop.requestedHandleTypes =
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        }
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: `prop` is initialised and alive for the call; the driver writes one handle.
        check("cuMemCreate", unsafe {
            sys::cuMemCreate(&raw mut handle, size, &raw const prop, 0)
        })?;
        Ok(PhysHandle(handle))
    }

    /// [cuMemExportToShareableHandle](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html)
    #[cfg(unix)]
    fn mem_export_fd(
        &self,
        ctx: ContextHandle,
        handle: PhysHandle,
    ) -> Result<OwnedFd, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let mut fd: i32 = -1;
        // SAFETY: for POSIX file descriptors the driver writes one int through the handle
        // pointer, and `fd` is that int; the driver validates the allocation handle.
        check("cuMemExportToShareableHandle", unsafe {
            sys::cuMemExportToShareableHandle(
                (&raw mut fd).cast::<c_void>(),
                handle.0,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        // SAFETY: the call succeeded and wrote `fd`, opened for the caller.
        unsafe { exported_fd("cuMemExportToShareableHandle", fd) }
    }

    /// [cuMemImportFromShareableHandle](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html)
    #[cfg(unix)]
    fn mem_import_fd(
        &self,
        ctx: ContextHandle,
        fd: BorrowedFd<'_>,
    ) -> Result<PhysHandle, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: for POSIX file descriptors the handle argument is the descriptor's value
        // itself; `fd` is open for the whole call; the driver writes one handle.
        check("cuMemImportFromShareableHandle", unsafe {
            sys::cuMemImportFromShareableHandle(
                &raw mut handle,
                fd.as_raw_fd() as usize as *mut c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })?;
        Ok(PhysHandle(handle))
    }

    /// [cuMemRelease](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html)
    unsafe fn mem_release(
        &self,
        ctx: ContextHandle,
        handle: PhysHandle,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the caller vouches the handle came from `mem_create` and is released once.
        check("cuMemRelease", unsafe { sys::cuMemRelease(handle.0) })
    }

    /// [cuMemMap](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html)
    unsafe fn mem_map(
        &self,
        ctx: ContextHandle,
        ptr: DevicePtr,
        size: usize,
        handle: PhysHandle,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the caller vouches the range lies in its reservation with nothing mapped;
        // the driver checks the handle and the sizes.
        check("cuMemMap", unsafe {
            sys::cuMemMap(ptr.0, size, 0, handle.0, 0)
        })
    }

    /// [cuMemSetAccess](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html)
    fn mem_set_access(
        &self,
        ctx: ContextHandle,
        ptr: DevicePtr,
        size: usize,
        dev: DeviceOrdinal,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let desc = read_write_access(dev);
        // SAFETY: one initialised descriptor, alive for the call; the driver checks that the
        // range is mapped.
        check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(ptr.0, size, &raw const desc, 1)
        })
    }

    /// [cuMemUnmap](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html)
    unsafe fn mem_unmap(
        &self,
        ctx: ContextHandle,
        ptr: DevicePtr,
        size: usize,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the caller vouches no work uses the range.
        check("cuMemUnmap", unsafe { sys::cuMemUnmap(ptr.0, size) })
    }
}

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
