//! The `pool` manager: a device memory pool in the manner of RMM's pool resource, as a
//! [`DeviceAllocator`] under the [`HostOnly`] layer.
//!
//! **Streams.** Memory from `memalloc` is not stream ordered: a block goes back to the pool
//! when its last pointer drops, and the next allocation may hand it out at once, so work that
//! a stream still runs on the memory must be complete (synchronised) before the pointer is
//! dropped. Memory from `memalloc_on` is ([`StreamOrdering::PerStream`], `streams.rs`): each
//! stream has an arena of its own chunks; a block freed on a stream goes back to it at once,
//! merged with its free neighbours, for that stream's next allocations with no driver call,
//! and a block other streams used waits for an event recorded on each of them first. Before
//! the pool grows for a stream, other streams' free space serves it, behind their work.
//!
//! # Design
//!
//! - **Chunks.** The pool grows by driver allocations (`cuMemAlloc`): for a request up to
//!   [`PoolConfig::chunk_size`], by an eighth of what it holds (at least 2 MiB, at most the
//!   chunk size, at least the request); a larger request gets a chunk of its own, which serves
//!   only requests above the chunk size (`arena.rs`, `Arenas`). `vmm-pool` maps its chunks
//!   side by side in one address range instead (`vmm.rs`), each growth as pieces of physical
//!   memory (a sixteenth of the growth, from 2 MiB up to 64 MiB, or the size
//!   [`PoolConfig::vmm_piece`] sets): their free space merges, every size is served
//!   from it, a growth extends the free block at the end in place, and a piece that a hole
//!   leaves wholly free can move to where a growth needs it. Every block is a multiple of 256 bytes and
//!   256-byte aligned, as `cuMemAlloc`'s are.
//! - **Memory held is bounded by memory in use.** Before it grows, the pool takes back what the
//!   shards cache and the free chunks of streams with no work pending, then the wholly free
//!   chunks of busy streams (the growing stream waits for their work on the GPU), tries again,
//!   and then gives the chunks with nothing in use back to the driver, but for those it may
//!   keep: the largest first, while it would then hold at most an eighth more than the most
//!   stream-ordered memory it had in use at a growth since its last trim (`KEPT_DIVISOR`; a
//!   pool used through `memalloc` alone keeps none). A program whose large
//!   blocks change size from step to step finds its chunks again at the next step, where
//!   giving back every free chunk made a `cuMemFree` and a `cuMemAlloc` at each step. The
//!   growing stream's chunks go back after the pool has waited for that stream's work, so
//!   that it never holds the chunks it gives back and the one it grows by at once. A stream
//!   takes a wholly free chunk of the shared arena for a request above the chunk size
//!   whatever its size (the smallest that holds it). `vmm-pool` gives nothing back when it
//!   grows: it keeps the pieces under the block it extends and moves free pieces elsewhere
//!   (up to what the growth maps) to where the growth needs them, unmapped and mapped again,
//!   making new physical memory only for the rest; its memory goes back to the driver on a
//!   trim, out of memory, or a reset. The trace corpus test (`integration/tests/traces.rs`)
//!   holds `pool` to 1.25 times peak live, `vmm-pool` to 1.10, on logs of programs recorded
//!   on the GPU with the work they had in flight too.
//! - **The arena** holds the free space of all chunks in bins by size (sixteen per doubling,
//!   with a bitmap of the non-empty ones) and in two address maps (by start and by end):
//!   finding a block, splitting it and merging a freed block with its free neighbours take
//!   constant time, never a scan of the free blocks (`arena.rs`). Requests above
//!   [`PoolConfig::small_max`] are served from the arena, unless the thread's shard holds a
//!   free block of exactly their size: a shard keeps the last 8 such blocks freed on its
//!   thread (within its byte bound below), and besides them the last block larger than the
//!   bound (its *oversize* slot, outside the bound; before the pool grows it takes every
//!   shard's oversize block back, so the slot never makes it hold more from the driver), so a
//!   thread that reuses large sizes does not take the arena's lock.
//! - **Size classes and shards.** Requests up to `small_max` (at most 1 MiB) are rounded to one
//!   of 44 size classes (4 per doubling, so at most 25 % rounding) and served from a per-thread
//!   shard: a free list per class on its own cache lines. Each live thread holds its own
//!   index (dense slots, handed back when the thread exits: `thread_slots.rs`); a thread whose
//!   index is below the shard count owns that shard and enters it with two plain stores and a
//!   load, no lock and no read-modify-write (`sync::Biased`: on Linux, `trim`, `reset` and
//!   `stats` make it step aside with one `membarrier` for all the shards), and threads past the
//!   count share a second set of shards by spin lock. An empty
//!   list is refilled with a full magazine from the depot (blocks other shards handed on),
//!   else from the arena in batches; a list past its share
//!   ([`PoolConfig::cache_bytes_per_class`]) hands a magazine to the depot, or, with the depot
//!   full, to the arena, where its blocks coalesce. A shard also hands blocks on
//!   once it caches more than
//!   [`PoolConfig::cache_bytes_per_shard`] over all classes, so the shards together cache at
//!   most shards × that (plus a magazine each), and the depot at most twice a shard's share
//!   per class (`stats().cached_bytes` says how much now; `trim` returns it all).
//! - **Release.** A pointer's last drop returns its block to the dropping thread's shard, with
//!   no driver call; its pointer carries a shared [`ReleaseHook`](crate::memory::pointer::ReleaseHook), and its record comes from
//!   a per-thread list of recycled ones (`memory/record.rs`), so a cached allocation
//!   allocates nothing on the heap. A block's record stays with it in the shard
//!   (*parked*, up to 256 per shard, within the class's and the shard's cache bounds, large
//!   blocks' and the oversize block's too): the next allocation of the class (or of the large
//!   block's size) on that thread takes both and makes its pointer by setting
//!   its size and generation, which halves the work of a cached alloc + free pair. A parked
//!   record holds a clone of the pool's hook, so trim, reset
//!   and the pool's drop let every parked record go (their blocks back to the arena), or the
//!   pool would keep itself alive.
//! - **Memory held back** is reported by [`PoolAllocator::stats`] at all times. [`trim`]
//!   returns every cached block to the arena and frees every chunk with nothing in use;
//!   `reset` frees every chunk. Both free through the host layer's deferred-deallocation
//!   queue, so inside `defer_cleanup` the chunks stay allocated until the guard is gone.
//! - **Out of memory.** When the driver refuses to grow the pool, the pool trims itself and
//!   retries; then the host layer flushes its queue and retries once more (Numba's rule).
//! - **Reset** bumps a generation number while holding every lock; pointers stamped with an
//!   older generation release nothing when they drop later.
//!
//! [`trim`]: PoolAllocator::trim

