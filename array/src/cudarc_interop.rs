//! The seam between emm's arrays and kernels launched with cudarc (the `cudarc` feature).
//!
//! - A `&DeviceArray<T>` (or `&mut`) is a kernel argument of cudarc's launch builder: the
//!   kernel gets the first element's device address, as it gets a `CudaSlice`'s.
//! - [`DeviceArray::cudarc_view`] lends a contiguous array to cudarc's copies and memsets
//!   (`CudaStream::memcpy_htod`, `memcpy_dtoh`, `memset_zeros`) as a [`CudarcView`], which
//!   implements cudarc's `DevicePtr` and `DevicePtrMut`. Each such copy or memset has finished
//!   when cudarc's call returns (cudarc synchronises its stream as the view's guard drops): emm
//!   memory records no cudarc event, and the array may be dropped, its block handed to the
//!   next allocation, at once.
//! - [`emm_stream`] makes a cudarc stream an emm stream (allocations and stream-ordered frees
//!   on it keep the cudarc stream alive), and [`cudarc_stream`] lends an emm stream to cudarc.
//!
//! emm's memory does not record cudarc events: the order of work on it is the order of the
//! streams the host runtime uses, as with memory of any external allocator. Launch on the
//! stream the array was allocated on (or order the streams with events) as you would with
//! `CudaContext::disable_event_tracking`.
//!
//! The cudarc context must be the one emm uses: emm's real driver works in each device's
//! primary context, which is what `CudaContext::new(ordinal)` retains.

use std::sync::Arc;

use bytemuck::Pod;
use cudarc::driver::{
    CudaContext, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, LaunchArgs, PushKernelArg,
    SyncOnDrop, sys,
};
use emm::Context;
use emm::driver_sys::StreamHandle;

use crate::{ArrayError, DeviceArray, invalid};

/// A contiguous [`DeviceArray`] lent to cudarc's copies and memsets on one stream (see
/// [`DeviceArray::cudarc_view`]). It borrows the array, so the memory outlives it.
#[derive(Debug)]
pub struct CudarcView<'a, T: Pod> {
    array: &'a DeviceArray<T>,
    stream: &'a Arc<CudaStream>,
}

impl<T: Pod> DeviceArray<T> {
    /// Lends the array to cudarc's copies and memsets on `stream` (`CudaStream::memcpy_htod`
    /// into it, `memcpy_dtoh` out of it, `memset_zeros`). The array must be contiguous (a
    /// cudarc slice is one run of elements) and live in `stream`'s context.
    ///
    /// ```no_run
    /// use std::sync::Arc;
    /// use emm_array::{DeviceArray, Order};
    /// let driver = Arc::new(emm::driver_sys::CudaDriver::load()?);
    /// let runtime = emm::Runtime::new(driver)?;
    /// let ctx = runtime.context(0)?;
    /// let cuda = cudarc::driver::CudaContext::new(0)?; // the same primary context
    /// let stream = cuda.new_stream()?;
    /// let a = DeviceArray::<f32>::new(&ctx, &[256], Order::C)?;
    /// stream.memcpy_htod(&[1.0f32; 256], &mut a.cudarc_view(&stream)?)?;
    /// let mut back = [0f32; 256];
    /// stream.memcpy_dtoh(&a.cudarc_view(&stream)?, &mut back)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn cudarc_view<'a>(
        &'a self,
        stream: &'a Arc<CudaStream>,
    ) -> Result<CudarcView<'a, T>, ArrayError> {
        if !self.is_c_contiguous() && !self.is_f_contiguous() {
            return Err(ArrayError::NeedsCopy {
                what: "lending an array to cudarc",
                order: crate::Order::C,
            });
        }
        if let Some(m) = self.memory() {
            check_context("cudarc_view", m.context().raw(), stream.context())?;
            crate::refuse_sleeping("cudarc_view", m)?;
        }
        Ok(CudarcView {
            array: self,
            stream,
        })
    }
}

impl<T: Pod> DeviceSlice<T> for CudarcView<'_, T> {
    fn len(&self) -> usize {
        self.array.size()
    }

    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl<T: Pod> DevicePtr<T> for CudarcView<'_, T> {
    /// The array's address, and a guard that synchronises `stream` when cudarc's operation
    /// has queued its work: emm memory records no cudarc event, so nothing else would keep
    /// the array's block from being freed and handed out again while the work still runs.
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.array.addr, SyncOnDrop::sync_stream(stream))
    }
}

impl<T: Pod> DevicePtrMut<T> for CudarcView<'_, T> {
    /// As [`device_ptr`](DevicePtr::device_ptr): the work is done when the guard drops.
    fn device_ptr_mut<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.array.addr, SyncOnDrop::sync_stream(stream))
    }
}

// SAFETY: the argument pushed is a reference to the array's `addr` field, a `u64` (a
// `CUdeviceptr`, which cudarc passes by reference as `DeviceRepr`), borrowed for `'b`, which
// outlives the launch builder `'a`; the kernel sees the first element's address, valid while
// the array (and so its allocation) is borrowed.
unsafe impl<'a, 'b: 'a, T: Pod> PushKernelArg<&'b DeviceArray<T>> for LaunchArgs<'a> {
    /// Panics where the array's memory is asleep ([`emm::Context::sleep`]): the launch would
    /// fault on the device, and the fault would end the context.
    #[inline(always)]
    fn arg(&mut self, arg: &'b DeviceArray<T>) -> &mut Self {
        refuse_sleeping_argument(arg);
        self.arg(&arg.addr)
    }
}

