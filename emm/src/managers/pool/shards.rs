//! The per-thread shards of size-class free lists, and the release hook that returns a
//! block to the shard it came from.

use std::sync::Arc;

use driver_sys::DevicePtr;

use super::{CLASSES, PoolShared};
use crate::memory::pointer::ReleaseHook;
use crate::sync::{Mutex, Ordering};

/// One shard's free lists, on its own cache lines.
#[repr(align(128))]
pub(super) struct Shard {
    pub(super) inner: Mutex<ShardLists>,
}

#[derive(Default)]
pub(super) struct ShardLists {
    pub(super) free: Vec<Vec<u64>>,
    pub(super) cached_bytes: usize,
    /// Blocks and bytes handed out from or returned to this shard; a block allocated on one
    /// shard and returned to another makes both drift, their sums stay right.
    pub(super) in_use_blocks: i64,
    pub(super) in_use_bytes: i64,
}

impl ShardLists {
    pub(super) fn new() -> ShardLists {
        ShardLists {
            free: (0..CLASSES).map(|_| Vec::new()).collect(),
            ..ShardLists::default()
        }
    }
}

/// A shard's release hook: pointers allocated on shard `shard` return their blocks to it.
/// Aligned so that the reference counts of neighbouring shards' hooks do not share a cache
/// line (every allocation clones its shard's hook).
#[repr(align(128))]
pub(super) struct ShardHook {
    pub(super) pool: Arc<PoolShared>,
    pub(super) shard: usize,
}

impl ReleaseHook for ShardHook {
    fn release(&self, base: DevicePtr, size: usize, tag: u64) {
        self.pool.release(self.shard, base.0, size, tag);
    }

    fn is_live(&self, tag: u64) -> bool {
        self.pool.generation.load(Ordering::Acquire) == tag
    }
}

// Only spreads threads over shards; not a synchronisation point, so std even under loom.
static NEXT_THREAD: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

thread_local! {
    pub(super) static THREAD_INDEX: usize = NEXT_THREAD.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

pub(super) fn shard_count() -> usize {
    let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
    (cores * 2).next_power_of_two().clamp(4, 64)
}
