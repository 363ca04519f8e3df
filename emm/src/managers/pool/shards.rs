//! The per-thread shards of size-class free lists, and the release hook that returns a
//! block to the shard it came from.

use std::sync::Arc;

use driver_sys::DevicePtr;

use super::{CLASSES, PoolShared};
use crate::memory::pointer::ReleaseHook;
use crate::sync::{Ordering, Spin};

/// One shard's free lists, on its own cache lines. The thread that owns the shard (see
/// [`thread_index`]) is almost always the only one to take its lock; others take it to free a
/// block allocated there, and `trim`, `reset` and `stats` to see or reclaim every block.
#[repr(align(128))]
pub(super) struct Shard {
    pub(super) inner: Spin<ShardLists>,
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

/// Dense per-thread indices: a thread claims the lowest free slot the first time it uses a pool
/// and gives it back when it exits, so that the live threads hold distinct indices (below their
/// number) however many threads came and went, and two live threads share a shard only when
/// there are more of them than shards. Only spreads threads over shards, never a
/// synchronisation point for the pool's data, so std atomics even under loom.
static SLOTS: [std::sync::atomic::AtomicU64; SLOT_WORDS] =
    [const { std::sync::atomic::AtomicU64::new(0) }; SLOT_WORDS];
const SLOT_WORDS: usize = 16;
/// Indices for threads beyond the slots' 1 024, handed out round-robin and never returned.
static OVERFLOW: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

struct Slot(Option<usize>);

impl Slot {
    fn claim() -> Slot {
        use std::sync::atomic::Ordering::Relaxed;
        for (w, word) in SLOTS.iter().enumerate() {
            let mut bits = word.load(Relaxed);
            while bits != u64::MAX {
                let bit = (!bits).trailing_zeros() as usize;
                match word.compare_exchange_weak(bits, bits | 1 << bit, Relaxed, Relaxed) {
                    Ok(_) => return Slot(Some(w * 64 + bit)),
                    Err(now) => bits = now,
                }
            }
        }
        Slot(None)
    }

    fn index(&self) -> usize {
        self.0
            .unwrap_or_else(|| OVERFLOW.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(i) = self.0 {
            SLOTS[i / 64].fetch_and(!(1 << (i % 64)), std::sync::atomic::Ordering::Relaxed);
        }
    }
}

thread_local! {
    static THREAD_SLOT: (Slot, usize) = {
        let slot = Slot::claim();
        let index = slot.index();
        (slot, index)
    };
}

/// This thread's index (0 while the thread is being torn down, after its slot was returned).
pub(super) fn thread_index() -> usize {
    THREAD_SLOT.try_with(|(_, i)| *i).unwrap_or(0)
}

pub(super) fn shard_count() -> usize {
    let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
    (cores * 2).next_power_of_two().clamp(4, 64)
}

#[cfg(all(test, not(emm_loom)))]
mod tests {
    use super::thread_index;

    /// Threads that come and go hand their index back: after hundreds of short-lived threads
    /// a new one still gets a low index (a counter would be past 300), and threads alive at
    /// once never share one.
    #[test]
    fn live_threads_hold_distinct_indices_however_many_came_and_went() {
        // Miri interprets every step: fewer threads there (still more than the 128 bound).
        let churn = if cfg!(miri) { 140 } else { 300 };
        let churned: Vec<usize> = (0..churn)
            .map(|_| std::thread::spawn(thread_index).join().expect("thread"))
            .collect();
        // Other tests' threads run beside this one and hold slots too, but far fewer than 128.
        assert!(churned.iter().all(|&i| i < 128), "{churned:?}");
        let barrier = std::sync::Barrier::new(8);
        let live: Vec<usize> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|_| {
                    s.spawn(|| {
                        let i = thread_index();
                        barrier.wait(); // all eight alive, each holding its slot
                        i
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("thread")).collect()
        });
        let mut distinct = live.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), 8, "{live:?}");
    }
}
