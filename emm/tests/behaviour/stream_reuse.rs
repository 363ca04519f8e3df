//! Stream-ordered memory against a model of stream work, under `default`, `pool` and
//! `async-pool`, and from cuda.core's device, pinned and managed resources: random sequences allocate on three streams, queue writes on them (recording
//! the stream when it is not the allocation's), move frees to other streams, drop, trim, and
//! hold and release streams on flags in mapped memory. The simulator runs queued work only
//! when the sequence says (`Run`), the most adversarial schedule there is.
//!
//! The model knows what each live allocation must hold: the value of its last write, once
//! that write has run. If a manager hands a block to new work while a stream's earlier work
//! on it is still pending, that work lands later on the new owner's bytes, and the check after
//! the next `Run` fails. `cross_stream_check_catches_early_reuse` in the suite shows that such
//! a manager is caught.
//!
//! Streams' own lives too: a stream is destroyed once, when its user dropped it and the last
//! memory ordered on it is gone (for `pool`, trimmed off its free list), never before, with
//! memory dropped on other threads, records parked and revived on other streams, and a
//! property test of streams and memory made and dropped in any order.
//!
//! 128 cases per manager; `PROPTEST_CASES=N` for more.

use driver_mock::SimDriver;
use emm::driver_sys::{Driver, wait_value};
use emm::{Context, Event, HostMemory, MemoryPointer, Stream};
use proptest::prelude::*;

use crate::common::{runtime_with, sim};

const STREAMS: usize = 3;

#[derive(Clone, Debug)]
enum Step {
    /// Allocate on stream `s` (one of a few sizes) and write the block's own value there.
    Alloc(usize, usize),
    /// Write a fresh value into live allocation `i` on stream `s` (recorded if not its own).
    Write(usize, usize),
    /// Free allocation `i` on stream `s` instead.
    FreeOn(usize, usize),
    /// Drop live allocation `i`.
    Drop(usize),
    /// Hold stream `s` behind its flag.
    Hold(usize),
    /// Write stream `s`'s flag.
    Release(usize),
    /// Let the simulator run what can run, then check every allocation whose writes ran.
    Run,
    /// The manager gives back what it holds.
    Trim,
}

fn step() -> impl Strategy<Value = Step> {
    let s = 0..STREAMS;
    prop_oneof![
        4 => (s.clone(), 0..4usize).prop_map(|(s, z)| Step::Alloc(s, z)),
        3 => (any::<usize>(), s.clone()).prop_map(|(i, s)| Step::Write(i, s)),
        1 => (any::<usize>(), s.clone()).prop_map(|(i, s)| Step::FreeOn(i, s)),
        3 => any::<usize>().prop_map(Step::Drop),
        2 => s.clone().prop_map(Step::Hold),
        2 => s.prop_map(Step::Release),
        2 => Just(Step::Run),
        1 => Just(Step::Trim),
    ]
}

const SIZES: [usize; 4] = [256, 4096, 96 << 10, 2 << 20];

/// A live allocation and what the model expects of it.
struct Live {
    mem: MemoryPointer,
    /// The value its bytes hold once its last write ran.
    value: u8,
    /// Events recorded after its writes that have not completed: the simulator says when
    /// they ran (a stream the driver made wait for another runs later than its holds say).
    pending: Vec<Event>,
    /// The stream of its last write (the model allows a write on another stream only once
    /// the earlier ones ran, so the last write decides the bytes).
    last_stream: usize,
}

/// The streams of the sequence and their holds.
struct Streams {
    streams: Vec<Stream>,
    flags: Vec<HostMemory>,
    /// Per stream: the highest flag value a hold waits for, and the value written so far.
    held_to: Vec<u32>,
    released: Vec<u32>,
}

