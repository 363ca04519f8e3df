//! The pool's shared state at work ([`PoolShared`]): size-class limits, taking from and
//! giving back to the arena, growth and shedding, trimming, reset and the figures the pool
//! reports. The module text of `pool` gives the design.

use super::*;

impl PoolShared {
    /// Blocks of `class` a shard keeps before it hands a magazine on: computed once per class
    /// (a division on every free costs more cycles than the rest of the list push).
    pub(super) fn cache_limit(&self, class: usize) -> usize {
        self.cache_limits[class]
    }

    pub(super) fn cache_limits(config: &PoolConfig) -> [usize; CLASSES] {
        std::array::from_fn(|class| (config.cache_bytes_per_class / class_size(class)).max(8))
    }

    pub(super) fn batch(class: usize) -> usize {
        ((256 << 10) / class_size(class)).clamp(1, 16)
    }

    /// Blocks in a magazine passed through the depot: up to 1 MiB of them, 2 to 64.
    pub(super) fn magazine(class: usize) -> usize {
        ((1 << 20) / class_size(class)).clamp(2, 64)
    }

    /// Magazines the depot keeps per class: together twice a shard's cache limit, at least 2.
    pub(super) fn depot_limit(&self, class: usize) -> usize {
        (2 * self.cache_limit(class) / Self::magazine(class)).max(2)
    }

    /// A full magazine of `class` from the depot, and the generation its blocks belong to.
    pub(super) fn take_magazine(&self, class: usize) -> Option<(Vec<u64>, u64)> {
        let mut depot = lock(&self.depot);
        let magazine = depot.magazines[class].pop()?;
        depot.cached_bytes -= magazine.len() * class_size(class);
        Some((magazine, depot.generation))
    }

    /// Keeps the record of a block's last pointer, dropped on `shard`'s thread, with the block
    /// in that shard (a small block in its class's parked list, a larger one among the large
    /// blocks or in the oversize slot: [`park_above_small`](Self::park_above_small)), if the
    /// shard has room for both (else hands it back, and the block is released by
    /// [`release`](Self::release), which may pass it on).
    #[inline]
    pub(super) fn park(
        &self,
        (shard, owner): (usize, bool),
        record: ParkedPointer,
        bytes: usize,
        tag: u64,
    ) -> Option<ParkedPointer> {
        if bytes > self.config.small_max {
            return self.park_above_small((shard, owner), record, bytes, tag);
        }
        let class = class_of(bytes);
        let size = class_size(class);
        let mut lists = self.shards[shard].inner.enter(owner);
        if lists.park_room == 0
            || lists.cached(class) >= self.cache_limit(class)
            || lists.cached_bytes + size > self.config.cache_bytes_per_shard
            || self.generation.load(Ordering::Acquire) != tag
        {
            return Some(record);
        }
        lists.returned(size);
        lists.cached_bytes += size;
        lists.park_room -= 1;
        lists.history.free(record.base(), record.stamp());
        lists.parked[class].push(record);
        None
    }

    /// [`park`](Self::park) for a block above `small_max`, kept out of `park` so that the
    /// small blocks' path there stays as it is (its time moved by 30 % with the code beside it
    /// in one build, at the same instruction count): the block is kept with its record among
    /// the shard's large blocks (within the byte bound, as
    /// [`release_large`](Self::release_large) keeps a block alone) or, above the bound, in the
    /// shard's one oversize slot, whose older block goes to the arena.
    #[inline(never)]
    pub(super) fn park_above_small(
        &self,
        (shard, owner): (usize, bool),
        record: ParkedPointer,
        bytes: usize,
        tag: u64,
    ) -> Option<ParkedPointer> {
        let size = block_size(bytes, self.config.small_max);
        let evicted = {
            let mut lists = self.shards[shard].inner.enter(owner);
            if lists.park_room == 0 || self.generation.load(Ordering::Acquire) != tag {
                return Some(record);
            }
            lists.park_room -= 1;
            lists.returned(size);
            lists.history.free(record.base(), record.stamp());
            let block = Large {
                addr: record.base(),
                size,
                record: Some(record),
            };
            if size > self.config.cache_bytes_per_shard {
                let older = lists.oversize.replace(block);
                older.map(|b| vec![lists.let_go(b)]).unwrap_or_default()
            } else {
                self.keep_large(&mut lists, block)
            }
        };
        if !evicted.is_empty() {
            self.to_arena(tag, evicted);
        }
        None
    }

