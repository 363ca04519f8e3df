"""CuPy's allocator over emm: ``cupy.cuda.set_allocator(emm.cupy.allocator)``.

Every CuPy allocation then comes from the process's emm runtime, on CuPy's current device.
Streams are not passed through yet: emm allocates in the order of the legacy default stream
and does not keep blocks per stream as CuPy's own pool does, so work on another stream that
uses memory must be complete before CuPy drops it.
"""

import cupy

from . import context


def allocator(size):
    """Allocates ``size`` bytes for CuPy: a ``cupy.cuda.MemoryPointer`` that keeps the emm
    buffer alive until CuPy lets go of it (0 bytes: a null pointer, no allocation)."""
    device = cupy.cuda.runtime.getDevice()
    if size == 0:
        return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(0, 0, None, device), 0)
    buf = context(device).memalloc(size)
    mem = cupy.cuda.UnownedMemory(buf.ptr, size, buf, device)
    return cupy.cuda.MemoryPointer(mem, 0)


def install():
    """Makes emm CuPy's allocator (``cupy.cuda.set_allocator(allocator)``)."""
    cupy.cuda.set_allocator(allocator)
