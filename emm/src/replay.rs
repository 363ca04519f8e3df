//! Replays an allocation log against a context: the `log` adaptor's CSV ([`LOG_HEADER`](crate::adaptors::LOG_HEADER))
//! or RMM's replay format (`Thread,Time,Action,Pointer,Size,Stream`). A log recorded from a
//! real program on the GPU can be replayed on the simulator, under any manager.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::adaptors::log::{LogColumns, parse_log_line};
use crate::contract::info::MemoryKind;
use crate::error::EmmError;
use crate::memory::host::HostMemory;
use crate::memory::pointer::MemoryPointer;
use crate::runtime::context::Context;

/// What one log line asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Allocate `size` bytes that the log calls `ptr`.
    Allocate,
    /// Free what the log called `ptr`.
    Free,
}

/// One event of a log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplayEvent {
    /// Allocate or free.
    pub action: Action,
    /// The address in the recorded run (a name for the allocation, here).
    pub ptr: u64,
    /// Bytes.
    pub size: usize,
    /// The kind of memory.
    pub kind: MemoryKind,
}

/// Parses a log. A header line says where the columns stand (by name: `Action`, `Pointer`,
/// `Size`, and `Kind` where there is one); without a header, RMM's order is assumed. Pointers
/// are hexadecimal, with or without `0x`. `allocate failure` lines and empty lines are
/// skipped.
pub fn parse_log(text: &str) -> Result<Vec<ReplayEvent>, EmmError> {
    let mut events = Vec::new();
    let mut cols = LogColumns::RMM;
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |reason: String| EmmError::InvalidArgument {
            what: "an allocation log",
            reason: format!("line {}: {reason}", n + 1),
        };
        if let Some(header) = LogColumns::from_header(line) {
            cols = header.map_err(bad)?;
            continue;
        }
        let (action, ptr, size, kind) = parse_log_line(line, &cols).map_err(bad)?;
        let action = match action.as_str() {
            "allocate" | "alloc" => Action::Allocate,
            "free" | "deallocate" => Action::Free,
            "allocate failure" => continue,
            other => {
                return Err(bad(format!(
                    "unknown action {other:?}; a log has allocate, free and allocate failure"
                )));
            }
        };
        events.push(ReplayEvent {
            action,
            ptr,
            size,
            kind,
        });
    }
    Ok(events)
}

/// What a replay did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReplayReport {
    /// Allocations made.
    pub allocations: usize,
    /// Frees done.
    pub frees: usize,
    /// Allocations the manager refused (the replay goes on without them).
    pub failures: usize,
    /// Frees of pointers the log never allocated (or whose allocation failed here).
    pub unmatched_frees: usize,
    /// Events skipped: pins (`mempin` needs the program's buffers).
    pub skipped: usize,
    /// The most allocations live at once.
    pub peak_live: usize,
    /// Wall time of the replay.
    pub elapsed: Duration,
}

enum Live {
    Device(#[allow(dead_code)] MemoryPointer),
    Host(#[allow(dead_code)] HostMemory),
}

/// Replays `events` on `ctx`. Memory still live at the end of the log is freed on return.
pub fn replay(ctx: &Context, events: &[ReplayEvent]) -> ReplayReport {
    let mut live: HashMap<u64, Live> = HashMap::new();
    let mut report = ReplayReport::default();
    let start = Instant::now();
    for e in events {
        match e.action {
            Action::Allocate => {
                let made = match e.kind {
                    MemoryKind::Device => ctx.memalloc(e.size).map(Live::Device),
                    MemoryKind::Managed => ctx
                        .memallocmanaged(e.size, true)
                        .map(|m| Live::Device(m.device().clone())),
                    MemoryKind::Pinned | MemoryKind::Mapped => ctx
                        .memhostalloc(e.size, e.kind == MemoryKind::Mapped, false, false)
                        .map(Live::Host),
                    MemoryKind::Pin => {
                        report.skipped += 1;
                        continue;
                    }
                };
                match made {
                    Ok(m) => {
                        report.allocations += 1;
                        live.insert(e.ptr, m);
                        report.peak_live = report.peak_live.max(live.len());
                    }
                    Err(err) => {
                        tracing::debug!(error = %err, size = e.size, "replayed allocation refused");
                        report.failures += 1;
                    }
                }
            }
            Action::Free => match live.remove(&e.ptr) {
                Some(m) => {
                    drop(m);
                    report.frees += 1;
                }
                None if e.kind == MemoryKind::Pin => report.skipped += 1,
                None => report.unmatched_frees += 1,
            },
        }
    }
    drop(live);
    report.elapsed = start.elapsed();
    report
}