    /// Moves every block above `small_max` that the shards cache (their large blocks and their
    /// oversize ones) to the arena, before the pool grows: a block another thread's shard keeps
    /// may be the one this request needs, or may merge with its free neighbours into one large
    /// enough, and a chunk with a cached block in it cannot go back to the driver. Returns
    /// whether there was any.
    #[cold]
    pub(super) fn reclaim_large(&self) -> bool {
        let (taken, generation) = {
            let mut shards = thread_slots::lock_all(&self.shards);
            let mut taken: Vec<(u64, usize)> = Vec::new();
            for lists in shards.iter_mut() {
                for block in lists.large.take_all() {
                    lists.cached_bytes -= block.size;
                    taken.push(lists.let_go(block));
                }
                if let Some(block) = lists.oversize.take() {
                    taken.push(lists.let_go(block));
                }
            }
            (taken, self.generation.load(Ordering::Acquire))
        };
        if taken.is_empty() {
            return false;
        }
        tracing::debug!(device = %self.cx.device, blocks = taken.len(), "pool took back the threads' large blocks before growing");
        self.to_arena(generation, taken);
        true
    }

    /// Puts `block` (counted as returned) on `lists`' large blocks and evicts the oldest past
    /// [`LARGE_SLOTS`] or the byte bound, the block itself included if need be; returns the
    /// evicted blocks, their records let go, for the arena.
    pub(super) fn keep_large(&self, lists: &mut ShardLists, block: Large) -> Vec<(u64, usize)> {
        let bound = self.config.cache_bytes_per_shard;
        lists.cached_bytes += block.size;
        lists.large.push(block);
        let mut evict = 0;
        // The small classes' bytes count against the bound too, so it may take every large
        // block, the one just given included.
        while evict < lists.large.len()
            && (lists.large.len() - evict > LARGE_SLOTS || lists.cached_bytes > bound)
        {
            lists.cached_bytes -= lists.large[evict].size;
            evict += 1;
        }
        if evict == 0 {
            return Vec::new();
        }
        let evicted = lists.large.take_first(evict);
        evicted.into_iter().map(|b| lists.let_go(b)).collect()
    }

    pub(super) fn release(
        &self,
        (shard, owner): (usize, bool),
        addr: u64,
        bytes: usize,
        (tag, stamp): (u64, u64),
    ) {
        if bytes > self.config.small_max {
            self.release_large((shard, owner), addr, bytes, (tag, stamp));
            return;
        }
        let class = class_of(bytes);
        let size = class_size(class);
        let spill = {
            let mut lists = self.shards[shard].inner.enter(owner);
            if self.generation.load(Ordering::Acquire) != tag {
                return;
            }
            lists.returned(size);
            lists.history.free(addr, stamp);
            lists.cached_bytes += size;
            let over_shard = lists.cached_bytes > self.config.cache_bytes_per_shard;
            lists.free[class].push(addr);
            if lists.cached(class) <= self.cache_limit(class) && !over_shard {
                return;
            }
            // A magazine of the blocks by address, the newest, and then of the oldest parked
            // ones, their records let go (to this thread's spares).
            let want = Self::magazine(class).min(lists.cached(class));
            let mut magazine = Vec::with_capacity(want);
            lists.free[class].move_last_into(want, &mut magazine);
            let unparked = want - magazine.len();
            if unparked > 0 {
                let parked = lists.parked[class].take_first(unparked);
                magazine.extend(parked.into_iter().map(|p| p.into_base().0));
                lists.park_room += unparked;
            }
            lists.cached_bytes -= magazine.len() * size;
            magazine
        };
        // A full magazine goes to the depot for another shard; with the depot full, to the
        // arena, where its blocks coalesce.
        let spill = {
            let mut depot = lock(&self.depot);
            if depot.generation != tag {
                return; // a reset freed them
            }
            if depot.magazines[class].len() < self.depot_limit(class) {
                depot.cached_bytes += spill.len() * size;
                depot.magazines[class].push(spill);
                return;
            }
            spill
        };
        self.to_arena(tag, spill.into_iter().map(|a| (a, size)));
    }

