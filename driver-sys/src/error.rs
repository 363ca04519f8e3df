//! [`DriverError`]: the raw `CUresult`, its classification, and a message that says what to do.
//!
//! Formatting never calls into libcuda (cudarc's own `DriverError` does, and panics on a
//! machine without a driver): names and descriptions of the codes come from the table below.

use std::fmt;

/// One row of the code table: a raw `CUresult`, its CUDA name, what it means, and its kind.
#[derive(Clone, Copy, Debug)]
struct CodeInfo {
    raw: u32,
    name: &'static str,
    kind: ErrorKind,
    text: &'static str,
}

/// The code table: every `CUresult` of the CUDA driver API that cudarc 0.19's bindings name
/// (CUDA 11.4 to 13.x), each written once. It makes the [`code`] constants, the kind of each
/// code ([`ErrorKind::from_code`]) and the name and description [`DriverError`] prints.
macro_rules! cuda_codes {
    ($($konst:ident = $raw:literal, $kind:ident, $text:literal;)*) => {
        /// Raw `CUresult` values, by their CUDA names (`OUT_OF_MEMORY` is
        /// `CUDA_ERROR_OUT_OF_MEMORY`). The numbers are the CUDA driver's.
        pub mod code {
            /// `CUDA_SUCCESS`.
            pub const SUCCESS: u32 = 0;
            $(
                #[doc = concat!("`CUDA_ERROR_", stringify!($konst), "`: ", $text, ".")]
                pub const $konst: u32 = $raw;
            )*
        }

        const CODES: &[CodeInfo] = &[
            CodeInfo { raw: 0, name: "CUDA_SUCCESS", kind: ErrorKind::Other, text: "no error" },
            $(CodeInfo {
                raw: $raw,
                name: concat!("CUDA_ERROR_", stringify!($konst)),
                kind: ErrorKind::$kind,
                text: $text,
            },)*
        ];
    };
}

