//! Device memory: allocations in 2 MiB pages with small ones packed at 512 bytes, the backing
//! bytes, and how an address resolves for a process (unified addressing).
#![allow(unsafe_code)]

use std::collections::BTreeMap;

use driver_sys::{ContextHandle, DevicePtr, MemInfo, code};

use super::Note;
use super::config::{
    DEVICE_SPACE_BASE, DEVICE_SPACE_STRIDE, IPC_SPACE_OFFSET, PAGE_SIZE, SMALL_MAX, SimDeviceConfig,
};
use super::pool_space::PoolSpace;
use super::world::{World, context};

#[derive(Debug)]
pub(super) struct SimAlloc {
    pub(super) size: usize,
    /// Bytes of address space it occupies: `size` rounded to the alignment (small) or to whole
    /// pages (large).
    pub(super) span: usize,
    pub(super) store: u64,
    pub(super) owner: usize,
    /// A block of a stream-ordered pool: it lies in the device's pool space, whose pages its
    /// pool holds ([`PoolSpace`]).
    pub(super) pooled: bool,
    /// Freed by `cuMemFreeAsync` on a stream that has not yet reached the free: its memory
    /// stays in use until then ([`Work::AllocFreed`](super::streams::Work::AllocFreed)), and
    /// any other free of it is refused as a double free.
    pub(super) free_queued: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Page {
    /// Shared by this many small allocations.
    Small(usize),
    /// Part of one large allocation.
    Large,
}

/// One device's physical memory.
#[derive(Debug)]
pub(super) struct DeviceMem {
    pub(super) config: SimDeviceConfig,
    pub(super) allocs: BTreeMap<u64, SimAlloc>,
    /// Pages in use, by index from the device's base address.
    pub(super) pages: BTreeMap<u64, Page>,
    /// Bytes of physical allocations (`cuMemCreate`) alive on the device.
    pub(super) phys_bytes: usize,
    /// Where the device's stream-ordered pools place their blocks, and the pages they hold.
    pub(super) pool_space: PoolSpace,
}

impl DeviceMem {
    pub(super) fn base(ordinal: usize) -> u64 {
        DEVICE_SPACE_BASE + ordinal as u64 * DEVICE_SPACE_STRIDE
    }

    pub(super) fn page_addr(ordinal: usize, page: u64) -> u64 {
        Self::base(ordinal) + page * PAGE_SIZE as u64
    }

    pub(super) fn page_of(ordinal: usize, addr: u64) -> u64 {
        (addr - Self::base(ordinal)) / PAGE_SIZE as u64
    }

    /// The lowest run of `n` unused page indices.
    pub(super) fn free_pages(&self, n: u64) -> u64 {
        let mut cursor = 0;
        for &used in self.pages.keys() {
            if used - cursor >= n {
                break;
            }
            cursor = used + 1;
        }
        cursor
    }

    /// Places a small allocation of `span` bytes: the lowest aligned gap in a shared page, or a
    /// new page. Returns the address and the new page, if one is needed.
    pub(super) fn place_small(&self, ordinal: usize, span: usize) -> (u64, Option<u64>) {
        for (&page, kind) in &self.pages {
            if !matches!(kind, Page::Small(_)) {
                continue;
            }
            let start = Self::page_addr(ordinal, page);
            let end = start + PAGE_SIZE as u64;
            let mut cursor = start;
            for (&addr, a) in self.allocs.range(start..end) {
                if addr - cursor >= span as u64 {
                    break;
                }
                cursor = addr + a.span as u64;
            }
            if end - cursor >= span as u64 {
                return (cursor, None);
            }
        }
        let page = self.free_pages(1);
        (Self::page_addr(ordinal, page), Some(page))
    }

    /// The allocation containing `addr`, as (base, allocation).
    pub(super) fn containing(&self, addr: u64) -> Option<(u64, &SimAlloc)> {
        let (&base, alloc) = self.allocs.range(..=addr).next_back()?;
        (addr < base + alloc.size.max(1) as u64).then_some((base, alloc))
    }

