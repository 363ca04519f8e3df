"""PyTorch's allocator over emm: ``emm.torch.install()`` before the first CUDA tensor.

It is a ``torch.cuda.memory.CUDAPluggableAllocator`` over two C functions that emm's extension
library exports (``emm_torch_malloc``, ``emm_torch_free``), so PyTorch calls emm without going
through Python. PyTorch passes its current stream: emm allocates on it where the manager
allocates on streams (``emm.context(d).stream_ordering()``), and frees on it. A failed
allocation makes PyTorch raise its out-of-memory error; ``last_error()`` gives emm's message. A free of a pointer emm did not hand out, or with a size
that does not match, is printed and kept for ``last_error()``.
"""

import torch

from . import _emm


def allocator():
    """The pluggable allocator object."""
    return torch.cuda.memory.CUDAPluggableAllocator(
        _emm.__file__, "emm_torch_malloc", "emm_torch_free"
    )


def install():
    """Makes emm PyTorch's CUDA allocator; PyTorch allows this only before it allocates."""
    torch.cuda.memory.change_current_allocator(allocator())


def last_error():
    """The message of the last failed allocator call (``None`` if none), cleared by reading."""
    return _emm.torch_last_error()


def live():
    """How many allocations PyTorch holds from emm now."""
    return _emm.torch_live()
