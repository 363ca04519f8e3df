//! Out of memory, as a caller sees it: the context's callback may free memory and have the
//! allocation tried again, a bounded number of times; a failure that stays carries a report of
//! what the manager holds, and both are counted.

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use driver_mock::{SimConfig, SimDriver};
use emm::contract::OUT_OF_MEMORY_RETRIES;
use emm::{EmmError, Runtime};

use crate::common::runtime_with;

/// Every manager a runtime ships that allocates device memory of its own.
const MANAGERS: [&str; 5] = [
    "default",
    "pool",
    "vmm-pool",
    "async-pool",
    "async-pool-ipc",
];

fn small_device() -> Arc<SimDriver> {
    Arc::new(SimDriver::new(SimConfig::single(64 << 20)))
}

#[test]
fn a_callback_that_frees_memory_gets_the_allocation_served_under_every_manager() {
    for manager in MANAGERS {
        let rt = runtime_with(&small_device(), manager);
        let ctx = rt.context(0).unwrap();
        let spare = Arc::new(Mutex::new(Some(ctx.memalloc(40 << 20).unwrap())));
        let calls = Arc::new(AtomicU32::new(0));
        let (held, counted) = (Arc::clone(&spare), Arc::clone(&calls));
        ctx.on_out_of_memory(Some(Arc::new(move |bytes| {
            assert_eq!(bytes, 40 << 20);
            counted.fetch_add(1, Ordering::Relaxed);
            held.lock().unwrap().take().is_some()
        })));
        let s = ctx.create_stream().unwrap();
        // The spare fills most of the device: the request fails until the callback drops it.
        let got = if ctx.stream_ordering() == emm::contract::StreamOrdering::Unsupported {
            ctx.memalloc(40 << 20)
        } else {
            ctx.memalloc_on(40 << 20, &s)
        };
        let got = got.unwrap_or_else(|e| panic!("{manager}: {e}"));
        assert_eq!(got.size(), 40 << 20, "{manager}");
        assert_eq!(calls.load(Ordering::Relaxed), 1, "{manager}");
        assert!(spare.lock().unwrap().is_none(), "{manager}");
        let events = ctx.allocation_events();
        assert!(events.retries() >= 1, "{manager}");
        assert_eq!(events.ooms(), 0, "{manager}");
    }
}

#[test]
fn a_callback_that_frees_nothing_is_asked_a_bounded_number_of_times() {
    for manager in MANAGERS {
        let rt = runtime_with(&small_device(), manager);
        let ctx = rt.context(0).unwrap();
        let calls = Arc::new(AtomicU32::new(0));
        let counted = Arc::clone(&calls);
        ctx.on_out_of_memory(Some(Arc::new(move |_| {
            counted.fetch_add(1, Ordering::Relaxed);
            true
        })));
        let err = ctx.memalloc(100 << 20).unwrap_err();
        assert!(err.is_out_of_memory(), "{manager}: {err:?}");
        assert_eq!(
            calls.load(Ordering::Relaxed),
            OUT_OF_MEMORY_RETRIES,
            "{manager}"
        );
        assert_eq!(ctx.allocation_events().ooms(), 1, "{manager}");
        let report = err
            .out_of_memory_report()
            .unwrap_or_else(|| panic!("{manager}: no report in {err:?}"));
        assert_eq!(report.callback_retries, OUT_OF_MEMORY_RETRIES);
        assert!(
            err.to_string()
                .contains("asked for 3 retries; none found room"),
            "{manager}: {err}"
        );
        // Without the callback, the next failure asks no one.
        ctx.on_out_of_memory(None);
        let err = ctx.memalloc(100 << 20).unwrap_err();
        assert_eq!(err.out_of_memory_report().unwrap().callback_retries, 0);
        assert_eq!(calls.load(Ordering::Relaxed), OUT_OF_MEMORY_RETRIES);
        assert_eq!(ctx.allocation_events().ooms(), 2, "{manager}");
    }
}

