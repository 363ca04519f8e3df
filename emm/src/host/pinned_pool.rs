//! The pinned host pool: reuses page-locked host memory (`cuMemHostAlloc` costs hundreds of
//! microseconds), in the manner of cuda.core's `PinnedMemoryResource`. It lives in the
//! [`HostLayer`](crate::HostLayer), so every manager built on it (the default manager, the
//! pool, a plugin's `HostOnly<_>`) gets it when the runtime asks for it
//! ([`RuntimeBuilder::pinned_host_pool`](crate::RuntimeBuilder::pinned_host_pool) or
//! `EMM_PINNED_HOST_POOL`).
//!
//! - Requests up to [`PinnedPoolConfig::max_block`] are rounded to a size class (4 per
//!   doubling) and served from a free list per (flags, size); larger ones bypass the pool.
//! - **Per-thread shards.** The lists live in per-thread shards (one spin lock each, on its
//!   own cache lines; a thread's index comes from `thread_slots`), so threads do not share a
//!   hot lock: a cached pair takes one uncontended lock. A thread whose own lists are empty
//!   looks in the other shards before it calls the driver (a `cuMemHostAlloc` costs hundreds
//!   of microseconds; looking costs one lock per shard).
//! - **The cache bound.** The shards together never hold more than
//!   [`PinnedPoolConfig::max_cached`] bytes: a shard caches against an allowance it takes
//!   from the pool in steps of at least [`ALLOWANCE_STEP`], and hands back what it does not
//!   use beyond one step. A block returned when no allowance is left is still kept: with
//!   every shard locked, the pool takes back the shards' unused allowance and frees cached
//!   blocks (through the deferred queue) to make room, from the lists holding the most bytes
//!   first and the returned block's own list last. A cache full of blocks of sizes a program
//!   no longer uses therefore gives way to its new sizes after one round of them; before,
//!   every block of a new size was freed on its return and allocated again from the driver.
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
use crate::sync::{AtomicU64, Bias, Biased, Mutex, Ordering, lock};
use crate::thread_slots::{Shard, shard_count, thread_shard};

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

/// The smallest allowance a shard takes from the pool at a time, and the unused allowance it
/// may keep.
pub(crate) const ALLOWANCE_STEP: usize = 1 << 20;

/// One thread's free lists.
#[derive(Debug, Default)]
struct Lists {
    /// Free blocks by [`list_index`]: size class, then flags (a plain index, not a hash map: a
    /// hashed key cost about 400 instructions of the 1 000 a cached pair took).
    free: Vec<Vec<PinnedBlock>>,
    cached: usize,
    /// Bytes this shard may cache (taken from [`Totals::allowed`]).
    allowance: usize,
    /// Blocks and bytes handed out from or returned to this shard; a block taken on one shard
    /// and returned to another makes both drift, their sums stay right.
    in_use: i64,
    in_use_blocks: i64,
}

impl Lists {
    fn pop(&mut self, flags: u32, size: usize) -> Option<PinnedBlock> {
        let block = self.free.get_mut(list_index(flags, size))?.pop()?;
        self.cached -= size;
        Some(block)
    }
}

