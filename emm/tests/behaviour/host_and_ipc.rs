//! Host-side rules and multi-device IPC on the simulator: what the shared suite cannot show on a
//! single GPU (devices that cannot map, that are not peers) or without fault injection.

use std::sync::Arc;

use crate::common::{runtime, sim};
use driver_mock::{Fault, Op, SimConfig, SimDeviceConfig, SimDriver};
use driver_sys::{DeviceOrdinal, ErrorKind};
use emm::{EmmError, HostAllocFlags, HostMemory, IpcHandle, PinnableBuffer, Runtime};

/// Numba's `Context.mempin`: mapping on a device that cannot map host memory is refused before
/// the manager is asked; unmapped pinning still works.
#[test]
fn mempin_mapped_is_refused_on_a_device_that_cannot_map() {
    let sim = Arc::new(SimDriver::new(SimConfig::with_devices(vec![
        SimDeviceConfig::new(64 << 20).can_map_host_memory(false),
    ])));
    let rt = runtime(&sim);
    let ctx = rt.context(0).unwrap();
    let buffer = Arc::new(PinnableBuffer::zeroed(64));
    let err = ctx.pin(buffer.clone(), true).unwrap_err();
    assert!(
        matches!(err, EmmError::CannotMapHostMemory { .. }),
        "{err:?}"
    );
    assert!(
        err.to_string()
            .starts_with("device 0 cannot map host memory"),
        "{err}"
    );
    assert_eq!(
        sim.count(Op::MemHostRegister),
        0,
        "refused before any driver call"
    );
    let pinned = ctx.pin(buffer, false).unwrap();
    assert!(matches!(pinned, HostMemory::Pinned(_)));
}

fn oom_once(sim: &SimDriver, op: Op) {
    sim.inject(Fault::nth(op, 1, ErrorKind::OutOfMemory));
}

/// Numba's `_attempt_allocation`: device memory, mapped host memory and mapped pins retry once
/// after out-of-memory; unmapped pinned memory and unmapped pins do not.
#[test]
fn which_allocations_retry_after_out_of_memory() {
    let sim = Arc::new(SimDriver::new(SimConfig::default()));
    let rt = runtime(&sim);
    let ctx = rt.context(0).unwrap();

    oom_once(&sim, Op::MemAlloc);
    ctx.memalloc(64).expect("device memory retries");
    assert_eq!(sim.count(Op::MemAlloc), 2);

    oom_once(&sim, Op::MemHostAlloc);
    ctx.memhostalloc(64, true, false, false)
        .expect("mapped host memory retries");
    assert_eq!(sim.count(Op::MemHostAlloc), 2);

    oom_once(&sim, Op::MemHostAlloc);
    let err = ctx.memhostalloc(64, false, false, false).unwrap_err();
    assert_eq!(err.driver_kind(), Some(ErrorKind::OutOfMemory), "{err}");
    assert_eq!(
        sim.count(Op::MemHostAlloc),
        3,
        "unmapped pinned memory is not retried"
    );

    oom_once(&sim, Op::MemHostRegister);
    ctx.pin(Arc::new(PinnableBuffer::zeroed(64)), true)
        .expect("mapped pins retry");
    assert_eq!(sim.count(Op::MemHostRegister), 2);

    oom_once(&sim, Op::MemHostRegister);
    let err = ctx
        .pin(Arc::new(PinnableBuffer::zeroed(64)), false)
        .unwrap_err();
    assert_eq!(err.driver_kind(), Some(ErrorKind::OutOfMemory), "{err}");
    assert_eq!(
        sim.count(Op::MemHostRegister),
        3,
        "unmapped pins are not retried"
    );
}