use std::fmt;
use std::sync::Arc;

use driver_sys::{DevicePtr, DriverError, ErrorKind, StreamHandle};

use crate::contract::factory::{FnFactory, ManagerContext};
use crate::contract::info::{FreeSpace, PoolStats};
use crate::contract::ipc::IpcHandle;
use crate::contract::manager::{HistoryRecord, StreamOrdering};
use crate::contract::mapped_export::MappedExport;
use crate::contract::sleep::{SleepBlock, SleepOptions, SleepReport, WakeReport};
use crate::contract::snapshot::{BlockState, HeldBlock, HeldSegment, SegmentKind};
use crate::error::EmmError;
use crate::host::fences::Fences;
use crate::host::{
    AllocationKind, DeviceAllocator, DeviceExports, DeviceHoldings, DeviceRecords, DeviceSleeper,
    HostLayer, HostOnly,
};
use crate::lines::Lines;
use crate::managers::default::DriverAllocator;
use crate::memory::pending::PendingDeallocs;
use crate::memory::pointer::{MemoryPointer, ParkedPointer, PoolHook, forget_hooks};
use crate::size_class::{class_of, class_size};
use crate::sync::{AtomicU64, AtomicUsize, Mutex, Ordering, lock};
use crate::thread_slots::{self, Shard, thread_shard};

mod arena;
mod config;
mod freed;
mod history;
mod shards;
mod shared;
mod streams;
mod vmm;

use arena::{Arenas, Chunk};
pub use config::{ENV_VMM_PIECE, PoolConfig, vmm_piece_from_lookup};
use history::NO_STREAM;
use shards::{Depot, Large, ShardHook, ShardLists, unparked};
use streams::{StreamCache, StreamHook, stream_block_size};
use vmm::VmmSpace;

/// The name the pool manager is registered under.
pub const POOL_MANAGER: &str = "pool";

/// The name the pool over mapped physical memory (the driver's virtual memory management) is
/// registered under.
pub const VMM_POOL_MANAGER: &str = "vmm-pool";

/// Alignment and granularity of every block.
pub const POOL_ALIGNMENT: usize = crate::size_class::ALIGNMENT;

