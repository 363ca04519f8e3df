//! The [`Driver`] trait. Its contract is partly `unsafe`: frees, copies and context resets
//! carry `# Safety` conditions the caller must meet.
#![allow(unsafe_code)]

use std::fmt;
#[cfg(unix)]
use std::os::fd::{BorrowedFd, OwnedFd};

use crate::{
    ContextHandle, DeviceOrdinal, DevicePtr, DriverError, EventHandle, GraphExecHandle,
    GraphHandle, HostPtr, IpcMemHandle, MemPoolHandle, ModuleHandle, PhysHandle, PoolPtrExportData,
    StreamHandle,
};

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
#[cfg_attr(feature = "mock", mockall::automock)]
pub trait Driver: Send + Sync + fmt::Debug {
    /// A short name for messages: `"cuda"` or `"sim"`.
    fn name(&self) -> &'static str;

    /// `cuInit(0)`.
    fn init(&self) -> Result<(), DriverError>;

    /// `cuDeviceGetCount`.
    fn device_count(&self) -> Result<u32, DriverError>;

    /// `cuDeviceTotalMem`: the device's memory in bytes.
    fn device_total_mem(&self, dev: DeviceOrdinal) -> Result<usize, DriverError>;

    /// `cuDeviceGetAttribute`.
    fn device_attribute(
        &self,
        dev: DeviceOrdinal,
        attr: DeviceAttribute,
    ) -> Result<i32, DriverError>;

    /// `cuDevicePrimaryCtxRetain`: the device's primary context, its reference count raised.
    fn primary_ctx_retain(&self, dev: DeviceOrdinal) -> Result<ContextHandle, DriverError>;

    /// `cuDevicePrimaryCtxRelease`: lowers the primary context's reference count.
    ///
    /// # Safety
    ///
    /// - Each call matches an earlier successful [`primary_ctx_retain`](Driver::primary_ctx_retain)
    ///   of the same device by this caller.
    /// - When the count reaches zero the context is destroyed with everything it owns: the
    ///   caller must no longer use memory of that context.
    unsafe fn primary_ctx_release(&self, dev: DeviceOrdinal) -> Result<(), DriverError>;

    /// `cuDevicePrimaryCtxReset`: destroys the primary context's allocations and state.
    ///
    /// # Safety
    ///
    /// - Every allocation, mapping and handle of that context is gone afterwards, in this
    ///   process, whoever holds it: the caller guarantees none is used again.
    unsafe fn primary_ctx_reset(&self, dev: DeviceOrdinal) -> Result<(), DriverError>;

    /// `cuMemAlloc`: `bytes` of device memory in `ctx`.
    fn mem_alloc(&self, ctx: ContextHandle, bytes: usize) -> Result<DevicePtr, DriverError>;

    /// `cuMemAllocManaged`: `bytes` of managed memory in `ctx`, addressable from the host and
    /// the devices at the same address; `flags` is [`mem_attach::GLOBAL`] or
    /// [`mem_attach::HOST`]. Freed with [`mem_free`](Driver::mem_free).
    fn mem_alloc_managed(
        &self,
        ctx: ContextHandle,
        bytes: usize,
        flags: u32,
    ) -> Result<DevicePtr, DriverError>;

    /// `cuMemFree`.
    ///
    /// # Safety
    ///
    /// - `ptr` was returned by [`mem_alloc`](Driver::mem_alloc) or
    ///   [`mem_alloc_managed`](Driver::mem_alloc_managed) in `ctx` and is freed once.
    /// - Nothing uses the memory afterwards; no work on the device still reads or writes it.
    unsafe fn mem_free(&self, ctx: ContextHandle, ptr: DevicePtr) -> Result<(), DriverError>;

    /// `cuMemGetInfo` in `ctx`.
    fn mem_get_info(&self, ctx: ContextHandle) -> Result<MemInfo, DriverError>;

    /// `cuMemGetAddressRange`: base and size of the allocation that contains `ptr`.
    fn mem_get_address_range(
        &self,
        ctx: ContextHandle,
        ptr: DevicePtr,
    ) -> Result<(DevicePtr, usize), DriverError>;