/// A second out-of-memory on pinned memory is a typed, clear error.
#[test]
fn pinned_out_of_memory_after_the_retry_is_clear() {
    let sim = Arc::new(SimDriver::new(
        SimConfig::default().pinned_host_limit(1 << 20),
    ));
    let rt = runtime(&sim);
    let ctx = rt.context(0).unwrap();
    let err = ctx.memhostalloc(2 << 20, true, false, false).unwrap_err();
    assert!(
        matches!(err, EmmError::OutOfHostMemory { requested, .. } if requested == 2 << 20),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("out of page-locked host memory"),
        "{err}"
    );
    assert_eq!(sim.count(Op::MemHostAlloc), 2, "one retry");
}

/// `Context::defer_cleanup` suspends both queues (Numba: the manager's and the context's own).
#[test]
fn context_defer_cleanup_covers_both_queues() {
    let sim = Arc::new(SimDriver::new(SimConfig::default()));
    let rt = Runtime::builder(sim.clone())
        .ignore_env()
        .dealloc_config(emm::plugin::DeallocConfig {
            max_count: 0,
            max_ratio: 0.2,
        })
        .build()
        .unwrap();
    let ctx = rt.context(0).unwrap();
    {
        let _guard = ctx.defer_cleanup().unwrap();
        drop(ctx.create_stream().unwrap());
        drop(ctx.memalloc(8).unwrap());
        assert_eq!(ctx.own_deallocations().len(), 1);
        assert_eq!(ctx.deallocations().unwrap().len(), 1);
        assert_eq!(sim.count(Op::StreamDestroy) + sim.count(Op::MemFree), 0);
    }
    drop(ctx.create_event(false).unwrap());
    assert_eq!(
        ctx.own_deallocations().len(),
        0,
        "the next push over the threshold flushes"
    );
    assert_eq!(sim.count(Op::StreamDestroy), 1);
}

fn two_devices(peers: bool) -> Arc<SimDriver> {
    let config = SimConfig::with_devices(vec![
        SimDeviceConfig::new(64 << 20),
        SimDeviceConfig::new(64 << 20),
    ])
    .peer_access(peers);
    Arc::new(SimDriver::new(config))
}

/// A copy between devices first asks the driver for peer access from the copying context to
/// the source's (so that it goes device to device, not through host memory): granted the
/// first time and "already enabled" after; refused between devices that are not peers, and the
/// copy goes ahead; any other refusal is absorbed the same way (with a warning), and the bytes
/// arrive every time.
#[test]
fn copies_between_devices_ask_for_peer_access_first() {
    let copy_twice = |sim: &Arc<SimDriver>| {
        let rt = runtime(sim);
        let (c0, c1) = (rt.context(0).unwrap(), rt.context(1).unwrap());
        let data: Vec<u8> = (0..=255).collect();
        let src = c0.to_device(&data).unwrap();
        let dst = c1.memalloc(256).unwrap();
        for _ in 0..2 {
            c1.copy_peer(&dst, &c0, &src, 256).unwrap();
            let mut back = vec![0u8; 256];
            c1.copy_to_host(&mut back, &dst).unwrap();
            assert_eq!(back, data);
        }
        sim.calls()
            .into_iter()
            .filter(|c| c.op == Op::CtxEnablePeerAccess)
            .map(|c| (c.device, c.outcome, c.injected))
            .collect::<Vec<_>>()
    };
    let on_1 = Some(DeviceOrdinal(1));
    let refused = Err(ErrorKind::PeerAccess);
    assert_eq!(
        copy_twice(&two_devices(true)),
        vec![(on_1, Ok(()), false), (on_1, refused, false)],
        "granted once, then already enabled"
    );
    assert_eq!(
        copy_twice(&two_devices(false)),
        vec![(on_1, refused, false), (on_1, refused, false)],
        "not peers: unsupported, every time"
    );
    let sim = two_devices(true);
    sim.inject(Fault::nth(
        Op::CtxEnablePeerAccess,
        1,
        ErrorKind::InvalidValue,
    ));
    assert_eq!(
        copy_twice(&sim),
        vec![
            // An injected failure runs nothing, so the log names no device for it.
            (None, Err(ErrorKind::InvalidValue), true),
            (on_1, Ok(()), false)
        ],
        "a failure is absorbed and asked again at the next copy"
    );
}

