//! Hostile and bad input, as property tests (the same inputs the fuzz targets in `fuzz/` take):
//! IPC handle bytes from another process, allocation and pin sizes, view offsets and copy
//! lengths, and environment configuration. Nothing may panic; every refusal is a clear error.
//! 256 cases each; `PROPTEST_CASES=N` for more.

use std::sync::Arc;

use driver_mock::{SimConfig, SimDriver};
use driver_sys::{IpcMemHandle, PoolPtrExportData};
use emm::contract::{DeviceIdentity, IpcMemory, PoolExport, PoolId};
use emm::plugin::DeallocConfig;
use emm::{EmmError, IpcHandle, PinnableBuffer, Runtime};
use proptest::prelude::*;

/// What a handle names: a `cuIpcGetMemHandle` allocation or a pool allocation.
fn memory() -> impl Strategy<Value = IpcMemory> {
    let driver_bytes = prop::array::uniform32(any::<u8>()).prop_map(|raw| {
        let mut b = [0u8; 64];
        b[..32].copy_from_slice(&raw);
        b
    });
    (
        driver_bytes,
        proptest::option::of(prop::array::uniform16(any::<u8>())),
    )
        .prop_map(|(b, pool)| match pool {
            None => IpcMemory::Allocation(IpcMemHandle(b)),
            Some(p) => IpcMemory::PoolAllocation {
                pool: PoolId(p),
                data: PoolPtrExportData(b),
            },
        })
}

/// A file descriptor to hand to `PoolExport::from_descriptor` (one end of a pipe).
fn some_fd() -> std::os::fd::OwnedFd {
    let (reader, _writer) = std::io::pipe().unwrap();
    reader.into()
}