impl Streams {
    fn new(ctx: &Context) -> Streams {
        let streams = (0..STREAMS)
            .map(|_| ctx.create_stream_with(true, 0).unwrap())
            .collect();
        let flags = (0..STREAMS)
            .map(|_| {
                let f = ctx.memhostalloc(64, true, false, false).unwrap();
                f.write(0, &0u32.to_le_bytes()).unwrap();
                f
            })
            .collect();
        Streams {
            streams,
            flags,
            held_to: vec![0; STREAMS],
            released: vec![0; STREAMS],
        }
    }

    fn release(&mut self, s: usize, upto: u32) {
        self.released[s] = upto;
        self.flags[s].write(0, &upto.to_le_bytes()).unwrap();
    }
}

/// Queues a set of `mem` to `v` on stream `s`, and an event after it.
fn write(
    sim: &SimDriver,
    ctx: &Context,
    st: &Streams,
    mem: &MemoryPointer,
    s: usize,
    v: u8,
) -> Event {
    // SAFETY: `mem` is live memory of this context; the test keeps it (or the manager keeps
    // its block) until the write ran, which is the property under test.
    unsafe {
        sim.memset_d8_async(
            ctx.handle(),
            mem.device_ptr(),
            v,
            mem.size(),
            st.streams[s].handle(),
        )
        .unwrap()
    };
    let e = ctx.create_event(false).unwrap();
    st.streams[s].record(&e).unwrap();
    e
}

fn check(ctx: &Context, live: &mut [Live]) -> Result<(), TestCaseError> {
    for l in live.iter_mut() {
        l.pending.retain(|e| !e.query().unwrap());
        if !l.pending.is_empty() {
            continue;
        }
        let mut back = vec![0u8; l.mem.size()];
        ctx.copy_to_host(&mut back, &l.mem).unwrap();
        let wrong = back.iter().position(|&b| b != l.value);
        prop_assert!(
            wrong.is_none(),
            "allocation at {} holds {:#x} at byte {:?}, expected {:#x}: earlier work on a stream landed on it",
            l.mem.device_ptr(),
            back[wrong.unwrap_or(0)],
            wrong,
            l.value
        );
    }
    Ok(())
}

