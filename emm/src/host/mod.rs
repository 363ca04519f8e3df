//! The host side of every NBEP 7 manager (Numba's `HostOnlyCUDAMemoryManager`), and how a
//! device-only plugin gets it by composition; see [`HostLayer`].
#![allow(unsafe_code)]

use std::sync::Arc;

use driver_sys::{
    DevicePtr, DriverError, ErrorKind, HostPtr, StreamHandle, host_alloc, host_register, mem_attach,
};

use crate::contract::factory::ManagerContext;
use crate::contract::info::PoolStats;
use crate::contract::ipc::IpcHandle;
use crate::contract::snapshot::{BlockState, HeldSegment, SegmentKind};
use crate::error::EmmError;
use crate::host::allocations::{AllocationTable, Entry, unpin_now};
use crate::host::driver_pool::{DriverHostPool, DriverHostRelease};
use crate::host::pinned_pool::{Kind, PinnedBlock, PinnedPool, Taken};
use crate::memory::host::{
    HostAllocFlags, HostKeeper, HostMemory, HostOwner, ManagedMemory, MappedMemory, PinnedMemory,
};
use crate::memory::pending::{DeferCleanup, Free, PendingDeallocs};
use crate::memory::pointer::{AllocationOwner, MemoryPointer, Release};

mod allocations;
mod driver_pool;
pub(crate) mod fences;
mod host_only;
pub(crate) mod pinned_pool;

pub use host_only::{
    DeviceAllocator, DeviceExports, DeviceHoldings, DeviceRecords, DeviceSleeper, HostOnly,
};

/// Which memory an allocation that ran out is of, for the error message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllocationKind {
    /// Device memory.
    Device,
    /// Page-locked host memory.
    Host,
}

/// The host side every NBEP 7 manager has (Numba's `HostOnlyCUDAMemoryManager`): pinned and
/// mapped host memory, the allocation table, the deferred-deallocation queue. A device-only
/// plugin gets it by composition:
///
/// - [`HostLayer`]: pinned and mapped host allocation (`cuMemHostAlloc`), pinning of existing
///   host memory (`cuMemHostRegister`), the allocation table and the deferred-deallocation
///   queue, `reset` and `defer_cleanup` for all of it, Numba's out-of-memory retry
///   ([`HostLayer::attempt_allocation`]) and IPC handles of `cuMemAlloc` memory
///   ([`HostLayer::ipc_handle`], Numba's `GetIpcHandleMixin`).
/// - [`DeviceAllocator`]: what a plugin that manages device memory only implements.
/// - [`HostOnly`]: a [`MemoryManager`](crate::contract::MemoryManager) made of a [`HostLayer`] and a [`DeviceAllocator`]. It
///   calls the host layer's `reset` and `defer_cleanup` itself, so a plugin cannot forget them
///   (NBEP 7 asks subclasses to remember to call `super()`).
///
/// Which kinds retry after out-of-memory and which bypass the queue, as in Numba:
///
/// | allocation | retry after a flush | release |
/// | --- | --- | --- |
/// | device memory (`cuMemAlloc`) | yes | `cuMemFree`, deferred, counted by size |
/// | mapped pinned memory (`memhostalloc(mapped)`) | yes | `cuMemFreeHost`, deferred, counted by size |
/// | unmapped pinned memory | no | `cuMemFreeHost`, deferred, counted as 0 bytes |
/// | mapped pin (`mempin(mapped)`) | yes | `cuMemHostUnregister` at once (not deferred) |
/// | unmapped pin | no | `cuMemHostUnregister` at once (not deferred) |
///
/// Unpins bypass the queue and `defer_cleanup` so that pinning the same memory again works at
/// once. A `reset` frees what the table holds (device memory, mapped memory and mapped pins);
/// unmapped pinned memory is not tracked and is released only when its handle drops.
#[derive(Debug)]
pub struct HostLayer {
    table: Arc<AllocationTable>,
    pinned: Option<Arc<PinnedPool>>,
    /// `memhostalloc` from the driver's pool in host memory (`cx.host_memory_pool`).
    driver_pool: Option<Arc<DriverHostRelease>>,
}

