#!/usr/bin/env python3
"""What a pool of `cuMemAlloc` chunks could hold on a program's log: an idealised model.

`pool` keeps each stream's memory in whole chunks of that stream's own (`docs/rust.md`), so
free space in one stream's chunk never merges with free space beside it in another's. On the
four-stream server it holds 1.4 to 1.6 x peak live where `vmm-pool` holds 1.03. This model asks
whether that is the price of chunks that never merge or of chunks owned per stream. It replays
a log (the `log` adaptor's CSV, with its `Kind` and `Reached` columns, as in `programs.csv`)
through one free space for every stream:

- the pool grows by chunks of `--chunk` bytes; a request above it gets a chunk of its own
  (rounded up to 2 MiB) whose free space serves any request; chunks never merge;
- a request takes the smallest free block that holds it and that its stream may use;
- before a growth, every wholly free chunk goes back to the driver;
- a free block remembers, per stream that freed part of it, when it was freed: the stream that
  freed it reuses it at once (its work is ordered), another stream once the log says the
  freeing stream's GPU work had reached that time (`Reached`); with `--same-stream-only`, never;
  with `--marker-interval MS`, only once a marker (an event) recorded on the freeing stream at
  or after the free is done, the pool recording at most one per stream per MS at its frees, as a
  pool that asks the driver would know;
- with `--wait-fallback`, a request no block serves takes, before the pool grows, the smallest
  free block large enough behind a wait (the stream's work made to wait on the GPU for the
  work queued so far on the streams that freed it, `cuStreamWaitEvent`): from then on what
  those streams freed before the wait serves it too.

The model makes no driver call and waits for nothing: it bounds what such a pool could do, it is
not a manager. Its figures are peak held over peak live (over every pass) and driver
allocations per pass; the replay of the same log under a real manager is
`cargo run --release -p integration --example replay -- --manager pool --passes N LOG`.

    python3 integration/traces/pool_model.py --passes 3 integration/traces/program_server.csv.gz
"""

import argparse
import gzip
import sys

MIB = 1 << 20
GRANULARITY = 2 * MIB
ALIGNMENT = 512


def load(path):
    """The device events of a log: (action, pointer, bytes, stream, time ns, reached ns or None)."""
    opener = gzip.open if path.endswith(".gz") else open
    events = []
    with opener(path, "rt") as f:
        header = f.readline().rstrip("\n").split(",")
        col = {name: k for k, name in enumerate(header)}
        for name in ("Action", "Pointer", "Size", "Stream", "Time", "Kind", "Reached"):
            if name not in col:
                sys.exit(f"{path}: no {name} column; the model needs a log with the GPU's progress")
        for line in f:
            x = line.rstrip("\n").split(",")
            if x[col["Kind"]] != "device":
                continue
            reached = x[col["Reached"]]
            events.append(
                (
                    x[col["Action"]],
                    x[col["Pointer"]],
                    int(x[col["Size"]]),
                    x[col["Stream"]],
                    int(round(float(x[col["Time"]]) * 1e9)),
                    int(reached) if reached not in ("", "-") else None,
                )
            )
    return events


class Chunk:
    """One `cuMemAlloc` allocation: its size and free blocks, [start, size, {stream: freed at}]."""

    def __init__(self, size):
        """A new chunk of `size` bytes, wholly free."""
        self.size = size
        self.free = [[0, size, {}]]

    def wholly_free(self):
        """Whether one free block covers the whole chunk."""
        return len(self.free) == 1 and self.free[0][1] == self.size

    def give(self, start, size, stream=None, at=0):
        """Returns a block freed on `stream` at `at`, merged with its free neighbours (their
        streams' times kept); with no stream, a block every stream may use."""
        self.free.append([start, size, {stream: at} if stream is not None else {}])
        self.free.sort(key=lambda b: b[0])
        merged = []
        for b in self.free:
            if merged and merged[-1][0] + merged[-1][1] == b[0]:
                last = merged[-1]
                last[1] += b[1]
                for s, t in b[2].items():
                    last[2][s] = max(last[2].get(s, 0), t)
            else:
                merged.append(b)
        self.free = merged


