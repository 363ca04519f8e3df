//! IPC of `vmm-pool`'s memory between simulated processes: memory allocated to share
//! (`memalloc_shared`) exported as the file descriptor of its physical memory, sent over a
//! real Unix socket, mapped by the other process, which reaches that memory and nothing else;
//! the refusals where that cannot work (the pool's own blocks among them); and a property test
//! of random exports, opens and drops.
//!
//! `PROPTEST_CASES` sets the number of cases of the property test (CI: 32).

use std::os::unix::net::UnixStream;
use std::sync::Arc;

use driver_mock::{Op, SimConfig, SimDeviceConfig, SimDriver};
use emm::contract::MappedExport;
use emm::{Context, EmmError, MemoryPointer};
use proptest::prelude::*;

use crate::common::runtime_with;

/// `export` after a trip over a socket pair, as the other process receives it.
fn across(export: &MappedExport) -> MappedExport {
    let (a, b) = UnixStream::pair().unwrap();
    export.send(&a).unwrap();
    MappedExport::receive(&b).unwrap()
}

fn read(ctx: &Context, memory: &MemoryPointer) -> Vec<u8> {
    let mut out = vec![0u8; memory.size()];
    ctx.copy_to_host(&mut out, memory).unwrap();
    out
}

/// Memory allocated to share reaches the other process whole, as a view of it: it reads the
/// exporter's bytes, its write lands in the exporter's memory, and once it drops its pointer
/// it holds nothing.
#[test]
fn shared_memory_opens_in_the_other_process() {
    let sim = Arc::new(SimDriver::new(SimConfig::single(1 << 30)));
    let rt = runtime_with(&sim, "vmm-pool");
    let ctx = rt.context(0).unwrap();
    let _first = ctx.memalloc(1 << 20).unwrap();
    let size = 100 << 20;
    let big = ctx.memalloc_shared(size).unwrap();
    let bytes: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
    ctx.copy_to_device(&big, &bytes).unwrap();
    let view = big.view(4096, Some(size - 4096)).unwrap();
    let export = ctx.export_mapped(&view).unwrap();
    assert_eq!(
        export.pieces(),
        [size],
        "one piece: the allocation's own memory"
    );
    assert_eq!((export.offset(), export.size()), (4096, size - 8192));
    let received = across(&export);
    drop(export);

    let other = Arc::new(sim.spawn_process());
    {
        let ort = runtime_with(&other, "default");
        let octx = ort.context(0).unwrap();
        let theirs = octx.open_mapped(received).unwrap();
        assert_eq!(theirs.size(), size - 8192);
        assert_eq!(read(&octx, &theirs), bytes[4096..size - 4096]);
        octx.copy_to_device(&theirs.view(0, Some(16)).unwrap(), &[7u8; 16])
            .unwrap();
        drop(theirs);
        assert_eq!(other.count(Op::MemUnmap), other.count(Op::MemMap));
        assert_eq!(other.count(Op::MemAddressFree), 1);
    }
    assert!(other.leak_report().is_clean(), "{}", other.leak_report());
    let back = read(&ctx, &big);
    assert_eq!(&back[4096..4112], &[7u8; 16], "the importer's write landed");
    assert_eq!(back[4112..], bytes[4112..]);
}

/// The physical memory lives while the other process maps it, also after the exporter's
/// context went: the importer still reads it, and the device's memory comes back only at its
/// drop.
#[test]
fn an_opened_export_keeps_its_memory_past_the_exporter() {
    let sim = Arc::new(SimDriver::new(SimConfig::single(1 << 30)));
    let other = Arc::new(sim.spawn_process());
    {
        let ort = runtime_with(&other, "default");
        let octx = ort.context(0).unwrap();
        let free_at_start = octx.get_memory_info().unwrap().free;
        let theirs = {
            let rt = runtime_with(&sim, "vmm-pool");
            let ctx = rt.context(0).unwrap();
            let mem = ctx.memalloc_shared(8192).unwrap();
            ctx.copy_to_device(&mem, &[3u8; 8192]).unwrap();
            let export = ctx.export_mapped(&mem).unwrap();
            let theirs = octx.open_mapped(across(&export)).unwrap();
            drop(mem);
            theirs
        };
        assert!(sim.leak_report().is_clean(), "{}", sim.leak_report());
        assert_eq!(read(&octx, &theirs), vec![3u8; 8192]);
        assert!(octx.get_memory_info().unwrap().free < free_at_start);
        drop(theirs);
        assert_eq!(octx.get_memory_info().unwrap().free, free_at_start);
    }
    assert!(other.leak_report().is_clean(), "{}", other.leak_report());
}

