//! Stream-ordered pools: allocation and free on streams, the release threshold, trimming, and
//! pools exported to other processes as file descriptors.

use std::collections::{BTreeMap, BTreeSet};
#[cfg(unix)]
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
#[cfg(unix)]
use std::os::unix::fs::MetadataExt;

use driver_sys::{
    ContextHandle, DeviceOrdinal, DevicePtr, MemLocation, MemPoolHandle, MemPoolUsage,
    PoolPtrExportData, StreamHandle, code,
};

/// Whether pool `h` of process `pid` lives in host memory, and whether it is managed.
fn p_host(w: &World, pid: usize, h: u64) -> (bool, bool) {
    w.processes[pid]
        .pools
        .get(&h)
        .map_or((false, false), |p| (p.host, p.managed))
}

use super::Note;
use super::config::PAGE_SIZE;
use super::memory::SimAlloc;
use super::streams::Work;
use super::world::{Object, World, context, device_index};

/// A block freed to a stream-ordered pool: reusable at once on the stream it was freed on,
/// on other streams once the free ran in that stream's order.
#[derive(Clone, Copy, Debug)]
pub(super) struct FreeBlock {
    pub(super) addr: u64,
    pub(super) size: usize,
    pub(super) stream: u64,
    pub(super) ready: bool,
    /// Names this free (a block freed, reused on its stream and freed again is two frees).
    pub(super) id: u64,
}

/// A stream-ordered pool (`cuMemPoolCreate`, or a device's default pool).
#[derive(Debug)]
pub(super) struct SimPool {
    pub(super) device: usize,
    /// In host memory (`CU_MEM_LOCATION_TYPE_HOST` / `HOST_NUMA`): its blocks are pinned host
    /// memory, reached at one address by the host and the devices; `device` is the device of
    /// the context that made it.
    pub(super) host: bool,
    /// A managed-memory pool (`CU_MEM_ALLOCATION_TYPE_MANAGED`); its blocks live in host
    /// memory too (`host`), not pinned.
    pub(super) managed: bool,
    pub(super) is_default: bool,
    /// Destroyed while allocations were outstanding: measured on the H200, the driver
    /// releases the pool's memory only once they are freed.
    pub(super) destroyed: bool,
    pub(super) threshold: u64,
    pub(super) reserved: usize,
    pub(super) used: usize,
    /// `CUmemPoolProps::maxSize` (0: no limit).
    pub(super) max_size: usize,
    /// High-water marks since creation or the last reset.
    pub(super) reserved_high: usize,
    pub(super) used_high: usize,
    pub(super) live: BTreeMap<u64, usize>,
    pub(super) free: Vec<FreeBlock>,
    /// Created with a shareable handle type (POSIX file descriptors): it can be exported.
    pub(super) ipc: bool,
    /// Exported to a shareable handle at least once. Measured on the H200: until then
    /// `cuMemPoolExportPointer` refuses the pool's allocations (`CUDA_ERROR_INVALID_VALUE`).
    pub(super) exported: bool,
    /// Imported from another process: (that process, its pool handle). Such a pool only
    /// imports pointers.
    pub(super) imported_from: Option<(usize, u64)>,
    /// Devices other than its own granted read-write access (`cuMemPoolSetAccess`).
    pub(super) access: BTreeSet<usize>,
}

impl SimPool {
    /// A pool of page-locked host memory (location `HOST` or `HOST_NUMA`), not managed.
    pub(super) fn in_host_memory(&self) -> bool {
        self.host && !self.managed
    }

    pub(super) fn new(device: usize, is_default: bool) -> SimPool {
        SimPool {
            device,
            host: false,
            managed: false,
            is_default,
            ipc: false,
            exported: false,
            imported_from: None,
            access: BTreeSet::new(),
            destroyed: false,
            threshold: 0,
            reserved: 0,
            used: 0,
            max_size: 0,
            reserved_high: 0,
            used_high: 0,
            live: BTreeMap::new(),
            free: Vec::new(),
        }
    }
}