cuda_codes! {
    INVALID_VALUE = 1, InvalidValue, "an argument is invalid";
    OUT_OF_MEMORY = 2, OutOfMemory, "out of memory";
    NOT_INITIALIZED = 3, NotInitialized, "the driver is not initialised";
    DEINITIALIZED = 4, NotInitialized, "the driver is shutting down";
    PROFILER_DISABLED = 5, Other, "the profiler is disabled for this run";
    PROFILER_NOT_INITIALIZED = 6, Other, "the profiler is not initialised";
    PROFILER_ALREADY_STARTED = 7, Other, "the profiler is already started";
    PROFILER_ALREADY_STOPPED = 8, Other, "the profiler is already stopped";
    STUB_LIBRARY = 34, DriverUnavailable, "the CUDA driver found is a stub library, not a real driver";
    INSUFFICIENT_DRIVER = 35, DriverUnavailable, "the CUDA driver is older than the CUDA version used";
    CALL_REQUIRES_NEWER_DRIVER = 36, DriverUnavailable, "the call needs a newer CUDA driver";
    DEVICE_UNAVAILABLE = 46, DeviceUnavailable, "the device is busy or unavailable";
    MULTICAST_RESOURCE_FULL = 47, Other, "no multicast resource is left";
    NO_DEVICE = 100, NoDevice, "no CUDA-capable device is detected";
    INVALID_DEVICE = 101, InvalidDevice, "the device ordinal is invalid";
    DEVICE_NOT_LICENSED = 102, DeviceUnavailable, "the device is not licensed for this use";
    INVALID_IMAGE = 200, InvalidValue, "the kernel image is invalid";
    INVALID_CONTEXT = 201, InvalidContext, "the context is invalid";
    CONTEXT_ALREADY_CURRENT = 202, Other, "the context is already current";
    MAP_FAILED = 205, MapFailed, "mapping failed";
    UNMAP_FAILED = 206, MapFailed, "unmapping failed";
    ARRAY_IS_MAPPED = 207, AlreadyMapped, "the array is mapped";
    ALREADY_MAPPED = 208, AlreadyMapped, "the resource is already mapped";
    NO_BINARY_FOR_GPU = 209, NotSupported, "the image has no code for this GPU";
    ALREADY_ACQUIRED = 210, Other, "the resource is already acquired";
    NOT_MAPPED = 211, MapFailed, "the resource is not mapped";
    NOT_MAPPED_AS_ARRAY = 212, MapFailed, "the resource is not mapped as an array";
    NOT_MAPPED_AS_POINTER = 213, MapFailed, "the resource is not mapped as a pointer";
    ECC_UNCORRECTABLE = 214, KernelFault, "an uncorrectable ECC error was detected";
    UNSUPPORTED_LIMIT = 215, NotSupported, "the limit is not supported by the device";
    CONTEXT_ALREADY_IN_USE = 216, Other, "the context is already in use by another thread";
    PEER_ACCESS_UNSUPPORTED = 217, PeerAccess, "peer access is not supported between these two devices";
    INVALID_PTX = 218, InvalidValue, "the PTX failed to compile";
    INVALID_GRAPHICS_CONTEXT = 219, InvalidContext, "the graphics context is invalid";
    NVLINK_UNCORRECTABLE = 220, KernelFault, "an uncorrectable NVLink error was detected";
    JIT_COMPILER_NOT_FOUND = 221, NotSupported, "the PTX JIT compiler library was not found";
    UNSUPPORTED_PTX_VERSION = 222, NotSupported, "the PTX was compiled for a newer toolchain than this driver";
    JIT_COMPILATION_DISABLED = 223, NotSupported, "PTX JIT compilation is disabled";
    UNSUPPORTED_EXEC_AFFINITY = 224, NotSupported, "the execution affinity is not supported";
    UNSUPPORTED_DEVSIDE_SYNC = 225, NotSupported, "device-side synchronisation is not supported here";
    CONTAINED = 226, KernelFault, "a fatal error was contained to this context";
    INSUFFICIENT_LOADER_VERSION = 227, DriverUnavailable, "the loader is older than the driver needs";
    INVALID_SOURCE = 300, InvalidValue, "the kernel source is invalid";
    FILE_NOT_FOUND = 301, NotFound, "the file was not found";
    SHARED_OBJECT_SYMBOL_NOT_FOUND = 302, NotFound, "a shared-object symbol was not found";
    SHARED_OBJECT_INIT_FAILED = 303, Other, "a shared object failed to initialise";
    OPERATING_SYSTEM = 304, Other, "an operating-system call failed";
    INVALID_HANDLE = 400, InvalidHandle, "the resource handle is invalid";
    ILLEGAL_STATE = 401, Other, "the resource is in a state that does not allow this";
    LOSSY_QUERY = 402, Other, "the query would lose information";
    NOT_FOUND = 500, NotFound, "the named symbol or object was not found";
    NOT_READY = 600, Other, "the work is not complete yet";
    ILLEGAL_ADDRESS = 700, KernelFault, "a kernel accessed an illegal memory address";
    LAUNCH_OUT_OF_RESOURCES = 701, Other, "the launch needs more resources than the device has";
    LAUNCH_TIMEOUT = 702, KernelFault, "a kernel ran past the watchdog's time limit";
    LAUNCH_INCOMPATIBLE_TEXTURING = 703, Other, "the launch uses incompatible texturing";
    PEER_ACCESS_ALREADY_ENABLED = 704, PeerAccess, "peer access is already enabled";
    PEER_ACCESS_NOT_ENABLED = 705, PeerAccess, "peer access has not been enabled";
    PRIMARY_CONTEXT_ACTIVE = 708, Other, "the primary context is already active";
    CONTEXT_IS_DESTROYED = 709, ContextDestroyed, "the context is destroyed";
    ASSERT = 710, KernelFault, "a device-side assertion failed";
    TOO_MANY_PEERS = 711, PeerAccess, "too many peers are enabled";
    HOST_MEMORY_ALREADY_REGISTERED = 712, HostMemoryAlreadyRegistered, "part or all of the host range is already registered";
    HOST_MEMORY_NOT_REGISTERED = 713, HostMemoryNotRegistered, "the pointer is not in a registered host range";
    HARDWARE_STACK_ERROR = 714, KernelFault, "a kernel's hardware stack failed (overflow or corruption)";
    ILLEGAL_INSTRUCTION = 715, KernelFault, "a kernel executed an illegal instruction";
    MISALIGNED_ADDRESS = 716, KernelFault, "a kernel accessed a misaligned address";
    INVALID_ADDRESS_SPACE = 717, KernelFault, "a kernel used an address in the wrong address space";
    INVALID_PC = 718, KernelFault, "a kernel jumped to an invalid program counter";
    LAUNCH_FAILED = 719, KernelFault, "a kernel failed while it ran";
    COOPERATIVE_LAUNCH_TOO_LARGE = 720, Other, "the cooperative launch has more blocks than can run at once";
    TENSOR_MEMORY_LEAK = 721, KernelFault, "a kernel exited with tensor memory still allocated";
    NOT_PERMITTED = 800, NotSupported, "the operation is not permitted";
    NOT_SUPPORTED = 801, NotSupported, "the operation is not supported";
    SYSTEM_NOT_READY = 802, DeviceUnavailable, "the system is not ready (a driver component is not running)";
    SYSTEM_DRIVER_MISMATCH = 803, DriverUnavailable, "the display driver and the CUDA driver versions differ";
    COMPAT_NOT_SUPPORTED_ON_DEVICE = 804, DriverUnavailable, "forward compatibility is not supported on this device";
    MPS_CONNECTION_FAILED = 805, DeviceUnavailable, "the MPS client could not connect to the server";
    MPS_RPC_FAILURE = 806, DeviceUnavailable, "a remote call to the MPS server failed";
    MPS_SERVER_NOT_READY = 807, DeviceUnavailable, "the MPS server is not ready";
    MPS_MAX_CLIENTS_REACHED = 808, DeviceUnavailable, "the MPS server has its most clients";
    MPS_MAX_CONNECTIONS_REACHED = 809, DeviceUnavailable, "the MPS server has its most connections";
    MPS_CLIENT_TERMINATED = 810, DeviceUnavailable, "the MPS server terminated this client";
    CDP_NOT_SUPPORTED = 811, NotSupported, "dynamic parallelism is not supported here";
    CDP_VERSION_MISMATCH = 812, NotSupported, "the dynamic-parallelism versions differ";
    STREAM_CAPTURE_UNSUPPORTED = 900, StreamCapture, "the operation is not allowed while the stream is captured";
    STREAM_CAPTURE_INVALIDATED = 901, StreamCapture, "the stream capture was invalidated by an earlier error";
    STREAM_CAPTURE_MERGE = 902, StreamCapture, "the operation would merge two separate captures";
    STREAM_CAPTURE_UNMATCHED = 903, StreamCapture, "the capture was not started in this stream";
    STREAM_CAPTURE_UNJOINED = 904, StreamCapture, "the capture forked a stream that was not joined back";
    STREAM_CAPTURE_ISOLATION = 905, StreamCapture, "the operation would cross a capture's isolation";
    STREAM_CAPTURE_IMPLICIT = 906, StreamCapture, "the operation would wait on the legacy stream during a capture";
    CAPTURED_EVENT = 907, StreamCapture, "the event was recorded during a capture and cannot be used like this";
    STREAM_CAPTURE_WRONG_THREAD = 908, StreamCapture, "the capture was ended from another thread";
    TIMEOUT = 909, Other, "the wait timed out";
    GRAPH_EXEC_UPDATE_FAILURE = 910, Other, "the graph update broke its rules";
    EXTERNAL_DEVICE = 911, KernelFault, "an external device's async error reached this context";
    INVALID_CLUSTER_SIZE = 912, InvalidValue, "the cluster size is invalid";
    FUNCTION_NOT_LOADED = 913, NotFound, "the function is not loaded";
    INVALID_RESOURCE_TYPE = 914, InvalidValue, "the resource type is invalid";
    INVALID_RESOURCE_CONFIGURATION = 915, InvalidValue, "the resource configuration is invalid";
    KEY_ROTATION = 916, Other, "a key rotation error occurred";
    STREAM_DETACHED = 917, InvalidHandle, "the stream is detached";
    GRAPH_RECAPTURE_FAILURE = 918, Other, "recapturing the graph failed";
    FABRIC_NOT_READY = 919, DeviceUnavailable, "the fabric is not ready";
    UNKNOWN = 999, Other, "an unknown internal error";
}

