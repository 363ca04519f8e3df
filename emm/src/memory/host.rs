//! Host memory objects: pinned and mapped memory, pins of existing buffers.
#![allow(unsafe_code)]

use std::any::Any;
use std::cell::UnsafeCell;
use std::fmt;
use std::sync::Arc;

use driver_sys::HostPtr;

use crate::error::EmmError;
use crate::memory::pointer::MemoryPointer;

/// How `memhostalloc` allocates page-locked host memory, as named flags rather than Numba's
/// three booleans ([`Context::host_alloc`](crate::Context::host_alloc)).
///
/// ```
/// use emm::HostAllocFlags;
/// let flags = HostAllocFlags::MAPPED.portable();
/// assert!(flags.mapped && flags.portable && !flags.write_combined);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct HostAllocFlags {
    /// Mapped into the device's address space (`CU_MEMHOSTALLOC_DEVICEMAP`).
    pub mapped: bool,
    /// Page-locked for every context, not only the allocating one (`CU_MEMHOSTALLOC_PORTABLE`).
    pub portable: bool,
    /// Write-combined: fast for the device to read, slow for the host to read
    /// (`CU_MEMHOSTALLOC_WRITECOMBINED`).
    pub write_combined: bool,
}

impl HostAllocFlags {
    /// Pinned only.
    pub const PINNED: HostAllocFlags = HostAllocFlags {
        mapped: false,
        portable: false,
        write_combined: false,
    };

    /// Pinned and mapped into the device.
    pub const MAPPED: HostAllocFlags = HostAllocFlags {
        mapped: true,
        portable: false,
        write_combined: false,
    };

    /// These flags, and portable.
    #[must_use]
    pub const fn portable(mut self) -> HostAllocFlags {
        self.portable = true;
        self
    }

    /// These flags, and write-combined.
    #[must_use]
    pub const fn write_combined(mut self) -> HostAllocFlags {
        self.write_combined = true;
        self
    }
}

/// Whatever keeps pinned host memory alive (Numba's `owner`): the buffer a caller pinned.
pub type HostOwner = Arc<dyn Any + Send + Sync>;

/// A release action for host memory: called once, with the host address and size.
pub type HostReleaseFn = Box<dyn FnOnce(HostPtr, usize) + Send + Sync>;

/// How a pool of pinned host memory releases the blocks it hands out without a closure (a heap
/// allocation) per block; see [`PinnedMemory::with_hook`].
pub trait HostReleaseHook: Send + Sync {
    /// The [`PinnedMemory`] at `host` (of `size` bytes, stamped with `tag`) dropped. Runs on the
    /// dropping thread; must not panic.
    fn release(&self, host: HostPtr, size: usize, tag: u64);

    /// As [`release`](Self::release), called by a [`PinnedMemory`] made with
    /// [`PinnedMemory::with_hook`], which hands over its reference to the hook with it: a pool
    /// may keep that reference for the next block it hands out, instead of dropping it here
    /// and cloning one there (two updates of a count every thread shares). The default
    /// releases and drops it.
    fn release_owned(self: Arc<Self>, host: HostPtr, size: usize, tag: u64) {
        self.release(host, size, tag);
    }

    /// Runs `access` (a read, write or copy named `what`) while the memory at `host` stamped
    /// `tag` stays allocated, or returns the error that says why it no longer is. The default
    /// runs it: a caller's own hook vouched, in [`PinnedMemory::with_hook`]'s contract, that
    /// the memory lives until the release. emm's pools answer for what frees memory under a
    /// live block (a context destroyed with its runtime).
    fn keep_while(
        &self,
        host: HostPtr,
        tag: u64,
        what: &'static str,
        access: &mut dyn FnMut(),
    ) -> Result<(), EmmError> {
        let _ = (host, tag, what);
        access();
        Ok(())
    }
}

/// What keeps the memory of a [`PinnedMemory`] emm made with a release closure allocated while
/// a read, write or copy goes through it: the context it was allocated in (destroyed with its
/// runtime, the driver frees its host allocations with it), and for some memory the pool it
/// came from (a reset frees the driver's host memory pool).
pub(crate) trait HostKeeper: Send + Sync {
    /// As [`HostReleaseHook::keep_while`].
    fn keep_while(
        &self,
        host: HostPtr,
        tag: u64,
        what: &'static str,
        access: &mut dyn FnMut(),
    ) -> Result<(), EmmError>;
}

