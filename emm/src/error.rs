//! [`EmmError`]: every error emm reports. Each message says what happened and what to do.

use std::fmt;

use driver_sys::{DeviceOrdinal, DriverError, ErrorKind};

/// An error from emm.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum EmmError {
    /// A driver call failed. The message includes the driver's (its call, raw code and
    /// advice), so the driver's error is not also returned as `source()`: a reporter that
    /// prints the chain prints it once.
    #[error("{op} on device {device}: {error}")]
    Driver {
        /// What emm was doing.
        op: &'static str,
        /// The device concerned.
        device: DeviceOrdinal,
        /// The driver's error.
        error: DriverError,
    },

    /// An allocation failed for lack of memory, after the one retry Numba makes (and those an
    /// out-of-memory callback asked for). `Display` prints the report's lines after the first.
    #[error(
        "out of memory on device {device}: could not allocate {requested} bytes \
         ({free} of {total} bytes free after flushing {flushed} pending deallocation(s)); \
         drop buffers you no longer need, or request less{}",
        ReportLines(.report)
    )]
    OutOfMemory {
        /// The device.
        device: DeviceOrdinal,
        /// Bytes requested.
        requested: usize,
        /// Free bytes the driver reported after the retry failed (0 if it could not say).
        free: usize,
        /// Total bytes of the device (0 if the driver could not say).
        total: usize,
        /// Pending deallocations flushed before the retry (0 inside `defer_cleanup`).
        flushed: usize,
        /// What the manager held, used and cached when the allocation failed, filled in by the
        /// context that refused it (`None` from a manager used without a context).
        report: Option<Box<OutOfMemoryReport>>,
        /// The driver's error from the retry.
        #[source]
        source: DriverError,
    },

    /// Page-locked host memory ran out, after the one retry Numba makes for mapped memory.
    #[error(
        "out of page-locked host memory (device {device}'s context): could not pin {requested} \
         bytes after flushing {flushed} pending deallocation(s); drop pinned buffers you no \
         longer need, pin less, or use pageable memory"
    )]
    OutOfHostMemory {
        /// The device whose context allocated.
        device: DeviceOrdinal,
        /// Bytes requested.
        requested: usize,
        /// Pending deallocations flushed before the retry.
        flushed: usize,
        /// The driver's error from the last try.
        #[source]
        source: DriverError,
    },

    /// `mempin(mapped = true)` on a device that cannot map host memory (Numba's text).
    #[error(
        "device {device} cannot map host memory; pin without mapping (mapped = false) and copy \
         explicitly"
    )]
    CannotMapHostMemory {
        /// The device.
        device: DeviceOrdinal,
    },

    /// An IPC handle used against its rules (Numba's texts: "IpcHandle is already opened",
    /// "IpcHandle not opened", "opening IpcHandle from original process").
    #[error("{message}; {advice}")]
    Ipc {
        /// Numba's message.
        message: &'static str,
        /// What to do.
        advice: &'static str,
    },

    /// Bytes that do not decode as an emm IPC handle.
    #[error(
        "invalid IPC handle bytes: {reason}; pass the exact bytes IpcHandle::to_bytes produced in the exporting process"
    )]
    InvalidIpcHandle {
        /// What is wrong with them.
        reason: String,
    },

    /// An IPC handle names an allocation of a stream-ordered pool that this process has not
    /// imported (or whose import a device reset ended).
    #[error(
        "the IPC handle names an allocation of stream-ordered pool {pool}, which this process has not imported{detail}; \
         receive the pool's PoolExport from the exporting process (Context::export_pool, then PoolExport::send) \
         and pass it to Runtime::import_pool before opening the handle"
    )]
    PoolNotImported {
        /// The pool's id, printed.
        pool: String,
        /// Why, where more is known (a reset since the import).
        detail: &'static str,
    },

    /// Sending or receiving a [`PoolExport`](crate::contract::PoolExport) over a socket failed.
    /// (The operating system's error is in the message, and not also `source()`.)
    #[error(
        "{what}: {error}; both ends must use PoolExport::send and PoolExport::receive on a \
         connected Unix stream socket, one export per message"
    )]
    PoolTransfer {
        /// What emm was doing.
        what: &'static str,
        /// The operating system's error (or a description of the malformed message).
        error: std::io::Error,
    },

    /// No visible device has the identity an IPC handle names (Numba's text).
    #[error(
        "No device of {identity} is found. Target device may not be visible in this process \
         (check CUDA_VISIBLE_DEVICES)"
    )]
    NoDeviceWithIdentity {
        /// The identity, printed.
        identity: String,
    },

    /// A request for zero bytes.
    #[error("{what} of 0 bytes: there is nothing to allocate or pin; request at least one byte")]
    ZeroSize {
        /// The operation.
        what: &'static str,
    },

    /// The device or its driver cannot do what was asked (a capability it lacks).
    #[error("{what} is not supported on device {device}: {advice}")]
    DeviceCannot {
        /// What was asked.
        what: &'static str,
        /// The device.
        device: DeviceOrdinal,
        /// Why, and what to use instead.
        advice: String,
    },

    /// A stream operation on memory that was not allocated on a stream.
    #[error(
        "{what} needs memory allocated on a stream (memalloc_on / Context::memalloc_on); this \
         memory came from memalloc, whose free is not stream ordered: synchronise the streams \
         that use it before dropping it, or allocate it on a stream"
    )]
    NotStreamOrdered {
        /// The operation.
        what: &'static str,
    },

    /// The memory manager does not offer this operation.
    #[error("{operation} is not supported by the memory manager '{manager}'; {advice}")]
    NotSupported {
        /// The operation, such as `memhostalloc`.
        operation: &'static str,
        /// The manager's name.
        manager: String,
        /// What the caller can do instead.
        advice: &'static str,
    },

    /// A manager that maps physical memory into reserved addresses (`vmm-pool`) on a device or
    /// driver without virtual memory management.
    #[error(
        "the memory manager '{manager}' needs the driver's virtual memory management, which \
         device {device} does not offer ({reason}); select 'pool', 'async-pool' or 'default' \
         (EMM_MEMORY_MANAGER), which need none"
    )]
    NoVirtualMemory {
        /// The manager's name.
        manager: String,
        /// The device.
        device: DeviceOrdinal,
        /// What the driver said.
        reason: String,
    },

    /// The memory manager was chosen after a context already existed.
    #[error(
        "the memory manager is already fixed: device {device} has a context using '{current}'; \
         choose the manager before the first context is created (Runtime::builder), or reset \
         every device first"
    )]
    ManagerAlreadyFixed {
        /// A device whose context exists.
        device: DeviceOrdinal,
        /// The manager in use.
        current: String,
    },

    /// A plugin implements another version of the interface (Numba's text).
    #[error("EMM Plugin interface has version {found} - version {required} required")]
    InterfaceVersion {
        /// The version the plugin reports.
        found: u32,
        /// The version emm implements.
        required: u32,
    },

    /// `EMM_MEMORY_MANAGER` or a requested name matches no registered manager.
    #[error(
        "no memory manager named '{name}' is registered; registered managers: {}; set \
         EMM_MEMORY_MANAGER to one of them or register '{name}' with \
         RuntimeBuilder::register_manager",
        registered.join(", ")
    )]
    UnknownManager {
        /// The name asked for.
        name: String,
        /// The names that exist.
        registered: Vec<String>,
    },

    /// A value given in code (a pool's configuration, say) is refused.
    #[error("{what} is invalid: {reason}")]
    InvalidArgument {
        /// What was given.
        what: &'static str,
        /// Why it is refused, and what to give instead.
        reason: String,
    },

    /// An allocation would exceed the cap of a limit adaptor.
    #[error(
        "allocating {requested} bytes would bring the memory in use on device {device} to {would_be} bytes, over the limit of {limit} bytes; \
         free memory you no longer need, or raise the limit (EMM_MEMORY_ADAPTORS=limit=...)"
    )]
    OverLimit {
        /// The device.
        device: DeviceOrdinal,
        /// Bytes requested.
        requested: usize,
        /// Bytes in use had it been granted.
        would_be: usize,
        /// The cap.
        limit: usize,
    },

    /// A configuration value (environment variable) is malformed.
    #[error("{variable}={value:?} is invalid: {reason}")]
    Config {
        /// The variable.
        variable: &'static str,
        /// Its value.
        value: String,
        /// Why it is rejected and what is accepted.
        reason: String,
    },

    /// A device ordinal that does not exist.
    #[error(
        "device {device} does not exist: the driver reports {count} device(s); use an ordinal \
         below {count}"
    )]
    NoSuchDevice {
        /// The ordinal asked for.
        device: DeviceOrdinal,
        /// How many devices there are.
        count: u32,
    },

    /// A view or copy reaches outside the memory it refers to.
    #[error(
        "{what}: range {start}..{end} is outside the {size}-byte buffer; keep offsets and \
         lengths within the buffer"
    )]
    OutOfBounds {
        /// What was attempted.
        what: &'static str,
        /// Start of the requested range, in bytes from the buffer's start.
        start: usize,
        /// End of the requested range (exclusive).
        end: usize,
        /// The buffer's size.
        size: usize,
    },

    /// A device-to-device copy whose source and destination overlap.
    #[error(
        "device to device copy of {bytes} bytes: source and destination overlap; copy through a \
         separate buffer"
    )]
    OverlappingCopy {
        /// Bytes requested.
        bytes: usize,
    },

    /// The memory belongs to another context (or device) than the one asked to use it.
    #[error(
        "{what}: the buffer belongs to device {owner}, not device {device}; use the context of \
         the device that allocated it"
    )]
    WrongContext {
        /// What was attempted.
        what: &'static str,
        /// The device whose context was used.
        device: DeviceOrdinal,
        /// The device that owns the buffer.
        owner: DeviceOrdinal,
    },

    /// A stream and an event of different contexts were used together where the driver needs
    /// one context (an event is recorded, or timed, in its own context).
    #[error(
        "{what}: the stream or event of device {first} and the event of device {second} belong          to different contexts; record and time an event with streams and events of its own          device (waiting on another device's event is allowed: Stream::wait_event)"
    )]
    MismatchedContexts {
        /// What was attempted.
        what: &'static str,
        /// The device of the first object.
        first: DeviceOrdinal,
        /// The device of the second object.
        second: DeviceOrdinal,
    },

    /// The memory or context was released by a reset.
    #[error(
        "{what} on device {device}: {reason}; allocate again from a current context \
         (Runtime::context) after a reset"
    )]
    Stale {
        /// What was attempted.
        what: &'static str,
        /// The device.
        device: DeviceOrdinal,
        /// What was reset.
        reason: &'static str,
    },

    /// The context's memory is asleep ([`Context::sleep`](crate::Context::sleep)), or a wake
    /// found nothing asleep.
    #[error("{what} on device {device}: {reason}")]
    Sleep {
        /// What was attempted.
        what: &'static str,
        /// The device.
        device: DeviceOrdinal,
        /// The state found, and what to do.
        reason: &'static str,
    },
}

