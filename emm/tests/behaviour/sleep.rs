//! Putting a context's memory to sleep and waking it (`Context::sleep` / `wake`) under
//! `vmm-pool`: every address stays valid, offloaded allocations come back bit for bit, kept
//! ones stay usable, sleeping memory is refused by emm and faults for anyone else (the
//! simulator models reserved addresses with nothing mapped), the device holds only what was
//! asked to stay; the other managers refuse; and a property test of random programs of
//! allocations, writes, frees, sleeps with random choices per tag, trims and wakes.
//!
//! `PROPTEST_CASES` sets the number of cases of the property test (CI: 24).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use driver_mock::{Fault, Op, SimConfig, SimDriver};
use emm::contract::{SleepChoice, SleepOptions};
use emm::driver_sys::ErrorKind;
use emm::internals::config::vmm_piece_from_lookup;
use emm::{Adaptor, Context, EmmError, MemoryPointer, Runtime, Tag};
use proptest::prelude::*;

use crate::common::{cases, runtime_with, seed};
use crate::vmm_pool::vmm_runtime;

/// The simulator's physical piece: every `vmm-pool` mapping is made of these.
const PIECE: u64 = 2 << 20;

/// A runtime over `sim` with `vmm-pool` under the `history` adaptor, which records every
/// allocation's tag.
fn vmm_with_history(sim: &Arc<SimDriver>) -> Runtime {
    vmm_with_history_and_pieces(sim, Some(PIECE as usize))
}

/// [`vmm_with_history`] with physical pieces of `piece` bytes (`None`: chosen per growth).
fn vmm_with_history_and_pieces(sim: &Arc<SimDriver>, piece: Option<usize>) -> Runtime {
    let history = Adaptor::History {
        events: 1000,
        stacks: false,
    };
    vmm_runtime(sim, piece, vec![history])
}

/// Device memory in use on the simulated device: what the manager holds from the driver.
fn device_used(ctx: &Context) -> usize {
    let info = ctx.get_memory_info().unwrap();
    info.total - info.free
}

/// `bytes` of device memory under `tag`, filled with `fill`.
fn tagged(ctx: &Context, tag: &str, bytes: usize, fill: u8) -> MemoryPointer {
    let _scope = Tag::named(tag).scope();
    let mem = ctx.memalloc(bytes).unwrap();
    ctx.copy_to_device(&mem, &vec![fill; bytes]).unwrap();
    mem
}

fn read(ctx: &Context, mem: &MemoryPointer) -> Vec<u8> {
    let mut out = vec![0u8; mem.size()];
    ctx.copy_to_host(&mut out, mem).unwrap();
    out
}

/// The pieces (by index) of `piece` bytes that `len` bytes at `at` lie in.
fn pieces_of(at: u64, len: usize, piece: u64) -> std::ops::Range<u64> {
    at / piece..(at + len as u64).div_ceil(piece)
}

/// The physical memory mapped on the simulated device now, from its log of calls: size by
/// address (every mapping of `vmm-pool`'s is one piece, unmapped whole).
fn mapped_pieces(sim: &SimDriver) -> BTreeMap<u64, usize> {
    let mut mapped = BTreeMap::new();
    for call in sim.calls().into_iter().filter(|c| c.outcome.is_ok()) {
        match (call.op, call.ptr, call.bytes) {
            (Op::MemMap, Some(ptr), Some(bytes)) => {
                mapped.insert(ptr.0, bytes);
            }
            (Op::MemUnmap, Some(ptr), _) => {
                mapped.remove(&ptr.0);
            }
            _ => {}
        }
    }
    mapped
}

/// Allocations larger than this are written and read at their two ends only (64 KiB each),
/// so that a program of large allocations stays quick.
const WHOLE_UP_TO: usize = 8 << 20;

/// The bytes of `mem` a program writes and reads, as (offset, length).
fn probed(mem: &MemoryPointer) -> Vec<(usize, usize)> {
    let n = mem.size();
    if n <= WHOLE_UP_TO {
        vec![(0, n)]
    } else {
        vec![(0, 64 << 10), (n - (64 << 10), 64 << 10)]
    }
}