    /// Removes the allocation at `base` and returns its pages; the caller drops its store.
    pub(super) fn remove(&mut self, ordinal: usize, base: u64) -> Option<SimAlloc> {
        let alloc = self.allocs.remove(&base)?;
        let first = Self::page_of(ordinal, base);
        if alloc.pooled {
            self.pool_space.remove(base);
        } else if alloc.size <= SMALL_MAX {
            if let Some(Page::Small(count)) = self.pages.get_mut(&first) {
                *count -= 1;
                if *count == 0 {
                    self.pages.remove(&first);
                }
            }
        } else {
            for p in first..first + (alloc.span / PAGE_SIZE) as u64 {
                self.pages.remove(&p);
            }
        }
        Some(alloc)
    }
}

/// Backing bytes of a device allocation, shared with the IPC mappings of other processes.
#[derive(Debug)]
pub(super) struct Store {
    pub(super) bytes: SparseBytes,
    pub(super) refs: usize,
}

/// Bytes that read as zeros until written, backed only in the pages written: a simulated
/// device as large as an H200 replays a program's allocations without the machine holding
/// them.
#[derive(Debug, Default)]
pub(super) struct SparseBytes {
    /// Page index -> its bytes.
    pages: BTreeMap<usize, Box<[u8]>>,
}

/// The backing page of [`SparseBytes`].
const BACKING_PAGE: usize = 64 << 10;

impl SparseBytes {
    /// Copies `dst.len()` bytes at `offset` into `dst` (zeros where nothing was written).
    pub(super) fn read(&self, offset: usize, dst: &mut [u8]) {
        let mut done = 0;
        while done < dst.len() {
            let at = offset + done;
            let (page, within) = (at / BACKING_PAGE, at % BACKING_PAGE);
            let n = (BACKING_PAGE - within).min(dst.len() - done);
            let out = &mut dst[done..done + n];
            match self.pages.get(&page) {
                Some(bytes) => out.copy_from_slice(&bytes[within..within + n]),
                None => out.fill(0),
            }
            done += n;
        }
    }

    /// Copies `src` to `offset`, backing the pages it touches.
    pub(super) fn write(&mut self, offset: usize, src: &[u8]) {
        let mut done = 0;
        while done < src.len() {
            let at = offset + done;
            let (page, within) = (at / BACKING_PAGE, at % BACKING_PAGE);
            let n = (BACKING_PAGE - within).min(src.len() - done);
            let bytes = self
                .pages
                .entry(page)
                .or_insert_with(|| vec![0; BACKING_PAGE].into_boxed_slice());
            bytes[within..within + n].copy_from_slice(&src[done..done + n]);
            done += n;
        }
    }
}

/// Who reaches memory: a process, through a context of a device.
#[derive(Clone, Copy)]
pub(super) struct Accessor {
    pub(super) pid: usize,
    pub(super) device: usize,
}

/// Where a device address leads.
pub(super) enum Loc {
    Store(u64, usize),
    Host(usize),
    /// Mapped virtual memory: (store, offset, length) per mapping the range crosses.
    Mapped(Vec<(u64, usize, usize)>),
}

impl World {
    /// Allocates `bytes` on device `i` for process `pid` (`cuMemAlloc`'s model: 2 MiB pages,
    /// small allocations packed). Where the device lacks the pages, the driver first takes
    /// back what this process's stream-ordered pools on the device cache unused, whatever
    /// their release threshold, and tries again (measured on an H100: a `cuMemAlloc`, or an
    /// allocation from another pool, that fills the device empties a pool's cache without a
    /// trim). Only blocks whose free the host has observed (a synchronisation) are taken, as
    /// measured too: a block freed but not synchronised stays reserved. The driver takes what
    /// it needs; the simulator takes every such block (a modelling choice).
    pub(super) fn alloc_device(&mut self, i: usize, pid: usize, bytes: usize) -> Result<u64, u32> {
        match self.alloc_device_now(i, pid, bytes) {
            Err(code::OUT_OF_MEMORY) if self.take_back_pool_caches(i, pid) => {
                self.alloc_device_now(i, pid, bytes)
            }
            other => other,
        }
    }

    /// Releases every block that process `pid`'s device pools on device `i` cache and whose
    /// free the host has observed; false when none cached such a block.
    pub(super) fn take_back_pool_caches(&mut self, i: usize, pid: usize) -> bool {
        let caching: Vec<u64> = self.processes[pid]
            .pools
            .iter()
            .filter(|(_, p)| p.device == i && !p.host && p.free.iter().any(|b| b.ready))
            .map(|(&h, _)| h)
            .collect();
        for &h in &caching {
            self.pool_release(pid, h, 0);
        }
        !caching.is_empty()
    }

