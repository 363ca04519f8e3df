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
//!
//! The wrapping costs one allocation per memory object (the wrapper); managers with no
//! adaptor pay nothing.

#![allow(unsafe_code)]

use std::fmt;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use driver_sys::{DevicePtr, HostPtr};

use crate::host::{HostMemory, HostOwner, MappedMemory, PinnedMemory};
use crate::ipc::IpcHandle;
use crate::manager::{ManagerContext, ManagerFactory, MemoryManager};
use crate::pending::{DeferCleanup, PendingDeallocs};
use crate::pointer::ReleaseHook;
use crate::pool::PoolReport;
use crate::sync::{AtomicU64, AtomicUsize, Mutex, Ordering, lock};
use crate::{EmmError, MemoryInfo, MemoryPointer};
use driver_sys::DeviceOrdinal;

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
            ("trace", None) => Ok(Adaptor::Trace),
            ("limit", Some(bytes)) => crate::config::parse_bytes(bytes)
                .map(Adaptor::Limit)
                .map_err(|e| format!("limit: {e}")),
            ("log", Some(path)) if !path.is_empty() => Ok(Adaptor::Log(PathBuf::from(path))),
            ("limit", None) | ("log", None | Some(_)) => Err(format!(
                "'{name}' needs a value: limit=<bytes> (such as limit=8GiB), log=<path>"
            )),
            (other, _) => Err(format!(
                "unknown adaptor '{other}'; the adaptors are stats, limit=<bytes>, log=<path> and trace"
            )),
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Adaptor::Stats => "stats",
            Adaptor::Limit(_) => "limit",
            Adaptor::Log(_) => "log",
            Adaptor::Trace => "trace",
        }
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
}

impl MemoryKind {
    const ALL: [MemoryKind; 4] = [
        MemoryKind::Device,
        MemoryKind::Pinned,
        MemoryKind::Mapped,
        MemoryKind::Pin,
    ];

    fn index(self) -> usize {
        self as usize
    }

    /// The name used in logs.
    pub fn name(self) -> &'static str {
        match self {
            MemoryKind::Device => "device",
            MemoryKind::Pinned => "pinned",
            MemoryKind::Mapped => "mapped",
            MemoryKind::Pin => "pin",
        }
    }

    fn parse(s: &str) -> Option<MemoryKind> {
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
}

impl Usage {
    /// The statistics of `kind`.
    pub fn of(&self, kind: MemoryKind) -> &KindUsage {
        match kind {
            MemoryKind::Device => &self.device,
            MemoryKind::Pinned => &self.pinned,
            MemoryKind::Mapped => &self.mapped,
            MemoryKind::Pin => &self.pin,
        }
    }
}

/// What an adaptor is told. Every method has a default that does nothing.
trait Observer: Send + Sync + fmt::Debug {
    /// Before the inner manager is asked; an error refuses the allocation.
    fn admit(
        &self,
        _device: DeviceOrdinal,
        _kind: MemoryKind,
        _bytes: usize,
    ) -> Result<(), EmmError> {
        Ok(())
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
    /// Whether events need their times.
    fn timed(&self) -> bool {
        false
    }
    /// The manager was reset (the log flushes its file).
    fn reset(&self) {}
}

/// One allocation or free, as adaptors see it.
#[derive(Clone, Copy, Debug)]
struct Event {
    device: DeviceOrdinal,
    kind: MemoryKind,
    addr: Option<u64>,
    bytes: usize,
    start: Option<Instant>,
    end: Option<Instant>,
}

#[derive(Debug, Default)]
struct KindCounters {
    current_bytes: AtomicUsize,
    peak_bytes: AtomicUsize,
    total_bytes: AtomicU64,
    current_count: AtomicUsize,
    peak_count: AtomicUsize,
    total_count: AtomicU64,
}

#[derive(Debug, Default)]
struct Stats {
    kinds: [KindCounters; 4],
}

impl Observer for Stats {
    fn allocated(&self, e: &Event) {
        if e.addr.is_none() {
            return;
        }
        let k = &self.kinds[e.kind.index()];
        let bytes = k.current_bytes.fetch_add(e.bytes, Ordering::Relaxed) + e.bytes;
        k.peak_bytes.fetch_max(bytes, Ordering::Relaxed);
        k.total_bytes.fetch_add(e.bytes as u64, Ordering::Relaxed);
        let count = k.current_count.fetch_add(1, Ordering::Relaxed) + 1;
        k.peak_count.fetch_max(count, Ordering::Relaxed);
        k.total_count.fetch_add(1, Ordering::Relaxed);
    }

