//! Deferred deallocation (Numba's `_PendingDeallocs`).
#![allow(unsafe_code)]

use std::fmt;
use std::sync::Arc;

use driver_sys::{
    ContextHandle, DeviceOrdinal, DevicePtr, Driver, DriverError, EventHandle, HostPtr,
    ModuleHandle, StreamHandle,
};

use crate::error::EmmError;
use crate::memory::liveness::ContextLiveness;
use crate::memory::policy::DeallocConfig;
use crate::sync::{Mutex, lock};

/// One deferred driver call. Data, not a closure, so tests can compare queues.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Free {
    /// `cuMemFree` of a device allocation of `bytes` bytes.
    Device {
        /// The allocation's base address.
        ptr: DevicePtr,
        /// Its size, counted against the byte threshold.
        bytes: usize,
    },
    /// `cuMemFreeHost` of pinned host memory. Numba counts mapped memory by its size and
    /// unmapped pinned memory as 0 bytes.
    Host {
        /// The allocation's host address.
        ptr: HostPtr,
        /// Bytes counted against the byte threshold.
        bytes: usize,
    },
    /// `cuStreamDestroy` (the context's own queue).
    Stream(StreamHandle),
    /// `cuEventDestroy` (the context's own queue).
    Event(EventHandle),
    /// `cuModuleUnload` (the context's own queue).
    Module(ModuleHandle),
}

impl Free {
    /// Bytes this entry counts against the byte threshold.
    pub fn bytes(&self) -> usize {
        match self {
            Free::Device { bytes, .. } | Free::Host { bytes, .. } => *bytes,
            Free::Stream(_) | Free::Event(_) | Free::Module(_) => 0,
        }
    }

    fn execute(&self, driver: &dyn Driver, ctx: ContextHandle) -> Result<(), DriverError> {
        // SAFETY: for every arm of the match:
        // - an entry is queued exactly once, by the last owner of the resource (or by the
        //   manager's reset, which first removes it from the manager's table so no owner queues
        //   it again);
        // - nothing uses the resource afterwards: every handle to it is gone, or is stale and
        //   refused by emm before it reaches the driver;
        // - the caller holds a `LiveGuard`, so `ctx` is the context that created it.
        unsafe {
            match self {
                Free::Device { ptr, .. } => driver.mem_free(ctx, *ptr),
                Free::Host { ptr, .. } => driver.mem_free_host(ctx, *ptr),
                Free::Stream(s) => driver.stream_destroy(ctx, *s),
                Free::Event(e) => driver.event_destroy(ctx, *e),
                Free::Module(m) => driver.module_unload(ctx, *m),
            }
        }
    }
}

#[derive(Debug)]
struct Inner {
    /// The pending frees, oldest first (a `Vec`, not a `VecDeque`: a flush takes them all,
    /// and a push to a `Vec` is inlined where a `VecDeque`'s was a call).
    items: Vec<Free>,
    bytes: usize,
    disabled: usize,
    capacity: usize,
    /// `config.max_pending_bytes(capacity)`, worked out when the capacity is set rather than
    /// at every free.
    max_bytes: usize,
    recorded: Option<EmmError>,
    /// Frees the driver refused: out of the queue (Numba drops them), retried once when the
    /// context is torn down.
    failed: Vec<Free>,
}

