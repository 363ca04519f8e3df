//! Stream capture and graphs: `cuStreamBeginCapture` / `cuStreamEndCapture`, the calls a
//! capture refuses, graph instantiation, launch and destruction, and memory allocated while
//! capturing (the driver's graph memory nodes).
//!
//! The rules, as the conformance suite pins them on the GPU:
//!
//! - Work queued on a captured stream is recorded, not run; a launch of the instantiated graph
//!   queues it again, on the launch stream, each time. A graph is one ordered list here (its
//!   nodes' dependencies are not modelled: the list's order is one the driver could run).
//! - Querying or synchronising a captured stream is refused
//!   (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`), and an event recorded in a capture
//!   (`CUDA_ERROR_CAPTURED_EVENT`); either invalidates the capture. So are the unsafe calls
//!   ([`Op::capture_unsafe`]: allocation, queries and synchronisation of any stream or event,
//!   pool attributes and trims, stream-ordered allocation on a stream not captured) made by a
//!   thread whose own capture mode is not relaxed while a capture forbids them: a capture
//!   begun by the same thread in global or thread-local mode, or one begun by another thread
//!   in global mode. `cuThreadExchangeStreamCaptureMode` sets a thread's own mode.
//! - Work on the legacy stream while a blocking stream of its context captures is refused
//!   (`CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`) and invalidates that capture, stream-ordered
//!   allocations and frees there included, whatever the thread's mode.
//! - An IPC-enabled pool's `cuMemAllocFromPoolAsync` on a captured stream is refused
//!   (`CUDA_ERROR_NOT_SUPPORTED`), the capture left as it was.
//! - Ending an invalidated capture ends it and fails (`CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`).
//! - An event whose last record was made in a capture that ended belongs to the graph: querying
//!   or synchronising it is refused (`CUDA_ERROR_INVALID_VALUE`) until it is recorded again.
//! - A stream that waits on an event recorded in a capture joins it; ending the capture fails
//!   (`CUDA_ERROR_STREAM_CAPTURE_UNJOINED`) unless the capturing stream waited on an event
//!   recorded on each joined stream after its last work.
//! - `cuMemAllocFromPoolAsync` in a capture takes the block at once (the driver reserves
//!   addresses at capture and pages at launch; the simulator takes both at capture). The block
//!   belongs to the graph: freed in the same capture, it is the graph's to reuse; otherwise it
//!   is live from each launch until freed with `cuMemFreeAsync`, which before a launch is
//!   refused (`CUDA_ERROR_INVALID_VALUE`), and a launch while it is still live from the last
//!   one is refused too. `cuMemFreeAsync` in a capture of memory allocated outside it is
//!   refused (`CUDA_ERROR_INVALID_VALUE`) and leaves the capture as it was.
//! - The block returns to its pool when the graph and every executable graph made from it are
//!   destroyed (or, if live then, when it is freed).
//! - The simulator refuses `cuLaunchHostFunc` on a captured stream without invalidating the
//!   capture, as `CudaDriver` does: the trait's host functions run once, a graph's at every
//!   launch.
//!
//! Threads are told apart by `std::thread::ThreadId`; each thread's capture mode is kept in a
//! thread-local.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::thread::ThreadId;

use driver_sys::{
    CaptureMode, CaptureStatus, ContextHandle, DevicePtr, GraphExecHandle, GraphHandle,
    MemPoolHandle, StreamHandle, code,
};

use super::Note;
use super::log::Op;
use super::pools::FreeBlock;
use super::streams::{Source, Work};
use super::world::{World, context};

thread_local! {
    /// This thread's capture mode (`cuThreadExchangeStreamCaptureMode`).
    static THREAD_MODE: Cell<CaptureMode> = const { Cell::new(CaptureMode::Global) };
}

