"""PyTorch's allocator over emm: ``emm.torch.install()`` before the first CUDA tensor.

It is a ``torch.cuda.memory.CUDAPluggableAllocator`` over two C functions that emm's extension
library exports (``emm_torch_malloc``, ``emm_torch_free``), so PyTorch calls emm without going
through Python. PyTorch passes its current stream: emm allocates on it where the manager
allocates on streams (``emm.context(d).stream_ordering()``), and frees on it. A failed
allocation raises a ``RuntimeError`` with emm's message (not ``torch.OutOfMemoryError``:
a pluggable allocator cannot raise PyTorch's own type); ``last_error()`` gives the message.
A free of a pointer emm did not hand out, or with a size that does not match, is printed and
kept for ``last_error()``.

CUDA graphs: ``torch.cuda.graph`` captures work. PyTorch does not tell a pluggable allocator
that a capture begins, so emm asks the driver at each allocation whether PyTorch's stream is
being captured, and serves a capture from a graph pool of its own: the graph's memory, reused
by that capture alone, kept for its replays. Call ``release_graph_pools()`` after deleting (or
``reset()``-ing) graphs to give their memory back. ``torch.compile(mode="reduce-overhead")``
needs PyTorch's own allocator (its CUDA-graph trees ask the allocator about its pools, which a
pluggable allocator cannot answer): ``use_mem_pool()`` is the route for it.
"""

import contextlib
import ctypes
import os
import warnings

import torch

from . import _emm


def allocator():
    """The pluggable allocator object of ``install()``: a failed allocation raises a
    ``RuntimeError`` with emm's message (PyTorch's pluggable allocator would otherwise take
    a null pointer for memory). Its record-stream hook is emm's where PyTorch has one to set
    (:func:`record_stream_hooked`)."""
    made = torch.cuda.memory.CUDAPluggableAllocator(
        _emm.__file__, "emm_torch_malloc", "emm_torch_free"
    )
    _hook_record_stream(made)
    return made


_record_stream_hooked = False


def _hook_record_stream(made):
    """Sets the record-stream hook of the pluggable allocator ``made`` to emm's, so that every
    ``recordStream`` PyTorch makes reaches emm, from ``Tensor.record_stream`` and from its C++
    alike (PyTorch's Python class does not set it). Whether this PyTorch has the hook."""
    global _record_stream_hooked
    setter = getattr(made.allocator(), "set_record_stream_fn", None)
    if setter is None:
        return False
    hook = ctypes.CDLL(_emm.__file__).emm_torch_record_stream
    setter(ctypes.cast(hook, ctypes.c_void_p).value)
    _record_stream_hooked = True
    return True


def record_stream_hooked():
    """Whether ``recordStream`` reaches emm through PyTorch's pluggable allocator (its
    record-stream hook, set by :func:`allocator`), from Python and C++ callers alike. Where
    this PyTorch lacks the hook, ``install()`` wraps ``Tensor.record_stream`` instead, which
    C++ callers do not pass through."""
    return _record_stream_hooked


def _pool_allocator():
    """The allocator object behind ``mem_pool()``: a failure returns null, which PyTorch's
    caching allocator handles (it frees its cache, retries, then raises
    ``torch.OutOfMemoryError``)."""
    return torch.cuda.memory.CUDAPluggableAllocator(
        _emm.__file__, "emm_torch_pool_malloc", "emm_torch_free"
    )


def install():
    """Makes emm PyTorch's CUDA allocator; PyTorch allows this only before it allocates.
    Captures get graph pools (see the module's text); ``EMM_CAPTURE_POOLS=0`` leaves them off,
    saving the driver query each allocation makes, for programs that never capture.

    ``torch.cuda.empty_cache()`` then gives back what emm holds unused too (PyTorch's
    pluggable allocator does nothing on it): ``install()`` wraps ``torch.cuda.empty_cache``
    and ``torch.cuda.memory.empty_cache`` so that they call PyTorch's own and then
    :func:`empty_cache`. Code that took a reference to the function before ``install()``
    (``from torch.cuda import empty_cache``) keeps PyTorch's alone.

    ``recordStream`` is honoured too: emm records the stream on the tensor's allocation,
    whose free then waits for the work queued on that stream. The allocator's record-stream
    hook is emm's (PyTorch's Python class leaves it unset), so ``Tensor.record_stream`` and the
    calls PyTorch makes from C++ both reach emm. A PyTorch without the hook gets
    ``Tensor.record_stream`` wrapped instead, with a warning that C++ callers do not reach
    emm (:func:`record_stream_hooked` says which)."""
    if os.environ.get("EMM_CAPTURE_POOLS", "1") != "0":
        _emm.enable_capture_pools()
    torch.cuda.memory.change_current_allocator(allocator())
    _route_empty_cache()
    if not _record_stream_hooked:
        warnings.warn(
            "this PyTorch's pluggable allocator has no record-stream hook "
            "(set_record_stream_fn): emm wraps Tensor.record_stream, but record_stream calls "
            "PyTorch makes from C++ do not reach emm; synchronise a tensor's other streams "
            "before it is freed, or use a PyTorch that has the hook",
            RuntimeWarning,
            stacklevel=2,
        )
        _route_record_stream()


