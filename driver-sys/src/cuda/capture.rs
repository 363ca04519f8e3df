//! [`CudaDriver`](super::CudaDriver)'s calls of one area: stream capture and graphs.

use super::*;

impl Calls<'_> {
    /// [cuStreamBeginCapture](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
    pub(super) fn stream_begin_capture(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
        mode: CaptureMode,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the driver validates the stream handle and refuses the legacy stream.
        check("cuStreamBeginCapture", unsafe {
            sys::cuStreamBeginCapture_v2(cu_stream(stream), cu_capture_mode(mode))
        })
    }

    /// [cuStreamEndCapture](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
    pub(super) fn stream_end_capture(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
    ) -> Result<GraphHandle, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: `graph` is a valid out-parameter; the driver validates the stream handle.
        check("cuStreamEndCapture", unsafe {
            sys::cuStreamEndCapture(cu_stream(stream), &mut graph)
        })?;
        Ok(GraphHandle(graph as usize as u64))
    }

    /// [cuStreamGetCaptureInfo](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
    pub(super) fn stream_capture_status(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
    ) -> Result<CaptureStatus, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let mut id: sys::cuuint64_t = 0;
        // SAFETY: both out-parameters are valid, the others are null (the driver skips null
        // outputs); the driver validates the stream handle.
        check("cuStreamGetCaptureInfo", unsafe {
            sys::cuStreamGetCaptureInfo_v3(
                cu_stream(stream),
                &mut status,
                &mut id,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        })?;
        Ok(match status {
            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => CaptureStatus::None,
            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => {
                CaptureStatus::Active { id }
            }
            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED => {
                CaptureStatus::Invalidated { id }
            }
        })
    }

    /// [cuThreadExchangeStreamCaptureMode](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
    pub(super) fn thread_exchange_capture_mode(
        &self,
        mode: CaptureMode,
    ) -> Result<CaptureMode, DriverError> {
        let mut m = cu_capture_mode(mode);
        // SAFETY: `m` is a valid in/out parameter.
        check("cuThreadExchangeStreamCaptureMode", unsafe {
            sys::cuThreadExchangeStreamCaptureMode(&mut m)
        })?;
        Ok(match m {
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL => CaptureMode::Global,
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL => {
                CaptureMode::ThreadLocal
            }
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED => CaptureMode::Relaxed,
        })
    }

    /// [cuGraphInstantiateWithFlags](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html)
    pub(super) fn graph_instantiate(
        &self,
        ctx: ContextHandle,
        graph: GraphHandle,
    ) -> Result<GraphExecHandle, DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: `exec` is a valid out-parameter; the driver validates the graph handle.
        check("cuGraphInstantiateWithFlags", unsafe {
            sys::cuGraphInstantiateWithFlags(&mut exec, graph.0 as usize as sys::CUgraph, 0)
        })?;
        Ok(GraphExecHandle(exec as usize as u64))
    }

    /// [cuGraphLaunch](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html)
    pub(super) fn graph_launch(
        &self,
        ctx: ContextHandle,
        exec: GraphExecHandle,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the driver validates both handles.
        check("cuGraphLaunch", unsafe {
            sys::cuGraphLaunch(exec.0 as usize as sys::CUgraphExec, cu_stream(stream))
        })
    }

    /// [cuGraphExecDestroy](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html)
    pub(super) unsafe fn graph_exec_destroy(
        &self,
        ctx: ContextHandle,
        exec: GraphExecHandle,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the caller does not use `exec` again (this method's contract).
        check("cuGraphExecDestroy", unsafe {
            sys::cuGraphExecDestroy(exec.0 as usize as sys::CUgraphExec)
        })
    }

    /// [cuGraphDestroy](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html)
    pub(super) unsafe fn graph_destroy(
        &self,
        ctx: ContextHandle,
        graph: GraphHandle,
    ) -> Result<(), DriverError> {
        let _scope = CtxScope::enter(ctx)?;
        // SAFETY: the caller does not use `graph` again (this method's contract).
        check("cuGraphDestroy", unsafe {
            sys::cuGraphDestroy(graph.0 as usize as sys::CUgraph)
        })
    }
}
