//! The integration suite: every test runs on each available target.
//!
//! Run it with `cargo test -p integration --test suite` (or `cargo test` at the top). With no
//! GPU the CUDA instances are reported as ignored, with the reason printed once; with
//! `EMM_REQUIRE_GPU=1` a missing GPU fails the run instead.

use std::sync::Mutex;

use integration::{Target, cuda_availability, gpu_required, requested_targets};
use libtest_mimic::{Arguments, Failed, Trial};

/// Fails the test with a message unless the condition holds.
macro_rules! ensure {
    ($cond:expr) => {
        ensure!($cond, "")
    };
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(libtest_mimic::Failed::from(format!("{} (at {}:{}): {}", stringify!($cond), file!(), line!(), format!($($msg)+))));
        }
    };
}

/// Fails the test unless both sides are equal.
macro_rules! ensure_eq {
    ($left:expr, $right:expr) => {
        ensure_eq!($left, $right, "")
    };
    ($left:expr, $right:expr, $($msg:tt)+) => {{
        let (l, r) = (&$left, &$right);
        if l != r {
            return Err(libtest_mimic::Failed::from(format!(
                "{} == {} failed (at {}:{}): left {:?}, right {:?}. {}",
                stringify!($left), stringify!($right), file!(), line!(), l, r, format!($($msg)+)
            )));
        }
    }};
}

mod basics;
mod context_stack;
mod cuda_memory;
mod cuda_only;
mod deallocations;
mod driver_conformance;
mod emm_plugins;
mod host_alloc;
mod ipc;
mod multi_device;
mod reset;
mod stress;

/// A suite test: runs against one target.
pub type SuiteFn = fn(Target) -> Result<(), Failed>;

/// Lists suite tests as (name, function) pairs; the name is the function's.
macro_rules! suite_tests {
    ($($module:ident::$name:ident),* $(,)?) => {
        &[$((stringify!($name), $module::$name as SuiteFn)),*]
    };
}

/// Every suite test. Tests that mirror a Numba test carry its name.
const TESTS: &[(&str, SuiteFn)] = suite_tests![
    basics::alloc_write_read_free,
    basics::test_memcpy,
    basics::mem_get_info_reflects_allocations,
    basics::test_derived_pointer,
    basics::copies_are_bounds_checked,
    basics::initialize_runs_on_every_use,
    basics::test_context_memory,
    deallocations::test_max_pending_count,
    deallocations::test_max_pending_bytes,
    deallocations::test_defer_cleanup,
    deallocations::test_nested_defer_cleanup,
    deallocations::test_exception,
    deallocations::oom_flushes_and_retries_once,
    deallocations::oom_inside_defer_cleanup_reports_clear_error,
    reset::reset_frees_everything,
    reset::reset_before_initialize,
    reset::reset_device_makes_old_memory_stale,
    reset::test_reset_device,
    reset::runtime_drop_releases_everything,
    emm_plugins::test_memalloc,
    emm_plugins::test_initialized_in_context,
    emm_plugins::test_reset,
    emm_plugins::test_get_memory_info,
    emm_plugins::test_get_ipc_handle,
    emm_plugins::test_bad_plugin_version,
    deallocations::test_del_stream,
    deallocations::test_del_event,
    deallocations::test_del_pinned_memory,
    deallocations::test_del_mapped_memory,
    deallocations::test_del_device_memory,
    deallocations::test_del_pinned_contextmanager,
    deallocations::test_del_mapped_contextmanager,
    cuda_memory::test_device_memory,
    cuda_memory::test_device_view,
    cuda_memory::test_host_alloc,
    cuda_memory::test_pinned_memory,
    cuda_memory::test_user_extension,
    cuda_memory::test_memset,
    cuda_memory::test_d2d,
    cuda_memory::test_ownership,
    host_alloc::test_host_alloc_driver,
    host_alloc::test_host_alloc_pinned,
    host_alloc::test_host_alloc_mapped,
    host_alloc::test_pinned,
    host_alloc::test_unpinned,
    host_alloc::reset_frees_tracked_host_memory,
    context_stack::test_attached_primary,
    context_stack::test_select_device,
    context_stack::modules_unload_on_drop_and_reset,
    ipc::test_ipc_handle,
    ipc::test_ipc_handle_serialization,
    ipc::test_ipc_array,
    ipc::test_staged,
    ipc::ipc_handle_errors,
    ipc::pool_export_per_manager,
    stress::stress_mixed_operations,
    driver_conformance::alignment_of_allocations,
    driver_conformance::pool_export_conformance,
    driver_conformance::zero_byte_alloc_is_invalid_value,
    driver_conformance::oversized_alloc_is_out_of_memory,
    driver_conformance::double_free_is_invalid_value,
    driver_conformance::interior_pointer_free_is_invalid_value,
    driver_conformance::address_range_of_interior_pointer,
    driver_conformance::out_of_range_copy_is_invalid_value,
    driver_conformance::mem_get_info_accounts_large_allocations,
    driver_conformance::small_allocations_are_packed,
    driver_conformance::mem_get_info_counts_pages,
    driver_conformance::free_of_null_is_a_no_op,
    driver_conformance::released_context_is_destroyed,
    driver_conformance::reset_destroys_context_until_retained,
    driver_conformance::host_memory_conformance,
    driver_conformance::ipc_and_peer_conformance,
];

