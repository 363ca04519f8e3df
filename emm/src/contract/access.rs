//! The driver as a manager and the layers above reach it: [`ManagerContext`]'s guarded calls.
//!
//! Each call enters the context's [`ContextLiveness`](crate::memory::liveness::ContextLiveness)
//! first (so a device reset waits for it, and a call after a reset is refused with
//! [`EmmError::Stale`]), names its context, and turns the driver's error into an [`EmmError`]
//! that says which operation failed on which device.
#![allow(unsafe_code)]

use driver_sys::{
    DeviceOrdinal, DevicePtr, DriverError, ErrorKind, IpcMemHandle, MemPoolHandle, StreamHandle,
};

use crate::contract::factory::ManagerContext;
use crate::contract::ipc::{DeviceIdentity, IpcHandle, IpcMemory, identity_of};
use crate::contract::pool_export::PoolId;
use crate::error::EmmError;
use crate::memory::liveness::{LiveGuard, MemoryInUse};
use crate::memory::pointer::MemoryPointer;

impl ManagerContext {
    /// Relaxes the calling thread's capture mode until the guard drops: a manager's slow
    /// path (growth, reclaiming other streams' blocks, flushing) takes it, so that a global
    /// capture under way on this thread does not refuse those calls and invalidate itself.
    /// Calls that name a captured stream are refused all the same: check
    /// [`stream_is_captured`](Self::stream_is_captured) first.
    pub fn relax_capture(&self) -> RelaxedCapture<'_> {
        RelaxedCapture::enter(&*self.driver)
    }

    /// Whether `stream` is being captured into a graph (an invalidated capture counts),
    /// from `cuStreamGetCaptureInfo`, which every capture allows. The legacy default stream
    /// (the null handle or `CU_STREAM_LEGACY`) is never captured, as the driver refuses to
    /// capture it: no call asks.
    pub fn stream_is_captured(&self, stream: StreamHandle) -> Result<bool, DriverError> {
        if stream == StreamHandle::NULL || stream == StreamHandle::LEGACY {
            return Ok(false);
        }
        self.driver
            .stream_capture_status(self.context, stream)
            .map(|s| s != driver_sys::CaptureStatus::None)
    }

    /// Refuses `memalloc_on` of a captured stream for `manager`, whose allocation would make
    /// calls the capture forbids ([`EmmError::NotSupported`], naming graph pools).
    pub fn refuse_captured_allocation(
        &self,
        manager: &str,
        stream: StreamHandle,
    ) -> Result<(), EmmError> {
        match self.stream_is_captured(stream) {
            Ok(false) => Ok(()),
            Ok(true) => Err(EmmError::captured_stream(manager)),
            Err(e) => Err(self.driver_error("asking whether the stream is captured", e)),
        }
    }

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
            self.log_failed_undo("a new memory pool", unsafe {
                self.driver.mem_pool_destroy(self.context, pool)
            });
            return Err(e);
        }
        Ok(pool)
    }

    /// `cuMemAllocFromPoolAsync` of `bytes` from `pool` on `stream`. Out of memory, waits for
    /// `stream` and the legacy default stream (frees queued there keep their memory reserved
    /// until the pool sees them complete) and tries once more. The caller holds the liveness.
    pub(crate) fn alloc_from_pool(
        &self,
        pool: MemPoolHandle,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<DevicePtr, DriverError> {
        let alloc = || {
            self.driver
                .mem_alloc_from_pool_async(self.context, pool, bytes, stream)
        };
        match alloc() {
            Err(e) if e.kind() == ErrorKind::OutOfMemory => {
                tracing::warn!(device = %self.device, bytes, ?stream, "stream-ordered pool out of memory; waiting for its frees and retrying");
                self.events.retried();
                self.driver.stream_synchronize(self.context, stream)?;
                if stream != StreamHandle::NULL {
                    self.driver
                        .stream_synchronize(self.context, StreamHandle::NULL)?;
                }
                alloc()
            }
            other => other,
        }
    }

    /// Frees `live` (the allocations of `pool` still outstanding) on `stream`, waits for
    /// `stream`, and destroys `pool`, which then has nothing outstanding (a pool destroyed
    /// with frees in flight releases its memory only as they complete). Every step is tried;
    /// the first error is returned. The caller holds the liveness.
    ///
    /// # Safety
    ///
    /// `pool` was created by the caller, is destroyed once, and allocates nothing after this
    /// call; the pointers of `live` came from it, are freed once here, and are used by no one
    /// after.
    pub(crate) unsafe fn free_and_destroy_pool(
        &self,
        pool: MemPoolHandle,
        live: impl IntoIterator<Item = u64>,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        let mut first_error = None;
        for ptr in live {
            // SAFETY: the caller's contract: an outstanding allocation of `pool`, freed once.
            if let Err(e) = unsafe {
                self.driver
                    .mem_free_async(self.context, DevicePtr(ptr), stream)
            } {
                first_error.get_or_insert(e);
            }
        }
        if let Err(e) = self.driver.stream_synchronize(self.context, stream) {
            first_error.get_or_insert(e);
        }
        // SAFETY: the caller's contract: the caller's pool, destroyed once.
        let destroyed = unsafe { self.driver.mem_pool_destroy(self.context, pool) };
        match first_error {
            Some(e) => Err(e),
            None => destroyed,
        }
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

    /// Logs the failure of an undo: `what` (an object made for a call that then failed) could
    /// not be destroyed again. The call returns its own error; this one would otherwise
    /// vanish, and the object stays until the context's destruction takes it.
    pub(crate) fn log_failed_undo(&self, what: &'static str, undone: Result<(), DriverError>) {
        if let Err(e) = undone {
            tracing::error!(device = %self.device, error = %e, "destroying {what} after a failed call failed too; it stays until the context is destroyed");
        }
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

    /// An IPC handle for `memory`, an allocation (or a view of one) of `pool`, a
    /// stream-ordered pool of this context exported at least once (the driver exports no
    /// allocation before): the allocation's stream (the legacy default stream for memory
    /// allocated on none) is synchronised first, since the importer must not see memory its
    /// allocation has not reached; then `cuMemPoolExportPointer`. The caller holds the
    /// liveness.
    pub(crate) fn export_pool_allocation(
        &self,
        memory: &MemoryPointer,
        pool: PoolId,
    ) -> Result<IpcHandle, EmmError> {
        const WHAT: &str = "get_ipc_handle";
        let base = memory.allocation_base();
        let stream = memory.stream().unwrap_or(StreamHandle::NULL);
        self.driver
            .stream_synchronize(self.context, stream)
            .map_err(|e| self.driver_error(WHAT, e))?;
        let data = self
            .driver
            .mem_pool_export_pointer(self.context, base)
            .map_err(|e| self.driver_error(WHAT, e))?;
        Ok(IpcHandle::exported(
            memory.clone(),
            IpcMemory::PoolAllocation { pool, data },
            memory.size(),
            (memory.device_ptr().0 - base.0) as usize,
            self.device_identity()?,
        ))
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
        if self
            .liveness
            .sleeps_in(memory.device_ptr().0, memory.size())
        {
            return Err(EmmError::Sleep {
                what,
                device: self.device,
                reason: "the memory is asleep (Context::sleep offloaded or discarded it); call \
                         Context::wake first",
            });
        }
        Ok(())
    }

    /// [`ensure_alive`](Self::ensure_alive) for an allocation: refused too while the context's
    /// memory is asleep.
    pub fn ensure_awake(&self, what: &'static str) -> Result<(), EmmError> {
        self.ensure_alive(what)?;
        if self.liveness.is_asleep() {
            return Err(EmmError::Sleep {
                what,
                device: self.device,
                reason: "the context's memory is asleep (Context::sleep); call Context::wake \
                         before allocating",
            });
        }
        Ok(())
    }

    /// Holds the context's memory for one use of caller-given pointers
    /// ([`ContextLiveness::use_memory`](crate::memory::liveness::ContextLiveness::use_memory)):
    /// take it before checking the pointers, keep it until the driver call was issued.
    pub(crate) fn use_memory(&self) -> MemoryInUse<'_> {
        self.liveness.use_memory()
    }

    /// Checks that a copy of `len` bytes at the start of `memory` is allowed, and enters the
    /// context for it. `_held` (this context's [`use_memory`](Self::use_memory)) keeps the
    /// memory from being freed between the check and the caller's driver call.
    pub(crate) fn enter_copy(
        &self,
        _held: &MemoryInUse<'_>,
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
    pub(crate) fn copy_to_device(
        &self,
        held: &MemoryInUse<'_>,
        dst: &MemoryPointer,
        src: &[u8],
    ) -> Result<(), EmmError> {
        const WHAT: &str = "copy to device";
        let _live = self.enter_copy(held, WHAT, dst, src.len())?;
        // SAFETY:
        // - `enter_copy` checked that `dst` is a live pointer of this context whose first
        //   `src.len()` bytes lie inside its allocation; `dst` keeps the allocation alive while
        //   borrowed here;
        // - `_live` keeps the context from being destroyed during the call.
        unsafe { self.driver.memcpy_htod(self.context, dst.device_ptr(), src) }
            .map_err(|e| self.driver_error(WHAT, e))
    }

    /// Copies the first `dst.len()` bytes of `src` into `dst`, synchronously.
    pub(crate) fn copy_to_host(
        &self,
        held: &MemoryInUse<'_>,
        dst: &mut [u8],
        src: &MemoryPointer,
    ) -> Result<(), EmmError> {
        const WHAT: &str = "copy to host";
        let _live = self.enter_copy(held, WHAT, src, dst.len())?;
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
        held: &MemoryInUse<'_>,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
        dst_mem: &MemoryPointer,
    ) -> Result<(), EmmError> {
        const WHAT: &str = "device to device copy";
        let _live = self.enter_copy(held, WHAT, dst_mem, bytes)?;
        // SAFETY:
        // - `enter_copy` checked that `dst_mem` (at `dst`) is live memory of this context with
        //   room for `bytes`;
        // - `src .. src + bytes` is a live mapping the caller holds open for the call;
        // - the ranges belong to different allocations, so they do not overlap.
        unsafe { self.driver.memcpy_dtod(self.context, dst, src, bytes) }
            .map_err(|e| self.driver_error(WHAT, e))
    }

    /// Before a copy issued in this context from memory of `peer`'s device: enables peer access
    /// from this context to `peer` where the two devices can be peers, so that the copy goes
    /// device to device. Without it the driver still copies through unified addressing, but
    /// through host memory, several times slower between devices joined by NVLink. Asked
    /// before every such copy (one driver call: it
    /// answers "already enabled" once granted, until either context is reset, and "unsupported"
    /// for devices that cannot be peers); any other refusal is logged, and the copy then goes
    /// ahead the slow way, still correct.
    pub(crate) fn enable_peer_access_to(&self, peer: &ManagerContext) {
        if peer.device == self.device {
            return;
        }
        let (Ok(_live), Ok(_peer_live)) = (self.enter("peer access"), peer.enter("peer access"))
        else {
            return; // the copy itself reports the dead context
        };
        let refused = match self
            .driver
            .ctx_enable_peer_access(self.context, peer.context)
        {
            Ok(()) => {
                tracing::debug!(device = %self.device, peer = %peer.device, "peer access enabled");
                return;
            }
            // Granted before, or the devices are not peers (the copy then has no faster way).
            Err(e)
                if matches!(
                    e.raw_code(),
                    Some(
                        driver_sys::code::PEER_ACCESS_ALREADY_ENABLED
                            | driver_sys::code::PEER_ACCESS_UNSUPPORTED
                    )
                ) =>
            {
                return;
            }
            Err(e) => e,
        };
        tracing::warn!(device = %self.device, peer = %peer.device, error = %refused, "enabling peer access failed; copies from the peer's memory go through host memory, at a fraction of the device-to-device rate");
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

/// The thread's capture mode set to relaxed while it lives, so that the calls a global
/// capture forbids (`cuMemAlloc`, queries of streams that are not captured) go through; the
/// previous mode comes back on drop.
#[derive(Debug)]
pub struct RelaxedCapture<'a> {
    driver: &'a dyn driver_sys::Driver,
    was: Option<driver_sys::CaptureMode>,
}

impl<'a> RelaxedCapture<'a> {
    fn enter(driver: &'a dyn driver_sys::Driver) -> RelaxedCapture<'a> {
        let was = match driver.thread_exchange_capture_mode(driver_sys::CaptureMode::Relaxed) {
            Ok(was) => Some(was),
            Err(e) => {
                tracing::warn!(error = %e, "could not relax the thread's capture mode; a capture may refuse the next calls");
                None
            }
        };
        RelaxedCapture { driver, was }
    }
}

impl Drop for RelaxedCapture<'_> {
    fn drop(&mut self) {
        if let Some(was) = self.was
            && let Err(e) = self.driver.thread_exchange_capture_mode(was)
        {
            tracing::warn!(error = %e, "could not restore the thread's capture mode");
        }
    }
}
