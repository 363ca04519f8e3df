//! What a memory snapshot is made of: the segments a manager holds and their blocks
//! ([`Holdings::segments`](super::Holdings::segments)), the allocation tags, and the
//! snapshot a context assembles from them ([`MemorySnapshot`]), with its exports (PyTorch's
//! snapshot format, a self-contained HTML page).
//!
//! A manager lists what only it knows: the segments it got from the driver and, inside them,
//! the blocks that are not in use (free in an arena, cached for a thread or a stream, waiting
//! for a deferred free). Whatever else a segment holds is in use. The `history` adaptor
//! ([`Adaptor::History`](crate::Adaptor::History)) knows each live allocation (address, size,
//! stream, tag, time, and a stack when asked for) and the last events; without it, `pool` and
//! `vmm-pool` give their own history, each thread's last events
//! ([`Records::history`](super::Records::history)). The context splits the in-use
//! space into the recorded allocations. Space in use that no recorded allocation covers
//! (allocated before the history's window) stays one block per run, marked unrecorded.

use std::fmt::{self, Write as _};
use std::sync::{Arc, OnceLock};

use crate::error::LiveByTag;
use crate::sync::{Mutex, lock};

/// What kind of driver memory a segment is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SegmentKind {
    /// A chunk a pool got from `cuMemAlloc` and splits into blocks.
    Chunk,
    /// Physical memory a virtual-memory pool mapped into its reserved range.
    VirtualRange,
    /// One `cuMemAlloc` (or stream-ordered allocation) of one allocation: the default and
    /// async-pool managers.
    DriverAllocation,
}

impl SegmentKind {
    /// The kind's name in exports.
    pub fn name(self) -> &'static str {
        match self {
            SegmentKind::Chunk => "chunk",
            SegmentKind::VirtualRange => "virtual-range",
            SegmentKind::DriverAllocation => "driver-allocation",
        }
    }
}

/// What a block of a segment is used for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockState {
    /// Handed out: a live allocation.
    InUse,
    /// Not in use, kept by a thread's or a stream's cache for its next allocation of this size.
    Cached,
    /// Not in use, free in an arena (any allocation that fits may take it).
    Free,
    /// Released by its last pointer, its driver free queued (deferred deallocation) or waiting
    /// for the streams that used it.
    PendingFree,
}

impl BlockState {
    /// The state's name in exports.
    pub fn name(self) -> &'static str {
        match self {
            BlockState::InUse => "in-use",
            BlockState::Cached => "cached",
            BlockState::Free => "free",
            BlockState::PendingFree => "pending-free",
        }
    }

    /// PyTorch's name for the state (`active_allocated`, `active_pending_free`, `inactive`).
    pub fn torch_name(self) -> &'static str {
        match self {
            BlockState::InUse => "active_allocated",
            BlockState::PendingFree => "active_pending_free",
            BlockState::Cached | BlockState::Free => "inactive",
        }
    }
}

/// A block a manager knows inside one of its segments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldBlock {
    /// Its device address.
    pub address: u64,
    /// Its size in bytes.
    pub bytes: usize,
    /// What it is used for.
    pub state: BlockState,
}

/// A segment a manager holds from the driver, with the blocks it knows in it (free, cached and
/// pending blocks, and, for a segment of one allocation, the in-use block). The rest of the
/// segment is in use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldSegment {
    /// Its device address.
    pub address: u64,
    /// Its size in bytes.
    pub bytes: usize,
    /// What kind of driver memory it is.
    pub kind: SegmentKind,
    /// The stream it serves, for a stream's own arena (`None`: every stream).
    pub stream: Option<u64>,
    /// The blocks the manager knows, in any order.
    pub blocks: Vec<HeldBlock>,
}

impl HeldSegment {
    /// A segment of `kind` that is one block in `state` (a driver allocation of its own, or a
    /// chunk waiting to be freed).
    pub fn whole(address: u64, bytes: usize, kind: SegmentKind, state: BlockState) -> HeldSegment {
        HeldSegment {
            address,
            bytes,
            kind,
            stream: None,
            blocks: vec![HeldBlock {
                address,
                bytes,
                state,
            }],
        }
    }
}

