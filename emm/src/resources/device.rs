//! [`DeviceMemoryResource`]: stream-ordered device memory from a driver pool that emm creates
//! (with `max_size` and `ipc_enabled`) or from the device's default pool, which emm does not
//! own.

// Raw-handle calls (allocations on a stream handle, mapped host memory); each block says why
// it holds.
#![allow(unsafe_code)]

use std::fmt;
use std::sync::Arc;

use driver_sys::{
    DeviceOrdinal, DevicePtr, DriverError, MemLocation, MemPoolHandle, MemPoolUsage, StreamHandle,
};

use crate::contract::factory::ManagerContext;
use crate::contract::ipc::IpcHandle;
#[cfg(unix)]
use crate::contract::pool_export::PoolExport;
use crate::contract::pool_export::PoolId;
use crate::error::EmmError;
use crate::host::fences::Fences;
use crate::memory::AddressSet;
use crate::memory::pointer::{MemoryPointer, OrderedOn, ReleaseHook, StreamUse};
use crate::objects::{Stream, check_same_context};
use crate::sync::{Mutex, lock};

/// How [`Context::device_memory_resource`](crate::Context::device_memory_resource) makes its
/// pool (cuda.core's `DeviceMemoryResourceOptions`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceMemoryResourceOptions {
    /// The most bytes the pool may reserve (`CUmemPoolProps::maxSize`); 0 is the device's
    /// memory. An allocation that would take the pool past it is out of memory. The driver
    /// holds the pool to this figure rounded up to a multiple of 32 MiB (measured on an H100,
    /// driver 580: a limit of 8 MiB let 32 MiB be allocated; 64 MiB and 512 MiB held exactly).
    pub max_size: usize,
    /// Whether the pool's memory can be exported to other processes (POSIX file descriptors).
    pub ipc_enabled: bool,
}

/// Stream-ordered device memory from one driver pool (cuda.core's `DeviceMemoryResource`).
///
/// Cloning shares the resource. A pool emm created is destroyed by [`close`](Self::close) or
/// when the last clone drops; memory still allocated from it stays valid until its pointers
/// drop, and the pool is destroyed after the last of them is freed. The device's default pool
/// is never destroyed by emm.
#[derive(Clone)]
pub struct DeviceMemoryResource {
    shared: Arc<Shared>,
}

struct State {
    closed: bool,
    /// The owned pool was destroyed: at the close, or at the last buffer's free after it.
    destroyed: bool,
    /// Exported to a descriptor at least once (the driver exports no allocation before).
    exported: bool,
    /// Allocations not freed yet.
    live: AddressSet,
    /// Buffers whose last pointer dropped but whose free failed: freed again at the close.
    unfreed: Vec<(DevicePtr, StreamUse)>,
    /// The first free that failed since it was last reported: returned by the `deallocate`
    /// whose drop it was, or by `close`.
    error: Option<EmmError>,
}

struct Shared {
    cx: ManagerContext,
    pool: MemPoolHandle,
    owned: bool,
    /// Imported from another process (cuda.core's `is_mapped`): it allocates nothing.
    mapped: bool,
    options: DeviceMemoryResourceOptions,
    /// The pool's name across processes (IPC-enabled pools).
    id: Option<PoolId>,
    state: Mutex<State>,
    fences: Fences,
}

impl Shared {
    fn free(&self, base: DevicePtr, stream: StreamHandle, after: Option<&StreamUse>) {
        let mut state = lock(&self.state);
        if !state.live.remove(&base.0) {
            return;
        }
        let Some(_live) = self.cx.liveness.enter() else {
            return; // the context is gone, and the pool with it
        };
        // SAFETY: `base` came from `cuMemAllocFromPoolAsync` of this pool (it was live), its
        // last pointer dropped, so it is freed once and used afterwards only by work already
        // queued, which the freeing stream waits for; the context is alive (`_live`).
        if let Err(e) = unsafe { self.fences.free_async_after(base, stream, after) } {
            tracing::error!(device = %self.cx.device, error = %e, ptr = %base, "freeing a memory resource's buffer failed; it is freed again when the resource is closed");
            let streams = after.cloned().unwrap_or_else(|| StreamUse::on(stream));
            state.unfreed.push((base, streams));
            state
                .error
                .get_or_insert(self.cx.driver_error("deallocate", e));
            return;
        }
        if state.closed && state.live.is_empty() && self.owned && !state.destroyed {
            // The last buffer of a closed resource: its pool goes now, after the free.
            if let Err(e) = self.destroy(&mut state) {
                state.error.get_or_insert(e);
            }
        }
    }

