//! [`MockDriver`]: the mockall mock of [`Driver`].

use driver_sys::{
    ContextHandle, DeviceAttribute, DeviceOrdinal, DevicePtr, Driver, DriverError, MemInfo,
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
        unsafe fn memcpy_dtoh(&self, ctx: ContextHandle, dst: &mut [u8], src: DevicePtr) -> Result<(), DriverError>;
    }
}

impl std::fmt::Debug for MockDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MockDriver")
    }
}
