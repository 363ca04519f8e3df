//! [`ManagedMemoryResource`]: stream-ordered managed memory from a managed-memory pool, over a
//! [`DeviceMemoryResource`]'s machinery.

// Raw-handle calls (allocations on a stream handle, mapped host memory); each block says why
// it holds.
#![allow(unsafe_code)]

use driver_sys::{DeviceAttribute, MemLocation, MemPoolHandle, MemPoolUsage, StreamHandle};

use super::DeviceMemoryResource;
use super::device::DeviceMemoryResourceOptions;
use crate::contract::factory::ManagerContext;
use crate::error::EmmError;
use crate::memory::host::ManagedMemory;
use crate::memory::pointer::OrderedOn;
use crate::objects::Stream;

/// How [`Context::managed_memory_resource`](crate::Context::managed_memory_resource) makes its
/// pool (cuda.core's `ManagedMemoryResourceOptions`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ManagedMemoryResourceOptions {
    /// Where the driver prefers to keep the memory: a device, host memory, or a host NUMA
    /// node; `None`: no preference (the driver migrates on demand).
    pub preferred_location: Option<MemLocation>,
}

/// Stream-ordered managed memory from a managed-memory pool (cuda.core's
/// `ManagedMemoryResource`; `cuMemPoolCreate` with `CU_MEM_ALLOCATION_TYPE_MANAGED`, CUDA 13
/// on): one address for the host and every device, migrated on demand. Where the driver has
/// no managed pools it is refused, naming `memallocmanaged` (`cuMemAllocManaged`), which every
/// driver with managed memory has. Managed pools are not exported (cuda.core neither).
#[derive(Clone, Debug)]
pub struct ManagedMemoryResource {
    inner: DeviceMemoryResource,
    preferred: Option<MemLocation>,
}

impl ManagedMemoryResource {
    pub(crate) fn create(
        cx: &ManagerContext,
        options: ManagedMemoryResourceOptions,
    ) -> Result<ManagedMemoryResource, EmmError> {
        const WHAT: &str = "managed_memory_resource";
        let _live = cx.enter(WHAT)?;
        let cannot = |advice: String| EmmError::DeviceCannot {
            what: WHAT,
            device: cx.device,
            advice,
        };
        let managed = cx
            .driver
            .device_attribute(cx.device, DeviceAttribute::ManagedMemory)
            .map_err(|e| cx.driver_error(WHAT, e))?;
        if managed != 1 {
            return Err(cannot(
                "the device has no managed memory; use device memory and copies".into(),
            ));
        }
        let pool = match cx
            .driver
            .mem_pool_create_managed(cx.context, options.preferred_location)
        {
            Ok(pool) => pool,
            Err(e) if e.kind() == driver_sys::ErrorKind::NotSupported => {
                return Err(cannot(format!(
                    "its driver has no managed memory pools ({e}); use memallocmanaged \
                     (cuMemAllocManaged), which is not stream-ordered"
                )));
            }
            Err(e) => return Err(cx.driver_error(WHAT, e)),
        };
        // SAFETY: created just above, handed to no one.
        let pool =
            unsafe { cx.adopt_new_pool(pool, false) }.map_err(|e| cx.driver_error(WHAT, e))?;
        let inner = DeviceMemoryResource::over(
            cx,
            pool,
            true,
            DeviceMemoryResourceOptions::default(),
            None,
        );
        Ok(ManagedMemoryResource {
            inner,
            preferred: options.preferred_location,
        })
    }

    /// `size` bytes of managed memory on `stream`, attached globally: usable by work queued on
    /// `stream` from now on, by the host once that work is done; freed on `stream` when the
    /// last handle drops.
    pub fn allocate(&self, size: usize, stream: &Stream) -> Result<ManagedMemory, EmmError> {
        let mem = self.inner.allocate(size, stream)?;
        // SAFETY: a block of this resource's pool, which lies in managed memory.
        Ok(unsafe { ManagedMemory::new(mem, true) })
    }

    /// As [`allocate`](Self::allocate), on a stream known only by its handle.
    ///
    /// # Safety
    ///
    /// As [`DeviceMemoryResource::allocate_on_raw`]: `stream` is a stream of this context
    /// (or an implicit one) that outlives the buffer.
    pub unsafe fn allocate_on_raw(
        &self,
        size: usize,
        stream: StreamHandle,
    ) -> Result<ManagedMemory, EmmError> {
        // SAFETY: the caller's contract, passed on.
        let mem = unsafe { self.inner.allocate_on_raw(size, stream) }?;
        // SAFETY: a block of this resource's pool, which lies in managed memory.
        Ok(unsafe { ManagedMemory::new(mem, true) })
    }

    /// Frees `memory` on `stream` once its last handle is gone (this one).
    pub fn deallocate(&self, memory: ManagedMemory, stream: &Stream) -> Result<(), EmmError> {
        let device = memory.device().clone();
        drop(memory);
        self.inner.deallocate(device, stream)
    }

    /// As [`deallocate`](Self::deallocate), on a stream given as any [`OrderedOn`] (another
    /// library's stream by its handle, for one).
    pub fn deallocate_on(
        &self,
        memory: ManagedMemory,
        stream: &(impl OrderedOn + ?Sized),
    ) -> Result<(), EmmError> {
        let device = memory.device().clone();
        drop(memory);
        self.inner.deallocate_on(device, stream)
    }

    /// Where the driver prefers to keep the memory (`None`: no preference).
    pub fn preferred_location(&self) -> Option<MemLocation> {
        self.preferred
    }

    /// The pool's figures, as [`DeviceMemoryResource::attributes`].
    pub fn attributes(&self) -> Result<MemPoolUsage, EmmError> {
        self.inner.attributes()
    }

    /// Whether emm made the pool (always, for a managed resource).
    pub fn is_handle_owned(&self) -> bool {
        self.inner.is_handle_owned()
    }

    /// The driver's pool handle.
    pub fn handle(&self) -> MemPoolHandle {
        self.inner.handle()
    }

    /// Closes the resource, as [`DeviceMemoryResource::close`].
    pub fn close(&self) -> Result<(), EmmError> {
        self.inner.close()
    }
}
