"""CuPy's allocator over emm: ``emm.cupy.install()``.

``install()`` gives CuPy two C functions of emm's extension (``emm_cupy_malloc``,
``emm_cupy_free``) through its ``cupy.cuda.memory.CFunctionAllocator``, so no Python runs
when CuPy allocates or frees; ``install(c_functions=False)`` gives it ``allocator``, the same
in Python (``cupy.cuda.set_allocator(emm.cupy.allocator)``). Every CuPy allocation then
comes from the process's emm runtime, on CuPy's current device
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

from . import _emm, context


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
        buf = ctx.memalloc_on(size, cupy.cuda.get_current_stream())
    else:
        buf = ctx.memalloc(size)
    mem = cupy.cuda.UnownedMemory(buf.ptr, size, buf, device)
    return cupy.cuda.MemoryPointer(mem, 0)


def c_allocator():
    """CuPy's ``CFunctionAllocator`` over emm's C functions. They read CuPy's current stream
    through the C function CuPy's ``cupy.cuda.stream`` module exports; a CuPy whose export is
    missing or of another signature is refused with a message naming ``c_functions=False``."""
    stream_module = getattr(cupy.cuda, "stream", None)
    capsule = getattr(stream_module, "__pyx_capi__", {}).get("get_current_stream_ptr")
    factory = getattr(getattr(cupy.cuda, "memory", None), "CFunctionAllocator", None)
    if capsule is None or factory is None:
        raise RuntimeError(
            "this CuPy exports no get_current_stream_ptr or CFunctionAllocator, which emm.cupy's "
            "C allocator needs; use emm.cupy.install(c_functions=False), the Python allocator"
        )
    malloc, free = _emm.cupy_c_functions(capsule)
    return factory(0, malloc, free, _emm)


_installed = None


def install(c_functions=True):
    """Makes emm CuPy's allocator: emm's C functions (``c_allocator()``), or with
    ``c_functions=False`` the Python ``allocator``. Captures get graph pools (see the module's
    text) unless ``EMM_CAPTURE_POOLS=0``."""
    import os

    from . import enable_capture_pools

    global _installed
    if os.environ.get("EMM_CAPTURE_POOLS", "1") != "0":
        enable_capture_pools()
    if c_functions:
        _installed = c_allocator()
        cupy.cuda.set_allocator(_installed.malloc)
    else:
        _installed = allocator
        cupy.cuda.set_allocator(allocator)
    _route_default_pool()


class DefaultPoolOverEmm:
    """What ``cupy.get_default_memory_pool()`` returns once ``install()`` ran: CuPy's own pool
    (no longer allocated from) answering in emm's words where a program asks what the pool
    holds or to empty it: ``free_all_blocks()`` gives emm's unused memory back
    (:func:`free_all_blocks`), ``used_bytes()`` and ``total_bytes()`` read emm's figures. Every
    other attribute is CuPy's pool's."""

    def __init__(self, pool):
        self._pool = pool

    def free_all_blocks(self, stream=None):
        """CuPy's pool's ``free_all_blocks``, then emm's (:func:`free_all_blocks`)."""
        self._pool.free_all_blocks(stream=stream)
        free_all_blocks()

    def used_bytes(self):
        """Bytes CuPy holds from emm on the current device (:func:`used_bytes`)."""
        return used_bytes()

    def total_bytes(self):
        """Bytes emm's manager holds for the current device (:func:`total_bytes`)."""
        return total_bytes()

    def __getattr__(self, name):
        return getattr(self._pool, name)


_framework_default_pool = None


def _route_default_pool():
    """Points ``cupy.get_default_memory_pool`` at a view of CuPy's pool that empties emm
    (:class:`DefaultPoolOverEmm`); once per process. A reference to CuPy's pool taken before
    ``install()`` stays CuPy's alone."""
    global _framework_default_pool
    if _framework_default_pool is not None or not hasattr(cupy, "get_default_memory_pool"):
        # Routed already, or a CuPy without a default pool: nothing to answer for.
        return
    _framework_default_pool = cupy.get_default_memory_pool
    view = DefaultPoolOverEmm(_framework_default_pool())

    def get_default_memory_pool():
        """CuPy's default pool, as emm's :class:`DefaultPoolOverEmm` sees it."""
        return view

    cupy.get_default_memory_pool = get_default_memory_pool


def used_bytes(device=None):
    """Bytes CuPy holds from emm on ``device`` (CuPy's current one by default), as CuPy's
    ``MemoryPool.used_bytes``; counted for the C allocator ``install()`` gives."""
    if _installed is allocator:
        raise RuntimeError(
            "used_bytes counts the C allocator's memory; under install(c_functions=False) read "
            "emm.context(device).usage() (EMM_MEMORY_ADAPTORS=stats)"
        )
    if device is None:
        device = cupy.cuda.runtime.getDevice()
    return _emm.cupy_usage(device)["used_bytes"]


def total_bytes(device=None):
    """Bytes emm's manager holds from the driver for ``device``, for every user of emm, as
    CuPy's ``MemoryPool.total_bytes`` (the bytes in use, under a manager without a pool)."""
    if device is None:
        device = cupy.cuda.runtime.getDevice()
    pool = context(device).pool_stats()["device"]
    return pool["held_bytes"] if pool is not None else used_bytes(device)


def free_all_blocks():
    """Gives what emm holds unused back to the driver, as CuPy's
    ``MemoryPool.free_all_blocks``: the graph pools of ended captures whose memory is free,
    then every device context's pool. Returns the bytes the trims released."""
    from . import device_count

    release_graph_pools()
    return sum(context(d).trim() for d in range(device_count()))


def release_graph_pools():
    """Lets go of the graph pools of captures that ended (see the module's text); returns
    how many."""
    from . import release_capture_pools

    return release_capture_pools()
