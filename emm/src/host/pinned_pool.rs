//! The pinned host pool: reuses page-locked host memory (`cuMemHostAlloc` costs hundreds of
//! microseconds), in the manner of cuda.core's `PinnedMemoryResource`. It lives in the
//! [`HostLayer`](crate::HostLayer), so every manager built on it (the default manager, the
//! pool, a plugin's `HostOnly<_>`) gets it when the runtime asks for it
//! ([`RuntimeBuilder::pinned_host_pool`](crate::RuntimeBuilder::pinned_host_pool) or
//! `EMM_PINNED_HOST_POOL`).
//!
//! - Requests up to [`PinnedPoolConfig::max_block`] are rounded to a size class (4 per
//!   doubling) and served from a free list per (flags, size); larger ones bypass the pool.
//! - **Per-thread shards.** The lists live in per-thread shards, each on its own cache lines
//!   behind a spin lock: a thread has the shard of its slot (`thread_slots`), so that live
//!   threads do not share one until there are more of them than shards. A thread whose own
//!   lists are empty looks in the other shards that have a block of its class (a bit per
//!   class each shard publishes) before it calls the driver (a `cuMemHostAlloc` costs
//!   hundreds of microseconds), and takes up to half of that list, at most 16 blocks, with
//!   their allowance, so that a thread that allocates what others free does not visit them
//!   once per block.
//! - **The cache bound.** The shards together never hold more than
//!   [`PinnedPoolConfig::max_cached`] bytes: a shard caches against an allowance it takes
//!   from the pool in steps of at least [`ALLOWANCE_STEP`], and hands back what it does not
//!   use beyond one step. A block returned when no allowance is left is freed (through the
//!   deferred queue); so a thread may free a block while other shards hold up to one step of
//!   unused allowance each.
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
use crate::thread_slots::{shard_total, thread_shard};

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

/// The most blocks a thread moves to its own shard, beside the one it takes, when it takes a
/// block from another thread's shard (`PinnedPool::steal`).
const STEAL_BATCH: usize = 16;

/// One thread's free lists.
#[derive(Debug)]
struct Lists {
    /// Free blocks by [`list_index`]: size class, then flags (a plain index, not a hash map: a
    /// hashed key cost about 400 instructions of the 1 000 a cached pair took).
    free: Vec<Vec<PinnedBlock>>,
    /// A bit per size class ([`class_bit`]) with a block in any of its lists, kept exact: a
    /// stale bit would send a thread that misses its own shard into this one for nothing (on
    /// the H100, bits cleared only by such visits halved the pinned pool's throughput on 8
    /// threads, each futile visit a `membarrier` that interrupts every running thread).
    classes: u64,
    /// Per bit of `classes`, how many of its lists hold a block (the bit is set while this is
    /// not 0).
    nonempty: [u16; 64],
    cached: usize,
    /// Bytes this shard may cache (taken from [`Totals::allowed`]).
    allowance: usize,
    /// Blocks and bytes handed out from or returned to this shard; a block taken on one shard
    /// and returned to another makes both drift, their sums stay right.
    in_use: i64,
    in_use_blocks: i64,
}

impl Default for Lists {
    fn default() -> Lists {
        Lists {
            free: Vec::new(),
            classes: 0,
            nonempty: [0; 64],
            cached: 0,
            allowance: 0,
            in_use: 0,
            in_use_blocks: 0,
        }
    }
}

impl Lists {
    fn pop(&mut self, flags: u32, size: usize) -> Option<PinnedBlock> {
        let i = list_index(flags, size);
        let list = self.free.get_mut(i)?;
        let block = list.pop()?;
        if list.is_empty() {
            self.emptied(i);
        }
        self.cached -= size;
        Some(block)
    }

    /// List `i` was just emptied: clears its class's bit unless another list of the same bit
    /// (the class with other flags, or another class from 63 up) holds a block.
    fn emptied(&mut self, i: usize) {
        let bit = class_bit(i);
        self.nonempty[bit] -= 1;
        if self.nonempty[bit] == 0 {
            self.classes &= !(1 << bit);
        }
    }

    /// List `i`, empty until now, holds a block.
    fn filled(&mut self, i: usize) {
        let bit = class_bit(i);
        self.nonempty[bit] += 1;
        self.classes |= 1 << bit;
    }

    /// Puts `blocks` (all of list `i`'s size) on list `i`, which the caller counts as cached.
    fn push(&mut self, i: usize, blocks: Vec<PinnedBlock>) {
        if blocks.is_empty() {
            return;
        }
        if self.free.len() <= i {
            self.free.resize_with(i + 1, Vec::new);
        }
        if self.free[i].is_empty() {
            self.filled(i);
        }
        self.free[i].extend(blocks);
    }
}

