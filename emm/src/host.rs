//! The host side of every NBEP 7 manager (Numba's `HostOnlyCUDAMemoryManager`), and how a
//! device-only plugin gets it by composition; see [`HostLayer`].
#![allow(unsafe_code)]

use std::any::Any;
use std::cell::UnsafeCell;
use std::fmt;
use std::sync::Arc;

use driver_sys::{DevicePtr, DriverError, ErrorKind, HostPtr, host_alloc, host_register};

use crate::ipc::IpcHandle;
use crate::manager::{INTERFACE_VERSION, ManagerContext, MemoryManager};
use crate::pending::{DeferCleanup, Free, PendingDeallocs};
use crate::pinned_pool::{PinnedBlock, PinnedPool};
use crate::pointer::Release;
use crate::pool::{PoolReport, PoolStats};
use crate::tracker::{Entry, Tracker, unpin_now};
use crate::{EmmError, MemoryInfo, MemoryPointer};

/// Whatever keeps pinned host memory alive (Numba's `owner`): the buffer a caller pinned.
pub type HostOwner = Arc<dyn Any + Send + Sync>;

/// A release action for host memory: called once, with the host address and size.
pub type HostReleaseFn = Box<dyn FnOnce(HostPtr, usize) + Send + Sync>;

fn host_range_check(
    what: &'static str,
    offset: usize,
    len: usize,
    size: usize,
) -> Result<(), EmmError> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(EmmError::OutOfBounds {
            what,
            start: offset,
            end: offset.saturating_add(len),
            size,
        }),
    }
}

/// Copies `src` into host memory at `host + offset`.
///
/// # Safety
///
/// `host .. host + size` is live host memory that no Rust reference covers, and
/// `offset + src.len() <= size` (checked by the caller).
unsafe fn host_write(host: HostPtr, offset: usize, src: &[u8]) {
    // SAFETY: the caller guarantees the range is live, unaliased by references, and in bounds;
    // `src` is a live slice; the two cannot overlap since no reference covers the destination.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), (host.0 + offset) as *mut u8, src.len()) }
}

/// Copies host memory at `host + offset` into `dst`.
///
/// # Safety
///
/// As for [`host_write`], with `offset + dst.len() <= size`.
unsafe fn host_read(host: HostPtr, offset: usize, dst: &mut [u8]) {
    // SAFETY: as for `host_write`; `dst` is an exclusive borrow.
    unsafe {
        std::ptr::copy_nonoverlapping((host.0 + offset) as *const u8, dst.as_mut_ptr(), dst.len())
    }
}

/// A heap buffer meant to be pinned with [`Context::pin`](crate::Context::pin): a stable
/// address, bytes reached only through copies (never through references), so the device may
/// read and write it through a mapping while the host holds the buffer.
pub struct PinnableBuffer {
    bytes: Box<[UnsafeCell<u8>]>,
}

// SAFETY: the bytes are only ever reached through raw-pointer copies (`read`, `write`, the
// driver), never through references, so sharing the buffer between threads creates no aliasing
// references; concurrent copies to the same bytes race as device and host memory always may.
unsafe impl Sync for PinnableBuffer {}

impl PinnableBuffer {
    /// A zeroed buffer of `len` bytes.
    pub fn zeroed(len: usize) -> PinnableBuffer {
        PinnableBuffer {
            bytes: (0..len).map(|_| UnsafeCell::new(0)).collect(),
        }
    }

    /// A buffer holding a copy of `data`.
    pub fn from_slice(data: &[u8]) -> PinnableBuffer {
        PinnableBuffer {
            bytes: data.iter().map(|&b| UnsafeCell::new(b)).collect(),
        }
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The address of the first byte.
    pub fn host_ptr(&self) -> HostPtr {
        HostPtr(self.bytes.as_ptr() as usize)
    }

    /// Copies `src` into the buffer at `offset`.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), EmmError> {
        host_range_check("write to a pinnable buffer", offset, src.len(), self.len())?;
        // SAFETY: the buffer is live (borrowed), its bytes are never referenced, and the range
        // was checked.
        unsafe { host_write(self.host_ptr(), offset, src) };
        Ok(())
    }

