//! IPC of `vmm-pool`'s memory as the contract speaks it: [`MappedExport`], one allocation's
//! physical memory as POSIX file descriptors and what places them. Sending it is
//! `crate::ipc::transfer`'s work, opening it `crate::ipc::mapped`'s.
//!
//! # How memory mapped into reserved addresses crosses processes
//!
//! `cuIpcGetMemHandle` does not export memory made by `cuMemCreate`, so such an allocation
//! cannot travel as an [`IpcHandle`](crate::IpcHandle)'s bytes. Its physical memory travels
//! instead, as file descriptors (`cuMemExportToShareableHandle`):
//!
//! 1. The exporter allocates the memory to share with
//!    [`Context::memalloc_shared`](crate::Context::memalloc_shared) (`vmm-pool`: physical
//!    memory of its own, which no other allocation shares), calls
//!    [`Context::export_mapped`](crate::Context::export_mapped) for it (or a view of it) and
//!    sends the [`MappedExport`] with [`MappedExport::send`] over a connected Unix stream
//!    socket. The export carries one descriptor per physical allocation, their sizes in order,
//!    and where the memory starts in the first.
//! 2. The other process calls [`MappedExport::receive`], which takes exports from processes
//!    of its own user only ([`MappedExport::receive_from`] names others), then
//!    [`Context::open_mapped`](crate::Context::open_mapped) in a context of the exporting
//!    device. That reserves addresses for the pieces, maps each in order and makes them
//!    accessible; the pointer it returns unmaps them when its last clone drops.
//!
//! Physical memory lives while any process maps it. The exporter's shared allocation is
//! unmapped and released at its free and never handed to another allocation, so an importer
//! that keeps its mapping longer still reads only what the allocation held, never another
//! allocation's data. `vmm-pool`'s own blocks are refused for export: their pieces hold other
//! allocations, and the pool reuses them.

use std::fmt;
#[cfg(unix)]
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use crate::contract::ipc::DeviceIdentity;
#[cfg(unix)]
use crate::contract::pool_export::check_header;
#[cfg(unix)]
use crate::error::EmmError;

const MAGIC: &[u8; 7] = b"EMMMAPD";
const VERSION: u16 = 1;
/// Bytes of [`MappedExport::descriptor`] before the pieces' sizes: magic, version, three PCI
/// ids, offset, size, piece count.
const HEADER_LEN: usize = 7 + 2 + 12 + 8 + 8 + 4;
/// The most pieces an export may have: a forged count must not make the importer wait for
/// descriptors without end. A block of `vmm-pool` lies across a handful of chunks.
#[cfg(unix)]
pub(crate) const MAX_PIECES: usize = 4096;
/// The longest descriptor an export has: its header and [`MAX_PIECES`] sizes.
#[cfg(unix)]
pub(crate) const MAX_DESCRIPTOR_LEN: usize = HEADER_LEN + 8 * MAX_PIECES;

/// One allocation of `vmm-pool`, exported for another process: a file descriptor per physical
/// allocation it lies across (`cuMemExportToShareableHandle`), their sizes, and where the
/// allocation lies in them. Get one from
/// [`Context::export_mapped`](crate::Context::export_mapped); open it in the other process with
/// [`Context::open_mapped`](crate::Context::open_mapped).
///
/// File descriptors do not travel as bytes: send the export with [`send`](Self::send) over a
/// connected Unix stream socket, or pass the descriptors some other way together with
/// [`descriptor`](Self::descriptor)'s bytes and rebuild it with
/// [`from_descriptor`](Self::from_descriptor). Dropping an export closes its descriptors; the
/// memory is unaffected.
pub struct MappedExport {
    source: DeviceIdentity,
    offset: usize,
    size: usize,
    pieces: Vec<usize>,
    #[cfg(unix)]
    fds: Vec<OwnedFd>,
}

