"""Tasks ``test_dask.py`` runs on Dask workers: a module that imports only emm and distributed,
so that a worker importing it makes no emm runtime of its own before the plugin does."""

import os

import distributed

import emm


def hold(nbytes):
    """Allocates ``nbytes`` through emm and keeps the buffer on the worker; returns the bytes
    the worker now holds so."""
    worker = distributed.get_worker()
    held = getattr(worker, "held_by_test", None)
    if held is None:
        held = worker.held_by_test = []
    held.append(emm.context(0).memalloc(nbytes))
    return sum(b.size for b in held)


def die(nbytes):
    """Allocates ``nbytes``, then ends the worker's process without a word."""
    emm.context(0).memalloc(nbytes)
    os._exit(1)
