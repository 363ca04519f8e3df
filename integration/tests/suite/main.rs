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
mod graphs;
mod host_alloc;
mod ipc;
mod multi_device;
mod reset;
mod streams;
mod stress;

/// A suite test: runs against one target.
pub type SuiteFn = fn(Target) -> Result<(), Failed>;

/// What a test needs of the memory manager under test, beyond its target. A test whose need
/// the manager does not meet is reported as ignored, with the reason printed once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Need {
    /// It counts the default manager's deferred `cuMemFree` calls (Numba's deallocation tests
    /// count one per allocation, queued until a threshold or a flush). A manager that returns
    /// device memory to a pool of its own makes no such frees.
    DeferredDeviceFrees,
    /// It exports device memory to another process; `async-pool`'s pool is not created for
    /// export (it refuses `get_ipc_handle` with a clear error, which `pool_export_per_manager`
    /// checks), `async-pool-ipc` runs them all.
    IpcExport,
    /// It checks that `cuMemGetInfo` counts the manager's allocations at once; managed memory
    /// (`async-pool-managed`) is placed on first touch.
    DeviceMemory,
    /// Not a need but a licence: the test makes the driver refuse release calls on purpose
    /// (double frees, unknown pointers, frees in a destroyed context), which otherwise fail a
    /// test, on the GPU as on the simulator. Every manager meets it.
    ProvokesFailedReleases,
}

/// One registered suite test: its name (the function's), the function, what it needs.
struct SuiteTest {
    name: &'static str,
    run: SuiteFn,
    needs: &'static [Need],
}

/// Registers suite tests: `module::name`, followed by `[Need, ..]` where the test needs
/// something of the manager. The name is the function's, so a rename cannot detach a need.
macro_rules! suite_tests {
    ($($module:ident::$name:ident $([$($need:ident),* $(,)?])?),* $(,)?) => {
        &[$(SuiteTest {
            name: stringify!($name),
            run: $module::$name as SuiteFn,
            needs: &[$($(Need::$need),*)?],
        }),*]
    };
}

