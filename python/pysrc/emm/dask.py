"""emm on Dask workers: one line sets every worker up, and the cluster's memory is one report.

::

    from distributed import Client
    import emm.dask

    client = Client(cluster)
    client.register_plugin(emm.dask.EmmSetup(manager="pool", maximum="20GiB"))
    ...
    emm.dask.memory_report(client).save_html("memory.html")

``EmmSetup`` runs in every worker process (those that join later, and a worker again after it
restarts), before the worker's first CUDA allocation must happen: it makes the process's emm
runtime with the manager and adaptors given, and installs emm for the frameworks the worker can
import (PyTorch's allocator, CuPy's, Numba's memory manager). Each worker then reports emm's
figures in its metrics (``worker.metrics["emm"]``), which reach the scheduler with every
heartbeat, and under the names Dask's dashboard draws its GPU memory panel from
(``worker.metrics["rmm"]``: ``rmm-used`` is device memory in use through emm, ``rmm-total`` what
emm holds from the driver; added to RMM's own figures where RMM is installed too). For ``dask worker`` and ``dask cuda worker``, ``--preload emm.dask`` does the same from
the environment (``EMM_MEMORY_MANAGER``, ``EMM_MEMORY_ADAPTORS``, ``EMM_DASK_MAXIMUM``,
``EMM_DASK_LOG_DIRECTORY``, ``EMM_DASK_FRAMEWORKS``).

dask-cuda's RMM options, and what takes their place here:

========================================  ==========================================================
dask-cuda (``LocalCUDACluster``)          emm (``EmmSetup``)
========================================  ==========================================================
``rmm_pool_size``                         ``manager="pool"`` (or ``"vmm-pool"``): the pool grows as
                                          needed and keeps what it grew; no size to give up front
``rmm_maximum_pool_size``                 ``maximum="20GiB"`` (the ``limit`` adaptor: device bytes
                                          in use through emm, refused past it)
``rmm_managed_memory``                    not applicable: emm's managers allocate device memory;
                                          managed memory is ``ctx.memallocmanaged`` per call
``rmm_async``                             ``manager="async-pool"`` (the driver's stream-ordered
                                          pool)
``rmm_release_threshold``                 not yet: emm's ``async-pool`` trims on ``trim()`` and
                                          out of memory, not at a threshold
``rmm_log_directory``                     ``log_directory=DIR`` (the ``log`` adaptor, one CSV per
                                          worker: ``DIR/emm-<worker name>.csv``)
``rmm_track_allocations``                 ``adaptors="stats"`` (on by default here: the metrics'
                                          live and peak figures) or ``"history"`` (every live
                                          allocation with its tag, for snapshots)
``rmm_allocator_external_lib_list``       ``frameworks=("torch", "cupy", "numba")``: the
                                          frameworks emm is installed for
========================================  ==========================================================

Spilling (``spill=True``): when an allocation runs out of device memory, emm's out-of-memory
callback has the worker evict its oldest results until as many bytes went, then flushes emm's
deferred frees, and the allocation is tried again: under dask-cuda's device-host file, device
objects (CuPy arrays, tensors) move from its device LRU to host memory first; then (and under
distributed's own spill buffer) ``worker.data.evict()`` pickles results to disk. emm's ``DeviceBuffer``
pickles as its bytes (and comes back as a new buffer of the worker's device), and counts its
device bytes in the worker's memory (``dask.sizeof``), so that the worker evicts it like any
result; a worker started with ``memory_limit=0`` keeps no spill buffer and spills nothing.
Without spilling, the allocation fails with emm's out-of-memory error, which the task raises.

The dashboard: ``enable_dashboard_page()``, before the scheduler starts, adds a page
``/emm`` to the scheduler's web server (beside ``/status``): a table of every worker's emm
figures, renewed every two seconds, and ``/emm/figures.json`` with the same figures.
"""

import copyreg
import html
import inspect
import os
import re

from distributed import WorkerPlugin

import emm
from emm._worker import FRAMEWORKS, figures, install

__all__ = [
    "EmmSetup",
    "MemoryReport",
    "dask_setup",
    "enable_dashboard_page",
    "memory_report",
    "rmm_panel_figures",
    "rmm_panel_metric",
    "worker_figures",
]

#: The name of the worker metric emm's figures are reported under.
METRIC = "emm"

#: The worker metric Dask's dashboard draws its RMM / GPU memory panel from.
RMM_PANEL_METRIC = "rmm"


