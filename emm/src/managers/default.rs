//! emm's default manager (Numba's `NumbaCUDAMemoryManager`): [`HostOnly`] over
//! [`DriverAllocator`].
//!
//! - `memalloc` calls `cuMemAlloc`; on out-of-memory it flushes its pending frees and retries
//!   **once**; inside `defer_cleanup` the flush does nothing and the retry happens anyway.
//! - Device and host frees share one queue whose byte threshold is a share of the device's
//!   total memory, captured at the first `initialize`.
//! - Pinned and mapped host memory, pinning, IPC handles: from the [`HostLayer`].
//! - `reset` frees every live allocation, then flushes; `defer_cleanup` suspends the queue.
//! - **Streams.** `cuMemFree` synchronises the device before it frees, so memory from
//!   `memalloc` is never reused under running work; the deferral only batches these
//!   synchronising frees. `memalloc_on` ([`StreamOrdering::Fenced`]) is `cuMemAlloc` too (the
//!   memory is usable on every stream at once); when its last pointer drops, an event goes on
//!   the stream it is freed on and on every recorded stream, and the `cuMemFree` is queued
//!   only once they completed: checked without waiting at each allocation, waited for when
//!   the device is out of memory. A free never waits for a stream held up by other work.
#![allow(unsafe_code)]

use driver_sys::{DevicePtr, StreamHandle};

use crate::contract::factory::{FnFactory, ManagerContext};
use crate::contract::manager::StreamOrdering;
use crate::contract::snapshot::HeldSegment;
use crate::error::EmmError;
use crate::host::{AllocationKind, DeviceAllocator, DeviceHoldings, HostLayer, HostOnly};
use crate::memory::pointer::MemoryPointer;

/// The name the default manager is registered under.
pub const DEFAULT_MANAGER: &str = "default";

/// Device memory straight from the driver (`cuMemAlloc`), tracked by the host layer so that its
/// frees are deferred and `reset` frees it.
#[derive(Debug, Default, Clone, Copy)]
pub struct DriverAllocator;

/// emm's default memory manager.
pub type DefaultManager = HostOnly<DriverAllocator>;

impl HostOnly<DriverAllocator> {
    /// The default manager of context `cx`.
    pub fn default_manager(cx: &ManagerContext) -> DefaultManager {
        HostOnly::new(cx, DriverAllocator)
    }

    /// The factory registered as `"default"`.
    pub fn factory() -> FnFactory {
        FnFactory::new(DEFAULT_MANAGER, |cx| {
            Ok(Box::new(DefaultManager::default_manager(cx)))
        })
    }

    /// Number of tracked allocations not released yet.
    pub fn live_allocations(&self) -> usize {
        self.host().live_allocations()
    }
}

impl DriverAllocator {
    /// `cuMemAlloc` of `bytes` for `what`, with the host layer's out-of-memory retry.
    #[inline(always)]
    fn mem_alloc(
        host: &HostLayer,
        what: &'static str,
        bytes: usize,
    ) -> Result<DevicePtr, EmmError> {
        if bytes == 0 {
            return Err(EmmError::ZeroSize { what });
        }
        let cx = host.context();
        host.attempt_allocation(what, AllocationKind::Device, bytes, || {
            cx.driver.mem_alloc(cx.context, bytes)
        })
    }
}

impl DeviceAllocator for DriverAllocator {
    fn memalloc(&self, host: &HostLayer, bytes: usize) -> Result<MemoryPointer, EmmError> {
        let base = Self::mem_alloc(host, "memalloc", bytes)?;
        // SAFETY: `base` was just returned by `cuMemAlloc` for `bytes` bytes, and is tracked once
        // here.
        Ok(unsafe { host.track_device_allocation(base, bytes) })
    }

    fn memalloc_on(
        &self,
        host: &HostLayer,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<MemoryPointer, EmmError> {
        host.context()
            .refuse_captured_allocation(DEFAULT_MANAGER, stream)?;
        let base = Self::mem_alloc(host, "memalloc_on", bytes)?;
        // SAFETY: `base` was just returned by `cuMemAlloc` for `bytes` bytes, and is tracked once
        // here.
        Ok(unsafe { host.track_device_allocation_on(base, bytes, stream) })
    }

    fn stream_ordering(&self) -> StreamOrdering {
        StreamOrdering::Fenced
    }

    fn holdings(&self) -> Option<&dyn DeviceHoldings> {
        Some(self)
    }

    fn initialize(&self, host: &HostLayer) -> Result<(), EmmError> {
        let queue = host.deallocations();
        if queue.capacity() == 0 {
            let total = self.get_memory_info(host)?.total;
            if queue.set_capacity_once(total) {
                tracing::debug!(device = %host.context().device, capacity = total, max_pending_bytes = queue.max_pending_bytes(), "default manager initialized");
            }
        }
        Ok(())
    }
}

/// Nothing held back: each allocation is the driver's; the segments are the host layer's
/// table of them.
impl DeviceHoldings for DriverAllocator {
    fn trim(&self, _host: &HostLayer) -> Result<usize, EmmError> {
        Ok(0)
    }

    fn segments(&self, host: &HostLayer) -> Option<Vec<HeldSegment>> {
        Some(host.tracked_device_segments())
    }
}
