//! The `async-pool` manager: device memory from a stream-ordered driver pool
//! (`cuMemPoolCreate`, `cuMemAllocFromPoolAsync`, `cuMemFreeAsync`), in the manner of
//! cuda.core's `DeviceMemoryResource`, under the [`HostOnly`] layer.
//!
//! - The manager creates its own pool for the context at the first `initialize` (or
//!   allocation), with the release threshold at its maximum, so freed memory stays cached in
//!   the pool instead of going back to the system at every synchronisation.
//! - `memalloc` allocates and frees on the legacy default stream (0): emm's copies are
//!   synchronous, so work on that stream is complete when a copy returns, and a block freed
//!   there is safe to reuse by the next allocation. Work on other streams that uses such
//!   memory must be complete (synchronised) before the pointer is dropped.
//! - **Streams** ([`StreamOrdering::Driver`]): `memalloc_on` allocates with
//!   `cuMemAllocFromPoolAsync` on the caller's stream, and the last drop frees with
//!   `cuMemFreeAsync` on the allocation's stream (or the one given to
//!   [`MemoryPointer::free_on`]); for every other stream that used the block (recorded with
//!   [`MemoryPointer::record_stream`], or the allocation stream when the free moved), an event
//!   is recorded there and the freeing stream waits for it first. The driver then orders
//!   reuse: the block is reused on the freeing stream in order, and on other streams once the
//!   free ran, or with a dependency on it that the driver inserts.
//! - A pointer's last drop calls `cuMemFreeAsync` at once (it is cheap and does not
//!   synchronise), so nothing goes through the deferred queue.
//! - **Threads**: allocations and frees do not wait for each other. The driver's pool is
//!   thread-safe; an allocation or a free holds its thread's gate across its driver call (a
//!   per-thread shard entered without a read-modify-write, as the `pool` manager's shards
//!   are), and creation, export and reset take every gate (one `membarrier` for all), so that
//!   none of them runs while an allocation or a free is in flight. emm keeps the live
//!   allocations in 16 shards by address, each a slab whose slot the pointer's
//!   tag names (no hashing). The loom model `async_pool_reset_races_a_drop_and_an_allocation`
//!   checks that no call reaches a destroyed pool and that every allocation is freed once.
//! - **Records**: a pointer's last drop frees its block and keeps its record (the pointer's
//!   box, with its clone of the manager's shared state) in the block's shard, up to 32 a shard
//!   for `memalloc`'s pointers and 32 for `memalloc_on`'s; the next allocation of the same
//!   kind whose block falls in that shard revives it by setting the address, size and tag (and
//!   the stream: a `memalloc_on` record keeps its stream record, emptied at the free, so a
//!   parked record keeps no stream alive). A parked record names no slot, so it frees nothing
//!   if it is dropped instead (when the manager goes). The loom model
//!   `async_pool_stale_park_races_a_reset_and_a_new_allocation` checks that a pointer older
//!   than a reset frees nothing of the new pool.
//! - `trim` synchronises the stream and calls `cuMemPoolTrimTo(0)`; `reset` destroys the pool
//!   (which frees everything in it) and the next use creates a new one.
//! - Out of memory: the manager synchronises its stream and retries; then the host layer
//!   flushes its queue and retries once more. The driver keeps a block whose free the host
//!   has not observed reserved, for every allocation and even for `cuMemPoolTrimTo`; once
//!   observed, it takes cached memory back by itself when an allocation needs it, so no trim
//!   is needed (both measured on an H100: the suite's `pool_cache_under_pressure`).
//! - IPC: the driver does not export pool memory with `cuIpcGetMemHandle`; under `async-pool`
//!   `get_ipc_handle` refuses with [`EmmError::NotSupported`], naming the managers that can.
//!
//! # `async-pool-ipc`
//!
//! The same manager over a pool created for export (POSIX file descriptor handles). Its memory
//! crosses processes the driver's way, in the manner of cuda.core's IPC-enabled
//! `DeviceMemoryResource`:
//!
//! - [`Context::export_pool`](crate::Context::export_pool) exports the pool
//!   (`cuMemPoolExportToShareableHandle`) as a [`PoolExport`], which
//!   [`PoolExport::send`] passes over a Unix socket; the other process imports it with
//!   [`Runtime::import_pool`](crate::Runtime::import_pool).
//! - `get_ipc_handle` waits for the allocating stream (the importer must not touch memory
//!   before its allocation completed) and exports the allocation (`cuMemPoolExportPointer`);
//!   the handle's bytes name the pool by its [`PoolId`] and open like any handle's.
//! - A reset destroys the pool; the next pool has a new id, so handles and exports of the old
//!   one are refused by importers instead of reaching the wrong memory.

