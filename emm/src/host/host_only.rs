//! A device-only plugin made complete: [`DeviceAllocator`] and [`HostOnly`].

use std::fmt;
use std::sync::Arc;

use driver_sys::{HostPtr, StreamHandle};

use crate::contract::capabilities::{Exports, Holdings, Records, Sleeper};
use crate::contract::factory::ManagerContext;
use crate::contract::info::{FreeSpace, MemoryInfo, PoolReport, PoolStats};
use crate::contract::ipc::IpcHandle;
use crate::contract::manager::{HistoryRecord, INTERFACE_VERSION, MemoryManager, StreamOrdering};
use crate::contract::mapped_export::MappedExport;
use crate::contract::pool_export::PoolExport;
use crate::contract::sleep::{SleepBlock, SleepOptions, SleepReport, WakeReport};
use crate::contract::snapshot::HeldSegment;
use crate::error::EmmError;
use crate::host::HostLayer;
use crate::memory::host::{HostAllocFlags, HostMemory, HostOwner, ManagedMemory};
use crate::memory::pending::{DeferCleanup, PendingDeallocs};
use crate::memory::pointer::MemoryPointer;

/// The device half of a manager: what a plugin that manages device memory (a host runtime's
/// own allocator) implements. Wrapped in [`HostOnly`], it becomes a complete
/// [`MemoryManager`]: the host layer adds pinned and mapped memory and runs its own `reset` and
/// `defer_cleanup` steps, which the plugin therefore cannot forget.
///
/// Each method gets the [`HostLayer`] for the context, its driver and its queue. Driver errors
/// become [`EmmError`]s with [`ManagerContext::driver_error`], so `?` works:
///
/// ```
/// use emm::{EmmError, IpcHandle, MemoryInfo, MemoryPointer};
/// use emm::plugin::{DeviceAllocator, HostLayer};
///
/// /// Device memory straight from `cuMemAlloc`, tracked by the host layer.
/// #[derive(Debug)]
/// struct Plain;
///
/// impl DeviceAllocator for Plain {
///     fn memalloc(&self, host: &HostLayer, bytes: usize) -> Result<MemoryPointer, EmmError> {
///         let cx = host.context();
///         let _live = cx.enter("memalloc")?; // refused once the device was reset
///         let base = cx
///             .driver
///             .mem_alloc(cx.context, bytes)
///             .map_err(|e| cx.driver_error("memalloc", e))?;
///         // SAFETY: `base` was just allocated by `cuMemAlloc` for `bytes` bytes.
///         Ok(unsafe { host.track_device_allocation(base, bytes) })
///     }
///
///     fn initialize(&self, _host: &HostLayer) -> Result<(), EmmError> {
///         Ok(())
///     }
///     // Memory info and IPC handles: the defaults (the driver's figures, cuIpcGetMemHandle).
/// }
///
/// // Selected like any manager: `emm::plugin::HostOnly::new(cx, Plain)` in a factory.
/// let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
/// let runtime = emm::Runtime::builder(sim)
///     .ignore_env()
///     .memory_manager(emm::contract::FnFactory::new("plain", |cx| {
///         Ok(Box::new(emm::plugin::HostOnly::new(cx, Plain)))
///     }))
///     .build()?;
/// let ctx = runtime.context(0)?;
/// let mem = ctx.to_device(&[7u8; 64])?;
/// let mut back = [0u8; 64];
/// ctx.copy_to_host(&mut back, &mem)?;
/// assert_eq!(back, [7u8; 64]);
/// # Ok::<(), EmmError>(())
/// ```
pub trait DeviceAllocator: Send + Sync + fmt::Debug {
    /// Allocates `bytes` of device memory.
    fn memalloc(&self, host: &HostLayer, bytes: usize) -> Result<MemoryPointer, EmmError>;

