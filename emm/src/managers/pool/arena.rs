//! The arena: free space of all chunks, found by size in constant time and coalesced by
//! address in constant time.
//!
//! Free blocks are kept in bins by size: sixteen bins per doubling (a block's bin is its size's
//! top five bits in 256-byte units, as a two-level segregated fit allocator indexes them), a
//! bitmap of the bins that are not empty, and two address maps, one by start and one by end,
//! so that a freed block finds both neighbours with two hash lookups, where ordered maps by
//! size and by address would take several tree operations per block with thousands of free
//! blocks.
//!
//! The bins and both maps name a free block by its index in a slab of nodes, which holds its
//! extent and its place in its bin. A split keeps the block's node and its end (one hash map
//! entry moves, the start), a merge keeps the surviving neighbour's node, and a block moved
//! within its bin is renumbered in the slab, not in a map: a take with a split makes two hash
//! map operations, and a give with one free neighbour four.
//!
//! **Fit.** A request takes the first block large enough among the last [`SCAN`] of its own
//! bin, else the smallest of the last [`SCAN`] blocks of the smallest larger bin that is not
//! empty (every block there is larger than the request), else any block large enough in its
//! own bin: a request fails only when no free block is large enough, as with best fit, and the
//! block taken is at most one bin (6.25 %) larger than the best fit, except when only its own
//! bin has one. The rest of a block taken is split off and stays free. On RMM's random
//! workload this holds as little as best fit does, and sixteen bins per doubling hold less
//! than eight and no more than thirty-two.
//!
//! **The block given last** waits outside the bins and maps ([`Arena::recent`]) until the next
//! operation: a take of exactly its size gets it back at once (a best fit), so that a program
//! that frees
//! and allocates one large size in turn (above the shards' bound, every pair an arena
//! round trip) makes no hash map operation; any other take, give, trim or reset first puts it in,
//! merged with its neighbours as any freed block, so fits and merges are those of a block
//! given at once.

use std::collections::{BTreeMap, BTreeSet};

use crate::contract::snapshot::{BlockState, HeldBlock, HeldSegment, SegmentKind};
use crate::memory::AddressMap;
use crate::slab::Slab;

/// Sub-bins per doubling, as a power of two.
const SUB_BITS: u32 = 4;
/// Sub-bins per doubling.
const SUBS: usize = 1 << SUB_BITS;
/// Granularity of the bin index: sizes are counted in units of this many bytes.
const UNIT_SHIFT: u32 = 8;
/// Bins for every size a `usize` holds.
const BINS: usize = SUBS + (usize::BITS - UNIT_SHIFT - SUB_BITS) as usize * SUBS;
/// Words of the bitmap of non-empty bins.
const WORDS: usize = BINS.div_ceil(64);
/// Blocks of the request's own bin looked at before a larger bin is tried.
const SCAN: usize = 8;
/// [`Arena::take_sparing`] spares only chunks larger than this (the smallest growth), so that
/// a pool of small chunks finds its free ones as [`Arena::take`] does.
const SPARED_ABOVE: usize = 2 << 20;
/// Free blocks [`Arena::take_sparing`] looks at for one that is not a spared chunk.
const SPARING_SCAN: usize = 256;

/// The bin of a free block of `size` bytes; bins grow with size.
fn bin_of(size: usize) -> usize {
    let units = size >> UNIT_SHIFT;
    if units < SUBS {
        return units;
    }
    let top = usize::BITS - 1 - units.leading_zeros(); // >= SUB_BITS
    let sub = (units >> (top - SUB_BITS)) & (SUBS - 1);
    SUBS + (top - SUB_BITS) as usize * SUBS + sub
}

/// A free block: where it is, and its place in its bin's list. Kept in a slab and named by
/// index, so that the bin lists and both address maps point at it: moving a block in its bin,
/// or growing it by a freed neighbour, writes the slab, not a hash map.
#[derive(Clone, Copy, Debug)]
struct Node {
    addr: u64,
    size: usize,
    slot: usize,
}

/// A node's index in the slab.
type NodeId = u32;

/// Free space of all chunks: binned by size, mapped by start and end address.
#[derive(Debug)]
pub(super) struct Arena {
    /// Chunk base -> size.
    pub(super) chunks: BTreeMap<u64, usize>,
    /// The free blocks.
    nodes: Slab<Node>,
    /// Free block start -> its node.
    free: AddressMap<NodeId>,
    /// Free block end (one past its last byte) -> its node.
    ends: AddressMap<NodeId>,
    /// Per bin, the (size, node) of its free blocks, most recently freed last.
    bins: Vec<Vec<(usize, NodeId)>>,
    /// Bit `b` set when bin `b` holds a block.
    nonempty: [u64; WORDS],
    /// The block given last (start, size), not yet in the bins and maps: see the module's
    /// note. It belongs to the free space as much as they do.
    recent: Option<(u64, usize)>,
    /// Bytes of its chunks.
    pub(super) held: usize,
    /// Free space merges across the bases of chunks (chunks mapped next to each other in one
    /// address reservation: `vmm-pool`); otherwise a chunk's base starts a chunk.
    merge_across: bool,
    /// Where chunks merge, the size of each physical piece a growth maps: a chunk added is
    /// recorded as its pieces, so that each goes back to the driver once wholly free.
    piece: usize,
    /// Where chunks merge, the runs of chunks side by side: start -> end. Their ends are
    /// where memory mapped next extends the arena's free space ([`tail`](Self::tail)).
    runs: BTreeMap<u64, u64>,
}

impl Default for Arena {
    fn default() -> Arena {
        Arena {
            chunks: BTreeMap::new(),
            nodes: Slab::default(),
            free: AddressMap::default(),
            ends: AddressMap::default(),
            bins: vec![Vec::new(); BINS],
            nonempty: [0; WORDS],
            recent: None,
            held: 0,
            merge_across: false,
            piece: usize::MAX,
            runs: BTreeMap::new(),
        }
    }
}

impl Arena {
    /// Puts node `id` last in the bin of its size.
    fn bin_push(&mut self, id: NodeId) {
        let node = &mut self.nodes[id];
        let bin = bin_of(node.size);
        let list = &mut self.bins[bin];
        node.slot = list.len();
        list.push((node.size, id));
        self.nonempty[bin / 64] |= 1 << (bin % 64);
    }

    /// Takes node `id` out of its bin (the bin's last block moves into its slot).
    fn bin_remove(&mut self, id: NodeId) {
        let Node { size, slot, .. } = self.nodes[id];
        let bin = bin_of(size);
        let list = &mut self.bins[bin];
        list.swap_remove(slot);
        if let Some(&(_, moved)) = list.get(slot) {
            self.nodes[moved].slot = slot;
        }
        if list.is_empty() {
            self.nonempty[bin / 64] &= !(1 << (bin % 64));
        }
    }

    /// Gives node `id` a new extent, moving it to the end of the bin of its new size (as a
    /// block removed and inserted again would be).
    fn rebin(&mut self, id: NodeId, addr: u64, size: usize) {
        self.bin_remove(id);
        let node = &mut self.nodes[id];
        node.addr = addr;
        node.size = size;
        self.bin_push(id);
    }

    fn insert_free(&mut self, addr: u64, size: usize) {
        let id = self.nodes.insert(Node {
            addr,
            size,
            slot: 0,
        });
        self.bin_push(id);
        self.free.insert(addr, id);
        self.ends.insert(addr + size as u64, id);
    }

    /// Forgets node `id`, which the address maps no longer name.
    fn drop_node(&mut self, id: NodeId) {
        self.bin_remove(id);
        self.nodes.remove(id);
    }

    /// Removes the free block at `addr`, returning its size.
    fn remove_free(&mut self, addr: u64) -> usize {
        let id = self
            .free
            .remove(&addr)
            .expect("the arena removes only blocks it holds free");
        let size = self.nodes[id].size;
        self.ends.remove(&(addr + size as u64));
        self.drop_node(id);
        size
    }

    /// The smallest non-empty bin above `bin`.
    fn next_nonempty(&self, bin: usize) -> Option<usize> {
        let start = bin + 1;
        let mut word = start / 64;
        if word >= WORDS {
            return None;
        }
        let mut bits = self.nonempty[word] & (!0u64 << (start % 64));
        loop {
            if bits != 0 {
                return Some(word * 64 + bits.trailing_zeros() as usize);
            }
            word += 1;
            if word == WORDS {
                return None;
            }
            bits = self.nonempty[word];
        }
    }