#![allow(unsafe_code)]

use std::fmt;
use std::sync::Arc;

use driver_sys::{DevicePtr, DriverError, MemPoolHandle, StreamHandle};

use crate::contract::factory::{FnFactory, ManagerContext};
use crate::contract::info::PoolStats;
use crate::contract::ipc::IpcHandle;
use crate::contract::manager::StreamOrdering;
use crate::contract::pool_export::{PoolExport, PoolId};
use crate::error::EmmError;
use crate::host::fences::Fences;
use crate::host::{
    AllocationKind, DeviceAllocator, DeviceExports, DeviceHoldings, HostLayer, HostOnly,
};
use crate::managers::default::DriverAllocator;
use crate::memory::pending::PendingDeallocs;
use crate::memory::pointer::{
    MemoryPointer, ParkedPointer, PoolHook, ReleaseHook, StreamUse, forget_hooks,
};
use crate::slab::Slab;
use crate::sync::{AtomicU64, AtomicUsize, BiasedGuard, Mutex, MutexGuard, Ordering, lock};
use crate::thread_slots::{self, Shard, thread_shard};

#[cfg(unix)]
mod export;

/// The name the stream-ordered pool manager is registered under.
pub const ASYNC_POOL_MANAGER: &str = "async-pool";

/// The name of the stream-ordered pool manager whose pool can be exported to other processes.
pub const ASYNC_POOL_IPC_MANAGER: &str = "async-pool-ipc";

/// The name of the stream-ordered pool manager over a managed-memory pool (cuda.core's
/// managed memory resource as a manager; CUDA 13 on): every allocation is managed memory, one
/// address for the host and every device, preferably kept on the context's device.
pub const ASYNC_POOL_MANAGED_MANAGER: &str = "async-pool-managed";

const STREAM: StreamHandle = StreamHandle::NULL;

/// What goes with the pool ([`Shared::pool`]), changed only with every gate held
/// ([`Shared::exclusive`]): allocations and frees hold their own thread's gate across their
/// driver call, so a reset cannot destroy the pool under them, and they do not wait for each
/// other (the driver's pool is thread-safe).
struct PoolState {
    /// The pool's name across processes (IPC-enabled pools only; new with every pool).
    id: Option<PoolId>,
    /// Whether the pool was exported to a file descriptor yet: measured on the H200, the
    /// driver refuses to export its allocations (`cuMemPoolExportPointer`) until it was.
    exported: bool,
}

/// Shards of the live set, so that threads allocating at once rarely share a lock.
const LIVE_SHARDS: usize = 16;

/// Records of `memalloc` pointers one shard keeps for the next allocations
/// ([`PoolHook::park`]): 128 bytes each, at most 16 × 32 of them.
const PARKED: usize = 32;

/// The bits of a pointer's tag that name its allocation's slot in its live shard (the shard is
/// its address's); the bits above are the pool's generation when it was allocated.
const SLOT_BITS: u32 = 32;
const SLOT_MASK: u64 = (1 << SLOT_BITS) - 1;
/// The slot in a parked record's tag: none (a shard's slab would need 2^32 live allocations
/// to hand it out), so a parked record dropped instead of revived releases nothing.
const NO_SLOT: u64 = SLOT_MASK;

/// One shard of the live set: the addresses of its allocations not freed yet, each in the
/// slot its pointer's tag names, and the records parked for the next `memalloc`.
#[derive(Default)]
struct LiveShard {
    slots: Slab<u64>,
    parked: Vec<ParkedPointer>,
    /// As `parked`, the records of `memalloc_on` pointers, each with its stream record (reset
    /// to no stream: it keeps no stream alive while parked).
    parked_on: Vec<ParkedPointer>,
    /// True once the manager is gone ([`Live::close`]): nothing is parked then, since a
    /// parked record's clone of the hook would keep the shared state alive.
    closed: bool,
}

impl LiveShard {
    /// Takes the allocation at `ptr` out if `slot` holds it.
    #[inline(always)]
    fn remove(&mut self, ptr: u64, slot: u64) -> bool {
        // A slot beyond `u32` (`NO_SLOT` included) is held by no allocation.
        let slot = slot as u32;
        if self.slots.get(slot) != Some(&ptr) {
            return false;
        }
        self.slots.discard(slot);
        true
    }
}

/// Allocations not freed yet, sharded by address: a reset frees them before it destroys the
/// pool, because the driver releases a destroyed pool's memory only once its allocations are
/// freed. A pointer names its allocation's slot in its tag, so recording and releasing one is
/// an index into a vector. A shard is locked only while the pool's lock is held (read or
/// write), or by `close`, never the other way round.
struct Live([Mutex<LiveShard>; LIVE_SHARDS]);

