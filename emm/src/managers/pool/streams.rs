//! The pool's stream-ordered half: free lists per stream, and blocks waiting for a fence
//! before any stream may reuse them.
//!
//! - A block freed on stream S, used by no other stream, goes on S's list and is reused by the
//!   next allocation of its size on S with no driver call (S's own order makes that safe).
//! - A block that other streams used (recorded with `record_stream`, or allocated on a stream
//!   other than the one it is freed on) waits behind a fence: events recorded on all of those
//!   streams at the free. Once they completed, it goes back to the arena, for every stream.
//! - An allocation that finds nothing on its stream's list and nothing in the arena moves the
//!   other streams' lists behind fences before the pool grows; out of memory, it waits for
//!   every fence. `trim` does the same without waiting.

use std::collections::BTreeMap;

use driver_sys::{DevicePtr, StreamHandle};

use super::{PoolShared, block_size};
use crate::error::EmmError;
use crate::host::fences::Fence;
use crate::memory::host::HostOwner;
use crate::memory::pointer::{PoolHook, ReleaseHook, StreamUse};
use crate::sync::{Mutex, Ordering, lock};

/// One stream's free blocks.
#[derive(Default)]
pub(super) struct PerStream {
    /// Block size → free blocks, reusable on the stream in order.
    blocks: BTreeMap<usize, Vec<u64>>,
    /// Keeps an emm-created stream alive while blocks wait on its list: a destroyed stream's
    /// handle may be reused by a new stream that is not ordered after the old one's work.
    _owner: Option<HostOwner>,
}

/// The stream-ordered blocks of the streams that hash to one shard.
#[derive(Default)]
pub(super) struct StreamLists {
    /// Per stream (a short list, searched in order): its free blocks.
    per_stream: Vec<(u64, PerStream)>,
    /// Blocks that go back to the arena once their fence is done.
    pub(super) waiting: Vec<(Vec<(u64, usize)>, Fence)>,
    /// Blocks and bytes handed out on this shard's streams or freed to them: a block
    /// allocated on one stream and freed on another makes both shards drift, the sums stay
    /// right.
    pub(super) in_use_blocks: i64,
    pub(super) in_use_bytes: i64,
    /// Bytes on the lists and waiting.
    pub(super) cached_bytes: usize,
}

impl StreamLists {
    fn list(&mut self, stream: u64) -> Option<&mut PerStream> {
        self.per_stream
            .iter_mut()
            .find(|(s, _)| *s == stream)
            .map(|(_, l)| l)
    }

    /// `stream`'s list, made empty if it has none yet.
    fn list_or_new(&mut self, stream: u64) -> &mut PerStream {
        let k = match self.per_stream.iter().position(|(s, _)| *s == stream) {
            Some(k) => k,
            None => {
                self.per_stream.push((stream, PerStream::default()));
                self.per_stream.len() - 1
            }
        };
        &mut self.per_stream[k].1
    }
}

/// One shard of the stream-ordered state, on its own cache lines.
#[repr(align(128))]
#[derive(Default)]
pub(super) struct StreamShard {
    pub(super) inner: Mutex<StreamLists>,
}

/// The pool's stream-ordered state: shards by stream, each lock taken before the arena's.
pub(super) struct StreamCache {
    pub(super) shards: Box<[StreamShard]>,
}

const STREAM_SHARDS: usize = 16;

impl StreamCache {
    pub(super) fn new() -> StreamCache {
        StreamCache {
            shards: (0..STREAM_SHARDS).map(|_| StreamShard::default()).collect(),
        }
    }

    /// The index of `stream`'s shard (handles are aligned pointers: their bits are mixed
    /// first).
    pub(super) fn index(&self, stream: StreamHandle) -> usize {
        let k = (stream.0.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 60) as usize;
        k % self.shards.len()
    }

    fn of(&self, stream: StreamHandle) -> &Mutex<StreamLists> {
        &self.shards[self.index(stream)].inner
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

    fn release_on_streams(&self, base: DevicePtr, size: usize, tag: u64, streams: StreamUse) {
        self.pool.release_on_streams(base.0, size, tag, streams);
    }

    fn is_live(&self, tag: u64) -> bool {
        self.pool.generation.load(Ordering::Acquire) == tag
    }
}

// SAFETY: the default `park`, which hands every record back (stream-ordered pointers are made
// without `park`, so it is not even called).
#[allow(unsafe_code)]
unsafe impl PoolHook for StreamHook {}

impl PoolShared {
    /// A block of `size` bytes freed earlier on `stream`, if its list has one.
    pub(super) fn take_on_stream(&self, stream: StreamHandle, size: usize) -> Option<(u64, u64)> {
        let mut lists = lock(self.streams.of(stream));
        let addr = lists.list(stream.0)?.blocks.get_mut(&size)?.pop()?;
        lists.cached_bytes -= size;
        lists.in_use_blocks += 1;
        lists.in_use_bytes += size as i64;
        Some((addr, self.generation.load(Ordering::Acquire)))
    }

