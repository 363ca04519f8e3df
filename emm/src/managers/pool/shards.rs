//! The per-thread shards of size-class free lists, and the release hook that returns a
//! block to the shard it came from.

use std::sync::Arc;

use driver_sys::DevicePtr;

use super::history::Ring;
use super::{CLASSES, PoolShared};
use crate::lines::Lines;
use crate::memory::pointer::{ParkedPointer, PoolHook, ReleaseHook, StreamUse};
use crate::size_class::class_size;
use crate::sync::Ordering;
use crate::thread_slots::thread_shard;

/// The most pointer records one shard keeps parked with their blocks ([`ParkedPointer`]), over
/// all classes: a record is a heap box of 128 bytes on x86-64, so at most 32 KiB per shard.
pub(super) const PARKED_PER_SHARD: usize = 256;

pub(super) struct ShardLists {
    /// Per size class, free blocks whose last pointer's record is kept with them (most recent
    /// last): the next allocation of the class revives one. Taken before `free`.
    pub(super) parked: [Lines<ParkedPointer>; CLASSES],
    /// Records `parked` may still take: [`PARKED_PER_SHARD`] less those it holds, and 0 once
    /// the pool's allocator dropped (a pointer that outlives it must not park its record,
    /// which would keep the pool alive through its hook with nobody left to let it go).
    pub(super) park_room: usize,
    /// Per size class, free blocks by address.
    pub(super) free: [Lines<u64>; CLASSES],
    /// Free blocks above `small_max`, oldest first: at most
    /// [`LARGE_SLOTS`](super::LARGE_SLOTS).
    pub(super) large: Lines<Large>,
    /// The last block above the byte bound that this shard's thread freed, with its record:
    /// the next allocation of its size takes it without the arena. Not counted in
    /// `cached_bytes` (it would crowd out every other block); the pool takes it back before
    /// it grows (`PoolShared::reclaim_large`), so it never makes the pool hold more.
    pub(super) oversize: Option<Large>,
    /// Bytes of `parked`, `free` and `large`.
    pub(super) cached_bytes: usize,
    /// Blocks and bytes handed out from or returned to this shard; a block allocated on one
    /// shard and returned to another makes both drift, their sums stay right.
    pub(super) in_use_blocks: i64,
    pub(super) in_use_bytes: i64,
    /// This shard's thread's last allocations and frees (`history.rs`).
    pub(super) history: Ring,
}

impl ShardLists {
    /// Empty lists. They live inside the shard (on its own lines: `Shard`), and their elements
    /// on lines of their own (`Lines`): whichever thread grows a list, the lines its owner
    /// writes on every pair share nothing with another thread's allocations.
    pub(super) fn new() -> ShardLists {
        ShardLists {
            parked: std::array::from_fn(|_| Lines::new()),
            park_room: PARKED_PER_SHARD,
            free: std::array::from_fn(|_| Lines::new()),
            large: Lines::new(),
            oversize: None,
            cached_bytes: 0,
            in_use_blocks: 0,
            in_use_bytes: 0,
            history: Ring::new(),
        }
    }

    /// Counts a block of `size` bytes handed out.
    pub(super) fn lent(&mut self, size: usize) {
        self.in_use_blocks += 1;
        self.in_use_bytes += size as i64;
    }

    /// Counts a block of `size` bytes given back.
    pub(super) fn returned(&mut self, size: usize) {
        self.in_use_blocks -= 1;
        self.in_use_bytes -= size as i64;
    }

    /// Adds the sizes of the blocks this shard caches (per class, large, oversize) to `out`.
    pub(super) fn cached_block_sizes(&self, out: &mut Vec<usize>) {
        for class in 0..CLASSES {
            out.extend(std::iter::repeat_n(class_size(class), self.cached(class)));
        }
        out.extend(self.large.iter().map(|b| b.size));
        out.extend(self.oversize.as_ref().map(|b| b.size));
    }

    /// Adds the blocks this shard caches (per class, parked or not, large, oversize) to `out`
    /// as (address, size).
    pub(super) fn cached_blocks(&self, out: &mut Vec<(u64, usize)>) {
        for class in 0..CLASSES {
            let size = class_size(class);
            out.extend(self.parked[class].iter().map(|p| (p.base(), size)));
            out.extend(self.free[class].iter().map(|&a| (a, size)));
        }
        out.extend(self.large.iter().map(|b| (b.addr, b.size)));
        out.extend(self.oversize.as_ref().map(|b| (b.addr, b.size)));
    }

    /// The largest block this shard caches (0 when none).
    pub(super) fn largest_cached(&self) -> usize {
        let small = (0..CLASSES)
            .rev()
            .find(|&c| self.cached(c) > 0)
            .map_or(0, class_size);
        let large = self.large.iter().map(|b| b.size).max().unwrap_or(0);
        small
            .max(large)
            .max(self.oversize.as_ref().map_or(0, |b| b.size))
    }

    /// Blocks of `class` cached, parked or not.
    pub(super) fn cached(&self, class: usize) -> usize {
        self.parked[class].len() + self.free[class].len()
    }