    fn freed(&self, e: &Event) {
        let k = &self.kinds[e.kind.index()];
        k.current_bytes.fetch_sub(e.bytes, Ordering::Relaxed);
        k.current_count.fetch_sub(1, Ordering::Relaxed);
    }

    fn usage(&self) -> Option<Usage> {
        let read = |k: &KindCounters| KindUsage {
            current_bytes: k.current_bytes.load(Ordering::Relaxed),
            peak_bytes: k.peak_bytes.load(Ordering::Relaxed),
            total_bytes: k.total_bytes.load(Ordering::Relaxed),
            current_count: k.current_count.load(Ordering::Relaxed),
            peak_count: k.peak_count.load(Ordering::Relaxed),
            total_count: k.total_count.load(Ordering::Relaxed),
        };
        Some(Usage {
            device: read(&self.kinds[0]),
            pinned: read(&self.kinds[1]),
            mapped: read(&self.kinds[2]),
            pin: read(&self.kinds[3]),
        })
    }
}

#[derive(Debug)]
struct Limit {
    limit: usize,
    in_use: AtomicUsize,
}

impl Observer for Limit {
    fn admit(&self, device: DeviceOrdinal, kind: MemoryKind, bytes: usize) -> Result<(), EmmError> {
        if kind != MemoryKind::Device {
            return Ok(());
        }
        let before = self.in_use.fetch_add(bytes, Ordering::AcqRel);
        let would_be = before.saturating_add(bytes);
        if would_be > self.limit {
            self.in_use.fetch_sub(bytes, Ordering::AcqRel);
            tracing::warn!(%device, requested = bytes, in_use = before, limit = self.limit, "allocation refused by the limit adaptor");
            return Err(EmmError::OverLimit {
                device,
                requested: bytes,
                would_be,
                limit: self.limit,
            });
        }
        Ok(())
    }

    fn allocated(&self, e: &Event) {
        if e.addr.is_none() && e.kind == MemoryKind::Device {
            // Admitted, then refused by the manager: give the bytes back.
            self.in_use.fetch_sub(e.bytes, Ordering::AcqRel);
        }
    }

    fn freed(&self, e: &Event) {
        if e.kind == MemoryKind::Device {
            self.in_use.fetch_sub(e.bytes, Ordering::AcqRel);
        }
    }
}

#[derive(Debug)]
struct Trace;

impl Observer for Trace {
    fn span(
        &self,
        op: &'static str,
        device: DeviceOrdinal,
        bytes: usize,
    ) -> Option<tracing::span::EnteredSpan> {
        Some(tracing::debug_span!("emm.call", op, %device, bytes).entered())
    }

    fn allocated(&self, e: &Event) {
        match e.addr {
            Some(addr) => {
                tracing::debug!(device = %e.device, kind = e.kind.name(), bytes = e.bytes, addr = format_args!("{addr:#x}"), "allocated")
            }
            None => {
                tracing::debug!(device = %e.device, kind = e.kind.name(), bytes = e.bytes, "allocation failed")
            }
        }
    }

    fn freed(&self, e: &Event) {
        tracing::debug!(device = %e.device, kind = e.kind.name(), bytes = e.bytes, addr = format_args!("{:#x}", e.addr.unwrap_or(0)), "freed");
    }
}

/// The header of the CSV log: RMM's replay columns (`Thread,Time,Action,Pointer,Size,Stream`)
/// followed by the device, the manager's free and total memory, the allocations live after
/// the event, its start and end (nanoseconds since the log opened), its duration, and the
/// kind of memory.
pub const LOG_HEADER: &str = "Thread,Time,Action,Pointer,Size,Stream,Device,Free,Total,Current allocations,Start,End,Elapsed,Kind";

struct LogFile {
    out: std::io::BufWriter<std::fs::File>,
    path: PathBuf,
    live: usize,
    /// Free and total memory, sampled at most once a millisecond.
    info: Option<(Instant, MemoryInfo)>,
    failed: Option<std::io::Error>,
}

/// The log's writer, shared by every context of a runtime.
struct Log {
    opened: Instant,
    file: Mutex<LogFile>,
}

impl fmt::Debug for Log {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Log")
            .field("path", &lock(&self.file).path)
            .finish()
    }
}

thread_local! {
    static LOG_THREAD: u64 = {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    };
}

