//! IPC handle data: [`IpcHandle`] and the [`DeviceIdentity`] of the exporting device.

/// A device's PCI identity (Numba's `get_device_identity()`), which names the exporting device
/// in an [`IpcHandle`] across processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DeviceIdentity {
    /// `CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID`.
    pub pci_domain_id: i32,
    /// `CU_DEVICE_ATTRIBUTE_PCI_BUS_ID`.
    pub pci_bus_id: i32,
    /// `CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID`.
    pub pci_device_id: i32,
}

/// An exportable handle to device memory (Numba's `IpcHandle`): the driver's 64-byte handle of
/// the whole allocation, the size of the exported range, its offset from the allocation's
/// base, and the exporting device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IpcHandle {
    handle: [u8; 64],
    size: usize,
    offset: usize,
    source: DeviceIdentity,
}

impl IpcHandle {
    /// A handle for `size` bytes at `offset` from the base of the allocation `handle` names.
    pub fn new(handle: [u8; 64], size: usize, offset: usize, source: DeviceIdentity) -> IpcHandle {
        IpcHandle {
            handle,
            size,
            offset,
            source,
        }
    }

    /// The driver's 64 bytes.
    pub fn handle_bytes(&self) -> &[u8; 64] {
        &self.handle
    }

    /// Bytes of the exported range.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Offset of the exported range from the allocation's base.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The exporting device.
    pub fn source(&self) -> DeviceIdentity {
        self.source
    }
}
