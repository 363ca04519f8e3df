//! IPC of stream-ordered pools: [`PoolId`], [`PoolExport`] (a pool's file descriptor and what
//! names it, sent over a Unix socket), and the runtime's table of imported pools.
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
#![allow(unsafe_code)]

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::io::{self, Read};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};

use driver_sys::{DeviceOrdinal, DevicePtr, MemPoolHandle, PoolPtrExportData, StreamHandle};

use crate::EmmError;
use crate::context::Context;
use crate::ipc::DeviceIdentity;
use crate::sync::{Mutex, lock};

/// The name of an IPC-enabled stream-ordered pool across processes: chosen by the exporting
/// manager when it creates the pool (a new one after every reset), carried in the bytes of each
/// [`IpcHandle`](crate::IpcHandle) of the pool's memory and in the pool's [`PoolExport`].
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PoolId(pub [u8; 16]);

impl PoolId {
    /// A new id: this process's id, a per-process counter and the time, so ids of different
    /// processes and of successive pools of one process differ.
    pub(crate) fn fresh() -> PoolId {
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
pub struct PoolExport {
    id: PoolId,
    source: DeviceIdentity,
    fd: OwnedFd,
}

const EXPORT_MAGIC: &[u8; 7] = b"EMMPOOL";
const EXPORT_VERSION: u16 = 1;
/// Length of [`PoolExport::descriptor`]: magic, version, id, three PCI ids.
pub const POOL_DESCRIPTOR_LEN: usize = 7 + 2 + 16 + 12;

impl PoolExport {
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
    pub fn from_descriptor(bytes: &[u8], fd: OwnedFd) -> Result<PoolExport, EmmError> {
        let bad = |reason: String| EmmError::InvalidArgument {
            what: "pool export descriptor",
            reason,
        };
        if bytes.len() < 9 || &bytes[..7] != EXPORT_MAGIC {
            return Err(bad(
                "the bytes do not start with an emm pool export's marker; pass the bytes \
                 PoolExport::descriptor produced"
                    .into(),
            ));
        }
        let version = u16::from_le_bytes([bytes[7], bytes[8]]);
        if version != EXPORT_VERSION {
            return Err(bad(format!(
                "format version {version}, and this emm reads version {EXPORT_VERSION}; export \
                 and import with the same emm release"
            )));
        }
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

    /// Sends the export over a connected Unix stream socket: the descriptor's bytes as data,
    /// the file descriptor as `SCM_RIGHTS`. The receiving process calls
    /// [`receive`](Self::receive). This export keeps its own descriptor (the receiver gets a
    /// duplicate).
    pub fn send(&self, socket: &UnixStream) -> Result<(), EmmError> {
        let payload = self.descriptor();
        let fail = |source| EmmError::PoolTransfer {
            what: "sending a pool export",
            source,
        };
        let fd: libc::c_int = self.fd.as_raw_fd();
        let mut control = ControlBuffer::new();
        let mut iov = libc::iovec {
            iov_base: payload.as_ptr() as *mut libc::c_void,
            iov_len: payload.len(),
        };
        let msg = control.message(&mut iov);
        // SAFETY: `msg` points at `control`, which has room for one header with one int (its
        // length is CMSG_SPACE of one int, and it is aligned for cmsghdr), so CMSG_FIRSTHDR
        // returns a valid, writable header and CMSG_DATA room for the int.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&raw const msg);
            if cmsg.is_null() {
                return Err(fail(io::Error::other("no room for the control message")));
            }
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(size_of::<libc::c_int>() as u32) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>(), fd);
        }
        // SAFETY: `msg` and everything it points at (`iov`, `payload`, `control`) are alive
        // and initialised for the call; the socket is open (borrowed from `socket`).
        let sent = unsafe { libc::sendmsg(socket.as_raw_fd(), &raw const msg, libc::MSG_NOSIGNAL) };
        if sent < 0 {
            return Err(fail(io::Error::last_os_error()));
        }
        if sent as usize != payload.len() {
            return Err(fail(io::Error::other(format!(
                "sent {sent} of {} bytes",
                payload.len()
            ))));
        }
        tracing::debug!(pool = %self.id, fd, "pool export sent");
        Ok(())
    }

    /// Receives one export that [`send`](Self::send) sent over `socket`. Blocks until it
    /// arrives (or the socket's read timeout passes).
    pub fn receive(socket: &UnixStream) -> Result<PoolExport, EmmError> {
        let fail = |source| EmmError::PoolTransfer {
            what: "receiving a pool export",
            source,
        };
        let mut payload = [0u8; POOL_DESCRIPTOR_LEN];
        let mut control = ControlBuffer::new();
        let mut iov = libc::iovec {
            iov_base: payload.as_mut_ptr().cast(),
            iov_len: payload.len(),
        };
        let mut msg = control.message(&mut iov);
        let received = loop {
            // SAFETY: `msg` points at `payload` and `control`, both writable for their stated
            // lengths for the call; the socket is open (borrowed from `socket`).
            let n =
                unsafe { libc::recvmsg(socket.as_raw_fd(), &raw mut msg, libc::MSG_CMSG_CLOEXEC) };
            if n >= 0 {
                break n as usize;
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(fail(e));
            }
        };
        // Take ownership of every descriptor that arrived first, so none leaks on an error.
        let mut fds = Vec::new();
        // SAFETY: `msg` was filled by recvmsg; CMSG_FIRSTHDR / CMSG_NXTHDR walk only within
        // `msg_controllen` bytes of `control`; each SCM_RIGHTS header's data holds
        // (cmsg_len - CMSG_LEN(0)) / size_of::<c_int>() descriptors, now owned by this process.
        unsafe {
            let mut cmsg = libc::CMSG_FIRSTHDR(&raw const msg);
            while !cmsg.is_null() {
                if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(cmsg).cast::<libc::c_int>();
                    let bytes = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                    for k in 0..bytes / size_of::<libc::c_int>() {
                        let raw = std::ptr::read_unaligned(data.add(k));
                        fds.push(OwnedFd::from_raw_fd(raw));
                    }
                }
                cmsg = libc::CMSG_NXTHDR(&raw const msg, cmsg);
            }
        }
        if msg.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(fail(io::Error::other(
                "the control message was truncated (more than one descriptor was sent)",
            )));
        }
        if received == 0 {
            return Err(fail(io::ErrorKind::UnexpectedEof.into()));
        }
        // A stream socket may deliver the data in pieces; the descriptor came with the first.
        if received < payload.len() {
            let mut rest = socket;
            rest.read_exact(&mut payload[received..]).map_err(fail)?;
        }
        let mut fds = fds.into_iter();
        let (Some(fd), None) = (fds.next(), fds.next()) else {
            return Err(fail(io::Error::other(
                "the message did not carry exactly one file descriptor",
            )));
        };
        let export = PoolExport::from_descriptor(&payload, fd)?;
        tracing::debug!(pool = %export.id, "pool export received");
        Ok(export)
    }
}

