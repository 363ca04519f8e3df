//! [`Arenas`]: the pool's standard arena and the one for requests of chunks of their own, the
//! [`Chunk`]s they hold, and how their blocks are placed in a snapshot's segments.

use super::*;

/// Puts each of `blocks` in the segment of `segments` (sorted by address) that holds its
/// start; a block outside every segment is left out (debug builds stop on it).
pub(in crate::managers::pool) fn place(
    segments: &mut [HeldSegment],
    blocks: impl IntoIterator<Item = HeldBlock>,
) {
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
pub(in crate::managers::pool) fn cut_out(
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

/// A chunk: one driver allocation, wholly the pool's; or, `lent`, a block of the shared
/// arena's chunk that the stream arena holds as a chunk of its own: it goes back to the shared
/// arena, never to the driver, whose allocation is the chunk the block lies in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::managers::pool) struct Chunk {
    /// Its address.
    pub(in crate::managers::pool) base: u64,
    /// Its bytes.
    pub(in crate::managers::pool) size: usize,
    /// Where chunks merge, the bytes of each physical piece it is made of, side by side (the
    /// last one shorter where `size` is not a multiple); elsewhere its size.
    pub(in crate::managers::pool) piece: usize,
    /// Made for one request above the standard limit, and serving only such requests.
    pub(in crate::managers::pool) oversize: bool,
    /// Lent by the shared arena ([`Arenas::lend`]): it goes back there
    /// ([`Arenas::restore`]), never to the driver, whose allocation is the chunk it lies in.
    pub(in crate::managers::pool) lent: bool,
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
                piece: size,
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
pub(in crate::managers::pool) struct Arenas {
    /// Bumped by a reset: a block of an older generation lies in a chunk the reset freed.
    pub(in crate::managers::pool) generation: u64,
    /// Requests up to this many bytes are served from standard chunks.
    limit: usize,
    standard: Arena,
    oversize: Arena,
    /// The bases of the chunks these arenas hold that another arena lent them (the stream
    /// arena: blocks of the shared arena's chunks).
    pub(super) borrowed: BTreeSet<u64>,
    /// The blocks these arenas lent to another (the shared arena's, to the stream arena),
    /// start -> bytes: taken from the free space, and no chunk of the driver's, until they
    /// come back.
    lent_out: BTreeMap<u64, usize>,
}

impl Arenas {
    /// Empty arenas that serve requests up to `limit` bytes from standard chunks; free space
    /// merges across chunks where they are mapped next to each other, in pieces of `pieces`
    /// bytes or a multiple of it.
    pub(in crate::managers::pool) fn new(limit: usize, pieces: Option<usize>) -> Arenas {
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
    pub(in crate::managers::pool) fn is_oversize(&self, size: usize) -> bool {
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
    pub(in crate::managers::pool) fn take(&mut self, size: usize) -> Option<u64> {
        self.of(size).take(size)
    }

    /// [`take`](Self::take), with the generation the block belongs to.
    pub(in crate::managers::pool) fn take_stamped(&mut self, size: usize) -> Option<(u64, u64)> {
        Some((self.take(size)?, self.generation))
    }

    /// [`Arena::take_sparing`] in the arena that serves `size` (chunks made for one request
    /// each are spared nothing: they serve only requests larger than the limit).
    pub(in crate::managers::pool) fn take_sparing(
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
    pub(in crate::managers::pool) fn give(&mut self, addr: u64, size: usize) {
        self.of(size).give(addr, size);
    }

    /// Adds a wholly free chunk to the arena of its kind.
    pub(in crate::managers::pool) fn add_chunk(&mut self, chunk: Chunk) {
        if chunk.lent {
            self.borrowed.insert(chunk.base);
        }
        let arena = if chunk.oversize {
            &mut self.oversize
        } else {
            &mut self.standard
        };
        arena.add_chunk(chunk.base, chunk.size, chunk.piece);
    }

    /// The free block of the arena that serves `size` that memory mapped just past it would
    /// extend ([`Arena::tail`]).
    pub(in crate::managers::pool) fn tail(&mut self, size: usize) -> Option<(u64, usize)> {
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
    pub(in crate::managers::pool) fn remove_free_chunks(&mut self) -> Vec<Chunk> {
        let standard = self.standard.remove_free_chunks();
        let chunks = Chunk::of_kinds(standard, self.oversize.remove_free_chunks());
        self.marked(chunks)
    }

    /// Before a growth of `most` bytes, removes the wholly free chunks that go back to the
    /// driver (where chunks merge, pieces up to `most` bytes, which the growth maps again:
    /// [`Arena::shed_free_chunks`]), or to the arena that lent them.
    pub(in crate::managers::pool) fn shed_free_chunks(&mut self, most: usize) -> Vec<Chunk> {
        let standard = self.standard.shed_free_chunks((0, 0), most);
        let chunks = Chunk::of_kinds(standard, self.oversize.shed_free_chunks((0, 0), most));
        self.marked(chunks)
    }

    /// Where chunks merge, removes wholly free pieces of the standard arena up to `most` bytes
    /// ([`Arena::shed_free_pieces`]).
    pub(in crate::managers::pool) fn shed_free_pieces(&mut self, most: usize) -> Vec<Chunk> {
        let standard = self.standard.shed_free_pieces(most);
        self.marked(Chunk::of_kinds(standard, []))
    }

    /// Lends the stream arena a block of `want` bytes, or failing that of `need` (at most
    /// `want`), from the free space of the standard chunks, as a chunk of its own marked
    /// `lent`: where a chunk is not wholly free, its free space still serves the streams.
    /// `None` where chunks merge (their pieces move whole,
    /// [`take_free_chunk`](Self::take_free_chunk)), for a request served from chunks of its
    /// own, or where no free block holds `need` but wholly free chunks larger than `most`
    /// ([`Arena::take_sparing`]).
    pub(in crate::managers::pool) fn lend(
        &mut self,
        need: usize,
        want: usize,
        most: usize,
    ) -> Option<Chunk> {
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
            piece: size,
            oversize: false,
            lent: true,
        })
    }

    /// Takes back a chunk another arena gave up: a block these arenas lent goes back to their
    /// free space; any other chunk joins them ([`add_chunk`](Self::add_chunk)).
    pub(in crate::managers::pool) fn restore(&mut self, chunk: Chunk) {
        if !chunk.lent {
            return self.add_chunk(chunk);
        }
        let lent = self.lent_out.remove(&chunk.base);
        debug_assert_eq!(lent, Some(chunk.size), "a lent block comes back as it went");
        self.standard.give(chunk.base, chunk.size);
    }

    /// The blocks lent to other arenas, as (start, bytes).
    pub(in crate::managers::pool) fn lent_out(&self) -> impl Iterator<Item = (u64, usize)> + '_ {
        self.lent_out.iter().map(|(&a, &s)| (a, s))
    }

    /// Before a growth in place, removes the wholly free chunks of the arena that serves
    /// `size` that lie outside the free block `keep` (start, end) and go back to the driver
    /// ([`Arena::shed_free_chunks`]).
    pub(in crate::managers::pool) fn shed_free_chunks_outside(
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
    pub(in crate::managers::pool) fn take_free_chunk(
        &mut self,
        size: usize,
        most: usize,
    ) -> Option<Chunk> {
        let oversize = self.is_oversize(size);
        let (base, size, piece) = self.of(size).take_free_chunk(size, most)?;
        let chunk = Chunk {
            base,
            size,
            piece,
            oversize,
            lent: false,
        };
        self.marked(vec![chunk]).pop()
    }

    /// Whether the arenas hold no chunk.
    pub(in crate::managers::pool) fn is_empty(&self) -> bool {
        self.standard.is_empty() && self.oversize.is_empty()
    }

    /// Bytes of their chunks, less the blocks lent to other arenas (the borrower holds those).
    pub(in crate::managers::pool) fn held(&self) -> usize {
        let lent: usize = self.lent_out.values().sum();
        self.standard.held + self.oversize.held - lent
    }

    /// How many of the driver's chunks they hold (not those another arena lent them).
    pub(in crate::managers::pool) fn chunks(&self) -> usize {
        self.standard.chunks.len() + self.oversize.chunks.len() - self.borrowed.len()
    }

    /// Adds their chunks to `out` as segments of `kind` serving `stream`, with their free
    /// blocks (chunks mapped next to each other with free space merging across them make one
    /// segment, as their free blocks may span them).
    pub(in crate::managers::pool) fn held_segments(
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
    pub(in crate::managers::pool) fn free_block_sizes(&self, out: &mut Vec<usize>) {
        for arena in [&self.standard, &self.oversize] {
            out.extend(arena.free_blocks().map(|(_, size)| size));
        }
    }

    /// The largest free block.
    pub(in crate::managers::pool) fn largest_free(&self) -> usize {
        self.standard
            .largest_free()
            .max(self.oversize.largest_free())
    }

    /// Forgets every chunk and free block (a reset freed them), returning the driver's chunks
    /// (not those lent to them: the lender's chunk holds each).
    pub(in crate::managers::pool) fn clear(&mut self) -> Vec<Chunk> {
        let standard = self.standard.clear();
        let mut chunks = Chunk::of_kinds(standard, self.oversize.clear());
        let borrowed = std::mem::take(&mut self.borrowed);
        chunks.retain(|c| !borrowed.contains(&c.base));
        self.lent_out.clear();
        chunks
    }
}