/// Every suite test. Tests that mirror a Numba test carry its name.
const TESTS: &[SuiteTest] = suite_tests![
    basics::alloc_write_read_free,
    basics::test_memcpy,
    basics::mem_get_info_reflects_allocations[DeviceMemory],
    basics::test_derived_pointer,
    basics::copies_are_bounds_checked,
    basics::initialize_runs_on_every_use,
    basics::test_context_memory,
    basics::async_pool_out_of_memory_waits_for_its_frees,
    deallocations::test_max_pending_count[DeferredDeviceFrees],
    deallocations::test_max_pending_bytes[DeferredDeviceFrees],
    deallocations::test_defer_cleanup[DeferredDeviceFrees],
    deallocations::test_nested_defer_cleanup[DeferredDeviceFrees],
    deallocations::test_exception[DeferredDeviceFrees],
    deallocations::oom_flushes_and_retries_once[DeferredDeviceFrees],
    deallocations::oom_inside_defer_cleanup_reports_clear_error[DeferredDeviceFrees],
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
    host_alloc::test_managed_memory,
    host_alloc::managed_frees_are_deferred[DeferredDeviceFrees],
    context_stack::test_attached_primary,
    context_stack::test_select_device,
    context_stack::modules_unload_on_drop_and_reset,
    ipc::test_ipc_handle[IpcExport],
    ipc::test_ipc_handle_serialization[IpcExport],
    ipc::test_ipc_array[IpcExport],
    ipc::test_staged[IpcExport],
    ipc::test_ipc_array_staged[IpcExport],
    ipc::test_ipc_overlapping_views[IpcExport],
    ipc::ipc_handle_errors[IpcExport],
    ipc::pool_export_per_manager,
    ipc::mapped_export_per_manager,
    stress::stress_mixed_operations,
    driver_conformance::alignment_of_allocations,
    driver_conformance::pool_export_conformance,
    driver_conformance::context_destruction_reclaims_all_its_memory[ProvokesFailedReleases],
    driver_conformance::stream_ordered_pool_conformance,
    driver_conformance::free_async_of_device_memory,
    driver_conformance::virtual_memory_conformance[ProvokesFailedReleases],
    driver_conformance::shareable_physical_memory_conformance,
    driver_conformance::pool_limits_and_host_pools_conformance,
    driver_conformance::pool_cache_under_pressure,
    driver_conformance::stream_and_event_conformance,
    driver_conformance::stream_capture_conformance[ProvokesFailedReleases],
    streams::stream_kinds,
    graphs::capture_and_replay_through_a_graph_pool,
    graphs::allocation_on_a_captured_stream_outside_a_graph_pool,
    graphs::captures_begun_elsewhere_get_graph_pools[ProvokesFailedReleases],
    streams::events_host_functions_and_auto_synchronize,
    streams::streams_refuse_work_after_a_reset,
    streams::async_copies_in_stream_order,
    streams::cross_stream_reuse,
    streams::cross_stream_check_catches_early_reuse,
    streams::device_memory_resource_conformance,
    streams::pinned_memory_resource_conformance,
    streams::managed_memory_resource_conformance,
    streams::memhostalloc_from_the_host_memory_pool,
    streams::memory_resources_between_processes,
    driver_conformance::managed_memory_conformance[ProvokesFailedReleases],
    driver_conformance::device_attributes_conformance,
    driver_conformance::ipc_mapping_conformance[ProvokesFailedReleases],
    driver_conformance::imported_pool_conformance[ProvokesFailedReleases],
    driver_conformance::zero_byte_alloc_is_invalid_value,
    driver_conformance::oversized_alloc_is_out_of_memory,
    driver_conformance::double_free_is_invalid_value[ProvokesFailedReleases],
    driver_conformance::interior_pointer_free_is_invalid_value[ProvokesFailedReleases],
    driver_conformance::address_range_of_interior_pointer,
    driver_conformance::out_of_range_copy_is_invalid_value,
    driver_conformance::mem_get_info_accounts_large_allocations,
    driver_conformance::small_allocations_are_packed,
    driver_conformance::mem_get_info_counts_pages,
    driver_conformance::free_of_null_is_a_no_op,
    driver_conformance::released_context_is_destroyed[ProvokesFailedReleases],
    driver_conformance::reset_destroys_context_until_retained[ProvokesFailedReleases],
    driver_conformance::host_memory_conformance[ProvokesFailedReleases],
    driver_conformance::ipc_and_peer_conformance[ProvokesFailedReleases],
];

/// The payload of the panic `test_exception` raises on purpose; the panic hook stays quiet
/// for it and only for it.
pub const EXPECTED_PANIC: &str = "emm suite: the panic test_exception raises on purpose";

/// Tests that only make sense on the real driver; without a GPU they are ignored like the CUDA
/// instances of the suite, and with `EMM_REQUIRE_GPU=1` they must run.
const CUDA_ONLY: &[SuiteTest] = suite_tests![cuda_only::calls_leave_the_current_context_alone,];

/// Tests that need two devices: on the simulator a two-device machine; on the GPU they run
/// where two GPUs are visible, and are ignored (with the reason printed) on one.
const MULTI_DEVICE: &[SuiteTest] = suite_tests![
    multi_device::contexts_on_every_device,
    multi_device::ipc_between_processes_on_different_devices[IpcExport],
    multi_device::wrong_context_conformance,
    multi_device::arrays_across_devices,
];

/// The GPU is one shared device: CUDA tests run one at a time (some fill its memory).
static GPU: Mutex<()> = Mutex::new(());

/// Release calls the driver refused so far: on the GPU in this process (the CUDA tests run one
/// at a time), on the simulator on this thread (each test runs on one).
fn failed_releases(target: Target) -> u64 {
    match target {
        Target::Cuda => emm::driver_sys::CudaDriver::failed_releases(),
        Target::Sim => driver_mock::failed_releases_on_this_thread(),
    }
}

