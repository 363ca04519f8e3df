//! Replays an allocation log against a context: the `log` adaptor's CSV ([`LOG_HEADER`](crate::adaptors::LOG_HEADER))
//! or RMM's replay format (`Thread,Time,Action,Pointer,Size,Stream`). A log recorded from a
//! real program on the GPU can be replayed on the simulator, under any manager, and what the
//! manager held measured against what the program had live.
//!
//! Stream-ordered events (a `Stream` column other than `-`) are replayed with `memalloc_on`:
//! the recorded handles 0 and 1 on the legacy default stream, 2 on the per-thread default
//! stream, and every other recorded handle on a stream of its own, made at its first use and
//! kept for the replayer's life.
//! Under a manager that does not allocate on streams they are replayed with `memalloc`, as
//! the frameworks' allocators over emm do.
//!
//! **The GPU's progress.** A program's frees reach the allocator long before the GPU reaches
//! them, and a stream that a manager queries while it grows is busy in a real run. A log that
//! says how far the GPU had got when each event came (the `log` adaptor's `Reached` column)
//! replays with that progress where the driver can queue stand-in work
//! ([`Replayer::pass_recorded`], with a [`RecordedWork`]): after each event on a stream, work
//! launched up to the next event's time; before each, the stream's progress moved to the
//! recorded figure; between a stream's own events, its progress runs on with the log's clock,
//! as far behind as its last event found it, up to what its next allocation records. An
//! allocation's figure is the stream's own answer (the log asks the stream), a free's only the
//! last marker found complete: a free moves the progress up to its figure, never back. The
//! manager's call itself sees every stream's progress at the middle of the recorded call (the
//! `Elapsed` column; its start where the log has none): the log reads `Reached` before the
//! call, and the GPU runs on while a growing manager decides. What a manager queues behind the
//! stand-ins (its fences) then completes when it did in the recorded run, and its queries see
//! the streams busy, or idle, as they were.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::adaptors::log::{LogColumns, parse_log_line};
use crate::contract::info::MemoryKind;
use crate::contract::manager::StreamOrdering;
use crate::error::EmmError;
use crate::memory::host::HostMemory;
use crate::memory::pointer::MemoryPointer;
use crate::objects::Stream;
use crate::runtime::context::Context;
use driver_sys::StreamHandle;

/// A stream's progress between two of its own events in a log with progress: from its last
/// event's time `since`, when the GPU had reached `from`, the GPU runs the stream's work in step
/// with the log's clock (as far behind as it was then), but never past `until`, what the
/// stream's next allocation says it had reached (none: no later allocation says). Between
/// its allocator calls a thread's stream is not stalled: its queued work runs on, and once the
/// thread waits for its stream, the stream is idle well before the thread's next call.
#[derive(Clone, Copy, Debug)]
struct Between {
    since: u64,
    from: u64,
    until: Option<u64>,
}

impl Between {
    /// The progress at log time `at`, where it is past `from`.
    fn at(&self, at: u64) -> Option<u64> {
        let ran = self.from.saturating_add(at.saturating_sub(self.since));
        let p = self.until.map_or(ran, |until| ran.min(until));
        (p > self.from).then_some(p)
    }

    /// The progress at log time `at`: [`at`](Self::at), or `from` where it is not past it.
    fn progress(&self, at: u64) -> u64 {
        self.at(at).unwrap_or(self.from)
    }
}

