//! [`Context`]: one device's primary context and the memory manager that owns its memory.
#![allow(unsafe_code)]

use std::fmt;
use std::sync::Arc;

use driver_sys::{ContextHandle, DeviceOrdinal, HostPtr, StreamHandle, event_flags, stream_flags};

use super::graphs::{GraphPoolSegment, GraphRoutes};
use crate::contract::capabilities::{Exports, Sleeper};
use crate::contract::factory::ManagerContext;
use crate::contract::info::{
    AllocationEvents, FreeSpace, MemoryInfo, OutOfMemoryCallback, PoolReport, Usage,
};
use crate::contract::ipc::{DeviceIdentity, IpcHandle};
use crate::contract::manager::{HistoryRecord, MemoryManager, StreamOrdering};
use crate::contract::mapped_export::MappedExport;
use crate::contract::pool_export::PoolExport;
use crate::contract::snapshot::{self, Block, BlockState, MemorySnapshot, Segment, SegmentKind};
use crate::error::{EmmError, LiveByTag, OutOfMemoryReport};
use crate::ipc::imports::PoolImports;
use crate::ipc::open::Endpoint;
use crate::memory::host::{HostAllocFlags, HostMemory, HostOwner, ManagedMemory, PinnableBuffer};
use crate::memory::pending::{DeferCleanup, PendingDeallocs};
use crate::memory::pointer::MemoryPointer;
use crate::objects::{Event, Module, ModuleRegistry, Stream, StreamKind, check_same_context};
use crate::resources::{
    DeviceMemoryResource, DeviceMemoryResourceOptions, ManagedMemoryResource,
    ManagedMemoryResourceOptions, PinnedMemoryResource, PinnedMemoryResourceOptions,
};

pub(crate) struct ContextInner {
    /// The driver, device, context handle and liveness, as the manager got them.
    pub(crate) cx: ManagerContext,
    pub(crate) manager: Box<dyn MemoryManager>,
    pub(crate) manager_name: String,
    /// The context's own queue: streams, events and modules (never memory).
    pub(crate) own: Arc<PendingDeallocs>,
    pub(crate) modules: Arc<ModuleRegistry>,
    pub(crate) can_map_host_memory: bool,
    /// The runtime's table of imported stream-ordered pools (shared by its contexts).
    pub(crate) imports: Arc<PoolImports>,
    /// Streams whose allocations a graph pool serves (`graphs.rs`). Boxed: the context's
    /// allocation path reads the fields above, which stay together in few cache lines.
    pub(crate) graph_routes: Box<GraphRoutes>,
}

impl ContextInner {
    /// The manager's history, if it keeps one.
    pub(crate) fn history(&self) -> Option<HistoryRecord> {
        self.manager.records()?.history()
    }

    /// The manager's exports, or `refusal`'s error naming the manager.
    pub(crate) fn exports(
        &self,
        refusal: fn(String) -> EmmError,
    ) -> Result<&dyn Exports, EmmError> {
        (self.manager.exports()).ok_or_else(|| refusal(self.manager_name.clone()))
    }

    /// The manager's sleep and wake, or the refusal of `operation` naming the manager.
    pub(crate) fn sleeper(&self, operation: &'static str) -> Result<&dyn Sleeper, EmmError> {
        (self.manager.sleeper()).ok_or_else(|| EmmError::no_sleep(operation, &*self.manager_name))
    }
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
            .field("device", &self.inner.cx.device)
            .field("handle", &self.inner.cx.context)
            .field("driver", &self.inner.cx.driver.name())
            .field("manager", &self.inner.manager_name)
            .field("alive", &self.inner.cx.liveness.is_alive())
            .finish()
    }
}

impl Context {
    /// The device.
    pub fn device(&self) -> DeviceOrdinal {
        self.inner.cx.device
    }

    /// The CUDA context handle.
    pub fn handle(&self) -> ContextHandle {
        self.inner.cx.context
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
        self.inner.cx.liveness.is_alive()
    }

    pub(crate) fn ensure_alive(&self, what: &'static str) -> Result<(), EmmError> {
        self.inner.cx.ensure_alive(what)
    }

    /// Allocates `bytes` of device memory through the manager.
    pub fn memalloc(&self, bytes: usize) -> Result<MemoryPointer, EmmError> {
        self.inner.cx.ensure_awake("memalloc")?;
        self.inner.manager.memalloc(bytes)
    }

