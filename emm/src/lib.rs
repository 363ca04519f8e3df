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
//! | [`MemoryManager`](contract::MemoryManager) | the plugin interface (all NBEP 7 members) |
//! | [`DeviceAllocator`](plugin::DeviceAllocator) + [`HostOnly`](plugin::HostOnly) | a device-only plugin, completed by the [`HostLayer`](plugin::HostLayer) (pinned and mapped memory, its queue, reset, `defer_cleanup`) |
//! | [`DefaultManager`](plugin::DefaultManager) | emm's own manager, `HostOnly<DriverAllocator>` |
//! | [`MemoryPointer`], [`MappedMemory`], [`PinnedMemory`] | memory; released through its owner when the last handle drops |
//! | [`PendingDeallocs`](plugin::PendingDeallocs) / [`DeferCleanup`](plugin::DeferCleanup) | deferred deallocation and its suspension |
//! | [`IpcHandle`] | export, transport as bytes, open directly or staged, close |
//! | [`PoolExport`](contract::PoolExport) | an IPC-enabled stream-ordered pool (`async-pool-ipc`) on its way to another process, which imports it with [`Runtime::import_pool`] |
//! | [`SleepOptions`] / [`Context::sleep`] / [`Context::wake`] | `vmm-pool`'s physical memory given back while every address stays valid: each live allocation kept, offloaded to host memory, or discarded, by tag |
//! | [`MappedExport`](contract::MappedExport) | an allocation of `vmm-pool` as file descriptors of its physical memory, on its way to another process, which maps it with [`Context::open_mapped`] |
//!
//! emm never names cudarc or the simulator: it talks to an `Arc<dyn Driver>`
//! ([`driver_sys::Driver`]).
//!
//! # Layers
//!
//! Each module is a layer; a layer imports only the layers below it (a test,
//! `emm/tests/source_checks.rs`, keeps it so: `crate::`, `$crate::` and `super::` paths
//! alike). `ARCHITECTURE.md` at the repository root has the
//! picture and the life of one allocation.
//!
//! | layer | module | what it holds |
//! | --- | --- | --- |
//! | 0 | `clock`, `error`, `sync`, `size_class`, `slab`, `lines`, `thread_slots`, `units`, `test_config` | the time-stamp counter the pools' histories stamp events with; [`EmmError`]; the loom shim, the spin lock and the biased lock of the pools' shards; the size classes, the slab the allocation table and the arena name entries in, lists on cache lines of their own, the dense per-thread indices both pools use, byte sizes, the property tests' settings |
//! | 1 | `memory` | memory objects and deallocation: pointers, host memory, the pending queue and its policy, `defer_cleanup`, liveness |
//! | 2 | [`contract`] | the plugin interface: [`MemoryManager`](contract::MemoryManager), its factory and [`ManagerContext`](contract::ManagerContext), the data it returns |
//! | 3 | `host` | the host layer: [`HostLayer`](plugin::HostLayer), [`DeviceAllocator`](plugin::DeviceAllocator) + [`HostOnly`](plugin::HostOnly), Numba's allocation table, the pinned host pool |
//! | 4 | `managers`, `adaptors` | `default`, `pool`, `async-pool`; `stats`, `limit`, `log`, `trace` |
//! | 5 | `ipc`, `objects`, `resources` | opening IPC handles, imported pools, pool transfer; streams, events, modules; cuda.core's memory resources |
//! | 6 | `runtime` | [`Runtime`], [`Context`], configuration from the environment |
//! | 7 | [`replay`] | replaying an allocation log against a context |
//! | 8 | `loom_models` | loom models of the public API: test code of the loom build only |
//!
//! The layers' modules are the crate's own, except `contract` (the plugin interface) and
//! `replay`. The crate root re-exports what an embedder uses (about thirty names); the
//! building blocks of managers are in [`plugin`], the finer stream types in [`streams`], and
//! what emm's tests and tools reach beneath the API in [`internals`].
#![deny(unsafe_code)]

// Layer 0: foundations.
mod clock;
mod error;
mod lines;
mod size_class;
mod slab;
mod sync;
#[cfg(test)]
mod test_config;
mod thread_slots;
mod units;

