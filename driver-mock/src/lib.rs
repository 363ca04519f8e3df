//! Test doubles for the emm [`Driver`](driver_sys::Driver) trait.
//!
//! - [`SimDriver`]: a deterministic simulated CUDA system. Devices with configurable memory and
//!   capabilities, primary contexts with reference counts, an address space with real backing
//!   bytes (copies move data), allocation alignment and out-of-memory as the real driver has
//!   them, the real driver's error codes for misuse, a call log, a leak report and scripted
//!   faults. The same calls give the same addresses, errors and log, every run.
//! - `MockDriver` (feature `mock`, off by default): a mockall expectation mock of the trait,
//!   for call-sequence tests ("exactly one `mem_alloc` per `memalloc`").
//!
//! The simulator is opt-in: nothing in emm falls back to it. Tests and examples choose it.

#[cfg(feature = "mock")]
mod mock;
mod sim;

#[cfg(feature = "mock")]
pub use mock::MockDriver;
pub use sim::{
    CallHook, CallRecord, DEFAULT_ALIGNMENT, Fault, LeakReport, Op, PAGE_SIZE, SMALL_MAX,
    SimConfig, SimDeviceConfig, SimDriver,
};
pub use sim::{failed_releases_on_this_thread, frees_while_imported_on_this_thread};
