"""emm.cupy's C functions timed from a C loop (cloop.c) on the GPU, beside the same loop over
cfloor.c's functions, which do nothing: emm's own cost per pair, without CuPy's objects or
ctypes around each call; and CuPy's current-stream function alone, which emm's malloc calls.
One JSON line: the medians of five batches, in ns per pair (per call for the stream getter).

    cc -O2 -shared -fPIC -o libcloop.so cloop.c; cc -O2 -shared -fPIC -o libcfloor.so cfloor.c
    EMM_BENCH_CLOOP=libcloop.so EMM_BENCH_CFLOOR=libcfloor.so python3 cupy_c_loop.py

Needs a GPU and CuPy (its current-stream function is the one emm.cupy reads).
"""
import ctypes
import json
import os
import statistics

import cupy

import emm.cupy
from emm import _emm

PAIRS = 200_000
loop = ctypes.PyDLL(os.environ["EMM_BENCH_CLOOP"])  # PyDLL: the GIL stays held
loop.cloop_pairs.restype = ctypes.c_double
loop.cloop_pairs.argtypes = [ctypes.c_ssize_t, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_long]
loop.cloop_calls.restype = ctypes.c_double
loop.cloop_calls.argtypes = [ctypes.c_size_t, ctypes.c_long]
floor = ctypes.CDLL(os.environ["EMM_BENCH_CFLOOR"])
addr = lambda f: ctypes.cast(f, ctypes.c_void_p).value

emm.cupy.install()
assert int((cupy.arange(16) + 1).sum()) == 136  # a kernel first, as bench_alloc.py does
capsule = cupy.cuda.stream.__pyx_capi__["get_current_stream_ptr"]
emm_malloc, emm_free = _emm.cupy_c_functions(capsule)
base = cupy.cuda.runtime.malloc(1 << 20)
out = {"manager": os.environ.get("EMM_MEMORY_MANAGER", "pool"), "pairs": PAIRS}
for name, (param, m, f) in {
    "cfloor": (base, addr(floor.cfloor_malloc), addr(floor.cfloor_free)),
    "emm": (0, emm_malloc, emm_free),
}.items():
    for size in (256, 1 << 20):
        loop.cloop_pairs(param, m, f, size, PAIRS // 10)  # warm up
        runs = [loop.cloop_pairs(param, m, f, size, PAIRS) for _ in range(5)]
        assert min(runs) > 0, f"{name}: a malloc failed"
        out[f"{name}_{size}"] = round(statistics.median(runs), 1)
# The getter's address, as emm reads it from the capsule.
PyCapsule_GetPointer = ctypes.pythonapi.PyCapsule_GetPointer
PyCapsule_GetPointer.restype = ctypes.c_void_p
PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
getter = PyCapsule_GetPointer(capsule, b"intptr_t (void)")
loop.cloop_calls(getter, PAIRS // 10)
out["stream_getter"] = round(statistics.median(loop.cloop_calls(getter, PAIRS) for _ in range(5)), 1)
print(json.dumps(out), flush=True)