    /// A block above `small_max` goes to the freeing thread's shard, which keeps the last
    /// [`LARGE_SLOTS`] it was given (within its byte bound, so a block larger than the bound
    /// goes to the arena at once); the oldest go to the arena, where they coalesce.
    pub(super) fn release_large(
        &self,
        (shard, owner): (usize, bool),
        addr: u64,
        bytes: usize,
        (tag, stamp): (u64, u64),
    ) {
        let size = block_size(bytes, self.config.small_max);
        let evicted: Vec<(u64, usize)> = {
            let mut lists = self.shards[shard].inner.enter(owner);
            if self.generation.load(Ordering::Acquire) != tag {
                return; // a reset freed its chunk
            }
            lists.returned(size);
            lists.history.free(addr, stamp);
            if size > self.config.cache_bytes_per_shard {
                drop(lists);
                return self.to_arena(tag, [(addr, size)]);
            }
            let block = Large {
                addr,
                size,
                record: None,
            };
            self.keep_large(&mut lists, block)
        };
        if !evicted.is_empty() {
            self.to_arena(tag, evicted);
        }
    }

    /// A cached block of exactly `size` bytes (above `small_max`) from `shard`, counted as in
    /// use, with its generation and its history stamp.
    pub(super) fn take_large(
        &self,
        (shard, owner): (usize, bool),
        size: usize,
        bytes: usize,
    ) -> Option<(Large, u64, u64)> {
        let mut lists = self.shards[shard].inner.enter(owner);
        let block = if size > self.config.cache_bytes_per_shard {
            // Only the oversize slot holds blocks above the bound (outside `cached_bytes`).
            lists.oversize.take_if(|b| b.size == size)?
        } else {
            let i = lists.large.iter().rposition(|b| b.size == size)?;
            lists.cached_bytes -= size;
            lists.large.remove(i)
        };
        lists.give_back_room(&block);
        lists.lent(size);
        let stamp = lists.history.alloc(block.addr, bytes);
        Some((block, self.generation.load(Ordering::Acquire), stamp))
    }

    /// Counts the block at `addr` of `size` bytes (for a request of `bytes`) that `shard`'s
    /// thread took from the arena as in use, unless a reset since `generation` forgot it;
    /// returns its history stamp (0 for a block the reset forgot).
    pub(super) fn count_in_use(
        &self,
        (shard, owner): (usize, bool),
        (addr, size, bytes): (u64, usize, usize),
        generation: u64,
    ) -> u64 {
        let mut lists = self.shards[shard].inner.enter(owner);
        if self.generation.load(Ordering::Acquire) != generation {
            return 0;
        }
        lists.lent(size);
        lists.history.alloc_fresh(addr, bytes, NO_STREAM)
    }

    /// Gives `blocks` (address, size) back to the arena, unless a reset since `generation`
    /// freed their chunks.
    pub(super) fn to_arena(&self, generation: u64, blocks: impl IntoIterator<Item = (u64, usize)>) {
        let mut arena = lock(&self.arena);
        if arena.generation == generation {
            for (addr, size) in blocks {
                arena.give(addr, size);
            }
        }
    }

    /// Moves every cached block (the shards' and the depot's) back to the arena; with `close`
    /// (the allocator's drop), no record parks in a shard afterwards.
    pub(super) fn drain_shards(&self, close: bool) {
        let (magazines, generation) = {
            let mut depot = lock(&self.depot);
            depot.cached_bytes = 0;
            (
                take_nonempty(&mut depot.magazines, std::mem::take),
                depot.generation,
            )
        };
        let blocks = magazines.into_iter().flat_map(|(class, held)| {
            held.into_iter()
                .flatten()
                .map(move |a| (a, class_size(class)))
        });
        self.to_arena(generation, blocks);
        let (taken, generation) = {
            let mut shards = thread_slots::lock_all(&self.shards);
            let taken: Vec<_> = shards
                .iter_mut()
                .map(|lists| {
                    lists.cached_bytes = 0;
                    let parked = lists.take_parked();
                    if close {
                        lists.park_room = 0;
                    }
                    // Every record is out, the large blocks' too: `take_parked` gave the shard
                    // back all its room.
                    (
                        parked,
                        take_nonempty(&mut lists.free, Lines::take_all),
                        lists.take_large_blocks(),
                    )
                })
                .collect();
            // Read under every shard's lock: a reset, which takes them all, cannot move it.
            (taken, self.generation.load(Ordering::Acquire))
        };
        // The parked records are let go here, with no shard entered.
        for (parked, lists, large) in taken {
            let blocks = lists
                .into_iter()
                .flat_map(|(class, held)| held.into_iter().map(move |a| (a, class_size(class))));
            let large = large.into_iter().map(Large::into_block);
            self.to_arena(generation, unparked(parked).chain(blocks).chain(large));
        }
    }