/// Exports from device 0, opens in another process on device 1: directly between peers,
/// staged otherwise; the data arrives either way; a staged copy belongs to the destination's
/// manager and is released through it.
#[test]
fn ipc_across_devices_is_direct_between_peers_and_staged_otherwise() {
    for peers in [true, false] {
        let sim = two_devices(peers);
        let rt = runtime(&sim);
        let src = rt.context(0).unwrap();
        let data: Vec<u8> = (0..200).collect();
        let mem = src.to_device(&data).unwrap();
        let view = mem.view(50, Some(150)).unwrap();
        let bytes = src.get_ipc_handle(&view).unwrap().to_bytes();

        let other = Arc::new(sim.spawn_process());
        let other_rt = runtime(&other);
        let dst = other_rt.context(1).unwrap();
        assert_eq!(dst.can_access_peer(DeviceOrdinal(0)).unwrap(), peers);
        let handle = IpcHandle::from_bytes(&bytes).unwrap();
        let opened = handle.open(&other_rt, &dst).unwrap();
        let mut back = vec![0u8; 100];
        dst.copy_to_host(&mut back, &opened).unwrap();
        assert_eq!(back, data[50..150].to_vec(), "peers: {peers}");
        let staged = other.count(Op::MemcpyDtoD) == 1;
        assert_eq!(
            staged, !peers,
            "staged exactly when the devices are not peers"
        );
        assert_eq!(other.count(Op::IpcOpenMemHandle), 1);
        if staged {
            assert_eq!(
                other.leak_report().ipc_mappings,
                vec![],
                "the staging mapping was closed"
            );
            assert_eq!(
                other.live_allocations(DeviceOrdinal(1)).len(),
                1,
                "the copy is device 1 memory"
            );
        }
        handle.close().unwrap();
        drop(opened);
        dst.deallocations().unwrap().flush().unwrap();
        assert!(
            other.leak_report().no_memory_leaked(),
            "{}",
            other.leak_report()
        );
        drop((dst, other_rt));
        assert!(other.leak_report().is_clean(), "{}", other.leak_report());
    }
}

/// Forcing the staged path between peers works too (what the GPU job does on NVLink pairs).
#[test]
fn staged_path_can_be_forced_between_peers() {
    let sim = two_devices(true);
    let rt = runtime(&sim);
    let src = rt.context(0).unwrap();
    let mem = src.to_device(&[9u8; 64]).unwrap();
    let bytes = src.get_ipc_handle(&mem).unwrap().to_bytes();
    let other = Arc::new(sim.spawn_process());
    let other_rt = runtime(&other);
    let dst = other_rt.context(1).unwrap();
    let handle = IpcHandle::from_bytes(&bytes).unwrap();
    let copy = handle.open_staged(&other_rt, &dst).unwrap();
    let mut back = [0u8; 64];
    dst.copy_to_host(&mut back, &copy).unwrap();
    assert_eq!(back, [9u8; 64]);
    handle.close().unwrap();
    dst.copy_to_host(&mut back, &copy)
        .expect("a staged copy outlives the close");
}

/// A handle whose source device is not visible gets Numba's message.
#[test]
fn a_handle_from_an_unknown_device_is_a_clear_error() {
    let sim = Arc::new(SimDriver::new(SimConfig::default()));
    let rt = runtime(&sim);
    let ctx = rt.context(0).unwrap();
    let mem = ctx.to_device(&[1u8; 8]).unwrap();
    let exported = ctx.get_ipc_handle(&mem).unwrap();
    let mut bytes = exported.to_bytes();
    bytes[110] = 0x77; // the PCI bus id
    let handle = IpcHandle::from_bytes(&bytes).unwrap();
    let other = Arc::new(sim.spawn_process());
    let other_rt = runtime(&other);
    let other_ctx = other_rt.context(0).unwrap();
    let err = handle.open(&other_rt, &other_ctx).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("No device of {'pci_domain_id': 0, 'pci_bus_id': 119"),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("Target device may not be visible in this process"),
        "{err}"
    );
}

