"""CuPy's own pool against emm.cupy's C functions in one process, batch by batch: the two
allocators are switched with ``cupy.cuda.set_allocator`` before every batch, so both see the
same phase of the host. bench_alloc.py runs each configuration in a process of its own, and
the host's fast and slow phases then differ between the processes by up to 2 x, more than
the figure compared.

Each round times one batch of each allocator at each size (the order of the allocators
alternates between rounds); the result is one JSON line: per allocator and size, the median
over the rounds in µs a pair, and the median of the rounds' ratios (emm.cupy over CuPy's
pool, each ratio from one round, so from one phase of the host). With EMM_BENCH_CFLOOR set
(cfloor.c built as in its text), CuPy's C allocator interface over functions that do nothing
is timed in the same rounds: the part of emm.cupy's pair that is CuPy's own.

    EMM_MEMORY_MANAGER=pool python3 cupy_ab.py [ROUNDS]

Needs a GPU and CuPy.
"""

import json
import os
import statistics
import sys
import time

import cupy

import emm.cupy
from bench_alloc import BATCH, SIZES, cfloor_allocator

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 15


def pair(n):
    m = cupy.cuda.alloc(n)
    del m


def main():
    os.environ.setdefault("EMM_MEMORY_MANAGER", "pool")
    allocators = {"cupy": cupy.get_default_memory_pool().malloc}
    emm.cupy.install()  # as a user does: capture pools on, the C functions installed
    allocators["cupy-emm"] = emm.cupy._installed.malloc
    if os.environ.get("EMM_BENCH_CFLOOR"):
        allocators["cupy-cfloor"] = cfloor_allocator(cupy).malloc
    # A kernel first, as any CuPy program runs one (see bench_alloc.py).
    assert int((cupy.arange(16) + 1).sum()) == 136
    times = {name: {n: [] for n in SIZES} for name in allocators}
    names = list(allocators)
    for r in range(ROUNDS):
        order = names if r % 2 == 0 else names[::-1]
        for n in SIZES:
            count = BATCH[n]
            for name in order:
                cupy.cuda.set_allocator(allocators[name])
                for _ in range(count // 10):  # the pools fill
                    pair(n)
                t0 = time.perf_counter()
                for _ in range(count):
                    pair(n)
                times[name][n].append((time.perf_counter() - t0) / count * 1e6)
    cupy.cuda.set_allocator(allocators["cupy-emm"])
    out = {"manager": os.environ["EMM_MEMORY_MANAGER"], "rounds": ROUNDS}
    for name in names:
        out[name] = {str(n): round(statistics.median(times[name][n]), 3) for n in SIZES}
    # Each round's ratio, from batches timed one after the other in one phase of the host.
    ratios = {n: [e / c for e, c in zip(times["cupy-emm"][n], times["cupy"][n])] for n in SIZES}
    out["ratio"] = {str(n): round(statistics.median(r), 3) for n, r in ratios.items()}
    out["ratio_range"] = {str(n): [round(min(r), 3), round(max(r), 3)] for n, r in ratios.items()}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
