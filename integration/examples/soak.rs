//! A soak: round after round, under `default`, `pool`, `async-pool` and `async-pool-ipc` in
//! turn, the stress workload (16 threads of mixed operations with concurrent context resets)
//! and an IPC round trip to another process (a real child process on the GPU), for
//! `EMM_SOAK_SECONDS` (default 60). After every round the device memory must be back to the
//! byte; the host's resident memory is sampled after every round and must not grow: its
//! highest value in the last third of the run may exceed its highest in the first third by at
//! most 8 MiB. The soak runs with two glibc malloc arenas (it re-executes itself with
//! `MALLOC_ARENA_MAX=2` unless the variable is set): with the default, every new worker thread
//! may get an arena of its own for a while, and resident memory creeps up with no leak behind
//! it (measured here: 7 to 55 MiB in 10 s, and flat at 14 MiB with one arena).
//!
//! ```sh
//! cargo run --release --example soak                       # the simulator, or the GPU if there is one
//! EMM_DRIVER=cuda EMM_SOAK_SECONDS=300 ./soak              # the GPU job's run, on the GPU machine
//! ```
//!
//! It prints one line per round (manager, operations, resets, resident memory, device free
//! memory) and a verdict last; it exits with 1 when memory grew or anything failed.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use integration::{IpcMode, Target, TestCtx, open_in_other_process};

const MANAGERS: [&str; 4] = ["default", "pool", "async-pool", "async-pool-ipc"];

/// Resident host memory of this process, in bytes (`VmRSS` of `/proc/self/status`).
fn resident_bytes() -> Result<u64, String> {
    let status = std::fs::read_to_string("/proc/self/status")
        .map_err(|e| format!("/proc/self/status: {e}"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|kb| kb.trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .ok_or_else(|| "/proc/self/status has no VmRSS line".into())
}

fn main() -> ExitCode {
    integration::run_ipc_child_if_requested();
    if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
        // glibc reads the variable when the process starts: run again with it.
        let status = std::env::current_exe()
            .and_then(|exe| {
                std::process::Command::new(exe)
                    .args(std::env::args_os().skip(1))
                    .env("MALLOC_ARENA_MAX", "2")
                    .status()
            })
            .map_err(|e| format!("re-running with MALLOC_ARENA_MAX=2: {e}"));
        return match status {
            Ok(s) if s.success() => ExitCode::SUCCESS,
            Ok(_) => ExitCode::FAILURE,
            Err(e) => integration::exit_with(Err(e.into())),
        };
    }
    integration::exit_with(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let seconds = integration::parse_count(
        "EMM_SOAK_SECONDS",
        std::env::var("EMM_SOAK_SECONDS").ok().as_deref(),
        60,
        1,
    )?;
    let ops = integration::parse_count(
        "EMM_SOAK_OPS",
        std::env::var("EMM_SOAK_OPS").ok().as_deref(),
        64_000,
        16,
    )? as usize;
    let target = if integration::driver_from_env()?.simulated {
        Target::Sim
    } else {
        Target::Cuda
    };
    println!("soak: {target}, {seconds} s, {ops} operations a round");
    let end = Instant::now() + Duration::from_secs(seconds);
    let start = Instant::now();
    let mut samples: Vec<(Duration, u64)> = Vec::new();
    let mut round = 0usize;
    while Instant::now() < end || round < 3 * MANAGERS.len() {
        let manager = MANAGERS[round % MANAGERS.len()];
        let t = TestCtx::with(target, |b| b.memory_manager_name(manager))?;
        let ctx = t.context()?;
        ctx.flush_deallocations()?;
        let baseline = ctx.get_memory_info()?.free;
        let resets = integration::stress::mixed_operations(&ctx, ops)?;
        if manager != "async-pool" {
            let data: Vec<u8> = (0..1 << 20).map(|i| (i * 7 + round) as u8).collect();
            let mem = ctx.to_device(&data)?;
            let handle = ctx.get_ipc_handle(&mem)?;
            let seen = open_in_other_process(&t, &handle.to_bytes(), IpcMode::Auto, 0)?;
            if seen != data {
                return Err(format!("round {round}: the other process saw other bytes").into());
            }
        }
        ctx.flush_deallocations()?;
        ctx.reset()?;
        let free = ctx.get_memory_info()?.free;
        if free != baseline {
            return Err(format!(
                "round {round} ({manager}): device free memory {free} after the round, {baseline} before"
            )
            .into());
        }
        drop((ctx, t));
        let rss = resident_bytes()?;
        samples.push((start.elapsed(), rss));
        println!(
            "soak round {round:>4} {manager:<15} {ops} ops, {resets:>4} resets, resident {:>7.1} MiB, device free {free}",
            rss as f64 / (1 << 20) as f64
        );
        round += 1;
    }
    let total = start.elapsed();
    let peak = |from: Duration, to: Duration| {
        samples
            .iter()
            .filter(|(t, _)| *t >= from && *t <= to)
            .map(|(_, r)| *r)
            .max()
            .unwrap_or(0)
    };
    let early = peak(Duration::ZERO, total / 3);
    let late = peak(total * 2 / 3, total);
    let growth = late as i64 - early as i64;
    let limit = 8 << 20;
    println!(
        "soak: {round} rounds in {:.0} s; resident memory peak {:.1} MiB in the first third, {:.1} MiB in the last ({growth:+} bytes, limit +{limit}); device memory back to the byte every round",
        total.as_secs_f64(),
        early as f64 / (1 << 20) as f64,
        late as f64 / (1 << 20) as f64
    );
    if growth > limit {
        return Err(format!("resident memory grew by {growth} bytes").into());
    }
    Ok(())
}
