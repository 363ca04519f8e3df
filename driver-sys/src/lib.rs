//! The driver boundary of emm.
//!
//! This crate owns three things, and nothing else:
//!
//! | item | what it is |
//! | --- | --- |
//! | [`Driver`] | an object-safe trait with one method per CUDA driver call emm makes |
//! | [`DevicePtr`], [`HostPtr`], [`ContextHandle`], [`DeviceOrdinal`] | handle newtypes; pointers print as hex |
//! | [`DriverError`] / [`ErrorKind`] | an error that keeps the raw `CUresult` and classifies it |
//! | [`CudaDriver`] (feature `cuda`, on by default) | the real driver over cudarc's `sys` layer |
//!
//! # Contract
//!
//! - The trait is **thin**: no validation, no bookkeeping. Validation is the caller's job
//!   (`emm` does it); implementations return the error the CUDA driver itself would return.
//! - **Every call names its context.** There is no hidden "current context" crossing the trait;
//!   [`CudaDriver`] makes the named context current for the duration of the call and restores
//!   what the thread had before.
//! - Calls whose misuse could touch memory the caller does not own (frees, copies, context
//!   resets) are `unsafe fn`, each with a `# Safety` list.
//! - Errors are values, never panics: a machine with no libcuda, or no device, gets an ordinary
//!   [`ErrorKind::DriverUnavailable`] / [`ErrorKind::NoDevice`] error with a message that says
//!   what to do.
#![deny(unsafe_code)]

mod calls;
mod driver;
mod error;
mod handles;

#[cfg(feature = "cuda")]
mod cuda;

#[cfg(feature = "cuda")]
pub use cuda::CudaDriver;
pub use driver::{
    CaptureMode, CaptureStatus, DeviceAttribute, Driver, HostFn, MemInfo, MemLocation,
    MemPoolUsage, event_flags, host_alloc, host_register, mem_attach, stream_flags, wait_value,
};
pub use error::{DriverError, ErrorKind, code};
pub use handles::{
    ContextHandle, DeviceOrdinal, DevicePtr, EventHandle, GraphExecHandle, GraphHandle, HostPtr,
    IpcMemHandle, MemPoolHandle, ModuleHandle, PhysHandle, PoolPtrExportData, StreamHandle,
};