/// Panics where `array`'s memory is asleep: a kernel given it would fault on the device.
#[inline(always)]
fn refuse_sleeping_argument<T: Pod>(array: &DeviceArray<T>) {
    if array.memory().is_some_and(emm::MemoryPointer::is_asleep) {
        sleeping_argument(array.addr);
    }
}

#[cold]
#[inline(never)]
fn sleeping_argument(addr: u64) -> ! {
    panic!(
        "a kernel argument (the array at {addr:#x}) is asleep (Context::sleep released its \
         memory), and the launch would fault on the device; call Context::wake before \
         launching work on it"
    )
}

// SAFETY: as for `&DeviceArray<T>` above; the exclusive borrow changes nothing for the launch.
unsafe impl<'a, 'b: 'a, T: Pod> PushKernelArg<&'b mut DeviceArray<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut DeviceArray<T>) -> &mut Self {
        refuse_sleeping_argument(arg);
        self.arg(&arg.addr)
    }
}

/// Makes a cudarc stream an emm stream of `ctx`: emm's stream-ordered allocations, frees and
/// copies on it run in its order, and the returned stream and every memory ordered on it
/// hold `stream` (an `Arc`), so it is not destroyed before the last stream-ordered free emm
/// queues on it. An error when the stream is of another context than `ctx`.
///
/// ```no_run
/// use std::sync::Arc;
/// use emm_array::{DeviceArray, Order};
/// let runtime = emm::Runtime::new(Arc::new(emm::driver_sys::CudaDriver::load()?))?;
/// let ctx = runtime.context(0)?;
/// let cuda = cudarc::driver::CudaContext::new(0)?;
/// let stream = cuda.new_stream()?;
/// let on = emm_array::cudarc::emm_stream(&ctx, &stream)?;
/// let a = DeviceArray::<f32>::new_on(&ctx, &[1024], Order::C, &on)?; // allocated in the stream's order
/// drop((a, on)); // freed on the stream, which stays alive until then
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn emm_stream(ctx: &Context, stream: &Arc<CudaStream>) -> Result<emm::Stream, ArrayError> {
    check_context("emm_stream", ctx.handle().raw(), stream.context())?;
    let owner: emm::plugin::HostOwner = Arc::clone(stream) as emm::plugin::HostOwner;
    // SAFETY: `handle` is the stream of `stream`, an `Arc<CudaStream>` of this context
    // (checked above) that cudarc destroys only when the last clone drops; `owner` is such a
    // clone, and the returned stream and every memory ordered on it hold it.
    Ok(unsafe {
        let handle = StreamHandle::from_raw(stream.cu_stream() as u64);
        ctx.external_stream_owned(handle, owner)
    })
}

/// Lends emm's `stream` to cudarc as a borrowed `CudaStream` of `cuda` (cudarc never destroys
/// it), to launch kernels in the order of emm's work on it. An error when `stream` is not of
/// `cuda`'s context. [`emm_stream`] is the safe direction: make the stream in cudarc.
///
/// # Safety
///
/// `stream` (and, for a stream emm created, the [`emm::Stream`] that owns it) outlives the
/// returned `Arc` and every clone of it, and nothing launched through it runs after the
/// stream is destroyed.
///
/// ```no_run
/// use std::sync::Arc;
/// let runtime = emm::Runtime::new(Arc::new(emm::driver_sys::CudaDriver::load()?))?;
/// let ctx = runtime.context(0)?;
/// let cuda = cudarc::driver::CudaContext::new(0)?;
/// let s = ctx.create_stream()?;
/// // SAFETY: `s` outlives `lent`, dropped first; nothing runs on it after.
/// let lent = unsafe { emm_array::cudarc::cudarc_stream(&cuda, &ctx, &s) }?;
/// lent.synchronize()?;
/// drop(lent);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub unsafe fn cudarc_stream(
    cuda: &Arc<CudaContext>,
    ctx: &Context,
    stream: &emm::Stream,
) -> Result<Arc<CudaStream>, ArrayError> {
    check_context("cudarc_stream", ctx.handle().raw(), cuda)?;
    if stream.device() != ctx.device() {
        return Err(invalid(
            "cudarc_stream",
            "the stream is of another device than the context; lend a stream of this context",
        ));
    }
    // SAFETY: the handle is a stream of `ctx`, which is `cuda`'s context (checked above); the
    // caller keeps it alive for as long as the wrapper is used, and cudarc does not destroy a
    // borrowed stream.
    Ok(unsafe { cuda.wrap_borrowed_stream(stream.handle().raw() as sys::CUstream) })
}

/// Refuses a cudarc context other than the emm one with `emm_ctx` as its `CUcontext`.
fn check_context(
    what: &'static str,
    emm_ctx: u64,
    cuda: &Arc<CudaContext>,
) -> Result<(), ArrayError> {
    let theirs = cuda.cu_ctx() as u64;
    if theirs != emm_ctx {
        return Err(ArrayError::Invalid {
            what,
            reason: format!(
                "the cudarc context ({theirs:#x}, device {}) is not the emm context ({emm_ctx:#x}); \
                 use CudaContext::new(ordinal), which retains the device's primary context as emm \
                 does, on the array's device",
                cuda.ordinal()
            ),
        });
    }
    Ok(())
}