/// Who allocated: a framework (`numba`, `cupy`, `torch`) or the embedder's own name. Tags are
/// interned: a tag is a small number, set per thread ([`Tag::scope`]) and read by the
/// `history` adaptor at each allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tag(u32);

/// The names of the tags, by number, and the number of each name.
struct TagNames {
    names: Vec<Arc<str>>,
    numbers: std::collections::HashMap<Arc<str>, u32>,
}

fn tag_names() -> &'static Mutex<TagNames> {
    static NAMES: OnceLock<Mutex<TagNames>> = OnceLock::new();
    NAMES.get_or_init(|| {
        let names: Vec<Arc<str>> = vec![Arc::from("untagged"), Arc::from(OTHER_TAGS)];
        let numbers = names
            .iter()
            .enumerate()
            .map(|(i, n)| (Arc::clone(n), i as u32))
            .collect();
        Mutex::new(TagNames { names, numbers })
    })
}

/// The name of the tag that the names past [`Tag::MAX_NAMES`] share.
const OTHER_TAGS: &str = "other tags";

thread_local! {
    static CURRENT: std::cell::Cell<Tag> = const { std::cell::Cell::new(Tag::UNTAGGED) };
    static HOST_STACK: std::cell::RefCell<Option<Arc<str>>> = const { std::cell::RefCell::new(None) };
}

/// Runs `f` with `stack` as this thread's stack in the host's own language (the Python
/// package passes the Python frames, innermost first, one per line in `traceback`'s
/// `File "...", line N, in name` form): the `history-stacks` adaptor puts it before the Rust
/// backtrace of the allocations `f` makes. Pass it only when
/// [`Context::records_stacks`](crate::Context::records_stacks) says stacks are kept.
pub fn with_host_stack<T>(stack: Arc<str>, f: impl FnOnce() -> T) -> T {
    struct Restore(Option<Arc<str>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let previous = self.0.take();
            HOST_STACK.with(|s| *s.borrow_mut() = previous);
        }
    }
    let _restore = Restore(HOST_STACK.with(|s| s.borrow_mut().replace(stack)));
    f()
}

/// This thread's host-language stack, set by [`with_host_stack`].
pub(crate) fn host_stack() -> Option<Arc<str>> {
    HOST_STACK.with(|s| s.borrow().clone())
}

impl Tag {
    /// Allocations made outside any [`Tag::scope`].
    pub const UNTAGGED: Tag = Tag(0);

    /// The most distinct names a process's tags have: names are kept for the process's life,
    /// so a program that made a name per step or per request would grow them without end. A
    /// name past the limit gets the tag every such name shares, named `other tags`
    /// ([`try_named`](Self::try_named) refuses it instead).
    pub const MAX_NAMES: usize = 4096;

    /// The tag named `name` (the same tag for the same name, process-wide); past
    /// [`MAX_NAMES`](Self::MAX_NAMES) distinct names, the tag they share.
    pub fn named(name: &str) -> Tag {
        Tag::try_named(name).unwrap_or(Tag(1))
    }

    /// The tag named `name`, or `None` where it would be a new name past
    /// [`MAX_NAMES`](Self::MAX_NAMES).
    pub fn try_named(name: &str) -> Option<Tag> {
        let mut tags = lock(tag_names());
        if let Some(&i) = tags.numbers.get(name) {
            return Some(Tag(i));
        }
        if tags.names.len() >= Tag::MAX_NAMES {
            return None;
        }
        let name: Arc<str> = Arc::from(name);
        let i = tags.names.len() as u32;
        tags.names.push(Arc::clone(&name));
        tags.numbers.insert(name, i);
        Some(Tag(i))
    }

    /// The tag's number (what a manager's own history keeps).
    #[inline(always)]
    pub(crate) fn raw(self) -> u32 {
        self.0
    }

    /// The tag of number `raw` ([`raw`](Self::raw)).
    pub(crate) fn from_raw(raw: u32) -> Tag {
        Tag(raw)
    }