class EmmSetup(WorkerPlugin):
    """Sets emm up in each worker process: the runtime (``manager``, ``adaptors`` as
    ``EMM_MEMORY_ADAPTORS`` takes them, ``maximum`` as the ``limit`` adaptor, ``log_directory``
    for a per-worker log), emm installed for each of ``frameworks`` the worker can import, and
    the ``emm`` metric. ``driver`` is ``"cuda"`` or ``"sim"`` (default: ``EMM_PYTHON_DRIVER``,
    else ``"cuda"``). Values left out come from the worker's environment, as for
    ``emm.configure``. The worker's runtime must not exist yet (no emm allocation before the
    plugin): a runtime made with other settings is refused with ``emm.EmmError``."""

    name = "emm-setup"
    idempotent = True

    def __init__(
        self,
        manager=None,
        adaptors="stats",
        maximum=None,
        log_directory=None,
        frameworks=FRAMEWORKS,
        driver=None,
        spill=False,
    ):
        unknown = [f for f in frameworks if f not in FRAMEWORKS]
        if unknown:
            raise ValueError(
                f"emm installs itself for {', '.join(FRAMEWORKS)}; {unknown} is not one of them"
            )
        self.manager = manager
        self.adaptors = adaptors
        self.maximum = maximum
        self.log_directory = log_directory
        self.frameworks = tuple(frameworks)
        self.driver = driver
        self.spill = spill

    def adaptors_for(self, worker_name):
        """The adaptor list for the worker named ``worker_name``."""
        parts = [a for a in (self.adaptors or "").split(",") if a.strip()]
        if self.maximum is not None:
            parts.append(f"limit={self.maximum}")
        if self.log_directory is not None:
            safe = re.sub(r"[^A-Za-z0-9_.-]", "_", str(worker_name))
            parts.append(f"log={os.path.join(self.log_directory, f'emm-{safe}.csv')}")
        return ",".join(parts) or None

    def setup(self, worker):
        driver = self.driver or os.environ.get("EMM_PYTHON_DRIVER", "cuda")
        sim_memory = os.environ.get("EMM_SIM_DEVICE_MEMORY") if driver == "sim" else None
        if self.log_directory is not None:
            os.makedirs(self.log_directory, exist_ok=True)
        emm.configure(
            manager=self.manager,
            adaptors=self.adaptors_for(worker.name),
            driver=driver,
            sim_memory=sim_memory,
        )
        installed = []
        for framework in self.frameworks:
            if install(framework):
                installed.append(framework)
        worker.metrics[METRIC] = worker_figures
        worker.metrics[RMM_PANEL_METRIC] = rmm_panel_metric(worker.metrics.get(RMM_PANEL_METRIC))
        worker.emm_frameworks = installed
        _make_device_buffers_spillable()
        if self.spill:
            emm.context(0).on_out_of_memory(lambda nbytes: _evict(worker, nbytes))


_SPILLABLE = False


def _make_device_buffers_spillable():
    """Once per process: emm's ``DeviceBuffer`` pickles as its bytes and counts its device
    bytes in ``dask.sizeof``, so that a worker's spill buffer can evict it."""
    global _SPILLABLE
    if _SPILLABLE:
        return
    from dask.sizeof import sizeof

    copyreg.pickle(emm.DeviceBuffer, _reduce_device_buffer)
    sizeof.register(emm.DeviceBuffer)(lambda buf: buf.size)
    _SPILLABLE = True


def _reduce_device_buffer(buf):
    """Pickles a live ``DeviceBuffer`` as its device and bytes."""
    return _restore_device_buffer, (buf.device, emm.context(buf.device).copy_to_host(buf))


def _restore_device_buffer(device, data):
    """A new ``DeviceBuffer`` on ``device`` holding ``data`` (unpickling)."""
    ctx = emm.context(device)
    buf = ctx.memalloc(max(len(data), 1))
    ctx.copy_to_device(buf, data)
    return buf


def _evict_one(data):
    """Evicts one result that holds device memory from a worker's ``data``: its weight, or -1
    when none can go.

    - dask-cuda's ``DeviceHostFile`` keeps device objects (CuPy arrays, tensors: anything with
      ``__cuda_array_interface__``) in a device LRU of its own, whose eviction moves the oldest
      to host memory. Its ``evict()`` moves host results to disk, which frees device memory
      only for emm's ``DeviceBuffer`` (pickled as its bytes), so the device LRU goes first.
    - distributed's ``SpillBuffer``: ``evict()`` pickles the oldest result to disk.
    """
    device = getattr(getattr(data, "device_buffer", None), "fast", None)
    if device is not None and hasattr(device, "evict") and len(device) > 0:
        try:
            _, _, weight = device.evict()
            return weight
        except Exception:  # noqa: BLE001 - as zict's own LRU: a failed eviction evicts nothing
            pass
    evict = getattr(data, "evict", None)
    return evict() if evict is not None else -1


