//! [`SimDriver`]'s `Driver` impl, made from the table of driver calls
//! (`driver_sys::driver_calls!`): each call is logged, may be faulted, and runs the model's
//! rule of the same name (`World`'s methods, one file per part of the model) with the same
//! arguments. The calls the table marks `[custom]` do more, and run a method of [`SimCalls`]
//! here instead.
#![allow(unsafe_code)]

use std::ops::Deref;

use driver_sys::{
    CaptureMode, ContextHandle, DevicePtr, Driver, DriverError, EventHandle, HostPtr, MemLocation,
    MemPoolHandle, ModuleHandle, StreamHandle,
};

use super::SimDriver;
use super::log::Op;
use super::world::{Object, World, context, plausible_image};

/// The table's callback that implements [`Driver`] for [`SimDriver`].
macro_rules! sim_driver_impl {
    (ops [$($ops:tt)*] methods [$(
        $(#[$doc:meta])*
        $(@[$attr:meta])*
        $([$unsafe:ident])? fn $name:ident $(<$lt:lifetime>)? ($($arg:ident : [$($ty:tt)*]),*) -> [$($ret:tt)*] => $op:ident $([$custom:ident])?;
    )*]) => {
        impl Driver for SimDriver {
            fn name(&self) -> &'static str {
                "sim"
            }

            $(
                $(#[$attr])*
                $($unsafe)? fn $name $(<$lt>)? (&self, $($arg: $($ty)*),*) -> Result<$($ret)*, DriverError> {
                    sim_call!($($custom)? ; $($unsafe)? ; self, $op, $name, $($arg),*)
                }
            )*
        }
    };
}

/// One call's body: the model's rule of the same name with the same arguments, logged and
/// faultable as operation `$op`; or, for a `[custom]` call, the method of [`SimCalls`].
macro_rules! sim_call {
    (custom ; $($unsafe:ident)? ; $s:ident, $op:ident, $name:ident, $($arg:ident),*) => {
        driver_sys::__forward_call!($($unsafe)? ; SimCalls($s).$name($($arg),*))
    };
    (; $($unsafe:ident)? ; $s:ident, $op:ident, $name:ident, $($arg:ident),*) => {
        $s.call(Op::$op, |w, pid, note| w.$name(pid, note, $($arg),*))
    };
}

driver_sys::driver_calls!(sim_driver_impl);

/// The simulator's calls that do more than run one rule with their arguments: copies (through
/// the model's stores), creations and destructions of objects, the pool calls that a capture
/// changes, and the few that set what the call log records themselves.
struct SimCalls<'a>(&'a SimDriver);

impl Deref for SimCalls<'_> {
    type Target = SimDriver;

    fn deref(&self) -> &SimDriver {
        self.0
    }
}