    /// Puts the block given last into the bins and maps, merged with its free neighbours.
    fn settle(&mut self) {
        if let Some((addr, size)) = self.recent.take() {
            self.give_now(addr, size);
        }
    }

    /// A free block of at least `size` bytes (see the module's note on fit), split.
    pub(super) fn take(&mut self, size: usize) -> Option<u64> {
        if let Some(addr) = self.take_recent(size) {
            return Some(addr);
        }
        let found = self.find(size)?;
        Some(self.split(found, size))
    }

    /// [`take`](Self::take), sparing wholly free chunks larger than `most()` bytes (what the
    /// pool would grow by for the request): where the block found is such a chunk, another
    /// free block that holds `size` is taken instead, and with none, nothing (the caller may
    /// look elsewhere, then [`take`](Self::take) the chunk). A small block placed in a large
    /// free chunk keeps it from going back to the driver and from serving a large request for
    /// as long as it lives; partly used chunks serve it as well.
    pub(super) fn take_sparing(
        &mut self,
        size: usize,
        most: impl FnOnce() -> usize,
    ) -> Option<u64> {
        if let Some(addr) = self.take_recent(size) {
            return Some(addr);
        }
        let mut found = self.find(size)?;
        let Node {
            addr, size: len, ..
        } = self.nodes[found];
        if !self.merge_across && len > SPARED_ABOVE {
            let most = most();
            if len > most && self.chunks.get(&addr) == Some(&len) {
                found = self.find_unspared(size, most)?;
            }
        }
        Some(self.split(found, size))
    }

    /// A free block of at least `size` bytes that is not a wholly free chunk larger than
    /// `most`: the first of the bins from the request's own up, at most [`SPARING_SCAN`]
    /// blocks looked at.
    #[cold]
    fn find_unspared(&self, size: usize, most: usize) -> Option<NodeId> {
        let mut bin = bin_of(size);
        let mut looked = 0;
        loop {
            for &(len, id) in self.bins[bin].iter().rev() {
                looked += 1;
                if looked > SPARING_SCAN {
                    return None;
                }
                let addr = self.nodes[id].addr;
                if len >= size && (len <= most || self.chunks.get(&addr) != Some(&len)) {
                    return Some(id);
                }
            }
            bin = self.next_nonempty(bin)?;
        }
    }

    /// The block given last, if it is of exactly `size` bytes (a best fit at once); else it
    /// goes into the bins and maps first.
    fn take_recent(&mut self, size: usize) -> Option<u64> {
        let (addr, given) = self.recent?;
        if given == size {
            self.recent = None;
            return Some(addr);
        }
        self.settle();
        None
    }

    /// The free block a request of `size` bytes takes (see the module's note on fit).
    fn find(&self, size: usize) -> Option<NodeId> {
        let bin = bin_of(size);
        let own = &self.bins[bin];
        let fits = |&&(s, _): &&(usize, NodeId)| s >= size;
        let found = match own.iter().rev().take(SCAN).find(fits) {
            Some(&(_, id)) => id,
            None => match self.next_nonempty(bin) {
                // The smallest of the bin's last few: closer to best fit, for the same cost.
                Some(larger) => {
                    let list = &self.bins[larger];
                    list.iter()
                        .rev()
                        .take(SCAN)
                        .min_by_key(|&&(s, _)| s)
                        .expect("a non-empty bin")
                        .1
                }
                None => own.iter().rev().skip(SCAN).find(fits)?.1,
            },
        };
        Some(found)
    }

    /// Takes `size` bytes from the start of free block `found`; the rest stays free.
    fn split(&mut self, found: NodeId, size: usize) -> u64 {
        let Node {
            addr,
            size: found_size,
            ..
        } = self.nodes[found];
        self.free.remove(&addr);
        if found_size > size {
            // The rest keeps the node and its end; only its start moves.
            let rest = addr + size as u64;
            self.free.insert(rest, found);
            self.rebin(found, rest, found_size - size);
        } else {
            self.ends.remove(&(addr + size as u64));
            self.drop_node(found);
        }
        addr
    }

    /// Returns a block: it waits as the block given last, and the one that waited goes into
    /// the bins and maps ([`give_now`](Self::give_now)).
    pub(super) fn give(&mut self, addr: u64, size: usize) {
        debug_assert!(
            self.merge_across
                || self
                    .chunks
                    .range(..=addr)
                    .next_back()
                    .is_some_and(|(&b, &s)| addr + size as u64 <= b + s as u64),
            "a pool block lies in a chunk"
        );
        self.settle();
        self.recent = Some((addr, size));
    }

    /// Puts a returned block into the bins and maps, merging it with free neighbours in the
    /// same chunk (a chunk's base starts a chunk: nothing merges across it).
    fn give_now(&mut self, addr: u64, size: usize) {
        let end = addr + size as u64;
        let prev = match self.ends.get(&addr) {
            Some(&id) if self.merges_at(addr) => Some(id),
            _ => None,
        };
        let next = match self.free.get(&end) {
            Some(&id) if self.merges_at(end) => Some(id),
            _ => None,
        };
        match (prev, next) {
            (Some(p), Some(n)) => {
                // The previous block's node spans all three and takes over the next's end.
                let before = self.nodes[p].size;
                let after = self.nodes[n].size;
                self.ends.remove(&addr);
                self.free.remove(&end);
                self.ends.insert(end + after as u64, p);
                self.bin_remove(p);
                self.drop_node(n);
                self.nodes[p].size = before + size + after;
                self.bin_push(p);
            }
            (Some(p), None) => {
                let Node {
                    addr: start,
                    size: before,
                    ..
                } = self.nodes[p];
                self.ends.remove(&addr);
                self.ends.insert(end, p);
                self.rebin(p, start, before + size);
            }
            (None, Some(n)) => {
                let after = self.nodes[n].size;
                self.free.remove(&end);
                self.free.insert(addr, n);
                self.rebin(n, addr, size + after);
            }
            (None, None) => self.insert_free(addr, size),
        }
    }

    /// Adds a chunk, wholly free: new from the driver, or one another arena gave up. Where
    /// chunks merge, its free space runs on into free neighbours' (a chunk mapped just past a
    /// free block extends it).
    pub(super) fn add_chunk(&mut self, base: u64, size: usize) {
        let mut at = 0;
        while at < size {
            let len = self.piece.min(size - at);
            self.chunks.insert(base + at as u64, len);
            at += len;
        }
        self.held += size;
        if self.merge_across {
            debug_assert!(
                base.is_multiple_of(self.piece as u64) && size.is_multiple_of(self.piece),
                "a chunk that merges is whole pieces, at a multiple of their size"
            );
            self.add_run(base, base + size as u64);
            self.settle();
            self.give_now(base, size);
        } else {
            self.insert_free(base, size);
        }
    }

    /// Where chunks merge: of the ends of chunks that no chunk of this arena follows, the one
    /// with the largest free block ending there (the highest end among equals; 0 bytes where
    /// the chunk's last block is in use), as (end, free bytes). Memory mapped just past it
    /// extends that free block, or starts one next to the chunk.
    pub(super) fn tail(&mut self) -> Option<(u64, usize)> {
        if !self.merge_across {
            return None;
        }
        self.settle();
        self.runs
            .values()
            .map(|&end| {
                (
                    end,
                    self.ends.get(&end).map_or(0, |&id| self.nodes[id].size),
                )
            })
            .max_by_key(|&(end, free)| (free, end))
    }

    /// Records the chunks `start .. end` in the runs, joined with the runs they touch.
    fn add_run(&mut self, start: u64, end: u64) {
        let (mut start, mut end) = (start, end);
        if let Some((&before, &until)) = self.runs.range(..start).next_back()
            && until == start
        {
            self.runs.remove(&before);
            start = before;
        }
        if let Some(until) = self.runs.remove(&end) {
            end = until;
        }
        self.runs.insert(start, end);
    }

