//! [`SimDriver`]: a deterministic simulated CUDA system.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Mutex, MutexGuard};

use driver_sys::{
    ContextHandle, DeviceAttribute, DeviceOrdinal, DevicePtr, Driver, DriverError, ErrorKind,
    MemInfo, code,
};

/// The granularity of allocations of up to [`SMALL_MAX`] bytes (measured: 512 bytes).
pub const DEFAULT_ALIGNMENT: usize = 512;
/// The unit device memory is handed out and accounted in (measured: 2 MiB).
pub const PAGE_SIZE: usize = 2 << 20;
/// Allocations up to this size share pages; larger ones get pages of their own.
pub const SMALL_MAX: usize = 1 << 20;

const DEVICE_SPACE_BASE: u64 = 0x7000_0000_0000;
const DEVICE_SPACE_STRIDE: u64 = 1 << 40;
const CONTEXT_HANDLE_BASE: u64 = 0x5c00_0000_0000;

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

/// The simulated system: its devices, in ordinal order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimConfig {
    /// The devices; device `i` has ordinal `i`.
    pub devices: Vec<SimDeviceConfig>,
}

impl SimConfig {
    /// One device with `total_mem` bytes.
    pub fn single(total_mem: usize) -> SimConfig {
        SimConfig {
            devices: vec![SimDeviceConfig::new(total_mem)],
        }
    }

    /// The given devices; PCI bus ids are numbered from 1 where left at 0.
    pub fn with_devices(devices: Vec<SimDeviceConfig>) -> SimConfig {
        SimConfig { devices }
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
    PrimaryCtxRetain,
    PrimaryCtxRelease,
    PrimaryCtxReset,
    MemAlloc,
    MemFree,
    MemGetInfo,
    MemGetAddressRange,
    MemcpyHtoD,
    MemcpyDtoH,
}

impl Op {
    /// The CUDA driver call this operation stands for.
    pub fn call_name(self) -> &'static str {
        match self {
            Op::Init => "cuInit",
            Op::DeviceCount => "cuDeviceGetCount",
            Op::DeviceTotalMem => "cuDeviceTotalMem",
            Op::DeviceAttribute => "cuDeviceGetAttribute",
            Op::PrimaryCtxRetain => "cuDevicePrimaryCtxRetain",
            Op::PrimaryCtxRelease => "cuDevicePrimaryCtxRelease",
            Op::PrimaryCtxReset => "cuDevicePrimaryCtxReset",
            Op::MemAlloc => "cuMemAlloc",
            Op::MemFree => "cuMemFree",
            Op::MemGetInfo => "cuMemGetInfo",
            Op::MemGetAddressRange => "cuMemGetAddressRange",
            Op::MemcpyHtoD => "cuMemcpyHtoD",
            Op::MemcpyDtoH => "cuMemcpyDtoH",
        }
    }
}

/// One entry of the call log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallRecord {
    /// Position in the log, from 0.
    pub seq: u64,
    /// The operation.
    pub op: Op,
    /// The device the call concerned, where it names one (directly or through a context).
    pub device: Option<DeviceOrdinal>,
    /// The pointer argument or result, where there is one.
    pub ptr: Option<DevicePtr>,
    /// The byte count argument, where there is one.
    pub bytes: Option<usize>,
    /// `Ok(())`, or the kind of error returned.
    pub outcome: Result<(), ErrorKind>,
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

/// What a simulated system still holds: allocations and retained contexts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LeakReport {
    /// Live allocations: device, address, requested size.
    pub allocations: Vec<(DeviceOrdinal, DevicePtr, usize)>,
    /// Primary contexts with a non-zero reference count: device, count.
    pub retained_contexts: Vec<(DeviceOrdinal, u32)>,
}

impl LeakReport {
    /// Whether nothing is allocated (retained contexts do not count as leaked memory).
    pub fn no_memory_leaked(&self) -> bool {
        self.allocations.is_empty()
    }

