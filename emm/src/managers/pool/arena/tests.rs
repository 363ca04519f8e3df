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
    arena.add_chunk(whole, 64 * MIB, usize::MAX);
    // Only the large free chunk holds the request: spared, unless it is no larger than
    // what the pool would grow by.
    assert_eq!(arena.take_sparing(256, || 8 * MIB), None);
    assert_eq!(arena.take_sparing(256, || 64 * MIB), Some(whole));
    arena.give(whole, 256);
    // A chunk a live block keeps serves it instead.
    arena.add_chunk(used, 8 * MIB, usize::MAX);
    assert_eq!(arena.take(8 * MIB - 4096), Some(used));
    let small = arena.take_sparing(256, || 8 * MIB).unwrap();
    assert!((used..used + 8 * MIB as u64).contains(&small), "{small:#x}");
    // A chunk of the smallest growth is never spared.
    let mut small_chunks = Arena::default();
    small_chunks.add_chunk(whole, SPARED_ABOVE, usize::MAX);
    assert_eq!(small_chunks.take_sparing(256, || 0), Some(whole));
}

#[test]
fn a_request_fails_only_when_no_free_block_is_large_enough() {
    let mut arena = Arena::default();
    arena.add_chunk(1 << 30, 64 << 20, usize::MAX);
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
    arena.add_chunk(1 << 32, 4 << 20, usize::MAX);
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
        arena.add_chunk(1 << 32, 4 << 20, usize::MAX);
        arena.add_chunk((1 << 32) + (4 << 20), 2 << 20, usize::MAX);
        arena.add_chunk(1 << 40, 8 << 20, usize::MAX);
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

/// Checks a merging arena against the blocks `lent`: its chunks are pieces of a multiple
/// of the smallest piece, at multiples of it, its runs are the runs of chunks side by side,
/// its held bytes theirs, and free and lent blocks tile each run with no two free blocks side
/// by side.
fn check_merging(arena: &Arena, lent: &[(u64, usize)]) {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for (&base, &size) in &arena.chunks {
        assert!(
            size.is_multiple_of(PIECE) && base.is_multiple_of(PIECE as u64),
            "a piece is whole smallest pieces, at a multiple of the smallest"
        );
        match runs.last_mut() {
            Some((_, end)) if *end == base => *end += size as u64,
            _ => runs.push((base, base + size as u64)),
        }
    }
    let recorded: Vec<(u64, u64)> = arena.runs.iter().map(|(&a, &b)| (a, b)).collect();
    assert_eq!(recorded, runs, "the runs");
    assert_eq!(arena.held, arena.chunks.values().sum::<usize>());
    let mut blocks: Vec<(u64, usize, bool)> = lent.iter().map(|&(a, s)| (a, s, false)).collect();
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

/// The wholly free pieces of a merging arena, as (base, size), found block by block.
fn free_pieces(arena: &Arena) -> Vec<(u64, usize)> {
    let blocks: Vec<(u64, usize)> = arena.free_blocks().collect();
    arena
        .chunks
        .iter()
        .map(|(&b, &size)| (b, size))
        .filter(|&(b, size)| {
            blocks
                .iter()
                .any(|&(a, s)| a <= b && b + size as u64 <= a + s as u64)
        })
        .collect()
}

/// The bytes of `pieces`.
fn bytes(pieces: &[(u64, usize)]) -> usize {
    pieces.iter().map(|&(_, size)| size).sum()
}

#[derive(Clone, Debug)]
enum MergingStep {
    Take(usize),
    Give(usize),
    /// Maps this many smallest pieces past the tail (or at a new place when there is none),
    /// as pieces of the smallest shifted left by the second (the last one shorter).
    Grow(usize, u32),
    /// Sheds up to this many smallest pieces' bytes, keeping the tail's free block or nothing.
    Shed(bool, usize),
    /// Sheds wholly free pieces, up to this many smallest pieces' bytes.
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
        1 => (1usize..=8, 0u32..=2).prop_map(|(n, k)| MergingStep::Grow(n, k)),
        1 => (any::<bool>(), 1usize..=8).prop_map(|(k, n)| MergingStep::Shed(k, n)),
        1 => (1usize..=8).prop_map(MergingStep::ShedPieces),
        1 => (1usize..=6).prop_map(|u| MergingStep::Adopt(u << 20)),
    ]
}

proptest::proptest! {
    #![proptest_config(crate::test_config::proptest_config())]

    /// Random takes, gives, growths (in pieces of mixed sizes), sheds and adoptions on an
    /// arena whose chunks merge and are recorded as pieces: after every step it is
    /// consistent (`check_merging`), a shed of up to n bytes gives back wholly free pieces
    /// outside the kept block in address order until they come to n bytes, or all of them
    /// where they come to less, and an adoption moves a run of wholly free pieces of one size
    /// that holds the request. 256 cases (`PROPTEST_CASES=N` for more).
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
        arena.add_chunk(1 << 32, 4 * PIECE, PIECE);
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
                MergingStep::Grow(n, k) => {
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
                    arena.add_chunk(at, n * PIECE, PIECE << k);
                }
                MergingStep::Shed(keep_tail, most) => {
                    let keep = match arena.tail() {
                        Some((end, free)) if keep_tail => (end - free as u64, end),
                        _ => (0, 0),
                    };
                    let outside: Vec<(u64, usize)> = free_pieces(&arena)
                        .into_iter()
                        .filter(|&(b, size)| b + size as u64 <= keep.0 || b >= keep.1)
                        .collect();
                    let most = most * PIECE;
                    let shed = arena.shed_free_chunks(keep, most);
                    // Wholly free pieces outside the kept block, taken until they come to
                    // `most` bytes.
                    proptest::prop_assert!(shed.iter().all(|p| outside.contains(p)));
                    proptest::prop_assert!(bytes(&shed) >= most.min(bytes(&outside)));
                    proptest::prop_assert!(bytes(&shed[..shed.len().saturating_sub(1)]) < most);
                }
                MergingStep::ShedPieces(n) => {
                    let wholly_free = bytes(&free_pieces(&arena));
                    let shed = arena.shed_free_pieces(n * PIECE);
                    proptest::prop_assert!(bytes(&shed) >= wholly_free.min(n * PIECE));
                    proptest::prop_assert!(bytes(&shed[..shed.len().saturating_sub(1)]) < n * PIECE);
                    proptest::prop_assert_eq!(bytes(&free_pieces(&arena)), wholly_free - bytes(&shed));
                }
                MergingStep::Adopt(size) => {
                    if let Some((base, got, piece)) = arena.take_free_chunk(size, usize::MAX) {
                        proptest::prop_assert!(got >= size && got < size + piece);
                        proptest::prop_assert!(got.is_multiple_of(piece));
                        proptest::prop_assert!(
                            lent.iter().all(|&(a, s)| a + s as u64 <= base || a >= base + got as u64),
                            "an adopted run holds no lent block"
                        );
                        other.add_chunk(base, got, piece);
                        check_merging(&other, &[]);
                    }
                }
            }
            check_merging(&arena, &lent);
            // Counted over the settled blocks, as the sheds count them.
            if arena.recent.is_none() {
                let brute = bytes(&free_pieces(&arena));
                proptest::prop_assert_eq!(arena.free_piece_bytes((0, 0)), brute);
            }
        }
    }
}

fn chunk(base: u64, size: usize) -> Chunk {
    Chunk {
        base,
        size,
        piece: size,
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
    assert_eq!(shared.held(), 8 * MIB, "the lent blocks are the borrowers'");
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
    arena.add_chunk(0x1000_0000, 4 << 20, usize::MAX);
    arena.add_chunk(0x1000_0000 + (4 << 20), 4 << 20, usize::MAX);
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
    arena.add_chunk(base, 4 << 20, 2 << 20);
    let used = arena.take(3 << 20).unwrap();
    assert_eq!(used, base);
    // The free 1 MiB at the end is the tail; a chunk mapped just past it extends it.
    assert_eq!(arena.tail(), Some((base + (4 << 20), 1 << 20)));
    arena.add_chunk(base + (4 << 20), 2 << 20, 2 << 20);
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
    arena.add_chunk(base + (64 << 20), 2 << 20, 2 << 20);
    arena.add_chunk(base + (96 << 20), 2 << 20, 2 << 20);
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
    arena.add_chunk(0x3000_0000, 4 << 20, usize::MAX);
    assert_eq!(arena.tail(), None);
}
