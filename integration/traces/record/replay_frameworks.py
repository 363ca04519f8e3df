"""Replays allocation traces through another framework's allocator on the GPU and prints the
memory it held: the peak of the device memory the driver counts as used (total - free, read
after every allocation) over what the process had used before, against the trace's peak live
bytes. One process per allocator (PyTorch reads its allocator settings once, at start):

    python3 replay_frameworks.py --allocator torch TRACE.csv.gz [...]

Allocators: ``torch`` (PyTorch's caching allocator, default settings), ``torch-expandable``
(``expandable_segments:True``), ``cupy`` (CuPy's memory pool), ``rmm-pool`` (RMM's pool,
initial size 0), ``rmm-arena`` (RMM's arena, its default size), ``rmm-async`` (RMM's resource
over the driver's stream-ordered pool). Streams other than the legacy default one get a stream
of the framework's own each. Every allocator frees everything it cached between traces.
"""

import argparse
import gzip
import json
import os
import sys
import time

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--allocator", required=True)
p.add_argument("traces", nargs="+")
args = p.parse_args()
if args.allocator == "torch-expandable":
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"

from cuda.bindings import runtime as cudart  # noqa: E402


def used():
    err, free, total = cudart.cudaMemGetInfo()
    assert int(err) == 0, err
    return total - free


def read(path):
    opener = gzip.open if path.endswith(".gz") else open
    events = []
    with opener(path, "rt") as f:
        cols = None
        for line in f:
            fields = [x.strip() for x in line.rstrip("\n").split(",")]
            if cols is None and ("Action" in fields or fields[0] == "Thread"):
                cols = {name.lower(): i for i, name in enumerate(fields)}
                continue
            if not line.strip():
                continue
            c = cols or {"action": 2, "pointer": 3, "size": 4, "stream": 5}
            action = fields[c["action"]].lower()
            kind = fields[c["kind"]].lower() if "kind" in c else "device"
            if kind != "device" or action not in ("allocate", "free"):
                continue
            stream = fields[c["stream"]] if "stream" in c else "0"
            stream = None if stream in ("", "-") else int(stream, 16)
            events.append((action == "allocate", int(fields[c["pointer"]], 16), int(fields[c["size"]]), stream))
    return events


class Torch:
    def __init__(self):
        import torch

        self.torch = torch
        torch.cuda.init()
        torch.empty(1, device="cuda")  # the context and the allocator's state
        self.streams = {}

    def stream(self, s):
        if s in (None, 0, 1):
            return self.torch.cuda.default_stream()
        if s not in self.streams:
            self.streams[s] = self.torch.cuda.Stream()
        return self.streams[s]

    def alloc(self, size, s):
        return self.torch.cuda.caching_allocator_alloc(size, 0, self.stream(s))

    def free(self, ptr):
        self.torch.cuda.caching_allocator_delete(ptr)

    def done(self):
        self.torch.cuda.synchronize()
        extra = {"max_reserved": self.torch.cuda.max_memory_reserved()}
        self.torch.cuda.empty_cache()
        self.torch.cuda.reset_peak_memory_stats()
        return extra


class Cupy:
    def __init__(self):
        import cupy

        self.cupy = cupy
        self.pool = cupy.cuda.MemoryPool()
        cupy.cuda.Device(0).use()
        self.streams = {}

    def alloc(self, size, s):
        if s in (None, 0, 1):
            return self.pool.malloc(size)
        if s not in self.streams:
            self.streams[s] = self.cupy.cuda.Stream(non_blocking=True)
        with self.streams[s]:
            return self.pool.malloc(size)

    def free(self, mem):
        del mem

    def done(self):
        self.cupy.cuda.Device().synchronize()
        extra = {"total_bytes": self.pool.total_bytes()}
        self.pool.free_all_blocks()
        return extra


class Rmm:
    def __init__(self, kind):
        import rmm

        self.rmm = rmm
        self.kind = kind
        # Made at a trace's first allocation, after its baseline was read: the arena reserves
        # its memory when it is made.
        self.mr = None
        self.streams = {}

    def make(self):
        mr = self.rmm.mr
        if self.kind == "rmm-pool":
            return mr.PoolMemoryResource(mr.CudaMemoryResource(), initial_pool_size=0)
        if self.kind == "rmm-arena":
            return mr.ArenaMemoryResource(mr.CudaMemoryResource())
        return mr.CudaAsyncMemoryResource()

    def stream(self, s):
        from rmm.pylibrmm.stream import DEFAULT_STREAM, Stream

        if s in (None, 0, 1):
            return DEFAULT_STREAM
        if s not in self.streams:
            self.streams[s] = Stream()
        return self.streams[s]

    def alloc(self, size, s):
        if self.mr is None:
            self.mr = self.make()
        return self.rmm.DeviceBuffer(size=size, stream=self.stream(s), mr=self.mr)

    def free(self, buf):
        del buf

    def done(self):
        from cuda.bindings import runtime

        runtime.cudaDeviceSynchronize()
        self.mr = None
        import gc

        gc.collect()
        runtime.cudaDeviceSynchronize()
        return {}


def allocator(name):
    if name.startswith("torch"):
        return Torch()
    if name == "cupy":
        return Cupy()
    if name.startswith("rmm"):
        return Rmm(name)
    sys.exit(f"unknown allocator {name}")


a = allocator(args.allocator)
for path in args.traces:
    events = read(path)
    base = used()
    live, live_bytes, peak_live, peak_held = {}, 0, 0, 0
    failures = 0
    start = time.perf_counter()
    for is_alloc, ptr, size, stream in events:
        if is_alloc:
            try:
                live[ptr] = (a.alloc(size, stream), size)
            except Exception as e:  # out of memory: counted, the replay goes on
                failures += 1
                continue
            live_bytes += size
            peak_live = max(peak_live, live_bytes)
            peak_held = max(peak_held, used() - base)
        elif ptr in live:
            mem, size = live.pop(ptr)
            live_bytes -= size
            a.free(mem)
            del mem
    for mem, _ in live.values():
        a.free(mem)
    # No name may keep the last buffer (and through it an RMM resource) alive.
    mem = live = None
    elapsed = time.perf_counter() - start
    held_after = used() - base
    extra = a.done()
    # What the allocator gave back between traces: the next baseline is read after this.
    extra["after_release"] = used() - base
    print(
        "RESULT "
        + json.dumps(
            {
                "trace": os.path.basename(path).split(".")[0],
                "allocator": args.allocator,
                "events": len(events),
                "peak_live": peak_live,
                "peak_held": peak_held,
                "held_over_live": peak_held / max(peak_live, 1),
                "held_after": held_after,
                "failures": failures,
                "seconds": elapsed,
                **extra,
            }
        ),
        flush=True,
    )