    /// Destroys the owned pool, once: after every buffer's free was queued (the driver
    /// releases the memory as those frees complete). The driver allows destroying a pool
    /// with buffers still allocated and freeing them later, but in the GPU suite (H100,
    /// driver 580) that order ended in a segmentation fault at the next synchronisation of
    /// the freeing stream, in every run where an earlier test had used the device (a bare
    /// reproduction, `driver_probe` `EMM_PROBE_ONLY=free-after-destroy-second`, did not
    /// crash); so a closed resource keeps its pool until its last buffer is freed.
    fn destroy(&self, state: &mut State) -> Result<(), EmmError> {
        state.destroyed = true;
        tracing::debug!(device = %self.cx.device, pool = ?self.pool, "memory resource's pool destroyed");
        self.fences.destroy_idle();
        // SAFETY: the pool is this resource's own, destroyed once (`destroyed` was false and
        // is set under the state's lock); no allocation follows (`closed` is set under the
        // same lock `allocate` takes) and every buffer's free was queued (`live` is empty).
        unsafe { self.cx.driver.mem_pool_destroy(self.cx.context, self.pool) }
            .map_err(|e| self.cx.driver_error("close", e))
    }

    fn close(&self) -> Result<(), EmmError> {
        let mut state = lock(&self.state);
        let first_close = !std::mem::replace(&mut state.closed, true);
        let Some(_live) = self.cx.liveness.enter() else {
            return Ok(()); // destroyed with its context
        };
        let mut first_error = state.error.take();
        for (base, streams) in std::mem::take(&mut state.unfreed) {
            // SAFETY: as in `free`: a buffer of this pool whose last pointer dropped and whose
            // free failed, freed once more here (it left `unfreed`), ordered as before.
            let freed = unsafe {
                self.fences
                    .free_async_after(base, streams.free_on, Some(&streams))
            };
            if let Err(e) = freed {
                first_error.get_or_insert(self.cx.driver_error("close", e));
            }
        }
        if first_close {
            tracing::debug!(device = %self.cx.device, pool = ?self.pool, outstanding = state.live.len(), "memory resource closed");
        }
        let destroyed = if self.owned && !state.destroyed && state.live.is_empty() {
            self.destroy(&mut state)
        } else {
            Ok(())
        };
        match first_error {
            Some(e) => Err(e),
            None => destroyed,
        }
    }
}

impl ReleaseHook for Shared {
    fn release(&self, base: DevicePtr, _size: usize, _tag: u64) {
        self.free(base, StreamHandle::NULL, None);
    }

    fn release_on_streams(&self, base: DevicePtr, _size: usize, _tag: u64, streams: StreamUse) {
        self.free(base, streams.free_on, Some(&streams));
    }

    fn is_live(&self, _tag: u64) -> bool {
        self.cx.liveness.is_alive()
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        if let Err(e) = self.close() {
            tracing::warn!(device = %self.cx.device, error = %e, "closing a dropped memory resource failed");
        }
    }
}

impl DeviceMemoryResource {
    /// A resource over a new pool of the context of `cx`, release threshold at its maximum
    /// (freed memory stays cached in the pool).
    pub(crate) fn create(
        cx: &ManagerContext,
        options: DeviceMemoryResourceOptions,
    ) -> Result<DeviceMemoryResource, EmmError> {
        Self::create_at(
            cx,
            MemLocation::Device(cx.device),
            options,
            "device_memory_resource",
        )
    }

    /// A resource over a new pool at `location`; a pool in host memory is made usable by the
    /// context's device.
    pub(super) fn create_at(
        cx: &ManagerContext,
        location: MemLocation,
        options: DeviceMemoryResourceOptions,
        what: &'static str,
    ) -> Result<DeviceMemoryResource, EmmError> {
        let _live = cx.enter(what)?;
        let err = |e| cx.driver_error(what, e);
        let pool = cx
            .driver
            .mem_pool_create_limited(cx.context, location, options.ipc_enabled, options.max_size)
            .map_err(err)?;
        // A pool in host memory is made usable by the context's device.
        let grant = !matches!(location, MemLocation::Device(_));
        // SAFETY: created just above, handed to no one.
        let pool = unsafe { cx.adopt_new_pool(pool, grant) }.map_err(err)?;
        Ok(Self::over(cx, pool, true, options, None))
    }

    /// A resource over pool `id`, which this process imported (`pool` in `cx`, the context of
    /// its source device): it allocates nothing (the driver refuses allocations from an
    /// imported pool), and closing it leaves the import to its runtime.
    pub(crate) fn mapped(
        cx: &ManagerContext,
        pool: MemPoolHandle,
        id: PoolId,
    ) -> DeviceMemoryResource {
        let options = DeviceMemoryResourceOptions {
            max_size: 0,
            ipc_enabled: true,
        };
        Self::over(cx, pool, false, options, Some(id))
    }

