//! The `log` adaptor: one CSV line per allocation and free, in RMM's replay columns and more,
//! and the parser [`crate::replay`] reads such logs (and RMM's) with.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use driver_sys::{EventHandle, StreamHandle};

use crate::adaptors::{Event, Observer};
use crate::contract::factory::ManagerContext;
use crate::contract::info::{MemoryInfo, MemoryKind};
use crate::error::EmmError;
use crate::sync::{Mutex, lock};

/// The header of the CSV log: RMM's replay columns (`Thread,Time,Action,Pointer,Size,Stream`)
/// (`Stream` is the handle of the stream a `memalloc_on` allocation was made on, in
/// hexadecimal, on its allocation's line and its free's; `-` for memory allocated without a
/// stream), followed by the device, the manager's free and total memory, the allocations live after
/// the event, its start and end (nanoseconds since the log opened), its duration, the
/// kind of memory, and `Reached`: how far the GPU had got through the stream's work when the
/// event came, as the start time (nanoseconds since the log opened) of the latest logged
/// event whose work on that stream had completed, or the event's own start where the stream
/// was idle then (`-` for memory without a stream, and while the stream is captured). A replay
/// queues work on its streams with these times so that frees become reusable elsewhere when
/// they did in the recorded run
/// ([`Replayer`](crate::replay::Replayer)).
pub const LOG_HEADER: &str = "Thread,Time,Action,Pointer,Size,Stream,Device,Free,Total,Current allocations,Start,End,Elapsed,Kind,Reached";

pub(super) struct LogFile {
    pub(super) out: std::io::BufWriter<std::fs::File>,
    pub(super) path: PathBuf,
    pub(super) live: usize,
    /// Free and total memory, sampled at most once a millisecond.
    pub(super) info: Option<(Instant, MemoryInfo)>,
    pub(super) failed: Option<std::io::Error>,
    /// The stream of each live stream-ordered allocation, by (device, address): a free's
    /// line names the stream its allocation was made on.
    pub(super) streams: HashMap<(u32, u64), u64>,
}

/// The log's writer, shared by every context of a runtime.
pub(super) struct Log {
    pub(super) opened: Instant,
    pub(super) file: Mutex<LogFile>,
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
        // A static, so std's atomic (loom's cannot be one); it orders nothing else.
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    };
}

/// Every log this process opened, so that [`flush_all`] reaches them: a process that ends
/// without dropping its runtime (a Python interpreter's) would lose what they buffered. A
/// static, so std's lock (loom's cannot be one).
static OPEN_LOGS: std::sync::Mutex<Vec<std::sync::Weak<Log>>> = std::sync::Mutex::new(Vec::new());

/// Writes out what every open log buffered.
pub(crate) fn flush_all() {
    let logs: Vec<Arc<Log>> = {
        let mut open = OPEN_LOGS.lock().unwrap_or_else(|p| p.into_inner());
        open.retain(|l| l.strong_count() > 0);
        open.iter().filter_map(std::sync::Weak::upgrade).collect()
    };
    for log in logs {
        log.flush();
    }
}

/// Registers `log` for [`flush_all`].
pub(super) fn register(log: &Arc<Log>) {
    let mut open = OPEN_LOGS.lock().unwrap_or_else(|p| p.into_inner());
    open.retain(|l| l.strong_count() > 0);
    open.push(Arc::downgrade(log));
}

impl Log {
    pub(super) fn create(path: &PathBuf) -> Result<Log, EmmError> {
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
                streams: HashMap::new(),
            }),
        })
    }

    /// Nanoseconds from the log's opening to `t` (0 for none).
    fn ns(&self, t: Option<Instant>) -> u64 {
        t.map_or(0, |t| t.duration_since(self.opened).as_nanos() as u64)
    }

    fn write(
        &self,
        action: &str,
        e: &Event,
        info: impl FnOnce() -> Option<MemoryInfo>,
        delta: isize,
        progress: Option<&Progress>,
    ) {
        let (start, end) = (self.ns(e.start), self.ns(e.end));
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
        let key = (e.device.0, e.addr.unwrap_or(0));
        let stream = match (action, e.stream) {
            ("allocate", Some(s)) => {
                f.streams.insert(key, s.raw());
                Some(s.raw())
            }
            ("free", _) => f.streams.remove(&key),
            (_, s) => s.map(|s| s.raw()),
        };
        // An allocation's line says what was read before the manager served it
        // (`LogObserver::before_on_stream`); a free's stream may be gone, so a free's line
        // reads the markers already recorded there, with no new one.
        let reached = Reached(if action == "allocate" {
            e.before
        } else {
            stream.zip(progress).and_then(|(s, p)| p.last_reached(s))
        });
        let stream = Stream(stream);
        let line = format!(
            "{thread},{:.9},{action},{:#x},{},{stream},{},{},{},{live},{start},{end},{},{},{reached}\n",
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

    pub(super) fn flush(&self) {
        let mut f = lock(&self.file);
        if let Err(e) = f.out.flush() {
            tracing::error!(path = %f.path.display(), error = %e, "the log adaptor cannot flush its file");
        }
    }
}

/// The `Reached` column of a line: nanoseconds, or `-` where the log cannot say.
struct Reached(Option<u64>);

impl fmt::Display for Reached {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(ns) => write!(f, "{ns}"),
            None => f.write_str("-"),
        }
    }
}