    /// Allocates `bytes` of device memory for work on `stream`
    /// ([`MemoryManager::memalloc_on`]). The default refuses; an allocator over `cuMemAlloc`
    /// can hand out [`HostLayer::track_device_allocation_on`]'s pointers.
    fn memalloc_on(
        &self,
        host: &HostLayer,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<MemoryPointer, EmmError> {
        let _ = (host, bytes, stream);
        Err(EmmError::no_stream_ordering(std::any::type_name_of_val(
            self,
        )))
    }

    /// How the allocator orders memory allocated on streams.
    fn stream_ordering(&self) -> StreamOrdering {
        StreamOrdering::Unsupported
    }

    /// Prepares for use; called on every use of the context, idempotent.
    fn initialize(&self, host: &HostLayer) -> Result<(), EmmError>;

    /// Free and total memory as the allocator sees it: by default the device's, as the driver
    /// reports them (`cuMemGetInfo`).
    fn get_memory_info(&self, host: &HostLayer) -> Result<MemoryInfo, EmmError> {
        let cx = host.context();
        let _live = cx.enter("get_memory_info")?;
        let info = cx
            .driver
            .mem_get_info(cx.context)
            .map_err(|e| cx.driver_error("get_memory_info", e))?;
        Ok(MemoryInfo {
            free: info.free,
            total: info.total,
        })
    }

    /// An IPC handle for `memory`: by default [`HostLayer::ipc_handle`]'s, which exports
    /// `cuMemAlloc` memory (`cuIpcGetMemHandle`); an allocator whose memory is of another kind
    /// exports it its own way or refuses.
    fn get_ipc_handle(
        &self,
        host: &HostLayer,
        memory: &MemoryPointer,
    ) -> Result<IpcHandle, EmmError> {
        host.ipc_handle(memory)
    }

    /// Frees the allocator's own memory. Runs after the host layer's reset.
    fn reset(&self, host: &HostLayer) -> Result<(), EmmError> {
        let _ = host;
        Ok(())
    }

    /// The allocator's own deferral, joined to the host layer's guard.
    fn defer_cleanup(&self, host: &HostLayer) -> Result<DeferCleanup, EmmError> {
        let _ = host;
        Ok(DeferCleanup::nothing())
    }

    /// The interface version the allocator implements.
    fn interface_version(&self) -> u32 {
        INTERFACE_VERSION
    }

    /// The allocator's pool figures and `trim` ([`DeviceHoldings`]), if it holds memory back.
    fn holdings(&self) -> Option<&dyn DeviceHoldings> {
        None
    }

    /// The allocator's own history ([`DeviceRecords`]), if it keeps one.
    fn records(&self) -> Option<&dyn DeviceRecords> {
        None
    }

    /// Pool exports and memory shared as file descriptors ([`DeviceExports`]), if the
    /// allocator's memory allows either.
    fn exports(&self) -> Option<&dyn DeviceExports> {
        None
    }

    /// Sleep and wake ([`DeviceSleeper`]), if the allocator's memory is physical memory mapped
    /// into reserved addresses.
    fn sleeper(&self) -> Option<&dyn DeviceSleeper> {
        None
    }
}

/// [`Holdings`] for a [`DeviceAllocator`]: what it holds of device memory; the [`HostOnly`]
/// manager adds the host layer's.
pub trait DeviceHoldings: Send + Sync {
    /// Releases device memory the allocator holds but does not use; returns the bytes released
    /// (or queued for release, inside `defer_cleanup`).
    fn trim(&self, host: &HostLayer) -> Result<usize, EmmError>;

    /// What the allocator's pool holds.
    fn pool_stats(&self) -> Option<PoolStats> {
        None
    }

    /// The pool's free space, block by block, if it can tell.
    fn free_space(&self) -> Option<FreeSpace> {
        None
    }

    /// The segments the allocator holds, with their blocks that are not in use
    /// ([`Holdings::segments`]); `None` where it cannot tell (the default).
    fn segments(&self, host: &HostLayer) -> Option<Vec<HeldSegment>> {
        let _ = host;
        None
    }
}

/// [`Records`] for a [`DeviceAllocator`]: its own history of allocations and frees.
pub trait DeviceRecords: Send + Sync {
    /// The history ([`Records::history`]).
    fn history(&self, host: &HostLayer) -> Option<HistoryRecord>;
}

/// [`Exports`] for a [`DeviceAllocator`]. Each method refuses by default.
pub trait DeviceExports: Send + Sync {
    /// Exports the allocator's IPC-enabled stream-ordered pool ([`Exports::export_pool`]).
    fn export_pool(&self, host: &HostLayer) -> Result<PoolExport, EmmError> {
        let _ = host;
        Err(EmmError::no_pool_export(std::any::type_name_of_val(self)))
    }

