//! The plugin interface: [`MemoryManager`] (NBEP 7's `BaseCUDAMemoryManager`) and the
//! interface version Numba checks.

#![allow(unsafe_code)]
use std::fmt;
use std::sync::Arc;

use driver_sys::{HostPtr, StreamHandle};

use crate::contract::capabilities::{Exports, Holdings, Records, Sleeper};
use crate::contract::info::MemoryInfo;
use crate::contract::ipc::IpcHandle;
use crate::contract::snapshot::HistoryEvent;
use crate::error::EmmError;
use crate::memory::host::{HostAllocFlags, HostMemory, HostOwner, ManagedMemory};
use crate::memory::pending::{DeferCleanup, PendingDeallocs};
use crate::memory::pointer::MemoryPointer;

/// The interface version emm implements (Numba's `_SUPPORTED_EMM_INTERFACE_VERSION`).
pub const INTERFACE_VERSION: u32 = 1;

/// How a manager orders memory allocated on a stream ([`MemoryManager::memalloc_on`]).
///
/// Whatever the manager, a block freed on stream A (or used by a stream recorded with
/// [`MemoryPointer::record_stream`]) is never handed to other work before the work queued on
/// those streams before the free is done; the variants say how each manager makes sure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamOrdering {
    /// The manager does not allocate on streams: `memalloc_on` is refused.
    Unsupported,
    /// The driver's stream-ordered pool: `cuMemAllocFromPoolAsync` and `cuMemFreeAsync` on the
    /// caller's streams, the free made to wait for events of the recorded streams. The driver
    /// orders reuse (it may hand a block to another stream with a dependency on the free).
    Driver,
    /// The manager's own free space, its reuse ordered per stream: a block freed on a stream
    /// is reused at once by that stream, and by another stream once the freeing stream's work
    /// is found done, or behind a wait on the GPU for that work (`cuStreamWaitEvent`); a block
    /// several streams used, once events recorded at the free on all of them completed.
    PerStream,
    /// Each allocation is the driver's (`cuMemAlloc`, usable on every stream at once); its
    /// `cuMemFree` waits until events recorded at the free on the streams that used it
    /// completed (checked at each allocation, waited for when the device is out of memory).
    Fenced,
}

/// A memory manager: owns all memory of one context. Object safe; emm holds `Box<dyn _>`.
///
/// The methods are NBEP 7's, plus allocation on streams; what only some managers can do
/// (pool figures and `trim`, a history, exports beyond IPC handles, sleep) is a capability
/// reached through one accessor each ([`holdings`](Self::holdings), [`records`](Self::records),
/// [`exports`](Self::exports), [`sleeper`](Self::sleeper)), `None` by default.
///
/// # Life cycle
///
/// 1. The host runtime picks a manager once, before any context exists: in code
///    ([`RuntimeBuilder::memory_manager`](crate::RuntimeBuilder::memory_manager)) or by name
///    (`EMM_MEMORY_MANAGER`). The factory's [`interface_version`](crate::contract::ManagerFactory::interface_version)
///    is checked then.
/// 2. The first use of a device creates its [`Context`](crate::Context), and the factory
///    builds **one manager for that context**, which owns all its memory.
/// 3. [`initialize`](MemoryManager::initialize) is called on **every** use of the context
///    ([`Runtime::context`](crate::Runtime::context)), always before the first allocation. It
///    must be idempotent and must not invalidate earlier state.
/// 4. Allocation calls come from any thread, in any order.
/// 5. [`reset`](MemoryManager::reset) frees everything the manager allocated in the context. It
///    may be called before `initialize`, and more than once.
/// 6. When the device is reset, the context and its manager are discarded after `reset`; the
///    next use of the device builds a new context with a new manager.
pub trait MemoryManager: Send + Sync + fmt::Debug {
    /// Allocates `bytes` of device memory in the context; the pointer owns it.
    ///
    /// Zero bytes is an error ([`EmmError::ZeroSize`]) in every shipped manager, as
    /// `cuMemAlloc(0)` is for the driver: a pointer must name memory. Array libraries that
    /// hand out empty buffers (PyTorch, CuPy) give them a null pointer without calling the
    /// manager; an adapter over emm does the same.
    fn memalloc(&self, bytes: usize) -> Result<MemoryPointer, EmmError>;

