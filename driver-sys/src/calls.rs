//! Every driver call, declared once ([`driver_calls!`](crate::driver_calls)): the CUDA
//! operations, and the methods of [`Driver`](crate::Driver) with their documentation, their
//! signatures and the operation each makes. From this one table come
//!
//! - the [`Driver`](crate::Driver) trait itself (`driver.rs`);
//! - [`CudaDriver`](crate::CudaDriver)'s implementation, which hands each call to the method
//!   of the same name in `cuda/`'s file for its area (`cuda/mod.rs`);
//! - in `driver-mock`, the simulator's `Op` list (each operation's CUDA name, whether it gives
//!   something back to the driver) and its dispatch: a method runs the model's rule of the
//!   same name with the same arguments, unless the table marks it `[custom]` (then a method of
//!   the simulator's `SimCalls` does more); and, with its feature `mock`, the mockall mock
//!   `MockDriver`.
//!
//! A new driver call is one entry here (and its operation, if new), its CUDA body in
//! `cuda/`, and its rule in the simulator's model; the compiler names whatever is missing.
//!
//! The table's shape: `ops [Name = "cuName" (release)?, ...]`, then `methods [...]`, each
//! method
//!
//! ```text
//! (/// doc)* (@[attr])* ([unsafe])? fn name(<'a>)?(arg: [Type], ...) -> [Ok] => Op ([custom])?;
//! ```
//!
//! - its return type is the `Ok` type of its `Result<_, DriverError>`;
//! - the documentation goes on the trait only; attributes marked `@` (`cfg`, lints) go on the
//!   implementations too;
//! - types are bracketed so that they reach mockall's `mock!` (driver-mock's `MockDriver`) as
//!   plain tokens, and a method that takes a file descriptor names its lifetime, which `mock!`
//!   needs there.

