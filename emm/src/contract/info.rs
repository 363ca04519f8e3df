//! The plain data the contract's methods return: memory info, what pools hold, what a `stats`
//! adaptor counted, and the pinned host pool's tuning that a manager is built with.

use std::fmt;
use std::sync::Arc;

use driver_sys::DeviceOrdinal;

use crate::error::OutOfMemoryReport;
use crate::memory::liveness::ContextLiveness;
use crate::sync::{AtomicU64, Mutex, Ordering, lock};

/// Free and total device memory in bytes (Numba's `MemoryInfo(free, total)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct MemoryInfo {
    /// Bytes free.
    pub free: usize,
    /// Bytes in all.
    pub total: usize,
}

/// What a pool holds, at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Bytes held from the driver (all chunks).
    pub held_bytes: usize,
    /// Bytes in blocks handed out and not returned (block sizes, after rounding).
    pub in_use_bytes: usize,
    /// Blocks handed out and not returned.
    pub in_use_blocks: usize,
    /// Bytes of free blocks cached in per-thread shards (part of `held - in_use`).
    pub cached_bytes: usize,
    /// The most bytes ever held at once.
    pub peak_held_bytes: usize,
    /// Chunks held.
    pub chunks: usize,
    /// Times the pool grew (each growth is one or more driver allocations).
    pub grows: u64,
    /// Driver allocations the pool made for its memory: `cuMemAlloc` calls, or `cuMemCreate`
    /// calls under `vmm-pool` (one per piece mapped). Zero where the pool does not count them
    /// (the driver's own pools).
    pub driver_allocations: u64,
    /// Driver frees the pool made: `cuMemFree` calls, or `cuMemRelease` calls under
    /// `vmm-pool`. A `cuMemFree` returns only once every stream's work queued so far is done;
    /// `cuMemUnmap` and `cuMemRelease` do not wait for it.
    pub driver_frees: u64,
    /// Waits the pool queued on the GPU (`cuStreamWaitEvent`, one per stream waited for): a
    /// stream about to use memory that another stream freed, while that stream still had work
    /// queued, first waits for that work. The waiting stream's next work starts only once the
    /// other's work queued so far is done, so streams that could have overlapped did not. Zero
    /// where the pool does not count them (the driver's own pools, the pinned host pool).
    pub stream_waits: u64,
    /// Waits on the host the pool made for a stream's work to finish (`cuEventSynchronize`),
    /// before it gave back or moved memory that work may still use, or reclaimed blocks
    /// behind events out of memory. The allocating thread stops there until the GPU catches up.
    /// Zero where the pool does not count them.
    pub host_waits: u64,
    /// Bytes released to the driver by trims, out-of-memory retries and, in a pool that sheds
    /// its unused chunks before it grows, by growths (not by resets).
    pub trimmed_bytes: u64,
    /// The largest free block the pool holds: the largest request it can serve without
    /// growing (`None` where the pool cannot tell, as with the driver's own pools).
    pub largest_free_bytes: Option<usize>,
}

/// The free space of a manager's device pool, block by block, at one moment: what the pool can
/// hand out without asking the driver for more ([`Holdings::free_space`](crate::contract::Holdings::free_space)).
/// Blocks cached for reuse by one size class (per-thread caches) are listed at their size; the
/// pool merges them back with their neighbours before it grows.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FreeSpace {
    /// The sizes of the free blocks, largest first.
    pub blocks: Vec<usize>,
}

impl FreeSpace {
    /// Free space of blocks of these sizes.
    pub fn from_blocks(mut blocks: Vec<usize>) -> FreeSpace {
        blocks.retain(|&b| b > 0);
        blocks.sort_unstable_by(|a, b| b.cmp(a));
        FreeSpace { blocks }
    }

    /// Bytes of all free blocks.
    pub fn total_bytes(&self) -> usize {
        self.blocks.iter().sum()
    }

    /// The largest free block (0 when there is none).
    pub fn largest_bytes(&self) -> usize {
        self.blocks.first().copied().unwrap_or(0)
    }

    /// The share of the free bytes outside the largest free block, 0 to 1 (0 without free
    /// space): near 1, the free space is in pieces too small for large requests.
    pub fn fragmentation(&self) -> f64 {
        let total = self.total_bytes();
        if total == 0 {
            return 0.0;
        }
        1.0 - self.largest_bytes() as f64 / total as f64
    }

    /// Free bytes that requests of `size` bytes each cannot use: what is left of every block
    /// after as many such requests as it holds (every free byte, for a size of 0).
    pub fn unusable_for(&self, size: usize) -> usize {
        if size == 0 {
            return self.total_bytes();
        }
        self.blocks.iter().map(|&b| b % size).sum()
    }

