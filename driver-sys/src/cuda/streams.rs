//! [`CudaDriver`](super::CudaDriver)'s calls of one area: streams, events and host functions.

use super::*;

impl Calls<'_> {
    /// [cuStreamCreate](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
    pub(super) fn stream_create(
        &self,
        ctx: ContextHandle,
        flags: u32,
    ) -> Result<StreamHandle, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let mut stream = MaybeUninit::<sys::CUstream>::uninit();
        // SAFETY: `stream` is a valid place for one handle; the driver validates `flags`.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(stream.as_mut_ptr(), flags)
        })?;
        // SAFETY: the call succeeded and wrote `stream`.
        Ok(StreamHandle(unsafe { stream.assume_init() } as usize as u64))
    }

    /// [cuStreamDestroy](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
    pub(super) unsafe fn stream_destroy(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the caller destroys a stream of `ctx` once (trait contract).
        counted(
            unsafe { result::stream::destroy(stream.0 as usize as sys::CUstream) }
                .map_err(err("cuStreamDestroy")),
        )
    }

    /// [cuStreamCreateWithPriority](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
    pub(super) fn stream_create_with_priority(
        &self,
        ctx: ContextHandle,
        flags: u32,
        priority: i32,
    ) -> Result<StreamHandle, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let mut stream = MaybeUninit::<sys::CUstream>::uninit();
        // SAFETY: `stream` is a valid place for one handle; the driver validates the rest.
        check("cuStreamCreateWithPriority", unsafe {
            sys::cuStreamCreateWithPriority(stream.as_mut_ptr(), flags, priority)
        })?;
        // SAFETY: the call succeeded and wrote `stream`.
        Ok(StreamHandle(unsafe { stream.assume_init() } as usize as u64))
    }

    /// [cuCtxGetStreamPriorityRange](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__CTX.html)
    pub(super) fn stream_priority_range(
        &self,
        ctx: ContextHandle,
    ) -> Result<(i32, i32), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let (mut least, mut greatest) = (0i32, 0i32);
        // SAFETY: both are valid places for one int.
        check("cuCtxGetStreamPriorityRange", unsafe {
            sys::cuCtxGetStreamPriorityRange(&raw mut least, &raw mut greatest)
        })?;
        Ok((least, greatest))
    }

    /// [cuStreamGetPriority](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
    pub(super) fn stream_priority(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
    ) -> Result<i32, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let mut priority = 0i32;
        // SAFETY: `priority` is a valid place for one int; the driver validates the handle.
        check("cuStreamGetPriority", unsafe {
            sys::cuStreamGetPriority(cu_stream(stream), &raw mut priority)
        })?;
        Ok(priority)
    }

    /// [cuStreamQuery](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
    pub(super) fn stream_query(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
    ) -> Result<bool, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the driver validates the stream handle.
        check_ready("cuStreamQuery", unsafe {
            sys::cuStreamQuery(cu_stream(stream))
        })
    }

    /// [cuEventRecord](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html)
    pub(super) fn event_record(
        &self,
        ctx: ContextHandle,
        event: EventHandle,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the driver validates both handles.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(cu_event(event), cu_stream(stream))
        })
    }

    /// [cuStreamWaitEvent](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
    pub(super) fn stream_wait_event(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
        event: EventHandle,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the driver validates both handles; flags must be 0.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(cu_stream(stream), cu_event(event), 0)
        })
    }

    /// [cuEventQuery](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html)
    pub(super) fn event_query(
        &self,
        ctx: ContextHandle,
        event: EventHandle,
    ) -> Result<bool, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the driver validates the handle.
        check_ready("cuEventQuery", unsafe {
            sys::cuEventQuery(cu_event(event))
        })
    }

    /// [cuEventSynchronize](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html)
    pub(super) fn event_synchronize(
        &self,
        ctx: ContextHandle,
        event: EventHandle,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the driver validates the handle.
        check("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(cu_event(event))
        })
    }

    /// [cuEventElapsedTime](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html)
    pub(super) fn event_elapsed_time(
        &self,
        ctx: ContextHandle,
        start: EventHandle,
        end: EventHandle,
    ) -> Result<f32, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let mut ms = 0f32;
        // SAFETY: `ms` is a valid place for one float; the driver validates the handles.
        check("cuEventElapsedTime", unsafe {
            sys::cuEventElapsedTime_v2(&raw mut ms, cu_event(start), cu_event(end))
        })?;
        Ok(ms)
    }

    /// [cuLaunchHostFunc](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EXEC.html)
    pub(super) fn launch_host_func(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
        f: HostFn,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // A captured host function would run at every launch of the graph, and `f` runs once:
        // refused on a captured stream (the trait's rule).
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: `status` is a valid out-parameter; the driver validates the stream handle.
        check("cuStreamIsCapturing", unsafe {
            sys::cuStreamIsCapturing(cu_stream(stream), &mut status)
        })?;
        if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
            return Err(DriverError::from_code(
                "cuLaunchHostFunc",
                crate::code::STREAM_CAPTURE_UNSUPPORTED,
            )
            .with_detail(
                "the stream is being captured, and a host function given to the driver runs \
                 once, where a graph would run it at every launch",
            ));
        }
        let data = Box::into_raw(Box::new(f)).cast::<c_void>();
        // SAFETY: `run_host_fn` matches `CUhostFn`; `data` is a leaked `Box<HostFn>` it takes
        // back once when the driver calls it.
        let launched = check("cuLaunchHostFunc", unsafe {
            sys::cuLaunchHostFunc(cu_stream(stream), Some(run_host_fn), data)
        });
        if launched.is_err() {
            // SAFETY: the launch failed, so the driver will never call back with `data`.
            drop(unsafe { Box::from_raw(data.cast::<HostFn>()) });
        }
        launched
    }

    /// [cuStreamWaitValue32](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEMOP.html)
    pub(super) fn stream_wait_value32(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u32,
        flags: u32,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the driver validates the stream, the address and the flags; waiting reads
        // the word only.
        check("cuStreamWaitValue32", unsafe {
            sys::cuStreamWaitValue32_v2(cu_stream(stream), addr.0, value, flags)
        })
    }

    /// [cuStreamWriteValue32](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEMOP.html)
    pub(super) unsafe fn stream_write_value32(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u32,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the caller owns the word at `addr` (trait contract); the driver validates
        // the handles.
        check("cuStreamWriteValue32", unsafe {
            sys::cuStreamWriteValue32_v2(cu_stream(stream), addr.0, value, 0)
        })
    }

    /// [cuEventCreate](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html)
    pub(super) fn event_create(
        &self,
        ctx: ContextHandle,
        flags: u32,
    ) -> Result<EventHandle, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let mut event = MaybeUninit::<sys::CUevent>::uninit();
        // SAFETY: `event` is a valid place for one handle; the driver validates `flags`.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(event.as_mut_ptr(), flags)
        })?;
        // SAFETY: the call succeeded and wrote `event`.
        Ok(EventHandle(unsafe { event.assume_init() } as usize as u64))
    }

    /// [cuEventDestroy](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html)
    pub(super) unsafe fn event_destroy(
        &self,
        ctx: ContextHandle,
        event: EventHandle,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the caller destroys an event of `ctx` once (trait contract).
        counted(check("cuEventDestroy", unsafe {
            sys::cuEventDestroy_v2(event.0 as usize as sys::CUevent)
        }))
    }

    /// [cuCtxSynchronize](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__CTX.html)
    pub(super) fn ctx_synchronize(&self, ctx: ContextHandle) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: `ctx` is current on this thread for the call (`_scope`); the call takes no
        // pointer.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }

    /// [cuStreamSynchronize](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
    pub(super) fn stream_synchronize(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the driver validates the stream handle (0 is the legacy default stream).
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(stream.0 as usize as sys::CUstream)
        })
    }
}