    /// Copies bytes at `offset` into `dst`.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), EmmError> {
        host_range_check("read from a pinnable buffer", offset, dst.len(), self.len())?;
        // SAFETY: as for `write`.
        unsafe { host_read(self.host_ptr(), offset, dst) };
        Ok(())
    }

    /// A copy of all bytes.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0; self.len()];
        self.read(0, &mut v).expect("in bounds");
        v
    }
}

impl fmt::Debug for PinnableBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnableBuffer")
            .field("host", &self.host_ptr())
            .field("len", &self.len())
            .finish()
    }
}

/// Page-locked host memory that is not mapped into the device (Numba's `PinnedMemory`).
/// Released when this value drops: a deferred `cuMemFreeHost`, or an immediate unpin.
pub struct PinnedMemory {
    host: HostPtr,
    size: usize,
    owner: Option<HostOwner>,
    release: Option<HostReleaseFn>,
}

impl PinnedMemory {
    /// Pinned memory at `host`, released by `release` when this value drops; `owner` (if any)
    /// is kept alive until then.
    pub fn with_release(
        host: HostPtr,
        size: usize,
        owner: Option<HostOwner>,
        release: impl FnOnce(HostPtr, usize) + Send + Sync + 'static,
    ) -> PinnedMemory {
        PinnedMemory {
            host,
            size,
            owner,
            release: Some(Box::new(release)),
        }
    }

    /// The host address.
    pub fn host_ptr(&self) -> HostPtr {
        self.host
    }

    /// Bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The owner kept alive, if any.
    pub fn owner(&self) -> Option<&HostOwner> {
        self.owner.as_ref()
    }

    /// Copies `src` into the memory at `offset`.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), EmmError> {
        host_range_check("write to pinned memory", offset, src.len(), self.size)?;
        // SAFETY: the memory is live while `self` is, emm hands out no references to it, and
        // the range was checked.
        unsafe { host_write(self.host, offset, src) };
        Ok(())
    }

    /// Copies bytes at `offset` into `dst`.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), EmmError> {
        host_range_check("read from pinned memory", offset, dst.len(), self.size)?;
        // SAFETY: as for `write`.
        unsafe { host_read(self.host, offset, dst) };
        Ok(())
    }
}

impl Drop for PinnedMemory {
    fn drop(&mut self) {
        if let Some(release) = self.release.take() {
            release(self.host, self.size);
        }
    }
}

impl fmt::Debug for PinnedMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedMemory")
            .field("host", &self.host)
            .field("size", &self.size)
            .field("has_owner", &self.owner.is_some())
            .finish()
    }
}

/// Page-locked host memory mapped into the device (Numba's `MappedMemory`): a host address and
/// a device pointer to the same bytes. Cheap to clone; released when the last clone of it (or
/// of its device pointer) drops.
#[derive(Clone, Debug)]
pub struct MappedMemory {
    host: HostPtr,
    device: MemoryPointer,
}

impl MappedMemory {
    /// Mapped memory whose device side is `device` (which carries the release action and keeps
    /// any owner alive).
    pub fn new(host: HostPtr, device: MemoryPointer) -> MappedMemory {
        MappedMemory { host, device }
    }

    /// The host address.
    pub fn host_ptr(&self) -> HostPtr {
        self.host
    }

    /// The device side.
    pub fn device(&self) -> &MemoryPointer {
        &self.device
    }

    /// Bytes.
    pub fn size(&self) -> usize {
        self.device.size()
    }

    /// Copies `src` into the memory at `offset`, from the host side.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), EmmError> {
        self.check_live("write to mapped memory")?;
        host_range_check("write to mapped memory", offset, src.len(), self.size())?;
        // SAFETY: the memory is live (the device pointer keeps the allocation, and the check
        // above refuses memory a reset released), emm hands out no references to it, and the
        // range was checked.
        unsafe { host_write(self.host, offset, src) };
        Ok(())
    }

    /// Copies bytes at `offset` into `dst`, from the host side.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), EmmError> {
        self.check_live("read from mapped memory")?;
        host_range_check("read from mapped memory", offset, dst.len(), self.size())?;
        // SAFETY: as for `write`.
        unsafe { host_read(self.host, offset, dst) };
        Ok(())
    }

    fn check_live(&self, what: &'static str) -> Result<(), EmmError> {
        if self.device.is_live() {
            Ok(())
        } else {
            Err(EmmError::Stale {
                what,
                device: self.device.device(),
                reason: "the memory was freed by a reset of its manager",
            })
        }
    }
}