/// The payload of the panic `test_exception` raises on purpose; the panic hook stays quiet
/// for it and only for it.
pub const EXPECTED_PANIC: &str = "emm suite: the panic test_exception raises on purpose";

/// Tests that only make sense on the real driver; without a GPU they are ignored like the CUDA
/// instances of the suite, and with `EMM_REQUIRE_GPU=1` they must run.
const CUDA_ONLY: &[(&str, SuiteFn)] =
    suite_tests![cuda_only::calls_leave_the_current_context_alone,];

/// Tests that need two devices: on the simulator a two-device machine; on the GPU they run
/// where two GPUs are visible, and are ignored (with the reason printed) on one.
const MULTI_DEVICE: &[(&str, SuiteFn)] = suite_tests![
    multi_device::contexts_on_every_device,
    multi_device::ipc_between_processes_on_different_devices,
    multi_device::wrong_context_conformance,
];

/// Tests of the deferred queue of device frees: Numba's deallocation tests count one
/// `cuMemFree` per allocation, queued until a threshold or a flush. A manager that returns
/// device memory to a pool of its own has no such frees; under it these tests are ignored and
/// the reason is printed. Every other test runs under every manager.
const DEFAULT_ONLY: &[&str] = &[
    "test_max_pending_count",
    "test_max_pending_bytes",
    "test_defer_cleanup",
    "test_nested_defer_cleanup",
    "test_exception",
    "oom_flushes_and_retries_once",
    "oom_inside_defer_cleanup_reports_clear_error",
];

/// Tests that export device memory to another process: ignored, with the reason printed,
/// under `async-pool`, whose pool is not created for export (it refuses `get_ipc_handle` with
/// a clear error; `pool_export_per_manager` checks it). `async-pool-ipc` runs them all.
const IPC_EXPORT: &[&str] = &[
    "test_ipc_handle",
    "test_ipc_handle_serialization",
    "test_ipc_array",
    "test_staged",
    "ipc_handle_errors",
    "ipc_between_processes_on_different_devices",
];

/// The GPU is one shared device: CUDA tests run one at a time (some fill its memory).
static GPU: Mutex<()> = Mutex::new(());