    /// Whether nothing is allocated and no context is retained.
    pub fn is_clean(&self) -> bool {
        self.allocations.is_empty() && self.retained_contexts.is_empty()
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
        for (dev, count) in &self.retained_contexts {
            writeln!(f, "device {dev}: primary context retained {count} time(s)")?;
        }
        Ok(())
    }
}

#[derive(Debug)]
struct SimAlloc {
    size: usize,
    /// Bytes of address space it occupies: `size` rounded to the alignment (small) or to
    /// whole pages (large).
    span: usize,
    bytes: Vec<u8>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Page {
    /// Shared by this many small allocations.
    Small(usize),
    /// Part of one large allocation.
    Large,
}

#[derive(Debug)]
struct SimDevice {
    config: SimDeviceConfig,
    ctx_refcount: u32,
    /// Whether the primary context exists (retained, not reset since).
    ctx_live: bool,
    allocs: BTreeMap<u64, SimAlloc>,
    /// Pages in use, by index from the device's base address.
    pages: BTreeMap<u64, Page>,
}

impl SimDevice {
    fn base(ordinal: usize) -> u64 {
        DEVICE_SPACE_BASE + ordinal as u64 * DEVICE_SPACE_STRIDE
    }

    fn page_addr(&self, ordinal: usize, page: u64) -> u64 {
        Self::base(ordinal) + page * PAGE_SIZE as u64
    }

