//! Streams, events and modules: context objects whose destruction is deferred on the
//! context's own queue, which no memory manager touches (Numba's two queues).
//!
//! Streams and events are released when their handle drops (the default streams and external
//! streams are never destroyed by emm); they order work, wait for it, and mark points in it. An
//! [`InFlight`] holds what an asynchronous copy uses until an event says it is done. Modules
//! are also tracked by the context, as Numba's `Context.modules` does, so that a context reset
//! unloads them; a module handle that outlives the reset unloads nothing when it drops.

use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use driver_sys::{DeviceOrdinal, DriverError, EventHandle, ModuleHandle, StreamHandle};

use crate::contract::factory::ManagerContext;
use crate::error::EmmError;
use crate::memory::host::HostOwner;
use crate::memory::pending::{Free, PendingDeallocs};
use crate::memory::pointer::{MemoryPointer, OrderedOn};
use crate::sync::{AtomicU64, Mutex, Ordering, lock};

/// Host functions launched through [`Stream::launch_host_func`] that panicked: a plain count,
/// outside the loom models (whose atomics cannot be made in a static).
static HOST_FUNCTION_PANICS: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(0);

/// How many host functions launched through [`Stream::launch_host_func`] in this process
/// panicked. Such a panic happens on a driver thread, where it cannot reach the code that
/// launched the function: it is stopped there, logged at error level and counted here, and
/// the stream's later work goes on.
pub fn host_function_panics() -> usize {
    HOST_FUNCTION_PANICS.load(std::sync::atomic::Ordering::Relaxed)
}

/// A loaded module (`cuModuleLoadData`); unloaded through the context's queue when dropped or
/// when the context is reset.
pub struct Module {
    handle: ModuleHandle,
    device: DeviceOrdinal,
    registry: Arc<ModuleRegistry>,
    generation: u64,
}

/// Which stream a [`Stream`] is (Numba's stream kinds).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamKind {
    /// Created by emm; destroyed through the context's own queue when dropped.
    Created {
        /// `CU_STREAM_NON_BLOCKING`: no implicit synchronisation with the legacy default
        /// stream.
        non_blocking: bool,
        /// Its priority, as the driver clamped it (lower numbers are higher priorities).
        priority: i32,
    },
    /// The legacy default stream (`CU_STREAM_LEGACY`): synchronises with every blocking
    /// stream of the context.
    LegacyDefault,
    /// The calling thread's default stream (`CU_STREAM_PER_THREAD`): synchronises with no
    /// other stream.
    PerThreadDefault,
    /// Another library's stream, wrapped (Numba's `external_stream`); emm never destroys it.
    External,
}

/// A stream of a context. Its work is ordered; [`synchronize`](Stream::synchronize) waits
/// for it, [`query`](Stream::query) asks whether it is done, events mark points in it, and
/// host functions run in its order. A created stream is destroyed through the context's own
/// queue when dropped; the default streams and external streams are not.
pub struct Stream {
    handle: StreamHandle,
    kind: StreamKind,
    cx: ManagerContext,
    /// What keeps the stream alive, held by the stream and by every memory ordered on it: for
    /// a created stream its [`StreamDestroy`] (which queues the destruction when the last
    /// holder is gone), for an external stream wrapped with its owner that owner; `None` for
    /// the default streams and other external streams.
    keep: Option<HostOwner>,
}

/// The destruction of a created stream, shared by the [`Stream`] and the memory ordered on
/// it (through [`OrderedOn::keep_alive`]): the last of them queues `cuStreamDestroy`.
struct StreamDestroy {
    handle: StreamHandle,
    queue: Arc<PendingDeallocs>,
}

impl Drop for StreamDestroy {
    fn drop(&mut self) {
        self.queue.push_from_drop(Free::Stream(self.handle));
    }
}

// SAFETY: a `Stream` is alive while it or its `keep` owner is held: emm's own streams are
// destroyed only when the last of those drops, and the external ones were vouched for by the
// unsafe `external_stream*` that made them.
#[allow(unsafe_code)]
unsafe impl OrderedOn for Stream {
    fn stream_handle(&self) -> StreamHandle {
        self.handle
    }

    fn keep_alive(&self) -> Option<HostOwner> {
        self.keep.clone()
    }
}

/// An event of a context (`cuEventCreate`): marks a point in a stream's work; destroyed
/// through the context's own queue when dropped.
pub struct Event {
    handle: EventHandle,
    timing: bool,
    cx: ManagerContext,
    queue: Arc<PendingDeallocs>,
}

