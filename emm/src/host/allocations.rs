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
//!
//! A plain device allocation's pointer (no streams, no owner) is released through
//! [`AllocationOwner::park`]: under the same lock its free is queued and its record (the box
//! with the reference count, and the pointer's clone of the table) is kept in the table, up to
//! [`PARKED`] of them, stamped with a generation no table reaches so that it releases nothing
//! if it is dropped rather than reused. The next device allocation takes it and sets the
//! address, size, key and generation ([`ParkedPointer::revive_tracked`]): no record to find,
//! no clone of the table to make or drop. The records go when the manager does
//! ([`AllocationTable::close`]), since each keeps the table alive.

use std::sync::Arc;

use driver_sys::{DevicePtr, HostPtr};

use crate::contract::factory::ManagerContext;
use crate::contract::snapshot::{BlockState, HeldSegment, SegmentKind};
use crate::error::EmmError;
use crate::host::fences::{Fence, Fences};
use crate::host::pinned_pool::{PinnedBlock, PinnedPool};
use crate::memory::host::HostOwner;
use crate::memory::pending::{Free, PendingDeallocs};
use crate::memory::pointer::{
    AllocationOwner, ParkedPointer, StreamRecord, StreamUse, into_stream_use,
};
use crate::slab::Slab;
use crate::sync::{AtomicU64, AtomicUsize, Mutex, Ordering, RwLock, lock};

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

/// The most records of released pointers a table keeps for its next allocations
/// ([`AllocationOwner::park`]): 128 bytes each.
const PARKED: usize = 64;

/// What the table's lock guards.
#[derive(Default)]
struct Live {
    /// The live entries; a pointer keeps its entry's index, so that recording and releasing
    /// one hashes nothing on the default manager's pair.
    entries: Slab<Entry>,
    /// Records of plain device allocations whose last pointer dropped, each holding a clone
    /// of the table, revived by the next device allocations: no record to find on the
    /// thread's spare list, no clone of the table to make, no value to fill.
    parked: Vec<ParkedPointer>,
    /// True once the manager is gone ([`AllocationTable::close`]): nothing is parked then,
    /// since a parked record's clone would keep the table alive.
    closed: bool,
}

impl std::fmt::Debug for Live {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Live")
            .field("entries", &self.entries)
            .field("parked", &self.parked.len())
            .field("closed", &self.closed)
            .finish()
    }
}

/// Live allocations of one manager, and the queue their frees go to.
#[derive(Debug)]
pub(crate) struct AllocationTable {
    cx: ManagerContext,
    /// The live entries and the parked records.
    table: Mutex<Live>,
    generation: AtomicU64,
    queue: Arc<PendingDeallocs>,
    fences: Fences,
    /// Stream-ordered device allocations whose last pointer dropped: (key, generation, the
    /// fence recorded on their streams at the drop). They stay in the table (a reset frees
    /// them) until the fence is done; then their `cuMemFree` is queued.
    waiting: Mutex<std::collections::VecDeque<(u64, u64, Fence)>>,
    waiting_count: AtomicUsize,
    /// Held shared by host-side reads and writes of tracked memory (mapped, managed) while
    /// they copy, and exclusively by a reset while it bumps the generation: a reset never
    /// frees memory under an access, and an access after the bump sees it and is refused.
    host_access: RwLock<()>,
}

