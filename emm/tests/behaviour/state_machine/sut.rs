//! The system under test: a runtime over the simulator, plus a second simulated process that
//! opens the exported IPC handles.

use std::sync::Arc;

use driver_mock::{SimConfig, SimDriver};
use driver_sys::DeviceOrdinal;
use emm::plugin::{DeallocConfig, DeferCleanup};
use emm::{
    Context, HostMemory, InFlight, IpcHandle, ManagedMemory, MemoryPointer, PinnableBuffer,
    Runtime, Stream,
};
use proptest_state_machine::StateMachineTest;

use super::reference::{Kind, MAX_PENDING_BYTES, MAX_PENDING_COUNT, Model, Transition};

const TOTAL: usize = 1 << 30;

pub enum Handle {
    Mem(MemoryPointer),
    Host(HostMemory),
    Managed(ManagedMemory),
}

pub struct Export {
    handle: IpcHandle,
    imported: Option<(IpcHandle, MemoryPointer)>,
}

/// What one allocation was made as: its address (device memory's base, or host memory's host
/// address) and the byte it was filled with.
struct Made {
    addr: u64,
    fill: u8,
}

pub struct Sut {
    sim: Arc<SimDriver>,
    /// One entry per allocation, in the model's order.
    made: Vec<Made>,
    ctx: Context,
    other: Arc<SimDriver>,
    other_rt: Runtime,
    other_ctx: Context,
    handles: Vec<Handle>,
    guards: Vec<DeferCleanup>,
    exports: Vec<Export>,
    /// A non-blocking stream, and the sets queued on it.
    stream: Stream,
    in_flight: Vec<InFlight<()>>,
    // Dropped last: the runtimes own the contexts' teardown.
    _rt: Runtime,
}

pub struct ContextSut;

fn runtime(driver: Arc<SimDriver>) -> Runtime {
    let config = DeallocConfig {
        max_count: MAX_PENDING_COUNT,
        max_ratio: MAX_PENDING_BYTES as f64 / TOTAL as f64,
    };
    Runtime::builder(driver)
        .ignore_env()
        .dealloc_config(config)
        .build()
        .expect("runtime")
}

impl StateMachineTest for ContextSut {
    type SystemUnderTest = Sut;
    type Reference = Model;

    fn init_test(_: &Model) -> Sut {
        let sim = Arc::new(SimDriver::new(SimConfig::single(TOTAL)));
        let other = Arc::new(sim.spawn_process());
        let rt = runtime(sim.clone());
        let other_rt = runtime(other.clone());
        let ctx = rt.context(0).expect("context");
        let other_ctx = other_rt.context(0).expect("other context");
        assert_eq!(
            ctx.deallocations().unwrap().max_pending_bytes(),
            MAX_PENDING_BYTES
        );
        let stream = ctx.create_stream_with(true, 0).expect("stream");
        Sut {
            sim,
            made: Vec::new(),
            stream,
            in_flight: Vec::new(),
            ctx,
            other,
            other_rt,
            other_ctx,
            handles: Vec::new(),
            guards: Vec::new(),
            exports: Vec::new(),
            _rt: rt,
        }
    }

