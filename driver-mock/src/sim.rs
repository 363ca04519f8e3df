//! [`SimDriver`]: a deterministic simulated CUDA system.
//!
//! # Model
//!
//! - **Devices** are configured up front ([`SimConfig`]). Each has a primary context with a
//!   reference count, total memory, `CAN_MAP_HOST_MEMORY` and PCI ids.
//! - **Address space.** Device `d` owns the range starting at
//!   `0x7000_0000_0000 + d * 2^40`. Allocations are placed first-fit from the bottom of that
//!   range at the device's alignment, so addresses are reused after a free, as on the real
//!   driver, and every run gives the same addresses.
//! - **Capacity.** Every allocation consumes its size rounded up to the alignment; `free` in
//!   [`Driver::mem_get_info`] is `total - consumed`. A request that does not fit fails with
//!   `CUDA_ERROR_OUT_OF_MEMORY`.
//! - **Real bytes.** Each allocation has zero-initialised backing bytes; copies move data.
//! - **Contract checking** with the real driver's codes: zero-byte allocations, unknown or
//!   interior pointers, double frees and out-of-range copies give `CUDA_ERROR_INVALID_VALUE`;
//!   a context whose reference count dropped to zero gives `CUDA_ERROR_INVALID_CONTEXT`.
//!   Releasing the last reference, or resetting the primary context, destroys its memory.
//! - **Observability.** Every call is appended to a log ([`SimDriver::calls`]) with its
//!   arguments and outcome; [`SimDriver::leak_report`] lists what is still allocated.
//! - **Scripted faults.** [`SimDriver::inject`] makes the Nth call of one operation (or of any
//!   operation) fail with a chosen error kind, once.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Mutex, MutexGuard};

use driver_sys::{
    ContextHandle, DeviceAttribute, DeviceOrdinal, DevicePtr, Driver, DriverError, ErrorKind,
    MemInfo, code,
};

/// The allocation alignment of the simulated devices unless configured otherwise.
pub const DEFAULT_ALIGNMENT: usize = 512;

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
    /// Allocation alignment in bytes (a power of two); also the unit capacity is consumed in.
    pub alignment: usize,
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

    /// Sets the allocation alignment (a power of two).
    #[must_use]
    pub fn alignment(mut self, alignment: usize) -> SimDeviceConfig {
        assert!(alignment.is_power_of_two(), "alignment must be a power of two, got {alignment}");
        self.alignment = alignment;
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
        SimConfig { devices: vec![SimDeviceConfig::new(total_mem)] }
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
        Fault { op: Some(op), nth, kind }
    }

    /// The `nth` driver call of any operation fails with `kind`.
    pub fn nth_call(nth: u64, kind: ErrorKind) -> Fault {
        Fault { op: None, nth, kind }
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
    consumed: usize,
    bytes: Vec<u8>,
}

#[derive(Debug)]
struct SimDevice {
    config: SimDeviceConfig,
    ctx_refcount: u32,
    allocs: BTreeMap<u64, SimAlloc>,
    consumed: usize,
}

impl SimDevice {
    fn base(ordinal: usize) -> u64 {
        DEVICE_SPACE_BASE + ordinal as u64 * DEVICE_SPACE_STRIDE
    }

    /// The lowest aligned address in this device's range where `consumed` bytes fit.
    fn first_fit(&self, ordinal: usize, consumed: usize) -> u64 {
        let mut cursor = Self::base(ordinal);
        for (&start, alloc) in &self.allocs {
            if start - cursor >= consumed as u64 {
                break;
            }
            cursor = start + alloc.consumed as u64;
        }
        cursor
    }

    /// The allocation containing `addr`, as (base, allocation).
    fn containing(&self, addr: u64) -> Option<(u64, &SimAlloc)> {
        let (&base, alloc) = self.allocs.range(..=addr).next_back()?;
        (addr < base + alloc.size.max(1) as u64).then_some((base, alloc))
    }

    fn destroy_memory(&mut self) -> usize {
        let n = self.allocs.len();
        self.allocs.clear();
        self.consumed = 0;
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

/// A deterministic simulated CUDA system. See the [module docs](self) for the model.
///
/// Shareable across threads (`Arc<SimDriver>` coerces to `Arc<dyn Driver>`); one lock guards
/// the whole state, so the call log has one total order.
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
                SimDevice { config: c, ctx_refcount: 0, allocs: BTreeMap::new(), consumed: 0 }
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
            .map(|d| d.allocs.iter().map(|(&a, s)| (DevicePtr(a), s.size)).collect())
            .unwrap_or_default()
    }

    /// The primary context's reference count on `dev`.
    pub fn context_refcount(&self, dev: DeviceOrdinal) -> u32 {
        self.lock().devices.get(dev.0 as usize).map_or(0, |d| d.ctx_refcount)
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
        let outcome = result.as_ref().map(|_| ()).map_err(|&c| ErrorKind::from_code(c));
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
            if faulted.is_some() { e.with_detail("injected by SimDriver") } else { e }
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

    fn device<'s>(st: &'s mut SimState, dev: DeviceOrdinal) -> Result<&'s mut SimDevice, u32> {
        st.devices.get_mut(dev.0 as usize).ok_or(code::INVALID_DEVICE)
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
        if d.ctx_refcount == 0 {
            return Err(code::INVALID_CONTEXT);
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
            Ok(ContextHandle(CONTEXT_HANDLE_BASE + u64::from(dev.0) * 0x100))
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
                let n = d.destroy_memory();
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
            Self::device(st, dev)?.destroy_memory();
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
            let align = d.config.alignment;
            let consumed = bytes.checked_next_multiple_of(align).ok_or(code::OUT_OF_MEMORY)?;
            if consumed > d.config.total_mem - d.consumed {
                return Err(code::OUT_OF_MEMORY);
            }
            let addr = d.first_fit(index, consumed);
            let mut backing = Vec::new();
            backing.try_reserve_exact(bytes).map_err(|_| code::OUT_OF_MEMORY)?;
            backing.resize(bytes, 0);
            d.allocs.insert(addr, SimAlloc { size: bytes, consumed, bytes: backing });
            d.consumed += consumed;
            note.ptr = Some(DevicePtr(addr));
            Ok(DevicePtr(addr))
        })
    }

    unsafe fn mem_free(&self, ctx: ContextHandle, ptr: DevicePtr) -> Result<(), DriverError> {
        self.call(Op::MemFree, |st, note| {
            note.ptr = Some(ptr);
            let (_, d) = Self::context(st, ctx, note)?;
            let alloc = d.allocs.remove(&ptr.0).ok_or(code::INVALID_VALUE)?;
            note.bytes = Some(alloc.size);
            d.consumed -= alloc.consumed;
            Ok(())
        })
    }

    fn mem_get_info(&self, ctx: ContextHandle) -> Result<MemInfo, DriverError> {
        self.call(Op::MemGetInfo, |st, note| {
            let (_, d) = Self::context(st, ctx, note)?;
            Ok(MemInfo { free: d.config.total_mem - d.consumed, total: d.config.total_mem })
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
            let alloc = d.allocs.get_mut(&base).expect("range() found this allocation");
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