    /// [`alloc_device`](Self::alloc_device) without taking back what pools cache.
    fn alloc_device_now(&mut self, i: usize, pid: usize, bytes: usize) -> Result<u64, u32> {
        if bytes == 0 {
            return Err(code::INVALID_VALUE);
        }
        let free = self.free_bytes(i);
        let d = &self.devices[i];
        let (addr, span, new_pages) = if bytes <= SMALL_MAX {
            let span = bytes.next_multiple_of(d.config.alignment);
            let (addr, page) = d.place_small(i, span);
            (addr, span, page.map(|p| (p, 1)))
        } else {
            let span = bytes
                .checked_next_multiple_of(PAGE_SIZE)
                .ok_or(code::OUT_OF_MEMORY)?;
            let n = (span / PAGE_SIZE) as u64;
            let first = d.free_pages(n);
            (DeviceMem::page_addr(i, first), span, Some((first, n)))
        };
        if new_pages.map_or(0, |(_, n)| n as usize * PAGE_SIZE) > free {
            return Err(code::OUT_OF_MEMORY);
        }
        let store = self.new_store();
        let d = &mut self.devices[i];
        match new_pages {
            Some((first, 1)) if bytes <= SMALL_MAX => {
                d.pages.insert(first, Page::Small(0));
            }
            Some((first, n)) => {
                for p in first..first + n {
                    d.pages.insert(p, Page::Large);
                }
            }
            None => {}
        }
        if bytes <= SMALL_MAX
            && let Some(Page::Small(count)) = d.pages.get_mut(&DeviceMem::page_of(i, addr))
        {
            *count += 1;
        }
        d.allocs.insert(
            addr,
            SimAlloc {
                size: bytes,
                span,
                store,
                owner: pid,
                pooled: false,
                free_queued: false,
            },
        );
        Ok(addr)
    }

    /// Frees process `pid`'s allocation at `ptr` on any device; returns its size.
    pub(super) fn free_device(&mut self, pid: usize, ptr: u64) -> Result<usize, u32> {
        // Unified addressing: the allocation may be on any device of this process.
        let Some(i) = self.device_of(pid, ptr) else {
            return self.free_managed(pid, ptr).ok_or(code::INVALID_VALUE);
        };
        let a = &self.devices[i].allocs[&ptr];
        if a.free_queued {
            return Err(code::INVALID_VALUE);
        }
        if a.pooled {
            return self.free_pool_allocation(pid, ptr);
        }
        Ok(self.drop_device_alloc(i, ptr))
    }

    /// Removes the plain allocation at `ptr` from device `i`'s allocations and gives up its
    /// store; returns its size.
    fn drop_device_alloc(&mut self, i: usize, ptr: u64) -> usize {
        let a = self.devices[i].remove(i, ptr).expect("a live allocation");
        self.note_if_imported(a.store);
        self.drop_store(a.store);
        a.size
    }

    /// The device whose allocations hold process `pid`'s allocation at `ptr` (unified
    /// addressing: any device of the process).
    fn device_of(&self, pid: usize, ptr: u64) -> Option<usize> {
        (0..self.devices.len()).find(|&i| {
            self.devices[i]
                .allocs
                .get(&ptr)
                .is_some_and(|a| a.owner == pid)
        })
    }

    /// `cuMemFreeAsync` of `cuMemAlloc` memory: process `pid`'s plain device allocation at
    /// `ptr` is marked as freed and its size returned; the caller queues the free on the
    /// stream, and the memory goes when the stream reaches it (measured on an H100: the call
    /// returns without waiting for the stream, and the device's free bytes rise only once the
    /// stream has run past it). `None` when `ptr` is no such allocation, or is already freed.
    pub(super) fn queue_device_free(&mut self, pid: usize, ptr: u64) -> Option<usize> {
        let i = self.device_of(pid, ptr)?;
        let a = self.devices[i].allocs.get_mut(&ptr).expect("found above");
        if a.pooled || a.free_queued {
            return None;
        }
        a.free_queued = true;
        Some(a.size)
    }

    /// The free of [`queue_device_free`](Self::queue_device_free), reached in stream order:
    /// the allocation goes, if it is still there (a context reset may have taken it first).
    pub(super) fn run_queued_device_free(&mut self, pid: usize, ptr: u64) {
        let Some(i) = self.device_of(pid, ptr) else {
            return;
        };
        if self.devices[i].allocs[&ptr].free_queued {
            self.drop_device_alloc(i, ptr);
        }
    }

