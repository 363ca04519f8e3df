//! CUDA graphs over emm memory: graph pools (the private pools of stream capture) and
//! [`Graph`], a captured, instantiated graph that keeps its pool.
//!
//! The rules are [`GraphPool`]'s.
#![allow(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::{Arc, Weak};

use driver_sys::{
    CaptureMode, CaptureStatus, DevicePtr, ErrorKind, GraphExecHandle, GraphHandle, StreamHandle,
};

use super::context::{Context, ContextInner};
use crate::contract::factory::ManagerContext;
use crate::contract::manager::StreamOrdering;
use crate::error::EmmError;
use crate::memory::pointer::MemoryPointer;
use crate::objects::{Stream, check_same_context};
use crate::sync::{AtomicBool, AtomicUsize, Mutex, Ordering, lock};

/// Blocks are carved in multiples of this.
const ALIGN: usize = 512;
/// The smallest segment, and the rounding of larger ones.
const SEGMENT: usize = 2 << 20;

/// The next graph pool's id, process-wide: a static, which loom's atomics cannot be (the
/// only order it needs is that two pools get different ids).
static NEXT_POOL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// What a graph pool holds, in bytes and blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphPoolStats {
    /// Bytes of the segments taken from the manager.
    pub held_bytes: usize,
    /// Bytes of blocks handed out and not freed.
    pub in_use_bytes: usize,
    /// Blocks handed out and not freed.
    pub in_use_blocks: usize,
    /// Segments taken from the manager.
    pub segments: usize,
}

struct Block {
    size: usize,
    free: bool,
    segment: usize,
}

#[derive(Default)]
struct Carve {
    /// Segments by index (`None` once given back).
    segments: Vec<Option<MemoryPointer>>,
    /// Every block, free or not, by address.
    blocks: BTreeMap<u64, Block>,
    /// Free blocks by (size, address), for best fit.
    free: BTreeSet<(usize, u64)>,
    stats: GraphPoolStats,
}

impl Carve {
    fn take(&mut self, size: usize) -> Option<u64> {
        let &(have, at) = self.free.range((size, 0)..).next()?;
        self.free.remove(&(have, at));
        let b = self.blocks.get_mut(&at).expect("listed");
        b.free = false;
        if have - size >= ALIGN {
            b.size = size;
            let segment = b.segment;
            let rest = at + size as u64;
            self.blocks.insert(
                rest,
                Block {
                    size: have - size,
                    free: true,
                    segment,
                },
            );
            self.free.insert((have - size, rest));
        }
        let size = self.blocks[&at].size;
        self.stats.in_use_bytes += size;
        self.stats.in_use_blocks += 1;
        Some(at)
    }

    fn give_back(&mut self, at: u64) {
        let Some(b) = self.blocks.get_mut(&at) else {
            return;
        };
        debug_assert!(!b.free, "a graph pool block freed twice");
        b.free = true;
        let (mut at, mut size, segment) = (at, b.size, b.segment);
        self.stats.in_use_bytes -= size;
        self.stats.in_use_blocks -= 1;
        // Merge with the next block, then the previous one, within the segment.
        let next = at + size as u64;
        if let Some(n) = self.blocks.get(&next)
            && n.free
            && n.segment == segment
        {
            self.free.remove(&(n.size, next));
            size += n.size;
            self.blocks.remove(&next);
        }
        if let Some((&p, prev)) = self.blocks.range(..at).next_back()
            && prev.free
            && prev.segment == segment
            && p + prev.size as u64 == at
        {
            self.free.remove(&(prev.size, p));
            size += prev.size;
            self.blocks.remove(&at);
            at = p;
        }
        self.blocks.get_mut(&at).expect("kept").size = size;
        self.free.insert((size, at));
    }

    fn add_segment(&mut self, mem: MemoryPointer) {
        let (at, size) = (mem.device_ptr().0, mem.size());
        let segment = self.segments.len();
        self.segments.push(Some(mem));
        self.blocks.insert(
            at,
            Block {
                size,
                free: true,
                segment,
            },
        );
        self.free.insert((size, at));
        self.stats.held_bytes += size;
        self.stats.segments += 1;
    }
}

