//! [`DriverError`]: the raw `CUresult`, its classification, and a message that says what to do.
//!
//! Formatting never calls into libcuda (cudarc's own `DriverError` does, and panics on a
//! machine without a driver): names and descriptions of the codes come from the table below.

use std::fmt;

/// Raw `CUresult` values that emm or the simulator name. The numbers are the CUDA driver's.
pub mod code {
    /// `CUDA_SUCCESS`.
    pub const SUCCESS: u32 = 0;
    /// `CUDA_ERROR_INVALID_VALUE`.
    pub const INVALID_VALUE: u32 = 1;
    /// `CUDA_ERROR_OUT_OF_MEMORY`.
    pub const OUT_OF_MEMORY: u32 = 2;
    /// `CUDA_ERROR_NOT_INITIALIZED`.
    pub const NOT_INITIALIZED: u32 = 3;
    /// `CUDA_ERROR_DEINITIALIZED`.
    pub const DEINITIALIZED: u32 = 4;
    /// `CUDA_ERROR_STUB_LIBRARY`.
    pub const STUB_LIBRARY: u32 = 34;
    /// `CUDA_ERROR_INSUFFICIENT_DRIVER`.
    pub const INSUFFICIENT_DRIVER: u32 = 35;
    /// `CUDA_ERROR_NO_DEVICE`.
    pub const NO_DEVICE: u32 = 100;
    /// `CUDA_ERROR_INVALID_DEVICE`.
    pub const INVALID_DEVICE: u32 = 101;
    /// `CUDA_ERROR_INVALID_IMAGE`.
    pub const INVALID_IMAGE: u32 = 200;
    /// `CUDA_ERROR_INVALID_CONTEXT`.
    pub const INVALID_CONTEXT: u32 = 201;
    /// `CUDA_ERROR_MAP_FAILED`.
    pub const MAP_FAILED: u32 = 205;
    /// `CUDA_ERROR_ALREADY_MAPPED`.
    pub const ALREADY_MAPPED: u32 = 208;
    /// `CUDA_ERROR_PEER_ACCESS_UNSUPPORTED`.
    pub const PEER_ACCESS_UNSUPPORTED: u32 = 217;
    /// `CUDA_ERROR_INVALID_HANDLE`.
    pub const INVALID_HANDLE: u32 = 400;
    /// `CUDA_ERROR_NOT_FOUND`.
    pub const NOT_FOUND: u32 = 500;
    /// `CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED`.
    pub const PEER_ACCESS_ALREADY_ENABLED: u32 = 704;
    /// `CUDA_ERROR_PEER_ACCESS_NOT_ENABLED`.
    pub const PEER_ACCESS_NOT_ENABLED: u32 = 705;
    /// `CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE`.
    pub const PRIMARY_CONTEXT_ACTIVE: u32 = 708;
    /// `CUDA_ERROR_CONTEXT_IS_DESTROYED`.
    pub const CONTEXT_IS_DESTROYED: u32 = 709;
    /// `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`.
    pub const HOST_MEMORY_ALREADY_REGISTERED: u32 = 712;
    /// `CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED`.
    pub const HOST_MEMORY_NOT_REGISTERED: u32 = 713;
    /// `CUDA_ERROR_NOT_PERMITTED`.
    pub const NOT_PERMITTED: u32 = 800;
    /// `CUDA_ERROR_NOT_SUPPORTED`.
    pub const NOT_SUPPORTED: u32 = 801;
    /// `CUDA_ERROR_UNKNOWN`.
    pub const UNKNOWN: u32 = 999;
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
    /// Any other driver error; the raw code says which.
    Other,
}

