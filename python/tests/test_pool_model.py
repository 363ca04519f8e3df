"""The idealised pool model of `integration/traces/pool_model.py`, on logs small enough to follow
by hand: a block freed on one stream serves that stream at once and another stream only once
the log says the first stream's GPU work got past the free, and chunks never merge.
"""

import importlib.util
import pathlib

MIB = 1 << 20
_PATH = pathlib.Path(__file__).resolve().parents[2] / "integration" / "traces" / "pool_model.py"
_spec = importlib.util.spec_from_file_location("pool_model", _PATH)
pool_model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pool_model)


def alloc(ptr, size, stream, time, reached=None):
    """An allocation event as `pool_model.load` makes them."""
    return ("allocate", ptr, size, stream, time, reached)


def free(ptr, size, stream, time, reached=None):
    """A free event as `pool_model.load` makes them."""
    return ("free", ptr, size, stream, time, reached)


def test_a_stream_reuses_what_it_freed_at_once():
    events = [
        alloc("a", 48 * MIB, "s", 0, 0),
        free("a", 48 * MIB, "s", 10, 0),
        alloc("b", 48 * MIB, "s", 20, 0),
    ]
    ratio, grown = pool_model.model(events, 64 * MIB)
    assert grown == [1]
    assert ratio == 64 / 48


def test_another_stream_waits_for_the_freeing_streams_progress():
    # t's request comes before s's GPU work reached s's free: the pool grows.
    early = [
        alloc("a", 48 * MIB, "s", 0, 0),
        free("a", 48 * MIB, "s", 10, 0),
        alloc("b", 48 * MIB, "t", 20, 0),
        alloc("c", 1, "s", 30, 9),
    ]
    assert pool_model.model(early, 64 * MIB)[1] == [2]
    # Here an event of s's says its work reached the free first: t takes the block.
    late = [
        alloc("a", 48 * MIB, "s", 0, 0),
        free("a", 48 * MIB, "s", 10, 0),
        alloc("c", 1, "s", 15, 10),
        alloc("b", 48 * MIB, "t", 20, 0),
    ]
    assert pool_model.model(late, 64 * MIB)[1] == [1]
    assert pool_model.model(late, 64 * MIB, same_stream_only=True)[1] == [2]


def test_free_space_of_two_chunks_never_merges():
    events = [
        alloc("a", 40 * MIB, "s", 0, 0),
        alloc("b", 40 * MIB, "s", 1, 0),  # a second chunk: 24 MiB left in each
        alloc("c", 30 * MIB, "s", 2, 0),  # 48 MiB free in all, but no block holds 30
    ]
    ratio, grown = pool_model.model(events, 64 * MIB)
    assert grown == [3]
    assert ratio == (3 * 64) / 110


def test_wholly_free_chunks_go_back_before_a_growth():
    events = [
        alloc("a", 40 * MIB, "s", 0, 0),
        alloc("b", 40 * MIB, "s", 1, 0),
        free("a", 40 * MIB, "s", 2, 2),
        alloc("c", 70 * MIB, "s", 3, 3),  # above the chunk size: a chunk of its own
    ]
    ratio, grown = pool_model.model(events, 64 * MIB)
    assert grown == [3]
    # The first chunk, wholly free, went back before the 70 MiB one came: at most two held.
    assert ratio == (64 + 70) / 110


def test_a_second_pass_reuses_the_first_ones_chunks():
    events = [
        alloc("a", 48 * MIB, "s", 0, 0),
        alloc("b", 8 * MIB, "t", 1, 0),
        free("a", 48 * MIB, "s", 2, 1),
        free("b", 8 * MIB, "t", 3, 2),
    ]
    assert pool_model.model(events, 64 * MIB, passes=3)[1] == [1, 0, 0]


def test_with_markers_a_free_serves_another_stream_once_a_marker_after_it_is_done():
    events = [
        alloc("a", 48 * MIB, "s", 0, 0),
        free("a", 48 * MIB, "s", 10, 0),  # a marker at 10 on s
        alloc("c", 1, "s", 15, 10),  # s's progress passes it
        alloc("b", 48 * MIB, "t", 20, 0),
    ]
    stats = {}
    assert pool_model.model(events, 64 * MIB, marker_interval=0, stats=stats)[1] == [1]
    assert stats["markers"] == 1
    # Two frees on s within the interval: the second gets no marker of its own, so t cannot
    # know that s got past it, though the trace says so.
    events = [
        alloc("a", 24 * MIB, "s", 0, 0),
        alloc("d", 24 * MIB, "s", 1, 0),
        free("a", 24 * MIB, "s", 10, 0),
        free("d", 24 * MIB, "s", 12, 0),
        alloc("c", 1, "s", 15, 12),
        alloc("b", 48 * MIB, "t", 20, 0),
    ]
    assert pool_model.model(events, 64 * MIB, marker_interval=0)[1] == [1]
    assert pool_model.model(events, 64 * MIB, marker_interval=5)[1] == [2]


def test_a_wait_lets_another_stream_take_a_block_before_a_growth():
    # As `early` above: no stream's work reaches a free in this log, so every request that
    # would take a block another stream freed waits for that stream instead.
    events = [
        alloc("a", 48 * MIB, "s", 0, 0),
        free("a", 48 * MIB, "s", 10, 0),
        alloc("b", 48 * MIB, "t", 20, 0),
        free("b", 48 * MIB, "t", 30, 0),
        alloc("c", 8 * MIB, "s", 35, 0),
        free("c", 8 * MIB, "s", 36, 0),
        # s freed c after t's first wait: t waits for s again rather than grow.
        alloc("d", 60 * MIB, "t", 40, 0),
    ]
    stats = {}
    ratio, grown = pool_model.model(events, 64 * MIB, stats=stats, wait_fallback=True)
    assert grown == [1]
    # t for s (b), s for t (c: the chunk's one free block holds what t freed), t for s (d).
    assert stats["waits"] == 3
    assert ratio == 64 / 60
    # Without the fallback every request grows the pool, the wholly free chunk before it going
    # back to the driver first.
    assert pool_model.model(events, 64 * MIB)[1] == [4]
    # Nor does a stream wait for another where no stream may reuse another's frees.
    assert pool_model.model(events, 64 * MIB, same_stream_only=True, wait_fallback=True)[1] == [4]