_framework_record_stream = None


def _route_record_stream():
    """Points ``torch.Tensor.record_stream`` at a function that calls PyTorch's own, then
    records the stream on the emm allocation under the tensor's storage; once per process."""
    global _framework_record_stream
    if _framework_record_stream is not None:
        return
    _framework_record_stream = torch.Tensor.record_stream

    def record_stream(self, stream):
        """PyTorch's ``record_stream``, then emm's: the memory under this tensor is not
        reused after its free until the work queued on ``stream`` so far is done."""
        _framework_record_stream(self, stream)
        if self.is_cuda:
            ptr = self.untyped_storage().data_ptr()
            if ptr:
                _emm.torch_record_stream(ptr, _emm.ExternalStream(stream.cuda_stream, stream))

    record_stream.__wrapped__ = _framework_record_stream
    torch.Tensor.record_stream = record_stream


_framework_empty_cache = None


def _route_empty_cache():
    """Points ``torch.cuda.empty_cache`` (and ``torch.cuda.memory.empty_cache``) at a function
    that calls PyTorch's own, then emm's :func:`empty_cache`; once per process."""
    global _framework_empty_cache
    if _framework_empty_cache is not None:
        return
    _framework_empty_cache = torch.cuda.memory.empty_cache

    def empty_cache_through_emm():
        """PyTorch's ``empty_cache``, then emm's (``emm.torch.empty_cache``): what emm's
        managers hold unused goes back to the driver."""
        _framework_empty_cache()
        empty_cache()

    empty_cache_through_emm.__wrapped__ = _framework_empty_cache
    torch.cuda.memory.empty_cache = empty_cache_through_emm
    torch.cuda.empty_cache = empty_cache_through_emm


def release_graph_pools():
    """Lets go of the graph pools of captures that ended: their memory goes back to emm's
    manager once the graphs' tensors are freed. Call it after the graphs are deleted or reset.
    Returns how many pools were let go."""
    return _emm.release_capture_pools()


_mem_pools = {}


def mem_pool(device=None):
    """A ``torch.cuda.MemPool`` whose segments come from emm (one per device, made once), for
    PyTorch's own caching allocator: under ``with torch.cuda.use_mem_pool(emm.torch.mem_pool()):``
    the current thread's allocations are PyTorch's (its statistics, graph pools and
    ``torch.compile(mode="reduce-overhead")`` work), and the memory they sit in is emm's. Use
    it instead of ``install()``, which makes PyTorch's allocator emm's itself: a MemPool needs
    PyTorch's own allocator to be the current one. Allocations outside the ``with`` block, and
    on other threads (autograd's backward), come from PyTorch's ``cudaMalloc``, not emm:
    ``use_mem_pool()`` routes every thread."""
    if device is None:
        device = torch.cuda.current_device()
    pool = _mem_pools.get(device)
    if pool is None:
        if not hasattr(torch.cuda, "MemPool"):
            raise RuntimeError(
                "this PyTorch has no torch.cuda.MemPool (PyTorch 2.5 or newer has it); use "
                "emm.torch.install() instead"
            )
        with torch.cuda.device(device):
            pool = _mem_pools[device] = torch.cuda.MemPool(_pool_allocator().allocator())
    return pool