    /// A resource over the device's default pool (`cuDeviceGetDefaultMemPool`), which emm does
    /// not own: `close` leaves it alone.
    pub(crate) fn device_default(cx: &ManagerContext) -> Result<DeviceMemoryResource, EmmError> {
        let _live = cx.enter("device_memory_resource")?;
        let pool = cx
            .driver
            .device_default_mem_pool(cx.device)
            .map_err(|e| cx.driver_error("device_memory_resource", e))?;
        Ok(Self::over(
            cx,
            pool,
            false,
            DeviceMemoryResourceOptions::default(),
            None,
        ))
    }

    /// Refuses a stream of another context for `what` (the pinned and managed resources'
    /// calls, which allocate through this one).
    pub(super) fn check_stream(&self, stream: &Stream, what: &'static str) -> Result<(), EmmError> {
        check_same_context(&self.shared.cx, stream.context(), what)
    }

    /// `mapped_id`: the id of an imported pool (which makes the resource a mapped one).
    pub(super) fn over(
        cx: &ManagerContext,
        pool: MemPoolHandle,
        owned: bool,
        options: DeviceMemoryResourceOptions,
        mapped_id: Option<PoolId>,
    ) -> DeviceMemoryResource {
        DeviceMemoryResource {
            shared: Arc::new(Shared {
                cx: cx.clone(),
                pool,
                owned,
                mapped: mapped_id.is_some(),
                options,
                id: mapped_id.or_else(|| options.ipc_enabled.then(PoolId::fresh)),
                state: Mutex::new(State {
                    closed: false,
                    destroyed: false,
                    exported: false,
                    live: AddressSet::default(),
                    unfreed: Vec::new(),
                    error: None,
                }),
                fences: Fences::new(cx),
            }),
        }
    }

    /// `size` bytes on `stream` (`cuMemAllocFromPoolAsync`), usable by work queued on `stream`
    /// from now on; freed on `stream` when the last pointer drops. Out of memory (the device's,
    /// or the pool's `max_size`), the resource waits for `stream` and the legacy default
    /// stream once and retries; then the error says which limit was reached.
    pub fn allocate(&self, size: usize, stream: &Stream) -> Result<MemoryPointer, EmmError> {
        check_same_context(&self.shared.cx, stream.context(), "allocate")?;
        // SAFETY: an emm stream of this context (checked), kept alive by the pointer below.
        let mut mem = unsafe { self.allocate_on_raw(size, stream.handle()) }?;
        mem.keep_stream(stream);
        Ok(mem)
    }

    /// As [`allocate`](Self::allocate), on a stream known only by its handle (another
    /// library's, or an implicit one such as [`StreamHandle::NULL`]).
    ///
    /// # Safety
    ///
    /// `stream` is a stream of this resource's context (or an implicit one) that outlives the
    /// buffer: emm cannot keep another library's stream alive.
    pub unsafe fn allocate_on_raw(
        &self,
        size: usize,
        stream: StreamHandle,
    ) -> Result<MemoryPointer, EmmError> {
        const WHAT: &str = "allocate";
        let shared = &self.shared;
        let cx = &shared.cx;
        if size == 0 {
            return Err(EmmError::ZeroSize { what: WHAT });
        }
        if shared.mapped {
            return Err(EmmError::InvalidArgument {
                what: "DeviceMemoryResource::allocate",
                reason: "this resource maps a pool imported from another process, and the \
                         driver allocates nothing from an imported pool; allocate in the \
                         exporting process and open its handles here"
                    .into(),
            });
        }
        let _live = cx.enter(WHAT)?;
        let mut state = lock(&shared.state);
        if state.closed {
            return Err(EmmError::InvalidArgument {
                what: "DeviceMemoryResource::allocate",
                reason: "the resource was closed; make a new one \
                         (Context::device_memory_resource)"
                    .into(),
            });
        }
        let ptr = cx
            .alloc_from_pool(shared.pool, size, stream)
            .map_err(|e| self.allocation_error(size, e))?;
        state.live.insert(ptr.0);
        drop(state);
        // SAFETY: `ptr` was just allocated from the resource's pool on `stream` with `size` bytes,
        // recorded live, and is freed only by the hook.
        Ok(unsafe {
            MemoryPointer::with_hook_on(
                cx.device,
                cx.context,
                ptr,
                size,
                Arc::clone(shared) as Arc<dyn ReleaseHook>,
                0,
                stream,
            )
        })
    }

