//! Layer 4, the shipped managers, each a [`DeviceAllocator`](crate::host::DeviceAllocator)
//! under the host layer:
//!
//! | module | `EMM_MEMORY_MANAGER` | device memory |
//! | --- | --- | --- |
//! | `default` | `default` | `cuMemAlloc` per allocation, deferred `cuMemFree` ([`DefaultManager`]) |
//! | `pool` | `pool`, `vmm-pool` | chunks carved by size-class shards and a coalescing arena ([`PoolManager`]); `vmm-pool` maps its chunks side by side in one address reservation |
//! | `async_pool` | `async-pool`, `async-pool-ipc`, `async-pool-managed` | the driver's stream-ordered pool ([`AsyncPoolManager`]), optionally exported to other processes, or of managed memory |
//!
//! How each orders memory allocated on a stream (`memalloc_on`) is its
//! [`StreamOrdering`](crate::contract::StreamOrdering): `default` fences the free, `pool` keeps an arena
//! per stream, the `async-pool` managers leave it to the driver. `emm/IMPLEMENTATION.md`
//! explains the pool's machinery.

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