/// A capture under way.
#[derive(Debug)]
pub(super) struct SimCapture {
    pub(super) device: usize,
    /// The queue key of the stream that began it.
    pub(super) origin: u64,
    pub(super) mode: CaptureMode,
    pub(super) thread: ThreadId,
    pub(super) invalidated: bool,
    /// The recorded work, in order.
    pub(super) nodes: Vec<Work>,
    /// Streams that joined it (queue key → whether the origin has waited on them since their
    /// last work).
    pub(super) joined: BTreeMap<u64, bool>,
    /// Blocks allocated in it (address → freed in it).
    pub(super) allocs: BTreeMap<u64, bool>,
}

/// A graph made by ending a capture.
#[derive(Debug)]
pub(super) struct SimGraph {
    pub(super) device: usize,
    pub(super) nodes: Vec<Work>,
    /// Its allocations: address → freed in the graph.
    pub(super) allocs: BTreeMap<u64, bool>,
    /// Whether the graph handle is destroyed (its allocations stay while executables do).
    pub(super) destroyed: bool,
    /// Executable graphs made from it and not destroyed.
    pub(super) execs: usize,
}

/// Where one graph allocation stands.
#[derive(Debug, Default)]
pub(super) struct GraphAlloc {
    /// The graph it belongs to.
    pub(super) graph: u64,
    /// Launched and not freed since.
    pub(super) live: bool,
}

impl Op {
    /// Whether a capture in global or thread-local mode forbids the call (the driver's
    /// "potentially unsafe" calls: they may synchronise, or read what the capture is making),
    /// as measured on an H100 (`stream_capture_conformance`; `cuMemAllocManaged` and the host
    /// calls other than `cuMemHostAlloc` by analogy, not measured). Synchronous copies are not
    /// refused. Event queries and
    /// synchronisations are unsafe too, checked after the event's own capture; stream-ordered
    /// allocations and frees are unsafe on a stream that is not captured.
    pub fn capture_unsafe(self) -> bool {
        matches!(
            self,
            Op::MemAlloc
                | Op::StreamQuery
                | Op::StreamSynchronize
                | Op::CtxSynchronize
                | Op::MemPoolGetAttribute
                | Op::MemPoolSetAttribute
                | Op::MemPoolTrimTo
                | Op::MemFree
                | Op::MemAllocManaged
                | Op::MemHostAlloc
                | Op::MemFreeHost
                | Op::MemHostRegister
                | Op::MemHostUnregister
        )
    }
}

/// A copy of recorded work for a launch; `None` for what a launch does not queue (waits, which
/// the list's order already satisfies).
fn replay(w: &Work) -> Option<Work> {
    Some(match w {
        Work::HtoD { dst, src, len } => Work::HtoD {
            dst: *dst,
            src: match src {
                Source::Snapshot(b) => Source::Snapshot(b.clone()),
                Source::Pinned(at) => Source::Pinned(*at),
            },
            len: *len,
        },
        Work::DtoH { dst, src, len } => Work::DtoH {
            dst: *dst,
            src: *src,
            len: *len,
        },
        Work::DtoD { dst, src, len } => Work::DtoD {
            dst: *dst,
            src: *src,
            len: *len,
        },
        Work::Memset { dst, value, len } => Work::Memset {
            dst: *dst,
            value: *value,
            len: *len,
        },
        Work::Record { event, .. } => Work::Record {
            event: *event,
            serial: 0,
        },
        Work::WaitValue { addr, value, flags } => Work::WaitValue {
            addr: *addr,
            value: *value,
            flags: *flags,
        },
        Work::WriteValue { addr, value } => Work::WriteValue {
            addr: *addr,
            value: *value,
        },
        Work::WaitEvent { .. }
        | Work::WaitStream { .. }
        | Work::PoolFreed { .. }
        | Work::AllocFreed { .. }
        | Work::Recorded { .. } => return None,
        // Refused in a capture (see the module's rules).
        Work::Host(_) => return None,
    })
}

