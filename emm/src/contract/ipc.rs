//! IPC as the contract speaks it: [`IpcHandle`] (what `get_ipc_handle` returns: what it names,
//! its bytes, whether it is open), [`IpcMemory`] (what a handle names), and the
//! [`DeviceIdentity`] that names the exporting device. Opening a handle is the IPC layer's
//! work (`crate::ipc`); the handle only keeps what an open left to undo.

use std::fmt;
use std::sync::Arc;

use driver_sys::{DeviceAttribute, DeviceOrdinal, Driver, IpcMemHandle, PoolPtrExportData};

use crate::contract::pool_export::PoolId;
use crate::error::EmmError;
use crate::memory::pointer::MemoryPointer;
use crate::sync::{AtomicBool, Mutex, Ordering, lock};

/// A device's PCI identity (Numba's `get_device_identity()`), which names the exporting device
/// across processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DeviceIdentity {
    /// `CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID`.
    pub pci_domain_id: i32,
    /// `CU_DEVICE_ATTRIBUTE_PCI_BUS_ID`.
    pub pci_bus_id: i32,
    /// `CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID`.
    pub pci_device_id: i32,
}

impl fmt::Display for DeviceIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{{'pci_domain_id': {}, 'pci_bus_id': {}, 'pci_device_id': {}}}",
            self.pci_domain_id, self.pci_bus_id, self.pci_device_id
        )
    }
}

/// The PCI identity of `device` (Numba's `get_device_identity`).
pub(crate) fn identity_of(
    driver: &dyn Driver,
    device: DeviceOrdinal,
) -> Result<DeviceIdentity, EmmError> {
    let attr = |a| {
        driver
            .device_attribute(device, a)
            .map_err(|e| EmmError::driver("device identity", device, e))
    };
    Ok(DeviceIdentity {
        pci_domain_id: attr(DeviceAttribute::PciDomainId)?,
        pci_bus_id: attr(DeviceAttribute::PciBusId)?,
        pci_device_id: attr(DeviceAttribute::PciDeviceId)?,
    })
}

/// What an [`IpcHandle`] names: an allocation exported with `cuIpcGetMemHandle`, or an
/// allocation of an IPC-enabled stream-ordered pool (the `async-pool-ipc` manager).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IpcMemory {
    /// `cuIpcGetMemHandle`'s 64 bytes; they name the whole allocation.
    Allocation(IpcMemHandle),
    /// An allocation of pool `pool`: `cuMemPoolExportPointer`'s 64 bytes. The process that
    /// opens it must have imported the pool first
    /// ([`Runtime::import_pool`](crate::Runtime::import_pool)).
    PoolAllocation {
        /// The pool, as its exporter named it.
        pool: PoolId,
        /// The driver's export data of the allocation.
        data: PoolPtrExportData,
    },
}

impl From<IpcMemHandle> for IpcMemory {
    fn from(h: IpcMemHandle) -> IpcMemory {
        IpcMemory::Allocation(h)
    }
}

/// How an opened direct mapping is undone (the IPC layer's business: a `cuIpcOpenMemHandle`
/// mapping, or a pointer imported through a pool). The handle only keeps it until `close`.
pub(crate) trait IpcMapping: Send {
    /// Unmaps (or frees the imported pointer).
    fn close(&self) -> Result<(), EmmError>;
}

/// What an open handle holds.
pub(crate) enum Opened {
    /// Mapped for use in a context; `open` turns false at the close.
    Direct {
        mapping: Box<dyn IpcMapping>,
        open: Arc<AtomicBool>,
    },
    /// Copied into memory of the destination's manager; nothing to close.
    Staged,
}