impl Log {
    fn create(path: &PathBuf) -> Result<Log, EmmError> {
        let file = std::fs::File::create(path).map_err(|e| EmmError::InvalidArgument {
            what: "the log adaptor's path",
            reason: format!(
                "cannot create {}: {e}; give a writable path (log=<path>)",
                path.display()
            ),
        })?;
        let mut out = std::io::BufWriter::new(file);
        writeln!(out, "{LOG_HEADER}").map_err(|e| EmmError::InvalidArgument {
            what: "the log adaptor's path",
            reason: format!("cannot write {}: {e}", path.display()),
        })?;
        Ok(Log {
            opened: Instant::now(),
            file: Mutex::new(LogFile {
                out,
                path: path.clone(),
                live: 0,
                info: None,
                failed: None,
            }),
        })
    }

    fn write(
        &self,
        action: &str,
        e: &Event,
        info: impl FnOnce() -> Option<MemoryInfo>,
        delta: isize,
    ) {
        let ns =
            |t: Option<Instant>| t.map_or(0, |t| t.duration_since(self.opened).as_nanos() as u64);
        let (start, end) = (ns(e.start), ns(e.end));
        let thread = LOG_THREAD.with(|t| *t);
        let mut f = lock(&self.file);
        let now = Instant::now();
        let stale = f
            .info
            .is_none_or(|(t, _)| now.duration_since(t).as_micros() >= 1000);
        if stale && let Some(i) = info() {
            f.info = Some((now, i));
        }
        let mi = f.info.map(|(_, i)| i).unwrap_or_default();
        f.live = f.live.saturating_add_signed(delta);
        let live = f.live;
        let line = format!(
            "{thread},{:.9},{action},{:#x},{},0,{},{},{},{live},{start},{end},{},{}\n",
            start as f64 / 1e9,
            e.addr.unwrap_or(0),
            e.bytes,
            e.device.0,
            mi.free,
            mi.total,
            end.saturating_sub(start),
            e.kind.name(),
        );
        if f.failed.is_none()
            && let Err(err) = f.out.write_all(line.as_bytes())
        {
            tracing::error!(path = %f.path.display(), error = %err, "the log adaptor cannot write its file; later events are dropped");
            f.failed = Some(err);
        }
    }

    fn flush(&self) {
        let mut f = lock(&self.file);
        if let Err(e) = f.out.flush() {
            tracing::error!(path = %f.path.display(), error = %e, "the log adaptor cannot flush its file");
        }
    }
}

type InfoFn = dyn Fn() -> Option<MemoryInfo> + Send + Sync;

/// The log observer of one context: the shared file plus the manager, for free and total.
struct LogObserver {
    log: Arc<Log>,
    /// Reads the inner manager's memory info.
    info: Box<InfoFn>,
}

impl fmt::Debug for LogObserver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LogObserver")
            .field("log", &self.log)
            .finish()
    }
}

impl LogObserver {
    fn info(&self) -> Option<MemoryInfo> {
        (self.info)()
    }
}

impl Observer for LogObserver {
    fn allocated(&self, e: &Event) {
        let (action, delta) = if e.addr.is_some() {
            ("allocate", 1)
        } else {
            ("allocate failure", 0)
        };
        self.log.write(action, e, || self.info(), delta);
    }

    fn freed(&self, e: &Event) {
        self.log.write("free", e, || self.info(), -1);
    }

    fn timed(&self) -> bool {
        true
    }

    fn reset(&self) {
        self.log.flush();
    }
}

impl Drop for LogObserver {
    fn drop(&mut self) {
        self.log.flush();
    }
}

