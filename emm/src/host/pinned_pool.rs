//! The pinned host pool: reuses page-locked host memory (`cuMemHostAlloc` costs hundreds of
//! microseconds), in the manner of cuda.core's `PinnedMemoryResource`. It lives in the
//! [`HostLayer`](crate::HostLayer), so every manager built on it (the default manager, the
//! pool, a plugin's `HostOnly<_>`) gets it when the runtime asks for it
//! ([`RuntimeBuilder::pinned_host_pool`](crate::RuntimeBuilder::pinned_host_pool) or
//! `EMM_PINNED_HOST_POOL`).
//!
//! - Requests up to [`PinnedPoolConfig::max_block`] are rounded to a size class (4 per
//!   doubling) and served from a free list per (flags, size); larger ones bypass the pool.
//! - **Per-thread shards, and an inbox each.** A thread's cached blocks live in its shard
//!   (`thread_slots`), which the thread that owns it enters without a lock or an atomic
//!   read-modify-write (`sync::Biased`; a spin lock where `membarrier` is not available), so
//!   a cached pair freed on the thread that got it touches no shared line. Every block
//!   remembers its home (the shard of the thread it was handed to); a block freed on another
//!   thread goes to its home's inbox (a spin lock each), and a thread's list that reaches
//!   [`SPILL_AT`] blocks hands half of them to its own inbox. A thread whose list is empty
//!   takes up to [`REFILL`] blocks from its inbox, then from the other inboxes, before it
//!   calls the driver. Blocks a thread freed itself stay in its shard, where other threads
//!   do not look (up to [`SPILL_AT`]` - 1` per size and kind; `trim`, `reset` and the cache
//!   bound still reach them): another thread that needs that size makes its own.
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
use crate::sync::{AtomicU64, Bias, Biased, BiasedGuard, Mutex, Ordering, lock};
use crate::thread_slots::{self, Shard, thread_shard};

/// A cached block: host address and, for mapped blocks, the device address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PinnedBlock {
    pub(crate) host: HostPtr,
    pub(crate) device: Option<DevicePtr>,
    pub(crate) size: usize,
    pub(crate) flags: u32,
    /// The shard of the thread it was handed out to: freed on another thread, it goes to that
    /// shard's inbox, so that the thread that uses it gets it back.
    pub(crate) home: u32,
}

/// The flag bits a block's list is chosen by: `cuMemHostAlloc`'s `PORTABLE`, `DEVICEMAP` and
/// `WRITECOMBINED` (1, 2, 4), the only flags emm passes.
const FLAG_BITS: u32 = 0b111;

/// The smallest allowance a shard takes from the pool at a time, and the unused allowance it
/// may keep.
pub(crate) const ALLOWANCE_STEP: usize = 1 << 20;

/// Bits of a tag that hold a block's home shard ([`thread_slots::shard_total`] is at most 128).
const HOME_BITS: u32 = 8;

/// A thread's own list that reaches this many blocks hands half of them to its shard's inbox.
const SPILL_AT: usize = 16;

