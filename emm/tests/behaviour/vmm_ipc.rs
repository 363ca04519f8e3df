//! IPC of `vmm-pool`'s memory between simulated processes: an allocation exported as the file
//! descriptors of the chunks it lies across, sent over a real Unix socket, mapped by the
//! other process; the refusals where that cannot work; and a property test of random exports,
//! opens and drops.
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

/// An allocation that lies across two chunks (the second grew the pool in place) reaches the
/// other process whole: it reads the exporter's bytes, its write lands in the exporter's
/// memory, and once it drops its pointer it holds nothing.
#[test]
fn an_allocation_across_chunks_opens_in_the_other_process() {
    let sim = Arc::new(SimDriver::new(SimConfig::single(1 << 30)));
    let rt = runtime_with(&sim, "vmm-pool");
    let ctx = rt.context(0).unwrap();
    let _first = ctx.memalloc(1 << 20).unwrap();
    let size = 100 << 20;
    let big = ctx.memalloc(size).unwrap();
    let bytes: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
    ctx.copy_to_device(&big, &bytes).unwrap();
    let view = big.view(4096, Some(size - 4096)).unwrap();
    let export = ctx.export_mapped(&view).unwrap();
    assert!(
        export.pieces().len() >= 2,
        "the allocation lies across {:?}",
        export.pieces()
    );
    assert_eq!(export.size(), size - 8192);
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
            let mem = ctx.to_device(&[3u8; 8192]).unwrap();
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

/// An export carries one file descriptor per 2 MiB piece, at most 4096 of them: a larger
/// allocation is refused with advice, and a view within the limit exports.
#[test]
fn an_export_of_more_pieces_than_one_carries_is_refused_with_advice() {
    let sim = Arc::new(SimDriver::new(SimConfig::single(16 << 30)));
    let rt = runtime_with(&sim, "vmm-pool");
    let ctx = rt.context(0).unwrap();
    let size = (8 << 30) + (4 << 20);
    let big = ctx.memalloc(size).unwrap();
    let e = ctx.export_mapped(&big).unwrap_err();
    assert!(matches!(e, EmmError::InvalidArgument { .. }), "{e}");
    let text = e.to_string();
    assert!(text.contains("more than 4096 pieces"), "{e}");
    assert!(text.contains("export views of at most"), "{e}");
    assert!(text.contains("async-pool-ipc"), "{e}");
    let view = big.view(0, Some(64 << 20)).unwrap();
    let export = ctx.export_mapped(&view).unwrap();
    assert_eq!(export.pieces().len(), 32, "64 MiB in pieces of 2 MiB");
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
    let mem = ctx.to_device(&[1u8; 4096]).unwrap();
    let e = ctx.export_mapped(&mem).unwrap_err();
    assert!(
        e.to_string()
            .contains("CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"),
        "{e}"
    );
    let e = ctx.get_ipc_handle(&mem).unwrap_err();
    assert!(e.to_string().contains("Context::export_mapped"), "{e}");

    let two = Arc::new(SimDriver::new(SimConfig::with_devices(vec![
        SimDeviceConfig::new(256 << 20),
        SimDeviceConfig::new(256 << 20),
    ])));
    let rt = runtime_with(&two, "vmm-pool");
    let mem = rt.context(0).unwrap().memalloc(4096).unwrap();
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

    /// Whatever is allocated, exported, opened and dropped: every open reads its allocation's
    /// bytes, and once everything is dropped the other process holds nothing and the pool
    /// gives back every chunk at a trim.
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
                        let mem = ctx.memalloc(bytes).unwrap();
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
                        let (mem, f) = live.swap_remove(i % live.len());
                        // The driver's rule: the importer closes before the exporter frees.
                        opens.retain(|(_, g)| *g != f);
                        drop(mem);
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