/// What `memhostalloc` and `mempin` return: Numba returns `MappedMemory` when mapped and
/// `PinnedMemory` otherwise.
#[derive(Debug)]
pub enum HostMemory {
    /// Pinned, not mapped.
    Pinned(PinnedMemory),
    /// Pinned and mapped into the device.
    Mapped(MappedMemory),
}

impl HostMemory {
    /// The host address.
    pub fn host_ptr(&self) -> HostPtr {
        match self {
            HostMemory::Pinned(p) => p.host_ptr(),
            HostMemory::Mapped(m) => m.host_ptr(),
        }
    }

    /// Bytes.
    pub fn size(&self) -> usize {
        match self {
            HostMemory::Pinned(p) => p.size(),
            HostMemory::Mapped(m) => m.size(),
        }
    }

    /// The mapped memory, if it is mapped.
    pub fn mapped(&self) -> Option<&MappedMemory> {
        match self {
            HostMemory::Mapped(m) => Some(m),
            HostMemory::Pinned(_) => None,
        }
    }

    /// Copies `src` in at `offset`.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), EmmError> {
        match self {
            HostMemory::Pinned(p) => p.write(offset, src),
            HostMemory::Mapped(m) => m.write(offset, src),
        }
    }

    /// Copies bytes at `offset` out into `dst`.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), EmmError> {
        match self {
            HostMemory::Pinned(p) => p.read(offset, dst),
            HostMemory::Mapped(m) => m.read(offset, dst),
        }
    }
}

/// Which memory an allocation that ran out is of, for the error message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllocationKind {
    /// Device memory.
    Device,
    /// Page-locked host memory.
    Host,
}

/// The host side every NBEP 7 manager has (Numba's `HostOnlyCUDAMemoryManager`): pinned and
/// mapped host memory, the allocation table, the deferred-deallocation queue. A device-only
/// plugin gets it by composition:
///
/// - [`HostLayer`]: pinned and mapped host allocation (`cuMemHostAlloc`), pinning of existing
///   host memory (`cuMemHostRegister`), the allocation table and the deferred-deallocation
///   queue, `reset` and `defer_cleanup` for all of it, Numba's out-of-memory retry
///   ([`HostLayer::attempt_allocation`]) and IPC handles of `cuMemAlloc` memory
///   ([`HostLayer::ipc_handle`], Numba's `GetIpcHandleMixin`).
/// - [`DeviceAllocator`]: what a plugin that manages device memory only implements.
/// - [`HostOnly`]: a [`MemoryManager`] made of a [`HostLayer`] and a [`DeviceAllocator`]. It
///   calls the host layer's `reset` and `defer_cleanup` itself, so a plugin cannot forget them
///   (NBEP 7 asks subclasses to remember to call `super()`).
///
/// Which kinds retry after out-of-memory and which bypass the queue, as in Numba:
///
/// | allocation | retry after a flush | release |
/// | --- | --- | --- |
/// | device memory (`cuMemAlloc`) | yes | `cuMemFree`, deferred, counted by size |
/// | mapped pinned memory (`memhostalloc(mapped)`) | yes | `cuMemFreeHost`, deferred, counted by size |
/// | unmapped pinned memory | no | `cuMemFreeHost`, deferred, counted as 0 bytes |
/// | mapped pin (`mempin(mapped)`) | yes | `cuMemHostUnregister` at once (not deferred) |
/// | unmapped pin | no | `cuMemHostUnregister` at once (not deferred) |
///
/// Unpins bypass the queue and `defer_cleanup` so that pinning the same memory again works at
/// once. A `reset` frees what the table holds (device memory, mapped memory and mapped pins);
/// unmapped pinned memory is not tracked and is released only when its handle drops.
#[derive(Debug)]
pub struct HostLayer {
    tracker: Arc<Tracker>,
    pinned: Option<Arc<PinnedPool>>,
}

