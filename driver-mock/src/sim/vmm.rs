//! Virtual memory management: address reservations, physical allocations, and the mappings
//! between them (`cuMemAddressReserve`, `cuMemCreate`, `cuMemMap`, `cuMemSetAccess`,
//! `cuMemUnmap`, `cuMemRelease`, `cuMemAddressFree`).
//!
//! The rules modelled:
//!
//! - Sizes and addresses are multiples of the granularity (2 MiB, measured on an H200).
//! - A physical allocation takes device memory (`cuMemGetInfo` counts it) from its creation
//!   until it is released and no mapping of it is left.
//! - A mapping covers a whole physical allocation at a granularity-aligned address inside a
//!   reservation of the process, where nothing else is mapped; memory there is reached from a
//!   device (its contexts' copies) only after `cuMemSetAccess` for that device, and ranges
//!   that span mappings are reached as one.
//! - `cuMemUnmap` and `cuMemSetAccess` take a range of whole mappings, with no gap; a
//!   reservation is freed whole, with nothing mapped in it.
//! - Destroying a context frees the process's physical allocations on that device and their
//!   mappings, and the reservations made in that context (a modelling choice the conformance
//!   tests hold to the driver).

use std::collections::BTreeMap;

use driver_sys::{ContextHandle, DeviceOrdinal, DevicePtr, PhysHandle, code};

use super::Note;
use super::config::PAGE_SIZE;
use super::world::{World, context, device_index};

/// The granularity of every size and address.
pub(super) const GRANULARITY: usize = PAGE_SIZE;

/// Where process `pid`'s reservations start: a range of their own, apart from the devices'.
const VMM_SPACE_BASE: u64 = 0x4000_0000_0000;
const VMM_SPACE_STRIDE: u64 = 1 << 42;

/// A physical allocation (`cuMemCreate`).
#[derive(Debug)]
pub(super) struct Phys {
    pub(super) owner: usize,
    pub(super) device: usize,
    pub(super) size: usize,
    pub(super) store: u64,
    pub(super) released: bool,
    pub(super) mappings: usize,
    /// Made with a POSIX file descriptor as a requested handle type: it may be exported.
    pub(super) shareable: bool,
    /// For a handle imported from a descriptor: the handle made by `cuMemCreate`, which
    /// counts the device's bytes. The memory goes with the last handle and mapping.
    pub(super) origin: Option<u64>,
    /// For a handle made by `cuMemCreate`: how many imported handles refer to it.
    pub(super) imports: usize,
}

/// No process: the owner of a physical allocation whose context was destroyed while another
/// process still holds a handle imported from it.
const ORPHAN: usize = usize::MAX;

/// One mapping of a physical allocation in a reservation.
#[derive(Debug)]
pub(super) struct VmMap {
    pub(super) size: usize,
    pub(super) handle: u64,
    /// Bit `d` set: device `d` may read and write it (`cuMemSetAccess`).
    pub(super) access: u64,
}

/// An address reservation (`cuMemAddressReserve`) and what is mapped in it, by address.
#[derive(Debug, Default)]
pub(super) struct Reservation {
    pub(super) size: usize,
    /// The device of the context that made it: destroying that context frees it.
    pub(super) device: usize,
    pub(super) maps: BTreeMap<u64, VmMap>,
}

/// A process's reservations, and where the next one goes.
#[derive(Debug, Default)]
pub(super) struct VmSpace {
    pub(super) reservations: BTreeMap<u64, Reservation>,
    next: u64,
}

fn aligned(x: u64) -> bool {
    x.is_multiple_of(GRANULARITY as u64)
}

impl VmSpace {
    /// The reservation holding `addr .. addr + len`, as (base, reservation).
    fn holding(&self, addr: u64, len: usize) -> Option<(u64, &Reservation)> {
        let (&base, r) = self.reservations.range(..=addr).next_back()?;
        (addr.checked_add(len as u64)? <= base + r.size as u64).then_some((base, r))
    }

    /// The reservation holding `addr` at all.
    pub(super) fn contains(&self, addr: u64) -> bool {
        self.holding(addr, 1).is_some()
    }

    /// The mapping holding `addr`, as (start, size): what `cuMemGetAddressRange` gives for
    /// mapped memory.
    pub(super) fn mapping_of(&self, addr: u64) -> Option<(DevicePtr, usize)> {
        let (_, r) = self.holding(addr, 1)?;
        let (&start, m) = r.maps.range(..=addr).next_back()?;
        (addr < start + m.size as u64).then_some((DevicePtr(start), m.size))
    }