/// A context's queue of deferred frees.
///
/// `cuMemFree` can synchronise the device, so frees are not sent to the driver when a pointer
/// drops: they are queued here, as data, and issued in batches.
///
/// # Life of a free
///
/// 1. The last clone of a [`MemoryPointer`](crate::memory::pointer::MemoryPointer) drops and pushes a [`Free`].
///    Nothing reaches the driver yet.
/// 2. [`PendingDeallocs::push`] flushes when the count is **greater than** `max_count` or the
///    pending bytes are **greater than** `floor(capacity * max_ratio)` (Numba: strict `>`;
///    numba-emm-spec §2). The capacity is 0 until the manager's first `initialize` sets it, so
///    before that any free of a known size flushes at once.
/// 3. [`PendingDeallocs::flush`] frees oldest first. If one free fails, that entry leaves the
///    queue, later entries **stay queued**, the byte count is not reset, and the error is
///    returned (Numba's code; its docs say otherwise, and the code wins). Unlike Numba, the
///    failed entry is not forgotten: it is set aside ([`PendingDeallocs::failed`]) and tried
///    once more when the context is torn down, so nothing that outlives a context (portable
///    pinned memory) is lost to one transient failure.
/// 4. While a [`DeferCleanup`] guard is alive, flushing does nothing (the queue grows without
///    bound). Leaving the outermost guard does **not** flush.
/// 5. When the runtime destroys the context (device reset, runtime drop), it first issues every
///    queued free, guard or no guard; frees that arrive after that are discarded without
///    reaching the driver, since the context's memory went with it.
///
/// A flush triggered from `Drop` cannot return its error: it is logged with `tracing::error!`,
/// recorded, and returned by the next [`PendingDeallocs::flush`].
///
/// # Locking
///
/// One mutex guards the queue and is held across the driver calls of a flush, so frees are
/// issued in queue order and never twice. Lock order: the manager's allocation table, then this
/// queue, then the context's [`ContextLiveness`].
pub struct PendingDeallocs {
    driver: Arc<dyn Driver>,
    device: DeviceOrdinal,
    ctx: ContextHandle,
    liveness: Arc<ContextLiveness>,
    config: DeallocConfig,
    inner: Mutex<Inner>,
}

/// Host memory that lives as long as the queue's context (`cuMemHostAlloc`'s, the pinned host
/// pool's) is kept by the queue: an access enters the context's liveness, so that the
/// context's teardown waits for it, and is refused once the context is gone.
impl crate::memory::host::HostKeeper for PendingDeallocs {
    fn keep_while(
        &self,
        _host: driver_sys::HostPtr,
        _tag: u64,
        what: &'static str,
        access: &mut dyn FnMut(),
    ) -> Result<(), EmmError> {
        let _live = self.liveness.enter().ok_or(EmmError::Stale {
            what,
            device: self.device,
            reason: "its context was torn down (its runtime dropped, or its device reset), and \
                     the driver freed the page-locked memory with it",
        })?;
        access();
        Ok(())
    }
}

impl fmt::Debug for PendingDeallocs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = lock(&self.inner);
        f.debug_struct("PendingDeallocs")
            .field("device", &self.device)
            .field("len", &inner.items.len())
            .field("bytes", &inner.bytes)
            .field("disabled", &inner.disabled)
            .field("capacity", &inner.capacity)
            .finish()
    }
}

impl PendingDeallocs {
    /// An empty queue for the context `ctx` of `device`, capacity unset.
    pub fn new(
        driver: Arc<dyn Driver>,
        device: DeviceOrdinal,
        ctx: ContextHandle,
        liveness: Arc<ContextLiveness>,
        config: DeallocConfig,
    ) -> PendingDeallocs {
        PendingDeallocs {
            driver,
            device,
            ctx,
            liveness,
            config,
            inner: Mutex::new(Inner {
                items: Vec::new(),
                bytes: 0,
                disabled: 0,
                capacity: 0,
                max_bytes: config.max_pending_bytes(0),
                recorded: None,
                failed: Vec::new(),
            }),
        }
    }

    /// Number of pending frees (Numba's `len(deallocations)`).
    pub fn len(&self) -> usize {
        lock(&self.inner).items.len()
    }

    /// Whether nothing is pending.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes pending (sizes of the queued frees since the last complete flush).
    pub fn pending_bytes(&self) -> usize {
        lock(&self.inner).bytes
    }

    /// The queued frees, oldest first.
    pub fn snapshot(&self) -> Vec<Free> {
        lock(&self.inner).items.to_vec()
    }

    /// Whether a [`DeferCleanup`] guard of this queue is alive.
    pub fn is_disabled(&self) -> bool {
        lock(&self.inner).disabled > 0
    }