/// The largest size served from size classes.
pub const MAX_SMALL: usize = 1 << 20;

const CLASSES: usize = 44;

/// The most free blocks above `small_max` one shard keeps (exact sizes, most recent first
/// reused): a thread that frees and again allocates the same large sizes takes no lock but its
/// own shard's, where two such threads would otherwise queue on the arena's lock. Within the
/// shard's byte bound;
/// besides them, one block above the bound waits in the shard's oversize slot.
const LARGE_SLOTS: usize = 8;

/// Empties every list of `lists` (one per size class) with `take`, returning each non-empty
/// one's elements with its class.
fn take_nonempty<L, T>(lists: &mut [L], take: impl Fn(&mut L) -> Vec<T>) -> Vec<(usize, Vec<T>)> {
    lists
        .iter_mut()
        .enumerate()
        .map(|(class, l)| (class, take(l)))
        .filter(|(_, taken)| !taken.is_empty())
        .collect()
}

/// Requests above this many bytes (a quarter of the address space, more than any device holds)
/// fail as out of memory at once (no flush, no callback) before the pool rounds them, whose
/// arithmetic they would overflow.
const MAX_REQUEST: usize = usize::MAX / 4;

/// The block size a request of `bytes` gets.
fn block_size(bytes: usize, small_max: usize) -> usize {
    if bytes <= small_max {
        class_size(class_of(bytes))
    } else {
        bytes.div_ceil(POOL_ALIGNMENT) * POOL_ALIGNMENT
    }
}
const GROW_GRANULARITY: usize = 2 << 20;

/// The pool grows by this fraction of what it holds (one eighth), within
/// [`GROW_GRANULARITY`] and [`PoolConfig::chunk_size`]: a small pool in small steps, so that
/// a chunk's unused rest is small beside what the pool holds.
const GROWTH_DIVISOR: usize = 8;

/// `vmm-pool` grows by a thirty-second of what it holds: its chunks merge their free space
/// with their neighbours', so small ones strand nothing, and more of them are wholly free when
/// the pool sheds; a growth in place maps what the request lacks, rounded up to this step.
const VMM_GROWTH_DIVISOR: usize = 32;

/// Before `pool` grows, it keeps wholly free chunks while it would then hold at most
/// `1 / KEPT_DIVISOR` more than the most stream-ordered memory in use with a request at a
/// growth since its last trim (an eighth): [`PoolShared::kept_through_growth`].
const KEPT_DIVISOR: usize = 8;

/// Empty arenas for a pool of `config`: requests above its chunk size in chunks of their own,
/// except under `vmm-pool` (`vmm`), whose chunks merge their free space and are recorded as
/// its pieces.
fn empty_arenas(config: &PoolConfig, vmm: Option<&VmmSpace>) -> Arenas {
    Arenas::new(config.oversize_above(vmm.is_some()), vmm.map(|v| v.piece))
}

/// The pool's state, shared with the hooks its pointers hold.
struct PoolShared {
    cx: ManagerContext,
    config: PoolConfig,
    /// Per size class, [`cache_limit`](Self::cache_limit).
    cache_limits: [usize; CLASSES],
    /// Bumped by `reset` while every lock is held; read under any one of them.
    generation: AtomicU64,
    arena: Mutex<Arenas>,
    shards: Box<[Shard<ShardLists>]>,
    /// Magazines passed between shards (`shards.rs`); its lock is taken with no other held but
    /// by `reset`, which takes it after the shards'.
    depot: Mutex<Depot>,
    /// The deferred-deallocation queue of the host layer: chunk frees go through it.
    queue: Arc<PendingDeallocs>,
    /// Stream-ordered blocks (`streams.rs`); its lock comes before the arena's.
    streams: StreamCache,
    /// Events for the fences of stream-ordered frees.
    fences: Fences,
    /// What the pool holds from the driver, over the shared arena and the stream arena.
    totals: Totals,
    /// `vmm-pool`'s address reservation, where its chunks are mapped (`vmm.rs`); `None` for a
    /// pool of `cuMemAlloc` chunks. Its lock is taken after every other.
    vmm: Option<VmmSpace>,
}

