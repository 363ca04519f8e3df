//! Adaptors that wrap any manager: statistics, a CSV event log, a limit, `tracing` spans.
//!
//! An adaptor is a [`MemoryManager`] around another one. It forwards every call, and wraps
//! what comes back so that it sees the memory released too. Adaptors compose: the runtime
//! wraps the selected manager in the list it is given, innermost first, in code
//! ([`RuntimeBuilder::adaptors`](crate::RuntimeBuilder::adaptors)) or from the environment:
//!
//! ```text
//! EMM_MEMORY_MANAGER=pool EMM_MEMORY_ADAPTORS=limit=8GiB,stats,log=/tmp/emm.csv
//!     -> log(stats(limit(pool)))
//! ```
//!
//! | adaptor | what it does | cost per call |
//! | --- | --- | --- |
//! | [`Adaptor::Stats`] | current, peak and total bytes and counts per kind ([`Context::usage`](crate::Context::usage)) | a few atomic additions |
//! | [`Adaptor::Limit`] | refuses device allocations that would bring the bytes in use past the cap ([`EmmError::OverLimit`]) | one atomic addition |
//! | [`Adaptor::Log`] | one CSV line per allocation and free ([`LOG_HEADER`]); replay it with [`crate::replay`] | a clock read and a buffered write under a lock |
//! | [`Adaptor::Trace`] | a `tracing` span (`emm.memalloc`, ...) around each call, and events for frees | nothing when the level is off |
//! | [`Adaptor::History`] | every live device allocation with its tag, stream, time (and stack with `history-stacks`), and a ring of the last events, for [`Context::snapshot`](crate::Context::snapshot) and out-of-memory reports | a clock read and a hash-map update under a lock (a stack capture with stacks) |
//!
//! The wrapping costs one allocation per memory object (the wrapper); managers with no
//! adaptor pay nothing.

#![allow(unsafe_code)]

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use driver_sys::{DevicePtr, HostPtr, StreamHandle};

use driver_sys::DeviceOrdinal;

use crate::contract::capabilities::{Exports, Holdings, Records, Sleeper};
use crate::contract::factory::{ManagerContext, ManagerFactory};
use crate::contract::info::{
    AllocationEvents, FreeSpace, MemoryInfo, MemoryKind, PoolReport, Usage,
};
use crate::contract::ipc::IpcHandle;
use crate::contract::manager::{HistoryRecord, MemoryManager, StreamOrdering};
use crate::contract::mapped_export::MappedExport;
use crate::contract::pool_export::PoolExport;
use crate::contract::snapshot::HeldSegment;
use crate::error::EmmError;
use crate::memory::host::{
    HostAllocFlags, HostKeeper, HostMemory, HostOwner, ManagedMemory, MappedMemory, PinnedMemory,
};
use crate::memory::liveness::ContextLiveness;
use crate::memory::pending::{DeferCleanup, PendingDeallocs};
use crate::memory::pointer::{MemoryPointer, ReleaseHook};
use crate::sync::{AtomicUsize, Mutex, lock};

mod history;
mod limit;
pub(crate) mod log;
mod stats;
mod trace;

use history::DEFAULT_HISTORY_EVENTS;
use history::History;
use limit::Limit;
pub use log::LOG_HEADER;
use log::{Log, LogObserver};
use stats::Stats;
use trace::Trace;

/// One adaptor, as named in `EMM_MEMORY_ADAPTORS`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Adaptor {
    /// `stats`: statistics per kind of memory.
    Stats,
    /// `limit=<bytes>`: a cap on device bytes in use through this manager.
    Limit(usize),
    /// `log=<path>`: a CSV event log (one file for all contexts; the `Device` column tells
    /// them apart).
    Log(PathBuf),
    /// `trace`: `tracing` spans around each call.
    Trace,
    /// `history[=<events>]`, or `history-stacks[=<events>]` to keep each allocation's stack
    /// too: live allocations and a ring of the last `events` events (default
    /// 100 000), for snapshots.
    History {
        /// The most events the ring keeps.
        events: usize,
        /// Whether each allocation keeps its stack (a backtrace per allocation: slow).
        stacks: bool,
    },
}

