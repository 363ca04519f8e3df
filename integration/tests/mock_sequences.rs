//! Call sequences, checked with the mockall mock of the driver: exactly the driver calls NBEP 7
//! implies, in the order it implies (`cargo test -p integration --test mock_sequences`).
//!
//! Here rather than among emm's own tests: the mock (driver-mock's feature `mock`) is a large
//! build, which only this crate's tests ask for.
#![allow(unsafe_code)]

use std::sync::Arc;

use driver_mock::MockDriver;
use driver_sys::{ContextHandle, DeviceOrdinal, DevicePtr, DriverError, ErrorKind, MemInfo};
use emm::{EmmError, Runtime};
use mockall::{Sequence, predicate::eq};

// SAFETY: only the mock sees this context, and it dereferences nothing.
const CTX: ContextHandle = unsafe { ContextHandle::from_raw(0xc7c) };
const TOTAL: usize = 1 << 30;

/// A mock that lets a runtime start, create device 0's context and initialise it.
fn started() -> MockDriver {
    let mut m = MockDriver::new();
    m.expect_name().return_const("mock");
    m.expect_init().times(1).returning(|| Ok(()));
    m.expect_device_count().returning(|| Ok(1));
    m.expect_device_attribute().returning(|_, _| Ok(1));
    m.expect_primary_ctx_retain()
        .with(eq(DeviceOrdinal(0)))
        .times(1)
        .returning(|_| Ok(CTX));
    m.expect_mem_get_info().returning(|_| {
        Ok(MemInfo {
            free: TOTAL / 2,
            total: TOTAL,
        })
    });
    m
}

fn oom() -> DriverError {
    DriverError::from_kind("cuMemAlloc", ErrorKind::OutOfMemory)
}

#[test]
fn one_mem_alloc_per_memalloc() {
    let mut m = started();
    let next = std::sync::atomic::AtomicU64::new(0x1000);
    m.expect_mem_alloc()
        .with(eq(CTX), eq(4096))
        .times(3)
        .returning(move |_, _| {
            Ok(DevicePtr(
                next.fetch_add(0x1000, std::sync::atomic::Ordering::Relaxed),
            ))
        });
    m.expect_primary_ctx_release()
        .times(1)
        .returning(|_| Ok(()));
    // The three pointers are dropped before the runtime; their frees are queued, then the
    // runtime's teardown flushes them.
    m.expect_mem_free().times(3).returning(|_, _| Ok(()));
    let rt = Runtime::builder(Arc::new(m)).ignore_env().build().unwrap();
    let ctx = rt.context(0).unwrap();
    let ptrs: Vec<_> = (0..3).map(|_| ctx.memalloc(4096).unwrap()).collect();
    drop(ptrs);
}