impl EmmError {
    /// The driver's error kind, where the error came from the driver.
    pub fn driver_kind(&self) -> Option<ErrorKind> {
        match self {
            EmmError::Driver { error: source, .. }
            | EmmError::OutOfMemory { source, .. }
            | EmmError::OutOfHostMemory { source, .. } => Some(source.kind()),
            _ => None,
        }
    }

    /// The report an out-of-memory error carries (`None` for other errors, and where no
    /// context filled one in).
    pub fn out_of_memory_report(&self) -> Option<&OutOfMemoryReport> {
        match self {
            EmmError::OutOfMemory { report, .. } => report.as_deref(),
            _ => None,
        }
    }

    /// Whether this is an out-of-memory error (after emm's retry).
    pub fn is_out_of_memory(&self) -> bool {
        matches!(
            self,
            EmmError::OutOfMemory { .. }
                | EmmError::OutOfHostMemory { .. }
                | EmmError::OverLimit { .. }
        ) || self.driver_kind() == Some(ErrorKind::OutOfMemory)
    }

    /// A driver call of `op` on `device` failed with `source`. A plugin turns its driver
    /// errors into `EmmError`s with this (or [`ManagerContext::driver_error`](crate::contract::ManagerContext::driver_error)),
    /// so `?` works inside its methods.
    pub fn driver(op: &'static str, device: DeviceOrdinal, source: DriverError) -> Self {
        EmmError::Driver {
            op,
            device,
            error: source,
        }
    }