impl Adaptor {
    /// Parses one item of `EMM_MEMORY_ADAPTORS`.
    pub fn parse(item: &str) -> Result<Adaptor, String> {
        let (name, arg) = match item.split_once('=') {
            Some((n, a)) => (n.trim(), Some(a.trim())),
            None => (item.trim(), None),
        };
        match (name, arg) {
            ("stats", None) => Ok(Adaptor::Stats),
            ("history" | "history-stacks", events) => {
                let events = match events {
                    None => DEFAULT_HISTORY_EVENTS,
                    Some(n) => n.parse().map_err(|_| {
                        format!("{name}={n}: the number of events to keep, such as {name}=100000")
                    })?,
                };
                Ok(Adaptor::History {
                    events,
                    stacks: name == "history-stacks",
                })
            }
            ("trace", None) => Ok(Adaptor::Trace),
            ("limit", Some(bytes)) => crate::units::parse_bytes(bytes)
                .map(Adaptor::Limit)
                .map_err(|e| format!("limit: {e}")),
            ("log", Some(path)) if !path.is_empty() => Ok(Adaptor::Log(PathBuf::from(path))),
            ("limit", None) | ("log", None | Some(_)) => Err(format!(
                "'{name}' needs a value: limit=<bytes> (such as limit=8GiB), log=<path>"
            )),
            (other, _) => Err(format!(
                "unknown adaptor '{other}'; the adaptors are stats, limit=<bytes>, log=<path>, trace, \
                 history[=<events>] and history-stacks[=<events>]"
            )),
        }
    }

    /// Writes out the lines every open `log` adaptor of this process has buffered. A log
    /// writes its file through a buffer, flushed when its runtime's contexts go; a process that
    /// ends without dropping its runtime (an interpreter that keeps one for its life) calls
    /// this at exit, or the last lines are lost.
    pub fn flush_logs() {
        log::flush_all();
    }

    /// The adaptor's name in `EMM_MEMORY_ADAPTORS`.
    pub fn name(&self) -> &'static str {
        match self {
            Adaptor::Stats => "stats",
            Adaptor::Limit(_) => "limit",
            Adaptor::Log(_) => "log",
            Adaptor::Trace => "trace",
            Adaptor::History { stacks: false, .. } => "history",
            Adaptor::History { stacks: true, .. } => "history-stacks",
        }
    }
}

/// What an adaptor is told. Every method has a default that does nothing.
pub(crate) trait Observer: Send + Sync + fmt::Debug {
    /// Before the inner manager is asked; an error refuses the allocation.
    fn admit(
        &self,
        _device: DeviceOrdinal,
        _kind: MemoryKind,
        _bytes: usize,
    ) -> Result<(), EmmError> {
        Ok(())
    }
    /// Before the inner manager is asked for memory on `stream`, at `start` (where the
    /// observer is [`timed`](Self::timed)): what the observer reads of the stream then, handed
    /// back in the call's [`Event`]. The manager may wait for the stream's work while it
    /// serves the call, so a reading after it would not say what the manager found.
    fn before_on_stream(&self, _stream: StreamHandle, _start: Option<Instant>) -> Option<u64> {
        None
    }
    /// The inner manager answered (`addr` is `None` on failure).
    fn allocated(&self, _e: &Event) {}
    /// Memory was released (the last handle dropped).
    fn freed(&self, _e: &Event) {}
    /// A span to hold around the inner call.
    fn span(
        &self,
        _op: &'static str,
        _device: DeviceOrdinal,
        _bytes: usize,
    ) -> Option<tracing::span::EnteredSpan> {
        None
    }
    /// The `stats` adaptor's report.
    fn usage(&self) -> Option<Usage> {
        None
    }
    /// The `history` adaptor's record.
    fn history(&self) -> Option<HistoryRecord> {
        None
    }
    /// Whether the `history` adaptor keeps each allocation's stack.
    fn stacks(&self) -> bool {
        false
    }
    /// Whether events need their times.
    fn timed(&self) -> bool {
        false
    }
    /// The manager was reset (the log flushes its file).
    fn reset(&self) {}
}