#[test]
fn out_of_memory_is_retried_exactly_once() {
    let mut m = started();
    let mut seq = Sequence::new();
    m.expect_mem_alloc()
        .times(2)
        .in_sequence(&mut seq)
        .returning(|_, _| Err(oom()));
    m.expect_primary_ctx_release()
        .times(1)
        .returning(|_| Ok(()));
    let rt = Runtime::builder(Arc::new(m)).ignore_env().build().unwrap();
    let ctx = rt.context(0).unwrap();
    let err = ctx.memalloc(1 << 20).unwrap_err();
    match &err {
        EmmError::OutOfMemory {
            requested,
            free,
            total,
            flushed,
            ..
        } => {
            assert_eq!(
                (*requested, *free, *total, *flushed),
                (1 << 20, TOTAL / 2, TOTAL, 0)
            );
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
}

#[test]
fn the_retry_can_succeed() {
    let mut m = started();
    let mut seq = Sequence::new();
    m.expect_mem_alloc()
        .times(1)
        .in_sequence(&mut seq)
        .returning(|_, _| Err(oom()));
    m.expect_mem_alloc()
        .times(1)
        .in_sequence(&mut seq)
        .returning(|_, _| Ok(DevicePtr(0x2000)));
    m.expect_mem_free()
        .with(eq(CTX), eq(DevicePtr(0x2000)))
        .times(1)
        .returning(|_, _| Ok(()));
    m.expect_primary_ctx_release()
        .times(1)
        .returning(|_| Ok(()));
    let rt = Runtime::builder(Arc::new(m)).ignore_env().build().unwrap();
    let ctx = rt.context(0).unwrap();
    let p = ctx.memalloc(64).unwrap();
    assert_eq!(p.device_ptr(), DevicePtr(0x2000));
}

#[test]
fn other_errors_are_not_retried() {
    let mut m = started();
    m.expect_mem_alloc().times(1).returning(|_, _| {
        Err(DriverError::from_kind(
            "cuMemAlloc",
            ErrorKind::InvalidValue,
        ))
    });
    m.expect_primary_ctx_release()
        .times(1)
        .returning(|_| Ok(()));
    let rt = Runtime::builder(Arc::new(m)).ignore_env().build().unwrap();
    let err = rt.context(0).unwrap().memalloc(64).unwrap_err();
    assert_eq!(err.driver_kind(), Some(ErrorKind::InvalidValue));
    assert!(
        err.to_string()
            .starts_with("memalloc on device 0: cuMemAlloc failed"),
        "{err}"
    );
}

#[test]
fn device_reset_frees_then_releases_then_resets() {
    let mut m = started();
    let mut seq = Sequence::new();
    m.expect_mem_alloc()
        .times(1)
        .returning(|_, _| Ok(DevicePtr(0x3000)));
    m.expect_mem_free()
        .with(eq(CTX), eq(DevicePtr(0x3000)))
        .times(1)
        .in_sequence(&mut seq)
        .returning(|_, _| Ok(()));
    m.expect_primary_ctx_release()
        .times(1)
        .in_sequence(&mut seq)
        .returning(|_| Ok(()));
    m.expect_primary_ctx_reset()
        .times(1)
        .in_sequence(&mut seq)
        .returning(|_| Ok(()));
    let rt = Runtime::builder(Arc::new(m)).ignore_env().build().unwrap();
    let ctx = rt.context(0).unwrap();
    let live = ctx.memalloc(16).unwrap();
    rt.reset_device(0).unwrap();
    // Dropping a pointer from before the reset makes no driver call (the mock would panic).
    drop(live);
}

#[test]
fn a_failing_release_is_retried_once_then_reset_anyway_reported_and_released_at_the_end() {
    let mut m = started();
    let mut seq = Sequence::new();
    m.expect_primary_ctx_release()
        .times(2)
        .in_sequence(&mut seq)
        .returning(|_| {
            Err(DriverError::from_kind(
                "cuDevicePrimaryCtxRelease",
                ErrorKind::InvalidContext,
            ))
        });
    m.expect_primary_ctx_reset()
        .times(1)
        .in_sequence(&mut seq)
        .returning(|_| Ok(()));
    // The reference the driver refused twice is not lost: the runtime's end releases it.
    m.expect_primary_ctx_release()
        .times(1)
        .in_sequence(&mut seq)
        .returning(|_| Ok(()));
    let rt = Runtime::builder(Arc::new(m)).ignore_env().build().unwrap();
    rt.context(0).unwrap();
    let err = rt.reset_device(0).unwrap_err();
    assert_eq!(err.driver_kind(), Some(ErrorKind::InvalidContext));
    drop(rt);
}

#[test]
fn a_release_that_fails_once_succeeds_on_the_retry() {
    let mut m = started();
    let mut seq = Sequence::new();
    m.expect_primary_ctx_release()
        .times(1)
        .in_sequence(&mut seq)
        .returning(|_| {
            Err(DriverError::from_kind(
                "cuDevicePrimaryCtxRelease",
                ErrorKind::Other,
            ))
        });
    m.expect_primary_ctx_release()
        .times(1)
        .in_sequence(&mut seq)
        .returning(|_| Ok(()));
    m.expect_primary_ctx_reset()
        .times(1)
        .in_sequence(&mut seq)
        .returning(|_| Ok(()));
    let rt = Runtime::builder(Arc::new(m)).ignore_env().build().unwrap();
    rt.context(0).unwrap();
    rt.reset_device(0).expect("the retry released the context");
}

#[derive(Debug)]
struct CountingPlugin;

impl emm::plugin::DeviceAllocator for CountingPlugin {
    fn memalloc(
        &self,
        host: &emm::plugin::HostLayer,
        bytes: usize,
    ) -> Result<emm::MemoryPointer, EmmError> {
        let cx = host.context();
        // SAFETY: the address is fake and the test never copies into or out of it; it counts calls
        // only.
        Ok(unsafe {
            emm::MemoryPointer::with_release(
                cx.device,
                cx.context,
                DevicePtr(0x4000),
                bytes,
                |_, _| {},
            )
        })
    }
    fn initialize(&self, _: &emm::plugin::HostLayer) -> Result<(), EmmError> {
        Ok(())
    }
    fn get_memory_info(&self, _: &emm::plugin::HostLayer) -> Result<emm::MemoryInfo, EmmError> {
        Ok(emm::MemoryInfo { free: 1, total: 2 })
    }
    fn get_ipc_handle(
        &self,
        h: &emm::plugin::HostLayer,
        m: &emm::MemoryPointer,
    ) -> Result<emm::IpcHandle, EmmError> {
        h.ipc_handle(m)
    }
}

#[test]
fn no_mem_alloc_while_a_plugin_owns_device_memory() {
    let mut m = started();
    // No `expect_mem_alloc`: any cuMemAlloc would fail the test.
    m.expect_primary_ctx_release()
        .times(1)
        .returning(|_| Ok(()));
    let plugin = emm::contract::FnFactory::new("plugin", |cx| {
        Ok(Box::new(emm::plugin::HostOnly::new(cx, CountingPlugin)))
    });
    let rt = Runtime::builder(Arc::new(m))
        .ignore_env()
        .memory_manager(plugin)
        .build()
        .unwrap();
    let ctx = rt.context(0).unwrap();
    for _ in 0..5 {
        drop(ctx.memalloc(1 << 20).unwrap());
    }
    assert_eq!(
        ctx.get_memory_info().unwrap(),
        emm::MemoryInfo { free: 1, total: 2 }
    );
}