    fn free_bytes(&self) -> usize {
        let used = self.pages.len() * PAGE_SIZE + self.config.context_overhead;
        self.config.total_mem.saturating_sub(used)
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
    /// new page. Returns the address and whether a new page is needed.
    fn place_small(&self, ordinal: usize, span: usize) -> (u64, Option<u64>) {
        for (&page, kind) in &self.pages {
            if !matches!(kind, Page::Small(_)) {
                continue;
            }
            let start = self.page_addr(ordinal, page);
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
        (self.page_addr(ordinal, page), Some(page))
    }

    fn page_of(&self, ordinal: usize, addr: u64) -> u64 {
        (addr - Self::base(ordinal)) / PAGE_SIZE as u64
    }

    /// The allocation containing `addr`, as (base, allocation).
    fn containing(&self, addr: u64) -> Option<(u64, &SimAlloc)> {
        let (&base, alloc) = self.allocs.range(..=addr).next_back()?;
        (addr < base + alloc.size.max(1) as u64).then_some((base, alloc))
    }

    /// Destroys the context and everything it owned.
    fn destroy_context(&mut self) -> usize {
        let n = self.allocs.len();
        self.allocs.clear();
        self.pages.clear();
        self.ctx_live = false;
        n
    }
}

#[derive(Debug)]
struct SimState {
    initialized: bool,
    devices: Vec<SimDevice>,
    log: Vec<CallRecord>,
    faults: Vec<(Fault, u64)>,
}

/// A deterministic simulated CUDA system.
///
/// Shareable across threads (`Arc<SimDriver>` coerces to `Arc<dyn Driver>`); one lock guards
/// the whole state, so the call log has one total order.
///
/// # Model
///
/// - **Devices** are configured up front ([`SimConfig`]). Each has a primary context with a
///   reference count, total memory, `CAN_MAP_HOST_MEMORY` and PCI ids.
/// - **Address space and accounting**, as measured on an H200 (driver 580, CUDA 13.0; see
///   `ci/hardware-runs.md`). Device memory is handed out in 2 MiB pages. Allocations of up to
///   1 MiB are packed into shared pages at 512-byte granularity (first fit, lowest address);
///   larger ones get whole 2 MiB-aligned pages of their own. A page is returned as soon as its
///   last allocation is freed. `free` in [`Driver::mem_get_info`] is
///   `total - context overhead - pages in use × 2 MiB`, so a 1-byte allocation that opens a
///   page costs 2 MiB, and one that fits an open page costs nothing, exactly as on the GPU.
///   Device `d`'s addresses start at `0x7000_0000_0000 + d * 2^40`.
/// - **Real bytes.** Each allocation has zero-initialised backing bytes; copies move data.
/// - **Contract checking** with the real driver's codes: zero-byte allocations, unknown or
///   interior pointers, double frees and out-of-range copies give `CUDA_ERROR_INVALID_VALUE`
///   (freeing the null pointer succeeds); a request larger than what is free gives
///   `CUDA_ERROR_OUT_OF_MEMORY`.
/// - **Primary contexts.** Releasing the last reference destroys the context and its memory;
///   `cuDevicePrimaryCtxReset` destroys them even while references remain. A destroyed
///   context answers `CUDA_ERROR_CONTEXT_IS_DESTROYED` until the next retain re-creates it
///   (with the same handle, as on the GPU); releasing at count zero is
///   `CUDA_ERROR_INVALID_CONTEXT`.
/// - **Observability.** Every call is appended to a log ([`SimDriver::calls`]) with its
///   arguments and outcome; [`SimDriver::leak_report`] lists what is still allocated.
/// - **Scripted faults.** [`SimDriver::inject`] makes the Nth call of one operation (or of any
///   operation) fail with a chosen error kind, once.
#[derive(Debug)]
pub struct SimDriver {
    state: Mutex<SimState>,
}

/// What a single call observed, for the log.
#[derive(Default)]
struct Note {
    device: Option<DeviceOrdinal>,
    ptr: Option<DevicePtr>,
    bytes: Option<usize>,
}

impl SimDriver {
    /// A simulated system with the given devices. The driver starts uninitialised, as libcuda
    /// does: call [`Driver::init`] first.
    pub fn new(config: SimConfig) -> SimDriver {
        let devices = config
            .devices
            .into_iter()
            .enumerate()
            .map(|(i, mut c)| {
                if c.pci_bus_id == 0 {
                    c.pci_bus_id = i as i32 + 1;
                }
                SimDevice {
                    config: c,
                    ctx_refcount: 0,
                    ctx_live: false,
                    allocs: BTreeMap::new(),
                    pages: BTreeMap::new(),
                }
            })
            .collect();
        SimDriver {
            state: Mutex::new(SimState {
                initialized: false,
                devices,
                log: Vec::new(),
                faults: Vec::new(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, SimState> {
        // A panic in a test thread must not hide every later call.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Scripts a fault; see [`Fault`].
    pub fn inject(&self, fault: Fault) {
        assert!(fault.nth >= 1, "Fault::nth is 1-based");
        self.lock().faults.push((fault, 0));
    }

    /// Removes every scripted fault that has not fired yet.
    pub fn clear_faults(&self) {
        self.lock().faults.clear();
    }

    /// A copy of the call log.
    pub fn calls(&self) -> Vec<CallRecord> {
        self.lock().log.clone()
    }

    /// How many calls of `op` were made (successful or not).
    pub fn count(&self, op: Op) -> usize {
        self.lock().log.iter().filter(|c| c.op == op).count()
    }

    /// How many driver calls were made in all.
    pub fn total_calls(&self) -> usize {
        self.lock().log.len()
    }

    /// The operations of the log, in order (for ordering assertions).
    pub fn ops(&self) -> Vec<Op> {
        self.lock().log.iter().map(|c| c.op).collect()
    }

    /// Live allocations of `dev`: address and requested size, in address order.
    pub fn live_allocations(&self, dev: DeviceOrdinal) -> Vec<(DevicePtr, usize)> {
        let st = self.lock();
        st.devices
            .get(dev.0 as usize)
            .map(|d| {
                d.allocs
                    .iter()
                    .map(|(&a, s)| (DevicePtr(a), s.size))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The primary context's reference count on `dev`.
    pub fn context_refcount(&self, dev: DeviceOrdinal) -> u32 {
        self.lock()
            .devices
            .get(dev.0 as usize)
            .map_or(0, |d| d.ctx_refcount)
    }

    /// Frees that failed because the pointer was unknown (never allocated, or freed already).
    pub fn rejected_frees(&self) -> Vec<CallRecord> {
        self.lock()
            .log
            .iter()
            .filter(|c| c.op == Op::MemFree && c.outcome == Err(ErrorKind::InvalidValue))
            .cloned()
            .collect()
    }

    /// What is still allocated and retained.
    pub fn leak_report(&self) -> LeakReport {
        let st = self.lock();
        let mut report = LeakReport::default();
        for (i, d) in st.devices.iter().enumerate() {
            let dev = DeviceOrdinal(i as u32);
            for (&addr, a) in &d.allocs {
                report.allocations.push((dev, DevicePtr(addr), a.size));
            }
            if d.ctx_refcount > 0 {
                report.retained_contexts.push((dev, d.ctx_refcount));
            }
        }
        report
    }

    /// Runs one driver call: checks scripted faults, runs `body`, logs the outcome.
    fn call<T>(
        &self,
        op: Op,
        body: impl FnOnce(&mut SimState, &mut Note) -> Result<T, u32>,
    ) -> Result<T, DriverError> {
        let mut st = self.lock();
        let mut note = Note::default();
        let seq = st.log.len() as u64;
        let faulted = Self::take_fault(&mut st, op);
        let result = match faulted {
            Some(kind) => Err(kind.representative_code()),
            None => {
                if op != Op::Init && !st.initialized {
                    Err(code::NOT_INITIALIZED)
                } else {
                    body(&mut st, &mut note)
                }
            }
        };
        let outcome = result
            .as_ref()
            .map(|_| ())
            .map_err(|&c| ErrorKind::from_code(c));
        st.log.push(CallRecord {
            seq,
            op,
            device: note.device,
            ptr: note.ptr,
            bytes: note.bytes,
            outcome,
        });
        drop(st);
        result.map_err(|c| {
            let e = DriverError::from_code(op.call_name(), c);
            if faulted.is_some() {
                e.with_detail("injected by SimDriver")
            } else {
                e
            }
        })
    }

    fn take_fault(st: &mut SimState, op: Op) -> Option<ErrorKind> {
        let mut fired = None;
        for (fault, seen) in st.faults.iter_mut() {
            if fault.op.is_none_or(|o| o == op) {
                *seen += 1;
                if *seen == fault.nth && fired.is_none() {
                    fired = Some(fault.kind);
                }
            }
        }
        st.faults.retain(|(f, seen)| *seen < f.nth);
        fired
    }

    fn device(st: &mut SimState, dev: DeviceOrdinal) -> Result<&mut SimDevice, u32> {
        st.devices
            .get_mut(dev.0 as usize)
            .ok_or(code::INVALID_DEVICE)
    }

    /// The device behind a context handle whose primary context is retained.
    fn context<'s>(
        st: &'s mut SimState,
        ctx: ContextHandle,
        note: &mut Note,
    ) -> Result<(usize, &'s mut SimDevice), u32> {
        let index = ctx
            .0
            .checked_sub(CONTEXT_HANDLE_BASE)
            .filter(|off| off % 0x100 == 0)
            .map(|off| (off / 0x100) as usize)
            .filter(|&i| i < st.devices.len())
            .ok_or(code::INVALID_CONTEXT)?;
        note.device = Some(DeviceOrdinal(index as u32));
        let d = &mut st.devices[index];
        if !d.ctx_live {
            return Err(code::CONTEXT_IS_DESTROYED);
        }
        Ok((index, d))
    }

    /// Checks that `[addr, addr + len)` lies inside one allocation; returns (base, offset).
    fn range(d: &SimDevice, addr: u64, len: usize) -> Result<(u64, usize), u32> {
        let (base, alloc) = d.containing(addr).ok_or(code::INVALID_VALUE)?;
        let offset = (addr - base) as usize;
        if offset.checked_add(len).is_none_or(|end| end > alloc.size) {
            return Err(code::INVALID_VALUE);
        }
        Ok((base, offset))
    }
}

impl Driver for SimDriver {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn init(&self) -> Result<(), DriverError> {
        self.call(Op::Init, |st, _| {
            st.initialized = true;
            Ok(())
        })
    }

    fn device_count(&self) -> Result<u32, DriverError> {
        self.call(Op::DeviceCount, |st, _| Ok(st.devices.len() as u32))
    }

    fn device_total_mem(&self, dev: DeviceOrdinal) -> Result<usize, DriverError> {
        self.call(Op::DeviceTotalMem, |st, note| {
            note.device = Some(dev);
            Ok(Self::device(st, dev)?.config.total_mem)
        })
    }

    fn device_attribute(
        &self,
        dev: DeviceOrdinal,
        attr: DeviceAttribute,
    ) -> Result<i32, DriverError> {
        self.call(Op::DeviceAttribute, |st, note| {
            note.device = Some(dev);
            let c = &Self::device(st, dev)?.config;
            Ok(match attr {
                DeviceAttribute::CanMapHostMemory => i32::from(c.can_map_host_memory),
                DeviceAttribute::PciBusId => c.pci_bus_id,
                DeviceAttribute::PciDeviceId => c.pci_device_id,
                DeviceAttribute::PciDomainId => c.pci_domain_id,
            })
        })
    }

    fn primary_ctx_retain(&self, dev: DeviceOrdinal) -> Result<ContextHandle, DriverError> {
        self.call(Op::PrimaryCtxRetain, |st, note| {
            note.device = Some(dev);
            let d = Self::device(st, dev)?;
            d.ctx_refcount += 1;
            d.ctx_live = true;
            Ok(ContextHandle(
                CONTEXT_HANDLE_BASE + u64::from(dev.0) * 0x100,
            ))
        })
    }

    unsafe fn primary_ctx_release(&self, dev: DeviceOrdinal) -> Result<(), DriverError> {
        self.call(Op::PrimaryCtxRelease, |st, note| {
            note.device = Some(dev);
            let d = Self::device(st, dev)?;
            if d.ctx_refcount == 0 {
                return Err(code::INVALID_CONTEXT);
            }
            d.ctx_refcount -= 1;
            if d.ctx_refcount == 0 {
                let n = d.destroy_context();
                if n > 0 {
                    tracing::debug!(%dev, allocations = n, "sim: last primary-context reference released; its memory is destroyed");
                }
            }
            Ok(())
        })
    }

    unsafe fn primary_ctx_reset(&self, dev: DeviceOrdinal) -> Result<(), DriverError> {
        self.call(Op::PrimaryCtxReset, |st, note| {
            note.device = Some(dev);
            Self::device(st, dev)?.destroy_context();
            Ok(())
        })
    }

    fn mem_alloc(&self, ctx: ContextHandle, bytes: usize) -> Result<DevicePtr, DriverError> {
        self.call(Op::MemAlloc, |st, note| {
            note.bytes = Some(bytes);
            let (index, d) = Self::context(st, ctx, note)?;
            if bytes == 0 {
                return Err(code::INVALID_VALUE);
            }
            let (addr, span, new_pages) = if bytes <= SMALL_MAX {
                let span = bytes.next_multiple_of(d.config.alignment);
                let (addr, new_page) = d.place_small(index, span);
                (addr, span, new_page.map(|p| (p, 1)))
            } else {
                let span = bytes
                    .checked_next_multiple_of(PAGE_SIZE)
                    .ok_or(code::OUT_OF_MEMORY)?;
                let n = (span / PAGE_SIZE) as u64;
                let first = d.free_pages(n);
                (d.page_addr(index, first), span, Some((first, n)))
            };
            let needed = new_pages.map_or(0, |(_, n)| n as usize * PAGE_SIZE);
            if needed > d.free_bytes() {
                return Err(code::OUT_OF_MEMORY);
            }
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
            if bytes <= SMALL_MAX {
                let page = d.page_of(index, addr);
                if let Some(Page::Small(count)) = d.pages.get_mut(&page) {
                    *count += 1;
                }
            }
            d.allocs.insert(
                addr,
                SimAlloc {
                    size: bytes,
                    span,
                    bytes: vec![0; bytes],
                },
            );
            note.ptr = Some(DevicePtr(addr));
            Ok(DevicePtr(addr))
        })
    }

    unsafe fn mem_free(&self, ctx: ContextHandle, ptr: DevicePtr) -> Result<(), DriverError> {
        self.call(Op::MemFree, |st, note| {
            note.ptr = Some(ptr);
            let (index, d) = Self::context(st, ctx, note)?;
            if ptr.is_null() {
                return Ok(());
            }
            let alloc = d.allocs.remove(&ptr.0).ok_or(code::INVALID_VALUE)?;
            note.bytes = Some(alloc.size);
            let first = d.page_of(index, ptr.0);
            if alloc.size <= SMALL_MAX {
                if let Some(Page::Small(count)) = d.pages.get_mut(&first) {
                    *count -= 1;
                    if *count == 0 {
                        d.pages.remove(&first);
                    }
                }
            } else {
                for p in first..first + (alloc.span / PAGE_SIZE) as u64 {
                    d.pages.remove(&p);
                }
            }
            Ok(())
        })
    }

    fn mem_get_info(&self, ctx: ContextHandle) -> Result<MemInfo, DriverError> {
        self.call(Op::MemGetInfo, |st, note| {
            let (_, d) = Self::context(st, ctx, note)?;
            Ok(MemInfo {
                free: d.free_bytes(),
                total: d.config.total_mem,
            })
        })
    }

    fn mem_get_address_range(
        &self,
        ctx: ContextHandle,
        ptr: DevicePtr,
    ) -> Result<(DevicePtr, usize), DriverError> {
        self.call(Op::MemGetAddressRange, |st, note| {
            note.ptr = Some(ptr);
            let (_, d) = Self::context(st, ctx, note)?;
            let (base, alloc) = d.containing(ptr.0).ok_or(code::NOT_FOUND)?;
            Ok((DevicePtr(base), alloc.size))
        })
    }

    unsafe fn memcpy_htod(
        &self,
        ctx: ContextHandle,
        dst: DevicePtr,
        src: &[u8],
    ) -> Result<(), DriverError> {
        self.call(Op::MemcpyHtoD, |st, note| {
            note.ptr = Some(dst);
            note.bytes = Some(src.len());
            let (_, d) = Self::context(st, ctx, note)?;
            if src.is_empty() {
                return Ok(());
            }
            let (base, offset) = Self::range(d, dst.0, src.len())?;
            let alloc = d
                .allocs
                .get_mut(&base)
                .expect("range() found this allocation");
            alloc.bytes[offset..offset + src.len()].copy_from_slice(src);
            Ok(())
        })
    }

    unsafe fn memcpy_dtoh(
        &self,
        ctx: ContextHandle,
        dst: &mut [u8],
        src: DevicePtr,
    ) -> Result<(), DriverError> {
        self.call(Op::MemcpyDtoH, |st, note| {
            note.ptr = Some(src);
            note.bytes = Some(dst.len());
            let (_, d) = Self::context(st, ctx, note)?;
            if dst.is_empty() {
                return Ok(());
            }
            let (base, offset) = Self::range(d, src.0, dst.len())?;
            let alloc = &d.allocs[&base];
            dst.copy_from_slice(&alloc.bytes[offset..offset + dst.len()]);
            Ok(())
        })
    }
}
