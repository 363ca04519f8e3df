//! The runtime's table of imported stream-ordered pools (`async-pool-ipc` memory of other
//! processes): imports, pointer imports and their frees, and what a device reset ends.

#![allow(unsafe_code)]

use crate::memory::AddressMap;
use std::collections::HashMap;
use std::fmt;

use driver_sys::{DeviceOrdinal, DevicePtr, MemPoolHandle, PoolPtrExportData, StreamHandle};

use crate::contract::factory::ManagerContext;
#[cfg(unix)]
use crate::contract::pool_export::PoolExport;
use crate::contract::pool_export::PoolId;
use crate::error::EmmError;
use crate::sync::{Mutex, lock};
/// One imported pool: the context it was imported in and the pointers imported through it
/// that are not freed yet, each with the number of opens that use it. The driver hands back
/// the same address when one allocation is imported again and unmaps it at the first free
/// (measured on an H100), so emm counts the opens and frees at the last close.
struct Imported {
    cx: ManagerContext,
    pool: MemPoolHandle,
    pointers: AddressMap<usize>,
}

/// The pools this process imported, by id (one table per runtime).
#[derive(Default)]
pub(crate) struct PoolImports {
    pools: Mutex<HashMap<PoolId, Imported>>,
}

impl fmt::Debug for PoolImports {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let pools = lock(&self.pools);
        f.debug_map()
            .entries(pools.iter().map(|(id, p)| (id, (p.pool, p.pointers.len()))))
            .finish()
    }
}

const STREAM: StreamHandle = StreamHandle::NULL;

impl PoolImports {
    /// Imports `export` in `cx` (its source device's context) and grants that device access;
    /// importing a pool already imported there does nothing.
    #[cfg(unix)]
    pub(crate) fn import(&self, cx: &ManagerContext, export: PoolExport) -> Result<(), EmmError> {
        let mut pools = lock(&self.pools);
        if let Some(p) = pools.get(&export.id()) {
            if p.cx.liveness.is_alive() {
                return Ok(());
            }
            // Imported before a reset of its device; the import went with the context.
            pools.remove(&export.id());
        }
        let err = |e| EmmError::driver("import_pool", cx.device, e);
        let _live = cx.enter("import_pool")?;
        let pool = cx
            .driver
            .mem_pool_import_fd(cx.context, export.fd())
            .map_err(err)?;
        if let Err(e) = cx.ensure_pool_access(pool, cx.device) {
            // SAFETY: imported just above; no pointer was imported through it.
            cx.log_failed_undo("an imported memory pool", unsafe {
                cx.driver.mem_pool_destroy(cx.context, pool)
            });
            return Err(err(e));
        }
        tracing::info!(device = %cx.device, pool = %export.id(), handle = ?pool, "stream-ordered pool imported");
        pools.insert(
            export.id(),
            Imported {
                cx: cx.clone(),
                pool,
                pointers: AddressMap::default(),
            },
        );
        Ok(())
    }

    /// The context and handle of imported pool `id`, if it is imported in a live context.
    pub(crate) fn pool_of(&self, id: PoolId) -> Option<(ManagerContext, MemPoolHandle)> {
        let pools = lock(&self.pools);
        let p = pools.get(&id)?;
        p.cx.liveness.is_alive().then(|| (p.cx.clone(), p.pool))
    }