impl fmt::Debug for PoolExport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolExport")
            .field("id", &self.id)
            .field("source", &self.source)
            .field("fd", &self.fd.as_raw_fd())
            .finish()
    }
}

/// Room for one control message with one file descriptor, aligned for `cmsghdr`.
struct ControlBuffer {
    words: [u64; 8],
}

impl ControlBuffer {
    fn new() -> ControlBuffer {
        ControlBuffer { words: [0; 8] }
    }

    fn len(&self) -> usize {
        // SAFETY: CMSG_SPACE is pure arithmetic.
        let space = unsafe { libc::CMSG_SPACE(size_of::<libc::c_int>() as u32) } as usize;
        debug_assert!(space <= size_of::<[u64; 8]>());
        space
    }

    /// A message header over one data buffer (`iov`) and this control buffer; both must
    /// outlive its use.
    fn message(&mut self, iov: &mut libc::iovec) -> libc::msghdr {
        // SAFETY: an all-zero msghdr is valid (null pointers, zero lengths); the fields used
        // are set below.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov;
        msg.msg_iovlen = 1;
        msg.msg_controllen = self.len() as _;
        msg.msg_control = self.words.as_mut_ptr().cast();
        msg
    }
}

/// One imported pool: the context it was imported in and the pointers imported through it
/// that are not freed yet.
struct Imported {
    ctx: Context,
    pool: MemPoolHandle,
    pointers: HashSet<u64>,
}

/// The pools this process imported, by id (one table per runtime).
#[derive(Default)]
pub(crate) struct PoolImports {
    pools: Mutex<HashMap<PoolId, Imported>>,
}

impl fmt::Debug for PoolImports {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let pools = lock(&self.pools);
        f.debug_map()
            .entries(pools.iter().map(|(id, p)| (id, (p.pool, p.pointers.len()))))
            .finish()
    }
}

const STREAM: StreamHandle = StreamHandle(0);

impl PoolImports {
    /// Imports `export` in `ctx` (its source device's context) and grants that device access;
    /// importing a pool already imported there does nothing.
    pub(crate) fn import(&self, ctx: &Context, export: PoolExport) -> Result<(), EmmError> {
        let mut pools = lock(&self.pools);
        if let Some(p) = pools.get(&export.id) {
            if p.ctx.is_alive() {
                return Ok(());
            }
            // Imported before a reset of its device; the import went with the context.
            pools.remove(&export.id);
        }
        let cx = &ctx.inner.cx;
        let err = |e| EmmError::driver("import_pool", cx.device, e);
        let _live = cx.liveness.enter().ok_or(EmmError::Stale {
            what: "import_pool",
            device: cx.device,
            reason: "the device was reset",
        })?;
        let pool = cx
            .driver
            .mem_pool_import_fd(cx.context, export.fd())
            .map_err(err)?;
        if let Err(e) = grant_access(ctx, pool, cx.device) {
            // SAFETY: imported just above; no pointer was imported through it.
            let _ = unsafe { cx.driver.mem_pool_destroy(cx.context, pool) };
            return Err(err(e));
        }
        tracing::info!(device = %cx.device, pool = %export.id, handle = ?pool, "stream-ordered pool imported");
        pools.insert(
            export.id,
            Imported {
                ctx: ctx.clone(),
                pool,
                pointers: HashSet::new(),
            },
        );
        Ok(())
    }