/// An exportable handle to device memory (Numba's `IpcHandle`).
///
/// # Life of a handle
///
/// 1. The exporting process calls [`Context::get_ipc_handle`](crate::Context::get_ipc_handle)
///    on some memory (a view is fine). The handle keeps that memory alive, and knows it is the
///    exporter's: opening it there is an error, as in Numba.
/// 2. [`IpcHandle::to_bytes`] gives bytes to send to another process (over a socket, a pipe, a
///    file); [`IpcHandle::from_bytes`] rebuilds the handle there, without the memory.
/// 3. [`IpcHandle::open`] maps the memory into a context: **directly** when the context's
///    device is the exporting device or a peer of it, otherwise **staged**: the handle is
///    opened on the exporting device, the bytes are copied into new memory allocated through
///    the destination context's own manager, and the mapping is closed again. The staged copy
///    belongs to that manager, not to the handle (NBEP 7: staged IPC takes no ownership).
/// 4. [`IpcHandle::close`] unmaps a direct open; pointers into the mapping become stale. A
///    staged copy lives on as ordinary memory. A handle dropped while open is closed then.
pub struct IpcHandle {
    memory: IpcMemory,
    size: usize,
    offset: usize,
    source: Option<DeviceIdentity>,
    /// In the exporting process: the exported memory, kept alive.
    base: Option<MemoryPointer>,
    pub(crate) opened: Mutex<Option<Opened>>,
}

/// `to_bytes` format: magic, version, kind (0: `cuIpcGetMemHandle`, 1: pool allocation), the
/// driver's 64 bytes, the pool id (zeros for kind 0), size, offset, whether the source is
/// known, and the source's three PCI ids; little-endian.
const MAGIC: &[u8; 6] = b"EMMIPC";
const FORMAT_VERSION: u16 = 2;
const ENCODED_LEN: usize = 6 + 2 + 1 + 64 + 16 + 8 + 8 + 1 + 12;

impl IpcHandle {
    pub(crate) fn exported(
        base: MemoryPointer,
        memory: IpcMemory,
        size: usize,
        offset: usize,
        source: DeviceIdentity,
    ) -> IpcHandle {
        IpcHandle {
            memory,
            size,
            offset,
            source: Some(source),
            base: Some(base),
            opened: Mutex::new(None),
        }
    }

    /// A handle from its parts, as another process receives them; without a source it always
    /// opens directly (Numba's `open_ipc_array`).
    pub fn new(
        memory: impl Into<IpcMemory>,
        size: usize,
        offset: usize,
        source: Option<DeviceIdentity>,
    ) -> IpcHandle {
        IpcHandle {
            memory: memory.into(),
            size,
            offset,
            source,
            base: None,
            opened: Mutex::new(None),
        }
    }

    /// What the handle names: the driver's bytes for the whole allocation.
    pub fn handle(&self) -> &IpcMemory {
        &self.memory
    }

    /// Bytes of the exported range.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Offset of the exported range from the allocation's base.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The exporting device, if known.
    pub fn source(&self) -> Option<DeviceIdentity> {
        self.source
    }

    /// Whether this is the exporting process's handle (it holds the memory).
    pub fn is_exporter(&self) -> bool {
        self.base.is_some()
    }

    /// Whether the handle is open.
    pub fn is_open(&self) -> bool {
        lock(&self.opened).is_some()
    }