impl Live {
    fn new() -> Live {
        Live(std::array::from_fn(|_| Mutex::new(LiveShard::default())))
    }

    #[inline(always)]
    fn shard(&self, ptr: u64) -> &Mutex<LiveShard> {
        // Pool blocks are at least 256-byte aligned: mix the bits above the alignment.
        let h = (ptr >> 8) ^ (ptr >> 20);
        &self.0[(h as usize) % LIVE_SHARDS]
    }

    /// Records the allocation at `ptr`; returns its slot and a parked record of the kind
    /// `park` asks for, if the shard keeps one.
    #[inline(always)]
    fn record(&self, ptr: u64, park: Park) -> (u64, Option<ParkedPointer>) {
        let mut shard = lock(self.shard(ptr));
        let slot = shard.slots.insert(ptr);
        let parked = match park {
            Park::No => None,
            Park::Plain => shard.parked.pop(),
            Park::OnStream => shard.parked_on.pop(),
        };
        (u64::from(slot), parked)
    }

    /// Takes the allocation at `ptr` out if `slot` holds it (so once).
    #[inline(always)]
    fn remove(&self, ptr: u64, slot: u64) -> bool {
        lock(self.shard(ptr)).remove(ptr, slot)
    }

    /// Whether `ptr` is live in `slot` (the IPC export's check; pools are exported on Unix
    /// only).
    #[cfg(unix)]
    fn contains(&self, ptr: u64, slot: u64) -> bool {
        lock(self.shard(ptr)).slots.get(slot as u32) == Some(&ptr)
    }

    fn len(&self) -> usize {
        self.0.iter().map(|s| lock(s).slots.len()).sum()
    }

    /// Takes every address out (a reset, with the pool's lock held for writing); the parked
    /// records stay (they name no allocation).
    fn take_all(&self) -> Vec<u64> {
        let mut all = Vec::new();
        for s in &self.0 {
            all.extend(lock(s).slots.drain());
        }
        all
    }

    /// The manager is gone: the parked records go, and none is parked from now on.
    fn close(&self) {
        let mut parked = Vec::new();
        for s in &self.0 {
            let mut shard = lock(s);
            shard.closed = true;
            parked.append(&mut shard.parked);
            parked.append(&mut shard.parked_on);
        }
        // Dropped with no lock held: each names no slot, and releases nothing.
        drop(parked);
    }
}

/// Which parked record an allocation takes: none (a pointer kept out of line after a failed
/// free), a `memalloc` pointer's, or a `memalloc_on` pointer's (with its stream record).
#[derive(Clone, Copy)]
enum Park {
    No,
    Plain,
    OnStream,
}

struct Shared {
    cx: ManagerContext,
    /// Whether the pool is created for export (`async-pool-ipc`).
    ipc: bool,
    /// Whether the pool is a managed-memory pool (`async-pool-managed`).
    managed: bool,
    /// The pool's handle ([`NO_POOL`] when there is none), read under a gate; stored only with
    /// every gate and the state held.
    pool: AtomicU64,
    /// One per thread shard ([`thread_slots`]): an allocation or a free enters its thread's
    /// (its owner's fast path: no read-modify-write), creation, export and reset take them all.
    /// A read-write lock taken for reading by every allocation and free would put a shared
    /// read-modify-write on each.
    gates: Box<[Shard<()>]>,
    /// What creation, export and reset change: locked after every gate.
    state: Mutex<PoolState>,
    /// The pool's allocations not freed yet.
    live: Live,
    /// Bumped by `reset` (with every gate held); pointers of older generations
    /// free nothing. Kept shifted to a tag's high bits (`SLOT_BITS`): it wraps after 2^32
    /// resets, and a pointer that outlived exactly that many resets would still free nothing
    /// unless its slot held its own address again.
    generation: AtomicU64,
    queue: Arc<PendingDeallocs>,
    /// Events for the frees of blocks that other streams used.
    fences: Fences,
    /// Blocks whose last pointer dropped while their stream was being captured (the driver
    /// refuses `cuMemFreeAsync` there of memory from outside the capture): kept live, with
    /// their tag, and freed on their stream once it no longer captures (at an allocation).
    /// Locked after a gate; counted apart for the allocation path.
    after_capture: Mutex<Vec<(DevicePtr, StreamHandle, u64)>>,
    after_capture_count: AtomicUsize,
}