/// Writes `fill` over the probed bytes of `mem` ([`probed`]).
fn write_probed(ctx: &Context, mem: &MemoryPointer, fill: u8) -> Result<(), EmmError> {
    for (at, len) in probed(mem) {
        ctx.copy_to_device(&mem.view(at, Some(at + len))?, &vec![fill; len])?;
    }
    Ok(())
}

/// Reads the probed bytes of `mem` ([`probed`]).
fn read_probed(ctx: &Context, mem: &MemoryPointer) -> Result<Vec<u8>, EmmError> {
    let mut out = Vec::new();
    for (at, len) in probed(mem) {
        let mut part = vec![0u8; len];
        ctx.copy_to_host(&mut part, &mem.view(at, Some(at + len))?)?;
        out.extend(part);
    }
    Ok(out)
}

/// One allocation of each choice: the offloaded one comes back whole, the kept one is usable
/// throughout, the device holds only the kept one's pieces while asleep, and emm refuses
/// sleeping memory and allocations until the wake.
#[test]
fn each_choice_does_what_it_says() {
    let sim = Arc::new(SimDriver::new(SimConfig::single(1 << 30)));
    let rt = vmm_with_history(&sim);
    let ctx = rt.context(0).unwrap();
    let weights = tagged(&ctx, "weights", 24 << 20, 0x5A);
    let cache = tagged(&ctx, "kv-cache", 16 << 20, 0x33);
    let keep = tagged(&ctx, "pinned-state", 3 << 20, 0x77);
    let scratch = tagged(&ctx, "untagged-scratch", 5 << 20, 0x11);
    let before = device_used(&ctx);
    let options = SleepOptions::new(SleepChoice::Discard)
        .with_tag(Tag::named("weights"), SleepChoice::Offload)
        .with_tag(Tag::named("pinned-state"), SleepChoice::Keep);

    let report = ctx.sleep(&options).unwrap();
    assert!(ctx.is_asleep());
    assert_eq!(report.offloaded_bytes, 24 << 20);
    assert_eq!(report.kept_bytes, 3 << 20);
    assert_eq!(report.discarded_bytes, (16 + 5) << 20);
    assert_eq!(
        report.held_before, before,
        "the pool's pieces are the device's use"
    );
    let kept: BTreeSet<u64> = pieces_of(keep.device_ptr().0, keep.size(), PIECE).collect();
    assert_eq!(report.held_asleep, kept.len() * PIECE as usize);
    assert_eq!(device_used(&ctx), report.held_asleep, "the rest went back");
    assert_eq!(
        sim.pinned_bytes(),
        24 << 20,
        "the offloaded bytes, in host memory"
    );

    // emm refuses sleeping memory and new allocations; kept memory works as before.
    let sleeping = |e: EmmError| matches!(e, EmmError::Sleep { .. });
    let mut out = vec![0u8; 16];
    let refused = ctx.copy_to_host(&mut out, &weights.view(0, Some(16)).unwrap());
    assert!(refused.is_err_and(sleeping));
    assert!(ctx.memalloc(1 << 20).is_err_and(sleeping));
    assert!(ctx.sleep(&options).is_err_and(sleeping), "asleep already");
    assert_eq!(read(&ctx, &keep), vec![0x77; 3 << 20]);
    ctx.copy_to_device(&keep, &vec![0x78; 3 << 20]).unwrap();
    // Anyone else's access (a kernel, another library's copy) faults: nothing is mapped.
    let driver = rt.driver();
    let mut raw = vec![0u8; 64];
    // SAFETY: a read of 64 bytes at the start of a live allocation of this context (asleep:
    // the driver refuses it, which is what the test shows).
    let fault = unsafe { driver.memcpy_dtoh(ctx.handle(), &mut raw, cache.device_ptr()) };
    assert!(fault.is_err(), "sleeping memory has nothing mapped");

    let woke = ctx.wake().unwrap();
    assert!(!ctx.is_asleep());
    assert_eq!(woke.restored_bytes, 24 << 20);
    assert_eq!(woke.mapped_bytes, report.held_before - report.held_asleep);
    assert_eq!(woke.held_after, before);
    assert_eq!(device_used(&ctx), before);
    assert_eq!(sim.pinned_bytes(), 0, "the host copy went at the wake");
    assert_eq!(
        read(&ctx, &weights),
        vec![0x5A; 24 << 20],
        "offloaded: bit for bit"
    );
    assert_eq!(
        read(&ctx, &keep),
        vec![0x78; 3 << 20],
        "kept: the write during the sleep"
    );
    // Discarded memory is usable again, its contents undefined.
    ctx.copy_to_device(&cache, &vec![1; 16 << 20]).unwrap();
    assert_eq!(read(&ctx, &cache), vec![1; 16 << 20]);
    drop((weights, cache, keep, scratch));
    let more = ctx.memalloc(8 << 20).unwrap();
    assert!(ctx.wake().is_err_and(sleeping), "nothing to wake");
    drop(more);
    drop(ctx);
    drop(rt);
    assert!(sim.leak_report().is_clean(), "{}", sim.leak_report());
}