fn identity() -> impl Strategy<Value = Option<DeviceIdentity>> {
    proptest::option::of(
        (any::<i32>(), any::<i32>(), any::<i32>()).prop_map(|(a, b, c)| DeviceIdentity {
            pci_domain_id: a,
            pci_bus_id: b,
            pci_device_id: c,
        }),
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: crate::common::cases(256), failure_persistence: None, ..ProptestConfig::default() })]

    /// Any bytes: a handle or a clear error, never a panic.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        match IpcHandle::from_bytes(&bytes) {
            Ok(h) => prop_assert_eq!(h.to_bytes(), bytes, "what decodes re-encodes to the same bytes"),
            Err(e) => {
                let invalid = matches!(e, EmmError::InvalidIpcHandle { .. });
                prop_assert!(invalid, "{}", e);
                prop_assert!(e.to_string().contains("IpcHandle::to_bytes"), "{}", e);
            }
        }
    }

    /// Every well-formed handle round-trips; every truncation of it is refused.
    #[test]
    fn handles_round_trip_and_truncations_are_refused(
        memory in memory(),
        size in 0usize..(1 << 40),
        offset in 0usize..(1 << 40),
        source in identity(),
        cut in 0usize..118,
    ) {
        let h = IpcHandle::new(memory, size, offset, source);
        let bytes = h.to_bytes();
        let back = IpcHandle::from_bytes(&bytes).unwrap();
        prop_assert_eq!(back.size(), size);
        prop_assert_eq!(back.offset(), offset);
        prop_assert_eq!(back.source(), source);
        prop_assert_eq!(back.handle(), h.handle());
        prop_assert!(!back.is_exporter());
        prop_assert!(IpcHandle::from_bytes(&bytes[..cut]).is_err());
    }

    /// One garbled byte anywhere: a handle (the byte was inside the payload) or a clear error.
    #[test]
    fn a_garbled_byte_is_survived(at in 0usize..118, value in any::<u8>(), size in 0usize..4096, memory in memory()) {
        let h = IpcHandle::new(memory, size, 0, None);
        let mut bytes = h.to_bytes();
        bytes[at] = value;
        if let Ok(back) = IpcHandle::from_bytes(&bytes) {
            prop_assert_eq!(back.to_bytes(), bytes);
        }
    }

    /// A pool export's descriptor bytes: any bytes decode or are refused with a clear error;
    /// a real descriptor round-trips, and each truncation of it is refused.
    #[test]
    fn pool_descriptors_round_trip_or_are_refused(
        bytes in prop::collection::vec(any::<u8>(), 0..64),
        id in prop::array::uniform16(any::<u8>()),
        source in identity(),
        cut in 0usize..emm::contract::POOL_DESCRIPTOR_LEN,
    ) {
        match PoolExport::from_descriptor(&bytes, some_fd()) {
            Ok(e) => prop_assert_eq!(e.descriptor().to_vec(), bytes),
            Err(e) => prop_assert!(e.to_string().contains("pool export descriptor is invalid"), "{}", e),
        }
        let source = source.unwrap_or(DeviceIdentity { pci_domain_id: 0, pci_bus_id: 1, pci_device_id: 2 });
        let mut real = Vec::from(&b"EMMPOOL\x01\x00"[..]);
        real.extend_from_slice(&id);
        for v in [source.pci_domain_id, source.pci_bus_id, source.pci_device_id] {
            real.extend_from_slice(&v.to_le_bytes());
        }
        let e = PoolExport::from_descriptor(&real, some_fd()).unwrap();
        prop_assert_eq!(e.id(), PoolId(id));
        prop_assert_eq!(e.source(), source);
        prop_assert_eq!(e.descriptor().to_vec(), real.clone());
        prop_assert!(PoolExport::from_descriptor(&real[..cut], some_fd()).is_err());
    }

    /// Environment values: parsed exactly when they are what the variable accepts.
    #[test]
    fn environment_values_never_panic(count in ".{0,24}", ratio in ".{0,24}", name in ".{0,24}") {
        let lookup = |var: &str| match var {
            "EMM_MAX_PENDING_DEALLOCS_COUNT" => Some(count.clone()),
            "EMM_MAX_PENDING_DEALLOCS_RATIO" => Some(ratio.clone()),
            "EMM_MEMORY_MANAGER" => Some(name.clone()),
            _ => None,
        };
        match DeallocConfig::from_lookup(lookup) {
            Ok(c) => {
                prop_assert_eq!(Some(c.max_count), count.trim().parse::<usize>().ok());
                prop_assert!(c.max_ratio.is_finite() && c.max_ratio >= 0.0);
            }
            Err(e) => prop_assert!(e.to_string().contains("or unset it"), "{}", e),
        }
        match emm::internals::config::manager_name_from_lookup(lookup) {
            Ok(n) => prop_assert_eq!(n, Some(name.trim().to_owned())),
            Err(e) => prop_assert!(name.trim().is_empty(), "{}", e),
        }
    }

    /// Sizes, views and copy lengths at the edges (0, 1, huge, past the end): typed errors, and
    /// nothing outside the allocation is touched.
    #[test]
    fn sizes_views_and_copies_at_the_edges(
        size in prop_oneof![Just(0usize), Just(1), Just(usize::MAX), Just(usize::MAX / 2), 1usize..(64 << 10)],
        start in prop_oneof![Just(0usize), Just(usize::MAX), 0usize..(80 << 10)],
        stop in proptest::option::of(prop_oneof![Just(0usize), Just(usize::MAX), 0usize..(80 << 10)]),
        copy in prop_oneof![Just(0usize), 0usize..(80 << 10)],
    ) {
        let sim = Arc::new(SimDriver::new(SimConfig::single(256 << 20)));
        let rt = Runtime::builder(sim.clone()).ignore_env().build().unwrap();
        let ctx = rt.context(0).unwrap();
        match ctx.memalloc(size) {
            Err(e) => prop_assert!(size == 0 || e.is_out_of_memory(), "size {}: {}", size, e),
            Ok(m) => {
                prop_assert!(size > 0 && size < (256 << 20));
                let end = stop.unwrap_or(m.size());
                match m.view(start, stop) {
                    Ok(v) => {
                        prop_assert!(start <= end && end <= m.size());
                        prop_assert_eq!(v.size(), end - start);
                        let data = vec![0xA5u8; copy];
                        match ctx.copy_to_device(&v, &data) {
                            Ok(()) => prop_assert!(copy <= v.size()),
                            Err(e) => {
                                let refused = matches!(e, EmmError::OutOfBounds { .. });
                                prop_assert!(refused && copy > v.size(), "{}", e);
                            }
                        }
                    }
                    Err(e) => {
                        let refused = matches!(e, EmmError::OutOfBounds { .. });
                        prop_assert!(refused && (start > end || end > m.size()), "{}", e);
                    }
                }
            }
        }
        // Pins of edge sizes: an empty buffer is refused as such, every other one pinned whole.
        let pinned = size.min(64 << 10);
        let buffer = Arc::new(PinnableBuffer::zeroed(pinned));
        match ctx.pin(buffer, start % 2 == 0) {
            Ok(p) => prop_assert!(pinned > 0 && p.size() == pinned, "pinned {} of {}", p.size(), pinned),
            Err(e) => prop_assert!(
                pinned == 0 && matches!(e, EmmError::ZeroSize { what: "mempin" }),
                "{} bytes: {}", pinned, e
            ),
        }
        let failed: Vec<_> = sim.calls().into_iter().filter(|c| c.outcome.is_err() && !matches!(c.op, driver_mock::Op::MemAlloc | driver_mock::Op::MemHostRegister)).collect();
        prop_assert!(failed.is_empty(), "{:?}", failed);
    }
}

