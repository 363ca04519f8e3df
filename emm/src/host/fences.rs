//! Fences for stream-ordered frees: events recorded on the streams that used a block when it
//! was freed, so that a manager hands the block to anyone else only once that work is done.
//! The events are recycled ([`Fences`]); a fence is a short list of them ([`Fence`]).

#![allow(unsafe_code)]

use driver_sys::{DevicePtr, DriverError, EventHandle, StreamHandle, event_flags};

use crate::contract::factory::ManagerContext;
use crate::memory::pointer::StreamUse;
use crate::sync::{Mutex, lock};

/// Events recorded on streams at one moment: done when all of them are.
///
/// A stream being captured when the fence was made gets no event then (an event recorded in a
/// capture is the graph's, and the driver refuses to query it): it is recorded once the capture
/// ended, so that the fence waits for the work queued there before the capture.
#[derive(Debug, Default)]
pub struct Fence {
    events: Vec<EventHandle>,
    after_capture: Vec<StreamHandle>,
}

/// A manager's recycled events (created without timing), and the operations on fences.
#[derive(Debug)]
pub struct Fences {
    cx: ManagerContext,
    idle: Mutex<Vec<EventHandle>>,
}

impl Fences {
    /// Fences for the context of `cx`.
    pub fn new(cx: &ManagerContext) -> Fences {
        Fences {
            cx: cx.clone(),
            idle: Mutex::new(Vec::new()),
        }
    }

    fn event(&self) -> Result<EventHandle, DriverError> {
        if let Some(e) = lock(&self.idle).pop() {
            return Ok(e);
        }
        self.cx
            .driver
            .event_create(self.cx.context, event_flags::DISABLE_TIMING)
    }

    /// Records an event on each of `streams` now. The caller holds the context's liveness.
    /// On an error the events recorded so far go back to the idle list.
    pub fn record(
        &self,
        streams: impl IntoIterator<Item = StreamHandle>,
    ) -> Result<Fence, DriverError> {
        let mut fence = Fence::default();
        for stream in streams {
            match self.cx.stream_is_captured(stream) {
                Ok(true) => {
                    fence.after_capture.push(stream);
                    continue;
                }
                Ok(false) => {}
                Err(e) => {
                    self.recycle(fence);
                    return Err(e);
                }
            }
            let recorded = self.event().and_then(|e| {
                fence.events.push(e);
                self.cx.driver.event_record(self.cx.context, e, stream)
            });
            if let Err(e) = recorded {
                self.recycle(fence);
                return Err(e);
            }
        }
        Ok(fence)
    }

    /// Records the events of the streams of `fence` whose capture ended; whether none is
    /// left captured.
    fn settle(&self, fence: &mut Fence) -> Result<bool, DriverError> {
        while let Some(&stream) = fence.after_capture.last() {
            if self.cx.stream_is_captured(stream)? {
                return Ok(false);
            }
            let e = self.event()?;
            if let Err(err) = self.cx.driver.event_record(self.cx.context, e, stream) {
                lock(&self.idle).push(e);
                return Err(err);
            }
            fence.events.push(e);
            fence.after_capture.pop();
        }
        Ok(true)
    }

