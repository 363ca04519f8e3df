use super::*;

/// A pool on a simulated GPU, made as a host runtime that embeds it would: no runtime.
fn pool() -> (HostLayer, PoolAllocator) {
    let host = HostLayer::new(&ManagerContext::simulated(None));
    let pool = PoolAllocator::new(&host, PoolConfig::default()).expect("a pool");
    (host, pool)
}

/// Records parked in every shard (small blocks' and large blocks'), checked against each
/// shard's count.
fn parked(pool: &PoolShared) -> usize {
    thread_slots::lock_all(&pool.shards)
        .iter()
        .map(|l| {
            let n: usize = l.parked.iter().map(|p| p.len()).sum::<usize>()
                + l.large.iter().filter(|b| b.record.is_some()).count()
                + l.oversize.iter().filter(|b| b.record.is_some()).count();
            let closed = n == 0 && l.park_room == 0;
            assert!(
                closed || n + l.park_room == shards::PARKED_PER_SHARD,
                "a shard's room"
            );
            n
        })
        .sum()
}

/// A stream of the simulator's, as the memory layer sees one.
struct OnStream(StreamHandle);

// SAFETY: a stream the test created and never destroys.
#[allow(unsafe_code)]
unsafe impl crate::memory::pointer::OrderedOn for OnStream {
    fn stream_handle(&self) -> StreamHandle {
        self.0
    }
}

/// A stream-ordered pointer's stream-use record stays in its recycled box: the next
/// pointer made on a stream fills it anew (allocating none of its own), with nothing of
/// the last pointer's use left in it.
#[test]
fn a_stream_pointers_use_record_is_reused_by_the_next_one() {
    let (host, alloc) = pool();
    let stream = StreamHandle::NULL;
    let a = alloc.memalloc_on(&host, 256, stream).unwrap();
    let (record, _) = a.stream_use_record().expect("a stream-ordered pointer");
    let cx = host.context().clone();
    let other = OnStream(cx.driver.stream_create(cx.context, 0).unwrap());
    a.record_stream(&other).unwrap();
    assert_eq!(a.stream_use_record().unwrap().1.recorded, vec![other.0]);
    drop(a);
    // Takes the heap's most recently freed block of the record's size, which a record
    // given back to the heap would be.
    let decoy = Box::new(Mutex::new(crate::memory::pointer::StreamUse::on(stream)));
    let b = alloc.memalloc_on(&host, 256, stream).unwrap();
    let (again, used) = b.stream_use_record().expect("a stream-ordered pointer");
    assert_eq!(again, record, "the record's box is reused");
    assert_eq!((used.stream, used.free_on), (stream, stream));
    assert!(used.recorded.is_empty());
    drop(decoy);
}

/// Spare records the stream lists keep.
fn spares(pool: &PoolShared) -> usize {
    lock(pool.streams.lists()).spare_records()
}

#[test]
fn a_stream_pointers_record_is_kept_as_a_spare_for_the_next_allocation() {
    let (host, alloc) = pool();
    let pool = &*alloc.shared;
    let stream = StreamHandle::NULL;
    let a = alloc.memalloc_on(&host, 256, stream).unwrap();
    let addr = a.device_ptr();
    let view = a.view(0, Some(10)).unwrap();
    drop(a);
    assert_eq!(spares(pool), 0, "a view keeps the allocation");
    drop(view);
    assert_eq!(spares(pool), 1);
    let stats = pool.stats();
    assert_eq!(
        stats.in_use_blocks, 0,
        "the block is back in the stream arena"
    );
    // The next stream-ordered allocation: a block from the arena, as ever, and
    // the spare record revived for it.
    let b = alloc.memalloc_on(&host, 200, stream).unwrap();
    assert_eq!(
        (b.device_ptr(), b.size(), b.stream()),
        (addr, 200, Some(stream))
    );
    assert!(b.is_live());
    assert_eq!(spares(pool), 0);
    // A block another stream used goes behind a fence, and its record is not kept.
    let cx = host.context().clone();
    let other = OnStream(cx.driver.stream_create(cx.context, 0).unwrap());
    b.record_stream(&other).unwrap();
    drop(b);
    assert_eq!(spares(pool), 0);
    // A reset lets the spares go without releasing anything.
    drop(alloc.memalloc_on(&host, 256, stream).unwrap());
    assert_eq!(spares(pool), 1);
    alloc.reset(&host).unwrap();
    assert_eq!(spares(pool), 0);
    let c = alloc.memalloc_on(&host, 256, stream).unwrap();
    assert!(c.is_live());
}