    /// Counts a block taken from the arena for a stream-ordered allocation on `stream`.
    pub(super) fn count_stream_block(&self, stream: StreamHandle, size: usize, generation: u64) {
        let mut lists = lock(self.streams.of(stream));
        if self.generation.load(Ordering::Acquire) == generation {
            lists.in_use_blocks += 1;
            lists.in_use_bytes += size as i64;
        }
    }

    fn release_on_streams(&self, addr: u64, bytes: usize, tag: u64, streams: StreamUse) {
        let size = block_size(bytes, self.config.small_max);
        let mut lists = lock(self.streams.of(streams.free_on));
        if self.generation.load(Ordering::Acquire) != tag {
            return;
        }
        lists.in_use_blocks -= 1;
        lists.in_use_bytes -= size as i64;
        lists.cached_bytes += size;
        if streams.other_streams().next().is_none() {
            let list = lists.list_or_new(streams.free_on.0);
            if list._owner.is_none() {
                list._owner = streams.owner_of(streams.free_on).cloned();
            }
            list.blocks.entry(size).or_default().push(addr);
            return;
        }
        let Some(_live) = self.cx.liveness.enter() else {
            return;
        };
        let on = std::iter::once(streams.free_on).chain(streams.other_streams());
        match self.fences.record(on) {
            Ok(fence) => lists.waiting.push((vec![(addr, size)], fence)),
            Err(e) => {
                // Without a fence the block cannot be known to be unused: it is kept out of
                // circulation (a reset or the device's reset frees its chunk).
                lists.cached_bytes -= size;
                tracing::error!(device = %self.cx.device, error = %e, ptr = addr, "recording the streams of a stream-ordered free failed; the pool keeps the block out of use until its reset");
                self.queue
                    .record_error(EmmError::driver("free on a stream", self.cx.device, e));
            }
        }
    }

    /// Puts every stream's list (but `keep`'s) back in the arena: at once for a stream with
    /// nothing pending, behind a fence on the stream for the others; then returns the blocks
    /// whose fences are done to the arena, and with `wait` waits for every fence first.
    /// Returns the bytes returned to the arena. Each shard's lock is taken before the arena's.
    pub(super) fn reclaim_stream_blocks(
        &self,
        keep: Option<StreamHandle>,
        wait: bool,
    ) -> Result<usize, EmmError> {
        let mut bytes = 0;
        for shard in self.streams.shards.iter() {
            bytes += self.reclaim_shard(&shard.inner, keep, wait)?;
        }
        if bytes > 0 {
            tracing::debug!(device = %self.cx.device, bytes, wait, "stream-ordered blocks back in the pool");
        }
        Ok(bytes)
    }

    fn reclaim_shard(
        &self,
        shard: &Mutex<StreamLists>,
        keep: Option<StreamHandle>,
        wait: bool,
    ) -> Result<usize, EmmError> {
        let mut lists = lock(shard);
        if lists.cached_bytes == 0 {
            return Ok(0);
        }
        let generation = self.generation.load(Ordering::Acquire);
        let err = |e| EmmError::driver("reclaiming stream-ordered blocks", self.cx.device, e);
        let mut idle = Vec::new();
        let mut k = 0;
        while k < lists.per_stream.len() {
            let (s, list) = &lists.per_stream[k];
            if Some(*s) == keep.map(|h| h.0) || list.blocks.values().all(|v| v.is_empty()) {
                k += 1;
                continue;
            }
            let stream = StreamHandle(*s);
            let blocks: Vec<(u64, usize)> = list
                .blocks
                .iter()
                .flat_map(|(&size, addrs)| addrs.iter().map(move |&a| (a, size)))
                .collect();
            // A stream with nothing pending has no work left on its blocks.
            let fenced = match self.cx.driver.stream_query(self.cx.context, stream) {
                Ok(true) => None,
                Ok(false) => Some(self.fences.record([stream]).map_err(err)?),
                Err(e) => return Err(err(e)),
            };
            // The list (and what keeps its stream alive) goes: a fence holds its place.
            lists.per_stream.swap_remove(k);
            match fenced {
                None => idle.extend(blocks),
                Some(fence) => lists.waiting.push((blocks, fence)),
            }
        }
        let mut done = Vec::new();
        let mut k = 0;
        while k < lists.waiting.len() {
            if self
                .fences
                .finished(&lists.waiting[k].1, wait)
                .map_err(err)?
            {
                done.push(lists.waiting.swap_remove(k));
            } else {
                k += 1;
            }
        }
        let mut bytes = 0;
        {
            let mut arena = lock(&self.arena);
            let blocks = done.into_iter().flat_map(|(blocks, fence)| {
                self.fences.recycle(fence);
                blocks
            });
            for (a, size) in idle.into_iter().chain(blocks) {
                if arena.generation == generation {
                    arena.give(a, size);
                }
                bytes += size;
            }
        }
        lists.cached_bytes -= bytes;
        Ok(bytes)
    }

    /// Empties every shard (a reset, with `shards` the locked shards).
    pub(super) fn clear_stream_shards(
        &self,
        shards: &mut [crate::sync::MutexGuard<'_, StreamLists>],
    ) {
        for lists in shards.iter_mut() {
            for (_, fence) in std::mem::take(&mut lists.waiting) {
                self.fences.recycle(fence);
            }
            **lists = StreamLists::default();
        }
    }
}
