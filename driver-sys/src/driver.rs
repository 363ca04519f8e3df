//! The [`Driver`] trait, declared from the table of driver calls (`calls.rs`), and the plain
//! data and flags its methods take. Its contract is partly `unsafe`: frees, copies and context
//! resets carry `# Safety` conditions the caller must meet.
#![allow(unsafe_code)]

use std::fmt;

use crate::{ContextHandle, DeviceOrdinal, DriverError, MemPoolHandle};

/// `cuMemHostAlloc` flags.
pub mod host_alloc {
    /// `CU_MEMHOSTALLOC_PORTABLE`: pinned for every context, not only the allocating one.
    pub const PORTABLE: u32 = 0x01;
    /// `CU_MEMHOSTALLOC_DEVICEMAP`: mapped into the device address space.
    pub const DEVICEMAP: u32 = 0x02;
    /// `CU_MEMHOSTALLOC_WRITECOMBINED`: write-combined (fast to write from the host, slow to
    /// read).
    pub const WRITECOMBINED: u32 = 0x04;
}

/// `cuMemHostRegister` flags.
pub mod host_register {
    /// `CU_MEMHOSTREGISTER_PORTABLE`.
    pub const PORTABLE: u32 = 0x01;
    /// `CU_MEMHOSTREGISTER_DEVICEMAP`: also mapped into the device address space.
    pub const DEVICEMAP: u32 = 0x02;
}

/// `cuMemAllocManaged` flags (`CUmemAttach_flags`): one of the two.
pub mod mem_attach {
    /// `CU_MEM_ATTACH_GLOBAL`: accessible from any stream on any device.
    pub const GLOBAL: u32 = 0x1;
    /// `CU_MEM_ATTACH_HOST`: not accessed from devices until attached to a stream or globally
    /// (on devices with concurrent managed access, this only hints).
    pub const HOST: u32 = 0x2;
}

/// `cuStreamCreateWithPriority` flags.
pub mod stream_flags {
    /// `CU_STREAM_DEFAULT`: the stream synchronises with the legacy default stream.
    pub const DEFAULT: u32 = 0x0;
    /// `CU_STREAM_NON_BLOCKING`: work on it does not wait for the legacy default stream, nor
    /// the other way round.
    pub const NON_BLOCKING: u32 = 0x1;
}

/// `cuStreamWaitValue32` conditions (`CUstreamWaitValue_flags`).
pub mod wait_value {
    /// Wait until `(int32)(*addr - value) >= 0`.
    pub const GEQ: u32 = 0x0;
    /// Wait until `*addr == value`.
    pub const EQ: u32 = 0x1;
    /// Wait until `(*addr & value) != 0`.
    pub const AND: u32 = 0x2;
    /// Wait until `!(*addr | value) != 0`.
    pub const NOR: u32 = 0x3;
}

/// A host function for [`Driver::launch_host_func`]: run once, on a driver thread, when the
/// stream reaches it. It must not call the driver.
pub type HostFn = Box<dyn FnOnce() + Send + 'static>;

/// `cuEventCreate` flags.
pub mod event_flags {
    /// `CU_EVENT_DEFAULT`.
    pub const DEFAULT: u32 = 0x0;
    /// `CU_EVENT_DISABLE_TIMING`.
    pub const DISABLE_TIMING: u32 = 0x2;
}

/// Device attributes emm reads (`CUdevice_attribute`). The discriminants are the driver's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum DeviceAttribute {
    /// `CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY`: 1 if host memory can be mapped into the
    /// device address space.
    CanMapHostMemory = 19,
    /// `CU_DEVICE_ATTRIBUTE_PCI_BUS_ID`.
    PciBusId = 33,
    /// `CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID`.
    PciDeviceId = 34,
    /// `CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID`.
    PciDomainId = 50,
    /// `CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY`: 1 if the device can allocate managed memory.
    ManagedMemory = 83,
    /// `CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS`: 1 if the host and the device may
    /// access managed memory at the same time.
    ConcurrentManagedAccess = 89,
    /// `CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID`: the NUMA node of the host memory closest to the
    /// device (-1 when there is none).
    HostNumaId = 134,
    /// `CU_DEVICE_ATTRIBUTE_HOST_NUMA_MEMORY_POOLS_SUPPORTED`: 1 if stream-ordered pools can
    /// be made at a host NUMA node (`CU_MEM_LOCATION_TYPE_HOST_NUMA`).
    HostNumaMemoryPoolsSupported = 142,
    /// `CU_DEVICE_ATTRIBUTE_HOST_MEMORY_POOLS_SUPPORTED`: 1 if stream-ordered pools can be
    /// made in host memory (`CU_MEM_LOCATION_TYPE_HOST`).
    HostMemoryPoolsSupported = 144,
    /// `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`: 1 if the device takes
    /// virtual memory management (`cuMemAddressReserve`, `cuMemCreate`, `cuMemMap`).
    VirtualMemoryManagement = 102,
    /// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`: 1 if physical
    /// allocations (`cuMemCreate`) can be exported as POSIX file descriptors.
    HandleTypePosixFileDescriptor = 103,
}

/// Where a stream-ordered pool's memory lives (`CUmemLocation`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemLocation {
    /// On a device (`CU_MEM_LOCATION_TYPE_DEVICE`).
    Device(DeviceOrdinal),
    /// Page-locked host memory (`CU_MEM_LOCATION_TYPE_HOST`).
    Host,
    /// Page-locked host memory on a NUMA node (`CU_MEM_LOCATION_TYPE_HOST_NUMA`).
    HostNuma(i32),
}

