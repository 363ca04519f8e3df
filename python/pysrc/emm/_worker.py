"""What ``emm.dask`` and ``emm.ray`` do in each worker process: install emm for the frameworks
it can import, and read emm's figures."""

import importlib.util
import os

import emm

#: The frameworks emm installs itself for.
FRAMEWORKS = ("torch", "cupy", "numba")


def install(framework):
    """Installs emm for ``framework`` if this process can import it; whether it did. PyTorch's
    and CuPy's allocators are replaced at once (before their first allocation); Numba reads its
    memory manager when its CUDA driver starts, from ``NUMBA_CUDA_MEMORY_MANAGER``."""
    if framework not in FRAMEWORKS:
        raise ValueError(
            f"emm installs itself for {', '.join(FRAMEWORKS)}; {framework!r} is not one of them"
        )
    if importlib.util.find_spec(framework) is None:
        return False
    if framework == "numba":
        os.environ["NUMBA_CUDA_MEMORY_MANAGER"] = "emm.numba"
    elif framework == "torch":
        import emm.torch

        emm.torch.install()
    else:
        import emm.cupy

        emm.cupy.install()
    return True


def figures():
    """emm's figures in this process: the manager, device memory live, its peak, held, the most
    held, the largest free block, out-of-memory retries and failures. Figures a configuration
    cannot give are ``None`` (live and peak need the ``stats`` adaptor; held, the pools)."""
    ctx = emm.context(0)
    usage = ctx.usage()
    device = usage["device"] if usage else None
    pool = ctx.pool_stats()["device"]
    events = ctx.allocation_events()
    return {
        "manager": ctx.manager,
        "live_bytes": device["current_bytes"] if device else None,
        "peak_live_bytes": device["peak_bytes"] if device else None,
        "held_bytes": pool["held_bytes"] if pool else None,
        "peak_held_bytes": pool["peak_held_bytes"] if pool else None,
        "largest_free_bytes": pool["largest_free_bytes"] if pool else None,
        "oom_retries": events["retries"],
        "ooms": events["ooms"],
    }
