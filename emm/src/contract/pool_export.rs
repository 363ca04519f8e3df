//! IPC of stream-ordered pools as the contract speaks it: [`PoolId`] and [`PoolExport`] (a
//! pool's file descriptor and what names it). Sending it is `crate::ipc::transfer`'s work.
//!
//! # How memory of an IPC-enabled pool crosses processes
//!
//! The driver shares such memory in two steps, and emm keeps them apart:
//!
//! 1. **The pool, once.** The exporter calls [`Context::export_pool`](crate::Context::export_pool)
//!    and sends the [`PoolExport`] (a file descriptor plus the pool's [`PoolId`] and device) to
//!    the other process with [`PoolExport::send`]; that process calls
//!    [`PoolExport::receive`] and [`Runtime::import_pool`](crate::Runtime::import_pool).
//! 2. **Each allocation.** [`Context::get_ipc_handle`](crate::Context::get_ipc_handle) gives an
//!    [`IpcHandle`](crate::IpcHandle) whose bytes name the pool by its id and carry the
//!    driver's export data; they travel like any handle's bytes, and open like any handle
//!    (directly, or staged through the source device).
//!
//! The driver's rule, which emm's handles follow: an importing process frees (closes) its
//! imported pointer before the exporter frees the allocation. The exporter's handle keeps the
//! allocation alive; drop it only once the other processes have closed theirs.

use std::fmt;
#[cfg(unix)]
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
// For `PoolId::fresh`'s static counter: loom's atomics cannot be statics.
use std::sync::atomic::{AtomicU64, Ordering};

use crate::contract::ipc::DeviceIdentity;
#[cfg(unix)]
use crate::error::EmmError;

/// The name of an IPC-enabled stream-ordered pool across processes: chosen by the exporting
/// manager when it creates the pool (a new one after every reset), carried in the bytes of each
/// [`IpcHandle`](crate::IpcHandle) of the pool's memory and in the pool's [`PoolExport`].
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PoolId(pub [u8; 16]);

impl PoolId {
    /// A new id: this process's id, a per-process counter and the time, so ids of different
    /// processes and of successive pools of one process differ.
    pub(crate) fn fresh() -> PoolId {
        // A static, so std's atomic (loom's cannot be one); it orders nothing else.
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let count = NEXT.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let mut b = [0u8; 16];
        b[..4].copy_from_slice(&std::process::id().to_le_bytes());
        b[4..8].copy_from_slice(&(count as u32).to_le_bytes());
        b[8..].copy_from_slice(&nanos.to_le_bytes());
        PoolId(b)
    }
}

impl fmt::Display for PoolId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for PoolId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PoolId({self})")
    }
}

/// An exported stream-ordered pool, ready to go to another process: the driver's file
/// descriptor for it (`cuMemPoolExportToShareableHandle`), the pool's [`PoolId`] and the
/// exporting device. Get one from [`Context::export_pool`](crate::Context::export_pool).
///
/// A file descriptor does not travel as bytes: send the export with [`send`](Self::send) over
/// a connected Unix stream socket (the descriptor goes as `SCM_RIGHTS`), or pass the
/// descriptor some other way (inherited by a child, `pidfd_getfd`) together with
/// [`descriptor`](Self::descriptor)'s bytes and rebuild it with
/// [`from_descriptor`](Self::from_descriptor). Dropping an export closes the descriptor; the
/// pool is unaffected.
///
/// Pools travel as POSIX file descriptors: off Unix there is no way to make one, and
/// [`Context::export_pool`](crate::Context::export_pool) refuses.
pub struct PoolExport {
    id: PoolId,
    source: DeviceIdentity,
    #[cfg(unix)]
    fd: OwnedFd,
}

const EXPORT_MAGIC: &[u8; 7] = b"EMMPOOL";
const EXPORT_VERSION: u16 = 1;
/// Length of [`PoolExport::descriptor`]: magic, version, id, three PCI ids.
pub const POOL_DESCRIPTOR_LEN: usize = 7 + 2 + 16 + 12;

impl PoolExport {
    #[cfg(unix)]
    pub(crate) fn new(id: PoolId, source: DeviceIdentity, fd: OwnedFd) -> PoolExport {
        PoolExport { id, source, fd }
    }

    /// The pool's id.
    pub fn id(&self) -> PoolId {
        self.id
    }

    /// The exporting device.
    pub fn source(&self) -> DeviceIdentity {
        self.source
    }

    /// The driver's file descriptor for the pool.
    #[cfg(unix)]
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// What names the pool, as bytes (the descriptor itself is not part of them).
    pub fn descriptor(&self) -> [u8; POOL_DESCRIPTOR_LEN] {
        let mut b = [0u8; POOL_DESCRIPTOR_LEN];
        b[..7].copy_from_slice(EXPORT_MAGIC);
        b[7..9].copy_from_slice(&EXPORT_VERSION.to_le_bytes());
        b[9..25].copy_from_slice(&self.id.0);
        let s = self.source;
        for (i, v) in [s.pci_domain_id, s.pci_bus_id, s.pci_device_id]
            .into_iter()
            .enumerate()
        {
            b[25 + 4 * i..29 + 4 * i].copy_from_slice(&v.to_le_bytes());
        }
        b
    }

    /// Rebuilds an export from [`descriptor`](Self::descriptor)'s bytes and the file
    /// descriptor that came with them (passed by other means than [`send`](Self::send)).
    #[cfg(unix)]
    pub fn from_descriptor(bytes: &[u8], fd: OwnedFd) -> Result<PoolExport, EmmError> {
        let bad = |reason: String| EmmError::InvalidArgument {
            what: "pool export descriptor",
            reason,
        };
        check_header(bytes, EXPORT_MAGIC, EXPORT_VERSION, "PoolExport").map_err(bad)?;
        if bytes.len() != POOL_DESCRIPTOR_LEN {
            return Err(bad(format!(
                "{} bytes instead of {POOL_DESCRIPTOR_LEN}",
                bytes.len()
            )));
        }
        let i32_at = |i: usize| i32::from_le_bytes(bytes[i..i + 4].try_into().expect("4 bytes"));
        Ok(PoolExport {
            id: PoolId(bytes[9..25].try_into().expect("16 bytes")),
            source: DeviceIdentity {
                pci_domain_id: i32_at(25),
                pci_bus_id: i32_at(29),
                pci_device_id: i32_at(33),
            },
            fd,
        })
    }
}

/// Checks that `bytes` start with an export descriptor's `magic` and this emm's `version` of
/// the format, where `kind` names the export's type; the reason they do not, as the error.
#[cfg(unix)]
pub(crate) fn check_header(
    bytes: &[u8],
    magic: &[u8; 7],
    version: u16,
    kind: &str,
) -> Result<(), String> {
    if bytes.len() < 9 || &bytes[..7] != magic {
        return Err(format!(
            "the bytes do not start with the marker of an emm {kind}; pass the bytes \
             {kind}::descriptor produced"
        ));
    }
    let got = u16::from_le_bytes([bytes[7], bytes[8]]);
    if got != version {
        return Err(format!(
            "format version {got}, and this emm reads version {version}; export and import \
             with the same emm release"
        ));
    }
    Ok(())
}

impl PoolExport {
    /// The descriptor's number, for `Debug` (none off Unix).
    fn fd_number(&self) -> Option<i32> {
        #[cfg(unix)]
        return Some(self.fd.as_raw_fd());
        #[cfg(not(unix))]
        return None;
    }
}

impl fmt::Debug for PoolExport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolExport")
            .field("id", &self.id)
            .field("source", &self.source)
            .field("fd", &self.fd_number())
            .finish()
    }
}
