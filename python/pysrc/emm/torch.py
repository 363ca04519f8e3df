"""PyTorch's allocator over emm: ``emm.torch.install()`` before the first CUDA tensor.

It is a ``torch.cuda.memory.CUDAPluggableAllocator`` over two C functions that emm's extension
library exports (``emm_torch_malloc``, ``emm_torch_free``), so PyTorch calls emm without going
through Python. PyTorch passes its current stream: emm allocates on it where the manager
allocates on streams (``emm.context(d).stream_ordering()``), and frees on it. A failed
allocation makes PyTorch raise its out-of-memory error; ``last_error()`` gives emm's message. A free of a pointer emm did not hand out, or with a size
that does not match, is printed and kept for ``last_error()``.

CUDA graphs: ``torch.cuda.graph`` captures work. PyTorch does not tell a pluggable allocator
that a capture begins, so emm asks the driver at each allocation whether PyTorch's stream is
being captured, and serves a capture from a graph pool of its own: the graph's memory, reused
by that capture alone, kept for its replays. Call ``release_graph_pools()`` after deleting (or
``reset()``-ing) graphs to give their memory back. ``torch.compile(mode="reduce-overhead")``
needs PyTorch's own allocator (its CUDA-graph trees ask the allocator about its pools, which a
pluggable allocator cannot answer): ``use_mem_pool()`` is the route for it.
"""

import contextlib
import os

import torch

from . import _emm


def allocator():
    """The pluggable allocator object."""
    return torch.cuda.memory.CUDAPluggableAllocator(
        _emm.__file__, "emm_torch_malloc", "emm_torch_free"
    )


def install():
    """Makes emm PyTorch's CUDA allocator; PyTorch allows this only before it allocates.
    Captures get graph pools (see the module's text); ``EMM_CAPTURE_POOLS=0`` leaves them off,
    saving the driver query each allocation makes, for programs that never capture."""
    if os.environ.get("EMM_CAPTURE_POOLS", "1") != "0":
        _emm.enable_capture_pools()
    torch.cuda.memory.change_current_allocator(allocator())


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
            pool = _mem_pools[device] = torch.cuda.MemPool(allocator().allocator())
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
