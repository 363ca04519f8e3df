//! Replays allocation logs under memory managers and prints what each held against what the
//! program had live.
//!
//! ```text
//! cargo run --release -p integration --example replay -- [OPTIONS] [LOG ...]
//!
//!   LOG                   an emm `log` adaptor CSV or an RMM log, plain or gzipped (.gz)
//!   --corpus              every trace of integration/traces/corpus.csv
//!   --manager M[,M...]    the managers (default: default, pool, async-pool, async-pool-ipc,
//!                         async-pool-managed)
//!   --driver sim|cuda     the simulator (default) or the GPU (device 0)
//!   --device-memory SIZE  the simulated device's memory (default 80GiB, an H100's)
//!   --passes N            replay each log N times in a row on one runtime (default 1)
//!   --csv FILE            also write the rows to FILE
//!   --lag MS              on the simulator, replay as if the GPU had run MS milliseconds
//!                         behind the host (each stream-ordered event's progress is its time
//!                         less MS), in place of what the log recorded
//!   --pool-chunk SIZE     `pool`'s chunk size (`PoolConfig::chunk_size`: the most it grows by
//!                         at once, default 128MiB), to weigh memory held against driver calls
//!   --vmm-piece SIZE      the size of every piece `vmm-pool` maps (`PoolConfig::vmm_piece`, a
//!                         power of two from 2MiB; by default a sixteenth of each growth), to
//!                         weigh memory held against the pieces it maps and moves
//! ```
//!
//! On the simulator, a log with the `log` adaptor's `Reached` column replays with the GPU's
//! progress it recorded: streams busy where they were, fenced frees reusable when they were.
//!
//! Each row: the trace, the manager, its peak live bytes (from the replay), the peak device
//! memory the driver counted as used (`total - free`, read after every allocation) and its
//! ratio to peak live, the most the manager's pool said it held, the driver's allocations and
//! frees and, where there were any, its mappings made and taken down (`cuMemMap`,
//! `cuMemUnmap`: `vmm-pool` moving pieces; simulator only), the waits the pool counted (on the
//! GPU for another stream's work, on the host for a stream's: `PoolStats::stream_waits`,
//! `host_waits`), allocations and frees per second (time in the manager's calls alone), the
//! largest free block the pool reported at the held peak, and, with `--passes`, every pass's
//! peak held and what was held after the last one.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;

use driver_sys::Driver;
use emm::PoolConfig;
use integration::traces::{self, ManagerReplay, TRACE_MANAGERS};

struct Options {
    logs: Vec<PathBuf>,
    managers: Vec<String>,
    cuda: bool,
    device_memory: usize,
    passes: usize,
    csv: Option<PathBuf>,
    lag_ns: Option<u64>,
    pool_config: Option<PoolConfig>,
}

const USAGE: &str = "usage: replay [--corpus] [--manager M[,M...]] [--driver sim|cuda] \
                     [--device-memory SIZE] [--passes N] [--csv FILE] [--lag MS] [--pool-chunk SIZE] [--vmm-piece SIZE] [LOG ...]";

fn parse_size(text: &str) -> Result<usize, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    let n: usize = digits
        .parse()
        .map_err(|_| format!("{text:?} is not a size (such as 80GiB)"))?;
    let shift = match unit.trim() {
        "" | "B" => 0,
        "KiB" => 10,
        "MiB" => 20,
        "GiB" => 30,
        "TiB" => 40,
        other => {
            return Err(format!(
                "unknown unit {other:?} in {text:?}; use B, KiB, MiB, GiB or TiB"
            ));
        }
    };
    n.checked_shl(shift)
        .filter(|v| v >> shift == n)
        .ok_or_else(|| format!("{text:?} does not fit in a usize"))
}

fn options() -> Result<Options, String> {
    let mut o = Options {
        logs: Vec::new(),
        managers: TRACE_MANAGERS.iter().map(|m| m.to_string()).collect(),
        cuda: false,
        device_memory: traces::H100_MEMORY,
        passes: 1,
        csv: None,
        lag_ns: None,
        pool_config: None,
    };
    let mut args = std::env::args().skip(1);
    let value = |args: &mut dyn Iterator<Item = String>, flag: &str| {
        args.next()
            .ok_or_else(|| format!("{flag} needs a value; {USAGE}"))
    };
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--corpus" => {
                for (_, path) in traces::corpus()? {
                    o.logs.push(path);
                }
            }
            "--manager" => {
                o.managers = value(&mut args, "--manager")?
                    .split(',')
                    .map(|m| m.trim().to_owned())
                    .collect()
            }
            "--driver" => match value(&mut args, "--driver")?.as_str() {
                "sim" => o.cuda = false,
                "cuda" => o.cuda = true,
                other => return Err(format!("--driver {other}: sim or cuda")),
            },
            "--device-memory" => {
                o.device_memory = parse_size(&value(&mut args, "--device-memory")?)?
            }
            "--passes" => {
                o.passes = value(&mut args, "--passes")?
                    .parse()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or("--passes takes a count of at least 1")?
            }
            "--csv" => o.csv = Some(PathBuf::from(value(&mut args, "--csv")?)),
            "--lag" => {
                let ms: f64 = value(&mut args, "--lag")?
                    .parse()
                    .ok()
                    .filter(|ms: &f64| ms.is_finite() && *ms >= 0.0)
                    .ok_or("--lag takes milliseconds, such as 5 or 0.5")?;
                o.lag_ns = Some((ms * 1e6) as u64);
            }
            "--pool-chunk" => {
                o.pool_config = Some(PoolConfig {
                    chunk_size: parse_size(&value(&mut args, "--pool-chunk")?)?,
                    ..o.pool_config.unwrap_or_default()
                })
            }
            "--vmm-piece" => {
                o.pool_config = Some(PoolConfig {
                    vmm_piece: Some(parse_size(&value(&mut args, "--vmm-piece")?)?),
                    ..o.pool_config.unwrap_or_default()
                })
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            flag if flag.starts_with("--") => {
                return Err(format!("unknown option {flag}; {USAGE}"));
            }
            log => o.logs.push(PathBuf::from(log)),
        }
    }
    if o.logs.is_empty() {
        return Err(format!("no log given; {USAGE}"));
    }
    Ok(o)
}