/// No pool: the value of [`Shared::pool`] before the first use and after a reset (a driver's
/// pool handle is a pointer, never null).
const NO_POOL: u64 = 0;

/// The pool a value of [`Shared::pool`] names, if any.
#[inline(always)]
fn pool_of(raw: u64) -> Option<MemPoolHandle> {
    // SAFETY: `Shared::pool` holds only NO_POOL or the raw value of a pool handle the
    // driver returned, and a reset destroys the pool only after storing NO_POOL.
    (raw != NO_POOL).then_some(unsafe { MemPoolHandle::from_raw(raw) })
}

impl Shared {
    /// This thread's gate, held while the pool is used: creation, export and reset wait for
    /// it. Not re-entrant: nothing done under it enters a gate of this manager again (a
    /// pointer dropped under it would).
    #[inline(always)]
    fn gate(&self) -> BiasedGuard<'_, ()> {
        let (shard, owner) = thread_shard();
        self.gates[shard].inner.enter(owner)
    }

    /// Every gate, then the state: no allocation or free is in flight or can start until the
    /// guards drop. The caller holds no gate of this manager.
    fn exclusive(&self) -> (Vec<BiasedGuard<'_, ()>>, MutexGuard<'_, PoolState>) {
        let gates = thread_slots::lock_all(&self.gates);
        (gates, lock(&self.state))
    }

    /// The pool, read under a gate.
    #[inline(always)]
    fn current_pool(&self) -> Option<MemPoolHandle> {
        pool_of(self.pool.load(Ordering::Acquire))
    }

    /// Whether `tag` is of the current pool (the generation, in the tag's high bits).
    #[inline(always)]
    fn current(&self, tag: u64) -> bool {
        self.generation.load(Ordering::Acquire) == tag & !SLOT_MASK
    }

    /// Frees `base` on `stream` once the last record of every other stream in `after` is done.
    fn free(&self, base: DevicePtr, tag: u64, stream: StreamHandle, after: Option<&StreamUse>) {
        let gate = self.gate();
        if self.current(tag) && self.live.remove(base.0, tag & SLOT_MASK) {
            self.free_taken(base, stream, after);
        }
        drop(gate);
    }

    /// [`free`](Self::free) of `base`, just taken out of the live set, with the thread's gate
    /// held.
    #[inline(always)]
    fn free_taken(&self, base: DevicePtr, stream: StreamHandle, after: Option<&StreamUse>) {
        let Some(_live) = self.cx.liveness.enter() else {
            return;
        };
        // SAFETY: `base` came from `cuMemAllocFromPoolAsync` of the current pool (the
        // generation matched, and the gate, which the caller holds, keeps a reset from
        // destroying the pool meanwhile); its last pointer dropped, and it was taken out
        // of the live set (once), so it is freed once and not used after but by work already
        // queued, which the freeing stream waits for; the context is alive (`_live`).
        if let Err(e) = unsafe { self.fences.free_async_after(base, stream, after) } {
            self.free_failed(base, stream, e);
        }
    }

    /// Freeing `base` on `stream` failed: deferred if the stream is being captured, else
    /// kept ([`keep_unfreed`](Self::keep_unfreed)). The caller holds the thread's gate.
    #[cold]
    #[inline(never)]
    fn free_failed(&self, base: DevicePtr, stream: StreamHandle, e: DriverError) {
        if self.cx.stream_is_captured(stream) != Ok(true) {
            return self.keep_unfreed(base, e);
        }
        let (slot, _) = self.live.record(base.0, Park::No);
        let tag = self.generation.load(Ordering::Acquire) | slot;
        let mut list = lock(&self.after_capture);
        list.push((base, stream, tag));
        self.after_capture_count
            .store(list.len(), Ordering::Release);
        tracing::debug!(device = %self.cx.device, ptr = %base, "freed while its stream is captured: freed once the capture ends");
    }

    /// Frees the blocks [`free_failed`](Self::free_failed) deferred whose stream no longer
    /// captures. The caller holds no gate of this manager.
    #[cold]
    #[inline(never)]
    fn free_after_captures(&self) {
        let gate = self.gate();
        let ready: Vec<(DevicePtr, StreamHandle, u64)> = {
            let mut list = lock(&self.after_capture);
            let mut ready = Vec::new();
            list.retain(|&(base, stream, tag)| {
                if !self.current(tag) {
                    return false; // a reset freed it
                }
                if self.cx.stream_is_captured(stream) != Ok(false) {
                    return true;
                }
                ready.push((base, stream, tag));
                false
            });
            self.after_capture_count
                .store(list.len(), Ordering::Release);
            ready
        };
        for (base, stream, tag) in ready {
            if self.live.remove(base.0, tag & SLOT_MASK) {
                self.free_taken(base, stream, None);
            }
        }
        drop(gate);
    }

    /// Freeing `base` failed: nothing was freed, and the block is kept (a reset frees it)
    /// rather than reused under other streams' work.
    #[cold]
    #[inline(never)]
    fn keep_unfreed(&self, base: DevicePtr, e: DriverError) {
        let device = self.cx.device;
        tracing::error!(device = %device, error = %e, ptr = %base, "freeing a block on its stream failed; the block is kept until the manager's reset, and the error is returned by the next flush");
        self.live.record(base.0, Park::No);
        self.queue
            .record_error(EmmError::driver("cuMemFreeAsync", device, e));
    }
}