/// One allocation or free, as adaptors see it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Event {
    device: DeviceOrdinal,
    kind: MemoryKind,
    addr: Option<u64>,
    bytes: usize,
    /// The stream of a stream-ordered allocation (`memalloc_on`); `None` for the others and
    /// for frees (the log finds a free's stream from its allocation).
    stream: Option<StreamHandle>,
    start: Option<Instant>,
    end: Option<Instant>,
    /// What the observer read of `stream` before the inner manager was asked
    /// ([`Observer::before_on_stream`]); `None` elsewhere.
    before: Option<u64>,
}

/// A manager wrapped in one adaptor.
pub struct Adapted {
    name: &'static str,
    inner: Arc<dyn MemoryManager>,
    observer: Arc<dyn Observer>,
    hook: Arc<dyn ReleaseHook>,
    device: DeviceOrdinal,
    /// The context's liveness: whether this thread is inside its out-of-memory callback.
    liveness: Arc<ContextLiveness>,
    /// The context's out-of-memory callback and counts.
    events: Arc<AllocationEvents>,
}

impl fmt::Debug for Adapted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Adapted")
            .field("adaptor", &self.name)
            .field("inner", &self.inner)
            .finish()
    }
}

/// Tells the observer about frees of wrapped device pointers; the tag is the kind.
struct FreeHook {
    observer: Arc<dyn Observer>,
    device: DeviceOrdinal,
    timed: bool,
}

impl ReleaseHook for FreeHook {
    fn release(&self, base: DevicePtr, size: usize, tag: u64) {
        let now = self.timed.then(Instant::now);
        self.observer.freed(&Event {
            device: self.device,
            kind: MemoryKind::ALL[tag as usize],
            addr: Some(base.0),
            bytes: size,
            stream: None,
            start: now,
            end: now,
            before: None,
        });
    }

    fn is_live(&self, _tag: u64) -> bool {
        true
    }
}

impl Adapted {
    fn new(
        inner: Arc<dyn MemoryManager>,
        adaptor: &Adaptor,
        cx: &ManagerContext,
        log: Option<Arc<Log>>,
    ) -> Adapted {
        let device = cx.device;
        let observer: Arc<dyn Observer> = match adaptor {
            Adaptor::Stats => Arc::new(Stats::default()),
            Adaptor::Limit(limit) => Arc::new(Limit {
                limit: *limit,
                in_use: AtomicUsize::new(0),
            }),
            Adaptor::Trace => Arc::new(Trace),
            Adaptor::History { events, stacks } => Arc::new(History::new(*events, *stacks)),
            Adaptor::Log(_) => {
                let weak = Arc::downgrade(&inner);
                Arc::new(LogObserver {
                    log: log.expect("the factory opens the log"),
                    info: Box::new(move || {
                        let manager = weak.upgrade()?;
                        match manager.get_memory_info() {
                            Ok(info) => Some(info),
                            Err(e) => {
                                // The log line keeps the last figures it had; the event is
                                // still logged.
                                tracing::warn!(error = %e, "the log adaptor could not read free and total memory");
                                None
                            }
                        }
                    }),
                    progress: log::Progress::new(cx.clone()),
                })
            }
        };
        let hook = Arc::new(FreeHook {
            observer: Arc::clone(&observer),
            device,
            timed: observer.timed(),
        });
        Adapted {
            name: adaptor.name(),
            inner,
            observer,
            hook,
            device,
            liveness: Arc::clone(&cx.liveness),
            events: Arc::clone(&cx.events),
        }
    }

    fn observe<T>(
        &self,
        op: &'static str,
        kind: MemoryKind,
        bytes: usize,
        stream: Option<StreamHandle>,
        call: impl FnOnce() -> Result<T, EmmError>,
        addr: impl Fn(&T) -> u64,
    ) -> Result<T, EmmError> {
        let _span = self.observer.span(op, self.device, bytes);
        if let Err(refused) = self.observer.admit(self.device, kind, bytes) {
            self.admit_after_callback(op, kind, bytes, refused)?;
        }
        let timed = self.observer.timed();
        let start = timed.then(Instant::now);
        let before = stream.and_then(|s| self.observer.before_on_stream(s, start));
        let result = call();
        let end = timed.then(Instant::now);
        self.observer.allocated(&Event {
            device: self.device,
            kind,
            addr: result.as_ref().ok().map(&addr),
            bytes,
            stream,
            start,
            end,
            before,
        });
        result
    }