/// The pinned host pool keeps spare clones of its own `Arc` for the blocks it hands out, and
/// the allocation table parked records that hold clones of its own; with their owner gone they
/// must let them go, or they would keep themselves alive.
impl Drop for HostLayer {
    fn drop(&mut self) {
        if let Some(pool) = &self.pinned {
            pool.close();
        }
        self.table.close();
    }
}

impl HostLayer {
    /// The host layer of the manager of context `cx`, with an empty table and queue (capacity
    /// unset, so any free of a known size flushes at once until someone sets it).
    pub fn new(cx: &ManagerContext) -> HostLayer {
        let table = Arc::new(AllocationTable::new(cx));
        let driver_pool = cx.host_memory_pool.then(|| {
            Arc::new(DriverHostRelease {
                pool: Arc::new(DriverHostPool::new(cx)),
                queue: Arc::clone(table.queue()),
            })
        });
        let queue = Arc::clone(table.queue());
        HostLayer {
            table,
            pinned: cx.pinned_pool.map(|c| Arc::new(PinnedPool::new(c, queue))),
            driver_pool,
        }
    }

    /// What the pinned host pool holds, if the layer has one.
    pub fn pinned_pool_stats(&self) -> Option<PoolStats> {
        self.pinned.as_ref().map(|p| p.stats())
    }

    /// Frees every cached block of the pinned host pool, and the stream-ordered frees whose
    /// streams finished their work (no waiting); returns the pinned bytes released (queued,
    /// inside `defer_cleanup`). A trim thus leaves nothing the layer holds for lack of a later
    /// allocation to notice it.
    pub fn trim(&self) -> Result<usize, EmmError> {
        let polled = if self.table.waiting_for_streams() > 0 {
            self.poll_stream_frees()?
        } else {
            0
        };
        let Some(pool) = &self.pinned else {
            if polled > 0 {
                self.deallocations().flush()?;
            }
            return Ok(0);
        };
        let (frees, bytes) = pool.drain(false);
        let queue = self.deallocations();
        queue.push_all_without_flush(frees);
        queue.flush()?;
        Ok(bytes)
    }

    /// The context the layer serves.
    pub fn context(&self) -> &ManagerContext {
        self.table.context()
    }

    /// The deferred-deallocation queue.
    pub fn deallocations(&self) -> &Arc<PendingDeallocs> {
        self.table.queue()
    }

    /// The live device allocations the table tracks, as segments of one block each (the
    /// default manager's segments).
    pub(crate) fn tracked_device_segments(&self) -> Vec<HeldSegment> {
        self.table.device_segments()
    }

    /// Device memory whose `cuMemFree` waits in the deferred queue, as segments of one
    /// pending block each: memory still held from the driver.
    pub(crate) fn queued_device_segments(&self) -> Vec<HeldSegment> {
        self.deallocations()
            .snapshot()
            .into_iter()
            .filter_map(|f| match f {
                Free::Device { ptr, bytes } => Some(HeldSegment::whole(
                    ptr.0,
                    bytes,
                    SegmentKind::DriverAllocation,
                    BlockState::PendingFree,
                )),
                _ => None,
            })
            .collect()
    }

    /// Number of tracked allocations (device, mapped, mapped pins) not yet released.
    pub fn live_allocations(&self) -> usize {
        self.table.live()
    }

