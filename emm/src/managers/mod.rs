//! Layer 4, the shipped managers, each a [`DeviceAllocator`](crate::host::DeviceAllocator)
//! under the host layer:
//!
//! | module | `EMM_MEMORY_MANAGER` | device memory |
//! | --- | --- | --- |
//! | `default` | `default` | `cuMemAlloc` per allocation, deferred `cuMemFree` ([`DefaultManager`]) |
//! | `pool` | `pool` | chunks carved by size-class shards and a coalescing arena ([`PoolManager`]) |
//! | `async_pool` | `async-pool`, `async-pool-ipc` | the driver's stream-ordered pool ([`AsyncPoolManager`]), optionally exported to other processes |
//!
//! None of them is stream-aware yet: memory is allocated and freed on the legacy default
//! stream (`async-pool`) or returned to the pool at once when its last pointer drops (`pool`),
//! so work on other streams must be complete before the memory is dropped.

pub(crate) mod async_pool;
pub(crate) mod default;
pub(crate) mod pool;

pub use async_pool::{
    ASYNC_POOL_IPC_MANAGER, ASYNC_POOL_MANAGED_MANAGER, ASYNC_POOL_MANAGER, AsyncPoolAllocator,
    AsyncPoolManager,
};
pub use default::{DEFAULT_MANAGER, DefaultManager, DriverAllocator};
pub use pool::{
    MAX_SMALL, POOL_ALIGNMENT, POOL_MANAGER, PoolAllocator, PoolConfig, PoolManager,
    VMM_POOL_MANAGER,
};
