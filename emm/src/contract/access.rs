//! The driver as a manager and the layers above reach it: [`ManagerContext`]'s guarded calls.
//!
//! Each call enters the context's [`ContextLiveness`](crate::memory::liveness::ContextLiveness)
//! first (so a device reset waits for it, and a call after a reset is refused with
//! [`EmmError::Stale`]), names its context, and turns the driver's error into an [`EmmError`]
//! that says which operation failed on which device.
#![allow(unsafe_code)]

use driver_sys::{DeviceOrdinal, DevicePtr, DriverError, IpcMemHandle, MemPoolHandle};

use crate::contract::factory::ManagerContext;
use crate::contract::ipc::{DeviceIdentity, identity_of};
use crate::error::EmmError;
use crate::memory::liveness::LiveGuard;
use crate::memory::pointer::MemoryPointer;

impl ManagerContext {
    /// Gives device `dev` read-write access to `pool` unless it has it already
    /// (`cuMemPoolGetAccess`, then `cuMemPoolSetAccess`). The caller holds the liveness.
    pub fn ensure_pool_access(
        &self,
        pool: MemPoolHandle,
        dev: DeviceOrdinal,
    ) -> Result<(), DriverError> {
        if self.driver.mem_pool_can_access(self.context, pool, dev)? {
            return Ok(());
        }
        self.driver.mem_pool_grant_access(self.context, pool, dev)
    }

    /// Readies `pool`, just created in this context, for emm's use: with `grant`, this
    /// context's device is given access (a pool in host memory needs it); the release
    /// threshold goes to its maximum, so freed memory stays cached in the pool. On an error the
    /// pool is destroyed and the error returned. The caller holds the liveness.
    ///
    /// # Safety
    ///
    /// `pool` was created by the caller just now and handed to no one: on an error it is
    /// destroyed here.
    pub(crate) unsafe fn adopt_new_pool(
        &self,
        pool: MemPoolHandle,
        grant: bool,
    ) -> Result<MemPoolHandle, DriverError> {
        let ready = if grant {
            self.ensure_pool_access(pool, self.device)
        } else {
            Ok(())
        }
        .and_then(|()| {
            self.driver
                .mem_pool_set_release_threshold(self.context, pool, u64::MAX)
        });
        if let Err(e) = ready {
            // SAFETY: the caller's contract: created just now, handed to no one.
            let _ = unsafe { self.driver.mem_pool_destroy(self.context, pool) };
            return Err(e);
        }
        Ok(pool)
    }

    /// The error for `what` on a context whose device was reset.
    pub fn stale(&self, what: &'static str) -> EmmError {
        EmmError::Stale {
            what,
            device: self.device,
            reason: "the device was reset",
        }
    }

    /// A driver error of `what` on this context's device, as an [`EmmError`]; a plugin maps
    /// its driver calls' errors with it (`.map_err(|e| cx.driver_error("memalloc", e))?`).
    pub fn driver_error(&self, what: &'static str, source: DriverError) -> EmmError {
        EmmError::driver(what, self.device, source)
    }