    /// `cuMemcpyHtoD`: copies `src` to device address `dst`, synchronously.
    ///
    /// # Safety
    ///
    /// - `dst .. dst + src.len()` lies inside one live allocation of `ctx`.
    /// - Nothing else reads or writes that range during the copy; if the range is host memory
    ///   mapped into the device, no Rust reference to it is alive.
    unsafe fn memcpy_htod(
        &self,
        ctx: ContextHandle,
        dst: DevicePtr,
        src: &[u8],
    ) -> Result<(), DriverError>;

    /// `cuMemcpyDtoD`: copies `bytes` between device addresses, synchronously.
    ///
    /// # Safety
    ///
    /// - Both ranges lie inside live allocations (or mappings) usable from `ctx`.
    /// - Nothing else writes either range during the copy, and they do not overlap.
    unsafe fn memcpy_dtod(
        &self,
        ctx: ContextHandle,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
    ) -> Result<(), DriverError>;

    /// `cuMemsetD8`: sets `bytes` bytes at `dst` to `value`, synchronously.
    ///
    /// # Safety
    ///
    /// - `dst .. dst + bytes` lies inside live memory usable from `ctx` (device memory, a
    ///   mapping, or mapped host memory no Rust reference covers); nothing else uses it during
    ///   the call.
    unsafe fn memset_d8(
        &self,
        ctx: ContextHandle,
        dst: DevicePtr,
        value: u8,
        bytes: usize,
    ) -> Result<(), DriverError>;

    /// `cuMemHostAlloc`: `bytes` of page-locked host memory with `flags` ([`host_alloc`]).
    fn mem_host_alloc(
        &self,
        ctx: ContextHandle,
        bytes: usize,
        flags: u32,
    ) -> Result<HostPtr, DriverError>;

    /// `cuMemFreeHost`.
    ///
    /// # Safety
    ///
    /// - `ptr` came from [`mem_host_alloc`](Driver::mem_host_alloc) and is freed once.
    /// - Nothing (host code or device work through a mapping) uses the memory afterwards.
    unsafe fn mem_free_host(&self, ctx: ContextHandle, ptr: HostPtr) -> Result<(), DriverError>;

    /// `cuMemHostRegister`: page-locks the existing host range `ptr .. ptr + bytes` with
    /// `flags` ([`host_register`]).
    ///
    /// # Safety
    ///
    /// - The range is host memory the caller keeps alive until it is unregistered.
    /// - With `DEVICEMAP`, device work may read and write it: the caller holds no Rust
    ///   reference to it while device work or driver copies use the mapping.
    unsafe fn mem_host_register(
        &self,
        ctx: ContextHandle,
        ptr: HostPtr,
        bytes: usize,
        flags: u32,
    ) -> Result<(), DriverError>;

    /// `cuMemHostUnregister`.
    ///
    /// # Safety
    ///
    /// - `ptr` is the start of a range registered with
    ///   [`mem_host_register`](Driver::mem_host_register); its mapping is not used afterwards.
    unsafe fn mem_host_unregister(
        &self,
        ctx: ContextHandle,
        ptr: HostPtr,
    ) -> Result<(), DriverError>;

    /// `cuMemHostGetDevicePointer`: the device address of mapped host memory.
    fn mem_host_get_device_pointer(
        &self,
        ctx: ContextHandle,
        ptr: HostPtr,
    ) -> Result<DevicePtr, DriverError>;

    /// `cuStreamCreateWithPriority`: a stream with `flags` ([`stream_flags`]) and `priority`
    /// (lower numbers are higher priorities; see
    /// [`stream_priority_range`](Driver::stream_priority_range)).
    fn stream_create_with_priority(
        &self,
        ctx: ContextHandle,
        flags: u32,
        priority: i32,
    ) -> Result<StreamHandle, DriverError>;

    /// `cuCtxGetStreamPriorityRange`: `(least, greatest)` priority; the greatest is the lowest
    /// number.
    fn stream_priority_range(&self, ctx: ContextHandle) -> Result<(i32, i32), DriverError>;

    /// `cuStreamGetPriority`: the priority `stream` was created with (clamped into the range).
    fn stream_priority(&self, ctx: ContextHandle, stream: StreamHandle)
    -> Result<i32, DriverError>;

