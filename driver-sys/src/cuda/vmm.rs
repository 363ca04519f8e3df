//! [`CudaDriver`](super::CudaDriver)'s calls of one area: virtual memory management: reservations, physical memory, mappings and access, shareable handles.

use super::*;

impl Calls<'_> {
    /// [cuMemGetAllocationGranularity](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html)
    pub(super) fn mem_vmm_granularity(&self, dev: DeviceOrdinal) -> Result<usize, DriverError> {
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
    pub(super) fn mem_address_reserve(
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
    pub(super) unsafe fn mem_address_free(
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
    pub(super) fn mem_create(
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
    pub(super) fn mem_export_fd(
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
    pub(super) fn mem_import_fd(
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
    pub(super) unsafe fn mem_release(
        &self,
        ctx: ContextHandle,
        handle: PhysHandle,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the caller vouches the handle came from `mem_create` and is released once.
        check("cuMemRelease", unsafe { sys::cuMemRelease(handle.0) })
    }

    /// [cuMemMap](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html)
    pub(super) unsafe fn mem_map(
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
    pub(super) fn mem_set_access(
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
    pub(super) unsafe fn mem_unmap(
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
