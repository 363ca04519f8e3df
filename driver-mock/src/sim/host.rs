//! Page-locked host memory: `cuMemHostAlloc`, `cuMemHostRegister` and their device mappings.

use driver_sys::{ContextHandle, DevicePtr, HostPtr, code, host_alloc, host_register, mem_attach};

use std::sync::Arc;

use super::Note;
use super::world::{World, context};

/// `cuMemHostAlloc` (and managed) memory: zeroed bytes the simulator owns and everyone else
/// reaches by address (the caller through the host pointer, copies through the device
/// mapping). Page-aligned, as the driver's are (a caller may put words of any alignment in
/// them). No reference may claim the bytes while they are in use, or writes through the
/// address would alias it: the block holds a raw pointer, and its address is exposed for those
/// writes.
#[derive(Debug)]
pub(super) struct HostBlock {
    bytes: *mut u8,
    layout: std::alloc::Layout,
    /// Made by `mmap` (a large block on Unix), not by the allocator.
    #[cfg_attr(not(all(unix, not(miri))), allow(dead_code))]
    mapped: bool,
}

/// Host blocks of at least this many bytes are anonymous mappings on Unix (not under Miri): zeroed by the
/// kernel and backed only where written, so a replay that allocates gigabytes of managed or
/// pooled host memory without touching it costs no memory and no time zeroing it.
#[cfg(all(unix, not(miri)))]
const MAP_AT_LEAST: usize = 1 << 20;

// SAFETY: the block is plain bytes that this value alone frees; the simulator reaches it only
// under the machine's lock, and callers only through the driver contract's copies.
unsafe impl Send for HostBlock {}
// SAFETY: as above: a shared block (one process's pool block imported by another) is read and
// written only under the machine's lock, so no two threads touch its bytes at once through it.
unsafe impl Sync for HostBlock {}

/// The alignment of the simulator's host blocks: a page, as the driver gives.
const HOST_ALIGN: usize = 4096;

/// The byte a quarantined block is filled with when freed
/// ([`SimDriver::quarantine_host_frees`](super::SimDriver::quarantine_host_frees)).
pub(super) const QUARANTINE_BYTE: u8 = 0xDD;

impl HostBlock {
    /// Fills the block with `byte`.
    fn fill(&mut self, byte: u8) {
        // SAFETY: `bytes` is this block's own memory of `layout.size()` bytes, reached here
        // under the machine's lock.
        unsafe { std::ptr::write_bytes(self.bytes, byte, self.layout.size()) };
    }

    /// Whether every byte of the block is `byte`.
    pub(super) fn all(&self, byte: u8) -> bool {
        // SAFETY: as for `fill`; read only.
        let bytes = unsafe { std::slice::from_raw_parts(self.bytes, self.layout.size()) };
        bytes.iter().all(|&b| b == byte)
    }

    /// `len` (at least 1) zeroed, page-aligned bytes, and their address.
    fn zeroed(len: usize) -> (HostBlock, usize) {
        let layout = std::alloc::Layout::from_size_align(len.max(1), HOST_ALIGN)
            .expect("a host block's size fits the address space");
        #[cfg(all(unix, not(miri)))]
        if len >= MAP_AT_LEAST {
            // SAFETY: a private anonymous mapping of `len` bytes at an address the kernel
            // chooses; no existing memory is touched.
            let at = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if at == libc::MAP_FAILED {
                std::alloc::handle_alloc_error(layout);
            }
            let bytes = at.cast::<u8>();
            let addr = bytes.expose_provenance();
            let block = HostBlock {
                bytes,
                layout,
                mapped: true,
            };
            return (block, addr);
        }
        // SAFETY: the layout has a non-zero size.
        let bytes = unsafe { std::alloc::alloc_zeroed(layout) };
        if bytes.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        let addr = bytes.expose_provenance();
        let block = HostBlock {
            bytes,
            layout,
            mapped: false,
        };
        (block, addr)
    }
}

impl Drop for HostBlock {
    fn drop(&mut self) {
        #[cfg(all(unix, not(miri)))]
        if self.mapped {
            // SAFETY: `bytes` is the start of a mapping of `layout.size()` bytes made by `zeroed`
            // and unmapped once, here; the range was removed from the process's table before
            // the block dropped, so no copy reaches it any more.
            unsafe { libc::munmap(self.bytes.cast(), self.layout.size()) };
            return;
        }
        // SAFETY: `bytes` came from `alloc_zeroed` with `layout` in `zeroed` and is freed once,
        // here; the range was removed from the process's table before the block dropped, so no
        // copy reaches it any more.
        unsafe { std::alloc::dealloc(self.bytes, self.layout) };
    }
}

