//! [`DefaultManager`]: emm's own manager (Numba's `NumbaCUDAMemoryManager`), device path.

use std::sync::Arc;

use driver_sys::{ErrorKind, HostPtr};

use crate::host::{HostMemory, HostOwner};
use crate::ipc::IpcHandle;
use crate::manager::{FnFactory, INTERFACE_VERSION, ManagerContext, MemoryManager};
use crate::pending::{DeferCleanup, PendingDeallocs};
use crate::pointer::Release;
use crate::tracker::DeviceTracker;
use crate::{EmmError, MemoryInfo, MemoryPointer};

/// The name the default manager is registered under.
pub const DEFAULT_MANAGER: &str = "default";

/// emm's default memory manager.
///
/// - `memalloc` calls `cuMemAlloc`; on out-of-memory it flushes its pending frees and retries
///   **once** (Numba's `_attempt_allocation`); inside `defer_cleanup` the flush does nothing and
///   the retry happens anyway.
/// - Frees are deferred through its [`PendingDeallocs`] queue, whose byte threshold is a share
///   of the device's total memory, captured at the first `initialize`.
/// - `reset` frees every live allocation, then flushes.
#[derive(Debug)]
pub struct DefaultManager {
    cx: ManagerContext,
    tracker: Arc<DeviceTracker>,
}

impl DefaultManager {
    /// The default manager for one context.
    pub fn new(cx: &ManagerContext) -> DefaultManager {
        let queue = Arc::new(cx.new_pending_deallocs());
        DefaultManager {
            cx: cx.clone(),
            tracker: Arc::new(DeviceTracker::new(queue)),
        }
    }

    /// The factory registered as `"default"`.
    pub fn factory() -> FnFactory {
        FnFactory::new(DEFAULT_MANAGER, |cx| Ok(Box::new(DefaultManager::new(cx))))
    }

    /// Number of allocations the manager holds that have not been released.
    pub fn live_allocations(&self) -> usize {
        self.tracker.live()
    }

    fn stale(&self, what: &'static str) -> EmmError {
        EmmError::Stale {
            what,
            device: self.cx.device,
            reason: "the device was reset",
        }
    }

    fn not_built(&self, operation: &'static str) -> EmmError {
        EmmError::NotSupported {
            operation,
            manager: DEFAULT_MANAGER.into(),
            advice: "this emm release allocates device memory only; allocate and pin host \
                     memory with the CUDA driver directly (cuMemHostAlloc, cuMemHostRegister) \
                     for now",
        }
    }
}

impl MemoryManager for DefaultManager {
    fn memalloc(&self, bytes: usize) -> Result<MemoryPointer, EmmError> {
        let cx = &self.cx;
        let _live = cx.liveness.enter().ok_or_else(|| self.stale("memalloc"))?;
        let base = match cx.driver.mem_alloc(cx.context, bytes) {
            Ok(ptr) => ptr,
            Err(e) if e.kind() == ErrorKind::OutOfMemory => {
                let queue = self.tracker.queue();
                tracing::warn!(
                    device = %cx.device,
                    bytes,
                    pending = queue.len(),
                    deferred = queue.is_disabled(),
                    "out of memory; flushing pending deallocations and retrying once"
                );
                let flushed = queue.flush()?;
                match cx.driver.mem_alloc(cx.context, bytes) {
                    Ok(ptr) => ptr,
                    Err(e) if e.kind() == ErrorKind::OutOfMemory => {
                        let info = cx.driver.mem_get_info(cx.context).unwrap_or_default();
                        return Err(EmmError::OutOfMemory {
                            device: cx.device,
                            requested: bytes,
                            free: info.free,
                            total: info.total,
                            flushed,
                            source: e,
                        });
                    }
                    Err(e) => return Err(EmmError::driver("memalloc", cx.device, e)),
                }
            }
            Err(e) => return Err(EmmError::driver("memalloc", cx.device, e)),
        };
        let generation = self.tracker.record(base, bytes);
        tracing::debug!(device = %cx.device, bytes, ptr = %base, "device memory allocated");
        Ok(MemoryPointer::from_release(
            cx.device,
            cx.context,
            base,
            bytes,
            Release::Tracked {
                tracker: Arc::clone(&self.tracker),
                generation,
            },
        ))
    }

    fn memhostalloc(
        &self,
        _bytes: usize,
        _mapped: bool,
        _portable: bool,
        _wc: bool,
    ) -> Result<HostMemory, EmmError> {
        Err(self.not_built("memhostalloc"))
    }

    fn mempin(
        &self,
        _owner: HostOwner,
        _ptr: HostPtr,
        _size: usize,
        _mapped: bool,
    ) -> Result<HostMemory, EmmError> {
        Err(self.not_built("mempin"))
    }

    fn initialize(&self) -> Result<(), EmmError> {
        let queue = self.tracker.queue();
        if queue.capacity() == 0 {
            let total = self.get_memory_info()?.total;
            if queue.set_capacity_once(total) {
                tracing::debug!(device = %self.cx.device, capacity = total, max_pending_bytes = queue.max_pending_bytes(), "default manager initialized");
            }
        }
        Ok(())
    }

    fn get_ipc_handle(&self, _memory: &MemoryPointer) -> Result<IpcHandle, EmmError> {
        Err(self.not_built("get_ipc_handle"))
    }

    fn get_memory_info(&self) -> Result<MemoryInfo, EmmError> {
        let cx = &self.cx;
        let _live = cx
            .liveness
            .enter()
            .ok_or_else(|| self.stale("get_memory_info"))?;
        let info = cx
            .driver
            .mem_get_info(cx.context)
            .map_err(|e| EmmError::driver("get_memory_info", cx.device, e))?;
        Ok(MemoryInfo {
            free: info.free,
            total: info.total,
        })
    }

    fn reset(&self) -> Result<(), EmmError> {
        let live = self.tracker.live();
        tracing::info!(device = %self.cx.device, live_allocations = live, pending = self.tracker.queue().len(), "resetting the default manager");
        self.tracker.reset().map(|_| ())
    }

    fn defer_cleanup(&self) -> Result<DeferCleanup, EmmError> {
        Ok(self.tracker.queue().defer_cleanup())
    }

    fn interface_version(&self) -> u32 {
        INTERFACE_VERSION
    }

    fn deallocations(&self) -> Option<&Arc<PendingDeallocs>> {
        Some(self.tracker.queue())
    }
}
