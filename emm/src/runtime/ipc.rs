//! Opening an [`IpcHandle`] from the runtime's side: which context the memory goes to, which
//! device it comes from, and whether the open is direct or staged. The work is the IPC layer's
//! (`crate::ipc::open`).

use crate::contract::ipc::IpcHandle;
use crate::error::EmmError;
use crate::ipc::open;
use crate::memory::pointer::MemoryPointer;
use crate::runtime::Runtime;
use crate::runtime::context::Context;

impl IpcHandle {
    /// Opens the handle in `ctx`: directly when its device is the source or a peer of it (or
    /// the source is unknown), staged otherwise (Numba's `IpcHandle.open`).
    pub fn open(&self, runtime: &Runtime, ctx: &Context) -> Result<MemoryPointer, EmmError> {
        let direct = match self.source() {
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

    /// Maps the memory into `ctx` and returns a pointer to the exported range (Numba's
    /// `open_direct`). The mapping covers `offset + size` bytes from the allocation's base.
    pub fn open_direct(&self, ctx: &Context) -> Result<MemoryPointer, EmmError> {
        open::open_direct(self, &ctx.endpoint())
    }

    /// Copies the memory into new memory of `ctx`'s manager by way of the source device
    /// (Numba's `open_staged`); the copy belongs to that manager. Use it to force the staged
    /// path between peers. Memory of an imported stream-ordered pool is copied through host
    /// memory (16 MiB at a time) when `ctx` is on another device: only devices the pool grants
    /// access reach it, and one that is not a peer cannot be granted.
    pub fn open_staged(&self, runtime: &Runtime, ctx: &Context) -> Result<MemoryPointer, EmmError> {
        let Some(source) = self.source() else {
            return Err(EmmError::Ipc {
                message: "IPC handle doesn't have source info",
                advice: "a staged open needs the exporting device; send the handle with \
                         IpcHandle::to_bytes from the handle get_ipc_handle returned",
            });
        };
        let src_ctx = runtime.context(runtime.device_with_identity(&source)?)?;
        open::open_staged(self, &src_ctx.endpoint(), &ctx.endpoint())
    }
}