    /// Numba's `_attempt_allocation`: runs `allocate`; on out-of-memory flushes the queue and
    /// runs it once more (inside `defer_cleanup` the flush frees nothing). Any other error, or
    /// a second out-of-memory, is returned.
    #[inline(always)]
    pub fn attempt_allocation<T>(
        &self,
        what: &'static str,
        kind: AllocationKind,
        bytes: usize,
        mut allocate: impl FnMut() -> Result<T, DriverError>,
    ) -> Result<T, EmmError> {
        let cx = self.context();
        let _live = cx.enter(what)?;
        // Stream-ordered frees whose streams are done join the queue (no waiting).
        self.table.poll_stream_frees(false)?;
        match allocate() {
            Ok(v) => Ok(v),
            Err(e) => self.retry_allocation(what, kind, bytes, e, &mut allocate),
        }
    }

    /// [`attempt_allocation`](Self::attempt_allocation) after the first attempt failed with
    /// `e` (out of line: the allocation that succeeds does not carry it).
    #[cold]
    #[inline(never)]
    fn retry_allocation<T>(
        &self,
        what: &'static str,
        kind: AllocationKind,
        bytes: usize,
        e: DriverError,
        allocate: &mut dyn FnMut() -> Result<T, DriverError>,
    ) -> Result<T, EmmError> {
        let cx = self.context();
        if e.kind() != ErrorKind::OutOfMemory {
            return Err(EmmError::driver(what, cx.device, e));
        }
        let queue = self.deallocations();
        let waiting = self.table.waiting_for_streams();
        if waiting > 0 {
            tracing::warn!(device = %cx.device, what, bytes, waiting, "out of memory; waiting for the streams of stream-ordered frees");
            self.table.poll_stream_frees(true)?;
        }
        tracing::warn!(
            device = %cx.device,
            what,
            bytes,
            pending = queue.len(),
            deferred = queue.is_disabled(),
            "out of memory; flushing pending deallocations and retrying once"
        );
        let flushed = queue.flush()?;
        cx.events.retried();
        let mut made = allocate();
        // Then the context's callback, for device memory: it may free some and ask again.
        let mut asked = 0;
        let out_of_memory = |made: &Result<T, DriverError>| matches!(made, Err(e) if e.kind() == ErrorKind::OutOfMemory);
        // An allocation made from inside the callback (on this thread, in this context) does
        // not call it again: it would recurse with every allocation the callback makes.
        let inside = cx.liveness.called_back_here();
        if kind == AllocationKind::Device && out_of_memory(&made) {
            asked = cx
                .events
                .call_back(&cx.liveness, cx.device, what, bytes, &mut || {
                    made = allocate();
                    !out_of_memory(&made)
                });
        }
        match made {
            Ok(v) => Ok(v),
            Err(e) if e.kind() == ErrorKind::OutOfMemory => Err(match kind {
                AllocationKind::Device => {
                    let mut e = self.out_of_memory(what, bytes, flushed, asked, e);
                    if inside && cx.events.callback().is_some() {
                        tracing::warn!(device = %cx.device, what, bytes, "out of memory inside the out-of-memory callback; the callback is not called again");
                        if let EmmError::OutOfMemory {
                            report: Some(r), ..
                        } = &mut e
                        {
                            r.inside_callback = true;
                        }
                    }
                    e
                }
                AllocationKind::Host => EmmError::OutOfHostMemory {
                    device: cx.device,
                    requested: bytes,
                    flushed,
                    source: e,
                },
            }),
            Err(e) => Err(EmmError::driver(what, cx.device, e)),
        }
    }

    /// The error of a device allocation of `bytes` that stays out of memory (the driver's
    /// `source`) after `flushed` deferred frees and `asked` retries of the context's callback:
    /// counted, with the device's free and total bytes and the context's report.
    #[cold]
    #[inline(never)]
    pub(crate) fn out_of_memory(
        &self,
        what: &'static str,
        bytes: usize,
        flushed: usize,
        asked: u32,
        source: DriverError,
    ) -> EmmError {
        let cx = self.context();
        let info = cx.driver.mem_get_info(cx.context).unwrap_or_default();
        cx.events.out_of_memory();
        let e = EmmError::OutOfMemory {
            device: cx.device,
            requested: bytes,
            free: info.free,
            total: info.total,
            flushed,
            report: cx.events.report(bytes, asked),
            source,
        };
        tracing::warn!(device = %cx.device, what, bytes, error = %e, "out of memory");
        e
    }

