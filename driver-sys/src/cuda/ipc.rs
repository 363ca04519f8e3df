//! [`CudaDriver`](super::CudaDriver)'s calls of one area: IPC handles of device memory.

use super::*;

impl Calls<'_> {
    /// [cuIpcGetMemHandle](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html)
    /// (no `result` wrapper in cudarc).
    pub(super) fn ipc_get_mem_handle(
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
    pub(super) fn ipc_open_mem_handle(
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
    pub(super) unsafe fn ipc_close_mem_handle(
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
}