/// The inode of the file `fd` names (a pipe's is unique while it is open).
#[cfg(unix)]
pub(super) fn inode(fd: BorrowedFd<'_>) -> Option<u64> {
    let file = std::fs::File::from(fd.try_clone_to_owned().ok()?);
    file.metadata().ok().map(|m| m.ino())
}

/// A new descriptor for an export, and the inode that names it: a real descriptor, so that it
/// travels like the driver's (one end of a pipe).
#[cfg(unix)]
pub(super) fn export_descriptor() -> Result<(OwnedFd, u64), u32> {
    let (reader, _writer) = std::io::pipe().map_err(|_| code::OUT_OF_MEMORY)?;
    let fd = OwnedFd::from(reader);
    let ino = inode(fd.as_fd()).ok_or(code::OUT_OF_MEMORY)?;
    Ok((fd, ino))
}

/// The step to which the driver rounds a pool's maxSize up.
const MAX_SIZE_GRAIN: usize = 32 << 20;

pub(super) const POOL_PTR_MAGIC: &[u8; 8] = b"SIMPOOLP";

/// The simulator's export data of a pool allocation: magic, process, pool handle, address.
pub(super) fn encode_pool_ptr(pid: usize, pool: u64, addr: u64) -> PoolPtrExportData {
    let mut b = [0u8; 64];
    b[..8].copy_from_slice(POOL_PTR_MAGIC);
    b[8..16].copy_from_slice(&(pid as u64).to_le_bytes());
    b[16..24].copy_from_slice(&pool.to_le_bytes());
    b[24..32].copy_from_slice(&addr.to_le_bytes());
    PoolPtrExportData(b)
}

pub(super) fn decode_pool_ptr(d: &PoolPtrExportData) -> Option<(usize, u64, u64)> {
    let b = &d.0;
    if &b[..8] != POOL_PTR_MAGIC || b[32..].iter().any(|&x| x != 0) {
        return None;
    }
    let u = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
    Some((usize::try_from(u(8)).ok()?, u(16), u(24)))
}

impl World {
    /// Gives a block of pool `h` back to the system: a device pool's block leaves the pool
    /// space (its pages unmapped once no other block of the pool lies in them), a host pool's
    /// is pinned host memory. The pool (if it is still listed) reserves what is left.
    fn free_pool_block(&mut self, pid: usize, h: u64, host: bool, addr: u64, size: usize) {
        if host {
            let _ = self.free_pooled_host(pid, addr);
            if let Some(p) = self.processes[pid].pools.get_mut(&h) {
                p.reserved -= size;
            }
            return;
        }
        let device = (0..self.devices.len()).find(|&i| {
            self.devices[i]
                .allocs
                .get(&addr)
                .is_some_and(|a| a.owner == pid && a.pooled)
        });
        if let Some(i) = device {
            let a = self.devices[i].remove(i, addr).expect("found above");
            self.note_if_imported(a.store);
            self.drop_store(a.store);
            self.note_pool_pages(pid, h, i);
        }
    }

    /// Device pool `h` of process `pid` reserves the pages it holds on device `i`.
    fn note_pool_pages(&mut self, pid: usize, h: u64, i: usize) {
        let bytes = self.devices[i].pool_space.pool_bytes(h);
        if let Some(p) = self.processes[pid].pools.get_mut(&h) {
            p.reserved = bytes;
            p.reserved_high = p.reserved_high.max(bytes);
        }
    }

    /// Releases free blocks of pool `h` of process `pid` that are ready until the pool
    /// reserves at most `keep` bytes.
    pub(super) fn pool_release(&mut self, pid: usize, h: u64, keep: usize) {
        let Some(pool) = self.processes[pid].pools.get_mut(&h) else {
            return;
        };
        let host = pool.host;
        let mut ready = Vec::new();
        pool.free.retain(|b| {
            if b.ready {
                ready.push(*b);
                false
            } else {
                true
            }
        });
        let mut ready = ready.into_iter();
        for b in ready.by_ref() {
            if self.processes[pid].pools[&h].reserved <= keep {
                self.processes[pid]
                    .pools
                    .get_mut(&h)
                    .expect("listed")
                    .free
                    .push(b);
                break;
            }
            self.free_pool_block(pid, h, host, b.addr, b.size);
        }
        let pool = self.processes[pid].pools.get_mut(&h).expect("listed");
        pool.free.extend(ready);
    }