/// The other process reaches the exported allocation and nothing else: memory allocated to
/// share is a piece of its own, which the pool's allocations made before and after it never
/// share, and which no later allocation reuses after the exporter frees it. The importer that
/// keeps its mapping past that free reads the allocation's last bytes, never a neighbour's or
/// a later allocation's. The pool's own blocks, whose pieces hold other allocations, are
/// refused with advice.
#[test]
fn an_importer_reaches_the_export_and_never_a_neighbour() {
    let sim = Arc::new(SimDriver::new(SimConfig::single(1 << 30)));
    let rt = runtime_with(&sim, "vmm-pool");
    let ctx = rt.context(0).unwrap();
    let before = ctx.memalloc(64).unwrap();
    ctx.memset(&before, 0xB1, 64).unwrap();
    let shared = ctx.memalloc_shared(64).unwrap();
    ctx.memset(&shared, 0x5A, 64).unwrap();
    let after = ctx.memalloc(64).unwrap();
    ctx.memset(&after, 0xA2, 64).unwrap();
    // A pool block is refused: its piece holds `before` and `after` too.
    let e = ctx.export_mapped(&before).unwrap_err();
    assert!(matches!(e, EmmError::InvalidArgument { .. }), "{e}");
    assert!(e.to_string().contains("Context::memalloc_shared"), "{e}");

    let export = ctx.export_mapped(&shared).unwrap();
    let piece = export.pieces()[0];
    assert_eq!(piece, 2 << 20, "the granularity: a piece of its own");
    let other = Arc::new(sim.spawn_process());
    {
        let ort = runtime_with(&other, "default");
        let octx = ort.context(0).unwrap();
        let theirs = octx.open_mapped(across(&export)).unwrap();
        drop(export);
        assert_eq!(read(&octx, &theirs), vec![0x5A; 64]);
        // The whole piece the other process could map holds the export's bytes and zeros:
        // neither neighbour's.
        let whole = octx.memalloc(piece).unwrap();
        let piece_view = unsafe_whole_piece(&octx, &theirs, piece);
        octx.copy_device(&whole, &piece_view, piece).unwrap();
        drop(piece_view);
        let seen = read(&octx, &whole);
        assert!(seen[..64].iter().all(|&b| b == 0x5A));
        assert!(
            seen[64..].iter().all(|&b| b == 0),
            "the piece holds nothing else"
        );
        // The exporter frees the shared allocation; new allocations of every size never land
        // in its piece, and the importer keeps reading the allocation's bytes.
        drop(shared);
        let later: Vec<_> = (0..8)
            .map(|k| {
                let m = ctx.memalloc(1 << (12 + k)).unwrap();
                ctx.memset(&m, 0xEE, m.size()).unwrap();
                m
            })
            .collect();
        let again = ctx.memalloc_shared(64).unwrap();
        ctx.memset(&again, 0xEE, 64).unwrap();
        assert_eq!(
            read(&octx, &theirs),
            vec![0x5A; 64],
            "no later allocation reached it"
        );
        drop((later, again, theirs, whole));
    }
    assert!(other.leak_report().is_clean(), "{}", other.leak_report());
    drop((before, after));
}

/// The other process's view of the whole piece an export maps (the importer's own mapping,
/// extended to the piece: what a process that maps the descriptor itself reaches).
fn unsafe_whole_piece(octx: &Context, theirs: &MemoryPointer, piece: usize) -> MemoryPointer {
    // SAFETY: `open_mapped` maps the export's whole piece at its reservation, which starts at
    // the opened pointer (the export's offset is 0); `theirs` keeps the mapping, and the view
    // is dropped before it.
    unsafe { MemoryPointer::unowned(octx.device(), octx.handle(), theirs.device_ptr(), piece) }
}

/// Every refusal says what to do: managers other than `vmm-pool`, a driver that does not share
/// physical memory as file descriptors (where `vmm-pool` still allocates), `get_ipc_handle`
/// under `vmm-pool`, and an open in a context of another device (which maps nothing).
#[test]
fn what_cannot_be_exported_or_opened_is_refused_with_advice() {
    let sim = Arc::new(SimDriver::new(SimConfig::single(256 << 20)));
    let rt = runtime_with(&sim, "pool");
    let ctx = rt.context(0).unwrap();
    let mem = ctx.memalloc(4096).unwrap();
    let e = ctx.export_mapped(&mem).unwrap_err();
    assert!(matches!(e, EmmError::NotSupported { .. }), "{e}");
    assert!(e.to_string().contains("get_ipc_handle"), "{e}");

    let no_fds = Arc::new(SimDriver::new(SimConfig::with_devices(vec![
        SimDeviceConfig::new(256 << 20).posix_fd_handles(false),
    ])));
    let rt = runtime_with(&no_fds, "vmm-pool");
    let ctx = rt.context(0).unwrap();
    let mem = ctx.memalloc_shared(4096).unwrap();
    let e = ctx.export_mapped(&mem).unwrap_err();
    assert!(
        e.to_string()
            .contains("CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"),
        "{e}"
    );
    let e = ctx.get_ipc_handle(&mem).unwrap_err();
    assert!(e.to_string().contains("Context::memalloc_shared"), "{e}");
    let e = runtime_with(&sim, "pool")
        .context(0)
        .unwrap()
        .memalloc_shared(64)
        .unwrap_err();
    assert!(matches!(e, EmmError::NotSupported { .. }), "{e}");
    assert!(e.to_string().contains("vmm-pool"), "{e}");

    let two = Arc::new(SimDriver::new(SimConfig::with_devices(vec![
        SimDeviceConfig::new(256 << 20),
        SimDeviceConfig::new(256 << 20),
    ])));
    let rt = runtime_with(&two, "vmm-pool");
    let mem = rt.context(0).unwrap().memalloc_shared(4096).unwrap();
    let export = rt.context(0).unwrap().export_mapped(&mem).unwrap();
    let other = Arc::new(two.spawn_process());
    let ort = runtime_with(&other, "default");
    let e = ort
        .context(1)
        .unwrap()
        .open_mapped(across(&export))
        .unwrap_err();
    assert!(e.to_string().contains("device_with_identity"), "{e}");
    assert_eq!(other.count(Op::MemAddressReserve), 0);
    let e = ort
        .context(1)
        .unwrap()
        .export_mapped(&ort.context(1).unwrap().memalloc(64).unwrap())
        .unwrap_err();
    assert!(matches!(e, EmmError::NotSupported { .. }), "{e}");
}