impl HostLayer {
    /// The host layer of the manager of context `cx`, with an empty table and queue (capacity
    /// unset, so any free of a known size flushes at once until someone sets it).
    pub fn new(cx: &ManagerContext) -> HostLayer {
        HostLayer {
            tracker: Arc::new(Tracker::new(cx)),
            pinned: cx.pinned_pool.map(|c| Arc::new(PinnedPool::new(c))),
        }
    }

    /// What the pinned host pool holds, if the layer has one.
    pub fn pinned_pool_stats(&self) -> Option<PoolStats> {
        self.pinned.as_ref().map(|p| p.stats())
    }

    /// Frees every cached block of the pinned host pool; returns the bytes released (queued,
    /// inside `defer_cleanup`).
    pub fn trim(&self) -> Result<usize, EmmError> {
        let Some(pool) = &self.pinned else {
            return Ok(0);
        };
        let (frees, bytes) = pool.drain(false);
        let queue = self.deallocations();
        queue.push_all_without_flush(frees);
        queue.flush()?;
        Ok(bytes)
    }

    /// The context the layer serves.
    pub fn context(&self) -> &ManagerContext {
        self.tracker.context()
    }

    /// The deferred-deallocation queue.
    pub fn deallocations(&self) -> &Arc<PendingDeallocs> {
        self.tracker.queue()
    }

    /// Number of tracked allocations (device, mapped, mapped pins) not yet released.
    pub fn live_allocations(&self) -> usize {
        self.tracker.live()
    }

    fn stale(&self, what: &'static str) -> EmmError {
        EmmError::Stale {
            what,
            device: self.context().device,
            reason: "the device was reset",
        }
    }

    /// Numba's `_attempt_allocation`: runs `allocate`; on out-of-memory flushes the queue and
    /// runs it once more (inside `defer_cleanup` the flush frees nothing). Any other error, or
    /// a second out-of-memory, is returned.
    pub fn attempt_allocation<T>(
        &self,
        what: &'static str,
        kind: AllocationKind,
        bytes: usize,
        mut allocate: impl FnMut() -> Result<T, DriverError>,
    ) -> Result<T, EmmError> {
        let cx = self.context();
        let _live = cx.liveness.enter().ok_or_else(|| self.stale(what))?;
        match allocate() {
            Ok(v) => return Ok(v),
            Err(e) if e.kind() == ErrorKind::OutOfMemory => {}
            Err(e) => return Err(EmmError::driver(what, cx.device, e)),
        }
        let queue = self.deallocations();
        tracing::warn!(
            device = %cx.device,
            what,
            bytes,
            pending = queue.len(),
            deferred = queue.is_disabled(),
            "out of memory; flushing pending deallocations and retrying once"
        );
        let flushed = queue.flush()?;
        match allocate() {
            Ok(v) => Ok(v),
            Err(e) if e.kind() == ErrorKind::OutOfMemory => Err(match kind {
                AllocationKind::Device => {
                    let info = cx.driver.mem_get_info(cx.context).unwrap_or_default();
                    EmmError::OutOfMemory {
                        device: cx.device,
                        requested: bytes,
                        free: info.free,
                        total: info.total,
                        flushed,
                        source: e,
                    }
                }
                AllocationKind::Host => EmmError::OutOfHostMemory {
                    device: cx.device,
                    requested: bytes,
                    flushed,
                    source: e,
                },
            }),
            Err(e) => Err(EmmError::driver(what, cx.device, e)),
        }
    }

    /// Tracks `bytes` of device memory at `base` allocated with `cuMemAlloc`: the returned
    /// pointer queues a `cuMemFree` when its last clone drops, and `reset` frees it.
    pub fn track_device_allocation(&self, base: DevicePtr, bytes: usize) -> MemoryPointer {
        let cx = self.context();
        let generation = self
            .tracker
            .record(base.0, Entry::Device { ptr: base, bytes });
        tracing::debug!(device = %cx.device, bytes, ptr = %base, "device memory allocated");
        MemoryPointer::from_release(
            cx.device,
            cx.context,
            base,
            bytes,
            Release::Tracked {
                tracker: Arc::clone(&self.tracker),
                key: base.0,
                generation,
            },
            None,
        )
    }

