//! The machine and its processes: devices, primary contexts and their reference counts,
//! streams, events and modules, and what destroying a context takes with it.

use std::collections::BTreeMap;

use driver_sys::{
    ContextHandle, DeviceAttribute, DeviceOrdinal, DevicePtr, HostPtr, PhysHandle, code,
};

use super::Note;
use super::config::{CONTEXT_HANDLE_BASE, HANDLE_BASE};
use super::host::HostKind;
use super::host::HostRange;
use super::ipc::IpcMap;
use super::log::{CallRecord, Fault, LeakReport};
use super::memory::{DeviceMem, Store};
use super::pools::SimPool;

#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Ctx {
    pub(super) refcount: u32,
    /// Whether the primary context exists (retained, not reset since).
    pub(super) live: bool,
    /// The devices whose contexts this one has peer access to (bit per device), as
    /// `cuCtxEnablePeerAccess` granted it; lost when either context is destroyed.
    pub(super) peers: u64,
}

#[derive(Debug)]
pub(super) struct Process {
    pub(super) initialized: bool,
    pub(super) contexts: Vec<Ctx>,
    pub(super) log: Vec<CallRecord>,
    pub(super) faults: Vec<(Fault, u64)>,
    pub(super) host: BTreeMap<usize, HostRange>,
    /// Streams, events and modules: handle → (kind, device).
    pub(super) objects: BTreeMap<u64, (Object, usize)>,
    pub(super) ipc: BTreeMap<u64, IpcMap>,
    /// Stream-ordered pools: handle → pool (the default pools included).
    pub(super) pools: BTreeMap<u64, SimPool>,
    /// What destroying this process's contexts took with it while it was still held.
    pub(super) reclaimed: LeakReport,
    /// Stream queues and event states.
    pub(super) streams: super::streams::Streams,
    /// Address reservations and their mappings (`vmm.rs`).
    pub(super) vm: super::vmm::VmSpace,
    /// Captures under way, by id (`capture.rs`).
    pub(super) captures: BTreeMap<u64, super::capture::SimCapture>,
    /// Graphs by handle, executable graphs (handle → graph), and graph allocations by address.
    pub(super) graphs: BTreeMap<u64, super::capture::SimGraph>,
    pub(super) execs: BTreeMap<u64, u64>,
    pub(super) graph_allocs: BTreeMap<u64, super::capture::GraphAlloc>,
}

impl Process {
    pub(super) fn new(devices: usize) -> Process {
        Process {
            initialized: false,
            contexts: vec![Ctx::default(); devices],
            log: Vec::new(),
            faults: Vec::new(),
            host: BTreeMap::new(),
            objects: BTreeMap::new(),
            ipc: BTreeMap::new(),
            pools: BTreeMap::new(),
            reclaimed: LeakReport::default(),
            streams: super::streams::Streams::default(),
            vm: super::vmm::VmSpace::default(),
            captures: BTreeMap::new(),
            graphs: BTreeMap::new(),
            execs: BTreeMap::new(),
            graph_allocs: BTreeMap::new(),
        }
    }
}

/// A context object the simulator hands out handles for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Object {
    Stream,
    Event,
    Module,
}

#[derive(Debug)]
pub(super) struct World {
    pub(super) devices: Vec<DeviceMem>,
    pub(super) stores: BTreeMap<u64, Store>,
    pub(super) processes: Vec<Process>,
    pub(super) peer_access: bool,
    pub(super) pinned_limit: usize,
    pub(super) pinned: usize,
    pub(super) next_handle: u64,
    /// Pools exported as file descriptors: the descriptor's inode → (process, pool handle).
    /// The descriptors are real (pipes), so they can be passed like the driver's.
    #[cfg_attr(not(unix), allow(dead_code))]
    pub(super) pool_exports: BTreeMap<u64, (usize, u64)>,
    /// Physical allocations (`cuMemCreate`, and handles imported from descriptors) by handle
    /// (`vmm.rs`).
    pub(super) phys: BTreeMap<u64, super::vmm::Phys>,
    /// Physical allocations exported as file descriptors: the descriptor's inode → the
    /// handle `cuMemCreate` made. Real descriptors (pipes), as for pools.
    #[cfg_attr(not(unix), allow(dead_code))]
    pub(super) phys_exports: BTreeMap<u64, u64>,
    /// With [`SimDriver::quarantine_host_frees`](super::SimDriver::quarantine_host_frees):
    /// `cuMemHostAlloc` blocks `cuMemFreeHost` freed, kept filled with
    /// [`QUARANTINE_BYTE`](super::host::QUARANTINE_BYTE) rather than given back, so that a
    /// write after the free shows.
    pub(super) quarantine: Option<Vec<super::host::HostBlock>>,
}