impl World {
    /// Whether process `pid` has no capture under way and no graph memory: every capture rule
    /// is then moot, and the calls skip them (the simulator's cost per call stays what it was
    /// for programs that never capture).
    fn no_captures(&self, pid: usize) -> bool {
        let p = &self.processes[pid];
        p.captures.is_empty() && p.graph_allocs.is_empty()
    }

    /// The capture stream key `k` of process `pid` belongs to, if any.
    pub(super) fn capture_of(&self, pid: usize, k: u64) -> Option<u64> {
        self.processes[pid]
            .streams
            .streams
            .get(&k)
            .and_then(|q| q.capture)
    }

    /// Marks capture `id` invalidated.
    pub(super) fn invalidate(&mut self, pid: usize, id: u64) {
        if let Some(c) = self.processes[pid].captures.get_mut(&id) {
            c.invalidated = true;
        }
    }

    /// Refuses call `op` where a capture forbids it to this thread, invalidating that capture.
    pub(super) fn check_capture_unsafe(&mut self, pid: usize, op: Op) -> Result<(), u32> {
        if self.processes[pid].captures.is_empty() {
            return Ok(());
        }
        if op.capture_unsafe() {
            self.forbid_unsafe(pid)
        } else {
            Ok(())
        }
    }

    /// Refuses an unsafe call where a capture forbids it to this thread, invalidating that
    /// capture.
    pub(super) fn forbid_unsafe(&mut self, pid: usize) -> Result<(), u32> {
        if THREAD_MODE.with(Cell::get) == CaptureMode::Relaxed {
            return Ok(());
        }
        let me = std::thread::current().id();
        self.refuse_for(pid, code::STREAM_CAPTURE_UNSUPPORTED, |_, c| match c.mode {
            CaptureMode::Global => true,
            CaptureMode::ThreadLocal => c.thread == me,
            CaptureMode::Relaxed => false,
        })
    }

    /// Invalidates every capture `forbids` names and fails with `code`, if there is one.
    fn refuse_for(
        &mut self,
        pid: usize,
        code: u32,
        forbids: impl Fn(&World, &SimCapture) -> bool,
    ) -> Result<(), u32> {
        let ids: Vec<u64> = self.processes[pid]
            .captures
            .iter()
            .filter(|(_, c)| forbids(self, c))
            .map(|(&id, _)| id)
            .collect();
        if ids.is_empty() {
            return Ok(());
        }
        for id in ids {
            self.invalidate(pid, id);
        }
        Err(code)
    }

    /// Refuses a query or synchronisation of stream key `k` while it is captured, invalidating
    /// the capture.
    pub(super) fn refuse_if_captured(&mut self, pid: usize, k: u64) -> Result<(), u32> {
        if self.processes[pid].captures.is_empty() {
            return Ok(());
        }
        match self.capture_of(pid, k) {
            Some(id) => {
                self.invalidate(pid, id);
                Err(code::STREAM_CAPTURE_UNSUPPORTED)
            }
            None => Ok(()),
        }
    }

    /// Refuses work on the legacy stream of `device` while a blocking stream of it captures
    /// (`CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`), invalidating that capture.
    fn refuse_implicit(&mut self, pid: usize, device: usize) -> Result<(), u32> {
        self.refuse_for(pid, code::STREAM_CAPTURE_IMPLICIT, |w, c| {
            c.device == device
                && w.processes[pid]
                    .streams
                    .streams
                    .get(&c.origin)
                    .is_some_and(|q| q.blocking)
        })
    }

    /// Work about to be queued on stream key `k` (the legacy stream of `device` when
    /// `legacy`): recorded into its capture (`Ok(None)`), refused, or handed back to queue.
    pub(super) fn capture_work(
        &mut self,
        pid: usize,
        device: usize,
        k: u64,
        legacy: bool,
        work: Work,
    ) -> Result<Option<Work>, u32> {
        if self.processes[pid].captures.is_empty() {
            return Ok(Some(work));
        }
        if legacy {
            self.refuse_implicit(pid, device)?;
            return Ok(Some(work));
        }
        let Some(id) = self.capture_of(pid, k) else {
            return Ok(Some(work));
        };
        if matches!(work, Work::Host(_)) {
            return Err(code::STREAM_CAPTURE_UNSUPPORTED);
        }
        let c = self.processes[pid]
            .captures
            .get_mut(&id)
            .expect("capturing");
        if c.invalidated {
            return Err(code::STREAM_CAPTURE_INVALIDATED);
        }
        if let Some(rejoined) = c.joined.get_mut(&k) {
            *rejoined = false;
        }
        c.nodes.push(work);
        Ok(None)
    }