/// What kind of failure a [`DriverError`] is, independent of the raw code.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The device (or pinned host memory) is exhausted. emm retries these once after a flush.
    OutOfMemory,
    /// No usable CUDA driver: libcuda is missing, is a stub, or is too old.
    DriverUnavailable,
    /// The driver loaded but sees no CUDA device.
    NoDevice,
    /// A device ordinal that does not exist.
    InvalidDevice,
    /// The driver was not initialised, or was deinitialised.
    NotInitialized,
    /// An argument the driver rejected: a zero size, an unknown pointer, a double free.
    InvalidValue,
    /// The context is not valid (never created, released, or from another process).
    InvalidContext,
    /// The context was destroyed (for example by a primary-context reset).
    ContextDestroyed,
    /// A handle (stream, event, IPC handle) that is not valid.
    InvalidHandle,
    /// The operation is not supported by this device, driver or platform.
    NotSupported,
    /// Mapping failed (an IPC handle opened in the exporting process, for example).
    MapFailed,
    /// The resource is already mapped.
    AlreadyMapped,
    /// The host range is already page-locked.
    HostMemoryAlreadyRegistered,
    /// The host range was never page-locked.
    HostMemoryNotRegistered,
    /// Peer access between these devices is unsupported, not enabled, or already enabled.
    PeerAccess,
    /// A named symbol or object was not found.
    NotFound,
    /// A kernel faulted (an illegal address, a failed assertion, an uncorrectable hardware
    /// error): the error is sticky, and every later call in the process's context fails too.
    KernelFault,
    /// The device or a driver service cannot be used now (exclusive mode, MPS, a component
    /// not running).
    DeviceUnavailable,
    /// A stream capture refused the call, or was invalidated by an earlier refused call
    /// (`CUDA_ERROR_STREAM_CAPTURE_*`, `CUDA_ERROR_CAPTURED_EVENT`).
    StreamCapture,
    /// Any other driver error; the raw code says which.
    Other,
}

