//! The GPU benchmark: in one process, times the raw driver (`cuMemAlloc`, the driver's default
//! stream-ordered pool, `cuMemHostAlloc`, copies) and every emm manager on the same sizes and
//! workloads, and prints one CSV line per measurement (`section,subject,param,threads,value,unit`)
//! followed by nothing else; `BENCHMARKS.md` is made from that output.
//!
//! ```text
//! cargo run --release -p integration --example bench_gpu            # GPU (or the simulator)
//! EMM_DRIVER=sim cargo run --release -p integration --example bench_gpu
//! EMM_BENCH_QUICK=1 ...                                             # fewer iterations
//! ```
//!
//! Figures are medians of 5 batches; each batch times many operations and divides. On the
//! simulator (a device of 80 GiB, so that workloads sized by the device's memory are the GPU
//! run's) the numbers are bookkeeping plus the simulator's own cost, not GPU figures; a cached
//! `pool` pair makes no driver call, so there it is the same path as on the GPU.

mod common;
mod copies;
mod pairs;
mod random;
mod stream;
mod threads;

use std::sync::Arc;

use emm::driver_sys::Driver;

use common::*;
use copies::*;
use pairs::*;
use random::*;
use stream::*;
use threads::*;

fn main() {
    // The ipc section re-runs this executable as the other process of its staged opens.
    integration::run_ipc_child_if_requested();
    let quick = integration::parse_flag(
        "EMM_BENCH_QUICK",
        std::env::var("EMM_BENCH_QUICK").ok().as_deref(),
    );
    let only = std::env::var("EMM_BENCH_ONLY").unwrap_or_default();
    let unknown: Vec<&str> = only
        .split(',')
        .filter(|s| !s.is_empty() && !SECTIONS.contains(s))
        .collect();
    match quick {
        Ok(q) => QUICK.set(q).expect("set once"),
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    }
    if !unknown.is_empty() {
        eprintln!(
            "EMM_BENCH_ONLY={only:?} names unknown sections {unknown:?}: use a comma-separated list of {}, or unset it",
            SECTIONS.join(", ")
        );
        std::process::exit(2);
    }
    let choice = match integration::driver_from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    eprintln!(
        "bench_gpu: driver {} ({})",
        choice.driver.name(),
        choice.reason
    );
    eprintln!(
        "bench_gpu: pool shards entered without a lock (membarrier): {}",
        emm::internals::shards_without_locks()
    );
    let (driver, simulated) = (choice.driver, choice.simulated);
    // On the simulator, one device of an H100's memory (the suite's simulated device has 256
    // MiB): the sections size their workloads by the device's memory (the random workload's
    // cap, the live blocks), so that this way they run the GPU run's workloads.
    let driver = if simulated {
        Arc::new(driver_mock::SimDriver::new(
            driver_mock::SimConfig::with_devices(vec![driver_mock::SimDeviceConfig::new(
                SIM_DEVICE_BYTES,
            )]),
        )) as Arc<dyn Driver>
    } else {
        driver
    };
    let probe = runtime(&driver, "default", false, vec![]);
    let total = probe
        .context(0)
        .and_then(|c| c.get_memory_info())
        .expect("device memory info")
        .total;
    drop(probe);
    TOTAL.set(total).expect("set once");
    let log_dir = std::env::var_os("EMM_BENCH_DIR").map(std::path::PathBuf::from);
    println!("section,subject,param,threads,value,unit");
    host_probe();
    let want = |s: &str| only.is_empty() || only.split(',').any(|o| o == s);
    if want("pair") {
        alloc_free_pairs(&driver);
    }
    if want("interleaved") {
        interleaved_pairs(&driver, simulated);
    }
    if want("threads") {
        scaling(&driver);
    }
    if want("random") {
        random_workload(&driver, log_dir.as_deref());
        if let Some(dir) = &log_dir {
            replays(&driver, dir);
        }
    }
    if want("random-pool") {
        random_pool(&driver);
    }
    if want("pinned") {
        pinned(&driver);
    }
    if want("copy") {
        copies(&driver);
    }
    if want("stream") {
        stream_ordered(&driver);
    }
    if want("overhead") {
        overhead(&driver);
    }
    if want("live") {
        live_blocks(&driver, simulated);
    }
    if want("anchors") {
        anchors(&driver, simulated);
    }
    if want("mixes") {
        thread_mixes(&driver);
    }
    if want("default") {
        default_fairly(&driver);
    }
    if want("ipc") {
        staged_ipc(&driver, simulated);
    }
}