fn main() {
    // On the GPU, IPC tests re-run this binary as the other process.
    integration::run_ipc_child_if_requested();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("EMM_LOG"))
        .with_test_writer()
        .try_init();
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if info.payload().downcast_ref::<&str>() != Some(&EXPECTED_PANIC) {
            default_hook(info);
        }
    }));
    let args = Arguments::from_args();
    let targets = match requested_targets() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let required = gpu_required() || targets == [Target::Cuda];
    let setup = match integration::suite_setup() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let default_only_ignored = !integration::defers_device_frees();
    let ipc_ignored = !integration::exports_ipc_handles();
    if !args.list {
        eprintln!(
            "note: the suite runs under the memory manager {}",
            setup.describe()
        );
        if default_only_ignored {
            eprintln!(
                "note: {} tests per target are not applicable: they count the default manager's deferred cuMemFree calls, which '{}' does not make ({})",
                DEFAULT_ONLY.len(),
                setup.manager,
                DEFAULT_ONLY.join(", ")
            );
        }
        if ipc_ignored {
            eprintln!(
                "note: {} tests per target are not applicable: '{}' does not export memory to other processes (its pool is not created for export; 'async-pool-ipc' does that) ({})",
                IPC_EXPORT.len(),
                setup.manager,
                IPC_EXPORT.join(", ")
            );
        }
    }
    let mut trials = Vec::new();
    let mut manager_ignored: Vec<(Target, usize)> = Vec::new();
    for &target in &targets {
        manager_ignored.push((target, 0));
        let count = &mut manager_ignored.last_mut().expect("pushed").1;
        let cuda_missing = match target {
            Target::Sim => None,
            Target::Cuda => cuda_availability().err(),
        };
        if let Some(why) = &cuda_missing {
            if required {
                let why = why.clone();
                trials.push(Trial::test("cuda::gpu_available", move || {
                    Err(format!("a GPU is required (EMM_REQUIRE_GPU=1 or EMM_TEST_TARGET=cuda) but none is usable: {why}").into())
                }));
            } else if !args.list {
                eprintln!(
                    "note: the {} CUDA tests are skipped: {why}. Set EMM_REQUIRE_GPU=1 to fail instead.",
                    TESTS.len() + CUDA_ONLY.len()
                );
            }
        }
        let only_here: &[(&str, SuiteFn)] = if target == Target::Cuda {
            CUDA_ONLY
        } else {
            &[]
        };
        // Fewer than two GPUs: the multi-device tests cannot run (an error if EMM_REQUIRE_GPUS
        // asks for two).
        let few_gpus = match target {
            Target::Sim => None,
            Target::Cuda if cuda_missing.is_some() => None,
            Target::Cuda => match integration::cuda_device_count() {
                Ok(n) if n >= 2 => None,
                Ok(n) => Some(format!("{n} GPU(s) visible, the multi-device tests need 2")),
                Err(e) => Some(e),
            },
        };
        if let Some(why) = &few_gpus {
            if integration::gpus_required() >= 2 {
                let why = why.clone();
                trials.push(Trial::test("cuda::two_gpus_available", move || {
                    Err(format!("EMM_REQUIRE_GPUS=2 but {why}").into())
                }));
            } else if !args.list {
                eprintln!(
                    "note: the {} multi-device CUDA tests are skipped: {why}. Set EMM_REQUIRE_GPUS=2 to fail instead.",
                    MULTI_DEVICE.len()
                );
            }
        }
        for &(name, test) in MULTI_DEVICE {
            let trial = Trial::test(format!("{target}::{name}"), move || {
                let _gpu =
                    (target == Target::Cuda).then(|| GPU.lock().unwrap_or_else(|p| p.into_inner()));
                test(target)
            });
            let not_this_manager = ipc_ignored && IPC_EXPORT.contains(&name);
            if not_this_manager && cuda_missing.is_none() && few_gpus.is_none() {
                *count += 1;
            }
            trials.push(trial.with_ignored_flag(
                cuda_missing.is_some() || few_gpus.is_some() || not_this_manager,
            ));
        }
        for &(name, test) in TESTS.iter().chain(only_here) {
            let trial = Trial::test(format!("{target}::{name}"), move || {
                let _gpu =
                    (target == Target::Cuda).then(|| GPU.lock().unwrap_or_else(|p| p.into_inner()));
                test(target)
            });
            let not_this_manager = (default_only_ignored && DEFAULT_ONLY.contains(&name))
                || (ipc_ignored && IPC_EXPORT.contains(&name));
            if not_this_manager && cuda_missing.is_none() {
                *count += 1;
            }
            trials.push(trial.with_ignored_flag(cuda_missing.is_some() || not_this_manager));
        }
    }
    for (target, n) in manager_ignored {
        if n > 0 && !args.list {
            // The GPU job reads this line: these are the only ignored tests it allows besides
            // the announced multi-device skips.
            eprintln!(
                "note: {n} {target} tests are ignored under the memory manager {} (the reasons are above)",
                setup.describe()
            );
        }
    }
    libtest_mimic::run(&args, trials).exit();
}
