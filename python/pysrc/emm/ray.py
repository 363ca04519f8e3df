"""emm on Ray workers, in one line::

    ray.init(runtime_env={
        "worker_process_setup_hook": "emm.ray.setup",
        "env_vars": {"EMM_MEMORY_MANAGER": "pool", "EMM_RAY_MAXIMUM": "20GiB"},
    })

Ray runs ``setup`` in every worker process before the task or actor it starts there (also per
actor or task, through ``.options(runtime_env=...)``): it makes the process's emm runtime from
the environment and installs emm for the frameworks the worker can import (PyTorch, CuPy,
Numba). The variables:

- ``EMM_MEMORY_MANAGER``, ``EMM_MEMORY_ADAPTORS`` (default ``stats``), ``EMM_PYTHON_DRIVER``,
  ``EMM_SIM_DEVICE_MEMORY``: as for ``emm.configure``;
- ``EMM_RAY_MAXIMUM``: device bytes in use through emm in the worker (the ``limit`` adaptor);
- ``EMM_RAY_FRAMEWORKS``: the frameworks to install emm for, comma-separated (default all
  three, where importable);
- ``EMM_RAY_METRICS_SECONDS``: how often the worker's figures go to Ray's metrics (default 5;
  0 turns them off).

The figures (``emm_live_bytes``, ``emm_peak_live_bytes``, ``emm_held_bytes``,
``emm_largest_free_bytes``, ``emm_oom_retries``, ``emm_ooms``, tagged with the manager) are Ray
gauges (``ray.util.metrics``), which Ray's metrics agent exports where it runs (``ray[default]``).
``figures()`` gives them in the worker itself.
"""

import os
import threading

import emm
from emm._worker import FRAMEWORKS, figures, install

__all__ = ["figures", "setup"]  # figures: emm._worker.figures, this worker's

_GAUGES = {
    "live_bytes": "device bytes live through emm in this worker",
    "peak_live_bytes": "the most device bytes live through emm in this worker",
    "held_bytes": "device bytes emm's manager holds in this worker",
    "largest_free_bytes": "the largest free block emm's manager holds in this worker",
    "oom_retries": "allocations emm tried again after running out of device memory",
    "ooms": "allocations that failed for lack of device memory",
}

#: What ``setup`` did in this process: the frameworks emm was installed for.
installed = []


def setup():
    """Ray's ``worker_process_setup_hook``: emm's runtime from the environment, emm installed
    for the frameworks, and the figures sent to Ray's metrics (see the module's text)."""
    adaptors = [a for a in os.environ.get("EMM_MEMORY_ADAPTORS", "stats").split(",") if a]
    maximum = os.environ.get("EMM_RAY_MAXIMUM")
    if maximum:
        adaptors.append(f"limit={maximum}")
    driver = os.environ.get("EMM_PYTHON_DRIVER", "cuda")
    emm.configure(
        manager=os.environ.get("EMM_MEMORY_MANAGER"),
        adaptors=",".join(adaptors) or None,
        driver=driver,
        sim_memory=os.environ.get("EMM_SIM_DEVICE_MEMORY") if driver == "sim" else None,
    )
    frameworks = os.environ.get("EMM_RAY_FRAMEWORKS")
    wanted = tuple(f for f in frameworks.split(",") if f) if frameworks else FRAMEWORKS
    installed[:] = [f for f in wanted if install(f)]
    seconds = float(os.environ.get("EMM_RAY_METRICS_SECONDS", "5"))
    if seconds > 0:
        _start_metrics(seconds)


def _start_metrics(seconds):
    """Sets Ray gauges to this worker's figures now and every ``seconds``, from a daemon
    thread."""
    from ray.util.metrics import Gauge

    gauges = {
        name: Gauge(f"emm_{name}", description=text, tag_keys=("manager",))
        for name, text in _GAUGES.items()
    }
    stop = threading.Event()

    def publish():
        f = figures()
        for name, gauge in gauges.items():
            if f[name] is not None:
                gauge.set(f[name], tags={"manager": f["manager"]})

    def loop():
        while not stop.wait(seconds):
            publish()

    publish()
    threading.Thread(target=loop, name="emm-ray-metrics", daemon=True).start()
