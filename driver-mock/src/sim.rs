//! [`SimDriver`]: a deterministic simulated CUDA system.
//!
//! Unsafe code here is confined to copies into and out of host memory that the caller mapped
//! into the simulated device (the [`Driver`] contract makes the caller vouch for it).
#![allow(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::sync::{Arc, Mutex, MutexGuard};

use driver_sys::{
    ContextHandle, DeviceAttribute, DeviceOrdinal, DevicePtr, Driver, DriverError, ErrorKind,
    EventHandle, HostPtr, IpcMemHandle, MemInfo, MemPoolHandle, MemPoolUsage, ModuleHandle,
    PoolPtrExportData, StreamHandle, code, host_alloc, host_register,
};

/// The granularity of allocations of up to [`SMALL_MAX`] bytes (measured: 512 bytes).
pub const DEFAULT_ALIGNMENT: usize = 512;
/// The unit device memory is handed out and accounted in (measured: 2 MiB).
pub const PAGE_SIZE: usize = 2 << 20;
/// Allocations up to this size share pages; larger ones get pages of their own.
pub const SMALL_MAX: usize = 1 << 20;

const DEVICE_SPACE_BASE: u64 = 0x7000_0000_0000;
const DEVICE_SPACE_STRIDE: u64 = 1 << 40;
/// IPC mappings of a device live in the upper half of its range.
const IPC_SPACE_OFFSET: u64 = 1 << 39;
const CONTEXT_HANDLE_BASE: u64 = 0x5c00_0000_0000;
const HANDLE_BASE: u64 = 0x5d00_0000_0000;
const IPC_MAGIC: &[u8; 8] = b"EMMSIMIP";

/// One simulated device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimDeviceConfig {
    /// Device memory in bytes, as `cuDeviceTotalMem` and `cuMemGetInfo` report it.
    pub total_mem: usize,
    /// `CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY`.
    pub can_map_host_memory: bool,
    /// Granularity of small allocations in bytes (a power of two dividing [`PAGE_SIZE`]).
    pub alignment: usize,
    /// Bytes a live context takes before anything is allocated (the real driver's context
    /// state: about 552 MB on an H200); counted against `free`.
    pub context_overhead: usize,
    /// `CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID`.
    pub pci_domain_id: i32,
    /// `CU_DEVICE_ATTRIBUTE_PCI_BUS_ID`.
    pub pci_bus_id: i32,
    /// `CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID`.
    pub pci_device_id: i32,
}

impl SimDeviceConfig {
    /// A device with `total_mem` bytes that can map host memory, at the default alignment.
    pub fn new(total_mem: usize) -> SimDeviceConfig {
        SimDeviceConfig {
            total_mem,
            can_map_host_memory: true,
            alignment: DEFAULT_ALIGNMENT,
            context_overhead: 0,
            pci_domain_id: 0,
            pci_bus_id: 0,
            pci_device_id: 0,
        }
    }

    /// Sets whether the device can map host memory.
    #[must_use]
    pub fn can_map_host_memory(mut self, yes: bool) -> SimDeviceConfig {
        self.can_map_host_memory = yes;
        self
    }

    /// Sets the granularity of small allocations (a power of two dividing [`PAGE_SIZE`]).
    #[must_use]
    pub fn alignment(mut self, alignment: usize) -> SimDeviceConfig {
        assert!(
            alignment.is_power_of_two() && alignment <= PAGE_SIZE,
            "alignment must be a power of two of at most {PAGE_SIZE}, got {alignment}"
        );
        self.alignment = alignment;
        self
    }

    /// Sets the bytes a live context takes before anything is allocated.
    #[must_use]
    pub fn context_overhead(mut self, bytes: usize) -> SimDeviceConfig {
        self.context_overhead = bytes;
        self
    }
}

/// The simulated machine: its devices, in ordinal order, whether they are peers, and how much
/// host memory may be page-locked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimConfig {
    /// The devices; device `i` has ordinal `i`.
    pub devices: Vec<SimDeviceConfig>,
    /// Whether every pair of distinct devices can access each other's memory
    /// (`cuDeviceCanAccessPeer`), as over NVLink. Without it, opening an IPC handle of one
    /// device in a context of another fails, and emm takes the staged path.
    pub peer_access: bool,
    /// Bytes of host memory that may be page-locked at once (`cuMemHostAlloc` and
    /// `cuMemHostRegister` together) before out-of-memory.
    pub pinned_host_limit: usize,
}

impl SimConfig {
    /// One device with `total_mem` bytes.
    pub fn single(total_mem: usize) -> SimConfig {
        SimConfig::with_devices(vec![SimDeviceConfig::new(total_mem)])
    }

    /// The given devices, all peers of each other; PCI bus ids are numbered from 1 where left
    /// at 0.
    pub fn with_devices(devices: Vec<SimDeviceConfig>) -> SimConfig {
        SimConfig {
            devices,
            peer_access: true,
            pinned_host_limit: 1 << 30,
        }
    }

    /// Sets whether distinct devices are peers.
    #[must_use]
    pub fn peer_access(mut self, yes: bool) -> SimConfig {
        self.peer_access = yes;
        self
    }

    /// Sets how many bytes of host memory may be page-locked at once.
    #[must_use]
    pub fn pinned_host_limit(mut self, bytes: usize) -> SimConfig {
        self.pinned_host_limit = bytes;
        self
    }
}

impl Default for SimConfig {
    /// One device with 1 GiB.
    fn default() -> SimConfig {
        SimConfig::single(1 << 30)
    }
}

/// A driver operation, as logged and as named by [`Fault`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[allow(missing_docs)] // each variant is the driver call of the same name
pub enum Op {
    Init,
    DeviceCount,
    DeviceTotalMem,
    DeviceAttribute,
    DeviceCanAccessPeer,
    PrimaryCtxRetain,
    PrimaryCtxRelease,
    PrimaryCtxReset,
    MemAlloc,
    MemFree,
    MemGetInfo,
    MemGetAddressRange,
    MemcpyHtoD,
    MemcpyDtoH,
    MemcpyDtoD,
    MemsetD8,
    MemHostAlloc,
    MemFreeHost,
    MemHostRegister,
    MemHostUnregister,
    MemHostGetDevicePointer,
    StreamCreate,
    StreamDestroy,
    EventCreate,
    EventDestroy,
    ModuleLoadData,
    ModuleUnload,
    IpcGetMemHandle,
    IpcOpenMemHandle,
    IpcCloseMemHandle,
    StreamSynchronize,
    DeviceGetDefaultMemPool,
    MemPoolCreate,
    MemPoolDestroy,
    MemPoolSetAttribute,
    MemPoolTrimTo,
    MemPoolGetAttribute,
    MemAllocFromPoolAsync,
    MemFreeAsync,
    MemPoolExportToShareableHandle,
    MemPoolImportFromShareableHandle,
    MemPoolExportPointer,
    MemPoolImportPointer,
    MemPoolGetAccess,
    MemPoolSetAccess,
}

impl Op {
    /// Every operation, in declaration order (for fault sweeps).
    pub const ALL: [Op; 45] = [
        Op::Init,
        Op::DeviceCount,
        Op::DeviceTotalMem,
        Op::DeviceAttribute,
        Op::DeviceCanAccessPeer,
        Op::PrimaryCtxRetain,
        Op::PrimaryCtxRelease,
        Op::PrimaryCtxReset,
        Op::MemAlloc,
        Op::MemFree,
        Op::MemGetInfo,
        Op::MemGetAddressRange,
        Op::MemcpyHtoD,
        Op::MemcpyDtoH,
        Op::MemcpyDtoD,
        Op::MemsetD8,
        Op::MemHostAlloc,
        Op::MemFreeHost,
        Op::MemHostRegister,
        Op::MemHostUnregister,
        Op::MemHostGetDevicePointer,
        Op::StreamCreate,
        Op::StreamDestroy,
        Op::EventCreate,
        Op::EventDestroy,
        Op::ModuleLoadData,
        Op::ModuleUnload,
        Op::IpcGetMemHandle,
        Op::IpcOpenMemHandle,
        Op::IpcCloseMemHandle,
        Op::StreamSynchronize,
        Op::DeviceGetDefaultMemPool,
        Op::MemPoolCreate,
        Op::MemPoolDestroy,
        Op::MemPoolSetAttribute,
        Op::MemPoolTrimTo,
        Op::MemPoolGetAttribute,
        Op::MemAllocFromPoolAsync,
        Op::MemFreeAsync,
        Op::MemPoolExportToShareableHandle,
        Op::MemPoolImportFromShareableHandle,
        Op::MemPoolExportPointer,
        Op::MemPoolImportPointer,
        Op::MemPoolGetAccess,
        Op::MemPoolSetAccess,
    ];