def _evict(worker, nbytes):
    """The out-of-memory callback of a spilling worker: evicts its oldest results until
    ``nbytes`` of them went (by ``dask.sizeof``) or nothing more can go
    (``_evict_one``), then flushes emm's deferred frees; whether anything went (the allocation
    is then tried again)."""
    went = 0
    while went < nbytes:
        weight = _evict_one(worker.data)
        if weight < 0:
            break
        went += max(weight, 1)
    if went:
        emm.context(0).flush()
    return went > 0


def worker_figures(worker=None):
    """emm's figures in this process, the ``emm`` worker metric (``worker`` is what the
    worker passes a metric; unused): see ``emm._worker.figures``."""
    return figures()


def rmm_panel_figures():
    """emm's device figures under the names Dask's RMM panel reads: ``rmm-used``, device memory
    in use through emm (live, with the ``stats`` adaptor; else the pool's in-use bytes), and
    ``rmm-total``, what emm holds from the driver (the pool's held bytes; the memory in use for
    a manager that holds nothing back)."""
    ctx = emm.context(0)
    usage = ctx.usage()
    pool = ctx.pool_stats()["device"]
    if usage:
        used = usage["device"]["current_bytes"]
    else:
        used = pool["in_use_bytes"] if pool else 0
    total = pool["held_bytes"] if pool else used
    return {"rmm-used": used, "rmm-total": max(total, used)}


def rmm_panel_metric(previous=None):
    """The ``rmm`` worker metric: :func:`rmm_panel_figures`, added to ``previous`` (the worker's
    ``rmm`` metric before: RMM's, where RMM is installed) figure by figure. Setting a worker up
    again replaces emm's part rather than adding it twice."""
    previous = getattr(previous, "emm_previous", previous)

    async def metric(worker):
        mine = rmm_panel_figures()
        if previous is None:
            return mine
        theirs = previous(worker)
        if inspect.isawaitable(theirs):
            theirs = await theirs
        return {k: (theirs.get(k) or 0) + v for k, v in mine.items()}

    metric.emm_previous = previous
    return metric


def dask_setup(worker):
    """``--preload emm.dask``: :class:`EmmSetup` from the environment (``EMM_MEMORY_MANAGER``,
    ``EMM_MEMORY_ADAPTORS``, ``EMM_DASK_MAXIMUM``, ``EMM_DASK_LOG_DIRECTORY``,
    ``EMM_DASK_FRAMEWORKS``, a comma-separated list)."""
    frameworks = os.environ.get("EMM_DASK_FRAMEWORKS")
    EmmSetup(
        adaptors=os.environ.get("EMM_MEMORY_ADAPTORS", "stats"),
        maximum=os.environ.get("EMM_DASK_MAXIMUM"),
        log_directory=os.environ.get("EMM_DASK_LOG_DIRECTORY"),
        frameworks=tuple(f for f in frameworks.split(",") if f) if frameworks else FRAMEWORKS,
    ).setup(worker)


def _worker_report():
    """One worker's part of :func:`memory_report` (run in the worker)."""
    ctx = emm.context(0)
    snapshot = ctx.snapshot()
    segments = [
        {"bytes": s["bytes"], "kind": s["kind"], "blocks": [(b["bytes"], b["state"]) for b in s["blocks"]]}
        for s in snapshot.segments()
    ]
    largest = max(
        (b[0] for s in segments for b in s["blocks"] if b[1] == "in-use"), default=0
    )
    return {
        "figures": worker_figures(),
        "segments": segments,
        "by_tag": snapshot.by_tag(),
        "largest_live_block": largest,
    }