    fn device_pointer_of(&self, host: HostPtr) -> Result<DevicePtr, EmmError> {
        let cx = self.context();
        cx.driver
            .mem_host_get_device_pointer(cx.context, host)
            .map_err(|e| EmmError::driver("mapping host memory", cx.device, e))
    }

    fn mapped(
        &self,
        host: HostPtr,
        bytes: usize,
        entry: Entry,
        owner: Option<HostOwner>,
    ) -> Result<HostMemory, EmmError> {
        let device_ptr = self.device_pointer_of(host)?;
        Ok(self.mapped_at(host, device_ptr, bytes, entry, owner))
    }

    fn mapped_at(
        &self,
        host: HostPtr,
        device_ptr: DevicePtr,
        bytes: usize,
        entry: Entry,
        owner: Option<HostOwner>,
    ) -> HostMemory {
        let cx = self.context();
        let generation = self.tracker.record(host.0 as u64, entry);
        let device = MemoryPointer::from_release(
            cx.device,
            cx.context,
            device_ptr,
            bytes,
            Release::Tracked {
                tracker: Arc::clone(&self.tracker),
                key: host.0 as u64,
                generation,
            },
            owner,
        );
        HostMemory::Mapped(MappedMemory::new(host, device))
    }

    /// `cuMemHostAlloc` of `bytes` with `flags`, under Numba's rules (mapped memory retries
    /// after out-of-memory, unmapped does not), and the device pointer of mapped memory. A
    /// mapping that fails frees the allocation again.
    fn host_alloc_from_driver(
        &self,
        bytes: usize,
        mapped: bool,
        flags: u32,
    ) -> Result<(HostPtr, Option<DevicePtr>), EmmError> {
        let cx = self.context();
        let allocate = || cx.driver.mem_host_alloc(cx.context, bytes, flags);
        let host = if mapped {
            self.attempt_allocation("memhostalloc", AllocationKind::Host, bytes, allocate)?
        } else {
            let _live = cx
                .liveness
                .enter()
                .ok_or_else(|| self.stale("memhostalloc"))?;
            allocate().map_err(|e| EmmError::driver("memhostalloc", cx.device, e))?
        };
        if !mapped {
            return Ok((host, None));
        }
        match self.device_pointer_of(host) {
            Ok(device) => Ok((host, Some(device))),
            Err(e) => {
                // SAFETY: allocated just above and handed to no one.
                if let Err(e) = unsafe { cx.driver.mem_free_host(cx.context, host) } {
                    tracing::error!(device = %cx.device, error = %e, "freeing pinned memory whose mapping failed");
                }
                Err(e)
            }
        }
    }

    /// `memhostalloc` through the pinned host pool: a cached block of the request's size
    /// class, or a new one from the driver.
    fn pooled_host_alloc(
        &self,
        pool: &Arc<PinnedPool>,
        bytes: usize,
        size: usize,
        mapped: bool,
        flags: u32,
    ) -> Result<HostMemory, EmmError> {
        let (cached, mut generation) = pool.take(flags, size);
        let block = match cached {
            Some(block) => block,
            None => {
                let (host, device) = self.host_alloc_from_driver(size, mapped, flags)?;
                generation = pool.grew(size);
                tracing::debug!(device = %self.context().device, bytes = size, host = %host, mapped, "pinned host pool grew");
                PinnedBlock {
                    host,
                    device,
                    size,
                    flags,
                }
            }
        };
        if let Some(device_ptr) = block.device {
            let entry = Entry::Pooled {
                block,
                generation,
                pool: Arc::clone(pool),
            };
            return Ok(self.mapped_at(block.host, device_ptr, bytes, entry, None));
        }
        let queue = Arc::clone(self.deallocations());
        let pool = Arc::clone(pool);
        Ok(HostMemory::Pinned(PinnedMemory::with_release(
            block.host,
            bytes,
            None,
            move |_, _| {
                if let Some(free) = pool.give_back(block, generation) {
                    queue.push_from_drop(free);
                }
            },
        )))
    }