    /// The tag's name.
    pub fn name(self) -> Arc<str> {
        let tags = lock(tag_names());
        tags.names
            .get(self.0 as usize)
            .cloned()
            .unwrap_or_else(|| Arc::from("untagged"))
    }

    /// The tag this thread's allocations get now.
    #[inline]
    pub fn current() -> Tag {
        CURRENT.with(|c| c.get())
    }

    /// Makes `self` this thread's tag until the guard drops (scopes nest: the guard restores
    /// the tag it replaced).
    pub fn scope(self) -> TagScope {
        TagScope {
            previous: CURRENT.with(|c| c.replace(self)),
            _not_send: std::marker::PhantomData,
        }
    }

    /// Sets this thread's tag with no guard (a framework's allocator entry point, which tags
    /// each of its calls and has nowhere to keep a guard); returns the tag it replaced.
    #[inline]
    pub fn set_current(tag: Tag) -> Tag {
        CURRENT.with(|c| c.replace(tag))
    }
}

impl fmt::Display for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

/// Restores the thread's previous [`Tag`] when dropped.
#[must_use = "the tag holds only while the guard lives"]
pub struct TagScope {
    previous: Tag,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for TagScope {
    fn drop(&mut self) {
        CURRENT.with(|c| c.set(self.previous));
    }
}

impl fmt::Debug for TagScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TagScope")
            .field("previous", &self.previous)
            .finish()
    }
}

/// What the `history` adaptor knows of one allocation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllocationInfo {
    /// Bytes the caller asked for.
    pub requested: usize,
    /// The stream of a stream-ordered allocation.
    pub stream: Option<u64>,
    /// Who allocated.
    pub tag: Tag,
    /// When, in microseconds since the Unix epoch.
    pub time_us: u64,
    /// The allocating stack, when the adaptor records stacks.
    pub stack: Option<Arc<str>>,
}

/// A block of a [`MemorySnapshot`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Block {
    /// Its device address.
    pub address: u64,
    /// Its size in bytes.
    pub bytes: usize,
    /// What it is used for.
    pub state: BlockState,
    /// The allocation in it, for an in-use block that history recorded (`None` for other
    /// blocks, and for space in use since before history was on).
    pub allocation: Option<AllocationInfo>,
    /// The graph pool ([`GraphPool::id`](crate::GraphPool::id)) whose segment the block is
    /// part of: a graph pool takes whole segments from the manager and carves them (a free
    /// block of a graph pool is kept for that pool's graphs).
    pub graph_pool: Option<u64>,
}

/// A segment of a [`MemorySnapshot`]: its blocks cover it, in address order, with no gap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Its device address.
    pub address: u64,
    /// Its size in bytes.
    pub bytes: usize,
    /// What kind of driver memory it is.
    pub kind: SegmentKind,
    /// The stream it serves (`None`: every stream).
    pub stream: Option<u64>,
    /// Its blocks, by address.
    pub blocks: Vec<Block>,
}

impl Segment {
    /// Bytes of its blocks in `state`.
    pub fn bytes_in(&self, state: BlockState) -> usize {
        self.blocks
            .iter()
            .filter(|b| b.state == state)
            .map(|b| b.bytes)
            .sum()
    }
}

/// What a recorded event did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HistoryAction {
    /// An allocation.
    Alloc,
    /// The last pointer of an allocation dropped.
    Free,
    /// An allocation failed: out of memory.
    OutOfMemory,
}

impl HistoryAction {
    /// PyTorch's name for the action in a trace (`alloc`, `free_requested`, `oom`).
    pub fn torch_name(self) -> &'static str {
        match self {
            HistoryAction::Alloc => "alloc",
            HistoryAction::Free => "free_requested",
            HistoryAction::OutOfMemory => "oom",
        }
    }
}

/// One event of the `history` adaptor's ring.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HistoryEvent {
    /// What happened.
    pub action: HistoryAction,
    /// The allocation's address (0 for a failed one).
    pub address: u64,
    /// Its size: requested bytes.
    pub bytes: usize,
    /// The stream of a stream-ordered allocation.
    pub stream: Option<u64>,
    /// Who allocated.
    pub tag: Tag,
    /// When, in microseconds since the Unix epoch.
    pub time_us: u64,
    /// The stack, when the adaptor records stacks (allocations only).
    pub stack: Option<Arc<str>>,
}

