//! The pinned host pool: reuses page-locked host memory (`cuMemHostAlloc` costs hundreds of
//! microseconds), in the manner of cuda.core's `PinnedMemoryResource`. It lives in the
//! [`HostLayer`](crate::plugin::HostLayer), so every manager built on it (the default manager, the
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
use crate::error::EmmError;
use crate::lines::Lines;
use crate::memory::HostReleaseHook;
use crate::memory::host::HostKeeper;
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
    /// Its list ([`Kind::list`]): size class and flags.
    pub(crate) list: u32,
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

/// Bits of a tag that hold a block's list (a size class of [`size_class::CLASS_COUNT`], then
/// the three flag bits).
const LIST_BITS: u32 = 11;
const _: () = assert!(size_class::CLASS_COUNT << 3 <= 1 << LIST_BITS);

/// The most spare clones of the pool's own `Arc` a shard keeps for the blocks it hands out
/// (see [`Hooks`]).
const HOOKS_PER_SHARD: usize = 64;

/// Which list a request is served from and the size of its blocks: worked out once per
/// allocation ([`PinnedPool::kind`]) and carried in the block and its tag, so that neither
/// the pool nor the release works out a size class again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Kind {
    /// The size class, shifted past the three flag bits, then the flags.
    pub(crate) list: u32,
    /// The class's block size.
    pub(crate) size: usize,
}

impl Kind {
    /// The `cuMemHostAlloc` flags its blocks are allocated with.
    pub(crate) fn flags(self) -> u32 {
        self.list & FLAG_BITS
    }

    /// Whether its blocks are mapped into the device (`DEVICEMAP`).
    pub(crate) fn mapped(self) -> bool {
        self.flags() & driver_sys::host_alloc::DEVICEMAP != 0
    }
}

/// What [`PinnedPool::take`] found.
pub(crate) struct Taken {
    /// A cached block, its home set to this thread's shard; `None` when none was cached.
    pub(crate) block: Option<PinnedBlock>,
    /// The generation to stamp the block with.
    pub(crate) generation: u64,
    /// For an unmapped block, one of the shard's spare clones of the pool's `Arc`, if any.
    pub(crate) hook: Option<Arc<PinnedPool>>,
}

/// Spare clones of the pool's own `Arc`, kept in the shard of the thread that freed a block
/// (at home or not): the next unmapped block the thread takes carries one to its
/// [`PinnedMemory`](crate::PinnedMemory), which gives it back when it drops
/// ([`HostReleaseHook::release_owned`]). A pair on one thread then neither counts the pool's
/// reference count up and down (a line every thread would share) nor looks up a thread-local
/// list of spares. They are the pool's references to itself: the host layer's drop
/// [closes](PinnedPool::close) every shard's spares, after which a block's clone is dropped
/// when the block comes back.
#[derive(Default)]
struct Hooks {
    /// On lines of their own, as the block lists (`Lines`).
    spare: Lines<Arc<PinnedPool>>,
    closed: bool,
}

impl fmt::Debug for Hooks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Not the pool's own `Debug`: that locks every shard, this one among them.
        f.debug_struct("Hooks")
            .field("spare", &self.spare.len())
            .field("closed", &self.closed)
            .finish()
    }
}

/// A thread's own list that reaches this many blocks hands half of them to its shard's inbox.
const SPILL_AT: usize = 16;

/// The most blocks a thread takes from one inbox's list at a time.
const REFILL: usize = 16;

/// One thread's free lists.
#[derive(Default)]
struct Lists {
    /// Free blocks by list ([`Kind::list`]): size class, then flags (a plain index: no hashing
    /// on a cached pair). The
    /// lists and their blocks are on lines no other allocation shares (`Lines`): the lists
    /// outlive the threads that grew them, and a thread written beside them would slow their
    /// owner's every pair.
    free: Lines<Lines<PinnedBlock>>,
    cached: usize,
    /// Bytes this shard may cache (taken from [`Totals::allowed`]).
    allowance: usize,
    /// Blocks and bytes handed out from or returned to this shard; a block taken on one shard
    /// and returned to another makes both drift, their sums stay right.
    in_use: i64,
    in_use_blocks: i64,
    /// Spare clones of the pool's `Arc` (a thread's shard only; inboxes keep none).
    hooks: Hooks,
}

