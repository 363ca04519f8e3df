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

use std::collections::{BTreeMap, HashMap};

use driver_sys::{DevicePtr, StreamHandle};

use super::{PoolShared, block_size};
use crate::error::EmmError;
use crate::host::fences::Fence;
use crate::memory::host::HostOwner;
use crate::memory::pointer::{ReleaseHook, StreamUse};
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

/// Blocks of stream-ordered allocations.
#[derive(Default)]
pub(super) struct StreamLists {
    /// Per stream: its free blocks.
    pub(super) per_stream: HashMap<u64, PerStream>,
    /// Blocks that go back to the arena once their fence is done.
    pub(super) waiting: Vec<(Vec<(u64, usize)>, Fence)>,
    pub(super) in_use_blocks: usize,
    pub(super) in_use_bytes: usize,
    /// Bytes on the lists and waiting.
    pub(super) cached_bytes: usize,
}

/// The pool's stream-ordered state, on its own lock (taken before the arena's).
pub(super) struct StreamCache {
    pub(super) inner: Mutex<StreamLists>,
}

/// The release hook of stream-ordered pool pointers.
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

impl PoolShared {
    /// A block of `size` bytes freed earlier on `stream`, if its list has one.
    pub(super) fn take_on_stream(&self, stream: StreamHandle, size: usize) -> Option<(u64, u64)> {
        let mut lists = lock(&self.streams.inner);
        let list = lists.per_stream.get_mut(&stream.0)?.blocks.get_mut(&size)?;
        let addr = list.pop()?;
        lists.cached_bytes -= size;
        lists.in_use_blocks += 1;
        lists.in_use_bytes += size;
        Some((addr, self.generation.load(Ordering::Acquire)))
    }

    /// Counts a block taken from the arena for a stream-ordered allocation.
    pub(super) fn count_stream_block(&self, size: usize, generation: u64) {
        let mut lists = lock(&self.streams.inner);
        if self.generation.load(Ordering::Acquire) == generation {
            lists.in_use_blocks += 1;
            lists.in_use_bytes += size;
        }
    }

    fn release_on_streams(&self, addr: u64, bytes: usize, tag: u64, streams: StreamUse) {
        let size = block_size(bytes, self.config.small_max);
        let mut lists = lock(&self.streams.inner);
        if self.generation.load(Ordering::Acquire) != tag {
            return;
        }
        lists.in_use_blocks -= 1;
        lists.in_use_bytes -= size;
        lists.cached_bytes += size;
        if streams.other_streams().next().is_none() {
            let list = lists.per_stream.entry(streams.free_on.0).or_default();
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

    /// Puts every stream's list behind a fence on that stream (all but `keep`'s), then returns
    /// the blocks whose fences are done to the arena; with `wait`, waits for every fence.
    /// Returns the bytes returned to the arena. Fences are recorded and queried under the
    /// stream lock; the arena's lock is taken after it.
    pub(super) fn reclaim_stream_blocks(
        &self,
        keep: Option<StreamHandle>,
        wait: bool,
    ) -> Result<usize, EmmError> {
        let mut lists = lock(&self.streams.inner);
        if lists.cached_bytes == 0 {
            return Ok(0);
        }
        let generation = self.generation.load(Ordering::Acquire);
        let err = |e| EmmError::driver("reclaiming stream-ordered blocks", self.cx.device, e);
        let streams: Vec<u64> = lists
            .per_stream
            .iter()
            .filter(|(s, l)| {
                Some(**s) != keep.map(|k| k.0) && l.blocks.values().any(|v| !v.is_empty())
            })
            .map(|(s, _)| *s)
            .collect();
        let mut idle = Vec::new();
        for s in streams {
            let list = lists.per_stream.remove(&s).expect("listed above");
            let blocks: Vec<(u64, usize)> = list
                .blocks
                .iter()
                .flat_map(|(&size, addrs)| addrs.iter().map(move |&a| (a, size)))
                .collect();
            // A stream with nothing pending has no work left on its blocks.
            let fenced = match self
                .cx
                .driver
                .stream_query(self.cx.context, StreamHandle(s))
            {
                Ok(true) => {
                    idle.extend(blocks);
                    continue;
                }
                Ok(false) => self.fences.record([StreamHandle(s)]),
                Err(e) => Err(e),
            };
            match fenced {
                // The stream may go now: the fence holds its place in the work.
                Ok(fence) => lists.waiting.push((blocks, fence)),
                Err(e) => {
                    // Put them back: nothing is lost, nothing is reused early.
                    lists.per_stream.insert(s, list);
                    return Err(err(e));
                }
            }
        }
        let mut done = Vec::new();
        let mut k = 0;
        while k < lists.waiting.len() {
            let fence = &lists.waiting[k].1;
            let finished = if wait {
                self.fences.wait(fence).map(|()| true)
            } else {
                self.fences.is_done(fence)
            }
            .map_err(err)?;
            if finished {
                done.push(lists.waiting.swap_remove(k));
            } else {
                k += 1;
            }
        }
        let mut bytes = 0;
        {
            let mut arena = lock(&self.arena);
            for (a, size) in idle {
                if arena.generation == generation {
                    arena.give(a, size);
                }
                bytes += size;
            }
            for (blocks, fence) in done {
                self.fences.recycle(fence);
                for (a, size) in blocks {
                    if arena.generation == generation {
                        arena.give(a, size);
                    }
                    bytes += size;
                }
            }
        }
        lists.cached_bytes -= bytes;
        if bytes > 0 {
            tracing::debug!(device = %self.cx.device, bytes, wait, "stream-ordered blocks back in the pool");
        }
        Ok(bytes)
    }
}