    /// The CUDA driver call this operation stands for.
    pub fn call_name(self) -> &'static str {
        match self {
            Op::Init => "cuInit",
            Op::DeviceCount => "cuDeviceGetCount",
            Op::DeviceTotalMem => "cuDeviceTotalMem",
            Op::DeviceAttribute => "cuDeviceGetAttribute",
            Op::DeviceCanAccessPeer => "cuDeviceCanAccessPeer",
            Op::PrimaryCtxRetain => "cuDevicePrimaryCtxRetain",
            Op::PrimaryCtxRelease => "cuDevicePrimaryCtxRelease",
            Op::PrimaryCtxReset => "cuDevicePrimaryCtxReset",
            Op::MemAlloc => "cuMemAlloc",
            Op::MemFree => "cuMemFree",
            Op::MemGetInfo => "cuMemGetInfo",
            Op::MemGetAddressRange => "cuMemGetAddressRange",
            Op::MemcpyHtoD => "cuMemcpyHtoD",
            Op::MemcpyDtoH => "cuMemcpyDtoH",
            Op::MemcpyDtoD => "cuMemcpyDtoD",
            Op::MemsetD8 => "cuMemsetD8",
            Op::MemHostAlloc => "cuMemHostAlloc",
            Op::MemFreeHost => "cuMemFreeHost",
            Op::MemHostRegister => "cuMemHostRegister",
            Op::MemHostUnregister => "cuMemHostUnregister",
            Op::MemHostGetDevicePointer => "cuMemHostGetDevicePointer",
            Op::StreamCreate => "cuStreamCreate",
            Op::StreamDestroy => "cuStreamDestroy",
            Op::EventCreate => "cuEventCreate",
            Op::EventDestroy => "cuEventDestroy",
            Op::ModuleLoadData => "cuModuleLoadData",
            Op::ModuleUnload => "cuModuleUnload",
            Op::IpcGetMemHandle => "cuIpcGetMemHandle",
            Op::IpcOpenMemHandle => "cuIpcOpenMemHandle",
            Op::IpcCloseMemHandle => "cuIpcCloseMemHandle",
            Op::StreamSynchronize => "cuStreamSynchronize",
            Op::DeviceGetDefaultMemPool => "cuDeviceGetDefaultMemPool",
            Op::MemPoolCreate => "cuMemPoolCreate",
            Op::MemPoolDestroy => "cuMemPoolDestroy",
            Op::MemPoolSetAttribute => "cuMemPoolSetAttribute",
            Op::MemPoolTrimTo => "cuMemPoolTrimTo",
            Op::MemPoolGetAttribute => "cuMemPoolGetAttribute",
            Op::MemAllocFromPoolAsync => "cuMemAllocFromPoolAsync",
            Op::MemPoolExportToShareableHandle => "cuMemPoolExportToShareableHandle",
            Op::MemPoolImportFromShareableHandle => "cuMemPoolImportFromShareableHandle",
            Op::MemPoolExportPointer => "cuMemPoolExportPointer",
            Op::MemPoolImportPointer => "cuMemPoolImportPointer",
            Op::MemPoolGetAccess => "cuMemPoolGetAccess",
            Op::MemPoolSetAccess => "cuMemPoolSetAccess",
            Op::MemFreeAsync => "cuMemFreeAsync",
        }
    }
}

/// One entry of the call log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallRecord {
    /// Position in this process's log, from 0.
    pub seq: u64,
    /// The operation.
    pub op: Op,
    /// The device the call concerned, where it names one (directly or through a context).
    pub device: Option<DeviceOrdinal>,
    /// The device pointer argument or result, where there is one.
    pub ptr: Option<DevicePtr>,
    /// The host pointer argument or result, where there is one.
    pub host: Option<HostPtr>,
    /// The byte count argument, where there is one.
    pub bytes: Option<usize>,
    /// `Ok(())`, or the kind of error returned.
    pub outcome: Result<(), ErrorKind>,
    /// Whether the error was scripted with [`SimDriver::inject`] (the call did nothing).
    pub injected: bool,
}

/// A scripted failure: the `nth` call (1-based, counted from when it is injected) of `op`, or of
/// any operation when `op` is `None`, fails with `kind` instead of running. It fires once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    /// Which operation to count; `None` counts every call.
    pub op: Option<Op>,
    /// Which call fails, 1-based.
    pub nth: u64,
    /// The error returned.
    pub kind: ErrorKind,
}

impl Fault {
    /// The `nth` call of `op` fails with `kind`.
    pub fn nth(op: Op, nth: u64, kind: ErrorKind) -> Fault {
        Fault {
            op: Some(op),
            nth,
            kind,
        }
    }

    /// The `nth` driver call of any operation fails with `kind`.
    pub fn nth_call(nth: u64, kind: ErrorKind) -> Fault {
        Fault {
            op: None,
            nth,
            kind,
        }
    }
}

/// What one simulated process still holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LeakReport {
    /// Live device allocations: device, address, requested size.
    pub allocations: Vec<(DeviceOrdinal, DevicePtr, usize)>,
    /// Live `cuMemHostAlloc` allocations: address, size.
    pub host_allocations: Vec<(HostPtr, usize)>,
    /// Live `cuMemHostRegister` registrations: address, size.
    pub host_registrations: Vec<(HostPtr, usize)>,
    /// Open IPC mappings: device, mapped address, size.
    pub ipc_mappings: Vec<(DeviceOrdinal, DevicePtr, usize)>,
    /// Streams, events and modules not destroyed: how many of each.
    pub streams: usize,
    /// See `streams`.
    pub events: usize,
    /// See `streams`.
    pub modules: usize,
    /// Stream-ordered pools created or imported and not destroyed (default pools excluded).
    pub pools: usize,
    /// Primary contexts with a non-zero reference count: device, count.
    pub retained_contexts: Vec<(DeviceOrdinal, u32)>,
}

impl LeakReport {
    /// Whether no memory (device, host, registered or mapped) is held.
    pub fn no_memory_leaked(&self) -> bool {
        self.allocations.is_empty()
            && self.host_allocations.is_empty()
            && self.host_registrations.is_empty()
            && self.ipc_mappings.is_empty()
    }

    /// Whether nothing at all is held, contexts included.
    pub fn is_clean(&self) -> bool {
        self.no_memory_leaked()
            && self.streams == 0
            && self.events == 0
            && self.modules == 0
            && self.pools == 0
            && self.retained_contexts.is_empty()
    }
}