// SAFETY: `park` (and `park_on`, which it hands stream-ordered records to) keeps the record it
// is offered (in a shard's parked lists) or hands it back; it drops it on no path.
#[allow(unsafe_code)]
unsafe impl PoolHook for Shared {
    /// A `memalloc` or `memalloc_on` pointer's last drop: its block is freed as `release`
    /// and `release_on_streams` free it (on the legacy default stream, or on its stream after
    /// the others that used it), and its record kept in its block's shard for the next
    /// allocation of its kind ([`ParkedPointer::revive_at`], [`ParkedPointer::revive_on`]),
    /// stamped with no slot, its stream record emptied; handed back if the shard is full, the
    /// manager is gone, or the block is not live (a reset took it).
    fn park(&self, mut record: ParkedPointer, _size: usize, tag: u64) -> Option<ParkedPointer> {
        if record.has_streams() {
            return self.park_on(record, tag);
        }
        let base = record.base();
        let gate = self.gate();
        if !self.current(tag) {
            return Some(record);
        }
        {
            let mut shard = lock(self.live.shard(base));
            if shard.closed || shard.parked.len() >= PARKED || !shard.remove(base, tag & SLOT_MASK)
            {
                return Some(record);
            }
            record.set_tag(tag | NO_SLOT);
            shard.parked.push(record);
        }
        self.free_taken(DevicePtr(base), STREAM, None);
        drop(gate);
        None
    }
}

impl Shared {
    /// [`PoolHook::park`] of a `memalloc_on` pointer's record: its streams are taken out for
    /// the free (the record keeps its stream record, emptied), and it is kept in `parked_on`.
    /// Out of line, so that the `memalloc` pair, which never parks a stream's record, does not
    /// carry its code.
    #[inline(never)]
    fn park_on(&self, mut record: ParkedPointer, tag: u64) -> Option<ParkedPointer> {
        let base = record.base();
        let gate = self.gate();
        if !self.current(tag) {
            return Some(record);
        }
        let streams = {
            let mut shard = lock(self.live.shard(base));
            if shard.closed
                || shard.parked_on.len() >= PARKED
                || !shard.remove(base, tag & SLOT_MASK)
            {
                return Some(record);
            }
            record.set_tag(tag | NO_SLOT);
            let streams = record.take_stream_use();
            shard.parked_on.push(record);
            streams
        };
        if let Some(s) = &streams {
            self.free_taken(DevicePtr(base), s.free_on, Some(s));
        }
        drop(gate);
        // What kept the streams alive goes once the free is queued (after the gate: their
        // drop may run anything, a stream's destruction included).
        drop(streams);
        None
    }
}

impl ReleaseHook for Shared {
    fn release(&self, base: DevicePtr, _size: usize, tag: u64) {
        self.free(base, tag, STREAM, None);
    }

    fn release_on_streams(&self, base: DevicePtr, _size: usize, tag: u64, streams: StreamUse) {
        self.free(base, tag, streams.free_on, Some(&streams));
    }

    fn is_live(&self, tag: u64) -> bool {
        self.current(tag)
    }
}

/// The device half of the `async-pool` manager ([`AsyncPoolManager`]).
pub struct AsyncPoolAllocator {
    shared: Arc<Shared>,
    /// `shared` as the release hook of the pointers `memalloc` and `memalloc_on` make: their
    /// records keep its clone when recycled (`MemoryPointer::with_stashed_hook`), so that
    /// allocating and freeing on several threads does not write the shared state's reference
    /// count.
    hook: Arc<dyn PoolHook>,
}

/// The stream-ordered pool manager: the [`HostLayer`] over an [`AsyncPoolAllocator`].
pub type AsyncPoolManager = HostOnly<AsyncPoolAllocator>;

impl Drop for AsyncPoolAllocator {
    fn drop(&mut self) {
        // The parked records hold clones of the shared state: without this they would keep it
        // alive after the manager; so would the depot's spare boxes.
        self.shared.live.close();
        forget_hooks([&self.hook]);
    }
}