    /// `sleep` or `wake` asked of a manager that cannot keep its addresses while its memory
    /// goes back to the driver.
    pub(crate) fn no_sleep(operation: &'static str, manager: impl Into<String>) -> Self {
        EmmError::NotSupported {
            operation,
            manager: manager.into(),
            advice: "only 'vmm-pool' keeps every address while the physical memory behind it \
                     goes back to the driver; select it (EMM_MEMORY_MANAGER=vmm-pool), or free \
                     the memory and call trim",
        }
    }

    /// `memalloc_shared` asked of a manager that cannot make memory to share as file
    /// descriptors.
    pub(crate) fn no_shared_allocation(manager: impl Into<String>) -> Self {
        EmmError::NotSupported {
            operation: "memalloc_shared",
            manager: manager.into(),
            advice: "only 'vmm-pool' allocates memory to share as file descriptors \
                     (Context::export_mapped); share this manager's memory with get_ipc_handle",
        }
    }

    /// `export_mapped` asked of a manager whose memory is not mapped physical memory.
    pub(crate) fn no_mapped_export(manager: impl Into<String>) -> Self {
        EmmError::NotSupported {
            operation: "export_mapped",
            manager: manager.into(),
            advice: "only memory mapped into reserved addresses ('vmm-pool') is exported as \
                     file descriptors; share this manager's memory with get_ipc_handle",
        }
    }

