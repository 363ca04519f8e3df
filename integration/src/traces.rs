//! The trace corpus and its replay: allocation logs of real programs, recorded on a GPU through
//! emm's `log` adaptor and kept gzipped in `integration/traces/` (the scripts that recorded
//! them are in `integration/traces/record/`), replayed under any manager on the simulator
//! or the GPU, with the memory each manager held measured against what the program had live.
//!
//! `integration/traces/corpus.csv` lists the traces with what was measured of them on the GPU
//! (PyTorch's caching allocator's reserve on the same trace, the bound every manager keeps
//! under); `cargo run --release -p integration --example replay` replays any log.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use driver_mock::{Op, SimConfig, SimDriver};
use driver_sys::{ContextHandle, DeviceOrdinal, Driver, StreamHandle};
use emm::plugin::{POOL_MANAGER, PoolAllocator};
use emm::replay::{RecordedWork, ReplayEvent, ReplayReport, Replayer};
use emm::{EmmError, PoolConfig, Runtime};

/// Where the corpus lives.
pub const TRACE_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/traces");

/// The device a trace replays on off the GPU: as large as an H100's (80 GB), with no byte
/// backed until written.
pub const H100_MEMORY: usize = 80 << 30;

/// The managers every corpus trace is replayed under (the registered ones that hand out device
/// memory).
pub const TRACE_MANAGERS: [&str; 6] = [
    "default",
    "pool",
    "vmm-pool",
    "async-pool",
    "async-pool-ipc",
    "async-pool-managed",
];

/// Reads a log, gunzipping it if its name ends in `.gz`.
pub fn read_log(path: &Path) -> Result<String, String> {
    let raw = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if path.extension().is_some_and(|e| e == "gz") {
        let mut text = String::new();
        flate2::read::GzDecoder::new(&raw[..])
            .read_to_string(&mut text)
            .map_err(|e| format!("{} is not a gzipped text log: {e}", path.display()))?;
        Ok(text)
    } else {
        String::from_utf8(raw).map_err(|e| format!("{} is not text: {e}", path.display()))
    }
}

