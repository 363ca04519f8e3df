"""What the recording scripts share: arguments, seeds, and a result line.

Each script runs one workload. With ``--allocator emm`` its framework allocates from emm
(``emm.torch``, ``emm.cupy``, ``emm.numba``), and the ``log`` adaptor, set by the caller with
``EMM_MEMORY_ADAPTORS=log=<file>``, records every allocation and free: that file is the trace.
With ``--allocator native`` the framework's own allocator runs the same workload, so its memory
figures and results can be compared. With ``--allocator emm-mempool`` (PyTorch only) PyTorch's
own caching allocator runs in front of emm: every thread allocates in ``emm.torch.mem_pool()``
(``emm.torch.use_mem_pool()``), whose segments come from emm. With ``--allocator floor`` (PyTorch
only) a pluggable allocator of two C functions that call the driver's stream-ordered pool and
nothing else (``python/bench/torch_floor.c``, built as a shared library named by
``EMM_TORCH_FLOOR``) runs it: what PyTorch's pluggable interface costs by itself, with no
memory figures (PyTorch keeps none for a pluggable allocator). Each script prints one JSON line
last, prefixed ``RESULT``: the workload's result (losses, checksums), step times, and memory
figures.
"""

import argparse
import json
import random
import statistics
import sys
import time


def parser(description, steps):
    """An argument parser with the options every script takes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=steps, help="steps (default %(default)s)")
    p.add_argument("--allocator", choices=["emm", "emm-mempool", "native", "floor"], default="emm")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run of shapes")
    p.add_argument("--seed", type=int, default=0)
    return p


def rng(seed):
    """The workload's own random numbers (shapes per step), apart from the frameworks'."""
    return random.Random(seed)


class Timer:
    """Wall times of steps; the median leaves out the first few (compilation, warm-up)."""

    def __init__(self, warmup=5):
        self.times = []
        self.warmup = warmup
        self.start = None

    def begin(self):
        self.start = time.perf_counter()

    def end(self):
        self.times.append(time.perf_counter() - self.start)

    def median_ms(self):
        kept = self.times[self.warmup:] or self.times
        return 1000 * statistics.median(kept) if kept else None

    def total_s(self):
        return sum(self.times)


_ROUTE = None


def install(framework, args):
    """Makes emm the framework's allocator (``torch`` or ``cupy``) when ``--allocator emm`` runs
    on the GPU."""
    if args.allocator == "native" or args.device != "cuda":
        return
    if args.allocator == "floor":
        import os

        path = os.environ.get("EMM_TORCH_FLOOR")
        if framework != "torch" or not path:
            fail("--allocator floor is PyTorch's, and needs EMM_TORCH_FLOOR: the path of "
                 "python/bench/torch_floor.c built as a shared library (the command is in it)")
        import torch

        torch.cuda.memory.change_current_allocator(
            torch.cuda.memory.CUDAPluggableAllocator(path, "floor_malloc", "floor_free"))
        return
    if args.allocator == "emm-mempool":
        if framework != "torch":
            fail("--allocator emm-mempool is PyTorch's route only")
        import emm.torch

        # Entered for the whole run and kept referenced (a context manager collected as
        # garbage would end the routing): the process ends with the workload.
        global _ROUTE
        _ROUTE = emm.torch.use_mem_pool()
        _ROUTE.__enter__()
        return
    if framework == "torch":
        import emm.torch

        emm.torch.install()
    else:
        import emm.cupy

        emm.cupy.install()


class DeviceUse:
    """Device memory the driver counts as used (``cudaMemGetInfo``), beyond what it counted
    when made, read when asked: the peak of the readings."""

    def __init__(self, torch, args):
        self.torch = torch if args.device == "cuda" else None
        self.base = self.used()
        self.peak = 0

    def used(self):
        if self.torch is None:
            return 0
        free, total = self.torch.cuda.mem_get_info()
        return total - free

    def read(self):
        self.peak = max(self.peak, self.used() - self.base)


def train(opt, loss, losses):
    """One optimiser step on ``loss``, whose value joins ``losses``."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    losses.append(loss.item())


