"""emm.torch's two C functions (``emm_torch_malloc``, ``emm_torch_free``, what PyTorch's
pluggable allocator calls) timed from a C loop (cloop.c's ``cloop_torch_pairs``), without
PyTorch: emm's own cost per pair behind PyTorch's interface. With ``EMM_TORCH_FLOOR`` (the
floor of python/bench/torch_floor.c, on a GPU), the same loop over its two functions: the
driver's stream-ordered pool alone. One JSON line: the medians of five batches, in ns a pair,
on stream 0 (the legacy default stream, where a PyTorch program that makes no stream of its own
allocates).

    cc -O2 -shared -fPIC -o libcloop.so cloop.c
    EMM_BENCH_CLOOP=libcloop.so [EMM_TORCH_FLOOR=libtorch_floor.so] python3 torch_c_loop.py

Runs on the GPU, or on emm's simulated driver (``EMM_PYTHON_DRIVER=sim``), where a cached pair
makes no driver call and the figure is emm's alone.
"""
import ctypes
import json
import os
import statistics

import emm
from emm import _emm

PAIRS = 200_000
loop = ctypes.PyDLL(os.environ["EMM_BENCH_CLOOP"])  # PyDLL: the GIL stays held, as in PyTorch's calls
loop.cloop_torch_pairs.restype = ctypes.c_double
loop.cloop_torch_pairs.argtypes = [ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_long,
                                   ctypes.c_size_t]
lib = ctypes.CDLL(_emm.__file__)
addr = lambda f: ctypes.cast(f, ctypes.c_void_p).value
functions = {"emm": (addr(lib.emm_torch_malloc), addr(lib.emm_torch_free))}
if os.environ.get("EMM_TORCH_FLOOR"):
    floor = ctypes.CDLL(os.environ["EMM_TORCH_FLOOR"])
    functions["floor"] = (addr(floor.floor_malloc), addr(floor.floor_free))

ctx = emm.context(0)
out = {"manager": ctx.manager, "driver": os.environ.get("EMM_PYTHON_DRIVER", "cuda"), "pairs": PAIRS}
for name, (m, f) in functions.items():
    for size in (256, 1 << 20):
        loop.cloop_torch_pairs(m, f, size, PAIRS // 10, 0)  # warm up
        runs = [loop.cloop_torch_pairs(m, f, size, PAIRS, 0) for _ in range(5)]
        assert min(runs) > 0, f"{name}: a malloc returned null ({_emm.torch_last_error()})"
        out[f"{name}_{size}"] = round(statistics.median(runs), 1)
print(json.dumps(out), flush=True)