    /// The handle as bytes for another process (the exported memory is not part of them).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(ENCODED_LEN);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        match &self.memory {
            IpcMemory::Allocation(h) => {
                out.push(0);
                out.extend_from_slice(&h.0);
                out.extend_from_slice(&[0; 16]);
            }
            IpcMemory::PoolAllocation { pool, data } => {
                out.push(1);
                out.extend_from_slice(&data.0);
                out.extend_from_slice(&pool.0);
            }
        }
        out.extend_from_slice(&(self.size as u64).to_le_bytes());
        out.extend_from_slice(&(self.offset as u64).to_le_bytes());
        let id = self.source.unwrap_or(DeviceIdentity {
            pci_domain_id: 0,
            pci_bus_id: 0,
            pci_device_id: 0,
        });
        out.push(u8::from(self.source.is_some()));
        for v in [id.pci_domain_id, id.pci_bus_id, id.pci_device_id] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out
    }

    /// Rebuilds a handle from [`to_bytes`](Self::to_bytes)'s output. Truncated, garbled or
    /// foreign bytes, and bytes of another format version, are an error that says which.
    pub fn from_bytes(bytes: &[u8]) -> Result<IpcHandle, EmmError> {
        let bad = |reason: String| EmmError::InvalidIpcHandle { reason };
        if bytes.len() < MAGIC.len() + 2 || &bytes[..MAGIC.len()] != MAGIC {
            return Err(bad(
                "they do not start with an emm IPC handle's marker".into()
            ));
        }
        let version = u16::from_le_bytes([bytes[6], bytes[7]]);
        if version != FORMAT_VERSION {
            return Err(bad(format!(
                "they are of handle format version {version}, and this emm reads version {FORMAT_VERSION} (export and import with the same emm release)"
            )));
        }
        if bytes.len() != ENCODED_LEN {
            return Err(bad(format!(
                "{} bytes instead of {ENCODED_LEN}",
                bytes.len()
            )));
        }
        let u64_at = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
        let i32_at = |i: usize| i32::from_le_bytes(bytes[i..i + 4].try_into().expect("4 bytes"));
        let driver_bytes: [u8; 64] = bytes[9..73].try_into().expect("64 bytes");
        let pool: [u8; 16] = bytes[73..89].try_into().expect("16 bytes");
        let memory = match bytes[8] {
            0 if pool == [0; 16] => IpcMemory::Allocation(IpcMemHandle(driver_bytes)),
            0 => {
                return Err(bad(
                    "a pool id is present in a cuIpcGetMemHandle handle".into()
                ));
            }
            1 => IpcMemory::PoolAllocation {
                pool: PoolId(pool),
                data: PoolPtrExportData(driver_bytes),
            },
            other => return Err(bad(format!("handle kind {other} is neither 0 nor 1"))),
        };
        let (size, offset) = (u64_at(89), u64_at(97));
        let (Ok(size), Ok(offset)) = (usize::try_from(size), usize::try_from(offset)) else {
            return Err(bad(
                "size or offset does not fit this machine's address space".into(),
            ));
        };
        if offset.checked_add(size).is_none() {
            return Err(bad(format!("offset {offset} plus size {size} overflows")));
        }
        let source = match bytes[105] {
            0 if bytes[106..].iter().all(|&b| b == 0) => None,
            0 => return Err(bad("a source identity is present but marked absent".into())),
            1 => Some(DeviceIdentity {
                pci_domain_id: i32_at(106),
                pci_bus_id: i32_at(110),
                pci_device_id: i32_at(114),
            }),
            other => return Err(bad(format!("source marker {other} is neither 0 nor 1"))),
        };
        Ok(IpcHandle::new(memory, size, offset, source))
    }

    /// Closes the handle (Numba's `close`): a direct mapping is unmapped and pointers into it
    /// become stale; a staged copy stays.
    pub fn close(&self) -> Result<(), EmmError> {
        let mut opened = lock(&self.opened);
        match opened.take() {
            None => Err(EmmError::Ipc {
                message: "IpcHandle not opened",
                advice: "open it before closing it",
            }),
            Some(Opened::Staged) => Ok(()),
            Some(Opened::Direct { mapping, open }) => {
                open.store(false, Ordering::Release);
                mapping.close()
            }
        }
    }
}

impl Drop for IpcHandle {
    fn drop(&mut self) {
        if self.is_open()
            && let Err(e) = self.close()
        {
            tracing::error!(error = %e, "closing an IPC handle dropped while open");
        }
    }
}

impl fmt::Debug for IpcHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IpcHandle")
            .field("memory", &self.memory)
            .field("size", &self.size)
            .field("offset", &self.offset)
            .field("source", &self.source)
            .field("exporter", &self.is_exporter())
            .field("open", &self.is_open())
            .finish()
    }
}