/// What the pool counts across shards; its lock is taken after a shard's, and only when the
/// pool grows, frees, trims, resets or moves allowance.
#[derive(Debug, Default)]
struct Totals {
    held: usize,
    peak_held: usize,
    grows: u64,
    trimmed: u64,
    /// The sum of the shards' allowances, at most `max_cached`.
    allowed: usize,
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
    /// Bumped by `drain(true)` (a reset) while every shard's lock is held.
    generation: AtomicU64,
    /// [`shard_count`] shards, each a plain spin lock for every thread, owner included
    /// ([`Bias::None`]), unlike the `pool` manager's: a thread that misses here takes blocks
    /// from other threads' shards (the pool's threads go to a depot instead), and on the H100
    /// shards biased to their owners (`sync::Biased`) cost a `membarrier` for each such visit;
    /// a steal of half a list at a time, and a bit per class to skip shards, measured no better
    /// under threads (BENCHMARKS.md, run T). So this pool is as it was before the pool's shards
    /// were biased.
    shards: Box<[Shard<Lists>]>,
    totals: Mutex<Totals>,
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
            shards: (0..shard_count())
                .map(|_| Shard {
                    inner: Biased::new(Lists::default(), Bias::None),
                })
                .collect(),
            totals: Mutex::new(Totals::default()),
        }
    }

    /// This thread's shard: its slot's index, wrapped (a mask: the count is a power of two).
    fn own_shard(&self) -> usize {
        thread_shard().0 & (self.shards.len() - 1)
    }

    /// The size a request is served with, or `None` if it bypasses the pool.
    pub(crate) fn class(&self, bytes: usize) -> Option<usize> {
        (bytes <= self.config.max_block).then(|| size_class::round_up(bytes))
    }

    /// Hands the pool back the allowance `lists` holds beyond its cached bytes and one step.
    fn return_spare_allowance(&self, lists: &mut Lists) {
        let spare = lists.allowance - lists.cached;
        if spare > 2 * ALLOWANCE_STEP {
            let back = spare - ALLOWANCE_STEP;
            lists.allowance -= back;
            lock(&self.totals).allowed -= back;
        }
    }

    /// A cached block of `size` bytes with `flags` (this thread's, else another shard's), and
    /// the generation to stamp it with.
    pub(crate) fn take(&self, flags: u32, size: usize) -> (Option<PinnedBlock>, u64) {
        let own = self.own_shard();
        let n = self.shards.len(); // a power of two: a mask wraps, not a division
        for i in (0..n).map(|k| (own + k) & (n - 1)) {
            let mut lists = self.shards[i].inner.lock();
            let generation = self.generation.load(Ordering::Acquire);
            if let Some(block) = lists.pop(flags, size) {
                lists.in_use += size as i64;
                lists.in_use_blocks += 1;
                self.return_spare_allowance(&mut lists);
                return (Some(block), generation);
            }
        }
        (None, self.generation.load(Ordering::Acquire))
    }

    /// Counts a block the caller has just allocated from the driver as held and in use;
    /// returns the generation to stamp it with.
    pub(crate) fn grew(&self, size: usize) -> u64 {
        let mut lists = self.shards[self.own_shard()].inner.lock();
        lists.in_use += size as i64;
        lists.in_use_blocks += 1;
        let mut totals = lock(&self.totals);
        totals.held += size;
        totals.peak_held = totals.peak_held.max(totals.held);
        totals.grows += 1;
        self.generation.load(Ordering::Acquire)
    }

    /// The tag of an unmapped block handed out by [`HostReleaseHook`]: the generation and the
    /// flags it was allocated with.
    pub(crate) fn tag(generation: u64, flags: u32) -> u64 {
        generation << 3 | u64::from(flags & FLAG_BITS)
    }

    /// The generation and flags a [`tag`](Self::tag) holds.
    fn untag(tag: u64) -> (u64, u32) {
        (tag >> 3, (tag & u64::from(FLAG_BITS)) as u32)
    }

    /// A block stamped `generation` is no longer used: cache it in this thread's shard.
    /// Returns the frees the caller must queue: none when the block is cached; the block
    /// itself when it is from before a reset or larger than the whole cache; and, when the
    /// cache is full, the cached blocks it displaced (see [`make_room`](Self::make_room)).
    #[must_use = "blocks the pool does not keep must be freed"]
    pub(crate) fn give_back(&self, block: PinnedBlock, generation: u64) -> Vec<Free> {
        {
            let mut lists = self.shards[self.own_shard()].inner.lock();
            if self.generation.load(Ordering::Acquire) != generation {
                return vec![Self::free_of(&block)];
            }
            lists.in_use -= block.size as i64;
            lists.in_use_blocks -= 1;
            let need = (lists.cached + block.size).saturating_sub(lists.allowance);
            let allowed = need == 0 || {
                let mut totals = lock(&self.totals);
                let grant = need
                    .max(ALLOWANCE_STEP)
                    .min(self.config.max_cached - totals.allowed);
                grant >= need && {
                    totals.allowed += grant;
                    lists.allowance += grant;
                    true
                }
            };
            if allowed {
                Self::cache(&mut lists, block);
                return Vec::new();
            }
        }
        self.make_room(block, generation)
    }

    /// Puts `block` on its list in `lists`, against allowance the caller made sure of.
    fn cache(lists: &mut Lists, block: PinnedBlock) {
        lists.cached += block.size;
        let i = list_index(block.flags, block.size);
        if lists.free.len() <= i {
            lists.free.resize_with(i + 1, Vec::new);
        }
        lists.free[i].push(block);
    }

    /// The cache is full and `block` (already counted as no longer in use) comes back: rather
    /// than free the block just used, and so send every later pair of its size to the driver
    /// for as long as older blocks fill the cache, the pool makes room for it. It takes back
    /// the allowance shards hold beyond what they cache, then evicts cached blocks from the
    /// lists that cache the most bytes (a list that grew fat is the likeliest to hold what a
    /// past phase of the program left), lists of the block's own size and kind last, until
    /// [`ALLOWANCE_STEP`] is free (so that the next blocks back need no sweep) or, failing
    /// that, the block's size. Every shard is locked: this is the path of a full cache, which
    /// ends in driver frees. Returns the evicted blocks' frees, or the block's own if it is
    /// larger than the whole cache.
    #[cold]
    #[inline(never)]
    fn make_room(&self, block: PinnedBlock, generation: u64) -> Vec<Free> {
        let mut shards: Vec<_> = self.shards.iter().map(|s| s.inner.lock()).collect();
        let mut totals = lock(&self.totals);
        if self.generation.load(Ordering::Acquire) != generation {
            // A reset came in between: the block is no longer the pool's.
            return vec![Self::free_of(&block)];
        }
        if block.size > self.config.max_cached {
            totals.held -= block.size;
            totals.trimmed += block.size as u64;
            return vec![Self::free_of(&block)];
        }
        for lists in &mut shards {
            totals.allowed -= lists.allowance - lists.cached;
            lists.allowance = lists.cached;
        }
        let keep = list_index(block.flags, block.size);
        let wanted = block.size.max(ALLOWANCE_STEP).min(self.config.max_cached);
        let mut room = self.config.max_cached - totals.allowed;
        let mut evicted = Vec::new();
        // Lists of other sizes and kinds first, then the block's own.
        for (same_list, enough) in [(false, wanted), (true, block.size)] {
            let mut fattest: Vec<(usize, usize, usize)> = shards
                .iter()
                .enumerate()
                .flat_map(|(k, lists)| {
                    lists.free.iter().enumerate().filter_map(move |(i, list)| {
                        let bytes = list.iter().map(|b| b.size).sum::<usize>();
                        ((i == keep) == same_list && bytes > 0).then_some((bytes, k, i))
                    })
                })
                .collect();
            fattest.sort_unstable_by_key(|c| std::cmp::Reverse(c.0));
            for (_, k, i) in fattest {
                let lists = &mut shards[k];
                while room < enough {
                    let Some(b) = lists.free[i].pop() else { break };
                    lists.cached -= b.size;
                    lists.allowance -= b.size;
                    totals.allowed -= b.size;
                    totals.held -= b.size;
                    totals.trimmed += b.size as u64;
                    room += b.size;
                    evicted.push(b);
                }
            }
        }
        debug_assert!(
            room >= block.size,
            "an empty cache holds any block up to max_cached"
        );
        let lists = &mut shards[self.own_shard()];
        let grant = room.min(wanted);
        lists.allowance += grant;
        totals.allowed += grant;
        Self::cache(lists, block);
        drop((shards, totals));
        tracing::debug!(
            evicted = evicted.len(),
            bytes = evicted.iter().map(|b| b.size).sum::<usize>(),
            "pinned host pool full: cached blocks evicted to keep the one returned"
        );
        evicted.iter().map(Self::free_of).collect()
    }

    /// The free of a block the pool does not keep.
    fn free_of(block: &PinnedBlock) -> Free {
        Free::Host {
            ptr: block.host,
            bytes: Self::counted(block),
        }
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
        let mut shards: Vec<_> = self.shards.iter().map(|s| s.inner.lock()).collect();
        let mut totals = lock(&self.totals);
        let mut blocks = Vec::new();
        for lists in &mut shards {
            blocks.extend(lists.free.iter_mut().flat_map(std::mem::take));
            lists.cached = 0;
            lists.allowance = 0;
            if reset {
                lists.in_use = 0;
                lists.in_use_blocks = 0;
            }
        }
        let bytes: usize = blocks.iter().map(|b| b.size).sum();
        totals.allowed = 0;
        totals.held -= bytes;
        if reset {
            self.generation.fetch_add(1, Ordering::AcqRel);
            totals.held = 0;
        } else {
            totals.trimmed += bytes as u64;
        }
        let frees = blocks.iter().map(Self::free_of).collect();
        (frees, bytes)
    }

    pub(crate) fn stats(&self) -> PoolStats {
        let (mut in_use, mut in_use_blocks, mut cached, mut free_blocks) = (0i64, 0i64, 0, 0);
        for shard in self.shards.iter() {
            let lists = shard.inner.lock();
            in_use += lists.in_use;
            in_use_blocks += lists.in_use_blocks;
            cached += lists.cached;
            free_blocks += lists.free.iter().map(Vec::len).sum::<usize>();
        }
        let totals = lock(&self.totals);
        let in_use_blocks = in_use_blocks.max(0) as usize;
        PoolStats {
            held_bytes: totals.held,
            in_use_bytes: in_use.max(0) as usize,
            in_use_blocks,
            cached_bytes: cached,
            peak_held_bytes: totals.peak_held,
            chunks: free_blocks + in_use_blocks,
            grows: totals.grows,
            trimmed_bytes: totals.trimmed,
        }
    }
}

/// Unmapped blocks come back here when their [`PinnedMemory`](crate::PinnedMemory) drops.
impl HostReleaseHook for PinnedPool {
    fn release(&self, host: HostPtr, size: usize, tag: u64) {
        let (generation, flags) = Self::untag(tag);
        let block = PinnedBlock {
            host,
            device: None,
            size: size_class::round_up(size),
            flags,
        };
        let frees = self.give_back(block, generation);
        if !frees.is_empty() && self.queue.push_all_without_flush(frees) {
            self.queue.apply_thresholds_from_drop();
        }
    }
}