/// Runs one driver call of `cx` for `what`, with the context entered (refused after a reset).
fn call<T>(
    cx: &ManagerContext,
    what: &'static str,
    f: impl FnOnce(&ManagerContext) -> Result<T, DriverError>,
) -> Result<T, EmmError> {
    let _live = cx.enter(what)?;
    f(cx).map_err(|e| cx.driver_error(what, e))
}

impl Stream {
    pub(crate) fn new(
        handle: StreamHandle,
        kind: StreamKind,
        cx: ManagerContext,
        queue: Option<Arc<PendingDeallocs>>,
    ) -> Stream {
        Stream {
            handle,
            kind,
            cx,
            keep: queue.map(|queue| Arc::new(StreamDestroy { handle, queue }) as HostOwner),
        }
    }

    /// An external stream that `owner` keeps alive: the stream and every memory ordered on it
    /// hold `owner`.
    pub(crate) fn external_owned(
        handle: StreamHandle,
        cx: ManagerContext,
        owner: HostOwner,
    ) -> Stream {
        let mut s = Stream::new(handle, StreamKind::External, cx, None);
        s.keep = Some(owner);
        s
    }

    /// The driver's stream handle (`CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD` for the
    /// default streams).
    pub fn handle(&self) -> StreamHandle {
        self.handle
    }

    /// The device.
    pub fn device(&self) -> DeviceOrdinal {
        self.cx.device
    }

    /// Which stream it is.
    pub fn kind(&self) -> StreamKind {
        self.kind
    }

    /// The context the stream belongs to.
    pub(crate) fn context(&self) -> &ManagerContext {
        &self.cx
    }

    /// Waits until all work queued on the stream is done (`cuStreamSynchronize`).
    pub fn synchronize(&self) -> Result<(), EmmError> {
        call(&self.cx, "synchronize stream", |cx| {
            cx.driver.stream_synchronize(cx.context, self.handle)
        })
    }

    /// Whether all work queued on the stream is done (`cuStreamQuery`), without waiting.
    pub fn query(&self) -> Result<bool, EmmError> {
        call(&self.cx, "query stream", |cx| {
            cx.driver.stream_query(cx.context, self.handle)
        })
    }

    /// The stream's priority (`cuStreamGetPriority`).
    pub fn priority(&self) -> Result<i32, EmmError> {
        call(&self.cx, "stream priority", |cx| {
            cx.driver.stream_priority(cx.context, self.handle)
        })
    }

    /// Records `event` at this point of the stream (`cuEventRecord`).
    pub fn record(&self, event: &Event) -> Result<(), EmmError> {
        check_same_context(&self.cx, &event.cx, "record an event")?;
        call(&self.cx, "record event", |cx| {
            cx.driver
                .event_record(cx.context, event.handle, self.handle)
        })
    }

    /// Makes work queued on the stream after this wait for `event`'s last record
    /// (`cuStreamWaitEvent`).
    /// The event may be of another device's context (a cross-device wait).
    pub fn wait_event(&self, event: &Event) -> Result<(), EmmError> {
        call(&self.cx, "wait for event", |cx| {
            cx.driver
                .stream_wait_event(cx.context, self.handle, event.handle)
        })
    }

    /// Runs `f` when the stream reaches this point (`cuLaunchHostFunc`); later work on the
    /// stream waits for it. `f` runs on a driver thread and must not call CUDA, emm
    /// included (dropping emm memory in it can flush the deferred frees: move it out instead).
    /// A panic in `f` cannot reach the caller: it is logged at error level and counted
    /// ([`host_function_panics`]).
    pub fn launch_host_func(&self, f: impl FnOnce() + Send + 'static) -> Result<(), EmmError> {
        let device = self.cx.device;
        let guarded = move || {
            if let Err(payload) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
                HOST_FUNCTION_PANICS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let why = payload
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic without a message".to_owned());
                tracing::error!(%device, panic = %why, "a host function panicked on the driver's thread; the stream's later work went on");
            }
        };
        call(&self.cx, "launch host function", |cx| {
            cx.driver
                .launch_host_func(cx.context, self.handle, Box::new(guarded))
        })
    }

    /// A guard that synchronises the stream when it drops (Numba's `auto_synchronize`). An
    /// error at the drop is logged; [`AutoSynchronize::finish`] returns it instead.
    pub fn auto_synchronize(&self) -> AutoSynchronize<'_> {
        AutoSynchronize {
            stream: self,
            done: false,
        }
    }
}