    /// Allocates `bytes` of device memory for work on `stream` (the manager's
    /// [`memalloc_on`](MemoryManager::memalloc_on)): usable by work queued on `stream` from
    /// now on; when the last pointer drops, freed on `stream` (or the stream given to
    /// [`MemoryPointer::free_on`]) once the work of every stream recorded with
    /// [`MemoryPointer::record_stream`] is done. The stream is kept alive (not destroyed)
    /// while the memory needs it. [`stream_ordering`](Self::stream_ordering) says how the
    /// manager orders reuse; a manager that does not allocate on streams refuses.
    ///
    /// ```
    /// let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// let ctx = runtime.context(0)?;
    /// let (a, b) = (ctx.create_stream()?, ctx.create_stream()?);
    /// let mem = ctx.memalloc_on(1 << 20, &a)?;
    /// ctx.memset_async(&mem, 0, &a)?;
    /// mem.record_stream(&b)?; // b reads it too: reused only once both are done
    /// assert_eq!(mem.stream(), Some(a.handle()));
    /// drop(mem);
    /// # Ok::<(), emm::EmmError>(())
    /// ```
    pub fn memalloc_on(&self, bytes: usize, stream: &Stream) -> Result<MemoryPointer, EmmError> {
        check_same_context(&self.inner.cx, stream.context(), "memalloc_on")?;
        self.inner.cx.ensure_awake("memalloc_on")?;
        if let Some(pool) = self.graph_pool_of(stream.handle())? {
            return pool.allocate(bytes);
        }
        let mut mem = self.inner.manager.memalloc_on(bytes, stream.handle())?;
        mem.keep_stream(stream);
        Ok(mem)
    }

    /// As [`memalloc_on`](Self::memalloc_on), for a stream known only by its handle: another
    /// library's (CuPy's, PyTorch's), or one of the implicit streams
    /// ([`StreamHandle::NULL`](driver_sys::StreamHandle::NULL), `LEGACY`, `PER_THREAD`).
    ///
    /// # Safety
    ///
    /// `stream` is a stream of this context (or an implicit one) and is not destroyed while
    /// the memory lives, nor while the manager may still free it there or keep it on the
    /// stream's free list (until a `trim` or `reset` after the last pointer dropped): emm
    /// cannot keep another library's stream alive, and a destroyed stream's handle may name a
    /// new stream that is not ordered after the old one's work.
    pub unsafe fn memalloc_on_raw(
        &self,
        bytes: usize,
        stream: driver_sys::StreamHandle,
    ) -> Result<MemoryPointer, EmmError> {
        self.inner.cx.ensure_awake("memalloc_on")?;
        if let Some(pool) = self.graph_pool_of(stream)? {
            return pool.allocate(bytes);
        }
        self.inner.manager.memalloc_on(bytes, stream)
    }

    /// What the manager holds now, for an out-of-memory error.
    pub(crate) fn out_of_memory_report(
        inner: &ContextInner,
        requested: usize,
        callback_retries: u32,
    ) -> OutOfMemoryReport {
        let holdings = inner.manager.holdings();
        let pool = holdings.and_then(|h| h.pool_stats().device);
        let space = holdings.and_then(|h| h.free_space());
        let unused = pool.map(|p| p.unused_bytes());
        let largest = pool.and_then(|p| p.largest_free_bytes);
        OutOfMemoryReport {
            manager: inner.manager_name.clone(),
            held_bytes: pool.map(|p| p.held_bytes),
            in_use_bytes: pool.map(|p| p.in_use_bytes),
            unused_bytes: unused,
            largest_free_bytes: largest,
            fragmentation: match (&space, unused, largest) {
                (Some(space), _, _) => Some(space.fragmentation()),
                (None, Some(u), Some(l)) if u > 0 => Some(1.0 - l.min(u) as f64 / u as f64),
                (None, Some(_), Some(_)) => Some(0.0),
                _ => None,
            },
            free_blocks: space.as_ref().map(|s| s.blocks.len()),
            unusable_for_request: space.as_ref().map(|s| s.unusable_for(requested)),
            callback_retries,
            inside_callback: false,
            live_by_tag: Self::live_by_tag(inner),
        }
    }

    /// The five tags with the most live bytes, from the allocations the manager's history
    /// recorded (every one with the `history` adaptor; the recent ones of `pool`'s own).
    fn live_by_tag(inner: &ContextInner) -> Vec<LiveByTag> {
        // Without a history no allocation is recorded: the snapshot's walk is not needed.
        let Some(history) = inner.history() else {
            return Vec::new();
        };
        let mut tags = Self::snapshot_with(inner, Some(history)).by_tag();
        tags.truncate(5);
        tags
    }

