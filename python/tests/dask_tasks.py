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


def make(nbytes, value):
    """A device buffer of ``nbytes`` holding ``value`` in every byte."""
    ctx = emm.context(0)
    buf = ctx.memalloc(nbytes)
    ctx.copy_to_device(buf, bytes([value]) * nbytes)
    return buf


def first_and_last(buf):
    """The first and last bytes of a device buffer (brought back to the device first, where it
    was spilled)."""
    ctx = emm.context(0)
    return ctx.copy_to_host(buf, 1)[0], ctx.copy_to_host(buf, 1, buf.size - 1)[0]


def cupy_filled(nbytes, value):
    """A CuPy array of ``nbytes`` bytes holding ``value``, allocated wherever CuPy allocates in
    this worker (through emm once the plugin installed it)."""
    import cupy

    return cupy.full(nbytes, value, dtype=cupy.uint8)


def torch_filled(nbytes, value):
    """A PyTorch CUDA tensor of ``nbytes`` bytes holding ``value`` (through emm once the plugin
    installed it)."""
    import torch

    return torch.full((nbytes,), value, dtype=torch.uint8, device="cuda")


def gpu_identity():
    """The PCI address of the GPU this worker's CUDA device 0 is (dask-cuda gives each worker
    its own GPU first in ``CUDA_VISIBLE_DEVICES``)."""
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(0)
    return "%04x:%02x:%02x" % (props["pciDomainID"], props["pciBusID"], props["pciDeviceID"])


def total(array):
    """The sum of a CuPy array's or a PyTorch tensor's bytes, as a Python int."""
    return int(array.sum())



def installed_frameworks():
    """The frameworks the plugin installed emm for in this worker."""
    return list(getattr(distributed.get_worker(), "emm_frameworks", []))