/// Calls the macro `$callback` with the table of every driver call (the module's
/// documentation says its shape). driver-sys builds the [`Driver`](crate::Driver) trait and
/// [`CudaDriver`](crate::CudaDriver)'s implementation from it, and the simulator its
/// operations and its dispatch.
#[macro_export]
macro_rules! driver_calls {
    ($callback:ident) => {
        $callback! {
        ops [
            Init = "cuInit",
            DeviceCount = "cuDeviceGetCount",
            DeviceTotalMem = "cuDeviceTotalMem",
            DeviceAttribute = "cuDeviceGetAttribute",
            DeviceCanAccessPeer = "cuDeviceCanAccessPeer",
            CtxEnablePeerAccess = "cuCtxEnablePeerAccess",
            PrimaryCtxRetain = "cuDevicePrimaryCtxRetain",
            PrimaryCtxRelease = "cuDevicePrimaryCtxRelease",
            PrimaryCtxReset = "cuDevicePrimaryCtxReset",
            MemAlloc = "cuMemAlloc",
            MemFree = "cuMemFree" release,
            MemGetInfo = "cuMemGetInfo",
            MemGetAddressRange = "cuMemGetAddressRange",
            MemcpyHtoD = "cuMemcpyHtoD",
            MemcpyDtoH = "cuMemcpyDtoH",
            MemcpyDtoD = "cuMemcpyDtoD",
            MemsetD8 = "cuMemsetD8",
            MemHostAlloc = "cuMemHostAlloc",
            MemFreeHost = "cuMemFreeHost" release,
            MemHostRegister = "cuMemHostRegister",
            MemHostUnregister = "cuMemHostUnregister" release,
            MemHostGetDevicePointer = "cuMemHostGetDevicePointer",
            StreamCreate = "cuStreamCreate",
            StreamDestroy = "cuStreamDestroy" release,
            EventCreate = "cuEventCreate",
            EventDestroy = "cuEventDestroy" release,
            ModuleLoadData = "cuModuleLoadData",
            ModuleUnload = "cuModuleUnload" release,
            IpcGetMemHandle = "cuIpcGetMemHandle",
            IpcOpenMemHandle = "cuIpcOpenMemHandle",
            IpcCloseMemHandle = "cuIpcCloseMemHandle" release,
            StreamSynchronize = "cuStreamSynchronize",
            CtxSynchronize = "cuCtxSynchronize",
            DeviceGetDefaultMemPool = "cuDeviceGetDefaultMemPool",
            MemPoolCreate = "cuMemPoolCreate",
            MemPoolDestroy = "cuMemPoolDestroy" release,
            MemPoolSetAttribute = "cuMemPoolSetAttribute",
            MemPoolTrimTo = "cuMemPoolTrimTo",
            MemPoolGetAttribute = "cuMemPoolGetAttribute",
            MemAllocFromPoolAsync = "cuMemAllocFromPoolAsync",
            MemFreeAsync = "cuMemFreeAsync" release,
            MemPoolExportToShareableHandle = "cuMemPoolExportToShareableHandle",
            MemPoolImportFromShareableHandle = "cuMemPoolImportFromShareableHandle",
            MemPoolExportPointer = "cuMemPoolExportPointer",
            MemPoolImportPointer = "cuMemPoolImportPointer",
            MemPoolGetAccess = "cuMemPoolGetAccess",
            MemPoolSetAccess = "cuMemPoolSetAccess",
            MemAllocManaged = "cuMemAllocManaged",
            StreamQuery = "cuStreamQuery",
            EventRecord = "cuEventRecord",
            StreamWaitEvent = "cuStreamWaitEvent",
            EventQuery = "cuEventQuery",
            EventSynchronize = "cuEventSynchronize",
            EventElapsedTime = "cuEventElapsedTime",
            LaunchHostFunc = "cuLaunchHostFunc",
            StreamWaitValue32 = "cuStreamWaitValue32",
            StreamWriteValue32 = "cuStreamWriteValue32",
            MemcpyHtoDAsync = "cuMemcpyHtoDAsync",
            MemcpyDtoHAsync = "cuMemcpyDtoHAsync",
            MemcpyDtoDAsync = "cuMemcpyDtoDAsync",
            MemsetD8Async = "cuMemsetD8Async",
            StreamCreateWithPriority = "cuStreamCreateWithPriority",
            CtxGetStreamPriorityRange = "cuCtxGetStreamPriorityRange",
            StreamGetPriority = "cuStreamGetPriority",
            MemGetAllocationGranularity = "cuMemGetAllocationGranularity",
            MemAddressReserve = "cuMemAddressReserve",
            MemAddressFree = "cuMemAddressFree" release,
            MemCreate = "cuMemCreate",
            MemExportToShareableHandle = "cuMemExportToShareableHandle",
            MemImportFromShareableHandle = "cuMemImportFromShareableHandle",
            MemRelease = "cuMemRelease" release,
            MemMap = "cuMemMap",
            MemSetAccess = "cuMemSetAccess",
            MemUnmap = "cuMemUnmap" release,
            StreamBeginCapture = "cuStreamBeginCapture",
            StreamEndCapture = "cuStreamEndCapture",
            StreamGetCaptureInfo = "cuStreamGetCaptureInfo",
            ThreadExchangeStreamCaptureMode = "cuThreadExchangeStreamCaptureMode",
            GraphInstantiate = "cuGraphInstantiateWithFlags",
            GraphLaunch = "cuGraphLaunch",
            GraphExecDestroy = "cuGraphExecDestroy" release,
            GraphDestroy = "cuGraphDestroy" release,
        ]
        methods [
            /// `cuInit(0)`.
            fn init() -> [()] => Init;

            /// `cuDeviceGetCount`.
            fn device_count() -> [u32] => DeviceCount;

            /// `cuDeviceTotalMem`: the device's memory in bytes.
            fn device_total_mem(dev: [$crate::DeviceOrdinal]) -> [usize] => DeviceTotalMem;

            /// `cuDeviceGetAttribute`.
            fn device_attribute(dev: [$crate::DeviceOrdinal], attr: [$crate::DeviceAttribute]) -> [i32] => DeviceAttribute;

            /// `cuDevicePrimaryCtxRetain`: the device's primary context, its reference count raised.
            fn primary_ctx_retain(dev: [$crate::DeviceOrdinal]) -> [$crate::ContextHandle] => PrimaryCtxRetain;

            /// `cuDevicePrimaryCtxRelease`: lowers the primary context's reference count.
            ///
            /// # Safety
            ///
            /// - Each call matches an earlier successful [`primary_ctx_retain`](Driver::primary_ctx_retain)
            ///   of the same device by this caller.
            /// - When the count reaches zero the context is destroyed with everything it owns: the
            ///   caller must no longer use memory of that context.
            [unsafe] fn primary_ctx_release(dev: [$crate::DeviceOrdinal]) -> [()] => PrimaryCtxRelease;

            /// `cuDevicePrimaryCtxReset`: destroys the primary context's allocations and state.
            ///
            /// # Safety
            ///
            /// - Every allocation, mapping and handle of that context is gone afterwards, in this
            ///   process, whoever holds it: the caller guarantees none is used again.
            [unsafe] fn primary_ctx_reset(dev: [$crate::DeviceOrdinal]) -> [()] => PrimaryCtxReset;

            /// `cuMemAlloc`: `bytes` of device memory in `ctx`.
            fn mem_alloc(ctx: [$crate::ContextHandle], bytes: [usize]) -> [$crate::DevicePtr] => MemAlloc;

            /// `cuMemAllocManaged`: `bytes` of managed memory in `ctx`, addressable from the host and
            /// the devices at the same address; `flags` is [`mem_attach::GLOBAL`] or
            /// [`mem_attach::HOST`]. Freed with [`mem_free`](Driver::mem_free).
            fn mem_alloc_managed(ctx: [$crate::ContextHandle], bytes: [usize], flags: [u32]) -> [$crate::DevicePtr] => MemAllocManaged;

            /// `cuMemFree`.
            ///
            /// # Safety
            ///
            /// - `ptr` was returned by [`mem_alloc`](Driver::mem_alloc) or
            ///   [`mem_alloc_managed`](Driver::mem_alloc_managed) in `ctx` and is freed once.
            /// - Nothing uses the memory afterwards; no work on the device still reads or writes it.
            [unsafe] fn mem_free(ctx: [$crate::ContextHandle], ptr: [$crate::DevicePtr]) -> [()] => MemFree;

            /// `cuMemGetInfo` in `ctx`.
            fn mem_get_info(ctx: [$crate::ContextHandle]) -> [$crate::MemInfo] => MemGetInfo;

            /// `cuMemGetAddressRange`: base and size of the allocation that contains `ptr`.
            fn mem_get_address_range(ctx: [$crate::ContextHandle], ptr: [$crate::DevicePtr]) -> [($crate::DevicePtr, usize)] => MemGetAddressRange;

            /// `cuMemcpyHtoD`: copies `src` to device address `dst`, synchronously.
            ///
            /// # Safety
            ///
            /// - `dst .. dst + src.len()` lies inside one live allocation of `ctx`.
            /// - Nothing else reads or writes that range during the copy; if the range is host memory
            ///   mapped into the device, no Rust reference to it is alive.
            [unsafe] fn memcpy_htod(ctx: [$crate::ContextHandle], dst: [$crate::DevicePtr], src: [&[u8]]) -> [()] => MemcpyHtoD [custom];

            /// `cuMemcpyDtoD`: copies `bytes` between device addresses, synchronously.
            ///
            /// # Safety
            ///
            /// - Both ranges lie inside live allocations (or mappings) usable from `ctx`.
            /// - Nothing else writes either range during the copy, and they do not overlap.
            [unsafe] fn memcpy_dtod(ctx: [$crate::ContextHandle], dst: [$crate::DevicePtr], src: [$crate::DevicePtr], bytes: [usize]) -> [()] => MemcpyDtoD [custom];

            /// `cuMemsetD8`: sets `bytes` bytes at `dst` to `value`, synchronously.
            ///
            /// # Safety
            ///
            /// - `dst .. dst + bytes` lies inside live memory usable from `ctx` (device memory, a
            ///   mapping, or mapped host memory no Rust reference covers); nothing else uses it during
            ///   the call.
            [unsafe] fn memset_d8(ctx: [$crate::ContextHandle], dst: [$crate::DevicePtr], value: [u8], bytes: [usize]) -> [()] => MemsetD8 [custom];

            /// `cuMemHostAlloc`: `bytes` of page-locked host memory with `flags` ([`host_alloc`]).
            fn mem_host_alloc(ctx: [$crate::ContextHandle], bytes: [usize], flags: [u32]) -> [$crate::HostPtr] => MemHostAlloc;

            /// `cuMemFreeHost`.
            ///
            /// # Safety
            ///
            /// - `ptr` came from [`mem_host_alloc`](Driver::mem_host_alloc) and is freed once.
            /// - Nothing (host code or device work through a mapping) uses the memory afterwards.
            [unsafe] fn mem_free_host(ctx: [$crate::ContextHandle], ptr: [$crate::HostPtr]) -> [()] => MemFreeHost;

            /// `cuMemHostRegister`: page-locks the existing host range `ptr .. ptr + bytes` with
            /// `flags` ([`host_register`]).
            ///
            /// # Safety
            ///
            /// - The range is host memory the caller keeps alive until it is unregistered.
            /// - With `DEVICEMAP`, device work may read and write it: the caller holds no Rust
            ///   reference to it while device work or driver copies use the mapping.
            [unsafe] fn mem_host_register(ctx: [$crate::ContextHandle], ptr: [$crate::HostPtr], bytes: [usize], flags: [u32]) -> [()] => MemHostRegister;

            /// `cuMemHostUnregister`.
            ///
            /// # Safety
            ///
            /// - `ptr` is the start of a range registered with
            ///   [`mem_host_register`](Driver::mem_host_register); its mapping is not used afterwards.
            [unsafe] fn mem_host_unregister(ctx: [$crate::ContextHandle], ptr: [$crate::HostPtr]) -> [()] => MemHostUnregister;

            /// `cuMemHostGetDevicePointer`: the device address of mapped host memory.
            fn mem_host_get_device_pointer(ctx: [$crate::ContextHandle], ptr: [$crate::HostPtr]) -> [$crate::DevicePtr] => MemHostGetDevicePointer;

            /// `cuStreamCreateWithPriority`: a stream with `flags` ([`stream_flags`]) and `priority`
            /// (lower numbers are higher priorities; see
            /// [`stream_priority_range`](Driver::stream_priority_range)).
            fn stream_create_with_priority(ctx: [$crate::ContextHandle], flags: [u32], priority: [i32]) -> [$crate::StreamHandle] => StreamCreateWithPriority [custom];

            /// `cuCtxGetStreamPriorityRange`: `(least, greatest)` priority; the greatest is the lowest
            /// number.
            fn stream_priority_range(ctx: [$crate::ContextHandle]) -> [(i32, i32)] => CtxGetStreamPriorityRange [custom];

            /// `cuStreamGetPriority`: the priority `stream` was created with (clamped into the range).
            fn stream_priority(ctx: [$crate::ContextHandle], stream: [$crate::StreamHandle]) -> [i32] => StreamGetPriority;

            /// `cuStreamQuery`: whether all work queued on `stream` is complete
            /// (`CUDA_ERROR_NOT_READY` is `Ok(false)`).
            fn stream_query(ctx: [$crate::ContextHandle], stream: [$crate::StreamHandle]) -> [bool] => StreamQuery;

            /// `cuStreamBeginCapture`: work queued on `stream` from now on is recorded into a graph
            /// instead of run, until [`stream_end_capture`](Driver::stream_end_capture). `mode` says
            /// which calls the capture forbids meanwhile ([`CaptureMode`]). The legacy default stream
            /// cannot be captured.
            fn stream_begin_capture(ctx: [$crate::ContextHandle], stream: [$crate::StreamHandle], mode: [$crate::CaptureMode]) -> [()] => StreamBeginCapture;

            /// `cuStreamEndCapture`: ends the capture begun on `stream` and returns its graph;
            /// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED` (and no graph) when a refused call invalidated
            /// it.
            fn stream_end_capture(ctx: [$crate::ContextHandle], stream: [$crate::StreamHandle]) -> [$crate::GraphHandle] => StreamEndCapture;

            /// `cuStreamGetCaptureInfo`: whether `stream` is being captured, and the capture's id.
            /// Allowed during any capture.
            fn stream_capture_status(ctx: [$crate::ContextHandle], stream: [$crate::StreamHandle]) -> [$crate::CaptureStatus] => StreamGetCaptureInfo;

            /// `cuThreadExchangeStreamCaptureMode`: sets the calling thread's capture mode and returns
            /// the one it had. A thread in [`CaptureMode::Relaxed`] may make calls a global capture
            /// elsewhere would otherwise forbid it.
            fn thread_exchange_capture_mode(mode: [$crate::CaptureMode]) -> [$crate::CaptureMode] => ThreadExchangeStreamCaptureMode [custom];

            /// `cuGraphInstantiateWithFlags` (no flags): an executable graph of `graph`.
            fn graph_instantiate(ctx: [$crate::ContextHandle], graph: [$crate::GraphHandle]) -> [$crate::GraphExecHandle] => GraphInstantiate;

            /// `cuGraphLaunch`: queues the executable graph's work on `stream`.
            fn graph_launch(ctx: [$crate::ContextHandle], exec: [$crate::GraphExecHandle], stream: [$crate::StreamHandle]) -> [()] => GraphLaunch;

            /// `cuGraphExecDestroy`.
            ///
            /// # Safety
            ///
            /// `exec` is not used again; launches already queued still run.
            [unsafe] fn graph_exec_destroy(ctx: [$crate::ContextHandle], exec: [$crate::GraphExecHandle]) -> [()] => GraphExecDestroy;

            /// `cuGraphDestroy`.
            ///
            /// # Safety
            ///
            /// `graph` is not used again (executable graphs made from it stay valid).
            [unsafe] fn graph_destroy(ctx: [$crate::ContextHandle], graph: [$crate::GraphHandle]) -> [()] => GraphDestroy;

            /// `cuEventRecord`: `event` completes when `stream` reaches this point.
            fn event_record(ctx: [$crate::ContextHandle], event: [$crate::EventHandle], stream: [$crate::StreamHandle]) -> [()] => EventRecord;

            /// `cuStreamWaitEvent`: work queued on `stream` after this waits for the last record of
            /// `event` made before the call.
            fn stream_wait_event(ctx: [$crate::ContextHandle], stream: [$crate::StreamHandle], event: [$crate::EventHandle]) -> [()] => StreamWaitEvent;

            /// `cuEventQuery`: whether the last record of `event` completed (an event never recorded
            /// is complete; `CUDA_ERROR_NOT_READY` is `Ok(false)`).
            fn event_query(ctx: [$crate::ContextHandle], event: [$crate::EventHandle]) -> [bool] => EventQuery;

            /// `cuEventSynchronize`: waits for the last record of `event`.
            fn event_synchronize(ctx: [$crate::ContextHandle], event: [$crate::EventHandle]) -> [()] => EventSynchronize;

            /// `cuEventElapsedTime`: milliseconds between two completed records of timing events.
            fn event_elapsed_time(ctx: [$crate::ContextHandle], start: [$crate::EventHandle], end: [$crate::EventHandle]) -> [f32] => EventElapsedTime;

            /// `cuLaunchHostFunc`: runs `f` when `stream` reaches this point; later work on the stream
            /// waits for it to return. Refused on a captured stream
            /// (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`, the capture left as it was): `f` runs once,
            /// and a graph would run it at every launch.
            fn launch_host_func(ctx: [$crate::ContextHandle], stream: [$crate::StreamHandle], f: [$crate::HostFn]) -> [()] => LaunchHostFunc;

            /// `cuStreamWaitValue32`: work queued on `stream` after this waits until the 32-bit word at
            /// `addr` (device memory, or the device address of mapped host memory) meets `flags`'s
            /// condition ([`wait_value`]) against `value`.
            fn stream_wait_value32(ctx: [$crate::ContextHandle], stream: [$crate::StreamHandle], addr: [$crate::DevicePtr], value: [u32], flags: [u32]) -> [()] => StreamWaitValue32;

            /// `cuStreamWriteValue32`: writes `value` to the 32-bit word at `addr` when `stream`
            /// reaches this point.
            ///
            /// # Safety
            ///
            /// - `addr .. addr + 4` is memory of `ctx` (device, or mapped host) that nothing else
            ///   reads or writes while the write may happen, but through the driver.
            [unsafe] fn stream_write_value32(ctx: [$crate::ContextHandle], stream: [$crate::StreamHandle], addr: [$crate::DevicePtr], value: [u32]) -> [()] => StreamWriteValue32;

            /// `cuMemcpyHtoDAsync`: queues a copy of `bytes` from host memory at `src` to `dst` on
            /// `stream`.
            ///
            /// # Safety
            ///
            /// - `src .. src + bytes` stays live and unwritten until the copy completes (a
            ///   synchronisation of the stream, or an event recorded after it); the driver copies
            ///   pageable memory at once, so callers that need overlap pass page-locked memory.
            /// - `dst` is memory of `ctx` that no other work writes meanwhile.
            [unsafe] fn memcpy_htod_async(ctx: [$crate::ContextHandle], dst: [$crate::DevicePtr], src: [$crate::HostPtr], bytes: [usize], stream: [$crate::StreamHandle]) -> [()] => MemcpyHtoDAsync [custom];

            /// `cuMemcpyDtoHAsync`: queues a copy of `bytes` from `src` to host memory at `dst` on
            /// `stream`.
            ///
            /// # Safety
            ///
            /// - `dst .. dst + bytes` stays live, and nothing reads or writes it, until the copy
            ///   completes.
            [unsafe] fn memcpy_dtoh_async(ctx: [$crate::ContextHandle], dst: [$crate::HostPtr], src: [$crate::DevicePtr], bytes: [usize], stream: [$crate::StreamHandle]) -> [()] => MemcpyDtoHAsync [custom];

            /// `cuMemcpyDtoDAsync`: queues a device-to-device copy on `stream`.
            ///
            /// # Safety
            ///
            /// - Both ranges are memory of `ctx` that stays live until the copy completes, and no
            ///   other work writes them meanwhile.
            [unsafe] fn memcpy_dtod_async(ctx: [$crate::ContextHandle], dst: [$crate::DevicePtr], src: [$crate::DevicePtr], bytes: [usize], stream: [$crate::StreamHandle]) -> [()] => MemcpyDtoDAsync;

            /// `cuMemsetD8Async`: queues setting `bytes` bytes at `dst` to `value` on `stream`.
            ///
            /// # Safety
            ///
            /// - `dst .. dst + bytes` is memory of `ctx` that stays live until the set completes.
            [unsafe] fn memset_d8_async(ctx: [$crate::ContextHandle], dst: [$crate::DevicePtr], value: [u8], bytes: [usize], stream: [$crate::StreamHandle]) -> [()] => MemsetD8Async;

            /// `cuStreamCreate` with `flags` (0: default).
            fn stream_create(ctx: [$crate::ContextHandle], flags: [u32]) -> [$crate::StreamHandle] => StreamCreate [custom];

            /// `cuStreamDestroy`.
            ///
            /// # Safety
            ///
            /// - `stream` was created in `ctx` and is destroyed once; no later work names it.
            [unsafe] fn stream_destroy(ctx: [$crate::ContextHandle], stream: [$crate::StreamHandle]) -> [()] => StreamDestroy [custom];

            /// `cuEventCreate` with `flags` ([`event_flags`]).
            fn event_create(ctx: [$crate::ContextHandle], flags: [u32]) -> [$crate::EventHandle] => EventCreate [custom];

            /// `cuEventDestroy`.
            ///
            /// # Safety
            ///
            /// - `event` was created in `ctx` and is destroyed once; no later work names it.
            [unsafe] fn event_destroy(ctx: [$crate::ContextHandle], event: [$crate::EventHandle]) -> [()] => EventDestroy [custom];

            /// `cuModuleLoadData`: loads a module from a cubin, fatbin or PTX image.
            fn module_load_data(ctx: [$crate::ContextHandle], image: [&[u8]]) -> [$crate::ModuleHandle] => ModuleLoadData [custom];

            /// `cuModuleUnload`.
            ///
            /// # Safety
            ///
            /// - `module` was loaded in `ctx` and is unloaded once; none of its functions runs or is
            ///   launched afterwards.
            [unsafe] fn module_unload(ctx: [$crate::ContextHandle], module: [$crate::ModuleHandle]) -> [()] => ModuleUnload [custom];

            /// `cuIpcGetMemHandle`: a handle another process can open, for the allocation whose base
            /// is `ptr`.
            fn ipc_get_mem_handle(ctx: [$crate::ContextHandle], ptr: [$crate::DevicePtr]) -> [$crate::IpcMemHandle] => IpcGetMemHandle;

            /// `cuIpcOpenMemHandle` with `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`: maps another process's
            /// allocation into `ctx`; returns the base of the mapping.
            fn ipc_open_mem_handle(ctx: [$crate::ContextHandle], handle: [&$crate::IpcMemHandle]) -> [$crate::DevicePtr] => IpcOpenMemHandle;

            /// `cuIpcCloseMemHandle`: unmaps what [`ipc_open_mem_handle`](Driver::ipc_open_mem_handle)
            /// mapped.
            ///
            /// # Safety
            ///
            /// - `ptr` is the base returned by the open, closed once; the mapping is not used after.
            [unsafe] fn ipc_close_mem_handle(ctx: [$crate::ContextHandle], ptr: [$crate::DevicePtr]) -> [()] => IpcCloseMemHandle;

            /// `cuCtxEnablePeerAccess` (flags 0): lets work in `ctx` reach memory of the device of
            /// context `peer` directly (over NVLink or PCIe peer-to-peer), so that a copy issued in `ctx`
            /// from `peer`'s memory goes device to device instead of through host memory. Fails with
            /// `PEER_ACCESS_ALREADY_ENABLED` when it was enabled before (until either context is
            /// destroyed), and `PEER_ACCESS_UNSUPPORTED` when the devices cannot be peers.
            fn ctx_enable_peer_access(ctx: [$crate::ContextHandle], peer: [$crate::ContextHandle]) -> [()] => CtxEnablePeerAccess;

            /// `cuDeviceCanAccessPeer`: whether `dev` can access memory of `peer` directly.
            fn device_can_access_peer(dev: [$crate::DeviceOrdinal], peer: [$crate::DeviceOrdinal]) -> [bool] => DeviceCanAccessPeer;

            /// `cuMemcpyDtoH`: copies `dst.len()` bytes from device address `src`, synchronously.
            ///
            /// # Safety
            ///
            /// - `src .. src + dst.len()` lies inside one live allocation of `ctx`.
            /// - Nothing writes that range during the copy.
            [unsafe] fn memcpy_dtoh(ctx: [$crate::ContextHandle], dst: [&mut [u8]], src: [$crate::DevicePtr]) -> [()] => MemcpyDtoH [custom];

            /// `cuStreamSynchronize`: waits for all work on `stream` (0 is the legacy default stream).
            fn stream_synchronize(ctx: [$crate::ContextHandle], stream: [$crate::StreamHandle]) -> [()] => StreamSynchronize;

            /// `cuCtxSynchronize`: waits for all work of `ctx`, on every stream.
            fn ctx_synchronize(ctx: [$crate::ContextHandle]) -> [()] => CtxSynchronize;

            /// `cuDeviceGetDefaultMemPool`: the device's default stream-ordered pool (the one
            /// `cuMemAllocAsync` uses). It lives as long as the device; never destroy it.
            fn device_default_mem_pool(dev: [$crate::DeviceOrdinal]) -> [$crate::MemPoolHandle] => DeviceGetDefaultMemPool;

            /// `cuMemPoolCreate` of pinned memory at `location` with `CUmemPoolProps::maxSize` =
            /// `max_size` (0: no limit beyond the memory there): the pool never reserves more, and an
            /// allocation that would need more is `CUDA_ERROR_OUT_OF_MEMORY`. A pool in host memory
            /// hands out addresses the host and (once granted access, `mem_pool_grant_access`) devices
            /// use alike.
            fn mem_pool_create_limited(ctx: [$crate::ContextHandle], location: [$crate::MemLocation], ipc: [bool], max_size: [usize]) -> [$crate::MemPoolHandle] => MemPoolCreate [custom];

            /// `cuMemPoolCreate` of managed memory (`CU_MEM_ALLOCATION_TYPE_MANAGED`, CUDA 13 on):
            /// its allocations are one address for the host and every device, migrated on demand, and
            /// `preferred` is where the driver prefers to keep them (`None`: no preference). Drivers
            /// without managed pools answer `CUDA_ERROR_NOT_SUPPORTED`.
            fn mem_pool_create_managed(ctx: [$crate::ContextHandle], preferred: [Option<$crate::MemLocation>]) -> [$crate::MemPoolHandle] => MemPoolCreate;

            /// `cuMemPoolSetAttribute(RESERVED_MEM_HIGH, USED_MEM_HIGH)` to 0: the high-water marks
            /// start again from the current figures.
            fn mem_pool_reset_high_water(ctx: [$crate::ContextHandle], pool: [$crate::MemPoolHandle]) -> [()] => MemPoolSetAttribute;

            /// `cuMemPoolDestroy`.
            ///
            /// # Safety
            ///
            /// - `pool` was created by [`mem_pool_create`](Self::mem_pool_create) and is destroyed
            ///   once; nothing allocates from it afterwards, and its memory is not used afterwards.
            [unsafe] fn mem_pool_destroy(ctx: [$crate::ContextHandle], pool: [$crate::MemPoolHandle]) -> [()] => MemPoolDestroy;

            /// `cuMemPoolSetAttribute(CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)`: bytes the pool keeps
            /// reserved at a synchronisation instead of releasing them to the system.
            fn mem_pool_set_release_threshold(ctx: [$crate::ContextHandle], pool: [$crate::MemPoolHandle], bytes: [u64]) -> [()] => MemPoolSetAttribute;

            /// `cuMemPoolTrimTo`: releases unused memory until the pool reserves at most `keep` bytes.
            fn mem_pool_trim_to(ctx: [$crate::ContextHandle], pool: [$crate::MemPoolHandle], keep: [usize]) -> [()] => MemPoolTrimTo;

            /// `cuMemPoolGetAttribute`: reserved and used bytes, current and high-water, and the
            /// release threshold.
            fn mem_pool_usage(ctx: [$crate::ContextHandle], pool: [$crate::MemPoolHandle]) -> [$crate::MemPoolUsage] => MemPoolGetAttribute;

            /// `cuMemAllocFromPoolAsync`: `bytes` from `pool`, ordered on `stream`.
            fn mem_alloc_from_pool_async(ctx: [$crate::ContextHandle], pool: [$crate::MemPoolHandle], bytes: [usize], stream: [$crate::StreamHandle]) -> [$crate::DevicePtr] => MemAllocFromPoolAsync [custom];

            /// `cuMemFreeAsync`: returns `ptr` to its pool, ordered on `stream`. Memory from
            /// [`mem_alloc`](Self::mem_alloc) is accepted too: the call returns without waiting
            /// for `stream`, and the memory stays in use until `stream` has run past the free.
            ///
            /// # Safety
            ///
            /// - `ptr` came from [`mem_alloc_from_pool_async`](Self::mem_alloc_from_pool_async) or
            ///   [`mem_alloc`](Self::mem_alloc) and is freed once; no work ordered after the free
            ///   on other streams uses it.
            [unsafe] fn mem_free_async(ctx: [$crate::ContextHandle], ptr: [$crate::DevicePtr], stream: [$crate::StreamHandle]) -> [()] => MemFreeAsync [custom];

            /// `cuMemPoolExportToShareableHandle(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)`: a new file
            /// descriptor naming `pool` (created with `ipc`), for another process to import. The
            /// caller owns it; closing it does not affect the pool.
            @[cfg(unix)]
            fn mem_pool_export_fd(ctx: [$crate::ContextHandle], pool: [$crate::MemPoolHandle]) -> [::std::os::fd::OwnedFd] => MemPoolExportToShareableHandle;

            /// `cuMemPoolImportFromShareableHandle(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)`: the pool
            /// another process exported as `fd`. An imported pool makes no allocations; it only
            /// imports pointers. The caller may close `fd` afterwards.
            @[cfg(unix)]
            @[allow(clippy::needless_lifetimes)]
            fn mem_pool_import_fd<'a>(ctx: [$crate::ContextHandle], fd: [::std::os::fd::BorrowedFd<'a>]) -> [$crate::MemPoolHandle] => MemPoolImportFromShareableHandle;

            /// `cuMemPoolExportPointer`: the export data of `ptr`, an allocation of an IPC-enabled
            /// pool, for a process that imported the pool.
            fn mem_pool_export_pointer(ctx: [$crate::ContextHandle], ptr: [$crate::DevicePtr]) -> [$crate::PoolPtrExportData] => MemPoolExportPointer;

            /// `cuMemPoolImportPointer`: maps the exporter's allocation that `data` names, from the
            /// imported `pool`, into this process. Free it with
            /// [`mem_free_async`](Self::mem_free_async) before the exporter frees it.
            fn mem_pool_import_pointer(ctx: [$crate::ContextHandle], pool: [$crate::MemPoolHandle], data: [&$crate::PoolPtrExportData]) -> [$crate::DevicePtr] => MemPoolImportPointer;

            /// `cuMemPoolGetAccess` for device `dev`: whether its kernels and copies may read and
            /// write the pool's memory.
            fn mem_pool_can_access(ctx: [$crate::ContextHandle], pool: [$crate::MemPoolHandle], dev: [$crate::DeviceOrdinal]) -> [bool] => MemPoolGetAccess;

            /// `cuMemPoolSetAccess` with `CU_MEM_ACCESS_FLAGS_PROT_READWRITE` for device `dev`.
            fn mem_pool_grant_access(ctx: [$crate::ContextHandle], pool: [$crate::MemPoolHandle], dev: [$crate::DeviceOrdinal]) -> [()] => MemPoolSetAccess;

            /// `cuMemGetAllocationGranularity` (`CU_MEM_ALLOC_GRANULARITY_MINIMUM`) of pinned device
            /// memory on `dev`: reservations, physical allocations and mappings are sized and aligned
            /// in multiples of it.
            fn mem_vmm_granularity(dev: [$crate::DeviceOrdinal]) -> [usize] => MemGetAllocationGranularity;

            /// `cuMemAddressReserve`: `size` bytes of virtual address space (a multiple of the
            /// granularity), with nothing behind them until memory is mapped there.
            fn mem_address_reserve(ctx: [$crate::ContextHandle], size: [usize]) -> [$crate::DevicePtr] => MemAddressReserve;

            /// `cuMemAddressFree`: gives back a whole reservation.
            ///
            /// # Safety
            ///
            /// `ptr` and `size` are a reservation [`mem_address_reserve`](Self::mem_address_reserve)
            /// made, freed once, with nothing mapped in it.
            [unsafe] fn mem_address_free(ctx: [$crate::ContextHandle], ptr: [$crate::DevicePtr], size: [usize]) -> [()] => MemAddressFree;

            /// `cuMemCreate`: `size` bytes (a multiple of the granularity) of pinned memory on `dev`,
            /// with no address until mapped. With `shareable`, the allocation may be exported as a
            /// POSIX file descriptor ([`mem_export_fd`](Self::mem_export_fd); its
            /// `requestedHandleTypes`), which needs
            /// [`DeviceAttribute::HandleTypePosixFileDescriptor`].
            fn mem_create(ctx: [$crate::ContextHandle], dev: [$crate::DeviceOrdinal], size: [usize], shareable: [bool]) -> [$crate::PhysHandle] => MemCreate;

            /// `cuMemExportToShareableHandle(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)`: a new file
            /// descriptor naming the physical allocation `handle` (made `shareable`), for a process to
            /// import. The caller owns it; closing it does not affect the allocation.
            @[cfg(unix)]
            fn mem_export_fd(ctx: [$crate::ContextHandle], handle: [$crate::PhysHandle]) -> [::std::os::fd::OwnedFd] => MemExportToShareableHandle;

            /// `cuMemImportFromShareableHandle(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)`: a handle of
            /// this process to the physical allocation exported as `fd` (by this process or another),
            /// to map like one of its own and give up with [`mem_release`](Self::mem_release). The
            /// memory lives while any process holds a handle to it or a mapping of it. The caller may
            /// close `fd` afterwards.
            @[cfg(unix)]
            @[allow(clippy::needless_lifetimes)]
            fn mem_import_fd<'a>(ctx: [$crate::ContextHandle], fd: [::std::os::fd::BorrowedFd<'a>]) -> [$crate::PhysHandle] => MemImportFromShareableHandle;

            /// `cuMemRelease`: gives up the handle; the memory goes once no mapping of it is left.
            ///
            /// # Safety
            ///
            /// `handle` came from [`mem_create`](Self::mem_create) and is released once.
            [unsafe] fn mem_release(ctx: [$crate::ContextHandle], handle: [$crate::PhysHandle]) -> [()] => MemRelease;

            /// `cuMemMap`: maps the whole of `handle` (`size` bytes) at `ptr`, inside a reservation,
            /// where nothing is mapped. The range is not accessible until
            /// [`mem_set_access`](Self::mem_set_access).
            ///
            /// # Safety
            ///
            /// `ptr .. ptr + size` lies in a reservation of this process and nothing is mapped there.
            [unsafe] fn mem_map(ctx: [$crate::ContextHandle], ptr: [$crate::DevicePtr], size: [usize], handle: [$crate::PhysHandle]) -> [()] => MemMap;

            /// `cuMemSetAccess` with `CU_MEM_ACCESS_FLAGS_PROT_READWRITE` for device `dev` over a
            /// mapped range.
            fn mem_set_access(ctx: [$crate::ContextHandle], ptr: [$crate::DevicePtr], size: [usize], dev: [$crate::DeviceOrdinal]) -> [()] => MemSetAccess;

            /// `cuMemUnmap`: unmaps whole mappings covering `ptr .. ptr + size`.
            ///
            /// # Safety
            ///
            /// No work, queued or running, uses the range; nothing reads or writes it afterwards.
            [unsafe] fn mem_unmap(ctx: [$crate::ContextHandle], ptr: [$crate::DevicePtr], size: [usize]) -> [()] => MemUnmap;
        ]
        }
    };
}

/// Forwards a driver call to its implementation, inside `unsafe` for an `unsafe` method:
/// what the generated implementations of [`Driver`](crate::Driver) expand to.
#[doc(hidden)]
#[macro_export]
macro_rules! __forward_call {
    (unsafe ; $call:expr) => {
        // SAFETY: forwarded under the contract of the `Driver` method being implemented,
        // which its caller meets; the implementation has the same contract.
        unsafe { $call }
    };
    (; $call:expr) => {
        $call
    };
}

/// Whether an operation of the table is marked `release`.
#[doc(hidden)]
#[macro_export]
macro_rules! __is_release {
    (release) => {
        true
    };
    () => {
        false
    };
}