    /// Takes the chunk `start .. end` out of its run, which it splits.
    fn remove_run(&mut self, start: u64, end: u64) {
        let (&first, &last) = self
            .runs
            .range(..=start)
            .next_back()
            .expect("a chunk of a merging arena lies in a run");
        debug_assert!(end <= last, "a chunk lies in one run");
        self.runs.remove(&first);
        if first < start {
            self.runs.insert(first, start);
        }
        if end < last {
            self.runs.insert(end, last);
        }
    }

    /// Whether free space merges across address `at` (a chunk's base stops it unless chunks
    /// merge).
    fn merges_at(&self, at: u64) -> bool {
        self.merge_across || !self.chunks.contains_key(&at)
    }

    /// The wholly free chunks, as (base, size), each with the start of the free block that
    /// covers it (the block given last settled first): with chunks that merge, a free block
    /// may cover several.
    fn free_chunks(&self) -> Vec<(u64, usize, u64)> {
        if !self.merge_across {
            return self
                .chunks
                .iter()
                .filter(|&(&base, &size)| {
                    self.free
                        .get(&base)
                        .is_some_and(|&id| self.nodes[id].size == size)
                })
                .map(|(&base, &size)| (base, size, base))
                .collect();
        }
        let mut found = Vec::new();
        for (addr, size) in self.large_free_blocks() {
            let end = addr + size as u64;
            found.extend(
                self.chunks
                    .range(addr..end)
                    .filter(|&(&b, &s)| b + s as u64 <= end)
                    .map(|(&b, &s)| (b, s, addr)),
            );
        }
        found
    }

    /// Where chunks merge, the free blocks that may cover a piece, as (start, size): those of a
    /// piece or more, found in the bins from the piece's (the block given last settled
    /// first).
    fn large_free_blocks(&self) -> impl Iterator<Item = (u64, usize)> + '_ {
        (bin_of(self.piece)..BINS)
            .filter(|&bin| self.nonempty[bin / 64] & (1 << (bin % 64)) != 0)
            .flat_map(|bin| &self.bins[bin])
            .filter(|&&(size, _)| size >= self.piece)
            .map(|&(_, id)| (self.nodes[id].addr, self.nodes[id].size))
    }

    /// Removes the wholly free chunks `chunks` (from [`free_chunks`](Self::free_chunks)):
    /// each covering free block leaves the arena, and what of it no removed chunk covered
    /// comes back as free blocks.
    fn remove_chunks(&mut self, mut chunks: Vec<(u64, usize, u64)>) {
        chunks.sort_unstable_by_key(|&(base, _, block)| (block, base));
        let mut k = 0;
        while k < chunks.len() {
            let block = chunks[k].2;
            let size = self.remove_free(block);
            let mut at = block;
            while k < chunks.len() && chunks[k].2 == block {
                let (base, chunk, _) = chunks[k];
                if base > at {
                    self.insert_free(at, (base - at) as usize);
                }
                self.chunks.remove(&base);
                if self.merge_across {
                    self.remove_run(base, base + chunk as u64);
                }
                self.held -= chunk;
                at = base + chunk as u64;
                k += 1;
            }
            let end = block + size as u64;
            if end > at {
                self.insert_free(at, (end - at) as usize);
            }
        }
    }

    /// Removes every chunk that is wholly free.
    pub(super) fn remove_free_chunks(&mut self) -> Vec<(u64, usize)> {
        self.remove_free_chunks_outside((0, 0), usize::MAX)
    }

    /// Before a growth, removes the wholly free chunks outside the free block `keep` (start,
    /// end; empty for none): every one, except where chunks merge, whose wholly free pieces go
    /// only up to `most` bytes (what the growth maps; the last piece may pass it). A `pool`
    /// gives its chunks back to the driver and grows anew; `vmm-pool` maps the pieces again
    /// where the growth needs them, so that memory moves in the reservation rather than going
    /// back to the driver and coming again, and the free pieces it keeps serve the next
    /// requests without a growth.
    pub(super) fn shed_free_chunks(&mut self, keep: (u64, u64), most: usize) -> Vec<(u64, usize)> {
        let most = if self.merge_across { most } else { usize::MAX };
        self.remove_free_chunks_outside(keep, most)
    }

    /// Where chunks merge, removes wholly free pieces up to `most` bytes (the last may pass
    /// it); nothing otherwise.
    pub(super) fn shed_free_pieces(&mut self, most: usize) -> Vec<(u64, usize)> {
        if !self.merge_across {
            return Vec::new();
        }
        self.remove_free_chunks_outside((0, 0), most)
    }

    /// Removes the wholly free chunks outside the free block `keep` (start, end; empty for
    /// none), as (base, size), in address order until they come to `most` bytes.
    fn remove_free_chunks_outside(&mut self, keep: (u64, u64), most: usize) -> Vec<(u64, usize)> {
        self.settle();
        let mut taken = 0usize;
        let free: Vec<_> = self
            .free_chunks()
            .into_iter()
            .filter(|&(base, size, _)| base + size as u64 <= keep.0 || base >= keep.1)
            .take_while(|&(_, size, _)| {
                let more = taken < most;
                taken = taken.saturating_add(size);
                more
            })
            .collect();
        let out = free.iter().map(|&(b, s, _)| (b, s)).collect();
        self.remove_chunks(free);
        out
    }

    /// Where chunks merge, the bytes of the wholly free pieces outside the free block `keep`.
    /// Pieces lie at multiples of their size (mapped at the granularity): counted, not listed.
    #[cfg(test)]
    fn free_piece_bytes(&self, keep: (u64, u64)) -> usize {
        let piece = self.piece as u64;
        self.large_free_blocks()
            .filter(|&(addr, _)| addr != keep.0)
            .map(|(addr, size)| {
                let (first, end) = (addr.next_multiple_of(piece), (addr + size as u64) / piece);
                (end * piece).saturating_sub(first) as usize
            })
            .sum()
    }

    /// Removes the smallest wholly free chunk of at least `size` bytes, for another arena, as
    /// (base, size). Where chunks merge, the shortest run of wholly free pieces in one free
    /// block that holds `size` bytes, taken from the run that fits best (the other arena
    /// records it as the same pieces).
    pub(super) fn take_free_chunk(&mut self, size: usize, most: usize) -> Option<(u64, usize)> {
        self.settle();
        let free = self.free_chunks();
        if !self.merge_across {
            let chunk = free
                .into_iter()
                .filter(|&(_, got, _)| got >= size && got <= most)
                .min_by_key(|&(_, got, _)| got)?;
            self.remove_chunks(vec![chunk]);
            return Some((chunk.0, chunk.1));
        }
        // The pieces inside one free block lie side by side: a block's run is all of them.
        let mut runs: BTreeMap<u64, (u64, usize)> = BTreeMap::new();
        for &(base, len, block) in &free {
            let run = runs.entry(block).or_insert((base, 0));
            run.0 = run.0.min(base);
            run.1 += len;
        }
        let (&block, &(start, _)) = runs
            .iter()
            .filter(|&(_, &(_, got))| got >= size)
            .min_by_key(|&(_, &(_, got))| got)?;
        let mut taken: Vec<_> = free.into_iter().filter(|c| c.2 == block).collect();
        taken.sort_unstable_by_key(|c| c.0);
        let mut got = 0;
        taken.retain(|c| {
            let keep = got < size;
            got += if keep { c.1 } else { 0 };
            keep
        });
        self.remove_chunks(taken);
        Some((start, got))
    }

    /// Whether the arena holds no chunk.
    pub(super) fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    /// The largest free block: the largest of the highest non-empty bin, or the block given
    /// last with the neighbours it will merge with, whichever is larger.
    pub(super) fn largest_free(&self) -> usize {
        let binned = (0..WORDS)
            .rev()
            .find(|&w| self.nonempty[w] != 0)
            .map(|w| w * 64 + 63 - self.nonempty[w].leading_zeros() as usize)
            .map_or(0, |bin| {
                self.bins[bin].iter().map(|&(s, _)| s).max().unwrap_or(0)
            });
        binned.max(self.recent_merged().map_or(0, |(_, size, _, _)| size))
    }

    /// The block given last as it will be once settled: (start, size) with the free
    /// neighbours it merges with, and those neighbours' nodes.
    fn recent_merged(&self) -> Option<(u64, usize, Option<NodeId>, Option<NodeId>)> {
        let (addr, size) = self.recent?;
        let merges = |at: u64| self.merges_at(at);
        let (mut start, mut end) = (addr, addr + size as u64);
        let before = self.ends.get(&addr).copied().filter(|_| merges(addr));
        if let Some(id) = before {
            start = self.nodes[id].addr;
        }
        let after = self.free.get(&end).copied().filter(|_| merges(end));
        if let Some(id) = after {
            end += self.nodes[id].size as u64;
        }
        Some((start, (end - start) as usize, before, after))
    }

    /// Forgets every chunk and free block (a reset freed them), returning the chunks.
    pub(super) fn clear(&mut self) -> BTreeMap<u64, usize> {
        self.recent = None;
        self.free.clear();
        self.ends.clear();
        self.nodes.clear();
        for list in &mut self.bins {
            list.clear();
        }
        self.nonempty = [0; WORDS];
        self.held = 0;
        self.runs.clear();
        std::mem::take(&mut self.chunks)
    }

    /// The free blocks, as (start, size), in no order: those in the maps, and the block given
    /// last merged with the neighbours it will merge with when it settles.
    fn free_blocks(&self) -> impl Iterator<Item = (u64, usize)> + '_ {
        let merged = self.recent_merged();
        let (before, after) = merged.map_or((None, None), |(_, _, b, a)| (b, a));
        self.free
            .values()
            .filter(move |&&id| Some(id) != before && Some(id) != after)
            .map(|&id| {
                let node = self.nodes[id];
                (node.addr, node.size)
            })
            .chain(merged.map(|(start, size, _, _)| (start, size)))
    }
}