/// Free and total device memory as `cuMemGetInfo` reports them, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct MemInfo {
    /// Bytes the driver can still hand out.
    pub free: usize,
    /// Bytes of device memory in all.
    pub total: usize,
}

/// How strictly a stream capture forbids calls that are unsafe while work is being captured
/// (`CUstreamCaptureMode`): `cuMemAlloc`, `cuMemFree`, synchronous calls and queries of the
/// legacy stream, among others.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CaptureMode {
    /// `CU_STREAM_CAPTURE_MODE_GLOBAL`: while the capture runs, no thread whose own mode is
    /// not relaxed may make an unsafe call.
    Global = 0,
    /// `CU_STREAM_CAPTURE_MODE_THREAD_LOCAL`: only the capturing thread is restricted.
    ThreadLocal = 1,
    /// `CU_STREAM_CAPTURE_MODE_RELAXED`: unsafe calls are not refused for this capture.
    Relaxed = 2,
}

/// Whether a stream is being captured into a graph (`cuStreamGetCaptureInfo`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CaptureStatus {
    /// Work queued on the stream runs (`CU_STREAM_CAPTURE_STATUS_NONE`).
    None,
    /// Work queued on the stream is recorded into the capture `id`'s graph
    /// (`CU_STREAM_CAPTURE_STATUS_ACTIVE`). Ids are unique within the process.
    Active {
        /// The capture's id.
        id: u64,
    },
    /// The capture `id` was invalidated by a refused call; ending it fails
    /// (`CU_STREAM_CAPTURE_STATUS_INVALIDATED`).
    Invalidated {
        /// The capture's id.
        id: u64,
    },
}

impl CaptureStatus {
    /// The capture's id, unless the stream is not being captured.
    pub fn id(self) -> Option<u64> {
        match self {
            CaptureStatus::None => None,
            CaptureStatus::Active { id } | CaptureStatus::Invalidated { id } => Some(id),
        }
    }
}

/// The table's callback that declares [`Driver`]: one method per entry, plus `name` and the
/// provided `mem_pool_create`.
macro_rules! declare_driver_trait {
    (ops [$($ops:tt)*] methods [$(
        $(#[$doc:meta])*
        $(@[$attr:meta])*
        $([$unsafe:ident])? fn $name:ident $(<$lt:lifetime>)? ($($arg:ident : [$($ty:tt)*]),*) -> [$($ret:tt)*] => $op:ident $([$sim:ident])?;
    )*]) => {
        /// One method per CUDA driver call emm makes. Object safe: emm holds an `Arc<dyn Driver>`.
        ///
        /// Implementations are thin: they validate nothing beyond what the CUDA driver validates, keep
        /// no bookkeeping a caller could rely on, and return the error the CUDA driver would return
        /// (the simulator is held to that by a conformance suite run on both).
        ///
        /// # Life cycle
        ///
        /// 1. [`init`](Driver::init) once (repeating it is harmless).
        /// 2. [`primary_ctx_retain`](Driver::primary_ctx_retain) per device; the handle it returns
        ///    names the context in every later call.
        /// 3. Allocate, copy, free within that context.
        /// 4. [`primary_ctx_release`](Driver::primary_ctx_release) once per retain; optionally
        ///    [`primary_ctx_reset`](Driver::primary_ctx_reset), which destroys everything the context
        ///    still owns.
        ///
        /// # Copies
        ///
        /// The copies' device addresses may name any memory the driver knows, memory of a pool in
        /// host memory included: the CUDA driver's typed copies (`cuMemcpyHtoD` and the like) refuse
        /// such addresses, so the real implementation copies them with `cuMemcpy` instead, and the
        /// simulator takes them.
        pub trait Driver: Send + Sync + fmt::Debug {
            /// A short name for messages: `"cuda"` or `"sim"`.
            fn name(&self) -> &'static str;

            $(
                $(#[$doc])*
                $(#[$attr])*
                $($unsafe)? fn $name $(<$lt>)? (&self, $($arg: $($ty)*),*) -> Result<$($ret)*, DriverError>;
            )*

            /// `cuMemPoolCreate`: a pool of pinned device memory on `dev`; with `ipc`, its memory can
            /// be exported to other processes (POSIX file descriptor handles). No size limit.
            fn mem_pool_create(
                &self,
                ctx: ContextHandle,
                dev: DeviceOrdinal,
                ipc: bool,
            ) -> Result<MemPoolHandle, DriverError> {
                self.mem_pool_create_limited(ctx, MemLocation::Device(dev), ipc, 0)
            }
        }
    };
}

crate::driver_calls!(declare_driver_trait);

/// What a stream-ordered pool holds (`cuMemPoolGetAttribute`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemPoolUsage {
    /// Bytes reserved from the system (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`).
    pub reserved: u64,
    /// Bytes handed out and not freed (`CU_MEMPOOL_ATTR_USED_MEM_CURRENT`).
    pub used: u64,
    /// The most bytes reserved since the pool was made or the mark was reset
    /// (`CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH`).
    pub reserved_high: u64,
    /// The most bytes in use since then (`CU_MEMPOOL_ATTR_USED_MEM_HIGH`).
    pub used_high: u64,
    /// Bytes the pool keeps at a synchronisation (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`).
    pub release_threshold: u64,
}
