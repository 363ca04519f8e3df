//! The pool's stream-ordered half: each stream's own arena of whole chunks, and blocks waiting
//! for a fence before their stream may reuse them.
//!
//! - Memory allocated on stream S comes from S's arena: whole chunks the pool gave S, split
//!   and merged as the shared arena's blocks are (`arena.rs`).
//! - A block freed on S and used by no other stream goes back to S's arena at once, merged
//!   with its free neighbours: S's next allocation may take it (or part of it) in S's order,
//!   with no driver call.
//! - A block that other streams used (recorded with `record_stream`, or freed on a stream
//!   other than the one it was allocated on) waits behind a fence, events recorded at the free
//!   on those streams, and goes back to its stream's arena once they completed.
//! - When S's arena has no block large enough, S takes a wholly free chunk of the shared
//!   arena, no larger than the pool would grow by for the request (any size for a request
//!   above the chunk size: the smallest that holds it); else the shared arena lends
//!   S a block of its free space (the request rounded up to 2 MiB) as a chunk of S's, so that
//!   free space beside a block that keeps a shared chunk from going back whole still serves
//!   the streams; failing that, the wholly free chunks of streams with no work pending move to
//!   the shared arena (they are safe for every stream; a lent one goes back into the free space
//!   it came from) and S tries again; failing that, S takes a wholly free chunk of a stream T
//!   whose work is still running, after making S's work wait on the GPU for the work queued on
//!   T so far (an event recorded on T, `cuStreamWaitEvent` on S), so that nothing S queues on
//!   the memory runs before T's last use of it; failing that, a stream T lends S a block of
//!   its free space (the request rounded up to 2 MiB), behind such a wait where T's work is
//!   still running: each stream's peak comes at its own time, and the streams' free space
//!   together serves them all where each stream's alone would make the pool grow; failing
//!   that, the pool grows by a chunk for S. A block moves from one stream's arena to another's
//!   only once the first stream's work is done, or behind such a wait.
//! - A block a stream lent goes back to it once the borrower gives it up (before the borrower
//!   grows, or once its work is done): T's work from then on waits on the GPU for the work
//!   queued on S, so the host never waits for it. A block another stream lent is not lent on,
//!   and a stream holds a chunk it lent from while the block is out, which keeps the chunk
//!   (and an emm-made stream it belongs to) from going back until then.
//! - A stream's wholly free chunk larger than the pool would grow by for a request (one a large
//!   block left) serves that request last: a chunk of the shared arena's, or its free space
//!   lent, serves it first (`Arena::take_sparing`). A small block placed there would keep the
//!   chunk from going back to the driver before a larger request grows the pool.
//! - A lent chunk never goes to the driver: where a stream gives it up (moved, shed, trimmed)
//!   it returns to its lender, and a reset frees only the chunk it lies in.
//! - Before the pool grows for S, the wholly free chunks it does not keep
//!   (`PoolShared::kept_through_growth`) go back to the driver, S's own once the pool has
//!   waited for S's work (`give_back_after`): a `cuMemFree` waits for the device in any case,
//!   and freeing them later would have the pool hold them and the new chunk at once.
//! - `trim` frees the wholly free chunks of streams with no work pending; out of memory, the
//!   pool waits for every stream's work first.
//!
//! Lock order: the stream shards in index order, then the shared arena.

use driver_sys::{DevicePtr, StreamHandle};

use super::arena::{Arenas, Chunk, Lender, cut_out, place};
use super::history::Ring;
use super::{GROW_GRANULARITY, POOL_ALIGNMENT, PoolShared};
use crate::contract::snapshot::{BlockState, HeldBlock, HeldSegment, SegmentKind};
use crate::error::EmmError;
use crate::host::HostLayer;
use crate::host::fences::Fence;
use crate::memory::host::HostOwner;
use crate::memory::pointer::{ParkedPointer, PoolHook, ReleaseHook, StreamUse};
use crate::sync::{AtomicU64, Mutex, MutexGuard, Ordering, lock};

/// The block size a stream-ordered request of `bytes` gets: a multiple of 256 bytes (the
/// stream arenas split blocks to measure, so no size class rounds it further).
pub(super) fn stream_block_size(bytes: usize) -> usize {
    bytes.div_ceil(POOL_ALIGNMENT) * POOL_ALIGNMENT
}

/// One stream's memory.
pub(super) struct PerStream {
    /// The chunks the stream holds, and their free space.
    arena: Arenas,
    /// Keeps an emm-created stream alive while its arena holds memory it freed: a destroyed
    /// stream's handle may be reused by a new stream that is not ordered after the old one's
    /// work.
    _owner: Option<HostOwner>,
}

