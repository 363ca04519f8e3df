use std::sync::Weak;

use super::*;
use crate::contract::factory::ManagerContext;
use crate::memory::pointer::{Allocation, KeptHook};
use crate::memory::record::depot_keeps;

/// An `async-pool` allocator over a host layer on a simulated GPU, and a weak reference to
/// its shared state.
fn allocator() -> (HostLayer, AsyncPoolAllocator, Weak<Shared>) {
    let host = HostLayer::new(&ManagerContext::simulated(None));
    let device = AsyncPoolAllocator::new(&host);
    let shared = Arc::downgrade(&device.shared);
    (host, device, shared)
}

/// Records parked in every shard.
fn parked(shared: &Weak<Shared>) -> Vec<usize> {
    let shared = shared.upgrade().expect("the shared state");
    shared.live.0.iter().map(|s| lock(s).parked.len()).collect()
}

fn parked_total(shared: &Weak<Shared>) -> usize {
    parked(shared).iter().sum()
}

/// Records of stream-ordered pointers parked in every shard.
fn parked_on_total(shared: &Weak<Shared>) -> usize {
    let shared = shared.upgrade().expect("the shared state");
    shared.live.0.iter().map(|s| lock(s).parked_on.len()).sum()
}

/// Bytes the driver's pool has handed out and not had back.
fn used(host: &HostLayer, shared: &Weak<Shared>) -> u64 {
    let shared = shared.upgrade().expect("the shared state");
    let pool = shared.current_pool().expect("a pool");
    let cx = host.context();
    cx.driver
        .mem_pool_usage(cx.context, pool)
        .expect("pool usage")
        .used
}

#[test]
fn a_memalloc_pointers_record_serves_the_next_allocation_and_goes_with_the_manager() {
    let (host, device, shared) = allocator();
    let first = device.memalloc(&host, 4096).expect("memory");
    let at = first.device_ptr();
    let refs = shared.strong_count();
    drop(first);
    assert_eq!(parked_total(&shared), 1, "the record is kept");
    assert_eq!(used(&host, &shared), 0, "its block is freed");
    assert_eq!(shared.strong_count(), refs, "with its clone of the state");
    for _ in 0..20 {
        let again = device.memalloc(&host, 256).expect("memory");
        // The simulator's pool hands back the block freed last on the same stream, so the
        // parked record is in the new block's shard.
        assert_eq!(again.device_ptr(), at);
        assert_eq!(
            parked_total(&shared),
            0,
            "the record went to the new pointer"
        );
        assert!(again.is_live());
        assert_eq!((again.size(), again.allocation_size()), (256, 256));
        assert_eq!(device.stats().expect("stats").in_use_blocks, 1);
        drop(again);
        assert_eq!(parked_total(&shared), 1);
        assert_eq!(shared.strong_count(), refs, "no clone made or dropped");
    }
    assert_eq!(used(&host, &shared), 0, "every block freed once");
    drop(device);
    let_the_spares_go(&host, &shared, 1);
}

/// The manager is gone: its `spares` records (the parked one, and a stream-ordered
/// pointer's once dropped) went to this thread's spares with their clones of the hook (as
/// a retired pool pointer's does), and pointers made on this thread over another state
/// take every spare box (at most 64) and drop the clones: nothing else keeps the state
/// alive.
fn let_the_spares_go(host: &HostLayer, shared: &Weak<Shared>, spares: usize) {
    assert_eq!(
        shared.strong_count(),
        spares,
        "the spare records' clones alone"
    );
    let other = AsyncPoolAllocator::new(host);
    let held: Vec<_> = (0..65)
        .map(|_| other.memalloc(host, 256).expect("memory"))
        .collect();
    assert_eq!(shared.strong_count(), 0, "no parked record keeps the state");
    drop(held);
}

#[test]
fn a_parked_record_releases_nothing_when_it_goes() {
    let (host, device, shared) = allocator();
    drop(device.memalloc(&host, 4096).expect("memory"));
    assert_eq!(parked_total(&shared), 1);
    // A stream-ordered allocation takes no parked record; it gets the freed block and the
    // slot the parked record's allocation had.
    let ordered = device
        .memalloc_on(&host, 4096, STREAM)
        .expect("stream-ordered memory");
    assert_eq!(parked_total(&shared), 1);
    assert_eq!(used(&host, &shared), 4096);
    drop(device); // the parked record goes, naming no slot
    assert_eq!(
        used(&host, &shared),
        4096,
        "the parked record freed a live allocation"
    );
    assert!(ordered.is_live());
    drop(ordered); // released by its hook, whose manager is gone
    assert_eq!(used(&host, &shared), 0);
    let_the_spares_go(&host, &shared, 2);
}

/// The legacy default stream, as the memory layer takes a stream.
struct Legacy;

// SAFETY: the null stream is never destroyed.
#[allow(unsafe_code)]
unsafe impl crate::memory::pointer::OrderedOn for Legacy {
    fn stream_handle(&self) -> StreamHandle {
        STREAM
    }
}

