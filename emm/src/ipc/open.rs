//! Opening an [`IpcHandle`] in a context: directly (a mapping of the exporter's memory in the
//! context), or staged (a copy into new memory of the destination's manager, read through the
//! source device). The public entry points are [`IpcHandle::open`], `open_direct` and
//! `open_staged`, which resolve the contexts; this module does the work.

use std::sync::Arc;

use driver_sys::DevicePtr;

use crate::contract::factory::ManagerContext;
use crate::contract::ipc::{IpcHandle, IpcMapping, IpcMemory, Opened};
use crate::contract::manager::MemoryManager;
use crate::contract::pool_export::PoolId;
use crate::error::EmmError;
use crate::ipc::imports::PoolImports;
use crate::memory::pointer::{MemoryPointer, Release};
use crate::sync::{AtomicBool, lock};

/// Bytes per host round trip when a staged open of pool memory goes through the host.
const STAGING_CHUNK: usize = 16 << 20;

/// One context as an open sees it: its driver access, its manager (a staged copy is memory of
/// the manager) and the runtime's table of imported pools.
#[derive(Clone, Copy)]
pub(crate) struct Endpoint<'a> {
    pub(crate) cx: &'a ManagerContext,
    pub(crate) manager: &'a dyn MemoryManager,
    pub(crate) imports: &'a Arc<PoolImports>,
}

/// A direct mapping and how it is undone: a `cuIpcOpenMemHandle` mapping in `cx`, or a
/// pointer imported through pool `pool` (whose context `cx` is).
struct Mapping {
    cx: ManagerContext,
    base: DevicePtr,
    pool: Option<(PoolId, Arc<PoolImports>)>,
}

impl IpcMapping for Mapping {
    fn close(&self) -> Result<(), EmmError> {
        // Copies that saw the mapping open finish first; later ones see it closed.
        let _uses = self.cx.liveness.exclusive_memory();
        match &self.pool {
            None => self.cx.ipc_close(self.base),
            Some((id, imports)) => imports.free_pointer(*id, self.base),
        }
    }
}

fn check_openable(handle: &IpcHandle, opened: &Option<Opened>) -> Result<(), EmmError> {
    if handle.is_exporter() {
        return Err(EmmError::Ipc {
            message: "opening IpcHandle from original process",
            advice: "open it in another process; here, use the exported memory itself",
        });
    }
    if opened.is_some() {
        return Err(EmmError::Ipc {
            message: "IpcHandle is already opened",
            advice: "close it (IpcHandle::close) before opening it again",
        });
    }
    Ok(())
}

/// Opens the mapping for use in `at` and checks that the exported range lies inside what was
/// mapped: the offset and size travelled as bytes and may have been garbled or forged, and a
/// view past the mapping would reach memory the exporter never shared.
fn map_checked(handle: &IpcHandle, at: &Endpoint<'_>) -> Result<Mapping, EmmError> {
    let mapping = match handle.handle() {
        IpcMemory::Allocation(h) => Mapping {
            base: at.cx.ipc_open(h)?,
            cx: at.cx.clone(),
            pool: None,
        },
        IpcMemory::PoolAllocation { pool, data } => {
            let (pool_cx, base) = at.imports.import_pointer(*pool, data, at.cx.device)?;
            Mapping {
                cx: pool_cx,
                base,
                pool: Some((*pool, Arc::clone(at.imports))),
            }
        }
    };
    let (size, offset) = (handle.size(), handle.offset());
    let mapped = mapping.cx.mapping_size(mapping.base);
    let fits = matches!(&mapped, Ok(n) if offset.checked_add(size).is_some_and(|end| end <= *n));
    if !fits {
        let closed = mapping.close();
        let mapped = mapped?;
        closed?;
        return Err(EmmError::InvalidIpcHandle {
            reason: format!(
                "the handle claims {size} bytes at offset {offset}, but the allocation it names has {mapped} bytes"
            ),
        });
    }
    Ok(mapping)
}

/// Maps the memory into `at` and returns a pointer to the exported range (Numba's
/// `open_direct`). The mapping covers `offset + size` bytes from the allocation's base.
pub(crate) fn open_direct(
    handle: &IpcHandle,
    at: &Endpoint<'_>,
) -> Result<MemoryPointer, EmmError> {
    let mut opened = lock(&handle.opened);
    check_openable(handle, &opened)?;
    let mapping = map_checked(handle, at)?;
    let base = mapping.base;
    let (size, offset) = (handle.size(), handle.offset());
    let open = Arc::new(AtomicBool::new(true));
    let whole = MemoryPointer::from_release(
        at.cx.device,
        at.cx.context,
        base,
        offset + size,
        Release::Mapping {
            open: Arc::clone(&open),
        },
        None,
    );
    let view = whole.view(offset, None)?;
    tracing::debug!(device = %at.cx.device, %base, size, offset, "IPC handle opened directly");
    *opened = Some(Opened::Direct {
        mapping: Box::new(mapping),
        open,
    });
    Ok(view)
}

/// Copies the memory into new memory of `to`'s manager by way of `source`, the exporting
/// device's context (Numba's `open_staged`). Memory of an imported stream-ordered pool is
/// copied through host memory (16 MiB at a time) when `to` is on another device: only devices
/// the pool grants access reach it, and one that is not a peer cannot be granted.
pub(crate) fn open_staged(
    handle: &IpcHandle,
    source: &Endpoint<'_>,
    to: &Endpoint<'_>,
) -> Result<MemoryPointer, EmmError> {
    let mut opened = lock(&handle.opened);
    check_openable(handle, &opened)?;
    let size = handle.size();
    // No peer access is asked for here, unlike `Context::copy_peer`: granting it, before or
    // after the mapping, did not speed the staged copy, which runs at host-memory speed where
    // a plain copy between the devices takes the peer path. The
    // copy from a mapping of another process's memory does not take the peer path, for a
    // reason not found.
    let mapping = map_checked(handle, source)?;
    let src = DevicePtr(mapping.base.0 + handle.offset() as u64);
    let copied = to
        .cx
        .ensure_alive("memalloc")
        .and_then(|()| to.manager.memalloc(size))
        .and_then(|new| {
            if mapping.pool.is_some() && source.cx.device != to.cx.device {
                // Imported pool memory is reached only from devices its pool grants access,
                // and a device that is not a peer cannot be granted (measured on two H200s):
                // the bytes go through host memory.
                let mut chunk = vec![0u8; size.min(STAGING_CHUNK)];
                for start in (0..size).step_by(STAGING_CHUNK) {
                    let n = (size - start).min(STAGING_CHUNK);
                    mapping
                        .cx
                        .read_mapping(&mut chunk[..n], DevicePtr(src.0 + start as u64))?;
                    let held = to.cx.use_memory();
                    to.cx
                        .copy_to_device(&held, &new.view(start, Some(start + n))?, &chunk[..n])?;
                }
            } else {
                let held = to.cx.use_memory();
                to.cx
                    .copy_device_to_device(&held, new.device_ptr(), src, size, &new)?;
            }
            Ok(new)
        });
    let closed = mapping.close();
    let new = copied?;
    closed?;
    tracing::debug!(from = %source.cx.device, to = %to.cx.device, size, "IPC handle opened through staging");
    *opened = Some(Opened::Staged);
    Ok(new)
}