    /// Numba's `memhostalloc`: `cuMemHostAlloc` with `DEVICEMAP` if `mapped`, `PORTABLE` if
    /// `portable`, `WRITECOMBINED` if `wc`. Mapped memory retries after out-of-memory and is
    /// tracked; unmapped memory is not, and its free counts as 0 bytes.
    pub fn memhostalloc(
        &self,
        bytes: usize,
        mapped: bool,
        portable: bool,
        wc: bool,
    ) -> Result<HostMemory, EmmError> {
        if bytes == 0 {
            // The driver would hand back a null pointer, which cannot be mapped or freed usefully.
            return Err(EmmError::ZeroSize {
                what: "memhostalloc",
            });
        }
        let cx = self.context().clone();
        let mut flags = 0;
        if mapped {
            flags |= host_alloc::DEVICEMAP;
        }
        if portable {
            flags |= host_alloc::PORTABLE;
        }
        if wc {
            flags |= host_alloc::WRITECOMBINED;
        }
        if let Some(pool) = &self.pinned
            && let Some(size) = pool.class(bytes)
        {
            return self.pooled_host_alloc(pool, bytes, size, mapped, flags);
        }
        let (host, device) = self.host_alloc_from_driver(bytes, mapped, flags)?;
        tracing::debug!(device = %cx.device, bytes, host = %host, mapped, portable, wc, "pinned host memory allocated");
        if let Some(device_ptr) = device {
            let entry = Entry::Host { ptr: host, bytes };
            return Ok(self.mapped_at(host, device_ptr, bytes, entry, None));
        }
        let queue = Arc::clone(self.deallocations());
        Ok(HostMemory::Pinned(PinnedMemory::with_release(
            host,
            bytes,
            None,
            move |ptr, _| {
                queue.push_from_drop(Free::Host { ptr, bytes: 0 });
            },
        )))
    }

    /// Numba's `mempin`: page-locks `ptr .. ptr + size` with `cuMemHostRegister` (`DEVICEMAP`
    /// if `mapped`), keeping `owner` alive until it is unpinned. Mapped pins retry after
    /// out-of-memory and are tracked; every unpin happens at once when the last handle drops.
    ///
    /// # Safety
    ///
    /// - `ptr .. ptr + size` is host memory that `owner` keeps alive.
    /// - While the pin lives, no Rust reference to that memory is used while the device or a
    ///   driver copy may write it (with `mapped`, device work can write it at any time).
    pub unsafe fn mempin(
        &self,
        owner: HostOwner,
        ptr: HostPtr,
        size: usize,
        mapped: bool,
    ) -> Result<HostMemory, EmmError> {
        if size == 0 {
            return Err(EmmError::ZeroSize { what: "mempin" });
        }
        let cx = self.context().clone();
        let flags = if mapped { host_register::DEVICEMAP } else { 0 };
        // SAFETY: the caller vouches for the range and its use (this function's contract).
        let register = || unsafe { cx.driver.mem_host_register(cx.context, ptr, size, flags) };
        if mapped {
            self.attempt_allocation("mempin", AllocationKind::Host, size, register)?;
        } else {
            let _live = cx.liveness.enter().ok_or_else(|| self.stale("mempin"))?;
            register().map_err(|e| EmmError::driver("mempin", cx.device, e))?;
        }
        tracing::debug!(device = %cx.device, bytes = size, host = %ptr, mapped, "host memory pinned");
        if mapped {
            return self
                .mapped(
                    ptr,
                    size,
                    Entry::Unpin {
                        ptr,
                        owner: Arc::clone(&owner),
                    },
                    Some(owner),
                )
                .inspect_err(|_| {
                    // SAFETY: registered just above and handed to no one.
                    if let Err(e) = unsafe { cx.driver.mem_host_unregister(cx.context, ptr) } {
                        tracing::error!(device = %cx.device, error = %e, "unpinning a range whose mapping failed");
                    }
                });
        }
        let queue = Arc::clone(self.deallocations());
        Ok(HostMemory::Pinned(PinnedMemory::with_release(
            ptr,
            size,
            Some(owner),
            move |p, _| {
                unpin_now(&cx, &queue, p);
            },
        )))
    }