/// Only `vmm-pool` can sleep: the others refuse with advice, and stay awake.
#[test]
fn other_managers_refuse_and_stay_awake() {
    for manager in ["default", "pool", "async-pool"] {
        let sim = Arc::new(SimDriver::new(SimConfig::single(1 << 30)));
        let rt = runtime_with(&sim, manager);
        let ctx = rt.context(0).unwrap();
        let mem = ctx.memalloc(1 << 20).unwrap();
        let err = ctx.sleep(&SleepOptions::default()).unwrap_err();
        assert!(
            matches!(err, EmmError::NotSupported { .. }),
            "{manager}: {err}"
        );
        assert!(err.to_string().contains("vmm-pool"), "{manager}: {err}");
        assert!(!ctx.is_asleep(), "{manager}");
        let err = ctx.wake().unwrap_err();
        assert!(matches!(err, EmmError::Sleep { .. }), "{manager}: {err}");
        ctx.copy_to_device(&mem, &[1; 64]).unwrap();
        drop(ctx.memalloc(1 << 20).unwrap());
    }
}

/// Choices that differ by tag need every allocation's tag: refused without the `history`
/// adaptor (nothing changed), where one choice for all memory works.
#[test]
fn choices_by_tag_need_the_history_adaptor() {
    let sim = Arc::new(SimDriver::new(SimConfig::single(1 << 30)));
    let rt = runtime_with(&sim, "vmm-pool");
    let ctx = rt.context(0).unwrap();
    let mem = tagged(&ctx, "weights", 4 << 20, 9);
    let by_tag = SleepOptions::new(SleepChoice::Discard)
        .with_tag(Tag::named("weights"), SleepChoice::Offload);
    let err = ctx.sleep(&by_tag).unwrap_err();
    assert!(
        err.to_string().contains("EMM_MEMORY_ADAPTORS=history"),
        "{err}"
    );
    assert!(!ctx.is_asleep());
    assert_eq!(sim.count(Op::MemUnmap), 0, "nothing went back");
    let report = ctx.sleep(&SleepOptions::new(SleepChoice::Offload)).unwrap();
    assert_eq!(report.offloaded_bytes, 4 << 20);
    ctx.wake().unwrap();
    assert_eq!(read(&ctx, &mem), vec![9; 4 << 20]);
}

/// A reset while asleep gives everything up, the host copy too; the context is awake after
/// it and allocates as new. Frees and trims while asleep are taken, and the wake maps only
/// what is still the pool's.
#[test]
fn frees_trims_and_resets_while_asleep() {
    let sim = Arc::new(SimDriver::new(SimConfig::single(1 << 30)));
    let rt = runtime_with(&sim, "vmm-pool");
    let ctx = rt.context(0).unwrap();
    let a = tagged(&ctx, "a", 10 << 20, 1);
    let b = tagged(&ctx, "b", 10 << 20, 2);
    let slept = ctx.sleep(&SleepOptions::default()).unwrap();
    assert_eq!(slept.held_asleep, 0);
    drop(a);
    let trimmed = ctx.trim().unwrap();
    assert!(trimmed > 0, "the freed allocation's pieces left the pool");
    assert_eq!(
        device_used(&ctx),
        0,
        "a trim while asleep calls no driver for them"
    );
    let woke = ctx.wake().unwrap();
    assert!(woke.mapped_bytes < slept.held_before, "{woke:?} {slept:?}");
    assert_eq!(read(&ctx, &b), vec![2; 10 << 20]);

    ctx.sleep(&SleepOptions::default()).unwrap();
    ctx.reset().unwrap();
    assert!(!ctx.is_asleep(), "a reset ends the sleep");
    assert_eq!(sim.pinned_bytes(), 0, "the host copy went with the reset");
    assert_eq!(device_used(&ctx), 0);
    drop(b);
    let fresh = ctx.memalloc(1 << 20).unwrap();
    ctx.copy_to_device(&fresh, &[3; 1 << 20]).unwrap();
    drop(fresh);
    drop(ctx);
    drop(rt);
    assert!(sim.leak_report().is_clean(), "{}", sim.leak_report());
}