    /// A new block of `bytes` for device pool `h` of process `pid` on device `i`, placed in
    /// the device's pool space. Where the device lacks the pages it needs, the driver first
    /// takes back what this process's pools on the device cache, as for `cuMemAlloc`
    /// ([`alloc_device`](Self::alloc_device)).
    fn alloc_pool_block(&mut self, i: usize, pid: usize, h: u64, bytes: usize) -> Result<u64, u32> {
        match self.alloc_pool_block_now(i, pid, h, bytes) {
            Err(code::OUT_OF_MEMORY) if self.take_back_pool_caches(i, pid) => {
                self.alloc_pool_block_now(i, pid, h, bytes)
            }
            other => other,
        }
    }

    /// [`alloc_pool_block`](Self::alloc_pool_block) without taking back what pools cache.
    fn alloc_pool_block_now(
        &mut self,
        i: usize,
        pid: usize,
        h: u64,
        bytes: usize,
    ) -> Result<u64, u32> {
        let d = &self.devices[i];
        let span = bytes
            .checked_next_multiple_of(d.config.alignment)
            .ok_or(code::OUT_OF_MEMORY)?;
        let addr = d
            .pool_space
            .find(h, span as u64)
            .ok_or(code::OUT_OF_MEMORY)?;
        let added = d.pool_space.pages_added(h, addr, span as u64) as usize * PAGE_SIZE;
        if added > self.free_bytes(i) {
            return Err(code::OUT_OF_MEMORY);
        }
        let store = self.new_store();
        let d = &mut self.devices[i];
        d.pool_space.insert(h, addr, span as u64);
        d.allocs.insert(
            addr,
            SimAlloc {
                size: bytes,
                span,
                store,
                owner: pid,
                pooled: true,
                free_queued: false,
            },
        );
        self.note_pool_pages(pid, h, i);
        Ok(addr)
    }

    /// `cuMemFree` of a pool's allocation at `ptr`: the block goes back to its pool, reusable
    /// on every stream at once (the driver documents that it does not synchronise: the caller
    /// must have finished with the memory); a destroyed pool's goes back to the system.
    pub(super) fn free_pool_allocation(&mut self, pid: usize, ptr: u64) -> Result<usize, u32> {
        let (&h, p) = self.processes[pid]
            .pools
            .iter_mut()
            .find(|(_, p)| p.live.contains_key(&ptr))
            .ok_or(code::INVALID_VALUE)?;
        let size = p.live.remove(&ptr).expect("found");
        p.used -= size;
        if p.destroyed {
            self.free_pool_block(pid, h, false, ptr, size);
            self.processes[pid]
                .pools
                .retain(|_, p| !(p.destroyed && p.live.is_empty()));
        } else {
            p.free.push(FreeBlock {
                addr: ptr,
                size,
                stream: 0,
                ready: true,
                id: 0,
            });
        }
        Ok(size)
    }

    /// Pool `h` of process `pid` (`CUDA_ERROR_INVALID_VALUE` when it has none such).
    pub(super) fn pool_mut(&mut self, pid: usize, h: MemPoolHandle) -> Result<&mut SimPool, u32> {
        self.processes[pid]
            .pools
            .get_mut(&h.raw())
            .ok_or(code::INVALID_VALUE)
    }

    /// Checks that `stream` is 0 (the legacy default stream) or a live stream of process `pid`.
    pub(super) fn check_stream(&self, pid: usize, stream: u64) -> Result<(), u32> {
        match self.processes[pid].objects.get(&stream) {
            _ if stream <= 2 => Ok(()),
            Some((Object::Stream, _)) => Ok(()),
            _ => Err(code::INVALID_HANDLE),
        }
    }

    /// `cuCtxSynchronize`: [`Driver::ctx_synchronize`](driver_sys::Driver::ctx_synchronize) in
    /// the model: every stream of the context's device is drained.
    pub(super) fn ctx_synchronize(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
    ) -> Result<(), u32> {
        let device = context(self, pid, ctx, note)?;
        self.drain_all(pid, device)
    }

