//! Tests of the real driver alone.

use integration::Target;
use libtest_mimic::Failed;

/// emm names its context in every driver call and makes it current only for the call: a host
/// runtime's thread state is the same before and after, whether it had no context current or
/// one of its own.
#[cfg(feature = "cuda")]
pub fn calls_leave_the_current_context_alone(target: Target) -> Result<(), Failed> {
    use std::sync::Arc;

    use driver_sys::{CudaDriver, DeviceOrdinal, Driver};

    assert_eq!(target, Target::Cuda);
    // A fresh thread starts with no current context.
    std::thread::scope(|s| {
        s.spawn(|| -> Result<(), Failed> {
            let driver = Arc::new(CudaDriver::load()?);
            ensure_eq!(driver.current_context()?, None);
            let runtime = emm::Runtime::builder(driver.clone()).ignore_env().build()?;
            let ctx = runtime.context(0)?;
            let mem = ctx.to_device(&[1u8; 32])?;
            ensure_eq!(
                driver.current_context()?,
                None,
                "emm left a context current"
            );
            // The host runtime makes the context current itself: emm keeps it so.
            let handle = driver.primary_ctx_retain(DeviceOrdinal(0))?;
            ensure_eq!(handle, ctx.handle());
            driver.push_current(handle)?;
            let mut back = [0u8; 32];
            ctx.copy_to_host(&mut back, &mem)?;
            ensure_eq!(driver.current_context()?, Some(handle));
            ensure_eq!(driver.pop_current()?, Some(handle));
            // SAFETY: matches the retain above; emm still holds its own reference.
            #[allow(unsafe_code)]
            unsafe {
                driver.primary_ctx_release(DeviceOrdinal(0))?
            };
            Ok(())
        })
        .join()
        .map_err(|_| Failed::from("the test thread panicked"))?
    })
}

/// Without the `cuda` feature there is no real driver to test.
#[cfg(not(feature = "cuda"))]
pub fn calls_leave_the_current_context_alone(_target: Target) -> Result<(), Failed> {
    Err("integration was built without its `cuda` feature".into())
}