impl fmt::Debug for AsyncPoolAllocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AsyncPoolAllocator")
            .field("device", &self.shared.cx.device)
            .field("pool", &self.shared.current_pool())
            .finish()
    }
}

impl AsyncPoolAllocator {
    /// The allocator for the manager whose host layer is `host`; the pool is created at the
    /// first use.
    pub fn new(host: &HostLayer) -> AsyncPoolAllocator {
        Self::with_ipc(host, false)
    }

    /// As [`new`](Self::new), with a pool that can be exported to other processes when `ipc`
    /// (the `async-pool-ipc` manager).
    pub fn with_ipc(host: &HostLayer, ipc: bool) -> AsyncPoolAllocator {
        Self::with_kind(host, ipc, false)
    }

    /// As [`new`](Self::new), over a managed-memory pool (the `async-pool-managed` manager).
    pub fn managed(host: &HostLayer) -> AsyncPoolAllocator {
        Self::with_kind(host, false, true)
    }

    fn with_kind(host: &HostLayer, ipc: bool, managed: bool) -> AsyncPoolAllocator {
        let shared = Arc::new(Shared {
            cx: host.context().clone(),
            ipc,
            managed,
            pool: AtomicU64::new(NO_POOL),
            gates: Shard::all(|| ()),
            state: Mutex::new(PoolState {
                id: None,
                exported: false,
            }),
            live: Live::new(),
            generation: AtomicU64::new(0),
            queue: Arc::clone(host.deallocations()),
            fences: Fences::new(host.context()),
            after_capture: Mutex::new(Vec::new()),
            after_capture_count: AtomicUsize::new(0),
        });
        AsyncPoolAllocator {
            hook: Arc::clone(&shared) as Arc<dyn PoolHook>,
            shared,
        }
    }

    /// The factory registered as `"async-pool"`.
    pub fn factory() -> FnFactory {
        FnFactory::new(ASYNC_POOL_MANAGER, |cx: &ManagerContext| {
            let host = HostLayer::new(cx);
            let device = AsyncPoolAllocator::new(&host);
            Ok(Box::new(HostOnly::from_parts(host, device)))
        })
    }

    /// The factory registered as `"async-pool-ipc"`: the pool is created for export.
    pub fn ipc_factory() -> FnFactory {
        FnFactory::new(ASYNC_POOL_IPC_MANAGER, |cx: &ManagerContext| {
            let host = HostLayer::new(cx);
            let device = AsyncPoolAllocator::with_ipc(&host, true);
            Ok(Box::new(HostOnly::from_parts(host, device)))
        })
    }

    /// The factory registered as `"async-pool-managed"`: the pool is a managed-memory pool.
    pub fn managed_factory() -> FnFactory {
        FnFactory::new(ASYNC_POOL_MANAGED_MANAGER, |cx: &ManagerContext| {
            let host = HostLayer::new(cx);
            let device = AsyncPoolAllocator::managed(&host);
            Ok(Box::new(HostOnly::from_parts(host, device)))
        })
    }