    /// `cuMemAllocFromPoolAsync`, with capture: a block taken on a captured stream is the
    /// capture's.
    pub(super) fn pool_alloc_captured(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        pool: MemPoolHandle,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<DevicePtr, u32> {
        if self.no_captures(pid) {
            return self.mem_alloc_from_pool_async(pid, note, ctx, pool, bytes, stream);
        }
        let device = context(self, pid, ctx, note)?;
        let k = self.stream_key(pid, device, stream)?;
        if matches!(stream, StreamHandle::NULL | StreamHandle::LEGACY) {
            self.refuse_implicit(pid, device)?;
        }
        let id = self.capture_of(pid, k);
        match id {
            Some(id) if self.processes[pid].captures[&id].invalidated => {
                return Err(code::STREAM_CAPTURE_INVALIDATED);
            }
            // The driver makes no graph memory of an IPC-enabled pool's.
            Some(_)
                if self.processes[pid]
                    .pools
                    .get(&pool.raw())
                    .is_some_and(|p| p.ipc) =>
            {
                return Err(code::NOT_SUPPORTED);
            }
            Some(_) => {}
            None => self.forbid_unsafe(pid)?,
        }
        let p = self.mem_alloc_from_pool_async(pid, note, ctx, pool, bytes, stream)?;
        if let Some(id) = id {
            self.capture_alloc(pid, id, p.0);
        }
        Ok(p)
    }

    /// `cuMemFreeAsync`, with capture and graph allocations (see the module's rules).
    pub(super) fn pool_free_captured(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        ptr: DevicePtr,
        stream: StreamHandle,
    ) -> Result<(), u32> {
        if self.no_captures(pid) {
            return self.mem_free_async(pid, note, ctx, ptr, stream);
        }
        note.ptr = Some(ptr);
        let device = context(self, pid, ctx, note)?;
        let k = self.stream_key(pid, device, stream)?;
        if matches!(stream, StreamHandle::NULL | StreamHandle::LEGACY) {
            self.refuse_implicit(pid, device)?;
        }
        if let Some(id) = self.capture_of(pid, k) {
            return self.capture_free(pid, id, ptr.0);
        }
        self.forbid_unsafe(pid)?;
        if let Some(r) = self.graph_alloc_free(pid, ptr.0) {
            return r;
        }
        self.mem_free_async(pid, note, ctx, ptr, stream)
    }

    /// `cuStreamBeginCapture`.
    pub(super) fn stream_begin_capture(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        stream: StreamHandle,
        mode: CaptureMode,
    ) -> Result<(), u32> {
        let device = context(self, pid, ctx, note)?;
        if matches!(stream, StreamHandle::NULL | StreamHandle::LEGACY) {
            return Err(code::STREAM_CAPTURE_UNSUPPORTED);
        }
        let k = self.stream_key(pid, device, stream)?;
        if self.capture_of(pid, k).is_some() {
            return Err(code::ILLEGAL_STATE);
        }
        let id = self.new_handle();
        let p = &mut self.processes[pid];
        p.captures.insert(
            id,
            SimCapture {
                device,
                origin: k,
                mode,
                thread: std::thread::current().id(),
                invalidated: false,
                nodes: Vec::new(),
                joined: BTreeMap::new(),
                allocs: BTreeMap::new(),
            },
        );
        p.streams.streams.get_mut(&k).expect("keyed").capture = Some(id);
        Ok(())
    }

    /// `cuStreamEndCapture`.
    pub(super) fn stream_end_capture(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        stream: StreamHandle,
    ) -> Result<GraphHandle, u32> {
        let device = context(self, pid, ctx, note)?;
        let k = self.stream_key(pid, device, stream)?;
        let Some(id) = self.capture_of(pid, k) else {
            return Err(code::ILLEGAL_STATE);
        };
        if self.processes[pid].captures[&id].origin != k {
            return Err(code::STREAM_CAPTURE_UNMATCHED);
        }
        let c = self.processes[pid].captures.remove(&id).expect("capturing");
        let p = &mut self.processes[pid];
        for q in p.streams.streams.values_mut() {
            if q.capture == Some(id) {
                q.capture = None;
            }
        }
        for e in p.streams.events.values_mut() {
            if e.captured.is_some_and(|(c, _)| c == id) {
                e.captured = None;
                e.in_graph = true;
            }
        }
        let unjoined = c.joined.values().any(|&rejoined| !rejoined);
        if c.invalidated || unjoined {
            for &addr in c.allocs.keys() {
                self.release_graph_block(pid, addr);
            }
            return Err(if c.invalidated {
                code::STREAM_CAPTURE_INVALIDATED
            } else {
                code::STREAM_CAPTURE_UNJOINED
            });
        }
        let h = self.new_handle();
        let p = &mut self.processes[pid];
        for (&addr, &freed) in &c.allocs {
            if !freed {
                p.graph_allocs.insert(
                    addr,
                    GraphAlloc {
                        graph: h,
                        live: false,
                    },
                );
            }
        }
        p.graphs.insert(
            h,
            SimGraph {
                device,
                nodes: c.nodes,
                allocs: c.allocs,
                destroyed: false,
                execs: 0,
            },
        );
        Ok(crate::sim::made(GraphHandle::from_raw, h))
    }

    /// `cuStreamGetCaptureInfo`.
    pub(super) fn stream_capture_status(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        stream: StreamHandle,
    ) -> Result<CaptureStatus, u32> {
        let device = context(self, pid, ctx, note)?;
        let k = self.stream_key(pid, device, stream)?;
        Ok(match self.capture_of(pid, k) {
            None => CaptureStatus::None,
            Some(id) if self.processes[pid].captures[&id].invalidated => {
                CaptureStatus::Invalidated { id }
            }
            Some(id) => CaptureStatus::Active { id },
        })
    }

    /// `cuThreadExchangeStreamCaptureMode`.
    pub(super) fn thread_exchange_capture_mode(mode: CaptureMode) -> CaptureMode {
        THREAD_MODE.with(|m| m.replace(mode))
    }

    /// `cuEventRecord` on a captured stream: the record is the capture's; queries of the event
    /// are refused until the capture ends.
    pub(super) fn capture_event_record(&mut self, pid: usize, k: u64, event: u64) -> bool {
        if self.processes[pid].captures.is_empty() {
            return false;
        }
        let Some(id) = self.capture_of(pid, k) else {
            return false;
        };
        if let Some(e) = self.processes[pid].streams.events.get_mut(&event) {
            e.captured = Some((id, k));
        }
        true
    }

    /// `cuStreamWaitEvent` of an event recorded in a capture: a stream outside the capture
    /// joins it; the capturing stream waiting on a joined stream's event rejoins that stream.
    pub(super) fn capture_event_wait(&mut self, pid: usize, k: u64, event: u64) {
        let Some((id, on)) = self.processes[pid]
            .streams
            .events
            .get(&event)
            .and_then(|e| e.captured)
        else {
            return;
        };
        let Some(c) = self.processes[pid].captures.get_mut(&id) else {
            return;
        };
        if k == c.origin {
            if let Some(rejoined) = c.joined.get_mut(&on) {
                *rejoined = true;
            }
            return;
        }
        if self.capture_of(pid, k).is_none() {
            let c = self.processes[pid].captures.get_mut(&id).expect("above");
            c.joined.insert(k, false);
            if let Some(q) = self.processes[pid].streams.streams.get_mut(&k) {
                q.capture = Some(id);
            }
        }
    }

    /// Refuses a query or synchronisation of an event recorded in a capture still under way
    /// (`CUDA_ERROR_CAPTURED_EVENT`), or of any event where a capture forbids unsafe calls,
    /// invalidating the capture.
    pub(super) fn refuse_captured_event(&mut self, pid: usize, event: u64) -> Result<(), u32> {
        let e = self.processes[pid].streams.events.get(&event);
        if e.is_some_and(|e| e.in_graph) {
            return Err(code::INVALID_VALUE);
        }
        if self.processes[pid].captures.is_empty() {
            return Ok(());
        }
        let id = e.and_then(|e| e.captured).map(|(id, _)| id);
        match id {
            Some(id) if self.processes[pid].captures.contains_key(&id) => {
                self.invalidate(pid, id);
                Err(code::CAPTURED_EVENT)
            }
            _ => self.forbid_unsafe(pid),
        }
    }

    /// `cuMemAllocFromPoolAsync` on a captured stream made block `addr`: it is the capture's.
    pub(super) fn capture_alloc(&mut self, pid: usize, id: u64, addr: u64) {
        if let Some(c) = self.processes[pid].captures.get_mut(&id) {
            c.allocs.insert(addr, false);
        }
    }

    /// `cuMemFreeAsync` of `addr` on a captured stream: a block of the same capture is freed
    /// in the graph; anything else is refused (`CUDA_ERROR_INVALID_VALUE`), the capture left
    /// as it was.
    pub(super) fn capture_free(&mut self, pid: usize, id: u64, addr: u64) -> Result<(), u32> {
        let c = self.processes[pid]
            .captures
            .get_mut(&id)
            .expect("capturing");
        if c.invalidated {
            return Err(code::STREAM_CAPTURE_INVALIDATED);
        }
        match c.allocs.get_mut(&addr) {
            Some(freed) if !*freed => {
                *freed = true;
                Ok(())
            }
            _ => Err(code::INVALID_VALUE),
        }
    }

    /// `cuMemFreeAsync` outside a capture of a graph's allocation: `Some` when `addr` is one
    /// (refused before a launch made it live; the block stays the graph's), `None` otherwise.
    pub(super) fn graph_alloc_free(&mut self, pid: usize, addr: u64) -> Option<Result<(), u32>> {
        let p = &mut self.processes[pid];
        let a = p.graph_allocs.get_mut(&addr)?;
        if !a.live {
            return Some(Err(code::INVALID_VALUE));
        }
        a.live = false;
        let graph = a.graph;
        let gone = p
            .graphs
            .get(&graph)
            .is_none_or(|g| g.destroyed && g.execs == 0);
        if gone {
            p.graph_allocs.remove(&addr);
            self.release_graph_block(pid, addr);
        }
        Some(Ok(()))
    }

    /// Gives a graph's block back to its pool, reusable on every stream.
    fn release_graph_block(&mut self, pid: usize, addr: u64) {
        if let Some(p) = self.processes[pid]
            .pools
            .values_mut()
            .find(|p| p.live.contains_key(&addr))
        {
            let size = p.live.remove(&addr).expect("found");
            p.used -= size;
            p.free.push(FreeBlock {
                addr,
                size,
                stream: 0,
                ready: true,
                id: 0,
            });
        }
    }

    /// `cuGraphInstantiateWithFlags`.
    pub(super) fn graph_instantiate(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        graph: GraphHandle,
    ) -> Result<GraphExecHandle, u32> {
        context(self, pid, ctx, note)?;
        let h = self.new_handle();
        let p = &mut self.processes[pid];
        let g = p
            .graphs
            .get_mut(&graph.raw())
            .filter(|g| !g.destroyed)
            .ok_or(code::INVALID_VALUE)?;
        g.execs += 1;
        p.execs.insert(h, graph.raw());
        Ok(crate::sim::made(GraphExecHandle::from_raw, h))
    }

    /// `cuGraphLaunch`.
    pub(super) fn graph_launch(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        exec: GraphExecHandle,
        stream: StreamHandle,
    ) -> Result<(), u32> {
        let device = context(self, pid, ctx, note)?;
        let p = &self.processes[pid];
        let graph = *p.execs.get(&exec.raw()).ok_or(code::INVALID_VALUE)?;
        let g = &p.graphs[&graph];
        if g.device != device {
            return Err(code::INVALID_VALUE);
        }
        let unfreed: Vec<u64> = g
            .allocs
            .iter()
            .filter(|(_, f)| !**f)
            .map(|(&a, _)| a)
            .collect();
        if unfreed
            .iter()
            .any(|a| p.graph_allocs.get(a).is_some_and(|a| a.live))
        {
            return Err(code::INVALID_VALUE);
        }
        let work: Vec<Work> = g.nodes.iter().filter_map(replay).collect();
        for a in unfreed {
            if let Some(a) = self.processes[pid].graph_allocs.get_mut(&a) {
                a.live = true;
            }
        }
        for w in work {
            let w = match w {
                Work::Record { event, .. } => {
                    match self.processes[pid].streams.events.get_mut(&event) {
                        Some(e) => {
                            e.recorded += 1;
                            e.pending.insert(e.recorded);
                            Work::Record {
                                event,
                                serial: e.recorded,
                            }
                        }
                        None => continue,
                    }
                }
                w => w,
            };
            self.enqueue(pid, device, stream, w)?;
        }
        Ok(())
    }

    /// `cuGraphExecDestroy`.
    pub(super) fn graph_exec_destroy(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        exec: GraphExecHandle,
    ) -> Result<(), u32> {
        context(self, pid, ctx, note)?;
        let graph = self.processes[pid]
            .execs
            .remove(&exec.raw())
            .ok_or(code::INVALID_VALUE)?;
        if let Some(g) = self.processes[pid].graphs.get_mut(&graph) {
            g.execs -= 1;
        }
        self.collect_graph(pid, graph);
        Ok(())
    }

    /// `cuGraphDestroy`.
    pub(super) fn graph_destroy(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        graph: GraphHandle,
    ) -> Result<(), u32> {
        context(self, pid, ctx, note)?;
        let g = self.processes[pid]
            .graphs
            .get_mut(&graph.raw())
            .filter(|g| !g.destroyed)
            .ok_or(code::INVALID_VALUE)?;
        g.destroyed = true;
        self.collect_graph(pid, graph.raw());
        Ok(())
    }

    /// Once a graph and its executables are all destroyed, its blocks that are not live go
    /// back to their pool (live ones when they are freed).
    fn collect_graph(&mut self, pid: usize, graph: u64) {
        let p = &mut self.processes[pid];
        if !p
            .graphs
            .get(&graph)
            .is_some_and(|g| g.destroyed && g.execs == 0)
        {
            return;
        }
        let g = p.graphs.remove(&graph).expect("checked");
        for addr in g.allocs.into_keys() {
            let p = &mut self.processes[pid];
            if !p.graph_allocs.get(&addr).is_some_and(|a| a.live) {
                p.graph_allocs.remove(&addr);
                self.release_graph_block(pid, addr);
            }
        }
    }

    /// Forgets the captures and graphs of `device` (its context is destroyed).
    pub(super) fn drop_graphs_of(&mut self, pid: usize, device: usize) {
        let p = &mut self.processes[pid];
        p.captures.retain(|_, c| c.device != device);
        let gone: Vec<u64> = p
            .graphs
            .iter()
            .filter(|(_, g)| g.device == device)
            .map(|(&h, _)| h)
            .collect();
        for h in &gone {
            p.graphs.remove(h);
        }
        p.execs.retain(|_, g| !gone.contains(g));
        p.graph_allocs.retain(|_, a| !gone.contains(&a.graph));
    }
}