    /// The capacity the byte threshold is a share of (0 while unset).
    pub fn capacity(&self) -> usize {
        lock(&self.inner).capacity
    }

    /// Sets the capacity if it is still unset; returns whether it was set now.
    pub fn set_capacity_once(&self, bytes: usize) -> bool {
        let mut inner = lock(&self.inner);
        if inner.capacity == 0 {
            inner.capacity = bytes;
            inner.max_bytes = self.config.max_pending_bytes(bytes);
            true
        } else {
            false
        }
    }

    /// The byte threshold: pending bytes above this flush (Numba's `_max_pending_bytes`).
    pub fn max_pending_bytes(&self) -> usize {
        lock(&self.inner).max_bytes
    }

    /// The thresholds this queue applies.
    pub fn config(&self) -> DeallocConfig {
        self.config
    }

    /// Queues a free and flushes if a threshold is crossed (Numba's `add_item`).
    ///
    /// # Safety
    ///
    /// As [`push_all`](Self::push_all), for `item`.
    pub unsafe fn push(&self, item: Free) -> Result<(), EmmError> {
        // SAFETY: the caller's contract, for the one item.
        unsafe { self.push_all(std::iter::once(item)) }
    }

    /// Queues several frees, then applies the thresholds once.
    ///
    /// # Safety
    ///
    /// Each item names a resource of this queue's context that the caller owns and gives up
    /// here: the allocation, stream, event or module was made in that context, is queued once,
    /// and nothing uses it once queued (the flush hands it to the driver's free or destroy
    /// call, which would otherwise free what someone else owns). A [`Free`] is plain data:
    /// safe code can build one naming any address or handle.
    ///
    /// A plugin queues the free of memory it allocated so:
    ///
    /// ```no_run
    /// fn give_up(queue: &emm::plugin::PendingDeallocs, ptr: emm::driver_sys::DevicePtr) {
    ///     // SAFETY: `ptr` is this plugin's `cuMemAlloc` allocation of 1 byte in the queue's
    ///     // context, no longer used, queued once.
    ///     unsafe { queue.push(emm::plugin::Free::Device { ptr, bytes: 1 }) }.unwrap();
    /// }
    /// ```
    ///
    /// and safe code cannot queue one:
    ///
    /// ```compile_fail,E0133
    /// fn free_anything(queue: &emm::plugin::PendingDeallocs, ptr: emm::driver_sys::DevicePtr) {
    ///     queue.push(emm::plugin::Free::Device { ptr, bytes: 1 }).unwrap();
    /// }
    /// ```
    pub unsafe fn push_all(&self, items: impl IntoIterator<Item = Free>) -> Result<(), EmmError> {
        let mut inner = lock(&self.inner);
        if self.enqueue(&mut inner, items) && self.over_threshold(&inner) {
            self.flush_locked(&mut inner)?;
        }
        Ok(())
    }

    /// Queues frees without applying the thresholds (a reset queues everything, then flushes
    /// once); returns whether a threshold is now crossed, so that a caller that must not flush
    /// here (it holds another lock) knows whether to call
    /// [`apply_thresholds_from_drop`](Self::apply_thresholds_from_drop) afterwards.
    pub(crate) fn push_all_without_flush(&self, items: impl IntoIterator<Item = Free>) -> bool {
        let mut inner = lock(&self.inner);
        self.enqueue(&mut inner, items) && self.over_threshold(&inner)
    }

    /// [`push_all_without_flush`](Self::push_all_without_flush) of one free (a pointer's
    /// release: no iterator to go through). Always inlined into the tables' releases, which
    /// are on every pair. Its append is `enqueue`'s loop body written out: a helper shared by
    /// both compiles to a longer pair, even always inlined.
    #[inline(always)]
    pub(crate) fn push_one_without_flush(&self, item: Free) -> bool {
        let mut inner = lock(&self.inner);
        if !self.liveness.is_alive() {
            tracing::debug!(device = %self.device, dropped = 1, "context destroyed; its memory went with it, nothing to free");
            return false;
        }
        tracing::trace!(device = %self.device, ?item, "deallocation deferred");
        inner.bytes = inner.bytes.saturating_add(item.bytes());
        inner.items.push(item);
        self.over_threshold(&inner)
    }