/// A segment of `bytes` from the context's manager. A manager over the driver's
/// stream-ordered pool allocates plain memory on the legacy stream, which a capture of a
/// blocking stream refuses: the segment is allocated on the context's side stream instead and
/// waited for, so that every stream may use it.
fn segment_from(ctx: &Arc<ContextInner>, bytes: usize) -> Result<MemoryPointer, EmmError> {
    if ctx.manager.stream_ordering() != StreamOrdering::Driver {
        return ctx.manager.memalloc(bytes);
    }
    let side = ctx.graph_routes.side_stream(ctx)?;
    let mut mem = ctx.manager.memalloc_on(bytes, side.handle())?;
    mem.keep_stream(&*side);
    side.synchronize()?;
    Ok(mem)
}

struct PoolInner {
    id: u64,
    device: driver_sys::DeviceOrdinal,
    ctx: Weak<ContextInner>,
    carve: Mutex<Carve>,
}

impl PoolInner {
    fn allocate(self: &Arc<Self>, bytes: usize) -> Result<MemoryPointer, EmmError> {
        let size = bytes.max(1).div_ceil(ALIGN) * ALIGN;
        let ctx = self.ctx.upgrade().ok_or(EmmError::Stale {
            what: "a graph pool allocation",
            device: self.device,
            reason: "every handle of the pool's context was dropped",
        })?;
        let found = lock(&self.carve).take(size);
        let at = match found {
            Some(at) => at,
            None => {
                let segment = if size <= SEGMENT / 2 {
                    SEGMENT
                } else {
                    size.div_ceil(SEGMENT) * SEGMENT
                };
                // Without the pool's lock: the manager may flush frees, and a block of this
                // pool among them takes the lock to come back.
                let mem = {
                    let _relaxed = ctx.cx.relax_capture();
                    segment_from(&ctx, segment)?
                };
                tracing::debug!(device = %ctx.cx.device, pool = self.id, bytes = segment, "graph pool segment");
                let mut carve = lock(&self.carve);
                carve.add_segment(mem);
                carve.take(size).expect("the new segment fits")
            }
        };
        let (device, context) = (ctx.cx.device, ctx.cx.context);
        let pool = Arc::clone(self);
        // SAFETY: `at .. at + size` is a block of a segment the pool holds from the manager, handed
        // out once; the release gives it back to the pool, which keeps the segment until no block
        // is out.
        Ok(unsafe {
            MemoryPointer::with_release(device, context, DevicePtr(at), size, move |p, _| {
                lock(&pool.carve).give_back(p.0)
            })
        })
    }
}

impl Drop for PoolInner {
    fn drop(&mut self) {
        let mut carve = lock(&self.carve);
        if carve.stats.segments > 0 {
            tracing::debug!(
                pool = self.id,
                bytes = carve.stats.held_bytes,
                "graph pool segments back to the manager"
            );
        }
        // Dropping the segments' pointers hands them back to the manager, in relaxed mode: a
        // capture this thread could not end must not refuse the frees.
        let ctx = self.ctx.upgrade();
        let _relaxed = ctx.as_ref().map(|c| c.cx.relax_capture());
        carve.segments.clear();
    }
}

/// A private pool for the allocations of stream capture (PyTorch's graph pools). Cheap to
/// clone; the segments go back to the manager when the last clone, the last routed stream and
/// the last block are gone.
///
/// # The rules
///
/// - While a graph pool is begun on a stream ([`Context::begin_graph_pool`]), every
///   [`Context::memalloc_on`] of that stream is served from the pool, under every manager. The
///   pool takes whole segments from the context's manager ([`Context::memalloc`]) with the
///   calling thread's capture mode relaxed, so that a global capture does not refuse the
///   manager's own driver calls; blocks are carved from the segments by best fit and merge
///   again when freed.
/// - A block belongs to the pool. Freed during a capture, it is reused by later allocations of
///   the same pool only, so work a graph replays never shares memory with work outside it
///   (PyTorch's private pools). Allocations on other streams never see the pool.
/// - The segments go back to the manager when the pool is unused: no [`GraphPool`] handle
///   (every [`Graph`] holds one), no stream routed to it, and every block freed. Drop a graph,
///   or the last handle of its pool, only after its last launch completed.
/// - Outside a graph pool, a manager that would make calls a capture forbids refuses to
///   allocate on a captured stream with an error that says so ([`EmmError::NotSupported`]), and
///   leaves the capture intact; `async-pool` allocates there with the driver's graph memory
///   nodes.
#[derive(Clone)]
pub struct GraphPool {
    inner: Arc<PoolInner>,
}