/// For each event, the progress the next allocation on its stream records (for events with a
/// stream and progress; `None` otherwise, or where no later allocation on the stream records
/// any). Only an allocation's figure bounds the progress before it: the log asks the stream
/// itself there (its own time where the stream was idle), while a free's figure is the last
/// marker found complete, which the GPU may have passed long before.
fn next_progress(events: &[ReplayEvent]) -> Vec<Option<u64>> {
    let mut later: HashMap<u64, u64> = HashMap::new();
    let mut next = vec![None; events.len()];
    for (i, e) in events.iter().enumerate().rev() {
        if let (Some(stream), Some(reached), true) = (e.stream, e.reached, is_device(e.kind)) {
            next[i] = later.get(&stream).copied();
            if e.action == Action::Allocate {
                later.insert(stream, reached);
            }
        }
    }
    next
}

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
    /// The stream the memory was allocated on in the recorded run (its handle there), or
    /// `None` for memory allocated without a stream.
    pub stream: Option<u64>,
    /// The kind of memory.
    pub kind: MemoryKind,
    /// When the event came in the recorded run, in nanoseconds since its log opened, where the
    /// log says.
    pub at: Option<u64>,
    /// How far the GPU had got through the event's stream when it came: the time (as
    /// [`at`](Self::at)) up to which the work the program had launched there was complete,
    /// where the log says (the `log` adaptor's `Reached` column).
    pub reached: Option<u64>,
    /// How long the manager's call took in the recorded run, in nanoseconds, where the log
    /// says (the `log` adaptor's `Elapsed` column).
    pub elapsed: Option<u64>,
}

/// Parses a log. A header line says where the columns stand (by name: `Action`, `Pointer`,
/// `Size`, and `Stream` and `Kind` where there are such); without a header, RMM's order is
/// assumed. Pointers and streams are hexadecimal, with or without `0x`; a stream of `-` means
/// none. `allocate failure` lines and empty lines are skipped.
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
        let parsed = parse_log_line(line, &cols).map_err(bad)?;
        let action = match parsed.action.as_str() {
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
            ptr: parsed.ptr,
            size: parsed.size,
            stream: parsed.stream,
            kind: parsed.kind,
            at: parsed.at,
            reached: parsed.reached,
            elapsed: parsed.elapsed,
        });
    }
    Ok(events)
}

/// What a log itself says about the memory its program had live.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TraceSummary {
    /// Allocation events.
    pub allocations: usize,
    /// Free events that name a live allocation.
    pub frees: usize,
    /// The most device bytes (device and managed memory, as requested) live at once
    /// (`usize::MAX` for a log that names more).
    pub peak_live_bytes: usize,
    /// Distinct allocation sizes.
    pub sizes: usize,
    /// Distinct streams (stream-ordered allocations), not counting memory without a stream.
    pub streams: usize,
}

/// Whether memory of `kind` is device memory, which a replay weighs.
fn is_device(kind: MemoryKind) -> bool {
    matches!(kind, MemoryKind::Device | MemoryKind::Managed)
}

/// Reads `events` without replaying them: what the recorded program had live.
pub fn summarize(events: &[ReplayEvent]) -> TraceSummary {
    let mut live: HashMap<u64, usize> = HashMap::new();
    // Saturating: a log may name more live bytes than a `usize` holds (the peak is then
    // `usize::MAX`, whatever the log frees after).
    let (mut bytes, mut summary) = (0usize, TraceSummary::default());
    let mut sizes = std::collections::HashSet::new();
    let mut streams = std::collections::HashSet::new();
    for e in events.iter().filter(|e| is_device(e.kind)) {
        match e.action {
            Action::Allocate => {
                summary.allocations += 1;
                sizes.insert(e.size);
                streams.extend(e.stream);
                if let Some(old) = live.insert(e.ptr, e.size) {
                    bytes = bytes.saturating_sub(old);
                }
                bytes = bytes.saturating_add(e.size);
                summary.peak_live_bytes = summary.peak_live_bytes.max(bytes);
            }
            Action::Free => {
                if let Some(size) = live.remove(&e.ptr) {
                    bytes = bytes.saturating_sub(size);
                    summary.frees += 1;
                }
            }
        }
    }
    summary.sizes = sizes.len();
    summary.streams = streams.len();
    summary
}

/// What a replay did, and what the manager held while it ran.
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
    /// The most device bytes live at once (as requested).
    pub peak_live_bytes: usize,
    /// The most device memory the driver counted as used, beyond what it counted when the
    /// replayer was made (`total - free` of `get_memory_info`, read after every device
    /// allocation): what `nvidia-smi` would have shown the replay take.
    pub peak_held_bytes: usize,
    /// The same figure after the pass, every allocation of it freed and the frees the manager
    /// deferred issued: what the manager keeps.
    pub held_after_bytes: usize,
    /// The largest free block the manager's device pool reported when the held peak was
    /// reached (`PoolStats::largest_free_bytes`), where it has a pool that knows.
    pub largest_free_at_peak: Option<usize>,
    /// Time spent in the manager's allocations and frees (the held readings left out).
    pub elapsed: Duration,
}