@contextlib.contextmanager
def use_mem_pool(device=None):
    """Routes every allocation PyTorch's caching allocator makes on ``device`` (the current
    one by default), from every thread, autograd's backward included, to ``mem_pool(device)``
    while the ``with`` block runs; yields the pool. PyTorch's statistics, CUDA graphs (their
    private pools take segments from ``cudaMalloc``) and ``torch.compile(mode="reduce-overhead")``
    work as under PyTorch's own allocator. ``torch.cuda.use_mem_pool`` routes only the calling
    thread; this uses the all-streams form PyTorch keeps for itself
    (``torch._C._cuda_beginAllocateToPool``), and raises if this PyTorch lacks it."""
    if device is None:
        device = torch.cuda.current_device()
    device = torch.cuda._utils._get_device_index(device)
    begin = getattr(torch._C, "_cuda_beginAllocateToPool", None)
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if begin is None or end is None:
        raise RuntimeError(
            "this PyTorch cannot route every thread's allocations to a pool "
            "(torch._C._cuda_beginAllocateToPool is missing); use "
            "torch.cuda.use_mem_pool(emm.torch.mem_pool()) for the calling thread's, or "
            "emm.torch.install()"
        )
    pool = mem_pool(device)
    begin(device, pool.id)
    try:
        yield pool
    finally:
        end(device, pool.id)


def last_error():
    """The message of the last failed allocator call (``None`` if none), cleared by reading."""
    return _emm.torch_last_error()


def live():
    """How many allocations PyTorch holds from emm now."""
    return _emm.torch_live()


# PyTorch's memory statistics over emm. Under a pluggable allocator PyTorch refuses
# torch.cuda.memory_stats() and its kin ("does not yet support getDeviceStats"); these answer
# with the same keys and meanings, from what emm counted of PyTorch's allocations and what its
# manager holds. Under use_mem_pool() PyTorch's own functions work and are the ones to call.


def _device_index(device):
    if device is None:
        return torch.cuda.current_device()
    return torch.cuda._utils._get_device_index(device, optional=True)


def memory_stats(device=None):
    """``torch.cuda.memory_stats()`` for PyTorch's allocations from emm on ``device``: a dict
    with PyTorch's keys. ``allocated_bytes`` / ``active_bytes`` / ``requested_bytes`` (emm has
    no split blocks: all three are the tensors' bytes) and ``allocation`` / ``active`` (counts),
    each ``.all.current``, ``.all.peak``, ``.all.allocated`` and ``.all.freed``;
    ``reserved_bytes.all.current`` and ``.peak``: what emm's manager holds from the driver for
    the device (the allocated bytes, for a manager without a pool), for every user of emm, not
    PyTorch alone; ``num_alloc_retries`` (allocations emm retried after freeing memory) and
    ``num_ooms`` (PyTorch's allocations that failed for lack of memory)."""
    import emm

    device = _device_index(device)
    c = _emm.torch_counters(device)
    ctx = emm.context(device)
    pool = ctx.pool_stats()["device"]
    events = ctx.allocation_events()
    out = {}
    for name in ("allocated_bytes", "active_bytes", "requested_bytes"):
        out[f"{name}.all.current"] = c["current_bytes"]
        out[f"{name}.all.peak"] = c["peak_bytes"]
        out[f"{name}.all.allocated"] = c["allocated_bytes"]
        out[f"{name}.all.freed"] = c["freed_bytes"]
    for name in ("allocation", "active"):
        out[f"{name}.all.current"] = c["current_count"]
        out[f"{name}.all.peak"] = c["peak_count"]
        out[f"{name}.all.allocated"] = c["allocated_count"]
        out[f"{name}.all.freed"] = c["freed_count"]
    if pool is not None:
        out["reserved_bytes.all.current"] = pool["held_bytes"]
        out["reserved_bytes.all.peak"] = pool["peak_held_bytes"]
        out["segment.all.current"] = pool["chunks"]
    else:
        out["reserved_bytes.all.current"] = c["current_bytes"]
        out["reserved_bytes.all.peak"] = c["peak_bytes"]
    out["num_alloc_retries"] = events["retries"]
    out["num_ooms"] = c["ooms"]
    return dict(sorted(out.items()))


def memory_allocated(device=None):
    """Bytes of PyTorch's tensors emm holds on ``device`` now (``torch.cuda.memory_allocated``)."""
    return memory_stats(device)["allocated_bytes.all.current"]


def max_memory_allocated(device=None):
    """The peak of ``memory_allocated`` since the start or ``reset_peak_memory_stats``."""
    return memory_stats(device)["allocated_bytes.all.peak"]