/// Puts each of `blocks` in the segment of `segments` (sorted by address) that holds its
/// start; a block outside every segment is left out (debug builds stop on it).
pub(super) fn place(segments: &mut [HeldSegment], blocks: impl IntoIterator<Item = HeldBlock>) {
    for b in blocks {
        let i = segments.partition_point(|s| s.address <= b.address);
        match i.checked_sub(1).map(|i| &mut segments[i]) {
            Some(s) if b.address < s.address + s.bytes as u64 => s.blocks.push(b),
            _ => debug_assert!(false, "block {b:?} outside the pool's segments"),
        }
    }
}

/// Cuts the blocks `lent` (start, bytes) out of the segments `segments` (sorted by address,
/// each block inside one): a block lent to a stream's arena is a segment of that arena's, so
/// the segment it lies in is split around it, keeping its blocks on their sides.
pub(super) fn cut_out(
    segments: &mut Vec<HeldSegment>,
    lent: impl IntoIterator<Item = (u64, usize)>,
) {
    for (start, bytes) in lent {
        let end = start + bytes as u64;
        let i = segments.partition_point(|s| s.address <= start);
        let Some(i) = i.checked_sub(1).filter(|&i| {
            let s = &segments[i];
            end <= s.address + s.bytes as u64
        }) else {
            debug_assert!(
                false,
                "lent block {start:#x}+{bytes} outside the shared segments"
            );
            continue;
        };
        let seg = &mut segments[i];
        let seg_end = seg.address + seg.bytes as u64;
        let after_blocks = seg.blocks.extract_if(.., |b| b.address >= end).collect();
        seg.blocks.retain(|b| b.address < start);
        let after = HeldSegment {
            address: end,
            bytes: (seg_end - end) as usize,
            kind: seg.kind,
            stream: seg.stream,
            blocks: after_blocks,
        };
        seg.bytes = (start - seg.address) as usize;
        let at = if seg.bytes == 0 {
            segments.remove(i);
            i
        } else {
            i + 1
        };
        if after.bytes > 0 {
            segments.insert(at, after);
        }
    }
}

/// A chunk: one driver allocation, wholly the pool's; or, `lent`, a block of a chunk of the
/// shared arena that a stream's arena holds as a chunk of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Chunk {
    /// Its address.
    pub(super) base: u64,
    /// Its bytes.
    pub(super) size: usize,
    /// Made for one request above the standard limit, and serving only such requests.
    pub(super) oversize: bool,
    /// Lent by the shared arena ([`Arenas::lend`]): it goes back there
    /// ([`Arenas::restore`]), never to the driver, whose allocation is the chunk it lies in.
    pub(super) lent: bool,
}

impl Chunk {
    /// The standard chunks `standard` and the oversize ones `oversize`, as (base, size).
    fn of_kinds(
        standard: impl IntoIterator<Item = (u64, usize)>,
        oversize: impl IntoIterator<Item = (u64, usize)>,
    ) -> Vec<Chunk> {
        let kind = |oversize| {
            move |(base, size)| Chunk {
                base,
                size,
                oversize,
                lent: false,
            }
        };
        standard
            .into_iter()
            .map(kind(false))
            .chain(oversize.into_iter().map(kind(true)))
            .collect()
    }
}

/// A pool's free space in two arenas: chunks of the configured size, which serve every request
/// up to a limit, and chunks made for one larger request each, which serve only requests
/// larger than the limit. A small block never splits a chunk made for a large one, which would
/// leave the next large request of its size no room and the chunk unable to go back to the
/// driver; a large request never takes most of a standard chunk and strands its rest.
#[derive(Debug)]
pub(super) struct Arenas {
    /// Bumped by a reset: a block of an older generation lies in a chunk the reset freed.
    pub(super) generation: u64,
    /// Requests up to this many bytes are served from standard chunks.
    limit: usize,
    standard: Arena,
    oversize: Arena,
    /// The bases of the chunks these arenas hold that another arena lent them (a stream's
    /// arenas: blocks of the shared arena's chunks).
    borrowed: BTreeSet<u64>,
    /// The blocks these arenas lent to others (the shared arena's), start -> bytes: taken from
    /// the free space, and no chunk of the driver's, until they come back.
    lent_out: BTreeMap<u64, usize>,
}

impl Arenas {
    /// Empty arenas that serve requests up to `limit` bytes from standard chunks; free space
    /// merges across chunks where they are mapped next to each other, in pieces of `pieces`
    /// bytes each.
    pub(super) fn new(limit: usize, pieces: Option<usize>) -> Arenas {
        let arena = || Arena {
            merge_across: pieces.is_some(),
            piece: pieces.unwrap_or(usize::MAX),
            ..Arena::default()
        };
        Arenas {
            generation: 0,
            limit,
            standard: arena(),
            oversize: arena(),
            borrowed: BTreeSet::new(),
            lent_out: BTreeMap::new(),
        }
    }

    /// Whether a request of `size` bytes is served from chunks of its own.
    pub(super) fn is_oversize(&self, size: usize) -> bool {
        size > self.limit
    }

    fn of(&mut self, size: usize) -> &mut Arena {
        if self.is_oversize(size) {
            &mut self.oversize
        } else {
            &mut self.standard
        }
    }

    /// A free block of at least `size` bytes, split off a free block of its arena.
    pub(super) fn take(&mut self, size: usize) -> Option<u64> {
        self.of(size).take(size)
    }

    /// [`take`](Self::take), with the generation the block belongs to.
    pub(super) fn take_stamped(&mut self, size: usize) -> Option<(u64, u64)> {
        Some((self.take(size)?, self.generation))
    }

    /// [`Arena::take_sparing`] in the arena that serves `size` (chunks made for one request
    /// each are spared nothing: they serve only requests larger than the limit).
    pub(super) fn take_sparing(
        &mut self,
        size: usize,
        most: impl FnOnce() -> usize,
    ) -> Option<u64> {
        if self.is_oversize(size) {
            return self.oversize.take(size);
        }
        self.standard.take_sparing(size, most)
    }

    /// Returns a block of `size` bytes taken earlier with that size.
    pub(super) fn give(&mut self, addr: u64, size: usize) {
        self.of(size).give(addr, size);
    }

    /// Adds a wholly free chunk to the arena of its kind.
    pub(super) fn add_chunk(&mut self, chunk: Chunk) {
        if chunk.lent {
            self.borrowed.insert(chunk.base);
        }
        let arena = if chunk.oversize {
            &mut self.oversize
        } else {
            &mut self.standard
        };
        arena.add_chunk(chunk.base, chunk.size);
    }

    /// The free block of the arena that serves `size` that memory mapped just past it would
    /// extend ([`Arena::tail`]).
    pub(super) fn tail(&mut self, size: usize) -> Option<(u64, usize)> {
        self.of(size).tail()
    }