/// Reads and parses a log.
pub fn load(path: &Path) -> Result<Vec<ReplayEvent>, String> {
    let text = read_log(path)?;
    emm::replay::parse_log(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// A trace's name: its file name without `.csv` and `.gz`.
pub fn trace_name(path: &Path) -> String {
    let name = path
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    name.trim_end_matches(".gz")
        .trim_end_matches(".csv")
        .to_owned()
}

/// One row of `corpus.csv`: a trace and what was measured of it on the GPU.
#[derive(Clone, Debug, PartialEq)]
pub struct CorpusEntry {
    /// The trace's name (`traces/<name>.csv.gz`).
    pub name: String,
    /// What the recorded program does.
    pub workload: String,
    /// Peak bytes PyTorch's caching allocator reserved replaying the trace on the GPU, over
    /// the trace's peak live bytes: the bound every manager keeps under.
    pub torch_reserved_over_live: f64,
    /// Peak device memory the driver's stream-ordered pool held replaying the trace on the
    /// GPU (emm's `async-pool`), over the trace's peak live bytes: what the simulator's model
    /// of that pool is held to.
    pub driver_pool_over_live: f64,
}

/// The rows of the index `file` of [`TRACE_DIR`] (a header line, then `columns` fields a row,
/// the first the trace's name), each with its trace's file, which must exist.
fn read_index(file: &str, columns: &str) -> Result<Vec<(Vec<String>, PathBuf)>, String> {
    let index = Path::new(TRACE_DIR).join(file);
    let text = std::fs::read_to_string(&index)
        .map_err(|e| format!("cannot read {}: {e}", index.display()))?;
    let want = columns.split(',').count();
    let mut rows = Vec::new();
    for (n, line) in text.lines().enumerate().skip(1) {
        if line.trim().is_empty() {
            continue;
        }
        let fields: Vec<String> = line.split(',').map(|f| f.trim().to_owned()).collect();
        if fields.len() != want {
            return Err(format!(
                "{} line {}: want {columns}",
                index.display(),
                n + 1
            ));
        }
        let path = Path::new(TRACE_DIR).join(format!("{}.csv.gz", fields[0]));
        if !path.is_file() {
            return Err(format!(
                "{} lists {}, but {} is missing",
                index.display(),
                fields[0],
                path.display()
            ));
        }
        rows.push((fields, path));
    }
    Ok(rows)
}

/// The corpus: every trace `corpus.csv` lists, with its file, which must exist.
pub fn corpus() -> Result<Vec<(CorpusEntry, PathBuf)>, String> {
    let ratio = |text: &str| {
        text.parse::<f64>()
            .map_err(|e| format!("corpus.csv: {text:?}: {e}"))
    };
    read_index(
        "corpus.csv",
        "name,workload,torch_reserved_over_live,driver_pool_over_live",
    )?
    .into_iter()
    .map(|(f, path)| {
        Ok((
            CorpusEntry {
                torch_reserved_over_live: ratio(&f[2])?,
                driver_pool_over_live: ratio(&f[3])?,
                name: f[0].clone(),
                workload: f[1].clone(),
            },
            path,
        ))
    })
    .collect()
}

/// One row of `programs.csv`: a log of a program of `record/programs.py`, recorded on the GPU
/// under `pool` with the `log` adaptor's `Reached` column (how far the GPU had got), so that
/// its replay sees the work in flight the program had.
#[derive(Clone, Debug, PartialEq)]
pub struct ProgramTrace {
    /// The trace's name (`traces/<name>.csv.gz`).
    pub name: String,
    /// What the recorded program does, and which part of it the trace keeps.
    pub workload: String,
}

/// The program traces: every trace `programs.csv` lists, with its file, which must exist.
pub fn programs() -> Result<Vec<(ProgramTrace, PathBuf)>, String> {
    Ok(read_index("programs.csv", "name,workload,steps_recorded")?
        .into_iter()
        .map(|(f, path)| {
            (
                ProgramTrace {
                    name: f[0].clone(),
                    workload: f[1].clone(),
                },
                path,
            )
        })
        .collect())
}

/// What replaying a trace under one manager gave, pass by pass.
#[derive(Clone, Debug)]
pub struct ManagerReplay {
    /// The manager's name.
    pub manager: String,
    /// One report per pass, in order.
    pub passes: Vec<ReplayReport>,
    /// Driver allocations and frees over all passes (device memory, pool and mapping calls),
    /// where the driver counts them (the simulator does; the real driver does not).
    pub driver_calls: Option<(usize, usize)>,
    /// The driver allocations of each pass, in order, where the driver counts them.
    pub pass_driver_allocations: Vec<usize>,
    /// Mappings made and taken down over all passes (`cuMemMap`, `cuMemUnmap`: `vmm-pool`
    /// maps each new piece, and unmaps a piece to move it where a growth needs it or to give
    /// it back), where the driver counts them. Each is a driver call on the allocating
    /// thread, as costly as an allocation, though neither gives the process memory.
    pub mappings: Option<(usize, usize)>,
    /// The `cuMemUnmap` calls of each pass, in order, where the driver counts them.
    pub pass_unmaps: Vec<usize>,
    /// The most the manager's device pool said it held, where it has one.
    pub pool_peak_held: Option<usize>,
    /// The waits the manager's device pool counted over all passes, on the GPU for another
    /// stream's work and on the host (`PoolStats::stream_waits`, `host_waits`), where it has a
    /// pool.
    pub pool_waits: Option<(u64, u64)>,
}

/// The simulated machine a trace replays on: one device of `device_memory` bytes.
pub fn trace_sim(device_memory: usize) -> Arc<SimDriver> {
    Arc::new(SimDriver::new(SimConfig::single(device_memory)))
}

/// Driver calls that give a process device memory, and those that take it back.
const ALLOCATING: [Op; 4] = [
    Op::MemAlloc,
    Op::MemAllocFromPoolAsync,
    Op::MemAllocManaged,
    Op::MemCreate,
];
const FREEING: [Op; 3] = [Op::MemFree, Op::MemFreeAsync, Op::MemRelease];

/// The simulator's counts of the calls a replay reports, at one moment: those that give
/// device memory and take it back ([`ALLOCATING`], [`FREEING`]), and mappings made and taken
/// down (`cuMemMap`, `cuMemUnmap`).
#[derive(Clone, Copy)]
struct CallCounts {
    allocating: usize,
    freeing: usize,
    maps: usize,
    unmaps: usize,
}

impl CallCounts {
    fn now(sim: &SimDriver) -> CallCounts {
        CallCounts {
            allocating: count(sim, &ALLOCATING),
            freeing: count(sim, &FREEING),
            maps: sim.count(Op::MemMap),
            unmaps: sim.count(Op::MemUnmap),
        }
    }

    /// The calls made since `earlier`.
    fn since(self, earlier: CallCounts) -> CallCounts {
        CallCounts {
            allocating: self.allocating - earlier.allocating,
            freeing: self.freeing - earlier.freeing,
            maps: self.maps - earlier.maps,
            unmaps: self.unmaps - earlier.unmaps,
        }
    }
}

/// The simulator's stand-in work for a replay that reproduces the GPU's progress
/// ([`RecordedWork`]): `launch_recorded` and `reach_recorded` on the replay's context.
struct SimRecordedWork<'s> {
    sim: &'s SimDriver,
    ctx: ContextHandle,
}

impl RecordedWork for SimRecordedWork<'_> {
    fn launched(&mut self, stream: StreamHandle, at: u64) -> Result<(), EmmError> {
        self.sim
            .launch_recorded(self.ctx, stream, at)
            .map_err(|e| EmmError::driver("queueing recorded work", DeviceOrdinal(0), e))
    }

    fn reached(&mut self, stream: StreamHandle, at: u64) -> Result<(), EmmError> {
        self.sim
            .reach_recorded(self.ctx, stream, at)
            .map_err(|e| EmmError::driver("moving recorded progress", DeviceOrdinal(0), e))
    }
}