const MIB: f64 = (1 << 20) as f64;

const HEADER: &str = "trace,manager,driver,events,peak_live_bytes,peak_held_bytes,held_over_live,pool_peak_held_bytes,driver_allocations,driver_frees,ops_per_second,largest_free_at_peak_bytes,held_after_bytes,pass_peak_held_bytes,stream_waits,host_waits,driver_maps,driver_unmaps";

/// A figure for the CSV, empty where there is none.
fn opt<T: ToString>(v: Option<T>) -> String {
    v.map_or_else(String::new, |v| v.to_string())
}

fn csv_row(trace: &str, driver: &str, events: usize, r: &ManagerReplay) -> String {
    let first = &r.passes[0];
    let passes: Vec<String> = r
        .passes
        .iter()
        .map(|p| p.peak_held_bytes.to_string())
        .collect();
    format!(
        "{trace},{},{driver},{events},{},{},{:.4},{},{},{},{:.0},{},{},{},{},{},{},{}",
        r.manager,
        first.peak_live_bytes,
        r.peak_held(),
        r.held_over_live(),
        opt(r.pool_peak_held),
        opt(r.driver_calls.map(|c| c.0)),
        opt(r.driver_calls.map(|c| c.1)),
        first.ops_per_second(),
        opt(first.largest_free_at_peak),
        r.passes.last().map_or(0, |p| p.held_after_bytes),
        passes.join(" "),
        opt(r.pool_waits.map(|w| w.0)),
        opt(r.pool_waits.map(|w| w.1)),
        opt(r.mappings.map(|m| m.0)),
        opt(r.mappings.map(|m| m.1)),
    )
}

fn print_row(trace: &str, r: &ManagerReplay) {
    let first = &r.passes[0];
    let mut line = format!(
        "{trace:<22} {:<20} live {:>9.1} MiB  held {:>9.1} MiB  held/live {:>5.3}",
        r.manager,
        first.peak_live_bytes as f64 / MIB,
        r.peak_held() as f64 / MIB,
        r.held_over_live(),
    );
    if let Some(p) = r.pool_peak_held {
        let _ = write!(line, "  pool held {:>9.1} MiB", p as f64 / MIB);
    }
    if let Some((a, f)) = r.driver_calls {
        let _ = write!(line, "  driver {a} allocs {f} frees");
    }
    if let Some((maps, unmaps)) = r.mappings.filter(|&(m, u)| m + u > 0) {
        let _ = write!(line, " {maps} maps {unmaps} unmaps");
    }
    if let Some((gpu, host)) = r.pool_waits {
        let _ = write!(line, "  waits {gpu} GPU {host} host");
    }
    let _ = write!(line, "  {:>10.0} ops/s", first.ops_per_second());
    if let Some(l) = first.largest_free_at_peak {
        let _ = write!(line, "  largest free at peak {:.1} MiB", l as f64 / MIB);
    }
    if first.failures > 0 {
        let _ = write!(line, "  {} allocations REFUSED", first.failures);
    }
    if r.passes.len() > 1 {
        let held: Vec<String> = r
            .passes
            .iter()
            .map(|p| format!("{:.1}", p.peak_held_bytes as f64 / MIB))
            .collect();
        let _ = write!(
            line,
            "  per pass [{}] MiB, after {:.1} MiB",
            held.join(", "),
            r.passes.last().map_or(0, |p| p.held_after_bytes) as f64 / MIB
        );
    }
    println!("{line}");
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    integration::log_from_env();
    let o = options()?;
    let cuda: Option<Arc<dyn Driver>> = if o.cuda {
        #[cfg(feature = "cuda")]
        {
            Some(Arc::new(driver_sys::CudaDriver::load()?))
        }
        #[cfg(not(feature = "cuda"))]
        {
            return Err(
                "this build has no `cuda` feature; rebuild with it for --driver cuda".into(),
            );
        }
    } else {
        None
    };
    let driver_name = if o.cuda { "cuda" } else { "sim" };
    let mut csv = String::from(HEADER);
    csv.push('\n');
    for path in &o.logs {
        let mut events = traces::load(path)?;
        if let Some(lag) = o.lag_ns {
            if o.cuda {
                return Err("--lag replays on the simulator only".into());
            }
            events = traces::with_lag(&events, lag);
        }
        let summary = emm::replay::summarize(&events);
        let name = traces::trace_name(path);
        println!(
            "{name}: {} events, {} allocations of {} sizes on {} streams, peak live {:.1} MiB",
            events.len(),
            summary.allocations,
            summary.sizes,
            summary.streams,
            summary.peak_live_bytes as f64 / MIB
        );
        for manager in &o.managers {
            let r = match &cuda {
                Some(driver) => traces::replay_under(
                    Arc::clone(driver),
                    None,
                    manager,
                    o.pool_config,
                    &events,
                    o.passes,
                )?,
                None => traces::replay_on_sim(
                    manager,
                    o.pool_config,
                    &events,
                    o.device_memory,
                    o.passes,
                )?,
            };
            print_row(&name, &r);
            csv.push_str(&csv_row(&name, driver_name, events.len(), &r));
            csv.push('\n');
        }
    }
    if let Some(path) = &o.csv {
        std::fs::write(path, csv).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    integration::exit_with(run())
}