impl GraphPool {
    /// A block of at least `bytes` (see the module's rules).
    pub(crate) fn allocate(&self, bytes: usize) -> Result<MemoryPointer, EmmError> {
        self.inner.allocate(bytes)
    }

    /// The pool's id, unique in the process.
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// What the pool holds now.
    pub fn stats(&self) -> GraphPoolStats {
        lock(&self.inner.carve).stats
    }
}

impl fmt::Debug for GraphPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GraphPool")
            .field("id", &self.inner.id)
            .field("stats", &self.stats())
            .finish()
    }
}

/// A context's streams routed to graph pools.
#[derive(Default)]
pub(crate) struct GraphRoutes {
    /// How many streams are routed: the allocation path reads only this while it is 0.
    count: AtomicUsize,
    routes: Mutex<Vec<(StreamHandle, GraphPool)>>,
    /// A non-blocking stream of the context for segments of stream-ordered managers, made on
    /// first use.
    side: Mutex<Option<Arc<Stream>>>,
    /// Whether captures begun by others get graph pools of their own
    /// ([`Context::enable_capture_pools`]).
    auto: AtomicBool,
    /// The pools of those captures, by capture id, with their stream and whether the capture
    /// is known to have ended; and how many are not known to have ended.
    auto_pools: Mutex<Vec<AutoPool>>,
    auto_open: AtomicUsize,
    /// Every graph pool made for the context, while it lives (for snapshots).
    made: Mutex<Vec<Weak<PoolInner>>>,
    /// The device memory that work recorded into a capture uses (a copy's, a set's), by the
    /// captured stream: the graph's launches read and write it, so it lives as long as the
    /// graph. [`Context::capture`] hands its stream's to the graph it makes; a capture begun
    /// by another library leaves them here until
    /// [`release_capture_pools`](Context::release_capture_pools) (once that capture ended) or
    /// a reset.
    captured: Mutex<Vec<(StreamHandle, Vec<MemoryPointer>)>>,
}

/// A segment a graph pool took from the manager, with its carved blocks.
pub(crate) struct GraphPoolSegment {
    pub(crate) pool: u64,
    pub(crate) address: u64,
    pub(crate) bytes: usize,
    /// (address, size, free), by address.
    pub(crate) blocks: Vec<(u64, usize, bool)>,
}

struct AutoPool {
    capture: u64,
    stream: StreamHandle,
    pool: GraphPool,
    ended: bool,
}

impl GraphRoutes {
    /// Every graph pool made for the context that still lives.
    fn live_pools(&self) -> Vec<Arc<PoolInner>> {
        lock(&self.made).iter().filter_map(Weak::upgrade).collect()
    }