/// Refuses objects (streams, events, a context's own work) of different contexts.
pub(crate) fn check_same_context(
    a: &ManagerContext,
    b: &ManagerContext,
    what: &'static str,
) -> Result<(), EmmError> {
    if a.context == b.context {
        Ok(())
    } else {
        Err(EmmError::MismatchedContexts {
            what,
            first: a.device,
            second: b.device,
        })
    }
}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stream")
            .field("handle", &self.handle)
            .field("device", &self.cx.device)
            .field("kind", &self.kind)
            .finish()
    }
}

/// Synchronises its stream when dropped: see [`Stream::auto_synchronize`].
#[must_use = "the stream is synchronised when the guard drops"]
pub struct AutoSynchronize<'a> {
    stream: &'a Stream,
    done: bool,
}

impl AutoSynchronize<'_> {
    /// Synchronises now and returns what the synchronisation found.
    pub fn finish(mut self) -> Result<(), EmmError> {
        self.done = true;
        self.stream.synchronize()
    }
}

impl Drop for AutoSynchronize<'_> {
    fn drop(&mut self) {
        if !self.done
            && let Err(e) = self.stream.synchronize()
        {
            tracing::error!(device = %self.stream.device(), error = %e, "auto_synchronize: the stream's synchronisation failed");
        }
    }
}

impl fmt::Debug for AutoSynchronize<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AutoSynchronize")
            .field("stream", &self.stream)
            .finish()
    }
}

impl Event {
    pub(crate) fn new(
        handle: EventHandle,
        timing: bool,
        cx: ManagerContext,
        queue: Arc<PendingDeallocs>,
    ) -> Event {
        Event {
            handle,
            timing,
            cx,
            queue,
        }
    }

    /// The driver's event handle.
    pub fn handle(&self) -> EventHandle {
        self.handle
    }

    /// The device.
    pub fn device(&self) -> DeviceOrdinal {
        self.cx.device
    }

    /// Whether it records times ([`elapsed_since`](Self::elapsed_since) needs it).
    pub fn is_timing(&self) -> bool {
        self.timing
    }

    /// Records the event at the current point of `stream` (`cuEventRecord`).
    pub fn record(&self, stream: &Stream) -> Result<(), EmmError> {
        stream.record(self)
    }

    /// Whether the event's last record is done (`cuEventQuery`); an event never recorded is.
    pub fn query(&self) -> Result<bool, EmmError> {
        call(&self.cx, "query event", |cx| {
            cx.driver.event_query(cx.context, self.handle)
        })
    }

    /// Waits for the event's last record (`cuEventSynchronize`).
    pub fn synchronize(&self) -> Result<(), EmmError> {
        call(&self.cx, "synchronize event", |cx| {
            cx.driver.event_synchronize(cx.context, self.handle)
        })
    }

    /// The time from `start`'s last record to this event's (`cuEventElapsedTime`): both must
    /// be timing events, recorded, and done.
    pub fn elapsed_since(&self, start: &Event) -> Result<Duration, EmmError> {
        check_same_context(&self.cx, &start.cx, "time between events")?;
        let ms = call(&self.cx, "elapsed time", |cx| {
            cx.driver
                .event_elapsed_time(cx.context, start.handle, self.handle)
        })?;
        Ok(Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1000.0))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        self.queue.push_from_drop(Free::Event(self.handle));
    }
}

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Event")
            .field("handle", &self.handle)
            .field("device", &self.cx.device)
            .field("timing", &self.timing)
            .finish()
    }
}

/// Work queued on a stream together with what it uses: the host memory it was given (handed
/// back by [`wait`](InFlight::wait)) and the device memory it touches (kept alive). Dropping it
/// waits for the work first, so nothing it uses is freed under the copy; forgetting it
/// (`std::mem::forget`) leaks what it holds instead.
///
/// Work queued on a stream being captured is recorded into the graph, not run: its
/// `InFlight` has nothing to wait for, and the device memory it uses is kept by the context
/// for the graph (by the [`Graph`](crate::Graph) that [`Context::capture`](crate::Context::capture)
/// makes, for as long as it lives; for a capture another library began, until
/// [`Context::release_capture_pools`](crate::Context::release_capture_pools) after it ended).
#[must_use = "dropping it waits for the work; wait() gives the host memory back"]
pub struct InFlight<T> {
    /// `None` for work recorded into a capture.
    event: Option<Event>,
    value: Option<T>,
    keep: Vec<MemoryPointer>,
}