class MemoryReport:
    """Every worker's emm figures and memory, gathered by :func:`memory_report`: ``rows`` (one
    dict per worker, its address first), ``table()`` (the same as text), ``to_html()`` and
    ``save_html(path)`` (a page with a row of segments per worker)."""

    def __init__(self, workers):
        self.workers = workers
        self.rows = [
            {"worker": address, **w["figures"], "largest_live_block": w["largest_live_block"]}
            for address, w in sorted(workers.items())
        ]

    def table(self):
        """The rows as aligned text, one line per worker."""
        columns = ["worker", "manager", "live_bytes", "peak_live_bytes", "held_bytes",
                   "peak_held_bytes", "largest_free_bytes", "largest_live_block", "oom_retries",
                   "ooms"]
        text = [[str(r.get(c)) for c in columns] for r in self.rows]
        widths = [max(len(c), *(len(t[i]) for t in text)) for i, c in enumerate(columns)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
        lines += ["  ".join(v.ljust(w) for v, w in zip(t, widths)) for t in text]
        return "\n".join(lines)

    def to_html(self):
        """A self-contained page: the table, then each worker's segments as bars, blocks
        coloured by state, and its live memory by tag."""
        colour = {"in-use": "#c0392b", "cached": "#e67e22", "free": "#27ae60",
                  "pending-free": "#8e44ad"}
        parts = ["<!doctype html><meta charset=utf-8><title>emm memory report</title>",
                 "<h1>emm memory report</h1>", "<pre>", html.escape(self.table()), "</pre>"]
        for address, w in sorted(self.workers.items()):
            parts.append(f"<h2>{html.escape(address)}</h2><div class=segments>")
            for s in w["segments"]:
                total = max(s["bytes"], 1)
                cells = "".join(
                    f"<span title='{b} bytes, {st}' style='display:inline-block;height:14px;"
                    f"width:{100 * b / total:.3f}%;background:{colour.get(st, '#999')}'></span>"
                    for b, st in s["blocks"]
                )
                parts.append(
                    f"<div class=segment title='{s['bytes']} bytes, {html.escape(s['kind'])}' "
                    f"style='width:100%;border:1px solid #333;margin:2px 0'>{cells}</div>"
                )
            parts.append("</div><ul>")
            for t in w["by_tag"]:
                parts.append(
                    f"<li>{html.escape(t['tag'])}: {t['bytes']} bytes in {t['allocations']} "
                    f"allocations (largest {t['largest']})</li>"
                )
            parts.append("</ul>")
        return "\n".join(parts)

    def save_html(self, path):
        """Writes :meth:`to_html` to ``path``."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_html())


def memory_report(client):
    """Every worker's emm figures, segments and live memory by tag, as a :class:`MemoryReport`
    (a worker without emm set up raises ``emm.EmmError`` there, which this raises)."""
    return MemoryReport(client.run(_worker_report))


# The scheduler's web server: a page of every worker's emm figures. distributed imports the
# modules its config lists (``distributed.scheduler.http.routes``) and serves their ``routes``.

_COLUMNS = ("manager", "live_bytes", "peak_live_bytes", "held_bytes", "peak_held_bytes",
            "largest_free_bytes", "oom_retries", "ooms")


def _scheduler_figures(scheduler):
    """Every worker's ``emm`` metric as the scheduler last heard it, by address."""
    return {
        address: {"name": str(ws.name), **(ws.metrics.get(METRIC) or {})}
        for address, ws in sorted(scheduler.workers.items())
    }


def _page_handlers():
    from distributed.http.utils import RequestHandler

    class EmmPage(RequestHandler):
        """``/emm``: a table of every worker's emm figures, renewed every two seconds."""

        def get(self):
            figures = _scheduler_figures(self.server)
            head = "".join(f"<th>{c}</th>" for c in ("worker", "name", *_COLUMNS))
            rows = "".join(
                "<tr>"
                + f"<td>{html.escape(address)}</td><td>{html.escape(f['name'])}</td>"
                + "".join(
                    f"<td class='{c}'>{html.escape(str(f.get(c, '')))}</td>" for c in _COLUMNS
                )
                + "</tr>"
                for address, f in figures.items()
            )
            self.set_header("Content-Type", "text/html; charset=utf-8")
            self.write(
                "<!doctype html><meta charset=utf-8><meta http-equiv=refresh content=2>"
                "<title>emm: workers' memory</title><h1>emm: workers' memory</h1>"
                f"<table id=emm-workers><tr>{head}</tr>{rows}</table>"
            )

    class EmmJson(RequestHandler):
        """``/emm/figures.json``: the same figures."""

        def get(self):
            self.write(_scheduler_figures(self.server))

    return [(r"emm", EmmPage, {}), (r"emm/figures.json", EmmJson, {})]


def __getattr__(name):
    # ``routes`` is made when distributed asks for it, so that importing emm.dask does not
    # import tornado's handlers where no scheduler runs.
    if name == "routes":
        return _page_handlers()
    raise AttributeError(name)


def enable_dashboard_page():
    """Adds the ``/emm`` page to the web server of schedulers started from now on in this
    process (``LocalCluster``, or ``dask scheduler --preload`` of a module that calls it)."""
    import dask

    routes = list(dask.config.get("distributed.scheduler.http.routes"))
    if __name__ not in routes:
        dask.config.set({"distributed.scheduler.http.routes": [*routes, __name__]})