def torch_figures(torch, args, use=None):
    """PyTorch's peaks under its own allocator, emm's figures under emm (none on the CPU), and
    the peak device memory used that ``use`` read (after every step)."""
    if args.device != "cuda":
        return {}
    torch.cuda.synchronize()
    if args.allocator == "floor":
        out = {}
    elif args.allocator == "native":
        out = {
            "max_allocated": torch.cuda.max_memory_allocated(),
            "max_reserved": torch.cuda.max_memory_reserved(),
        }
    elif args.allocator == "emm-mempool":
        # PyTorch's figures are whole-device; emm's say how much of the reserve came through
        # emm (all but CUDA graphs' private pools).
        out = {
            "max_allocated": torch.cuda.max_memory_allocated(),
            "max_reserved": torch.cuda.max_memory_reserved(),
            **emm_figures(),
        }
    else:
        out = emm_figures()
    if use is not None:
        out["peak_used_per_step"] = use.peak
    return out


def counters(torch, args):
    """What the allocator did so far, under PyTorch's allocator or emm's: allocations served,
    live bytes now and at their peak, bytes held from the driver now and at their peak, driver
    allocations and frees, the bytes given back to the driver, and under emm the waits its pool
    made, on the GPU for another stream's work and on the host (``{}`` on the CPU, and under
    the floor allocator, of which PyTorch counts nothing)."""
    if args.device != "cuda" or args.allocator == "floor":
        return {}
    if args.allocator == "native":
        st = torch.cuda.memory_stats()
        return {
            "allocations": st.get("allocation.all.allocated", 0),
            "live_bytes": st.get("allocated_bytes.all.current", 0),
            "peak_live_bytes": st.get("allocated_bytes.all.peak", 0),
            "held_bytes": st.get("reserved_bytes.all.current", 0),
            "peak_held_bytes": st.get("reserved_bytes.all.peak", 0),
            "driver_allocations": st.get("num_device_alloc", 0),
            "driver_frees": st.get("num_device_free", 0),
            "given_back_bytes": st.get("reserved_bytes.all.freed", 0),
        }
    import emm
    import emm.torch

    st = emm.torch.memory_stats()
    pool = emm.context(0).pool_stats()["device"] or {}
    return {
        "allocations": st["allocation.all.allocated"],
        "live_bytes": st["allocated_bytes.all.current"],
        "peak_live_bytes": st["allocated_bytes.all.peak"],
        "held_bytes": pool.get("held_bytes", 0),
        "peak_held_bytes": pool.get("peak_held_bytes", 0),
        "driver_allocations": pool.get("driver_allocations", 0),
        "driver_frees": pool.get("driver_frees", 0),
        "given_back_bytes": pool.get("trimmed_bytes", 0),
        "stream_waits": pool.get("stream_waits", 0),
        "host_waits": pool.get("host_waits", 0),
    }


class Counters:
    """The allocator's counters at the end of warm-up and at the end of the run, for the
    result line: driver calls per allocation after warm-up come from their difference."""

    def __init__(self, torch, args):
        self.torch, self.args = torch, args
        self.warm = None

    def warmed(self):
        """Call once the warm-up steps are done (after a synchronisation)."""
        if self.args.device == "cuda":
            self.torch.cuda.synchronize()
        self.warm = counters(self.torch, self.args)

    def fields(self):
        if self.args.device == "cuda":
            self.torch.cuda.synchronize()
        return {"counters": counters(self.torch, self.args), "counters_warm": self.warm}


def warmup_steps(steps):
    """The steps a program counts as warm-up: a tenth of the run, at least 3."""
    return max(3, steps // 10)


def finish(workload, args, timer, memory, **fields):
    """Prints the result line of a run of ``--steps`` steps timed by ``timer``."""
    report(
        workload=workload,
        allocator=args.allocator,
        steps=args.steps,
        step_ms_median=timer.median_ms(),
        total_s=timer.total_s(),
        memory=memory,
        **fields,
    )


def emm_figures():
    """What emm says of device 0: its manager, pool figures and usage (``stats`` adaptor)."""
    import emm

    ctx = emm.context(0)
    out = {"manager": ctx.manager, "pool": ctx.pool_stats()}
    try:
        out["usage"] = ctx.usage()
    except Exception as e:  # the stats adaptor is optional
        out["usage_error"] = repr(e)
    return out


def report(**fields):
    """Prints the result line."""
    print("RESULT " + json.dumps(fields, default=str), flush=True)


def fail(message):
    print("RESULT " + json.dumps({"error": message}), flush=True)
    sys.exit(1)