/// One step of the property test.
#[derive(Clone, Debug)]
enum Step {
    /// Allocate this many KiB (from 2049, 8 KiB steps up to 16 MiB) and fill them.
    Alloc(u32),
    /// Export the live allocation at an index and open it in the other process.
    Open(usize),
    /// Free the live allocation at an index (after the other process dropped its opens).
    Free(usize),
    /// The other process drops the open at an index.
    Close(usize),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (1u32..=4096).prop_map(Step::Alloc),
        3 => any::<usize>().prop_map(Step::Open),
        2 => any::<usize>().prop_map(Step::Free),
        2 => any::<usize>().prop_map(Step::Close),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: crate::common::cases(if cfg!(miri) { 2 } else { 32 }),
        failure_persistence: None,
        rng_seed: crate::common::seed(),
        ..ProptestConfig::default()
    })]

    /// Whatever is allocated to share, exported, opened and dropped, in any order: every open
    /// reads its allocation's bytes (also after the exporter freed it and allocated more), and
    /// once everything is dropped the other process holds nothing and every physical
    /// allocation was released.
    #[test]
    fn random_exports_open_to_the_exporters_bytes(steps in prop::collection::vec(step(), 1..40)) {
        let sim = Arc::new(SimDriver::new(SimConfig::single(2 << 30)));
        let rt = runtime_with(&sim, "vmm-pool");
        let ctx = rt.context(0).unwrap();
        let other = Arc::new(sim.spawn_process());
        {
            let ort = runtime_with(&other, "default");
            let octx = ort.context(0).unwrap();
            let mut live: Vec<(MemoryPointer, u8)> = Vec::new();
            // Opens in the other process: the pointer and the index of its allocation's fill.
            let mut opens: Vec<(MemoryPointer, u8)> = Vec::new();
            let mut fill = 0u8;
            for s in &steps {
                match *s {
                    Step::Alloc(k) => {
                        let bytes = if k > 2048 { (k as usize - 2048) << 13 } else { (k as usize) << 10 };
                        fill = fill.wrapping_add(1);
                        let mem = ctx.memalloc_shared(bytes).unwrap();
                        ctx.memset(&mem, fill, bytes).unwrap();
                        live.push((mem, fill));
                    }
                    Step::Open(i) if !live.is_empty() => {
                        let (mem, f) = &live[i % live.len()];
                        let theirs = octx.open_mapped(across(&ctx.export_mapped(mem).unwrap())).unwrap();
                        prop_assert_eq!(theirs.size(), mem.size());
                        opens.push((theirs, *f));
                    }
                    Step::Close(i) if !opens.is_empty() => {
                        let (theirs, f) = opens.swap_remove(i % opens.len());
                        let seen = read(&octx, &theirs);
                        prop_assert!(seen.iter().all(|&b| b == f), "an open saw other bytes than its allocation's");
                    }
                    Step::Free(i) if !live.is_empty() => {
                        // Opens may outlive the free: they keep reading the allocation's
                        // bytes, whatever the exporter allocates next.
                        drop(live.swap_remove(i % live.len()));
                    }
                    _ => {}
                }
            }
            for (theirs, f) in opens.drain(..) {
                prop_assert!(read(&octx, &theirs).iter().all(|&b| b == f));
            }
        }
        prop_assert!(other.leak_report().is_clean(), "{}", other.leak_report());
        drop(ctx);
        rt.context(0).unwrap().trim().unwrap();
        prop_assert_eq!(sim.count(Op::MemCreate), sim.count(Op::MemRelease));
    }
}
