//! [`AllocationTable`]: a manager's table of live allocations (Numba's `allocations`).
//!
//! The table holds every allocation a reset must free: device memory, mapped host memory and
//! mapped pinned ranges (unmapped pinned memory is not tracked, as in Numba). Each entry knows
//! how it is released, and a generation number makes pointers that outlive a reset harmless:
//!
//! 1. An allocation is recorded in a slot of the table, and its pointer keeps the slot's index
//!    and the table's current generation.
//! 2. When the last pointer drops, the entry is removed and released, if the generation still
//!    matches: device and host frees are queued (the queue is appended under the table's lock,
//!    so a racing reset finds the entry in one place or the other, never in neither); an unpin
//!    is done at once (Numba: pinning the same memory again must work right away).
//! 3. `reset` bumps the generation, releases every entry, then flushes. Pointers stamped with
//!    the old generation release nothing when they drop later, so nothing is freed twice.

use std::sync::Arc;

use driver_sys::{DevicePtr, HostPtr};

use crate::contract::factory::ManagerContext;
use crate::error::EmmError;
use crate::host::fences::{Fence, Fences};
use crate::host::pinned_pool::{PinnedBlock, PinnedPool};
use crate::memory::host::HostOwner;
use crate::memory::pending::{Free, PendingDeallocs};
use crate::memory::pointer::{AllocationOwner, StreamRecord, StreamUse, into_stream_use};
use crate::slab::Slab;
use crate::sync::{AtomicU64, AtomicUsize, Mutex, Ordering, lock};

/// How a tracked allocation is released.
#[derive(Clone)]
pub(crate) enum Entry {
    /// `cuMemFree`, deferred.
    Device { ptr: DevicePtr, bytes: usize },
    /// `cuMemFreeHost` of mapped pinned memory, deferred.
    Host { ptr: HostPtr, bytes: usize },
    /// `cuMemHostUnregister` of a mapped pinned range, at once. The entry keeps the range's
    /// owner alive until the unpin is done: were the buffer freed first, a new one could be
    /// allocated at the same address and fail to pin while the old registration lingers.
    Unpin { ptr: HostPtr, owner: HostOwner },
    /// Mapped memory from the pinned host pool: returned to the pool when released, freed
    /// (`cuMemFreeHost`, deferred) by a reset.
    Pooled {
        block: PinnedBlock,
        generation: u64,
        pool: Arc<PinnedPool>,
    },
}

impl std::fmt::Debug for Entry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Entry::Device { ptr, bytes } => write!(f, "Device({ptr}, {bytes})"),
            Entry::Host { ptr, bytes } => write!(f, "Host({ptr}, {bytes})"),
            Entry::Unpin { ptr, .. } => write!(f, "Unpin({ptr})"),
            Entry::Pooled { block, .. } => write!(f, "Pooled({}, {})", block.host, block.size),
        }
    }
}

/// How many waiting stream-ordered frees one allocation looks at.
const POLL_BATCH: usize = 8;

/// Live allocations of one manager, and the queue their frees go to.
#[derive(Debug)]
pub(crate) struct AllocationTable {
    cx: ManagerContext,
    /// The live entries; a pointer keeps its entry's index (recording and releasing one
    /// hashes nothing: the default manager's pair spent about 100 instructions hashing).
    table: Mutex<Slab<Entry>>,
    generation: AtomicU64,
    queue: Arc<PendingDeallocs>,
    fences: Fences,
    /// Stream-ordered device allocations whose last pointer dropped: (key, generation, the
    /// fence recorded on their streams at the drop). They stay in the table (a reset frees
    /// them) until the fence is done; then their `cuMemFree` is queued.
    waiting: Mutex<std::collections::VecDeque<(u64, u64, Fence)>>,
    waiting_count: AtomicUsize,
}

impl AllocationTable {
    pub(crate) fn new(cx: &ManagerContext) -> AllocationTable {
        AllocationTable {
            cx: cx.clone(),
            table: Mutex::new(Slab::default()),
            generation: AtomicU64::new(0),
            queue: Arc::new(cx.new_pending_deallocs()),
            fences: Fences::new(cx),
            waiting: Mutex::new(std::collections::VecDeque::new()),
            waiting_count: AtomicUsize::new(0),
        }
    }

    /// Stream-ordered frees waiting for their streams.
    pub(crate) fn waiting_for_streams(&self) -> usize {
        self.waiting_count.load(Ordering::Acquire)
    }