/// Chunk bytes the pool holds from the driver, over all its arenas, and how they came and
/// went. Chunks moving between arenas change none of it.
#[derive(Default)]
struct Totals {
    held: AtomicUsize,
    peak_held: AtomicUsize,
    grows: AtomicU64,
    trimmed: AtomicU64,
    /// Driver allocations (`cuMemAlloc`, or `cuMemCreate` per piece) and frees (`cuMemFree`,
    /// or `cuMemRelease` per piece) made for the pool's memory.
    driver_allocations: AtomicU64,
    driver_frees: AtomicU64,
    /// GPU waits (`cuStreamWaitEvent`) and host waits (`cuEventSynchronize`) made for the
    /// pool's stream-ordered memory ([`PoolStats::stream_waits`], [`PoolStats::host_waits`]).
    stream_waits: AtomicU64,
    host_waits: AtomicU64,
    /// The most bytes in use with a request seen at a growth since the last trim or reset
    /// ([`PoolShared::kept_through_growth`]).
    in_use_mark: AtomicUsize,
}

impl Totals {
    /// The pool grew by a chunk of `bytes`.
    fn grew(&self, bytes: usize) {
        let now = self.held.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak_held.fetch_max(now, Ordering::Relaxed);
        self.grows.fetch_add(1, Ordering::Relaxed);
    }

    /// Chunks of `bytes` went back to the driver: by a trim (or an out-of-memory retry),
    /// else by a reset.
    fn released(&self, bytes: usize, trimmed: bool) {
        self.held.fetch_sub(bytes, Ordering::Relaxed);
        if trimmed {
            self.trimmed.fetch_add(bytes as u64, Ordering::Relaxed);
        }
    }
}

impl fmt::Debug for PoolShared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolShared")
            .field("device", &self.cx.device)
            .field("config", &self.config)
            .field("shards", &self.shards.len())
            .finish()
    }
}

/// The pool's device half; the `pool` manager is [`PoolManager`] = `HostOnly<PoolAllocator>`.
pub struct PoolAllocator {
    shared: Arc<PoolShared>,
    /// The release hook of every block from the shards and the arena (one for the pool: a
    /// block goes back to the dropping thread's shard, whichever shard it came from).
    hook: Arc<dyn PoolHook>,
    /// The release hook of stream-ordered blocks; a pointer's record keeps its clone when
    /// recycled, as `hook`'s.
    stream_hook: Arc<dyn PoolHook>,
}

impl Drop for PoolAllocator {
    /// The parked records hold clones of the pool's hook, and so of the pool: they are let go
    /// here, their blocks back in the arena, or the pool would never be freed; and no pointer
    /// dropped later parks its record.
    fn drop(&mut self) {
        self.shared.drain_shards(true);
        self.shared.close_stream_spares();
        // The depot's spare boxes hold clones of the hooks too.
        forget_hooks([&self.hook, &self.stream_hook]);
    }
}

impl fmt::Debug for PoolAllocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolAllocator")
            .field("shared", &self.shared)
            .field("stats", &self.stats())
            .finish()
    }
}

/// emm's pool manager: the [`HostLayer`] over a [`PoolAllocator`].
pub type PoolManager = HostOnly<PoolAllocator>;

impl PoolAllocator {
    /// A pool of `cuMemAlloc` chunks for the manager whose host layer is `host`.
    pub fn new(host: &HostLayer, config: PoolConfig) -> Result<PoolAllocator, EmmError> {
        Self::build(host, config, None)
    }

    /// A pool whose chunks are physical memory mapped into one address reservation
    /// (`vmm-pool`): its free space merges across chunks, so it grows in place. Refused with
    /// [`EmmError::NoVirtualMemory`] where the device or its driver lacks virtual memory
    /// management.
    pub fn with_virtual_memory(
        host: &HostLayer,
        config: PoolConfig,
        manager: &str,
    ) -> Result<PoolAllocator, EmmError> {
        let vmm = VmmSpace::new(host.context(), manager, config.vmm_piece)?;
        Self::build(host, config, Some(vmm))
    }

