//! A manager's optional capabilities, each a trait of its own that
//! [`MemoryManager`](crate::contract::MemoryManager) hands out through one accessor
//! ([`holdings`](crate::contract::MemoryManager::holdings),
//! [`records`](crate::contract::MemoryManager::records),
//! [`exports`](crate::contract::MemoryManager::exports),
//! [`sleeper`](crate::contract::MemoryManager::sleeper)). A manager without one returns `None`
//! there, and a layer that wraps a manager without changing a capability forwards its
//! accessor: one method, however many the capability has.

use crate::contract::info::{FreeSpace, PoolReport, Usage};
use crate::contract::manager::HistoryRecord;
use crate::contract::mapped_export::MappedExport;
use crate::contract::pool_export::PoolExport;
use crate::contract::sleep::{SleepBlock, SleepOptions, SleepReport, WakeReport};
use crate::contract::snapshot::HeldSegment;
use crate::error::EmmError;
use crate::memory::pointer::MemoryPointer;

/// What a manager holds back from the driver, and giving it back: pool figures, free space,
/// held segments, `trim`.
pub trait Holdings: Send + Sync {
    /// Releases memory the manager holds back (pool chunks with nothing in use, cached pinned
    /// host blocks) to the driver; returns the bytes released. Inside `defer_cleanup` the frees
    /// are queued until the guard is gone.
    fn trim(&self) -> Result<usize, EmmError>;

    /// What the manager's pools hold.
    fn pool_stats(&self) -> PoolReport;

    /// The free space of the manager's device pool, block by block (`None` where the pool
    /// cannot tell, as the driver's own pools).
    fn free_space(&self) -> Option<FreeSpace> {
        None
    }

    /// Every segment the manager holds from the driver, with the blocks in it that are not in
    /// use (free, cached, waiting to be freed; for a segment of one allocation, its in-use
    /// block), for snapshots ([`Context::snapshot`](crate::Context::snapshot)). `None` where
    /// the manager cannot list them.
    fn segments(&self) -> Option<Vec<HeldSegment>> {
        None
    }
}

/// What a manager recorded of its allocations: a history and counts.
pub trait Records: Send + Sync {
    /// The live allocations and last events the manager's history recorded: a `history`
    /// adaptor's (every allocation), or a manager's own (`pool` and `vmm-pool`: the window
    /// of each thread's last events). `None` where none is kept.
    fn history(&self) -> Option<HistoryRecord>;

    /// Whether the history keeps each allocation's stack (a `history-stacks` adaptor): a host
    /// runtime then passes its own language's stack
    /// ([`with_host_stack`](crate::contract::with_host_stack)).
    fn records_stacks(&self) -> bool {
        false
    }

    /// What a `stats` adaptor around the manager counted (`None` without one).
    fn usage(&self) -> Option<Usage> {
        None
    }
}

/// Sharing memory with other processes beyond NBEP 7's IPC handles
/// ([`MemoryManager::get_ipc_handle`](crate::contract::MemoryManager::get_ipc_handle), which
/// every manager has). Each method refuses with [`EmmError::NotSupported`] by default: a
/// manager implements those its memory allows.
pub trait Exports: Send + Sync {
    /// Exports the manager's stream-ordered pool to other processes (only a manager whose
    /// memory comes from an IPC-enabled pool can).
    fn export_pool(&self) -> Result<PoolExport, EmmError> {
        Err(EmmError::no_pool_export(std::any::type_name_of_val(self)))
    }

    /// Allocates `bytes` of device memory to share with other processes as file descriptors
    /// ([`export_mapped`](Self::export_mapped)): physical memory of its own, which no other
    /// allocation shares and which is not handed out again after its free. Only a manager whose
    /// memory is physical memory mapped into reserved addresses can (`vmm-pool`).
    fn memalloc_shared(&self, bytes: usize) -> Result<MemoryPointer, EmmError> {
        let _ = bytes;
        Err(EmmError::no_shared_allocation(std::any::type_name_of_val(
            self,
        )))
    }

    /// Exports `memory` (an allocation of this manager) as the physical memory behind it, file
    /// descriptors that another process maps ([`MappedExport`]).
    fn export_mapped(&self, memory: &MemoryPointer) -> Result<MappedExport, EmmError> {
        let _ = memory;
        Err(EmmError::no_mapped_export(std::any::type_name_of_val(self)))
    }
}

/// Giving the physical memory behind the manager's device memory back to the driver while every
/// address stays reserved, and taking it again: only a manager whose memory is physical memory
/// mapped into reserved addresses has it (`vmm-pool`).
pub trait Sleeper: Send + Sync {
    /// Releases the physical memory ([`Context::sleep`](crate::Context::sleep), which calls it
    /// with the device idle, deallocations flushed, and allocations refused): `blocks` are the
    /// live allocations, each with its choice; memory of those kept stays mapped, those
    /// offloaded are copied to host memory first; `options` are the caller's (the choices are
    /// already in `blocks`; the host buffer's fate is not).
    fn sleep(&self, blocks: &[SleepBlock], options: &SleepOptions)
    -> Result<SleepReport, EmmError>;

    /// Maps physical memory again behind every address [`sleep`](Self::sleep) released and
    /// copies the offloaded allocations back.
    fn wake(&self) -> Result<WakeReport, EmmError>;
}