/// `Context::host_alloc` with named flags is `memhostalloc` with Numba's three booleans.
#[test]
fn host_alloc_with_named_flags() {
    let sim = Arc::new(SimDriver::new(SimConfig::default()));
    let rt = runtime(&sim);
    let ctx = rt.context(0).unwrap();
    let pinned = ctx.host_alloc(64, HostAllocFlags::PINNED).unwrap();
    assert!(matches!(pinned, HostMemory::Pinned(_)), "{pinned:?}");
    let mapped = ctx
        .host_alloc(64, HostAllocFlags::MAPPED.portable().write_combined())
        .unwrap();
    let device = mapped.mapped().expect("mapped memory").device().clone();
    ctx.copy_to_device(&device, &[5u8; 64]).unwrap();
    let mut back = [0u8; 64];
    mapped.read(0, &mut back).unwrap();
    assert_eq!(back, [5u8; 64], "the device writes land in the host bytes");
    assert_eq!(sim.count(Op::MemHostAlloc), 2);
}

/// `Context::flush_deallocations` issues what the manager's queue holds, and nothing inside
/// `defer_cleanup`.
#[test]
fn flush_deallocations_issues_the_queue() {
    let sim = Arc::new(SimDriver::new(SimConfig::default()));
    let rt = runtime(&sim);
    let ctx = rt.context(0).unwrap();
    drop(ctx.memalloc(256).unwrap());
    drop(ctx.memalloc(256).unwrap());
    assert_eq!(sim.count(Op::MemFree), 0, "queued, below the thresholds");
    {
        let _guard = ctx.defer_cleanup().unwrap();
        assert_eq!(ctx.flush_deallocations().unwrap(), 0);
        assert_eq!(sim.count(Op::MemFree), 0);
    }
    assert_eq!(ctx.flush_deallocations().unwrap(), 2);
    assert_eq!(sim.count(Op::MemFree), 2);
    assert_eq!(ctx.flush_deallocations().unwrap(), 0, "nothing left");
}

/// `memhostalloc` from the driver's pool in host memory (`host_memory_pool`): mapped and
/// unmapped memory is one address for the host and the device, bytes round-trip through the
/// device, a dropped buffer goes back to the pool, portable and write-combined requests are
/// refused with an error that says why, a reset frees what is live, and the pool does not
/// combine with emm's pinned host pool.
#[test]
fn memhostalloc_from_the_driver_host_pool() {
    let sim = crate::common::sim();
    let rt = emm::Runtime::builder(sim.clone())
        .ignore_env()
        .host_memory_pool(true)
        .build()
        .unwrap();
    let ctx = rt.context(0).unwrap();
    let mapped = ctx.memhostalloc(4096, true, false, false).unwrap();
    let m = mapped.mapped().unwrap();
    assert_eq!(m.host_ptr().0 as u64, m.device().device_ptr().0);
    mapped.write(0, &[6u8; 64]).unwrap();
    let d = ctx.memalloc(64).unwrap();
    ctx.copy_device(&d, m.device(), 64).unwrap();
    let mut back = [0u8; 64];
    ctx.copy_to_host(&mut back, &d).unwrap();
    assert_eq!(back, [6u8; 64]);
    let unmapped = ctx.memhostalloc(100, false, false, false).unwrap();
    unmapped.write(0, &[1u8; 100]).unwrap();
    drop(unmapped);
    for (portable, wc) in [(true, false), (false, true)] {
        let e = ctx.memhostalloc(64, false, portable, wc).unwrap_err();
        assert!(e.to_string().contains("EMM_HOST_MEMORY_POOL"), "{e}");
    }
    assert_eq!(
        sim.count(driver_mock::Op::MemHostAlloc),
        0,
        "no cuMemHostAlloc"
    );
    let live = ctx.memhostalloc(8192, true, false, false).unwrap();
    ctx.reset().unwrap();
    assert!(!live.mapped().unwrap().device().is_live());
    drop((live, mapped, d));
    drop(ctx);
    drop(rt);
    assert!(sim.leak_report().is_clean(), "{}", sim.leak_report());

    let e = emm::Runtime::builder(crate::common::sim())
        .ignore_env()
        .host_memory_pool(true)
        .pinned_host_pool(Some(emm::PinnedPoolConfig::default()))
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("choose one"), "{e}");
    let on = emm::internals::config::host_memory_pool_from_lookup(|_| Some("on".into())).unwrap();
    assert!(on);
    let e =
        emm::internals::config::host_memory_pool_from_lookup(|_| Some("maybe".into())).unwrap_err();
    assert!(e.to_string().contains("EMM_HOST_MEMORY_POOL"), "{e}");
}