impl ErrorKind {
    /// Every kind, in declaration order: for tests and fault injection that go through them all.
    pub const ALL: [ErrorKind; 20] = [
        ErrorKind::OutOfMemory,
        ErrorKind::DriverUnavailable,
        ErrorKind::NoDevice,
        ErrorKind::InvalidDevice,
        ErrorKind::NotInitialized,
        ErrorKind::InvalidValue,
        ErrorKind::InvalidContext,
        ErrorKind::ContextDestroyed,
        ErrorKind::InvalidHandle,
        ErrorKind::NotSupported,
        ErrorKind::MapFailed,
        ErrorKind::AlreadyMapped,
        ErrorKind::HostMemoryAlreadyRegistered,
        ErrorKind::HostMemoryNotRegistered,
        ErrorKind::PeerAccess,
        ErrorKind::NotFound,
        ErrorKind::KernelFault,
        ErrorKind::DeviceUnavailable,
        ErrorKind::StreamCapture,
        ErrorKind::Other,
    ];
}

/// For each kind: the raw code that stands for it when a kind is scripted (fault injection),
/// and what a user can do about it. One row per kind.
const KINDS: &[(ErrorKind, u32, &str)] = &[
    (
        ErrorKind::OutOfMemory,
        code::OUT_OF_MEMORY,
        "free memory (drop buffers, flush pending deallocations) or request less",
    ),
    (
        ErrorKind::DriverUnavailable,
        code::STUB_LIBRARY,
        "install the NVIDIA driver (libcuda.so.1 must be on the loader path, e.g. \
         LD_LIBRARY_PATH; the driver must be at least as new as the CUDA version used), or run \
         without a GPU on a simulated driver (driver_mock::SimDriver)",
    ),
    (
        ErrorKind::NoDevice,
        code::NO_DEVICE,
        "check that a GPU is visible (nvidia-smi, CUDA_VISIBLE_DEVICES), or run without a GPU \
         on a simulated driver (driver_mock::SimDriver)",
    ),
    (
        ErrorKind::InvalidDevice,
        code::INVALID_DEVICE,
        "use a device ordinal below the device count",
    ),
    (
        ErrorKind::NotInitialized,
        code::NOT_INITIALIZED,
        "initialise the driver (Driver::init) before this call",
    ),
    (
        ErrorKind::InvalidValue,
        code::INVALID_VALUE,
        "check the arguments: a zero or oversized size, or a pointer that was never allocated \
         here or was already freed",
    ),
    (
        ErrorKind::InvalidContext,
        code::INVALID_CONTEXT,
        "the context was released or reset; get a fresh context and allocate again",
    ),
    (
        ErrorKind::ContextDestroyed,
        code::CONTEXT_IS_DESTROYED,
        "the context was released or reset; get a fresh context and allocate again",
    ),
    (
        ErrorKind::InvalidHandle,
        code::INVALID_HANDLE,
        "the handle is stale or from another process",
    ),
    (
        ErrorKind::NotSupported,
        code::NOT_SUPPORTED,
        "this device, driver or platform does not offer it",
    ),
    (
        ErrorKind::MapFailed,
        code::MAP_FAILED,
        "an IPC handle may be opened once, and only in a process other than the exporter",
    ),
    (
        ErrorKind::AlreadyMapped,
        code::ALREADY_MAPPED,
        "an IPC handle may be opened once, and only in a process other than the exporter",
    ),
    (
        ErrorKind::HostMemoryAlreadyRegistered,
        code::HOST_MEMORY_ALREADY_REGISTERED,
        "unpin the range before pinning it again",
    ),
    (
        ErrorKind::HostMemoryNotRegistered,
        code::HOST_MEMORY_NOT_REGISTERED,
        "only pinned ranges can be unpinned",
    ),
    (
        ErrorKind::PeerAccess,
        code::PEER_ACCESS_UNSUPPORTED,
        "use the staged path for devices that are not peers",
    ),
    (
        ErrorKind::NotFound,
        code::NOT_FOUND,
        "check the name or handle",
    ),
    (
        ErrorKind::KernelFault,
        code::ILLEGAL_ADDRESS,
        "a kernel faulted and the context is unusable; every later call in it fails: end the \
         process (or reset the device) and find the faulting kernel, e.g. with \
         compute-sanitizer",
    ),
    (
        ErrorKind::DeviceUnavailable,
        code::DEVICE_UNAVAILABLE,
        "check the device's compute mode and MPS (nvidia-smi) and that no other process holds \
         it exclusively, then try again",
    ),
    (
        ErrorKind::StreamCapture,
        code::STREAM_CAPTURE_UNSUPPORTED,
        "while a stream is being captured in global mode, make none of the calls it forbids \
         (queries and synchronisation of streams and events, cuMemAlloc, pool attributes) from \
         the capturing thread, or switch that thread to relaxed mode for them; allocate during \
         a capture from a graph pool (emm's Context::begin_graph_pool); end an invalidated \
         capture and capture again",
    ),
    (
        ErrorKind::Other,
        code::UNKNOWN,
        "see the CUDA driver documentation for this code",
    ),
];

