//! [`CudaDriver`](super::CudaDriver)'s calls of one area: initialisation, devices, primary contexts, peer access and modules.

use super::*;

impl Calls<'_> {
    /// [cuInit](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__INITIALIZE.html)
    pub(super) fn init(&self) -> Result<(), DriverError> {
        result::init().map_err(err("cuInit"))
    }

    /// [cuDeviceGetCount](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html)
    pub(super) fn device_count(&self) -> Result<u32, DriverError> {
        let n = result::device::get_count().map_err(err("cuDeviceGetCount"))?;
        Ok(u32::try_from(n).unwrap_or(0))
    }

    /// [cuDeviceTotalMem](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html)
    pub(super) fn device_total_mem(&self, dev: DeviceOrdinal) -> Result<usize, DriverError> {
        let device = cu_device(dev)?;
        // SAFETY: `device` came from cuDeviceGet.
        unsafe { result::device::total_mem(device) }.map_err(err("cuDeviceTotalMem"))
    }

    /// [cuDeviceGetAttribute](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html)
    pub(super) fn device_attribute(
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
    pub(super) fn primary_ctx_retain(
        &self,
        dev: DeviceOrdinal,
    ) -> Result<ContextHandle, DriverError> {
        let device = cu_device(dev)?;
        // SAFETY: `device` came from cuDeviceGet; the caller releases what it retains.
        let ctx = unsafe { result::primary_ctx::retain(device) }
            .map_err(err("cuDevicePrimaryCtxRetain"))?;
        Ok(ContextHandle(ctx as usize as u64))
    }

    /// [cuDevicePrimaryCtxRelease](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__PRIMARY__CTX.html)
    pub(super) unsafe fn primary_ctx_release(&self, dev: DeviceOrdinal) -> Result<(), DriverError> {
        let device = cu_device(dev)?;
        // SAFETY: the caller matches this release with an earlier retain (trait contract).
        unsafe { result::primary_ctx::release(device) }.map_err(err("cuDevicePrimaryCtxRelease"))
    }

    /// [cuDevicePrimaryCtxReset](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__PRIMARY__CTX.html)
    /// (no `result` wrapper in cudarc).
    pub(super) unsafe fn primary_ctx_reset(&self, dev: DeviceOrdinal) -> Result<(), DriverError> {
        let device = cu_device(dev)?;
        // SAFETY: the caller guarantees nothing of the context is used again (trait contract).
        check("cuDevicePrimaryCtxReset", unsafe {
            sys::cuDevicePrimaryCtxReset_v2(device)
        })
    }

    /// [cuModuleLoadData](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MODULE.html)
    pub(super) fn module_load_data(
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
    pub(super) unsafe fn module_unload(
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

    /// [cuCtxEnablePeerAccess](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__PEER__ACCESS.html)
    /// (no `result` wrapper in cudarc).
    pub(super) fn ctx_enable_peer_access(
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
    pub(super) fn device_can_access_peer(
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
}