/// A manager wrapped in one adaptor.
pub struct Adapted {
    name: &'static str,
    inner: Arc<dyn MemoryManager>,
    observer: Arc<dyn Observer>,
    hook: Arc<dyn ReleaseHook>,
    device: DeviceOrdinal,
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
            start: now,
            end: now,
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
        device: DeviceOrdinal,
        log: Option<Arc<Log>>,
    ) -> Adapted {
        let observer: Arc<dyn Observer> = match adaptor {
            Adaptor::Stats => Arc::new(Stats::default()),
            Adaptor::Limit(limit) => Arc::new(Limit {
                limit: *limit,
                in_use: AtomicUsize::new(0),
            }),
            Adaptor::Trace => Arc::new(Trace),
            Adaptor::Log(_) => {
                let weak = Arc::downgrade(&inner);
                Arc::new(LogObserver {
                    log: log.expect("the factory opens the log"),
                    info: Box::new(move || weak.upgrade().and_then(|m| m.get_memory_info().ok())),
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
        }
    }

    fn observe<T>(
        &self,
        op: &'static str,
        kind: MemoryKind,
        bytes: usize,
        call: impl FnOnce() -> Result<T, EmmError>,
        addr: impl Fn(&T) -> u64,
    ) -> Result<T, EmmError> {
        let _span = self.observer.span(op, self.device, bytes);
        self.observer.admit(self.device, kind, bytes)?;
        let timed = self.observer.timed();
        let start = timed.then(Instant::now);
        let result = call();
        let end = timed.then(Instant::now);
        self.observer.allocated(&Event {
            device: self.device,
            kind,
            addr: result.as_ref().ok().map(&addr),
            bytes,
            start,
            end,
        });
        result
    }

    fn wrap_device(&self, inner: MemoryPointer, kind: MemoryKind) -> MemoryPointer {
        MemoryPointer::wrapping(inner, Arc::clone(&self.hook), kind as u64)
    }

    fn wrap_host(&self, memory: HostMemory, kind: MemoryKind) -> HostMemory {
        match memory {
            HostMemory::Mapped(m) => {
                let host = m.host_ptr();
                let device = self.wrap_device(m.device().clone(), kind);
                HostMemory::Mapped(MappedMemory::new(host, device))
            }
            HostMemory::Pinned(p) => {
                let observer = Arc::clone(&self.observer);
                let device = self.device;
                let (host, size, owner) = (p.host_ptr(), p.size(), p.owner().cloned());
                HostMemory::Pinned(PinnedMemory::with_release(
                    host,
                    size,
                    owner,
                    move |h: HostPtr, s| {
                        drop(p);
                        let now = observer.timed().then(Instant::now);
                        observer.freed(&Event {
                            device,
                            kind,
                            addr: Some(h.0 as u64),
                            bytes: s,
                            start: now,
                            end: now,
                        });
                    },
                ))
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
            || self.inner.memalloc(bytes),
            |p| p.device_ptr().0,
        )?;
        Ok(self.wrap_device(p, MemoryKind::Device))
    }

    fn memhostalloc(
        &self,
        bytes: usize,
        mapped: bool,
        portable: bool,
        wc: bool,
    ) -> Result<HostMemory, EmmError> {
        let kind = host_kind(mapped);
        let m = self.observe(
            "memhostalloc",
            kind,
            bytes,
            || self.inner.memhostalloc(bytes, mapped, portable, wc),
            |m| m.host_ptr().0 as u64,
        )?;
        Ok(self.wrap_host(m, kind))
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
        let m = self.observe("mempin", MemoryKind::Pin, size, call, |m| {
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

    fn trim(&self) -> Result<usize, EmmError> {
        let _span = self.observer.span("trim", self.device, 0);
        self.inner.trim()
    }

    fn pool_stats(&self) -> PoolReport {
        self.inner.pool_stats()
    }

    fn usage(&self) -> Option<Usage> {
        self.observer.usage().or_else(|| self.inner.usage())
    }

    fn export_pool(&self) -> Result<crate::PoolExport, EmmError> {
        self.inner.export_pool()
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
            Ok(Adapted::new(inner, adaptor, cx.device, log))
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

/// Parses a CSV log written by the `log` adaptor, or RMM's replay format (its first six
/// columns), into events for [`crate::replay::replay`].
pub(crate) fn parse_log_line(
    line: &str,
) -> Result<Option<(String, u64, usize, MemoryKind)>, String> {
    let cols: Vec<&str> = line.split(',').map(str::trim).collect();
    if cols.len() < 6 {
        return Err(format!(
            "{} columns; a log line has at least 6 ({})",
            cols.len(),
            &LOG_HEADER[..36]
        ));
    }
    if cols[0] == "Thread" {
        return Ok(None);
    }
    let action = cols[2].to_ascii_lowercase();
    let ptr = cols[3];
    let ptr = ptr
        .strip_prefix("0x")
        .map_or_else(|| ptr.parse::<u64>(), |h| u64::from_str_radix(h, 16))
        .map_err(|e| format!("pointer {:?}: {e}", cols[3]))?;
    let size: usize = cols[4]
        .parse()
        .map_err(|e| format!("size {:?}: {e}", cols[4]))?;
    let kind = cols
        .get(13)
        .map(|k| MemoryKind::parse(k).ok_or_else(|| format!("unknown kind {k:?}")))
        .transpose()?
        .unwrap_or(MemoryKind::Device);
    Ok(Some((action, ptr, size, kind)))
}