    fn apply(mut s: Sut, model: &Model, t: Transition) -> Sut {
        match t {
            Transition::Alloc(kind, bytes) => {
                let h = match kind {
                    Kind::Device => Handle::Mem(s.ctx.memalloc(bytes).expect("memalloc")),
                    Kind::Managed => Handle::Managed(
                        s.ctx
                            .memallocmanaged(bytes, bytes % 2 == 0)
                            .expect("memallocmanaged"),
                    ),
                    Kind::Mapped | Kind::Pinned => Handle::Host(
                        s.ctx
                            .memhostalloc(bytes, kind == Kind::Mapped, false, false)
                            .expect("memhostalloc"),
                    ),
                    Kind::MappedPin | Kind::Pin => Handle::Host(
                        s.ctx
                            .pin(
                                Arc::new(PinnableBuffer::zeroed(bytes)),
                                kind == Kind::MappedPin,
                            )
                            .expect("pin"),
                    ),
                };
                // Each allocation gets bytes of its own, read back after every step.
                let fill = (s.made.len() % 251) as u8 + 1;
                let addr = match &h {
                    Handle::Mem(m) => {
                        s.ctx
                            .copy_to_device(m, &vec![fill; bytes])
                            .expect("fill device memory");
                        m.device_ptr().0
                    }
                    Handle::Host(hm) => {
                        hm.write(0, &vec![fill; bytes]).expect("fill host memory");
                        hm.host_ptr().0 as u64
                    }
                    // From the host side: the device side reads it back.
                    Handle::Managed(mm) => {
                        mm.write(0, &vec![fill; bytes])
                            .expect("fill managed memory");
                        mm.device().device_ptr().0
                    }
                };
                s.made.push(Made { addr, fill });
                s.handles.push(h);
            }
            Transition::Clone(i) => {
                let h = match &s.handles[i.index(s.handles.len())] {
                    Handle::Mem(m) => Handle::Mem(m.clone()),
                    Handle::Host(HostMemory::Mapped(m)) => {
                        Handle::Host(HostMemory::Mapped(m.clone()))
                    }
                    Handle::Host(HostMemory::Pinned(_)) => unreachable!("precondition: shareable"),
                    Handle::Managed(m) => Handle::Managed(m.clone()),
                };
                s.handles.push(h);
            }
            Transition::View(i) => {
                let m = match &s.handles[i.index(s.handles.len())] {
                    Handle::Mem(m) => m,
                    Handle::Managed(mm) => mm.device(),
                    Handle::Host(_) => unreachable!("precondition: a device pointer"),
                };
                let v = m.view(m.size() / 2, None).expect("view");
                s.handles.push(Handle::Mem(v));
            }
            Transition::Drop(i) => {
                let n = s.handles.len();
                drop(s.handles.swap_remove(i.index(n)));
            }
            Transition::EnterDefer => s.guards.push(s.ctx.defer_cleanup().expect("guard")),
            Transition::LeaveDefer => drop(s.guards.pop()),
            Transition::Flush => {
                s.ctx.deallocations().unwrap().flush().expect("flush");
            }
            Transition::Initialize => {
                let again = s._rt.context(0).expect("context");
                assert_eq!(again.handle(), s.ctx.handle());
            }
            Transition::Reset => s.ctx.reset().expect("reset"),
            Transition::IpcExport(i) => {
                let Handle::Mem(m) = &s.handles[i.index(s.handles.len())] else {
                    unreachable!("precondition: device memory")
                };
                let handle = s.ctx.get_ipc_handle(m).expect("export");
                s.exports.push(Export {
                    handle,
                    imported: None,
                });
            }
            Transition::IpcOpen(i) => {
                let n = s.exports.len();
                let e = &mut s.exports[i.index(n)];
                let imported = IpcHandle::from_bytes(&e.handle.to_bytes()).expect("bytes");
                let mem = imported
                    .open(&s.other_rt, &s.other_ctx)
                    .expect("open in the other process");
                e.imported = Some((imported, mem));
            }
            Transition::IpcClose(i) => {
                let n = s.exports.len();
                let (imported, mem) = s.exports[i.index(n)].imported.take().expect("open");
                imported.close().expect("close");
                assert!(!mem.is_live(), "pointers of a closed handle are stale");
            }
            Transition::DropExport(i) => {
                let n = s.exports.len();
                drop(s.exports.swap_remove(i.index(n)));
            }
            Transition::AsyncSet(i) => {
                let n = s.handles.len();
                let id = model.handles[i.index(n)];
                let m = match &s.handles[i.index(n)] {
                    Handle::Mem(m) => m,
                    Handle::Managed(mm) => mm.device(),
                    Handle::Host(_) => unreachable!("precondition: a device pointer"),
                };
                let fill = s.made[id].fill;
                let queued = s.ctx.memset_async(m, fill, &s.stream).expect("queue a set");
                s.in_flight.push(queued);
            }
            Transition::Settle => {
                for queued in std::mem::take(&mut s.in_flight) {
                    queued.wait().expect("settle");
                }
            }
        }
        let _ = model;
        s
    }