    /// The owner gives up the allocation backed by `store`: if another process still maps it
    /// (a reference beyond the owner's: a process never maps its own allocations), that is the
    /// driver's undefined behaviour, counted for the test harness
    /// ([`frees_while_imported_on_this_thread`](super::frees_while_imported_on_this_thread)).
    pub(super) fn note_if_imported(&self, store: u64) {
        if self.stores.get(&store).is_some_and(|s| s.refs > 1) {
            super::FREED_WHILE_IMPORTED.with(|n| n.set(n.get() + 1));
        }
    }

    /// A new, empty store of bytes with one reference.
    pub(super) fn new_store(&mut self) -> u64 {
        let store = self.new_handle();
        self.stores.insert(
            store,
            Store {
                bytes: SparseBytes::default(),
                refs: 1,
            },
        );
        store
    }

    pub(super) fn drop_store(&mut self, id: u64) {
        if let Some(s) = self.stores.get_mut(&id) {
            s.refs -= 1;
            if s.refs == 0 {
                self.stores.remove(&id);
            }
        }
    }

    pub(super) fn free_bytes(&self, device: usize) -> usize {
        let d = &self.devices[device];
        let used = d.pages.len() * PAGE_SIZE
            + d.pool_space.held_bytes()
            + d.phys_bytes
            + d.config.context_overhead * self.live_contexts(device);
        d.config.total_mem.saturating_sub(used)
    }

    /// Copies `dst.len()` bytes from `addr`, as process `pid` sees it, into `dst`.
    ///
    /// # Safety
    ///
    /// If `addr` is mapped host memory, it is live and nothing writes it during the call (the
    /// `Driver` copy contracts).
    pub(super) unsafe fn read(&self, by: Accessor, addr: u64, dst: &mut [u8]) -> Result<(), u32> {
        match self.resolve(by, addr, dst.len())? {
            Loc::Store(id, off) => self.stores[&id].bytes.read(off, dst),
            Loc::Mapped(pieces) => {
                let mut done = 0;
                for (id, off, len) in pieces {
                    self.stores[&id].bytes.read(off, &mut dst[done..done + len]);
                    done += len;
                }
            }
            // SAFETY: `resolve` checked the range lies in a mapped host range; the caller vouches
            // that it is live and unwritten; `dst` is an exclusive borrow.
            Loc::Host(at) => unsafe {
                std::ptr::copy(
                    std::ptr::with_exposed_provenance::<u8>(at),
                    dst.as_mut_ptr(),
                    dst.len(),
                )
            },
        }
        Ok(())
    }

    /// Copies `src` to `addr`, as process `pid` sees it.
    ///
    /// # Safety
    ///
    /// If `addr` is mapped host memory, it is live and nothing else touches it during the call.
    pub(super) unsafe fn write(&mut self, by: Accessor, addr: u64, src: &[u8]) -> Result<(), u32> {
        match self.resolve(by, addr, src.len())? {
            Loc::Store(id, off) => self
                .stores
                .get_mut(&id)
                .expect("live store")
                .bytes
                .write(off, src),
            Loc::Mapped(pieces) => {
                let mut done = 0;
                for (id, off, len) in pieces {
                    let store = self.stores.get_mut(&id).expect("live store");
                    store.bytes.write(off, &src[done..done + len]);
                    done += len;
                }
            }
            // SAFETY: `resolve` checked the range lies in a mapped host range; the caller vouches
            // that it is live and untouched by anyone else.
            Loc::Host(at) => unsafe {
                std::ptr::copy(
                    src.as_ptr(),
                    std::ptr::with_exposed_provenance_mut::<u8>(at),
                    src.len(),
                )
            },
        }
        Ok(())
    }