    fn build(
        host: &HostLayer,
        config: PoolConfig,
        vmm: Option<VmmSpace>,
    ) -> Result<PoolAllocator, EmmError> {
        if config.small_max > MAX_SMALL {
            return Err(EmmError::InvalidArgument {
                what: "PoolConfig::small_max",
                reason: format!(
                    "{} bytes is above the largest size class ({MAX_SMALL} bytes); lower it",
                    config.small_max
                ),
            });
        }
        if config.chunk_size < GROW_GRANULARITY {
            return Err(EmmError::InvalidArgument {
                what: "PoolConfig::chunk_size",
                reason: format!(
                    "{} bytes is below the pool's smallest growth ({GROW_GRANULARITY} bytes); \
                     give at least that (the default is {} bytes)",
                    config.chunk_size,
                    PoolConfig::default().chunk_size
                ),
            });
        }
        // The history's stamps convert to times from here on.
        crate::clock::start();
        let shared = Arc::new(PoolShared {
            cx: host.context().clone(),
            config,
            cache_limits: PoolShared::cache_limits(&config),
            generation: AtomicU64::new(0),
            arena: Mutex::new(empty_arenas(&config, vmm.as_ref())),
            shards: Shard::all(ShardLists::new),
            depot: Mutex::new(Depot::new()),
            queue: Arc::clone(host.deallocations()),
            streams: StreamCache::new(),
            fences: Fences::new(host.context()),
            totals: Totals::default(),
            vmm,
        });
        let stream_hook = Arc::new(StreamHook {
            pool: Arc::clone(&shared),
        }) as Arc<dyn PoolHook>;
        let hook = Arc::new(ShardHook {
            pool: Arc::clone(&shared),
        }) as Arc<dyn PoolHook>;
        Ok(PoolAllocator {
            shared,
            hook,
            stream_hook,
        })
    }

    /// What the pool holds now.
    pub fn stats(&self) -> PoolStats {
        self.shared.stats()
    }

    /// The configuration.
    pub fn config(&self) -> PoolConfig {
        self.shared.config
    }

    fn pointer(&self, addr: u64, bytes: usize, generation: u64, stamp: u64) -> MemoryPointer {
        let cx = &self.shared.cx;
        MemoryPointer::with_stashed_hook(
            cx.device,
            cx.context,
            DevicePtr(addr),
            bytes,
            &self.hook,
            (generation, stamp),
            true,
        )
    }

    fn alloc_small(&self, host: &HostLayer, bytes: usize) -> Result<MemoryPointer, EmmError> {
        let pool = &*self.shared;
        let (shard, owner) = thread_shard();
        let class = class_of(bytes);
        let size = class_size(class);
        {
            let mut lists = pool.shards[shard].inner.enter(owner);
            if let Some(parked) = lists.parked[class].pop() {
                lists.park_room += 1;
                lists.cached_bytes -= size;
                lists.lent(size);
                let stamp = lists.history.alloc(parked.base(), bytes);
                let generation = pool.generation.load(Ordering::Acquire);
                drop(lists);
                return Ok(parked.revive(bytes, generation, stamp));
            }
            if let Some(addr) = lists.free[class].pop() {
                lists.cached_bytes -= size;
                lists.lent(size);
                let stamp = lists.history.alloc(addr, bytes);
                let generation = pool.generation.load(Ordering::Acquire);
                drop(lists);
                return Ok(self.pointer(addr, bytes, generation, stamp));
            }
        }
        // Refill: a magazine another shard handed to the depot, else one arena block split
        // into a batch of this class.
        if let Some((mut magazine, generation)) = pool.take_magazine(class) {
            let addr = magazine.pop().expect("magazines are never empty");
            let mut lists = pool.shards[shard].inner.enter(owner);
            let mut stamp = 0;
            if pool.generation.load(Ordering::Acquire) == generation {
                lists.lent(size);
                stamp = lists.history.alloc_fresh(addr, bytes, NO_STREAM);
                lists.cached_bytes += magazine.len() * size;
                lists.free[class].extend(magazine);
            }
            drop(lists);
            return Ok(self.pointer(addr, bytes, generation, stamp));
        }
        let batch = PoolShared::batch(class);
        let (addr, generation, got) = match pool.take_from_arena(host, size * batch) {
            Ok((a, g)) => (a, g, batch),
            Err(e) if batch > 1 && e.is_out_of_memory() => {
                let (a, g) = pool.take_from_arena(host, size)?;
                (a, g, 1)
            }
            Err(e) => return Err(e),
        };
        let mut lists = pool.shards[shard].inner.enter(owner);
        let mut stamp = 0;
        if pool.generation.load(Ordering::Acquire) == generation {
            lists.lent(size);
            stamp = lists.history.alloc_fresh(addr, bytes, NO_STREAM);
            lists.free[class].extend((1..got).map(|i| addr + (i * size) as u64));
            lists.cached_bytes += (got - 1) * size;
        }
        drop(lists);
        Ok(self.pointer(addr, bytes, generation, stamp))
    }