    /// The addresses of the mappings that exactly cover `addr .. addr + len`, in order, or
    /// `None` where a gap or a partial mapping is in the way.
    fn whole_maps(&self, addr: u64, len: usize) -> Option<(u64, Vec<u64>)> {
        let (base, r) = self.holding(addr, len)?;
        let end = addr + len as u64;
        let mut at = addr;
        let mut maps = Vec::new();
        for (&start, m) in r.maps.range(addr..end) {
            if start != at {
                return None;
            }
            at = start + m.size as u64;
            maps.push(start);
        }
        (at == end && !maps.is_empty()).then_some((base, maps))
    }

    /// The stores and offsets behind `addr .. addr + len`: one piece per mapping crossed, each
    /// mapping accessible to `device`; `None` where a gap or an inaccessible mapping is in the
    /// way.
    pub(super) fn segments(
        &self,
        phys: &BTreeMap<u64, Phys>,
        addr: u64,
        len: usize,
        device: usize,
    ) -> Option<Vec<(u64, usize, usize)>> {
        let (_, r) = self.holding(addr, len.max(1))?;
        let end = addr + len as u64;
        let mut out = Vec::new();
        let mut at = addr;
        // The mapping that holds `addr` may start before it.
        let first = r.maps.range(..=addr).next_back().map(|(&s, _)| s)?;
        for (&start, m) in r.maps.range(first..) {
            if at >= end {
                break;
            }
            let map_end = start + m.size as u64;
            if start > at || map_end <= at || m.access & (1 << device) == 0 {
                return None;
            }
            let take = (map_end.min(end) - at) as usize;
            let store = phys.get(&m.handle)?.store;
            out.push((store, (at - start) as usize, take));
            at += take as u64;
        }
        (at >= end).then_some(out)
    }
}

impl World {
    fn check_vmm(&self, device: usize) -> Result<(), u32> {
        if self.devices[device].config.vmm {
            Ok(())
        } else {
            Err(code::NOT_SUPPORTED)
        }
    }

    /// `cuMemGetAllocationGranularity`: [`Driver::mem_vmm_granularity`](driver_sys::Driver::mem_vmm_granularity) in the model.
    pub(super) fn mem_vmm_granularity(
        &mut self,
        _pid: usize,
        note: &mut Note,
        dev: DeviceOrdinal,
    ) -> Result<usize, u32> {
        note.device = Some(dev);
        let i = device_index(self, dev)?;
        self.check_vmm(i)?;
        Ok(GRANULARITY)
    }

    /// `cuMemAddressReserve`: [`Driver::mem_address_reserve`](driver_sys::Driver::mem_address_reserve) in the model.
    pub(super) fn mem_address_reserve(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        size: usize,
    ) -> Result<DevicePtr, u32> {
        note.bytes = Some(size);
        let i = context(self, pid, ctx, note)?;
        self.check_vmm(i)?;
        if size == 0 || !aligned(size as u64) {
            return Err(code::INVALID_VALUE);
        }
        let space = &mut self.processes[pid].vm;
        let base = VMM_SPACE_BASE + pid as u64 * VMM_SPACE_STRIDE + space.next;
        // A size past the process's address space (however large: the driver refuses, it does
        // not wrap) is out of memory.
        let end = (space.next).checked_add(size as u64);
        if end.is_none_or(|end| end > VMM_SPACE_STRIDE) {
            return Err(code::OUT_OF_MEMORY);
        }
        // A page between reservations, so that none is adjacent to the next.
        space.next += (size + GRANULARITY) as u64;
        space.reservations.insert(
            base,
            Reservation {
                size,
                device: i,
                maps: BTreeMap::new(),
            },
        );
        note.ptr = Some(DevicePtr(base));
        Ok(DevicePtr(base))
    }

    /// `cuMemAddressFree`: [`Driver::mem_address_free`](driver_sys::Driver::mem_address_free) in the model.
    pub(super) fn mem_address_free(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        ptr: DevicePtr,
        size: usize,
    ) -> Result<(), u32> {
        note.ptr = Some(ptr);
        note.bytes = Some(size);
        let device = context(self, pid, ctx, note)?;
        self.settle_recorded(pid, device)?;
        let space = &mut self.processes[pid].vm;
        match space.reservations.get(&ptr.0) {
            Some(r) if r.size == size && r.maps.is_empty() => {
                space.reservations.remove(&ptr.0);
                Ok(())
            }
            _ => Err(code::INVALID_VALUE),
        }
    }

