"""What ``test_ray.py`` runs in Ray's workers: a module that imports only emm and the standard
library (the test pickles its functions by value, so the workers need not import it)."""

import os
import threading

import emm


def worker_state(nbytes):
    """Allocates ``nbytes`` through emm (freed on return) and says how the worker was set up."""
    import emm.ray

    buf = emm.context(0).memalloc(nbytes)
    return {
        "pid": os.getpid(),
        "settings": emm.settings(),
        "manager": emm.context(0).manager,
        "installed": list(emm.ray.installed),
        "live_bytes": emm.ray.figures()["live_bytes"],
        "buffer": buf.size,
        "metrics_thread": any(t.name == "emm-ray-metrics" for t in threading.enumerate()),
    }


class Holder:
    """An actor that keeps what it allocates through emm."""

    def __init__(self):
        self.buffers = []

    def hold(self, nbytes):
        """Allocates ``nbytes`` and keeps it; returns this worker's figures."""
        import emm.ray

        self.buffers.append(emm.context(0).memalloc(nbytes))
        return emm.ray.figures()