/// Memory that wraps other pinned memory (an adaptor's) is kept as that memory is.
impl HostKeeper for PinnedMemory {
    fn keep_while(
        &self,
        _host: HostPtr,
        _tag: u64,
        what: &'static str,
        access: &mut dyn FnMut(),
    ) -> Result<(), EmmError> {
        self.access(what, access)
    }
}

/// What a [`PinnedMemory`] does when it drops.
enum HostRelease {
    /// Done already, or nothing to do.
    Done,
    /// A closure, called once.
    Fn(HostReleaseFn),
    /// A shared hook, told the address, size and tag. `spare`: a clone
    /// [`PinnedMemory::with_shared_hook`] made, which afterwards goes to the dropping thread's
    /// spares; a caller's own hook, given to `with_hook`, is handed back to the hook itself
    /// ([`HostReleaseHook::release_owned`]).
    Hook {
        hook: Arc<dyn HostReleaseHook>,
        tag: u64,
        spare: bool,
    },
}

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
    release: HostRelease,
    /// For memory released by a closure: what keeps it allocated during an access, and the
    /// tag it knows the memory by ([`HostKeeper`]). A hook answers for its own memory.
    keeper: Option<(Arc<dyn HostKeeper>, u64)>,
}

impl PinnedMemory {
    /// Pinned memory at `host`, released by `release` when this value drops; `owner` (if any)
    /// is kept alive until then.
    ///
    /// # Safety
    ///
    /// `host .. host + size` is page-locked host memory the caller owns and keeps valid until
    /// the release runs: emm's safe reads, writes and copies go through that range.
    pub unsafe fn with_release(
        host: HostPtr,
        size: usize,
        owner: Option<HostOwner>,
        release: impl FnOnce(HostPtr, usize) + Send + Sync + 'static,
    ) -> PinnedMemory {
        PinnedMemory {
            host,
            size,
            owner,
            release: HostRelease::Fn(Box::new(release)),
            keeper: None,
        }
    }

    /// Pinned memory at `host` that a pool hands out: when this value drops, it hands `hook`
    /// back with `hook.release_owned(host, size, tag)`
    /// ([`HostReleaseHook::release_owned`], which by default runs `release` and drops the
    /// reference). Unlike [`with_release`](Self::with_release) this allocates nothing per
    /// block.
    ///
    /// # Safety
    ///
    /// `host .. host + size` is page-locked host memory the caller owns and keeps valid until
    /// the release runs: emm's safe reads, writes and copies go through that range.
    pub unsafe fn with_hook(
        host: HostPtr,
        size: usize,
        hook: Arc<dyn HostReleaseHook>,
        tag: u64,
    ) -> PinnedMemory {
        PinnedMemory {
            host,
            size,
            owner: None,
            release: HostRelease::Hook {
                hook,
                tag,
                spare: false,
            },
            keeper: None,
        }
    }