pub(super) fn device_index(w: &World, dev: DeviceOrdinal) -> Result<usize, u32> {
    let i = dev.0 as usize;
    if i < w.devices.len() {
        Ok(i)
    } else {
        Err(code::INVALID_DEVICE)
    }
}

/// The device behind a context handle of process `pid`, if its context exists.
pub(super) fn context(
    w: &World,
    pid: usize,
    ctx: ContextHandle,
    note: &mut Note,
) -> Result<usize, u32> {
    let index = ctx
        .raw()
        .checked_sub(CONTEXT_HANDLE_BASE)
        .filter(|off| off % 0x100 == 0)
        .map(|off| (off / 0x100) as usize)
        .filter(|&i| i < w.devices.len())
        .ok_or(code::INVALID_CONTEXT)?;
    note.device = Some(DeviceOrdinal(index as u32));
    if !w.processes[pid].contexts[index].live {
        return Err(code::CONTEXT_IS_DESTROYED);
    }
    Ok(index)
}

/// The bit of device `index` in [`Ctx::peers`]; the model keeps grants to the first 64
/// devices only (a grant to a later one is never remembered, so it is never "already enabled").
fn peer_bit(index: usize) -> u64 {
    u32::try_from(index)
        .ok()
        .and_then(|i| 1u64.checked_shl(i))
        .unwrap_or(0)
}

/// Whether `image` looks like something `cuModuleLoadData` accepts: PTX text or an ELF cubin.
pub(super) fn plausible_image(image: &[u8]) -> bool {
    image.starts_with(b"\x7fELF") || image.windows(8).any(|w| w == b".version")
}

impl World {
    pub(super) fn new_handle(&mut self) -> u64 {
        self.next_handle += 0x10;
        HANDLE_BASE + self.next_handle
    }

    pub(super) fn live_contexts(&self, device: usize) -> usize {
        self.processes
            .iter()
            .filter(|p| p.contexts[device].live)
            .count()
    }

    /// Destroys process `pid`'s context on `device` and everything it owned there.
    pub(super) fn destroy_context(&mut self, pid: usize, device: usize) {
        let held = self.held(pid, Some(device));
        self.processes[pid].reclaimed.absorb(held);
        let bases: Vec<u64> = self.devices[device]
            .allocs
            .iter()
            .filter(|(_, a)| a.owner == pid)
            .map(|(&b, _)| b)
            .collect();
        for base in bases {
            if let Some(a) = self.devices[device].remove(device, base) {
                self.note_if_imported(a.store);
                self.drop_store(a.store);
            }
        }
        self.drop_streams_of(pid, device);
        self.destroy_vmm_of(pid, device);
        let p = &mut self.processes[pid];
        p.contexts[device].live = false;
        p.contexts[device].peers = 0;
        for c in &mut p.contexts {
            c.peers &= !peer_bit(device);
        }
        p.objects.retain(|_, (_, d)| *d != device);
        // The pools' memory went with the allocations above.
        p.pools.retain(|_, pool| pool.device != device);
        let mut freed_pinned = 0;
        p.host.retain(|_, h| {
            let keep = h.device != device || h.survives_its_context();
            if !keep && h.is_pinned() {
                freed_pinned += h.size;
            }
            keep
        });
        let mappings: Vec<u64> = p
            .ipc
            .iter()
            .filter(|(_, m)| m.device == device)
            .map(|(&a, _)| a)
            .collect();
        let stores: Vec<u64> = mappings
            .iter()
            .filter_map(|a| p.ipc.remove(a))
            .map(|m| m.store)
            .collect();
        self.pinned -= freed_pinned;
        for s in stores {
            self.drop_store(s);
        }
    }

