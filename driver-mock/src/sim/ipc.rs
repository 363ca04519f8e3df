//! IPC of `cuMemAlloc` memory: handles, mappings in other processes and their reference counts.

use driver_sys::{ContextHandle, DevicePtr, IpcMemHandle, code};

use super::Note;
use super::config::{IPC_SPACE_OFFSET, PAGE_SIZE};
use super::memory::DeviceMem;
use super::world::{World, context};

pub(super) const IPC_MAGIC: &[u8; 8] = b"EMMSIMIP";

#[derive(Debug)]
pub(super) struct IpcMap {
    pub(super) device: usize,
    pub(super) store: u64,
    pub(super) size: usize,
    pub(super) span: usize,
    /// Opens not yet closed: the driver reference-counts repeated opens in one context.
    pub(super) opens: usize,
    /// For a pointer imported from a stream-ordered pool: the imported pool it came through.
    /// It is freed with `cuMemFreeAsync`, not closed.
    pub(super) pool: Option<u64>,
}

pub(super) fn encode_ipc(
    pid: usize,
    device: usize,
    store: u64,
    base: u64,
    size: usize,
) -> IpcMemHandle {
    let mut h = [0u8; 64];
    h[..8].copy_from_slice(IPC_MAGIC);
    h[8..12].copy_from_slice(&(pid as u32).to_le_bytes());
    h[12..16].copy_from_slice(&(device as u32).to_le_bytes());
    h[16..24].copy_from_slice(&store.to_le_bytes());
    h[24..32].copy_from_slice(&base.to_le_bytes());
    h[32..40].copy_from_slice(&(size as u64).to_le_bytes());
    IpcMemHandle(h)
}

/// (exporting process, device, store) of a handle made by [`encode_ipc`]; the size it carries
/// is informative only.
pub(super) fn decode_ipc(h: &IpcMemHandle) -> Option<(usize, usize, u64)> {
    let b = &h.0;
    if &b[..8] != IPC_MAGIC || b[40..].iter().any(|&x| x != 0) {
        return None;
    }
    let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
    let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
    Some((u32_at(8) as usize, u32_at(12) as usize, u64_at(16)))
}

impl World {
    /// Maps `size` bytes of `store` into process `pid`'s IPC space of `device`, at the lowest
    /// free run of whole pages, opened once (`pool`: imported through that pool); returns
    /// the address.
    pub(super) fn map_store(
        &mut self,
        pid: usize,
        device: usize,
        store: u64,
        size: usize,
        pool: Option<u64>,
    ) -> u64 {
        let span = size.next_multiple_of(PAGE_SIZE);
        let region = DeviceMem::base(device) + IPC_SPACE_OFFSET;
        let mut addr = region;
        for (&start, m) in self.processes[pid]
            .ipc
            .range(region..region + IPC_SPACE_OFFSET)
        {
            if start - addr >= span as u64 {
                break;
            }
            addr = start + m.span as u64;
        }
        self.stores.get_mut(&store).expect("a live store").refs += 1;
        self.processes[pid].ipc.insert(
            addr,
            IpcMap {
                device,
                store,
                size,
                span,
                opens: 1,
                pool,
            },
        );
        addr
    }

    /// `cuIpcGetMemHandle`: [`Driver::ipc_get_mem_handle`](driver_sys::Driver::ipc_get_mem_handle) in the model.
    pub(super) fn ipc_get_mem_handle(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        ptr: DevicePtr,
    ) -> Result<IpcMemHandle, u32> {
        note.ptr = Some(ptr);
        context(self, pid, ctx, note)?;
        for (i, d) in self.devices.iter().enumerate() {
            // Measured on the GPU: an address inside the allocation names it too.
            if let Some((base, a)) = d.containing(ptr.0)
                && a.owner == pid
            {
                // Stream-ordered pool memory cannot be exported this way (the driver
                // documents it; pools export through shareable handles).
                if self.processes[pid]
                    .pools
                    .values()
                    .any(|p| p.live.contains_key(&base))
                {
                    return Err(code::INVALID_VALUE);
                }
                note.bytes = Some(a.size);
                return Ok(encode_ipc(pid, i, a.store, base, a.size));
            }
        }
        Err(code::INVALID_VALUE)
    }

    /// `cuIpcOpenMemHandle`: [`Driver::ipc_open_mem_handle`](driver_sys::Driver::ipc_open_mem_handle) in the model.
    pub(super) fn ipc_open_mem_handle(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        handle: &IpcMemHandle,
    ) -> Result<DevicePtr, u32> {
        let handle = *handle;
        let i = context(self, pid, ctx, note)?;
        let (exporter, device, store) = decode_ipc(&handle).ok_or(code::INVALID_VALUE)?;
        if device >= self.devices.len() || exporter >= self.processes.len() {
            return Err(code::INVALID_VALUE);
        }
        if exporter == pid {
            return Err(code::INVALID_CONTEXT);
        }
        if device != i && !self.peer_access {
            return Err(code::PEER_ACCESS_UNSUPPORTED);
        }
        // The driver's own record of the allocation decides the size, never the bytes
        // of the handle (which another process may have garbled).
        let Some(size) = self.devices[device]
            .allocs
            .values()
            .find(|a| a.store == store && a.owner == exporter)
            .map(|a| a.size)
        else {
            // Freed by the exporter before the open, or never exported.
            return Err(code::INVALID_VALUE);
        };
        // The driver's documentation: a handle opened again by the same context gets the
        // existing pointer, its reference count raised.
        if let Some((&addr, m)) = self.processes[pid]
            .ipc
            .iter_mut()
            .find(|(_, m)| m.store == store && m.device == i && m.pool.is_none())
        {
            m.opens += 1;
            note.ptr = Some(DevicePtr(addr));
            return Ok(DevicePtr(addr));
        }
        let addr = self.map_store(pid, i, store, size, None);
        note.ptr = Some(DevicePtr(addr));
        note.bytes = Some(size);
        Ok(DevicePtr(addr))
    }

    /// `cuIpcCloseMemHandle`: [`Driver::ipc_close_mem_handle`](driver_sys::Driver::ipc_close_mem_handle) in the model.
    pub(super) fn ipc_close_mem_handle(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        ptr: DevicePtr,
    ) -> Result<(), u32> {
        note.ptr = Some(ptr);
        context(self, pid, ctx, note)?;
        let m = self.processes[pid]
            .ipc
            .get_mut(&ptr.0)
            .filter(|m| m.pool.is_none())
            .ok_or(code::INVALID_VALUE)?;
        m.opens -= 1;
        if m.opens == 0 {
            let m = self.processes[pid].ipc.remove(&ptr.0).expect("present");
            self.drop_store(m.store);
        }
        Ok(())
    }
}