impl<T> InFlight<T> {
    pub(crate) fn new(event: Event, value: T, keep: Vec<MemoryPointer>) -> InFlight<T> {
        InFlight {
            event: Some(event),
            value: Some(value),
            keep,
        }
    }

    /// Work recorded into a capture: nothing to wait for.
    pub(crate) fn recorded(value: T, keep: Vec<MemoryPointer>) -> InFlight<T> {
        InFlight {
            event: None,
            value: Some(value),
            keep,
        }
    }

    /// Whether the work is done, without waiting (work recorded into a capture: `true`, it
    /// runs at the graph's launches).
    pub fn is_done(&self) -> Result<bool, EmmError> {
        self.event.as_ref().map_or(Ok(true), Event::query)
    }

    /// Waits for the work; returns what it was given (the host memory of a copy).
    pub fn wait(mut self) -> Result<T, EmmError> {
        if let Some(e) = &self.event {
            e.synchronize()?;
        }
        self.keep.clear();
        Ok(self.value.take().expect("taken only here"))
    }
}

impl<T> Drop for InFlight<T> {
    fn drop(&mut self) {
        if self.value.is_some()
            && let Some(event) = &self.event
            && let Err(e) = event.synchronize()
        {
            // The work may still use the memory: leak it rather than free it under the work.
            tracing::error!(device = %event.device(), error = %e, "an in-flight copy could not be waited for; its buffers are leaked");
            std::mem::forget(self.value.take());
            std::mem::forget(std::mem::take(&mut self.keep));
        }
    }
}

impl<T> fmt::Debug for InFlight<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InFlight")
            .field("event", &self.event)
            .field("buffers", &self.keep.len())
            .finish()
    }
}

/// The modules a context has loaded (Numba's `Context.modules`).
#[derive(Debug)]
pub(crate) struct ModuleRegistry {
    loaded: Mutex<BTreeSet<ModuleHandle>>,
    generation: AtomicU64,
    queue: Arc<PendingDeallocs>,
}

impl ModuleRegistry {
    pub(crate) fn new(queue: Arc<PendingDeallocs>) -> ModuleRegistry {
        ModuleRegistry {
            loaded: Mutex::new(BTreeSet::new()),
            generation: AtomicU64::new(0),
            queue,
        }
    }

    pub(crate) fn register(
        self: &Arc<Self>,
        handle: ModuleHandle,
        device: DeviceOrdinal,
    ) -> Module {
        let mut loaded = lock(&self.loaded);
        loaded.insert(handle);
        Module {
            handle,
            device,
            registry: Arc::clone(self),
            generation: self.generation.load(Ordering::Acquire),
        }
    }

    /// Queues an unload for every loaded module (Numba's `modules.clear()`).
    pub(crate) fn clear(&self) {
        let mut loaded = lock(&self.loaded);
        self.generation.fetch_add(1, Ordering::AcqRel);
        let all = std::mem::take(&mut *loaded);
        self.queue
            .push_all_without_flush(all.into_iter().map(Free::Module));
    }

    pub(crate) fn len(&self) -> usize {
        lock(&self.loaded).len()
    }

    fn release(&self, handle: ModuleHandle, generation: u64) {
        let flush = {
            let mut loaded = lock(&self.loaded);
            if self.generation.load(Ordering::Acquire) != generation || !loaded.remove(&handle) {
                return;
            }
            self.queue.push_all_without_flush([Free::Module(handle)])
        };
        if flush {
            self.queue.apply_thresholds_from_drop();
        }
    }
}

impl Module {
    /// The driver's module handle.
    pub fn handle(&self) -> ModuleHandle {
        self.handle
    }

    /// The device.
    pub fn device(&self) -> DeviceOrdinal {
        self.device
    }

    /// Whether the module is still loaded (false after a context reset unloaded it).
    pub fn is_loaded(&self) -> bool {
        self.registry.generation.load(Ordering::Acquire) == self.generation
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        self.registry.release(self.handle, self.generation);
    }
}

impl fmt::Debug for Module {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Module")
            .field("handle", &self.handle)
            .field("device", &self.device)
            .field("loaded", &self.is_loaded())
            .finish()
    }
}