    /// Tracks `bytes` of device memory at `base` allocated with `cuMemAlloc`: the returned
    /// pointer queues a `cuMemFree` when its last clone drops, and `reset` frees it.
    ///
    /// # Safety
    ///
    /// `base .. base + bytes` came from `cuMemAlloc` (or `cuMemAllocManaged`) in this
    /// context, is tracked once, and is freed by nothing else: the pointer's drop frees it, and
    /// emm's safe copies and sets use the range until then.
    #[inline(always)]
    pub unsafe fn track_device_allocation(&self, base: DevicePtr, bytes: usize) -> MemoryPointer {
        let cx = self.context();
        tracing::debug!(device = %cx.device, bytes, ptr = %base, "device memory allocated");
        self.track_freed_by_mem_free(base, bytes)
    }

    /// As [`track_device_allocation`](Self::track_device_allocation), for memory handed out
    /// on `stream` (a `memalloc_on` over `cuMemAlloc`): when the last pointer drops, an event
    /// is recorded on the stream it is freed on and on every stream recorded as using it, and
    /// the `cuMemFree` is queued only once those events completed (checked without waiting at
    /// each allocation, waited for when the device is out of memory). The memory itself is
    /// usable on every stream at once.
    ///
    /// # Safety
    ///
    /// As [`track_device_allocation`](Self::track_device_allocation).
    pub unsafe fn track_device_allocation_on(
        &self,
        base: DevicePtr,
        bytes: usize,
        stream: StreamHandle,
    ) -> MemoryPointer {
        let cx = self.context();
        tracing::debug!(device = %cx.device, bytes, ptr = %base, ?stream, "device memory allocated on a stream");
        self.track_freed_by_mem_free_on(base, bytes, stream)
    }

    /// Queues the `cuMemFree` of each stream-ordered free whose streams finished their work
    /// (no waiting); returns how many. Allocations do this by themselves, a batch at a time.
    pub fn poll_stream_frees(&self) -> Result<usize, EmmError> {
        let cx = self.context();
        let _live = cx.enter("poll_stream_frees")?;
        self.table.poll_every_stream_free()
    }

    /// Stream-ordered frees still waiting for their streams.
    pub fn stream_frees_waiting(&self) -> usize {
        self.table.waiting_for_streams()
    }

    /// Records `bytes` at `base`, released by `cuMemFree` (device and managed memory), in the
    /// table, and returns the pointer that owns it: a record the table parked, revived, or a
    /// new one.
    #[inline(always)]
    fn track_freed_by_mem_free(&self, base: DevicePtr, bytes: usize) -> MemoryPointer {
        let (recorded, parked) = self.table.record_device(base, bytes);
        match parked {
            Some(parked) => parked.revive_tracked(base, bytes, recorded),
            None => self.tracked_pointer(base, bytes, recorded, None),
        }
    }

    /// As [`track_freed_by_mem_free`](Self::track_freed_by_mem_free), for memory handed out
    /// on `stream`.
    fn track_freed_by_mem_free_on(
        &self,
        base: DevicePtr,
        bytes: usize,
        stream: StreamHandle,
    ) -> MemoryPointer {
        let recorded = self.table.record(Entry::Device { ptr: base, bytes });
        self.tracked_pointer(base, bytes, recorded, Some(stream))
    }

    /// A new pointer to `bytes` at `base`, recorded in the table as `(key, generation)`.
    #[inline(never)]
    fn tracked_pointer(
        &self,
        base: DevicePtr,
        bytes: usize,
        (key, generation): (u64, u64),
        stream: Option<StreamHandle>,
    ) -> MemoryPointer {
        let cx = self.context();
        MemoryPointer::from_parts(
            cx.device,
            cx.context,
            base,
            bytes,
            Release::Tracked {
                table: Arc::clone(&self.table) as Arc<dyn AllocationOwner>,
                key,
                generation,
            },
            None,
            stream,
        )
    }