/// Everything a context's manager holds, block by block, with the history's allocations and
/// events ([`Context::snapshot`](crate::Context::snapshot)).
#[derive(Clone, Debug, PartialEq)]
pub struct MemorySnapshot {
    /// The device.
    pub device: u32,
    /// The manager's registered name.
    pub manager: String,
    /// When it was taken, in microseconds since the Unix epoch.
    pub time_us: u64,
    /// Every segment. A manager that cannot list its segments (the driver's stream-ordered
    /// pool hides its own: `async-pool`) gives none, and each allocation history recorded is
    /// then a segment of its own ([`segments_known`](Self::segments_known) is false).
    pub segments: Vec<Segment>,
    /// Whether the manager listed its segments ([`Holdings::segments`](super::Holdings::segments)).
    pub segments_known: bool,
    /// Whether a `history` adaptor recorded allocations: without one, in-use blocks carry no
    /// allocation and the history is empty.
    pub history_on: bool,
    /// The history's last events, oldest first.
    pub history: Vec<HistoryEvent>,
    /// Live allocations history recorded that no listed segment holds, as blocks (empty when
    /// the manager lists no segments: each recorded allocation is a segment of its own then).
    pub unplaced: Vec<Block>,
}

impl MemorySnapshot {
    /// Bytes of every segment.
    pub fn held_bytes(&self) -> usize {
        self.segments.iter().map(|s| s.bytes).sum()
    }

    /// Bytes of the segments' blocks in `state`.
    pub fn bytes_in(&self, state: BlockState) -> usize {
        self.segments.iter().map(|s| s.bytes_in(state)).sum()
    }

    /// Every block, segment by segment, then the unplaced ones.
    pub fn blocks(&self) -> impl Iterator<Item = &Block> {
        self.segments
            .iter()
            .flat_map(|s| s.blocks.iter())
            .chain(self.unplaced.iter())
    }