    /// `cuStreamQuery`: whether all work queued on `stream` is complete
    /// (`CUDA_ERROR_NOT_READY` is `Ok(false)`).
    fn stream_query(&self, ctx: ContextHandle, stream: StreamHandle) -> Result<bool, DriverError>;

    /// `cuStreamBeginCapture`: work queued on `stream` from now on is recorded into a graph
    /// instead of run, until [`stream_end_capture`](Driver::stream_end_capture). `mode` says
    /// which calls the capture forbids meanwhile ([`CaptureMode`]). The legacy default stream
    /// cannot be captured.
    fn stream_begin_capture(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
        mode: CaptureMode,
    ) -> Result<(), DriverError>;

    /// `cuStreamEndCapture`: ends the capture begun on `stream` and returns its graph;
    /// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED` (and no graph) when a refused call invalidated
    /// it.
    fn stream_end_capture(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
    ) -> Result<GraphHandle, DriverError>;

    /// `cuStreamGetCaptureInfo`: whether `stream` is being captured, and the capture's id.
    /// Allowed during any capture.
    fn stream_capture_status(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
    ) -> Result<CaptureStatus, DriverError>;

    /// `cuThreadExchangeStreamCaptureMode`: sets the calling thread's capture mode and returns
    /// the one it had. A thread in [`CaptureMode::Relaxed`] may make calls a global capture
    /// elsewhere would otherwise forbid it.
    fn thread_exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode, DriverError>;

    /// `cuGraphInstantiateWithFlags` (no flags): an executable graph of `graph`.
    fn graph_instantiate(
        &self,
        ctx: ContextHandle,
        graph: GraphHandle,
    ) -> Result<GraphExecHandle, DriverError>;

    /// `cuGraphLaunch`: queues the executable graph's work on `stream`.
    fn graph_launch(
        &self,
        ctx: ContextHandle,
        exec: GraphExecHandle,
        stream: StreamHandle,
    ) -> Result<(), DriverError>;

    /// `cuGraphExecDestroy`.
    ///
    /// # Safety
    ///
    /// `exec` is not used again; launches already queued still run.
    unsafe fn graph_exec_destroy(
        &self,
        ctx: ContextHandle,
        exec: GraphExecHandle,
    ) -> Result<(), DriverError>;

    /// `cuGraphDestroy`.
    ///
    /// # Safety
    ///
    /// `graph` is not used again (executable graphs made from it stay valid).
    unsafe fn graph_destroy(
        &self,
        ctx: ContextHandle,
        graph: GraphHandle,
    ) -> Result<(), DriverError>;

    /// `cuEventRecord`: `event` completes when `stream` reaches this point.
    fn event_record(
        &self,
        ctx: ContextHandle,
        event: EventHandle,
        stream: StreamHandle,
    ) -> Result<(), DriverError>;

    /// `cuStreamWaitEvent`: work queued on `stream` after this waits for the last record of
    /// `event` made before the call.
    fn stream_wait_event(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
        event: EventHandle,
    ) -> Result<(), DriverError>;

    /// `cuEventQuery`: whether the last record of `event` completed (an event never recorded
    /// is complete; `CUDA_ERROR_NOT_READY` is `Ok(false)`).
    fn event_query(&self, ctx: ContextHandle, event: EventHandle) -> Result<bool, DriverError>;

    /// `cuEventSynchronize`: waits for the last record of `event`.
    fn event_synchronize(&self, ctx: ContextHandle, event: EventHandle) -> Result<(), DriverError>;

    /// `cuEventElapsedTime`: milliseconds between two completed records of timing events.
    fn event_elapsed_time(
        &self,
        ctx: ContextHandle,
        start: EventHandle,
        end: EventHandle,
    ) -> Result<f32, DriverError>;

    /// `cuLaunchHostFunc`: runs `f` when `stream` reaches this point; later work on the stream
    /// waits for it to return. Refused on a captured stream
    /// (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`, the capture left as it was): `f` runs once,
    /// and a graph would run it at every launch.
    fn launch_host_func(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
        f: HostFn,
    ) -> Result<(), DriverError>;