    /// Marks the chunks of `chunks` that were lent to these arenas, which no longer hold them.
    fn marked(&mut self, mut chunks: Vec<Chunk>) -> Vec<Chunk> {
        if !self.borrowed.is_empty() {
            for c in &mut chunks {
                c.lent = self.borrowed.remove(&c.base);
            }
        }
        chunks
    }

    /// Removes every chunk that is wholly free.
    pub(super) fn remove_free_chunks(&mut self) -> Vec<Chunk> {
        let standard = self.standard.remove_free_chunks();
        let chunks = Chunk::of_kinds(standard, self.oversize.remove_free_chunks());
        self.marked(chunks)
    }

    /// Before a growth of `most` bytes, removes the wholly free chunks that go back to the
    /// driver (where chunks merge, pieces up to `most` bytes, which the growth maps again:
    /// [`Arena::shed_free_chunks`]), or to the arena that lent them.
    pub(super) fn shed_free_chunks(&mut self, most: usize) -> Vec<Chunk> {
        let standard = self.standard.shed_free_chunks((0, 0), most);
        let chunks = Chunk::of_kinds(standard, self.oversize.shed_free_chunks((0, 0), most));
        self.marked(chunks)
    }

    /// Where chunks merge, removes wholly free pieces of the standard arena up to `most` bytes
    /// ([`Arena::shed_free_pieces`]).
    pub(super) fn shed_free_pieces(&mut self, most: usize) -> Vec<Chunk> {
        let standard = self.standard.shed_free_pieces(most);
        self.marked(Chunk::of_kinds(standard, []))
    }

    /// Lends another arena (a stream's) a block of `want` bytes, or failing that of `need`
    /// (at most `want`), from the free space of the standard chunks, as a chunk of its own:
    /// where a chunk is not wholly free, its free space still serves the streams. `None`
    /// where chunks merge (their pieces move whole, [`take_free_chunk`](Self::take_free_chunk)),
    /// for a request served from chunks of its own, or where no free block holds `need` but
    /// wholly free chunks larger than `most` ([`Arena::take_sparing`]).
    pub(super) fn lend(&mut self, need: usize, want: usize, most: usize) -> Option<Chunk> {
        if self.standard.merge_across || self.is_oversize(need) {
            return None;
        }
        let (base, size) = [want, need]
            .into_iter()
            .find_map(|size| Some((self.standard.take_sparing(size, || most)?, size)))?;
        self.lent_out.insert(base, size);
        Some(Chunk {
            base,
            size,
            oversize: false,
            lent: true,
        })
    }

    /// Takes back a chunk another arena gave up: a block these arenas lent goes back to their
    /// free space; any other chunk joins them ([`add_chunk`](Self::add_chunk)).
    pub(super) fn restore(&mut self, chunk: Chunk) {
        if !chunk.lent {
            return self.add_chunk(chunk);
        }
        let lent = self.lent_out.remove(&chunk.base);
        debug_assert_eq!(lent, Some(chunk.size), "a lent block comes back as it went");
        self.standard.give(chunk.base, chunk.size);
    }