    /// Allocates memory to share with other processes ([`Exports::memalloc_shared`]).
    fn memalloc_shared(&self, host: &HostLayer, bytes: usize) -> Result<MemoryPointer, EmmError> {
        let _ = (host, bytes);
        Err(EmmError::no_shared_allocation(std::any::type_name_of_val(
            self,
        )))
    }

    /// Exports `memory` as the physical memory behind it ([`Exports::export_mapped`]).
    fn export_mapped(
        &self,
        host: &HostLayer,
        memory: &MemoryPointer,
    ) -> Result<MappedExport, EmmError> {
        let _ = (host, memory);
        Err(EmmError::no_mapped_export(std::any::type_name_of_val(self)))
    }
}

/// [`Sleeper`] for a [`DeviceAllocator`].
pub trait DeviceSleeper: Send + Sync {
    /// Releases the physical memory behind the allocator's memory, keeping its addresses
    /// ([`Sleeper::sleep`]).
    fn sleep(
        &self,
        host: &HostLayer,
        blocks: &[SleepBlock],
        options: &SleepOptions,
    ) -> Result<SleepReport, EmmError>;

    /// Maps the memory [`sleep`](Self::sleep) released again ([`Sleeper::wake`]).
    fn wake(&self, host: &HostLayer) -> Result<WakeReport, EmmError>;
}

/// A [`MemoryManager`] made of the [`HostLayer`] and a [`DeviceAllocator`] (Numba: a subclass of
/// `HostOnlyCUDAMemoryManager`, with the `super()` calls made for it).
#[derive(Debug)]
pub struct HostOnly<D> {
    host: HostLayer,
    device: D,
}

impl<D: DeviceAllocator> HostOnly<D> {
    /// The manager of context `cx`, with `device` managing its device memory.
    pub fn new(cx: &ManagerContext, device: D) -> HostOnly<D> {
        HostOnly {
            host: HostLayer::new(cx),
            device,
        }
    }

    /// A manager from a host layer and the device allocator built for it (an allocator that
    /// needs the host layer's queue is built after the layer).
    pub fn from_parts(host: HostLayer, device: D) -> HostOnly<D> {
        HostOnly { host, device }
    }

    /// The host layer.
    pub fn host(&self) -> &HostLayer {
        &self.host
    }

    /// The device allocator.
    pub fn device(&self) -> &D {
        &self.device
    }
}

impl<D: DeviceAllocator> MemoryManager for HostOnly<D> {
    // One hop every allocation of a host-layer manager crosses: kept inlinable into the
    // context's call wherever the manager's code lands.
    #[inline]
    fn memalloc(&self, bytes: usize) -> Result<MemoryPointer, EmmError> {
        self.device.memalloc(&self.host, bytes)
    }

    fn memalloc_on(&self, bytes: usize, stream: StreamHandle) -> Result<MemoryPointer, EmmError> {
        self.device.memalloc_on(&self.host, bytes, stream)
    }

    fn stream_ordering(&self) -> StreamOrdering {
        self.device.stream_ordering()
    }

    fn memhostalloc(&self, bytes: usize, flags: HostAllocFlags) -> Result<HostMemory, EmmError> {
        self.host.memhostalloc(bytes, flags)
    }

    fn memallocmanaged(
        &self,
        bytes: usize,
        attach_global: bool,
    ) -> Result<ManagedMemory, EmmError> {
        self.host.memallocmanaged(bytes, attach_global)
    }

    unsafe fn mempin(
        &self,
        owner: HostOwner,
        ptr: HostPtr,
        size: usize,
        mapped: bool,
    ) -> Result<HostMemory, EmmError> {
        // SAFETY: forwarded with this method's own contract.
        unsafe { self.host.mempin(owner, ptr, size, mapped) }
    }

    fn initialize(&self) -> Result<(), EmmError> {
        self.device.initialize(&self.host)
    }