#[test]
fn the_report_says_what_the_pool_holds_uses_and_leaves_unused() {
    let rt = runtime_with(&small_device(), "pool");
    let ctx = rt.context(0).unwrap();
    // Blocks of 1 MiB over the device, every other one freed: 20 MiB unused, in pieces.
    let blocks: Vec<_> = (0..40).map(|_| ctx.memalloc(1 << 20).unwrap()).collect();
    let kept: Vec<_> = blocks.into_iter().step_by(2).collect();
    let err = ctx.memalloc(48 << 20).unwrap_err();
    let EmmError::OutOfMemory {
        requested, report, ..
    } = &err
    else {
        panic!("{err:?}")
    };
    assert_eq!(*requested, 48 << 20);
    let report = report.as_deref().expect("a report");
    let stats = ctx.pool_stats().device.unwrap();
    assert_eq!(report.manager, "pool");
    assert_eq!(report.held_bytes, Some(stats.held_bytes));
    assert_eq!(report.in_use_bytes, Some(stats.in_use_bytes));
    assert_eq!(report.in_use_bytes, Some(kept.len() << 20));
    assert_eq!(
        report.unused_bytes,
        Some(stats.held_bytes - stats.in_use_bytes)
    );
    let largest = report.largest_free_bytes.expect("the pool can tell");
    assert!(largest < 48 << 20, "{report:?}");
    let frag = report.fragmentation.unwrap();
    assert!((0.0..=1.0).contains(&frag), "{report:?}");
    // Every free block is smaller than the request: all the free space is unusable for it.
    let space = ctx.free_space().unwrap();
    assert_eq!(report.free_blocks, Some(space.blocks.len()));
    assert_eq!(report.unusable_for_request, Some(space.total_bytes()));
    assert!(space.total_bytes() >= 20 << 20, "{space:?}");
    let text = err.to_string();
    assert!(text.contains("manager `pool` holds"), "{text}");
    assert!(text.contains("largest free block"), "{text}");
    assert!(text.contains("ctx.trim()"), "{text}");
    assert!(text.contains("too small for this request"), "{text}");

    // The default manager keeps no pool, and says so.
    let rt = runtime_with(&small_device(), "default");
    let ctx = rt.context(0).unwrap();
    let err = ctx.memalloc(100 << 20).unwrap_err();
    assert!(
        err.to_string().contains("manager `default` keeps no pool"),
        "{err}"
    );
}

/// An allocation from inside the out-of-memory callback that runs out of memory too does not
/// call the callback again (it recursed, one level per allocation the callback made): it fails
/// at once, its error saying why, and the outer allocation goes on with the callback's answer.
#[test]
fn an_allocation_inside_the_callback_does_not_call_it_again() {
    let sim = small_device();
    let rt = runtime_with(&sim, "pool");
    let ctx = rt.context(0).unwrap();
    let calls = Arc::new(Mutex::new(Vec::new()));
    let (inner_ctx, seen) = (ctx.clone(), Arc::clone(&calls));
    ctx.on_out_of_memory(Some(Arc::new(move |bytes| {
        let inner = inner_ctx.memalloc(bytes).map(drop);
        seen.lock().unwrap().push((bytes, inner));
        false
    })));
    let outer = ctx.memalloc(1 << 30).expect_err("the device is smaller");
    assert!(outer.is_out_of_memory(), "{outer}");
    let calls = std::mem::take(&mut *calls.lock().unwrap());
    assert_eq!(
        calls.len(),
        1,
        "called once, not again from inside: {calls:?}"
    );
    let inner = calls[0]
        .1
        .as_ref()
        .expect_err("the inner allocation is as large");
    assert!(inner.is_out_of_memory(), "{inner}");
    assert!(
        inner.out_of_memory_report().unwrap().inside_callback
            && inner
                .to_string()
                .contains("from inside the out-of-memory callback"),
        "{inner}"
    );
    assert!(
        !outer.out_of_memory_report().unwrap().inside_callback,
        "{outer}"
    );
    ctx.on_out_of_memory(None);
}

/// A callback that resets the device it is called for is refused with an error that says why,
/// where the reset waited forever for the allocation the callback runs in; the allocation then
/// fails as out of memory, and a reset after it works.
#[test]
fn a_device_reset_from_inside_the_callback_is_refused_not_hung() {
    let sim = small_device();
    let rt = Arc::new(runtime_with(&sim, "pool"));
    let ctx = rt.context(0).unwrap();
    let seen: Arc<Mutex<Option<Result<(), EmmError>>>> = Arc::new(Mutex::new(None));
    let (runtime, result) = (Arc::downgrade(&rt), Arc::clone(&seen));
    ctx.on_out_of_memory(Some(Arc::new(move |_bytes| {
        let rt = runtime
            .upgrade()
            .expect("the runtime outlives the allocation");
        *result.lock().unwrap() = Some(rt.reset_device(0));
        false
    })));
    let too_big = ctx.memalloc(1 << 30).expect_err("the device is smaller");
    assert!(too_big.is_out_of_memory(), "{too_big}");
    let refused = seen.lock().unwrap().take().expect("the callback ran");
    let e = refused.expect_err("a reset from inside the callback is refused");
    assert!(e.to_string().contains("out-of-memory callback"), "{e}");
    // The context is still whole; a reset after the allocation returned works.
    let m = ctx.memalloc(4096).unwrap();
    drop(m);
    ctx.on_out_of_memory(None);
    drop(ctx);
    rt.reset_device(0).unwrap();
}