    /// Enters the context for a driver call: the guard keeps a device reset from destroying
    /// the context until it drops. Refused with [`EmmError::Stale`] after a reset.
    pub fn enter(&self, what: &'static str) -> Result<LiveGuard<'_>, EmmError> {
        self.liveness.enter().ok_or_else(|| self.stale(what))
    }

    /// Refuses `what` with [`EmmError::Stale`] once the device was reset.
    pub fn ensure_alive(&self, what: &'static str) -> Result<(), EmmError> {
        if self.liveness.is_alive() {
            Ok(())
        } else {
            Err(self.stale(what))
        }
    }

    /// The PCI identity of the context's device (Numba's `get_device_identity`).
    pub fn device_identity(&self) -> Result<DeviceIdentity, EmmError> {
        identity_of(&*self.driver, self.device)
    }

    /// Checks that `memory` may be used for `what` here: the context is alive, the memory is
    /// of this context, and its owner did not free it in a reset.
    pub(crate) fn check_usable(
        &self,
        what: &'static str,
        memory: &MemoryPointer,
    ) -> Result<(), EmmError> {
        self.ensure_alive(what)?;
        if memory.device() != self.device || memory.context() != self.context {
            return Err(EmmError::WrongContext {
                what,
                device: self.device,
                owner: memory.device(),
            });
        }
        if !memory.is_live() {
            return Err(EmmError::Stale {
                what,
                device: self.device,
                reason: "the memory was freed by a reset of its manager",
            });
        }
        Ok(())
    }

    /// Checks that a copy of `len` bytes at the start of `memory` is allowed, and enters the
    /// context for it.
    pub(crate) fn enter_copy(
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
        self.enter(what)
    }

    /// Copies `src` to the start of `dst`, synchronously.
    pub(crate) fn copy_to_device(&self, dst: &MemoryPointer, src: &[u8]) -> Result<(), EmmError> {
        const WHAT: &str = "copy to device";
        let _live = self.enter_copy(WHAT, dst, src.len())?;
        // SAFETY:
        // - `enter_copy` checked that `dst` is a live pointer of this context whose first
        //   `src.len()` bytes lie inside its allocation; `dst` keeps the allocation alive while
        //   borrowed here;
        // - `_live` keeps the context from being destroyed during the call.
        unsafe { self.driver.memcpy_htod(self.context, dst.device_ptr(), src) }
            .map_err(|e| self.driver_error(WHAT, e))
    }

    /// Copies the first `dst.len()` bytes of `src` into `dst`, synchronously.
    pub(crate) fn copy_to_host(&self, dst: &mut [u8], src: &MemoryPointer) -> Result<(), EmmError> {
        const WHAT: &str = "copy to host";
        let _live = self.enter_copy(WHAT, src, dst.len())?;
        // SAFETY:
        // - `enter_copy` checked that `src` is a live pointer of this context whose first
        //   `dst.len()` bytes lie inside its allocation;
        // - `dst` is an exclusive borrow of host memory, so nothing else touches it;
        // - `_live` keeps the context from being destroyed during the call.
        unsafe { self.driver.memcpy_dtoh(self.context, dst, src.device_ptr()) }
            .map_err(|e| self.driver_error(WHAT, e))
    }

    /// Copies `bytes` from `src` (any device memory this process can reach, such as an IPC
    /// mapping on another device) to `dst`, which lies at the start of `dst_mem`.
    pub(crate) fn copy_device_to_device(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
        dst_mem: &MemoryPointer,
    ) -> Result<(), EmmError> {
        const WHAT: &str = "device to device copy";
        let _live = self.enter_copy(WHAT, dst_mem, bytes)?;
        // SAFETY:
        // - `enter_copy` checked that `dst_mem` (at `dst`) is live memory of this context with
        //   room for `bytes`;
        // - `src .. src + bytes` is a live mapping the caller holds open for the call;
        // - the ranges belong to different allocations, so they do not overlap.
        unsafe { self.driver.memcpy_dtod(self.context, dst, src, bytes) }
            .map_err(|e| self.driver_error(WHAT, e))
    }

    /// Copies `dst.len()` bytes at `src`, a mapping the caller holds open for the call, to the
    /// host.
    pub(crate) fn read_mapping(&self, dst: &mut [u8], src: DevicePtr) -> Result<(), EmmError> {
        const WHAT: &str = "device to host copy";
        let _live = self.enter(WHAT)?;
        // SAFETY: `dst` is an exclusive borrow of `dst.len()` writable bytes; the caller holds
        // the mapping `src .. src + dst.len()` open for the call, and nothing writes it here.
        unsafe { self.driver.memcpy_dtoh(self.context, dst, src) }
            .map_err(|e| self.driver_error(WHAT, e))
    }

    /// Maps another process's `cuIpcGetMemHandle` memory into this context.
    pub(crate) fn ipc_open(&self, handle: &IpcMemHandle) -> Result<DevicePtr, EmmError> {
        let _live = self.enter("open IPC handle")?;
        self.driver
            .ipc_open_mem_handle(self.context, handle)
            .map_err(|e| self.driver_error("open IPC handle", e))
    }

    /// The size of the mapping (or allocation) at `base`, as the driver knows it.
    pub(crate) fn mapping_size(&self, base: DevicePtr) -> Result<usize, EmmError> {
        let _live = self.enter("open IPC handle")?;
        self.driver
            .mem_get_address_range(self.context, base)
            .map(|(_, size)| size)
            .map_err(|e| self.driver_error("open IPC handle", e))
    }

    /// Unmaps a mapping [`ipc_open`](Self::ipc_open) made; nothing to do once the context is
    /// gone (its mappings went with it).
    pub(crate) fn ipc_close(&self, base: DevicePtr) -> Result<(), EmmError> {
        let Some(_live) = self.liveness.enter() else {
            return Ok(());
        };
        // SAFETY: `base` is a mapping this context opened, closed once by its `IpcHandle`, whose
        // pointers turned stale before this call; `_live` keeps the context alive.
        unsafe { self.driver.ipc_close_mem_handle(self.context, base) }
            .map_err(|e| self.driver_error("close IPC handle", e))
    }
}
