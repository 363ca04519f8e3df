//! [`MockDriver`]: the mockall mock of [`Driver`].

use std::os::fd::{BorrowedFd, OwnedFd};

use driver_sys::{
    ContextHandle, DeviceAttribute, DeviceOrdinal, DevicePtr, Driver, DriverError, EventHandle,
    HostPtr, IpcMemHandle, MemInfo, MemPoolHandle, MemPoolUsage, ModuleHandle, PoolPtrExportData,
    StreamHandle,
};

mockall::mock! {
    /// An expectation mock of [`Driver`]: set `expect_*` calls, hand it to emm as
    /// `Arc<dyn Driver>`, and unmet or unexpected calls fail the test.
    pub Driver {}

    impl Driver for Driver {
        fn name(&self) -> &'static str;
        fn init(&self) -> Result<(), DriverError>;
        fn device_count(&self) -> Result<u32, DriverError>;
        fn device_total_mem(&self, dev: DeviceOrdinal) -> Result<usize, DriverError>;
        fn device_attribute(&self, dev: DeviceOrdinal, attr: DeviceAttribute) -> Result<i32, DriverError>;
        fn primary_ctx_retain(&self, dev: DeviceOrdinal) -> Result<ContextHandle, DriverError>;
        unsafe fn primary_ctx_release(&self, dev: DeviceOrdinal) -> Result<(), DriverError>;
        unsafe fn primary_ctx_reset(&self, dev: DeviceOrdinal) -> Result<(), DriverError>;
        fn mem_alloc(&self, ctx: ContextHandle, bytes: usize) -> Result<DevicePtr, DriverError>;
        unsafe fn mem_free(&self, ctx: ContextHandle, ptr: DevicePtr) -> Result<(), DriverError>;
        fn mem_get_info(&self, ctx: ContextHandle) -> Result<MemInfo, DriverError>;
        fn mem_get_address_range(&self, ctx: ContextHandle, ptr: DevicePtr) -> Result<(DevicePtr, usize), DriverError>;
        unsafe fn memcpy_htod(&self, ctx: ContextHandle, dst: DevicePtr, src: &[u8]) -> Result<(), DriverError>;
        unsafe fn memcpy_dtod(&self, ctx: ContextHandle, dst: DevicePtr, src: DevicePtr, bytes: usize) -> Result<(), DriverError>;
        unsafe fn memset_d8(&self, ctx: ContextHandle, dst: DevicePtr, value: u8, bytes: usize) -> Result<(), DriverError>;
        fn mem_host_alloc(&self, ctx: ContextHandle, bytes: usize, flags: u32) -> Result<HostPtr, DriverError>;
        unsafe fn mem_free_host(&self, ctx: ContextHandle, ptr: HostPtr) -> Result<(), DriverError>;
        unsafe fn mem_host_register(&self, ctx: ContextHandle, ptr: HostPtr, bytes: usize, flags: u32) -> Result<(), DriverError>;
        unsafe fn mem_host_unregister(&self, ctx: ContextHandle, ptr: HostPtr) -> Result<(), DriverError>;
        fn mem_host_get_device_pointer(&self, ctx: ContextHandle, ptr: HostPtr) -> Result<DevicePtr, DriverError>;
        fn stream_create(&self, ctx: ContextHandle, flags: u32) -> Result<StreamHandle, DriverError>;
        unsafe fn stream_destroy(&self, ctx: ContextHandle, stream: StreamHandle) -> Result<(), DriverError>;
        fn event_create(&self, ctx: ContextHandle, flags: u32) -> Result<EventHandle, DriverError>;
        unsafe fn event_destroy(&self, ctx: ContextHandle, event: EventHandle) -> Result<(), DriverError>;
        fn module_load_data(&self, ctx: ContextHandle, image: &[u8]) -> Result<ModuleHandle, DriverError>;
        unsafe fn module_unload(&self, ctx: ContextHandle, module: ModuleHandle) -> Result<(), DriverError>;
        fn ipc_get_mem_handle(&self, ctx: ContextHandle, ptr: DevicePtr) -> Result<IpcMemHandle, DriverError>;
        fn ipc_open_mem_handle(&self, ctx: ContextHandle, handle: &IpcMemHandle) -> Result<DevicePtr, DriverError>;
        unsafe fn ipc_close_mem_handle(&self, ctx: ContextHandle, ptr: DevicePtr) -> Result<(), DriverError>;
        fn device_can_access_peer(&self, dev: DeviceOrdinal, peer: DeviceOrdinal) -> Result<bool, DriverError>;
        unsafe fn memcpy_dtoh(&self, ctx: ContextHandle, dst: &mut [u8], src: DevicePtr) -> Result<(), DriverError>;
        fn stream_synchronize(&self, ctx: ContextHandle, stream: StreamHandle) -> Result<(), DriverError>;
        fn device_default_mem_pool(&self, dev: DeviceOrdinal) -> Result<MemPoolHandle, DriverError>;
        fn mem_pool_create(&self, ctx: ContextHandle, dev: DeviceOrdinal, ipc: bool) -> Result<MemPoolHandle, DriverError>;
        unsafe fn mem_pool_destroy(&self, ctx: ContextHandle, pool: MemPoolHandle) -> Result<(), DriverError>;
        fn mem_pool_set_release_threshold(&self, ctx: ContextHandle, pool: MemPoolHandle, bytes: u64) -> Result<(), DriverError>;
        fn mem_pool_trim_to(&self, ctx: ContextHandle, pool: MemPoolHandle, keep: usize) -> Result<(), DriverError>;
        fn mem_pool_usage(&self, ctx: ContextHandle, pool: MemPoolHandle) -> Result<MemPoolUsage, DriverError>;
        fn mem_alloc_from_pool_async(&self, ctx: ContextHandle, pool: MemPoolHandle, bytes: usize, stream: StreamHandle) -> Result<DevicePtr, DriverError>;
        unsafe fn mem_free_async(&self, ctx: ContextHandle, ptr: DevicePtr, stream: StreamHandle) -> Result<(), DriverError>;
        fn mem_pool_export_fd(&self, ctx: ContextHandle, pool: MemPoolHandle) -> Result<OwnedFd, DriverError>;
        fn mem_pool_import_fd<'a>(&self, ctx: ContextHandle, fd: BorrowedFd<'a>) -> Result<MemPoolHandle, DriverError>;
        fn mem_pool_export_pointer(&self, ctx: ContextHandle, ptr: DevicePtr) -> Result<PoolPtrExportData, DriverError>;
        fn mem_pool_import_pointer(&self, ctx: ContextHandle, pool: MemPoolHandle, data: &PoolPtrExportData) -> Result<DevicePtr, DriverError>;
        fn mem_pool_can_access(&self, ctx: ContextHandle, pool: MemPoolHandle, dev: DeviceOrdinal) -> Result<bool, DriverError>;
        fn mem_pool_grant_access(&self, ctx: ContextHandle, pool: MemPoolHandle, dev: DeviceOrdinal) -> Result<(), DriverError>;
    }
}

impl std::fmt::Debug for MockDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MockDriver")
    }
}