    /// The free blocks by size, a bucket per power of two: `(upper, count, bytes)` for each
    /// bucket that holds a block, where the bucket holds sizes in `(upper / 2, upper]`,
    /// smallest first.
    pub fn histogram(&self) -> Vec<(usize, usize, usize)> {
        let mut out: Vec<(usize, usize, usize)> = Vec::new();
        for &b in self.blocks.iter().rev() {
            let upper = b.next_power_of_two();
            match out.last_mut() {
                Some(last) if last.0 == upper => {
                    last.1 += 1;
                    last.2 += b;
                }
                _ => out.push((upper, 1, b)),
            }
        }
        out
    }
}

/// What a manager's pools hold: its device pool and its pinned host pool, where it has them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolReport {
    /// The device memory pool.
    pub device: Option<PoolStats>,
    /// The pinned host memory pool.
    pub pinned_host: Option<PoolStats>,
}

impl PoolReport {
    /// Bytes held from the driver by all pools.
    pub fn held_bytes(&self) -> usize {
        self.device.map_or(0, |s| s.held_bytes) + self.pinned_host.map_or(0, |s| s.held_bytes)
    }
}

impl PoolStats {
    /// Bytes held but not in use: what a trim could give back at best.
    pub fn unused_bytes(&self) -> usize {
        self.held_bytes.saturating_sub(self.in_use_bytes)
    }
}

/// A context's out-of-memory callback: called with the bytes of a device allocation the
/// manager could not serve, after the manager's own retry; it may free memory (drop buffers,
/// empty caches of its own) and returns `true` to have the allocation tried again, `false` to
/// let it fail.
pub type OutOfMemoryCallback = dyn Fn(usize) -> bool + Send + Sync;

/// The most retries an out-of-memory callback may ask for, per allocation: a callback that
/// keeps answering `true` without freeing anything cannot hold an allocation in a loop.
pub const OUT_OF_MEMORY_RETRIES: u32 = 3;

/// What makes an out-of-memory error's report: given the bytes requested and the callback's
/// retries, the manager's figures (set by the context that owns the manager).
pub(crate) type Reporter = dyn Fn(usize, u32) -> OutOfMemoryReport + Send + Sync;

/// One context's out-of-memory events: its callback, and how often its device allocations ran
/// out of memory, counted by its host layer and pools (retries after freeing what they could)
/// and when a failure reached the caller. Shared by the context and its manager
/// ([`ManagerContext::events`](crate::contract::ManagerContext::events)); read and written only
/// on the paths an allocation takes once it has run out of memory.
#[derive(Default)]
pub struct AllocationEvents {
    retries: AtomicU64,
    ooms: AtomicU64,
    callback: Mutex<Option<Arc<OutOfMemoryCallback>>>,
    reporter: std::sync::OnceLock<Box<Reporter>>,
}

impl fmt::Debug for AllocationEvents {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AllocationEvents")
            .field("retries", &self.retries())
            .field("ooms", &self.ooms())
            .field("callback", &self.callback().is_some())
            .finish()
    }
}

impl AllocationEvents {
    /// An allocation ran out of memory and is tried again after memory was freed.
    pub fn retried(&self) {
        self.retries.fetch_add(1, Ordering::Relaxed);
    }

    /// A device allocation failed for lack of memory, after every retry.
    pub fn out_of_memory(&self) {
        self.ooms.fetch_add(1, Ordering::Relaxed);
    }

    /// Retries so far (PyTorch's `num_alloc_retries`).
    pub fn retries(&self) -> u64 {
        self.retries.load(Ordering::Relaxed)
    }

    /// Failures so far (PyTorch's `num_ooms`).
    pub fn ooms(&self) -> u64 {
        self.ooms.load(Ordering::Relaxed)
    }

    /// Sets (or, with `None`, removes) the out-of-memory callback.
    pub fn set_callback(&self, callback: Option<Arc<OutOfMemoryCallback>>) {
        *lock(&self.callback) = callback;
    }

    /// The out-of-memory callback, if one is set.
    pub fn callback(&self) -> Option<Arc<OutOfMemoryCallback>> {
        lock(&self.callback).clone()
    }