    /// Numba's rule: more than `max_count` frees, or more than the byte budget, pending.
    fn over_threshold(&self, inner: &Inner) -> bool {
        inner.items.len() > self.config.max_count || inner.bytes > inner.max_bytes
    }

    /// Appends `items`; returns false (dropping them) when the context is already destroyed.
    fn enqueue(&self, inner: &mut Inner, items: impl IntoIterator<Item = Free>) -> bool {
        if !self.liveness.is_alive() {
            let dropped = items.into_iter().count();
            tracing::debug!(device = %self.device, dropped, "context destroyed; its memory went with it, nothing to free");
            return false;
        }
        for item in items {
            tracing::trace!(device = %self.device, ?item, "deallocation deferred");
            inner.bytes = inner.bytes.saturating_add(item.bytes());
            inner.items.push(item);
        }
        true
    }

    /// Keeps an error from a destructor (an immediate unpin, say) to be returned by the next
    /// [`flush`](Self::flush).
    pub(crate) fn record_error(&self, e: EmmError) {
        lock(&self.inner).recorded = Some(e);
    }

    /// Queues a free from a destructor (a stream, event or pinned buffer that dropped) and
    /// applies the thresholds; errors are recorded for the next flush.
    pub(crate) fn push_from_drop(&self, item: Free) {
        if self.push_all_without_flush(Some(item)) {
            self.apply_thresholds_from_drop();
        }
    }

    /// Applies the thresholds after frees were queued from a destructor, flushing if one is
    /// crossed. An error cannot be returned from a destructor, so it is logged and kept for
    /// the next [`flush`](Self::flush).
    pub(crate) fn apply_thresholds_from_drop(&self) {
        let mut inner = lock(&self.inner);
        if self.over_threshold(&inner)
            && let Err(e) = self.flush_locked(&mut inner)
        {
            tracing::error!(device = %self.device, error = %e, "deferred deallocation failed; the error is returned by the next flush");
            inner.recorded = Some(e);
        }
    }

    /// Frees everything pending, oldest first, unless a [`DeferCleanup`] guard is alive
    /// (Numba's `clear`). Returns how many frees were issued, or the first error: the failing
    /// entry is dropped and later ones stay queued. An error recorded by an earlier flush in a
    /// destructor is returned here if this flush itself succeeds.
    pub fn flush(&self) -> Result<usize, EmmError> {
        let mut inner = lock(&self.inner);
        let freed = self.flush_locked(&mut inner)?;
        match inner.recorded.take() {
            Some(e) => Err(e),
            None => Ok(freed),
        }
    }