impl ErrorKind {
    /// The kind a raw `CUresult` belongs to (`Other` for a code the table does not name).
    pub fn from_code(raw: u32) -> ErrorKind {
        CODES
            .iter()
            .find(|c| c.raw == raw)
            .map_or(ErrorKind::Other, |c| c.kind)
    }

    fn row(self) -> (u32, &'static str) {
        KINDS
            .iter()
            .find(|(k, _, _)| *k == self)
            .map(|&(_, raw, advice)| (raw, advice))
            .expect("every kind has a row in KINDS (checked by a test)")
    }

    /// A representative raw code for this kind, used when a kind is scripted (fault injection)
    /// rather than returned by a driver.
    pub fn representative_code(self) -> u32 {
        self.row().0
    }

    /// What a user can do about an error of this kind.
    pub fn advice(self) -> &'static str {
        self.row().1
    }
}

/// The CUDA name and description of a raw code; a code the table does not name (a driver newer
/// than emm) prints as `CUDA_ERROR_<number>`.
pub fn describe_code(raw: u32) -> (&'static str, &'static str) {
    match CODES.iter().find(|c| c.raw == raw) {
        Some(c) => (c.name, c.text),
        None => (
            "CUDA_ERROR_(not in emm's table)",
            "a code newer than this emm; see the CUDA driver documentation",
        ),
    }
}

