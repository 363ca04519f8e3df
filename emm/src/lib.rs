//! emm: external memory management for CUDA runtimes, after Numba's NBEP 7.
//!
//! A host runtime (an array library, a JIT, a Python extension) embeds emm; one memory manager
//! owns all memory of each context; frees are deferred and batched; the manager is chosen once,
//! in code or by `EMM_MEMORY_MANAGER`.
//!
//! ```text
//! host runtime ──> Context::memalloc(bytes)
//!                    └─> MemoryManager::memalloc        (the selected manager)
//!                          └─> Driver::mem_alloc         on out-of-memory: flush, retry once
//!                  <── MemoryPointer (clones and views share the allocation)
//! last clone drops ─> Free::Device queued on the manager's PendingDeallocs
//!                       flushed when count > 10 or bytes > 0.2 × total memory,
//!                       unless a DeferCleanup guard is alive
//! ```
//!
//! | item | role |
//! | --- | --- |
//! | [`Runtime`] | the driver, the manager choice (in code or `EMM_MEMORY_MANAGER`), one [`Context`] per device, device reset |
//! | [`Context`] | a device's primary context: memory through its manager, copies, streams, events, modules, IPC, `defer_cleanup`, reset in Numba's order |
//! | [`MemoryManager`] | the plugin interface (all NBEP 7 members) |
//! | [`DeviceAllocator`] + [`HostOnly`] | a device-only plugin, completed by the [`HostLayer`] (pinned and mapped memory, its queue, reset, `defer_cleanup`) |
//! | [`DefaultManager`] | emm's own manager, `HostOnly<DriverAllocator>` |
//! | [`MemoryPointer`], [`MappedMemory`], [`PinnedMemory`] | memory; released through its owner when the last handle drops |
//! | [`PendingDeallocs`] / [`DeferCleanup`] | deferred deallocation and its suspension |
//! | [`IpcHandle`] | export, transport as bytes, open directly or staged, close |
//! | [`PoolExport`] | an IPC-enabled stream-ordered pool (`async-pool-ipc`) on its way to another process, which imports it with [`Runtime::import_pool`] |
//!
//! emm never names cudarc or the simulator: it talks to an `Arc<dyn Driver>`
//! ([`driver_sys::Driver`]).
#![deny(unsafe_code)]

mod adaptors;
mod async_pool;
mod config;
mod context;
mod default;
mod error;
mod host;
mod ipc;
mod liveness;
mod manager;
mod objects;
mod pending;
mod pinned_pool;
mod pointer;
mod pool;
mod pool_ipc;
pub mod replay;
mod runtime;
mod sync;
mod tracker;

pub use adaptors::{Adapted, Adaptor, KindUsage, LOG_HEADER, MemoryKind, Usage};
pub use async_pool::{
    ASYNC_POOL_IPC_MANAGER, ASYNC_POOL_MANAGER, AsyncPoolAllocator, AsyncPoolManager,
};
pub use config::{
    DeallocConfig, ENV_MAX_PENDING_COUNT, ENV_MAX_PENDING_RATIO, ENV_MEMORY_ADAPTORS,
    ENV_MEMORY_MANAGER, ENV_PINNED_HOST_POOL, adaptors_from_lookup, manager_name_from_env,
    manager_name_from_lookup, parse_bytes, pinned_pool_from_lookup,
};
pub use context::Context;
pub use default::{DEFAULT_MANAGER, DefaultManager, DriverAllocator};
pub use driver_sys;
pub use error::EmmError;
pub use host::{
    AllocationKind, DeviceAllocator, HostLayer, HostMemory, HostOnly, HostOwner, HostReleaseFn,
    MappedMemory, PinnableBuffer, PinnedMemory,
};
pub use ipc::{DeviceIdentity, IpcHandle, IpcMemory};
pub use liveness::{ContextLiveness, LiveGuard};
pub use manager::{
    FnFactory, INTERFACE_VERSION, ManagerContext, ManagerFactory, MemoryManager,
    check_interface_version,
};
pub use objects::{Event, Module, Stream};
pub use pending::{DeferCleanup, Free, PendingDeallocs};
pub use pinned_pool::PinnedPoolConfig;
pub use pointer::{MemoryInfo, MemoryPointer, ReleaseFn, ReleaseHook};
pub use pool::{
    MAX_SMALL, POOL_ALIGNMENT, POOL_MANAGER, PoolAllocator, PoolConfig, PoolManager, PoolReport,
    PoolStats,
};
pub use pool_ipc::{POOL_DESCRIPTOR_LEN, PoolExport, PoolId};
pub use runtime::{Runtime, RuntimeBuilder};