    /// Resolves `len` bytes at `addr` as seen by process `pid` (unified addressing: any device's
    /// memory of this process, its IPC mappings, and its mapped host memory).
    ///
    /// Memory imported from another process's pool is reached only from a device the imported
    /// pool grants access to (measured on two H200s: a copy in another device's context is
    /// `CUDA_ERROR_INVALID_VALUE`).
    pub(super) fn resolve(&self, by: Accessor, addr: u64, len: usize) -> Result<Loc, u32> {
        let pid = by.pid;
        let in_range = |start: u64, size: usize| {
            addr.checked_sub(start)
                .and_then(|off| {
                    (off as usize)
                        .checked_add(len)
                        .map(|end| (off as usize, end))
                })
                .filter(|&(_, end)| end <= size)
                .map(|(off, _)| off)
        };
        for (i, d) in self.devices.iter().enumerate() {
            let base = DeviceMem::base(i);
            if addr >= base && addr < base + IPC_SPACE_OFFSET {
                let (start, a) = d.containing(addr).ok_or(code::INVALID_VALUE)?;
                if a.owner != pid {
                    return Err(code::INVALID_VALUE);
                }
                let off = in_range(start, a.size).ok_or(code::INVALID_VALUE)?;
                return Ok(Loc::Store(a.store, off));
            }
        }
        let p = &self.processes[pid];
        if p.vm.contains(addr) {
            return p
                .vm
                .segments(&self.phys, addr, len, by.device)
                .map(Loc::Mapped)
                .ok_or(code::INVALID_VALUE);
        }
        if let Some((&start, m)) = p.ipc.range(..=addr).next_back()
            && let Some(off) = in_range(start, m.size)
        {
            if let Some(pool) = m.pool.and_then(|h| p.pools.get(&h))
                && pool.device != by.device
                && !pool.access.contains(&by.device)
            {
                return Err(code::INVALID_VALUE);
            }
            return Ok(Loc::Store(m.store, off));
        }
        if let Some((&start, h)) = p.host.range(..=(addr as usize)).next_back()
            && h.mapped
            && let Some(off) = in_range(start as u64, h.size)
        {
            return Ok(Loc::Host(start + off));
        }
        Err(code::INVALID_VALUE)
    }

    /// `cuMemAlloc`: [`Driver::mem_alloc`](driver_sys::Driver::mem_alloc) in the model.
    pub(super) fn mem_alloc(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        bytes: usize,
    ) -> Result<DevicePtr, u32> {
        note.bytes = Some(bytes);
        let i = context(self, pid, ctx, note)?;
        let addr = self.alloc_device(i, pid, bytes)?;
        note.ptr = Some(DevicePtr(addr));
        Ok(DevicePtr(addr))
    }

    /// `cuMemFree`: [`Driver::mem_free`](driver_sys::Driver::mem_free) in the model.
    pub(super) fn mem_free(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        ptr: DevicePtr,
    ) -> Result<(), u32> {
        note.ptr = Some(ptr);
        let device = context(self, pid, ctx, note)?;
        if ptr.is_null() {
            return Ok(());
        }
        self.settle_recorded(pid, device)?;
        note.bytes = Some(self.free_device(pid, ptr.0)?);
        Ok(())
    }

    /// `cuMemGetInfo`: [`Driver::mem_get_info`](driver_sys::Driver::mem_get_info) in the model.
    pub(super) fn mem_get_info(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
    ) -> Result<MemInfo, u32> {
        let i = context(self, pid, ctx, note)?;
        Ok(MemInfo {
            free: self.free_bytes(i),
            total: self.devices[i].config.total_mem,
        })
    }

    /// `cuMemGetAddressRange`: [`Driver::mem_get_address_range`](driver_sys::Driver::mem_get_address_range) in the model.
    pub(super) fn mem_get_address_range(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        ptr: DevicePtr,
    ) -> Result<(DevicePtr, usize), u32> {
        note.ptr = Some(ptr);
        // Measured on two H200s: the lookup is per context. Memory of another device is
        // not found through this context, although copies and frees reach it.
        let i = context(self, pid, ctx, note)?;
        if let Some((base, a)) = self.devices[i].containing(ptr.0)
            && a.owner == pid
        {
            return Ok((DevicePtr(base), a.size));
        }
        let p = &self.processes[pid];
        if let Some(range) = p.vm.mapping_of(ptr.0) {
            return Ok(range);
        }
        if let Some((&base, m)) = p.ipc.range(..=ptr.0).next_back()
            && m.device == i
            && ptr.0 < base + m.size as u64
        {
            return Ok((DevicePtr(base), m.size));
        }
        if let Some((&base, h)) = p.host.range(..=ptr.0 as usize).next_back()
            && !h.is_pinned()
            && (ptr.0 as usize) < base + h.size
        {
            return Ok((DevicePtr(base as u64), h.size));
        }
        Err(code::NOT_FOUND)
    }
}