    /// What process `pid` holds: everything (`None`; the leak report), or what its context on
    /// one device holds (`Some(device)`): what destroying that context would reclaim, so
    /// memory that survives its context is left out.
    pub(super) fn held(&self, pid: usize, device: Option<usize>) -> LeakReport {
        let p = &self.processes[pid];
        let on = |d: usize| device.is_none_or(|x| x == d);
        let mut r = LeakReport::default();
        for (i, d) in self.devices.iter().enumerate().filter(|(i, _)| on(*i)) {
            for (&addr, a) in d.allocs.iter().filter(|(_, a)| a.owner == pid) {
                r.allocations
                    .push((DeviceOrdinal(i as u32), DevicePtr(addr), a.size));
            }
        }
        for (&addr, h) in p
            .host
            .iter()
            .filter(|(_, h)| device.is_none() || (on(h.device) && !h.survives_its_context()))
        {
            match h.kind {
                HostKind::Alloc(_) => r.host_allocations.push((HostPtr(addr), h.size)),
                HostKind::Registered => r.host_registrations.push((HostPtr(addr), h.size)),
                HostKind::ImportedPooled(_) => r.ipc_mappings.push((
                    DeviceOrdinal(h.device as u32),
                    DevicePtr(addr as u64),
                    h.size,
                )),
                HostKind::Managed(_) | HostKind::Pooled(_) | HostKind::PooledManaged(_) => {
                    r.allocations.push((
                        DeviceOrdinal(h.device as u32),
                        DevicePtr(addr as u64),
                        h.size,
                    ))
                }
            }
        }
        for (&handle, ph) in self
            .phys
            .iter()
            // Released and unmapped, an allocation another process imported is that
            // process's to give up, not this one's leak.
            .filter(|(_, ph)| {
                ph.owner == pid && on(ph.device) && !(ph.released && ph.mappings == 0)
            })
        {
            r.physical.push((
                DeviceOrdinal(ph.device as u32),
                crate::sim::made(PhysHandle::from_raw, handle),
                ph.size,
            ));
        }
        for (&base, res) in p.vm.reservations.iter().filter(|(_, res)| on(res.device)) {
            r.reservations.push((DevicePtr(base), res.size));
        }
        for (&addr, m) in p.ipc.iter().filter(|(_, m)| on(m.device)) {
            r.ipc_mappings
                .push((DeviceOrdinal(m.device as u32), DevicePtr(addr), m.size));
        }
        let count = |kind| {
            p.objects
                .values()
                .filter(|(k, d)| *k == kind && on(*d))
                .count()
        };
        r.streams = count(Object::Stream);
        r.events = count(Object::Event);
        r.modules = count(Object::Module);
        r.pools = p
            .pools
            .values()
            .filter(|q| on(q.device) && !q.is_default && !q.destroyed)
            .count();
        r
    }

    /// `cuInit`: [`Driver::init`](driver_sys::Driver::init) in the model.
    pub(super) fn init(&mut self, pid: usize, _note: &mut Note) -> Result<(), u32> {
        self.processes[pid].initialized = true;
        Ok(())
    }

    /// `cuDeviceGetCount`: [`Driver::device_count`](driver_sys::Driver::device_count) in the model.
    pub(super) fn device_count(&mut self, _pid: usize, _note: &mut Note) -> Result<u32, u32> {
        Ok(self.devices.len() as u32)
    }

    /// `cuDeviceTotalMem`: [`Driver::device_total_mem`](driver_sys::Driver::device_total_mem) in the model.
    pub(super) fn device_total_mem(
        &mut self,
        _pid: usize,
        note: &mut Note,
        dev: DeviceOrdinal,
    ) -> Result<usize, u32> {
        note.device = Some(dev);
        Ok(self.devices[device_index(self, dev)?].config.total_mem)
    }