    /// As [`with_hook`](Self::with_hook), with a clone of `hook` taken from this thread's
    /// spare clones when one is there: a pool hands every block the same hook, and cloning it
    /// per block makes every thread increment (and every drop decrement) one shared count,
    /// which halves what two threads manage together. A dropped value's clone goes back to the
    /// spares of the dropping thread (at most 64).
    ///
    /// # Safety
    ///
    /// As [`with_hook`](Self::with_hook).
    pub unsafe fn with_shared_hook<H: HostReleaseHook + 'static>(
        host: HostPtr,
        size: usize,
        hook: &Arc<H>,
        tag: u64,
    ) -> PinnedMemory {
        let same =
            |h: &Arc<dyn HostReleaseHook>| std::ptr::addr_eq(Arc::as_ptr(h), Arc::as_ptr(hook));
        let spare = SPARE_HOOKS
            .try_with(|s| {
                let mut s = s.try_borrow_mut().ok()?;
                s.last().is_some_and(same).then(|| s.pop()).flatten()
            })
            .ok()
            .flatten();
        let hook = spare.unwrap_or_else(|| Arc::clone(hook) as Arc<dyn HostReleaseHook>);
        PinnedMemory {
            host,
            size,
            owner: None,
            release: HostRelease::Hook {
                hook,
                tag,
                spare: true,
            },
            keeper: None,
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

    /// Has `keeper` answer for the memory during accesses, knowing it by `tag`.
    pub(crate) fn kept_by(mut self, keeper: Arc<dyn HostKeeper>, tag: u64) -> PinnedMemory {
        self.keeper = Some((keeper, tag));
        self
    }

    /// Runs `access` (named `what`) while the memory stays allocated: the memory's keeper or
    /// hook holds what would free it meanwhile, and refuses memory already freed under this
    /// value (its context torn down, its pool reset).
    pub(crate) fn access<R>(
        &self,
        what: &'static str,
        access: impl FnOnce() -> R,
    ) -> Result<R, EmmError> {
        let mut access = Some(access);
        let mut out = None;
        let mut run = || out = access.take().map(|f| f());
        match (&self.release, &self.keeper) {
            (_, Some((keeper, tag))) => keeper.keep_while(self.host, *tag, what, &mut run)?,
            (HostRelease::Hook { hook, tag, .. }, None) => {
                hook.keep_while(self.host, *tag, what, &mut run)?
            }
            _ => run(),
        }
        Ok(out.expect("a keeper that returns Ok ran the access"))
    }

    /// Copies `src` into the memory at `offset`.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), EmmError> {
        const WHAT: &str = "write to pinned memory";
        host_range_check(WHAT, offset, src.len(), self.size)?;
        self.access(WHAT, || {
            // SAFETY: the memory stays allocated during the access (its keeper holds what
            // would free it, and refused memory already freed), emm hands out no references
            // to it, and the range was checked.
            unsafe { host_write(self.host, offset, src) }
        })
    }

    /// Copies bytes at `offset` into `dst`.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), EmmError> {
        const WHAT: &str = "read from pinned memory";
        host_range_check(WHAT, offset, dst.len(), self.size)?;
        self.access(WHAT, || {
            // SAFETY: as for `write`.
            unsafe { host_read(self.host, offset, dst) }
        })
    }
}

impl Drop for PinnedMemory {
    fn drop(&mut self) {
        match std::mem::replace(&mut self.release, HostRelease::Done) {
            HostRelease::Fn(release) => release(self.host, self.size),
            HostRelease::Hook {
                hook,
                tag,
                spare: false,
            } => hook.release_owned(self.host, self.size, tag),
            HostRelease::Hook {
                hook,
                tag,
                spare: true,
            } => {
                hook.release(self.host, self.size, tag);
                let mut hook = Some(hook);
                // A spare is kept for the next `with_shared_hook` on this thread; dropped
                // (below, with the list not borrowed) when the list is full or the thread is
                // exiting.
                let _ = SPARE_HOOKS.try_with(|s| {
                    if let Ok(mut s) = s.try_borrow_mut()
                        && s.len() < HOOK_SPARES
                    {
                        s.extend(hook.take());
                    }
                });
                drop(hook);
            }
            HostRelease::Done => {}
        }
    }
}

/// The most spare hook clones one thread keeps for [`PinnedMemory::with_shared_hook`].
const HOOK_SPARES: usize = 64;

thread_local! {
    /// This thread's spare clones of pool hooks, the last dropped on top.
    static SPARE_HOOKS: std::cell::RefCell<Vec<Arc<dyn HostReleaseHook>>> =
        const { std::cell::RefCell::new(Vec::new()) };
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
    ///
    /// # Safety
    ///
    /// `host .. host + device.size()` is page-locked host memory mapped at `device`'s address,
    /// alive as long as `device` is: [`write`](Self::write) and [`read`](Self::read) copy
    /// through `host` with no further check.
    #[allow(unsafe_code)] // the contract above
    pub unsafe fn new(host: HostPtr, device: MemoryPointer) -> MappedMemory {
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
        device_backed_write(
            &self.device,
            self.host,
            "write to mapped memory",
            offset,
            src,
        )
    }

    /// Copies bytes at `offset` into `dst`, from the host side.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), EmmError> {
        device_backed_read(
            &self.device,
            self.host,
            "read from mapped memory",
            offset,
            dst,
        )
    }
}

/// The error of an access to memory whose device side a reset released.
fn stale(device: &MemoryPointer, what: &'static str) -> EmmError {
    EmmError::Stale {
        what,
        device: device.device(),
        reason: "the memory was freed by a reset of its manager",
    }
}