    /// Gives back the room for a record that `block`, just taken out of this shard, held.
    pub(super) fn give_back_room(&mut self, block: &Large) {
        self.park_room += usize::from(block.record.is_some());
    }

    /// `block`, taken out of this shard, for the arena: the room its record held given back,
    /// the record let go (`Large::into_block`).
    pub(super) fn let_go(&mut self, block: Large) -> (u64, usize) {
        self.give_back_room(&block);
        block.into_block()
    }

    /// Takes every block above `small_max` out, the large blocks and the oversize one, with
    /// their records (the caller lets them go with no shard entered: `Large::into_block`).
    /// Their room is not given back here: the callers take every record out, and
    /// [`take_parked`](Self::take_parked) gives the shard all its room.
    pub(super) fn take_large_blocks(&mut self) -> Vec<Large> {
        let mut large = self.large.take_all();
        large.extend(self.oversize.take());
        large
    }

    /// Takes every parked record out, with its class (the caller lets them go with no shard
    /// entered: [`unparked`]).
    pub(super) fn take_parked(&mut self) -> Vec<(usize, Vec<ParkedPointer>)> {
        self.park_room = PARKED_PER_SHARD;
        super::take_nonempty(&mut self.parked, Lines::take_all)
    }
}

/// A free block above `small_max` in a shard, with its last pointer's record when it was parked
/// with it ([`PoolHook::park`]): the next allocation of its size revives the record, as a
/// small block's.
pub(super) struct Large {
    pub(super) addr: u64,
    pub(super) size: usize,
    pub(super) record: Option<ParkedPointer>,
}

impl Large {
    /// The block, its record (if any) let go to this thread's spares (`ParkedPointer::into_base`:
    /// the hook's clone stays with the spare box, so no reference count drops).
    pub(super) fn into_block(self) -> (u64, usize) {
        if let Some(record) = self.record {
            record.into_base();
        }
        (self.addr, self.size)
    }
}

/// Lets go of the records [`ShardLists::take_parked`] took out (to this thread's spares),
/// yielding their blocks with their sizes. Called with no shard entered.
pub(super) fn unparked(
    taken: Vec<(usize, Vec<ParkedPointer>)>,
) -> impl Iterator<Item = (u64, usize)> {
    taken.into_iter().flat_map(|(class, held)| {
        held.into_iter()
            .map(move |p| (p.into_base().0, class_size(class)))
    })
}

/// Full magazines of free blocks per size class, passed between shards: a shard past its
/// cache limit hands a magazine here, and a shard whose list is empty takes one before it
/// carves new blocks from the arena. Moving a magazine is one `Vec` move under this lock, so
/// a thread that frees what another allocates (a producer and a consumer) feeds it without
/// either touching the arena's ordered maps.
#[derive(Default)]
pub(super) struct Depot {
    /// Per class, the magazines held.
    pub(super) magazines: Vec<Vec<Vec<u64>>>,
    pub(super) cached_bytes: usize,
    /// The generation the magazines belong to; `reset` bumps it while holding this lock.
    pub(super) generation: u64,
}

impl Depot {
    pub(super) fn new() -> Depot {
        Depot {
            magazines: (0..CLASSES).map(|_| Vec::new()).collect(),
            ..Depot::default()
        }
    }
}

/// The pool's release hook, cloned into every pointer from the shards and the arena (the
/// clone stays with the pointer's record when the record is recycled, so that in the steady
/// state it costs no atomic operation: `MemoryPointer::with_stashed_hook`). A block goes back
/// to the shard of the thread that drops its last pointer (as in tcmalloc), not to the shard
/// it came from: a thread that frees what another allocated then takes no lock but its own,
/// where returning blocks home made two such threads contend on every pair. A small block's
/// record is parked with
/// it there ([`PoolHook::park`]) while the shard has room.
pub(super) struct ShardHook {
    pub(super) pool: Arc<PoolShared>,
}

impl ReleaseHook for ShardHook {
    /// A release without its allocation's history stamp (not reached from a pool pointer's
    /// drop, which gives it: [`PoolHook::release_stamped`]): the free is stamped with the
    /// time-stamp counter, later than any allocation before it.
    fn release(&self, base: DevicePtr, size: usize, tag: u64) {
        let stamped = (tag, crate::clock::stamp());
        self.pool.release(thread_shard(), base.0, size, stamped);
    }

    fn is_live(&self, tag: u64) -> bool {
        self.pool.generation.load(Ordering::Acquire) == tag
    }
}

// SAFETY: `PoolShared::park` keeps the record in a shard's list or returns it; it drops none.
#[allow(unsafe_code)]
unsafe impl PoolHook for ShardHook {
    #[inline]
    fn park(&self, record: ParkedPointer, size: usize, tag: u64) -> Option<ParkedPointer> {
        self.pool.park(thread_shard(), record, size, tag)
    }

    fn release_stamped(
        &self,
        base: DevicePtr,
        size: usize,
        stamped: (u64, u64),
        streams: Option<StreamUse>,
    ) {
        // The shards' pointers have no streams (`memalloc`).
        debug_assert!(streams.is_none(), "a shard's block has no streams");
        self.pool.release(thread_shard(), base.0, size, stamped);
    }
}