    fn name(&self) -> &'static str {
        if self.shared.ipc {
            ASYNC_POOL_IPC_MANAGER
        } else if self.shared.managed {
            ASYNC_POOL_MANAGED_MANAGER
        } else {
            ASYNC_POOL_MANAGER
        }
    }

    fn err(&self, op: &'static str) -> impl Fn(DriverError) -> EmmError + '_ {
        move |e| EmmError::driver(op, self.shared.cx.device, e)
    }

    /// The pool, created on first use with the release threshold at its maximum. The caller
    /// holds every gate and the state ([`Shared::exclusive`]).
    fn pool(&self, state: &mut PoolState) -> Result<MemPoolHandle, DriverError> {
        if let Some(p) = self.shared.current_pool() {
            return Ok(p);
        }
        let cx = &self.shared.cx;
        let pool = if self.shared.managed {
            let preferred = Some(driver_sys::MemLocation::Device(cx.device));
            cx.driver.mem_pool_create_managed(cx.context, preferred)?
        } else {
            cx.driver
                .mem_pool_create(cx.context, cx.device, self.shared.ipc)?
        };
        if pool.raw() == NO_POOL {
            // A null handle would read as "no pool" under the gates, and allocations would
            // make pools forever.
            return Err(DriverError::from_kind(
                "cuMemPoolCreate",
                driver_sys::ErrorKind::InvalidValue,
            )
            .with_detail(
                "the driver returned a null pool handle; please report this with the \
                         driver's version",
            ));
        }
        // SAFETY: created just above, handed to no one.
        let pool = unsafe { cx.adopt_new_pool(pool, false) }?;
        state.id = self.shared.ipc.then(PoolId::fresh);
        state.exported = false;
        tracing::debug!(device = %cx.device, ?pool, id = ?state.id, "stream-ordered pool created");
        self.shared.pool.store(pool.raw(), Ordering::Release);
        Ok(pool)
    }

    /// Returns what the pool holds unused to the system; the bytes released.
    pub fn trim(&self) -> Result<usize, EmmError> {
        let cx = &self.shared.cx;
        let _live = cx.enter("trim")?;
        let _gate = self.shared.gate();
        let Some(pool) = self.shared.current_pool() else {
            return Ok(0);
        };
        let before = cx
            .driver
            .mem_pool_usage(cx.context, pool)
            .map_err(self.err("trim"))?;
        cx.driver
            .stream_synchronize(cx.context, STREAM)
            .map_err(self.err("trim"))?;
        cx.driver
            .mem_pool_trim_to(cx.context, pool, 0)
            .map_err(self.err("trim"))?;
        let after = cx
            .driver
            .mem_pool_usage(cx.context, pool)
            .map_err(self.err("trim"))?;
        Ok(before.reserved.saturating_sub(after.reserved) as usize)
    }

    /// What the pool holds (`None` before the first use or after the device was reset).
    pub fn stats(&self) -> Option<PoolStats> {
        let cx = &self.shared.cx;
        let _live = cx.liveness.enter()?;
        let (pool, blocks) = {
            let _gate = self.shared.gate();
            (self.shared.current_pool()?, self.shared.live.len())
        };
        let usage = match cx.driver.mem_pool_usage(cx.context, pool) {
            Ok(u) => u,
            Err(e) => {
                tracing::warn!(device = %cx.device, error = %e, "reading the stream-ordered pool's usage failed; pool_stats reports no device pool");
                return None;
            }
        };
        Some(PoolStats {
            held_bytes: usage.reserved as usize,
            in_use_bytes: usage.used as usize,
            in_use_blocks: blocks,
            cached_bytes: usage.reserved.saturating_sub(usage.used) as usize,
            peak_held_bytes: usage.reserved_high as usize,
            ..PoolStats::default()
        })
    }
}

/// Off Unix: pools travel as POSIX file descriptors, which the platform does not have.
#[cfg(not(unix))]
impl AsyncPoolAllocator {
    fn no_ipc(&self, operation: &'static str) -> EmmError {
        EmmError::NotSupported {
            operation,
            manager: self.name().into(),
            advice: "stream-ordered pools are shared as POSIX file descriptors, which this \
                     platform does not have; use 'default' or 'pool' for memory you share \
                     between processes",
        }
    }

    fn export_allocation(&self, _memory: &MemoryPointer) -> Result<IpcHandle, EmmError> {
        Err(self.no_ipc("get_ipc_handle"))
    }

    fn export(&self) -> Result<PoolExport, EmmError> {
        Err(self.no_ipc("export_pool"))
    }
}

impl AsyncPoolAllocator {
    /// `cuMemAllocFromPoolAsync` of `bytes` on `stream`; out of memory, waits for `stream`
    /// and the legacy default stream (frees the host has not observed stay reserved) and
    /// retries, then the host layer flushes and retries once more.
    ///
    /// Returns the address, the pointer's tag (the pool's generation and the allocation's
    /// slot in the live set) and a parked record of the kind `park` asks for, if its shard
    /// keeps one.
    #[inline(always)]
    fn alloc(
        &self,
        host: &HostLayer,
        what: &'static str,
        bytes: usize,
        stream: StreamHandle,
        park: Park,
    ) -> Result<(DevicePtr, u64, Option<ParkedPointer>), EmmError> {
        if bytes == 0 {
            return Err(EmmError::ZeroSize { what });
        }
        let shared = &self.shared;
        let cx = &shared.cx;
        if shared.after_capture_count.load(Ordering::Acquire) > 0 {
            shared.free_after_captures();
        }
        host.attempt_allocation(what, AllocationKind::Device, bytes, || {
            loop {
                let gate = shared.gate();
                if let Some(pool) = shared.current_pool() {
                    // Under the gate: other threads allocate and free meanwhile, a reset
                    // waits, and the generation read below is the pool's.
                    let ptr = cx.alloc_from_pool(pool, bytes, stream)?;
                    let (slot, parked) = shared.live.record(ptr.0, park);
                    let generation = shared.generation.load(Ordering::Acquire);
                    return Ok((ptr, generation | slot, parked));
                }
                drop(gate);
                // No pool yet (first use, or after a reset): made with every gate held, then
                // the allocation goes round again.
                self.pool(&mut shared.exclusive().1)?;
            }
        })
    }
}