    /// Imports the pointer `data` names from pool `id`, usable from device `user` (access is
    /// granted when that is not the pool's device). Returns the pool's context (the source
    /// device's) and the pointer.
    pub(crate) fn import_pointer(
        &self,
        id: PoolId,
        data: &PoolPtrExportData,
        user: DeviceOrdinal,
    ) -> Result<(Context, DevicePtr), EmmError> {
        let mut pools = lock(&self.pools);
        let Some(p) = pools.get_mut(&id) else {
            return Err(EmmError::PoolNotImported {
                pool: id.to_string(),
                detail: "",
            });
        };
        let cx = &p.ctx.inner.cx;
        let Some(_live) = cx.liveness.enter() else {
            pools.remove(&id);
            return Err(EmmError::PoolNotImported {
                pool: id.to_string(),
                detail: " (it was imported before its device was reset)",
            });
        };
        let err = |e| EmmError::driver("open IPC handle", cx.device, e);
        if user != cx.device {
            grant_access(&p.ctx, p.pool, user).map_err(err)?;
        }
        let ptr = cx
            .driver
            .mem_pool_import_pointer(cx.context, p.pool, data)
            .map_err(err)?;
        p.pointers.insert(ptr.0);
        tracing::debug!(device = %cx.device, pool = %id, %ptr, "pool pointer imported");
        Ok((p.ctx.clone(), ptr))
    }

    /// Frees a pointer [`import_pointer`](Self::import_pointer) returned, once; a pointer a
    /// device reset already released is left alone.
    pub(crate) fn free_pointer(&self, id: PoolId, ptr: DevicePtr) -> Result<(), EmmError> {
        let mut pools = lock(&self.pools);
        let Some(p) = pools.get_mut(&id) else {
            return Ok(());
        };
        if !p.pointers.remove(&ptr.0) {
            return Ok(());
        }
        free_imported(&p.ctx, ptr)
    }

    /// Frees the pointers imported through pools of `device` and destroys those pools (a
    /// device reset or the runtime's end). The first error is returned after all ran.
    pub(crate) fn release_device(&self, device: DeviceOrdinal) -> Result<(), EmmError> {
        let gone: Vec<(PoolId, Imported)> = {
            let mut pools = lock(&self.pools);
            let ids: Vec<PoolId> = pools
                .iter()
                .filter(|(_, p)| p.ctx.device() == device)
                .map(|(id, _)| *id)
                .collect();
            ids.into_iter()
                .filter_map(|id| pools.remove(&id).map(|p| (id, p)))
                .collect()
        };
        let mut result = Ok(());
        for (id, p) in gone {
            let cx = &p.ctx.inner.cx;
            let Some(_live) = cx.liveness.enter() else {
                continue;
            };
            for ptr in &p.pointers {
                result = result.and(free_imported(&p.ctx, DevicePtr(*ptr)));
            }
            // SAFETY: the pool was imported by this table, is destroyed once (removed from it
            // above), and every pointer imported through it was freed just above; handles
            // still open see their mapping as closed (the context's pointers are stale from
            // the reset on).
            let destroyed = unsafe { cx.driver.mem_pool_destroy(cx.context, p.pool) };
            tracing::info!(%device, pool = %id, pointers = p.pointers.len(), "imported stream-ordered pool released");
            result = result.and(destroyed.map_err(|e| EmmError::driver("reset", device, e)));
        }
        result
    }
}

/// Gives device `dev` read-write access to the imported `pool`, unless it has it already.
fn grant_access(
    ctx: &Context,
    pool: MemPoolHandle,
    dev: DeviceOrdinal,
) -> Result<(), driver_sys::DriverError> {
    let cx = &ctx.inner.cx;
    if cx.driver.mem_pool_can_access(cx.context, pool, dev)? {
        return Ok(());
    }
    cx.driver.mem_pool_grant_access(cx.context, pool, dev)
}

/// Frees an imported pointer and waits for the free: the driver wants it complete in the
/// importer before the exporter frees the allocation.
fn free_imported(ctx: &Context, ptr: DevicePtr) -> Result<(), EmmError> {
    let cx = &ctx.inner.cx;
    let Some(_live) = cx.liveness.enter() else {
        // The context is gone, and the import with it.
        return Ok(());
    };
    let err = |e| EmmError::driver("close IPC handle", cx.device, e);
    // SAFETY: `ptr` was imported by `cuMemPoolImportPointer` and is freed once (its entry was
    // removed from the table by the caller); the pointer's handle turned its mapping stale
    // first, so emm does not use it afterwards; the context is alive (`_live`).
    unsafe { cx.driver.mem_free_async(cx.context, ptr, STREAM) }.map_err(err)?;
    cx.driver
        .stream_synchronize(cx.context, STREAM)
        .map_err(err)
}
