//! The pinned host pool: reuses page-locked host memory (`cuMemHostAlloc` costs hundreds of
//! microseconds), in the manner of cuda.core's `PinnedMemoryResource`. It lives in the
//! [`HostLayer`](crate::HostLayer), so every manager built on it (the default manager, the
//! pool, a plugin's `HostOnly<_>`) gets it when the runtime asks for it
//! ([`RuntimeBuilder::pinned_host_pool`](crate::RuntimeBuilder::pinned_host_pool) or
//! `EMM_PINNED_HOST_POOL`).
//!
//! - Requests up to [`PinnedPoolConfig::max_block`] are rounded to a size class (4 per
//!   doubling) and served from a free list per (flags, size); larger ones bypass the pool.
//! - A returned block goes back to its list, unless the lists already hold
//!   [`PinnedPoolConfig::max_cached`] bytes; then it is freed (through the deferred queue).
//! - Mapped blocks keep their device pointer, so a cached mapped allocation makes no driver
//!   call.
//! - `trim` frees every cached block; `reset` frees every cached block and forgets the rest:
//!   mapped blocks in use are freed by the host layer's table (as without the pool), unmapped
//!   ones are freed when their handle drops (as without the pool).

use std::fmt;
use std::sync::Arc;

use driver_sys::{DevicePtr, HostPtr};

use crate::contract::info::{PinnedPoolConfig, PoolStats};
use crate::memory::HostReleaseHook;
use crate::memory::pending::{Free, PendingDeallocs};
use crate::size_class;
use crate::sync::{AtomicU64, Ordering, Spin};

/// A cached block: host address and, for mapped blocks, the device address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PinnedBlock {
    pub(crate) host: HostPtr,
    pub(crate) device: Option<DevicePtr>,
    pub(crate) size: usize,
    pub(crate) flags: u32,
}

/// The flag bits a block's list is chosen by: `cuMemHostAlloc`'s `PORTABLE`, `DEVICEMAP` and
/// `WRITECOMBINED` (1, 2, 4), the only flags emm passes.
const FLAG_BITS: u32 = 0b111;

#[derive(Debug, Default)]
struct Lists {
    /// Free blocks by [`list_index`]: size class, then flags (a plain index, not a hash map: a
    /// hashed key cost about 400 instructions of the 1 000 a cached pair took).
    free: Vec<Vec<PinnedBlock>>,
    cached: usize,
    held: usize,
    peak_held: usize,
    in_use: usize,
    in_use_blocks: usize,
    grows: u64,
    trimmed: u64,
}

/// The list of blocks of `size` (a class size) with `flags`.
fn list_index(flags: u32, size: usize) -> usize {
    debug_assert_eq!(
        flags & !FLAG_BITS,
        0,
        "a flag the pool does not know: {flags:#x}"
    );
    size_class::class_of(size) << 3 | (flags & FLAG_BITS) as usize
}

/// The pool of one host layer.
pub(crate) struct PinnedPool {
    config: PinnedPoolConfig,
    /// The host layer's deferred-deallocation queue: blocks the pool does not keep are freed
    /// through it.
    queue: Arc<PendingDeallocs>,
    generation: AtomicU64,
    /// A spin lock: held for a list operation and a few counters, never across a driver call.
    lists: Spin<Lists>,
}

impl fmt::Debug for PinnedPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedPool")
            .field("config", &self.config)
            .field("stats", &self.stats())
            .finish()
    }
}

impl PinnedPool {
    pub(crate) fn new(config: PinnedPoolConfig, queue: Arc<PendingDeallocs>) -> PinnedPool {
        PinnedPool {
            config,
            queue,
            generation: AtomicU64::new(0),
            lists: Spin::new(Lists::default()),
        }
    }

    /// The size a request is served with, or `None` if it bypasses the pool.
    pub(crate) fn class(&self, bytes: usize) -> Option<usize> {
        (bytes <= self.config.max_block).then(|| size_class::round_up(bytes))
    }

