//! [`SimDriver`]'s `Driver` impl: each call is logged, may be faulted, and runs one rule of
//! the model (`World`'s methods, one file per part of the model).
#![allow(unsafe_code)]

#[cfg(unix)]
use std::os::fd::{BorrowedFd, OwnedFd};

use driver_sys::{
    CaptureMode, CaptureStatus, ContextHandle, DeviceAttribute, DeviceOrdinal, DevicePtr, Driver,
    DriverError, EventHandle, GraphExecHandle, GraphHandle, HostFn, HostPtr, IpcMemHandle, MemInfo,
    MemLocation, MemPoolHandle, MemPoolUsage, ModuleHandle, PhysHandle, PoolPtrExportData,
    StreamHandle,
};

use super::SimDriver;
use super::log::Op;
use super::world::{Object, World, context, plausible_image};

impl Driver for SimDriver {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn init(&self) -> Result<(), DriverError> {
        self.call(Op::Init, |w, pid, note| w.init(pid, note))
    }

    fn device_count(&self) -> Result<u32, DriverError> {
        self.call(Op::DeviceCount, |w, pid, note| w.device_count(pid, note))
    }

    fn device_total_mem(&self, dev: DeviceOrdinal) -> Result<usize, DriverError> {
        self.call(Op::DeviceTotalMem, |w, pid, note| {
            w.device_total_mem(pid, note, dev)
        })
    }

    fn device_attribute(
        &self,
        dev: DeviceOrdinal,
        attr: DeviceAttribute,
    ) -> Result<i32, DriverError> {
        self.call(Op::DeviceAttribute, |w, pid, note| {
            w.device_attribute(pid, note, dev, attr)
        })
    }

    fn device_can_access_peer(
        &self,
        dev: DeviceOrdinal,
        peer: DeviceOrdinal,
    ) -> Result<bool, DriverError> {
        self.call(Op::DeviceCanAccessPeer, |w, pid, note| {
            w.device_can_access_peer(pid, note, dev, peer)
        })
    }

    fn ctx_enable_peer_access(
        &self,
        ctx: ContextHandle,
        peer: ContextHandle,
    ) -> Result<(), DriverError> {
        self.call(Op::CtxEnablePeerAccess, |w, pid, note| {
            w.ctx_enable_peer_access(pid, note, ctx, peer)
        })
    }

    fn primary_ctx_retain(&self, dev: DeviceOrdinal) -> Result<ContextHandle, DriverError> {
        self.call(Op::PrimaryCtxRetain, |w, pid, note| {
            w.primary_ctx_retain(pid, note, dev)
        })
    }

    unsafe fn primary_ctx_release(&self, dev: DeviceOrdinal) -> Result<(), DriverError> {
        self.call(Op::PrimaryCtxRelease, |w, pid, note| {
            w.primary_ctx_release(pid, note, dev)
        })
    }

    unsafe fn primary_ctx_reset(&self, dev: DeviceOrdinal) -> Result<(), DriverError> {
        self.call(Op::PrimaryCtxReset, |w, pid, note| {
            w.primary_ctx_reset(pid, note, dev)
        })
    }

    fn mem_alloc(&self, ctx: ContextHandle, bytes: usize) -> Result<DevicePtr, DriverError> {
        self.call(Op::MemAlloc, |w, pid, note| {
            w.mem_alloc(pid, note, ctx, bytes)
        })
    }

    fn mem_alloc_managed(
        &self,
        ctx: ContextHandle,
        bytes: usize,
        flags: u32,
    ) -> Result<DevicePtr, DriverError> {
        self.call(Op::MemAllocManaged, |w, pid, note| {
            w.mem_alloc_managed(pid, note, ctx, bytes, flags)
        })
    }

    unsafe fn mem_free(&self, ctx: ContextHandle, ptr: DevicePtr) -> Result<(), DriverError> {
        self.call(Op::MemFree, |w, pid, note| w.mem_free(pid, note, ctx, ptr))
    }

    fn mem_get_info(&self, ctx: ContextHandle) -> Result<MemInfo, DriverError> {
        self.call(Op::MemGetInfo, |w, pid, note| {
            w.mem_get_info(pid, note, ctx)
        })
    }

