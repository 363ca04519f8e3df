//! `async-pool-ipc`: the pool and its allocations exported to other processes
//! (`cuMemPoolExportToShareableHandle`, `cuMemPoolExportPointer`).

use driver_sys::DriverError;

use super::{AsyncPoolAllocator, PoolState, SLOT_MASK};
use crate::contract::ipc::IpcHandle;
use crate::contract::pool_export::PoolExport;
use crate::error::EmmError;
use crate::memory::pointer::MemoryPointer;

impl AsyncPoolAllocator {
    /// Exports the pool (created if need be) as a new file descriptor, and records that it
    /// was exported.
    pub(super) fn export_fd(
        &self,
        state: &mut PoolState,
    ) -> Result<std::os::fd::OwnedFd, DriverError> {
        let cx = &self.shared.cx;
        let pool = self.pool(state)?;
        let fd = cx.driver.mem_pool_export_fd(cx.context, pool)?;
        state.exported = true;
        Ok(fd)
    }

    /// An IPC handle for `memory` (`cuMemPoolExportPointer`), after the pool itself was
    /// exported once and the allocating stream completed; refused under `async-pool`.
    pub(super) fn export_allocation(&self, memory: &MemoryPointer) -> Result<IpcHandle, EmmError> {
        if !self.shared.ipc {
            return Err(EmmError::NotSupported {
                operation: "get_ipc_handle",
                manager: self.name().into(),
                advice: "its pool is not created for export, and the driver does not export \
                         stream-ordered pool memory with cuIpcGetMemHandle; select \
                         'async-pool-ipc' (or 'default' or 'pool') for memory you share between \
                         processes",
            });
        }
        let cx = &self.shared.cx;
        let _live = cx.enter("get_ipc_handle")?;
        let base = memory.allocation_base();
        // Every gate: the export may record `exported`, and no reset destroys the pool
        // while the allocation is exported.
        let (_gates, mut state) = self.shared.exclusive();
        let live = memory.hook_tag().is_some_and(|tag| {
            self.shared.current(tag) && self.shared.live.contains(base.0, tag & SLOT_MASK)
        });
        let (Some(id), true) = (state.id, live) else {
            return Err(EmmError::InvalidArgument {
                what: "memory passed to get_ipc_handle",
                reason: format!(
                    "{base} is not a live allocation of this context's '{}' pool; export memory \
                     this context's manager allocated, before the device is reset",
                    self.name()
                ),
            });
        };
        if !state.exported {
            // The driver exports no allocation of a pool never exported itself; the descriptor
            // opened here is closed at once (the export stays valid).
            drop(
                self.export_fd(&mut state)
                    .map_err(self.err("get_ipc_handle"))?,
            );
        }
        cx.export_pool_allocation(memory, id)
    }

    /// The pool as a [`PoolExport`] for other processes (`cuMemPoolExportToShareableHandle`);
    /// refused under `async-pool`.
    pub(super) fn export(&self) -> Result<PoolExport, EmmError> {
        let cx = &self.shared.cx;
        if !self.shared.ipc {
            return Err(EmmError::no_pool_export(self.name()));
        }
        let _live = cx.enter("export_pool")?;
        let (fd, id) = {
            let (_gates, mut state) = self.shared.exclusive();
            let fd = self
                .export_fd(&mut state)
                .map_err(self.err("export_pool"))?;
            (fd, state.id.expect("an IPC-enabled pool has an id"))
        };
        let source = cx.device_identity()?;
        tracing::info!(device = %cx.device, pool = %id, "stream-ordered pool exported");
        Ok(PoolExport::new(id, source, fd))
    }
}