    /// The last pointer to the stream-ordered device allocation under `key` dropped: a fence
    /// goes on the streams that used it, and the entry waits for it in the table.
    fn release_after_streams(&self, key: u64, generation: u64, streams: StreamUse) {
        let Some(_live) = self.cx.liveness.enter() else {
            return; // the context is gone, and its memory with it
        };
        let on = std::iter::once(streams.free_on).chain(streams.other_streams());
        match self.fences.record(on) {
            Ok(fence) => {
                lock(&self.waiting).push_back((key, generation, fence));
                self.waiting_count.fetch_add(1, Ordering::AcqRel);
            }
            Err(e) => {
                // Without a fence the block cannot be known to be unused: it stays in the
                // table, and the manager's reset frees it.
                tracing::error!(device = %self.cx.device, error = %e, ptr = key, "recording the streams of a stream-ordered free failed; the memory is kept until the manager's reset");
                self.queue.record_error(crate::error::EmmError::driver(
                    "free on a stream",
                    self.cx.device,
                    e,
                ));
            }
        }
    }

    /// Queues the `cuMemFree` of waiting stream-ordered allocations whose streams are done:
    /// without `wait`, looks at up to [`POLL_BATCH`] of them, oldest first, and puts those
    /// not done at the back (so a stream held up for long costs each allocation a bounded
    /// number of queries, and the others still get their turn); with `wait`, waits for all
    /// of them (out of memory: the frees are needed). Returns how many were queued. The
    /// caller holds the context's liveness.
    #[inline]
    pub(crate) fn poll_stream_frees(&self, wait: bool) -> Result<usize, EmmError> {
        if self.waiting_for_streams() == 0 {
            return Ok(0);
        }
        self.poll_waiting(wait)
    }

    /// [`poll_stream_frees`](Self::poll_stream_frees) once some are waiting (out of line: an
    /// allocation with none waiting pays one atomic load).
    #[inline(never)]
    fn poll_waiting(&self, wait: bool) -> Result<usize, EmmError> {
        let done = {
            let mut waiting = lock(&self.waiting);
            let mut done = Vec::new();
            let looks = if wait {
                waiting.len()
            } else {
                waiting.len().min(POLL_BATCH)
            };
            for _ in 0..looks {
                let entry = waiting.pop_front().expect("counted");
                match self.fences.finished(&entry.2, wait) {
                    Ok(true) => done.push(entry),
                    Ok(false) => waiting.push_back(entry),
                    Err(e) => {
                        waiting.push_back(entry);
                        self.waiting_count.store(waiting.len(), Ordering::Release);
                        return Err(crate::error::EmmError::driver(
                            "free on a stream",
                            self.cx.device,
                            e,
                        ));
                    }
                }
            }
            self.waiting_count.store(waiting.len(), Ordering::Release);
            done
        };
        let mut frees = Vec::with_capacity(done.len());
        {
            let mut table = lock(&self.table);
            for (key, generation, fence) in done {
                self.fences.recycle(fence);
                if self.generation() != generation {
                    continue; // a reset freed it
                }
                if let Some(Entry::Device { ptr, bytes }) = table.remove(key as u32) {
                    frees.push(Free::Device { ptr, bytes });
                }
            }
            // Appended under the table's lock, as `release` does.
            self.queue.push_all_without_flush(frees.iter().cloned());
        }
        if !frees.is_empty() {
            tracing::debug!(device = %self.cx.device, frees = frees.len(), "stream-ordered frees done on their streams; queued");
            self.queue.apply_thresholds_from_drop();
        }
        Ok(frees.len())
    }

    pub(crate) fn queue(&self) -> &Arc<PendingDeallocs> {
        &self.queue
    }

    pub(crate) fn context(&self) -> &ManagerContext {
        &self.cx
    }

    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Records a new allocation; returns its key and the generation to stamp its pointer with.
    pub(crate) fn record(&self, entry: Entry) -> (u64, u64) {
        let mut table = lock(&self.table);
        (u64::from(table.insert(entry)), self.generation())
    }

    /// Number of live tracked allocations.
    pub(crate) fn live(&self) -> usize {
        lock(&self.table).len()
    }