    /// Sets (or, with `None`, removes) the callback this context calls when a device
    /// allocation runs out of memory after the manager's own retry ([`OutOfMemoryCallback`]),
    /// as RMM's failure-callback adaptor does, at most
    /// [`OUT_OF_MEMORY_RETRIES`](crate::contract::OUT_OF_MEMORY_RETRIES) times an
    /// allocation. Every device allocation of the shipped managers consults it (the host
    /// layer's retry, where Numba's one retry is made; a plugin of its own that bypasses
    /// [`HostLayer::attempt_allocation`](crate::host::HostLayer::attempt_allocation) does
    /// not). The callback runs on the allocating thread, with no lock of emm's managers held:
    /// it may free emm memory. It may allocate too, but an allocation of this context that
    /// runs out of memory inside it does not call it again (the error says so), and a reset
    /// of this context's device from inside it is refused.
    ///
    /// ```
    /// use std::sync::{Arc, Mutex};
    /// let sim = Arc::new(driver_mock::SimDriver::new(driver_mock::SimConfig::single(64 << 20)));
    /// let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// let ctx = runtime.context(0)?;
    /// let spare = Arc::new(Mutex::new(Some(ctx.memalloc(48 << 20)?)));
    /// let held = Arc::clone(&spare);
    /// ctx.on_out_of_memory(Some(Arc::new(move |_bytes| held.lock().unwrap().take().is_some())));
    /// let big = ctx.memalloc(32 << 20)?; // fails once; the callback drops the spare; served
    /// assert!(spare.lock().unwrap().is_none());
    /// assert_eq!(ctx.allocation_events().ooms(), 0);
    /// # drop(big);
    /// # Ok::<(), emm::EmmError>(())
    /// ```
    pub fn on_out_of_memory(&self, callback: Option<Arc<OutOfMemoryCallback>>) {
        self.inner.cx.events.set_callback(callback);
    }

    /// How often this context's allocations ran out of memory: retries made after freeing
    /// memory, and failures its callers saw.
    pub fn allocation_events(&self) -> &AllocationEvents {
        &self.inner.cx.events
    }

    /// A memory resource over a new driver pool of this context's device (cuda.core's
    /// `DeviceMemoryResource(device, options)`): stream-ordered allocations beside the
    /// manager's, with the pool's `max_size` and `ipc_enabled`.
    ///
    /// ```
    /// let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// let ctx = runtime.context(0)?;
    /// let mr = ctx.device_memory_resource(emm::DeviceMemoryResourceOptions {
    ///     max_size: 64 << 20,
    ///     ipc_enabled: false,
    /// })?;
    /// let s = ctx.create_stream()?;
    /// let buf = mr.allocate(1 << 20, &s)?;
    /// assert_eq!(mr.attributes()?.used, 1 << 20);
    /// mr.deallocate(buf, &s)?;
    /// mr.close()?;
    /// # Ok::<(), emm::EmmError>(())
    /// ```
    pub fn device_memory_resource(
        &self,
        options: DeviceMemoryResourceOptions,
    ) -> Result<DeviceMemoryResource, EmmError> {
        self.ensure_alive("device_memory_resource")?;
        DeviceMemoryResource::create(&self.inner.cx, options)
    }

    /// A pinned memory resource (cuda.core's `PinnedMemoryResource`): stream-ordered
    /// page-locked host memory from a driver pool in host memory, one address for the host and
    /// this device. Refused, naming the legacy pinned memory, where the driver has no host
    /// memory pools.
    pub fn pinned_memory_resource(
        &self,
        options: PinnedMemoryResourceOptions,
    ) -> Result<PinnedMemoryResource, EmmError> {
        self.ensure_alive("pinned_memory_resource")?;
        PinnedMemoryResource::create(&self.inner.cx, options)
    }

    /// A managed memory resource (cuda.core's `ManagedMemoryResource`): stream-ordered managed
    /// memory from a managed-memory pool (CUDA 13 on). Refused, naming `memallocmanaged`,
    /// where the driver has no managed pools.
    pub fn managed_memory_resource(
        &self,
        options: ManagedMemoryResourceOptions,
    ) -> Result<ManagedMemoryResource, EmmError> {
        self.ensure_alive("managed_memory_resource")?;
        ManagedMemoryResource::create(&self.inner.cx, options)
    }

    /// A memory resource over the device's default pool (`cuDeviceGetDefaultMemPool`), which
    /// emm does not own: closing the resource leaves the pool as it is.
    pub fn default_device_memory_resource(&self) -> Result<DeviceMemoryResource, EmmError> {
        self.ensure_alive("device_memory_resource")?;
        DeviceMemoryResource::device_default(&self.inner.cx)
    }

    /// How the context's manager orders memory allocated on streams.
    pub fn stream_ordering(&self) -> StreamOrdering {
        self.inner.manager.stream_ordering()
    }