/// A host-side write to memory that `device` keeps alive and whose host address is `host`
/// (mapped and managed memory).
fn device_backed_write(
    device: &MemoryPointer,
    host: HostPtr,
    what: &'static str,
    offset: usize,
    src: &[u8],
) -> Result<(), EmmError> {
    host_range_check(what, offset, src.len(), device.size())?;
    device
        .keep_while(|| {
            // SAFETY: the memory is live (the device pointer keeps the allocation, and
            // `keep_while` refuses memory a reset released and holds off a reset meanwhile),
            // emm hands out no references to it, and the range was checked.
            unsafe { host_write(host, offset, src) }
        })
        .ok_or_else(|| stale(device, what))
}

/// A host-side read of memory as in [`device_backed_write`].
fn device_backed_read(
    device: &MemoryPointer,
    host: HostPtr,
    what: &'static str,
    offset: usize,
    dst: &mut [u8],
) -> Result<(), EmmError> {
    host_range_check(what, offset, dst.len(), device.size())?;
    device
        .keep_while(|| {
            // SAFETY: as for `device_backed_write`.
            unsafe { host_read(host, offset, dst) }
        })
        .ok_or_else(|| stale(device, what))
}

/// Managed memory (`cuMemAllocManaged`; Numba's `ManagedMemory`): one address for the host and
/// every device, the driver migrating pages on use. The device side is an ordinary
/// [`MemoryPointer`] (copies, views, kernels take it; it is freed like device memory, through
/// the deferred queue); the host side is reached with [`write`](Self::write) and
/// [`read`](Self::read), or through [`host_ptr`](Self::host_ptr) by code that keeps device
/// work off the memory meanwhile. Cheap to clone; released when the last clone of it (or of
/// its device pointer) drops.
#[derive(Clone, Debug)]
pub struct ManagedMemory {
    device: MemoryPointer,
    attach_global: bool,
}

impl ManagedMemory {
    /// Managed memory whose device side is `device` (which carries the release action);
    /// `attach_global` records the attach flag it was allocated with.
    ///
    /// # Safety
    ///
    /// `device` is managed memory (`cuMemAllocManaged`, or a managed-memory pool) of its whole
    /// size, which the host reaches at its device address for as long as `device` lives:
    /// [`write`](Self::write) and [`read`](Self::read) copy through host slices there. Device
    /// memory that is not managed would be written as if it were host memory.
    ///
    /// A plugin that hands out managed memory of its own wraps it so:
    ///
    /// ```no_run
    /// fn wrap(managed: emm::MemoryPointer) -> emm::ManagedMemory {
    ///     // SAFETY: `managed` came from `cuMemAllocManaged` and carries its release.
    ///     unsafe { emm::ManagedMemory::new(managed, true) }
    /// }
    /// ```
    ///
    /// and safe code cannot make one of any pointer:
    ///
    /// ```compile_fail,E0133
    /// fn wrap(device: emm::MemoryPointer) -> emm::ManagedMemory {
    ///     emm::ManagedMemory::new(device, true)
    /// }
    /// ```
    pub unsafe fn new(device: MemoryPointer, attach_global: bool) -> ManagedMemory {
        ManagedMemory {
            device,
            attach_global,
        }
    }

    /// The host address: the device address, as managed memory has one address everywhere.
    pub fn host_ptr(&self) -> HostPtr {
        HostPtr(self.device.device_ptr().0 as usize)
    }

    /// The device side.
    pub fn device(&self) -> &MemoryPointer {
        &self.device
    }

    /// Bytes.
    pub fn size(&self) -> usize {
        self.device.size()
    }

    /// Whether it was allocated attached globally (`CU_MEM_ATTACH_GLOBAL`: any stream of any
    /// device may use it) rather than to the host (`CU_MEM_ATTACH_HOST`).
    pub fn attached_globally(&self) -> bool {
        self.attach_global
    }