    /// `export_pool` asked of a manager without a pool created for export.
    pub(crate) fn no_pool_export(manager: impl Into<String>) -> Self {
        EmmError::NotSupported {
            operation: "export_pool",
            manager: manager.into(),
            advice: "only a manager over a stream-ordered pool created for export can export \
                     it; select 'async-pool-ipc' (EMM_MEMORY_MANAGER=async-pool-ipc)",
        }
    }
}

impl EmmError {
    /// `memalloc_on` under a manager that does not allocate on streams.
    /// `memalloc_on` of a stream being captured, by a manager whose allocation would make
    /// calls the capture forbids.
    pub(crate) fn captured_stream(manager: &str) -> EmmError {
        EmmError::NotSupported {
            operation: "memalloc_on of a stream being captured",
            manager: manager.into(),
            advice: "this manager would allocate with driver calls a capture forbids, which \
                     would invalidate it; allocate during the capture from a graph pool \
                     (Context::begin_graph_pool on the stream before the capture, \
                     end_graph_pool after, or Context::capture), or select the 'async-pool' \
                     manager, whose allocations on a captured stream become the graph's",
        }
    }

    pub(crate) fn no_stream_ordering(manager: &str) -> EmmError {
        EmmError::NotSupported {
            operation: "memalloc_on",
            manager: manager.into(),
            advice: "this manager does not allocate on streams; use memalloc and synchronise \
                     before dropping the memory, or select a manager that does ('default', \
                     'pool', 'async-pool', 'async-pool-ipc')",
        }
    }
}

/// What a context knew when an allocation on it ran out of memory: the manager's pool figures,
/// where it keeps a pool, and the out-of-memory callback's retries.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OutOfMemoryReport {
    /// The manager's registered name.
    pub manager: String,
    /// Bytes the manager held from the driver (`None`: it keeps no pool).
    pub held_bytes: Option<usize>,
    /// Bytes of the manager's blocks in use.
    pub in_use_bytes: Option<usize>,
    /// Bytes held and not in use: cached blocks and free space the request did not fit.
    pub unused_bytes: Option<usize>,
    /// The largest free block the manager held (`None` where it cannot tell).
    pub largest_free_bytes: Option<usize>,
    /// The share of the unused bytes outside the largest free block, 0 to 1: near 1, the
    /// free space is in pieces too small for large requests.
    pub fragmentation: Option<f64>,
    /// Free blocks the manager held (`None` where it cannot tell).
    pub free_blocks: Option<usize>,
    /// Free bytes in blocks too small for the request (`None` where the manager cannot
    /// tell).
    pub unusable_for_request: Option<usize>,
    /// Retries the context's out-of-memory callback asked for.
    pub callback_retries: u32,
    /// The allocation was made from inside the context's out-of-memory callback, on the
    /// thread that runs it: the callback was not called again for it.
    pub inside_callback: bool,
    /// Who holds the live memory: the tags with the most live bytes, largest first, at most
    /// five (empty without the `history` adaptor, which records tags).
    pub live_by_tag: Vec<LiveByTag>,
}

