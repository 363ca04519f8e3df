//! The pool's stream-ordered half: one arena shared by every stream, and what each stream
//! must wait for before it uses a block another stream freed.
//!
//! - Memory allocated on stream S comes from the stream arena, whole chunks split and merged
//!   as the shared arena's blocks are (`arena.rs`), whichever stream freed them.
//! - A block freed on S and used by no other stream goes back to the stream arena at once,
//!   merged with its free neighbours, and its range is recorded with S (`freed.rs`): S may
//!   take it (or part of it) at once, in S's order, with no driver call.
//! - A stream T that takes a block holding a range S freed first asks whether S's work is done
//!   (`cuStreamQuery`: then every range S freed is every stream's), else makes its own work
//!   wait on the GPU for the work queued on S so far (an event recorded on S,
//!   `cuStreamWaitEvent` on T), so that nothing T queues on the block runs before S's last use
//!   of it; T remembers up to which of S's frees it is ordered. The host never waits.
//! - A block that other streams used (recorded with `record_stream`, or freed on a stream
//!   other than the one it was allocated on) waits behind a fence, events recorded at the free
//!   on those streams, and goes back to the stream arena once they completed, every stream's.
//! - A captured stream neither waits nor is waited for, queried or recorded on (its work is
//!   not the GPU's yet): a block that would need it is set aside and another taken, else the
//!   pool grows (refused on a captured stream).
//! - When no block is large enough, the stream arena takes a wholly free chunk of the shared
//!   arena, no larger than the pool would grow by for the request (any size for a request
//!   above the chunk size), else a block of its free space lent as a chunk; else the wholly
//!   free chunks it does not keep go back to the driver (`PoolShared::kept_through_growth`),
//!   once the streams that freed blocks in them have done their work (the pool waits for it:
//!   a `cuMemFree` waits for the device in any case), and the pool grows by a chunk.
//! - `trim` frees the wholly free chunks whose streams have no work pending; out of memory,
//!   the pool waits for every stream's work first.
//! - A stream with a range recorded, or ordered after one that has, is kept alive (an
//!   emm-made stream): a destroyed stream's handle may name a new stream, which neither its
//!   ranges nor its orders are about.
//!
//! Lock order: the stream lists, then the shared arena.

use driver_sys::{DevicePtr, StreamHandle};

use super::arena::{Arenas, Chunk, cut_out, place};
use super::freed::FreedRanges;
use super::history::Ring;
use super::{GROW_GRANULARITY, POOL_ALIGNMENT, PoolShared};
use crate::contract::snapshot::{BlockState, HeldBlock, HeldSegment, SegmentKind};
use crate::error::EmmError;
use crate::host::HostLayer;
use crate::host::fences::Fence;
use crate::memory::host::HostOwner;
use crate::memory::pointer::{ParkedPointer, PoolHook, ReleaseHook, StreamUse};
use crate::sync::{AtomicBool, Mutex, MutexGuard, Ordering, lock};

/// The block size a stream-ordered request of `bytes` gets: a multiple of 256 bytes (the
/// stream arena splits blocks to measure, so no size class rounds it further).
pub(super) fn stream_block_size(bytes: usize) -> usize {
    bytes.div_ceil(POOL_ALIGNMENT) * POOL_ALIGNMENT
}

/// The pool's stream-ordered memory.
#[derive(Default)]
pub(super) struct StreamLists {
    /// The chunks every stream's blocks come from, and their free space (made at the first
    /// stream-ordered allocation).
    arena: Option<Arenas>,
    /// What a stream waits for before it uses a block another stream freed.
    freed: FreedRanges,
    /// The streams `freed` knows, each with what keeps it alive (an emm-made stream's owner;
    /// none for another library's stream, which its caller keeps alive).
    owners: Vec<(StreamHandle, Option<HostOwner>)>,
    /// The stream each chunk of the arena was added for (grown or taken from the shared arena
    /// at its request), by base: before that stream grows, the pool waits for its work to
    /// give such a chunk back; a chunk another stream added goes back only once every stream
    /// that freed into it is idle.
    added_for: std::collections::BTreeMap<u64, (u64, StreamHandle)>,
    /// Blocks that go back to the arena once their fence is done: (address, size, fence).
    waiting: Vec<(u64, usize, Fence)>,
    /// Blocks handed out on streams and not yet freed.
    pub(super) in_use_blocks: i64,
    /// Their bytes.
    pub(super) in_use_bytes: i64,
    /// The last allocations and frees on streams (`history.rs`), in the order this lock saw
    /// them.
    pub(super) history: Ring,
    /// Records of pointers whose blocks went back to the arena at once
    /// ([`PoolShared::park_on_stream`]), for the next stream-ordered allocation: the block
    /// comes from the arena as it would, and its pointer is this record revived. At most
    /// [`SPARES`]; they hold no memory.
    spares: Vec<ParkedPointer>,
    /// Set by the allocator's drop: no record is kept here any more (a kept record holds a
    /// clone of the pool's hook, and so of the pool).
    closed: bool,
}

/// The most spare records the stream lists keep.
const SPARES: usize = 8;

/// Blocks a take sets aside, at most, looking for one it may use with no call its stream's
/// capture forbids.
const SET_ASIDE: usize = 8;

impl StreamLists {
    /// Counts a block of `size` bytes taken from the arena as in use.
    #[inline]
    fn took(&mut self, size: usize) {
        self.in_use_blocks += 1;
        self.in_use_bytes += size as i64;
    }

    /// Counts a block of `size` bytes given back to the arena as no longer in use.
    #[inline]
    fn gave(&mut self, size: usize) {
        self.in_use_blocks -= 1;
        self.in_use_bytes -= size as i64;
    }

    /// The arena, made of the empty arenas `empty` if there is none yet.
    fn arena_or_new(&mut self, empty: impl FnOnce() -> Arenas) -> &mut Arenas {
        self.arena.get_or_insert_with(empty)
    }

