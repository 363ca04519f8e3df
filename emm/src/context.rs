//! [`Context`]: one device's primary context and the memory manager that owns its memory.
#![allow(unsafe_code)]

use std::fmt;
use std::sync::Arc;

use driver_sys::{ContextHandle, DeviceOrdinal, DevicePtr, Driver};

use crate::liveness::{ContextLiveness, LiveGuard};
use crate::manager::MemoryManager;
use crate::pending::{DeferCleanup, PendingDeallocs};
use crate::{EmmError, MemoryInfo, MemoryPointer};

pub(crate) struct ContextInner {
    pub(crate) device: DeviceOrdinal,
    pub(crate) handle: ContextHandle,
    pub(crate) driver: Arc<dyn Driver>,
    pub(crate) manager: Box<dyn MemoryManager>,
    pub(crate) manager_name: String,
    pub(crate) liveness: Arc<ContextLiveness>,
}

/// A device's context: its primary CUDA context plus the one memory manager that owns all its
/// memory. Cheap to clone. Obtained from [`Runtime::context`](crate::Runtime::context), which
/// calls the manager's `initialize` on every use.
///
/// A `Context` that outlived a device reset refuses further work with
/// [`EmmError::Stale`]; get a fresh one from the runtime.
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("device", &self.inner.device)
            .field("handle", &self.inner.handle)
            .field("driver", &self.inner.driver.name())
            .field("manager", &self.inner.manager_name)
            .field("alive", &self.inner.liveness.is_alive())
            .finish()
    }
}

impl Context {
    /// The device.
    pub fn device(&self) -> DeviceOrdinal {
        self.inner.device
    }

    /// The CUDA context handle.
    pub fn handle(&self) -> ContextHandle {
        self.inner.handle
    }

    /// The memory manager that owns this context's memory.
    pub fn memory_manager(&self) -> &dyn MemoryManager {
        &*self.inner.manager
    }

    /// The registered name of the memory manager.
    pub fn memory_manager_name(&self) -> &str {
        &self.inner.manager_name
    }

    /// Whether the context is still usable (false after its device was reset).
    pub fn is_alive(&self) -> bool {
        self.inner.liveness.is_alive()
    }

    fn stale(&self, what: &'static str) -> EmmError {
        EmmError::Stale {
            what,
            device: self.inner.device,
            reason: "the device was reset",
        }
    }

    fn ensure_alive(&self, what: &'static str) -> Result<(), EmmError> {
        if self.is_alive() {
            Ok(())
        } else {
            Err(self.stale(what))
        }
    }

    /// Allocates `bytes` of device memory through the manager.
    pub fn memalloc(&self, bytes: usize) -> Result<MemoryPointer, EmmError> {
        self.ensure_alive("memalloc")?;
        self.inner.manager.memalloc(bytes)
    }

    /// Free and total memory, as the manager reports them.
    pub fn get_memory_info(&self) -> Result<MemoryInfo, EmmError> {
        self.ensure_alive("get_memory_info")?;
        self.inner.manager.get_memory_info()
    }

    /// Defers cleanup while the returned guard lives (the manager's guard).
    pub fn defer_cleanup(&self) -> Result<DeferCleanup, EmmError> {
        self.inner.manager.defer_cleanup()
    }

    /// The manager's deferred-deallocation queue, if it has one.
    pub fn deallocations(&self) -> Option<&Arc<PendingDeallocs>> {
        self.inner.manager.deallocations()
    }

    /// Frees everything the manager allocated in this context (Numba's `Context.reset`).
    /// Pointers that outlive it become stale; dropping them frees nothing twice.
    pub fn reset(&self) -> Result<(), EmmError> {
        tracing::info!(device = %self.inner.device, "context reset");
        self.inner.manager.reset()
    }

    /// Base and end address of the whole allocation that `memory` lies in, as the driver
    /// reports them (Numba's `device_extents`).
    pub fn device_extents(
        &self,
        memory: &MemoryPointer,
    ) -> Result<(DevicePtr, DevicePtr), EmmError> {
        self.check_usable("device_extents", memory)?;
        let _live = self
            .inner
            .liveness
            .enter()
            .ok_or_else(|| self.stale("device_extents"))?;
        let (base, size) = self
            .inner
            .driver
            .mem_get_address_range(self.inner.handle, memory.device_ptr())
            .map_err(|e| EmmError::driver("device_extents", self.inner.device, e))?;
        Ok((base, DevicePtr(base.0 + size as u64)))
    }

    /// Allocates device memory through the manager and copies `src` into it.
    pub fn to_device(&self, src: &[u8]) -> Result<MemoryPointer, EmmError> {
        let mem = self.memalloc(src.len())?;
        self.copy_to_device(&mem, src)?;
        Ok(mem)
    }

    /// Copies `src` to the start of `dst`, synchronously. `src` may be shorter than `dst`.
    pub fn copy_to_device(&self, dst: &MemoryPointer, src: &[u8]) -> Result<(), EmmError> {
        const WHAT: &str = "copy to device";
        let _live = self.enter_copy(WHAT, dst, src.len())?;
        // SAFETY:
        // - `enter_copy` checked that `dst` is a live pointer of this context whose first
        //   `src.len()` bytes lie inside its allocation; `dst` keeps the allocation alive while
        //   borrowed here;
        // - `_live` keeps the context from being destroyed during the call.
        unsafe {
            self.inner
                .driver
                .memcpy_htod(self.inner.handle, dst.device_ptr(), src)
        }
        .map_err(|e| EmmError::driver(WHAT, self.inner.device, e))
    }

    /// Copies the first `dst.len()` bytes of `src` into `dst`, synchronously.
    pub fn copy_to_host(&self, dst: &mut [u8], src: &MemoryPointer) -> Result<(), EmmError> {
        const WHAT: &str = "copy to host";
        let _live = self.enter_copy(WHAT, src, dst.len())?;
        // SAFETY:
        // - `enter_copy` checked that `src` is a live pointer of this context whose first
        //   `dst.len()` bytes lie inside its allocation;
        // - `dst` is an exclusive borrow of host memory, so nothing else touches it;
        // - `_live` keeps the context from being destroyed during the call.
        unsafe {
            self.inner
                .driver
                .memcpy_dtoh(self.inner.handle, dst, src.device_ptr())
        }
        .map_err(|e| EmmError::driver(WHAT, self.inner.device, e))
    }

    /// Checks that a copy of `len` bytes at the start of `memory` is allowed, and enters the
    /// context for it.
    fn enter_copy(
        &self,
        what: &'static str,
        memory: &MemoryPointer,
        len: usize,
    ) -> Result<LiveGuard<'_>, EmmError> {
        self.check_usable(what, memory)?;
        if len > memory.size() {
            return Err(EmmError::OutOfBounds {
                what,
                start: 0,
                end: len,
                size: memory.size(),
            });
        }
        self.inner.liveness.enter().ok_or_else(|| self.stale(what))
    }

    fn check_usable(&self, what: &'static str, memory: &MemoryPointer) -> Result<(), EmmError> {
        self.ensure_alive(what)?;
        if memory.device() != self.inner.device || memory.context() != self.inner.handle {
            return Err(EmmError::WrongContext {
                what,
                device: self.inner.device,
                owner: memory.device(),
            });
        }
        if !memory.is_live() {
            return Err(EmmError::Stale {
                what,
                device: self.inner.device,
                reason: "the memory was freed by a reset of its manager",
            });
        }
        Ok(())
    }
}