    /// `cuStreamSynchronize`: [`Driver::stream_synchronize`](driver_sys::Driver::stream_synchronize) in the model.
    pub(super) fn stream_synchronize(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        stream: StreamHandle,
    ) -> Result<(), u32> {
        self.check_stream(pid, stream.raw())?;
        // The stream's queued work runs first (`streams`; frees in it make their blocks
        // reusable on every stream), then pools release what they reserve above their
        // threshold.
        self.drain_stream(pid, note, ctx, stream)?;
        let handles: Vec<u64> = self.processes[pid].pools.keys().copied().collect();
        for h in handles {
            let pool = self.processes[pid].pools.get(&h).expect("listed");
            let keep = usize::try_from(pool.threshold).unwrap_or(usize::MAX);
            self.pool_release(pid, h, keep);
        }
        Ok(())
    }

    /// `cuDeviceGetDefaultMemPool`: [`Driver::device_default_mem_pool`](driver_sys::Driver::device_default_mem_pool) in the model.
    pub(super) fn device_default_mem_pool(
        &mut self,
        pid: usize,
        note: &mut Note,
        dev: DeviceOrdinal,
    ) -> Result<MemPoolHandle, u32> {
        note.device = Some(dev);
        let i = dev.0 as usize;
        if !self.processes[pid].initialized {
            return Err(code::NOT_INITIALIZED);
        }
        if i >= self.devices.len() {
            return Err(code::INVALID_DEVICE);
        }
        let p = &self.processes[pid];
        if let Some((&h, _)) = p.pools.iter().find(|(_, q)| q.is_default && q.device == i) {
            return Ok(crate::sim::made(MemPoolHandle::from_raw, h));
        }
        let h = self.new_handle();
        self.processes[pid].pools.insert(h, SimPool::new(i, true));
        Ok(crate::sim::made(MemPoolHandle::from_raw, h))
    }

    /// `cuMemPoolCreate`: [`Driver::mem_pool_create`](driver_sys::Driver::mem_pool_create) in the model.
    pub(super) fn mem_pool_create(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        location: MemLocation,
        ipc: bool,
        max_size: usize,
    ) -> Result<MemPoolHandle, u32> {
        let current = context(self, pid, ctx, note)?;
        let (i, host) = match location {
            MemLocation::Device(dev) => (dev.0 as usize, false),
            MemLocation::Host | MemLocation::HostNuma(_) => (current, true),
        };
        if i >= self.devices.len() {
            return Err(code::INVALID_DEVICE);
        }
        if host {
            let config = &self.devices[i].config;
            if !config.host_memory_pools {
                return Err(code::NOT_SUPPORTED);
            }
            if matches!(location, MemLocation::HostNuma(n) if n != config.host_numa_id) {
                return Err(code::INVALID_VALUE);
            }
        }
        let h = self.new_handle();
        let mut pool = SimPool::new(i, false);
        pool.host = host;
        pool.ipc = ipc;
        // The driver holds a pool to its maxSize rounded up to 32 MiB (measured on an H100,
        // driver 580: a maxSize of 8 MiB let 32 MiB be allocated; 64 and 512 MiB held exactly).
        pool.max_size = max_size.div_ceil(MAX_SIZE_GRAIN) * MAX_SIZE_GRAIN;
        self.processes[pid].pools.insert(h, pool);
        Ok(crate::sim::made(MemPoolHandle::from_raw, h))
    }