    /// Allocates `bytes` of managed memory (Numba's `memallocmanaged`): one address for the
    /// host and the devices, attached globally if `attach_global` (any stream of any device
    /// may use it), else to the host. Out of memory, the deferred frees are flushed and the
    /// allocation retried once, as for device memory; it is freed like device memory too.
    ///
    /// ```
    /// let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// let ctx = runtime.context(0)?;
    /// let managed = ctx.memallocmanaged(64, true)?;
    /// managed.write(0, &[9; 64])?;
    /// let mut back = [0u8; 64];
    /// ctx.copy_to_host(&mut back, managed.device())?;
    /// assert_eq!(back, [9; 64]);
    /// # Ok::<(), emm::EmmError>(())
    /// ```
    pub fn memallocmanaged(
        &self,
        bytes: usize,
        attach_global: bool,
    ) -> Result<ManagedMemory, EmmError> {
        self.ensure_alive("memallocmanaged")?;
        self.inner.manager.memallocmanaged(bytes, attach_global)
    }

    /// Releases what the manager holds back (pool chunks, cached pinned blocks) to the driver;
    /// returns the bytes released. Inside `defer_cleanup` the frees wait for the guard.
    pub fn trim(&self) -> Result<usize, EmmError> {
        self.ensure_alive("trim")?;
        self.inner.manager.holdings().map_or(Ok(0), |h| h.trim())
    }

    /// What the manager's pools hold now.
    pub fn pool_stats(&self) -> PoolReport {
        (self.inner.manager.holdings())
            .map(|h| h.pool_stats())
            .unwrap_or_default()
    }

    /// The free space of the manager's device pool, block by block: largest block, count,
    /// histogram, fragmentation, and what requests of a size cannot use ([`FreeSpace`];
    /// `None` for a manager without a pool, or whose pool cannot tell).
    pub fn free_space(&self) -> Option<FreeSpace> {
        self.inner.manager.holdings()?.free_space()
    }

    /// Everything the manager holds, segment by segment and block by block: in use, cached
    /// for a thread or a stream, free, or waiting to be freed ([`MemorySnapshot`]). With the
    /// `history` adaptor ([`Adaptor::History`](crate::Adaptor::History)), each in-use block
    /// carries its allocation's tag, stream, time (and stack with `history-stacks`), and the
    /// snapshot the last events; it exports to PyTorch's format
    /// ([`MemorySnapshot::to_torch_json`]) and to an HTML page ([`MemorySnapshot::to_html`]).
    ///
    /// The manager's lists are read one lock at a time: taken while other threads allocate,
    /// a snapshot may show a block that moved between two lists in both or in neither.
    pub fn snapshot(&self) -> MemorySnapshot {
        Self::snapshot_of(&self.inner)
    }

    fn snapshot_of(inner: &ContextInner) -> MemorySnapshot {
        Self::snapshot_with(inner, inner.history())
    }

    /// The snapshot of `inner`'s manager, with `history` (its manager's, read once).
    pub(super) fn snapshot_with(
        inner: &ContextInner,
        history: Option<HistoryRecord>,
    ) -> MemorySnapshot {
        let held = inner.manager.holdings().and_then(|h| h.segments());
        let history_on = history.is_some();
        let HistoryRecord {
            live,
            events,
            complete,
        } = history.unwrap_or_default();
        let segments_known = held.is_some();
        let (mut segments, mut unplaced) = snapshot::assemble(held.unwrap_or_default(), live);
        if !complete {
            // A manager's own window may name allocations freed since: only those in in-use
            // space are live.
            unplaced.clear();
        }
        if !segments_known {
            segments = std::mem::take(&mut unplaced)
                .into_iter()
                .map(|b| Segment {
                    address: b.address,
                    bytes: b.bytes,
                    kind: SegmentKind::DriverAllocation,
                    stream: b.allocation.as_ref().and_then(|a| a.stream),
                    blocks: vec![b],
                })
                .collect();
        }
        segments.sort_by_key(|s| s.address);
        for graph in inner.graph_routes.pool_segments() {
            carve_graph_segment(&mut segments, &graph);
        }
        MemorySnapshot {
            device: inner.cx.device.0,
            manager: inner.manager_name.clone(),
            time_us: crate::clock::unix_now_us(),
            segments,
            segments_known,
            history_on,
            history: events,
            unplaced,
        }
    }

    /// Whether allocations keep their stacks (the `history-stacks` adaptor): worth passing
    /// the host language's stack then ([`with_host_stack`](crate::contract::with_host_stack)).
    pub fn records_stacks(&self) -> bool {
        (self.inner.manager.records()).is_some_and(|r| r.records_stacks())
    }

    /// What a `stats` adaptor counted, if the manager has one.
    pub fn usage(&self) -> Option<Usage> {
        self.inner.manager.records()?.usage()
    }

    /// Free and total memory, as the manager reports them.
    pub fn get_memory_info(&self) -> Result<MemoryInfo, EmmError> {
        self.ensure_alive("get_memory_info")?;
        self.inner.manager.get_memory_info()
    }