    /// Gives `size` bytes at `addr`, freed on `stream` (which `owner` keeps alive) and used by
    /// no other stream, back to the arena at once, their range recorded with `stream`.
    fn give_back(
        &mut self,
        stream: StreamHandle,
        owner: Option<&HostOwner>,
        addr: u64,
        size: usize,
    ) {
        if let Some(arena) = self.arena.as_mut() {
            arena.give(addr, size);
        }
        if self.freed.freed(stream, addr, size) {
            self.owners.push((stream, owner.cloned()));
        }
    }

    /// Records that `stream`'s work from now on waits for the work queued so far on each of
    /// `after`, where `stream` is kept alive meanwhile (one the lists know: an order about a
    /// stream since destroyed would be about whichever stream gets its handle next).
    fn ordered(&mut self, stream: StreamHandle, after: Vec<StreamHandle>) {
        if self.freed.knows(stream) {
            for other in after {
                self.freed.ordered(stream, other);
            }
        }
    }

    /// The stream the arena's chunk at `base` was added for (see `added_for`).
    fn added_for(&self, base: u64) -> Option<StreamHandle> {
        let (_, &(end, stream)) = self.added_for.range(..=base).next_back()?;
        (base < end).then_some(stream)
    }

    /// Forgets which stream the chunks `chunks`, which leave the arena, were added for (what
    /// was added whole inside one of them: `vmm-pool` gives back a growth's pieces one by one,
    /// and the rest stay).
    fn left(&mut self, chunks: &[Chunk]) {
        for c in chunks {
            let end = c.base + c.size as u64;
            let inside: Vec<u64> = (self.added_for.range(c.base..end))
                .filter(|(_, (e, _))| *e <= end)
                .map(|(&b, _)| b)
                .collect();
            for b in inside {
                self.added_for.remove(&b);
            }
        }
    }

    /// Lets go of the owners of `gone`, streams `freed` no longer knows, into `out` (dropped by
    /// the caller with no lock held: a stream's destruction may run anything).
    fn forget_owners(&mut self, gone: Vec<StreamHandle>, out: &mut Vec<HostOwner>) {
        for stream in gone {
            if let Some(k) = self.owners.iter().position(|(s, _)| *s == stream) {
                out.extend(self.owners.swap_remove(k).1);
            }
        }
    }

    /// Bytes of the chunks the arena holds.
    pub(super) fn held_bytes(&self) -> usize {
        self.arena.as_ref().map_or(0, Arenas::held)
    }

    /// Bytes held and not in use: free in the arena, or waiting for a fence.
    pub(super) fn cached_bytes(&self) -> usize {
        self.held_bytes()
            .saturating_sub(self.in_use_bytes.max(0) as usize)
    }

    /// Adds the sizes of the arena's free blocks to `out`.
    pub(super) fn free_block_sizes(&self, out: &mut Vec<usize>) {
        if let Some(arena) = &self.arena {
            arena.free_block_sizes(out);
        }
    }

    /// Adds the arena's chunks to `out` as segments of `kind`, with their free blocks and the
    /// blocks waiting for their fences.
    pub(super) fn held_segments(&self, kind: SegmentKind, out: &mut Vec<HeldSegment>) {
        let Some(arena) = &self.arena else {
            return;
        };
        let mut mine = Vec::new();
        arena.held_segments(kind, None, &mut mine);
        mine.sort_by_key(|s| s.address);
        cut_out(&mut mine, arena.lent_out());
        place(
            &mut mine,
            self.waiting.iter().map(|&(address, bytes, _)| HeldBlock {
                address,
                bytes,
                state: BlockState::PendingFree,
            }),
        );
        out.append(&mut mine);
    }

    /// The arena's largest free block.
    pub(super) fn largest_free(&self) -> usize {
        self.arena.as_ref().map_or(0, Arenas::largest_free)
    }

    /// Spare records kept.
    #[cfg(all(test, not(emm_loom)))]
    pub(super) fn spare_records(&self) -> usize {
        self.spares.len()
    }

    /// Chunks the arena holds.
    pub(super) fn chunks(&self) -> usize {
        self.arena.as_ref().map_or(0, Arenas::chunks)
    }
}

/// The pool's stream-ordered state: the stream lists, on their own cache lines, locked before
/// the shared arena.
#[repr(align(128))]
pub(super) struct StreamCache {
    lists: Mutex<StreamLists>,
    /// Set while the lists hold a chunk (written under their lock): a growth or a trim visits
    /// them only then.
    occupied: AtomicBool,
}

impl StreamCache {
    pub(super) fn new() -> StreamCache {
        StreamCache {
            lists: Mutex::new(StreamLists::default()),
            occupied: AtomicBool::new(false),
        }
    }

    /// The stream lists.
    pub(super) fn lists(&self) -> &Mutex<StreamLists> {
        &self.lists
    }

    /// Records, under the lists' lock, whether they hold a chunk.
    fn mark(&self, lists: &StreamLists) {
        let holds = lists.arena.as_ref().is_some_and(|a| !a.is_empty());
        self.occupied.store(holds, Ordering::Release);
    }

    /// Whether the lists held a chunk when last marked.
    pub(super) fn occupied(&self) -> bool {
        self.occupied.load(Ordering::Acquire)
    }
}

/// The release hook of stream-ordered pool pointers (one for the pool, apart from the
/// shards' hook), on its own cache lines.
#[repr(align(128))]
pub(super) struct StreamHook {
    pub(super) pool: std::sync::Arc<PoolShared>,
}

impl ReleaseHook for StreamHook {
    fn release(&self, base: DevicePtr, size: usize, tag: u64) {
        // Only reached for a pointer made without streams, which the pool does not make.
        self.release_on_streams(base, size, tag, StreamUse::on(StreamHandle::NULL));
    }