impl Lists {
    fn pop(&mut self, kind: Kind) -> Option<PinnedBlock> {
        let block = self.free.get_mut(kind.list as usize)?.pop()?;
        self.cached -= kind.size;
        Some(block)
    }

    /// The list at `i`, made if it is not there yet.
    #[inline(always)]
    fn list(&mut self, i: usize) -> &mut Lines<PinnedBlock> {
        if self.free.len() <= i {
            self.grow_to(i);
        }
        &mut self.free[i]
    }

    #[cold]
    #[inline(never)]
    fn grow_to(&mut self, i: usize) {
        while self.free.len() <= i {
            self.free.push(Lines::new());
        }
    }

    /// Moves up to `most` blocks of `from`'s list `i` (`size` bytes each) to `to`, with their
    /// cached bytes and allowance; returns how many moved.
    fn move_blocks(from: &mut Lists, to: &mut Lists, i: usize, size: usize, most: usize) -> usize {
        let Some(list) = from.free.get_mut(i) else {
            return 0;
        };
        let n = list.len().min(most);
        to.list(i).extend(list.split_off_last(n));
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
    /// Blocks given back to the driver (`cuMemFreeHost`), by eviction, trim or reset.
    frees: u64,
    /// The sum of the shards' allowances, at most `max_cached`.
    allowed: usize,
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

    /// The list a request of `bytes` with `flags` is served from and its block size, or
    /// `None` if it bypasses the pool.
    pub(crate) fn kind(&self, bytes: usize, flags: u32) -> Option<Kind> {
        debug_assert_eq!(
            flags & !FLAG_BITS,
            0,
            "a flag the pool does not know: {flags:#x}"
        );
        if bytes > self.config.max_block {
            return None;
        }
        let class = size_class::class_of(bytes.max(1));
        Some(Kind {
            list: (class as u32) << 3 | (flags & FLAG_BITS),
            size: size_class::class_size(class),
        })
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

    /// A cached block of `kind` (this thread's, else its inbox's, else another inbox's), the
    /// generation to stamp it with, and, for an unmapped block, one of the shard's spare
    /// clones of the pool's `Arc` if it has one (the caller clones the pool's otherwise).
    pub(crate) fn take(&self, kind: Kind) -> Taken {
        let (shard, owner) = thread_shard();
        let mut lists = self.shards[shard].inner.enter(owner);
        let generation = self.generation.load(Ordering::Acquire);
        let block = match lists.pop(kind) {
            Some(block) => block,
            None => match self.refill(&mut lists, shard, kind) {
                Some(block) => block,
                None => {
                    return Taken {
                        block: None,
                        generation,
                        hook: None,
                    };
                }
            },
        };
        lists.in_use += kind.size as i64;
        lists.in_use_blocks += 1;
        self.return_spare_allowance(&mut lists);
        let hook = if kind.mapped() {
            None
        } else {
            lists.hooks.spare.pop()
        };
        Taken {
            block: Some(PinnedBlock {
                home: shard as u32,
                ..block
            }),
            generation,
            hook,
        }
    }

    /// This thread's list of `size` with `flags` is empty: up to [`REFILL`] blocks come from
    /// the first inbox that has some, this thread's first; returns one of them.
    #[cold]
    #[inline(never)]
    fn refill(&self, lists: &mut Lists, shard: usize, kind: Kind) -> Option<PinnedBlock> {
        let i = kind.list as usize;
        let n = self.inboxes.len(); // a power of two: a mask wraps, not a division
        (0..n).map(|k| (shard + k) & (n - 1)).find_map(|k| {
            let mut inbox = self.inboxes[k].inner.lock();
            (Lists::move_blocks(&mut inbox, lists, i, kind.size, REFILL) > 0)
                .then(|| lists.pop(kind))
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
    /// block's home shard and its list (size class and flags).
    pub(crate) fn tag(generation: u64, block: &PinnedBlock) -> u64 {
        debug_assert!(block.home < 1 << HOME_BITS, "shards are at most 128");
        debug_assert!(block.list < 1 << LIST_BITS, "lists are at most 220 × 8");
        generation << (HOME_BITS + LIST_BITS)
            | u64::from(block.home) << LIST_BITS
            | u64::from(block.list)
    }

    /// The block a [`tag`](Self::tag) describes, at `host`, and its generation.
    fn untag(host: HostPtr, tag: u64) -> (PinnedBlock, u64) {
        let list = (tag & ((1 << LIST_BITS) - 1)) as u32;
        let block = PinnedBlock {
            host,
            device: None,
            size: size_class::class_size((list >> 3) as usize),
            list,
            home: ((tag >> LIST_BITS) & ((1 << HOME_BITS) - 1)) as u32,
        };
        (block, tag >> (HOME_BITS + LIST_BITS))
    }

    /// A block stamped `generation` is no longer used: cache it in this thread's shard.
    /// Returns the frees the caller must queue: none when the block is cached; the block
    /// itself when it is from before a reset or larger than the whole cache; and, when the
    /// cache is full, the cached blocks it displaced (see [`make_room`](Self::make_room)).
    #[must_use = "blocks the pool does not keep must be freed"]
    pub(crate) fn give_back(&self, block: PinnedBlock, generation: u64) -> Vec<Free> {
        self.give_back_then(block, generation, |_| {})
    }

    /// [`give_back`](Self::give_back), which calls `cached` with this thread's lists, still
    /// entered, when it cached the block there (the block was freed at home): the last thing
    /// it does with the pool. `cached` may therefore hand the shard the last reference that
    /// keeps the pool alive (as [`HostReleaseHook::release_owned`] does).
    #[inline(always)]
    fn give_back_then(
        &self,
        block: PinnedBlock,
        generation: u64,
        cached: impl FnOnce(&mut Lists),
    ) -> Vec<Free> {
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
            if at_home {
                if lists.free[i].len() >= SPILL_AT {
                    let mut inbox = self.inboxes[shard].inner.lock();
                    Lists::move_blocks(&mut lists, &mut inbox, i, block.size, SPILL_AT / 2);
                }
                cached(&mut lists);
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
        let i = block.list as usize;
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
            totals.frees += 1;
            return vec![Self::free_of(&block)];
        }
        for lists in all.iter_mut() {
            totals.allowed -= lists.allowance - lists.cached;
            lists.allowance = lists.cached;
        }
        let keep = block.list as usize;
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
                    totals.frees += 1;
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
    /// an inbox while waiting for an owner deadlocks (a thread refilling from an inbox with
    /// its shard entered, against a trim holding that inbox and waiting for the thread to leave
    /// its shard: `shard_owners_race_trims_and_counts_from_another_thread` checks it).
    fn lock_every_list(&self) -> Vec<BiasedGuard<'_, Lists>> {
        let mut all = Biased::lock_all(self.shards.iter().map(|s| &s.inner));
        // Inboxes have no owner (`Bias::None`): their `lock_all` waits for nobody.
        all.extend(Biased::lock_all(self.inboxes.iter().map(|s| &s.inner)));
        all
    }

    /// Queues the frees of blocks the pool did not keep, from a handle's drop.
    fn queue_frees(&self, frees: Vec<Free>) {
        if !frees.is_empty() && self.queue.push_all_without_flush(frees) {
            self.queue.apply_thresholds_from_drop();
        }
    }

    /// Closes every shard's spare clones of the pool's `Arc` ([`Hooks`]) and lets them go:
    /// the host layer that owns the pool is dropping, and clones the pool kept of itself would
    /// keep it alive for ever. Blocks still in use keep the pool until they drop.
    pub(crate) fn close(&self) {
        let mut all = self.lock_every_list();
        let spare: Vec<Arc<PinnedPool>> = all
            .iter_mut()
            .flat_map(|lists| {
                lists.hooks.closed = true;
                lists.hooks.spare.take_all()
            })
            .collect();
        drop(all);
        // The caller holds a reference: none of these is the last.
        drop(spare);
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
            blocks.extend(lists.free.iter_mut().flat_map(Lines::take_all));
            lists.cached = 0;
            lists.allowance = 0;
            if reset {
                lists.in_use = 0;
                lists.in_use_blocks = 0;
            }
        }
        let bytes: usize = blocks.iter().map(|b| b.size).sum();
        totals.frees += blocks.len() as u64;
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
            free_blocks += lists.free.iter().map(|l| l.len()).sum::<usize>();
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
            driver_allocations: totals.grows,
            driver_frees: totals.frees,
            // Host memory: no stream waits for another to use it.
            stream_waits: 0,
            host_waits: 0,
            trimmed_bytes: totals.trimmed,
            // Size-class lists: no block is split or merged, so no one figure says it.
            largest_free_bytes: None,
        }
    }
}

/// Unmapped blocks come back here when their [`PinnedMemory`](crate::PinnedMemory) drops.
impl HostReleaseHook for PinnedPool {
    fn release(&self, host: HostPtr, _size: usize, tag: u64) {
        let (block, generation) = Self::untag(host, tag);
        let frees = self.give_back(block, generation);
        self.queue_frees(frees);
    }

    /// A block in use stays allocated through a reset (its free waits for its drop); only
    /// its context's end frees it underneath: an access holds the context's liveness.
    fn keep_while(
        &self,
        host: HostPtr,
        tag: u64,
        what: &'static str,
        access: &mut dyn FnMut(),
    ) -> Result<(), EmmError> {
        HostKeeper::keep_while(&*self.queue, host, tag, what, access)
    }

    /// As `release`, and the block's clone of the pool's `Arc` goes to the freeing thread's
    /// spares ([`Hooks`]), if they are open and have room.
    fn release_owned(self: Arc<Self>, host: HostPtr, _size: usize, tag: u64) {
        let (block, generation) = Self::untag(host, tag);
        let this = Arc::into_raw(self);
        // SAFETY: `this` holds one strong count of the pool until it is rebuilt below, once:
        // in a shard's spares or dropped; so the pool outlives every use of `pool`. Once the
        // count is in the spares, the shard they are in stays entered until this function
        // returns without using `pool` again, and no other thread can take the spares before
        // that (`close` takes every shard).
        let pool = unsafe { &*this };
        let mut kept = false;
        let frees = pool.give_back_then(block, generation, |lists| {
            // SAFETY: `give_back_then` calls this with the shard entered, as the last thing it
            // does with the pool; `kept` tells the code below that the count is given.
            kept = unsafe { Self::keep_spare(lists, this) };
        });
        if kept {
            return;
        }
        pool.queue_frees(frees);
        // Freed away from home (or not cached): the reference goes to this thread's own
        // spares all the same, for the next block this thread takes. A thread that frees
        // what others allocate would otherwise drop a reference every pair while its own
        // allocations cloned one, two updates of one shared count.
        let (shard, owner) = thread_shard();
        let mut lists = pool.shards[shard].inner.enter(owner);
        // SAFETY: `lists` stays entered until this function returns, and `pool` is not used
        // after it.
        if unsafe { Self::keep_spare(&mut lists, this) } {
            return;
        }
        drop(lists);
        // SAFETY: the count `into_raw` kept, not given to the spares; `pool` is not used
        // after this.
        drop(unsafe { Arc::from_raw(this) });
    }
}

impl PinnedPool {
    /// Puts the reference `this` holds in `lists`' spares if they are open and have room;
    /// returns whether it did (the count is then the spares').
    ///
    /// # Safety
    ///
    /// `this` comes from `Arc::into_raw` of this pool and its count is the caller's, which it
    /// gives up when this returns `true`; `lists` is one of this pool's shards, entered until
    /// the caller no longer uses the pool.
    unsafe fn keep_spare(lists: &mut Lists, this: *const PinnedPool) -> bool {
        if lists.hooks.closed || lists.hooks.spare.len() >= HOOKS_PER_SHARD {
            return false;
        }
        // SAFETY: the caller's count, given to the spares (this function's contract).
        lists.hooks.spare.push(unsafe { Arc::from_raw(this) });
        true
    }
}

#[cfg(all(test, not(emm_loom)))]
mod tests {
    use std::sync::Weak;

    use super::*;
    use crate::contract::factory::ManagerContext;
    use crate::host::HostLayer;
    use crate::memory::host::HostAllocFlags;

    /// A host layer with the pinned pool on a simulated GPU (no runtime: this module sits
    /// below it), and a weak reference to its pool.
    fn layer() -> (HostLayer, Weak<PinnedPool>) {
        let host = HostLayer::new(&ManagerContext::simulated(
            Some(PinnedPoolConfig::default()),
        ));
        let pool = Arc::downgrade(host.pinned.as_ref().expect("a pinned pool"));
        (host, pool)
    }

    fn pinned(host: &HostLayer, bytes: usize) -> crate::memory::HostMemory {
        host.memhostalloc(bytes, HostAllocFlags::PINNED)
            .expect("pinned memory")
    }

    /// The spare clones every shard keeps.
    fn spares(pool: &Weak<PinnedPool>) -> usize {
        let pool = pool.upgrade().expect("the pool");
        let all = pool.lock_every_list();
        all.iter().map(|l| l.hooks.spare.len()).sum()
    }

    #[test]
    fn a_blocks_reference_to_the_pool_is_kept_for_the_next_block_and_let_go_with_the_layer() {
        let (host, pool) = layer();
        assert_eq!(pool.strong_count(), 1, "the layer's");
        let first = pinned(&host, 4096);
        assert_eq!(pool.strong_count(), 2, "the block's clone");
        drop(first);
        assert_eq!(spares(&pool), 1, "kept by the freeing thread's shard");
        for _ in 0..10 {
            let again = pinned(&host, 4096);
            assert_eq!(spares(&pool), 0, "the spare went to the block");
            drop(again);
            assert_eq!(pool.strong_count(), 2, "no clone made or dropped");
        }
        // More blocks at once than spares: clones are made (a block from the driver takes a
        // new one, the spare stays), and all come back.
        let held: Vec<_> = (0..HOOKS_PER_SHARD + 8)
            .map(|_| pinned(&host, 512))
            .collect();
        assert_eq!(pool.strong_count(), 2 + HOOKS_PER_SHARD + 8);
        assert_eq!(spares(&pool), 1);
        drop(held);
        assert_eq!(spares(&pool), HOOKS_PER_SHARD, "bounded");
        assert_eq!(pool.strong_count(), 1 + HOOKS_PER_SHARD);
        // Mapped blocks take no spare (their entry in the layer's table holds the pool).
        let mapped = host
            .memhostalloc(4096, HostAllocFlags::MAPPED)
            .expect("mapped");
        assert_eq!(spares(&pool), HOOKS_PER_SHARD);
        drop(mapped);
        drop(host);
        assert_eq!(pool.strong_count(), 0, "the layer's drop let the spares go");
    }

    #[test]
    fn a_block_that_outlives_the_layer_keeps_the_pool_until_it_drops() {
        let (host, pool) = layer();
        let kept = pinned(&host, 4096);
        drop(pinned(&host, 4096));
        drop(host);
        assert_eq!(pool.strong_count(), 1, "only the live block's clone");
        drop(kept);
        assert_eq!(pool.strong_count(), 0, "a closed shard keeps no spare");
    }

    #[test]
    fn a_block_freed_on_another_thread_leaves_its_reference_with_that_thread() {
        let (host, pool) = layer();
        let block = pinned(&host, 4096);
        assert_eq!(pool.strong_count(), 2);
        std::thread::spawn(move || drop(block))
            .join()
            .expect("the freeing thread");
        assert_eq!(spares(&pool), 1, "kept by the freeing thread's shard");
        assert_eq!(pool.strong_count(), 2);
        // Its block went to its home's inbox and comes back to this thread.
        let again = pinned(&host, 4096);
        assert_eq!(host.pinned_pool_stats().expect("stats").grows, 1);
        drop(again);
        drop(host);
        assert_eq!(pool.strong_count(), 0);
    }

    #[test]
    fn a_tag_gives_back_the_block_it_was_made_from() {
        let (host, pool) = layer();
        let pool = pool.upgrade().expect("the pool");
        for (bytes, flags) in [(1, 0), (4096, 1), (5000, 5), (1 << 20, 7)] {
            let kind = pool.kind(bytes, flags).expect("pooled");
            assert_eq!(
                kind.size,
                size_class::class_size(size_class::class_of(bytes))
            );
            assert_eq!(kind.list & FLAG_BITS, flags);
            let block = PinnedBlock {
                host: HostPtr(0x1000),
                device: None,
                size: kind.size,
                list: kind.list,
                home: 127,
            };
            let generation = (1 << 40) + 3;
            assert_eq!(
                PinnedPool::untag(HostPtr(0x1000), PinnedPool::tag(generation, &block)),
                (block, generation)
            );
        }
        assert_eq!(pool.kind(pool.config.max_block + 1, 0), None, "too large");
        drop(host);
    }
}