    /// Defers cleanup while the returned guard lives: the manager's deferral joined with the
    /// context's own queue's (Numba's `Context.defer_cleanup`). Guards nest; leaving the
    /// outermost does not flush.
    pub fn defer_cleanup(&self) -> Result<DeferCleanup, EmmError> {
        Ok(self
            .inner
            .manager
            .defer_cleanup()?
            .join(self.inner.own.defer_cleanup()))
    }

    /// The context's own queue (streams, events, modules).
    pub fn own_deallocations(&self) -> &Arc<PendingDeallocs> {
        &self.inner.own
    }

    /// The manager's deferred-deallocation queue, if it has one.
    pub fn deallocations(&self) -> Option<&Arc<PendingDeallocs>> {
        self.inner.manager.deallocations()
    }

    /// Resets the context in Numba's order (`Context.reset`): the manager frees everything it
    /// allocated, the loaded modules are unloaded, the context's own queue is flushed. Every
    /// step runs; the first error is returned. Pointers and modules that outlive it become
    /// stale; dropping them frees nothing twice.
    ///
    /// Copies, sets, exports and graph launches of the context's memory that are under way on
    /// other threads finish first; those that come after are refused as stale. Called from
    /// inside the context's out-of-memory callback ([`on_out_of_memory`](Self::on_out_of_memory)),
    /// whose allocation is still inside the manager, it refuses with
    /// [`EmmError::InvalidArgument`] and changes nothing.
    pub fn reset(&self) -> Result<(), EmmError> {
        self.refuse_inside_callback("Context::reset")?;
        tracing::info!(device = %self.inner.cx.device, modules = self.inner.modules.len(), "context reset");
        let manager = {
            let Some(_uses) = self.inner.cx.liveness.exclusive_memory() else {
                return Err(self.reset_inside_reset("Context::reset"));
            };
            self.inner.graph_routes.clear();
            let manager = self.inner.manager.reset();
            // The memory a sleep released was given up with the rest.
            self.inner.cx.liveness.wake();
            manager
        };
        self.inner.modules.clear();
        let own = self.inner.own.flush().map(|_| ());
        manager.and(own)
    }

    /// The refusal of `what` (a reset or a sleep) on a thread that is resetting this context,
    /// or putting its memory to sleep, already: user code those run (a release hook) asked.
    pub(super) fn reset_inside_reset(&self, what: &'static str) -> EmmError {
        EmmError::InvalidArgument {
            what,
            reason: format!(
                "it was called while this thread resets device {}'s context (or puts its memory \
                 to sleep), from code that runs inside (a release hook, or a destructor of \
                 memory being freed); let the reset or sleep finish, and call it afterwards",
                self.inner.cx.device
            ),
        }
    }

    /// Refuses `what` (a reset of this context or its device, a sleep) from inside the
    /// context's out-of-memory callback: the allocation that called it is still inside the
    /// manager, which `what` would free or unmap under it (and a device reset would wait for
    /// it).
    pub(super) fn refuse_inside_callback(&self, what: &'static str) -> Result<(), EmmError> {
        if !self.inner.cx.liveness.called_back_here() {
            return Ok(());
        }
        Err(EmmError::InvalidArgument {
            what,
            reason: format!(
                "it was called from inside an out-of-memory callback of device {}'s context, \
                 whose allocation is still under way inside the memory manager; free memory \
                 from the callback and return true to retry (or false to let the allocation \
                 fail), and call it after the allocation returns",
                self.inner.cx.device
            ),
        })
    }

    /// Allocates page-locked host memory through the manager (Numba's `memhostalloc`); no
    /// map-capability check, as in Numba.
    pub fn memhostalloc(
        &self,
        bytes: usize,
        mapped: bool,
        portable: bool,
        wc: bool,
    ) -> Result<HostMemory, EmmError> {
        let flags = HostAllocFlags {
            mapped,
            portable,
            write_combined: wc,
        };
        self.host_alloc(bytes, flags)
    }

    /// Allocates page-locked host memory with named flags: [`memhostalloc`](Self::memhostalloc)
    /// without three booleans in a row.
    pub fn host_alloc(&self, bytes: usize, flags: HostAllocFlags) -> Result<HostMemory, EmmError> {
        self.ensure_alive("memhostalloc")?;
        self.inner.manager.memhostalloc(bytes, flags)
    }