/// The stream-ordered memory of the streams that hash to one shard.
#[derive(Default)]
pub(super) struct StreamLists {
    /// Per stream (a short list, searched in order): its arena.
    per_stream: Vec<(StreamHandle, PerStream)>,
    /// Blocks that go back to their stream's arena once their fence is done:
    /// (stream, address, size, fence).
    waiting: Vec<(StreamHandle, u64, usize, Fence)>,
    /// Blocks handed out on this shard's streams and not yet freed.
    pub(super) in_use_blocks: i64,
    /// Their bytes.
    pub(super) in_use_bytes: i64,
    /// The last allocations and frees on this shard's streams (`history.rs`), in the order
    /// this shard's lock saw them.
    pub(super) history: Ring,
    /// Records of pointers whose blocks went back to their streams' arenas at once
    /// ([`PoolShared::park_on_stream`]), for the next allocation on a stream of this shard:
    /// the block comes from the arena as it would, and its pointer is this record revived.
    /// At most [`SPARES_PER_SHARD`]; they hold no memory.
    spares: Vec<ParkedPointer>,
    /// Set by the allocator's drop: no record is kept here any more (a kept record holds a
    /// clone of the pool's hook, and so of the pool).
    closed: bool,
}

/// The most spare records one stream shard keeps.
const SPARES_PER_SHARD: usize = 8;

impl StreamLists {
    /// Counts a block of `size` bytes taken from a stream's arena as in use.
    #[inline]
    fn took(&mut self, size: usize) {
        self.in_use_blocks += 1;
        self.in_use_bytes += size as i64;
    }

    /// Counts a block of `size` bytes given back to a stream's arena as no longer in use.
    #[inline]
    fn gave(&mut self, size: usize) {
        self.in_use_blocks -= 1;
        self.in_use_bytes -= size as i64;
    }

    fn list(&mut self, stream: StreamHandle) -> Option<&mut PerStream> {
        self.per_stream
            .iter_mut()
            .find(|(s, _)| *s == stream)
            .map(|(_, l)| l)
    }

    /// `stream`'s memory, made of the empty arenas `empty` if it has none yet.
    fn list_or_new(&mut self, stream: StreamHandle, empty: Arenas) -> &mut PerStream {
        let k = match self.per_stream.iter().position(|(s, _)| *s == stream) {
            Some(k) => k,
            None => {
                let mine = PerStream {
                    arena: empty,
                    _owner: None,
                };
                self.per_stream.push((stream, mine));
                self.per_stream.len() - 1
            }
        };
        &mut self.per_stream[k].1
    }

    /// Bytes of the chunks this shard's streams hold.
    pub(super) fn held_bytes(&self) -> usize {
        self.per_stream.iter().map(|(_, l)| l.arena.held()).sum()
    }

    /// Bytes held and not in use: free in the arenas, or waiting for a fence.
    pub(super) fn cached_bytes(&self) -> usize {
        self.held_bytes()
            .saturating_sub(self.in_use_bytes.max(0) as usize)
    }

    /// Adds the sizes of the free blocks of this shard's streams' arenas to `out`.
    pub(super) fn free_block_sizes(&self, out: &mut Vec<usize>) {
        for (_, l) in &self.per_stream {
            l.arena.free_block_sizes(out);
        }
    }

    /// Adds this shard's streams' chunks to `out` as segments of `kind`, with their free
    /// blocks and the blocks waiting for their fences.
    pub(super) fn held_segments(&self, kind: SegmentKind, out: &mut Vec<HeldSegment>) {
        for (stream, l) in &self.per_stream {
            let mut mine = Vec::new();
            l.arena.held_segments(kind, Some(stream.raw()), &mut mine);
            mine.sort_by_key(|s| s.address);
            // A block lent to another stream is a segment of that stream's.
            cut_out(&mut mine, l.arena.lent_out());
            let waiting = self.waiting.iter().filter(|w| w.0 == *stream);
            place(
                &mut mine,
                waiting.map(|&(_, address, bytes, _)| HeldBlock {
                    address,
                    bytes,
                    state: BlockState::PendingFree,
                }),
            );
            out.append(&mut mine);
        }
    }

    /// The largest free block of any of this shard's streams.
    pub(super) fn largest_free(&self) -> usize {
        self.per_stream
            .iter()
            .map(|(_, l)| l.arena.largest_free())
            .max()
            .unwrap_or(0)
    }

    /// Spare records this shard keeps.
    #[cfg(all(test, not(emm_loom)))]
    pub(super) fn spare_records(&self) -> usize {
        self.spares.len()
    }

    /// Chunks this shard's streams hold.
    pub(super) fn chunks(&self) -> usize {
        self.per_stream.iter().map(|(_, l)| l.arena.chunks()).sum()
    }

    /// Forgets the streams whose arenas hold no chunk (and so no block, free or waiting).
    fn forget_empty(&mut self) {
        self.per_stream.retain(|(_, l)| !l.arena.is_empty());
    }
}

/// One shard of the stream-ordered state, on its own cache lines.
#[repr(align(128))]
#[derive(Default)]
pub(super) struct StreamShard {
    pub(super) inner: Mutex<StreamLists>,
}

/// The pool's stream-ordered state: shards by stream, locked in index order, each before the
/// shared arena's lock.
pub(super) struct StreamCache {
    pub(super) shards: Box<[StreamShard]>,
    /// Bit `k` set while shard `k` holds a stream's memory (written under that shard's lock):
    /// a growth or a trim visits only those shards.
    occupied: AtomicU64,
}