impl SimCalls<'_> {
    unsafe fn memcpy_htod(
        &self,
        ctx: ContextHandle,
        dst: DevicePtr,
        src: &[u8],
    ) -> Result<(), DriverError> {
        self.copy_call(Op::MemcpyHtoD, ctx, dst, src.len(), |w, by| {
            // SAFETY: `Driver::memcpy_htod`'s contract: the destination is live memory of the
            // caller's that nothing else touches during the call.
            unsafe { w.write(by, dst.0, src) }
        })
    }

    unsafe fn memcpy_dtoh(
        &self,
        ctx: ContextHandle,
        dst: &mut [u8],
        src: DevicePtr,
    ) -> Result<(), DriverError> {
        let len = dst.len();
        self.copy_call(Op::MemcpyDtoH, ctx, src, len, |w, by| {
            // SAFETY: `Driver::memcpy_dtoh`'s contract: the source is live memory of the caller's
            // that nothing writes during the call.
            unsafe { w.read(by, src.0, dst) }
        })
    }

    fn mem_pool_create_limited(
        &self,
        ctx: ContextHandle,
        location: MemLocation,
        ipc: bool,
        max_size: usize,
    ) -> Result<MemPoolHandle, DriverError> {
        self.call(Op::MemPoolCreate, |w, pid, note| {
            note.bytes = (max_size > 0).then_some(max_size);
            w.mem_pool_create(pid, note, ctx, location, ipc, max_size)
        })
    }

    fn mem_alloc_from_pool_async(
        &self,
        ctx: ContextHandle,
        pool: MemPoolHandle,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<DevicePtr, DriverError> {
        self.call(Op::MemAllocFromPoolAsync, |w, pid, note| {
            w.pool_alloc_captured(pid, note, ctx, pool, bytes, stream)
        })
    }

    unsafe fn mem_free_async(
        &self,
        ctx: ContextHandle,
        ptr: DevicePtr,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.call(Op::MemFreeAsync, |w, pid, note| {
            w.pool_free_captured(pid, note, ctx, ptr, stream)
        })
    }

    unsafe fn memcpy_dtod(
        &self,
        ctx: ContextHandle,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
    ) -> Result<(), DriverError> {
        self.copy_call(Op::MemcpyDtoD, ctx, dst, bytes, |w, by| {
            let mut staging = vec![0u8; bytes];
            // SAFETY: `Driver::memcpy_dtod`'s contract: both ranges are live memory of the
            // caller's that nothing else writes during the call.
            unsafe {
                w.read(by, src.0, &mut staging)?;
                w.write(by, dst.0, &staging)
            }
        })
    }

    unsafe fn memset_d8(
        &self,
        ctx: ContextHandle,
        dst: DevicePtr,
        value: u8,
        bytes: usize,
    ) -> Result<(), DriverError> {
        self.copy_call(Op::MemsetD8, ctx, dst, bytes, |w, by| {
            // SAFETY: `Driver::memset_d8`'s contract: the range is live memory of the caller's
            // that nothing else uses during the call.
            unsafe { w.write(by, dst.0, &vec![value; bytes]) }
        })
    }

    fn stream_create(&self, ctx: ContextHandle, flags: u32) -> Result<StreamHandle, DriverError> {
        self.create_stream(Op::StreamCreate, ctx, flags, 0)
    }

    fn stream_create_with_priority(
        &self,
        ctx: ContextHandle,
        flags: u32,
        priority: i32,
    ) -> Result<StreamHandle, DriverError> {
        self.create_stream(Op::StreamCreateWithPriority, ctx, flags, priority)
    }

    fn stream_priority_range(&self, ctx: ContextHandle) -> Result<(i32, i32), DriverError> {
        self.call(Op::CtxGetStreamPriorityRange, |w, pid, note| {
            context(w, pid, ctx, note)?;
            Ok(w.priority_range())
        })
    }

    fn thread_exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode, DriverError> {
        self.call(Op::ThreadExchangeStreamCaptureMode, |_, _, _| {
            Ok(World::thread_exchange_capture_mode(mode))
        })
    }

    unsafe fn memcpy_htod_async(
        &self,
        ctx: ContextHandle,
        dst: DevicePtr,
        src: HostPtr,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.call(Op::MemcpyHtoDAsync, |w, pid, note| {
            // SAFETY: `Driver::memcpy_htod_async`'s contract keeps the source live.
            unsafe { w.memcpy_htod_async(pid, note, ctx, dst, src.0, bytes, stream) }
        })
    }

    unsafe fn memcpy_dtoh_async(
        &self,
        ctx: ContextHandle,
        dst: HostPtr,
        src: DevicePtr,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.call(Op::MemcpyDtoHAsync, |w, pid, note| {
            w.memcpy_dtoh_async(pid, note, ctx, dst.0, src, bytes, stream)
        })
    }

    unsafe fn stream_destroy(
        &self,
        ctx: ContextHandle,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.destroy_object(Op::StreamDestroy, ctx, Object::Stream, stream.raw())
    }

    fn event_create(&self, ctx: ContextHandle, flags: u32) -> Result<EventHandle, DriverError> {
        let h = self.create_object(Op::EventCreate, ctx, Object::Event, flags & !0xf == 0)?;
        self.lock().add_event(self.pid, h, flags);
        Ok(crate::sim::made(EventHandle::from_raw, h))
    }

    unsafe fn event_destroy(
        &self,
        ctx: ContextHandle,
        event: EventHandle,
    ) -> Result<(), DriverError> {
        self.destroy_object(Op::EventDestroy, ctx, Object::Event, event.raw())
    }

    fn module_load_data(
        &self,
        ctx: ContextHandle,
        image: &[u8],
    ) -> Result<ModuleHandle, DriverError> {
        self.create_object(
            Op::ModuleLoadData,
            ctx,
            Object::Module,
            plausible_image(image),
        )
        .map(|h| crate::sim::made(ModuleHandle::from_raw, h))
    }

    unsafe fn module_unload(
        &self,
        ctx: ContextHandle,
        module: ModuleHandle,
    ) -> Result<(), DriverError> {
        self.destroy_object(Op::ModuleUnload, ctx, Object::Module, module.raw())
    }
}
