//! Host memory objects: [`PinnedMemory`] (page-locked, not mapped) and [`MappedMemory`]
//! (page-locked and mapped into the device's address space), as NBEP 7's `memhostalloc` and
//! `mempin` return them.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use driver_sys::HostPtr;

use crate::MemoryPointer;

/// Whatever keeps pinned host memory alive (Numba's `owner`): the buffer a caller pinned.
pub type HostOwner = Arc<dyn Any + Send + Sync>;

/// A release action for host memory: called once, with the host address and size.
pub type HostReleaseFn = Box<dyn FnOnce(HostPtr, usize) + Send + Sync>;

/// Page-locked host memory that is not mapped into the device.
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

/// Page-locked host memory mapped into the device: a host address and a device pointer to the
/// same bytes. Released when the device pointer's last clone drops.
#[derive(Clone, Debug)]
pub struct MappedMemory {
    host: HostPtr,
    device: MemoryPointer,
}

impl MappedMemory {
    /// Mapped memory whose device side is `device` (which carries the release action).
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