impl ErrorKind {
    /// The kind a raw `CUresult` belongs to.
    pub fn from_code(raw: u32) -> ErrorKind {
        match raw {
            code::OUT_OF_MEMORY => ErrorKind::OutOfMemory,
            code::STUB_LIBRARY | code::INSUFFICIENT_DRIVER => ErrorKind::DriverUnavailable,
            code::NO_DEVICE => ErrorKind::NoDevice,
            code::INVALID_DEVICE => ErrorKind::InvalidDevice,
            code::NOT_INITIALIZED | code::DEINITIALIZED => ErrorKind::NotInitialized,
            code::INVALID_VALUE => ErrorKind::InvalidValue,
            code::INVALID_CONTEXT => ErrorKind::InvalidContext,
            code::CONTEXT_IS_DESTROYED => ErrorKind::ContextDestroyed,
            code::INVALID_HANDLE => ErrorKind::InvalidHandle,
            code::NOT_SUPPORTED | code::NOT_PERMITTED => ErrorKind::NotSupported,
            code::MAP_FAILED => ErrorKind::MapFailed,
            code::ALREADY_MAPPED => ErrorKind::AlreadyMapped,
            code::HOST_MEMORY_ALREADY_REGISTERED => ErrorKind::HostMemoryAlreadyRegistered,
            code::HOST_MEMORY_NOT_REGISTERED => ErrorKind::HostMemoryNotRegistered,
            code::PEER_ACCESS_UNSUPPORTED
            | code::PEER_ACCESS_ALREADY_ENABLED
            | code::PEER_ACCESS_NOT_ENABLED => ErrorKind::PeerAccess,
            code::NOT_FOUND => ErrorKind::NotFound,
            _ => ErrorKind::Other,
        }
    }

    /// A representative raw code for this kind, used when a kind is scripted (fault injection)
    /// rather than returned by a driver.
    pub fn representative_code(self) -> u32 {
        match self {
            ErrorKind::OutOfMemory => code::OUT_OF_MEMORY,
            ErrorKind::DriverUnavailable => code::STUB_LIBRARY,
            ErrorKind::NoDevice => code::NO_DEVICE,
            ErrorKind::InvalidDevice => code::INVALID_DEVICE,
            ErrorKind::NotInitialized => code::NOT_INITIALIZED,
            ErrorKind::InvalidValue => code::INVALID_VALUE,
            ErrorKind::InvalidContext => code::INVALID_CONTEXT,
            ErrorKind::ContextDestroyed => code::CONTEXT_IS_DESTROYED,
            ErrorKind::InvalidHandle => code::INVALID_HANDLE,
            ErrorKind::NotSupported => code::NOT_SUPPORTED,
            ErrorKind::MapFailed => code::MAP_FAILED,
            ErrorKind::AlreadyMapped => code::ALREADY_MAPPED,
            ErrorKind::HostMemoryAlreadyRegistered => code::HOST_MEMORY_ALREADY_REGISTERED,
            ErrorKind::HostMemoryNotRegistered => code::HOST_MEMORY_NOT_REGISTERED,
            ErrorKind::PeerAccess => code::PEER_ACCESS_UNSUPPORTED,
            ErrorKind::NotFound => code::NOT_FOUND,
            ErrorKind::Other => code::UNKNOWN,
        }
    }

    /// What a user can do about an error of this kind.
    fn advice(self) -> &'static str {
        match self {
            ErrorKind::OutOfMemory => {
                "free memory (drop buffers, flush pending deallocations) or request less"
            }
            ErrorKind::DriverUnavailable => {
                "install the NVIDIA driver (libcuda.so.1 must be on the loader path, e.g. \
                 LD_LIBRARY_PATH), or run on the simulator with EMM_DRIVER=sim"
            }
            ErrorKind::NoDevice => {
                "check that a GPU is visible (nvidia-smi, CUDA_VISIBLE_DEVICES), or run on \
                 the simulator with EMM_DRIVER=sim"
            }
            ErrorKind::InvalidDevice => "use a device ordinal below the device count",
            ErrorKind::NotInitialized => "initialise the driver (Driver::init) before this call",
            ErrorKind::InvalidValue => {
                "check the arguments: a zero or oversized size, or a pointer that was never \
                 allocated here or was already freed"
            }
            ErrorKind::InvalidContext | ErrorKind::ContextDestroyed => {
                "the context was released or reset; get a fresh context and allocate again"
            }
            ErrorKind::InvalidHandle => "the handle is stale or from another process",
            ErrorKind::NotSupported => "this device, driver or platform does not offer it",
            ErrorKind::MapFailed | ErrorKind::AlreadyMapped => {
                "an IPC handle may be opened once, and only in a process other than the \
                 exporter"
            }
            ErrorKind::HostMemoryAlreadyRegistered => "unpin the range before pinning it again",
            ErrorKind::HostMemoryNotRegistered => "only pinned ranges can be unpinned",
            ErrorKind::PeerAccess => "use the staged path for devices that are not peers",
            ErrorKind::NotFound => "check the name or handle",
            ErrorKind::Other => "see the CUDA driver documentation for this code",
        }
    }
}