    /// Imports the pointer `data` names from pool `id`, usable from device `user` (access is
    /// granted when that is not the pool's device). Returns the pool's context (the source
    /// device's) and the pointer.
    pub(crate) fn import_pointer(
        &self,
        id: PoolId,
        data: &PoolPtrExportData,
        user: DeviceOrdinal,
    ) -> Result<(ManagerContext, DevicePtr), EmmError> {
        let mut pools = lock(&self.pools);
        let Some(p) = pools.get_mut(&id) else {
            return Err(EmmError::PoolNotImported {
                pool: id.to_string(),
                detail: "",
            });
        };
        let cx = &p.cx;
        let Some(_live) = cx.liveness.enter() else {
            pools.remove(&id);
            return Err(EmmError::PoolNotImported {
                pool: id.to_string(),
                detail: " (it was imported before its device was reset)",
            });
        };
        let err = |e| EmmError::driver("open IPC handle", cx.device, e);
        if user != cx.device {
            cx.ensure_pool_access(p.pool, user).map_err(err)?;
        }
        let ptr = cx
            .driver
            .mem_pool_import_pointer(cx.context, p.pool, data)
            .map_err(err)?;
        *p.pointers.entry(ptr.0).or_insert(0) += 1;
        tracing::debug!(device = %cx.device, pool = %id, %ptr, "pool pointer imported");
        Ok((p.cx.clone(), ptr))
    }

    /// Frees a pointer [`import_pointer`](Self::import_pointer) returned, once; a pointer a
    /// device reset already released is left alone.
    pub(crate) fn free_pointer(&self, id: PoolId, ptr: DevicePtr) -> Result<(), EmmError> {
        let mut pools = lock(&self.pools);
        let Some(p) = pools.get_mut(&id) else {
            return Ok(());
        };
        match p.pointers.get_mut(&ptr.0) {
            None => Ok(()),
            Some(opens) if *opens > 1 => {
                *opens -= 1;
                Ok(())
            }
            Some(_) => {
                p.pointers.remove(&ptr.0);
                free_imported(&p.cx, ptr)
            }
        }
    }

    /// Frees the pointers imported through pools of `device` and destroys those pools (a
    /// device reset or the runtime's end). The first error is returned after all ran.
    pub(crate) fn release_device(&self, device: DeviceOrdinal) -> Result<(), EmmError> {
        let gone: Vec<(PoolId, Imported)> = {
            let mut pools = lock(&self.pools);
            let ids: Vec<PoolId> = pools
                .iter()
                .filter(|(_, p)| p.cx.device == device)
                .map(|(id, _)| *id)
                .collect();
            ids.into_iter()
                .filter_map(|id| pools.remove(&id).map(|p| (id, p)))
                .collect()
        };
        let mut result = Ok(());
        for (id, p) in gone {
            let cx = &p.cx;
            let Some(_live) = cx.liveness.enter() else {
                continue;
            };
            for ptr in p.pointers.keys() {
                result = result.and(free_imported(cx, DevicePtr(*ptr)));
            }
            // SAFETY: the pool was imported by this table, is destroyed once (removed from it
            // above), and every pointer imported through it was freed just above; handles
            // still open see their mapping as closed (the context's pointers are stale from
            // the reset on).
            let destroyed = unsafe { cx.driver.mem_pool_destroy(cx.context, p.pool) };
            tracing::info!(%device, pool = %id, pointers = p.pointers.len(), "imported stream-ordered pool released");
            result = result.and(destroyed.map_err(|e| EmmError::driver("reset", device, e)));
        }
        result
    }
}

/// Frees an imported pointer and waits for the free: the driver wants it complete in the
/// importer before the exporter frees the allocation.
fn free_imported(cx: &ManagerContext, ptr: DevicePtr) -> Result<(), EmmError> {
    let Some(_live) = cx.liveness.enter() else {
        // The context is gone, and the import with it.
        return Ok(());
    };
    let err = |e| EmmError::driver("close IPC handle", cx.device, e);
    // SAFETY: `ptr` was imported by `cuMemPoolImportPointer` and is freed once (its entry was
    // removed from the table by the caller); the pointer's handle turned its mapping stale
    // first, so emm does not use it afterwards; the context is alive (`_live`).
    unsafe { cx.driver.mem_free_async(cx.context, ptr, STREAM) }.map_err(err)?;
    cx.driver
        .stream_synchronize(cx.context, STREAM)
        .map_err(err)
}