    /// The last pointer to the allocation under `key` dropped.
    pub(crate) fn release(&self, key: u64, generation: u64, streams: Option<StreamRecord>) {
        let (unpin, flush) = {
            let mut table = lock(&self.table);
            if self.generation() != generation {
                // A reset already released it.
                return;
            }
            if let Some(streams) = streams
                && matches!(table.get(key as u32), Some(Entry::Device { .. }))
            {
                drop(table);
                return self.release_after_streams(key, generation, into_stream_use(*streams));
            }
            match table.remove(key as u32) {
                Some(Entry::Device { ptr, bytes }) => (
                    None,
                    self.queue
                        .push_all_without_flush(Some(Free::Device { ptr, bytes })),
                ),
                Some(Entry::Host { ptr, bytes }) => (
                    None,
                    self.queue
                        .push_all_without_flush(Some(Free::Host { ptr, bytes })),
                ),
                Some(Entry::Unpin { ptr, owner }) => (Some((ptr, owner)), false),
                Some(Entry::Pooled {
                    block,
                    generation,
                    pool,
                }) => (
                    None,
                    self.queue
                        .push_all_without_flush(pool.give_back(block, generation)),
                ),
                None => (None, false),
            }
        };
        if let Some((ptr, _owner)) = unpin {
            // The owner drops after the unpin.
            unpin_now(&self.cx, &self.queue, ptr);
        }
        // The queue lock is taken again only when a flush is due.
        if flush {
            self.queue.apply_thresholds_from_drop();
        }
    }

    /// Forgets every allocation and releases it, then flushes (Numba: `allocations.clear()`
    /// then `deallocations.clear()`). Inside `defer_cleanup` the frees stay queued (unpins
    /// happen at once regardless, as in Numba).
    pub(crate) fn reset(&self) -> Result<usize, EmmError> {
        let mut unpins = Vec::new();
        let n = {
            let mut table = lock(&self.table);
            self.generation.fetch_add(1, Ordering::AcqRel);
            // Waiting stream-ordered frees are in the table: freed with the rest.
            for (_, _, fence) in std::mem::take(&mut *lock(&self.waiting)) {
                self.fences.recycle(fence);
            }
            self.waiting_count.store(0, Ordering::Release);
            let n = table.len();
            let frees = table.drain().filter_map(|e| match e {
                Entry::Device { ptr, bytes } => Some(Free::Device { ptr, bytes }),
                Entry::Host { ptr, bytes } => Some(Free::Host { ptr, bytes }),
                Entry::Pooled { block, .. } => Some(Free::Host {
                    ptr: block.host,
                    bytes: block.size,
                }),
                Entry::Unpin { ptr, owner } => {
                    unpins.push((ptr, owner));
                    None
                }
            });
            // Queue everything first, then flush once: a threshold crossed half way must not
            // flush a partial list and leave the rest to a later caller.
            self.queue.push_all_without_flush(frees);
            n
        };
        let mut first_error = None;
        // Each owner drops only after its range is unpinned.
        for (ptr, _owner) in unpins {
            if let Err(e) = unpin(&self.cx, ptr) {
                first_error.get_or_insert(e);
            }
        }
        let flushed = self.queue.flush();
        if let Some(_live) = self.cx.liveness.enter() {
            self.fences.destroy_idle();
        }
        match first_error {
            Some(e) => Err(e),
            None => flushed.map(|_| n),
        }
    }
}

/// `cuMemHostUnregister` now, for a pin whose last owner dropped; an error cannot be returned
/// from a destructor, so it is recorded on the queue and returned by its next flush.
pub(crate) fn unpin_now(cx: &ManagerContext, queue: &PendingDeallocs, ptr: HostPtr) {
    if let Err(e) = unpin(cx, ptr) {
        tracing::error!(device = %cx.device, error = %e, "unpinning host memory failed; the error is returned by the next flush");
        queue.record_error(e);
    }
}

#[allow(unsafe_code)]
fn unpin(cx: &ManagerContext, ptr: HostPtr) -> Result<(), EmmError> {
    let Some(_live) = cx.liveness.enter() else {
        // The context is gone, and its registrations with it.
        return Ok(());
    };
    tracing::debug!(device = %cx.device, host = %ptr, "host memory unpinned");
    // SAFETY:
    // - `ptr` was registered by this manager and is unregistered once: its entry (or its
    //   `PinnedMemory`) is gone, so no other owner does it again;
    // - the last handle to the range dropped, so nothing uses the mapping afterwards;
    // - `_live` keeps the context alive during the call.
    unsafe { cx.driver.mem_host_unregister(cx.context, ptr) }
        .map_err(|e| EmmError::driver("unpin host memory", cx.device, e))
}

impl AllocationOwner for AllocationTable {
    fn release(&self, key: u64, generation: u64, streams: Option<StreamRecord>) {
        AllocationTable::release(self, key, generation, streams);
    }

    fn generation(&self) -> u64 {
        AllocationTable::generation(self)
    }
}
