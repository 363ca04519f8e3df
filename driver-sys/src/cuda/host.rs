//! [`CudaDriver`](super::CudaDriver)'s calls of one area: pinned host memory: allocation, registration, device pointers.

use super::*;

impl Calls<'_> {
    /// [cuMemHostAlloc](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
    pub(super) fn mem_host_alloc(
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
    pub(super) unsafe fn mem_free_host(
        &self,
        ctx: ContextHandle,
        ptr: HostPtr,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the caller guarantees `ptr` came from cuMemHostAlloc, is freed once and is not
        // used afterwards (trait contract).
        counted(unsafe { result::free_host(ptr.0 as *mut c_void) }.map_err(err("cuMemFreeHost")))
    }

    /// [cuMemHostRegister](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
    /// (no `result` wrapper in cudarc).
    pub(super) unsafe fn mem_host_register(
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
    pub(super) unsafe fn mem_host_unregister(
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
    pub(super) fn mem_host_get_device_pointer(
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
}
