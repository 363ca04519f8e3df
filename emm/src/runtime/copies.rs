//! The copies and sets of [`Context`]: between device memory, page-locked and pageable host
//! memory and other devices, synchronous and in a stream's order.
#![allow(unsafe_code)]

use driver_sys::{DevicePtr, DriverError, HostPtr};

use super::context::Context;
use crate::contract::factory::ManagerContext;
use crate::error::EmmError;
use crate::memory::host::HostMemory;
use crate::memory::liveness::LiveGuard;
use crate::memory::pointer::MemoryPointer;
use crate::objects::{InFlight, Stream, check_same_context};

impl Context {
    /// Enters the context's liveness for `what` (refused once the context is gone).
    pub(super) fn enter(&self, what: &'static str) -> Result<LiveGuard<'_>, EmmError> {
        self.inner.cx.enter(what)
    }

    /// Copies the first `bytes` bytes of page-locked host memory `src` to `dst` (a true pinned
    /// transfer: the driver reads the pinned pages directly).
    pub fn copy_pinned_to_device(
        &self,
        dst: &MemoryPointer,
        src: &HostMemory,
        bytes: usize,
    ) -> Result<(), EmmError> {
        if bytes > src.size() {
            return Err(EmmError::OutOfBounds {
                what: "copy from pinned memory",
                start: 0,
                end: bytes,
                size: src.size(),
            });
        }
        // The device memory first, then the host memory (the order a reset takes them in).
        let held = self.inner.cx.use_memory();
        src.access("copy from pinned memory", || {
            // SAFETY: `src` is page-locked memory of at least `bytes` bytes (checked above),
            // kept allocated during the access, to which emm hands out no references; the
            // slice lives only for this synchronous copy.
            let host = unsafe { std::slice::from_raw_parts(src.host_ptr().0 as *const u8, bytes) };
            self.inner.cx.copy_to_device(&held, dst, host)
        })?
    }

    /// Copies the first `bytes` bytes of `src` into page-locked host memory `dst`.
    pub fn copy_device_to_pinned(
        &self,
        dst: &HostMemory,
        src: &MemoryPointer,
        bytes: usize,
    ) -> Result<(), EmmError> {
        if bytes > dst.size() {
            return Err(EmmError::OutOfBounds {
                what: "copy into pinned memory",
                start: 0,
                end: bytes,
                size: dst.size(),
            });
        }
        // The device memory first, then the host memory (the order a reset takes them in).
        let held = self.inner.cx.use_memory();
        dst.access("copy into pinned memory", || {
            // SAFETY: `dst` is page-locked memory of at least `bytes` bytes (checked above),
            // kept allocated during the access, to which emm hands out no references; the
            // slice lives only for this synchronous copy.
            let host =
                unsafe { std::slice::from_raw_parts_mut(dst.host_ptr().0 as *mut u8, bytes) };
            self.inner.cx.copy_to_host(&held, host, src)
        })?
    }

    /// Sets the first `bytes` bytes of `dst` to `value` (`cuMemsetD8`, synchronous; Numba's
    /// `device_memset`). Works on device memory and on the device side of mapped memory.
    pub fn memset(&self, dst: &MemoryPointer, value: u8, bytes: usize) -> Result<(), EmmError> {
        const WHAT: &str = "memset";
        let held = self.inner.cx.use_memory();
        let _live = self.inner.cx.enter_copy(&held, WHAT, dst, bytes)?;
        // SAFETY: `enter_copy` checked that `dst` is live memory of this context with room for
        // `bytes`; `_live` keeps the context alive; emm hands out no references to device or
        // mapped memory.
        unsafe {
            self.inner
                .cx
                .driver
                .memset_d8(self.inner.cx.context, dst.device_ptr(), value, bytes)
        }
        .map_err(|e| EmmError::driver(WHAT, self.inner.cx.device, e))
    }

    /// Copies the first `bytes` bytes of `src` to the start of `dst`, synchronously
    /// (`cuMemcpyDtoD`; Numba's `device_to_device`). The ranges must not overlap.
    pub fn copy_device(
        &self,
        dst: &MemoryPointer,
        src: &MemoryPointer,
        bytes: usize,
    ) -> Result<(), EmmError> {
        const WHAT: &str = "device to device copy";
        let (d, s) = (dst.device_ptr().0, src.device_ptr().0);
        if bytes > 0 && d < s + bytes as u64 && s < d + bytes as u64 {
            return Err(EmmError::OverlappingCopy { bytes });
        }
        let held = self.inner.cx.use_memory();
        let _live = self.inner.cx.enter_copy(&held, WHAT, src, bytes)?;
        self.inner
            .cx
            .copy_device_to_device(&held, dst.device_ptr(), src.device_ptr(), bytes, dst)
    }

    /// Copies the first `bytes` bytes of `src`, memory of `src_ctx` (another device's context,
    /// or this one), to the start of `dst`, memory of this context, synchronously: a
    /// device-to-device copy through unified addressing (`cuMemcpyDtoD`), which the driver
    /// runs directly between peers and stages through host memory between devices that are
    /// not. Both contexts stay alive for the copy. Stream-ordered pool memory is reached only
    /// from devices its pool grants access; copy it through page-locked host memory instead
    /// (`emm_array`'s staged route does).
    pub fn copy_peer(
        &self,
        dst: &MemoryPointer,
        src_ctx: &Context,
        src: &MemoryPointer,
        bytes: usize,
    ) -> Result<(), EmmError> {
        if src_ctx.inner.cx.context == self.inner.cx.context {
            return self.copy_device(dst, src, bytes);
        }
        let (from, to) = (&src_ctx.inner.cx, &self.inner.cx);
        // Both contexts' memory is held, taken in one order by every peer copy (the contexts'
        // handles, ascending): two copies in opposite directions, each waiting behind a reset
        // of the other's context, would otherwise wait for each other.
        let (src_held, dst_held) = if from.context.raw() < to.context.raw() {
            let src_held = from.use_memory();
            (src_held, to.use_memory())
        } else {
            let dst_held = to.use_memory();
            (from.use_memory(), dst_held)
        };
        let _src_live = from.enter_copy(&src_held, "peer copy (source)", src, bytes)?;
        tracing::trace!(from = %src_ctx.device(), to = %self.device(), bytes, "peer copy");
        to.enable_peer_access_to(from);
        to.copy_device_to_device(&dst_held, dst.device_ptr(), src.device_ptr(), bytes, dst)
    }

    /// Base and end address of the whole allocation that `memory` lies in, as the driver
    /// reports them (Numba's `device_extents`).
    pub fn device_extents(
        &self,
        memory: &MemoryPointer,
    ) -> Result<(DevicePtr, DevicePtr), EmmError> {
        let _held = self.inner.cx.use_memory();
        self.check_usable("device_extents", memory)?;
        let _live = self.enter("device_extents")?;
        let (base, size) = self
            .inner
            .cx
            .driver
            .mem_get_address_range(self.inner.cx.context, memory.device_ptr())
            .map_err(|e| EmmError::driver("device_extents", self.inner.cx.device, e))?;
        Ok((base, DevicePtr(base.0 + size as u64)))
    }

    /// Allocates device memory through the manager and copies `src` into it.
    pub fn to_device(&self, src: &[u8]) -> Result<MemoryPointer, EmmError> {
        let mem = self.memalloc(src.len())?;
        self.copy_to_device(&mem, src)?;
        Ok(mem)
    }

    /// Copies `src` to the start of `dst`, synchronously. `src` may be shorter than `dst`.
    pub fn copy_to_device(&self, dst: &MemoryPointer, src: &[u8]) -> Result<(), EmmError> {
        let held = self.inner.cx.use_memory();
        self.inner.cx.copy_to_device(&held, dst, src)
    }

    /// Copies the first `dst.len()` bytes of `src` into `dst`, synchronously.
    pub fn copy_to_host(&self, dst: &mut [u8], src: &MemoryPointer) -> Result<(), EmmError> {
        let held = self.inner.cx.use_memory();
        self.inner.cx.copy_to_host(&held, dst, src)
    }

    /// Refuses memory of another context, or memory freed or asleep, for `what`.
    pub(super) fn check_usable(
        &self,
        what: &'static str,
        memory: &MemoryPointer,
    ) -> Result<(), EmmError> {
        self.inner.cx.check_usable(what, memory)
    }

    /// Queues a copy of `dst.size()` bytes from page-locked `src` to `dst` on `stream`
    /// (`cuMemcpyHtoDAsync`) and returns at once. `src` travels with the work: the returned
    /// [`InFlight`] gives it back from [`wait`](InFlight::wait). Pageable memory is refused
    /// by type: [`copy_to_device_on`](Self::copy_to_device_on) takes a slice.
    pub fn copy_to_device_async(
        &self,
        dst: &MemoryPointer,
        src: HostMemory,
        stream: &Stream,
    ) -> Result<InFlight<HostMemory>, EmmError> {
        const WHAT: &str = "copy to device (async)";
        self.refuse_captured(WHAT, stream)?;
        let len = dst.size();
        host_fits(WHAT, len, src.size())?;
        // Memory already freed under `src` (its context torn down, its pool reset) is refused.
        src.access(WHAT, || ())?;
        let (at, keep) = (src.host_ptr(), vec![dst.clone()]);
        self.queue(WHAT, stream, (dst, len), (src, keep), |cx| {
            // SAFETY: `queue` checked `dst` (live, this context, `len` bytes) and entered the
            // context; `src` is page-locked memory of at least `len` bytes that the returned
            // `InFlight` owns until the copy is done (or leaks, if forgotten).
            unsafe {
                cx.driver
                    .memcpy_htod_async(cx.context, dst.device_ptr(), at, len, stream.handle())
            }
        })
    }

    /// Queues a copy of `src.size()` bytes from `src` into page-locked `dst` on `stream`
    /// (`cuMemcpyDtoHAsync`) and returns at once; [`wait`](InFlight::wait) gives `dst` back,
    /// holding the bytes.
    pub fn copy_to_host_async(
        &self,
        dst: HostMemory,
        src: &MemoryPointer,
        stream: &Stream,
    ) -> Result<InFlight<HostMemory>, EmmError> {
        const WHAT: &str = "copy to host (async)";
        self.refuse_captured(WHAT, stream)?;
        let len = src.size();
        host_fits(WHAT, len, dst.size())?;
        // Memory already freed under `dst` is refused, as in `copy_to_device_async`.
        dst.access(WHAT, || ())?;
        let (at, keep) = (dst.host_ptr(), vec![src.clone()]);
        self.queue(WHAT, stream, (src, len), (dst, keep), |cx| {
            // SAFETY: as for `copy_to_device_async`, with the roles swapped: `dst` is owned by
            // the returned `InFlight`, and nothing reads or writes it until `wait` gives it back.
            unsafe {
                cx.driver
                    .memcpy_dtoh_async(cx.context, at, src.device_ptr(), len, stream.handle())
            }
        })
    }

    /// Queues a copy of `src.size()` bytes from `src` to `dst` on `stream`
    /// (`cuMemcpyDtoDAsync`); both stay alive until it is done.
    pub fn copy_device_async(
        &self,
        dst: &MemoryPointer,
        src: &MemoryPointer,
        stream: &Stream,
    ) -> Result<InFlight<()>, EmmError> {
        const WHAT: &str = "copy device to device (async)";
        let len = src.size();
        let keep = vec![dst.clone(), src.clone()];
        self.queue(WHAT, stream, (dst, len), ((), keep), |cx| {
            // SAFETY: both pointers are live memory of this context (checked), `len` bytes fit
            // both (`queue` checked `dst`; `len` is `src`'s size), and the returned `InFlight`
            // keeps both alive until the copy is done.
            unsafe {
                cx.driver.memcpy_dtod_async(
                    cx.context,
                    dst.device_ptr(),
                    src.device_ptr(),
                    len,
                    stream.handle(),
                )
            }
        })
    }

    /// Queues setting every byte of `dst` to `value` on `stream` (`cuMemsetD8Async`).
    pub fn memset_async(
        &self,
        dst: &MemoryPointer,
        value: u8,
        stream: &Stream,
    ) -> Result<InFlight<()>, EmmError> {
        const WHAT: &str = "memset (async)";
        let len = dst.size();
        self.queue(WHAT, stream, (dst, len), ((), vec![dst.clone()]), |cx| {
            // SAFETY: `dst` is live memory of this context (checked), kept alive by the
            // returned `InFlight` until the set is done.
            unsafe {
                cx.driver
                    .memset_d8_async(cx.context, dst.device_ptr(), value, len, stream.handle())
            }
        })
    }

    /// Copies `src` (any host memory, pageable included) to the start of `dst` in `stream`'s
    /// order, and returns once it is done: the driver stages pageable memory synchronously, so
    /// this is a stream-ordered copy, not an overlapping one (for overlap, give
    /// [`copy_to_device_async`](Self::copy_to_device_async) page-locked memory).
    pub fn copy_to_device_on(
        &self,
        dst: &MemoryPointer,
        src: &[u8],
        stream: &Stream,
    ) -> Result<(), EmmError> {
        const WHAT: &str = "copy to device (on a stream)";
        self.refuse_captured(WHAT, stream)?;
        let at = HostPtr(src.as_ptr() as usize);
        self.queue(
            WHAT,
            stream,
            (dst, src.len()),
            ((), vec![dst.clone()]),
            |cx| {
                // SAFETY: `dst` checked by `queue`; `src` is borrowed until this function returns,
                // and it returns only after the copy is done (the wait below).
                unsafe {
                    cx.driver.memcpy_htod_async(
                        cx.context,
                        dst.device_ptr(),
                        at,
                        src.len(),
                        stream.handle(),
                    )
                }
            },
        )?
        .wait()
    }

    /// Copies the first `dst.len()` bytes of `src` into `dst` (any host memory) in `stream`'s
    /// order, and returns once it is done.
    pub fn copy_to_host_on(
        &self,
        dst: &mut [u8],
        src: &MemoryPointer,
        stream: &Stream,
    ) -> Result<(), EmmError> {
        const WHAT: &str = "copy to host (on a stream)";
        self.refuse_captured(WHAT, stream)?;
        let (at, len) = (HostPtr(dst.as_mut_ptr() as usize), dst.len());
        self.queue(WHAT, stream, (src, len), ((), vec![src.clone()]), |cx| {
            // SAFETY: `src` checked by `queue`; `dst` is exclusively borrowed until this function
            // returns, and it returns only after the copy is done (the wait below).
            unsafe {
                cx.driver
                    .memcpy_dtoh_async(cx.context, at, src.device_ptr(), len, stream.handle())
            }
        })?
        .wait()
    }

    /// Queues one piece of stream work on `mem`'s first `len` bytes: checks the stream, `mem`
    /// and every other pointer in `keep` (the device memory the work uses), enters the context
    /// for `call` (the driver call), and marks the work's end in an [`InFlight`] holding
    /// `value` (what it hands back) and `keep`.
    fn queue<T>(
        &self,
        what: &'static str,
        stream: &Stream,
        (mem, len): (&MemoryPointer, usize),
        (value, keep): (T, Vec<MemoryPointer>),
        call: impl FnOnce(&ManagerContext) -> Result<(), DriverError>,
    ) -> Result<InFlight<T>, EmmError> {
        check_same_context(&self.inner.cx, stream.context(), what)?;
        let cx = &self.inner.cx;
        let queued = {
            let held = cx.use_memory();
            for other in &keep {
                cx.check_usable(what, other)?;
            }
            let _live = cx.enter_copy(&held, what, mem, len)?;
            call(cx)
        };
        queued.map_err(|e| cx.driver_error(what, e))?;
        self.in_flight(stream, value, keep)
    }

    /// Refuses a copy with host memory on a captured stream: the graph would read or write
    /// the host buffer at every launch, long after the copy's buffer came back.
    fn refuse_captured(&self, what: &'static str, stream: &Stream) -> Result<(), EmmError> {
        let captured = self.inner.cx.stream_is_captured(stream.handle());
        if captured.map_err(|e| self.inner.cx.driver_error(what, e))? {
            return Err(EmmError::InvalidArgument {
                what,
                reason: "the stream is being captured into a graph, which would copy from or \
                         to the host buffer at every launch after the buffer is handed back; \
                         capture device-to-device copies and sets only, and copy host memory \
                         outside the capture"
                    .into(),
            });
        }
        Ok(())
    }

    /// Marks the end of work just queued on `stream` with an event, in an [`InFlight`] that
    /// holds `value` and `keep`. If the event cannot be made, the stream is synchronised
    /// before the error returns, so nothing is freed under the work. Work recorded into a
    /// capture gets no event ([`InFlight::recorded`]): it runs at the graph's launches, and
    /// the memory it uses is kept for the graph (`GraphRoutes::keep_captured`).
    fn in_flight<T>(
        &self,
        stream: &Stream,
        value: T,
        keep: Vec<MemoryPointer>,
    ) -> Result<InFlight<T>, EmmError> {
        // A stream the driver cannot say about is taken as running: the event and its wait
        // then report what is wrong.
        if self.inner.cx.stream_is_captured(stream.handle()) == Ok(true) {
            // The graph's launches use the memory: it lives as long as the graph.
            self.inner.graph_routes.keep_captured(stream.handle(), keep);
            return Ok(InFlight::recorded(value, Vec::new()));
        }
        let marked = self.create_event(false).and_then(|e| {
            stream.record(&e)?;
            Ok(e)
        });
        match marked {
            Ok(event) => Ok(InFlight::new(event, value, keep)),
            Err(e) => {
                if stream.synchronize().is_err() {
                    // The work may still run: leak what it uses.
                    std::mem::forget(value);
                    std::mem::forget(keep);
                }
                Err(e)
            }
        }
    }
}

/// Refuses host memory smaller than the `len` bytes a copy moves.
fn host_fits(what: &'static str, len: usize, size: usize) -> Result<(), EmmError> {
    if len <= size {
        Ok(())
    } else {
        Err(EmmError::OutOfBounds {
            what,
            start: 0,
            end: len,
            size,
        })
    }
}