    /// The error of an allocation the driver refused (out of memory: twice): past a
    /// `max_size`, one that names the limit. Called with the state locked: it
    /// reads the pool's figures straight from the driver.
    fn allocation_error(&self, size: usize, e: DriverError) -> EmmError {
        let cx = &self.shared.cx;
        let max = self.shared.options.max_size;
        if max > 0 && e.kind() == driver_sys::ErrorKind::OutOfMemory {
            let reserved = cx
                .driver
                .mem_pool_usage(cx.context, self.shared.pool)
                .map_or(0, |u| u.reserved);
            return EmmError::InvalidArgument {
                what: "DeviceMemoryResource::allocate",
                reason: format!(
                    "{size} bytes do not fit the pool's max_size of {max} bytes ({reserved} \
                     reserved now); free buffers of this resource, or make one with a larger \
                     max_size ({e})"
                ),
            };
        }
        cx.driver_error("allocate", e)
    }

    /// Frees `memory` on `stream` (cuda.core's `deallocate(ptr, size, stream)`): the memory is
    /// freed there once its last pointer drops, which this call's is; other clones keep it.
    /// A free that fails (here, or an earlier one from a dropped pointer) is returned here; the
    /// buffer is freed again when the resource is closed.
    pub fn deallocate(&self, memory: MemoryPointer, stream: &Stream) -> Result<(), EmmError> {
        check_same_context(&self.shared.cx, stream.context(), "deallocate")?;
        self.deallocate_on(memory, stream)
    }