    /// The address ranges (start, end) of every live graph pool's segments.
    fn pool_ranges(&self) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        for pool in self.live_pools() {
            let carve = lock(&pool.carve);
            out.extend(carve.segments.iter().flatten().map(|mem| {
                let start = mem.device_ptr().0;
                (start, start + mem.size() as u64)
            }));
        }
        out
    }

    /// The segments of every live graph pool of the context: (pool id, segment address,
    /// segment size, its blocks as (address, size, free)).
    pub(crate) fn pool_segments(&self) -> Vec<GraphPoolSegment> {
        let mut out = Vec::new();
        for pool in self.live_pools() {
            let carve = lock(&pool.carve);
            for (index, mem) in carve.segments.iter().enumerate() {
                let Some(mem) = mem else { continue };
                out.push(GraphPoolSegment {
                    pool: pool.id,
                    address: mem.device_ptr().0,
                    bytes: mem.size(),
                    blocks: carve
                        .blocks
                        .iter()
                        .filter(|(_, b)| b.segment == index)
                        .map(|(&at, b)| (at, b.size, b.free))
                        .collect(),
                });
            }
        }
        out
    }

    /// The side stream ([`segment_from`]), made on first use.
    fn side_stream(&self, ctx: &Arc<ContextInner>) -> Result<Arc<Stream>, EmmError> {
        let mut side = lock(&self.side);
        if let Some(s) = &*side {
            return Ok(Arc::clone(s));
        }
        let ctx = Context {
            inner: Arc::clone(ctx),
        };
        let s = Arc::new(ctx.create_stream_with(true, 0)?);
        *side = Some(Arc::clone(&s));
        Ok(s)
    }

    /// The pool `stream` is routed to, if any.
    pub(crate) fn pool_for(&self, stream: StreamHandle) -> Option<GraphPool> {
        if self.count.load(Ordering::Acquire) == 0 {
            return None;
        }
        lock(&self.routes)
            .iter()
            .find(|(s, _)| *s == stream)
            .map(|(_, p)| p.clone())
    }

    fn begin(&self, stream: StreamHandle, pool: GraphPool) -> Result<(), EmmError> {
        let mut routes = lock(&self.routes);
        if routes.iter().any(|(s, _)| *s == stream) {
            return Err(EmmError::InvalidArgument {
                what: "begin_graph_pool",
                reason: format!(
                    "stream {stream} already allocates from a graph pool; call end_graph_pool \
                     for it first"
                ),
            });
        }
        routes.push((stream, pool));
        self.count.store(routes.len(), Ordering::Release);
        Ok(())
    }

    fn end(&self, stream: StreamHandle) -> Result<GraphPool, EmmError> {
        let mut routes = lock(&self.routes);
        let Some(i) = routes.iter().position(|(s, _)| *s == stream) else {
            return Err(EmmError::InvalidArgument {
                what: "end_graph_pool",
                reason: format!(
                    "stream {stream} allocates from no graph pool; call begin_graph_pool first"
                ),
            });
        };
        let (_, pool) = routes.swap_remove(i);
        self.count.store(routes.len(), Ordering::Release);
        Ok(pool)
    }

    /// Forgets every route (the context is reset).
    pub(crate) fn clear(&self) {
        let mut routes = lock(&self.routes);
        routes.clear();
        self.count.store(0, Ordering::Release);
        lock(&self.side).take();
        lock(&self.auto_pools).clear();
        self.set_open(0);
        drop(routes);
        // Dropped with no lock of the routes held (a pointer's release runs its manager).
        drop(std::mem::take(&mut *lock(&self.captured)));
    }

    /// Keeps `memory`, which work just recorded into a capture of `stream` uses, until the
    /// graph is known to be gone ([`GraphRoutes::captured`]).
    /// A graph pool's blocks are not kept: the pool keeps them for its graphs, and a block
    /// freed during the capture serves the capture's next allocation, in the graph's order.
    pub(crate) fn keep_captured(&self, stream: StreamHandle, mut memory: Vec<MemoryPointer>) {
        if memory.is_empty() {
            return;
        }
        let pooled = self.pool_ranges();
        memory.retain(|m| {
            let at = m.device_ptr().0;
            !pooled
                .iter()
                .any(|&(start, end)| (start..end).contains(&at))
        });
        if memory.is_empty() {
            return;
        }
        let mut captured = lock(&self.captured);
        match captured.iter_mut().find(|(s, _)| *s == stream) {
            Some((_, kept)) => kept.extend(memory),
            None => captured.push((stream, memory)),
        }
    }

    /// The memory kept for work recorded into captures of `stream` (the graph takes it).
    fn take_captured(&self, stream: StreamHandle) -> Vec<MemoryPointer> {
        let mut captured = lock(&self.captured);
        match captured.iter().position(|(s, _)| *s == stream) {
            Some(k) => captured.swap_remove(k).1,
            None => Vec::new(),
        }
    }

    /// Whether captures begun by others get graph pools of their own.
    pub(crate) fn auto(&self) -> bool {
        self.auto.load(Ordering::Relaxed)
    }

    /// Marks the pools whose capture is no longer under way as ended; returns how many are
    /// still open.
    fn settle(&self, cx: &ManagerContext, pools: &mut [AutoPool]) -> usize {
        let mut open = 0;
        for p in pools.iter_mut().filter(|p| !p.ended) {
            match cx.driver.stream_capture_status(cx.context, p.stream) {
                Ok(s) if s.id() == Some(p.capture) => open += 1,
                // Ended, or the handle names another stream now (its capture is another).
                Ok(_) => p.ended = true,
                // The stream's owner destroyed it, which a capture under way forbids: the
                // capture ended before.
                Err(e) if e.kind() == ErrorKind::InvalidHandle => {
                    tracing::debug!(device = %cx.device, stream = ?p.stream, "the stream of a capture pool is gone; its capture ended");
                    p.ended = true;
                }
                // Asked again later.
                Err(_) => open += 1,
            }
        }
        self.set_open(open);
        open
    }

    /// Records how many of this context's capture pools are open, in the process-wide count
    /// too.
    fn set_open(&self, open: usize) {
        let was = self.auto_open.swap(open, Ordering::AcqRel);
        if open > was {
            OPEN_CAPTURE_POOLS.fetch_add(open - was, Ordering::AcqRel);
        } else if was > open {
            OPEN_CAPTURE_POOLS.fetch_sub(was - open, Ordering::AcqRel);
        }
    }
}