impl fmt::Display for LeakReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_clean() {
            return write!(f, "no leaks");
        }
        for (dev, ptr, size) in &self.allocations {
            writeln!(f, "device {dev}: {size} bytes at {ptr} still allocated")?;
        }
        for (ptr, size) in &self.host_allocations {
            writeln!(
                f,
                "pinned host memory: {size} bytes at {ptr} still allocated"
            )?;
        }
        for (ptr, size) in &self.host_registrations {
            writeln!(f, "host range: {size} bytes at {ptr} still registered")?;
        }
        for (dev, ptr, size) in &self.ipc_mappings {
            writeln!(
                f,
                "device {dev}: IPC mapping of {size} bytes at {ptr} still open"
            )?;
        }
        for (what, n) in [
            ("stream", self.streams),
            ("event", self.events),
            ("module", self.modules),
            ("stream-ordered pool", self.pools),
        ] {
            if n > 0 {
                writeln!(f, "{n} {what}(s) not destroyed")?;
            }
        }
        for (dev, count) in &self.retained_contexts {
            writeln!(f, "device {dev}: primary context retained {count} time(s)")?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// The model. One `World` per simulated machine, behind one lock; every `SimDriver` is a process
// on it.

#[derive(Debug)]
struct SimAlloc {
    size: usize,
    /// Bytes of address space it occupies: `size` rounded to the alignment (small) or to whole
    /// pages (large).
    span: usize,
    store: u64,
    owner: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Page {
    /// Shared by this many small allocations.
    Small(usize),
    /// Part of one large allocation.
    Large,
}

/// One device's physical memory.
#[derive(Debug)]
struct DeviceMem {
    config: SimDeviceConfig,
    allocs: BTreeMap<u64, SimAlloc>,
    /// Pages in use, by index from the device's base address.
    pages: BTreeMap<u64, Page>,
}

impl DeviceMem {
    fn base(ordinal: usize) -> u64 {
        DEVICE_SPACE_BASE + ordinal as u64 * DEVICE_SPACE_STRIDE
    }

    fn page_addr(ordinal: usize, page: u64) -> u64 {
        Self::base(ordinal) + page * PAGE_SIZE as u64
    }

    fn page_of(ordinal: usize, addr: u64) -> u64 {
        (addr - Self::base(ordinal)) / PAGE_SIZE as u64
    }

    /// The lowest run of `n` unused page indices.
    fn free_pages(&self, n: u64) -> u64 {
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
    fn place_small(&self, ordinal: usize, span: usize) -> (u64, Option<u64>) {
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
    fn containing(&self, addr: u64) -> Option<(u64, &SimAlloc)> {
        let (&base, alloc) = self.allocs.range(..=addr).next_back()?;
        (addr < base + alloc.size.max(1) as u64).then_some((base, alloc))
    }

    /// Removes the allocation at `base` and returns its pages; the caller drops its store.
    fn remove(&mut self, ordinal: usize, base: u64) -> Option<SimAlloc> {
        let alloc = self.allocs.remove(&base)?;
        let first = Self::page_of(ordinal, base);
        if alloc.size <= SMALL_MAX {
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
struct Store {
    bytes: Vec<u8>,
    refs: usize,
}

#[derive(Debug, Default, Clone, Copy)]
struct Ctx {
    refcount: u32,
    /// Whether the primary context exists (retained, not reset since).
    live: bool,
}

#[derive(Debug)]
enum HostKind {
    /// `cuMemHostAlloc` memory, owned by the simulator.
    Alloc(#[allow(dead_code)] Box<[u8]>),
    /// A caller's range, `cuMemHostRegister`ed.
    Registered,
}

#[derive(Debug)]
struct HostRange {
    size: usize,
    device: usize,
    mapped: bool,
    portable: bool,
    kind: HostKind,
}

#[derive(Debug)]
struct IpcMap {
    device: usize,
    store: u64,
    size: usize,
    span: usize,
    /// Opens not yet closed: the driver reference-counts repeated opens in one context.
    opens: usize,
    /// For a pointer imported from a stream-ordered pool: the imported pool it came through.
    /// It is freed with `cuMemFreeAsync`, not closed.
    pool: Option<u64>,
}

#[derive(Debug)]
struct Process {
    initialized: bool,
    contexts: Vec<Ctx>,
    log: Vec<CallRecord>,
    faults: Vec<(Fault, u64)>,
    host: BTreeMap<usize, HostRange>,
    /// Streams, events and modules: handle → (kind, device).
    objects: BTreeMap<u64, (Object, usize)>,
    ipc: BTreeMap<u64, IpcMap>,
    /// Stream-ordered pools: handle → pool (the default pools included).
    pools: BTreeMap<u64, SimPool>,
}

/// A block freed to a stream-ordered pool: reusable at once on the stream it was freed on,
/// on other streams once that stream was synchronised.
#[derive(Clone, Copy, Debug)]
struct FreeBlock {
    addr: u64,
    size: usize,
    stream: u64,
    ready: bool,
}

/// A stream-ordered pool (`cuMemPoolCreate`, or a device's default pool).
#[derive(Debug)]
struct SimPool {
    device: usize,
    is_default: bool,
    /// Destroyed while allocations were outstanding: measured on the H200, the driver
    /// releases the pool's memory only once they are freed.
    destroyed: bool,
    threshold: u64,
    reserved: usize,
    used: usize,
    live: BTreeMap<u64, usize>,
    free: Vec<FreeBlock>,
    /// Created with a shareable handle type (POSIX file descriptors): it can be exported.
    ipc: bool,
    /// Exported to a shareable handle at least once. Measured on the H200: until then
    /// `cuMemPoolExportPointer` refuses the pool's allocations (`CUDA_ERROR_INVALID_VALUE`).
    exported: bool,
    /// Imported from another process: (that process, its pool handle). Such a pool only
    /// imports pointers.
    imported_from: Option<(usize, u64)>,
    /// Devices other than its own granted read-write access (`cuMemPoolSetAccess`).
    access: BTreeSet<usize>,
}

impl SimPool {
    fn new(device: usize, is_default: bool) -> SimPool {
        SimPool {
            device,
            is_default,
            ipc: false,
            exported: false,
            imported_from: None,
            access: BTreeSet::new(),
            destroyed: false,
            threshold: 0,
            reserved: 0,
            used: 0,
            live: BTreeMap::new(),
            free: Vec::new(),
        }
    }
}

/// A context object the simulator hands out handles for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Object {
    Stream,
    Event,
    Module,
}

impl Process {
    fn new(devices: usize) -> Process {
        Process {
            initialized: false,
            contexts: vec![Ctx::default(); devices],
            log: Vec::new(),
            faults: Vec::new(),
            host: BTreeMap::new(),
            objects: BTreeMap::new(),
            ipc: BTreeMap::new(),
            pools: BTreeMap::new(),
        }
    }
}

#[derive(Debug)]
struct World {
    devices: Vec<DeviceMem>,
    stores: BTreeMap<u64, Store>,
    processes: Vec<Process>,
    peer_access: bool,
    pinned_limit: usize,
    pinned: usize,
    next_handle: u64,
    /// Pools exported as file descriptors: the descriptor's inode → (process, pool handle).
    /// The descriptors are real (pipes), so they can be passed like the driver's.
    pool_exports: BTreeMap<u64, (usize, u64)>,
}

/// Who reaches memory: a process, through a context of a device.
#[derive(Clone, Copy)]
struct Accessor {
    pid: usize,
    device: usize,
}

/// Where a device address leads.
enum Loc {
    Store(u64, usize),
    Host(usize),
}

impl World {
    fn new_handle(&mut self) -> u64 {
        self.next_handle += 0x10;
        HANDLE_BASE + self.next_handle
    }

    /// Allocates `bytes` on device `i` for process `pid` (`cuMemAlloc`'s model: 2 MiB pages,
    /// small allocations packed).
    fn alloc_device(&mut self, i: usize, pid: usize, bytes: usize) -> Result<u64, u32> {
        let w = self;
        if bytes == 0 {
            return Err(code::INVALID_VALUE);
        }
        let free = w.free_bytes(i);
        let d = &w.devices[i];
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
        let store = w.new_handle();
        w.stores.insert(
            store,
            Store {
                bytes: vec![0; bytes],
                refs: 1,
            },
        );
        let d = &mut w.devices[i];
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
            },
        );
        Ok(addr)
    }

    /// Releases free blocks of pool `h` of process `pid` that are ready until the pool
    /// reserves at most `keep` bytes.
    fn pool_release(&mut self, pid: usize, h: u64, keep: usize) {
        let Some(pool) = self.processes[pid].pools.get_mut(&h) else {
            return;
        };
        let mut release = Vec::new();
        pool.free.retain(|b| {
            if b.ready && pool.reserved > keep {
                pool.reserved -= b.size;
                release.push(b.addr);
                false
            } else {
                true
            }
        });
        for addr in release {
            let _ = self.free_device(pid, addr);
        }
    }

    /// Maps `size` bytes of `store` into process `pid`'s IPC space of `device`, at the lowest
    /// free run of whole pages, opened once (`pool`: imported through that pool); returns
    /// the address.
    fn map_store(
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

    /// Pool `h` of process `pid` (`CUDA_ERROR_INVALID_VALUE` when it has none such).
    fn pool_mut(&mut self, pid: usize, h: MemPoolHandle) -> Result<&mut SimPool, u32> {
        self.processes[pid]
            .pools
            .get_mut(&h.0)
            .ok_or(code::INVALID_VALUE)
    }

    /// Checks that `stream` is 0 (the legacy default stream) or a live stream of process `pid`.
    fn check_stream(&self, pid: usize, stream: u64) -> Result<(), u32> {
        match self.processes[pid].objects.get(&stream) {
            _ if stream == 0 => Ok(()),
            Some((Object::Stream, _)) => Ok(()),
            _ => Err(code::INVALID_HANDLE),
        }
    }

    /// Frees process `pid`'s allocation at `ptr` on any device; returns its size.
    fn free_device(&mut self, pid: usize, ptr: u64) -> Result<usize, u32> {
        let w = self;
        // Unified addressing: the allocation may be on any device of this process.
        let i = (0..w.devices.len())
            .find(|&i| {
                w.devices[i]
                    .allocs
                    .get(&ptr)
                    .is_some_and(|a| a.owner == pid)
            })
            .ok_or(code::INVALID_VALUE)?;
        let a = w.devices[i].remove(i, ptr).expect("found above");
        w.drop_store(a.store);
        Ok(a.size)
    }

    fn drop_store(&mut self, id: u64) {
        if let Some(s) = self.stores.get_mut(&id) {
            s.refs -= 1;
            if s.refs == 0 {
                self.stores.remove(&id);
            }
        }
    }

    fn live_contexts(&self, device: usize) -> usize {
        self.processes
            .iter()
            .filter(|p| p.contexts[device].live)
            .count()
    }

    fn free_bytes(&self, device: usize) -> usize {
        let d = &self.devices[device];
        let used =
            d.pages.len() * PAGE_SIZE + d.config.context_overhead * self.live_contexts(device);
        d.config.total_mem.saturating_sub(used)
    }

    /// Destroys process `pid`'s context on `device` and everything it owned there.
    fn destroy_context(&mut self, pid: usize, device: usize) {
        let bases: Vec<u64> = self.devices[device]
            .allocs
            .iter()
            .filter(|(_, a)| a.owner == pid)
            .map(|(&b, _)| b)
            .collect();
        for base in bases {
            if let Some(a) = self.devices[device].remove(device, base) {
                self.drop_store(a.store);
            }
        }
        let p = &mut self.processes[pid];
        p.contexts[device].live = false;
        p.objects.retain(|_, (_, d)| *d != device);
        // The pools' memory went with the allocations above.
        p.pools.retain(|_, pool| pool.device != device);
        let mut freed_pinned = 0;
        p.host.retain(|_, h| {
            let keep = h.device != device || h.portable;
            if !keep {
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

    /// Copies `dst.len()` bytes from `addr`, as process `pid` sees it, into `dst`.
    ///
    /// # Safety
    ///
    /// If `addr` is mapped host memory, it is live and nothing writes it during the call (the
    /// `Driver` copy contracts).
    unsafe fn read(&self, by: Accessor, addr: u64, dst: &mut [u8]) -> Result<(), u32> {
        match self.resolve(by, addr, dst.len())? {
            Loc::Store(id, off) => {
                dst.copy_from_slice(&self.stores[&id].bytes[off..off + dst.len()])
            }
            // SAFETY: `resolve` checked the range lies in a mapped host range; the caller vouches
            // that it is live and unwritten; `dst` is an exclusive borrow.
            Loc::Host(at) => unsafe {
                std::ptr::copy(at as *const u8, dst.as_mut_ptr(), dst.len())
            },
        }
        Ok(())
    }

    /// Copies `src` to `addr`, as process `pid` sees it.
    ///
    /// # Safety
    ///
    /// If `addr` is mapped host memory, it is live and nothing else touches it during the call.
    unsafe fn write(&mut self, by: Accessor, addr: u64, src: &[u8]) -> Result<(), u32> {
        match self.resolve(by, addr, src.len())? {
            Loc::Store(id, off) => self.stores.get_mut(&id).expect("live store").bytes
                [off..off + src.len()]
                .copy_from_slice(src),
            // SAFETY: `resolve` checked the range lies in a mapped host range; the caller vouches
            // that it is live and untouched by anyone else.
            Loc::Host(at) => unsafe { std::ptr::copy(src.as_ptr(), at as *mut u8, src.len()) },
        }
        Ok(())
    }

    /// Resolves `len` bytes at `addr` as seen by process `pid` (unified addressing: any device's
    /// memory of this process, its IPC mappings, and its mapped host memory).
    ///
    /// Memory imported from another process's pool is reached only from a device the imported
    /// pool grants access to (measured on two H200s: a copy in another device's context is
    /// `CUDA_ERROR_INVALID_VALUE`).
    fn resolve(&self, by: Accessor, addr: u64, len: usize) -> Result<Loc, u32> {
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
}

/// A deterministic simulated CUDA system, as seen by one process.
///
/// # Model
///
/// - **Devices** are configured up front ([`SimConfig`]). Each process has a primary context
///   per device with a reference count; devices may or may not be peers.
/// - **Address space and accounting**, as measured on an H200 (driver 580, CUDA 13.0; see
///   `ci/hardware-runs.md`). Device memory is handed out in 2 MiB pages. Allocations of up to
///   1 MiB are packed into shared pages at 512-byte granularity (first fit, lowest address);
///   larger ones get whole 2 MiB-aligned pages of their own. A page is returned as soon as its
///   last allocation is freed. `free` in [`Driver::mem_get_info`] is
///   `total - live contexts × context overhead - pages in use × 2 MiB`, so a 1-byte allocation
///   that opens a page costs 2 MiB and one that fits an open page costs nothing, exactly as on
///   the GPU. Device `d`'s addresses start at `0x7000_0000_0000 + d * 2^40`; addresses are
///   unified, so copies find any memory of the process whatever the context.
/// - **Real bytes.** Device allocations have zero-initialised backing bytes; copies move data.
///   `cuMemHostAlloc` returns real, zeroed host memory, and mapped host memory (allocated or
///   registered) is reached from the device at the same address (unified addressing), so a
///   copy to its device address lands in the host bytes.
/// - **Processes and IPC.** [`SimDriver::spawn_process`] gives another process on the same
///   machine. An IPC handle names an allocation; another process opens it at an address of its
///   own and sees the same bytes; opening it again in the same context returns the same address
///   and counts the opens (the driver's documented behaviour), and each close undoes one. Opening
///   in the exporting process, or on a device that is not a peer of the allocation's, fails as
///   on the GPU. The memory lives while
///   any process maps it.
/// - **Stream-ordered pools and their IPC.** Pools, the release threshold and stream order (a
///   freed block is reusable on its stream at once, on others after a synchronisation). A pool
///   created for export exports as a real file descriptor (one end of a pipe, known by its
///   inode), so it can travel over a Unix socket; another process imports it and then imports
///   allocations through it. As measured on the H200: allocations export only once their pool
///   was exported; an imported pointer is reached only from devices the imported pool grants
///   access to.
/// - **Host memory** as measured: `cuMemHostAlloc(0)` succeeds with the null pointer; pinned
///   and registered memory has a device address (the host address) whatever the flags.
/// - **Host memory** as measured: `cuMemHostAlloc(0)` succeeds with the null pointer; pinned
///   and registered memory has a device address (the host address) whatever the flags.
/// - **Contexts and unified addressing**, as measured on two H200s: copies and frees reach any
///   device's memory of the process whatever context names them; `cuMemGetAddressRange` finds
///   only memory of the context's own device (`CUDA_ERROR_NOT_FOUND` otherwise).
/// - **Contract checking** with the real driver's codes: zero-byte allocations, unknown or
///   interior pointers, double frees and out-of-range copies give `CUDA_ERROR_INVALID_VALUE`
///   (freeing the null pointer succeeds); a request larger than what is free gives
///   `CUDA_ERROR_OUT_OF_MEMORY`; registering a range twice gives
///   `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`, unregistering an unknown one
///   `CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED`.
/// - **Primary contexts.** Releasing the last reference destroys the context and everything it
///   owns (device memory, non-portable pinned memory, streams, events, modules, IPC mappings);
///   `cuDevicePrimaryCtxReset` does so even while references remain. A destroyed context
///   answers `CUDA_ERROR_CONTEXT_IS_DESTROYED` until the next retain re-creates it (with the
///   same handle, as on the GPU); releasing at count zero is `CUDA_ERROR_INVALID_CONTEXT`.
/// - **Observability.** Every call is appended to the process's log ([`SimDriver::calls`]) with
///   its arguments and outcome; [`SimDriver::leak_report`] lists what the process still holds.
/// - **Scripted faults.** [`SimDriver::inject`] makes the Nth call of one operation (or of any
///   operation) fail with a chosen error kind, once.
/// - **Determinism.** The same calls give the same device addresses, handles, errors and log,
///   every run. Host addresses are real heap addresses and are the one exception.
///
/// Shareable across threads (`Arc<SimDriver>` coerces to `Arc<dyn Driver>`); one lock guards
/// the whole machine, so each log has one total order.
#[derive(Debug)]
pub struct SimDriver {
    world: Arc<Mutex<World>>,
    pid: usize,
}

/// What a single call observed, for the log.
#[derive(Default)]
struct Note {
    device: Option<DeviceOrdinal>,
    ptr: Option<DevicePtr>,
    host: Option<HostPtr>,
    bytes: Option<usize>,
}

type Body<'a, T> = Box<dyn FnOnce(&mut World, usize, &mut Note) -> Result<T, u32> + 'a>;

impl SimDriver {
    /// A simulated machine with the given devices, seen by its first process. The driver
    /// starts uninitialised, as libcuda does: call [`Driver::init`] first.
    pub fn new(config: SimConfig) -> SimDriver {
        let n = config.devices.len();
        let devices = config
            .devices
            .into_iter()
            .enumerate()
            .map(|(i, mut c)| {
                if c.pci_bus_id == 0 {
                    c.pci_bus_id = i as i32 + 1;
                }
                DeviceMem {
                    config: c,
                    allocs: BTreeMap::new(),
                    pages: BTreeMap::new(),
                }
            })
            .collect();
        let world = World {
            devices,
            stores: BTreeMap::new(),
            processes: vec![Process::new(n)],
            peer_access: config.peer_access,
            pinned_limit: config.pinned_host_limit,
            pinned: 0,
            next_handle: 0,
            pool_exports: BTreeMap::new(),
        };
        SimDriver {
            world: Arc::new(Mutex::new(world)),
            pid: 0,
        }
    }

    /// Another process on the same simulated machine: it shares the devices and their memory
    /// (for IPC), and has its own contexts, host memory, log and faults. Uninitialised.
    pub fn spawn_process(&self) -> SimDriver {
        let mut w = self.lock();
        let n = w.devices.len();
        w.processes.push(Process::new(n));
        SimDriver {
            world: Arc::clone(&self.world),
            pid: w.processes.len() - 1,
        }
    }

    /// This process's number on the machine (0 for the first).
    pub fn process_id(&self) -> usize {
        self.pid
    }

    fn lock(&self) -> MutexGuard<'_, World> {
        // A panic in a test thread must not hide every later call.
        self.world.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn with_process<T>(&self, f: impl FnOnce(&Process) -> T) -> T {
        f(&self.lock().processes[self.pid])
    }

    /// Scripts a fault for this process; see [`Fault`].
    pub fn inject(&self, fault: Fault) {
        assert!(fault.nth >= 1, "Fault::nth is 1-based");
        self.lock().processes[self.pid].faults.push((fault, 0));
    }

    /// Removes every scripted fault of this process that has not fired yet.
    pub fn clear_faults(&self) {
        self.lock().processes[self.pid].faults.clear();
    }

    /// A copy of this process's call log.
    pub fn calls(&self) -> Vec<CallRecord> {
        self.with_process(|p| p.log.clone())
    }

    /// How many calls of `op` this process made (successful or not).
    pub fn count(&self, op: Op) -> usize {
        self.with_process(|p| p.log.iter().filter(|c| c.op == op).count())
    }

    /// How many driver calls this process made in all.
    pub fn total_calls(&self) -> usize {
        self.with_process(|p| p.log.len())
    }

    /// The operations of the log, in order (for ordering assertions).
    pub fn ops(&self) -> Vec<Op> {
        self.with_process(|p| p.log.iter().map(|c| c.op).collect())
    }

    /// This process's live allocations on `dev`: address and requested size, in address order.
    pub fn live_allocations(&self, dev: DeviceOrdinal) -> Vec<(DevicePtr, usize)> {
        let w = self.lock();
        w.devices
            .get(dev.0 as usize)
            .map(|d| {
                d.allocs
                    .iter()
                    .filter(|(_, a)| a.owner == self.pid)
                    .map(|(&b, a)| (DevicePtr(b), a.size))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// This process's primary-context reference count on `dev`.
    pub fn context_refcount(&self, dev: DeviceOrdinal) -> u32 {
        self.with_process(|p| p.contexts.get(dev.0 as usize).map_or(0, |c| c.refcount))
    }

    /// Page-locked host bytes on the whole machine.
    pub fn pinned_bytes(&self) -> usize {
        self.lock().pinned
    }

    /// Frees this process made that the driver itself refused because the pointer was unknown
    /// (never allocated, or freed already); scripted faults are not counted.
    pub fn rejected_frees(&self) -> Vec<CallRecord> {
        self.with_process(|p| {
            p.log
                .iter()
                .filter(|c| {
                    !c.injected
                        && matches!(c.op, Op::MemFree | Op::MemFreeHost | Op::MemHostUnregister)
                        && matches!(
                            c.outcome,
                            Err(ErrorKind::InvalidValue | ErrorKind::HostMemoryNotRegistered)
                        )
                })
                .cloned()
                .collect()
        })
    }

    /// What this process still holds.
    pub fn leak_report(&self) -> LeakReport {
        let w = self.lock();
        let p = &w.processes[self.pid];
        let mut report = LeakReport::default();
        for (i, d) in w.devices.iter().enumerate() {
            for (&addr, a) in d.allocs.iter().filter(|(_, a)| a.owner == self.pid) {
                report
                    .allocations
                    .push((DeviceOrdinal(i as u32), DevicePtr(addr), a.size));
            }
            if p.contexts[i].refcount > 0 {
                report
                    .retained_contexts
                    .push((DeviceOrdinal(i as u32), p.contexts[i].refcount));
            }
        }
        for (&addr, h) in &p.host {
            match h.kind {
                HostKind::Alloc(_) => report.host_allocations.push((HostPtr(addr), h.size)),
                HostKind::Registered => report.host_registrations.push((HostPtr(addr), h.size)),
            }
        }
        for (&addr, m) in &p.ipc {
            report
                .ipc_mappings
                .push((DeviceOrdinal(m.device as u32), DevicePtr(addr), m.size));
        }
        let count = |kind| p.objects.values().filter(|(k, _)| *k == kind).count();
        report.streams = count(Object::Stream);
        report.events = count(Object::Event);
        report.modules = count(Object::Module);
        report.pools = p
            .pools
            .values()
            .filter(|q| !q.is_default && !q.destroyed)
            .count();
        report
    }

    /// Runs one driver call: checks scripted faults, runs `body`, logs the outcome.
    fn call<T>(&self, op: Op, body: Body<'_, T>) -> Result<T, DriverError> {
        let mut w = self.lock();
        let pid = self.pid;
        let mut note = Note::default();
        let seq = w.processes[pid].log.len() as u64;
        let faulted = Self::take_fault(&mut w.processes[pid], op);
        let result = match faulted {
            Some(kind) => Err(kind.representative_code()),
            None if op != Op::Init && !w.processes[pid].initialized => Err(code::NOT_INITIALIZED),
            None => body(&mut w, pid, &mut note),
        };
        let outcome = result
            .as_ref()
            .map(|_| ())
            .map_err(|&c| ErrorKind::from_code(c));
        w.processes[pid].log.push(CallRecord {
            seq,
            op,
            device: note.device,
            ptr: note.ptr,
            host: note.host,
            bytes: note.bytes,
            outcome,
            injected: faulted.is_some(),
        });
        drop(w);
        result.map_err(|c| {
            let e = DriverError::from_code(op.call_name(), c);
            if faulted.is_some() {
                e.with_detail("injected by SimDriver")
            } else {
                e
            }
        })
    }

    /// Runs a copy or memset of `bytes` at `ptr` in context `ctx`: logs it, checks the context,
    /// and treats zero bytes as done.
    fn copy_call(
        &self,
        op: Op,
        ctx: ContextHandle,
        ptr: DevicePtr,
        bytes: usize,
        body: impl FnOnce(&mut World, Accessor) -> Result<(), u32>,
    ) -> Result<(), DriverError> {
        self.call(
            op,
            Box::new(move |w, pid, note| {
                note.ptr = Some(ptr);
                note.bytes = Some(bytes);
                let device = context(w, pid, ctx, note)?;
                if bytes == 0 {
                    Ok(())
                } else {
                    body(w, Accessor { pid, device })
                }
            }),
        )
    }

    /// Creates a stream, event or module; `valid` says whether the arguments (flags, image) are
    /// acceptable.
    fn create_object(
        &self,
        op: Op,
        ctx: ContextHandle,
        kind: Object,
        valid: bool,
    ) -> Result<u64, DriverError> {
        self.call(
            op,
            Box::new(move |w, pid, note| {
                let i = context(w, pid, ctx, note)?;
                if !valid {
                    return Err(if kind == Object::Module {
                        code::INVALID_IMAGE
                    } else {
                        code::INVALID_VALUE
                    });
                }
                let h = w.new_handle();
                w.processes[pid].objects.insert(h, (kind, i));
                Ok(h)
            }),
        )
    }

    /// Destroys a stream, event or module of this process.
    fn destroy_object(
        &self,
        op: Op,
        ctx: ContextHandle,
        kind: Object,
        handle: u64,
    ) -> Result<(), DriverError> {
        self.call(
            op,
            Box::new(move |w, pid, note| {
                context(w, pid, ctx, note)?;
                let objects = &mut w.processes[pid].objects;
                match objects.get(&handle) {
                    Some((k, _)) if *k == kind => {
                        objects.remove(&handle);
                        Ok(())
                    }
                    _ => Err(code::INVALID_HANDLE),
                }
            }),
        )
    }

    fn take_fault(p: &mut Process, op: Op) -> Option<ErrorKind> {
        let mut fired = None;
        for (fault, seen) in p.faults.iter_mut() {
            if fault.op.is_none_or(|o| o == op) {
                *seen += 1;
                if *seen == fault.nth && fired.is_none() {
                    fired = Some(fault.kind);
                }
            }
        }
        p.faults.retain(|(f, seen)| *seen < f.nth);
        fired
    }
}

fn device_index(w: &World, dev: DeviceOrdinal) -> Result<usize, u32> {
    let i = dev.0 as usize;
    if i < w.devices.len() {
        Ok(i)
    } else {
        Err(code::INVALID_DEVICE)
    }
}

/// The device behind a context handle of process `pid`, if its context exists.
fn context(w: &World, pid: usize, ctx: ContextHandle, note: &mut Note) -> Result<usize, u32> {
    let index = ctx
        .0
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

fn encode_ipc(pid: usize, device: usize, store: u64, base: u64, size: usize) -> IpcMemHandle {
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
fn decode_ipc(h: &IpcMemHandle) -> Option<(usize, usize, u64)> {
    let b = &h.0;
    if &b[..8] != IPC_MAGIC || b[40..].iter().any(|&x| x != 0) {
        return None;
    }
    let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
    let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
    Some((u32_at(8) as usize, u32_at(12) as usize, u64_at(16)))
}

/// Whether `image` looks like something `cuModuleLoadData` accepts: PTX text or an ELF cubin.
fn plausible_image(image: &[u8]) -> bool {
    image.starts_with(b"\x7fELF") || image.windows(8).any(|w| w == b".version")
}

impl Driver for SimDriver {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn init(&self) -> Result<(), DriverError> {
        self.call(
            Op::Init,
            Box::new(|w, pid, _| {
                w.processes[pid].initialized = true;
                Ok(())
            }),
        )
    }

    fn device_count(&self) -> Result<u32, DriverError> {
        self.call(
            Op::DeviceCount,
            Box::new(|w, _, _| Ok(w.devices.len() as u32)),
        )
    }

    fn device_total_mem(&self, dev: DeviceOrdinal) -> Result<usize, DriverError> {
        self.call(
            Op::DeviceTotalMem,
            Box::new(move |w, _, note| {
                note.device = Some(dev);
                Ok(w.devices[device_index(w, dev)?].config.total_mem)
            }),
        )
    }

    fn device_attribute(
        &self,
        dev: DeviceOrdinal,
        attr: DeviceAttribute,
    ) -> Result<i32, DriverError> {
        self.call(
            Op::DeviceAttribute,
            Box::new(move |w, _, note| {
                note.device = Some(dev);
                let c = &w.devices[device_index(w, dev)?].config;
                Ok(match attr {
                    DeviceAttribute::CanMapHostMemory => i32::from(c.can_map_host_memory),
                    DeviceAttribute::PciBusId => c.pci_bus_id,
                    DeviceAttribute::PciDeviceId => c.pci_device_id,
                    DeviceAttribute::PciDomainId => c.pci_domain_id,
                })
            }),
        )
    }

    fn device_can_access_peer(
        &self,
        dev: DeviceOrdinal,
        peer: DeviceOrdinal,
    ) -> Result<bool, DriverError> {
        self.call(
            Op::DeviceCanAccessPeer,
            Box::new(move |w, _, note| {
                note.device = Some(dev);
                let (a, b) = (device_index(w, dev)?, device_index(w, peer)?);
                // Measured on the GPU: a device is not its own peer.
                Ok(a != b && w.peer_access)
            }),
        )
    }

    fn primary_ctx_retain(&self, dev: DeviceOrdinal) -> Result<ContextHandle, DriverError> {
        self.call(
            Op::PrimaryCtxRetain,
            Box::new(move |w, pid, note| {
                note.device = Some(dev);
                let i = device_index(w, dev)?;
                let c = &mut w.processes[pid].contexts[i];
                c.refcount += 1;
                c.live = true;
                Ok(ContextHandle(CONTEXT_HANDLE_BASE + i as u64 * 0x100))
            }),
        )
    }

    unsafe fn primary_ctx_release(&self, dev: DeviceOrdinal) -> Result<(), DriverError> {
        self.call(
            Op::PrimaryCtxRelease,
            Box::new(move |w, pid, note| {
                note.device = Some(dev);
                let i = device_index(w, dev)?;
                let c = &mut w.processes[pid].contexts[i];
                if c.refcount == 0 {
                    return Err(code::INVALID_CONTEXT);
                }
                c.refcount -= 1;
                if c.refcount == 0 {
                    w.destroy_context(pid, i);
                }
                Ok(())
            }),
        )
    }

    unsafe fn primary_ctx_reset(&self, dev: DeviceOrdinal) -> Result<(), DriverError> {
        self.call(
            Op::PrimaryCtxReset,
            Box::new(move |w, pid, note| {
                note.device = Some(dev);
                let i = device_index(w, dev)?;
                w.destroy_context(pid, i);
                Ok(())
            }),
        )
    }

    fn mem_alloc(&self, ctx: ContextHandle, bytes: usize) -> Result<DevicePtr, DriverError> {
        self.call(
            Op::MemAlloc,
            Box::new(move |w, pid, note| {
                note.bytes = Some(bytes);
                let i = context(w, pid, ctx, note)?;
                let addr = w.alloc_device(i, pid, bytes)?;
                note.ptr = Some(DevicePtr(addr));
                Ok(DevicePtr(addr))
            }),
        )
    }

    unsafe fn mem_free(&self, ctx: ContextHandle, ptr: DevicePtr) -> Result<(), DriverError> {
        self.call(
            Op::MemFree,
            Box::new(move |w, pid, note| {
                note.ptr = Some(ptr);
                context(w, pid, ctx, note)?;
                if ptr.is_null() {
                    return Ok(());
                }
                note.bytes = Some(w.free_device(pid, ptr.0)?);
                Ok(())
            }),
        )
    }

    fn mem_get_info(&self, ctx: ContextHandle) -> Result<MemInfo, DriverError> {
        self.call(
            Op::MemGetInfo,
            Box::new(move |w, pid, note| {
                let i = context(w, pid, ctx, note)?;
                Ok(MemInfo {
                    free: w.free_bytes(i),
                    total: w.devices[i].config.total_mem,
                })
            }),
        )
    }

    fn mem_get_address_range(
        &self,
        ctx: ContextHandle,
        ptr: DevicePtr,
    ) -> Result<(DevicePtr, usize), DriverError> {
        self.call(
            Op::MemGetAddressRange,
            Box::new(move |w, pid, note| {
                note.ptr = Some(ptr);
                // Measured on two H200s: the lookup is per context. Memory of another device is
                // not found through this context, although copies and frees reach it.
                let i = context(w, pid, ctx, note)?;
                if let Some((base, a)) = w.devices[i].containing(ptr.0)
                    && a.owner == pid
                {
                    return Ok((DevicePtr(base), a.size));
                }
                let p = &w.processes[pid];
                if let Some((&base, m)) = p.ipc.range(..=ptr.0).next_back()
                    && m.device == i
                    && ptr.0 < base + m.size as u64
                {
                    return Ok((DevicePtr(base), m.size));
                }
                Err(code::NOT_FOUND)
            }),
        )
    }

    unsafe fn memcpy_htod(
        &self,
        ctx: ContextHandle,
        dst: DevicePtr,
        src: &[u8],
    ) -> Result<(), DriverError> {
        self.copy_call(Op::MemcpyHtoD, ctx, dst, src.len(), |w, by| {
            // SAFETY: `Driver::memcpy_htod`'s contract: the destination is live memory of the
            // caller's that nothing else touches during the call.
            unsafe { w.write(by, dst.0, src) }
        })
    }

    unsafe fn memcpy_dtoh(
        &self,
        ctx: ContextHandle,
        dst: &mut [u8],
        src: DevicePtr,
    ) -> Result<(), DriverError> {
        let len = dst.len();
        self.copy_call(Op::MemcpyDtoH, ctx, src, len, |w, by| {
            // SAFETY: `Driver::memcpy_dtoh`'s contract: the source is live memory of the caller's
            // that nothing writes during the call.
            unsafe { w.read(by, src.0, dst) }
        })
    }

    fn stream_synchronize(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.call(
            Op::StreamSynchronize,
            Box::new(move |w, pid, note| {
                context(w, pid, ctx, note)?;
                w.check_stream(pid, stream.0)?;
                // Work is done when it is issued here; what synchronising changes is that
                // blocks freed on the stream become reusable on every stream, and pools
                // release what they reserve above their threshold.
                let handles: Vec<u64> = w.processes[pid].pools.keys().copied().collect();
                for h in handles {
                    let pool = w.processes[pid].pools.get_mut(&h).expect("listed");
                    for b in &mut pool.free {
                        if b.stream == stream.0 || stream.0 == 0 {
                            b.ready = true;
                        }
                    }
                    let keep = usize::try_from(pool.threshold).unwrap_or(usize::MAX);
                    w.pool_release(pid, h, keep);
                }
                Ok(())
            }),
        )
    }

    fn device_default_mem_pool(&self, dev: DeviceOrdinal) -> Result<MemPoolHandle, DriverError> {
        self.call(
            Op::DeviceGetDefaultMemPool,
            Box::new(move |w, pid, note| {
                note.device = Some(dev);
                let i = dev.0 as usize;
                if !w.processes[pid].initialized {
                    return Err(code::NOT_INITIALIZED);
                }
                if i >= w.devices.len() {
                    return Err(code::INVALID_DEVICE);
                }
                let p = &w.processes[pid];
                if let Some((&h, _)) = p.pools.iter().find(|(_, q)| q.is_default && q.device == i) {
                    return Ok(MemPoolHandle(h));
                }
                let h = w.new_handle();
                w.processes[pid].pools.insert(h, SimPool::new(i, true));
                Ok(MemPoolHandle(h))
            }),
        )
    }

    fn mem_pool_create(
        &self,
        ctx: ContextHandle,
        dev: DeviceOrdinal,
        ipc: bool,
    ) -> Result<MemPoolHandle, DriverError> {
        self.call(
            Op::MemPoolCreate,
            Box::new(move |w, pid, note| {
                context(w, pid, ctx, note)?;
                let i = dev.0 as usize;
                if i >= w.devices.len() {
                    return Err(code::INVALID_DEVICE);
                }
                let h = w.new_handle();
                let mut pool = SimPool::new(i, false);
                pool.ipc = ipc;
                w.processes[pid].pools.insert(h, pool);
                Ok(MemPoolHandle(h))
            }),
        )
    }

    unsafe fn mem_pool_destroy(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
    ) -> Result<(), DriverError> {
        self.call(
            Op::MemPoolDestroy,
            Box::new(move |w, pid, note| {
                context(w, pid, ctx, note)?;
                match w.processes[pid].pools.get(&pool.0) {
                    Some(p) if !p.is_default && !p.destroyed => {}
                    _ => return Err(code::INVALID_VALUE),
                }
                let mut p = w.processes[pid].pools.remove(&pool.0).expect("checked");
                for b in std::mem::take(&mut p.free) {
                    let _ = w.free_device(pid, b.addr);
                }
                // The driver releases the memory of allocations still outstanding only when
                // they are freed (cuMemFreeAsync); until then the pool lingers, destroyed.
                if !p.live.is_empty() {
                    p.destroyed = true;
                    w.processes[pid].pools.insert(pool.0, p);
                }
                Ok(())
            }),
        )
    }

    fn mem_pool_set_release_threshold(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
        bytes: u64,
    ) -> Result<(), DriverError> {
        self.call(
            Op::MemPoolSetAttribute,
            Box::new(move |w, pid, note| {
                context(w, pid, ctx, note)?;
                let p = w.pool_mut(pid, pool)?;
                p.threshold = bytes;
                Ok(())
            }),
        )
    }

    fn mem_pool_trim_to(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
        keep: usize,
    ) -> Result<(), DriverError> {
        self.call(
            Op::MemPoolTrimTo,
            Box::new(move |w, pid, note| {
                context(w, pid, ctx, note)?;
                w.pool_mut(pid, pool)?;
                w.pool_release(pid, pool.0, keep);
                Ok(())
            }),
        )
    }

    fn mem_pool_usage(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
    ) -> Result<MemPoolUsage, DriverError> {
        self.call(
            Op::MemPoolGetAttribute,
            Box::new(move |w, pid, note| {
                context(w, pid, ctx, note)?;
                let p = w.pool_mut(pid, pool)?;
                Ok(MemPoolUsage {
                    reserved: p.reserved as u64,
                    used: p.used as u64,
                })
            }),
        )
    }

    fn mem_alloc_from_pool_async(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<DevicePtr, DriverError> {
        self.call(
            Op::MemAllocFromPoolAsync,
            Box::new(move |w, pid, note| {
                note.bytes = Some(bytes);
                let i = context(w, pid, ctx, note)?;
                w.check_stream(pid, stream.0)?;
                let p = w.pool_mut(pid, pool)?;
                // An imported pool makes no allocations (the driver documents it).
                if bytes == 0 || p.device != i || p.imported_from.is_some() {
                    return Err(code::INVALID_VALUE);
                }
                // Best fit among the blocks this stream may reuse. The driver splits blocks; the
                // simulator reuses whole ones, so it takes none much larger than the request.
                let fits = |size: usize| size >= bytes && size <= (2 * bytes).max(PAGE_SIZE);
                let found = p
                    .free
                    .iter()
                    .enumerate()
                    .filter(|(_, b)| fits(b.size) && (b.ready || b.stream == stream.0))
                    .min_by_key(|(_, b)| b.size)
                    .map(|(k, _)| k);
                if let Some(k) = found {
                    let b = p.free.swap_remove(k);
                    p.used += b.size;
                    p.live.insert(b.addr, b.size);
                    note.ptr = Some(DevicePtr(b.addr));
                    return Ok(DevicePtr(b.addr));
                }
                let addr = match w.alloc_device(i, pid, bytes) {
                    Err(code::OUT_OF_MEMORY) => {
                        // Release what the pool holds unused, then try once more.
                        w.pool_release(pid, pool.0, 0);
                        w.alloc_device(i, pid, bytes)?
                    }
                    other => other?,
                };
                let p = w.processes[pid].pools.get_mut(&pool.0).expect("checked");
                p.reserved += bytes;
                p.used += bytes;
                p.live.insert(addr, bytes);
                note.ptr = Some(DevicePtr(addr));
                Ok(DevicePtr(addr))
            }),
        )
    }

    unsafe fn mem_free_async(
        &self,
        ctx: ContextHandle,
        ptr: DevicePtr,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.call(
            Op::MemFreeAsync,
            Box::new(move |w, pid, note| {
                note.ptr = Some(ptr);
                context(w, pid, ctx, note)?;
                w.check_stream(pid, stream.0)?;
                // A pointer imported from another process's pool: the mapping goes.
                if w.processes[pid]
                    .ipc
                    .get(&ptr.0)
                    .is_some_and(|m| m.pool.is_some())
                {
                    let m = w.processes[pid].ipc.remove(&ptr.0).expect("present");
                    note.bytes = Some(m.size);
                    w.drop_store(m.store);
                    return Ok(());
                }
                let p = w.processes[pid]
                    .pools
                    .values_mut()
                    .find(|p| p.live.contains_key(&ptr.0))
                    .ok_or(code::INVALID_VALUE)?;
                let size = p.live.remove(&ptr.0).expect("found");
                note.bytes = Some(size);
                p.used -= size;
                if p.destroyed {
                    let gone = p.live.is_empty();
                    w.free_device(pid, ptr.0)?;
                    if gone {
                        w.processes[pid]
                            .pools
                            .retain(|_, p| !(p.destroyed && p.live.is_empty()));
                    }
                    return Ok(());
                }
                p.free.push(FreeBlock {
                    addr: ptr.0,
                    size,
                    stream: stream.0,
                    ready: false,
                });
                Ok(())
            }),
        )
    }

    unsafe fn memcpy_dtod(
        &self,
        ctx: ContextHandle,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
    ) -> Result<(), DriverError> {
        self.copy_call(Op::MemcpyDtoD, ctx, dst, bytes, |w, by| {
            let mut staging = vec![0u8; bytes];
            // SAFETY: `Driver::memcpy_dtod`'s contract: both ranges are live memory of the
            // caller's that nothing else writes during the call.
            unsafe {
                w.read(by, src.0, &mut staging)?;
                w.write(by, dst.0, &staging)
            }
        })
    }

    unsafe fn memset_d8(
        &self,
        ctx: ContextHandle,
        dst: DevicePtr,
        value: u8,
        bytes: usize,
    ) -> Result<(), DriverError> {
        self.copy_call(Op::MemsetD8, ctx, dst, bytes, |w, by| {
            // SAFETY: `Driver::memset_d8`'s contract: the range is live memory of the caller's
            // that nothing else uses during the call.
            unsafe { w.write(by, dst.0, &vec![value; bytes]) }
        })
    }

    fn mem_host_alloc(
        &self,
        ctx: ContextHandle,
        bytes: usize,
        flags: u32,
    ) -> Result<HostPtr, DriverError> {
        self.call(
            Op::MemHostAlloc,
            Box::new(move |w, pid, note| {
                note.bytes = Some(bytes);
                let i = context(w, pid, ctx, note)?;
                let known =
                    host_alloc::PORTABLE | host_alloc::DEVICEMAP | host_alloc::WRITECOMBINED;
                if flags & !known != 0 {
                    return Err(code::INVALID_VALUE);
                }
                if bytes == 0 {
                    // Measured on the GPU: success, with the null pointer.
                    return Ok(HostPtr(0));
                }
                let mapped = flags & host_alloc::DEVICEMAP != 0;
                if mapped && !w.devices[i].config.can_map_host_memory {
                    return Err(code::NOT_SUPPORTED);
                }
                if bytes > w.pinned_limit - w.pinned {
                    return Err(code::OUT_OF_MEMORY);
                }
                let storage = vec![0u8; bytes].into_boxed_slice();
                let addr = storage.as_ptr() as usize;
                w.pinned += bytes;
                w.processes[pid].host.insert(
                    addr,
                    HostRange {
                        size: bytes,
                        device: i,
                        // Unified addressing: pinned memory is mapped whatever the flag says, as long as
                        // the device can map host memory.
                        mapped: w.devices[i].config.can_map_host_memory,
                        portable: flags & host_alloc::PORTABLE != 0,
                        kind: HostKind::Alloc(storage),
                    },
                );
                note.host = Some(HostPtr(addr));
                Ok(HostPtr(addr))
            }),
        )
    }

    unsafe fn mem_free_host(&self, ctx: ContextHandle, ptr: HostPtr) -> Result<(), DriverError> {
        self.call(
            Op::MemFreeHost,
            Box::new(move |w, pid, note| {
                note.host = Some(ptr);
                context(w, pid, ctx, note)?;
                if ptr.is_null() {
                    return Ok(());
                }
                let p = &mut w.processes[pid];
                match p.host.get(&ptr.0) {
                    Some(HostRange {
                        kind: HostKind::Alloc(_),
                        size,
                        ..
                    }) => {
                        let size = *size;
                        p.host.remove(&ptr.0);
                        w.pinned -= size;
                        note.bytes = Some(size);
                        Ok(())
                    }
                    _ => Err(code::INVALID_VALUE),
                }
            }),
        )
    }

    unsafe fn mem_host_register(
        &self,
        ctx: ContextHandle,
        ptr: HostPtr,
        bytes: usize,
        flags: u32,
    ) -> Result<(), DriverError> {
        self.call(
            Op::MemHostRegister,
            Box::new(move |w, pid, note| {
                note.host = Some(ptr);
                note.bytes = Some(bytes);
                let i = context(w, pid, ctx, note)?;
                let known = host_register::PORTABLE | host_register::DEVICEMAP;
                if bytes == 0 || ptr.is_null() || flags & !known != 0 {
                    return Err(code::INVALID_VALUE);
                }
                let mapped = flags & host_register::DEVICEMAP != 0;
                if mapped && !w.devices[i].config.can_map_host_memory {
                    return Err(code::NOT_SUPPORTED);
                }
                let end = ptr.0.checked_add(bytes).ok_or(code::INVALID_VALUE)?;
                let p = &w.processes[pid];
                let overlaps = p
                    .host
                    .range(..end)
                    .next_back()
                    .is_some_and(|(&start, h)| start + h.size > ptr.0);
                if overlaps {
                    return Err(code::HOST_MEMORY_ALREADY_REGISTERED);
                }
                if bytes > w.pinned_limit - w.pinned {
                    return Err(code::OUT_OF_MEMORY);
                }
                w.pinned += bytes;
                w.processes[pid].host.insert(
                    ptr.0,
                    HostRange {
                        size: bytes,
                        device: i,
                        // Measured on the GPU: with unified addressing a registered range has a device
                        // address whether or not DEVICEMAP was asked for.
                        mapped: w.devices[i].config.can_map_host_memory,
                        portable: flags & host_register::PORTABLE != 0,
                        kind: HostKind::Registered,
                    },
                );
                Ok(())
            }),
        )
    }

    unsafe fn mem_host_unregister(
        &self,
        ctx: ContextHandle,
        ptr: HostPtr,
    ) -> Result<(), DriverError> {
        self.call(
            Op::MemHostUnregister,
            Box::new(move |w, pid, note| {
                note.host = Some(ptr);
                context(w, pid, ctx, note)?;
                let p = &mut w.processes[pid];
                match p.host.get(&ptr.0) {
                    Some(HostRange {
                        kind: HostKind::Registered,
                        size,
                        ..
                    }) => {
                        let size = *size;
                        p.host.remove(&ptr.0);
                        w.pinned -= size;
                        note.bytes = Some(size);
                        Ok(())
                    }
                    _ => Err(code::HOST_MEMORY_NOT_REGISTERED),
                }
            }),
        )
    }

    fn mem_host_get_device_pointer(
        &self,
        ctx: ContextHandle,
        ptr: HostPtr,
    ) -> Result<DevicePtr, DriverError> {
        self.call(
            Op::MemHostGetDevicePointer,
            Box::new(move |w, pid, note| {
                note.host = Some(ptr);
                context(w, pid, ctx, note)?;
                let p = &w.processes[pid];
                match p.host.range(..=ptr.0).next_back() {
                    Some((&start, h)) if h.mapped && ptr.0 < start + h.size => {
                        note.ptr = Some(DevicePtr(ptr.0 as u64));
                        Ok(DevicePtr(ptr.0 as u64))
                    }
                    _ => Err(code::INVALID_VALUE),
                }
            }),
        )
    }

    fn stream_create(&self, ctx: ContextHandle, flags: u32) -> Result<StreamHandle, DriverError> {
        self.create_object(Op::StreamCreate, ctx, Object::Stream, flags <= 1)
            .map(StreamHandle)
    }

    unsafe fn stream_destroy(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.destroy_object(Op::StreamDestroy, ctx, Object::Stream, stream.0)
    }

    fn event_create(&self, ctx: ContextHandle, flags: u32) -> Result<EventHandle, DriverError> {
        self.create_object(Op::EventCreate, ctx, Object::Event, flags & !0xf == 0)
            .map(EventHandle)
    }

    unsafe fn event_destroy(
        &self,
        ctx: ContextHandle,
        event: EventHandle,
    ) -> Result<(), DriverError> {
        self.destroy_object(Op::EventDestroy, ctx, Object::Event, event.0)
    }

    fn module_load_data(
        &self,
        ctx: ContextHandle,
        image: &[u8],
    ) -> Result<ModuleHandle, DriverError> {
        self.create_object(
            Op::ModuleLoadData,
            ctx,
            Object::Module,
            plausible_image(image),
        )
        .map(ModuleHandle)
    }

    unsafe fn module_unload(
        &self,
        ctx: ContextHandle,
        module: ModuleHandle,
    ) -> Result<(), DriverError> {
        self.destroy_object(Op::ModuleUnload, ctx, Object::Module, module.0)
    }

    fn ipc_get_mem_handle(
        &self,
        ctx: ContextHandle,
        ptr: DevicePtr,
    ) -> Result<IpcMemHandle, DriverError> {
        self.call(
            Op::IpcGetMemHandle,
            Box::new(move |w, pid, note| {
                note.ptr = Some(ptr);
                context(w, pid, ctx, note)?;
                for (i, d) in w.devices.iter().enumerate() {
                    // Measured on the GPU: an address inside the allocation names it too.
                    if let Some((base, a)) = d.containing(ptr.0)
                        && a.owner == pid
                    {
                        // Stream-ordered pool memory cannot be exported this way (the driver
                        // documents it; pools export through shareable handles).
                        if w.processes[pid]
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
            }),
        )
    }

    fn ipc_open_mem_handle(
        &self,
        ctx: ContextHandle,
        handle: &IpcMemHandle,
    ) -> Result<DevicePtr, DriverError> {
        let handle = *handle;
        self.call(
            Op::IpcOpenMemHandle,
            Box::new(move |w, pid, note| {
                let i = context(w, pid, ctx, note)?;
                let (exporter, device, store) = decode_ipc(&handle).ok_or(code::INVALID_VALUE)?;
                if device >= w.devices.len() || exporter >= w.processes.len() {
                    return Err(code::INVALID_VALUE);
                }
                if exporter == pid {
                    return Err(code::INVALID_CONTEXT);
                }
                if device != i && !w.peer_access {
                    return Err(code::PEER_ACCESS_UNSUPPORTED);
                }
                // The driver's own record of the allocation decides the size, never the bytes
                // of the handle (which another process may have garbled).
                let Some(size) = w.devices[device]
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
                if let Some((&addr, m)) = w.processes[pid]
                    .ipc
                    .iter_mut()
                    .find(|(_, m)| m.store == store && m.device == i && m.pool.is_none())
                {
                    m.opens += 1;
                    note.ptr = Some(DevicePtr(addr));
                    return Ok(DevicePtr(addr));
                }
                let addr = w.map_store(pid, i, store, size, None);
                note.ptr = Some(DevicePtr(addr));
                note.bytes = Some(size);
                Ok(DevicePtr(addr))
            }),
        )
    }

    unsafe fn ipc_close_mem_handle(
        &self,
        ctx: ContextHandle,
        ptr: DevicePtr,
    ) -> Result<(), DriverError> {
        self.call(
            Op::IpcCloseMemHandle,
            Box::new(move |w, pid, note| {
                note.ptr = Some(ptr);
                context(w, pid, ctx, note)?;
                let m = w.processes[pid]
                    .ipc
                    .get_mut(&ptr.0)
                    .filter(|m| m.pool.is_none())
                    .ok_or(code::INVALID_VALUE)?;
                m.opens -= 1;
                if m.opens == 0 {
                    let m = w.processes[pid].ipc.remove(&ptr.0).expect("present");
                    w.drop_store(m.store);
                }
                Ok(())
            }),
        )
    }

    fn mem_pool_export_fd(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
    ) -> Result<OwnedFd, DriverError> {
        self.call(
            Op::MemPoolExportToShareableHandle,
            Box::new(move |w, pid, note| {
                context(w, pid, ctx, note)?;
                let p = w.pool_mut(pid, pool)?;
                // Only a pool created with a shareable handle type exports, and not one that
                // was itself imported or destroyed.
                if !p.ipc || p.destroyed || p.imported_from.is_some() {
                    return Err(code::INVALID_VALUE);
                }
                p.exported = true;
                // A real descriptor, so it travels like the driver's: one end of a pipe, known
                // by its inode.
                let (reader, _writer) = std::io::pipe().map_err(|_| code::OUT_OF_MEMORY)?;
                let fd = OwnedFd::from(reader);
                let ino = inode(fd.as_fd()).ok_or(code::OUT_OF_MEMORY)?;
                w.pool_exports.insert(ino, (pid, pool.0));
                Ok(fd)
            }),
        )
    }

    fn mem_pool_import_fd(
        &self,
        ctx: ContextHandle,
        fd: BorrowedFd<'_>,
    ) -> Result<MemPoolHandle, DriverError> {
        let ino = inode(fd);
        self.call(
            Op::MemPoolImportFromShareableHandle,
            Box::new(move |w, pid, note| {
                context(w, pid, ctx, note)?;
                let &(exporter, h) = ino
                    .and_then(|ino| w.pool_exports.get(&ino))
                    .ok_or(code::INVALID_VALUE)?;
                // The exporter's own process does not import its pool (a modelling choice:
                // emm never does it).
                if exporter == pid {
                    return Err(code::INVALID_VALUE);
                }
                let device = match w.processes[exporter].pools.get(&h) {
                    Some(p) if !p.destroyed => p.device,
                    _ => return Err(code::INVALID_VALUE),
                };
                let mut imported = SimPool::new(device, false);
                imported.imported_from = Some((exporter, h));
                let handle = w.new_handle();
                w.processes[pid].pools.insert(handle, imported);
                Ok(MemPoolHandle(handle))
            }),
        )
    }

    fn mem_pool_export_pointer(
        &self,
        ctx: ContextHandle,
        ptr: DevicePtr,
    ) -> Result<PoolPtrExportData, DriverError> {
        self.call(
            Op::MemPoolExportPointer,
            Box::new(move |w, pid, note| {
                note.ptr = Some(ptr);
                context(w, pid, ctx, note)?;
                let (&h, _) = w.processes[pid]
                    .pools
                    .iter()
                    .find(|(_, p)| p.exported && !p.destroyed && p.live.contains_key(&ptr.0))
                    .ok_or(code::INVALID_VALUE)?;
                Ok(encode_pool_ptr(pid, h, ptr.0))
            }),
        )
    }

    fn mem_pool_import_pointer(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
        data: &PoolPtrExportData,
    ) -> Result<DevicePtr, DriverError> {
        let data = *data;
        self.call(
            Op::MemPoolImportPointer,
            Box::new(move |w, pid, note| {
                context(w, pid, ctx, note)?;
                let (exporter, h, addr) = decode_pool_ptr(&data).ok_or(code::INVALID_VALUE)?;
                let p = w.pool_mut(pid, pool)?;
                if p.imported_from != Some((exporter, h)) {
                    return Err(code::INVALID_VALUE);
                }
                let device = p.device;
                // The exporter's allocation must still be live in its pool.
                let live = w.processes[exporter]
                    .pools
                    .get(&h)
                    .is_some_and(|p| p.live.contains_key(&addr));
                let alloc = w.devices[device]
                    .allocs
                    .get(&addr)
                    .filter(|a| live && a.owner == exporter)
                    .ok_or(code::INVALID_VALUE)?;
                let (store, size) = (alloc.store, alloc.size);
                let at = w.map_store(pid, device, store, size, Some(pool.0));
                note.ptr = Some(DevicePtr(at));
                note.bytes = Some(size);
                Ok(DevicePtr(at))
            }),
        )
    }

    fn mem_pool_can_access(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
        dev: DeviceOrdinal,
    ) -> Result<bool, DriverError> {
        self.call(
            Op::MemPoolGetAccess,
            Box::new(move |w, pid, note| {
                context(w, pid, ctx, note)?;
                note.device = Some(dev);
                let d = device_index(w, dev)?;
                let p = w.pool_mut(pid, pool)?;
                Ok(p.device == d || p.access.contains(&d))
            }),
        )
    }

    fn mem_pool_grant_access(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
        dev: DeviceOrdinal,
    ) -> Result<(), DriverError> {
        self.call(
            Op::MemPoolSetAccess,
            Box::new(move |w, pid, note| {
                context(w, pid, ctx, note)?;
                note.device = Some(dev);
                let d = device_index(w, dev)?;
                let peers = w.peer_access;
                let p = w.pool_mut(pid, pool)?;
                if d != p.device {
                    if !peers {
                        return Err(code::PEER_ACCESS_UNSUPPORTED);
                    }
                    p.access.insert(d);
                }
                Ok(())
            }),
        )
    }
}

/// The inode of the file `fd` names (a pipe's is unique while it is open).
fn inode(fd: BorrowedFd<'_>) -> Option<u64> {
    let file = std::fs::File::from(fd.try_clone_to_owned().ok()?);
    file.metadata().ok().map(|m| m.ino())
}

const POOL_PTR_MAGIC: &[u8; 8] = b"SIMPOOLP";

/// The simulator's export data of a pool allocation: magic, process, pool handle, address.
fn encode_pool_ptr(pid: usize, pool: u64, addr: u64) -> PoolPtrExportData {
    let mut b = [0u8; 64];
    b[..8].copy_from_slice(POOL_PTR_MAGIC);
    b[8..16].copy_from_slice(&(pid as u64).to_le_bytes());
    b[16..24].copy_from_slice(&pool.to_le_bytes());
    b[24..32].copy_from_slice(&addr.to_le_bytes());
    PoolPtrExportData(b)
}

fn decode_pool_ptr(d: &PoolPtrExportData) -> Option<(usize, u64, u64)> {
    let b = &d.0;
    if &b[..8] != POOL_PTR_MAGIC || b[32..].iter().any(|&x| x != 0) {
        return None;
    }
    let u = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
    Some((usize::try_from(u(8)).ok()?, u(16), u(24)))
}