#[derive(Debug)]
pub(super) enum HostKind {
    /// `cuMemHostAlloc` memory, owned by the simulator.
    Alloc(HostBlock),
    /// A caller's range, `cuMemHostRegister`ed.
    Registered,
    /// `cuMemAllocManaged` memory: bytes the simulator owns, reached at the same address from
    /// the host and from copies, freed with `cuMemFree`. Not pinned memory.
    Managed(#[allow(dead_code)] HostBlock),
    /// A block of a stream-ordered pool in host memory (`CU_MEM_LOCATION_TYPE_HOST`): pinned,
    /// reached at one address by the host and the devices, owned by its pool (and kept alive
    /// by the processes that imported it).
    Pooled(Arc<HostBlock>),
    /// A block of another process's pool in host memory, imported through an imported pool
    /// (`cuMemPoolImportPointer`): the same bytes at the same address, kept alive until this
    /// process frees it; counted as pinned memory by its exporter only.
    ImportedPooled(#[allow(dead_code)] Arc<HostBlock>),
    /// A block of a managed-memory pool: reached at one address by the host and the devices,
    /// owned by its pool. Not pinned memory.
    PooledManaged(#[allow(dead_code)] HostBlock),
}

#[derive(Debug)]
pub(super) struct HostRange {
    pub(super) size: usize,
    pub(super) device: usize,
    pub(super) mapped: bool,
    pub(super) portable: bool,
    pub(super) kind: HostKind,
}

impl HostRange {
    /// Whether destroying the context that made it leaves it in place. Measured on the H200:
    /// `cuMemHostAlloc` memory goes with its context, portable or not (the flag makes it
    /// pinned for every context, not longer-lived). A portable registration of the caller's
    /// memory is kept (not measured).
    pub(super) fn survives_its_context(&self) -> bool {
        self.portable && matches!(self.kind, HostKind::Registered)
    }

    /// Whether it counts as page-locked memory (managed memory does not).
    pub(super) fn is_pinned(&self) -> bool {
        !matches!(
            self.kind,
            HostKind::Managed(_) | HostKind::PooledManaged(_) | HostKind::ImportedPooled(_)
        )
    }
}

impl World {
    /// `cuMemHostAlloc`: [`Driver::mem_host_alloc`](driver_sys::Driver::mem_host_alloc) in the model.
    pub(super) fn mem_host_alloc(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        bytes: usize,
        flags: u32,
    ) -> Result<HostPtr, u32> {
        note.bytes = Some(bytes);
        let i = context(self, pid, ctx, note)?;
        let known = host_alloc::PORTABLE | host_alloc::DEVICEMAP | host_alloc::WRITECOMBINED;
        if flags & !known != 0 {
            return Err(code::INVALID_VALUE);
        }
        if bytes == 0 {
            // Measured on the GPU: success, with the null pointer.
            return Ok(HostPtr(0));
        }
        let mapped = flags & host_alloc::DEVICEMAP != 0;
        if mapped && !self.devices[i].config.can_map_host_memory {
            return Err(code::NOT_SUPPORTED);
        }
        if bytes > self.pinned_limit - self.pinned {
            return Err(code::OUT_OF_MEMORY);
        }
        let (storage, addr) = HostBlock::zeroed(bytes);
        self.pinned += bytes;
        self.processes[pid].host.insert(
            addr,
            HostRange {
                size: bytes,
                device: i,
                // Unified addressing: pinned memory is mapped whatever the flag says, as long as
                // the device can map host memory.
                mapped: self.devices[i].config.can_map_host_memory,
                portable: flags & host_alloc::PORTABLE != 0,
                kind: HostKind::Alloc(storage),
            },
        );
        note.host = Some(HostPtr(addr));
        Ok(HostPtr(addr))
    }

    /// `cuMemFreeHost`: [`Driver::mem_free_host`](driver_sys::Driver::mem_free_host) in the model.
    pub(super) fn mem_free_host(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        ptr: HostPtr,
    ) -> Result<(), u32> {
        note.host = Some(ptr);
        context(self, pid, ctx, note)?;
        if ptr.is_null() {
            return Ok(());
        }
        self.release_host(pid, note, ptr, false)
            .ok_or(code::INVALID_VALUE)
    }

    /// `cuMemHostRegister`: [`Driver::mem_host_register`](driver_sys::Driver::mem_host_register) in the model.
    pub(super) fn mem_host_register(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        ptr: HostPtr,
        bytes: usize,
        flags: u32,
    ) -> Result<(), u32> {
        note.host = Some(ptr);
        note.bytes = Some(bytes);
        let i = context(self, pid, ctx, note)?;
        let known = host_register::PORTABLE | host_register::DEVICEMAP;
        if bytes == 0 || ptr.is_null() || flags & !known != 0 {
            return Err(code::INVALID_VALUE);
        }
        let mapped = flags & host_register::DEVICEMAP != 0;
        if mapped && !self.devices[i].config.can_map_host_memory {
            return Err(code::NOT_SUPPORTED);
        }
        let end = ptr.0.checked_add(bytes).ok_or(code::INVALID_VALUE)?;
        let p = &self.processes[pid];
        let overlaps = p
            .host
            .range(..end)
            .next_back()
            .is_some_and(|(&start, h)| start + h.size > ptr.0);
        if overlaps {
            return Err(code::HOST_MEMORY_ALREADY_REGISTERED);
        }
        if bytes > self.pinned_limit - self.pinned {
            return Err(code::OUT_OF_MEMORY);
        }
        self.pinned += bytes;
        self.processes[pid].host.insert(
            ptr.0,
            HostRange {
                size: bytes,
                device: i,
                // Measured on the GPU: with unified addressing a registered range has a device
                // address whether or not DEVICEMAP was asked for.
                mapped: self.devices[i].config.can_map_host_memory,
                portable: flags & host_register::PORTABLE != 0,
                kind: HostKind::Registered,
            },
        );
        Ok(())
    }

    /// `cuMemHostUnregister`: [`Driver::mem_host_unregister`](driver_sys::Driver::mem_host_unregister) in the model.
    pub(super) fn mem_host_unregister(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        ptr: HostPtr,
    ) -> Result<(), u32> {
        note.host = Some(ptr);
        context(self, pid, ctx, note)?;
        self.release_host(pid, note, ptr, true)
            .ok_or(code::HOST_MEMORY_NOT_REGISTERED)
    }

    /// Takes back the pinned range starting at `ptr` if it is of the asked kind (a
    /// `cuMemHostRegister`ed range when `registered`, else a `cuMemHostAlloc` block): the range
    /// leaves the process and its bytes the pinned total. `None` when there is no such range.
    fn release_host(
        &mut self,
        pid: usize,
        note: &mut Note,
        ptr: HostPtr,
        registered: bool,
    ) -> Option<()> {
        let host = &mut self.processes[pid].host;
        let kind_matches = match host.get(&ptr.0)?.kind {
            HostKind::Registered => registered,
            HostKind::Alloc(_) => !registered,
            HostKind::Managed(_)
            | HostKind::Pooled(_)
            | HostKind::PooledManaged(_)
            | HostKind::ImportedPooled(_) => false,
        };
        if !kind_matches {
            return None;
        }
        let range = host.remove(&ptr.0)?;
        let size = range.size;
        if let (Some(kept), HostKind::Alloc(mut block)) = (self.quarantine.as_mut(), range.kind) {
            block.fill(QUARANTINE_BYTE);
            kept.push(block);
        }
        self.pinned -= size;
        note.bytes = Some(size);
        Some(())
    }

    /// `cuMemHostGetDevicePointer`: [`Driver::mem_host_get_device_pointer`](driver_sys::Driver::mem_host_get_device_pointer) in the model.
    pub(super) fn mem_host_get_device_pointer(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        ptr: HostPtr,
    ) -> Result<DevicePtr, u32> {
        note.host = Some(ptr);
        context(self, pid, ctx, note)?;
        let p = &self.processes[pid];
        match p.host.range(..=ptr.0).next_back() {
            Some((&start, h)) if h.mapped && h.is_pinned() && ptr.0 < start + h.size => {
                note.ptr = Some(DevicePtr(ptr.0 as u64));
                Ok(DevicePtr(ptr.0 as u64))
            }
            _ => Err(code::INVALID_VALUE),
        }
    }

    /// `cuMemAllocManaged`: [`Driver::mem_alloc_managed`](driver_sys::Driver::mem_alloc_managed)
    /// in the model. The bytes are the simulator's own host memory, at one address for the
    /// host and for copies (unified addressing); they do not count against the device's free
    /// memory (the driver places pages on first touch). Refused: zero bytes or flags other
    /// than exactly one attach flag (`CUDA_ERROR_INVALID_VALUE`), a device without managed
    /// memory (`CUDA_ERROR_NOT_SUPPORTED`), and, a modelling choice, more than the device's
    /// total memory (`CUDA_ERROR_OUT_OF_MEMORY`; the driver may oversubscribe, emm's tests do
    /// not ask it to).
    pub(super) fn mem_alloc_managed(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        bytes: usize,
        flags: u32,
    ) -> Result<DevicePtr, u32> {
        note.bytes = Some(bytes);
        let i = context(self, pid, ctx, note)?;
        if bytes == 0 || (flags != mem_attach::GLOBAL && flags != mem_attach::HOST) {
            return Err(code::INVALID_VALUE);
        }
        let config = &self.devices[i].config;
        if !config.managed_memory {
            return Err(code::NOT_SUPPORTED);
        }
        if bytes > config.total_mem {
            return Err(code::OUT_OF_MEMORY);
        }
        let (storage, addr) = HostBlock::zeroed(bytes);
        self.processes[pid].host.insert(
            addr,
            HostRange {
                size: bytes,
                device: i,
                mapped: true,
                portable: false,
                kind: HostKind::Managed(storage),
            },
        );
        note.ptr = Some(DevicePtr(addr as u64));
        Ok(DevicePtr(addr as u64))
    }

    /// A block of `bytes` for a pool in host memory of process `pid`, made in a context of
    /// device `device`: its address. Counted against the machine's page-locked memory, as
    /// `cuMemHostAlloc` is (`CUDA_ERROR_OUT_OF_MEMORY` past the limit).
    pub(super) fn alloc_pooled_host(
        &mut self,
        pid: usize,
        device: usize,
        bytes: usize,
        managed: bool,
    ) -> Result<u64, u32> {
        if !managed {
            if bytes > self.pinned_limit - self.pinned {
                return Err(code::OUT_OF_MEMORY);
            }
            self.pinned += bytes;
        }
        let (storage, addr) = HostBlock::zeroed(bytes);
        let kind = if managed {
            HostKind::PooledManaged(storage)
        } else {
            HostKind::Pooled(Arc::new(storage))
        };
        self.processes[pid].host.insert(
            addr,
            HostRange {
                size: bytes,
                device,
                mapped: true,
                portable: true,
                kind,
            },
        );
        Ok(addr as u64)
    }

    /// Maps the block at `addr` of `exporter`'s pool in host memory into process `pid` (for
    /// `device`): the same bytes at the same address. Importing it again gives the same
    /// address. Its size, or `None` when `exporter` has no such block.
    pub(super) fn import_pooled_host(
        &mut self,
        pid: usize,
        exporter: usize,
        addr: u64,
        device: usize,
    ) -> Option<usize> {
        let at = usize::try_from(addr).ok()?;
        let (block, size) = match self.processes[exporter].host.get(&at)? {
            HostRange {
                kind: HostKind::Pooled(block),
                size,
                ..
            } => (Arc::clone(block), *size),
            _ => return None,
        };
        let host = &mut self.processes[pid].host;
        match host.get(&at) {
            Some(HostRange {
                kind: HostKind::ImportedPooled(_),
                ..
            }) => {}
            Some(_) => return None,
            None => {
                host.insert(
                    at,
                    HostRange {
                        size,
                        device,
                        mapped: true,
                        portable: true,
                        kind: HostKind::ImportedPooled(block),
                    },
                );
            }
        }
        Some(size)
    }

    /// Frees process `pid`'s import of another process's host pool block at `ptr`; its size,
    /// or `None` when `ptr` is not one.
    pub(super) fn free_imported_host(&mut self, pid: usize, ptr: u64) -> Option<usize> {
        let host = &mut self.processes[pid].host;
        let at = usize::try_from(ptr).ok()?;
        if !matches!(host.get(&at)?.kind, HostKind::ImportedPooled(_)) {
            return None;
        }
        host.remove(&at).map(|h| h.size)
    }

    /// Gives a host pool's block at `ptr` back to the system; its size, or `None`.
    pub(super) fn free_pooled_host(&mut self, pid: usize, ptr: u64) -> Option<usize> {
        let host = &mut self.processes[pid].host;
        let at = usize::try_from(ptr).ok()?;
        let pinned = match &host.get(&at)?.kind {
            HostKind::Pooled(block) => {
                if Arc::strong_count(block) > 1 {
                    super::FREED_WHILE_IMPORTED.with(|n| n.set(n.get() + 1));
                }
                true
            }
            HostKind::PooledManaged(_) => false,
            _ => return None,
        };
        let size = host.remove(&at)?.size;
        if pinned {
            self.pinned -= size;
        }
        Some(size)
    }

    /// `cuMemFree` of managed memory: takes back the managed range starting at `ptr`; its size,
    /// or `None` when there is none.
    pub(super) fn free_managed(&mut self, pid: usize, ptr: u64) -> Option<usize> {
        let host = &mut self.processes[pid].host;
        let at = usize::try_from(ptr).ok()?;
        if !matches!(host.get(&at)?.kind, HostKind::Managed(_)) {
            return None;
        }
        host.remove(&at).map(|h| h.size)
    }
}