    /// Returns cached blocks to the arena and queues the free of every unused chunk (the
    /// streams' too, those whose work is done; with `wait`, every stream's after waiting for
    /// its work); returns the bytes queued. The caller flushes.
    pub(super) fn trim_to_queue(&self, wait: bool) -> usize {
        self.totals.in_use_mark.store(0, Ordering::Relaxed);
        if let Err(e) = self.release_idle_stream_chunks(wait) {
            tracing::warn!(device = %self.cx.device, error = %e, "returning the streams' free chunks to the pool failed; the trim leaves them out");
            self.queue.record_error(e);
        }
        self.drain_shards(false);
        let chunks = lock(&self.arena).remove_free_chunks();
        let bytes = chunks.iter().map(|c| c.size).sum();
        if !chunks.is_empty() {
            self.totals.released(bytes, true);
            tracing::debug!(device = %self.cx.device, chunks = chunks.len(), bytes, "pool trimmed");
            self.release_chunks(chunks, false);
        }
        bytes
    }

    /// The bytes of wholly free chunks, of `free` about to go back to the driver before a
    /// growth for `size` bytes, that `pool` may keep: as many as leave the pool, once grown,
    /// holding at most an eighth ([`KEPT_DIVISOR`]) more than the most in use on streams with
    /// a request at a growth since the last trim (or reset), this one's included. A program that frees
    /// its step's memory and allocates it again at the next step, in other sizes, finds its
    /// chunks again instead of giving them back and taking them anew; the pool's peak held
    /// stays within that eighth of the peak in use, or what shedding every free chunk would
    /// have held where the chunks in use hold more free space than that already.
    pub(super) fn kept_through_growth(&self, size: usize, free: usize) -> usize {
        let wanted = self.stream_in_use_bytes().saturating_add(size);
        let mark = self
            .totals
            .in_use_mark
            .fetch_max(wanted, Ordering::Relaxed)
            .max(wanted);
        let bound = mark.saturating_add(mark / KEPT_DIVISOR);
        let held = self.totals.held.load(Ordering::Relaxed);
        let least = held.saturating_sub(free).saturating_add(self.growth(size));
        bound.saturating_sub(least).min(free)
    }

    /// The bytes of stream-ordered blocks in use (a lock of the stream lists where they hold
    /// memory). The blocks of `memalloc` are left out: counting them takes every thread's
    /// shard at once, which a growth does not do, so a pool used through `memalloc` alone keeps
    /// no free chunk through a growth ([`kept_through_growth`](Self::kept_through_growth)).
    pub(super) fn stream_in_use_bytes(&self) -> usize {
        if !self.streams.occupied() {
            return 0;
        }
        lock(self.streams.lists()).in_use_bytes.max(0) as usize
    }

    /// The bytes the pool grows by for a request of `size` bytes: `size` rounded up to 2 MiB
    /// for a request served from a chunk of its own; else an eighth of what the pool holds,
    /// at least 2 MiB and at most the chunk size (or that rounded request, when larger), so
    /// that a small pool grows in small steps and a large one in few.
    pub(super) fn growth(&self, size: usize) -> usize {
        let need = size.div_ceil(GROW_GRANULARITY) * GROW_GRANULARITY;
        if size > self.config.oversize_above(self.vmm.is_some()) {
            return need;
        }
        let held = self.totals.held.load(Ordering::Relaxed);
        let divisor = if self.vmm.is_some() {
            VMM_GROWTH_DIVISOR
        } else {
            GROWTH_DIVISOR
        };
        let step = (held / divisor).div_ceil(GROW_GRANULARITY) * GROW_GRANULARITY;
        need.max(step.clamp(GROW_GRANULARITY, self.config.chunk_size))
    }