impl MappedExport {
    /// An export of `size` bytes at `offset` into the span of `pieces` (one descriptor each).
    #[cfg(unix)]
    pub(crate) fn new(
        source: DeviceIdentity,
        offset: usize,
        size: usize,
        pieces: Vec<(usize, OwnedFd)>,
    ) -> MappedExport {
        let (pieces, fds) = pieces.into_iter().unzip();
        MappedExport {
            source,
            offset,
            size,
            pieces,
            fds,
        }
    }

    /// The exporting device.
    pub fn source(&self) -> DeviceIdentity {
        self.source
    }

    /// The allocation's distance from the start of its first piece.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The allocation's size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The sizes of the physical allocations the memory lies across, in address order.
    pub fn pieces(&self) -> &[usize] {
        &self.pieces
    }

    /// The pieces' file descriptors, in the order of [`pieces`](Self::pieces).
    #[cfg(unix)]
    pub fn fds(&self) -> impl ExactSizeIterator<Item = BorrowedFd<'_>> {
        self.fds.iter().map(|fd| fd.as_fd())
    }

    /// Takes the pieces apart: their sizes beside their descriptors, in address order.
    #[cfg(unix)]
    pub(crate) fn into_pieces(self) -> Vec<(usize, OwnedFd)> {
        self.pieces.into_iter().zip(self.fds).collect()
    }

    /// What places the memory, as bytes (the descriptors themselves are not part of them).
    pub fn descriptor(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(HEADER_LEN + 8 * self.pieces.len());
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        let s = self.source;
        for v in [s.pci_domain_id, s.pci_bus_id, s.pci_device_id] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(&(self.offset as u64).to_le_bytes());
        b.extend_from_slice(&(self.size as u64).to_le_bytes());
        b.extend_from_slice(&(self.pieces.len() as u32).to_le_bytes());
        for &p in &self.pieces {
            b.extend_from_slice(&(p as u64).to_le_bytes());
        }
        b
    }

    /// Reads [`descriptor`](Self::descriptor)'s bytes: the source, offset, size and the
    /// pieces' sizes, checked to be consistent (the memory lies inside the pieces).
    #[cfg(unix)]
    pub(crate) fn parse_descriptor(
        bytes: &[u8],
    ) -> Result<(DeviceIdentity, usize, usize, Vec<usize>), EmmError> {
        let bad = |reason: String| EmmError::InvalidArgument {
            what: "mapped export descriptor",
            reason,
        };
        check_header(bytes, MAGIC, VERSION, "MappedExport").map_err(bad)?;
        if bytes.len() < HEADER_LEN {
            return Err(bad(format!(
                "{} bytes, shorter than the {HEADER_LEN} of its header",
                bytes.len()
            )));
        }
        let i32_at = |i: usize| i32::from_le_bytes(bytes[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
        let source = DeviceIdentity {
            pci_domain_id: i32_at(9),
            pci_bus_id: i32_at(13),
            pci_device_id: i32_at(17),
        };
        let (offset, size) = (u64_at(21) as usize, u64_at(29) as usize);
        let count = u32::from_le_bytes(bytes[37..41].try_into().expect("4 bytes")) as usize;
        if count == 0 || count > MAX_PIECES {
            return Err(bad(format!(
                "{count} pieces; an export has between 1 and {MAX_PIECES}"
            )));
        }
        if bytes.len() != HEADER_LEN + 8 * count {
            return Err(bad(format!(
                "{} bytes for {count} pieces, which take {}",
                bytes.len(),
                HEADER_LEN + 8 * count
            )));
        }
        let pieces: Vec<usize> = (0..count)
            .map(|k| u64_at(HEADER_LEN + 8 * k) as usize)
            .collect();
        let span = pieces
            .iter()
            .try_fold(0usize, |sum, &p| sum.checked_add(p).filter(|_| p > 0));
        let fits = span.is_some_and(|span| offset.checked_add(size).is_some_and(|e| e <= span));
        if size == 0 || !fits {
            return Err(bad(format!(
                "{size} bytes at offset {offset} do not lie inside pieces of {pieces:?} bytes"
            )));
        }
        Ok((source, offset, size, pieces))
    }

    /// Rebuilds an export from [`descriptor`](Self::descriptor)'s bytes and the file
    /// descriptors that came with them, in the order of the pieces.
    #[cfg(unix)]
    pub fn from_descriptor(bytes: &[u8], fds: Vec<OwnedFd>) -> Result<MappedExport, EmmError> {
        let (source, offset, size, pieces) = Self::parse_descriptor(bytes)?;
        if fds.len() != pieces.len() {
            return Err(EmmError::InvalidArgument {
                what: "mapped export descriptor",
                reason: format!(
                    "{} file descriptors for {} pieces; pass one per piece, in order",
                    fds.len(),
                    pieces.len()
                ),
            });
        }
        Ok(MappedExport {
            source,
            offset,
            size,
            pieces,
            fds,
        })
    }

    /// The descriptors' numbers, for `Debug` (none off Unix).
    fn fd_numbers(&self) -> Vec<i32> {
        #[cfg(unix)]
        return self.fds.iter().map(|fd| fd.as_raw_fd()).collect();
        #[cfg(not(unix))]
        return Vec::new();
    }
}

impl fmt::Debug for MappedExport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MappedExport")
            .field("source", &self.source)
            .field("offset", &self.offset)
            .field("size", &self.size)
            .field("pieces", &self.pieces)
            .field("fds", &self.fd_numbers())
            .finish()
    }
}