    /// As [`deallocate`](Self::deallocate), on a stream given as any [`OrderedOn`] (a raw
    /// handle: the caller keeps that stream alive until the free ran).
    pub fn deallocate_on(
        &self,
        memory: MemoryPointer,
        stream: &(impl OrderedOn + ?Sized),
    ) -> Result<(), EmmError> {
        memory.free_on(stream)?;
        drop(memory);
        match lock(&self.shared.state).error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The pool's figures: bytes reserved and used, now and at their high-water marks, and
    /// the release threshold (cuda.core's `attributes`).
    pub fn attributes(&self) -> Result<MemPoolUsage, EmmError> {
        let cx = &self.shared.cx;
        let _live = cx.enter("attributes")?;
        self.check_open("attributes")?;
        cx.driver
            .mem_pool_usage(cx.context, self.shared.pool)
            .map_err(|e| cx.driver_error("attributes", e))
    }

    /// Starts the high-water marks again from the current figures.
    pub fn reset_high_water(&self) -> Result<(), EmmError> {
        let cx = &self.shared.cx;
        let _live = cx.enter("reset_high_water")?;
        self.check_open("reset_high_water")?;
        cx.driver
            .mem_pool_reset_high_water(cx.context, self.shared.pool)
            .map_err(|e| cx.driver_error("reset_high_water", e))
    }

    fn check_open(&self, what: &'static str) -> Result<(), EmmError> {
        self.open_for(&lock(&self.shared.state), what)
    }

    /// The pool as a [`PoolExport`] for other processes (cuda.core's `allocation_handle`):
    /// sent with [`PoolExport::send`], imported there with
    /// [`Runtime::import_pool`](crate::Runtime::import_pool), after which the handles of
    /// [`get_ipc_handle`](Self::get_ipc_handle) open there. Refused unless the resource was
    /// made with `ipc_enabled`.
    #[cfg(unix)]
    pub fn allocation_handle(&self) -> Result<PoolExport, EmmError> {
        const WHAT: &str = "allocation_handle";
        let cx = &self.shared.cx;
        let id = self.ipc_id(WHAT)?;
        if self.shared.mapped {
            return Err(EmmError::InvalidArgument {
                what: WHAT,
                reason: "this resource maps a pool imported from another process; the driver \
                         exports a pool only from the process that made it"
                    .into(),
            });
        }
        let _live = cx.enter(WHAT)?;
        let fd = {
            let mut state = lock(&self.shared.state);
            self.open_for(&state, WHAT)?;
            self.export_fd(&mut state, WHAT)?
        };
        let source = cx.device_identity()?;
        tracing::info!(device = %cx.device, pool = %id, "memory resource's pool exported");
        Ok(PoolExport::new(id, source, fd))
    }

    /// An IPC handle for `memory` (a buffer of this resource, or a view of one), which opens
    /// in a process that imported the pool: the buffer's stream is synchronised first (the
    /// importer must not see memory its allocation has not reached), and the pool is exported
    /// once if it was not yet (the driver exports no allocation before).
    pub fn get_ipc_handle(&self, memory: &MemoryPointer) -> Result<IpcHandle, EmmError> {
        const WHAT: &str = "get_ipc_handle";
        let cx = &self.shared.cx;
        let id = self.ipc_id(WHAT)?;
        let _live = cx.enter(WHAT)?;
        let base = memory.allocation_base();
        let mut state = lock(&self.shared.state);
        self.open_for(&state, WHAT)?;
        if !state.live.contains(&base.0) || memory.context() != cx.context {
            return Err(EmmError::InvalidArgument {
                what: "memory passed to DeviceMemoryResource::get_ipc_handle",
                reason: format!(
                    "{base} is not a live buffer of this resource; export memory it allocated"
                ),
            });
        }
        if !state.exported {
            self.export_first(&mut state, WHAT)?;
        }
        cx.export_pool_allocation(memory, id)
    }

    /// Exports the pool once before its first allocation is (the driver exports no
    /// allocation of a pool never exported); the descriptor is closed at once (the export
    /// stays valid).
    #[cfg(unix)]
    fn export_first(&self, state: &mut State, what: &'static str) -> Result<(), EmmError> {
        self.export_fd(state, what).map(drop)
    }

    /// Off Unix: pools travel as POSIX file descriptors, which the platform does not have.
    #[cfg(not(unix))]
    fn export_first(&self, _state: &mut State, what: &'static str) -> Result<(), EmmError> {
        Err(EmmError::InvalidArgument {
            what,
            reason: "stream-ordered pools are shared as POSIX file descriptors, which this \
                     platform does not have"
                .into(),
        })
    }

    /// Exports the pool to a new descriptor, and records that it was exported.
    #[cfg(unix)]
    fn export_fd(
        &self,
        state: &mut State,
        what: &'static str,
    ) -> Result<std::os::fd::OwnedFd, EmmError> {
        let cx = &self.shared.cx;
        let fd = cx
            .driver
            .mem_pool_export_fd(cx.context, self.shared.pool)
            .map_err(|e| cx.driver_error(what, e))?;
        state.exported = true;
        Ok(fd)
    }

    fn ipc_id(&self, what: &'static str) -> Result<PoolId, EmmError> {
        self.shared.id.ok_or(EmmError::InvalidArgument {
            what,
            reason: "the resource's pool is not IPC-enabled; make it with \
                     DeviceMemoryResourceOptions { ipc_enabled: true, .. }"
                .into(),
        })
    }

    fn open_for(&self, state: &State, what: &'static str) -> Result<(), EmmError> {
        if state.closed && self.shared.owned {
            return Err(EmmError::InvalidArgument {
                what,
                reason: "the resource was closed (its pool is destroyed once its last buffer is \
                         freed); make a new one"
                    .into(),
            });
        }
        Ok(())
    }

    /// The pool's name across processes, for an IPC-enabled resource (the key under which an
    /// importer's runtime registers the pool).
    pub fn pool_id(&self) -> Option<PoolId> {
        self.shared.id
    }

    /// Whether the resource maps a pool imported from another process (it allocates nothing).
    pub fn is_mapped(&self) -> bool {
        self.shared.mapped
    }

    /// Whether emm created the pool and destroys it (false for the device's default pool).
    pub fn is_handle_owned(&self) -> bool {
        self.shared.owned
    }

    /// Whether the pool's memory can be exported to other processes.
    pub fn is_ipc_enabled(&self) -> bool {
        self.shared.options.ipc_enabled
    }

    /// The options the pool was made with (the default pool's: no limit, no IPC).
    pub fn options(&self) -> DeviceMemoryResourceOptions {
        self.shared.options
    }

    /// The driver's pool handle.
    pub fn handle(&self) -> MemPoolHandle {
        self.shared.pool
    }

    /// The device the memory is on.
    pub fn device(&self) -> DeviceOrdinal {
        self.shared.cx.device
    }

    /// Buffers allocated and not freed yet.
    pub fn live_buffers(&self) -> usize {
        lock(&self.shared.state).live.len()
    }

    /// Closes the resource: no more allocations; buffers whose free failed are freed again; an
    /// owned pool is destroyed now, or, while buffers are still live (they stay valid), once
    /// the last of them is freed.
    /// Idempotent; also done when the last clone drops. Returns the first failed free not
    /// reported yet.
    pub fn close(&self) -> Result<(), EmmError> {
        self.shared.close()
    }
}

impl fmt::Debug for DeviceMemoryResource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceMemoryResource")
            .field("device", &self.shared.cx.device)
            .field("pool", &self.shared.pool)
            .field("owned", &self.shared.owned)
            .field("mapped", &self.shared.mapped)
            .field("options", &self.shared.options)
            .finish()
    }
}