/// A sleep whose copies cannot be made (no host memory for them) leaves the context awake and
/// every piece mapped.
#[test]
fn a_failed_offload_leaves_the_context_awake() {
    let sim = Arc::new(SimDriver::new(SimConfig::single(1 << 30)));
    let rt = runtime_with(&sim, "vmm-pool");
    let ctx = rt.context(0).unwrap();
    let mem = tagged(&ctx, "w", 4 << 20, 5);
    let before = device_used(&ctx);
    sim.inject(Fault::nth(Op::MemHostAlloc, 1, ErrorKind::OutOfMemory));
    let err = ctx.sleep(&SleepOptions::default()).unwrap_err();
    assert!(err.to_string().contains("sleep"), "{err}");
    sim.clear_faults();
    assert!(!ctx.is_asleep());
    assert_eq!(device_used(&ctx), before);
    assert_eq!(read(&ctx, &mem), vec![5; 4 << 20]);
}

/// A graph whose captured work sets an offloaded allocation is refused while it sleeps (the
/// launch would fault on the device), and launches after the wake.
#[test]
fn a_graph_over_sleeping_memory_waits_for_the_wake() {
    let sim = Arc::new(SimDriver::new(SimConfig::single(1 << 30)));
    let rt = runtime_with(&sim, "vmm-pool");
    let ctx = rt.context(0).unwrap();
    let stream = ctx.create_stream().unwrap();
    let m = tagged(&ctx, "w", 1 << 20, 4);
    let (graph, ()) = ctx
        .capture(&stream, emm::driver_sys::CaptureMode::Global, |s| {
            ctx.memset_async(&m, 0xAB, s)?.wait()?;
            Ok(())
        })
        .unwrap();
    ctx.sleep(&SleepOptions::default()).unwrap();
    let err = graph.launch(&stream).unwrap_err();
    assert!(matches!(err, EmmError::Sleep { .. }), "{err}");
    ctx.wake().unwrap();
    assert_eq!(read(&ctx, &m), vec![4; 1 << 20], "nothing ran while asleep");
    graph.launch(&stream).unwrap();
    stream.synchronize().unwrap();
    assert_eq!(read(&ctx, &m), vec![0xAB; 1 << 20]);
}

/// One step of a random program.
#[derive(Clone, Debug)]
enum Step {
    /// Allocate `quarter_mib / 4` MiB (at least 64 KiB) under tag `tag` and fill it.
    Alloc { quarter_mib: usize, tag: usize },
    /// Write `fill` over the `i`-th live allocation (modulo their number).
    Write { i: usize, fill: u8 },
    /// Drop the `i`-th live allocation.
    Free { i: usize },
    /// Sleep with a choice per tag and one for the rest.
    Sleep {
        choices: [SleepChoice; TAGS],
        default: SleepChoice,
    },
    /// Trim the pool.
    Trim,
    /// Wake.
    Wake,
}

const TAGS: usize = 3;

fn choice() -> impl Strategy<Value = SleepChoice> {
    prop_oneof![
        Just(SleepChoice::Keep),
        Just(SleepChoice::Offload),
        Just(SleepChoice::Discard)
    ]
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (1usize..24, 0..TAGS + 1).prop_map(|(quarter_mib, tag)| Step::Alloc { quarter_mib, tag }),
        // 48 - 160 MiB: a growth of pieces larger than 2 MiB where they are chosen per growth.
        1 => (192usize..640, 0..TAGS + 1).prop_map(|(quarter_mib, tag)| Step::Alloc { quarter_mib, tag }),
        2 => (any::<usize>(), any::<u8>()).prop_map(|(i, fill)| Step::Write { i, fill }),
        2 => any::<usize>().prop_map(|i| Step::Free { i }),
        1 => (proptest::array::uniform3(choice()), choice())
            .prop_map(|(choices, default)| Step::Sleep { choices, default }),
        1 => Just(Step::Trim),
        1 => Just(Step::Wake),
    ]
}

