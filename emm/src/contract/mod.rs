//! Layer 2, the contract: the plugin interface every manager implements, how a manager is
//! built, and the plain data its methods return. Everything above (the host layer, the
//! managers, the adaptors, IPC, `Context` and `Runtime`) is written against this module.
//!
//! | file | holds |
//! | --- | --- |
//! | `manager` | [`MemoryManager`] (NBEP 7's `BaseCUDAMemoryManager`), [`INTERFACE_VERSION`], [`check_interface_version`] |
//! | `capabilities` | what only some managers can do, one trait each: [`Holdings`], [`Records`], [`Exports`], [`Sleeper`] |
//! | `factory` | [`ManagerContext`] (what a manager is built from), [`ManagerFactory`], [`FnFactory`] |
//! | `access` | [`ManagerContext`]'s guarded driver calls: liveness, the stale-context error, copies, mappings |
//! | `info` | [`MemoryInfo`], [`PoolStats`], [`PoolReport`], [`Usage`] / [`KindUsage`] / [`MemoryKind`], [`PinnedPoolConfig`] |
//! | `ipc` | [`IpcHandle`] (what `get_ipc_handle` returns), [`IpcMemory`], [`DeviceIdentity`] |
//! | `mapped_export` | [`MappedExport`] (what `export_mapped` returns: `vmm-pool` memory as file descriptors) |
//! | `pool_export` | [`PoolExport`] (what `export_pool` returns) and [`PoolId`] |
//! | `sleep` | [`SleepOptions`] / [`SleepChoice`] (what `Context::sleep` is asked), [`SleepBlock`] (what `Sleeper::sleep` gets), [`SleepReport`], [`WakeReport`] |
//! | `snapshot` | [`HeldSegment`] (what `segments` returns), [`Tag`], [`MemorySnapshot`] and its exports |

pub(crate) mod access;
pub(crate) mod capabilities;
pub(crate) mod factory;
pub(crate) mod info;
pub(crate) mod ipc;
pub(crate) mod manager;
pub(crate) mod mapped_export;
pub(crate) mod pool_export;
pub(crate) mod sleep;
pub(crate) mod snapshot;

pub use access::RelaxedCapture;
pub use capabilities::{Exports, Holdings, Records, Sleeper};
pub use factory::{FnFactory, ManagerContext, ManagerFactory};
pub use info::{
    AllocationEvents, FreeSpace, KindUsage, MemoryInfo, MemoryKind, OUT_OF_MEMORY_RETRIES,
    OutOfMemoryCallback, PinnedPoolConfig, PoolReport, PoolStats, Usage,
};
pub use ipc::{DeviceIdentity, IpcHandle, IpcMemory};
pub use manager::{
    HistoryRecord, INTERFACE_VERSION, MemoryManager, StreamOrdering, check_interface_version,
};
pub use mapped_export::MappedExport;
pub use pool_export::{POOL_DESCRIPTOR_LEN, PoolExport, PoolId};
pub use sleep::{SleepBlock, SleepChoice, SleepOptions, SleepReport, WakeReport};
pub use snapshot::{
    AllocationInfo, Block, BlockState, HeldBlock, HeldSegment, HistoryAction, HistoryEvent,
    MemorySnapshot, Segment, SegmentKind, Tag, TagScope, with_host_stack,
};