    /// `cuMemCreate`: [`Driver::mem_create`](driver_sys::Driver::mem_create) in the model.
    pub(super) fn mem_create(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        dev: DeviceOrdinal,
        size: usize,
        shareable: bool,
    ) -> Result<PhysHandle, u32> {
        note.bytes = Some(size);
        context(self, pid, ctx, note)?;
        let i = device_index(self, dev)?;
        note.device = Some(dev);
        self.check_vmm(i)?;
        if shareable && !self.devices[i].config.posix_fd_handles {
            return Err(code::NOT_SUPPORTED);
        }
        if size == 0 || !aligned(size as u64) {
            return Err(code::INVALID_VALUE);
        }
        if size > self.free_bytes(i) {
            return Err(code::OUT_OF_MEMORY);
        }
        let store = self.new_store();
        let handle = self.new_handle();
        self.phys.insert(
            handle,
            Phys {
                owner: pid,
                device: i,
                size,
                store,
                released: false,
                mappings: 0,
                shareable,
                origin: None,
                imports: 0,
            },
        );
        self.devices[i].phys_bytes += size;
        Ok(crate::sim::made(PhysHandle::from_raw, handle))
    }

    /// `cuMemExportToShareableHandle`: [`Driver::mem_export_fd`](driver_sys::Driver::mem_export_fd) in the model.
    #[cfg(unix)]
    pub(super) fn mem_export_fd(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        handle: PhysHandle,
    ) -> Result<std::os::fd::OwnedFd, u32> {
        context(self, pid, ctx, note)?;
        let origin = match self.phys.get(&handle.raw()) {
            Some(p) if p.owner == pid && !p.released => {
                note.bytes = Some(p.size);
                // An imported handle exports the allocation it names, as the driver's does.
                if !p.shareable {
                    return Err(code::INVALID_VALUE);
                }
                p.origin.unwrap_or(handle.raw())
            }
            _ => return Err(code::INVALID_VALUE),
        };
        let (fd, ino) = super::pools::export_descriptor()?;
        self.phys_exports.insert(ino, origin);
        Ok(fd)
    }

    /// `cuMemImportFromShareableHandle`: [`Driver::mem_import_fd`](driver_sys::Driver::mem_import_fd) in the model.
    #[cfg(unix)]
    pub(super) fn mem_import_fd(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        fd: std::os::fd::BorrowedFd<'_>,
    ) -> Result<PhysHandle, u32> {
        let ino = super::pools::inode(fd);
        context(self, pid, ctx, note)?;
        let origin = *ino
            .and_then(|ino| self.phys_exports.get(&ino))
            .ok_or(code::INVALID_VALUE)?;
        // The allocation is gone once its last handle and mapping went, whatever descriptors
        // still name it.
        let Some(root) = self.phys.get_mut(&origin) else {
            return Err(code::INVALID_VALUE);
        };
        root.imports += 1;
        let (device, size, store) = (root.device, root.size, root.store);
        note.bytes = Some(size);
        note.device = Some(DeviceOrdinal(device as u32));
        self.stores
            .get_mut(&store)
            .expect("a live allocation's store")
            .refs += 1;
        let handle = self.new_handle();
        self.phys.insert(
            handle,
            Phys {
                owner: pid,
                device,
                size,
                store,
                released: false,
                mappings: 0,
                shareable: true,
                origin: Some(origin),
                imports: 0,
            },
        );
        Ok(crate::sim::made(PhysHandle::from_raw, handle))
    }

    /// Forgets physical allocation `handle` if it is released and unmapped (and, for one made
    /// by `cuMemCreate`, no imported handle refers to it).
    fn drop_phys_if_unused(&mut self, handle: u64) {
        let unused = self
            .phys
            .get(&handle)
            .is_some_and(|p| p.released && p.mappings == 0 && p.imports == 0);
        if unused {
            self.forget_phys(handle);
        }
    }

    /// Removes physical allocation `handle`: an imported handle goes, and with the last handle
    /// to it the memory and its bytes go.
    fn forget_phys(&mut self, handle: u64) {
        let p = self.phys.remove(&handle).expect("a physical allocation");
        self.drop_store(p.store);
        match p.origin {
            Some(origin) => {
                if let Some(root) = self.phys.get_mut(&origin) {
                    root.imports -= 1;
                }
                self.drop_phys_if_unused(origin);
            }
            None => self.devices[p.device].phys_bytes -= p.size,
        }
    }