/// Handle bytes that point at memory which no longer exists: a clear error in the other
/// process, not a crash or a mapping of whatever is there now.
#[test]
fn a_handle_to_freed_memory_is_refused() {
    let sim = Arc::new(SimDriver::new(SimConfig::default()));
    let rt = Runtime::builder(sim.clone()).ignore_env().build().unwrap();
    let ctx = rt.context(0).unwrap();
    let mem = ctx.memalloc(4096).unwrap();
    let bytes = ctx.get_ipc_handle(&mem).unwrap().to_bytes();
    drop(mem);
    ctx.deallocations().unwrap().flush().unwrap();
    let other = Arc::new(sim.spawn_process());
    let other_rt = Runtime::builder(other.clone())
        .ignore_env()
        .build()
        .unwrap();
    let other_ctx = other_rt.context(0).unwrap();
    let handle = IpcHandle::from_bytes(&bytes).unwrap();
    let err = handle.open(&other_rt, &other_ctx).unwrap_err();
    assert_eq!(
        err.driver_kind(),
        Some(driver_sys::ErrorKind::InvalidValue),
        "{err}"
    );
    assert!(!handle.is_open());
    assert!(other.leak_report().ipc_mappings.is_empty());
}

/// A forged handle that claims more than the allocation it names (offset or size garbled in
/// transit) is refused, and the mapping it opened is closed again.
#[test]
fn a_handle_claiming_more_than_its_allocation_is_refused() {
    let sim = Arc::new(SimDriver::new(SimConfig::default()));
    let rt = Runtime::builder(sim.clone()).ignore_env().build().unwrap();
    let ctx = rt.context(0).unwrap();
    let mem = ctx.memalloc(4096).unwrap();
    let real = ctx.get_ipc_handle(&mem).unwrap();
    let other = Arc::new(sim.spawn_process());
    let other_rt = Runtime::builder(other.clone())
        .ignore_env()
        .build()
        .unwrap();
    let other_ctx = other_rt.context(0).unwrap();
    for (size, offset) in [(4097, 0), (16, 4090), (1, usize::MAX / 2)] {
        let forged = IpcHandle::new(*real.handle(), size, offset, None);
        let forged = IpcHandle::from_bytes(&forged.to_bytes()).unwrap();
        let err = forged.open_direct(&other_ctx).unwrap_err();
        assert!(matches!(err, EmmError::InvalidIpcHandle { .. }), "{err:?}");
        assert!(
            err.to_string()
                .contains("the allocation it names has 4096 bytes"),
            "{err}"
        );
        assert!(
            other.leak_report().ipc_mappings.is_empty(),
            "the mapping was closed again"
        );
    }
}

/// A log that names more live bytes than a `usize` holds (found by the `alloc_log` fuzz
/// target): its summary saturates at `usize::MAX` instead of overflowing.
#[test]
fn a_log_larger_than_memory_summarizes_without_overflow() {
    let text = "Thread,Time,Action,Pointer,Size,Stream,Kind\n\
                0,0,allocate,0x10,18446744073709551615,0x0,device\n\
                0,0,allocate,0x20,18446744073709551615,0x0,device\n\
                0,0,free,0x10,18446744073709551615,0x0,device\n";
    let events = emm::replay::parse_log(text).unwrap();
    let summary = emm::replay::summarize(&events);
    assert_eq!(summary.peak_live_bytes, usize::MAX);
    assert_eq!((summary.allocations, summary.frees), (2, 1));
}

/// Requests near `usize::MAX` (found by the `alloc_log` fuzz target, replaying a log on the
/// pool): every manager refuses them with a typed error, on a stream and off it, where the
/// rounding of a block's size overflowed.
#[test]
#[cfg_attr(
    miri,
    ignore = "the overflow it guards against is arithmetic on the request's size, which the \
              native debug run checks as well (overflow panics); under Miri its five managers' \
              error paths took a minute of the CI job's Miri step"
)]
fn requests_near_the_largest_size_are_refused_under_every_manager() {
    for manager in [
        "default",
        "pool",
        "vmm-pool",
        "async-pool",
        "async-pool-ipc",
    ] {
        let sim = std::sync::Arc::new(driver_mock::SimDriver::new(driver_mock::SimConfig::single(
            64 << 20,
        )));
        let rt = crate::common::runtime_with(&sim, manager);
        let ctx = rt.context(0).unwrap();
        let s = ctx.create_stream().unwrap();
        for size in [usize::MAX, usize::MAX - 255, usize::MAX / 2 + 1, 1 << 62] {
            let e = ctx.memalloc(size).expect_err("no device holds it");
            assert!(
                e.is_out_of_memory() || matches!(e, emm::EmmError::InvalidArgument { .. }),
                "{manager} {size}: {e:?}"
            );
            if ctx.stream_ordering() != emm::contract::StreamOrdering::Unsupported {
                let e = ctx.memalloc_on(size, &s).expect_err("no device holds it");
                assert!(
                    e.is_out_of_memory() || matches!(e, emm::EmmError::InvalidArgument { .. }),
                    "{manager} {size} on a stream: {e:?}"
                );
            }
        }
        // The context still serves ordinary requests.
        drop(ctx.memalloc_on(1 << 20, &s).unwrap());
    }
}