    /// Frees everything tracked (device memory, mapped memory, mapped pins), then flushes the
    /// queue (Numba's `HostOnlyCUDAMemoryManager.reset`). Inside `defer_cleanup` the frees stay
    /// queued; unpins happen at once.
    pub fn reset(&self) -> Result<(), EmmError> {
        tracing::info!(device = %self.context().device, live = self.tracker.live(), pending = self.deallocations().len(), "resetting the host layer");
        if let Some(pool) = &self.pinned {
            // The tracker's reset flushes these with its own frees.
            self.deallocations()
                .push_all_without_flush(pool.drain(true).0);
        }
        self.tracker.reset().map(|_| ())
    }

    /// Suspends the queue's flushing while the guard lives.
    pub fn defer_cleanup(&self) -> DeferCleanup {
        self.deallocations().defer_cleanup()
    }

    /// An IPC handle for `memory`, which must lie in `cuMemAlloc` memory of this context
    /// (Numba's `GetIpcHandleMixin`): the handle names the whole allocation, the offset is the
    /// view's start from the allocation's base, the size is the view's.
    pub fn ipc_handle(&self, memory: &MemoryPointer) -> Result<IpcHandle, EmmError> {
        let cx = self.context();
        let _live = cx
            .liveness
            .enter()
            .ok_or_else(|| self.stale("get_ipc_handle"))?;
        let err = |op| move |e| EmmError::driver(op, cx.device, e);
        let (base, _) = cx
            .driver
            .mem_get_address_range(cx.context, memory.device_ptr())
            .map_err(err("get_ipc_handle"))?;
        let handle = cx
            .driver
            .ipc_get_mem_handle(cx.context, base)
            .map_err(err("get_ipc_handle"))?
            .into();
        let source = crate::ipc::identity_of(&*cx.driver, cx.device)?;
        let offset = (memory.device_ptr().0 - base.0) as usize;
        Ok(IpcHandle::exported(
            memory.clone(),
            handle,
            memory.size(),
            offset,
            source,
        ))
    }
}

/// The device half of a manager: what a plugin that manages device memory (a host runtime's
/// own allocator) implements. Wrapped in [`HostOnly`], it becomes a complete
/// [`MemoryManager`]: the host layer adds pinned and mapped memory and runs its own `reset` and
/// `defer_cleanup` steps, which the plugin therefore cannot forget.
///
/// Each method gets the [`HostLayer`] for the context, its driver and its queue.
pub trait DeviceAllocator: Send + Sync + fmt::Debug {
    /// Allocates `bytes` of device memory.
    fn memalloc(&self, host: &HostLayer, bytes: usize) -> Result<MemoryPointer, EmmError>;

    /// Prepares for use; called on every use of the context, idempotent.
    fn initialize(&self, host: &HostLayer) -> Result<(), EmmError>;

    /// Free and total memory as the allocator sees it.
    fn get_memory_info(&self, host: &HostLayer) -> Result<MemoryInfo, EmmError>;

    /// An IPC handle for `memory`. [`HostLayer::ipc_handle`] does it for `cuMemAlloc` memory.
    fn get_ipc_handle(
        &self,
        host: &HostLayer,
        memory: &MemoryPointer,
    ) -> Result<IpcHandle, EmmError>;

    /// Frees the allocator's own memory. Runs after the host layer's reset.
    fn reset(&self, host: &HostLayer) -> Result<(), EmmError> {
        let _ = host;
        Ok(())
    }

    /// The allocator's own deferral, joined to the host layer's guard.
    fn defer_cleanup(&self, host: &HostLayer) -> Result<DeferCleanup, EmmError> {
        let _ = host;
        Ok(DeferCleanup::nothing())
    }

    /// The interface version the allocator implements.
    fn interface_version(&self) -> u32 {
        INTERFACE_VERSION
    }

