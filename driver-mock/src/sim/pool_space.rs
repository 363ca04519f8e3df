//! Where a device's stream-ordered pools place their blocks, and the physical pages they hold.
//!
//! The model, matched against the driver's own pool replaying the trace corpus on an H100
//! (`integration/traces/corpus.csv`): a pool maps physical memory in 2 MiB pages, and a page
//! stays mapped while any block of the pool (live, or freed and cached) lies in it. Blocks are
//! packed at the device's alignment, and a pool that grows places the new block past the one it
//! placed last (next fit, wrapping at the end of the space), so growth takes fresh pages rather
//! than filling the holes that live neighbours keep mapped. Blocks of different pools never
//! share a page: each pool's pages are its own.

use std::collections::BTreeMap;

use super::config::PAGE_SIZE;

/// One pool's pages: those at a block's edge may be shared by several of its blocks; those
/// strictly inside a block are that block's alone.
#[derive(Debug, Default)]
struct PoolPages {
    /// Page index -> how many of the pool's blocks begin or end in it.
    edges: BTreeMap<u64, usize>,
    /// Pages wholly inside one block.
    inner: u64,
}

impl PoolPages {
    fn count(&self) -> u64 {
        self.edges.len() as u64 + self.inner
    }
}

/// A block placed in the space.
#[derive(Clone, Copy, Debug)]
struct Placed {
    span: u64,
    pool: u64,
}

/// The addresses a device's stream-ordered pools place their blocks in.
#[derive(Debug)]
pub(super) struct PoolSpace {
    start: u64,
    len: u64,
    blocks: BTreeMap<u64, Placed>,
    /// Where the next search for room begins: past the block placed last, or the start
    /// while the space is empty.
    cursor: u64,
    pools: BTreeMap<u64, PoolPages>,
    /// Pages all pools hold.
    pages: u64,
}

/// The first and last page a block of `span` bytes at `addr` lies in.
fn edge_pages(start: u64, addr: u64, span: u64) -> (u64, u64) {
    let page = PAGE_SIZE as u64;
    ((addr - start) / page, (addr - start + span - 1) / page)
}

impl PoolSpace {
    /// An empty space of `len` bytes from `start`, both multiples of the page size.
    pub(super) fn new(start: u64, len: u64) -> PoolSpace {
        debug_assert!(
            start.is_multiple_of(PAGE_SIZE as u64) && len.is_multiple_of(PAGE_SIZE as u64)
        );
        PoolSpace {
            start,
            len,
            blocks: BTreeMap::new(),
            cursor: start,
            pools: BTreeMap::new(),
            pages: 0,
        }
    }

    /// Bytes of the pages all pools hold.
    pub(super) fn held_bytes(&self) -> usize {
        self.pages as usize * PAGE_SIZE
    }

    /// Bytes of the pages `pool` holds.
    pub(super) fn pool_bytes(&self, pool: u64) -> usize {
        self.pools
            .get(&pool)
            .map_or(0, |p| p.count() as usize * PAGE_SIZE)
    }

    /// Where a new block of `span` bytes of `pool` goes: the first room at or after the cursor,
    /// wrapping once; `None` when the space has no room.
    pub(super) fn find(&self, pool: u64, span: u64) -> Option<u64> {
        let end = self.start + self.len;
        self.find_in(pool, span, self.cursor, end)
            .or_else(|| self.find_in(pool, span, self.start, self.cursor))
    }

    /// The first room for `span` bytes of `pool` beginning in `[lo, hi)`.
    fn find_in(&self, pool: u64, span: u64, lo: u64, hi: u64) -> Option<u64> {
        let page = PAGE_SIZE as u64;
        let end = self.start + self.len;
        // The gap's start and the pool of the block before it.
        let (mut from, mut before) = match self.blocks.range(..lo).next_back() {
            Some((&a, b)) => ((a + b.span).max(lo), Some(b.pool)),
            None => (lo, None),
        };
        let mut next = self.blocks.range(lo..);
        loop {
            if from >= hi {
                return None;
            }
            let following = next.next();
            let (to, after) = match following {
                Some((&a, b)) => (a, Some(b.pool)),
                None => (end, None),
            };
            // Another pool's neighbour keeps its pages: the block starts or ends at a page
            // boundary beside it.
            let at = if before.is_some_and(|p| p != pool) {
                from.next_multiple_of(page)
            } else {
                from
            };
            let limit = if after.is_some_and(|p| p != pool) {
                to - (to - self.start) % page
            } else {
                to
            };
            if at < hi && at.checked_add(span).is_some_and(|e| e <= limit) {
                return Some(at);
            }
            let (a, b) = following?;
            from = from.max(a + b.span);
            before = Some(b.pool);
        }
    }