/// A host pool allocation whose wait fails is freed again; where that free fails too, the
/// block stays counted live and the manager's reset frees it: nothing is left for the
/// context's destruction to take.
#[test]
fn a_host_pool_block_whose_wait_and_free_fail_is_freed_by_the_reset() {
    use driver_mock::{Fault, Op};
    use driver_sys::ErrorKind;
    let sim = crate::common::sim();
    let rt = emm::Runtime::builder(sim.clone())
        .ignore_env()
        .host_memory_pool(true)
        .build()
        .unwrap();
    let ctx = rt.context(0).unwrap();
    drop(ctx.memhostalloc(64, true, false, false).unwrap()); // the pool and its stream exist
    sim.inject(Fault::nth(
        Op::StreamSynchronize,
        1,
        ErrorKind::InvalidValue,
    ));
    sim.inject(Fault::nth(Op::MemFreeAsync, 1, ErrorKind::InvalidValue));
    let frees = sim.count(Op::MemFreeAsync);
    let e = ctx.memhostalloc(4096, true, false, false).unwrap_err();
    assert!(e.to_string().contains("memhostalloc"), "{e}");
    assert_eq!(sim.count(Op::MemFreeAsync), frees + 1, "the free was tried");
    ctx.reset().unwrap();
    assert_eq!(
        sim.count(Op::MemFreeAsync),
        frees + 2,
        "the reset freed the block whose free had failed"
    );
    drop(ctx);
    drop(rt);
    let reclaimed = sim.reclaimed_by_destroy();
    assert!(reclaimed.is_clean(), "{reclaimed}");
    assert!(sim.leak_report().is_clean(), "{}", sim.leak_report());
}

/// An external stream wrapped with its owner: the stream and every memory ordered on it hold
/// the owner (another library's stream object), so it outlives the last stream-ordered free,
/// under a manager that frees on the stream and one that does not.
#[test]
fn an_owned_external_stream_outlives_the_memory_ordered_on_it() {
    for manager in ["default", "async-pool"] {
        let sim = sim();
        let rt = crate::common::runtime_with(&sim, manager);
        let ctx = rt.context(0).unwrap();
        let theirs = ctx.create_stream().unwrap();
        let owner: Arc<()> = Arc::new(());
        // SAFETY: `theirs` is a stream of this context that outlives `owner` (dropped last).
        let s = unsafe { ctx.external_stream_owned(theirs.handle(), owner.clone()) };
        assert_eq!(s.kind(), emm::streams::StreamKind::External);
        let mem = ctx.memalloc_on(64, &s).unwrap();
        drop(s);
        assert_eq!(
            Arc::strong_count(&owner),
            2,
            "{manager}: the memory holds the owner"
        );
        drop(mem);
        ctx.flush_deallocations().unwrap();
        assert_eq!(
            Arc::strong_count(&owner),
            1,
            "{manager}: released after the free"
        );
        drop(theirs);
    }
}