    /// A limit's refusal of device memory (`refused`) is out of memory to the program, as the
    /// driver's is: the context's out-of-memory callback runs
    /// ([`AllocationEvents::call_back`]), and where it says it freed memory (a
    /// Dask worker spilling, say) the allocation is admitted again. Any other refusal stands.
    #[cold]
    #[inline(never)]
    fn admit_after_callback(
        &self,
        op: &'static str,
        kind: MemoryKind,
        bytes: usize,
        refused: EmmError,
    ) -> Result<(), EmmError> {
        if kind != MemoryKind::Device || !matches!(refused, EmmError::OverLimit { .. }) {
            return Err(refused);
        }
        let mut last = Err(refused);
        self.events
            .call_back(&self.liveness, self.device, op, bytes, &mut || {
                last = self.observer.admit(self.device, kind, bytes);
                last.is_ok()
            });
        last
    }

    fn wrap_device(&self, inner: MemoryPointer, kind: MemoryKind) -> MemoryPointer {
        MemoryPointer::wrapping(inner, Arc::clone(&self.hook), kind as u64)
    }

    fn wrap_host(&self, memory: HostMemory, kind: MemoryKind) -> HostMemory {
        match memory {
            HostMemory::Mapped(m) => {
                let host = m.host_ptr();
                let device = self.wrap_device(m.device().clone(), kind);
                // SAFETY: the host side of mapped memory whose device side `device` wraps, and
                // so keeps alive.
                HostMemory::Mapped(unsafe { MappedMemory::new(host, device) })
            }
            HostMemory::Pinned(p) => {
                let observer = Arc::clone(&self.observer);
                let device = self.device;
                let (host, size, owner) = (p.host_ptr(), p.size(), p.owner().cloned());
                // `p` answers for its memory during accesses (`PinnedMemory::access`): the
                // wrapper's keeper is `p` itself, which the wrapper's drop lets go last.
                let p = Arc::new(p);
                let keeper = Arc::clone(&p) as Arc<dyn HostKeeper>;
                // SAFETY: the range is `p`'s page-locked memory, which the release and the
                // keeper keep alive (they own `p`) and give back by dropping it.
                let wrapped = unsafe {
                    PinnedMemory::with_release(host, size, owner, move |h: HostPtr, s| {
                        drop(p);
                        let now = observer.timed().then(Instant::now);
                        observer.freed(&Event {
                            device,
                            kind,
                            addr: Some(h.0 as u64),
                            bytes: s,
                            stream: None,
                            start: now,
                            end: now,
                            before: None,
                        });
                    })
                };
                HostMemory::Pinned(wrapped.kept_by(keeper, 0))
            }
        }
    }
}

fn host_kind(mapped: bool) -> MemoryKind {
    if mapped {
        MemoryKind::Mapped
    } else {
        MemoryKind::Pinned
    }
}

impl MemoryManager for Adapted {
    fn memalloc(&self, bytes: usize) -> Result<MemoryPointer, EmmError> {
        let p = self.observe(
            "memalloc",
            MemoryKind::Device,
            bytes,
            None,
            || self.inner.memalloc(bytes),
            |p| p.device_ptr().0,
        )?;
        Ok(self.wrap_device(p, MemoryKind::Device))
    }

    fn memalloc_on(&self, bytes: usize, stream: StreamHandle) -> Result<MemoryPointer, EmmError> {
        let p = self.observe(
            "memalloc_on",
            MemoryKind::Device,
            bytes,
            Some(stream),
            || self.inner.memalloc_on(bytes, stream),
            |p| p.device_ptr().0,
        )?;
        Ok(self.wrap_device(p, MemoryKind::Device))
    }