    /// A release without its allocation's history stamp (not reached from a pool pointer's
    /// drop, which gives it: [`PoolHook::release_stamped`]): the free is stamped with the
    /// time-stamp counter, later than any allocation before it.
    fn release_on_streams(&self, base: DevicePtr, size: usize, tag: u64, streams: StreamUse) {
        let stamped = (tag, crate::clock::stamp());
        self.pool.release_on_streams(base.0, size, stamped, streams);
    }

    fn is_live(&self, tag: u64) -> bool {
        self.pool.generation.load(Ordering::Acquire) == tag
    }
}

// SAFETY: `PoolShared::park_on_stream` keeps the record in the stream lists or returns it; it
// drops none.
#[allow(unsafe_code)]
unsafe impl PoolHook for StreamHook {
    #[inline]
    fn park(&self, record: ParkedPointer, size: usize, tag: u64) -> Option<ParkedPointer> {
        self.pool.park_on_stream(record, size, tag)
    }

    fn release_stamped(
        &self,
        base: DevicePtr,
        size: usize,
        stamped: (u64, u64),
        streams: Option<StreamUse>,
    ) {
        // Only a pointer made without streams has none, which the pool does not make.
        let streams = streams.unwrap_or_else(|| StreamUse::on(StreamHandle::NULL));
        self.pool.release_on_streams(base.0, size, stamped, streams);
    }
}

impl PoolShared {
    /// A block of `size` bytes (a [`stream_block_size`], for a request of `bytes`) from the
    /// stream arena that `stream` may use, once ordered after the streams that freed it where
    /// their work still runs, counted as in use, with its generation, its history stamp and a
    /// spare record.
    pub(super) fn take_on_stream(
        &self,
        stream: StreamHandle,
        size: usize,
        bytes: usize,
    ) -> Option<(u64, u64, u64, Option<ParkedPointer>)> {
        let mut lists = lock(self.streams.lists());
        let addr = self.take_usable(&mut lists, stream, size, true)?;
        lists.took(size);
        let stamp = lists.history.alloc_on(addr, bytes, stream.raw());
        let spare = lists.spares.pop();
        drop(lists);
        Some((addr, self.generation.load(Ordering::Acquire), stamp, spare))
    }

    /// A block of `size` bytes of the arena that `stream` may use ([`clear_to_use`]
    /// (Self::clear_to_use)), sparing large wholly free chunks with `sparing`
    /// ([`Arenas::take_sparing`]). A block `stream` may not use (it would need a call a
    /// capture forbids, or the driver refused one) is set aside for another, at most
    /// [`SET_ASIDE`] times, and goes back afterwards. `None` where none serves.
    #[inline]
    fn take_usable(
        &self,
        lists: &mut StreamLists,
        stream: StreamHandle,
        size: usize,
        sparing: bool,
    ) -> Option<u64> {
        let first = self.take_block(lists, size, sparing)?;
        // The commonest case: the block `stream` freed last, taken back whole.
        if lists.freed.take_own_recent(stream, first, size) {
            return Some(first);
        }
        self.take_usable_from(lists, stream, size, sparing, first)
    }

    /// A block of `size` bytes of the arena, sparing large wholly free chunks with `sparing`.
    #[inline]
    fn take_block(&self, lists: &mut StreamLists, size: usize, sparing: bool) -> Option<u64> {
        let arena = lists.arena.as_mut()?;
        if sparing {
            arena.take_sparing(size, || self.growth(size))
        } else {
            arena.take(size)
        }
    }

    /// [`take_usable`](Self::take_usable) from `first`, a block just taken from the arena.
    #[inline(never)]
    fn take_usable_from(
        &self,
        lists: &mut StreamLists,
        stream: StreamHandle,
        size: usize,
        sparing: bool,
        first: u64,
    ) -> Option<u64> {
        let mut aside = Vec::new();
        let mut addr = first;
        let found = loop {
            if self.clear_to_use(lists, stream, addr, size) {
                break Some(addr);
            }
            aside.push(addr);
            if aside.len() >= SET_ASIDE {
                break None;
            }
            match self.take_block(lists, size, sparing) {
                Some(next) => addr = next,
                None => break None,
            }
        };
        if let Some(arena) = lists.arena.as_mut() {
            for addr in aside {
                arena.give(addr, size);
            }
        }
        found
    }

    /// Readies `size` bytes at `addr`, just taken from the arena, for `stream`: the ranges
    /// of the streams that freed into it and whose work is done are forgotten (every stream's
    /// now), and `stream`'s work from now on waits on the GPU for the others' work queued so
    /// far. `false`, with nothing recorded, where that takes a call a capture forbids
    /// (`stream` or another is being captured) or the driver refuses one: the block is not
    /// `stream`'s to use.
    fn clear_to_use(
        &self,
        lists: &mut StreamLists,
        stream: StreamHandle,
        addr: u64,
        size: usize,
    ) -> bool {
        if lists.freed.take_own_recent(stream, addr, size) {
            return true;
        }
        let others = lists.freed.waits_for(stream, addr, size);
        if !others.is_empty() && !self.order_after_frees(lists, stream, others) {
            return false;
        }
        lists.freed.forget_within(addr, size);
        true
    }

    /// Orders `stream` after the frees of `others` (see [`clear_to_use`](Self::clear_to_use));
    /// `false` where it cannot.
    #[inline(never)]
    fn order_after_frees(
        &self,
        lists: &mut StreamLists,
        stream: StreamHandle,
        others: Vec<StreamHandle>,
    ) -> bool {
        let Some(_live) = self.cx.liveness.enter() else {
            return false;
        };
        // Queries and events are slow-path calls: a capture elsewhere on this thread must not
        // refuse them (a captured stream itself is never named in one).
        let _relaxed = self.cx.relax_capture();
        let mut busy = Vec::new();
        for other in others {
            match self.freeing_stream_idle(lists, other, false) {
                Ok(Some(true)) => {}
                Ok(Some(false)) => busy.push(other),
                Ok(None) => return false,
                Err(e) => {
                    self.queue.record_error(EmmError::driver(
                        "asking whether the stream that freed a block is done",
                        self.cx.device,
                        e,
                    ));
                    return false;
                }
            }
        }
        // A captured stream waits for nothing outside its capture.
        if busy.is_empty() {
            return true;
        }
        if self.cx.stream_is_captured(stream).unwrap_or(true) {
            return false;
        }
        if let Err(e) = self.order_on_gpu(&busy, stream) {
            tracing::warn!(device = %self.cx.device, error = %e, "ordering a stream after another's work failed; the block another stream freed is not used");
            self.queue.record_error(EmmError::driver(
                "ordering a stream after the streams that freed its block",
                self.cx.device,
                e,
            ));
            return false;
        }
        tracing::trace!(device = %self.cx.device, stream = stream.raw(), streams = busy.len(), "a stream waits on the GPU for the streams that freed its block");
        lists.ordered(stream, busy);
        true
    }