    fn device_pointer_of(&self, host: HostPtr) -> Result<DevicePtr, EmmError> {
        let cx = self.context();
        cx.driver
            .mem_host_get_device_pointer(cx.context, host)
            .map_err(|e| EmmError::driver("mapping host memory", cx.device, e))
    }

    fn mapped(
        &self,
        host: HostPtr,
        bytes: usize,
        entry: Entry,
        owner: Option<HostOwner>,
    ) -> Result<HostMemory, EmmError> {
        let device_ptr = self.device_pointer_of(host)?;
        Ok(self.mapped_at(host, device_ptr, bytes, entry, owner))
    }

    fn mapped_at(
        &self,
        host: HostPtr,
        device_ptr: DevicePtr,
        bytes: usize,
        entry: Entry,
        owner: Option<HostOwner>,
    ) -> HostMemory {
        let cx = self.context();
        let (key, generation) = self.table.record(entry);
        let device = MemoryPointer::from_release(
            cx.device,
            cx.context,
            device_ptr,
            bytes,
            Release::Tracked {
                table: Arc::clone(&self.table) as Arc<dyn AllocationOwner>,
                key,
                generation,
            },
            owner,
        );
        // SAFETY: `host` was allocated mapped at `device_ptr` with `bytes` bytes, and `device`
        // releases it.
        HostMemory::Mapped(unsafe { MappedMemory::new(host, device) })
    }

    /// `cuMemHostAlloc` of `bytes` with `flags`, under Numba's rules (mapped memory retries
    /// after out-of-memory, unmapped does not), and the device pointer of mapped memory. A
    /// mapping that fails frees the allocation again.
    fn host_alloc_from_driver(
        &self,
        bytes: usize,
        mapped: bool,
        flags: u32,
    ) -> Result<(HostPtr, Option<DevicePtr>), EmmError> {
        let cx = self.context();
        let allocate = || cx.driver.mem_host_alloc(cx.context, bytes, flags);
        let host = if mapped {
            self.attempt_allocation("memhostalloc", AllocationKind::Host, bytes, allocate)?
        } else {
            let _live = cx.enter("memhostalloc")?;
            allocate().map_err(|e| EmmError::driver("memhostalloc", cx.device, e))?
        };
        if !mapped {
            return Ok((host, None));
        }
        match self.device_pointer_of(host) {
            Ok(device) => Ok((host, Some(device))),
            Err(e) => {
                // SAFETY: allocated just above and handed to no one.
                if let Err(e) = unsafe { cx.driver.mem_free_host(cx.context, host) } {
                    tracing::error!(device = %cx.device, error = %e, "freeing pinned memory whose mapping failed");
                }
                Err(e)
            }
        }
    }

    /// `memhostalloc` through the pinned host pool: a cached block of the request's size
    /// class, or a new one from the driver.
    fn pooled_host_alloc(
        &self,
        pool: &Arc<PinnedPool>,
        bytes: usize,
        kind: Kind,
    ) -> Result<HostMemory, EmmError> {
        let Taken {
            block,
            mut generation,
            hook,
        } = pool.take(kind);
        let block = match block {
            Some(block) => block,
            None => {
                let mapped = kind.mapped();
                let (host, device) =
                    self.host_alloc_from_driver(kind.size, mapped, kind.flags())?;
                let home;
                (generation, home) = pool.grew(kind.size);
                tracing::debug!(device = %self.context().device, bytes = kind.size, host = %host, mapped, "pinned host pool grew");
                PinnedBlock {
                    host,
                    device,
                    size: kind.size,
                    list: kind.list,
                    home,
                }
            }
        };
        if let Some(device_ptr) = block.device {
            let entry = Entry::Pooled {
                block,
                generation,
                pool: Arc::clone(pool),
            };
            return Ok(self.mapped_at(block.host, device_ptr, bytes, entry, None));
        }
        // The shard's spare clone of the pool's `Arc` when it had one: the block's drop hands
        // it back (`release_owned`).
        let hook = hook.unwrap_or_else(|| Arc::clone(pool));
        // SAFETY: the block is page-locked memory of the pool's, handed out once and owned by the
        // returned value until its drop hands it back.
        Ok(HostMemory::Pinned(unsafe {
            PinnedMemory::with_hook(block.host, bytes, hook, PinnedPool::tag(generation, &block))
        }))
    }

