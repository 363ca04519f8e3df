"""Stream-ordered alloc + free pairs from Python, in one process: cuda.core's own memory
resources (device, pinned, managed), emm's resources of the same kinds (`ctx.*_memory_resource`)
and emm's `pool` manager on a stream (`ctx.memalloc_on`), and the raw driver pair
(`cuMemAllocFromPoolAsync` + `cuMemFreeAsync` through cuda.bindings, on cuda.core's pool).
Every pair is on one created stream; the figure is the median of five batches, in ns per
pair, with the stream synchronised at the end of each batch.

    python3 bench_resources.py          # one JSON line per (path, size), then a table

Needs a GPU and cuda-core (with cuda-bindings); the emm wheel on the path.
"""

import json
import os
import statistics
import sys
import time

SIZES = [256, 64 << 10, 1 << 20, 16 << 20]
PAIRS = 2000
BATCHES = 5


def cuda_core():
    """cuda.core's module: the stable name first, the experimental one of older releases."""
    try:
        import cuda.core as core

        core.Device  # noqa: B018 - the stable namespace has it from 0.4 on
        return core
    except (ImportError, AttributeError):
        import cuda.core.experimental as core

        return core


def timed(pair, stream_sync, n):
    """Median ns per pair over BATCHES batches of `n` pairs (one warm-up batch first)."""
    for _ in range(n // 10 + 1):
        pair()
    stream_sync()
    per = []
    for _ in range(BATCHES):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            pair()
        stream_sync()
        per.append((time.perf_counter_ns() - t0) / n)
    return statistics.median(per)


def main():
    core = cuda_core()
    from cuda.bindings import driver as cu

    import emm

    dev = core.Device(0)
    dev.set_current()
    stream = dev.create_stream()
    handle = int(stream.handle)
    sync = stream.sync

    def check(result):
        err, *rest = result
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"driver call failed: {err}")
        return rest[0] if rest else None

    rows = []

    def record(path, size, ns):
        row = {"path": path, "size": size, "ns_per_pair": round(ns, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)

    def skipped(path, why):
        row = {"path": path, "skipped": why}
        rows.append(row)
        print(json.dumps(row), flush=True)

    # cuda.core's resources, each over a pool it creates (options given), and the raw pair on
    # the device resource's own pool.
    makers = {
        "device": lambda: core.DeviceMemoryResource(
            dev, options=core.DeviceMemoryResourceOptions()
        ),
        "pinned": lambda: core.PinnedMemoryResource(),
        "managed": lambda: core.ManagedMemoryResource(),
    }
    core_mrs = {}
    for kind, make in makers.items():
        try:
            core_mrs[kind] = make()
        except Exception as e:  # a resource this driver or release lacks: say which
            skipped(f"cuda.core {kind}", f"{type(e).__name__}: {e}")
    ctx = emm.context(0)
    emm_mrs = {}
    for kind, make in {
        "device": lambda: ctx.device_memory_resource(),
        "pinned": lambda: ctx.pinned_memory_resource(),
        "managed": lambda: ctx.managed_memory_resource(),
    }.items():
        try:
            emm_mrs[kind] = make()
        except Exception as e:
            skipped(f"emm {kind}", f"{type(e).__name__}: {e}")

    for size in SIZES:
        if "device" in core_mrs:
            pool = core_mrs["device"].handle

            def raw_pair(size=size, pool=pool):
                ptr = check(cu.cuMemAllocFromPoolAsync(size, pool, stream.handle))
                check(cu.cuMemFreeAsync(ptr, stream.handle))

            record("raw driver pool (cuda.bindings)", size, timed(raw_pair, sync, PAIRS))
        for kind, mr in core_mrs.items():

            def core_pair(mr=mr, size=size):
                buf = mr.allocate(size, stream=stream)
                buf.close(stream)

            record(f"cuda.core {kind}", size, timed(core_pair, sync, PAIRS))
        for kind, mr in emm_mrs.items():

            def emm_pair(mr=mr, size=size):
                buf = mr.allocate(size, handle)
                mr.deallocate(buf, handle)

            record(f"emm {kind} resource", size, timed(emm_pair, sync, PAIRS))

            def emm_drop(mr=mr, size=size):
                mr.allocate(size, handle)

            record(f"emm {kind} resource (freed by drop)", size, timed(emm_drop, sync, PAIRS))

        def emm_on(size=size):
            ctx.memalloc_on(size, handle)

        manager = os.environ.get("EMM_MEMORY_MANAGER", "default")
        record(f"emm memalloc_on ({manager})", size, timed(emm_on, sync, PAIRS))

    for mr in list(core_mrs.values()):
        mr.close()
    for mr in list(emm_mrs.values()):
        mr.close()
    sizes = sorted({r["size"] for r in rows if "size" in r})
    paths = []
    for r in rows:
        if "size" in r and r["path"] not in paths:
            paths.append(r["path"])
    print("\n| path | " + " | ".join(f"{s} B" for s in sizes) + " |")
    print("| --- |" + " --- |" * len(sizes))
    for p in paths:
        cells = [
            next((f"{r['ns_per_pair']:.0f}" for r in rows if r.get("path") == p and r["size"] == s), "")
            for s in sizes
        ]
        print(f"| {p} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