/// `events` as if the GPU had run `lag_ns` behind the host throughout: each stream-ordered
/// event's progress is its time less the lag (a what-if for logs recorded without progress,
/// or to see how a manager fares with more work in flight). Events without a time are left
/// as they are.
pub fn with_lag(events: &[ReplayEvent], lag_ns: u64) -> Vec<ReplayEvent> {
    events
        .iter()
        .map(|e| ReplayEvent {
            reached: match (e.stream, e.at) {
                (Some(_), Some(at)) => Some(at.saturating_sub(lag_ns)),
                _ => e.reached,
            },
            ..*e
        })
        .collect()
}

/// Whether a log says how far the GPU had got (the `log` adaptor's `Reached` column).
pub fn has_progress(events: &[ReplayEvent]) -> bool {
    events.iter().any(|e| e.reached.is_some())
}

/// Replays `events` `passes` times under `manager` on a fresh runtime over `driver` (`sim`
/// is the same driver, when it is the simulator, for its call counts). On the simulator, a log
/// that says how far the GPU had got replays with that progress ([`Replayer::pass_recorded`]):
/// streams are busy where they were, and the frees of fenced memory become reusable when they
/// did; other logs replay with every stream's work done after each event. `pool_config`, when
/// given, configures the `pool` manager in place of [`PoolConfig::default`], and where it sets
/// [`PoolConfig::vmm_piece`], `vmm-pool`'s pieces too (its other fields [`PoolConfig::vmm`]'s).
pub fn replay_under(
    driver: Arc<dyn Driver>,
    sim: Option<&SimDriver>,
    manager: &str,
    pool_config: Option<PoolConfig>,
    events: &[ReplayEvent],
    passes: usize,
) -> Result<ManagerReplay, String> {
    let mut builder = Runtime::builder(driver).ignore_env();
    if let Some(config) = pool_config {
        builder = builder.register_manager(PoolAllocator::factory_with(POOL_MANAGER, config));
        if config.vmm_piece.is_some() {
            builder = builder.register_manager(PoolAllocator::vmm_factory_with(PoolConfig {
                vmm_piece: config.vmm_piece,
                ..PoolConfig::vmm()
            }));
        }
    }
    let runtime = builder
        .memory_manager_name(manager)
        .build()
        .map_err(|e| format!("{manager}: {e}"))?;
    let ctx = runtime
        .context(DeviceOrdinal(0))
        .map_err(|e| format!("{manager}: {e}"))?;
    let before = sim.map(CallCounts::now);
    let mut replayer = Replayer::new(&ctx).map_err(|e| format!("{manager}: {e}"))?;
    let mut reports = Vec::with_capacity(passes);
    let progress = has_progress(events);
    let mut pass_driver_allocations = Vec::with_capacity(passes);
    let mut pass_unmaps = Vec::with_capacity(passes);
    for _ in 0..passes {
        let pass_start = sim.map(CallCounts::now);
        // The simulator runs streams' queued work when asked: after every event, as a GPU
        // keeps up with a program that gives it no work of its own (or, with the log's
        // progress, as far as the stand-ins of the program's work let it).
        let run = || {
            if let Some(s) = sim {
                s.run_streams();
            }
        };
        let report = match sim.filter(|_| progress) {
            Some(s) => {
                let mut work = SimRecordedWork {
                    sim: s,
                    ctx: ctx.handle(),
                };
                replayer.pass_recorded(events, &mut work, run)
            }
            None => replayer.pass_with(events, run),
        };
        reports.push(report.map_err(|e| format!("{manager}: {e}"))?);
        if let (Some(s), Some(start)) = (sim, pass_start) {
            let pass = CallCounts::now(s).since(start);
            pass_driver_allocations.push(pass.allocating);
            pass_unmaps.push(pass.unmaps);
        }
    }
    let all = sim.zip(before).map(|(s, b)| CallCounts::now(s).since(b));
    let driver_calls = all.map(|c| (c.allocating, c.freeing));
    let mappings = all.map(|c| (c.maps, c.unmaps));
    let pool = ctx.pool_stats().device;
    let pool_peak_held = pool.map(|s| s.peak_held_bytes);
    let pool_waits = pool.map(|s| (s.stream_waits, s.host_waits));
    drop(replayer);
    ctx.trim().map_err(|e| format!("{manager}: trim: {e}"))?;
    Ok(ManagerReplay {
        manager: manager.to_owned(),
        passes: reports,
        driver_calls,
        pass_driver_allocations,
        mappings,
        pass_unmaps,
        pool_peak_held,
        pool_waits,
    })
}

impl ManagerReplay {
    /// The most held over all passes.
    pub fn peak_held(&self) -> usize {
        self.passes
            .iter()
            .map(|p| p.peak_held_bytes)
            .max()
            .unwrap_or(0)
    }

    /// [`peak_held`](Self::peak_held) over the trace's peak live bytes.
    pub fn held_over_live(&self) -> f64 {
        let live = self.passes.first().map_or(0, |p| p.peak_live_bytes);
        self.peak_held() as f64 / live.max(1) as f64
    }
}

fn count(sim: &SimDriver, ops: &[Op]) -> usize {
    ops.iter().map(|&op| sim.count(op)).sum()
}

/// Replays `events` under `manager` on a fresh simulated device of `device_memory` bytes
/// (`pool_config` as in [`replay_under`]).
pub fn replay_on_sim(
    manager: &str,
    pool_config: Option<PoolConfig>,
    events: &[ReplayEvent],
    device_memory: usize,
    passes: usize,
) -> Result<ManagerReplay, String> {
    let sim = trace_sim(device_memory);
    replay_under(
        sim.clone(),
        Some(&sim),
        manager,
        pool_config,
        events,
        passes,
    )
}
