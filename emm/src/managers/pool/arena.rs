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
    /// Where chunks merge, the size of the smallest physical piece a growth maps (a chunk
    /// added is recorded as its pieces, each of which goes back to the driver once wholly
    /// free): no free block smaller than it covers a piece.
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
    /// chunks merge, it is recorded as pieces of `piece` bytes side by side, the last one
    /// shorter where `size` is not a multiple of it, and its free space runs on into free
    /// neighbours' (a chunk mapped just past a free block extends it); elsewhere `piece` is
    /// its size or more.
    pub(super) fn add_chunk(&mut self, base: u64, size: usize, piece: usize) {
        let mut at = 0;
        while at < size {
            let len = piece.min(size - at);
            self.chunks.insert(base + at as u64, len);
            at += len;
        }
        self.held += size;
        if self.merge_across {
            debug_assert!(
                base.is_multiple_of(self.piece as u64)
                    && size.is_multiple_of(self.piece)
                    && piece.is_multiple_of(self.piece),
                "a chunk that merges is whole pieces of at least the smallest piece, at a \
                 multiple of it"
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
    #[cfg(test)]
    fn free_piece_bytes(&self, keep: (u64, u64)) -> usize {
        self.free_chunks()
            .into_iter()
            .filter(|&(_, _, block)| block != keep.0)
            .map(|(_, size, _)| size)
            .sum()
    }

    /// Removes the smallest wholly free chunk of at least `size` bytes, for another arena, as
    /// (base, size, piece): `piece` is the size of each of its pieces (the chunk's own size
    /// where chunks do not merge). Where chunks merge, the shortest run of wholly free pieces
    /// of one size that lie side by side in one free block and hold `size` bytes, taken from
    /// the run that fits best (the other arena records it as the same pieces).
    pub(super) fn take_free_chunk(
        &mut self,
        size: usize,
        most: usize,
    ) -> Option<(u64, usize, usize)> {
        self.settle();
        let mut free = self.free_chunks();
        if !self.merge_across {
            let chunk = free
                .into_iter()
                .filter(|&(_, got, _)| got >= size && got <= most)
                .min_by_key(|&(_, got, _)| got)?;
            self.remove_chunks(vec![chunk]);
            return Some((chunk.0, chunk.1, chunk.1));
        }
        // Runs: pieces of one size side by side in one free block, in address order.
        free.sort_unstable_by_key(|c| (c.2, c.0));
        let mut runs: Vec<(usize, usize)> = Vec::new(); // (first index, bytes)
        for (k, &(base, len, block)) in free.iter().enumerate() {
            match runs.last_mut() {
                Some((first, got))
                    if free[*first].2 == block
                        && free[*first].1 == len
                        && free[k - 1].0 + free[k - 1].1 as u64 == base =>
                {
                    *got += len;
                }
                _ => runs.push((k, len)),
            }
        }
        let &(first, _) = runs
            .iter()
            .filter(|&&(_, got)| got >= size)
            .min_by_key(|&&(_, got)| got)?;
        let (start, piece) = (free[first].0, free[first].1);
        let count = size.div_ceil(piece);
        let taken: Vec<_> = free[first..first + count].to_vec();
        self.remove_chunks(taken);
        Some((start, count * piece, piece))
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

mod arenas;

pub(super) use arenas::{Arenas, Chunk, cut_out, place};

#[cfg(test)]
mod tests;