    /// Live bytes per tag, largest first, ties by name (from history's allocations).
    pub fn by_tag(&self) -> Vec<LiveByTag> {
        let mut tags: Vec<(Tag, LiveByTag)> = Vec::new();
        for a in self.blocks().filter_map(|b| b.allocation.as_ref()) {
            let i = match tags.iter().position(|(t, _)| *t == a.tag) {
                Some(i) => i,
                None => {
                    let usage = LiveByTag {
                        tag: a.tag.name().to_string(),
                        bytes: 0,
                        allocations: 0,
                        largest: 0,
                    };
                    tags.push((a.tag, usage));
                    tags.len() - 1
                }
            };
            let t = &mut tags[i].1;
            t.bytes += a.requested;
            t.allocations += 1;
            t.largest = t.largest.max(a.requested);
        }
        let mut tags: Vec<LiveByTag> = tags.into_iter().map(|(_, t)| t).collect();
        tags.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.tag.cmp(&b.tag)));
        tags
    }

    /// The snapshot in PyTorch's format (`torch.cuda.memory._snapshot()`), as JSON: a
    /// `segments` list and a `device_traces` list for this device. Loaded with `json.load`,
    /// it is what `torch.cuda._memory_viz` and the memory_viz page read (the Python package's
    /// `Snapshot.dump_torch` pickles it as they expect).
    pub fn to_torch_json(&self) -> String {
        let mut out = String::with_capacity(256 + 160 * self.blocks().count());
        out.push_str("{\"segments\":[");
        for (i, s) in self.segments.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            let small = s.kind == SegmentKind::Chunk && s.bytes <= 2 << 20;
            let in_use = s.bytes_in(BlockState::InUse);
            let _ = write!(
                out,
                "{{\"device\":{},\"address\":{},\"total_size\":{},\"allocated_size\":{},\
                 \"active_size\":{},\"requested_size\":{},\"stream\":{},\"segment_type\":\"{}\",\
                 \"segment_pool_id\":[0,0],\"is_expandable\":{},\"frames\":[],\"blocks\":[",
                self.device,
                s.address,
                s.bytes,
                in_use,
                in_use + s.bytes_in(BlockState::PendingFree),
                s.blocks
                    .iter()
                    .filter(|b| b.state == BlockState::InUse)
                    .map(|b| b.allocation.as_ref().map_or(b.bytes, |a| a.requested))
                    .sum::<usize>(),
                s.stream.unwrap_or(0),
                if small { "small" } else { "large" },
                s.kind == SegmentKind::VirtualRange,
            );
            for (j, b) in s.blocks.iter().enumerate() {
                if j > 0 {
                    out.push(',');
                }
                let requested = b.allocation.as_ref().map_or(b.bytes, |a| a.requested);
                let _ = write!(
                    out,
                    "{{\"address\":{},\"size\":{},\"requested_size\":{},\"state\":\"{}\",\
                     \"frames\":",
                    b.address,
                    b.bytes,
                    requested,
                    b.state.torch_name()
                );
                frames_json(
                    &mut out,
                    b.allocation.as_ref().and_then(|a| a.stack.as_deref()),
                );
                out.push('}');
            }
            out.push_str("]}");
        }
        out.push_str("],\"device_traces\":[");
        for d in 0..=self.device {
            if d > 0 {
                out.push(',');
            }
            out.push('[');
            if d == self.device {
                for (i, e) in self.history.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    let _ = write!(
                        out,
                        "{{\"action\":\"{}\",\"addr\":{},\"size\":{},\"stream\":{},\
                         \"time_us\":{},\"frames\":",
                        e.action.torch_name(),
                        e.address,
                        e.bytes,
                        e.stream.unwrap_or(0),
                        e.time_us
                    );
                    frames_json(&mut out, e.stack.as_deref());
                    out.push('}');
                }
            }
            out.push(']');
        }
        out.push_str("],\"emm\":{\"manager\":");
        json_string(&mut out, &self.manager);
        let _ = write!(
            out,
            ",\"time_us\":{},\"history_on\":{},\"segments_known\":{},\"tags\":{{",
            self.time_us, self.history_on, self.segments_known
        );
        for (i, t) in self.by_tag().iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            json_string(&mut out, &t.tag);
            let _ = write!(
                out,
                ":{{\"bytes\":{},\"allocations\":{}}}",
                t.bytes, t.allocations
            );
        }
        out.push_str("}}}");
        out
    }

    /// A self-contained HTML page that draws every segment as a bar and its blocks in it,
    /// coloured by state, with the blocks' tags and stacks in their tooltips, and the live
    /// bytes per tag; no script and no server.
    pub fn to_html(&self) -> String {
        let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
        let mut out = String::new();
        let _ = write!(
            out,
            "<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>emm snapshot: device {} \
             ({})</title><style>body{{font-family:sans-serif;margin:1em}}\
             table{{border-collapse:collapse}}td,th{{padding:2px 8px;text-align:right}}\
             .in-use{{fill:#d9534f}}.cached{{fill:#f0ad4e}}.free{{fill:#5cb85c}}\
             .pending-free{{fill:#5bc0de}}.unrecorded{{fill:#a94442}}</style></head><body>",
            self.device,
            html_escape(&self.manager)
        );
        let _ = write!(
            out,
            "<h1>Device {}, manager <code>{}</code></h1><p>{} segments, {:.1} MiB held: \
             {:.1} MiB in use, {:.1} MiB cached, {:.1} MiB free, {:.1} MiB waiting to be freed. \
             History {}.</p>",
            self.device,
            html_escape(&self.manager),
            self.segments.len(),
            mib(self.held_bytes()),
            mib(self.bytes_in(BlockState::InUse)),
            mib(self.bytes_in(BlockState::Cached)),
            mib(self.bytes_in(BlockState::Free)),
            mib(self.bytes_in(BlockState::PendingFree)),
            if self.history_on {
                "on"
            } else {
                "off (in-use blocks carry no tag: add the history adaptor)"
            }
        );
        out.push_str(
            "<p>Colours: <span style=\"color:#d9534f\">in use</span>, \
             <span style=\"color:#a94442\">in use, not recorded</span>, \
             <span style=\"color:#f0ad4e\">cached</span>, \
             <span style=\"color:#5cb85c\">free</span>, \
             <span style=\"color:#5bc0de\">waiting to be freed</span>.</p>",
        );
        out.push_str("<h2>Live bytes by tag</h2><table><tr><th>tag</th><th>MiB</th><th>allocations</th><th>largest MiB</th></tr>");
        for t in self.by_tag() {
            let _ = write!(
                out,
                "<tr><td>{}</td><td>{:.2}</td><td>{}</td><td>{:.2}</td></tr>",
                html_escape(&t.tag),
                mib(t.bytes),
                t.allocations,
                mib(t.largest)
            );
        }
        out.push_str("</table><h2>Segments</h2>");
        const WIDTH: f64 = 1000.0;
        for s in &self.segments {
            let _ = write!(
                out,
                "<p>{:#x}: {:.2} MiB, {}{}</p><svg width=\"{WIDTH}\" height=\"24\">",
                s.address,
                mib(s.bytes),
                s.kind.name(),
                s.stream
                    .map_or(String::new(), |st| format!(", stream {st:#x}"))
            );
            for b in &s.blocks {
                let x = (b.address - s.address) as f64 / s.bytes.max(1) as f64 * WIDTH;
                let w = (b.bytes as f64 / s.bytes.max(1) as f64 * WIDTH).max(0.5);
                let class = match (b.state, &b.allocation) {
                    (BlockState::InUse, None) if self.history_on => "unrecorded",
                    (state, _) => state.name(),
                };
                let _ = write!(
                    out,
                    "<rect class=\"{class}\" x=\"{x:.2}\" y=\"0\" width=\"{w:.2}\" height=\"24\" \
                     stroke=\"#fff\" stroke-width=\"0.5\"><title>{:#x}, {} bytes, {}",
                    b.address,
                    b.bytes,
                    b.state.name()
                );
                if let Some(pool) = b.graph_pool {
                    let _ = write!(out, ", graph pool {pool}");
                }
                if let Some(a) = &b.allocation {
                    let _ = write!(out, ", tag {}", html_escape(&a.tag.name()));
                    if let Some(stack) = &a.stack {
                        let _ = write!(out, "\n{}", html_escape(stack));
                    }
                }
                out.push_str("</title></rect>");
            }
            out.push_str("</svg>");
        }
        if !self.unplaced.is_empty() {
            let _ = write!(
                out,
                "<h2>Live allocations outside the listed segments</h2><p>{} allocations, {:.2} MiB \
                 (the manager does not list its segments).</p>",
                self.unplaced.len(),
                mib(self.unplaced.iter().map(|b| b.bytes).sum())
            );
        }
        out.push_str("</body></html>\n");
        out
    }
}