    /// Whether every event of `fence` completed (no waiting); a stream still captured since
    /// the fence was made is not done.
    pub fn is_done(&self, fence: &mut Fence) -> Result<bool, DriverError> {
        if !self.settle(fence)? {
            return Ok(false);
        }
        for &e in &fence.events {
            if !self.cx.driver.event_query(self.cx.context, e)? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Waits until every event of `fence` completed; refused
    /// (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`) while a stream of it is still captured, which
    /// no wait can end.
    pub fn wait(&self, fence: &mut Fence) -> Result<(), DriverError> {
        if !self.settle(fence)? {
            return Err(DriverError::from_code(
                "cuEventSynchronize",
                driver_sys::code::STREAM_CAPTURE_UNSUPPORTED,
            )
            .with_detail(
                "a stream that used the memory is being captured; wait after the capture ends",
            ));
        }
        for &e in &fence.events {
            self.cx.driver.event_synchronize(self.cx.context, e)?;
        }
        Ok(())
    }

    /// Whether every event of `fence` completed: with `wait`, after waiting for them (so
    /// always, unless the driver fails); without, as they stand now.
    pub fn finished(&self, fence: &mut Fence, wait: bool) -> Result<bool, DriverError> {
        if wait {
            self.wait(fence).map(|()| true)
        } else {
            self.is_done(fence)
        }
    }

    /// Makes work queued on `stream` from now on wait for every event of `fence`.
    pub fn wait_on(&self, fence: &Fence, stream: StreamHandle) -> Result<(), DriverError> {
        for &e in &fence.events {
            self.cx
                .driver
                .stream_wait_event(self.cx.context, stream, e)?;
        }
        Ok(())
    }

    /// `cuMemFreeAsync` of `base` on `stream`, after making `stream` wait for the work
    /// queued so far on every other stream in `after` (events recorded there, reused at once:
    /// a wait captures the record it waits for). The caller holds the context's liveness and
    /// owns the allocation. On an error nothing was freed.
    ///
    /// # Safety
    ///
    /// `base` came from `cuMemAllocFromPoolAsync` in this context, is freed once, and is not
    /// used after this call except by work already queued on the streams of `after`.
    ///
    /// Always inlined, the wait out of line: a free with no streams to wait for (`after` is
    /// `None`, as for every `memalloc` pointer) is the driver's call alone.
    #[inline(always)]
    pub unsafe fn free_async_after(
        &self,
        base: DevicePtr,
        stream: StreamHandle,
        after: Option<&StreamUse>,
    ) -> Result<(), DriverError> {
        if let Some(streams) = after
            && streams.other_streams().next().is_some()
        {
            self.wait_for_others(streams, stream)?;
        }
        // SAFETY: the caller's contract; the freeing stream now waits for the other streams.
        unsafe { self.cx.driver.mem_free_async(self.cx.context, base, stream) }
    }

    /// Makes `stream` wait for the work queued so far on every other stream of `streams`
    /// (out of line: a free on the only stream that used the block does not carry it).
    #[inline(never)]
    fn wait_for_others(
        &self,
        streams: &StreamUse,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.order_after(streams.other_streams(), stream)
    }

    /// Makes work queued on `stream` from now on wait, on the GPU, for the work queued so far
    /// on each of `after` (events recorded there now, reused at once: a wait captures the
    /// record it waits for). The caller holds the context's liveness.
    pub fn order_after(
        &self,
        after: impl IntoIterator<Item = StreamHandle>,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        let fence = self.record(after)?;
        let waited = self.wait_on(&fence, stream);
        self.recycle(fence);
        waited
    }

    /// Waits, on the host, until the work queued so far on `stream` is done (an event
    /// recorded there now). The caller holds the context's liveness.
    pub fn wait_for_stream(&self, stream: StreamHandle) -> Result<(), DriverError> {
        let mut fence = self.record([stream])?;
        let waited = self.wait(&mut fence);
        self.recycle(fence);
        waited
    }

    /// Takes back the events of a fence that is done (or no longer needed).
    pub fn recycle(&self, fence: Fence) {
        lock(&self.idle).extend(fence.events);
    }

    /// Destroys the idle events (a reset). The caller holds the context's liveness; events
    /// of fences still held elsewhere are recycled later and destroyed by the next call.
    pub fn destroy_idle(&self) {
        let idle = std::mem::take(&mut *lock(&self.idle));
        for e in idle {
            // SAFETY: an idle event is recorded on nothing that is still to be waited for by
            // emm (its fence was recycled), owned by this list alone, and destroyed once; the
            // driver keeps a recorded event until its work completes.
            if let Err(err) = unsafe { self.cx.driver.event_destroy(self.cx.context, e) } {
                tracing::warn!(device = %self.cx.device, error = %err, "destroying a fence event failed");
            }
        }
    }
}

impl Drop for Fences {
    fn drop(&mut self) {
        if let Some(_live) = self.cx.liveness.enter() {
            self.destroy_idle();
        }
    }
}