    /// Allocates `bytes` of device memory for work on `stream` (emm's stream-ordered extension:
    /// NBEP 7's members and [`INTERFACE_VERSION`] are unchanged). The memory may be used by
    /// work queued on `stream` from now on (and by other streams after synchronising with it,
    /// as with `cuMemAllocAsync`). When its last pointer drops it is freed on `stream`, or on
    /// the stream given to [`MemoryPointer::free_on`], after the work of every stream recorded
    /// with [`MemoryPointer::record_stream`]; the manager never hands it to other work before
    /// then ([`stream_ordering`](Self::stream_ordering) says how).
    ///
    /// The default refuses with [`EmmError::NotSupported`]: a plugin that does not know
    /// streams keeps NBEP 7's rule (synchronise, then drop).
    fn memalloc_on(&self, bytes: usize, stream: StreamHandle) -> Result<MemoryPointer, EmmError> {
        let _ = (bytes, stream);
        Err(EmmError::no_stream_ordering(std::any::type_name_of_val(
            self,
        )))
    }

    /// How the manager orders memory allocated on streams.
    fn stream_ordering(&self) -> StreamOrdering {
        StreamOrdering::Unsupported
    }

    /// Allocates `bytes` of managed memory (`cuMemAllocManaged`; Numba's `memallocmanaged`),
    /// attached globally if `attach_global`, else to the host. Freed like device memory.
    fn memallocmanaged(&self, bytes: usize, attach_global: bool)
    -> Result<ManagedMemory, EmmError>;

    /// Allocates page-locked host memory (`cuMemHostAlloc` with `flags`: mapped into the
    /// device, pinned for every context, write-combined).
    fn memhostalloc(&self, bytes: usize, flags: HostAllocFlags) -> Result<HostMemory, EmmError>;

    /// Page-locks the existing host range `ptr .. ptr + size`, which `owner` keeps alive;
    /// `mapped` also maps it into the device.
    ///
    /// # Safety
    ///
    /// - `ptr .. ptr + size` is host memory that `owner` keeps alive.
    /// - While the pin lives, no Rust reference to that memory is used while the device or a
    ///   driver copy may write it.
    unsafe fn mempin(
        &self,
        owner: HostOwner,
        ptr: HostPtr,
        size: usize,
        mapped: bool,
    ) -> Result<HostMemory, EmmError>;

    /// Prepares the manager for use in its context. Called on every use; idempotent.
    fn initialize(&self) -> Result<(), EmmError>;

    /// An IPC handle for `memory`, which may be a view.
    fn get_ipc_handle(&self, memory: &MemoryPointer) -> Result<IpcHandle, EmmError>;

    /// Free and total memory as the manager sees it.
    fn get_memory_info(&self) -> Result<MemoryInfo, EmmError>;

    /// Frees everything allocated in this context. May come before `initialize`.
    fn reset(&self) -> Result<(), EmmError>;

    /// Defers expensive cleanup while the returned guard lives. Guards nest.
    fn defer_cleanup(&self) -> Result<DeferCleanup, EmmError>;

    /// The interface version this manager implements; must be [`INTERFACE_VERSION`].
    fn interface_version(&self) -> u32;

    /// The manager's deferred-deallocation queue, if it has one (for inspection and tests).
    fn deallocations(&self) -> Option<&Arc<PendingDeallocs>> {
        None
    }

    /// The manager's pool figures and `trim` ([`Holdings`]), if it holds memory back.
    fn holdings(&self) -> Option<&dyn Holdings> {
        None
    }

    /// The manager's history and counts ([`Records`]), if it keeps any.
    fn records(&self) -> Option<&dyn Records> {
        None
    }

    /// Pool exports and memory shared as file descriptors ([`Exports`]), if the manager's
    /// memory allows either.
    fn exports(&self) -> Option<&dyn Exports> {
        None
    }

    /// Sleep and wake ([`Sleeper`]), if the manager's memory is physical memory mapped into
    /// reserved addresses (`vmm-pool`).
    fn sleeper(&self) -> Option<&dyn Sleeper> {
        None
    }
}

/// What a manager's history recorded ([`Records::history`]).
#[derive(Clone, Debug, Default)]
pub struct HistoryRecord {
    /// Live allocations: address, and what history knows of each (its size among it).
    pub live: Vec<(u64, crate::contract::snapshot::AllocationInfo)>,
    /// The last events, oldest first.
    pub events: Vec<HistoryEvent>,
    /// Whether `live` is every live allocation (a `history` adaptor's record). A manager's
    /// own window may name allocations already freed: a snapshot keeps only those whose
    /// address lies in in-use space.
    pub complete: bool,
}

/// Checks a plugin's interface version (Numba's message on mismatch).
pub fn check_interface_version(found: u32) -> Result<(), EmmError> {
    if found == INTERFACE_VERSION {
        Ok(())
    } else {
        Err(EmmError::InterfaceVersion {
            found,
            required: INTERFACE_VERSION,
        })
    }
}