/// PyTorch's frames for a stack, one per line: a line in `traceback`'s form (`File "f.py",
/// line 12, in step`, the Python package's frames) gives its file, line and name; any other
/// line (a Rust backtrace's) is the name, with no file or number.
fn frames_json(out: &mut String, stack: Option<&str>) {
    out.push('[');
    for (i, line) in stack.into_iter().flat_map(str::lines).enumerate() {
        if i > 0 {
            out.push(',');
        }
        let (file, number, name) = traceback_line(line.trim()).unwrap_or(("", 0, line.trim()));
        out.push_str("{\"filename\":");
        json_string(out, file);
        let _ = write!(out, ",\"line\":{number},\"name\":");
        json_string(out, name);
        out.push('}');
    }
    out.push(']');
}

/// The file, line and name of a line in `traceback`'s form.
fn traceback_line(line: &str) -> Option<(&str, u64, &str)> {
    let rest = line.strip_prefix("File \"")?;
    let (file, rest) = rest.split_once("\", line ")?;
    let (number, name) = rest.split_once(", in ")?;
    Some((file, number.parse().ok()?, name))
}

/// `s` as a JSON string.
fn json_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn html_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Builds the snapshot's segments from what a manager listed and the live allocations history
/// recorded (address → info), so that blocks cover each segment in address
/// order: the manager's blocks as given, recorded allocations where they fall in the rest, and
/// whatever in-use space is left as unrecorded in-use blocks. Returns the segments and the
/// recorded allocations no segment holds.
pub(crate) fn assemble(
    mut held: Vec<HeldSegment>,
    mut live: Vec<(u64, AllocationInfo)>,
) -> (Vec<Segment>, Vec<Block>) {
    held.sort_by_key(|s| s.address);
    live.sort_by_key(|l| l.0);
    let mut placed = vec![false; live.len()];
    let mut segments = Vec::with_capacity(held.len());
    for s in held {
        let end = s.address + s.bytes as u64;
        let mut known = s.blocks;
        known.sort_by_key(|b| b.address);
        let mut blocks = Vec::with_capacity(known.len() * 2 + 1);
        let first = live.partition_point(|l| l.0 < s.address);
        let mut next_live = first;
        let mut cursor = s.address;
        let mut fill = |from: u64, to: u64, blocks: &mut Vec<Block>, next_live: &mut usize| {
            // In-use space [from, to): each recorded allocation that starts in it runs to the
            // next one's start or to the end of the space (the manager's rounding is part of
            // its block); space before the first is unrecorded.
            let mut at = from;
            let mut open: Option<usize> = None;
            while *next_live < live.len() && live[*next_live].0 < to {
                let (addr, ref info) = live[*next_live];
                if addr >= at {
                    match open {
                        Some(i) => blocks[i].bytes = (addr - blocks[i].address) as usize,
                        None if addr > at => blocks.push(unrecorded(at, addr - at)),
                        None => {}
                    }
                    open = Some(blocks.len());
                    blocks.push(Block {
                        address: addr,
                        bytes: (to - addr) as usize,
                        state: BlockState::InUse,
                        allocation: Some(info.clone()),
                        graph_pool: None,
                    });
                    placed[*next_live] = true;
                    at = addr;
                }
                *next_live += 1;
            }
            if open.is_none() && to > at {
                blocks.push(unrecorded(at, to - at));
            }
        };
        for b in known {
            let b_end = (b.address + b.bytes as u64).min(end);
            if b.address < cursor || b.address >= end {
                continue; // overlapping or outside: the manager's lists were read apart
            }
            if b.address > cursor {
                fill(cursor, b.address, &mut blocks, &mut next_live);
            }
            if b.state == BlockState::InUse {
                fill(b.address, b_end, &mut blocks, &mut next_live);
            } else {
                while next_live < live.len() && live[next_live].0 < b_end {
                    next_live += 1;
                }
                blocks.push(Block {
                    address: b.address,
                    bytes: (b_end - b.address) as usize,
                    state: b.state,
                    allocation: None,
                    graph_pool: None,
                });
            }
            cursor = b_end;
        }
        if cursor < end {
            fill(cursor, end, &mut blocks, &mut next_live);
        }
        segments.push(Segment {
            address: s.address,
            bytes: s.bytes,
            kind: s.kind,
            stream: s.stream,
            blocks,
        });
    }
    let unplaced = live
        .into_iter()
        .zip(placed)
        .filter(|(_, p)| !p)
        .map(|((address, info), _)| Block {
            address,
            bytes: info.requested,
            state: BlockState::InUse,
            allocation: Some(info),
            graph_pool: None,
        })
        .collect();
    (segments, unplaced)
}