    /// Runs this callback for an allocation of `bytes` for `what` that ran out (of the
    /// device's memory, or of a limit's), unless this thread is inside the callback already
    /// in the context whose liveness is `liveness` (an allocation it makes would recurse):
    /// while the callback says it freed memory, counts a retry and calls `retry`, which tries
    /// the allocation again and says whether it is served now, at most
    /// [`OUT_OF_MEMORY_RETRIES`] times. Returns how many retries the callback asked for. The
    /// callback runs inside this call of the context
    /// ([`ContextLiveness::calling_back`]): a reset of its device from there is refused,
    /// where it would wait for this call.
    #[cold]
    #[inline(never)]
    pub(crate) fn call_back(
        &self,
        liveness: &ContextLiveness,
        device: DeviceOrdinal,
        what: &'static str,
        bytes: usize,
        retry: &mut dyn FnMut() -> bool,
    ) -> u32 {
        if liveness.called_back_here() {
            return 0;
        }
        let Some(callback) = self.callback() else {
            return 0;
        };
        let mut asked = 0;
        while asked < OUT_OF_MEMORY_RETRIES && {
            let _mark = liveness.calling_back();
            callback(bytes)
        } {
            asked += 1;
            self.retried();
            tracing::warn!(%device, what, bytes, retry = asked, "out of memory; the callback asked for a retry");
            if retry() {
                break;
            }
        }
        asked
    }

    /// Sets what makes the report of an out-of-memory error; the first call wins.
    pub(crate) fn set_reporter(&self, reporter: Box<Reporter>) {
        let _ = self.reporter.set(reporter);
    }

    /// The report of an out-of-memory error of a request of `requested` bytes after
    /// `callback_retries` retries the callback asked for (`None` where no context set a
    /// reporter: a manager used on its own).
    pub fn report(
        &self,
        requested: usize,
        callback_retries: u32,
    ) -> Option<Box<OutOfMemoryReport>> {
        self.reporter
            .get()
            .map(|r| Box::new(r(requested, callback_retries)))
    }
}

/// Which memory an event is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Device memory (`memalloc`).
    Device,
    /// Pinned host memory, not mapped (`memhostalloc`).
    Pinned,
    /// Mapped pinned host memory (`memhostalloc(mapped)`).
    Mapped,
    /// Pinned existing host memory (`mempin`).
    Pin,
    /// Managed memory (`memallocmanaged`).
    Managed,
}

impl MemoryKind {
    pub(crate) const ALL: [MemoryKind; 5] = [
        MemoryKind::Device,
        MemoryKind::Pinned,
        MemoryKind::Mapped,
        MemoryKind::Pin,
        MemoryKind::Managed,
    ];

    pub(crate) fn index(self) -> usize {
        self as usize
    }

    /// The name used in logs.
    pub fn name(self) -> &'static str {
        match self {
            MemoryKind::Device => "device",
            MemoryKind::Pinned => "pinned",
            MemoryKind::Mapped => "mapped",
            MemoryKind::Pin => "pin",
            MemoryKind::Managed => "managed",
        }
    }

    pub(crate) fn parse(s: &str) -> Option<MemoryKind> {
        MemoryKind::ALL.into_iter().find(|k| k.name() == s)
    }
}

/// Statistics of one kind of memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KindUsage {
    /// Bytes allocated and not freed.
    pub current_bytes: usize,
    /// The most `current_bytes` ever was.
    pub peak_bytes: usize,
    /// Bytes allocated in all.
    pub total_bytes: u64,
    /// Allocations not freed.
    pub current_count: usize,
    /// The most `current_count` ever was.
    pub peak_count: usize,
    /// Allocations in all.
    pub total_count: u64,
}

/// What a `stats` adaptor counted, per kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Device memory.
    pub device: KindUsage,
    /// Pinned host memory, not mapped.
    pub pinned: KindUsage,
    /// Mapped pinned host memory.
    pub mapped: KindUsage,
    /// Pinned existing host memory.
    pub pin: KindUsage,
    /// Managed memory.
    pub managed: KindUsage,
}

impl Usage {
    /// The statistics of `kind`.
    pub fn of(&self, kind: MemoryKind) -> &KindUsage {
        match kind {
            MemoryKind::Device => &self.device,
            MemoryKind::Pinned => &self.pinned,
            MemoryKind::Mapped => &self.mapped,
            MemoryKind::Pin => &self.pin,
            MemoryKind::Managed => &self.managed,
        }
    }
}

/// The pinned host pool's tuning.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PinnedPoolConfig {
    /// Larger requests bypass the pool. Default 64 MiB.
    pub max_block: usize,
    /// Bytes of free blocks the pool keeps at most. A block returned to a full cache is kept,
    /// and cached blocks are freed to make room for it: first those of the lists that hold the
    /// most bytes, those of the returned block's own size and kind last (so a program whose
    /// sizes change is not left calling the driver for every block of its new sizes). A block
    /// larger than this is freed when it returns. Default 256 MiB.
    pub max_cached: usize,
}

impl Default for PinnedPoolConfig {
    fn default() -> PinnedPoolConfig {
        PinnedPoolConfig {
            max_block: 64 << 20,
            max_cached: 256 << 20,
        }
    }
}