/// The CUDA name and description of a raw code, for the codes emm meets.
pub fn describe_code(raw: u32) -> (&'static str, &'static str) {
    match raw {
        code::SUCCESS => ("CUDA_SUCCESS", "no error"),
        code::INVALID_VALUE => ("CUDA_ERROR_INVALID_VALUE", "invalid argument"),
        code::OUT_OF_MEMORY => ("CUDA_ERROR_OUT_OF_MEMORY", "out of memory"),
        code::NOT_INITIALIZED => ("CUDA_ERROR_NOT_INITIALIZED", "initialization error"),
        code::DEINITIALIZED => ("CUDA_ERROR_DEINITIALIZED", "driver shutting down"),
        code::STUB_LIBRARY => ("CUDA_ERROR_STUB_LIBRARY", "CUDA driver is a stub library"),
        code::INSUFFICIENT_DRIVER => (
            "CUDA_ERROR_INSUFFICIENT_DRIVER",
            "CUDA driver version is insufficient",
        ),
        code::NO_DEVICE => ("CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"),
        code::INVALID_DEVICE => ("CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"),
        code::INVALID_IMAGE => ("CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"),
        code::INVALID_CONTEXT => ("CUDA_ERROR_INVALID_CONTEXT", "invalid device context"),
        code::MAP_FAILED => ("CUDA_ERROR_MAP_FAILED", "mapping of buffer object failed"),
        code::ALREADY_MAPPED => ("CUDA_ERROR_ALREADY_MAPPED", "resource already mapped"),
        code::PEER_ACCESS_UNSUPPORTED => (
            "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
            "peer access is not supported between these two devices",
        ),
        code::INVALID_HANDLE => ("CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"),
        code::NOT_FOUND => ("CUDA_ERROR_NOT_FOUND", "named symbol not found"),
        code::PEER_ACCESS_ALREADY_ENABLED => (
            "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED",
            "peer access is already enabled",
        ),
        code::PEER_ACCESS_NOT_ENABLED => (
            "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED",
            "peer access has not been enabled",
        ),
        code::PRIMARY_CONTEXT_ACTIVE => (
            "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE",
            "primary context active",
        ),
        code::CONTEXT_IS_DESTROYED => ("CUDA_ERROR_CONTEXT_IS_DESTROYED", "context is destroyed"),
        code::HOST_MEMORY_ALREADY_REGISTERED => (
            "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
            "part or all of the requested memory range is already mapped",
        ),
        code::HOST_MEMORY_NOT_REGISTERED => (
            "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
            "pointer does not correspond to a registered memory region",
        ),
        code::NOT_PERMITTED => ("CUDA_ERROR_NOT_PERMITTED", "operation not permitted"),
        code::NOT_SUPPORTED => ("CUDA_ERROR_NOT_SUPPORTED", "operation not supported"),
        code::UNKNOWN => ("CUDA_ERROR_UNKNOWN", "unknown error"),
        _ => ("CUDA_ERROR_(unlisted)", "an error code emm does not name"),
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
        assert!(e.to_string().contains("EMM_DRIVER=sim"), "{e}");
        assert!(e.to_string().contains("LD_LIBRARY_PATH"), "{e}");
    }
}