    /// [`PoolHook::park`] of a stream-ordered pointer's record: where its block was freed on
    /// the stream it was allocated on and no other stream used it, the block goes back to the
    /// arena at once (as [`release_on_streams`](Self::release_on_streams) would put it) and
    /// the record is kept as a spare, so that the next allocation makes its pointer without
    /// building one. Otherwise (or when the lists have their spares, or the pool was reset
    /// since) hands the record back, to be released as usual.
    pub(super) fn park_on_stream(
        &self,
        mut record: ParkedPointer,
        bytes: usize,
        tag: u64,
    ) -> Option<ParkedPointer> {
        let Some(stream) = record.single_stream() else {
            return Some(record);
        };
        let size = stream_block_size(bytes);
        let streams = {
            let mut lists = lock(self.streams.lists());
            // A block with no arena was not handed out here: its release reports it.
            if lists.closed
                || lists.arena.is_none()
                || lists.spares.len() >= SPARES
                || self.generation.load(Ordering::Acquire) != tag
            {
                return Some(record);
            }
            let Some(streams) = record.take_stream_use() else {
                return Some(record);
            };
            let addr = record.base();
            lists.give_back(stream, streams.owner_of(stream), addr, size);
            lists.gave(size);
            lists.history.free(addr, record.stamp());
            lists.spares.push(record);
            streams
        };
        // What kept the streams alive goes with no lock held (its drop may run anything, a
        // stream's destruction included).
        drop(streams);
        None
    }

    /// Records in the stream history an allocation of `bytes` at `addr` on `stream` that a
    /// growth served, and returns its stamp (the path that finds a block records its own
    /// under the lock it holds).
    pub(super) fn note_grown(&self, stream: StreamHandle, addr: u64, bytes: usize) -> u64 {
        lock(self.streams.lists())
            .history
            .alloc_fresh(addr, bytes, stream.raw())
    }

    /// Gives the stream arena a chunk that holds a block of `size` bytes and takes the block
    /// from it for `stream`: a wholly free chunk of the shared arena, or its free space lent,
    /// else a new one from the driver (through the host layer's out-of-memory rule).
    pub(super) fn grow_stream(
        &self,
        host: &HostLayer,
        stream: StreamHandle,
        size: usize,
    ) -> Result<(u64, u64), EmmError> {
        // Growth queries streams and may allocate: refused on a captured stream before any
        // call the capture would refuse, and made in relaxed mode so that a capture elsewhere
        // on this thread does not refuse them.
        if let Err(refused) = self
            .cx
            .refuse_captured_allocation(self.manager_name(), stream)
        {
            // A captured stream does not grow; a large free chunk, spared by the first try,
            // still serves it.
            return self.take_sparing_nothing(stream, size).ok_or(refused);
        }
        let _relaxed = self.cx.relax_capture();
        if let Some(found) = self.take_after_adopting(stream, size, None) {
            return Ok(found);
        }
        // The wholly free chunks whose streams have no work pending are every allocation's:
        // the shared arena's, from which the stream arena adopts what fits best.
        if self.release_idle_stream_chunks(false)? > 0
            && let Some(found) = self.take_after_adopting(stream, size, None)
        {
            return Ok(found);
        }
        let grown = host.attempt_allocation(
            "memalloc_on",
            crate::host::AllocationKind::Device,
            size,
            || {
                // Another thread may have freed a block meanwhile.
                if let Some(found) = self.take_after_adopting(stream, size, None) {
                    return Ok(found);
                }
                // About to grow: the blocks the shards cache go back to the shared arena, which
                // may free a chunk of it whole, for the streams or the driver (a pool that
                // never served memalloc has nothing there).
                if !lock(&self.arena).is_empty() {
                    self.drain_shards(false);
                    if let Some(found) = self.take_after_adopting(stream, size, None) {
                        return Ok(found);
                    }
                }
                if let Some(found) = self.grow_stream_in_place(stream, size) {
                    return Ok(found);
                }
                if tracing::enabled!(tracing::Level::DEBUG) {
                    self.trace_stream_growth(stream, size);
                }
                self.shed_free_chunks(Some(stream), size);
                let chunks = self.new_chunk(size)?;
                Ok(self
                    .take_after_adopting(stream, size, chunks)
                    .expect("a new chunk holds the request"))
            },
        );
        self.release_spares();
        grown
    }

    /// Says, at debug level, that the pool grows for `size` bytes on `stream`, with the free
    /// space the stream arena holds meanwhile: free space split into blocks too small for the
    /// request is what a growth adds to.
    fn trace_stream_growth(&self, stream: StreamHandle, size: usize) {
        let mut free = Vec::new();
        lock(self.streams.lists()).free_block_sizes(&mut free);
        tracing::debug!(
            device = %self.cx.device,
            stream = stream.raw(),
            requested = size,
            held = self.totals.held.load(Ordering::Relaxed),
            streams_free = free.iter().sum::<usize>(),
            free_blocks = free.len(),
            largest_free = free.iter().max().copied().unwrap_or(0),
            "pool grows for a stream"
        );
    }