const STREAM_SHARDS: usize = 16;
const _: () = assert!(
    STREAM_SHARDS <= 64,
    "StreamCache::occupied has a bit per shard"
);

impl StreamCache {
    pub(super) fn new() -> StreamCache {
        StreamCache {
            shards: (0..STREAM_SHARDS).map(|_| StreamShard::default()).collect(),
            occupied: AtomicU64::new(0),
        }
    }

    /// The index of `stream`'s shard (handles are aligned pointers: their bits are mixed
    /// first).
    pub(super) fn index(&self, stream: StreamHandle) -> usize {
        let k = (stream.raw().wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 60) as usize;
        k % self.shards.len()
    }

    fn of(&self, stream: StreamHandle) -> &Mutex<StreamLists> {
        &self.shards[self.index(stream)].inner
    }

    /// Records, under shard `k`'s lock, whether it holds any stream's memory.
    fn mark(&self, k: usize, lists: &StreamLists) {
        let bit = 1u64 << k;
        if lists.per_stream.is_empty() {
            self.occupied.fetch_and(!bit, Ordering::Release);
        } else {
            self.occupied.fetch_or(bit, Ordering::Release);
        }
    }

    /// The shards that held a stream's memory when last marked.
    pub(super) fn occupied(&self) -> impl Iterator<Item = usize> + '_ {
        let bits = self.occupied.load(Ordering::Acquire);
        (0..self.shards.len()).filter(move |k| bits & (1 << k) != 0)
    }

    /// How many shards there are.
    pub(super) fn len(&self) -> usize {
        self.shards.len()
    }
}

/// The release hook of stream-ordered pool pointers, one per shard (so that threads on
/// different streams do not share the hook's reference count), aligned like the shards.
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

