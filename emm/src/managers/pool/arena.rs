//! The arena: free space of all chunks, best fit and coalescing.

use std::collections::{BTreeMap, BTreeSet};

/// Free space of all chunks: ordered by size (best fit) and by address (coalescing).
#[derive(Debug, Default)]
pub(super) struct Arena {
    pub(super) generation: u64,
    /// Chunk base -> size.
    pub(super) chunks: BTreeMap<u64, usize>,
    /// Free block address -> (size, chunk base).
    pub(super) by_addr: BTreeMap<u64, (usize, u64)>,
    /// (size, address) of every free block.
    pub(super) by_size: BTreeSet<(usize, u64)>,
    pub(super) held: usize,
    pub(super) peak_held: usize,
    pub(super) grows: u64,
    pub(super) trimmed: u64,
}

impl Arena {
    pub(super) fn chunk_of(&self, addr: u64) -> u64 {
        let (&base, &size) = self
            .chunks
            .range(..=addr)
            .next_back()
            .expect("a pool block lies in a chunk");
        debug_assert!(addr < base + size as u64);
        base
    }

    pub(super) fn insert_free(&mut self, addr: u64, size: usize, chunk: u64) {
        self.by_addr.insert(addr, (size, chunk));
        self.by_size.insert((size, addr));
    }

    pub(super) fn remove_free(&mut self, addr: u64, size: usize) {
        self.by_addr.remove(&addr);
        self.by_size.remove(&(size, addr));
    }

    /// Best fit: the smallest free block of at least `size` bytes, split.
    pub(super) fn take(&mut self, size: usize) -> Option<u64> {
        let &(found, addr) = self.by_size.range((size, 0)..).next()?;
        let (_, chunk) = self.by_addr[&addr];
        self.remove_free(addr, found);
        if found > size {
            self.insert_free(addr + size as u64, found - size, chunk);
        }
        Some(addr)
    }

    /// [`take`](Self::take), with the generation the block belongs to.
    pub(super) fn take_stamped(&mut self, size: usize) -> Option<(u64, u64)> {
        Some((self.take(size)?, self.generation))
    }

    /// Returns a block, merging it with free neighbours in the same chunk.
    pub(super) fn give(&mut self, mut addr: u64, mut size: usize) {
        let chunk = self.chunk_of(addr);
        if let Some((&prev, &(psize, pchunk))) = self.by_addr.range(..addr).next_back()
            && pchunk == chunk
            && prev + psize as u64 == addr
        {
            self.remove_free(prev, psize);
            addr = prev;
            size += psize;
        }
        let end = addr + size as u64;
        if let Some(&(nsize, nchunk)) = self.by_addr.get(&end)
            && nchunk == chunk
        {
            self.remove_free(end, nsize);
            size += nsize;
        }
        self.insert_free(addr, size, chunk);
    }

    pub(super) fn add_chunk(&mut self, base: u64, size: usize) {
        self.chunks.insert(base, size);
        self.held += size;
        self.peak_held = self.peak_held.max(self.held);
        self.grows += 1;
        self.insert_free(base, size, base);
    }

    /// Removes every chunk that is wholly free.
    pub(super) fn remove_free_chunks(&mut self) -> Vec<(u64, usize)> {
        let free: Vec<(u64, usize)> = self
            .chunks
            .iter()
            .filter(|&(base, size)| self.by_addr.get(base) == Some(&(*size, *base)))
            .map(|(&b, &s)| (b, s))
            .collect();
        for &(base, size) in &free {
            self.remove_free(base, size);
            self.chunks.remove(&base);
            self.held -= size;
            self.trimmed += size as u64;
        }
        free
    }
}