    /// `cuMemPoolCreate` of managed memory: [`Driver::mem_pool_create_managed`](driver_sys::Driver::mem_pool_create_managed) in the
    /// model: a pool of the context's device whose blocks are host-backed, reached at one
    /// address everywhere; `CUDA_ERROR_NOT_SUPPORTED` where the device has no managed memory.
    pub(super) fn mem_pool_create_managed(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        preferred: Option<MemLocation>,
    ) -> Result<MemPoolHandle, u32> {
        let i = context(self, pid, ctx, note)?;
        if !self.devices[i].config.managed_memory {
            return Err(code::NOT_SUPPORTED);
        }
        match preferred {
            Some(MemLocation::Device(d)) if d.0 as usize >= self.devices.len() => {
                return Err(code::INVALID_DEVICE);
            }
            Some(MemLocation::HostNuma(n)) if n != self.devices[i].config.host_numa_id => {
                return Err(code::INVALID_VALUE);
            }
            _ => {}
        }
        let h = self.new_handle();
        let mut pool = SimPool::new(i, false);
        pool.host = true;
        pool.managed = true;
        self.processes[pid].pools.insert(h, pool);
        Ok(crate::sim::made(MemPoolHandle::from_raw, h))
    }

    /// `cuMemPoolDestroy`: [`Driver::mem_pool_destroy`](driver_sys::Driver::mem_pool_destroy) in the model.
    pub(super) fn mem_pool_destroy(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        pool: MemPoolHandle,
    ) -> Result<(), u32> {
        context(self, pid, ctx, note)?;
        match self.processes[pid].pools.get(&pool.raw()) {
            Some(p) if !p.is_default && !p.destroyed => {}
            _ => return Err(code::INVALID_VALUE),
        }
        let mut p = self.processes[pid]
            .pools
            .remove(&pool.raw())
            .expect("checked");
        for b in std::mem::take(&mut p.free) {
            self.free_pool_block(pid, pool.raw(), p.host, b.addr, b.size);
        }
        // The driver releases the memory of allocations still outstanding only when
        // they are freed (cuMemFreeAsync); until then the pool lingers, destroyed.
        if !p.live.is_empty() {
            p.destroyed = true;
            self.processes[pid].pools.insert(pool.raw(), p);
        }
        Ok(())
    }

    /// `cuMemPoolSetAttribute`: [`Driver::mem_pool_set_release_threshold`](driver_sys::Driver::mem_pool_set_release_threshold) in the model.
    pub(super) fn mem_pool_set_release_threshold(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        pool: MemPoolHandle,
        bytes: u64,
    ) -> Result<(), u32> {
        context(self, pid, ctx, note)?;
        let p = self.pool_mut(pid, pool)?;
        p.threshold = bytes;
        Ok(())
    }

    /// `cuMemPoolTrimTo`: [`Driver::mem_pool_trim_to`](driver_sys::Driver::mem_pool_trim_to) in the model.
    pub(super) fn mem_pool_trim_to(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        pool: MemPoolHandle,
        keep: usize,
    ) -> Result<(), u32> {
        context(self, pid, ctx, note)?;
        self.pool_mut(pid, pool)?;
        self.pool_release(pid, pool.raw(), keep);
        Ok(())
    }

    /// `cuMemPoolGetAttribute`: [`Driver::mem_pool_usage`](driver_sys::Driver::mem_pool_usage) in the model.
    pub(super) fn mem_pool_usage(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        pool: MemPoolHandle,
    ) -> Result<MemPoolUsage, u32> {
        context(self, pid, ctx, note)?;
        let p = self.pool_mut(pid, pool)?;
        Ok(MemPoolUsage {
            reserved: p.reserved as u64,
            used: p.used as u64,
            reserved_high: p.reserved_high as u64,
            used_high: p.used_high as u64,
            release_threshold: p.threshold,
        })
    }

    /// `cuMemPoolSetAttribute(RESERVED_MEM_HIGH, USED_MEM_HIGH)`: [`Driver::mem_pool_reset_high_water`](driver_sys::Driver::mem_pool_reset_high_water) in the model: the marks
    /// start again from the current figures.
    pub(super) fn mem_pool_reset_high_water(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        pool: MemPoolHandle,
    ) -> Result<(), u32> {
        context(self, pid, ctx, note)?;
        let p = self.pool_mut(pid, pool)?;
        p.reserved_high = p.reserved;
        p.used_high = p.used;
        Ok(())
    }