/// Runs `steps` with memory from the manager registered as `manager`, or, for `"resource"`,
/// from a [`emm::DeviceMemoryResource`] of the default manager's context, or for `"pinned"`
/// from a [`emm::PinnedMemoryResource`], or for `"managed"` from a
/// [`emm::ManagedMemoryResource`].
fn run_sequence(manager: &str, steps: &[Step]) -> Result<(), TestCaseError> {
    let sim = sim();
    let resource = ["resource", "pinned", "managed"].contains(&manager);
    let rt = runtime_with(&sim, if resource { "default" } else { manager });
    let ctx = rt.context(0).unwrap();
    let mr = (manager == "resource").then(|| {
        ctx.device_memory_resource(emm::DeviceMemoryResourceOptions::default())
            .unwrap()
    });
    let pinned = (manager == "pinned").then(|| {
        ctx.pinned_memory_resource(emm::PinnedMemoryResourceOptions::default())
            .unwrap()
    });
    let managed = (manager == "managed").then(|| {
        ctx.managed_memory_resource(emm::ManagedMemoryResourceOptions::default())
            .unwrap()
    });
    let alloc = |bytes: usize, s: &Stream| match (&mr, &pinned) {
        _ if managed.is_some() => managed
            .as_ref()
            .expect("checked")
            .allocate(bytes, s)
            .map(|m| m.device().clone()),
        (Some(mr), _) => mr.allocate(bytes, s),
        // The device side of the host buffer: the same allocation, freed when it drops.
        (_, Some(p)) => p
            .allocate(bytes, s)
            .map(|h| h.mapped().expect("mapped").device().clone()),
        _ => ctx.memalloc_on(bytes, s),
    };
    let mut st = Streams::new(&ctx);
    let mut live: Vec<Live> = Vec::new();
    let mut next_value = 1u8;
    let mut fresh = || {
        next_value = next_value.wrapping_add(1).max(1);
        next_value
    };
    for step in steps {
        match *step {
            Step::Alloc(s, z) => {
                let mem = alloc(SIZES[z], &st.streams[s]).unwrap();
                let value = fresh();
                let done = write(&sim, &ctx, &st, &mem, s, value);
                live.push(Live {
                    mem,
                    value,
                    pending: vec![done],
                    last_stream: s,
                });
            }
            Step::Write(i, s) if !live.is_empty() => {
                let k = i % live.len();
                // A write on another stream while earlier writes are pending would race with
                // them: a program must order the two streams first, so the sequence does not.
                if live[k].last_stream != s && !live[k].pending.is_empty() {
                    continue;
                }
                live[k].mem.record_stream(&st.streams[s]).unwrap();
                let value = fresh();
                let done = write(&sim, &ctx, &st, &live[k].mem, s, value);
                live[k].value = value;
                live[k].last_stream = s;
                live[k].pending.push(done);
            }
            Step::FreeOn(i, s) if !live.is_empty() => {
                let k = i % live.len();
                live[k].mem.free_on(&st.streams[s]).unwrap();
            }
            Step::Drop(i) if !live.is_empty() => {
                let k = i % live.len();
                drop(live.swap_remove(k));
            }
            Step::Hold(s) => {
                let want = st.released[s] + 1;
                if st.held_to[s] >= want {
                    continue;
                }
                let at = st.flags[s].mapped().unwrap().device().device_ptr();
                sim.stream_wait_value32(
                    ctx.handle(),
                    st.streams[s].handle(),
                    at,
                    want,
                    wait_value::GEQ,
                )
                .unwrap();
                st.held_to[s] = want;
            }
            Step::Release(s) if st.held_to[s] > st.released[s] => {
                st.release(s, st.released[s] + 1);
            }
            Step::Run => {
                sim.run_streams();
                check(&ctx, &mut live)?;
            }
            Step::Trim => {
                ctx.trim().unwrap();
            }
            _ => {}
        }
    }
    // Release every hold, let everything run, and check once more.
    for s in 0..STREAMS {
        st.release(s, st.held_to[s]);
    }
    sim.run_streams();
    check(&ctx, &mut live)?;
    prop_assert!(
        live.iter().all(|l| l.pending.is_empty()),
        "all work ran once released"
    );
    for s in &st.streams {
        s.synchronize().unwrap();
    }
    drop(live);
    ctx.trim().unwrap();
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: crate::common::cases(128), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn default_manager_never_reuses_under_pending_work(steps in prop::collection::vec(step(), 1..60)) {
        run_sequence("default", &steps)?;
    }

    #[test]
    fn pool_never_reuses_under_pending_work(steps in prop::collection::vec(step(), 1..60)) {
        run_sequence("pool", &steps)?;
    }

    #[test]
    fn async_pool_never_reuses_under_pending_work(steps in prop::collection::vec(step(), 1..60)) {
        run_sequence("async-pool", &steps)?;
    }

    #[test]
    fn device_memory_resource_never_reuses_under_pending_work(steps in prop::collection::vec(step(), 1..60)) {
        run_sequence("resource", &steps)?;
    }

    #[test]
    fn pinned_memory_resource_never_reuses_under_pending_work(steps in prop::collection::vec(step(), 1..60)) {
        run_sequence("pinned", &steps)?;
    }

    #[test]
    fn managed_memory_resource_never_reuses_under_pending_work(steps in prop::collection::vec(step(), 1..60)) {
        run_sequence("managed", &steps)?;
    }
}

/// Every memory source the property tests cover: the managers, then the resources.
const SUBJECTS: [&str; 6] = [
    "default",
    "pool",
    "async-pool",
    "resource",
    "pinned",
    "managed",
];