    /// The blocks lent to other arenas, as (start, bytes).
    pub(super) fn lent_out(&self) -> impl Iterator<Item = (u64, usize)> + '_ {
        self.lent_out.iter().map(|(&a, &s)| (a, s))
    }

    /// Before a growth in place, removes the wholly free chunks of the arena that serves
    /// `size` that lie outside the free block `keep` (start, end) and go back to the driver
    /// ([`Arena::shed_free_chunks`]).
    pub(super) fn shed_free_chunks_outside(
        &mut self,
        size: usize,
        keep: (u64, u64),
        most: usize,
    ) -> Vec<Chunk> {
        let oversize = self.is_oversize(size);
        let removed = self.of(size).shed_free_chunks(keep, most);
        let chunks = if oversize {
            Chunk::of_kinds([], removed)
        } else {
            Chunk::of_kinds(removed, [])
        };
        self.marked(chunks)
    }

    /// Removes the smallest wholly free chunk that can serve a request of `size` bytes (a
    /// chunk these arenas were lent says so: it goes back to its lender, never the driver).
    pub(super) fn take_free_chunk(&mut self, size: usize, most: usize) -> Option<Chunk> {
        let oversize = self.is_oversize(size);
        let (base, size) = self.of(size).take_free_chunk(size, most)?;
        let chunk = Chunk {
            base,
            size,
            oversize,
            lent: false,
        };
        self.marked(vec![chunk]).pop()
    }

    /// Whether the arenas hold no chunk.
    pub(super) fn is_empty(&self) -> bool {
        self.standard.is_empty() && self.oversize.is_empty()
    }

    /// Bytes of their chunks.
    pub(super) fn held(&self) -> usize {
        self.standard.held + self.oversize.held
    }

    /// How many of the driver's chunks they hold (not those another arena lent them).
    pub(super) fn chunks(&self) -> usize {
        self.standard.chunks.len() + self.oversize.chunks.len() - self.borrowed.len()
    }

    /// Adds their chunks to `out` as segments of `kind` serving `stream`, with their free
    /// blocks (chunks mapped next to each other with free space merging across them make one
    /// segment, as their free blocks may span them).
    pub(super) fn held_segments(
        &self,
        kind: SegmentKind,
        stream: Option<u64>,
        out: &mut Vec<HeldSegment>,
    ) {
        for arena in [&self.standard, &self.oversize] {
            let first = out.len();
            for (&base, &size) in &arena.chunks {
                match out[first..].last_mut() {
                    Some(last)
                        if arena.merge_across && last.address + last.bytes as u64 == base =>
                    {
                        last.bytes += size;
                    }
                    _ => out.push(HeldSegment {
                        address: base,
                        bytes: size,
                        kind,
                        stream,
                        blocks: Vec::new(),
                    }),
                }
            }
            place(
                &mut out[first..],
                arena.free_blocks().map(|(addr, size)| HeldBlock {
                    address: addr,
                    bytes: size,
                    state: BlockState::Free,
                }),
            );
        }
    }

    /// Adds the sizes of their free blocks to `out`.
    pub(super) fn free_block_sizes(&self, out: &mut Vec<usize>) {
        for arena in [&self.standard, &self.oversize] {
            out.extend(arena.free_blocks().map(|(_, size)| size));
        }
    }

    /// The largest free block.
    pub(super) fn largest_free(&self) -> usize {
        self.standard
            .largest_free()
            .max(self.oversize.largest_free())
    }

    /// Forgets every chunk and free block (a reset freed them), returning the driver's chunks
    /// (not those lent to them: the lender's chunk holds each).
    pub(super) fn clear(&mut self) -> Vec<Chunk> {
        let standard = self.standard.clear();
        let mut chunks = Chunk::of_kinds(standard, self.oversize.clear());
        let borrowed = std::mem::take(&mut self.borrowed);
        chunks.retain(|c| !borrowed.contains(&c.base));
        self.lent_out.clear();
        chunks
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bins_grow_with_size_sixteen_to_a_doubling() {
        assert_eq!(bin_of(0), 0);
        assert_eq!(bin_of(256), 1);
        assert_eq!(bin_of(15 * 256), 15);
        assert_eq!(bin_of(16 * 256), 16);
        assert_eq!(bin_of(17 * 256), 17);
        assert_eq!(bin_of(32 * 256), 32);
        assert_eq!(bin_of(33 * 256), 32);
        assert_eq!(bin_of(34 * 256), 33);
        assert_eq!(bin_of(usize::MAX), BINS - 1);
        let mut last = 0;
        for shift in 8..40 {
            for k in 0..64usize {
                let size = (1usize << shift) + k * (1usize << shift) / 64;
                let bin = bin_of(size);
                assert!(bin >= last, "{size}: bin {bin} after {last}");
                last = bin;
            }
        }
    }

    #[test]
    fn a_sparing_take_leaves_large_free_chunks_whole() {
        const MIB: usize = 1 << 20;
        let (whole, used) = (1u64 << 30, 2u64 << 30);
        let mut arena = Arena::default();
        arena.add_chunk(whole, 64 * MIB);
        // Only the large free chunk holds the request: spared, unless it is no larger than
        // what the pool would grow by.
        assert_eq!(arena.take_sparing(256, || 8 * MIB), None);
        assert_eq!(arena.take_sparing(256, || 64 * MIB), Some(whole));
        arena.give(whole, 256);
        // A chunk a live block keeps serves it instead.
        arena.add_chunk(used, 8 * MIB);
        assert_eq!(arena.take(8 * MIB - 4096), Some(used));
        let small = arena.take_sparing(256, || 8 * MIB).unwrap();
        assert!((used..used + 8 * MIB as u64).contains(&small), "{small:#x}");
        // A chunk of the smallest growth is never spared.
        let mut small_chunks = Arena::default();
        small_chunks.add_chunk(whole, SPARED_ABOVE);
        assert_eq!(small_chunks.take_sparing(256, || 0), Some(whole));
    }

    #[test]
    fn a_request_fails_only_when_no_free_block_is_large_enough() {
        let mut arena = Arena::default();
        arena.add_chunk(1 << 30, 64 << 20);
        // Blocks of one bin, but of sizes both sides of a request in it.
        let unit = 9 << 20;
        let (larger, request) = (unit + (256 << 10), unit + (128 << 10));
        assert_eq!(bin_of(unit), bin_of(larger));
        assert_eq!(bin_of(unit), bin_of(request));
        let a = arena.take(unit).unwrap();
        let _gap = arena.take(1 << 20).unwrap();
        let b = arena.take(larger).unwrap();
        let _rest = arena
            .take(arena.free_blocks().map(|(_, s)| s).sum())
            .unwrap();
        assert!(arena.free.is_empty());
        arena.give(a, unit);
        arena.give(b, larger);
        // Only the larger block fits the request; it is in the request's own bin.
        assert_eq!(arena.take(request), Some(b));
        assert_eq!(arena.take(request), None);
        assert_eq!(arena.take(unit), Some(a));
    }

    #[test]
    fn a_fitting_block_behind_the_scanned_ones_is_found_before_the_pool_grows() {
        let mut arena = Arena::default();
        arena.add_chunk(1 << 32, 4 << 20);
        // One bin, [16, 17) KiB: one block that fits the request, freed first, then more
        // than `SCAN` that do not; lent gaps keep them from merging.
        let (small, fits, request) = (64 << 8, 67 << 8, 66 << 8);
        assert!(bin_of(small) == bin_of(fits) && bin_of(fits) == bin_of(request));
        let b = arena.take(fits).unwrap();
        arena.take(256).unwrap();
        let smalls: Vec<u64> = (0..SCAN + 1)
            .map(|_| {
                let a = arena.take(small).unwrap();
                arena.take(256).unwrap();
                a
            })
            .collect();
        let rest = arena.free_blocks().map(|(_, s)| s).sum();
        arena.take(rest).unwrap();
        arena.give(b, fits);
        for a in smalls {
            arena.give(a, small);
        }
        assert_eq!(arena.take(request), Some(b));
        assert_eq!(arena.take(request), None);
    }

    /// Checks every structure of the arena against the others, and against the blocks
    /// `lent` (outstanding): free and lent blocks tile the chunks exactly, no two free
    /// neighbours in one chunk are left unmerged, and the bins, their bitmap and the end map
    /// agree with the free map.
    fn check(arena: &Arena, lent: &[(u64, usize)]) {
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
        enum Piece {
            Lent,
            Free,
            /// The block given last, outside the maps until it settles.
            Recent,
        }
        let mut pieces: Vec<(u64, usize, Piece)> =
            lent.iter().map(|&(a, s)| (a, s, Piece::Lent)).collect();
        pieces.extend(arena.free.values().map(|&id| {
            let node = arena.nodes[id];
            (node.addr, node.size, Piece::Free)
        }));
        pieces.extend(arena.recent.map(|(a, s)| (a, s, Piece::Recent)));
        pieces.sort();
        let mut chunks = arena.chunks.iter().peekable();
        let mut cursor: Option<(u64, u64)> = None; // (chunk end, next expected address)
        let mut last_free_end = None;
        for &(addr, size, piece) in &pieces {
            if cursor.is_none_or(|(end, next)| next == end) {
                let (&base, &len) = chunks.next().expect("a piece outside every chunk");
                assert_eq!(cursor.map_or(base, |(_, next)| next).max(base), base);
                cursor = Some((base + len as u64, base));
                last_free_end = None;
            }
            let (end, next) = cursor.unwrap();
            assert_eq!(addr, next, "pieces tile the chunk: {pieces:x?}");
            assert!(addr + size as u64 <= end, "a piece crosses its chunk's end");
            if piece == Piece::Recent {
                assert!(
                    !arena.free.contains_key(&addr),
                    "the block given last in the maps"
                );
                // It merges with its neighbours when it settles, not before.
                last_free_end = None;
            }
            if piece == Piece::Free {
                assert_ne!(last_free_end, Some(addr), "free neighbours left unmerged");
                last_free_end = Some(addr + size as u64);
                let id = arena.free[&addr];
                assert_eq!(arena.ends.get(&(addr + size as u64)), Some(&id));
                let node = arena.nodes[id];
                assert_eq!((node.addr, node.size), (addr, size));
                assert_eq!(arena.bins[bin_of(size)][node.slot], (size, id));
            }
            cursor = Some((end, addr + size as u64));
        }
        assert!(chunks.next().is_none(), "a chunk with nothing in it");
        assert!(
            cursor.is_none_or(|(end, next)| next == end),
            "the last chunk not covered"
        );
        assert_eq!(arena.ends.len(), arena.free.len());
        let binned: usize = arena.bins.iter().map(Vec::len).sum();
        assert_eq!(binned, arena.free.len());
        assert_eq!(
            arena.nodes.len(),
            arena.free.len(),
            "every node held is a free block"
        );
        for (bin, list) in arena.bins.iter().enumerate() {
            let bit = arena.nonempty[bin / 64] >> (bin % 64) & 1 == 1;
            assert_eq!(bit, !list.is_empty(), "bitmap bit of bin {bin}");
        }
    }

    #[derive(Clone, Debug)]
    enum Step {
        Take(usize),
        Give(usize),
    }

    fn step() -> impl proptest::strategy::Strategy<Value = Step> {
        use proptest::prelude::*;
        prop_oneof![
            3 => (1usize..=64).prop_map(|u| Step::Take(u << 8)),
            2 => (1usize..=48).prop_map(|u| Step::Take(u << 16)),
            1 => (1usize..=6).prop_map(|u| Step::Take(u << 20)),
            5 => any::<usize>().prop_map(Step::Give),
        ]
    }

    /// The most steps in one case (fewer under Miri, which also runs fewer cases).
    const STEPS: usize = if cfg!(miri) { 40 } else { 200 };

    proptest::proptest! {
        #![proptest_config(crate::test_config::proptest_config())]

        /// Random takes and gives on three chunks, two of them touching: after every step the
        /// arena is consistent (see `check`), and a take fails exactly when no free block is
        /// large enough. 256 cases (`PROPTEST_CASES=N` for more).
        #[test]
        #[cfg_attr(
            miri,
            ignore = "the arena is bookkeeping without unsafe code, which Miri has nothing to check \
                      in; the native run covers it"
        )]
        fn takes_and_gives_keep_the_arena_consistent_and_fail_only_when_nothing_fits(
            steps in proptest::collection::vec(step(), 1..STEPS)
        ) {
            let mut arena = Arena::default();
            arena.add_chunk(1 << 32, 4 << 20);
            arena.add_chunk((1 << 32) + (4 << 20), 2 << 20);
            arena.add_chunk(1 << 40, 8 << 20);
            let mut lent: Vec<(u64, usize)> = Vec::new();
            for step in steps {
                match step {
                    Step::Take(size) => {
                        let fits = arena.free_blocks().any(|(_, s)| s >= size);
                        match arena.take(size) {
                            Some(addr) => {
                                proptest::prop_assert!(fits);
                                lent.push((addr, size));
                            }
                            None => proptest::prop_assert!(!fits, "nothing taken for {size} B"),
                        }
                    }
                    Step::Give(k) if !lent.is_empty() => {
                        let (addr, size) = lent.swap_remove(k % lent.len());
                        arena.give(addr, size);
                    }
                    Step::Give(_) => {}
                }
                check(&arena, &lent);
            }
            for (addr, size) in lent.drain(..) {
                arena.give(addr, size);
            }
            check(&arena, &lent);
            proptest::prop_assert_eq!(arena.remove_free_chunks().len(), 3);
            proptest::prop_assert!(arena.free.is_empty() && arena.chunks.is_empty());
        }
    }

    /// The piece of the merging arenas below.
    const PIECE: usize = 2 << 20;

    /// Checks a merging arena against the blocks `lent`: its chunks are pieces at multiples of
    /// their size, its runs are the runs of chunks side by side, its held bytes theirs, and
    /// free and lent blocks tile each run with no two free blocks side by side.
    fn check_merging(arena: &Arena, lent: &[(u64, usize)]) {
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for (&base, &size) in &arena.chunks {
            assert_eq!(size, PIECE, "a chunk is one piece");
            assert!(
                base.is_multiple_of(PIECE as u64),
                "a piece at a multiple of its size"
            );
            match runs.last_mut() {
                Some((_, end)) if *end == base => *end += size as u64,
                _ => runs.push((base, base + size as u64)),
            }
        }
        let recorded: Vec<(u64, u64)> = arena.runs.iter().map(|(&a, &b)| (a, b)).collect();
        assert_eq!(recorded, runs, "the runs");
        assert_eq!(arena.held, arena.chunks.len() * PIECE);
        let mut blocks: Vec<(u64, usize, bool)> =
            lent.iter().map(|&(a, s)| (a, s, false)).collect();
        blocks.extend(arena.free_blocks().map(|(a, s)| (a, s, true)));
        blocks.sort();
        let mut at = blocks.iter().peekable();
        for (start, end) in runs {
            let (mut next, mut last_free) = (start, false);
            while next < end {
                let &(addr, size, free) = at.next().expect("blocks cover every run");
                assert_eq!(
                    addr, next,
                    "blocks tile the run {start:#x}..{end:#x}: {blocks:x?}"
                );
                assert!(
                    !(free && last_free),
                    "free neighbours left unmerged at {addr:#x}"
                );
                (next, last_free) = (addr + size as u64, free);
            }
            assert_eq!(next, end, "a block crosses a run's end");
        }
        assert!(at.next().is_none(), "a block outside every run");
    }

    /// The wholly free pieces of a merging arena, counted block by block.
    fn free_pieces(arena: &Arena) -> usize {
        let blocks: Vec<(u64, usize)> = arena.free_blocks().collect();
        arena
            .chunks
            .keys()
            .filter(|&&b| {
                blocks
                    .iter()
                    .any(|&(a, s)| a <= b && b + PIECE as u64 <= a + s as u64)
            })
            .count()
    }

    #[derive(Clone, Debug)]
    enum MergingStep {
        Take(usize),
        Give(usize),
        /// Maps this many pieces past the tail (or at a new place when there is none).
        Grow(usize),
        /// Sheds up to this many pieces, keeping the tail's free block or nothing.
        Shed(bool, usize),
        /// Sheds wholly free pieces, up to this many.
        ShedPieces(usize),
        /// Moves the pieces of a request of this size to another arena.
        Adopt(usize),
    }

    fn merging_step() -> impl proptest::strategy::Strategy<Value = MergingStep> {
        use proptest::prelude::*;
        prop_oneof![
            4 => (1usize..=64).prop_map(|u| MergingStep::Take(u << 16)),
            1 => (1usize..=12).prop_map(|u| MergingStep::Take(u << 20)),
            5 => any::<usize>().prop_map(MergingStep::Give),
            1 => (1usize..=4).prop_map(MergingStep::Grow),
            1 => (any::<bool>(), 1usize..=8).prop_map(|(k, n)| MergingStep::Shed(k, n)),
            1 => (1usize..=8).prop_map(MergingStep::ShedPieces),
            1 => (1usize..=6).prop_map(|u| MergingStep::Adopt(u << 20)),
        ]
    }

    proptest::proptest! {
        #![proptest_config(crate::test_config::proptest_config())]

        /// Random takes, gives, growths, sheds and adoptions on an arena whose chunks merge
        /// and are recorded as pieces: after every step it is consistent (`check_merging`), a
        /// shed of up to n pieces gives back n wholly free pieces outside the kept block, or
        /// all of them where there are fewer, and an adoption moves a run of
        /// wholly free pieces that holds the request. 256 cases (`PROPTEST_CASES=N` for more).
        #[test]
        #[cfg_attr(
            miri,
            ignore = "the arena is bookkeeping without unsafe code, which Miri has nothing to check \
                      in; the native run covers it"
        )]
        fn merging_arenas_keep_their_pieces_runs_and_blocks_consistent(
            steps in proptest::collection::vec(merging_step(), 1..STEPS)
        ) {
            let new = || Arena { merge_across: true, piece: PIECE, ..Arena::default() };
            let (mut arena, mut other) = (new(), new());
            arena.add_chunk(1 << 32, 4 * PIECE);
            let mut lent: Vec<(u64, usize)> = Vec::new();
            let mut elsewhere = 1u64 << 40;
            for step in steps {
                match step {
                    MergingStep::Take(size) => {
                        if let Some(addr) = arena.take(size) {
                            lent.push((addr, size));
                        }
                    }
                    MergingStep::Give(k) if !lent.is_empty() => {
                        let (addr, size) = lent.swap_remove(k % lent.len());
                        arena.give(addr, size);
                    }
                    MergingStep::Give(_) => {}
                    MergingStep::Grow(n) => {
                        // Past the tail where nothing is mapped there, as the reservation
                        // allows; else elsewhere.
                        let tail = arena.tail();
                        let unmapped = |at: u64| {
                            let range = at..at + (n * PIECE) as u64;
                            arena.chunks.range(range.clone()).next().is_none()
                                && other.chunks.range(range).next().is_none()
                        };
                        let at = match tail {
                            Some((end, _)) if unmapped(end) => end,
                            _ => {
                                elsewhere += 1 << 30;
                                elsewhere
                            }
                        };
                        arena.add_chunk(at, n * PIECE);
                    }
                    MergingStep::Shed(keep_tail, most) => {
                        let keep = match arena.tail() {
                            Some((end, free)) if keep_tail => (end - free as u64, end),
                            _ => (0, 0),
                        };
                        let kept = arena
                            .chunks
                            .keys()
                            .filter(|&&b| b >= keep.0 && b + PIECE as u64 <= keep.1)
                            .count();
                        let wholly_free = free_pieces(&arena);
                        let outside = wholly_free
                            - if keep.1 > keep.0 { kept } else { 0 };
                        let shed = arena.shed_free_chunks(keep, most * PIECE);
                        proptest::prop_assert_eq!(shed.len(), outside.min(most));
                        proptest::prop_assert!(
                            shed.iter().all(|&(b, _)| b + PIECE as u64 <= keep.0 || b >= keep.1)
                        );
                    }
                    MergingStep::ShedPieces(n) => {
                        let wholly_free = free_pieces(&arena);
                        let shed = arena.shed_free_pieces(n * PIECE);
                        let due = wholly_free.min(n);
                        proptest::prop_assert_eq!(shed.len(), due);
                        proptest::prop_assert_eq!(free_pieces(&arena), wholly_free - due);
                    }
                    MergingStep::Adopt(size) => {
                        if let Some((base, got)) = arena.take_free_chunk(size, usize::MAX) {
                            proptest::prop_assert!(got >= size && got < size + PIECE);
                            proptest::prop_assert!(
                                lent.iter().all(|&(a, s)| a + s as u64 <= base || a >= base + got as u64),
                                "an adopted run holds no lent block"
                            );
                            other.add_chunk(base, got);
                            check_merging(&other, &[]);
                        }
                    }
                }
                check_merging(&arena, &lent);
                // Counted over the settled blocks, as the sheds count them.
                if arena.recent.is_none() {
                    let brute = free_pieces(&arena) * PIECE;
                    proptest::prop_assert_eq!(arena.free_piece_bytes((0, 0)), brute);
                }
            }
        }
    }

    fn chunk(base: u64, size: usize) -> Chunk {
        Chunk {
            base,
            size,
            oversize: false,
            lent: false,
        }
    }

    /// A block lent out of a chunk that a live block keeps serves the borrowing arena as a
    /// chunk of its own; it comes back marked as lent, goes back into the lender's free space,
    /// and the lender's chunk is then wholly free once its own block goes.
    #[test]
    fn a_lent_block_comes_back_to_the_free_space_it_left() {
        const MIB: usize = 1 << 20;
        let mut shared = Arenas::new(128 * MIB, None);
        shared.add_chunk(chunk(1 << 32, 64 * MIB));
        let pin = shared.take(MIB).unwrap();
        assert_eq!(shared.take_free_chunk(8 * MIB, usize::MAX), None);
        // Twice the request where the free space holds it; the request where only that fits.
        let lent = shared.lend(8 * MIB, 16 * MIB, usize::MAX).unwrap();
        assert!(lent.lent && lent.size == 16 * MIB && !lent.oversize);
        assert_eq!(
            shared.lent_out().collect::<Vec<_>>(),
            [(lent.base, 16 * MIB)]
        );
        assert_eq!(
            shared.lend(40 * MIB, 50 * MIB, usize::MAX).unwrap().size,
            40 * MIB
        );
        assert_eq!(
            shared.lend(8 * MIB, 16 * MIB, usize::MAX),
            None,
            "7 MiB free"
        );
        let mut stream = Arenas::new(128 * MIB, None);
        stream.add_chunk(lent);
        assert_eq!(stream.chunks(), 0, "a lent chunk is not the driver's");
        assert_eq!(stream.held(), 16 * MIB);
        let a = stream.take(10 * MIB).unwrap();
        assert!(stream.remove_free_chunks().is_empty());
        stream.give(a, 10 * MIB);
        let back = stream.remove_free_chunks();
        assert_eq!(back, [lent]);
        assert!(stream.is_empty() && stream.borrowed.is_empty());
        shared.restore(back[0]);
        assert_eq!(shared.lent_out().count(), 1);
        assert!(
            shared.remove_free_chunks().is_empty(),
            "the pinned block keeps it"
        );
        // The other lent block back, then the pinned one: the chunk is free, whole.
        let second = shared.lent_out().next().unwrap();
        shared.restore(Chunk {
            lent: true,
            ..chunk(second.0, second.1)
        });
        shared.give(pin, MIB);
        assert_eq!(shared.remove_free_chunks(), [chunk(1 << 32, 64 * MIB)]);
        assert_eq!(shared.held(), 0);
    }

    /// A reset frees the lender's chunk, not the blocks lent out of it; merging arenas and
    /// requests served from chunks of their own lend nothing.
    #[test]
    fn a_reset_frees_only_the_drivers_chunks_and_merging_arenas_lend_nothing() {
        const MIB: usize = 1 << 20;
        let mut shared = Arenas::new(128 * MIB, None);
        shared.add_chunk(chunk(1 << 32, 64 * MIB));
        assert_eq!(
            shared.lend(256 * MIB, 256 * MIB, usize::MAX),
            None,
            "oversize"
        );
        let lent = shared.lend(MIB, 2 * MIB, usize::MAX).unwrap();
        let mut stream = Arenas::new(128 * MIB, None);
        stream.add_chunk(lent);
        stream.add_chunk(chunk(1 << 40, 8 * MIB));
        assert_eq!(stream.chunks(), 1);
        assert_eq!(stream.clear(), [chunk(1 << 40, 8 * MIB)]);
        assert_eq!(shared.clear(), [chunk(1 << 32, 64 * MIB)]);
        assert_eq!(shared.lent_out().count(), 0);
        let mut merging = Arenas::new(usize::MAX, Some(2 * MIB));
        merging.add_chunk(chunk(1 << 32, 8 * MIB));
        assert_eq!(merging.lend(MIB, 2 * MIB, usize::MAX), None);
    }

    /// A stream's lent segment is cut out of the shared segment it lies in; the blocks on
    /// either side stay on their side.
    #[test]
    fn lent_blocks_are_cut_out_of_the_shared_segments() {
        let block = |address, bytes| HeldBlock {
            address,
            bytes,
            state: BlockState::Free,
        };
        let mut segments = vec![HeldSegment {
            address: 0x1000,
            bytes: 0x1000,
            kind: SegmentKind::Chunk,
            stream: None,
            blocks: vec![block(0x1000, 0x100), block(0x1800, 0x800)],
        }];
        cut_out(&mut segments, [(0x1100, 0x100), (0x1000, 0x100)]);
        let got: Vec<_> = segments
            .iter()
            .map(|s| (s.address, s.bytes, s.blocks.len()))
            .collect();
        assert_eq!(got, [(0x1200, 0xe00, 1)], "{segments:?}");
        cut_out(&mut segments, [(0x1400, 0x100)]);
        let got: Vec<_> = segments
            .iter()
            .map(|s| (s.address, s.bytes, s.blocks.len()))
            .collect();
        assert_eq!(got, [(0x1200, 0x200, 0), (0x1500, 0xb00, 1)]);
    }

    #[test]
    fn freed_neighbours_merge_within_a_chunk_but_not_across_chunks() {
        let mut arena = Arena::default();
        // Two chunks that touch: the second starts where the first ends.
        arena.add_chunk(0x1000_0000, 4 << 20);
        arena.add_chunk(0x1000_0000 + (4 << 20), 4 << 20);
        let blocks: Vec<u64> = (0..8).map(|_| arena.take(1 << 20).unwrap()).collect();
        assert!(arena.free.is_empty());
        for &b in blocks.iter().rev() {
            arena.give(b, 1 << 20);
        }
        let mut free: Vec<(u64, usize)> = arena.free_blocks().collect();
        free.sort();
        assert_eq!(
            free,
            vec![(0x1000_0000, 4 << 20), (0x1000_0000 + (4 << 20), 4 << 20)]
        );
        assert_eq!(arena.remove_free_chunks().len(), 2);
        assert!(arena.free.is_empty() && arena.ends.is_empty());
        assert_eq!(arena.nonempty, [0; WORDS]);
    }

    #[test]
    fn chunks_that_merge_extend_the_free_block_they_are_added_after() {
        let mut arena = Arena {
            merge_across: true,
            piece: 2 << 20,
            ..Arena::default()
        };
        let base = 0x2000_0000u64;
        arena.add_chunk(base, 4 << 20);
        let used = arena.take(3 << 20).unwrap();
        assert_eq!(used, base);
        // The free 1 MiB at the end is the tail; a chunk mapped just past it extends it.
        assert_eq!(arena.tail(), Some((base + (4 << 20), 1 << 20)));
        arena.add_chunk(base + (4 << 20), 2 << 20);
        let blocks: Vec<(u64, usize)> = arena.free_blocks().collect();
        assert_eq!(
            blocks,
            vec![(base + (3 << 20), 3 << 20)],
            "one block over both chunks"
        );
        assert_eq!(arena.take(3 << 20), Some(base + (3 << 20)));
        assert_eq!(
            arena.tail(),
            Some((base + (6 << 20), 0)),
            "nothing free at the end"
        );
        arena.give(used, 3 << 20);
        // Two chunks elsewhere, wholly free: the one outside the kept range goes, the one
        // inside it stays; so does the wholly free first piece of the block given back, and
        // the rest of that block stays free.
        arena.add_chunk(base + (64 << 20), 2 << 20);
        arena.add_chunk(base + (96 << 20), 2 << 20);
        let held = arena.held;
        let mut removed = arena.shed_free_chunks((base + (90 << 20), base + (100 << 20)), held);
        removed.sort();
        assert_eq!(removed, vec![(base, 2 << 20), (base + (64 << 20), 2 << 20)]);
        assert_eq!(arena.chunks.len(), 3);
        assert_eq!(arena.held, 6 << 20);
        let mut blocks: Vec<(u64, usize)> = arena.free_blocks().collect();
        blocks.sort();
        assert_eq!(
            blocks,
            vec![(base + (2 << 20), 1 << 20), (base + (96 << 20), 2 << 20)]
        );
        assert_eq!(
            arena.runs.iter().map(|(&a, &b)| (a, b)).collect::<Vec<_>>(),
            vec![
                (base + (2 << 20), base + (6 << 20)),
                (base + (96 << 20), base + (98 << 20))
            ],
            "the runs split where pieces went"
        );
    }

    #[test]
    fn chunks_that_do_not_merge_have_no_tail() {
        let mut arena = Arena::default();
        arena.add_chunk(0x3000_0000, 4 << 20);
        assert_eq!(arena.tail(), None);
    }
}