    /// Kept out of `memalloc`: inlined there, changes to it move the small sizes' code about
    /// and slow their cached pair through code layout alone, which no instruction count
    /// shows.
    #[inline(never)]
    fn alloc_large(&self, host: &HostLayer, bytes: usize) -> Result<MemoryPointer, EmmError> {
        let pool = &*self.shared;
        let size = block_size(bytes, pool.config.small_max);
        let shard = thread_shard();
        if let Some((block, generation, stamp)) = pool.take_large(shard, size, bytes) {
            return Ok(match block.record {
                Some(record) => record.revive(bytes, generation, stamp),
                None => self.pointer(block.addr, bytes, generation, stamp),
            });
        }
        let (addr, generation) = pool.take_from_arena(host, size)?;
        let stamp = pool.count_in_use(shard, (addr, size, bytes), generation);
        Ok(self.pointer(addr, bytes, generation, stamp))
    }

    /// Frees every chunk with nothing in use, after returning cached blocks to the arena;
    /// returns the bytes of device memory released. Inside `defer_cleanup` the frees stay
    /// queued until the guard is gone. Under `vmm-pool` the page-locked host buffer a sleep
    /// kept for the next ([`SleepOptions::with_host_buffer_kept`]) is freed too.
    pub fn trim(&self) -> Result<usize, EmmError> {
        self.shared.free_kept_buffer();
        let bytes = self.shared.trim_to_queue(false);
        self.shared.queue.flush()?;
        Ok(bytes)
    }

    /// The factory registered as `"pool"`, with the default configuration.
    pub fn factory() -> FnFactory {
        Self::factory_with(POOL_MANAGER, PoolConfig::default())
    }

    /// The factory registered as `"vmm-pool"`: the pool over physical memory mapped into one
    /// address reservation per device ([`with_virtual_memory`](Self::with_virtual_memory)),
    /// with the default configuration.
    ///
    /// Each context it makes reads `EMM_VMM_PIECE` ([`PoolConfig::vmm_piece`]); a malformed
    /// value refuses the context with [`EmmError::Config`].
    pub fn vmm_factory() -> FnFactory {
        FnFactory::new(VMM_POOL_MANAGER, move |cx: &ManagerContext| {
            let config = PoolConfig {
                vmm_piece: vmm_piece_from_lookup(|k| std::env::var(k).ok())?,
                ..PoolConfig::vmm()
            };
            Self::vmm_manager(cx, config)
        })
    }

    /// A factory registered as `"vmm-pool"` whose pools are configured with `config`
    /// ([`PoolConfig::vmm`] and changes to it); it reads no environment variable.
    pub fn vmm_factory_with(config: PoolConfig) -> FnFactory {
        FnFactory::new(VMM_POOL_MANAGER, move |cx: &ManagerContext| {
            Self::vmm_manager(cx, config)
        })
    }

    fn vmm_manager(
        cx: &ManagerContext,
        config: PoolConfig,
    ) -> Result<Box<dyn crate::contract::MemoryManager>, EmmError> {
        let host = HostLayer::new(cx);
        let pool = PoolAllocator::with_virtual_memory(&host, config, VMM_POOL_MANAGER)?;
        Ok(Box::new(HostOnly::from_parts(host, pool)))
    }

    /// A factory named `name` for pools configured with `config`.
    pub fn factory_with(name: &str, config: PoolConfig) -> FnFactory {
        FnFactory::new(name, move |cx: &ManagerContext| {
            let host = HostLayer::new(cx);
            let pool = PoolAllocator::new(&host, config)?;
            Ok(Box::new(HostOnly::from_parts(host, pool)))
        })
    }
}