/// Runs `steps` under every subject; a failure names it.
fn run_on_every_subject(steps: &[Step]) {
    for subject in SUBJECTS {
        if let Err(e) = run_sequence(subject, steps) {
            panic!("{subject}: {e}");
        }
    }
}

/// The model itself: a sequence that a manager reusing blocks at once would fail (a block
/// freed on a held stream, then the same size allocated on another) passes here, and the
/// block is not reused while the hold lasts.
#[test]
fn a_block_freed_behind_a_hold_is_not_reused_elsewhere() {
    run_on_every_subject(&[
        Step::Hold(0),
        Step::Alloc(0, 1),
        Step::Drop(0),
        Step::Alloc(1, 1),
        Step::Run,
        Step::Release(0),
        Step::Run,
    ]);
}

/// Found by the property test: a block freed on a stream, reused on that stream and freed
/// again behind a hold. The simulator once let the first free's completion release the second
/// free too (it named frees by address); the block then went to another stream under the held
/// write.
#[test]
fn a_block_freed_twice_on_its_stream_waits_for_the_second_free() {
    use Step::*;
    let steps = [
        Alloc(2, 3),
        Drop(0),
        Alloc(0, 0),
        Alloc(0, 0),
        Hold(2),
        Alloc(0, 0),
        Alloc(2, 0),
        Drop(3),
        Run,
        Alloc(0, 0),
        Alloc(0, 0),
    ];
    run_on_every_subject(&steps);
}

/// Found by the property test: a free moved to another stream (its wait for the allocation
/// stream, held) and a second free whose fence reused the same event on a stream that ran.
/// The simulator once let the second record's completion satisfy the first wait.
#[test]
fn a_wait_on_a_reused_event_waits_for_its_own_record() {
    use Step::*;
    let steps = [
        Hold(1),
        Alloc(1, 2),
        Alloc(0, 0),
        Run,
        FreeOn(0, 0),
        Write(1, 2),
        Drop(0),
        Drop(0),
        Alloc(0, 0),
        Alloc(0, 0),
        Run,
    ];
    run_on_every_subject(&steps);
}

/// Found by the property test: a block written on stream 2 (recorded), whose free moved to
/// stream 2 and then to stream 1. Moving the free away from stream 2 once forgot that stream
/// 2 used the block, and the block went to new work under stream 2's held write.
#[test]
fn moving_a_free_twice_keeps_the_streams_that_used_the_block() {
    use Step::*;
    let steps = [
        Alloc(0, 0),
        Alloc(1, 2),
        Hold(2),
        Alloc(0, 0),
        Drop(2),
        Run,
        Alloc(0, 0),
        Write(1, 2),
        Drop(2),
        Drop(0),
        Alloc(0, 0),
        FreeOn(0, 2),
        Alloc(0, 0),
        Write(0, 1),
        Drop(1),
        FreeOn(0, 1),
        Drop(0),
        Release(2),
        Alloc(1, 2),
        Run,
    ];
    run_on_every_subject(&steps);
}

/// A created stream that several threads allocate on, dropped while their memory lives: each
/// thread's memory holds the stream through that thread's share of its owner, and is dropped
/// on another thread than made it. The stream is destroyed once, after the last free (for
/// `pool`, once `trim` takes the blocks off the stream's free list), under every manager that
/// allocates on streams, bare and behind adaptors (whose pointers wrap the manager's), and
/// nothing is left behind.
#[test]
fn a_stream_shared_by_threads_is_destroyed_once_after_the_last_free() {
    under_every_stream_manager(1, |manager, sim, ctx| {
        let s = ctx.create_stream().unwrap();
        let destroyed = || destroyed_streams(sim, ctx, false);
        let mut made: Vec<Vec<MemoryPointer>> = std::thread::scope(|scope| {
            let threads: Vec<_> = (0..6)
                .map(|t| {
                    let s = &s;
                    scope.spawn(move || {
                        (0..4)
                            .map(|i| ctx.memalloc_on(256 << ((t + i) % 4), s).unwrap())
                            .collect()
                    })
                })
                .collect();
            threads.into_iter().map(|h| h.join().unwrap()).collect()
        });
        drop(s);
        assert_eq!(destroyed(), 0, "{manager}: memory ordered on it is live");
        let last = made.pop().unwrap();
        std::thread::scope(|scope| {
            for batch in made {
                scope.spawn(move || drop(batch));
            }
        });
        assert_eq!(
            destroyed(),
            0,
            "{manager}: one thread's memory is still live"
        );
        std::thread::spawn(move || drop(last)).join().unwrap();
        if manager.starts_with("pool") {
            assert_eq!(
                destroyed(),
                0,
                "{manager}: its blocks wait on the stream's list"
            );
            ctx.trim().unwrap();
        }
        assert_eq!(destroyed(), 1, "{manager}: destroyed after the last free");
    });
}

