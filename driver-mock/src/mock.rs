//! [`MockDriver`]: the mockall mock of [`Driver`](driver_sys::Driver), generated here from
//! driver-sys's table of driver calls ([`driver_calls!`](driver_sys::driver_calls)), so a new
//! driver call needs no second signature. It is built in this crate (feature `mock`), not
//! beside the trait: every build of emm waits for driver-sys, and the mock's generated code
//! is most of what building it would take.
//!
//! An expectation mock: set `expect_*` calls, hand it to emm as `Arc<dyn Driver>`, and unmet or
//! unexpected calls fail the test.
// The mock's generated expectation types have no `Debug`, which the crate's lints ask of
// every type.
#![allow(missing_debug_implementations)]

use driver_sys::{ContextHandle, DeviceOrdinal, DriverError, MemPoolHandle};

/// The table's callback that declares the mock: every method of the table, plus `name` and
/// the trait's provided `mem_pool_create`, which a test may expect as any other call.
macro_rules! declare_mock {
    (ops [$($ops:tt)*] methods [$(
        $(#[$doc:meta])*
        $(@[$attr:meta])*
        $([$unsafe:ident])? fn $name:ident $(<$lt:lifetime>)? ($($arg:ident : [$($ty:tt)*]),*) -> [$($ret:tt)*] => $op:ident $([$sim:ident])?;
    )*]) => {
        mockall::mock! {
            /// The mockall mock of [`Driver`](driver_sys::Driver).
            pub Driver {}

            impl driver_sys::Driver for Driver {
                fn name(&self) -> &'static str;
                $(
                    $(#[$attr])*
                    $($unsafe)? fn $name $(<$lt>)? (&self, $($arg: $($ty)*),*) -> Result<$($ret)*, DriverError>;
                )*
                fn mem_pool_create(
                    &self,
                    ctx: ContextHandle,
                    dev: DeviceOrdinal,
                    ipc: bool,
                ) -> Result<MemPoolHandle, DriverError>;
            }
        }
    };
}

driver_sys::driver_calls!(declare_mock);

impl std::fmt::Debug for MockDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MockDriver")
    }
}