    /// Page-locks an existing host range through the manager (Numba's `Context.mempin`);
    /// `mapped` on a device that cannot map host memory is refused first.
    ///
    /// # Safety
    ///
    /// As [`MemoryManager::mempin`]: `owner` keeps the range alive, and no Rust reference to it
    /// is used while the device or a driver copy may write it.
    pub unsafe fn mempin(
        &self,
        owner: HostOwner,
        ptr: HostPtr,
        size: usize,
        mapped: bool,
    ) -> Result<HostMemory, EmmError> {
        self.ensure_alive("mempin")?;
        if mapped && !self.inner.can_map_host_memory {
            return Err(EmmError::CannotMapHostMemory {
                device: self.inner.cx.device,
            });
        }
        // SAFETY: forwarded with this method's own contract.
        unsafe { self.inner.manager.mempin(owner, ptr, size, mapped) }
    }

    /// Pins a [`PinnableBuffer`] (safe: the buffer's bytes are never referenced, only copied),
    /// keeping it alive until the pin is released.
    pub fn pin(&self, buffer: Arc<PinnableBuffer>, mapped: bool) -> Result<HostMemory, EmmError> {
        let (ptr, size) = (buffer.host_ptr(), buffer.len());
        // SAFETY: `buffer` is the owner and keeps the range alive; a `PinnableBuffer` hands out
        // no references to its bytes, so device writes alias nothing.
        unsafe { self.mempin(buffer, ptr, size, mapped) }
    }

    /// An IPC handle for `memory` from the manager (Numba's `Context.get_ipc_handle`); IPC
    /// needs Linux.
    pub fn get_ipc_handle(&self, memory: &MemoryPointer) -> Result<IpcHandle, EmmError> {
        // Held until the export is made: a reset meanwhile would let the address name other
        // memory.
        let _held = self.inner.cx.use_memory();
        self.check_usable("get_ipc_handle", memory)?;
        if !cfg!(target_os = "linux") {
            return Err(EmmError::NotSupported {
                operation: "get_ipc_handle",
                manager: self.inner.manager_name.clone(),
                advice: "OS does not support CUDA IPC (it needs Linux)",
            });
        }
        self.inner.manager.get_ipc_handle(memory)
    }

    /// Exports the manager's stream-ordered pool for other processes (`async-pool-ipc`; other
    /// managers refuse with [`EmmError::NotSupported`]). Send the export with
    /// [`PoolExport::send`]; the other process imports it with
    /// [`Runtime::import_pool`](crate::Runtime::import_pool) and can then open the
    /// [`IpcHandle`]s of the pool's memory.
    pub fn export_pool(&self) -> Result<PoolExport, EmmError> {
        self.ensure_alive("export_pool")?;
        if !cfg!(target_os = "linux") {
            return Err(EmmError::NotSupported {
                operation: "export_pool",
                manager: self.inner.manager_name.clone(),
                advice: "pools are exported as POSIX file descriptors, which needs Linux",
            });
        }
        (self.inner.exports(EmmError::no_pool_export)?).export_pool()
    }

    /// Allocates `bytes` of device memory to share with other processes
    /// ([`export_mapped`](Self::export_mapped)): physical memory of its own, which no other
    /// allocation shares, unmapped and released when its last pointer drops and never handed
    /// to another allocation, so that a process that opened it reaches this memory and nothing
    /// else, even after this process freed it. Only `vmm-pool` makes it (its size rounded up to
    /// the granularity, 2 MiB); other managers refuse with [`EmmError::NotSupported`]. A reset
    /// leaves it alone: another process may map it.
    pub fn memalloc_shared(&self, bytes: usize) -> Result<MemoryPointer, EmmError> {
        self.inner.cx.ensure_awake("memalloc_shared")?;
        (self.inner.exports(EmmError::no_shared_allocation)?).memalloc_shared(bytes)
    }

    /// Exports `memory` (an allocation of [`memalloc_shared`](Self::memalloc_shared), or a view
    /// of one) as the physical memory behind it, for another process: send the [`MappedExport`] with
    /// [`MappedExport::send`]; that process opens it with [`open_mapped`](Self::open_mapped).
    /// Other managers refuse with [`EmmError::NotSupported`] (their memory travels as
    /// [`get_ipc_handle`](Self::get_ipc_handle)'s handles), as does a driver that does not share
    /// physical memory as POSIX file descriptors, and `vmm-pool`'s own blocks (their physical
    /// memory holds other allocations too). The other process keeps what it opened for as long
    /// as it maps it, whatever this process frees meanwhile.
    pub fn export_mapped(&self, memory: &MemoryPointer) -> Result<MappedExport, EmmError> {
        let _held = self.inner.cx.use_memory();
        self.check_usable("export_mapped", memory)?;
        if !cfg!(target_os = "linux") {
            return Err(EmmError::NotSupported {
                operation: "export_mapped",
                manager: self.inner.manager_name.clone(),
                advice: "memory is exported as POSIX file descriptors, which needs Linux",
            });
        }
        (self.inner.exports(EmmError::no_mapped_export)?).export_mapped(memory)
    }