    /// A block of `size` bytes of the arena that `stream` may use, sparing nothing, counted as
    /// in use.
    fn take_sparing_nothing(&self, stream: StreamHandle, size: usize) -> Option<(u64, u64)> {
        let mut lists = lock(self.streams.lists());
        let addr = self.take_usable(&mut lists, stream, size, false)?;
        lists.took(size);
        drop(lists);
        Some((addr, self.generation.load(Ordering::Acquire)))
    }

    /// Before the pool grows for a request of `size` bytes that no free block holds: the
    /// wholly free chunks (none holds the request, or it would have been taken) go back to the
    /// driver, except those the pool may keep through the growth
    /// ([`kept_through_growth`](PoolShared::kept_through_growth)): the largest first, while
    /// the pool, grown, holds at most an eighth more than the most stream-ordered memory in
    /// use at a growth. A program whose requests vary from step to step finds them again at
    /// its next step instead of the driver's `cuMemFree` and `cuMemAlloc` at every step, and
    /// what the pool holds beyond what is in use stays bounded all the same. `vmm-pool` keeps
    /// nothing so: its free pieces, up to what the growth maps, are mapped again there
    /// ([`Arena::shed_free_chunks`](super::arena::Arena::shed_free_chunks)). The shared
    /// arena's go at once; the stream arena's, where a stream grows, once the streams that
    /// freed blocks in them have done their work: the pool waits for it here
    /// ([`give_back_after`](Self::give_back_after)), so that it never holds the chunks it
    /// gives back and the one it grows by at once.
    pub(super) fn shed_free_chunks(&self, growing: Option<StreamHandle>, size: usize) {
        let Some(_live) = self.cx.liveness.enter() else {
            return;
        };
        // `vmm-pool` moves at most what the growth maps (`Arena::shed_free_chunks`).
        let most = self.growth(size);
        let mut freed = lock(&self.arena).shed_free_chunks(most);
        let most = most.saturating_sub(freed.iter().map(|c| c.size).sum());
        let mut shed = if growing.is_some() {
            let mut lists = lock(self.streams.lists());
            if let Err(e) = self.settle_fences(&mut lists, false) {
                self.queue.record_error(e);
            }
            let shed = (lists.arena.as_mut())
                .map(|arena| arena.shed_free_chunks(most))
                .unwrap_or_default();
            self.streams.mark(&lists);
            shed
        } else {
            Vec::new()
        };
        if self.vmm.is_none() {
            self.keep_some(size, &mut freed, &mut shed);
        }
        self.free_chunks(freed, "before growing");
        if let Some(stream) = growing {
            self.give_back_after(stream, shed);
        }
    }

    /// `pool`: of the wholly free chunks about to go back before a growth for `size` bytes,
    /// the shared arena's `freed` and the stream arena's `shed`, puts back those the pool may
    /// keep ([`kept_through_growth`](PoolShared::kept_through_growth)), the largest first; a
    /// chunk the shared arena lent goes back to it in any case, at no driver call.
    fn keep_some(&self, size: usize, freed: &mut Vec<Chunk>, shed: &mut Vec<Chunk>) {
        let free: usize = (freed.iter().chain(shed.iter()))
            .filter(|c| !c.lent)
            .map(|c| c.size)
            .sum();
        // Every growth raises the mark of what is in use on streams, free chunks or not; with
        // neither free chunks nor stream-ordered memory, there is nothing to keep or count.
        if free == 0 && !self.streams.occupied() {
            return;
        }
        let mut budget = self.kept_through_growth(size, free);
        if budget == 0 {
            return;
        }
        let mut all: Vec<(Chunk, bool)> = (freed.drain(..).map(|c| (c, false)))
            .chain(shed.drain(..).map(|c| (c, true)))
            .collect();
        // The largest first: a chunk made for a large request serves most of the next step's.
        all.sort_unstable_by_key(|(c, _)| std::cmp::Reverse(c.size));
        let (mut kept_freed, mut kept_shed) = (Vec::new(), Vec::new());
        for (chunk, streams) in all {
            let keep = !chunk.lent && chunk.size <= budget;
            if keep {
                budget -= chunk.size;
            }
            match (keep, streams) {
                (true, false) => kept_freed.push(chunk),
                (true, true) => kept_shed.push(chunk),
                (false, false) => freed.push(chunk),
                (false, true) => shed.push(chunk),
            }
        }
        if !kept_freed.is_empty() {
            let mut arena = lock(&self.arena);
            for chunk in kept_freed {
                arena.add_chunk(chunk);
            }
        }
        self.keep_on_streams(kept_shed);
    }

    /// Gives back `shed`, wholly free chunks taken out of the stream arena before `growing`
    /// grows. A chunk into which another stream with work pending freed a block stays (that
    /// work may wait on the host itself: the pool never waits for another stream's work);
    /// one into which only idle streams and `growing` freed goes once `growing`'s work is
    /// done: the pool waits for it (an event recorded there now), then frees the driver's
    /// chunks and returns the shared arena's. A `cuMemFree` waits for the device's work in any
    /// case, but `cuMemUnmap` does not: the wait is what orders `vmm-pool`'s unmap after the
    /// stream's work, and under `pool` it orders the free by rule rather than by the driver's
    /// habit and frees the chunks before the pool grows instead of at a later growth. Where the
    /// wait fails, the chunks go back to the arena, which may still use them. The caller holds
    /// the context's liveness and no lock of the pool's.
    fn give_back_after(&self, growing: StreamHandle, shed: Vec<Chunk>) {
        if shed.is_empty() {
            return;
        }
        let (going, kept, wait) = {
            let mut lists = lock(self.streams.lists());
            let (mut going, mut kept, mut wait) = (Vec::new(), Vec::new(), false);
            for chunk in shed {
                match self.only_idle_or(&mut lists, &chunk, growing) {
                    Some(own) => {
                        wait |= own;
                        going.push(chunk);
                    }
                    None => kept.push(chunk),
                }
            }
            (going, kept, wait)
        };
        self.keep_on_streams(kept);
        if going.is_empty() {
            return;
        }
        // A growing stream with nothing pending needs no wait.
        let wait = wait
            && !matches!(
                self.cx.driver.stream_query(self.cx.context, growing),
                Ok(true)
            );
        if wait && let Err(e) = self.wait_on_host(growing) {
            tracing::warn!(device = %self.cx.device, error = %e, "waiting for a growing stream's work failed; the free chunks it freed into stay with the pool");
            self.keep_on_streams(going);
            self.queue.record_error(EmmError::driver(
                "waiting for a stream's work before giving free chunks back",
                self.cx.device,
                e,
            ));
            return;
        }
        {
            let mut lists = lock(self.streams.lists());
            for chunk in &going {
                lists.freed.forget_within(chunk.base, chunk.size);
            }
            lists.left(&going);
        }
        let (lent, freed): (Vec<Chunk>, Vec<Chunk>) = going.into_iter().partition(|c| c.lent);
        if !lent.is_empty() {
            let mut arena = lock(&self.arena);
            for chunk in lent {
                arena.restore(chunk);
            }
        }
        self.free_chunks(freed, "before a stream grows");
    }

