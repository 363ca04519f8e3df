"""CuPy's allocator over emm: ``cupy.cuda.set_allocator(emm.cupy.allocator)``.

Every CuPy allocation then comes from the process's emm runtime, on CuPy's current device
and on CuPy's current stream (``cupy.cuda.get_current_stream()``), as CuPy's own pool does:
the memory is freed on that stream when CuPy drops it, and the manager reuses it elsewhere
only once that stream's work is done (``emm.context(d).stream_ordering()`` says how). Under
a manager that does not allocate on streams (a plugin), emm allocates without a stream, and
work on a stream that uses the memory must be complete before CuPy drops it. A CuPy stream
must outlive the memory allocated on it.

CUDA graphs: a stream capture (``Stream.begin_capture`` ... ``end_capture``) is served from a
graph pool of its own, found by asking the driver at each allocation whether the stream is
being captured: the graph's memory, reused by that capture alone, kept for its launches.
``release_graph_pools()`` gives the memory of ended captures back once their graphs are gone.
"""

import cupy

from . import context


# Each device's context and whether its manager allocates on streams, looked up once: the
# process runtime is configured once and keeps its contexts, and a manager's stream ordering
# does not change.
_contexts = {}


def allocator(size):
    """Allocates ``size`` bytes for CuPy: a ``cupy.cuda.MemoryPointer`` that keeps the emm
    buffer alive until CuPy lets go of it (0 bytes: a null pointer, no allocation)."""
    device = cupy.cuda.runtime.getDevice()
    if size == 0:
        return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(0, 0, None, device), 0)
    entry = _contexts.get(device)
    if entry is None:
        ctx = context(device)
        entry = _contexts[device] = (ctx, ctx.stream_ordering() != "unsupported")
    ctx, on_streams = entry
    if on_streams:
        buf = ctx.memalloc_on(size, cupy.cuda.get_current_stream().ptr)
    else:
        buf = ctx.memalloc(size)
    mem = cupy.cuda.UnownedMemory(buf.ptr, size, buf, device)
    return cupy.cuda.MemoryPointer(mem, 0)


def install():
    """Makes emm CuPy's allocator (``cupy.cuda.set_allocator(allocator)``); captures get
    graph pools (see the module's text) unless ``EMM_CAPTURE_POOLS=0``."""
    import os

    from . import enable_capture_pools

    if os.environ.get("EMM_CAPTURE_POOLS", "1") != "0":
        enable_capture_pools()
    cupy.cuda.set_allocator(allocator)


def release_graph_pools():
    """Lets go of the graph pools of captures that ended (see the module's text); returns
    how many."""
    from . import release_capture_pools

    return release_capture_pools()