impl PoolAllocator {
    fn alloc_on(
        &self,
        host: &HostLayer,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<MemoryPointer, EmmError> {
        let pool = &*self.shared;
        let size = stream_block_size(bytes);
        let (addr, generation, stamp) = match pool.take_on_stream(stream, size, bytes) {
            Some((addr, generation, stamp, Some(spare))) => {
                return Ok(spare.revive_on(DevicePtr(addr), bytes, generation, stamp, stream));
            }
            Some((addr, generation, stamp, None)) => (addr, generation, stamp),
            None => {
                let (addr, generation) = pool.grow_stream(host, stream, size)?;
                (addr, generation, pool.note_grown(stream, addr, bytes))
            }
        };
        let cx = &pool.cx;
        Ok(MemoryPointer::with_stashed_hook_on(
            cx.device,
            cx.context,
            DevicePtr(addr),
            bytes,
            &self.stream_hook,
            (generation, stamp),
            stream,
            true,
        ))
    }
}

impl DeviceAllocator for PoolAllocator {
    fn memalloc_on(
        &self,
        host: &HostLayer,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<MemoryPointer, EmmError> {
        if bytes == 0 {
            return Err(EmmError::ZeroSize {
                what: "memalloc_on",
            });
        }
        if bytes > MAX_REQUEST {
            // No device holds it: nothing to flush, no callback to ask.
            let refused = DriverError::from_kind("cuMemAlloc", ErrorKind::OutOfMemory);
            return Err(host.out_of_memory("memalloc_on", bytes, 0, 0, refused));
        }
        self.alloc_on(host, bytes, stream)
    }

    fn stream_ordering(&self) -> StreamOrdering {
        StreamOrdering::PerStream
    }

    fn memalloc(&self, host: &HostLayer, bytes: usize) -> Result<MemoryPointer, EmmError> {
        if bytes == 0 {
            return Err(EmmError::ZeroSize { what: "memalloc" });
        }
        if bytes > MAX_REQUEST {
            let refused = DriverError::from_kind("cuMemAlloc", ErrorKind::OutOfMemory);
            return Err(host.out_of_memory("memalloc", bytes, 0, 0, refused));
        }
        if bytes <= self.shared.config.small_max {
            self.alloc_small(host, bytes)
        } else {
            self.alloc_large(host, bytes)
        }
    }

    fn initialize(&self, host: &HostLayer) -> Result<(), EmmError> {
        DriverAllocator.initialize(host)
    }

    fn get_ipc_handle(
        &self,
        host: &HostLayer,
        memory: &MemoryPointer,
    ) -> Result<IpcHandle, EmmError> {
        if self.shared.vmm.is_some() {
            return Err(EmmError::NotSupported {
                operation: "get_ipc_handle",
                manager: VMM_POOL_MANAGER.into(),
                advice: "its memory is physical memory mapped into reserved addresses, which \
                         cuIpcGetMemHandle does not export; allocate memory to share with \
                         Context::memalloc_shared, export it as file descriptors with \
                         Context::export_mapped, send that over a Unix socket \
                         (MappedExport::send) and open it with Context::open_mapped in the \
                         other process",
            });
        }
        // The handle names the chunk; its offset is the block's distance from the chunk base.
        host.ipc_handle(memory)
    }

    fn reset(&self, host: &HostLayer) -> Result<(), EmmError> {
        let pool = &*self.shared;
        let (mut parked, mut large) = (Vec::new(), Vec::new());
        let (chunks, spares, owners) = {
            let mut streams = lock(pool.streams.lists());
            streams.history.clear();
            let mut arena = lock(&pool.arena);
            let mut shards = thread_slots::lock_all(&pool.shards);
            let mut depot = lock(&pool.depot);
            pool.generation.fetch_add(1, Ordering::AcqRel);
            arena.generation += 1;
            depot.generation += 1;
            for m in &mut depot.magazines {
                m.clear();
            }
            depot.cached_bytes = 0;
            for lists in &mut shards {
                lists.history.clear();
                parked.push(lists.take_parked());
                for l in &mut lists.free {
                    l.clear();
                }
                // Their records are let go below, with no shard entered, as the small blocks'.
                large.extend(lists.take_large_blocks());
                lists.cached_bytes = 0;
                lists.in_use_blocks = 0;
                lists.in_use_bytes = 0;
            }
            let (mut chunks, spares, owners) = pool.clear_stream_lists(&mut streams);
            chunks.extend(arena.clear());
            (chunks, spares, owners)
        };
        // Let go with no shard entered; their blocks were in the chunks just released.
        streams::let_go(spares);
        drop(owners);
        parked.into_iter().flat_map(unparked).for_each(drop);
        large.into_iter().map(Large::into_block).for_each(drop);
        let bytes = chunks.iter().map(|c| c.size).sum::<usize>();
        pool.totals.released(bytes, false);
        pool.totals.in_use_mark.store(0, Ordering::Relaxed);
        tracing::info!(device = %pool.cx.device, chunks = chunks.len(), bytes, "pool reset");
        if let Some(_live) = pool.cx.liveness.enter() {
            pool.fences.destroy_idle();
        }
        let queue = host.deallocations();
        pool.release_chunks(chunks, true);
        // A sleep ends with the reset: what it offloaded belonged to the blocks given up.
        pool.end_sleep();
        let flushed = queue.flush().map(|_| ());
        // The reservation after its mappings, which the flush gave back.
        pool.free_reservation();
        flushed
    }

    fn holdings(&self) -> Option<&dyn DeviceHoldings> {
        Some(self)
    }

    fn records(&self) -> Option<&dyn DeviceRecords> {
        Some(self)
    }

    /// `vmm-pool` only: `pool`'s `cuMemAlloc` chunks are exported as IPC handles.
    fn exports(&self) -> Option<&dyn DeviceExports> {
        self.shared
            .vmm
            .is_some()
            .then_some(self as &dyn DeviceExports)
    }

    /// `vmm-pool` only: `pool`'s `cuMemAlloc` chunks cannot keep their addresses without their
    /// memory.
    fn sleeper(&self) -> Option<&dyn DeviceSleeper> {
        self.shared
            .vmm
            .is_some()
            .then_some(self as &dyn DeviceSleeper)
    }
}

impl DeviceHoldings for PoolAllocator {
    fn trim(&self, _host: &HostLayer) -> Result<usize, EmmError> {
        PoolAllocator::trim(self)
    }

