//! The [`Driver`] trait. Its contract is partly `unsafe`: frees, copies and context resets
//! carry `# Safety` conditions the caller must meet.
#![allow(unsafe_code)]

use std::fmt;

use crate::{ContextHandle, DeviceOrdinal, DevicePtr, DriverError};

/// Device attributes emm reads (`CUdevice_attribute`). The discriminants are the driver's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum DeviceAttribute {
    /// `CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY`: 1 if host memory can be mapped into the
    /// device address space.
    CanMapHostMemory = 19,
    /// `CU_DEVICE_ATTRIBUTE_PCI_BUS_ID`.
    PciBusId = 33,
    /// `CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID`.
    PciDeviceId = 34,
    /// `CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID`.
    PciDomainId = 50,
}

/// Free and total device memory as `cuMemGetInfo` reports them, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct MemInfo {
    /// Bytes the driver can still hand out.
    pub free: usize,
    /// Bytes of device memory in all.
    pub total: usize,
}

/// One method per CUDA driver call emm makes. Object safe: emm holds an `Arc<dyn Driver>`.
///
/// Implementations are thin: they validate nothing beyond what the CUDA driver validates, keep
/// no bookkeeping a caller could rely on, and return the error the CUDA driver would return
/// (the simulator is held to that by a conformance suite run on both).
///
/// # Life cycle
///
/// 1. [`init`](Driver::init) once (repeating it is harmless).
/// 2. [`primary_ctx_retain`](Driver::primary_ctx_retain) per device; the handle it returns
///    names the context in every later call.
/// 3. Allocate, copy, free within that context.
/// 4. [`primary_ctx_release`](Driver::primary_ctx_release) once per retain; optionally
///    [`primary_ctx_reset`](Driver::primary_ctx_reset), which destroys everything the context
///    still owns.
pub trait Driver: Send + Sync + fmt::Debug {
    /// A short name for messages: `"cuda"` or `"sim"`.
    fn name(&self) -> &'static str;

    /// `cuInit(0)`.
    fn init(&self) -> Result<(), DriverError>;

    /// `cuDeviceGetCount`.
    fn device_count(&self) -> Result<u32, DriverError>;

    /// `cuDeviceTotalMem`: the device's memory in bytes.
    fn device_total_mem(&self, dev: DeviceOrdinal) -> Result<usize, DriverError>;

    /// `cuDeviceGetAttribute`.
    fn device_attribute(
        &self,
        dev: DeviceOrdinal,
        attr: DeviceAttribute,
    ) -> Result<i32, DriverError>;

    /// `cuDevicePrimaryCtxRetain`: the device's primary context, its reference count raised.
    fn primary_ctx_retain(&self, dev: DeviceOrdinal) -> Result<ContextHandle, DriverError>;

    /// `cuDevicePrimaryCtxRelease`: lowers the primary context's reference count.
    ///
    /// # Safety
    ///
    /// - Each call matches an earlier successful [`primary_ctx_retain`](Driver::primary_ctx_retain)
    ///   of the same device by this caller.
    /// - When the count reaches zero the context is destroyed with everything it owns: the
    ///   caller must no longer use memory of that context.
    unsafe fn primary_ctx_release(&self, dev: DeviceOrdinal) -> Result<(), DriverError>;

    /// `cuDevicePrimaryCtxReset`: destroys the primary context's allocations and state.
    ///
    /// # Safety
    ///
    /// - Every allocation, mapping and handle of that context is gone afterwards, in this
    ///   process, whoever holds it: the caller guarantees none is used again.
    unsafe fn primary_ctx_reset(&self, dev: DeviceOrdinal) -> Result<(), DriverError>;

    /// `cuMemAlloc`: `bytes` of device memory in `ctx`.
    fn mem_alloc(&self, ctx: ContextHandle, bytes: usize) -> Result<DevicePtr, DriverError>;

    /// `cuMemFree`.
    ///
    /// # Safety
    ///
    /// - `ptr` was returned by [`mem_alloc`](Driver::mem_alloc) in `ctx` and is freed once.
    /// - Nothing uses the memory afterwards; no work on the device still reads or writes it.
    unsafe fn mem_free(&self, ctx: ContextHandle, ptr: DevicePtr) -> Result<(), DriverError>;

    /// `cuMemGetInfo` in `ctx`.
    fn mem_get_info(&self, ctx: ContextHandle) -> Result<MemInfo, DriverError>;

    /// `cuMemGetAddressRange`: base and size of the allocation that contains `ptr`.
    fn mem_get_address_range(
        &self,
        ctx: ContextHandle,
        ptr: DevicePtr,
    ) -> Result<(DevicePtr, usize), DriverError>;

    /// `cuMemcpyHtoD`: copies `src` to device address `dst`, synchronously.
    ///
    /// # Safety
    ///
    /// - `dst .. dst + src.len()` lies inside one live allocation of `ctx`.
    /// - Nothing else reads or writes that range during the copy; if the range is host memory
    ///   mapped into the device, no Rust reference to it is alive.
    unsafe fn memcpy_htod(
        &self,
        ctx: ContextHandle,
        dst: DevicePtr,
        src: &[u8],
    ) -> Result<(), DriverError>;

    /// `cuMemcpyDtoH`: copies `dst.len()` bytes from device address `src`, synchronously.
    ///
    /// # Safety
    ///
    /// - `src .. src + dst.len()` lies inside one live allocation of `ctx`.
    /// - Nothing writes that range during the copy.
    unsafe fn memcpy_dtoh(
        &self,
        ctx: ContextHandle,
        dst: &mut [u8],
        src: DevicePtr,
    ) -> Result<(), DriverError>;
}