impl Drop for GraphRoutes {
    fn drop(&mut self) {
        self.set_open(0);
    }
}

/// Capture pools not known to have ended, over every context of the process: a static, which
/// loom's atomics cannot be (each context's own count, `auto_open`, is loom's).
static OPEN_CAPTURE_POOLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Whether a capture pool of any context may still be open (one atomic load): a framework's
/// free path asks this before looking up its context's
/// [`capture_pools_open`](Context::capture_pools_open).
pub fn capture_pools_may_be_open() -> bool {
    OPEN_CAPTURE_POOLS.load(Ordering::Acquire) > 0
}

/// A graph captured on a stream of a context, instantiated, and the graph pool its
/// allocations came from. Dropping it destroys the executable graph and the graph, then lets
/// the pool go: drop it only after its last launch completed.
pub struct Graph {
    ctx: Context,
    graph: GraphHandle,
    exec: GraphExecHandle,
    pool: GraphPool,
    /// The device memory the captured work reads and writes (copies' and sets' operands):
    /// every launch uses it, so it is freed only after the graph (its pool's blocks are kept
    /// by `pool`). Declared last: dropped after the graph is destroyed.
    uses: Vec<MemoryPointer>,
}

impl Graph {
    /// Queues the graph's work on `stream`. Refused where memory the captured work reads or
    /// writes was freed by a reset, or is asleep ([`Context::sleep`]): the launch would write
    /// another's memory, or fault on the device.
    pub fn launch(&self, stream: &Stream) -> Result<(), EmmError> {
        check_same_context(&self.ctx.inner.cx, stream.context(), "Graph::launch")?;
        self.ctx.ensure_alive("Graph::launch")?;
        let cx = &self.ctx.inner.cx;
        let _held = cx.use_memory();
        // What the captured work reads and writes: refused once a reset freed it, or while
        // asleep (the launch would fault on the device).
        for used in &self.uses {
            cx.check_usable("Graph::launch", used)?;
        }
        cx.driver
            .graph_launch(cx.context, self.exec, stream.handle())
            .map_err(|e| EmmError::driver("launching a graph", cx.device, e))
    }

    /// The pool the graph's allocations came from (pass it to
    /// [`Context::begin_graph_pool_shared`] to capture another graph into the same memory).
    pub fn pool(&self) -> &GraphPool {
        &self.pool
    }

    /// The driver's graph and executable graph.
    pub fn handles(&self) -> (GraphHandle, GraphExecHandle) {
        (self.graph, self.exec)
    }
}

