//! [`PinnedMemoryResource`]: stream-ordered page-locked host memory from a driver pool in host
//! memory, over a [`DeviceMemoryResource`]'s machinery.

// Raw-handle calls (allocations on a stream handle, mapped host memory); each block says why
// it holds.
#![allow(unsafe_code)]

use driver_sys::{
    DeviceAttribute, HostPtr, MemLocation, MemPoolHandle, MemPoolUsage, StreamHandle,
};

use super::DeviceMemoryResource;
use super::device::DeviceMemoryResourceOptions;
use crate::contract::factory::ManagerContext;
use crate::contract::ipc::IpcHandle;
#[cfg(unix)]
use crate::contract::pool_export::PoolExport;
use crate::contract::pool_export::PoolId;
use crate::error::EmmError;
use crate::memory::host::{HostMemory, MappedMemory};
use crate::memory::pointer::{MemoryPointer, OrderedOn};
use crate::objects::Stream;

/// How [`Context::pinned_memory_resource`](crate::Context::pinned_memory_resource) makes its
/// pool (cuda.core's `PinnedMemoryResourceOptions`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PinnedMemoryResourceOptions {
    /// The most bytes the pool may reserve; 0: no limit.
    pub max_size: usize,
    /// Whether the pool's memory can be exported to other processes. The pool is then made at
    /// a host NUMA node (`numa_id`, or the device's `host_numa_id` attribute).
    pub ipc_enabled: bool,
    /// The host NUMA node to make the pool on (`CU_MEM_LOCATION_TYPE_HOST_NUMA`); `None`:
    /// host memory at large (`CU_MEM_LOCATION_TYPE_HOST`), unless `ipc_enabled`.
    pub numa_id: Option<i32>,
}

/// Stream-ordered page-locked host memory from a driver pool in host memory (cuda.core's
/// `PinnedMemoryResource`, `cuMemPoolCreate` at `CU_MEM_LOCATION_TYPE_HOST` or `HOST_NUMA`):
/// each buffer is one address for the host and the device, a [`HostMemory::Mapped`] whose
/// host side reads and writes and whose device side is a stream-ordered [`MemoryPointer`].
/// Drivers without host memory pools (before CUDA 12.6) refuse it; the legacy pinned memory
/// (`Context::memhostalloc`, `cuMemHostAlloc`) works everywhere.
#[derive(Clone, Debug)]
pub struct PinnedMemoryResource {
    inner: DeviceMemoryResource,
    numa_id: Option<i32>,
}

impl PinnedMemoryResource {
    pub(crate) fn create(
        cx: &ManagerContext,
        options: PinnedMemoryResourceOptions,
    ) -> Result<PinnedMemoryResource, EmmError> {
        const WHAT: &str = "pinned_memory_resource";
        let attr = |a| {
            cx.driver
                .device_attribute(cx.device, a)
                .map_err(|e| cx.driver_error(WHAT, e))
        };
        let numa_id = match (options.numa_id, options.ipc_enabled) {
            (Some(n), _) => Some(n),
            (None, true) => Some(attr(DeviceAttribute::HostNumaId)?),
            (None, false) => None,
        };
        let (capability, name) = if numa_id.is_some() {
            (
                DeviceAttribute::HostNumaMemoryPoolsSupported,
                "host NUMA memory pools",
            )
        } else {
            (
                DeviceAttribute::HostMemoryPoolsSupported,
                "host memory pools",
            )
        };
        if attr(capability)? != 1 {
            return Err(EmmError::DeviceCannot {
                what: WHAT,
                device: cx.device,
                advice: format!(
                    "its driver has no {name}; use the legacy pinned memory \
                     (Context::memhostalloc, cuMemHostAlloc), which every driver has"
                ),
            });
        }
        if numa_id.is_some_and(|n| n < 0) {
            return Err(EmmError::DeviceCannot {
                what: WHAT,
                device: cx.device,
                advice: "the device has no host NUMA node (host_numa_id is -1), which an \
                         IPC-enabled pinned pool needs; give numa_id, or leave ipc_enabled off"
                    .into(),
            });
        }
        let location = numa_id.map_or(MemLocation::Host, MemLocation::HostNuma);
        let device_options = DeviceMemoryResourceOptions {
            max_size: options.max_size,
            ipc_enabled: options.ipc_enabled,
        };
        let inner = DeviceMemoryResource::create_at(cx, location, device_options, WHAT)?;
        Ok(PinnedMemoryResource { inner, numa_id })
    }