#[test]
fn a_small_blocks_record_is_parked_with_it_and_revived_by_the_next_allocation() {
    let (host, alloc) = pool();
    let pool = &*alloc.shared;
    // Allocated first: the pool grows for it, and a growth takes every cached block back.
    let big = alloc.memalloc(&host, 3 << 20).unwrap();
    let a = alloc.memalloc(&host, 1000).unwrap();
    let cached = pool.stats().cached_bytes;
    let (addr, class) = (a.device_ptr(), class_of(1000));
    let view = a.view(0, Some(10)).unwrap();
    drop(a);
    assert_eq!(parked(pool), 0, "a view keeps the allocation");
    drop(view);
    assert_eq!(parked(pool), 1);
    let stats = pool.stats();
    assert_eq!(stats.in_use_blocks, 1, "the large block");
    assert_eq!(stats.cached_bytes, cached + class_size(class));
    // Another request of the class gets the block and the record back, made anew.
    let b = alloc.memalloc(&host, 999).unwrap();
    assert_eq!((b.device_ptr(), b.size()), (addr, 999));
    assert!(b.is_live());
    assert_eq!(parked(pool), 0);
    let stats = pool.stats();
    assert_eq!((stats.in_use_blocks, stats.cached_bytes), (2, cached));
    drop(b);
    assert_eq!(parked(pool), 1);
    // A block above `small_max` is parked among the shard's large blocks, and a request of
    // its size gets it back with its record.
    let big_addr = big.device_ptr();
    drop(big);
    assert_eq!(parked(pool), 2);
    let again = alloc.memalloc(&host, (3 << 20) - 100).unwrap();
    assert_eq!(
        (again.device_ptr(), again.size()),
        (big_addr, (3 << 20) - 100)
    );
    assert!(again.is_live());
    assert_eq!(parked(pool), 1);
    assert_eq!(pool.stats().in_use_blocks, 1);
    drop(again);
    let stats = pool.stats();
    assert_eq!(stats.in_use_blocks, 0, "{stats:?}");
}

/// A block above a shard's byte bound waits in the freeing thread's one oversize slot with
/// its record: the next request of its size gets both back, a block of another such size
/// takes the slot and sends the older one to the arena, and trim and reset let it go.
#[test]
fn one_oversize_block_waits_in_its_threads_shard() {
    let (host, alloc) = pool();
    let pool = &*alloc.shared;
    let bound = pool.config.cache_bytes_per_shard;
    let a = alloc.memalloc(&host, bound + 1).unwrap();
    let addr = a.device_ptr();
    drop(a);
    assert_eq!(parked(pool), 1);
    let stats = pool.stats();
    assert_eq!(stats.in_use_blocks, 0, "{stats:?}");
    assert!(
        stats.cached_bytes > bound,
        "the slot's block is cached: {stats:?}"
    );
    let again = alloc.memalloc(&host, bound + 100).unwrap();
    assert_eq!((again.device_ptr(), again.size()), (addr, bound + 100));
    assert_eq!(parked(pool), 0);
    drop(again);
    // Another size takes the slot; the older block goes to the arena.
    drop(alloc.memalloc(&host, 2 * bound).unwrap());
    assert_eq!(parked(pool), 1);
    let slot = thread_slots::lock_all(&pool.shards)
        .iter()
        .find_map(|l| l.oversize.as_ref().map(|b| b.size));
    assert_eq!(slot, Some(2 * bound));
    alloc.trim().unwrap();
    assert_eq!(parked(pool), 0);
    assert_eq!(pool.stats().held_bytes, 0);
    drop(alloc.memalloc(&host, bound + 1).unwrap());
    assert_eq!(parked(pool), 1);
    DeviceAllocator::reset(&alloc, &host).unwrap();
    assert_eq!(parked(pool), 0);
}