// SAFETY: `PoolShared::park_on_stream` keeps the record in a stream shard or returns it; it
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
    /// A block of `size` bytes (a [`stream_block_size`], for a request of `bytes`) from
    /// `stream`'s arena, if it has one large enough, counted as in use, with its generation,
    /// its history stamp and a spare record of the shard's.
    pub(super) fn take_on_stream(
        &self,
        stream: StreamHandle,
        size: usize,
        bytes: usize,
    ) -> Option<(u64, u64, u64, Option<ParkedPointer>)> {
        let mut lists = lock(self.streams.of(stream));
        let addr = lists
            .list(stream)?
            .arena
            .take_sparing(size, || self.growth(size))?;
        lists.took(size);
        let stamp = lists.history.alloc_on(addr, bytes, stream.raw());
        let spare = lists.spares.pop();
        Some((addr, self.generation.load(Ordering::Acquire), stamp, spare))
    }

    /// [`PoolHook::park`] of a stream-ordered pointer's record: where its block was freed on
    /// the stream it was allocated on and no other stream used it, the block goes back to that
    /// stream's arena at once (as [`release_on_streams`](Self::release_on_streams) would put
    /// it) and the record is kept as a spare of the stream's shard, so that the next
    /// allocation there makes its pointer without building one. Otherwise (or when the shard
    /// has its spares, or the pool was reset since) hands the record back, to be released as
    /// usual.
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
            let mut lists = lock(self.streams.of(stream));
            // A block whose stream holds no memory was not handed out here: its release
            // reports it.
            let k = lists.per_stream.iter().position(|(s, _)| *s == stream);
            let Some(k) = k.filter(|_| {
                !lists.closed
                    && lists.spares.len() < SPARES_PER_SHARD
                    && self.generation.load(Ordering::Acquire) == tag
            }) else {
                return Some(record);
            };
            let Some(streams) = record.take_stream_use() else {
                return Some(record);
            };
            let addr = record.base();
            let mine = &mut lists.per_stream[k].1;
            if mine._owner.is_none() {
                mine._owner = streams.owner_of(stream).cloned();
            }
            mine.arena.give(addr, size);
            lists.gave(size);
            lists.history.free(addr, record.stamp());
            lists.spares.push(record);
            streams
        };
        // What kept the streams alive goes with no shard entered (its drop may run anything,
        // a stream's destruction included).
        drop(streams);
        None
    }

    /// Records in `stream`'s shard's history an allocation of `bytes` at `addr` that a
    /// growth served, its block from outside the stream's arena, and returns its stamp (the
    /// path that finds a block records its own under the lock it holds).
    pub(super) fn note_grown(&self, stream: StreamHandle, addr: u64, bytes: usize) -> u64 {
        lock(self.streams.of(stream))
            .history
            .alloc_fresh(addr, bytes, stream.raw())
    }

    /// Gives `stream` a chunk that holds a block of `size` bytes and takes the block from it:
    /// a wholly free chunk of the shared arena, else one that streams with no work pending
    /// gave up, else a new one from the driver (through the host layer's out-of-memory rule).
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
            // A captured stream neither grows nor borrows; a large free chunk of its own,
            // spared by the first try, still serves it.
            return self.take_own(stream, size).ok_or(refused);
        }
        let _relaxed = self.cx.relax_capture();
        if let Some(found) = self.take_after_adopting(stream, size, None) {
            return Ok(found);
        }
        // The free chunks of streams with no work pending (this one's too) are every
        // stream's.
        if self.release_idle_stream_chunks(None, false)? > 0
            && let Some(found) = self.take_after_adopting(stream, size, None)
        {
            return Ok(found);
        }
        // A wholly free chunk of a stream whose work is still running, once this stream's
        // work waits for that work on the GPU.
        if let Some(chunk) = self.take_from_busy_stream(stream, size)
            && let Some(found) = self.take_after_adopting(stream, size, Some(chunk))
        {
            return Ok(found);
        }
        // A free block of another stream's chunk, lent behind that stream's work.
        if let Some(chunk) = self.borrow_from_stream(stream, size)
            && let Some(found) = self.take_after_adopting(stream, size, Some(chunk))
        {
            return Ok(found);
        }
        let grown = host.attempt_allocation(
            "memalloc_on",
            crate::host::AllocationKind::Device,
            size,
            || {
                // Another thread may have freed a chunk meanwhile.
                if let Some(found) = self.take_after_adopting(stream, size, None) {
                    return Ok(found);
                }
                // About to grow: the blocks the shards cache go back to the shared arena, which
                // may free a chunk of it whole, for this stream or the driver (a pool that
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
    /// space the streams' arenas hold meanwhile: free space split into blocks too small for
    /// the request (or too large to be lent) is what a growth adds to.
    fn trace_stream_growth(&self, stream: StreamHandle, size: usize) {
        let mut free = Vec::new();
        for k in self.streams.occupied() {
            lock(&self.streams.shards[k].inner).free_block_sizes(&mut free);
        }
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

    /// A wholly free chunk of another stream's arena that holds `size` bytes (no larger than
    /// the pool would grow by for the request), for `stream`, whose work from now on waits on
    /// the GPU for the work queued so far on the stream that gave it up: a free chunk of a
    /// busy stream serves another stream without the host waiting and without the pool
    /// growing ([`take_from_another_stream`](Self::take_from_another_stream)).
    fn take_from_busy_stream(&self, stream: StreamHandle, size: usize) -> Option<Chunk> {
        let most = self.growth(size);
        self.take_from_another_stream(
            stream,
            |arena, _| arena.take_free_chunk(size, most),
            Arenas::add_chunk,
            false,
            "a busy stream's free chunk moved to another stream behind its work",
        )
    }

    /// A block of another stream T's free space that holds `size` bytes (the request rounded
    /// up to the growth granularity where the block is that large), lent to `stream` as a
    /// chunk of its own: the sum of what each stream holds at its own peak is more than the
    /// streams hold together at theirs, and free space in a chunk T still uses would otherwise
    /// serve T alone while the pool grows for `stream`. Where T has work pending, `stream`'s
    /// work from now on waits on the GPU for the work queued on T so far, as for a whole
    /// chunk ([`take_from_busy_stream`](Self::take_from_busy_stream)). The block goes back to
    /// T once `stream` gives it up: before `stream` grows, T's work then waiting on the GPU for
    /// `stream`'s ([`return_to_lenders`](Self::return_to_lenders)), or once `stream`'s work is
    /// done ([`return_lent`](Self::return_lent)). `vmm-pool` lends nothing (it moves whole
    /// pieces instead).
    fn borrow_from_stream(&self, stream: StreamHandle, size: usize) -> Option<Chunk> {
        let most = self.growth(size);
        let want = size.next_multiple_of(GROW_GRANULARITY);
        self.take_from_another_stream(
            stream,
            |arena, other| arena.lend(size, want, most, Lender::Stream(other)),
            Arenas::restore,
            true,
            "a stream's free block lent to another stream behind its work",
        )
    }

    /// Memory for `stream` that another stream's arena gives up (`take` on it, the first that
    /// gives any), once `stream`'s work from now on waits on the GPU for the work queued on
    /// that stream so far (an event recorded there, waited for with `cuStreamWaitEvent`); with
    /// `if_busy`, only where that stream still has work pending. A stream that is being
    /// captured gives nothing (its work is not the GPU's yet). `None` where no stream gives
    /// anything, or the driver refused the query or the event: what was taken goes back
    /// (`put_back`) and the pool grows instead.
    fn take_from_another_stream(
        &self,
        stream: StreamHandle,
        mut take: impl FnMut(&mut Arenas, StreamHandle) -> Option<Chunk>,
        put_back: impl FnOnce(&mut Arenas, Chunk),
        if_busy: bool,
        moved: &'static str,
    ) -> Option<Chunk> {
        let _live = self.cx.liveness.enter()?;
        for k in self.streams.occupied() {
            let mut lists = lock(&self.streams.shards[k].inner);
            for (other, mine) in lists.per_stream.iter_mut() {
                if *other == stream || self.cx.stream_is_captured(*other).unwrap_or(true) {
                    continue;
                }
                let Some(chunk) = take(&mut mine.arena, *other) else {
                    continue;
                };
                let wait = if if_busy {
                    let done = self.cx.driver.stream_query(self.cx.context, *other);
                    done.map(|done| !done)
                } else {
                    Ok(true)
                };
                let ordered = wait.and_then(|wait| {
                    if wait {
                        self.fences.order_after([*other], stream)
                    } else {
                        Ok(())
                    }
                });
                return match ordered {
                    Ok(()) => {
                        tracing::debug!(device = %self.cx.device, bytes = chunk.size, from = other.raw(), to = stream.raw(), "{moved}");
                        Some(chunk)
                    }
                    Err(e) => {
                        put_back(&mut mine.arena, chunk);
                        tracing::warn!(device = %self.cx.device, error = %e, "ordering a stream after another's work failed; the pool grows instead");
                        None
                    }
                };
            }
        }
        None
    }

    /// A block of `size` bytes from `stream`'s own arena, sparing nothing, counted as in use.
    fn take_own(&self, stream: StreamHandle, size: usize) -> Option<(u64, u64)> {
        let mut lists = lock(self.streams.of(stream));
        let addr = lists.list(stream)?.arena.take(size)?;
        lists.took(size);
        Some((addr, self.generation.load(Ordering::Acquire)))
    }

    /// Before the pool grows for a request of `size` bytes that no free block holds: the
    /// wholly free chunks (none holds the request, or it would have been taken) go back to the
    /// driver, except those the pool may keep through the growth
    /// ([`kept_through_growth`](PoolShared::kept_through_growth)): the largest first, while
    /// the pool, grown, holds at most an eighth more than the most stream-ordered memory in
    /// use at a growth. A
    /// program whose requests vary from step to step finds them again at its next step instead
    /// of the driver's `cuMemFree` and `cuMemAlloc` at every step, and what the pool holds
    /// beyond what is in use stays bounded all the same. `vmm-pool` keeps nothing so: its free
    /// pieces, up to what the growth maps, are mapped again there
    /// ([`Arena::shed_free_chunks`](super::arena::Arena::shed_free_chunks)). The shared
    /// arena's go at once; those of `growing`, the stream that grows, once its work is done:
    /// the pool waits for that work here ([`give_back_after`](Self::give_back_after)), so
    /// that it never holds the chunks it gives back and the one it grows by at once.
    pub(super) fn shed_free_chunks(&self, growing: Option<StreamHandle>, size: usize) {
        let Some(_live) = self.cx.liveness.enter() else {
            return;
        };
        // `vmm-pool` moves at most what the growth maps (`Arena::shed_free_chunks`).
        let most = self.growth(size);
        let mut freed = lock(&self.arena).shed_free_chunks(most);
        let most = most.saturating_sub(freed.iter().map(|c| c.size).sum());
        let mut shed = match growing {
            Some(stream) => {
                let mut lists = lock(self.streams.of(stream));
                if let Err(e) = self.settle_fences(&mut lists, false) {
                    self.queue.record_error(e);
                }
                lists
                    .list(stream)
                    .map(|mine| mine.arena.shed_free_chunks(most))
                    .unwrap_or_default()
            }
            None => Vec::new(),
        };
        if self.vmm.is_none() {
            self.keep_some(growing, size, &mut freed, &mut shed);
        }
        self.free_chunks(freed, "before growing");
        if let Some(stream) = growing {
            self.give_back_after(stream, shed);
        }
    }

    /// `pool`: of the wholly free chunks about to go back before a growth for `size` bytes,
    /// the shared arena's `freed` and `growing`'s `shed`, puts back those the pool may keep
    /// ([`kept_through_growth`](PoolShared::kept_through_growth)), the largest first; a chunk
    /// the shared arena lent goes back to it in any case, at no driver call.
    fn keep_some(
        &self,
        growing: Option<StreamHandle>,
        size: usize,
        freed: &mut Vec<Chunk>,
        shed: &mut Vec<Chunk>,
    ) {
        let free: usize = (freed.iter().chain(shed.iter()))
            .filter(|c| c.lent.is_none())
            .map(|c| c.size)
            .sum();
        // Every growth raises the mark of what is in use on streams, free chunks or not; with
        // neither free chunks nor stream-ordered memory, there is nothing to keep or count.
        if free == 0 && self.streams.occupied().next().is_none() {
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
        for (chunk, own) in all {
            let keep = chunk.lent.is_none() && chunk.size <= budget;
            if keep {
                budget -= chunk.size;
            }
            match (keep, own) {
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
        if let Some(stream) = growing.filter(|_| !kept_shed.is_empty()) {
            self.keep_on(stream, kept_shed);
        }
    }

    /// Gives back `shed`, wholly free chunks taken out of `stream`'s arena. Blocks another
    /// stream lent go back to it at once, its work from now on waiting on the GPU for the work
    /// queued on `stream` so far ([`return_to_lenders`](Self::return_to_lenders)). The rest
    /// go once that work is done: the pool waits for it (an event recorded there now), then
    /// frees the driver's chunks and returns the shared arena's. A free on the driver waits
    /// for the device's work in any case (`cuMemFree`, `cuMemUnmap`); waiting first orders it
    /// after the stream's work by rule rather than by the driver's habit, and frees the chunks
    /// before the pool grows instead of at a later growth. Where the wait fails, the chunks go
    /// back to the stream, which may still use them. The caller holds the context's liveness
    /// and no lock of the pool's.
    fn give_back_after(&self, stream: StreamHandle, shed: Vec<Chunk>) {
        let (streams_lent, shed): (Vec<Chunk>, Vec<Chunk>) =
            shed.into_iter().partition(Chunk::lent_by_a_stream);
        self.return_to_lenders(stream, streams_lent);
        if shed.is_empty() {
            return;
        }
        if let Err(e) = self.fences.wait_for_stream(stream) {
            tracing::warn!(device = %self.cx.device, error = %e, "waiting for a growing stream's work failed; its free chunks stay with it");
            self.keep_on(stream, shed);
            self.queue.record_error(EmmError::driver(
                "waiting for a stream's work before giving its free chunks back",
                self.cx.device,
                e,
            ));
            return;
        }
        let (lent, freed): (Vec<Chunk>, Vec<Chunk>) =
            shed.into_iter().partition(|c| c.lent.is_some());
        self.return_lent(lent);
        self.free_chunks(freed, "before a stream grows");
    }

    /// Puts wholly free chunks taken out of `stream`'s arena back there.
    fn keep_on(&self, stream: StreamHandle, chunks: Vec<Chunk>) {
        let k = self.streams.index(stream);
        let mut lists = lock(&self.streams.shards[k].inner);
        let mine = lists.list_or_new(stream, self.new_arenas());
        for chunk in chunks {
            mine.arena.add_chunk(chunk);
        }
        self.streams.mark(k, &lists);
    }

    /// Returns blocks other streams lent to `stream`, which gave them up with work perhaps
    /// still queued on them: each lender's work from now on waits on the GPU for the work
    /// queued on `stream` so far, so the host never waits (a stream's work may wait on the
    /// host itself). A block whose lender is being captured (its work is not the GPU's yet),
    /// or that the driver could not order, stays with `stream`. The caller holds the
    /// context's liveness and no lock of the pool's.
    fn return_to_lenders(&self, stream: StreamHandle, chunks: Vec<Chunk>) {
        let (mut back, mut kept) = (Vec::new(), Vec::new());
        for chunk in chunks {
            let Some(Lender::Stream(lender)) = chunk.lent else {
                kept.push(chunk);
                continue;
            };
            if self.cx.stream_is_captured(lender).unwrap_or(true) {
                kept.push(chunk);
                continue;
            }
            match self.fences.order_after([stream], lender) {
                Ok(()) => back.push(chunk),
                Err(e) => {
                    tracing::warn!(device = %self.cx.device, error = %e, "ordering a stream after another's work failed; the block it lent stays with the borrower");
                    kept.push(chunk);
                }
            }
        }
        self.return_lent(back);
        if !kept.is_empty() {
            self.keep_on(stream, kept);
        }
    }

    /// `vmm-pool`: grows the largest free block of `stream`'s arena that ends where mapped
    /// memory does, as [`grow_in_place`](PoolShared::grow_in_place) does the shared arena's.
    /// Free pieces, up to what the growth maps, move to it: the stream's own once its work is
    /// done ([`give_back_after`](Self::give_back_after)), then the shared arena's (no run of
    /// them held the request, or the stream would have adopted it). `None` where no block can
    /// grow so, or the context is gone.
    fn grow_stream_in_place(&self, stream: StreamHandle, size: usize) -> Option<(u64, u64)> {
        self.vmm.as_ref()?;
        let _live = self.cx.liveness.enter()?;
        let (tail, free, shed) = {
            let mut lists = lock(self.streams.of(stream));
            let mine = lists.list(stream)?;
            let (end, free) = mine.arena.tail(size)?;
            let most = self.growth_after(free, size);
            // Nothing moves for a growth that cannot map there.
            if !self.can_map_at(end, most) {
                return None;
            }
            let shed = mine
                .arena
                .shed_free_chunks_outside(size, (end - free as u64, end), most);
            (end, free, shed)
        };
        // The shared arena's free pieces move too, up to what the growth still lacks (no run
        // of them held the request, or the stream would have taken it).
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

    /// Takes a block of `size` bytes for `stream`: from its arena, after adding `chunks` (new
    /// ones from the driver, or one another stream gave up) or, with none, a chunk the shared
    /// arena gives up for it ([`adopt`](Self::adopt)). `None` when it has none.
    fn take_after_adopting(
        &self,
        stream: StreamHandle,
        size: usize,
        chunks: impl IntoIterator<Item = Chunk>,
    ) -> Option<(u64, u64)> {
        let k = self.streams.index(stream);
        let mut lists = lock(&self.streams.shards[k].inner);
        let generation = self.generation.load(Ordering::Acquire);
        if lists.list(stream).is_none() {
            lists.list_or_new(stream, self.new_arenas());
            self.streams.mark(k, &lists);
        }
        let mine = lists.list(stream).expect("made above if it had no memory");
        // New chunks join the arena even where another thread's free on this stream made
        // room since the miss.
        for chunk in chunks {
            // A block this stream lent, which came back inside a chunk another stream gave
            // up, is free space of its own again.
            if chunk.lent == Some(Lender::Stream(stream)) {
                mine.arena.restore(chunk);
            } else {
                mine.arena.add_chunk(chunk);
            }
        }
        // A large wholly free chunk of the stream's is its last resort for a small request
        // ([`Arenas::take_sparing`]): a chunk of the shared arena's serves it first.
        let addr = match mine.arena.take_sparing(size, || self.growth(size)) {
            Some(addr) => addr,
            None => match self.adopt(size) {
                Some(chunk) => {
                    mine.arena.add_chunk(chunk);
                    mine.arena.take(size).expect("the chunk holds the request")
                }
                None => mine.arena.take(size)?,
            },
        };
        lists.took(size);
        Some((addr, generation))
    }

    /// A chunk for a stream's arena that holds `size` bytes (a [`stream_block_size`], so a
    /// multiple of the pool's alignment), from the shared arena: its
    /// smallest wholly free chunk that does and is no larger than the pool would grow by for
    /// the request, else a block of its free space lent as a chunk (the request rounded up to
    /// the growth granularity). A stream takes no more than it would have grown by: a small
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
        arena.lend(
            size,
            size.next_multiple_of(GROW_GRANULARITY),
            most,
            Lender::Shared,
        )
    }

    pub(super) fn release_on_streams(
        &self,
        addr: u64,
        bytes: usize,
        (tag, stamp): (u64, u64),
        streams: StreamUse,
    ) {
        let size = stream_block_size(bytes);
        // The block belongs to the arena of the stream it was allocated on.
        let mut lists = lock(self.streams.of(streams.stream));
        if self.generation.load(Ordering::Acquire) != tag {
            return;
        }
        lists.gave(size);
        lists.history.free(addr, stamp);
        let owner = streams.owner_of(streams.stream).cloned();
        let Some(mine) = lists.list(streams.stream) else {
            // A stream's arena holds the chunk of every block it handed out until the block
            // comes back; a block with no arena was not handed out here.
            tracing::error!(device = %self.cx.device, ptr = addr, stream = streams.stream.raw(), "a stream-ordered block came back to a pool stream that holds no memory; it is left out of use");
            return;
        };
        if mine._owner.is_none() {
            mine._owner = owner;
        }
        if streams.other_streams().next().is_none() {
            mine.arena.give(addr, size);
            return;
        }
        let Some(_live) = self.cx.liveness.enter() else {
            return;
        };
        let on = std::iter::once(streams.free_on).chain(streams.other_streams());
        match self.fences.record(on) {
            Ok(fence) => lists.waiting.push((streams.stream, addr, size, fence)),
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
    /// waiting) to their streams' arenas.
    fn settle_fences(&self, lists: &mut StreamLists, wait: bool) -> Result<(), EmmError> {
        let err = |e| EmmError::driver("reclaiming stream-ordered blocks", self.cx.device, e);
        let mut k = 0;
        while k < lists.waiting.len() {
            if !self
                .fences
                .finished(&mut lists.waiting[k].3, wait)
                .map_err(err)?
            {
                k += 1;
                continue;
            }
            let (stream, addr, size, fence) = lists.waiting.swap_remove(k);
            self.fences.recycle(fence);
            // The waiting block's chunk keeps its stream's arena (`release_on_streams`).
            if let Some(mine) = lists.list(stream) {
                mine.arena.give(addr, size);
            }
        }
        Ok(())
    }

    /// Moves the wholly free chunks of every stream (but `keep`) whose work is done to the
    /// shared arena: streams with nothing pending, or with `wait`, every stream after its
    /// work. Returns the bytes moved.
    pub(super) fn release_idle_stream_chunks(
        &self,
        keep: Option<StreamHandle>,
        wait: bool,
    ) -> Result<usize, EmmError> {
        let Some(_live) = self.cx.liveness.enter() else {
            return Ok(0);
        };
        let mut bytes = 0;
        // A block a stream returns to its lender may leave the lender's chunk wholly free,
        // in a shard this pass has visited: another pass takes it.
        loop {
            let mut returned = false;
            for k in self.streams.occupied() {
                let (moved, lent_back) = self.release_shard(k, keep, wait)?;
                bytes += moved;
                returned |= lent_back;
            }
            if !returned {
                break;
            }
        }
        if bytes > 0 {
            tracing::debug!(device = %self.cx.device, bytes, wait, "streams' free chunks back in the shared pool");
        }
        Ok(bytes)
    }

    fn release_shard(
        &self,
        k: usize,
        keep: Option<StreamHandle>,
        wait: bool,
    ) -> Result<(usize, bool), EmmError> {
        let mut lists = lock(&self.streams.shards[k].inner);
        if lists.per_stream.is_empty() {
            return Ok((0, false));
        }
        self.settle_fences(&mut lists, wait)?;
        let err = |e| EmmError::driver("reclaiming stream-ordered blocks", self.cx.device, e);
        let mut freed: Vec<Chunk> = Vec::new();
        for (s, mine) in lists.per_stream.iter_mut() {
            if Some(*s) == keep {
                continue;
            }
            let stream = *s;
            let chunks = mine.arena.remove_free_chunks();
            if chunks.is_empty() {
                continue;
            }
            // A captured stream's work is not the GPU's yet: neither queried nor waited for
            // (the capture would refuse it); its chunks stay, as they do when the driver
            // cannot say.
            if self.cx.stream_is_captured(stream).unwrap_or(true) {
                for chunk in chunks {
                    mine.arena.add_chunk(chunk);
                }
                continue;
            }
            // A stream with nothing pending has no work left on its free chunks.
            let done = if wait {
                self.fences.wait_for_stream(stream).map(|()| true)
            } else {
                self.cx.driver.stream_query(self.cx.context, stream)
            };
            let done = match done {
                Ok(done) => done,
                Err(e) => {
                    // The chunks stay with their stream: nothing is lost.
                    for chunk in chunks {
                        mine.arena.add_chunk(chunk);
                    }
                    return Err(err(e));
                }
            };
            if done {
                freed.extend(chunks);
            } else {
                for chunk in chunks {
                    mine.arena.add_chunk(chunk);
                }
            }
        }
        lists.forget_empty();
        self.streams.mark(k, &lists);
        // A block another stream lent goes back to that stream's arena, whose shard may come
        // before this one in the lock order: after this shard's lock is let go.
        let (lent, freed): (Vec<Chunk>, Vec<Chunk>) =
            freed.into_iter().partition(Chunk::lent_by_a_stream);
        let bytes = freed.iter().map(|c| c.size).sum();
        {
            let mut arena = lock(&self.arena);
            for chunk in freed {
                arena.restore(chunk);
            }
        }
        drop(lists);
        let lent_back = !lent.is_empty();
        self.return_lent(lent);
        Ok((bytes, lent_back))
    }

    /// Gives chunks lent to a stream's arena, which it no longer holds and whose work on them
    /// is done, back to the arenas that lent them: the shared arena, or another stream's. The
    /// caller holds the context's liveness (a reset forgets every lent block at once) and no
    /// lock of the pool's.
    fn return_lent(&self, chunks: Vec<Chunk>) {
        for chunk in chunks {
            match chunk.lent {
                Some(Lender::Stream(lender)) => {
                    let k = self.streams.index(lender);
                    let mut lists = lock(&self.streams.shards[k].inner);
                    match lists.list(lender) {
                        Some(mine) => mine.arena.restore(chunk),
                        None => debug_assert!(
                            false,
                            "stream {lender:?} lent {chunk:?} and holds no memory"
                        ),
                    }
                }
                Some(Lender::Shared) => lock(&self.arena).restore(chunk),
                None => debug_assert!(false, "{chunk:?} was lent by nobody"),
            }
        }
    }

    /// The allocator's drop: lets every shard's spare records go, and keeps none from now on
    /// (each holds a clone of the pool's hook, and so of the pool, which would never be freed).
    pub(super) fn close_stream_spares(&self) {
        for shard in self.streams.shards.iter() {
            let spares = {
                let mut lists = lock(&shard.inner);
                lists.closed = true;
                std::mem::take(&mut lists.spares)
            };
            let_go(spares);
        }
    }

    /// Empties every shard (a reset, with `shards` the locked shards), returning the chunks
    /// the streams held and the shards' spare records (the caller lets them go with no shard
    /// entered: [`let_go`]).
    pub(super) fn clear_stream_shards(
        &self,
        shards: &mut [MutexGuard<'_, StreamLists>],
    ) -> (Vec<Chunk>, Vec<ParkedPointer>) {
        let mut chunks = Vec::new();
        let mut spares = Vec::new();
        for lists in shards.iter_mut() {
            for (_, _, _, fence) in std::mem::take(&mut lists.waiting) {
                self.fences.recycle(fence);
            }
            for (_, mine) in &mut lists.per_stream {
                chunks.extend(mine.arena.clear());
            }
            spares.append(&mut lists.spares);
            let closed = lists.closed;
            **lists = StreamLists::default();
            lists.closed = closed;
        }
        self.streams.occupied.store(0, Ordering::Release);
        (chunks, spares)
    }
}

/// Lets go of spare records (their boxes go to this thread's spares, their blocks long back in
/// the arenas or freed by a reset: [`ParkedPointer::into_base`]).
pub(super) fn let_go(records: Vec<ParkedPointer>) {
    for record in records {
        record.into_base();
    }
}
