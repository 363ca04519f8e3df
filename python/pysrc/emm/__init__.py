"""emm: Numba's External Memory Management design, in Rust, for Python runtimes.

One emm runtime per process serves everything: Numba (``emm.numba``), CuPy (``emm.cupy``)
and PyTorch (``emm.torch``) allocate from the same manager, and their memory shows in one
``usage()``.

The runtime is made at first use from the environment (``EMM_MEMORY_MANAGER``,
``EMM_MEMORY_ADAPTORS``, ``EMM_PINNED_HOST_POOL``; ``EMM_PYTHON_DRIVER=sim`` for emm's
simulated GPU), or explicitly, once, before the first allocation::

    import emm
    rt = emm.Runtime(manager="pool", adaptors="stats")   # or driver="sim": no GPU needed
    ctx = rt.context(0)
    buf = ctx.memalloc(1 << 20)
"""

import atexit as _atexit

from ._emm import (
    Context,
    DeviceBuffer,
    EmmError,
    ExternalStream,
    HostBuffer,
    Ipc,
    ManagedBuffer,
    OutOfMemoryError,
    Snapshot,
    configure,
    context,
    device_count,
    enable_capture_pools,
    release_capture_pools,
    settings,
    tag,
)

from ._emm import flush_logs as _flush_logs
from ._emm import ledger_forget as _ledger_forget
from ._emm import ledger_publish as _ledger_publish

# The process's runtime is never dropped: the log adaptor's buffered lines are written out at
# exit.
_atexit.register(_flush_logs)
# Nor does the device ledger's thread end before exit: this process's records go then.
_atexit.register(_ledger_forget)

__all__ = [
    "Context",
    "DeviceBuffer",
    "EmmError",
    "ExternalStream",
    "HostBuffer",
    "Ipc",
    "ManagedBuffer",
    "OutOfMemoryError",
    "Runtime",
    "Snapshot",
    "configure",
    "context",
    "device_count",
    "device_report",
    "enable_capture_pools",
    "release_capture_pools",
    "settings",
    "sleep",
    "tag",
    "wake",
]


class Runtime:
    """The process's emm runtime.

    ``manager``: a manager name (``default``, ``pool``, ``vmm-pool``, ``async-pool``,
    ``async-pool-ipc``, or one registered by the host runtime); ``adaptors``: a list as
    ``EMM_MEMORY_ADAPTORS`` takes (``"stats,limit=8GiB"``); ``driver``: ``"cuda"`` or ``"sim"``;
    ``sim_memory``: the simulated device's size for ``"sim"`` (bytes or ``"80GiB"``; 1 GiB when
    left out; only pages written take host memory, so an H100's size replays full-size traces).
    Values left out come from the environment. The runtime is made once per process: a second ``Runtime(...)`` with the same
    settings is the same runtime; with others it raises ``emm.EmmError``.
    """

    def __init__(self, manager=None, adaptors=None, driver="cuda", sim_memory=None):
        configure(manager=manager, adaptors=adaptors, driver=driver, sim_memory=sim_memory)

    def context(self, device=0):
        """Device ``device``'s context."""
        return context(device)

    def device_count(self):
        """How many devices the runtime sees."""
        return device_count()

    def settings(self):
        """``manager``, ``adaptors``, ``driver`` and ``sim_memory`` of the runtime."""
        return settings()

    def usage(self, device=0):
        """What the ``stats`` adaptor counted on ``device`` (``None`` without it)."""
        return context(device).usage()

    def pool_stats(self, device=0):
        """What the manager's pools hold on ``device``."""
        return context(device).pool_stats()

    def trim(self, device=0):
        """Gives what the manager holds back on ``device`` to the driver; returns bytes."""
        return context(device).trim()

    def defer_cleanup(self, device=0):
        """A context manager deferring frees on ``device`` while it is active."""
        return context(device).defer_cleanup()


def sleep(offload=(), discard=(), keep=(), default="offload", device=0, keep_host_buffer=False):
    """Puts device ``device``'s memory to sleep (``Context.sleep``; ``vmm-pool`` only): the
    physical memory goes back to the driver, every address stays valid for :func:`wake`.
    ``offload``, ``discard`` and ``keep`` list tags (``with emm.tag(name):``): an allocation
    made under a tag in ``offload`` is copied to page-locked host memory and back at the wake,
    one in ``discard`` loses its contents, one in ``keep`` stays mapped; the rest get
    ``default``. Choices by tag need ``EMM_MEMORY_ADAPTORS=history``. ``keep_host_buffer``
    keeps the offload's page-locked buffer for the next sleep. Returns a dict of what was held
    before and while asleep and the bytes each choice moved."""
    return context(device).sleep(
        offload=offload, discard=discard, keep=keep, default=default,
        keep_host_buffer=keep_host_buffer,
    )


def wake(device=0):
    """Wakes device ``device``'s memory (:func:`sleep`): mapped again at the same addresses, the
    offloaded allocations copied back. Returns a dict of what was mapped and restored."""
    return context(device).wake()


def device_report(device=0):
    """The emm processes that use device ``device`` (this one included), with what each holds,
    the most held first: a list of dicts (``pid``, ``program``, ``device``, ``manager``,
    ``live_bytes``, ``peak_live_bytes``, ``held_bytes``, ``peak_held_bytes``, ``ooms``,
    ``updated``: the Unix time the process last wrote them). Each emm process writes its
    figures to a ledger every ``EMM_LEDGER_SECONDS`` (default 2) in ``EMM_LEDGER_DIR``
    (default ``/dev/shm/emm-ledger``); ``EMM_LEDGER=0`` leaves a process out. Figures a
    configuration cannot give are ``None`` (live bytes need the ``stats`` adaptor, held bytes a
    pool). Records of processes that have ended are removed as they are found."""
    import json
    import os

    context(device)
    directory = _ledger_publish(device)
    rows = []
    for name in os.listdir(directory):
        if not name.endswith(".json") or name.startswith("."):
            continue
        path = os.path.join(directory, name)
        try:
            pid = int(name[: -len(".json")])
            os.kill(pid, 0)
        except ValueError:
            continue
        except ProcessLookupError:
            try:
                os.remove(path)
            except OSError:
                pass
            continue
        except PermissionError:
            pass  # another user's process: alive
        try:
            with open(path, encoding="utf-8") as f:
                rows.append(json.load(f))
        except (OSError, ValueError):
            continue  # being replaced, or removed meanwhile
    return sorted(rows, key=lambda r: (-(r["held_bytes"] or r["live_bytes"] or 0), r["pid"]))