    /// Releases memory the allocator holds but does not use; returns the bytes released (or
    /// queued for release, inside `defer_cleanup`). Allocators that hold nothing back return 0.
    fn trim(&self, host: &HostLayer) -> Result<usize, EmmError> {
        let _ = host;
        Ok(0)
    }

    /// What a pooling allocator holds, if it pools.
    fn pool_stats(&self) -> Option<PoolStats> {
        None
    }

    /// Exports the allocator's IPC-enabled stream-ordered pool; allocators without one refuse
    /// (the default).
    fn export_pool(&self, host: &HostLayer) -> Result<crate::PoolExport, EmmError> {
        let _ = host;
        Err(EmmError::no_pool_export(std::any::type_name_of_val(self)))
    }
}

/// A [`MemoryManager`] made of the [`HostLayer`] and a [`DeviceAllocator`] (Numba: a subclass of
/// `HostOnlyCUDAMemoryManager`, with the `super()` calls made for it).
#[derive(Debug)]
pub struct HostOnly<D> {
    host: HostLayer,
    device: D,
}

impl<D: DeviceAllocator> HostOnly<D> {
    /// The manager of context `cx`, with `device` managing its device memory.
    pub fn new(cx: &ManagerContext, device: D) -> HostOnly<D> {
        HostOnly {
            host: HostLayer::new(cx),
            device,
        }
    }

    /// A manager from a host layer and the device allocator built for it (an allocator that
    /// needs the host layer's queue is built after the layer).
    pub fn from_parts(host: HostLayer, device: D) -> HostOnly<D> {
        HostOnly { host, device }
    }

    /// The host layer.
    pub fn host(&self) -> &HostLayer {
        &self.host
    }

    /// The device allocator.
    pub fn device(&self) -> &D {
        &self.device
    }
}

impl<D: DeviceAllocator> MemoryManager for HostOnly<D> {
    fn memalloc(&self, bytes: usize) -> Result<MemoryPointer, EmmError> {
        self.device.memalloc(&self.host, bytes)
    }

    fn memhostalloc(
        &self,
        bytes: usize,
        mapped: bool,
        portable: bool,
        wc: bool,
    ) -> Result<HostMemory, EmmError> {
        self.host.memhostalloc(bytes, mapped, portable, wc)
    }

    unsafe fn mempin(
        &self,
        owner: HostOwner,
        ptr: HostPtr,
        size: usize,
        mapped: bool,
    ) -> Result<HostMemory, EmmError> {
        // SAFETY: forwarded with this method's own contract.
        unsafe { self.host.mempin(owner, ptr, size, mapped) }
    }

    fn initialize(&self) -> Result<(), EmmError> {
        self.device.initialize(&self.host)
    }

    fn get_ipc_handle(&self, memory: &MemoryPointer) -> Result<IpcHandle, EmmError> {
        self.device.get_ipc_handle(&self.host, memory)
    }

    fn get_memory_info(&self) -> Result<MemoryInfo, EmmError> {
        self.device.get_memory_info(&self.host)
    }

    fn reset(&self) -> Result<(), EmmError> {
        let host = self.host.reset();
        let device = self.device.reset(&self.host);
        host.and(device)
    }

    fn defer_cleanup(&self) -> Result<DeferCleanup, EmmError> {
        let host = self.host.defer_cleanup();
        Ok(host.join(self.device.defer_cleanup(&self.host)?))
    }

    fn interface_version(&self) -> u32 {
        self.device.interface_version()
    }

    fn deallocations(&self) -> Option<&Arc<PendingDeallocs>> {
        Some(self.host.deallocations())
    }

    fn trim(&self) -> Result<usize, EmmError> {
        let device = self.device.trim(&self.host)?;
        Ok(device + self.host.trim()?)
    }

    fn pool_stats(&self) -> PoolReport {
        PoolReport {
            device: self.device.pool_stats(),
            pinned_host: self.host.pinned_pool_stats(),
        }
    }

    fn export_pool(&self) -> Result<crate::PoolExport, EmmError> {
        self.device.export_pool(&self.host)
    }
}