/// A new marker is recorded on a stream once this many nanoseconds passed since its last: the
/// `Reached` column's resolution, at a few driver calls per marker.
const MARKER_GAP_NS: u64 = 20_000;

/// The most markers one stream has waiting: past it (a GPU that lags the host by more than
/// [`MARKER_GAP_NS`] times this, or a simulated one whose streams run only when synchronised)
/// the column's resolution coarsens instead of the events piling up.
const MAX_PENDING_MARKERS: usize = 1024;

/// Markers waiting on one stream, oldest first, with the log time each was recorded at, and
/// the time of the latest one found complete.
#[derive(Default)]
struct StreamMarks {
    pending: VecDeque<(EventHandle, u64)>,
    reached: u64,
}

/// How far the GPU got through each stream's work, for the log's `Reached` column: an event
/// (a marker) recorded on the stream every [`MARKER_GAP_NS`] at most, and queried, oldest first,
/// at each line of that stream. One per context; its lock is a leaf under the log file's, and
/// its driver calls are made inside the context's liveness.
pub(super) struct Progress {
    cx: ManagerContext,
    state: Mutex<ProgressState>,
}

#[derive(Default)]
struct ProgressState {
    streams: HashMap<u64, StreamMarks>,
    /// Markers that completed, for the next ones.
    spare: Vec<EventHandle>,
    /// A driver call failed: the column says `-` from then on (logged once).
    failed: bool,
}

impl Progress {
    pub(super) fn new(cx: ManagerContext) -> Progress {
        Progress {
            cx,
            state: Mutex::new(ProgressState::default()),
        }
    }

    /// How far the GPU got through the stream of handle `stream`, from the markers already
    /// recorded there (event queries only: the stream itself may be gone by now, as it may be
    /// when its memory is freed).
    fn last_reached(&self, stream: u64) -> Option<u64> {
        let mut state = lock(&self.state);
        if state.failed {
            return None;
        }
        let _live = self.cx.liveness.enter()?;
        let ProgressState { streams, spare, .. } = &mut *state;
        let marks = streams.get_mut(&stream)?;
        let polled = poll(&*self.cx.driver, self.cx.context, marks, spare);
        match polled {
            Ok(reached) => Some(reached),
            Err(e) => {
                tracing::warn!(device = %self.cx.device, error = %e, "the log adaptor cannot follow the GPU's progress; its Reached column says '-' from now on");
                state.failed = true;
                None
            }
        }
    }

    /// The log time of the latest marker on `stream` that completed, after recording a new
    /// marker at `now` (log nanoseconds) where the last is older than [`MARKER_GAP_NS`]; `now`
    /// itself where the stream is idle (no marker is needed then).
    /// `None` where the stream is captured (a marker would join the graph), the context is
    /// gone, or the driver refused a call.
    fn reached(&self, stream: StreamHandle, now: u64) -> Option<u64> {
        let mut state = lock(&self.state);
        if state.failed {
            return None;
        }
        let _live = self.cx.liveness.enter()?;
        let (driver, ctx) = (&self.cx.driver, self.cx.context);
        let result = (|| -> Result<Option<u64>, driver_sys::DriverError> {
            if self.cx.stream_is_captured(stream)? {
                return Ok(None);
            }
            let ProgressState { streams, spare, .. } = &mut *state;
            let marks = streams.entry(stream.raw()).or_default();
            // An idle stream has done all the work launched there before `now`, however long
            // ago its last marker was recorded (a thread that waited for its stream).
            if driver.stream_query(ctx, stream)? {
                spare.extend(marks.pending.drain(..).map(|(event, _)| event));
                marks.reached = now;
                return Ok(Some(now));
            }
            poll(&**driver, ctx, marks, spare)?;
            let last = marks.pending.back().map_or(marks.reached, |&(_, at)| at);
            let due = marks.pending.is_empty() || now.saturating_sub(last) >= MARKER_GAP_NS;
            if due && marks.pending.len() < MAX_PENDING_MARKERS {
                let event = match spare.pop() {
                    Some(e) => e,
                    None => driver.event_create(ctx, driver_sys::event_flags::DISABLE_TIMING)?,
                };
                if let Err(e) = driver.event_record(ctx, event, stream) {
                    spare.push(event);
                    return Err(e);
                }
                marks.pending.push_back((event, now));
            }
            Ok(Some(marks.reached))
        })();
        result.unwrap_or_else(|e| {
            tracing::warn!(device = %self.cx.device, error = %e, "the log adaptor cannot follow the GPU's progress; its Reached column says '-' from now on");
            state.failed = true;
            None
        })
    }
}