    /// Pages a block of `span` bytes at `addr` would add to what `pool` holds.
    pub(super) fn pages_added(&self, pool: u64, addr: u64, span: u64) -> u64 {
        let (first, last) = edge_pages(self.start, addr, span);
        let edges = self.pools.get(&pool).map(|p| &p.edges);
        let new = |pg: u64| u64::from(edges.is_none_or(|e| !e.contains_key(&pg)));
        if first == last {
            new(first)
        } else {
            new(first) + new(last) + (last - first - 1)
        }
    }

    /// Places a block of `pool` at `addr` (from [`find`](Self::find)).
    pub(super) fn insert(&mut self, pool: u64, addr: u64, span: u64) {
        let (first, last) = edge_pages(self.start, addr, span);
        let p = self.pools.entry(pool).or_default();
        let before = p.count();
        *p.edges.entry(first).or_default() += 1;
        if last != first {
            *p.edges.entry(last).or_default() += 1;
            p.inner += last - first - 1;
        }
        self.pages += p.count() - before;
        self.blocks.insert(addr, Placed { span, pool });
        self.cursor = addr + span;
    }

    /// Takes the block at `addr` out; its pool's pages that no other block of it lies in are
    /// unmapped. Returns the pool it belonged to.
    pub(super) fn remove(&mut self, addr: u64) -> Option<u64> {
        let b = self.blocks.remove(&addr)?;
        let (first, last) = edge_pages(self.start, addr, b.span);
        let p = self
            .pools
            .get_mut(&b.pool)
            .expect("a placed block's pool has pages");
        let before = p.count();
        for pg in if first == last {
            vec![first]
        } else {
            vec![first, last]
        } {
            let n = p
                .edges
                .get_mut(&pg)
                .expect("a placed block's edge page is counted");
            *n -= 1;
            if *n == 0 {
                p.edges.remove(&pg);
            }
        }
        if last != first {
            p.inner -= last - first - 1;
        }
        self.pages -= before - p.count();
        if p.count() == 0 {
            self.pools.remove(&b.pool);
        }
        // An empty space starts over: a pool made after every block went places its first
        // block where the first block of all went.
        if self.blocks.is_empty() {
            self.cursor = self.start;
        }
        Some(b.pool)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: u64 = PAGE_SIZE as u64;
    const START: u64 = 64 * P;

    fn space() -> PoolSpace {
        PoolSpace::new(START, 16 * P)
    }

    fn place(s: &mut PoolSpace, pool: u64, span: u64) -> u64 {
        let at = s.find(pool, span).expect("room");
        s.insert(pool, at, span);
        at
    }

    #[test]
    fn blocks_of_one_pool_pack_and_share_pages() {
        let mut s = space();
        let a = place(&mut s, 1, 512);
        let b = place(&mut s, 1, P);
        assert_eq!((a, b), (START, START + 512));
        // The second block reaches into the second page.
        assert_eq!(s.pool_bytes(1), 2 * PAGE_SIZE);
        s.remove(a);
        assert_eq!(s.pool_bytes(1), 2 * PAGE_SIZE, "b still lies in both pages");
        s.remove(b);
        assert_eq!((s.pool_bytes(1), s.held_bytes()), (0, 0));
    }

    #[test]
    fn growth_goes_past_the_last_block_not_into_holes() {
        let mut s = space();
        let a = place(&mut s, 1, 512);
        let b = place(&mut s, 1, 512);
        s.remove(a);
        let c = place(&mut s, 1, 512);
        assert_eq!(c, b + 512, "next fit: after the last placed block");
        // At the end of the space, the search wraps to the hole.
        let rest = START + 16 * P - (c + 512);
        let d = place(&mut s, 1, rest);
        assert_eq!(d + rest, START + 16 * P);
        assert_eq!(place(&mut s, 1, 512), START);
        assert_eq!(s.find(1, 512), None, "full");
    }

    #[test]
    fn pools_keep_to_their_own_pages() {
        let mut s = space();
        let a = place(&mut s, 1, 512);
        let b = place(&mut s, 2, 512);
        assert_eq!(b, a + P, "the other pool starts on the next page");
        assert_eq!(s.held_bytes(), 2 * PAGE_SIZE);
        // After pool 2's block, pool 1 starts on the page after it.
        s.remove(a);
        assert_eq!(s.find(1, P), Some(b + P));
        // Wrapped to the start, its room ends where pool 2's page begins.
        let rest = START + 16 * P - (b + P);
        place(&mut s, 1, rest);
        assert_eq!(s.find(1, P + 512), None);
        assert_eq!(s.find(1, P), Some(START));
    }

    #[test]
    fn pages_added_counts_only_pages_the_pool_lacks() {
        let mut s = space();
        place(&mut s, 1, 512);
        let at = s.find(1, 3 * P).expect("room");
        assert_eq!(
            s.pages_added(1, at, 3 * P),
            3,
            "shares the first page, adds three"
        );
        s.insert(1, at, 3 * P);
        assert_eq!(s.pool_bytes(1), 4 * PAGE_SIZE);
    }
}