    /// The bytes a growth in place maps past a free block of `free` bytes for a request of
    /// `size` bytes: what the block lacks, as a growth step ([`growth`](Self::growth)).
    pub(super) fn growth_after(&self, free: usize, size: usize) -> usize {
        self.growth(size.saturating_sub(free).max(1))
    }

    /// New memory from the driver that holds `size` bytes, of [`growth`](Self::growth) bytes
    /// (or `size` rounded up to 2 MiB, when the driver cannot give that), as chunks side by
    /// side (one for `pool`; `vmm-pool`'s runs of pieces of one size). Out of memory, the pool
    /// first gives back every chunk with nothing in use, the streams' after their work, and
    /// tries once more.
    pub(super) fn new_chunk(&self, size: usize) -> Result<Vec<Chunk>, DriverError> {
        let need = size.div_ceil(GROW_GRANULARITY) * GROW_GRANULARITY;
        let want = self.growth(size);
        let alloc = |bytes| self.allocate_chunk(bytes);
        let runs = match alloc(want) {
            Ok(b) => b,
            Err(e) if e.kind() == ErrorKind::OutOfMemory => {
                let fallback = if want > need { alloc(need) } else { Err(e) };
                match fallback {
                    Ok(b) => b,
                    Err(e) if e.kind() == ErrorKind::OutOfMemory => {
                        let queued = self.trim_to_queue(true);
                        tracing::warn!(device = %self.cx.device, requested = size, released = queued, "pool out of memory; trimmed, retrying");
                        // Inside defer_cleanup the frees stay queued and the retry fails.
                        if queued > 0
                            && let Err(e) = self.queue.flush()
                        {
                            tracing::warn!(device = %self.cx.device, error = %e, "freeing the trimmed chunks before the retry failed");
                            // Kept for the next flush to return.
                            self.queue.record_error(e);
                        }
                        self.cx.events.retried();
                        alloc(need)?
                    }
                    Err(e) => return Err(e),
                }
            }
            Err(e) => return Err(e),
        };
        let oversize = size > self.config.oversize_above(self.vmm.is_some());
        let chunks = self.grown(runs, oversize);
        tracing::debug!(device = %self.cx.device, bytes = chunks.iter().map(|c| c.size).sum::<usize>(), pieces = ?chunks.iter().map(|c| c.piece).collect::<Vec<_>>(), ptr = chunks[0].base, "pool grew");
        Ok(chunks)
    }

    /// The runs of pieces a growth mapped (at least one), as chunks, counted as grown.
    fn grown(&self, runs: super::vmm::Runs, oversize: bool) -> Vec<Chunk> {
        let chunks: Vec<Chunk> = runs
            .into_iter()
            .map(|(base, size, piece)| Chunk {
                base,
                size,
                piece,
                oversize,
                lent: false,
            })
            .collect();
        self.totals.grew(chunks.iter().map(|c| c.size).sum());
        chunks
    }

    /// `vmm-pool`: grows the largest free block that ends where mapped memory does, by mapping
    /// what a request of `size` bytes lacks just past it, and takes the block. The wholly free
    /// chunks elsewhere go back to the driver first (they could not serve the request); the
    /// block's own stay, so a loop whose requests outgrow the free space by a little maps a
    /// little, where shedding every free chunk and growing anew would unmap and map most of
    /// the pool again. `None` where no free block ends at a chunk's end with room after it in
    /// the reservation, or the mapping failed (the caller's growth reports it, and out of
    /// memory frees what it can and retries).
    pub(super) fn grow_in_place(&self, size: usize) -> Option<(u64, u64)> {
        self.vmm.as_ref()?;
        let (tail, free, shed) = {
            let mut arena = lock(&self.arena);
            let (end, free) = arena.tail(size)?;
            let most = self.growth_after(free, size);
            // Nothing moves for a growth that cannot map there.
            if !self.can_map_at(end, most) {
                return None;
            }
            let shed = arena.shed_free_chunks_outside(size, (end - free as u64, end), most);
            (end, free, shed)
        };
        self.free_chunks(shed, "before growing in place");
        let chunks = self.map_after(tail, free, size)?;
        let mut arena = lock(&self.arena);
        for chunk in chunks {
            arena.add_chunk(chunk);
        }
        // Another thread may have taken from the block meanwhile: a growth follows.
        arena.take_stamped(size)
    }

