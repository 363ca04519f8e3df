"""Pairs of emm.cupy's C allocator functions, called as CuPy calls them (GIL held, through
ctypes), with no GPU and no CuPy: for callgrind, which counts a pair's instructions however
noisy the machine. The difference between two runs is the cost of the pairs:

    for n in 0 20000; do EMM_PYTHON_DRIVER=sim EMM_MEMORY_MANAGER=pool \
        valgrind --tool=callgrind --callgrind-out-file=cg.$n python3 cupy_c_pairs.py $n; done

(instructions of the second run less the first's, over 20 000). ctypes' own call costs most of
it and stays the same between builds: compare builds, not the figure with CuPy's pair.
The stream is the legacy stream: CuPy's current-stream function is stood in for by one that
returns 0 (geteuid, as root).
"""
import ctypes
import os
import sys

from emm import _emm

if os.geteuid() != 0:
    sys.exit("cupy_c_pairs.py stands geteuid in for CuPy's current-stream function, which must "
             "return 0 (the legacy stream): run it as root")
n = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
size = int(sys.argv[2]) if len(sys.argv) > 2 else 256
libc = ctypes.CDLL(None)
# CuPy's current-stream function: one of no arguments that returns 0 (the legacy stream) as root.
getter = ctypes.cast(libc.geteuid, ctypes.c_void_p).value
PyCapsule_New = ctypes.pythonapi.PyCapsule_New
PyCapsule_New.restype = ctypes.py_object
PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
cap = PyCapsule_New(getter, b"intptr_t (void)", None)
# As emm.cupy.install() does: allocations on a stream under capture get graph pools.
_emm.enable_capture_pools()
malloc_addr, free_addr = _emm.cupy_c_functions(cap)
MALLOC = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)(malloc_addr)
FREE = ctypes.PYFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)(free_addr)
for _ in range(1000):
    FREE(None, MALLOC(None, size, 0), 0)
for _ in range(n):
    FREE(None, MALLOC(None, size, 0), 0)
print("pairs", n, "size", size, "manager", os.environ.get("EMM_MEMORY_MANAGER"))