/// A host function that panics: the panic stays on the thread that ran it (it cannot reach
/// the caller), is counted, and the stream's later work still runs.
#[test]
fn a_panicking_host_function_is_stopped_counted_and_the_stream_goes_on() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let sim = crate::common::sim();
    let rt = crate::common::runtime_with(&sim, "default");
    let ctx = rt.context(0).unwrap();
    let stream = ctx.create_stream().unwrap();
    let before = emm::streams::host_function_panics();
    let ran = Arc::new(AtomicBool::new(false));
    let after = Arc::clone(&ran);
    stream
        .launch_host_func(|| panic!("a host function that fails"))
        .unwrap();
    stream
        .launch_host_func(move || after.store(true, Ordering::SeqCst))
        .unwrap();
    stream.synchronize().unwrap();
    assert!(ran.load(Ordering::SeqCst), "the later host function ran");
    assert_eq!(emm::streams::host_function_panics(), before + 1);
}

/// Page-locked memory outlives nothing that frees it: once the runtime that made it is gone
/// (its contexts destroyed, and the driver's host allocations with them), reads and writes
/// are refused, for memory from the driver, from the pinned host pool and mapped memory
/// alike, and through an adaptor that wraps it; while the runtime lives they work.
#[test]
fn pinned_memory_is_refused_after_its_runtime_is_gone() {
    for (pinned_pool, stats) in [(false, false), (true, false), (false, true), (true, true)] {
        let sim = Arc::new(SimDriver::new(SimConfig::default()));
        let mut builder = emm::Runtime::builder(sim.clone()).ignore_env();
        if pinned_pool {
            builder = builder.pinned_host_pool(Some(emm::PinnedPoolConfig::default()));
        }
        if stats {
            builder = builder.adaptors(vec![emm::Adaptor::Stats]);
        }
        let rt = builder.build().unwrap();
        let ctx = rt.context(0).unwrap();
        let pinned = ctx.memhostalloc(4096, false, false, false).unwrap();
        let mapped = ctx.memhostalloc(4096, true, false, false).unwrap();
        for m in [&pinned, &mapped] {
            m.write(0, &[7; 16]).unwrap();
            let mut back = [0u8; 16];
            m.read(0, &mut back).unwrap();
            assert_eq!(back, [7; 16]);
        }
        drop(ctx);
        drop(rt);
        for (what, m) in [("pinned", &pinned), ("mapped", &mapped)] {
            let e = m
                .write(0, &[1; 16])
                .expect_err("a write after the runtime is gone");
            assert!(
                matches!(e, EmmError::Stale { .. }),
                "{what} (pinned pool {pinned_pool}, stats {stats}): {e}"
            );
            let mut back = [0u8; 16];
            assert!(
                m.read(0, &mut back).is_err(),
                "{what}: a read after the runtime"
            );
        }
    }
}

/// Memory of the driver's host memory pool that a reset freed is refused, not written.
#[test]
fn host_pool_memory_is_refused_after_a_reset() {
    let sim = Arc::new(SimDriver::new(SimConfig::default()));
    let rt = emm::Runtime::builder(sim.clone())
        .ignore_env()
        .host_memory_pool(true)
        .build()
        .unwrap();
    let ctx = rt.context(0).unwrap();
    let pinned = ctx.memhostalloc(4096, false, false, false).unwrap();
    pinned.write(0, &[3; 8]).unwrap();
    ctx.reset().unwrap();
    let e = pinned
        .write(0, &[1; 8])
        .expect_err("the reset freed the memory");
    assert!(matches!(e, EmmError::Stale { .. }), "{e}");
    let dst = ctx.memalloc(8).unwrap();
    assert!(ctx.copy_pinned_to_device(&dst, &pinned, 8).is_err());
    assert!(ctx.copy_device_to_pinned(&pinned, &dst, 8).is_err());
}