    /// Numba's `memallocmanaged`: `cuMemAllocManaged`, attached globally if `attach_global`,
    /// else to the host. Like device memory, it retries after out-of-memory, is tracked, and
    /// its `cuMemFree` goes through the deferred queue, counted by size.
    pub fn memallocmanaged(
        &self,
        bytes: usize,
        attach_global: bool,
    ) -> Result<ManagedMemory, EmmError> {
        if bytes == 0 {
            return Err(EmmError::ZeroSize {
                what: "memallocmanaged",
            });
        }
        let cx = self.context().clone();
        let flags = if attach_global {
            mem_attach::GLOBAL
        } else {
            mem_attach::HOST
        };
        let ptr = self.attempt_allocation(
            "memallocmanaged",
            AllocationKind::Device,
            bytes,
            &mut || cx.driver.mem_alloc_managed(cx.context, bytes, flags),
        )?;
        tracing::debug!(device = %cx.device, bytes, %ptr, attach_global, "managed memory allocated");
        let device = self.track_freed_by_mem_free(ptr, bytes);
        // SAFETY: `ptr` is the `cuMemAllocManaged` allocation of `bytes` made above, which
        // `device` frees.
        Ok(unsafe { ManagedMemory::new(device, attach_global) })
    }

    /// Numba's `memhostalloc`: `cuMemHostAlloc` with `DEVICEMAP` if `flags.mapped`, `PORTABLE`
    /// if `flags.portable`, `WRITECOMBINED` if `flags.write_combined`. Mapped memory retries
    /// after out-of-memory and is tracked; unmapped memory is not, and its free counts as 0
    /// bytes.
    pub fn memhostalloc(
        &self,
        bytes: usize,
        flags: HostAllocFlags,
    ) -> Result<HostMemory, EmmError> {
        let HostAllocFlags {
            mapped,
            portable,
            write_combined: wc,
        } = flags;
        if bytes == 0 {
            // The driver would hand back a null pointer, which cannot be mapped or freed usefully.
            return Err(EmmError::ZeroSize {
                what: "memhostalloc",
            });
        }
        if let Some(release) = &self.driver_pool {
            return self.memhostalloc_from_driver_pool(release, bytes, mapped, portable, wc);
        }
        let cx = self.context();
        let mut flags = 0;
        if mapped {
            flags |= host_alloc::DEVICEMAP;
        }
        if portable {
            flags |= host_alloc::PORTABLE;
        }
        if wc {
            flags |= host_alloc::WRITECOMBINED;
        }
        if let Some(pool) = &self.pinned
            && let Some(kind) = pool.kind(bytes, flags)
        {
            return self.pooled_host_alloc(pool, bytes, kind);
        }
        let (host, device) = self.host_alloc_from_driver(bytes, mapped, flags)?;
        tracing::debug!(device = %cx.device, bytes, host = %host, mapped, portable, wc, "pinned host memory allocated");
        if let Some(device_ptr) = device {
            let entry = Entry::Host { ptr: host, bytes };
            return Ok(self.mapped_at(host, device_ptr, bytes, entry, None));
        }
        let queue = Arc::clone(self.deallocations());
        // The queue keeps the memory during accesses: it knows the context's liveness.
        let keeper = Arc::clone(&queue) as Arc<dyn HostKeeper>;
        // SAFETY: `host .. host + bytes` was just allocated by `cuMemHostAlloc` and is freed only
        // by this value's release, or with its context, which the keeper answers for.
        let pinned = unsafe {
            PinnedMemory::with_release(host, bytes, None, move |ptr, _| {
                queue.push_from_drop(Free::Host { ptr, bytes: 0 });
            })
        };
        Ok(HostMemory::Pinned(pinned.kept_by(keeper, 0)))
    }