    /// Chunks mapped at `tail`, the end of a free block of `free` bytes, side by side, with
    /// what a request of `size` bytes lacks beyond that block (a growth step at least); `None`
    /// where that range of the reservation is not free or the mapping failed (the caller's
    /// growth reports it, and out of memory frees what it can and retries).
    pub(super) fn map_after(&self, tail: u64, free: usize, size: usize) -> Option<Vec<Chunk>> {
        let want = self.growth_after(free, size);
        match self.allocate_chunk_at(tail, want) {
            Ok(Some(runs)) => {
                let chunks = self.grown(runs, size > self.config.oversize_above(true));
                tracing::debug!(device = %self.cx.device, bytes = chunks.iter().map(|c| c.size).sum::<usize>(), pieces = ?chunks.iter().map(|c| c.piece).collect::<Vec<_>>(), ptr = tail, extended = free, "pool grew in place");
                Some(chunks)
            }
            Ok(None) => None,
            Err(e) => {
                tracing::debug!(device = %self.cx.device, error = %e, bytes = want, "growing in place failed; the pool grows as usual");
                None
            }
        }
    }

    /// Empty arenas for this pool's chunks: a stream's ([`empty_arenas`]).
    pub(super) fn new_arenas(&self) -> Arenas {
        empty_arenas(&self.config, self.vmm.as_ref())
    }

