//! The simulated machine's configuration ([`SimConfig`], [`SimDeviceConfig`]) and the layout
//! of its address space.

/// The granularity of allocations of up to [`SMALL_MAX`] bytes (measured: 512 bytes).
pub const DEFAULT_ALIGNMENT: usize = 512;

/// The unit device memory is handed out and accounted in (measured: 2 MiB).
pub const PAGE_SIZE: usize = 2 << 20;

/// Allocations up to this size share pages; larger ones get pages of their own.
pub const SMALL_MAX: usize = 1 << 20;

pub(super) const DEVICE_SPACE_BASE: u64 = 0x7000_0000_0000;

pub(super) const DEVICE_SPACE_STRIDE: u64 = 1 << 40;

/// IPC mappings of a device live in the upper half of its range.
pub(super) const IPC_SPACE_OFFSET: u64 = 1 << 39;

/// The device's stream-ordered pools place their blocks in the quarter of its range below the
/// IPC mappings; its own pages lie below that, so a device has at most this many bytes.
pub(super) const POOL_SPACE_OFFSET: u64 = 1 << 38;

/// The length of the pools' space.
pub(super) const POOL_SPACE_LEN: u64 = IPC_SPACE_OFFSET - POOL_SPACE_OFFSET;

pub(super) const CONTEXT_HANDLE_BASE: u64 = 0x5c00_0000_0000;

pub(super) const HANDLE_BASE: u64 = 0x5d00_0000_0000;

/// One simulated device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimDeviceConfig {
    /// Device memory in bytes, as `cuDeviceTotalMem` and `cuMemGetInfo` report it.
    pub total_mem: usize,
    /// `CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY`.
    pub can_map_host_memory: bool,
    /// `CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY` (and `CONCURRENT_MANAGED_ACCESS`): whether
    /// `cuMemAllocManaged` works on the device.
    pub managed_memory: bool,
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
    /// `CU_DEVICE_ATTRIBUTE_HOST_MEMORY_POOLS_SUPPORTED` (and `HOST_NUMA_MEMORY_POOLS_SUPPORTED`):
    /// whether pools can be made in host memory.
    pub host_memory_pools: bool,
    /// `CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID`: the host NUMA node nearest the device.
    pub host_numa_id: i32,
    /// `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`: whether the virtual memory
    /// calls (`cuMemAddressReserve`, `cuMemCreate`, `cuMemMap`) work on the device.
    pub vmm: bool,
    /// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED` (where `vmm` is on):
    /// whether physical memory can be made shareable as a POSIX file descriptor.
    pub posix_fd_handles: bool,
}

impl SimDeviceConfig {
    /// A device with `total_mem` bytes that can map host memory, at the default alignment.
    pub fn new(total_mem: usize) -> SimDeviceConfig {
        SimDeviceConfig {
            total_mem,
            can_map_host_memory: true,
            managed_memory: true,
            alignment: DEFAULT_ALIGNMENT,
            context_overhead: 0,
            pci_domain_id: 0,
            pci_bus_id: 0,
            pci_device_id: 0,
            host_memory_pools: true,
            host_numa_id: 0,
            vmm: true,
            posix_fd_handles: true,
        }
    }

    /// Sets whether pools can be made in host memory (a driver before CUDA 12.6 cannot).
    #[must_use]
    pub fn host_memory_pools(mut self, yes: bool) -> SimDeviceConfig {
        self.host_memory_pools = yes;
        self
    }

    /// Sets whether the device takes virtual memory management (a driver or device without
    /// it refuses the calls with `CUDA_ERROR_NOT_SUPPORTED`).
    #[must_use]
    pub fn vmm(mut self, yes: bool) -> SimDeviceConfig {
        self.vmm = yes;
        self
    }

    /// Sets whether physical memory can be made shareable as a POSIX file descriptor (a
    /// driver without it refuses `cuMemCreate` with that handle type with
    /// `CUDA_ERROR_NOT_SUPPORTED`).
    #[must_use]
    pub fn posix_fd_handles(mut self, yes: bool) -> SimDeviceConfig {
        self.posix_fd_handles = yes;
        self
    }

    /// Sets whether the device can map host memory.
    #[must_use]
    pub fn can_map_host_memory(mut self, yes: bool) -> SimDeviceConfig {
        self.can_map_host_memory = yes;
        self
    }

    /// Sets whether the device supports managed memory.
    #[must_use]
    pub fn managed_memory(mut self, yes: bool) -> SimDeviceConfig {
        self.managed_memory = yes;
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