    /// Numba's `mempin`: page-locks `ptr .. ptr + size` with `cuMemHostRegister` (`DEVICEMAP`
    /// if `mapped`), keeping `owner` alive until it is unpinned. Mapped pins retry after
    /// out-of-memory and are tracked; every unpin happens at once when the last handle drops.
    ///
    /// # Safety
    ///
    /// - `ptr .. ptr + size` is host memory that `owner` keeps alive.
    /// - While the pin lives, no Rust reference to that memory is used while the device or a
    ///   driver copy may write it (with `mapped`, device work can write it at any time).
    pub unsafe fn mempin(
        &self,
        owner: HostOwner,
        ptr: HostPtr,
        size: usize,
        mapped: bool,
    ) -> Result<HostMemory, EmmError> {
        if size == 0 {
            return Err(EmmError::ZeroSize { what: "mempin" });
        }
        let cx = self.context().clone();
        let flags = if mapped { host_register::DEVICEMAP } else { 0 };
        // SAFETY: the caller vouches for the range and its use (this function's contract).
        let register = || unsafe { cx.driver.mem_host_register(cx.context, ptr, size, flags) };
        if mapped {
            self.attempt_allocation("mempin", AllocationKind::Host, size, register)?;
        } else {
            let _live = cx.enter("mempin")?;
            register().map_err(|e| EmmError::driver("mempin", cx.device, e))?;
        }
        tracing::debug!(device = %cx.device, bytes = size, host = %ptr, mapped, "host memory pinned");
        if mapped {
            return self
                .mapped(
                    ptr,
                    size,
                    Entry::Unpin {
                        ptr,
                        owner: Arc::clone(&owner),
                    },
                    Some(owner),
                )
                .inspect_err(|_| {
                    // SAFETY: registered just above and handed to no one.
                    if let Err(e) = unsafe { cx.driver.mem_host_unregister(cx.context, ptr) } {
                        tracing::error!(device = %cx.device, error = %e, "unpinning a range whose mapping failed");
                    }
                });
        }
        let queue = Arc::clone(self.deallocations());
        // SAFETY: `ptr .. ptr + size` was just page-locked (`cuMemHostRegister`) in `owner`'s
        // buffer, which the value keeps alive until its release unpins it.
        Ok(HostMemory::Pinned(unsafe {
            PinnedMemory::with_release(ptr, size, Some(owner), move |p, _| {
                unpin_now(&cx, &queue, p);
            })
        }))
    }

    /// Frees everything tracked (device memory, mapped memory, mapped pins), then flushes the
    /// queue (Numba's `HostOnlyCUDAMemoryManager.reset`). Inside `defer_cleanup` the frees stay
    /// queued; unpins happen at once.
    pub fn reset(&self) -> Result<(), EmmError> {
        tracing::info!(device = %self.context().device, live = self.table.live(), pending = self.deallocations().len(), "resetting the host layer");
        if let Some(pool) = &self.pinned {
            // The table's reset flushes these with its own frees.
            self.deallocations()
                .push_all_without_flush(pool.drain(true).0);
        }
        let table = self.table.reset().map(|_| ());
        let host_pool = self.driver_pool.as_ref().map_or(Ok(()), |r| r.pool.reset());
        table.and(host_pool)
    }