impl DeviceAllocator for AsyncPoolAllocator {
    fn memalloc(&self, host: &HostLayer, bytes: usize) -> Result<MemoryPointer, EmmError> {
        let (ptr, tag, parked) = self.alloc(host, "memalloc", bytes, STREAM, Park::Plain)?;
        if let Some(parked) = parked {
            return Ok(parked.revive_at(ptr, bytes, tag, 0));
        }
        let cx = &self.shared.cx;
        Ok(MemoryPointer::with_stashed_hook(
            cx.device,
            cx.context,
            ptr,
            bytes,
            &self.hook,
            (tag, 0),
            true,
        ))
    }

    fn memalloc_on(
        &self,
        host: &HostLayer,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<MemoryPointer, EmmError> {
        let (ptr, tag, parked) =
            match self.alloc(host, "memalloc_on", bytes, stream, Park::OnStream) {
                // The driver makes no graph memory of an IPC-enabled pool's: measured on an H100,
                // the capture refuses the allocation (and stays intact).
                Err(e)
                    if e.driver_kind() == Some(driver_sys::ErrorKind::NotSupported)
                        && self.shared.cx.stream_is_captured(stream) == Ok(true) =>
                {
                    return Err(EmmError::captured_stream(self.name()));
                }
                r => r?,
            };
        if let Some(parked) = parked {
            return Ok(parked.revive_on(ptr, bytes, tag, 0, stream));
        }
        let cx = &self.shared.cx;
        Ok(MemoryPointer::with_stashed_hook_on(
            cx.device,
            cx.context,
            ptr,
            bytes,
            &self.hook,
            (tag, 0),
            stream,
            true,
        ))
    }

    fn stream_ordering(&self) -> StreamOrdering {
        StreamOrdering::Driver
    }

    fn initialize(&self, host: &HostLayer) -> Result<(), EmmError> {
        DriverAllocator.initialize(host)?;
        let _live = self.shared.cx.enter("initialize")?;
        let (_gates, mut state) = self.shared.exclusive();
        self.pool(&mut state)
            .map(|_| ())
            .map_err(self.err("initialize"))
    }

    fn get_ipc_handle(
        &self,
        _host: &HostLayer,
        memory: &MemoryPointer,
    ) -> Result<IpcHandle, EmmError> {
        self.export_allocation(memory)
    }

    fn reset(&self, _host: &HostLayer) -> Result<(), EmmError> {
        let cx = &self.shared.cx;
        let (_gates, mut state) = self.shared.exclusive();
        self.shared
            .generation
            .fetch_add(1 << SLOT_BITS, Ordering::AcqRel);
        let live = self.shared.live.take_all();
        state.id = None;
        let Some(pool) = pool_of(self.shared.pool.swap(NO_POOL, Ordering::AcqRel)) else {
            return Ok(());
        };
        let Some(_live) = cx.liveness.enter() else {
            // The context is gone, and its pools with it.
            return Ok(());
        };
        tracing::info!(device = %cx.device, ?pool, outstanding = live.len(), "stream-ordered pool destroyed by reset");
        // SAFETY: the pool is this manager's, destroyed once (swapped out of `pool`), and
        // allocates nothing after (a new one is made on the next use); `live` are its
        // allocations not freed, whose pointers are stale from the generation bump on, so emm
        // neither uses nor frees them again; the context is alive (`_live`).
        let done = unsafe { cx.free_and_destroy_pool(pool, live, STREAM) };
        self.shared.fences.destroy_idle();
        done.map_err(self.err("reset"))
    }

    fn holdings(&self) -> Option<&dyn DeviceHoldings> {
        Some(self)
    }

    /// `async-pool-ipc` only: the other pools are not created for export.
    fn exports(&self) -> Option<&dyn DeviceExports> {
        self.shared.ipc.then_some(self as &dyn DeviceExports)
    }
}

impl DeviceHoldings for AsyncPoolAllocator {
    fn trim(&self, _host: &HostLayer) -> Result<usize, EmmError> {
        AsyncPoolAllocator::trim(self)
    }

    fn pool_stats(&self) -> Option<PoolStats> {
        self.stats()
    }
}

/// The pool's export (`async-pool-ipc`).
impl DeviceExports for AsyncPoolAllocator {
    fn export_pool(&self, _host: &HostLayer) -> Result<PoolExport, EmmError> {
        self.export()
    }
}

#[cfg(all(test, not(emm_loom)))]
mod tests;
