"""Python-level allocate + free pairs through Numba, CuPy and PyTorch: each framework's own
allocator, RMM's pool allocators, and emm's (manager from EMM_MEMORY_MANAGER, `pool` by
default; for PyTorch both routes: `emm.torch.install()` and PyTorch's allocator over
`emm.torch.mem_pool()`), plus emm's own share (emm.context().memalloc from Python). One process per
configuration, as the allocators are chosen before first use; the medians of five batches.

    python3 bench_alloc.py            # every configuration, one JSON line each
    python3 bench_alloc.py CONFIG     # one configuration (what the driver runs per process)

Needs a GPU; RMM (rmm-cu13) for its configurations.
"""

import json
import os
import statistics
import subprocess
import sys
import time

SIZES = [256, 1 << 20, 64 << 20, 1 << 30]
BATCH = {256: 2000, 1 << 20: 2000, 64 << 20: 500, 1 << 30: 200}
# Pairs before the timed batches at every size (default: a tenth of the size's batch).
WARMUP = int(os.environ.get("BENCH_WARMUP", "0"))
CONFIGS = [
    "numba", "numba-rmm", "numba-emm",
    "cupy", "cupy-rmm", "cupy-emm", "cupy-emm-py", "cupy-cfloor",
    "torch", "torch-rmm", "torch-emm", "torch-emm-mempool",
    "emm",
]


def rmm_pool():
    import rmm

    rmm.reinitialize(pool_allocator=True, initial_pool_size=4 << 30)


_ROUTE = None
_FLOOR = None
_FLOOR_ALLOCATOR = None


def cfloor_allocator(cupy):
    """CuPy's CFunctionAllocator over cfloor.c's functions, which hand back one device
    allocation of the largest size and free nothing: what CuPy's own side of a C allocator
    costs, the floor under emm.cupy's pair. The library's path is in EMM_BENCH_CFLOOR (build it
    with the command in cfloor.c)."""
    import ctypes

    path = os.environ.get("EMM_BENCH_CFLOOR")
    if not path:
        raise SystemExit("cupy-cfloor needs EMM_BENCH_CFLOOR, the path of cfloor.c built as a shared library")
    global _FLOOR
    lib = ctypes.CDLL(path)
    base = cupy.cuda.runtime.malloc(max(SIZES))
    _FLOOR = (lib, base)  # kept for the process: the allocator hands out this allocation
    addr = lambda f: ctypes.cast(f, ctypes.c_void_p).value
    return cupy.cuda.memory.CFunctionAllocator(base, addr(lib.cfloor_malloc), addr(lib.cfloor_free), lib)


def setup(config):
    """Returns pair(size): one allocation and its free, through the configuration's path."""
    if config.endswith("-rmm"):
        rmm_pool()
    if config.startswith("numba"):
        if config == "numba-rmm":
            os.environ["NUMBA_CUDA_MEMORY_MANAGER"] = "rmm.allocators.numba"
        elif config == "numba-emm":
            os.environ["NUMBA_CUDA_MEMORY_MANAGER"] = "emm.numba"
        import numpy as np
        from numba import cuda

        cuda.device_array(1, dtype=np.uint8)

        def pair(n):
            a = cuda.device_array(n, dtype=np.uint8)
            del a

        return pair
    if config.startswith("cupy"):
        import cupy

        if config == "cupy-rmm":
            from rmm.allocators.cupy import rmm_cupy_allocator

            cupy.cuda.set_allocator(rmm_cupy_allocator)
        elif config == "cupy-emm":
            import emm.cupy

            emm.cupy.install()
        elif config == "cupy-emm-py":
            import emm.cupy

            emm.cupy.install(c_functions=False)
        elif config == "cupy-cfloor":
            global _FLOOR_ALLOCATOR
            _FLOOR_ALLOCATOR = cfloor_allocator(cupy)
            cupy.cuda.set_allocator(_FLOOR_ALLOCATOR.malloc)
        # A kernel first, as any CuPy program runs one: without it, emm.cupy's pairs measured
        # 3.5 to 7.4 µs (H100, 2026-11-23), against 2.2 µs after a kernel, and 0.9 µs in a
        # process whose CuPy pool had allocated first: a state of the process, not of emm.
        assert int((cupy.arange(16) + 1).sum()) == 136

        def pair(n):
            m = cupy.cuda.alloc(n)
            del m

        return pair
    if config.startswith("torch"):
        import torch

        if config == "torch-rmm":
            from rmm.allocators.torch import rmm_torch_allocator

            torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
        elif config == "torch-emm":
            import emm.torch

            emm.torch.install()
        elif config == "torch-emm-mempool":
            import emm.torch

            # PyTorch's caching allocator in front, its segments from emm, for the whole run
            # (the context manager kept referenced: collected, it would end the routing).
            global _ROUTE
            _ROUTE = emm.torch.use_mem_pool()
            _ROUTE.__enter__()
        assert int((torch.arange(16, device="cuda") + 1).sum()) == 136  # a kernel first

        def pair(n):
            t = torch.empty(n, dtype=torch.uint8, device="cuda")
            del t

        return pair
    if config == "emm":
        import emm

        ctx = emm.context(0)

        def pair(n):
            b = ctx.memalloc(n)
            del b

        return pair
    raise SystemExit("unknown configuration " + config)


def measure(config):
    pair = setup(config)
    out = {"config": config, "manager": os.environ.get("EMM_MEMORY_MANAGER", "pool")}
    for n in SIZES:
        count = BATCH[n]
        for _ in range(WARMUP or count // 10):  # warm up: the pools fill
            pair(n)
        batches = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(count):
                pair(n)
            batches.append((time.perf_counter() - t0) / count * 1e6)
        out[str(n)] = round(statistics.median(batches), 3)
    print(json.dumps(out), flush=True)


def main():
    # `pool` unless the environment names a manager, whether one configuration runs here or
    # every one in a process of its own (the runtime reads it when first used).
    os.environ.setdefault("EMM_MEMORY_MANAGER", "pool")
    if len(sys.argv) > 1:
        measure(sys.argv[1])
        return
    env = dict(os.environ)
    for config in CONFIGS:
        if config == "cupy-cfloor" and not env.get("EMM_BENCH_CFLOOR"):
            print(json.dumps({"config": config, "skipped": "EMM_BENCH_CFLOOR is not set (see cfloor.c)"}), flush=True)
            continue
        r = subprocess.run(
            [sys.executable, __file__, config], env=env, capture_output=True, text=True, timeout=120
        )
        line = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
        if r.returncode != 0 or not line.startswith("{"):
            print(json.dumps({"config": config, "error": r.stderr.strip().splitlines()[-3:]}), flush=True)
        else:
            print(line, flush=True)


if __name__ == "__main__":
    main()