    /// Maps memory another process exported with [`export_mapped`](Self::export_mapped) into
    /// this context, which must be on the exporting device, and returns a pointer to it. The
    /// mapping is undone when the pointer's last clone (or view) drops; drop it before the
    /// exporter frees the memory.
    #[cfg(unix)]
    pub fn open_mapped(&self, export: MappedExport) -> Result<MemoryPointer, EmmError> {
        self.ensure_alive("open_mapped")?;
        crate::ipc::mapped::open_mapped(&self.inner.cx, export)
    }

    /// Creates a stream (`cuStreamCreate`, default flags: blocking, priority 0); it is
    /// destroyed through the context's own queue when dropped.
    pub fn create_stream(&self) -> Result<Stream, EmmError> {
        let _live = self.enter("create_stream")?;
        let cx = &self.inner.cx;
        let s = cx
            .driver
            .stream_create(cx.context, stream_flags::DEFAULT)
            .map_err(|e| cx.driver_error("create_stream", e))?;
        let kind = StreamKind::Created {
            non_blocking: false,
            priority: 0,
        };
        Ok(Stream::new(
            s,
            kind,
            cx.clone(),
            Some(Arc::clone(&self.inner.own)),
        ))
    }

    /// Creates a stream with `priority` (clamped into
    /// [`stream_priority_range`](Self::stream_priority_range) by the driver) that is
    /// non-blocking if `non_blocking` (no implicit synchronisation with the legacy default
    /// stream); destroyed through the context's own queue when dropped.
    pub fn create_stream_with(
        &self,
        non_blocking: bool,
        priority: i32,
    ) -> Result<Stream, EmmError> {
        let _live = self.enter("create_stream")?;
        let cx = &self.inner.cx;
        let flags = if non_blocking {
            stream_flags::NON_BLOCKING
        } else {
            stream_flags::DEFAULT
        };
        let err = |e| cx.driver_error("create_stream", e);
        let s = cx
            .driver
            .stream_create_with_priority(cx.context, flags, priority)
            .map_err(err)?;
        // The kind records the priority the driver gave, which may be clamped.
        let given = match cx.driver.stream_priority(cx.context, s) {
            Ok(p) => p,
            Err(e) => {
                // SAFETY: created just above and not handed out; destroyed once.
                cx.log_failed_undo("a new stream", unsafe {
                    cx.driver.stream_destroy(cx.context, s)
                });
                return Err(err(e));
            }
        };
        let kind = StreamKind::Created {
            non_blocking,
            priority: given,
        };
        Ok(Stream::new(
            s,
            kind,
            cx.clone(),
            Some(Arc::clone(&self.inner.own)),
        ))
    }

    /// `(least, greatest)` stream priority of the context (`cuCtxGetStreamPriorityRange`); the
    /// greatest priority is the lowest number.
    pub fn stream_priority_range(&self) -> Result<(i32, i32), EmmError> {
        let _live = self.enter("stream_priority_range")?;
        let cx = &self.inner.cx;
        cx.driver
            .stream_priority_range(cx.context)
            .map_err(|e| cx.driver_error("stream_priority_range", e))
    }

    /// The legacy default stream (`CU_STREAM_LEGACY`; Numba's `legacy_default_stream`), which
    /// synchronises with every blocking stream of the context. Never destroyed.
    pub fn legacy_default_stream(&self) -> Stream {
        self.implicit_stream(StreamHandle::LEGACY, StreamKind::LegacyDefault)
    }

    /// The calling thread's default stream (`CU_STREAM_PER_THREAD`; Numba's
    /// `per_thread_default_stream`), which synchronises with no other stream. Never destroyed.
    pub fn per_thread_default_stream(&self) -> Stream {
        self.implicit_stream(StreamHandle::PER_THREAD, StreamKind::PerThreadDefault)
    }

    /// The default stream (Numba's `default_stream`): the legacy default stream, as emm's own
    /// calls use it.
    pub fn default_stream(&self) -> Stream {
        self.legacy_default_stream()
    }

    /// Wraps another library's stream (Numba's `external_stream`): emm's calls order work on
    /// it, and never destroy it.
    ///
    /// # Safety
    ///
    /// `handle` is a stream of this context that stays alive as long as the returned
    /// [`Stream`] is used.
    pub unsafe fn external_stream(&self, handle: StreamHandle) -> Stream {
        self.implicit_stream(handle, StreamKind::External)
    }