    fn pool_stats(&self) -> Option<PoolStats> {
        Some(self.stats())
    }

    fn free_space(&self) -> Option<FreeSpace> {
        Some(self.shared.free_space())
    }

    fn segments(&self, _host: &HostLayer) -> Option<Vec<HeldSegment>> {
        Some(self.shared.segments())
    }
}

/// Each thread's and stream's window of last events.
impl DeviceRecords for PoolAllocator {
    fn history(&self, _host: &HostLayer) -> Option<HistoryRecord> {
        // The stream lists' copied out first (their lock comes before the shards').
        let streams = lock(self.shared.streams.lists()).history.clone();
        let shards = thread_slots::lock_all(&self.shared.shards);
        Some(history::merge(
            std::iter::once(&streams).chain(shards.iter().map(|lists| &lists.history)),
        ))
    }
}

/// `vmm-pool`'s memory shared as file descriptors ([`DeviceAllocator::exports`] hands it out
/// for `vmm-pool` alone).
impl DeviceExports for PoolAllocator {
    fn export_mapped(
        &self,
        _host: &HostLayer,
        memory: &MemoryPointer,
    ) -> Result<MappedExport, EmmError> {
        self.shared
            .export_mapped(memory.device_ptr().0, memory.size())
    }

    /// `vmm-pool`: physical memory of its own for the request, outside the pool
    /// (`PoolShared::allocate_shared`), through the host layer's out-of-memory rule; its
    /// pointer gives it back when the last clone drops.
    fn memalloc_shared(&self, host: &HostLayer, bytes: usize) -> Result<MemoryPointer, EmmError> {
        // `exports` hands this out for `vmm-pool` alone, but the impl is public.
        if self.shared.vmm.is_none() {
            return Err(EmmError::no_shared_allocation(POOL_MANAGER));
        }
        if bytes == 0 {
            return Err(EmmError::ZeroSize {
                what: "memalloc_shared",
            });
        }
        let (base, _) =
            host.attempt_allocation("memalloc_shared", AllocationKind::Device, bytes, || {
                self.shared.allocate_shared(bytes)
            })?;
        let (cx, pool) = (&self.shared.cx, Arc::clone(&self.shared));
        // SAFETY: `base .. base + bytes` lies in physical memory mapped for this allocation
        // alone, which stays mapped until this pointer's release unmaps it.
        #[allow(unsafe_code)]
        let mem = unsafe {
            MemoryPointer::with_release(
                cx.device,
                cx.context,
                DevicePtr(base),
                bytes,
                move |p, _| pool.release_shared(p.0),
            )
        };
        Ok(mem)
    }
}

/// `vmm-pool`'s sleep ([`DeviceAllocator::sleeper`] hands it out for `vmm-pool` alone).
impl DeviceSleeper for PoolAllocator {
    /// `vmm-pool`: unmaps and releases the pieces no kept allocation lies in, keeping the
    /// reservation (`PoolShared::sleep`); `pool` refuses, its `cuMemAlloc` chunks cannot keep
    /// their addresses without their memory.
    fn sleep(
        &self,
        _host: &HostLayer,
        blocks: &[SleepBlock],
        options: &SleepOptions,
    ) -> Result<SleepReport, EmmError> {
        self.shared.sleep(blocks, options.keeps_host_buffer())
    }

    /// `vmm-pool`: maps memory again where the sleep released it and copies the offloaded
    /// allocations back (`PoolShared::wake`); `pool` refuses.
    fn wake(&self, _host: &HostLayer) -> Result<WakeReport, EmmError> {
        self.shared.wake()
    }
}

#[cfg(all(test, not(emm_loom)))]
mod tests;