fn unrecorded(address: u64, bytes: u64) -> Block {
    Block {
        address,
        bytes: bytes as usize,
        state: BlockState::InUse,
        allocation: None,
        graph_pool: None,
    }
}

#[cfg(all(test, not(emm_loom)))]
mod tests {
    use super::*;

    fn info(tag: Tag, requested: usize) -> AllocationInfo {
        AllocationInfo {
            requested,
            stream: None,
            tag,
            time_us: 1,
            stack: None,
        }
    }

    #[test]
    fn blocks_cover_each_segment_in_order() {
        let t = Tag::named("unit-test");
        let held = vec![HeldSegment {
            address: 0x1000,
            bytes: 0x1000,
            kind: SegmentKind::Chunk,
            stream: None,
            blocks: vec![
                HeldBlock {
                    address: 0x1800,
                    bytes: 0x200,
                    state: BlockState::Free,
                },
                HeldBlock {
                    address: 0x1a00,
                    bytes: 0x200,
                    state: BlockState::Cached,
                },
            ],
        }];
        let live = vec![
            (0x1200, info(t, 0xf0)),
            (0x1c00, info(t, 0x400)),
            (0x9000, info(t, 0x10)),
        ];
        let (segments, unplaced) = assemble(held, live);
        let blocks = &segments[0].blocks;
        let spans: Vec<_> = blocks
            .iter()
            .map(|b| (b.address, b.bytes, b.state, b.allocation.is_some()))
            .collect();
        assert_eq!(
            spans,
            [
                (0x1000, 0x200, BlockState::InUse, false),
                (0x1200, 0x600, BlockState::InUse, true),
                (0x1800, 0x200, BlockState::Free, false),
                (0x1a00, 0x200, BlockState::Cached, false),
                (0x1c00, 0x400, BlockState::InUse, true),
            ]
        );
        assert_eq!(unplaced.len(), 1);
        assert_eq!(unplaced[0].address, 0x9000);
    }

