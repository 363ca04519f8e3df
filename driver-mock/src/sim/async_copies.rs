//! Copies and sets queued on a stream (`cuMemcpyHtoDAsync`, `cuMemcpyDtoHAsync`,
//! `cuMemcpyDtoDAsync`, `cuMemsetD8Async`): their checks, and the work they queue.

use driver_sys::{ContextHandle, DevicePtr, StreamHandle};

use super::Note;
use super::memory::Accessor;
use super::streams::{Source, Work};
use super::world::{World, context};

impl World {
    /// Whether `len` bytes at host address `at` are page-locked memory of process `pid`.
    pub(super) fn pinned_range(&self, pid: usize, at: usize, len: usize) -> bool {
        self.processes[pid]
            .host
            .range(..=at)
            .next_back()
            .is_some_and(|(&start, h)| h.is_pinned() && at + len <= start + h.size)
    }

    /// `cuMemcpyHtoDAsync`: the destination is checked now, the copy runs in stream order;
    /// pageable source bytes are taken at once (the driver stages them).
    ///
    /// # Safety
    ///
    /// `src .. src + len` is live host memory (the driver call's contract).
    #[allow(clippy::too_many_arguments)] // the driver call's arguments, one for one
    pub(super) unsafe fn memcpy_htod_async(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        dst: DevicePtr,
        src: usize,
        len: usize,
        stream: StreamHandle,
    ) -> Result<(), u32> {
        let Some(device) = self.async_range(pid, note, ctx, dst, len)? else {
            return Ok(());
        };
        let source = if self.pinned_range(pid, src, len) {
            Source::Pinned(src)
        } else {
            let mut b = vec![0u8; len];
            // SAFETY: the caller's live host memory (this function's contract).
            unsafe {
                std::ptr::copy(
                    std::ptr::with_exposed_provenance::<u8>(src),
                    b.as_mut_ptr(),
                    len,
                )
            };
            Source::Snapshot(b)
        };
        self.enqueue(
            pid,
            device,
            stream,
            Work::HtoD {
                dst: dst.0,
                src: source,
                len,
            },
        )
    }

    /// `cuMemcpyDtoHAsync`: to pageable memory the driver copies synchronously (the stream's
    /// earlier work runs first); to page-locked memory in stream order.
    #[allow(clippy::too_many_arguments)] // the driver call's arguments, one for one
    pub(super) fn memcpy_dtoh_async(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        dst: usize,
        src: DevicePtr,
        len: usize,
        stream: StreamHandle,
    ) -> Result<(), u32> {
        let Some(device) = self.async_range(pid, note, ctx, src, len)? else {
            return Ok(());
        };
        let pinned = self.pinned_range(pid, dst, len);
        self.enqueue(
            pid,
            device,
            stream,
            Work::DtoH {
                dst,
                src: src.0,
                len,
            },
        )?;
        if pinned {
            return Ok(());
        }
        let k = self.stream_key(pid, device, stream)?;
        self.wait_until(pid, |w| w.drained(pid, k))
    }

    /// `cuMemcpyDtoDAsync`.
    #[allow(clippy::too_many_arguments)] // the driver call's arguments, one for one
    pub(super) fn memcpy_dtod_async(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        dst: DevicePtr,
        src: DevicePtr,
        len: usize,
        stream: StreamHandle,
    ) -> Result<(), u32> {
        let Some(device) = self.async_range(pid, note, ctx, dst, len)? else {
            return Ok(());
        };
        self.resolve(Accessor { pid, device }, src.0, len)?;
        self.enqueue(
            pid,
            device,
            stream,
            Work::DtoD {
                dst: dst.0,
                src: src.0,
                len,
            },
        )
    }

    /// `cuMemsetD8Async`.
    #[allow(clippy::too_many_arguments)] // the driver call's arguments, one for one
    pub(super) fn memset_d8_async(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        dst: DevicePtr,
        value: u8,
        len: usize,
        stream: StreamHandle,
    ) -> Result<(), u32> {
        let Some(device) = self.async_range(pid, note, ctx, dst, len)? else {
            return Ok(());
        };
        self.enqueue(
            pid,
            device,
            stream,
            Work::Memset {
                dst: dst.0,
                value,
                len,
            },
        )
    }

    /// The common start of an asynchronous copy or set: notes the call, checks the context and
    /// the device range `ptr .. ptr + len`; `None` for zero bytes (nothing to queue).
    pub(super) fn async_range(
        &mut self,
        pid: usize,
        note: &mut Note,
        ctx: ContextHandle,
        ptr: DevicePtr,
        len: usize,
    ) -> Result<Option<usize>, u32> {
        note.ptr = Some(ptr);
        note.bytes = Some(len);
        let device = context(self, pid, ctx, note)?;
        if len == 0 {
            return Ok(None);
        }
        self.resolve(Accessor { pid, device }, ptr.0, len)?;
        Ok(Some(device))
    }
}