    /// `cuMemRelease`: [`Driver::mem_release`](driver_sys::Driver::mem_release) in the model.
    pub(super) fn mem_release(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        handle: PhysHandle,
    ) -> Result<(), u32> {
        context(self, pid, ctx, note)?;
        match self.phys.get_mut(&handle.raw()) {
            Some(p) if p.owner == pid && !p.released => {
                note.bytes = Some(p.size);
                p.released = true;
            }
            _ => return Err(code::INVALID_VALUE),
        }
        self.drop_phys_if_unused(handle.raw());
        Ok(())
    }

    /// `cuMemMap`: [`Driver::mem_map`](driver_sys::Driver::mem_map) in the model.
    pub(super) fn mem_map(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        ptr: DevicePtr,
        size: usize,
        handle: PhysHandle,
    ) -> Result<(), u32> {
        note.ptr = Some(ptr);
        note.bytes = Some(size);
        context(self, pid, ctx, note)?;
        let p = match self.phys.get(&handle.raw()) {
            Some(p) if p.owner == pid && !p.released => p,
            _ => return Err(code::INVALID_HANDLE),
        };
        if p.size != size || !aligned(ptr.0) {
            return Err(code::INVALID_VALUE);
        }
        let space = &mut self.processes[pid].vm;
        let Some((base, _)) = space.holding(ptr.0, size) else {
            return Err(code::INVALID_VALUE);
        };
        let r = space.reservations.get_mut(&base).expect("found");
        let end = ptr.0 + size as u64;
        let overlaps = r
            .maps
            .range(..end)
            .next_back()
            .is_some_and(|(&s, m)| s + m.size as u64 > ptr.0);
        if overlaps {
            return Err(code::INVALID_VALUE);
        }
        r.maps.insert(
            ptr.0,
            VmMap {
                size,
                handle: handle.raw(),
                access: 0,
            },
        );
        self.phys.get_mut(&handle.raw()).expect("checked").mappings += 1;
        Ok(())
    }

    /// `cuMemSetAccess`: [`Driver::mem_set_access`](driver_sys::Driver::mem_set_access) in the model.
    pub(super) fn mem_set_access(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        ptr: DevicePtr,
        size: usize,
        dev: DeviceOrdinal,
    ) -> Result<(), u32> {
        note.ptr = Some(ptr);
        note.bytes = Some(size);
        context(self, pid, ctx, note)?;
        let d = device_index(self, dev)?;
        let space = &mut self.processes[pid].vm;
        let (base, maps) = space.whole_maps(ptr.0, size).ok_or(code::INVALID_VALUE)?;
        let r = space.reservations.get_mut(&base).expect("found");
        for at in maps {
            r.maps.get_mut(&at).expect("found").access |= 1 << d;
        }
        Ok(())
    }

    /// `cuMemUnmap`: [`Driver::mem_unmap`](driver_sys::Driver::mem_unmap) in the model.
    pub(super) fn mem_unmap(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        ptr: DevicePtr,
        size: usize,
    ) -> Result<(), u32> {
        note.ptr = Some(ptr);
        note.bytes = Some(size);
        let device = context(self, pid, ctx, note)?;
        self.settle_recorded(pid, device)?;
        let space = &mut self.processes[pid].vm;
        let (base, maps) = space.whole_maps(ptr.0, size).ok_or(code::INVALID_VALUE)?;
        let r = space.reservations.get_mut(&base).expect("found");
        let handles: Vec<u64> = maps
            .into_iter()
            .map(|at| r.maps.remove(&at).expect("found").handle)
            .collect();
        for h in handles {
            if let Some(p) = self.phys.get_mut(&h) {
                p.mappings -= 1;
            }
            self.drop_phys_if_unused(h);
        }
        Ok(())
    }

    /// Destroying process `pid`'s context on `device`: its physical allocations there go, and
    /// their mappings with them.
    pub(super) fn destroy_vmm_of(&mut self, pid: usize, device: usize) {
        let gone: Vec<u64> = self
            .phys
            .iter()
            .filter(|(_, p)| p.owner == pid && p.device == device)
            .map(|(&h, _)| h)
            .collect();
        let space = &mut self.processes[pid].vm;
        space.reservations.retain(|_, r| r.device != device);
        for r in space.reservations.values_mut() {
            r.maps.retain(|_, m| !gone.contains(&m.handle));
        }
        for h in gone {
            // Memory another process imported lives on, with no owner, until its last
            // imported handle goes.
            let p = self.phys.get_mut(&h).expect("listed above");
            if p.imports > 0 {
                p.owner = ORPHAN;
                p.released = true;
                p.mappings = 0;
            } else {
                self.forget_phys(h);
            }
        }
    }
}