/// Live allocations of one tag, for an [`OutOfMemoryReport`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LiveByTag {
    /// The tag's name (`torch`, `cupy`, `numba`, an embedder's own, or `untagged`).
    pub tag: String,
    /// Bytes its live allocations asked for.
    pub bytes: usize,
    /// How many live allocations it has.
    pub allocations: usize,
    /// The largest of them, in bytes.
    pub largest: usize,
}

/// The lines an [`OutOfMemoryReport`] adds to an out-of-memory error's message.
struct ReportLines<'a>(&'a Option<Box<OutOfMemoryReport>>);

impl fmt::Display for ReportLines<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(r) = self.0 else {
            return Ok(());
        };
        let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
        match (r.held_bytes, r.in_use_bytes, r.unused_bytes) {
            (Some(held), Some(used), Some(unused)) => write!(
                f,
                "\n  manager `{}` holds {:.1} MiB: {:.1} MiB in use, {:.1} MiB unused",
                r.manager,
                mib(held),
                mib(used),
                mib(unused)
            )?,
            _ => write!(f, "\n  manager `{}` keeps no pool", r.manager)?,
        }
        if let Some(largest) = r.largest_free_bytes {
            write!(f, "\n  largest free block {:.1} MiB", mib(largest))?;
            if let Some(frag) = r.fragmentation {
                write!(f, ", fragmentation {frag:.2}")?;
            }
            if let Some(blocks) = r.free_blocks {
                write!(f, ", {blocks} free blocks")?;
            }
            if let Some(unusable) = r.unusable_for_request.filter(|&u| u > 0) {
                write!(
                    f,
                    "\n  {:.1} MiB of the free space is in blocks too small for this request",
                    mib(unusable)
                )?;
            }
            if r.unused_bytes.is_some_and(|u| u > 0) {
                f.write_str("\n  ctx.trim() gives unused memory back to the driver")?;
            }
        }
        for (i, t) in r.live_by_tag.iter().enumerate() {
            write!(
                f,
                "{}{} {:.1} MiB in {} allocation{} (largest {:.1} MiB)",
                if i == 0 {
                    "\n  live memory by tag: "
                } else {
                    "; "
                },
                t.tag,
                mib(t.bytes),
                t.allocations,
                if t.allocations == 1 { "" } else { "s" },
                mib(t.largest)
            )?;
        }
        if r.inside_callback {
            f.write_str(
                "\n  this allocation was made from inside the out-of-memory callback, which is \
                 not called again for it: free memory there without allocating, or allocate \
                 after the callback returns",
            )?;
        }
        if r.callback_retries > 0 {
            write!(
                f,
                "\n  the out-of-memory callback asked for {} retr{}; none found room",
                r.callback_retries,
                if r.callback_retries == 1 { "y" } else { "ies" }
            )?;
        }
        Ok(())
    }
}

#[cfg(all(test, not(emm_loom)))]
mod tests {
    use std::error::Error as _;

    use driver_sys::{DeviceOrdinal, DriverError};

    use super::EmmError;

    /// A reporter that prints the message and then each `source()` prints every cause once:
    /// where the message already holds the cause, it is not also the source.
    #[test]
    fn each_cause_is_printed_once() {
        let driver = DriverError::from_code("cuMemAlloc", 1);
        let e = EmmError::driver("memalloc", DeviceOrdinal(0), driver.clone());
        assert!(e.to_string().contains(&driver.to_string()), "{e}");
        assert!(
            e.source().is_none(),
            "the driver's error is in the message already"
        );

        let e = EmmError::PoolTransfer {
            what: "receiving a pool export",
            error: std::io::Error::other("connection reset"),
        };
        assert!(e.to_string().contains("connection reset"), "{e}");
        assert!(e.source().is_none());

        let e = EmmError::OutOfMemory {
            device: DeviceOrdinal(0),
            requested: 1 << 40,
            free: 0,
            total: 1 << 30,
            flushed: 0,
            report: None,
            source: DriverError::from_code("cuMemAlloc", 2),
        };
        assert!(!e.to_string().contains("CUDA_ERROR_OUT_OF_MEMORY"), "{e}");
        let source = e.source().expect("the driver's error, not in the message");
        assert!(source.to_string().contains("CUDA_ERROR_OUT_OF_MEMORY"));
    }
}