    /// Frees everything pending even while a [`DeferCleanup`] guard is alive: the context is
    /// about to be destroyed, so deferring no longer saves anything, and an explicit free keeps
    /// every allocation accounted for (leak checkers see it freed, not dropped with the
    /// context).
    pub(crate) fn flush_for_teardown(&self) -> Result<usize, EmmError> {
        let mut inner = lock(&self.inner);
        if inner.disabled > 0 && !inner.items.is_empty() {
            tracing::info!(device = %self.device, pending = inner.items.len(), "context torn down inside defer_cleanup; issuing the deferred frees first");
        }
        let Some(_live) = self.liveness.enter() else {
            inner.items.clear();
            inner.failed.clear();
            inner.bytes = 0;
            return Ok(0);
        };
        // Everything goes, whatever fails: earlier failures once more, then the queue.
        let mut work: Vec<Free> = std::mem::take(&mut inner.failed);
        work.append(&mut inner.items);
        inner.bytes = 0;
        let mut first_error = inner.recorded.take();
        let mut freed = 0;
        for item in work {
            match item.execute(&*self.driver, self.ctx) {
                Ok(()) => freed += 1,
                Err(e) => {
                    tracing::error!(device = %self.device, ?item, error = %e, "a free failed while tearing the context down");
                    first_error.get_or_insert(EmmError::driver(
                        "deferred deallocation",
                        self.device,
                        e,
                    ));
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(freed),
        }
    }

    /// Frees the driver refused so far (set aside, retried once at teardown).
    pub fn failed(&self) -> Vec<Free> {
        lock(&self.inner).failed.clone()
    }

    fn flush_locked(&self, inner: &mut Inner) -> Result<usize, EmmError> {
        if inner.disabled > 0 {
            return Ok(0);
        }
        let Some(_live) = self.liveness.enter() else {
            let dropped = inner.items.len();
            inner.items.clear();
            inner.bytes = 0;
            tracing::debug!(device = %self.device, dropped, "context destroyed; pending frees discarded");
            return Ok(0);
        };
        let mut freed = 0;
        let mut failure = None;
        for item in &inner.items {
            if let Err(e) = item.execute(&*self.driver, self.ctx) {
                failure = Some(e);
                break;
            }
            freed += 1;
        }
        if let Some(e) = failure {
            // The frees issued and the one that failed leave the queue; later ones stay.
            let failed = inner
                .items
                .drain(..=freed)
                .next_back()
                .expect("the failed free");
            inner.failed.push(failed);
            return Err(EmmError::driver("deferred deallocation", self.device, e));
        }
        inner.items.clear();
        inner.bytes = 0;
        if freed > 0 {
            tracing::debug!(device = %self.device, freed, "flushed pending deallocations");
        }
        Ok(freed)
    }

    /// Suspends flushing until the returned guard drops (Numba's `disable()`). Nests.
    pub fn defer_cleanup(self: &Arc<Self>) -> DeferCleanup {
        lock(&self.inner).disabled += 1;
        DeferCleanup {
            parts: vec![GuardPart::Queue(Arc::clone(self))],
        }
    }

    fn enable(&self) {
        let mut inner = lock(&self.inner);
        debug_assert!(inner.disabled > 0, "DeferCleanup guard released twice");
        inner.disabled = inner.disabled.saturating_sub(1);
    }
}

enum GuardPart {
    Queue(Arc<PendingDeallocs>),
    /// Held only to be dropped with the guard.
    Plugin(#[allow(dead_code)] Box<dyn Send>),
}

/// While alive, deferred cleanup is suspended (Numba's `defer_cleanup()` context manager).
///
/// Guards nest: cleanup resumes when the last one drops, and resuming does not flush. A guard
/// may hold several parts (the manager's queue, the context's queue, a plugin's own state);
/// they are released together.
#[must_use = "cleanup is deferred only while the guard is alive"]
pub struct DeferCleanup {
    parts: Vec<GuardPart>,
}

impl DeferCleanup {
    /// A guard that defers nothing (for managers that have no deferred cleanup).
    pub fn nothing() -> DeferCleanup {
        DeferCleanup { parts: Vec::new() }
    }

    /// A guard holding a plugin's own value, dropped when the guard drops.
    pub fn plugin(state: Box<dyn Send>) -> DeferCleanup {
        DeferCleanup {
            parts: vec![GuardPart::Plugin(state)],
        }
    }

    /// One guard that holds both.
    pub fn join(mut self, mut other: DeferCleanup) -> DeferCleanup {
        self.parts.append(&mut other.parts);
        self
    }
}

impl Drop for DeferCleanup {
    fn drop(&mut self) {
        for part in self.parts.drain(..).rev() {
            if let GuardPart::Queue(q) = part {
                q.enable();
            }
        }
    }
}

impl fmt::Debug for DeferCleanup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let queues = self
            .parts
            .iter()
            .filter(|p| matches!(p, GuardPart::Queue(_)))
            .count();
        f.debug_struct("DeferCleanup")
            .field("queues", &queues)
            .field("plugin_parts", &(self.parts.len() - queues))
            .finish()
    }
}
