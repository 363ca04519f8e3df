//! [`CudaDriver`](super::CudaDriver)'s calls of one area: device and managed memory: allocation, frees, copies and sets, synchronous and on streams.

use super::*;

impl Calls<'_> {
    /// [cuMemAlloc](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
    pub(super) fn mem_alloc(
        &self,
        ctx: ContextHandle,
        bytes: usize,
    ) -> Result<DevicePtr, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the context is current; the new allocation is owned by the caller.
        let ptr = unsafe { result::malloc_sync(bytes) }.map_err(err("cuMemAlloc"))?;
        Ok(DevicePtr(ptr))
    }

    /// [cuMemAllocManaged](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
    pub(super) fn mem_alloc_managed(
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
    pub(super) unsafe fn mem_free(
        &self,
        ctx: ContextHandle,
        ptr: DevicePtr,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the caller guarantees `ptr` is a live allocation of `ctx`, freed once and no
        // longer used (trait contract); the driver rejects unknown pointers with an error.
        counted(unsafe { result::free_sync(ptr.0) }.map_err(err("cuMemFree")))
    }

    /// [cuMemGetInfo](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
    pub(super) fn mem_get_info(&self, ctx: ContextHandle) -> Result<MemInfo, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let (free, total) = result::mem_get_info().map_err(err("cuMemGetInfo"))?;
        Ok(MemInfo { free, total })
    }

    /// [cuMemGetAddressRange](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
    /// (no `result` wrapper in cudarc).
    pub(super) fn mem_get_address_range(
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
    pub(super) unsafe fn memcpy_htod(
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
    pub(super) unsafe fn memcpy_dtod(
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
    pub(super) unsafe fn memset_d8(
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

    /// [cuMemcpyHtoDAsync](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
    pub(super) unsafe fn memcpy_htod_async(
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
    pub(super) unsafe fn memcpy_dtoh_async(
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
    pub(super) unsafe fn memcpy_dtod_async(
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
    pub(super) unsafe fn memset_d8_async(
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

    /// [cuMemcpyDtoH](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
    pub(super) unsafe fn memcpy_dtoh(
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
}