/// Memory allocated and freed on a stream while the stream lives (under `async-pool`, the
/// freed pointers' records parked, and one revived for another stream), then the stream
/// dropped: it is destroyed once, at the next flush of the context's own queue (for `pool`,
/// once `trim` takes the blocks off its free list); nothing the manager keeps for reuse keeps
/// the stream. Under every manager that allocates on streams, bare and behind adaptors.
#[test]
fn a_stream_whose_memory_was_freed_is_destroyed_when_dropped() {
    under_every_stream_manager(2, |manager, sim, ctx| {
        let (a, b) = (ctx.create_stream().unwrap(), ctx.create_stream().unwrap());
        let destroyed = || destroyed_streams(sim, ctx, manager.starts_with("pool"));
        for round in 0..3 {
            let held: Vec<_> = (0..8)
                .map(|i| ctx.memalloc_on(256 << (i % 4), &a).unwrap())
                .collect();
            drop(held);
            assert_eq!(destroyed(), 0, "{manager}: round {round}, a is in use");
        }
        // Takes one of the records a's memory left, if the manager parks them.
        let on_b = ctx.memalloc_on(256, &b).unwrap();
        drop(a);
        assert_eq!(destroyed(), 1, "{manager}: a dropped, its memory gone");
        drop(on_b);
        assert_eq!(destroyed(), 1, "{manager}: b is in use");
        drop(b);
        assert_eq!(destroyed(), 2, "{manager}: b dropped, its memory gone");
    });
}

/// A stream the pool keeps alive for what it freed (a block another stream may take behind
/// its work) is let go by a context reset, which frees every chunk: it is destroyed once, at
/// the next flush of the context's own queue, and a stream made after the reset starts anew.
#[test]
fn a_stream_the_pool_keeps_is_let_go_by_a_reset() {
    for manager in ["pool", "vmm-pool"] {
        let sim = sim();
        let rt = runtime_with(&sim, manager);
        let ctx = rt.context(0).unwrap();
        let destroyed = || {
            ctx.own_deallocations().flush().unwrap();
            sim.count(driver_mock::Op::StreamDestroy)
        };
        let a = ctx.create_stream().unwrap();
        drop(ctx.memalloc_on(4096, &a).unwrap());
        drop(a);
        assert_eq!(
            destroyed(),
            0,
            "{manager}: the pool keeps the stream its free names"
        );
        ctx.reset().unwrap();
        assert_eq!(destroyed(), 1, "{manager}: the reset let the stream go");
        let b = ctx.create_stream().unwrap();
        drop(ctx.memalloc_on(4096, &b).unwrap());
        drop(b);
        ctx.reset().unwrap();
        assert_eq!(destroyed(), 2, "{manager}: once each");
        drop(ctx);
        drop(rt);
        assert!(
            sim.leak_report().is_clean(),
            "{manager}: {}",
            sim.leak_report()
        );
    }
}