// Layer 1.
pub(crate) mod memory;
// Layer 2.
pub mod contract;
// Layer 3.
pub(crate) mod host;
// Layer 4.
pub(crate) mod adaptors;
pub(crate) mod managers;
// Layer 5.
pub(crate) mod ipc;
mod objects;
pub(crate) mod resources;
// Layer 6.
pub(crate) mod runtime;
// Layer 7.
pub mod replay;

// Above every layer, in the loom build only: loom models of the public API, written against
// `emm::` as an embedder's code is.
#[cfg(all(test, emm_loom))]
extern crate self as emm;
#[cfg(all(test, emm_loom))]
mod loom_models;

pub use driver_sys;
pub use error::{EmmError, LiveByTag, OutOfMemoryReport};

pub use adaptors::Adaptor;
pub use contract::{
    IpcHandle, MemoryInfo, MemorySnapshot, PinnedPoolConfig, PoolStats, SleepChoice, SleepOptions,
    Tag,
};
#[cfg(unix)]
pub use ipc::{PeerPolicy, bind_owner_only};
pub use managers::PoolConfig;
pub use memory::{
    HostAllocFlags, HostMemory, ManagedMemory, MappedMemory, MemoryPointer, PinnableBuffer,
    PinnedMemory,
};
pub use objects::{Event, InFlight, Module, Stream};
pub use resources::{
    DeviceMemoryResource, DeviceMemoryResourceOptions, ManagedMemoryResource,
    ManagedMemoryResourceOptions, PinnedMemoryResource, PinnedMemoryResourceOptions,
};
pub use runtime::context::Context;
pub use runtime::graphs::{Graph, GraphPool, GraphPoolStats};
pub use runtime::{Runtime, RuntimeBuilder};

/// The building blocks of memory managers, for a host runtime that writes or composes its
/// own (the plugin interface itself is [`contract`]): the shipped managers, their names and
/// allocators; the host layer a manager is made of ([`HostOnly`](plugin::HostOnly) over a
/// [`DeviceAllocator`](plugin::DeviceAllocator)); release hooks; the deferred-deallocation
/// queue; and the adaptors' wrapper.
pub mod plugin {
    pub use crate::adaptors::{Adapted, LOG_HEADER};
    pub use crate::host::{
        AllocationKind, DeviceAllocator, DeviceExports, DeviceHoldings, DeviceRecords,
        DeviceSleeper, HostLayer, HostOnly,
    };
    pub use crate::managers::{
        ASYNC_POOL_IPC_MANAGER, ASYNC_POOL_MANAGED_MANAGER, ASYNC_POOL_MANAGER, AsyncPoolAllocator,
        AsyncPoolManager, DEFAULT_MANAGER, DefaultManager, DriverAllocator, MAX_SMALL,
        POOL_ALIGNMENT, POOL_MANAGER, PoolAllocator, PoolManager, VMM_POOL_MANAGER,
    };
    pub use crate::memory::{
        ContextLiveness, DeallocConfig, DeferCleanup, Free, HostOwner, HostReleaseHook,
        PendingDeallocs, ReleaseFn, ReleaseHook,
    };
}

/// What streams and the memory ordered on them are made of, beyond [`Stream`] and
/// [`Event`]: a stream's kind, the trait of what memory can be ordered on, a host
/// function's panic count, and the synchronising guard.
pub mod streams {
    pub use crate::memory::{OrderedOn, StreamUse};
    pub use crate::objects::{AutoSynchronize, StreamKind, host_function_panics};
}

/// What emm's own tests, tools and the Python package reach beneath the embedding API:
/// configuration parsing (`config`), whether a capture pool may be open anywhere in the
/// process, whether the pools' shards are entered without a lock, and two memory types of the
/// host layer's internals. Not part of the API an embedder relies on: it changes with the
/// implementation, and hidden from the documentation.
#[doc(hidden)]
pub mod internals {
    pub use crate::memory::{HostReleaseFn, LiveGuard};
    pub use crate::runtime::config;
    pub use crate::runtime::graphs::capture_pools_may_be_open;
    pub use crate::thread_slots::shards_without_locks;
}

/// README.md's Rust example, compiled by `cargo test` so that the front page cannot drift from
/// the API.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeExample;