    fn check_invariants(s: &Sut, model: &Model) {
        let queue = s.ctx.deallocations().unwrap();
        assert_eq!(queue.len(), model.pending.len(), "pending frees");
        assert_eq!(queue.pending_bytes(), model.pending_bytes, "pending bytes");
        assert_eq!(queue.is_disabled(), model.defer > 0, "defer_cleanup");
        let leaks = s.sim.leak_report();
        assert_eq!(
            s.sim.live_allocations(DeviceOrdinal(0)).len(),
            model.device_live,
            "device allocations the driver holds"
        );
        assert_eq!(
            leaks.host_allocations.len(),
            model.host_live,
            "pinned host allocations the driver holds"
        );
        assert_eq!(
            leaks.host_registrations.len(),
            model.pins_live,
            "registered host ranges"
        );
        let failed: Vec<_> = s
            .sim
            .calls()
            .into_iter()
            .filter(|c| c.outcome.is_err())
            .collect();
        assert!(
            failed.is_empty(),
            "failed driver calls (a double free?): {failed:?}"
        );
        assert_eq!(
            s.other.leak_report().ipc_mappings.len(),
            model.mapped_allocations(),
            "mappings in the other process"
        );
        // Identities, not only counts: the driver holds exactly the allocations the model
        // says it holds, at the addresses they were made at.
        let held = model.held();
        // The addresses the held allocations of the kinds `of` were made at, sorted.
        let expect = |of: &dyn Fn(Kind) -> bool| {
            let mut addrs: Vec<u64> = held
                .iter()
                .filter(|(_, k)| of(*k))
                .map(|(i, _)| s.made[*i].addr)
                .collect();
            addrs.sort_unstable();
            addrs
        };
        let expect_device = expect(&|k| k == Kind::Device);
        let device: Vec<u64> = s
            .sim
            .live_allocations(DeviceOrdinal(0))
            .into_iter()
            .map(|(p, _)| p.0)
            .collect();
        assert_eq!(device, expect_device, "device allocations, by address");
        let expect_managed = expect(&|k| k == Kind::Managed);
        // The leak report lists managed memory with device memory (`cuMemFree` frees both).
        let mut managed: Vec<u64> = leaks
            .allocations
            .iter()
            .map(|(_, p, _)| p.0)
            .filter(|a| !device.contains(a))
            .collect();
        managed.sort_unstable();
        assert_eq!(managed, expect_managed, "managed allocations, by address");
        let expect_host = expect(&|k| matches!(k, Kind::Mapped | Kind::Pinned));
        let mut host: Vec<u64> = leaks
            .host_allocations
            .iter()
            .map(|(p, _)| p.0 as u64)
            .collect();
        host.sort_unstable();
        assert_eq!(host, expect_host, "pinned host allocations, by address");
        // And the bytes: every handle still reads what its allocation was filled with.
        for (h, &id) in s.handles.iter().zip(&model.handles) {
            if model.allocs[id].released {
                continue;
            }
            let fill = s.made[id].fill;
            let mut seen = vec![
                0u8;
                match h {
                    Handle::Mem(m) => m.size(),
                    Handle::Host(hm) => hm.size(),
                    Handle::Managed(mm) => mm.size(),
                }
            ];
            match h {
                Handle::Mem(m) => s.ctx.copy_to_host(&mut seen, m).expect("read back"),
                Handle::Host(hm) => hm.read(0, &mut seen).expect("read back"),
                Handle::Managed(mm) => s
                    .ctx
                    .copy_to_host(&mut seen, mm.device())
                    .expect("read back through the device side"),
            }
            assert!(
                seen.iter().all(|&b| b == fill),
                "allocation {id} no longer holds its bytes ({fill})"
            );
        }
        // The other process reads what the exporter filled, through its mapping.
        for (e, m) in s.exports.iter().zip(&model.exports) {
            if let Some((_, mem)) = &e.imported
                && !model.allocs[m.alloc].released
            {
                let fill = s.made[m.alloc].fill;
                let mut seen = vec![0u8; mem.size()];
                s.other_ctx
                    .copy_to_host(&mut seen, mem)
                    .expect("read in the other process");
                assert!(
                    seen.iter().all(|&b| b == fill),
                    "the other process reads allocation {}'s bytes ({fill})",
                    m.alloc
                );
            }
        }
    }

    fn teardown(s: Sut, _model: Model) {
        let Sut {
            sim,
            made: _,
            ctx,
            other,
            other_rt,
            other_ctx,
            handles,
            guards,
            exports,
            stream,
            in_flight,
            _rt,
        } = s;
        for queued in in_flight {
            queued.wait().expect("settle at the end");
        }
        drop(stream);
        drop(exports);
        drop(handles);
        drop(guards);
        ctx.reset().expect("final reset");
        ctx.deallocations().unwrap().flush().expect("final flush");
        let leaks = sim.leak_report();
        assert!(leaks.no_memory_leaked(), "after the final reset: {leaks}");
        assert!(
            sim.rejected_frees().is_empty(),
            "{:?}",
            sim.rejected_frees()
        );
        drop((other_ctx, other_rt));
        assert!(other.leak_report().is_clean(), "{}", other.leak_report());
        drop((ctx, _rt));
        assert!(sim.leak_report().is_clean(), "{}", sim.leak_report());
    }
}