def model(events, chunk, passes=1, same_stream_only=False, marker_interval=None, stats=None,
          wait_fallback=False):
    """(peak held / peak live, driver allocations per pass) of the idealised pool on `events`.

    With `marker_interval` (ns), the pool knows another stream's progress only as a driver
    would tell it: through markers (events) it records on a stream at a free, at most one per
    stream per interval, each known done once the trace's progress passed it; `stats`, a dict,
    then gets the count of markers recorded ("markers"). With `wait_fallback`, a request no
    usable block serves takes the smallest block large enough behind a wait for the streams
    that freed it, before a growth; `stats` gets the count of such waits ("waits").
    """
    chunks = []
    where = {}
    reached = {}
    held = live = peak_held = peak_live = 0
    per_pass = []
    span = (events[-1][4] + 1) if events else 0
    # Per stream: the markers recorded and not yet known done (oldest first), the latest known
    # done, and when the last was recorded.
    pending = {}
    known = {}
    last_marker = {}
    markers = 0
    # (waiting stream, stream waited for) -> the time up to which the first was made to wait
    # for the second's work.
    ordered = {}
    waits = 0

    def progress_of(s):
        """How far stream `s`'s work is known to have got (trace time, ns)."""
        if marker_interval is None:
            return reached.get(s, -1)
        return known.get(s, -1)

    def usable(freed_by, stream):
        """Whether a free block that `freed_by` freed may serve `stream` now."""
        return all(
            s == stream
            or (not same_stream_only and max(progress_of(s), ordered.get((stream, s), -1)) >= at)
            for s, at in freed_by.items()
        )

    def smallest(size, accept):
        """(chunk, index, size) of the smallest free block of at least `size` bytes whose
        freeing streams `accept` takes, or None."""
        best = None
        for c in chunks:
            for k, (start, free, freed_by) in enumerate(c.free):
                if free >= size and (best is None or free < best[2]) and accept(freed_by):
                    best = (c, k, free)
        return best

    for p in range(passes):
        grown = 0
        base = p * span
        for action, ptr, nbytes, stream, time, progress in events:
            key = (p, ptr)
            now = base + time
            if progress is not None:
                reached[stream] = max(reached.get(stream, -1), base + progress)
            # A stream's markers are recorded in time order: those its progress passed lead.
            queued = pending.get(stream)
            while queued and queued[0] <= reached.get(stream, -1):
                known[stream] = queued.pop(0)
            if action == "allocate":
                size = -(-nbytes // ALIGNMENT) * ALIGNMENT
                best = smallest(size, lambda freed_by: usable(freed_by, stream))
                # `--same-stream-only` rules out waiting for another stream as much as reading
                # its progress.
                if best is None and wait_fallback and not same_stream_only:
                    best = smallest(size, lambda freed_by: True)
                    if best is not None:
                        c, k, _ = best
                        waits += 1
                        for s in c.free[k][2]:
                            if s != stream:
                                ordered[(stream, s)] = now
                if best is None:
                    for c in [c for c in chunks if c.wholly_free()]:
                        chunks.remove(c)
                        held -= c.size
                    grow = -(-size // GRANULARITY) * GRANULARITY if size > chunk else chunk
                    c = Chunk(grow)
                    chunks.append(c)
                    held += grow
                    grown += 1
                    best = (c, 0, grow)
                c, k, free = best
                start = c.free[k][0]
                if free > size:
                    c.free[k][0] += size
                    c.free[k][1] -= size
                else:
                    del c.free[k]
                where[key] = (c, start, size, nbytes)
                live += nbytes
                peak_live = max(peak_live, live)
                peak_held = max(peak_held, held)
            elif key in where:
                c, start, size, nbytes = where.pop(key)
                live -= nbytes
                c.give(start, size, stream, now)
                if marker_interval is not None and now - last_marker.get(stream, -marker_interval) >= marker_interval:
                    pending.setdefault(stream, []).append(now)
                    last_marker[stream] = now
                    markers += 1
        # What the pass left live goes before the next pass (the program again, its work done).
        for key in [k for k in where if k[0] == p]:
            c, start, size, nbytes = where.pop(key)
            live -= nbytes
            c.give(start, size)
        for s in reached:
            reached[s] = base + span
            known[s] = base + span
            pending[s] = []
        per_pass.append(grown)
    if stats is not None:
        stats["markers"] = markers
        stats["waits"] = waits
    return (peak_held / peak_live if peak_live else 0.0), per_pass


def parse_size(text):
    """Bytes of a size given as `128MiB`, `2GiB`, `512KiB` or a plain count."""
    units = {"KiB": 1 << 10, "MiB": MIB, "GiB": 1 << 30}
    for unit, scale in units.items():
        if text.endswith(unit):
            return int(text[: -len(unit)]) * scale
    return int(text)


def main():
    """Prints the model's figures for each log named on the command line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--chunk", default="128MiB", help="growth and chunk size (default 128MiB, pool's)")
    ap.add_argument("--passes", type=int, default=1)
    ap.add_argument("--same-stream-only", action="store_true",
                    help="a block another stream freed never serves a stream")
    ap.add_argument("--marker-interval", type=float, metavar="MS",
                    help="know other streams' progress only through markers recorded at frees, "
                    "at most one per stream per MS milliseconds")
    ap.add_argument("--wait-fallback", action="store_true",
                    help="before a growth, take the smallest block large enough behind a wait "
                    "for the streams that freed it")
    args = ap.parse_args()
    chunk = parse_size(args.chunk)
    interval = None if args.marker_interval is None else int(args.marker_interval * 1e6)
    for path in args.logs:
        stats = {}
        ratio, per_pass = model(load(path), chunk, args.passes, args.same_stream_only, interval, stats,
                                args.wait_fallback)
        name = path.rsplit("/", 1)[-1].split(".")[0]
        markers = f", markers recorded {stats['markers']}" if interval is not None else ""
        if args.wait_fallback:
            markers += f", waits {stats['waits']}"
        print(f"{name}: chunk {chunk // MIB} MiB, held/live {ratio:.3f}, driver allocations per pass {per_pass}{markers}")


if __name__ == "__main__":
    main()