    fn mem_get_address_range(
        &self,
        ctx: ContextHandle,
        ptr: DevicePtr,
    ) -> Result<(DevicePtr, usize), DriverError> {
        self.call(Op::MemGetAddressRange, |w, pid, note| {
            w.mem_get_address_range(pid, note, ctx, ptr)
        })
    }

    unsafe fn memcpy_htod(
        &self,
        ctx: ContextHandle,
        dst: DevicePtr,
        src: &[u8],
    ) -> Result<(), DriverError> {
        self.copy_call(Op::MemcpyHtoD, ctx, dst, src.len(), |w, by| {
            // SAFETY: `Driver::memcpy_htod`'s contract: the destination is live memory of the
            // caller's that nothing else touches during the call.
            unsafe { w.write(by, dst.0, src) }
        })
    }

    unsafe fn memcpy_dtoh(
        &self,
        ctx: ContextHandle,
        dst: &mut [u8],
        src: DevicePtr,
    ) -> Result<(), DriverError> {
        let len = dst.len();
        self.copy_call(Op::MemcpyDtoH, ctx, src, len, |w, by| {
            // SAFETY: `Driver::memcpy_dtoh`'s contract: the source is live memory of the caller's
            // that nothing writes during the call.
            unsafe { w.read(by, src.0, dst) }
        })
    }

    fn stream_synchronize(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.call(Op::StreamSynchronize, |w, pid, note| {
            w.stream_synchronize(pid, note, ctx, stream)
        })
    }

    fn device_default_mem_pool(&self, dev: DeviceOrdinal) -> Result<MemPoolHandle, DriverError> {
        self.call(Op::DeviceGetDefaultMemPool, |w, pid, note| {
            w.device_default_mem_pool(pid, note, dev)
        })
    }

    fn mem_pool_create_limited(
        &self,
        ctx: ContextHandle,
        location: MemLocation,
        ipc: bool,
        max_size: usize,
    ) -> Result<MemPoolHandle, DriverError> {
        self.call(Op::MemPoolCreate, |w, pid, note| {
            note.bytes = (max_size > 0).then_some(max_size);
            w.mem_pool_create(pid, note, ctx, location, ipc, max_size)
        })
    }

    fn mem_pool_create_managed(
        &self,
        ctx: ContextHandle,
        preferred: Option<MemLocation>,
    ) -> Result<MemPoolHandle, DriverError> {
        self.call(Op::MemPoolCreate, |w, pid, note| {
            w.mem_pool_create_managed(pid, note, ctx, preferred)
        })
    }

    fn mem_pool_reset_high_water(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
    ) -> Result<(), DriverError> {
        self.call(Op::MemPoolSetAttribute, |w, pid, note| {
            w.mem_pool_reset_high_water(pid, note, ctx, pool)
        })
    }

    unsafe fn mem_pool_destroy(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
    ) -> Result<(), DriverError> {
        self.call(Op::MemPoolDestroy, |w, pid, note| {
            w.mem_pool_destroy(pid, note, ctx, pool)
        })
    }

    fn mem_pool_set_release_threshold(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
        bytes: u64,
    ) -> Result<(), DriverError> {
        self.call(Op::MemPoolSetAttribute, |w, pid, note| {
            w.mem_pool_set_release_threshold(pid, note, ctx, pool, bytes)
        })
    }

    fn mem_pool_trim_to(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
        keep: usize,
    ) -> Result<(), DriverError> {
        self.call(Op::MemPoolTrimTo, |w, pid, note| {
            w.mem_pool_trim_to(pid, note, ctx, pool, keep)
        })
    }

    fn mem_pool_usage(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
    ) -> Result<MemPoolUsage, DriverError> {
        self.call(Op::MemPoolGetAttribute, |w, pid, note| {
            w.mem_pool_usage(pid, note, ctx, pool)
        })
    }