/// An error from a [`crate::Driver`] call.
///
/// It keeps the raw `CUresult` (when there is one: a missing libcuda has none), the driver call
/// that failed, and an optional detail. `Display` says what happened and what to do.
#[derive(Clone, PartialEq, Eq)]
pub struct DriverError {
    kind: ErrorKind,
    raw: Option<u32>,
    call: &'static str,
    detail: Option<String>,
}

impl DriverError {
    /// An error for the raw `CUresult` `raw` returned by the driver call `call`.
    pub fn from_code(call: &'static str, raw: u32) -> DriverError {
        DriverError {
            kind: ErrorKind::from_code(raw),
            raw: Some(raw),
            call,
            detail: None,
        }
    }

    /// An error of `kind` with that kind's representative raw code (for scripted faults).
    pub fn from_kind(call: &'static str, kind: ErrorKind) -> DriverError {
        DriverError {
            kind,
            raw: Some(kind.representative_code()),
            call,
            detail: None,
        }
    }

    /// No driver library could be loaded: there is no raw code.
    pub fn unavailable(call: &'static str, detail: impl Into<String>) -> DriverError {
        DriverError {
            kind: ErrorKind::DriverUnavailable,
            raw: None,
            call,
            detail: Some(detail.into()),
        }
    }

    /// Adds a detail (which pointer, which device) to the message.
    #[must_use]
    pub fn with_detail(mut self, detail: impl Into<String>) -> DriverError {
        self.detail = Some(detail.into());
        self
    }

    /// The classification of this error.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The raw `CUresult`, if the driver returned one.
    pub fn raw_code(&self) -> Option<u32> {
        self.raw
    }

    /// The driver call that failed, such as `cuMemAlloc`.
    pub fn call(&self) -> &'static str {
        self.call
    }

    /// The CUDA name of the raw code, such as `CUDA_ERROR_OUT_OF_MEMORY`.
    pub fn code_name(&self) -> &'static str {
        match self.raw {
            Some(raw) => describe_code(raw).0,
            None => "no CUDA driver library",
        }
    }
}

impl fmt::Display for DriverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.raw {
            Some(raw) => {
                let (name, text) = describe_code(raw);
                write!(f, "{} failed with {name} ({raw}): {text}", self.call)?;
            }
            None => write!(
                f,
                "{} failed: no CUDA driver library could be loaded",
                self.call
            )?,
        }
        if let Some(detail) = &self.detail {
            write!(f, " ({detail})")?;
        }
        write!(f, "; {}", self.kind.advice())
    }
}

impl fmt::Debug for DriverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DriverError")
            .field("kind", &self.kind)
            .field("raw", &self.raw)
            .field("name", &self.code_name())
            .field("call", &self.call)
            .field("detail", &self.detail)
            .finish()
    }
}