/// Before the pool grows, it takes back the oversize blocks threads' shards keep: a block
/// one thread freed serves another thread's request of its size without the pool holding
/// a second one.
#[test]
fn the_pool_takes_back_oversize_blocks_before_it_grows() {
    let (host, alloc) = pool();
    let pool = &*alloc.shared;
    let big = pool.config.cache_bytes_per_shard * 2;
    std::thread::scope(|s| {
        s.spawn(|| drop(alloc.memalloc(&host, big).unwrap()));
    });
    let before = pool.stats();
    assert_eq!(parked(pool), 1, "kept in the finished thread's shard");
    let b = alloc.memalloc(&host, big).unwrap();
    let after = pool.stats();
    assert_eq!(after.grows, before.grows, "{before:?} {after:?}");
    assert_eq!(after.held_bytes, before.held_bytes);
    assert_eq!(parked(pool), 0);
    drop(b);
}

/// Large blocks past the shard's slots or its byte bound leave it, oldest first, their
/// records let go, and the room they held comes back.
#[test]
fn large_blocks_past_the_slots_leave_with_their_records() {
    let (host, alloc) = pool();
    let pool = &*alloc.shared;
    // Past the byte bound: two blocks of 20 MiB do not fit a 32 MiB shard.
    drop(alloc.memalloc(&host, 20 << 20).unwrap());
    drop(alloc.memalloc(&host, (20 << 20) + 4096).unwrap());
    assert_eq!(parked(pool), 1, "the older one left");
    alloc.trim().unwrap();
    assert_eq!(parked(pool), 0);
    // Past the slots.
    let blocks: Vec<_> = (0..LARGE_SLOTS + 3)
        .map(|i| alloc.memalloc(&host, (1 << 20) + (i + 1) * 4096).unwrap())
        .collect();
    drop(blocks);
    assert_eq!(parked(pool), LARGE_SLOTS);
    let stats = pool.stats();
    assert_eq!(stats.in_use_blocks, 0, "{stats:?}");
    // Every large block of the sizes still cached comes back with its record.
    let again: Vec<_> = (3..LARGE_SLOTS + 3)
        .map(|i| alloc.memalloc(&host, (1 << 20) + (i + 1) * 4096).unwrap())
        .collect();
    assert_eq!(parked(pool), 0);
    drop(again);
    assert_eq!(parked(pool), LARGE_SLOTS);
}

#[test]
fn trim_and_reset_let_every_parked_record_go() {
    let (host, alloc) = pool();
    let pool = &*alloc.shared;
    let blocks: Vec<_> = (0..40)
        .map(|i| alloc.memalloc(&host, 256 << (i % 8)).unwrap())
        .chain((0..4).map(|i| alloc.memalloc(&host, (2 << 20) + i).unwrap()))
        .collect();
    drop(blocks);
    assert_eq!(parked(pool), 44);
    alloc.trim().unwrap();
    assert_eq!(parked(pool), 0);
    let stats = pool.stats();
    assert_eq!((stats.held_bytes, stats.cached_bytes), (0, 0), "{stats:?}");

    let blocks: Vec<_> = (0..40)
        .map(|_| alloc.memalloc(&host, 4096).unwrap())
        .chain((0..4).map(|i| alloc.memalloc(&host, (4 << 20) + i).unwrap()))
        .collect();
    drop(blocks);
    assert_eq!(parked(pool), 44);
    DeviceAllocator::reset(&alloc, &host).unwrap();
    assert_eq!(parked(pool), 0);
    assert_eq!(pool.stats().cached_bytes, 0);
}

/// A parked record holds a clone of the pool's hook, and so of the pool: were they not let
/// go when the pool is dropped, the pool would keep itself alive. A host runtime may drop
/// a pool it made without a reset.
#[test]
fn a_pool_dropped_without_a_reset_is_freed_once_its_threads_are_gone() {
    let pool = std::thread::spawn(|| {
        let (host, alloc) = pool();
        let mut blocks: Vec<_> = (0..20)
            .map(|_| alloc.memalloc(&host, 512).unwrap())
            .chain([alloc.memalloc(&host, 5 << 20).unwrap()])
            .collect();
        let outlives = blocks.remove(0);
        drop(blocks);
        assert_eq!(parked(&alloc.shared), 20);
        let pool = Arc::clone(&alloc.shared);
        drop(alloc);
        assert_eq!(parked(&pool), 0, "the pool's drop let them go");
        // A pointer that outlives the pool's allocator does not park its record.
        drop(outlives);
        assert_eq!(parked(&pool), 0, "parked after the pool was dropped");
        pool
    })
    .join()
    .expect("the thread");
    // The thread's spare records, which kept clones of the hook, went with it.
    assert_eq!(Arc::strong_count(&pool), 1, "only this clone is left");
}