/// The bit of [`Lists::classes`] for list `i`: its size class, the classes from 63 up (blocks
/// of 32 MiB and more, which the default `max_block` of 64 MiB admits) sharing the last bit.
fn class_bit(i: usize) -> usize {
    (i >> 3).min(63)
}

/// One shard, on its own cache lines. Its lock is a plain spin lock for every thread, owner
/// included, unlike the `pool` manager's shards: a thread that misses here takes blocks from
/// other threads' shards (the pool's threads go to a depot instead), and on the H100 with the
/// shards biased to their owners (`sync::Biased`) each such visit cost a `membarrier` that
/// interrupted every running thread. The cached pair gained 5 to 25 % (medians of paired
/// rounds), but 8 and 16 threads that each hold 8 blocks fell from 60-83 to 38-50 M pairs a
/// second, and in one round of four to 0.5 (BENCHMARKS.md, run T).
#[repr(align(128))]
struct Shard {
    lists: Biased<Lists>,
    /// `lists`'s classes with a block ([`Lists::classes`]), as its last holder left them: read
    /// without entering, by a thread that looks for a block to take, so that it enters (a
    /// heavy fence, for an owned shard) only a shard that had a block of its class. A thread
    /// that misses everywhere then enters none.
    classes: AtomicU64,
}