impl fmt::Debug for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Graph")
            .field("graph", &self.graph)
            .field("exec", &self.exec)
            .field("pool", &self.pool)
            .finish()
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        let cx = &self.ctx.inner.cx;
        let Some(_live) = cx.liveness.enter() else {
            return;
        };
        // SAFETY: the graph and executable graph are this object's, used by nothing after it;
        // launches already queued still run (the driver's rule).
        let results = unsafe {
            [
                cx.driver.graph_exec_destroy(cx.context, self.exec),
                cx.driver.graph_destroy(cx.context, self.graph),
            ]
        };
        for r in results {
            if let Err(e) = r {
                tracing::error!(device = %cx.device, error = %e, "destroying a graph");
            }
        }
    }
}

impl Context {
    /// Serves every [`memalloc_on`](Self::memalloc_on) of `stream` from a new graph pool
    /// until [`end_graph_pool`](Self::end_graph_pool): call it before capturing `stream`
    /// into a graph, under any manager. The rules are [`GraphPool`]'s.
    ///
    /// ```
    /// let sim = std::sync::Arc::new(driver_mock::SimDriver::new(Default::default()));
    /// let runtime = emm::Runtime::builder(sim).ignore_env().build()?;
    /// let ctx = runtime.context(0)?;
    /// let s = ctx.create_stream()?;
    /// let pool = ctx.begin_graph_pool(&s)?;
    /// let m = ctx.memalloc_on(1024, &s)?;
    /// ctx.end_graph_pool(&s)?;
    /// assert_eq!(pool.stats().in_use_blocks, 1);
    /// drop(m);
    /// assert_eq!(pool.stats().in_use_blocks, 0);
    /// # Ok::<(), emm::EmmError>(())
    /// ```
    pub fn begin_graph_pool(&self, stream: &Stream) -> Result<GraphPool, EmmError> {
        check_same_context(&self.inner.cx, stream.context(), "begin_graph_pool")?;
        let pool = self.new_graph_pool();
        self.route(stream.handle(), pool.clone())?;
        Ok(pool)
    }

    /// As [`begin_graph_pool`](Self::begin_graph_pool), into an existing pool (PyTorch's
    /// `pool=` of `torch.cuda.graph`): graphs captured into one pool share its memory, and
    /// must then not run concurrently.
    pub fn begin_graph_pool_shared(
        &self,
        stream: &Stream,
        pool: &GraphPool,
    ) -> Result<(), EmmError> {
        check_same_context(&self.inner.cx, stream.context(), "begin_graph_pool_shared")?;
        self.route(stream.handle(), pool.clone())
    }

    /// As [`begin_graph_pool`](Self::begin_graph_pool) (or, with `pool`,
    /// [`begin_graph_pool_shared`](Self::begin_graph_pool_shared)) for a stream known only by
    /// its handle (another library's). The stream must be a stream of this context; a
    /// handle of no stream is refused by no one here, and simply never matches.
    pub fn begin_graph_pool_raw(
        &self,
        stream: StreamHandle,
        pool: Option<&GraphPool>,
    ) -> Result<GraphPool, EmmError> {
        let pool = pool.cloned().unwrap_or_else(|| self.new_graph_pool());
        self.route(stream, pool.clone())?;
        Ok(pool)
    }

    /// Ends what [`begin_graph_pool`](Self::begin_graph_pool) began: `stream`'s allocations
    /// come from the manager again. The pool keeps its blocks for the graph.
    pub fn end_graph_pool(&self, stream: &Stream) -> Result<(), EmmError> {
        self.end_graph_pool_raw(stream.handle()).map(drop)
    }

    /// As [`end_graph_pool`](Self::end_graph_pool), by handle; returns the pool.
    pub fn end_graph_pool_raw(&self, stream: StreamHandle) -> Result<GraphPool, EmmError> {
        self.inner.graph_routes.end(stream)
    }