    /// `cuMemAllocFromPoolAsync`: [`Driver::mem_alloc_from_pool_async`](driver_sys::Driver::mem_alloc_from_pool_async) in the model.
    pub(super) fn mem_alloc_from_pool_async(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        pool: MemPoolHandle,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<DevicePtr, u32> {
        note.bytes = Some(bytes);
        let i = context(self, pid, ctx, note)?;
        self.check_stream(pid, stream.raw())?;
        let p = self.pool_mut(pid, pool)?;
        // A destroyed pool that lingers until its allocations are freed makes no new ones (its
        // handle is invalid to the caller from the destroy on); an imported pool makes none
        // either (the driver documents it).
        if bytes == 0 || p.device != i || p.imported_from.is_some() || p.destroyed {
            return Err(code::INVALID_VALUE);
        }
        // Best fit among the blocks this stream may reuse. The driver splits blocks; the
        // simulator reuses whole ones, up to three times the request, which with the remapping
        // below and the pages of the pool space (`pool_space`) holds what the driver's pool
        // holds at the first pass of each trace of the corpus, within 10 % (`corpus.csv`).
        let fits = |size: usize| size >= bytes && size <= (3 * bytes).max(PAGE_SIZE);
        let found = p
            .free
            .iter()
            .enumerate()
            .filter(|(_, b)| fits(b.size) && (b.ready || b.stream == stream.raw()))
            .min_by_key(|(_, b)| b.size)
            .map(|(k, _)| k);
        if let Some(k) = found {
            let b = p.free.swap_remove(k);
            p.used += b.size;
            p.used_high = p.used_high.max(p.used);
            p.live.insert(b.addr, b.size);
            note.ptr = Some(DevicePtr(b.addr));
            return Ok(DevicePtr(b.addr));
        }
        // A limited pool gives back what it may (blocks reusable everywhere) before it grows
        // past its limit; past it, the allocation is out of memory.
        if p.max_size > 0 && p.reserved + bytes > p.max_size {
            let keep = p.max_size.saturating_sub(bytes);
            self.pool_release(pid, pool.raw(), keep);
            let p = self.processes[pid].pools.get(&pool.raw()).expect("checked");
            if p.reserved + bytes > p.max_size {
                return Err(code::OUT_OF_MEMORY);
            }
        }
        // No free block fits: the driver maps the physical memory of the free blocks whose
        // frees ran into the new allocation rather than growing by all of it. Modelled by
        // giving those blocks back before the new one takes its pages.
        let (host, managed) = p_host(self, pid, pool.raw());
        if !host {
            let p = self.processes[pid]
                .pools
                .get_mut(&pool.raw())
                .expect("checked");
            let mut reusable = Vec::new();
            p.free.retain(|b| {
                // A block whose free has not run yet may still be written by earlier work: its
                // memory goes to no other allocation until it ran.
                let take = b.ready;
                if take {
                    reusable.push((b.addr, b.size));
                }
                !take
            });
            for (addr, size) in reusable {
                self.free_pool_block(pid, pool.raw(), false, addr, size);
            }
        }
        // Out of pages, this takes back what the process's pools cache, this one included.
        let addr = if host {
            let addr = self.alloc_pooled_host(pid, i, bytes, managed)?;
            self.processes[pid]
                .pools
                .get_mut(&pool.raw())
                .expect("checked")
                .reserved += bytes;
            addr
        } else {
            self.alloc_pool_block(i, pid, pool.raw(), bytes)?
        };
        let p = self.processes[pid]
            .pools
            .get_mut(&pool.raw())
            .expect("checked");
        p.used += bytes;
        p.reserved_high = p.reserved_high.max(p.reserved);
        p.used_high = p.used_high.max(p.used);
        p.live.insert(addr, bytes);
        note.ptr = Some(DevicePtr(addr));
        Ok(DevicePtr(addr))
    }

    /// `cuMemFreeAsync`: [`Driver::mem_free_async`](driver_sys::Driver::mem_free_async) in the model.
    pub(super) fn mem_free_async(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        ptr: DevicePtr,
        stream: StreamHandle,
    ) -> Result<(), u32> {
        note.ptr = Some(ptr);
        let i = context(self, pid, ctx, note)?;
        self.check_stream(pid, stream.raw())?;
        // A pointer imported from another process's pool: the mapping goes.
        if self.processes[pid]
            .ipc
            .get(&ptr.0)
            .is_some_and(|m| m.pool.is_some())
        {
            let m = self.processes[pid].ipc.remove(&ptr.0).expect("present");
            note.bytes = Some(m.size);
            self.drop_store(m.store);
            return Ok(());
        }
        if let Some(size) = self.free_imported_host(pid, ptr.0) {
            note.bytes = Some(size);
            return Ok(());
        }
        let Some((h, device)) = self.processes[pid]
            .pools
            .iter()
            .find(|(_, p)| p.live.contains_key(&ptr.0))
            .map(|(&h, p)| (h, p.device))
        else {
            // `cuMemAlloc` memory: freed in stream order, once the stream reaches the free.
            let size = self
                .queue_device_free(pid, ptr.0)
                .ok_or(code::INVALID_VALUE)?;
            note.bytes = Some(size);
            return self.enqueue(pid, i, stream, Work::AllocFreed { ptr: ptr.0 });
        };
        if let Some(a) = self.devices[device].allocs.get(&ptr.0) {
            self.note_if_imported(a.store);
        }
        let id = self.new_handle();
        let p = self.processes[pid].pools.get_mut(&h).expect("found above");
        let size = p.live.remove(&ptr.0).expect("found");
        note.bytes = Some(size);
        p.used -= size;
        if p.destroyed {
            let gone = p.live.is_empty();
            let host = p.host;
            self.free_pool_block(pid, h, host, ptr.0, size);
            if gone {
                self.processes[pid]
                    .pools
                    .retain(|_, p| !(p.destroyed && p.live.is_empty()));
            }
            return Ok(());
        }
        p.free.push(FreeBlock {
            addr: ptr.0,
            size,
            stream: stream.raw(),
            ready: false,
            id,
        });
        self.enqueue(pid, i, stream, Work::PoolFreed { id })
    }

    /// `cuMemPoolExportToShareableHandle`: [`Driver::mem_pool_export_fd`](driver_sys::Driver::mem_pool_export_fd) in the model.
    #[cfg(unix)]
    pub(super) fn mem_pool_export_fd(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        pool: MemPoolHandle,
    ) -> Result<OwnedFd, u32> {
        context(self, pid, ctx, note)?;
        let p = self.pool_mut(pid, pool)?;
        // Only a pool created with a shareable handle type exports, and not one that
        // was itself imported or destroyed.
        if !p.ipc || p.destroyed || p.imported_from.is_some() {
            return Err(code::INVALID_VALUE);
        }
        p.exported = true;
        let (fd, ino) = export_descriptor()?;
        self.pool_exports.insert(ino, (pid, pool.raw()));
        Ok(fd)
    }

    /// `cuMemPoolImportFromShareableHandle`: [`Driver::mem_pool_import_fd`](driver_sys::Driver::mem_pool_import_fd) in the model.
    #[cfg(unix)]
    pub(super) fn mem_pool_import_fd(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        fd: BorrowedFd<'_>,
    ) -> Result<MemPoolHandle, u32> {
        let ino = inode(fd);
        context(self, pid, ctx, note)?;
        let &(exporter, h) = ino
            .and_then(|ino| self.pool_exports.get(&ino))
            .ok_or(code::INVALID_VALUE)?;
        // The exporter's own process does not import its pool (a modelling choice:
        // emm never does it).
        if exporter == pid {
            return Err(code::INVALID_VALUE);
        }
        let device = match self.processes[exporter].pools.get(&h) {
            Some(p) if !p.destroyed => p.device,
            _ => return Err(code::INVALID_VALUE),
        };
        let mut imported = SimPool::new(device, false);
        imported.imported_from = Some((exporter, h));
        let handle = self.new_handle();
        self.processes[pid].pools.insert(handle, imported);
        Ok(crate::sim::made(MemPoolHandle::from_raw, handle))
    }

    /// `cuMemPoolExportPointer`: [`Driver::mem_pool_export_pointer`](driver_sys::Driver::mem_pool_export_pointer) in the model.
    pub(super) fn mem_pool_export_pointer(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        ptr: DevicePtr,
    ) -> Result<PoolPtrExportData, u32> {
        note.ptr = Some(ptr);
        context(self, pid, ctx, note)?;
        let (&h, _) = self.processes[pid]
            .pools
            .iter()
            .find(|(_, p)| p.exported && !p.destroyed && p.live.contains_key(&ptr.0))
            .ok_or(code::INVALID_VALUE)?;
        Ok(encode_pool_ptr(pid, h, ptr.0))
    }

    /// `cuMemPoolImportPointer`: [`Driver::mem_pool_import_pointer`](driver_sys::Driver::mem_pool_import_pointer) in the model.
    pub(super) fn mem_pool_import_pointer(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        pool: MemPoolHandle,
        data: &PoolPtrExportData,
    ) -> Result<DevicePtr, u32> {
        let data = *data;
        context(self, pid, ctx, note)?;
        let (exporter, h, addr) = decode_pool_ptr(&data).ok_or(code::INVALID_VALUE)?;
        let p = self.pool_mut(pid, pool)?;
        if p.imported_from != Some((exporter, h)) {
            return Err(code::INVALID_VALUE);
        }
        let device = p.device;
        // The exporter's allocation must still be live in its pool.
        let Some(source) = self.processes[exporter].pools.get(&h) else {
            return Err(code::INVALID_VALUE);
        };
        let live = source.live.contains_key(&addr);
        if source.in_host_memory() {
            // A pool in host memory: the importer reaches the same pinned bytes (measured on
            // an H100: a host NUMA pool's buffer opened in another process reads the
            // exporter's bytes).
            let size = live
                .then(|| self.import_pooled_host(pid, exporter, addr, device))
                .flatten()
                .ok_or(code::INVALID_VALUE)?;
            note.ptr = Some(DevicePtr(addr));
            note.bytes = Some(size);
            return Ok(DevicePtr(addr));
        }
        let alloc = self.devices[device]
            .allocs
            .get(&addr)
            .filter(|a| live && a.owner == exporter)
            .ok_or(code::INVALID_VALUE)?;
        let (store, size) = (alloc.store, alloc.size);
        // Imported already through this pool: the driver hands back the same address, and
        // does not count imports (measured on an H100: one free unmaps it).
        let known = self.processes[pid]
            .ipc
            .iter()
            .find(|(_, m)| m.store == store && m.pool == Some(pool.raw()))
            .map(|(&at, _)| at);
        let at = match known {
            Some(at) => at,
            None => self.map_store(pid, device, store, size, Some(pool.raw())),
        };
        note.ptr = Some(DevicePtr(at));
        note.bytes = Some(size);
        Ok(DevicePtr(at))
    }

    /// `cuMemPoolGetAccess`: [`Driver::mem_pool_can_access`](driver_sys::Driver::mem_pool_can_access) in the model.
    pub(super) fn mem_pool_can_access(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        pool: MemPoolHandle,
        dev: DeviceOrdinal,
    ) -> Result<bool, u32> {
        context(self, pid, ctx, note)?;
        note.device = Some(dev);
        let d = device_index(self, dev)?;
        let p = self.pool_mut(pid, pool)?;
        // A pool in host memory gives no device access until it is granted (measured on an
        // H100: `cuMemPoolGetAccess` answers none for the context's own device).
        Ok((p.device == d && !p.in_host_memory()) || p.access.contains(&d))
    }

    /// `cuMemPoolSetAccess`: [`Driver::mem_pool_grant_access`](driver_sys::Driver::mem_pool_grant_access) in the model.
    pub(super) fn mem_pool_grant_access(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        pool: MemPoolHandle,
        dev: DeviceOrdinal,
    ) -> Result<(), u32> {
        context(self, pid, ctx, note)?;
        note.device = Some(dev);
        let d = device_index(self, dev)?;
        let peers = self.peer_access;
        let p = self.pool_mut(pid, pool)?;
        if p.in_host_memory() {
            p.access.insert(d);
        } else if d != p.device {
            if !peers {
                return Err(code::PEER_ACCESS_UNSUPPORTED);
            }
            p.access.insert(d);
        }
        Ok(())
    }
}