    /// Whether `chunk` may go back before `growing` grows: `Some(true)` where `growing` freed a
    /// block in it (the pool waits for its work first), `Some(false)` where only streams with
    /// no work pending did (forgotten here), `None` where another stream is being captured,
    /// has work pending or cannot be asked.
    fn only_idle_or(
        &self,
        lists: &mut StreamLists,
        chunk: &Chunk,
        growing: StreamHandle,
    ) -> Option<bool> {
        let mut own = false;
        // `vmm-pool` moves free pieces to the growing stream's tail whoever added them, as it
        // moved another stream's wholly free pieces to the growing one behind a wait on the
        // GPU: the growing stream's work is waited for. A chunk added for no stream the lists
        // remember is the growing stream's where only it freed into it.
        let streams = lists.freed.streams_within(chunk.base, chunk.size);
        let added_for = if self.vmm.is_some() {
            Some(growing)
        } else {
            lists
                .added_for(chunk.base)
                .or_else(|| (streams == [growing]).then_some(growing))
        };
        let mut busy = Vec::new();
        for s in streams {
            if s == growing && added_for == Some(growing) {
                own = true;
                continue;
            }
            let idle = self.freeing_stream_idle(lists, s, false).map_err(|e| {
                self.queue.record_error(EmmError::driver(
                    "asking whether a stream that freed into a chunk is done",
                    self.cx.device,
                    e,
                ))
            });
            if !idle.ok()?? {
                if self.vmm.is_none() || self.cx.stream_is_captured(growing).unwrap_or(true) {
                    return None;
                }
                busy.push(s);
            }
        }
        if !busy.is_empty() {
            // `vmm-pool`: the growing stream's work waits on the GPU for theirs, and the pool
            // for the growing stream's.
            if let Err(e) = self.order_on_gpu(&busy, growing) {
                self.queue.record_error(EmmError::driver(
                    "ordering a growing stream after the streams that freed its pieces",
                    self.cx.device,
                    e,
                ));
                return None;
            }
            lists.ordered(growing, busy);
            own = true;
        }
        Some(own)
    }

    /// Puts wholly free chunks taken out of the stream arena back there.
    fn keep_on_streams(&self, chunks: Vec<Chunk>) {
        if chunks.is_empty() {
            return;
        }
        let mut lists = lock(self.streams.lists());
        let arena = lists.arena_or_new(|| self.new_arenas());
        for chunk in chunks {
            arena.add_chunk(chunk);
        }
        self.streams.mark(&lists);
    }

    /// `vmm-pool`: grows the largest free block of the stream arena that ends where mapped
    /// memory does, as [`grow_in_place`](PoolShared::grow_in_place) does the shared arena's.
    /// Free pieces, up to what the growth maps, move to it: the stream arena's once the work
    /// of the streams that freed into them is done ([`give_back_after`](Self::give_back_after)),
    /// then the shared arena's. `None` where no block can grow so, or the context is gone.
    fn grow_stream_in_place(&self, stream: StreamHandle, size: usize) -> Option<(u64, u64)> {
        self.vmm.as_ref()?;
        let _live = self.cx.liveness.enter()?;
        let (tail, free, shed) = {
            let mut lists = lock(self.streams.lists());
            let arena = lists.arena.as_mut()?;
            let (end, free) = arena.tail(size)?;
            let most = self.growth_after(free, size);
            // Nothing moves for a growth that cannot map there.
            if !self.can_map_at(end, most) {
                return None;
            }
            let shed = arena.shed_free_chunks_outside(size, (end - free as u64, end), most);
            (end, free, shed)
        };
        // The shared arena's free pieces move too, up to what the growth still lacks (no run
        // of them held the request, or the stream arena would have adopted it).
        let moved: usize = shed.iter().map(|c| c.size).sum();
        let most = self.growth_after(free, size).saturating_sub(moved);
        let shared = lock(&self.arena).shed_free_pieces(most);
        self.free_chunks(shared, "before a stream grows in place");
        self.give_back_after(stream, shed);
        let chunks = self.map_after(tail, free, size)?;
        self.take_after_adopting(stream, size, chunks)
    }

    /// Frees `chunks` through the deferred-deallocation queue, at once (inside
    /// `defer_cleanup`, once the guard is gone). A failed free stays for the next flush to
    /// return.
    pub(super) fn free_chunks(&self, chunks: Vec<Chunk>, why: &'static str) {
        if chunks.is_empty() {
            return;
        }
        let bytes = chunks.iter().map(|c| c.size).sum();
        self.totals.released(bytes, true);
        tracing::debug!(device = %self.cx.device, chunks = chunks.len(), bytes, why, "pool gave chunks back");
        // Every caller is about to grow: `vmm-pool` keeps the pieces for the growth to map.
        self.release_or_spare(chunks, false, true);
        if let Err(e) = self.queue.flush() {
            self.queue.record_error(e);
        }
    }

