//! Handle newtypes. Pointers and context handles print as hex, device ordinals as decimal.

use std::fmt;

/// A device address (`CUdeviceptr`). Prints as hex.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct DevicePtr(pub u64);

/// A host address (`void *` as handed to or by the driver). Prints as hex.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct HostPtr(pub usize);

/// A CUDA context (`CUcontext`), as an opaque value. Prints as hex.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ContextHandle(pub(crate) u64);

/// A stream (`CUstream`), as an opaque value. Prints as hex.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StreamHandle(pub(crate) u64);

impl StreamHandle {
    /// The null stream (0): the legacy default stream, unless the program was built for
    /// per-thread default streams (emm's calls are not).
    pub const NULL: StreamHandle = StreamHandle(0);
    /// `CU_STREAM_LEGACY`: the legacy default stream, which synchronises with every blocking
    /// stream of its context.
    pub const LEGACY: StreamHandle = StreamHandle(0x1);
    /// `CU_STREAM_PER_THREAD`: the calling thread's default stream, which does not synchronise
    /// with other streams.
    pub const PER_THREAD: StreamHandle = StreamHandle(0x2);
}

/// An event (`CUevent`), as an opaque value. Prints as hex.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EventHandle(pub(crate) u64);

/// A stream-ordered memory pool (`CUmemoryPool`), as an opaque value. Prints as hex.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MemPoolHandle(pub(crate) u64);

/// A physical memory allocation made by `cuMemCreate` (`CUmemGenericAllocationHandle`), as an
/// opaque value: memory with no address until it is mapped into a reserved range. Prints as
/// hex.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PhysHandle(pub(crate) u64);

/// A graph (`CUgraph`), as made by ending a stream capture, as an opaque value. Prints as hex.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GraphHandle(pub(crate) u64);

/// An executable graph (`CUgraphExec`), as an opaque value. Prints as hex.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GraphExecHandle(pub(crate) u64);

/// A loaded module (`CUmodule`), as an opaque value. Prints as hex.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ModuleHandle(pub(crate) u64);

/// The driver's 64-byte IPC handle of a device allocation (`CUipcMemHandle`): plain bytes that
/// another process passes to `cuIpcOpenMemHandle`. Prints as hex.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcMemHandle(pub [u8; 64]);

/// The driver's 64-byte export data of one allocation of an IPC-enabled stream-ordered pool
/// (`CUmemPoolPtrExportData`, from `cuMemPoolExportPointer`): plain bytes that a process which
/// imported the pool passes to `cuMemPoolImportPointer`. Prints as hex.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PoolPtrExportData(pub [u8; 64]);

/// Raw access to the opaque handles. A handle names a driver object that safe code passes
/// straight to the driver, which dereferences it unchecked (a made-up stream handle crashes
/// `libcuda`), so only the driver that made the object, or code that vouches for a value it
/// was given, makes one: [`from_raw`](StreamHandle::from_raw) is `unsafe`. Reading the value is
/// safe.
macro_rules! opaque_handle {
    ($($ty:ident => $what:literal),* $(,)?) => {$(
        // An unsafe constructor is the point: it makes no unsafe call.
        #[allow(unsafe_code)]
        impl $ty {
            #[doc = concat!("The handle whose raw value is `raw`.")]
            ///
            /// # Safety
            ///
            #[doc = concat!("`raw` names ", $what, " that is alive, made by the driver this handle")]
            /// will be passed to (a driver implementation makes its own handles this way), and
            /// stays alive while the handle is used. Safe code hands handles to the driver
            /// unchecked, and the driver dereferences them.
            pub const unsafe fn from_raw(raw: u64) -> $ty {
                $ty(raw)
            }

            /// The raw value, as the driver's C API takes it.
            pub const fn raw(self) -> u64 {
                self.0
            }
        }
    )*};
}
opaque_handle!(
    ContextHandle => "a CUDA context",
    StreamHandle => "a stream (or is 0, `CU_STREAM_LEGACY` or `CU_STREAM_PER_THREAD`)",
    EventHandle => "an event",
    MemPoolHandle => "a stream-ordered memory pool",
    PhysHandle => "a physical allocation of `cuMemCreate`",
    GraphHandle => "a graph",
    GraphExecHandle => "an executable graph",
    ModuleHandle => "a loaded module",
);

/// The driver's opaque byte handles print as their name and hex bytes.
macro_rules! hex_bytes_debug {
    ($($ty:ident),*) => {$(
        impl fmt::Debug for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(concat!(stringify!($ty), "("))?;
                self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))?;
                f.write_str(")")
            }
        }
    )*};
}
hex_bytes_debug!(IpcMemHandle, PoolPtrExportData);

/// A device ordinal, as `cuDeviceGet` takes it (0-based).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
pub struct DeviceOrdinal(pub u32);

impl DevicePtr {
    /// The address as an integer.
    pub const fn addr(self) -> u64 {
        self.0
    }

    /// This address plus `bytes`, or `None` on overflow.
    pub fn checked_add(self, bytes: usize) -> Option<DevicePtr> {
        self.0.checked_add(bytes as u64).map(DevicePtr)
    }

    /// Whether this is the null device pointer.
    pub const fn is_null(self) -> bool {
        self.0 == 0
    }
}

impl HostPtr {
    /// The address as an integer.
    pub const fn addr(self) -> usize {
        self.0
    }

    /// Whether this is the null host pointer.
    pub const fn is_null(self) -> bool {
        self.0 == 0
    }
}

macro_rules! hex_fmt {
    ($($ty:ident),*) => {$(
        impl fmt::Debug for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!(stringify!($ty), "({:#x})"), self.0)
            }
        }
        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{:#x}", self.0)
            }
        }
        impl fmt::LowerHex for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::LowerHex::fmt(&self.0, f)
            }
        }
    )*};
}
hex_fmt!(
    DevicePtr,
    HostPtr,
    ContextHandle,
    StreamHandle,
    EventHandle,
    ModuleHandle,
    MemPoolHandle,
    PhysHandle,
    GraphHandle,
    GraphExecHandle
);

impl fmt::Display for DeviceOrdinal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl From<u32> for DeviceOrdinal {
    fn from(v: u32) -> Self {
        DeviceOrdinal(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pointers_print_as_hex() {
        assert_eq!(DevicePtr(0x7f00_0000_0200).to_string(), "0x7f0000000200");
        assert_eq!(format!("{:?}", DevicePtr(255)), "DevicePtr(0xff)");
        assert_eq!(format!("{:?}", HostPtr(16)), "HostPtr(0x10)");
        assert_eq!(ContextHandle(0xabc).to_string(), "0xabc");
        assert_eq!(DeviceOrdinal(3).to_string(), "3");
    }

    #[test]
    fn checked_add_reports_overflow() {
        assert_eq!(DevicePtr(10).checked_add(5), Some(DevicePtr(15)));
        assert_eq!(DevicePtr(u64::MAX).checked_add(1), None);
    }
}