    /// A cached block of `size` bytes with `flags`, and the generation to stamp it with.
    pub(crate) fn take(&self, flags: u32, size: usize) -> (Option<PinnedBlock>, u64) {
        let mut lists = self.lists.lock();
        let generation = self.generation.load(Ordering::Acquire);
        let block = lists
            .free
            .get_mut(list_index(flags, size))
            .and_then(Vec::pop);
        if block.is_some() {
            lists.cached -= size;
            lists.in_use += size;
            lists.in_use_blocks += 1;
        }
        (block, generation)
    }

    /// Counts a block the caller has just allocated from the driver as held and in use;
    /// returns the generation to stamp it with.
    pub(crate) fn grew(&self, size: usize) -> u64 {
        let mut lists = self.lists.lock();
        lists.held += size;
        lists.peak_held = lists.peak_held.max(lists.held);
        lists.in_use += size;
        lists.in_use_blocks += 1;
        lists.grows += 1;
        self.generation.load(Ordering::Acquire)
    }

    /// The tag of an unmapped block handed out by [`HostReleaseHook`]: the generation and the
    /// flags it was allocated with.
    pub(crate) fn tag(generation: u64, flags: u32) -> u64 {
        generation << 3 | u64::from(flags & FLAG_BITS)
    }

    /// A block stamped `generation` is no longer used: cache it, or return the free the
    /// caller must queue (when the pool is full, or when the block is from before a reset).
    #[must_use = "a block the pool does not keep must be freed"]
    pub(crate) fn give_back(&self, block: PinnedBlock, generation: u64) -> Option<Free> {
        let mut lists = self.lists.lock();
        if self.generation.load(Ordering::Acquire) == generation {
            lists.in_use -= block.size;
            lists.in_use_blocks -= 1;
            if lists.cached + block.size <= self.config.max_cached {
                lists.cached += block.size;
                let i = list_index(block.flags, block.size);
                if lists.free.len() <= i {
                    lists.free.resize_with(i + 1, Vec::new);
                }
                lists.free[i].push(block);
                return None;
            }
            lists.held -= block.size;
            lists.trimmed += block.size as u64;
        }
        Some(Free::Host {
            ptr: block.host,
            bytes: Self::counted(&block),
        })
    }

    /// Numba counts mapped memory by its size and unmapped pinned memory as 0 bytes.
    fn counted(block: &PinnedBlock) -> usize {
        if block.device.is_some() {
            block.size
        } else {
            0
        }
    }

    /// Takes every cached block out of the pool (their frees are the caller's); with `reset`,
    /// also forgets the blocks in use and starts a new generation. Returns the frees and the
    /// bytes they release.
    pub(crate) fn drain(&self, reset: bool) -> (Vec<Free>, usize) {
        let mut lists = self.lists.lock();
        let blocks: Vec<PinnedBlock> = lists.free.iter_mut().flat_map(std::mem::take).collect();
        let bytes: usize = blocks.iter().map(|b| b.size).sum();
        lists.cached = 0;
        lists.held -= bytes;
        if reset {
            self.generation.fetch_add(1, Ordering::AcqRel);
            lists.held = 0;
            lists.in_use = 0;
            lists.in_use_blocks = 0;
        } else {
            lists.trimmed += bytes as u64;
        }
        let frees = blocks
            .iter()
            .map(|b| Free::Host {
                ptr: b.host,
                bytes: Self::counted(b),
            })
            .collect();
        (frees, bytes)
    }

    pub(crate) fn stats(&self) -> PoolStats {
        let lists = self.lists.lock();
        PoolStats {
            held_bytes: lists.held,
            in_use_bytes: lists.in_use,
            in_use_blocks: lists.in_use_blocks,
            cached_bytes: lists.cached,
            peak_held_bytes: lists.peak_held,
            chunks: lists.free.iter().map(Vec::len).sum::<usize>() + lists.in_use_blocks,
            grows: lists.grows,
            trimmed_bytes: lists.trimmed,
        }
    }
}

/// Unmapped blocks come back here when their [`PinnedMemory`](crate::PinnedMemory) drops.
impl HostReleaseHook for PinnedPool {
    fn release(&self, host: HostPtr, size: usize, tag: u64) {
        let block = PinnedBlock {
            host,
            device: None,
            size: size_class::round_up(size),
            flags: (tag & u64::from(FLAG_BITS)) as u32,
        };
        if let Some(free) = self.give_back(block, tag >> 3) {
            self.queue.push_from_drop(free);
        }
    }
}