    /// Captures the work `record` queues on `stream` into a graph, with every
    /// [`memalloc_on`](Self::memalloc_on) of `stream` meanwhile served from a new graph pool,
    /// and instantiates it. `mode` is the capture's ([`CaptureMode::Global`] is what PyTorch
    /// and CuPy use). The capture ends whatever `record` returns; its error comes first.
    pub fn capture<T>(
        &self,
        stream: &Stream,
        mode: CaptureMode,
        record: impl FnOnce(&Stream) -> Result<T, EmmError>,
    ) -> Result<(Graph, T), EmmError> {
        self.ensure_alive("capture")?;
        let pool = self.begin_graph_pool(stream)?;
        let cx = &self.inner.cx;
        let err = |what, e| EmmError::driver(what, cx.device, e);
        if let Err(e) = cx
            .driver
            .stream_begin_capture(cx.context, stream.handle(), mode)
        {
            self.end_graph_pool(stream)?;
            return Err(err("beginning a stream capture", e));
        }
        let recorded = record(stream);
        let ended = cx.driver.stream_end_capture(cx.context, stream.handle());
        if ended.is_err() && cx.stream_is_captured(stream.handle()) != Ok(false) {
            // A capture left under way would record (and refuse) every later call: ended
            // once more, its graph (if any) dropped, the first error kept.
            match cx.driver.stream_end_capture(cx.context, stream.handle()) {
                Ok(g) => {
                    // SAFETY: the graph just made, used by nothing.
                    if let Err(e) = unsafe { cx.driver.graph_destroy(cx.context, g) } {
                        tracing::error!(device = %cx.device, error = %e, "destroying a graph");
                    }
                }
                Err(e) => {
                    tracing::error!(device = %cx.device, error = %e, "a stream capture could not be ended; the stream still captures")
                }
            }
        }
        self.end_graph_pool(stream)?;
        let value = recorded?;
        let graph = ended.map_err(|e| err("ending a stream capture", e))?;
        let exec = match cx.driver.graph_instantiate(cx.context, graph) {
            Ok(exec) => exec,
            Err(e) => {
                // SAFETY: the graph just made, used by nothing else.
                if let Err(d) = unsafe { cx.driver.graph_destroy(cx.context, graph) } {
                    tracing::error!(device = %cx.device, error = %d, "destroying a graph");
                }
                return Err(err("instantiating a graph", e));
            }
        };
        let uses = self.inner.graph_routes.take_captured(stream.handle());
        tracing::debug!(device = %cx.device, pool = pool.id(), kept = uses.len(), "graph captured");
        Ok((
            Graph {
                ctx: self.clone(),
                graph,
                exec,
                pool,
                uses,
            },
            value,
        ))
    }

    /// Gives every capture that another library begins on this context's streams a graph
    /// pool of its own, found by the capture's id at each
    /// [`memalloc_on_raw`](Self::memalloc_on_raw) (a `cuStreamGetCaptureInfo` per call while
    /// on): PyTorch's and CuPy's allocators over emm, which are not told when a capture
    /// begins, turn it on. The pools keep their memory for the graphs until
    /// [`release_capture_pools`](Self::release_capture_pools). Whether a capture ended is
    /// asked of its stream; a stream its owner destroyed since (the driver refuses the
    /// handle) counts as ended.
    pub fn enable_capture_pools(&self) {
        self.inner.graph_routes.auto.store(true, Ordering::Relaxed);
    }

    /// Whether a capture with a pool of [`enable_capture_pools`](Self::enable_capture_pools)
    /// may still be under way (a capture query per such capture): frees made meanwhile
    /// should run in [`relaxed`](Self::relaxed_capture) mode, as a global capture refuses
    /// the calls a manager's free may make.
    pub fn capture_pools_open(&self) -> bool {
        let routes = &self.inner.graph_routes;
        if routes.auto_open.load(Ordering::Acquire) == 0 {
            return false;
        }
        routes.settle(&self.inner.cx, &mut lock(&routes.auto_pools)) > 0
    }