/// Runs `body` under every manager that allocates on streams, bare and behind the `stats` and
/// `limit` adaptors (whose pointers wrap the manager's), each on a fresh simulated GPU, with
/// the subject's name; then checks, once the runtime is gone, that nothing was left behind and
/// that `streams` streams were destroyed, each once.
fn under_every_stream_manager(streams: usize, body: impl Fn(&str, &SimDriver, &Context)) {
    use driver_mock::Op;
    use emm::Adaptor;
    let subjects = ["default", "pool", "async-pool"].into_iter().flat_map(|m| {
        [
            (m, vec![]),
            (m, vec![Adaptor::Stats, Adaptor::Limit(1 << 30)]),
        ]
    });
    for (manager, adaptors) in subjects {
        let sim = sim();
        let rt = emm::Runtime::builder(sim.clone())
            .ignore_env()
            .memory_manager_name(manager)
            .adaptors(adaptors.clone())
            .build()
            .unwrap();
        let label = format!("{manager} {adaptors:?}");
        let ctx = rt.context(0).unwrap();
        body(&label, &sim, &ctx);
        drop(ctx);
        drop(rt);
        assert!(
            sim.leak_report().is_clean(),
            "{label}: {}",
            sim.leak_report()
        );
        assert_eq!(sim.count(Op::StreamDestroy), streams, "{label}: each once");
    }
}

/// The streams destroyed so far, once both queues are flushed (the manager's frees, then the
/// context's own, which destroys streams), and with `trim`, the manager trimmed in between
/// (`pool`'s blocks keep their stream on its free lists until then).
fn destroyed_streams(sim: &SimDriver, ctx: &Context, trim: bool) -> usize {
    ctx.flush_deallocations().unwrap();
    if trim {
        ctx.trim().unwrap();
    }
    ctx.own_deallocations().flush().unwrap();
    sim.count(driver_mock::Op::StreamDestroy)
}

/// One step of [`streams_are_destroyed_once_their_user_and_memory_are_gone`].
#[derive(Clone, Debug)]
enum LifeStep {
    /// Creates a stream.
    Create,
    /// Drops the `n`th stream (modulo those made), if its user still holds it.
    DropStream(usize),
    /// Allocates 256 << `size` bytes on the `n`th stream (modulo), if its user still holds it.
    Alloc(usize, usize),
    /// Drops the `n`th allocation (modulo those made), if still held.
    DropMem(usize),
}

fn life_step() -> impl Strategy<Value = LifeStep> {
    prop_oneof![
        1 => Just(LifeStep::Create),
        1 => (0..8usize).prop_map(LifeStep::DropStream),
        4 => (0..8usize, 0..4usize).prop_map(|(n, s)| LifeStep::Alloc(n, s)),
        3 => (0..32usize).prop_map(LifeStep::DropMem),
    ]
}

