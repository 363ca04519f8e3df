//! The device ledger: every emm process writes its figures for each device it uses into a file
//! of its own (`<pid>.json`) in a directory per device, named by the device's PCI identity, so
//! that `emm.device_report()` in any process lists the emm processes that share a device and
//! what each holds. A thread of the process runtime rewrites the file every
//! `EMM_LEDGER_SECONDS` (default 2; `EMM_LEDGER=0` turns the ledger off); the directory is
//! `EMM_LEDGER_DIR`, else `emm-ledger` in `/dev/shm` (or the temporary directory where there is
//! none), open to every user (sticky, as `/tmp` is) so that processes of several users share it.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use emm::contract::DeviceIdentity;
use emm::{Context, Runtime};
use pyo3::prelude::*;

use crate::runtime::runtime;

/// The ledger's directory.
fn directory() -> PathBuf {
    if let Some(dir) = std::env::var_os("EMM_LEDGER_DIR") {
        return PathBuf::from(dir);
    }
    let shm = Path::new("/dev/shm");
    let base = if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    base.join("emm-ledger")
}

/// The directory of the device `id`, made (open to every user, sticky) if it is not there.
fn device_directory(id: DeviceIdentity) -> std::io::Result<PathBuf> {
    let root = directory();
    let dir = root.join(format!(
        "{:04x}-{:02x}-{:02x}",
        id.pci_domain_id, id.pci_bus_id, id.pci_device_id
    ));
    if !dir.is_dir() {
        std::fs::create_dir_all(&dir)?;
        #[cfg(unix)]
        for d in [&root, &dir] {
            use std::os::unix::fs::PermissionsExt;
            // Best effort: a directory another user made keeps that user's mode.
            let _ = std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o1777));
        }
    }
    Ok(dir)
}

/// This process's record for `ctx`, as a line of JSON.
fn record(ctx: &Context) -> String {
    let usage = ctx.usage();
    let pool = ctx.pool_stats().device;
    let events = ctx.allocation_events();
    let number = |v: Option<usize>| v.map_or("null".to_owned(), |v| v.to_string());
    let name = std::env::args()
        .next()
        .unwrap_or_default()
        .replace(['"', '\\'], "_");
    let updated = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let mut out = String::new();
    let _ = write!(
        out,
        "{{\"pid\": {}, \"program\": \"{}\", \"device\": {}, \"manager\": \"{}\", \
         \"live_bytes\": {}, \"peak_live_bytes\": {}, \"held_bytes\": {}, \
         \"peak_held_bytes\": {}, \"ooms\": {}, \"updated\": {:.3}}}",
        std::process::id(),
        name,
        ctx.device().0,
        ctx.memory_manager_name().replace(['"', '\\'], "_"),
        number(usage.map(|u| u.device.current_bytes)),
        number(usage.map(|u| u.device.peak_bytes)),
        number(pool.map(|p| p.held_bytes)),
        number(pool.map(|p| p.peak_held_bytes)),
        events.ooms(),
        updated,
    );
    out
}

/// Writes this process's record for every context of `runtime` (a file replaced whole, so
/// that a reader never sees half of one); returns the directory of `device`'s, where that
/// device has a context.
fn publish(runtime: &Runtime, device: Option<u32>) -> std::io::Result<Option<PathBuf>> {
    let mut wanted = None;
    for ctx in runtime.contexts() {
        let Ok(id) = ctx.device_identity() else {
            continue;
        };
        let dir = device_directory(id)?;
        let pid = std::process::id();
        let partial = dir.join(format!(".{pid}.json.partial"));
        std::fs::write(&partial, record(&ctx))?;
        std::fs::rename(&partial, dir.join(format!("{pid}.json")))?;
        if Some(ctx.device().0) == device {
            wanted = Some(dir);
        }
    }
    Ok(wanted)
}

/// Starts the thread that keeps this process's records current, unless `EMM_LEDGER=0`. It
/// holds the runtime weakly and ends with it.
pub(crate) fn start(runtime: &Arc<Runtime>) {
    if std::env::var("EMM_LEDGER").is_ok_and(|v| v == "0") {
        return;
    }
    let seconds = std::env::var("EMM_LEDGER_SECONDS")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .unwrap_or(2.0);
    let weak: Weak<Runtime> = Arc::downgrade(runtime);
    let spawned = std::thread::Builder::new()
        .name("emm-ledger".into())
        .spawn(move || {
            while let Some(rt) = weak.upgrade() {
                if let Err(e) = publish(&rt, None) {
                    tracing::warn!(error = %e, dir = %directory().display(), "the device ledger could not be written; emm.device_report() will not list this process");
                }
                drop(rt);
                std::thread::sleep(Duration::from_secs_f64(seconds));
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "the device ledger's thread could not start");
    }
}

/// Removes this process's records from every device's ledger directory (at the interpreter's
/// exit: a process that has ended is no longer listed, even before a report finds it gone).
#[pyfunction]
pub(crate) fn ledger_forget() {
    let Ok(devices) = std::fs::read_dir(directory()) else {
        return;
    };
    let name = format!("{}.json", std::process::id());
    for device in devices.flatten() {
        let _ = std::fs::remove_file(device.path().join(&name));
    }
}

/// Writes this process's records now and returns the directory of `device`'s ledger, for
/// `emm.device_report()` to read (`emm.device_report` makes the context first).
#[pyfunction]
pub(crate) fn ledger_publish(py: Python<'_>, device: u32) -> PyResult<String> {
    let rt = runtime()?;
    let dir = py.detach(|| publish(&rt, Some(device))).map_err(|e| {
        pyo3::exceptions::PyOSError::new_err(format!(
            "writing the device ledger under {}: {e}; set EMM_LEDGER_DIR to a directory this \
                 process may write",
            directory().display()
        ))
    })?;
    dir.map(|d| d.display().to_string()).ok_or_else(|| {
        crate::exceptions::EmmError::new_err(format!(
            "device {device} has no context in this process: use it (emm.context({device})) first"
        ))
    })
}