    /// `memhostalloc` from the driver's pool in host memory (`driver_pool.rs`): mapped and
    /// unmapped alike (the memory is one address for the host and the device, so it is
    /// retried after out-of-memory as Numba's mapped memory is); portable and write-combined
    /// memory refused (only `cuMemHostAlloc` makes them).
    fn memhostalloc_from_driver_pool(
        &self,
        release: &Arc<DriverHostRelease>,
        bytes: usize,
        mapped: bool,
        portable: bool,
        wc: bool,
    ) -> Result<HostMemory, EmmError> {
        let cx = self.context();
        if portable || wc {
            return Err(EmmError::InvalidArgument {
                what: "memhostalloc",
                reason: "portable and write-combined memory come from cuMemHostAlloc, and this \
                         runtime takes host memory from the driver's host memory pool \
                         (EMM_HOST_MEMORY_POOL); ask without those flags, or turn the pool off"
                    .into(),
            });
        }
        {
            // The pool and its stream first: their failures are errors, not out-of-memory to
            // retry.
            let _live = cx.enter("memhostalloc")?;
            release
                .pool
                .prepare()
                .map_err(|e| EmmError::driver("memhostalloc", cx.device, e))?;
        }
        // The pool's memory is mapped memory, whatever was asked: retried after out-of-memory.
        let (ptr, tag) =
            self.attempt_allocation("memhostalloc", AllocationKind::Host, bytes, &mut || {
                release.pool.allocate(bytes)
            })?;
        {
            let _live = cx.enter("memhostalloc")?;
            release
                .pool
                .ready(ptr)
                .map_err(|e| EmmError::driver("memhostalloc", cx.device, e))?;
        }
        tracing::debug!(device = %cx.device, bytes, ptr = %ptr, mapped, "pinned host memory allocated from the host memory pool");
        let host = HostPtr(ptr.0 as usize);
        if mapped {
            // SAFETY: `ptr .. ptr + bytes` was just allocated from the host memory pool, mapped at
            // this address for every device of the context, and freed only by the hook.
            let device = unsafe {
                MemoryPointer::with_hook(
                    cx.device,
                    cx.context,
                    ptr,
                    bytes,
                    Arc::clone(release) as Arc<dyn crate::memory::pointer::ReleaseHook>,
                    tag,
                )
            };
            // SAFETY: as above: `host` is mapped at `ptr`, and `device` releases it.
            return Ok(HostMemory::Mapped(unsafe {
                MappedMemory::new(host, device)
            }));
        }
        let keeper = Arc::clone(release) as Arc<dyn HostKeeper>;
        let release = Arc::clone(release);
        // SAFETY: `host .. host + bytes` was just allocated from the host memory pool and is freed
        // by this value's release, or by the pool's reset or its context's end, which the
        // keeper (the release) answers for.
        let pinned = unsafe {
            PinnedMemory::with_release(host, bytes, None, move |p, _| release.free(p.0 as u64, tag))
        };
        Ok(HostMemory::Pinned(pinned.kept_by(keeper, tag)))
    }

    /// Suspends the queue's flushing while the guard lives.
    pub fn defer_cleanup(&self) -> DeferCleanup {
        self.deallocations().defer_cleanup()
    }

    /// An IPC handle for `memory`, which must lie in `cuMemAlloc` memory of this context
    /// (Numba's `GetIpcHandleMixin`): the handle names the whole allocation, the offset is the
    /// view's start from the allocation's base, the size is the view's.
    pub fn ipc_handle(&self, memory: &MemoryPointer) -> Result<IpcHandle, EmmError> {
        let cx = self.context();
        let _live = cx.enter("get_ipc_handle")?;
        let err = |op| move |e| EmmError::driver(op, cx.device, e);
        let (base, _) = cx
            .driver
            .mem_get_address_range(cx.context, memory.device_ptr())
            .map_err(err("get_ipc_handle"))?;
        let handle = cx
            .driver
            .ipc_get_mem_handle(cx.context, base)
            .map_err(err("get_ipc_handle"))?
            .into();
        let source = cx.device_identity()?;
        let offset = (memory.device_ptr().0 - base.0) as usize;
        Ok(IpcHandle::exported(
            memory.clone(),
            handle,
            memory.size(),
            offset,
            source,
        ))
    }
}