/// Runs `steps` under `manager` and checks after each that exactly the streams whose user
/// dropped them and whose memory is all gone were destroyed (the manager's queue and the
/// context's own flushed, and `pool`'s free lists trimmed, first), then that every stream is
/// destroyed once in the end. Under `pool` a stream may live a while longer, never less: a
/// block of its chunk lent to another stream keeps that chunk, and so the stream, until the
/// borrower's allocation there is gone.
fn run_lives(manager: &str, steps: &[LifeStep]) -> Result<(), TestCaseError> {
    use driver_mock::Op;
    let sim = sim();
    let rt = runtime_with(&sim, manager);
    let ctx = rt.context(0).unwrap();
    let destroyed = || destroyed_streams(&sim, &ctx, manager == "pool");
    let mut streams: Vec<Option<Stream>> = vec![Some(ctx.create_stream().unwrap())];
    let mut mems: Vec<(usize, Option<MemoryPointer>)> = Vec::new();
    for (i, step) in steps.iter().enumerate() {
        match *step {
            LifeStep::Create => streams.push(Some(ctx.create_stream().unwrap())),
            LifeStep::DropStream(n) => {
                let n = n % streams.len();
                drop(streams[n].take());
            }
            LifeStep::Alloc(n, size) => {
                let n = n % streams.len();
                if let Some(s) = &streams[n] {
                    mems.push((n, Some(ctx.memalloc_on(256 << size, s).unwrap())));
                }
            }
            LifeStep::DropMem(n) => {
                if !mems.is_empty() {
                    let k = n % mems.len();
                    drop(mems[k].1.take());
                }
            }
        }
        let dead = (0..streams.len())
            .filter(|&s| streams[s].is_none() && !mems.iter().any(|(m, p)| *m == s && p.is_some()))
            .count();
        let none_live = mems.iter().all(|(_, p)| p.is_none());
        let now = destroyed();
        if manager == "pool" && !none_live {
            prop_assert!(
                now <= dead,
                "{}: after step {} ({:?}): {} destroyed, {} may be",
                manager,
                i,
                step,
                now,
                dead
            );
        } else {
            prop_assert_eq!(now, dead, "{}: after step {} ({:?})", manager, i, step);
        }
    }
    let made = streams.len();
    drop(mems);
    drop(streams);
    prop_assert_eq!(destroyed(), made, "{}: every stream in the end", manager);
    drop(ctx);
    drop(rt);
    prop_assert_eq!(sim.count(Op::StreamDestroy), made, "{}: each once", manager);
    prop_assert!(
        sim.leak_report().is_clean(),
        "{}: {}",
        manager,
        sim.leak_report()
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: crate::common::cases(128), failure_persistence: None, ..ProptestConfig::default() })]

    /// Streams and memory ordered on them made and dropped in any order, under every manager
    /// that allocates on streams: a stream is destroyed once, when its user dropped it and its
    /// last memory is gone (for `pool`, trimmed off its free list), never before.
    #[test]
    fn streams_are_destroyed_once_their_user_and_memory_are_gone(
        steps in prop::collection::vec(life_step(), 1..50),
    ) {
        for manager in ["default", "pool", "async-pool"] {
            run_lives(manager, &steps)?;
        }
    }
}

/// A trim releases the stream-ordered frees whose streams have finished, without waiting for a
/// later allocation to notice them: under `default`, a block freed on a stream once stayed
/// allocated (with its event) until the next allocation, trims notwithstanding (found by the
/// `stream_lifetimes` fuzz target).
#[test]
fn a_trim_releases_stream_frees_whose_streams_finished() {
    let sim = sim();
    let rt = runtime_with(&sim, "default");
    let ctx = rt.context(0).unwrap();
    let s = ctx.create_stream().unwrap();
    let before = ctx.get_memory_info().unwrap().free;
    drop(ctx.memalloc_on(512, &s).unwrap());
    sim.run_streams();
    ctx.trim().unwrap();
    assert_eq!(
        ctx.get_memory_info().unwrap().free,
        before,
        "the freed block is still held"
    );
}

/// More finished stream frees than an allocation's poll looks at: a trim releases every one
/// (it once looked at one batch and left the ninth block allocated; found by the
/// `stream_lifetimes` fuzz target).
#[test]
fn a_trim_releases_every_finished_stream_free() {
    let sim = sim();
    let rt = runtime_with(&sim, "default");
    let ctx = rt.context(0).unwrap();
    let s = ctx.legacy_default_stream();
    let before = ctx.get_memory_info().unwrap().free;
    let blocks: Vec<_> = [5824, 5824, 5824, 10880, 5312, 5312, 5312, 5312, 1 << 21]
        .into_iter()
        .map(|size| ctx.memalloc_on(size, &s).unwrap())
        .collect();
    drop(blocks);
    sim.run_streams();
    ctx.trim().unwrap();
    assert_eq!(
        ctx.get_memory_info().unwrap().free,
        before,
        "{}",
        sim.leak_report()
    );
}
