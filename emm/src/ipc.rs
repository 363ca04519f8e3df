//! IPC: [`IpcHandle`], [`IpcMemory`] (what a handle names), and the [`DeviceIdentity`] that
//! names the exporting device.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use driver_sys::{
    DeviceAttribute, DeviceOrdinal, DevicePtr, Driver, IpcMemHandle, PoolPtrExportData,
};

use crate::context::Context;
use crate::pointer::Release;
use crate::pool_ipc::PoolId;
use crate::sync::{Mutex, lock};
use crate::{EmmError, MemoryPointer, Runtime};

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

/// A mapping opened for a handle, and how it is undone: a `cuIpcOpenMemHandle` mapping in
/// `ctx`, or a pointer imported through pool `pool` (whose context `ctx` is).
struct Mapping {
    ctx: Context,
    base: DevicePtr,
    pool: Option<PoolId>,
}

impl Mapping {
    fn close(&self) -> Result<(), EmmError> {
        match self.pool {
            None => self.ctx.ipc_close(self.base),
            Some(id) => self.ctx.inner.imports.free_pointer(id, self.base),
        }
    }
}

enum Opened {
    /// Mapped for use in a context; `open` turns false at the close.
    Direct {
        mapping: Mapping,
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
    opened: Mutex<Option<Opened>>,
}

/// `to_bytes` format: magic, version, kind (0: `cuIpcGetMemHandle`, 1: pool allocation), the
/// driver's 64 bytes, the pool id (zeros for kind 0), size, offset, whether the source is
/// known, and the source's three PCI ids; little-endian.
const MAGIC: &[u8; 6] = b"EMMIPC";
const FORMAT_VERSION: u16 = 2;
const ENCODED_LEN: usize = 6 + 2 + 1 + 64 + 16 + 8 + 8 + 1 + 12;

/// Bytes per host round trip when a staged open of pool memory goes through the host.
const STAGING_CHUNK: usize = 16 << 20;

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

    /// Opens the handle in `ctx`: directly when its device is the source or a peer of it (or
    /// the source is unknown), staged otherwise (Numba's `IpcHandle.open`).
    pub fn open(&self, runtime: &Runtime, ctx: &Context) -> Result<MemoryPointer, EmmError> {
        let direct = match self.source {
            None => true,
            Some(id) => {
                let src = runtime.device_with_identity(&id)?;
                src == ctx.device() || ctx.can_access_peer(src)?
            }
        };
        if direct {
            self.open_direct(ctx)
        } else {
            self.open_staged(runtime, ctx)
        }
    }

    fn check_openable(&self, opened: &Option<Opened>) -> Result<(), EmmError> {
        if self.base.is_some() {
            return Err(EmmError::Ipc {
                message: "opening IpcHandle from original process",
                advice: "open it in another process; here, use the exported memory itself",
            });
        }
        if opened.is_some() {
            return Err(EmmError::Ipc {
                message: "IpcHandle is already opened",
                advice: "close it (IpcHandle::close) before opening it again",
            });
        }
        Ok(())
    }

    /// Opens the mapping for use in `ctx` and checks that the exported range lies inside what
    /// was mapped: the offset and size travelled as bytes and may have been garbled or forged,
    /// and a view past the mapping would reach memory the exporter never shared.
    fn map_checked(&self, ctx: &Context) -> Result<Mapping, EmmError> {
        let mapping = match &self.memory {
            IpcMemory::Allocation(h) => Mapping {
                base: ctx.ipc_open(h)?,
                ctx: ctx.clone(),
                pool: None,
            },
            IpcMemory::PoolAllocation { pool, data } => {
                let (pool_ctx, base) =
                    ctx.inner
                        .imports
                        .import_pointer(*pool, data, ctx.device())?;
                Mapping {
                    ctx: pool_ctx,
                    base,
                    pool: Some(*pool),
                }
            }
        };
        let mapped = mapping.ctx.mapping_size(mapping.base);
        let fits = matches!(&mapped, Ok(n) if self.offset.checked_add(self.size).is_some_and(|end| end <= *n));
        if !fits {
            let closed = mapping.close();
            let mapped = mapped?;
            closed?;
            return Err(EmmError::InvalidIpcHandle {
                reason: format!(
                    "the handle claims {} bytes at offset {}, but the allocation it names has {mapped} bytes",
                    self.size, self.offset
                ),
            });
        }
        Ok(mapping)
    }

    /// Maps the memory into `ctx` and returns a pointer to the exported range (Numba's
    /// `open_direct`). The mapping covers `offset + size` bytes from the allocation's base.
    pub fn open_direct(&self, ctx: &Context) -> Result<MemoryPointer, EmmError> {
        let mut opened = lock(&self.opened);
        self.check_openable(&opened)?;
        let mapping = self.map_checked(ctx)?;
        let base = mapping.base;
        let open = Arc::new(AtomicBool::new(true));
        let whole = MemoryPointer::from_release(
            ctx.device(),
            ctx.handle(),
            base,
            self.offset + self.size,
            Release::Mapping {
                open: Arc::clone(&open),
            },
            None,
        );
        let view = whole.view(self.offset, None)?;
        tracing::debug!(device = %ctx.device(), %base, size = self.size, offset = self.offset, "IPC handle opened directly");
        *opened = Some(Opened::Direct { mapping, open });
        Ok(view)
    }

    /// Copies the memory into new memory of `ctx`'s manager by way of the source device
    /// (Numba's `open_staged`); the copy belongs to that manager. Use it to force the staged
    /// path between peers. Memory of an imported stream-ordered pool is copied through host
    /// memory (16 MiB at a time) when `ctx` is on another device: only devices the pool grants
    /// access reach it, and one that is not a peer cannot be granted.
    pub fn open_staged(&self, runtime: &Runtime, ctx: &Context) -> Result<MemoryPointer, EmmError> {
        let Some(source) = self.source else {
            return Err(EmmError::Ipc {
                message: "IPC handle doesn't have source info",
                advice: "a staged open needs the exporting device; send the handle with \
                         IpcHandle::to_bytes from the handle get_ipc_handle returned",
            });
        };
        let mut opened = lock(&self.opened);
        self.check_openable(&opened)?;
        let src_ctx = runtime.context(runtime.device_with_identity(&source)?)?;
        let mapping = self.map_checked(&src_ctx)?;
        let src = DevicePtr(mapping.base.0 + self.offset as u64);
        let copied = ctx.memalloc(self.size).and_then(|new| {
            if mapping.pool.is_some() && src_ctx.device() != ctx.device() {
                // Imported pool memory is reached only from devices its pool grants access,
                // and a device that is not a peer cannot be granted (measured on two H200s):
                // the bytes go through host memory.
                let mut chunk = vec![0u8; self.size.min(STAGING_CHUNK)];
                for start in (0..self.size).step_by(STAGING_CHUNK) {
                    let n = (self.size - start).min(STAGING_CHUNK);
                    src_ctx.read_mapping(&mut chunk[..n], DevicePtr(src.0 + start as u64))?;
                    ctx.copy_to_device(&new.view(start, Some(start + n))?, &chunk[..n])?;
                }
            } else {
                ctx.copy_device_to_device(new.device_ptr(), src, self.size, &new)?;
            }
            Ok(new)
        });
        let closed = mapping.close();
        let new = copied?;
        closed?;
        tracing::debug!(from = %src_ctx.device(), to = %ctx.device(), size = self.size, "IPC handle opened through staging");
        *opened = Some(Opened::Staged);
        Ok(new)
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