/// Takes the completed markers off the front of `marks` (into `spare`), oldest first; returns
/// the time of the latest one complete.
fn poll(
    driver: &dyn driver_sys::Driver,
    ctx: driver_sys::ContextHandle,
    marks: &mut StreamMarks,
    spare: &mut Vec<EventHandle>,
) -> Result<u64, driver_sys::DriverError> {
    while let Some(&(event, at)) = marks.pending.front() {
        if !driver.event_query(ctx, event)? {
            break;
        }
        marks.pending.pop_front();
        marks.reached = at;
        spare.push(event);
    }
    Ok(marks.reached)
}

impl Drop for Progress {
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        let state = std::mem::take(&mut *lock(&self.state));
        let Some(_live) = self.cx.liveness.enter() else {
            // The context's destruction took the events.
            return;
        };
        let pending = state.streams.into_values().flat_map(|m| m.pending);
        for event in state.spare.into_iter().chain(pending.map(|(e, _)| e)) {
            // SAFETY: an event this probe created and destroys once; a pending one may still
            // be recorded on its stream, which the driver allows (it is freed once complete).
            if let Err(e) = unsafe { self.cx.driver.event_destroy(self.cx.context, event) } {
                tracing::debug!(device = %self.cx.device, error = %e, "destroying a log marker failed");
            }
        }
    }
}

/// The `Stream` column of a line: the stream's handle in hexadecimal for stream-ordered
/// memory (`memalloc_on`), `-` for memory allocated without a stream.
struct Stream(Option<u64>);

impl fmt::Display for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(s) => write!(f, "{s:#x}"),
            None => f.write_str("-"),
        }
    }
}

pub(super) type InfoFn = dyn Fn() -> Option<MemoryInfo> + Send + Sync;

/// The log observer of one context: the shared file plus the manager, for free and total, and
/// the context's streams' progress.
pub(super) struct LogObserver {
    pub(super) log: Arc<Log>,
    /// Reads the inner manager's memory info.
    pub(super) info: Box<InfoFn>,
    pub(super) progress: Progress,
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
    /// How far the GPU had got through `stream` when the allocation came: read before the
    /// manager serves it, since a pool that grows may wait for the stream's work, and a
    /// reading after that would find the stream idle where the pool found it busy. The
    /// stream is live for the call (its caller's promise).
    fn before_on_stream(&self, stream: StreamHandle, start: Option<Instant>) -> Option<u64> {
        self.progress.reached(stream, self.log.ns(start))
    }

    fn allocated(&self, e: &Event) {
        let (action, delta) = if e.addr.is_some() {
            ("allocate", 1)
        } else {
            ("allocate failure", 0)
        };
        self.log
            .write(action, e, || self.info(), delta, Some(&self.progress));
    }

    fn freed(&self, e: &Event) {
        self.log
            .write("free", e, || self.info(), -1, Some(&self.progress));
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

/// Where the columns a replay reads stand in a log: read from its header by name, so a log
/// with RMM's six columns, the `log` adaptor's fourteen, or the columns in another order reads
/// the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LogColumns {
    action: usize,
    pointer: usize,
    size: usize,
    stream: Option<usize>,
    kind: Option<usize>,
    /// `Time` (seconds) and `Start` (nanoseconds): when the event came.
    time: Option<usize>,
    start: Option<usize>,
    /// `Reached`: how far the GPU had got through the event's stream (nanoseconds).
    reached: Option<usize>,
    /// `Elapsed`: how long the manager's call took (nanoseconds).
    elapsed: Option<usize>,
}

/// One data line of a log, parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct LogLine {
    /// The action, in lower case (`allocate`, `free`, `allocate failure`, ...).
    pub(crate) action: String,
    /// The address in the recorded run.
    pub(crate) ptr: u64,
    /// Bytes.
    pub(crate) size: usize,
    /// The stream of stream-ordered memory (`None`: allocated without a stream, `-`).
    pub(crate) stream: Option<u64>,
    /// The kind of memory (device memory when the log has no kind column).
    pub(crate) kind: MemoryKind,
    /// When the event came, in nanoseconds since the log opened (`Start`, else `Time`).
    pub(crate) at: Option<u64>,
    /// The `Reached` column: nanoseconds, or `None` for `-` or a log without it.
    pub(crate) reached: Option<u64>,
    /// The `Elapsed` column: nanoseconds, or `None` for `-` or a log without it.
    pub(crate) elapsed: Option<u64>,
}