    /// `cuStreamWaitValue32`: work queued on `stream` after this waits until the 32-bit word at
    /// `addr` (device memory, or the device address of mapped host memory) meets `flags`'s
    /// condition ([`wait_value`]) against `value`.
    fn stream_wait_value32(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u32,
        flags: u32,
    ) -> Result<(), DriverError>;

    /// `cuStreamWriteValue32`: writes `value` to the 32-bit word at `addr` when `stream`
    /// reaches this point.
    ///
    /// # Safety
    ///
    /// - `addr .. addr + 4` is memory of `ctx` (device, or mapped host) that nothing else
    ///   reads or writes while the write may happen, but through the driver.
    unsafe fn stream_write_value32(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u32,
    ) -> Result<(), DriverError>;

    /// `cuMemcpyHtoDAsync`: queues a copy of `bytes` from host memory at `src` to `dst` on
    /// `stream`.
    ///
    /// # Safety
    ///
    /// - `src .. src + bytes` stays live and unwritten until the copy completes (a
    ///   synchronisation of the stream, or an event recorded after it); the driver copies
    ///   pageable memory at once, so callers that need overlap pass page-locked memory.
    /// - `dst` is memory of `ctx` that no other work writes meanwhile.
    unsafe fn memcpy_htod_async(
        &self,
        ctx: ContextHandle,
        dst: DevicePtr,
        src: HostPtr,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<(), DriverError>;

    /// `cuMemcpyDtoHAsync`: queues a copy of `bytes` from `src` to host memory at `dst` on
    /// `stream`.
    ///
    /// # Safety
    ///
    /// - `dst .. dst + bytes` stays live, and nothing reads or writes it, until the copy
    ///   completes.
    unsafe fn memcpy_dtoh_async(
        &self,
        ctx: ContextHandle,
        dst: HostPtr,
        src: DevicePtr,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<(), DriverError>;

    /// `cuMemcpyDtoDAsync`: queues a device-to-device copy on `stream`.
    ///
    /// # Safety
    ///
    /// - Both ranges are memory of `ctx` that stays live until the copy completes, and no
    ///   other work writes them meanwhile.
    unsafe fn memcpy_dtod_async(
        &self,
        ctx: ContextHandle,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<(), DriverError>;

    /// `cuMemsetD8Async`: queues setting `bytes` bytes at `dst` to `value` on `stream`.
    ///
    /// # Safety
    ///
    /// - `dst .. dst + bytes` is memory of `ctx` that stays live until the set completes.
    unsafe fn memset_d8_async(
        &self,
        ctx: ContextHandle,
        dst: DevicePtr,
        value: u8,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<(), DriverError>;

    /// `cuStreamCreate` with `flags` (0: default).
    fn stream_create(&self, ctx: ContextHandle, flags: u32) -> Result<StreamHandle, DriverError>;

    /// `cuStreamDestroy`.
    ///
    /// # Safety
    ///
    /// - `stream` was created in `ctx` and is destroyed once; no later work names it.
    unsafe fn stream_destroy(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
    ) -> Result<(), DriverError>;

    /// `cuEventCreate` with `flags` ([`event_flags`]).
    fn event_create(&self, ctx: ContextHandle, flags: u32) -> Result<EventHandle, DriverError>;

    /// `cuEventDestroy`.
    ///
    /// # Safety
    ///
    /// - `event` was created in `ctx` and is destroyed once; no later work names it.
    unsafe fn event_destroy(
        &self,
        ctx: ContextHandle,
        event: EventHandle,
    ) -> Result<(), DriverError>;

    /// `cuModuleLoadData`: loads a module from a cubin, fatbin or PTX image.
    fn module_load_data(
        &self,
        ctx: ContextHandle,
        image: &[u8],
    ) -> Result<ModuleHandle, DriverError>;

    /// `cuModuleUnload`.
    ///
    /// # Safety
    ///
    /// - `module` was loaded in `ctx` and is unloaded once; none of its functions runs or is
    ///   launched afterwards.
    unsafe fn module_unload(
        &self,
        ctx: ContextHandle,
        module: ModuleHandle,
    ) -> Result<(), DriverError>;

    /// `cuIpcGetMemHandle`: a handle another process can open, for the allocation whose base
    /// is `ptr`.
    fn ipc_get_mem_handle(
        &self,
        ctx: ContextHandle,
        ptr: DevicePtr,
    ) -> Result<IpcMemHandle, DriverError>;

    /// `cuIpcOpenMemHandle` with `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`: maps another process's
    /// allocation into `ctx`; returns the base of the mapping.
    fn ipc_open_mem_handle(
        &self,
        ctx: ContextHandle,
        handle: &IpcMemHandle,
    ) -> Result<DevicePtr, DriverError>;

    /// `cuIpcCloseMemHandle`: unmaps what [`ipc_open_mem_handle`](Driver::ipc_open_mem_handle)
    /// mapped.
    ///
    /// # Safety
    ///
    /// - `ptr` is the base returned by the open, closed once; the mapping is not used after.
    unsafe fn ipc_close_mem_handle(
        &self,
        ctx: ContextHandle,
        ptr: DevicePtr,
    ) -> Result<(), DriverError>;

    /// `cuCtxEnablePeerAccess` (flags 0): lets work in `ctx` reach memory of the device of
    /// context `peer` directly (over NVLink or PCIe peer-to-peer), so that a copy issued in `ctx`
    /// from `peer`'s memory goes device to device instead of through host memory. Fails with
    /// `PEER_ACCESS_ALREADY_ENABLED` when it was enabled before (until either context is
    /// destroyed), and `PEER_ACCESS_UNSUPPORTED` when the devices cannot be peers.
    fn ctx_enable_peer_access(
        &self,
        ctx: ContextHandle,
        peer: ContextHandle,
    ) -> Result<(), DriverError>;

    /// `cuDeviceCanAccessPeer`: whether `dev` can access memory of `peer` directly.
    fn device_can_access_peer(
        &self,
        dev: DeviceOrdinal,
        peer: DeviceOrdinal,
    ) -> Result<bool, DriverError>;

    /// `cuMemcpyDtoH`: copies `dst.len()` bytes from device address `src`, synchronously.
    ///
    /// # Safety
    ///
    /// - `src .. src + dst.len()` lies inside one live allocation of `ctx`.
    /// - Nothing writes that range during the copy.
    unsafe fn memcpy_dtoh(
        &self,
        ctx: ContextHandle,
        dst: &mut [u8],
        src: DevicePtr,
    ) -> Result<(), DriverError>;

    /// `cuStreamSynchronize`: waits for all work on `stream` (0 is the legacy default stream).
    fn stream_synchronize(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
    ) -> Result<(), DriverError>;

    /// `cuDeviceGetDefaultMemPool`: the device's default stream-ordered pool (the one
    /// `cuMemAllocAsync` uses). It lives as long as the device; never destroy it.
    fn device_default_mem_pool(&self, dev: DeviceOrdinal) -> Result<MemPoolHandle, DriverError>;

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

    /// `cuMemPoolCreate` of pinned memory at `location` with `CUmemPoolProps::maxSize` =
    /// `max_size` (0: no limit beyond the memory there): the pool never reserves more, and an
    /// allocation that would need more is `CUDA_ERROR_OUT_OF_MEMORY`. A pool in host memory
    /// hands out addresses the host and (once granted access, `mem_pool_grant_access`) devices
    /// use alike.
    fn mem_pool_create_limited(
        &self,
        ctx: ContextHandle,
        location: MemLocation,
        ipc: bool,
        max_size: usize,
    ) -> Result<MemPoolHandle, DriverError>;

    /// `cuMemPoolCreate` of managed memory (`CU_MEM_ALLOCATION_TYPE_MANAGED`, CUDA 13 on):
    /// its allocations are one address for the host and every device, migrated on demand, and
    /// `preferred` is where the driver prefers to keep them (`None`: no preference). Drivers
    /// without managed pools answer `CUDA_ERROR_NOT_SUPPORTED`.
    fn mem_pool_create_managed(
        &self,
        ctx: ContextHandle,
        preferred: Option<MemLocation>,
    ) -> Result<MemPoolHandle, DriverError>;

    /// `cuMemPoolSetAttribute(RESERVED_MEM_HIGH, USED_MEM_HIGH)` to 0: the high-water marks
    /// start again from the current figures.
    fn mem_pool_reset_high_water(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
    ) -> Result<(), DriverError>;

    /// `cuMemPoolDestroy`.
    ///
    /// # Safety
    ///
    /// - `pool` was created by [`mem_pool_create`](Self::mem_pool_create) and is destroyed
    ///   once; nothing allocates from it afterwards, and its memory is not used afterwards.
    unsafe fn mem_pool_destroy(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
    ) -> Result<(), DriverError>;

    /// `cuMemPoolSetAttribute(CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)`: bytes the pool keeps
    /// reserved at a synchronisation instead of releasing them to the system.
    fn mem_pool_set_release_threshold(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
        bytes: u64,
    ) -> Result<(), DriverError>;

    /// `cuMemPoolTrimTo`: releases unused memory until the pool reserves at most `keep` bytes.
    fn mem_pool_trim_to(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
        keep: usize,
    ) -> Result<(), DriverError>;

    /// `cuMemPoolGetAttribute`: reserved and used bytes, current and high-water, and the
    /// release threshold.
    fn mem_pool_usage(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
    ) -> Result<MemPoolUsage, DriverError>;

    /// `cuMemAllocFromPoolAsync`: `bytes` from `pool`, ordered on `stream`.
    fn mem_alloc_from_pool_async(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<DevicePtr, DriverError>;

    /// `cuMemFreeAsync`: returns `ptr` to its pool, ordered on `stream`.
    ///
    /// # Safety
    ///
    /// - `ptr` came from [`mem_alloc_from_pool_async`](Self::mem_alloc_from_pool_async) and
    ///   is freed once; no work ordered after the free on other streams uses it.
    unsafe fn mem_free_async(
        &self,
        ctx: ContextHandle,
        ptr: DevicePtr,
        stream: StreamHandle,
    ) -> Result<(), DriverError>;

    /// `cuMemPoolExportToShareableHandle(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)`: a new file
    /// descriptor naming `pool` (created with `ipc`), for another process to import. The
    /// caller owns it; closing it does not affect the pool.
    #[cfg(unix)]
    fn mem_pool_export_fd(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
    ) -> Result<OwnedFd, DriverError>;

    /// `cuMemPoolImportFromShareableHandle(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)`: the pool
    /// another process exported as `fd`. An imported pool makes no allocations; it only
    /// imports pointers. The caller may close `fd` afterwards.
    #[cfg(unix)]
    // The named lifetime is for mockall's `automock`, which does not take `'_` here.
    #[allow(clippy::needless_lifetimes)]
    fn mem_pool_import_fd<'a>(
        &self,
        ctx: ContextHandle,
        fd: BorrowedFd<'a>,
    ) -> Result<MemPoolHandle, DriverError>;

    /// `cuMemPoolExportPointer`: the export data of `ptr`, an allocation of an IPC-enabled
    /// pool, for a process that imported the pool.
    fn mem_pool_export_pointer(
        &self,
        ctx: ContextHandle,
        ptr: DevicePtr,
    ) -> Result<PoolPtrExportData, DriverError>;

    /// `cuMemPoolImportPointer`: maps the exporter's allocation that `data` names, from the
    /// imported `pool`, into this process. Free it with
    /// [`mem_free_async`](Self::mem_free_async) before the exporter frees it.
    fn mem_pool_import_pointer(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
        data: &PoolPtrExportData,
    ) -> Result<DevicePtr, DriverError>;

    /// `cuMemPoolGetAccess` for device `dev`: whether its kernels and copies may read and
    /// write the pool's memory.
    fn mem_pool_can_access(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
        dev: DeviceOrdinal,
    ) -> Result<bool, DriverError>;

    /// `cuMemPoolSetAccess` with `CU_MEM_ACCESS_FLAGS_PROT_READWRITE` for device `dev`.
    fn mem_pool_grant_access(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
        dev: DeviceOrdinal,
    ) -> Result<(), DriverError>;

    /// `cuMemGetAllocationGranularity` (`CU_MEM_ALLOC_GRANULARITY_MINIMUM`) of pinned device
    /// memory on `dev`: reservations, physical allocations and mappings are sized and aligned
    /// in multiples of it.
    fn mem_vmm_granularity(&self, dev: DeviceOrdinal) -> Result<usize, DriverError>;

    /// `cuMemAddressReserve`: `size` bytes of virtual address space (a multiple of the
    /// granularity), with nothing behind them until memory is mapped there.
    fn mem_address_reserve(
        &self,
        ctx: ContextHandle,
        size: usize,
    ) -> Result<DevicePtr, DriverError>;

    /// `cuMemAddressFree`: gives back a whole reservation.
    ///
    /// # Safety
    ///
    /// `ptr` and `size` are a reservation [`mem_address_reserve`](Self::mem_address_reserve)
    /// made, freed once, with nothing mapped in it.
    unsafe fn mem_address_free(
        &self,
        ctx: ContextHandle,
        ptr: DevicePtr,
        size: usize,
    ) -> Result<(), DriverError>;

    /// `cuMemCreate`: `size` bytes (a multiple of the granularity) of pinned memory on `dev`,
    /// with no address until mapped. With `shareable`, the allocation may be exported as a
    /// POSIX file descriptor ([`mem_export_fd`](Self::mem_export_fd); its
    /// `requestedHandleTypes`), which needs
    /// [`DeviceAttribute::HandleTypePosixFileDescriptor`].
    fn mem_create(
        &self,
        ctx: ContextHandle,
        dev: DeviceOrdinal,
        size: usize,
        shareable: bool,
    ) -> Result<PhysHandle, DriverError>;

    /// `cuMemExportToShareableHandle(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)`: a new file
    /// descriptor naming the physical allocation `handle` (made `shareable`), for a process to
    /// import. The caller owns it; closing it does not affect the allocation.
    #[cfg(unix)]
    fn mem_export_fd(&self, ctx: ContextHandle, handle: PhysHandle)
    -> Result<OwnedFd, DriverError>;

    /// `cuMemImportFromShareableHandle(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)`: a handle of
    /// this process to the physical allocation exported as `fd` (by this process or another),
    /// to map like one of its own and give up with [`mem_release`](Self::mem_release). The
    /// memory lives while any process holds a handle to it or a mapping of it. The caller may
    /// close `fd` afterwards.
    #[cfg(unix)]
    // The named lifetime is for mockall's `automock`, which does not take `'_` here.
    #[allow(clippy::needless_lifetimes)]
    fn mem_import_fd<'a>(
        &self,
        ctx: ContextHandle,
        fd: BorrowedFd<'a>,
    ) -> Result<PhysHandle, DriverError>;

    /// `cuMemRelease`: gives up the handle; the memory goes once no mapping of it is left.
    ///
    /// # Safety
    ///
    /// `handle` came from [`mem_create`](Self::mem_create) and is released once.
    unsafe fn mem_release(&self, ctx: ContextHandle, handle: PhysHandle)
    -> Result<(), DriverError>;

    /// `cuMemMap`: maps the whole of `handle` (`size` bytes) at `ptr`, inside a reservation,
    /// where nothing is mapped. The range is not accessible until
    /// [`mem_set_access`](Self::mem_set_access).
    ///
    /// # Safety
    ///
    /// `ptr .. ptr + size` lies in a reservation of this process and nothing is mapped there.
    unsafe fn mem_map(
        &self,
        ctx: ContextHandle,
        ptr: DevicePtr,
        size: usize,
        handle: PhysHandle,
    ) -> Result<(), DriverError>;

    /// `cuMemSetAccess` with `CU_MEM_ACCESS_FLAGS_PROT_READWRITE` for device `dev` over a
    /// mapped range.
    fn mem_set_access(
        &self,
        ctx: ContextHandle,
        ptr: DevicePtr,
        size: usize,
        dev: DeviceOrdinal,
    ) -> Result<(), DriverError>;

    /// `cuMemUnmap`: unmaps whole mappings covering `ptr .. ptr + size`.
    ///
    /// # Safety
    ///
    /// No work, queued or running, uses the range; nothing reads or writes it afterwards.
    unsafe fn mem_unmap(
        &self,
        ctx: ContextHandle,
        ptr: DevicePtr,
        size: usize,
    ) -> Result<(), DriverError>;
}

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