    /// `cuDeviceGetAttribute`: [`Driver::device_attribute`](driver_sys::Driver::device_attribute) in the model.
    pub(super) fn device_attribute(
        &mut self,
        _pid: usize,
        note: &mut Note,
        dev: DeviceOrdinal,
        attr: DeviceAttribute,
    ) -> Result<i32, u32> {
        note.device = Some(dev);
        let c = &self.devices[device_index(self, dev)?].config;
        Ok(match attr {
            DeviceAttribute::CanMapHostMemory => i32::from(c.can_map_host_memory),
            DeviceAttribute::PciBusId => c.pci_bus_id,
            DeviceAttribute::PciDeviceId => c.pci_device_id,
            DeviceAttribute::PciDomainId => c.pci_domain_id,
            DeviceAttribute::ManagedMemory | DeviceAttribute::ConcurrentManagedAccess => {
                i32::from(c.managed_memory)
            }
            DeviceAttribute::HostNumaId => c.host_numa_id,
            DeviceAttribute::HostMemoryPoolsSupported
            | DeviceAttribute::HostNumaMemoryPoolsSupported => i32::from(c.host_memory_pools),
            DeviceAttribute::VirtualMemoryManagement => i32::from(c.vmm),
            DeviceAttribute::HandleTypePosixFileDescriptor => {
                i32::from(c.vmm && c.posix_fd_handles)
            }
        })
    }

    /// `cuDeviceCanAccessPeer`: [`Driver::device_can_access_peer`](driver_sys::Driver::device_can_access_peer) in the model.
    pub(super) fn device_can_access_peer(
        &mut self,
        _pid: usize,
        note: &mut Note,
        dev: DeviceOrdinal,
        peer: DeviceOrdinal,
    ) -> Result<bool, u32> {
        note.device = Some(dev);
        let (a, b) = (device_index(self, dev)?, device_index(self, peer)?);
        // Measured on the GPU: a device is not its own peer.
        Ok(a != b && self.peer_access)
    }

    /// `cuCtxEnablePeerAccess`: [`Driver::ctx_enable_peer_access`](driver_sys::Driver::ctx_enable_peer_access) in the model. Both
    /// contexts must exist; the devices must be peers (the machine's peer access, and not one
    /// device: the model refuses a context as its own peer as `PEER_ACCESS_UNSUPPORTED`); a
    /// second grant is `PEER_ACCESS_ALREADY_ENABLED`.
    pub(super) fn ctx_enable_peer_access(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        peer: ContextHandle,
    ) -> Result<(), u32> {
        let b = context(self, pid, peer, note)?;
        let a = context(self, pid, ctx, note)?;
        if a == b || !self.peer_access {
            return Err(code::PEER_ACCESS_UNSUPPORTED);
        }
        let c = &mut self.processes[pid].contexts[a];
        if c.peers & peer_bit(b) != 0 {
            return Err(code::PEER_ACCESS_ALREADY_ENABLED);
        }
        c.peers |= peer_bit(b);
        Ok(())
    }

    /// `cuDevicePrimaryCtxRetain`: [`Driver::primary_ctx_retain`](driver_sys::Driver::primary_ctx_retain) in the model.
    pub(super) fn primary_ctx_retain(
        &mut self,
        pid: usize,
        note: &mut Note,
        dev: DeviceOrdinal,
    ) -> Result<ContextHandle, u32> {
        note.device = Some(dev);
        let i = device_index(self, dev)?;
        let c = &mut self.processes[pid].contexts[i];
        c.refcount += 1;
        c.live = true;
        Ok(crate::sim::made(
            ContextHandle::from_raw,
            CONTEXT_HANDLE_BASE + i as u64 * 0x100,
        ))
    }

    /// `cuDevicePrimaryCtxRelease`: [`Driver::primary_ctx_release`](driver_sys::Driver::primary_ctx_release) in the model.
    pub(super) fn primary_ctx_release(
        &mut self,
        pid: usize,
        note: &mut Note,
        dev: DeviceOrdinal,
    ) -> Result<(), u32> {
        note.device = Some(dev);
        let i = device_index(self, dev)?;
        let c = &mut self.processes[pid].contexts[i];
        if c.refcount == 0 {
            return Err(code::INVALID_CONTEXT);
        }
        c.refcount -= 1;
        if c.refcount == 0 {
            self.destroy_context(pid, i);
        }
        Ok(())
    }

    /// `cuDevicePrimaryCtxReset`: [`Driver::primary_ctx_reset`](driver_sys::Driver::primary_ctx_reset) in the model.
    pub(super) fn primary_ctx_reset(
        &mut self,
        pid: usize,
        note: &mut Note,
        dev: DeviceOrdinal,
    ) -> Result<(), u32> {
        note.device = Some(dev);
        let i = device_index(self, dev)?;
        self.destroy_context(pid, i);
        Ok(())
    }
}