    fn stream_ordering(&self) -> StreamOrdering {
        self.inner.stream_ordering()
    }

    fn memhostalloc(&self, bytes: usize, flags: HostAllocFlags) -> Result<HostMemory, EmmError> {
        let kind = host_kind(flags.mapped);
        let m = self.observe(
            "memhostalloc",
            kind,
            bytes,
            None,
            || self.inner.memhostalloc(bytes, flags),
            |m| m.host_ptr().0 as u64,
        )?;
        Ok(self.wrap_host(m, kind))
    }

    fn memallocmanaged(
        &self,
        bytes: usize,
        attach_global: bool,
    ) -> Result<ManagedMemory, EmmError> {
        let m = self.observe(
            "memallocmanaged",
            MemoryKind::Managed,
            bytes,
            None,
            || self.inner.memallocmanaged(bytes, attach_global),
            |m| m.device().device_ptr().0,
        )?;
        let device = self.wrap_device(m.device().clone(), MemoryKind::Managed);
        // SAFETY: the inner manager's managed memory, wrapped: the same memory and size.
        Ok(unsafe { ManagedMemory::new(device, attach_global) })
    }

    unsafe fn mempin(
        &self,
        owner: HostOwner,
        ptr: HostPtr,
        size: usize,
        mapped: bool,
    ) -> Result<HostMemory, EmmError> {
        // SAFETY: forwarded with this method's own contract.
        let call = || unsafe { self.inner.mempin(owner, ptr, size, mapped) };
        let m = self.observe("mempin", MemoryKind::Pin, size, None, call, |m| {
            m.host_ptr().0 as u64
        })?;
        Ok(self.wrap_host(m, MemoryKind::Pin))
    }

    fn initialize(&self) -> Result<(), EmmError> {
        self.inner.initialize()
    }

    fn get_ipc_handle(&self, memory: &MemoryPointer) -> Result<IpcHandle, EmmError> {
        let _span = self
            .observer
            .span("get_ipc_handle", self.device, memory.size());
        self.inner.get_ipc_handle(memory)
    }

    fn get_memory_info(&self) -> Result<MemoryInfo, EmmError> {
        self.inner.get_memory_info()
    }

    fn reset(&self) -> Result<(), EmmError> {
        let _span = self.observer.span("reset", self.device, 0);
        let r = self.inner.reset();
        self.observer.reset();
        r
    }

    fn defer_cleanup(&self) -> Result<DeferCleanup, EmmError> {
        self.inner.defer_cleanup()
    }

    fn interface_version(&self) -> u32 {
        self.inner.interface_version()
    }

    fn deallocations(&self) -> Option<&Arc<PendingDeallocs>> {
        self.inner.deallocations()
    }

    fn holdings(&self) -> Option<&dyn Holdings> {
        self.inner.holdings().map(|_| self as &dyn Holdings)
    }

    fn records(&self) -> Option<&dyn Records> {
        // The adaptor's own records (a `stats` or `history` adaptor), else the inner manager's.
        Some(self)
    }

    fn exports(&self) -> Option<&dyn Exports> {
        self.inner.exports().map(|_| self as &dyn Exports)
    }

    fn sleeper(&self) -> Option<&dyn Sleeper> {
        self.inner.sleeper()
    }
}

/// The inner manager's, with `trim` in a span.
impl Holdings for Adapted {
    fn trim(&self) -> Result<usize, EmmError> {
        let _span = self.observer.span("trim", self.device, 0);
        self.inner.holdings().map_or(Ok(0), |h| h.trim())
    }

    fn pool_stats(&self) -> PoolReport {
        self.inner
            .holdings()
            .map(|h| h.pool_stats())
            .unwrap_or_default()
    }

    fn free_space(&self) -> Option<FreeSpace> {
        self.inner.holdings()?.free_space()
    }

    fn segments(&self) -> Option<Vec<HeldSegment>> {
        self.inner.holdings()?.segments()
    }
}

impl Records for Adapted {
    fn history(&self) -> Option<HistoryRecord> {
        (self.observer.history()).or_else(|| self.inner.records()?.history())
    }

