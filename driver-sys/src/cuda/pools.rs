//! [`CudaDriver`](super::CudaDriver)'s calls of one area: stream-ordered pools: creation, attributes, allocation on streams, export and import.

use super::*;

impl Calls<'_> {
    /// [cuDeviceGetDefaultMemPool](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html)
    pub(super) fn device_default_mem_pool(
        &self,
        dev: DeviceOrdinal,
    ) -> Result<MemPoolHandle, DriverError> {
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
    pub(super) fn mem_pool_create_limited(
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
    pub(super) unsafe fn mem_pool_destroy(
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
    pub(super) fn mem_pool_set_release_threshold(
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
    pub(super) fn mem_pool_trim_to(
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
    pub(super) fn mem_pool_usage(
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
    pub(super) fn mem_pool_create_managed(
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
    pub(super) fn mem_pool_create_managed(
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
    pub(super) fn mem_pool_reset_high_water(
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
    pub(super) fn mem_alloc_from_pool_async(
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
    pub(super) unsafe fn mem_free_async(
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
    pub(super) fn mem_pool_export_fd(
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
    pub(super) fn mem_pool_import_fd(
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
    pub(super) fn mem_pool_export_pointer(
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
    pub(super) fn mem_pool_import_pointer(
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
    pub(super) fn mem_pool_can_access(
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
    pub(super) fn mem_pool_grant_access(
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
}
