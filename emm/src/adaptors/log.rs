//! The `log` adaptor: one CSV line per allocation and free, in RMM's replay columns and more,
//! and the parser [`crate::replay`] reads such logs (and RMM's) with.

use std::collections::HashMap;
use std::fmt;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use crate::adaptors::{Event, Observer};
use crate::contract::info::{MemoryInfo, MemoryKind};
use crate::error::EmmError;
use crate::sync::{Mutex, lock};

/// The header of the CSV log: RMM's replay columns (`Thread,Time,Action,Pointer,Size,Stream`)
/// (`Stream` is the handle of the stream a `memalloc_on` allocation was made on, in
/// hexadecimal, on its allocation's line and its free's; `-` for memory allocated without a
/// stream), followed by the device, the manager's free and total memory, the allocations live after
/// the event, its start and end (nanoseconds since the log opened), its duration, and the
/// kind of memory.
pub const LOG_HEADER: &str = "Thread,Time,Action,Pointer,Size,Stream,Device,Free,Total,Current allocations,Start,End,Elapsed,Kind";

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
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    };
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
        let key = (e.device.0, e.addr.unwrap_or(0));
        let stream = match (action, e.stream) {
            ("allocate", Some(s)) => {
                f.streams.insert(key, s.raw());
                Some(s.raw())
            }
            ("free", _) => f.streams.remove(&key),
            (_, s) => s.map(|s| s.raw()),
        };
        let stream = Stream(stream);
        let line = format!(
            "{thread},{:.9},{action},{:#x},{},{stream},{},{},{},{live},{start},{end},{},{}\n",
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

/// The log observer of one context: the shared file plus the manager, for free and total.
pub(super) struct LogObserver {
    pub(super) log: Arc<Log>,
    /// Reads the inner manager's memory info.
    pub(super) info: Box<InfoFn>,
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
}

impl LogColumns {
    /// RMM's order (`Thread,Time,Action,Pointer,Size,Stream`), for a log without a header.
    pub(crate) const RMM: LogColumns = LogColumns {
        action: 2,
        pointer: 3,
        size: 4,
        stream: Some(5),
        kind: None,
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
    Ok(LogLine {
        action,
        ptr,
        size,
        stream,
        kind,
    })
}