impl std::error::Error for DriverError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classification_of_known_codes() {
        assert_eq!(ErrorKind::from_code(2), ErrorKind::OutOfMemory);
        assert_eq!(ErrorKind::from_code(1), ErrorKind::InvalidValue);
        assert_eq!(ErrorKind::from_code(34), ErrorKind::DriverUnavailable);
        assert_eq!(ErrorKind::from_code(100), ErrorKind::NoDevice);
        assert_eq!(ErrorKind::from_code(201), ErrorKind::InvalidContext);
        assert_eq!(ErrorKind::from_code(709), ErrorKind::ContextDestroyed);
        assert_eq!(ErrorKind::from_code(801), ErrorKind::NotSupported);
        assert_eq!(ErrorKind::from_code(12345), ErrorKind::Other);
    }

    #[test]
    fn every_kind_round_trips_through_its_representative_code() {
        use ErrorKind::*;
        for kind in [
            OutOfMemory,
            DriverUnavailable,
            NoDevice,
            InvalidDevice,
            NotInitialized,
            InvalidValue,
            InvalidContext,
            ContextDestroyed,
            InvalidHandle,
            NotSupported,
            MapFailed,
            AlreadyMapped,
            HostMemoryAlreadyRegistered,
            HostMemoryNotRegistered,
            PeerAccess,
            NotFound,
            KernelFault,
            DeviceUnavailable,
            StreamCapture,
            Other,
        ] {
            assert_eq!(
                ErrorKind::from_code(kind.representative_code()),
                kind,
                "{kind:?}"
            );
        }
    }

    #[test]
    fn the_tables_have_one_row_each() {
        for (i, a) in CODES.iter().enumerate() {
            for b in &CODES[i + 1..] {
                assert_ne!(a.raw, b.raw, "{} and {}", a.name, b.name);
                assert_ne!(a.name, b.name);
            }
        }
        for (i, (kind, raw, advice)) in KINDS.iter().enumerate() {
            assert!(
                KINDS[i + 1..].iter().all(|(k, _, _)| k != kind),
                "{kind:?} twice"
            );
            assert_eq!(ErrorKind::from_code(*raw), *kind, "{kind:?}");
            assert!(!advice.is_empty());
        }
        // A kind without a row would panic in advice(); a kind missing from ALL, or a match
        // below without a new variant's arm, fails to compile or fails here.
        for kind in ErrorKind::ALL {
            assert!(
                KINDS.iter().any(|(k, _, _)| *k == kind),
                "{kind:?} has no row"
            );
            match kind {
                ErrorKind::OutOfMemory
                | ErrorKind::DriverUnavailable
                | ErrorKind::NoDevice
                | ErrorKind::InvalidDevice
                | ErrorKind::NotInitialized
                | ErrorKind::InvalidValue
                | ErrorKind::InvalidContext
                | ErrorKind::ContextDestroyed
                | ErrorKind::InvalidHandle
                | ErrorKind::NotSupported
                | ErrorKind::MapFailed
                | ErrorKind::AlreadyMapped
                | ErrorKind::HostMemoryAlreadyRegistered
                | ErrorKind::HostMemoryNotRegistered
                | ErrorKind::PeerAccess
                | ErrorKind::NotFound
                | ErrorKind::KernelFault
                | ErrorKind::DeviceUnavailable
                | ErrorKind::StreamCapture
                | ErrorKind::Other => {}
            }
        }
        assert_eq!(
            KINDS.len(),
            ErrorKind::ALL.len(),
            "a row for a kind not in ALL"
        );
        assert!(
            CODES.len() >= 106,
            "cudarc 0.19 names 106 driver results, success included"
        );
    }

    /// The sticky errors after a kernel fault are what an embedder meets first: they are named,
    /// and the message says the context is gone.
    #[test]
    fn kernel_faults_are_named() {
        for (raw, name) in [
            (700, "CUDA_ERROR_ILLEGAL_ADDRESS"),
            (710, "CUDA_ERROR_ASSERT"),
            (719, "CUDA_ERROR_LAUNCH_FAILED"),
        ] {
            assert_eq!(describe_code(raw).0, name);
            assert_eq!(ErrorKind::from_code(raw), ErrorKind::KernelFault);
        }
        let text = DriverError::from_code("cuMemcpyDtoH", 700).to_string();
        assert!(
            text.starts_with("cuMemcpyDtoH failed with CUDA_ERROR_ILLEGAL_ADDRESS (700)"),
            "{text}"
        );
        assert!(text.contains("compute-sanitizer"), "{text}");
        let (name, _) = describe_code(12345);
        assert!(name.contains("not in emm's table"), "{name}");
    }

    #[test]
    fn message_names_call_code_and_advice() {
        let e = DriverError::from_code("cuMemAlloc", 2).with_detail("1024 bytes on device 0");
        let text = e.to_string();
        assert_eq!(
            text,
            "cuMemAlloc failed with CUDA_ERROR_OUT_OF_MEMORY (2): out of memory \
             (1024 bytes on device 0); free memory (drop buffers, flush pending \
             deallocations) or request less"
        );
        assert_eq!(e.kind(), ErrorKind::OutOfMemory);
        assert_eq!(e.raw_code(), Some(2));
    }

    #[test]
    fn unavailable_has_no_code_and_says_what_to_do() {
        let e = DriverError::unavailable("cuInit", "libcuda.so.1 not found");
        assert_eq!(e.raw_code(), None);
        assert_eq!(e.kind(), ErrorKind::DriverUnavailable);
        assert!(e.to_string().contains("driver_mock::SimDriver"), "{e}");
        assert!(e.to_string().contains("LD_LIBRARY_PATH"), "{e}");
    }
}