    #[test]
    fn python_frames_keep_their_file_and_line() {
        let mut out = String::new();
        frames_json(
            &mut out,
            Some("File \"/x/train.py\", line 42, in step\n   3: emm::Context::memalloc"),
        );
        assert_eq!(
            out,
            r#"[{"filename":"/x/train.py","line":42,"name":"step"},{"filename":"","line":0,"name":"3: emm::Context::memalloc"}]"#
        );
        let stack: Arc<str> = Arc::from("File \"a.py\", line 1, in f");
        assert_eq!(host_stack(), None);
        with_host_stack(stack.clone(), || {
            assert_eq!(host_stack(), Some(stack.clone()))
        });
        assert_eq!(host_stack(), None);
    }

    #[test]
    fn tags_are_interned_and_scoped() {
        let a = Tag::named("scope-a");
        assert_eq!(Tag::named("scope-a"), a);
        assert_eq!(&*a.name(), "scope-a");
        assert_eq!(Tag::current(), Tag::UNTAGGED);
        {
            let _outer = a.scope();
            let b = Tag::named("scope-b");
            {
                let _inner = b.scope();
                assert_eq!(Tag::current(), b);
            }
            assert_eq!(Tag::current(), a);
        }
        assert_eq!(Tag::current(), Tag::UNTAGGED);
    }

    #[test]
    fn torch_json_escapes_and_balances() {
        let t = Tag::named("quote\"tag");
        let snapshot = MemorySnapshot {
            device: 1,
            manager: "pool".into(),
            time_us: 5,
            segments: vec![Segment {
                address: 16,
                bytes: 32,
                kind: SegmentKind::Chunk,
                stream: None,
                blocks: vec![Block {
                    address: 16,
                    bytes: 32,
                    state: BlockState::InUse,
                    allocation: Some(AllocationInfo {
                        stack: Some(Arc::from("a \"b\"\nc\\d")),
                        ..info(t, 30)
                    }),
                    graph_pool: None,
                }],
            }],
            segments_known: true,
            history_on: true,
            history: vec![],
            unplaced: vec![],
        };
        let json = snapshot.to_torch_json();
        assert!(json.contains(r#""name":"a \"b\"""#), "{json}");
        assert!(json.contains(r#""name":"c\\d""#), "{json}");
        assert!(json.contains(r#""quote\"tag":{"bytes":30"#), "{json}");
        // Two device traces: device 0's empty, device 1's.
        assert!(json.contains(r#""device_traces":[[],[]]"#), "{json}");
        assert_eq!(json.matches('{').count(), json.matches('}').count());
        let html = snapshot.to_html();
        assert!(html.contains("quote&quot;tag"), "{html}");
    }
}