    /// Takes a block of `size` bytes for `stream` from the stream arena, after adding `chunks`
    /// (new ones from the driver) or, with none that serves, a chunk the shared arena gives up
    /// for it ([`adopt`](Self::adopt)). `None` when it has none.
    fn take_after_adopting(
        &self,
        stream: StreamHandle,
        size: usize,
        chunks: impl IntoIterator<Item = Chunk>,
    ) -> Option<(u64, u64)> {
        let mut lists = lock(self.streams.lists());
        let generation = self.generation.load(Ordering::Acquire);
        let arena = lists.arena_or_new(|| self.new_arenas());
        let mut added = Vec::new();
        // New chunks join the arena even where another thread's free made room since the miss.
        for chunk in chunks {
            added.push((chunk.base, chunk.base + chunk.size as u64));
            arena.add_chunk(chunk);
        }
        for (base, end) in added {
            lists.added_for.insert(base, (end, stream));
        }
        self.streams.mark(&lists);
        // A large wholly free chunk is the last resort for a small request
        // ([`Arenas::take_sparing`]): a chunk of the shared arena's serves it first.
        let addr = match self.take_usable(&mut lists, stream, size, true) {
            Some(addr) => addr,
            None => {
                if let Some(chunk) = self.adopt(size) {
                    let end = chunk.base + chunk.size as u64;
                    lists.added_for.insert(chunk.base, (end, stream));
                    lists.arena_or_new(|| self.new_arenas()).add_chunk(chunk);
                    self.streams.mark(&lists);
                }
                self.take_usable(&mut lists, stream, size, false)?
            }
        };
        lists.took(size);
        drop(lists);
        Some((addr, generation))
    }

    /// A chunk for the stream arena that holds `size` bytes (a [`stream_block_size`], so a
    /// multiple of the pool's alignment), from the shared arena: its smallest wholly free
    /// chunk that does and is no larger than the pool would grow by for the request, else a
    /// block of its free space lent as a chunk (the request rounded up to the growth
    /// granularity). The stream arena takes no more than it would have grown by: a small
    /// request that took a large free chunk whole would keep it from the next large request
    /// for as long as its block lives, and the pool would grow for that one. A request above
    /// the chunk size takes the smallest that holds it, whatever its size: such chunks serve
    /// only such requests, and one the pool kept through a growth
    /// ([`kept_through_growth`](PoolShared::kept_through_growth)) is there for the next.
    fn adopt(&self, size: usize) -> Option<Chunk> {
        let mut arena = lock(&self.arena);
        let most = if arena.is_oversize(size) {
            usize::MAX
        } else {
            self.growth(size)
        };
        if let Some(chunk) = arena.take_free_chunk(size, most) {
            return Some(chunk);
        }
        arena.lend(size, size.next_multiple_of(GROW_GRANULARITY), most)
    }

    /// The free of a stream-ordered block that [`park_on_stream`](Self::park_on_stream) did
    /// not keep: back to the arena at once where only the stream it was freed on used it (its
    /// range recorded with that stream), else once a fence recorded on every stream that used
    /// it is done.
    pub(super) fn release_on_streams(
        &self,
        addr: u64,
        bytes: usize,
        (tag, stamp): (u64, u64),
        streams: StreamUse,
    ) {
        let size = stream_block_size(bytes);
        let mut lists = lock(self.streams.lists());
        if self.generation.load(Ordering::Acquire) != tag {
            return;
        }
        lists.gave(size);
        lists.history.free(addr, stamp);
        if lists.arena.is_none() {
            // The arena holds the chunk of every block it handed out until the block comes
            // back; a block with no arena was not handed out here.
            tracing::error!(device = %self.cx.device, ptr = addr, stream = streams.stream.raw(), "a stream-ordered block came back to a pool whose streams hold no memory; it is left out of use");
            return;
        }
        if streams.other_streams().next().is_none() {
            let on = streams.free_on;
            lists.give_back(on, streams.owner_of(on), addr, size);
            return;
        }
        let Some(_live) = self.cx.liveness.enter() else {
            return;
        };
        let on = std::iter::once(streams.free_on).chain(streams.other_streams());
        match self.fences.record(on) {
            Ok(fence) => lists.waiting.push((addr, size, fence)),
            Err(e) => {
                // Without a fence the block cannot be known to be unused: it stays out of
                // circulation, its chunk held, until the pool's reset.
                tracing::error!(device = %self.cx.device, error = %e, ptr = addr, "recording the streams of a stream-ordered free failed; the pool keeps the block out of use until its reset");
                self.queue
                    .record_error(EmmError::driver("free on a stream", self.cx.device, e));
            }
        }
    }

    /// Returns the blocks of `lists` whose fences are done (all of them with `wait`, after
    /// waiting) to the arena, every stream's.
    fn settle_fences(&self, lists: &mut StreamLists, wait: bool) -> Result<(), EmmError> {
        let err = |e| EmmError::driver("reclaiming stream-ordered blocks", self.cx.device, e);
        let mut k = 0;
        while k < lists.waiting.len() {
            if !self
                .fences
                .finished(&mut lists.waiting[k].2, wait)
                .map_err(err)?
            {
                k += 1;
                continue;
            }
            if wait {
                // Counted once the wait succeeded, as `wait_on_host` counts.
                self.totals.host_waits.fetch_add(1, Ordering::Relaxed);
            }
            let (addr, size, fence) = lists.waiting.swap_remove(k);
            self.fences.recycle(fence);
            // A waiting block's chunk keeps the arena (`release_on_streams`).
            if let Some(arena) = lists.arena.as_mut() {
                arena.give(addr, size);
            }
        }
        Ok(())
    }