/// A plugin's `reset` (user code, which a context's reset runs) may use the same context: a
/// copy there is refused as stale (the host layer's reset, which runs first, made every pointer
/// stale), and a reset or sleep from there is refused with an error that says why. Neither
/// waits for the reset that runs it, which holds the context's memory until it ends.
#[test]
fn code_a_reset_runs_may_use_its_context_and_is_refused_not_hung() {
    use std::sync::Mutex;
    use std::sync::mpsc;
    use std::time::Duration;

    use emm::contract::FnFactory;
    use emm::plugin::{DeviceAllocator, HostLayer, HostOnly};

    type Seen = Arc<Mutex<Vec<Result<(), EmmError>>>>;
    /// `cuMemAlloc` memory; at its reset, uses the context it was told of.
    #[derive(Debug)]
    struct Reentrant {
        ctx: Arc<Mutex<Option<(emm::Context, emm::MemoryPointer)>>>,
        seen: Seen,
    }
    impl DeviceAllocator for Reentrant {
        fn memalloc(&self, host: &HostLayer, bytes: usize) -> Result<emm::MemoryPointer, EmmError> {
            let cx = host.context();
            let _live = cx.enter("memalloc")?;
            let base = (cx.driver.mem_alloc(cx.context, bytes))
                .map_err(|e| cx.driver_error("memalloc", e))?;
            // SAFETY: `base` was just allocated by `cuMemAlloc` for `bytes` bytes.
            Ok(unsafe { host.track_device_allocation(base, bytes) })
        }
        fn initialize(&self, _host: &HostLayer) -> Result<(), EmmError> {
            Ok(())
        }
        fn reset(&self, _host: &HostLayer) -> Result<(), EmmError> {
            // Taken out: the context holds this allocator, which must not hold it back.
            if let Some((ctx, mem)) = self.ctx.lock().unwrap().take() {
                let mut seen = self.seen.lock().unwrap();
                seen.push(ctx.copy_to_device(&mem, &[1; 64]));
                seen.push(ctx.reset());
                seen.push(ctx.sleep(&Default::default()).map(|_| ()));
            }
            Ok(())
        }
    }

    let (done, finished) = mpsc::channel();
    let seen: Seen = Arc::new(Mutex::new(Vec::new()));
    let told: Arc<Mutex<Option<(emm::Context, emm::MemoryPointer)>>> = Arc::default();
    let (recorded, tell) = (Arc::clone(&seen), Arc::clone(&told));
    std::thread::spawn(move || {
        let plugin = FnFactory::new("reentrant", move |cx| {
            let device = Reentrant {
                ctx: Arc::clone(&tell),
                seen: Arc::clone(&recorded),
            };
            Ok(Box::new(HostOnly::new(cx, device)))
        });
        let rt = Runtime::builder(sim())
            .ignore_env()
            .memory_manager(plugin)
            .build()
            .unwrap();
        let ctx = rt.context(0).unwrap();
        let mem = ctx.memalloc(64).unwrap();
        *told.lock().unwrap() = Some((ctx.clone(), mem));
        done.send(ctx.reset()).unwrap();
    });
    let reset = finished
        .recv_timeout(Duration::from_secs(20))
        .expect("the reset returned (a use from code it runs waited for it before)");
    reset.unwrap();
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    assert_eq!(seen.len(), 3, "the plugin's reset ran once: {seen:?}");
    assert!(matches!(seen[0], Err(EmmError::Stale { .. })), "{seen:?}");
    for refused in &seen[1..] {
        let Err(e) = refused else {
            panic!("refused inside the reset: {seen:?}");
        };
        assert!(
            matches!(e, EmmError::InvalidArgument { .. }) && e.to_string().contains("resets"),
            "{e}"
        );
    }
}