impl AllocationTable {
    pub(crate) fn new(cx: &ManagerContext) -> AllocationTable {
        AllocationTable {
            cx: cx.clone(),
            table: Mutex::new(Live::default()),
            generation: AtomicU64::new(0),
            queue: Arc::new(cx.new_pending_deallocs()),
            fences: Fences::new(cx),
            waiting: Mutex::new(std::collections::VecDeque::new()),
            waiting_count: AtomicUsize::new(0),
            host_access: RwLock::new(()),
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

    /// Queues the `cuMemFree` of every waiting stream-ordered allocation whose streams are
    /// done, looking at each of them once, without waiting (a trim's poll). Returns how many
    /// were queued. The caller holds the context's liveness.
    pub(crate) fn poll_every_stream_free(&self) -> Result<usize, EmmError> {
        if self.waiting_for_streams() == 0 {
            return Ok(0);
        }
        self.poll_some(false, usize::MAX)
    }

    /// [`poll_stream_frees`](Self::poll_stream_frees) once some are waiting (out of line: an
    /// allocation with none waiting pays one atomic load).
    #[inline(never)]
    fn poll_waiting(&self, wait: bool) -> Result<usize, EmmError> {
        self.poll_some(wait, if wait { usize::MAX } else { POLL_BATCH })
    }

    /// Looks at up to `most` waiting frees, oldest first (waiting for each with `wait`), and
    /// queues those done.
    fn poll_some(&self, wait: bool, most: usize) -> Result<usize, EmmError> {
        let done = {
            let mut waiting = lock(&self.waiting);
            let mut done = Vec::new();
            let looks = waiting.len().min(most);
            for _ in 0..looks {
                let mut entry = waiting.pop_front().expect("counted");
                match self.fences.finished(&mut entry.2, wait) {
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
                if let Some(Entry::Device { ptr, bytes }) = table.entries.remove(key as u32) {
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
        (u64::from(table.entries.insert(entry)), self.generation())
    }

    /// Records a new device allocation of `bytes` at `ptr`, and takes a parked record for its
    /// pointer if the table keeps one ([`ParkedPointer::revive_tracked`]).
    #[inline(always)]
    pub(crate) fn record_device(
        &self,
        ptr: DevicePtr,
        bytes: usize,
    ) -> ((u64, u64), Option<ParkedPointer>) {
        let mut table = lock(&self.table);
        let key = table.entries.insert(Entry::Device { ptr, bytes });
        ((u64::from(key), self.generation()), table.parked.pop())
    }

    /// The live device allocations as segments of one block each: in use, or waiting for the
    /// streams that used them (a stream-ordered free not yet queued).
    pub(crate) fn device_segments(&self) -> Vec<HeldSegment> {
        let waiting: Vec<u64> = lock(&self.waiting).iter().map(|w| w.0).collect();
        let table = lock(&self.table);
        let mut out = Vec::with_capacity(table.entries.len());
        for (key, entry) in table.entries.iter_indexed() {
            if let Entry::Device { ptr, bytes } = entry {
                let state = if waiting.contains(&u64::from(key)) {
                    BlockState::PendingFree
                } else {
                    BlockState::InUse
                };
                out.push(HeldSegment::whole(
                    ptr.0,
                    *bytes,
                    SegmentKind::DriverAllocation,
                    state,
                ));
            }
        }
        out
    }

    /// Number of live tracked allocations.
    pub(crate) fn live(&self) -> usize {
        lock(&self.table).entries.len()
    }

    /// The manager is gone: the parked records go (each holds a clone of the table, which
    /// would otherwise keep itself alive), and none is parked from now on.
    pub(crate) fn close(&self) {
        let parked = {
            let mut table = lock(&self.table);
            table.closed = true;
            std::mem::take(&mut table.parked)
        };
        // Dropped with no lock held: each was stamped released when parked, and releases
        // nothing.
        drop(parked);
    }

    /// [`AllocationOwner::park`]: the entry under `key` is a plain device allocation of this
    /// generation, so its free is queued and the record kept, if there is room.
    fn park(&self, mut record: ParkedPointer, key: u64, generation: u64) -> Option<ParkedPointer> {
        let flush = {
            let mut table = lock(&self.table);
            if table.parked.len() >= PARKED || table.closed || self.generation() != generation {
                return Some(record);
            }
            let Some(Entry::Device { ptr, bytes }) = table.entries.get(key as u32) else {
                return Some(record);
            };
            let free = Free::Device {
                ptr: *ptr,
                bytes: *bytes,
            };
            table.entries.discard(key as u32);
            record.mark_released();
            table.parked.push(record);
            // Appended under the table's lock, as `release` does.
            self.queue.push_one_without_flush(free)
        };
        if flush {
            self.queue.apply_thresholds_from_drop();
        }
        None
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
                && matches!(table.entries.get(key as u32), Some(Entry::Device { .. }))
            {
                drop(table);
                return self.release_after_streams(key, generation, into_stream_use(*streams));
            }
            match table.entries.remove(key as u32) {
                Some(Entry::Device { ptr, bytes }) => (
                    None,
                    self.queue
                        .push_one_without_flush(Free::Device { ptr, bytes }),
                ),
                Some(Entry::Host { ptr, bytes }) => (
                    None,
                    self.queue.push_one_without_flush(Free::Host { ptr, bytes }),
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
            {
                // No host-side access is in flight once this is held; those that come after
                // see the new generation.
                let _accesses = self
                    .host_access
                    .write()
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
                self.generation.fetch_add(1, Ordering::AcqRel);
            }
            // Waiting stream-ordered frees are in the table: freed with the rest.
            for (_, _, fence) in std::mem::take(&mut *lock(&self.waiting)) {
                self.fences.recycle(fence);
            }
            self.waiting_count.store(0, Ordering::Release);
            let n = table.entries.len();
            let frees = table.entries.drain().filter_map(|e| match e {
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

// SAFETY: `park` keeps the record it is offered or hands it back; it drops it on no path.
unsafe impl AllocationOwner for AllocationTable {
    fn release(&self, key: u64, generation: u64, streams: Option<StreamRecord>) {
        AllocationTable::release(self, key, generation, streams);
    }

    fn generation(&self) -> u64 {
        AllocationTable::generation(self)
    }

    fn keep_while(&self, generation: u64, access: &mut dyn FnMut()) -> bool {
        let _access = self
            .host_access
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let live = self.generation() == generation;
        if live {
            access();
        }
        live
    }

    fn park(&self, record: ParkedPointer, key: u64, generation: u64) -> Option<ParkedPointer> {
        AllocationTable::park(self, record, key, generation)
    }
}

#[cfg(all(test, not(emm_loom)))]
mod tests {
    use std::sync::Weak;

    use super::*;
    use crate::host::HostLayer;
    use crate::memory::pointer::MemoryPointer;

    /// A host layer on a simulated GPU, and a weak reference to its table.
    fn layer() -> (HostLayer, Weak<AllocationTable>) {
        let host = HostLayer::new(&ManagerContext::simulated(None));
        let table = Arc::downgrade(&host.table);
        (host, table)
    }

    /// `cuMemAlloc` of `bytes`, tracked by `host`.
    fn device(host: &HostLayer, bytes: usize) -> MemoryPointer {
        let cx = host.context().clone();
        let base = host
            .attempt_allocation(
                "memalloc",
                crate::host::AllocationKind::Device,
                bytes,
                || cx.driver.mem_alloc(cx.context, bytes),
            )
            .expect("device memory");
        // SAFETY: `base` was just allocated with `cuMemAlloc` for `bytes` bytes.
        unsafe { host.track_device_allocation(base, bytes) }
    }

    fn parked(table: &Weak<AllocationTable>) -> usize {
        lock(&table.upgrade().expect("the table").table)
            .parked
            .len()
    }

    /// Free device memory as the driver counts it.
    fn free_bytes(host: &HostLayer) -> usize {
        let cx = host.context();
        cx.driver
            .mem_get_info(cx.context)
            .expect("memory info")
            .free
    }

    #[test]
    fn a_released_pointers_record_serves_the_next_allocation_and_goes_with_the_layer() {
        let (host, table) = layer();
        let empty = free_bytes(&host);
        assert_eq!(table.strong_count(), 1, "the layer's");
        let first = device(&host, 4096);
        assert_eq!(table.strong_count(), 2, "the pointer's clone");
        drop(first);
        assert_eq!(parked(&table), 1, "the record is kept, with its clone");
        assert_eq!(table.strong_count(), 2);
        assert_eq!(host.live_allocations(), 0, "the entry is released");
        for _ in 0..20 {
            let again = device(&host, 256);
            assert_eq!(
                parked(&table),
                0,
                "the parked record went to the new pointer"
            );
            assert!(again.is_live());
            assert_eq!(again.size(), 256);
            drop(again);
            assert_eq!(table.strong_count(), 2, "no clone made or dropped");
        }
        host.deallocations().flush().expect("flush");
        assert_eq!(free_bytes(&host), empty, "every block freed once");
        drop(host);
        assert_eq!(
            table.strong_count(),
            0,
            "the layer's drop let the parked record go"
        );
    }

    #[test]
    fn a_parked_record_releases_nothing_when_it_goes() {
        let (host, table) = layer();
        drop(device(&host, 4096));
        assert_eq!(parked(&table), 1);
        // A stream-ordered allocation takes no parked record, and gets the entry the parked
        // record's pointer had.
        let cx = host.context().clone();
        let stream = cx
            .driver
            .stream_create(cx.context, 0)
            .expect("a simulated stream");
        let base = cx
            .driver
            .mem_alloc(cx.context, 8192)
            .expect("device memory");
        // SAFETY: `base` was just allocated with `cuMemAlloc` for 8192 bytes.
        let ordered = unsafe { host.track_device_allocation_on(base, 8192, stream) };
        assert_eq!(parked(&table), 1);
        drop(host); // the parked record goes
        assert_eq!(table.strong_count(), 1, "the stream-ordered pointer's");
        let live = table.upgrade().expect("the table").live();
        assert_eq!(live, 1, "the entry of the same key is still there");
        drop(ordered); // released through the table, whose manager is gone: no parking
        assert_eq!(table.strong_count(), 0, "nothing keeps the table");
    }

    #[test]
    fn a_revived_record_carries_the_generation_after_a_reset() {
        let (host, table) = layer();
        drop(device(&host, 4096));
        assert_eq!(parked(&table), 1);
        host.reset().expect("reset");
        let after = device(&host, 4096);
        assert_eq!(parked(&table), 0, "revived");
        assert!(after.is_live(), "stamped with the new generation");
        drop(after);
        assert_eq!(parked(&table), 1, "parked again: its generation matched");
        assert_eq!(host.live_allocations(), 0);
    }

    #[test]
    fn the_table_keeps_a_bounded_number_of_records() {
        let (host, table) = layer();
        let empty = free_bytes(&host);
        let held: Vec<_> = (0..PARKED + 10).map(|_| device(&host, 512)).collect();
        assert_eq!(table.strong_count(), 1 + PARKED + 10);
        drop(held);
        assert_eq!(parked(&table), PARKED, "bounded");
        assert_eq!(table.strong_count(), 1 + PARKED);
        assert_eq!(host.live_allocations(), 0, "every entry released");
        host.deallocations().flush().expect("flush");
        assert_eq!(free_bytes(&host), empty);
    }
}