    /// Wraps another library's stream that `owner` keeps alive (a cudarc `Arc<CudaStream>`,
    /// say): unlike [`external_stream`](Self::external_stream), the returned [`Stream`] and
    /// every memory ordered on it (allocated on it, or freed on it) hold `owner`, so the stream
    /// outlives the last stream-ordered free emm queues on it. emm never destroys it.
    ///
    /// # Safety
    ///
    /// `handle` is a stream of this context that stays alive as long as `owner` does.
    pub unsafe fn external_stream_owned(&self, handle: StreamHandle, owner: HostOwner) -> Stream {
        Stream::external_owned(handle, self.inner.cx.clone(), owner)
    }

    fn implicit_stream(&self, handle: StreamHandle, kind: StreamKind) -> Stream {
        Stream::new(handle, kind, self.inner.cx.clone(), None)
    }

    /// Creates an event (`cuEventCreate`; timing disabled unless `timing`); destroyed through
    /// the context's own queue when dropped.
    pub fn create_event(&self, timing: bool) -> Result<Event, EmmError> {
        let _live = self.enter("create_event")?;
        let flags = if timing {
            event_flags::DEFAULT
        } else {
            event_flags::DISABLE_TIMING
        };
        let cx = &self.inner.cx;
        let e = cx
            .driver
            .event_create(cx.context, flags)
            .map_err(|e| cx.driver_error("create_event", e))?;
        Ok(Event::new(
            e,
            timing,
            cx.clone(),
            Arc::clone(&self.inner.own),
        ))
    }

    /// Loads a module from a PTX, cubin or fatbin image (`cuModuleLoadData`); it is unloaded
    /// through the context's own queue when dropped or when the context is reset.
    pub fn load_module(&self, image: &[u8]) -> Result<Module, EmmError> {
        let _live = self.enter("load_module")?;
        let m = self
            .inner
            .cx
            .driver
            .module_load_data(self.inner.cx.context, image)
            .map_err(|e| EmmError::driver("load_module", self.inner.cx.device, e))?;
        Ok(self.inner.modules.register(m, self.inner.cx.device))
    }

    /// The PCI identity of this context's device.
    pub fn device_identity(&self) -> Result<DeviceIdentity, EmmError> {
        self.inner.cx.device_identity()
    }

    /// Whether this context's device can access memory of `peer` directly
    /// (`cuDeviceCanAccessPeer`; a device can always access its own).
    pub fn can_access_peer(&self, peer: DeviceOrdinal) -> Result<bool, EmmError> {
        if peer == self.inner.cx.device {
            return Ok(true);
        }
        self.inner
            .cx
            .driver
            .device_can_access_peer(self.inner.cx.device, peer)
            .map_err(|e| EmmError::driver("peer access query", self.inner.cx.device, e))
    }
}

impl Context {
    /// The context as the IPC layer sees it.
    pub(crate) fn endpoint(&self) -> Endpoint<'_> {
        Endpoint {
            cx: &self.inner.cx,
            manager: &*self.inner.manager,
            imports: &self.inner.imports,
        }
    }

    /// Issues the frees the manager's queue holds now (Numba's `deallocations.clear()`);
    /// returns how many were issued. Inside `defer_cleanup` nothing is issued. A manager
    /// without a queue has nothing to issue.
    pub fn flush_deallocations(&self) -> Result<usize, EmmError> {
        match self.inner.manager.deallocations() {
            Some(queue) => queue.flush(),
            None => Ok(0),
        }
    }
}

/// Replaces the in-use block of `segments` that holds graph pool segment `graph` (a graph pool
/// takes whole segments from the manager) with the pool's carved blocks: in use, or free
/// (kept for the pool's graphs, so cached). The block's allocation stays on the first.
fn carve_graph_segment(segments: &mut [Segment], graph: &GraphPoolSegment) {
    let i = segments.partition_point(|s| s.address <= graph.address);
    let Some(segment) = i.checked_sub(1).map(|i| &mut segments[i]) else {
        return;
    };
    let Some(at) = segment
        .blocks
        .iter()
        .position(|b| b.address == graph.address && b.state == BlockState::InUse)
    else {
        return;
    };
    let outer = segment.blocks[at].clone();
    let mut carved: Vec<Block> = graph
        .blocks
        .iter()
        .map(|&(address, bytes, free)| Block {
            address,
            bytes,
            state: if free {
                BlockState::Cached
            } else {
                BlockState::InUse
            },
            allocation: None,
            graph_pool: Some(graph.pool),
        })
        .collect();
    if let Some(first) = carved.first_mut() {
        first.allocation = outer.allocation.clone();
    }
    let end = graph.address + graph.bytes as u64;
    let outer_end = outer.address + outer.bytes as u64;
    if let Some(last) = carved.last_mut()
        && outer_end > end
    {
        // The manager's rounding past the pool's segment goes with its last block.
        last.bytes += (outer_end - end) as usize;
    }
    segment.blocks.splice(at..=at, carved);
}