/// The trial of test `t` on `target`; CUDA trials take the GPU for themselves. A release call
/// the driver refuses during the test fails it, unless the test provokes them on purpose.
fn trial(target: Target, t: &SuiteTest) -> Trial {
    let run = t.run;
    let name = t.name;
    let provokes = t.needs.contains(&Need::ProvokesFailedReleases);
    Trial::test(format!("{target}::{name}"), move || {
        let _gpu = (target == Target::Cuda).then(|| GPU.lock().unwrap_or_else(|p| p.into_inner()));
        let before = failed_releases(target);
        let early_before = driver_mock::frees_while_imported_on_this_thread();
        run(target)?;
        let refused = failed_releases(target) - before;
        let early = driver_mock::frees_while_imported_on_this_thread() - early_before;
        if early > 0 {
            return Err(format!(
                "{name} freed {early} allocation(s) while another process still had them mapped \
                 (on the simulator); the driver documents that as undefined behaviour in the \
                 importer: close the mapping there (or free the imported pointer) first"
            )
            .into());
        }
        if refused > 0 && !provokes {
            return Err(format!(
                "the driver refused {refused} release call(s) during {name} (a double free, or a \
                 free of memory that is not this process's); a test that does so on purpose \
                 says [ProvokesFailedReleases] where it is registered"
            )
            .into());
        }
        Ok(())
    })
}

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
    // Every variable the suite reads is checked before anything runs: a malformed one is an
    // error that names it, never a silent default.
    let (gpu_required, gpus_required) = match (
        gpu_required(),
        integration::gpus_required(),
        integration::stress_ops(),
    ) {
        (Ok(one), Ok(two), Ok(_)) => (one, two),
        (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let required = gpu_required || targets == [Target::Cuda];
    let setup = match integration::suite_setup() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let unmet = |need: Need| match need {
        Need::DeferredDeviceFrees => !integration::defers_device_frees(),
        Need::IpcExport => !integration::exports_ipc_handles(),
        Need::DeviceMemory => !integration::allocates_device_memory(),
        Need::ProvokesFailedReleases => false,
    };
    let not_this_manager = |t: &SuiteTest| t.needs.iter().any(|&n| unmet(n));
    if !args.list {
        eprintln!(
            "note: the suite runs under the memory manager {}",
            setup.describe()
        );
        for (need, why) in [
            (
                Need::DeferredDeviceFrees,
                "they count the default manager's deferred cuMemFree calls, which it does not make",
            ),
            (
                Need::IpcExport,
                "it does not export memory by IPC handle (a stream-ordered pool not created for export, or mapped physical memory, which vmm-pool exports as file descriptors instead: mapped_export_per_manager); 'pool' and 'async-pool-ipc' do that",
            ),
            (
                Need::DeviceMemory,
                "its memory is managed memory, which the driver places on first touch, so cuMemGetInfo need not count it at once",
            ),
        ] {
            if !unmet(need) {
                continue;
            }
            let names: Vec<&str> = TESTS
                .iter()
                .chain(MULTI_DEVICE)
                .filter(|t| t.needs.contains(&need))
                .map(|t| t.name)
                .collect();
            eprintln!(
                "note: {} tests per target are not applicable under '{}': {why} ({})",
                names.len(),
                setup.manager,
                names.join(", ")
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
        let only_here: &[SuiteTest] = if target == Target::Cuda {
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
            if gpus_required >= 2 {
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
        for t in MULTI_DEVICE {
            let skipped = not_this_manager(t);
            if skipped && cuda_missing.is_none() && few_gpus.is_none() {
                *count += 1;
            }
            trials.push(
                trial(target, t)
                    .with_ignored_flag(cuda_missing.is_some() || few_gpus.is_some() || skipped),
            );
        }
        for t in TESTS.iter().chain(only_here) {
            let skipped = not_this_manager(t);
            if skipped && cuda_missing.is_none() {
                *count += 1;
            }
            trials.push(trial(target, t).with_ignored_flag(cuda_missing.is_some() || skipped));
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