impl Shard {
    /// Publishes which classes `lists` (this shard's, held) has blocks of now.
    fn publish(&self, lists: &Lists) {
        self.classes.store(lists.classes, Ordering::Relaxed);
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
    shards: Box<[Shard]>,
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
            shards: (0..shard_total())
                .map(|_| Shard {
                    // Not biased: a thread that misses its own shard takes blocks from the
                    // others, and a membarrier for each of those visits measured worse than the
                    // lock it saves (see `Shard`).
                    lists: Biased::new(Lists::default(), Bias::None),
                    classes: AtomicU64::new(0),
                })
                .collect(),
            totals: Mutex::new(Totals::default()),
        }
    }

    /// This thread's shard, and whether the thread owns it (`thread_slots::thread_shard`).
    fn own_shard(&self) -> (usize, bool) {
        (thread_shard().0, false) // the shards are not biased: every thread takes the lock
    }

    /// Every shard, taken in index order.
    fn lock_all(&self) -> Vec<crate::sync::BiasedGuard<'_, Lists>> {
        Biased::lock_all(self.shards.iter().map(|s| &s.lists))
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
        let (own, owner) = self.own_shard();
        {
            let shard = &self.shards[own];
            let mut lists = shard.lists.enter(owner);
            let generation = self.generation.load(Ordering::Acquire);
            let bits = lists.classes;
            if let Some(block) = lists.pop(flags, size) {
                lists.in_use += size as i64;
                lists.in_use_blocks += 1;
                self.return_spare_allowance(&mut lists);
                if lists.classes != bits {
                    shard.publish(&lists);
                }
                return (Some(block), generation);
            }
        }
        let n = self.shards.len(); // a power of two: a mask wraps, not a division
        for from in (1..n).map(|k| (own + k) & (n - 1)) {
            let bit = class_bit(list_index(flags, size));
            if self.shards[from].classes.load(Ordering::Relaxed) & 1 << bit == 0 {
                continue; // nothing of this class there, as its holder last left it
            }
            if let Some(found) = self.steal(own, from, flags, size) {
                return found;
            }
        }
        (None, self.generation.load(Ordering::Acquire))
    }

    /// A block of `size` with `flags` from shard `from`, for this thread, whose shard is `own`;
    /// with it, up to half of that list (at most [`STEAL_BATCH`] blocks) moves to `own`, with
    /// as much of `from`'s allowance, so that a thread that allocates what other threads free
    /// enters their shards (a heavy fence each time) once per batch, not once per block. Both
    /// shards are held at once, taken in index order (as every holder of several takes them),
    /// so that no block is ever outside a shard while a trim or a reset counts them.
    fn steal(
        &self,
        own: usize,
        from: usize,
        flags: u32,
        size: usize,
    ) -> Option<(Option<PinnedBlock>, u64)> {
        let (low, high) = (own.min(from), own.max(from));
        let mut both = Biased::lock_all([&self.shards[low].lists, &self.shards[high].lists]);
        let (first, second) = both.split_at_mut(1);
        let (mine, theirs) = if own < from {
            (&mut *first[0], &mut *second[0])
        } else {
            (&mut *second[0], &mut *first[0])
        };
        let generation = self.generation.load(Ordering::Acquire);
        let Some(block) = theirs.pop(flags, size) else {
            return None; // the owner took them since it published, or other flags
        };
        let i = list_index(flags, size);
        let list = &mut theirs.free[i];
        let batch: Vec<PinnedBlock> = list
            .drain(list.len() - (list.len() / 2).min(STEAL_BATCH)..)
            .collect();
        if !batch.is_empty() && list.is_empty() {
            theirs.emptied(i); // (a pop that emptied it counted that already)
        }
        // Every shard caches within its allowance, so `theirs` has the batch's allowance.
        let bytes = batch.len() * size;
        theirs.cached -= bytes;
        theirs.allowance -= bytes;
        mine.cached += bytes;
        mine.allowance += bytes;
        mine.push(i, batch);
        mine.in_use += size as i64;
        mine.in_use_blocks += 1;
        self.return_spare_allowance(theirs);
        self.shards[own].publish(mine);
        self.shards[from].publish(theirs);
        Some((Some(block), generation))
    }

    /// Counts a block the caller has just allocated from the driver as held and in use;
    /// returns the generation to stamp it with.
    pub(crate) fn grew(&self, size: usize) -> u64 {
        let (own, owner) = self.own_shard();
        let mut lists = self.shards[own].lists.enter(owner);
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

    /// A block stamped `generation` is no longer used: cache it in this thread's shard, or
    /// return the free the caller must queue (when the pool may cache no more, or when the
    /// block is from before a reset).
    #[must_use = "a block the pool does not keep must be freed"]
    pub(crate) fn give_back(&self, block: PinnedBlock, generation: u64) -> Option<Free> {
        let (own, owner) = self.own_shard();
        let shard = &self.shards[own];
        let mut lists = shard.lists.enter(owner);
        if self.generation.load(Ordering::Acquire) == generation {
            lists.in_use -= block.size as i64;
            lists.in_use_blocks -= 1;
            let need = (lists.cached + block.size).saturating_sub(lists.allowance);
            let allowed = need == 0 || {
                let mut totals = lock(&self.totals);
                let grant = need
                    .max(ALLOWANCE_STEP)
                    .min(self.config.max_cached - totals.allowed);
                if grant >= need {
                    totals.allowed += grant;
                    lists.allowance += grant;
                    true
                } else {
                    totals.held -= block.size;
                    totals.trimmed += block.size as u64;
                    false
                }
            };
            if allowed {
                lists.cached += block.size;
                let i = list_index(block.flags, block.size);
                if lists.free.len() <= i {
                    lists.free.resize_with(i + 1, Vec::new);
                }
                let list = &mut lists.free[i];
                list.push(block);
                if list.len() == 1 {
                    lists.filled(i);
                    shard.publish(&lists);
                }
                return None;
            }
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
        let mut shards = self.lock_all();
        let mut totals = lock(&self.totals);
        let mut blocks = Vec::new();
        for (lists, shard) in shards.iter_mut().zip(self.shards.iter()) {
            blocks.extend(lists.free.iter_mut().flat_map(std::mem::take));
            lists.cached = 0;
            lists.classes = 0;
            lists.nonempty = [0; 64];
            shard.publish(lists);
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
        let (mut in_use, mut in_use_blocks, mut cached, mut free_blocks) = (0i64, 0i64, 0, 0);
        for lists in self.lock_all() {
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
        if let Some(free) = self.give_back(block, generation) {
            self.queue.push_from_drop(free);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        #![proptest_config(crate::test_config::proptest_config())]

        /// Random pushes and pops of blocks of random classes and flags: a class's bit in
        /// `Lists::classes` (what stealers read to skip a shard) is set exactly when one of the
        /// lists of its bit holds a block, and each pop returns a block of the size and flags
        /// asked for. 256 cases (`PROPTEST_CASES=N` for more).
        #[test]
        fn a_class_bit_is_set_exactly_when_the_class_has_a_block(
            steps in proptest::collection::vec((0u8..2, proptest::sample::select(vec![0usize, 1, 5, 11, 62, 63, 70]), 0u32..8), 1..200)
        ) {
            let mut lists = Lists::default();
            for (step, class, flags) in steps {
                let size = size_class::class_size(class);
                if step == 1 {
                    let block = PinnedBlock { host: HostPtr(size), device: None, size, flags };
                    lists.cached += size;
                    lists.push(list_index(flags, size), vec![block]);
                } else if let Some(block) = lists.pop(flags, size) {
                    proptest::prop_assert_eq!((block.size, block.flags), (size, flags));
                }
                for bit in 0..64 {
                    let held = lists.free.iter().enumerate().any(|(i, l)| class_bit(i) == bit && !l.is_empty());
                    proptest::prop_assert_eq!(lists.classes & 1 << bit != 0, held, "bit {}", bit);
                }
            }
        }
    }
}