    fn mem_alloc_from_pool_async(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<DevicePtr, DriverError> {
        self.call(Op::MemAllocFromPoolAsync, |w, pid, note| {
            w.pool_alloc_captured(pid, note, ctx, pool, bytes, stream)
        })
    }

    unsafe fn mem_free_async(
        &self,
        ctx: ContextHandle,
        ptr: DevicePtr,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.call(Op::MemFreeAsync, |w, pid, note| {
            w.pool_free_captured(pid, note, ctx, ptr, stream)
        })
    }

    unsafe fn memcpy_dtod(
        &self,
        ctx: ContextHandle,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
    ) -> Result<(), DriverError> {
        self.copy_call(Op::MemcpyDtoD, ctx, dst, bytes, |w, by| {
            let mut staging = vec![0u8; bytes];
            // SAFETY: `Driver::memcpy_dtod`'s contract: both ranges are live memory of the
            // caller's that nothing else writes during the call.
            unsafe {
                w.read(by, src.0, &mut staging)?;
                w.write(by, dst.0, &staging)
            }
        })
    }

    unsafe fn memset_d8(
        &self,
        ctx: ContextHandle,
        dst: DevicePtr,
        value: u8,
        bytes: usize,
    ) -> Result<(), DriverError> {
        self.copy_call(Op::MemsetD8, ctx, dst, bytes, |w, by| {
            // SAFETY: `Driver::memset_d8`'s contract: the range is live memory of the caller's
            // that nothing else uses during the call.
            unsafe { w.write(by, dst.0, &vec![value; bytes]) }
        })
    }

    fn mem_host_alloc(
        &self,
        ctx: ContextHandle,
        bytes: usize,
        flags: u32,
    ) -> Result<HostPtr, DriverError> {
        self.call(Op::MemHostAlloc, |w, pid, note| {
            w.mem_host_alloc(pid, note, ctx, bytes, flags)
        })
    }

    unsafe fn mem_free_host(&self, ctx: ContextHandle, ptr: HostPtr) -> Result<(), DriverError> {
        self.call(Op::MemFreeHost, |w, pid, note| {
            w.mem_free_host(pid, note, ctx, ptr)
        })
    }

    unsafe fn mem_host_register(
        &self,
        ctx: ContextHandle,
        ptr: HostPtr,
        bytes: usize,
        flags: u32,
    ) -> Result<(), DriverError> {
        self.call(Op::MemHostRegister, |w, pid, note| {
            w.mem_host_register(pid, note, ctx, ptr, bytes, flags)
        })
    }

    unsafe fn mem_host_unregister(
        &self,
        ctx: ContextHandle,
        ptr: HostPtr,
    ) -> Result<(), DriverError> {
        self.call(Op::MemHostUnregister, |w, pid, note| {
            w.mem_host_unregister(pid, note, ctx, ptr)
        })
    }

    fn mem_host_get_device_pointer(
        &self,
        ctx: ContextHandle,
        ptr: HostPtr,
    ) -> Result<DevicePtr, DriverError> {
        self.call(Op::MemHostGetDevicePointer, |w, pid, note| {
            w.mem_host_get_device_pointer(pid, note, ctx, ptr)
        })
    }

    fn stream_create(&self, ctx: ContextHandle, flags: u32) -> Result<StreamHandle, DriverError> {
        self.create_stream(Op::StreamCreate, ctx, flags, 0)
    }

    fn stream_create_with_priority(
        &self,
        ctx: ContextHandle,
        flags: u32,
        priority: i32,
    ) -> Result<StreamHandle, DriverError> {
        self.create_stream(Op::StreamCreateWithPriority, ctx, flags, priority)
    }

    fn stream_priority_range(&self, ctx: ContextHandle) -> Result<(i32, i32), DriverError> {
        self.call(Op::CtxGetStreamPriorityRange, |w, pid, note| {
            context(w, pid, ctx, note)?;
            Ok(w.priority_range())
        })
    }

    fn stream_priority(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
    ) -> Result<i32, DriverError> {
        self.call(Op::StreamGetPriority, |w, pid, note| {
            w.stream_priority(pid, note, ctx, stream)
        })
    }

    fn stream_query(&self, ctx: ContextHandle, stream: StreamHandle) -> Result<bool, DriverError> {
        self.call(Op::StreamQuery, |w, pid, note| {
            w.stream_query(pid, note, ctx, stream)
        })
    }

    fn stream_begin_capture(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
        mode: CaptureMode,
    ) -> Result<(), DriverError> {
        self.call(Op::StreamBeginCapture, |w, pid, note| {
            w.stream_begin_capture(pid, note, ctx, stream, mode)
        })
    }

    fn stream_end_capture(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
    ) -> Result<GraphHandle, DriverError> {
        self.call(Op::StreamEndCapture, |w, pid, note| {
            w.stream_end_capture(pid, note, ctx, stream)
        })
    }

    fn stream_capture_status(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
    ) -> Result<CaptureStatus, DriverError> {
        self.call(Op::StreamGetCaptureInfo, |w, pid, note| {
            w.stream_capture_status(pid, note, ctx, stream)
        })
    }

    fn thread_exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode, DriverError> {
        self.call(Op::ThreadExchangeStreamCaptureMode, |_, _, _| {
            Ok(World::thread_exchange_capture_mode(mode))
        })
    }

    fn graph_instantiate(
        &self,
        ctx: ContextHandle,
        graph: GraphHandle,
    ) -> Result<GraphExecHandle, DriverError> {
        self.call(Op::GraphInstantiate, |w, pid, note| {
            w.graph_instantiate(pid, note, ctx, graph)
        })
    }

    fn graph_launch(
        &self,
        ctx: ContextHandle,
        exec: GraphExecHandle,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.call(Op::GraphLaunch, |w, pid, note| {
            w.graph_launch(pid, note, ctx, exec, stream)
        })
    }

    unsafe fn graph_exec_destroy(
        &self,
        ctx: ContextHandle,
        exec: GraphExecHandle,
    ) -> Result<(), DriverError> {
        self.call(Op::GraphExecDestroy, |w, pid, note| {
            w.graph_exec_destroy(pid, note, ctx, exec)
        })
    }

    unsafe fn graph_destroy(
        &self,
        ctx: ContextHandle,
        graph: GraphHandle,
    ) -> Result<(), DriverError> {
        self.call(Op::GraphDestroy, |w, pid, note| {
            w.graph_destroy(pid, note, ctx, graph)
        })
    }

    fn event_record(
        &self,
        ctx: ContextHandle,
        event: EventHandle,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.call(Op::EventRecord, |w, pid, note| {
            w.event_record(pid, note, ctx, event, stream)
        })
    }

    fn stream_wait_event(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
        event: EventHandle,
    ) -> Result<(), DriverError> {
        self.call(Op::StreamWaitEvent, |w, pid, note| {
            w.stream_wait_event(pid, note, ctx, stream, event)
        })
    }

    fn event_query(&self, ctx: ContextHandle, event: EventHandle) -> Result<bool, DriverError> {
        self.call(Op::EventQuery, |w, pid, note| {
            w.event_query(pid, note, ctx, event)
        })
    }

    fn event_synchronize(&self, ctx: ContextHandle, event: EventHandle) -> Result<(), DriverError> {
        self.call(Op::EventSynchronize, |w, pid, note| {
            w.event_synchronize(pid, note, ctx, event)
        })
    }

    fn event_elapsed_time(
        &self,
        ctx: ContextHandle,
        start: EventHandle,
        end: EventHandle,
    ) -> Result<f32, DriverError> {
        self.call(Op::EventElapsedTime, |w, pid, note| {
            w.event_elapsed_time(pid, note, ctx, start, end)
        })
    }

    fn launch_host_func(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
        f: HostFn,
    ) -> Result<(), DriverError> {
        self.call(Op::LaunchHostFunc, |w, pid, note| {
            w.launch_host_func(pid, note, ctx, stream, f)
        })
    }

    fn stream_wait_value32(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u32,
        flags: u32,
    ) -> Result<(), DriverError> {
        self.call(Op::StreamWaitValue32, |w, pid, note| {
            w.stream_wait_value32(pid, note, ctx, stream, addr, value, flags)
        })
    }

    unsafe fn stream_write_value32(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u32,
    ) -> Result<(), DriverError> {
        self.call(Op::StreamWriteValue32, |w, pid, note| {
            w.stream_write_value32(pid, note, ctx, stream, addr, value)
        })
    }

    unsafe fn memcpy_htod_async(
        &self,
        ctx: ContextHandle,
        dst: DevicePtr,
        src: HostPtr,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.call(Op::MemcpyHtoDAsync, |w, pid, note| {
            // SAFETY: `Driver::memcpy_htod_async`'s contract keeps the source live.
            unsafe { w.memcpy_htod_async(pid, note, ctx, dst, src.0, bytes, stream) }
        })
    }

    unsafe fn memcpy_dtoh_async(
        &self,
        ctx: ContextHandle,
        dst: HostPtr,
        src: DevicePtr,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.call(Op::MemcpyDtoHAsync, |w, pid, note| {
            w.memcpy_dtoh_async(pid, note, ctx, dst.0, src, bytes, stream)
        })
    }

    unsafe fn memcpy_dtod_async(
        &self,
        ctx: ContextHandle,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.call(Op::MemcpyDtoDAsync, |w, pid, note| {
            w.memcpy_dtod_async(pid, note, ctx, dst, src, bytes, stream)
        })
    }

    unsafe fn memset_d8_async(
        &self,
        ctx: ContextHandle,
        dst: DevicePtr,
        value: u8,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.call(Op::MemsetD8Async, |w, pid, note| {
            w.memset_d8_async(pid, note, ctx, dst, value, bytes, stream)
        })
    }

    unsafe fn stream_destroy(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.destroy_object(Op::StreamDestroy, ctx, Object::Stream, stream.raw())
    }

    fn event_create(&self, ctx: ContextHandle, flags: u32) -> Result<EventHandle, DriverError> {
        let h = self.create_object(Op::EventCreate, ctx, Object::Event, flags & !0xf == 0)?;
        self.lock().add_event(self.pid, h, flags);
        Ok(crate::sim::made(EventHandle::from_raw, h))
    }

    unsafe fn event_destroy(
        &self,
        ctx: ContextHandle,
        event: EventHandle,
    ) -> Result<(), DriverError> {
        self.destroy_object(Op::EventDestroy, ctx, Object::Event, event.raw())
    }

    fn module_load_data(
        &self,
        ctx: ContextHandle,
        image: &[u8],
    ) -> Result<ModuleHandle, DriverError> {
        self.create_object(
            Op::ModuleLoadData,
            ctx,
            Object::Module,
            plausible_image(image),
        )
        .map(|h| crate::sim::made(ModuleHandle::from_raw, h))
    }

    unsafe fn module_unload(
        &self,
        ctx: ContextHandle,
        module: ModuleHandle,
    ) -> Result<(), DriverError> {
        self.destroy_object(Op::ModuleUnload, ctx, Object::Module, module.raw())
    }

    fn ipc_get_mem_handle(
        &self,
        ctx: ContextHandle,
        ptr: DevicePtr,
    ) -> Result<IpcMemHandle, DriverError> {
        self.call(Op::IpcGetMemHandle, |w, pid, note| {
            w.ipc_get_mem_handle(pid, note, ctx, ptr)
        })
    }

    fn ipc_open_mem_handle(
        &self,
        ctx: ContextHandle,
        handle: &IpcMemHandle,
    ) -> Result<DevicePtr, DriverError> {
        self.call(Op::IpcOpenMemHandle, |w, pid, note| {
            w.ipc_open_mem_handle(pid, note, ctx, handle)
        })
    }

    unsafe fn ipc_close_mem_handle(
        &self,
        ctx: ContextHandle,
        ptr: DevicePtr,
    ) -> Result<(), DriverError> {
        self.call(Op::IpcCloseMemHandle, |w, pid, note| {
            w.ipc_close_mem_handle(pid, note, ctx, ptr)
        })
    }

    #[cfg(unix)]
    fn mem_pool_export_fd(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
    ) -> Result<OwnedFd, DriverError> {
        self.call(Op::MemPoolExportToShareableHandle, |w, pid, note| {
            w.mem_pool_export_fd(pid, note, ctx, pool)
        })
    }

    #[cfg(unix)]
    fn mem_pool_import_fd(
        &self,
        ctx: ContextHandle,
        fd: BorrowedFd<'_>,
    ) -> Result<MemPoolHandle, DriverError> {
        self.call(Op::MemPoolImportFromShareableHandle, |w, pid, note| {
            w.mem_pool_import_fd(pid, note, ctx, fd)
        })
    }

    fn mem_pool_export_pointer(
        &self,
        ctx: ContextHandle,
        ptr: DevicePtr,
    ) -> Result<PoolPtrExportData, DriverError> {
        self.call(Op::MemPoolExportPointer, |w, pid, note| {
            w.mem_pool_export_pointer(pid, note, ctx, ptr)
        })
    }

    fn mem_pool_import_pointer(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
        data: &PoolPtrExportData,
    ) -> Result<DevicePtr, DriverError> {
        self.call(Op::MemPoolImportPointer, |w, pid, note| {
            w.mem_pool_import_pointer(pid, note, ctx, pool, data)
        })
    }

    fn mem_pool_can_access(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
        dev: DeviceOrdinal,
    ) -> Result<bool, DriverError> {
        self.call(Op::MemPoolGetAccess, |w, pid, note| {
            w.mem_pool_can_access(pid, note, ctx, pool, dev)
        })
    }

    fn mem_pool_grant_access(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
        dev: DeviceOrdinal,
    ) -> Result<(), DriverError> {
        self.call(Op::MemPoolSetAccess, |w, pid, note| {
            w.mem_pool_grant_access(pid, note, ctx, pool, dev)
        })
    }

    fn mem_vmm_granularity(&self, dev: DeviceOrdinal) -> Result<usize, DriverError> {
        self.call(Op::MemGetAllocationGranularity, |w, pid, note| {
            w.mem_vmm_granularity(pid, note, dev)
        })
    }

    fn mem_address_reserve(
        &self,
        ctx: ContextHandle,
        size: usize,
    ) -> Result<DevicePtr, DriverError> {
        self.call(Op::MemAddressReserve, |w, pid, note| {
            w.mem_address_reserve(pid, note, ctx, size)
        })
    }

    unsafe fn mem_address_free(
        &self,
        ctx: ContextHandle,
        ptr: DevicePtr,
        size: usize,
    ) -> Result<(), DriverError> {
        self.call(Op::MemAddressFree, |w, pid, note| {
            w.mem_address_free(pid, note, ctx, ptr, size)
        })
    }

    fn mem_create(
        &self,
        ctx: ContextHandle,
        dev: DeviceOrdinal,
        size: usize,
        shareable: bool,
    ) -> Result<PhysHandle, DriverError> {
        self.call(Op::MemCreate, |w, pid, note| {
            w.mem_create(pid, note, ctx, dev, size, shareable)
        })
    }

    #[cfg(unix)]
    fn mem_export_fd(
        &self,
        ctx: ContextHandle,
        handle: PhysHandle,
    ) -> Result<OwnedFd, DriverError> {
        self.call(Op::MemExportToShareableHandle, |w, pid, note| {
            w.mem_export_fd(pid, note, ctx, handle)
        })
    }

    #[cfg(unix)]
    fn mem_import_fd(
        &self,
        ctx: ContextHandle,
        fd: BorrowedFd<'_>,
    ) -> Result<PhysHandle, DriverError> {
        self.call(Op::MemImportFromShareableHandle, |w, pid, note| {
            w.mem_import_fd(pid, note, ctx, fd)
        })
    }

    unsafe fn mem_release(
        &self,
        ctx: ContextHandle,
        handle: PhysHandle,
    ) -> Result<(), DriverError> {
        self.call(Op::MemRelease, |w, pid, note| {
            w.mem_release(pid, note, ctx, handle)
        })
    }

    unsafe fn mem_map(
        &self,
        ctx: ContextHandle,
        ptr: DevicePtr,
        size: usize,
        handle: PhysHandle,
    ) -> Result<(), DriverError> {
        self.call(Op::MemMap, |w, pid, note| {
            w.mem_map(pid, note, ctx, ptr, size, handle)
        })
    }

    fn mem_set_access(
        &self,
        ctx: ContextHandle,
        ptr: DevicePtr,
        size: usize,
        dev: DeviceOrdinal,
    ) -> Result<(), DriverError> {
        self.call(Op::MemSetAccess, |w, pid, note| {
            w.mem_set_access(pid, note, ctx, ptr, size, dev)
        })
    }

    unsafe fn mem_unmap(
        &self,
        ctx: ContextHandle,
        ptr: DevicePtr,
        size: usize,
    ) -> Result<(), DriverError> {
        self.call(Op::MemUnmap, |w, pid, note| {
            w.mem_unmap(pid, note, ctx, ptr, size)
        })
    }
}