impl LogColumns {
    /// RMM's order (`Thread,Time,Action,Pointer,Size,Stream`), for a log without a header.
    pub(crate) const RMM: LogColumns = LogColumns {
        action: 2,
        pointer: 3,
        size: 4,
        stream: Some(5),
        kind: None,
        time: Some(1),
        start: None,
        reached: None,
        elapsed: None,
    };

    /// The columns a header line names, or `None` when `line` is not a header (its first field
    /// is not `Thread` and no field is `Action`). A header without `Action`, `Pointer` or
    /// `Size` is an error.
    pub(crate) fn from_header(line: &str) -> Option<Result<LogColumns, String>> {
        let names: Vec<String> = line
            .split(',')
            .map(|c| c.trim().to_ascii_lowercase())
            .collect();
        let is_header =
            names.first().is_some_and(|n| n == "thread") || names.iter().any(|n| n == "action");
        if !is_header {
            return None;
        }
        let find = |name: &str| names.iter().position(|n| n == name);
        let need = |name: &str| {
            find(name).ok_or_else(|| {
                format!(
                    "the header {line:?} has no {name:?} column; a log needs Action, Pointer and Size"
                )
            })
        };
        Some((|| {
            Ok(LogColumns {
                action: need("action")?,
                pointer: need("pointer")?,
                size: need("size")?,
                stream: find("stream"),
                kind: find("kind"),
                time: find("time"),
                start: find("start"),
                reached: find("reached"),
                elapsed: find("elapsed"),
            })
        })())
    }
}

/// A hexadecimal number, with or without `0x`, as RMM and the `log` adaptor write pointers and
/// streams.
fn parse_hex(text: &str) -> Result<u64, std::num::ParseIntError> {
    let digits = text
        .strip_prefix("0x")
        .or_else(|| text.strip_prefix("0X"))
        .unwrap_or(text);
    u64::from_str_radix(digits, 16)
}

/// Parses one data line of a log (RMM's, or the `log` adaptor's) with the columns `cols`.
pub(crate) fn parse_log_line(line: &str, cols: &LogColumns) -> Result<LogLine, String> {
    let fields: Vec<&str> = line.split(',').map(str::trim).collect();
    let at = |i: usize, name: &str| {
        fields.get(i).copied().ok_or_else(|| {
            format!(
                "{} columns, and the {name} column is number {} (the header, or RMM's order \
                 Thread,Time,Action,Pointer,Size,Stream, says where each stands)",
                fields.len(),
                i + 1
            )
        })
    };
    let action = at(cols.action, "Action")?.to_ascii_lowercase();
    let ptr_text = at(cols.pointer, "Pointer")?;
    let ptr = parse_hex(ptr_text)
        .map_err(|e| format!("pointer {ptr_text:?} is not a hexadecimal address ({e})"))?;
    let size_text = at(cols.size, "Size")?;
    let size: usize = size_text
        .parse()
        .map_err(|e| format!("size {size_text:?}: {e}"))?;
    // A log cut short after its Size column (RMM's five-column variant) has no streams.
    let stream = match cols.stream.and_then(|i| fields.get(i).copied()) {
        None | Some("" | "-") => None,
        Some(text) => Some(parse_hex(text).map_err(|e| {
            format!("stream {text:?} is neither '-' nor a hexadecimal handle ({e})")
        })?),
    };
    let kind = match cols.kind {
        Some(i) => {
            let k = at(i, "Kind")?;
            MemoryKind::parse(k).ok_or_else(|| {
                format!("unknown kind {k:?}; a log names device, pinned, mapped or pin")
            })?
        }
        None => MemoryKind::Device,
    };
    let number = |i: Option<usize>, name: &str| -> Result<Option<u64>, String> {
        match i.and_then(|i| fields.get(i).copied()) {
            None | Some("" | "-") => Ok(None),
            Some(text) => text
                .parse()
                .map(Some)
                .map_err(|e| format!("{name} {text:?} is not a count of nanoseconds ({e})")),
        }
    };
    let at = match number(cols.start, "Start")? {
        Some(ns) => Some(ns),
        None => match cols.time.and_then(|i| fields.get(i).copied()) {
            None | Some("" | "-") => None,
            // Seconds, as emm writes it; RMM's logs write a clock time, which says nothing a
            // replay uses.
            Some(text) => text
                .parse::<f64>()
                .ok()
                .filter(|s| s.is_finite() && *s >= 0.0)
                .map(|s| (s * 1e9) as u64),
        },
    };
    let reached = number(cols.reached, "Reached")?;
    let elapsed = number(cols.elapsed, "Elapsed")?;
    Ok(LogLine {
        action,
        ptr,
        size,
        stream,
        kind,
        at,
        reached,
        elapsed,
    })
}