    /// Moves the stream arena's wholly free chunks whose streams' work is done to the shared
    /// arena: chunks into which only streams with nothing pending freed blocks, or with
    /// `wait`, every chunk after waiting for its streams' work. A chunk a captured stream freed
    /// into stays (its work is not the GPU's yet). Returns the bytes moved.
    pub(super) fn release_idle_stream_chunks(&self, wait: bool) -> Result<usize, EmmError> {
        let Some(_live) = self.cx.liveness.enter() else {
            return Ok(0);
        };
        let mut gone = Vec::new();
        let moved = {
            let mut lists = lock(self.streams.lists());
            if lists.arena.is_none() {
                return Ok(0);
            }
            self.settle_fences(&mut lists, wait)?;
            let chunks = (lists.arena.as_mut())
                .map(Arenas::remove_free_chunks)
                .unwrap_or_default();
            let (mut moved, mut kept) = (Vec::new(), Vec::new());
            let mut failed = None;
            for chunk in chunks {
                if failed.is_some() {
                    kept.push(chunk);
                    continue;
                }
                match self.streams_done(&mut lists, &chunk, wait) {
                    Ok(true) => moved.push(chunk),
                    Ok(false) => kept.push(chunk),
                    Err(e) => {
                        failed = Some(e);
                        kept.push(chunk);
                    }
                }
            }
            if let Some(arena) = lists.arena.as_mut() {
                for chunk in kept {
                    arena.add_chunk(chunk);
                }
            }
            lists.left(&moved);
            self.streams.mark(&lists);
            // The streams that no longer hold a range or an order are let go of (their owners
            // dropped below, with no lock held).
            let forgotten = lists.freed.sweep();
            lists.forget_owners(forgotten, &mut gone);
            if let Some(e) = failed {
                return Err(EmmError::driver(
                    "reclaiming stream-ordered blocks",
                    self.cx.device,
                    e,
                ));
            }
            moved
        };
        drop(gone);
        let bytes = moved.iter().map(|c| c.size).sum();
        {
            let mut arena = lock(&self.arena);
            for chunk in moved {
                arena.restore(chunk);
            }
        }
        if bytes > 0 {
            tracing::debug!(device = %self.cx.device, bytes, wait, "the streams' free chunks back in the shared pool");
        }
        Ok(bytes)
    }

    /// Whether the work of every stream that freed a block into `chunk` (a wholly free chunk
    /// out of the arena) is done, with `wait` after waiting for it: those streams' ranges are
    /// then forgotten. `false` where a stream is being captured or still has work pending.
    fn streams_done(
        &self,
        lists: &mut StreamLists,
        chunk: &Chunk,
        wait: bool,
    ) -> Result<bool, driver_sys::DriverError> {
        for s in lists.freed.streams_within(chunk.base, chunk.size) {
            if self.freeing_stream_idle(lists, s, wait)? != Some(true) {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Makes `stream`'s work from now on wait on the GPU for the work queued so far on `busy`,
    /// counted in [`PoolStats::stream_waits`](crate::contract::info::PoolStats::stream_waits).
    fn order_on_gpu(
        &self,
        busy: &[StreamHandle],
        stream: StreamHandle,
    ) -> Result<(), driver_sys::DriverError> {
        self.fences.order_after(busy.iter().copied(), stream)?;
        (self.totals.stream_waits).fetch_add(busy.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Waits on the host until the work queued so far on `stream` is done, counted in
    /// [`PoolStats::host_waits`](crate::contract::info::PoolStats::host_waits).
    fn wait_on_host(&self, stream: StreamHandle) -> Result<(), driver_sys::DriverError> {
        self.fences.wait_for_stream(stream)?;
        self.totals.host_waits.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Whether `s`, a stream whose frees the lists record, has no work pending (with `wait`,
    /// after waiting for it): `Some(true)` with its ranges forgotten, every stream's now;
    /// `Some(false)` where its work still runs; `None` where it is being captured (its work is
    /// not the GPU's yet: it is neither asked nor waited for) or cannot be asked.
    fn freeing_stream_idle(
        &self,
        lists: &mut StreamLists,
        s: StreamHandle,
        wait: bool,
    ) -> Result<Option<bool>, driver_sys::DriverError> {
        if self.cx.stream_is_captured(s).unwrap_or(true) {
            return Ok(None);
        }
        let idle = if wait {
            self.wait_on_host(s).map(|()| true)?
        } else {
            self.cx.driver.stream_query(self.cx.context, s)?
        };
        if idle {
            lists.freed.idle(s);
        }
        Ok(Some(idle))
    }

    /// The allocator's drop: lets the spare records go, and keeps none from now on (each holds
    /// a clone of the pool's hook, and so of the pool, which would never be freed).
    pub(super) fn close_stream_spares(&self) {
        let spares = {
            let mut lists = lock(self.streams.lists());
            lists.closed = true;
            std::mem::take(&mut lists.spares)
        };
        let_go(spares);
    }

    /// Empties the stream lists (a reset, with `lists` their guard), returning the chunks the
    /// arena held, the spare records and what kept the known streams alive (the caller lets
    /// them go with no lock held: [`let_go`]; a stream's destruction may run anything).
    pub(super) fn clear_stream_lists(
        &self,
        lists: &mut MutexGuard<'_, StreamLists>,
    ) -> (Vec<Chunk>, Vec<ParkedPointer>, Vec<HostOwner>) {
        let mut chunks = Vec::new();
        for (_, _, fence) in std::mem::take(&mut lists.waiting) {
            self.fences.recycle(fence);
        }
        if let Some(arena) = lists.arena.as_mut() {
            chunks.extend(arena.clear());
        }
        let spares = std::mem::take(&mut lists.spares);
        let owners = (std::mem::take(&mut lists.owners).into_iter())
            .filter_map(|(_, owner)| owner)
            .collect();
        let closed = lists.closed;
        **lists = StreamLists::default();
        lists.closed = closed;
        self.streams.mark(lists);
        (chunks, spares, owners)
    }
}

/// Lets go of spare records (their boxes go to this thread's spares, their blocks long back in
/// the arenas or freed by a reset: [`ParkedPointer::into_base`]).
pub(super) fn let_go(records: Vec<ParkedPointer>) {
    for record in records {
        record.into_base();
    }
}