#[test]
fn a_stream_ordered_pointers_record_is_parked_and_serves_the_next_one() {
    let (host, device, shared) = allocator();
    let cx = host.context();
    let other = cx.driver.stream_create(cx.context, 0).expect("a stream");
    let first = device.memalloc_on(&host, 4096, other).expect("memory");
    first.record_stream(&Legacy).expect("recorded");
    let refs = shared.strong_count();
    drop(first);
    assert_eq!(parked_on_total(&shared), 1, "the record is kept");
    assert_eq!(parked_total(&shared), 0, "apart from memalloc's");
    assert_eq!(used(&host, &shared), 0, "its block is freed");
    assert_eq!(shared.strong_count(), refs, "with its clone of the state");
    for (i, stream) in [STREAM, other].into_iter().cycle().take(20).enumerate() {
        let ordered = device.memalloc_on(&host, 4096, stream).expect("memory");
        assert_eq!(
            parked_on_total(&shared),
            0,
            "the record went to the new pointer"
        );
        let streams = ordered.streams().expect("stream ordered");
        assert_eq!(
            (streams.stream, streams.free_on),
            (stream, stream),
            "round {i}"
        );
        assert!(streams.recorded.is_empty(), "no stream recorded before");
        assert!(ordered.is_live());
        assert_eq!(device.stats().expect("stats").in_use_blocks, 1);
        assert_eq!(shared.strong_count(), refs, "no clone made");
        drop(ordered);
        assert_eq!(parked_on_total(&shared), 1);
        assert_eq!(shared.strong_count(), refs, "no clone dropped");
        assert_eq!(used(&host, &shared), 0, "freed on its stream");
    }
    // A `memalloc` takes no stream-ordered record, and the reverse.
    let plain = device.memalloc(&host, 4096).expect("memory");
    assert_eq!(plain.streams().map(|s| s.stream), None);
    assert_eq!(parked_on_total(&shared), 1);
    drop(plain);
    assert_eq!((parked_total(&shared), parked_on_total(&shared)), (1, 1));
    drop(device);
    let_the_spares_go(&host, &shared, 2);
    // SAFETY: created above; nothing is queued on it any more (the simulator's pool ran
    // every free), and nothing uses it after.
    unsafe { cx.driver.stream_destroy(cx.context, other) }.expect("destroyed");
}

#[test]
#[cfg_attr(
    miri,
    ignore = "its 600 simulated allocations take minutes under Miri; the depot's unsafe-free \
              purge is covered natively"
)]
fn a_dropped_manager_is_not_kept_alive_by_the_depots_spare_boxes() {
    let (host, device, shared) = allocator();
    let hook = Arc::as_ptr(&device.hook).cast::<()>();
    let ours = |k: &KeptHook| Arc::as_ptr(&k.hook).cast::<()>() == hook;
    // The depot is the process's: other tests' threads may take every box this thread
    // left before they are counted, so the thread runs again until some stay.
    for _ in 0..20 {
        std::thread::scope(|s| {
            s.spawn(|| {
                // More pointers than the shards park and the thread's list keeps: the rest
                // of the records go to the depot, with their clones of the hook.
                let held: Vec<_> = (0..600)
                    .map(|_| device.memalloc(&host, 256).expect("memory"))
                    .collect();
                drop(held);
            });
        });
        if depot_keeps::<Allocation>(ours) > 0 {
            break;
        }
    }
    // The thread exited (its own list went with it); the depot keeps boxes with clones.
    assert!(
        depot_keeps::<Allocation>(ours) > 0,
        "the depot keeps clones"
    );
    // The manager's drop lets its parked records go on this thread (its list keeps at most
    // 64, the rest go to the depot), and then the depot lets go of every clone.
    drop(device);
    assert_eq!(
        depot_keeps::<Allocation>(ours),
        0,
        "no box of the depot keeps the state"
    );
    drop(shared);
}

#[test]
fn a_record_parked_before_a_reset_serves_the_new_pool() {
    let (host, device, shared) = allocator();
    let stale = device.memalloc(&host, 512).expect("memory");
    drop(device.memalloc(&host, 512).expect("memory"));
    assert_eq!(parked_total(&shared), 1);
    device.reset(&host).expect("reset");
    assert!(
        !stale.is_live(),
        "the reset made the old pool's pointer stale"
    );
    let fresh = device.memalloc(&host, 512).expect("memory");
    assert!(fresh.is_live(), "revived with the new generation");
    assert_eq!(device.stats().expect("stats").in_use_blocks, 1);
    drop(stale); // frees nothing: the reset did
    assert_eq!(used(&host, &shared), 512);
    drop(fresh);
    assert_eq!(used(&host, &shared), 0);
    assert_eq!(device.stats().expect("stats").in_use_blocks, 0);
}

#[test]
fn a_stale_pointers_last_drop_frees_nothing_of_the_new_pool() {
    let (host, device, shared) = allocator();
    let stale = device.memalloc(&host, 2048).expect("memory");
    device.reset(&host).expect("reset");
    // The new pool hands out the same address, recorded in the same slot.
    let live = device
        .memalloc_on(&host, 2048, STREAM)
        .expect("stream-ordered memory");
    assert_eq!(live.device_ptr(), stale.device_ptr());
    assert_eq!(
        live.hook_tag().map(|t| t & SLOT_MASK),
        stale.hook_tag().map(|t| t & SLOT_MASK)
    );
    drop(stale);
    assert_eq!(parked_total(&shared), 0, "a stale record is not parked");
    assert_eq!(
        used(&host, &shared),
        2048,
        "the stale drop freed a live block"
    );
    drop(live);
    assert_eq!(used(&host, &shared), 0);
}

#[test]
#[cfg_attr(
    miri,
    ignore = "its 1 024 allocations through the simulator take minutes under Miri; the \
              shard code it bounds is what the other tests here run"
)]
fn the_shards_keep_a_bounded_number_of_records_and_free_every_block() {
    let (host, device, shared) = allocator();
    let all: Vec<_> = (0..LIVE_SHARDS * PARKED * 2)
        .map(|_| device.memalloc(&host, 1024).expect("memory"))
        .collect();
    drop(all);
    let parked = parked(&shared);
    assert!(parked.iter().all(|&n| n <= PARKED), "{parked:?}");
    assert!(parked.iter().sum::<usize>() > 0);
    assert_eq!(used(&host, &shared), 0, "every block freed, parked or not");
    assert_eq!(device.stats().expect("stats").in_use_blocks, 0);
}