    /// Copies `src` into the memory at `offset`, from the host side. No device work may use
    /// the memory meanwhile (on devices without concurrent managed access, the host must not
    /// touch managed memory while any kernel runs).
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), EmmError> {
        let host = self.host_ptr();
        device_backed_write(&self.device, host, "write to managed memory", offset, src)
    }

    /// Copies bytes at `offset` into `dst`, from the host side, under the conditions of
    /// [`write`](Self::write).
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), EmmError> {
        let host = self.host_ptr();
        device_backed_read(&self.device, host, "read from managed memory", offset, dst)
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

    /// Runs `access` (a copy through the memory, named `what`) while the memory stays
    /// allocated ([`PinnedMemory::access`]); mapped memory a reset released is refused.
    pub(crate) fn access<R>(
        &self,
        what: &'static str,
        access: impl FnOnce() -> R,
    ) -> Result<R, EmmError> {
        match self {
            HostMemory::Pinned(p) => p.access(what, access),
            HostMemory::Mapped(m) => m
                .device
                .keep_while(access)
                .ok_or_else(|| stale(&m.device, what)),
        }
    }
}

#[cfg(all(test, not(emm_loom)))]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Records the blocks released through it.
    #[derive(Default)]
    struct Recorder(Mutex<Vec<(HostPtr, usize, u64)>>);
    impl HostReleaseHook for Recorder {
        fn release(&self, host: HostPtr, size: usize, tag: u64) {
            self.0.lock().expect("recorder").push((host, size, tag));
        }
    }

    #[test]
    fn a_hook_given_by_the_caller_is_released_and_not_kept_as_a_spare() {
        std::thread::spawn(|| {
            let hook = Arc::new(Recorder::default());
            // SAFETY: the test only drops the value; nothing reads or writes the fake range.
            let m = unsafe { PinnedMemory::with_hook(HostPtr(0x1000), 4096, hook.clone(), 3) };
            assert_eq!(Arc::strong_count(&hook), 2);
            drop(m);
            assert_eq!(Arc::strong_count(&hook), 1, "the caller's hook is not kept");
            assert_eq!(
                *hook.0.lock().expect("recorder"),
                [(HostPtr(0x1000), 4096, 3)]
            );
            assert_eq!(SPARE_HOOKS.with(|s| s.borrow().len()), 0);
        })
        .join()
        .expect("the test thread");
    }

    #[test]
    fn a_shared_hook_is_told_every_release_and_its_clone_is_reused_on_the_thread() {
        // A thread of its own: the spare list starts empty and no other test touches it.
        std::thread::spawn(|| {
            let hook = Arc::new(Recorder::default());
            // SAFETY: the test only drops the value; nothing reads or writes the fake range.
            let a = unsafe { PinnedMemory::with_shared_hook(HostPtr(0x1000), 4096, &hook, 7) };
            assert_eq!(Arc::strong_count(&hook), 2, "a clone per live block");
            drop(a);
            assert_eq!(Arc::strong_count(&hook), 2, "the clone stays as a spare");
            // SAFETY: the test only drops the value; nothing reads or writes the fake range.
            let b = unsafe { PinnedMemory::with_shared_hook(HostPtr(0x2000), 8192, &hook, 9) };
            assert_eq!(
                Arc::strong_count(&hook),
                2,
                "the spare is reused, not cloned"
            );
            // Another hook does not take this one's spare.
            let other = Arc::new(Recorder::default());
            drop(b);
            // SAFETY: the test only drops the value; nothing reads or writes the fake range.
            let c = unsafe { PinnedMemory::with_shared_hook(HostPtr(0x3000), 256, &other, 1) };
            assert_eq!(Arc::strong_count(&other), 2);
            assert_eq!(Arc::strong_count(&hook), 2);
            drop(c);
            assert_eq!(
                *hook.0.lock().expect("recorder"),
                [(HostPtr(0x1000), 4096, 7), (HostPtr(0x2000), 8192, 9)]
            );
            assert_eq!(
                *other.0.lock().expect("recorder"),
                [(HostPtr(0x3000), 256, 1)]
            );
            // The spares are bounded.
            let many: Vec<_> = (0..HOOK_SPARES * 2)
                // SAFETY: the test only drops the values; nothing reads or writes the fake ranges.
                .map(|i| unsafe { PinnedMemory::with_shared_hook(HostPtr(i + 1), 1, &hook, 0) })
                .collect();
            drop(many);
            let spares = SPARE_HOOKS.with(|s| s.borrow().len());
            assert_eq!(spares, HOOK_SPARES);
        })
        .join()
        .expect("the test thread");
    }
}