    /// Lets go of the pools of captures that ended
    /// ([`enable_capture_pools`](Self::enable_capture_pools)): their
    /// memory goes back to the manager once every block of theirs is freed. Call it after the
    /// graphs captured with them are gone (PyTorch: after `graph.reset()` or deleting the
    /// graph). The memory that emm's copies and sets recorded into captures other than
    /// [`capture`](Self::capture)'s used, kept for their graphs, goes too where the capture
    /// ended. Returns how many pools were let go.
    pub fn release_capture_pools(&self) -> usize {
        let routes = &self.inner.graph_routes;
        let released = {
            let mut pools = lock(&routes.auto_pools);
            routes.settle(&self.inner.cx, &mut pools);
            let before = pools.len();
            pools.retain(|p| !p.ended);
            before - pools.len()
        };
        // The memory that work recorded into those captures used goes too, but that of a
        // capture still under way (or whose stream the driver cannot say about).
        let ended: Vec<Vec<MemoryPointer>> = {
            let mut captured = lock(&routes.captured);
            let (ended, open): (Vec<_>, Vec<_>) = std::mem::take(&mut *captured)
                .into_iter()
                .partition(|(s, _)| self.inner.cx.stream_is_captured(*s) == Ok(false));
            *captured = open;
            ended.into_iter().map(|(_, m)| m).collect()
        };
        drop(ended);
        released
    }

    /// The thread's capture mode relaxed until the guard drops (see
    /// [`capture_pools_open`](Self::capture_pools_open)).
    pub fn relaxed_capture(&self) -> crate::contract::RelaxedCapture<'_> {
        self.inner.cx.relax_capture()
    }

    /// The graph pool that serves `stream` now: one begun on it, else, with
    /// [`enable_capture_pools`](Self::enable_capture_pools) on, that of the capture under way
    /// on it (the legacy default stream has none).
    #[inline]
    pub(crate) fn graph_pool_of(
        &self,
        stream: StreamHandle,
    ) -> Result<Option<GraphPool>, EmmError> {
        let routes = &self.inner.graph_routes;
        if let Some(pool) = routes.pool_for(stream) {
            return Ok(Some(pool));
        }
        // The legacy default stream is never captured (the driver refuses to begin a capture
        // there, and asking it while another stream captures is an error), so an allocation
        // on it asks the driver nothing.
        if routes.auto() && !matches!(stream, StreamHandle::NULL | StreamHandle::LEGACY) {
            return self.capture_pool(stream);
        }
        Ok(None)
    }

    /// The pool of the capture under way on `stream`, if any (out of line: a context
    /// without capture pools never calls it).
    #[inline(never)]
    fn capture_pool(&self, stream: StreamHandle) -> Result<Option<GraphPool>, EmmError> {
        let cx = &self.inner.cx;
        let status = cx
            .driver
            .stream_capture_status(cx.context, stream)
            .map_err(|e| cx.driver_error("asking whether the stream is captured", e))?;
        let id = match status {
            CaptureStatus::None => return Ok(None),
            CaptureStatus::Active { id } => id,
            CaptureStatus::Invalidated { .. } => {
                return Err(EmmError::InvalidArgument {
                    what: "memalloc_on",
                    reason: format!(
                        "stream {stream} is being captured and the capture was invalidated by \
                         an earlier refused call; end it and capture again"
                    ),
                });
            }
        };
        let routes = &self.inner.graph_routes;
        let mut pools = lock(&routes.auto_pools);
        if let Some(p) = pools.iter().find(|p| p.capture == id) {
            return Ok(Some(p.pool.clone()));
        }
        let pool = self.new_graph_pool();
        tracing::debug!(device = %cx.device, capture = id, pool = pool.id(), "graph pool for a capture");
        pools.push(AutoPool {
            capture: id,
            stream,
            pool: pool.clone(),
            ended: false,
        });
        routes.settle(cx, &mut pools);
        Ok(Some(pool))
    }

    fn new_graph_pool(&self) -> GraphPool {
        let inner = Arc::new(PoolInner {
            id: NEXT_POOL.fetch_add(1, Ordering::Relaxed),
            device: self.inner.cx.device,
            ctx: Arc::downgrade(&self.inner),
            carve: Mutex::new(Carve::default()),
        });
        let mut made = lock(&self.inner.graph_routes.made);
        made.retain(|p| p.strong_count() > 0);
        made.push(Arc::downgrade(&inner));
        GraphPool { inner }
    }

    fn route(&self, stream: StreamHandle, pool: GraphPool) -> Result<(), EmmError> {
        self.ensure_alive("begin_graph_pool")?;
        self.inner.graph_routes.begin(stream, pool)
    }
}