    /// The manager's registered name, for errors.
    pub(super) fn manager_name(&self) -> &'static str {
        if self.vmm.is_some() {
            VMM_POOL_MANAGER
        } else {
            POOL_MANAGER
        }
    }

    /// Grows the pool by a chunk that holds `size` bytes and takes a block of `size` from it.
    pub(super) fn grow_and_take(&self, size: usize) -> Result<(u64, u64), DriverError> {
        let chunks = self.new_chunk(size)?;
        let mut arena = lock(&self.arena);
        for chunk in chunks {
            arena.add_chunk(chunk);
        }
        Ok(arena
            .take_stamped(size)
            .expect("a new chunk fits the request"))
    }

    /// A block of `size` bytes from the arena (growing the pool if needed), and the generation
    /// it belongs to.
    pub(super) fn take_from_arena(
        &self,
        host: &HostLayer,
        size: usize,
    ) -> Result<(u64, u64), EmmError> {
        if let Some(found) = lock(&self.arena).take_stamped(size) {
            return Ok(found);
        }
        let _relaxed = self.cx.relax_capture();
        let grown = host.attempt_allocation("memalloc", AllocationKind::Device, size, || {
            // Another thread may have grown the pool meanwhile; or the block it needs may be a
            // thread's oversize block.
            if let Some(found) = lock(&self.arena).take_stamped(size) {
                return Ok(found);
            }
            if self.reclaim_large()
                && let Some(found) = lock(&self.arena).take_stamped(size)
            {
                return Ok(found);
            }
            // Or it may be free in the stream arena, freed on streams whose work is done.
            match self.release_idle_stream_chunks(false) {
                Ok(0) => {}
                Ok(_) => {
                    if let Some(found) = lock(&self.arena).take_stamped(size) {
                        return Ok(found);
                    }
                }
                Err(e) => {
                    tracing::warn!(device = %self.cx.device, error = %e, "taking back the streams' free chunks failed; the pool grows instead");
                    self.queue.record_error(e);
                }
            }
            // About to grow: every block the shards cache goes back to the arena first, so that
            // merged with its neighbours it may serve the request, and so that a chunk it kept
            // in use can go back to the driver.
            self.drain_shards(false);
            if let Some(found) = lock(&self.arena).take_stamped(size) {
                return Ok(found);
            }
            if let Some(found) = self.grow_in_place(size) {
                return Ok(found);
            }
            self.shed_free_chunks(None, size);
            self.grow_and_take(size)
        });
        self.release_spares();
        grown
    }

    /// The free space, block by block: the stream arena, the shards' and the depot's cached
    /// blocks, and the shared arena (locks in the order `stats` takes them).
    pub(super) fn free_space(&self) -> FreeSpace {
        let mut blocks = Vec::new();
        lock(self.streams.lists()).free_block_sizes(&mut blocks);
        for lists in thread_slots::lock_all(&self.shards) {
            lists.cached_block_sizes(&mut blocks);
        }
        {
            let depot = lock(&self.depot);
            for (class, magazines) in depot.magazines.iter().enumerate() {
                let count = magazines.iter().map(Vec::len).sum();
                blocks.extend(std::iter::repeat_n(class_size(class), count));
            }
        }
        lock(&self.arena).free_block_sizes(&mut blocks);
        FreeSpace::from_blocks(blocks)
    }

    /// Every chunk as a segment, with its free, cached and waiting blocks (locks in the order
    /// `stats` takes them).
    pub(super) fn segments(&self) -> Vec<HeldSegment> {
        let kind = if self.vmm.is_some() {
            SegmentKind::VirtualRange
        } else {
            SegmentKind::Chunk
        };
        let mut streams = Vec::new();
        lock(self.streams.lists()).held_segments(kind, &mut streams);
        let mut cached = Vec::new();
        for lists in thread_slots::lock_all(&self.shards) {
            lists.cached_blocks(&mut cached);
        }
        {
            let depot = lock(&self.depot);
            for (class, magazines) in depot.magazines.iter().enumerate() {
                let size = class_size(class);
                cached.extend(magazines.iter().flatten().map(|&a| (a, size)));
            }
        }
        let mut shared = Vec::new();
        {
            let arena = lock(&self.arena);
            arena.held_segments(kind, None, &mut shared);
            shared.sort_by_key(|s| s.address);
            arena::cut_out(&mut shared, arena.lent_out());
        }
        arena::place(
            &mut shared,
            cached.into_iter().map(|(address, bytes)| HeldBlock {
                address,
                bytes,
                state: BlockState::Cached,
            }),
        );
        shared.extend(streams);
        shared
    }

    pub(super) fn stats(&self) -> PoolStats {
        let (mut blocks, mut bytes, mut cached, mut chunks, mut largest) = (0i64, 0i64, 0, 0, 0);
        {
            let s = lock(self.streams.lists());
            blocks += s.in_use_blocks;
            bytes += s.in_use_bytes;
            cached += s.cached_bytes();
            chunks += s.chunks();
            largest = largest.max(s.largest_free());
        }
        for lists in thread_slots::lock_all(&self.shards) {
            blocks += lists.in_use_blocks;
            bytes += lists.in_use_bytes;
            cached += lists.cached_bytes + lists.oversize.as_ref().map_or(0, |b| b.size);
            largest = largest.max(lists.largest_cached());
        }
        {
            let depot = lock(&self.depot);
            cached += depot.cached_bytes;
            if let Some(class) = (0..CLASSES).rev().find(|&c| !depot.magazines[c].is_empty()) {
                largest = largest.max(class_size(class));
            }
        }
        let arena = lock(&self.arena);
        PoolStats {
            held_bytes: self.totals.held.load(Ordering::Relaxed),
            in_use_bytes: bytes.max(0) as usize,
            in_use_blocks: blocks.max(0) as usize,
            cached_bytes: cached,
            peak_held_bytes: self.totals.peak_held.load(Ordering::Relaxed),
            chunks: chunks + arena.chunks(),
            grows: self.totals.grows.load(Ordering::Relaxed),
            driver_allocations: self.totals.driver_allocations.load(Ordering::Relaxed),
            driver_frees: self.totals.driver_frees.load(Ordering::Relaxed),
            stream_waits: self.totals.stream_waits.load(Ordering::Relaxed),
            host_waits: self.totals.host_waits.load(Ordering::Relaxed),
            trimmed_bytes: self.totals.trimmed.load(Ordering::Relaxed),
            largest_free_bytes: Some(largest.max(arena.largest_free())),
        }
    }
}