    fn records_stacks(&self) -> bool {
        self.observer.stacks() || self.inner.records().is_some_and(|r| r.records_stacks())
    }

    fn usage(&self) -> Option<Usage> {
        (self.observer.usage()).or_else(|| self.inner.records()?.usage())
    }
}

/// The inner manager's, with shared memory observed and wrapped like every allocation.
impl Exports for Adapted {
    fn export_pool(&self) -> Result<PoolExport, EmmError> {
        self.inner_exports()?.export_pool()
    }

    fn export_mapped(&self, memory: &MemoryPointer) -> Result<MappedExport, EmmError> {
        self.inner_exports()?.export_mapped(memory)
    }

    fn memalloc_shared(&self, bytes: usize) -> Result<MemoryPointer, EmmError> {
        let inner = self.inner_exports()?;
        let p = self.observe(
            "memalloc_shared",
            MemoryKind::Device,
            bytes,
            None,
            || inner.memalloc_shared(bytes),
            |p| p.device_ptr().0,
        )?;
        Ok(self.wrap_device(p, MemoryKind::Device))
    }
}

impl Adapted {
    /// The inner manager's exports ([`MemoryManager::exports`] hands out this adaptor's only
    /// where the inner manager has them).
    fn inner_exports(&self) -> Result<&dyn Exports, EmmError> {
        self.inner.exports().ok_or_else(|| EmmError::NotSupported {
            operation: "exports",
            manager: format!("{}(...)", self.name),
            advice: "the manager under the adaptor exports nothing; ask MemoryManager::exports \
                     before using an adaptor's exports",
        })
    }
}

/// A factory whose managers are the inner factory's, wrapped in adaptors (innermost first).
pub(crate) struct AdaptedFactory {
    inner: Arc<dyn ManagerFactory>,
    adaptors: Vec<Adaptor>,
    name: String,
    /// The log files, opened once and shared by every context.
    logs: Mutex<Vec<(PathBuf, Arc<Log>)>>,
}

impl fmt::Debug for AdaptedFactory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdaptedFactory")
            .field("name", &self.name)
            .field("adaptors", &self.adaptors)
            .finish()
    }
}

impl AdaptedFactory {
    pub(crate) fn new(inner: Arc<dyn ManagerFactory>, adaptors: Vec<Adaptor>) -> AdaptedFactory {
        let name = adaptors.iter().fold(inner.name().to_owned(), |acc, a| {
            format!("{}({acc})", a.name())
        });
        AdaptedFactory {
            inner,
            adaptors,
            name,
            logs: Mutex::new(Vec::new()),
        }
    }

    fn log(&self, path: &PathBuf) -> Result<Arc<Log>, EmmError> {
        let mut logs = lock(&self.logs);
        if let Some((_, log)) = logs.iter().find(|(p, _)| p == path) {
            return Ok(Arc::clone(log));
        }
        let log = Arc::new(Log::create(path)?);
        log::register(&log);
        logs.push((path.clone(), Arc::clone(&log)));
        Ok(log)
    }
}

impl ManagerFactory for AdaptedFactory {
    fn name(&self) -> &str {
        &self.name
    }

    fn interface_version(&self) -> u32 {
        self.inner.interface_version()
    }

    fn create(&self, cx: &ManagerContext) -> Result<Box<dyn MemoryManager>, EmmError> {
        let adapted = |inner, adaptor: &Adaptor| -> Result<Adapted, EmmError> {
            let log = match adaptor {
                Adaptor::Log(path) => Some(self.log(path)?),
                _ => None,
            };
            Ok(Adapted::new(inner, adaptor, cx, log))
        };
        let (outermost, inner_adaptors) = self
            .adaptors
            .split_last()
            .expect("the runtime wraps only with at least one adaptor");
        let mut inner: Arc<dyn MemoryManager> = Arc::from(self.inner.create(cx)?);
        for adaptor in inner_adaptors {
            inner = Arc::new(adapted(inner, adaptor)?);
        }
        Ok(Box::new(adapted(inner, outermost)?))
    }
}