    fn get_ipc_handle(&self, memory: &MemoryPointer) -> Result<IpcHandle, EmmError> {
        self.device.get_ipc_handle(&self.host, memory)
    }

    fn get_memory_info(&self) -> Result<MemoryInfo, EmmError> {
        self.device.get_memory_info(&self.host)
    }

    fn reset(&self) -> Result<(), EmmError> {
        let host = self.host.reset();
        let device = self.device.reset(&self.host);
        host.and(device)
    }

    fn defer_cleanup(&self) -> Result<DeferCleanup, EmmError> {
        let host = self.host.defer_cleanup();
        Ok(host.join(self.device.defer_cleanup(&self.host)?))
    }

    fn interface_version(&self) -> u32 {
        self.device.interface_version()
    }

    fn deallocations(&self) -> Option<&Arc<PendingDeallocs>> {
        Some(self.host.deallocations())
    }

    fn holdings(&self) -> Option<&dyn Holdings> {
        // The host layer holds pinned memory back whatever the allocator does.
        Some(self)
    }

    fn records(&self) -> Option<&dyn Records> {
        self.device.records().map(|_| self as &dyn Records)
    }

    fn exports(&self) -> Option<&dyn Exports> {
        self.device.exports().map(|_| self as &dyn Exports)
    }

    fn sleeper(&self) -> Option<&dyn Sleeper> {
        self.device.sleeper().map(|_| self as &dyn Sleeper)
    }
}

impl<D: DeviceAllocator> Holdings for HostOnly<D> {
    fn trim(&self) -> Result<usize, EmmError> {
        let device = match self.device.holdings() {
            Some(device) => device.trim(&self.host)?,
            None => 0,
        };
        Ok(device + self.host.trim()?)
    }

    fn pool_stats(&self) -> PoolReport {
        PoolReport {
            device: self.device.holdings().and_then(|d| d.pool_stats()),
            pinned_host: self.host.pinned_pool_stats(),
        }
    }

    fn free_space(&self) -> Option<FreeSpace> {
        self.device.holdings()?.free_space()
    }

    fn segments(&self) -> Option<Vec<HeldSegment>> {
        let mut segments = self.device.holdings()?.segments(&self.host)?;
        segments.extend(self.host.queued_device_segments());
        Some(segments)
    }
}

impl<D: DeviceAllocator> Records for HostOnly<D> {
    fn history(&self) -> Option<HistoryRecord> {
        self.device.records()?.history(&self.host)
    }
}

/// Reached only where the allocator has the capability ([`MemoryManager::exports`]); the
/// refusals cover a caller that kept the reference across a change of mind.
impl<D: DeviceAllocator> Exports for HostOnly<D> {
    fn export_pool(&self) -> Result<PoolExport, EmmError> {
        match self.device.exports() {
            Some(device) => device.export_pool(&self.host),
            None => Err(EmmError::no_pool_export(std::any::type_name::<D>())),
        }
    }

    fn memalloc_shared(&self, bytes: usize) -> Result<MemoryPointer, EmmError> {
        match self.device.exports() {
            Some(device) => device.memalloc_shared(&self.host, bytes),
            None => Err(EmmError::no_shared_allocation(std::any::type_name::<D>())),
        }
    }

    fn export_mapped(&self, memory: &MemoryPointer) -> Result<MappedExport, EmmError> {
        match self.device.exports() {
            Some(device) => device.export_mapped(&self.host, memory),
            None => Err(EmmError::no_mapped_export(std::any::type_name::<D>())),
        }
    }
}

impl<D: DeviceAllocator> Sleeper for HostOnly<D> {
    fn sleep(
        &self,
        blocks: &[SleepBlock],
        options: &SleepOptions,
    ) -> Result<SleepReport, EmmError> {
        match self.device.sleeper() {
            Some(device) => device.sleep(&self.host, blocks, options),
            None => Err(EmmError::no_sleep("sleep", std::any::type_name::<D>())),
        }
    }

    fn wake(&self) -> Result<WakeReport, EmmError> {
        match self.device.sleeper() {
            Some(device) => device.wake(&self.host),
            None => Err(EmmError::no_sleep("wake", std::any::type_name::<D>())),
        }
    }
}
