//! [`DeviceTracker`]: a built-in manager's table of live device allocations.
//!
//! Numba's managers keep `allocations`, a dict of every live allocation, so that `reset` can
//! free them all. Here the table maps base address to size, and a generation number makes
//! pointers that outlive a reset harmless:
//!
//! 1. `memalloc` records the allocation and stamps the pointer with the current generation.
//! 2. When the last pointer drops, its allocation is removed from the table and a
//!    [`Free::Device`] is queued, if the generation still matches.
//! 3. `reset` bumps the generation and queues a free for everything in the table, then flushes.
//!    Pointers stamped with the old generation release nothing when they drop later, so nothing
//!    is freed twice.

use std::collections::BTreeMap;
use std::sync::Arc;

use driver_sys::DevicePtr;

use crate::EmmError;
use crate::pending::{Free, PendingDeallocs};
use crate::sync::{AtomicU64, Mutex, Ordering, lock};

/// Live allocations of one manager, and the queue their frees go to.
#[derive(Debug)]
pub(crate) struct DeviceTracker {
    allocations: Mutex<BTreeMap<DevicePtr, usize>>,
    generation: AtomicU64,
    queue: Arc<PendingDeallocs>,
}

impl DeviceTracker {
    pub(crate) fn new(queue: Arc<PendingDeallocs>) -> DeviceTracker {
        DeviceTracker {
            allocations: Mutex::new(BTreeMap::new()),
            generation: AtomicU64::new(0),
            queue,
        }
    }

    pub(crate) fn queue(&self) -> &Arc<PendingDeallocs> {
        &self.queue
    }

    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Records a new allocation; returns the generation to stamp its pointer with.
    pub(crate) fn record(&self, base: DevicePtr, size: usize) -> u64 {
        let mut table = lock(&self.allocations);
        let previous = table.insert(base, size);
        debug_assert!(
            previous.is_none(),
            "the driver returned {base} twice without a free"
        );
        self.generation()
    }

    /// Number of live allocations.
    pub(crate) fn live(&self) -> usize {
        lock(&self.allocations).len()
    }

    /// The last pointer to `base` dropped.
    ///
    /// The free is queued while the table is still locked, so a concurrent `reset` finds the
    /// allocation either in the table or in the queue, never in neither; the thresholds (and
    /// any flush they trigger) are applied after the table is unlocked.
    pub(crate) fn release(&self, base: DevicePtr, size: usize, generation: u64) {
        {
            let mut table = lock(&self.allocations);
            if self.generation() != generation {
                // A reset already freed it.
                return;
            }
            table.remove(&base);
            self.queue.push_all_without_flush([Free::Device {
                ptr: base,
                bytes: size,
            }]);
        }
        self.queue.apply_thresholds_from_drop();
    }

    /// Forgets every allocation and queues its free, then flushes (Numba: `allocations.clear()`
    /// then `deallocations.clear()`). Inside `defer_cleanup` the frees stay queued.
    pub(crate) fn reset(&self) -> Result<usize, EmmError> {
        let drained: Vec<Free> = {
            let mut table = lock(&self.allocations);
            self.generation.fetch_add(1, Ordering::AcqRel);
            std::mem::take(&mut *table)
                .into_iter()
                .map(|(ptr, bytes)| Free::Device { ptr, bytes })
                .collect()
        };
        let n = drained.len();
        // Queue everything first, then flush once: a threshold crossed half way must not flush
        // a partial list and leave the rest to a later caller.
        self.queue.push_all_without_flush(drained);
        self.queue.flush()?;
        Ok(n)
    }
}