#[cfg(all(test, unix, not(emm_loom)))]
mod tests {
    use super::*;

    fn export(pieces: &[usize], offset: usize, size: usize) -> MappedExport {
        let fds = pieces
            .iter()
            .map(|&p| (p, std::fs::File::open("/dev/null").unwrap().into()))
            .collect();
        let source = DeviceIdentity {
            pci_domain_id: 1,
            pci_bus_id: -2,
            pci_device_id: 3,
        };
        MappedExport::new(source, offset, size, fds)
    }

    #[test]
    fn a_descriptor_reads_back_as_it_was_written() {
        let e = export(&[2 << 20, 4 << 20], 1 << 20, 3 << 20);
        let b = e.descriptor();
        let fds = e.into_pieces().into_iter().map(|(_, fd)| fd).collect();
        let back = MappedExport::from_descriptor(&b, fds).unwrap();
        assert_eq!(back.pieces(), &[2 << 20, 4 << 20]);
        assert_eq!((back.offset(), back.size()), (1 << 20, 3 << 20));
        assert_eq!(back.source().pci_bus_id, -2);
        assert_eq!(back.descriptor(), b);
    }

    #[test]
    fn a_descriptor_whose_memory_leaves_its_pieces_is_refused() {
        let mut b = export(&[2 << 20], 0, 1 << 20).descriptor();
        // The size field, now 3 MiB in a piece of 2 MiB.
        b[29..37].copy_from_slice(&(3u64 << 20).to_le_bytes());
        let e = MappedExport::parse_descriptor(&b).unwrap_err();
        assert!(e.to_string().contains("do not lie inside"), "{e}");
        let mut b = export(&[2 << 20], 0, 1 << 20).descriptor();
        b[37..41].copy_from_slice(&5000u32.to_le_bytes());
        let e = MappedExport::parse_descriptor(&b).unwrap_err();
        assert!(e.to_string().contains("5000 pieces"), "{e}");
        let b = export(&[2 << 20], 0, 1 << 20).descriptor();
        let e = MappedExport::from_descriptor(&b, Vec::new()).unwrap_err();
        assert!(
            e.to_string().contains("0 file descriptors for 1 pieces"),
            "{e}"
        );
        assert!(MappedExport::parse_descriptor(&b[..20]).is_err());
        assert!(MappedExport::parse_descriptor(b"EMMPOOL..").is_err());
    }
}