    /// `size` bytes of page-locked host memory on `stream`: usable by work queued on `stream`
    /// from now on, and by the host once that work is done (synchronise first); freed on
    /// `stream` when the last handle to it drops.
    pub fn allocate(&self, size: usize, stream: &Stream) -> Result<HostMemory, EmmError> {
        let mem = self.inner.allocate(size, stream)?;
        Ok(Self::host_memory(mem))
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
    ) -> Result<HostMemory, EmmError> {
        // SAFETY: the caller's contract, passed on.
        let mem = unsafe { self.inner.allocate_on_raw(size, stream) }?;
        Ok(Self::host_memory(mem))
    }

    /// A host pool's buffer: one address for the host and the device.
    fn host_memory(mem: MemoryPointer) -> HostMemory {
        let host = HostPtr(mem.device_ptr().0 as usize);
        // SAFETY: a pinned pool's buffer has one address on the host and the device, and `mem`
        // keeps it alive.
        HostMemory::Mapped(unsafe { MappedMemory::new(host, mem) })
    }

    /// Frees `memory` on `stream` once its last handle is gone (this one).
    pub fn deallocate(&self, memory: HostMemory, stream: &Stream) -> Result<(), EmmError> {
        self.inner.check_stream(stream, "deallocate")?;
        self.deallocate_on(memory, stream)
    }

    /// As [`deallocate`](Self::deallocate), on a stream given as any [`OrderedOn`].
    pub fn deallocate_on(
        &self,
        memory: HostMemory,
        stream: &(impl OrderedOn + ?Sized),
    ) -> Result<(), EmmError> {
        let HostMemory::Mapped(mapped) = memory else {
            return Err(EmmError::InvalidArgument {
                what: "PinnedMemoryResource::deallocate",
                reason: "this memory is not a buffer of a pinned memory resource".into(),
            });
        };
        let device = mapped.device().clone();
        drop(mapped);
        self.inner.deallocate_on(device, stream)
    }

    /// The host NUMA node of the pool, if it was made on one.
    pub fn numa_id(&self) -> Option<i32> {
        self.numa_id
    }

    /// The pool's figures, as [`DeviceMemoryResource::attributes`].
    pub fn attributes(&self) -> Result<MemPoolUsage, EmmError> {
        self.inner.attributes()
    }

    /// Starts the high-water marks again from the current figures.
    pub fn reset_high_water(&self) -> Result<(), EmmError> {
        self.inner.reset_high_water()
    }

    /// Whether emm made the pool (always, for a pinned resource).
    pub fn is_handle_owned(&self) -> bool {
        self.inner.is_handle_owned()
    }

    /// Whether the pool's memory can be exported to other processes.
    pub fn is_ipc_enabled(&self) -> bool {
        self.inner.is_ipc_enabled()
    }

    /// The driver's pool handle.
    pub fn handle(&self) -> MemPoolHandle {
        self.inner.handle()
    }

    /// The pool as a [`PoolExport`] for other processes, as
    /// [`DeviceMemoryResource::allocation_handle`].
    #[cfg(unix)]
    pub fn allocation_handle(&self) -> Result<PoolExport, EmmError> {
        self.inner.allocation_handle()
    }

    /// An IPC handle for `memory` (a buffer of this resource), which opens in a process that
    /// imported the pool ([`allocation_handle`](Self::allocation_handle)), as
    /// [`DeviceMemoryResource::get_ipc_handle`]: the buffer's stream is synchronised first.
    /// The importer opens it as device memory ([`IpcHandle::open`]), which work on its streams
    /// and copies use.
    pub fn get_ipc_handle(&self, memory: &HostMemory) -> Result<IpcHandle, EmmError> {
        let HostMemory::Mapped(mapped) = memory else {
            return Err(EmmError::InvalidArgument {
                what: "memory passed to PinnedMemoryResource::get_ipc_handle",
                reason: "this memory is not a buffer of a pinned memory resource; export \
                         memory it allocated"
                    .into(),
            });
        };
        self.inner.get_ipc_handle(mapped.device())
    }

    /// The pool's name across processes, for an IPC-enabled resource.
    pub fn pool_id(&self) -> Option<PoolId> {
        self.inner.pool_id()
    }

    /// Closes the resource, as [`DeviceMemoryResource::close`].
    pub fn close(&self) -> Result<(), EmmError> {
        self.inner.close()
    }
}
