//! [`MockDriver`]: the mockall mock of [`Driver`](driver_sys::Driver), generated from the trait
//! itself (`#[automock]` in driver-sys, feature `mock`), so a new driver call needs no second
//! signature here.
//!
//! An expectation mock: set `expect_*` calls, hand it to emm as `Arc<dyn Driver>`, and unmet or
//! unexpected calls fail the test.

pub use driver_sys::MockDriver;