def memory_reserved(device=None):
    """Bytes emm's manager holds from the driver for ``device`` (``torch.cuda.memory_reserved``)."""
    return memory_stats(device)["reserved_bytes.all.current"]


def max_memory_reserved(device=None):
    """The most bytes emm's manager has held for ``device`` since its context was made
    (``reset_peak_memory_stats`` does not reset it: the manager keeps one peak for all users)."""
    return memory_stats(device)["reserved_bytes.all.peak"]


def reset_peak_memory_stats(device=None):
    """Sets the allocated peaks (bytes and counts) of ``device`` to what is allocated now."""
    _emm.torch_reset_peaks(_device_index(device))


def empty_cache():
    """Gives what emm's managers hold unused back to the driver: the graph pools of ended
    captures whose memory is free, then every device context's pool (``ctx.trim()``).
    Returns the bytes the trims released."""
    import emm

    release_graph_pools()
    return sum(emm.context(d).trim() for d in range(emm.device_count()))


def sleep(offload=(), discard=(), keep=(), default="offload", device=None, keep_host_buffer=False):
    """Puts the device's memory to sleep under ``vmm-pool`` (``emm.sleep``, for PyTorch): waits
    for PyTorch's work on the device, then gives the physical memory back while every tensor's
    address stays valid. Tensors allocated inside ``with emm.tag(name):`` follow the choice
    their tag is listed under (``offload``: copied to host memory and back at the wake;
    ``discard``: contents lost; ``keep``: stays mapped); the rest get ``default``. Until
    :func:`wake`, no tensor may be allocated or touched on the device, except those kept.
    ``keep_host_buffer`` keeps the offload's page-locked buffer for the next sleep. Returns
    what was held before and during, and what each choice moved."""
    import emm

    # The sleep waits for the device (cuCtxSynchronize), PyTorch's streams included.
    return emm.sleep(
        offload=offload, discard=discard, keep=keep, default=default,
        device=_device_index(device), keep_host_buffer=keep_host_buffer,
    )


def wake(device=None):
    """Wakes the device's memory (:func:`sleep`): every tensor is usable again, the offloaded
    ones with their contents."""
    import emm

    return emm.wake(device=_device_index(device))


def memory_summary(device=None):
    """A few lines, as ``torch.cuda.memory_summary`` gives: PyTorch's allocations from emm on
    ``device`` (now, peak, in all, freed), what emm's manager holds, and the out-of-memory
    counts."""
    import emm

    device = _device_index(device)
    st = memory_stats(device)
    ctx = emm.context(device)

    def mib(n):
        return f"{n / 2**20:,.1f} MiB"

    rows = [
        ("", "now", "peak", "in all", "freed"),
        ("allocated", mib(st["allocated_bytes.all.current"]), mib(st["allocated_bytes.all.peak"]),
         mib(st["allocated_bytes.all.allocated"]), mib(st["allocated_bytes.all.freed"])),
        ("allocations", str(st["allocation.all.current"]), str(st["allocation.all.peak"]),
         str(st["allocation.all.allocated"]), str(st["allocation.all.freed"])),
        ("reserved", mib(st["reserved_bytes.all.current"]), mib(st["reserved_bytes.all.peak"]),
         "", ""),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = [f"emm memory summary, device {device}, manager {ctx.manager}"]
    lines += ["  " + "  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows]
    lines.append(f"  retries after out of memory: {st['num_alloc_retries']}; "
                 f"failed for lack of memory: {st['num_ooms']}")
    return "\n".join(lines)


def memory_snapshot(device=None):
    """The drop-in for ``torch.cuda.memory._snapshot()`` under emm: device ``device``'s
    segments and blocks in PyTorch's snapshot format (a dict with ``segments`` and
    ``device_traces``), which ``torch.cuda._memory_viz`` reads. The blocks carry tags (PyTorch's
    are ``torch``) and the trace the last events when the runtime has the ``history``
    adaptor (``EMM_MEMORY_ADAPTORS=history``; ``history-stacks`` adds each allocation's
    stack)."""
    import emm

    return emm.context(_device_index(device)).snapshot().to_torch()


def dump_snapshot(path, device=None):
    """Writes :func:`memory_snapshot` to ``path`` as a pickle, the file PyTorch's memory_viz
    page opens (as ``torch.cuda.memory._dump_snapshot`` does)."""
    import emm

    emm.context(_device_index(device)).snapshot().dump_torch(path)