/// A callback that resets or puts to sleep the context it is called for is refused, under
/// every manager, with an error that says why: the allocation it runs in is still inside the
/// manager, which the reset would free under it. Memory allocated before stays whole.
#[test]
fn a_context_reset_or_sleep_from_inside_the_callback_is_refused() {
    for manager in MANAGERS {
        let rt = runtime_with(&small_device(), manager);
        let ctx = rt.context(0).unwrap();
        let kept = ctx.to_device(&[0x5A; 4096]).unwrap();
        type Seen = Arc<Mutex<Vec<Result<(), EmmError>>>>;
        let seen: Seen = Arc::new(Mutex::new(Vec::new()));
        let (inner, result) = (ctx.clone(), Arc::clone(&seen));
        ctx.on_out_of_memory(Some(Arc::new(move |_bytes| {
            let mut result = result.lock().unwrap();
            result.push(inner.reset());
            result.push(inner.sleep(&Default::default()).map(|_| ()));
            false
        })));
        let too_big = ctx.memalloc(1 << 30).expect_err("the device is smaller");
        assert!(too_big.is_out_of_memory(), "{manager}: {too_big}");
        ctx.on_out_of_memory(None);
        let seen = std::mem::take(&mut *seen.lock().unwrap());
        assert_eq!(seen.len(), 2, "{manager}: the callback ran once");
        for refused in seen {
            let e = refused.expect_err("refused from inside the callback");
            assert!(
                matches!(e, EmmError::InvalidArgument { .. })
                    && e.to_string().contains("out-of-memory callback"),
                "{manager}: {e}"
            );
        }
        let mut back = [0u8; 4096];
        ctx.copy_to_host(&mut back, &kept).unwrap();
        assert_eq!(back, [0x5A; 4096], "{manager}");
        assert!(!ctx.is_asleep(), "{manager}");
    }
}

/// A limit adaptor's refusal is out of memory to the program: the context's callback runs,
/// and where it frees memory (a spare dropped, as a Dask worker spills a result) the
/// allocation is admitted on the retry, counted as one; a callback that frees nothing leaves
/// the limit's error; and an allocation from inside the callback is not called back again.
#[test]
fn the_limit_adaptor_calls_the_out_of_memory_callback() {
    let sim = Arc::new(SimDriver::new(SimConfig::single(1 << 30)));
    let rt = Runtime::builder(sim.clone())
        .ignore_env()
        .memory_manager_name("pool")
        .adaptors(vec![emm::Adaptor::Limit(10 << 20)])
        .build()
        .unwrap();
    let ctx = rt.context(0).unwrap();
    let spare = Arc::new(Mutex::new(Some(ctx.memalloc(6 << 20).unwrap())));
    let calls = Arc::new(AtomicUsize::new(0));
    let (held, counted) = (Arc::clone(&spare), Arc::clone(&calls));
    ctx.on_out_of_memory(Some(Arc::new(move |_bytes| {
        counted.fetch_add(1, Ordering::Relaxed);
        held.lock().unwrap().take().is_some()
    })));
    let retries = ctx.allocation_events().retries();
    let big = ctx.memalloc(6 << 20).unwrap();
    assert!(
        spare.lock().unwrap().is_none(),
        "the callback dropped the spare"
    );
    assert_eq!(calls.load(Ordering::Relaxed), 1);
    assert_eq!(ctx.allocation_events().retries(), retries + 1);
    // Nothing more to free: the limit's error stands, after one call.
    let err = ctx.memalloc(6 << 20).unwrap_err();
    assert!(matches!(err, EmmError::OverLimit { .. }), "{err:?}");
    assert_eq!(calls.load(Ordering::Relaxed), 2);
    // From inside the callback, an allocation over the limit is not called back again.
    let inner_ctx = ctx.clone();
    let inner = Arc::new(Mutex::new(None));
    let seen = Arc::clone(&inner);
    ctx.on_out_of_memory(Some(Arc::new(move |_bytes| {
        *seen.lock().unwrap() = Some(inner_ctx.memalloc(8 << 20).map(drop));
        false
    })));
    assert!(ctx.memalloc(8 << 20).is_err());
    let from_inside = inner.lock().unwrap().take().expect("the callback ran");
    assert!(
        matches!(from_inside, Err(EmmError::OverLimit { .. })),
        "{from_inside:?}"
    );
    ctx.on_out_of_memory(None);
    drop(big);
}