/// A live allocation of the model: its pointer, its tag (index; `TAGS` is untagged), and its
/// contents as far as they are defined (`None` after a discard, until the next write).
struct Live {
    mem: MemoryPointer,
    tag: usize,
    fill: Option<u8>,
}

/// Whether `result` is emm's refusal of sleeping memory.
fn is_asleep_error<T>(result: &Result<T, EmmError>) -> bool {
    matches!(result, Err(EmmError::Sleep { .. }))
}

fn tag_name(i: usize) -> String {
    format!("sleep-prop-{i}")
}

fn run_program(steps: &[Step], piece: Option<usize>) -> Result<(), TestCaseError> {
    let sim = Arc::new(SimDriver::new(SimConfig::single(4 << 30)));
    let rt = vmm_with_history_and_pieces(&sim, piece);
    let ctx = rt.context(0).unwrap();
    let mut live: Vec<Live> = Vec::new();
    let mut asleep: Option<Vec<SleepChoice>> = None;
    for step in steps {
        match *step {
            Step::Alloc { quarter_mib, tag } => {
                let bytes = (quarter_mib << 18).max(64 << 10);
                let got = {
                    let _scope = (tag < TAGS).then(|| Tag::named(&tag_name(tag)).scope());
                    ctx.memalloc(bytes)
                };
                if asleep.is_some() {
                    prop_assert!(
                        is_asleep_error(&got),
                        "not refused as asleep: {:?}",
                        got.err()
                    );
                    continue;
                }
                let mem = match got {
                    // Large allocations may fill the device: nothing to check then.
                    Err(EmmError::OutOfMemory { .. }) => continue,
                    got => got.unwrap(),
                };
                let fill = (live.len() as u8).wrapping_mul(37).wrapping_add(1);
                write_probed(&ctx, &mem, fill).unwrap();
                live.push(Live {
                    mem,
                    tag,
                    fill: Some(fill),
                });
            }
            Step::Write { i, fill } if !live.is_empty() => {
                let at = i % live.len();
                let l = &mut live[at];
                let wrote = write_probed(&ctx, &l.mem, fill);
                match &asleep {
                    Some(choices) if choices[at] != SleepChoice::Keep => {
                        prop_assert!(
                            is_asleep_error(&wrote),
                            "not refused as asleep: {:?}",
                            wrote.err()
                        );
                    }
                    _ => {
                        wrote.unwrap();
                        l.fill = Some(fill);
                    }
                }
            }
            Step::Free { i } if !live.is_empty() => {
                let at = i % live.len();
                live.remove(at);
                if let Some(choices) = &mut asleep {
                    choices.remove(at);
                }
            }
            Step::Sleep { choices, default } if asleep.is_none() => {
                let options = (0..TAGS).fold(SleepOptions::new(default), |o, t| {
                    o.with_tag(Tag::named(&tag_name(t)), choices[t])
                });
                let of: Vec<SleepChoice> = live
                    .iter()
                    .map(|l| {
                        if l.tag < TAGS {
                            choices[l.tag]
                        } else {
                            default
                        }
                    })
                    .collect();
                // The pieces that stay: those a kept allocation lies in, whatever their sizes.
                let kept_ranges: Vec<(u64, u64)> = live
                    .iter()
                    .zip(&of)
                    .filter(|(_, c)| **c == SleepChoice::Keep)
                    .map(|(l, _)| {
                        (
                            l.mem.device_ptr().0,
                            l.mem.device_ptr().0 + l.mem.size() as u64,
                        )
                    })
                    .collect();
                let stay: usize = mapped_pieces(&sim)
                    .into_iter()
                    .filter(|&(b, s)| kept_ranges.iter().any(|&(a, e)| a < b + s as u64 && b < e))
                    .map(|(_, s)| s)
                    .sum();
                if let Some(piece) = piece {
                    prop_assert!(mapped_pieces(&sim).values().all(|&s| s == piece));
                }
                let report = ctx.sleep(&options).unwrap();
                prop_assert_eq!(report.held_asleep, stay);
                prop_assert_eq!(device_used(&ctx), report.held_asleep);
                let sum = |c: SleepChoice| -> usize {
                    live.iter()
                        .zip(&of)
                        .filter(|(_, x)| **x == c)
                        .map(|(l, _)| l.mem.size())
                        .sum()
                };
                prop_assert_eq!(report.offloaded_bytes, sum(SleepChoice::Offload));
                prop_assert_eq!(report.discarded_bytes, sum(SleepChoice::Discard));
                prop_assert_eq!(report.kept_bytes, sum(SleepChoice::Keep));
                for (l, c) in live.iter_mut().zip(&of) {
                    if *c == SleepChoice::Discard {
                        l.fill = None;
                    }
                }
                asleep = Some(of);
            }
            Step::Trim => {
                ctx.trim().unwrap();
            }
            Step::Wake if asleep.is_some() => {
                ctx.wake().unwrap();
                asleep = None;
            }
            _ => {}
        }
        // What is readable holds what the model says: everything while awake, the kept
        // allocations while asleep (the others are refused).
        for (k, l) in live.iter().enumerate() {
            let awake_or_kept = asleep.as_ref().is_none_or(|c| c[k] == SleepChoice::Keep);
            let got = read_probed(&ctx, &l.mem);
            if !awake_or_kept {
                prop_assert!(
                    is_asleep_error(&got),
                    "not refused as asleep: {:?}",
                    got.err()
                );
            } else if let Some(fill) = l.fill {
                let out = got.unwrap();
                prop_assert!(
                    out.iter().all(|&b| b == fill),
                    "allocation {} lost its data",
                    k
                );
            }
        }
    }
    if asleep.is_some() {
        ctx.wake().unwrap();
    }
    drop(live);
    drop(ctx);
    drop(rt);
    prop_assert!(sim.leak_report().is_clean(), "{}", sim.leak_report());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(24),
        rng_seed: seed(),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Random programs of allocations (up to 160 MiB), writes, frees, sleeps (random choices
    /// per tag), trims and wakes: data kept or offloaded is never lost, discarded data is never
    /// read as kept, sleeping memory is refused, and the device holds only the pieces kept
    /// allocations lie in while asleep; with pieces chosen per growth, or of 2, 8 or 32 MiB.
    #[test]
    fn random_programs_keep_what_they_ask_for(
        steps in proptest::collection::vec(step(), 1..40),
        piece_mib in prop_oneof![Just(None), Just(Some(2usize)), Just(Some(8)), Just(Some(32))],
    ) {
        run_program(&steps, piece_mib.map(|m| m << 20))?;
    }
}

/// Larger pieces make a sleep and a wake take as many driver calls fewer: 256 MiB of 32 MiB
/// pieces go back in 8 unmappings and come again in 8 mappings, where pieces of 2 MiB take
/// 128 each, and offloaded contents come back whole either way.
#[test]
fn larger_pieces_sleep_and_wake_in_fewer_driver_calls() {
    let mut calls = Vec::new();
    for piece in [2usize << 20, 32 << 20] {
        let sim = Arc::new(SimDriver::new(SimConfig::single(1 << 30)));
        let rt = vmm_with_history_and_pieces(&sim, Some(piece));
        let ctx = rt.context(0).unwrap();
        let blocks: Vec<MemoryPointer> = (0..16)
            .map(|i| tagged(&ctx, "weights", 16 << 20, i as u8 + 1))
            .collect();
        for b in &blocks {
            assert_eq!(b.device_ptr().0 % (2 << 20), 0);
        }
        assert_eq!(device_used(&ctx), 256 << 20);
        let (unmaps, releases) = (sim.count(Op::MemUnmap), sim.count(Op::MemRelease));
        let report = ctx.sleep(&SleepOptions::new(SleepChoice::Offload)).unwrap();
        assert_eq!((report.held_asleep, device_used(&ctx)), (0, 0));
        let slept = (
            sim.count(Op::MemUnmap) - unmaps,
            sim.count(Op::MemRelease) - releases,
        );
        let (creates, maps) = (sim.count(Op::MemCreate), sim.count(Op::MemMap));
        ctx.wake().unwrap();
        let woke = (
            sim.count(Op::MemCreate) - creates,
            sim.count(Op::MemMap) - maps,
        );
        for (i, b) in blocks.iter().enumerate() {
            assert!(
                read(&ctx, b).iter().all(|&x| x == i as u8 + 1),
                "block {i} lost its data"
            );
        }
        calls.push((slept, woke));
    }
    assert_eq!(calls, [((128, 128), (128, 128)), ((8, 8), (8, 8))]);
}

/// A piece size that is not a power of two, or below the device's granularity, refuses the
/// context with the setting's name; `EMM_VMM_PIECE` takes byte sizes that are powers of two.
#[test]
fn piece_sizes_are_checked() {
    for piece in [3usize << 20, 1 << 20] {
        let sim = Arc::new(SimDriver::new(SimConfig::single(1 << 30)));
        let rt = vmm_with_history_and_pieces(&sim, Some(piece));
        match rt.context(0) {
            Err(e) => assert!(e.to_string().contains("PoolConfig::vmm_piece"), "{e}"),
            Ok(_) => panic!("a piece of {piece} bytes was taken"),
        }
    }
    let lookup = |v: &'static str| move |k: &str| (k == "EMM_VMM_PIECE").then(|| v.to_owned());
    assert_eq!(vmm_piece_from_lookup(|_| None).unwrap(), None);
    assert_eq!(
        vmm_piece_from_lookup(lookup("32MiB")).unwrap(),
        Some(32 << 20)
    );
    for bad in ["48MiB", "lots", ""] {
        let e = vmm_piece_from_lookup(lookup(bad)).unwrap_err();
        assert!(
            matches!(
                e,
                EmmError::Config {
                    variable: "EMM_VMM_PIECE",
                    ..
                }
            ),
            "{e}"
        );
    }
}

/// A host buffer kept at the wake serves the next sleep with no new page-locked allocation;
/// a sleep that offloads more replaces it, `trim` frees it, a sleep that does not ask for it
/// frees it at its wake, and offloaded contents come back whole every time.
#[test]
fn a_kept_host_buffer_serves_the_next_sleep() {
    let sim = Arc::new(SimDriver::new(SimConfig::single(1 << 30)));
    let rt = vmm_with_history(&sim);
    let ctx = rt.context(0).unwrap();
    let keep = SleepOptions::new(SleepChoice::Offload).with_host_buffer_kept(true);
    let host_calls = || (sim.count(Op::MemHostAlloc), sim.count(Op::MemFreeHost));
    let first = tagged(&ctx, "weights", 8 << 20, 0x21);
    let cycle = |options: &SleepOptions, blocks: &[&MemoryPointer]| {
        let before = host_calls();
        let report = ctx.sleep(options).unwrap();
        ctx.wake().unwrap();
        for (i, b) in blocks.iter().enumerate() {
            assert!(
                read(&ctx, b).iter().all(|&x| x == 0x21 + i as u8),
                "block {i} lost its data"
            );
        }
        let after = host_calls();
        (
            report.host_buffer_reused,
            after.0 - before.0,
            after.1 - before.1,
        )
    };
    // (reused, host allocations, host frees) of each sleep and wake.
    assert_eq!(
        cycle(&keep, &[&first]),
        (false, 1, 0),
        "the first pins a buffer and keeps it"
    );
    assert_eq!(
        cycle(&keep, &[&first]),
        (true, 0, 0),
        "the second reuses it"
    );
    let second = tagged(&ctx, "weights", 8 << 20, 0x22);
    assert_eq!(
        cycle(&keep, &[&first, &second]),
        (false, 1, 1),
        "more to offload: the kept one is replaced"
    );
    let trims = host_calls();
    ctx.trim().unwrap();
    assert_eq!(host_calls().1 - trims.1, 1, "trim frees the kept buffer");
    assert_eq!(cycle(&keep, &[&first, &second]), (false, 1, 0));
    let plain = SleepOptions::new(SleepChoice::Offload);
    assert_eq!(
        cycle(&plain, &[&first, &second]),
        (true, 0, 1),
        "a sleep that does not keep it uses the kept one and frees it at the wake"
    );
    assert_eq!(cycle(&keep, &[&first, &second]), (false, 1, 0));
    // A buffer kept at the context's end goes with the context.
    drop((first, second, ctx));
    drop(rt);
    assert!(sim.leak_report().is_clean(), "{}", sim.leak_report());
}