/// The most blocks a thread takes from one inbox's list at a time.
const REFILL: usize = 16;

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

    /// The list at `i`, made if it is not there yet.
    #[inline(always)]
    fn list(&mut self, i: usize) -> &mut Vec<PinnedBlock> {
        if self.free.len() <= i {
            self.grow_to(i);
        }
        &mut self.free[i]
    }

    #[cold]
    #[inline(never)]
    fn grow_to(&mut self, i: usize) {
        self.free.resize_with(i + 1, Vec::new);
    }

    /// Moves up to `most` blocks of `from`'s list `i` (`size` bytes each) to `to`, with their
    /// cached bytes and allowance; returns how many moved.
    fn move_blocks(from: &mut Lists, to: &mut Lists, i: usize, size: usize, most: usize) -> usize {
        let Some(list) = from.free.get_mut(i) else {
            return 0;
        };
        let n = list.len().min(most);
        to.list(i).extend(list.drain(list.len() - n..));
        from.cached -= n * size;
        from.allowance -= n * size;
        to.cached += n * size;
        to.allowance += n * size;
        n
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

/// The pool of one host layer. Locks are taken in this order: a shard, an inbox, `totals`;
/// the paths that take every shard (trim, reset, statistics, a full cache) take them all
/// first, then the inboxes in order ([`Biased::lock_all`], one heavy fence for all).
pub(crate) struct PinnedPool {
    config: PinnedPoolConfig,
    /// The host layer's deferred-deallocation queue: blocks the pool does not keep are freed
    /// through it.
    queue: Arc<PendingDeallocs>,
    /// Bumped by `drain(true)` (a reset) while every shard's lock is held.
    generation: AtomicU64,
    /// Per-thread lists ([`Shard::all`]): a thread that owns its shard takes and returns
    /// cached blocks there without a lock or an atomic read-modify-write. No other thread
    /// visits them but to trim, reset, count or make room (all at once, with one heavy fence).
    shards: Box<[Shard<Lists>]>,
    /// One inbox per shard, a plain spin lock each: a thread's list that reaches
    /// [`SPILL_AT`] blocks hands half of them to its inbox, and a thread that misses its own
    /// list takes from its inbox, then from the others', before it calls the driver. An inbox
    /// caches against an allowance as a shard does (a block freed away from home may take a
    /// step of it from the pool; blocks moved in or out carry theirs). Locked after the
    /// shards.
    inboxes: Box<[Shard<Lists>]>,
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
            shards: Shard::all(Lists::default),
            inboxes: (0..thread_slots::shard_total())
                .map(|_| Shard {
                    inner: Biased::new(Lists::default(), Bias::None),
                })
                .collect(),
            totals: Mutex::new(Totals::default()),
        }
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

    /// A cached block of `size` bytes with `flags` (this thread's, else its inbox's, else
    /// another inbox's), and the generation to stamp it with.
    pub(crate) fn take(&self, flags: u32, size: usize) -> (Option<PinnedBlock>, u64) {
        let (shard, owner) = thread_shard();
        let mut lists = self.shards[shard].inner.enter(owner);
        let generation = self.generation.load(Ordering::Acquire);
        let block = match lists.pop(flags, size) {
            Some(block) => Some(block),
            None => self.refill(&mut lists, shard, flags, size),
        };
        if block.is_some() {
            lists.in_use += size as i64;
            lists.in_use_blocks += 1;
            self.return_spare_allowance(&mut lists);
        }
        (
            block.map(|b| PinnedBlock {
                home: shard as u32,
                ..b
            }),
            generation,
        )
    }

    /// This thread's list of `size` with `flags` is empty: up to [`REFILL`] blocks come from
    /// the first inbox that has some, this thread's first; returns one of them.
    #[cold]
    #[inline(never)]
    fn refill(
        &self,
        lists: &mut Lists,
        shard: usize,
        flags: u32,
        size: usize,
    ) -> Option<PinnedBlock> {
        let i = list_index(flags, size);
        let n = self.inboxes.len(); // a power of two: a mask wraps, not a division
        (0..n).map(|k| (shard + k) & (n - 1)).find_map(|k| {
            let mut inbox = self.inboxes[k].inner.lock();
            (Lists::move_blocks(&mut inbox, lists, i, size, REFILL) > 0)
                .then(|| lists.pop(flags, size))
                .flatten()
        })
    }

    /// Counts a block the caller has just allocated from the driver as held and in use;
    /// returns the generation to stamp it with and its home shard.
    pub(crate) fn grew(&self, size: usize) -> (u64, u32) {
        let (shard, owner) = thread_shard();
        let mut lists = self.shards[shard].inner.enter(owner);
        lists.in_use += size as i64;
        lists.in_use_blocks += 1;
        let mut totals = lock(&self.totals);
        totals.held += size;
        totals.peak_held = totals.peak_held.max(totals.held);
        totals.grows += 1;
        (self.generation.load(Ordering::Acquire), shard as u32)
    }

    /// The tag of an unmapped block handed out by [`HostReleaseHook`]: the generation, the
    /// block's home shard and the flags it was allocated with.
    pub(crate) fn tag(generation: u64, block: &PinnedBlock) -> u64 {
        debug_assert!(block.home < 1 << HOME_BITS, "shards are at most 128");
        generation << (HOME_BITS + 3)
            | u64::from(block.home) << 3
            | u64::from(block.flags & FLAG_BITS)
    }

    /// The generation, home and flags a [`tag`](Self::tag) holds.
    fn untag(tag: u64) -> (u64, u32, u32) {
        (
            tag >> (HOME_BITS + 3),
            ((tag >> 3) & ((1 << HOME_BITS) - 1)) as u32,
            (tag & u64::from(FLAG_BITS)) as u32,
        )
    }

    /// A block stamped `generation` is no longer used: cache it in this thread's shard.
    /// Returns the frees the caller must queue: none when the block is cached; the block
    /// itself when it is from before a reset or larger than the whole cache; and, when the
    /// cache is full, the cached blocks it displaced (see [`make_room`](Self::make_room)).
    #[must_use = "blocks the pool does not keep must be freed"]
    pub(crate) fn give_back(&self, block: PinnedBlock, generation: u64) -> Vec<Free> {
        let (shard, owner) = thread_shard();
        let at_home = block.home as usize == shard;
        // At home, this thread's lists; freed away from home, the home shard's inbox, where
        // its thread looks first.
        let mut lists = if at_home {
            self.shards[shard].inner.enter(owner)
        } else {
            self.inboxes[block.home as usize].inner.lock()
        };
        if self.generation.load(Ordering::Acquire) != generation {
            return vec![Self::free_of(&block)];
        }
        if let Some(i) = self.keep(&mut lists, block) {
            if at_home && lists.free[i].len() >= SPILL_AT {
                let mut inbox = self.inboxes[shard].inner.lock();
                Lists::move_blocks(&mut lists, &mut inbox, i, block.size, SPILL_AT / 2);
            }
            return Vec::new();
        }
        drop(lists);
        self.make_room(block, generation)
    }

    /// Counts `block` as no longer in use in `lists` and caches it there if the allowance
    /// `lists` holds, or can take from the pool, covers it; returns its list's index, or
    /// `None` when the cache is full.
    #[inline(always)]
    fn keep(&self, lists: &mut Lists, block: PinnedBlock) -> Option<usize> {
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
        allowed.then(|| Self::cache(lists, block))
    }

    /// Puts `block` on its list in `lists`, against allowance the caller made sure of;
    /// returns the list's index.
    #[inline(always)]
    fn cache(lists: &mut Lists, block: PinnedBlock) -> usize {
        lists.cached += block.size;
        let i = list_index(block.flags, block.size);
        lists.list(i).push(block);
        i
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
        let own = thread_shard().0;
        let mut all = self.lock_every_list();
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
        for lists in all.iter_mut() {
            totals.allowed -= lists.allowance - lists.cached;
            lists.allowance = lists.cached;
        }
        let keep = list_index(block.flags, block.size);
        let wanted = block.size.max(ALLOWANCE_STEP).min(self.config.max_cached);
        let mut room = self.config.max_cached - totals.allowed;
        let mut evicted = Vec::new();
        // Lists of other sizes and kinds first, then the block's own.
        for (same_list, enough) in [(false, wanted), (true, block.size)] {
            let mut fattest: Vec<(usize, usize, usize)> = all
                .iter()
                .enumerate()
                .flat_map(|(k, lists)| {
                    lists.free.iter().enumerate().filter_map(move |(i, list)| {
                        // A list's blocks are all of its class size.
                        let bytes = list.first().map_or(0, |b| b.size * list.len());
                        ((i == keep) == same_list && bytes > 0).then_some((bytes, k, i))
                    })
                })
                .collect();
            fattest.sort_unstable_by_key(|c| std::cmp::Reverse(c.0));
            for (_, k, i) in fattest {
                let lists = &mut *all[k];
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
        // Where `give_back` would have put it: this thread's lists, or its home's inbox.
        let to = if block.home as usize == own {
            own
        } else {
            self.shards.len() + block.home as usize
        };
        let lists = &mut *all[to];
        let grant = room.min(wanted);
        lists.allowance += grant;
        totals.allowed += grant;
        Self::cache(lists, block);
        drop((all, totals));
        tracing::debug!(
            evicted = evicted.len(),
            bytes = evicted.iter().map(|b| b.size).sum::<usize>(),
            "pinned host pool full: cached blocks evicted to keep the one returned"
        );
        evicted.iter().map(Self::free_of).collect()
    }

    /// Every shard's lists, then every inbox's, taken as a thread that owns none, with one
    /// heavy fence (the paths that reach every cached block: trim, reset, statistics, a full
    /// cache).
    ///
    /// The shards are taken to the end, their owners out, before any inbox: an owner inside
    /// its shard may wait for an inbox (`refill`, and the spill in `give_back`), so holding
    /// an inbox while waiting for an owner deadlocks. Taking all of them in one `lock_all`
    /// did, on a 16-core host (`shard_owners_race_trims_and_counts_from_another_thread` hung
    /// in the GPU job at e033ff5: a thread refilling from an inbox with its shard entered, the
    /// trim holding that inbox and waiting for the thread to leave its shard).
    fn lock_every_list(&self) -> Vec<BiasedGuard<'_, Lists>> {
        let mut all = Biased::lock_all(self.shards.iter().map(|s| &s.inner));
        // Inboxes have no owner (`Bias::None`): their `lock_all` waits for nobody.
        all.extend(Biased::lock_all(self.inboxes.iter().map(|s| &s.inner)));
        all
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
        let mut all = self.lock_every_list();
        let mut totals = lock(&self.totals);
        let mut blocks = Vec::new();
        for lists in all.iter_mut() {
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
        let all = self.lock_every_list();
        for lists in all.iter() {
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
        let (generation, home, flags) = Self::untag(tag);
        let block = PinnedBlock {
            host,
            device: None,
            size: size_class::round_up(size),
            flags,
            home,
        };
        let frees = self.give_back(block, generation);
        if !frees.is_empty() && self.queue.push_all_without_flush(frees) {
            self.queue.apply_thresholds_from_drop();
        }
    }
}