impl ReplayReport {
    /// Peak held over peak live: 1.0 holds nothing beyond what the program used.
    pub fn held_over_live(&self) -> f64 {
        self.peak_held_bytes as f64 / self.peak_live_bytes.max(1) as f64
    }

    /// Allocations and frees per second of [`elapsed`](Self::elapsed).
    pub fn ops_per_second(&self) -> f64 {
        (self.allocations + self.frees) as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// How a replay reproduces the GPU's progress through the recorded program's work, on a driver
/// that can queue stand-in work (the simulator's `launch_recorded` and `reach_recorded`). Log
/// times are nanoseconds; a replayer shifts each pass's past the last's.
pub trait RecordedWork {
    /// The recorded program launched work on `stream` until log time `at`: a stand-in that
    /// completes once the stream's progress reaches `at` is queued there.
    fn launched(&mut self, stream: StreamHandle, at: u64) -> Result<(), EmmError>;

    /// The GPU had finished the work launched on `stream` up to log time `at`.
    fn reached(&mut self, stream: StreamHandle, at: u64) -> Result<(), EmmError>;
}

enum Live {
    Device(#[allow(dead_code)] MemoryPointer, usize),
    Host(#[allow(dead_code)] HostMemory),
}

/// Replays logs on one context, pass after pass, measuring the device memory held against a
/// baseline read when it was made.
pub struct Replayer<'c> {
    ctx: &'c Context,
    baseline: usize,
    on_streams: bool,
    /// Streams made for recorded handles other than the implicit ones.
    streams: HashMap<u64, Stream>,
    /// Added to a log's times in a pass with recorded work: past every time of the passes
    /// before, so that progress, which never goes back, applies to each pass afresh.
    time_base: u64,
}

impl std::fmt::Debug for Replayer<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replayer")
            .field("baseline", &self.baseline)
            .field("on_streams", &self.on_streams)
            .field("streams", &self.streams.len())
            .finish()
    }
}

impl<'c> Replayer<'c> {
    /// A replayer on `ctx`; the device memory the driver counts as used now is its baseline.
    pub fn new(ctx: &'c Context) -> Result<Replayer<'c>, EmmError> {
        let info = ctx.get_memory_info()?;
        Ok(Replayer {
            ctx,
            baseline: info.total.saturating_sub(info.free),
            on_streams: ctx.stream_ordering() != StreamOrdering::Unsupported,
            streams: HashMap::new(),
            time_base: 0,
        })
    }

    /// Device memory the driver counts as used beyond the baseline, now.
    pub fn held_bytes(&self) -> Result<usize, EmmError> {
        let info = self.ctx.get_memory_info()?;
        Ok(info
            .total
            .saturating_sub(info.free)
            .saturating_sub(self.baseline))
    }

    /// The replay's stream for the recorded handle `handle`, made at its first use.
    fn stream(&mut self, handle: u64) -> Result<&Stream, EmmError> {
        if !self.streams.contains_key(&handle) {
            let made = match handle {
                // The legacy default stream by either of its names.
                0 | 1 => self.ctx.legacy_default_stream(),
                2 => self.ctx.per_thread_default_stream(),
                _ => self.ctx.create_stream()?,
            };
            self.streams.insert(handle, made);
        }
        Ok(&self.streams[&handle])
    }

    /// Allocates device memory for `e`, on its stream where it has one and the manager
    /// allocates on streams.
    fn allocate_device(&mut self, e: &ReplayEvent) -> Result<MemoryPointer, EmmError> {
        let Some(handle) = e.stream.filter(|_| self.on_streams) else {
            return self.ctx.memalloc(e.size);
        };
        let ctx = self.ctx;
        ctx.memalloc_on(e.size, self.stream(handle)?)
    }

    /// The replay's stream handle for `e`'s recorded stream, where the event is stream-ordered
    /// device memory replayed on a stream.
    fn stream_of(&mut self, e: &ReplayEvent) -> Result<Option<StreamHandle>, EmmError> {
        match e.stream.filter(|_| self.on_streams && is_device(e.kind)) {
            Some(handle) => Ok(Some(self.stream(handle)?.handle())),
            None => Ok(None),
        }
    }

    /// Replays `events` once. Memory still live at the end of the log is freed before it
    /// returns. Allocations the manager refuses are counted and the replay goes on.
    pub fn pass(&mut self, events: &[ReplayEvent]) -> Result<ReplayReport, EmmError> {
        self.pass_with(events, || {})
    }

    /// [`pass`](Self::pass), calling `between` after every event: a replay on a simulated
    /// driver runs the streams' queued work there, as a GPU does while the program runs (the
    /// simulator runs it only when asked; stream-ordered frees wait for it).
    pub fn pass_with(
        &mut self,
        events: &[ReplayEvent],
        between: impl FnMut(),
    ) -> Result<ReplayReport, EmmError> {
        self.run(events, None, between)
    }

    /// [`pass_with`](Self::pass_with), reproducing the GPU's progress the log recorded
    /// through `work` (see the module's text): before each stream-ordered event its stream's
    /// progress moves to the event's [`reached`](ReplayEvent::reached), and after it work
    /// launched until the next event's time is queued there. Events without times replay as
    /// `pass_with` replays them. At the end of the pass every stream's work completes (the
    /// program ended).
    pub fn pass_recorded(
        &mut self,
        events: &[ReplayEvent],
        work: &mut dyn RecordedWork,
        between: impl FnMut(),
    ) -> Result<ReplayReport, EmmError> {
        self.run(events, Some(work), between)
    }

    fn run(
        &mut self,
        events: &[ReplayEvent],
        mut work: Option<&mut dyn RecordedWork>,
        mut between: impl FnMut(),
    ) -> Result<ReplayReport, EmmError> {
        let base = self.time_base;
        let last = events.iter().filter_map(|e| e.at).max().unwrap_or(0);
        // (stream, the latest time work was launched there) of the streams this pass used.
        let mut used: Vec<(StreamHandle, u64)> = Vec::new();
        // The streams' progress between their own events (see `Between`).
        let mut between_events: Vec<(StreamHandle, Between)> = Vec::new();
        let next = match work {
            Some(_) => next_progress(events),
            None => Vec::new(),
        };
        if work.is_some() {
            self.time_base = base.saturating_add(last).saturating_add(1);
        }
        // By recorded address, with the event's index: what is left at the end is freed in the
        // order it was allocated, so that a pass leaves the same state every time.
        let mut live: HashMap<u64, (usize, Live)> = HashMap::new();
        let mut report = ReplayReport::default();
        let mut live_bytes = 0usize;
        let mut busy = Duration::ZERO;
        for (index, e) in events.iter().enumerate() {
            let recorded = match &mut work {
                Some(_) => self.stream_of(e)?,
                None => None,
            };
            // The manager decides somewhere inside its call, while the GPU runs on: the replay
            // takes the call's middle.
            let deciding = e.at.map(|at| at.saturating_add(e.elapsed.unwrap_or(0) / 2));
            if let (Some(w), Some(at)) = (&mut work, deciding) {
                // The other streams' GPU work went on since their last events.
                for (other, b) in &between_events {
                    if Some(*other) != recorded
                        && let Some(p) = b.at(at)
                    {
                        w.reached(*other, base.saturating_add(p))?;
                    }
                }
            }
            if let (Some(stream), Some(w), Some(reached)) = (recorded, &mut work, e.reached) {
                let slot = between_events.iter().position(|(s, _)| *s == stream);
                // A free's figure is a floor: the stream has got at least as far as it had.
                let reached = match (e.action, slot, e.at) {
                    (Action::Free, Some(k), Some(at)) => {
                        reached.max(between_events[k].1.progress(at))
                    }
                    _ => reached,
                };
                let b = e.at.map(|at| Between {
                    since: at,
                    from: reached,
                    until: next[index],
                });
                // Its own stream runs on too, from where the log read it before the call.
                let now = b.zip(deciding).map_or(reached, |(b, d)| b.progress(d));
                w.reached(stream, base.saturating_add(now))?;
                if let Some(b) = b {
                    match slot {
                        Some(k) => between_events[k].1 = b,
                        None => between_events.push((stream, b)),
                    }
                }
            }
            match e.action {
                Action::Allocate => {
                    let start = Instant::now();
                    let made = match e.kind {
                        MemoryKind::Device => {
                            self.allocate_device(e).map(|m| Live::Device(m, e.size))
                        }
                        MemoryKind::Managed => self
                            .ctx
                            .memallocmanaged(e.size, true)
                            .map(|m| Live::Device(m.device().clone(), e.size)),
                        MemoryKind::Pinned | MemoryKind::Mapped => self
                            .ctx
                            .memhostalloc(e.size, e.kind == MemoryKind::Mapped, false, false)
                            .map(Live::Host),
                        MemoryKind::Pin => {
                            report.skipped += 1;
                            continue;
                        }
                    };
                    busy += start.elapsed();
                    match made {
                        Ok(m) => {
                            report.allocations += 1;
                            let device = matches!(m, Live::Device(..));
                            // A log that allocates one address twice without a free: the
                            // older allocation is freed here.
                            if let Some((_, Live::Device(_, size))) = live.insert(e.ptr, (index, m))
                            {
                                live_bytes -= size;
                            }
                            report.peak_live = report.peak_live.max(live.len());
                            if device {
                                live_bytes += e.size;
                                report.peak_live_bytes = report.peak_live_bytes.max(live_bytes);
                                let held = self.held_bytes()?;
                                if held > report.peak_held_bytes {
                                    report.peak_held_bytes = held;
                                    report.largest_free_at_peak = self
                                        .ctx
                                        .pool_stats()
                                        .device
                                        .and_then(|s| s.largest_free_bytes);
                                }
                            }
                        }
                        Err(err) => {
                            tracing::debug!(error = %err, size = e.size, "replayed allocation refused");
                            report.failures += 1;
                        }
                    }
                }
                Action::Free => match live.remove(&e.ptr) {
                    Some((_, m)) => {
                        if let Live::Device(_, size) = m {
                            live_bytes -= size;
                        }
                        let start = Instant::now();
                        drop(m);
                        busy += start.elapsed();
                        report.frees += 1;
                    }
                    None if e.kind == MemoryKind::Pin => report.skipped += 1,
                    None => report.unmatched_frees += 1,
                },
            }
            if let (Some(stream), Some(w)) = (recorded, &mut work) {
                // The work the program launched there before its next call to the allocator
                // (threads log in the order they took the log's lock, so a later line may
                // carry an earlier time: a stream's launches never go back).
                let next = events[index + 1..].iter().find_map(|n| n.at);
                let until = next.max(e.at);
                let slot = match used.iter().position(|&(s, _)| s == stream) {
                    Some(k) => k,
                    None => {
                        used.push((stream, 0));
                        used.len() - 1
                    }
                };
                if let Some(at) = until {
                    let at = at.max(used[slot].1);
                    used[slot].1 = at;
                    w.launched(stream, base.saturating_add(at))?;
                }
            }
            between();
        }
        if let Some(w) = &mut work {
            // The program ended: the GPU finished its work (launched by the last event's time).
            for &(stream, _) in &used {
                w.reached(stream, base.saturating_add(last))?;
            }
        }
        let mut left: Vec<(usize, Live)> = live.into_values().collect();
        left.sort_unstable_by_key(|(index, _)| *index);
        let start = Instant::now();
        drop(left);
        busy += start.elapsed();
        between();
        report.elapsed = busy;
        // Frees the manager deferred are issued first: what it keeps, not what it queued.
        self.ctx.flush_deallocations()?;
        report.held_after_bytes = self.held_bytes()?;
        Ok(report)
    }
}

/// Replays `events` once on `ctx` ([`Replayer::pass`] of a new [`Replayer`]).
pub fn replay(ctx: &Context, events: &[ReplayEvent]) -> Result<ReplayReport, EmmError> {
    Replayer::new(ctx)?.pass(events)
}
