//! cuda.core's memory resources as emm types, one file each: [`DeviceMemoryResource`]
//! (`device.rs`: stream-ordered device memory from a driver pool that emm creates, with
//! `max_size` and `ipc_enabled`, or from the device's default pool, which emm does not own),
//! [`PinnedMemoryResource`] (`pinned.rs`) and [`ManagedMemoryResource`] (`managed.rs`), both
//! over the first's machinery.
//!
//! A resource is not a memory manager: it allocates alongside the context's manager, for code
//! written against cuda.core's interface (`allocate(size, stream)`, `deallocate`, the pool's
//! attributes, `is_handle_owned`, `close`). Its buffers are
//! [`MemoryPointer`](crate::MemoryPointer)s, stream-ordered as the managers' `memalloc_on`
//! memory is: freed on their stream when the last pointer drops (or on the stream given to
//! [`free_on`](crate::MemoryPointer::free_on)), after the streams recorded with
//! [`record_stream`](crate::MemoryPointer::record_stream). The `async-pool` manager is the
//! same pool behind the manager interface.

mod device;
mod managed;
mod pinned;

pub use device::{DeviceMemoryResource, DeviceMemoryResourceOptions};
pub use managed::{ManagedMemoryResource, ManagedMemoryResourceOptions};
pub use pinned::{PinnedMemoryResource, PinnedMemoryResourceOptions};
